// Fused flash attention through cuDNN's graph API (host code): causal softmax attention of bf16 or f16
// queries, keys and values, forward (out and the softmax statistics) and backward (dq, dk, dv), each one
// cuDNN execution plan built once per shape and reused. The operation graphs are written out in
// fused_attention.cpp; docs/gpu.md says what they compute and when the CUDA backend takes this path
// rather than its own kernel (attention_kernels.h), which stays the reference and the path for everything
// this one does not cover (dropout, windows, key masks, context-parallel blocks, f32, odd head sizes).
//
// Layouts are Loom's (core/ops.h's AttentionShape): rows in (s, b) order, query head h's columns h d ..
// h d + d - 1 of its row; the heads as cuDNN's [B, H, S, D] tensors over those strides, no copy. Grouped
// query attention shares key/value head h / (nq / nkv) among the queries, as Loom's kernel does.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "backend/cuda/fused_attention_stats.h"

#include <cuda_runtime.h>

#include <cstdint>
#include <string>

namespace loom::LOOM_CUDA_NS {

// One call's shape: every stride in elements between consecutive (s, b) rows.
struct FusedAttentionShape {
    int64_t b = 0, s = 0, nq = 0, nkv = 0, d = 0;
    int64_t q_row = 0;    // q and dq rows
    int64_t kv_row = 0;   // k, v, dk and dv rows
    int64_t o_row = 0;    // out and dout rows
    bool    bf16 = true;  // else f16

    auto operator<=>(const FusedAttentionShape &) const = default;
};

// Whether this build has the fused path (cuDNN found when it was configured, or the emulated device).
bool fused_attention_built();

// Builds (once per shape and direction) and returns the plan's workspace in bytes, or -1 where cuDNN has
// no engine for the graph (then `why` says what cuDNN said and the caller runs its own kernel). Never call
// it inside a stream capture for a shape not seen before: building a plan may allocate.
int64_t fused_attention_prepare(int device_index, const FusedAttentionShape & shape, bool backward, std::string * why);

// out = softmax(scale q k^T, causal) v and lse = the rows' log-sum-exp of the scaled scores (b, nq, s) f32.
// workspace: the bytes fused_attention_prepare returned, in device memory.
void fused_attention_forward(int device_index, cudaStream_t stream, const FusedAttentionShape & shape, const void * q,
                             const void * k, const void * v, void * out, float * lse, float scale, void * workspace);

// dq, dk, dv (assigned) from out, dout and lse of the forward. dk and dv sum over the query heads that
// share each key/value head.
void fused_attention_backward(int device_index, cudaStream_t stream, const FusedAttentionShape & shape, const void * q,
                              const void * k, const void * v, const void * out, const void * dout, const float * lse,
                              void * dq, void * dk, void * dv, float scale, void * workspace);

}  // namespace loom::LOOM_CUDA_NS
