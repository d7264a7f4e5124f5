#include "model/transformer_layer.h"

#include <algorithm>

#include "core/error.h"
#include "core/ops.h"
#include "model/dsa_indexer.h"
#include "model/gated_delta_net.h"

#include <cmath>

namespace loom::model {

// ---------------------------------------------------------------------------------------------------
// TransformerLayer

namespace {
std::string layer_prefix(int64_t index, const std::string & prefix) {
    return prefix.empty() ? "layers." + std::to_string(index) : prefix;
}
}  // namespace

TransformerLayer::TransformerLayer(int64_t index, const GptConfig & c, Device & device, const TensorParallel & tp,
                                   const ExpertParallel & ep, const ContextParallel & cp, const std::string & prefix)
    : config(c),
      index(index),
      norm1(layer_prefix(index, prefix) + ".norm1", c.hidden_size, c.normalization, c.norm_epsilon, c.params_dtype,
            device, tp),
      // An MTP depth's attention takes the CP exchange of the decoder layer with its depth's number (Megatron
      // numbers MTP layers from 1, and a per-layer --cp-comm-type list is read by layer number).
      attention(layer_prefix(index, prefix) + ".attention", c, device, tp, cp,
                index < c.num_layers ? index : index - c.num_layers),
      norm2(layer_prefix(index, prefix) + ".norm2", c.hidden_size, c.normalization, c.norm_epsilon, c.params_dtype,
            device, tp) {
    norm1.set_one_plus(c.apply_layernorm_1p);
    norm2.set_one_plus(c.apply_layernorm_1p);
    if (index < c.num_layers) attention.window = c.attention_window(index);   // (MTP with a window is refused)
    const std::string name = layer_prefix(index, prefix) + ".mlp";
    if (c.is_moe_layer(index)) {
        moe        = std::make_unique<MoELayer>(name, c, c.moe, device, tp, ep, cp);
        moe_losses = Tensor::zeros({router_loss_count}, DType::f32, device, {MemoryKind::device, "moe-metrics"});
    } else {
        mlp            = std::make_unique<Mlp>(name, c, device, tp);
        mlp->recompute = c.recompute_mlp;
    }
    if (c.fp8_layer(index)) {   // every linear layer of the attention, the dense MLP and the experts
        const Linear::Fp8 fp8{c.fp8_forward, c.fp8_backward, c.fp8_param_gather, c.fp8_blockwise, c.fp8_mx};
        std::vector<Linear *> linears;
        if (attention.gdn) {
            linears = {&attention.gdn->in_proj, &attention.gdn->out_proj};
        } else {
            linears = {&attention.qkv, &attention.proj};
        }
        if (attention.mla) {
            for (auto * l : {&attention.mla->q, &attention.mla->q_down, &attention.mla->q_up, &attention.mla->kv_down,
                             &attention.mla->kv_up}) {
                if (*l) linears.push_back(l->get());
            }
        }
        if (attention.indexer) {   // DSA's indexer: Megatron builds its projections as the layer's other linear modules
            for (Linear * l : {&attention.indexer->wq_b, &attention.indexer->wk, &attention.indexer->weights_proj}) {
                linears.push_back(l);
            }
        }
        if (mlp) {
            linears.push_back(&mlp->fc1);
            linears.push_back(&mlp->fc2);
        }
        for (Linear * l : linears) l->set_fp8(fp8);
        if (moe) moe->set_fp8(fp8);
        if (c.fp8_delayed) {
            fp8_delayed.forward  = std::make_unique<Fp8Delayed>(c.fp8_forward, c.fp8_amax_history_len, c.fp8_amax_max, c.fp8_margin);
            fp8_delayed.backward = std::make_unique<Fp8Delayed>(c.fp8_backward, c.fp8_amax_history_len, c.fp8_amax_max, c.fp8_margin);
            for (Linear * l : linears) l->set_fp8_delayed(fp8_delayed);
            if (moe) moe->set_fp8_delayed(fp8_delayed);
            fp8_delayed.forward->allocate(device);
            fp8_delayed.backward->allocate(device);
            fp8_group = ep.tp_dp_cp;
        }
    }
}

TransformerLayer::~TransformerLayer() = default;

void TransformerLayer::init(uint64_t seed) {
    // Megatron's init: N(0, std) for inputs, std / sqrt(2 L) for the layers that write the residual.
    // µP: both over sqrt(width multiplier) (GptConfig::hidden_init_std).
    float std        = config.hidden_init_std();
    float output_std = config.residual_init_std();
    norm1.init();
    attention.init(seed, std, output_std);
    norm2.init();
    if (moe) {
        moe->init(seed, std, output_std);
    } else {
        mlp->init(seed, std, output_std);
    }
}

void TransformerLayer::parameters(std::vector<Parameter *> & out) {
    norm1.parameters(out);
    attention.parameters(out);
    norm2.parameters(out);
    if (moe) {
        moe->parameters(out);
    } else {
        mlp->parameters(out);
    }
}

namespace {

// The fields of a layer's context that --offload-modules names (undefined ones included: the caller skips them).
std::vector<Tensor *> offload_fields(TransformerLayer::Context & ctx, uint32_t modules) {
    std::vector<Tensor *> f;
    SelfAttention::Context & a = ctx.attn;
    if (modules & offload_attn_norm) f.push_back(&ctx.norm1.x);
    if (modules & offload_qkv_linear) {
        for (Tensor * t : {&a.qkv_ctx.x, &a.latent.q.x, &a.latent.q_down.x, &a.latent.kv_down.x}) f.push_back(t);
    }
    if (modules & offload_core_attn) {   // its inputs, and with an output gate its output (the gate's backward reads it)
        f.push_back(&a.qkv);
        f.push_back(&a.ungated);
    }
    if (modules & offload_attn_proj) f.push_back(&a.proj_ctx.x);
    if (a.linear) {   // a gated delta-net layer's: its input projection's input; its core's input (the projection)
                      // and what its gated norm's backward reads; its output projection's input
        GatedDeltaNetContext & g = *a.linear;
        if (modules & offload_qkv_linear) f.push_back(&g.in_ctx.x);
        if (modules & offload_core_attn) {
            for (Tensor * t : {&g.projected, &g.norm.x, &g.normed}) f.push_back(t);
        }
        if (modules & offload_attn_proj) f.push_back(&g.out_ctx.x);
    }
    if (modules & offload_mlp_norm) f.push_back(&ctx.norm2.x);
    if (ctx.moe) {
        Experts::Context & e = ctx.moe->experts;
        if (modules & offload_expert_fc1) {
            f.push_back(&e.x);
            for (Mlp::Context & m : e.mlp) f.push_back(&m.fc1_ctx.x);
        }
        if (modules & offload_moe_act) {
            f.push_back(&e.pre_act);
            for (Mlp::Context & m : e.mlp) f.push_back(&m.pre_act);
        }
    }
    return f;
}

// Moves every field's tensor (those of `from` memory, of at least `min` elements) into new memory of `to`,
// one copy per tensor however many fields share it; returns the bytes moved.
int64_t move_fields(const std::vector<Tensor *> & fields, bool from_host, TensorOptions to, int64_t min) {
    int64_t                                 bytes = 0;
    std::vector<std::pair<void *, Tensor>> moved;   // the old tensor's address -> its new home
    for (Tensor * field : fields) {
        if (!field->defined() || field->numel() < min) continue;
        const bool on_host = field->memory_kind() == MemoryKind::pinned_host;
        if (on_host != from_host) continue;
        void * key = field->data_ptr();
        auto   it  = std::find_if(moved.begin(), moved.end(), [&](const auto & m) { return m.first == key; });
        if (it == moved.end()) {
            Device & device = field->device();
            Tensor   copy   = Tensor::empty(field->shape(), field->dtype(), device, to);
            device.ops().copy(device.compute_stream(), *field, copy);
            bytes += static_cast<int64_t>(field->nbytes());
            moved.emplace_back(key, copy);
            it = moved.end() - 1;
        }
        *field = it->second;
    }
    return bytes;
}

}  // namespace

int64_t TransformerLayer::offload_activations(Context & ctx) const {
    if (config.offload_modules == 0) return 0;
    return move_fields(offload_fields(ctx, config.offload_modules), false, {MemoryKind::pinned_host, "offloaded activations"},
                       config.min_offloaded_tensor_size);
}

int64_t TransformerLayer::reload_activations(Context & ctx) const {
    if (config.offload_modules == 0) return 0;
    return move_fields(offload_fields(ctx, config.offload_modules), true, {MemoryKind::device, kActivationsPool}, 0);
}

Tensor TransformerLayer::forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch) {
    // Delayed FP8: the scales move once the layer's training forward has cast everything (an evaluation's
    // forward casts by them, recording nothing, and leaves them be).
    if (!fp8_delayed.forward) return forward_layer(ctx, x, s, b, batch);
    fp8_delayed.forward->set_recording(batch.training);
    Tensor y = forward_layer(ctx, x, s, b, batch);
    fp8_delayed.forward->set_recording(true);
    if (batch.training) fp8_delayed.forward->update(fp8_group.get());
    return y;
}

