// The x86-64 instruction-set levels Loom's CPU kernels dispatch on, and the cap that tests use to run the
// lower levels on a bigger CPU.
//
//   scalar        any x86-64 (SSE2)
//   avx2          AVX2 + FMA                                  the floor every supported machine has
//   avx512        AVX-512 F, BW, VL
//   avx512_bf16   AVX-512 with the BF16 dot products (oneDNN's native bf16 GEMM)
//
// cpu_isa() is the detected level capped by LOOM_MAX_CPU_ISA. The variable takes Loom's names above or
// oneDNN's ONEDNN_MAX_CPU_ISA spellings (AVX2, AVX512_CORE, AVX512_CORE_BF16, AVX512_CORE_AMX, ALL), in
// any case, so one value can be given to both:
//
//   ONEDNN_MAX_CPU_ISA=AVX2 LOOM_MAX_CPU_ISA=AVX2 ctest      what a machine without AVX-512 runs
//
// A cap above what the CPU has changes nothing; an unknown value is an error naming the variable.
#pragma once

#include <cstdint>
#include <string_view>

namespace loom {

enum class CpuIsa : uint8_t { scalar, avx2, avx512, avx512_bf16 };

const char * cpu_isa_name(CpuIsa isa);
// Loom's or oneDNN's spelling, case-insensitive; throws naming `what` (the variable) on anything else.
CpuIsa       cpu_isa_from_name(std::string_view name, std::string_view what = "LOOM_MAX_CPU_ISA");
// What this CPU (and its OS) runs, uncapped.
CpuIsa       cpu_isa_detected();
// The level kernels may use: cpu_isa_detected() capped by LOOM_MAX_CPU_ISA (read once).
CpuIsa       cpu_isa();

}  // namespace loom
