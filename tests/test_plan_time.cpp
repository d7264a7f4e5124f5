// `loom plan`'s time model: the cost of collectives (NCCL's ring with nccl-tests' bus bandwidth), the meta
// device's modelled clocks (streams, events, host waits), the schedule simulated with planned op durations,
// and whole step plans: the FLOPs the meta device counts from the real GEMMs and attention calls against
// Megatron's formula, the pipeline bubble against the 1F1B formula, links across nodes against NVLink.
#include "core/ops.h"
#include "pipeline/timeline.h"
#include "plan/cost_model.h"
#include "plan/cpu_calibration.h"
#include "plan/layout_search.h"
#include "plan/meta_device.h"
#include "plan/plan_svg.h"
#include "plan/step_plan.h"
#include "train/megatron_flags.h"
#include "train/options_parser.h"

#include "loom_cli_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <CLI/CLI.hpp>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <regex>

using namespace loom;

namespace {

plan::CostModel h100(int gpus_per_node = 8, DType math = DType::bf16) {
    return plan::CostModel(plan::gpu_spec("h100-80gb"), gpus_per_node, math);
}

train::TrainOptions parse_flags(const std::vector<std::string> & flags, int64_t world_size) {
    CLI::App                 app{"test", "loom plan"};
    train::TrainOptionParser parser(app);
    parser.plan_only();
    std::vector<std::string> args{"plan"};
    args.insert(args.end(), flags.begin(), flags.end());
    std::vector<const char *> argv;
    for (const std::string & a : args) argv.push_back(a.c_str());
    train::check_option_values(app, static_cast<int>(argv.size()), argv.data());
    app.parse(static_cast<int>(argv.size()), argv.data());
    return parser.resolve(world_size);
}

// A small model's flags, then `flags`.
train::TrainOptions parse_plan(const std::vector<std::string> & flags, int64_t world_size) {
    std::vector<std::string> args{"--mock-data", "--num-layers", "4", "--hidden-size", "256", "--num-attention-heads", "8",
                                  "--seq-length", "512", "--max-position-embeddings", "512", "--micro-batch-size", "2",
                                  "--vocab-size", "8000", "--bf16"};
    args.insert(args.end(), flags.begin(), flags.end());
    return parse_flags(args, world_size);
}

// The model FLOPs of the tensor-core ops of one stage's iteration: the attention backward's as Megatron
// counts them, twice the forward's (the kernel's 2.5 times include recomputing the scores).
double tensor_core_flops(const plan::RankTime & time) {
    double flops = 0;
    for (const char * op : {"gemm", "attention_forward", "attention_backward"}) {
        const double model_share = std::string(op) == "attention_backward" ? 2.0 / 2.5 : 1.0;
        if (auto it = time.totals.find(op); it != time.totals.end()) flops += model_share * it->second.flops;
    }
    return flops;
}

}  // namespace

TEST(CostModel, RingCollectivesMoveNcclTestsBusBandwidth) {
    const plan::CostModel costs = h100();
    const double          bw    = 450e9 * costs.efficiency().nvlink;
    const double          step  = costs.efficiency().nvlink_step_s;
    const std::vector<int> node{0, 1, 2, 3, 4, 5, 6, 7};
    // 2 (n - 1) / n of the bytes cross each link for an all-reduce, (n - 1) / n for the others.
    EXPECT_NEAR(costs.collective_seconds(plan::CollectiveKind::all_reduce, 1e9, node), 14 * step + 1.75e9 / bw, 1e-12);
    EXPECT_NEAR(costs.collective_seconds(plan::CollectiveKind::reduce_scatter, 1e9, node), 7 * step + 0.875e9 / bw, 1e-12);
    EXPECT_NEAR(costs.collective_seconds(plan::CollectiveKind::all_gather, 1e9, node), 7 * step + 0.875e9 / bw, 1e-12);
    // A group with a rank on another node goes over the network, at the NIC's bandwidth.
    const std::vector<int> two_nodes{0, 8};
    EXPECT_FALSE(costs.within_one_node(two_nodes));
    EXPECT_NEAR(costs.collective_seconds(plan::CollectiveKind::all_reduce, 1e9, two_nodes),
                2 * costs.efficiency().network_step_s + 1e9 / (50e9 * costs.efficiency().network), 1e-12);
    EXPECT_EQ(costs.collective_seconds(plan::CollectiveKind::all_reduce, 1e9, {3}), 0.0);   // a group of one
    try {
        plan::gpu_spec("v100");
        FAIL() << "an unknown GPU was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.what()).find("--gpu v100"), std::string::npos) << e.what();
        EXPECT_NE(std::string(e.what()).find("h100-80gb"), std::string::npos) << e.what();
    }
}

