// Rank generation: which global ranks form each process group. Pure functions, no MPI.
//
// The world is a mixed-radix grid. The order string lists axes fastest-varying first; in the default
// "tp-cp-ep-dp-pp", for the dense generator (axis sizes tp, cp, ep = 1, dp, pp):
//
//   global_rank = tp_rank + cp_rank * tp + dp_rank * tp * cp + pp_rank * tp * cp * dp
//
// and for the expert generator (axis sizes etp as "tp", cp = 1, ep, edp as "dp", pp):
//
//   global_rank = etp_rank + ep_rank * etp + edp_rank * etp * ep + pp_rank * etp * ep * edp
//
// The groups of a token such as "dp" or "tp-pp" (masked orthogonal groups): the named axes are masked
// (they vary inside a group), the others fix the group.
//   - ranks in a group: mixed radix over the masked axes, leftmost masked axis (in the generator's
//     order) fastest, each rank = inner(masked coords, masked strides) + inner(group coords, unmasked strides);
//   - groups numbered by mixed radix over the unmasked axes, leftmost fastest;
//   - the order of tokens inside the argument does not matter ("dp-cp" == "cp-dp").
//
// Worked example (docs/design/parallel_state.md section 3): world 16, tp 4, pp 2, so dp 2. Masking dp
// leaves tp (stride 1) and pp (stride 8): group index = tp_rank + pp_rank * 4, and group[tp_rank + 4 pp_rank]
// = tp_rank + {0, 1} * 4 + pp_rank * 8, giving dp groups [0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15].
//
// Axes of size 1 missing from the order are appended in the order tp, pp, dp, ep, cp; an axis of size
// greater than 1 missing from it is an error.
#pragma once

#include <string>
#include <string_view>
#include <vector>

namespace loom::parallel {

using RankGroups = std::vector<std::vector<int>>;

// Groups of `world_size` ranks over axes of `sizes` (fastest first) where `mask[i]` marks the axes that
// vary inside a group.
RankGroups masked_orthogonal_rank_groups(int world_size, const std::vector<int> & sizes,
                                         const std::vector<bool> & mask);

class RankGenerator {
public:
    // Sizes of the five axes; `order` names them fastest first, e.g. "tp-cp-ep-dp-pp". Throws if an
    // axis of size > 1 is missing from the order, or the order names an unknown or repeated axis.
    RankGenerator(int tp, int ep, int dp, int pp, int cp, std::string_view order);

    // The groups of a token string such as "tp", "dp-cp" or "tp-ep-pp".
    RankGroups get_ranks(std::string_view token) const;

    // The coordinate of global `rank` along axis `axis` ("tp", "cp", "ep", "dp", "pp").
    int coordinate(int rank, std::string_view axis) const;

    const std::string &              order() const { return order_; }   // with the appended axes
    int                              world_size() const { return world_size_; }
    int                              size_of(std::string_view axis) const;

private:
    std::vector<bool> mask_of(std::string_view token) const;

    std::vector<std::string> axes_;    // in order, fastest first
    std::vector<int>         sizes_;   // size of each axis in axes_
    std::string              order_;
    int                      world_size_ = 1;
};

}  // namespace loom::parallel
