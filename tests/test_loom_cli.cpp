// `loom --version` and `loom help`. `loom ranks`: the JSON for the two 16-rank examples of
// docs/design/parallel_state.md section 3 equals the groups listed there; the text view has both tables and
// the per-rank map; Megatron spellings work; bad input exits 2 with nothing on stdout.
#include <nlohmann/json.hpp>

#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>

namespace {

// stdout only: the JSON and the tables; errors go to stderr.
CliRun run_loom_stdout(const std::string & args) { return run_loom(args, "2>/dev/null"); }

using Groups = std::vector<std::vector<int>>;

}  // namespace

TEST(LoomRanks, Seed001DenseExampleJson) {
    CliRun r = run_loom_stdout("ranks --world-size 16 --tp 4 --pp 2 --json");
    ASSERT_EQ(r.status, 0);
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["world_size"], 16);
    EXPECT_EQ(j["dp"], 2);
    EXPECT_EQ(j["order"], "tp-cp-ep-dp-pp");
    EXPECT_EQ(j["dense"]["dp"].get<Groups>(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
    EXPECT_EQ(j["dense"]["tp"].get<Groups>(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
    EXPECT_EQ(j["dense"]["pp"].get<Groups>(), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    for (const char * key : {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp", "tp-dp", "embedding",
                             "position-embedding"}) {
        EXPECT_TRUE(j["dense"].contains(key)) << key;
    }
    for (const char * key : {"ep", "tp", "dp", "tp-ep", "tp-ep-pp", "pp"}) {
        EXPECT_TRUE(j["expert"].contains(key)) << key;
    }
}

TEST(LoomRanks, Seed001MoeExampleJson) {
    CliRun r = run_loom_stdout("ranks --world-size 16 --tp 4 --pp 2 --etp 1 --ep 4 --json");
    ASSERT_EQ(r.status, 0);
    auto j = nlohmann::json::parse(r.out);
    EXPECT_EQ(j["ep"], 4);
    EXPECT_EQ(j["etp"], 1);
    EXPECT_EQ(j["edp"], 2);
    EXPECT_EQ(j["expert"]["ep"].get<Groups>(), (Groups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
    EXPECT_EQ(j["expert"]["dp"].get<Groups>(), (Groups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
    EXPECT_EQ(j["expert"]["pp"].get<Groups>(), (Groups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    EXPECT_EQ(j["expert"]["tp"].size(), 16u);
}

TEST(LoomRanks, MegatronSpellingsGiveTheSameOutput) {
    CliRun short_flags = run_loom_stdout("ranks --world-size 16 --tp 4 --pp 2 --etp 1 --ep 4 --json");
    CliRun long_flags  = run_loom_stdout("ranks --world_size 16 --tensor-model-parallel-size 4 --pipeline-model-parallel-size 2 "
                          "--expert-tensor-parallel-size 1 --expert-model-parallel-size 4 --context-parallel-size 1 "
                          "--order tp-cp-ep-dp-pp --json");
    ASSERT_EQ(long_flags.status, 0);
    EXPECT_EQ(short_flags.out, long_flags.out);
}

TEST(LoomRanks, TextViewHasBothTablesAndThePerRankMap) {
    CliRun r = run_loom_stdout("ranks --world-size 16 --tp 4 --pp 2 --etp 1 --ep 4");
    ASSERT_EQ(r.status, 0);
    EXPECT_NE(r.out.find("dense groups"), std::string::npos);
    EXPECT_NE(r.out.find("expert groups"), std::string::npos);
    EXPECT_NE(r.out.find("[0,4] [1,5] [2,6] [3,7] [8,12] [9,13] [10,14] [11,15]"), std::string::npos) << r.out;
    // Rank 13: tp 1, cp 0, dp 1, pp 1 | etp 0, ep 1, edp 1, pp 1.
    EXPECT_NE(r.out.find("  13     1   0   1   1 |    0   1   1   1"), std::string::npos) << r.out;
}

TEST(LoomRanks, InvalidConfigurationExitsTwoWithNothingOnStdout) {
    CliRun r = run_loom_stdout("ranks --world-size 12 --tp 8");
    EXPECT_EQ(r.status, 2);
    EXPECT_EQ(r.out, "");
    CliRun order = run_loom_stdout("ranks --world-size 8 --tp 2 --order dp-pp");
    EXPECT_EQ(order.status, 2);
    EXPECT_EQ(order.out, "");
    CliRun bad_flag = run_loom_stdout("ranks --world-size 8 --tensor-parallel 2");
    EXPECT_EQ(bad_flag.status, 2);
    EXPECT_EQ(bad_flag.out, "");
    CliRun missing = run_loom_stdout("ranks --tp 2");
    EXPECT_EQ(missing.status, 2);
    // Listings too large to hold end in a message naming the flag, not in std::bad_alloc.
    CliRun huge = run_loom("ranks --world-size 2147483647");
    EXPECT_EQ(huge.status, 2);
    EXPECT_NE(huge.out.find("--world-size 2147483647 is more ranks than `loom ranks` lists"), std::string::npos) << huge.out;
    CliRun long_schedule = run_loom("schedule --pp 100000 --microbatches 100000");
    EXPECT_EQ(long_schedule.status, 2);
    EXPECT_NE(long_schedule.out.find("more than `loom schedule` prints"), std::string::npos) << long_schedule.out;
}

// `loom --version` names the version and the backends; `loom help` is the usage and `loom help <command>` the
// command's --help, both on stdout with status 0; an unknown command after help exits 2.
TEST(LoomCli, VersionAndHelpAsUsersExpect) {
    CliRun version = run_loom_stdout("--version");
    EXPECT_EQ(version.status, 0);
    EXPECT_EQ(version.out.rfind("loom ", 0), 0u) << version.out;
    EXPECT_NE(version.out.find("backends: cpu"), std::string::npos) << version.out;
    CliRun usage = run_loom_stdout("help");
    EXPECT_EQ(usage.status, 0);
    EXPECT_NE(usage.out.find("usage: loom <command>"), std::string::npos) << usage.out;
    CliRun help_train = run_loom_stdout("help train"), train_help = run_loom_stdout("train --help");
    EXPECT_EQ(help_train.status, 0);
    EXPECT_EQ(help_train.out, train_help.out);
    EXPECT_NE(help_train.out.find("--tensor-model-parallel-size"), std::string::npos);
    CliRun unknown = run_loom_stdout("help nonsense");
    EXPECT_EQ(unknown.status, 2);
}

// The CUDA backend is a plugin (apps/loom/cuda_plugin.cpp): loom itself needs no CUDA library, a CPU run
// never opens one (LD_DEBUG=files lists every object the loader opens), `--device cuda` without the plugin
// says which file could not be loaded and why, and `--version` loads it to count the GPUs.
TEST(LoomCli, TheCudaBackendIsAPluginThatACpuRunNeverOpens) {
#ifndef LOOM_CUDA_PLUGIN_PATH
    GTEST_SKIP() << "this build has no CUDA backend (LOOM_CUDA=OFF): no plugin to check";
#else
    const std::string loom = LOOM_CLI_PATH;
    CliRun            needed = run_command("readelf -d " + loom + " 2>&1");
    EXPECT_NE(needed.out.find("(NEEDED)"), std::string::npos) << needed.out;
    for (const char * lib : {"libcudart", "libcublas", "libnccl"}) {
        EXPECT_EQ(needed.out.find(lib), std::string::npos) << "loom needs " << lib << ":\n" << needed.out;
    }
    CliRun plugin = run_command(std::string("readelf -d ") + LOOM_CUDA_PLUGIN_PATH + " 2>&1");
    EXPECT_NE(plugin.out.find("libcudart"), std::string::npos) << plugin.out;

    CliRun cpu = run_command("LD_DEBUG=files " + loom +
                             " train --device cpu --mock-data --train-iters 2 --log-interval 1 --num-layers 1 "
                             "--hidden-size 32 --num-attention-heads 2 --seq-length 16 --micro-batch-size 1 2>&1");
    EXPECT_EQ(cpu.status, 0) << cpu.out;
    EXPECT_NE(cpu.out.find("lm loss"), std::string::npos) << cpu.out;
    for (const char * lib : {"libloom_cuda", "libcudart", "libcublas", "libnccl"}) {
        EXPECT_EQ(cpu.out.find(lib), std::string::npos) << "a CPU run opened " << lib;
    }

    CliRun missing = run_command("LOOM_CUDA_PLUGIN=/nonexistent/libloom_cuda.so " + loom +
                                 " train --device cuda --mock-data --train-iters 1 2>&1");
    EXPECT_NE(missing.status, 0) << missing.out;
    EXPECT_NE(missing.out.find("--device cuda: the CUDA backend /nonexistent/libloom_cuda.so could not be loaded"),
              std::string::npos)
        << missing.out;

    CliRun version = run_command("LD_DEBUG=files " + loom + " --version 2>&1");
    EXPECT_EQ(version.status, 0) << version.out;
    EXPECT_NE(version.out.find("libloom_cuda"), std::string::npos) << version.out;
    EXPECT_NE(version.out.find("cuda ("), std::string::npos) << version.out;
#endif
}
