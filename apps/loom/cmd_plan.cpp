// loom plan: the memory each rank of a training run will hold, and how long its step will take, before a
// cluster is spent on finding out.
//
//   loom plan [loom train's flags] --nodes 4 --gpus-per-node 8           every rank's bytes by pool, the most loaded
//   loom plan [...] --ranks 0,7 --json                                   chosen ranks, as JSON
//   loom plan [...] --gpu h100-80gb --timeline plan.svg                  and the step time, TFLOP/s, MFU, timeline
//   loom plan [...] --svg plan.svg                                       every planned rank's memory by pool (and the
//                                                                        timeline, with --gpu) as one picture
//
// Each planned rank is set up as `loom train` would set it up (its stage's model chunks, DDP's buffers, the
// optimizer's state) on the meta device, which allocates by the same code without memory or work
// (plan/memory_plan.h); the numbers are the allocator's, pool by pool, as `loom train`'s summary names them.
// Planned: what a rank holds between iterations (values, gradients, optimizer state) and the peak of one
// iteration of its schedule (activations and every other pool; MoE layers routed round-robin, balanced). With --gpu, the
// same iteration on the meta device keeps modelled time (plan/cost_model.h, plan/step_plan.h).
#include "apps/loom/commands.h"

#include "core/error.h"
#include "plan/cpu_calibration.h"
#include "plan/layout_search.h"
#include "plan/memory_plan.h"
#include "plan/plan_svg.h"
#include "plan/step_plan.h"
#include "train/options_parser.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <optional>
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

// The ops that take the slowest stage's time, longest first.
std::vector<std::pair<std::string, plan::OpTotal>> longest_ops(const std::map<std::string, plan::OpTotal> & totals) {
    std::vector<std::pair<std::string, plan::OpTotal>> ops(totals.begin(), totals.end());
    std::sort(ops.begin(), ops.end(), [](const auto & a, const auto & b) { return a.second.seconds > b.second.seconds; });
    return ops;
}

// The command's flags: loom train's, and the plan's own.
struct PlanCommand {
    CLI::App                 app{"Plan a training run: the memory each rank holds, by pool, from the allocator's books; "
                                 "with --gpu, its step time; with --search, the layouts that fit, fastest first.",
                                 "loom plan"};
    train::TrainOptionParser parser{app};
    int64_t                  nodes = 1, gpus_per_node = 1;
    std::string              ranks_text = "all";
    std::string              svg_file;
    bool                     json = false, search = false;
    std::string              gpu;
    double                   nvlink_gbps = 0, network_gbps = 0;
    int64_t                  top = 10;

    PlanCommand() {
        parser.plan_only();
        app.add_option("--nodes", nodes, "nodes in the planned job (default 1)");
        app.add_option("--gpus-per-node", gpus_per_node, "devices per node: world size = nodes x gpus-per-node (default 1)");
        app.add_option("--ranks", ranks_text, "the ranks to plan: all (default) or a comma-separated list");
        app.add_flag("--json", json, "print the plan as JSON");
        app.add_option("--gpu", gpu, "time the step on this GPU: h100-80gb, h200, a100-80gb or b200, or cpu (this machine, its rates measured first) (default: memory only)");
        app.add_option("--nvlink-gbps", nvlink_gbps, "NVLink bandwidth per GPU, one direction, GB/s (default: the GPU's)");
        app.add_option("--network-gbps", network_gbps, "network bandwidth per GPU, one direction, GB/s (default: the GPU's)");
        app.add_flag("--search", search, "with --gpu: plan every layout (TP, PP, VPP, CP, micro-batch, recompute) and "
                                         "rank those that fit by step time");
        app.add_option("--top", top, "with --search: how many layouts to print (default 10)");
        app.add_option("--svg", svg_file, "write the plan as an SVG: each planned rank's memory by pool and its "
                                          "iteration's peak, and with --gpu the predicted pipeline timeline")
            ->type_name("FILE");
    }
};

// `loom plan --search`: the layouts of the user's model, batch and cluster, each parsed from the user's flags
// with the layout's added, as `loom plan` would parse them.
void refuse_searched_flags(int argc, char ** argv) {
    for (int i = 1; i < argc; ++i) {
        const std::string arg = argv[i];
        for (const std::string & flag : plan::searched_flags()) {
            LOOM_CHECK(arg != flag && arg.rfind(flag + "=", 0) != 0, "--search chooses " << flag << " itself",
                       "leave " << flag << " out, or plan that layout without --search");
        }
    }
}

