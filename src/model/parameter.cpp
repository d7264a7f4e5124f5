#include "model/parameter.h"

#include "core/allocator.h"
#include "core/error.h"
#include "core/ops.h"

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

namespace loom::model {

Parameter parameter_create(const std::string & name, const Shape & shape, DType dtype, Device & device) {
    LOOM_CHECK(dtype == DType::f32 || dtype_is_half(dtype),
               "parameter " << name << " of dtype " << dtype_name(dtype), "parameters are float32, bfloat16 or float16");
    Parameter p;
    p.name      = name;
    p.data      = Tensor::empty(shape, dtype, device, {MemoryKind::device, "weights"});
    p.main_grad = Tensor::zeros(shape, DType::f32, device, {MemoryKind::device, "grads"});
    return p;
}

bool any_16bit_grads(std::span<const Tensor> main_grads) {
    for (const Tensor & t : main_grads) {
        if (t.defined() && t.dtype() != DType::f32) return true;
    }
    return false;
}

std::vector<Tensor> widen_grads(Stream & stream, std::span<const Tensor> main_grads) {
    std::vector<Tensor> wide(main_grads.begin(), main_grads.end());
    for (Tensor & t : wide) {
        if (!t.defined() || t.dtype() == DType::f32) continue;
        Tensor f32 = Tensor::empty(t.shape(), DType::f32, t.device(), {MemoryKind::device, kActivationsPool});
        t.device().ops().convert(stream, t, f32);
        t = f32;
    }
    return wide;
}

void narrow_grads(Stream & stream, std::span<const Tensor> wide, std::span<const Tensor> main_grads) {
    for (size_t i = 0; i < wide.size(); ++i) {
        if (wide[i].defined() && wide[i].dtype() != main_grads[i].dtype()) {
            main_grads[i].device().ops().convert(stream, wide[i], main_grads[i]);
        }
    }
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

namespace {

// Fills p with draw(rng, values) over the full tensor's values, from a stream seeded by (seed, name), keeping this
// rank's tp_slice.
template <class Draw>
void init_from_stream(Parameter & p, uint64_t seed, Draw && draw) {
    std::mt19937_64    rng(seed * 0x9e3779b97f4a7c15ull ^ fnv1a(p.name));
    const bool         sharded = p.tp_slice.dim >= 0;
    int64_t            full    = 1;
    for (int64_t d : p.tp_slice.full_shape) full *= d;
    std::vector<float> w(static_cast<size_t>(sharded ? full : p.numel()));
    draw(rng, w);
    if (sharded) w = tp_extract(p.tp_slice, w.data());
    LOOM_CHECK(static_cast<int64_t>(w.size()) == p.numel(), "tensor-parallel slice of " << p.name << " holds "
                                                                                         << w.size() << " elements, the parameter "
                                                                                         << p.numel(), "");
    write_values_f32(p.data, w);
}

// A 53-bit uniform in [0, 1): identical on every platform (std's distributions are not).
double uniform01(std::mt19937_64 & rng) { return static_cast<double>(rng() >> 11) * 0x1p-53; }

}  // namespace

void parameter_init_normal(Parameter & p, uint64_t seed, float std) {
    init_from_stream(p, seed, [&](std::mt19937_64 & rng, std::vector<float> & w) {
        // Box-Muller on 53-bit uniforms.
        constexpr double kTwoPi = 6.283185307179586;
        for (int64_t i = 0; i < static_cast<int64_t>(w.size()); i += 2) {
            double u1 = (static_cast<double>(rng() >> 11) + 1.0) * 0x1p-53;
            double u2 = uniform01(rng);
            double r  = std::sqrt(-2.0 * std::log(u1));
            w[i]      = static_cast<float>(std * r * std::cos(kTwoPi * u2));
            if (i + 1 < static_cast<int64_t>(w.size())) {
                w[i + 1] = static_cast<float>(std * r * std::sin(kTwoPi * u2));
            }
        }
    });
}

void parameter_init_uniform(Parameter & p, uint64_t seed, double lo, double hi, double (*map)(double)) {
    init_from_stream(p, seed, [&](std::mt19937_64 & rng, std::vector<float> & w) {
        for (float & e : w) {
            const double u = lo + (hi - lo) * uniform01(rng);
            e              = static_cast<float>(map ? map(u) : u);
        }
    });
}

void tp_slice_runs(const TpSlice & slice, const std::function<void(int64_t, int64_t, int64_t)> & fn) {
    const Shape & shape = slice.full_shape;
    const int     dim   = slice.dim;
    LOOM_CHECK(dim >= 0 && dim < static_cast<int>(shape.size()), "a tensor-parallel slice along dim " << dim << " of a "
                                                                                                       << shape.size() << "-d tensor", "");
    int64_t inner = 1;   // elements per index of `dim`
    for (size_t d = static_cast<size_t>(dim) + 1; d < shape.size(); ++d) inner *= shape[d];
    for (auto [a, b] : slice.ranges) {
        LOOM_CHECK(0 <= a && a <= b && b <= shape[static_cast<size_t>(dim)],
                   "range [" << a << ", " << b << ") outside dim " << dim << " of " << shape_string(shape), "");
    }
    int64_t local = 0;
    if (dim == 0) {
        for (auto [a, b] : slice.ranges) {
            fn(local, a * inner, (b - a) * inner);
            local += (b - a) * inner;
        }
        return;
    }
    // Rows: every index of dims [0, dim), dim 0 restricted to `outer`; each holds the ranges of `dim`.
    int64_t between = 1;   // indices of dims 1 .. dim-1 per index of dim 0
    for (size_t d = 1; d < static_cast<size_t>(dim); ++d) between *= shape[d];
    const int64_t first = slice.outer.first, count = slice.outer.second < 0 ? shape[0] - first : slice.outer.second - first;
    LOOM_CHECK(first >= 0 && count >= 0 && first + count <= shape[0], "outer range outside dim 0 of " << shape_string(shape), "");
    const int64_t row_size = shape[static_cast<size_t>(dim)] * inner;
    for (int64_t r = 0; r < count * between; ++r) {
        const int64_t row = (first + r / between) * between + r % between;
        for (auto [a, b] : slice.ranges) {
            fn(local, row * row_size + a * inner, (b - a) * inner);
            local += (b - a) * inner;
        }
    }
}

std::vector<float> tp_extract(const TpSlice & slice, const float * full) {
    LOOM_CHECK(slice.dim >= 0, "tp_extract of an unsplit tensor", "");
    std::vector<float> out;
    tp_slice_runs(slice, [&](int64_t, int64_t at, int64_t n) { out.insert(out.end(), full + at, full + at + n); });
    return out;
}

void parameter_init_constant(Parameter & p, float value) {
    write_values_f32(p.data, std::vector<float>(static_cast<size_t>(p.numel()), value));
}

Tensor parameter_f32(const Parameter & p) {
    if (p.data.dtype() == DType::f32) {
        return p.data;
    }
    Device &            device = p.data.device();
    Ops &               ops    = device.ops();
    Stream &            stream = device.compute_stream();
    const TensorOptions pool{MemoryKind::device, "activations"};
    Tensor              out = Tensor::empty(p.data.shape(), DType::f32, device, pool);
    if (!p.fp8_codes()) {
        ops.convert(stream, p.data, out);
        return out;
    }
    // FP8 codes: each block's values times its scale_inv (the product in f32, as the GEMMs scale theirs back).
    const Tensor values = Tensor::empty({p.numel()}, DType::bf16, device, pool);
    const Tensor flat   = out.view({p.numel()});
    ops.fp8_decode(stream, p.data.view({p.numel()}), p.fp8_format, values);
    ops.convert(stream, values, flat);
    const Tensor  one   = Tensor::empty({1}, DType::f32, device, pool);
    write_values_f32(one, std::vector<float>{1.0f});
    const int64_t block = p.numel() / p.fp8_blocks;
    for (int64_t b = 0; b < p.fp8_blocks; ++b) {
        ops.scale_by_product(stream, flat.slice(b * block, {block}), p.fp8_scale_inv.slice(b, {1}), one);
    }
    return out;
}

void parameter_write_f32(Parameter & p, std::span<const float> values) {
    LOOM_CHECK(static_cast<int64_t>(values.size()) == p.numel(), values.size() << " values for " << p.name, "");
    if (!p.fp8_codes()) {
        write_values_f32(p.data, values);
        return;
    }
    const int64_t        block = p.numel() / p.fp8_blocks;
    std::vector<uint8_t> codes(values.size());
    std::vector<float>   scale_inv(static_cast<size_t>(p.fp8_blocks));
    for (int64_t k = 0; k < p.fp8_blocks; ++k) {
        uint32_t amax = 0;
        for (int64_t i = k * block; i < (k + 1) * block; ++i) amax = std::max(amax, float_to_bits(values[i]) & 0x7FFFFFFFu);
        const float scale = fp8_scale_from_amax(bits_to_float(amax), p.fp8_format);
        for (int64_t i = k * block; i < (k + 1) * block; ++i) codes[i] = fp8_from_f32(values[i] * scale, p.fp8_format);
        scale_inv[k] = 1.0f / scale;
    }
    Tensor host = Tensor::empty(p.data.shape(), DType::u8, p.data.device(), {MemoryKind::pinned_host});
    std::memcpy(host.data_ptr(), codes.data(), codes.size());
    copy_now(p.data, host);
    write_values_f32(p.fp8_scale_inv, scale_inv);
}

}  // namespace loom::model
