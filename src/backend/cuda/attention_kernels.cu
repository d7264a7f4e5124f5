// The causal attention kernels (attention_kernels.h): flash-style tiles in shared memory, the CPU's
// exp_approx for the probabilities, and the dropout masks of core/dropout.h.
#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/kernel_common.cuh"
#include "backend/cuda/launch.h"
#include "core/dropout.h"
#include "core/float_bits.h"

#include <cmath>

namespace loom::LOOM_CUDA_NS::kernels {

namespace {

// ---- Causal attention (backend/cpu/attention.cpp's twin), flash-style: tiles of kAttnTile query rows and
// kAttnTile key rows in shared memory (rows padded to an odd stride, so a warp reading 32 rows' same column
// hits 32 banks), 256 threads a block. The forward keeps each query row's running max m, sum l and output
// accumulator (registers: thread t owns elements t, t + 256, ... of the (tile, d) block) and never forms
// the s x s matrix. The backward recomputes P = exp(S - lse) tile by tile: one kernel per key tile writes
// dK and dV (summing over the group's query heads and the query tiles in a fixed order), another per query
// tile writes dQ: no atomics, so the bits do not change run to run.

constexpr int kAttnTile    = 32;    // Br = Bc
constexpr int kAttnThreads = 256;
constexpr int kAttnPerThread = kAttnTile * kAttentionMaxHeadDim / kAttnThreads;   // (tile, d) elements a thread owns

// Each of this thread's elements of a (tile, d) block in use (elems of them: kAttnTile d, or fewer) as
// fn(k, row, column), k the thread's accumulator slot; unrolled, so the slots stay in registers.
template <class Fn> __device__ __forceinline__ void for_tile_elements(int64_t elems, int64_t d, Fn && fn) {
#pragma unroll
    for (int k = 0; k < kAttnPerThread; ++k) {
        const int64_t e = threadIdx.x + static_cast<int64_t>(k) * kAttnThreads;
        if (e < elems) fn(k, e / d, e % d);
    }
}

// The shared-memory row stride for head dimension d: odd.
__host__ __device__ __forceinline__ int attn_stride(int64_t d) { return static_cast<int>(d | 1); }

// dst (kAttnTile, stride ds) <- d columns from `col` of rows row0 .. of one sequence bi; rows past `rows`
// are 0. The source's elements E (float or Bf16, core/float_bits.h) are read as f32: the tiles are f32.
template <class E>
__device__ void attn_load(float * dst, const E * src, int64_t row0, int64_t rows, int64_t bi, int64_t col,
                          int64_t stride, const AttentionDims & a, int ds) {
    for (int64_t e = threadIdx.x; e < kAttnTile * a.d; e += blockDim.x) {
        const int64_t r = e / a.d, dd = e % a.d, i = row0 + r;
        dst[r * ds + dd] = i < rows ? to_f32(src[(i * a.b + bi) * stride + col + dd]) : 0.0f;
    }
}

// Whether query row i of sequence bi sees key row j (both in range): causal, within the window when there is one,
// and held by the key mask when there is one.
__device__ __forceinline__ bool attn_visible(const AttentionDims & a, int64_t bi, int64_t i, int64_t j) {
    return i < a.s && j < a.s_kv && a.k_pos(j) <= a.q_pos(i) && (a.window < 0 || a.k_pos(j) >= a.q_pos(i) - a.window) &&
           (a.key_mask == nullptr || a.key_mask[(bi * a.s + i) * a.s_kv + j] != 0);
}
// Whether no key of the tile from j0 falls in row i's window (keys' positions increase along the tile).
__device__ __forceinline__ bool attn_before_window(const AttentionDims & a, int64_t i, int64_t j0) {
    const int64_t last_key = (j0 + kAttnTile < a.s_kv ? j0 + kAttnTile : a.s_kv) - 1;
    return a.window >= 0 && a.k_pos(last_key) < a.q_pos(i) - a.window;
}
// The last query position of the tile from row i0.
__device__ __forceinline__ int64_t attn_last_query(const AttentionDims & a, int64_t i0) {
    return a.q_pos((i0 + kAttnTile < a.s ? i0 + kAttnTile : a.s) - 1);
}

__device__ __forceinline__ float attn_dot(const float * x, const float * y, int64_t d) {
    float sum = 0.0f;
    for (int64_t dd = 0; dd < d; ++dd) sum += x[dd] * y[dd];
    return sum;
}

__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

__device__ __forceinline__ uint64_t attn_base(const AttentionKey & key, int64_t bi) {
    return key.dropped ? dropout_base(key.seed, key.site, key.sample_ids != nullptr ? key.sample_ids[bi] : bi) : 0;
}

// One block per (sequence, query head, query tile), the last tiles (most keys) first.
template <class E>
__global__ void __launch_bounds__(kAttnThreads) attention_forward_kernel(const E * q, const E * kv, E * out, float * lse,
                                                                        AttentionDims a, float scale, AttentionKey key) {
    LOOM_DYNAMIC_SHARED(float, smem);
    constexpr int T = kAttnTile;
    const int     ds = attn_stride(a.d);
    float *       qs = smem, *ks = qs + T * ds, *vs = ks + T * ds, *ps = vs + T * ds;
    float *       ms = ps + T * (T + 1), *ls = ms + T, *corr = ls + T;

    const int64_t tiles = (a.s + T - 1) / T;
    const int64_t bh = blockIdx.x / tiles, qt = tiles - 1 - blockIdx.x % tiles;
    const int64_t bi = bh / a.nq, hq = bh % a.nq, hk = hq / (a.nq / a.nkv);
    const int64_t i0 = qt * T;
    const int     warp = threadIdx.x / 32, lane = threadIdx.x % 32;
    const uint64_t base = attn_base(key, bi);

    attn_load(qs, q, i0, a.s, bi, hq * a.d, a.row_stride, a, ds);
    if (threadIdx.x < T) {
        ms[threadIdx.x] = -INFINITY;
        ls[threadIdx.x] = 0.0f;
    }
    float acc[kAttnPerThread];
#pragma unroll
    for (int k = 0; k < kAttnPerThread; ++k) acc[k] = 0.0f;
    const int64_t elems = T * a.d;
    const int64_t last  = attn_last_query(a, i0);

    for (int64_t j0 = 0; j0 < a.s_kv && a.k_pos(j0) <= last; j0 += T) {
        if (attn_before_window(a, i0, j0)) continue;   // the tile's first query (and so every one) is past these keys
        __syncthreads();   // the previous tile's K, V and P are no longer read
        attn_load(ks, kv, j0, a.s_kv, bi, a.k_col + hk * a.d, a.kv_stride, a, ds);
        attn_load(vs, kv, j0, a.s_kv, bi, a.v_col + hk * a.d, a.kv_stride, a, ds);
        __syncthreads();
        for (int e = threadIdx.x; e < T * T; e += blockDim.x) {
            const int r = e / T, c = e % T;
            const int64_t i = i0 + r, j = j0 + c;
            ps[r * (T + 1) + c] = attn_visible(a, bi, i, j) ? attn_dot(qs + r * ds, ks + c * ds, a.d) * scale : 0.0f;
        }
        __syncthreads();
        // The online softmax, a warp per row: lane c holds key j0 + c.
        for (int r = warp; r < T; r += kAttnThreads / 32) {
            const int64_t i = i0 + r, j = j0 + lane;
            if (i >= a.s || a.k_pos(j0) > a.q_pos(i) || attn_before_window(a, i, j0)) {   // no key of this tile for row i
                ps[r * (T + 1) + lane] = 0.0f;
                if (lane == 0) corr[r] = 1.0f;
                continue;
            }
            const bool  valid  = attn_visible(a, bi, i, j);
            const float sc     = ps[r * (T + 1) + lane];
            const float m_old  = ms[r];
            const float mx     = fmaxf(m_old, warp_max(valid ? sc : -INFINITY));
            if (mx == -INFINITY) {   // the key mask holds no key of this tile for the row, nor did it before
                ps[r * (T + 1) + lane] = 0.0f;
                if (lane == 0) corr[r] = 1.0f;
                continue;
            }
            float       p      = valid ? exp_approx(__fsub_rn(sc, mx)) : 0.0f;
            const float sum    = warp_sum(p);
            if (key.dropped && valid) {   // l sums the undropped probabilities; O takes the dropped ones
                const uint64_t row = dropout_attention_row(base, key.head_offset + hq, a.q_pos(i));
                p = __fmul_rn(p, dropout_keep_attention(row, a.k_pos(j), key.threshold) ? key.keep_scale : 0.0f);
            }
            ps[r * (T + 1) + lane] = p;
            __syncwarp();   // every lane has read ms[r] before lane 0 replaces it (racecheck's WAR hazard)
            if (lane == 0) {
                const float cr = exp_approx(__fsub_rn(m_old, mx));
                corr[r]        = cr;
                ls[r]          = ls[r] * cr + sum;
                ms[r]          = mx;
            }
        }
        __syncthreads();
        for_tile_elements(elems, a.d, [&](int k, int64_t r, int64_t dd) {
            const float * pr = ps + r * (T + 1);
            float         v  = acc[k] * corr[r];
            for (int c = 0; c < T; ++c) v += pr[c] * vs[c * ds + dd];
            acc[k] = v;
        });
    }
    __syncthreads();
    for_tile_elements(elems, a.d, [&](int k, int64_t r, int64_t dd) {
        const int64_t i = i0 + r;
        if (i < a.s) out[((i * a.b + bi) * a.nq + hq) * a.d + dd] = from_f32<E>(ls[r] > 0.0f ? acc[k] * (1.0f / ls[r]) : 0.0f);
    });
    if (threadIdx.x < T && i0 + threadIdx.x < a.s) {   // a row that saw no key: -inf
        const float l = ls[threadIdx.x];
        lse[(bi * a.nq + hq) * a.s + i0 + threadIdx.x] = l > 0.0f ? ms[threadIdx.x] + logf(l) : -INFINITY;
    }
}

// delta[(bi, hq, i)] = sum_dd out * dout over query row i's head hq, in dd order (the CPU's).
template <class E>
__global__ void attention_delta_kernel(const E * out, const E * dout, float * delta, AttentionDims a) {
    LOOM_GRID_STRIDE(t, a.b * a.nq * a.s) {
        const int64_t i = t % a.s, bh = t / a.s, bi = bh / a.nq, hq = bh % a.nq;
        const int64_t at = ((i * a.b + bi) * a.nq + hq) * a.d;
        float         sum = 0.0f;
        for (int64_t dd = 0; dd < a.d; ++dd) sum += to_f32(out[at + dd]) * to_f32(dout[at + dd]);
        delta[t] = sum;
    }
}

// The shared tile of both backward kernels: for query rows i0 + r (Q, dO, lse, delta in shared memory) and
// keys j0 + c (K, V), ps[r][c] = P z (z the dropout factor, 1 without) and dss[r][c] = P (z dP - delta) scale,
// both 0 outside the causal triangle.
__device__ void attention_grad_tile(const float * qs, const float * dos, const float * ks, const float * vs,
                                    const float * lses, const float * deltas, float * ps, float * dss, int64_t i0,
                                    int64_t j0, int64_t bi, int64_t hq, uint64_t base, const AttentionDims & a, float scale,
                                    const AttentionKey & key, int ds) {
    constexpr int T = kAttnTile;
    for (int e = threadIdx.x; e < T * T; e += blockDim.x) {
        const int     r = e / T, c = e % T;
        const int64_t i = i0 + r, j = j0 + c;
        float         p = 0.0f, dsv = 0.0f;
        if (attn_visible(a, bi, i, j)) {
            const float pv = exp_approx(__fsub_rn(attn_dot(qs + r * ds, ks + c * ds, a.d) * scale, lses[r]));
            const float dp = attn_dot(dos + r * ds, vs + c * ds, a.d);
            if (key.dropped) {
                const uint64_t row = dropout_attention_row(base, key.head_offset + hq, a.q_pos(i));
                const float    z   = dropout_keep_attention(row, a.k_pos(j), key.threshold) ? key.keep_scale : 0.0f;
                p                  = pv * z;
                dsv                = pv * (z * dp - deltas[r]) * scale;
            } else {
                p   = pv;
                dsv = pv * (dp - deltas[r]) * scale;
            }
        }
        ps[e + r]  = p;   // row stride T + 1
        dss[e + r] = dsv;
    }
}

// Loads the query tile's lse and delta rows of head hq (0 past s).
__device__ void attn_load_rows(float * lses, float * deltas, const float * lse, const float * delta, int64_t i0,
                               int64_t bi, int64_t hq, const AttentionDims & a) {
    if (threadIdx.x < kAttnTile) {
        const int64_t i  = i0 + threadIdx.x;
        const int64_t at = (bi * a.nq + hq) * a.s + i;
        lses[threadIdx.x]   = i < a.s ? lse[at] : 0.0f;
        deltas[threadIdx.x] = i < a.s ? delta[at] : 0.0f;
    }
}

// dQ: one block per (sequence, query head, query tile); dQ = sum over key tiles of dS K, assigned (added with
// accumulate).
template <class E>
__global__ void __launch_bounds__(kAttnThreads) attention_dq_kernel(const E * q, const E * kv, const E * dout,
                                                                   const float * lse, const float * delta, E * dq,
                                                                   AttentionDims a, float scale, AttentionKey key,
                                                                   bool accumulate) {
    LOOM_DYNAMIC_SHARED(float, smem);
    constexpr int T = kAttnTile;
    const int     ds = attn_stride(a.d);
    float *       qs = smem, *dos = qs + T * ds, *ks = dos + T * ds, *vs = ks + T * ds;
    float *       ps = vs + T * ds, *dss = ps + T * (T + 1), *lses = dss + T * (T + 1), *deltas = lses + T;

    const int64_t tiles = (a.s + T - 1) / T;
    const int64_t bh = blockIdx.x / tiles, qt = tiles - 1 - blockIdx.x % tiles;
    const int64_t bi = bh / a.nq, hq = bh % a.nq, hk = hq / (a.nq / a.nkv);
    const int64_t i0 = qt * T, elems = T * a.d;
    const uint64_t base = attn_base(key, bi);

    attn_load(qs, q, i0, a.s, bi, hq * a.d, a.row_stride, a, ds);
    attn_load(dos, dout, i0, a.s, bi, hq * a.d, a.nq * a.d, a, ds);
    attn_load_rows(lses, deltas, lse, delta, i0, bi, hq, a);
    float acc[kAttnPerThread];
#pragma unroll
    for (int k = 0; k < kAttnPerThread; ++k) acc[k] = 0.0f;
    const int64_t last = attn_last_query(a, i0);

    for (int64_t j0 = 0; j0 < a.s_kv && a.k_pos(j0) <= last; j0 += T) {
        if (attn_before_window(a, i0, j0)) continue;   // the tile's first query (and so every one) is past these keys
        __syncthreads();
        attn_load(ks, kv, j0, a.s_kv, bi, a.k_col + hk * a.d, a.kv_stride, a, ds);
        attn_load(vs, kv, j0, a.s_kv, bi, a.v_col + hk * a.d, a.kv_stride, a, ds);
        __syncthreads();
        attention_grad_tile(qs, dos, ks, vs, lses, deltas, ps, dss, i0, j0, bi, hq, base, a, scale, key, ds);
        __syncthreads();
        for_tile_elements(elems, a.d, [&](int k, int64_t r, int64_t dd) {
            const float * dsr = dss + r * (T + 1);
            float         v   = acc[k];
            for (int c = 0; c < T; ++c) v += dsr[c] * ks[c * ds + dd];
            acc[k] = v;
        });
    }
    for_tile_elements(elems, a.d, [&](int k, int64_t r, int64_t dd) {
        const int64_t i = i0 + r;
        if (i < a.s) {
            E * at = dq + (i * a.b + bi) * a.row_stride + hq * a.d + dd;
            *at    = from_f32<E>(accumulate ? __fadd_rn(to_f32(*at), acc[k]) : acc[k]);
        }
    });
}

// dK and dV: one block per (sequence, key/value head, key tile); sums over the group's query heads, then
// over the query tiles that see the key tile, in that order; assigned (added with accumulate).
template <class E>
__global__ void __launch_bounds__(kAttnThreads) attention_dkdv_kernel(const E * q, const E * kv, const E * dout,
                                                                     const float * lse, const float * delta, E * dkv,
                                                                     AttentionDims a, float scale, AttentionKey key,
                                                                     bool accumulate) {
    LOOM_DYNAMIC_SHARED(float, smem);
    constexpr int T = kAttnTile;
    const int     ds = attn_stride(a.d);
    float *       qs = smem, *dos = qs + T * ds, *ks = dos + T * ds, *vs = ks + T * ds;
    float *       ps = vs + T * ds, *dss = ps + T * (T + 1), *lses = dss + T * (T + 1), *deltas = lses + T;

    const int64_t tiles = (a.s + T - 1) / T, key_tiles = (a.s_kv + T - 1) / T;
    const int64_t bh = blockIdx.x / key_tiles, kt = blockIdx.x % key_tiles;   // the first tiles (most queries) first
    const int64_t bi = bh / a.nkv, hk = bh % a.nkv, group = a.nq / a.nkv;
    const int64_t j0 = kt * T, elems = T * a.d, first_key = a.k_pos(j0);
    const uint64_t base = attn_base(key, bi);

    attn_load(ks, kv, j0, a.s_kv, bi, a.k_col + hk * a.d, a.kv_stride, a, ds);
    attn_load(vs, kv, j0, a.s_kv, bi, a.v_col + hk * a.d, a.kv_stride, a, ds);
    float dk[kAttnPerThread], dv[kAttnPerThread];
#pragma unroll
    for (int k = 0; k < kAttnPerThread; ++k) dk[k] = dv[k] = 0.0f;

    for (int64_t g = 0; g < group; ++g) {
        const int64_t hq = hk * group + g;
        for (int64_t qt = 0; qt < tiles; ++qt) {
            const int64_t i0 = qt * T;
            if (attn_last_query(a, i0) < first_key) continue;   // no query of the tile sees a key of this one
            if (attn_before_window(a, i0, j0)) continue;        // nor, past its window, its first query
            __syncthreads();
            attn_load(qs, q, i0, a.s, bi, hq * a.d, a.row_stride, a, ds);
            attn_load(dos, dout, i0, a.s, bi, hq * a.d, a.nq * a.d, a, ds);
            attn_load_rows(lses, deltas, lse, delta, i0, bi, hq, a);
            __syncthreads();
            attention_grad_tile(qs, dos, ks, vs, lses, deltas, ps, dss, i0, j0, bi, hq, base, a, scale, key, ds);
            __syncthreads();
            for_tile_elements(elems, a.d, [&](int k, int64_t c, int64_t dd) {
                float         vk = dk[k], vv = dv[k];
                for (int r = 0; r < T; ++r) {
                    vv += ps[r * (T + 1) + c] * dos[r * ds + dd];
                    vk += dss[r * (T + 1) + c] * qs[r * ds + dd];
                }
                dk[k] = vk;
                dv[k] = vv;
            });
        }
    }
    for_tile_elements(elems, a.d, [&](int k, int64_t c, int64_t dd) {
        const int64_t j = j0 + c;
        if (j < a.s_kv) {
            E * row = dkv + (j * a.b + bi) * a.kv_stride;
            E * pk  = row + a.k_col + hk * a.d + dd;
            E * pv  = row + a.v_col + hk * a.d + dd;
            *pk     = from_f32<E>(accumulate ? __fadd_rn(to_f32(*pk), dk[k]) : dk[k]);
            *pv     = from_f32<E>(accumulate ? __fadd_rn(to_f32(*pv), dv[k]) : dv[k]);
        }
    });
}

// One thread per (sequence, head, query): lse' = log(e^lse + e^part), out' = out e^(lse - lse') + part_out
// e^(part - lse'); a query whose part is -inf keeps its own.
__global__ void attention_merge_kernel(float * out, float * lse, const float * part_out, const float * part_lse,
                                       int64_t s, int64_t b, int64_t nq, int64_t d) {
    LOOM_GRID_STRIDE(t, b * nq * s) {
        const float pl = part_lse[t];
        if (pl == -INFINITY) continue;
        const int64_t i = t % s, bh = t / s, bi = bh / nq, hq = bh % nq;
        const float   l = lse[t], mx = fmaxf(l, pl);
        const float   nl = mx + logf(expf(l - mx) + expf(pl - mx));
        const float   wa = expf(l - nl), wb = expf(pl - nl);
        float *       o  = out + ((i * b + bi) * nq + hq) * d;
        const float * po = part_out + ((i * b + bi) * nq + hq) * d;
        for (int64_t dd = 0; dd < d; ++dd) o[dd] = o[dd] * wa + po[dd] * wb;
        lse[t] = nl;
    }
}

// One thread per (sequence, head, query): the sink joins the query's softmax (lse' = log(e^lse + e^sink)), its
// output scaled by e^(lse - lse').
template <class E>
__global__ void attention_sink_forward_kernel(E * out, float * lse, const float * sink, int64_t s, int64_t b, int64_t nq,
                                              int64_t d) {
    LOOM_GRID_STRIDE(t, b * nq * s) {
        const int64_t i = t % s, bh = t / s, bi = bh / nq, hq = bh % nq;
        const float   l = lse[t], sl = sink[hq], mx = fmaxf(l, sl);
        const float   nl = mx + logf(expf(l - mx) + expf(sl - mx));
        const float   w  = expf(l - nl);
        E *           o  = out + ((i * b + bi) * nq + hq) * d;
        for (int64_t dd = 0; dd < d; ++dd) o[dd] = from_f32<E>(to_f32(o[dd]) * w);
        lse[t] = nl;
    }
}

// One block of kSinkLanes threads per head: thread k sums the entries k, k + kSinkLanes, ... of (b, i) order,
// thread 0 the lanes in order (the CPU's sums).
template <class E>
__global__ void attention_sink_backward_kernel(const E * out, const E * dout, const float * lse, const float * sink,
                                               float * dsink, int64_t s, int64_t b, int64_t nq, int64_t d) {
    __shared__ float lanes[kSinkLanes];
    const int64_t    hq = blockIdx.x;
    float            sum = 0.0f;
    for (int64_t e = threadIdx.x; e < b * s; e += kSinkLanes) {
        const int64_t bi = e / s, i = e % s;
        const int64_t at = ((i * b + bi) * nq + hq) * d;
        float         delta = 0.0f;
        for (int64_t dd = 0; dd < d; ++dd) delta += to_f32(out[at + dd]) * to_f32(dout[at + dd]);
        sum += expf(sink[hq] - lse[(bi * nq + hq) * s + i]) * delta;
    }
    lanes[threadIdx.x] = sum;
    __syncthreads();
    if (threadIdx.x == 0) {
        float total = 0.0f;
        for (int64_t k = 0; k < kSinkLanes; ++k) total += lanes[k];
        dsink[hq] -= total;
    }
}

// Dynamic shared memory of the forward and of the backward kernels, in bytes.
size_t attention_forward_smem(int64_t d) {
    return sizeof(float) * (3 * kAttnTile * attn_stride(d) + kAttnTile * (kAttnTile + 1) + 3 * kAttnTile);
}
size_t attention_backward_smem(int64_t d) {
    return sizeof(float) * (4 * kAttnTile * attn_stride(d) + 2 * kAttnTile * (kAttnTile + 1) + 2 * kAttnTile);
}

// Allows `bytes` of dynamic shared memory to `kernel` where it needs more than the default 48 KiB.
template <typename Kernel>
cudaError_t allow_smem(Kernel kernel, size_t bytes) {
    if (bytes <= 48 * 1024) return cudaSuccess;
    return cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, static_cast<int>(bytes));
}

}  // namespace

