// Values the numerical tests draw: n uniform floats in [-scale, scale] from a seed.
#pragma once

#include <cstdint>
#include <random>
#include <vector>

namespace loom::testing {

inline std::vector<float> random_vector(int64_t n, uint64_t seed, float scale = 1.0f) {
    std::mt19937_64                       rng(seed);
    std::uniform_real_distribution<float> u(-scale, scale);
    std::vector<float>                    v(static_cast<size_t>(n));
    for (auto & x : v) x = u(rng);
    return v;
}

}  // namespace loom::testing
