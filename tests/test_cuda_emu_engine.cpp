// The emulated CUDA device's kernel engine (backend/cuda_emu/kernel_engine.cpp, loom_emu/device.h): grids cover
// their indices, block barriers and warp collectives give CUDA's results, atomics are atomic, launches are
// checked as CUDA checks them, and a kernel that cannot finish (a divergent barrier) or throws is reported
// instead of hanging. Most kernels run through loom_emu::run_kernel (at once, on the test's thread); the
// launch checks go through LOOM_LAUNCH and the runtime's last error.
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <stdexcept>
#include <string>
#include <thread>
#include <tuple>
#include <vector>

namespace {

// The message of the exception run() throws, or "" when it throws none.
template <typename Run>
std::string failure_of(Run run) {
    try {
        run();
    } catch (const std::exception & e) {
        return e.what();
    }
    return "";
}

// ---- Kernels

__global__ void count_indices(int * hits, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
        atomicAdd(&hits[i], 1);
    }
}

__global__ void add_one(float * x, int64_t n) {
    for (int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x; i < n;
         i += static_cast<int64_t>(blockDim.x) * gridDim.x) {
        x[i] = x[i] + 1.0f;
    }
}

// Every thread of a 3-D grid of 3-D blocks records its global coordinates at its own linear index.
__global__ void record_coordinates(int * hits, unsigned * coords) {
    const unsigned tx = blockIdx.x * blockDim.x + threadIdx.x, ty = blockIdx.y * blockDim.y + threadIdx.y,
                   tz = blockIdx.z * blockDim.z + threadIdx.z;
    const unsigned w = gridDim.x * blockDim.x, h = gridDim.y * blockDim.y;
    const unsigned i = tx + w * (ty + h * tz);
    atomicAdd(&hits[i], 1);
    coords[3 * i]     = tx;
    coords[3 * i + 1] = ty;
    coords[3 * i + 2] = tz;
}

// A block's sum: warps reduce with __shfl_down_sync, warp 0 reduces the warps' sums from shared memory.
// Assumes whole warps (blockDim.x a multiple of 32).
__global__ void block_sums(const float * x, float * out) {
    __shared__ float warp_sums[32];
    const unsigned lane = threadIdx.x % 32, warp = threadIdx.x / 32;
    float          v    = x[blockIdx.x * blockDim.x + threadIdx.x];
    for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
    if (lane == 0) warp_sums[warp] = v;
    __syncthreads();
    if (warp == 0) {
        v = lane < blockDim.x / 32 ? warp_sums[lane] : 0.0f;
        for (int offset = 16; offset > 0; offset /= 2) v += __shfl_down_sync(0xffffffffu, v, offset);
        if (lane == 0) out[blockIdx.x] = v;
    }
}

// The same in double, through two rounds of shared memory (tree over the block).
__global__ void block_tree_sum(const double * x, double * out) {
    __shared__ double partial[1024];
    const unsigned t = threadIdx.x;
    partial[t]       = x[blockIdx.x * blockDim.x + t];
    __syncthreads();
    for (unsigned stride = 1; stride < blockDim.x; stride *= 2) {   // any block size
        if (t % (2 * stride) == 0 && t + stride < blockDim.x) partial[t] += partial[t + stride];
        __syncthreads();
    }
    if (t == 0) out[blockIdx.x] = partial[0];
}

// out[t] = butterfly sum and max over the warp, plus the broadcasts and scans of the other shuffles.
__global__ void warp_shuffles(int * sum, int * max_of, int * from_lane_5, int * scan, int * down_by_1, double * dsum) {
    const int lane = static_cast<int>(threadIdx.x % 32);
    const int t    = static_cast<int>(threadIdx.x);
    int       s = t, m = (t * 7) % 32;
    double    d = 0.5 * t;
    for (int o = 16; o > 0; o >>= 1) {
        s += __shfl_xor_sync(0xffffffffu, s, o);
        m = max(m, __shfl_xor_sync(0xffffffffu, m, o));
        d += __shfl_xor_sync(0xffffffffu, d, o);
    }
    sum[t]         = s;
    max_of[t]      = m;
    dsum[t]        = d;
    from_lane_5[t] = __shfl_sync(0xffffffffu, t, 5);
    int v          = 1;
    for (int o = 1; o < 32; o <<= 1) {
        const int up = __shfl_up_sync(0xffffffffu, v, o);
        if (lane >= o) v += up;
    }
    scan[t]      = v;
    down_by_1[t] = __shfl_down_sync(0xffffffffu, t, 1);
}

