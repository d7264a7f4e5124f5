#include "backend/cpu/moe.h"

#include "core/error.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <limits>
#include <vector>

namespace loom::cpu {

namespace {

// The k largest of v[0, E) in descending order, ties toward the lower index.
void topk_desc(const double * v, int64_t E, int64_t k, int32_t * idx) {
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[j] = static_cast<int32_t>(best);
    }
}

// s = softmax(l) over E; returns logsumexp(l).
template <typename L>
double softmax(const L * l, int64_t E, double * s) {
    double m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(l[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) s[e] /= sum;
    return m + std::log(sum);
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// The aux loss's scores p over all E (softmax, or sigmoid normalised over E).
template <typename L>
void aux_scores(const L * l, int64_t E, bool use_sigmoid, double * p) {
    if (!use_sigmoid) {
        softmax(l, E, p);
        return;
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = sigmoid(l[e]));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum + 1e-20;
}

// The routing probabilities of one token's selected experts (before the scaling factor): q (k).
template <typename L>
void topk_probs(const L * l, const int32_t * idx, const MoeRouting & r, double * q, double * scratch) {
    const int64_t E = r.experts, k = r.topk;
    if (!r.sigmoid) {
        if (r.pre_softmax) {
            softmax(l, E, scratch);
            for (int64_t j = 0; j < k; ++j) q[j] = scratch[idx[j]];
        } else {
            double m = l[idx[0]], sum = 0;   // idx[0] holds the largest logit
            for (int64_t j = 0; j < k; ++j) sum += (q[j] = std::exp(l[idx[j]] - m));
            for (int64_t j = 0; j < k; ++j) q[j] /= sum;
        }
    } else {
        double sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid(l[idx[j]]));
        if (k > 1) {
            for (int64_t j = 0; j < k; ++j) q[j] /= sum + 1e-20;
        }
    }
}

double scaling(const MoeRouting & r) { return r.scaling > 0.0f ? r.scaling : 1.0; }

// Group-limited routing: every expert outside the g groups whose k / g largest scores sum highest drops out
// (its score becomes -inf). Each group's sum adds its largest scores in descending order.
void limit_to_groups(double * score, const MoeRouting & r) {
    const int64_t G = r.num_groups, per = r.experts / G, m = r.topk / r.group_topk;
    double        group_score[kMoeMaxGroups];
    int32_t       best[kMoeMaxGroups];
    std::vector<int32_t> idx(static_cast<size_t>(std::max<int64_t>(m, 1)));
    for (int64_t g = 0; g < G; ++g) {
        topk_desc(score + g * per, per, std::min(m, per), idx.data());
        double sum = 0;
        for (int64_t j = 0; j < std::min(m, per); ++j) sum += score[g * per + idx[j]];
        group_score[g] = sum;
    }
    topk_desc(group_score, G, r.group_topk, best);
    for (int64_t g = 0; g < G; ++g) {
        bool kept = false;
        for (int64_t j = 0; j < r.group_topk; ++j) kept |= best[j] == g;
        if (kept) continue;
        for (int64_t e = g * per; e < (g + 1) * per; ++e) score[e] = -std::numeric_limits<double>::infinity();
    }
}

}  // namespace

template <typename L>
void moe_topk(const L * logits, int64_t n, const MoeRouting & r, const float * bias, int32_t * top_idx, float * probs) {
    const int64_t E = r.experts, k = r.topk;
    const double  sf = scaling(r);
    parallel_for(n, 64, [&](int64_t begin, int64_t end) {
        std::vector<double> score(E), q(k), scratch(E);
        for (int64_t x = begin; x < end; ++x) {
            const L * lx = logits + x * E;
            // Selection scores: logits (post-softmax; softmax is monotonic), softmax, or sigmoid (+ the bias).
            for (int64_t e = 0; e < E; ++e) score[e] = lx[e];
            if (!r.sigmoid && r.pre_softmax) softmax(lx, E, score.data());
            if (r.sigmoid) {
                for (int64_t e = 0; e < E; ++e) score[e] = sigmoid(lx[e]) + (bias ? static_cast<double>(bias[e]) : 0.0);
            }
            if (r.group_topk > 0) limit_to_groups(score.data(), r);
            topk_desc(score.data(), E, k, top_idx + x * k);
            topk_probs(lx, top_idx + x * k, r, q.data(), scratch.data());
            for (int64_t j = 0; j < k; ++j) probs[x * k + j] = static_cast<float>(sf * q[j]);
        }
    });
}

template <typename L>
void moe_sinkhorn_topk(const L * logits, int64_t N, int64_t first, int64_t n, const MoeRouting & r,
                       int32_t * top_idx, float * probs) {
    const int64_t E = r.experts, k = r.topk;
    // C = exp(logits) and the two scalings, in double; each sum in index order.
    std::vector<double> C(static_cast<size_t>(N * E)), d0(static_cast<size_t>(N), 1.0), d1(static_cast<size_t>(E), 1.0);
    for (int64_t i = 0; i < N * E; ++i) C[i] = std::exp(static_cast<double>(logits[i]));
    const double eps = 1e-8, tol = 1e-4;
    for (double error = 1e9; error > tol;) {
        for (int64_t x = 0; x < N; ++x) {
            double sum = 0;
            for (int64_t e = 0; e < E; ++e) sum += d1[e] * C[x * E + e];
            d0[x] = 1.0 / static_cast<double>(N) / (sum + eps);
        }
        error = 0;
        for (int64_t e = 0; e < E; ++e) {
            double sum = 0;
            for (int64_t x = 0; x < N; ++x) sum += d0[x] * C[x * E + e];
            const double next = 1.0 / static_cast<double>(E) / (sum + eps);
            error += std::abs(d1[e] - next);
            d1[e] = next;
        }
        error /= static_cast<double>(E);
    }
    std::vector<double> score(E), q(k), scratch(E);
    for (int64_t x = 0; x < n; ++x) {
        const int64_t row = first + x;
        for (int64_t e = 0; e < E; ++e) score[e] = d0[row] * C[row * E + e] * d1[e];
        topk_desc(score.data(), E, k, top_idx + x * k);
        topk_probs(logits + row * E, top_idx + x * k, r, q.data(), scratch.data());
        for (int64_t j = 0; j < k; ++j) probs[x * k + j] = static_cast<float>(scaling(r) * q[j]);
    }
}

template <typename L>
void moe_aux_counts(const L * logits, int64_t n, const MoeRouting & r, int64_t groups, float * counts) {
    const int64_t E = r.experts, k = r.topk;
    std::fill(counts, counts + groups * E, 0);
    std::vector<double>  p(E);
    std::vector<int32_t> idx(k);
    for (int64_t x = 0; x < n; ++x) {
        aux_scores(logits + x * E, E, r.sigmoid, p.data());
        topk_desc(p.data(), E, k, idx.data());
        for (int64_t j = 0; j < k; ++j) counts[(x % groups) * E + idx[j]] += 1.0f;
    }
}

template <typename L>
void moe_router_losses(const L * logits, int64_t n, const float * counts, const MoeRouting & r,
                       const MoeRouterLoss & loss, float * losses) {
    const int64_t E = r.experts, k = r.topk, G = loss.groups;
    const bool    aux = loss.aux_coeff > 0.0f, z = loss.z_coeff > 0.0f;
    // Each group's score sums P over this rank's tokens and the sum of lse^2, in token order.
    std::vector<double> P(G * E, 0.0), p(E);
    double              lse_sq = 0;
    for (int64_t x = 0; x < n && (aux || z); ++x) {
        const L * lx = logits + x * E;
        if (aux) {
            aux_scores(lx, E, r.sigmoid, p.data());
            for (int64_t e = 0; e < E; ++e) P[(x % G) * E + e] += p[e];
        }
        if (z) {
            const double lse = softmax(lx, E, p.data());
            lse_sq += lse * lse;
        }
    }
    // This rank's share: summed over a sequence-parallel group, the shares give the single-rank losses
    // (the counts are the group's, the score sums and lse^2 this rank's).
    double aux_loss = 0;
    if (aux) {
        const double T = static_cast<double>(loss.tokens / G);
        for (int64_t i = 0; i < G * E; ++i) aux_loss += P[i] * counts[i];
        aux_loss *= static_cast<double>(E) * loss.aux_coeff / (static_cast<double>(k) * T * T) / G;
    }
    const double z_loss = z ? loss.z_coeff * lse_sq / static_cast<double>(loss.tokens) : 0.0;
    losses[0] = static_cast<float>(aux_loss);
    losses[1] = aux ? static_cast<float>(aux_loss / loss.aux_coeff) : 0.0f;
    losses[2] = static_cast<float>(z_loss);
    losses[3] = z ? static_cast<float>(z_loss / loss.z_coeff) : 0.0f;
}

template <typename L>
void moe_router_backward(const L * logits, int64_t n, const int32_t * top_idx, const float * dprobs,
                         const float * counts, const MoeRouting & r, const MoeRouterLoss & loss, float loss_scale,
                         L * dlogits) {
    const int64_t E = r.experts, k = r.topk, G = loss.groups;
    const bool    aux = loss.aux_coeff > 0.0f, z = loss.z_coeff > 0.0f;
    const double  sf  = scaling(r);
    // d aux / d p_xi = c_gi * E coeff / (k T^2 G), times the caller's scale.
    const double T        = static_cast<double>(loss.tokens / G);
    const double aux_unit = aux ? loss_scale * static_cast<double>(E) * loss.aux_coeff / (k * T * T) / G : 0.0;
    const double z_unit   = z ? loss_scale * loss.z_coeff * 2.0 / static_cast<double>(loss.tokens) : 0.0;
    parallel_for(n, 64, [&](int64_t begin, int64_t end) {
        std::vector<double> d(E), s(E), ds(E), q(k), dq(k);
        for (int64_t x = begin; x < end; ++x) {
            const L *       lx  = logits + x * E;
            const int32_t * idx = top_idx + x * k;
            std::fill(d.begin(), d.end(), 0.0);
            for (int64_t j = 0; j < k; ++j) dq[j] = sf * dprobs[x * k + j];
            if (!r.sigmoid) {
                if (r.pre_softmax) {   // probs_j = sf s_idx_j with s the softmax over all E
                    softmax(lx, E, s.data());
                    std::fill(ds.begin(), ds.end(), 0.0);
                    double dot = 0;
                    for (int64_t j = 0; j < k; ++j) {
                        ds[idx[j]] = dq[j];
                        dot += s[idx[j]] * dq[j];
                    }
                    for (int64_t e = 0; e < E; ++e) d[e] += s[e] * (ds[e] - dot);
                } else {   // probs = sf softmax over the k selected logits
                    topk_probs(lx, idx, r, q.data(), s.data());
                    double dot = 0;
                    for (int64_t j = 0; j < k; ++j) dot += q[j] * dq[j];
                    for (int64_t j = 0; j < k; ++j) d[idx[j]] += q[j] * (dq[j] - dot);
                }
            } else {   // sigmoid, normalised over the k when k > 1
                double sum = 0, dot = 0;
                for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid(lx[idx[j]]));
                const double S = sum + 1e-20;
                if (k > 1) {
                    for (int64_t j = 0; j < k; ++j) dot += q[j] / S * dq[j];
                }
                for (int64_t j = 0; j < k; ++j) {
                    const double dg = k > 1 ? (dq[j] - dot) / S : dq[j];
                    d[idx[j]] += dg * q[j] * (1.0 - q[j]);
                }
            }
            if (aux) {
                const float * cg = counts + (x % G) * E;
                if (!r.sigmoid) {
                    softmax(lx, E, s.data());
                    double dot = 0;
                    for (int64_t e = 0; e < E; ++e) dot += s[e] * cg[e] * aux_unit;
                    for (int64_t e = 0; e < E; ++e) d[e] += s[e] * (cg[e] * aux_unit - dot);
                } else {   // p = g / (sum_E g + 1e-20)
                    double sum = 0, dot = 0;
                    for (int64_t e = 0; e < E; ++e) sum += (s[e] = sigmoid(lx[e]));
                    const double S = sum + 1e-20;
                    for (int64_t e = 0; e < E; ++e) dot += s[e] / S * cg[e] * aux_unit;
                    for (int64_t e = 0; e < E; ++e) d[e] += (cg[e] * aux_unit - dot) / S * s[e] * (1.0 - s[e]);
                }
            }
            if (z) {   // d/dl (lse^2) = 2 lse softmax(l)
                const double lse = softmax(lx, E, s.data());
                for (int64_t e = 0; e < E; ++e) d[e] += z_unit * lse * s[e];
            }
            for (int64_t e = 0; e < E; ++e) dlogits[x * E + e] = static_cast<L>(d[e]);
        }
    });
}

