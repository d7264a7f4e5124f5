// The gated delta-net's host kernels (core/ops.h states each): the delta rule (Ops::gated_delta_rule_forward /
// _backward), its short convolution, the L2 norm of its queries and keys, its per-head gates, and the output gates
// (sigmoid and SiLU). Each loop runs in the order of the CUDA kernels (backend/cuda/kernels.cu), and the file is
// compiled without contraction (src/CMakeLists.txt), as the emulated device's kernels are, so the two give the
// same bits.
//
// The delta rule: each (sequence, head) is one task; within it a column j of the state S is one thread's (its sums
// over the key index i, in order), a row i another's (its sums over j), and the two scalar sums (dbeta, dg) are
// thread 0's over the others' partials.
#include "backend/cpu/ops.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <vector>

namespace loom::cpu {

namespace {

// One (sequence bi, head h)'s view of the operands at step t.
struct Step {
    const float * q;
    const float * k;
    const float * v;
    float         decay;   // e^g
    float         beta;
};

struct Operands {
    const float *          q, *k, *v, *g, *beta;
    const DeltaRuleShape & d;
    Step at(int64_t t, int64_t bi, int64_t h) const {
        const int64_t r = (t * d.b + bi) * d.heads + h;
        return {q + r * d.dk, k + r * d.dk, v + r * d.dv, std::exp(g[r]), beta[r]};
    }
};

// One step of the rule on S (dk x dv, row-major) in place; o (dv) the output when given, from qh = scale q.
void step(float * S, const Step & x, const float * qh, float * o, int64_t dk, int64_t dv) {
    for (int64_t j = 0; j < dv; ++j) {
        float w = 0.0f;
        for (int64_t i = 0; i < dk; ++i) {
            const float decayed = x.decay * S[i * dv + j];
            S[i * dv + j]       = decayed;
            w += decayed * x.k[i];
        }
        const float u   = x.beta * (x.v[j] - w);
        float       acc = 0.0f;
        for (int64_t i = 0; i < dk; ++i) {
            const float next = S[i * dv + j] + x.k[i] * u;
            S[i * dv + j]    = next;
            if (o) acc += next * qh[i];
        }
        if (o) o[j] = acc;
    }
}

int64_t chunks_of(const DeltaRuleShape & d) { return (d.s + kDeltaRuleChunk - 1) / kDeltaRuleChunk; }
int64_t region_of(const DeltaRuleShape & d) { return (chunks_of(d) + kDeltaRuleChunk + 1) * d.dk * d.dv; }

}  // namespace

void gated_delta_rule_forward(const float * q, const float * k, const float * v, const float * g, const float * beta,
                              float * o, float * workspace, const DeltaRuleShape & d) {
    const Operands x{q, k, v, g, beta, d};
    parallel_for(d.b * d.heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qh(static_cast<size_t>(d.dk));
        for (int64_t p = begin; p < end; ++p) {
            const int64_t bi = p / d.heads, h = p % d.heads;
            float *       S  = workspace + p * region_of(d);
            std::fill(S, S + d.dk * d.dv, 0.0f);
            for (int64_t t = 0; t < d.s; ++t) {
                const Step at = x.at(t, bi, h);
                for (int64_t i = 0; i < d.dk; ++i) qh[static_cast<size_t>(i)] = d.scale * at.q[i];
                step(S, at, qh.data(), o + ((t * d.b + bi) * d.heads + h) * d.dv, d.dk, d.dv);
            }
        }
    });
}

