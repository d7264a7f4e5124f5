// No rank hangs the job: a rank that fails in any way (an allocation that throws std::bad_alloc, a missing
// file, a process stopped by SIGSTOP) ends the whole `mpirun` job with a message naming the rank, within
// 30 s. The faults come from the trainer's LOOM_FAULT seam; the watchdog's timeout from
// LOOM_DISTRIBUTED_TIMEOUT_S (--distributed-timeout-minutes counts whole minutes). The watchdog's message
// names the rank that did not arrive: a stopped one does not answer its roll call, a stalled one (sleeping
// outside communication) answers that it has not posted the operation, a diverged one (an extra
// collective) answers which operation it waits in.
//
// Ranks launched differently (a flag on one rank only, another value, another file at the same path on
// another host) refuse before the first collective, every rank exiting with status 2 and the message
// naming the flag, its values and the ranks holding each (comm/agreement.h).
//
// No output is lost silently: a standard output or --log-file that cannot be written (full, closed) stops
// the run at the next log iteration on every rank, saves the checkpoint, and exits 1 naming the stream.
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <chrono>
#include <filesystem>
#include <fstream>
#include <unistd.h>

namespace {

struct Fault {
    const char * name;
    const char * message;   // what the output must say
};

class RankFault : public ::testing::TestWithParam<Fault> {};

TEST_P(RankFault, EndsTheWholeJobWithinThirtySeconds) {
    const Fault & f     = GetParam();
    const auto    start = std::chrono::steady_clock::now();
    CliRun r = run_loom_mpi(2, "train --mock-data --train-iters 50 --lr-warmup-iters 1 --log-interval 1",
                            std::string("LOOM_DISTRIBUTED_TIMEOUT_S=2 LOOM_FAULT=1:3:") + f.name + " timeout 120");
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_NE(r.status, 0) << r.out;
    EXPECT_NE(r.status, 124) << "timeout(1) had to end it: the job hung\n" << r.out;
    EXPECT_LT(seconds, 30.0) << r.out;
    EXPECT_NE(r.out.find(f.message), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("iteration        4/"), std::string::npos) << "the job went on past the fault\n" << r.out;
}

INSTANTIATE_TEST_SUITE_P(
    Faults, RankFault,
    ::testing::Values(Fault{"bad_alloc", "[rank 1] loom train: std::bad_alloc"},
                      Fault{"missing_file", "cannot read injected fault '/nonexistent/loom-fault-injection.bin'"},
                      Fault{"sigstop", "rank 1 did not answer within 1 s: it has stopped, crashed, or is blocked "
                                       "inside MPI"},
                      Fault{"stall", "rank 1 has not arrived: it has posted"},
                      // Rank 1 issues an all-reduce the others never do: whichever watchdog reports first,
                      // it names the ranks that have not arrived and what each is waiting in.
                      Fault{"diverge", "has not arrived: it has posted"},
                      // Rank 1's next all-reduce reduces with max where the others sum: it completes, and the
                      // running check at the next log line names the group and both reductions.
                      Fault{"diverge_op", "the ranks' collective operations diverged"}),
    [](const ::testing::TestParamInfo<Fault> & info) { return std::string(info.param.name); });

// A pipeline stage that sends one transfer its neighbour never receives (LOOM_FAULT diverge_send on rank 0 at
// iteration 3): over MPI the small send completes, and a later receive of the same tag would take its data.
// The running check of the channels' transfers at the iteration's log line ends both ranks naming the
// channel, its two ranks and their counts. Without the fault the same run trains to the end.
TEST(PipelineTransfers, ATransferNeverReceivedIsNamedAtTheNextLogLine) {
    const std::string run = "train --mock-data --train-iters 6 --lr-warmup-iters 1 --log-interval 1 "
                            "--pipeline-model-parallel-size 2 --num-layers 2 --hidden-size 32 --num-attention-heads 2 "
                            "--seq-length 16 --micro-batch-size 2 --global-batch-size 8";
    const CliRun fine = run_loom_mpi(2, run);
    EXPECT_EQ(fine.status, 0) << fine.out;
    const auto   start    = std::chrono::steady_clock::now();
    const CliRun diverged = run_loom_mpi(2, run, "LOOM_DISTRIBUTED_TIMEOUT_S=20 LOOM_FAULT=0:3:diverge_send timeout 120");
    const double seconds  = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    EXPECT_EQ(diverged.status, 1) << diverged.out;
    EXPECT_LT(seconds, 15.0) << "named by the check, not by the watchdog\n" << diverged.out;
    EXPECT_NE(diverged.out.find("the pipeline's point-to-point transfers diverged"), std::string::npos) << diverged.out;
    EXPECT_NE(diverged.out.find("channel 'pp-activations-0-1', rank 0 to rank 1: sent 14 transfer(s)"), std::string::npos)
        << diverged.out;
    EXPECT_NE(diverged.out.find("on rank 0; received 13 transfer(s)"), std::string::npos) << diverged.out;
    EXPECT_EQ(diverged.out.find("iteration        4/"), std::string::npos) << "the job went on past the fault\n" << diverged.out;
}

// --check-weight-hash-across-dp-replicas-interval: replicas that agree print Megatron's line at every check;
// a replica whose weights drifted (LOOM_FAULT perturb_param on rank 1 at iteration 3) ends the job at the
// next check (iteration 4) naming the parameter and the replicas.
TEST(WeightHashes, ReplicasCompareTheirWeightsAndADriftedOneIsNamed) {
    const std::string run = "train --mock-data --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                            "--micro-batch-size 2 --train-iters 6 --log-interval 2 "
                            "--check-weight-hash-across-dp-replicas-interval 2";
    CliRun fine = run_loom_mpi(2, run);
    EXPECT_EQ(fine.status, 0) << fine.out;
    for (const char * k : {"2", "4", "6"}) {
        EXPECT_NE(fine.out.find(std::string(">>> Weight hashes match after ") + k + " iterations..."), std::string::npos)
            << fine.out;
    }
    CliRun drifted = run_loom_mpi(2, run, "LOOM_FAULT=1:3:perturb_param");
    EXPECT_EQ(drifted.status, 1) << drifted.out;
    EXPECT_NE(drifted.out.find("Parameter hashes not matching across DP replicas after 4 iterations"), std::string::npos)
        << drifted.out;
    EXPECT_NE(drifted.out.find("embedding.word_embeddings.weight: group rank 0 and group rank 1 (data-parallel)"),
              std::string::npos) << drifted.out;
}

// Two ranks launched apart (mpirun's multiple-program form): `loom train <rank0>` in `dir0` and
// `loom train <rank1>` in `dir1`; the seconds it took.
struct TwoRanks {
    CliRun run;
    double seconds;
};
TwoRanks train_on_two_ranks(const std::string & rank0, const std::string & rank1, const std::string & dir0 = ".",
                            const std::string & dir1 = ".") {
    const auto        start = std::chrono::steady_clock::now();
    const std::string loom  = std::string(LOOM_CLI_PATH) + " train --train-iters 4 --lr-warmup-iters 1 ";
    CliRun r = run_command("timeout 120 " + std::string(LOOM_MPIEXEC) + " --oversubscribe -np 1 -wdir " + dir0 + " " + loom +
                           rank0 + " : -np 1 -wdir " + dir1 + " " + loom + rank1 + " 2>&1");
    return {r, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count()};
}

void expect_refused_before_training(const TwoRanks & t, const std::string & heading, const std::string & line) {
    EXPECT_EQ(t.run.status, 2) << t.run.out;
    EXPECT_LT(t.seconds, 30.0) << t.run.out;
    EXPECT_NE(t.run.out.find(heading + ":"), std::string::npos) << t.run.out;
    EXPECT_NE(t.run.out.find("\n    " + line + "\n"), std::string::npos) << "expected the line: " << line << "\n"
                                                                         << t.run.out;
    EXPECT_EQ(t.run.out.find("iteration "), std::string::npos) << "a rank trained\n" << t.run.out;
}

constexpr const char * kOptions = "the ranks were launched with different options";

TEST(RanksThatDisagree, AnotherLearningRateIsNamedWithBothValues) {
    expect_refused_before_training(train_on_two_ranks("--mock-data --lr 1e-4", "--mock-data --lr 2e-4"), kOptions,
                                   "--lr: 0.0001 on rank 0; 0.0002 on rank 1");
}

TEST(RanksThatDisagree, AFlagOnOneRankOnlyIsNamed) {
    expect_refused_before_training(train_on_two_ranks("--mock-data", "--mock-data --bf16"), kOptions,
                                   "--bf16: false on rank 0; true on rank 1");
}

TEST(RanksThatDisagree, AnotherModelShapeIsNamedBeforeAnyCollective) {
    // Once an MPI error in a non-blocking collective, far from the cause.
    const TwoRanks t = train_on_two_ranks("--mock-data --num-layers 2", "--mock-data --num-layers 4");
    expect_refused_before_training(t, kOptions, "--num-layers: 2 on rank 0; 4 on rank 1");
    EXPECT_NE(t.run.out.find("the resolved model: 2 layers"), std::string::npos) << t.run.out;
}

TEST(RanksThatDisagree, TheSamePathNamingOtherDataOnAnotherHostIsNamed) {
    // Two "hosts": each rank in its own folder, where corpus_text_document is a different dataset.
    namespace fs = std::filesystem;
    const fs::path root = fs::temp_directory_path() / ("loom-agreement-" + std::to_string(getpid()));
    for (int host = 0; host < 2; ++host) {
        const fs::path dir = root / ("host" + std::to_string(host));
        fs::create_directories(dir);
        std::ofstream text(dir / "corpus.txt");
        for (int line = 0; line < 200 + 50 * host; ++line) text << "document " << line << " of host " << host << "\n";
        text.close();
        ASSERT_EQ(run_loom("data --input " + (dir / "corpus.txt").string() + " --output-prefix " + (dir / "corpus").string() +
                           " --text-documents line").status, 0);
    }
    const std::string flags = "--data-path corpus_text_document --split 100,0,0 --seq-length 32 --num-layers 1";
    const TwoRanks    t = train_on_two_ranks(flags, flags, (root / "host0").string(), (root / "host1").string());
    EXPECT_EQ(t.run.status, 2) << t.run.out;
    EXPECT_LT(t.seconds, 30.0) << t.run.out;
    EXPECT_NE(t.run.out.find("the ranks read different data:\n    training data: Megatron dataset corpus_text_document"),
              std::string::npos) << t.run.out;
    EXPECT_NE(t.run.out.find(" on rank 0; Megatron dataset corpus_text_document"), std::string::npos) << t.run.out;
    EXPECT_EQ(t.run.out.find("iteration "), std::string::npos) << "a rank trained\n" << t.run.out;
    fs::remove_all(root);
}

// An output that fails: the run stops at the first log iteration after it (2 here), on every rank, saved.
struct LostOutput {
    const char * name;
    int          np;
    const char * redirect;   // where the output goes
    const char * message;    // what stderr must say
};

class OutputLost : public ::testing::TestWithParam<LostOutput> {};

TEST_P(OutputLost, EndsTheRunWithExitOneNamingItAfterSaving) {
    namespace fs = std::filesystem;
    const LostOutput & o    = GetParam();
    const fs::path     save = fs::temp_directory_path() / ("loom-lost-output-" + std::string(o.name) + "-" + std::to_string(getpid()));
    fs::remove_all(save);
    const std::string train = std::string(LOOM_CLI_PATH) +
                              " train --mock-data --num-layers 1 --train-iters 6 --log-interval 2 --lr-warmup-iters 1 --save " +
                              save.string() + " " + o.redirect;
    const std::string launch = o.np == 1 ? "" : std::string(LOOM_MPIEXEC) + " --oversubscribe -np " + std::to_string(o.np) + " ";
    const CliRun      r      = run_command("timeout 120 " + launch + train);
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find(o.message), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("(the run stopped after iteration 2; the checkpoint is saved in " + save.string() + ")"),
              std::string::npos) << r.out;
    std::ifstream tracker(save / "latest_checkpointed_iteration.txt");
    std::string   iteration;
    tracker >> iteration;
    EXPECT_EQ(iteration, "2") << "the checkpoint of the iteration the run stopped after";
    fs::remove_all(save);
}

