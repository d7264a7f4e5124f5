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
#pragma once

#include "checkpoint/checkpoint.h"
#include "train/options.h"
#include "train/setup.h"

#include <nlohmann/json.hpp>

#include <cstdio>
#include <optional>
#include <string>

namespace loom::train {

// The metadata a checkpoint of this run holds: {"args": {...}, "consumed_train_samples", "rng"}.
nlohmann::json checkpoint_metadata(const TrainOptions & options, int64_t consumed_samples);

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
};

// --load into this rank's setup (every rank, no collective).
Resumed load_checkpoint(const TrainOptions & options, Setup & setup);

// --load for a command that reads one model (eval, export-hf): the index of the checkpoint it names
// (with --ckpt-step); throws when the folder holds none, or when a flag only `loom train` honours
// (--save, --save-interval, the exit flags) was given to `command`.
checkpoint::Index index_to_read(const TrainOptions & options, const char * command);
// The checkpoint's weights into a whole model on one rank (the f32 master where one was saved).
void load_weights(const checkpoint::Index & index, model::GptModel & model);

// --save at `iteration`: every rank of the setup calls it.
checkpoint::SaveStats save_checkpoint(const TrainOptions & options, Setup & setup, int64_t iteration,
                                      int64_t consumed_samples);

}  // namespace loom::train
