// Expert parallelism end to end, under mpirun with 2 and 4 ranks: the small GPT with 4 experts per layer
// (top-2, an aux loss) trains with its experts spread over an EP group and must follow the single-rank run
// that every rank computes first: EP 2 (world 2: dp 2, ep 2, edp 1) with both dispatchers, EP 2 x PP 2
// (world 4), EP 2 with ZeRO-1 and both overlaps (world 4: dp 4, ep 2, edp 2), DP 2 with EP 1, and MoE
// parallel folding on 4 ranks: dense TP 2 + SP x DP 2 with the experts ETP 2 x EP 2 (both dispatchers) or
// ETP 1 x EP 2 x EDP 2. Every run also checks its DDP buffers against `loom layout`'s for the same
// parameters, and its logged load_balancing_loss against the single-rank run's. A layer-
// level test counts the exchanges through a CountingCommunicator and compares one layer's output and input
// gradient with the single-rank layer's on the same tokens, with and without capacity dropping.
//
// Tolerance. Expert parallelism changes no formula: each token's output is the same sum of its k experts'
// outputs, weighted by the same probabilities. What moves is the order of float sums: the experts' weight
// gradients add the rows of two ranks' tokens in another order, and the norm adds the dense and the
// expert parts apart. Over 20 iterations losses and weights agree within 5e-5.
#include "backend/cpu/cpu_device.h"
#include "comm/counting_communicator.h"
#include "ddp/ddp.h"
#include "ddp/layout.h"
#include "model/moe/moe_layer.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "train/checkpointing.h"
#include "train/data_source.h"
#include "train/setup.h"
#include "train/trainer.h"

#include "mpi_test_main.h"
#include "small_gpt.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <map>
#include <memory>
#include <random>
#include <tuple>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

train::TrainOptions moe_options(model::MoeDispatcher dispatcher = model::MoeDispatcher::allgather, bool grouped = false,
                                bool bias = true, bool sinkhorn = false, bool expert_bias = false) {
    train::TrainOptions o   = testing_models::small_gpt_options(2, 8, 20);
    o.model.add_bias_linear = bias;
    model::MoeConfig &  moe = o.model.moe;
    moe.num_experts         = 4;
    moe.topk                = 2;
    moe.aux_loss_coeff      = 0.01f;
    moe.dispatcher          = dispatcher;
    moe.grouped_gemm        = grouped;
    if (sinkhorn) {   // Megatron's functional tests route top-1 by sinkhorn, without an aux loss
        moe.load_balancing = model::MoeLoadBalancing::sinkhorn;
        moe.topk           = 1;
        moe.aux_loss_coeff = 0.0f;
    }
    if (expert_bias) {   // DeepSeek-V3's router: sigmoid scores, aux-loss-free bias, group-limited routing
        moe.score_function   = model::MoeScoreFunction::sigmoid;
        moe.expert_bias      = true;
        moe.bias_update_rate = 1e-2f;
        moe.num_groups       = 2;
        moe.group_topk       = 1;
        // Beside a shared expert with Qwen3-Next's gate: its weight whole on every TP rank, fed the rank's rows
        // (sequence parallelism), its gradient summed over TP.
        moe.shared_expert_intermediate_size = 8;
        moe.shared_expert_gate              = true;
        // Each update moves a bias by +-rate (0 only where the loads are exactly even): after an odd number of
        // them none is 0 (the two groups' loads swap places nearly every iteration, so after an even number
        // most are).
        o.train_iters    = 19;
        o.lr_decay_iters = 19;
    }
    o.clip_grad             = 1.0f;
    o.log_interval          = 1;   // every iteration's grad norm in the --log-file
    return o;
}

// The value `key` of every iteration of a --log-file.
std::vector<double> logged(const std::string & path, const char * key) {
    std::ifstream       in(path);
    std::vector<double> values;
    for (std::string line; std::getline(in, line);) {
        nlohmann::json j = nlohmann::json::parse(line);
        if (j.contains(key)) values.push_back(j[key].get<double>());
    }
    return values;
}

std::vector<double> grad_norms(const std::string & path) { return logged(path, "grad norm"); }

