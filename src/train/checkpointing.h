// The trainer's side of checkpoints (checkpoint/checkpoint.h holds the format): what `loom train` saves
// besides the tensors (the args, the consumed samples, the saved layout, the seed), the check that a
// --load checkpoint is of the model the flags describe, --use-checkpoint-args, and the save and load of one
// rank's Setup.
//
// Megatron's flags and semantics:
//   --save DIR --save-interval N   save at every multiple of N, and at the end of training
//   --load DIR [--ckpt-step N]     resume from the tracker's iteration (or N): parameters, optimizer state,
//                                  iteration and consumed samples; with no tracker in DIR, train from scratch
//   --no-save-optim / --no-load-optim   parameters only (the optimizer then starts from the loaded values)
//   --no-load-rng                  accepted: Loom draws no random numbers after initialisation yet (no dropout),
//                                  and the data order depends only on --seed and the consumed samples
//   --finetune                     parameters only, from iteration 0 and sample 0
//   --use-checkpoint-args          the model's shape from the checkpoint, over the model flags
//   --ckpt-format torch_dist       the default; Loom's format answers to Megatron's default name, other
//                                  formats are refused
//   --dist-ckpt-strictness S       the model's tensors the checkpoint lacks ("unexpected") and the checkpoint's
//                                  tensors no rank's model uses ("missing"), Megatron's StrictHandling:
//                                    assume_ok_unexpected   (default) an unexpected tensor is an error naming it
//                                    log_unexpected         unexpected ones keep their initial values (and a fresh
//                                                           optimizer state), each rank lists its own on stderr
//                                    log_all                the same, and rank 0 lists the missing ones
//                                    raise_unexpected       an error listing the unexpected, before anything loads
//                                    raise_all              an error listing both
//                                    return_unexpected/_all as log_*: the trainer is the caller they are returned to
//                                    ignore_all             unexpected ones keep their initial values, unlisted
//                                  The *_all values find the missing tensors with one collective over the world
//                                  (after the ranks agree on the checkpoint they read).
//
// The schedule's state (Megatron's OptimizerParamScheduler.state_dict(), steps counted in samples) is saved
// in the index's metadata as "opt_param_scheduler": max_lr, min_lr, lr_warmup_steps, lr_decay_steps,
// lr_decay_style, num_steps, start_wd, end_wd, wd_incr_steps, wd_incr_style (and Loom's lr_warmup_init and
// WSD anneal). A --load restores num_steps, and, as Megatron's load_state_dict:
//   by default                              each value of the flags must equal the checkpoint's: an error
//                                           lists every difference with its flag
//   --override-opt_param-scheduler          the flags' values
//   --use-checkpoint-opt_param-scheduler    the checkpoint's values (the weight decay must still agree: Loom's
//                                           is the optimizer's, fixed when it is built)
// With --finetune or --no-load-optim the scheduler is not loaded (Megatron's rule): it starts at step 0.
#pragma once

#include "checkpoint/checkpoint.h"
#include "train/options.h"
#include "train/setup.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <optional>
#include <string>

