// The CUDA backend's kernels (kernels.h): simple and correct first, each the twin of a CPU kernel of
// backend/cpu/ops.cpp. Elementwise kernels are grid-stride loops; per-row kernels take one block per row;
// reductions over rows (parameter gradients) add in core/column_sums.h's order, as the CPU does: one thread
// per (column, chunk of rows), then one per column over the chunks' sums. Deterministic, the CPU's f32 sums.
#include "backend/cuda/kernels.h"
#include "backend/cuda/kernel_common.cuh"
#include "backend/cuda/launch.h"
#include "core/column_sums.h"
#include "core/dropout.h"
#include "core/float_bits.h"
#include "core/gelu.h"
#include "core/gemm_f64.h"
#include "core/grad_norm_gate.h"

#include <algorithm>
#include <climits>
#include <cmath>

namespace loom::LOOM_CUDA_NS::kernels {

namespace {

constexpr int64_t kChunk = int64_t{1} << 16;   // sum_of_squares: the CPU's chunk

// The 16-bit conversions are core/float_bits.h's, the host's own.

__device__ __forceinline__ float load_float(const void * p, Float kind, int64_t i) {
    switch (kind) {
        case Float::f32: return static_cast<const float *>(p)[i];
        case Float::bf16: return bf16_bits_to_f32(static_cast<const uint16_t *>(p)[i]);
        default: return f16_bits_to_f32(static_cast<const uint16_t *>(p)[i]);
    }
}

__device__ __forceinline__ void store_float(void * p, Float kind, int64_t i, float v) {
    switch (kind) {
        case Float::f32: static_cast<float *>(p)[i] = v; break;
        case Float::bf16: static_cast<uint16_t *>(p)[i] = f32_to_bf16_bits(v); break;
        default: static_cast<uint16_t *>(p)[i] = f32_to_f16_bits(v); break;
    }
}


// The first maximum of a row, as std::max over its columns in order keeps it (a later equal value, -0 after
// +0 too, does not replace it; NaNs never do): each thread keeps (value, column) of its columns, and pairs
// combine to the greater value, the lower column on ties.
struct MaxAt {
    float     v;
    long long at;
};

__device__ __forceinline__ MaxAt first_max(MaxAt a, MaxAt b) { return a.v < b.v || (a.v == b.v && b.at < a.at) ? b : a; }

__device__ MaxAt block_first_max(MaxAt m) {
    __shared__ float     warp_v[32];
    __shared__ long long warp_at[32];
    __shared__ MaxAt     total;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) {
        MaxAt other{__shfl_down_sync(0xffffffffu, m.v, offset), __shfl_down_sync(0xffffffffu, m.at, offset)};
        m = first_max(m, other);
    }
    if (lane == 0) {
        warp_v[warp]  = m.v;
        warp_at[warp] = m.at;
    }
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) / 32;
        m = lane < warps ? MaxAt{warp_v[lane], warp_at[lane]} : MaxAt{-INFINITY, LLONG_MAX};
        for (int offset = 16; offset > 0; offset /= 2) {
            MaxAt other{__shfl_down_sync(0xffffffffu, m.v, offset), __shfl_down_sync(0xffffffffu, m.at, offset)};
            m = first_max(m, other);
        }
        if (lane == 0) total = m;
    }
    __syncthreads();
    MaxAt result = total;
    __syncthreads();
    return result;
}

// ---- The dropout masks: core/dropout.h's hash functions themselves (host and device).

// ---- Elementwise

__global__ void fill_kernel(float * data, int64_t n, float value) {
    LOOM_GRID_STRIDE(i, n) data[i] = value;
}

__global__ void convert_kernel(const void * src, Float src_kind, void * dst, Float dst_kind, int64_t n) {
    LOOM_GRID_STRIDE(i, n) store_float(dst, dst_kind, i, load_float(src, src_kind, i));
}

// To or from f64: f64 -> f32 rounds once; f32, bf16, f16 -> f64 is exact (op_checks::convert refuses the rest).
__global__ void convert_f64_kernel(const void * src, Float src_kind, void * dst, Float dst_kind, int64_t n) {
    LOOM_GRID_STRIDE(i, n) {
        if (src_kind == Float::f64) {
            const double v = static_cast<const double *>(src)[i];
            if (dst_kind == Float::f64) {
                static_cast<double *>(dst)[i] = v;
            } else {
                static_cast<float *>(dst)[i] = static_cast<float>(v);
            }
        } else {
            static_cast<double *>(dst)[i] = static_cast<double>(load_float(src, src_kind, i));
        }
    }
}

__global__ void bias_add_f64_kernel(double * y, const double * bias, int64_t n, int64_t h) {
    LOOM_GRID_STRIDE(i, n * h) y[i] = gemm_f64_accumulate(y[i], bias[i % h]);
}

__global__ void bias_backward_f64_kernel(const double * dy, double * dbias, int64_t n, int64_t h) {
    LOOM_GRID_STRIDE(c, h) dbias[c] = column_sum_f64(dy, n, h, c, dbias[c]);
}

__global__ void gemm_f64_kernel(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double * a,
                                const double * b, double * c, bool accumulate) {
    LOOM_GRID_STRIDE(e, m * n) {
        const int64_t i = e / n, j = e % n;
        const double  product = gemm_f64_element(a, trans_a, b, trans_b, m, n, k, i, j);
        c[e]                  = accumulate ? gemm_f64_accumulate(c[e], product) : product;
    }
}

__global__ void round_to_bf16_kernel(float * x, uint16_t * x_bf16, int64_t n) {
    LOOM_GRID_STRIDE(i, n) {
        uint16_t bits = f32_to_bf16_bits(x[i]);
        x_bf16[i]     = bits;
        x[i]          = bf16_bits_to_f32(bits);
    }
}

__global__ void scale_kernel(void * x, Float kind, float factor, int64_t n) {
    LOOM_GRID_STRIDE(i, n) store_float(x, kind, i, __fmul_rn(load_float(x, kind, i), factor));
}

// ---- FP8 (core/fp8.h): tensorwise current scaling in three launches: each chunk's largest |x| bit pattern
// (held as a double: exact), the scale from their maximum, then the cast.
__device__ inline double block_max(double v) {
    __shared__ double warp_max[32];
    __shared__ double total;
    const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    for (int offset = 16; offset > 0; offset /= 2) v = fmax(v, __shfl_down_sync(0xffffffffu, v, offset));
    if (lane == 0) warp_max[warp] = v;
    __syncthreads();
    if (warp == 0) {
        const int warps = (blockDim.x + 31) / 32;
        v = lane < warps ? warp_max[lane] : 0.0;
        for (int offset = 16; offset > 0; offset /= 2) v = fmax(v, __shfl_down_sync(0xffffffffu, v, offset));
        if (lane == 0) total = v;
    }
    __syncthreads();
    double result = total;
    __syncthreads();
    return result;
}

__global__ void amax_bits_chunks_kernel(const void * x, Float kind, int64_t n, double * partial) {
    const int64_t begin = blockIdx.x * kChunk, end = min(n, begin + kChunk);
    double        m     = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) {
        m = fmax(m, static_cast<double>(float_to_bits(load_float(x, kind, i)) & 0x7FFFFFFFu));
    }
    m = block_max(m);
    if (threadIdx.x == 0) partial[blockIdx.x] = m;
}

__global__ void fp8_scale_kernel(const double * partial, int64_t chunks, Fp8Format format, float * scale, float * scale_inv) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double m = 0;
    for (int64_t c = 0; c < chunks; ++c) m = fmax(m, partial[c]);
    const float s = fp8_scale_from_amax(bits_to_float(static_cast<uint32_t>(m)), format);
    scale[0]      = s;
    scale_inv[0]  = __fdiv_rn(1.0f, s);
}

__global__ void fp8_cast_kernel(const void * x, Float kind, int64_t n, const float * scale, Fp8Format format, uint16_t * q) {
    const float s = scale[0];
    LOOM_GRID_STRIDE(i, n) q[i] = f32_to_bf16_bits(fp8_round(__fmul_rn(load_float(x, kind, i), s), format));
}

// One CUDA block per quantization block: its amax, then its power-of-two scale.
__global__ void fp8_block_scale_kernel(const void * x, Float kind, int64_t rows, int64_t cols, Fp8Format format,
                                       int64_t br, int64_t bc, float * scale, bool mx) {
    const int64_t per_row = (cols + bc - 1) / bc;
    const int64_t r0 = (blockIdx.x / per_row) * br, c0 = (blockIdx.x % per_row) * bc;
    const int64_t h = min(br, rows - r0), w = min(bc, cols - c0);
    double        m = 0;
    for (int64_t i = threadIdx.x; i < h * w; i += blockDim.x) {
        m = fmax(m, static_cast<double>(float_to_bits(load_float(x, kind, (r0 + i / w) * cols + c0 + i % w)) & 0x7FFFFFFFu));
    }
    m = block_max(m);
    if (threadIdx.x == 0) {
        const float amax  = bits_to_float(static_cast<uint32_t>(m));
        scale[blockIdx.x] = mx ? mxfp8_block_scale(amax, format) : fp8_scale_from_amax(amax, format, true);
    }
}

__global__ void fp8_block_cast_kernel(const void * x, Float kind, int64_t rows, int64_t cols, Fp8Format format, int64_t br,
                                      int64_t bc, const float * scale, uint16_t * q) {
    const int64_t per_row = (cols + bc - 1) / bc;
    LOOM_GRID_STRIDE(i, rows * cols) {
        const int64_t r = i / cols, c = i % cols;
        const float   s = scale[(r / br) * per_row + c / bc];
        q[i] = f32_to_bf16_bits(__fdiv_rn(fp8_round(__fmul_rn(load_float(x, kind, i), s), format), s));
    }
}

__global__ void fp8_amax_fold_kernel(const double * partial, int64_t chunks, float * amax) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    double m = static_cast<double>(float_to_bits(amax[0]) & 0x7FFFFFFFu);
    for (int64_t c = 0; c < chunks; ++c) m = fmax(m, partial[c]);
    amax[0] = bits_to_float(static_cast<uint32_t>(m));
}

// Every thread forms s from amax itself; the first also writes 1 / s.
__global__ void fp8_encode_kernel(const float * x, int64_t n, Fp8Format format, const float * amax, uint8_t * codes,
                                  float * scale_inv) {
    const float s = fp8_scale_from_amax(amax[0], format);
    if (blockIdx.x == 0 && threadIdx.x == 0) scale_inv[0] = __fdiv_rn(1.0f, s);
    LOOM_GRID_STRIDE(i, n) codes[i] = fp8_from_f32(__fmul_rn(x[i], s), format);
}

// One thread per row, as the CPU's loops (its sum in j order).
// sigmoid_rn(v) = 1 / (1 + e^-v) in f32, each operation rounded once: the CPU's sigmoid_f32 (backend/cpu/ops.h).
__device__ inline float sigmoid_rn(float v) { return __fdiv_rn(1.0f, __fadd_rn(1.0f, expf(-v))); }

__global__ void sigmoid_gate_forward_kernel(float * y, const float * logits, int64_t n, int64_t h) {
    LOOM_GRID_STRIDE(r, n) {
        const float g = sigmoid_rn(logits[r]);
        for (int64_t j = 0; j < h; ++j) y[r * h + j] = __fmul_rn(y[r * h + j], g);
    }
}

__global__ void sigmoid_gate_backward_kernel(const float * dy, const float * m, const float * logits, float * dm,
                                             float * dlogits, int64_t n, int64_t h) {
    LOOM_GRID_STRIDE(r, n) {
        const float g   = sigmoid_rn(logits[r]);
        float       sum = 0.0f;
        for (int64_t j = 0; j < h; ++j) sum = __fadd_rn(sum, __fmul_rn(dy[r * h + j], m[r * h + j]));
        dlogits[r] = __fmul_rn(sum, __fmul_rn(g, __fsub_rn(1.0f, g)));
        for (int64_t j = 0; j < h; ++j) dm[r * h + j] = __fmul_rn(dy[r * h + j], g);
    }
}

__global__ void fp8_scale_inv_kernel(const float * scale, float * scale_inv) {
    if (threadIdx.x == 0 && blockIdx.x == 0) scale_inv[0] = __fdiv_rn(1.0f, scale[0]);
}

// One thread per operand (column of the history), as the CPU's loop.
__global__ void fp8_delayed_update_kernel(float * h, float * scale, int64_t len, int64_t n, Fp8Format format, int margin,
                                          bool max_algo) {
    LOOM_GRID_STRIDE(j, n) {
        float amax = h[j];
        if (max_algo) {
            for (int64_t r = 1; r < len; ++r) {
                if (h[r * n + j] > amax) amax = h[r * n + j];
            }
        }
        scale[j]        = fp8_delayed_scale(amax, scale[j], format, margin);
        const float now = h[j];
        for (int64_t r = 0; r + 1 < len; ++r) h[r * n + j] = h[(r + 1) * n + j];
        h[(len - 1) * n + j] = now;
        h[j]                 = 0.0f;
    }
}

