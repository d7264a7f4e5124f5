// Checkpoints end to end through `loom train` (one rank, or under mpirun): a resume continues bitwise, a
// checkpoint reshards across DP, TP and PP, a kill at any point of a save leaves the previous checkpoint
// loadable, SIGTERM and --exit-interval stop with a checkpoint, and corrupt checkpoints are refused naming
// the file.
#include "checkpoint/checkpoint.h"
#include "core/crc32c.h"

#include "loom_cli_runner.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <chrono>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <functional>
#include <iterator>
#include <limits>
#include <numeric>
#include <random>
#include <regex>
#include <set>
#include <sys/wait.h>
#include <thread>
#include <unistd.h>

using namespace loom;
namespace fs = std::filesystem;
using json   = nlohmann::json;

namespace {

// A fresh folder under the system's temporary folder, removed at the end of the test.
class TempDir {
public:
    TempDir() {
        std::string pattern = (fs::temp_directory_path() / "loom_ckpt_XXXXXX").string();
        path_               = mkdtemp(pattern.data());
    }
    ~TempDir() { fs::remove_all(path_); }
    std::string operator/(const std::string & name) const { return (fs::path(path_) / name).string(); }

private:
    std::string path_;
};

CliRun run_on(int np, const std::string & args, const std::string & env = "") { return run_loom_mpi(np, args, env); }

// iteration -> lm loss of a --log-file.
std::map<int64_t, double> losses(const std::string & log_file) {
    std::map<int64_t, double> out;
    std::ifstream             in(log_file);
    for (std::string line; std::getline(in, line);) {
        json j = json::parse(line);
        out[j["iteration"].get<int64_t>()] = j["lm loss"].get<double>();
    }
    return out;
}

// A model smaller than the default gpt-tiny (hidden 64, sequence 32): checkpoints behave the same at any
// size, and each run here takes a tenth of the time.
const std::string kModel = "--hidden-size 64 --num-attention-heads 4 --seq-length 32 ";
const std::string kRun   = "train --mock-data --train-iters 20 --lr-warmup-iters 2 --log-interval 1 " + kModel;

std::string tracker(const std::string & dir) {
    std::ifstream in(fs::path(dir) / checkpoint::kTrackerFile);
    std::string   s;
    in >> s;
    return s;
}

}  // namespace

TEST(Crc32c, MatchesTheCastagnoliCheckValue) {
    const char * text = "123456789";
    EXPECT_EQ(crc32c(text, 9), 0xE3069283u) << "the standard check value of CRC-32C";
    // Streaming in pieces gives the same CRC as one call.
    EXPECT_EQ(crc32c(text + 4, 5, crc32c(text, 4)), 0xE3069283u);
    std::vector<uint8_t> zeros(32, 0);
    EXPECT_EQ(crc32c(zeros.data(), zeros.size()), 0x8A9136AAu) << "32 zero bytes (RFC 3720 B.4)";
}

// Train 12 iterations saving at 6; a fresh process resumes from 6: iterations 7-12 print bitwise the same
// losses and end with bitwise the same parameters and optimizer state. (Six steps after the save: a missing
// piece of state shows at the first.)
struct ResumeCase {
    const char * name;
    int          np;
    const char * args;
};

class ResumeIsBitwise : public ::testing::TestWithParam<ResumeCase> {};

TEST_P(ResumeIsBitwise, LossesAndFinalStateMatchTheUninterruptedRun) {
    const ResumeCase & c = GetParam();
    TempDir            tmp;
    const std::string  run = kRun + c.args + " --train-iters 12";
    CliRun a = run_on(c.np, run + " --save " + (tmp / "a") + " --save-interval 6 --log-file " + (tmp / "a.jsonl"));
    ASSERT_EQ(a.status, 0) << a.out;
    CliRun b = run_on(c.np, run + " --load " + (tmp / "a") + " --ckpt-step 6 --save " + (tmp / "b") + " --log-file " +
                              (tmp / "b.jsonl"));
    ASSERT_EQ(b.status, 0) << b.out;
    EXPECT_NE(b.out.find("successfully loaded checkpoint"), std::string::npos) << b.out;
    std::map<int64_t, double> la = losses(tmp / "a.jsonl"), lb = losses(tmp / "b.jsonl");
    ASSERT_EQ(la.size(), 12u);
    ASSERT_EQ(lb.size(), 6u) << "the resumed run trains iterations 7-12";
    for (int64_t k = 7; k <= 12; ++k) EXPECT_EQ(la.at(k), lb.at(k)) << "iteration " << k;   // bitwise

    checkpoint::Index ia = checkpoint::read_index(tmp / "a/iter_0000012");
    checkpoint::Index ib = checkpoint::read_index(tmp / "b/iter_0000012");
    // Every iteration steps, but those a loss scaler skipped (overflows): the same ones in both runs.
    const bool scaled = std::string(c.args).find("--fp16") != std::string::npos;
    if (!scaled) EXPECT_EQ(ia.optimizer_step, 12);
    EXPECT_GE(ia.optimizer_step, 6);
    EXPECT_EQ(ib.optimizer_step, ia.optimizer_step);
    EXPECT_EQ(ib.metadata["consumed_train_samples"], ia.metadata["consumed_train_samples"]);
    EXPECT_EQ(ib.metadata.value("grad_scaler", nlohmann::json()), ia.metadata.value("grad_scaler", nlohmann::json()));
    EXPECT_EQ(scaled, ia.metadata.contains("grad_scaler"));
    ASSERT_EQ(ia.tensors.size(), ib.tensors.size());
    for (const auto & [name, t] : ia.tensors) {
        // A buffer (the routers' expert biases, delayed FP8's histories and scales) has values only.
        const bool buffer = (name.size() > 12 && name.compare(name.size() - 12, 12, ".expert_bias") == 0) ||
                            name.find(".fp8_") != std::string::npos;
        std::vector<std::string> kinds  = {"values"};
        if (!buffer) kinds.insert(kinds.end(), {"exp_avg", "exp_avg_sq"});
        if (t.dtype != "F32") kinds.push_back("master");
        for (const std::string & kind : kinds) {
            std::vector<float> x = checkpoint::read_tensor(ia, name, kind), y = checkpoint::read_tensor(ib, name, kind);
            ASSERT_EQ(x.size(), y.size());
            EXPECT_EQ(std::memcmp(x.data(), y.data(), x.size() * sizeof(float)), 0) << name << " " << kind;
        }
    }
}

// Adam's moments are not Muon's momentum: loading one optimizer's state into the other is refused naming
// both, and --no-load-optim starts the new one's state from the checkpoint's weights.
TEST(Checkpoint, AnotherOptimizersStateIsRefused) {
    TempDir           tmp;
    const std::string run = "train --mock-data --train-iters 4 --log-interval 1 " + kModel;
    ASSERT_EQ(run_on(1, run + " --save " + (tmp / "a") + " --save-interval 4").status, 0);
    const CliRun refused = run_on(1, run + " --load " + (tmp / "a") + " --optimizer muon --train-iters 6 --override-opt_param-scheduler");
    EXPECT_NE(refused.status, 0);
    EXPECT_NE(refused.out.find("--optimizer muon: checkpoint"), std::string::npos) << refused.out;
    EXPECT_NE(refused.out.find("holds the state of --optimizer adam"), std::string::npos) << refused.out;
    const CliRun fresh = run_on(1, run + " --load " + (tmp / "a") + " --optimizer muon --train-iters 6 --no-load-optim");
    EXPECT_EQ(fresh.status, 0) << fresh.out;
}