Tensor TransformerLayer::forward_layer(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch) {
    if (moe) {
        Tensor y = forward_tail(ctx, forward_head(ctx, x, s, b, batch, true), s, b, batch);
        offload_activations(ctx);
        return y;
    }
    Ops &            ops    = x.device().ops();
    Stream &         stream = x.device().compute_stream();
    const Tensor     h1     = attention_block(ctx, x, s, b, batch);
    Tensor h2 = mlp->forward(ctx.mlp, norm2.forward(ctx.norm2, h1, &x));   // h1 = x + attn, fused into norm2
    if (config.recompute_layernorm) (mlp->recompute ? ctx.mlp.input : ctx.mlp.fc1_ctx.x) = Tensor();   // norm2's output
    if (ctx.mlp_out.enabled()) ops.dropout(stream, h2, h2, ctx.mlp_out);
    ops.add_inplace(stream, h2, h1);   // h2 = h1 + mlp
    offload_activations(ctx);
    return h2;
}

Tensor TransformerLayer::attention_block(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch) {
    Ops &            ops    = x.device().ops();
    Stream &         stream = x.device().compute_stream();
    const TensorParallel & tp = attention.tp;
    const int64_t    rows   = x.size(0);
    ctx.attn_out = dropout_key(config, tp, batch, index, DropoutKind::attention_output, rows);
    ctx.mlp_out  = dropout_key(config, tp, batch, index, DropoutKind::mlp_output, rows);
    ctx.attn.training = batch.training;
    ctx.attn.dsa_topk = batch.dsa_topk;
    ctx.attn.recomputing = batch.recompute;
    Tensor h1 = attention.forward(ctx.attn, norm1.forward(ctx.norm1, x), s, b,
                                  dropout_key(config, tp, batch, index, DropoutKind::attention_probs, rows, attention.heads));
    if (config.recompute_layernorm) attention.release_input(ctx.attn);   // norm1's output: recomputed in backward
    if (ctx.attn_out.enabled()) ops.dropout(stream, h1, h1, ctx.attn_out);
    return h1;
}

