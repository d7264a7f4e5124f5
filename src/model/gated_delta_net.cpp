#include "model/gated_delta_net.h"

#include "core/error.h"
#include "core/ops.h"

#include <cmath>

namespace loom::model {

namespace {

// FLA's l2norm's epsilon, inside the square root.
constexpr float kL2NormEps = 1e-6f;

}  // namespace

GatedDeltaNet::GatedDeltaNet(const std::string & name, const GptConfig & c, Device & device, const TensorParallel & t,
                             const ContextParallel & context)
    : config(c), tp(t), cp(context), key_heads(c.linear_num_key_heads / t.size), value_heads(c.linear_num_value_heads / t.size),
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
    LOOM_CHECK(nk % (t.size * cp.size) == 0 && nv % (t.size * cp.size) == 0,
               "--linear-num-key-heads " << nk << " and --linear-num-value-heads " << nv
                                         << " must be multiples of --tensor-model-parallel-size x --context-parallel-size = "
                                         << t.size * cp.size, "");
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

GatedDeltaNet::Core GatedDeltaNet::core() const {
    const int64_t K = config.linear_conv_kernel_dim, C = 2 * key_heads * dk + value_heads * dv;
    const Tensor  taps = parameter_f32(conv).view({C, K}), a = parameter_f32(a_log), dt = parameter_f32(dt_bias);
    if (!cp.enabled()) return {key_heads, value_heads, taps, a, dt};
    // This CP rank's share: its key heads' q and k taps and its value heads' v taps, and their A_log and dt_bias.
    Device &      device = conv.data.device();
    const int64_t kc = key_heads / cp.size, vc = value_heads / cp.size, r = cp.rank;
    Core          share{kc, vc, Tensor::empty({2 * kc * dk + vc * dv, K}, DType::f32, device, {MemoryKind::device, kActivationsPool}),
               a.narrow(0, r * vc, vc), dt.narrow(0, r * vc, vc)};
    const std::pair<int64_t, int64_t> rows[] = {{r * kc * dk, kc * dk}, {key_heads * dk + r * kc * dk, kc * dk},
                                                {2 * key_heads * dk + r * vc * dv, vc * dv}};
    int64_t at = 0;
    for (const auto & [first, count] : rows) {
        device.ops().copy(device.compute_stream(), taps.narrow(0, first, count), share.taps.narrow(0, at, count));
        at += count;
    }
    return share;
}

void GatedDeltaNet::add_core_grads(const Core & c, const Tensor & d_taps, const Tensor & d_a_log, const Tensor & d_dt_bias) {
    Device &      device = conv.data.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t K = config.linear_conv_kernel_dim, C = 2 * key_heads * dk + value_heads * dv, r = cp.enabled() ? cp.rank : 0;
    const int64_t kc = c.key_heads, vc = c.value_heads;
    // (the share's first row, the parameter's first row, rows): q, k and v taps of the share's heads
    const int64_t blocks[3][3] = {{0, r * kc * dk, kc * dk}, {kc * dk, key_heads * dk + r * kc * dk, kc * dk},
                                  {2 * kc * dk, 2 * key_heads * dk + r * vc * dv, vc * dv}};
    accumulate_grads(stream, {conv.main_grad}, [&](std::span<const Tensor> g) {
        for (const auto & block : blocks) {
            ops.add_inplace(stream, g[0].view({C, K}).narrow(0, block[1], block[2]), d_taps.narrow(0, block[0], block[2]));
        }
    });
    accumulate_grads(stream, {a_log.main_grad, dt_bias.main_grad}, [&](std::span<const Tensor> g) {
        ops.add_inplace(stream, g[0].narrow(0, r * vc, vc), d_a_log);
        ops.add_inplace(stream, g[1].narrow(0, r * vc, vc), d_dt_bias);
    });
}

std::vector<HeadColumns> GatedDeltaNet::projection_columns() const {
    const int64_t kc = key_heads / cp.size, vc = value_heads / cp.size;
    const int64_t C  = 2 * key_heads * dk + value_heads * dv, v = value_heads * dv;
    return {{0, kc * dk}, {key_heads * dk, kc * dk}, {2 * key_heads * dk, vc * dv},
            {C, vc * dv}, {C + v, vc},                {C + v + value_heads, vc}};
}

GatedDeltaNet::Operands GatedDeltaNet::operands(const Core & c, const Tensor & projected, int64_t s, int64_t b) const {
    Device &      device = projected.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t n = s * b, C = c.channels(dk, dv), kh = c.key_heads, vh = c.value_heads, kw = kh * dk, r = vh / kh;
    Operands      o;
    Tensor        conv_in = activation(device, n, C, projected.dtype());
    ops.copy_columns(stream, projected, 0, conv_in, 0, C);
    o.conv_in = in_dtype(conv_in, DType::f32);
    const Tensor conv_out = activation(device, n, C);
    ops.causal_conv_silu_forward(stream, o.conv_in, c.taps, conv_out, s, b);
    // The queries' and keys' norms, head by head, then each key head over its value heads.
    const Tensor qk = activation(device, n, 2 * kw);
    ops.copy_columns(stream, conv_out, 0, qk, 0, 2 * kw);
    o.qk      = activation(device, n * 2 * kh, dk);
    o.qk_rstd = Tensor::empty({n * 2 * kh}, DType::f32, device, {MemoryKind::device, kActivationsPool});
    ops.l2norm_forward(stream, qk.view({n * 2 * kh, dk}), o.qk, o.qk_rstd, kL2NormEps);
    const Tensor normed = o.qk.view({n, 2 * kw});
    o.q = activation(device, n, vh * dk);
    o.k = activation(device, n, vh * dk);
    if (r == 1) {   // one value head per key head: each block in one copy
        ops.copy_columns(stream, normed, 0, o.q, 0, kw);
        ops.copy_columns(stream, normed, kw, o.k, 0, kw);
    } else {
        for (int64_t j = 0; j < vh; ++j) {
            ops.copy_columns(stream, normed, (j / r) * dk, o.q, j * dk, dk);
            ops.copy_columns(stream, normed, kw + (j / r) * dk, o.k, j * dk, dk);
        }
    }
    o.v = activation(device, n, vh * dv);
    ops.copy_columns(stream, conv_out, 2 * kw, o.v, 0, vh * dv);
    o.g    = activation(device, n, vh);
    o.beta = activation(device, n, vh);
    ops.gdn_gates_forward(stream, projected, C + vh * dv, c.a_log, c.dt_bias, o.g, o.beta);
    return o;
}

namespace {

DeltaRuleShape rule_shape(int64_t s, int64_t b, int64_t heads, int64_t dk, int64_t dv) {
    return {s, b, heads, dk, dv, static_cast<float>(1.0 / std::sqrt(static_cast<double>(dk)))};
}

Tensor workspace_for(Device & device, const DeltaRuleShape & shape) {
    return Tensor::empty({delta_rule_workspace_elements(shape)}, DType::f32, device, {MemoryKind::device, kActivationsPool});
}

Tensor zeros_f32(Device & device, const Shape & shape) {
    Tensor t = Tensor::empty(shape, DType::f32, device, {MemoryKind::device, kActivationsPool});
    device.ops().fill_zero(device.compute_stream(), t);
    return t;
}

}  // namespace

Tensor GatedDeltaNet::forward(Context & ctx, const Tensor & x, int64_t s, int64_t b) {
    Device & device = x.device();
    Ops &    ops    = device.ops();
    Stream & stream = device.compute_stream();
    ctx.s = s;
    ctx.b = b;
    Tensor      projected = in_proj.forward(ctx.in_ctx, x);
    const DType act       = projected.dtype();
    if (cp.enabled()) {   // this rank's rows of every head -> the whole sequence of this CP rank's share
        projected = in_dtype(heads_to_sequence(cp, in_dtype(projected, DType::f32), s, b, projection_columns()), act);
    }
    ctx.projected = keep_for_backward(projected, config.params_dtype);
    const Core           c     = core();
    const int64_t        steps = cp.enabled() ? s * cp.size : s, rows = steps * b, width = c.value_heads * dv;
    const Operands       o     = operands(c, projected, steps, b);
    const DeltaRuleShape shape = rule_shape(steps, b, c.value_heads, dk, dv);
    const Tensor         out   = activation(device, rows, width);
    ops.gated_delta_rule_forward(stream, o.q, o.k, o.v, o.g, o.beta, out, workspace_for(device, shape), shape);
    // The norm over each head's dv, in the activations' dtype, then times silu(z) (z: the projection's columns after C).
    const Tensor rule_out = in_dtype(out, act);
    Tensor       normed   = out_norm.forward(ctx.norm, rule_out.view({rows * c.value_heads, dv})).view({rows, width});
    Tensor       gated    = activation(device, rows, width, act);
    ops.output_gate_forward(stream, normed, projected, c.channels(dk, dv), gated, GateActivation::silu);
    ctx.normed = keep_for_backward(normed, config.params_dtype);
    if (cp.enabled()) {   // back to this rank's rows of every head of the TP rank
        const Tensor local = activation(device, s * b, value_heads * dv);
        sequence_to_heads(cp, in_dtype(gated, DType::f32), s, b, {{0, width}}, local);
        gated = in_dtype(local, act);
    }
    return out_proj.forward(ctx.out_ctx, gated);
}

Tensor GatedDeltaNet::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Device &      device = dy.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const DType   act    = dy.dtype();
    const Core    c      = core();
    const int64_t s = ctx.s, b = ctx.b, steps = cp.enabled() ? s * cp.size : s, rows = steps * b;
    const int64_t kh = c.key_heads, vh = c.value_heads, width = vh * dv, C = c.channels(dk, dv), kw = kh * dk, r = vh / kh;
    Tensor        d_gated = out_proj.backward(ctx.out_ctx, dy, ready);
    if (cp.enabled()) d_gated = in_dtype(heads_to_sequence(cp, in_dtype(d_gated, DType::f32), s, b, {{0, width}}), act);
    const Tensor projected = in_dtype(ctx.projected, act);
    const Tensor d_normed = activation(device, rows, width, act), dz = activation(device, rows, width, act);
    ops.output_gate_backward(stream, in_dtype(ctx.normed, act), projected, C, d_gated, d_normed, dz, GateActivation::silu);
    const Tensor d_out = in_dtype(out_norm.backward(ctx.norm, d_normed.view({rows * vh, dv}), ready).view({rows, width}),
                                  DType::f32);
    ctx.normed = Tensor();