// A checkpoint without delayed FP8's state (saved with tensorwise scaling) loads into a delayed run, whose
// histories and scales start afresh, and says so; the other way round, the state is left unread.
TEST(Checkpoint, DelayedFp8StateStartsAfreshWhereTheCheckpointHasNone) {
    TempDir           tmp;
    const std::string run = "train --mock-data --log-interval 1 " + kModel + "--fp8-format hybrid ";
    ASSERT_EQ(run_on(1, run + "--fp8-recipe tensorwise --train-iters 2 --save " + (tmp / "a") + " --save-interval 2").status, 0);
    const CliRun delayed = run_on(1, run + "--fp8-recipe delayed --train-iters 3 --override-opt_param-scheduler --load " + (tmp / "a") +
                                         " --save " + (tmp / "b") + " --save-interval 3");
    ASSERT_EQ(delayed.status, 0) << delayed.out;
    EXPECT_NE(delayed.out.find("holds no delayed FP8 state"), std::string::npos) << delayed.out;
    EXPECT_EQ(checkpoint::read_index(tmp / "b/iter_0000003").tensors.count("layers.0.fp8_forward_scale"), 1u);
    const CliRun back = run_on(1, run + "--fp8-recipe tensorwise --train-iters 4 --override-opt_param-scheduler --load " + (tmp / "b"));
    EXPECT_EQ(back.status, 0) << back.out;
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, ResumeIsBitwise,
    ::testing::Values(
        ResumeCase{"single_f32", 1, ""}, ResumeCase{"single_bf16", 1, "--bf16"},
        ResumeCase{"dp2_zero1_overlaps", 2,
                   "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather --ddp-bucket-size 100000"},
        ResumeCase{"pp2_vpp2", 2, "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2 "
                                  "--global-batch-size 16"},
        // With learnable attention sinks and the output gate: each TP rank's heads' softmax_offset and gate rows of
        // QKV, and their Adam state, come back; and on every other layer the gated delta-net's (its input projection's
        // six blocks, taps, A_log and dt_bias by heads, the gated norm whole).
        ResumeCase{"tp2_sp_sinks_gate_gdn", 2,
                   "--tensor-model-parallel-size 2 --sequence-parallel --softmax-type learnable --attention-output-gate "
                   "--experimental-attention-variant gated_delta_net --linear-attention-freq 2 --linear-num-key-heads 2 "
                   "--linear-num-value-heads 4 --linear-key-head-dim 16 --linear-value-head-dim 16"},
        // DeepSeek-V3's router and an MTP depth: the expert biases (moved every iteration; the MTP layer's
        // router's among them) and the depth's weights come back from the checkpoint.
        ResumeCase{"tp2_sp_moe_expert_bias_mtp", 2,
                   "--tensor-model-parallel-size 2 --sequence-parallel --num-experts 4 --disable-bias-linear "
                   "--position-embedding-type rope --mtp-num-layers 1 "
                   "--moe-router-score-function sigmoid --moe-router-enable-expert-bias --moe-router-bias-update-rate 1e-2 "
                   "--moe-router-num-groups 2 --moe-router-group-topk 1"},
        // DeepSeek Sparse Attention: each MLA layer's indexer (wq_b, wk, its key norm, weights_proj) and its Adam state
        // come back, and the indexer's loss and its selection (each row's top 16 of 32 keys, every other layer taking
        // the one before's) continue; under delayed FP8, the indexer's projections' slots of the layers' amax
        // histories too.
        ResumeCase{"single_dsa_fp8_delayed", 1,
                   "--multi-latent-attention --q-lora-rank 32 --kv-lora-rank 16 --qk-head-dim 16 --qk-pos-emb-head-dim 8 "
                   "--v-head-dim 16 --disable-bias-linear --experimental-attention-variant dsa --dsa-indexer-n-heads 16 "
                   "--dsa-indexer-head-dim 16 --dsa-indexer-topk 16 --dsa-indexer-topk-freq 2 --dsa-indexer-loss-coeff 1.0 "
                   "--bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4"},
        // Muon's momentum (the matrices' exp_avg) sharded by ZeRO-1 over DP 2, bf16 with its masters.
        ResumeCase{"dp2_zero1_muon_bf16", 2, "--optimizer muon --use-distributed-optimizer --bf16"},
        ResumeCase{"offload_half", 1, "--use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5"},
        // The dynamic loss scale halves and doubles within the run (a window of 3): the resume must bring
        // back its trackers as well as its scale to continue bitwise.
        ResumeCase{"dp2_zero1_fp16_dynamic_scale", 2,
                   "--use-distributed-optimizer --fp16 --initial-loss-scale 262144 --loss-scale-window 3"},
        // FP8 codes under Megatron-FSDP (each unit gathered from the shards' codes): the f32 main values come
        // back as the weights' values and every shard is encoded again before a unit is gathered.
        ResumeCase{"dp2_fsdp_fp8_codes_moe", 2,
                   "--use-megatron-fsdp --overlap-grad-reduce --overlap-param-gather --bf16 --fp8-format hybrid "
                   "--fp8-recipe tensorwise --fp8-param-gather --num-experts 4 --moe-grouped-gemm --disable-bias-linear"},
        // Delayed FP8 with the experts split over EP 2: every layer's amax histories and scales (one per global
        // expert, reduced over the ranks) come back, and the casts after the resume use them.
        ResumeCase{"dp2_ep2_fp8_delayed_moe", 2,
                   "--expert-model-parallel-size 2 --bf16 --fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 "
                   "--fp8-amax-compute-algo max --num-experts 4 --moe-grouped-gemm --disable-bias-linear"},
        ResumeCase{"dp2_zero1_offload_half_bf16", 2,
                   "--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5 "
                   "--overlap-cpu-optimizer-d2h-h2d --bf16"}),
    [](const ::testing::TestParamInfo<ResumeCase> & info) { return std::string(info.param.name); });

// Delayed FP8 scaling under TP 2 + SP against one rank, the same micro-batches: each layer's amaxes are reduced
// over the TP ranks (a split weight's shards, a split gradient's columns), so both form the same scales. The
// first two iterations agree within 1e-6 relative: the first casts by 1 everywhere, the second by the first's
// amaxes, which a rank's shard alone would not give. Later ones within 2e-3 (f32: a sum's order moves a value
// across an FP8 rounding boundary now and then, and training carries it on).
TEST(Fp8DelayedScaling, TensorParallelRunFollowsTheSingleRank) {
    TempDir           tmp;
    const std::string run = kRun + "--fp8-format hybrid --fp8-recipe delayed --fp8-amax-history-len 4 --fp8-amax-compute-algo max "
                                   "--position-embedding-type rope --disable-bias-linear ";
    ASSERT_EQ(run_on(1, run + "--log-file " + (tmp / "one.jsonl")).status, 0);
    const CliRun tp = run_on(2, run + "--tensor-model-parallel-size 2 --sequence-parallel --log-file " + (tmp / "tp.jsonl"));
    ASSERT_EQ(tp.status, 0) << tp.out;
    const std::map<int64_t, double> one = losses(tmp / "one.jsonl"), two = losses(tmp / "tp.jsonl");
    ASSERT_EQ(one.size(), 20u);
    ASSERT_EQ(two.size(), 20u);
    double worst = 0;
    for (int64_t k = 1; k <= 20; ++k) {
        const double rel = std::fabs(two.at(k) - one.at(k)) / one.at(k);
        worst            = std::max(worst, rel);
        EXPECT_LT(rel, k <= 2 ? 1e-6 : 2e-3) << "iteration " << k;
    }
    std::printf("[fp8 delayed, tp 2 + sp] worst relative loss error %.3g\n", worst);
}

// Saved under one layout at iteration 6 and resumed under another: iterations 7-12 match the run that never
// changed layout within 1e-5 relative (f32; the sums only regroup).
struct ReshardCase {
    const char * name;
    int          save_np;
    const char * save_args;
    int          load_np;
    const char * load_args;
};

class Reshard : public ::testing::TestWithParam<ReshardCase> {};

