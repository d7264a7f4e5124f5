// --cuda-graph-*: Megatron's rules (arguments.py validate_args, TransformerConfig.__post_init__), in its
// words where it has them; what Loom does not implement is refused by name.
#include "core/error.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <algorithm>
#include <cstdio>

namespace loom::train {

namespace {

using G = GraphFlags;

const Flag<GraphFlags> kGraphFlags[] = {
    {"--cuda-graph-impl", "transformer configuration", &G::impl,
     "none, transformer_engine or local: capture every transformer layer's forward and backward per "
     "micro-batch as graphs after --cuda-graph-warmup-steps eager iterations, and replay them (both "
     "names select Loom's per-layer graphs); full_iteration: capture each iteration's forward and backward "
     "passes, every micro-batch, as one graph", kShowDefault},
    {"--cuda-graph-modules", "inference", &G::modules,
     "what each layer graph covers: nothing given (or full) is the whole layer; attn alone is a "
     "layer's attention and norm2 (the MLP or MoE layer runs eagerly); attn moe_router [moe_preprocess] is every MoE "
     "layer up to its router (attn mlp moe_router [moe_preprocess] beside dense layers, those whole); attn moe is "
     "whole drop-and-pad MoE layers; other sets are refused"},
    {"--cuda-graph-scope", "inference", &G::scope, "deprecated spelling of --cuda-graph-modules"},
    {"--enable-cuda-graph", "transformer configuration", &G::enable, "deprecated: --cuda-graph-impl local"},
    {"--external-cuda-graph", "transformer configuration", &G::external,
     "deprecated: --cuda-graph-impl transformer_engine"},
};

const Flag<TrainOptions> kGraphOptionFlags[] = {
    {"--cuda-graph-warmup-steps", "transformer configuration", &TrainOptions::cuda_graph_warmup_steps,
     "eager iterations before the layer graphs are captured", kShowDefault},
};

}  // namespace

std::span<const Flag<GraphFlags>> graph_flags() { return kGraphFlags; }
std::span<const Flag<TrainOptions>> graph_option_flags() { return kGraphOptionFlags; }

namespace {

// --cuda-graph-impl full_iteration (graphs/full_iteration_graph.h): Megatron's rule on the modules, then what
// Loom's capture of one stage's iteration cannot hold, by name.
void resolve_full_iteration(const std::vector<std::string> & modules, TrainOptions & o) {
    const bool named = std::any_of(modules.begin(), modules.end(), [](const std::string & m) { return m != "full"; });
    LOOM_CHECK(!named, "cuda_graph_modules must be empty when cuda_graph_impl=\"full_iteration\".",
               "the full-iteration graph holds every layer whole: drop --cuda-graph-modules");
    auto refuse = [](bool bad, const std::string & what, const std::string & why) {
        LOOM_CHECK(!bad, "--cuda-graph-impl full_iteration with " << what << " is not supported by Loom", why);
    };
    refuse(o.parallel.pp() > 1, "--pipeline-model-parallel-size " + std::to_string(o.parallel.pp()),
           "Loom captures one pipeline stage's iteration (the stages' transfers are waited for on the host); use "
           "per-layer graphs, --cuda-graph-impl transformer_engine");
    refuse(o.model.moe.enabled(), "MoE layers",
           "the dispatch reads each expert's token count on the host; capture layers up to their router instead: "
           "--cuda-graph-impl transformer_engine --cuda-graph-modules attn moe_router");
    refuse(o.model.mtp_num_layers > 0, "--mtp-num-layers", "the MTP planes are cut from each batch on the host");
    refuse(o.fp16 && o.loss_scale == 0, "--fp16's dynamic loss scale",
           "the scale is baked into the captured loss gradients: give a constant --loss-scale");
    refuse(o.model.offload_modules != 0, "--fine-grained-activation-offloading",
           "the offloads are waited for on the host during the passes");
    LOOM_CHECK(o.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0, got " << o.cuda_graph_warmup_steps, "");
    o.full_iteration_graph = true;
}

}  // namespace

void resolve_cuda_graphs(const GraphFlags & f, const MoeFlags & moe_flags, TrainOptions & o) {
    std::string impl = f.impl;
    if (f.enable || f.external) {
        LOOM_CHECK(impl == "none", "Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl.", "");
        LOOM_CHECK(!(f.enable && f.external),
                   "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time.", "");
        impl = f.enable ? "local" : "transformer_engine";
        if (process_rank() <= 0) {   // Megatron's warn_rank_0
            std::fprintf(stderr, "WARNING: %s is deprecated, use --cuda-graph-impl=%s instead.\n",
                         f.enable ? "--enable-cuda-graph" : "--external-cuda-graph", impl.c_str());
        }
    }
    LOOM_CHECK(impl == "none" || impl == "local" || impl == "transformer_engine" || impl == "full_iteration",
               "argument --cuda-graph-impl: invalid choice: '" << impl
                                                              << "' (choose from 'none', 'local', 'transformer_engine', 'full_iteration')",
               "");
    // Megatron's two per-layer implementations (MCore's own, local, and Transformer Engine's) capture the
    // same thing, each layer's forward and backward over --cuda-graph-modules: both select Loom's.
    LOOM_CHECK(f.scope.empty() || f.modules.empty(),
               "--cuda-graph-scope and --cuda-graph-modules cannot be used together.", "--cuda-graph-scope is deprecated");
    std::vector<std::string> modules = f.scope.empty() ? f.modules : f.scope;
    if (!f.scope.empty() && process_rank() <= 0) {
        std::fprintf(stderr, "WARNING: --cuda-graph-scope is deprecated, use --cuda-graph-modules instead.\n");
    }
    static const std::vector<std::string> known = {"attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full"};
    for (const std::string & module : modules) {
        LOOM_CHECK(std::find(known.begin(), known.end(), module) != known.end(),
                   "argument --cuda-graph-modules: invalid choice: '" << module
                                                                     << "' (choose from 'attn', 'mlp', 'moe', 'moe_router', "
                                                                        "'moe_preprocess', 'mamba')", "");
    }
    auto has = [&](const char * m) { return std::find(modules.begin(), modules.end(), m) != modules.end(); };
    if (impl == "full_iteration") {
        resolve_full_iteration(modules, o);
        return;
    }
    LOOM_CHECK(!(has("moe") && has("moe_router")), "cuda_graph_modules must not contain both moe and moe_router.", "");
    LOOM_CHECK(!has("moe_preprocess") || has("moe_router"),
               "moe_preprocess cuda graph is only supported with moe_router cuda graph.", "");
    const model::MoeConfig & moe = o.model.moe;
    LOOM_CHECK(!(has("moe") || has("moe_router")) || moe.num_experts > 1, "moe cuda graph is only supported for MoE.",
               "the MoE scopes need --num-experts > 1");
    bool every_layer_moe = moe.enabled();
    for (int64_t i = 0; i < o.model.num_layers; ++i) every_layer_moe = every_layer_moe && moe.is_moe_layer(i);
    const bool drop_pad = moe.drops() && moe.pad_to_capacity;
    LOOM_CHECK(!has("mlp") || !every_layer_moe, "mlp cuda graph is only supported for dense layers, but not found in the model.", "");
    LOOM_CHECK(!has("moe") || drop_pad, "moe cuda graph is only supported with drop-padding MoE.",
               "add --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity, or capture up to the router (moe_router)");
    LOOM_CHECK(!has("moe_preprocess") || moe_flags.dispatcher != "alltoall" || !moe.drops(),
               "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations in the preprocess step.", "");
    LOOM_CHECK(!has("mamba"), "--cuda-graph-modules mamba: Loom has no Mamba layers", "");
    // What Loom captures: whole layers (no modules, full, or attn + moe of drop-and-pad MoE layers), or
    // every layer a MoE layer up to its router (attn moe_router [moe_preprocess]).
    std::vector<std::string> named;
    for (const std::string & m : modules) {
        if (m != "full" && std::find(named.begin(), named.end(), m) == named.end()) named.push_back(m);
    }
    std::sort(named.begin(), named.end());
    using Modules = std::vector<std::string>;
    const bool whole   = named.empty() || (named == Modules{"attn", "moe"} && every_layer_moe);
    // Up to the router: every layer MoE, or MoE layers beside dense ones captured whole (mlp named too).
    const bool partial = ((named == Modules{"attn", "moe_router"} || named == Modules{"attn", "moe_preprocess", "moe_router"}) &&
                          every_layer_moe) ||
                         ((named == Modules{"attn", "mlp", "moe_router"} || named == Modules{"attn", "mlp", "moe_preprocess", "moe_router"}) &&
                          moe.enabled() && !every_layer_moe);
    const bool attn_only = named == Modules{"attn"};   // every layer up to norm2, the MLP or the MoE layer eager
    if (impl != "none") {
        std::string given;
        for (const std::string & m : named) given += (given.empty() ? "" : " ") + m;
        LOOM_CHECK(whole || partial || attn_only, "--cuda-graph-modules " << given << " is not supported by Loom",
                   "Loom captures whole layers (no --cuda-graph-modules, or attn moe of drop-and-pad MoE layers), "
                   "every layer's attention alone (attn), or MoE layers up to their router: attn "
                   "moe_router [moe_preprocess] with every layer MoE, attn mlp moe_router [moe_preprocess] beside "
                   "dense layers (captured whole)");
    }
    o.graph_moe_router     = partial;
    o.graph_moe_preprocess = partial && has("moe_preprocess");
    o.graph_attn           = attn_only;
    LOOM_CHECK(o.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0, got " << o.cuda_graph_warmup_steps, "");
    o.layer_graphs = impl == "transformer_engine" || impl == "local";
    if (o.layer_graphs) {
        LOOM_CHECK(!o.model.moe.enabled() || o.model.moe.pad_to_capacity || o.graph_moe_router || o.graph_attn,
                   "--cuda-graph-impl transformer_engine with dropless MoE layers",
                   "a dropless dispatch reads each expert's token count on the host, which no graph can; add "
                   "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity (Megatron's rule for graphing "
                   "whole MoE layers), or capture each layer up to its router: --cuda-graph-modules attn moe_router");
        LOOM_CHECK(o.model.recompute_granularity != model::RecomputeGranularity::full,
                   "full recompute is only supported with full iteration CUDA graph.",
                   "drop --recompute-granularity full, or --cuda-graph-impl");
    }
}

}  // namespace loom::train
