#include "backend/cpu/ops.h"

#include "backend/cpu/vec_math.h"
#include "core/column_sums.h"
#include "core/dtype.h"
#include "core/gelu.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::cpu {

namespace {

constexpr int64_t kRowGrain  = 16;
constexpr int64_t kElemGrain = 4096;

// Runs fn(begin, end) over column chunks of h, for parameter-gradient reductions over rows: each chunk
// of columns belongs to one thread, so no two threads add into the same gradient element.
template <typename Fn>
void over_column_chunks(int64_t h, Fn && fn) {
    parallel_for(h, 64, [&](int64_t begin, int64_t end) { fn(begin, end); });
}

// acc[j] += term(r, j) over the n rows, for the columns [c0, c1), in core/column_sums.h's order: chunk
// 0 straight into acc, each later chunk into a partial sum from zero that is then added.
template <class Term>
void column_sums(float * acc, int64_t n, int64_t c0, int64_t c1, Term && term) {
    const int64_t first = std::min(n, kColumnSumRows);
    for (int64_t r = 0; r < first; ++r) {
        for (int64_t j = c0; j < c1; ++j) acc[j] += term(r, j);
    }
    if (n <= first) return;
    constexpr int64_t kWidth = 256;   // columns a partial sum covers at once
    float             part[kWidth];
    for (int64_t b0 = c0; b0 < c1; b0 += kWidth) {
        const int64_t b1 = std::min(c1, b0 + kWidth);
        for (int64_t r0 = first; r0 < n; r0 += kColumnSumRows) {
            std::fill(part, part + (b1 - b0), 0.0f);
            for (int64_t r = r0; r < std::min(n, r0 + kColumnSumRows); ++r) {
                for (int64_t j = b0; j < b1; ++j) part[j - b0] += term(r, j);
            }
            for (int64_t j = b0; j < b1; ++j) acc[j] += part[j - b0];
        }
    }
}

}  // namespace

namespace {

template <class T>
void layernorm_row(const T * xr, const float * gamma, const float * beta, T * yr, float * mean, float * rstd,
                   int64_t h, float eps) {
    double sum = 0;
    for (int64_t j = 0; j < h; ++j) sum += to_f32(xr[j]);
    float  m   = static_cast<float>(sum / h);
    double var = 0;
    for (int64_t j = 0; j < h; ++j) {
        float c = to_f32(xr[j]) - m;
        var += static_cast<double>(c) * c;
    }
    float rs = 1.0f / std::sqrt(static_cast<float>(var / h) + eps);
    for (int64_t j = 0; j < h; ++j) {
        float v = (to_f32(xr[j]) - m) * rs * gamma[j];
        yr[j]   = from_f32<T>(beta ? v + beta[j] : v);
    }
    *mean = m;
    *rstd = rs;
}

template <class T>
void rmsnorm_row(const T * xr, const float * gamma, T * yr, float * rstd, int64_t h, float eps) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) {
        const float v = to_f32(xr[j]);
        ss += static_cast<double>(v) * v;
    }
    float rs = 1.0f / std::sqrt(static_cast<float>(ss / h) + eps);
    for (int64_t j = 0; j < h; ++j) yr[j] = from_f32<T>(to_f32(xr[j]) * rs * gamma[j]);
    *rstd = rs;
}

// Adds the residual row into x's row (rounded to T), then normalises it while it is in cache.
template <class T, typename Norm>
void add_then_norm(T * x, const T * residual, int64_t n, int64_t h, Norm && norm_row) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            T *       xr = x + r * h;
            const T * rr = residual + r * h;
            for (int64_t j = 0; j < h; ++j) xr[j] = from_f32<T>(to_f32(xr[j]) + to_f32(rr[j]));
            norm_row(r, xr);
        }
    });
}

}  // namespace

template <class T>
void layernorm_forward(const T * x, const float * gamma, const float * beta, T * y, float * mean, float * rstd,
                       int64_t n, int64_t h, float eps) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) layernorm_row(x + r * h, gamma, beta, y + r * h, mean + r, rstd + r, h, eps);
    });
}

template <class T>
void add_layernorm_forward(T * x, const T * residual, const float * gamma, const float * beta, T * y, float * mean,
                           float * rstd, int64_t n, int64_t h, float eps) {
    add_then_norm(x, residual, n, h, [&](int64_t r, const T * xr) {
        layernorm_row(xr, gamma, beta, y + r * h, mean + r, rstd + r, h, eps);
    });
}