std::string log_path(const std::string & what) {
    return ::testing::TempDir() + "loom_moe_mpi_" + what + "_" + std::to_string(g_mpi->world_size()) + "_" +
           std::to_string(g_mpi->world_rank()) + ".jsonl";
}

struct Layout {
    int  ep = 1, pp = 1;
    bool distopt = false;
    model::MoeDispatcher dispatcher = model::MoeDispatcher::allgather;
    bool grouped = false;
    bool offload = false;   // --optimizer-cpu-offload, half the optimizer state on the host
    int  tp = 1, etp = 1;   // --tensor-model-parallel-size (with --sequence-parallel), --expert-tensor-parallel-size
    bool bias = true;       // --add-bias-linear (ETP > 1 needs --disable-bias-linear)
    bool sinkhorn = false;  // --moe-router-load-balancing-type sinkhorn --moe-router-topk 1
    bool expert_bias = false;   // sigmoid, --moe-router-enable-expert-bias, 2 groups (group top-1)
};

std::string describe(const Layout & l) {
    return "world " + std::to_string(g_mpi->world_size()) + " ep " + std::to_string(l.ep) + " pp " + std::to_string(l.pp) +
           (l.dispatcher == model::MoeDispatcher::alltoall ? " alltoall" : " allgather") + (l.grouped ? " grouped" : "") +
           (l.distopt ? " zero-1 + overlaps" : "") + (l.offload ? " cpu-offload 0.5" : "") +
           (l.tp > 1 ? " tp " + std::to_string(l.tp) + " + sp" : "") + (l.etp > 1 ? " etp " + std::to_string(l.etp) : "") + (l.bias ? "" : " no bias") +
           (l.sinkhorn ? " sinkhorn top-1" : "") + (l.expert_bias ? " expert bias + groups" : "");
}

struct Reference {
    testing_models::SingleRankRun run;
    std::vector<double>           grad_norms, balancing;   // balancing: the logged load_balancing_loss
};

const Reference & reference(bool grouped, bool bias, bool sinkhorn, bool expert_bias) {
    // The dispatcher does not matter on one rank: both permute the same tokens.
    static std::map<std::tuple<bool, bool, bool, bool>, Reference> runs;
    auto it = runs.find({grouped, bias, sinkhorn, expert_bias});
    if (it == runs.end()) {
        train::TrainOptions o = moe_options(model::MoeDispatcher::allgather, grouped, bias, sinkhorn, expert_bias);
        o.log_file = log_path(std::string(grouped ? "reference_grouped" : "reference") + (bias ? "" : "_no_bias") +
                              (sinkhorn ? "_sinkhorn" : "") + (expert_bias ? "_expert_bias" : ""));
        Reference ref;
        ref.run        = testing_models::train_single_rank(o);
        ref.grad_norms = grad_norms(o.log_file);
        ref.balancing  = logged(o.log_file, "load_balancing_loss");
        it             = runs.emplace(std::tuple{grouped, bias, sinkhorn, expert_bias}, std::move(ref)).first;
    }
    return it->second;
}

// The runtime's DDP layout is the one `loom layout` computes from this rank's parameters written in its
// --params format (entries [name, shape, dtype, {"allreduce": false} for experts]) with the sizes and
// options the run used: the expert buffers apart, reduced and sharded over expert-data-parallel ranks.
void expect_layout_is_loom_layouts(const ddp::DistributedDataParallel & ddp, int64_t dp, int64_t edp, const std::string & path) {
    nlohmann::json params = nlohmann::json::array();
    int64_t        expert_params = 0;
    for (const ddp::ParamSpec & p : ddp.specs()) {
        nlohmann::json entry = {p.name, p.shape, dtype_name(p.param_dtype)};
        nlohmann::json extra = nlohmann::json::object();
        if (p.shared_embedding) extra["shared_embedding"] = true;
        if (p.expert) extra["allreduce"] = false;
        if (!extra.empty()) entry.push_back(extra);
        params.push_back(entry);
        expert_params += p.expert ? 1 : 0;
    }
    std::ofstream(path) << nlohmann::json{{"params", params}}.dump();
    const std::vector<ddp::ParamSpec> specs = ddp::read_param_specs(path);   // `loom layout --params`
    ddp::LayoutOptions options;
    options.dp                        = dp;    // `loom layout --dp`
    options.edp                       = edp;   // `--edp`
    options.use_distributed_optimizer = ddp.config().use_distributed_optimizer;
    options.bucket_size               = ddp::effective_bucket_size(ddp.config(), options.dp);
    options.grad_reduce_in_fp32       = true;   // Loom's gradients are float32 (--grad-reduce-in-fp32)
    const bool shards = options.use_distributed_optimizer;
    EXPECT_EQ(ddp::layout_json(ddp::compute_layout(specs, options), specs, shards), ddp::layout_json(ddp.layout(), ddp.specs(), shards));
    EXPECT_GT(expert_params, 0);
}