template <class E>
cudaError_t attention_forward(cudaStream_t stream, const E * q, const E * kv, E * out, float * lse,
                              const AttentionDims & a, float scale, const AttentionKey & key) {
    const int64_t tiles  = (a.s + kAttnTile - 1) / kAttnTile;
    const int64_t blocks = tiles * a.b * a.nq;
    if (blocks == 0) return cudaSuccess;
    const size_t smem = attention_forward_smem(a.d);
    cudaError_t  err  = allow_smem(attention_forward_kernel<E>, smem);
    if (err != cudaSuccess) return err;
    LOOM_LAUNCH(attention_forward_kernel<E>, static_cast<unsigned>(blocks), kAttnThreads, smem, stream)(
        q, kv, out, lse, a, scale, key);
    return cudaGetLastError();
}

template <class E>
cudaError_t attention_backward(cudaStream_t stream, const E * q, const E * kv, const E * out, const E * dout,
                               const float * lse, float * delta, E * dq, E * dkv, const AttentionDims & a, float scale,
                               const AttentionKey & key, bool accumulate) {
    const int64_t tiles = (a.s + kAttnTile - 1) / kAttnTile, key_tiles = (a.s_kv + kAttnTile - 1) / kAttnTile;
    if (tiles * a.b * a.nq == 0 || key_tiles == 0) return cudaSuccess;
    const size_t smem = attention_backward_smem(a.d);
    cudaError_t  err  = allow_smem(attention_dq_kernel<E>, smem);
    if (err == cudaSuccess) err = allow_smem(attention_dkdv_kernel<E>, smem);
    if (err != cudaSuccess) return err;
    LOOM_LAUNCH(attention_delta_kernel<E>, blocks_for(a.b * a.nq * a.s), kThreads, 0, stream)(out, dout, delta, a);
    LOOM_LAUNCH(attention_dq_kernel<E>, static_cast<unsigned>(tiles * a.b * a.nq), kAttnThreads, smem, stream)(
        q, kv, dout, lse, delta, dq, a, scale, key, accumulate);
    LOOM_LAUNCH(attention_dkdv_kernel<E>, static_cast<unsigned>(key_tiles * a.b * a.nkv), kAttnThreads, smem, stream)(
        q, kv, dout, lse, delta, dkv, a, scale, key, accumulate);
    return cudaGetLastError();
}