    // The delta rule's backward, from its operands again.
    const Operands       o     = operands(c, projected, steps, b);
    const DeltaRuleShape shape = rule_shape(steps, b, vh, dk, dv);
    const Tensor dq = activation(device, rows, vh * dk), dk_ = activation(device, rows, vh * dk);
    const Tensor dvv = activation(device, rows, width), dg = activation(device, rows, vh), dbeta = activation(device, rows, vh);
    ops.gated_delta_rule_backward(stream, o.q, o.k, o.v, o.g, o.beta, d_out, dq, dk_, dvv, dg, dbeta,
                                  workspace_for(device, shape), shape);
    // Each key head's gradient sums its value heads' (in value-head order), then back through the norm.
    const Tensor d_normed_qk = activation(device, rows, 2 * kw);
    const Tensor head        = r > 1 ? activation(device, rows, dk) : Tensor();
    const Tensor sum         = r > 1 ? activation(device, rows, dk) : Tensor();
    if (r == 1) {
        ops.copy_columns(stream, dq, 0, d_normed_qk, 0, kw);
        ops.copy_columns(stream, dk_, 0, d_normed_qk, kw, kw);
    }
    for (int64_t i = 0; r > 1 && i < kh; ++i) {
        for (const auto & [grad, col] : {std::pair{dq, i * dk}, std::pair{dk_, kw + i * dk}}) {
            ops.copy_columns(stream, grad, i * r * dk, sum, 0, dk);
            for (int64_t m = 1; m < r; ++m) {
                ops.copy_columns(stream, grad, (i * r + m) * dk, head, 0, dk);
                ops.add_inplace(stream, sum, head);
            }
            ops.copy_columns(stream, sum, 0, d_normed_qk, col, dk);
        }
    }
    const Tensor d_qk = activation(device, rows * 2 * kh, dk);
    ops.l2norm_backward(stream, d_normed_qk.view({rows * 2 * kh, dk}), o.qk, o.qk_rstd, d_qk);
    const Tensor d_conv_out = activation(device, rows, C);
    ops.copy_columns(stream, d_qk.view({rows, 2 * kw}), 0, d_conv_out, 0, 2 * kw);
    ops.copy_columns(stream, dvv, 0, d_conv_out, 2 * kw, width);
    const Tensor d_conv_in = activation(device, rows, C);
    const Tensor d_taps = zeros_f32(device, {C, config.linear_conv_kernel_dim});
    const Tensor d_a_log = zeros_f32(device, {vh}), d_dt_bias = zeros_f32(device, {vh});
    ops.causal_conv_silu_backward(stream, o.conv_in, c.taps, d_conv_out, d_conv_in, d_taps, steps, b);
    const Tensor d_gates = activation(device, rows, 2 * vh, act);
    ops.gdn_gates_backward(stream, projected, C + width, c.a_log, c.dt_bias, dg, dbeta, d_gates, d_a_log, d_dt_bias);
    add_core_grads(c, d_taps, d_a_log, d_dt_bias);
    if (ready) {   // in reverse forward order
        ready(dt_bias);
        ready(a_log);
        ready(conv);
    }
    // The projection's gradient: [q | k | v] from the convolution, z from the gate, [b | a] from the gates.
    Tensor d_projected = activation(device, rows, C + width + 2 * vh, act);
    ops.copy_columns(stream, in_dtype(d_conv_in, act), 0, d_projected, 0, C);
    ops.copy_columns(stream, dz, 0, d_projected, C, width);
    ops.copy_columns(stream, d_gates, 0, d_projected, C + width, 2 * vh);
    ctx.projected = Tensor();
    if (cp.enabled()) {   // the whole sequence of this share -> this rank's rows of every head
        const Tensor local = activation(device, s * b, in_proj.weight.data.size(0));
        sequence_to_heads(cp, in_dtype(d_projected, DType::f32), s, b, projection_columns(), local);
        d_projected = in_dtype(local, act);
    }
    return in_proj.backward(ctx.in_ctx, d_projected, ready);
}

}  // namespace loom::model
