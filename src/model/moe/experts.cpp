#include "model/moe/experts.h"

#include "core/error.h"
#include "core/ops.h"

#include <algorithm>

namespace loom::model {

namespace {

GptConfig with_ffn(const GptConfig & config, int64_t ffn) {
    GptConfig c       = config;
    c.ffn_hidden_size = ffn;
    return c;
}

// Expert e's (rows, cols) slice of an (E, rows, cols) or (E, rows) tensor.
Tensor expert_slice(const Tensor & t, int64_t e, const Shape & shape) {
    return t.slice(e * shape_numel(shape), shape);
}

}  // namespace

Experts::Experts(const std::string & n, const GptConfig & config, const MoeConfig & moe, Device & device, int64_t first,
                 int64_t count, const TensorParallel & etp)
    : expert_config(with_ffn(config, moe.expert_ffn(config))),
      num_experts(count < 0 ? moe.num_experts : count),
      first_expert(first),
      ffn(moe.expert_ffn(config) / std::max(etp.size, 1)),
      shard(etp),
      grouped(moe.grouped_gemm),
      name(n) {
    const int64_t h = config.hidden_size, f1 = config.swiglu ? 2 * ffn : ffn;
    const DType   dtype = config.params_dtype;
    LOOM_CHECK(first >= 0 && num_experts >= 1 && first + num_experts <= moe.num_experts,
               "experts [" << first << ", " << first + num_experts << ") of " << moe.num_experts, "");
    LOOM_CHECK(!shard.group && shard.size >= 1 && shard.rank >= 0 && shard.rank < shard.size,
               "expert-tensor-parallel rank " << shard.rank << " of " << shard.size, "");
    LOOM_CHECK(moe.expert_ffn(config) % shard.size == 0,
               "the experts' hidden size " << moe.expert_ffn(config) << " (--moe-ffn-hidden-size, or --ffn-hidden-size) "
                                           << "is not divisible by --expert-tensor-parallel-size " << shard.size, "");
    LOOM_CHECK(shard.size == 1 || !config.add_bias_linear,
               "--expert-tensor-parallel-size " << shard.size << " with biases in the experts", "pass --disable-bias-linear");
    const bool sliced = num_experts < moe.num_experts;
    // A grouped tensor holding experts [first, first + L) of the full (E, ...) one.
    auto slice_of_full = [&](Parameter & p) {
        if (!sliced) return;
        Shape full = p.data.shape();
        full[0]    = moe.num_experts;
        p.tp_slice = TpSlice{0, {{first, first + num_experts}}, full};
    };
    if (grouped) {
        fc1_weight = parameter_create(name + ".fc1.weight", {num_experts, f1, h}, dtype, device);
        fc2_weight = parameter_create(name + ".fc2.weight", {num_experts, h, ffn}, dtype, device);
        if (config.add_bias_linear) {
            fc1_bias = parameter_create(name + ".fc1.bias", {num_experts, f1}, dtype, device);
            fc2_bias = parameter_create(name + ".fc2.bias", {num_experts, h}, dtype, device);
            fc1_bias.no_weight_decay = fc2_bias.no_weight_decay = true;
            slice_of_full(fc1_bias);
            slice_of_full(fc2_bias);
        }
        if (shard.size == 1) {
            slice_of_full(fc1_weight);
            slice_of_full(fc2_weight);
        } else {   // this ETP rank's features of each held expert (and with EP, of its experts only)
            const int64_t                      F = moe.expert_ffn(config), r = shard.rank;
            const std::pair<int64_t, int64_t> held = sliced ? std::pair{first, first + num_experts} : std::pair<int64_t, int64_t>{0, -1};
            fc1_weight.tp_slice = TpSlice{1, etp_rows(F, r), {moe.num_experts, config.swiglu ? 2 * F : F, h}, held};
            fc2_weight.tp_slice = TpSlice{2, {{r * ffn, (r + 1) * ffn}}, {moe.num_experts, h, F}, held};
        }
    } else {
        for (int64_t e = 0; e < num_experts; ++e) {
            local.push_back(std::make_unique<Mlp>(name + "." + std::to_string(first_expert + e), expert_config, device, shard));
            local.back()->recompute_act = config.recompute_moe_act;
        }
    }
    std::vector<Parameter *> params;
    parameters(params);
    for (Parameter * p : params) p->expert = true;
}

std::vector<std::pair<int64_t, int64_t>> Experts::etp_rows(int64_t F, int64_t r) const {
    std::vector<std::pair<int64_t, int64_t>> rows{{r * ffn, (r + 1) * ffn}};
    if (expert_config.swiglu) rows.push_back({F + r * ffn, F + (r + 1) * ffn});
    return rows;
}

void Experts::init(uint64_t seed, float std, float output_std) {
    if (!grouped) {
        for (auto & mlp : local) mlp->init(seed, std, output_std);
        return;
    }
    const int64_t h = expert_config.hidden_size, f1 = expert_config.swiglu ? 2 * ffn : ffn;
    const int64_t F = ffn * shard.size;   // the whole expert's features
    for (int64_t e = 0; e < num_experts; ++e) {
        const std::string expert = name + "." + std::to_string(first_expert + e);
        Parameter         w1, w2;   // views under the sequential layout's names (its ETP slices with ETP)
        w1.name = expert + ".fc1.weight";
        w1.data = expert_slice(fc1_weight.data, e, {f1, h});
        w2.name = expert + ".fc2.weight";
        w2.data = expert_slice(fc2_weight.data, e, {h, ffn});
        if (shard.size > 1) {
            w1.tp_slice = TpSlice{0, etp_rows(F, shard.rank), {expert_config.swiglu ? 2 * F : F, h}};
            w2.tp_slice = TpSlice{1, {{shard.rank * ffn, (shard.rank + 1) * ffn}}, {h, F}};
        }
        parameter_init_normal(w1, seed, std);
        parameter_init_normal(w2, seed, output_std);
    }
    if (fc1_bias.data.defined()) {
        parameter_init_constant(fc1_bias, 0.0f);
        parameter_init_constant(fc2_bias, 0.0f);
    }
}

void Experts::parameters(std::vector<Parameter *> & out) {
    if (!grouped) {
        for (auto & mlp : local) mlp->parameters(out);
        return;
    }
    out.push_back(&fc1_weight);
    if (fc1_bias.data.defined()) out.push_back(&fc1_bias);
    out.push_back(&fc2_weight);
    if (fc2_bias.data.defined()) out.push_back(&fc2_bias);
}

Tensor Experts::forward(Context & ctx, const Tensor & xp, const std::vector<int64_t> & counts) {
    LOOM_CHECK(static_cast<int64_t>(counts.size()) == num_experts, counts.size() << " expert counts for " << num_experts
                                                                                 << " experts", "");
    int64_t rows = 0;
    for (int64_t c : counts) rows += c;
    LOOM_CHECK(xp.dim() == 2 && xp.size(0) == rows && xp.size(1) == expert_config.hidden_size,
               "expert input " << xp.describe() << ", expected (" << rows << ", " << expert_config.hidden_size << ")", "");
    ctx.counts = counts;
    if (grouped) return grouped_forward(ctx, xp);

    Ops &    ops    = xp.device().ops();
    Stream & stream = xp.device().compute_stream();
    Tensor   yp     = activation(xp.device(), rows, expert_config.hidden_size);
    ctx.mlp.assign(num_experts, {});
    int64_t offset = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (counts[e] == 0) continue;
        Tensor ye = local[e]->forward(ctx.mlp[e], xp.narrow(0, offset, counts[e]));
        ops.copy(stream, ye, yp.narrow(0, offset, counts[e]));
        offset += counts[e];
    }
    return yp;
}