// `loom train` on a GPU plans its step on the GPU its device names: only the parts the table describes.
TEST(CostModel, CudaProductNamesMapToThePlansGpus) {
    const std::pair<const char *, const char *> names[] = {
        {"NVIDIA H100 80GB HBM3", "h100-80gb"}, {"NVIDIA H200", "h200"},           {"NVIDIA A100-SXM4-80GB", "a100-80gb"},
        {"NVIDIA B200", "b200"},                {"NVIDIA H100 PCIe", ""},          {"NVIDIA H100 NVL", ""},
        {"NVIDIA H200 NVL", ""},                {"NVIDIA A100 80GB PCIe", ""},     {"NVIDIA A100-SXM4-40GB", ""},
        {"Loom emulated device 0", ""},         {"", ""}};
    for (const auto & [product, gpu] : names) EXPECT_EQ(plan::gpu_for_product(product), gpu) << product;
}

TEST(MetaClock, StreamsEventsAndHostWaitsOrderTheModelledTime) {
    const plan::CostModel costs = h100();
    plan::MetaDevice      device(&costs);
    Stream &              compute = device.compute_stream();
    const int64_t         n       = 4096;
    Tensor a = Tensor::empty({n, n}, DType::bf16, device), b = Tensor::empty({n, n}, DType::bf16, device);
    Tensor c = Tensor::empty({n, n}, DType::f32, device);
    const double flops = 2.0 * n * n * n, bytes = 2.0 * n * n * 2 + 4.0 * n * n;
    const double gemm  = costs.kernel_seconds(flops, bytes, costs.efficiency().gemm);
    EXPECT_NEAR(gemm, 2e-6 + flops / (989.4e12 * 0.70), 1e-9);   // compute-bound at 70% of the dense peak
    device.ops().gemm(compute, a, false, b, false, c);
    device.ops().gemm(compute, a, false, b, false, c);
    EXPECT_NEAR(*compute.modelled_seconds(), 2 * gemm, 1e-12);
    EXPECT_EQ(device.clock().host, 0.0);   // enqueued, not waited for
    // A second stream runs beside it until it waits for an event recorded after the GEMMs.
    std::unique_ptr<Stream> side = device.stream_create("side");
    device.ops().fill_zero(*side, c);
    const double zero = costs.memory_seconds(static_cast<double>(c.nbytes()));
    EXPECT_NEAR(*side->modelled_seconds(), zero, 1e-12);
    std::unique_ptr<Event> done = device.event_create();
    compute.record(*done);
    side->wait(*done);
    device.ops().fill_zero(*side, c);
    EXPECT_NEAR(*side->modelled_seconds(), 2 * gemm + zero, 1e-12);
    // The host waits for the side stream; work it enqueues afterwards starts no earlier.
    side->synchronize();
    EXPECT_NEAR(device.clock().host, 2 * gemm + zero, 1e-12);
    device.ops().fill_zero(compute, c);
    EXPECT_NEAR(*compute.modelled_seconds(), 2 * gemm + 2 * zero, 1e-12);
    EXPECT_EQ(device.clock().totals.at("gemm").calls, 2);
    EXPECT_NEAR(device.clock().totals.at("gemm").flops, 2 * flops, 1.0);
    // A collective without a stream starts at the host's time; waiting for it moves the host to its end.
    plan::MetaCommunicatorFactory factory(8, 0, &device.clock());
    std::shared_ptr<comm::Communicator> world = factory.world();
    const double                        host  = device.clock().host;
    world->all_reduce(c, comm::ReduceOp::sum)->wait();
    EXPECT_NEAR(device.clock().host,
                host + costs.collective_seconds(plan::CollectiveKind::all_reduce, static_cast<double>(c.nbytes()), world->global_ranks()),
                1e-12);
}

