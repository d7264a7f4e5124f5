// The log line, TensorBoard (train/tensorboard.h), validation, and the run's other outputs and device.
#include "core/error.h"
#include "train/flag_table.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <algorithm>
#include <cstdlib>
#include <cstdio>
#include <filesystem>

namespace loom::train {

namespace {

using O = TrainOptions;

constexpr const char * kLog = "logging";

const Flag<TrainOptions> kLoggingFlags[] = {
    {"--print-layout", kLoomGroup, &O::print_layout, "print the DDP buffer layout (as `loom layout`) on rank 0"},
    {"--device", kLoomGroup, &O::device,
     "where the model trains: cpu, cuda (one GPU per rank, NCCL between ranks), cuda-emu (the CUDA "
     "backend on an emulated GPU that runs on the CPU), or auto: cuda when this build has the CUDA "
     "backend and a GPU is visible, else cpu", kShowDefault},
    {"--timeline", kLoomGroup, &O::timeline_file,
     "write the last iteration's measured pipeline timeline (one row per stage) as an SVG"},
    {"--log-interval", kLog, &O::log_interval, "iterations between log lines", kShowDefault},
    {"--logging-level", kLog, &O::logging_level,
     "Python's logging level of the messages Megatron logs (the rerun state machine's warnings, 30, and errors, "
     "40); default MEGATRON_LOGGING_LEVEL, else 20"},
    {"--log-file", kLoomGroup, &O::log_file, "write the logged metrics as JSON lines to this file"},
    {"--log-throughput", kLog, &O::log_throughput, "add the achieved TFLOP/s to the log line"},
    {"--wandb-project", kLog, &O::wandb_project,
     "accepted with a warning: Loom has no W&B client; the scalars go to --tensorboard-dir and --log-file"},
    {"--wandb-entity", kLog, &O::wandb_entity, "accepted with --wandb-project's warning"},
    {"--wandb-exp-name", kLog, &O::wandb_exp_name, "accepted with --wandb-project's warning"},
    {"--wandb-save-dir", kLog, &O::wandb_save_dir, "accepted with --wandb-project's warning"},
    {"--tensorboard-dir", kLog, &O::tensorboard_dir, "write TensorBoard event files here (rank 0)"},
    {"--tensorboard-log-interval", kLog, &O::tensorboard_log_interval, "iterations between TensorBoard scalars",
     kShowDefault},
    {"--tensorboard-queue-size", kLog, &O::tensorboard_queue_size,
     "accepted; Loom flushes the event file at every logged iteration", kShowDefault},
    {"--log-timers-to-tensorboard", kLog, &O::log_timers_to_tensorboard, "iteration-time to TensorBoard"},
    {"--log-memory-to-tensorboard", kLog, &O::log_memory_to_tensorboard,
     "the device allocator's bytes to TensorBoard (mem-reserved-bytes, mem-allocated-bytes, ...)"},
    {"--log-validation-ppl-to-tensorboard", kLog, &O::log_validation_ppl_to_tensorboard,
     "the validation perplexity to TensorBoard as well"},
    {"--no-log-loss-scale-to-tensorboard", kLog, &O::log_loss_scale_to_tensorboard, "leave loss-scale out of TensorBoard",
     kNegated},
    {"--log-world-size-to-tensorboard", kLog, &O::log_world_size_to_tensorboard, "world-size to TensorBoard"},
    {"--log-params-norm", kLog, &O::log_params_norm, "the parameters' L2 norm in the log line"},
    {"--timing-log-level", kLog, &O::timing_log_level,
     "0: no timers; 1 and 2: forward-backward, all-grads-sync and optimizer times, (min, max) over ranks, "
     "after each log line", kShowDefault},
    {"--timing-log-option", kLog, &O::timing_log_option,
     "how the timers block reports the ranks' times: max, minmax (the least and the most) or all (every rank's)",
     kShowDefault},
    {"--log-num-zeros-in-grad", kLog, &O::log_num_zeros_in_grad, "the gradients' zero count in the log line"},
    {"--profile", "training", &O::profile,
     "a Chrome trace (chrome://tracing, ui.perfetto.dev) of every stream's work from --profile-step-start to "
     "--profile-step-end, per rank, to --tensorboard-dir (else --save, else .) as loom_profile_rank<R>.json"},
    {"--profile-step-start", "training", &O::profile_step_start, "completed iterations before the profile starts",
     kShowDefault},
    {"--profile-step-end", "training", &O::profile_step_end, "completed iterations when it ends", kShowDefault},
    {"--profile-ranks", "training", &O::profile_ranks, "global ranks to profile (default: every rank)", kList},
    {"--use-pytorch-profiler", "training", &O::use_pytorch_profiler,
     "accepted: Loom's own trace is written either way (there is no PyTorch here)"},
    {"--eval-interval", "validation", &O::eval_interval,
     "iterations between validations (and one after training); without it, none"},
    {"--eval-global-batch-size", "validation", &O::eval_global_batch_size,
     "sequences per validation iteration (default: the global batch)"},
    {"--eval-iters", "validation", &O::eval_iters, "global batches of the validation split per validation",
     kShowDefault},
};

// An output path given by `flag`: its folder exists, and it is not a folder, a FIFO (which would block the
// writer until a reader appears) or a symbolic link (writing through one truncates whatever it points at:
// as root, /etc/hostname). Checked before anything is built.
void check_output_path(const std::string & path, const char * flag) {
    namespace fs = std::filesystem;
    std::error_code ec;
    if (fs::is_symlink(fs::symlink_status(path, ec))) {
        LOOM_THROW(flag << " '" << path << "' is a symbolic link (to '" << fs::read_symlink(path, ec).string()
                        << "'); Loom does not write through one",
                   "give the path of the file itself");
    }
    const fs::path  parent = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
    LOOM_CHECK(fs::is_directory(parent, ec), flag << " '" << path << "': the folder '" << parent.string()
                                                  << "' does not exist", "create it first");
    const fs::file_status status = fs::status(path, ec);
    LOOM_CHECK(!fs::is_directory(status) && !fs::is_fifo(status),
               flag << " '" << path << "' is a " << (fs::is_directory(status) ? "folder" : "FIFO") << ", not a file",
               "give the path of a file to write");
}

}  // namespace

std::span<const Flag<TrainOptions>> logging_flags() { return kLoggingFlags; }

void validate_logging(const Given & given, const TrainOptions & o) {
    // Megatron's order: the flag, then MEGATRON_LOGGING_LEVEL (an int), then the default.
    if (given("--logging-level")) {
        set_logging_level(static_cast<int>(std::clamp<int64_t>(o.logging_level, -1000000, 1000000)));
    } else if (const char * env = std::getenv("MEGATRON_LOGGING_LEVEL")) {
        char *          end   = nullptr;
        const long long level = std::strtoll(env, &end, 10);
        LOOM_CHECK(end != env && *end == '\0' && level > -1000000 && level < 1000000,
                   "MEGATRON_LOGGING_LEVEL='" << env << "' is not an integer", "Python's logging levels: 10, 20, 30, 40, 50");
        set_logging_level(static_cast<int>(level));
    }
    if (!o.wandb_project.empty() && process_rank() <= 0) {
        std::fprintf(stderr, "WARNING: --wandb-project %s: Loom has no Weights & Biases client; the logged scalars go "
                             "to TensorBoard (--tensorboard-dir) and to --log-file%s\n",
                     o.wandb_project.c_str(),
                     o.tensorboard_dir.empty() && o.log_file.empty() ? ", neither of which is given" : "");
    }
    LOOM_CHECK(o.log_interval >= 1, "--log-interval must be >= 1", "");
    LOOM_CHECK(!o.profile || (o.profile_step_start >= 0 && o.profile_step_end > o.profile_step_start),
               "--profile-step-start " << o.profile_step_start << " and --profile-step-end " << o.profile_step_end
                                       << " give no iteration to profile",
               "the profile covers the iterations after --profile-step-start completed ones up to --profile-step-end");
    for (const std::string & word : o.profile_ranks) {
        const std::optional<std::string> plain = python_int_text(word);
        LOOM_CHECK(plain && plain->size() < 10 && (*plain)[0] != '-', "--profile-ranks: '" << word << "' is not a rank", "");
    }
    LOOM_CHECK(o.timing_log_level >= 0 && o.timing_log_level <= 2,
               "--timing-log-level must be 0, 1 or 2, got " << o.timing_log_level, "");
    LOOM_CHECK(o.timing_log_option == "max" || o.timing_log_option == "minmax" || o.timing_log_option == "all",
               "argument --timing-log-option: invalid choice: '" << o.timing_log_option
                                                                 << "' (choose from 'max', 'minmax', 'all')", "");
    LOOM_CHECK(o.tensorboard_log_interval >= 1 && o.tensorboard_queue_size >= 1,
               "--tensorboard-log-interval and --tensorboard-queue-size must be >= 1", "");
    if (!o.tensorboard_dir.empty()) {
        std::error_code ec;
        LOOM_CHECK(!std::filesystem::exists(o.tensorboard_dir, ec) || std::filesystem::is_directory(o.tensorboard_dir, ec),
                   "--tensorboard-dir '" << o.tensorboard_dir << "' exists and is not a folder", "give a folder");
    }
    LOOM_CHECK(!given("--eval-interval") || o.eval_interval >= 1, "--eval-interval must be >= 1, got " << o.eval_interval,
               "leave it out to train without validation");
    LOOM_CHECK(o.eval_iters >= 0 && o.eval_iters <= (int64_t(1) << 40) / o.eval_global_batch_size,
               "--eval-iters " << o.eval_iters << " x global batch " << o.eval_global_batch_size
                               << " samples is outside what Loom evaluates [0, 2^40]",
               "");
    if (!o.log_file.empty()) check_output_path(o.log_file, "--log-file");
    if (!o.timeline_file.empty()) {
        LOOM_CHECK(o.parallel.pp() > 1, "--timeline draws the pipeline stages' measured timeline; it needs "
                                                 "--pipeline-model-parallel-size > 1",
                   "`loom schedule --svg` draws a schedule without running one");
        check_output_path(o.timeline_file, "--timeline");
    }
    LOOM_CHECK(o.device == "auto" || o.device == "cpu" || o.device == "cuda" || o.device == "cuda-emu",
               "--device " << o.device << " is not a device Loom trains on", "give --device cpu, cuda, cuda-emu or auto");
    LOOM_CHECK(o.distributed_timeout_minutes >= 1,
               "--distributed-timeout-minutes must be >= 1, got " << o.distributed_timeout_minutes, "");
}

}  // namespace loom::train

namespace loom::train {

std::string TrainOptions::profile_file(int rank) const {
    const std::string dir = !tensorboard_dir.empty() ? tensorboard_dir : !save.empty() ? save : std::string(".");
    return (std::filesystem::path(dir) / ("loom_profile_rank" + std::to_string(rank) + ".json")).string();
}

}  // namespace loom::train
