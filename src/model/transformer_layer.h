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
    TransformerLayer(int64_t index, const GptConfig & config, Device & device, const TensorParallel & tp = {},
                     const ExpertParallel & ep = {}, const ContextParallel & cp = {});
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
    void   init(uint64_t seed);
    void   parameters(std::vector<Parameter *> & out);

    // A MoE layer in two segments (MoE partial graph capture, Megatron's --cuda-graph-modules attn
    // moe_router [moe_preprocess]); forward and backward of a MoE layer are these, composed:
    //   graphable: x -> norm1, attention, dropout, residual, norm2 -> the router (and with `preprocess` the
    //              dispatch plan); static shapes, no host read. Returns its outputs.
    //   eager:     those outputs -> the dispatch plan (unless made), the host's read of each expert's row
    //              count, permutation, experts, combine, shared expert, dropout, + residual -> y.
    // Backward runs the eager segment first (the gradients of the graphable outputs), then the graphable.
    // The two may use different contexts (a graph's and an eager one); the eager segment's context only
    // needs what it was given.
    struct MoeSegment {
        Tensor hidden;     // norm2's output (n, h): the router's and the experts' input
        Tensor residual;   // h1 = x + attention (n, h)
        Tensor top_idx;    // (n, k) i32
        Tensor probs;      // (n, k) f32
        Tensor plan_probs, row_of, token_of_row, tokens_per_expert;   // with `preprocess` (token_dispatcher.h)
    };
    struct MoeSegmentGrad {
        Tensor hidden, probs, residual;   // gradients of MoeSegment's hidden, probs and residual
    };
    MoeSegment     forward_graphable(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch,
                                     bool preprocess);
    Tensor         forward_eager(Context & ctx, const MoeSegment & in, int64_t s, int64_t b, const DropoutBatch & batch);
    MoeSegmentGrad backward_eager(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    Tensor         backward_graphable(Context & ctx, const MoeSegmentGrad & grad, const GradReadyFn & ready);

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

private:
    // norm1, attention and its dropout: h1 (before the residual); sets ctx's hidden-dropout keys.
    Tensor attention_block(Context & ctx, const Tensor & x, int64_t s, int64_t b, const DropoutBatch & batch);
    // dh1 += dy, then attention's and norm1's backward: dx.
    Tensor attention_block_backward(Context & ctx, const Tensor & dh1, const Tensor & dy, const GradReadyFn & ready);
    Tensor dropped(const Dropout & key, const Tensor & g) const;
};

}  // namespace loom::model