template <class T>
void layernorm_backward(const T * dy, const T * x, const float * gamma, const float * mean, const float * rstd, T * dx,
                        float * dgamma, float * dbeta, int64_t n, int64_t h, const T * dres) {
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat = (x - mean) * rstd.
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * dyr = dy + r * h;
            const T * xr  = x + r * h;
            T *       dxr = dx + r * h;
            float     m = mean[r], rs = rstd[r];
            double    sum_g = 0, sum_gx = 0;
            for (int64_t j = 0; j < h; ++j) {
                float g    = to_f32(dyr[j]) * gamma[j];
                float xhat = (to_f32(xr[j]) - m) * rs;
                sum_g += g;
                sum_gx += static_cast<double>(g) * xhat;
            }
            float mg = static_cast<float>(sum_g / h), mgx = static_cast<float>(sum_gx / h);
            for (int64_t j = 0; j < h; ++j) {
                float xhat = (to_f32(xr[j]) - m) * rs;
                float v    = rs * (to_f32(dyr[j]) * gamma[j] - mg - xhat * mgx);
                dxr[j]     = from_f32<T>(dres ? v + to_f32(dres[r * h + j]) : v);
            }
        }
    });
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dgamma, n, c0, c1, [&](int64_t r, int64_t j) {
            return to_f32(dy[r * h + j]) * (to_f32(x[r * h + j]) - mean[r]) * rstd[r];
        });
        if (dbeta) column_sums(dbeta, n, c0, c1, [&](int64_t r, int64_t j) { return to_f32(dy[r * h + j]); });
    });
}

template <class T>
void rmsnorm_forward(const T * x, const float * gamma, T * y, float * rstd, int64_t n, int64_t h, float eps) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) rmsnorm_row(x + r * h, gamma, y + r * h, rstd + r, h, eps);
    });
}

template <class T>
void add_rmsnorm_forward(T * x, const T * residual, const float * gamma, T * y, float * rstd, int64_t n, int64_t h,
                         float eps) {
    add_then_norm(x, residual, n, h, [&](int64_t r, const T * xr) { rmsnorm_row(xr, gamma, y + r * h, rstd + r, h, eps); });
}

template <class T>
void rmsnorm_backward(const T * dy, const T * x, const float * gamma, const float * rstd, T * dx, float * dgamma,
                      int64_t n, int64_t h, const T * dres) {
    // dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd.
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * dyr = dy + r * h;
            const T * xr  = x + r * h;
            float     rs  = rstd[r];
            double    sum_gx = 0;
            for (int64_t j = 0; j < h; ++j) sum_gx += static_cast<double>(to_f32(dyr[j]) * gamma[j]) * (to_f32(xr[j]) * rs);
            float mgx = static_cast<float>(sum_gx / h);
            for (int64_t j = 0; j < h; ++j) {
                const float v = rs * (to_f32(dyr[j]) * gamma[j] - to_f32(xr[j]) * rs * mgx);
                dx[r * h + j] = from_f32<T>(dres ? v + to_f32(dres[r * h + j]) : v);
            }
        }
    });
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dgamma, n, c0, c1,
                    [&](int64_t r, int64_t j) { return to_f32(dy[r * h + j]) * to_f32(x[r * h + j]) * rstd[r]; });
    });
}

template <class T>
void bias_add(T * y, const float * bias, int64_t n, int64_t h) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t j = 0; j < h; ++j) y[r * h + j] = from_f32<T>(to_f32(y[r * h + j]) + bias[j]);
        }
    });
}

template <class T>
void bias_backward(const T * dy, float * dbias, int64_t n, int64_t h) {
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dbias, n, c0, c1, [&](int64_t r, int64_t j) { return to_f32(dy[r * h + j]); });
    });
}

inline float gelu(float v) { return gelu_from_tanh(v, tanh_approx(gelu_tanh_arg(v))); }

void gelu_forward(const float * x, float * y, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) y[i] = gelu(x[i]);
    });
}