__global__ void fp8_decode_kernel(const uint8_t * codes, int64_t n, Fp8Format format, uint16_t * q) {
    LOOM_GRID_STRIDE(i, n) q[i] = f32_to_bf16_bits(f32_from_fp8(codes[i], format));
}

__global__ void scale_by_reciprocal_kernel(float * t, const float * d, int64_t n) {
    const float f = __fdiv_rn(1.0f, d[0]);
    LOOM_GRID_STRIDE(i, n) t[i] = __fmul_rn(t[i], f);
}

__global__ void scale_by_product_kernel(float * t, const float * a, const float * b, int64_t n) {
    const float p = __fmul_rn(a[0], b[0]);
    LOOM_GRID_STRIDE(i, n) t[i] = __fmul_rn(t[i], p);
}

// Every thread forms the same inv from the pair (double arithmetic, as the CPU's).
__global__ void scale_by_inverse_norm_kernel(float * x, const float * sums, double eps, int64_t n) {
    const double norm = sqrt(static_cast<double>(sums[0]) + static_cast<double>(sums[1]));
    const float  inv  = static_cast<float>(1.0 / (norm > eps ? norm : eps));
    LOOM_GRID_STRIDE(i, n) x[i] = __fmul_rn(x[i], inv);
}

// Kernels over activations take them as T, float or Bf16 (core/float_bits.h): each element is read as f32
// (to_f32), the arithmetic is f32 and each result is stored once (from_f32<T>, round to nearest even).

template <class T>
__global__ void add_inplace_kernel(T * y, const T * x, int64_t n) {
    LOOM_GRID_STRIDE(i, n) y[i] = from_f32<T>(__fadd_rn(to_f32(y[i]), to_f32(x[i])));
}

template <class T>
__global__ void bias_add_kernel(T * y, const float * bias, int64_t n, int64_t h) {
    LOOM_GRID_STRIDE(i, n * h) y[i] = from_f32<T>(__fadd_rn(to_f32(y[i]), bias[i % h]));
}

// ---- Column sums in core/column_sums.h's order. Stage 1: thread (column j, chunk c) of a grid
// (h / kThreads, chunks) sums its chunk's rows, chunk 0 from the accumulator, into partial[c][j]; stage 2
// (column_total_kernel) adds the chunks' sums in order into the accumulator. One chunk: stage 1 writes the
// accumulator itself (partial == acc) and stage 2 is not launched.

template <class T>
__global__ void bias_backward_kernel(const T * dy, const float * dbias, float * partial, int64_t n, int64_t h,
                                     int64_t chunks) {
    const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (j >= h) return;
    for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
        const int64_t r1  = min(n, (c + 1) * kColumnSumRows);
        float         acc = c == 0 ? dbias[j] : 0.0f;
        for (int64_t r = c * kColumnSumRows; r < r1; ++r) acc = __fadd_rn(acc, to_f32(dy[r * h + j]));
        partial[c * h + j] = acc;
    }
}

__global__ void column_total_kernel(const float * partial, float * acc, int64_t h, int64_t chunks) {
    LOOM_GRID_STRIDE(j, h) {
        float sum = partial[j];
        for (int64_t c = 1; c < chunks; ++c) sum = __fadd_rn(sum, partial[c * h + j]);
        acc[j] = sum;
    }
}

// The stage-1 grid of a column sum: a thread per column (x) and chunk (y, at most CUDA's 65535, the rest by
// stride).
dim3 column_sum_grid(int64_t h, int64_t chunks) {
    return dim3(static_cast<unsigned>((h + kThreads - 1) / kThreads), static_cast<unsigned>(std::min<int64_t>(chunks, 65535)));
}

// ---- Sum of squares

// One chunk's sum of squares, by the calling block: the single-tensor and multi-tensor kernels share it.
__device__ inline double chunk_sum_of_squares(const float * x, int64_t n, int64_t chunk) {
    const int64_t begin = chunk * kChunk;
    const int64_t end   = min(n, begin + kChunk);
    double        s     = 0;
    for (int64_t i = begin + threadIdx.x; i < end; i += blockDim.x) s += static_cast<double>(x[i]) * x[i];
    return block_sum(s);
}

// The partials of one tensor added in chunk order, written as the (hi, lo) pair.
__device__ inline void chunks_total(const double * partial, int64_t chunks, float * out) {
    double total = 0;
    for (int64_t c = 0; c < chunks; ++c) total += partial[c];
    const float hi = static_cast<float>(total);
    out[0]         = hi;
    out[1]         = static_cast<float>(total - static_cast<double>(hi));
}

__global__ void sum_of_squares_chunks_kernel(const float * x, int64_t n, double * partial) {
    const double s = chunk_sum_of_squares(x, n, blockIdx.x);
    if (threadIdx.x == 0) partial[blockIdx.x] = s;
}

__global__ void sum_of_squares_total_kernel(const double * partial, int64_t chunks, float * out) {
    if (threadIdx.x != 0 || blockIdx.x != 0) return;
    chunks_total(partial, chunks, out);
}

// The last of `count` ranges, starting at begin[0] <= begin[1] <= ..., that starts at or before i: the range
// holding i (an empty range shares its start with the next, which wins).
__device__ inline int range_of(const int64_t * begin, int count, int64_t i) {
    int lo = 0, hi = count - 1;
    while (lo < hi) {
        const int mid = (lo + hi + 1) / 2;
        if (begin[mid] <= i) {
            lo = mid;
        } else {
            hi = mid - 1;
        }
    }
    return lo;
}

__global__ void sum_of_squares_multi_chunks_kernel(SquaresMulti tensors, double * partial) {
    const int64_t c  = blockIdx.x;
    const int     lo = range_of(tensors.chunk_begin, tensors.count, c);
    const double s = chunk_sum_of_squares(tensors.x[lo], tensors.n[lo], c - tensors.chunk_begin[lo]);
    if (threadIdx.x == 0) partial[c] = s;
}

__global__ void sum_of_squares_multi_total_kernel(SquaresMulti tensors, const double * partial, float * out) {
    const int t = blockIdx.x * blockDim.x + threadIdx.x;
    if (t >= tensors.count) return;
    chunks_total(partial + tensors.chunk_begin[t], tensors.chunk_begin[t + 1] - tensors.chunk_begin[t], out + 2 * t);
}

// ---- Norms

template <class T>
__global__ void layernorm_forward_kernel(T * x, const T * residual, const float * gamma, const float * beta, T * y,
                                         float * mean, float * rstd, int64_t h, float eps, bool rms) {
    const int64_t r  = blockIdx.x;
    T *           xr = x + r * h;
    T *           yr = y + r * h;
    double        sum = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {   // each thread reads back only what it wrote
        float v = to_f32(xr[j]);
        if (residual != nullptr) {
            const T stored = from_f32<T>(__fadd_rn(v, to_f32(residual[r * h + j])));
            xr[j]          = stored;
            v              = to_f32(stored);   // the norm reads the sum as stored
        }
        sum += rms ? static_cast<double>(v) * v : static_cast<double>(v);
    }
    sum = block_sum(sum);
    if (rms) {
        const float rs = 1.0f / sqrtf(static_cast<float>(sum / h) + eps);
        for (int64_t j = threadIdx.x; j < h; j += blockDim.x) yr[j] = from_f32<T>(to_f32(xr[j]) * rs * gamma[j]);
        if (threadIdx.x == 0) rstd[r] = rs;
        return;
    }
    const float m   = static_cast<float>(sum / h);
    double      var = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
        float c = to_f32(xr[j]) - m;
        var += static_cast<double>(c) * c;
    }
    var            = block_sum(var);
    const float rs = 1.0f / sqrtf(static_cast<float>(var / h) + eps);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
        float v = (to_f32(xr[j]) - m) * rs * gamma[j];
        yr[j]   = from_f32<T>(beta != nullptr ? v + beta[j] : v);
    }
    if (threadIdx.x == 0) {
        mean[r] = m;
        rstd[r] = rs;
    }
}

// dx of one row per block. LayerNorm: dx = rstd (g - mean(g) - xhat mean(g xhat)); RMSNorm (mean null):
// dx = rstd (g - xhat mean(g xhat)); g = dy gamma.
template <class T>
__global__ void norm_backward_dx_kernel(const T * dy, const T * x, const float * gamma, const float * mean,
                                        const float * rstd, T * dx, const T * dres, int64_t h) {
    const int64_t r   = blockIdx.x;
    const T *     dyr = dy + r * h;
    const T *     xr  = x + r * h;
    const float   m   = mean != nullptr ? mean[r] : 0.0f;
    const float   rs  = rstd[r];
    double        sum_g = 0, sum_gx = 0;
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
        float g    = to_f32(dyr[j]) * gamma[j];
        float xhat = mean != nullptr ? (to_f32(xr[j]) - m) * rs : to_f32(xr[j]) * rs;
        sum_g += g;
        sum_gx += static_cast<double>(g) * xhat;
    }
    sum_gx = block_sum(sum_gx);
    if (mean != nullptr) sum_g = block_sum(sum_g);
    const float mg = static_cast<float>(sum_g / h), mgx = static_cast<float>(sum_gx / h);
    for (int64_t j = threadIdx.x; j < h; j += blockDim.x) {
        float v;
        if (mean != nullptr) {
            float xhat = (to_f32(xr[j]) - m) * rs;
            v          = rs * (to_f32(dyr[j]) * gamma[j] - mg - xhat * mgx);
        } else {
            v = rs * (to_f32(dyr[j]) * gamma[j] - to_f32(xr[j]) * rs * mgx);
        }
        dx[r * h + j] = from_f32<T>(dres != nullptr ? __fadd_rn(v, to_f32(dres[r * h + j])) : v);
    }
}

// dgamma[j] += sum_r dy (x - mean) rstd (mean null: dy x rstd); dbeta[j] += sum_r dy (dbeta may be null):
// stage 1 of two column sums at once, into partial_g and partial_b (core/column_sums.h's order).
template <class T>
__global__ void norm_backward_params_kernel(const T * dy, const T * x, const float * mean, const float * rstd,
                                            const float * dgamma, const float * dbeta, float * partial_g,
                                            float * partial_b, int64_t n, int64_t h, int64_t chunks) {
    const int64_t j = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (j >= h) return;
    for (int64_t c = blockIdx.y; c < chunks; c += gridDim.y) {
        const int64_t r1 = min(n, (c + 1) * kColumnSumRows);
        float         dg = c == 0 ? dgamma[j] : 0.0f;
        float         db = c == 0 && dbeta != nullptr ? dbeta[j] : 0.0f;
        for (int64_t r = c * kColumnSumRows; r < r1; ++r) {
            const float d = to_f32(dy[r * h + j]), xv = to_f32(x[r * h + j]);
            dg += mean != nullptr ? d * (xv - mean[r]) * rstd[r] : d * xv * rstd[r];
            db += d;
        }
        partial_g[c * h + j] = dg;
        if (dbeta != nullptr) partial_b[c * h + j] = db;
    }
}

// ---- Activations

__device__ __forceinline__ float gelu(float v) { return gelu_from_tanh(v, tanhf(gelu_tanh_arg(v))); }

template <class T>
__global__ void bias_gelu_forward_kernel(T * x, const float * bias, T * y, uint16_t * x_bf16, int64_t n, int64_t f) {
    LOOM_GRID_STRIDE(i, n * f) {
        float v = bias != nullptr ? to_f32(x[i]) + bias[i % f] : to_f32(x[i]);
        if (x_bf16 != nullptr) {
            uint16_t bits = f32_to_bf16_bits(v);
            x_bf16[i]     = bits;
            y[i]          = from_f32<T>(gelu(bf16_bits_to_f32(bits)));
        } else {
            const T stored = from_f32<T>(v);   // gelu reads the biased value as stored
            x[i]           = stored;
            y[i]           = from_f32<T>(gelu(to_f32(stored)));
        }
    }
}

template <class T>
__global__ void gelu_backward_kernel(const T * x, const T * dy, T * dx, int64_t count) {
    LOOM_GRID_STRIDE(i, count) {
        const float v = to_f32(x[i]);
        dx[i]         = from_f32<T>(to_f32(dy[i]) * gelu_grad_from_tanh(v, tanhf(gelu_tanh_arg(v))));
    }
}

// ---- The gated delta rule (Ops::gated_delta_rule_forward / _backward; backend/cpu/delta_rule.cpp runs the same
// loops in the same order). Thread j owns column j of the state S (dk x dv, row-major in the block's workspace
// region), thread i row i in the backward's row phase; thread 0 sums the partials. Products and sums rounded
// one by one (no contraction).

