#include "model/gated_delta_net.h"

#include "core/error.h"
#include "core/ops.h"

#include <cmath>

namespace loom::model {

namespace {

// FLA's l2norm's epsilon, inside the square root.
constexpr float kL2NormEps = 1e-6f;

}  // namespace

GatedDeltaNet::GatedDeltaNet(const std::string & name, const GptConfig & c, Device & device, const TensorParallel & t)
    : config(c), tp(t), key_heads(c.linear_num_key_heads / t.size), value_heads(c.linear_num_value_heads / t.size),
      dk(c.linear_key_head_dim), dv(c.linear_value_head_dim),
      in_proj(name + ".in_proj", c.hidden_size, 2 * key_heads * dk + 2 * value_heads * dv + 2 * value_heads, false,
              c.params_dtype, device, t.size > 1 ? Linear::Split::column : Linear::Split::none, &tp),
      conv(parameter_create(name + ".conv1d.weight", {2 * key_heads * dk + value_heads * dv, 1, c.linear_conv_kernel_dim},
                            c.params_dtype, device)),
      a_log(parameter_create(name + ".A_log", {value_heads}, c.params_dtype, device)),
      dt_bias(parameter_create(name + ".dt_bias", {value_heads}, c.params_dtype, device)),
      out_norm(name + ".out_norm", c.linear_value_head_dim, c.normalization, c.norm_epsilon, c.params_dtype, device),
      out_proj(name + ".out_proj", value_heads * dv, c.hidden_size, false, c.params_dtype, device,
               t.size > 1 ? Linear::Split::row : Linear::Split::none, &tp) {
    const int64_t nk = c.linear_num_key_heads, nv = c.linear_num_value_heads;
    LOOM_CHECK(nk % t.size == 0 && nv % t.size == 0,
               "--linear-num-key-heads " << nk << " and --linear-num-value-heads " << nv
                                         << " must be divisible by --tensor-model-parallel-size " << t.size, "");
    // Megatron's param groups: vectors take no weight decay; the (C, 1, K) taps do.
    a_log.no_weight_decay   = true;
    dt_bias.no_weight_decay = true;
    out_norm.set_one_plus(c.apply_layernorm_1p);
    std::vector<Parameter *> norm_params;
    out_norm.parameters(norm_params);
    for (Parameter * p : norm_params) {   // every TP rank holds it whole and feeds it its own heads
        p->tp_duplicate      = t.rank != 0;
        p->sequence_parallel = t.size > 1;
    }
    if (t.size > 1) {
        // Each block of the full [q | k | v | z | b | a] (and of the full [q | k | v] channels): this rank's heads.
        const int64_t r = t.rank, qk = nk * dk, v = nv * dv, kh = key_heads * dk, vh = value_heads * dv;
        const std::vector<std::pair<int64_t, int64_t>> qkv{{r * kh, (r + 1) * kh}, {qk + r * kh, qk + (r + 1) * kh},
                                                           {2 * qk + r * vh, 2 * qk + (r + 1) * vh}};
        std::vector<std::pair<int64_t, int64_t>> rows = qkv;
        const int64_t z = 2 * qk + v, gates = z + v;
        rows.push_back({z + r * vh, z + (r + 1) * vh});
        rows.push_back({gates + r * value_heads, gates + (r + 1) * value_heads});
        rows.push_back({gates + nv + r * value_heads, gates + nv + (r + 1) * value_heads});
        set_tp_slice(in_proj.weight, 0, rows, {gates + 2 * nv, c.hidden_size});
        set_tp_slice(conv, 0, qkv, {2 * qk + v, 1, c.linear_conv_kernel_dim});
        for (Parameter * p : {&a_log, &dt_bias}) set_tp_slice(*p, 0, {{r * value_heads, (r + 1) * value_heads}}, {nv});
        set_tp_slice(out_proj.weight, 1, {{r * vh, (r + 1) * vh}}, {c.hidden_size, v});
    }
}

void GatedDeltaNet::init(uint64_t seed, float std, float output_std) {
    // Megatron's: the projections by the init method (the output one scaled), the taps by torch's Conv1d default
    // U(-1/sqrt(K), 1/sqrt(K)) (its fan-in is K), dt_bias ones, A_log the log of U(1, 16), the norm at one.
    in_proj.init(seed, std);
    const double bound = 1.0 / std::sqrt(static_cast<double>(config.linear_conv_kernel_dim));
    parameter_init_uniform(conv, seed, -bound, bound);
    parameter_init_uniform(a_log, seed, 1.0, 16.0, [](double u) { return std::log(u); });
    parameter_init_constant(dt_bias, 1.0f);
    out_norm.init();
    out_proj.init(seed, output_std);
}

void GatedDeltaNet::parameters(std::vector<Parameter *> & out) {   // in forward order
    in_proj.parameters(out);
    out.push_back(&conv);
    out.push_back(&a_log);
    out.push_back(&dt_bias);
    out_norm.parameters(out);
    out_proj.parameters(out);
}

Tensor GatedDeltaNet::conv_weight() const {
    return parameter_f32(conv).view({channels(), config.linear_conv_kernel_dim});
}

GatedDeltaNet::Operands GatedDeltaNet::operands(const Tensor & projected, int64_t s, int64_t b) const {
    Device &      device = projected.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t n = s * b, C = channels(), kw = key_heads * dk, r = value_heads / key_heads;
    Operands      o;
    Tensor        conv_in = activation(device, n, C, projected.dtype());
    ops.copy_columns(stream, projected, 0, conv_in, 0, C);
    o.conv_in = in_dtype(conv_in, DType::f32);
    const Tensor conv_out = activation(device, n, C);
    ops.causal_conv_silu_forward(stream, o.conv_in, conv_weight(), conv_out, s, b);
    // The queries' and keys' norms, head by head, then each key head over its value heads.
    const Tensor qk = activation(device, n, 2 * kw);
    ops.copy_columns(stream, conv_out, 0, qk, 0, 2 * kw);
    o.qk      = activation(device, n * 2 * key_heads, dk);
    o.qk_rstd = Tensor::empty({n * 2 * key_heads}, DType::f32, device, {MemoryKind::device, kActivationsPool});
    ops.l2norm_forward(stream, qk.view({n * 2 * key_heads, dk}), o.qk, o.qk_rstd, kL2NormEps);
    const Tensor normed = o.qk.view({n, 2 * kw});
    o.q = activation(device, n, value_heads * dk);
    o.k = activation(device, n, value_heads * dk);
    for (int64_t j = 0; j < value_heads; ++j) {
        ops.copy_columns(stream, normed, (j / r) * dk, o.q, j * dk, dk);
        ops.copy_columns(stream, normed, kw + (j / r) * dk, o.k, j * dk, dk);
    }
    o.v = activation(device, n, value_heads * dv);
    ops.copy_columns(stream, conv_out, 2 * kw, o.v, 0, value_heads * dv);
    o.g    = activation(device, n, value_heads);
    o.beta = activation(device, n, value_heads);
    ops.gdn_gates_forward(stream, projected, C + value_heads * dv, parameter_f32(a_log), parameter_f32(dt_bias), o.g, o.beta);
    return o;
}

namespace {

DeltaRuleShape rule_shape(int64_t s, int64_t b, int64_t heads, int64_t dk, int64_t dv) {
    return {s, b, heads, dk, dv, static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)))};
}

