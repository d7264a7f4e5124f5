// DistributedOptimizer (ZeRO-1): each data-parallel rank keeps the AdamW state, and the f32 master
// weights of 16-bit parameters, only for the shard of the DDP buffers it owns
// (docs/design/ddp_and_optimizers.md section 2; the section numbers below refer to that document).
//
// After DDP's reduce-scatter, rank r's shard of every bucket holds the data-parallel average of the
// gradients. The step is Optimizer::step (optim/optimizer.h) over the owned pieces (section 2.2's ranges):
//   - the norm counts each owned piece once over the data-parallel group (every element is owned by
//     exactly one rank), then over the model-parallel ranks, leaving out `shared` and `tp_duplicate` copies;
//     expert pieces (sharded over DDP's expert-data-parallel group) over that group, then ETP x EP x PP;
//   - AdamW on each piece with its parameter's weight decay: a bf16 parameter's piece updates its f32
//     master and writes the rounded value into the param buffer in the same pass, an f32 parameter's
//     piece updates the param buffer in place (it is its own master);
//   - the step leaves the gather to its caller: DDP's start_param_sync() all-gathers the updated shards
//     (now, or lazily before each layer's forward with --overlap-param-gather), after the compute stream's
//     update; the trainer calls it through train/grad_sync.h.
// The pieces are the slots of the Adam state in section 2.3's order (the default-weight-decay group, then
// the no-decay group; in each, f32-native pieces before 16-bit ones; then buffer -> bucket -> shard-range
// order), which decides what --optimizer-cpu-offload's fraction offloads: a prefix of this rank's local
// shard (the split uses local piece sizes, per rank). Every element goes through the same AdamW kernel
// with the same arguments whatever the fraction, so the result is bitwise the same.
//
// Memory per parameter (optimizer pool): 12 / d bytes for bf16 parameters (master, m, v), 8 / d for f32
// (m, v), for the elements this rank owns; with DDP's buffers that makes 6 + 12/d and 8 + 8/d in all.
#pragma once

#include "ddp/ddp.h"
#include "optim/optimizer.h"

namespace loom::optim {

class DistributedOptimizer final : public Optimizer {
public:
    // model_parallel: the TP x PP group the norm sums over after the data-parallel group (null: none);
    // expert_model_parallel: the ETP x EP x PP group the expert pieces sum over after the expert-data-parallel
    // group (null: with the rest). Expert buffers are sharded over DDP's expert-data-parallel group.
    DistributedOptimizer(ddp::DistributedDataParallel & ddp, const OptimizerOptions & options,
                         comm::Communicator * model_parallel = nullptr, comm::Communicator * expert_model_parallel = nullptr);

    // Elements of the model this rank owns (sum over its pieces).
    int64_t owned_numel() const { return owned_; }

private:
    ddp::DistributedDataParallel & ddp_;
    int64_t                        owned_ = 0;
};

}  // namespace loom::optim