constexpr int kDeltaRuleMax = 256;

// One step of the rule on column j of S: decays it, forms u_j and adds k u_j; returns the column's output
// sum over qh (when qh is given).
__device__ inline float delta_rule_column(float * S, int64_t j, const float * ks, const float * qh, float decay, float beta,
                                          float v, int64_t dk, int64_t dv) {
    float w = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
        const float decayed = __fmul_rn(decay, S[i * dv + j]);
        S[i * dv + j]       = decayed;
        w                   = __fadd_rn(w, __fmul_rn(decayed, ks[i]));
    }
    const float u   = __fmul_rn(beta, __fsub_rn(v, w));
    float       acc = 0.0f;
    for (int64_t i = 0; i < dk; ++i) {
        const float next = __fadd_rn(S[i * dv + j], __fmul_rn(ks[i], u));
        S[i * dv + j]    = next;
        if (qh) acc = __fadd_rn(acc, __fmul_rn(next, qh[i]));
    }
    return acc;
}

__global__ void delta_rule_forward_kernel(const float * q, const float * k, const float * v, const float * g,
                                          const float * beta, float * o, float * workspace, DeltaRuleDims d) {
    __shared__ float qh[kDeltaRuleMax], ks[kDeltaRuleMax];
    const int64_t    p = blockIdx.x, bi = p / d.heads, h = p % d.heads, j = threadIdx.x;
    float *          S = workspace + p * d.region;
    if (j < d.dv) {
        for (int64_t i = 0; i < d.dk; ++i) S[i * d.dv + j] = 0.0f;
    }
    for (int64_t t = 0; t < d.s; ++t) {
        const int64_t r = (t * d.b + bi) * d.heads + h;
        if (j < d.dk) {
            qh[j] = __fmul_rn(d.scale, q[r * d.dk + j]);
            ks[j] = k[r * d.dk + j];
        }
        __syncthreads();
        if (j < d.dv) o[r * d.dv + j] = delta_rule_column(S, j, ks, qh, expf(g[r]), beta[r], v[r * d.dv + j], d.dk, d.dv);
        __syncthreads();
    }
}

__global__ void delta_rule_backward_kernel(const float * q, const float * k, const float * v, const float * g,
                                           const float * beta, const float * dout, float * dq, float * dk, float * dv,
                                           float * dg, float * dbeta, float * workspace, DeltaRuleDims d) {
    __shared__ float qh[kDeltaRuleMax], ks[kDeltaRuleMax], dos[kDeltaRuleMax], u[kDeltaRuleMax], rs[kDeltaRuleMax];
    __shared__ float dw[kDeltaRuleMax], pb[kDeltaRuleMax], rp[kDeltaRuleMax];
    const int64_t    p = blockIdx.x, bi = p / d.heads, h = p % d.heads, x = threadIdx.x;
    const int64_t    K = d.dk, V = d.dv, KV = K * V, chunks = (d.s + d.chunk - 1) / d.chunk;
    float *          kept = workspace + p * d.region;
    float *          prev = kept + chunks * KV;
    float *          dS   = prev + d.chunk * KV;
    // The forward again (dS as the running state), keeping the state before every chunk.
    if (x < V) {
        for (int64_t i = 0; i < K; ++i) dS[i * V + x] = 0.0f;
    }
    for (int64_t t = 0; t < d.s; ++t) {
        const int64_t r = (t * d.b + bi) * d.heads + h;
        if (x < K) ks[x] = k[r * K + x];
        __syncthreads();
        if (x < V) {
            if (t % d.chunk == 0) {
                for (int64_t i = 0; i < K; ++i) kept[t / d.chunk * KV + i * V + x] = dS[i * V + x];
            }
            delta_rule_column(dS, x, ks, nullptr, expf(g[r]), beta[r], v[r * V + x], K, V);
        }
        __syncthreads();
    }
    if (x < V) {
        for (int64_t i = 0; i < K; ++i) dS[i * V + x] = 0.0f;
    }
    for (int64_t c = chunks - 1; c >= 0; --c) {
        const int64_t t0 = c * d.chunk, t1 = t0 + d.chunk < d.s ? t0 + d.chunk : d.s;
        if (x < V) {
            for (int64_t i = 0; i < K; ++i) prev[i * V + x] = kept[c * KV + i * V + x];
        }
        for (int64_t t = t0; t + 1 < t1; ++t) {   // the chunk's states before each of its steps
            const int64_t r = (t * d.b + bi) * d.heads + h;
            if (x < K) ks[x] = k[r * K + x];
            __syncthreads();
            if (x < V) {
                float * next = prev + (t - t0 + 1) * KV;
                for (int64_t i = 0; i < K; ++i) next[i * V + x] = prev[(t - t0) * KV + i * V + x];
                delta_rule_column(next, x, ks, nullptr, expf(g[r]), beta[r], v[r * V + x], K, V);
            }
            __syncthreads();
        }
        for (int64_t t = t1 - 1; t >= t0; --t) {
            const int64_t r     = (t * d.b + bi) * d.heads + h;
            const float   decay = expf(g[r]), bt = beta[r];
            const float * Sp    = prev + (t - t0) * KV;
            if (x < K) {
                qh[x] = __fmul_rn(d.scale, q[r * K + x]);
                ks[x] = k[r * K + x];
            }
            if (x < V) dos[x] = dout[r * V + x];
            __syncthreads();
            if (x < V) {   // column x
                float w = 0.0f;
                for (int64_t i = 0; i < K; ++i) w = __fadd_rn(w, __fmul_rn(__fmul_rn(decay, Sp[i * V + x]), ks[i]));
                rs[x]    = __fsub_rn(v[r * V + x], w);
                u[x]     = __fmul_rn(bt, rs[x]);
                float du = 0.0f;
                for (int64_t i = 0; i < K; ++i) {
                    dS[i * V + x] = __fadd_rn(dS[i * V + x], __fmul_rn(qh[i], dos[x]));
                    du            = __fadd_rn(du, __fmul_rn(dS[i * V + x], ks[i]));
                }
                dw[x]         = -__fmul_rn(bt, du);
                dv[r * V + x] = __fmul_rn(bt, du);
                pb[x]         = __fmul_rn(du, rs[x]);
            }
            __syncthreads();
            if (x < K) {   // row x
                float a = 0.0f, b1 = 0.0f, b2 = 0.0f, part = 0.0f;
                for (int64_t j = 0; j < V; ++j) {
                    const float decayed = __fmul_rn(decay, Sp[x * V + j]);
                    a    = __fadd_rn(a, __fmul_rn(__fadd_rn(decayed, __fmul_rn(ks[x], u[j])), dos[j]));
                    b1   = __fadd_rn(b1, __fmul_rn(dS[x * V + j], u[j]));
                    b2   = __fadd_rn(b2, __fmul_rn(decayed, dw[j]));
                    part = __fadd_rn(part, __fmul_rn(decayed, __fadd_rn(dS[x * V + j], __fmul_rn(ks[x], dw[j]))));
                }
                dq[r * K + x] = __fmul_rn(d.scale, a);
                dk[r * K + x] = __fadd_rn(b1, b2);
                rp[x]         = part;
            }
            __syncthreads();
            if (x == 0) {
                float sb = 0.0f, sg = 0.0f;
                for (int64_t j = 0; j < V; ++j) sb = __fadd_rn(sb, pb[j]);
                for (int64_t i = 0; i < K; ++i) sg = __fadd_rn(sg, rp[i]);
                dbeta[r] = sb;
                dg[r]    = sg;
            }
            if (x < V) {   // dS of the state before step t
                for (int64_t i = 0; i < K; ++i) {
                    dS[i * V + x] = __fmul_rn(decay, __fadd_rn(dS[i * V + x], __fmul_rn(ks[i], dw[x])));
                }
            }
            __syncthreads();
        }
    }
}

// ---- The short convolution (Ops::causal_conv_silu_forward / _backward), as backend/cpu/delta_rule.cpp forms it.

__device__ inline float conv_pre(const float * x, const float * w, int64_t t, int64_t bi, int64_t c, int64_t b, int64_t C,
                                 int64_t K) {
    float pre = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
        const int64_t at = t - K + 1 + j;
        if (at >= 0) pre = __fadd_rn(pre, __fmul_rn(w[c * K + j], x[(at * b + bi) * C + c]));
    }
    return pre;
}

__device__ inline float silu_grad(float pre) {
    const float s = sigmoid_rn(pre);
    return __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(pre, __fsub_rn(1.0f, s))));
}

__global__ void causal_conv_forward_kernel(const float * x, const float * w, float * y, int64_t s, int64_t b, int64_t C,
                                           int64_t K) {
    LOOM_GRID_STRIDE(i, s * b * C) {
        const int64_t r = i / C, c = i % C;
        const float   pre = conv_pre(x, w, r / b, r % b, c, b, C, K);
        y[i]              = __fdiv_rn(pre, __fadd_rn(1.0f, expf(-pre)));
    }
}

__global__ void causal_conv_dx_kernel(const float * x, const float * w, const float * dy, float * dx, int64_t s, int64_t b,
                                      int64_t C, int64_t K) {
    LOOM_GRID_STRIDE(i, s * b * C) {
        const int64_t r = i / C, c = i % C, t = r / b, bi = r % b;
        float         acc = 0.0f;
        for (int64_t j = 0; j < K; ++j) {
            const int64_t out = t + K - 1 - j;
            if (out >= s) continue;
            const float dpre = __fmul_rn(dy[(out * b + bi) * C + c], silu_grad(conv_pre(x, w, out, bi, c, b, C, K)));
            acc              = __fadd_rn(acc, __fmul_rn(w[c * K + j], dpre));
        }
        dx[i] = acc;
    }
}

__global__ void causal_conv_dw_kernel(const float * x, const float * w, const float * dy, float * dw, int64_t s, int64_t b,
                                      int64_t C, int64_t K) {
    LOOM_GRID_STRIDE(e, C * K) {
        const int64_t c = e / K, j = e % K;
        float         acc = 0.0f;
        for (int64_t r = 0; r < s * b; ++r) {
            const int64_t t = r / b, bi = r % b, at = t - K + 1 + j;
            if (at < 0) continue;
            const float dpre = __fmul_rn(dy[r * C + c], silu_grad(conv_pre(x, w, t, bi, c, b, C, K)));
            acc              = __fadd_rn(acc, __fmul_rn(dpre, x[(at * b + bi) * C + c]));
        }
        dw[e] = __fadd_rn(dw[e], acc);
    }
}

__device__ inline float gate_act(float g, GateActivation act) {
    return act == GateActivation::silu ? __fmul_rn(g, sigmoid_rn(g)) : sigmoid_rn(g);
}

__device__ inline float gate_act_grad(float g, GateActivation act) {
    if (act == GateActivation::silu) return silu_grad(g);
    const float s = sigmoid_rn(g);
    return __fmul_rn(s, __fsub_rn(1.0f, s));
}

template <class T>
__global__ void output_gate_forward_kernel(const T * x, const T * gate, int64_t stride, T * y, int64_t n, int64_t w,
                                           GateActivation act) {
    LOOM_GRID_STRIDE(i, n * w) {
        const int64_t r = i / w, j = i % w;
        y[i] = from_f32<T>(__fmul_rn(to_f32(x[i]), gate_act(to_f32(gate[r * stride + j]), act)));
    }
}

template <class T>
__global__ void output_gate_backward_kernel(const T * x, const T * gate, int64_t stride, const T * dy, T * dx, T * dgate,
                                            int64_t n, int64_t w, GateActivation act) {
    LOOM_GRID_STRIDE(i, n * w) {
        const int64_t r = i / w, j = i % w;
        const float   g = to_f32(gate[r * stride + j]), d = to_f32(dy[i]);
        dgate[i]        = from_f32<T>(__fmul_rn(__fmul_rn(d, to_f32(x[i])), gate_act_grad(g, act)));
        dx[i]           = from_f32<T>(__fmul_rn(d, gate_act(g, act)));
    }
}

// ---- The L2 norm (Ops::l2norm_forward / _backward): a thread per row, its sums in index order.

__global__ void l2norm_forward_kernel(const float * x, float * y, float * rstd, int64_t rows, int64_t d, float eps) {
    LOOM_GRID_STRIDE(r, rows) {
        const float * xr = x + r * d;
        float         ss = 0.0f;
        for (int64_t i = 0; i < d; ++i) ss = __fadd_rn(ss, __fmul_rn(xr[i], xr[i]));
        const float inv = __fdiv_rn(1.0f, __fsqrt_rn(__fadd_rn(ss, eps)));
        rstd[r]         = inv;
        for (int64_t i = 0; i < d; ++i) y[r * d + i] = __fmul_rn(xr[i], inv);
    }
}

