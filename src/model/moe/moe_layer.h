// MoELayer: a Mixture-of-Experts MLP (Megatron's MoELayer), on one rank or with its experts spread over an
// expert-parallel group and split over expert-tensor-parallel ranks. It replaces a transformer layer's Mlp: same input and output, (n, h)
// rows in (s, b) order.
//
//   forward:   router (logits, top-k, probs, aux and z losses)
//              -> dispatch plan (capacity dropping, padding)          token_dispatcher.h
//              -> [host reads tokens per expert, unless padded to capacity]
//              -> permute -> experts -> unpermute (weighted by probs)
//              (+ shared expert(x), with --moe-shared-expert-intermediate-size)
//   backward:  unpermute' -> experts' -> permute' (+ shared') + router' (dprobs, aux and z gradients)
//
// Wiring, as a TransformerLayer would use it in place of its Mlp:
//
//   MoELayer moe("layers.3.mlp", config, moe_config, device);   // validates moe_config
//   moe.init(seed, std, std / sqrt(2 L));
//   moe.aux_loss_backward_scale = loss_scale / num_microbatches;  // Megatron's MoEAuxLossAutoScaler scale
//   Tensor y  = moe.forward(ctx, x, s, b, training);               // ctx: one per (layer, microbatch)
//   ...   after a stream synchronize: ctx.router.losses.data<float>()[router_loss_aux_logged] is
//         Megatron's "load_balancing_loss" for this layer and microbatch (router.h)
//   Tensor dx = moe.backward(ctx, dy, ready);
//
// The aux and z losses are not part of y: their gradients are added in backward as if the objective
// included them (multiplied by aux_loss_backward_scale, as the main loss's gradient is by the caller).
// The parameters: router ("<name>.router.weight", (E, h)), the experts ("<name>.experts...", marked
// expert), the shared expert ("<name>.shared_experts.fc1.weight", ...).
//
// Unless --moe-pad-expert-input-to-capacity is set, forward drains the compute stream once (the host
// needs each expert's row count, as Megatron's dispatcher does), so it cannot be graph-captured whole.
//
// Expert parallelism (ep.size = P > 1, layers.h's ExpertParallel): EP rank r holds the L = E / P experts
// [r L, (r + 1) L) and routes its own n tokens (the router is replicated; capacity drops are decided per
// rank on its local tokens, as Megatron's router does). --moe-token-dispatcher-type picks the exchange:
//
//   alltoall:  permute by global expert (rows for rank p are experts [p L, (p + 1) L), contiguous)
//              -> all-to-all of the (E) per-expert counts; the host reads what each rank sends it
//                 (the layer's second drain of the stream)
//              -> all-to-all of the rows: received [source q][local expert j] -> sorted [j][q]
//              -> local experts -> unsorted -> all-to-all back -> unpermute (weighted by probs)
//              backward: the same exchanges in reverse on dy, and the experts' backward between them.
//   allgather: all-gather x (n, h), the routed experts (n, k; -1 where dropped) and their probs over the
//              EP group -> each rank permutes the gathered tokens routed to its experts, runs them,
//              unpermutes into (P n, h) -> reduce-scatter: every rank gets its n rows, summed over ranks.
//              backward: all-gather dy, the local backward, reduce-scatter dx and dprobs.
// Expert tensor parallelism (ETP = T > 1, layers.h): both exchanges run over the ETP x EP group instead of
// EP, so every ETP rank of an EP rank sees the tokens all its ETP peers route there:
//   alltoall:  each rank's block for EP rank p goes to all T of p's ranks (T copies in the send buffer);
//              the experts' outputs are partial sums over their feature shards, and the T partial blocks
//              that come back are added (in ETP rank order) before the unpermute. Backward mirrors it.
//   allgather: all-gather over ETP x EP; the reduce-scatter adds the partial sums with the other ranks'.
// Tensor parallelism of the dense layers (tp): the router and the shared expert are the layer's; with
// sequence parallelism (which training with TP > 1 requires, as Megatron does) each rank routes its block of
// the sequence's rows, and the router's losses are shares of the whole sequence's (router.h).
//
// Both give each token sum_j probs[t, j] expert_{e_j}(x[t]); with k = 2 the two terms are added in one
// order or the other, which float addition does not tell apart. --moe-pad-expert-input-to-capacity keeps
// its single-rank meaning for alltoall (every expert receives P C rows); allgather runs the kept rows only
// (the padding rows contribute nothing to the result).
#pragma once

#include "model/layers.h"
#include "model/moe/experts.h"
#include "model/moe/moe_config.h"
#include "model/moe/router.h"
#include "model/moe/token_dispatcher.h"

#include <memory>

