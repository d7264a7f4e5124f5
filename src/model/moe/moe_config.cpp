#include "model/moe/moe_config.h"

#include "core/error.h"
#include "core/ops.h"

#include <cmath>

namespace loom::model {

int64_t MoeConfig::expert_ffn(const GptConfig & config) const {
    return ffn_hidden_size > 0 ? ffn_hidden_size : config.ffn_hidden_size;
}

const char * moe_score_function_name(MoeScoreFunction f) {
    return f == MoeScoreFunction::softmax ? "softmax" : "sigmoid";
}

const char * moe_load_balancing_name(MoeLoadBalancing t) {
    switch (t) {
    case MoeLoadBalancing::aux_loss: return "aux_loss";
    case MoeLoadBalancing::seq_aux_loss: return "seq_aux_loss";
    case MoeLoadBalancing::none: return "none";
    case MoeLoadBalancing::sinkhorn: return "sinkhorn";
    case MoeLoadBalancing::global_aux_loss: return "global_aux_loss";
    }
    return "?";
}

const char * moe_drop_policy_name(MoeDropPolicy p) { return p == MoeDropPolicy::probs ? "probs" : "position"; }

MoeLoadBalancing moe_load_balancing_parse(const std::string & name) {
    if (name == "aux_loss") return MoeLoadBalancing::aux_loss;
    if (name == "seq_aux_loss") return MoeLoadBalancing::seq_aux_loss;
    if (name == "none") return MoeLoadBalancing::none;
    if (name == "sinkhorn") return MoeLoadBalancing::sinkhorn;
    if (name == "global_aux_loss") return MoeLoadBalancing::global_aux_loss;
    LOOM_CHECK(name != "quantile_balancing", "--moe-router-load-balancing-type " << name << " is not supported by Loom",
               "use aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none");
    LOOM_THROW("--moe-router-load-balancing-type " << name << " is not a load-balancing type",
               "use aux_loss, seq_aux_loss, global_aux_loss, sinkhorn or none");
}

void moe_config_validate(const MoeConfig & moe, const GptConfig & config) {
    LOOM_CHECK(moe.num_experts >= 1, "--num-experts must be >= 1, got " << moe.num_experts, "");
    LOOM_CHECK(moe.topk >= 1 && moe.topk <= moe.num_experts,
               "--moe-router-topk " << moe.topk << " must be between 1 and --num-experts " << moe.num_experts, "");
    LOOM_CHECK(!moe.router_dtype || *moe.router_dtype == DType::f32 || *moe.router_dtype == DType::f64,
               "--moe-router-dtype " << dtype_name(*moe.router_dtype), "fp32 or fp64");
    // Megatron's own message: a softmax over one selected logit is 1 whatever the logit, so the router
    // would get no gradient.
    LOOM_CHECK(!(moe.topk == 1 && moe.score_function == MoeScoreFunction::softmax && !moe.pre_softmax &&
                 moe.load_balancing != MoeLoadBalancing::sinkhorn),
               "Please use --moe-router-pre-softmax when topk is 1.",
               "a softmax over the one selected expert is always 1 and gives the router no gradient");
    LOOM_CHECK(moe.aux_loss_coeff >= 0.0f, "--moe-aux-loss-coeff must be >= 0, got " << moe.aux_loss_coeff, "");
    // Megatron's assert in sinkhorn_load_balancing, checked before any rank starts.
    LOOM_CHECK(moe.load_balancing != MoeLoadBalancing::sinkhorn || moe.aux_loss_coeff == 0.0f,
               "Sinkhorn routing does not support aux loss.",
               "--moe-router-load-balancing-type sinkhorn balances by itself: leave --moe-aux-loss-coeff at 0");
    LOOM_CHECK(moe.z_loss_coeff >= 0.0f, "--moe-z-loss-coeff must be >= 0, got " << moe.z_loss_coeff, "");
    LOOM_CHECK(moe.topk_scaling_factor >= 0.0f,
               "--moe-router-topk-scaling-factor must be > 0, got " << moe.topk_scaling_factor, "");
    // Megatron's messages (TransformerConfig), then the bounds of Loom's router: a token must find its k experts
    // among its groups', and the kept groups are a 64-bit mask.
    if (moe.group_topk > 0) {
        LOOM_CHECK(moe.num_groups > 0, "When using group limited routing, moe_router_num_groups must be specified.",
                   "give --moe-router-num-groups with --moe-router-group-topk");
        LOOM_CHECK(moe.num_experts % moe.num_groups == 0,
                   "num_moe_experts (" << moe.num_experts << ") should be divisible by moe_router_num_groups ("
                                       << moe.num_groups << ").", "");
        LOOM_CHECK(moe.group_topk <= moe.num_groups,
                   "moe_router_group_topk (" << moe.group_topk << ") should be smaller than moe_router_num_groups ("
                                             << moe.num_groups << ").", "");
        LOOM_CHECK(moe.num_groups <= kMoeMaxGroups,
                   "--moe-router-num-groups " << moe.num_groups << " is more than Loom's router takes (" << kMoeMaxGroups << ")", "");
        LOOM_CHECK(moe.topk <= moe.group_topk * (moe.num_experts / moe.num_groups),
                   "--moe-router-topk " << moe.topk << " is more than the " << moe.group_topk * (moe.num_experts / moe.num_groups)
                                        << " experts of --moe-router-group-topk " << moe.group_topk << " groups of "
                                        << moe.num_experts / moe.num_groups,
                   "a token selects its experts among its groups' only");
    }
    LOOM_CHECK(moe.num_groups >= 0 && moe.group_topk >= 0,
               "--moe-router-num-groups and --moe-router-group-topk must be >= 1 (" << moe.num_groups << ", "
                                                                                     << moe.group_topk << ")", "");
    LOOM_CHECK(!moe.expert_bias || moe.score_function == MoeScoreFunction::sigmoid,
               "Expert bias for aux-loss-free routing only supports 'sigmoid' and 'sqrtsoftplus' score functions. Please "
               "set --moe-router-score-function to 'sigmoid' or 'sqrtsoftplus', or unset --moe-router-enable-expert-bias.",
               "Loom's router has the sigmoid of the two");
    LOOM_CHECK(std::isfinite(moe.bias_update_rate),
               "--moe-router-bias-update-rate must be finite, got " << moe.bias_update_rate, "");
    LOOM_CHECK(!moe.pad_to_capacity || moe.drops(),
               "moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity",
               "--moe-pad-expert-input-to-capacity needs --moe-expert-capacity-factor");
    LOOM_CHECK(moe.expert_ffn(config) >= 1, "--moe-ffn-hidden-size must be >= 1, got " << moe.ffn_hidden_size, "");
    LOOM_CHECK(moe.shared_expert_intermediate_size >= 0,
               "--moe-shared-expert-intermediate-size must be > 0, got " << moe.shared_expert_intermediate_size, "");
    LOOM_CHECK(moe.shared_expert_intermediate_size == 0 || !config.add_bias_linear,
               "bias is not supported in the shared experts, please set '--disable-bias-linear' instead.",
               "--moe-shared-expert-intermediate-size needs --disable-bias-linear");
}

int64_t moe_capacity(int64_t n, int64_t num_experts, int64_t topk, double capacity_factor) {
    const double assignments = static_cast<double>(n * topk);
    return static_cast<int64_t>(std::ceil(assignments / static_cast<double>(num_experts) * capacity_factor));
}

}  // namespace loom::model
