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
};

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
}

}  // namespace loom::train
