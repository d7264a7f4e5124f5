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

void layernorm_row(const float * xr, const float * gamma, const float * beta, float * yr, float * mean, float * rstd,
                   int64_t h, float eps) {
    double sum = 0;
    for (int64_t j = 0; j < h; ++j) sum += xr[j];
    float  m   = static_cast<float>(sum / h);
    double var = 0;
    for (int64_t j = 0; j < h; ++j) {
        float c = xr[j] - m;
        var += static_cast<double>(c) * c;
    }
    float rs = 1.0f / std::sqrt(static_cast<float>(var / h) + eps);
    for (int64_t j = 0; j < h; ++j) {
        float v = (xr[j] - m) * rs * gamma[j];
        yr[j]   = beta ? v + beta[j] : v;
    }
    *mean = m;
    *rstd = rs;
}

void rmsnorm_row(const float * xr, const float * gamma, float * yr, float * rstd, int64_t h, float eps) {
    double ss = 0;
    for (int64_t j = 0; j < h; ++j) ss += static_cast<double>(xr[j]) * xr[j];
    float rs = 1.0f / std::sqrt(static_cast<float>(ss / h) + eps);
    for (int64_t j = 0; j < h; ++j) yr[j] = xr[j] * rs * gamma[j];
    *rstd = rs;
}

// Adds the residual row into x's row, then normalises it while it is in cache.
template <typename Norm>
void add_then_norm(float * x, const float * residual, int64_t n, int64_t h, Norm && norm_row) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float *       xr = x + r * h;
            const float * rr = residual + r * h;
            for (int64_t j = 0; j < h; ++j) xr[j] += rr[j];
            norm_row(r, xr);
        }
    });
}

}  // namespace

void layernorm_forward(const float * x, const float * gamma, const float * beta, float * y, float * mean,
                       float * rstd, int64_t n, int64_t h, float eps) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) layernorm_row(x + r * h, gamma, beta, y + r * h, mean + r, rstd + r, h, eps);
    });
}

void add_layernorm_forward(float * x, const float * residual, const float * gamma, const float * beta, float * y,
                           float * mean, float * rstd, int64_t n, int64_t h, float eps) {
    add_then_norm(x, residual, n, h, [&](int64_t r, const float * xr) {
        layernorm_row(xr, gamma, beta, y + r * h, mean + r, rstd + r, h, eps);
    });
}

void layernorm_backward(const float * dy, const float * x, const float * gamma, const float * mean,
                        const float * rstd, float * dx, float * dgamma, float * dbeta, int64_t n, int64_t h) {
    // dx = rstd * (g - mean(g) - xhat * mean(g * xhat)), g = dy * gamma, xhat = (x - mean) * rstd.
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * dyr = dy + r * h;
            const float * xr  = x + r * h;
            float *       dxr = dx + r * h;
            float         m = mean[r], rs = rstd[r];
            double        sum_g = 0, sum_gx = 0;
            for (int64_t j = 0; j < h; ++j) {
                float g    = dyr[j] * gamma[j];
                float xhat = (xr[j] - m) * rs;
                sum_g += g;
                sum_gx += static_cast<double>(g) * xhat;
            }
            float mg = static_cast<float>(sum_g / h), mgx = static_cast<float>(sum_gx / h);
            for (int64_t j = 0; j < h; ++j) {
                float xhat = (xr[j] - m) * rs;
                dxr[j]     = rs * (dyr[j] * gamma[j] - mg - xhat * mgx);
            }
        }
    });
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dgamma, n, c0, c1, [&](int64_t r, int64_t j) { return dy[r * h + j] * (x[r * h + j] - mean[r]) * rstd[r]; });
        if (dbeta) column_sums(dbeta, n, c0, c1, [&](int64_t r, int64_t j) { return dy[r * h + j]; });
    });
}

void rmsnorm_forward(const float * x, const float * gamma, float * y, float * rstd, int64_t n, int64_t h, float eps) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) rmsnorm_row(x + r * h, gamma, y + r * h, rstd + r, h, eps);
    });
}

void add_rmsnorm_forward(float * x, const float * residual, const float * gamma, float * y, float * rstd, int64_t n,
                         int64_t h, float eps) {
    add_then_norm(x, residual, n, h, [&](int64_t r, const float * xr) { rmsnorm_row(xr, gamma, y + r * h, rstd + r, h, eps); });
}

void rmsnorm_backward(const float * dy, const float * x, const float * gamma, const float * rstd, float * dx,
                      float * dgamma, int64_t n, int64_t h) {
    // dx = rstd * (g - xhat * mean(g * xhat)), g = dy * gamma, xhat = x * rstd.
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * dyr = dy + r * h;
            const float * xr  = x + r * h;
            float         rs  = rstd[r];
            double        sum_gx = 0;
            for (int64_t j = 0; j < h; ++j) sum_gx += static_cast<double>(dyr[j] * gamma[j]) * (xr[j] * rs);
            float mgx = static_cast<float>(sum_gx / h);
            for (int64_t j = 0; j < h; ++j) dx[r * h + j] = rs * (dyr[j] * gamma[j] - xr[j] * rs * mgx);
        }
    });
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dgamma, n, c0, c1, [&](int64_t r, int64_t j) { return dy[r * h + j] * x[r * h + j] * rstd[r]; });
    });
}