__global__ void shuffle_in_segments(int * down, int * xor_out, int * idx) {
    const int t = static_cast<int>(threadIdx.x);
    down[t]     = __shfl_down_sync(0xffffffffu, t, 2, 8);
    xor_out[t]  = __shfl_xor_sync(0xffffffffu, t, 4, 8);
    idx[t]      = __shfl_sync(0xffffffffu, t, 9, 8);   // lane 9 % 8 = 1 of each segment of 8
}

__global__ void votes(unsigned * ballot, int * any_even, int * all_small, int * counts) {
    const int t  = static_cast<int>(threadIdx.x);
    ballot[t]    = __ballot_sync(0xffffffffu, t % 3 == 0);
    any_even[t]  = __any_sync(0xffffffffu, t == 7);
    all_small[t] = __all_sync(0xffffffffu, t < 40);
    counts[t]    = __syncthreads_count(t % 4 == 0) * 100 + __syncthreads_and(t >= 0) * 10 + __syncthreads_or(t == 1000);
}

__global__ void atomics(float * fsum, double * dsum, int * isum, unsigned long long * usum, int * imin,
                        unsigned long long * umax, long long * lmin, int * cas_winner, int * exch) {
    const int t = static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x);
    atomicAdd(fsum, 1.0f);
    atomicAdd(dsum, 0.5);
    atomicAdd(isum, t);
    atomicAdd(usum, static_cast<unsigned long long>(t) << 32);
    atomicMin(imin, 1000 - t);
    atomicMax(umax, static_cast<unsigned long long>(t) * 3);
    atomicMin(lmin, -static_cast<long long>(t) * 5);
    atomicCAS(cas_winner, -1, t);   // the first thread to come wins
    atomicExch(exch, 7);
}

__global__ void poisoned_shared(unsigned * first_word, uintptr_t * address) {
    LOOM_DYNAMIC_SHARED(unsigned, smem);
    if (threadIdx.x == 0) {
        *first_word = smem[0];   // read before anything is written: the poison
        *address    = reinterpret_cast<uintptr_t>(smem);
    }
    __syncthreads();
    smem[threadIdx.x] = threadIdx.x;
}

__global__ void uses_dynamic_shared(float * out) {
    LOOM_DYNAMIC_SHARED(float, smem);
    smem[threadIdx.x] = 1.0f;
    __syncthreads();
    if (threadIdx.x == 0) *out = smem[blockDim.x - 1];
}

__global__ void raised_limit_kernel(float * out) {
    LOOM_DYNAMIC_SHARED(float, smem);
    smem[16 * 1024] = 2.0f;   // past the default 48 KiB
    *out            = smem[16 * 1024];
}

// Lane 0 waits at __syncthreads while its warp's other lanes wait at a shuffle that needs lane 0.
__global__ void warp_op_against_barrier(int * out) {
    if (threadIdx.x == 0) {
        __syncthreads();
    } else {
        out[threadIdx.x] = __shfl_sync(0xffffffffu, static_cast<int>(threadIdx.x), 0);
    }
}

// The lower half waits at one __syncthreads, the upper half at another.
__global__ void divergent_syncthreads(int * out) {
    if (threadIdx.x < blockDim.x / 2) {
        __syncthreads();
        out[threadIdx.x] = 1;
    } else {
        __syncthreads();
        out[threadIdx.x] = 2;
    }
}

