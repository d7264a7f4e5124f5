// The hybrid device optimizer's step (optim/hybrid_optimizer.h) on ~25M bf16 parameters, for offload
// fractions 0, 0.5 and 1, with and without --overlap-cpu-optimizer-d2h-h2d.
//
// The model is 24 matrices of 1M elements (a 12-layer GPT's 2 big GEMM weights per layer at h = 1024
// would be 4M; these are smaller so the per-slot work of overlap shows) plus 48 vectors of 1024 elements,
// 25.2M parameters. Gradients are fixed; each iteration is one step() with the host seeing the updated
// values on return. On the CPU backend device memory is host memory, so the device part and the host part
// run the same kernel: the difference between fractions is the copies and, with overlap, the streams'
// concurrency. Bytes moved per element: device part 30 (host Adam with its bf16 output); host part 28
// (host Adam, no output) + 8 (D2H: grad read and written) + 6 (H2D: master read, bf16 written) = 42.
// Time is wall time around the whole step.
//
//   build/bench/bench_hybrid        (LOOM_NUM_THREADS sets the compute budget)
#include "backend/cpu/cpu_device.h"
#include "optim/hybrid_optimizer.h"

#include <benchmark/benchmark.h>

#include <cmath>
#include <vector>

using namespace loom;

namespace {

struct Model {
    std::vector<Tensor> values, grads;   // (n) bf16, (n) f32
    int64_t             numel = 0;
};

Model & model() {
    static Model m = [] {
        Model    r;
        Device & device = cpu::device();
        auto add = [&](int64_t n) {
            Tensor v = Tensor::zeros({n}, DType::bf16, device), g = Tensor::empty({n}, DType::f32, device);
            float * gp = g.data<float>();
            for (int64_t i = 0; i < n; ++i) gp[i] = 1e-3f * std::sin(0.001f * static_cast<float>(i));
            r.values.push_back(v);
            r.grads.push_back(g);
            r.numel += n;
        };
        for (int layer = 0; layer < 24; ++layer) {
            add(1 << 20);
            add(1024);
            add(1024);
        }
        return r;
    }();
    return m;
}

void BM_HybridStep(benchmark::State & state) {
    Model &              m = model();
    optim::HybridOptions options;
    options.offload_fraction = static_cast<float>(state.range(0)) / 100.0f;
    options.overlap_d2h_h2d  = state.range(1) != 0;
    std::vector<optim::HybridSlot> slots;
    for (size_t k = 0; k < m.values.size(); ++k) slots.push_back(optim::HybridSlot{m.values[k], m.grads[k], 0.01f});
    optim::HybridDeviceOptimizer hdo(cpu::device(), slots, {}, options);
    hdo.step(1e-4f);   // warm-up: first touch of the state
    for (auto _ : state) {
        hdo.step(1e-4f);
    }
    state.counters["params"]    = static_cast<double>(m.numel);
    state.counters["offloaded"] = static_cast<double>(hdo.offloaded_numel());
    state.SetLabel(std::string("fraction ") + std::to_string(options.offload_fraction).substr(0, 4) +
                   (options.overlap_d2h_h2d ? ", overlap" : ", no overlap"));
}

}  // namespace

BENCHMARK(BM_HybridStep)
    ->ArgsProduct({{0, 50, 100}, {0, 1}})
    ->ArgNames({"fraction%", "overlap"})
    ->Unit(benchmark::kMillisecond)
    ->UseRealTime()
    ->MinTime(1.0);

BENCHMARK_MAIN();