void bias_add(float * y, const float * bias, int64_t n, int64_t h) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t j = 0; j < h; ++j) y[r * h + j] += bias[j];
        }
    });
}

void bias_backward(const float * dy, float * dbias, int64_t n, int64_t h) {
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        column_sums(dbias, n, c0, c1, [&](int64_t r, int64_t j) { return dy[r * h + j]; });
    });
}

inline float gelu(float v) { return gelu_from_tanh(v, tanh_approx(gelu_tanh_arg(v))); }

void gelu_forward(const float * x, float * y, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) y[i] = gelu(x[i]);
    });
}

void bias_gelu_forward(float * x, const float * bias, float * y, uint16_t * x_bf16, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float * xr = x + r * f;
            float * yr = y + r * f;
            if (x_bf16) {
                uint16_t * br = x_bf16 + r * f;
                for (int64_t j = 0; j < f; ++j) {
                    float    v    = bias ? xr[j] + bias[j] : xr[j];
                    uint16_t bits = f32_to_bf16_bits(v);
                    br[j]         = bits;
                    yr[j]         = gelu(bf16_bits_to_f32(bits));
                }
            } else {
                for (int64_t j = 0; j < f; ++j) {
                    float v = bias ? xr[j] + bias[j] : xr[j];
                    xr[j]   = v;
                    yr[j]   = gelu(v);
                }
            }
        }
    });
}

void gelu_backward(const float * x, const float * dy, float * dx, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float v = x[i];
            dx[i]         = dy[i] * gelu_grad_from_tanh(v, tanh_approx(gelu_tanh_arg(v)));
        }
    });
}

void squared_relu_forward(const float * x, float * y, int64_t count) {
    parallel_for(count, kElemGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            const float r = x[i] > 0.0f ? x[i] : 0.0f;
            y[i]          = r * r;
        }
    });
}

void squared_relu_backward(const float * x, const float * dy, float * dx, int64_t count) {
    parallel_for(count, kElemGrain, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) dx[i] = x[i] > 0.0f ? dy[i] * (2.0f * x[i]) : 0.0f;
    });
}

void swiglu_forward(const float * x, float * y, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * gate = x + r * 2 * f;
            const float * up   = gate + f;
            for (int64_t j = 0; j < f; ++j) {
                float g      = gate[j];
                y[r * f + j] = g * sigmoid_approx(g) * up[j];
            }
        }
    });
}

void swiglu_backward(const float * x, const float * dy, float * dx, int64_t n, int64_t f) {
    parallel_for(n, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * gate  = x + r * 2 * f;
            const float * up    = gate + f;
            float *       dgate = dx + r * 2 * f;
            float *       dup   = dgate + f;
            for (int64_t j = 0; j < f; ++j) {
                float g   = gate[j];
                float sig = sigmoid_approx(g);
                float d   = dy[r * f + j];
                dup[j]    = d * g * sig;
                dgate[j]  = d * up[j] * sig * (1.0f + g * (1.0f - sig));
            }
        }
    });
}

void add_inplace(float * y, const float * x, int64_t count) {
    parallel_for(count, 4096, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) y[i] += x[i];
    });
}

namespace {

inline float load_f32(const float * p, int64_t j) { return p[j]; }
inline float load_f32(const uint16_t * p, int64_t j) { return bf16_bits_to_f32(p[j]); }

template <typename W>
void embedding_forward_impl(const int32_t * tokens, const W * wte, const W * wpe, float * out, int64_t s, int64_t b,
                            int64_t h, const SeqPositions & positions) {
    parallel_for(s * b, kRowGrain, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            int64_t   si    = r / b, bi = r % b;
            int32_t   token = tokens[bi * s + si];
            float *   o     = out + r * h;
            if (token < 0) {   // another tensor-parallel rank's part of the vocabulary
                for (int64_t j = 0; j < h; ++j) o[j] = 0.0f;
            } else {
                const W * row = wte + static_cast<int64_t>(token) * h;
                for (int64_t j = 0; j < h; ++j) o[j] = load_f32(row, j);
            }
            if (wpe) {
                for (int64_t j = 0; j < h; ++j) o[j] += load_f32(wpe + positions(si) * h, j);
            }
        }
    });
}

}  // namespace

void embedding_forward(const int32_t * tokens, const float * wte, const float * wpe, float * out, int64_t s,
                       int64_t b, int64_t h, const SeqPositions & positions) {
    embedding_forward_impl(tokens, wte, wpe, out, s, b, h, positions);
}

void embedding_forward(const int32_t * tokens, const uint16_t * wte_bf16, const uint16_t * wpe_bf16, float * out,
                       int64_t s, int64_t b, int64_t h, const SeqPositions & positions) {
    embedding_forward_impl(tokens, wte_bf16, wpe_bf16, out, s, b, h, positions);
}

