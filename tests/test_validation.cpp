// Validation during training (--eval-interval, --eval-iters): Megatron's report at every interval and after
// training, then on the test split ("on test set"), the same validation and test losses in every parallel layout as on one rank (forward-only pipeline
// schedule, the losses summed over pipeline and data-parallel ranks). Also the other quantities the log line
// can carry, --log-params-norm and --log-num-zeros-in-grad, the same in every layout.
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <regex>
#include <string>
#include <vector>

namespace {

const std::string kRun = "train --mock-data --train-iters 6 --eval-interval 3 --eval-iters 2 --log-interval 3 "
                         "--num-layers 4 --seq-length 32 --micro-batch-size 2 --global-batch-size 8 --lr-warmup-iters 1 ";

// Each report's (where, lm loss value) in order.
std::vector<std::pair<std::string, double>> reports(const std::string & out) {
    std::vector<std::pair<std::string, double>> found;
    const std::regex line(" validation loss at ([^|]+) \\| lm loss value: ([0-9.E+-]+) \\| lm loss PPL: [0-9.E+-]+ \\| ");
    for (std::sregex_iterator it(out.begin(), out.end(), line), end; it != end; ++it) {
        found.emplace_back((*it)[1].str(), std::strtod((*it)[2].str().c_str(), nullptr));
    }
    return found;
}

struct Layout {
    const char * name;
    int          np;
    const char * flags;
};

class Validation : public ::testing::TestWithParam<Layout> {};

// Tolerance: the layouts' training losses agree with one rank's to ~1e-6 relative over 6 iterations (TP and
// PP change summation orders); the validation loss, a mean over 2 x 8 x 32 tokens, is held to 2e-5 relative.
TEST_P(Validation, EveryLayoutReportsTheSingleRankLosses) {
    static const std::vector<std::pair<std::string, double>> single = [] {
        CliRun r = run_loom_mpi(1, kRun);
        EXPECT_EQ(r.status, 0) << r.out;
        return reports(r.out);
    }();
    ASSERT_EQ(single.size(), 4u) << "iterations 3 and 6, then after training on the validation and test splits";
    EXPECT_EQ(single[0].first, "iteration 3");
    EXPECT_EQ(single[1].first, "iteration 6");
    EXPECT_EQ(single[2].first, "iteration 6 on validation set");
    EXPECT_EQ(single[3].first, "iteration 6 on test set");
    EXPECT_NE(single[3].second, single[2].second) << "the test split's samples are not the validation split's";
    const Layout & l = GetParam();
    CliRun         r = run_loom_mpi(l.np, kRun + l.flags);
    ASSERT_EQ(r.status, 0) << r.out;
    const auto got = reports(r.out);
    ASSERT_EQ(got.size(), single.size()) << r.out;
    for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_EQ(got[i].first, single[i].first);
        EXPECT_NEAR(got[i].second, single[i].second, 2e-5 * single[i].second) << l.name << ": " << got[i].first;
    }
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, Validation,
    ::testing::Values(Layout{"dp2_zero1_overlaps", 2,
                             "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"},
                      Layout{"pp2", 2, "--pipeline-model-parallel-size 2"},
                      Layout{"pp2_vpp2", 2, "--pipeline-model-parallel-size 2 --num-virtual-stages-per-pipeline-rank 2"},
                      Layout{"tp2_sp", 2, "--tensor-model-parallel-size 2 --sequence-parallel"},
                      Layout{"tp2_pp2_dp2", 8, "--tensor-model-parallel-size 2 --pipeline-model-parallel-size 2"},
                      Layout{"pp2_dp2_tp_pp_dp_mapping", 4, "--pipeline-model-parallel-size 2 --use-tp-pp-dp-mapping"}),
    [](const ::testing::TestParamInfo<Layout> & info) { return std::string(info.param.name); });

// Without --eval-interval there is no validation; the report's format is Megatron's, dashes included.
TEST(ValidationReport, OnlyWithEvalIntervalAndInMegatronsFormat) {
    CliRun none = run_loom_mpi(1, "train --mock-data --train-iters 2 --log-interval 1 --num-layers 1");
    ASSERT_EQ(none.status, 0) << none.out;
    EXPECT_EQ(none.out.find("validation loss"), std::string::npos) << none.out;
    CliRun one = run_loom_mpi(1, "train --mock-data --train-iters 2 --eval-interval 2 --eval-iters 1 --num-layers 1");
    ASSERT_EQ(one.status, 0) << one.out;
    const size_t at = one.out.find(" validation loss at iteration 2 | lm loss value: ");
    ASSERT_NE(at, std::string::npos) << one.out;
    const size_t line_end = one.out.find('\n', at);
    const size_t width    = line_end - at + 1;   // Megatron prints len(string) + 1 dashes
    EXPECT_EQ(one.out.substr(line_end + 1, width), std::string(width, '-')) << one.out;
    CliRun bad = run_loom_mpi(1, "train --mock-data --eval-interval 0");
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("--eval-interval must be >= 1"), std::string::npos) << bad.out;
}

