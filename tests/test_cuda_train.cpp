// `loom train --device cuda` against `--device cpu` (label gpu): the same model, data and seed trained for 20
// iterations in bf16 on the GPU follows the CPU run's loss curve within 1e-3 relative, on one GPU, with
// the hybrid optimizer offloading half the state over pinned memory, and on two ranks sharing one GPU
// through NCCL (each rank claims its own host with NCCL_HOSTID, as tests/test_nccl_mpi.cpp does). Without
// a GPU these skip, and `--device cuda` is refused naming the flag.
//
// Tolerance: both runs round the same bf16 operands, but cuBLASLt and the CPU's GEMMs sum in different
// orders (f32 accumulation), so per-iteration losses drift apart by rounding only; 1e-3 relative over 20
// iterations is the bound, three orders above the drift seen between CPU layouts (~1e-6).
#include "backend/cuda/cuda_device.h"
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstdlib>
#include <string>
#include <vector>

namespace {

const std::string kRun = "train --mock-data --bf16 --train-iters 20 --log-interval 1 --num-layers 2 --hidden-size 64 "
                         "--num-attention-heads 4 --seq-length 64 --micro-batch-size 2 --global-batch-size 8 "
                         "--lr 1e-3 --lr-warmup-iters 2 ";

// The lm loss of every logged iteration, in order.
std::vector<double> losses(const std::string & out) {
    std::vector<double> found;
    for (size_t at = out.find("lm loss: "); at != std::string::npos; at = out.find("lm loss: ", at + 1)) {
        found.push_back(std::strtod(out.c_str() + at + 9, nullptr));
    }
    return found;
}

const std::vector<double> & cpu_curve() {
    static const std::vector<double> curve = [] {
        CliRun r = run_loom_mpi(1, kRun + "--device cpu");
        EXPECT_EQ(r.status, 0) << r.out;
        return losses(r.out);
    }();
    return curve;
}

void expect_follows_cpu(const CliRun & r, const char * what) {
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find(" on cuda:"), std::string::npos) << "the run names its GPU\n" << r.out;
    const std::vector<double> got = losses(r.out), & want = cpu_curve();
    ASSERT_EQ(want.size(), 20u);
    ASSERT_EQ(got.size(), want.size()) << r.out;
    for (size_t i = 0; i < got.size(); ++i) {
        EXPECT_NEAR(got[i], want[i], 1e-3 * want[i]) << what << ", iteration " << i + 1;
    }
    EXPECT_LT(got.back(), got.front()) << what << ": the loss falls";
}

#define SKIP_WITHOUT_CUDA()                                                                                      \
    if (loom::cuda::device_count() == 0) GTEST_SKIP() << "no CUDA device visible: `loom train --device cuda` not run"

}  // namespace

TEST(CudaTrain, DeviceCudaIsRefusedNamingTheFlagWithoutAGpu) {
    if (loom::cuda::device_count() > 0) GTEST_SKIP() << "a GPU is visible: the refusal does not apply";
    CliRun r = run_loom_mpi(1, kRun + "--device cuda");
    EXPECT_EQ(r.status, 2) << r.out;
    EXPECT_NE(r.out.find("--device cuda: no CUDA device is visible"), std::string::npos) << r.out;
}

TEST(CudaTrain, OneGpuFollowsTheCpuLossCurveInBf16) {
    SKIP_WITHOUT_CUDA();
    expect_follows_cpu(run_loom_mpi(1, kRun + "--device cuda"), "one GPU");
}

TEST(CudaTrain, HybridOptimizerOffloadOverPinnedMemoryFollowsTheCpu) {
    SKIP_WITHOUT_CUDA();
    expect_follows_cpu(run_loom_mpi(1, kRun + "--device cuda --use-distributed-optimizer --optimizer-cpu-offload "
                                              "--optimizer-offload-fraction 0.5 --overlap-cpu-optimizer-d2h-h2d"),
                       "hybrid optimizer");
}

struct Layout {
    const char * name;
    const char * flags;
};

class CudaTrainTwoRanks : public ::testing::TestWithParam<Layout> {};

TEST_P(CudaTrainTwoRanks, FollowTheCpuThroughNccl) {
    SKIP_WITHOUT_CUDA();
    const Layout & l = GetParam();
    // Each rank its own NCCL host id, so NCCL accepts two ranks on one GPU.
    const std::string command = std::string(LOOM_MPIEXEC) + " --oversubscribe -np 2 sh -c 'NCCL_HOSTID=loom-test-$OMPI_COMM_WORLD_RANK exec " +
                                LOOM_CLI_PATH + " " + kRun + "--device cuda " + l.flags + "' 2>&1";
    expect_follows_cpu(run_command(command), l.name);
}

INSTANTIATE_TEST_SUITE_P(
    Layouts, CudaTrainTwoRanks,
    ::testing::Values(Layout{"dp2_zero1_overlaps", "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"},
                      Layout{"tp2_sp", "--tensor-model-parallel-size 2 --sequence-parallel"},
                      Layout{"pp2", "--pipeline-model-parallel-size 2"}),
    [](const ::testing::TestParamInfo<Layout> & info) { return std::string(info.param.name); });