TEST(Timeline, PlannedDurationsGiveTheOneFOneBMakespan) {
    pipeline::ScheduleOptions o;
    o.pp               = 4;
    o.num_microbatches = 8;
    const double f = 1.5, b = 3.25, t = 0.5;
    // Equal durations through the function: the unit-time simulation's ops, at the same times.
    const pipeline::Timeline unit = pipeline::simulate_timeline(o, f, b);
    const pipeline::Timeline same = pipeline::simulate_timeline(o, [&](int, size_t, const pipeline::ScheduleOp & op) {
        return op.forward ? f : b;
    });
    ASSERT_EQ(unit.ranks.size(), same.ranks.size());
    for (size_t r = 0; r < unit.ranks.size(); ++r) {
        ASSERT_EQ(unit.ranks[r].size(), same.ranks[r].size());
        for (size_t k = 0; k < unit.ranks[r].size(); ++k) EXPECT_EQ(unit.ranks[r][k].end, same.ranks[r][k].end);
    }
    // 1F1B over uniform stages ends after (M + PP - 1)(f + b). With transfers, the first stage's backward of
    // micro-batch m waits for m's round trip through the second stage: between its forward of m and its
    // backward of m it runs one backward and one forward (f + b), while the round trip takes f + b + 2t.
    // So every micro-batch exposes 2t there: (M + PP - 1)(f + b) + 2 M t.
    EXPECT_DOUBLE_EQ(unit.total_time(), (8 + 4 - 1) * (f + b));
    // With PP 2 the first stage runs one backward and one forward (f + b) between its forward of micro-batch
    // m + 1 and its backward of m + 1, while that round trip through the second stage takes f + b + 2t:
    // each pair of micro-batches exposes 2t, t per micro-batch: (M + 1)(f + b) + M t.
    o.pp = 2;
    auto sent = [&] {
        return pipeline::simulate_timeline(o, [&](int, size_t, const pipeline::ScheduleOp & op) { return op.forward ? f : b; }, t);
    };
    EXPECT_DOUBLE_EQ(sent().total_time(), (8 + 1) * (f + b) + 8 * t);
    // Deeper pipelines expose at least the fill and the drain, 2 (PP - 1) t, at most every micro-batch's
    // round trip, 2 M t.
    o.pp               = 4;
    const double extra = sent().total_time() - unit.total_time();
    EXPECT_GE(extra, 2 * (4 - 1) * t);
    EXPECT_LE(extra, 2 * 8 * t);
    // A slower last stage holds everyone: its 8 forwards and backwards plus the others' share of one.
    const pipeline::Timeline slow = pipeline::simulate_timeline(o, [&](int rank, size_t, const pipeline::ScheduleOp & op) {
        return (op.forward ? f : b) * (rank == 3 ? 2.0 : 1.0);
    });
    EXPECT_DOUBLE_EQ(slow.total_time(), 3 * f + 8 * 2 * (f + b) + 3 * b);
}

TEST(StepPlan, TheGemmsAndAttentionTheMetaDeviceTimesAreMegatronsFlops) {
    // One rank: the FLOPs counted from the real op calls equal Megatron's formula, to the causal mask's
    // diagonal (the kernels keep s (s + 1) / 2 pairs of a sequence, the formula s^2 / 2).
    const plan::CostModel costs = h100();
    for (const std::vector<std::string> & flags :
         {std::vector<std::string>{"--global-batch-size", "4"},
          std::vector<std::string>{"--global-batch-size", "4", "--swiglu", "--group-query-attention", "--num-query-groups", "2",
                                   "--position-embedding-type", "rope", "--normalization", "RMSNorm", "--disable-bias-linear"},
          std::vector<std::string>{"--global-batch-size", "4", "--recompute-granularity", "full", "--recompute-method",
                                   "uniform", "--recompute-num-layers", "1"}}) {
        std::string joined;
        for (const std::string & f : flags) joined += f + " ";
        SCOPED_TRACE(joined);
        const train::TrainOptions options = parse_plan(flags, 1);
        const plan::StepPlan      step    = plan::plan_step(options, 1, costs);
        const double              counted = tensor_core_flops(*step.stages[0].time);
        EXPECT_NEAR(counted / step.model_flops, 1.0, 0.001);
        EXPECT_GT(counted, step.model_flops);   // the diagonal
    }
    // TP 2 and PP 2 split them: the stages' FLOPs times the tensor-parallel size are the model's.
    const train::TrainOptions options = parse_plan({"--global-batch-size", "8", "--tensor-model-parallel-size", "2",
                                                    "--sequence-parallel", "--pipeline-model-parallel-size", "2"}, 4);
    const plan::StepPlan      step    = plan::plan_step(options, 4, costs);
    ASSERT_EQ(step.stages.size(), 2u);
    EXPECT_EQ(step.stages[1].rank, 2);   // rank 0's pipeline group: tp 2 ranks apart
    const double counted = 2 * (tensor_core_flops(*step.stages[0].time) + tensor_core_flops(*step.stages[1].time));
    EXPECT_NEAR(counted / step.model_flops, 1.0, 0.001);
}