#define LOOM_ROUTER_KERNELS(T)                                                                                    \
    template void moe_topk(const T *, int64_t, const MoeRouting &, const float *, int32_t *, float *);                          \
    template void moe_sinkhorn_topk(const T *, int64_t, int64_t, int64_t, const MoeRouting &, int32_t *, float *); \
    template void moe_aux_counts(const T *, int64_t, const MoeRouting &, int64_t, float *);                      \
    template void moe_router_losses(const T *, int64_t, const float *, const MoeRouting &, const MoeRouterLoss &, \
                                    float *);                                                                     \
    template void moe_router_backward(const T *, int64_t, const int32_t *, const float *, const float *,          \
                                      const MoeRouting &, const MoeRouterLoss &, float, T *);
LOOM_ROUTER_KERNELS(float)
LOOM_ROUTER_KERNELS(double)
#undef LOOM_ROUTER_KERNELS

void moe_plan(const int32_t * expert_of, const float * probs, int64_t n, int64_t k, const MoePlanSpec & spec,
              float * plan_probs, int32_t * row_of, int32_t * token_of_row, int64_t token_rows,
              int64_t * tokens_per_expert) {
    const int64_t E = spec.experts, C = spec.capacity;
    // Each expert's (token, slot) assignments in token order.
    std::vector<std::vector<int64_t>> assigned(E);
    for (int64_t a = 0; a < n * k; ++a) {
        const int64_t e = static_cast<int64_t>(expert_of[a]) - spec.first;
        if (expert_of[a] >= 0 && e >= 0 && e < E) assigned[e].push_back(a);
    }
    std::fill(row_of, row_of + n * k, -1);
    std::fill(token_of_row, token_of_row + token_rows, -1);
    int64_t row = 0;
    for (int64_t e = 0; e < E; ++e) {
        std::vector<int64_t> & kept = assigned[e];
        if (C >= 0 && static_cast<int64_t>(kept.size()) > C) {
            if (spec.drop_by_probs) {   // the C highest probabilities, ties toward the earlier token
                std::stable_sort(kept.begin(), kept.end(), [&](int64_t a, int64_t b) { return probs[a] > probs[b]; });
                kept.resize(C);
                std::sort(kept.begin(), kept.end());
            } else {                    // the C earliest tokens
                kept.resize(C);
            }
        }
        const int64_t begin = row;
        for (int64_t a : kept) {
            row_of[a]           = static_cast<int32_t>(row);
            token_of_row[row++] = static_cast<int32_t>(a / k);
        }
        if (spec.padded) row = begin + C;   // the rest of the expert's rows are padding (token -1)
        tokens_per_expert[e] = row - begin;
    }
    for (int64_t a = 0; a < n * k; ++a) plan_probs[a] = row_of[a] >= 0 ? probs[a] : 0.0f;
}

