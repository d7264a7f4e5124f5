// The CUDA backend's attention kernels (attention_kernels.cu), as kernels.h: plain launch functions over raw
// device pointers, read by nvcc in C++17, no Loom header but the namespace macro.
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::LOOM_CUDA_NS::kernels {

// ---- Causal attention (backend/cpu/attention.cpp's contract, core/ops.h): qkv rows (s b, row_stride) of
// [Q | K | V], out (s b, nq d), lse (b, nq, s). Flash-style tiles in shared memory: no s x s matrix.
// Probabilities from exp_approx as the CPU's; sums in another order than the CPU's (tiles of 32 keys, warp
// trees), so results agree to rounding, not bitwise. Deterministic: no atomics.
constexpr int64_t kAttentionMaxHeadDim = 256;   // d <= this (per-thread accumulators in registers)
struct AttentionDims {
    int64_t s, b, nq, nkv, d, row_stride;
};
// The attention dropout's key: sample_ids (b, device memory) may be null (sequence bi is sample bi); query
// head hq of the call is head head_offset + hq of the model; keep_scale = 1 / (1 - p) in f32 as the CPU's.
struct AttentionKey {
    bool            dropped;
    uint64_t        seed;
    uint64_t        site;
    const int64_t * sample_ids;
    int64_t         head_offset;
    uint32_t        threshold;
    float           keep_scale;
};
// Each returns the launch's error (a shared-memory attribute refused, a bad launch).
cudaError_t attention_forward(cudaStream_t stream, const float * qkv, float * out, float * lse, const AttentionDims & a,
                              float scale, const AttentionKey & key);
// delta: scratch of b * nq * s floats (rowsum(dO * O), computed first). dqkv's Q, K and V columns are
// assigned (its other columns untouched).
cudaError_t attention_backward(cudaStream_t stream, const float * qkv, const float * out, const float * dout,
                               const float * lse, float * delta, float * dqkv, const AttentionDims & a, float scale,
                               const AttentionKey & key);

}  // namespace loom::LOOM_CUDA_NS::kernels
