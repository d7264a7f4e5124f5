// Per-layer graphs in training (--cuda-graph-impl transformer_engine, graphs/layer_graph_runner.h), under
// mpirun with 4 ranks and the stream-delay seam on: after 3 eager iterations every transformer layer's
// forward and backward is captured per micro-batch and replayed, and 7 iterations must be BITWISE the
// eager run of the same layout (losses and every final weight): a replay runs the very kernels on the very
// values, so any difference is a bug (a stale input, a buffer reused too early, a collective replayed out
// of order). Layouts: PP 1 (DP 4), PP 2 x DP 2, PP 4, PP 2 x VPP 2, DP 2 with ZeRO-1 and
// --overlap-param-gather, TP 2 + SP, CP 2 x PP 2 (p2p) and CP 2 x DP 2 (a2a), --bf16, uneven stages,
// --optimizer-cpu-offload. The full-iteration graph (--cuda-graph-impl full_iteration) the same way: DP 4
// with ZeRO-1 and both overlaps, TP 2 + SP x DP 2 in bf16, CP 2 (a2a) x DP 2 with full recompute, and the
// optimizer offloaded.
//
// Memory, from the allocator's statistics of the "graphs" pool: its peak is the same for M = 8 and M = 16
// (the static input sets and the live saved activations depend on the pipeline depth, not on M); the
// difference between the first and the last stage's peaks is (P_0 - P_1) L (one layer's saved bytes);
// and replaying allocates nothing in the pool.
#include "backend/cpu/cpu_device.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include "mpi_test_main.h"
#include "small_gpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <cstdio>
#include <cstring>
#include <map>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

struct Layout {
    int  tp = 1, pp = 1, vpp = 1;
    int  cp = 1;   // context parallelism, cp_comm's exchange inside the captured layers
    model::CpCommType cp_comm = model::CpCommType::p2p;
    bool sp = false, distopt = false, bf16 = false, offload = false;
    bool moe = false;   // 4 experts, top-2, drop-and-pad (capacity 1): whole MoE layers in the graphs
    // Dropless MoE layers captured up to the router (--cuda-graph-modules attn moe_router), with the
    // dispatch plan too (moe_preprocess).
    bool moe_router = false, moe_preprocess = false;
    bool mixed      = false;   // with moe_router: layer 0 dense, captured whole (attn mlp moe_router)
    bool global_aux = false;   // global_aux_loss: the counts' running mean over the micro-batches, on the stream
    bool moe_layers = false;   // dropless MoE layers (4 experts, top-2) whatever the scope
    bool attn       = false;   // dense layers captured up to norm2 (--cuda-graph-modules attn), the MLP eager
    int  ep         = 1;       // expert parallelism (with moe_router), alltoall dispatcher
    int  etp        = 0;       // expert tensor parallelism (0: tp, Megatron's default; > 1 needs no biases)
    int  first_stage_layers = 0;
    int  global_batch       = 8;
    bool full_iteration     = false;   // --cuda-graph-impl full_iteration: the whole iteration, one graph
    bool recompute          = false;   // full recompute (uniform, 1 layer)
    // DeepSeek Sparse Attention on MLA layers: each row's top half of the keys, the sparse loss, every other layer
    // taking the one before's selection
    bool dsa                = false;
};

struct TrainRun {
    std::vector<double>                       losses;
    std::map<std::string, std::vector<float>> params;
    AllocatorStats                            pool;            // "graphs", over the whole run
    int64_t                                   pool_allocs_after_capture = -1;   // at the end of the run
    int64_t                                   pool_allocs_at_capture    = -1;
    int                                       stage = 0, layers = 0, peak_in_flight = 0, graphs = 0;
    int64_t                                   replays = 0, microbatches = 0;
    int                                       input_sets = 0;
    size_t                                    collective_nodes = 0, all_to_all_nodes = 0;
    std::vector<double>                       balancing;   // the first tracked loss per iteration (MoE's, DSA's)
    int64_t                                   saved_bytes = 0;   // one layer forward's, after its capture
    double                                    seconds     = 0;
};

// Each layout trains 7 iterations: 3 eager, then 4 that replay every layer's graphs (each graph replayed on
// buffers its earlier replays used too). A replay that reads a stale input or a reused buffer differs at its
// first iteration, bitwise.
constexpr int kIterations = 7, kWarmup = 3;