TEST(StepPlan, ThePipelineBubbleIsTheSchedulesAndTheNetworkIsSlowerThanNvlink) {
    const plan::CostModel costs = h100();
    // PP 4 with 8 micro-batches: 1F1B idles (PP - 1) / (M + PP - 1) of the time, near enough with the first
    // stage's embedding and the last one's loss.
    const train::TrainOptions pp4 = parse_plan({"--num-layers", "8", "--hidden-size", "1024", "--vocab-size", "1000",
                                                "--global-batch-size", "16", "--pipeline-model-parallel-size", "4"}, 4);
    const plan::StepPlan piped = plan::plan_step(pp4, 4, costs);
    EXPECT_NEAR(piped.timeline.bubble_fraction(), 3.0 / 11.0, 0.05);
    EXPECT_GT(piped.step_s, 0.0);
    EXPECT_LT(piped.mfu, costs.efficiency().gemm);
    // The same TP 2 layout with both ranks in one node, then on two nodes.
    const train::TrainOptions tp2 = parse_plan({"--global-batch-size", "4", "--tensor-model-parallel-size", "2",
                                                "--sequence-parallel"}, 2);
    const plan::CostModel     one_node(plan::gpu_spec("h100-80gb"), 2, DType::bf16);
    const plan::CostModel     two_nodes(plan::gpu_spec("h100-80gb"), 1, DType::bf16);
    const plan::StepPlan      near = plan::plan_step(tp2, 2, one_node);
    const plan::StepPlan      far  = plan::plan_step(tp2, 2, two_nodes);
    const auto &              near_ops = near.stages[0].time->totals;
    const auto &              far_ops  = far.stages[0].time->totals;
    ASSERT_TRUE(near_ops.count("all_gather") && near_ops.count("reduce_scatter"));
    EXPECT_EQ(near_ops.at("all_gather").bytes, far_ops.at("all_gather").bytes);
    // The network's 42.5 GB/s against NVLink's 360: the same bytes, eight times the time less the ring's
    // per-step latency, which weighs on these small (bf16) gathers.
    EXPECT_GT(far_ops.at("all_gather").seconds, 3 * near_ops.at("all_gather").seconds);
    EXPECT_GT(far.step_s, near.step_s);
}

TEST(StepPlan, MoeLayersArePlannedWithBalancedRouting) {
    // The meta device routes round-robin: every expert gets k/E of the tokens, so the experts' GEMMs the
    // plan counts are Megatron's top-k count, on one rank and with the experts split over EP 2 (each rank
    // runs half of them on every rank's tokens). The rest: the router's GEMM (2 h E a token) and the mask's
    // diagonal, under 0.5%.
    const plan::CostModel costs = h100();
    for (const auto & [ep, dispatcher] : {std::pair{1, "allgather"}, std::pair{2, "allgather"}, std::pair{2, "alltoall"}}) {
        const train::TrainOptions options = parse_plan({"--global-batch-size", "8", "--num-experts", "4", "--moe-router-topk", "2",
                                                        "--disable-bias-linear", "--expert-model-parallel-size",
                                                        std::to_string(ep), "--moe-token-dispatcher-type", dispatcher}, ep);
        const plan::StepPlan step = plan::plan_step(options, ep, costs);
        ASSERT_TRUE(step.stages[0].iteration_planned);
        EXPECT_NEAR(ep * tensor_core_flops(*step.stages[0].time) / step.model_flops, 1.0, 0.005) << "ep " << ep << " " << dispatcher;
        // The tokens cross the expert-parallel group by the dispatcher's collective.
        const auto & ops = step.stages[0].time->totals;
        const char * moves = std::string(dispatcher) == "alltoall" ? "all_to_all" : "all_gather";
        if (ep == 2) {
            ASSERT_TRUE(ops.count(moves)) << dispatcher;
            EXPECT_GT(ops.at(moves).bytes, 1e6) << dispatcher;
        }
    }
}

