// Router: the gate of a Mixture-of-Experts layer (Megatron's TopKRouter), with its load-balancing
// auxiliary loss and z-loss. Legend as moe_config.h: n tokens, h hidden, E experts, k per token.
//
//   logits (n, E) = x W^T (+ bias, with --add-bias-linear as Megatron's router)      f32
//
// Top-k (every selection orders by value and breaks ties toward the lower expert index, so routing is
// deterministic; sf is --moe-router-topk-scaling-factor, 1 when unset):
//   softmax (default, "post-softmax"): the k largest logits, then probs = sf * softmax over those k only
//                                      (which is why k = 1 needs --moe-router-pre-softmax)
//   softmax --moe-router-pre-softmax:  s = softmax over all E, the k largest s, probs = sf * s
//   sigmoid:                           g = sigmoid(logits), the k largest g,
//                                      probs = sf * g / (sum of the k g + 1e-20) when k > 1, else sf * g
//
//   with --moe-router-enable-expert-bias (sigmoid): the selection's scores are g + expert_bias, the
//                                      probabilities g's as above (DeepSeek-V3's aux-loss-free balancing)
//   with --moe-router-num-groups G --moe-router-group-topk gk: before the top-k, every expert outside the gk
//                                      groups (of E / G consecutive experts) whose k / gk largest selection
//                                      scores sum highest drops out (ties toward the lower group)
//
//   sinkhorn (--moe-router-load-balancing-type sinkhorn, Megatron's S-BASE routing): while training the
//                                      k largest of sinkhorn(logits) over the micro-batch's rows (under
//                                      sequence parallelism the TP group's rows, all-gathered: the same
//                                      selection as one rank), then probs = sigmoid(logit) for k = 1, or
//                                      the softmax over all E at the selected experts (no scaling factor);
//                                      in eval the top-k of those scores. No aux loss.
// --moe-router-dtype fp32: the gate's GEMMs (forward and both of backward) read f32 operands, the bf16
// weight's values widened and the gradient of the logits unrounded (without it, bf16 operands under --bf16).
// --moe-router-dtype fp64 (Megatron's for reinforcement learning, where training and inference must route
// alike): the input and the weight widened to f64, the GEMMs in f64 (core/gemm_f64.h), f64 logits, and every
// routing op reading them as f64 (scores, probabilities and losses are double in any case); the logits'
// gradient is f64, the input's, the weight's and the bias's are rounded to f32 once.
//
// Auxiliary load-balancing loss (Megatron's switch_load_balancing_loss_func), only while training:
//   p (n, E)  = softmax(logits) over all E (sigmoid: g / (sum over E of g + 1e-20))
//   c_i       = tokens whose top-k of p contains expert i (before any capacity dropping)
//   aux       = E * coeff / (k * T^2) * sum_i (sum_x p_xi) * c_i        over the T = n tokens
//   Balanced routing (c_i = T k / E) gives aux = coeff whatever p is, as sum_i p_xi = 1.
//   seq_aux_loss: the same per sequence (T = s tokens of sample j, the rows r with r % b == j), averaged
//   over the b samples. Its gradient reaches the logits through p only (the counts are constants).
//   global_aux_loss (Megatron's global load balancing): c_i summed over every TP x DP x CP rank, then the
//   running mean of those sums over the iteration's micro-batches so far (reset_global_counts at each
//   iteration), with T = n times those ranks; each rank's aux is its rows' share.
//   Megatron logs aux / coeff as "load_balancing_loss" ("seq_load_balancing_loss",
//   "global_load_balancing_loss").
// z-loss (ST-MoE):  z = z_coeff * mean over tokens of logsumexp(logits)^2, logged as z / z_coeff ("z_loss").
// Under sequence parallelism T is the whole sequence's tokens (tp times this rank's), c_i is summed over the
// TP group, and each rank's aux and z are its rows' share (Megatron divides the z coefficient by the TP x CP
// size for the same effect).
//
// The gradients of aux and z enter the backward multiplied by `loss_scale`, the factor the caller applies
// to the main loss's gradient (Megatron's MoEAuxLossAutoScaler.set_loss_scale: loss scale / microbatches).
#pragma once

#include "core/ops.h"
#include "core/tensor.h"
#include "model/gpt_config.h"
#include "model/layers.h"
#include "model/moe/moe_config.h"
#include "model/parameter.h"

#include <string>
#include <vector>

