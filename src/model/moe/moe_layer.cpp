#include "model/moe/moe_layer.h"

#include "core/error.h"
#include "core/ops.h"

namespace loom::model {

namespace {

GptConfig shared_expert_config(const GptConfig & config, const MoeConfig & moe) {
    moe_config_validate(moe, config);   // first, before any member is built from it
    GptConfig c       = config;
    c.ffn_hidden_size = moe.shared_expert_intermediate_size > 0 ? moe.shared_expert_intermediate_size : config.ffn_hidden_size;
    return c;
}

// The first of this EP rank's experts (checks that they divide evenly and the group matches).
int64_t ep_first_expert(const MoeConfig & moe, const ExpertParallel & ep) {
    LOOM_CHECK(ep.size >= 1 && ep.rank >= 0 && ep.rank < ep.size && (ep.size == 1 || (ep.group && ep.group->size() == ep.size)),
               "expert-parallel rank " << ep.rank << " of " << ep.size, "");
    LOOM_CHECK(ep.tp_size >= 1 && ep.tp_rank >= 0 && ep.tp_rank < ep.tp_size &&
                   (ep.tp_size == 1 || ep.tp_ep) &&
                   (!ep.tp_ep || (ep.tp_ep->size() == ep.exchange_size() && ep.tp_ep->rank() == ep.tp_rank + ep.rank * ep.tp_size)),
               "expert-tensor-parallel rank " << ep.tp_rank << " of " << ep.tp_size << " without its ETP x EP group",
               "");
    LOOM_CHECK(moe.num_experts % ep.size == 0, "--num-experts " << moe.num_experts
                                                                << " is not divisible by --expert-model-parallel-size " << ep.size,
               "Number of experts should be a multiple of expert model parallel_size.");
    return ep.rank * (moe.num_experts / ep.size);
}

// (max(rows, 1), cols) f32: a buffer a collective may send or receive nothing through.
Tensor rows_buffer(Device & device, int64_t rows, int64_t cols) { return activation(device, std::max<int64_t>(rows, 1), cols); }

std::vector<int64_t> times(const std::vector<int64_t> & v, int64_t f) {
    std::vector<int64_t> out(v);
    for (int64_t & x : out) x *= f;
    return out;
}

// Expert tensor parallelism sends each EP rank's block of rows to its T ETP ranks, and gets T partial sums
// back. Calls fn(block, copy, r) for each block of r > 0 rows (at row `block` of the blocks back to back)
// and each of its T copies (at row `copy` of the copies, in the exchange group's rank order q T + t).
template <typename Fn>
void for_each_copy(const std::vector<int64_t> & rows, int64_t T, Fn && fn) {
    int64_t block = 0, copy = 0;
    for (int64_t r : rows) {
        for (int64_t t = 0; t < T; ++t, copy += r) {
            if (r > 0) fn(block, copy, r, t);
        }
        block += r;
    }
}

int64_t total_rows(const std::vector<int64_t> & rows) {
    int64_t total = 0;
    for (int64_t r : rows) total += r;
    return total;
}

// Blocks (rows[q], w) of src -> T copies of each.
Tensor replicate_blocks(const Tensor & src, const std::vector<int64_t> & rows, int64_t T) {
    if (T == 1) return src;
    Device & device = src.device();
    Tensor   out    = Tensor::empty({std::max<int64_t>(T * total_rows(rows), 1), src.size(1)}, src.dtype(), device,
                                    {MemoryKind::device, kActivationsPool});
    for_each_copy(rows, T, [&](int64_t block, int64_t copy, int64_t r, int64_t) {
        device.ops().copy(device.compute_stream(), src.narrow(0, block, r), out.narrow(0, copy, r));
    });
    return out;
}

// T partial copies of each block -> each block's sum, added in t order.
Tensor sum_blocks(const Tensor & src, const std::vector<int64_t> & rows, int64_t T) {
    if (T == 1) return src;
    Device & device = src.device();
    Tensor   out    = rows_buffer(device, total_rows(rows), src.size(1));
    for_each_copy(rows, T, [&](int64_t block, int64_t copy, int64_t r, int64_t t) {
        if (t == 0) device.ops().copy(device.compute_stream(), src.narrow(0, copy, r), out.narrow(0, block, r));
        else device.ops().add_inplace(device.compute_stream(), out.narrow(0, block, r), src.narrow(0, copy, r));
    });
    return out;
}

}  // namespace

MoELayer::MoELayer(const std::string & name, const GptConfig & config, const MoeConfig & m, Device & device,
                   const TensorParallel & tensor_parallel, const ExpertParallel & expert_parallel,
                   const ContextParallel & context_parallel)
    : moe(m),
      ep(expert_parallel),
      shared_config(shared_expert_config(config, m)),
      router(name + ".router", config, m, device, tensor_parallel, context_parallel, expert_parallel.tp_dp_cp),
      experts(name + ".experts", config, m, device, ep_first_expert(m, expert_parallel), m.num_experts / expert_parallel.size,
              TensorParallel{nullptr, expert_parallel.tp_rank, expert_parallel.tp_size, false, nullptr}) {
    if (moe.shared_expert_intermediate_size > 0) {
        shared_expert            = std::make_unique<Mlp>(name + ".shared_experts", shared_config, device, tensor_parallel);
        shared_expert->recompute = config.recompute_shared_experts;
        if (moe.shared_expert_gate) {
            shared_gate = parameter_create(name + ".shared_experts.gate_weight", {1, config.hidden_size}, config.params_dtype, device);
            tensor_parallel.replicated(*shared_gate);
        }
    }
}

comm::Communicator & MoELayer::exchange() const { return ep.tp_ep ? *ep.tp_ep : *ep.group; }

void MoELayer::init(uint64_t seed, float std, float output_std) {
    router.init(seed, std);
    experts.init(seed, std, output_std);
    if (shared_expert) shared_expert->init(seed, std, output_std);
    if (shared_gate) parameter_init_normal(*shared_gate, seed, std);   // Megatron's init_method
}

void MoELayer::set_fp8(const Linear::Fp8 & formats) {
    experts.set_fp8(formats);
    if (shared_expert) {
        shared_expert->fc1.set_fp8(formats);
        shared_expert->fc2.set_fp8(formats);
    }
}

void MoELayer::set_fp8_delayed(Fp8DelayedMetas & metas) {
    experts.set_fp8_delayed(metas);
    if (shared_expert) {
        shared_expert->fc1.set_fp8_delayed(metas);
        shared_expert->fc2.set_fp8_delayed(metas);
    }
}

void MoELayer::parameters(std::vector<Parameter *> & out) {
    router.parameters(out);
    experts.parameters(out);
    if (shared_expert) shared_expert->parameters(out);
    if (shared_gate) out.push_back(&*shared_gate);
}

Tensor MoELayer::forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, bool training) {
    LOOM_CHECK(x.dim() == 2 && x.size(0) == s * b && x.dtype() == DType::f32,
               "MoE input " << x.describe() << ", expected (" << s * b << ", h) float32 rows", "");
    forward_router(ctx, x, b, training, true);
    return forward_experts(ctx, x);
}

