// DeepSeek Sparse Attention's lightning indexer (DeepSeek-V3.2; Megatron's DSAIndexer, --experimental-attention-variant
// dsa): a small attention of its own that scores, for every query position i, each earlier key position j,
//
//   q = rot(RoPE(W_qb qr)) (n_i heads of d_i),   k = rot(RoPE(LayerNorm(W_k x))) (one head of d_i),
//   w = (W_w x) / sqrt(n_i d_i)                  (one weight per head),
//   I[i, j] = sum over heads h of w[i, h] relu(q[i, h] . k[j])                  (j <= i)
//
// where x is the attention's input (every row: gathered under sequence parallelism), qr the query latent (MLA's
// q_down output after its norm), RoPE turns the first qk_pos_emb_head_dim elements of each head (MLA's rotary
// settings; pairs (i, i + r/2), or interleaved) and rot is the Hadamard rotation (Sylvester's matrix over d_i,
// times 1/sqrt(d_i); --no-dsa-indexer-rotate-activation leaves it out). The main attention attends to the top
// --dsa-indexer-topk keys of each row by I (Ops::dsa_topk_mask; ties to the earlier key) and to no other key, in
// every forward, training or not; with at least as many keys as the sequence has, that is every causal key and the
// attention is MLA's own. The selection is not differentiated: the main model's gradients reach the indexer
// through its loss alone.
//
// The indexer learns from its KL loss against the main attention (--dsa-indexer-loss-coeff c): with T the
// main attention's causal probabilities summed over every head (this rank's heads, then summed over the TP
// group), normalised per row, and p = softmax(I) over j <= i,
//
//   L = c / (b s) * sum over rows of KL(T || p)
//
// whose gradient dI = c / (b s) (p - T) reaches only the indexer's weights: x, qr and the main attention are
// detached. With --dsa-indexer-use-sparse-loss both T's softmax and p run over each row's selected keys only. L is
// not added to the language-model loss; its backward enters with the auxiliary losses' scale (loss scale /
// micro-batches, as Megatron's DSAIndexerLossAutoScaler) and it is logged as "indexer loss".
//
// Under tensor parallelism every rank holds the whole indexer and computes it on every row: its gradients are
// the same on every rank (the target is summed over the group first), so nothing more is reduced.
//
// Under context parallelism (Megatron's DSA supports --cp-comm-type allgather only) each rank scores its own query
// rows (its two chunks of every sequence, at their global positions) against every key of the whole sequences: k is
// gathered over the CP group into position order, the scores, the selection, the target and the loss are (b, s, S)
// with S = CP s, and k's gradient (this rank's queries' share of every key's) is summed back onto each key's owner.
// Each rank's loss is its share of the whole sequences' mean, c / (b S) per row, as the language-model loss's.
#pragma once

#include "model/layers.h"

#include <memory>
#include <string>

namespace loom::model {

struct DsaIndexerContext {
    Linear::Context wq_b, wk, weights_proj;
    Norm::Context   k_norm;
    Tensor          q, k, w;    // f32, as the scores read them (q (n, n_i d_i) and k (S b, d_i) turned and rotated)
    Tensor          dscores;    // (b, s, S) f32: the loss's gradient of the scores, before the backward's scale
    int64_t         s = 0, b = 0;
    SeqPositions    q_pos;      // this rank's rows' positions (context parallelism)
};

class DsaIndexer {
public:
    DsaIndexer(const std::string & name, const GptConfig & config, Device & device, const TensorParallel & tp,
               const ContextParallel & cp = {});

    // The scores (b, s, S) f32 of every causal key from x (n, h) and qr (n, q_lora_rank), every row of this rank's
    // share of the micro-batch (S = CP s keys); what the loss's backward reads is kept in ctx.
    Tensor score(DsaIndexerContext & ctx, const Tensor & x, const Tensor & qr, int64_t s, int64_t b);
    // Each row's top --dsa-indexer-topk keys by the scores, the main attention's key mask (b, s, S) u8; undefined
    // when the top k holds every causal key (topk >= S).
    Tensor select(const Tensor & scores) const;
    // One training forward's loss from the scores against the main attention of q_k_v (MLA's packed rows of this
    // rank's heads, `shape` and `scale` its; shape's key mask not read) over the keys of `kv` (the whole sequences'
    // K | V rows under context parallelism, `shape` against them; undefined: q_k_v's own), added to `loss`; `mask` is
    // select()'s, read with --dsa-indexer-use-sparse-loss. What backward needs is kept in ctx. `logged`: the loss is
    // added to `loss` (not in full recompute's rerun of a forward, which logged it the first time).
    void loss_forward(DsaIndexerContext & ctx, const Tensor & scores, const Tensor & q_k_v, const Tensor & kv,
                      AttentionShape shape, float scale, const Tensor & mask, bool logged = true);
    // The loss's gradients (times loss_backward_scale) added to the indexer's weights, each reported ready.
    void backward(DsaIndexerContext & ctx, const GradReadyFn & ready);
    // Reports every weight ready with no gradient added: a pass without the loss (no coefficient, or evaluation).
    void skip_backward(const GradReadyFn & ready);
    void init(uint64_t seed, float std);
    void parameters(std::vector<Parameter *> & out);

    const GptConfig & config;
    TensorParallel    tp;
    ContextParallel   cp;
    int64_t           heads, head_dim;   // n_i, d_i
    Linear            wq_b;              // q_lora_rank -> n_i d_i
    Linear            wk;                // h -> d_i
    Norm              k_norm;            // LayerNorm over d_i
    Linear            weights_proj;      // h -> n_i
    Tensor            rotation;          // (d_i, d_i) f32: the Hadamard rotation (undefined without it)
    Tensor            loss;              // (1, 1) f32: the loss summed over training forwards since last taken
    float             loss_backward_scale = 1.0f;   // GptModel::set_aux_loss_scale

private:
    // t (rows, k d_i) f32 with each d_i-wide head multiplied by the rotation (t itself without it). The rotation is
    // symmetric: the backward applies it again.
    Tensor rotated(const Tensor & t) const;
    Tensor ones_;   // (b s, 1) f32 ones: the rows' KL summed into `loss` by a product
};

}  // namespace loom::model
