// DeepSeek Sparse Attention's indexer kernels (Ops::dsa_index_scores, _backward, dsa_topk_mask,
// dsa_attention_target, dsa_indexer_loss; core/ops.h states them). Every sum runs in index order in f32, one task per sequence and
// query row (the keys' gradient: per key position), so the result does not depend on the thread budget.
#include "backend/cpu/ops.h"

#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace loom::cpu {

namespace {

float dot(const float * a, const float * b, int64_t d) {
    float sum = 0.0f;
    for (int64_t x = 0; x < d; ++x) sum += a[x] * b[x];
    return sum;
}

}  // namespace

void dsa_index_scores(const float * q, const float * k, const float * w, float * scores, const DsaRows & rows, int64_t H,
                      int64_t d, bool relu) {
    const float   minus_inf = -std::numeric_limits<float>::infinity();
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    parallel_for(s * b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bi = task / s, i = task % s, ri = i * b + bi, last = rows.last(i);
            float *       out = scores + (bi * s + i) * S;
            for (int64_t j = 0; j <= last; ++j) {
                const float * kj  = k + (j * b + bi) * d;
                float         sum = 0.0f;
                for (int64_t h = 0; h < H; ++h) {
                    const float z = dot(q + (ri * H + h) * d, kj, d);
                    sum += w[ri * H + h] * (relu ? std::max(z, 0.0f) : z);
                }
                out[j] = sum;
            }
            for (int64_t j = last + 1; j < S; ++j) out[j] = minus_inf;
        }
    });
}

void dsa_index_scores_backward(const float * q, const float * k, const float * w, const float * dscores, float * dq,
                               float * dk, float * dw, const DsaRows & rows, int64_t H, int64_t d, bool relu) {
    const int64_t s = rows.s, b = rows.b, S = rows.keys;
    // The queries' side: dq and dw of each row.
    parallel_for(s * b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bi = task / s, i = task % s, ri = i * b + bi, last = rows.last(i);
            const float * g  = dscores + (bi * s + i) * S;
            for (int64_t h = 0; h < H; ++h) {
                const float * qh  = q + (ri * H + h) * d;
                float *       dqh = dq + (ri * H + h) * d;
                std::fill(dqh, dqh + d, 0.0f);
                float dwh = 0.0f;
                for (int64_t j = 0; j <= last; ++j) {
                    const float * kj = k + (j * b + bi) * d;
                    const float   z  = dot(qh, kj, d);
                    if (relu && !(z > 0.0f)) continue;
                    dwh += g[j] * z;
                    const float dz = g[j] * w[ri * H + h];
                    for (int64_t x = 0; x < d; ++x) dqh[x] += dz * kj[x];
                }
                dw[ri * H + h] = dwh;
            }
        }
    });
    // The keys' side: dk of each key, over the query rows at or after it.
    parallel_for(S * b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bi = task / S, j = task % S, rj = j * b + bi;
            const float * kj  = k + rj * d;
            float *       dkj = dk + rj * d;
            std::fill(dkj, dkj + d, 0.0f);
            for (int64_t i = 0; i < s; ++i) {
                if (rows.last(i) < j) continue;
                const int64_t ri = i * b + bi;
                const float   g  = dscores[(bi * s + i) * S + j];
                for (int64_t h = 0; h < H; ++h) {
                    const float * qh = q + (ri * H + h) * d;
                    const float   z  = dot(qh, kj, d);
                    if (relu && !(z > 0.0f)) continue;
                    const float dz = g * w[ri * H + h];
                    for (int64_t x = 0; x < d; ++x) dkj[x] += dz * qh[x];
                }
            }
        }
    });
}

void dsa_topk_mask(const float * scores, int64_t k, uint8_t * mask, const DsaRows & rows) {
    const int64_t s = rows.s, S = rows.keys;
    parallel_for(s * rows.b, 1, [&](int64_t begin, int64_t end) {
        std::vector<int64_t> keys;
        for (int64_t task = begin; task < end; ++task) {
            const int64_t last = rows.last(task % s);
            const float * row  = scores + task * S;
            uint8_t *     out  = mask + task * S;
            std::fill(out, out + S, uint8_t{0});
            if (last + 1 <= k) {   // every causal key
                std::fill(out, out + last + 1, uint8_t{1});
                continue;
            }
            keys.resize(static_cast<size_t>(last + 1));
            for (int64_t j = 0; j <= last; ++j) keys[static_cast<size_t>(j)] = j;
            // A strict total order (score, then the earlier key), so the first k are one set however found.
            std::nth_element(keys.begin(), keys.begin() + (k - 1), keys.end(), [row](int64_t x, int64_t y) {
                return row[x] > row[y] || (row[x] == row[y] && x < y);
            });
            for (int64_t r = 0; r < k; ++r) out[keys[static_cast<size_t>(r)]] = 1;
        }
    });
}