template <class T>
void bias_gelu_forward(T * x, const float * bias, T * y, uint16_t * x_bf16, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            T * xr = x + r * f;
            T * yr = y + r * f;
            if (x_bf16) {
                uint16_t * br = x_bf16 + r * f;
                for (int64_t j = 0; j < f; ++j) {
                    float    v    = bias ? to_f32(xr[j]) + bias[j] : to_f32(xr[j]);
                    uint16_t bits = f32_to_bf16_bits(v);
                    br[j]         = bits;
                    yr[j]         = from_f32<T>(gelu(bf16_bits_to_f32(bits)));
                }
            } else {
                for (int64_t j = 0; j < f; ++j) {
                    // The biased value is stored first: gelu reads what backward will read.
                    const T v = from_f32<T>(bias ? to_f32(xr[j]) + bias[j] : to_f32(xr[j]));
                    xr[j]     = v;
                    yr[j]     = from_f32<T>(gelu(to_f32(v)));
                }
            }
        }
    });
}

template <class T>
void gelu_backward(const T * x, const T * dy, T * dx, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float v = to_f32(x[i]);
            dx[i]         = from_f32<T>(to_f32(dy[i]) * gelu_grad_from_tanh(v, tanh_approx(gelu_tanh_arg(v))));
        }
    });
}

template <class T>
void squared_relu_forward(const T * x, T * y, int64_t count) {
    parallel_for(count, kElemGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float v = to_f32(x[i]);
            const float r = v > 0.0f ? v : 0.0f;
            y[i]          = from_f32<T>(r * r);
        }
    });
}

template <class T>
void squared_relu_backward(const T * x, const T * dy, T * dx, int64_t count) {
    parallel_for(count, kElemGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float v = to_f32(x[i]);
            dx[i]         = from_f32<T>(v > 0.0f ? to_f32(dy[i]) * (2.0f * v) : 0.0f);
        }
    });
}

template <class T>
void swiglu_forward(const T * x, T * y, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * gate = x + r * 2 * f;
            const T * up   = gate + f;
            for (int64_t j = 0; j < f; ++j) {
                float g      = to_f32(gate[j]);
                y[r * f + j] = from_f32<T>(g * sigmoid_approx(g) * to_f32(up[j]));
            }
        }
    });
}

// The gate's activation: s = sigmoid(k a) with k = 1 (silu) or 1.702 (quick_gelu), each product rounded to
// f32 on its own (the CUDA kernels' order). Forward: act = a s, y = act (b + offset). Backward: d act / d a =
// s (1 + k a (1 - s)).
namespace {

inline float glu_gate_scale(const GluSpec & glu) { return glu.gate == GluSpec::Gate::quick_gelu ? 1.702f : 1.0f; }

}  // namespace

template <class T>
void glu_forward(const T * x, T * y, int64_t n, int64_t f, const GluSpec & glu) {
    const float k = glu_gate_scale(glu), c = glu.clamp, offset = glu.linear_offset;
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * gate = x + r * 2 * f;
            const T * lin  = gate + f;
            for (int64_t j = 0; j < f; ++j) {
                float a = to_f32(gate[j]), b = to_f32(lin[j]);
                if (c > 0.0f) {
                    a = std::min(a, c);
                    b = std::min(std::max(b, -c), c);
                }
                const float act = a * sigmoid_approx(k * a);
                y[r * f + j]    = from_f32<T>(act * (b + offset));
            }
        }
    });
}

template <class T>
void glu_backward(const T * x, const T * dy, T * dx, int64_t n, int64_t f, const GluSpec & glu) {
    const float k = glu_gate_scale(glu), c = glu.clamp, offset = glu.linear_offset;
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * gate  = x + r * 2 * f;
            const T * lin   = gate + f;
            T *       dgate = dx + r * 2 * f;
            T *       dlin  = dgate + f;
            for (int64_t j = 0; j < f; ++j) {
                const float a0 = to_f32(gate[j]), b0 = to_f32(lin[j]);
                const bool  clamped = c > 0.0f;
                const bool  pass_a = !clamped || a0 <= c, pass_b = !clamped || (b0 >= -c && b0 <= c);
                const float a = clamped ? std::min(a0, c) : a0, b = clamped ? std::min(std::max(b0, -c), c) : b0;
                const float s = sigmoid_approx(k * a);
                const float d = to_f32(dy[r * f + j]);
                dlin[j]       = from_f32<T>(pass_b ? d * (a * s) : 0.0f);
                dgate[j]      = from_f32<T>(pass_a ? d * (b + offset) * (s * (1.0f + k * a * (1.0f - s))) : 0.0f);
            }
        }
    });
}