INSTANTIATE_TEST_SUITE_P(
    Outputs, OutputLost,
    ::testing::Values(
        LostOutput{"full_stdout", 1, "2>&1 >/dev/full",
                   "cannot write the training log to standard output: No space left on device"},
        LostOutput{"full_log_file_of_two_ranks", 2, "--log-file /dev/full 2>&1",
                   "cannot write --log-file '/dev/full': No space left on device"}),
    [](const ::testing::TestParamInfo<LostOutput> & info) { return std::string(info.param.name); });

TEST(OutputLost, AClosedStandardOutputIsRefusedBeforeAnythingRuns) {
    // Left closed, the first file opened would take its number, and the log would be written into it.
    const CliRun r = run_loom("train --mock-data --train-iters 2", "2>&1 >&-");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_NE(r.out.find("loom: standard output is closed"), std::string::npos) << r.out;
    EXPECT_EQ(r.out.find("iteration"), std::string::npos) << r.out;
}

TEST(OutputLost, AnyCommandWhoseStandardOutputIsFullExitsOne) {
    const CliRun r = run_loom("ranks --world-size 8 --tensor-model-parallel-size 2", "2>&1 >/dev/full");
    EXPECT_EQ(r.status, 1) << r.out;
    EXPECT_EQ(r.out.rfind("loom ranks: ", 0), 0u) << r.out;
    EXPECT_NE(r.out.find("cannot write standard output: No space left on device"), std::string::npos) << r.out;
}

}  // namespace