Tensor workspace_for(Device & device, const DeltaRuleShape & shape) {
    return Tensor::empty({delta_rule_workspace_elements(shape)}, DType::f32, device, {MemoryKind::device, kActivationsPool});
}

}  // namespace

Tensor GatedDeltaNet::forward(Context & ctx, const Tensor & x, int64_t s, int64_t b) {
    Device &      device = x.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t n = s * b, width = value_heads * dv;
    ctx.s = s;
    ctx.b = b;
    Tensor projected = in_proj.forward(ctx.in_ctx, x);
    ctx.projected    = keep_for_backward(projected, config.params_dtype);
    const Operands       o     = operands(projected, s, b);
    const DeltaRuleShape shape = rule_shape(s, b, value_heads, dk, dv);
    const Tensor         out   = activation(device, n, width);
    ops.gated_delta_rule_forward(stream, o.q, o.k, o.v, o.g, o.beta, out, workspace_for(device, shape), shape);
    // The norm over each head's dv, in the activations' dtype, then times silu(z) (z: the projection's columns after C).
    const Tensor rule_out = in_dtype(out, projected.dtype());
    Tensor       normed   = out_norm.forward(ctx.norm, rule_out.view({n * value_heads, dv})).view({n, width});
    const Tensor gated    = activation(device, n, width, projected.dtype());
    ops.output_gate_forward(stream, normed, projected, channels(), gated, GateActivation::silu);
    ctx.normed = keep_for_backward(normed, config.params_dtype);
    return out_proj.forward(ctx.out_ctx, gated);
}

