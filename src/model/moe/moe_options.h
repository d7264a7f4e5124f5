// MoeConfig: the Mixture-of-Experts knobs, in Megatron's terms (one field per flag). A plain header, so
// GptConfig can hold one; moe_config.h has the validation and the capacity.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <optional>
#include <vector>

namespace loom::model {

struct GptConfig;

enum class MoeScoreFunction { softmax, sigmoid };                // --moe-router-score-function
enum class MoeLoadBalancing { aux_loss, seq_aux_loss, none, sinkhorn, global_aux_loss };   // --moe-router-load-balancing-type
enum class MoeDropPolicy { probs, position };                    // --moe-token-drop-policy
enum class MoeDispatcher { allgather, alltoall };                // --moe-token-dispatcher-type

struct MoeConfig {
    int64_t          num_experts          = 0;       // --num-experts (0: no MoE)
    int64_t          topk                 = 2;       // --moe-router-topk
    MoeScoreFunction score_function       = MoeScoreFunction::softmax;
    bool             pre_softmax          = false;   // --moe-router-pre-softmax
    float            topk_scaling_factor  = 0.0f;    // --moe-router-topk-scaling-factor (0: none)
    int64_t          num_groups           = 0;       // --moe-router-num-groups (0: None)
    int64_t          group_topk           = 0;       // --moe-router-group-topk (0: None, no group-limited routing)
    bool             expert_bias          = false;   // --moe-router-enable-expert-bias (aux-loss-free balancing)
    float            bias_update_rate     = 1e-3f;   // --moe-router-bias-update-rate
    MoeLoadBalancing load_balancing       = MoeLoadBalancing::aux_loss;
    float            aux_loss_coeff       = 0.0f;    // --moe-aux-loss-coeff
    float            z_loss_coeff         = 0.0f;    // --moe-z-loss-coeff (0: none)
    float            capacity_factor      = -1.0f;   // --moe-expert-capacity-factor (< 0: none, no dropping)
    bool             pad_to_capacity      = false;   // --moe-pad-expert-input-to-capacity
    MoeDropPolicy    drop_policy          = MoeDropPolicy::probs;
    int64_t          ffn_hidden_size      = 0;       // --moe-ffn-hidden-size (0: --ffn-hidden-size)
    bool             grouped_gemm         = false;   // --moe-grouped-gemm
    int64_t          shared_expert_intermediate_size = 0;   // --moe-shared-expert-intermediate-size (0: none)
    bool             shared_expert_gate = false;   // --moe-shared-expert-gate: the shared expert's output times sigmoid(x w)
    MoeDispatcher    dispatcher           = MoeDispatcher::allgather;   // --moe-token-dispatcher-type
    // --moe-router-dtype: the gate's GEMMs and the logits in f32 or f64 (nullopt: the model's dtype's GEMM
    // operands into f32 logits).
    std::optional<DType> router_dtype;

    // --moe-layer-freq: which layers are MoE. An integer N: layers 0, N, 2N, ... (Megatron's default 1: all);
    // a list: one 0/1 entry per layer of the whole model.
    int64_t          layer_freq           = 1;
    std::vector<int> layer_pattern;

    bool    enabled() const { return num_experts > 0; }
    bool    drops() const { return capacity_factor >= 0.0f; }
    int64_t expert_ffn(const GptConfig & config) const;   // ffn_hidden_size, or the model's
    bool    is_moe_layer(int64_t layer) const {
        if (!enabled()) return false;
        if (!layer_pattern.empty()) return layer < static_cast<int64_t>(layer_pattern.size()) && layer_pattern[static_cast<size_t>(layer)] != 0;
        return layer_freq >= 1 && layer % layer_freq == 0;
    }
};

}  // namespace loom::model
