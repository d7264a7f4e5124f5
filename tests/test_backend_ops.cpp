// Backend ops, op by op, against a plain double-precision reference on the host (ggml's test-backend-ops
// in spirit). Run it at every dispatch level: `.ci/run` repeats the suite with ONEDNN_MAX_CPU_ISA=AVX2 and
// LOOM_MAX_CPU_ISA=avx2, which takes the widened bf16 GEMM and the AVX2 kernels on any CPU.
//
// Tolerances: f32 GEMMs 1e-5 relative to the sum of |products| (f32 accumulation over k <= 512 terms);
// bf16 GEMMs the same once the operands are rounded to bf16 (products of bf16 values are exact in f32);
// the widened bf16 path is bitwise the f32 GEMM of the widened operands.
#include "backend/cpu/gemm.h"
#include "core/cpu_isa.h"
#include "core/dtype.h"
#include "core/error.h"

#include <gtest/gtest.h>

#include <cmath>
#include <cstring>
#include <random>
#include <vector>

using namespace loom;

namespace {

std::vector<float> random_values(size_t n, uint64_t seed) {
    std::mt19937_64                       rng(seed);
    std::uniform_real_distribution<float> u(-1.0f, 1.0f);
    std::vector<float>                    v(n);
    for (float & x : v) x = u(rng);
    return v;
}

std::vector<uint16_t> to_bf16(const std::vector<float> & v) {
    std::vector<uint16_t> out(v.size());
    convert(v.data(), DType::f32, out.data(), DType::bf16, v.size());
    return out;
}

std::vector<float> from_bf16(const std::vector<uint16_t> & v) {
    std::vector<float> out(v.size());
    convert(v.data(), DType::bf16, out.data(), DType::f32, v.size());
    return out;
}

// C (m, n) [+]= op(A) op(B) in double, with |products| summed for the tolerance.
void reference_gemm(bool ta, bool tb, int64_t m, int64_t n, int64_t k, const std::vector<float> & a,
                    const std::vector<float> & b, std::vector<double> & c, std::vector<double> & magnitude) {
    for (int64_t i = 0; i < m; ++i) {
        for (int64_t j = 0; j < n; ++j) {
            double sum = 0, mag = 0;
            for (int64_t p = 0; p < k; ++p) {
                double x = ta ? a[p * m + i] : a[i * k + p];
                double y = tb ? b[j * k + p] : b[p * n + j];
                sum += x * y;
                mag += std::fabs(x * y);
            }
            c[i * n + j] += sum;
            magnitude[i * n + j] += mag;
        }
    }
}

}  // namespace

TEST(CpuIsa, NamesAndCap) {
    EXPECT_EQ(cpu_isa_from_name("AVX2"), CpuIsa::avx2);
    EXPECT_EQ(cpu_isa_from_name("avx512_core"), CpuIsa::avx512);
    EXPECT_EQ(cpu_isa_from_name("AVX512_CORE_AMX"), CpuIsa::avx512_bf16);
    EXPECT_EQ(cpu_isa_from_name("scalar"), CpuIsa::scalar);
    try {
        cpu_isa_from_name("avx9000");
        FAIL() << "an unknown level was accepted";
    } catch (const Error & e) {
        EXPECT_NE(std::string(e.message()).find("LOOM_MAX_CPU_ISA=avx9000"), std::string::npos) << e.message();
    }
    EXPECT_LE(cpu_isa(), cpu_isa_detected());
    EXPECT_EQ(cpu::gemm_bf16_native(), cpu_isa() >= CpuIsa::avx512);
    std::printf("dispatch: detected %s, in use %s, bf16 GEMM %s\n", cpu_isa_name(cpu_isa_detected()),
                cpu_isa_name(cpu_isa()), cpu::gemm_bf16_native() ? "native (oneDNN bf16)" : "widened to f32");
}

struct GemmCase {
    bool    ta, tb;
    int64_t m, n, k;
    bool    accumulate;
};

class Gemm : public ::testing::TestWithParam<GemmCase> {};

TEST_P(Gemm, BothDtypesAgainstDoubleReference) {
    const GemmCase g = GetParam();
    auto           a = random_values(static_cast<size_t>(g.m * g.k), 1);
    auto           b = random_values(static_cast<size_t>(g.k * g.n), 2);
    auto           c0 = random_values(static_cast<size_t>(g.m * g.n), 3);
    for (DType dtype : {DType::f32, DType::bf16}) {
        std::vector<uint16_t> a16 = to_bf16(a), b16 = to_bf16(b);
        std::vector<float>    av = dtype == DType::f32 ? a : from_bf16(a16);
        std::vector<float>    bv = dtype == DType::f32 ? b : from_bf16(b16);
        std::vector<double>   ref(c0.size(), 0.0), mag(c0.size(), 0.0);
        if (g.accumulate) {
            for (size_t i = 0; i < c0.size(); ++i) { ref[i] = c0[i]; mag[i] = std::fabs(c0[i]); }
        }
        reference_gemm(g.ta, g.tb, g.m, g.n, g.k, av, bv, ref, mag);
        std::vector<float> c = c0;
        const void * ap = dtype == DType::f32 ? static_cast<const void *>(a.data()) : a16.data();
        const void * bp = dtype == DType::f32 ? static_cast<const void *>(b.data()) : b16.data();
        cpu::gemm(g.ta, g.tb, g.m, g.n, g.k, ap, bp, dtype, c.data(), g.accumulate);
        for (size_t i = 0; i < c.size(); ++i) {
            ASSERT_NEAR(c[i], ref[i], 1e-5 * (mag[i] + 1e-30)) << dtype_name(dtype) << " element " << i;
        }
        if (dtype == DType::bf16 && !cpu::gemm_bf16_native()) {
            std::vector<float> wide = c0;   // the widened path is the f32 GEMM of the widened operands
            cpu::gemm(g.ta, g.tb, g.m, g.n, g.k, av.data(), bv.data(), DType::f32, wide.data(), g.accumulate);
            ASSERT_EQ(0, std::memcmp(wide.data(), c.data(), c.size() * sizeof(float)));
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Shapes, Gemm,
                         ::testing::Values(GemmCase{false, true, 32, 192, 64, false},     // a linear's forward
                                           GemmCase{false, false, 32, 64, 192, false},    // its input gradient
                                           GemmCase{true, false, 192, 64, 32, true},      // its weight gradient
                                           GemmCase{false, false, 7, 5, 3, false},
                                           GemmCase{true, true, 33, 17, 129, true},
                                           GemmCase{false, true, 1, 1, 512, false}));
