// The caching allocator: size classes, reuse, pools, statistics, peak reset, device vs pinned.
#include "backend/cpu/cpu_device.h"
#include "core/allocator.h"
#include "core/error.h"
#include "core/tensor.h"

#include <gtest/gtest.h>

#include <cstdlib>
#include <set>
#include <type_traits>
#include <utility>

using namespace loom;

namespace {

// Counts what reaches the raw backend, to tell cache hits from real allocations.
class CountingMemory : public RawMemory {
public:
    explicit CountingMemory(int64_t * raw_calls, int64_t limit = INT64_MAX) : raw_calls_(raw_calls), limit_(limit) {}
    void * raw_alloc(size_t bytes) override {
        if (static_cast<int64_t>(held_ + bytes) > limit_) {
            return nullptr;
        }
        ++*raw_calls_;
        held_ += bytes;
        return std::malloc(bytes);
    }
    void raw_free(void * ptr, size_t bytes) override {
        held_ -= bytes;
        std::free(ptr);
    }

private:
    int64_t * raw_calls_;
    int64_t   limit_;
    size_t    held_ = 0;
};

}  // namespace

// Freeing runs in ~Storage, often while an exception (std::bad_alloc) unwinds: a throw there terminates.
static_assert(noexcept(std::declval<Allocator &>().deallocate(std::declval<const Block &>())),
              "Allocator::deallocate must not throw");
static_assert(std::is_nothrow_destructible_v<Storage>, "~Storage must not throw");

TEST(Allocator, SizeClassesHaveAtMostQuarterSlack) {
    EXPECT_EQ(Allocator::class_size(1), 512u);
    EXPECT_EQ(Allocator::class_size(512), 512u);
    EXPECT_EQ(Allocator::class_size(513), 640u);
    EXPECT_EQ(Allocator::class_size(1024), 1024u);
    EXPECT_EQ(Allocator::class_size(1025), 1280u);
    EXPECT_EQ(Allocator::class_size(size_t{100} << 20), size_t{100} << 20);
    EXPECT_EQ(Allocator::class_size((size_t{100} << 20) + 1), size_t{102} << 20);
    for (size_t n = 513; n < (size_t{1} << 24); n = n * 5 / 4 + 7) {
        size_t c = Allocator::class_size(n);
        EXPECT_GE(c, n);
        EXPECT_LE(c, n + n / 4 + 1) << n;
        EXPECT_EQ(Allocator::class_size(c), c) << "a class size is its own class";
    }
}

TEST(Allocator, StatisticsTrackRequestedAndReservedBytes) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw), MemoryKind::device, "test");
    Block     a = alloc.allocate(1000);
    Block     b = alloc.allocate(3000);
    AllocatorStats s = alloc.stats();
    EXPECT_EQ(s.allocated, 4000);
    EXPECT_EQ(s.reserved, static_cast<int64_t>(Allocator::class_size(1000) + Allocator::class_size(3000)));
    EXPECT_EQ(s.num_allocs, 2);
    EXPECT_EQ(s.active, 2);
    EXPECT_EQ(s.peak_allocated, 4000);
    alloc.deallocate(a);
    s = alloc.stats();
    EXPECT_EQ(s.allocated, 3000);
    EXPECT_EQ(s.peak_allocated, 4000);
    EXPECT_EQ(s.reserved, static_cast<int64_t>(Allocator::class_size(1000) + Allocator::class_size(3000)))
        << "a freed block stays reserved in the cache";
    EXPECT_EQ(s.num_frees, 1);
    EXPECT_EQ(s.active, 1);
    alloc.reset_peak();
    EXPECT_EQ(alloc.stats().peak_allocated, 3000);
    alloc.deallocate(b);
    alloc.empty_cache();
    EXPECT_EQ(alloc.stats().reserved, 0);
    EXPECT_EQ(alloc.stats().allocated, 0);
}

TEST(Allocator, FreedBlocksAreReusedWithinTheirSizeClassAndPool) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw), MemoryKind::device, "test");
    Block     a   = alloc.allocate(5000);
    void *    ptr = a.ptr;
    alloc.deallocate(a);
    Block b = alloc.allocate(4900);   // same class as 5000
    EXPECT_EQ(b.ptr, ptr);
    EXPECT_EQ(raw, 1) << "the second allocation is a cache hit";
    alloc.deallocate(b);
    // Another pool never receives this pool's cached block.
    Block c = alloc.allocate(5000, "graph");
    EXPECT_NE(c.ptr, ptr);
    EXPECT_EQ(raw, 2);
    alloc.deallocate(c);
    // Empty one pool's cache only.
    alloc.empty_cache("graph");
    EXPECT_EQ(alloc.pool_stats("graph").reserved, 0);
    EXPECT_GT(alloc.pool_stats(kDefaultPool).reserved, 0);
}