// The largest of `v` over the world's ranks.
double world_max(double v) {
    Tensor t = Tensor::empty({1}, DType::f32, cpu::device());
    t.data<float>()[0] = static_cast<float>(v);
    g_mpi->world()->all_reduce(t, comm::ReduceOp::max)->wait();
    return t.data<float>()[0];
}

void expect_follows_reference(const Layout & l) {
    SCOPED_TRACE(describe(l));
    parallel::ParallelSizes sizes;
    sizes.world_size = g_mpi->world_size();
    sizes.pp         = l.pp;
    sizes.ep         = l.ep;
    sizes.tp         = l.tp;
    sizes.etp        = l.etp;
    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);
    parallel::ProcessGroups  groups = parallel::ProcessGroups::create(config, *g_mpi);

    train::TrainOptions o             = moe_options(l.dispatcher, l.grouped, l.bias, l.sinkhorn, l.expert_bias);
    o.parallel                        = config;
    o.sequence_parallel               = l.tp > 1;
    o.ddp.use_distributed_optimizer   = l.distopt;
    o.ddp.overlap_grad_reduce         = l.distopt;
    o.ddp.overlap_param_gather        = l.distopt;
    o.ddp.bucket_size                 = 20000;
    o.log_file                        = log_path("run");   // world rank 0 writes it
    if (l.offload) {
        o.optimizer_cpu_offload            = true;
        o.offload.offload_fraction         = 0.5f;
    }
    auto                source = train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), config.dp());
    train::Setup        setup  = train::setup(o, groups, cpu::device());
    ASSERT_TRUE(setup.ddp);
    expect_layout_is_loom_layouts(*setup.ddp, config.dp(), config.edp(), log_path("params"));
    std::vector<double> losses;
    {
        train::Trainer trainer(o, setup, *source);
        losses = trainer.run(nullptr).losses;
    }
    const Reference &                     reference_run = reference(l.grouped, l.bias, l.sinkhorn, l.expert_bias);
    const testing_models::SingleRankRun & ref           = reference_run.run;
    if (l.expert_bias) {
        // Every rank's biases (each TP x DP x CP rank routes its own rows) are the single rank's, bitwise: the
        // counts are whole numbers and every update the same step. And they moved.
        ASSERT_EQ(setup.chunks.size(), 1u);
        cpu::device().compute_stream().synchronize();
        const Tensor       bias = setup.chunks[0]->moe_expert_bias();
        std::vector<float> mine(bias.data<float>(), bias.data<float>() + bias.numel());
        EXPECT_EQ(mine, ref.moe_expert_bias);
        ASSERT_EQ(ref.moe_expert_bias.size(), 8u) << "2 MoE layers of 4 experts";
        for (float v : ref.moe_expert_bias) EXPECT_NE(v, 0.0f) << "after an odd number of updates, each moved";
    }
    ASSERT_EQ(losses.size(), ref.losses.size());
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < losses.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(losses[i] - ref.losses[i]));
        EXPECT_NEAR(losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    }
    int experts_held = 0;
    for (model::Parameter * p : setup.parameters()) {
        std::vector<float> v = testing_models::parameter_values(*p);
        auto               it = ref.params.find(p->name);
        ASSERT_NE(it, ref.params.end()) << p->name;
        std::vector<float> r = p->tp_slice.dim >= 0 ? model::tp_extract(p->tp_slice, it->second.data()) : it->second;
        ASSERT_EQ(v.size(), r.size()) << p->name;
        for (size_t i = 0; i < v.size(); ++i) worst_param = std::max(worst_param, static_cast<double>(std::fabs(v[i] - r[i])));
        experts_held += p->expert && p->name.find(".fc1.weight") != std::string::npos;
    }
    // The checkpoint of this layout holds the whole model, each expert once: loaded into one rank's model it
    // is the single-rank run's.
    o.save = ::testing::TempDir() + "loom_moe_mpi_ckpt_" + std::to_string(g_mpi->world_size());
    train::save_checkpoint(o, setup, 20, 20 * o.global_batch_size,
                           train::SchedulerState{o.lr_schedule(), 20.0 * static_cast<double>(o.global_batch_size)});
    {
        model::GptConfig whole = o.model;
        model::GptModel  gpt(whole, cpu::device());
        train::load_weights(checkpoint::read_index(o.save + "/iter_0000020"), gpt);
        double worst_loaded = 0;
        for (model::Parameter * p : gpt.parameters()) {
            std::vector<float> v = testing_models::parameter_values(*p);
            const std::vector<float> & r = ref.params.at(p->name);
            for (size_t i = 0; i < v.size(); ++i) worst_loaded = std::max(worst_loaded, static_cast<double>(std::fabs(v[i] - r[i])));
        }
        EXPECT_LT(worst_loaded, 5e-5) << "the checkpoint loaded into one rank";
        if (l.expert_bias) {   // saved once (by TP x DP x CP rank 0 of the stage), loaded whole
            const Tensor bias = gpt.moe_expert_bias();
            EXPECT_EQ(std::vector<float>(bias.data<float>(), bias.data<float>() + bias.numel()), ref.moe_expert_bias)
                << "the expert biases through the checkpoint";
        }
    }
    // Each MoE layer of this rank's stage holds E / ep experts (one grouped tensor of them), each its ETP
    // rank's share of the features.
    const int layers = 2 / l.pp;
    EXPECT_EQ(experts_held, l.grouped ? layers : layers * 4 / l.ep);
    worst_loss  = world_max(worst_loss);
    worst_param = world_max(worst_param);
    EXPECT_LT(worst_param, 5e-5);
    if (g_mpi->world_rank() == 0) {
        // The grad norm checks what Adam's scale invariance hides from the weights: expert gradients averaged
        // by 1/dp (not 1/edp), each expert counted once in the norm.
        std::vector<double> norms = grad_norms(o.log_file);
        ASSERT_EQ(norms.size(), reference_run.grad_norms.size());
        double worst_norm = 0;
        for (size_t i = 0; i < norms.size(); ++i) {
            const double rel = std::fabs(norms[i] - reference_run.grad_norms[i]) / reference_run.grad_norms[i];
            worst_norm       = std::max(worst_norm, rel);
            EXPECT_LT(rel, 1e-4) << "grad norm of iteration " << i + 1 << ": " << norms[i] << " vs "
                                 << reference_run.grad_norms[i];
        }
        // The logged load-balancing loss (summed over the sequence-parallel ranks' shares, averaged over DP).
        std::vector<double> balancing = logged(o.log_file, "load_balancing_loss");
        ASSERT_EQ(balancing.size(), reference_run.balancing.size());
        ASSERT_EQ(balancing.empty(), l.sinkhorn) << "sinkhorn has no aux loss to log";
        double worst_balancing = 0;
        for (size_t i = 0; i < balancing.size(); ++i) {
            worst_balancing = std::max(worst_balancing, std::fabs(balancing[i] - reference_run.balancing[i]));
            EXPECT_NEAR(balancing[i], reference_run.balancing[i], 1e-5) << "load_balancing_loss of iteration " << i + 1;
        }
        std::printf("[%s] worst |loss - reference| %.3g, worst |param - reference| %.3g, worst relative grad-norm "
                    "difference %.3g, worst |load_balancing_loss - reference| %.3g over %zu iterations\n",
                    describe(l).c_str(), worst_loss, worst_param, worst_norm, worst_balancing, losses.size());
    }
}

}  // namespace

