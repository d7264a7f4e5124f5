// Pipeline schedules (docs/design/schedules_and_graphs.md sections 1 and 6.5, cited below by number): the golden
// PP=4 VPP=2 M=8 orders of 1.6 on every rank, Megatron's docstring PP=2 N=3 M=5 VPP=2 example, the
// M=8 V=2 N=4 schedule table and the layer split of 1.7, warm-up counts (explicit VPP=1 against none, the cap at M x V,
// forward-only), the order invariants, peak in flight against its closed form and the unit-time
// timeline over pp {1,2,3,4,8} x vpp {none,1,2,3,4} x several M and N, the validation errors naming
// Megatron's flags, and the `loom schedule` command. Everything here is exact integer arithmetic, except
// the timeline's bubble fractions, compared to 1e-12.
#include "core/error.h"
#include "pipeline/layer_assignment.h"
#include "pipeline/schedule.h"
#include "pipeline/timeline.h"

#include "loom_cli_runner.h"
#include "tests/schedule_options.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <unistd.h>
#include <vector>

using namespace loom;
using namespace loom::pipeline;

namespace {

using loom::testing::schedule;

// The message and hint of the Error `f` throws ("" if none).
template <typename F>
std::string error_of(F && f) {
    try {
        f();
    } catch (const Error & e) {
        return e.message() + " | " + e.hint();
    }
    return "";
}

std::vector<int> parse_order(const std::string & text) {
    std::istringstream is(text);
    std::vector<int>   order;
    for (int x; is >> x;) order.push_back(x);
    return order;
}

std::string labels(const std::vector<ScheduleOp> & ops) {
    std::string s;
    for (const ScheduleOp & op : ops) {
        if (!s.empty()) s += ' ';
        s += op_label(op);
    }
    return s;
}

bool contains(const std::string & haystack, const std::string & needle) {
    return haystack.find(needle) != std::string::npos;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Worked examples of docs/design/schedules_and_graphs.md

// Section 1.6, golden per-rank orders for PP=4, V=2, M=8, N=4 (the default N = PP).
TEST(Schedule, SpecGoldenOrdersPp4Vpp2M8EveryRank) {
    const std::vector<std::string> golden = {
        "+1 +1 +1 +1 +2 +2 +2 +2 +1 +1 +1 -2 +1 -2 +2 -2 +2 -2 +2 -1 +2 -1 -1 -1 -2 -2 -2 -2 -1 -1 -1 -1",
        "+1 +1 +1 +1 +2 +2 +2 +2 +1 -2 +1 -2 +1 -2 +1 -2 +2 -1 +2 -1 +2 -1 +2 -1 -2 -2 -2 -2 -1 -1 -1 -1",
        "+1 +1 +1 +1 +2 +2 +2 -2 +2 -2 +1 -2 +1 -2 +1 -1 +1 -1 +2 -1 +2 -1 +2 -2 +2 -2 -2 -2 -1 -1 -1 -1",
        "+1 +1 +1 +1 +2 -2 +2 -2 +2 -2 +2 -2 +1 -1 +1 -1 +1 -1 +1 -1 +2 -2 +2 -2 +2 -2 +2 -2 -1 -1 -1 -1",
    };
    const int warmup[] = {10, 8, 6, 4};
    ScheduleOptions o = schedule(4, 2, 8);
    for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(schedule_order(o, r), parse_order(golden[r])) << "rank " << r;
        EXPECT_EQ(num_warmup_microbatches(o, r), warmup[r]) << "rank " << r;
        EXPECT_EQ(peak_in_flight(o, r), warmup[r] + 1) << "rank " << r;
    }
    EXPECT_EQ(labels(schedule_ops(o, 0)),
              "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 F0.5 F0.6 B1.0 F0.7 B1.1 F1.4 B1.2 F1.5 B1.3 F1.6 B0.0 "
              "F1.7 B0.1 B0.2 B0.3 B1.4 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7");
    EXPECT_EQ(labels(schedule_ops(o, 3)),
              "F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F0.4 B0.0 F0.5 B0.1 F0.6 B0.2 F0.7 B0.3 "
              "F1.4 B1.4 F1.5 B1.5 F1.6 B1.6 F1.7 B1.7 B0.4 B0.5 B0.6 B0.7");
}

// Section 1.4 and Megatron's docstring: PP=2, N=3, M=5, V=2.
TEST(Schedule, ReferenceDocstringExamplePp2N3M5Vpp2) {
    ScheduleOptions                  o     = schedule(2, 2, 5, 3);
    const std::vector<ScheduleEntry> table = schedule_table(o);
    std::vector<int>                 ms, cs;
    for (const ScheduleEntry & e : table) {
        ms.push_back(e.microbatch);
        cs.push_back(e.chunk);
    }
    EXPECT_EQ(ms, (std::vector<int>{0, 1, 2, 0, 1, 2, 3, 4, 3, 4}));
    EXPECT_EQ(cs, (std::vector<int>{0, 0, 0, 1, 1, 1, 0, 0, 1, 1}));
    EXPECT_EQ(num_warmup_microbatches(o, 0), 5);
    EXPECT_EQ(schedule_order(o, 0), parse_order("1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1"));
    EXPECT_EQ(labels(schedule_ops(o, 0)),
              "F0.0 F0.1 F0.2 F1.0 F1.1 F1.2 B1.0 F0.3 B1.1 F0.4 B1.2 F1.3 B0.0 F1.4 B0.1 B0.2 B1.3 B1.4 B0.3 B0.4");
    EXPECT_EQ(peak_in_flight(o, 0), 6);
    // Rank 1 (last): W = (V - 1) N = 3.
    EXPECT_EQ(num_warmup_microbatches(o, 1), 3);
    EXPECT_EQ(schedule_order(o, 1), parse_order("1 1 1 2 -2 2 -2 2 -2 1 -1 1 -1 2 -1 2 -2 -2 -1 -1"));
    EXPECT_EQ(peak_in_flight(o, 1), 4);
}

// Section 1.6: the table for M=8, V=2, N=4, and the forward/backward id lists derived from it.
TEST(Schedule, SeedTableM8Vpp2N4) {
    const std::vector<ScheduleEntry> expected = {{0, 0}, {1, 0}, {2, 0}, {3, 0}, {0, 1}, {1, 1}, {2, 1}, {3, 1},
                                                 {4, 0}, {5, 0}, {6, 0}, {7, 0}, {4, 1}, {5, 1}, {6, 1}, {7, 1}};
    EXPECT_EQ(schedule_table(8, 2, 4), expected);
    EXPECT_EQ(schedule_table(schedule(4, 2, 8)), expected);
    // Rank 0's derivation: warm-up fwd[:10], then (fwd[k], bwd[k-10]), then bwd[-10:].
    EXPECT_EQ(convert_schedule_table_to_order(10, 2, expected),
              parse_order("1 1 1 1 2 2 2 2 1 1  1 -2 1 -2 2 -2 2 -2 2 -1 2 -1  -1 -1 -2 -2 -2 -2 -1 -1 -1 -1"));
}

// Section 1.2's no-pipelining orders: [1, -1] per microbatch (1F1B without a pipeline).
TEST(Schedule, NoPipeliningIsForwardThenBackwardPerMicrobatch) {
    ScheduleOptions o = schedule(1, std::nullopt, 4);
    EXPECT_EQ(schedule_kind(o), ScheduleKind::no_pipelining);
    EXPECT_EQ(num_warmup_microbatches(o, 0), 0);
    EXPECT_EQ(schedule_order(o, 0), parse_order("1 -1 1 -1 1 -1 1 -1"));
    EXPECT_EQ(peak_in_flight(o, 0), 1);
    // An explicit VPP of 1 with PP 1 is still no pipelining.
    EXPECT_EQ(schedule_order(schedule(1, 1, 4), 0), parse_order("1 -1 1 -1 1 -1 1 -1"));
}

// Section 6.5's table of warm-up counts and peaks (W / P per rank).
TEST(Schedule, SpecWorkedExamplesWarmupAndPeak) {
    struct Case {
        ScheduleOptions  options;
        std::vector<int> warmup, peak;
    };
    const Case cases[] = {
        {schedule(4, 2, 8, 4), {10, 8, 6, 4}, {11, 9, 7, 5}},
        {schedule(4, 2, 4, 4), {8, 8, 6, 4}, {8, 8, 7, 5}},             // clipped at M x V = 8
        {schedule(4, 2, 8, 8), {14, 12, 10, 8}, {15, 13, 11, 9}},       // N = 8, not PP
        {schedule(4, std::nullopt, 8), {3, 2, 1, 0}, {4, 3, 2, 1}},    // non-interleaved
    };
    for (const Case & c : cases) {
        for (int r = 0; r < 4; ++r) {
            EXPECT_EQ(num_warmup_microbatches(c.options, r), c.warmup[r]) << "rank " << r;
            EXPECT_EQ(peak_in_flight(c.options, r), c.peak[r]) << "rank " << r;
            EXPECT_EQ(expected_peak_in_flight(c.options, r), c.peak[r]) << "rank " << r;
        }
    }
}

// The 1F1B closed form of section 1.6: [+1]*W + [+1, -1]*(M - W) + [-1]*W.
TEST(Schedule, OneFOneBOrderClosedForm) {
    for (int pp : {2, 3, 4, 8}) {
        for (int m : {1, 2, 3, 5, 8, 16}) {
            ScheduleOptions o = schedule(pp, std::nullopt, m);
            for (int r = 0; r < pp; ++r) {
                const int w = std::min(pp - r - 1, m);
                ASSERT_EQ(num_warmup_microbatches(o, r), w);
                std::vector<int> expected(w, 1);
                for (int i = 0; i < m - w; ++i) {
                    expected.push_back(1);
                    expected.push_back(-1);
                }
                expected.insert(expected.end(), w, -1);
                EXPECT_EQ(schedule_order(o, r), expected) << "pp " << pp << " m " << m << " rank " << r;
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Warm-up counts

TEST(Schedule, ExplicitVppOneRunsTheInterleavedPathUnlikeNone) {
    ScheduleOptions none = schedule(4, std::nullopt, 8);
    ScheduleOptions one  = schedule(4, 1, 8);
    EXPECT_EQ(schedule_kind(none), ScheduleKind::one_f_one_b);
    EXPECT_EQ(schedule_kind(one), ScheduleKind::interleaved);
    for (int r = 0; r < 4; ++r) {
        EXPECT_EQ(num_warmup_microbatches(none, r), 3 - r);
        EXPECT_EQ(num_warmup_microbatches(one, r), 2 * (3 - r));   // 2 (PP - r - 1) + 0 N
        EXPECT_EQ(peak_in_flight(one, r), 2 * (3 - r) + 1);
    }
    // The interleaved validation applies to V = 1 too: M = 2 < PP = 4 is fine without V, not with V = 1.
    EXPECT_NO_THROW(schedule_order(schedule(4, std::nullopt, 2), 0));
    EXPECT_THROW(schedule_order(schedule(4, 1, 2), 0), Error);
}

TEST(Schedule, WarmupIsCappedAtMicrobatchesTimesChunks) {
    // PP 8, V 1, M 8: rank 0 would run 14 warm-up forwards, there are only 8.
    EXPECT_EQ(num_warmup_microbatches(schedule(8, 1, 8), 0), 8);
    EXPECT_EQ(num_warmup_microbatches(schedule(8, 1, 8), 3), 8);
    EXPECT_EQ(num_warmup_microbatches(schedule(8, 1, 8), 4), 6);
    // PP 4, V 3, M 4, N 4: 6 + 2 x 4 = 14 > 12.
    EXPECT_EQ(num_warmup_microbatches(schedule(4, 3, 4), 0), 12);
    EXPECT_EQ(peak_in_flight(schedule(4, 3, 4), 0), 12);
    // All in warm-up: every forward, then every backward.
    std::vector<int> order = schedule_order(schedule(4, 3, 4), 0);
    EXPECT_TRUE(std::all_of(order.begin(), order.begin() + 12, [](int x) { return x > 0; }));
    EXPECT_TRUE(std::all_of(order.begin() + 12, order.end(), [](int x) { return x < 0; }));
    // 1F1B: min(PP - r - 1, M).
    EXPECT_EQ(num_warmup_microbatches(schedule(8, std::nullopt, 3), 0), 3);
}

TEST(Schedule, ForwardOnlyRunsEveryMicrobatchInWarmupAndKeepsNoContext) {
    for (std::optional<int> vpp : {std::optional<int>{}, std::optional<int>{1}, std::optional<int>{2}}) {
        ScheduleOptions o = schedule(4, vpp, 8, std::nullopt, true);
        const int       v = vpp.value_or(1);
        for (int r = 0; r < 4; ++r) {
            EXPECT_EQ(num_warmup_microbatches(o, r), 8 * v);
            std::vector<int> order = schedule_order(o, r);
            ASSERT_EQ(order.size(), static_cast<size_t>(8 * v));
            EXPECT_TRUE(std::all_of(order.begin(), order.end(), [](int x) { return x > 0; }));
            EXPECT_EQ(peak_in_flight(o, r), 1);
            EXPECT_EQ(expected_peak_in_flight(o, r), 1);
        }
        Timeline t = simulate_timeline(o);
        EXPECT_EQ(t.ranks[0].size(), static_cast<size_t>(8 * v));
    }
    EXPECT_EQ(num_warmup_microbatches(schedule(1, std::nullopt, 5, std::nullopt, true), 0), 5);
}

// ---------------------------------------------------------------------------------------------------
// The sweep: pp {1,2,4,8} x vpp {none,1,2,3,4} x M x N, training and forward-only

namespace {

// Whether section 1.4's validation accepts the configuration (the validation the sweep checks against).
bool spec_accepts(int pp, std::optional<int> vpp, int m, std::optional<int> n_flag) {
    if (!vpp) return true;
    if (pp == 1) return *vpp == 1;
    const int n = n_flag.value_or(pp);
    return pp <= n && n <= m && (m % n == 0 || m % n >= pp);
}

// Order invariants of section 1.6 and Megatron's test_get_pipeline_parallel_order assertions, plus: every (m, c)
// forward and backward exactly once, a backward never before its forward, per-chunk FIFO.
void check_order(const std::vector<int> & order, int m, int v, bool forward_only, const std::string & where) {
    ASSERT_EQ(order.size(), static_cast<size_t>((forward_only ? 1 : 2) * m * v)) << where;
    EXPECT_EQ(*std::max_element(order.begin(), order.end()), v) << where;
    int prefix = 0;
    std::vector<int> plus(v, 0), minus(v, 0);
    for (int x : order) {
        ASSERT_NE(x, 0) << where;
        ASSERT_LE(std::abs(x), v) << where;
        prefix += x > 0 ? 1 : -1;
        ASSERT_GE(prefix, 0) << where;
        (x > 0 ? plus : minus)[std::abs(x) - 1]++;
        ASSERT_LE(minus[std::abs(x) - 1], plus[std::abs(x) - 1]) << where;
    }
    EXPECT_EQ(prefix, forward_only ? m * v : 0) << where;

    std::map<std::pair<int, int>, int> forward_at, backward_at;   // (chunk, microbatch) -> position
    std::vector<ScheduleOp>            ops = order_ops(order);
    for (size_t i = 0; i < ops.size(); ++i) {
        auto & seen = ops[i].forward ? forward_at : backward_at;
        ASSERT_LT(ops[i].microbatch, m) << where;
        ASSERT_TRUE(seen.emplace(std::make_pair(ops[i].chunk, ops[i].microbatch), static_cast<int>(i)).second)
            << where << ": " << op_label(ops[i]) << " twice";
        if (!ops[i].forward) {
            auto f = forward_at.find({ops[i].chunk, ops[i].microbatch});
            ASSERT_TRUE(f != forward_at.end()) << where << ": " << op_label(ops[i]) << " before its forward";
        }
    }
    EXPECT_EQ(forward_at.size(), static_cast<size_t>(m * v)) << where;
    EXPECT_EQ(backward_at.size(), static_cast<size_t>(forward_only ? 0 : m * v)) << where;
}

// The timeline respects every dependency, never overlaps two ops of a rank, and runs every op.
void check_timeline(const Timeline & t, int m, int v, bool forward_only, const std::string & where) {
    const int pp     = t.options.pp;
    const int stages = pp * v;
    std::map<std::tuple<bool, int, int>, std::pair<double, double>> at;   // (forward, stage, m) -> [start, end)
    for (int r = 0; r < pp; ++r) {
        ASSERT_EQ(t.ranks[r].size(), static_cast<size_t>((forward_only ? 1 : 2) * m * v)) << where;
        double free = 0.0;
        for (const TimelineOp & op : t.ranks[r]) {
            ASSERT_GE(op.start, free) << where;
            ASSERT_DOUBLE_EQ(op.end - op.start, op.op.forward ? 1.0 : 2.0) << where;
            free = op.end;
            at[{op.op.forward, op.op.chunk * pp + r, op.op.microbatch}] = {op.start, op.end};
        }
    }
    for (const auto & [key, span] : at) {
        const auto [forward, s, mb] = key;
        if (forward && s > 0) {
            ASSERT_GE(span.first, at.at({true, s - 1, mb}).second) << where;
        }
        if (!forward) {
            ASSERT_GE(span.first, at.at({true, s, mb}).second) << where;
            if (s + 1 < stages) {
                ASSERT_GE(span.first, at.at({false, s + 1, mb}).second) << where;
            }
        }
    }
}

}  // namespace

TEST(Schedule, SweepOrdersWarmupPeakTimelineAndValidation) {
    int accepted = 0, rejected = 0;
    for (int pp : {1, 2, 3, 4, 8}) {
        for (std::optional<int> vpp : {std::optional<int>{}, std::optional<int>{1}, std::optional<int>{2},
                                       std::optional<int>{3}, std::optional<int>{4}}) {
            for (int m : {1, 2, 3, 4, 5, 7, 8, 9, 12, 16, 32}) {
                std::vector<std::optional<int>> group_sizes = {std::nullopt, pp, pp + 1, pp + 3, m, 1};
                for (std::optional<int> n : group_sizes) {
                    for (bool forward_only : {false, true}) {
                        ScheduleOptions   o     = schedule(pp, vpp, m, n, forward_only);
                        const std::string where = "pp " + std::to_string(pp) + " vpp " +
                                                  (vpp ? std::to_string(*vpp) : "none") + " m " + std::to_string(m) +
                                                  " n " + (n ? std::to_string(*n) : "default") +
                                                  (forward_only ? " forward-only" : "");
                        if (!spec_accepts(pp, vpp, m, n)) {
                            EXPECT_THROW(validate_schedule(o), Error) << where;
                            EXPECT_THROW(schedule_order(o, 0), Error) << where;
                            ++rejected;
                            continue;
                        }
                        ASSERT_NO_THROW(validate_schedule(o)) << where;
                        ++accepted;
                        const bool interleaved = pp > 1 && vpp.has_value();
                        const int  v           = interleaved ? *vpp : 1;
                        const int  nn          = n.value_or(pp);
                        for (int r = 0; r < pp; ++r) {
                            const std::string at = where + " rank " + std::to_string(r);
                            int w = forward_only ? m * v
                                    : pp == 1    ? 0
                                    : interleaved ? std::min(2 * (pp - r - 1) + (v - 1) * nn, m * v)
                                                  : std::min(pp - r - 1, m);
                            EXPECT_EQ(num_warmup_microbatches(o, r), w) << at;
                            std::vector<int> order = schedule_order(o, r);
                            check_order(order, m, v, forward_only, at);
                            if (!forward_only) {
                                // The formulas of the issue: interleaved and 1F1B (PP 1: 1 = min(1, M)).
                                const int expected = interleaved ? std::min(2 * (pp - r - 1) + (v - 1) * nn + 1, m * v)
                                                                 : std::min(pp - r, m);
                                EXPECT_EQ(peak_in_flight(order), expected) << at;
                                EXPECT_EQ(expected_peak_in_flight(o, r), expected) << at;
                                // The order is the reference conversion of the table with W.
                                EXPECT_EQ(order, convert_schedule_table_to_order(w, v, schedule_table(o))) << at;
                            }
                        }
                        Timeline t;
                        ASSERT_NO_THROW(t = simulate_timeline(o)) << where;   // no deadlock
                        check_timeline(t, m, v, forward_only, where);
                    }
                }
            }
        }
    }
    EXPECT_GT(accepted, 500);
    EXPECT_GT(rejected, 100);
}

// ---------------------------------------------------------------------------------------------------
// Validation errors name Megatron's flags and the valid values

TEST(Schedule, RejectsLastGroupSmallerThanPp) {
    // The reference's unit test: PP=4, N=4, M=7 raises.
    std::string e = error_of([] { validate_schedule(schedule(4, 2, 7, 4)); });
    EXPECT_TRUE(contains(e, "--microbatch-group-size-per-virtual-pipeline-stage 4")) << e;
    EXPECT_TRUE(contains(e, "--pipeline-model-parallel-size 4")) << e;
    EXPECT_TRUE(contains(e, "last group of 3")) << e;
    EXPECT_TRUE(contains(e, "use 8 microbatches, or a group size from: 7")) << e;
    EXPECT_TRUE(contains(e, "--global-batch-size")) << e;
    // The same with the default N = PP says so.
    e = error_of([] { validate_schedule(schedule(4, 2, 7)); });
    EXPECT_TRUE(contains(e, "its default, the pipeline size")) << e;
    // M mod N >= PP is accepted: PP 2, N 3, M 5.
    EXPECT_NO_THROW(validate_schedule(schedule(2, 2, 5, 3)));
}

TEST(Schedule, RejectsGroupSizeOutsidePpToM) {
    std::string below = error_of([] { validate_schedule(schedule(4, 2, 8, 3)); });
    EXPECT_TRUE(contains(below, "--microbatch-group-size-per-virtual-pipeline-stage 3 must be in "
                                "[--pipeline-model-parallel-size 4, number of microbatches 8]"))
        << below;
    EXPECT_TRUE(contains(below, "valid values for 8 microbatches: 4, 8")) << below;
    std::string above = error_of([] { validate_schedule(schedule(4, 2, 8, 9)); });
    EXPECT_TRUE(contains(above, "must be in [--pipeline-model-parallel-size 4, number of microbatches 8]")) << above;
    // Default N = PP > M: the message asks for more microbatches.
    std::string few = error_of([] { validate_schedule(schedule(8, 2, 4)); });
    EXPECT_TRUE(contains(few, "needs at least --pipeline-model-parallel-size (8) microbatches, got 4")) << few;
    EXPECT_TRUE(contains(few, "--global-batch-size")) << few;
    EXPECT_TRUE(contains(few, "--num-virtual-stages-per-pipeline-rank")) << few;
}

TEST(Schedule, RejectsBadSizesNamingTheFlags) {
    EXPECT_TRUE(contains(error_of([] { validate_schedule(schedule(0, std::nullopt, 8)); }),
                         "--pipeline-model-parallel-size must be >= 1"));
    EXPECT_TRUE(contains(error_of([] { validate_schedule(schedule(4, std::nullopt, 0)); }),
                         "number of microbatches must be >= 1"));
    EXPECT_TRUE(contains(error_of([] { validate_schedule(schedule(4, 0, 8)); }),
                         "--num-virtual-stages-per-pipeline-rank must be >= 1"));
    EXPECT_TRUE(contains(error_of([] { validate_schedule(schedule(4, 2, 8, 0)); }),
                         "--microbatch-group-size-per-virtual-pipeline-stage must be >= 1"));
    std::string no_pp = error_of([] { validate_schedule(schedule(1, 2, 8)); });
    EXPECT_TRUE(contains(no_pp, "--num-virtual-stages-per-pipeline-rank 2 needs pipeline parallelism")) << no_pp;
    EXPECT_TRUE(contains(no_pp, "--pipeline-model-parallel-size")) << no_pp;
    EXPECT_TRUE(contains(error_of([] { num_warmup_microbatches(schedule(4, 2, 8), 4); }), "out of range"));
}

// ---------------------------------------------------------------------------------------------------
// The unit-time timeline

TEST(Timeline, OneFOneBHasTheTextbookBubble) {
    // (M + PP - 1)(f + b) in total, bubble (PP - 1) / (M + PP - 1).
    for (int pp : {2, 4, 8}) {
        for (int m : {1, 4, 8, 16}) {
            Timeline t = simulate_timeline(schedule(pp, std::nullopt, m));
            EXPECT_DOUBLE_EQ(t.total_time(), 3.0 * (m + pp - 1)) << pp << " " << m;
            EXPECT_NEAR(t.bubble_fraction(), double(pp - 1) / (m + pp - 1), 1e-12) << pp << " " << m;
        }
    }
    Timeline single = simulate_timeline(schedule(1, std::nullopt, 8));
    EXPECT_DOUBLE_EQ(single.total_time(), 24.0);
    EXPECT_NEAR(single.bubble_fraction(), 0.0, 1e-12);
}

TEST(Timeline, InterleavingShrinksTheBubbleByVpp) {
    // In chunk units the interleaved bubble is (PP - 1)(f + b), against M V (f + b) of work per rank: the
    // bubble fraction (PP - 1) / (M V + PP - 1), 1/V of 1F1B's bubble time per unit of model work.
    Timeline t = simulate_timeline(schedule(4, 2, 8));
    EXPECT_DOUBLE_EQ(t.total_time(), 3.0 * (8 * 2 + 3));
    EXPECT_NEAR(t.bubble_fraction(), 3.0 / 19.0, 1e-12);
    // Rank 0 starts at 0 with F0.0 and the last rank's first backward B1.0 starts after the 8 forward
    // stages of microbatch 0: 4 ranks x 2 chunks.
    EXPECT_DOUBLE_EQ(t.ranks[0][0].start, 0.0);
    for (const TimelineOp & op : t.ranks[3]) {
        if (!op.op.forward) {
            EXPECT_EQ(op_label(op.op), "B1.0");
            EXPECT_DOUBLE_EQ(op.start, 8.0);
            break;
        }
    }
}

TEST(Timeline, TextHasOneLinePerRankWithTheSpecOps) {
    std::string text = timeline_text(simulate_timeline(schedule(4, 2, 8)));
    EXPECT_TRUE(contains(text, "interleaved 1F1B: PP=4, VPP=2, M=8, N=4\n")) << text;
    EXPECT_TRUE(contains(text, "total 57, bubble fraction 15.8%")) << text;
    EXPECT_TRUE(contains(text, "rank 0  W 10  peak 11 | F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 F0.4 F0.5 F0.6 B1.0"))
        << text;
    EXPECT_TRUE(contains(text, "rank 3  W  4  peak  5 | F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1")) << text;
}

TEST(Timeline, SvgHasOneRectPerOpATitleAndALegend) {
    Timeline    t   = simulate_timeline(schedule(4, 2, 8));
    std::string svg = timeline_svg(t);
    ASSERT_EQ(svg.rfind("<svg", 0), 0u);
    EXPECT_TRUE(contains(svg, "</svg>"));
    size_t rects = 0;
    for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
    EXPECT_EQ(rects, 4u * 2 * 8 * 2);
    EXPECT_TRUE(contains(svg, "PP=4, VPP=2, M=8, N=4"));
    EXPECT_TRUE(contains(svg, "total time 57 units, bubble fraction 15.8%"));
    EXPECT_TRUE(contains(svg, "backward 2 units"));
    EXPECT_TRUE(contains(svg, ">F1.3</text>"));
    EXPECT_TRUE(contains(svg, ">B0.7</text>"));
    // Balanced tags: every opened element of these kinds is closed.
    auto count = [&](const std::string & needle) {
        size_t n = 0;
        for (size_t at = svg.find(needle); at != std::string::npos; at = svg.find(needle, at + 1)) ++n;
        return n;
    };
    for (const std::string tag : {"svg", "rect", "text", "g", "title"}) {
        EXPECT_EQ(count("<" + tag + " ") + count("<" + tag + ">"), count("</" + tag + ">")) << tag;
    }
}

// ---------------------------------------------------------------------------------------------------
// Layer assignment

TEST(LayerAssignment, SeedExample32LayersPp4Vpp2) {
    LayerSplitOptions o;
    o.num_layers = 32;
    o.pp         = 4;
    o.vpp        = 2;
    LayerAssignment a = assign_layers(o);
    ASSERT_EQ(a.num_chunks, 2);
    const LayerRange expected[4][2] = {{{0, 4}, {16, 20}}, {{4, 8}, {20, 24}}, {{8, 12}, {24, 28}}, {{12, 16}, {28, 32}}};
    for (int r = 0; r < 4; ++r) {
        for (int c = 0; c < 2; ++c) EXPECT_EQ(a.at(r, c), expected[r][c]) << r << " " << c;
    }
    // The same through --num-layers-per-virtual-pipeline-stage 4: (32 / 4) / 4 = 2 chunks.
    LayerSplitOptions per_stage;
    per_stage.num_layers                   = 32;
    per_stage.pp                           = 4;
    per_stage.num_layers_per_virtual_stage = 4;
    EXPECT_EQ(resolve_virtual_stages(per_stage), std::optional<int>(2));
    EXPECT_EQ(assign_layers(per_stage).ranges, a.ranges);
}

// The embedding and the loss counted as layers: the header's example (L 6, PP 4, V 2), one of them alone,
// and Megatron's checks.
TEST(LayerAssignment, EmbeddingAndLossCountedAsLayers) {
    LayerSplitOptions o;
    o.num_layers            = 6;
    o.pp                    = 4;
    o.vpp                   = 2;
    o.account_for_embedding = true;
    o.account_for_loss      = true;
    LayerAssignment   a     = assign_layers(o);
    const LayerRange expected[4][2] = {{{0, 0}, {3, 4}}, {{0, 1}, {4, 5}}, {{1, 2}, {5, 6}}, {{2, 3}, {6, 6}}};
    for (int r = 0; r < 4; ++r) {
        for (int c = 0; c < 2; ++c) EXPECT_EQ(a.at(r, c), expected[r][c]) << r << " " << c;
    }
    LayerSplitOptions embedding_only;   // L 7 + 1 over PP 4: rank 0 holds one layer, the others two
    embedding_only.num_layers            = 7;
    embedding_only.pp                    = 4;
    embedding_only.account_for_embedding = true;
    LayerAssignment e = assign_layers(embedding_only);
    EXPECT_EQ(e.at(0, 0), (LayerRange{0, 1}));
    EXPECT_EQ(e.at(1, 0), (LayerRange{1, 3}));
    EXPECT_EQ(e.at(3, 0), (LayerRange{5, 7}));
    o.num_layers = 7;
    EXPECT_THROW(assign_layers(o), Error) << "9 counted layers over 4 stages";
    o.num_layers         = 6;
    o.first_stage_layers = 2;
    EXPECT_THROW(assign_layers(o), Error) << "not with uneven ends";
}

// --pipeline-model-parallel-layout: the header's example unrolled and split (PP 2, so 4 virtual stages per
// rank), and Megatron's rules and Loom's, each naming what is wrong.
TEST(LayerAssignment, CustomLayoutFollowsItsStages) {
    const std::vector<std::string> stages = parse_pipeline_layout("Et*3|(tt|)*6tmL");
    EXPECT_EQ(stages, (std::vector<std::string>{"Ettt", "tt", "tt", "tt", "tt", "tt", "tt", "tmL"}));
    EXPECT_EQ(parse_pipeline_layout("E,t|t,L"), (std::vector<std::string>{"Et", "tL"})) << "commas are cosmetic";
    LayerSplitOptions o;
    o.num_layers     = 16;
    o.pp             = 2;
    o.layout         = stages;
    o.mtp_num_layers = 1;
    const LayerAssignment a = assign_layers(o);
    ASSERT_EQ(a.num_chunks, 4);
    const LayerRange expected[2][4] = {{{0, 3}, {5, 7}, {9, 11}, {13, 15}}, {{3, 5}, {7, 9}, {11, 13}, {15, 16}}};
    for (int r = 0; r < 2; ++r) {
        for (int c = 0; c < 4; ++c) EXPECT_EQ(a.at(r, c), expected[r][c]) << r << " " << c;
    }
    EXPECT_EQ(resolve_virtual_stages(o), std::optional<int>(4));
    const std::pair<std::string, const char *> bad[] = {
        {"t*8|Et*8mL", "The first layer must be embedding"},
        {"Et*8|t*7mL", "Number of decoder layers 15 must match num_layers 16"},
        {"Et*8|t*8L", "Number of mtp layers in layout must match mtp_num_layers"},
        {"Et*8m|t*8L", "decoder layers must be placed before MTP layers"},
        {"Et*8|t*8|mL|", "puts the loss before the last stage, which Loom does not support"},
        {"Et*8|t*4|t*4m|L", "puts an MTP layer before the last stage, which Loom does not support"},
        {"Et*8|t*8mLt", "The last layer must be loss"},
        {"Et*8|t*8mx", "invalid layer character 'x'"},
        {"Et*8|t*7|tmL", "must be divisible by pipeline_model_parallel_size (3 stages"},
    };
    for (const auto & entry : bad) {   // (no structured binding: clang 14 cannot capture one)
        const std::string & layout = entry.first;
        LayerSplitOptions   b      = o;
        const std::string   e      = error_of([&] {
            b.layout = parse_pipeline_layout(layout);
            assign_layers(b);
        });
        EXPECT_TRUE(contains(e, entry.second)) << layout << ": " << e;
    }
    LayerSplitOptions uneven = o;
    uneven.first_stage_layers = 4;
    EXPECT_TRUE(contains(error_of([&] { assign_layers(uneven); }), "cannot be set with other pipeline layout arguments"));
}

TEST(LayerAssignment, EvenAndUnevenEnds) {
    LayerSplitOptions even;
    even.num_layers = 12;
    even.pp         = 3;
    LayerAssignment a = assign_layers(even);
    EXPECT_EQ(a.at(0, 0), (LayerRange{0, 4}));
    EXPECT_EQ(a.at(2, 0), (LayerRange{8, 12}));

    LayerSplitOptions uneven;   // the header's example
    uneven.num_layers         = 10;
    uneven.pp                 = 4;
    uneven.first_stage_layers = 1;
    uneven.last_stage_layers  = 3;
    LayerAssignment u = assign_layers(uneven);
    EXPECT_EQ(u.at(0, 0), (LayerRange{0, 1}));
    EXPECT_EQ(u.at(1, 0), (LayerRange{1, 4}));
    EXPECT_EQ(u.at(2, 0), (LayerRange{4, 7}));
    EXPECT_EQ(u.at(3, 0), (LayerRange{7, 10}));

    // Only the last stage set: rank 0 is a middle stage.
    LayerSplitOptions last_only;
    last_only.num_layers        = 14;
    last_only.pp                = 4;
    last_only.last_stage_layers = 2;
    LayerAssignment l = assign_layers(last_only);
    EXPECT_EQ(l.at(0, 0), (LayerRange{0, 4}));
    EXPECT_EQ(l.at(2, 0), (LayerRange{8, 12}));
    EXPECT_EQ(l.at(3, 0), (LayerRange{12, 14}));

    // Uneven with virtual stages: L 28, PP 4, V 2, first 2, last 2: middle ranks hold 12 each, 6 per chunk.
    // Virtual stage 0 = layers 0-13: rank 0 [0, 1), ranks 1, 2 six each, rank 3 [13, 14); stage 1 the same + 14.
    LayerSplitOptions vpp_uneven;
    vpp_uneven.num_layers         = 28;
    vpp_uneven.pp                 = 4;
    vpp_uneven.vpp                = 2;
    vpp_uneven.first_stage_layers = 2;
    vpp_uneven.last_stage_layers  = 2;
    LayerAssignment v = assign_layers(vpp_uneven);
    EXPECT_EQ(v.at(0, 0), (LayerRange{0, 1}));
    EXPECT_EQ(v.at(1, 0), (LayerRange{1, 7}));
    EXPECT_EQ(v.at(2, 0), (LayerRange{7, 13}));
    EXPECT_EQ(v.at(3, 0), (LayerRange{13, 14}));
    EXPECT_EQ(v.at(0, 1), (LayerRange{14, 15}));
    EXPECT_EQ(v.at(3, 1), (LayerRange{27, 28}));
}

TEST(LayerAssignment, EveryLayerExactlyOnceInModelOrder) {
    for (int pp : {1, 2, 4, 8}) {
        for (int v : {1, 2, 3, 4}) {
            if (pp == 1 && v > 1) continue;
            LayerSplitOptions o;
            o.num_layers = pp * v * 3;
            o.pp         = pp;
            o.vpp        = v;
            LayerAssignment a    = assign_layers(o);
            int             next = 0;
            for (int c = 0; c < v; ++c) {   // virtual stage c runs ranks 0..PP-1 in order
                for (int r = 0; r < pp; ++r) {
                    EXPECT_EQ(a.at(r, c).begin, next);
                    EXPECT_EQ(a.at(r, c).size(), 3);
                    next = a.at(r, c).end;
                }
            }
            EXPECT_EQ(next, o.num_layers);
        }
    }
}

TEST(LayerAssignment, RejectsSplitsNamingTheFlags) {
    LayerSplitOptions o;
    o.num_layers = 30;
    o.pp         = 4;
    o.vpp        = 2;
    std::string e = error_of([&] { assign_layers(o); });
    EXPECT_TRUE(contains(e, "--num-layers 30 is not divisible by --pipeline-model-parallel-size 4 x virtual stages "
                            "per rank 2 = 8"))
        << e;
    EXPECT_TRUE(contains(e, "use a multiple of 8 layers")) << e;

    LayerSplitOptions both = o;
    both.num_layers                   = 32;
    both.num_layers_per_virtual_stage = 4;
    EXPECT_TRUE(contains(error_of([&] { assign_layers(both); }), "only one of --num-virtual-stages-per-pipeline-rank"));

    LayerSplitOptions per_stage;
    per_stage.num_layers                   = 32;
    per_stage.pp                           = 4;
    per_stage.num_layers_per_virtual_stage = 3;
    EXPECT_TRUE(contains(error_of([&] { assign_layers(per_stage); }),
                         "not divisible by --num-layers-per-virtual-pipeline-stage 3"));

    LayerSplitOptions middle;
    middle.num_layers         = 10;
    middle.pp                 = 4;
    middle.first_stage_layers = 2;
    std::string m = error_of([&] { assign_layers(middle); });
    EXPECT_TRUE(contains(m, "the 8 layers left after --decoder-first-pipeline-num-layers")) << m;
    EXPECT_TRUE(contains(m, "3 middle pipeline stages")) << m;

    LayerSplitOptions vpp_first;
    vpp_first.num_layers         = 28;
    vpp_first.pp                 = 4;
    vpp_first.vpp                = 2;
    vpp_first.first_stage_layers = 1;
    vpp_first.last_stage_layers  = 3;
    std::string f = error_of([&] { assign_layers(vpp_first); });
    EXPECT_TRUE(contains(f, "--decoder-first-pipeline-num-layers 1 is not divisible by the 2 virtual stages")) << f;

    LayerSplitOptions two;
    two.num_layers         = 10;
    two.pp                 = 2;
    two.first_stage_layers = 4;
    two.last_stage_layers  = 5;
    EXPECT_TRUE(contains(error_of([&] { assign_layers(two); }), "must equal --num-layers 10"));

    LayerSplitOptions no_pp;
    no_pp.num_layers = 8;
    no_pp.vpp        = 2;
    EXPECT_TRUE(contains(error_of([&] { assign_layers(no_pp); }), "need pipeline parallelism"));
}

// ---------------------------------------------------------------------------------------------------
// loom schedule

namespace {
CliRun run_loom_stdout(const std::string & args) { return run_loom(args, "2>/dev/null"); }
CliRun run_loom_stderr(const std::string & args) { return run_loom(args, "2>&1 >/dev/null"); }
}  // namespace

TEST(LoomSchedule, JsonForEveryRankMatchesTheLibrary) {
    CliRun r = run_loom_stdout("schedule --pp 4 --vpp 2 --microbatches 8 --json");
    ASSERT_EQ(r.status, 0) << r.out;
    auto j = nlohmann::json::parse(r.out);
    ASSERT_TRUE(j.is_array());
    ASSERT_EQ(j.size(), 4u);
    ScheduleOptions o = schedule(4, 2, 8);
    for (int rank = 0; rank < 4; ++rank) {
        EXPECT_EQ(j[rank]["rank"], rank);
        EXPECT_EQ(j[rank]["num_warmup_microbatches"], 10 - 2 * rank);
        EXPECT_EQ(j[rank]["peak_in_flight"], 11 - 2 * rank);
        EXPECT_EQ(j[rank]["order"].get<std::vector<int>>(), schedule_order(o, rank));
        auto table = j[rank]["schedule_table"].get<std::vector<std::vector<int>>>();
        ASSERT_EQ(table.size(), 16u);
        EXPECT_EQ(table[4], (std::vector<int>{0, 1}));
        EXPECT_EQ(table[8], (std::vector<int>{4, 0}));
    }
    // --rank: one object; Megatron spellings give the same.
    CliRun one = run_loom_stdout("schedule --pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                                 "--microbatches 5 --microbatch-group-size-per-virtual-pipeline-stage 3 --rank 0 --json");
    ASSERT_EQ(one.status, 0) << one.out;
    auto k = nlohmann::json::parse(one.out);
    ASSERT_TRUE(k.is_object());
    EXPECT_EQ(k["order"].get<std::vector<int>>(), parse_order("1 1 1 2 2 2 -2 1 -2 1 -2 2 -1 2 -1 -1 -2 -2 -1 -1"));
    EXPECT_EQ(k["num_warmup_microbatches"], 5);
    EXPECT_EQ(k["peak_in_flight"], 6);
    EXPECT_FALSE(k.contains("layers"));
    // With --num-layers each rank also lists its chunks' layers.
    CliRun layers = run_loom_stdout("schedule --pp 4 --vpp 2 --microbatches 8 --num-layers 32 --rank 1 --json");
    ASSERT_EQ(layers.status, 0) << layers.out;
    EXPECT_EQ(nlohmann::json::parse(layers.out)["layers"].get<std::vector<std::vector<int>>>(),
              (std::vector<std::vector<int>>{{4, 8}, {20, 24}}));
}

TEST(LoomSchedule, TextRendering) {
    CliRun r = run_loom_stdout("schedule --pp 4 --vpp 2 --microbatches 8");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "rank 0  W 10  peak 11 | F0.0 F0.1")) << r.out;
    EXPECT_TRUE(contains(r.out, "rank 3  W  4  peak  5 |")) << r.out;
    CliRun one = run_loom_stdout("schedule --pp 4 --microbatches 8 --rank 2 --num-layers 8");
    ASSERT_EQ(one.status, 0) << one.out;
    EXPECT_TRUE(contains(one.out, "1F1B: PP=4, VPP=none, M=8")) << one.out;
    EXPECT_TRUE(contains(one.out, "rank 2  W 1  peak 2 | F0.0 F0.1 B0.0")) << one.out;
    EXPECT_TRUE(contains(one.out, "layers 4-5")) << one.out;
    EXPECT_FALSE(contains(one.out, "rank 0")) << one.out;
}

TEST(LoomSchedule, SvgIsWrittenAtomicallyWithOneRectPerOp) {
    const std::string path = ::testing::TempDir() + "loom_schedule_" + std::to_string(::getpid()) + ".svg";
    CliRun            r    = run_loom_stdout("schedule --pp 4 --vpp 2 --microbatches 8 --svg " + path);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_TRUE(contains(r.out, "wrote " + path)) << r.out;
    std::ifstream     in(path);
    std::stringstream ss;
    ss << in.rdbuf();
    const std::string svg = ss.str();
    ASSERT_EQ(svg.rfind("<svg", 0), 0u) << svg.substr(0, 100);
    EXPECT_TRUE(contains(svg, "</svg>\n"));
    size_t rects = 0;
    for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
    EXPECT_EQ(rects, 4u * 2 * 8 * 2);   // PP x (F + B) x M x V
    EXPECT_EQ(svg, timeline_svg(simulate_timeline(schedule(4, 2, 8))));
    std::remove(path.c_str());
    // No temporary file is left behind.
    EXPECT_NE(access((path + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0);
}

TEST(LoomSchedule, BadInputExitsTwoNamingTheFlagWithNothingOnStdout) {
    struct Case {
        std::string args, flag;
    };
    const Case cases[] = {
        {"schedule --pp 0 --microbatches 8", "--pipeline-model-parallel-size"},
        {"schedule --pp 4 --vpp 2 --microbatches 7", "--microbatch-group-size-per-virtual-pipeline-stage"},
        {"schedule --pp 4 --vpp 2 --microbatches 8 --microbatch-group-size 3",
         "--microbatch-group-size-per-virtual-pipeline-stage 3"},
        {"schedule --pp 1 --vpp 2 --microbatches 8", "--num-virtual-stages-per-pipeline-rank"},
        {"schedule --pp 4 --vpp 0 --microbatches 8", "--num-virtual-stages-per-pipeline-rank"},
        {"schedule --pp 4 --microbatches 0", "microbatches"},
        {"schedule --pp 4 --microbatches 8 --rank 4", "--rank 4"},
        {"schedule --pp four --microbatches 8", "--pp"},
        {"schedule --pp 4", "--microbatches"},
        {"schedule --pp 4 --vpp 2 --microbatches 8 --num-layers 30", "--num-layers 30"},
        {"schedule --pp 4 --microbatches 8 --decoder-first-pipeline-num-layers 2", "--num-layers"},
        {"schedule --pp 4 --microbatches 8 --svg /nonexistent-dir/x.svg", "/nonexistent-dir/x.svg"},
    };
    for (const Case & c : cases) {
        CliRun out = run_loom_stdout(c.args);
        EXPECT_EQ(out.status, 2) << c.args;
        EXPECT_EQ(out.out, "") << c.args;
        CliRun err = run_loom_stderr(c.args);
        EXPECT_TRUE(contains(err.out, c.flag)) << c.args << "\n" << err.out;
    }
}