TEST(MetaOps, AttentionCountsTheCausalPairsOfEveryPositionRun) {
    // The closed form over each side's two runs of positions against counting every (query, key) pair:
    // whole sequences, a context-parallel rank's two chunks (its queries and the keys of another rank), and
    // runs that start past each other.
    const plan::CostModel costs = h100();
    plan::MetaDevice      device(&costs);
    const int64_t         b = 2, nq = 4, nkv = 2, d = 8;
    auto pairs = [&](const AttentionShape & shape) {
        double count = 0;
        for (int64_t i = 0; i < shape.s; ++i) {
            for (int64_t j = 0; j < shape.keys(); ++j) count += shape.k_pos(j) <= shape.q_pos(i) ? 1 : 0;
        }
        return count * static_cast<double>(b);
    };
    struct Case {
        int64_t      s, s_kv;
        SeqPositions q, k;
    };
    for (const Case & c : {Case{64, 64, {}, {}},
                           Case{32, 32, {0, 16, 112}, {0, 16, 112}},     // CP 4, rank 0: chunks 0 and 7 of 8
                           Case{32, 32, {48, 16, 64}, {0, 16, 112}},     // rank 3's queries, rank 0's keys
                           Case{32, 32, {0, 16, 112}, {48, 16, 64}},     // rank 0's queries, rank 3's keys
                           Case{17, 40, {100, 5, 7}, {3, 30, 90}}}) {   // uneven runs, in any order
        AttentionShape shape(c.s, b, nq, nkv, d, (nq + 2 * nkv) * d);
        shape.s_kv  = c.s_kv;
        shape.q_pos = c.q;
        shape.k_pos = c.k;
        Tensor q    = Tensor::empty({c.s * b, (nq + 2 * nkv) * d}, DType::bf16, device);
        Tensor kv   = Tensor::empty({c.s_kv * b, (nq + 2 * nkv) * d}, DType::bf16, device);
        Tensor out  = Tensor::empty({c.s * b, nq * d}, DType::f32, device);
        Tensor lse  = Tensor::empty({b, nq, c.s}, DType::f32, device);
        device.clock().totals.clear();
        device.ops().attention_forward(device.compute_stream(), q, kv, out, lse, shape, 1.0f);
        EXPECT_DOUBLE_EQ(device.clock().totals.at("attention_forward").flops, 4.0 * nq * d * pairs(shape))
            << "s " << c.s << ", queries from " << c.q.first << "/" << c.q.second << ", keys from " << c.k.first << "/"
            << c.k.second;
    }
}

TEST(StepPlan, SampledMicroBatchesGiveTheWholePlansStepAndPeaks) {
    // 32 micro-batches through PP 4 (1F1B, and interleaved with 2 chunks): the stages run 8 and the rest are
    // simulated with their durations. The same peaks, to the byte, and the same step.
    const plan::CostModel costs = h100();
    for (const std::vector<std::string> & extra :
         {std::vector<std::string>{}, std::vector<std::string>{"--num-virtual-stages-per-pipeline-rank", "2"}}) {
        std::vector<std::string> flags{"--num-layers", "8", "--global-batch-size", "64", "--pipeline-model-parallel-size", "4"};
        flags.insert(flags.end(), extra.begin(), extra.end());
        const train::TrainOptions options = parse_plan(flags, 4);
        const plan::StepPlan      whole   = plan::plan_step(options, 4, costs);
        const plan::StepPlan      sampled = plan::plan_step(options, 4, costs, /*sampled=*/true);
        ASSERT_EQ(whole.stages.size(), sampled.stages.size());
        for (size_t stage = 0; stage < whole.stages.size(); ++stage) {
            EXPECT_EQ(whole.stages[stage].device_peak_total(), sampled.stages[stage].device_peak_total()) << "stage " << stage;
            EXPECT_EQ(whole.stages[stage].activations_peak, sampled.stages[stage].activations_peak) << "stage " << stage;
        }
        EXPECT_NEAR(sampled.step_s / whole.step_s, 1.0, 1e-9) << extra.size();
        EXPECT_NEAR(sampled.timeline.bubble_fraction(), whole.timeline.bubble_fraction(), 1e-9);
    }
}

