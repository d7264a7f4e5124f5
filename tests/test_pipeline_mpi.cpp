// Pipeline parallelism end to end, under mpirun with 2 and 4 ranks: the model split into PP stages (and,
// with 4 ranks, also PP 2 x DP 2, with replicated AdamW and with ZeRO-1 and both overlaps) trains with the
// 1F1B executor and must follow the single-rank run that every rank computes first. Each stage's peak
// number of activation contexts must be min(pp - stage, M).
//
// Tolerance. Pipelining changes no arithmetic inside a stage; what moves is the order of a few sums: the
// tied word embedding's gradient is the first stage's embedding part plus the last stage's output part
// added by the embedding-group all-reduce, and the gradient norm adds the stages' sums. Over 10
// iterations losses agree within 5e-5 and weights within 5e-5, as for data parallelism.
#include "backend/cpu/cpu_device.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "pipeline/layer_assignment.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include "mpi_test_main.h"
#include "small_gpt.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <fstream>
#include <map>
#include <memory>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

train::TrainOptions small_options() {
    train::TrainOptions o = testing_models::small_gpt_options(4, 8, 10);
    o.lr_warmup_iters     = 3;
    return o;
}

struct StageRun {
    std::vector<double>                       losses;
    std::map<std::string, std::vector<float>> params;   // by name
    int                                       peak_in_flight = 0;
    int                                       stage = 0;
};

using testing_models::parameter_values;

StageRun reference() {
    testing_models::SingleRankRun ref = testing_models::train_single_rank(small_options());
    StageRun                      run;
    run.losses = ref.losses;
    run.params = ref.params;
    return run;
}

StageRun pipelined(int pp, bool distopt, const std::string & timeline = "", int vpp = 1, int first_stage_layers = 0) {
    parallel::ParallelSizes sizes;
    sizes.world_size = g_mpi->world_size();
    sizes.pp         = pp;
    if (vpp > 1) sizes.vpp = vpp;
    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);
    parallel::ProcessGroups  groups = parallel::ProcessGroups::create(config, *g_mpi);
    const int                stage  = groups.pp->rank();

    train::TrainOptions o = small_options();
    o.parallel            = config;
    o.ddp.use_distributed_optimizer = distopt;
    o.ddp.overlap_grad_reduce       = distopt;
    o.ddp.overlap_param_gather      = distopt;
    o.ddp.bucket_size               = 20000;
    o.timeline_file                 = timeline;
    if (first_stage_layers > 0) o.first_stage_layers = first_stage_layers;
    auto         source = train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), config.dp());
    train::Setup setup  = train::setup(o, groups, cpu::device());
    StageRun     run;
    run.stage = stage;
    {
        train::Trainer trainer(o, setup, *source);
        run.losses         = trainer.run(nullptr).losses;
        run.peak_in_flight = trainer.peak_in_flight();
    }
    for (model::Parameter * p : setup.parameters()) run.params[p->name] = parameter_values(*p);
    return run;
}

void expect_follows_reference(int pp, bool distopt, int vpp = 1) {
    SCOPED_TRACE("pp " + std::to_string(pp) + " vpp " + std::to_string(vpp) +
                 (distopt ? ", distributed optimizer, both overlaps" : ""));
    static const StageRun ref = reference();
    StageRun              run = pipelined(pp, distopt, "", vpp);
    ASSERT_EQ(run.losses.size(), ref.losses.size());
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(run.losses[i] - ref.losses[i]));
        EXPECT_NEAR(run.losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    }
    for (const auto & [name, v] : run.params) {
        auto it = ref.params.find(name);
        ASSERT_NE(it, ref.params.end()) << name;
        ASSERT_EQ(v.size(), it->second.size()) << name;
        for (size_t i = 0; i < v.size(); ++i) {
            worst_param = std::max(worst_param, static_cast<double>(std::fabs(v[i] - it->second[i])));
        }
    }
    EXPECT_LT(worst_param, 5e-5);
    // 1F1B keeps min(pp - stage, M) micro-batches in flight, interleaved min(2(pp - stage - 1) +
    // (V - 1) N + 1, M V) with N = pp, as measured by the executor.
    int dp = g_mpi->world_size() / pp, m = 8 / dp;
    int expected = vpp == 1 ? std::min(pp - run.stage, m) : std::min(2 * (pp - run.stage - 1) + (vpp - 1) * pp + 1, m * vpp);
    EXPECT_EQ(run.peak_in_flight, expected) << "stage " << run.stage;
    if (g_mpi->world_rank() == 0) {
        std::printf("[pp %d vpp %d dp %d%s] worst |loss - reference| %.3g, worst |param - reference| %.3g\n", pp, vpp,
                    dp, distopt ? " zero-1" : "", worst_loss, worst_param);
    }
}

}  // namespace