// global_aux_loss over every rank (the TP x DP x CP group, here the world): a router's counts are the sum of
// every rank's own counts of its rows (bitwise: whole numbers), and its T is its rows times the world.
TEST(ExpertParallel, GlobalAuxLossSumsTheCountsOfEveryRank) {
    const int64_t n = 16, E = 4;
    Device &      device = cpu::device();
    model::GptConfig config = testing_models::small_gpt_options(1, 1, 1).model;
    model::MoeConfig moe;
    moe.num_experts    = E;
    moe.topk           = 2;
    moe.aux_loss_coeff = 0.01f;
    moe.load_balancing = model::MoeLoadBalancing::global_aux_loss;
    model::Router router("router", config, moe, device, {}, {}, g_mpi->world());
    Tensor logits = Tensor::empty({n, E}, DType::f32, device);
    for (int64_t i = 0; i < n * E; ++i) {   // rank-dependent scores
        logits.data<float>()[i] = std::sin(0.37f * static_cast<float>(i) + 1.3f * static_cast<float>(g_mpi->world_rank()));
    }
    model::Router::Context ctx;
    router.route(ctx, logits, 1);
    Tensor mine = Tensor::empty({1, E}, DType::f32, device);
    device.ops().moe_aux_counts(device.compute_stream(), logits, MoeRouting{E, 2}, 1, mine);
    g_mpi->world()->all_reduce(mine, comm::ReduceOp::sum, &device.compute_stream());
    device.compute_stream().synchronize();
    for (int64_t e = 0; e < E; ++e) EXPECT_EQ(ctx.counts.data<float>()[e], mine.data<float>()[e]) << "expert " << e;
    float total = 0;
    for (int64_t e = 0; e < E; ++e) total += ctx.counts.data<float>()[e];
    EXPECT_EQ(total, static_cast<float>(n * 2 * g_mpi->world_size())) << "every rank's rows, k each";
    EXPECT_EQ(router.loss_of(ctx, n).tokens, n * g_mpi->world_size());
}