std::vector<Tensor> TransformerLayer::forward_head(Context & ctx, const Tensor & x, int64_t s, int64_t b,
                                                   const DropoutBatch & batch, bool with_plan, bool at_norm2) {
    const Tensor residual = attention_block(ctx, x, s, b, batch);
    if (!moe || at_norm2) {   // residual = x + attn, fused into norm2, whose output the tail takes
        const Tensor normed = norm2.forward(ctx.norm2, residual, &x);
        return {residual, normed};
    }
    // residual = x + attn, fused into norm2. The MoE layer runs in f32: bf16 activations are widened into it
    // and its output rounded back (forward_tail), its gradients likewise.
    std::vector<Tensor> out{residual};
    for (Tensor & t : forward_router(ctx, norm2.forward(ctx.norm2, residual, &x), b, batch, with_plan)) out.push_back(std::move(t));
    return out;
}

std::vector<Tensor> TransformerLayer::forward_router(Context & ctx, const Tensor & normed, int64_t b, const DropoutBatch & batch,
                                                     bool with_plan) {
    const Tensor hidden = in_dtype(normed, DType::f32);
    ctx.moe             = std::make_shared<MoeLayerContext>();
    moe->forward_router(*ctx.moe, hidden, b, batch.training, with_plan);
    if (batch.training) hidden.device().ops().add_inplace(hidden.device().compute_stream(), moe_losses, ctx.moe->router.losses);
    return moe->router_outputs(*ctx.moe, hidden);
}