__global__ void l2norm_backward_kernel(const float * dy, const float * y, const float * rstd, float * dx, int64_t rows,
                                       int64_t d) {
    LOOM_GRID_STRIDE(r, rows) {
        const float * dyr = dy + r * d;
        const float * yr  = y + r * d;
        float         dot = 0.0f;
        for (int64_t i = 0; i < d; ++i) dot = __fadd_rn(dot, __fmul_rn(dyr[i], yr[i]));
        for (int64_t i = 0; i < d; ++i) dx[r * d + i] = __fmul_rn(rstd[r], __fsub_rn(dyr[i], __fmul_rn(yr[i], dot)));
    }
}

// ---- DeepSeek Sparse Attention's indexer (Ops::dsa_*), as backend/cpu/dsa.cpp forms it: a thread per score, per
// query row and head, per key row or per target row, every sum in the CPU's index order, nothing fused.

__device__ inline float dsa_dot(const float * a, const float * b, int64_t d) {
    float sum = 0.0f;
    for (int64_t x = 0; x < d; ++x) sum = __fadd_rn(sum, __fmul_rn(a[x], b[x]));
    return sum;
}

__global__ void dsa_index_scores_kernel(const float * q, const float * k, const float * w, float * scores, DsaRows rows,
                                        int64_t H, int64_t d, bool relu) {
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    LOOM_GRID_STRIDE(e, b * s * S) {
        const int64_t bi = e / (s * S), i = e / S % s, j = e % S, ri = i * b + bi;
        if (j > rows.last(i)) {
            scores[e] = -INFINITY;
            continue;
        }
        float sum = 0.0f;
        for (int64_t h = 0; h < H; ++h) {
            const float z = dsa_dot(q + (ri * H + h) * d, k + (j * b + bi) * d, d);
            sum           = __fadd_rn(sum, __fmul_rn(w[ri * H + h], relu ? fmaxf(z, 0.0f) : z));
        }
        scores[e] = sum;
    }
}

__global__ void dsa_index_dq_kernel(const float * q, const float * k, const float * w, const float * dscores, float * dq,
                                    float * dw, DsaRows rows, int64_t H, int64_t d, bool relu) {
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    LOOM_GRID_STRIDE(e, s * b * H) {   // (bi, i, h)
        const int64_t bi = e / (s * H), i = e / H % s, h = e % H, ri = i * b + bi, last = rows.last(i);
        const float * qh  = q + (ri * H + h) * d;
        float *       dqh = dq + (ri * H + h) * d;
        for (int64_t x = 0; x < d; ++x) dqh[x] = 0.0f;
        float dwh = 0.0f;
        for (int64_t j = 0; j <= last; ++j) {
            const float * kj = k + (j * b + bi) * d;
            const float   z  = dsa_dot(qh, kj, d);
            if (relu && !(z > 0.0f)) continue;
            const float g = dscores[(bi * s + i) * S + j];
            dwh           = __fadd_rn(dwh, __fmul_rn(g, z));
            const float dz = __fmul_rn(g, w[ri * H + h]);
            for (int64_t x = 0; x < d; ++x) dqh[x] = __fadd_rn(dqh[x], __fmul_rn(dz, kj[x]));
        }
        dw[ri * H + h] = dwh;
    }
}

__global__ void dsa_index_dk_kernel(const float * q, const float * k, const float * w, const float * dscores, float * dk,
                                    DsaRows rows, int64_t H, int64_t d, bool relu) {
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    LOOM_GRID_STRIDE(e, S * b) {   // (bi, j)
        const int64_t bi = e / S, j = e % S, rj = j * b + bi;
        const float * kj  = k + rj * d;
        float *       dkj = dk + rj * d;
        for (int64_t x = 0; x < d; ++x) dkj[x] = 0.0f;
        for (int64_t i = 0; i < s; ++i) {
            if (rows.last(i) < j) continue;
            const int64_t ri = i * b + bi;
            const float   g  = dscores[(bi * s + i) * S + j];
            for (int64_t h = 0; h < H; ++h) {
                const float * qh = q + (ri * H + h) * d;
                const float   z  = dsa_dot(qh, kj, d);
                if (relu && !(z > 0.0f)) continue;
                const float dz = __fmul_rn(g, w[ri * H + h]);
                for (int64_t x = 0; x < d; ++x) dkj[x] = __fadd_rn(dkj[x], __fmul_rn(dz, qh[x]));
            }
        }
    }
}

template <class T>
__device__ inline float dsa_logit(const T * q, const T * k, int64_t d, float scale) {
    float dot = 0.0f;
    for (int64_t x = 0; x < d; ++x) dot = __fadd_rn(dot, __fmul_rn(to_f32(q[x]), to_f32(k[x])));
    return __fmul_rn(scale, dot);
}

// A thread per score (bi, i, j): key j's rank among row i's causal keys (how many outrank it: a higher score, or
// the same and earlier), held when below k. The CPU finds the same set by selection.
__global__ void dsa_topk_mask_kernel(const float * scores, int64_t k, uint8_t * mask, DsaRows rows) {
    const int64_t s = rows.s, S = rows.keys;
    LOOM_GRID_STRIDE(e, rows.b * s * S) {
        const int64_t j = e % S, last = rows.last(e / S % s);
        const float * row  = scores + (e - j);
        bool          held = j <= last;
        if (held && last + 1 > k) {
            const float v    = row[j];
            int64_t     rank = 0;
            for (int64_t x = 0; x <= last && rank < k; ++x) rank += row[x] > v || (row[x] == v && x < j);
            held = rank < k;
        }
        mask[e] = held ? 1 : 0;
    }
}

template <class T>
__global__ void dsa_attention_target_kernel(const T * q_k_v, const T * kv, float * target, DsaRows rows, int64_t heads,
                                            int64_t d, int64_t row_stride, int64_t kv_stride, int64_t k_col,
                                            float scale, const uint8_t * key_mask) {
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    LOOM_GRID_STRIDE(e, b * s) {   // (bi, i)
        const int64_t   bi = e / s, i = e % s, last = rows.last(i);
        float *         out  = target + e * S;
        const uint8_t * held = key_mask != nullptr ? key_mask + e * S : nullptr;
        for (int64_t j = 0; j < S; ++j) out[j] = 0.0f;
        for (int64_t h = 0; h < heads; ++h) {
            const T * qh = q_k_v + (i * b + bi) * row_stride + h * d;
            auto      kh = [&](int64_t j) { return kv + (j * b + bi) * kv_stride + k_col + h * d; };
            // Three passes over the keys, the logits recomputed (the CPU keeps them): the maximum, the sum, the
            // probabilities.
            float mx = -INFINITY;
            for (int64_t j = 0; j <= last; ++j) {
                if (held != nullptr && held[j] == 0) continue;
                mx = fmaxf(mx, dsa_logit(qh, kh(j), d, scale));
            }
            float sum = 0.0f;
            for (int64_t j = 0; j <= last; ++j) {
                if (held != nullptr && held[j] == 0) continue;
                sum = __fadd_rn(sum, expf(__fsub_rn(dsa_logit(qh, kh(j), d, scale), mx)));
            }
            for (int64_t j = 0; j <= last; ++j) {
                if (held != nullptr && held[j] == 0) continue;
                const float p = expf(__fsub_rn(dsa_logit(qh, kh(j), d, scale), mx));
                out[j]        = __fadd_rn(out[j], __fdiv_rn(p, sum));
            }
        }
    }
}

__global__ void dsa_indexer_loss_kernel(const float * scores, const float * target, float weight, float * kl,
                                        float * dscores, DsaRows rows, const uint8_t * mask) {
    const int64_t s = rows.s, S = rows.keys;
    LOOM_GRID_STRIDE(e, rows.b * s) {   // (bi, i)
        const int64_t   last = rows.last(e % s);
        const float *   I    = scores + e * S;
        const float *   t    = target + e * S;
        float *         g    = dscores + e * S;
        const uint8_t * held = mask != nullptr ? mask + e * S : nullptr;
        float           total = 0.0f, mx = -INFINITY;
        for (int64_t j = 0; j <= last; ++j) {
            if (held != nullptr && held[j] == 0) continue;
            total = __fadd_rn(total, t[j]);
            mx    = fmaxf(mx, I[j]);
        }
        const float norm = fmaxf(total, 1e-10f);
        float       sum  = 0.0f;
        for (int64_t j = 0; j <= last; ++j) {
            if (held == nullptr || held[j] != 0) sum = __fadd_rn(sum, expf(__fsub_rn(I[j], mx)));
        }
        const float log_sum = logf(sum);
        float       row     = 0.0f;
        for (int64_t j = 0; j <= last; ++j) {
            if (held != nullptr && held[j] == 0) {
                g[j] = 0.0f;
                continue;
            }
            const float T     = __fdiv_rn(t[j], norm);
            const float log_p = __fsub_rn(__fsub_rn(I[j], mx), log_sum);
            row  = __fadd_rn(row, __fmul_rn(T, __fsub_rn(logf(fmaxf(T, 1e-10f)), log_p)));
            g[j] = __fmul_rn(weight, __fsub_rn(expf(log_p), T));
        }
        for (int64_t j = last + 1; j < S; ++j) g[j] = 0.0f;
        kl[e] = __fmul_rn(weight, row);
    }
}

// ---- The gated delta-net's gates (Ops::gdn_gates_forward / _backward), as backend/cpu/delta_rule.cpp forms them.

__device__ inline float softplus_rn(float x) { return x > 20.0f ? x : log1pf(expf(x)); }

template <class T>
__global__ void gdn_gates_forward_kernel(const T * src, int64_t stride, const float * a_log, const float * dt_bias, float * g,
                                         float * beta, int64_t n, int64_t H) {
    LOOM_GRID_STRIDE(i, n * H) {
        const int64_t r = i / H, h = i % H;
        beta[i] = sigmoid_rn(to_f32(src[r * stride + h]));
        g[i]    = __fmul_rn(-expf(a_log[h]), softplus_rn(__fadd_rn(to_f32(src[r * stride + H + h]), dt_bias[h])));
    }
}

template <class T>
__device__ inline float gdn_da(const T * src, int64_t stride, const float * a_log, const float * dt_bias, const float * dg,
                               int64_t r, int64_t h, int64_t H) {
    const float x     = __fadd_rn(to_f32(src[r * stride + H + h]), dt_bias[h]);
    const float slope = x > 20.0f ? 1.0f : sigmoid_rn(x);
    return __fmul_rn(__fmul_rn(dg[r * H + h], -expf(a_log[h])), slope);
}

template <class T>
__global__ void gdn_gates_dsrc_kernel(const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                                      const float * dg, const float * dbeta, T * dsrc, int64_t n, int64_t H) {
    LOOM_GRID_STRIDE(i, n * H) {
        const int64_t r = i / H, h = i % H;
        const float   s = sigmoid_rn(to_f32(src[r * stride + h]));
        dsrc[r * 2 * H + h]     = from_f32<T>(__fmul_rn(dbeta[i], __fmul_rn(s, __fsub_rn(1.0f, s))));
        dsrc[r * 2 * H + H + h] = from_f32<T>(gdn_da(src, stride, a_log, dt_bias, dg, r, h, H));
    }
}

// A thread per head walks the rows in order.
template <class T>
__global__ void gdn_gates_params_kernel(const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                                        const float * dg, float * da_log, float * ddt_bias, int64_t n, int64_t H) {
    LOOM_GRID_STRIDE(h, H) {
        float sum_da = 0.0f, sum_dg_g = 0.0f;
        for (int64_t r = 0; r < n; ++r) {
            const float x = __fadd_rn(to_f32(src[r * stride + H + h]), dt_bias[h]);
            sum_da        = __fadd_rn(sum_da, gdn_da(src, stride, a_log, dt_bias, dg, r, h, H));
            sum_dg_g      = __fadd_rn(sum_dg_g, __fmul_rn(dg[r * H + h], __fmul_rn(-expf(a_log[h]), softplus_rn(x))));
        }
        ddt_bias[h] = __fadd_rn(ddt_bias[h], sum_da);
        da_log[h]   = __fadd_rn(da_log[h], sum_dg_g);
    }
}

template <class T>
__global__ void squared_relu_forward_kernel(const T * x, T * y, int64_t count) {
    LOOM_GRID_STRIDE(i, count) {
        const float v = to_f32(x[i]);
        const float r = v > 0.0f ? v : 0.0f;
        y[i]          = from_f32<T>(r * r);
    }
}

