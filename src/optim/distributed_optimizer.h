// DistributedOptimizer (ZeRO-1): each data-parallel rank keeps the AdamW state, and the f32 master
// weights of 16-bit parameters, only for the shard of the DDP buffers it owns
// (../shared/specs/ddp_and_optimizers.md section 2; seeds 003, 004).
//
// After DDP's reduce-scatter, rank r's shard of every bucket holds the data-parallel average of the
// gradients. The step, per iteration:
//   1. grad norm: the squares of the owned shard's gradients, summed over the data-parallel group
//      (every element is owned by exactly one rank, so it counts once; the per-rank sums are gathered
//      and added in double, group_sum), then over the pipeline stages, leaving out `shared` copies;
//      then sqrt;
//   2. a non-finite norm skips the step and the all-gather (a nan iteration);
//   3. clip: scale the owned gradients by min(1, clip / (norm + 1e-6));
//   4. AdamW on each owned piece (spec 2.2's ranges), with its parameter's weight decay; a bf16
//      parameter's piece updates its f32 master and writes the rounded value into the param buffer in the
//      same pass, an f32 parameter's piece updates the param buffer in place (it is its own master);
//   5. DDP's start_param_sync() all-gathers the updated shards (now, or lazily before each layer's
//      forward with --overlap-param-gather).
//
// With --optimizer-cpu-offload (a HybridOptions given), the pieces become the slots of a
// HybridDeviceOptimizer, in spec 3.2's order (the default-weight-decay group, then the no-decay group; in
// each, f32-native pieces before 16-bit ones; then buffer -> bucket -> shard-range order), which holds their state
// instead and steps them in step 4, offloading a prefix of this rank's local shard to the host (the split
// uses local piece sizes, per rank). Every element still goes through host_adam_step with the same
// arguments, so the result is bitwise the same.
//
// Memory per parameter (optimizer pool): 12 / d bytes for bf16 parameters (master, m, v), 8 / d for f32
// (m, v), for the elements this rank owns; with DDP's buffers that makes 6 + 12/d and 8 + 8/d in all.
#pragma once

#include "ddp/ddp.h"
#include "optim/adamw.h"
#include "optim/hybrid_optimizer.h"

#include <memory>
#include <optional>

#include <vector>

namespace loom::optim {

class DistributedOptimizer {
public:
    // offload: step the pieces with a HybridDeviceOptimizer (--optimizer-cpu-offload).
    DistributedOptimizer(ddp::DistributedDataParallel & ddp, const AdamWConfig & config,
                         const std::optional<HybridOptions> & offload = std::nullopt);

    struct StepResult {
        double grad_norm = 0;      // before clipping
        bool   stepped   = false;  // false: non-finite norm, parameters unchanged
    };
    // Clips to clip_grad (0: off), steps with lr, then starts the parameter all-gather.
    // With tensor or pipeline parallelism, `model_parallel` (the TP x PP group) adds the other ranks' norms.
    StepResult step(float lr, float clip_grad, comm::Communicator * model_parallel = nullptr);

    // Elements of the model this rank owns (sum over its pieces).
    int64_t owned_numel() const { return owned_; }
    int64_t steps() const { return step_; }
    // The hybrid optimizer holding the state (null without offload).
    HybridDeviceOptimizer * hybrid() { return hybrid_.get(); }
    // The parameter (index into ddp.params()) of each hybrid slot, in slot order (offload only).
    const std::vector<int> & hybrid_slot_params() const { return slot_params_; }

private:
    struct Piece {
        int     param;        // index into ddp.params()
        int     buffer;
        int64_t world_start;  // in the buffer
        int64_t numel;
        int64_t state;        // offset into the state tensors
    };

    ddp::DistributedDataParallel & ddp_;
    AdamWConfig                    config_;
    std::vector<Piece>             pieces_;
    std::vector<Tensor>            master_, exp_avg_, exp_avg_sq_;   // per buffer, owned elements
    int64_t                        owned_ = 0;
    std::vector<int>               slot_params_;
    int64_t                        step_  = 0;
    std::unique_ptr<HybridDeviceOptimizer> hybrid_;   // with offload: the state of every piece
};

}  // namespace loom::optim