TEST_P(Reshard, ContinuesTheLossCurve) {
    const ReshardCase & c = GetParam();
    TempDir             tmp;
    const std::string   run = kRun + "--global-batch-size 16 --train-iters 12 ";
    CliRun a = run_on(c.save_np, run + c.save_args + " --save " + (tmp / "a") + " --save-interval 6 --log-file " +
                                   (tmp / "a.jsonl"));
    ASSERT_EQ(a.status, 0) << a.out;
    CliRun b = run_on(c.load_np, run + c.load_args + " --load " + (tmp / "a") + " --ckpt-step 6 --log-file " +
                                   (tmp / "b.jsonl"));
    ASSERT_EQ(b.status, 0) << b.out;
    std::map<int64_t, double> la = losses(tmp / "a.jsonl"), lb = losses(tmp / "b.jsonl");
    ASSERT_EQ(lb.size(), 6u) << b.out;
    for (int64_t k = 7; k <= 12; ++k) {
        EXPECT_NEAR(lb.at(k), la.at(k), 1e-5 * std::abs(la.at(k))) << "iteration " << k;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Reshard,
    ::testing::Values(
        ReshardCase{"dp2_zero1_to_1", 2, "--use-distributed-optimizer --overlap-grad-reduce --ddp-bucket-size 100000",
                    1, ""},
        ReshardCase{"tp2_to_1", 2, "--tensor-model-parallel-size 2 --sequence-parallel", 1, ""},
        ReshardCase{"pp2_vpp2_to_1", 2, "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2", 1,
                    ""},
        ReshardCase{"1_to_dp2_zero1", 1, "", 2, "--use-distributed-optimizer"},
        ReshardCase{"1_to_tp2", 1, "", 2, "--tensor-model-parallel-size 2"},
        ReshardCase{"1_to_pp2", 1, "", 2, "--pipeline-model-parallel-size 2"},
        // Context parallelism holds whole weights on every CP rank; ZeRO-1 shards over dp x cp.
        ReshardCase{"cp2_zero1_to_1", 2, "--context-parallel-size 2 --use-distributed-optimizer", 1, ""},
        ReshardCase{"1_to_cp2_a2a", 1, "", 2, "--context-parallel-size 2 --cp-comm-type a2a"},
        // Megatron-FSDP's shards (values, gradients and optimizer state by module) to ZeRO-1 and back, and
        // the hybrid optimizer over FSDP shards to one rank.
        ReshardCase{"fsdp_to_zero1", 2, "--use-megatron-fsdp", 2, "--use-distributed-optimizer"},
        ReshardCase{"zero1_to_fsdp_optim_grads", 2, "--use-distributed-optimizer", 2,
                    "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"},
        ReshardCase{"fsdp_offload_to_1", 2,
                    "--use-megatron-fsdp --use-precision-aware-optimizer --optimizer-cpu-offload --optimizer-offload-fraction 0.5",
                    1, ""},
        ReshardCase{"tp2_pp2_to_dp2_offload", 4,
                    "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2 --use-distributed-optimizer", 2,
                    "--use-distributed-optimizer --use-precision-aware-optimizer --optimizer-cpu-offload "
                    "--optimizer-offload-fraction 0.3"}),
    [](const ::testing::TestParamInfo<ReshardCase> & info) { return std::string(info.param.name); });

// SIGKILL at each of the 9 points inside a save (the LOOM_CHECKPOINT_KILL_AT seam), each in a save drawn at
// random among the run's 6; each time the tracker names the last complete checkpoint, and resuming from it
// continues bitwise. With --async-save the points of the shard's writing fall on the writer thread while
// training goes on, and those of the commit at a later iteration: the same guarantee.
class CheckpointKill : public ::testing::TestWithParam<const char *> {};

TEST_P(CheckpointKill, AnyPointOfASaveLeavesTheLastCompleteCheckpoint) {
    TempDir           tmp;
    const std::string run = "train --mock-data --train-iters 12 --lr-warmup-iters 2 --log-interval 1 --save-interval 2 " +
                            kModel + GetParam();
    CliRun            ref = run_loom(run + "--save " + (tmp / "ref") + " --log-file " + (tmp / "ref.jsonl"));
    ASSERT_EQ(ref.status, 0) << ref.out;
    std::map<int64_t, double> expected = losses(tmp / "ref.jsonl");
    constexpr int kPointsPerSave = 9, kSaves = 6;
    std::mt19937  rng(20261123);
    std::vector<int> points;
    for (int within = 1; within <= kPointsPerSave; ++within) {
        points.push_back(static_cast<int>(rng() % kSaves) * kPointsPerSave + within);
    }
    for (int point : points) {
        SCOPED_TRACE("killed at point " + std::to_string(point));
        const std::string dir = tmp / ("k" + std::to_string(point));
        const std::string command = "LOOM_CHECKPOINT_KILL_AT=" + std::to_string(point) + " " + LOOM_CLI_PATH + " " +
                                    run + "--save " + dir + " >/dev/null 2>&1";
        EXPECT_NE(std::system(command.c_str()), 0) << "the seam must have killed the run";
        const int save = (point - 1) / kPointsPerSave + 1, within = (point - 1) % kPointsPerSave + 1;
        const int last = within == kPointsPerSave ? 2 * save : 2 * (save - 1);   // the last complete checkpoint
        if (last == 0) {
            EXPECT_FALSE(fs::exists(fs::path(dir) / checkpoint::kTrackerFile));
        } else {
            EXPECT_EQ(tracker(dir), std::to_string(last));
        }
        CliRun resumed = run_loom(run + "--load " + dir + " --save " + dir + " --log-file " + dir + ".jsonl");
        ASSERT_EQ(resumed.status, 0) << resumed.out;
        std::map<int64_t, double> got = losses(dir + ".jsonl");
        ASSERT_EQ(got.size(), static_cast<size_t>(12 - last)) << resumed.out;
        for (auto [k, loss] : got) EXPECT_EQ(loss, expected.at(k)) << "iteration " << k;
        EXPECT_EQ(tracker(dir), "12");
        for (const fs::directory_entry & e : fs::directory_iterator(dir)) {
            if (e.path().filename() == checkpoint::kSaveLockFile) continue;   // the folder's lock stays by design
            EXPECT_EQ(e.path().extension(), e.is_directory() ? "" : ".txt") << e.path() << " left behind";
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Saves, CheckpointKill, ::testing::Values("", "--async-save "),
                         [](const ::testing::TestParamInfo<const char *> & info) {
                             return std::string(info.param[0] ? "async" : "sync");
                         });

// --async-save: training goes on while a checkpoint is written (the LOOM_CHECKPOINT_WRITE_DELAY_MS seam holds
// the writer): iterations are logged between a save's start and its commit, the commit comes at a later
// iteration's check, and the checkpoint holds the state of the iteration it was taken at (its resume
// continues bitwise, on two data-parallel ranks with ZeRO-1).
TEST(CheckpointAsync, TrainingGoesOnWhileTheSnapshotIsWritten) {
    TempDir           tmp;
    const std::string run = kRun + "--use-distributed-optimizer --save-interval 10 ";
    CliRun ref = run_on(2, run + "--save " + (tmp / "ref") + " --log-file " + (tmp / "ref.jsonl"));
    ASSERT_EQ(ref.status, 0) << ref.out;
    CliRun slow = run_on(2, run + "--async-save --save " + (tmp / "async") + " --log-file " + (tmp / "async.jsonl"),
                         "LOOM_CHECKPOINT_WRITE_DELAY_MS=300");
    ASSERT_EQ(slow.status, 0) << slow.out;
    const size_t began = slow.out.find("saving checkpoint at iteration      10");
    const size_t done  = slow.out.find("successfully saved checkpoint from iteration      10");
    ASSERT_NE(began, std::string::npos) << slow.out;
    ASSERT_NE(done, std::string::npos) << slow.out;
    const size_t eleventh = slow.out.find("iteration       11/", began);
    EXPECT_LT(eleventh, done) << "iteration 11 ran while iteration 10's checkpoint was written\n" << slow.out;
    EXPECT_EQ(losses(tmp / "async.jsonl"), losses(tmp / "ref.jsonl")) << "saving does not change the run";
    CliRun resumed = run_on(2, run + "--load " + (tmp / "async") + " --ckpt-step 10 --log-file " + (tmp / "resumed.jsonl"));
    ASSERT_EQ(resumed.status, 0) << resumed.out;
    std::map<int64_t, double> want = losses(tmp / "ref.jsonl"), got = losses(tmp / "resumed.jsonl");
    ASSERT_EQ(got.size(), 10u);
    for (auto [k, loss] : got) EXPECT_EQ(loss, want.at(k)) << "iteration " << k;
    EXPECT_EQ(tracker(tmp / "async"), "20");
}

// Starts `argv` (stdout and stderr discarded) training with --log-interval 1 into `log`, sends it `signal`
// once 3 iterations are logged, and returns (how many had been logged, its wait status); `logged` 0: it did
// not start.
static std::pair<size_t, int> signal_when_running(std::vector<std::string> argv, const std::string & log, int signal) {
    pid_t pid = fork();
    if (pid == 0) {
        int null = open("/dev/null", O_WRONLY);
        dup2(null, 1);
        dup2(null, 2);
        std::vector<char *> args;
        for (std::string & a : argv) args.push_back(a.data());
        args.push_back(nullptr);
        execv(args[0], args.data());
        _exit(127);
    }
    size_t logged = 0;
    for (int wait = 0; wait < 600 && logged < 3; ++wait) {
        std::this_thread::sleep_for(std::chrono::milliseconds(50));
        logged = losses(log).size();
    }
    kill(pid, logged < 3 ? SIGKILL : signal);
    int status = 0;
    waitpid(pid, &status, 0);
    return {logged < 3 ? 0 : logged, status};
}

// --exit-signal-handler: SIGTERM finishes the iteration in flight, saves and exits 0.
TEST(CheckpointExit, SigtermSavesAndExitsZero) {
    TempDir     tmp;
    std::string dir = tmp / "d", log = tmp / "log.jsonl";
    const auto [logged, status] = signal_when_running(
        {LOOM_CLI_PATH, "train", "--mock-data", "--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler",
         "--save", dir, "--log-file", log},
        log, SIGTERM);
    ASSERT_GE(logged, 3u) << "the run did not start";
    ASSERT_TRUE(WIFEXITED(status)) << "killed by the signal instead of handling it";
    EXPECT_EQ(WEXITSTATUS(status), 0);
    const int64_t saved = std::stoll(tracker(dir));
    EXPECT_GE(saved, static_cast<int64_t>(logged));
    EXPECT_LE(saved, static_cast<int64_t>(logged) + 2) << "stopped within the iteration in flight";
    EXPECT_EQ(losses(log).rbegin()->first, saved) << "the last iteration trained is the one saved";
}

// Under mpirun, a SIGTERM sent to mpirun ends the job (Open MPI's rule, exit 1 whatever the ranks do), and
// Open MPI does not forward it; it does forward SIGUSR1. With --exit-signal SIGUSR1, the launcher's signal
// reaches every rank, which finish the iteration, save together and exit 0, and so does mpirun.
TEST(CheckpointExit, ExitSignalSentToMpirunSavesAndExitsZero) {
    TempDir     tmp;
    std::string dir = tmp / "d", log = tmp / "log.jsonl";
    const auto [logged, status] = signal_when_running(
        {LOOM_MPIEXEC, "--oversubscribe", "-np", "2", LOOM_CLI_PATH, "train", "--mock-data", "--num-layers", "1",
         "--train-iters", "100000", "--log-interval", "1", "--exit-signal-handler", "--exit-signal", "SIGUSR1",
         "--save", dir, "--log-file", log},
        log, SIGUSR1);
    ASSERT_GE(logged, 3u) << "the run did not start";
    ASSERT_TRUE(WIFEXITED(status)) << "mpirun was killed by the signal";
    EXPECT_EQ(WEXITSTATUS(status), 0);
    const int64_t saved = std::stoll(tracker(dir));
    EXPECT_GE(saved, static_cast<int64_t>(logged));
    EXPECT_EQ(losses(log).rbegin()->first, saved) << "the last iteration trained is the one saved";
}

// A --save folder is one job's: this process holds the lock as a running job's rank 0 does, and loom train
// saving there, on one rank or two, is refused before it trains, naming the holder; once the holder ends,
// the same run saves.
TEST(CheckpointSaveLock, ASecondJobSavingIntoTheFolderIsRefusedNamingTheHolder) {
    TempDir           tmp;
    const std::string dir = tmp / "shared";
    const std::string run = kRun + "--train-iters 3 --save " + dir;
    {
        checkpoint::SaveFolderLock held(dir);
        EXPECT_THROW(checkpoint::SaveFolderLock again(dir), Error) << "a lock conflicts with another of the same process";
        const std::string holder = "--save folder '" + dir + "' is held by another job (pid " + std::to_string(getpid()) + " on ";
        for (int np : {1, 2}) {
            const CliRun r = run_on(np, run);
            EXPECT_EQ(r.status, 2) << r.out;
            EXPECT_NE(r.out.find(holder), std::string::npos) << r.out;
            EXPECT_EQ(r.out.find("iteration "), std::string::npos) << "np " << np << " trained\n" << r.out;
        }
        EXPECT_FALSE(fs::exists(fs::path(dir) / checkpoint::kTrackerFile));
    }
    const CliRun r = run_loom(run);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(tracker(dir), "3");
}

TEST(CheckpointExit, ExitIntervalStopsThereAfterSaving) {
    TempDir tmp;
    CliRun  r = run_loom(kRun + "--exit-interval 7 --save " + (tmp / "d") + " --log-file " + (tmp / "l.jsonl"));
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("exiting program at iteration 7"), std::string::npos) << r.out;
    EXPECT_EQ(tracker(tmp / "d"), "7");
    EXPECT_EQ(losses(tmp / "l.jsonl").size(), 7u);
}

// --save-retain-interval 4 with --save-interval 2 over 12 iterations: the checkpoints of 4, 8 and 12 (the
// latest) stay, each other one is removed by the save after it; a retain interval that is not a multiple of
// the save interval is refused (Megatron's assert).
TEST(CheckpointRetention, OnlyMultiplesOfTheRetainIntervalAndTheLatestStay) {
    TempDir tmp;
    CliRun  r = run_loom(kRun + "--train-iters 12 --save-interval 2 --save-retain-interval 4 --save " + (tmp / "d"));
    ASSERT_EQ(r.status, 0) << r.out;
    std::set<std::string> kept;
    for (const auto & e : fs::directory_iterator(tmp / "d")) {
        if (e.path().filename().string().rfind("iter_", 0) == 0) kept.insert(e.path().filename().string());
    }
    EXPECT_EQ(kept, (std::set<std::string>{"iter_0000004", "iter_0000008", "iter_0000012"}));
    EXPECT_EQ(tracker(tmp / "d"), "12");
    CliRun resumed = run_loom(kRun + "--train-iters 12 --load " + (tmp / "d") + " --ckpt-step 8");
    EXPECT_EQ(resumed.status, 0) << "a retained checkpoint loads\n" << resumed.out;
    CliRun bad = run_loom(kRun + "--save-interval 2 --save-retain-interval 3 --save " + (tmp / "e"));
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("--save-retain-interval 3 is not a multiple of --save-interval 2"), std::string::npos) << bad.out;
}

TEST(CheckpointExit, ExitDurationStopsAfterTheFirstIterationPastIt) {
    TempDir tmp;
    CliRun  r = run_loom(kRun + "--exit-duration-in-mins 0.00001 --save " + (tmp / "d"));
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("exiting program at iteration 1 (--exit-duration-in-mins)"), std::string::npos) << r.out;
    EXPECT_EQ(tracker(tmp / "d"), "1");
}

