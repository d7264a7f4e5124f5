// The CPU kernels of the Mixture-of-Experts ops (core/ops.h states their contracts; model/moe/router.h and
// model/moe/token_dispatcher.h the math). Scores, probabilities and the losses are computed in double,
// every sum in token order, so results do not depend on the thread count. The CUDA kernels
// (backend/cuda/moe_kernels.cu) are their twins.
#pragma once

#include "core/ops.h"

#include <cstdint>

namespace loom::cpu {

// The router's kernels read float or double logits (--moe-router-dtype fp64) and compute the same way from
// either: a float logit widens exactly, so f32 logits held in an f64 tensor give the f32 results bit for bit.
// dlogits are of the logits' type. Instantiated for float and double.
template <typename T>
void moe_topk(const T * logits, int64_t n, const MoeRouting & r, const float * expert_bias, int32_t * top_idx,
              float * probs);
template <typename T>
void moe_sinkhorn_topk(const T * logits, int64_t N, int64_t first, int64_t n, const MoeRouting & r, int32_t * top_idx,
                       float * probs);
template <typename T>
void moe_aux_counts(const T * logits, int64_t n, const MoeRouting & r, int64_t groups, float * counts);
template <typename T>
void moe_router_losses(const T * logits, int64_t n, const float * counts, const MoeRouting & r,
                       const MoeRouterLoss & loss, float * losses);
template <typename T>
void moe_router_backward(const T * logits, int64_t n, const int32_t * top_idx, const float * dprobs,
                         const float * counts, const MoeRouting & r, const MoeRouterLoss & loss, float loss_scale,
                         T * dlogits);

void moe_plan(const int32_t * expert_of, const float * probs, int64_t n, int64_t k, const MoePlanSpec & spec,
              float * plan_probs, int32_t * row_of, int32_t * token_of_row, int64_t token_rows,
              int64_t * tokens_per_expert);
void moe_plan_experts(const int32_t * row_of, int64_t slots, const int64_t * tokens_per_expert, int64_t experts,
                      int32_t * expert_of);
void moe_gather_rows(const float * x, int64_t m, const int32_t * index, int64_t rows, int64_t h, float * out);
void moe_combine(const float * src, const int32_t * row_of, const float * weights, int64_t n, int64_t k, int64_t h,
                 float * dst);
void moe_combine_backward(const float * dy, const float * src, int64_t rows, const float * weights,
                          const int32_t * row_of, const int32_t * token_of_row, int64_t n, int64_t k, int64_t h,
                          float * dsrc, float * dweights);

// load (E) += tokens_per_expert; and core/ops.h's moe_expert_bias_update over (rows, E).
void moe_count_tokens(const int64_t * tokens_per_expert, int64_t experts, float * load);
void moe_expert_bias_update(float * load, float * bias, int64_t rows, int64_t experts, float rate);

}  // namespace loom::cpu