template <class T>
void swiglu_backward(const T * x, const T * dy, T * dx, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * gate  = x + r * 2 * f;
            const T * up    = gate + f;
            T *       dgate = dx + r * 2 * f;
            T *       dup   = dgate + f;
            for (int64_t j = 0; j < f; ++j) {
                float g   = to_f32(gate[j]);
                float sig = sigmoid_approx(g);
                float d   = to_f32(dy[r * f + j]);
                dup[j]    = from_f32<T>(d * g * sig);
                dgate[j]  = from_f32<T>(d * to_f32(up[j]) * sig * (1.0f + g * (1.0f - sig)));
            }
        }
    });
}

template <class T>
void add_inplace(T * y, const T * x, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) y[i] = from_f32<T>(to_f32(y[i]) + to_f32(x[i]));
    });
}

namespace {

inline float load_f32(const float * p, int64_t j) { return p[j]; }
inline float load_f32(const uint16_t * p, int64_t j) { return bf16_bits_to_f32(p[j]); }

template <typename W, class T>
void embedding_forward_impl(const int32_t * tokens, const W * wte, const W * wpe, T * out, int64_t s, int64_t b,
                            int64_t h, const SeqPositions & positions) {
    parallel_for(s * b, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            int64_t si    = r / b, bi = r % b;
            int32_t token = tokens[bi * s + si];
            T *     o     = out + r * h;
            // Summed in f32, stored once.
            const W * row = token >= 0 ? wte + static_cast<int64_t>(token) * h : nullptr;   // < 0: another TP rank's
            for (int64_t j = 0; j < h; ++j) {
                float v = row ? load_f32(row, j) : 0.0f;
                if (wpe) v += load_f32(wpe + positions(si) * h, j);
                o[j] = from_f32<T>(v);
            }
        }
    });
}

}  // namespace

template <class T>
void embedding_forward(const int32_t * tokens, const float * wte, const float * wpe, T * out, int64_t s, int64_t b,
                       int64_t h, const SeqPositions & positions) {
    embedding_forward_impl(tokens, wte, wpe, out, s, b, h, positions);
}

template <class T>
void embedding_forward(const int32_t * tokens, const uint16_t * wte_bf16, const uint16_t * wpe_bf16, T * out,
                       int64_t s, int64_t b, int64_t h, const SeqPositions & positions) {
    embedding_forward_impl(tokens, wte_bf16, wpe_bf16, out, s, b, h, positions);
}

template <class T>
void embedding_backward(const int32_t * tokens, const T * dout, float * dwte, float * dwpe, int64_t s, int64_t b,
                        int64_t h, int64_t vocab, const SeqPositions & positions) {
    // Column chunks: each thread owns a slice of h for every token row, so repeated tokens never race.
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        for (int64_t r = 0; r < s * b; ++r) {
            int64_t   si = r / b, bi = r % b;
            int32_t   t  = tokens[bi * s + si];
            const T * d  = dout + r * h;
            if (t >= 0) {
                float * w = dwte + static_cast<int64_t>(t) * h;
                for (int64_t j = c0; j < c1; ++j) w[j] += to_f32(d[j]);
            }
            if (dwpe) {
                for (int64_t j = c0; j < c1; ++j) dwpe[positions(si) * h + j] += to_f32(d[j]);
            }
        }
    });
    (void)vocab;
}

template <class T>
void rope_apply(T * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, float base, bool inverse,
                int64_t rotary_dim, bool interleaved, const SeqPositions & positions, const RopeScaling & scaling) {
    const int64_t r    = rotary_dim > 0 ? rotary_dim : d;
    const int64_t half = r / 2;
    // Element j of pair i: (i, i + half), or interleaved (2i, 2i + 1).
    const int64_t first = interleaved ? 2 : 1, second = interleaved ? 1 : half;
    const std::vector<float> inv_freq = rope_inv_freq(base, r, scaling);
    const float              amp      = scaling.amplitude;
    parallel_for(s, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> cs(half), sn(half);
        for (int64_t si = begin; si < end; ++si) {
            for (int64_t i = 0; i < half; ++i) {
                float angle = static_cast<float>(positions(si)) * inv_freq[i];
                cs[i]       = std::cos(angle) * amp;
                sn[i]       = (inverse ? -std::sin(angle) : std::sin(angle)) * amp;
            }
            for (int64_t bi = 0; bi < b; ++bi) {
                T * row = x + (si * b + bi) * row_stride;
                for (int64_t hd = 0; hd < heads; ++hd) {
                    T * v = row + hd * d;
                    for (int64_t i = 0; i < half; ++i) {
                        T *   p1 = v + i * first;
                        T *   p2 = p1 + second;
                        float x1 = to_f32(*p1), x2 = to_f32(*p2);
                        *p1      = from_f32<T>(x1 * cs[i] - x2 * sn[i]);
                        *p2      = from_f32<T>(x2 * cs[i] + x1 * sn[i]);
                    }
                }
            }
        }
    });
}