void MoELayer::forward_router(Context & ctx, const Tensor & x, int64_t b, bool training, bool with_plan) {
    router.forward(ctx.router, x, b, training);
    if (with_plan) ctx.plan = dispatch_plan_create(ctx.router.top_idx, ctx.router.probs, moe);
}

Tensor MoELayer::forward_experts(Context & ctx, const Tensor & x) {
    Tensor y = ep.exchange_size() == 1                    ? local_forward(ctx, x)
               : moe.dispatcher == MoeDispatcher::alltoall ? alltoall_forward(ctx, x)
                                                           : allgather_forward(ctx, x);
    if (!shared_expert) return y;
    Ops &        ops    = x.device().ops();
    Stream &     stream = x.device().compute_stream();
    const Tensor m      = shared_expert->forward(ctx.shared, x);
    if (!shared_gate) {
        ops.add_inplace(stream, y, m);
        return y;
    }
    // y += m sigmoid(x w): the logits one GEMM (n, h) x (h, 1), then the rows scaled.
    const int64_t n = x.size(0);
    ctx.shared_x      = x;
    ctx.shared_m      = m;
    ctx.shared_logits = activation(x.device(), n, 1, DType::f32);
    ops.gemm(stream, x, false, parameter_f32(*shared_gate), true, ctx.shared_logits);
    const Tensor gated = activation(x.device(), n, x.size(1), DType::f32);
    ops.copy(stream, m, gated);
    ops.sigmoid_gate_forward(stream, gated, ctx.shared_logits.view({n}));
    ops.add_inplace(stream, y, gated);
    return y;
}

