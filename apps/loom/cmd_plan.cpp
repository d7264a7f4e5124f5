// loom plan: the memory each rank of a training run will hold, before a cluster is spent on finding out.
//
//   loom plan [loom train's flags] --nodes 4 --gpus-per-node 8           every rank's bytes by pool, the most loaded
//   loom plan [...] --ranks 0,7 --json                                   chosen ranks, as JSON
//
// Each planned rank is set up as `loom train` would set it up (its stage's model chunks, DDP's buffers, the
// optimizer's state) on the meta device, which allocates by the same code without memory or work
// (plan/memory_plan.h); the numbers are the allocator's, pool by pool, as `loom train`'s summary names them.
// Planned: what a rank holds between iterations (values, gradients, optimizer state) and, for models without
// MoE layers, the peak of one iteration of its schedule (activations and every other pool).
#include "apps/loom/commands.h"

#include "core/error.h"
#include "plan/memory_plan.h"
#include "train/options_parser.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cstdio>
#include <sstream>

namespace loom::app {

namespace {

// "all", or a comma-separated list of ranks below world.
std::vector<int> ranks_of(const std::string & text, int world) {
    std::vector<int> ranks;
    if (text == "all") {
        for (int r = 0; r < world; ++r) ranks.push_back(r);
        return ranks;
    }
    std::stringstream in(text);
    for (std::string item; std::getline(in, item, ',');) {
        char *     end  = nullptr;
        const long rank = std::strtol(item.c_str(), &end, 10);
        LOOM_CHECK(!item.empty() && *end == '\0' && rank >= 0 && rank < world,
                   "--ranks: '" << item << "' is not a rank of the " << world << " planned",
                   "give ranks from 0 to " << world - 1 << ", comma-separated, or all");
        ranks.push_back(static_cast<int>(rank));
    }
    return ranks;
}

double mib(int64_t bytes) { return static_cast<double>(bytes) / 1048576.0; }

}  // namespace

int cmd_plan(int argc, char ** argv) {
    CLI::App app{"Plan a training run: the memory each rank holds, by pool, from the allocator's books.", "loom plan"};
    train::TrainOptionParser parser(app);
    parser.plan_only();
    int64_t     nodes = 1, gpus_per_node = 1;
    std::string ranks_text = "all";
    bool        json       = false;
    app.add_option("--nodes", nodes, "nodes in the planned job (default 1)");
    app.add_option("--gpus-per-node", gpus_per_node, "devices per node: world size = nodes x gpus-per-node (default 1)");
    app.add_option("--ranks", ranks_text, "the ranks to plan: all (default) or a comma-separated list");
    app.add_flag("--json", json, "print the plan as JSON");
    if (std::optional<int> status = parse_arguments(app, argc, argv)) return *status;
    LOOM_CHECK(nodes >= 1 && gpus_per_node >= 1, "--nodes " << nodes << " --gpus-per-node " << gpus_per_node,
               "both are at least 1");
    const int64_t world = nodes * gpus_per_node;
    LOOM_CHECK(world <= 1 << 20, "a plan of " << world << " ranks", "plan at most 2^20 ranks");
    const train::TrainOptions options = parser.resolve(world);
    const std::vector<int>    ranks   = ranks_of(ranks_text, static_cast<int>(world));

    std::vector<plan::RankMemory> plans;
    for (int rank : ranks) plans.push_back(plan::plan_rank_memory(options, static_cast<int>(world), rank));
    const plan::RankMemory & most = *std::max_element(plans.begin(), plans.end(), [](const auto & a, const auto & b) {
        return a.device_peak_total() < b.device_peak_total();
    });
    if (json) {
        nlohmann::json out;
        out["world_size"]   = world;
        out["rank"]         = most.rank;
        out["memory_bytes"] = most.device;
        out["memory_bytes_total"] = most.device_total();
        if (most.iteration_planned) {
            out["activations_peak_bytes"] = most.activations_peak;
            out["peak_bytes"]             = most.device_peak_total();
        }
        nlohmann::json per_rank = nlohmann::json::array();
        for (const plan::RankMemory & p : plans) {
            per_rank.push_back({{"rank", p.rank}, {"memory_bytes", p.device}, {"pinned_bytes", p.pinned},
                                {"memory_bytes_total", p.device_total()}, {"setup_peak_bytes", p.device_peak}});
            if (p.iteration_planned) {
                per_rank.back()["activations_peak_bytes"] = p.activations_peak;
                per_rank.back()["iteration_peak_bytes"]   = p.iteration_peak;
            }
        }
        out["ranks"] = per_rank;
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    }
    std::printf("loom plan: %s, %lld ranks (tp %lld, pp %lld, dp %lld, cp %lld, ep %lld); device memory a rank holds "
                "between iterations, MiB\n",
                options.model_preset.c_str(), static_cast<long long>(world), static_cast<long long>(options.parallel.tp()),
                static_cast<long long>(options.parallel.pp()), static_cast<long long>(options.parallel.dp()),
                static_cast<long long>(options.parallel.cp()), static_cast<long long>(options.parallel.ep()));
    std::vector<std::string> pools;
    for (const plan::RankMemory & p : plans) {
        for (const auto & [pool, bytes] : p.device) {
            if (std::find(pools.begin(), pools.end(), pool) == pools.end()) pools.push_back(pool);
        }
    }
    std::printf("%6s", "rank");
    for (const std::string & pool : pools) std::printf(" %12s", pool.c_str());
    std::printf(" %12s %12s %12s\n", "held", "activations", "peak");
    for (const plan::RankMemory & p : plans) {
        std::printf("%6d", p.rank);
        for (const std::string & pool : pools) {
            auto it = p.device.find(pool);
            std::printf(" %12.1f", it == p.device.end() ? 0.0 : mib(it->second));
        }
        std::printf(" %12.1f", mib(p.device_total()));
        if (p.iteration_planned) {
            std::printf(" %12.1f %12.1f\n", mib(p.activations_peak), mib(p.device_peak_total()));
        } else {
            std::printf(" %12s %12s\n", "-", "-");
        }
    }
    std::printf("held: between iterations; activations: their pool's peak in one iteration; peak: held plus the "
                "iteration's peak above it%s\n",
                options.model.moe.enabled() ? " (not planned for MoE layers, which route by the data)" : "");
    std::printf("most loaded: rank %d, %.1f MiB\n", most.rank, mib(most.device_peak_total()));
    return 0;
}

}  // namespace loom::app
