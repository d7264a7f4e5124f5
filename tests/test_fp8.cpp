// FP8 (core/fp8.h): every code of both formats decoded against the formats' definition, the cast to the
// nearest code (ties to even, saturating) against a brute-force search over all codes, and each scaling
// recipe's rule on hand-worked cases.
#include "core/fp8.h"

#include <gtest/gtest.h>

#include <cmath>
#include <limits>
#include <random>
#include <vector>

using namespace loom;

namespace {

struct Def {   // the formats as their specification tables give them
    Fp8Format format;
    const char * name;
    int          exp_bits, man_bits, bias;
};
const Def kFormats[] = {{Fp8Format::e4m3, "e4m3", 4, 3, 7}, {Fp8Format::e5m2, "e5m2", 5, 2, 15}};

// The value of `code` by its fields (NaN and Inf as the formats reserve them).
double by_definition(uint8_t code, const Def & d) {
    const int  sign = code >> 7, e = (code >> d.man_bits) & ((1 << d.exp_bits) - 1), m = code & ((1 << d.man_bits) - 1);
    const int  emax_field = (1 << d.exp_bits) - 1;
    double     v;
    if (d.format == Fp8Format::e4m3 && e == emax_field && m == (1 << d.man_bits) - 1) return std::nan("");
    if (d.format == Fp8Format::e5m2 && e == emax_field) {
        if (m != 0) return std::nan("");
        v = std::numeric_limits<double>::infinity();
    } else if (e == 0) {
        v = std::ldexp(static_cast<double>(m), 1 - d.bias - d.man_bits);
    } else {
        v = std::ldexp(1.0 + std::ldexp(static_cast<double>(m), -d.man_bits), e - d.bias);
    }
    return sign ? -v : v;
}

// The code a cast should give: the nearest finite code (the even mantissa on a tie), the largest finite at or
// past it, NaN for NaN.
uint8_t nearest_code(float x, const Def & d) {
    const uint8_t sign = std::signbit(x) ? 0x80 : 0x00;
    if (std::isnan(x)) return static_cast<uint8_t>(sign | 0x7F);
    const double ax = std::fabs(static_cast<double>(x));
    uint8_t      best = 0;
    double       best_err = std::numeric_limits<double>::infinity(), largest = 0;
    uint8_t      largest_code = 0;
    for (int c = 0; c < 0x80; ++c) {
        const double v = by_definition(static_cast<uint8_t>(c), d);
        if (std::isnan(v) || std::isinf(v)) continue;
        if (v > largest) {
            largest      = v;
            largest_code = static_cast<uint8_t>(c);
        }
        const double err = std::fabs(v - ax);
        if (err < best_err || (err == best_err && (c & 1) == 0)) {
            best     = static_cast<uint8_t>(c);
            best_err = err;
        }
    }
    if (ax >= largest) best = largest_code;
    return static_cast<uint8_t>(sign | best);
}

}  // namespace

TEST(Fp8, EveryCodeDecodesAsItsFormatDefinesIt) {
    for (const Def & d : kFormats) {
        for (int c = 0; c < 256; ++c) {
            const double want = by_definition(static_cast<uint8_t>(c), d);
            const float  got  = f32_from_fp8(static_cast<uint8_t>(c), d.format);
            if (std::isnan(want)) {
                EXPECT_TRUE(std::isnan(got)) << d.name << " code " << c;
                EXPECT_TRUE(fp8_is_nan(static_cast<uint8_t>(c), d.format)) << d.name << " code " << c;
            } else {
                EXPECT_EQ(static_cast<double>(got), want) << d.name << " code " << c;
                EXPECT_EQ(std::signbit(got), c >= 0x80) << d.name << " code " << c;
            }
        }
    }
    EXPECT_EQ(f32_from_fp8(0x7E, Fp8Format::e4m3), 448.0f);
    EXPECT_EQ(f32_from_fp8(0x01, Fp8Format::e4m3), std::ldexp(1.0f, -9));
    EXPECT_EQ(f32_from_fp8(0x08, Fp8Format::e4m3), std::ldexp(1.0f, -6));
    EXPECT_EQ(f32_from_fp8(0x7B, Fp8Format::e5m2), 57344.0f);
    EXPECT_EQ(f32_from_fp8(0x01, Fp8Format::e5m2), std::ldexp(1.0f, -16));
    EXPECT_TRUE(std::isinf(f32_from_fp8(0x7C, Fp8Format::e5m2)));
    EXPECT_EQ(fp8_spec(Fp8Format::e4m3).max_value, f32_from_fp8(fp8_spec(Fp8Format::e4m3).max_code, Fp8Format::e4m3));
    EXPECT_EQ(fp8_spec(Fp8Format::e5m2).max_value, f32_from_fp8(fp8_spec(Fp8Format::e5m2).max_code, Fp8Format::e5m2));
}