TrainRun train_layout(const Layout & layout, bool graphed, int iterations = kIterations) {
    parallel::ParallelSizes sizes;
    sizes.world_size = g_mpi->world_size();
    sizes.tp         = layout.tp;
    sizes.pp         = layout.pp;
    sizes.cp         = layout.cp;
    sizes.ep         = layout.ep;
    if (layout.etp > 0) sizes.etp = layout.etp;
    if (layout.vpp > 1) sizes.vpp = layout.vpp;
    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);
    parallel::ProcessGroups  groups = parallel::ProcessGroups::create(config, *g_mpi);

    train::TrainOptions o = testing_models::small_gpt_options(4, layout.global_batch, iterations);
    o.parallel                      = config;
    o.cp_comm_types                 = {layout.cp_comm};
    o.sequence_parallel             = layout.sp;
    if (layout.first_stage_layers > 0) o.first_stage_layers = layout.first_stage_layers;
    o.ddp.use_distributed_optimizer = layout.distopt || layout.offload;
    o.ddp.overlap_grad_reduce       = layout.distopt;
    o.ddp.overlap_param_gather      = layout.distopt;
    o.ddp.bucket_size               = 20000;
    o.bf16                          = layout.bf16;
    o.optimizer_cpu_offload         = layout.offload;
    if (layout.offload) o.offload.offload_fraction = 0.5;
    if (layout.moe || layout.moe_router || layout.moe_layers) {
        o.model.moe.num_experts    = 4;
        o.model.moe.topk           = 2;
        o.model.moe.aux_loss_coeff = 1e-2f;
        o.model.moe.z_loss_coeff   = 1e-3f;
    }
    if (layout.mixed) o.model.moe.layer_pattern = {0, 1, 1, 1};
    if (layout.global_aux) o.model.moe.load_balancing = model::MoeLoadBalancing::global_aux_loss;
    if (layout.moe) {
        o.model.moe.capacity_factor = 1.0f;
        o.model.moe.pad_to_capacity = true;
    }
    if (config.etp() > 1 && (layout.moe || layout.moe_router || layout.moe_layers)) o.model.add_bias_linear = false;
    if (layout.ep > 1) o.model.moe.dispatcher = model::MoeDispatcher::alltoall;
    o.graph_moe_router     = layout.moe_router;
    o.graph_moe_preprocess = layout.moe_preprocess;
    o.graph_attn           = layout.attn;
    o.layer_graphs            = graphed && !layout.full_iteration;
    o.full_iteration_graph    = graphed && layout.full_iteration;
    o.cuda_graph_warmup_steps = kWarmup;
    if (layout.dsa) {
        testing_models::use_multi_latent_attention(o);
        testing_models::use_sparse_attention(o);
        o.model.add_bias_linear   = false;
        o.model.attention_dropout = 0.0f;
    }
    if (layout.recompute) {
        o.model.recompute_granularity = model::RecomputeGranularity::full;
        o.model.recompute_method      = model::RecomputeMethod::uniform;
        o.model.recompute_num_layers  = 1;
    }

    Allocator & allocator = cpu::device().allocator();
    auto source = train::context_parallel_part(
        train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), config.dp()), groups.cp->rank(), layout.cp);
    train::Setup setup    = train::setup(o, groups, cpu::device());
    TrainRun          run;
    run.stage = groups.pp->rank();
    allocator.reset_peak();
    {
        train::Trainer trainer(o, setup, *source);
        train::IterationStats stats;
        const auto begin = std::chrono::steady_clock::now();
        for (int i = 0; i < iterations; ++i) {
            run.losses.push_back(trainer.step(stats));
            if (!stats.tracked_losses.empty()) run.balancing.push_back(stats.tracked_losses[0].second);
            if (const graphs::LayerGraphRunner * runner = trainer.layer_graphs();
                runner != nullptr && run.pool_allocs_at_capture < 0) {
                run.pool_allocs_at_capture = allocator.pool_stats(kGraphPool).num_allocs;
                run.layers                 = runner->plan().total_layers();
                run.peak_in_flight         = runner->plan().peak_in_flight;
                run.graphs                 = static_cast<int>(runner->num_graphs());
                run.input_sets             = runner->plan().num_input_sets();
                run.collective_nodes       = runner->num_collective_nodes();
                run.all_to_all_nodes       = runner->num_collective_nodes("all_to_all");
                run.saved_bytes            = runner->saved_bytes_per_layer();
            }
            if (const graphs::FullIterationGraph * full = trainer.full_iteration_graph();
                full != nullptr && full->captured() && run.pool_allocs_at_capture < 0) {
                run.pool_allocs_at_capture = allocator.pool_stats(kGraphPool).num_allocs;
                run.graphs                 = 1;
                run.collective_nodes       = full->graph().num_replayable_nodes();
            }
        }
        cpu::device().compute_stream().synchronize();
        run.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - begin).count();
        run.pool_allocs_after_capture = allocator.pool_stats(kGraphPool).num_allocs;
        run.pool                      = allocator.pool_stats(kGraphPool);
        if (trainer.layer_graphs()) run.replays = trainer.layer_graphs()->num_replays();
        if (trainer.full_iteration_graph()) run.replays = trainer.full_iteration_graph()->num_replays();
        run.microbatches = o.num_microbatches();
    }
    for (model::Parameter * p : setup.parameters()) run.params[p->name] = testing_models::parameter_values(*p);
    return run;
}