template <class T>
__global__ void squared_relu_backward_kernel(const T * x, const T * dy, T * dx, int64_t count) {
    LOOM_GRID_STRIDE(i, count) {
        const float v = to_f32(x[i]);
        dx[i]         = from_f32<T>(v > 0.0f ? to_f32(dy[i]) * (2.0f * v) : 0.0f);
    }
}

template <class T>
__global__ void swiglu_forward_kernel(const T * x, T * y, int64_t n, int64_t f) {
    LOOM_GRID_STRIDE(i, n * f) {
        const int64_t r = i / f, j = i % f;
        const float   g = to_f32(x[r * 2 * f + j]);
        y[i]            = from_f32<T>(g * sigmoid_rn(g) * to_f32(x[r * 2 * f + f + j]));
    }
}

template <class T>
__global__ void swiglu_backward_kernel(const T * x, const T * dy, T * dx, int64_t n, int64_t f) {
    LOOM_GRID_STRIDE(i, n * f) {
        const int64_t r = i / f, j = i % f;
        const float   g   = to_f32(x[r * 2 * f + j]);
        const float   up  = to_f32(x[r * 2 * f + f + j]);
        const float   sig = sigmoid_rn(g);
        const float   d   = to_f32(dy[i]);
        dx[r * 2 * f + f + j] = from_f32<T>(d * g * sig);
        dx[r * 2 * f + j]     = from_f32<T>(d * up * sig * (1.0f + g * (1.0f - sig)));
    }
}

// std::min and std::max as the CPU's code calls them (the second argument when it compares less or greater;
// a NaN first argument is kept).
__device__ __forceinline__ float host_min(float a, float b) { return b < a ? b : a; }
__device__ __forceinline__ float host_max(float a, float b) { return a < b ? b : a; }

template <class T>
__global__ void glu_forward_kernel(const T * x, T * y, int64_t n, int64_t f, float k, float c, float offset) {
    LOOM_GRID_STRIDE(i, n * f) {
        const int64_t r = i / f, j = i % f;
        float         a = to_f32(x[r * 2 * f + j]), b = to_f32(x[r * 2 * f + f + j]);
        if (c > 0.0f) {
            a = host_min(a, c);
            b = host_min(host_max(b, -c), c);
        }
        const float act = __fmul_rn(a, sigmoid_rn(__fmul_rn(k, a)));
        y[i]            = from_f32<T>(__fmul_rn(act, __fadd_rn(b, offset)));
    }
}

template <class T>
__global__ void glu_backward_kernel(const T * x, const T * dy, T * dx, int64_t n, int64_t f, float k, float c, float offset) {
    LOOM_GRID_STRIDE(i, n * f) {
        const int64_t r = i / f, j = i % f;
        const float   a0 = to_f32(x[r * 2 * f + j]), b0 = to_f32(x[r * 2 * f + f + j]);
        const bool    clamped = c > 0.0f;
        const bool    pass_a = !clamped || a0 <= c, pass_b = !clamped || (b0 >= -c && b0 <= c);
        const float   a = clamped ? host_min(a0, c) : a0, b = clamped ? host_min(host_max(b0, -c), c) : b0;
        const float   s = sigmoid_rn(__fmul_rn(k, a));
        const float   d = to_f32(dy[i]);
        const float   slope = __fmul_rn(s, __fadd_rn(1.0f, __fmul_rn(__fmul_rn(k, a), __fadd_rn(1.0f, -s))));
        dx[r * 2 * f + f + j] = from_f32<T>(pass_b ? __fmul_rn(d, __fmul_rn(a, s)) : 0.0f);
        dx[r * 2 * f + j]     = from_f32<T>(pass_a ? __fmul_rn(__fmul_rn(d, __fadd_rn(b, offset)), slope) : 0.0f);
    }
}

// ---- AdamW: core/host_adam.cpp's adam_element, operation for operation.

// One element's AdamW: the single-tensor and the multi-tensor kernels share it, so their bits are one.
__device__ inline void adam_element(float * p, const float * g, float * m, float * v, void * out, AdamOut out_kind,
                                    int64_t i, const AdamCoeffs & c) {
    const float gi = g[i];
    const float mi = __fmaf_rn(c.beta1, m[i], __fmul_rn(c.one_minus_beta1, gi));
    const float vi = __fmaf_rn(c.beta2, v[i], __fmul_rn(__fmul_rn(c.one_minus_beta2, gi), gi));
    const float q  = __fdiv_rn(__fmul_rn(c.step_size, mi), __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), c.bc2_sqrt), c.eps));
    const float pi = __fmaf_rn(p[i], c.decay, -q);
    m[i]           = mi;
    v[i]           = vi;
    p[i]           = pi;
    if (out_kind == AdamOut::bf16) static_cast<uint16_t *>(out)[i] = f32_to_bf16_bits(pi);
    if (out_kind == AdamOut::f32) static_cast<float *>(out)[i] = pi;
}

__global__ void adamw_kernel(float * p, const float * g, float * m, float * v, void * out, AdamOut out_kind,
                             int64_t n, AdamCoeffs c) {
    LOOM_GRID_STRIDE(i, n) adam_element(p, g, m, v, out, out_kind, i, c);
}

__global__ void adamw_multi_kernel(AdamMulti tensors) {
    float coeff = 1.0f;
    if (tensors.gate != nullptr) {
        if (tensors.gate[1] == 0.0f) return;   // the step was skipped: nothing is written
        coeff = tensors.gate[0];
    }
    LOOM_GRID_STRIDE(i, tensors.begin[tensors.count]) {
        const int              lo = range_of(tensors.begin, tensors.count, i);
        const AdamMultiEntry & e  = tensors.entries[lo];
        const int64_t          j  = i - tensors.begin[lo];
        if (coeff != 1.0f) e.g[j] = __fmul_rn(e.g[j], coeff);   // Ops::scale's product, kept as the clip's is
        adam_element(e.p, e.g, e.m, e.v, e.out, e.out_kind, j, e.c);
    }
}

__global__ void grad_norm_gate_kernel(const float * pairs, GradNormGate g, float * gate, double * norm) {
    const GradNormVerdict v = grad_norm_verdict(pairs, g);
    gate[0]                 = v.coeff;
    gate[1]                 = v.go ? 1.0f : 0.0f;
    norm[0]                 = v.norm;
}


// ---- Ids, rotary embedding, dropout, embedding

__global__ void find_bad_id_kernel(const int32_t * ids, int64_t n, int64_t limit, unsigned long long * first_bad) {
    LOOM_GRID_STRIDE(i, n) {
        const int32_t v = ids[i];
        if (v < -1 || v >= limit) {
            atomicMin(first_bad, (static_cast<unsigned long long>(i) << 32) | static_cast<uint32_t>(v));   // integer: exact
        }
    }
}

// One thread per rotated pair (row, head, i < r / 2), as backend/cpu/ops.cpp's rope_apply.
template <class T>
__global__ void rope_kernel(T * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, int64_t r,
                            bool interleaved, const float * inv_freq, bool inverse, SeqPositions positions,
                            float amplitude) {
    const int64_t half = r / 2;
    LOOM_GRID_STRIDE(e, s * b * heads * half) {
        const int64_t i = e % half, t = e / half, hd = t % heads, row = t / heads, si = row / b;
        const float   angle = __fmul_rn(static_cast<float>(positions(si)), inv_freq[i]);
        const float   c     = __fmul_rn(cosf(angle), amplitude);
        const float   sn    = __fmul_rn(inverse ? -sinf(angle) : sinf(angle), amplitude);
        T *           p1    = x + row * row_stride + hd * d + (interleaved ? 2 * i : i);
        T *           p2    = p1 + (interleaved ? 1 : half);
        const float   x1 = to_f32(*p1), x2 = to_f32(*p2);
        *p1 = from_f32<T>(__fsub_rn(__fmul_rn(x1, c), __fmul_rn(x2, sn)));
        *p2 = from_f32<T>(__fadd_rn(__fmul_rn(x2, c), __fmul_rn(x1, sn)));
    }
}

template <class T>
__global__ void dropout_kernel(const T * x, T * y, int64_t n, int64_t w, DropoutKey key) {
    LOOM_GRID_STRIDE(i, n * w) {
        const int64_t  r = i / w, c = i % w;
        const int64_t  g = key.offset + r, position = key.positions(g / key.batch), column = g % key.batch;
        const uint64_t base = dropout_base(key.seed, key.site, key.sample_ids != nullptr ? key.sample_ids[column] : column);
        y[i] = from_f32<T>(dropout_keep_hidden(base, position, c, key.threshold) ? __fmul_rn(to_f32(x[i]), key.keep_scale) : 0.0f);
    }
}

__device__ __forceinline__ float load_table(const float * p, int64_t i) { return p[i]; }
__device__ __forceinline__ float load_table(const uint16_t * p, int64_t i) { return bf16_bits_to_f32(p[i]); }

template <typename W, class T>
__global__ void embedding_forward_kernel(const int32_t * tokens, const W * wte, const W * wpe, T * out, int64_t s,
                                         int64_t b, int64_t h, int64_t vocab, SeqPositions positions) {
    LOOM_GRID_STRIDE(i, s * b * h) {
        const int64_t r = i / h, j = i % h, si = r / b, bi = r % b;
        const int32_t token = tokens[bi * s + si];
        float         v     = token >= 0 && token < vocab ? load_table(wte, static_cast<int64_t>(token) * h + j) : 0.0f;
        if (wpe != nullptr) v = __fadd_rn(v, load_table(wpe, positions(si) * h + j));
        out[i] = from_f32<T>(v);
    }
}

// dwte without a scan of every token per thread: the rows sorted by (token, row), then one thread per run of
// a token and column adds the run's rows in row order, the CPU's order: no atomics, the CPU's bits.
//
// Row r = si * b + bi (dout's row) gets the key token << 32 | r, or all ones (sorted last, never a run) for
// a token outside [0, vocab); keys are unique, so the sort's order is the one order of the keys.
__global__ void embedding_row_keys_kernel(const int32_t * tokens, uint64_t * keys, int64_t s, int64_t b, int64_t vocab,
                                          int64_t n_keys) {
    LOOM_GRID_STRIDE(r, n_keys) {
        uint64_t key = ~uint64_t{0};
        if (r < s * b) {
            const int32_t t = tokens[(r % b) * s + r / b];
            if (t >= 0 && t < vocab) key = static_cast<uint64_t>(t) << 32 | static_cast<uint64_t>(r);
        }
        keys[r] = key;
    }
}

// One compare-exchange pass of a bitonic sort (ascending) of n (a power of two) keys: merge size k, distance j.
__global__ void bitonic_pass_kernel(uint64_t * keys, int64_t n, int64_t j, int64_t k) {
    LOOM_GRID_STRIDE(i, n) {
        const int64_t partner = i ^ j;
        if (partner <= i) continue;
        const uint64_t a = keys[i], c = keys[partner];
        if ((a > c) == ((i & k) == 0)) {
            keys[i]       = c;
            keys[partner] = a;
        }
    }
}

// Thread (sorted place p, column j): where a token's run starts at p, dwte[token, j] += its rows in order.
template <class T>
__global__ void embedding_backward_runs_kernel(const uint64_t * keys, const T * dout, float * dwte, int64_t n_keys,
                                               int64_t h) {
    LOOM_GRID_STRIDE(i, n_keys * h) {
        const int64_t  p = i / h, j = i % h;
        const uint64_t token = keys[p] >> 32;
        if (keys[p] == ~uint64_t{0} || (p > 0 && keys[p - 1] >> 32 == token)) continue;
        float * w   = dwte + static_cast<int64_t>(token) * h + j;
        float   acc = *w;
        for (int64_t q = p; q < n_keys && keys[q] >> 32 == token; ++q) {   // the all-ones key ends every run
            acc = __fadd_rn(acc, to_f32(dout[static_cast<int64_t>(keys[q] & 0xffffffffu) * h + j]));
        }
        *w = acc;
    }
}

// dwpe[positions(si), j] += dout[si * b + bi, j] for bi in order.
template <class T>
__global__ void embedding_backward_wpe_kernel(const T * dout, float * dwpe, int64_t s, int64_t b, int64_t h,
                                              SeqPositions positions) {
    LOOM_GRID_STRIDE(i, s * h) {
        const int64_t si = i / h, j = i % h;
        float *       w   = dwpe + positions(si) * h + j;
        float         acc = *w;
        for (int64_t bi = 0; bi < b; ++bi) acc = __fadd_rn(acc, to_f32(dout[(si * b + bi) * h + j]));
        *w = acc;
    }
}

__global__ void vocab_shard_ids_kernel(const int32_t * ids, int64_t n, int64_t begin, int64_t count, int32_t * out) {
    LOOM_GRID_STRIDE(i, n) {
        const int64_t v = ids[i];
        out[i]          = v >= begin && v < begin + count ? static_cast<int32_t>(v - begin) : -1;
    }
}

