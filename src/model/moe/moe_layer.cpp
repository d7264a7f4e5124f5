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

}  // namespace

MoELayer::MoELayer(const std::string & name, const GptConfig & config, const MoeConfig & m, Device & device)
    : moe(m),
      shared_config(shared_expert_config(config, m)),
      router(name + ".router", config, m, device),
      experts(name + ".experts", config, m, device) {
    if (moe.shared_expert_intermediate_size > 0) {
        shared_expert = std::make_unique<Mlp>(name + ".shared_experts", shared_config, device);
    }
}

void MoELayer::init(uint64_t seed, float std, float output_std) {
    router.init(seed, std);
    experts.init(seed, std, output_std);
    if (shared_expert) shared_expert->init(seed, std, output_std);
}

void MoELayer::parameters(std::vector<Parameter *> & out) {
    router.parameters(out);
    experts.parameters(out);
    if (shared_expert) shared_expert->parameters(out);
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
    Ops &    ops    = x.device().ops();
    Stream & stream = x.device().compute_stream();
    std::vector<int64_t> counts = dispatch_plan_counts(ctx.plan);
    ctx.rows                    = 0;
    for (int64_t c : counts) ctx.rows += c;
    Tensor y;
    if (ctx.rows > 0) {
        Tensor xp = moe_permute(x, ctx.plan, ctx.rows);
        ctx.yp    = experts.forward(ctx.experts, xp, counts);
        y         = moe_unpermute(ctx.yp, ctx.plan);
    } else {   // every token dropped
        y = activation(x.device(), x.size(0), x.size(1));
        ops.fill_zero(stream, y);
    }
    if (shared_expert) ops.add_inplace(stream, y, shared_expert->forward(ctx.shared, x));
    return y;
}

Tensor MoELayer::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Tensor dx, dprobs;
    backward_experts(ctx, dy, ready, dx, dprobs);
    return backward_router(ctx, dx, dprobs, ready);
}

void MoELayer::backward_experts(Context & ctx, const Tensor & dy, const GradReadyFn & ready, Tensor & dx, Tensor & dprobs) {
    Ops &    ops    = dy.device().ops();
    Stream & stream = dy.device().compute_stream();
    if (ctx.rows > 0) {
        Tensor dyp;
        moe_unpermute_backward(dy, ctx.yp, ctx.plan, dyp, dprobs);
        ctx.yp     = Tensor();
        Tensor dxp = experts.backward(ctx.experts, dyp, ready);
        dx         = moe_permute_backward(dxp, ctx.plan);
    } else {
        dx     = activation(dy.device(), dy.size(0), dy.size(1));
        dprobs = activation(dy.device(), ctx.plan.n, ctx.plan.k);
        ops.fill_zero(stream, dx);
        ops.fill_zero(stream, dprobs);
        std::vector<Parameter *> params;
        experts.parameters(params);
        if (ready) {
            for (Parameter * p : params) ready(*p);
        }
    }
    if (shared_expert) ops.add_inplace(stream, dx, shared_expert->backward(ctx.shared, dy, ready));
    ctx.plan = DispatchPlan();
}

Tensor MoELayer::backward_router(Context & ctx, const Tensor & dx, const Tensor & dprobs, const GradReadyFn & ready) {
    dx.device().ops().add_inplace(dx.device().compute_stream(), dx,
                                  router.backward(ctx.router, dprobs, aux_loss_backward_scale, ready));
    ctx.plan = DispatchPlan();
    return dx;
}

}  // namespace loom::model
