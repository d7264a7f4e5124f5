// exp, tanh and sigmoid written so that a loop calling them vectorises (libm's expf / tanhf are scalar
// calls, and GELU's tanh alone was ~10% of a GPT-2 step). Branch-free: a clamp, a round to nearest by
// the 1.5 * 2^23 trick (no -ffast-math, no SSE4.1 needed), a degree-6 polynomial and an exponent
// built from integer bits.
//
// Accuracy: exp_approx has a relative error below 3e-7 (a few ulp) on [-87, 88]; inputs outside are
// clamped (exp(-inf) comes out as 1.6e-38, not 0, which every caller multiplies into a sum or masks).
// tanh_approx = 1 - 2 / (exp(2u) + 1) has an absolute error below 2e-7, which is what GELU and its
// gradient use it for (they add it to 1).
#pragma once

#include <algorithm>
#include <bit>
#include <cstdint>

namespace loom::cpu {

inline float exp_approx(float x) {
    x        = std::min(std::max(x, -87.3f), 88.3f);
    float k  = (x * 1.44269504088896341f + 12582912.0f) - 12582912.0f;   // round(x / ln 2)
    float r  = x - k * 0.693145751953125f;                                 // ln 2, high part (exact k * hi)
    r        = r - k * 1.428606765330187e-06f;                             // ln 2, low part
    float p  = 1.0f / 720.0f;                                              // exp(r), |r| <= ln(2) / 2
    p        = p * r + 1.0f / 120.0f;
    p        = p * r + 1.0f / 24.0f;
    p        = p * r + 1.0f / 6.0f;
    p        = p * r + 0.5f;
    p        = p * r + 1.0f;
    p        = p * r + 1.0f;
    // 2^k from its exponent bits, k clamped first: converting a NaN or an out-of-range float to int is
    // undefined. A NaN x gives k = -127 (2^k = 0) and p = NaN, so NaN still comes out; a huge x gives inf.
    k         = k >= -127.0f ? k : -127.0f;
    k         = k <= 128.0f ? k : 128.0f;
    int32_t e = (static_cast<int32_t>(k) + 127) << 23;
    return p * std::bit_cast<float>(e);
}

inline float tanh_approx(float u) { return 1.0f - 2.0f / (exp_approx(2.0f * u) + 1.0f); }

inline float sigmoid_approx(float x) { return 1.0f / (1.0f + exp_approx(-x)); }

}  // namespace loom::cpu
