// DType: the element types of Loom tensors, and the 16-bit float conversions.
//
//   dtype   bytes  name        notes
//   f32     4      float32     master weights, main_grad, optimizer state
//   bf16    2      bfloat16    1 sign, 8 exponent, 7 mantissa bits: the top half of an f32
//   f16     2      float16     1 sign, 5 exponent, 10 mantissa bits (IEEE binary16)
//   i32     4      int32
//   i64     8      int64       token ids, sample indices
//   u8      1      uint8       raw bytes
//
// f32 -> bf16 / f16 rounds to nearest, ties to even, as IEEE does: a value halfway between two
// representable numbers goes to the one whose last mantissa bit is 0. Values beyond the largest finite
// number (after rounding) become +-Inf; f32 values too small become +-0 or a subnormal. Inf keeps its
// sign; NaN stays NaN (quietened, sign and the top payload bits kept). bf16/f16 -> f32 is exact
// (an f16 signalling NaN comes out quiet, as the hardware conversion gives it).
//
// The array conversions are written as plain branch-free loops that the compiler vectorises (AVX-512 with
// LOOM_NATIVE on a machine that has it), with the scalar functions as their twins.
#pragma once

#include "core/float_bits.h"

#include <bit>
#include <cstddef>
#include <cstdint>
#include <string>
#include <string_view>

namespace loom {

enum class DType : uint8_t { f32, bf16, f16, i32, i64, u8, f64 };

inline constexpr DType kAllDTypes[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::f64};

size_t      dtype_size(DType dtype);
bool        dtype_is_floating(DType dtype);
// bf16 or f16: a 16-bit float parameter dtype (--bf16, --fp16), with an f32 master beside it.
inline bool dtype_is_half(DType dtype) { return dtype == DType::bf16 || dtype == DType::f16; }
// The name users type and files store: "float32", "bfloat16", "float16", "int32", "int64", "uint8", "float64".
const char * dtype_name(DType dtype);
// Parses dtype_name()'s spellings and the short ones ("f32", "bf16", "fp16", ...); throws on others.
DType        dtype_from_name(std::string_view name);

// Storage types of the 16-bit floats: the raw bits, no arithmetic.
struct bf16_t { uint16_t bits; };
struct f16_t  { uint16_t bits; };

// The scalar conversions (f32_to_bf16_bits, bf16_bits_to_f32, f32_to_f16_bits, f16_bits_to_f32): core/float_bits.h.

// Array conversions; src and dst must not overlap.
void convert_f32_to_bf16(const float * src, uint16_t * dst, size_t n);
void convert_bf16_to_f32(const uint16_t * src, float * dst, size_t n);
void convert_f32_to_f16(const float * src, uint16_t * dst, size_t n);
void convert_f16_to_f32(const uint16_t * src, float * dst, size_t n);

// Converts n elements between any two floating dtypes (f32, bf16, f16, f64), through f32, rounding once to
// nearest even: f64 -> f32 rounds, every widening is exact. f64 -> bf16 or f16 is refused (it would round
// twice); go through f32 on purpose where that is meant.
void convert(const void * src, DType src_dtype, void * dst, DType dst_dtype, size_t n);

// The DType of a C++ element type, for typed access to tensors.
template <typename T> struct dtype_of;
template <> struct dtype_of<float>    { static constexpr DType value = DType::f32;  };
template <> struct dtype_of<bf16_t>   { static constexpr DType value = DType::bf16; };
template <> struct dtype_of<f16_t>    { static constexpr DType value = DType::f16;  };
template <> struct dtype_of<int32_t>  { static constexpr DType value = DType::i32;  };
template <> struct dtype_of<int64_t>  { static constexpr DType value = DType::i64;  };
template <> struct dtype_of<uint8_t>  { static constexpr DType value = DType::u8;   };
template <> struct dtype_of<double>   { static constexpr DType value = DType::f64;  };

}  // namespace loom