Tensor TransformerLayer::forward_tail(Context & ctx, const std::vector<Tensor> & head, int64_t s, int64_t b,
                                      const DropoutBatch & batch, bool at_norm2) {
    LOOM_CHECK(!head.empty(), "the MoE tail of layer " << index << " without the head's outputs", "");
    const Tensor & residual = head[0];
    Ops &          ops      = residual.device().ops();
    Stream &       stream   = residual.device().compute_stream();
    const int64_t  rows     = s * b / (attention.tp.sp() ? attention.tp.size : 1);   // this rank's block with SP
    LOOM_CHECK(residual.size(0) == rows, "MoE segment of " << residual.size(0) << " rows for s " << s << ", b " << b, "");
    ctx.mlp_out = dropout_key(config, attention.tp, batch, index, DropoutKind::mlp_output, rows);
    Tensor h2;
    if (moe && at_norm2) {   // the router too, from norm2's output
        LOOM_CHECK(head.size() == 2, "the MoE tail of layer " << index << " given " << head.size() << " head outputs", "");
        h2 = in_dtype(moe->forward_experts_from(*ctx.moe, forward_router(ctx, head[1], b, batch, true)), residual.dtype());
    } else if (moe) {
        if (!ctx.moe) ctx.moe = std::make_shared<MoeLayerContext>();
        h2 = in_dtype(moe->forward_experts_from(*ctx.moe, std::vector<Tensor>(head.begin() + 1, head.end())),
                      residual.dtype());
    } else {   // the MLP keeps norm2's output as its input (the head's norm2 context is not the tail's)
        LOOM_CHECK(head.size() == 2, "the MLP tail of layer " << index << " given " << head.size() << " head outputs", "");
        h2 = mlp->forward(ctx.mlp, head[1]);
    }
    if (ctx.mlp_out.enabled()) ops.dropout(stream, h2, h2, ctx.mlp_out);
    ops.add_inplace(stream, h2, residual);   // h2 = h1 + mlp
    return h2;
}

Tensor TransformerLayer::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    Tensor dx = backward_layer(ctx, dy, ready);
    if (fp8_delayed.backward) fp8_delayed.backward->update(fp8_group.get());   // after every cast of the layer's dy
    return dx;
}

Tensor TransformerLayer::backward_layer(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    reload_activations(ctx);
    if (moe) return backward_head(ctx, backward_tail(ctx, dy, ready), ready);
    if (config.recompute_layernorm) {   // norm2's output again, from its saved input (x + attn), as the MLP kept it
        Norm::Context again;
        const Tensor  y = norm2.forward(again, ctx.norm2.x);
        (mlp->recompute ? ctx.mlp.input : ctx.mlp.fc1_ctx.x) =
            mlp->recompute ? in_dtype(y, config.params_dtype) : mlp->fc1.input_for_backward(y);
    }
    // d h1 = dy (the residual path) + norm2'(mlp'(...)), in norm2's backward pass.
    Tensor dh1 = norm2.backward(ctx.norm2, mlp->backward(ctx.mlp, dropped(ctx.mlp_out, dy), ready), ready, dy);
    return attention_block_backward(ctx, dh1, ready);
}