TEST(PipelineParallel, AllStagesFollowTheSingleRankRun) { expect_follows_reference(g_mpi->world_size(), false); }

// --timeline: the last iteration's measured ops of every stage, one <rect> each, written by world rank 0.
TEST(PipelineParallel, MeasuredTimelineHoldsEveryStagesOps) {
    const int   pp   = g_mpi->world_size();
    std::string path = ::testing::TempDir() + "loom_pp_timeline_" + std::to_string(pp) + ".svg";
    std::remove(path.c_str());
    pipelined(pp, false, path);
    g_mpi->world()->barrier()->wait();
    if (g_mpi->world_rank() == 0) {
        std::ifstream in(path);
        ASSERT_TRUE(in.good()) << path;
        std::string svg((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        size_t      rects = 0;
        for (size_t at = svg.find("<rect"); at != std::string::npos; at = svg.find("<rect", at + 1)) ++rects;
        EXPECT_EQ(rects, static_cast<size_t>(2 * 8 * pp)) << "forward and backward of 8 micro-batches per stage";
        EXPECT_NE(svg.find("measured durations"), std::string::npos);
    }
}

TEST(PipelineParallel, TwoStagesTimesDataParallelFollowTheSingleRankRun) {
    if (g_mpi->world_size() % 2 != 0 || g_mpi->world_size() < 4) GTEST_SKIP() << "needs 4 ranks";
    expect_follows_reference(2, false);
}

// --decoder-first-pipeline-num-layers 1: stage 0 holds layer 0 only, stage 1 layers 1-3.
TEST(PipelineParallel, UnevenStagesFollowTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks";
    static const StageRun ref = reference();
    StageRun              run = pipelined(2, false, "", 1, 1);
    for (size_t i = 0; i < ref.losses.size(); ++i) EXPECT_NEAR(run.losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    const size_t layers = std::count_if(run.params.begin(), run.params.end(), [](const auto & kv) {
        return kv.first.find(".norm1.weight") != std::string::npos;
    });
    EXPECT_EQ(layers, run.stage == 0 ? 1u : 3u) << "stage " << run.stage;
    for (const auto & [name, v] : run.params) {
        const std::vector<float> & r = ref.params.at(name);
        for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], r[i], 5e-5) << name;
    }
}

// --account-for-embedding-in-pipeline-split and --account-for-loss-in-pipeline-split (Megatron's functional
// test gpt3_mcore_te_tp1_pp4_vp2_account_for_embedding_loss_in_pipeline_split): 6 layers, PP 4, V 2: the
// model's first chunk holds the embedding alone and its last the loss alone; the run is the single rank's.
TEST(PipelineParallel, EmbeddingAndLossCountedAsLayersFollowTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 4 ranks";
    train::TrainOptions o = testing_models::small_gpt_options(6, 8, 6);
    o.lr_warmup_iters     = 3;
    const testing_models::SingleRankRun ref = testing_models::train_single_rank(o);
    parallel::ParallelSizes sizes;
    sizes.world_size = 4;
    sizes.pp         = 4;
    sizes.vpp        = 2;
    o.parallel                              = parallel::ParallelConfig::create(sizes);
    o.account_for_embedding_in_pipeline_split = true;
    o.account_for_loss_in_pipeline_split      = true;
    parallel::ProcessGroups groups = parallel::ProcessGroups::create(o.parallel, *g_mpi);
    auto                    source = train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), o.parallel.dp());
    train::Setup            setup  = train::setup(o, groups, cpu::device());
    std::vector<double>     losses;
    {
        train::Trainer trainer(o, setup, *source);
        losses = trainer.run(nullptr).losses;
    }
    ASSERT_EQ(losses.size(), ref.losses.size());
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    size_t layers = 0;
    for (model::Parameter * p : setup.parameters()) {
        layers += p->name.find(".norm1.weight") != std::string::npos;
        const std::vector<float> v = parameter_values(*p), & r = ref.params.at(p->name);
        for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], r[i], 5e-5) << p->name;
    }
    const int stage = groups.pp->rank();
    EXPECT_EQ(layers, stage == 0 || stage == 3 ? 1u : 2u) << "stage " << stage << ": [] + [3], [0] + [4], [1] + [5], [2] + []";
}

