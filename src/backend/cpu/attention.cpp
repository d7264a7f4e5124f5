#include "backend/cpu/attention.h"

#include "backend/cpu/vec_math.h"
#include "core/dropout.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <limits>
#include <vector>

namespace loom::cpu {

namespace {

constexpr int64_t kBlock = 64;   // Br = Bc

// The (s, b) rows of one tensor: a row stride and the batch.
struct Layout {
    int64_t b, stride, d;
    int64_t row(int64_t si, int64_t bi) const { return (si * b + bi) * stride; }
};

// dst (rows, d) f32 <- rows of src at row offsets (contiguous copy of a strided block).
template <class T>
void gather(const T * src, const Layout & L, int64_t bi, int64_t s0, int64_t rows, int64_t col, float * dst) {
    for (int64_t r = 0; r < rows; ++r) {
        const T * p = src + L.row(s0 + r, bi) + col;
        for (int64_t dd = 0; dd < L.d; ++dd) dst[r * L.d + dd] = to_f32(p[dd]);
    }
}

// dst (d, cols) f32 <- transpose of a strided (cols, d) block.
template <class T>
void gather_t(const T * src, const Layout & L, int64_t bi, int64_t s0, int64_t cols, int64_t col, float * dst) {
    for (int64_t c = 0; c < cols; ++c) {
        const T * p = src + L.row(s0 + c, bi) + col;
        for (int64_t dd = 0; dd < L.d; ++dd) dst[dd * kBlock + c] = to_f32(p[dd]);
    }
}

// The keys of a block j0 .. j0 + cols that query position qp sees, [lo, hi) of the block: causal, keys at
// positions <= qp, and with a window w >= 0 also >= qp - w (positions increase along the keys).
struct Visible {
    int64_t lo = 0, hi = 0;
};
Visible visible(const SeqPositions & k_pos, int64_t j0, int64_t cols, int64_t qp, int64_t window) {
    Visible v;
    while (v.hi < cols && k_pos(j0 + v.hi) <= qp) ++v.hi;
    if (window >= 0) {
        while (v.lo < v.hi && k_pos(j0 + v.lo) < qp - window) ++v.lo;
    }
    return v;
}

// The key mask's entries for query row i of sequence bi from key j0 (AttentionShape::key_mask), or null: every key.
const uint8_t * masked_row(const uint8_t * key_mask, const AttentionShape & a, int64_t bi, int64_t i, int64_t j0) {
    return key_mask != nullptr ? key_mask + (bi * a.s + i) * a.keys() + j0 : nullptr;
}

// S (rows, cols) = scale * A (rows, d) . Bt (d, cols), with Bt's row stride kBlock.
void scores(const float * a, const float * bt, int64_t rows, int64_t cols, int64_t d, float scale, float * s) {
    for (int64_t r = 0; r < rows; ++r) {
        float * sr = s + r * kBlock;
        std::fill(sr, sr + cols, 0.0f);
        for (int64_t dd = 0; dd < d; ++dd) {
            float         av = a[r * d + dd];
            const float * br = bt + dd * kBlock;
            for (int64_t c = 0; c < cols; ++c) sr[c] += av * br[c];
        }
        for (int64_t c = 0; c < cols; ++c) sr[c] *= scale;
    }
}

// Draws one row of the dropout mask: z[c] = mask / (1 - p) for keys j0 .. j0 + cols of one query's row key.
struct MaskRow {
    uint32_t threshold;
    float    keep_scale;
    void draw(uint64_t row, const SeqPositions & k_pos, int64_t j0, int64_t cols, float * z) const {
        for (int64_t c = 0; c < cols; ++c) {
            z[c] = dropout_keep_attention(row, k_pos(j0 + c), threshold) ? keep_scale : 0.0f;
        }
    }
};

MaskRow mask_row(const AttentionDropout & dropout) {
    return {dropout_threshold(dropout.p), 1.0f / (1.0f - dropout.p)};
}

uint64_t sample_base(const AttentionDropout & dropout, int64_t bi) {
    return dropout_base(dropout.seed, dropout.site, dropout.sample_ids ? dropout.sample_ids[bi] : bi);
}

}  // namespace

template <class T>
void attention_forward(const T * qkv_q, const T * kv, T * out, float * lse, const AttentionShape & a, float scale,
                       const AttentionDropout & dropout) {
    const Layout  Q{a.b, a.row_stride, a.d}, K{a.b, a.kv_stride(), a.d};
    const int64_t group = a.nq / a.nkv, s_kv = a.keys(), k_col = a.k_column(), v_col = a.v_column();
    const bool    dropped = dropout.p > 0.0f;
    const MaskRow mask    = mask_row(dropout);
    const uint8_t * key_mask = a.key_mask.defined() ? a.key_mask.data<uint8_t>() : nullptr;
    parallel_for(a.b * a.nq, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> q(kBlock * a.d), kt(a.d * kBlock), v(kBlock * a.d), s(kBlock * kBlock),
            acc(kBlock * a.d), m(kBlock), l(kBlock), z(kBlock);
        for (int64_t task = begin; task < end; ++task) {
            int64_t  bi = task / a.nq, hq = task % a.nq, hk = hq / group;
            uint64_t base = dropped ? sample_base(dropout, bi) : 0;
            for (int64_t i0 = 0; i0 < a.s; i0 += kBlock) {
                int64_t rows = std::min(kBlock, a.s - i0);
                gather(qkv_q, Q, bi, i0, rows, hq * a.d, q.data());
                std::fill(acc.begin(), acc.end(), 0.0f);
                std::fill(m.begin(), m.end(), -std::numeric_limits<float>::infinity());
                std::fill(l.begin(), l.end(), 0.0f);
                const int64_t last = a.q_pos(i0 + rows - 1);   // the block's last query position
                for (int64_t j0 = 0; j0 < s_kv && a.k_pos(j0) <= last; j0 += kBlock) {
                    int64_t cols = std::min(kBlock, s_kv - j0);
                    if (a.window >= 0 && a.k_pos(j0 + cols - 1) < a.q_pos(i0) - a.window) continue;   // before every window
                    gather_t(kv, K, bi, j0, cols, k_col + hk * a.d, kt.data());
                    gather(kv, K, bi, j0, cols, v_col + hk * a.d, v.data());
                    scores(q.data(), kt.data(), rows, cols, a.d, scale, s.data());
                    for (int64_t r = 0; r < rows; ++r) {
                        const int64_t qp    = a.q_pos(i0 + r);
                        float *       sr    = s.data() + r * kBlock;
                        const Visible vis   = visible(a.k_pos, j0, cols, qp, a.window);   // causal, windowed
                        const uint8_t * held = masked_row(key_mask, a, bi, i0 + r, j0);    // and the key mask's
                        int64_t lo = vis.lo, limit = vis.hi;
                        if (held != nullptr) {
                            while (lo < limit && held[lo] == 0) ++lo;
                            while (limit > lo && held[limit - 1] == 0) --limit;
                        }
                        if (lo == limit) continue;
                        float   mx    = m[r];
                        for (int64_t c = lo; c < limit; ++c) {
                            if (held == nullptr || held[c] != 0) mx = std::max(mx, sr[c]);
                        }
                        float correction = exp_approx(m[r] - mx);
                        for (int64_t c = lo; c < limit; ++c) {
                            sr[c] = held != nullptr && held[c] == 0 ? 0.0f : exp_approx(sr[c] - mx);
                        }
                        float sum = 0;
                        for (int64_t c = lo; c < limit; ++c) sum += sr[c];
                        float * ar = acc.data() + r * a.d;
                        for (int64_t dd = 0; dd < a.d; ++dd) ar[dd] *= correction;
                        if (dropped) {   // l sums the undropped probabilities; O takes the dropped ones
                            mask.draw(dropout_attention_row(base, dropout.head_offset + hq, qp), a.k_pos, j0, limit,
                                      z.data());
                            for (int64_t c = lo; c < limit; ++c) sr[c] *= z[c];
                        }
                        for (int64_t c = lo; c < limit; ++c) {
                            float         p  = sr[c];
                            const float * vr = v.data() + c * a.d;
                            for (int64_t dd = 0; dd < a.d; ++dd) ar[dd] += p * vr[dd];
                        }
                        l[r] = l[r] * correction + sum;
                        m[r] = mx;
                    }
                }
                for (int64_t r = 0; r < rows; ++r) {
                    T *     o   = out + ((i0 + r) * a.b + bi) * a.nq * a.d + hq * a.d;
                    float * ls  = lse + (bi * a.nq + hq) * a.s + i0 + r;
                    if (l[r] == 0.0f) {   // no visible key in this call
                        std::fill(o, o + a.d, from_f32<T>(0.0f));
                        *ls = -std::numeric_limits<float>::infinity();
                        continue;
                    }
                    float   inv = 1.0f / l[r];
                    for (int64_t dd = 0; dd < a.d; ++dd) o[dd] = from_f32<T>(acc[r * a.d + dd] * inv);
                    *ls = m[r] + std::log(l[r]);
                }
            }
        }
    });
}