void gated_delta_rule_backward(const float * q, const float * k, const float * v, const float * g, const float * beta,
                               const float * dout, float * dq, float * dk, float * dv, float * dg, float * dbeta,
                               float * workspace, const DeltaRuleShape & d) {
    const Operands x{q, k, v, g, beta, d};
    const int64_t  K = d.dk, V = d.dv, KV = K * V, chunks = chunks_of(d);
    parallel_for(d.b * d.heads, 1, [&](int64_t begin, int64_t end) {
        std::vector<float> qh(static_cast<size_t>(K)), u(static_cast<size_t>(V)), r(static_cast<size_t>(V));
        std::vector<float> dw(static_cast<size_t>(V)), pb(static_cast<size_t>(V)), rp(static_cast<size_t>(K));
        for (int64_t p = begin; p < end; ++p) {
            const int64_t bi = p / d.heads, h = p % d.heads;
            float *       kept = workspace + p * region_of(d);   // each chunk's first state
            float *       prev = kept + chunks * KV;              // a chunk's states before each of its steps
            float *       dS   = prev + kDeltaRuleChunk * KV;
            // The forward again, keeping the state before every chunk (dS serves as the running state).
            std::fill(dS, dS + KV, 0.0f);
            for (int64_t t = 0; t < d.s; ++t) {
                if (t % kDeltaRuleChunk == 0) std::memcpy(kept + t / kDeltaRuleChunk * KV, dS, sizeof(float) * KV);
                step(dS, x.at(t, bi, h), nullptr, nullptr, K, V);
            }
            std::fill(dS, dS + KV, 0.0f);
            for (int64_t c = chunks - 1; c >= 0; --c) {
                const int64_t t0 = c * kDeltaRuleChunk, t1 = std::min(d.s, t0 + kDeltaRuleChunk);
                std::memcpy(prev, kept + c * KV, sizeof(float) * KV);
                for (int64_t t = t0; t + 1 < t1; ++t) {
                    float * next = prev + (t - t0 + 1) * KV;
                    std::memcpy(next, prev + (t - t0) * KV, sizeof(float) * KV);
                    step(next, x.at(t, bi, h), nullptr, nullptr, K, V);
                }
                for (int64_t t = t1 - 1; t >= t0; --t) {
                    const Step    at  = x.at(t, bi, h);
                    const float * Sp  = prev + (t - t0) * KV;   // the state before step t
                    const int64_t row = (t * d.b + bi) * d.heads + h;
                    const float * dO  = dout + row * V;
                    for (int64_t i = 0; i < K; ++i) qh[static_cast<size_t>(i)] = d.scale * at.q[i];
                    // Columns (a thread per j): u, the output's term of dS, du and what it gives.
                    for (int64_t j = 0; j < V; ++j) {
                        float w = 0.0f;
                        for (int64_t i = 0; i < K; ++i) w += (at.decay * Sp[i * V + j]) * at.k[i];
                        r[static_cast<size_t>(j)] = at.v[j] - w;
                        u[static_cast<size_t>(j)] = at.beta * r[static_cast<size_t>(j)];
                        float du = 0.0f;
                        for (int64_t i = 0; i < K; ++i) {
                            dS[i * V + j] = dS[i * V + j] + qh[static_cast<size_t>(i)] * dO[j];
                            du += dS[i * V + j] * at.k[i];
                        }
                        dw[static_cast<size_t>(j)] = -(at.beta * du);
                        dv[row * V + j]            = at.beta * du;
                        pb[static_cast<size_t>(j)] = du * r[static_cast<size_t>(j)];
                    }
                    // Rows (a thread per i): dq, dk and the row's share of dg.
                    for (int64_t i = 0; i < K; ++i) {
                        float a = 0.0f, b1 = 0.0f, b2 = 0.0f, part = 0.0f;
                        for (int64_t j = 0; j < V; ++j) {
                            const float decayed = at.decay * Sp[i * V + j];
                            a += (decayed + at.k[i] * u[static_cast<size_t>(j)]) * dO[j];
                            b1 += dS[i * V + j] * u[static_cast<size_t>(j)];
                            b2 += decayed * dw[static_cast<size_t>(j)];
                            part += decayed * (dS[i * V + j] + at.k[i] * dw[static_cast<size_t>(j)]);
                        }
                        dq[row * K + i]            = d.scale * a;
                        dk[row * K + i]            = b1 + b2;
                        rp[static_cast<size_t>(i)] = part;
                    }
                    float sb = 0.0f, sg = 0.0f;
                    for (int64_t j = 0; j < V; ++j) sb += pb[static_cast<size_t>(j)];
                    for (int64_t i = 0; i < K; ++i) sg += rp[static_cast<size_t>(i)];
                    dbeta[row] = sb;
                    dg[row]    = sg;
                    // dS of the state before step t: e^g (dS + k dw^T).
                    for (int64_t j = 0; j < V; ++j) {
                        for (int64_t i = 0; i < K; ++i) {
                            dS[i * V + j] = at.decay * (dS[i * V + j] + at.k[i] * dw[static_cast<size_t>(j)]);
                        }
                    }
                }
            }
        }
    });
}