cudaError_t attention_merge(cudaStream_t stream, float * out, float * lse, const float * part_out,
                            const float * part_lse, int64_t s, int64_t b, int64_t nq, int64_t d) {
    if (s * b * nq == 0) return cudaSuccess;
    LOOM_LAUNCH(attention_merge_kernel, blocks_for(b * nq * s), kThreads, 0, stream)(out, lse, part_out, part_lse, s, b,
                                                                                    nq, d);
    return cudaGetLastError();
}

template <class E>
cudaError_t attention_sink_forward(cudaStream_t stream, E * out, float * lse, const float * sink, int64_t s, int64_t b,
                                   int64_t nq, int64_t d) {
    if (s * b * nq == 0) return cudaSuccess;
    LOOM_LAUNCH(attention_sink_forward_kernel<E>, blocks_for(b * nq * s), kThreads, 0, stream)(out, lse, sink, s, b, nq, d);
    return cudaGetLastError();
}

template <class E>
cudaError_t attention_sink_backward(cudaStream_t stream, const E * out, const E * dout, const float * lse, const float * sink,
                                    float * dsink, int64_t s, int64_t b, int64_t nq, int64_t d) {
    if (nq == 0) return cudaSuccess;
    LOOM_LAUNCH(attention_sink_backward_kernel<E>, static_cast<unsigned>(nq), static_cast<unsigned>(kSinkLanes), 0, stream)(
        out, dout, lse, sink, dsink, s, b, nq, d);
    return cudaGetLastError();
}

