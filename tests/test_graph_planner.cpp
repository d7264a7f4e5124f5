// The per-layer CUDA-graph planner (docs/design/schedules_and_graphs.md sections 2.3, 6.1-6.3, 6.5,
// 6.7, cited below by number): the header's worked example step by step, the golden set assignment of 6.5, the counts
// table of 6.5, P1 set counts independent of M, every golden schedule order expanding to a valid timeline, the pool
// intervals, several signatures, the validation catching corrupted plans, and `loom schedule --graph-plan`. Everything
// is exact integer arithmetic.
#include "core/error.h"
#include "graphs/planner.h"
#include "pipeline/schedule.h"

#include "error_text.h"
#include "loom_cli_runner.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <map>
#include <set>
#include <sstream>
#include <string>
#include <tuple>
#include <vector>

using namespace loom;
using namespace loom::graphs;

namespace {

GraphPlanOptions options(int pp, std::optional<int> vpp, int m, int rank, std::vector<int> layers = {},
                         std::optional<int> n = std::nullopt) {
    GraphPlanOptions o;
    o.schedule.pp                    = pp;
    o.schedule.vpp                   = vpp;
    o.schedule.num_microbatches      = m;
    o.schedule.microbatch_group_size = n;
    o.rank                           = rank;
    o.layers_per_chunk               = std::move(layers);
    return o;
}

bool contains(const std::string & haystack, const std::string & needle) {
    return haystack.find(needle) != std::string::npos;
}

std::string labels(const GraphPlan & plan) {
    std::string s;
    for (const GraphStep & step : plan.timeline) {
        if (!s.empty()) s += ' ';
        s += step_label(step);
    }
    return s;
}

// The set ids of (c, m, 0) for m = 0..Mc-1, for one-layer chunks.
std::vector<int> sets_of_chunk(const GraphPlan & plan, int chunk) {
    std::vector<int> sets;
    for (const std::vector<int> & layers : plan.input_sets[chunk]) sets.push_back(layers.at(0));
    return sets;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Worked examples

// The example at the top of planner.h: PP 2, 1F1B, M 3, rank 0, two layers.
TEST(GraphPlanner, HeaderWorkedExamplePp2M3TwoLayers) {
    GraphPlan plan = plan_graphs(options(2, std::nullopt, 3, 0, {2}));
    EXPECT_EQ(plan.order, (std::vector<int>{1, 1, -1, 1, -1, -1}));
    EXPECT_EQ(plan.captured_microbatches, 3);
    EXPECT_EQ(plan.num_warmup, 1);
    EXPECT_EQ(labels(plan), "F0.0.0 F0.0.1 F0.1.0 F0.1.1 B0.0.1 B0.0.0 F0.2.0 F0.2.1 B0.1.1 B0.1.0 B0.2.1 B0.2.0");
    std::vector<int> ids, sets, grad_outputs;
    for (const GraphStep & s : plan.timeline) {
        ids.push_back(s.graph_id);
        sets.push_back(s.input_set);
        grad_outputs.push_back(s.grad_output_buffer);
    }
    EXPECT_EQ(ids, (std::vector<int>{0, 1, 2, 3, 7, 6, 4, 5, 9, 8, 11, 10}));
    EXPECT_EQ(sets, (std::vector<int>{0, 1, 2, 3, 1, 0, 0, 1, 3, 2, 1, 0}));
    EXPECT_EQ(grad_outputs, (std::vector<int>{-1, -1, -1, -1, 0, 0, -1, -1, 0, 0, 0, 0}));
    EXPECT_EQ(plan.num_graphs, 12);
    EXPECT_EQ(plan.num_input_sets(), 4);
    EXPECT_EQ(plan.num_grad_output_buffers(), 1);
    EXPECT_EQ(plan.peak_in_flight, 2);
    EXPECT_EQ(plan.peak_layer_forwards, 4);

    std::map<std::string, std::pair<int, int>> at;   // "dX0.0.1" -> [first, last]
    for (const PoolInterval & p : plan.pool_intervals) {
        at[std::string(pool_tensor_name(p.tensor)) + std::to_string(p.chunk) + "." + std::to_string(p.microbatch) +
           "." + std::to_string(p.layer)] = {p.first, p.last};
    }
    ASSERT_EQ(at.size(), 18u);
    EXPECT_EQ(at["Y0.0.0"], std::make_pair(0, 5));
    EXPECT_EQ(at["Saved0.0.1"], std::make_pair(1, 4));
    EXPECT_EQ(at["Y0.2.1"], std::make_pair(7, 10));
    EXPECT_EQ(at["dX0.0.1"], std::make_pair(4, 5));
    EXPECT_EQ(at["dX0.0.0"], std::make_pair(5, 9));    // until B0.1's layer-0 graph
    EXPECT_EQ(at["dX0.1.0"], std::make_pair(9, 11));
    EXPECT_EQ(at["dX0.2.0"], std::make_pair(11, 11));  // no chunk-backward after it: the end of T
    EXPECT_EQ(plan.peak_live_grad_inputs, 3);          // at step 9: dX0.0.0, dX0.1.1, dX0.1.0
}

// Section 6.5, "Golden set assignment": L = 1, PP 4, V 2, M 8 (N = PP), ranks 0 and 3; S_i in allocation order.
TEST(GraphPlanner, SpecGoldenSetAssignmentL1Pp4Vpp2M8Ranks0And3) {
    GraphPlan r0 = plan_graphs(options(4, 2, 8, 0));
    EXPECT_EQ(r0.num_input_sets(), 11);
    EXPECT_EQ(sets_of_chunk(r0, 0), (std::vector<int>{0, 1, 2, 3, 8, 9, 10, 4}));
    EXPECT_EQ(sets_of_chunk(r0, 1), (std::vector<int>{4, 5, 6, 7, 5, 6, 7, 0}));

    GraphPlan r3 = plan_graphs(options(4, 2, 8, 3));
    EXPECT_EQ(r3.num_input_sets(), 5);
    EXPECT_EQ(sets_of_chunk(r3, 0), (std::vector<int>{0, 1, 2, 3, 4, 0, 1, 2}));
    EXPECT_EQ(sets_of_chunk(r3, 1), (std::vector<int>{4, 4, 4, 4, 3, 3, 3, 3}));
    // The timeline reads the same sets: rank 3's first steps F0.0 .. F1.0 B1.0 F1.1.
    std::vector<int> first;
    for (int i = 0; i < 7; ++i) first.push_back(r3.timeline[i].input_set);
    EXPECT_EQ(first, (std::vector<int>{0, 1, 2, 3, 4, 4, 4}));
    // Flat ids, Mc = 8, one layer per chunk: FWD(c, m) = 8 c + m, BWD + 16.
    EXPECT_EQ(graph_id(r3, GraphKind::forward, 1, 3, 0), 11);
    EXPECT_EQ(graph_id(r3, GraphKind::backward, 0, 7, 0), 23);
}

// Section 6.5's counts table: W / P_r, P1 sets and graphs per rank.
TEST(GraphPlanner, SpecCountsTablePerRank) {
    struct Row {
        const char *       name;
        GraphPlanOptions   options;   // rank filled in below
        std::vector<int>   warmup, peak, sets;
        int                graphs;
    };
    const Row rows[] = {
        {"PP4 V2 M8 N4 L4", options(4, 2, 8, 0, {4, 4}), {10, 8, 6, 4}, {11, 9, 7, 5}, {44, 36, 28, 20}, 128},
        {"PP4 V2 M8 N4 L2", options(4, 2, 8, 0, {2, 2}), {10, 8, 6, 4}, {11, 9, 7, 5}, {22, 18, 14, 10}, 64},
        {"PP4 V2 M8 N4 L1", options(4, 2, 8, 0), {10, 8, 6, 4}, {11, 9, 7, 5}, {11, 9, 7, 5}, 32},
        {"PP4 V2 M4 N4 L1 (clipped)", options(4, 2, 4, 0), {8, 8, 6, 4}, {8, 8, 7, 5}, {8, 8, 7, 5}, 16},
        {"PP4 V2 M8 N8 L1", options(4, 2, 8, 0, {}, 8), {14, 12, 10, 8}, {15, 13, 11, 9}, {15, 13, 11, 9}, 32},
        {"PP4 1F1B M8, 8 layers per rank", options(4, std::nullopt, 8, 0, {8}), {3, 2, 1, 0}, {4, 3, 2, 1},
         {32, 24, 16, 8}, 128},
    };
    for (const Row & row : rows) {
        for (int r = 0; r < 4; ++r) {
            GraphPlanOptions o = row.options;
            o.rank             = r;
            GraphPlan plan     = plan_graphs(o);
            EXPECT_EQ(plan.num_warmup, row.warmup[r]) << row.name << " rank " << r;
            EXPECT_EQ(plan.peak_in_flight, row.peak[r]) << row.name << " rank " << r;
            EXPECT_EQ(plan.num_input_sets(), row.sets[r]) << row.name << " rank " << r;
            EXPECT_EQ(plan.peak_layer_forwards, row.sets[r]) << row.name << " rank " << r;
            EXPECT_EQ(plan.num_graphs, row.graphs) << row.name << " rank " << r;
            EXPECT_EQ(plan.num_grad_output_buffers(), 1) << row.name << " rank " << r;
        }
    }
}

// Section 6.5: PP = 1 captures one microbatch, P = 1, L sets, 2 L graphs; every microbatch replays m = 0's.
TEST(GraphPlanner, Pp1CapturesOneMicrobatchWithLSetsAnd2LGraphs) {
    for (int layers : {1, 3, 6}) {
        GraphPlan plan = plan_graphs(options(1, std::nullopt, 8, 0, {layers}));
        EXPECT_EQ(plan.captured_microbatches, 1);
        EXPECT_EQ(plan.order, (std::vector<int>{1, -1}));
        EXPECT_EQ(plan.peak_in_flight, 1);
        EXPECT_EQ(plan.num_input_sets(), layers);
        EXPECT_EQ(plan.num_graphs, 2 * layers);
        for (int m = 0; m < 8; ++m) {
            EXPECT_EQ(graph_id(plan, GraphKind::forward, 0, m, layers - 1), layers - 1);
            EXPECT_EQ(graph_id(plan, GraphKind::backward, 0, m, 0), layers);
        }
    }
    // PP > 1: each microbatch its own graph.
    GraphPlan pp2 = plan_graphs(options(2, std::nullopt, 4, 0, {2}));
    EXPECT_EQ(graph_id(pp2, GraphKind::forward, 0, 3, 1), 7);
    EXPECT_EQ(graph_id(pp2, GraphKind::backward, 0, 3, 1), 15);
}

// Sections 2.3 / 6.7: the number of P1 sets does not grow with M (16, 64, 256) at fixed (PP, V), the graphs do.
TEST(GraphPlanner, InputSetCountIndependentOfMicrobatches) {
    for (int pp : {2, 4, 8}) {
        for (std::optional<int> vpp : {std::optional<int>{}, std::optional<int>{2}, std::optional<int>{4}}) {
            const int v = vpp.value_or(1);
            for (int r = 0; r < pp; ++r) {
                std::vector<int> sets;
                for (int m : {16, 64, 256}) {
                    GraphPlan plan = plan_graphs(options(pp, vpp, m, r, std::vector<int>(v, 2)));
                    sets.push_back(plan.num_input_sets());
                    EXPECT_EQ(plan.num_graphs, 2 * m * v * 2);
                }
                const int p = vpp ? 2 * (pp - r - 1) + (v - 1) * pp + 1 : pp - r;   // unclipped for M >= 16
                EXPECT_EQ(sets, (std::vector<int>{2 * p, 2 * p, 2 * p})) << "pp " << pp << " v " << v << " r " << r;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Timelines of the golden schedule orders

namespace {

// Checked here without validate_graph_plan(): T is the order expanded layer by layer, every (c, m, l)
// runs exactly once per kind, every BWD after its FWD, the ids are the formula's.
void check_timeline(const GraphPlan & plan, const std::string & where) {
    std::vector<pipeline::ScheduleOp> ops = pipeline::order_ops(plan.order);
    std::vector<std::tuple<bool, int, int, int>> expected;
    for (const pipeline::ScheduleOp & op : ops) {
        const int layers = plan.layers_per_chunk[op.chunk];
        for (int i = 0; i < layers; ++i) {
            expected.emplace_back(op.forward, op.chunk, op.microbatch, op.forward ? i : layers - 1 - i);
        }
    }
    ASSERT_EQ(plan.timeline.size(), expected.size()) << where;
    std::set<std::tuple<bool, int, int, int>> seen;
    std::set<int>                             ids;
    const int mc = plan.captured_microbatches, total = plan.total_layers();
    for (size_t i = 0; i < expected.size(); ++i) {
        const GraphStep & s = plan.timeline[i];
        const bool forward  = s.kind == GraphKind::forward;
        ASSERT_EQ(std::make_tuple(forward, s.chunk, s.microbatch, s.layer), expected[i]) << where << " step " << i;
        ASSERT_TRUE(seen.insert(expected[i]).second) << where << ": " << step_label(s) << " twice";
        if (!forward) {
            ASSERT_TRUE(seen.count({true, s.chunk, s.microbatch, s.layer})) << where << ": " << step_label(s);
        }
        const int id = plan.layer_prefix(s.chunk) * mc + s.microbatch * plan.layers_per_chunk[s.chunk] + s.layer;
        ASSERT_EQ(s.graph_id, forward ? id : id + mc * total) << where;
        ids.insert(s.graph_id);
    }
    EXPECT_EQ(seen.size(), static_cast<size_t>(2 * mc * total)) << where;
    EXPECT_EQ(ids.size(), static_cast<size_t>(2 * mc * total)) << where;
    EXPECT_EQ(*ids.rbegin(), 2 * mc * total - 1) << where;
}

}  // namespace

TEST(GraphPlanner, EveryGoldenScheduleOrderExpandsToAValidTimeline) {
    struct Case {
        GraphPlanOptions options;
        std::string      order;   // "" when only the invariants are checked
    };
    std::vector<Case> cases = {
        // test_schedule.cpp's goldens: section 1.6, PP 4 V 2 M 8, ranks 0 and 3; the docstring's PP 2 N 3 M 5 V 2.
        {options(4, 2, 8, 0),
         "1 1 1 1 2 2 2 2 1 1 1 -2 1 -2 2 -2 2 -2 2 -1 2 -1 -1 -1 -2 -2 -2 -2 -1 -1 -1 -1"},
        {options(4, 2, 8, 1), "1 1 1 1 2 2 2 2 1 -2 1 -2 1 -2 1 -2 2 -1 2 -1 2 -1 2 -1 -2 -2 -2 -2 -1 -1 -1 -1"},
        {options(4, 2, 8, 2), "1 1 1 1 2 2 2 -2 2 -2 1 -2 1 -2 1 -1 1 -1 2 -1 2 -1 2 -2 2 -2 -2 -2 -1 -1 -1 -1"},
        {options(4, 2, 8, 3), "1 1 1 1 2 -2 2 -2 2 -2 2 -2 1 -1 1 -1 1 -1 1 -1 2 -2 2 -2 2 -2 2 -2 -1 -1 -1 -1"},
        {options(2, 2, 5, 0, {}, 3), "1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1"},
        {options(2, 2, 5, 1, {}, 3), "1 1 1 2 -2 2 -2 2 -2 1 -1 1 -1 2 -1 2 -2 -2 -1 -1"},
        {options(1, std::nullopt, 4, 0), "1 -1"},
        {options(4, 1, 8, 0), ""},   // explicit V = 1: the interleaved path
        {options(8, 1, 8, 3), ""},   // clipped warm-up
        {options(4, 3, 4, 0), ""},   // all in warm-up
    };
    for (int pp : {2, 3, 4, 8}) {   // the 1F1B closed-form cases
        for (int m : {1, 2, 3, 5, 8, 16}) {
            for (int r = 0; r < pp; ++r) cases.push_back({options(pp, std::nullopt, m, r), ""});
        }
    }
    for (const Case & c : cases) {
        for (const std::vector<int> & layers : {std::vector<int>{1}, std::vector<int>{3}, std::vector<int>{2, 0, 1}}) {
            GraphPlanOptions o = c.options;
            const int        v = pipeline::num_model_chunks(o.schedule);
            o.layers_per_chunk.clear();
            for (int i = 0; i < v; ++i) o.layers_per_chunk.push_back(layers[i % layers.size()]);
            if (layers.size() == 3 && v == 1) continue;
            std::ostringstream where;
            where << "pp " << o.schedule.pp << " vpp " << o.schedule.vpp.value_or(0) << " m "
                  << o.schedule.num_microbatches << " rank " << o.rank << " layers " << o.layers_per_chunk[0] << "..";
            GraphPlan plan = plan_graphs(o);
            pipeline::ScheduleOptions captured = o.schedule;
            captured.num_microbatches          = plan.captured_microbatches;
            EXPECT_EQ(plan.order, pipeline::schedule_order(captured, o.rank)) << where.str();
            if (!c.order.empty()) {
                std::istringstream is(c.order);
                std::vector<int>   golden;
                for (int x; is >> x;) golden.push_back(x);
                EXPECT_EQ(plan.order, golden) << where.str();
            }
            check_timeline(plan, where.str());
            EXPECT_EQ(plan.peak_in_flight, pipeline::expected_peak_in_flight(captured, o.rank)) << where.str();
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Pool intervals, signatures, non-uniform chunks

// Section 6.5: Y and Saved peak at L P_r; at most 3 dX buffers live at once, 2 when L = 1.
TEST(GraphPlanner, PoolPeaksAreLTimesPeakInFlightAndAtMostThreeDgrads) {
    for (int layers : {1, 2, 4}) {
        for (int r = 0; r < 4; ++r) {
            GraphPlan plan = plan_graphs(options(4, 2, 8, r, {layers, layers}));
            const int p    = 11 - 2 * r;
            EXPECT_EQ(plan.peak_live_outputs, layers * p) << layers << " " << r;
            EXPECT_EQ(plan.peak_live_saved, layers * p) << layers << " " << r;
            EXPECT_EQ(plan.peak_live_grad_inputs, layers == 1 ? 2 : 3) << layers << " " << r;
            EXPECT_EQ(plan.pool_intervals.size(), 3u * 16 * layers);
        }
    }
}

// Non-uniform chunks, two input signatures, two output signatures: PP 4, V 2, M 8, rank 3, L = {2, 1};
// chunk 0's layers read "a" and "b", chunk 1's reads "a"; chunk 1's output is "moe". P_3 = 5 chunk-
// microbatches: "a" peaks at 5 (F1.0 with chunk 0's m 0..3 outstanding, and F0.4), "b" at 5 (F0.4).
TEST(GraphPlanner, SetsPerSignatureArePeakOutstandingLayerForwardsOfThatSignature) {
    GraphPlanOptions o  = options(4, 2, 8, 3, {2, 1});
    o.input_signatures  = {{"a", "b"}, {"a"}};
    o.output_signatures = {{"hidden", "hidden"}, {"moe"}};
    GraphPlan plan      = plan_graphs(o);
    EXPECT_EQ(plan.num_graphs, 2 * 8 * 3);
    EXPECT_EQ(plan.num_input_sets(), 10);
    EXPECT_EQ(std::count(plan.set_signatures.begin(), plan.set_signatures.end(), "a"), 5);
    EXPECT_EQ(std::count(plan.set_signatures.begin(), plan.set_signatures.end(), "b"), 5);
    EXPECT_EQ(plan.grad_output_signatures, (std::vector<std::string>{"moe", "hidden"}));   // first BWD is B1.0
    EXPECT_EQ(plan.peak_layer_forwards, 10);   // F0.4: m 0..4 of chunk 0, two layers each
    // Chunk 1's ids follow chunk 0's: prefix(1) Mc = 2 x 8.
    EXPECT_EQ(graph_id(plan, GraphKind::forward, 1, 0, 0), 16);
    EXPECT_EQ(graph_id(plan, GraphKind::forward, 0, 7, 1), 15);
    EXPECT_EQ(graph_id(plan, GraphKind::backward, 1, 7, 0), 23 + 24);
    for (const GraphStep & s : plan.timeline) {
        EXPECT_EQ(plan.set_signatures[s.input_set], o.input_signatures[s.chunk][s.layer]) << step_label(s);
        if (s.kind == GraphKind::backward) {
            EXPECT_EQ(s.grad_output_buffer, s.chunk == 1 ? 0 : 1) << step_label(s);
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Validation

TEST(GraphPlanner, ValidationCatchesCorruptedPlans) {
    const GraphPlan good = plan_graphs(options(2, std::nullopt, 3, 0, {2}));   // the header's example
    EXPECT_NO_THROW(validate_graph_plan(good));
    auto expect_error = [&](const char * what, auto corrupt, const std::string & needle) {
        GraphPlan bad = good;
        corrupt(bad);
        std::string e = error_of([&] { validate_graph_plan(bad); });
        EXPECT_TRUE(contains(e, needle)) << what << ": " << e;
    };
    expect_error("duplicate id", [](GraphPlan & p) { p.timeline[1].graph_id = p.timeline[0].graph_id; },
                 "graph id 0 is used twice");
    expect_error("wrong id", [](GraphPlan & p) { std::swap(p.timeline[0].graph_id, p.timeline[1].graph_id); },
                 "step 0 (F0.0.0) has graph id 1, expected 0");
    expect_error("backward first", [](GraphPlan & p) { std::swap(p.timeline[0], p.timeline[5]); },
                 "step 0 (B0.0.0) runs a backward before its forward");
    expect_error("chunk-backward split", [](GraphPlan & p) { std::swap(p.timeline[5], p.timeline[6]); },
                 "does not follow the backward of layer 1");
    // F0.2.0 handed S2, which F0.1.0 owns until B0.1.
    expect_error("set handed out while owned",
                 [](GraphPlan & p) {
                     p.timeline[6].input_set = 2;
                     p.input_sets[0][2][0]   = 2;
                 },
                 "static input set S2 is handed to F0.2.0 at step 6 while chunk 0 microbatch 1 still owns it");
    expect_error("BWD reads another set", [](GraphPlan & p) { p.timeline[4].input_set = 0; },
                 "step 4 (B0.0.1) reads set S0, the plan gives (c, m, l) S1");
    expect_error("extra set",
                 [](GraphPlan & p) {
                     p.set_signatures.push_back("hidden");
                     p.timeline[6].input_set = 4;   // F0.2.0 and B0.2.0 in a fresh set instead of reusing S0
                     p.timeline[11].input_set = 4;
                     p.input_sets[0][2][0]   = 4;
                 },
                 "input signature 'hidden' has 5 static input sets, but at most 4 are owned at once");
    expect_error("dX released early",
                 [](GraphPlan & p) {
                     for (PoolInterval & i : p.pool_intervals) {
                         if (i.tensor == PoolTensor::grad_input && i.layer == 1 && i.microbatch == 0) i.last = i.first;
                     }
                 },
                 "dX(0, 0, 1) lives over [4, 4], but BWD(0, 0, 0) consumes it at step 5");
    expect_error("Y interval", [](GraphPlan & p) { p.pool_intervals[0].last = 3; },
                 "Y(0, 0, 0) lives over [0, 3], expected [0, 5]");
    expect_error("grad-output buffer", [](GraphPlan & p) { p.timeline[4].grad_output_buffer = 1; },
                 "reads grad-output buffer 1");
    expect_error("graph count", [](GraphPlan & p) { p.timeline.pop_back(); }, "graph plan has 11 steps");
}

TEST(GraphPlanner, RejectsBadOptionsNamingWhatIsWrong) {
    EXPECT_TRUE(contains(error_of([] { plan_graphs(options(4, 2, 8, 0, {1, 1, 1})); }),
                         "layers are given for 3 chunks, the rank has 2"));
    EXPECT_TRUE(contains(error_of([] { plan_graphs(options(4, 2, 8, 4)); }), "pipeline rank 4 is out of range"));
    EXPECT_TRUE(contains(error_of([] { plan_graphs(options(4, 2, 8, 0, {0, 0})); }), "no graphed layer"));
    EXPECT_TRUE(contains(error_of([] { plan_graphs(options(4, 2, 7, 0)); }),
                         "--microbatch-group-size-per-virtual-pipeline-stage"));
    GraphPlanOptions forward_only = options(4, 2, 8, 0);
    forward_only.schedule.forward_only = true;
    EXPECT_TRUE(contains(error_of([&] { plan_graphs(forward_only); }), "forward-only"));
    GraphPlanOptions signatures = options(4, 2, 8, 0, {2, 2});
    signatures.input_signatures = {{"a", "a"}, {"a"}};
    EXPECT_TRUE(contains(error_of([&] { plan_graphs(signatures); }),
                         "input signatures of chunk 1 name 1 layers, the chunk has 2"));
}

// ---------------------------------------------------------------------------------------------------
// loom schedule --graph-plan

TEST(LoomScheduleGraphPlan, JsonMatchesTheLibrary) {
    CliRun r = run_loom("schedule --graph-plan --pipeline-model-parallel-size 4 --num-virtual-stages-per-pipeline-rank 2 "
                        "--num-microbatches 8 --json",
                        "2>/dev/null");
    ASSERT_EQ(r.status, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    ASSERT_TRUE(j.is_array());
    ASSERT_EQ(j.size(), 4u);
    for (int rank = 0; rank < 4; ++rank) {
        GraphPlan plan = plan_graphs(options(4, 2, 8, rank));
        EXPECT_EQ(j[rank]["rank"], rank);
        EXPECT_EQ(j[rank]["counts"]["graphs"], 32);
        EXPECT_EQ(j[rank]["counts"]["input_sets"], 11 - 2 * rank);
        EXPECT_EQ(j[rank]["counts"]["peak_in_flight"], 11 - 2 * rank);
        EXPECT_EQ(j[rank]["order"].get<std::vector<int>>(), plan.order);
        ASSERT_EQ(j[rank]["timeline"].size(), 32u);
        for (size_t i = 0; i < 32; ++i) {
            EXPECT_EQ(j[rank]["timeline"][i]["graph_id"], plan.timeline[i].graph_id);
            EXPECT_EQ(j[rank]["timeline"][i]["input_set"], plan.timeline[i].input_set);
        }
        EXPECT_EQ(j[rank]["pool_intervals"].size(), 48u);
    }
    // --rank 3 with --num-layers 32 (4 layers per chunk): one object, section 6.5's 20 sets / 128 graphs.
    CliRun one = run_loom("schedule --graph-plan --pp 4 --vpp 2 --microbatches 8 --num-layers 32 --rank 3 --json",
                          "2>/dev/null");
    ASSERT_EQ(one.status, 0) << one.out;
    auto k = nlohmann::json::parse(one.out);
    ASSERT_TRUE(k.is_object());
    EXPECT_EQ(k["layers_per_chunk"].get<std::vector<int>>(), (std::vector<int>{4, 4}));
    EXPECT_EQ(k["counts"]["input_sets"], 20);
    EXPECT_EQ(k["counts"]["graphs"], 128);
    EXPECT_EQ(k["input_sets"][1][4].get<std::vector<int>>(), (std::vector<int>{12, 13, 14, 15}));
}

TEST(LoomScheduleGraphPlan, TextShowsTheTimelineAndCounts) {
    CliRun r = run_loom("schedule --graph-plan --pp 4 --vpp 2 --microbatches 8 --rank 3", "2>/dev/null");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "graph plan, rank 3: interleaved 1F1B, PP=4, VPP=2, M=8, N=4\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "     4  F1.0.0     8     S4   -\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "     5  B1.0.0    24     S4   0  Y1.0.0 Saved1.0.0\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "  graphs 32 (16 FWD + 16 BWD = 2 x Mc 8 x 2 layers)\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "  P1 static input sets 5 (hidden 5), P2 grad-output buffers 1\n")) << r.out;
    EXPECT_TRUE(contains(r.out, "peak in flight P_r 5 chunk-microbatches")) << r.out;
    EXPECT_FALSE(contains(r.out, "rank 0")) << r.out;

    CliRun layers = run_loom("schedule --graph-plan --pp 4 --microbatches 8 --layers-per-chunk 8 --rank 0", "2>/dev/null");
    ASSERT_EQ(layers.status, 0) << layers.out;
    EXPECT_TRUE(contains(layers.out, "P1 static input sets 32 (hidden 32)")) << layers.out;
    EXPECT_TRUE(contains(layers.out, "graphs 128")) << layers.out;
}

TEST(LoomScheduleGraphPlan, BadInputExitsTwoWithNothingOnStdout) {
    const std::pair<std::string, std::string> cases[] = {
        {"schedule --graph-plan --pp 4 --vpp 2 --microbatches 8 --layers-per-chunk 4", "layers are given for 1 chunks"},
        {"schedule --graph-plan --pp 4 --microbatches 8 --forward-only", "forward-only"},
        {"schedule --graph-plan --pp 4 --microbatches 8 --svg x.svg", "--svg"},
        {"schedule --pp 4 --microbatches 8 --layers-per-chunk 4", "--graph-plan"},
    };
    for (const auto & [args, needle] : cases) {
        CliRun out = run_loom(args, "2>/dev/null");
        EXPECT_EQ(out.status, 2) << args;
        EXPECT_EQ(out.out, "") << args;
        CliRun err = run_loom(args, "2>&1 >/dev/null");
        EXPECT_TRUE(contains(err.out, needle)) << args << "\n" << err.out;
    }
}
