// The compute thread budget: parallel_for covers every index exactly once, concurrent callers share
// the pool, errors propagate.
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <atomic>
#include <cstdlib>
#include <thread>
#include <vector>

using namespace loom;

TEST(ThreadPool, BudgetIsPositive) {
    EXPECT_GE(num_threads(), 1);
}

TEST(ThreadPool, ParallelForCoversEveryIndexOnce) {
    for (int64_t n : {int64_t{0}, int64_t{1}, int64_t{7}, int64_t{1000}, int64_t{100003}}) {
        std::vector<std::atomic<int>> hits(static_cast<size_t>(n));
        parallel_for(n, 16, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) {
                hits[static_cast<size_t>(i)]++;
            }
        });
        for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(hits[static_cast<size_t>(i)].load(), 1) << "n=" << n << " i=" << i;
        }
    }
}

TEST(ThreadPool, ConcurrentCallersFromSeveralThreadsAllFinish) {
    std::atomic<int64_t> total{0};
    std::vector<std::thread> callers;
    for (int c = 0; c < 4; ++c) {
        callers.emplace_back([&] {
            for (int rep = 0; rep < 50; ++rep) {
                parallel_for(1000, 10, [&](int64_t b, int64_t e) { total += e - b; });
            }
        });
    }
    for (auto & t : callers) {
        t.join();
    }
    EXPECT_EQ(total.load(), 4 * 50 * 1000);
}

TEST(ThreadPool, ExceptionsReachTheCaller) {
    EXPECT_THROW(parallel_for(100, 1,
                              [](int64_t b, int64_t) {
                                  if (b == 0) throw std::runtime_error("chunk failed");
                              }),
                 std::runtime_error);
}

// Registered twice by ctest: plainly, and with LOOM_NUM_THREADS=3 (and LOOM_EXPECT_THREADS=3).
TEST(ThreadPool, BudgetFollowsLoomNumThreads) {
    const char * expected = std::getenv("LOOM_EXPECT_THREADS");
    if (expected == nullptr) {
        GTEST_SKIP() << "run by the test_thread_pool_env variant, which sets LOOM_NUM_THREADS";
    }
    EXPECT_EQ(num_threads(), std::atoi(expected));
}
