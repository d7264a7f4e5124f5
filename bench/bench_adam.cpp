// Host Adam (optim/host_adam.h) on 100M parameters against the machine's memory bandwidth, measured in
// the same run.
//
// Each body this CPU runs steps 100M f32 parameters (master, grad, m, v: 28 bytes per element read or
// written) with no model-dtype output and with a bf16 one (30 bytes). The baselines are in-place
// read-modify-write stream kernels over the same bytes, on the same thread budget:
//   stream2   a[i] = a[i]*s + b[i]                       12 bytes/element, 2.8 GB: the bandwidth baseline
//   stream4   a,b,c[i] = a,b,c[i]*s + d[i] (d[i]^2 for c) 28 bytes/element: host Adam's own access pattern
// This machine's bandwidth drifts (a shared host): every repetition of every benchmark first measures both
// stream kernels (3 steps each, untimed by the benchmark), and its ratios are to those adjacent numbers.
// The summary at the end prints ms/step, GB/s and the ratios (the goal is >= 0.8 of stream2). Time is wall
// time (UseRealTime) around the whole step, threads are the compute budget (num_threads()).
//
//   build/bench/bench_adam                       (LOOM_NUM_THREADS sets the budget; LOOM_BENCH_ADAM_PARAMS
//                                                 shrinks the problem for a quick look)
#include "core/thread_pool.h"
#include "core/host_adam.h"

#include <benchmark/benchmark.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <string>
#include <vector>

using namespace loom;


namespace {

int64_t params_count() {
    static const int64_t n = [] {
        const char * value = std::getenv("LOOM_BENCH_ADAM_PARAMS");
        return value ? std::max<int64_t>(1, std::atoll(value)) : int64_t{100'000'000};
    }();
    return n;
}

// A 64-byte aligned host array, first touched (and so placed) by the compute threads.
template <typename T>
struct HostArray {
    struct Free {
        void operator()(T * ptr) const { std::free(ptr); }
    };
    std::unique_ptr<T, Free> data;
    int64_t                  size = 0;

    HostArray(int64_t n, T value) : size(n) {
        size_t bytes = (static_cast<size_t>(n) * sizeof(T) + 63) / 64 * 64;
        data.reset(static_cast<T *>(std::aligned_alloc(64, bytes)));
        if (!data) {
            std::fprintf(stderr, "bench_adam: cannot allocate %zu bytes\n", bytes);
            std::exit(1);
        }
        T * p = data.get();
        parallel_for(n, 1 << 16, [&](int64_t begin, int64_t end) { std::fill(p + begin, p + end, value); });
    }
    T * get() { return data.get(); }
};

struct AdamArrays {
    int64_t             n;
    HostArray<float>    p, g, m, v;   // (n)
    HostArray<uint16_t> out;          // (n) bf16
    int64_t             step = 0;

    explicit AdamArrays(int64_t count)
        : n(count), p(count, 0.5f), g(count, 0.0f), m(count, 0.0f), v(count, 0.0f), out(count, 0) {
        float * gp = g.get();
        parallel_for(n, 1 << 16, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) gp[i] = 1e-3f * static_cast<float>(i % 2001 - 1000) / 1000.0f;
        });
    }
};

AdamArrays & adam_arrays() {
    static AdamArrays arrays(params_count());
    return arrays;
}

// a[i] = a[i]*s + b[i] on [begin, end): 8 bytes read, 4 written per element.
void stream2_range(float * __restrict a, const float * __restrict b, float s, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) a[i] = a[i] * s + b[i];
}

// Three arrays updated in place from a fourth, as p, m, v from g (c gets d^2 so that v stays >= 0).
void stream4_range(float * __restrict a, float * __restrict b, float * __restrict c, const float * __restrict d,
                   float s, int64_t begin, int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        a[i] = a[i] * s + d[i];
        b[i] = b[i] * s + d[i];
        c[i] = c[i] * s + d[i] * d[i];
    }
}

// stream2 over arrays sized to host Adam's 28 bytes per parameter (12 bytes per element).
struct Stream2 {
    int64_t          n = params_count() * 28 / 12;
    HostArray<float> a{n, 1.0f}, b{n, 1.0f};
    double           bytes() const { return 12.0 * static_cast<double>(n); }
    void             step() {
        parallel_for(n, 1 << 16, [&](int64_t begin, int64_t end) { stream2_range(a.get(), b.get(), 0.5f, begin, end); });
    }
};

Stream2 & stream2() {
    static Stream2 s;
    return s;
}

// stream4 on host Adam's own arrays p, m, v, g (values stay finite, normal, and v >= 0).
double stream4_bytes() { return 28.0 * static_cast<double>(adam_arrays().n); }
void   stream4_step() {
    AdamArrays & s = adam_arrays();
    parallel_for(s.n, 1 << 16, [&](int64_t begin, int64_t end) {
        stream4_range(s.p.get(), s.m.get(), s.v.get(), s.g.get(), 0.5f, begin, end);
    });
}