template cudaError_t attention_sink_forward(cudaStream_t, float *, float *, const float *, int64_t, int64_t, int64_t, int64_t);
template cudaError_t attention_sink_forward(cudaStream_t, Bf16 *, float *, const float *, int64_t, int64_t, int64_t, int64_t);
template cudaError_t attention_sink_backward(cudaStream_t, const float *, const float *, const float *, const float *, float *,
                                             int64_t, int64_t, int64_t, int64_t);
template cudaError_t attention_sink_backward(cudaStream_t, const Bf16 *, const Bf16 *, const float *, const float *, float *,
                                             int64_t, int64_t, int64_t, int64_t);

template cudaError_t attention_forward(cudaStream_t, const float *, const float *, float *, float *,
                                      const AttentionDims &, float, const AttentionKey &);
template cudaError_t attention_forward(cudaStream_t, const Bf16 *, const Bf16 *, Bf16 *, float *, const AttentionDims &,
                                      float, const AttentionKey &);
template cudaError_t attention_backward(cudaStream_t, const float *, const float *, const float *, const float *,
                                       const float *, float *, float *, float *, const AttentionDims &, float,
                                       const AttentionKey &, bool);
template cudaError_t attention_backward(cudaStream_t, const Bf16 *, const Bf16 *, const Bf16 *, const Bf16 *,
                                       const float *, float *, Bf16 *, Bf16 *, const AttentionDims &, float,
                                       const AttentionKey &, bool);

}  // namespace loom::LOOM_CUDA_NS::kernels
