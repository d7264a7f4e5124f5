#include "core/cpu_isa.h"

#include "core/error.h"

#include <algorithm>
#include <cctype>
#include <cstdlib>
#include <string>

namespace loom {

const char * cpu_isa_name(CpuIsa isa) {
    switch (isa) {
        case CpuIsa::scalar:      return "scalar";
        case CpuIsa::avx2:        return "avx2";
        case CpuIsa::avx512:      return "avx512";
        case CpuIsa::avx512_bf16: return "avx512_bf16";
    }
    return "unknown";
}

CpuIsa cpu_isa_from_name(std::string_view name, std::string_view what) {
    std::string lower(name);
    std::transform(lower.begin(), lower.end(), lower.begin(), [](unsigned char c) { return std::tolower(c); });
    struct Spelling { const char * name; CpuIsa isa; };
    static constexpr Spelling kSpellings[] = {
        {"scalar", CpuIsa::scalar},         {"sse41", CpuIsa::scalar},
        {"avx", CpuIsa::scalar},            {"avx2", CpuIsa::avx2},
        {"avx2_vnni", CpuIsa::avx2},        {"avx2_vnni_2", CpuIsa::avx2},
        {"avx512", CpuIsa::avx512},         {"avx512_core", CpuIsa::avx512},
        {"avx512_core_vnni", CpuIsa::avx512},
        {"avx512_bf16", CpuIsa::avx512_bf16}, {"avx512_core_bf16", CpuIsa::avx512_bf16},
        {"avx512_core_fp16", CpuIsa::avx512_bf16}, {"avx512_core_amx", CpuIsa::avx512_bf16},
        {"avx512_core_amx_fp16", CpuIsa::avx512_bf16}, {"avx10_1_512", CpuIsa::avx512_bf16},
        {"avx10_1_512_amx", CpuIsa::avx512_bf16}, {"avx10_1_512_amx_fp16", CpuIsa::avx512_bf16},
        {"all", CpuIsa::avx512_bf16},       {"default", CpuIsa::avx512_bf16},
    };
    for (const Spelling & s : kSpellings) {
        if (lower == s.name) return s.isa;
    }
    LOOM_THROW(what << "=" << name << " is not an instruction-set level",
               "use scalar, avx2, avx512 or avx512_bf16 (or oneDNN's AVX2, AVX512_CORE, AVX512_CORE_BF16, ALL)");
}

CpuIsa cpu_isa_detected() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_cpu_init();
    if (!__builtin_cpu_supports("avx2") || !__builtin_cpu_supports("fma")) return CpuIsa::scalar;
    if (!__builtin_cpu_supports("avx512f") || !__builtin_cpu_supports("avx512bw") ||
        !__builtin_cpu_supports("avx512vl")) {
        return CpuIsa::avx2;
    }
    return __builtin_cpu_supports("avx512bf16") ? CpuIsa::avx512_bf16 : CpuIsa::avx512;
#else
    return CpuIsa::scalar;
#endif
}

CpuIsa cpu_isa() {
    static const CpuIsa isa = [] {
        CpuIsa       detected = cpu_isa_detected();
        const char * cap      = std::getenv("LOOM_MAX_CPU_ISA");
        if (cap == nullptr || *cap == '\0') return detected;
        return std::min(detected, cpu_isa_from_name(cap));
    }();
    return isa;
}

}  // namespace loom
