#include "core/dtype.h"

#include "core/error.h"

#include <cstring>
#include <vector>

#if defined(__F16C__) && defined(__AVX__)
#include <immintrin.h>
#define LOOM_HAVE_F16C 1
#endif

namespace loom {

size_t dtype_size(DType dtype) {
    switch (dtype) {
        case DType::f32:  return 4;
        case DType::bf16: return 2;
        case DType::f16:  return 2;
        case DType::i32:  return 4;
        case DType::i64:  return 8;
        case DType::u8:   return 1;
        case DType::f64:  return 8;
    }
    LOOM_THROW("unknown dtype " << static_cast<int>(dtype), "");
}

bool dtype_is_floating(DType dtype) {
    return dtype == DType::f32 || dtype == DType::bf16 || dtype == DType::f16 || dtype == DType::f64;
}

const char * dtype_name(DType dtype) {
    switch (dtype) {
        case DType::f32:  return "float32";
        case DType::bf16: return "bfloat16";
        case DType::f16:  return "float16";
        case DType::i32:  return "int32";
        case DType::i64:  return "int64";
        case DType::u8:   return "uint8";
        case DType::f64:  return "float64";
    }
    return "unknown";
}

DType dtype_from_name(std::string_view name) {
    struct Alias { const char * name; DType dtype; };
    static const Alias aliases[] = {
        {"float32", DType::f32}, {"f32", DType::f32}, {"fp32", DType::f32}, {"float", DType::f32},
        {"bfloat16", DType::bf16}, {"bf16", DType::bf16},
        {"float16", DType::f16}, {"f16", DType::f16}, {"fp16", DType::f16}, {"half", DType::f16},
        {"int32", DType::i32}, {"i32", DType::i32},
        {"int64", DType::i64}, {"i64", DType::i64},
        {"uint8", DType::u8}, {"u8", DType::u8},
        {"float64", DType::f64}, {"f64", DType::f64}, {"fp64", DType::f64}, {"double", DType::f64},
    };
    for (const Alias & alias : aliases) {
        if (name == alias.name) {
            return alias.dtype;
        }
    }
    LOOM_THROW("unknown dtype '" << name << "'",
               "use one of float32, bfloat16, float16, int32, int64, uint8, float64");
}

void convert_f32_to_bf16(const float * src, uint16_t * dst, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        dst[i] = f32_to_bf16_bits(src[i]);
    }
}

void convert_bf16_to_f32(const uint16_t * src, float * dst, size_t n) {
    for (size_t i = 0; i < n; ++i) {
        dst[i] = bf16_bits_to_f32(src[i]);
    }
}

void convert_f32_to_f16(const float * src, uint16_t * dst, size_t n) {
    size_t i = 0;
#ifdef LOOM_HAVE_F16C
    // vcvtps2ph honours IEEE round-to-nearest-even, subnormals, Inf and NaN, as long as the compute
    // thread has not turned on denormals-are-zero; callers that set DAZ must use the scalar path.
    if ((_mm_getcsr() & 0x0040u) == 0) {
        for (; i + 8 <= n; i += 8) {
            __m256  x = _mm256_loadu_ps(src + i);
            __m128i h = _mm256_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
            _mm_storeu_si128(reinterpret_cast<__m128i *>(dst + i), h);
        }
    }
#endif
    for (; i < n; ++i) {
        dst[i] = f32_to_f16_bits(src[i]);
    }
}

void convert_f16_to_f32(const uint16_t * src, float * dst, size_t n) {
    size_t i = 0;
#ifdef LOOM_HAVE_F16C
    for (; i + 8 <= n; i += 8) {
        __m128i h = _mm_loadu_si128(reinterpret_cast<const __m128i *>(src + i));
        _mm256_storeu_ps(dst + i, _mm256_cvtph_ps(h));
    }
#endif
    for (; i < n; ++i) {
        dst[i] = f16_bits_to_f32(src[i]);
    }
}

void convert(const void * src, DType src_dtype, void * dst, DType dst_dtype, size_t n) {
    LOOM_CHECK(dtype_is_floating(src_dtype) && dtype_is_floating(dst_dtype),
               "convert supports float32, bfloat16, float16 and float64, got " << dtype_name(src_dtype) << " -> "
                                                                                << dtype_name(dst_dtype),
               "convert integer tensors element by element");
    LOOM_CHECK(src_dtype != DType::f64 || dst_dtype == DType::f64 || dst_dtype == DType::f32,
               "convert float64 -> " << dtype_name(dst_dtype), "convert to float32 first (that rounds twice)");
    if (n == 0) return;   // an empty tensor's data may be null, which memcpy must not be given
    if (src_dtype == dst_dtype) {
        std::memcpy(dst, src, n * dtype_size(src_dtype));
        return;
    }
    if (src_dtype == DType::f64) {   // to f32: one rounding
        auto * s = static_cast<const double *>(src);
        auto * d = static_cast<float *>(dst);
        for (size_t i = 0; i < n; ++i) d[i] = static_cast<float>(s[i]);
        return;
    }
    if (dst_dtype == DType::f64) {   // exact: through f32, which holds every 16-bit value
        auto *           d = static_cast<double *>(dst);
        constexpr size_t kBlock = 1024;
        float            tmp[kBlock];
        for (size_t i = 0; i < n; i += kBlock) {
            const size_t m = n - i < kBlock ? n - i : kBlock;
            convert(static_cast<const char *>(src) + i * dtype_size(src_dtype), src_dtype, tmp, DType::f32, m);
            for (size_t j = 0; j < m; ++j) d[i + j] = tmp[j];
        }
        return;
    }
    if (src_dtype == DType::f32) {
        auto * s = static_cast<const float *>(src);
        auto * d = static_cast<uint16_t *>(dst);
        dst_dtype == DType::bf16 ? convert_f32_to_bf16(s, d, n) : convert_f32_to_f16(s, d, n);
        return;
    }
    auto * s = static_cast<const uint16_t *>(src);
    if (dst_dtype == DType::f32) {
        auto * d = static_cast<float *>(dst);
        src_dtype == DType::bf16 ? convert_bf16_to_f32(s, d, n) : convert_f16_to_f32(s, d, n);
        return;
    }
    // bf16 <-> f16: through f32 in blocks (bf16 -> f32 is exact, so this rounds once).
    constexpr size_t kBlock = 1024;
    float  tmp[kBlock];
    auto * d = static_cast<uint16_t *>(dst);
    for (size_t i = 0; i < n; i += kBlock) {
        size_t m = n - i < kBlock ? n - i : kBlock;
        src_dtype == DType::bf16 ? convert_bf16_to_f32(s + i, tmp, m) : convert_f16_to_f32(s + i, tmp, m);
        dst_dtype == DType::bf16 ? convert_f32_to_bf16(tmp, d + i, m) : convert_f32_to_f16(tmp, d + i, m);
    }
}

}  // namespace loom
