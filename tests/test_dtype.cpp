// DType conversions: exhaustive bf16 round trip and rounding, f16 round trip and rounding at every
// midpoint, NaN/Inf preservation, and the array paths against the scalar twins. All exact (bitwise).
#include "core/dtype.h"
#include "core/error.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstring>
#include <thread>
#include <vector>

using namespace loom;

namespace {

bool bf16_is_nan(uint16_t b) { return (b & 0x7f80u) == 0x7f80u && (b & 0x007fu) != 0; }
bool f16_is_nan(uint16_t h) { return (h & 0x7c00u) == 0x7c00u && (h & 0x03ffu) != 0; }

// The value of a bf16 bit pattern as a double, reading the all-ones exponent of +-Inf as +-2^128 (the
// next power of two past the largest finite bf16), which is what round-to-nearest compares against.
double bf16_value_unbounded(uint16_t b) {
    if ((b & 0x7fffu) == 0x7f80u) {
        return (b & 0x8000u) ? -0x1p128 : 0x1p128;
    }
    return static_cast<double>(bf16_bits_to_f32(b));
}

// Reference f32 -> bf16 by definition: of the two bf16 neighbours of x (truncation and the next one
// away from zero) take the nearer, on a tie the one with an even last bit.
uint16_t reference_bf16(uint32_t u) {
    float x = std::bit_cast<float>(u);
    if (std::isnan(x)) {
        return 0;   // not used for NaN
    }
    uint16_t lo = static_cast<uint16_t>(u >> 16);       // toward zero
    if ((u & 0xffffu) == 0) {
        return lo;                                       // exact
    }
    uint16_t hi = static_cast<uint16_t>(lo + 1);         // away from zero
    double   v  = static_cast<double>(x);
    double   dl = std::fabs(v - bf16_value_unbounded(lo));
    double   dh = std::fabs(bf16_value_unbounded(hi) - v);
    if (dl < dh) return lo;
    if (dh < dl) return hi;
    return (lo & 1u) ? hi : lo;
}

}  // namespace

TEST(DType, SizesAndNames) {
    EXPECT_EQ(dtype_size(DType::f32), 4u);
    EXPECT_EQ(dtype_size(DType::bf16), 2u);
    EXPECT_EQ(dtype_size(DType::f16), 2u);
    EXPECT_EQ(dtype_size(DType::i32), 4u);
    EXPECT_EQ(dtype_size(DType::i64), 8u);
    EXPECT_EQ(dtype_size(DType::u8), 1u);
    EXPECT_EQ(dtype_size(DType::f64), 8u);
    EXPECT_EQ(dtype_from_name("fp64"), DType::f64);
    for (DType d : kAllDTypes) {
        EXPECT_EQ(dtype_from_name(dtype_name(d)), d);
    }
    EXPECT_EQ(dtype_from_name("bf16"), DType::bf16);
    EXPECT_EQ(dtype_from_name("fp16"), DType::f16);
    EXPECT_THROW(dtype_from_name("float8"), Error);
}

TEST(DType, Bf16RoundTripIsExactForAll65536Patterns) {
    std::vector<uint16_t> all(65536), back(65536);
    std::vector<float>    wide(65536);
    for (uint32_t b = 0; b < 65536; ++b) {
        all[b] = static_cast<uint16_t>(b);
    }
    convert_bf16_to_f32(all.data(), wide.data(), all.size());
    convert_f32_to_bf16(wide.data(), back.data(), wide.size());
    for (uint32_t b = 0; b < 65536; ++b) {
        EXPECT_EQ(std::bit_cast<uint32_t>(wide[b]), b << 16) << "bf16 -> f32 of " << b;
        if (bf16_is_nan(static_cast<uint16_t>(b))) {
            // NaN stays NaN with its sign, quietened; a quiet NaN comes back unchanged.
            ASSERT_TRUE(bf16_is_nan(back[b])) << b;
            EXPECT_EQ(back[b], static_cast<uint16_t>(b | 0x0040u)) << b;
        } else {
            ASSERT_EQ(back[b], b) << "round trip of bf16 pattern " << b;
        }
    }
}