Tensor Experts::backward(Context & ctx, const Tensor & dyp, const GradReadyFn & ready) {
    if (grouped) return grouped_backward(ctx, dyp, ready);
    Ops &    ops    = dyp.device().ops();
    Stream & stream = dyp.device().compute_stream();
    Tensor   dxp    = activation(dyp.device(), dyp.size(0), expert_config.hidden_size);
    int64_t  offset = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        if (ctx.counts[e] == 0) {   // no rows: no gradient, but final all the same
            std::vector<Parameter *> params;
            local[e]->parameters(params);
            if (ready) {
                for (Parameter * p : params) ready(*p);
            }
            continue;
        }
        Tensor dxe = local[e]->backward(ctx.mlp[e], dyp.narrow(0, offset, ctx.counts[e]), ready);
        ops.copy(stream, dxe, dxp.narrow(0, offset, ctx.counts[e]));
        offset += ctx.counts[e];
    }
    ctx = Context();
    return dxp;
}

void Experts::set_fp8(const Linear::Fp8 & formats) {
    fp8 = formats;
    for (const std::unique_ptr<Mlp> & mlp : local) {
        mlp->fc1.set_fp8(formats);
        mlp->fc2.set_fp8(formats);
    }
    if (grouped && formats.param_codes) {   // one scale per expert, as each expert's own weight has
        for (Parameter * w : {&fc1_weight, &fc2_weight}) {
            w->fp8_blocks = num_experts;
            w->fp8_format = formats.forward;
        }
    }
}