TEST(LayoutSearch, RanksTheLayoutsThatFitAndSaysWhyTheOthersDoNot) {
    // A 3.4B Llama-style model on 8 GPUs of 24 GiB: the unsharded families cannot hold its states, some fit
    // only with recompute, and the rest are ranked by their planned step.
    plan::GpuSpec small = plan::gpu_spec("h100-80gb");
    small.memory_bytes  = int64_t{24} << 30;
    const plan::CostModel costs(small, 8, DType::bf16);
    const std::vector<std::string> model{"--mock-data", "--num-layers", "16", "--hidden-size", "4096",
                                         "--num-attention-heads", "32", "--group-query-attention", "--num-query-groups", "8",
                                         "--ffn-hidden-size", "14336", "--swiglu", "--normalization", "RMSNorm",
                                         "--position-embedding-type", "rope", "--disable-bias-linear",
                                         "--untie-embeddings-and-output-weights", "--seq-length", "4096",
                                         "--max-position-embeddings", "4096", "--vocab-size", "32000", "--bf16",
                                         "--global-batch-size", "16"};
    auto options_for = [&](const plan::Layout & layout) {
        std::vector<std::string> flags = model;
        for (const std::string & f : layout.flags()) flags.push_back(f);
        return parse_flags(flags, 8);
    };
    const auto               began  = std::chrono::steady_clock::now();
    const plan::SearchResult result = plan::search_layouts(options_for(plan::Layout{}), 8, costs, options_for);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - began).count();
    ASSERT_FALSE(result.fitting.empty());
    for (size_t i = 0; i < result.fitting.size(); ++i) {
        EXPECT_LE(result.fitting[i].peak_bytes, costs.usable_memory_bytes()) << result.fitting[i].layout.describe(8);
        if (i > 0) EXPECT_LE(result.fitting[i - 1].step_s, result.fitting[i].step_s);
    }
    bool unsharded = false;
    for (const plan::RejectedFamily & r : result.rejected) {
        EXPECT_NE(r.why.find("GiB"), std::string::npos) << r.family << ": " << r.why;
        if (r.family == "TP 1, PP 1, CP 1") {
            unsharded = true;
            EXPECT_NE(r.why.find("alone take"), std::string::npos) << r.why;
        }
    }
    EXPECT_TRUE(unsharded);
    auto recomputes = [](const plan::Candidate & c) { return c.layout.full_recompute; };
    EXPECT_TRUE(std::any_of(result.fitting.begin(), result.fitting.end(), recomputes));
    EXPECT_FALSE(std::all_of(result.fitting.begin(), result.fitting.end(), recomputes));
    // The fastest layout, planned whole (every micro-batch run), gives the search's figures.
    const plan::Candidate & best  = result.fitting.front();
    const plan::StepPlan    whole = plan::plan_step(options_for(best.layout), 8, costs);
    int64_t                 peak  = 0;
    for (const plan::RankMemory & stage : whole.stages) peak = std::max(peak, stage.device_peak_total());
    EXPECT_EQ(peak, best.peak_bytes);
    EXPECT_NEAR(whole.step_s / best.step_s, 1.0, 1e-9);
    std::printf("search: %d layouts planned in %.2f s, %zu fit, best %s at %.3f s\n", result.planned, seconds,
                result.fitting.size(), best.layout.describe(8).c_str(), best.step_s);
}

TEST(LoomPlanCli, TimesTheStepAsJsonAndRefusesWhatItCannotHonour) {
    const std::string model = "--mock-data --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
                              "--max-position-embeddings 512 --micro-batch-size 2 --global-batch-size 8 --vocab-size 8000 --bf16";
    CliRun plan = run_loom("plan " + model + " --gpu h100-80gb --json", "2>/dev/null");
    ASSERT_EQ(plan.status, 0) << plan.out;
    const auto json = nlohmann::json::parse(plan.out);
    EXPECT_GT(json.at("step_seconds").get<double>(), 0.0);
    EXPECT_GT(json.at("mfu").get<double>(), 0.0);
    EXPECT_LT(json.at("mfu").get<double>(), 0.7);
    EXPECT_TRUE(json.at("fits").get<bool>());
    EXPECT_TRUE(json.at("stages").at(0).at("ops").contains("gemm"));
    // A flag the search sets itself, a timing flag without a GPU, a GPU it does not know: refused by name.
    const std::string sizes = "--mock-data --num-layers 4 --hidden-size 256 --num-attention-heads 8 --seq-length 512 "
                              "--max-position-embeddings 512 --global-batch-size 8 --vocab-size 8000 --bf16";
    CliRun chosen = run_loom("plan " + sizes + " --gpu h100-80gb --search --tensor-model-parallel-size 2");
    EXPECT_EQ(chosen.status, 2);
    EXPECT_NE(chosen.out.find("--search chooses --tensor-model-parallel-size"), std::string::npos) << chosen.out;
    CliRun no_gpu = run_loom("plan " + sizes + " --search");
    EXPECT_EQ(no_gpu.status, 2);
    EXPECT_NE(no_gpu.out.find("add --gpu"), std::string::npos) << no_gpu.out;
    CliRun unknown = run_loom("plan " + model + " --gpu v100");
    EXPECT_EQ(unknown.status, 2);
    EXPECT_NE(unknown.out.find("--gpu v100"), std::string::npos) << unknown.out;
    EXPECT_NE(unknown.out.find("or cpu (this machine)"), std::string::npos) << unknown.out;
}

