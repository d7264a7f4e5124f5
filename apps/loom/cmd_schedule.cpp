// loom schedule: the pipeline schedule of every rank, without launching anything.
//
//   loom schedule --pp 4 --microbatches 8                      1F1B, one line of ops per rank
//   loom schedule --pp 4 --vpp 2 --microbatches 8              interleaved 1F1B (group size N = pp)
//   loom schedule ... --json [--rank R]                        warm-up, schedule table, order, peak in flight
//   loom schedule ... --svg timeline.svg                       the unit-time timeline of all ranks
//   loom schedule ... --num-layers 32                          plus the layers each model chunk holds
#include "apps/loom/commands.h"
#include "core/error.h"
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
                 "the interleaved one.",
                 "loom schedule"};
    pipeline::ScheduleOptions   options;
    pipeline::LayerSplitOptions split;
    int                         vpp        = 0;
    int                         group_size = 0;
    int                         rank       = 0;
    int                         layers_per_virtual_stage = 0, first_layers = 0, last_layers = 0;
    bool                        json = false;
    std::string                 svg_path;
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
    const bool one_rank = app.count("--rank") > 0;
    LOOM_CHECK(!one_rank || (rank >= 0 && rank < options.pp),
               "--rank " << rank << " is out of range for --pipeline-model-parallel-size " << options.pp,
               "use a rank in 0.." << options.pp - 1);

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
