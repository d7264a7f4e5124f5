// ProcessGroups: the communicators of this rank, one per group kind, built once from a ParallelConfig
// and passed down explicitly (no global getters).
//
//   dense generator (tp-cp-dp-pp):  tp, pp, dp, cp, dp_cp (gradients reduce here), tp_pp (model
//                                   parallel), tp_cp, tp_dp_cp, tp_dp, embedding, position_embedding
//   expert generator (etp-ep-edp-pp): expert_ep, expert_tp, expert_dp, expert_tp_ep, expert_tp_ep_pp
//                                   (expert pp is the dense pp: the configuration checks they match)
//
// embedding and position_embedding are null on ranks outside those groups (middle pipeline stages).
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

struct ProcessGroups {
    using CommPtr = std::shared_ptr<comm::Communicator>;

    CommPtr world;
    CommPtr tp, pp, dp, cp, dp_cp, tp_pp, tp_cp, tp_dp_cp, tp_dp, embedding, position_embedding;
    CommPtr expert_ep, expert_tp, expert_dp, expert_tp_ep, expert_tp_ep_pp;

    // Collective over the world: every rank must call it with the same config.
    static ProcessGroups create(const ParallelConfig & config, comm::CommunicatorFactory & factory);

    // The communicator of a group kind by its name ("tp", "expert-dp", ...); throws for unknown names.
    CommPtr by_name(const std::string & kind, bool expert) const;
};

}  // namespace loom::parallel
