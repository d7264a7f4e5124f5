#include "model/parameter.h"

#include <cmath>
#include <random>

namespace loom::model {

Parameter parameter_create(const std::string & name, const Shape & shape, Device & device) {
    Parameter p;
    p.name      = name;
    p.data      = Tensor::empty(shape, DType::f32, device, {MemoryKind::device, "weights"});
    p.main_grad = Tensor::zeros(shape, DType::f32, device, {MemoryKind::device, "grads"});
    return p;
}

namespace {

uint64_t fnv1a(const std::string & s) {
    uint64_t h = 1469598103934665603ull;
    for (unsigned char c : s) {
        h = (h ^ c) * 1099511628211ull;
    }
    return h;
}

}  // namespace

void parameter_init_normal(Parameter & p, uint64_t seed, float std) {
    std::mt19937_64 rng(seed * 0x9e3779b97f4a7c15ull ^ fnv1a(p.name));
    float *         w = p.data.data<float>();
    // Box-Muller on 53-bit uniforms: identical on every platform (std::normal_distribution is not).
    constexpr double kTwoPi = 6.283185307179586;
    for (int64_t i = 0; i < p.numel(); i += 2) {
        double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1p-53;
        double u2 = static_cast<double>(rng() >> 11) * 0x1p-53;
        double r  = std::sqrt(-2.0 * std::log(u1));
        w[i]      = static_cast<float>(std * r * std::cos(kTwoPi * u2));
        if (i + 1 < p.numel()) {
            w[i + 1] = static_cast<float>(std * r * std::sin(kTwoPi * u2));
        }
    }
}

void parameter_init_constant(Parameter & p, float value) {
    float * w = p.data.data<float>();
    for (int64_t i = 0; i < p.numel(); ++i) {
        w[i] = value;
    }
}

}  // namespace loom::model