namespace {

// pre of channel c at step t of sequence bi: the taps in order (x before step 0 is 0).
float conv_pre(const float * x, const float * w, int64_t t, int64_t bi, int64_t c, int64_t b, int64_t C, int64_t K) {
    float pre = 0.0f;
    for (int64_t j = 0; j < K; ++j) {
        const int64_t at = t - K + 1 + j;
        if (at >= 0) pre += w[c * K + j] * x[(at * b + bi) * C + c];
    }
    return pre;
}

// silu'(pre) = s (1 + pre (1 - s)), s = sigmoid(pre).
float silu_grad(float pre) {
    const float s = sigmoid_f32(pre);
    return s * (1.0f + pre * (1.0f - s));
}

// torch's softplus (beta 1, threshold 20): x above 20, else log(1 + e^x).
float softplus(float x) { return x > 20.0f ? x : std::log1p(std::exp(x)); }

float gate_act(float g, GateActivation act) { return act == GateActivation::silu ? g * sigmoid_f32(g) : sigmoid_f32(g); }

float gate_act_grad(float g, GateActivation act) {
    if (act == GateActivation::silu) return silu_grad(g);
    const float s = sigmoid_f32(g);
    return s * (1.0f - s);
}

}  // namespace

void causal_conv_silu_forward(const float * x, const float * w, float * y, int64_t s, int64_t b, int64_t C, int64_t K) {
    parallel_for(s * b, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t c = 0; c < C; ++c) {
                const float pre = conv_pre(x, w, r / b, r % b, c, b, C, K);
                y[r * C + c]    = pre / (1.0f + std::exp(-pre));
            }
        }
    });
}

void causal_conv_silu_backward(const float * x, const float * w, const float * dy, float * dx, float * dw, int64_t s,
                               int64_t b, int64_t C, int64_t K) {
    // dx (a thread per element on the device): the taps that read x[t', c], j in order.
    parallel_for(s * b, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const int64_t t = r / b, bi = r % b;
            for (int64_t c = 0; c < C; ++c) {
                float acc = 0.0f;
                for (int64_t j = 0; j < K; ++j) {
                    const int64_t out = t + K - 1 - j;   // the step whose tap j reads step t
                    if (out >= s) continue;
                    const int64_t ro   = out * b + bi;
                    const float   dpre = dy[ro * C + c] * silu_grad(conv_pre(x, w, out, bi, c, b, C, K));
                    acc += w[c * K + j] * dpre;
                }
                dx[r * C + c] = acc;
            }
        }
    });
    // dw (a thread per weight on the device): the rows in order.
    parallel_for(C * K, 1, [&](int64_t begin, int64_t end) {
        for (int64_t e = begin; e < end; ++e) {
            const int64_t c = e / K, j = e % K;
            float         acc = 0.0f;
            for (int64_t r = 0; r < s * b; ++r) {
                const int64_t t = r / b, bi = r % b, at = t - K + 1 + j;
                if (at < 0) continue;
                const float dpre = dy[r * C + c] * silu_grad(conv_pre(x, w, t, bi, c, b, C, K));
                acc += dpre * x[(at * b + bi) * C + c];
            }
            dw[e] += acc;
        }
    });
}

template <class T>
void output_gate_forward(const T * x, const T * gate, int64_t stride, T * y, int64_t n, int64_t w, GateActivation act) {
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t j = 0; j < w; ++j) {
                y[r * w + j] = from_f32<T>(to_f32(x[r * w + j]) * gate_act(to_f32(gate[r * stride + j]), act));
            }
        }
    });
}

template <class T>
void output_gate_backward(const T * x, const T * gate, int64_t stride, const T * dy, T * dx, T * dgate, int64_t n, int64_t w,
                          GateActivation act) {
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t j = 0; j < w; ++j) {
                const float g = to_f32(gate[r * stride + j]), d = to_f32(dy[r * w + j]);
                dgate[r * w + j] = from_f32<T>(d * to_f32(x[r * w + j]) * gate_act_grad(g, act));
                dx[r * w + j]    = from_f32<T>(d * gate_act(g, act));
            }
        }
    });
}

