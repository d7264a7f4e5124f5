#include "train/rerun.h"

#include "core/error.h"

#include <bit>
#include <cmath>
#include <cstdio>
#include <sstream>

namespace loom::train {

namespace {

using json = nlohmann::json;

const char * state_name(RerunState s) {
    switch (s) {
        case RerunState::not_running_yet: return "not_running_yet";
        case RerunState::initial_run: return "initial_run";
        case RerunState::rerunning_in_place: return "rerunning_in_place";
        case RerunState::will_rerun_from_checkpoint: return "will_rerun_from_checkpoint";
        case RerunState::rerunning_from_checkpoint: return "rerunning_from_checkpoint";
        case RerunState::rerunning_again_from_checkpoint: return "rerunning_again_from_checkpoint";
    }
    return "?";
}

RerunState state_from_name(const std::string & name) {
    for (RerunState s : {RerunState::not_running_yet, RerunState::initial_run, RerunState::rerunning_in_place,
                         RerunState::will_rerun_from_checkpoint, RerunState::rerunning_from_checkpoint,
                         RerunState::rerunning_again_from_checkpoint}) {
        if (name == state_name(s)) return s;
    }
    LOOM_THROW("the checkpoint's rerun_state_machine has the state '" << name << "'", "the index is damaged");
}

const char * diagnostic_name(RerunDiagnostic d) {
    switch (d) {
        case RerunDiagnostic::correct_result: return "correct_result";
        case RerunDiagnostic::transient_error: return "transient_error";
        case RerunDiagnostic::persistent_error: return "persistent_error";
    }
    return "?";
}

const char * error_title(RerunDiagnostic d) {   // Megatron's _ERROR_NAMES
    switch (d) {
        case RerunDiagnostic::correct_result: return "Expected result";
        case RerunDiagnostic::transient_error: return "Transient error";
        case RerunDiagnostic::persistent_error: return "Persistent error";
    }
    return "?";
}

// A result as JSON keeps NaN and infinities (JSON numbers cannot): its bits.
json result_json(double v) { return std::bit_cast<uint64_t>(v); }
double result_of(const json & j) { return std::bit_cast<double>(j.get<uint64_t>()); }

std::string number(double v) {   // as Python prints a float's NaN and infinities
    if (std::isnan(v)) return "nan";
    if (std::isinf(v)) return v > 0 ? "inf" : "-inf";
    std::ostringstream os;
    os << v;
    return os.str();
}

}  // namespace

RerunMode rerun_mode_from_name(const std::string & name) {
    if (name == "disabled") return RerunMode::disabled;
    if (name == "validate_results") return RerunMode::validate_results;
    if (name == "report_stats") return RerunMode::report_stats;
    LOOM_THROW("argument --rerun-mode: invalid choice: '" << name << "'",
               "choose from 'disabled', 'validate_results', 'report_stats'");
}

RerunDiagnostic rerun_diagnostic_from_name(const std::string & name) {
    for (RerunDiagnostic d :
         {RerunDiagnostic::correct_result, RerunDiagnostic::transient_error, RerunDiagnostic::persistent_error}) {
        if (name == diagnostic_name(d)) return d;
    }
    LOOM_THROW("argument --error-injection-type: invalid choice: '" << name << "'",
               "choose from 'correct_result', 'transient_error', 'persistent_error'");
}

RerunStateMachine::RerunStateMachine(RerunOptions options, int rank, std::string node, int device, uint64_t seed,
                                     ReduceAny reduce_any)
    : options_(options), rank_(rank), device_(device), node_(std::move(node)), draws_(seed),
      reduce_any_(std::move(reduce_any)) {}

void RerunStateMachine::log(const std::string & line, int level) const {
    if (!logging_enabled(level)) return;
    std::fprintf(stderr, "%s: rank %d, node %s, device %d, iteration #%lld: %s\n", level >= kLogError ? "ERROR" : "WARNING",
                 rank_, node_.c_str(), device_, static_cast<long long>(iteration_), line.c_str());
    std::fflush(stderr);
}

RerunStateMachine::Call RerunStateMachine::call_of(const std::string & message) {
    return Call{message, counts_[message]++};
}

// Megatron's draw: (randint(0, rate - 1) + rank) % rate == 0, once per validation call, at most one
// injection followed at a time.
bool RerunStateMachine::maybe_inject() {
    if (options_.injection_rate <= 0 || injected_) return false;
    std::uniform_int_distribution<int64_t> pick(0, options_.injection_rate - 1);
    if ((pick(draws_) + rank_) % options_.injection_rate != 0) return false;
    injected_      = true;
    injected_type_ = options_.injection_type;
    log(std::string("Injecting error type ") + error_title(injected_type_));
    return true;
}

// Megatron's _compare_floats: 0 for the same value (NaN and NaN included), infinity where one is NaN or
// infinite and the other not, else the difference relative to the mean.
double RerunStateMachine::compare(double a, double b) {
    if (injected_) {   // RerunErrorInjector.maybe_miscompare
        if (state_ == RerunState::rerunning_in_place) {
            if (injected_type_ == RerunDiagnostic::transient_error) {
                injected_ = false;
                return INFINITY;
            }
            return 0.0;
        }
        injected_ = false;
        return injected_type_ == RerunDiagnostic::persistent_error ? INFINITY : 0.0;
    }
    if (a == b || (std::isnan(a) && std::isnan(b))) return 0.0;
    if (std::isnan(a) != std::isnan(b) || std::isinf(a) != std::isinf(b) || std::isnan(a) || std::isinf(a)) {
        return INFINITY;
    }
    return std::fabs((a - b) / (a + b) * 2.0);
}

bool RerunStateMachine::should_run_forward_backward() {
    counts_.clear();
    switch (state_) {
        case RerunState::not_running_yet:
            rerun_requested_ = checkpoint_requested_ = restart_again_requested_ = continue_requested_ = false;
            state_ = RerunState::initial_run;
            return true;
        case RerunState::initial_run: {
            if (options_.mode == RerunMode::disabled || !reduce_any_({rerun_requested_})[0]) {
                state_ = RerunState::not_running_yet;
                return false;
            }
            if (options_.mode == RerunMode::validate_results && rank_ == 0) {
                log("Need to rerun step to check reproducibility of initial result");
            }
            state_ = RerunState::rerunning_in_place;
            return true;
        }
        case RerunState::rerunning_in_place: {
            if (options_.mode == RerunMode::report_stats) {
                state_ = RerunState::not_running_yet;
                saved_results_.clear();
                return false;
            }
            const std::vector<bool> any = reduce_any_({continue_requested_, checkpoint_requested_});
            if (any[0]) {
                if (rank_ == 0) log("Continuing normal execution because failed validation was not fatal");
                state_ = RerunState::not_running_yet;
            } else if (any[1]) {
                state_ = RerunState::will_rerun_from_checkpoint;
            }
            return false;
        }
        case RerunState::will_rerun_from_checkpoint:
            state_ = RerunState::rerunning_from_checkpoint;
            return true;
        case RerunState::rerunning_from_checkpoint: {
            const std::vector<bool> any = reduce_any_({restart_again_requested_, continue_requested_});
            if (any[0]) {
                if (rank_ == 0) {
                    log("Need to restart job from the same checkpoint because it was scheduled on the same node/GPU");
                }
                state_ = RerunState::rerunning_again_from_checkpoint;
            } else if (any[1]) {
                state_ = RerunState::not_running_yet;
            }
            return false;
        }
        case RerunState::rerunning_again_from_checkpoint: break;
    }
    LOOM_THROW("the rerun state machine was asked to run in state " << state_name(state_), "");
}

void RerunStateMachine::validate_result(double result, bool rejected, const std::string & message) {
    const Call call = call_of(message);
    if (options_.mode == RerunMode::report_stats) {
        const std::string key = message + " #" + std::to_string(call.sequence);
        if (state_ == RerunState::initial_run) {
            rerun_requested_     = true;
            saved_results_[key] = result;
        } else if (state_ == RerunState::rerunning_in_place && saved_results_.count(key)) {
            double & worst = worst_difference_[message];
            worst          = std::max(worst, compare(saved_results_[key], result));
        }
        return;
    }
    if (state_ == RerunState::initial_run && !rerun_requested_) {
        // Not on the run's first iteration: a checkpoint cannot be taken before the optimizer has stepped.
        if (!first_iteration_complete_) return;
        if (maybe_inject() || rejected) {
            failed_          = call;
            initial_result_  = result;
            rerun_requested_ = true;
            log("Unexpected result " + number(result) + " on rank " + std::to_string(rank_) + " invocation #" +
                    std::to_string(call.sequence) + " (message='" + message + "')",
                kLogError);
        }
        return;
    }
    if (!(call == failed_)) return;
    if (state_ == RerunState::rerunning_in_place) {
        const double difference = compare(initial_result_, result);
        if (difference > 0.0) {
            log("First rerun: unexpected result is not reproducible within the tolerance (" + number(result) +
                    " != " + number(initial_result_) + ")!",
                kLogError);
            log("Possible transient error!", kLogError);
        } else {
            checkpoint_requested_ = true;
            suspicious_node_      = node_;
            suspicious_device_    = device_;
            log("First rerun: unexpected result is reproducible within the tolerance (" + number(result) + " = " +
                    number(initial_result_) + "). Need to rerun on a different GPU to verify correctness.",
                kLogError);
        }
    } else if (state_ == RerunState::rerunning_from_checkpoint) {
        if (node_ == suspicious_node_ && device_ == suspicious_device_) {
            log("Got rescheduled on the same GPU. Need to resume again from the same checkpoint (node: " +
                    suspicious_node_ + ", gpu: " + std::to_string(suspicious_device_) + ")",
                kLogError);
            restart_again_requested_ = true;
        } else if (compare(initial_result_, result) > 0.0) {
            log("Second rerun: unexpected result is not reproducible on a different GPU, therefore was likely "
                "incorrect (" + number(result) + " != " + number(initial_result_) + ")");
            log("Possible persistent error!", kLogError);
        } else {
            log("Second rerun: unexpected result is reproducible on a different GPU, therefore it was likely "
                "correct (" + number(result) + " = " + number(initial_result_) + ")");
            log("Correct result (but possible Application error) (" + message + ")!", kLogError);
        }
    }
}

RerunStateMachine::Decision RerunStateMachine::should_checkpoint_and_exit() {
    first_iteration_complete_ = true;
    if (options_.mode != RerunMode::validate_results) return {};
    switch (state_) {
        case RerunState::rerunning_in_place:
            return {false, true, kExitFailedOnResultValidation,
                    "Exiting now. The job can be resumed from a previous checkpoint"};
        case RerunState::will_rerun_from_checkpoint:
            return {true, true, kExitResumeToDisambiguate,
                    "Saving a checkpoint and exiting now. Please resume the job from the checkpoint to rerun the "
                    "last iteration and establish a diagnostic"};
        case RerunState::rerunning_from_checkpoint:
            return {false, true, kExitFailedOnResultValidation,
                    "Exiting now. A checkpoint at the last iteration already exists if further examination is needed"};
        case RerunState::rerunning_again_from_checkpoint:
            return {false, true, kExitResumeToDisambiguate,
                    "Exiting now. Please resume the job from the same checkpoint to rerun the last iteration and "
                    "establish a diagnostic"};
        default: return {};
    }
}

json RerunStateMachine::state_dict() const {
    if (options_.mode == RerunMode::disabled || state_ == RerunState::not_running_yet) return nullptr;
    return {{"mode", options_.mode == RerunMode::validate_results ? "validate_results" : "report_stats"},
            {"state", state_name(state_)},
            {"failed_validation_call", {{"message", failed_.message}, {"sequence", failed_.sequence}}},
            {"initial_result_bits", result_json(initial_result_)},
            {"suspicious_node", suspicious_node_},
            {"suspicious_device", suspicious_device_},
            {"injected_error_type", injected_ ? json(diagnostic_name(injected_type_)) : json(nullptr)}};
}

void RerunStateMachine::load_state_dict(const json & state) {
    if (state.is_null()) return;
    if (options_.mode == RerunMode::disabled) {
        if (rank_ == 0) log("RerunStateMachine disabled via CLI, ignoring machine state saved in checkpoint");
        return;
    }
    try {
        state_ = state_from_name(state.at("state").get<std::string>());
        if (state_ == RerunState::not_running_yet) return;
        const json & sequence = state.at("failed_validation_call").at("sequence");
        const json & device   = state.at("suspicious_device");
        const json & bits     = state.at("initial_result_bits");
        LOOM_CHECK(sequence.is_number_integer() && device.is_number_integer() && bits.is_number_unsigned() &&
                       device.get<int64_t>() >= -1 && device.get<int64_t>() < (int64_t(1) << 20),
                   "the checkpoint's rerun_state_machine holds a sequence, device or result that is not an integer",
                   "the index is damaged");
        failed_            = Call{state.at("failed_validation_call").at("message").get<std::string>(), sequence.get<int64_t>()};
        initial_result_    = result_of(bits);
        suspicious_node_   = state.at("suspicious_node").get<std::string>();
        suspicious_device_ = static_cast<int>(device.get<int64_t>());
        const json & injected = state.at("injected_error_type");
        injected_             = !injected.is_null();
        if (injected_) injected_type_ = rerun_diagnostic_from_name(injected.get<std::string>());
    } catch (const json::exception & e) {
        LOOM_THROW("the checkpoint's rerun_state_machine is malformed: " << e.what(), "the index is damaged");
    }
}

std::string RerunStateMachine::take_stats_report() {
    if (options_.mode != RerunMode::report_stats || iteration_ % 100 != 0 || worst_difference_.empty()) return "";
    std::string report = "Stats on computation determinism in validation calls (rank " + std::to_string(rank_) + ")";
    for (const auto & [message, worst] : worst_difference_) {
        report += "\n  From validation call '" + message + "': largest relative difference " + number(worst);
    }
    worst_difference_.clear();
    return report;
}

}  // namespace loom::train