TEST(DType, F32ToBf16RoundsToNearestEvenForEvery32BitPattern) {
    // 2^32 inputs, split over two threads; each compares the vectorised array conversion against the
    // by-definition reference. NaN inputs must give a NaN of the same sign.
    constexpr uint64_t kTotal = uint64_t{1} << 32;
    constexpr uint32_t kChunk = 1u << 16;
    auto check_range = [&](uint64_t begin, uint64_t end, uint64_t * mismatches) {
        std::vector<float>    in(kChunk);
        std::vector<uint16_t> out(kChunk);
        for (uint64_t base = begin; base < end; base += kChunk) {
            for (uint32_t i = 0; i < kChunk; ++i) {
                in[i] = std::bit_cast<float>(static_cast<uint32_t>(base + i));
            }
            convert_f32_to_bf16(in.data(), out.data(), kChunk);
            for (uint32_t i = 0; i < kChunk; ++i) {
                uint32_t u = static_cast<uint32_t>(base + i);
                bool     ok;
                if ((u & 0x7fffffffu) > 0x7f800000u) {
                    ok = bf16_is_nan(out[i]) && (out[i] & 0x8000u) == ((u >> 16) & 0x8000u);
                } else {
                    ok = out[i] == reference_bf16(u) && out[i] == f32_to_bf16_bits(in[i]);
                }
                *mismatches += ok ? 0 : 1;
            }
        }
    };
    uint64_t    mismatches[2] = {0, 0};
    std::thread other(check_range, kTotal / 2, kTotal, &mismatches[1]);
    check_range(0, kTotal / 2, &mismatches[0]);
    other.join();
    EXPECT_EQ(mismatches[0] + mismatches[1], 0u);
}

TEST(DType, Bf16SpecialValues) {
    EXPECT_EQ(f32_to_bf16_bits(INFINITY), 0x7f80u);
    EXPECT_EQ(f32_to_bf16_bits(-INFINITY), 0xff80u);
    EXPECT_EQ(f32_to_bf16_bits(0.0f), 0x0000u);
    EXPECT_EQ(f32_to_bf16_bits(-0.0f), 0x8000u);
    EXPECT_TRUE(bf16_is_nan(f32_to_bf16_bits(NAN)));
    // A signalling NaN whose payload lives only in the low 16 bits must not become Inf.
    EXPECT_TRUE(bf16_is_nan(f32_to_bf16_bits(std::bit_cast<float>(0x7f800001u))));
    // The largest finite f32 rounds up to Inf in bf16; 1 + 2^-8 (a tie) rounds to even (1.0).
    EXPECT_EQ(f32_to_bf16_bits(std::bit_cast<float>(0x7f7fffffu)), 0x7f80u);
    EXPECT_EQ(f32_to_bf16_bits(1.0f + 0x1p-8f), 0x3f80u);
    EXPECT_EQ(f32_to_bf16_bits(1.0f + 0x1p-8f + 0x1p-20f), 0x3f81u);
}

TEST(DType, F16RoundTripIsExactForAll65536Patterns) {
    std::vector<uint16_t> all(65536), back_array(65536);
    std::vector<float>    wide(65536);
    for (uint32_t h = 0; h < 65536; ++h) {
        all[h] = static_cast<uint16_t>(h);
    }
    convert_f16_to_f32(all.data(), wide.data(), all.size());
    convert_f32_to_f16(wide.data(), back_array.data(), wide.size());
    for (uint32_t h = 0; h < 65536; ++h) {
        float scalar = f16_bits_to_f32(static_cast<uint16_t>(h));
        ASSERT_EQ(std::bit_cast<uint32_t>(wide[h]), std::bit_cast<uint32_t>(scalar)) << "f16 -> f32 of " << h;
        uint16_t back_scalar = f32_to_f16_bits(scalar);
        if (f16_is_nan(static_cast<uint16_t>(h))) {
            EXPECT_TRUE(f16_is_nan(back_scalar) && f16_is_nan(back_array[h])) << h;
            EXPECT_EQ(back_scalar, static_cast<uint16_t>(h | 0x0200u)) << h;
            EXPECT_EQ(back_array[h], back_scalar) << h;
        } else {
            ASSERT_EQ(back_scalar, h) << "scalar round trip of f16 pattern " << h;
            ASSERT_EQ(back_array[h], h) << "array round trip of f16 pattern " << h;
        }
    }
    // Known values: 1.0, the largest finite, the smallest subnormal, Inf.
    EXPECT_EQ(f16_bits_to_f32(0x3c00u), 1.0f);
    EXPECT_EQ(f16_bits_to_f32(0x7bffu), 65504.0f);
    EXPECT_EQ(f16_bits_to_f32(0x0001u), 0x1p-24f);
    EXPECT_TRUE(std::isinf(f16_bits_to_f32(0x7c00u)));
}

