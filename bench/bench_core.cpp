// Core engine micro-benchmarks: 16-bit conversions (memory-bound, reported as bytes/s), the cost of
// a cached allocation, and the round trip of a CPU stream task and an event wait.
//
//   build/bench/bench_core --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "backend/cpu/cpu_device.h"
#include "core/dtype.h"
#include "core/tensor.h"

#include <benchmark/benchmark.h>

#include <cstring>
#include <vector>

using namespace loom;

static void BM_f32_to_bf16(benchmark::State & state) {
    size_t                n = static_cast<size_t>(state.range(0));
    std::vector<float>    src(n, 1.2345f);
    std::vector<uint16_t> dst(n);
    for (auto _ : state) {
        convert_f32_to_bf16(src.data(), dst.data(), n);
        benchmark::DoNotOptimize(dst.data());
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 6));
}
BENCHMARK(BM_f32_to_bf16)->Arg(1 << 12)->Arg(1 << 22);

static void BM_bf16_to_f32(benchmark::State & state) {
    size_t                n = static_cast<size_t>(state.range(0));
    std::vector<uint16_t> src(n, 0x3f9e);
    std::vector<float>    dst(n);
    for (auto _ : state) {
        convert_bf16_to_f32(src.data(), dst.data(), n);
        benchmark::DoNotOptimize(dst.data());
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 6));
}
BENCHMARK(BM_bf16_to_f32)->Arg(1 << 12)->Arg(1 << 22);

static void BM_f32_to_f16(benchmark::State & state) {
    size_t                n = static_cast<size_t>(state.range(0));
    std::vector<float>    src(n, 1.2345f);
    std::vector<uint16_t> dst(n);
    for (auto _ : state) {
        convert_f32_to_f16(src.data(), dst.data(), n);
        benchmark::DoNotOptimize(dst.data());
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 6));
}
BENCHMARK(BM_f32_to_f16)->Arg(1 << 12)->Arg(1 << 22);

// Baseline for the conversions: a plain copy of the same bytes read and written.
static void BM_memcpy_baseline(benchmark::State & state) {
    size_t            n = static_cast<size_t>(state.range(0));
    std::vector<char> src(n * 4, 1), dst(n * 2);
    for (auto _ : state) {
        std::memcpy(dst.data(), src.data(), n * 2);
        std::memcpy(dst.data(), src.data() + n * 2, n * 2);
        benchmark::DoNotOptimize(dst.data());
    }
    state.SetBytesProcessed(static_cast<int64_t>(state.iterations() * n * 8));
}
BENCHMARK(BM_memcpy_baseline)->Arg(1 << 22);

static void BM_cached_allocation(benchmark::State & state) {
    for (auto _ : state) {
        Tensor t = Tensor::empty({1024, 1024}, DType::f32, cpu::device());
        benchmark::DoNotOptimize(t.data_ptr());
    }
}
BENCHMARK(BM_cached_allocation);

static void BM_stream_submit_and_sync(benchmark::State & state) {
    auto stream = cpu::device().stream_create("bench");
    int  x      = 0;
    for (auto _ : state) {
        stream->submit([&x] { ++x; });
        stream->synchronize();
    }
    benchmark::DoNotOptimize(x);
}
BENCHMARK(BM_stream_submit_and_sync);

static void BM_cross_stream_event(benchmark::State & state) {
    auto a = cpu::device().stream_create("a");
    auto b = cpu::device().stream_create("b");
    auto e = cpu::device().event_create();
    for (auto _ : state) {
        a->record(*e);
        b->wait(*e);
        b->synchronize();
    }
}
BENCHMARK(BM_cross_stream_event);

BENCHMARK_MAIN();
