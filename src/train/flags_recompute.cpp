// --recompute-*: arguments.py's choices and asserts, and transformer_config.py's rules for full recompute.
#include "core/error.h"
#include "model/gpt_config.h"
#include "train/flag_values.h"

namespace loom::train {

namespace {

using R = RecomputeFlags;

const Flag<RecomputeFlags> kRecomputeFlags[] = {
    {"--recompute-granularity", "training", &R::granularity,
     "activation recompute: full (whole layers, see --recompute-method) or selective (--recompute-modules; core_attn, which "
     "Loom's tiled attention always recomputes)"},
    {"--recompute-method", "training", &R::method,
     "full recompute: uniform (groups of --recompute-num-layers, one input kept each) or block (the first "
     "--recompute-num-layers layers of each pipeline stage)"},
    {"--recompute-num-layers", "training", &R::num_layers, "layers per group (uniform) or per stage (block)"},
    {"--recompute-activations", "training", &R::activations, "the same as --recompute-granularity selective"},
    {"--recompute-modules", "training", &R::modules,
     "selective recompute's modules (Loom: core_attn, which its tiled attention always does; moe_act, the "
     "experts' activation output; mlp and shared_experts, the dense MLP and the shared experts rerun from their "
     "input; layernorm, the input norm's output and a dense MLP's pre-MLP norm's, recomputed in backward; "
     "mla_up_proj, MLA's up projections and RoPE'd rows rebuilt from the latents)"},
    {"--fine-grained-activation-offloading", "transformer configuration", &R::offloading,
     "move the inputs of --offload-modules that backward reads to pinned host memory after each layer's forward, "
     "and back before its backward (the same values; docs/activation_offloading.md)"},
    {"--offload-modules", "transformer configuration", &R::offload_modules,
     "attn_norm, qkv_linear, core_attn, attn_proj (with core_attn), mlp_norm, expert_fc1, moe_act", kList},
    {"--min-offloaded-tensor-size", "transformer configuration", &R::min_offloaded_tensor_size,
     "tensors of fewer elements stay in device memory", kShowDefault},
    {"--activation-offload-fraction", "transformer configuration", &R::activation_offload_fraction,
     "the share of eligible offload groups offloaded (Loom: 1)", kShowDefault},
    {"--delta-offload-bytes-across-pp-ranks", "transformer configuration", &R::delta_offload_bytes,
     "bytes each later pipeline rank keeps on the device (Loom: 0)", kShowDefault},
    {"--delay-offload-until-cuda-graph", "transformer configuration", &R::delay_offload_until_cuda_graph,
     "offload after a CUDA graph runs (Loom offloads without graphs only)"},
};

// --fine-grained-activation-offloading: Megatron's TransformerConfig checks in its words, then Loom's limits.
void resolve_offloading(const RecomputeFlags & f, model::GptConfig & m) {
    if (!f.offloading) return;   // Megatron reads the module list only with the switch
    LOOM_CHECK(!f.offload_modules.empty(), "--fine-grained-activation-offloading without --offload-modules",
               "name the modules whose inputs to offload, e.g. --offload-modules core_attn attn_proj");
    const std::pair<const char *, uint32_t> names[] = {
        {"attn_norm", model::offload_attn_norm}, {"qkv_linear", model::offload_qkv_linear},
        {"core_attn", model::offload_core_attn}, {"attn_proj", model::offload_attn_proj},
        {"mlp_norm", model::offload_mlp_norm},   {"expert_fc1", model::offload_expert_fc1},
        {"moe_act", model::offload_moe_act}};
    for (const std::string & module : f.offload_modules) {
        LOOM_CHECK(module != "fused_group_mlp" && module != "gdp_qkv",
                   "--offload-modules " << module << " is not supported by Loom",
                   "Loom has no fused grouped MLP (Transformer Engine's op fuser) and no GatedDeltaProduct mixer");
        uint32_t bit = 0;
        for (const auto & entry : names) bit = module == entry.first ? entry.second : bit;
        LOOM_CHECK(bit != 0, "Invalid choices for offload_modules: {'" << module << "'}",
                   "Allowed modules are: attn_norm, qkv_linear, core_attn, attn_proj, mlp_norm, expert_fc1, moe_act "
                   "(and Megatron's fused_group_mlp, gdp_qkv)");
        m.offload_modules |= bit;
    }
    LOOM_CHECK(!(m.offload_modules & model::offload_attn_proj) || (m.offload_modules & model::offload_core_attn),
               "attn_proj cannot be set to offload_modules alone without core_attn because the input of attn_proj is "
               "the output of core_attn, which is needed in core_attn.backward().", "add core_attn to --offload-modules");
    LOOM_CHECK(f.min_offloaded_tensor_size >= 0, "min_offloaded_tensor_size must be non-negative.", "");
    LOOM_CHECK(f.activation_offload_fraction >= 0.0f && f.activation_offload_fraction <= 1.0f,
               "activation_offload_fraction must be in range [0, 1].", "");
    LOOM_CHECK(f.delta_offload_bytes >= 0, "delta_offload_bytes_across_pp_ranks must be non-negative.", "");
    LOOM_CHECK(f.activation_offload_fraction == 1.0f,
               "--activation-offload-fraction " << f.activation_offload_fraction << " is not supported by Loom",
               "Loom offloads every eligible tensor: drop the flag");
    LOOM_CHECK(f.delta_offload_bytes == 0,
               "--delta-offload-bytes-across-pp-ranks " << f.delta_offload_bytes << " is not supported by Loom",
               "Loom offloads the same modules on every pipeline rank: drop the flag");
    LOOM_CHECK(!f.delay_offload_until_cuda_graph, "--delay-offload-until-cuda-graph is not supported by Loom",
               "Loom offloads without CUDA graphs only");
    m.min_offloaded_tensor_size = f.min_offloaded_tensor_size;
}

}  // namespace

std::span<const Flag<RecomputeFlags>> recompute_flags() { return kRecomputeFlags; }

void resolve_recompute(const RecomputeFlags & f, const Given & given, model::GptConfig & m) {
    std::string granularity = f.activations ? "selective" : f.granularity;   // arguments.py's rule
    LOOM_CHECK(granularity.empty() || granularity == "full" || granularity == "selective",
               "argument --recompute-granularity: invalid choice: '" << granularity << "' (choose from 'full', 'selective')", "");
    LOOM_CHECK(f.method.empty() || f.method == "uniform" || f.method == "block",
               "argument --recompute-method: invalid choice: '" << f.method << "' (choose from 'uniform', 'block')", "");
    const bool num_given = given("--recompute-num-layers");
    if (granularity == "full") {
        LOOM_CHECK(!f.method.empty(),
                   "Using recompute_granularity: full so recompute_method must be \"block\" or \"uniform\"",
                   "add --recompute-method uniform or --recompute-method block");
        LOOM_CHECK(num_given && f.num_layers >= 1,
                   "When using recompute_granularity: full recompute_num_layers must be between 1 and "
                   "num_layers_per_pipeline_rank" << (num_given ? " (--recompute-num-layers " + std::to_string(f.num_layers) + ")" : ""),
                   "add --recompute-num-layers N");
        m.recompute_granularity = model::RecomputeGranularity::full;
        m.recompute_method      = f.method == "block" ? model::RecomputeMethod::block : model::RecomputeMethod::uniform;
        m.recompute_num_layers  = f.num_layers;
    } else if (granularity == "selective") {
        LOOM_CHECK(f.method.empty(), "recompute method is not yet supported for selective recomputing granularity",
                   "drop --recompute-method, or use --recompute-granularity full");
        LOOM_CHECK(!num_given, "When using recompute_granularity: selective recompute_num_layers must be None",
                   "drop --recompute-num-layers");
        for (const std::string & module : f.modules) {
            LOOM_CHECK(module == "core_attn" || module == "moe_act" || module == "mlp" || module == "shared_experts" ||
                           module == "layernorm" || module == "mla_up_proj",
                       "--recompute-modules " << module << " is not supported by Loom",
                       "Loom recomputes core_attn (its tiled attention never stores the probabilities), moe_act, mlp, "
                       "shared_experts, layernorm and mla_up_proj; for more, use --recompute-granularity full");
            if (module == "mla_up_proj") m.recompute_mla_up_proj = true;
            if (module == "layernorm") m.recompute_layernorm = true;
            if (module == "moe_act") m.recompute_moe_act = true;
            if (module == "mlp") m.recompute_mlp = true;
            if (module == "shared_experts") m.recompute_shared_experts = true;
        }
        m.recompute_granularity = model::RecomputeGranularity::selective;
    }
    // Without a granularity, --recompute-method and --recompute-num-layers recompute nothing, in Megatron too.
    resolve_offloading(f, m);
}

}  // namespace loom::train
