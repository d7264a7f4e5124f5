// When a training run stops before --train-iters: a failed output stream (a log iteration's check, on
// every run), then Megatron's checks after each iteration, in its order — the --exit-signal (SIGTERM by
// default, with --exit-signal-handler), --exit-duration-in-mins, then --exit-interval. The ranks agree: a condition any
// rank sees stops all of them after the same iteration (one all-reduce per check that one rank alone sees).
#pragma once

#include "comm/communicator.h"
#include "train/options.h"

#include <csignal>
#include <string>

namespace loom::train {

// The number of the signal --exit-signal names (Python's signal.Signals names); throws naming the flag for
// an unknown name, and for SIGKILL and SIGSTOP, which no process can catch.
int exit_signal_number(const std::string & name);

class StopPolicy {
public:
    // `everyone`: the group of all ranks (null on one rank). Installs the --exit-signal's handler with
    // --exit-signal-handler; the destructor restores the previous one.
    StopPolicy(const TrainOptions & options, comm::Communicator * everyone, Device & device);
    ~StopPolicy();
    StopPolicy(const StopPolicy &)             = delete;
    StopPolicy & operator=(const StopPolicy &) = delete;

    // After iteration `iteration`, `seconds` into the run, `output_failed` when one of this rank's output
    // streams could not be written: "" to go on, else the reason to stop (kOutputFailed, the signal's name,
    // "--exit-duration-in-mins", "--exit-interval"). Collective at log iterations (--log-interval and the
    // last) and where the signal and duration checks apply.
    std::string after(int64_t iteration, double seconds, bool output_failed = false);

    static constexpr const char * kOutputFailed = "an output stream failed";

private:
    bool any_rank(bool local);

    const TrainOptions & options_;
    comm::Communicator * everyone_;
    Device &             device_;
    int                  signal_ = SIGTERM;
    struct sigaction     previous_ {};
};

}  // namespace loom::train