namespace loom::train {

// --dist-ckpt-strictness's values, Megatron's spellings.
enum class Strictness {
    assume_ok_unexpected, log_unexpected, log_all, raise_unexpected, raise_all, return_unexpected, return_all, ignore_all
};
Strictness strictness_from_name(const std::string & name);   // throws naming --dist-ckpt-strictness

// The learning-rate schedule's position: the schedule in use and the samples it has stepped over.
struct SchedulerState {
    optim::LrSchedule schedule;
    double            num_steps = 0;
};

// The metadata a checkpoint of this run holds: {"args": {...}, "consumed_train_samples", "rng",
// "opt_param_scheduler"}.
// `rerun`: the rerun state machine's pending state (train/rerun.h), saved when not null; `grad_scaler`:
// a dynamic loss scaler's state (Megatron's optimizer "grad_scaler"), saved with the optimizer.
nlohmann::json checkpoint_metadata(const TrainOptions & options, int64_t consumed_samples,
                                   const SchedulerState & scheduler, const nlohmann::json & rerun = nullptr,
                                   const std::optional<optim::LossScalerState> & grad_scaler = std::nullopt);

// The schedule a resumed run follows, from the flags' (`flags`) and a checkpoint's "opt_param_scheduler"
// under the rules above; throws listing each value that differs, with its flag, by default.
SchedulerState resume_scheduler(const TrainOptions & options, const optim::LrSchedule & flags,
                                const nlohmann::json & saved, const std::string & index_path);

// Throws naming the flag when the model `options` describes is not the checkpoint's (layers, sizes, heads,
// groups, positions, vocabulary, normalization, MLP, biases, tied output). Parallel layout, batch sizes,
// precision and the learning-rate schedule may change.
void check_checkpoint_args(const TrainOptions & options, const checkpoint::Index & index);

// --use-checkpoint-args: sets the model's shape from the checkpoint's args.
void apply_checkpoint_args(model::GptConfig & model, const checkpoint::Index & index);

// The folder --load (with --ckpt-step) names; nothing when its folder holds no tracker file.
std::optional<std::string> checkpoint_to_load(const TrainOptions & options);

// What a --load resumed.
struct Resumed {
    std::string folder;                // empty: nothing loaded (no tracker in --load's folder)
    int64_t     iteration        = 0;
    int64_t     consumed_samples = 0;
    double      seconds          = 0;
    std::optional<SchedulerState> scheduler;   // the checkpoint's schedule, under the rules above (nothing:
                                               // not loaded, the run starts the flags' at step 0)
    std::vector<std::string> notes;            // lines for rank 0's log (the missing tensors)
    nlohmann::json           rerun;            // the rerun state machine's saved state (null: none)
    std::optional<optim::LossScalerState> grad_scaler;   // a dynamic loss scaler's, where the checkpoint has one
};

// --load into this rank's setup (every rank, no collective).
Resumed load_checkpoint(const TrainOptions & options, Setup & setup);

// --load for a command that reads one model (eval, export-hf): the index of the checkpoint it names
// (with --ckpt-step); throws when the folder holds none, or when a flag only `loom train` honours
// (--save, --save-interval, the exit flags) was given to `command`.
checkpoint::Index index_to_read(const TrainOptions & options, const char * command);
// The checkpoint's weights into a whole model on one rank (the f32 master where one was saved).
void load_weights(const checkpoint::Index & index, model::GptModel & model);

// --save-retain-interval R, after a save of `iteration` (rank 0): the checkpoint the tracker named before it
// (`previous`) is removed unless its iteration is a multiple of R, or is `iteration`, or its folder is a
// symbolic link (Megatron's rule). Renamed to iter_XXXXXXX.tmp first, which the next save clears if a kill
// comes between: the tracker already names the new checkpoint.
// Returns whether it removed one.
bool retire_checkpoint(const TrainOptions & options, std::optional<int64_t> previous, int64_t iteration);
// The iteration DIR's tracker names, if any (a "release" tracker or none: nothing).
std::optional<int64_t> tracked_iteration(const std::string & dir);

// --save at `iteration` begun: the temporary folder made and this rank's part snapshotted and written on a
// thread (`background`, --async-save) or written before returning; checkpoint::finish_save commits it.
std::unique_ptr<checkpoint::SaveInProgress> begin_save_checkpoint(
    const TrainOptions & options, Setup & setup, int64_t iteration, int64_t consumed_samples,
    const SchedulerState & scheduler, const std::optional<optim::LossScalerState> & grad_scaler, bool background);

// --save at `iteration`: every rank of the setup calls it.
checkpoint::SaveStats save_checkpoint(const TrainOptions & options, Setup & setup, int64_t iteration,
                                      int64_t consumed_samples, const SchedulerState & scheduler,
                                      const nlohmann::json & rerun = nullptr,
                                      const std::optional<optim::LossScalerState> & grad_scaler = std::nullopt);

}  // namespace loom::train