template <class T>
void attention_backward(const T * qkv_q, const T * kv, const T * out, const T * dout, const float * lse, T * dq_out,
                        T * dkv, const AttentionShape & a, float scale, const AttentionDropout & dropout,
                        bool accumulate) {
    const Layout  Q{a.b, a.row_stride, a.d}, K{a.b, a.kv_stride(), a.d};
    const int64_t group = a.nq / a.nkv, s_kv = a.keys(), k_col = a.k_column(), v_col = a.v_column();
    const bool    dropped = dropout.p > 0.0f;
    const MaskRow mask    = mask_row(dropout);
    const uint8_t * key_mask = a.key_mask.defined() ? a.key_mask.data<uint8_t>() : nullptr;
    // dout and out are (s, b, nq * d): a layout with row stride nq * d.
    const Layout O{a.b, a.nq * a.d, a.d};

    parallel_for(a.b * a.nkv, 1, [&](int64_t begin, int64_t end) {
        int64_t d = a.d;
        std::vector<float> q(kBlock * d), k(kBlock * d), kt(d * kBlock), vt(d * kBlock), dob(kBlock * d),
            p(kBlock * kBlock), dp(kBlock * kBlock), dq(kBlock * d), dk(kBlock * d), dv(kBlock * d),
            delta(a.s), lse_h(a.s), z(kBlock);
        // The sums over key blocks (dQ of one query head) and over the group's query heads (dK, dV of the
        // key/value head) in f32, stored once: T rounds each result once.
        std::vector<float> dq_sum(a.s * d), dk_sum(s_kv * d), dv_sum(s_kv * d);
        for (int64_t task = begin; task < end; ++task) {
            int64_t  bi = task / a.nkv, hk = task % a.nkv;
            uint64_t base = dropped ? sample_base(dropout, bi) : 0;
            if (accumulate) {
                gather(dkv, K, bi, 0, s_kv, k_col + hk * d, dk_sum.data());
                gather(dkv, K, bi, 0, s_kv, v_col + hk * d, dv_sum.data());
            } else {
                std::fill(dk_sum.begin(), dk_sum.end(), 0.0f);
                std::fill(dv_sum.begin(), dv_sum.end(), 0.0f);
            }
            for (int64_t g = 0; g < group; ++g) {
                int64_t hq = hk * group + g;
                if (accumulate) {
                    gather(dq_out, Q, bi, 0, a.s, hq * d, dq_sum.data());
                } else {
                    std::fill(dq_sum.begin(), dq_sum.end(), 0.0f);
                }
                for (int64_t si = 0; si < a.s; ++si) {
                    const T * o  = out + O.row(si, bi) + hq * d;
                    const T * dO = dout + O.row(si, bi) + hq * d;
                    float     sum = 0;
                    for (int64_t dd = 0; dd < d; ++dd) sum += to_f32(o[dd]) * to_f32(dO[dd]);
                    delta[si] = sum;
                    lse_h[si] = lse[(bi * a.nq + hq) * a.s + si];
                }
                for (int64_t j0 = 0; j0 < s_kv; j0 += kBlock) {
                    int64_t cols = std::min(kBlock, s_kv - j0);
                    const int64_t first_key = a.k_pos(j0);
                    gather(kv, K, bi, j0, cols, k_col + hk * d, k.data());
                    gather_t(kv, K, bi, j0, cols, k_col + hk * d, kt.data());
                    gather_t(kv, K, bi, j0, cols, v_col + hk * d, vt.data());
                    std::fill(dk.begin(), dk.end(), 0.0f);
                    std::fill(dv.begin(), dv.end(), 0.0f);
                    for (int64_t i0 = 0; i0 < a.s; i0 += kBlock) {
                        int64_t rows = std::min(kBlock, a.s - i0);
                        if (a.q_pos(i0 + rows - 1) < first_key) continue;   // no query of the block sees a key
                        if (a.window >= 0 && a.q_pos(i0) - a.window > a.k_pos(j0 + cols - 1)) continue;   // past the window
                        gather(qkv_q, Q, bi, i0, rows, hq * d, q.data());
                        gather(dout, O, bi, i0, rows, hq * d, dob.data());
                        scores(q.data(), kt.data(), rows, cols, d, scale, p.data());
                        scores(dob.data(), vt.data(), rows, cols, d, 1.0f, dp.data());
                        std::fill(dq.begin(), dq.end(), 0.0f);
                        for (int64_t r = 0; r < rows; ++r) {
                            float *       pr    = p.data() + r * kBlock;
                            float *       dpr   = dp.data() + r * kBlock;
                            const int64_t qp    = a.q_pos(i0 + r);
                            const Visible vis   = visible(a.k_pos, j0, cols, qp, a.window);
                            const int64_t lo = vis.lo, limit = vis.hi;
                            const uint8_t * held = masked_row(key_mask, a, bi, i0 + r, j0);
                            auto seen = [&](int64_t c) { return c >= lo && c < limit && (held == nullptr || held[c] != 0); };
                            float   li = lse_h[i0 + r], di = delta[i0 + r];
                            if (dropped) {   // pr becomes z P (for dV), dS takes z dP
                                mask.draw(dropout_attention_row(base, dropout.head_offset + hq, qp), a.k_pos, j0, cols,
                                          z.data());
                                for (int64_t c = 0; c < cols; ++c) {
                                    float pv = seen(c) ? exp_approx(pr[c] - li) : 0.0f;
                                    pr[c]    = pv * z[c];
                                    dpr[c]   = pv * (z[c] * dpr[c] - di) * scale;
                                }
                            } else {
                                for (int64_t c = 0; c < cols; ++c) {
                                    float pv = seen(c) ? exp_approx(pr[c] - li) : 0.0f;
                                    pr[c]    = pv;
                                    dpr[c]   = pv * (dpr[c] - di) * scale;   // dS, scaled
                                }
                            }
                            const float * dor = dob.data() + r * d;
                            const float * qr  = q.data() + r * d;
                            float *       dqr = dq.data() + r * d;
                            for (int64_t c = lo; c < limit; ++c) {
                                float pv = pr[c], ds = dpr[c];
                                float *       dvc = dv.data() + c * d;
                                float *       dkc = dk.data() + c * d;
                                const float * kc  = k.data() + c * d;
                                for (int64_t dd = 0; dd < d; ++dd) {
                                    dvc[dd] += pv * dor[dd];
                                    dkc[dd] += ds * qr[dd];
                                    dqr[dd] += ds * kc[dd];
                                }
                            }
                        }
                        for (int64_t r = 0; r < rows; ++r) {
                            float * dst = dq_sum.data() + (i0 + r) * d;
                            for (int64_t dd = 0; dd < d; ++dd) dst[dd] += dq[r * d + dd];
                        }
                    }
                    for (int64_t c = 0; c < cols; ++c) {
                        float * dkr = dk_sum.data() + (j0 + c) * d;
                        float * dvr = dv_sum.data() + (j0 + c) * d;
                        for (int64_t dd = 0; dd < d; ++dd) {
                            dkr[dd] += dk[c * d + dd];
                            dvr[dd] += dv[c * d + dd];
                        }
                    }
                }
                for (int64_t si = 0; si < a.s; ++si) {
                    T * dst = dq_out + Q.row(si, bi) + hq * d;
                    for (int64_t dd = 0; dd < d; ++dd) dst[dd] = from_f32<T>(dq_sum[si * d + dd]);
                }
            }
            for (int64_t sj = 0; sj < s_kv; ++sj) {
                T * dkr = dkv + K.row(sj, bi) + k_col + hk * d;
                T * dvr = dkv + K.row(sj, bi) + v_col + hk * d;
                for (int64_t dd = 0; dd < d; ++dd) {
                    dkr[dd] = from_f32<T>(dk_sum[sj * d + dd]);
                    dvr[dd] = from_f32<T>(dv_sum[sj * d + dd]);
                }
            }
        }
    });
}

