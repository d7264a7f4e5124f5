// The CUDA backend: links against the toolkit everywhere; runs a kernel where a GPU is present.
#include "backend/cuda/cuda_device.h"

#include <gtest/gtest.h>

TEST(CudaBackend, LibrariesReportTheirVersions) {
    if (loom::LOOM_CUDA_NS::device_count() == 0) {
        GTEST_SKIP() << "no CUDA device on this machine: the CUDA backend was compiled and linked, not run";
    }
    std::string v = loom::LOOM_CUDA_NS::versions();
    EXPECT_NE(v.find("CUDA runtime"), std::string::npos);
    EXPECT_NE(v.find("NCCL"), std::string::npos);
}

TEST(CudaBackend, FillKernelMatchesTheHost) {
    if (loom::LOOM_CUDA_NS::device_count() == 0) {
        GTEST_SKIP() << "no CUDA device on this machine: the CUDA backend was compiled and linked, not run";
    }
    std::vector<float> out = loom::LOOM_CUDA_NS::fill_on_device(100003, 2.5f);
    ASSERT_EQ(out.size(), 100003u);
    for (float v : out) {
        ASSERT_EQ(v, 2.5f);
    }
}
