// Tensor parallelism end to end, under mpirun: TP 2 (GPT-2-style and Llama-style: SwiGLU, GQA, RoPE, --qk-layernorm,
// untied output), with and without sequence parallelism, TP 2 x DP 2, TP 2 x PP 2 (also with sequence
// parallelism and ZeRO-1), and with 8 ranks TP 2 x PP 2 x DP 2 with the distributed optimizer, each against the single-rank run every rank computes first. Each rank's parameter shard is
// compared with the same slice (its tp_slice) of the reference's full tensor.
//
// Tolerance. Tensor parallelism reorders sums: each row-parallel output and each column-parallel input
// gradient is summed over the TP ranks, and the vocabulary-parallel softmax combines per-rank maxima and
// sums. Over 10 iterations losses agree within 5e-5 and weights within 5e-5, as for the other layouts.
#include "backend/cpu/cpu_device.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "train/data_source.h"
#include "train/setup.h"
#include "train/trainer.h"

#include "mpi_test_main.h"
#include "small_gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>
#include <memory>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

// mla: DeepSeek-style, the Llama-style model with multi-latent attention (a query latent, the latents' norms)
// and one MTP depth, without attention dropout (as Megatron's DeepSeek configurations train): with it, a few
// embedding elements' gradients come out near 1e-8 (four orders below the mean), where Adam turns the TP
// run's rounding into whole steps and no tolerance on the weights can hold.
// --cross-entropy-loss-fusion in every run of a test that sets it (the reference's and the layout's): chunks of 5
// of the 32 positions, the last one short.
bool g_fused_classifier = false;
// DeepSeek Sparse Attention on the DeepSeek-style model's MLA layers (without its MTP depth, which Loom refuses with
// DSA): an indexer of 2 heads of 16 with the top-k every key and a loss coefficient of 1, in every run of a test that
// sets it.
bool g_dsa = false;
// --tp-comm-overlap in the layout's run (the reference has no TP): the sequence-parallel linears' rings.
bool g_tp_comm_overlap = false;

train::TrainOptions small_options(bool llama, bool mla = false, bool muon = false, bool sinks = false, bool gdn = false);

train::TrainOptions options_of(bool llama, bool mla, bool muon, bool sinks, bool gdn) {
    train::TrainOptions o = small_options(llama, mla, muon, sinks, gdn);
    o.model.classifier_fusion          = g_fused_classifier;
    o.model.classifier_chunk_positions = g_fused_classifier ? 5 : 0;
    if (g_dsa) {
        o.model.dsa                    = true;
        o.model.dsa_indexer_n_heads    = 2;
        o.model.dsa_indexer_head_dim   = 16;
        // Two ranks: every causal key (the attention MLA's own); four: each row's top half, the loss over them.
        const bool sparse                   = g_mpi->world_size() == 4;
        o.model.dsa_indexer_topk            = sparse ? o.model.seq_length / 2 : o.model.seq_length;
        o.model.dsa_indexer_use_sparse_loss = sparse;
        o.model.dsa_indexer_loss_coeff      = 1.0f;
    }
    return o;
}

train::TrainOptions small_options(bool llama, bool mla, bool muon, bool sinks, bool gdn) {
    if (gdn) {   // Qwen3-Next's layers: the gated delta-net on layers 0 and 2 (split by heads: two key heads, four value
                 // heads), the gated attention (and sinks) on 1 and 3, zero-centred norms
        train::TrainOptions o      = small_options(llama, mla, muon, true);
        testing_models::use_gated_delta_net(o, 2, 4);
        o.model.apply_layernorm_1p = true;
        return o;
    }
    if (sinks) {   // gpt-oss's learnable attention sinks (each rank holds its heads' logits), and Qwen3-Next's output
                   // gate (each rank its heads' gate rows of QKV)
        train::TrainOptions o         = small_options(llama, mla, muon);
        o.model.softmax_type          = model::SoftmaxType::learnable;
        o.model.attention_output_gate = true;
        return o;
    }
    train::TrainOptions o = testing_models::small_gpt_options(4, 8, 10);
    o.lr_warmup_iters     = 3;
    if (muon) {   // Muon on the weight matrices, its Newton-Schulz in f32 (bf16's rounding would hide nothing)
        o = small_options(llama, mla);
        o.muon.emplace().bf16_matmul = false;
        return o;
    }
    if (mla) {
        o = small_options(true);
        testing_models::use_multi_latent_attention(o);
        o.model.mtp_num_layers    = 1;
        o.model.attention_dropout = 0.0f;
        return o;
    }
    if (llama) {
        model::GptConfig l      = model::gpt_preset("llama-tiny");
        o.model.normalization   = l.normalization;
        o.model.swiglu          = true;
        o.model.position_embedding = l.position_embedding;
        o.model.add_bias_linear = false;
        o.model.untie_embeddings_and_output_weights = true;
        o.model.num_query_groups = 2;
        o.model.qk_layernorm     = true;   // as OLMo-2 and Qwen3 add to it: the per-head norms' gradients sum over TP
    }
    return o;
}

