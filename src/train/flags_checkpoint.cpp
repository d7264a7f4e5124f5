// --save, --load and the exit flags: Megatron's spellings and defaults (train/checkpointing.h).
#include "core/error.h"
#include "train/flag_values.h"
#include "train/checkpointing.h"
#include "train/rerun.h"
#include "train/options.h"
#include "train/stop_policy.h"

#include <cmath>
#include <cstdio>

namespace loom::train {

namespace {

using O = TrainOptions;

constexpr const char * kCkpt = "checkpointing";

const Flag<TrainOptions> kCheckpointFlags[] = {
    {"--save", kCkpt, &O::save, "folder to save checkpoints to (DIR/iter_XXXXXXX)"},
    {"--load", kCkpt, &O::load, "folder to resume from (its latest_checkpointed_iteration.txt, or --ckpt-step)"},
    {"--async-save", kCkpt, &O::async_save,
     "copy each checkpoint into host memory and write it on a thread while training goes on; the tracker moves "
     "once every rank's part is written (checked each iteration), so a kill leaves the last complete one"},
    {"--log-progress", "logging", &O::log_progress,
     "append the job's start, each save (with its throughput and operations so far) and each retired checkpoint to "
     "progress.txt in the --save folder"},
    {"--save-interval", kCkpt, &O::save_interval, "iterations between checkpoints (and one at the end)"},
    {"--save-retain-interval", kCkpt, &O::save_retain_interval,
     "keep the checkpoints of iterations that are multiples of this, and the latest; each save removes the one "
     "before it otherwise (a multiple of --save-interval)"},
    {"--no-save-optim", kCkpt, &O::no_save_optim, "save the parameters only"},
    {"--no-load-optim", kCkpt, &O::no_load_optim, "load the parameters only; the optimizer starts afresh"},
    {"--no-load-rng", kCkpt, &O::no_load_rng, "do not load the random state (Loom keeps none after initialisation)"},
    {"--finetune", kCkpt, &O::finetune, "load the parameters only and start from iteration 0"},
    {"--ckpt-step", kCkpt, &O::ckpt_step, "load this iteration instead of the latest"},
    {"--ckpt-format", kCkpt, &O::ckpt_format,
     "torch_dist, torch, torch_dcp or fsdp_dtensor: Loom writes its own reshardable format (Megatron's folder "
     "layout, sharded safetensors) for each, and says so for the others", kShowDefault},
    {"--use-checkpoint-args", kCkpt, &O::use_checkpoint_args, "take the model's shape from the --load checkpoint"},
    {"--dist-ckpt-strictness", kCkpt, &O::dist_ckpt_strictness,
     "a --load's handling of the model's tensors the checkpoint lacks (unexpected) and the checkpoint's the model "
     "does not use (missing): assume_ok_unexpected (an error names the first unexpected), log_unexpected, log_all, "
     "raise_unexpected, raise_all, return_unexpected, return_all (logged as log_*), ignore_all; unexpected tensors "
     "keep their initial values", kShowDefault},
    {"--override-opt_param-scheduler,--override-opt-param-scheduler", "learning rate", &O::override_opt_param_scheduler,
     "on --load, take the schedule (learning rates, warmup, decay, weight decay) from the flags, not the checkpoint"},
    {"--use-checkpoint-opt_param-scheduler,--use-checkpoint-opt-param-scheduler", "learning rate",
     &O::use_checkpoint_opt_param_scheduler,
     "on --load, take the schedule (learning rates, warmup, decay, weight decay) from the checkpoint, not the flags"},
    {"--exit-on-missing-checkpoint", kCkpt, &O::exit_on_missing_checkpoint,
     "stop with an error when --load holds no checkpoint (default: a warning, then train from scratch)"},
    {"--rerun-mode", "training", &O::rerun_mode,
     "validate_results: rerun an iteration whose loss is NaN or Inf, to tell a transient fault (exit 17) from a "
     "reproducible result (a checkpoint, then exit 16 to rerun on another device); disabled: such a loss ends the "
     "run; report_stats: run every iteration twice and report the differences", kShowDefault},
    {"--error-injection-rate", "training", &O::error_injection_rate,
     "reject one validated result in this many, at random (0: never), to test --rerun-mode", kShowDefault},
    {"--error-injection-type", "training", &O::error_injection_type,
     "what the reruns of an injected result see: correct_result, transient_error or persistent_error", kShowDefault},
    {"--exit-interval", "training", &O::exit_interval, "stop (after saving) when the iteration is a multiple of this"},
    {"--exit-duration-in-mins", "training", &O::exit_duration_in_mins, "stop (after saving) after this many minutes"},
    {"--exit-signal-handler", "training", &O::exit_signal_handler,
     "on the --exit-signal, finish the iteration, save and exit 0"},
    {"--exit-signal", "training", &O::exit_signal,
     "the signal --exit-signal-handler acts on, by name (SIGTERM, SIGUSR1, ...); mpirun forwards SIGUSR1 and SIGUSR2 "
     "to the ranks, while a SIGTERM sent to mpirun ends the job itself", kShowDefault},
};

}  // namespace

std::span<const Flag<TrainOptions>> checkpoint_flags() { return kCheckpointFlags; }

void validate_checkpoint_flags(const TrainOptions & o, const Given & given) {
    LOOM_CHECK(o.ckpt_format == "torch_dist" || o.ckpt_format == "torch" || o.ckpt_format == "torch_dcp" ||
                   o.ckpt_format == "fsdp_dtensor",
               "--ckpt-format " << o.ckpt_format << " is not supported by Loom",
               "Loom writes one format, sharded safetensors in parameter space that reshard across DP, TP and PP, "
               "under the names torch_dist (Megatron's default), torch, torch_dcp and fsdp_dtensor");
    if (o.ckpt_format != "torch_dist" && process_rank() <= 0) {
        std::fprintf(stderr, "WARNING: --ckpt-format %s: Loom writes and reads its own format (Megatron's folders, "
                             "sharded safetensors inside) whatever the format's name; it reshards across layouts\n",
                     o.ckpt_format.c_str());
    }
    LOOM_CHECK(!given("--save-interval") || o.save_interval >= 1, "--save-interval must be >= 1, got " << o.save_interval, "");
    if (given("--save-retain-interval")) {   // Megatron's asserts
        LOOM_CHECK(o.save_retain_interval >= 1, "--save-retain-interval must be >= 1, got " << o.save_retain_interval, "");
        LOOM_CHECK(o.save_interval >= 1 && o.save_retain_interval % o.save_interval == 0,
                   "--save-retain-interval " << o.save_retain_interval << " is not a multiple of --save-interval "
                                             << o.save_interval,
                   "the retained checkpoints are some of the saved ones: give a multiple of --save-interval");
    }
    LOOM_CHECK(!given("--exit-interval") || o.exit_interval >= 1, "--exit-interval must be >= 1, got " << o.exit_interval, "");
    LOOM_CHECK(std::isfinite(o.exit_duration_in_mins) && o.exit_duration_in_mins >= 0,
               "--exit-duration-in-mins must be a finite number >= 0, got " << o.exit_duration_in_mins, "");
    exit_signal_number(o.exit_signal);   // throws naming --exit-signal
    LOOM_CHECK(!given("--ckpt-step") || o.ckpt_step >= 0, "--ckpt-step must be >= 0, got " << o.ckpt_step, "");
    LOOM_CHECK(o.ckpt_step < 0 || !o.load.empty(), "--ckpt-step " << o.ckpt_step << " without --load",
               "give the folder to load from with --load");
    LOOM_CHECK(!o.use_checkpoint_args || !o.load.empty(), "--use-checkpoint-args without --load",
               "give the folder to load from with --load");
    strictness_from_name(o.dist_ckpt_strictness);   // throws naming --dist-ckpt-strictness
    rerun_mode_from_name(o.rerun_mode);
    rerun_diagnostic_from_name(o.error_injection_type);
    LOOM_CHECK(o.error_injection_rate >= 0, "--error-injection-rate must be >= 0, got " << o.error_injection_rate, "");
    // Megatron's OptimizerParamScheduler asserts the same.
    LOOM_CHECK(!o.override_opt_param_scheduler || !o.use_checkpoint_opt_param_scheduler,
               "--override-opt_param-scheduler with --use-checkpoint-opt_param-scheduler",
               "give one: the first takes the schedule from the flags, the second from the checkpoint");
}

}  // namespace loom::train
