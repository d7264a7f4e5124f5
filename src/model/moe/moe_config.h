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
#include "model/moe/moe_options.h"

#include <cstdint>
#include <string>

namespace loom::model {

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