// --gpu cpu: this machine's rates, measured by Loom's kernels, plan a step here. The rates are whatever the
// machine gives (not asserted beyond being rates); the plan built on them times every op of the iteration.
TEST(LoomPlanCli, GpuCpuMeasuresThisMachineAndTimesTheStepOnIt) {
    const plan::CpuCalibration c = plan::calibrate_cpu();
    EXPECT_EQ(c.spec.name, "cpu");
    for (double rate : {c.spec.tensor_16bit_flops, c.spec.tf32_flops, c.spec.hbm_bytes_per_s}) {
        EXPECT_TRUE(std::isfinite(rate) && rate > 0) << rate;
    }
    EXPECT_GT(c.efficiency.attention, 0.0);
    EXPECT_LE(c.efficiency.attention, 1.0);
    EXPECT_GT(c.efficiency.launch_s, 0.0);
    EXPECT_GT(c.spec.memory_bytes, int64_t{1} << 30);
    std::printf("this machine: bf16 GEMM %.1f GFLOP/s, f32 GEMM %.1f GFLOP/s, memory %.1f GB/s, attention at %.2f of "
                "the bf16 GEMM's rate, %.1f us per op; measured in %.3f s\n",
                c.spec.tensor_16bit_flops / 1e9, c.spec.tf32_flops / 1e9, c.spec.hbm_bytes_per_s / 1e9,
                c.efficiency.attention, c.efficiency.launch_s * 1e6, c.seconds);
    CliRun plan = run_loom("plan --mock-data --num-layers 2 --hidden-size 128 --num-attention-heads 4 --seq-length 128 "
                           "--max-position-embeddings 128 --micro-batch-size 2 --vocab-size 512 --gpu cpu --json",
                           "2>/dev/null");
    ASSERT_EQ(plan.status, 0) << plan.out;
    const auto json = nlohmann::json::parse(plan.out);
    EXPECT_EQ(json.at("gpu").get<std::string>(), "cpu");
    EXPECT_GT(json.at("step_seconds").get<double>(), 0.0);
    EXPECT_TRUE(json.at("stages").at(0).at("ops").contains("attention_forward"));
}

TEST(LoomTrainCli, PrintsItsPlanBesideTheAllocatorsFigures) {
    // Streams inline, as a GPU's stream-ordered allocator frees: the held pools equal their plan and the
    // activations' peak is within 3% of it (docs/plan.md).
    CliRun run = run_command("LOOM_SYNC_STREAMS=1 " + std::string(LOOM_CLI_PATH) +
                             " train --mock-data --train-iters 2 --log-interval 1 2>&1");
    ASSERT_EQ(run.status, 0) << run.out;
    for (const char * pool : {"weights", "grads", "optimizer"}) {
        const std::regex line(std::string("  ") + pool + " +peak +[0-9.]+ MiB +in use +([0-9.]+) MiB +planned +([0-9.]+) MiB");
        std::smatch      m;
        ASSERT_TRUE(std::regex_search(run.out, m, line)) << pool << "\n" << run.out;
        EXPECT_EQ(m[1].str(), m[2].str()) << pool;
    }
    std::smatch m;
    ASSERT_TRUE(std::regex_search(run.out, m, std::regex("  activations +peak +([0-9.]+) MiB .* planned peak +([0-9.]+) MiB")))
        << run.out;
    EXPECT_NEAR(std::stod(m[1].str()) / std::stod(m[2].str()), 1.0, 0.03);
    EXPECT_NE(run.out.find("loom plan predicted for this rank"), std::string::npos);
    // On the CPU the plan also times the step on this machine: printed at the start, and at the end beside the
    // measured median (their ratio is a benchmark's business: bench/plan_vs_cpu.sh).
    ASSERT_TRUE(std::regex_search(run.out, m, std::regex("loom plan predicts for rank 0: a step of ([0-9.]+) s on this machine")))
        << run.out;
    const std::string predicted = m[1].str();
    ASSERT_TRUE(std::regex_search(run.out, m, std::regex("step time: measured ([0-9.]+) s .* loom plan predicted ([0-9.]+) s")))
        << run.out;
    EXPECT_GT(std::stod(m[1].str()), 0.0);
    EXPECT_EQ(m[2].str(), predicted);
    EXPECT_GT(std::stod(predicted), 0.0);
}