// Threads that exit do not hold up the others' barrier or warp collective (CUDA's rule).
__global__ void early_exit(int * out) {
    __shared__ int shared_value;
    if (threadIdx.x % 2 == 1) return;
    if (threadIdx.x == 0) shared_value = 42;
    __syncthreads();
    const int v      = __shfl_xor_sync(0xffffffffu, static_cast<int>(threadIdx.x), 2);   // odd lanes are inactive
    out[threadIdx.x] = shared_value + v;
}

// Reads a neighbour's slot without a barrier: the result depends on the order the threads run in.
__global__ void racy_neighbour(int * out) {
    LOOM_DYNAMIC_SHARED(int, slots);
    slots[threadIdx.x] = static_cast<int>(threadIdx.x) + 1;
    out[threadIdx.x]   = slots[(threadIdx.x + 1) % blockDim.x];
}

__global__ void synced_neighbour(int * out) {
    LOOM_DYNAMIC_SHARED(int, slots);
    slots[threadIdx.x] = static_cast<int>(threadIdx.x) + 1;
    __syncthreads();
    out[threadIdx.x] = slots[(threadIdx.x + 1) % blockDim.x];
}

__device__ void check_value(int v) {
    if (v == 3) throw std::runtime_error("value 3 is not allowed");
}

__global__ void throws_in_helper(int * out) {
    __syncthreads();
    check_value(static_cast<int>(blockIdx.x * blockDim.x + threadIdx.x));
    out[blockIdx.x * blockDim.x + threadIdx.x] = 1;
}

// Large locals on the fiber stack, alive across a barrier.
__global__ void big_locals(int * out) {
    int local[4096];
    for (int i = 0; i < 4096; ++i) local[i] = i + static_cast<int>(threadIdx.x);
    __syncthreads();
    int64_t s = 0;
    for (int i = 0; i < 4096; ++i) s += local[i];
    out[threadIdx.x] = static_cast<int>(s % 1000003);
}

__global__ void exact_rounding(const float * a, const float * b, const float * c, float * separate, float * fused) {
    const unsigned i = threadIdx.x;
    separate[i]      = __fadd_rn(__fmul_rn(a[i], b[i]), c[i]);
    fused[i]         = __fmaf_rn(a[i], b[i], c[i]);
}

// ---- Tests

TEST(CudaEmuEngine, GridStrideCoversEveryIndexOnce) {
    for (const auto & [blocks, threads, n] : std::vector<std::tuple<unsigned, unsigned, int64_t>>{
             {1, 1, 5}, {1, 32, 1000}, {7, 96, 10007}, {64, 256, 65536}, {3, 1024, 100000}}) {
        std::vector<int> hits(static_cast<size_t>(n), 0);
        loom_emu::run_kernel(count_indices, "count_indices", dim3(blocks), dim3(threads), 0, hits.data(), n);
        for (int64_t i = 0; i < n; ++i) {
            ASSERT_EQ(hits[static_cast<size_t>(i)], 1) << "blocks " << blocks << " threads " << threads << " i " << i;
        }
    }
}

TEST(CudaEmuEngine, ThreeDimensionalIndicesCoverTheGrid) {
    const dim3       grid(3, 2, 2), block(4, 2, 5);
    const unsigned   w = 12, h = 4, d = 10, total = w * h * d;
    std::vector<int> hits(total, 0);
    std::vector<unsigned> coords(3 * total, ~0u);
    loom_emu::run_kernel(record_coordinates, "record_coordinates", grid, block, 0, hits.data(), coords.data());
    for (unsigned i = 0; i < total; ++i) {
        ASSERT_EQ(hits[i], 1) << i;
        EXPECT_EQ(coords[3 * i], i % w);
        EXPECT_EQ(coords[3 * i + 1], i / w % h);
        EXPECT_EQ(coords[3 * i + 2], i / (w * h));
    }
}

