// The rerun state machine (Megatron's megatron/core/rerun_state_machine.py, --rerun-mode): when a validated
// result of an iteration is rejected, the iteration's forward and backward run again before the optimizer
// steps, to tell a transient fault (the rerun differs) from a reproducible result (a persistent fault of the
// device, or a correct result of a bad run, told apart by a third run on another device).
//
// The results Loom validates are Megatron's loss_func checks, with --check-for-nan-in-loss-and-grad (the
// default): each micro-batch's loss, "found NaN in local forward loss calculation" and "found Inf in local
// forward loss calculation", compared exactly on a rerun (Loom's forward is deterministic). The gradient
// norm's NaN check stays the optimizer's (an error, exit 1).
//
// --rerun-mode validate_results (Megatron's default), iteration k (not the run's first: no checkpoint can
// be taken before a step):
//   a result rejected on any rank               every rank reruns k in place (same batch, same weights)
//   the rerun differs                           "Possible transient error!": exit 17, no checkpoint
//   the rerun reproduces it                     a checkpoint of iteration k - 1 holding the machine's state
//                                               (with --save), then exit 16: resume on another device
//   resumed from that checkpoint                k runs once more and is compared with the first result:
//     on the same node and device               exit 16 again (resume elsewhere)
//     differs                                   "Possible persistent error!": exit 17
//     reproduces                                "Correct result (but possible Application error)": exit 17
// --rerun-mode disabled: a rejected result ends the run (exit 1), as before; --rerun-mode report_stats:
// every iteration runs twice and the largest relative difference of each validated result is reported
// every 100 iterations.
//
// --error-injection-rate N (> 0) rejects one validation call in N at random (per rank, Megatron's draw), and
// --error-injection-type sets what the reruns then see: transient_error (the first rerun differs),
// persistent_error (the first rerun reproduces, the rerun from the checkpoint differs), correct_result
// (both reproduce). LOOM_RERUN_NODE names the node in place of the host name (a test seam: "another node"
// on one machine).
#pragma once

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <cstdint>
#include <functional>
#include <map>
#include <random>
#include <string>
#include <vector>

namespace loom::train {

enum class RerunMode { disabled, validate_results, report_stats };
enum class RerunDiagnostic { correct_result, transient_error, persistent_error };
enum class RerunState {
    not_running_yet,
    initial_run,
    rerunning_in_place,
    will_rerun_from_checkpoint,
    rerunning_from_checkpoint,
    rerunning_again_from_checkpoint,
};

RerunMode       rerun_mode_from_name(const std::string & name);         // throws naming --rerun-mode
RerunDiagnostic rerun_diagnostic_from_name(const std::string & name);   // throws naming --error-injection-type

inline constexpr int kExitResumeToDisambiguate    = 16;   // Megatron's EXIT_CODE_RESUME_TO_DISAMBIGUATE
inline constexpr int kExitFailedOnResultValidation = 17;  // Megatron's EXIT_CODE_FAILED_ON_RESULT_VALIDATION

struct RerunOptions {
    RerunMode       mode           = RerunMode::validate_results;
    int64_t         injection_rate = 0;
    RerunDiagnostic injection_type = RerunDiagnostic::transient_error;
};

// Every rank throws it together (the decision is reduced over the world): the job ends with `code`.
class RerunExit : public RunError {
public:
    RerunExit(int code, const std::string & why) : RunError(why, "", __FILE__, __LINE__), code_(code) {}
    int code() const { return code_; }

private:
    int code_;
};

class RerunStateMachine {
public:
    // reduce_any: each flag OR-ed over every rank (a collective; the identity on one rank). node and device
    // identify where this rank runs; seed draws the injected errors.
    using ReduceAny = std::function<std::vector<bool>(std::vector<bool>)>;
    RerunStateMachine(RerunOptions options, int rank, std::string node, int device, uint64_t seed, ReduceAny reduce_any);

    // The loop of an iteration: while (m.should_run_forward_backward()) { reset; forward and backward }
    // The caller rewinds the data and zeroes the gradients before every run but the first.
    bool should_run_forward_backward();
    // One validated result of this run of the iteration, in the same order on every run; `rejected` is the
    // rejection test's answer (NaN, Inf).
    void validate_result(double result, bool rejected, const std::string & message);

    struct Decision {
        bool        checkpoint = false;   // save iteration k - 1 with state_dict()
        bool        exit       = false;
        int         code       = 0;
        std::string why;
    };
    // After the loop, before the optimizer steps.
    Decision should_checkpoint_and_exit();

    // What a checkpoint carries (null when nothing is pending) and what a resumed run restores.
    nlohmann::json state_dict() const;
    void           load_state_dict(const nlohmann::json & state);

    // The training iteration about to run (for the log lines and report_stats' interval).
    void       set_iteration(int64_t iteration) { iteration_ = iteration; }
    RerunState state() const { return state_; }
    RerunMode  mode() const { return options_.mode; }
    // report_stats: every 100 iterations, each validation call's largest relative difference (else "").
    std::string take_stats_report();

private:
    struct Call {
        std::string message;
        int64_t     sequence = 0;
        bool        operator==(const Call & o) const { return message == o.message && sequence == o.sequence; }
    };
    Call   call_of(const std::string & message);
    bool   maybe_inject();
    double compare(double initial, double result);
    // Megatron logs each line at a level (its logger.warning or .error): shown by --logging-level.
    void log(const std::string & line, int level = kLogWarning) const;

    RerunOptions                   options_;
    int                            rank_ = 0, device_ = 0;
    std::string                    node_;
    std::mt19937_64                draws_;
    ReduceAny                      reduce_any_;
    RerunState                     state_ = RerunState::not_running_yet;
    int64_t                        iteration_ = 0;
    bool                           first_iteration_complete_ = false;
    bool                           rerun_requested_ = false, checkpoint_requested_ = false;
    bool                           restart_again_requested_ = false, continue_requested_ = false;
    std::map<std::string, int64_t> counts_;   // validation calls of each message in this run of the iteration
    Call                           failed_;
    double                         initial_result_ = 0;
    std::string                    suspicious_node_;
    int                            suspicious_device_ = -1;
    bool                           injected_ = false;   // an injected error is being followed
    RerunDiagnostic                injected_type_ = RerunDiagnostic::transient_error;
    std::map<std::string, double>  saved_results_, worst_difference_;   // report_stats
};

}  // namespace loom::train