struct Run {
    std::vector<double>                       losses;
    std::map<std::string, std::vector<float>> params;   // by name: the shard this rank holds
    std::map<std::string, model::TpSlice>     slices;
};

Run reference(bool llama, bool mla = false, bool muon = false, bool sinks = false, bool gdn = false) {
    testing_models::SingleRankRun ref = testing_models::train_single_rank(options_of(llama, mla, muon, sinks, gdn));
    Run                           run;
    run.losses = ref.losses;
    run.params = ref.params;
    return run;
}

// recompute: 0 none, 1 full (every layer), 2 selective (layernorm and mlp: the norms' outputs gathered again
// over the TP group in backward, the MLP rerun from its input).
Run parallel_run(int tp, int pp, bool distopt, bool llama, bool sp, int recompute, bool mla = false, bool muon = false,
                 bool sinks = false, bool gdn = false) {
    parallel::ParallelSizes sizes;
    sizes.world_size = g_mpi->world_size();
    sizes.tp         = tp;
    sizes.pp         = pp;
    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);
    parallel::ProcessGroups  groups = parallel::ProcessGroups::create(config, *g_mpi);

    train::TrainOptions o           = options_of(llama, mla, muon, sinks, gdn);
    o.parallel                      = config;
    o.ddp.use_distributed_optimizer = distopt;
    o.ddp.overlap_grad_reduce       = distopt;
    o.ddp.bucket_size               = 20000;
    o.sequence_parallel             = sp;
    o.tp_comm_overlap               = sp && g_tp_comm_overlap;
    if (recompute == 1) {   // every layer rerun in backward, its dropout masks redrawn
        o.model.recompute_granularity = model::RecomputeGranularity::full;
        o.model.recompute_method      = model::RecomputeMethod::uniform;
        o.model.recompute_num_layers  = 1;
    } else if (recompute == 2) {
        o.model.recompute_granularity = model::RecomputeGranularity::selective;
        o.model.recompute_layernorm   = true;
        o.model.recompute_mlp         = true;
    }
    auto         source = train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), config.dp());
    train::Setup setup  = train::setup(o, groups, cpu::device());
    Run          run;
    {
        train::Trainer trainer(o, setup, *source);
        run.losses = trainer.run(nullptr).losses;
    }
    for (model::Parameter * p : setup.parameters()) {
        run.params[p->name] = testing_models::parameter_values(*p);
        run.slices[p->name] = p->tp_slice;
    }
    return run;
}

