// Multi-host for real: two hosts made of network namespaces on this machine (tests/netns_cluster.sh), Open
// MPI launching across them over TCP as over two machines, two ranks per host.
//   - DP 2 x PP 2 across the hosts trains exactly as on one host: with Megatron's rank order the pipeline
//     crosses the link (DP inside each host), with --use-tp-pp-dp-mapping data parallelism does.
//   - A slow link (rate-limited) trains the same numbers.
//   - A partition mid-run (the link taken down) ends every rank within the watchdog's timeout plus its roll
//     call, and the surviving host's watchdog names the lost ranks (or the neighbour waiting on them).
// Skips with a message where network namespaces cannot be made (not root, no `ip`, a container without
// the privilege).
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdio>
#include <fstream>
#include <iterator>
#include <string>
#include <thread>
#include <unistd.h>
#include <vector>

namespace {

const std::string kCluster = std::string(LOOM_SOURCE_DIR) + "/tests/netns_cluster.sh";

// The lm loss of each line of a --log-file, as written.
std::vector<std::string> losses(const std::string & log_file) {
    std::vector<std::string> out;
    std::ifstream            in(log_file);
    for (std::string line; std::getline(in, line);) {
        const size_t at = line.find("\"lm loss\":");
        if (at != std::string::npos) out.push_back(line.substr(at, line.find_first_of(",}", at) - at));
    }
    return out;
}

class TwoHosts : public ::testing::Test {
protected:
    void SetUp() override {
        const CliRun check = run_command(kCluster + " check 2>&1");
        if (check.status != 0) GTEST_SKIP() << "network namespaces cannot be made here: " << check.out;
        name_ = "lt" + std::to_string(getpid() % 100000);
        const CliRun up = run_command(kCluster + " up " + name_ + " 2>&1");
        ASSERT_EQ(up.status, 0) << up.out;
        up_ = true;
    }
    void TearDown() override {
        if (up_) run_command(kCluster + " down " + name_ + " 2>&1");
    }
    std::string tmp(const std::string & file) const { return "/tmp/loom-" + name_ + "-" + file; }

    std::string name_;
    bool        up_ = false;
};

const std::string kTrain = std::string(LOOM_CLI_PATH) +
                           " train --mock-data --num-layers 2 --lr-warmup-iters 1 --log-interval 1 "
                           "--pipeline-model-parallel-size 2 ";

TEST_F(TwoHosts, DataAndPipelineParallelAcrossTheHostsTrainAsOnOneHost) {
    for (const std::string mapping : {"", "--use-tp-pp-dp-mapping"}) {
        SCOPED_TRACE(mapping.empty() ? "pipeline across the hosts" : "data parallel across the hosts");
        const std::string args = kTrain + "--train-iters 6 " + mapping + " --log-file ";
        const CliRun two = run_command("timeout 120 " + kCluster + " mpirun " + name_ + " -x LOOM_NUM_THREADS -np 4 " +
                                       args + tmp("two.jsonl") + " 2>&1");
        ASSERT_EQ(two.status, 0) << two.out;
        EXPECT_NE(two.out.find("parallel: tp 1, pp 2, dp 2"), std::string::npos) << two.out;
        const CliRun one = run_loom_mpi(4, args.substr(std::string(LOOM_CLI_PATH).size() + 1) + tmp("one.jsonl"));
        ASSERT_EQ(one.status, 0) << one.out;
        const std::vector<std::string> across = losses(tmp("two.jsonl")), local = losses(tmp("one.jsonl"));
        EXPECT_EQ(across.size(), 6u);
        EXPECT_EQ(across, local) << "two hosts and one host train the same numbers";
        std::remove(tmp("two.jsonl").c_str());
        std::remove(tmp("one.jsonl").c_str());
    }
}

// A slow link (16 mbit/s each way, a token bucket: this kernel has no netem for added delay or loss) changes
// when every transfer and reduction completes, and nothing else: the losses are one host's.
TEST_F(TwoHosts, ASlowLinkTrainsAsOnOneHost) {
    ASSERT_EQ(run_command(kCluster + " slow " + name_ + " 16mbit 2>&1").status, 0);
    const std::string args = kTrain + "--train-iters 3 --log-file ";
    const CliRun two = run_command("timeout 120 " + kCluster + " mpirun " + name_ + " -x LOOM_NUM_THREADS -np 4 " + args +
                                   tmp("slow.jsonl") + " 2>&1");
    ASSERT_EQ(two.status, 0) << two.out;
    const CliRun one = run_loom_mpi(4, args.substr(std::string(LOOM_CLI_PATH).size() + 1) + tmp("fast.jsonl"));
    ASSERT_EQ(one.status, 0) << one.out;
    EXPECT_EQ(losses(tmp("slow.jsonl")).size(), 3u);
    EXPECT_EQ(losses(tmp("slow.jsonl")), losses(tmp("fast.jsonl")));
    std::remove(tmp("slow.jsonl").c_str());
    std::remove(tmp("fast.jsonl").c_str());
}

TEST_F(TwoHosts, APartitionMidRunEndsEveryRankNamingTheLostHostsRanks) {
    const std::string log = tmp("partition.jsonl"), out = tmp("partition.out");
    // Under a unique --log-file, so that this job's ranks can be found among the machine's processes.
    const std::string job = "LOOM_DISTRIBUTED_TIMEOUT_S=3 timeout 120 " + kCluster + " mpirun " + name_ +
                            " -x LOOM_NUM_THREADS -x LOOM_DISTRIBUTED_TIMEOUT_S -np 4 " + kTrain +
                            "--train-iters 1000000 --log-file " + log;
    ASSERT_EQ(run_command("(" + job + " > " + out + " 2>&1 &)").status, 0);
    for (int wait = 0; wait < 600 && losses(log).size() < 3; ++wait) std::this_thread::sleep_for(std::chrono::milliseconds(100));
    ASSERT_GE(losses(log).size(), 3u) << "the run did not start";
    ASSERT_EQ(run_command(kCluster + " partition " + name_ + " 2>&1").status, 0);
    const auto start = std::chrono::steady_clock::now();
    // Loom's own processes: the launcher (mpirun waiting for its lost daemon) is Open MPI's and is not counted.
    double seconds = 0;
    while (seconds < 30 && run_command("pgrep -f -- '^" + std::string(LOOM_CLI_PATH) + " train.*--log-file " + log +
                                       "' | wc -l").out != "0\n") {
        std::this_thread::sleep_for(std::chrono::milliseconds(200));
        seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    }
    std::ifstream in(out);
    const std::string output((std::istreambuf_iterator<char>(in)), std::istreambuf_iterator<char>());
    EXPECT_LT(seconds, 15.0) << "ranks still running " << seconds << " s after the partition\n" << output;
    EXPECT_NE(output.find("has not completed after 3 s"), std::string::npos) << output;
    // Ranks 2 and 3 are on h1 (the second pipeline stage). The first watchdog to fire on h0 names either
    // its peer there, which does not answer, or its neighbour on h0 (data parallel), which answers that it
    // waits on a pipeline transfer across the link; the first to abort the job may stop the others first.
    const bool names_lost_rank = output.find("rank 2 did not answer within 1 s") != std::string::npos ||
                                 output.find("rank 3 did not answer within 1 s") != std::string::npos;
    const bool names_waiting_neighbour = output.find("has not arrived: it has posted") != std::string::npos &&
                                         output.find(" on group 'pp") != std::string::npos;
    EXPECT_TRUE(names_lost_rank || names_waiting_neighbour) << output;
    std::remove(log.c_str());
    std::remove(out.c_str());
}

}  // namespace