int search(const PlanCommand & command, const train::TrainOptions & base, int argc, char ** argv) {
    const int       world = static_cast<int>(command.nodes * command.gpus_per_node);
    plan::PlannedDevice device = plan::planned_device(command.gpu);
    if (command.nvlink_gbps > 0) device.spec.nvlink_bytes_per_s = command.nvlink_gbps * 1e9;
    if (command.network_gbps > 0) device.spec.network_bytes_per_s = command.network_gbps * 1e9;
    const plan::CostModel costs(device.spec, static_cast<int>(command.gpus_per_node), base.model.params_dtype,
                                device.efficiency);
    auto options_for = [&](const plan::Layout & layout) {
        PlanCommand               again;
        std::vector<std::string>  args(argv, argv + argc);
        for (const std::string & f : layout.flags()) args.push_back(f);
        std::vector<const char *> raw;
        for (const std::string & a : args) raw.push_back(a.c_str());
        train::check_option_values(again.app, static_cast<int>(raw.size()), raw.data());
        try {
            again.app.parse(static_cast<int>(raw.size()), raw.data());
        } catch (const CLI::ParseError & e) {
            LOOM_THROW("the layout's flags do not parse: " << e.what(), "");
        }
        return again.parser.resolve(world);
    };
    const auto                began  = std::chrono::steady_clock::now();
    const plan::SearchResult  result = plan::search_layouts(base, world, costs, options_for);
    const double              took   = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    const size_t              shown  = std::min(result.fitting.size(), static_cast<size_t>(std::max<int64_t>(command.top, 0)));
    if (command.json) {
        nlohmann::json out;
        out["world_size"] = world;
        out["gpu"]        = command.gpu;
        out["planned"]    = result.planned;
        out["seconds"]    = took;
        nlohmann::json fitting = nlohmann::json::array();
        for (size_t i = 0; i < shown; ++i) {
            const plan::Candidate & c = result.fitting[i];
            fitting.push_back({{"layout", c.layout.describe(world)}, {"flags", c.layout.flags()}, {"step_seconds", c.step_s},
                               {"tflops_per_gpu", c.tflops_per_gpu}, {"mfu", c.mfu}, {"bubble_fraction", c.bubble},
                               {"peak_bytes", c.peak_bytes}});
        }
        out["fitting"]  = fitting;
        nlohmann::json rejected = nlohmann::json::array();
        for (const plan::RejectedFamily & r : result.rejected) rejected.push_back({{"family", r.family}, {"why", r.why}});
        out["rejected"] = rejected;
        std::printf("%s\n", out.dump(2).c_str());
        return 0;
    }
    std::printf("loom plan --search: %s on %d x %s, global batch %lld x %lld tokens; %d layouts planned in %.1f s\n",
                base.model_preset.c_str(), world, command.gpu.c_str(), static_cast<long long>(base.global_batch_size),
                static_cast<long long>(base.model.seq_length), result.planned, took);
    std::printf("%zu fit in %.1f GiB (95%% of the GPU's memory), fastest first:\n", result.fitting.size(),
                static_cast<double>(costs.usable_memory_bytes()) / 1073741824.0);
    std::printf("  %-62s %9s %8s %6s %7s %9s\n", "layout", "step s", "TFLOP/s", "MFU", "bubble", "peak GiB");
    for (size_t i = 0; i < shown; ++i) {
        const plan::Candidate & c = result.fitting[i];
        std::printf("  %-62s %9.3f %8.1f %5.1f%% %6.1f%% %9.1f\n", c.layout.describe(world).c_str(), c.step_s,
                    c.tflops_per_gpu, 100 * c.mfu, 100 * c.bubble, static_cast<double>(c.peak_bytes) / 1073741824.0);
    }
    if (!result.rejected.empty()) std::printf("families that do not fit:\n");
    for (const plan::RejectedFamily & r : result.rejected) std::printf("  %-20s %s\n", r.family.c_str(), r.why.c_str());
    return 0;
}

}  // namespace