void Experts::set_fp8_delayed(Fp8DelayedMetas & metas) {
    const int64_t total = expert_config.moe.num_experts;
    fp8_forward_meta    = metas.forward.get();
    fp8_backward_meta   = metas.backward.get();
    fp8_forward_base    = fp8_forward_meta->add(4 * total);
    fp8_backward_base   = fp8_backward_meta->add(2 * total);
    for (size_t e = 0; e < local.size(); ++e) {
        const int64_t g = first_expert + static_cast<int64_t>(e);
        local[e]->fc1.set_fp8_delayed(metas, fp8_forward_base + 4 * g, fp8_backward_base + 2 * g);
        local[e]->fc2.set_fp8_delayed(metas, fp8_forward_base + 4 * g + 2, fp8_backward_base + 2 * g + 1);
    }
}

Fp8Delayed::Operand Experts::delayed_forward(int64_t e, int k) const {
    return fp8_forward_meta->operand(fp8_forward_base + 4 * (first_expert + e) + k);
}

Fp8Delayed::Operand Experts::delayed_kept(const Context & ctx, int64_t e, int k) const {
    return Fp8Delayed::Operand{ctx.fp8_scales.slice(4 * e + k, {1}), Tensor()};
}

Fp8Delayed::Operand Experts::delayed_backward(int64_t e, int k, bool record) const {
    return fp8_backward_meta->operand(fp8_backward_base + 2 * (first_expert + e) + k, record);
}

Tensor Experts::scale_inv(const Parameter & w, int64_t e) {
    return w.fp8_codes() ? w.fp8_scale_inv.slice(e, {1}) : Tensor();
}

void Experts::gemm(const Tensor & a, Pass pass, bool trans_a, const Tensor & w, bool trans_w, const Tensor & c,
                   const Tensor & w_scale_inv, const Fp8Delayed::Operand * da, const Fp8Delayed::Operand * dw) const {
    if (fp8) {
        fp8_product(a, pass == Pass::forward ? fp8->forward : fp8->backward, trans_a, w, fp8->forward, trans_w, c, w_scale_inv,
                    Fp8Cast{fp8->blockwise, true, fp8->mxfp8}, da, dw);
    } else {
        a.device().ops().gemm(a.device().compute_stream(), a, trans_a, w, trans_w, c);
    }
}

void Experts::weight_grad(const Tensor & dy, const Tensor & x, const Tensor & g, const Fp8Delayed::Operand * ddy,
                          const Fp8Delayed::Operand * dx) const {
    Device & device = dy.device();
    Stream & stream = device.compute_stream();
    if (!fp8) {
        device.ops().gemm(stream, dy, true, x, false, g, /*accumulate=*/true);
        return;
    }
    const Tensor g32 = activation(device, g.size(0), g.size(1), DType::f32);
    fp8_product(dy, fp8->backward, true, x, fp8->forward, false, g32, Tensor(), Fp8Cast{fp8->blockwise, false, fp8->mxfp8}, ddy, dx);
    device.ops().add_inplace(stream, g, g32);
}