// --vocab-size 500 pads to 512: the 12 padded rows of the tied embedding never receive a gradient, so every
// layout counts exactly 12 x 128 zeros; the parameter norm is the single rank's. Without linear biases: the
// key bias's gradient is zero in exact arithmetic (it shifts a whole row of scores), so its rounded sums may
// be exactly zero or not depending on the order a layout adds them in.
TEST(LoggedNorms, ParamsNormAndNumZerosAreTheSingleRanksInEveryLayout) {
    const std::string run = "train --mock-data --train-iters 3 --num-layers 2 --log-interval 1 --vocab-size 500 "
                            "--global-batch-size 8 --micro-batch-size 4 --log-params-norm --log-num-zeros-in-grad "
                            "--disable-bias-linear ";
    const std::regex field(" num zeros: ([0-9.]+) \\| params norm: ([0-9.]+) \\|");
    auto last = [&](const CliRun & r) {
        std::pair<double, double> v{-1, -1};
        for (std::sregex_iterator it(r.out.begin(), r.out.end(), field), end; it != end; ++it) {
            v = {std::stod((*it)[1].str()), std::stod((*it)[2].str())};
        }
        return v;
    };
    CliRun single = run_loom_mpi(1, run);
    ASSERT_EQ(single.status, 0) << single.out;
    const auto want = last(single);
    EXPECT_EQ(want.first, 12.0 * 128.0) << single.out;
    EXPECT_GT(want.second, 1.0);
    for (const char * layout : {"--use-distributed-optimizer", "--tensor-model-parallel-size 2",
                                "--pipeline-model-parallel-size 2"}) {
        CliRun r = run_loom_mpi(2, run + layout);
        ASSERT_EQ(r.status, 0) << r.out;
        const auto got = last(r);
        EXPECT_EQ(got.first, want.first) << layout;
        EXPECT_NEAR(got.second, want.second, 1e-3) << layout << " (printed to 3 decimals)";
    }
}

}  // namespace

namespace {

// --timing-log-level 1: Megatron's timers block after each log line, every timer in every block, times
// (min <= max, both >= 0) gathered over all ranks; level 0 prints none.
TEST(TimingLog, LevelOnePrintsMegatronsTimersBlock) {
    const std::string run = "train --mock-data --train-iters 4 --num-layers 1 --log-interval 2 ";
    CliRun quiet = run_loom_mpi(1, run);
    ASSERT_EQ(quiet.status, 0) << quiet.out;
    EXPECT_EQ(quiet.out.find("time across ranks"), std::string::npos);
    CliRun r = run_loom_mpi(2, run + "--timing-log-level 1 --use-distributed-optimizer");
    ASSERT_EQ(r.status, 0) << r.out;
    const std::regex timer("\n    (forward-backward|all-grads-sync|optimizer) \\.+: \\(([0-9.]+), ([0-9.]+)\\)");
    int count = 0;
    for (std::sregex_iterator it(r.out.begin(), r.out.end(), timer), end; it != end; ++it, ++count) {
        EXPECT_LE(std::stod((*it)[2].str()), std::stod((*it)[3].str())) << (*it)[0].str();
    }
    EXPECT_EQ(count, 6) << "three timers after each of two log lines\n" << r.out;
    size_t blocks = 0;
    for (size_t at = r.out.find("(min, max) time across ranks (ms):"); at != std::string::npos;
         at = r.out.find("(min, max) time across ranks (ms):", at + 1)) {
        ++blocks;
    }
    EXPECT_EQ(blocks, 2u);
    CliRun bad = run_loom_mpi(1, run + "--timing-log-level 3");
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("--timing-log-level must be 0, 1 or 2"), std::string::npos) << bad.out;
}

// --timing-log-option: Megatron's other two forms of the block, each rank's time ("all", rank by rank, in
// Megatron's layout) or the most over the ranks ("max", one number per timer). A value outside the choices is
// refused as argparse refuses it.
TEST(TimingLog, TimingLogOptionPrintsMaxOrEveryRank) {
    const std::string run = "train --mock-data --train-iters 2 --num-layers 1 --log-interval 2 --timing-log-level 1 ";
    const CliRun      all = run_loom_mpi(2, run + "--timing-log-option all");
    ASSERT_EQ(all.status, 0) << all.out;
    const size_t at = all.out.find("times across ranks (ms):");
    ASSERT_NE(at, std::string::npos) << all.out;
    double per_rank[3][2];
    ASSERT_EQ(std::sscanf(all.out.c_str() + at,
                          "times across ranks (ms):\n  forward-backward:\n     rank  0: %lf\n     rank  1: %lf\n"
                          "  all-grads-sync:\n     rank  0: %lf\n     rank  1: %lf\n"
                          "  optimizer:\n     rank  0: %lf\n     rank  1: %lf",
                          &per_rank[0][0], &per_rank[0][1], &per_rank[1][0], &per_rank[1][1], &per_rank[2][0],
                          &per_rank[2][1]), 6) << all.out.substr(at);
    for (const auto & timer : per_rank) EXPECT_GE(std::min(timer[0], timer[1]), 0.0);
    const CliRun most = run_loom_mpi(2, run + "--timing-log-option max");
    ASSERT_EQ(most.status, 0) << most.out;
    const std::regex max_line("\n    (forward-backward|all-grads-sync|optimizer) \\.+: [0-9]");
    EXPECT_NE(most.out.find("max time across ranks (ms):"), std::string::npos) << most.out;
    EXPECT_EQ(std::distance(std::sregex_iterator(most.out.begin(), most.out.end(), max_line), std::sregex_iterator()), 3)
        << "one number per timer\n" << most.out;
    const CliRun bad = run_loom_mpi(1, run + "--timing-log-option median");
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("argument --timing-log-option: invalid choice: 'median' (choose from 'max', 'minmax', 'all')"),
              std::string::npos) << bad.out;
}

}  // namespace