// DeepSeek-V3's layers over two stages (x DP 2 on 4 ranks): multi-latent attention with a query latent and
// the latents' norms, MoE with sigmoid routing, the expert bias and group-limited routing, and one MTP depth
// on the last stage with untied embeddings (the last stage's copy of the word embedding summed with the
// first's over the embedding group), placed by Megatron's custom layout "Ett|t|t|mL": two virtual stages per
// rank, uneven (rank 0 holds layers 0-1 and 3, rank 1 layer 2 and a last chunk of the MTP depth alone).
// Losses and weights follow the single rank within 5e-5, and each rank's routers' expert biases (the MTP
// layer's router among rank 1's) are the single rank's bitwise.
TEST(PipelineParallel, DeepSeekStyleLayersAndMtpOverTwoStagesFollowTheSingleRankRun) {
    if (g_mpi->world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
    train::TrainOptions o            = testing_models::small_gpt_options(4, 8, 7);
    o.model.normalization            = model::Normalization::rmsnorm;
    o.model.position_embedding       = model::PositionEmbedding::rope;
    o.model.add_bias_linear          = false;
    o.model.qk_layernorm             = true;
    o.model.untie_embeddings_and_output_weights = true;
    o.model.mtp_num_layers           = 1;
    testing_models::use_multi_latent_attention(o);
    model::MoeConfig & moe           = o.model.moe;
    moe.num_experts                  = 4;
    moe.topk                         = 2;
    moe.score_function               = model::MoeScoreFunction::sigmoid;
    moe.expert_bias                  = true;
    moe.bias_update_rate             = 1e-2f;
    moe.num_groups                   = 2;
    moe.group_topk                   = 1;
    moe.aux_loss_coeff               = 1e-3f;
    const testing_models::SingleRankRun ref = testing_models::train_single_rank(o);
    parallel::ParallelSizes sizes;
    sizes.world_size = g_mpi->world_size();
    sizes.pp         = 2;
    sizes.vpp        = 2;
    o.parallel       = parallel::ParallelConfig::create(sizes);
    o.pipeline_layout = "Ett|t|t|mL";
    parallel::ProcessGroups groups = parallel::ProcessGroups::create(o.parallel, *g_mpi);
    auto                    source = train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), o.parallel.dp());
    train::Setup            setup  = train::setup(o, groups, cpu::device());
    std::vector<double>     losses;
    {
        train::Trainer trainer(o, setup, *source);
        losses = trainer.run(nullptr).losses;
    }
    ASSERT_EQ(losses.size(), ref.losses.size());
    for (size_t i = 0; i < losses.size(); ++i) EXPECT_NEAR(losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    for (model::Parameter * p : setup.parameters()) {
        const std::vector<float> v = parameter_values(*p), & r = ref.params.at(p->name);
        for (size_t i = 0; i < v.size(); ++i) ASSERT_NEAR(v[i], r[i], 5e-5) << p->name;
    }
    cpu::device().compute_stream().synchronize();
    int compared = 0;
    // "layers.<i>.mlp.router.expert_bias", then "mtp.layers.0.transformer_layer.mlp.router.expert_bias" (the
    // single rank's row after the decoder's four)
    for (model::GptModel * chunk : setup.chunks) {
        for (auto & [name, bias] : chunk->buffers()) {
            const size_t  layer = name.rfind("mtp.", 0) == 0 ? 4 : std::stoul(name.substr(7));
            const float * mine = bias.data<float>(), * want = ref.moe_expert_bias.data() + layer * 4;
            EXPECT_EQ(std::vector<float>(mine, mine + 4), std::vector<float>(want, want + 4)) << name;
            ++compared;
        }
    }
    EXPECT_EQ(compared, groups.pp->rank() == 0 ? 3 : 2) << "rank 0: layers 0, 1 and 3; rank 1: layer 2 and MTP's";
}

TEST(PipelineParallel, InterleavedTwoStagesTwoVirtualStagesFollowTheSingleRankRun) {
    if (g_mpi->world_size() % 2 != 0) GTEST_SKIP() << "needs an even number of ranks";
    expect_follows_reference(2, false, 2);
}

TEST(PipelineParallel, TwoStagesTimesDataParallelWithZeroOneAndOverlapsFollowTheSingleRankRun) {
    if (g_mpi->world_size() % 2 != 0 || g_mpi->world_size() < 4) GTEST_SKIP() << "needs 4 ranks";
    expect_follows_reference(2, true);
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