template <class T>
void dsa_attention_target(const T * q_k_v, const T * kv, float * target, const AttentionShape & a, float scale) {
    const int64_t s = a.s, b = a.b, d = a.d, S = a.keys(), k_col = a.k_column();
    const uint8_t * key_mask = a.key_mask.defined() ? a.key_mask.data<uint8_t>() : nullptr;
    parallel_for(s * b, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qh(static_cast<size_t>(d)), kj(static_cast<size_t>(d)), logits(static_cast<size_t>(S));
        for (int64_t task = begin; task < end; ++task) {
            const int64_t   bi = task / s, i = task % s, last = a.q_pos(i);
            float *         out  = target + (bi * s + i) * S;
            const uint8_t * held = key_mask != nullptr ? key_mask + (bi * s + i) * S : nullptr;
            std::fill(out, out + S, 0.0f);
            for (int64_t h = 0; h < a.nq; ++h) {
                const T * qp = q_k_v + (i * b + bi) * a.row_stride + h * d;
                for (int64_t x = 0; x < d; ++x) qh[x] = to_f32(qp[x]);
                float mx = -std::numeric_limits<float>::infinity();
                for (int64_t j = 0; j <= last; ++j) {
                    if (held != nullptr && held[j] == 0) continue;
                    const T * kp = kv + (j * b + bi) * a.kv_stride() + k_col + h * d;
                    for (int64_t x = 0; x < d; ++x) kj[x] = to_f32(kp[x]);
                    logits[j] = scale * dot(qh.data(), kj.data(), d);
                    mx        = std::max(mx, logits[j]);
                }
                float sum = 0.0f;
                for (int64_t j = 0; j <= last; ++j) {
                    logits[j] = held != nullptr && held[j] == 0 ? 0.0f : std::exp(logits[j] - mx);
                    sum += logits[j];
                }
                for (int64_t j = 0; j <= last; ++j) out[j] += logits[j] / sum;
            }
        }
    });
}

template void dsa_attention_target(const float *, const float *, float *, const AttentionShape &, float);
template void dsa_attention_target(const Bf16 *, const Bf16 *, float *, const AttentionShape &, float);

void dsa_indexer_loss(const float * scores, const float * target, float weight, float * kl, float * dscores,
                      const DsaRows & rows, const uint8_t * mask) {
    const int64_t s = rows.s, S = rows.keys;
    parallel_for(s * rows.b, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t   last = rows.last(task % s);
            const float *   I    = scores + task * S;
            const float *   t    = target + task * S;
            float *         g    = dscores + task * S;
            const uint8_t * held = mask != nullptr ? mask + task * S : nullptr;
            auto            in   = [held](int64_t j) { return held == nullptr || held[j] != 0; };
            float           total = 0.0f, mx = -std::numeric_limits<float>::infinity();
            for (int64_t j = 0; j <= last; ++j) {
                if (!in(j)) continue;
                total += t[j];
                mx = std::max(mx, I[j]);
            }
            const float norm = std::max(total, 1e-10f);
            float       sum  = 0.0f;
            for (int64_t j = 0; j <= last; ++j) {
                if (in(j)) sum += std::exp(I[j] - mx);
            }
            const float log_sum = std::log(sum);
            float       row     = 0.0f;
            for (int64_t j = 0; j <= last; ++j) {
                if (!in(j)) {
                    g[j] = 0.0f;
                    continue;
                }
                const float T     = t[j] / norm;
                const float log_p = I[j] - mx - log_sum;
                row += T * (std::log(std::max(T, 1e-10f)) - log_p);
                g[j] = weight * (std::exp(log_p) - T);
            }
            for (int64_t j = last + 1; j < S; ++j) g[j] = 0.0f;
            kl[task] = weight * row;
        }
    });
}

}  // namespace loom::cpu