std::vector<Tensor> MoELayer::router_outputs(const Context & ctx, const Tensor & x) const {
    return {x, ctx.router.top_idx, ctx.router.probs, ctx.plan.probs, ctx.plan.row_of, ctx.plan.token_of_row,
            ctx.plan.tokens_per_expert};
}

Tensor MoELayer::forward_experts_from(Context & ctx, const std::vector<Tensor> & outputs) {
    LOOM_CHECK(outputs.size() == 7, "the MoE router segment's " << outputs.size() << " outputs, expected 7", "");
    const Tensor & x = outputs[0];
    const Tensor & top_idx = outputs[1];
    const Tensor & probs   = outputs[2];
    if (!outputs[3].defined()) {
        ctx.plan = dispatch_plan_create(top_idx, probs, moe);
    } else if (!ctx.plan.probs.shares_storage(outputs[3])) {
        // Made by the router segment under another context: the scalars follow from the shapes.
        DispatchPlan plan      = dispatch_plan_shape(top_idx.size(0), top_idx.size(1), moe);
        plan.probs             = outputs[3];
        plan.row_of            = outputs[4];
        plan.token_of_row      = outputs[5];
        plan.tokens_per_expert = outputs[6];
        ctx.plan               = plan;
    }
    return forward_experts(ctx, x);
}

std::vector<Tensor> MoELayer::backward_experts_to(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Tensor dx, dprobs;
    backward_experts(ctx, dy, ready, dx, dprobs);
    return {dx, dprobs};
}

Tensor MoELayer::backward_router_from(Context & ctx, const std::vector<Tensor> & grads, const GradReadyFn & ready) {
    LOOM_CHECK(grads.size() == 2, "the MoE router segment's " << grads.size() << " gradients, expected 2", "");
    return backward_router(ctx, grads[0], grads[1], ready);
}

std::vector<std::vector<int64_t>> MoELayer::router_grad_shapes(int64_t rows) const {
    return {{rows, shared_config.hidden_size}, {rows, moe.topk}};
}

Tensor MoELayer::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Tensor dx, dprobs;
    backward_experts(ctx, dy, ready, dx, dprobs);
    return backward_router(ctx, dx, dprobs, ready);
}

void MoELayer::backward_experts(Context & ctx, const Tensor & dy, const GradReadyFn & ready, Tensor & dx, Tensor & dprobs) {
    Ops &    ops    = dy.device().ops();
    Stream & stream = dy.device().compute_stream();
    // Aux-loss-free balancing counts this micro-batch's routing here: a backward runs once per training
    // micro-batch, a forward also when recomputed or evaluating.
    if (router.expert_load.defined()) ops.moe_count_tokens(stream, ctx.plan.tokens_per_expert, router.expert_load);
    dx = ep.exchange_size() == 1                    ? local_backward(ctx, dy, dprobs, ready)
         : moe.dispatcher == MoeDispatcher::alltoall ? alltoall_backward(ctx, dy, dprobs, ready)
                                                     : allgather_backward(ctx, dy, dprobs, ready);
    if (shared_expert && !shared_gate) ops.add_inplace(stream, dx, shared_expert->backward(ctx.shared, dy, ready));
    if (shared_gate) {   // dm = dy s, d logits = rowsum(dy m) s (1 - s); dx += dlogits w, dw += dlogits^T x
        const int64_t n = dy.size(0);
        const Tensor  dm = activation(dy.device(), n, dy.size(1), DType::f32), dlogits = activation(dy.device(), n, 1, DType::f32);
        ops.sigmoid_gate_backward(stream, dy, ctx.shared_m, ctx.shared_logits.view({n}), dm, dlogits.view({n}));
        ops.add_inplace(stream, dx, shared_expert->backward(ctx.shared, dm, ready));
        ops.gemm(stream, dlogits, false, parameter_f32(*shared_gate), false, dx, /*accumulate=*/true);
        accumulate_grads(stream, {shared_gate->main_grad}, [&](std::span<const Tensor> g) {
            ops.gemm(stream, dlogits, true, ctx.shared_x, false, g[0], /*accumulate=*/true);
        });
        if (ready) ready(*shared_gate);
        ctx.shared_x = ctx.shared_m = ctx.shared_logits = Tensor();
    }
    ctx.plan     = DispatchPlan();
    ctx.gathered = DispatchPlan();
    ctx.yp       = Tensor();
}

