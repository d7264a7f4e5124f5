// The Mixture-of-Experts kernels (moe_kernels.h): one thread per token for the router, whose scores are
// recomputed on the fly instead of kept in per-thread arrays of E; the dispatch plan in one block per
// expert, whose slot list is built in token order by one thread (the order the CPU's plan takes).
#include "backend/cuda/kernel_common.cuh"
#include "backend/cuda/launch.h"
#include "backend/cuda/moe_kernels.h"

#include <cmath>

namespace loom::LOOM_CUDA_NS::kernels {

namespace {

__device__ __forceinline__ double sigmoid_d(double v) { return 1.0 / (1.0 + exp(-v)); }

// softmax(l) over E is exp(l_e - m) / sum; logsumexp is m + log(sum).
struct Softmax {
    double m, sum;
};

template <typename L>
__device__ Softmax softmax_of(const L * l, int64_t E) {
    double m = l[0];
    for (int64_t e = 1; e < E; ++e) m = fmax(m, static_cast<double>(l[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += exp(l[e] - m);
    return {m, sum};
}

template <typename L>
__device__ __forceinline__ double softmax_at(const L * l, int64_t e, const Softmax & s) {
    return exp(l[e] - s.m) / s.sum;
}

template <typename L>
__device__ double sigmoid_sum(const L * l, int64_t E) {
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += sigmoid_d(l[e]);
    return sum;
}

// A row's score of expert e: the selection score (aux = false) or the aux loss's (aux = true).
template <typename L>
struct Scores {
    const L *     l;
    Softmax       soft;
    double        sig_sum;
    int           kind;   // 0 logits, 1 softmax, 2 sigmoid, 3 sigmoid normalised over E

    __device__ double operator()(int64_t e) const {
        switch (kind) {
            case 0: return l[e];
            case 1: return softmax_at(l, e, soft);
            case 2: return sigmoid_d(l[e]);
            default: return sigmoid_d(l[e]) / (sig_sum + 1e-20);
        }
    }
};

template <typename L>
__device__ Scores<L> selection_scores(const L * l, const MoeRoutingArgs & r) {
    Scores<L> s{l, {0, 1}, 0, r.sigmoid ? 2 : r.pre_softmax ? 1 : 0};
    if (s.kind == 1) s.soft = softmax_of(l, r.experts);
    return s;
}

template <typename L>
__device__ Scores<L> aux_scores(const L * l, const MoeRoutingArgs & r) {
    Scores<L> s{l, {0, 1}, 0, r.sigmoid ? 3 : 1};
    if (s.kind == 1) s.soft = softmax_of(l, r.experts);
    if (s.kind == 3) s.sig_sum = sigmoid_sum(l, r.experts);
    return s;
}

// The k largest scores in descending order, ties toward the lower index.
template <typename Score>
__device__ void topk_desc(const Score & score, int64_t E, int64_t k, int32_t * idx) {
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        double  best_v = 0;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
            if (taken) continue;
            const double v = score(e);
            if (best < 0 || v > best_v) {
                best   = e;
                best_v = v;
            }
        }
        idx[j] = static_cast<int32_t>(best);
    }
}

// The selected experts' probabilities before the scaling factor.
template <typename L>
__device__ void topk_probs(const L * l, const int32_t * idx, const MoeRoutingArgs & r, double * q) {
    const int64_t k = r.topk;
    if (!r.sigmoid) {
        if (r.pre_softmax) {
            const Softmax s = softmax_of(l, r.experts);
            for (int64_t j = 0; j < k; ++j) q[j] = softmax_at(l, idx[j], s);
        } else {
            const double m = l[idx[0]];
            double       sum = 0;
            for (int64_t j = 0; j < k; ++j) sum += (q[j] = exp(l[idx[j]] - m));
            for (int64_t j = 0; j < k; ++j) q[j] /= sum;
        }
    } else {
        double sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid_d(l[idx[j]]));
        if (k > 1) {
            for (int64_t j = 0; j < k; ++j) q[j] /= sum + 1e-20;
        }
    }
}

// A row's selection score with the expert bias added (sigmoid) and the experts of the groups left out by
// group-limited routing at -inf (backend/cpu/moe.cpp's limit_to_groups).
template <typename L>
struct Selection {
    Scores<L>     base;
    const float * bias;
    uint64_t      kept;   // bit g: group g kept
    int64_t       per;    // experts per group