void l2norm_forward(const float * x, float * y, float * rstd, int64_t rows, int64_t d, float eps) {
    parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * xr = x + r * d;
            float         ss = 0.0f;
            for (int64_t i = 0; i < d; ++i) ss += xr[i] * xr[i];
            const float inv = 1.0f / std::sqrt(ss + eps);
            rstd[r]         = inv;
            for (int64_t i = 0; i < d; ++i) y[r * d + i] = xr[i] * inv;
        }
    });
}

void l2norm_backward(const float * dy, const float * y, const float * rstd, float * dx, int64_t rows, int64_t d) {
    parallel_for(rows, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            const float * dyr = dy + r * d;
            const float * yr  = y + r * d;
            float         dot = 0.0f;
            for (int64_t i = 0; i < d; ++i) dot += dyr[i] * yr[i];
            for (int64_t i = 0; i < d; ++i) dx[r * d + i] = rstd[r] * (dyr[i] - yr[i] * dot);
        }
    });
}

template <class T>
void gdn_gates_forward(const T * src, int64_t stride, const float * a_log, const float * dt_bias, float * g, float * beta,
                       int64_t n, int64_t H) {
    parallel_for(n, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t h = 0; h < H; ++h) {
                beta[r * H + h] = sigmoid_f32(to_f32(src[r * stride + h]));
                g[r * H + h]    = -std::exp(a_log[h]) * softplus(to_f32(src[r * stride + H + h]) + dt_bias[h]);
            }
        }
    });
}

template <class T>
void gdn_gates_backward(const T * src, int64_t stride, const float * a_log, const float * dt_bias, const float * dg,
                        const float * dbeta, T * dsrc, float * da_log, float * ddt_bias, int64_t n, int64_t H) {
    // da = dg (-e^A_log) softplus'(x), softplus'(x) = sigmoid(x) (1 above the threshold); dg g's sum into da_log.
    auto da_of = [&](int64_t r, int64_t h) {
        const float x     = to_f32(src[r * stride + H + h]) + dt_bias[h];
        const float slope = x > 20.0f ? 1.0f : sigmoid_f32(x);
        return dg[r * H + h] * -std::exp(a_log[h]) * slope;
    };
    parallel_for(n, 64, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            for (int64_t h = 0; h < H; ++h) {
                const float s         = sigmoid_f32(to_f32(src[r * stride + h]));
                dsrc[r * 2 * H + h]     = from_f32<T>(dbeta[r * H + h] * (s * (1.0f - s)));
                dsrc[r * 2 * H + H + h] = from_f32<T>(da_of(r, h));
            }
        }
    });
    // A thread per head on the device: the rows in order.
    parallel_for(H, 1, [&](int64_t begin, int64_t end) {
        for (int64_t h = begin; h < end; ++h) {
            float sum_da = 0.0f, sum_dg_g = 0.0f;
            for (int64_t r = 0; r < n; ++r) {
                const float x = to_f32(src[r * stride + H + h]) + dt_bias[h];
                sum_da += da_of(r, h);
                sum_dg_g += dg[r * H + h] * (-std::exp(a_log[h]) * softplus(x));
            }
            ddt_bias[h] += sum_da;
            da_log[h] += sum_dg_g;
        }
    });
}

#define LOOM_GATE_KERNELS(T)                                                                                            \
    template void output_gate_forward(const T *, const T *, int64_t, T *, int64_t, int64_t, GateActivation);           \
    template void output_gate_backward(const T *, const T *, int64_t, const T *, T *, T *, int64_t, int64_t,           \
                                       GateActivation);                                                                 \
    template void gdn_gates_forward(const T *, int64_t, const float *, const float *, float *, float *, int64_t,       \
                                    int64_t);                                                                           \
    template void gdn_gates_backward(const T *, int64_t, const float *, const float *, const float *, const float *,   \
                                     T *, float *, float *, int64_t, int64_t);
LOOM_GATE_KERNELS(float)
LOOM_GATE_KERNELS(Bf16)
#undef LOOM_GATE_KERNELS

}  // namespace loom::cpu
