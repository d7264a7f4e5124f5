#include "model/dsa_indexer.h"

#include "core/error.h"

#include <bit>
#include <cmath>
#include <vector>

namespace loom::model {

namespace {

// Every parameter of the indexer is whole on every TP rank and gets the same gradient there (dsa_indexer.h):
// counted once in the gradient's norm, reduced over nothing but DP.
void replicated_whole(Parameter & p, const TensorParallel & tp) {
    p.tp_duplicate      = tp.rank != 0;
    p.sequence_parallel = false;
}

// Megatron's rotate_activation (fast_hadamard_transform with scale d^-1/2): y = H x / sqrt(d) with H Sylvester's
// Hadamard matrix of the next power of two, x zero-padded to it and y cut back to d. As a matrix, the top-left d x d
// block of H, over sqrt(d): entry (r, c) is (-1)^popcount(r & c) / sqrt(d). Symmetric, so it is its own transpose
// (the backward's), and orthonormal when d is a power of two.
std::vector<float> hadamard_rotation(int64_t d) {
    std::vector<float> m(static_cast<size_t>(d * d));
    const float        scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int64_t r = 0; r < d; ++r) {
        for (int64_t c = 0; c < d; ++c) {
            m[static_cast<size_t>(r * d + c)] = std::popcount(static_cast<uint64_t>(r & c)) % 2 == 0 ? scale : -scale;
        }
    }
    return m;
}

}  // namespace

DsaIndexer::DsaIndexer(const std::string & name, const GptConfig & c, Device & device, const TensorParallel & t,
                       const ContextParallel & context)
    : config(c), tp(t), cp(context), heads(c.dsa_indexer_n_heads), head_dim(c.dsa_indexer_head_dim),
      wq_b(name + ".wq_b", c.q_lora_rank, c.dsa_indexer_n_heads * c.dsa_indexer_head_dim, false, c.params_dtype, device),
      wk(name + ".wk", c.hidden_size, c.dsa_indexer_head_dim, false, c.params_dtype, device),
      k_norm(name + ".k_norm", c.dsa_indexer_head_dim, Normalization::layernorm,
             c.dsa_indexer_k_norm_epsilon > 0.0f ? c.dsa_indexer_k_norm_epsilon : c.norm_epsilon, c.params_dtype, device),
      weights_proj(name + ".weights_proj", c.hidden_size, c.dsa_indexer_n_heads, false, c.params_dtype, device) {
    LOOM_CHECK(c.q_lora_rank > 0 && heads >= 1 && head_dim >= c.qk_pos_emb_head_dim,
               "the DSA indexer of " << name << ": --q-lora-rank " << c.q_lora_rank << ", --dsa-indexer-n-heads " << heads
                                     << ", --dsa-indexer-head-dim " << head_dim,
               "GptConfig::validate states the indexer's sizes");
    std::vector<Parameter *> params;
    parameters(params);
    for (Parameter * p : params) replicated_whole(*p, tp);
    if (c.dsa_indexer_rotate_activation) {
        rotation = Tensor::empty({head_dim, head_dim}, DType::f32, device);
        write_values_f32(rotation, hadamard_rotation(head_dim));
    }
    loss = Tensor::zeros({1, 1}, DType::f32, device, {MemoryKind::device, "dsa-metrics"});
}

void DsaIndexer::init(uint64_t seed, float std) {   // Megatron's: the init method for the projections, the norm at one
    wq_b.init(seed, std);
    wk.init(seed, std);
    weights_proj.init(seed, std);
    k_norm.init();
}

void DsaIndexer::parameters(std::vector<Parameter *> & out) {   // in forward order
    wq_b.parameters(out);
    wk.parameters(out);
    k_norm.parameters(out);
    weights_proj.parameters(out);
}

Tensor DsaIndexer::score(DsaIndexerContext & ctx, const Tensor & x, const Tensor & qr, int64_t s, int64_t b) {
    Device &      device = x.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t n = s * b, dr = config.qk_pos_emb_head_dim;
    LOOM_CHECK(x.size(0) == n && qr.size(0) == n, "the DSA indexer takes every row: " << x.size(0) << " and " << qr.size(0)
                                                                                   << " rows of " << n, "");
    ctx.s     = s;
    ctx.b     = b;
    ctx.q_pos = cp.positions(s);
    const RopeScaling rope = mla_rope(config);
    // Each head turned by RoPE (at the rows' global positions) on its first dr elements, then rotated (rows of d_i,
    // one product for every head).
    auto turn = [&](Tensor t, int64_t heads_of_t) {
        ops.rope(stream, t, s, b, heads_of_t, head_dim, config.rotary_base, false, dr, config.dsa_indexer_rope_interleaved,
                 ctx.q_pos, rope);
        return rotated(t);
    };
    ctx.q = turn(in_dtype(wq_b.forward(ctx.wq_b, qr), DType::f32), heads);
    ctx.k = turn(in_dtype(k_norm.forward(ctx.k_norm, wk.forward(ctx.wk, x)), DType::f32), 1);
    if (cp.enabled()) ctx.k = gather_sequence(cp, ctx.k, s, b);   // every key of the whole sequences
    ctx.w = in_dtype(weights_proj.forward(ctx.weights_proj, x), DType::f32);
    ops.scale(stream, ctx.w, 1.0f / std::sqrt(static_cast<float>(heads * head_dim)));
    const Tensor scores = Tensor::empty({b, s, s * cp.size}, DType::f32, device, {MemoryKind::device, kActivationsPool});
    ops.dsa_index_scores(stream, ctx.q, ctx.k, ctx.w, s, b, config.dsa_indexer_scoring_relu, scores, ctx.q_pos);
    return scores;
}