std::string describe(const Layout & l) {
    char text[200];
    std::snprintf(text, sizeof text, "%stp %d%s cp %d%s pp %d vpp %d ep %d etp %d%s%s%s%s%s%s%s%s%s",
                  l.full_iteration ? "full iteration: " : "", l.tp, l.sp ? "+sp" : "", l.cp,
                  l.cp == 1 ? "" : l.cp_comm == model::CpCommType::a2a ? " a2a" : l.cp_comm == model::CpCommType::allgather ? " allgather" : " p2p",
                  l.pp, l.vpp, l.ep, l.etp > 0 ? l.etp : l.tp,
                  l.distopt ? " zero-1+overlaps" : "", l.bf16 ? " bf16" : "", l.offload ? " cpu-offload 0.5" : "",
                  l.first_stage_layers ? " uneven" : "", l.moe ? " moe drop-and-pad" : "",
                  l.moe_preprocess ? " dropless moe, graphs to the dispatch plan" : l.moe_router ? " dropless moe, graphs to the router" : "",
                  l.attn ? (l.moe_layers ? " graphs to norm2, the mlp and moe layers eager" : " graphs to norm2, the mlp eager")
                         : l.mixed ? ", layer 0 dense and whole, global aux loss" : "",
                  l.recompute ? " full recompute" : "", l.dsa ? " dsa" : "");
    return text;
}

void expect_bitwise(const Layout & layout) {
    SCOPED_TRACE(describe(layout));
    const TrainRun eager = train_layout(layout, false);
    const TrainRun graph = train_layout(layout, true);
    ASSERT_EQ(graph.losses.size(), eager.losses.size());
    for (size_t i = 0; i < eager.losses.size(); ++i) {
        EXPECT_EQ(graph.losses[i], eager.losses[i]) << "iteration " << i + 1 << " (graphs replay from iteration " << kWarmup + 1 << ")";
    }
    size_t differing = 0;
    for (const auto & [name, values] : eager.params) {
        const std::vector<float> & other = graph.params.at(name);
        ASSERT_EQ(other.size(), values.size()) << name;
        if (std::memcmp(other.data(), values.data(), values.size() * sizeof(float)) != 0) {
            ++differing;
            ADD_FAILURE() << name << " differs from the eager run";
        }
    }
    EXPECT_EQ(differing, 0u);
    EXPECT_EQ(graph.balancing, eager.balancing) << "the MoE router's load-balancing loss (DSA's indexer loss), iteration by iteration";
    if (layout.dsa) {
        EXPECT_EQ(eager.balancing.size(), eager.losses.size()) << "the indexer loss is logged every iteration";
        EXPECT_LT(eager.balancing.back(), eager.balancing.front()) << "the indexer learns";
    }
    if (layout.moe_router) {
        // The routing differs between iterations (the balancing loss moves), so a dispatch replayed from the
        // capture would have diverged; and the router's graphs hold no all-to-all (and without tensor
        // parallelism no communication at all).
        EXPECT_NE(std::adjacent_find(eager.balancing.begin(), eager.balancing.end(), std::not_equal_to<>()), eager.balancing.end());
        EXPECT_EQ(graph.all_to_all_nodes, 0u);
        // global_aux_loss sums the counts over the data-parallel ranks too, in the router's graphs.
        const bool summed_over_dp = layout.global_aux && g_mpi->world_size() / layout.pp > 1;
        if (layout.tp == 1 && !summed_over_dp) {
            EXPECT_EQ(graph.collective_nodes, 0u);
        }
        if (summed_over_dp) EXPECT_GT(graph.collective_nodes, 0u);
    }
    if (layout.tp > 1) {
        EXPECT_GT(graph.collective_nodes, 0u) << "tensor parallelism's collectives are in the graphs";
    }
    EXPECT_GT(graph.graphs, 0) << "graphs were captured";
    if (layout.full_iteration) {
        EXPECT_EQ(graph.replays, kIterations - kWarmup) << "every iteration after the warm-up replayed the graph";
    } else {
        EXPECT_EQ(graph.replays, (kIterations - kWarmup) * 2 * graph.microbatches * graph.layers)
            << "every layer call of the iterations after the warm-up replayed a graph";
    }
    EXPECT_EQ(graph.pool_allocs_after_capture, graph.pool_allocs_at_capture)
        << "replays allocate nothing in the graph pool";
    if (g_mpi->world_rank() == 0) {
        std::printf("[%s] %d iterations bitwise; %d graphs on rank 0; eager %.2f s, graphed %.2f s\n",
                    describe(layout).c_str(), kIterations, graph.graphs, eager.seconds, graph.seconds);
    }
}

}  // namespace

