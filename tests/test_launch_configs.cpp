// Launch configurations written the way Megatron's functional tests write them (tests/launch_configs/*.yaml:
// ENV_VARS and MODEL_ARGS as in tests/functional_tests/test_cases/gpt/*/model_config.yaml, with tiny sizes),
// replayed under mpirun at their own TP x CP x PP x DP (x EP): each trains to exit 0 with its validation, TensorBoard
// files and checkpoints; a ckpt-resume configuration stops halfway (--exit-interval), then resumes from its
// checkpoint with the same command line and finishes.
#include "loom_cli_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <filesystem>
#include <fstream>
#include <map>
#include <sstream>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

const std::string kConfigs = std::string(LOOM_SOURCE_DIR) + "/tests/launch_configs";

std::vector<std::string> config_names() {
    std::vector<std::string> names;
    for (const auto & entry : fs::directory_iterator(kConfigs)) {
        if (entry.path().extension() == ".yaml") names.push_back(entry.path().stem().string());
    }
    std::sort(names.begin(), names.end());
    return names;
}

struct Config {
    int                                              ranks  = 1;
    bool                                             resume = false;
    std::vector<std::pair<std::string, std::string>> args;   // flag, value ("true": a switch)
};

// The subset of YAML these files use: "SECTION:" lines, then "  key: value" lines; '#' starts a comment.
Config read_config(const std::string & name) {
    std::ifstream in(kConfigs + "/" + name + ".yaml");
    Config        c;
    std::string   line, section;
    while (std::getline(in, line)) {
        if (const size_t hash = line.find(" #"); hash != std::string::npos) line.resize(hash);
        if (line.empty() || line[0] == '#') continue;
        const size_t colon = line.find(':');
        if (colon == std::string::npos) continue;
        std::string key   = line.substr(0, colon);
        std::string value = line.substr(colon + 1);
        value.erase(0, value.find_first_not_of(' '));
        value.erase(value.find_last_not_of(' ') + 1);
        if (line[0] != ' ') {
            section = key;
            continue;
        }
        key.erase(0, key.find_first_not_of(' '));
        if (section == "ENV_VARS" && key == "NUM_RANKS") c.ranks = std::stoi(value);
        if (section == "ENV_VARS" && key == "RESUME") c.resume = value == "true";
        if (section == "MODEL_ARGS") c.args.emplace_back(key, value);
    }
    return c;
}

// The command line a launcher builds from MODEL_ARGS: `true` is a bare flag, `false` leaves it out, and
// ${VAR} is the variable's value.
std::string command_line(const Config & c, const std::map<std::string, std::string> & vars) {
    std::string cmd = "train";
    for (auto [flag, value] : c.args) {
        if (value == "false") continue;
        for (const auto & [name, replacement] : vars) {
            for (size_t at; (at = value.find("${" + name + "}")) != std::string::npos;) {
                value.replace(at, name.size() + 3, replacement);
            }
        }
        cmd += " " + flag;
        if (value != "true") cmd += " " + value;
    }
    return cmd;
}

class LaunchConfig : public ::testing::TestWithParam<std::string> {
protected:
    // DATA_PATH: a GPT-2 BPE dataset of 240 documents (the fixture vocabulary) and its vocab/merges files.
    static void SetUpTestSuite() {
        data_ = fs::temp_directory_path() / ("loom_launch_data_" + std::to_string(::getpid()));
        fs::remove_all(data_);
        fs::create_directories(data_ + "/bpe");
        const std::string fixtures = std::string(LOOM_SOURCE_DIR) + "/tests/fixtures/bpe";
        fs::copy_file(fixtures + "/vocab.json", data_ + "/bpe/vocab.json");
        fs::copy_file(fixtures + "/merges.txt", data_ + "/bpe/merges.txt");
        std::ifstream            sample(fixtures + "/sample.txt");
        std::vector<std::string> lines;
        for (std::string line; std::getline(sample, line);) {
            if (!line.empty()) lines.push_back(line);
        }
        ASSERT_GE(lines.size(), 3u);
        std::ofstream jsonl(data_ + "/corpus.jsonl");
        for (size_t d = 0; d < 240; ++d) {   // whole lines, so no UTF-8 character is cut
            std::string text;
            for (size_t k = 0; k < 2 + d % 3; ++k) text += lines[(d + k) % lines.size()] + "\n";
            jsonl << nlohmann::json{{"text", text}}.dump() << "\n";
        }
        jsonl.close();
        CliRun r = run_loom("data --input " + data_ + "/corpus.jsonl --output-prefix " + data_ + "/my-gpt3_00 " +
                            "--vocab-file " + data_ + "/bpe/vocab.json --merge-file " + data_ + "/bpe/merges.txt");
        ASSERT_EQ(r.status, 0) << r.out;
    }
    static void TearDownTestSuite() { fs::remove_all(data_); }

    static std::string data_;
};

std::string LaunchConfig::data_;

TEST_P(LaunchConfig, TrainsToExitZeroAtItsOwnLayout) {
    const std::string name = GetParam();
    const Config      c    = read_config(name);
    ASSERT_FALSE(c.args.empty()) << name;
    const std::string run = fs::temp_directory_path() / ("loom_launch_" + name + "_" + std::to_string(::getpid()));
    fs::remove_all(run);
    const std::map<std::string, std::string> vars = {{"DATA_PATH", data_},
                                                     {"CHECKPOINT_SAVE_PATH", run + "/ckpt"},
                                                     {"CHECKPOINT_LOAD_PATH", run + "/ckpt"},
                                                     {"TENSORBOARD_PATH", run + "/tensorboard"},
                                                     {"DATA_CACHE_PATH", run + "/cache"}};
    const std::string cmd = command_line(c, vars);
    if (c.resume) {   // the first half, stopped by --exit-interval after its save
        CliRun first = run_loom_mpi(c.ranks, cmd + " --exit-interval 4");
        ASSERT_EQ(first.status, 0) << cmd << "\n" << first.out;
        EXPECT_NE(first.out.find("iteration        4/       8"), std::string::npos) << first.out;
        EXPECT_EQ(first.out.find("iteration        5/"), std::string::npos) << first.out;
    }
    CliRun r = run_loom_mpi(c.ranks, cmd);
    ASSERT_EQ(r.status, 0) << cmd << "\n" << r.out;
    if (c.resume) {
        EXPECT_NE(r.out.find("successfully loaded checkpoint from " + run + "/ckpt/iter_0000004 at iteration 4"),
                  std::string::npos)
            << r.out;
        EXPECT_EQ(r.out.find("iteration        4/       8"), std::string::npos) << "resumed after 4\n" << r.out;
    }
    EXPECT_NE(r.out.find("iteration        8/       8"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find(" validation loss at iteration 8 on validation set | lm loss value: "), std::string::npos)
        << r.out;
    EXPECT_TRUE(fs::is_directory(run + "/ckpt/iter_0000008")) << r.out;
    EXPECT_FALSE(fs::is_empty(run + "/tensorboard")) << r.out;
    fs::remove_all(run);
}

INSTANTIATE_TEST_SUITE_P(Megatron, LaunchConfig, ::testing::ValuesIn(config_names()),
                         [](const ::testing::TestParamInfo<std::string> & info) { return info.param; });

TEST(LaunchConfigs, AtLeastTwentyAreReplayed) { EXPECT_GE(config_names().size(), 20u); }

}  // namespace
