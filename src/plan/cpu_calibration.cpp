#include "plan/cpu_calibration.h"

#include "backend/cpu/attention.h"
#include "backend/cpu/cpu_device.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/ops.h"
#include "core/float_bits.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <functional>
#include <vector>

namespace loom::plan {

namespace {

// The shortest of `runs` timings of `work` (seconds), after one untimed run.
double best_of(int runs, const std::function<void()> & work) {
    work();
    double best = 1e30;
    for (int i = 0; i < runs; ++i) {
        const auto start = std::chrono::steady_clock::now();
        work();
        best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count());
    }
    return best;
}

}  // namespace

CpuCalibration calibrate_cpu() {
    const auto     start = std::chrono::steady_clock::now();
    CpuCalibration c;
    cpu::init_compute_threads();

    // GEMMs: operands filled with small values (their magnitude does not change the rate).
    const int64_t         g = 512;
    std::vector<float>    a32(static_cast<size_t>(g * g), 0.5f), b32(a32.size(), 0.25f), c32(a32.size());
    std::vector<uint16_t> a16(a32.size(), from_f32<Bf16>(0.5f).bits), b16(a32.size(), from_f32<Bf16>(0.25f).bits);
    const double          flops = 2.0 * static_cast<double>(g * g * g);
    const double f32_s  = best_of(3, [&] { cpu::gemm(false, false, g, g, g, a32.data(), b32.data(), DType::f32, c32.data()); });
    const double bf16_s = best_of(3, [&] { cpu::gemm(false, false, g, g, g, a16.data(), b16.data(), DType::bf16, c32.data()); });

    // Memory: y += x over 8 MiB tensors moves 3 x 8 MiB.
    const int64_t      count = 2 * 1024 * 1024;
    std::vector<float> y(static_cast<size_t>(count), 1.0f), x(y.size(), 0.0f);
    const double       add_s = best_of(3, [&] { cpu::add_inplace(y.data(), x.data(), count); });
    const double       bytes_per_s = 3.0 * 4.0 * static_cast<double>(count) / add_s;

    // Causal attention of one sequence: 4 d FLOPs per head and kept (query, key) pair.
    const int64_t      s = 512, heads = 8, d = 64;
    const AttentionShape shape(s, 1, heads, heads, d, 3 * heads * d);
    std::vector<float> qkv(static_cast<size_t>(s * 3 * heads * d), 0.01f), out(static_cast<size_t>(s * heads * d));
    std::vector<float> lse(static_cast<size_t>(heads * s));
    const double       attention_s = best_of(2, [&] {
        cpu::attention_forward(qkv.data(), qkv.data(), out.data(), lse.data(), shape, 0.125f);
    });
    const double attention_flops = 4.0 * static_cast<double>(heads * d) * static_cast<double>(s * (s + 1) / 2);

    // One op's submission and scheduling on the compute stream.
    Stream &     stream = cpu::device().compute_stream();
    const int    ops    = 1000;
    const double submit_s = best_of(2, [&] {
        for (int i = 0; i < ops; ++i) stream.submit([] {});
        stream.synchronize();
    }) / ops;

    c.spec.name               = "cpu";
    c.spec.memory_bytes       = static_cast<int64_t>(sysconf(_SC_PHYS_PAGES)) * static_cast<int64_t>(sysconf(_SC_PAGE_SIZE));
    c.spec.tensor_16bit_flops = flops / bf16_s;
    c.spec.tf32_flops         = flops / f32_s;
    c.spec.hbm_bytes_per_s    = bytes_per_s;
    c.spec.nvlink_bytes_per_s = c.spec.network_bytes_per_s = c.spec.host_bytes_per_s = bytes_per_s;
    c.spec.source = "this machine, measured by Loom's CPU kernels (plan/cpu_calibration.h): a 512^3 GEMM, "
                    "add_inplace over 8 MiB, a 512-position causal attention, 1000 empty stream tasks";
    c.efficiency.gemm      = 1.0;
    c.efficiency.memory    = 1.0;
    c.efficiency.attention = std::min(1.0, (attention_flops / attention_s) / c.spec.tensor_16bit_flops);
    c.efficiency.nvlink = c.efficiency.network = c.efficiency.host = 0.5;
    c.efficiency.launch_s      = submit_s;
    c.efficiency.nvlink_step_s = c.efficiency.network_step_s = 5e-6;
    c.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return c;
}

PlannedDevice planned_device(const std::string & gpu) {
    if (gpu == "cpu") {
        const CpuCalibration c = calibrate_cpu();
        return {c.spec, c.efficiency};
    }
    return {gpu_spec(gpu), Efficiencies{}};
}

}  // namespace loom::plan