TEST(ExpertParallel, Ep2AllgatherFollowsTheSingleRankRun) { expect_follows_reference(Layout{2, 1, false}); }

TEST(ExpertParallel, Ep2AlltoallFollowsTheSingleRankRun) {
    expect_follows_reference(Layout{2, 1, false, model::MoeDispatcher::alltoall});
}

TEST(ExpertParallel, Ep2AlltoallGroupedGemmFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks";
    expect_follows_reference(Layout{2, 1, false, model::MoeDispatcher::alltoall, true});
}

TEST(ExpertParallel, Ep2WithCpuOffloadFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks";
    expect_follows_reference(Layout{2, 1, false, model::MoeDispatcher::allgather, false, true});
}

TEST(ExpertParallel, Ep2TimesPp2FollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks";
    expect_follows_reference(Layout{2, 2, false, model::MoeDispatcher::alltoall});
}

TEST(ExpertParallel, Ep2WithZeroOneAndOverlapsFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (dp 4, ep 2, edp 2)";
    expect_follows_reference(Layout{2, 1, true, model::MoeDispatcher::allgather});
}

TEST(ExpertParallel, DataParallelWithEp1FollowsTheSingleRankRun) { expect_follows_reference(Layout{1, 1, false}); }

// MoE parallel folding: the dense layers TP 2 + SP x DP 2, the experts ETP 2 x EP 2 (edp 1).
Layout tp2_sp(model::MoeDispatcher dispatcher, int etp) {
    Layout l;
    l.ep         = 2;
    l.dispatcher = dispatcher;
    l.tp         = 2;
    l.etp        = etp;
    l.bias       = false;
    return l;
}

TEST(ExpertParallel, Ep2TimesEtp2WithTp2SpAlltoallFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2; etp 2 x ep 2)";
    expect_follows_reference(tp2_sp(model::MoeDispatcher::alltoall, 2));
}

TEST(ExpertParallel, Ep2TimesEtp2WithTp2SpAllgatherFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2; etp 2 x ep 2)";
    expect_follows_reference(tp2_sp(model::MoeDispatcher::allgather, 2));
}

// Grouped GEMM: each (L, F1, h) tensor is this rank's experts (dim 0) and its ETP block of features (dim 1,
// or 2 for fc2) of the full (E, F1, h); the checkpoint assembles them into the single-rank tensors.
TEST(ExpertParallel, Ep2TimesEtp2WithTp2SpGroupedGemmFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2; etp 2 x ep 2)";
    Layout l  = tp2_sp(model::MoeDispatcher::alltoall, 2);
    l.grouped = true;
    expect_follows_reference(l);
}

