// What every kernel file of the CUDA backend shares (kernels.cu, moe_kernels.cu): the launch shape of
// elementwise kernels, the grid-stride loop, the CPU's exp_approx and the block reduction in double. Included by .cu files only;
// each gets its own internal copy.
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdint>

namespace loom::LOOM_CUDA_NS::kernels {

namespace {

constexpr int     kThreads   = 256;
constexpr int64_t kMaxBlocks = 8192;

inline int blocks_for(int64_t n) { return static_cast<int>(std::min<int64_t>((n + kThreads - 1) / kThreads, kMaxBlocks)); }

#define LOOM_GRID_STRIDE(i, n)                                                                         \
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < (n);            \
         i += static_cast<int64_t>(blockDim.x) * gridDim.x)

// backend/cpu/vec_math.h's exp_approx, operation for operation, each rounded on its own (nothing fused).
__device__ __forceinline__ float exp_approx(float x) {
    x       = x < -87.3f ? -87.3f : x;   // std::max(x, -87.3f): a NaN stays
    x       = 88.3f < x ? 88.3f : x;     // std::min(x, 88.3f)
    float k = __fsub_rn(__fadd_rn(__fmul_rn(x, 1.44269504088896341f), 12582912.0f), 12582912.0f);
    float r = __fsub_rn(x, __fmul_rn(k, 0.693145751953125f));
    r       = __fsub_rn(r, __fmul_rn(k, 1.428606765330187e-06f));
    float p = 1.0f / 720.0f;
    p       = __fadd_rn(__fmul_rn(p, r), 1.0f / 120.0f);
    p       = __fadd_rn(__fmul_rn(p, r), 1.0f / 24.0f);
    p       = __fadd_rn(__fmul_rn(p, r), 1.0f / 6.0f);
    p       = __fadd_rn(__fmul_rn(p, r), 0.5f);
    p       = __fadd_rn(__fmul_rn(p, r), 1.0f);
    p       = __fadd_rn(__fmul_rn(p, r), 1.0f);
    k       = k >= -127.0f ? k : -127.0f;
    k       = k <= 128.0f ? k : 128.0f;
    return __fmul_rn(p, __int_as_float((static_cast<int>(k) + 127) << 23));
}

// ---- Block reductions (fixed tree for a fixed block size: deterministic)

__device__ inline double block_sum(double v) {
    __shared__ double warp_sums[32];
    __shared__ double total;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) / 32;
        v = lane < warps ? warp_sums[lane] : 0.0;
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
        if (lane == 0) total = v;
    }
    __syncthreads();
    double result = total;
    __syncthreads();   // warp_sums and total may be reused by the next call
    return result;
}

}  // namespace

}  // namespace loom::LOOM_CUDA_NS::kernels
