#include "core/fault_injection.h"

#include "core/error.h"
#include "core/input_file.h"

#include <chrono>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <new>
#include <string>
#include <thread>

namespace loom {

FaultAction inject_fault(int64_t iteration) {
    static const char * spec = std::getenv("LOOM_FAULT");
    if (!spec) return FaultAction::none;
    int  rank = -1;
    long at   = -1;
    char fault[32] = {};
    if (std::sscanf(spec, "%d:%ld:%31s", &rank, &at, fault) != 3 || rank != process_rank() || at != iteration) return FaultAction::none;
    const std::string kind = fault;
    if (kind == "bad_alloc") throw std::bad_alloc();
    if (kind == "missing_file") open_input_fd("/nonexistent/loom-fault-injection.bin", "injected fault");
    if (kind == "sigstop") std::raise(SIGSTOP);
    if (kind == "stall") {
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
    if (kind == "diverge") return FaultAction::extra_collective;
    if (kind == "diverge_op") return FaultAction::other_reduction;
    if (kind == "perturb_param") return FaultAction::perturb_param;
    if (kind == "diverge_send") return FaultAction::extra_transfer;
    return FaultAction::none;
}

}  // namespace loom