template <class T>
void cross_entropy_forward(const T * logits, const int32_t * labels, float * loss, float * lse, int64_t s, int64_t b,
                           int64_t stride, int64_t vocab) {
    // The one-rank case of the vocabulary-parallel pieces: row max, then the row's sum of exponentials.
    const int64_t      n = s * b;
    std::vector<float> max(static_cast<size_t>(n)), sum(static_cast<size_t>(n));
    row_max(logits, n, stride, vocab, max.data());
    row_sum_exp(logits, max.data(), n, stride, vocab, sum.data());
    for (int64_t r = 0; r < n; ++r) {
        int64_t si = r / b, bi = r % b;
        lse[r]     = max[r] + static_cast<float>(std::log(static_cast<double>(sum[r])));
        const int32_t label = labels[bi * s + si];   // -1: on another rank's shard, a target logit of 0
        loss[r]    = lse[r] - (label >= 0 ? to_f32(logits[r * stride + label]) : 0.0f);
    }
}

template <class T>
void cross_entropy_backward(T * logits, const int32_t * labels, const float * lse, const float * dloss, int64_t s,
                            int64_t b, int64_t stride, int64_t vocab) {
    parallel_for(s * b, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            T *     row = logits + r * stride;
            float   l = lse[r], g = dloss[r];
            int64_t si = r / b, bi = r % b;
            const int32_t label = labels[bi * s + si];
            // The one-hot term is taken from the f32 value, before the store rounds it.
            for (int64_t v = 0; v < vocab; ++v) {
                const float p = exp_approx(to_f32(row[v]) - l) * g;
                row[v]        = from_f32<T>(v == label ? p - g : p);
            }
            std::fill(row + vocab, row + stride, from_f32<T>(0.0f));
        }
    });
}

template <class T>
void row_max(const T * logits, int64_t n, int64_t stride, int64_t valid, float * out) {
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * row = logits + r * stride;
            float     mx  = -INFINITY;
            for (int64_t v = 0; v < valid; ++v) mx = std::max(mx, to_f32(row[v]));
            out[r] = mx;
        }
    });
}

template <class T>
void row_sum_exp(const T * logits, const float * max, int64_t n, int64_t stride, int64_t valid, float * out) {
    parallel_for(n, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const T * row      = logits + r * stride;
            float     part[16] = {};
            int64_t   v        = 0;
            for (; v + 16 <= valid; v += 16) {
                for (int k = 0; k < 16; ++k) part[k] += exp_approx(to_f32(row[v + k]) - max[r]);
            }
            for (; v < valid; ++v) part[v % 16] += exp_approx(to_f32(row[v]) - max[r]);
            double sum = 0;
            for (float p : part) sum += p;
            out[r] = static_cast<float>(sum);
        }
    });
}