int cmd_plan(int argc, char ** argv) {
    PlanCommand command;
    if (std::optional<int> status = parse_arguments(command.app, argc, argv)) return *status;
    const int64_t nodes = command.nodes, gpus_per_node = command.gpus_per_node;
    const std::string & gpu = command.gpu;
    const double nvlink_gbps = command.nvlink_gbps, network_gbps = command.network_gbps;
    const bool json = command.json;
    LOOM_CHECK(nodes >= 1 && gpus_per_node >= 1, "--nodes " << nodes << " --gpus-per-node " << gpus_per_node,
               "both are at least 1");
    const int64_t world = nodes * gpus_per_node;
    LOOM_CHECK(world <= 1 << 20, "a plan of " << world << " ranks", "plan at most 2^20 ranks");
    if (command.search) refuse_searched_flags(argc, argv);
    // A search reads the model and the batch from them, whatever layout the flags would give (it sets its own).
    const train::TrainOptions options = command.parser.resolve(command.search ? 1 : world);
    const std::string &       timeline_file = options.timeline_file;   // loom train's --timeline: here, the plan's

    LOOM_CHECK(nvlink_gbps >= 0 && network_gbps >= 0, "--nvlink-gbps " << nvlink_gbps << " --network-gbps " << network_gbps,
               "bandwidths are positive (0: the GPU's default)");
    LOOM_CHECK(!gpu.empty() || (nvlink_gbps == 0 && network_gbps == 0 && timeline_file.empty() && !command.search),
               "--nvlink-gbps, --network-gbps, --timeline and --search time the step", "add --gpu");
    LOOM_CHECK(!command.search || command.svg_file.empty(), "--svg with --search",
               "draw one layout: plan it without --search");
    if (command.search) return search(command, options, argc, argv);
    const std::vector<int> ranks = ranks_of(command.ranks_text, static_cast<int>(world));
    std::optional<plan::StepPlan> step;
    std::optional<plan::CostModel> costs;
    if (!gpu.empty()) {
        plan::PlannedDevice device = plan::planned_device(gpu);
        if (nvlink_gbps > 0) device.spec.nvlink_bytes_per_s = nvlink_gbps * 1e9;
        if (network_gbps > 0) device.spec.network_bytes_per_s = network_gbps * 1e9;
        costs.emplace(device.spec, static_cast<int>(gpus_per_node), options.model.params_dtype, device.efficiency);
        step = plan::plan_step(options, static_cast<int>(world), *costs);
        if (!timeline_file.empty()) pipeline::write_file_atomically(timeline_file, pipeline::timeline_svg(step->timeline));
    }

    std::vector<plan::RankMemory> plans;
    for (int rank : ranks) plans.push_back(plan::plan_rank_memory(options, static_cast<int>(world), rank));
    const plan::RankMemory & most = *std::max_element(plans.begin(), plans.end(), [](const auto & a, const auto & b) {
        return a.device_peak_total() < b.device_peak_total();
    });
    if (!command.svg_file.empty()) {
        pipeline::write_file_atomically(command.svg_file, plan::plan_svg(plans, costs ? costs->usable_memory_bytes() : 0,
                                                                         step ? &step->timeline : nullptr));
    }
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
        if (step) {
            out["gpu"]              = gpu;
            out["step_seconds"]     = step->step_s;
            out["tflops_per_gpu"]   = step->tflops_per_gpu;
            out["mfu"]              = step->mfu;
            out["model_flops"]      = step->model_flops;
            out["bubble_fraction"]  = step->timeline.bubble_fraction();
            out["slowest_stage"]    = step->slowest_stage;
            out["fits"]             = most.device_peak_total() <= costs->usable_memory_bytes();
            nlohmann::json stages = nlohmann::json::array();
            for (const plan::RankMemory & s : step->stages) {
                nlohmann::json ops = nlohmann::json::object();
                for (const auto & [name, t] : s.time->totals) {
                    ops[name] = {{"calls", t.calls}, {"flops", t.flops}, {"bytes", t.bytes}, {"seconds", t.seconds}};
                }
                stages.push_back({{"rank", s.rank}, {"alone_seconds", s.time->iteration_s}, {"head_seconds", s.time->head_s},
                                  {"tail_seconds", s.time->tail_s}, {"transfer_seconds", s.time->transfer_s}, {"ops", ops}});
            }
            out["stages"] = stages;
        }
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
                options.model.moe.enabled() ? " (MoE layers routed round-robin: balanced)" : "");
    std::printf("most loaded: rank %d, %.1f MiB\n", most.rank, mib(most.device_peak_total()));
    if (!step) return 0;
    const plan::GpuSpec & g = costs->gpu();
    std::printf("\non %lld x %s (%.3g TFLOP/s, %.3g TB/s, NVLink %.0f GB/s, network %.0f GB/s per GPU):\n",
                static_cast<long long>(world), g.name.c_str(), costs->tensor_core_flops() / 1e12, g.hbm_bytes_per_s / 1e12,
                g.nvlink_bytes_per_s / 1e9, g.network_bytes_per_s / 1e9);
    if (most.device_peak_total() > costs->usable_memory_bytes()) {
        std::printf("  does NOT fit: rank %d peaks at %.1f GiB of the %.1f GiB usable (95%% of the GPU's)\n", most.rank,
                    static_cast<double>(most.device_peak_total()) / 1073741824.0,
                    static_cast<double>(costs->usable_memory_bytes()) / 1073741824.0);
    }
    std::printf("  step %.3f s, %.1f TFLOP/s per GPU, MFU %.1f%% (Megatron's count: %.3g FLOPs per step)\n", step->step_s,
                step->tflops_per_gpu, 100 * step->mfu, step->model_flops);
    std::printf("  pipeline bubble %.1f%%; slowest stage %d (rank %d)\n", 100 * step->timeline.bubble_fraction(),
                step->slowest_stage, step->stages[static_cast<size_t>(step->slowest_stage)].rank);
    const plan::RankTime & t = *step->stages[static_cast<size_t>(step->slowest_stage)].time;
    std::printf("  its iteration alone %.3f s: before the schedule %.4f s, after it %.4f s (exposed reductions, "
                "optimizer, gathers)\n", t.iteration_s, t.head_s, t.tail_s);
    std::printf("  %-24s %8s %12s %12s %10s\n", "op (its streams' time)", "calls", "TFLOP", "GB", "seconds");
    int shown = 0;
    for (const auto & [name, v] : longest_ops(t.totals)) {
        if (++shown > 12) break;
        std::printf("  %-24s %8lld %12.2f %12.2f %10.4f\n", name.c_str(), static_cast<long long>(v.calls), v.flops / 1e12,
                    v.bytes / 1e9, v.seconds);
    }
    return 0;
}

}  // namespace loom::app
