// The CUDA kernels of the Mixture-of-Experts ops (moe_kernels.cu), twins of backend/cpu/moe.cpp: the same
// double arithmetic in the same order wherever the CPU sums, so the emulated device reproduces the CPU's
// bits and a GPU differs only by its exp and log. Plain launch functions over raw device pointers, as
// kernels.h; read by nvcc in C++17, so no Loom header but the namespace macro.
//
// Legend: n tokens, E experts, k per token, G aux-loss groups, h hidden, R permuted rows.
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::LOOM_CUDA_NS::kernels {

// Most experts a router selects per token on CUDA (a per-thread array).
inline constexpr int64_t kMoeMaxTopk = 64;

// Most groups of group-limited routing (core/ops.h's kMoeMaxGroups): a kept-group bit mask per token.
inline constexpr int64_t kMoeMaxGroups = 64;

struct MoeRoutingArgs {
    int64_t experts;
    int64_t topk;
    bool    sigmoid;
    bool    pre_softmax;
    double  scaling;
    int64_t num_groups;   // group-limited routing (group_topk 0: off)
    int64_t group_topk;
};

struct MoeLossArgs {
    int64_t groups;
    int64_t tokens;
    float   aux_coeff;   // 0: off
    float   z_coeff;     // 0: off
};

// The router's kernels read float or double logits (--moe-router-dtype fp64; dlogits of the same type),
// instantiated for both.
// expert_bias (E) or null: added to the sigmoid scores for the selection only.
template <typename T>
void moe_topk(cudaStream_t stream, const T * logits, int64_t n, const MoeRoutingArgs & r, const float * expert_bias,
              int32_t * top_idx, float * probs);
// load (E) += tokens_per_expert (E); core/ops.h's moe_expert_bias_update over (rows, E).
void moe_count_tokens(cudaStream_t stream, const int64_t * tokens_per_expert, int64_t experts, float * load);
void moe_expert_bias_update(cudaStream_t stream, float * load, float * bias, int64_t rows, int64_t experts, float rate);
// Sinkhorn routing (core/ops.h's moe_sinkhorn_topk) over all N rows of logits, for rows [first, first + n);
// scratch: moe_sinkhorn_scratch(N, E) doubles (C, the two scalings, the changes). The balancing runs in one
// block, in double, with the CPU's operations in the CPU's order.
int64_t moe_sinkhorn_scratch(int64_t N, int64_t experts);
template <typename T>
void    moe_sinkhorn_topk(cudaStream_t stream, const T * logits, int64_t N, int64_t first, int64_t n,
                          const MoeRoutingArgs & r, double * scratch, int32_t * top_idx, float * probs);
// counts (G, E) is zeroed first.
template <typename T>
void moe_aux_counts(cudaStream_t stream, const T * logits, int64_t n, const MoeRoutingArgs & r, int64_t groups,
                    float * counts);
// Scratch doubles moe_router_losses needs.
int64_t moe_router_losses_scratch(int64_t n, int64_t groups, int64_t experts);
template <typename T>
void    moe_router_losses(cudaStream_t stream, const T * logits, int64_t n, const float * counts,
                          const MoeRoutingArgs & r, const MoeLossArgs & loss, double * scratch, float * losses);
template <typename T>
void    moe_router_backward(cudaStream_t stream, const T * logits, int64_t n, const int32_t * top_idx,
                            const float * dprobs, const float * counts, const MoeRoutingArgs & r,
                            const MoeLossArgs & loss, float loss_scale, T * dlogits);

struct MoePlanArgs {
    int64_t first;
    int64_t experts;
    int64_t capacity;   // -1: none
    bool    padded;
    bool    drop_by_probs;
};
// Scratch i32 elements moe_plan needs (counts, offsets, the experts' slot lists and kept flags).
int64_t moe_plan_scratch(int64_t slots, int64_t experts);
void    moe_plan(cudaStream_t stream, const int32_t * expert_of, const float * probs, int64_t n, int64_t k,
                 const MoePlanArgs & spec, float * plan_probs, int32_t * row_of, int32_t * token_of_row,
                 int64_t token_rows, int64_t * tokens_per_expert, int32_t * scratch);
void    moe_plan_experts(cudaStream_t stream, const int32_t * row_of, int64_t slots, const int64_t * tokens_per_expert,
                         int64_t experts, int32_t * expert_of);
void    moe_gather_rows(cudaStream_t stream, const float * x, int64_t m, const int32_t * index, int64_t rows, int64_t h,
                        float * out);
// weights may be null (1).
void    moe_combine(cudaStream_t stream, const float * src, const int32_t * row_of, const float * weights, int64_t n,
                    int64_t k, int64_t h, float * dst);
void    moe_combine_backward(cudaStream_t stream, const float * dy, const float * src, int64_t rows,
                             const float * weights, const int32_t * row_of, const int32_t * token_of_row, int64_t n,
                             int64_t k, int64_t h, float * dsrc, float * dweights);

}  // namespace loom::LOOM_CUDA_NS::kernels