TEST(CudaEmuEngine, BlockReductionIsExact) {
    for (unsigned threads : {32u, 96u, 256u, 1024u}) {
        const unsigned     blocks = 5;
        std::vector<float> x(blocks * threads);
        for (size_t i = 0; i < x.size(); ++i) x[i] = static_cast<float>(i % 97) - 13.0f;   // exact in f32
        std::vector<float> out(blocks, -1.0f);
        loom_emu::run_kernel(block_sums, "block_sums", dim3(blocks), dim3(threads), 0, x.data(), out.data());
        for (unsigned b = 0; b < blocks; ++b) {
            double expected = 0;
            for (unsigned t = 0; t < threads; ++t) expected += x[b * threads + t];
            EXPECT_EQ(out[b], static_cast<float>(expected)) << "threads " << threads << " block " << b;
        }

        std::vector<double> xd(blocks * threads);
        for (size_t i = 0; i < xd.size(); ++i) xd[i] = 0.25 * static_cast<double>(i % 1001);
        std::vector<double> outd(blocks, -1.0);
        loom_emu::run_kernel(block_tree_sum, "block_tree_sum", dim3(blocks), dim3(threads), 0, xd.data(),
                             outd.data());
        for (unsigned b = 0; b < blocks; ++b) {
            double expected = 0;
            for (unsigned t = 0; t < threads; ++t) expected += xd[b * threads + t];
            EXPECT_EQ(outd[b], expected) << "threads " << threads << " block " << b;
        }
    }
}

TEST(CudaEmuEngine, WarpShufflesFollowCudaLaneRules) {
    const unsigned      threads = 64;
    std::vector<int>    sum(threads), max_of(threads), lane5(threads), scan(threads), down(threads);
    std::vector<double> dsum(threads);
    loom_emu::run_kernel(warp_shuffles, "warp_shuffles", dim3(1), dim3(threads), 0, sum.data(), max_of.data(),
                         lane5.data(), scan.data(), down.data(), dsum.data());
    for (unsigned t = 0; t < threads; ++t) {
        const int warp_base = static_cast<int>(t / 32 * 32), lane = static_cast<int>(t % 32);
        int       expected_sum = 0;
        for (int l = 0; l < 32; ++l) expected_sum += warp_base + l;
        EXPECT_EQ(sum[t], expected_sum) << t;
        EXPECT_EQ(dsum[t], 0.5 * expected_sum) << t;
        EXPECT_EQ(max_of[t], 31) << t;   // (t * 7) % 32 takes every value over a warp
        EXPECT_EQ(lane5[t], warp_base + 5) << t;
        EXPECT_EQ(scan[t], lane + 1) << t;
        EXPECT_EQ(down[t], lane == 31 ? static_cast<int>(t) : static_cast<int>(t) + 1) << t;   // own value past the end
    }

    std::vector<int> seg_down(32), seg_xor(32), seg_idx(32);
    loom_emu::run_kernel(shuffle_in_segments, "shuffle_in_segments", dim3(1), dim3(32), 0, seg_down.data(),
                         seg_xor.data(), seg_idx.data());
    for (int t = 0; t < 32; ++t) {
        EXPECT_EQ(seg_down[t], t % 8 + 2 < 8 ? t + 2 : t) << t;
        EXPECT_EQ(seg_xor[t], t ^ 4) << t;
        EXPECT_EQ(seg_idx[t], t / 8 * 8 + 1) << t;
    }
}

TEST(CudaEmuEngine, VotesAndCountingBarriers) {
    const unsigned        threads = 64;
    std::vector<unsigned> ballot(threads);
    std::vector<int>      any(threads), all(threads), counts(threads);
    loom_emu::run_kernel(votes, "votes", dim3(1), dim3(threads), 0, ballot.data(), any.data(), all.data(),
                         counts.data());
    unsigned expected_ballot[2] = {0, 0};
    for (unsigned t = 0; t < threads; ++t) {
        if (t % 3 == 0) expected_ballot[t / 32] |= 1u << (t % 32);
    }
    for (unsigned t = 0; t < threads; ++t) {
        EXPECT_EQ(ballot[t], expected_ballot[t / 32]) << t;
        EXPECT_EQ(any[t], t < 32 ? 1 : 0) << t;
        EXPECT_EQ(all[t], t < 32 ? 1 : 0) << t;
        EXPECT_EQ(counts[t], 16 * 100 + 10 + 0) << t;
    }
}

