// The bit-exact conversions between f32 and the 16-bit floats (core/dtype.h states their rounding), one
// definition for the host (core/dtype.cpp's array loops, the CPU backend) and the CUDA kernels: round to
// nearest even, overflow to Inf, NaN quietened with its sign and top payload bits kept; widening is exact.
#pragma once

#include "core/host_device.h"

#include <cstdint>
#include <cstring>

namespace loom {

// std::bit_cast for host and device code (memcpy is a device built-in; both compile to a register move).
template <class To, class From> LOOM_HOST_DEVICE inline To bits_as(const From & value) {
    static_assert(sizeof(To) == sizeof(From), "a bit cast between types of one size");
    To out;
    memcpy(&out, &value, sizeof(out));
    return out;
}

LOOM_HOST_DEVICE inline uint32_t float_to_bits(float value) { return bits_as<uint32_t>(value); }
LOOM_HOST_DEVICE inline float    bits_to_float(uint32_t bits) { return bits_as<float>(bits); }

LOOM_HOST_DEVICE inline uint16_t f32_to_bf16_bits(float value) {
    const uint32_t u         = float_to_bits(value);
    const uint32_t rounded   = (u + 0x7fffu + ((u >> 16) & 1u)) >> 16;   // round to nearest even
    const uint32_t quiet_nan = (u >> 16) | 0x0040u;                      // keep sign and top payload, set quiet bit
    return static_cast<uint16_t>((u & 0x7fffffffu) > 0x7f800000u ? quiet_nan : rounded);
}

LOOM_HOST_DEVICE inline float bf16_bits_to_f32(uint16_t bits) { return bits_to_float(static_cast<uint32_t>(bits) << 16); }

// IEEE binary16 from binary32, round to nearest even, written without branches on the data so the host's
// array loop vectorises:
//   normal results:    re-bias the exponent (127 -> 15) and round the 23-bit mantissa to 10 bits;
//                      a carry out of the mantissa correctly bumps the exponent, up to Inf.
//   subnormal results: add the magic constant 0.5f (2^-1) in float arithmetic (rounded once: no
//                      contraction on the device), which shifts the mantissa so the FPU performs the
//                      round-to-nearest-even.
//   Inf / NaN:         exponent all ones; NaN keeps its top payload bits and is quietened.
LOOM_HOST_DEVICE inline uint16_t f32_to_f16_bits(float value) {
    const uint32_t u    = float_to_bits(value);
    const uint32_t sign = (u >> 16) & 0x8000u;
    const uint32_t a    = u & 0x7fffffffu;
    // Normal range: |x| >= 2^-14.
    uint32_t normal = ((a - (112u << 23)) + 0xfffu + ((a >> 13) & 1u)) >> 13;
    normal          = normal > 0x7c00u ? 0x7c00u : normal;   // overflow -> Inf
    // Subnormal range: |x| < 2^-14. Adding 0.5f aligns 2^-24 with the float's last mantissa bit.
#if defined(__CUDA_ARCH__)
    const float sub_f = __fadd_rn(bits_to_float(a), 0.5f);
#else
    const float sub_f = bits_to_float(a) + 0.5f;
#endif
    const uint32_t sub = float_to_bits(sub_f) - 0x3f000000u;   // 0 .. 0x400 (0x400 = 2^-14)
    const uint32_t nan = 0x7e00u | ((a >> 13) & 0x3ffu);
    uint32_t       bits = a < (113u << 23) ? sub : normal;
    bits                = a >= 0x7f800000u ? (a == 0x7f800000u ? 0x7c00u : nan) : bits;
    return static_cast<uint16_t>(sign | bits);
}

LOOM_HOST_DEVICE inline float f16_bits_to_f32(uint16_t h) {
    const uint32_t sign     = (static_cast<uint32_t>(h) & 0x8000u) << 16;
    const uint32_t exponent = (h >> 10) & 0x1fu;
    const uint32_t mantissa = h & 0x3ffu;
    uint32_t       bits;
    if (exponent == 0x1f) {
        // Inf, or NaN with its payload kept and quietened (as vcvtph2ps does, so every path agrees).
        bits = 0x7f800000u | (mantissa << 13) | (mantissa != 0 ? 0x00400000u : 0u);
    } else if (exponent != 0) {
        bits = ((exponent + 112u) << 23) | (mantissa << 13);   // normal: re-bias 15 -> 127
    } else {
        // Zero or subnormal: value = mantissa * 2^-24, exact in float.
#if defined(__CUDA_ARCH__)
        bits = float_to_bits(__fmul_rn(static_cast<float>(mantissa), 0x1p-24f));
#else
        bits = float_to_bits(static_cast<float>(mantissa) * 0x1p-24f);
#endif
    }
    return bits_to_float(sign | bits);
}

// The activations' storage types, for kernels templated over them (f32, or bf16 with --bf16): a kernel
// reads each element as f32 with to_f32, computes in f32 and stores with from_f32<T>, which rounds to
// nearest even. For float both are the identity, so an f32 instantiation has the f32 kernel's bits.
struct Bf16 {
    uint16_t bits;
};

LOOM_HOST_DEVICE inline float to_f32(float value) { return value; }
LOOM_HOST_DEVICE inline float to_f32(Bf16 value) { return bf16_bits_to_f32(value.bits); }

template <class T> LOOM_HOST_DEVICE inline T from_f32(float value);
template <> LOOM_HOST_DEVICE inline float from_f32<float>(float value) { return value; }
template <> LOOM_HOST_DEVICE inline Bf16 from_f32<Bf16>(float value) { return Bf16{f32_to_bf16_bits(value)}; }

}  // namespace loom