TEST(LayerGraphs, PipelineOneDataParallelFourIsBitwiseTheEagerRun) { expect_bitwise(Layout{}); }
TEST(LayerGraphs, PipelineTwoTimesDataParallelTwoIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2}); }
TEST(LayerGraphs, PipelineFourIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 4}); }
TEST(LayerGraphs, InterleavedPipelineIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .vpp = 2}); }
TEST(LayerGraphs, ZeroOneWithBothOverlapsIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .distopt = true}); }
TEST(LayerGraphs, TensorParallelWithSequenceParallelIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.tp = 2, .pp = 2, .sp = true});
}
// Context parallelism: the ring's all-to-alls (p2p) and the head exchange's (a2a) inside the captured layers.
TEST(LayerGraphs, ContextParallelIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.pp = 2, .cp = 2});
    expect_bitwise(Layout{.cp = 2, .cp_comm = model::CpCommType::a2a});
}
TEST(LayerGraphs, Bf16IsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .bf16 = true}); }
TEST(LayerGraphs, UnevenStagesAreBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .first_stage_layers = 1}); }
TEST(LayerGraphs, OptimizerCpuOffloadIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .offload = true}); }
TEST(LayerGraphs, DropAndPadMoeLayersAreBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .moe = true}); }
TEST(LayerGraphs, DroplessMoeCapturedToTheRouterIsBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .moe_router = true}); }
TEST(LayerGraphs, DroplessMoeCapturedToTheDispatchPlanIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.pp = 2, .moe_router = true, .moe_preprocess = true});
}
TEST(LayerGraphs, MoeCapturedToTheRouterWithOneStageIsBitwiseTheEagerRun) { expect_bitwise(Layout{.moe_router = true}); }
// Megatron's scoped graphs of a model whose first layer is dense (--cuda-graph-modules attn mlp moe_router
// moe_preprocess): that layer captured whole, the MoE layers up to the dispatch plan, over two stages; with
// global_aux_loss, whose running mean over the micro-batches counts them on the stream, in the router's graphs.
TEST(LayerGraphs, DenseLayersWholeBesideMoeLayersCapturedToTheRouterAreBitwiseTheEagerRun) {
    expect_bitwise(Layout{.pp = 2, .moe_router = true, .moe_preprocess = true, .mixed = true, .global_aux = true});
}
// Dense layers captured up to norm2 (--cuda-graph-modules attn) under TP 2 + SP and PP 2: the heads' graphs
// hold the attention's collectives, the MLP runs eagerly with its own between the replays.
TEST(LayerGraphs, DenseLayersCapturedToTheMlpAreBitwiseTheEagerRun) {
    const Layout attn{.tp = 2, .pp = 2, .sp = true, .attn = true};
    expect_bitwise(attn);
    // The MLPs are outside the graphs: their collectives and saved activations are not in them.
    Layout whole = attn;
    whole.attn   = false;
    const TrainRun split = train_layout(attn, true), full = train_layout(whole, true);
    EXPECT_LT(split.collective_nodes, full.collective_nodes);
    EXPECT_GT(split.collective_nodes, 0u) << "the attention's are";
    EXPECT_LT(split.saved_bytes, full.saved_bytes);
}
// --cuda-graph-modules attn on a model with dense and dropless MoE layers (Megatron's attn_cudagraph test):
// every layer captured up to norm2, the MLP and the whole MoE layer (router, dispatch, experts) eager, under
// EP 2 with the all-to-all dispatcher.
TEST(LayerGraphs, AttentionCapturedBeforeMlpAndMoeLayersIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.mixed = true, .global_aux = true, .moe_layers = true, .attn = true, .ep = 2});
}

