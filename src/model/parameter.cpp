#include "model/parameter.h"

#include "core/error.h"

#include <cmath>
#include <random>
#include <vector>

namespace loom::model {

Parameter parameter_create(const std::string & name, const Shape & shape, DType dtype, Device & device) {
    LOOM_CHECK(dtype == DType::f32 || dtype == DType::bf16,
               "parameter " << name << " of dtype " << dtype_name(dtype), "parameters are float32 or bfloat16");
    Parameter p;
    p.name      = name;
    p.data      = Tensor::empty(shape, dtype, device, {MemoryKind::device, "weights"});
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
    std::mt19937_64    rng(seed * 0x9e3779b97f4a7c15ull ^ fnv1a(p.name));
    std::vector<float> w(static_cast<size_t>(p.numel()));
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
    convert(w.data(), DType::f32, p.data.data_ptr(), p.data.dtype(), w.size());
}

void parameter_init_constant(Parameter & p, float value) {
    std::vector<float> w(static_cast<size_t>(p.numel()), value);
    convert(w.data(), DType::f32, p.data.data_ptr(), p.data.dtype(), w.size());
}

Tensor parameter_f32(const Parameter & p) {
    if (p.data.dtype() == DType::f32) {
        return p.data;
    }
    Tensor out = Tensor::empty(p.data.shape(), DType::f32, p.data.device(), {MemoryKind::device, "activations"});
    convert(p.data.data_ptr(), p.data.dtype(), out.data_ptr(), DType::f32, static_cast<size_t>(p.numel()));
    return out;
}

}  // namespace loom::model