// ETP 1 under TP 2 + SP on 2 ranks: every rank holds every expert whole and routes its half of the
// sequence, so the expert-data-parallel group (2) is larger than the data-parallel one (1).
TEST(ExpertParallel, Etp1UnderTp2SpFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks (tp 2; etp 1 x ep 1 x edp 2)";
    Layout l     = tp2_sp(model::MoeDispatcher::alltoall, 1);
    l.ep         = 1;
    expect_follows_reference(l);
}

// Sinkhorn balances over the micro-batch's rows: under TP 2 + SP each rank holds half of them, and the
// router gathers the group's logits so that both select as the single rank does.
TEST(ExpertParallel, SinkhornUnderTp2SpFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks (tp 2; etp 1 x ep 1 x edp 2)";
    Layout l   = tp2_sp(model::MoeDispatcher::alltoall, 1);
    l.ep       = 1;
    l.sinkhorn = true;
    expect_follows_reference(l);
}

TEST(ExpertParallel, SinkhornWithEp2FollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks (ep 2)";
    Layout l;
    l.ep         = 2;
    l.dispatcher = model::MoeDispatcher::alltoall;
    l.sinkhorn   = true;
    expect_follows_reference(l);
}

// Aux-loss-free balancing and group-limited routing (DeepSeek-V3's router) with every rank routing its own
// rows: the token counts are summed over TP x DP (the world here) before each bias update. A gated shared expert
// (--moe-shared-expert-gate) beside the routed ones.
TEST(ExpertParallel, ExpertBiasWithEp2AndTp2SpFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2; etp 1 x ep 2 x edp 2)";
    Layout l      = tp2_sp(model::MoeDispatcher::alltoall, 1);
    l.expert_bias = true;
    expect_follows_reference(l);
}

TEST(ExpertParallel, Ep2WithEtp1AndTp2SpFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "needs 4 ranks (tp 2 x dp 2; etp 1 x ep 2 x edp 2)";
    expect_follows_reference(tp2_sp(model::MoeDispatcher::alltoall, 1));
}

// ---------------------------------------------------------------------------------------------------
// One layer: the exchanges, counted, and the result against the single-rank layer on the same tokens.

namespace {

std::vector<float> random_vector(int64_t n, uint64_t seed) {
    std::mt19937_64                       rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float>                    v(static_cast<size_t>(n));
    for (float & x : v) x = u(rng);
    return v;
}

Tensor tensor_of(const std::vector<float> & v, const Shape & shape) {
    Tensor t = Tensor::empty(shape, DType::f32, cpu::device());
    std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(float));
    return t;
}

std::vector<float> values(const Tensor & t) {
    cpu::device().compute_stream().synchronize();
    return std::vector<float>(t.data<float>(), t.data<float>() + t.numel());
}

double max_diff(const std::vector<float> & a, const std::vector<float> & b) {
    double worst = 0;
    for (size_t i = 0; i < a.size(); ++i) worst = std::max(worst, static_cast<double>(std::fabs(a[i] - b[i])));
    return worst;
}

}  // namespace

