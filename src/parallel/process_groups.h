// ProcessGroups: the communicators of this rank, one per group kind, built once from a ParallelConfig
// and passed down explicitly (no global getters).
//
//   dense generator (tp-cp-dp-pp):  tp, pp, dp, cp, dp_cp (gradients reduce here), tp_pp (model
//                                   parallel), tp_cp, tp_dp_cp, tp_dp, embedding, position_embedding
//   expert generator (etp-ep-edp-pp): expert_ep, expert_tp, expert_dp, expert_tp_ep, expert_tp_ep_pp
//                                   (expert pp is the dense pp: the configuration checks they match)
//
// embedding and position_embedding are null on ranks outside those groups (middle pipeline stages).
//
// pp_channels: the pipeline's point-to-point channels, one two-rank communicator per directed channel of
// data (pipeline/p2p_plan.h says why: NCCL matches sends and receives by order only, per communicator, and a
// send may wait for its receive). For each pipeline rank r, in this order: the activations r -> (r + 1) mod PP,
// then the gradients (r + 1) mod PP -> r (pipeline::pipeline_channels(PP) lists the same). A rank holds the
// four that touch it (PP 2: all four, with its one peer); the pair through the wrap-around, PP - 1 and 0,
// carries data only with virtual stages, but the groups are built the same for every layout.
#pragma once

#include "comm/communicator.h"
#include "parallel/parallel_config.h"

#include <memory>
#include <string>
#include <vector>

namespace loom::parallel {

// One group kind: its name as `loom ranks --json` prints it, which generator, and its groups.
struct GroupKind {
    std::string name;       // "tp", "dp-cp", "embedding", ...
    bool        expert;     // from the expert generator
    RankGroups  groups;
};

// Every group kind of both generators, in the order `loom ranks` prints them.
std::vector<GroupKind> group_kinds(const ParallelConfig & config);

// One directed pipeline channel that holds this rank.
struct PipelineChannel {
    int                                 src      = 0;       // pipeline ranks (in-group ranks of the pp group)
    int                                 dst      = 0;
    bool                                gradient = false;   // false: forward activations, true: input gradients
    std::shared_ptr<comm::Communicator> comm;   // the two ranks, src first: src is its rank 0, dst its rank 1
};

struct PipelineChannels {
    std::vector<PipelineChannel> channels;   // those holding this rank, in creation order; empty for PP 1

    // The communicator of the channel src -> dst, or null when this rank holds none.
    std::shared_ptr<comm::Communicator> find(int src, int dst, bool gradient) const;
};

struct ProcessGroups {
    using CommPtr = std::shared_ptr<comm::Communicator>;

    CommPtr world;
    CommPtr tp, pp, dp, cp, dp_cp, tp_pp, tp_cp, tp_dp_cp, tp_dp, embedding, position_embedding;
    CommPtr expert_ep, expert_tp, expert_dp, expert_tp_ep, expert_tp_ep_pp;
    PipelineChannels pp_channels;   // the pipeline group's point-to-point channels (see the top of this file)
    // With several distributed-optimizer instances (--num-distributed-optimizer-instances N > 1; null
    // otherwise): each data-parallel group's ranks cut into N runs of consecutive ranks, this rank's run
    // (intra_dp; intra_expert_dp from the expert data-parallel group), and the ranks at this rank's place in
    // every run (inter_dp, inter_expert_dp): Megatron's intra- and inter-partial data-parallel groups.
    CommPtr intra_dp, inter_dp, intra_expert_dp, inter_expert_dp;
    // Hierarchical context parallelism (--hierarchical-context-parallel-sizes inner outer; null otherwise):
    // each CP group cut into runs of `inner` consecutive ranks (cp_inner, the heads' all-to-all of a2a+p2p)
    // and the ranks at this rank's place in every run (cp_outer, its ring). Megatron's hierarchical groups.
    CommPtr cp_inner, cp_outer;

    // Collective over the world: every rank must call it with the same config (and instances, and sizes).
    static ProcessGroups create(const ParallelConfig & config, comm::CommunicatorFactory & factory,
                                int64_t dist_opt_instances = 1, const std::vector<int64_t> & hierarchical_cp = {});

    // The communicator of a group kind by its name ("tp", "expert-dp", ...); throws for unknown names.
    CommPtr by_name(const std::string & kind, bool expert) const;
};

}  // namespace loom::parallel