// The grouped path does, expert by expert, what Mlp and Linear do (the same kernels on the same shapes),
// except that every expert reads a slice of one weight and the row-wise activation runs once.
Tensor Experts::grouped_forward(Context & ctx, const Tensor & xp) {
    Ops &         ops    = xp.device().ops();
    Stream &      stream = xp.device().compute_stream();
    Device &      device = xp.device();
    const int64_t R = xp.size(0), h = expert_config.hidden_size, f = ffn, f1 = expert_config.swiglu ? 2 * f : f;
    const DType   dtype    = expert_config.params_dtype;
    const bool    has_bias = fc1_bias.data.defined();
    Tensor        b1       = has_bias ? parameter_f32(fc1_bias) : Tensor();
    Tensor        b2       = has_bias ? parameter_f32(fc2_bias) : Tensor();

    ctx.x      = in_dtype(xp, dtype);
    Tensor pre = activation(device, R, f1);
    Tensor act = activation(device, R, f);
    const bool delayed = fp8 && fp8_forward_meta != nullptr;
    if (delayed) ctx.fp8_scales = fp8_forward_meta->snapshot(fp8_forward_base + 4 * first_expert, 4 * num_experts);
    int64_t offset = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t c = ctx.counts[e];
        if (c == 0) continue;
        const Fp8Delayed::Operand dx = delayed ? delayed_forward(e, 0) : Fp8Delayed::Operand{};
        const Fp8Delayed::Operand dw = delayed ? delayed_forward(e, 1) : Fp8Delayed::Operand{};
        gemm(ctx.x.narrow(0, offset, c), Pass::forward, false, expert_slice(fc1_weight.data, e, {f1, h}), true,
             pre.narrow(0, offset, c), scale_inv(fc1_weight, e), delayed ? &dx : nullptr, delayed ? &dw : nullptr);
        offset += c;
    }
    if (expert_config.swiglu || expert_config.squared_relu) {   // the bias, then the activation
        if (has_bias) {
            offset = 0;
            for (int64_t e = 0; e < num_experts; ++e) {
                if (ctx.counts[e] == 0) continue;
                ops.bias_add(stream, pre.narrow(0, offset, ctx.counts[e]), expert_slice(b1, e, {f1}));
                offset += ctx.counts[e];
            }
        }
        ctx.pre_act = keep_for_backward(pre, dtype);
        if (expert_config.swiglu) {
            gated_forward(expert_config, stream, pre, act);
        } else {
            ops.squared_relu_forward(stream, pre, act);
        }
    } else {
        // bf16: the fused op writes the rounded pre-activation; f16: rounded after it (keep_for_backward).
        ctx.pre_act = dtype != DType::bf16 ? pre : Tensor::empty(pre.shape(), dtype, device, {MemoryKind::device, kActivationsPool});
        Tensor pre_bf16 = dtype != DType::bf16 ? Tensor() : ctx.pre_act;
        if (has_bias) {   // the fused bias + GELU, one call per expert (its own bias)
            offset = 0;
            for (int64_t e = 0; e < num_experts; ++e) {
                const int64_t c = ctx.counts[e];
                if (c == 0) continue;
                ops.bias_gelu_forward(stream, pre.narrow(0, offset, c), expert_slice(b1, e, {f1}), act.narrow(0, offset, c),
                                      pre_bf16.defined() ? pre_bf16.narrow(0, offset, c) : Tensor());
                offset += c;
            }
        } else {
            ops.bias_gelu_forward(stream, pre, Tensor(), act, pre_bf16);
        }
        if (dtype == DType::f16) ctx.pre_act = keep_for_backward(pre, dtype);
    }
    ctx.act  = in_dtype(act, dtype);
    Tensor y = activation(device, R, h);
    offset   = 0;
    for (int64_t e = 0; e < num_experts; ++e) {
        const int64_t c = ctx.counts[e];
        if (c == 0) continue;
        Tensor                    ye = y.narrow(0, offset, c);
        const Fp8Delayed::Operand dx = delayed ? delayed_forward(e, 2) : Fp8Delayed::Operand{};
        const Fp8Delayed::Operand dw = delayed ? delayed_forward(e, 3) : Fp8Delayed::Operand{};
        gemm(ctx.act.narrow(0, offset, c), Pass::forward, false, expert_slice(fc2_weight.data, e, {h, f}), true, ye,
             scale_inv(fc2_weight, e), delayed ? &dx : nullptr, delayed ? &dw : nullptr);
        if (has_bias) ops.bias_add(stream, ye, expert_slice(b2, e, {h}));
        offset += c;
    }
    if (expert_config.recompute_moe_act) ctx.act = Tensor();   // backward recomputes it from pre_act
    return y;
}