Tensor MoELayer::backward_router(Context & ctx, const Tensor & dx, const Tensor & dprobs, const GradReadyFn & ready) {
    dx.device().ops().add_inplace(dx.device().compute_stream(), dx,
                                  router.backward(ctx.router, dprobs, aux_loss_backward_scale, ready));
    ctx.plan = DispatchPlan();
    return dx;
}

void MoELayer::experts_ready(const GradReadyFn & ready) {
    if (!ready) return;
    std::vector<Parameter *> params;
    experts.parameters(params);
    for (Parameter * p : params) ready(*p);
}

// ---------------------------------------------------------------------------------------------------
// One rank

Tensor MoELayer::local_forward(Context & ctx, const Tensor & x) {
    std::vector<int64_t> counts = dispatch_plan_counts(ctx.plan);
    ctx.rows                    = 0;
    for (int64_t c : counts) ctx.rows += c;
    if (ctx.rows == 0) {   // every token dropped
        Tensor y = activation(x.device(), x.size(0), x.size(1));
        x.device().ops().fill_zero(x.device().compute_stream(), y);
        return y;
    }
    Tensor xp = moe_permute(x, ctx.plan, ctx.rows);
    ctx.yp    = experts.forward(ctx.experts, xp, counts);
    return moe_unpermute(ctx.yp, ctx.plan);
}

Tensor MoELayer::local_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready) {
    Ops &    ops    = dy.device().ops();
    Stream & stream = dy.device().compute_stream();
    if (ctx.rows == 0) {
        Tensor dx = activation(dy.device(), dy.size(0), dy.size(1));
        dprobs    = activation(dy.device(), ctx.plan.n, ctx.plan.k);
        ops.fill_zero(stream, dx);
        ops.fill_zero(stream, dprobs);
        experts_ready(ready);
        return dx;
    }
    Tensor dyp;
    moe_unpermute_backward(dy, ctx.yp, ctx.plan, dyp, dprobs);
    ctx.yp     = Tensor();
    Tensor dxp = experts.backward(ctx.experts, dyp, ready);
    return moe_permute_backward(dxp, ctx.plan);
}

// ---------------------------------------------------------------------------------------------------
// alltoall

