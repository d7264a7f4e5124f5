// loom schedule: the pipeline schedule of every rank, without launching anything.
//
//   loom schedule --pp 4 --microbatches 8                      1F1B, one line of ops per rank
//   loom schedule --pp 4 --vpp 2 --microbatches 8              interleaved 1F1B (group size N = pp)
//   loom schedule ... --json [--rank R]                        warm-up, schedule table, order, peak in flight
//   loom schedule ... --svg timeline.svg                       the unit-time timeline of all ranks
//   loom schedule ... --num-layers 32                          plus the layers each model chunk holds
//   loom schedule ... --graph-plan [--json] [--rank R]         the per-layer CUDA-graph plan of each rank:
//                     [--layers-per-chunk 4,4 | --num-layers 32]  timeline, graph ids, static input sets,
//                                                                 pool intervals, counts (graphs/planner.h)
#include "apps/loom/commands.h"
#include "core/error.h"
#include "graphs/planner.h"
#include "pipeline/layer_assignment.h"
#include "pipeline/schedule.h"
#include "pipeline/timeline.h"

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <iostream>
#include <optional>
#include <sstream>
#include <string>

namespace loom::app {

namespace {

nlohmann::ordered_json rank_json(const pipeline::ScheduleOptions & options, int rank,
                         const std::optional<pipeline::LayerAssignment> & layers) {
    nlohmann::ordered_json table = nlohmann::ordered_json::array();
    for (const pipeline::ScheduleEntry & e : pipeline::schedule_table(options)) {
        table.push_back({e.microbatch, e.chunk});
    }
    nlohmann::ordered_json j;
    j["rank"]                    = rank;
    j["num_warmup_microbatches"] = pipeline::num_warmup_microbatches(options, rank);
    j["schedule_table"]          = table;
    j["order"]                   = pipeline::schedule_order(options, rank);
    j["peak_in_flight"]          = pipeline::peak_in_flight(options, rank);
    if (layers) {
        nlohmann::ordered_json chunks = nlohmann::ordered_json::array();
        for (const pipeline::LayerRange & range : layers->ranges[rank]) chunks.push_back({range.begin, range.end});
        j["layers"] = chunks;
    }
    return j;
}

nlohmann::ordered_json graph_plan_json(const graphs::GraphPlan & plan) {
    nlohmann::ordered_json timeline = nlohmann::ordered_json::array();
    for (size_t i = 0; i < plan.timeline.size(); ++i) {
        const graphs::GraphStep & s = plan.timeline[i];
        nlohmann::ordered_json    step;
        step["step"]       = i;
        step["kind"]       = graphs::graph_kind_name(s.kind);
        step["chunk"]      = s.chunk;
        step["microbatch"] = s.microbatch;
        step["layer"]      = s.layer;
        step["graph_id"]   = s.graph_id;
        step["input_set"]  = s.input_set;
        if (s.grad_output_buffer >= 0) step["grad_output_buffer"] = s.grad_output_buffer;
        timeline.push_back(step);
    }
    nlohmann::ordered_json intervals = nlohmann::ordered_json::array();
    for (const graphs::PoolInterval & p : plan.pool_intervals) {
        intervals.push_back({{"tensor", graphs::pool_tensor_name(p.tensor)}, {"chunk", p.chunk},
                             {"microbatch", p.microbatch}, {"layer", p.layer}, {"first", p.first}, {"last", p.last}});
    }
    nlohmann::ordered_json j;
    j["rank"]                    = plan.rank;
    j["schedule"]                = pipeline::schedule_kind_name(pipeline::schedule_kind(plan.schedule));
    j["num_microbatches"]        = plan.schedule.num_microbatches;
    j["captured_microbatches"]   = plan.captured_microbatches;
    j["num_warmup_microbatches"] = plan.num_warmup;
    j["layers_per_chunk"]        = plan.layers_per_chunk;
    j["order"]                   = plan.order;
    j["timeline"]                = timeline;
    j["input_sets"]              = plan.input_sets;   // [chunk][microbatch][layer] -> set id
    j["set_signatures"]          = plan.set_signatures;
    j["grad_output_signatures"]  = plan.grad_output_signatures;
    j["pool_intervals"]          = intervals;
    j["counts"] = {{"graphs", plan.num_graphs},
                   {"input_sets", plan.num_input_sets()},
                   {"grad_output_buffers", plan.num_grad_output_buffers()},
                   {"peak_in_flight", plan.peak_in_flight},
                   {"peak_layer_forwards", plan.peak_layer_forwards},
                   {"peak_live", {{"Y", plan.peak_live_outputs}, {"Saved", plan.peak_live_saved},
                                  {"dX", plan.peak_live_grad_inputs}}}};
    return j;
}

// Splits a flat, chunk-major list of per-layer signatures into [chunk][layer] ("" list: the default).
std::vector<std::vector<std::string>> signatures_per_chunk(const std::vector<std::string> & flat,
                                                           const std::vector<int> & layers, const char * flag) {
    if (flat.empty()) return {};
    int total = 0;
    for (int n : layers) total += n;
    LOOM_CHECK(static_cast<int>(flat.size()) == total,
               flag << " names " << flat.size() << " layers, the rank has " << total << " graphed layers",
               "give one signature per graphed layer, chunk after chunk, separated by commas");
    std::vector<std::vector<std::string>> out;
    size_t                                next = 0;
    for (int n : layers) {
        out.emplace_back(flat.begin() + next, flat.begin() + next + n);
        next += n;
    }
    return out;
}

// "layers 0-3, 16-19" (inclusive, per chunk; "none" for an empty chunk).
std::string layers_text(const pipeline::LayerAssignment & layers, int rank) {
    std::ostringstream os;
    os << "layers";
    for (size_t c = 0; c < layers.ranges[rank].size(); ++c) {
        const pipeline::LayerRange & range = layers.ranges[rank][c];
        os << (c ? ", " : " ");
        if (range.size() == 0) {
            os << "none";
        } else if (range.size() == 1) {
            os << range.begin;
        } else {
            os << range.begin << "-" << range.end - 1;
        }
    }
    return os.str();
}

}  // namespace

int cmd_schedule(int argc, char ** argv) {
    CLI::App app{"Print the pipeline-parallel schedule of every rank: the warm-up forwards, the schedule table "
                 "[(microbatch, chunk)], the order (+c forward / -c backward of 1-based model chunk c) and the peak "
                 "number of microbatches in flight; or draw the timeline of all ranks in unit time (forward 1, "
                 "backward 2) as an SVG. PP 1 runs no pipelining, --vpp unset the 1F1B schedule, --vpp V (even 1) "
                 "the interleaved one. With --graph-plan, the per-layer CUDA-graph plan of each rank instead.",
                 "loom schedule"};
    pipeline::ScheduleOptions   options;
    pipeline::LayerSplitOptions split;
    int                         vpp        = 0;
    int                         group_size = 0;
    int                         rank       = 0;
    int                         layers_per_virtual_stage = 0, first_layers = 0, last_layers = 0;
    bool                        json = false;
    std::string                 svg_path;
    bool                        graph_plan = false;
    std::vector<int>            layers_per_chunk;
    std::vector<std::string>    input_signatures, output_signatures;
    app.add_option("--pp,--pipeline-model-parallel-size", options.pp, "pipeline-parallel size")->required();
    app.add_option("--vpp,--num-virtual-stages-per-pipeline-rank", vpp,
                   "model chunks per rank: the interleaved schedule (unset: 1F1B)");
    app.add_option("--microbatches,--num-microbatches", options.num_microbatches,
                   "microbatches per iteration: --global-batch-size / (--micro-batch-size x dp)")
        ->required();
    app.add_option("--microbatch-group-size,--microbatch-group-size-per-virtual-pipeline-stage", group_size,
                   "consecutive microbatches per virtual stage in the interleaved schedule (default: pp)");
    app.add_option("--rank", rank, "print this pipeline rank only (--json and text)");
    app.add_flag("--forward-only", options.forward_only, "forwards only (evaluation): every microbatch in warm-up");
    app.add_flag("--json", json, "print JSON: one object per rank (one object with --rank)");
    app.add_option("--svg", svg_path, "write the timeline of all ranks to this SVG file")->type_name("FILE");
    app.add_option("--num-layers", split.num_layers, "transformer layers: also print the layers of every chunk");
    app.add_option("--num-layers-per-virtual-pipeline-stage", layers_per_virtual_stage,
                   "derive --vpp as (num-layers / pp) / this (needs --num-layers)");
    app.add_option("--decoder-first-pipeline-num-layers", first_layers, "layers on the first stage (needs --num-layers)");
    app.add_option("--decoder-last-pipeline-num-layers", last_layers, "layers on the last stage (needs --num-layers)");

    app.add_flag("--graph-plan", graph_plan,
                 "print the per-layer CUDA-graph plan of each rank instead: the timeline of graphs with their ids, "
                 "static input sets and grad-output buffers, the pool tensors' lifetimes and the counts");
    app.add_option("--layers-per-chunk", layers_per_chunk,
                   "with --graph-plan: graphed layers of each model chunk of the rank, e.g. 4,4 (default: from "
                   "--num-layers, else 1 per chunk)")
        ->delimiter(',');
    app.add_option("--graph-input-signatures", input_signatures,
                   "with --graph-plan: each graphed layer's static-input signature, chunk after chunk (layers with "
                   "equal names share static input sets; default: all the same)")
        ->delimiter(',');
    app.add_option("--graph-output-signatures", output_signatures,
                   "with --graph-plan: each graphed layer's output signature, chunk after chunk (one grad-output "
                   "buffer per name; default: all the same)")
        ->delimiter(',');

    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    if (app.count("--vpp")) options.vpp = vpp;
    if (app.count("--microbatch-group-size")) options.microbatch_group_size = group_size;

    // The layer split, when asked for; it may derive the virtual stages.
    std::optional<pipeline::LayerAssignment> layers;
    const bool wants_layers = app.count("--num-layers") || app.count("--num-layers-per-virtual-pipeline-stage") ||
                              app.count("--decoder-first-pipeline-num-layers") ||
                              app.count("--decoder-last-pipeline-num-layers");
    if (wants_layers) {
        LOOM_CHECK(app.count("--num-layers"),
                   "--num-layers-per-virtual-pipeline-stage and --decoder-first/last-pipeline-num-layers need "
                   "--num-layers",
                   "add --num-layers");
        split.pp  = options.pp;
        split.vpp = options.vpp;
        if (app.count("--num-layers-per-virtual-pipeline-stage")) split.num_layers_per_virtual_stage = layers_per_virtual_stage;
        if (app.count("--decoder-first-pipeline-num-layers")) split.first_stage_layers = first_layers;
        if (app.count("--decoder-last-pipeline-num-layers")) split.last_stage_layers = last_layers;
        layers      = pipeline::assign_layers(split);   // throws: exit 2, no stdout
        options.vpp = pipeline::resolve_virtual_stages(split);
    }

    pipeline::validate_schedule(options);   // throws: exit 2, no stdout
    // Every rank's order holds 2 x vpp x microbatches operations, each printed: past 2^24 in all the listing
    // would only exhaust memory.
    const int64_t operations = 2 * int64_t{options.pp} * options.vpp.value_or(1) * options.num_microbatches;
    LOOM_CHECK(operations <= (int64_t{1} << 24),
               "--pipeline-model-parallel-size " << options.pp << " x --num-microbatches " << options.num_microbatches
                                                 << " is " << operations << " operations to print, more than `loom schedule` "
                                                 << "prints (at most 2^24)",
               "the schedule's shape repeats: print one with fewer stages or microbatches");
    const bool one_rank = app.count("--rank") > 0;
    LOOM_CHECK(!one_rank || (rank >= 0 && rank < options.pp),
               "--rank " << rank << " is out of range for --pipeline-model-parallel-size " << options.pp,
               "use a rank in 0.." << options.pp - 1);

    const bool graph_flags = app.count("--layers-per-chunk") || app.count("--graph-input-signatures") ||
                             app.count("--graph-output-signatures");
    LOOM_CHECK(graph_plan || !graph_flags,
               "--layers-per-chunk and --graph-input/output-signatures only apply to --graph-plan", "add --graph-plan");
    if (graph_plan) {
        LOOM_CHECK(svg_path.empty(), "--svg draws the schedule timeline, not a graph plan",
                   "drop --svg, or run without --graph-plan");
        LOOM_CHECK(!(app.count("--layers-per-chunk") && layers),
                   "--layers-per-chunk and --num-layers both give the layers of each chunk", "give one of them");
        // Every plan is computed (and validated) before anything is printed.
        std::vector<graphs::GraphPlan> plans;
        for (int r = 0; r < options.pp; ++r) {
            if (one_rank && r != rank) continue;
            graphs::GraphPlanOptions plan_options;
            plan_options.schedule = options;
            plan_options.rank     = r;
            if (layers) {
                for (const pipeline::LayerRange & range : layers->ranges[r]) plan_options.layers_per_chunk.push_back(range.size());
            } else {
                plan_options.layers_per_chunk = layers_per_chunk;
            }
            std::vector<int> resolved = plan_options.layers_per_chunk;
            if (resolved.empty()) resolved.assign(pipeline::num_model_chunks(options), 1);
            plan_options.input_signatures  = signatures_per_chunk(input_signatures, resolved, "--graph-input-signatures");
            plan_options.output_signatures = signatures_per_chunk(output_signatures, resolved, "--graph-output-signatures");
            plans.push_back(graphs::plan_graphs(plan_options));
        }
        std::string out;
        if (json && one_rank) {
            out = graph_plan_json(plans[0]).dump() + "\n";
        } else if (json) {
            out = "[\n";
            for (size_t i = 0; i < plans.size(); ++i) {
                out += graph_plan_json(plans[i]).dump() + (i + 1 < plans.size() ? ",\n" : "\n");
            }
            out += "]\n";
        } else {
            for (size_t i = 0; i < plans.size(); ++i) out += (i ? "\n" : "") + graphs::graph_plan_text(plans[i]);
        }
        std::cout << out;
        return 0;
    }

    // Everything is computed before anything is printed or written.
    pipeline::Timeline timeline = pipeline::simulate_timeline(options);
    std::string        out;
    if (json) {
        if (one_rank) {
            out = rank_json(options, rank, layers).dump() + "\n";
        } else {
            out = "[\n";
            for (int r = 0; r < options.pp; ++r) {
                out += rank_json(options, r, layers).dump() + (r + 1 < options.pp ? ",\n" : "\n");
            }
            out += "]\n";
        }
    } else if (svg_path.empty()) {
        std::istringstream text(pipeline::timeline_text(timeline));
        std::string        line;
        for (int i = 0; std::getline(text, line); ++i) {
            // Lines 0 and 1 are the header; line 2 + r is rank r.
            const int r = i - 2;
            if (one_rank && r >= 0 && r != rank) continue;
            out += line + "\n";
            if (layers && r >= 0) out += "        " + layers_text(*layers, r) + "\n";
        }
    }
    if (!svg_path.empty()) {
        pipeline::write_file_atomically(svg_path, pipeline::timeline_svg(timeline));
        if (!json) {
            std::ostringstream os;
            os.precision(3);
            os << "wrote " << svg_path << ": total time " << timeline.total_time() << " units, bubble fraction "
               << 100.0 * timeline.bubble_fraction() << "%\n";
            out += os.str();
        }
    }
    std::cout << out;
    return 0;
}

}  // namespace loom::app
