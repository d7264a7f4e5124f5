#include "train/stop_policy.h"

#include "core/error.h"

#include <atomic>

namespace loom::train {

namespace {

std::atomic<bool> g_exit_signal{false};

extern "C" void on_exit_signal(int) { g_exit_signal.store(true); }

}  // namespace

int exit_signal_number(const std::string & name) {
    // Python's signal.Signals on Linux, by name (Megatron reads the flag as signal.Signals[name]).
    static const std::pair<const char *, int> kSignals[] = {
        {"SIGHUP", SIGHUP},       {"SIGINT", SIGINT},       {"SIGQUIT", SIGQUIT},     {"SIGILL", SIGILL},
        {"SIGTRAP", SIGTRAP},     {"SIGABRT", SIGABRT},     {"SIGIOT", SIGIOT},       {"SIGBUS", SIGBUS},
        {"SIGFPE", SIGFPE},       {"SIGKILL", SIGKILL},     {"SIGUSR1", SIGUSR1},     {"SIGSEGV", SIGSEGV},
        {"SIGUSR2", SIGUSR2},     {"SIGPIPE", SIGPIPE},     {"SIGALRM", SIGALRM},     {"SIGTERM", SIGTERM},
        {"SIGSTKFLT", SIGSTKFLT}, {"SIGCHLD", SIGCHLD},     {"SIGCONT", SIGCONT},     {"SIGSTOP", SIGSTOP},
        {"SIGTSTP", SIGTSTP},     {"SIGTTIN", SIGTTIN},     {"SIGTTOU", SIGTTOU},     {"SIGURG", SIGURG},
        {"SIGXCPU", SIGXCPU},     {"SIGXFSZ", SIGXFSZ},     {"SIGVTALRM", SIGVTALRM}, {"SIGPROF", SIGPROF},
        {"SIGWINCH", SIGWINCH},   {"SIGIO", SIGIO},         {"SIGPOLL", SIGPOLL},     {"SIGPWR", SIGPWR},
        {"SIGSYS", SIGSYS},       {"SIGRTMIN", SIGRTMIN},   {"SIGRTMAX", SIGRTMAX},
    };
    for (const auto & [n, number] : kSignals) {
        if (name != n) continue;
        LOOM_CHECK(number != SIGKILL && number != SIGSTOP, "--exit-signal " << name << " cannot be caught by a process",
                   "give a signal a process can handle: SIGTERM (the default), SIGUSR1 or SIGUSR2");
        return number;
    }
    LOOM_THROW("--exit-signal '" << name << "' is not a signal's name",
               "give a name of Python's signal.Signals: SIGTERM (the default), SIGUSR1, SIGUSR2, SIGINT, ...");
}

StopPolicy::StopPolicy(const TrainOptions & options, comm::Communicator * everyone, Device & device)
    : options_(options), everyone_(everyone), device_(device) {
    if (!options_.exit_signal_handler) return;
    signal_ = exit_signal_number(options_.exit_signal);
    struct sigaction action {};
    action.sa_handler = on_exit_signal;
    sigemptyset(&action.sa_mask);
    sigaction(signal_, &action, &previous_);
}

StopPolicy::~StopPolicy() {
    if (options_.exit_signal_handler) sigaction(signal_, &previous_, nullptr);
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
    if (options_.exit_signal_handler && any_rank(g_exit_signal.load())) return options_.exit_signal;
    if (options_.exit_duration_in_mins > 0 && any_rank(seconds / 60.0 > options_.exit_duration_in_mins)) {
        return "--exit-duration-in-mins";
    }
    if (options_.exit_interval > 0 && iteration % options_.exit_interval == 0) return "--exit-interval";
    return "";
}

}  // namespace loom::train