// Every finite code round-trips; the midpoint between two neighbours goes to the even one and a hair off it
// to the nearer; values across the whole range (log-uniform), past it, Inf, NaN and both zeros: each cast
// equals the brute-force nearest code.
TEST(Fp8, CastsToTheNearestCodeTiesToEvenAndSaturates) {
    std::mt19937 rng(11);
    for (const Def & d : kFormats) {
        SCOPED_TRACE(d.name);
        std::vector<float> xs = {0.0f, -0.0f, std::numeric_limits<float>::infinity(), -std::numeric_limits<float>::infinity(),
                                 std::nanf(""), 1e30f, -1e30f, std::numeric_limits<float>::denorm_min(), 1e-30f};
        std::vector<double> finite;
        for (int c = 0; c < 0x80; ++c) {
            const double v = by_definition(static_cast<uint8_t>(c), d);
            if (std::isfinite(v)) finite.push_back(v);
        }
        for (size_t i = 0; i < finite.size(); ++i) {
            xs.push_back(static_cast<float>(finite[i]));
            EXPECT_EQ(fp8_from_f32(static_cast<float>(finite[i]), d.format), nearest_code(static_cast<float>(finite[i]), d));
            if (i + 1 == finite.size()) continue;
            const float mid = static_cast<float>((finite[i] + finite[i + 1]) / 2);   // exact in f32
            for (const float x : {mid, std::nextafter(mid, 0.0f), std::nextafter(mid, 1e9f)}) {
                xs.push_back(x);
                xs.push_back(-x);
            }
        }
        const float top = fp8_spec(d.format).max_value;
        for (const float x : {top, std::nextafter(top, 1e9f), top * 1.0625f, top * 1.2f, top * 4.0f}) xs.push_back(x);
        std::uniform_real_distribution<double> exponent(-22.0, 18.0);
        for (int i = 0; i < 200000; ++i) {
            const float x = static_cast<float>(std::exp2(exponent(rng)));
            xs.push_back(i % 2 ? -x : x);
        }
        int wrong = 0;
        for (const float x : xs) {
            const uint8_t got = fp8_from_f32(x, d.format), want = nearest_code(x, d);
            if (got != want && ++wrong <= 5) ADD_FAILURE() << "x = " << x << ": code " << int(got) << ", want " << int(want);
        }
        EXPECT_EQ(wrong, 0) << "of " << xs.size() << " values";
        EXPECT_EQ(fp8_from_f32(-0.0f, d.format), 0x80) << "-0 keeps its sign";
        EXPECT_EQ(fp8_from_f32(std::numeric_limits<float>::infinity(), d.format), fp8_spec(d.format).max_code)
            << "Inf saturates";
    }
}