void attention_merge(float * out, float * lse, const float * part_out, const float * part_lse, int64_t s, int64_t b,
                     int64_t nq, int64_t d) {
    parallel_for(b * nq, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bi = task / nq, hq = task % nq;
            for (int64_t i = 0; i < s; ++i) {
                float &     l  = lse[task * s + i];
                const float pl = part_lse[task * s + i];
                if (pl == -std::numeric_limits<float>::infinity()) continue;   // nothing to add
                const float mx  = std::max(l, pl);
                const float sum = std::exp(l - mx) + std::exp(pl - mx);
                const float nl  = mx + std::log(sum);
                const float wa = std::exp(l - nl), wb = std::exp(pl - nl);
                float *       o = out + (i * b + bi) * nq * d + hq * d;
                const float * po = part_out + (i * b + bi) * nq * d + hq * d;
                for (int64_t dd = 0; dd < d; ++dd) o[dd] = o[dd] * wa + po[dd] * wb;
                l = nl;
            }
        }
    });
}

template <class T>
void attention_sink_forward(T * out, float * lse, const float * sink, int64_t s, int64_t b, int64_t nq, int64_t d) {
    parallel_for(b * nq, 1, [&](int64_t begin, int64_t end) {
        for (int64_t task = begin; task < end; ++task) {
            const int64_t bi = task / nq, hq = task % nq;
            const float   sl = sink[hq];
            for (int64_t i = 0; i < s; ++i) {
                float &     l  = lse[task * s + i];
                const float mx = std::max(l, sl);
                const float nl = mx + std::log(std::exp(l - mx) + std::exp(sl - mx));
                const float w  = std::exp(l - nl);
                T *         o  = out + ((i * b + bi) * nq + hq) * d;
                for (int64_t dd = 0; dd < d; ++dd) o[dd] = from_f32<T>(to_f32(o[dd]) * w);
                l = nl;
            }
        }
    });
}