TEST(ExpertParallel, DispatchersSendEveryRoutedTokenOnceAndMatchTheSingleRankLayer) {
    const int P = g_mpi->world_size();
    if (4 % P != 0) GTEST_SKIP() << "4 experts over " << P << " ranks";
    model::GptConfig config = moe_options().model;
    const int64_t    s = 8, b = 2, n = s * b, h = config.hidden_size, k = 2, E = 4;
    auto             counting = std::make_shared<comm::CountingCommunicator>(g_mpi->world());
    for (model::MoeDispatcher dispatcher : {model::MoeDispatcher::alltoall, model::MoeDispatcher::allgather}) {
        for (float capacity : {-1.0f, 1.0f}) {
            const bool alltoall = dispatcher == model::MoeDispatcher::alltoall;
            SCOPED_TRACE(std::string(alltoall ? "alltoall" : "allgather") + (capacity > 0 ? ", capacity factor 1" : ""));
            model::MoeConfig moe = config.moe;
            moe.dispatcher       = dispatcher;
            moe.capacity_factor  = capacity;
            model::MoELayer single("layers.0.mlp", config, moe, cpu::device());
            model::ExpertParallel ep;
            ep.group = counting;
            ep.rank  = counting->rank();
            ep.size  = P;
            model::MoELayer spread("layers.0.mlp", config, moe, cpu::device(), {}, ep);
            single.init(5, 0.2f, 0.1f);
            spread.init(5, 0.2f, 0.1f);
            // Every rank routes its own tokens.
            const auto xv = random_vector(n * h, 100 + counting->rank()), dyv = random_vector(n * h, 200 + counting->rank());
            model::MoELayer::Context a, c;
            counting->reset();
            Tensor y_single = single.forward(a, tensor_of(xv, {n, h}), s, b);
            Tensor y_spread = spread.forward(c, tensor_of(xv, {n, h}), s, b);
            const comm::OpCount forward_a2a = counting->count(comm::OpKind::all_to_all);
            const comm::OpCount forward_ag  = counting->count(comm::OpKind::all_gather);
            const comm::OpCount forward_rs  = counting->count(comm::OpKind::reduce_scatter);
            if (alltoall) {
                // The counts, the tokens, the outputs back; without dropping the rows sent are all T k.
                EXPECT_EQ(forward_a2a.calls, 3);
                int64_t sent = 0, received = 0;
                for (int64_t r : c.send_rows) sent += r;
                for (int64_t r : c.recv_rows) received += r;
                EXPECT_EQ(sent, c.rows);
                if (capacity < 0) {
                    EXPECT_EQ(sent, n * k);
                }
                EXPECT_EQ(forward_a2a.bytes, E * 8 + (sent + received) * h * 4);
                Tensor total = Tensor::empty({2}, DType::f32, cpu::device());
                total.data<float>()[0] = static_cast<float>(sent);
                total.data<float>()[1] = static_cast<float>(received);
                g_mpi->world()->all_reduce(total, comm::ReduceOp::sum)->wait();
                EXPECT_EQ(total.data<float>()[0], total.data<float>()[1]) << "every row sent is received";
                if (capacity < 0) {
                    EXPECT_EQ(total.data<float>()[0], static_cast<float>(P * n * k));
                }
                if (counting->rank() == 0 && capacity < 0) {
                    std::printf("[alltoall, world %d] rank 0 sends rows", P);
                    for (int64_t r : c.send_rows) std::printf(" %lld", static_cast<long long>(r));
                    std::printf(" (sum %lld = T k = %lld x %lld); all ranks send %g rows\n", static_cast<long long>(sent),
                                static_cast<long long>(n), static_cast<long long>(k), total.data<float>()[0]);
                }
            } else {
                EXPECT_EQ(forward_a2a.calls, 0);
                EXPECT_EQ(forward_ag.calls, 3);   // routed experts, probabilities, tokens
                EXPECT_EQ(forward_rs.calls, 1);   // the outputs
                EXPECT_EQ(forward_ag.bytes, P * n * (k * 4 + k * 4 + h * 4));
            }
            // Tolerance 1e-5: an expert's GEMMs run over the rows this rank received, not the single layer's,
            // and the GEMM's blocking (so its rounding) depends on the row count (AVX2-capped runs differ by
            // a few ulps, about 2e-6 here); the same rows give exact equality.
            const double dy_diff = max_diff(values(y_single), values(y_spread));
            EXPECT_LT(dy_diff, 1e-5);
            Tensor dx_single = single.backward(a, tensor_of(dyv, {n, h}), {});
            Tensor dx_spread = spread.backward(c, tensor_of(dyv, {n, h}), {});
            const double dx_diff = max_diff(values(dx_single), values(dx_spread));
            EXPECT_LT(dx_diff, 1e-5);
            // The router's gradient is this rank's tokens' alone on both.
            const double router_diff = max_diff(values(single.router.weight.main_grad), values(spread.router.weight.main_grad));
            EXPECT_LT(router_diff, 1e-5);
            if (counting->rank() == 0) {
                std::printf("[%s%s, world %d] worst |y| diff %.3g, |dx| diff %.3g, |router grad| diff %.3g\n",
                            alltoall ? "alltoall" : "allgather", capacity > 0 ? ", capacity 1" : "", P, dy_diff, dx_diff,
                            router_diff);
            }
        }
    }
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