void moe_plan_experts(const int32_t * row_of, int64_t slots, const int64_t * tokens_per_expert, int64_t experts,
                      int32_t * expert_of) {
    // Rows are expert-major: expert e's rows end at the prefix sum of the counts up to e.
    std::vector<int64_t> end(experts);
    int64_t              total = 0;
    for (int64_t e = 0; e < experts; ++e) end[e] = total += tokens_per_expert[e];
    for (int64_t a = 0; a < slots; ++a) {
        expert_of[a] = row_of[a] < 0 ? -1
                                     : static_cast<int32_t>(std::upper_bound(end.begin(), end.end(), row_of[a]) - end.begin());
    }
}

void moe_count_tokens(const int64_t * tokens_per_expert, int64_t experts, float * load) {
    for (int64_t e = 0; e < experts; ++e) load[e] += static_cast<float>(tokens_per_expert[e]);
}

void moe_expert_bias_update(float * load, float * bias, int64_t rows, int64_t experts, float rate) {
    for (int64_t r = 0; r < rows; ++r) {
        float * l = load + r * experts;
        double  sum = 0;
        for (int64_t e = 0; e < experts; ++e) sum += l[e];
        const double mean = sum / static_cast<double>(experts);
        for (int64_t e = 0; e < experts; ++e) {
            const double offset = mean - static_cast<double>(l[e]);
            bias[r * experts + e] += offset > 0 ? rate : offset < 0 ? -rate : 0.0f;
            l[e] = 0.0f;
        }
    }
}

