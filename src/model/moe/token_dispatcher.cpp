#include "model/moe/token_dispatcher.h"

#include "core/error.h"
#include "core/ops.h"
#include "core/thread_pool.h"
#include "model/layers.h"

#include <algorithm>
#include <cstring>

namespace loom::model {

namespace {

Tensor activation_i32(Device & device, const Shape & shape) {
    return Tensor::empty(shape, DType::i32, device, {MemoryKind::device, kActivationsPool});
}

void check_rows(const Tensor & t, int64_t rows, const char * what) {
    LOOM_CHECK(t.dim() == 2 && t.size(0) == rows && t.dtype() == DType::f32,
               what << " is " << t.describe() << ", expected " << rows << " float32 rows", "");
}

}  // namespace

DispatchPlan dispatch_plan_shape(int64_t n, int64_t k, const MoeConfig & moe) {
    DispatchPlan plan;
    plan.n        = n;
    plan.k        = k;
    plan.experts  = moe.num_experts;
    plan.capacity = moe.drops() ? moe_capacity(plan.n, plan.experts, plan.k, moe.capacity_factor) : -1;
    plan.padded   = moe.drops() && moe.pad_to_capacity;
    plan.rows_max = plan.padded ? plan.experts * plan.capacity : plan.n * plan.k;
    return plan;
}

DispatchPlan dispatch_plan_create(const Tensor & top_idx, const Tensor & probs, const MoeConfig & moe) {
    LOOM_CHECK(top_idx.dim() == 2 && top_idx.dtype() == DType::i32, "top_idx " << top_idx.describe(), "");
    LOOM_CHECK(probs.dtype() == DType::f32 && probs.numel() == top_idx.numel(), "probs " << probs.describe(), "");
    Device &     device = top_idx.device();
    DispatchPlan plan   = dispatch_plan_shape(top_idx.size(0), top_idx.size(1), moe);
    plan.probs    = activation(device, plan.n, plan.k);
    plan.row_of   = activation_i32(device, {plan.n, plan.k});
    plan.token_of_row      = activation_i32(device, {std::max<int64_t>(plan.rows_max, 1)});
    plan.tokens_per_expert = Tensor::empty({plan.experts}, DType::i64, device, {MemoryKind::device, kActivationsPool});

    const int64_t n = plan.n, k = plan.k, E = plan.experts, C = plan.capacity;
    const bool    padded = plan.padded, by_probs = moe.drop_policy == MoeDropPolicy::probs;
    Tensor        p_out = plan.probs, row_of = plan.row_of, token_of_row = plan.token_of_row,
                  counts = plan.tokens_per_expert;
    device.compute_stream().submit([=] {
        const int32_t * ti  = top_idx.data<int32_t>();
        const float *   pr  = probs.data<float>();
        float *         po  = p_out.data<float>();
        int32_t *       ro  = row_of.data<int32_t>();
        int32_t *       tor = token_of_row.data<int32_t>();
        int64_t *       cnt = counts.data<int64_t>();
        // Each expert's (token, slot) assignments in token order.
        std::vector<std::vector<int64_t>> assigned(E);
        for (int64_t a = 0; a < n * k; ++a) {
            LOOM_CHECK(ti[a] >= 0 && ti[a] < E, "expert index " << ti[a] << " outside [0, " << E << ")", "");
            assigned[ti[a]].push_back(a);
        }
        std::fill(ro, ro + n * k, -1);
        std::fill(tor, tor + token_of_row.numel(), -1);
        int64_t row = 0;
        for (int64_t e = 0; e < E; ++e) {
            std::vector<int64_t> & kept = assigned[e];
            if (C >= 0 && static_cast<int64_t>(kept.size()) > C) {
                if (by_probs) {   // the C highest probabilities, ties toward the earlier token
                    std::stable_sort(kept.begin(), kept.end(), [&](int64_t a, int64_t b) { return pr[a] > pr[b]; });
                    kept.resize(C);
                    std::sort(kept.begin(), kept.end());
                } else {          // the C earliest tokens
                    kept.resize(C);
                }
            }
            const int64_t begin = row;
            for (int64_t a : kept) {
                ro[a]      = static_cast<int32_t>(row);
                tor[row++] = static_cast<int32_t>(a / k);
            }
            if (padded) row = begin + C;   // the rest of the expert's rows are padding (token -1)
            cnt[e] = row - begin;
        }
        for (int64_t a = 0; a < n * k; ++a) po[a] = ro[a] >= 0 ? pr[a] : 0.0f;
    });
    return plan;
}

std::vector<int64_t> dispatch_plan_counts(const DispatchPlan & plan) {
    if (plan.padded) return std::vector<int64_t>(plan.experts, plan.capacity);
    plan.tokens_per_expert.device().compute_stream().synchronize();
    const int64_t * c = plan.tokens_per_expert.data<int64_t>();
    return std::vector<int64_t>(c, c + plan.experts);
}

Tensor moe_permute(const Tensor & x, const DispatchPlan & plan, int64_t rows) {
    check_rows(x, plan.n, "moe_permute input");
    LOOM_CHECK(rows >= 0 && rows <= plan.rows_max, "moe_permute to " << rows << " rows, the plan holds " << plan.rows_max, "");
    const int64_t h  = x.size(1);
    Tensor        xp = activation(x.device(), rows, h);
    Tensor        token_of_row = plan.token_of_row;
    x.device().compute_stream().submit([=] {
        const float *   src = x.data<float>();
        float *         dst = xp.data<float>();
        const int32_t * tor = token_of_row.data<int32_t>();
        parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                if (tor[r] >= 0) {
                    std::memcpy(dst + r * h, src + tor[r] * h, h * sizeof(float));
                } else {
                    std::memset(dst + r * h, 0, h * sizeof(float));
                }
            }
        });
    });
    return xp;
}