// --no-save-optim writes the parameters only; loading it (or any checkpoint with --no-load-optim) resumes
// the iteration and samples with a fresh Adam state over the loaded values.
TEST(CheckpointLoad, ParametersOnlyCheckpointsResumeWithAFreshOptimizer) {
    TempDir tmp;
    ASSERT_EQ(run_loom(kRun + "--train-iters 4 --bf16 --no-save-optim --save " + (tmp / "p")).status, 0);
    checkpoint::Index index = checkpoint::read_index(tmp / "p/iter_0000004");
    EXPECT_FALSE(index.has_optimizer);
    CliRun info = run_loom("checkpoint info " + (tmp / "p"));
    EXPECT_NE(info.out.find("optimizer state not saved"), std::string::npos) << info.out;
    for (const char * flags : {"", "--no-load-optim"}) {
        const std::string save = tmp / (std::string("r") + (flags[0] ? "1" : "0"));
        CliRun r = run_loom(kRun + "--train-iters 6 --bf16 --load " + (tmp / "p") + " --save " + save + " " + flags);
        ASSERT_EQ(r.status, 0) << r.out;
        EXPECT_NE(r.out.find("iteration        5/       6"), std::string::npos) << r.out;
        EXPECT_EQ(checkpoint::read_index(save + "/iter_0000006").optimizer_step, 2) << "two steps after the load";
    }
}

TEST(CheckpointLoad, MissingTrackerTrainsFromScratchAndFinetuneRestartsTheCount) {
    TempDir tmp;
    fs::create_directories(tmp / "empty");
    CliRun scratch = run_loom(kRun + "--train-iters 3 --load " + (tmp / "empty"));
    ASSERT_EQ(scratch.status, 0) << scratch.out;
    EXPECT_NE(scratch.out.find("training from scratch"), std::string::npos) << scratch.out;
    ASSERT_EQ(run_loom(kRun + "--train-iters 4 --save " + (tmp / "a")).status, 0);
    CliRun fine = run_loom(kRun + "--train-iters 3 --finetune --load " + (tmp / "a"));
    ASSERT_EQ(fine.status, 0) << fine.out;
    EXPECT_NE(fine.out.find("iteration        1/       3"), std::string::npos) << "finetune starts at iteration 1";
    CliRun done = run_loom(kRun + "--train-iters 4 --load " + (tmp / "a"));
    ASSERT_EQ(done.status, 0) << done.out;
    EXPECT_NE(done.out.find("no iterations to run"), std::string::npos) << done.out;
}

// A checkpoint whose tensor `from` was renamed `to` in its index: the model's `from` is "unexpected" (asked
// for, absent), the checkpoint's `to` "missing" (there, used by no rank).
void rename_tensor(const std::string & folder, const std::string & from, const std::string & to) {
    const std::string path = folder + "/index.json";
    std::ifstream     in(path);
    json              j = json::parse(in);
    in.close();
    j["tensors"][to] = j["tensors"][from];
    j["tensors"].erase(from);
    std::ofstream(path) << j.dump();
}

// --dist-ckpt-strictness, each of Megatron's values. A final norm trained 4 iterations at --lr 2e-3 sits
// ~1e-3 away from its initial 1.0; resumed at --lr 1e-9 (--override-opt_param-scheduler) it keeps whatever
// the load gave it within 1e-6, so the saved values tell a loaded tensor from an unloaded one.
TEST(CheckpointStrictness, EachModeLogsRaisesOrIgnoresUnexpectedAndMissingTensors) {
    TempDir tmp;
    ASSERT_EQ(run_loom(kRun + "--train-iters 4 --save " + (tmp / "a")).status, 0);
    rename_tensor(tmp / "a/iter_0000004", "final_norm.weight", "final_norm.renamed");
    const std::string resume = kRun + "--train-iters 5 --lr 1e-9 --override-opt_param-scheduler --load " + (tmp / "a");

    CliRun strict = run_loom(resume);
    EXPECT_EQ(strict.status, 2) << strict.out;
    EXPECT_NE(strict.out.find("has no tensor final_norm.weight"), std::string::npos) << "the default\n" << strict.out;
    CliRun raise = run_loom(resume + " --dist-ckpt-strictness raise_unexpected");
    EXPECT_EQ(raise.status, 2) << raise.out;
    EXPECT_NE(raise.out.find("(unexpected): final_norm.weight"), std::string::npos) << raise.out;
    EXPECT_EQ(raise.out.find("(missing)"), std::string::npos) << "raise_unexpected does not look for missing ones";
    CliRun all = run_loom(resume + " --dist-ckpt-strictness raise_all");
    EXPECT_EQ(all.status, 2) << all.out;
    EXPECT_NE(all.out.find("(missing): final_norm.renamed"), std::string::npos) << all.out;

    for (const char * mode : {"log_all", "log_unexpected", "return_all", "ignore_all"}) {
        SCOPED_TRACE(mode);
        const std::string save = tmp / (std::string("b_") + mode);
        CliRun            r    = run_loom(resume + " --dist-ckpt-strictness " + mode + " --save " + save);
        ASSERT_EQ(r.status, 0) << r.out;
        const bool listed = std::string(mode) != "ignore_all";
        EXPECT_EQ(r.out.find("rank 0: --dist-ckpt-strictness " + std::string(mode) +
                             ": 1 tensor(s) of the model are not in") != std::string::npos, listed)
            << r.out;
        const bool missing_listed = std::string(mode) == "log_all" || std::string(mode) == "return_all";
        EXPECT_EQ(r.out.find("used by no rank's model (missing), not loaded: final_norm.renamed") != std::string::npos,
                  missing_listed)
            << r.out;
        checkpoint::Index before = checkpoint::read_index(tmp / "a/iter_0000004");
        checkpoint::Index after  = checkpoint::read_index(save + "/iter_0000005");
        for (float w : checkpoint::read_tensor(after, "final_norm.weight")) ASSERT_NEAR(w, 1.0f, 1e-6f) << "initial";
        const std::vector<float> loaded = checkpoint::read_tensor(before, "final_norm.bias");
        const std::vector<float> kept   = checkpoint::read_tensor(after, "final_norm.bias");
        double                   moved  = 0;
        for (size_t i = 0; i < loaded.size(); ++i) {
            ASSERT_NEAR(kept[i], loaded[i], 1e-6f) << "a tensor the checkpoint has is loaded";
            moved = std::max(moved, std::abs(static_cast<double>(loaded[i])));
        }
        EXPECT_GT(moved, 1e-4) << "the first run moved the bias away from its initial 0";
    }
}