// Every kernel above for both storage types.
#define LOOM_ACTIVATION_KERNELS(T)                                                                                    \
    template void layernorm_forward(const T *, const float *, const float *, T *, float *, float *, int64_t, int64_t, \
                                    float);                                                                           \
    template void add_layernorm_forward(T *, const T *, const float *, const float *, T *, float *, float *, int64_t,  \
                                        int64_t, float);                                                              \
    template void layernorm_backward(const T *, const T *, const float *, const float *, const float *, T *, float *, \
                                     float *, int64_t, int64_t, const T *);                                           \
    template void rmsnorm_forward(const T *, const float *, T *, float *, int64_t, int64_t, float);                  \
    template void add_rmsnorm_forward(T *, const T *, const float *, T *, float *, int64_t, int64_t, float);         \
    template void rmsnorm_backward(const T *, const T *, const float *, const float *, T *, float *, int64_t, int64_t,  \
                                   const T *);                                                                       \
    template void bias_add(T *, const float *, int64_t, int64_t);                                                     \
    template void bias_backward(const T *, float *, int64_t, int64_t);                                                \
    template void bias_gelu_forward(T *, const float *, T *, uint16_t *, int64_t, int64_t);                           \
    template void gelu_backward(const T *, const T *, T *, int64_t);                                                  \
    template void squared_relu_forward(const T *, T *, int64_t);                                                      \
    template void squared_relu_backward(const T *, const T *, T *, int64_t);                                          \
    template void swiglu_forward(const T *, T *, int64_t, int64_t);                                                   \
    template void swiglu_backward(const T *, const T *, T *, int64_t, int64_t);                                       \
    template void glu_forward(const T *, T *, int64_t, int64_t, const GluSpec &);                                     \
    template void glu_backward(const T *, const T *, T *, int64_t, int64_t, const GluSpec &);                         \
    template void add_inplace(T *, const T *, int64_t);                                                               \
    template void embedding_forward(const int32_t *, const float *, const float *, T *, int64_t, int64_t, int64_t,    \
                                    const SeqPositions &);                                                            \
    template void embedding_forward(const int32_t *, const uint16_t *, const uint16_t *, T *, int64_t, int64_t,       \
                                    int64_t, const SeqPositions &);                                                   \
    template void embedding_backward(const int32_t *, const T *, float *, float *, int64_t, int64_t, int64_t, int64_t, \
                                     const SeqPositions &);                                                           \
    template void rope_apply(T *, int64_t, int64_t, int64_t, int64_t, int64_t, float, bool, int64_t, bool,            \
                             const SeqPositions &, const RopeScaling &);                                              \
    template void cross_entropy_forward(const T *, const int32_t *, float *, float *, int64_t, int64_t, int64_t,      \
                                        int64_t);                                                                     \
    template void cross_entropy_backward(T *, const int32_t *, const float *, const float *, int64_t, int64_t,        \
                                         int64_t, int64_t);                                                           \
    template void row_max(const T *, int64_t, int64_t, int64_t, float *);                                            \
    template void row_sum_exp(const T *, const float *, int64_t, int64_t, int64_t, float *);

LOOM_ACTIVATION_KERNELS(float)
LOOM_ACTIVATION_KERNELS(Bf16)
#undef LOOM_ACTIVATION_KERNELS


void convert_parallel(const void * src, DType src_dtype, void * dst, DType dst_dtype, int64_t n) {
    size_t in = dtype_size(src_dtype), out = dtype_size(dst_dtype);
    parallel_for(n, 1 << 15, [&](int64_t begin, int64_t end) {
        convert(static_cast<const char *>(src) + begin * in, src_dtype, static_cast<char *>(dst) + begin * out,
                dst_dtype, static_cast<size_t>(end - begin));
    });
}

void scale_parallel(void * x, DType dtype, float factor, int64_t n) {
    parallel_for(n, 1 << 15, [&](int64_t begin, int64_t end) {
        if (dtype == DType::f32) {
            float * v = static_cast<float *>(x);
            for (int64_t i = begin; i < end; ++i) v[i] *= factor;
            return;
        }
        // 16-bit: widened a block at a time, multiplied in f32, rounded back.
        uint16_t *         bits = static_cast<uint16_t *>(x);
        constexpr int64_t  kBlock = 1024;
        float              wide[kBlock];
        for (int64_t at = begin; at < end; at += kBlock) {
            const size_t count = static_cast<size_t>(std::min(kBlock, end - at));
            convert(bits + at, dtype, wide, DType::f32, count);
            for (size_t i = 0; i < count; ++i) wide[i] *= factor;
            convert(wide, DType::f32, bits + at, dtype, count);
        }
    });
}

double sum_of_squares(const float * x, int64_t n) {
    constexpr int64_t   kChunk = 1 << 16;
    const int64_t       chunks = (n + kChunk - 1) / kChunk;
    std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
    parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
        for (int64_t c = begin; c < end; ++c) {
            double s = 0;
            for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) s += static_cast<double>(x[i]) * x[i];
            partial[static_cast<size_t>(c)] = s;
        }
    });
    double total = 0;
    for (double s : partial) total += s;
    return total;
}

void round_to_bf16(float * x, uint16_t * x_bf16, int64_t n) {
    parallel_for(n, 1 << 15, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            uint16_t bits = f32_to_bf16_bits(x[i]);
            x_bf16[i]     = bits;
            x[i]          = bf16_bits_to_f32(bits);
        }
    });
}

}  // namespace loom::cpu