namespace {

// The width of the bar segment whose title is `title` in a plan picture; -1 when there is none.
double segment_width(const std::string & svg, const std::string & title) {
    const size_t at = svg.find("<title>" + title + "</title>");
    if (at == std::string::npos) return -1;
    const size_t rect  = svg.rfind("<rect", at);
    const size_t width = svg.find("width=\"", rect);
    return std::strtod(svg.c_str() + width + 7, nullptr);
}

plan::RankMemory rank_memory(int rank, int64_t weights_mib, int64_t peak_mib) {
    plan::RankMemory r;
    r.rank              = rank;
    r.device["weights"]   = weights_mib << 20;
    r.device["grads"]     = (2 * weights_mib) << 20;
    r.device["optimizer"] = (3 * weights_mib) << 20;
    r.iteration_planned = true;
    r.iteration_peak    = peak_mib << 20;
    return r;
}

}  // namespace

// `loom plan --svg`: each rank's bar is its pools' bytes and its iteration's peak, every rank on one scale; the usable
// memory is a line where it is near the peaks and only named where it is far above them; the timeline follows.
TEST(PlanSvg, BarsAreThePoolsBytesOnOneScaleAndTheTimelineFollows) {
    const std::vector<plan::RankMemory> ranks = {rank_memory(0, 100, 400), rank_memory(3, 50, 200)};   // 1000, 500 MiB
    const std::string svg = plan::plan_svg(ranks, int64_t{1100} << 20, nullptr);
    const double w0 = segment_width(svg, "rank 0 weights 100.0 MiB"), g0 = segment_width(svg, "rank 0 grads 200.0 MiB");
    const double o0 = segment_width(svg, "rank 0 optimizer 300.0 MiB"), p0 = segment_width(svg, "rank 0 iteration peak 400.0 MiB");
    const double w3 = segment_width(svg, "rank 3 weights 50.0 MiB");
    ASSERT_GT(w0, 0);
    EXPECT_NEAR(g0 / w0, 2.0, 0.01);
    EXPECT_NEAR(o0 / w0, 3.0, 0.01);
    EXPECT_NEAR(p0 / w0, 4.0, 0.01);
    EXPECT_NEAR(w3 / w0, 0.5, 0.01);   // one scale for every rank
    // The scale runs to the usable 1100 MiB (near the 1000 MiB peak): 900 px, rank 0's 1000 MiB at 818 of them.
    EXPECT_NEAR(w0 + g0 + o0 + p0, 900.0 * 1000 / 1100, 0.05);
    EXPECT_NE(svg.find("stroke-dasharray"), std::string::npos);
    EXPECT_NE(svg.find("usable memory, 1100.0 MiB"), std::string::npos);

    const std::string far = plan::plan_svg(ranks, int64_t{80} << 30, nullptr);   // 80 GiB: the bars would be slivers
    EXPECT_EQ(far.find("stroke-dasharray"), std::string::npos);
    EXPECT_NE(far.find("81920.0 MiB, is off the scale"), std::string::npos);
    EXPECT_NEAR(segment_width(far, "rank 0 weights 100.0 MiB"), 90.0, 0.05);   // the largest peak is the scale

    pipeline::ScheduleOptions o;
    o.pp               = 2;
    o.num_microbatches = 4;
    const pipeline::Timeline timeline = pipeline::simulate_timeline(o);
    const std::string        with     = plan::plan_svg(ranks, 0, &timeline);
    const size_t      nested = with.find("<svg x=\"0\" y=\"");
    ASSERT_NE(nested, std::string::npos);
    EXPECT_NE(with.find("Pipeline schedule", nested), std::string::npos);
    EXPECT_GT(std::strtod(with.c_str() + with.find("height=\"") + 8, nullptr),
              std::strtod(svg.c_str() + svg.find("height=\"") + 8, nullptr) + 100);
}