// Under PP 2 the missing tensors are found over the world: rank 1's last layer is renamed, and rank 0
// reports it (one all-reduce), while rank 1 reports its own unexpected tensor.
TEST(CheckpointStrictness, MissingTensorsAreFoundAcrossPipelineStages) {
    TempDir           tmp;
    const std::string pp = kRun + "--pipeline-model-parallel-size 2 --num-layers 2 --train-iters 4 ";
    ASSERT_EQ(run_on(2, pp + "--save " + (tmp / "a")).status, 0);
    rename_tensor(tmp / "a/iter_0000004", "layers.1.mlp.fc2.bias", "layers.1.mlp.fc2.gone");
    CliRun r = run_on(2, pp + "--train-iters 5 --override-opt_param-scheduler --load " + (tmp / "a") +
                             " --dist-ckpt-strictness log_all");
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("rank 1: --dist-ckpt-strictness log_all: 1 tensor(s) of the model are not in"),
              std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("rank 0: --dist-ckpt-strictness"), std::string::npos) << "rank 0 holds layer 0 only\n" << r.out;
    EXPECT_NE(r.out.find("(missing), not loaded: layers.1.mlp.fc2.gone"), std::string::npos) << r.out;
}

// The schedule's state: saved with the optimizer, checked against the flags on --load as Megatron's
// OptimizerParamScheduler.load_state_dict, or taken from either side by its flags.
TEST(CheckpointScheduler, ResumeChecksTheFlagsOrTakesTheCheckpointsOrTheFlagsSchedule) {
    TempDir           tmp;
    const std::string run = kRun + "--train-iters 8 --lr-decay-style cosine --min-lr 1e-4 ";
    ASSERT_EQ(run_loom(run + "--save " + (tmp / "a") + " --save-interval 4 --log-file " + (tmp / "a.jsonl")).status, 0);
    const json saved = checkpoint::read_index(tmp / "a/iter_0000004").metadata["opt_param_scheduler"];
    EXPECT_EQ(saved["num_steps"], 4 * 8) << "4 iterations of 8 samples";
    EXPECT_EQ(saved["lr_decay_style"], "cosine");
    EXPECT_EQ(saved["lr_decay_steps"], 8 * 8);
    EXPECT_EQ(saved["lr_warmup_steps"], 2 * 8);
    EXPECT_FLOAT_EQ(saved["max_lr"].get<float>(), 2e-3f);

    auto lrs = [](const std::string & log) {
        std::map<int64_t, double> out;
        std::ifstream             in(log);
        for (std::string line; std::getline(in, line);) {
            const json j = json::parse(line);
            out[j["iteration"].get<int64_t>()] = j["learning rate"].get<double>();
        }
        return out;
    };
    const std::string from = " --load " + (tmp / "a") + " --ckpt-step 4";
    CliRun            differ = run_loom(kRun + "--train-iters 8 --lr 1e-3" + from);
    EXPECT_EQ(differ.status, 2) << differ.out;
    for (const char * line : {"learning rate (--lr): 0.001 in the flags, 0.002 in the checkpoint",
                              "learning rate decay style (--lr-decay-style): linear in the flags, cosine in the checkpoint",
                              "minimum learning rate (--min-lr): 0 in the flags, 0.0001 in the checkpoint"}) {
        EXPECT_NE(differ.out.find(line), std::string::npos) << line << "\n" << differ.out;
    }
    CliRun both = run_loom(run + "--override-opt_param-scheduler --use-checkpoint-opt_param-scheduler" + from);
    EXPECT_EQ(both.status, 2);
    EXPECT_NE(both.out.find("--override-opt_param-scheduler with --use-checkpoint-opt_param-scheduler"), std::string::npos);

    // The checkpoint's schedule, given other flags: iterations 5-8 at the first run's learning rates.
    CliRun use = run_loom(kRun + "--train-iters 8 --lr 1e-3 --use-checkpoint-opt-param-scheduler --log-file " +
                          (tmp / "use.jsonl") + from);
    ASSERT_EQ(use.status, 0) << use.out;
    const auto first = lrs(tmp / "a.jsonl"), taken = lrs(tmp / "use.jsonl");
    ASSERT_EQ(taken.size(), 4u);
    for (int64_t k = 5; k <= 8; ++k) EXPECT_EQ(taken.at(k), first.at(k)) << "iteration " << k;
    // The flags' schedule, continued from the checkpoint's step: warmup over 16 samples, then linear from
    // 1e-3 to 0 at 64.
    CliRun over = run_loom(kRun + "--train-iters 8 --lr 1e-3 --override-opt_param-scheduler --log-file " +
                           (tmp / "over.jsonl") + from);
    ASSERT_EQ(over.status, 0) << over.out;
    const auto overridden = lrs(tmp / "over.jsonl");
    for (int64_t k = 5; k <= 8; ++k) {
        EXPECT_NEAR(overridden.at(k), 1e-3 * (1.0 - (8.0 * k - 16.0) / 48.0), 1e-9) << "iteration " << k;
    }
}

// --rerun-mode under PP 2: only the last stage validates a loss (rate 1 injects a persistent error at
// iteration 2); the first stage reruns with it, both save iteration 1 and exit 16; resumed on "another node"
// the last stage reports the persistent error and both exit 17 (Megatron's statuses, train/rerun.h).
TEST(CheckpointRerun, PipelineStagesRerunAndExitTogether) {
    TempDir           tmp;
    const std::string pp = "train --mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                           "--micro-batch-size 2 --global-batch-size 4 --train-iters 6 --log-interval 1 "
                           "--pipeline-model-parallel-size 2 --error-injection-rate 1 --error-injection-type "
                           "persistent_error --save " + (tmp / "s");
    CliRun staged = run_on(2, pp);
    EXPECT_EQ(staged.status, 16) << staged.out;
    const nlohmann::json saved = checkpoint::read_index(tmp / "s/iter_0000001").metadata["rerun_state_machine"];
    ASSERT_EQ(saved["ranks"].size(), 2u) << saved.dump();
    EXPECT_EQ(saved["ranks"][1]["state"], "will_rerun_from_checkpoint");
    EXPECT_EQ(saved["ranks"][1]["failed_validation_call"]["message"], "found NaN in local forward loss calculation");
    EXPECT_EQ(saved["ranks"][0]["failed_validation_call"]["message"], "") << "the first stage validates no loss";
    CliRun same = run_on(2, pp + " --load " + (tmp / "s"));
    EXPECT_EQ(same.status, 16) << "the same node: resume elsewhere\n" << same.out;
    CliRun other = run_loom_mpi(2, pp + " --load " + (tmp / "s"), "LOOM_RERUN_NODE=another-node");
    EXPECT_EQ(other.status, 17) << other.out;
    EXPECT_NE(other.out.find("rank 1, node another-node, device 0, iteration #2: Possible persistent error!"),
              std::string::npos) << other.out;
}

