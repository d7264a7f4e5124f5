#include "model/moe/router.h"

#include "core/error.h"
#include "core/ops.h"
#include "model/layers.h"


namespace loom::model {

namespace {

MoeRouting routing_of(const MoeConfig & moe) {
    MoeRouting r;
    r.experts = moe.num_experts;
    r.topk    = moe.topk;
    if (moe.load_balancing == MoeLoadBalancing::sinkhorn) {
        // Megatron's sinkhorn scores: sigmoid(logit) for k = 1, else the softmax over all E, unscaled; the
        // selection (while training) is sinkhorn's, in eval the scores' own top-k.
        r.sigmoid     = moe.topk == 1;
        r.pre_softmax = moe.topk > 1;
        return r;
    }
    r.sigmoid     = moe.score_function == MoeScoreFunction::sigmoid;
    r.pre_softmax = moe.pre_softmax;
    r.scaling     = moe.topk_scaling_factor > 0.0f ? moe.topk_scaling_factor : 1.0f;
    r.num_groups  = moe.num_groups;
    r.group_topk  = moe.group_topk;
    return r;
}

}  // namespace

Router::Router(const std::string & name, const GptConfig & config, const MoeConfig & m, Device & device,
               const TensorParallel & tensor_parallel, const ContextParallel & context_parallel,
               std::shared_ptr<comm::Communicator> global_group)
    : moe(m),
      tp(tensor_parallel),
      cp(context_parallel),
      global(std::move(global_group)),
      weight(parameter_create(name + ".weight", {m.num_experts, config.hidden_size}, config.params_dtype, device)),
      has_bias(config.add_bias_linear) {
    moe_config_validate(moe, config);
    require_supported(device, {"moe_topk", 0, m.topk}, "--moe-router-topk");
    if (m.load_balancing == MoeLoadBalancing::sinkhorn) {
        require_supported(device, {"moe_sinkhorn_topk", 0, m.topk}, "--moe-router-load-balancing-type sinkhorn");
    }
    tp.replicated(weight);   // every TP rank routes its own rows with the whole gate
    if (m.load_balancing == MoeLoadBalancing::global_aux_loss) {
        global_counts = Tensor::zeros({1, m.num_experts}, DType::f32, device, {MemoryKind::device, "moe-metrics"});
        global_steps  = Tensor::zeros({1}, DType::f32, device, {MemoryKind::device, "moe-metrics"});
        one_          = Tensor::empty({1}, DType::f32, device, {MemoryKind::device, "moe-metrics"});
        write_values_f32(one_, std::vector<float>{1.0f});
    }
    if (m.expert_bias) {   // replaced by views of the model's (layers, E) tensors (GptModel), zero either way
        expert_bias = Tensor::zeros({m.num_experts}, DType::f32, device, {MemoryKind::device, "moe-expert-bias"});
        expert_load = Tensor::zeros({m.num_experts}, DType::f32, device, {MemoryKind::device, "moe-expert-bias"});
    }
    if (has_bias) {
        bias                 = parameter_create(name + ".bias", {m.num_experts}, config.params_dtype, device);
        bias.no_weight_decay = true;
        tp.replicated(bias);
    }
}

void Router::init(uint64_t seed, float std) {
    // Megatron initialises the gate's weight and its bias with the model's init method.
    parameter_init_normal(weight, seed, std);
    if (has_bias) parameter_init_normal(bias, seed, std);
}

void Router::parameters(std::vector<Parameter *> & out) {
    out.push_back(&weight);
    if (has_bias) out.push_back(&bias);
}

// The gate's weight as its GEMMs read it: the parameter, or with --moe-router-dtype its values in f32 or f64.
Tensor Router::gate_weight() const {
    if (!moe.router_dtype) return weight.data;
    const Tensor f32 = parameter_f32(weight);
    return *moe.router_dtype == DType::f64 ? in_dtype(f32, DType::f64) : f32;
}

void Router::forward(Context & ctx, const Tensor & x, int64_t b, bool training) {
    Ops &    ops    = x.device().ops();
    Stream & stream = x.device().compute_stream();
    const Tensor w  = gate_weight();
    ctx.x           = in_dtype(x, w.dtype());
    Tensor logits   = Tensor::empty({x.size(0), moe.num_experts}, w.dtype() == DType::f64 ? DType::f64 : DType::f32,
                                    x.device(), {MemoryKind::device, kActivationsPool});
    ops.gemm(stream, ctx.x, false, w, true, logits);
    if (has_bias) ops.bias_add(stream, logits, in_dtype(parameter_f32(bias), logits.dtype()));
    route(ctx, logits, b, training);
}

void Router::route(Context & ctx, const Tensor & logits, int64_t b, bool training) {
    const int64_t n = logits.size(0), E = moe.num_experts, k = moe.topk;
    LOOM_CHECK(logits.dim() == 2 && logits.size(1) == E && (logits.dtype() == DType::f32 || logits.dtype() == DType::f64),
               "router logits " << logits.describe() << ", expected (n, " << E << ") float32 or float64", "");
    Device & device = logits.device();
    Ops &    ops    = device.ops();
    Stream & stream = device.compute_stream();
    ctx.aux         = training && moe.aux_loss_coeff > 0.0f && moe.load_balancing != MoeLoadBalancing::none &&
              moe.load_balancing != MoeLoadBalancing::sinkhorn;
    ctx.z           = training && moe.z_loss_coeff > 0.0f;
    ctx.groups      = moe.load_balancing == MoeLoadBalancing::seq_aux_loss ? b : 1;
    LOOM_CHECK(b >= 1 && n % b == 0, n << " router rows are not a multiple of the micro-batch size " << b, "");
    ctx.logits  = logits;
    ctx.top_idx = Tensor::empty({n, k}, DType::i32, device, {MemoryKind::device, kActivationsPool});
    ctx.probs   = activation(device, n, k);
    ctx.counts  = activation(device, ctx.groups, E);
    ctx.losses  = Tensor::empty({router_loss_count}, DType::f32, device, {MemoryKind::device, kActivationsPool});

    const MoeRouting routing = routing_of(moe);
    if (moe.load_balancing == MoeLoadBalancing::sinkhorn && training) {
        // Sinkhorn balances over every row of the micro-batch: under sequence (and context) parallelism the
        // rows of every rank holding part of it, gathered, so each rank selects as the single-rank run does
        // (to the rounding of the balancing sums, taken in the gathered order).
        comm::Communicator * group = sequence_group();
        Tensor               all   = logits;
        if (group) {
            all = Tensor::empty({n * group->size(), E}, logits.dtype(), device, {MemoryKind::device, kActivationsPool});
            group->all_gather(logits, all, &stream);
        }
        ops.moe_sinkhorn_topk(stream, all, group ? group->rank() * n : 0, routing, ctx.top_idx, ctx.probs);
    } else {
        // Sinkhorn's scores select without the expert bias (Megatron's sinkhorn routing ignores it), in eval too.
        const bool biased = moe.load_balancing != MoeLoadBalancing::sinkhorn;
        ops.moe_topk(stream, logits, routing, biased ? expert_bias : Tensor(), ctx.top_idx, ctx.probs);
    }
    // The counts are written on the stream even without the aux loss, so a captured graph's replay clears
    // them too; sequence parallelism sums them over the whole sequence (Megatron reduces them over TP x CP).
    if (ctx.aux && moe.load_balancing == MoeLoadBalancing::global_aux_loss) {
        // Summed over every TP x DP x CP rank, added to the iteration's sum, and the mean over its
        // micro-batches so far is what the loss reads (Megatron's global_tokens_per_expert / ga_steps).
        ops.moe_aux_counts(stream, logits, routing, 1, ctx.counts);
        if (global) global->all_reduce(ctx.counts, comm::ReduceOp::sum, &stream);
        // The micro-batch count is kept on the stream, so that a replayed graph of the router counts too.
        ops.add_inplace(stream, global_counts, ctx.counts);
        ops.add_inplace(stream, global_steps, one_);
        ops.copy(stream, global_counts, ctx.counts);
        ops.scale_by_reciprocal(stream, ctx.counts, global_steps);
    } else if (ctx.aux) {
        ops.moe_aux_counts(stream, logits, routing, ctx.groups, ctx.counts);
        if (comm::Communicator * group = sequence_group()) group->all_reduce(ctx.counts, comm::ReduceOp::sum, &stream);
    } else {
        ops.fill_zero(stream, ctx.counts);
    }
    ops.moe_router_losses(stream, logits, ctx.counts, routing, loss_of(ctx, n), ctx.losses);
}

MoeRouterLoss Router::loss_of(const Context & ctx, int64_t n) const {
    MoeRouterLoss loss;
    loss.groups    = ctx.groups;
    // The sequence's rows over the TP (and CP) ranks; global_aux_loss: every TP x DP x CP rank's rows.
    loss.tokens    = moe.load_balancing == MoeLoadBalancing::global_aux_loss ? n * (global ? global->size() : 1)
                                                                              : n * sequence_ranks();
    loss.aux_coeff = ctx.aux ? moe.aux_loss_coeff : 0.0f;
    loss.z_coeff   = ctx.z ? moe.z_loss_coeff : 0.0f;
    return loss;
}

void Router::reset_global_counts() {
    if (!global_counts.defined()) return;
    global_counts.device().ops().fill_zero(global_counts.device().compute_stream(), global_counts);
    global_counts.device().ops().fill_zero(global_counts.device().compute_stream(), global_steps);
}

comm::Communicator * Router::sequence_group() const {
    if (cp.enabled()) return tp.sp() ? cp.tp_cp.get() : cp.group.get();
    return tp.sp() ? tp.group.get() : nullptr;
}

int Router::sequence_ranks() const { return (tp.sp() ? tp.size : 1) * cp.size; }

Tensor Router::logits_backward(Context & ctx, const Tensor & dprobs, float loss_scale) {
    const int64_t n = ctx.logits.size(0);
    Device &      device  = dprobs.device();
    Tensor        dlogits = Tensor::empty({n, moe.num_experts}, ctx.logits.dtype(), device,
                                          {MemoryKind::device, kActivationsPool});
    device.ops().moe_router_backward(device.compute_stream(), ctx.logits, ctx.top_idx, dprobs, ctx.counts,
                                     routing_of(moe), loss_of(ctx, n), loss_scale, dlogits);
    return dlogits;
}

Tensor Router::backward(Context & ctx, const Tensor & dprobs, float loss_scale, const GradReadyFn & ready) {
    Tensor   dlogits = logits_backward(ctx, dprobs, loss_scale);
    Ops &    ops     = dlogits.device().ops();
    Stream & stream  = dlogits.device().compute_stream();
    if (has_bias && dlogits.dtype() == DType::f64) {   // summed in f64, rounded to f32 once
        Tensor db64 = Tensor::empty({moe.num_experts}, DType::f64, dlogits.device(), {MemoryKind::device, kActivationsPool});
        ops.fill_zero(stream, db64);
        ops.bias_backward(stream, dlogits, db64);
        const Tensor db = in_dtype(db64, DType::f32);
        accumulate_grads(stream, {bias.main_grad.view({moe.num_experts})},
                         [&](std::span<const Tensor> g) { ops.add_inplace(stream, g[0], db); });
    } else if (has_bias) {
        accumulate_grads(stream, {bias.main_grad},
                         [&](std::span<const Tensor> g) { ops.bias_backward(stream, dlogits, g[0]); });
    }
    const Tensor w     = gate_weight();
    Tensor       dl_in = in_dtype(dlogits, w.dtype());
    Tensor       dx;
    if (w.dtype() == DType::f64) {   // f64 products, each gradient rounded to f32 once
        const int64_t n = dlogits.size(0), h = weight.data.size(1), E = moe.num_experts;
        Tensor dx64 = Tensor::empty({n, h}, DType::f64, dlogits.device(), {MemoryKind::device, kActivationsPool});
        Tensor dw64 = Tensor::empty({E, h}, DType::f64, dlogits.device(), {MemoryKind::device, kActivationsPool});
        ops.gemm(stream, dl_in, false, w, false, dx64);
        ops.gemm(stream, dl_in, true, ctx.x, false, dw64);
        dx               = in_dtype(dx64, DType::f32);
        const Tensor dw = in_dtype(dw64, DType::f32);
        accumulate_grads(stream, {weight.main_grad}, [&](std::span<const Tensor> g) { ops.add_inplace(stream, g[0], dw); });
    } else {
        dx = activation(dlogits.device(), dlogits.size(0), weight.data.size(1));
        ops.gemm(stream, dl_in, false, w, false, dx);
        accumulate_grads(stream, {weight.main_grad}, [&](std::span<const Tensor> g) {
            ops.gemm(stream, dl_in, true, ctx.x, false, g[0], /*accumulate=*/true);
        });
    }
    Tensor losses = ctx.losses;   // still readable for logging
    ctx           = Context();
    ctx.losses    = losses;
    if (ready) {
        ready(weight);
        if (has_bias) ready(bias);
    }
    return dx;
}

}  // namespace loom::model