Tensor DsaIndexer::select(const Tensor & scores) const {
    const int64_t b = scores.size(0), s = scores.size(1), keys = scores.size(2);
    if (config.dsa_indexer_topk >= keys) return Tensor();   // every causal key
    const Tensor mask = Tensor::empty({b, s, keys}, DType::u8, scores.device(), {MemoryKind::device, kActivationsPool});
    scores.device().ops().dsa_topk_mask(scores.device().compute_stream(), scores, config.dsa_indexer_topk, mask,
                                        cp.positions(s));
    return mask;
}

void DsaIndexer::loss_forward(DsaIndexerContext & ctx, const Tensor & scores, const Tensor & q_k_v, const Tensor & kv,
                              AttentionShape shape, float scale, const Tensor & mask, bool logged) {
    Device &      device = scores.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t s = shape.s, b = shape.b, n = s * b, keys = scores.size(2);
    const Tensor  sparse = config.dsa_indexer_use_sparse_loss ? mask : Tensor();   // undefined: every causal key
    const TensorOptions pool{MemoryKind::device, kActivationsPool};
    const Tensor        target = Tensor::empty({b, s, keys}, DType::f32, device, pool);
    // The main attention's probabilities over this rank's heads, then every head's (detached: no gradient back).
    shape.key_mask = sparse;
    ops.dsa_attention_target(stream, q_k_v, shape, scale, target, kv);
    if (tp.size > 1) tp.all_reduce(target);
    const Tensor kl = Tensor::empty({1, n}, DType::f32, device, pool);
    ctx.dscores     = Tensor::empty({b, s, keys}, DType::f32, device, pool);
    // This rank's share of the mean over every row of the whole sequences (n of them per CP rank).
    const float weight = config.dsa_indexer_loss_coeff / static_cast<float>(n * cp.size);
    ops.dsa_indexer_loss(stream, scores, target, weight, kl, ctx.dscores, sparse, ctx.q_pos);
    if (!logged) return;
    if (!ones_.defined() || ones_.size(0) != n) {
        ones_ = Tensor::empty({n, 1}, DType::f32, device, {MemoryKind::device, "dsa-metrics"});
        write_values_f32(ones_, std::vector<float>(static_cast<size_t>(n), 1.0f));
    }
    ops.gemm(stream, kl, false, ones_, false, loss, true);   // the rows' KL, summed in one product
}

void DsaIndexer::backward(DsaIndexerContext & ctx, const GradReadyFn & ready) {
    Device &      device = ctx.q.device();
    Ops &         ops    = device.ops();
    Stream &      stream = device.compute_stream();
    const int64_t s = ctx.s, b = ctx.b, n = s * b, dr = config.qk_pos_emb_head_dim;
    ops.scale(stream, ctx.dscores, loss_backward_scale);
    Tensor dq = activation(device, n, heads * head_dim), dk = activation(device, ctx.k.size(0), head_dim);
    Tensor dw = activation(device, n, heads);
    ops.dsa_index_scores_backward(stream, ctx.q, ctx.k, ctx.w, ctx.dscores, s, b, config.dsa_indexer_scoring_relu, dq, dk, dw,
                                  ctx.q_pos);
    ctx.q = ctx.k = ctx.w = ctx.dscores = Tensor();
    if (cp.enabled()) dk = reduce_scatter_sequence(cp, dk, s, b);   // every rank's queries' share, onto this rank's keys
    ops.scale(stream, dw, 1.0f / std::sqrt(static_cast<float>(heads * head_dim)));
    const RopeScaling rope = mla_rope(config);
    // The transposes of the rotation (itself) and of RoPE (the opposite angle), into the projections' dtype.
    auto unturn = [&](Tensor t, int64_t heads_of_t, DType dtype) {
        t = rotated(t);
        ops.rope(stream, t, s, b, heads_of_t, head_dim, config.rotary_base, true, dr, config.dsa_indexer_rope_interleaved,
                 ctx.q_pos, rope);
        return in_dtype(t, dtype);
    };
    // The inputs' gradients are dropped: x and qr are detached from the main model.
    weights_proj.backward(ctx.weights_proj, in_dtype(dw, weights_proj.weight.compute_dtype()), ready);
    wq_b.backward(ctx.wq_b, unturn(dq, heads, wq_b.weight.compute_dtype()), ready);
    const Tensor dk_normed = unturn(dk, 1, wk.weight.compute_dtype());
    wk.backward(ctx.wk, k_norm.backward(ctx.k_norm, dk_normed, ready), ready);
}

Tensor DsaIndexer::rotated(const Tensor & t) const {
    if (!rotation.defined()) return t;
    const int64_t rows = t.numel() / head_dim;   // every head of every row: rows of d_i
    Tensor        out  = activation(t.device(), t.size(0), t.size(1));
    t.device().ops().gemm(t.device().compute_stream(), t.view({rows, head_dim}), false, rotation, false,
                          out.view({rows, head_dim}));
    return out;
}

void DsaIndexer::skip_backward(const GradReadyFn & ready) {
    if (!ready) return;
    std::vector<Parameter *> params;
    parameters(params);
    for (Parameter * p : params) ready(*p);
}

}  // namespace loom::model