TEST(DType, F32ToF16RoundsToNearestEvenAtEveryMidpoint) {
    // For every pair of adjacent non-negative f16 values (including the largest finite and the
    // overflow threshold 65520), the exact midpoint must round to the even one, and one f32 ulp either
    // side to the nearer one. Negative values mirror. Array and scalar paths must agree.
    std::vector<float>    inputs;
    std::vector<uint16_t> expected;
    for (uint32_t h = 0; h < 0x7c00u; ++h) {
        double lo  = f16_bits_to_f32(static_cast<uint16_t>(h));
        double hi  = h + 1 == 0x7c00u ? 65536.0 : f16_bits_to_f32(static_cast<uint16_t>(h + 1));
        float  mid = static_cast<float>((lo + hi) / 2);   // exact in f32
        ASSERT_EQ(static_cast<double>(mid), (lo + hi) / 2);
        uint16_t even = (h & 1u) ? static_cast<uint16_t>(h + 1) : static_cast<uint16_t>(h);
        for (float sign : {1.0f, -1.0f}) {
            uint16_t s = sign < 0 ? 0x8000u : 0;
            inputs.push_back(sign * mid);
            expected.push_back(static_cast<uint16_t>(even | s));
            inputs.push_back(sign * std::nextafter(mid, 0.0f));
            expected.push_back(static_cast<uint16_t>(h | s));
            inputs.push_back(sign * std::nextafter(mid, INFINITY));
            expected.push_back(static_cast<uint16_t>((h + 1) | s));
        }
    }
    std::vector<uint16_t> out(inputs.size());
    convert_f32_to_f16(inputs.data(), out.data(), inputs.size());
    size_t mismatches = 0;
    for (size_t i = 0; i < inputs.size(); ++i) {
        uint16_t scalar = f32_to_f16_bits(inputs[i]);
        if (out[i] != expected[i] || scalar != expected[i]) {
            if (++mismatches < 10) {
                ADD_FAILURE() << "f32 " << inputs[i] << " -> f16 array " << out[i] << " scalar " << scalar
                              << ", expected " << expected[i];
            }
        }
    }
    EXPECT_EQ(mismatches, 0u);
    // Below half the smallest subnormal: zero; at exactly half: ties to even (zero).
    EXPECT_EQ(f32_to_f16_bits(0x1p-26f), 0u);
    EXPECT_EQ(f32_to_f16_bits(0x1p-25f), 0u);
    EXPECT_EQ(f32_to_f16_bits(-0x1p-25f), 0x8000u);
    EXPECT_EQ(f32_to_f16_bits(1e30f), 0x7c00u);
    EXPECT_EQ(f32_to_f16_bits(INFINITY), 0x7c00u);
    EXPECT_EQ(f32_to_f16_bits(-INFINITY), 0xfc00u);
    EXPECT_TRUE(f16_is_nan(f32_to_f16_bits(NAN)));
    EXPECT_TRUE(f16_is_nan(f32_to_f16_bits(std::bit_cast<float>(0x7f800001u))));
}

TEST(DType, GenericConvertGoesThroughF32AndRoundsOnce) {
    std::vector<float> src = {1.0f, -2.5f, 3.140625f, 65504.0f, 1e-3f};
    std::vector<uint16_t> bf(src.size()), h(src.size()), h_via_bf(src.size());
    convert(src.data(), DType::f32, bf.data(), DType::bf16, src.size());
    convert(src.data(), DType::f32, h.data(), DType::f16, src.size());
    convert(bf.data(), DType::bf16, h_via_bf.data(), DType::f16, src.size());
    for (size_t i = 0; i < src.size(); ++i) {
        EXPECT_EQ(bf[i], f32_to_bf16_bits(src[i]));
        EXPECT_EQ(h[i], f32_to_f16_bits(src[i]));
        EXPECT_EQ(h_via_bf[i], f32_to_f16_bits(bf16_bits_to_f32(bf[i])));
    }
    int32_t ints[2] = {1, 2};
    float   out[2];
    EXPECT_THROW(convert(ints, DType::i32, out, DType::f32, 2), Error);
}

// float64 (the router's --moe-router-dtype fp64): to f32 rounds to nearest even, from f32 or a 16-bit float
// is exact, and to bf16 or f16 is refused (it would round twice).
TEST(DType, Float64ConvertsToF32OnceAndWidensExactly) {
    const double in[] = {1.0 + 0x1p-24, 1.0 + 0x1.8p-24, -3.0 + 0x1p-40, 1e300, 0x1p-149 * 0.75};
    float        out[5];
    convert(in, DType::f64, out, DType::f32, 5);
    EXPECT_EQ(out[0], 1.0f) << "a tie goes to even";
    EXPECT_EQ(out[1], 1.0f + 0x1p-23f) << "above the tie, up";
    EXPECT_EQ(out[2], -3.0f);
    EXPECT_EQ(out[3], INFINITY);
    EXPECT_EQ(out[4], 0x1p-149f);
    const uint16_t bf16_bits[] = {0x3f80, 0xc2f7, 0x7f80};   // 1, -123.5, inf
    double         wide[3];
    convert(bf16_bits, DType::bf16, wide, DType::f64, 3);
    EXPECT_EQ(wide[0], 1.0);
    EXPECT_EQ(wide[1], -123.5);
    EXPECT_EQ(wide[2], INFINITY);
    uint16_t narrow[1];
    EXPECT_THROW(convert(in, DType::f64, narrow, DType::bf16, 1), Error);
}