Tensor MoELayer::alltoall_forward(Context & ctx, const Tensor & x) {
    Device &      device = x.device();
    Stream &      stream = device.compute_stream();
    const int     P = ep.size, T = ep.tp_size, X = ep.exchange_size();
    const int64_t E = moe.num_experts, L = E / P, h = x.size(1);
    std::vector<int64_t> counts = dispatch_plan_counts(ctx.plan);   // (E) rows for every global expert
    ctx.rows = 0;
    ctx.send_rows.assign(P, 0);   // rows for each EP rank's experts (sent to each of its T ETP ranks)
    for (int64_t e = 0; e < E; ++e) {
        ctx.rows += counts[e];
        ctx.send_rows[e / L] += counts[e];
    }
    // Each exchange rank's counts for my experts: recv[d L + j] rows from rank d for local expert j.
    Tensor                     recv_counts = Tensor::empty({X * L}, DType::i64, device, {MemoryKind::device, kActivationsPool});
    const std::vector<int64_t> per_rank(X, L);
    exchange().all_to_all(replicate_blocks(ctx.plan.tokens_per_expert.view({E, 1}), std::vector<int64_t>(P, L), T),
                          per_rank, recv_counts, per_rank, &stream)->wait();
    const std::vector<int64_t> recv = read_counts(recv_counts);
    ctx.recv_rows.assign(X, 0);
    ctx.local_counts.assign(L, 0);
    for (int d = 0; d < X; ++d) {
        for (int64_t j = 0; j < L; ++j) {
            ctx.recv_rows[d] += recv[d * L + j];
            ctx.local_counts[j] += recv[d * L + j];
        }
    }
    ctx.local_rows = 0;
    for (int64_t c : ctx.local_counts) ctx.local_rows += c;
    // Received rows are [source d][local expert j]; the experts want [j][d].
    ctx.sort.clear();
    ctx.unsort.assign(ctx.local_rows, 0);
    for (int64_t j = 0; j < L; ++j) {
        int64_t offset = 0;
        for (int d = 0; d < X; ++d) {
            int64_t begin = offset;
            for (int64_t i = 0; i < j; ++i) begin += recv[d * L + i];
            for (int64_t r = 0; r < recv[d * L + j]; ++r) {
                ctx.unsort[begin + r] = static_cast<int32_t>(ctx.sort.size());
                ctx.sort.push_back(static_cast<int32_t>(begin + r));
            }
            offset += ctx.recv_rows[d];
        }
    }
    const std::vector<int64_t> send_each = exchange_rows(ctx.send_rows);
    Tensor xp = ctx.rows > 0 ? moe_permute(x, ctx.plan, ctx.rows) : rows_buffer(device, 0, h);
    Tensor xr = rows_buffer(device, ctx.local_rows, h);
    exchange().all_to_all(replicate_blocks(xp, ctx.send_rows, T), times(send_each, h), xr, times(ctx.recv_rows, h), &stream);
    Tensor yr = rows_buffer(device, ctx.local_rows, h);
    if (ctx.local_rows > 0) {
        Tensor ys = experts.forward(ctx.experts, moe_gather_rows(xr, ctx.sort), ctx.local_counts);
        yr        = moe_gather_rows(ys, ctx.unsort);
    }
    // ETP: every EP rank's T ranks send back their partial sums of each row; they add up here.
    Tensor yb = rows_buffer(device, T * ctx.rows, h);
    exchange().all_to_all(yr, times(ctx.recv_rows, h), yb, times(send_each, h), &stream);
    if (ctx.rows == 0) {   // every local token dropped
        Tensor y = activation(device, x.size(0), h);
        device.ops().fill_zero(stream, y);
        return y;
    }
    ctx.yp = sum_blocks(yb, ctx.send_rows, T).narrow(0, 0, ctx.rows);
    return moe_unpermute(ctx.yp, ctx.plan);
}

Tensor MoELayer::alltoall_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready) {
    Device &      device = dy.device();
    Stream &      stream = device.compute_stream();
    const int64_t h = dy.size(1), T = ep.tp_size;
    Tensor        dyp = rows_buffer(device, ctx.rows, h);
    if (ctx.rows > 0) {
        moe_unpermute_backward(dy, ctx.yp, ctx.plan, dyp, dprobs);
    } else {
        dprobs = activation(device, ctx.plan.n, ctx.plan.k);
        device.ops().fill_zero(stream, dprobs);
    }
    ctx.yp     = Tensor();
    const std::vector<int64_t> send_each = exchange_rows(ctx.send_rows);
    Tensor dyr = rows_buffer(device, ctx.local_rows, h);
    exchange().all_to_all(replicate_blocks(dyp, ctx.send_rows, T), times(send_each, h), dyr, times(ctx.recv_rows, h), &stream);
    Tensor dxr = rows_buffer(device, ctx.local_rows, h);
    if (ctx.local_rows > 0) {
        Tensor dxs = experts.backward(ctx.experts, moe_gather_rows(dyr, ctx.sort), ready);
        dxr        = moe_gather_rows(dxs, ctx.unsort);
    } else {
        experts_ready(ready);
    }
    Tensor dxb = rows_buffer(device, T * ctx.rows, h);
    exchange().all_to_all(dxr, times(ctx.recv_rows, h), dxb, times(send_each, h), &stream);
    if (ctx.rows == 0) {
        Tensor dx = activation(device, dy.size(0), h);
        device.ops().fill_zero(stream, dx);
        return dx;
    }
    return moe_permute_backward(sum_blocks(dxb, ctx.send_rows, T).narrow(0, 0, ctx.rows), ctx.plan);
}