namespace {

// dst[t] = sum over j = 0 .. k-1 with a row of weight(t, j) * src[row_of[t, j]], the terms added in slot
// order from zero; weights null: 1 (an exact product, so both callers share one loop).
void gather_rows(const Tensor & src, const Tensor & dst, const Tensor & row_of, const Tensor & weights, int64_t n, int64_t k) {
    const int64_t h = src.size(1);
    src.device().compute_stream().submit([=] {
        const float *   in  = src.data<float>();
        const float *   pr  = weights.defined() ? weights.data<float>() : nullptr;
        float *         out = dst.data<float>();
        const int32_t * ro  = row_of.data<int32_t>();
        parallel_for(n, 16, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                float * d = out + t * h;
                std::memset(d, 0, h * sizeof(float));
                for (int64_t j = 0; j < k; ++j) {
                    if (ro[t * k + j] < 0) continue;
                    const float * s = in + static_cast<int64_t>(ro[t * k + j]) * h;
                    const float   p = pr ? pr[t * k + j] : 1.0f;
                    for (int64_t c = 0; c < h; ++c) d[c] += p * s[c];
                }
            }
        });
    });
}

}  // namespace

Tensor moe_permute_backward(const Tensor & dxp, const DispatchPlan & plan) {
    LOOM_CHECK(dxp.dim() == 2 && dxp.dtype() == DType::f32, "moe_permute_backward of " << dxp.describe(), "");
    Tensor dx = activation(dxp.device(), plan.n, dxp.size(1));
    gather_rows(dxp, dx, plan.row_of, Tensor(), plan.n, plan.k);
    return dx;
}

Tensor moe_unpermute(const Tensor & yp, const DispatchPlan & plan) {
    LOOM_CHECK(yp.dim() == 2 && yp.dtype() == DType::f32, "moe_unpermute of " << yp.describe(), "");
    Tensor y = activation(yp.device(), plan.n, yp.size(1));
    gather_rows(yp, y, plan.row_of, plan.probs, plan.n, plan.k);
    return y;
}

void moe_unpermute_backward(const Tensor & dy, const Tensor & yp, const DispatchPlan & plan, Tensor & dyp,
                            Tensor & dprobs) {
    check_rows(dy, plan.n, "moe_unpermute_backward gradient");
    LOOM_CHECK(yp.dim() == 2 && yp.size(1) == dy.size(1), "moe_unpermute_backward of " << yp.describe(), "");
    const int64_t n = plan.n, k = plan.k, h = dy.size(1), rows = yp.size(0);
    dyp    = activation(dy.device(), rows, h);
    dprobs = activation(dy.device(), n, k);
    Tensor row_of = plan.row_of, probs = plan.probs, token_of_row = plan.token_of_row, d_yp = dyp, d_probs = dprobs;
    dy.device().compute_stream().submit([=] {
        const float *   g   = dy.data<float>();
        const float *   y   = yp.data<float>();
        const float *   pr  = probs.data<float>();
        const int32_t * ro  = row_of.data<int32_t>();
        const int32_t * tor = token_of_row.data<int32_t>();
        float *         dr  = d_yp.data<float>();
        float *         dp  = d_probs.data<float>();
        // Padding rows (and any row no slot points at) get a zero gradient.
        parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                if (tor[r] < 0) std::memset(dr + r * h, 0, h * sizeof(float));
            }
        });
        parallel_for(n, 16, [&](int64_t begin, int64_t end) {
            for (int64_t t = begin; t < end; ++t) {
                const float * gt = g + t * h;
                for (int64_t j = 0; j < k; ++j) {
                    const int64_t r = ro[t * k + j];
                    if (r < 0) {
                        dp[t * k + j] = 0.0f;
                        continue;
                    }
                    const float * yr  = y + r * h;
                    float *       out = dr + r * h;
                    const float   p   = pr[t * k + j];
                    double        dot = 0;
                    for (int64_t c = 0; c < h; ++c) {
                        out[c] = p * gt[c];
                        dot += static_cast<double>(gt[c]) * yr[c];
                    }
                    dp[t * k + j] = static_cast<float>(dot);
                }
            }
        });
    });
}