template <class T>
void attention_sink_backward(const T * out, const T * dout, const float * lse, const float * sink, float * dsink, int64_t s,
                             int64_t b, int64_t nq, int64_t d) {
    parallel_for(nq, 1, [&](int64_t begin, int64_t end) {
        for (int64_t hq = begin; hq < end; ++hq) {
            float lanes[kSinkLanes];
            for (int64_t k = 0; k < kSinkLanes; ++k) {
                float sum = 0.0f;
                for (int64_t e = k; e < b * s; e += kSinkLanes) {
                    const int64_t bi = e / s, i = e % s;
                    const int64_t at = ((i * b + bi) * nq + hq) * d;
                    float         delta = 0.0f;
                    for (int64_t dd = 0; dd < d; ++dd) delta += to_f32(out[at + dd]) * to_f32(dout[at + dd]);
                    sum += std::exp(sink[hq] - lse[(bi * nq + hq) * s + i]) * delta;
                }
                lanes[k] = sum;
            }
            float total = 0.0f;
            for (int64_t k = 0; k < kSinkLanes; ++k) total += lanes[k];
            dsink[hq] -= total;
        }
    });
}

template void attention_sink_forward(float *, float *, const float *, int64_t, int64_t, int64_t, int64_t);
template void attention_sink_forward(Bf16 *, float *, const float *, int64_t, int64_t, int64_t, int64_t);
template void attention_sink_backward(const float *, const float *, const float *, const float *, float *, int64_t, int64_t,
                                      int64_t, int64_t);
template void attention_sink_backward(const Bf16 *, const Bf16 *, const float *, const float *, float *, int64_t, int64_t,
                                      int64_t, int64_t);

template void attention_forward(const float *, const float *, float *, float *, const AttentionShape &, float,
                                const AttentionDropout &);
template void attention_forward(const Bf16 *, const Bf16 *, Bf16 *, float *, const AttentionShape &, float,
                                const AttentionDropout &);
template void attention_backward(const float *, const float *, const float *, const float *, const float *, float *,
                                 float *, const AttentionShape &, float, const AttentionDropout &, bool);
template void attention_backward(const Bf16 *, const Bf16 *, const Bf16 *, const Bf16 *, const float *, Bf16 *, Bf16 *,
                                 const AttentionShape &, float, const AttentionDropout &, bool);

}  // namespace loom::cpu