// ---- Cross-entropy, one block per row

template <class T>
__device__ float row_first_max(const T * row, int64_t valid) {
    MaxAt m{-INFINITY, LLONG_MAX};
    for (int64_t v = threadIdx.x; v < valid; v += blockDim.x) {
        const float value = to_f32(row[v]);
        if (m.v < value) m = MaxAt{value, v};
    }
    return block_first_max(m).v;
}

template <class T>
__device__ float row_sum_exp_of(const T * row, float mx, int64_t valid) {
    double sum = 0;
    for (int64_t v = threadIdx.x; v < valid; v += blockDim.x) sum += static_cast<double>(exp_approx(__fsub_rn(to_f32(row[v]), mx)));
    return static_cast<float>(block_sum(sum));
}

template <class T>
__global__ void row_max_kernel(const T * logits, int64_t stride, int64_t valid, float * out) {
    const float mx = row_first_max(logits + blockIdx.x * stride, valid);
    if (threadIdx.x == 0) out[blockIdx.x] = mx;
}

template <class T>
__global__ void row_sum_exp_kernel(const T * logits, const float * max, int64_t stride, int64_t valid, float * out) {
    const float sum = row_sum_exp_of(logits + blockIdx.x * stride, max[blockIdx.x], valid);
    if (threadIdx.x == 0) out[blockIdx.x] = sum;
}

__device__ __forceinline__ int32_t row_label(const int32_t * labels, int64_t r, int64_t s, int64_t b, int64_t limit) {
    const int32_t label = labels[(r % b) * s + r / b];
    return label >= 0 && label < limit ? label : -1;
}

template <class T>
__global__ void cross_entropy_forward_kernel(const T * logits, const int32_t * labels, float * loss, float * lse,
                                             int64_t s, int64_t b, int64_t stride, int64_t vocab) {
    const int64_t r   = blockIdx.x;
    const T *     row = logits + r * stride;
    const float   mx  = row_first_max(row, vocab);
    const float   sum = row_sum_exp_of(row, mx, vocab);
    if (threadIdx.x == 0) {
        const float   l     = __fadd_rn(mx, static_cast<float>(log(static_cast<double>(sum))));
        const int32_t label = row_label(labels, r, s, b, vocab);
        lse[r]              = l;
        loss[r]             = __fsub_rn(l, label >= 0 ? to_f32(row[label]) : 0.0f);
    }
}

template <class T>
__global__ void cross_entropy_backward_kernel(T * logits, const int32_t * labels, const float * lse,
                                              const float * dloss, int64_t s, int64_t b, int64_t stride, int64_t vocab) {
    const int64_t r     = blockIdx.x;
    T *           row   = logits + r * stride;
    const float   l     = lse[r], g = dloss[r];
    const int32_t label = row_label(labels, r, s, b, vocab);
    for (int64_t v = threadIdx.x; v < stride; v += blockDim.x) {
        float value = v < vocab ? __fmul_rn(exp_approx(__fsub_rn(to_f32(row[v]), l)), g) : 0.0f;
        if (v == label) value = __fsub_rn(value, g);
        row[v] = from_f32<T>(value);
    }
}

template <class T>
__global__ void label_logit_kernel(const T * logits, const int32_t * labels, float * out, int64_t s, int64_t b,
                                   int64_t stride) {
    LOOM_GRID_STRIDE(r, s * b) {
        const int32_t label = row_label(labels, r, s, b, stride);
        out[r]              = label >= 0 ? to_f32(logits[r * stride + label]) : 0.0f;
    }
}

__global__ void lse_and_loss_kernel(const float * max, const float * sum, const float * target, float * lse,
                                    float * loss, int64_t n) {
    LOOM_GRID_STRIDE(r, n) {
        const float l = __fadd_rn(max[r], logf(sum[r]));
        lse[r]        = l;
        loss[r]       = __fsub_rn(l, target[r]);
    }
}

__global__ void loss_grad_kernel(const float * mask, double scale, float * dloss, int64_t s, int64_t b) {
    LOOM_GRID_STRIDE(r, s * b) dloss[r] = static_cast<float>(__dmul_rn(static_cast<double>(mask[(r % b) * s + r / b]), scale));
}

}  // namespace

void fill_f32(cudaStream_t stream, float * data, int64_t n, float value) {
    if (n > 0) LOOM_LAUNCH(fill_kernel, blocks_for(n), kThreads, 0, stream)(data, n, value);
}

void convert(cudaStream_t stream, const void * src, Float src_kind, void * dst, Float dst_kind, int64_t n) {
    if (n == 0) return;
    if (src_kind == Float::f64 || dst_kind == Float::f64) {
        LOOM_LAUNCH(convert_f64_kernel, blocks_for(n), kThreads, 0, stream)(src, src_kind, dst, dst_kind, n);
    } else {
        LOOM_LAUNCH(convert_kernel, blocks_for(n), kThreads, 0, stream)(src, src_kind, dst, dst_kind, n);
    }
}

void round_to_bf16(cudaStream_t stream, float * x, uint16_t * x_bf16, int64_t n) {
    if (n > 0) LOOM_LAUNCH(round_to_bf16_kernel, blocks_for(n), kThreads, 0, stream)(x, x_bf16, n);
}

void gemm_f64(cudaStream_t stream, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double * a,
              const double * b, double * c, bool accumulate) {
    if (m * n > 0) {
        LOOM_LAUNCH(gemm_f64_kernel, blocks_for(m * n), kThreads, 0, stream)(trans_a, trans_b, m, n, k, a, b, c, accumulate);
    }
}

void bias_add_f64(cudaStream_t stream, double * y, const double * bias, int64_t n, int64_t h) {
    if (n * h > 0) LOOM_LAUNCH(bias_add_f64_kernel, blocks_for(n * h), kThreads, 0, stream)(y, bias, n, h);
}

void bias_backward_f64(cudaStream_t stream, const double * dy, double * dbias, int64_t n, int64_t h) {
    if (h > 0) LOOM_LAUNCH(bias_backward_f64_kernel, blocks_for(h), kThreads, 0, stream)(dy, dbias, n, h);
}

void scale(cudaStream_t stream, void * x, Float kind, float factor, int64_t n) {
    if (n > 0) LOOM_LAUNCH(scale_kernel, blocks_for(n), kThreads, 0, stream)(x, kind, factor, n);
}

int64_t fp8_quantize_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

void fp8_quantize(cudaStream_t stream, const void * x, Float kind, int64_t n, Fp8Format format, uint16_t * q,
                  float * scale_inv, double * partial, float * scale) {
    const int64_t chunks = fp8_quantize_chunks(n);
    if (chunks > 0) LOOM_LAUNCH(amax_bits_chunks_kernel, static_cast<unsigned>(chunks), kThreads, 0, stream)(x, kind, n, partial);
    LOOM_LAUNCH(fp8_scale_kernel, 1, 1, 0, stream)(partial, chunks, format, scale, scale_inv);
    if (n > 0) LOOM_LAUNCH(fp8_cast_kernel, blocks_for(n), kThreads, 0, stream)(x, kind, n, scale, format, q);
}

void fp8_quantize_blocks(cudaStream_t stream, const void * x, Float kind, int64_t rows, int64_t cols, Fp8Format format,
                         int64_t block_rows, int64_t block_cols, float * scale, uint16_t * q, bool mx) {
    if (rows * cols == 0) return;
    const int64_t  blocks  = ((rows + block_rows - 1) / block_rows) * ((cols + block_cols - 1) / block_cols);
    const unsigned threads = static_cast<unsigned>(std::clamp<int64_t>((block_rows * block_cols + 31) / 32 * 32, 32, kThreads));
    LOOM_LAUNCH(fp8_block_scale_kernel, static_cast<unsigned>(blocks), threads, 0, stream)(x, kind, rows, cols, format, block_rows,
                                                                                           block_cols, scale, mx);
    LOOM_LAUNCH(fp8_block_cast_kernel, blocks_for(rows * cols), kThreads, 0, stream)(x, kind, rows, cols, format, block_rows,
                                                                                     block_cols, scale, q);
}

void fp8_amax(cudaStream_t stream, const void * x, Float kind, int64_t n, double * partial, float * amax) {
    const int64_t chunks = fp8_quantize_chunks(n);
    if (chunks == 0) return;
    LOOM_LAUNCH(amax_bits_chunks_kernel, static_cast<unsigned>(chunks), kThreads, 0, stream)(x, kind, n, partial);
    LOOM_LAUNCH(fp8_amax_fold_kernel, 1, 1, 0, stream)(partial, chunks, amax);
}

void fp8_encode(cudaStream_t stream, const float * x, int64_t n, Fp8Format format, const float * amax, uint8_t * codes,
                float * scale_inv) {
    LOOM_LAUNCH(fp8_encode_kernel, std::max(blocks_for(n), 1), kThreads, 0, stream)(x, n, format, amax, codes, scale_inv);
}

void sigmoid_gate_forward(cudaStream_t stream, float * y, const float * logits, int64_t n, int64_t h) {
    if (n > 0) LOOM_LAUNCH(sigmoid_gate_forward_kernel, blocks_for(n), kThreads, 0, stream)(y, logits, n, h);
}

void sigmoid_gate_backward(cudaStream_t stream, const float * dy, const float * m, const float * logits, float * dm,
                           float * dlogits, int64_t n, int64_t h) {
    if (n > 0) LOOM_LAUNCH(sigmoid_gate_backward_kernel, blocks_for(n), kThreads, 0, stream)(dy, m, logits, dm, dlogits, n, h);
}

void fp8_quantize_scaled(cudaStream_t stream, const void * x, Float kind, int64_t n, Fp8Format format, const float * scale,
                         uint16_t * q, float * scale_inv) {
    LOOM_LAUNCH(fp8_scale_inv_kernel, 1, 1, 0, stream)(scale, scale_inv);
    if (n > 0) LOOM_LAUNCH(fp8_cast_kernel, blocks_for(n), kThreads, 0, stream)(x, kind, n, scale, format, q);
}

void fp8_delayed_update(cudaStream_t stream, float * history, float * scale, int64_t len, int64_t n, Fp8Format format,
                        int margin, bool max_algo) {
    if (n > 0) LOOM_LAUNCH(fp8_delayed_update_kernel, blocks_for(n), kThreads, 0, stream)(history, scale, len, n, format, margin, max_algo);
}

void fp8_decode(cudaStream_t stream, const uint8_t * codes, int64_t n, Fp8Format format, uint16_t * q) {
    if (n > 0) LOOM_LAUNCH(fp8_decode_kernel, blocks_for(n), kThreads, 0, stream)(codes, n, format, q);
}

void scale_by_reciprocal(cudaStream_t stream, float * t, const float * d, int64_t n) {
    if (n > 0) LOOM_LAUNCH(scale_by_reciprocal_kernel, blocks_for(n), kThreads, 0, stream)(t, d, n);
}

void scale_by_product(cudaStream_t stream, float * t, const float * a, const float * b, int64_t n) {
    if (n > 0) LOOM_LAUNCH(scale_by_product_kernel, blocks_for(n), kThreads, 0, stream)(t, a, b, n);
}

void scale_by_inverse_norm(cudaStream_t stream, float * x, const float * sums, double eps, int64_t n) {
    if (n > 0) LOOM_LAUNCH(scale_by_inverse_norm_kernel, blocks_for(n), kThreads, 0, stream)(x, sums, eps, n);
}

template <class T>
void add_inplace(cudaStream_t stream, T * y, const T * x, int64_t n) {
    if (n > 0) LOOM_LAUNCH(add_inplace_kernel<T>, blocks_for(n), kThreads, 0, stream)(y, x, n);
}

template <class T>
void bias_add(cudaStream_t stream, T * y, const float * bias, int64_t n, int64_t h) {
    if (n * h > 0) LOOM_LAUNCH(bias_add_kernel<T>, blocks_for(n * h), kThreads, 0, stream)(y, bias, n, h);
}

template <class T>
void bias_backward(cudaStream_t stream, const T * dy, float * dbias, float * partial, int64_t n, int64_t h) {
    if (h == 0) return;
    const int64_t chunks = column_sum_chunks(n);
    float *       sums   = chunks == 1 ? dbias : partial;
    LOOM_LAUNCH(bias_backward_kernel<T>, column_sum_grid(h, chunks), kThreads, 0, stream)(dy, dbias, sums, n, h, chunks);
    if (chunks > 1) LOOM_LAUNCH(column_total_kernel, blocks_for(h), kThreads, 0, stream)(partial, dbias, h, chunks);
}

int64_t sum_of_squares_chunks(int64_t n) { return (n + kChunk - 1) / kChunk; }

