// The transformer layer: the pre-norm block that composes the building blocks of model/layers.h, with a
// dense MLP or a Mixture of Experts (model/moe/moe_layer.h). The conventions of model/layers.h hold here:
// explicit forward and backward, contexts owned by the caller, gradients reported through `ready`.
#pragma once

#include "model/layers.h"
#include "model/moe/moe_layer.h"

#include <memory>
#include <vector>

namespace loom::model {

// Pre-norm block: h1 = x + drop(attn(norm1(x))), then h1 + drop(mlp(norm2(h1))), each drop Megatron's
// hidden dropout (its bias-dropout-add; the bias is added before the mask). The MLP is a Mixture of
// Experts (model/moe/moe_layer.h) where config.moe says this layer is one (--num-experts, --moe-layer-freq).
class TransformerLayer {
public:
    // `index` orders the layer in the model (dropout keys, MoE or dense: GptConfig::is_moe_layer); its
    // parameters are named "<prefix>.norm1.weight", ..., the prefix "layers.<index>" unless given (an MTP
    // depth's layer, index num_layers + k: "mtp.layers.<k>.transformer_layer").
    TransformerLayer(int64_t index, const GptConfig & config, Device & device, const TensorParallel & tp = {},
                     const ExpertParallel & ep = {}, const ContextParallel & cp = {}, const std::string & prefix = "");
    ~TransformerLayer();
    struct Context {
        Norm::Context                    norm1, norm2;
        SelfAttention::Context           attn;
        Mlp::Context                     mlp;
        std::shared_ptr<MoeLayerContext> moe;                // MoE layers
        Dropout                          attn_out, mlp_out;  // the hidden dropouts' keys
    };

    Tensor forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch = {});
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    // --fine-grained-activation-offloading: the selected modules' saved inputs (config.offload_modules) to
    // pinned host memory, and back to device memory (the activations pool); forward and backward call them.
    // A tensor two fields share moves once and both fields follow it. Bytes moved out (offload) or in.
    int64_t offload_activations(Context & ctx) const;
    int64_t reload_activations(Context & ctx) const;
    void   init(uint64_t seed);
    void   parameters(std::vector<Parameter *> & out);

    // A layer in two segments (partial graph capture captures the head: Megatron's --cuda-graph-modules attn
    // moe_router [moe_preprocess] for MoE layers, attn for dense ones). A MoE layer splits where its MoE
    // layer splits (MoELayer::router_outputs), and its forward and backward are these, composed:
    //   head: x -> norm1, attention, dropout, residual, norm2, the router (with `with_plan` the dispatch
    //         plan): fixed shapes, no host read. Returns h1 = x + attention, then the MoE layer's router
    //         outputs.
    //   tail: the head's outputs -> the experts (the host reads each expert's row count), dropout, + h1 -> y.
    // A dense layer's head ends at norm2 and returns {h1, norm2's output}; its tail is the MLP, dropout and
    // + h1: the operations of forward() and backward() in their order, so the bits are theirs (norm2's
    // output is kept by the MLP where --recompute-modules layernorm would recompute it).
    // Backward runs the tail first, which returns the gradients of the head's outputs that have one (d h1,
    // then the MoE layer's or the MLP's); backward_head takes them, in buffers of head_grad_shapes (the
    // activations' dtype for d h1 and a dense layer's, f32 for a MoE layer's) where the caller keeps them.
    // Head and tail may use different contexts (a graph's and an eager one): the tail needs only the head's
    // outputs. With at_norm2 (--cuda-graph-modules attn) a MoE layer splits as a dense one: the head ends at
    // norm2, {h1, norm2's output}, and the tail is the whole MoE layer (router, experts), the same operations
    // in the same order as forward() and backward().
    std::vector<Tensor> forward_head(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch,
                                     bool with_plan, bool at_norm2 = false);
    Tensor              forward_tail(Context & ctx, const std::vector<Tensor> & head, int64_t s, int64_t b,
                                     const DropoutBatch & batch, bool at_norm2 = false);
    std::vector<Tensor> backward_tail(Context & ctx, const Tensor & dy, const GradReadyFn & ready, bool at_norm2 = false);
    Tensor              backward_head(Context & ctx, const std::vector<Tensor> & grads, const GradReadyFn & ready,
                                      bool at_norm2 = false);
    std::vector<std::vector<int64_t>> head_grad_shapes(int64_t rows, bool at_norm2 = false) const;

private:
    // norm2's output widened into the MoE layer, its router run (the dispatch plan too with with_plan) and its
    // losses added: the router's outputs.
    std::vector<Tensor> forward_router(Context & ctx, const Tensor & normed, int64_t b, const DropoutBatch & batch, bool with_plan);

public:

    const GptConfig & config;
    int64_t           index;   // in the whole model
    Norm              norm1;
    SelfAttention     attention;
    Norm              norm2;
    std::unique_ptr<Mlp>      mlp;   // dense layers
    std::unique_ptr<MoELayer> moe;   // MoE layers
    // MoE layers: the router's logged losses (router.h's four entries) summed over this layer's training
    // forwards since the trainer last read and cleared them (Megatron's MoE metrics tracker).
    Tensor            moe_losses;
    // --fp8-recipe delayed: this layer's GEMM operands' amax histories and scales (model/fp8_delayed.h), updated
    // after each training forward and backward of the layer, reduced over fp8_group (the stage's TP x DP x CP).
    Fp8DelayedMetas                     fp8_delayed;
    std::shared_ptr<comm::Communicator> fp8_group;

private:
    // forward and backward without delayed FP8's updates.
    Tensor forward_layer(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch);
    Tensor backward_layer(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    // norm1, attention and its dropout: h1 (before the residual); sets ctx's hidden-dropout keys.
    Tensor attention_block(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch);
    // attention's and norm1's backward from d h1, which norm1's pass also adds to dx (the residual path): dx.
    Tensor attention_block_backward(Context & ctx, const Tensor & dh1, const GradReadyFn & ready);
    Tensor dropped(const Dropout & key, const Tensor & g) const;
};

}  // namespace loom::model
