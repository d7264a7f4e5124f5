// MoeConfig: the Mixture-of-Experts knobs, in Megatron's terms (one field per flag), their validation and
// the expert capacity.
//
// Legend: n = s * b tokens (rows) of a micro-batch, h hidden, E experts (--num-experts), k experts per
// token (--moe-router-topk), f the expert FFN hidden size (--moe-ffn-hidden-size), C the capacity.
//
// Capacity (Megatron's get_capacity on n * k assignments):
//
//   C = ceil((n * k / E) * capacity_factor)        computed in double, in that order
//
//   n = 10 tokens, k = 2, E = 4, factor 1.0  ->  C = ceil(5.0)  = 5
//   n = 10 tokens, k = 2, E = 4, factor 1.1  ->  C = ceil(5.5)  = 6
#pragma once

#include "model/gpt_config.h"

#include <cstdint>
#include <string>

namespace loom::model {

enum class MoeScoreFunction { softmax, sigmoid };                // --moe-router-score-function
enum class MoeLoadBalancing { aux_loss, seq_aux_loss, none };    // --moe-router-load-balancing-type
enum class MoeDropPolicy { probs, position };                    // --moe-token-drop-policy

struct MoeConfig {
    int64_t          num_experts          = 0;       // --num-experts (0: no MoE)
    int64_t          topk                 = 2;       // --moe-router-topk
    MoeScoreFunction score_function       = MoeScoreFunction::softmax;
    bool             pre_softmax          = false;   // --moe-router-pre-softmax
    float            topk_scaling_factor  = 0.0f;    // --moe-router-topk-scaling-factor (0: none)
    MoeLoadBalancing load_balancing       = MoeLoadBalancing::aux_loss;
    float            aux_loss_coeff       = 0.0f;    // --moe-aux-loss-coeff
    float            z_loss_coeff         = 0.0f;    // --moe-z-loss-coeff (0: none)
    float            capacity_factor      = -1.0f;   // --moe-expert-capacity-factor (< 0: none, no dropping)
    bool             pad_to_capacity      = false;   // --moe-pad-expert-input-to-capacity
    MoeDropPolicy    drop_policy          = MoeDropPolicy::probs;
    int64_t          ffn_hidden_size      = 0;       // --moe-ffn-hidden-size (0: --ffn-hidden-size)
    bool             grouped_gemm         = false;   // --moe-grouped-gemm
    int64_t          shared_expert_intermediate_size = 0;   // --moe-shared-expert-intermediate-size (0: none)

    bool    drops() const { return capacity_factor >= 0.0f; }
    int64_t expert_ffn(const GptConfig & config) const { return ffn_hidden_size > 0 ? ffn_hidden_size : config.ffn_hidden_size; }
};

// Megatron's spellings, for messages and option tables.
const char *     moe_score_function_name(MoeScoreFunction f);
const char *     moe_load_balancing_name(MoeLoadBalancing t);
const char *     moe_drop_policy_name(MoeDropPolicy p);
// Parses a --moe-router-load-balancing-type value; sinkhorn, global_aux_loss and quantile_balancing are
// Megatron's but not Loom's, and are refused by name.
MoeLoadBalancing moe_load_balancing_parse(const std::string & name);

// Megatron's checks (transformer_config.py __post_init__) that concern the single-rank layer; throws
// naming the flags.
void moe_config_validate(const MoeConfig & moe, const GptConfig & config);

// C above, for n tokens. Megatron's get_capacity(num_tokens = n * k, E, factor) without a minimum.
int64_t moe_capacity(int64_t n, int64_t num_experts, int64_t topk, double capacity_factor);

}  // namespace loom::model
