// `--gpu cpu`: this machine as the plan's device, its rates measured by Loom's own CPU kernels when asked,
// so a plan can be held against a run here (`loom train` on the CPU prints both).
#pragma once

#include "core/dtype.h"
#include "plan/cost_model.h"

namespace loom::plan {

struct CpuCalibration {
    GpuSpec      spec;         // name "cpu"; the measured rates as its peaks
    Efficiencies efficiency;   // 1 where the rate is the kernel's own; attention's relative to the GEMM
    double       seconds = 0;  // the measurement's own time
};

// Measures, on cpu::device() (a few hundred milliseconds; the best of several runs of each):
//   GEMM FLOP/s       (512 x 512) x (512 x 512) products with bf16 operands (tensor_16bit_flops) and f32
//                     ones (tf32_flops): Loom's GEMM, f32 accumulation
//   memory bytes/s    add_inplace over 8 MiB f32 tensors (reads 2, writes 1)
//   attention         a causal attention_forward of 8 heads of 64 over 512 positions, its FLOP rate as a
//                     fraction of the bf16 GEMM's (the efficiency the plan applies to attention)
//   per-op cost       1000 add_inplace of 64 floats: the submission and scheduling of one op (launch_s)
//   links             ranks of one machine exchange through shared memory: NVLink, network and host
//                     copies all at the memory rate, at efficiency 0.5 (each byte written by one rank and
//                     read by another)
// memory_bytes is the machine's physical memory.
CpuCalibration calibrate_cpu();

// --gpu's device and its efficiencies: a GPU of gpu_spec's table with the default efficiencies, or "cpu"
// (calibrate_cpu). Throws naming the value and the choices otherwise.
struct PlannedDevice {
    GpuSpec      spec;
    Efficiencies efficiency;
};
PlannedDevice planned_device(const std::string & gpu);

}  // namespace loom::plan
