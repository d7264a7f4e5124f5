// GradSync: the one object the trainer drives data parallelism through, phase by phase, with DDP's buffers
// (plain DDP, ZeRO-1, Megatron-FSDP) or without them (one rank's own main_grads). The trainer's iteration
// (train/trainer.h, Trainer::step) calls, in this order:
//
//   begin()           the gradients start from zero: DDP's buffers (iteration 1's readiness reports become
//                     the golden counts) or every chunk's main_grads
//   ready(), last()   handed to the pipeline executor: each parameter's readiness report (launches a bucket
//                     group's reduction under --overlap-grad-reduce) and Megatron's no_sync switch, set
//                     before each chunk's backward (true for its last micro-batch)
//   finish()          finalize_grads (ddp/finalize_grads.h): the data-parallel reduction completes, then the
//                     tied embedding's and sequence parallelism's sums
//   [optimizer step]
//   start_gather()    after an update the distributed optimizer made: its updated shards are all-gathered,
//                     now or, with --overlap-param-gather, lazily before each module's forward
//   whole()           every pending gather completes: before anything reads the weights whole (the params
//                     norm, the replicas' weight hashes, a checkpoint, the end of the run)
//
// A rerun of the iteration (--rerun-mode) calls restart(): the first run's reductions complete before their
// buffers are zeroed. The model's hooks (model::ParamHooks, installed by train/setup.h) are how DDP follows
// the layers inside the schedule (the pre-forward wait of --overlap-param-gather, Megatron-FSDP's gathers);
// they act on the same DDP object and nothing else calls into it during training.
#pragma once

#include "ddp/ddp.h"
#include "ddp/finalize_grads.h"
#include "model/gpt_model.h"

#include <functional>
#include <vector>

namespace loom::train {

class GradSync {
public:
    // `ddp` null: no data-parallel buffers (the single-rank reference); `params` are every chunk's.
    GradSync(ddp::DistributedDataParallel * ddp, std::vector<model::GptModel *> chunks,
             std::vector<model::Parameter *> params, ddp::FinalizeGroups groups, Device & device);

    void begin();
    void restart();
    const model::GradReadyFn &        ready() const { return ready_; }
    const std::function<void(bool)> & last() const { return last_; }
    void finish();
    // Waits for the reductions in flight without the rest of finish() (a checkpoint of the state before them).
    void wait_reductions();
    void start_gather();
    void whole();

private:
    ddp::DistributedDataParallel *  ddp_;
    std::vector<model::GptModel *>  chunks_;
    std::vector<model::Parameter *> params_;
    ddp::FinalizeGroups             groups_;
    Device &                        device_;
    model::GradReadyFn              ready_;
    std::function<void(bool)>       last_;
};

}  // namespace loom::train