void expect_follows_reference(int tp, int pp, bool distopt, bool llama, bool sp = false, int recompute = 0, bool mla = false,
                              bool muon = false, bool sinks = false, bool gdn = false) {
    const std::string name = std::string(mla ? "mla" : llama ? "llama" : "gpt") + (g_fused_classifier ? " fused classifier" : "") +
                             (g_dsa ? " dsa" : "") +
                             (muon ? " muon" : "") + (sinks ? " sinks+gate" : "") +
                             (gdn ? " gated delta-net" : "") +
                             " tp " + std::to_string(tp) + " pp " +
                             std::to_string(pp) + (sp ? " sequence-parallel" : "") +
                             (sp && g_tp_comm_overlap ? " tp-comm-overlap" : "") + (distopt ? " zero-1" : "") +
                             (recompute == 1 ? " full recompute" : recompute == 2 ? " selective recompute" : "");
    SCOPED_TRACE(name);
    const Run ref = reference(llama, mla, muon, sinks, gdn);
    const Run run = parallel_run(tp, pp, distopt, llama, sp, recompute, mla, muon, sinks, gdn);
    ASSERT_EQ(run.losses.size(), ref.losses.size());
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(run.losses[i] - ref.losses[i]));
        EXPECT_NEAR(run.losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    }
    for (const auto & [pname, shard] : run.params) {
        auto it = ref.params.find(pname);
        ASSERT_NE(it, ref.params.end()) << pname;
        const model::TpSlice & slice = run.slices.at(pname);
        std::vector<float>     full  = it->second;
        if (slice.dim >= 0) {
            // The reference's vocabulary may be padded less than the TP layout's: pad it with zeros.
            int64_t want = 1;
            for (int64_t d : slice.full_shape) want *= d;
            full.resize(static_cast<size_t>(want), 0.0f);
        }
        std::vector<float> expected = slice.dim >= 0 ? model::tp_extract(slice, full.data()) : full;
        ASSERT_EQ(shard.size(), expected.size()) << pname;
        for (size_t i = 0; i < shard.size(); ++i) {
            worst_param = std::max(worst_param, static_cast<double>(std::fabs(shard[i] - expected[i])));
        }
    }
    EXPECT_LT(worst_param, 5e-5);
    if (g_mpi->world_rank() == 0) {
        std::printf("[%s, dp %d] worst |loss - reference| %.3g, worst |param - reference| %.3g\n", name.c_str(),
                    g_mpi->world_size() / (tp * pp), worst_loss, worst_param);
    }
}

}  // namespace

TEST(TensorParallel, TwoRanksFollowTheSingleRankRun) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks";
    expect_follows_reference(2, 1, false, false);
    expect_follows_reference(2, 1, false, true);
}

TEST(TensorParallel, SequenceParallelFollowsTheSingleRankRun) {
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, false, true);   // TP 2 + SP
        // Llama-style, TP 2 + SP, with learnable attention sinks and the output gate (split by heads as the heads are)
        expect_follows_reference(2, 1, false, true, true, 0, false, false, true);
        expect_follows_reference(2, 1, false, false, true, 1);   // TP 2 + SP, every layer recomputed
        expect_follows_reference(2, 1, false, true, true, 2);    // Llama-style TP 2 + SP, layernorm and mlp recomputed
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(2, 2, true, false, true);    // TP 2 + SP x PP 2, ZeRO-1 (DP 1)
        expect_follows_reference(2, 2, true, false, true, 1);   // the same, every layer recomputed
    } else {
        GTEST_SKIP() << "runs with 2 and 4 ranks";
    }
}

// --tp-comm-overlap: every sequence-parallel linear passes its row blocks around the TP ring beside its GEMMs
// (all-gather + GEMM, GEMM + reduce-scatter, the backward's reduce-scatter beside the weight gradient), against the
// single-rank run: GPT-2-style (biases, the bias-GELU epilogue block by block) and Llama-style (SwiGLU, no biases)
// at TP 2 + SP; on 4 ranks TP 4 + SP (blocks three steps around the ring) and TP 2 + SP x PP 2 with ZeRO-1 and
// every layer recomputed.
TEST(TensorParallel, CommOverlapRingsFollowTheSingleRankRun) {
    g_tp_comm_overlap = true;
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, false, true);
        expect_follows_reference(2, 1, false, true, true);
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(4, 1, false, false, true);
        expect_follows_reference(2, 2, true, false, true, 1);
    } else {
        g_tp_comm_overlap = false;
        GTEST_SKIP() << "runs with 2 and 4 ranks";
    }
    g_tp_comm_overlap = false;
}

// --cross-entropy-loss-fusion: the output layer, the loss and its gradient in 7 chunks of positions in the
// forward, each chunk's vocabulary-parallel loss summed over TP (its max, sum and label logit), against the
// single rank's fused run: TP 2 + SP, and with MLA and an MTP depth (whose own logits stay unfused) TP 2 + SP x
// PP 2 with ZeRO-1 on 4 ranks.
TEST(TensorParallel, FusedClassifierFollowsTheSingleRankRun) {
    g_fused_classifier = true;
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, false, true);
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(2, 2, true, true, true, 0, true);
    }
    g_fused_classifier = false;
    if (g_mpi->world_size() != 2 && g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 2 and 4 ranks";
}

