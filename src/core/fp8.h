// FP8: the two OCP 8-bit float formats and the scaling recipes Megatron's --fp8-recipe names, as exact
// host-and-device arithmetic (one definition for the CPU and the CUDA kernels, as core/float_bits.h's).
// docs/fp8.md gives the sources.
//
// Formats (sign, exponent, mantissa bits; bias; largest finite; special codes):
//   e4m3 (E4M3FN)  1, 4, 3; bias 7;  448 = 0x7E = 1.75 x 2^8;  no infinities, NaN = S.1111.111
//   e5m2           1, 5, 2; bias 15; 57344 = 0x7B = 1.75 x 2^15; Inf = S.11111.00, NaN = S.11111.{01,10,11}
// Both have subnormals (exponent field 0): e4m3 down to 2^-9, e5m2 down to 2^-16.
//
// f32 -> FP8 (fp8_from_f32): round to nearest, ties to even, then saturate: a magnitude that rounds past the
// largest finite value, and +-Inf, become +-largest finite (the conversion NVIDIA's cvt.satfinite performs
// and Transformer Engine's casts use); NaN becomes the format's NaN with the sign kept; -0 stays -0.
// FP8 -> f32 (f32_from_fp8) is exact.
//
// Recipes (scale s: the tensor is multiplied by s before the cast; s_inv = 1 / s multiplies a GEMM's result):
//   tensorwise (current scaling)  one s per tensor from its own amax = max |x|: s = fmax / amax;
//                                 amax 0 gives s = 1, an infinite s the largest f32 (Transformer Engine's
//                                 compute_scale_from_amax); with pow2, s rounds down to a power of two
//   delayed                       s from an amax history (the last `len` amaxes, newest first): amax = the
//                                 history's max (algo max) or its newest entry (most_recent); s = fmax / amax /
//                                 2^margin, and the previous s is kept when that amax is 0 or not finite
//   blockwise                     one s per block of 1 x 128 (activations, gradients) or 128 x 128 (weights),
//                                 each the tensorwise rule over its block, power-of-two scales by default
//   mxfp8                         blocks of 32 along a GEMM's reduction, each sharing an E8M0 scale: amax / fmax
//                                 rounded up to a power of two (Transformer Engine's MXFP8 rule), so the block's
//                                 largest element lands at or below fmax; the elements are divided by it and cast
#pragma once

#include "core/float_bits.h"
#include "core/host_device.h"

#include <cmath>
#include <cstdint>