Tensor Experts::grouped_backward(Context & ctx, const Tensor & dyp, const GradReadyFn & ready) {
    Ops &         ops    = dyp.device().ops();
    Stream &      stream = dyp.device().compute_stream();
    Device &      device = dyp.device();
    const int64_t R = dyp.size(0), h = expert_config.hidden_size, f = ffn, f1 = expert_config.swiglu ? 2 * f : f;
    const DType   dtype    = expert_config.params_dtype;
    const bool    has_bias = fc1_bias.data.defined();

    if (expert_config.recompute_moe_act) {   // fc2's input again, from the saved pre-activation
        Tensor act = activation(device, R, f);
        recompute_activation(expert_config, in_dtype(ctx.pre_act, DType::f32), act);
        ctx.act = in_dtype(act, dtype);
    }
    const bool delayed = fp8 && fp8_backward_meta != nullptr;
    // Delayed FP8: dy by its slot (recorded in the dgrad, cast again for the wgrad), x and W by the forward's scales.
    auto backward_gemms = [&](int64_t e, int fc, const Tensor & d, const Tensor & w, const Tensor & w_scale_inv,
                              const Tensor & out, const Tensor & x, const Tensor & g) {
        const Fp8Delayed::Operand d_dy    = delayed ? delayed_backward(e, fc, true) : Fp8Delayed::Operand{};
        const Fp8Delayed::Operand d_again = delayed ? delayed_backward(e, fc, false) : Fp8Delayed::Operand{};
        const Fp8Delayed::Operand d_x     = delayed ? delayed_kept(ctx, e, 2 * fc) : Fp8Delayed::Operand{};
        const Fp8Delayed::Operand d_w     = delayed ? delayed_kept(ctx, e, 2 * fc + 1) : Fp8Delayed::Operand{};
        gemm(d, Pass::backward, false, w, false, out, w_scale_inv, delayed ? &d_dy : nullptr, delayed ? &d_w : nullptr);
        weight_grad(d, x, g, delayed ? &d_again : nullptr, delayed ? &d_x : nullptr);
    };
    // fc2
    Tensor  dy_in = in_dtype(dyp, dtype);
    Tensor  d_act = activation(device, R, f);
    accumulate_grads(stream, {fc2_weight.main_grad, fc2_bias.main_grad}, [&](std::span<const Tensor> g) {
        int64_t offset = 0;
        for (int64_t e = 0; e < num_experts; ++e) {
            const int64_t c = ctx.counts[e];
            if (c == 0) continue;
            if (has_bias) ops.bias_backward(stream, dyp.narrow(0, offset, c), expert_slice(g[1], e, {h}));
            backward_gemms(e, 1, dy_in.narrow(0, offset, c), expert_slice(fc2_weight.data, e, {h, f}), scale_inv(fc2_weight, e),
                           d_act.narrow(0, offset, c), ctx.act.narrow(0, offset, c), expert_slice(g[0], e, {h, f}));
            offset += c;
        }
    });
    if (ready) {
        ready(fc2_weight);
        if (has_bias) ready(fc2_bias);
    }
    // activation
    Tensor pre   = in_dtype(ctx.pre_act, DType::f32);
    Tensor d_pre = activation(device, R, f1);
    if (expert_config.swiglu) {
        gated_backward(expert_config, stream, pre, d_act, d_pre);
    } else if (expert_config.squared_relu) {
        ops.squared_relu_backward(stream, pre, d_act, d_pre);
    } else {
        ops.gelu_backward(stream, pre, d_act, d_pre);
    }
    // fc1
    Tensor d_pre_in = in_dtype(d_pre, dtype);
    Tensor dx       = activation(device, R, h);
    accumulate_grads(stream, {fc1_weight.main_grad, fc1_bias.main_grad}, [&](std::span<const Tensor> g) {
        int64_t offset = 0;
        for (int64_t e = 0; e < num_experts; ++e) {
            const int64_t c = ctx.counts[e];
            if (c == 0) continue;
            if (has_bias) ops.bias_backward(stream, d_pre.narrow(0, offset, c), expert_slice(g[1], e, {f1}));
            backward_gemms(e, 0, d_pre_in.narrow(0, offset, c), expert_slice(fc1_weight.data, e, {f1, h}),
                           scale_inv(fc1_weight, e), dx.narrow(0, offset, c), ctx.x.narrow(0, offset, c),
                           expert_slice(g[0], e, {f1, h}));
            offset += c;
        }
    });
    if (ready) {
        ready(fc1_weight);
        if (has_bias) ready(fc1_bias);
    }
    ctx = Context();
    return dx;
}

}  // namespace loom::model