// The checkpoint's weights reach Hugging Face's format and the eval command unchanged.
TEST(CheckpointExport, ExportHfAndEvalReadTheTrainedWeights) {
    TempDir tmp;
    CliRun trained = run_on(2, kRun + "--train-iters 6 --tensor-model-parallel-size 2 --save " + (tmp / "a"));
    ASSERT_EQ(trained.status, 0) << trained.out;
    CliRun info = run_loom("checkpoint info " + (tmp / "a") + " --verify");
    ASSERT_EQ(info.status, 0) << info.out;
    EXPECT_NE(info.out.find("iteration 6"), std::string::npos) << info.out;
    EXPECT_NE(info.out.find("saved from: tp 2"), std::string::npos) << info.out;
    EXPECT_NE(info.out.find("verified"), std::string::npos) << info.out;
    CliRun exported = run_loom("export-hf --load " + (tmp / "a") + " --output " + (tmp / "hf"));
    ASSERT_EQ(exported.status, 0) << exported.out;
    CliRun from_ckpt = run_loom("eval --mock-data --eval-iters 2 --load " + (tmp / "a") + " --use-checkpoint-args", "2>/dev/null");
    // Hugging Face's config has no training sequence length: the eval names kModel's.
    CliRun from_hf   = run_loom("eval --mock-data --eval-iters 2 --seq-length 32 --load-hf " + (tmp / "hf"), "2>/dev/null");
    ASSERT_EQ(from_ckpt.status, 0) << from_ckpt.out;
    ASSERT_EQ(from_hf.status, 0) << from_hf.out;
    auto loss = [](const std::string & out) {
        size_t at = out.find("lm loss value: ");
        return at == std::string::npos ? -1.0 : std::stod(out.substr(at + 15));
    };
    EXPECT_GT(loss(from_ckpt.out), 0);
    EXPECT_NEAR(loss(from_ckpt.out), loss(from_hf.out), 1e-6) << from_ckpt.out << from_hf.out;
    EXPECT_NE(from_ckpt.out.find("validation loss at iteration 6"), std::string::npos) << from_ckpt.out;
}

// A MoE checkpoint records the experts' shape as Megatron's args: a resume with the same flags continues
// bitwise, one with a different shape is refused naming the flag, --use-checkpoint-args rebuilds the
// experts, and export-hf refuses (GPT-2 has no experts).
TEST(CheckpointMoe, ExpertShapeIsSavedCheckedAndRestored) {
    TempDir           tmp;
    const std::string moe = kRun + "--num-layers 2 --num-experts 4 --moe-router-topk 2 --moe-aux-loss-coeff 1e-2 ";
    CliRun            whole = run_loom(moe + "--train-iters 6");
    ASSERT_EQ(whole.status, 0) << whole.out;
    ASSERT_EQ(run_loom(moe + "--train-iters 6 --save " + (tmp / "a") + " --exit-interval 3").status, 0);
    CliRun resumed = run_loom(moe + "--train-iters 6 --load " + (tmp / "a"));
    ASSERT_EQ(resumed.status, 0) << resumed.out;
    auto line6 = [](const std::string & out) {
        const size_t at = out.find("iteration        6/");
        return at == std::string::npos ? std::string() : out.substr(out.find("lm loss:", at), 60);
    };
    EXPECT_FALSE(line6(whole.out).empty()) << whole.out;
    EXPECT_EQ(line6(resumed.out), line6(whole.out)) << "the resumed run's iteration 6, lm loss and load_balancing_loss";
    CliRun dense = run_loom(kRun + "--num-layers 2 --train-iters 6 --load " + (tmp / "a"));
    EXPECT_EQ(dense.status, 2);
    EXPECT_NE(dense.out.find("--num-experts: the model has num_experts = null, the checkpoint"), std::string::npos) << dense.out;
    CliRun grouped = run_loom(moe + "--moe-grouped-gemm --train-iters 6 --load " + (tmp / "a"));
    EXPECT_EQ(grouped.status, 2);
    EXPECT_NE(grouped.out.find("--moe-grouped-gemm: the model has moe_grouped_gemm = true"), std::string::npos) << grouped.out;
    CliRun eval = run_loom("eval --mock-data --eval-iters 2 --load " + (tmp / "a") + " --use-checkpoint-args", "2>/dev/null");
    EXPECT_EQ(eval.status, 0) << eval.out;
    EXPECT_NE(eval.out.find("validation loss at iteration 3"), std::string::npos) << eval.out;
    CliRun exported = run_loom("export-hf --load " + (tmp / "a") + " --output " + (tmp / "hf"));
    EXPECT_EQ(exported.status, 2);
    EXPECT_NE(exported.out.find("the model has --num-experts 4 (GPT-2 has no experts)"), std::string::npos) << exported.out;
}