namespace loom::model {

// Indices into Router::Context::losses (f32, host-readable after the stream has run).
enum RouterLoss : int64_t {
    router_loss_aux        = 0,   // aux as added to the objective (coefficient included)
    router_loss_aux_logged = 1,   // aux / coeff: Megatron's "load_balancing_loss"
    router_loss_z          = 2,   // z as added to the objective
    router_loss_z_logged   = 3,   // z / z_coeff: Megatron's "z_loss"
    router_loss_count      = 4,
};

class Router {
public:
    // tp: the layer's tensor parallelism. Every TP rank holds the whole gate (marked replicated); with
    // sequence parallelism each routes its block of rows, the aux loss's counts are summed over the group,
    // and this rank's losses are its share: the group's sum is the loss of the whole sequence. Context
    // parallelism (cp) splits the sequence further: the counts are summed over TP x CP (or CP alone).
    // global: global_aux_loss's TP x DP x CP group (null: this rank alone).
    Router(const std::string & name, const GptConfig & config, const MoeConfig & moe, Device & device,
           const TensorParallel & tp = {}, const ContextParallel & cp = {},
           std::shared_ptr<comm::Communicator> global = nullptr);
    struct Context {
        Tensor  x;         // (n, h) input, in the gate's GEMM dtype
        Tensor  logits;    // (n, E) f32, or f64 with --moe-router-dtype fp64
        Tensor  top_idx;   // (n, k) i32: each token's experts, by descending score
        Tensor  probs;     // (n, k) f32: their routing probabilities
        Tensor  counts;    // (G, E) f32: c_i per aux-loss group (G = 1, or b with seq_aux_loss)
        Tensor  losses;    // (router_loss_count) f32
        int64_t groups   = 1;
        bool    aux      = false;   // aux loss computed (training, coeff > 0, a balancing type)
        bool    z        = false;   // z-loss computed (training, z_coeff > 0)
    };

    // x (n, h) rows in (s, b) order, b the micro-batch size (seq_aux_loss's samples). Enqueued on the
    // compute stream.
    void forward(Context & ctx, const Tensor & x, int64_t b, bool training = true);
    // Everything after the gate, from given logits (n, E): top-k, probs, counts, losses.
    void route(Context & ctx, const Tensor & logits, int64_t b, bool training = true);
    // dprobs (n, k): the objective's gradient w.r.t. ctx.probs. Adds the gate's gradient (from dprobs and
    // loss_scale times the aux and z gradients) into main_grad, reports it ready, returns dx (n, h).
    Tensor backward(Context & ctx, const Tensor & dprobs, float loss_scale, const GradReadyFn & ready);
    // The gradient w.r.t. the logits alone (backward without the gate's GEMMs), (n, E) of the logits' dtype.
    Tensor logits_backward(Context & ctx, const Tensor & dprobs, float loss_scale);

    void init(uint64_t seed, float std);
    void parameters(std::vector<Parameter *> & out);

    // global_aux_loss: the iteration's micro-batches start again (the running mean of the counts restarts).
    void reset_global_counts();

    // Aux-loss-free balancing (--moe-router-enable-expert-bias; undefined without it), Megatron's TopKRouter
    // buffers: the bias added to the sigmoid scores for the selection, and the tokens each expert received
    // (after capacity dropping) over this iteration's training micro-batches, counted by the MoE layer's
    // backward (once per micro-batch, so a recomputed forward does not count twice; evaluation never counts).
    // GptModel::update_moe_expert_bias sums the counts over TP x DP x CP and moves the bias.
    Tensor expert_bias;   // (E) f32, replicated over TP x DP x CP
    Tensor expert_load;   // (E) f32

    MoeConfig      moe;
    TensorParallel tp;
    ContextParallel cp;
    std::shared_ptr<comm::Communicator> global;   // global_aux_loss's TP x DP x CP ranks
    Tensor         global_counts;                 // (1, E) f32: their counts summed over this iteration's micro-batches
    Tensor         global_steps;                  // (1) f32: micro-batches in that sum, counted on the stream
    Tensor         one_;                          // (1) f32: 1, global_steps' increment
    Tensor         gate_weight() const;
    // The ranks holding rows of this rank's sequences, this one included: TP x CP, TP (sequence
    // parallelism), CP, or null (this rank alone); and how many.
    comm::Communicator * sequence_group() const;
    int                  sequence_ranks() const;
    // The losses' operands of a routed context of n rows.
    MoeRouterLoss loss_of(const Context & ctx, int64_t n) const;
    Parameter weight;   // (E, h)
    Parameter bias;     // (E), with add_bias_linear
    bool      has_bias;
};

}  // namespace loom::model