TEST(CudaEmuEngine, AtomicsAreExact) {
    float              fsum = 0.0f;
    double             dsum = 0.0;
    int                isum = 0, imin = 1 << 30, cas_winner = -1, exch = 0;
    unsigned long long usum = 0, umax = 0;
    long long          lmin = 0;
    const unsigned     blocks = 8, threads = 128, n = blocks * threads;
    loom_emu::run_kernel(atomics, "atomics", dim3(blocks), dim3(threads), 0, &fsum, &dsum, &isum, &usum, &imin, &umax,
                         &lmin, &cas_winner, &exch);
    EXPECT_EQ(fsum, static_cast<float>(n));
    EXPECT_EQ(dsum, 0.5 * n);
    EXPECT_EQ(isum, static_cast<int>(n * (n - 1) / 2));
    EXPECT_EQ(usum, (static_cast<unsigned long long>(n) * (n - 1) / 2) << 32);
    EXPECT_EQ(imin, 1000 - static_cast<int>(n - 1));
    EXPECT_EQ(umax, static_cast<unsigned long long>(n - 1) * 3);
    EXPECT_EQ(lmin, -static_cast<long long>(n - 1) * 5);
    EXPECT_GE(cas_winner, 0);   // exactly one thread won (thread 0 unless LOOM_EMU_SHUFFLE reorders them)
    EXPECT_LT(cas_winner, static_cast<int>(n));
    EXPECT_EQ(exch, 7);
}

// Grids on two OS threads at once (as on two streams) add to the same counters: the atomics are real, and
// each OS thread's blocks have their own shared memory.
TEST(CudaEmuEngine, GridsOnSeveralThreadsShareAtomicsNotSharedMemory) {
    const unsigned   blocks = 64, threads = 256;
    const int64_t    n      = 1 << 16;
    std::vector<int> hits(static_cast<size_t>(n), 0);
    std::vector<float> x(blocks * threads, 1.0f);
    std::vector<std::vector<float>> sums(4, std::vector<float>(blocks, 0.0f));
    std::vector<std::thread> workers;
    for (int w = 0; w < 4; ++w) {
        workers.emplace_back([&, w] {
            loom_emu::run_kernel(count_indices, "count_indices", dim3(blocks), dim3(threads), 0, hits.data(), n);
            loom_emu::run_kernel(block_sums, "block_sums", dim3(blocks), dim3(threads), 0, x.data(),
                                 sums[static_cast<size_t>(w)].data());
        });
    }
    for (std::thread & t : workers) t.join();
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(hits[static_cast<size_t>(i)], 4) << i;
    for (const std::vector<float> & s : sums) {
        for (float v : s) EXPECT_EQ(v, static_cast<float>(threads));
    }
}

TEST(CudaEmuEngine, RoundingIntrinsicsAreNotFused) {
    // a * b + c where the product's rounding matters: 1 + 2^-23 squared is 1 + 2^-22 + 2^-46.
    const float a = 1.0f + 0x1p-23f;
    std::vector<float> va(32, a), vb(32, a), vc(32, -(1.0f + 0x1p-22f)), separate(32), fused(32);
    loom_emu::run_kernel(exact_rounding, "exact_rounding", dim3(1), dim3(32), 0, va.data(), vb.data(), vc.data(),
                         separate.data(), fused.data());
    EXPECT_EQ(separate[0], 0.0f);
    EXPECT_EQ(fused[0], 0x1p-46f);
}

TEST(CudaEmuEngine, DynamicSharedMemoryIsPoisonedAndAligned) {
    for (int rep = 0; rep < 2; ++rep) {   // the second run sees the poison again, not the first run's writes
        unsigned  first = 0;
        uintptr_t address = 1;
        loom_emu::run_kernel(poisoned_shared, "poisoned_shared", dim3(2), dim3(64), 64 * sizeof(unsigned), &first,
                             &address);
        EXPECT_EQ(first, 0xffffffffu);
        EXPECT_EQ(address % 16, 0u);
    }
}