// Twenty-five ways a checkpoint can be damaged (three of them in a shard whose size and checksum were
// written into the index again): each is refused with exit 2, by --load and by `checkpoint info --verify`,
// naming the file at fault (and the field, for the index's), in Loom's words: no JSON library's exception
// text reaches the user.
TEST(CheckpointCorrupt, TwentySevenCorruptionsEachExitTwoNamingTheFile) {
    TempDir tmp;
    const std::string good = tmp / "good";
    ASSERT_EQ(run_on(2, kRun + "--train-iters 2 --lr-warmup-iters 1 --use-distributed-optimizer --save " + good).status, 0);
    const std::string iter = "iter_0000002";
    auto edit_index = [&](const std::string & dir, const std::function<void(json &)> & fn) {
        const std::string path = dir + "/" + iter + "/index.json";
        std::ifstream     in(path);
        json              j = json::parse(in);
        fn(j);
        std::ofstream(path) << j.dump();
    };
    auto corrupt_byte = [](const std::string & path, int64_t offset) {
        std::fstream f(path, std::ios::in | std::ios::out | std::ios::binary);
        f.seekg(offset);
        char c;
        f.get(c);
        f.seekp(offset);
        f.put(static_cast<char>(c ^ 0x5A));
    };
    struct Case {
        const char *                              name;
        std::function<void(const std::string &)>  damage;
        std::string                               names;   // the file (or flag) the message must name
        std::string                               flags = "";
        std::string                               says  = "";   // and, for a field of the index, what it says
        bool                                      damaged = true;   // `checkpoint info --verify` refuses it too
    };
    const std::string shard = iter + "/rank_00001.safetensors", index = iter + "/index.json";
    // A shard changed as a careful tool would: its size and CRC-32C written into the index again, so only
    // the checks of what the shard holds can find the damage.
    auto rewrite_shard = [&](const std::string & dir, const std::function<void(std::string &)> & change) {
        const std::string path = dir + "/" + shard;
        std::ifstream     in(path, std::ios::binary);
        std::string       bytes((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
        in.close();
        change(bytes);
        std::ofstream(path, std::ios::binary | std::ios::trunc) << bytes;
        char crc[9];
        std::snprintf(crc, sizeof(crc), "%08x", crc32c(bytes.data(), bytes.size()));
        edit_index(dir, [&](json & j) {
            j["files"]["rank_00001.safetensors"] = {{"bytes", bytes.size()}, {"crc32c", crc}};
        });
    };
    // The first F32 entry's first element of a safetensors file's bytes, set to `value`.
    auto set_first_f32 = [](std::string & bytes, float value) {
        uint64_t header = 0;
        std::memcpy(&header, bytes.data(), 8);
        const json entries = json::parse(bytes.substr(8, header));
        for (const auto & [name, e] : entries.items()) {
            if (name == "__metadata__" || e["dtype"] != "F32") continue;
            std::memcpy(bytes.data() + 8 + header + e["data_offsets"][0].get<size_t>(), &value, sizeof(value));
            return;
        }
        FAIL() << "no F32 entry";
    };
    std::vector<Case> cases = {
        {"truncated shard", [&](const std::string & d) { fs::resize_file(d + "/" + shard, 1000); }, shard},
        {"flipped byte in the data", [&](const std::string & d) { corrupt_byte(d + "/" + shard, 5000); }, shard},
        {"flipped byte in the header", [&](const std::string & d) { corrupt_byte(d + "/" + shard, 20); }, shard},
        {"missing shard", [&](const std::string & d) { fs::remove(d + "/" + shard); }, shard},
        {"missing index", [&](const std::string & d) { fs::remove(d + "/" + index); }, index},
        {"index not JSON", [&](const std::string & d) { fs::resize_file(d + "/" + index, 100); }, index},
        {"index pointing past a file",
         [&](const std::string & d) {
             edit_index(d, [](json & j) { j["files"]["rank_00001.safetensors"]["bytes"] = 1 << 30; });
         },
         shard},
        {"wrong shape in the index",
         [&](const std::string & d) {
             edit_index(d, [](json & j) { j["tensors"]["layers.0.norm1.weight"]["shape"] = {48}; });
         },
         index},
        {"piece range past its part",
         [&](const std::string & d) {
             edit_index(d, [](json & j) { j["tensors"]["layers.1.mlp.fc1.bias"]["pieces"][0]["range"][1] = 100000; });
         },
         index},
        {"tensor missing from the index",
         [&](const std::string & d) { edit_index(d, [](json & j) { j["tensors"].erase("final_norm.weight"); }); },
         index},
        {"tracker naming a missing iteration",
         [&](const std::string & d) { std::ofstream(d + "/latest_checkpointed_iteration.txt") << "30\n"; },
         "latest_checkpointed_iteration.txt"},
        {"args that contradict the checkpoint", [](const std::string &) {}, "--num-layers", "--num-layers 2", "", false},
        {"negative iteration", [&](const std::string & d) { edit_index(d, [](json & j) { j["iteration"] = -3; }); },
         index, "", "iteration -3 is negative"},
        // A float where an integer belongs (found by fuzz_checkpoint_index: converting 1e95 to int is undefined).
        {"float version", [&](const std::string & d) { edit_index(d, [](json & j) { j["version"] = 1e95; }); },
         index, "", "version is 1e+95, not an integer"},
        {"float piece range", [&](const std::string & d) {
             edit_index(d, [](json & j) { j["tensors"]["final_norm.weight"]["pieces"][0]["range"][1] = 3.5e30; });
         }, index, "", "final_norm.weight's range is 3.5e+30, not an integer"},
        {"iteration of another folder", [&](const std::string & d) { edit_index(d, [](json & j) { j["iteration"] = 5; }); },
         index, "", "iteration 5 is not the iteration of its folder 'iter_0000002'"},
        {"negative optimizer step",
         [&](const std::string & d) { edit_index(d, [](json & j) { j["optimizer"]["step"] = -1; }); }, index, "",
         "optimizer step -1 is negative"},
        {"negative consumed samples",
         [&](const std::string & d) { edit_index(d, [](json & j) { j["metadata"]["consumed_train_samples"] = -8; }); },
         index, "", "consumed_train_samples -8 is not a count of samples"},
        {"null metadata", [&](const std::string & d) { edit_index(d, [](json & j) { j["metadata"] = nullptr; }); }, index,
         "", "\"metadata\" is null, not an object"},
        {"checksum not hexadecimal",
         [&](const std::string & d) {
             edit_index(d, [](json & j) { j["files"]["rank_00001.safetensors"]["crc32c"] = "zz"; });
         },
         index, "", "has crc32c 'zz', not 8 hexadecimal digits"},
        {"string where a number belongs",
         [&](const std::string & d) {
             edit_index(d, [](json & j) { j["files"]["rank_00001.safetensors"]["bytes"] = "1000"; });
         },
         index, "", "the size of file 'rank_00001.safetensors' is \"1000\", not an integer"},
        {"tensor listed twice",
         [&](const std::string & d) {
             const std::string path = d + "/" + iter + "/index.json";
             std::ifstream     in(path);
             json              j = json::parse(in);
             std::string       text = j.dump();
             const std::string entry = "\"final_norm.bias\":" + j["tensors"]["final_norm.bias"].dump() + ",";
             text.insert(text.find("\"tensors\":{") + 11, entry);
             std::ofstream(path) << text;
         },
         index, "", "holds the key \"final_norm.bias\" twice in one object"},
        {"flipped byte in the header, checksum rewritten",
         [&](const std::string & d) { rewrite_shard(d, [](std::string & b) { b[20] = static_cast<char>(b[20] ^ 0x5A); }); },
         shard},
        {"NaN in a shard, checksum rewritten",
         [&](const std::string & d) {
             rewrite_shard(d, [&](std::string & b) { set_first_f32(b, std::numeric_limits<float>::quiet_NaN()); });
         },
         shard, "", "holds nan at element 0"},
        {"a dtype in the index that its shards do not hold",
         [&](const std::string & d) {
             edit_index(d, [](json & j) {
                 for (auto & [name, t] : j["tensors"].items()) t["dtype"] = "BF16";
             });
         },
         "rank_0000"},
        // --use-checkpoint-args reads the saved model shape: each value checked before it is converted.
        {"an integer arg of 1e95",
         [&](const std::string & d) { edit_index(d, [](json & j) { j["metadata"]["args"]["num_layers"] = 1e95; }); },
         index, "--use-checkpoint-args", "num_layers is 1e+95", false},
        {"a switch arg that is a number",
         [&](const std::string & d) { edit_index(d, [](json & j) { j["metadata"]["args"]["swiglu"] = 3; }); },
         index, "--use-checkpoint-args", "swiglu is 3", false},
    };
    ASSERT_EQ(cases.size(), 27u);
    for (const Case & c : cases) {
        SCOPED_TRACE(c.name);
        const std::string dir = tmp / "bad";
        fs::remove_all(dir);
        fs::copy(good, dir, fs::copy_options::recursive);
        c.damage(dir);
        CliRun r = run_loom(kRun + "--train-iters 4 --load " + dir + " " + c.flags);
        EXPECT_EQ(r.status, 2) << r.out;
        EXPECT_NE(r.out.find(c.names), std::string::npos) << "the message names " << c.names << ":\n" << r.out;
        EXPECT_NE(r.out.find(c.says), std::string::npos) << "the message says " << c.says << ":\n" << r.out;
        EXPECT_EQ(r.out.find("json.exception"), std::string::npos) << r.out;
        if (!c.damaged) continue;
        // `checkpoint info --verify` runs the checks --load runs: it refuses what --load refuses.
        CliRun info = run_loom("checkpoint info " + dir + " --verify");
        EXPECT_EQ(info.status, 2) << info.out;
        EXPECT_NE(info.out.find(c.names), std::string::npos) << "--verify names " << c.names << ":\n" << info.out;
        EXPECT_EQ(info.out.find("verified"), std::string::npos) << info.out;
    }
}

TEST(CheckpointFlags, UnsupportedFormatsAndMisusedFlagsAreRefusedByName) {
    CliRun zarr = run_loom("train --mock-data --ckpt-format zarr");
    EXPECT_EQ(zarr.status, 2);
    EXPECT_NE(zarr.out.find("--ckpt-format zarr is not supported"), std::string::npos) << zarr.out;
    // Megatron's other names write Loom's format, and say so.
    TempDir tmp;
    CliRun  torch = run_loom(kRun + "--train-iters 3 --ckpt-format torch --save " + (tmp / "t"));
    EXPECT_EQ(torch.status, 0) << torch.out;
    EXPECT_NE(torch.out.find("WARNING: --ckpt-format torch: Loom writes and reads its own format"), std::string::npos)
        << torch.out;
    EXPECT_EQ(checkpoint::read_index(tmp / "t/iter_0000003").iteration, 3);
    CliRun args = run_loom("train --mock-data --use-checkpoint-args");
    EXPECT_EQ(args.status, 2);
    EXPECT_NE(args.out.find("--use-checkpoint-args without --load"), std::string::npos) << args.out;
    CliRun interval = run_loom("train --mock-data --save-interval 0");
    EXPECT_EQ(interval.status, 2);
    EXPECT_NE(interval.out.find("--save-interval must be >= 1"), std::string::npos) << interval.out;
    for (const char * bad : {"SIGKILL", "SIGSTOP", "TERM", "sigterm"}) {
        CliRun signal = run_loom(std::string("train --mock-data --exit-signal-handler --exit-signal ") + bad);
        EXPECT_EQ(signal.status, 2) << signal.out;
        EXPECT_NE(signal.out.find(std::string("--exit-signal ") + (bad[0] == 'S' ? "" : "'") + bad), std::string::npos)
            << signal.out;
    }
    CliRun eval = run_loom("eval --mock-data --save /tmp/x --load /tmp");
    EXPECT_EQ(eval.status, 2);
    EXPECT_NE(eval.out.find("flags of `loom train`"), std::string::npos) << eval.out;
}

// A growing global batch (--step-batch-size-schedule, thresholds in tokens: samples 0, 4 and 12 at
// sequence 32; 44 samples make 8 iterations) on two data-parallel ranks with ZeRO-1 follows the one-rank run, and a resume on a two-stage
// pipeline from the one-rank checkpoint at iteration 4 picks the schedule up at its consumed samples.
TEST(BatchSchedule, DataParallelAndAResumeOnAPipelineFollowTheOneRankRun) {
    TempDir           tmp;
    // In samples: a schedule's iteration-based lr lengths count micro x dp samples per iteration (Megatron's
    // global batch with a schedule), which differ between the layouts.
    const std::string run = "train --mock-data --train-samples 44 --lr-warmup-samples 4 --lr-decay-samples 1000 "
                            "--log-interval 1 --micro-batch-size 1 " +
                            kModel + "--num-layers 2 --step-batch-size-schedule '0:2 128:4 384:8' ";
    CliRun one = run_on(1, run + "--save " + (tmp / "one") + " --save-interval 4 --log-file " + (tmp / "one.jsonl"));
    ASSERT_EQ(one.status, 0) << one.out;
    CliRun dp = run_on(2, run + "--use-distributed-optimizer --log-file " + (tmp / "dp.jsonl"));
    ASSERT_EQ(dp.status, 0) << dp.out;
    CliRun pp = run_on(2, run + "--pipeline-model-parallel-size 2 --load " + (tmp / "one") + " --ckpt-step 4 --log-file " +
                              (tmp / "pp.jsonl"));
    ASSERT_EQ(pp.status, 0) << pp.out;
    std::map<int64_t, double> l1 = losses(tmp / "one.jsonl"), l2 = losses(tmp / "dp.jsonl"), l3 = losses(tmp / "pp.jsonl");
    ASSERT_EQ(l1.size(), 8u);
    ASSERT_EQ(l2.size(), 8u);
    ASSERT_EQ(l3.size(), 4u) << pp.out;
    for (int64_t k = 1; k <= 8; ++k) {
        EXPECT_NEAR(l2.at(k), l1.at(k), 1e-5 * std::abs(l1.at(k))) << "dp 2, iteration " << k;
        if (k > 4) EXPECT_NEAR(l3.at(k), l1.at(k), 1e-5 * std::abs(l1.at(k))) << "pp 2 resumed, iteration " << k;
    }
    EXPECT_NE(pp.out.find("consumed samples:           20 | elapsed"), std::string::npos) << "iteration 5: 12 + 8\n"
                                                                                              << pp.out;
}

// --num-distributed-optimizer-instances 2 on four data-parallel ranks: two instances of two ranks, each
// sharding the optimizer over its own pair and all-reducing its shards with the other instance. The loss
// curve is the one-rank run's (1e-5 relative: the sums regroup), and the checkpoint (written by the first
// instance alone) resumes on one rank where the four-rank run went on.
TEST(DistOptInstances, TwoInstancesFollowTheOneRankRunAndTheirCheckpointReshards) {
    TempDir           tmp;
    const std::string run = kRun + "--global-batch-size 8 --micro-batch-size 2 --num-layers 2 ";
    const std::string instances = "--use-distributed-optimizer --num-distributed-optimizer-instances 2 "
                                  "--overlap-grad-reduce --ddp-bucket-size 50000 ";
    CliRun one = run_on(1, run + "--log-file " + (tmp / "one.jsonl"));
    ASSERT_EQ(one.status, 0) << one.out;
    CliRun four = run_on(4, run + instances + "--save " + (tmp / "four") + " --save-interval 10 --log-file " +
                                (tmp / "four.jsonl"));
    ASSERT_EQ(four.status, 0) << four.out;
    CliRun back = run_on(1, run + "--load " + (tmp / "four") + " --ckpt-step 10 --log-file " + (tmp / "back.jsonl"));
    ASSERT_EQ(back.status, 0) << back.out;
    std::map<int64_t, double> l1 = losses(tmp / "one.jsonl"), l4 = losses(tmp / "four.jsonl"), lb = losses(tmp / "back.jsonl");
    ASSERT_EQ(l4.size(), 20u);
    ASSERT_EQ(lb.size(), 10u) << back.out;
    for (int64_t k = 1; k <= 20; ++k) {
        EXPECT_NEAR(l4.at(k), l1.at(k), 1e-5 * std::abs(l1.at(k))) << "two instances, iteration " << k;
        if (k > 10) EXPECT_NEAR(lb.at(k), l4.at(k), 1e-5 * std::abs(l4.at(k))) << "resumed on one rank, iteration " << k;
    }
    // Megatron's rules, before any collective.
    CliRun odd = run_on(2, run + "--use-distributed-optimizer --num-distributed-optimizer-instances 4");
    EXPECT_NE(odd.status, 0);
    EXPECT_NE(odd.out.find("Data parallel size should be divisible by partial DistOpt shard factor"), std::string::npos)
        << odd.out;
    CliRun plain = run_on(1, run + "--num-distributed-optimizer-instances 2");
    EXPECT_NE(plain.out.find("Partial DistOpt cannot be used without DistOpt"), std::string::npos) << plain.out;
}

// --profile under mpirun (two data-parallel ranks with ZeRO-1 and both overlaps): each profiled rank writes
// its trace, which parses as a Chrome trace with the compute and DDP streams' work, collectives among it;
// on the compute stream (which the end of the window drains) a window of two iterations holds exactly twice
// the operations of a window of one, name by name (every iteration enqueues the same work); the DDP stream's
// work may still run when the window closes, so a longer window holds at least as much of it;
// --profile-ranks 1 leaves rank 0 unprofiled.
TEST(Profile, EveryRankTracesEachStreamOperationOfTheWindow) {
    TempDir           tmp;
    const std::string run = kRun + "--num-layers 2 --global-batch-size 8 --micro-batch-size 2 --train-iters 6 "
                                   "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather "
                                   "--ddp-bucket-size 40000 --profile ";
    auto counts = [&](const std::string & path) {
        std::map<std::pair<std::string, std::string>, int> out;
        std::ifstream in(path);
        EXPECT_TRUE(in.good()) << path;
        if (!in.good()) return out;
        const json trace = json::parse(in);
        std::map<int, std::string> threads;
        for (const json & e : trace["traceEvents"]) {
            if (e["ph"] == "M" && e["name"] == "thread_name") threads[e["tid"].get<int>()] = e["args"]["name"];
        }
        for (const json & e : trace["traceEvents"]) {
            if (e["ph"] != "X") continue;
            EXPECT_GE(e["dur"].get<int64_t>(), 0);
            ++out[{threads.at(e["tid"].get<int>()), e["name"].get<std::string>()}];
        }
        return out;
    };
    CliRun one = run_on(2, run + "--profile-step-start 3 --profile-step-end 4 --tensorboard-dir " + (tmp / "one"));
    ASSERT_EQ(one.status, 0) << one.out;
    EXPECT_NE(one.out.find("profile of iterations 4 to 4"), std::string::npos) << one.out;
    CliRun two = run_on(2, run + "--profile-step-start 3 --profile-step-end 5 --tensorboard-dir " + (tmp / "two"));
    ASSERT_EQ(two.status, 0) << two.out;
    for (int rank : {0, 1}) {
        const auto c1 = counts(tmp / ("one/loom_profile_rank" + std::to_string(rank) + ".json"));
        const auto c2 = counts(tmp / ("two/loom_profile_rank" + std::to_string(rank) + ".json"));
        ASSERT_FALSE(c1.empty());
        EXPECT_GT(c1.count({"compute", "gemm"}), 0u) << "rank " << rank;
        EXPECT_GT(c1.count({"ddp-comm", "reduce_scatter"}), 0u) << "rank " << rank;
        EXPECT_GT(c1.count({"ddp-comm", "all_gather"}), 0u) << "rank " << rank;
        for (const auto & [key, n] : c1) {
            const int twice = c2.count(key) ? c2.at(key) : 0;
            if (key.first == "compute") {
                EXPECT_EQ(twice, 2 * n) << "rank " << rank << ": " << key.first << " " << key.second;
            } else {
                EXPECT_GE(twice, n) << "rank " << rank << ": " << key.first << " " << key.second;
            }
        }
    }
    CliRun only = run_on(2, run + "--profile-step-start 3 --profile-step-end 4 --profile-ranks 1 --save " + (tmp / "only") +
                                " --save-interval 100");
    ASSERT_EQ(only.status, 0) << only.out;
    EXPECT_FALSE(fs::exists(tmp / "only/loom_profile_rank0.json"));
    EXPECT_TRUE(fs::exists(tmp / "only/loom_profile_rank1.json"));
}

// --log-progress: Megatron's progress.txt in the --save folder: the job's start, each save with its
// iteration, throughputs, floating-point operations so far (in proportion to the samples consumed) and tokens,
// each checkpoint --save-retain-interval removes; a resumed job appends its own start, and with --async-save
// its save line says "Saving async checkpoint".
TEST(ProgressLog, StartsSavesAndDeletionsAreAppendedAsMegatronWritesThem) {
    TempDir           tmp;
    const std::string run = "train --mock-data --num-layers 1 " + kModel + "--micro-batch-size 2 --global-batch-size 4 "
                            "--save-interval 2 --log-progress --save " + (tmp / "ckpt") + " ";
    ASSERT_EQ(run_loom(run + "--train-iters 6 --save-retain-interval 4").status, 0);
    CliRun again = run_loom(run + "--train-iters 8 --load " + (tmp / "ckpt") + " --override-opt_param-scheduler --async-save");
    ASSERT_EQ(again.status, 0) << again.out;
    std::ifstream            in(tmp / "ckpt/progress.txt");
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    ASSERT_EQ(lines.size(), 7u);
    const std::regex head(R"(^\d{4}-\d\d-\d\d \d\d:\d\d:\d\d\tJob ID: [^\t]*\t# GPUs: 1\t)");
    for (const std::string & line : lines) EXPECT_TRUE(std::regex_search(line, head)) << line;
    auto message = [&](size_t i) { return lines[i].substr(lines[i].find("# GPUs: 1\t") + 10); };
    EXPECT_EQ(message(0), "Starting job");
    EXPECT_EQ(message(3), "Deleted checkpoint\tIteration: 2");
    EXPECT_EQ(message(5), "Starting job");
    const std::regex saved(R"(^(Saved checkpoint|Saving async checkpoint)\tIteration: (\d+)\tJob throughput: [0-9.]+ TFLOP/s/GPU\t)"
                           R"(Cumulative throughput: [0-9.]+ TFLOP/s/GPU\tFloating-point operations: ([0-9.e+]+)\t)"
                           R"(Tokens \(in billions\): 0\.00$)");
    const size_t save_lines[] = {1, 2, 4, 6};
    const int    iterations[] = {2, 4, 6, 8};
    double       per_iteration = 0;
    for (int i = 0; i < 4; ++i) {
        std::smatch m;
        const std::string text = message(save_lines[i]);
        ASSERT_TRUE(std::regex_match(text, m, saved)) << text;
        EXPECT_EQ(m[1].str(), i == 3 ? "Saving async checkpoint" : "Saved checkpoint");
        EXPECT_EQ(std::stoi(m[2].str()), iterations[i]);
        const double flops = std::stod(m[3].str());
        if (i == 0) per_iteration = flops / 2;
        EXPECT_NEAR(flops, per_iteration * iterations[i], 0.01 * flops) << "operations so far, iteration " << iterations[i];
    }
}
