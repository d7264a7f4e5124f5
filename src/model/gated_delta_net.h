// The gated delta-net (Qwen3-Next's linear attention; Megatron's GatedDeltaNet), which takes the place of softmax
// attention on the layers GptConfig::is_linear_attention_layer marks. The conventions of model/layers.h hold here.
//
// Legend: n = s b rows, h hidden, nk key heads of dk, nv value heads of dv (r = nv / nk value heads per key head),
// K the convolution's taps, C = 2 nk dk + nv dv the convolved channels. Per row, this rank's heads:
//   [q | k | v | z | b | a] = W_in x                 q, k (nk dk), v and z (nv dv), b and a (nv)
//   [q | k | v] = silu(causal depthwise conv of [q | k | v] over the sequence)     (Ops::causal_conv_silu_forward)
//   q, k = their L2 norms, head by head (eps 1e-6), each key head repeated over its r value heads
//   beta = sigmoid(b),  g = -e^A_log softplus(a + dt_bias)                          (Ops::gdn_gates_forward)
//   o = the gated delta rule of (q, k, v, g, beta), scale dk^-1/2                  (Ops::gated_delta_rule_forward)
//   y = W_out (norm(o) * silu(z))        the norm over each head's dv (--normalization, one weight for every head)
// Tensor parallelism splits the heads: W_in by rows (each of its six blocks), the convolution's channels, A_log and
// dt_bias by value heads, W_out by columns; the norm is whole on every rank and fed its own heads, so its gradient
// is summed over the group.
//
// Context parallelism (Megatron's all-to-alls for the gated delta-net): the projection's output goes from this rank's
// rows of every head of the TP rank to the whole sequence of this CP rank's share of them (each of the six blocks
// split by heads), the recurrence runs over the whole sequence, and the gated output comes back to the rows before
// W_out. The taps, A_log and dt_bias of the share are used; their gradients land in that share of the parameters'
// and the data-parallel sum over CP completes them.
//
// Precision: the convolution, the norm of q and k, the gates and the delta rule run in f32 from the projection's
// output (bf16 with --bf16); the delta rule's output is rounded to the activations' dtype before the norm, as FLA's
// kernel returns it. Backward keeps the projection's output and recomputes the f32 chain from it.
#pragma once

#include "model/layers.h"

#include <string>
#include <vector>

namespace loom::model {

// What one (layer, micro-batch) keeps for the backward (SelfAttention::Context holds it).
struct GatedDeltaNetContext {
    Linear::Context in_ctx, out_ctx;   // out_ctx.x is the gated norm's output times silu(z)
    // The recurrence's rows: this rank's (n = s b), or under CP the whole sequence's (CP s b) of its share of heads.
    Tensor          projected;         // W_in x (rows, W), in the parameters' dtype
    Norm::Context   norm;              // the delta rule's output (rows nv, dv) and its statistics
    Tensor          normed;            // the norm's output (rows, nv dv), in the parameters' dtype
    int64_t         s = 0, b = 0;      // this rank's
};

class GatedDeltaNet {
public:
    GatedDeltaNet(const std::string & name, const GptConfig & config, Device & device, const TensorParallel & tp = {},
                  const ContextParallel & cp = {});
    using Context = GatedDeltaNetContext;

    Tensor forward(Context & ctx, const Tensor & x, int64_t s, int64_t b);
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    // --recompute-modules layernorm: the input projection's kept input dropped after forward and set again from the
    // recomputed norm's rows (SelfAttention::release_input).
    void   release_input(Context & ctx) const { ctx.in_ctx.x = Tensor(); }
    void   restore_input(Context & ctx, const Tensor & x_rows) const { ctx.in_ctx.x = in_proj.input_for_backward(x_rows); }
    void   init(uint64_t seed, float std, float output_std);
    void   parameters(std::vector<Parameter *> & out);

    const GptConfig & config;
    TensorParallel    tp;
    ContextParallel   cp;
    int64_t           key_heads, value_heads;   // this TP rank's: nk / tp, nv / tp
    int64_t           dk, dv;
    Linear            in_proj;    // h -> [q | k | v | z | b | a] of this rank's heads, column-parallel
    Parameter         conv;       // (C, 1, K): this rank's q, k and v channels' taps (Megatron's conv1d.weight)
    Parameter         a_log;      // (value_heads)
    Parameter         dt_bias;    // (value_heads)
    Norm              out_norm;   // over dv
    Linear            out_proj;   // nv dv / tp -> h, row-parallel

private:
    // The heads the recurrence runs for (this TP rank's, or under CP this CP rank's share of them) and their
    // parameters' values as f32: the taps (C, K), A_log and dt_bias. The projection's rows for them are
    // [q | k | v | z | b | a] of these heads.
    struct Core {
        int64_t key_heads, value_heads;
        Tensor  taps, a_log, dt_bias;
        int64_t channels(int64_t dk, int64_t dv) const { return 2 * key_heads * dk + value_heads * dv; }   // C
    };
    Core core() const;
    // The f32 operands of the delta rule from the projection's output, and what their backwards read.
    struct Operands {
        Tensor conv_in;          // [q | k | v] before the convolution (rows, C)
        Tensor qk;               // the convolution's q and k after their norm (rows 2 key heads, dk)
        Tensor qk_rstd;          // (rows 2 key heads)
        Tensor q, k, v, g, beta;  // the delta rule's: q, k (rows, value heads dk), v (rows, value heads dv), g, beta
    };
    Operands operands(const Core & core, const Tensor & projected, int64_t s, int64_t b) const;
    // The core's gradients (rows of the taps, entries of A_log and dt_bias) added into the parameters'.
    void     add_core_grads(const Core & core, const Tensor & d_taps, const Tensor & d_a_log, const Tensor & d_dt_bias);
    // The projection's six blocks, each split over the CP ranks by heads (heads_to_sequence's columns).
    std::vector<HeadColumns> projection_columns() const;
};

}  // namespace loom::model