TEST(CudaEmuEngine, LaunchesAreCheckedAsCudaChecksThem) {
    cudaGetLastError();   // start clean
    float out = 0.0f;

    // Within the default 48 KiB: runs.
    LOOM_LAUNCH(uses_dynamic_shared, 1, 32, 48 * 1024, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(out, 1.0f);

    // Past it without the attribute: refused, nothing runs.
    out = 0.0f;
    LOOM_LAUNCH(uses_dynamic_shared, 1, 32, 48 * 1024 + 4, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(out, 0.0f);

    // With the attribute raised: runs.
    ASSERT_EQ(cudaFuncSetAttribute(raised_limit_kernel, cudaFuncAttributeMaxDynamicSharedMemorySize, 96 * 1024),
              cudaSuccess);
    LOOM_LAUNCH(raised_limit_kernel, 1, 1, 96 * 1024, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(out, 2.0f);
    LOOM_LAUNCH(raised_limit_kernel, 1, 1, 96 * 1024 + 4, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);

    // Bad shapes.
    LOOM_LAUNCH(uses_dynamic_shared, 1, 0, 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    LOOM_LAUNCH(uses_dynamic_shared, 1, 1025, 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    LOOM_LAUNCH(uses_dynamic_shared, 1, dim3(32, 32, 2), 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    LOOM_LAUNCH(uses_dynamic_shared, 1, dim3(1, 1, 65), 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    LOOM_LAUNCH(uses_dynamic_shared, 0, 32, 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    LOOM_LAUNCH(uses_dynamic_shared, dim3(1, 65536), 32, 0, nullptr)(&out);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidConfiguration);
    ASSERT_EQ(cudaDeviceSynchronize(), cudaSuccess);
    EXPECT_EQ(out, 2.0f);   // none of them ran
}

TEST(CudaEmuEngine, WarpCollectiveAgainstBarrierIsReportedNotHung) {
    std::vector<int>  out(64, 0);
    const std::string message = failure_of([&] {
        loom_emu::run_kernel(warp_op_against_barrier, "warp_op_against_barrier", dim3(2), dim3(64), 0, out.data());
    });
    EXPECT_NE(message.find("warp_op_against_barrier"), std::string::npos) << message;
    EXPECT_NE(message.find("__syncthreads"), std::string::npos) << message;
    EXPECT_NE(message.find("__shfl_sync"), std::string::npos) << message;
    EXPECT_NE(message.find("block (0, 0, 0)"), std::string::npos) << message;
}

TEST(CudaEmuEngine, DivergentSyncthreadsIsReported) {
    std::vector<int>  out(64, 0);
    const std::string message = failure_of([&] {
        loom_emu::run_kernel(divergent_syncthreads, "divergent_syncthreads", dim3(1), dim3(64), 0, out.data());
    });
    EXPECT_NE(message.find("divergent_syncthreads"), std::string::npos) << message;
    EXPECT_NE(message.find("different places"), std::string::npos) << message;
}

TEST(CudaEmuEngine, ExitedThreadsDoNotHoldUpBarriers) {
    std::vector<int> out(64, -1);
    loom_emu::run_kernel(early_exit, "early_exit", dim3(3), dim3(64), 0, out.data());
    for (int t = 0; t < 64; ++t) EXPECT_EQ(out[static_cast<size_t>(t)], t % 2 == 1 ? -1 : 42 + (t ^ 2)) << t;
}

TEST(CudaEmuEngine, ShuffleSeedExposesSharedMemoryRaces) {
    const unsigned threads = 256;
    auto           run     = [&](void (*kernel)(int *), const char * name) {
        std::vector<int> out(threads, 0);
        loom_emu::run_kernel(kernel, name, dim3(1), dim3(threads), threads * sizeof(int), out.data());
        return out;
    };

    // Thread-index order: every thread but the last reads its neighbour's slot before the neighbour writes it.
    loom_emu::clear_shuffle_seed();
    const char * env = std::getenv("LOOM_EMU_SHUFFLE");
    if (env == nullptr || *env == '\0') {
        const std::vector<int> plain = run(racy_neighbour, "racy_neighbour");
        for (unsigned t = 0; t + 1 < threads; ++t) EXPECT_EQ(plain[t], -1) << t;   // the poison
        EXPECT_EQ(plain[threads - 1], 1);
    }

    loom_emu::set_shuffle_seed(1);
    const std::vector<int> racy_1   = run(racy_neighbour, "racy_neighbour");
    const std::vector<int> synced_1 = run(synced_neighbour, "synced_neighbour");
    const std::vector<int> racy_1b  = run(racy_neighbour, "racy_neighbour");
    loom_emu::set_shuffle_seed(2);
    const std::vector<int> racy_2   = run(racy_neighbour, "racy_neighbour");
    const std::vector<int> synced_2 = run(synced_neighbour, "synced_neighbour");
    loom_emu::clear_shuffle_seed();

    EXPECT_NE(racy_1, racy_2);    // the race shows
    EXPECT_EQ(racy_1, racy_1b);   // one seed, one order: reproducible
    EXPECT_EQ(synced_1, synced_2);
    for (unsigned t = 0; t < threads; ++t) EXPECT_EQ(synced_1[t], static_cast<int>((t + 1) % threads) + 1) << t;

    // LOOM_EMU_SHUFFLE is read at every launch.
    const std::string saved = env != nullptr ? env : "";
    setenv("LOOM_EMU_SHUFFLE", "1", 1);
    const std::vector<int> env_1 = run(racy_neighbour, "racy_neighbour");
    setenv("LOOM_EMU_SHUFFLE", "2", 1);
    const std::vector<int> env_2 = run(racy_neighbour, "racy_neighbour");
    if (env != nullptr) {
        setenv("LOOM_EMU_SHUFFLE", saved.c_str(), 1);
    } else {
        unsetenv("LOOM_EMU_SHUFFLE");
    }
    EXPECT_EQ(env_1, racy_1);
    EXPECT_EQ(env_2, racy_2);
}

TEST(CudaEmuEngine, ExceptionInKernelIsReported) {
    std::vector<int>  out(4 * 32, 0);
    const std::string message = failure_of([&] {
        loom_emu::run_kernel(throws_in_helper, "throws_in_helper", dim3(4), dim3(32), 0, out.data());
    });
    EXPECT_NE(message.find("value 3 is not allowed"), std::string::npos) << message;
    EXPECT_NE(message.find("throws_in_helper"), std::string::npos) << message;
    EXPECT_NE(message.find("thread (3, 0, 0)"), std::string::npos) << message;

    // The engine is usable afterwards.
    std::vector<int> hits(1000, 0);
    loom_emu::run_kernel(count_indices, "count_indices", dim3(4), dim3(64), 0, hits.data(), int64_t{1000});
    for (int h : hits) ASSERT_EQ(h, 1);
}

TEST(CudaEmuEngine, LargeLocalsLiveAcrossBarriers) {
    std::vector<int> out(128, 0);
    loom_emu::run_kernel(big_locals, "big_locals", dim3(2), dim3(128), 0, out.data());
    for (int t = 0; t < 128; ++t) {
        int64_t s = 0;
        for (int i = 0; i < 4096; ++i) s += i + t;
        EXPECT_EQ(out[static_cast<size_t>(t)], static_cast<int>(s % 1000003)) << t;
    }
}

TEST(CudaEmuEngine, LargeGridStrideKernelIsFast) {
    const int64_t      n = int64_t{1} << 22;
    std::vector<float> x(static_cast<size_t>(n), 1.0f);
    const auto         start = std::chrono::steady_clock::now();
    loom_emu::run_kernel(add_one, "add_one", dim3(8192), dim3(256), 0, x.data(), n);
    const double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    std::printf("8192 x 256 grid-stride kernel over 2^22 floats: %.3f s\n", seconds);
    for (int64_t i = 0; i < n; ++i) ASSERT_EQ(x[static_cast<size_t>(i)], 2.0f) << i;
}

}  // namespace