Tensor dispatch_plan_routed(const DispatchPlan & plan) {
    Device & device = plan.row_of.device();
    Tensor   routed = activation_i32(device, {plan.n, plan.k});
    Tensor   row_of = plan.row_of, counts = plan.tokens_per_expert;
    const int64_t E = plan.experts;
    device.compute_stream().submit([=] {
        const int32_t * ro  = row_of.data<int32_t>();
        const int64_t * cnt = counts.data<int64_t>();
        int32_t *       out = routed.data<int32_t>();
        // Rows are expert-major: expert e's rows end at the prefix sum of the counts up to e.
        std::vector<int64_t> end(E);
        int64_t              total = 0;
        for (int64_t e = 0; e < E; ++e) end[e] = total += cnt[e];
        for (int64_t a = 0; a < routed.numel(); ++a) {
            out[a] = ro[a] < 0 ? -1 : static_cast<int32_t>(std::upper_bound(end.begin(), end.end(), ro[a]) - end.begin());
        }
    });
    return routed;
}

DispatchPlan dispatch_plan_local(const Tensor & routed, const Tensor & probs, int64_t first, int64_t count) {
    LOOM_CHECK(routed.dim() == 2 && routed.dtype() == DType::i32, "routed " << routed.describe(), "");
    LOOM_CHECK(probs.dtype() == DType::f32 && probs.numel() == routed.numel(), "probs " << probs.describe(), "");
    Device &     device = routed.device();
    DispatchPlan plan;
    plan.n        = routed.size(0);
    plan.k        = routed.size(1);
    plan.experts  = count;
    plan.rows_max = plan.n * plan.k;
    plan.probs    = activation(device, plan.n, plan.k);
    plan.row_of   = activation_i32(device, {plan.n, plan.k});
    plan.token_of_row      = activation_i32(device, {std::max<int64_t>(plan.rows_max, 1)});
    plan.tokens_per_expert = Tensor::empty({count}, DType::i64, device, {MemoryKind::device, kActivationsPool});
    const int64_t n = plan.n, k = plan.k;
    Tensor        p_out = plan.probs, row_of = plan.row_of, token_of_row = plan.token_of_row, counts = plan.tokens_per_expert;
    device.compute_stream().submit([=] {
        const int32_t * ri  = routed.data<int32_t>();
        const float *   pr  = probs.data<float>();
        float *         po  = p_out.data<float>();
        int32_t *       ro  = row_of.data<int32_t>();
        int32_t *       tor = token_of_row.data<int32_t>();
        int64_t *       cnt = counts.data<int64_t>();
        std::fill(ro, ro + n * k, -1);
        std::fill(tor, tor + token_of_row.numel(), -1);
        int64_t row = 0;
        for (int64_t j = 0; j < count; ++j) {
            const int64_t begin = row;
            for (int64_t a = 0; a < n * k; ++a) {
                if (ri[a] != first + j) continue;
                ro[a]      = static_cast<int32_t>(row);
                tor[row++] = static_cast<int32_t>(a / k);
            }
            cnt[j] = row - begin;
        }
        for (int64_t a = 0; a < n * k; ++a) po[a] = ro[a] >= 0 ? pr[a] : 0.0f;
    });
    return plan;
}

Tensor moe_gather_rows(const Tensor & x, std::vector<int32_t> index) {
    LOOM_CHECK(x.dim() == 2 && x.dtype() == DType::f32, "moe_gather_rows of " << x.describe(), "");
    const int64_t rows = static_cast<int64_t>(index.size()), h = x.size(1), m = x.size(0);
    for (int32_t i : index) LOOM_CHECK(i >= 0 && i < m, "row " << i << " of " << m, "");
    Tensor out = activation(x.device(), rows, h);
    x.device().compute_stream().submit([=, index = std::move(index)] {
        const float * src = x.data<float>();
        float *       dst = out.data<float>();
        parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) std::memcpy(dst + r * h, src + index[r] * h, h * sizeof(float));
        });
    });
    return out;
}

}  // namespace loom::model