template <typename Step>
double seconds_of(Step && step) {
    auto start = std::chrono::steady_clock::now();
    step();
    return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

double median(std::vector<double> values) {
    std::sort(values.begin(), values.end());
    size_t k = values.size();
    return k == 0 ? 0.0 : k % 2 ? values[k / 2] : 0.5 * (values[k / 2 - 1] + values[k / 2]);
}

// Every repetition of every benchmark: seconds per step, and the stream bandwidths measured just before it.
struct Repetition {
    double seconds, stream2_gbps, stream4_gbps;
};
std::map<std::string, std::vector<Repetition>> g_runs;
std::map<std::string, double>                  g_bytes;

// The memory bandwidth of this moment (on a shared machine it drifts): median GB/s of a few steps of each
// stream kernel, run right before the kernel they are compared with.
Repetition adjacent_baseline() {
    constexpr int       kSteps = 3;
    std::vector<double> s2, s4;
    for (int i = 0; i < kSteps; ++i) s2.push_back(seconds_of([] { stream2().step(); }));
    for (int i = 0; i < kSteps; ++i) s4.push_back(seconds_of(stream4_step));
    return {0.0, stream2().bytes() / median(s2) / 1e9, stream4_bytes() / median(s4) / 1e9};
}

// The timed loop: records seconds per step, sets GB/s and the ratios to the adjacent stream baselines.
template <typename Step>
void run_timed(benchmark::State & state, const std::string & name, double bytes, Step && step) {
    Repetition rep = adjacent_baseline();
    double     seconds = 0;
    for (auto _ : state) seconds += seconds_of(step);
    rep.seconds = seconds / static_cast<double>(state.iterations());
    g_runs[name].push_back(rep);
    g_bytes[name]                = bytes;
    const double gbps            = bytes / rep.seconds / 1e9;
    state.counters["GB/s"]       = gbps;
    state.counters["vs_stream2"] = gbps / rep.stream2_gbps;
    state.counters["vs_stream4"] = gbps / rep.stream4_gbps;
    state.counters["threads"]    = num_threads();
}

void BM_stream2(benchmark::State & state) {
    run_timed(state, "stream2", stream2().bytes(), [] { stream2().step(); });
}

void BM_stream4(benchmark::State & state) {
    run_timed(state, "stream4", stream4_bytes(), stream4_step);
}

void BM_host_adam(benchmark::State & state, HostAdamIsa isa, bool bf16_out) {
    if (!host_adam_isa_supported(isa)) {
        state.SkipWithError("this CPU cannot run this body");
        for (auto _ : state) {}
        return;
    }
    AdamArrays &       s   = adam_arrays();
    HostAdamOut out = bf16_out ? HostAdamOut{s.out.get(), DType::bf16} : HostAdamOut{};
    const std::string  name = std::string("host_adam/") + host_adam_isa_name(isa) + (bf16_out ? "/bf16" : "/none");
    run_timed(state, name, static_cast<double>(host_adam_bytes_per_element(out) * s.n), [&] {
        host_adam_step(s.p.get(), s.g.get(), s.m.get(), s.v.get(), s.n, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f,
                              ++s.step, out, {isa, 0});
    });
}

// Fixed iteration counts: Google Benchmark then calls each function once per repetition, so every
// recorded run is a reported one.
void register_benchmarks() {
    benchmark::RegisterBenchmark("stream2", BM_stream2)
        ->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(10)->Repetitions(3);
    benchmark::RegisterBenchmark("stream4", BM_stream4)
        ->UseRealTime()->Unit(benchmark::kMillisecond)->Iterations(10)->Repetitions(3);
    for (HostAdamIsa isa : {HostAdamIsa::avx512, HostAdamIsa::avx2, HostAdamIsa::scalar}) {
        for (bool bf16 : {false, true}) {
            std::string name = std::string("host_adam/") + host_adam_isa_name(isa) + (bf16 ? "/bf16" : "/none");
            benchmark::RegisterBenchmark(name.c_str(), BM_host_adam, isa, bf16)
                ->UseRealTime()
                ->Unit(benchmark::kMillisecond)
                ->Iterations(isa == HostAdamIsa::scalar ? 2 : 10)
                ->Repetitions(3);
        }
    }
}

void print_summary() {
    std::printf("\nhost Adam, %lld parameters, %d threads; medians over repetitions; each ratio is to the stream\n"
                "bandwidth measured right before the kernel (stream2 is the baseline, goal >= 0.8)\n",
                static_cast<long long>(params_count()), num_threads());
    std::printf("  %-22s %9s %9s %11s %11s %11s\n", "kernel", "ms/step", "GB/s", "stream2", "vs stream2",
                "vs stream4");
    for (const auto & [name, runs] : g_runs) {
        std::vector<double> seconds, s2, r2, r4;
        const double        bytes = g_bytes[name];
        for (const Repetition & r : runs) {
            seconds.push_back(r.seconds);
            s2.push_back(r.stream2_gbps);
            r2.push_back(bytes / r.seconds / 1e9 / r.stream2_gbps);
            r4.push_back(bytes / r.seconds / 1e9 / r.stream4_gbps);
        }
        std::printf("  %-22s %9.2f %9.2f %11.2f %11.3f %11.3f\n", name.c_str(), median(seconds) * 1e3,
                    bytes / median(seconds) / 1e9, median(s2), median(r2), median(r4));
    }
    const std::string best = std::string("host_adam/") + host_adam_isa_name(host_adam_isa_best()) + "/none";
    if (auto it = g_runs.find(best); it != g_runs.end()) {
        std::vector<double> seconds;
        for (const Repetition & r : it->second) seconds.push_back(r.seconds);
        std::printf("  %s: %.3g parameters/s\n", best.c_str(), static_cast<double>(params_count()) / median(seconds));
    }
}

}  // namespace

int main(int argc, char ** argv) {
    register_benchmarks();
    benchmark::Initialize(&argc, argv);
    if (benchmark::ReportUnrecognizedArguments(argc, argv)) return 1;
    benchmark::RunSpecifiedBenchmarks();
    benchmark::Shutdown();
    print_summary();
    return 0;
}