// The recipes' scales, worked by hand.
TEST(Fp8, ScalingRecipesFollowTheirRules) {
    // Tensorwise: x = (1, -3.5, 0.3, 2): amax 3.5, s = 448 / 3.5 = 128; x s = (128, -448, 38.4, 256) in e4m3:
    // 38.4 lies between 36 and 40 (the binade [32, 64) steps by 4) and rounds to 40; dequantized
    // (1, -3.5, 0.3125, 2).
    const float s = fp8_scale_from_amax(3.5f, Fp8Format::e4m3);
    EXPECT_EQ(s, 128.0f);
    const float x[] = {1.0f, -3.5f, 0.3f, 2.0f}, want[] = {1.0f, -3.5f, 0.3125f, 2.0f};
    for (int i = 0; i < 4; ++i) EXPECT_EQ(fp8_round(x[i] * s, Fp8Format::e4m3) / s, want[i]) << i;
    EXPECT_EQ(fp8_scale_from_amax(2.0f, Fp8Format::e4m3), 224.0f);
    EXPECT_EQ(fp8_scale_from_amax(2.0f, Fp8Format::e4m3, true), 128.0f) << "a power of two at or below 224";
    EXPECT_EQ(fp8_scale_from_amax(0.0f, Fp8Format::e4m3), 1.0f);
    EXPECT_EQ(fp8_scale_from_amax(57344.0f, Fp8Format::e5m2), 1.0f);
    EXPECT_EQ(fp8_scale_from_amax(1e-45f, Fp8Format::e4m3), std::numeric_limits<float>::max()) << "an infinite s";
    // Delayed: the history (newest first) 1, 4, 2 with margin 1: algo max takes 4, s = 448 / 4 / 2 = 56;
    // most_recent takes 1, s = 224; an amax of 0 or Inf keeps the previous s.
    EXPECT_EQ(fp8_delayed_scale(4.0f, 9.0f, Fp8Format::e4m3, 1), 56.0f);
    EXPECT_EQ(fp8_delayed_scale(1.0f, 9.0f, Fp8Format::e4m3, 1), 224.0f);
    EXPECT_EQ(fp8_delayed_scale(0.0f, 9.0f, Fp8Format::e4m3, 1), 9.0f);
    EXPECT_EQ(fp8_delayed_scale(std::numeric_limits<float>::infinity(), 9.0f, Fp8Format::e4m3, 0), 9.0f);
    // MXFP8 (Transformer Engine's rule): amax / 448 rounded up to a power of two. 3.5 / 448 = 2^-7 exactly: code
    // 120, the block's largest lands on 448. 1000 / 448 = 2.23: up to 2^2 (code 129), 1000 / 4 = 250 -> 256 in
    // e4m3 (steps of 16 in [128, 256)), no saturation. In e5m2, 3.5 / 57344 = 2^-14 (code 113).
    // amax 0: code 0; NaN: 255 (a NaN scale). Just above a power of two, 448 x (1 + 2^-20) rounds up to 2^1.
    EXPECT_EQ(mxfp8_scale_code(3.5f, Fp8Format::e4m3), 120u);
    EXPECT_EQ(mxfp8_block_scale(3.5f, Fp8Format::e4m3), 128.0f);
    EXPECT_EQ(fp8_round(3.5f * 128.0f, Fp8Format::e4m3), 448.0f);
    EXPECT_EQ(mxfp8_scale_code(1000.0f, Fp8Format::e4m3), 129u);
    EXPECT_EQ(fp8_round(1000.0f * mxfp8_block_scale(1000.0f, Fp8Format::e4m3), Fp8Format::e4m3), 256.0f);
    EXPECT_EQ(mxfp8_scale_code(3.5f, Fp8Format::e5m2), 113u);
    EXPECT_EQ(mxfp8_scale_code(0.0f, Fp8Format::e4m3), 0u);
    EXPECT_TRUE(std::isnan(mxfp8_block_scale(std::numeric_limits<float>::quiet_NaN(), Fp8Format::e4m3)));
    EXPECT_EQ(mxfp8_scale_code(448.0f * (1.0f + std::ldexp(1.0f, -20)), Fp8Format::e4m3), 128u);
}