void sum_of_squares(cudaStream_t stream, const float * x, int64_t n, double * partial, float * out) {
    const int64_t chunks = sum_of_squares_chunks(n);
    if (chunks > 0) {
        LOOM_LAUNCH(sum_of_squares_chunks_kernel, static_cast<unsigned>(chunks), kThreads, 0, stream)(x, n, partial);
    }
    LOOM_LAUNCH(sum_of_squares_total_kernel, 1, 32, 0, stream)(partial, chunks, out);
}

void sum_of_squares_multi(cudaStream_t stream, const SquaresMulti & tensors, double * partial, float * out) {
    if (tensors.count == 0) return;
    const int64_t chunks = tensors.chunk_begin[tensors.count];
    if (chunks > 0) {
        LOOM_LAUNCH(sum_of_squares_multi_chunks_kernel, static_cast<unsigned>(chunks), kThreads, 0, stream)(tensors, partial);
    }
    LOOM_LAUNCH(sum_of_squares_multi_total_kernel, 1, kSquaresMultiTensors, 0, stream)(tensors, partial, out);
}

namespace {

// Threads for a kernel that reduces one row of h per block: a whole number of warps, at most kThreads. A
// row narrower than kThreads leaves no thread without an element (and, on the emulated device, no fiber
// that only waits at the barriers).
unsigned row_threads(int64_t h) {
    return static_cast<unsigned>(std::clamp<int64_t>((h + 31) / 32 * 32, 32, kThreads));
}

}  // namespace

template <class T>
void layernorm_forward(cudaStream_t stream, T * x, const T * residual, const float * gamma, const float * beta, T * y,
                       float * mean, float * rstd, int64_t n, int64_t h, float eps) {
    if (n > 0) {
        LOOM_LAUNCH(layernorm_forward_kernel<T>, static_cast<unsigned>(n), row_threads(h), 0, stream)(
            x, residual, gamma, beta, y, mean, rstd, h, eps, false);
    }
}

template <class T>
void rmsnorm_forward(cudaStream_t stream, T * x, const T * residual, const float * gamma, T * y, float * rstd, int64_t n,
                     int64_t h, float eps) {
    if (n > 0) {
        LOOM_LAUNCH(layernorm_forward_kernel<T>, static_cast<unsigned>(n), row_threads(h), 0, stream)(
            x, residual, gamma, nullptr, y, nullptr, rstd, h, eps, true);
    }
}

namespace {

// The parameter gradients of a norm's backward: two column sums (one without beta), partial holding
// 2 chunks h floats where there is more than one chunk.
template <class T>
void norm_backward_params(cudaStream_t stream, const T * dy, const T * x, const float * mean, const float * rstd,
                          float * dgamma, float * dbeta, float * partial, int64_t n, int64_t h) {
    const int64_t chunks = column_sum_chunks(n);
    float *       sums_g = chunks == 1 ? dgamma : partial;
    float *       sums_b = chunks == 1 ? dbeta : partial + chunks * h;
    LOOM_LAUNCH(norm_backward_params_kernel<T>, column_sum_grid(h, chunks), kThreads, 0, stream)(
        dy, x, mean, rstd, dgamma, dbeta, sums_g, sums_b, n, h, chunks);
    if (chunks == 1) return;
    LOOM_LAUNCH(column_total_kernel, blocks_for(h), kThreads, 0, stream)(sums_g, dgamma, h, chunks);
    if (dbeta != nullptr) LOOM_LAUNCH(column_total_kernel, blocks_for(h), kThreads, 0, stream)(sums_b, dbeta, h, chunks);
}

}  // namespace

template <class T>
void layernorm_backward(cudaStream_t stream, const T * dy, const T * x, const float * gamma, const float * mean,
                        const float * rstd, T * dx, float * dgamma, float * dbeta, float * partial, int64_t n, int64_t h,
                        const T * dres) {
    if (n == 0 || h == 0) return;
    LOOM_LAUNCH(norm_backward_dx_kernel<T>, static_cast<unsigned>(n), row_threads(h), 0, stream)(
        dy, x, gamma, mean, rstd, dx, dres, h);
    norm_backward_params(stream, dy, x, mean, rstd, dgamma, dbeta, partial, n, h);
}

template <class T>
void rmsnorm_backward(cudaStream_t stream, const T * dy, const T * x, const float * gamma, const float * rstd, T * dx,
                      float * dgamma, float * partial, int64_t n, int64_t h, const T * dres) {
    if (n == 0 || h == 0) return;
    LOOM_LAUNCH(norm_backward_dx_kernel<T>, static_cast<unsigned>(n), row_threads(h), 0, stream)(
        dy, x, gamma, nullptr, rstd, dx, dres, h);
    norm_backward_params(stream, dy, x, nullptr, rstd, dgamma, nullptr, partial, n, h);
}

template <class T>
void bias_gelu_forward(cudaStream_t stream, T * x, const float * bias, T * y, uint16_t * x_bf16, int64_t n, int64_t f) {
    if (n * f > 0) {
        LOOM_LAUNCH(bias_gelu_forward_kernel<T>, blocks_for(n * f), kThreads, 0, stream)(x, bias, y, x_bf16, n, f);
    }
}

template <class T>
void gelu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t count) {
    if (count > 0) LOOM_LAUNCH(gelu_backward_kernel<T>, blocks_for(count), kThreads, 0, stream)(x, dy, dx, count);
}

void causal_conv_silu_forward(cudaStream_t stream, const float * x, const float * w, float * y, int64_t s, int64_t b,
                              int64_t C, int64_t K) {
    LOOM_LAUNCH(causal_conv_forward_kernel, blocks_for(s * b * C), kThreads, 0, stream)(x, w, y, s, b, C, K);
}

void causal_conv_silu_backward(cudaStream_t stream, const float * x, const float * w, const float * dy, float * dx,
                               float * dw, int64_t s, int64_t b, int64_t C, int64_t K) {
    LOOM_LAUNCH(causal_conv_dx_kernel, blocks_for(s * b * C), kThreads, 0, stream)(x, w, dy, dx, s, b, C, K);
    LOOM_LAUNCH(causal_conv_dw_kernel, blocks_for(C * K), kThreads, 0, stream)(x, w, dy, dw, s, b, C, K);
}

namespace {
int delta_rule_threads(const DeltaRuleDims & d) {
    const int64_t widest = d.dk > d.dv ? d.dk : d.dv;
    return static_cast<int>((widest + 31) / 32 * 32);
}
}  // namespace

void gated_delta_rule_forward(cudaStream_t stream, const float * q, const float * k, const float * v, const float * g,
                              const float * beta, float * o, float * workspace, DeltaRuleDims d) {
    LOOM_LAUNCH(delta_rule_forward_kernel, static_cast<unsigned>(d.b * d.heads), delta_rule_threads(d), 0, stream)(
        q, k, v, g, beta, o, workspace, d);
}

void gated_delta_rule_backward(cudaStream_t stream, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, const float * dout, float * dq, float * dk, float * dv, float * dg,
                               float * dbeta, float * workspace, DeltaRuleDims d) {
    LOOM_LAUNCH(delta_rule_backward_kernel, static_cast<unsigned>(d.b * d.heads), delta_rule_threads(d), 0, stream)(
        q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, workspace, d);
}

template <class T>
void output_gate_forward(cudaStream_t stream, const T * x, const T * gate, int64_t stride, T * y, int64_t n, int64_t w,
                         GateActivation act) {
    if (n * w > 0) {
        LOOM_LAUNCH(output_gate_forward_kernel<T>, blocks_for(n * w), kThreads, 0, stream)(x, gate, stride, y, n, w, act);
    }
}

template <class T>
void output_gate_backward(cudaStream_t stream, const T * x, const T * gate, int64_t stride, const T * dy, T * dx, T * dgate,
                          int64_t n, int64_t w, GateActivation act) {
    if (n * w > 0) {
        LOOM_LAUNCH(output_gate_backward_kernel<T>, blocks_for(n * w), kThreads, 0, stream)(x, gate, stride, dy, dx, dgate, n,
                                                                                             w, act);
    }
}

void l2norm_forward(cudaStream_t stream, const float * x, float * y, float * rstd, int64_t rows, int64_t d, float eps) {
    if (rows > 0) LOOM_LAUNCH(l2norm_forward_kernel, blocks_for(rows), kThreads, 0, stream)(x, y, rstd, rows, d, eps);
}

void l2norm_backward(cudaStream_t stream, const float * dy, const float * y, const float * rstd, float * dx, int64_t rows,
                     int64_t d) {
    if (rows > 0) LOOM_LAUNCH(l2norm_backward_kernel, blocks_for(rows), kThreads, 0, stream)(dy, y, rstd, dx, rows, d);
}

void dsa_index_scores(cudaStream_t stream, const float * q, const float * k, const float * w, float * scores,
                      const DsaRows & rows, int64_t H, int64_t d, bool relu) {
    const int64_t n = rows.b * rows.s * rows.keys;
    if (n > 0) LOOM_LAUNCH(dsa_index_scores_kernel, blocks_for(n), kThreads, 0, stream)(q, k, w, scores, rows, H, d, relu);
}

void dsa_index_scores_backward(cudaStream_t stream, const float * q, const float * k, const float * w, const float * dscores,
                               float * dq, float * dk, float * dw, const DsaRows & rows, int64_t H, int64_t d, bool relu) {
    if (rows.b * rows.s == 0) return;
    LOOM_LAUNCH(dsa_index_dq_kernel, blocks_for(rows.s * rows.b * H), kThreads, 0, stream)(q, k, w, dscores, dq, dw, rows,
                                                                                         H, d, relu);
    LOOM_LAUNCH(dsa_index_dk_kernel, blocks_for(rows.keys * rows.b), kThreads, 0, stream)(q, k, w, dscores, dk, rows, H,
                                                                                        d, relu);
}

void dsa_topk_mask(cudaStream_t stream, const float * scores, int64_t k, uint8_t * mask, const DsaRows & rows) {
    const int64_t n = rows.b * rows.s * rows.keys;
    if (n > 0) LOOM_LAUNCH(dsa_topk_mask_kernel, blocks_for(n), kThreads, 0, stream)(scores, k, mask, rows);
}

template <class T>
void dsa_attention_target(cudaStream_t stream, const T * q_k_v, const T * kv, float * target, const DsaRows & rows,
                          int64_t heads, int64_t d, int64_t row_stride, int64_t kv_stride, int64_t k_col, float scale,
                          const uint8_t * key_mask) {
    if (rows.b * rows.s > 0) {
        LOOM_LAUNCH(dsa_attention_target_kernel<T>, blocks_for(rows.b * rows.s), kThreads, 0, stream)(
            q_k_v, kv, target, rows, heads, d, row_stride, kv_stride, k_col, scale, key_mask);
    }
}
template void dsa_attention_target(cudaStream_t, const float *, const float *, float *, const DsaRows &, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, float, const uint8_t *);
template void dsa_attention_target(cudaStream_t, const Bf16 *, const Bf16 *, float *, const DsaRows &, int64_t, int64_t,
                                   int64_t, int64_t, int64_t, float, const uint8_t *);

void dsa_indexer_loss(cudaStream_t stream, const float * scores, const float * target, float weight, float * kl,
                      float * dscores, const DsaRows & rows, const uint8_t * mask) {
    if (rows.b * rows.s > 0) {
        LOOM_LAUNCH(dsa_indexer_loss_kernel, blocks_for(rows.b * rows.s), kThreads, 0, stream)(scores, target, weight, kl,
                                                                                               dscores, rows, mask);
    }
}

template <class T>
void gdn_gates_forward(cudaStream_t stream, const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                       float * g, float * beta, int64_t n, int64_t H) {
    if (n * H > 0) {
        LOOM_LAUNCH(gdn_gates_forward_kernel<T>, blocks_for(n * H), kThreads, 0, stream)(src, stride, a_log, dt_bias, g, beta,
                                                                                          n, H);
    }
}

template <class T>
void gdn_gates_backward(cudaStream_t stream, const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                        const float * dg, const float * dbeta, T * dsrc, float * da_log, float * ddt_bias, int64_t n,
                        int64_t H) {
    if (n * H == 0) return;
    LOOM_LAUNCH(gdn_gates_dsrc_kernel<T>, blocks_for(n * H), kThreads, 0, stream)(src, stride, a_log, dt_bias, dg, dbeta,
                                                                                   dsrc, n, H);
    LOOM_LAUNCH(gdn_gates_params_kernel<T>, blocks_for(H), kThreads, 0, stream)(src, stride, a_log, dt_bias, dg, da_log,
                                                                                 ddt_bias, n, H);
}

template <class T>
void squared_relu_forward(cudaStream_t stream, const T * x, T * y, int64_t count) {
    if (count > 0) LOOM_LAUNCH(squared_relu_forward_kernel<T>, blocks_for(count), kThreads, 0, stream)(x, y, count);
}