Tensor GatedDeltaNet::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Device &      device = dy.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const DType   act    = dy.dtype();
    const int64_t s = ctx.s, b = ctx.b, n = s * b, width = value_heads * dv, C = channels(), kw = key_heads * dk;
    const int64_t r = value_heads / key_heads;
    const Tensor  d_gated   = out_proj.backward(ctx.out_ctx, dy, ready);
    const Tensor  projected = in_dtype(ctx.projected, act);
    const Tensor  d_normed = activation(device, n, width, act), dz = activation(device, n, width, act);
    ops.output_gate_backward(stream, in_dtype(ctx.normed, act), projected, C, d_gated, d_normed, dz, GateActivation::silu);
    const Tensor d_out = in_dtype(out_norm.backward(ctx.norm, d_normed.view({n * value_heads, dv}), ready).view({n, width}),
                                  DType::f32);
    ctx.normed = Tensor();

    // The delta rule's backward, from its operands again.
    const Operands       o     = operands(projected, s, b);
    const DeltaRuleShape shape = rule_shape(s, b, value_heads, dk, dv);
    const Tensor dq = activation(device, n, value_heads * dk), dk_ = activation(device, n, value_heads * dk);
    const Tensor dvv = activation(device, n, width), dg = activation(device, n, value_heads), dbeta = activation(device, n, value_heads);
    ops.gated_delta_rule_backward(stream, o.q, o.k, o.v, o.g, o.beta, d_out, dq, dk_, dvv, dg, dbeta,
                                  workspace_for(device, shape), shape);
    // Each key head's gradient sums its value heads' (in value-head order), then back through the norm.
    const Tensor d_normed_qk = activation(device, n, 2 * kw);
    const Tensor head        = r > 1 ? activation(device, n, dk) : Tensor();
    const Tensor sum         = r > 1 ? activation(device, n, dk) : Tensor();
    for (int64_t i = 0; i < key_heads; ++i) {
        for (const auto & [grad, col] : {std::pair{dq, i * dk}, std::pair{dk_, kw + i * dk}}) {
            if (r == 1) {
                ops.copy_columns(stream, grad, i * dk, d_normed_qk, col, dk);
                continue;
            }
            ops.copy_columns(stream, grad, i * r * dk, sum, 0, dk);
            for (int64_t m = 1; m < r; ++m) {
                ops.copy_columns(stream, grad, (i * r + m) * dk, head, 0, dk);
                ops.add_inplace(stream, sum, head);
            }
            ops.copy_columns(stream, sum, 0, d_normed_qk, col, dk);
        }
    }
    const Tensor d_qk = activation(device, n * 2 * key_heads, dk);
    ops.l2norm_backward(stream, d_normed_qk.view({n * 2 * key_heads, dk}), o.qk, o.qk_rstd, d_qk);
    const Tensor d_conv_out = activation(device, n, C);
    ops.copy_columns(stream, d_qk.view({n, 2 * kw}), 0, d_conv_out, 0, 2 * kw);
    ops.copy_columns(stream, dvv, 0, d_conv_out, 2 * kw, width);
    const Tensor d_conv_in = activation(device, n, C);
    accumulate_grads(stream, {conv.main_grad}, [&](std::span<const Tensor> g) {
        ops.causal_conv_silu_backward(stream, o.conv_in, conv_weight(), d_conv_out, d_conv_in,
                                      g[0].view({C, config.linear_conv_kernel_dim}), s, b);
    });
    const Tensor d_gates = activation(device, n, 2 * value_heads, act);
    accumulate_grads(stream, {a_log.main_grad, dt_bias.main_grad}, [&](std::span<const Tensor> g) {
        ops.gdn_gates_backward(stream, projected, C + width, parameter_f32(a_log), parameter_f32(dt_bias), dg, dbeta, d_gates,
                               g[0], g[1]);
    });
    if (ready) {   // in reverse forward order
        ready(dt_bias);
        ready(a_log);
        ready(conv);
    }
    // The projection's gradient: [q | k | v] from the convolution, z from the gate, [b | a] from the gates.
    const Tensor d_projected = activation(device, n, C + width + 2 * value_heads, act);
    ops.copy_columns(stream, in_dtype(d_conv_in, act), 0, d_projected, 0, C);
    ops.copy_columns(stream, dz, 0, d_projected, C, width);
    ops.copy_columns(stream, d_gates, 0, d_projected, C + width, 2 * value_heads);
    ctx.projected = Tensor();
    return in_proj.backward(ctx.in_ctx, d_projected, ready);
}

}  // namespace loom::model