// While a graph is captured into its pool, a block of that pool the host frees stays allocated until the
// capture ends (a real backend's captured work holds it; the meta device's records nothing, and its plan
// must see the same pool), so no later allocation of the same capture reuses it. Once the capture has ended
// the pool's blocks are freed at once.
TEST(Allocator, ACaptureReusesNoBlockOfItsPoolFreedDuringIt) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw), MemoryKind::device, "test");
    alloc.begin_capture("g", "graphs");
    Block first = alloc.allocate(5000, kActivationsPool);   // captured: the graph's pool
    ASSERT_EQ(alloc.pool_stats("graphs").allocated, 5000);
    void * ptr = first.ptr;
    alloc.deallocate(first);
    EXPECT_EQ(alloc.pool_stats("graphs").allocated, 5000) << "held until the capture ends";
    Block second = alloc.allocate(5000, kActivationsPool);
    EXPECT_NE(second.ptr, ptr) << "the same capture does not reuse it";
    EXPECT_EQ(alloc.pool_stats("graphs").peak_allocated, 10000);
    alloc.end_capture();
    EXPECT_EQ(alloc.pool_stats("graphs").allocated, 5000) << "freed when the capture ended";
    Block third = alloc.allocate(5000, "graphs");
    EXPECT_EQ(third.ptr, ptr) << "a later allocation reuses it";
    alloc.deallocate(second);
    alloc.deallocate(third);
    EXPECT_EQ(alloc.pool_stats("graphs").allocated, 0);
}

TEST(Allocator, PoolsKeepSeparateStatistics) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw), MemoryKind::device, "test");
    Block     a = alloc.allocate(100, "weights");
    Block     b = alloc.allocate(200, "grads");
    Block     c = alloc.allocate(300, "grads");
    EXPECT_EQ(alloc.pool_stats("weights").allocated, 100);
    EXPECT_EQ(alloc.pool_stats("grads").allocated, 500);
    EXPECT_EQ(alloc.pool_stats("grads").num_allocs, 2);
    EXPECT_EQ(alloc.pool_stats("never").allocated, 0);
    EXPECT_EQ(alloc.stats().allocated, 600);
    std::set<std::string> names;
    for (const std::string & n : alloc.pool_names()) names.insert(n);
    EXPECT_EQ(names, (std::set<std::string>{"weights", "grads"}));
    alloc.deallocate(c);
    alloc.reset_peak();
    EXPECT_EQ(alloc.pool_stats("grads").peak_allocated, 200);
    alloc.deallocate(a);
    alloc.deallocate(b);
}

TEST(Allocator, OutOfMemoryReleasesTheCacheThenFailsWithAClearError) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw, 4096), MemoryKind::device, "small");
    Block     a = alloc.allocate(2048);
    alloc.deallocate(a);                    // cached: 2048 of the 4096 held
    Block b = alloc.allocate(3000);         // class 3072 needs the cache released first
    EXPECT_NE(b.ptr, nullptr);
    EXPECT_EQ(alloc.stats().reserved, static_cast<int64_t>(Allocator::class_size(3000)));
    try {
        alloc.allocate(4000);
        FAIL() << "expected an out-of-memory error";
    } catch (const Error & e) {
        EXPECT_NE(e.message().find("out of device memory"), std::string::npos) << e.what();
        EXPECT_FALSE(e.hint().empty());
    }
    alloc.deallocate(b);
}

TEST(Allocator, ZeroByteAllocationsAreCountedButHoldNothing) {
    int64_t   raw = 0;
    Allocator alloc(std::make_unique<CountingMemory>(&raw), MemoryKind::pinned_host, "test");
    Block     a = alloc.allocate(0);
    EXPECT_EQ(a.ptr, nullptr);
    EXPECT_EQ(alloc.stats().num_allocs, 1);
    EXPECT_EQ(alloc.stats().reserved, 0);
    alloc.deallocate(a);
    EXPECT_EQ(alloc.stats().active, 0);
}

TEST(Allocator, CpuDeviceAllocatorsAreAlignedForAvx512) {
    Allocator & alloc = cpu::device().allocator(MemoryKind::device);
    for (size_t n : {size_t{1}, size_t{100}, size_t{5000}, size_t{3} << 20}) {
        Block b = alloc.allocate(n, "align-test");
        EXPECT_EQ(reinterpret_cast<uintptr_t>(b.ptr) % 64, 0u) << n;
        alloc.deallocate(b);
    }
    EXPECT_EQ(cpu::device().allocator(MemoryKind::pinned_host).kind(), MemoryKind::pinned_host);
}
