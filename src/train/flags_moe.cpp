// --num-experts and --moe-*: Megatron's defaults, choices and checks (arguments.py, transformer_config.py,
// model/moe/moe_config.h); what Loom's experts cannot do is refused by name.
#include "core/error.h"
#include "model/moe/moe_config.h"
#include "train/flag_values.h"
#include "train/layer_pattern.h"
#include "train/options.h"

#include <cstdlib>

namespace loom::train {

namespace {

using json = nlohmann::json;
using E    = MoeFlags;

const Flag<MoeFlags> kMoeFlags[] = {
    {"--num-experts", kLoomGroup, &E::num_experts, "experts per MoE layer (none: dense MLPs)", kPlain,
     {"num_experts", [](const TrainOptions & o) -> json {
          return o.model.moe.enabled() ? json(o.model.moe.num_experts) : json(nullptr);   // Megatron's None
      }, true}},
    {"--moe-layer-freq", kLoomGroup, &E::layer_freq,
     "which layers are MoE: an integer N (layers 0, N, 2N, ...) or a Python list expression such as "
     "\"([1]*3+[0]*1)*2\" with one entry per layer", kShowDefault,
     {"moe_layer_freq", [](const TrainOptions & o) -> json {
          const model::MoeConfig & moe = o.model.moe;
          return !moe.enabled() ? json(1) : moe.layer_pattern.empty() ? json(moe.layer_freq) : json(moe.layer_pattern);
      }, true}},
    {"--moe-ffn-hidden-size", kLoomGroup, &E::ffn, "each expert's MLP width (default --ffn-hidden-size)", kPlain,
     {"moe_ffn_hidden_size", [](const TrainOptions & o) -> json {
          return o.model.moe.enabled() ? json(o.model.moe.expert_ffn(o.model)) : json(nullptr);
      }, true}},
    {"--moe-router-topk", kLoomGroup, &E::topk, "experts per token", kShowDefault},
    {"--moe-router-score-function", kLoomGroup, &E::score_function, "softmax or sigmoid", kShowDefault},
    {"--moe-router-pre-softmax", kLoomGroup, &E::pre_softmax, "softmax over all experts before the top-k"},
    {"--moe-router-topk-scaling-factor", kLoomGroup, &E::topk_scaling, "multiplies the routing probabilities"},
    {"--moe-router-num-groups", kLoomGroup, &E::num_groups,
     "group-limited routing: the experts in this many groups of consecutive experts (DeepSeek's device- or "
     "node-limited routing)"},
    {"--moe-router-group-topk", kLoomGroup, &E::group_topk,
     "group-limited routing: each token keeps the groups whose top (topk / group-topk) scores sum highest, and "
     "selects its experts among theirs"},
    {"--moe-router-enable-expert-bias", kLoomGroup, &E::expert_bias,
     "aux-loss-free balancing (sigmoid scores): each expert's bias joins its score for the selection only, and "
     "after each iteration moves by the update rate toward the experts that got fewer than the mean tokens over "
     "the TP x DP x CP ranks"},
    {"--moe-router-bias-update-rate", kLoomGroup, &E::bias_update_rate, "the expert bias's step per iteration",
     kShowDefault},
    {"--moe-router-load-balancing-type", kLoomGroup, &E::load_balancing,
     "aux_loss, seq_aux_loss, global_aux_loss (counts over every TP x DP x CP rank, their mean over the "
     "iteration's micro-batches), sinkhorn (S-BASE: balanced by Sinkhorn's algorithm, no aux loss) or none", kShowDefault},
    {"--moe-router-dtype", kLoomGroup, &E::router_dtype,
     "fp32: the router's GEMMs and logits in f32 under --bf16; fp64: in f64, every routing op reading f64 logits. "
     "Default: the model's dtype's GEMM operands into f32 logits"},
    {"--moe-aux-loss-coeff", kLoomGroup, &E::aux_loss_coeff, "the load-balancing loss's coefficient", kShowDefault},
    {"--moe-z-loss-coeff", kLoomGroup, &E::z_loss_coeff, "the router z-loss's coefficient (default: none)"},
    {"--moe-per-layer-logging", kLoomGroup, &E::per_layer_logging,
     "each layer's router losses to TensorBoard as well (moe/<name>_layer_<i>, every layer of the model)"},
    {"--moe-expert-capacity-factor", kLoomGroup, &E::capacity_factor,
     "each expert takes at most ceil(tokens x topk / experts x factor) tokens; the rest are dropped "
     "(default: none, dropless)"},
    {"--moe-pad-expert-input-to-capacity", kLoomGroup, &E::pad, "pad every expert's input to its capacity"},
    {"--moe-token-drop-policy", kLoomGroup, &E::drop_policy, "probs (keep the most probable) or position (the first)",
     kShowDefault},
    {"--moe-grouped-gemm", kLoomGroup, &E::grouped_gemm, "every expert's GEMMs in one grouped call (bitwise the loop)",
     kPlain, {"moe_grouped_gemm", [](const TrainOptions & o) -> json { return o.model.moe.grouped_gemm; }, true}},
    {"--moe-shared-expert-intermediate-size", kLoomGroup, &E::shared_ffn, "a shared expert of this width", kPlain,
     {"moe_shared_expert_intermediate_size", [](const TrainOptions & o) -> json {
          const int64_t shared = o.model.moe.shared_expert_intermediate_size;
          return shared > 0 ? json(shared) : json(nullptr);
      }, true}},
    {"--moe-shared-expert-gate", kLoomGroup, &E::shared_gate,
     "the shared expert's output scaled by sigmoid(x w) of its input (Qwen3-Next; no effect without a shared expert, "
     "as in Megatron)", kPlain,
     {"moe_shared_expert_gate", [](const TrainOptions & o) -> json { return o.model.moe.shared_expert_gate; }, true}},
    {"--moe-token-dispatcher-type", kLoomGroup, &E::dispatcher,
     "how tokens reach the expert-parallel ranks' experts: allgather (gather every rank's tokens, reduce-scatter "
     "the outputs) or alltoall (send each token to its experts' ranks); with --expert-model-parallel-size 1 "
     "both permute the same tokens on one rank", kShowDefault},
};

}  // namespace

std::span<const Flag<MoeFlags>> moe_flags() { return kMoeFlags; }

namespace {

// Megatron raises this in MoELayer.forward while training; Loom refuses before any rank starts.
void check_moe_sequence_parallel(const TrainOptions & o) {
    LOOM_CHECK(o.parallel.tp() == 1 || o.sequence_parallel,
               "During training, performance may degrade if MoE and tensor parallelism are enabled without also enabling "
               "sequence parallelism.",
               "add --sequence-parallel to the experts (--num-experts, or a preset's) with --tensor-model-parallel-size "
                   << o.parallel.tp());
}

}  // namespace

void resolve_moe(const MoeFlags & f, const Given & given, TrainOptions & o) {
    model::MoeConfig & moe = o.model.moe;
    // Megatron's TransformerConfig check of an overlap choice Loom accepts without effect.
    LOOM_CHECK(!given("--delay-wgrad-compute") || given("--overlap-moe-expert-parallel-comm"),
               "overlap_moe_expert_parallel_comm must be enabled when enabling delay_wgrad_compute",
               "add --overlap-moe-expert-parallel-comm, or drop --delay-wgrad-compute");
    o.moe_per_layer_logging = f.per_layer_logging;   // without MoE layers there is nothing to log
    if (!given("--num-experts")) {
        for (const char * flag : {"--moe-ffn-hidden-size", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size"}) {
            LOOM_CHECK(!given(flag), flag << " without --num-experts", "add --num-experts E to make the MLPs Mixtures of Experts");
        }
        if (moe.enabled()) check_moe_sequence_parallel(o);   // a preset's experts (deepseek-v3)
        return;
    }
    LOOM_CHECK(f.num_experts >= 1, "--num-experts must be >= 1, got " << f.num_experts, "");
    moe.num_experts = f.num_experts;
    moe.topk        = f.topk;
    LOOM_CHECK(f.score_function == "softmax" || f.score_function == "sigmoid",
               "--moe-router-score-function " << f.score_function << " is not supported by Loom", "use softmax or sigmoid");
    moe.score_function      = f.score_function == "sigmoid" ? model::MoeScoreFunction::sigmoid : model::MoeScoreFunction::softmax;
    moe.pre_softmax         = f.pre_softmax;
    moe.topk_scaling_factor = given("--moe-router-topk-scaling-factor") ? f.topk_scaling : 0.0f;
    moe.num_groups          = f.num_groups;
    moe.group_topk          = f.group_topk;
    moe.expert_bias         = f.expert_bias;
    moe.bias_update_rate    = f.bias_update_rate;
    LOOM_CHECK(f.load_balancing.size() == 1 && f.aux_loss_coeff.size() == 1,
               "--moe-router-load-balancing-type and --moe-aux-loss-coeff with several values (combined balancing losses) "
               "are not supported by Loom", "give one type and one coefficient");
    moe.load_balancing = model::moe_load_balancing_parse(f.load_balancing[0]);
    LOOM_CHECK(!given("--moe-router-dtype") || f.router_dtype == "fp32" || f.router_dtype == "fp64",
               "argument --moe-router-dtype: invalid choice: '" << f.router_dtype << "' (choose from 'fp32', 'fp64')", "");
    if (given("--moe-router-dtype")) moe.router_dtype = f.router_dtype == "fp64" ? DType::f64 : DType::f32;
    moe.aux_loss_coeff = f.aux_loss_coeff[0];
    moe.z_loss_coeff   = given("--moe-z-loss-coeff") ? f.z_loss_coeff : 0.0f;
    moe.capacity_factor = given("--moe-expert-capacity-factor") ? f.capacity_factor : -1.0f;
    LOOM_CHECK(!given("--moe-expert-capacity-factor") || f.capacity_factor >= 0.0f,
               "--moe-expert-capacity-factor must be >= 0, got " << f.capacity_factor, "");
    moe.pad_to_capacity = f.pad;
    LOOM_CHECK(f.drop_policy == "probs" || f.drop_policy == "position",
               "argument --moe-token-drop-policy: invalid choice: '" << f.drop_policy << "' (choose from 'probs', 'position')", "");
    moe.drop_policy     = f.drop_policy == "position" ? model::MoeDropPolicy::position : model::MoeDropPolicy::probs;
    moe.ffn_hidden_size = f.ffn;
    moe.grouped_gemm    = f.grouped_gemm;
    moe.shared_expert_intermediate_size = f.shared_ffn;
    moe.shared_expert_gate              = f.shared_gate && f.shared_ffn > 0;   // Megatron's MoE layer reads it with one
    LOOM_CHECK(f.dispatcher == "allgather" || f.dispatcher == "alltoall" || f.dispatcher == "flex",
               "argument --moe-token-dispatcher-type: invalid choice: '" << f.dispatcher
                                                                         << "' (choose from 'allgather', 'alltoall', 'flex')", "");
    LOOM_CHECK(f.dispatcher != "flex", "--moe-token-dispatcher-type flex is not supported by Loom", "use allgather or alltoall");
    moe.dispatcher = f.dispatcher == "alltoall" ? model::MoeDispatcher::alltoall : model::MoeDispatcher::allgather;
    const LayerFrequency freq = parse_layer_frequency(f.layer_freq, "--moe-layer-freq", "moe_layer_pattern", o.model.num_layers);
    moe.layer_pattern         = freq.layers;
    if (freq.every > 0) moe.layer_freq = freq.every;
    model::moe_config_validate(moe, o.model);
    check_moe_sequence_parallel(o);
    const int64_t etp = o.parallel.etp();
    LOOM_CHECK(moe.expert_ffn(o.model) % etp == 0,
               "the experts' hidden size " << moe.expert_ffn(o.model) << " (--moe-ffn-hidden-size, or --ffn-hidden-size) "
                                           << "is not divisible by --expert-tensor-parallel-size " << etp,
               "each expert-tensor-parallel rank takes an equal share of every expert's features");
    LOOM_CHECK(moe.shared_expert_intermediate_size % o.parallel.tp() == 0,
               "--moe-shared-expert-intermediate-size " << moe.shared_expert_intermediate_size
                                                        << " is not divisible by --tensor-model-parallel-size "
                                                        << o.parallel.tp(),
               "the shared expert is split over the tensor-parallel ranks as a dense MLP");
    LOOM_CHECK(etp == 1 || !o.model.add_bias_linear,
               "biases in the experts with --expert-tensor-parallel-size " << etp << " are not supported by Loom",
               "pass --disable-bias-linear (Megatron's alltoall dispatcher refuses expert biases as well)");
}

}  // namespace loom::train
