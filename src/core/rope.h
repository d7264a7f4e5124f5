// Rotary embedding's frequencies, on the host, for every backend (Ops::rope): plain RoPE's base^(-2i / r),
// or YaRN's (Megatron's YarnRotaryEmbedding: multi-latent attention's default), which keeps the fast
// frequencies, divides the slow ones by the context's scaling factor and blends the two over a ramp of pairs.
//
// YaRN, for r rotated elements (pairs i < r / 2), scaling factor f, the original context L, beta_fast and
// beta_slow (Megatron's defaults 4096, 32 and 1):
//   dim(k)     = r ln(L / (2 pi k)) / (2 ln base)
//   low, high  = floor(dim(beta_fast)), ceil(dim(beta_slow)), clamped to [0, r - 1] (high + 0.001 if equal)
//   keep_i     = 1 - clamp((i - low) / (high - low), 0, 1)
//   freq_i     = base^(-2i / r) / f (1 - keep_i) + base^(-2i / r) keep_i
// and cos and sin are scaled by the concentration factor mscale(f, mscale) / mscale(f, mscale_all_dim), with
// mscale(f, m) = 0.1 m ln(f) + 1 for f > 1, else 1. At f = 1 the frequencies are plain RoPE's and the
// amplitude 1. Multi-latent attention also multiplies its softmax scale by mscale(f, mscale_all_dim)^2.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>

namespace loom {

struct RopeScaling {
    float   factor                 = 1.0f;    // --rotary-scaling-factor (1: none)
    int64_t original_max_positions = 4096;    // Megatron's MLA config: original_max_position_embeddings
    float   beta_fast              = 32.0f;
    float   beta_slow              = 1.0f;
    float   amplitude              = 1.0f;    // cos and sin multiplied by it (YaRN's concentration factor)
};

// YaRN's mscale(f, m).
inline double yarn_mscale(double factor, double m) { return factor <= 1.0 ? 1.0 : 0.1 * m * std::log(factor) + 1.0; }

// The r / 2 inverse frequencies: plain RoPE's (factor 1), or YaRN's.
inline std::vector<float> rope_inv_freq(float base, int64_t r, const RopeScaling & y = {}) {
    const int64_t      half = r / 2;
    std::vector<float> f(static_cast<size_t>(half));
    for (int64_t i = 0; i < half; ++i) f[i] = std::pow(base, -2.0f * static_cast<float>(i) / static_cast<float>(r));
    if (y.factor == 1.0f) return f;
    const double pi     = 3.14159265358979323846;
    auto         dim_of = [&](double rotations) {
        return static_cast<double>(r) * std::log(static_cast<double>(y.original_max_positions) / (rotations * 2.0 * pi)) /
               (2.0 * std::log(static_cast<double>(base)));
    };
    const double low  = std::max(std::floor(dim_of(y.beta_fast)), 0.0);
    double       high = std::min(std::ceil(dim_of(y.beta_slow)), static_cast<double>(r - 1));
    if (low == high) high += 0.001;
    for (int64_t i = 0; i < half; ++i) {
        const float keep = 1.0f - static_cast<float>(std::clamp((static_cast<double>(i) - low) / (high - low), 0.0, 1.0));
        f[i]             = f[i] / y.factor * (1.0f - keep) + f[i] * keep;
    }
    return f;
}

}  // namespace loom