template <class T>
void squared_relu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t count) {
    if (count > 0) LOOM_LAUNCH(squared_relu_backward_kernel<T>, blocks_for(count), kThreads, 0, stream)(x, dy, dx, count);
}

template <class T>
void swiglu_forward(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t f) {
    if (n * f > 0) LOOM_LAUNCH(swiglu_forward_kernel<T>, blocks_for(n * f), kThreads, 0, stream)(x, y, n, f);
}

template <class T>
void glu_forward(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t f, GluSpec glu) {
    const float k = glu.gate == GluSpec::Gate::quick_gelu ? 1.702f : 1.0f;
    if (n * f > 0) LOOM_LAUNCH(glu_forward_kernel<T>, blocks_for(n * f), kThreads, 0, stream)(x, y, n, f, k, glu.clamp, glu.linear_offset);
}

template <class T>
void glu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t n, int64_t f, GluSpec glu) {
    const float k = glu.gate == GluSpec::Gate::quick_gelu ? 1.702f : 1.0f;
    if (n * f > 0) {
        LOOM_LAUNCH(glu_backward_kernel<T>, blocks_for(n * f), kThreads, 0, stream)(x, dy, dx, n, f, k, glu.clamp, glu.linear_offset);
    }
}

template <class T>
void swiglu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t n, int64_t f) {
    if (n * f > 0) LOOM_LAUNCH(swiglu_backward_kernel<T>, blocks_for(n * f), kThreads, 0, stream)(x, dy, dx, n, f);
}

void adamw(cudaStream_t stream, float * p, const float * g, float * m, float * v, void * out, AdamOut out_kind,
           int64_t n, const AdamCoeffs & c) {
    if (n > 0) LOOM_LAUNCH(adamw_kernel, blocks_for(n), kThreads, 0, stream)(p, g, m, v, out, out_kind, n, c);
}

void adamw_multi(cudaStream_t stream, const AdamMulti & tensors) {
    const int64_t total = tensors.begin[tensors.count];
    if (total > 0) LOOM_LAUNCH(adamw_multi_kernel, blocks_for(total), kThreads, 0, stream)(tensors);
}

void grad_norm_gate(cudaStream_t stream, const float * pairs, const GradNormGate & g, float * gate, double * norm) {
    LOOM_LAUNCH(grad_norm_gate_kernel, 1, 1, 0, stream)(pairs, g, gate, norm);
}

void find_bad_id(cudaStream_t stream, const int32_t * ids, int64_t n, int64_t limit, unsigned long long * first_bad) {
    if (n > 0) LOOM_LAUNCH(find_bad_id_kernel, blocks_for(n), kThreads, 0, stream)(ids, n, limit, first_bad);
}

template <class T>
void rope(cudaStream_t stream, T * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, int64_t r,
          bool interleaved, const float * inv_freq, bool inverse, SeqPositions positions, float amplitude) {
    const int64_t pairs = s * b * heads * (r / 2);
    if (pairs > 0) {
        LOOM_LAUNCH(rope_kernel<T>, blocks_for(pairs), kThreads, 0, stream)(
            x, row_stride, s, b, heads, d, r, interleaved, inv_freq, inverse, positions, amplitude);
    }
}

template <class T>
void dropout(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t w, const DropoutKey & key) {
    if (n * w > 0) LOOM_LAUNCH(dropout_kernel<T>, blocks_for(n * w), kThreads, 0, stream)(x, y, n, w, key);
}

template <class T>
void embedding_forward(cudaStream_t stream, const int32_t * tokens, const void * wte, const void * wpe, Float kind,
                       T * out, int64_t s, int64_t b, int64_t h, int64_t vocab, SeqPositions positions) {
    const int64_t count = s * b * h;
    if (count == 0) return;
    if (kind == Float::f32) {
        LOOM_LAUNCH((embedding_forward_kernel<float, T>), blocks_for(count), kThreads, 0, stream)(
            tokens, static_cast<const float *>(wte), static_cast<const float *>(wpe), out, s, b, h, vocab, positions);
    } else {
        LOOM_LAUNCH((embedding_forward_kernel<uint16_t, T>), blocks_for(count), kThreads, 0, stream)(
            tokens, static_cast<const uint16_t *>(wte), static_cast<const uint16_t *>(wpe), out, s, b, h, vocab,
            positions);
    }
}

int64_t embedding_backward_keys(int64_t rows) {
    int64_t n = 1;
    while (n < rows) n *= 2;
    return n;
}

template <class T>
void embedding_backward(cudaStream_t stream, const int32_t * tokens, const T * dout, float * dwte, float * dwpe, int64_t s,
                        int64_t b, int64_t h, int64_t vocab, SeqPositions positions, uint64_t * keys) {
    if (s * b == 0 || h == 0) return;
    if (vocab > 0) {
        const int64_t n = embedding_backward_keys(s * b);
        LOOM_LAUNCH(embedding_row_keys_kernel, blocks_for(n), kThreads, 0, stream)(tokens, keys, s, b, vocab, n);
        for (int64_t k = 2; k <= n; k *= 2) {
            for (int64_t j = k / 2; j > 0; j /= 2) {
                LOOM_LAUNCH(bitonic_pass_kernel, blocks_for(n), kThreads, 0, stream)(keys, n, j, k);
            }
        }
        LOOM_LAUNCH(embedding_backward_runs_kernel<T>, blocks_for(n * h), kThreads, 0, stream)(keys, dout, dwte, n, h);
    }
    if (dwpe != nullptr) {
        LOOM_LAUNCH(embedding_backward_wpe_kernel<T>, blocks_for(s * h), kThreads, 0, stream)(dout, dwpe, s, b, h, positions);
    }
}

void vocab_shard_ids(cudaStream_t stream, const int32_t * ids, int64_t n, int64_t begin, int64_t count, int32_t * out) {
    if (n > 0) LOOM_LAUNCH(vocab_shard_ids_kernel, blocks_for(n), kThreads, 0, stream)(ids, n, begin, count, out);
}

template <class T>
void row_max(cudaStream_t stream, const T * logits, int64_t n, int64_t stride, int64_t valid, float * out) {
    if (n > 0) LOOM_LAUNCH(row_max_kernel<T>, static_cast<unsigned>(n), kThreads, 0, stream)(logits, stride, valid, out);
}

template <class T>
void row_sum_exp(cudaStream_t stream, const T * logits, const float * max, int64_t n, int64_t stride, int64_t valid,
                 float * out) {
    if (n > 0) {
        LOOM_LAUNCH(row_sum_exp_kernel<T>, static_cast<unsigned>(n), kThreads, 0, stream)(logits, max, stride, valid, out);
    }
}

template <class T>
void cross_entropy_forward(cudaStream_t stream, const T * logits, const int32_t * labels, float * loss, float * lse,
                           int64_t s, int64_t b, int64_t stride, int64_t vocab) {
    if (s * b > 0) {
        LOOM_LAUNCH(cross_entropy_forward_kernel<T>, static_cast<unsigned>(s * b), kThreads, 0, stream)(
            logits, labels, loss, lse, s, b, stride, vocab);
    }
}

template <class T>
void cross_entropy_backward(cudaStream_t stream, T * logits, const int32_t * labels, const float * lse,
                            const float * dloss, int64_t s, int64_t b, int64_t stride, int64_t vocab) {
    if (s * b > 0) {
        LOOM_LAUNCH(cross_entropy_backward_kernel<T>, static_cast<unsigned>(s * b), kThreads, 0, stream)(
            logits, labels, lse, dloss, s, b, stride, vocab);
    }
}

template <class T>
void label_logit(cudaStream_t stream, const T * logits, const int32_t * labels, float * out, int64_t s, int64_t b,
                 int64_t stride) {
    if (s * b > 0) {
        LOOM_LAUNCH(label_logit_kernel<T>, blocks_for(s * b), kThreads, 0, stream)(logits, labels, out, s, b, stride);
    }
}

void lse_and_loss(cudaStream_t stream, const float * max, const float * sum, const float * target, float * lse,
                  float * loss, int64_t n) {
    if (n > 0) LOOM_LAUNCH(lse_and_loss_kernel, blocks_for(n), kThreads, 0, stream)(max, sum, target, lse, loss, n);
}

void loss_grad(cudaStream_t stream, const float * mask, double scale, float * dloss, int64_t s, int64_t b) {
    if (s * b > 0) LOOM_LAUNCH(loss_grad_kernel, blocks_for(s * b), kThreads, 0, stream)(mask, scale, dloss, s, b);
}

// Every activations kernel for both storage types.
#define LOOM_ACTIVATION_KERNELS(T)                                                                                   \
    template void add_inplace(cudaStream_t, T *, const T *, int64_t);                                               \
    template void bias_add(cudaStream_t, T *, const float *, int64_t, int64_t);                                      \
    template void bias_backward(cudaStream_t, const T *, float *, float *, int64_t, int64_t);                        \
    template void layernorm_forward(cudaStream_t, T *, const T *, const float *, const float *, T *, float *, float *, \
                                    int64_t, int64_t, float);                                                        \
    template void rmsnorm_forward(cudaStream_t, T *, const T *, const float *, T *, float *, int64_t, int64_t, float); \
    template void layernorm_backward(cudaStream_t, const T *, const T *, const float *, const float *, const float *, \
                                     T *, float *, float *, float *, int64_t, int64_t, const T *);                   \
    template void rmsnorm_backward(cudaStream_t, const T *, const T *, const float *, const float *, T *, float *,    \
                                   float *, int64_t, int64_t, const T *);                                            \
    template void bias_gelu_forward(cudaStream_t, T *, const float *, T *, uint16_t *, int64_t, int64_t);            \
    template void gelu_backward(cudaStream_t, const T *, const T *, T *, int64_t);                                   \
    template void squared_relu_forward(cudaStream_t, const T *, T *, int64_t);                                       \
    template void output_gate_forward(cudaStream_t, const T *, const T *, int64_t, T *, int64_t, int64_t,            \
                                      GateActivation);                                                               \
    template void output_gate_backward(cudaStream_t, const T *, const T *, int64_t, const T *, T *, T *, int64_t,    \
                                       int64_t, GateActivation);                                                     \
    template void gdn_gates_forward(cudaStream_t, const T *, int64_t, const float *, const float *, float *, float *, \
                                    int64_t, int64_t);                                                               \
    template void gdn_gates_backward(cudaStream_t, const T *, int64_t, const float *, const float *, const float *,  \
                                     const float *, T *, float *, float *, int64_t, int64_t);                        \
    template void squared_relu_backward(cudaStream_t, const T *, const T *, T *, int64_t);                           \
    template void swiglu_forward(cudaStream_t, const T *, T *, int64_t, int64_t);                                    \
    template void swiglu_backward(cudaStream_t, const T *, const T *, T *, int64_t, int64_t);                        \
    template void glu_forward(cudaStream_t, const T *, T *, int64_t, int64_t, GluSpec);                              \
    template void glu_backward(cudaStream_t, const T *, const T *, T *, int64_t, int64_t, GluSpec);                  \
    template void rope(cudaStream_t, T *, int64_t, int64_t, int64_t, int64_t, int64_t, int64_t, bool, const float *, \
                       bool, SeqPositions, float);                                                                   \
    template void dropout(cudaStream_t, const T *, T *, int64_t, int64_t, const DropoutKey &);                       \
    template void embedding_forward(cudaStream_t, const int32_t *, const void *, const void *, Float, T *, int64_t,  \
                                    int64_t, int64_t, int64_t, SeqPositions);                                        \
    template void embedding_backward(cudaStream_t, const int32_t *, const T *, float *, float *, int64_t, int64_t,   \
                                     int64_t, int64_t, SeqPositions, uint64_t *);                                    \
    template void row_max(cudaStream_t, const T *, int64_t, int64_t, int64_t, float *);                              \
    template void row_sum_exp(cudaStream_t, const T *, const float *, int64_t, int64_t, int64_t, float *);            \
    template void cross_entropy_forward(cudaStream_t, const T *, const int32_t *, float *, float *, int64_t, int64_t, \
                                        int64_t, int64_t);                                                           \
    template void cross_entropy_backward(cudaStream_t, T *, const int32_t *, const float *, const float *, int64_t,  \
                                         int64_t, int64_t, int64_t);                                                 \
    template void label_logit(cudaStream_t, const T *, const int32_t *, float *, int64_t, int64_t, int64_t);

LOOM_ACTIVATION_KERNELS(float)
LOOM_ACTIVATION_KERNELS(Bf16)
#undef LOOM_ACTIVATION_KERNELS

}  // namespace loom::LOOM_CUDA_NS::kernels
