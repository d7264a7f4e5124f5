// The CUDA backend's attention kernels (attention_kernels.cu), as kernels.h: plain launch functions over raw
// device pointers, read by nvcc in C++17, no Loom header but the namespace macro.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "core/float_bits.h"
#include "core/positions.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::LOOM_CUDA_NS::kernels {

// ---- Causal attention (backend/cpu/attention.cpp's contract, core/ops.h): q rows (s b, row_stride) with Q
// first, kv rows (s_kv b, kv_stride) with K at k_col and V at v_col (q and kv may be the same [Q | K | V]
// rows), key j visible to query i when k_pos(j) <= q_pos(i); out (s b, nq d), lse (b, nq, s); a query that
// sees no key gets out 0 and lse -inf. Flash-style tiles in shared memory: no s x s matrix.
// Probabilities from exp_approx as the CPU's; sums in another order than the CPU's (tiles of 32 keys, warp
// trees), so results agree to rounding, not bitwise. Deterministic: no atomics.
constexpr int64_t kAttentionMaxHeadDim = 256;   // d <= this (per-thread accumulators in registers)
struct AttentionDims {
    int64_t      s, b, nq, nkv, d, row_stride;
    int64_t      s_kv, kv_stride, k_col, v_col;
    SeqPositions q_pos, k_pos;
    int64_t      window;     // AttentionShape::window: -1, or the keys p - window .. p
    const uint8_t * key_mask;   // AttentionShape::key_mask: (b, s, s_kv) in device memory, or null
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
// q, kv, out (and dout, dq, dkv) are E: float or Bf16 (core/float_bits.h), read into f32 tiles and each result
// stored once; lse and delta are f32.
template <class E>
cudaError_t attention_forward(cudaStream_t stream, const E * q, const E * kv, E * out, float * lse,
                              const AttentionDims & a, float scale, const AttentionKey & key);
// delta: scratch of b * nq * s floats (rowsum(dO * O), computed first). dq's Q columns (q's layout) and
// dkv's K and V columns (kv's) are assigned, or added to with accumulate (their other columns untouched).
template <class E>
cudaError_t attention_backward(cudaStream_t stream, const E * q, const E * kv, const E * out, const E * dout,
                               const float * lse, float * delta, E * dq, E * dkv, const AttentionDims & a, float scale,
                               const AttentionKey & key, bool accumulate);
// (out, lse) merged in place with (part_out, part_lse) (core/ops.h's attention_merge): out (s b, nq d), lse
// (b, nq, s).
cudaError_t attention_merge(cudaStream_t stream, float * out, float * lse, const float * part_out,
                            const float * part_lse, int64_t s, int64_t b, int64_t nq, int64_t d);

// Attention sinks (core/ops.h's attention_sink_forward and attention_sink_backward): sink and dsink (nq) f32;
// out and dout E. The backward is one block of kSinkLanes threads per head, thread k summing the lane k of the
// CPU's order, thread 0 the lanes in order.
constexpr int64_t kSinkLanes = 256;
template <class E>
cudaError_t attention_sink_forward(cudaStream_t stream, E * out, float * lse, const float * sink, int64_t s, int64_t b,
                                   int64_t nq, int64_t d);
template <class E>
cudaError_t attention_sink_backward(cudaStream_t stream, const E * out, const E * dout, const float * lse, const float * sink,
                                    float * dsink, int64_t s, int64_t b, int64_t nq, int64_t d);

}  // namespace loom::LOOM_CUDA_NS::kernels