// Expert parallelism: the all-to-all dispatch runs eagerly between the router's graphs, which hold none.
TEST(LayerGraphs, ExpertParallelMoeCapturedToTheDispatchPlanIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.pp = 2, .moe_router = true, .moe_preprocess = true, .ep = 2});
}
// MoE parallel folding: TP 2 + SP x DP 2 with the experts ETP 2 x EP 2. The router's graphs hold the
// sequence-parallel collectives (and the sum of the aux loss's counts over TP), not the dispatch.
TEST(LayerGraphs, ExpertTensorParallelMoeWithSequenceParallelCapturedToTheRouterIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.tp = 2, .sp = true, .moe_router = true, .moe_preprocess = true, .ep = 2, .etp = 2});
}

// PP 2 x DP 2: M = 8 and 16 per data-parallel rank (global batch 16 and 32); the pool's peak must not grow
// with M, and the first stage (P_0 = 2 micro-batches in flight) must hold exactly L more layer contexts
// at its peak than the last (P_1 = 1).
// --cuda-graph-impl full_iteration (graphs/full_iteration_graph.h): one graph of the whole forward-backward,
// DDP's reductions reported after each replay, the collectives of TP, SP and CP replayed inside it.
TEST(FullIterationGraph, DataParallelFourWithZeroOneAndBothOverlapsIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.distopt = true, .full_iteration = true});
}
TEST(FullIterationGraph, TensorParallelWithSequenceParallelTimesDataParallelIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.tp = 2, .sp = true, .bf16 = true, .full_iteration = true});
}
TEST(FullIterationGraph, ContextParallelWithFullRecomputeIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.cp = 2, .cp_comm = model::CpCommType::a2a, .full_iteration = true, .recompute = true});
}
TEST(FullIterationGraph, OptimizerCpuOffloadIsBitwiseTheEagerRun) {
    expect_bitwise(Layout{.offload = true, .full_iteration = true});
}

// DSA's layers captured whole: the indexer's scores, its selection (a layer between indexers reading the one before's,
// from that layer's graph), the masked attention and the indexer's loss, added to the layer's accumulator on the stream;
// PP 2 x DP 2, and the full iteration on DP 4.
TEST(LayerGraphs, DsaLayersAreBitwiseTheEagerRun) { expect_bitwise(Layout{.pp = 2, .dsa = true}); }
TEST(FullIterationGraph, DsaIsBitwiseTheEagerRun) { expect_bitwise(Layout{.full_iteration = true, .dsa = true}); }

TEST(LayerGraphs, GraphPoolPeakIsSetByThePipelineDepthNotTheMicroBatches) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 4 ranks";
    const TrainRun m8 = train_layout(Layout{.pp = 2, .global_batch = 16}, true, 5);   // M = 8
    const TrainRun m16 = train_layout(Layout{.pp = 2, .global_batch = 32}, true, 5);   // M = 16
    EXPECT_EQ(m16.graphs, 2 * m8.graphs) << "Mc = M graphs per layer and direction";
    EXPECT_EQ(m8.pool.peak_allocated, m16.pool.peak_allocated) << "stage " << m8.stage;
    EXPECT_EQ(m8.input_sets, m16.input_sets) << "static input sets: L P_r, whatever M";
    EXPECT_EQ(m8.input_sets, m8.layers * (2 - m8.stage));
    EXPECT_EQ(m8.peak_in_flight, 2 - m8.stage);
    // Every rank's peak, saved bytes and layers, gathered.
    Tensor    all  = Tensor::zeros({4, 3}, DType::i64, cpu::device());
    int64_t * mine = all.data<int64_t>() + 3 * g_mpi->world_rank();
    mine[0] = m8.pool.peak_allocated;
    mine[1] = m8.saved_bytes;
    mine[2] = m8.layers;
    g_mpi->world()->all_reduce(all, comm::ReduceOp::sum)->wait();
    const int64_t * r = all.data<int64_t>();
    // World ranks 0, 1 hold stage 0 and 2, 3 stage 1 (tp-cp-ep-dp-pp order): rank 0 against rank 2.
    ASSERT_EQ(r[1], r[3 * 2 + 1]) << "every layer saves the same bytes";
    EXPECT_EQ(r[0] - r[3 * 2], (2 - 1) * r[2] * r[1]) << "(P_0 - P_1) L (one layer's saved bytes)";
    if (g_mpi->world_rank() == 0) {
        std::printf("graph pool peak: stage 0 %lld B (M 8 and 16: %lld, %lld), stage 1 %lld B; one layer saves %lld B; "
                    "%d graphs (M 8), %d (M 16)\n",
                    static_cast<long long>(r[0]), static_cast<long long>(m8.pool.peak_allocated),
                    static_cast<long long>(m16.pool.peak_allocated), static_cast<long long>(r[6]),
                    static_cast<long long>(r[1]), m8.graphs, m16.graphs);
    }
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
