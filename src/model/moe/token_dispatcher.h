// Token dispatch on one rank (Megatron's all-gather dispatcher with EP = TP = 1): capacity dropping,
// padding, and the permutation of token rows into expert-major order and back.
// Legend as moe_config.h: n tokens, h hidden, E experts, k per token, C capacity, R permuted rows.
//
// The plan (dispatch_plan_create) assigns each (token t, slot j) routed to expert e = top_idx[t, j]
// a permuted row, or drops it:
//   - without a capacity factor nothing is dropped;
//   - with one, an expert routed more than C tokens keeps C of them: the C highest probabilities
//     (--moe-token-drop-policy probs; ties toward the earlier token) or the C earliest tokens (position);
//   - rows are expert-major: expert 0's kept tokens in token order, then expert 1's, ...;
//   - --moe-pad-expert-input-to-capacity gives every expert exactly C rows: after its kept tokens come
//     zero rows (token -1, probability 0), so R = E C is known before the routing has run.
//
//   n = 4, k = 1, E = 2, top_idx = [1, 0, 1, 1], probs = [.5, .9, .7, .6], C = 2 (factor 1.0):
//     expert 0: token 1              expert 1: tokens 0, 2, 3 -> keeps 2 and 3 (probs) or 0 and 2 (position)
//     probs policy: rows [1 | 2, 3], tokens_per_expert [1, 2]; padded: rows [1, pad | 2, 3], R = 4
//
// permute:    xp[r] = x[token_of_row[r]] (zero for padding)                                (R, h)
// unpermute:  y[t]  = sum over j = 0 .. k-1 with a row of probs[t, j] * yp[row_of[t, j]]       (n, h)
//             (the k terms added in slot order from zero: deterministic; dropped slots add nothing)
// Backward:   dx[t] = sum over j of dxp[row_of[t, j]] (slot order); dyp[r] = probs[t, j] dy[t];
//             dprobs[t, j] = <dy[t], yp[row_of[t, j]]> (0 when dropped, as Megatron's masked probs).
#pragma once

#include "core/tensor.h"
#include "model/moe/moe_config.h"

#include <vector>

namespace loom::model {

struct DispatchPlan {
    int64_t n = 0, k = 0, experts = 0;
    int64_t capacity = -1;            // C; -1 without a capacity factor
    bool    padded   = false;         // every expert has exactly C rows
    int64_t rows_max = 0;             // rows of token_of_row: n k, or E C when padded
    Tensor  probs;                    // (n, k) f32: the routing probabilities, 0 where dropped
    Tensor  row_of;                   // (n, k) i32: the permuted row of each (token, slot), -1 dropped
    Tensor  token_of_row;             // (rows_max) i32: each permuted row's token, -1 padding or unused
    Tensor  tokens_per_expert;        // (E) i64: each expert's rows (C each when padded)
};

// The plan's scalars for n tokens and k slots (no tensors): what dispatch_plan_create fills in.
DispatchPlan dispatch_plan_shape(int64_t n, int64_t k, const MoeConfig & moe);
// Enqueues the plan for top_idx (n, k) i32 and probs (n, k) f32 under `moe`'s capacity settings.
DispatchPlan dispatch_plan_create(const Tensor & top_idx, const Tensor & probs, const MoeConfig & moe);

// Each expert's rows on the host. Padded: E times C, with no wait. Otherwise the one host
// synchronisation of the layer (Megatron's tokens_per_expert.cpu()): the compute stream is drained.
std::vector<int64_t> dispatch_plan_counts(const DispatchPlan & plan);
// An i64 tensor's values on the host, after the compute stream has run up to now (a drain).
std::vector<int64_t> read_counts(const Tensor & counts);

// x (n, h) f32 -> xp (rows, h), rows = the sum of the counts.
Tensor moe_permute(const Tensor & x, const DispatchPlan & plan, int64_t rows);
// dxp (rows, h) -> dx (n, h).
Tensor moe_permute_backward(const Tensor & dxp, const DispatchPlan & plan);
// yp (rows, h) -> y (n, h), weighted by plan.probs.
Tensor moe_unpermute(const Tensor & yp, const DispatchPlan & plan);
// dy (n, h), yp (rows, h) -> dyp (rows, h) and dprobs (n, k).
void   moe_unpermute_backward(const Tensor & dy, const Tensor & yp, const DispatchPlan & plan, Tensor & dyp,
                              Tensor & dprobs);

// Expert parallelism (model/moe/moe_layer.h has the two dispatchers that use these).
//
// The plan's expert of each (token, slot), -1 where the capacity dropped it: (n, k) i32, read off the
// plan's rows (expert-major). The all-gather dispatcher gathers it (with plan.probs, 0 where dropped) from
// every EP rank.
Tensor dispatch_plan_routed(const DispatchPlan & plan);
// The plan of the local experts [first, first + count) over gathered routing: routed (N, k) i32 (-1:
// dropped), probs (N, k) f32. Its experts are the local ones (plan.experts = count), rows local-expert-
// major with tokens in order; slots routed elsewhere or dropped get no row (probability 0). No capacity:
// the ranks that routed the tokens applied theirs.
DispatchPlan dispatch_plan_local(const Tensor & routed, const Tensor & probs, int64_t first, int64_t count);
// out[r] = x[index[r]] for r < index.size(): x (m, h) f32 -> (index.size(), h).
Tensor moe_gather_rows(const Tensor & x, const std::vector<int32_t> & index);

}  // namespace loom::model