void embedding_backward(const int32_t * tokens, const float * dout, float * dwte, float * dwpe, int64_t s,
                        int64_t b, int64_t h, int64_t vocab, const SeqPositions & positions) {
    // Column chunks: each thread owns a slice of h for every token row, so repeated tokens never race.
    over_column_chunks(h, [&](int64_t c0, int64_t c1) {
        for (int64_t r = 0; r < s * b; ++r) {
            int64_t       si = r / b, bi = r % b;
            int32_t       t  = tokens[bi * s + si];
            const float * d  = dout + r * h;
            if (t >= 0) {
                float * w = dwte + static_cast<int64_t>(t) * h;
                for (int64_t j = c0; j < c1; ++j) w[j] += d[j];
            }
            if (dwpe) {
                for (int64_t j = c0; j < c1; ++j) dwpe[positions(si) * h + j] += d[j];
            }
        }
    });
    (void)vocab;
}

void rope_apply(float * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, float base,
                bool inverse, int64_t rotary_dim, bool interleaved, const SeqPositions & positions) {
    const int64_t r    = rotary_dim > 0 ? rotary_dim : d;
    const int64_t half = r / 2;
    // Element j of pair i: (i, i + half), or interleaved (2i, 2i + 1).
    const int64_t first = interleaved ? 2 : 1, second = interleaved ? 1 : half;
    std::vector<float> inv_freq(half);
    for (int64_t i = 0; i < half; ++i) {
        inv_freq[i] = std::pow(base, -2.0f * static_cast<float>(i) / static_cast<float>(r));
    }
    parallel_for(s, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> cs(half), sn(half);
        for (int64_t si = begin; si < end; ++si) {
            for (int64_t i = 0; i < half; ++i) {
                float angle = static_cast<float>(positions(si)) * inv_freq[i];
                cs[i]       = std::cos(angle);
                sn[i]       = inverse ? -std::sin(angle) : std::sin(angle);
            }
            for (int64_t bi = 0; bi < b; ++bi) {
                float * row = x + (si * b + bi) * row_stride;
                for (int64_t hd = 0; hd < heads; ++hd) {
                    float * v = row + hd * d;
                    for (int64_t i = 0; i < half; ++i) {
                        float * p1 = v + i * first;
                        float * p2 = p1 + second;
                        float   x1 = *p1, x2 = *p2;
                        *p1        = x1 * cs[i] - x2 * sn[i];
                        *p2        = x2 * cs[i] + x1 * sn[i];
                    }
                }
            }
        }
    });
}

void cross_entropy_forward(const float * logits, const int32_t * labels, float * loss, float * lse, int64_t s,
                           int64_t b, int64_t stride, int64_t vocab) {
    // The one-rank case of the vocabulary-parallel pieces: row max, then the row's sum of exponentials.
    const int64_t      n = s * b;
    std::vector<float> max(static_cast<size_t>(n)), sum(static_cast<size_t>(n));
    row_max(logits, n, stride, vocab, max.data());
    row_sum_exp(logits, max.data(), n, stride, vocab, sum.data());
    for (int64_t r = 0; r < n; ++r) {
        int64_t si = r / b, bi = r % b;
        lse[r]     = max[r] + static_cast<float>(std::log(static_cast<double>(sum[r])));
        const int32_t label = labels[bi * s + si];   // -1: on another rank's shard, a target logit of 0
        loss[r]    = lse[r] - (label >= 0 ? logits[r * stride + label] : 0.0f);
    }
}

void cross_entropy_backward(float * logits, const int32_t * labels, const float * lse, const float * dloss,
                            int64_t s, int64_t b, int64_t stride, int64_t vocab) {
    parallel_for(s * b, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            float * row = logits + r * stride;
            float   l = lse[r], g = dloss[r];
            for (int64_t v = 0; v < vocab; ++v) row[v] = exp_approx(row[v] - l) * g;
            std::fill(row + vocab, row + stride, 0.0f);
            int64_t si = r / b, bi = r % b;
            if (labels[bi * s + si] >= 0) row[labels[bi * s + si]] -= g;
        }
    });
}

void row_max(const float * logits, int64_t n, int64_t stride, int64_t valid, float * out) {
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * row = logits + r * stride;
            float         mx  = -INFINITY;
            for (int64_t v = 0; v < valid; ++v) mx = std::max(mx, row[v]);
            out[r] = mx;
        }
    });
}

void row_sum_exp(const float * logits, const float * max, int64_t n, int64_t stride, int64_t valid, float * out) {
    parallel_for(n, 4, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * row = logits + r * stride;
            float         part[16] = {};
            int64_t       v        = 0;
            for (; v + 16 <= valid; v += 16) {
                for (int k = 0; k < 16; ++k) part[k] += exp_approx(row[v + k] - max[r]);
            }
            for (; v < valid; ++v) part[v % 16] += exp_approx(row[v] - max[r]);
            double sum = 0;
            for (float p : part) sum += p;
            out[r] = static_cast<float>(sum);
        }
    });
}

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
