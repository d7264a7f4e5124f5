// The machine's GEMM peak through Loom's oneDNN path: square and training-shaped products in f32 and
// bf16, reported in GFLOP/s (2 M N K per product). The whole-step benchmark's efficiency is quoted against
// the best f32 figure measured here in the same run.
//
//   build/bench/bench_gemm --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "backend/cpu/gemm.h"
#include "core/dtype.h"

#include <benchmark/benchmark.h>

#include <vector>

using namespace loom;

static void run(benchmark::State & state, DType dtype, bool trans_b) {
    int64_t m = state.range(0), n = state.range(1), k = state.range(2);
    std::vector<float>    a(m * k, 0.5f), b(k * n, 0.25f), c(m * n);
    std::vector<uint16_t> a16(m * k, f32_to_bf16_bits(0.5f)), b16(k * n, f32_to_bf16_bits(0.25f));
    const void * pa = dtype == DType::f32 ? static_cast<const void *>(a.data()) : a16.data();
    const void * pb = dtype == DType::f32 ? static_cast<const void *>(b.data()) : b16.data();
    cpu::gemm(false, trans_b, m, n, k, pa, pb, dtype, c.data());   // warm the primitive cache
    for (auto _ : state) {
        cpu::gemm(false, trans_b, m, n, k, pa, pb, dtype, c.data());
        benchmark::DoNotOptimize(c.data());
    }
    state.counters["GFLOP"] = benchmark::Counter(2.0 * m * n * k * state.iterations() / 1e9,
                                                   benchmark::Counter::kIsRate);
}

static void BM_gemm_f32(benchmark::State & state) { run(state, DType::f32, false); }
static void BM_gemm_bf16(benchmark::State & state) { run(state, DType::bf16, false); }
// The forward of a GPT-2 124M linear layer at 1024 tokens: (1024, 768) x (3072, 768)^T.
static void BM_linear_f32(benchmark::State & state) { run(state, DType::f32, true); }
static void BM_linear_bf16(benchmark::State & state) { run(state, DType::bf16, true); }

BENCHMARK(BM_gemm_f32)->Args({1024, 1024, 1024})->Args({2048, 2048, 2048})->UseRealTime();
BENCHMARK(BM_gemm_bf16)->Args({1024, 1024, 1024})->Args({2048, 2048, 2048})->UseRealTime();
BENCHMARK(BM_linear_f32)->Args({1024, 3072, 768})->UseRealTime();
BENCHMARK(BM_linear_bf16)->Args({1024, 3072, 768})->UseRealTime();

BENCHMARK_MAIN();