// Multi-latent attention split by heads (the up projections and Q by rows, the output projection by
// columns), its down projections and latent norms whole on every rank: TP 2 with and without sequence
// parallelism (k_pe gathered and its gradient reduce-scattered), and TP 2 + SP x PP 2 with ZeRO-1. The MTP
// depth's eh_proj and norms are whole on every rank too (their gradients summed over TP under SP), its
// embedding and logits vocabulary-parallel.
TEST(TensorParallel, MultiLatentAttentionAndMtpFollowTheSingleRankRun) {
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, true, false, 0, true);
        expect_follows_reference(2, 1, false, true, true, 0, true);
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(2, 2, true, true, true, 0, true);
    } else {
        GTEST_SKIP() << "runs with 2 and 4 ranks";
    }
}

// DeepSeek Sparse Attention's indexer, whole on every rank: its inputs (the attention's input and the query latent)
// gathered under SP, the main attention's head-summed probabilities summed over the group, so its loss and its weights'
// gradients are the single rank's on every rank, with the MTP depth's layer (an indexer of its own). TP 2 + SP with
// every key; TP 2 + SP x PP 2 with ZeRO-1, each row attending to its top half of the keys (the same selection on every
// rank: the scores come from the same rows) and the sparse loss.
TEST(TensorParallel, DsaIndexerFollowsTheSingleRankRun) {
    g_dsa = true;
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, true, true, 0, true);
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(2, 2, true, true, true, 0, true);
    }
    g_dsa = false;
    if (g_mpi->world_size() != 2 && g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 2 and 4 ranks";
}

// Muon (optim/muon.h) orthogonalizes each whole matrix: the TP shards of the column-parallel QKV (its Q, K and
// V blocks apart, GQA's two groups split over the ranks) and fc1, the row-parallel projections' column shards,
// are gathered first, so every layout takes the single rank's update. TP 2 + SP; TP 2 + SP x DP 2 with ZeRO-1
// (each matrix's momentum pieces summed over DP before the gather); the DeepSeek-style model's MLA
// projections and MTP depth under TP 2 + SP x PP 2.
TEST(TensorParallel, MuonFollowsTheSingleRankRun) {
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, true, true, 0, false, true);
    } else if (g_mpi->world_size() == 4) {
        expect_follows_reference(2, 1, true, true, true, 0, false, true);
        expect_follows_reference(2, 2, true, true, true, 0, true, true);
    } else {
        GTEST_SKIP() << "runs with 2 and 4 ranks";
    }
}

// Qwen3-Next's gated delta-net split by heads (each of the input projection's six blocks by rows, the convolution's
// channels, A_log and dt_bias by value heads, the output projection by columns), its gated norm whole on every rank
// (its gradient summed over the group), beside gated softmax attention: TP 2 + SP, with --recompute-modules
// layernorm and mlp (the input projection's input set again from the recomputed norm's gathered rows); and TP 2 + SP
// x PP 2 with ZeRO-1.
TEST(TensorParallel, GatedDeltaNetFollowsTheSingleRankRun) {
    if (g_mpi->world_size() == 2) {
        expect_follows_reference(2, 1, false, true, true, 0, false, false, false, true);
        expect_follows_reference(2, 1, false, true, true, 2, false, false, false, true);
    } else if (g_mpi->world_size() == 4) {   // TP 2 + SP x PP 2 with ZeRO-1: a gated delta-net layer on each stage
        expect_follows_reference(2, 2, true, true, true, 0, false, false, false, true);
    } else {
        GTEST_SKIP() << "runs with 2 and 4 ranks";
    }
}

TEST(TensorParallel, TpTimesDpAndTpTimesPpFollowTheSingleRankRun) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 4 ranks";
    expect_follows_reference(2, 1, false, false);   // TP 2 x DP 2
    expect_follows_reference(2, 2, false, true);    // TP 2 x PP 2, Llama-style
}

TEST(TensorParallel, TpPpDpWithTheDistributedOptimizerFollowsTheSingleRankRun) {
    if (g_mpi->world_size() != 8) GTEST_SKIP() << "runs with 8 ranks";
    expect_follows_reference(2, 2, true, false);   // TP 2 x PP 2 x DP 2
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
