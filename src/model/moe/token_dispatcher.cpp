#include "model/moe/token_dispatcher.h"

#include "core/error.h"
#include "core/ops.h"
#include "model/layers.h"

#include <algorithm>

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

namespace {

// Allocates a plan's tensors and enqueues moe_plan over the slots' experts.
DispatchPlan plan_create(DispatchPlan plan, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec) {
    Device & device        = expert_of.device();
    plan.probs             = activation(device, plan.n, plan.k);
    plan.row_of            = activation_i32(device, {plan.n, plan.k});
    plan.token_of_row      = activation_i32(device, {std::max<int64_t>(plan.rows_max, 1)});
    plan.tokens_per_expert = Tensor::empty({plan.experts}, DType::i64, device, {MemoryKind::device, kActivationsPool});
    device.ops().moe_plan(device.compute_stream(), expert_of, probs, spec, plan.probs, plan.row_of, plan.token_of_row,
                          plan.tokens_per_expert);
    return plan;
}

}  // namespace

DispatchPlan dispatch_plan_create(const Tensor & top_idx, const Tensor & probs, const MoeConfig & moe) {
    LOOM_CHECK(top_idx.dim() == 2 && top_idx.dtype() == DType::i32, "top_idx " << top_idx.describe(), "");
    const DispatchPlan shape = dispatch_plan_shape(top_idx.size(0), top_idx.size(1), moe);
    MoePlanSpec        spec;
    spec.experts       = shape.experts;
    spec.capacity      = shape.capacity;
    spec.padded        = shape.padded;
    spec.drop_by_probs = moe.drop_policy == MoeDropPolicy::probs;
    return plan_create(shape, top_idx, probs, spec);
}

std::vector<int64_t> dispatch_plan_counts(const DispatchPlan & plan) {
    if (plan.padded) return std::vector<int64_t>(plan.experts, plan.capacity);
    return read_counts(plan.tokens_per_expert);
}

std::vector<int64_t> read_counts(const Tensor & counts) {
    Tensor host = counts;
    if (counts.host_addressable()) {
        counts.device().compute_stream().synchronize();
    } else {
        host = host_readable(counts);   // a pinned copy, after the stream has run
    }
    const int64_t * c = host.data<int64_t>();
    return std::vector<int64_t>(c, c + counts.numel());
}

Tensor moe_permute(const Tensor & x, const DispatchPlan & plan, int64_t rows) {
    check_rows(x, plan.n, "moe_permute input");
    LOOM_CHECK(rows >= 0 && rows <= plan.rows_max, "moe_permute to " << rows << " rows, the plan holds " << plan.rows_max, "");
    Tensor xp = activation(x.device(), rows, x.size(1));
    x.device().ops().moe_gather_rows(x.device().compute_stream(), x, plan.token_of_row.narrow(0, 0, rows), xp);
    return xp;
}

Tensor moe_permute_backward(const Tensor & dxp, const DispatchPlan & plan) {
    LOOM_CHECK(dxp.dim() == 2 && dxp.dtype() == DType::f32, "moe_permute_backward of " << dxp.describe(), "");
    Tensor dx = activation(dxp.device(), plan.n, dxp.size(1));
    dxp.device().ops().moe_combine(dxp.device().compute_stream(), dxp, plan.row_of, Tensor(), dx);
    return dx;
}

Tensor moe_unpermute(const Tensor & yp, const DispatchPlan & plan) {
    LOOM_CHECK(yp.dim() == 2 && yp.dtype() == DType::f32, "moe_unpermute of " << yp.describe(), "");
    Tensor y = activation(yp.device(), plan.n, yp.size(1));
    yp.device().ops().moe_combine(yp.device().compute_stream(), yp, plan.row_of, plan.probs, y);
    return y;
}

void moe_unpermute_backward(const Tensor & dy, const Tensor & yp, const DispatchPlan & plan, Tensor & dyp,
                            Tensor & dprobs) {
    check_rows(dy, plan.n, "moe_unpermute_backward gradient");
    LOOM_CHECK(yp.dim() == 2 && yp.size(1) == dy.size(1), "moe_unpermute_backward of " << yp.describe(), "");
    dyp    = activation(dy.device(), yp.size(0), dy.size(1));
    dprobs = activation(dy.device(), plan.n, plan.k);
    dy.device().ops().moe_combine_backward(dy.device().compute_stream(), dy, yp, plan.probs, plan.row_of,
                                           plan.token_of_row, dyp, dprobs);
}

Tensor dispatch_plan_routed(const DispatchPlan & plan) {
    Device & device = plan.row_of.device();
    Tensor   routed = activation_i32(device, {plan.n, plan.k});
    device.ops().moe_plan_experts(device.compute_stream(), plan.row_of, plan.tokens_per_expert, routed);
    return routed;
}

DispatchPlan dispatch_plan_local(const Tensor & routed, const Tensor & probs, int64_t first, int64_t count) {
    LOOM_CHECK(routed.dim() == 2 && routed.dtype() == DType::i32, "routed " << routed.describe(), "");
    DispatchPlan plan;
    plan.n        = routed.size(0);
    plan.k        = routed.size(1);
    plan.experts  = count;
    plan.rows_max = plan.n * plan.k;
    MoePlanSpec spec;
    spec.first   = first;
    spec.experts = count;
    return plan_create(plan, routed, probs, spec);
}

Tensor moe_gather_rows(const Tensor & x, const std::vector<int32_t> & index) {
    LOOM_CHECK(x.dim() == 2 && x.dtype() == DType::f32, "moe_gather_rows of " << x.describe(), "");
    const int64_t rows = static_cast<int64_t>(index.size());
    for (int32_t i : index) LOOM_CHECK(i >= 0 && i < x.size(0), "row " << i << " of " << x.size(0), "");
    Device & device = x.device();
    Stream & stream = device.compute_stream();
    // The host's index, in memory the device's kernels read (pinned on a GPU: copied to the device).
    Tensor host = Tensor::empty({std::max<int64_t>(rows, 1)}, DType::i32, device, {host_filled_kind(device)});
    std::copy(index.begin(), index.end(), host.data<int32_t>());
    Tensor out = activation(device, rows, x.size(1));
    device.ops().moe_gather_rows(stream, x, device_resident(host, stream).narrow(0, 0, rows), out);
    return out;
}

}  // namespace loom::model