    __device__ double operator()(int64_t e) const {
        if (!((kept >> (e / per)) & 1u)) return -INFINITY;
        const double v = base(e);
        return bias ? v + static_cast<double>(bias[e]) : v;
    }
};

template <typename L>
__device__ Selection<L> selection_of(const L * l, const MoeRoutingArgs & r, const float * bias) {
    Selection<L> s{selection_scores(l, r), bias, ~uint64_t{0}, r.experts};
    if (r.group_topk == 0) return s;
    const int64_t G = r.num_groups, per = r.experts / G, m = r.topk / r.group_topk;
    double        group_score[kMoeMaxGroups];
    int32_t       idx[kMoeMaxTopk];
    for (int64_t g = 0; g < G; ++g) {
        const Selection<L> all{s.base, bias, ~uint64_t{0}, r.experts};
        auto               in_group = [&](int64_t e) { return all(g * per + e); };
        topk_desc(in_group, per, m, idx);
        double sum = 0;
        for (int64_t j = 0; j < m; ++j) sum += in_group(idx[j]);
        group_score[g] = sum;
    }
    int32_t best[kMoeMaxGroups];
    topk_desc([&](int64_t g) { return group_score[g]; }, G, r.group_topk, best);
    s.kept = 0;
    for (int64_t j = 0; j < r.group_topk; ++j) s.kept |= uint64_t{1} << best[j];
    s.per = per;
    return s;
}

template <typename L>
__global__ void moe_topk_kernel(const L * logits, int64_t n, MoeRoutingArgs r, const float * bias, int32_t * top_idx,
                                float * probs) {
    LOOM_GRID_STRIDE(x, n) {
        const L *     l = logits + x * r.experts;
        int32_t *     idx = top_idx + x * r.topk;
        topk_desc(selection_of(l, r, bias), r.experts, r.topk, idx);
        double q[kMoeMaxTopk];
        topk_probs(l, idx, r, q);
        for (int64_t j = 0; j < r.topk; ++j) probs[x * r.topk + j] = static_cast<float>(r.scaling * q[j]);
    }
}

// Sinkhorn's scalings over all N rows (backend/cpu/moe.cpp's twin, the same double operations in the same
// order): one block; C = exp(logits) in `c`, d0 (N) and d1 (E) from ones, alternated until the mean |change
// of d1| is at most 1e-4 (thread 0 adds the changes in expert order, as the CPU does).
template <typename L>
__global__ void moe_sinkhorn_kernel(const L * logits, int64_t N, int64_t E, double * c, double * d0, double * d1,
                                    double * change) {
    __shared__ int done;
    const double   eps = 1e-8, tol = 1e-4;
    for (int64_t i = threadIdx.x; i < N * E; i += blockDim.x) c[i] = exp(static_cast<double>(logits[i]));
    for (int64_t x = threadIdx.x; x < N; x += blockDim.x) d0[x] = 1.0;
    for (int64_t e = threadIdx.x; e < E; e += blockDim.x) d1[e] = 1.0;
    __syncthreads();
    for (;;) {
        for (int64_t x = threadIdx.x; x < N; x += blockDim.x) {
            double sum = 0;
            for (int64_t e = 0; e < E; ++e) sum += d1[e] * c[x * E + e];
            d0[x] = 1.0 / static_cast<double>(N) / (sum + eps);
        }
        __syncthreads();
        for (int64_t e = threadIdx.x; e < E; e += blockDim.x) {
            double sum = 0;
            for (int64_t x = 0; x < N; ++x) sum += d0[x] * c[x * E + e];
            const double next = 1.0 / static_cast<double>(E) / (sum + eps);
            change[e]         = fabs(d1[e] - next);
            d1[e]             = next;
        }
        __syncthreads();
        if (threadIdx.x == 0) {
            double error = 0;
            for (int64_t e = 0; e < E; ++e) error += change[e];
            done = error / static_cast<double>(E) <= tol;
        }
        __syncthreads();
        if (done) break;
    }
}

// Rows [first, first + n): the k experts by descending d0_x C_xe d1_e, and their probabilities from the
// logits as moe_topk gives them.
template <typename L>
__global__ void moe_sinkhorn_select_kernel(const L * logits, int64_t first, int64_t n, MoeRoutingArgs r,
                                           const double * c, const double * d0, const double * d1, int32_t * top_idx,
                                           float * probs) {
    LOOM_GRID_STRIDE(x, n) {
        const int64_t row = first + x, E = r.experts;
        int32_t *     idx = top_idx + x * r.topk;
        topk_desc([&](int64_t e) { return d0[row] * c[row * E + e] * d1[e]; }, E, r.topk, idx);
        double q[kMoeMaxTopk];
        topk_probs(logits + row * E, idx, r, q);
        for (int64_t j = 0; j < r.topk; ++j) probs[x * r.topk + j] = static_cast<float>(r.scaling * q[j]);
    }
}

template <typename L>
__global__ void moe_aux_counts_kernel(const L * logits, int64_t n, MoeRoutingArgs r, int64_t groups, float * counts) {
    LOOM_GRID_STRIDE(x, n) {
        int32_t idx[kMoeMaxTopk];
        topk_desc(aux_scores(logits + x * r.experts, r), r.experts, r.topk, idx);
        for (int64_t j = 0; j < r.topk; ++j) atomicAdd(counts + (x % groups) * r.experts + idx[j], 1.0f);   // whole numbers: exact in any order
    }
}

// Per row: the aux scores' normaliser (softmax's m and sum, or the sigmoid sum) and logsumexp.
template <typename L>
__global__ void moe_row_stats_kernel(const L * logits, int64_t n, MoeRoutingArgs r, double * stats) {
    LOOM_GRID_STRIDE(x, n) {
        const L *     l = logits + x * r.experts;
        const Softmax s = softmax_of(l, r.experts);
        stats[x * 4 + 0] = s.m;
        stats[x * 4 + 1] = s.sum;
        stats[x * 4 + 2] = r.sigmoid ? sigmoid_sum(l, r.experts) : 0.0;
        stats[x * 4 + 3] = s.m + log(s.sum);
    }
}

// P[g, e]: the aux scores of expert e summed over group g's rows in token order.
template <typename L>
__global__ void moe_score_sums_kernel(const L * logits, int64_t n, MoeRoutingArgs r, int64_t groups,
                                      const double * stats, double * P) {
    LOOM_GRID_STRIDE(i, groups * r.experts) {
        const int64_t g = i / r.experts, e = i % r.experts;
        double        sum = 0;
        for (int64_t x = g; x < n; x += groups) {
            const L * l = logits + x * r.experts;
            sum += r.sigmoid ? sigmoid_d(l[e]) / (stats[x * 4 + 2] + 1e-20)
                             : softmax_at(l, e, Softmax{stats[x * 4 + 0], stats[x * 4 + 1]});
        }
        P[i] = sum;
    }
}

__global__ void moe_losses_kernel(int64_t n, MoeRoutingArgs r, MoeLossArgs loss, const float * counts,
                                  const double * stats, const double * P, float * losses) {
    if (blockIdx.x != 0 || threadIdx.x != 0) return;
    const int64_t E = r.experts, k = r.topk, G = loss.groups;
    const bool    aux = loss.aux_coeff > 0.0f, z = loss.z_coeff > 0.0f;
    double        aux_loss = 0;
    if (aux) {
        const double T = static_cast<double>(loss.tokens / G);
        for (int64_t i = 0; i < G * E; ++i) aux_loss += P[i] * counts[i];
        aux_loss *= static_cast<double>(E) * loss.aux_coeff / (static_cast<double>(k) * T * T) / G;
    }
    double lse_sq = 0;
    for (int64_t x = 0; x < n && z; ++x) lse_sq += stats[x * 4 + 3] * stats[x * 4 + 3];
    const double z_loss = z ? loss.z_coeff * lse_sq / static_cast<double>(loss.tokens) : 0.0;
    losses[0] = static_cast<float>(aux_loss);
    losses[1] = aux ? static_cast<float>(aux_loss / loss.aux_coeff) : 0.0f;
    losses[2] = static_cast<float>(z_loss);
    losses[3] = z ? static_cast<float>(z_loss / loss.z_coeff) : 0.0f;
}

// backend/cpu/moe.cpp's moe_router_backward, each expert's gradient summed from its terms in the CPU's order.
template <typename L>
__global__ void moe_router_backward_kernel(const L * logits, int64_t n, const int32_t * top_idx, const float * dprobs,
                                           const float * counts, MoeRoutingArgs r, MoeLossArgs loss, float loss_scale,
                                           L * dlogits) {
    const int64_t E = r.experts, k = r.topk, G = loss.groups;
    const bool    aux = loss.aux_coeff > 0.0f, z = loss.z_coeff > 0.0f;
    const double  T        = static_cast<double>(loss.tokens / G);
    const double  aux_unit = aux ? loss_scale * static_cast<double>(E) * loss.aux_coeff / (k * T * T) / G : 0.0;
    const double  z_unit   = z ? loss_scale * loss.z_coeff * 2.0 / static_cast<double>(loss.tokens) : 0.0;
    LOOM_GRID_STRIDE(x, n) {
        const L *       l   = logits + x * E;
        const int32_t * idx = top_idx + x * k;
        double          q[kMoeMaxTopk], dq[kMoeMaxTopk], term[kMoeMaxTopk];
        for (int64_t j = 0; j < k; ++j) dq[j] = r.scaling * dprobs[x * k + j];
        const Softmax soft = softmax_of(l, E);
        // The top-k part: a term per selected expert, or (pre-softmax) s_e (ds_e - dot) for every e.
        double dot = 0, S = 0;
        if (!r.sigmoid && r.pre_softmax) {
            for (int64_t j = 0; j < k; ++j) dot += softmax_at(l, idx[j], soft) * dq[j];
        } else if (!r.sigmoid) {
            topk_probs(l, idx, r, q);
            for (int64_t j = 0; j < k; ++j) dot += q[j] * dq[j];
            for (int64_t j = 0; j < k; ++j) term[j] = q[j] * (dq[j] - dot);
        } else {
            double sum = 0;
            for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid_d(l[idx[j]]));
            S = sum + 1e-20;
            if (k > 1) {
                for (int64_t j = 0; j < k; ++j) dot += q[j] / S * dq[j];
            }
            for (int64_t j = 0; j < k; ++j) {
                const double dg = k > 1 ? (dq[j] - dot) / S : dq[j];
                term[j]         = dg * q[j] * (1.0 - q[j]);
            }
        }
        // The aux part's dot product over all E.
        const float * cg      = counts + (x % G) * E;
        double          aux_dot = 0, aux_S = 0;
        if (aux && !r.sigmoid) {
            for (int64_t e = 0; e < E; ++e) aux_dot += softmax_at(l, e, soft) * cg[e] * aux_unit;
        } else if (aux) {
            aux_S = sigmoid_sum(l, E) + 1e-20;
            for (int64_t e = 0; e < E; ++e) aux_dot += sigmoid_d(l[e]) / aux_S * cg[e] * aux_unit;
        }
        const double lse = soft.m + log(soft.sum);
        for (int64_t e = 0; e < E; ++e) {
            double d = 0.0;
            if (!r.sigmoid && r.pre_softmax) {
                double ds = 0.0;
                for (int64_t j = 0; j < k; ++j) ds = idx[j] == e ? dq[j] : ds;
                d += softmax_at(l, e, soft) * (ds - dot);
            } else {
                for (int64_t j = 0; j < k; ++j) {
                    if (idx[j] == e) d += term[j];
                }
            }
            if (aux && !r.sigmoid) {
                const double s = softmax_at(l, e, soft);
                d += s * (cg[e] * aux_unit - aux_dot);
            } else if (aux) {
                const double s = sigmoid_d(l[e]);
                d += (cg[e] * aux_unit - aux_dot) / aux_S * s * (1.0 - s);
            }
            if (z) d += z_unit * lse * softmax_at(l, e, soft);
            dlogits[x * E + e] = static_cast<L>(d);
        }
    }
}

// ---- Dispatch plan

// count[e]: the slots routed to expert first + e.
__global__ void moe_plan_count_kernel(const int32_t * expert_of, int64_t slots, MoePlanArgs spec, int32_t * count) {
    const int64_t e = blockIdx.x;
    double        mine = 0;
    for (int64_t a = threadIdx.x; a < slots; a += blockDim.x) mine += expert_of[a] >= 0 && expert_of[a] - spec.first == e;
    const double total = block_sum(mine);
    if (threadIdx.x == 0) count[e] = static_cast<int32_t>(total);
}

// Block e: its slots in token order, which of them it keeps, and their rows (expert-major, after the rows of
// the experts before it).
__global__ void moe_plan_rows_kernel(const int32_t * expert_of, const float * probs, int64_t slots, int64_t k,
                                     MoePlanArgs spec, int32_t * row_of, int32_t * token_of_row,
                                     int64_t * tokens_per_expert, const int32_t * count, int32_t * list, int32_t * kept) {
    const int64_t e = blockIdx.x, C = spec.capacity;
    int64_t       offset = 0, base = 0;
    for (int64_t i = 0; i < e; ++i) {
        offset += count[i];
        base += spec.padded ? C : C >= 0 && count[i] > C ? C : count[i];
    }
    const int64_t m = count[e];
    int32_t *     mine = list + offset;
    int32_t *     keep = kept + offset;
    if (threadIdx.x == 0) {
        int64_t i = 0;
        for (int64_t a = 0; a < slots; ++a) {
            if (expert_of[a] >= 0 && expert_of[a] - spec.first == e) mine[i++] = static_cast<int32_t>(a);
        }
    }
    __syncthreads();
    const bool over = C >= 0 && m > C;
    for (int64_t i = threadIdx.x; i < m; i += blockDim.x) {
        if (!over) {
            keep[i] = 1;
        } else if (!spec.drop_by_probs) {
            keep[i] = i < C;   // the C earliest tokens
        } else {               // the C highest probabilities, ties toward the earlier token
            const float p    = probs[mine[i]];
            int64_t     rank = 0;
            for (int64_t j = 0; j < m; ++j) rank += probs[mine[j]] > p || (probs[mine[j]] == p && j < i);
            keep[i] = rank < C;
        }
    }
    __syncthreads();
    if (threadIdx.x == 0) {
        int64_t row = base;
        for (int64_t i = 0; i < m; ++i) {
            if (!keep[i]) continue;
            row_of[mine[i]]     = static_cast<int32_t>(row);
            token_of_row[row++] = static_cast<int32_t>(mine[i] / k);
        }
        tokens_per_expert[e] = spec.padded ? C : row - base;
    }
}

__global__ void fill_i32_kernel(int32_t * x, int64_t n, int32_t value) {
    LOOM_GRID_STRIDE(i, n) x[i] = value;
}

__global__ void moe_plan_probs_kernel(const float * probs, const int32_t * row_of, int64_t slots, float * plan_probs) {
    LOOM_GRID_STRIDE(a, slots) plan_probs[a] = row_of[a] >= 0 ? probs[a] : 0.0f;
}

__global__ void moe_plan_experts_kernel(const int32_t * row_of, int64_t slots, const int64_t * tokens_per_expert,
                                        int64_t experts, int32_t * expert_of) {
    LOOM_GRID_STRIDE(a, slots) {
        int32_t e = -1;
        if (row_of[a] >= 0) {
            int64_t end = 0;
            for (int64_t i = 0; i < experts && e < 0; ++i) {
                end += tokens_per_expert[i];
                if (row_of[a] < end) e = static_cast<int32_t>(i);
            }
            e = e < 0 ? static_cast<int32_t>(experts) : e;   // past the last expert's rows, as upper_bound
        }
        expert_of[a] = e;
    }
}

// ---- Moving rows

__global__ void moe_gather_rows_kernel(const float * x, int64_t m, const int32_t * index, int64_t rows, int64_t h, float * out) {
    LOOM_GRID_STRIDE(i, rows * h) {
        const int64_t src = index[i / h];
        out[i]            = src >= 0 && src < m ? x[src * h + i % h] : 0.0f;
    }
}

__global__ void moe_combine_kernel(const float * src, const int32_t * row_of, const float * weights, int64_t n,
                                   int64_t k, int64_t h, float * dst) {
    LOOM_GRID_STRIDE(i, n * h) {
        const int64_t t = i / h, c = i % h;
        float         d = 0.0f;
        for (int64_t j = 0; j < k; ++j) {
            const int64_t r = row_of[t * k + j];
            if (r < 0) continue;
            const float p = weights ? weights[t * k + j] : 1.0f;
            d             = __fadd_rn(d, __fmul_rn(p, src[r * h + c]));
        }
        dst[i] = d;
    }
}

__global__ void moe_zero_padding_rows_kernel(const int32_t * token_of_row, int64_t rows, int64_t h, float * dsrc) {
    LOOM_GRID_STRIDE(i, rows * h) {
        if (token_of_row[i / h] < 0) dsrc[i] = 0.0f;
    }
}

__global__ void moe_scatter_grad_kernel(const float * dy, const float * weights, const int32_t * row_of, int64_t slots,
                                        int64_t k, int64_t h, float * dsrc) {
    LOOM_GRID_STRIDE(i, slots * h) {
        const int64_t a = i / h, c = i % h, r = row_of[a];
        if (r >= 0) dsrc[r * h + c] = __fmul_rn(weights[a], dy[(a / k) * h + c]);
    }
}

__global__ void moe_weight_grad_kernel(const float * dy, const float * src, const int32_t * row_of, int64_t slots,
                                       int64_t k, int64_t h, float * dweights) {
    LOOM_GRID_STRIDE(a, slots) {
        const int64_t r = row_of[a];
        double        dot = 0;
        if (r >= 0) {
            const float * g = dy + (a / k) * h;
            const float * y = src + r * h;
            for (int64_t c = 0; c < h; ++c) dot += static_cast<double>(g[c]) * y[c];
        }
        dweights[a] = r >= 0 ? static_cast<float>(dot) : 0.0f;
    }
}

__global__ void moe_count_tokens_kernel(const int64_t * tokens_per_expert, int64_t experts, float * load) {
    LOOM_GRID_STRIDE(e, experts) { load[e] += static_cast<float>(tokens_per_expert[e]); }
}

// One thread per row, the row's sum in expert order (the CPU's).
__global__ void moe_expert_bias_update_kernel(float * load, float * bias, int64_t rows, int64_t experts, float rate) {
    LOOM_GRID_STRIDE(r, rows) {
        float * l   = load + r * experts;
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

}  // namespace

template <typename L>
void moe_topk(cudaStream_t stream, const L * logits, int64_t n, const MoeRoutingArgs & r, const float * expert_bias,
              int32_t * top_idx, float * probs) {
    if (n > 0) {
        LOOM_LAUNCH(moe_topk_kernel<L>, blocks_for(n), kThreads, 0, stream)(logits, n, r, expert_bias, top_idx, probs);
    }
}

void moe_count_tokens(cudaStream_t stream, const int64_t * tokens_per_expert, int64_t experts, float * load) {
    if (experts > 0) {
        LOOM_LAUNCH(moe_count_tokens_kernel, blocks_for(experts), kThreads, 0, stream)(tokens_per_expert, experts, load);
    }
}

void moe_expert_bias_update(cudaStream_t stream, float * load, float * bias, int64_t rows, int64_t experts, float rate) {
    if (rows > 0) LOOM_LAUNCH(moe_expert_bias_update_kernel, blocks_for(rows), kThreads, 0, stream)(load, bias, rows, experts, rate);
}

int64_t moe_sinkhorn_scratch(int64_t N, int64_t experts) { return N * experts + N + 2 * experts; }

template <typename L>
void moe_sinkhorn_topk(cudaStream_t stream, const L * logits, int64_t N, int64_t first, int64_t n,
                       const MoeRoutingArgs & r, double * scratch, int32_t * top_idx, float * probs) {
    if (N == 0) return;
    double * c = scratch, *d0 = c + N * r.experts, *d1 = d0 + N, *change = d1 + r.experts;
    LOOM_LAUNCH(moe_sinkhorn_kernel<L>, 1, kThreads, 0, stream)(logits, N, r.experts, c, d0, d1, change);
    if (n > 0) {
        LOOM_LAUNCH(moe_sinkhorn_select_kernel<L>, blocks_for(n), kThreads, 0, stream)(logits, first, n, r, c, d0, d1,
                                                                                    top_idx, probs);
    }
}

template <typename L>
void moe_aux_counts(cudaStream_t stream, const L * logits, int64_t n, const MoeRoutingArgs & r, int64_t groups,
                    float * counts) {
    cudaMemsetAsync(counts, 0, static_cast<size_t>(groups * r.experts) * sizeof(float), stream);
    if (n > 0) LOOM_LAUNCH(moe_aux_counts_kernel<L>, blocks_for(n), kThreads, 0, stream)(logits, n, r, groups, counts);
}

int64_t moe_router_losses_scratch(int64_t n, int64_t groups, int64_t experts) { return 4 * n + groups * experts + 1; }

template <typename L>
void moe_router_losses(cudaStream_t stream, const L * logits, int64_t n, const float * counts,
                       const MoeRoutingArgs & r, const MoeLossArgs & loss, double * scratch, float * losses) {
    double * stats = scratch;
    double * P     = scratch + 4 * n;
    if (n > 0 && (loss.aux_coeff > 0.0f || loss.z_coeff > 0.0f)) {
        LOOM_LAUNCH(moe_row_stats_kernel<L>, blocks_for(n), kThreads, 0, stream)(logits, n, r, stats);
        if (loss.aux_coeff > 0.0f) {
            LOOM_LAUNCH(moe_score_sums_kernel<L>, blocks_for(loss.groups * r.experts), kThreads, 0, stream)(
                logits, n, r, loss.groups, stats, P);
        }
    }
    LOOM_LAUNCH(moe_losses_kernel, 1, 1, 0, stream)(n, r, loss, counts, stats, P, losses);
}

template <typename L>
void moe_router_backward(cudaStream_t stream, const L * logits, int64_t n, const int32_t * top_idx,
                         const float * dprobs, const float * counts, const MoeRoutingArgs & r, const MoeLossArgs & loss,
                         float loss_scale, L * dlogits) {
    if (n > 0) {
        LOOM_LAUNCH(moe_router_backward_kernel<L>, blocks_for(n), kThreads, 0, stream)(
            logits, n, top_idx, dprobs, counts, r, loss, loss_scale, dlogits);
    }
}

#define LOOM_ROUTER_KERNELS(T)                                                                                     \
    template void moe_topk(cudaStream_t, const T *, int64_t, const MoeRoutingArgs &, const float *, int32_t *,     \
                           float *);                                                                              \
    template void moe_sinkhorn_topk(cudaStream_t, const T *, int64_t, int64_t, int64_t, const MoeRoutingArgs &,   \
                                    double *, int32_t *, float *);                                                \
    template void moe_aux_counts(cudaStream_t, const T *, int64_t, const MoeRoutingArgs &, int64_t, float *);     \
    template void moe_router_losses(cudaStream_t, const T *, int64_t, const float *, const MoeRoutingArgs &,      \
                                    const MoeLossArgs &, double *, float *);                                      \
    template void moe_router_backward(cudaStream_t, const T *, int64_t, const int32_t *, const float *,           \
                                      const float *, const MoeRoutingArgs &, const MoeLossArgs &, float, T *);
LOOM_ROUTER_KERNELS(float)
LOOM_ROUTER_KERNELS(double)
#undef LOOM_ROUTER_KERNELS

int64_t moe_plan_scratch(int64_t slots, int64_t experts) { return experts + 2 * slots + 1; }

void moe_plan(cudaStream_t stream, const int32_t * expert_of, const float * probs, int64_t n, int64_t k,
              const MoePlanArgs & spec, float * plan_probs, int32_t * row_of, int32_t * token_of_row,
              int64_t token_rows, int64_t * tokens_per_expert, int32_t * scratch) {
    const int64_t slots = n * k;
    int32_t *     count = scratch;
    int32_t *     list  = scratch + spec.experts;
    int32_t *     kept  = list + slots;
    if (slots > 0) LOOM_LAUNCH(fill_i32_kernel, blocks_for(slots), kThreads, 0, stream)(row_of, slots, -1);
    if (token_rows > 0) LOOM_LAUNCH(fill_i32_kernel, blocks_for(token_rows), kThreads, 0, stream)(token_of_row, token_rows, -1);
    const unsigned experts = static_cast<unsigned>(spec.experts);
    LOOM_LAUNCH(moe_plan_count_kernel, experts, kThreads, 0, stream)(expert_of, slots, spec, count);
    LOOM_LAUNCH(moe_plan_rows_kernel, experts, kThreads, 0, stream)(expert_of, probs, slots, k, spec, row_of, token_of_row,
                                                                    tokens_per_expert, count, list, kept);
    if (slots > 0) LOOM_LAUNCH(moe_plan_probs_kernel, blocks_for(slots), kThreads, 0, stream)(probs, row_of, slots, plan_probs);
}

void moe_plan_experts(cudaStream_t stream, const int32_t * row_of, int64_t slots, const int64_t * tokens_per_expert,
                      int64_t experts, int32_t * expert_of) {
    if (slots > 0) {
        LOOM_LAUNCH(moe_plan_experts_kernel, blocks_for(slots), kThreads, 0, stream)(
            row_of, slots, tokens_per_expert, experts, expert_of);
    }
}

void moe_gather_rows(cudaStream_t stream, const float * x, int64_t m, const int32_t * index, int64_t rows, int64_t h,
                     float * out) {
    if (rows * h > 0) LOOM_LAUNCH(moe_gather_rows_kernel, blocks_for(rows * h), kThreads, 0, stream)(x, m, index, rows, h, out);
}

void moe_combine(cudaStream_t stream, const float * src, const int32_t * row_of, const float * weights, int64_t n,
                 int64_t k, int64_t h, float * dst) {
    if (n * h > 0) LOOM_LAUNCH(moe_combine_kernel, blocks_for(n * h), kThreads, 0, stream)(src, row_of, weights, n, k, h, dst);
}

void moe_combine_backward(cudaStream_t stream, const float * dy, const float * src, int64_t rows, const float * weights,
                          const int32_t * row_of, const int32_t * token_of_row, int64_t n, int64_t k, int64_t h,
                          float * dsrc, float * dweights) {
    if (rows * h > 0) {
        LOOM_LAUNCH(moe_zero_padding_rows_kernel, blocks_for(rows * h), kThreads, 0, stream)(token_of_row, rows, h, dsrc);
    }
    if (n * k * h > 0) {
        LOOM_LAUNCH(moe_scatter_grad_kernel, blocks_for(n * k * h), kThreads, 0, stream)(dy, weights, row_of, n * k, k, h, dsrc);
    }
    if (n * k > 0) {
        LOOM_LAUNCH(moe_weight_grad_kernel, blocks_for(n * k), kThreads, 0, stream)(dy, src, row_of, n * k, k, h, dweights);
    }
}

}  // namespace loom::LOOM_CUDA_NS::kernels
