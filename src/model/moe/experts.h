// Experts: the E expert MLPs of a MoE layer, run on the permuted rows (token_dispatcher.h), expert e on
// its block of rows [offset_e, offset_e + count_e). Each expert is fc1 h -> f (2f with SwiGLU), the
// model's activation, fc2 f -> h, with biases under --add-bias-linear (Megatron's experts are MLPs of the
// model's config with --moe-ffn-hidden-size). The routing probabilities are applied by the unpermute,
// which equals Megatron's scaling of each row after the activation (and of the fc2 bias) in exact arithmetic.
//
// Two layouts of the same model (the same values from the same seed, see init):
//   sequential (Megatron's SequentialMLP): E Mlp layers, parameters "<name>.<e>.fc1.weight" (F1, h), ...;
//   grouped (--moe-grouped-gemm, Megatron's GroupedMLP): one tensor per kind over all experts,
//     "<name>.fc1.weight" (E, F1, h), "<name>.fc1.bias" (E, F1), "<name>.fc2.weight" (E, h, f),
//     "<name>.fc2.bias" (E, h); every expert's GEMM reads its slice of the one weight, and the activation
//     runs once over all R rows. Same GEMM shapes and elementwise kernels: bitwise the sequential result.
// F1 = f, or 2f with SwiGLU.
//
// With expert parallelism an Experts holds the L = E / EP experts [first, first + L) (model/moe/moe_layer.h)
// and runs only them: rows and counts are of its local experts. Names use the GLOBAL expert index, so
// every layout draws the single-rank model's values and checkpoints line up: sequential experts are whole
// tensors "<name>.<first + j>.fc1.weight"; a grouped tensor (L, F1, h) is the slice [first, first + L) of
// dim 0 of the full (E, F1, h), marked as such in its tp_slice (the checkpoint assembles and reshards it as
// any tensor-parallel slice).
//
// Expert tensor parallelism (`shard`: a TensorParallel with no group, size ETP): each sequential expert is an
// Mlp split as tensor parallelism splits one (fc1 by output features, fc2 by input features, marked as TP
// slices), and its output is this rank's partial sum over its features, summed by the dispatcher; the
// input gradient is likewise partial. No collective runs here. A grouped tensor is split the same way
// along dim 1 (fc1) or 2 (fc2), and with EP also along dim 0 (TpSlice's outer range). Biases are refused
// with ETP > 1 (each ETP rank would add the bias to its partial sum).
#pragma once

#include "model/gpt_config.h"
#include "model/layers.h"
#include "model/moe/moe_config.h"

#include <memory>
#include <vector>

namespace loom::model {

class Experts {
public:
    // first, count: the global indices of this rank's experts (count -1: all E); shard: this rank's place
    // among the expert-tensor-parallel ranks (size 1: whole experts).
    Experts(const std::string & name, const GptConfig & config, const MoeConfig & moe, Device & device,
            int64_t first = 0, int64_t count = -1, const TensorParallel & shard = {});
    Experts(const Experts &) = delete;             // the Mlps hold a reference to expert_config
    Experts & operator=(const Experts &) = delete;

    struct Context {
        std::vector<int64_t>     counts;    // (L) rows of each local expert
        std::vector<Mlp::Context> mlp;      // sequential: one per expert
        Tensor                   x, act;    // grouped: fc1 and fc2 inputs (R, h), (R, f), in the weights' dtype
        Tensor                   pre_act;   // grouped: (R, F1) in the weights' dtype
        Tensor                   fp8_scales;   // grouped, delayed FP8: the local experts' forward scales (4 L)
    };

    // xp (R, h) f32 with R = the sum of counts -> (R, h) f32.
    Tensor forward(Context & ctx, const Tensor & xp, const std::vector<int64_t> & counts);
    Tensor backward(Context & ctx, const Tensor & dyp, const GradReadyFn & ready);
    // Every expert's weights N(0, std) (fc2: output_std), biases 0; the grouped slices draw under the
    // sequential names, so both layouts start from the same values.
    void init(uint64_t seed, float std, float output_std);
    void parameters(std::vector<Parameter *> & out);
    // FP8 GEMMs (--fp8-format, tensorwise): each expert's fc1 and fc2, forward and backward, with its own rows'
    // and its own weight's scales, as Transformer Engine's grouped linear quantizes each GEMM of the group
    // apart (the sequential experts' Linears; the grouped loop calls fp8_product per expert).
    void set_fp8(const Linear::Fp8 & formats);
    // --fp8-recipe delayed: slots for every global expert (forward: fc1's x and W, fc2's x and W; backward: fc1's
    // and fc2's dy), the same on every rank whatever its experts, so the histories reduce over the stage's ranks
    // and checkpoint as one state. The sequential experts' Linears take their expert's slots.
    void set_fp8_delayed(Fp8DelayedMetas & metas);
    Fp8Delayed * fp8_forward_meta = nullptr, * fp8_backward_meta = nullptr;
    int64_t      fp8_forward_base = 0, fp8_backward_base = 0;   // global expert 0's first slots

    GptConfig                         expert_config;   // the model's, with ffn_hidden_size = f
    int64_t                           num_experts;      // L, the local experts
    int64_t                           first_expert = 0; // the global index of local expert 0
    int64_t                           ffn;              // f (this rank's f / ETP when sharded)
    TensorParallel                    shard;            // ETP: no group, only the rank and size
    bool                              grouped;
    std::string                       name;
    std::vector<std::unique_ptr<Mlp>> local;            // sequential
    Parameter fc1_weight, fc1_bias, fc2_weight, fc2_bias;   // grouped: (L, F1, h), (L, F1), (L, h, f), (L, h)
    std::optional<Linear::Fp8>        fp8;

private:
    // fc1's rows held by ETP rank r of an expert with F features: its block of them ([gate | up]'s with SwiGLU).
    std::vector<std::pair<int64_t, int64_t>> etp_rows(int64_t F, int64_t r) const;
    enum class Pass { forward, backward };   // what `a` of gemm is: a forward input, or a gradient
    // c (f32) = op(a) op(w): a GEMM, or with fp8 the FP8 product (a in the pass's format, w in forward's).
    void gemm(const Tensor & a, Pass pass, bool trans_a, const Tensor & w, bool trans_w, const Tensor & c,
              const Tensor & w_scale_inv, const Fp8Delayed::Operand * da = nullptr,
              const Fp8Delayed::Operand * dw = nullptr) const;
    // Expert e's 1 / s when `w` holds FP8 codes (--fp8-param-gather), else undefined.
    static Tensor scale_inv(const Parameter & w, int64_t e);
    // g += dy^T x, as gemm (dy in backward's format, x in forward's).
    void weight_grad(const Tensor & dy, const Tensor & x, const Tensor & g, const Fp8Delayed::Operand * ddy = nullptr,
                     const Fp8Delayed::Operand * dx = nullptr) const;
    // Delayed FP8 operands of local expert e: forward slot k (0 fc1 x, 1 fc1 W, 2 fc2 x, 3 fc2 W), recorded; the
    // forward's scale k from ctx (not recorded); backward slot k (0 fc1 dy, 1 fc2 dy), recorded or not.
    Fp8Delayed::Operand delayed_forward(int64_t e, int k) const;
    Fp8Delayed::Operand delayed_kept(const Context & ctx, int64_t e, int k) const;
    Fp8Delayed::Operand delayed_backward(int64_t e, int k, bool record) const;
    Tensor grouped_forward(Context & ctx, const Tensor & xp);
    Tensor grouped_backward(Context & ctx, const Tensor & dyp, const GradReadyFn & ready);
};

}  // namespace loom::model