namespace loom {

enum class Fp8Format : uint8_t { e4m3, e5m2 };

struct Fp8Spec {
    int      mantissa_bits, bias;
    uint8_t  max_code;   // the largest finite magnitude's code (sign 0)
    float    max_value;
    int      emax;       // the largest normal exponent (unbiased)
};

LOOM_HOST_DEVICE inline Fp8Spec fp8_spec(Fp8Format f) {
    return f == Fp8Format::e4m3 ? Fp8Spec{3, 7, 0x7E, 448.0f, 8} : Fp8Spec{2, 15, 0x7B, 57344.0f, 15};
}

LOOM_HOST_DEVICE inline bool fp8_is_nan(uint8_t code, Fp8Format f) {
    const uint8_t m = code & 0x7F;
    return f == Fp8Format::e4m3 ? m == 0x7F : m > 0x7C;
}

LOOM_HOST_DEVICE inline float f32_from_fp8(uint8_t code, Fp8Format f) {
    const Fp8Spec s    = fp8_spec(f);
    const bool    neg  = (code & 0x80) != 0;
    const int     mb   = s.mantissa_bits;
    const int     bexp = (code & 0x7F) >> mb;
    const int     mant = code & ((1 << mb) - 1);
    float         v;
    if (fp8_is_nan(code, f)) {
        v = bits_to_float(0x7FC00000u);
    } else if (f == Fp8Format::e5m2 && bexp == 31) {
        v = bits_to_float(0x7F800000u);   // Inf
    } else if (bexp == 0) {
        // Subnormal: mant x 2^(1 - bias - M), the power of two built from its bits (exact, no library call).
        v = static_cast<float>(mant) * bits_to_float(static_cast<uint32_t>(127 + 1 - s.bias - mb) << 23);
    } else {
        // Normal: f32's exponent field bexp - bias + 127, the mantissa's M bits at the top of f32's 23.
        v = bits_to_float((static_cast<uint32_t>(bexp - s.bias + 127) << 23) | (static_cast<uint32_t>(mant) << (23 - mb)));
    }
    return neg ? -v : v;
}

LOOM_HOST_DEVICE inline uint8_t fp8_from_f32(float x, Fp8Format f) {
    const Fp8Spec  s    = fp8_spec(f);
    const uint32_t u    = float_to_bits(x);
    const uint8_t  sign = static_cast<uint8_t>((u >> 24) & 0x80u);
    const uint32_t a    = u & 0x7FFFFFFFu;
    if (a > 0x7F800000u) return static_cast<uint8_t>(sign | 0x7F);   // NaN (both formats' all-ones code)
    if (a < 0x00800000u) return sign;   // zero and f32 subnormals (far below half the smallest FP8 subnormal)
    const int mb      = s.mantissa_bits;
    const int e       = static_cast<int>(a >> 23) - 127;   // f32's unbiased exponent (Inf: 128)
    if (e > s.emax + 1) return static_cast<uint8_t>(sign | s.max_code);   // far past the largest: saturate
    const int min_e   = 1 - s.bias;                          // the smallest normal exponent
    const int te      = e < min_e ? min_e : e;               // the exponent of the quantum's binade
    const int shift   = 23 - mb + (te - e);                  // f32 significand bits dropped
    const uint64_t full = static_cast<uint64_t>((a & 0x007FFFFFu) | 0x00800000u);
    if (shift >= 40) return sign;
    uint64_t       q    = full >> shift;
    const uint64_t rem  = full & ((uint64_t(1) << shift) - 1);
    const uint64_t half = uint64_t(1) << (shift - 1);
    if (rem > half || (rem == half && (q & 1u))) ++q;   // to nearest, ties to even
    uint32_t code;
    if (q >= (uint64_t(1) << mb)) {   // normal (a carry into the next binade halves q)
        int bexp = te + s.bias;
        if (q == (uint64_t(1) << (mb + 1))) {
            q >>= 1;
            ++bexp;
        }
        code = (static_cast<uint32_t>(bexp) << mb) | static_cast<uint32_t>(q - (uint64_t(1) << mb));
    } else {
        code = static_cast<uint32_t>(q);   // subnormal (or zero)
    }
    if (code > s.max_code) code = s.max_code;   // rounded past the largest finite (or onto Inf / NaN codes)
    return static_cast<uint8_t>(sign | code);
}

// The value x takes through the format: f32_from_fp8(fp8_from_f32(x)).
LOOM_HOST_DEVICE inline float fp8_round(float x, Fp8Format f) { return f32_from_fp8(fp8_from_f32(x, f), f); }

// Tensorwise (current) scaling's s from amax (Transformer Engine's compute_scale_from_amax, epsilon 0).
LOOM_HOST_DEVICE inline float fp8_scale_from_amax(float amax, Fp8Format f, bool pow2 = false) {
    if (!(amax > 0.0f)) return 1.0f;   // 0 (and NaN): 1
    float scale = fp8_spec(f).max_value / amax;
    if (!(scale <= bits_to_float(0x7F7FFFFFu))) scale = bits_to_float(0x7F7FFFFFu);   // an infinite s: the largest f32
    if (pow2) scale = ldexpf(1.0f, ilogbf(scale));   // the power of two at or below it
    return scale;
}

// Delayed scaling's s from the history's amax (already reduced by the algo), the margin and the previous s.
LOOM_HOST_DEVICE inline float fp8_delayed_scale(float amax, float previous, Fp8Format f, int margin) {
    if (!(amax > 0.0f) || !(amax <= bits_to_float(0x7F7FFFFFu))) return previous;
    return fp8_spec(f).max_value / amax / ldexpf(1.0f, margin);
}

// MXFP8's scale of a block (Transformer Engine's MXFP8BlockScaling; OCP MX's E8M0 scale type): q = amax times
// the f32 reciprocal of the format's largest, rounded up to a power of two as its E8M0 code, the biased
// exponent (2^(code - 127)): q's own exponent field, plus one where q has mantissa bits (not past code 254,
// nor for a subnormal q of at most 2^-127). An amax of 0 gives code 0 (2^-127); a NaN or infinite amax, 255.
// The block's largest element divided by the scale then lands at or below the format's largest: no saturation.
LOOM_HOST_DEVICE inline uint32_t mxfp8_scale_code(float amax, Fp8Format f) {
    const float q = amax * (1.0f / fp8_spec(f).max_value);
    if (!(q == q)) return 255;
    const uint32_t bits = float_to_bits(q) & 0x7FFFFFFFu;
    uint32_t       code = bits >> 23;
    const uint32_t mant = bits & 0x7FFFFFu;
    if (mant > 0 && code != 0xFEu && code != 0xFFu && !(code == 0 && mant <= 0x400000u)) ++code;
    return code;
}

// The factor a block's elements are multiplied by before the cast: 1 / 2^(code - 127) (NaN for code 255).
LOOM_HOST_DEVICE inline float mxfp8_block_scale(float amax, Fp8Format f) {
    const uint32_t code = mxfp8_scale_code(amax, f);
    return code == 255 ? bits_to_float(0x7FC00000u) : ldexpf(1.0f, 127 - static_cast<int>(code));
}

}  // namespace loom
