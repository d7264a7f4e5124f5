// The emulated libraries' own f16 and bf16 conversions (NCCL's reductions, cuBLASLt's operands and outputs),
// written by hand and apart from Loom's (core/float_bits.h): the emulator is the reference the CUDA backend is
// tested against, so it shares none of the code under test. To f32 exactly; from f32 rounded to nearest even,
// NaN quiet.
#pragma once

#include <bit>
#include <cstdint>

namespace loom_emu::half_bits {

inline float    bits_to_float(uint32_t bits) { return std::bit_cast<float>(bits); }
inline uint32_t float_to_bits(float value) { return std::bit_cast<uint32_t>(value); }

inline float bf16_to_float(uint16_t h) { return bits_to_float(static_cast<uint32_t>(h) << 16); }

inline uint16_t float_to_bf16(float value) {
    uint32_t bits = float_to_bits(value);
    if ((bits & 0x7fffffffu) > 0x7f800000u) return static_cast<uint16_t>((bits >> 16) | 0x0040u);   // quiet NaN
    bits += 0x7fffu + ((bits >> 16) & 1u);   // ties to even; a carry into the exponent rounds up to inf correctly
    return static_cast<uint16_t>(bits >> 16);
}

inline float f16_to_float(uint16_t h) {
    uint32_t sign     = static_cast<uint32_t>(h & 0x8000u) << 16;
    uint32_t exponent = (h >> 10) & 0x1fu;
    uint32_t mantissa = h & 0x3ffu;
    if (exponent == 0) {
        float magnitude = static_cast<float>(mantissa) * 0x1p-24f;   // zero or subnormal: exact
        return bits_to_float(float_to_bits(magnitude) | sign);
    }
    if (exponent == 31) return bits_to_float(sign | 0x7f800000u | (mantissa << 13));
    return bits_to_float(sign | ((exponent + 112) << 23) | (mantissa << 13));
}

inline uint16_t float_to_f16(float value) {
    uint32_t bits = float_to_bits(value);
    auto     sign = static_cast<uint16_t>((bits >> 16) & 0x8000u);
    uint32_t abs  = bits & 0x7fffffffu;
    if (abs >= 0x7f800000u) return static_cast<uint16_t>(sign | (abs > 0x7f800000u ? 0x7e00u : 0x7c00u));
    if (abs >= 0x477ff000u) return static_cast<uint16_t>(sign | 0x7c00u);   // from 65520 up: rounds to inf
    if (abs < 0x38800000u) {
        // Below f16's smallest normal (2^-14): a subnormal, mantissa * 2^-24, rounded to nearest even.
        if (abs < 0x33000000u) return sign;   // below 2^-25: rounds to zero
        uint32_t exponent = abs >> 23;
        uint32_t mantissa = (abs & 0x7fffffu) | 0x800000u;
        uint32_t shift    = 126 - exponent;   // 14..24
        uint32_t result   = mantissa >> shift;
        uint32_t rest     = mantissa & ((1u << shift) - 1);
        uint32_t half     = 1u << (shift - 1);
        if (rest > half || (rest == half && (result & 1u))) ++result;
        return static_cast<uint16_t>(sign | result);
    }
    uint32_t rebased = abs - 0x38000000u;   // exponent bias 127 -> 15
    rebased += 0xfffu + ((rebased >> 13) & 1u);
    return static_cast<uint16_t>(sign | (rebased >> 13));
}

}  // namespace loom_emu::half_bits
