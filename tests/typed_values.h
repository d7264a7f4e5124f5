// A CPU tensor of given values in any dtype, for the communicator tests (the values are chosen exact in
// every dtype they are used with; floats round to nearest even).
#pragma once

#include "backend/cpu/cpu_device.h"
#include "core/dtype.h"
#include "core/tensor.h"

#include <cstdint>
#include <vector>

namespace loom::testing {

inline Tensor tensor_of(DType dtype, const std::vector<double> & values) {
    const int64_t n = static_cast<int64_t>(values.size());
    Tensor        t = Tensor::empty({n}, dtype, cpu::device());
    for (int64_t i = 0; i < n; ++i) {
        const double v = values[static_cast<size_t>(i)];
        switch (dtype) {
            case DType::f32:  t.data<float>()[i] = static_cast<float>(v); break;
            case DType::bf16: t.data<bf16_t>()[i] = bf16_t{f32_to_bf16_bits(static_cast<float>(v))}; break;
            case DType::f16:  t.data<f16_t>()[i] = f16_t{f32_to_f16_bits(static_cast<float>(v))}; break;
            case DType::i32:  t.data<int32_t>()[i] = static_cast<int32_t>(v); break;
            case DType::i64:  t.data<int64_t>()[i] = static_cast<int64_t>(v); break;
            case DType::u8:   t.data<uint8_t>()[i] = static_cast<uint8_t>(v); break;
            case DType::f64:  t.data<double>()[i] = v; break;
        }
    }
    return t;
}

}  // namespace loom::testing