void moe_gather_rows(const float * x, int64_t m, const int32_t * index, int64_t rows, int64_t h, float * out) {
    for (int64_t r = 0; r < rows; ++r) {
        LOOM_CHECK(index[r] >= -1 && index[r] < m, "moe_gather_rows: row " << index[r] << " of " << m, "");
    }
    parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            if (index[r] >= 0) {
                std::memcpy(out + r * h, x + static_cast<int64_t>(index[r]) * h, h * sizeof(float));
            } else {
                std::memset(out + r * h, 0, h * sizeof(float));
            }
        }
    });
}

void moe_combine(const float * src, const int32_t * row_of, const float * weights, int64_t n, int64_t k, int64_t h,
                 float * dst) {
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            float * d = dst + t * h;
            std::memset(d, 0, h * sizeof(float));
            for (int64_t j = 0; j < k; ++j) {
                if (row_of[t * k + j] < 0) continue;
                const float * s = src + static_cast<int64_t>(row_of[t * k + j]) * h;
                const float   p = weights ? weights[t * k + j] : 1.0f;
                for (int64_t c = 0; c < h; ++c) d[c] += p * s[c];
            }
        }
    });
}

void moe_combine_backward(const float * dy, const float * src, int64_t rows, const float * weights,
                          const int32_t * row_of, const int32_t * token_of_row, int64_t n, int64_t k, int64_t h,
                          float * dsrc, float * dweights) {
    // Rows no slot points at (padding) get a zero gradient.
    parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
        for (int64_t r = begin; r < end; ++r) {
            if (token_of_row[r] < 0) std::memset(dsrc + r * h, 0, h * sizeof(float));
        }
    });
    parallel_for(n, 16, [&](int64_t begin, int64_t end) {
        for (int64_t t = begin; t < end; ++t) {
            const float * gt = dy + t * h;
            for (int64_t j = 0; j < k; ++j) {
                const int64_t r = row_of[t * k + j];
                if (r < 0) {
                    dweights[t * k + j] = 0.0f;
                    continue;
                }
                const float * yr  = src + r * h;
                float *       out = dsrc + r * h;
                const float   p   = weights[t * k + j];
                double        dot = 0;
                for (int64_t c = 0; c < h; ++c) {
                    out[c] = p * gt[c];
                    dot += static_cast<double>(gt[c]) * yr[c];
                }
                dweights[t * k + j] = static_cast<float>(dot);
            }
        }
    });
}

}  // namespace loom::cpu
