// Host Adam: the fused AdamW step over f32 arrays in host memory. Master weights, gradient and both
// moments are read and written once in one pass, which also writes the updated parameter in the model's
// dtype. The step is bound by memory bandwidth, not arithmetic.
//
// Why core and not optim (docs/architecture.md section 5; a textbook layering would put it in optim): two layers run
// this one kernel on host memory. The CPU backend registers it as its AdamW op (core/ops.h), and the hybrid device
// optimizer (optim) runs it on the offloaded slots' host state whatever the device is. A backend may use only core, so
// the kernel lives here; optim keeps the optimizers and the scalar reference adamw_update.
//
// Per element, at step t >= 1 (the update of optim/adamw.h, same operations in the same order;
// fma(a, b, c) is a*b + c rounded once):
//   m   <- fma(b1, m, (1 - b1) * g)
//   v   <- fma(b2, v, ((1 - b2) * g) * g)
//   p   <- fma(p, 1 - lr*wd, -((lr / bc1) * m / (sqrt(v) / sqrt(bc2) + eps)))     bc1 = 1 - b1^t, bc2 = 1 - b2^t
//   out <- p rounded to bf16 (nearest even, NaN quietened: f32_to_bf16_bits), or p itself (f32)
// Memory traffic per element: p, m, v read and written, g read = 28 bytes; +2 with a bf16 output, +4 with
// an f32 one. Steps of 2^19 elements or more write the output with non-temporal stores (it would leave the
// caches before anyone reads it), which saves reading its lines first.
//
// Bodies, chosen at run time from the CPU's features (core/cpu_isa.h, capped by LOOM_MAX_CPU_ISA):
//   avx512   16 lanes, masked loads and stores for the tail   avx512f, avx512bw, avx512vl
//   avx2      8 lanes, the scalar twin for the tail            avx2, fma
//   scalar    the portable twin (std::fma)                     any CPU
// host_adam.cpp is compiled for baseline x86-64 whatever LOOM_NATIVE says, and the SIMD bodies carry
// __attribute__((target(...))): the dispatch is genuine, a CPU without AVX-512 or AVX2 runs the next body
// down, and a build for generic x86-64 still uses AVX-512 where the CPU has it. HostAdamIsa::automatic
// picks the body named by LOOM_HOST_ADAM_ISA=scalar|avx2|avx512 if set, else the best one; naming a body
// the CPU lacks throws.
//
// Numerics (asserted in tests/test_host_adam.cpp):
//   - Every body, at every thread count, gives the same bits: each performs the same IEEE-754 operations
//     (mul, div, sqrt, add, and the three fma above spelled explicitly) in the same order, and the file is
//     compiled with -ffp-contract=off so the compiler fuses nothing else. (Only a NaN's payload may differ,
//     where two operands of one operation are NaN: x86 keeps the first one's, and bodies order operands
//     differently.)
//   - Against adamw_update (whose multiply-adds the compiler is free to contract): the same bits when the
//     compiler contracts them into the three fma above, which GCC does for adamw.cpp with -march=native on
//     a CPU with FMA (Loom's default build). Otherwise (no FMA, another compiler), the two may round
//     differently; after k steps from the same state, element-wise
//         |p - p_ref| <= k * (2^-21 |p_ref| + 2^-20 lr)
//     (the test checks it against an uncontracted copy of adamw_update's formula). Either way the bf16
//     output is f32_to_bf16_bits of the updated p, as adamw_update's is.
//
// Threads: the n elements are cut into `threads` chunks (options.threads, default num_threads(); fewer for
// small n, at least 2^14 elements each) of whole 64-byte lines, spread over the compute thread budget with
// parallel_for. Elements are independent, so the chunking never changes a result.
//
// Measured (bench/bench_adam.cpp, 100M parameters, 2 cores of an AMD EPYC): the SIMD bodies run at the
// bandwidth of an in-place stream kernel over the same bytes; the scalar twin, whose std::fma is a libm call
// on baseline x86-64, at a fraction of it.
#pragma once

#include "core/dtype.h"

#include <cstdint>
#include <string_view>

namespace loom {

enum class HostAdamIsa : uint8_t { automatic, scalar, avx2, avx512 };

// "automatic", "scalar", "avx2", "avx512".
const char * host_adam_isa_name(HostAdamIsa isa);
// The inverse of host_adam_isa_name; throws on anything else.
HostAdamIsa  host_adam_isa_from_name(std::string_view name);
// Whether this CPU (and its OS) can run the body under LOOM_MAX_CPU_ISA; automatic and scalar always can.
bool         host_adam_isa_supported(HostAdamIsa isa);
// The fastest body this CPU runs.
HostAdamIsa  host_adam_isa_best();
// The body a step with `isa` runs: automatic becomes LOOM_HOST_ADAM_ISA or host_adam_isa_best(); throws
// when the body is not supported here.
HostAdamIsa  host_adam_isa_resolve(HostAdamIsa isa);

// The scalars of one AdamW step, computed on the host in f32 by this one function (no contraction) for every
// implementation: the host kernel below, the CUDA kernel (backend/cuda/cuda_ops.cpp) and optim's scalar
// reference (optim/adamw.h), so all three apply the same factors and their elements agree to the bit.
struct AdamScalars {
    float one_minus_beta1;   // 1 - b1
    float one_minus_beta2;   // 1 - b2
    float step_size;         // lr / (1 - b1^t)
    float bc2_sqrt;          // sqrt(1 - b2^t)
    float decay;             // 1 - lr * wd
};
AdamScalars adam_scalars(float lr, float beta1, float beta2, float weight_decay, int64_t step);

// Where the updated parameter is also written, in the model's dtype.
struct HostAdamOut {
    void * data  = nullptr;       // (n) elements of dtype; nullptr: no output
    DType  dtype = DType::bf16;   // bf16 or f32
};

struct HostAdamOptions {
    HostAdamIsa isa     = HostAdamIsa::automatic;
    int         threads = 0;   // chunks the step is cut into (>= 1); 0: num_threads()
};

// One AdamW step on n elements. p, m, v are updated in place; g, p, m, v, out.data must not overlap.
// Bytes of memory traffic per element: host_adam_bytes_per_element(out).
void host_adam_step(float * p, const float * g, float * m, float * v, int64_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, int64_t step, HostAdamOut out = {},
                    const HostAdamOptions & options = {});

// 28, plus 2 (bf16 output) or 4 (f32 output).
int64_t host_adam_bytes_per_element(const HostAdamOut & out);

}  // namespace loom
