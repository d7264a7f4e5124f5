#include "train/stop_policy.h"

#include <atomic>

namespace loom::train {

namespace {

std::atomic<bool> g_sigterm{false};

extern "C" void on_sigterm(int) { g_sigterm.store(true); }

}  // namespace

StopPolicy::StopPolicy(const TrainOptions & options, comm::Communicator * everyone, Device & device)
    : options_(options), everyone_(everyone), device_(device) {
    if (!options_.exit_signal_handler) return;
    struct sigaction action {};
    action.sa_handler = on_sigterm;
    sigemptyset(&action.sa_mask);
    sigaction(SIGTERM, &action, &previous_);
}

StopPolicy::~StopPolicy() {
    if (options_.exit_signal_handler) sigaction(SIGTERM, &previous_, nullptr);
}

bool StopPolicy::any_rank(bool local) {
    if (!everyone_ || everyone_->size() == 1) return local;
    return comm::all_reduce_values(*everyone_, device_, {local ? 1.0f : 0.0f}, comm::ReduceOp::max)[0] > 0.0f;
}

std::string StopPolicy::after(int64_t iteration, double seconds, bool output_failed) {
    // Outputs fail where they are written (the console on rank 0, the files there): checked when a log
    // line has just been written, so every rank asks at the same iterations.
    const bool logged = iteration % options_.log_interval == 0 || iteration == options_.train_iters;
    if (logged && any_rank(output_failed)) return kOutputFailed;
    if (options_.exit_signal_handler && any_rank(g_sigterm.load())) return "SIGTERM";
    if (options_.exit_duration_in_mins > 0 && any_rank(seconds / 60.0 > options_.exit_duration_in_mins)) {
        return "--exit-duration-in-mins";
    }
    if (options_.exit_interval > 0 && iteration % options_.exit_interval == 0) return "--exit-interval";
    return "";
}

}  // namespace loom::train