// A copy of g with the dropout `key`'s mask applied, or g itself without dropout (the residual path
// takes the gradient whole).
Tensor TransformerLayer::dropped(const Dropout & key, const Tensor & g) const {
    if (!key.enabled()) return g;
    Tensor out = activation(g.device(), g.size(0), g.size(1), g.dtype());
    g.device().ops().dropout(g.device().compute_stream(), g, out, key);
    return out;
}

// dx = d h1 + norm1'(attn'(drop(d h1))), the residual path's d h1 added in norm1's backward pass.
Tensor TransformerLayer::attention_block_backward(Context & ctx, const Tensor & dh1, const GradReadyFn & ready) {
    if (config.recompute_layernorm) {   // norm1's output again, as the QKV projection kept it
        Norm::Context again;
        attention.restore_input(ctx.attn, norm1.forward(again, ctx.norm1.x));
    }
    Tensor dx = norm1.backward(ctx.norm1, attention.backward(ctx.attn, dropped(ctx.attn_out, dh1), ready), ready, dh1);
    ctx.attn_out = ctx.mlp_out = Dropout{};
    return dx;
}

std::vector<Tensor> TransformerLayer::backward_tail(Context & ctx, const Tensor & dy, const GradReadyFn & ready, bool at_norm2) {
    std::vector<Tensor> grads{dy};   // d h1: the residual path takes the gradient whole
    if (!moe) {
        grads.push_back(mlp->backward(ctx.mlp, dropped(ctx.mlp_out, dy), ready));   // d norm2's output
        return grads;
    }
    std::vector<Tensor> router_grads = moe->backward_experts_to(*ctx.moe, in_dtype(dropped(ctx.mlp_out, dy), DType::f32), ready);
    if (at_norm2) {   // through the router too: d norm2's output, in the activations' dtype as backward_head rounds it
        grads.push_back(in_dtype(moe->backward_router_from(*ctx.moe, router_grads, ready), dy.dtype()));
        ctx.moe.reset();
        return grads;
    }
    for (Tensor & g : router_grads) grads.push_back(std::move(g));
    return grads;
}

Tensor TransformerLayer::backward_head(Context & ctx, const std::vector<Tensor> & grads, const GradReadyFn & ready, bool at_norm2) {
    LOOM_CHECK(grads.size() >= (moe && !at_norm2 ? 1u : 2u), "the head of layer " << index << " given " << grads.size() << " gradients", "");
    if (!moe || at_norm2) {   // as backward(): d h1 = dy + norm2'(d norm2's output)
        Tensor dh1 = norm2.backward(ctx.norm2, grads[1], ready, grads[0]);
        return attention_block_backward(ctx, dh1, ready);
    }
    Tensor dhidden = in_dtype(moe->backward_router_from(*ctx.moe, std::vector<Tensor>(grads.begin() + 1, grads.end()), ready),
                              grads[0].dtype());
    ctx.moe.reset();
    Tensor dh1 = norm2.backward(ctx.norm2, dhidden, ready, grads[0]);
    return attention_block_backward(ctx, dh1, ready);
}

std::vector<std::vector<int64_t>> TransformerLayer::head_grad_shapes(int64_t rows, bool at_norm2) const {
    std::vector<std::vector<int64_t>> shapes{{rows, config.hidden_size}};
    if (!moe || at_norm2) return {{rows, config.hidden_size}, {rows, config.hidden_size}};   // and norm2's output
    for (auto & shape : moe ? moe->router_grad_shapes(rows) : std::vector<std::vector<int64_t>>{}) shapes.push_back(std::move(shape));
    return shapes;
}

}  // namespace loom::model