std::vector<int64_t> MoELayer::exchange_rows(const std::vector<int64_t> & per_ep_rank) const {
    std::vector<int64_t> out;
    for (int64_t r : per_ep_rank) out.insert(out.end(), static_cast<size_t>(ep.tp_size), r);
    return out;
}

// ---------------------------------------------------------------------------------------------------
// allgather

Tensor MoELayer::allgather_forward(Context & ctx, const Tensor & x) {
    Device &      device = x.device();
    Stream &      stream = device.compute_stream();
    const int     P = ep.exchange_size();   // the ETP x EP ranks: every one's tokens
    const int64_t n = x.size(0), h = x.size(1), k = ctx.plan.k, L = moe.num_experts / ep.size;
    Tensor routed     = dispatch_plan_routed(ctx.plan);
    Tensor routed_all = Tensor::empty({P * n, k}, DType::i32, device, {MemoryKind::device, kActivationsPool});
    Tensor probs_all  = activation(device, P * n, k);
    Tensor x_all      = activation(device, P * n, h);
    exchange().all_gather(routed, routed_all, &stream);
    exchange().all_gather(ctx.plan.probs, probs_all, &stream);
    exchange().all_gather(x, x_all, &stream);
    ctx.gathered             = dispatch_plan_local(routed_all, probs_all, experts.first_expert, L);
    ctx.local_counts         = dispatch_plan_counts(ctx.gathered);
    ctx.local_rows           = 0;
    for (int64_t c : ctx.local_counts) ctx.local_rows += c;
    Tensor y_all;
    if (ctx.local_rows > 0) {
        Tensor xp = moe_permute(x_all, ctx.gathered, ctx.local_rows);
        ctx.yp    = experts.forward(ctx.experts, xp, ctx.local_counts);
        y_all     = moe_unpermute(ctx.yp, ctx.gathered);
    } else {
        y_all = activation(device, P * n, h);
        device.ops().fill_zero(stream, y_all);
    }
    Tensor y = activation(device, n, h);
    exchange().reduce_scatter(y_all, y, comm::ReduceOp::sum, &stream);
    return y;
}

Tensor MoELayer::allgather_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready) {
    Device &      device = dy.device();
    Stream &      stream = device.compute_stream();
    const int     P = ep.exchange_size();
    const int64_t n = dy.size(0), h = dy.size(1), k = ctx.plan.k;
    Tensor        dy_all = activation(device, P * n, h);
    exchange().all_gather(dy, dy_all, &stream);
    Tensor dx_all, dprobs_all;
    if (ctx.local_rows > 0) {
        Tensor dyp;
        moe_unpermute_backward(dy_all, ctx.yp, ctx.gathered, dyp, dprobs_all);
        ctx.yp     = Tensor();
        Tensor dxp = experts.backward(ctx.experts, dyp, ready);
        dx_all     = moe_permute_backward(dxp, ctx.gathered);
    } else {
        dx_all     = activation(device, P * n, h);
        dprobs_all = activation(device, P * n, k);
        device.ops().fill_zero(stream, dx_all);
        device.ops().fill_zero(stream, dprobs_all);
        experts_ready(ready);
    }
    Tensor dx = activation(device, n, h);
    dprobs    = activation(device, n, k);
    exchange().reduce_scatter(dx_all, dx, comm::ReduceOp::sum, &stream);
    exchange().reduce_scatter(dprobs_all, dprobs, comm::ReduceOp::sum, &stream);
    return dx;
}

}  // namespace loom::model
