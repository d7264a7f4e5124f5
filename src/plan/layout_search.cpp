#include "plan/layout_search.h"

#include "core/error.h"
#include "plan/memory_plan.h"
#include "plan/step_plan.h"

#include <algorithm>
#include <cstdio>
#include <map>
#include <sstream>

namespace loom::plan {

namespace {

std::string gib(int64_t bytes) {
    char text[32];
    std::snprintf(text, sizeof(text), "%.1f GiB", static_cast<double>(bytes) / 1073741824.0);
    return text;
}

std::string family_name(const Layout & l) {
    return "TP " + std::to_string(l.tp) + ", PP " + std::to_string(l.pp) + ", CP " + std::to_string(l.cp);
}

}  // namespace

const std::vector<std::string> & searched_flags() {
    static const std::vector<std::string> flags = {
        "--tensor-model-parallel-size", "--pipeline-model-parallel-size", "--context-parallel-size",
        "--num-virtual-stages-per-pipeline-rank", "--num-layers-per-virtual-pipeline-stage", "--micro-batch-size",
        "--recompute-granularity", "--recompute-method", "--recompute-num-layers", "--sequence-parallel",
        "--tp-comm-overlap", "--use-distributed-optimizer"};
    return flags;
}

std::vector<std::string> Layout::flags() const {
    std::vector<std::string> f = {"--tensor-model-parallel-size", std::to_string(tp), "--pipeline-model-parallel-size",
                                  std::to_string(pp), "--context-parallel-size", std::to_string(cp), "--micro-batch-size",
                                  std::to_string(micro_batch), "--use-distributed-optimizer", "--overlap-grad-reduce",
                                  "--overlap-param-gather"};
    if (tp > 1) f.insert(f.end(), {"--sequence-parallel", "--tp-comm-overlap"});
    if (vpp) f.insert(f.end(), {"--num-virtual-stages-per-pipeline-rank", std::to_string(*vpp)});
    if (full_recompute) {
        f.insert(f.end(), {"--recompute-granularity", "full", "--recompute-method", "uniform", "--recompute-num-layers", "1"});
    }
    return f;
}

std::string Layout::describe(int world_size) const {
    std::ostringstream os;
    os << "TP " << tp << ", PP " << pp;
    if (vpp) os << " x VPP " << *vpp;
    os << ", CP " << cp << ", DP " << world_size / (tp * pp * cp) << ", micro-batch " << micro_batch
       << (full_recompute ? ", full recompute" : "");
    return os.str();
}

SearchResult search_layouts(const train::TrainOptions & base, int world_size, const CostModel & costs,
                            const std::function<train::TrainOptions(const Layout &)> & options_for) {
    const model::GptConfig & m      = base.model;
    const int64_t            usable = costs.usable_memory_bytes();
    SearchResult             result;

    // The families, in Megatron's bounds.
    std::vector<Layout> families;
    for (int tp = 1; tp <= std::min(costs.gpus_per_node(), 8); tp *= 2) {
        if (m.num_attention_heads % tp != 0 || m.num_query_groups % tp != 0) continue;
        for (int pp = 1; pp <= m.num_layers; ++pp) {
            if (m.num_layers % pp != 0 || world_size % (tp * pp) != 0) continue;
            for (int cp = 1; cp <= 8; cp *= 2) {
                if (world_size % (tp * pp * cp) != 0 || m.seq_length % (2 * cp) != 0) continue;
                if (cp > 1 && m.seq_length < 8192 * cp / 2) continue;   // short sequences gain nothing from CP
                families.push_back(Layout{tp, pp, cp});
            }
        }
    }
    auto evaluate = [&](const Layout & layout) -> std::optional<Candidate> {
        const train::TrainOptions options = options_for(layout);
        const StepPlan            step    = plan_step(options, world_size, costs, /*sampled=*/true);
        ++result.planned;
        Candidate c{layout, step.step_s, step.tflops_per_gpu, step.mfu, step.timeline.bubble_fraction(), 0};
        for (const RankMemory & stage : step.stages) c.peak_bytes = std::max(c.peak_bytes, stage.device_peak_total());
        return c;
    };
    for (const Layout & family : families) {
        const int     dp     = world_size / (family.tp * family.pp * family.cp);
        const std::string name = family_name(family);
        // 1. What a rank holds between iterations, alone.
        Layout smallest         = family;
        smallest.full_recompute = true;
        int64_t states          = 0;
        try {
            states = plan_rank_memory(options_for(smallest), world_size, 0, nullptr, false).device_total();
        } catch (const Error & e) {
            result.rejected.push_back({name, std::string("not a valid layout: ") + e.what()});
            continue;
        }
        if (states > usable) {
            result.rejected.push_back({name, "the weights, gradients and optimizer state alone take " + gib(states) +
                                                 " of the " + gib(usable) + " usable"});
            continue;
        }
        if (base.global_batch_size % dp != 0) {
            result.rejected.push_back({name, "DP " + std::to_string(dp) + " does not divide the global batch of " +
                                                 std::to_string(base.global_batch_size)});
            continue;
        }
        // 2. Its smallest variant, whole.
        std::optional<Candidate> least;
        try {
            least = evaluate(smallest);
        } catch (const Error & e) {
            result.rejected.push_back({name, std::string("not a valid layout: ") + e.what()});
            continue;
        }
        if (least->peak_bytes > usable) {
            result.rejected.push_back({name, "peaks at " + gib(least->peak_bytes) + " of the " + gib(usable) +
                                                 " usable even with micro-batch 1 and full recompute"});
            continue;
        }
        result.fitting.push_back(*least);
        // 3. The others. Recompute only adds work, so a variant is planned with it only where it does not fit
        // without; a larger micro-batch only adds memory, so none is tried past one that does not fit.
        const int64_t microbatches_per_dp = base.global_batch_size / dp;
        std::vector<std::optional<int>> chunkings = {std::nullopt};
        for (int v : {2, 4}) {
            if (family.pp > 1 && m.num_layers % (family.pp * v) == 0) chunkings.push_back(v);
        }
        for (const std::optional<int> & vpp : chunkings) {
            for (int64_t mb : {1, 2, 4}) {
                if (microbatches_per_dp % mb != 0) break;
                if (vpp && (microbatches_per_dp / mb) % family.pp != 0) break;
                bool fits = false;
                for (bool recompute : {false, true}) {
                    Layout layout{family.tp, family.pp, family.cp, vpp, mb, recompute};
                    if (!vpp && mb == 1 && recompute) {   // the smallest, planned above
                        fits = true;
                        break;
                    }
                    ++result.enumerated;
                    std::optional<Candidate> c;
                    try {
                        c = evaluate(layout);
                    } catch (const Error &) {
                        continue;   // a variant the flags refuse (the family stands)
                    }
                    if (c->peak_bytes <= usable) {
                        result.fitting.push_back(*c);
                        fits = true;
                        break;
                    }
                }
                if (!fits) break;
            }
        }
    }
    result.enumerated += static_cast<int>(families.size());
    std::sort(result.fitting.begin(), result.fitting.end(),
              [](const Candidate & a, const Candidate & b) { return a.step_s < b.step_s; });
    return result;
}

}  // namespace loom::plan