namespace loom::model {

// What one (MoE layer, micro-batch) saves for backward (a namespace-level struct, so layers.h can name it
// before this header).
struct MoeLayerContext {
    Router::Context  router;
    DispatchPlan     plan;
    Experts::Context experts;
    Mlp::Context     shared;
    Tensor           yp;         // (R, h) the experts' outputs, for the probabilities' gradient
    Tensor           shared_x, shared_m, shared_logits;   // --moe-shared-expert-gate: its input, ungated output, logits
    int64_t          rows = 0;   // R
    // Expert parallelism:
    std::vector<int64_t> send_rows, recv_rows;   // alltoall: rows to each EP rank, from each exchange rank
    std::vector<int64_t> local_counts;           // rows of each local expert (in the sorted order)
    std::vector<int32_t> sort, unsort;           // alltoall: received -> local-expert-major rows, and back
    DispatchPlan         gathered;               // allgather: the local experts' plan over all EP ranks' tokens
    int64_t              local_rows = 0;         // rows the local experts ran
};

class MoELayer {
public:
    MoELayer(const std::string & name, const GptConfig & config, const MoeConfig & moe, Device & device,
             const TensorParallel & tp = {}, const ExpertParallel & ep = {}, const ContextParallel & cp = {});
    MoELayer(const MoELayer &) = delete;   // the experts hold references into it
    MoELayer & operator=(const MoELayer &) = delete;

    using Context = MoeLayerContext;

    // x (n, h) f32, n = s b rows in (s, b) order; training: compute the aux and z losses.
    Tensor forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, bool training = true);
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);

    // The same in two segments (MoE partial graph capture, graphs/layer_graph_runner.h): forward is
    // forward_router then forward_experts, backward is backward_experts then backward_router, kernel for
    // kernel. The router segment has static shapes and no host read: the router, and with `with_plan` the
    // dispatch plan (Megatron's moe_preprocess). forward_experts needs ctx.plan (from forward_router, or set
    // by the caller from the router's outputs), reads the experts' row counts on the host unless padded,
    // and runs the permutation, experts, combine and shared expert. backward_experts returns the gradients
    // of the router segment's outputs: dx (of x, without the router's share) and dprobs; backward_router
    // adds the router's share into dx, in place, and returns it.
    void   forward_router(Context & ctx, const Tensor & x, int64_t b, bool training, bool with_plan);
    Tensor forward_experts(Context & ctx, const Tensor & x);
    void   backward_experts(Context & ctx, const Tensor & dy, const GradReadyFn & ready, Tensor & dx, Tensor & dprobs);
    Tensor backward_router(Context & ctx, const Tensor & dx, const Tensor & dprobs, const GradReadyFn & ready);

    // The split for a caller that keeps the router segment's outputs apart from its context (a graph's held
    // tensors, graphs/layer_graph_runner.h), as plain lists. router_outputs: x, the top-k ids and
    // probabilities, then the plan's probs, row_of, token_of_row and tokens_per_expert (undefined without
    // `with_plan`). forward_experts_from runs forward_experts from such a list, which another context may
    // have made: the routing (and the plan, when made) go into ctx first. backward_experts_to returns
    // backward_experts' (dx, dprobs); backward_router_from takes that list (in buffers of router_grad_shapes:
    // f32, for `rows` tokens).
    std::vector<Tensor>               router_outputs(const Context & ctx, const Tensor & x) const;
    Tensor                            forward_experts_from(Context & ctx, const std::vector<Tensor> & outputs);
    std::vector<Tensor>               backward_experts_to(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    Tensor                            backward_router_from(Context & ctx, const std::vector<Tensor> & grads, const GradReadyFn & ready);
    std::vector<std::vector<int64_t>> router_grad_shapes(int64_t rows) const;
    // Router and experts N(0, std) (the experts' fc2 and the shared expert's fc2: output_std), biases 0.
    void   init(uint64_t seed, float std, float output_std);
    void   parameters(std::vector<Parameter *> & out);
    // FP8 GEMMs in the experts (Experts::set_fp8) and the shared expert's linear layers; the router stays in
    // its own dtype, as Megatron's.
    void   set_fp8(const Linear::Fp8 & formats);
    void   set_fp8_delayed(Fp8DelayedMetas & metas);   // --fp8-recipe delayed: the same GEMMs' slots

    float                   aux_loss_backward_scale = 1.0f;
    MoeConfig               moe;
    ExpertParallel          ep;
    GptConfig               shared_config;   // the model's, with ffn_hidden_size = the shared expert's
    Router                  router;
    Experts                 experts;
    std::unique_ptr<Mlp>    shared_expert;   // with --moe-shared-expert-intermediate-size
    // --moe-shared-expert-gate (Qwen3-Next; Megatron's SharedExpertMLP.gate_weight, (1, h)): the shared expert's
    // output scaled row by row by sigmoid(x w), x its input. Whole on every TP rank, fed its own rows under SP.
    std::optional<Parameter> shared_gate;

private:
    // The routed experts' part of the output (and its backward) by dispatcher.
    Tensor local_forward(Context & ctx, const Tensor & x);
    Tensor local_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready);
    Tensor alltoall_forward(Context & ctx, const Tensor & x);
    Tensor alltoall_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready);
    Tensor allgather_forward(Context & ctx, const Tensor & x);
    Tensor allgather_backward(Context & ctx, const Tensor & dy, Tensor & dprobs, const GradReadyFn & ready);
    void   experts_ready(const GradReadyFn & ready);   // no rows: the experts' gradients are final as they are
    comm::Communicator & exchange() const;             // the dispatcher's group: ETP x EP, or EP
    // Rows per exchange rank from rows per EP rank (each repeated for the EP rank's T ETP ranks).
    std::vector<int64_t> exchange_rows(const std::vector<int64_t> & per_ep_rank) const;
};

}  // namespace loom::model
