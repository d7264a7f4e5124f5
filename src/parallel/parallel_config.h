// ParallelConfig: the parallel sizes of a job, validated up front, with the derived sizes.
//
//   world = tp * cp * dp * pp            (dense layers: attention, dense MLP)
//   world = etp * ep * edp * pp          (expert layers: MoE parallel folding; etp defaults to tp)
//
// Both decompositions share the pipeline axis, so the dense and expert pipeline groups must be the same
// ranks. Every rejected configuration gets an Error that names the Megatron flags involved and what
// would be valid; nothing invalid reaches a collective.
#pragma once

#include "parallel/rank_generator.h"

#include <optional>
#include <string>

namespace loom::parallel {

inline constexpr const char * kDefaultOrder = "tp-cp-ep-dp-pp";

// What the user asked for (flags), before derivation.
struct ParallelSizes {
    int                world_size = 1;
    int                tp         = 1;   // --tensor-model-parallel-size
    int                pp         = 1;   // --pipeline-model-parallel-size
    int                cp         = 1;   // --context-parallel-size
    int                ep         = 1;   // --expert-model-parallel-size
    std::optional<int> etp;              // --expert-tensor-parallel-size (default: tp)
    std::optional<int> vpp;              // --num-virtual-stages-per-pipeline-rank (1 is normalised away)
    std::string        order = kDefaultOrder;   // --order
};

class ParallelConfig {
public:
    // One rank: every size 1, the default order.
    ParallelConfig() : ParallelConfig(ParallelSizes{}, 1, 1, 1) {}
    // Validates and derives; throws loom::Error naming the flags at fault.
    static ParallelConfig create(const ParallelSizes & sizes);

    int                world_size() const { return world_size_; }
    int                tp() const { return tp_; }
    int                pp() const { return pp_; }
    int                cp() const { return cp_; }
    int                ep() const { return ep_; }
    int                etp() const { return etp_; }
    int                dp() const { return dp_; }     // world / (tp * cp * pp)
    int                edp() const { return edp_; }   // world / (etp * ep * pp)
    std::optional<int> vpp() const { return vpp_; }   // none, or >= 2
    const std::string & order() const { return order_; }

    // The two generators (axes of size 1 appended to the order).
    const RankGenerator & dense() const { return dense_; }
    const RankGenerator & expert() const { return expert_; }

    // Embedding group: [first, last] of each pipeline group ([r] when pp == 1); position embedding:
    // [first] of each pipeline group.
    RankGroups embedding_groups() const;
    RankGroups position_embedding_groups() const;

    // "world 16 = tp 4 x cp 1 x dp 2 x pp 2; experts: etp 1 x ep 4 x edp 2 x pp 2; order tp-cp-ep-dp-pp"
    std::string summary() const;

private:
    ParallelConfig(const ParallelSizes & s, int etp, int dp, int edp);

    int                world_size_, tp_, pp_, cp_, ep_, etp_, dp_, edp_;
    std::optional<int> vpp_;
    std::string        order_;
    RankGenerator      dense_;
    RankGenerator      expert_;
};

}  // namespace loom::parallel
