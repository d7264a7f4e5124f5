// setup: what one rank trains, built from the options and its process groups in one place (Megatron's
// setup_model_and_optimizer): the model chunks of its pipeline stage, DDP over their parameters, and the
// optimizer. `loom train` and every parallel test build a rank through here.
//
//   groups.dp         null: one rank without DDP's buffers (the reference run); else DDP over it
//   groups.pp         with more than one rank: this rank's chunks are its pipeline stage's virtual stages
//   groups.tp         with more than one rank: tensor-parallel layers (and --sequence-parallel)
//   groups.tp_pp      the TP x PP ranks the gradient norm sums over
//   groups.embedding  the first and last stages, over which the tied word embedding's gradient is summed
//   groups.expert_ep  with more than one rank: the MoE layers' experts spread over it (--expert-model-parallel-size)
//   groups.expert_dp  expert parameters' DDP buffers reduce and shard over it (null: groups.dp)
//   groups.expert_tp_ep_pp  the ranks the expert parameters' share of the gradient norm sums over
// A default-constructed ProcessGroups is a single process.
#pragma once

#include "ddp/ddp.h"
#include "model/gpt_model.h"
#include "optim/optimizer.h"
#include "parallel/process_groups.h"
#include "train/options.h"

#include <memory>
#include <vector>

namespace loom::train {

// The model chunks of pipeline rank `stage`, in chunk order: chunk c is virtual stage v = c * pp + stage,
// with the layers assign_layers gives it; the first virtual stage embeds, the last computes the loss.
// Without pipelining: one chunk with every layer.
std::vector<model::PipelineStage> pipeline_stages(const TrainOptions & options, int stage);

class Setup {
public:
    Setup() = default;
    Setup(Setup &&) = default;
    Setup & operator=(Setup &&) = delete;
    // Leaves the model whole (finishes a lazy parameter all-gather) and removes the hooks into DDP.
    ~Setup();

    std::vector<model::GptModel *>                chunks;        // this rank's chunks, in chunk order
    std::vector<std::unique_ptr<model::GptModel>> owned_chunks;  // those setup() built
    parallel::ProcessGroups                       groups;
    std::unique_ptr<ddp::DistributedDataParallel> ddp;           // null without a data-parallel group
    std::unique_ptr<optim::Optimizer>             optimizer;

    // Every parameter of every chunk, in chunk order.
    std::vector<model::Parameter *> parameters() const;
    // Every rank of the job: the world group, or the data-parallel group of a single-model setup built
    // without one (null: one process).
    comm::Communicator * all_ranks() const { return groups.world ? groups.world.get() : groups.dp.get(); }
    // The ranks that hold the same weights and reduce gradients together: the data-parallel group, or with
    // context parallelism the data- and context-parallel ranks (dp_cp).
    const std::shared_ptr<comm::Communicator> & gradient_group() const {
        return groups.cp && groups.cp->size() > 1 ? groups.dp_cp : groups.dp;
    }
};

// Builds this rank's chunks (initialised from --seed, then --load-hf if given) and everything over them.
// Checks the groups against the options first (no collective has run with a wrong size). Without
// `init_values` the chunks' values are left as allocated (a plan on the meta device: plan/memory_plan.h).
Setup setup(const TrainOptions & options, const parallel::ProcessGroups & groups, Device & device,
            bool init_values = true);
// The same over chunks the caller built and owns (tests that inspect a model they made).
Setup setup(const TrainOptions & options, std::vector<model::GptModel *> chunks,
            const parallel::ProcessGroups & groups);

}  // namespace loom::train
