// Backend ops, op by op, against a plain double-precision reference on the host (ggml's test-backend-ops
// in spirit). Every op of core/ops.h is called through the interface, cpu::device().ops(), on the compute
// stream, and read back after stream.synchronize(); the references are the straightforward loops below, in
// double, never the backend's kernels. Run it at every dispatch level: `.ci/run` (and `make test-avx2`)
// repeats the suite with ONEDNN_MAX_CPU_ISA=AVX2 and LOOM_MAX_CPU_ISA=avx2, which takes the widened bf16
// GEMM and the AVX2 kernels on any CPU.
//
// Tolerances, per op family. "rel(f)" is |got - ref| / max(|ref|, f); "mag" is |got - ref| over the sum of
// the magnitudes of the terms the result adds up (the scale of a reduction's rounding error); "max" is
// |got - ref| over the largest |ref| of the tensor; "exact" compares bits (or values, where the op is one
// correctly rounded f32 operation that the reference computes exactly in double and rounds once).
//   gemm (cpu::gemm and Ops::gemm)  1e-5 mag: f32 accumulation over k <= 512 terms; bf16 the same once the
//                                   operands are read as bf16 values (products of bf16 values are exact in
//                                   f32), f16 likewise; the widened bf16 path (f16's only CPU path) is bitwise
//                                   the f32 GEMM of the widened operands.
//   layernorm / rmsnorm forward     y 1e-5 rel(1), mean 1e-5 rel(1), rstd 1e-5 rel; x += residual 2^-23 rel(0).
//   layernorm / rmsnorm backward    dx 1e-5 rel(1); dgamma, dbeta 1e-5 mag (added into their old values).
//   bias_add, add_inplace           2^-23 rel(0): one f32 addition.   bias_backward 1e-6 mag; it and
//                                   dbeta also exact against core/column_sums.h's order computed in f32.
//   gemm_bias                       exact: the bits of gemm followed by bias_add.
//   bias_gelu_forward               y 2e-6 rel(1) (tanh through exp_approx, |error| < 2e-7 absolute);
//                                   x += bias 2^-23 rel(0); x_bf16 exact (the nearest bf16, ties to even).
//   gelu_backward                   1e-5 rel(1) on x in [-5, 5] (tanh's error times up to |x| du ~ 17).
//   swiglu forward / backward       2e-6 rel(1) (sigmoid through exp_approx).
//   glu forward / backward          2e-6 rel(1), as swiglu; the clamps' edges exact (0 past them).
//   rope                            1e-5 rel(1) against the double rotation (f32 angles up to 40 rad);
//                                   inverse(forward(x)) = x within 1e-5 rel(1); other columns untouched.
//   embedding_forward               2^-23 rel(0) (a lookup plus at most one f32 addition);
//   embedding_backward              1e-6 mag;  vocab_shard_ids exact.
//   attention forward               out 1e-5 max, lse 1e-5 rel(1).
//   attention backward              dq, dk, dv 1e-5 max against the analytic gradient of the double
//                                   reference (itself checked against central finite differences of the
//                                   double reference forward, 1e-6 rel(1e-3)).
//   cross_entropy forward           loss, lse 1e-5 rel(1); backward 1e-5 rel(1e-3), padding exactly 0.
//   row_max, label_logit, loss_grad exact;  row_sum_exp 1e-6 rel;  lse_and_loss 1e-6 rel(1).
//   convert, round_to_bf16          exact: the nearest value of the destination format (ties to even,
//                                   +-inf beyond its range), computed here with std::nearbyint.
//   copy, fill_zero, scale          exact (scale: one f32 multiplication, exact in double).
//   sum_of_squares                  hi + lo within 1e-12 rel of the double sum, hi within 2^-23 of it, and
//                                   the same bits at 1 and 2 threads (child processes, LOOM_NUM_THREADS).
//   adamw (5 steps)                 p: |p - p_ref| <= k (2^-21 |p_ref| + 2^-20 lr) after k steps (host_adam.h's
//                                   bound); m 1e-6 mag, v 1e-6 rel; out: bf16 = the nearest bf16 of p, f32 = p
//                                   bitwise; master the same bits with bf16, f32 and no out.
//   bf16 activations                exact: each op on bf16 tensors gives the nearest bf16 of what it gives in
//                                   f32 from the same values; its f32 outputs (statistics, losses, parameter
//                                   gradients) the same bits.
//   argument errors                 a wrong shape or dtype throws loom::Error on the calling thread and
//                                   enqueues nothing (the stream then synchronizes cleanly).
//   ids past the table              a token or label id >= the vocabulary is a loom::Error at the stream's
//                                   next synchronize, before the kernel reads or writes a row.
// LOOM_TEST_PRINT_ERRORS=1 prints every comparison's worst error next to its tolerance.
#include "backend/cpu/cpu_device.h"
#include "backend/cpu/gemm.h"
#include "core/column_sums.h"
#include "core/cpu_isa.h"
#include "core/device.h"
#include "core/dropout.h"
#include "core/dtype.h"
#include "core/error.h"
#include "core/ops.h"
#include "core/tensor.h"
#include "core/thread_pool.h"

#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <bit>
#include <cinttypes>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <iterator>
#include <limits>
#include <random>
#include <string>
#include <vector>

using namespace loom;

namespace {

// ---- Tolerances (see the table above)
constexpr double kGemmTol         = 1e-5;
constexpr double kF32Add          = 0x1p-23;   // one f32 rounding (<= 2^-24 relative) of an exact result, x2
constexpr double kNormTol         = 1e-5;
constexpr double kReduceTol       = 1e-6;   // f32 sums over rows, relative to the sum of |terms|
constexpr double kActivationTol   = 2e-6;
constexpr double kGeluGradTol     = 1e-5;   // tanh's error times up to |x| du(x) ~ 17 at |x| = 5
constexpr double kRopeTol         = 1e-5;
constexpr double kAttentionTol    = 1e-5;
constexpr double kAttentionBwTol  = 1e-5;
constexpr double kCrossEntropyTol = 1e-5;
constexpr double kSumOfSquaresTol = 1e-12;

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

// ---- The device, its ops and its compute stream

Device & dev() { return cpu::device(); }
Ops &    ops() { return dev().ops(); }
Stream & stream() { return dev().compute_stream(); }
void     synchronize() { stream().synchronize(); }

Tensor empty(const Shape & shape, DType dtype = DType::f32) { return Tensor::empty(shape, dtype, dev()); }

// A fixed, portable generator (splitmix64): the same values with any standard library.
struct Rng {
    uint64_t state;
    explicit Rng(uint64_t seed) : state(seed * 0x9e3779b97f4a7c15ull + 0x632be59bd9b4e019ull) {}
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z          = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z          = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    double  unit() { return static_cast<double>(next() >> 11) * 0x1p-53; }   // [0, 1)
    float   uniform(float lo, float hi) { return static_cast<float>(lo + (hi - lo) * unit()); }
    int32_t below(int64_t n) { return static_cast<int32_t>(next() % static_cast<uint64_t>(n)); }
};

// f32 tensor of values uniform in [lo, hi).
Tensor random_f32(const Shape & shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    Tensor  t = empty(shape);
    Rng     rng(seed);
    float * p = t.data<float>();
    for (int64_t i = 0; i < t.numel(); ++i) p[i] = rng.uniform(lo, hi);
    return t;
}

// The same values in `dtype` (f32, bf16 or f16: rounded there; the references read them back).
Tensor random_tensor(const Shape & shape, DType dtype, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    Tensor f = random_f32(shape, seed, lo, hi);
    if (dtype == DType::f32) return f;
    Tensor t = empty(shape, dtype);
    convert(f.data_ptr(), DType::f32, t.data_ptr(), dtype, static_cast<size_t>(f.numel()));
    return t;
}

Tensor int_tensor(const Shape & shape, const std::vector<int32_t> & values) {
    Tensor t = empty(shape, DType::i32);
    EXPECT_EQ(static_cast<size_t>(t.numel()), values.size());
    std::copy(values.begin(), values.end(), t.data<int32_t>());
    return t;
}

Tensor clone(const Tensor & t) {
    Tensor c = Tensor::empty(t.shape(), t.dtype(), dev());
    c.copy_from(t);
    return c;
}

// ---- Decoding 16-bit floats, and rounding to them, written here (not the library's conversions)

double bf16_value(uint16_t bits) { return std::bit_cast<float>(static_cast<uint32_t>(bits) << 16); }

double f16_value(uint16_t bits) {
    const int e = (bits >> 10) & 31, m = bits & 1023;
    double    v = e == 0    ? std::ldexp(m, -24)
                  : e == 31 ? (m ? std::numeric_limits<double>::quiet_NaN() : std::numeric_limits<double>::infinity())
                            : std::ldexp(1024 + m, e - 25);
    return (bits & 0x8000) ? -v : v;
}

// The nearest value of a binary format with `digits` significand bits and smallest normal exponent emin to
// x, ties to even (std::nearbyint in the default rounding mode); +-inf beyond the largest finite value.
double round_to_format(double x, int digits, int emin, double max_finite) {
    if (std::isnan(x) || std::isinf(x) || x == 0) return x;
    const double quantum = std::ldexp(1.0, std::max(std::ilogb(x), emin) - (digits - 1));
    const double r       = std::nearbyint(x / quantum) * quantum;
    return std::fabs(r) > max_finite ? std::copysign(std::numeric_limits<double>::infinity(), x) : r;
}
double round_bf16(double x) { return round_to_format(x, 8, -126, 0x1.fep127); }
double round_f16(double x) { return round_to_format(x, 11, -14, 65504.0); }

// Element i of a floating tensor as a double (exact).
double element(const Tensor & t, int64_t i) {
    switch (t.dtype()) {
        case DType::f32: return t.data<float>()[i];
        case DType::bf16: return bf16_value(static_cast<const uint16_t *>(t.data_ptr())[i]);
        case DType::f16: return f16_value(static_cast<const uint16_t *>(t.data_ptr())[i]);
        default: ADD_FAILURE() << "not a floating tensor: " << t.describe(); return 0;
    }
}

std::vector<double> values(const Tensor & t) {
    std::vector<double> v(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = element(t, i);
    return v;
}

std::vector<float> floats(const Tensor & t) {
    std::vector<float> v(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) v[static_cast<size_t>(i)] = static_cast<float>(element(t, i));
    return v;
}

// ---- Comparisons

bool print_errors() {
    static const bool on = [] {
        const char * v = std::getenv("LOOM_TEST_PRINT_ERRORS");
        return v && *v && std::strcmp(v, "0") != 0;
    }();
    return on;
}

// Passes when max_i |got[i] - ref[i]| / denominator(i) <= tol; names the worst element otherwise.
template <typename Denominator>
::testing::AssertionResult within(const std::string & what, const float * got, const std::vector<double> & ref,
                                  double tol, Denominator && denominator) {
    double worst = 0;
    size_t at    = 0;
    for (size_t i = 0; i < ref.size(); ++i) {
        const double e = std::fabs(static_cast<double>(got[i]) - ref[i]) / denominator(i);
        if (std::isnan(e) || e > worst) {
            worst = e;
            at    = i;
            if (std::isnan(e)) break;
        }
    }
    if (print_errors()) std::printf("    %-48s worst %.3g, tolerance %.3g\n", what.c_str(), worst, tol);
    if (worst <= tol) return ::testing::AssertionSuccess();
    return ::testing::AssertionFailure() << what << ": error " << worst << " > " << tol << " at element " << at
                                         << " of " << ref.size() << " (got " << got[at] << ", expected " << ref[at]
                                         << ")";
}

// rel(floor): relative to max(|ref|, floor).
::testing::AssertionResult close(const std::string & what, const float * got, const std::vector<double> & ref,
                                 double tol, double floor) {
    return within(what, got, ref, tol, [&](size_t i) { return std::max({std::fabs(ref[i]), floor, 1e-300}); });
}
::testing::AssertionResult close(const std::string & what, const Tensor & got, const std::vector<double> & ref,
                                 double tol, double floor) {
    if (got.numel() != static_cast<int64_t>(ref.size())) return ::testing::AssertionFailure() << what << ": size";
    return close(what, got.data<float>(), ref, tol, floor);
}
// mag: relative to the sum of the magnitudes of the terms.
::testing::AssertionResult close_to_magnitude(const std::string & what, const Tensor & got,
                                              const std::vector<double> & ref, const std::vector<double> & mag,
                                              double tol) {
    if (got.numel() != static_cast<int64_t>(ref.size())) return ::testing::AssertionFailure() << what << ": size";
    return within(what, got.data<float>(), ref, tol, [&](size_t i) { return std::max(mag[i], 1e-30); });
}
// max: relative to the largest |ref| of the tensor.
::testing::AssertionResult close_to_max(const std::string & what, const float * got, const std::vector<double> & ref,
                                        double tol) {
    double largest = 1e-30;
    for (double r : ref) largest = std::max(largest, std::fabs(r));
    return within(what, got, ref, tol, [&](size_t) { return largest; });
}

::testing::AssertionResult same_bits(const std::string & what, const void * got, const void * ref, size_t bytes) {
    const auto * g = static_cast<const unsigned char *>(got);
    const auto * r = static_cast<const unsigned char *>(ref);
    for (size_t i = 0; i < bytes; ++i) {
        if (g[i] != r[i])
            return ::testing::AssertionFailure() << what << ": byte " << i << " of " << bytes << " differs";
    }
    return ::testing::AssertionSuccess();
}

// The values `ref`, each rounded to f32 once, are the tensor's values, bit for bit.
::testing::AssertionResult exact(const std::string & what, const Tensor & got, const std::vector<double> & ref) {
    if (got.numel() != static_cast<int64_t>(ref.size())) return ::testing::AssertionFailure() << what << ": size";
    for (size_t i = 0; i < ref.size(); ++i) {
        const float g = got.data<float>()[i], r = static_cast<float>(ref[i]);
        if (std::bit_cast<uint32_t>(g) != std::bit_cast<uint32_t>(r)) {
            return ::testing::AssertionFailure() << what << ": element " << i << " is " << g << ", expected " << r;
        }
    }
    return ::testing::AssertionSuccess();
}

std::string name(const char * base, int variant) { return std::string(base) + " #" + std::to_string(variant); }

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

// A case's random operands a and b, stored as its transposes ask.
std::pair<Tensor, Tensor> gemm_operands(const GemmCase & g, DType dtype, uint64_t seed_a, uint64_t seed_b) {
    return {random_tensor(g.ta ? Shape{g.k, g.m} : Shape{g.m, g.k}, dtype, seed_a),
            random_tensor(g.tb ? Shape{g.n, g.k} : Shape{g.k, g.n}, dtype, seed_b)};
}

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
            ASSERT_NEAR(c[i], ref[i], kGemmTol * (mag[i] + 1e-30)) << dtype_name(dtype) << " element " << i;
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

// ---------------------------------------------------------------------------------------------------
// GEMM through the interface

TEST(OpsGemm, InterfaceF32Bf16AndF16WithAndWithoutAccumulate) {
    const GemmCase cases[] = {{false, true, 37, 48, 40, false},
                              {false, true, 37, 48, 40, true},
                              {true, false, 24, 16, 33, true},
                              {false, false, 7, 5, 3, true},
                              {true, true, 9, 65, 17, true}};
    int            variant = 0;
    for (const GemmCase & g : cases) {
        for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " case " + std::to_string(variant));
            const auto [a, b]     = gemm_operands(g, dtype, 100 + variant, 200 + variant);
            Tensor              c = random_f32({g.m, g.n}, 300 + variant);
            std::vector<double> ref(static_cast<size_t>(g.m * g.n), 0.0), mag(ref.size(), 0.0);
            if (g.accumulate) {
                ref = values(c);
                for (size_t i = 0; i < ref.size(); ++i) mag[i] = std::fabs(ref[i]);
            }
            reference_gemm(g.ta, g.tb, g.m, g.n, g.k, floats(a), floats(b), ref, mag);
            ops().gemm(stream(), a, g.ta, b, g.tb, c, g.accumulate);
            synchronize();
            EXPECT_TRUE(close_to_magnitude(name("gemm", variant), c, ref, mag, kGemmTol));
            ++variant;
        }
    }
}

// gemm_bias is gemm followed by bias_add, bit for bit: f32 and bf16 operands, b transposed or not (the
// linear layer's forward is (false, true)), sizes off multiples of 16, and k = 0 (c is the bias).
TEST(OpsGemm, GemmBiasIsGemmThenBiasAddBitwise) {
    const GemmCase cases[] = {{false, true, 37, 48, 40, false}, {false, false, 37, 48, 40, false},
                              {false, true, 5, 17, 33, false},  {false, false, 33, 7, 129, false},
                              {true, true, 9, 65, 17, false},   {false, true, 1, 1, 1, false},
                              {false, true, 6, 3, 0, false}};
    int            variant = 0;
    for (const GemmCase & g : cases) {
        for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " case " + std::to_string(variant));
            const auto [a, b] = gemm_operands(g, dtype, 110 + variant, 210 + variant);
            Tensor     bias   = random_f32({g.n}, 310 + variant);
            Tensor fused = random_f32({g.m, g.n}, 410 + variant), twin = random_f32({g.m, g.n}, 510 + variant);
            ops().gemm_bias(stream(), a, g.ta, b, g.tb, fused, bias);
            ops().gemm(stream(), a, g.ta, b, g.tb, twin);
            ops().bias_add(stream(), twin, bias);
            synchronize();
            EXPECT_TRUE(same_bits(name("gemm_bias", variant), fused.data_ptr(), twin.data_ptr(), twin.nbytes()));
            ++variant;
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// Norms

namespace {

constexpr int64_t kRows = 37, kHidden = 160;   // rows over several chunks of 16, columns over 2 of 64

// LayerNorm (beta may be empty) or, with `rms`, RMSNorm of the rows of x, in double.
void norm_reference(bool rms, const std::vector<double> & x, const std::vector<double> & gamma,
                    const std::vector<double> & beta, int64_t n, int64_t h, double eps, std::vector<double> & y,
                    std::vector<double> & mean, std::vector<double> & rstd) {
    y.assign(static_cast<size_t>(n * h), 0.0);
    mean.assign(static_cast<size_t>(n), 0.0);
    rstd.assign(static_cast<size_t>(n), 0.0);
    for (int64_t r = 0; r < n; ++r) {
        const double * xr = &x[r * h];
        double         mu = 0, ss = 0;
        if (!rms) {
            for (int64_t j = 0; j < h; ++j) mu += xr[j];
            mu /= h;
        }
        for (int64_t j = 0; j < h; ++j) ss += (xr[j] - mu) * (xr[j] - mu);
        const double rs = 1.0 / std::sqrt(ss / h + eps);
        for (int64_t j = 0; j < h; ++j) {
            y[r * h + j] = (xr[j] - mu) * rs * gamma[j] + (beta.empty() ? 0.0 : beta[j]);
        }
        mean[r] = mu;
        rstd[r] = rs;
    }
}

// The backward of norm_reference: dx, and dgamma, dbeta added to (with the magnitudes of what they add).
void norm_backward_reference(bool rms, const std::vector<double> & dy, const std::vector<double> & x,
                             const std::vector<double> & gamma, int64_t n, int64_t h, double eps,
                             std::vector<double> & dx, std::vector<double> & dgamma, std::vector<double> & dgamma_mag,
                             std::vector<double> & dbeta, std::vector<double> & dbeta_mag) {
    std::vector<double> y, mean, rstd;
    norm_reference(rms, x, gamma, {}, n, h, eps, y, mean, rstd);
    dx.assign(static_cast<size_t>(n * h), 0.0);
    for (int64_t r = 0; r < n; ++r) {
        double sum_g = 0, sum_gx = 0;
        for (int64_t j = 0; j < h; ++j) {
            const double g = dy[r * h + j] * gamma[j], xhat = (x[r * h + j] - mean[r]) * rstd[r];
            sum_g += g;
            sum_gx += g * xhat;
        }
        for (int64_t j = 0; j < h; ++j) {
            const double g = dy[r * h + j] * gamma[j], xhat = (x[r * h + j] - mean[r]) * rstd[r];
            dx[r * h + j] = rstd[r] * (g - (rms ? 0.0 : sum_g / h) - xhat * sum_gx / h);
            dgamma[j] += dy[r * h + j] * xhat;
            dgamma_mag[j] += std::fabs(dy[r * h + j] * xhat);
            dbeta[j] += dy[r * h + j];
            dbeta_mag[j] += std::fabs(dy[r * h + j]);
        }
    }
}

std::vector<double> plus(const std::vector<double> & a, const std::vector<double> & b) {
    std::vector<double> c(a.size());
    for (size_t i = 0; i < a.size(); ++i) c[i] = a[i] + b[i];
    return c;
}

std::vector<double> magnitudes(const std::vector<double> & a) {
    std::vector<double> m(a.size());
    for (size_t i = 0; i < a.size(); ++i) m[i] = std::fabs(a[i]);
    return m;
}

}  // namespace

TEST(OpsNorm, LayerNormAndRmsNormForwardBackwardWithAndWithoutResidualAndBeta) {
    const int64_t n = kRows, h = kHidden;
    const float   eps     = 1e-5f;
    int           variant = 0;
    for (bool rms : {false, true}) {
        for (bool with_residual : {false, true}) {
            for (bool with_beta : {false, true}) {
                if (rms && with_beta) continue;   // RMSNorm has no beta
                SCOPED_TRACE(std::string(rms ? "rmsnorm" : "layernorm") + (with_residual ? " +residual" : "") +
                             (with_beta ? " +beta" : ""));
                const uint64_t seed = 1000 + 10 * variant;
                // A mean well away from zero, so that LayerNorm's centring cancels.
                Tensor x        = random_f32({n, h}, seed, -0.5f, 1.5f);
                Tensor x0       = clone(x);
                Tensor residual = with_residual ? random_f32({n, h}, seed + 1) : Tensor();
                Tensor gamma    = random_f32({h}, seed + 2, 0.5f, 1.5f);
                Tensor beta     = with_beta ? random_f32({h}, seed + 3) : Tensor();
                Tensor y = empty({n, h}), mean = empty({n}), rstd = empty({n});
                if (rms) {
                    ops().rmsnorm_forward(stream(), x, residual, gamma, y, rstd, eps);
                } else {
                    ops().layernorm_forward(stream(), x, residual, gamma, beta, y, mean, rstd, eps);
                }
                synchronize();
                std::vector<double> xin = with_residual ? plus(values(x0), values(residual)) : values(x0);
                if (with_residual) {
                    EXPECT_TRUE(close(name("x += residual", variant), x, xin, kF32Add, 0.0));
                } else {
                    EXPECT_TRUE(same_bits("x unchanged", x.data_ptr(), x0.data_ptr(), x.nbytes()));
                }
                std::vector<double> ref_y, ref_mean, ref_rstd;
                norm_reference(rms, xin, values(gamma), with_beta ? values(beta) : std::vector<double>{}, n, h, eps,
                               ref_y, ref_mean, ref_rstd);
                EXPECT_TRUE(close(name("norm y", variant), y, ref_y, kNormTol, 1.0));
                EXPECT_TRUE(close(name("norm rstd", variant), rstd, ref_rstd, kNormTol, 0.0));
                if (!rms) { EXPECT_TRUE(close(name("norm mean", variant), mean, ref_mean, kNormTol, 1.0)); }

                // Backward from the forward's saved x (the sum, with a residual) and statistics; the
                // parameter gradients add into what they held.
                Tensor              dy = random_f32({n, h}, seed + 4), dx = empty({n, h});
                Tensor              dgamma = random_f32({h}, seed + 5), dbeta = random_f32({h}, seed + 6);
                std::vector<double> ref_dx, ref_dgamma = values(dgamma), ref_dbeta = values(dbeta);
                std::vector<double> dgamma_mag = magnitudes(ref_dgamma), dbeta_mag = magnitudes(ref_dbeta);
                norm_backward_reference(rms, values(dy), values(x), values(gamma), n, h, eps, ref_dx, ref_dgamma,
                                        dgamma_mag, ref_dbeta, dbeta_mag);
                Tensor dbeta0 = clone(dbeta);
                if (rms) {
                    ops().rmsnorm_backward(stream(), dy, x, gamma, rstd, dx, dgamma);
                } else {
                    ops().layernorm_backward(stream(), dy, x, gamma, mean, rstd, dx, dgamma, dbeta);
                }
                synchronize();
                EXPECT_TRUE(close(name("norm dx", variant), dx, ref_dx, kNormTol, 1.0));
                EXPECT_TRUE(close_to_magnitude(name("norm dgamma", variant), dgamma, ref_dgamma, dgamma_mag, kNormTol));
                if (rms) {
                    EXPECT_TRUE(same_bits("rmsnorm leaves dbeta", dbeta.data_ptr(), dbeta0.data_ptr(), dbeta.nbytes()));
                } else {
                    EXPECT_TRUE(close_to_magnitude(name("norm dbeta", variant), dbeta, ref_dbeta, dbeta_mag, kNormTol));
                }
                ++variant;
            }
        }
    }
}

// core/column_sums.h's order, bit for bit: bias_backward and layernorm's dbeta (both add dy alone) over 165
// rows (chunks of 64, 64 and 37) and 300 columns (more than one partial-sum width of the CPU's, split over
// threads), against that order computed here in f32: chunk 0 into the accumulator, each later chunk summed
// from zero and then added.
TEST(OpsReductions, ColumnSumsAddInTheDocumentedChunkOrderBitwise) {
    const int64_t n = 2 * kColumnSumRows + 37, h = 300;
    Tensor        dy = random_f32({n, h}, 2101), dbias = random_f32({h}, 2102), x = random_f32({n, h}, 2103);
    std::vector<float> want(h);
    for (int64_t j = 0; j < h; ++j) {
        float acc = dbias.data<float>()[j];
        for (int64_t c0 = 0; c0 < n; c0 += kColumnSumRows) {
            float part = c0 == 0 ? acc : 0.0f;
            for (int64_t r = c0; r < std::min(n, c0 + kColumnSumRows); ++r) part += dy.data<float>()[r * h + j];
            acc = c0 == 0 ? part : acc + part;
        }
        want[j] = acc;
    }
    Tensor dbeta = clone(dbias), gamma = random_f32({h}, 2104), dgamma = random_f32({h}, 2105);
    ops().bias_backward(stream(), dy, dbias);
    Tensor mean = empty({n}), rstd = empty({n});
    ops().layernorm_forward(stream(), x, Tensor(), gamma, Tensor(), empty({n, h}), mean, rstd, 1e-5f);
    ops().layernorm_backward(stream(), dy, x, gamma, mean, rstd, empty({n, h}), dgamma, dbeta);
    synchronize();
    EXPECT_TRUE(same_bits("bias_backward", dbias.data_ptr(), want.data(), want.size() * sizeof(float)));
    EXPECT_TRUE(same_bits("layernorm dbeta", dbeta.data_ptr(), want.data(), want.size() * sizeof(float)));
}

// ---------------------------------------------------------------------------------------------------
// Elementwise

TEST(OpsElementwise, BiasAddBiasBackwardAddInplace) {
    const int64_t       n = kRows, h = kHidden;
    Tensor              y = random_f32({n, h}, 2001), bias = random_f32({h}, 2002);
    std::vector<double> ref = values(y), b = values(bias);
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < h; ++j) ref[r * h + j] += b[j];
    }
    ops().bias_add(stream(), y, bias);
    synchronize();
    EXPECT_TRUE(close("bias_add", y, ref, kF32Add, 0.0));

    Tensor              dy = random_f32({n, h}, 2003), dbias = random_f32({h}, 2004);
    std::vector<double> ref_db = values(dbias), mag = magnitudes(ref_db), d = values(dy);
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < h; ++j) {
            ref_db[j] += d[r * h + j];
            mag[j] += std::fabs(d[r * h + j]);
        }
    }
    ops().bias_backward(stream(), dy, dbias);   // adds into dbias
    synchronize();
    EXPECT_TRUE(close_to_magnitude("bias_backward", dbias, ref_db, mag, kReduceTol));

    // add_inplace over a flat size that spans several chunks of 4096 and ends in a tail.
    Tensor              a = random_f32({3, 4099}, 2005), x = random_f32({3 * 4099}, 2006);
    std::vector<double> ref_a = plus(values(a), values(x));
    ops().add_inplace(stream(), a, x);
    synchronize();
    EXPECT_TRUE(close("add_inplace", a, ref_a, kF32Add, 0.0));
}

namespace {

constexpr double kSqrt2OverPi = 0.79788456080286535588;   // sqrt(2 / pi)

double gelu_ref(double x) { return 0.5 * x * (1.0 + std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x))); }

double gelu_grad_ref(double x) {
    const double t = std::tanh(kSqrt2OverPi * (x + 0.044715 * x * x * x));
    return 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3.0 * 0.044715 * x * x);
}

double sigmoid_ref(double x) { return 1.0 / (1.0 + std::exp(-x)); }

}  // namespace

TEST(OpsElementwise, BiasGeluForwardWithAndWithoutBiasAndBf16Copy) {
    const int64_t n = kRows, f = 96;
    int           variant = 0;
    for (bool with_bias : {true, false}) {
        for (bool with_bf16 : {false, true}) {
            SCOPED_TRACE(std::string(with_bias ? "bias" : "no bias") + (with_bf16 ? ", x_bf16" : ""));
            Tensor x      = random_f32({n, f}, 3000 + 10 * variant, -4.0f, 4.0f);
            Tensor x0     = clone(x);
            Tensor bias   = with_bias ? random_f32({f}, 3001 + 10 * variant) : Tensor();
            Tensor y      = empty({n, f});
            Tensor x_bf16 = with_bf16 ? empty({n, f}, DType::bf16) : Tensor();
            ops().bias_gelu_forward(stream(), x, bias, y, x_bf16);
            synchronize();
            // The biased x, one f32 addition; with x_bf16 it is rounded to bf16 there and gelu reads that.
            const float *       xs = x0.data<float>();
            std::vector<double> biased(static_cast<size_t>(n * f)), gelu_in(biased.size()), ref_y(biased.size());
            for (int64_t r = 0; r < n; ++r) {
                for (int64_t j = 0; j < f; ++j) {
                    const size_t i = static_cast<size_t>(r * f + j);
                    biased[i]      = with_bias ? static_cast<double>(xs[i]) + bias.data<float>()[j] : xs[i];
                    const float in = static_cast<float>(biased[i]);   // the f32 sum x holds
                    gelu_in[i]     = with_bf16 ? round_bf16(in) : in;
                    ref_y[i]       = gelu_ref(gelu_in[i]);
                }
            }
            if (with_bf16) {
                EXPECT_TRUE(same_bits("x unchanged with x_bf16", x.data_ptr(), x0.data_ptr(), x.nbytes()));
                std::vector<double> got(gelu_in.size());
                for (int64_t i = 0; i < x_bf16.numel(); ++i) got[static_cast<size_t>(i)] = element(x_bf16, i);
                EXPECT_EQ(got, gelu_in) << "x_bf16 is the nearest bf16 of the biased x";
            } else if (with_bias) {
                EXPECT_TRUE(close(name("x += bias", variant), x, biased, kF32Add, 0.0));
            } else {
                EXPECT_TRUE(same_bits("x unchanged without bias", x.data_ptr(), x0.data_ptr(), x.nbytes()));
            }
            EXPECT_TRUE(close(name("gelu y", variant), y, ref_y, kActivationTol, 1.0));
            ++variant;
        }
    }
}

TEST(OpsElementwise, GeluBackward) {
    Tensor x = random_f32({5, 2053}, 3101, -5.0f, 5.0f), dy = random_f32({5, 2053}, 3102), dx = empty({5, 2053});
    std::vector<double> xv = values(x), dv = values(dy), ref(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) ref[i] = dv[i] * gelu_grad_ref(xv[i]);
    ops().gelu_backward(stream(), x, dy, dx);
    synchronize();
    EXPECT_TRUE(close("gelu_backward", dx, ref, kGeluGradTol, 1.0));
}

TEST(OpsElementwise, SwigluForwardBackward) {
    const int64_t       n = kRows, f = 72;
    Tensor              x = random_f32({n, 2 * f}, 3201, -5.0f, 5.0f), y = empty({n, f});
    Tensor              dy = random_f32({n, f}, 3202), dx = empty({n, 2 * f});
    std::vector<double> xv = values(x), dv = values(dy), ref_y(static_cast<size_t>(n * f)), ref_dx(xv.size());
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < f; ++j) {
            const double g = xv[r * 2 * f + j], u = xv[r * 2 * f + f + j], s = sigmoid_ref(g), d = dv[r * f + j];
            ref_y[r * f + j]          = g * s * u;
            ref_dx[r * 2 * f + j]     = d * u * s * (1.0 + g * (1.0 - s));   // d/dgate of g s(g) u
            ref_dx[r * 2 * f + f + j] = d * g * s;                           // d/dup
        }
    }
    ops().swiglu_forward(stream(), x, y);
    ops().swiglu_backward(stream(), x, dy, dx);
    synchronize();
    EXPECT_TRUE(close("swiglu y", y, ref_y, kActivationTol, 1.0));
    EXPECT_TRUE(close("swiglu dx", dx, ref_dx, kActivationTol, 1.0));
}

// Quick-GEGLU (gpt-oss: clamp 7, offset 1) and SwiGLU with a clamp against the formula in double: a = min(gate,
// c), b = clamp(linear, -c, c), y = a sigmoid(k a) (b + offset); the gradient passes where the clamp let the
// value through, the bounds included. The double formula's derivative is checked by central differences
// first (away from the clamps' edges), so the test does not rest on the hand-derived slope alone.
TEST(OpsElementwise, GluQuickGegluAndClampForwardBackward) {
    const int64_t n = kRows, f = 72;
    for (const GluSpec glu : {GluSpec{GluSpec::Gate::quick_gelu, 7.0f, 1.0f}, GluSpec{GluSpec::Gate::quick_gelu, 0.0f, 0.5f},
                              GluSpec{GluSpec::Gate::silu, 2.0f, 0.0f}}) {
        const std::string what = std::string(glu.gate == GluSpec::Gate::quick_gelu ? "quick_geglu" : "swiglu") +
                                 " clamp " + std::to_string(glu.clamp) + " offset " + std::to_string(glu.linear_offset);
        const double k = glu.gate == GluSpec::Gate::quick_gelu ? 1.702 : 1.0, c = glu.clamp, off = glu.linear_offset;
        Tensor x = random_f32({n, 2 * f}, 3211, -10.0f, 10.0f), y = empty({n, f});
        for (int64_t r = 0; r < 4 && c > 0; ++r) {   // the clamps' bounds themselves: the gradient passes there
            x.data<float>()[r * 2 * f] = static_cast<float>(c);
            x.data<float>()[r * 2 * f + f] = static_cast<float>(r % 2 == 0 ? c : -c);
        }
        Tensor dy = random_f32({n, f}, 3212), dx = empty({n, 2 * f});
        auto   value = [&](double a, double b) {
            if (c > 0) a = std::min(a, c), b = std::clamp(b, -c, c);
            return a * sigmoid_ref(k * a) * (b + off);
        };
        std::vector<double> xv = values(x), dv = values(dy), ref_y(static_cast<size_t>(n * f)), ref_dx(xv.size());
        double              worst_fd = 0;
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t j = 0; j < f; ++j) {
                const double a0 = xv[r * 2 * f + j], b0 = xv[r * 2 * f + f + j], d = dv[r * f + j];
                const bool   pass_a = c == 0 || a0 <= c, pass_b = c == 0 || (b0 >= -c && b0 <= c);
                const double a = c > 0 ? std::min(a0, c) : a0, b = c > 0 ? std::clamp(b0, -c, c) : b0, s = sigmoid_ref(k * a);
                ref_y[r * f + j]          = value(a0, b0);
                ref_dx[r * 2 * f + j]     = pass_a ? d * (b + off) * s * (1.0 + k * a * (1.0 - s)) : 0.0;
                ref_dx[r * 2 * f + f + j] = pass_b ? d * a * s : 0.0;
                const double h = 1e-6;   // central differences, where both sides stay on one side of a bound
                if (c == 0 || (std::fabs(a0 - c) > 1e-3 && std::fabs(std::fabs(b0) - c) > 1e-3)) {
                    const double fa = d * (value(a0 + h, b0) - value(a0 - h, b0)) / (2 * h);
                    const double fb = d * (value(a0, b0 + h) - value(a0, b0 - h)) / (2 * h);
                    worst_fd = std::max({worst_fd, std::fabs(fa - ref_dx[r * 2 * f + j]) / (1.0 + std::fabs(fa)),
                                         std::fabs(fb - ref_dx[r * 2 * f + f + j]) / (1.0 + std::fabs(fb))});
                }
            }
        }
        EXPECT_LT(worst_fd, 1e-6) << what << ": the double formula's derivative";
        ops().glu_forward(stream(), x, y, glu);
        ops().glu_backward(stream(), x, dy, dx, glu);
        synchronize();
        EXPECT_TRUE(close(what + " y", y, ref_y, kActivationTol, 1.0));
        EXPECT_TRUE(close(what + " dx", dx, ref_dx, kActivationTol, 1.0));
        if (c > 0) {   // past the bounds exactly 0; at them, the gradient
            size_t zeros = 0;
            for (size_t i = 0; i < ref_dx.size(); ++i) zeros += ref_dx[i] == 0.0 && dx.data<float>()[i] == 0.0f;
            EXPECT_GT(zeros, static_cast<size_t>(n)) << what << ": the clamped values pass no gradient";
            EXPECT_NE(dx.data<float>()[0], 0.0f) << what << ": a gate at c passes it";
        }
    }
}

TEST(OpsElementwise, SquaredReluForwardBackward) {
    const int64_t       n = kRows, f = 72;
    Tensor              x = random_f32({n, f}, 3251, -4.0f, 4.0f), y = empty({n, f});
    Tensor              dy = random_f32({n, f}, 3252), dx = empty({n, f});
    std::vector<double> xv = values(x), dv = values(dy), ref_y(xv.size()), ref_dx(xv.size());
    for (size_t i = 0; i < xv.size(); ++i) {
        const double r = xv[i] > 0.0 ? xv[i] : 0.0;
        ref_y[i]       = r * r;
        ref_dx[i]      = dv[i] * 2.0 * r;
    }
    ops().squared_relu_forward(stream(), x, y);
    ops().squared_relu_backward(stream(), x, dy, dx);
    synchronize();
    EXPECT_TRUE(close("squared_relu y", y, ref_y, kActivationTol, 1.0));
    EXPECT_TRUE(close("squared_relu dx", dx, ref_dx, kActivationTol, 1.0));
}

// Rotary embedding: backend/cpu/ops.h documents Megatron's non-interleaved halves: in each head of d,
// element i pairs with element i + d/2 (i < d/2) and the pair at sequence position si turns by the angle
// si * base^(-2i/d): (x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin); the inverse turns by minus the angle.
// Partial (--rotary-percent: only the first r of each head's d turn, by base^(-2i/r)) and interleaved
// (--rotary-interleaved: pairs (2i, 2i + 1)) rotary embeddings against the same reference.
TEST(OpsElementwise, PartialAndInterleavedRopeAgainstReference) {
    const int64_t seq = 9, batch = 2, heads = 3, d = 16, stride = heads * d + 5;
    const double  base = 10000.0;
    for (const int64_t r : {int64_t(8), int64_t(16)}) {
        for (const bool interleaved : {false, true}) {
            SCOPED_TRACE("r " + std::to_string(r) + (interleaved ? ", interleaved" : ", halves"));
            Tensor              x   = random_f32({seq * batch, stride}, 3400 + r + interleaved);
            std::vector<double> xv  = values(x);
            std::vector<double> fwd = xv;
            for (int64_t si = 0; si < seq; ++si) {
                for (int64_t row = si * batch; row < (si + 1) * batch; ++row) {
                    for (int64_t hd = 0; hd < heads; ++hd) {
                        for (int64_t i = 0; i < r / 2; ++i) {
                            const size_t a = static_cast<size_t>(row * stride + hd * d + (interleaved ? 2 * i : i));
                            const size_t b = a + static_cast<size_t>(interleaved ? 1 : r / 2);
                            const double angle = static_cast<double>(si) * std::pow(base, -2.0 * i / r);
                            fwd[a] = xv[a] * std::cos(angle) - xv[b] * std::sin(angle);
                            fwd[b] = xv[b] * std::cos(angle) + xv[a] * std::sin(angle);
                        }
                    }
                }
            }
            ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), false, r, interleaved);
            synchronize();
            EXPECT_TRUE(close("rope forward", x, fwd, kRopeTol, 1.0));   // the unturned elements stay as they were
            ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), true, r, interleaved);
            synchronize();
            EXPECT_TRUE(close("rope inverse(forward(x))", x, xv, kRopeTol, 1.0));
        }
    }
}

// YaRN (core/rope.h), from Megatron's YarnRotaryEmbedding written out in double: r 16, base 10000, factor 40
// over an original context of 64 positions (so that the ramp falls inside the 8 pairs: pairs up to `low`
// keep RoPE's frequencies, those from `high` divide them by 40, those between blend), the cos and sin
// scaled by mscale(40, 0.9) / mscale(40, 0.7). The backward turns back with the same amplitude (the
// transpose): backward(forward(x)) = amplitude^2 x.
TEST(OpsElementwise, YarnRopeAgainstMegatronsFormula) {
    const int64_t seq = 11, batch = 2, heads = 2, r = 16, d = 16, stride = heads * d;
    const double  base = 10000.0, factor = 40.0, pi = 3.14159265358979323846;
    RopeScaling   yarn;
    yarn.factor                 = static_cast<float>(factor);
    yarn.original_max_positions = 64;
    auto mscale    = [&](double m) { return 0.1 * m * std::log(factor) + 1.0; };
    yarn.amplitude = static_cast<float>(mscale(0.9) / mscale(0.7));
    auto dim_of    = [&](double rotations) { return r * std::log(64.0 / (rotations * 2 * pi)) / (2 * std::log(base)); };
    const double low = std::max(std::floor(dim_of(32.0)), 0.0), high = std::min(std::ceil(dim_of(1.0)), double(r - 1));
    ASSERT_LT(low, high);
    ASSERT_GT(high, low + 1) << "some pairs blend";
    Tensor              x  = random_f32({seq * batch, stride}, 3500);
    std::vector<double> xv = values(x), fwd = xv, twice = xv;
    for (int64_t row = 0; row < seq * batch; ++row) {
        const double p = static_cast<double>(row / batch);
        for (int64_t hd = 0; hd < heads; ++hd) {
            for (int64_t i = 0; i < r / 2; ++i) {
                const double extra = std::pow(base, -2.0 * i / r), inter = extra / factor;
                const double keep  = 1.0 - std::clamp((i - low) / (high - low), 0.0, 1.0);
                const double angle = p * (inter * (1 - keep) + extra * keep), a = yarn.amplitude;
                const size_t u = static_cast<size_t>(row * stride + hd * d + i), v = u + static_cast<size_t>(r / 2);
                fwd[u]   = a * (xv[u] * std::cos(angle) - xv[v] * std::sin(angle));
                fwd[v]   = a * (xv[v] * std::cos(angle) + xv[u] * std::sin(angle));
                twice[u] = a * a * xv[u];
                twice[v] = a * a * xv[v];
            }
        }
    }
    ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), false, r, false, {}, yarn);
    synchronize();
    EXPECT_TRUE(close("yarn rope forward", x, fwd, kRopeTol, 1.0));
    ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), true, r, false, {}, yarn);
    synchronize();
    EXPECT_TRUE(close("yarn rope backward(forward(x))", x, twice, kRopeTol, 1.0));
}

TEST(OpsElementwise, RopeForwardAgainstReferenceAndInverse) {
    const int64_t       seq = 41, batch = 2, heads = 3, d = 16, stride = 5 * d + 3;   // K, V and padding after
    const double        base = 10000.0;
    Tensor              x    = random_f32({seq * batch, stride}, 3301);
    Tensor              x0   = clone(x);
    std::vector<double> xv   = values(x);
    std::vector<double> fwd = xv, inv = xv;
    for (int64_t si = 0; si < seq; ++si) {
        for (int64_t bi = 0; bi < batch; ++bi) {
            for (int64_t hd = 0; hd < heads; ++hd) {
                const size_t o = static_cast<size_t>((si * batch + bi) * stride + hd * d);
                for (int64_t i = 0; i < d / 2; ++i) {
                    const double angle = static_cast<double>(si) * std::pow(base, -2.0 * i / d);
                    const double c = std::cos(angle), s = std::sin(angle);
                    const double x1 = xv[o + i], x2 = xv[o + i + d / 2];
                    fwd[o + i]         = x1 * c - x2 * s;
                    fwd[o + i + d / 2] = x2 * c + x1 * s;
                    inv[o + i]         = x1 * c + x2 * s;
                    inv[o + i + d / 2] = x2 * c - x1 * s;
                }
            }
        }
    }
    ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), /*inverse=*/false);
    synchronize();
    EXPECT_TRUE(close("rope forward", x, fwd, kRopeTol, 1.0));   // columns past heads * d: fwd keeps them
    for (int64_t r = 0; r < seq * batch; ++r) {
        EXPECT_TRUE(same_bits("rope leaves the other heads", x.data<float>() + r * stride + heads * d,
                              x0.data<float>() + r * stride + heads * d, sizeof(float) * (stride - heads * d)));
    }
    ops().rope(stream(), x, seq, batch, heads, d, static_cast<float>(base), /*inverse=*/true);
    synchronize();
    EXPECT_TRUE(close("rope inverse(forward(x))", x, xv, kRopeTol, 1.0));

    Tensor y = clone(x0);
    ops().rope(stream(), y, seq, batch, heads, d, static_cast<float>(base), /*inverse=*/true);
    synchronize();
    EXPECT_TRUE(close("rope inverse", y, inv, kRopeTol, 1.0));
}

// ---------------------------------------------------------------------------------------------------
// Embedding

// Hidden dropout: y = x mask / (1 - p), the mask a function of (sample, position, feature) alone. Rows
// are (s, b) ordered; a sequence-parallel block of rows given its offset draws the rows of the whole.
TEST(OpsElementwise, DropoutKeepsOneMinusPScaledAndIsAFunctionOfTheGlobalRow) {
    const int64_t s = 64, b = 4, h = 96, n = s * b;
    Dropout       key;
    key.p          = 0.1f;
    key.seed       = 1234;
    key.site       = dropout_site(0, DropoutKind::mlp_output);
    key.sample_ids = empty({b}, DType::i64);
    for (int64_t j = 0; j < b; ++j) key.sample_ids.data<int64_t>()[j] = 100 + j;
    key.batch   = b;
    Tensor x    = random_f32({n, h}, 77);
    Tensor y    = empty({n, h});
    ops().dropout(stream(), x, y, key);
    // The last 3/4 of the rows alone, as a sequence-parallel rank holds them, in place.
    Tensor tail = empty({n / 4 * 3, h});
    ops().copy(stream(), x.narrow(0, n / 4, n - n / 4), tail);
    Dropout tail_key = key;
    tail_key.offset  = n / 4;
    ops().dropout(stream(), tail, tail, tail_key);
    synchronize();
    const uint32_t threshold = dropout_threshold(key.p);
    int64_t        kept      = 0;
    for (int64_t r = 0; r < n; ++r) {
        const uint64_t base = dropout_base(key.seed, key.site, 100 + r % b);
        for (int64_t c = 0; c < h; ++c) {
            const bool  keep = dropout_keep_hidden(base, r / b, c, threshold);
            const float want = keep ? x.data<float>()[r * h + c] * (1.0f / 0.9f) : 0.0f;
            ASSERT_EQ(y.data<float>()[r * h + c], want) << "row " << r << " feature " << c;
            if (r >= n / 4) {
                ASSERT_EQ(tail.data<float>()[(r - n / 4) * h + c], want) << "offset row " << r;
            }
            kept += keep;
        }
    }
    // Kept fraction 0.9 within 5 standard deviations of a binomial over n h = 24576 draws (sd 0.0019).
    const double fraction = static_cast<double>(kept) / static_cast<double>(n * h);
    EXPECT_NEAR(fraction, 0.9, 5 * std::sqrt(0.09 / static_cast<double>(n * h)));
    // Another sample, another site: another mask (the two agree on about 0.82 of the elements, not all).
    Dropout other = key;
    other.site    = dropout_site(1, DropoutKind::mlp_output);
    int64_t same  = 0;
    for (int64_t r = 0; r < n; ++r) {
        const uint64_t a = dropout_base(key.seed, key.site, 100 + r % b), o = dropout_base(key.seed, other.site, 100 + r % b);
        for (int64_t c = 0; c < h; ++c) same += dropout_keep_hidden(a, r / b, c, threshold) == dropout_keep_hidden(o, r / b, c, threshold);
    }
    EXPECT_NEAR(static_cast<double>(same) / static_cast<double>(n * h), 0.82, 0.01);
}

TEST(OpsEmbedding, ForwardF32AndBf16WithAndWithoutWpe) {
    const int64_t b = 3, s = 5, vocab = 11, h = 40, positions = 7;
    // tokens (b, s); -1 is another rank's row: it embeds to zero.
    Tensor tokens  = int_tensor({b, s}, {3, 0, 10, -1, 3, 7, 7, 1, 2, -1, 9, 4, 5, 6, 8});
    int    variant = 0;
    for (DType dtype : {DType::f32, DType::bf16}) {
        for (bool with_wpe : {true, false}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + (with_wpe ? " +wpe" : ""));
            Tensor              wte = random_tensor({vocab, h}, dtype, 4000 + variant);
            Tensor              wpe = with_wpe ? random_tensor({positions, h}, dtype, 4001 + variant) : Tensor();
            Tensor              out = random_f32({s * b, h}, 4002);   // assigned, whatever it held
            std::vector<double> ref(static_cast<size_t>(s * b * h), 0.0);
            for (int64_t si = 0; si < s; ++si) {
                for (int64_t bi = 0; bi < b; ++bi) {
                    const int32_t t = tokens.data<int32_t>()[bi * s + si];
                    for (int64_t j = 0; j < h; ++j) {
                        double v = t >= 0 ? element(wte, t * h + j) : 0.0;
                        if (with_wpe) v += element(wpe, si * h + j);
                        ref[static_cast<size_t>((si * b + bi) * h + j)] = v;
                    }
                }
            }
            ops().embedding_forward(stream(), tokens, wte, wpe, out);
            synchronize();
            EXPECT_TRUE(close(name("embedding out", variant), out, ref, kF32Add, 0.0));
            if (!with_wpe) { EXPECT_TRUE(exact(name("embedding lookup", variant), out, ref)); }
            ++variant;
        }
    }
}

TEST(OpsEmbedding, BackwardAddsIntoDwteAndDwpeSkippingOtherRanksTokens) {
    const int64_t b = 3, s = 5, vocab = 11, h = 130, positions = 7;   // h over 2 column chunks
    Tensor        tokens = int_tensor({b, s}, {3, 0, 10, -1, 3, 7, 7, 1, 2, -1, 9, 3, 5, 6, 3});   // 4 unused: 4, 8
    for (bool with_wpe : {true, false}) {
        SCOPED_TRACE(with_wpe ? "with dwpe" : "without dwpe");
        Tensor dout = random_f32({s * b, h}, 4101);
        Tensor dwte = random_f32({vocab, h}, 4102), dwpe = with_wpe ? random_f32({positions, h}, 4103) : Tensor();
        Tensor dwte0                = clone(dwte);
        std::vector<double> ref_wte = values(dwte), mag_wte = magnitudes(ref_wte), d = values(dout);
        std::vector<double> ref_wpe, mag_wpe;
        if (with_wpe) {
            ref_wpe = values(dwpe);
            mag_wpe = magnitudes(ref_wpe);
        }
        for (int64_t si = 0; si < s; ++si) {
            for (int64_t bi = 0; bi < b; ++bi) {
                const int32_t t = tokens.data<int32_t>()[bi * s + si];
                for (int64_t j = 0; j < h; ++j) {
                    const double g = d[static_cast<size_t>((si * b + bi) * h + j)];
                    if (t >= 0) {
                        ref_wte[t * h + j] += g;
                        mag_wte[t * h + j] += std::fabs(g);
                    }
                    if (with_wpe) {
                        ref_wpe[si * h + j] += g;
                        mag_wpe[si * h + j] += std::fabs(g);
                    }
                }
            }
        }
        ops().embedding_backward(stream(), tokens, dout, dwte, dwpe);
        synchronize();
        EXPECT_TRUE(close_to_magnitude("embedding dwte", dwte, ref_wte, mag_wte, kReduceTol));
        for (int64_t unused : {4, 8}) {
            EXPECT_TRUE(same_bits("a row no token reads", dwte.data<float>() + unused * h,
                                  dwte0.data<float>() + unused * h, sizeof(float) * h));
        }
        if (with_wpe) { EXPECT_TRUE(close_to_magnitude("embedding dwpe", dwpe, ref_wpe, mag_wpe, kReduceTol)); }
    }
}

// The ops that read positions (core/positions.h) on a context-parallel rank's rows: rank 1 of CP 2 over
// chunks of 3 holds positions 3..5 and 6..8 of 12. Its rope, hidden dropout, embedding lookup and position
// gradient give, bit for bit, what the whole sequence's ops give at those rows.
TEST(OpsPositions, RopeDropoutAndEmbeddingOfTwoChunksAreTheWholeSequencesRows) {
    const int64_t      S = 12, local = 6, b = 2, w = 16, vocab = 9;
    const SeqPositions positions{3, 3, 6};
    // Rank rows of a whole (S b, width) tensor.
    auto rows_of = [&](const Tensor & t) {
        const int64_t width = t.size(1);
        Tensor        out   = empty({local * b, width}, t.dtype());
        for (int64_t i = 0; i < local; ++i) {
            const int64_t from = positions(i) * b * width * static_cast<int64_t>(dtype_size(t.dtype()));
            std::memcpy(static_cast<char *>(out.data_ptr()) + i * b * width * static_cast<int64_t>(dtype_size(t.dtype())),
                        static_cast<const char *>(t.data_ptr()) + from, static_cast<size_t>(b * width) * dtype_size(t.dtype()));
        }
        return out;
    };
    auto same = [&](const char * what, const Tensor & whole, const Tensor & mine) {
        const Tensor want = rows_of(whole);
        EXPECT_EQ(0, std::memcmp(want.data_ptr(), mine.data_ptr(), static_cast<size_t>(want.nbytes()))) << what;
    };
    // Rope on 2 heads of 8.
    Tensor x_whole = random_f32({S * b, w}, 7300, -2.0f, 2.0f), x_mine = rows_of(x_whole);
    ops().rope(stream(), x_whole, S, b, 2, 8, 10000.0f, false);
    ops().rope(stream(), x_mine, local, b, 2, 8, 10000.0f, false, 0, false, positions);
    synchronize();
    same("rope", x_whole, x_mine);
    // Hidden dropout: the whole sequence from row 0, the rank's rows through its positions.
    Dropout key;
    key.p     = 0.4f;
    key.seed  = 5;
    key.site  = dropout_site(0, DropoutKind::mlp_output);
    key.batch = b;
    Tensor h_whole = random_f32({S * b, w}, 7301), h_mine = rows_of(h_whole);
    ops().dropout(stream(), h_whole, h_whole, key);
    key.positions = positions;
    ops().dropout(stream(), h_mine, h_mine, key);
    synchronize();
    same("dropout", h_whole, h_mine);
    // Embedding with learned positions: the rank's tokens are the whole sequence's at its positions.
    Tensor tokens_whole = empty({b, S}, DType::i32), tokens_mine = empty({b, local}, DType::i32);
    for (int64_t bi = 0; bi < b; ++bi) {
        for (int64_t si = 0; si < S; ++si) tokens_whole.data<int32_t>()[bi * S + si] = static_cast<int32_t>((si * 7 + bi) % vocab);
        for (int64_t i = 0; i < local; ++i) tokens_mine.data<int32_t>()[bi * local + i] = tokens_whole.data<int32_t>()[bi * S + positions(i)];
    }
    Tensor wte = random_f32({vocab, w}, 7302), wpe = random_f32({S, w}, 7303);
    Tensor e_whole = empty({S * b, w}), e_mine = empty({local * b, w});
    ops().embedding_forward(stream(), tokens_whole, wte, wpe, e_whole);
    ops().embedding_forward(stream(), tokens_mine, wte, wpe, e_mine, positions);
    // Backward: the rank's output gradient lands on its positions' rows of dwpe, the rest stays 0.
    Tensor dout = random_f32({local * b, w}, 7304), dwte = empty({vocab, w}), dwpe = empty({S, w});
    ops().fill_zero(stream(), dwte);
    ops().fill_zero(stream(), dwpe);
    ops().embedding_backward(stream(), tokens_mine, dout, dwte, dwpe, positions);
    synchronize();
    same("embedding", e_whole, e_mine);
    for (int64_t p = 0; p < S; ++p) {
        const bool mine = (p >= 3 && p < 9);
        for (int64_t j = 0; j < w; ++j) {
            double want = 0;
            if (mine) {
                const int64_t i = p - 3;   // local row of position p (chunks 3..5 then 6..8: contiguous here)
                for (int64_t bi = 0; bi < b; ++bi) want += dout.data<float>()[(i * b + bi) * w + j];
            }
            EXPECT_NEAR(dwpe.data<float>()[p * w + j], want, 1e-6) << "dwpe position " << p;
        }
    }
}

TEST(OpsEmbedding, VocabShardIds) {
    const int64_t        begin = 17, count = 13;
    std::vector<int32_t> ids = {0, 16, 17, 18, 29, 30, 31, 100, -1, 23, 17, 29, 5, 22};
    Tensor               in  = int_tensor({2, 7}, ids);
    Tensor               out = int_tensor({2, 7}, std::vector<int32_t>(ids.size(), 12345));
    ops().vocab_shard_ids(stream(), in, begin, count, out);
    synchronize();
    for (size_t i = 0; i < ids.size(); ++i) {
        const int32_t expected = ids[i] >= begin && ids[i] < begin + count ? ids[i] - static_cast<int32_t>(begin) : -1;
        EXPECT_EQ(out.data<int32_t>()[i], expected) << "id " << ids[i];
    }
}

// ---------------------------------------------------------------------------------------------------
// Attention

namespace {

struct AttentionIndex {
    const AttentionShape & a;
    size_t q(int64_t si, int64_t bi, int64_t hq, int64_t dd) const { return row(si, bi) + hq * a.d + dd; }
    size_t k(int64_t si, int64_t bi, int64_t hk, int64_t dd) const { return row(si, bi) + (a.nq + hk) * a.d + dd; }
    size_t v(int64_t si, int64_t bi, int64_t hk, int64_t dd) const {
        return row(si, bi) + (a.nq + a.nkv + hk) * a.d + dd;
    }
    size_t o(int64_t si, int64_t bi, int64_t hq, int64_t dd) const {
        return static_cast<size_t>(((si * a.b + bi) * a.nq + hq) * a.d + dd);
    }
    size_t row(int64_t si, int64_t bi) const { return static_cast<size_t>((si * a.b + bi) * a.row_stride); }
};

// The probabilities' dropout factor z (mask / (1 - p)) of (batch column, query head, query, key), drawn
// straight from core/dropout.h's keys.
double attention_dropout_factor(const Dropout & key, int64_t bi, int64_t hq, int64_t i, int64_t j) {
    if (!key.enabled()) return 1.0;
    const int64_t  sample = key.sample_ids.defined() ? key.sample_ids.data<int64_t>()[bi] : bi;
    const uint64_t row    = dropout_attention_row(dropout_base(key.seed, key.site, sample), key.offset + hq, i);
    return dropout_keep_attention(row, j, dropout_threshold(key.p)) ? 1.0 / (1.0 - static_cast<double>(key.p)) : 0.0;
}

// Naive causal softmax attention in double: the s x s probabilities of each (sequence, query head); with a
// window w, query i sees keys max(0, i - w) .. i; with a key mask, only the keys it holds.
// With dout given, also its gradient dqkv (assigned on the Q, K, V columns, 0 elsewhere). With dropout,
// O = (z P) V and dS = P (z dP - rowsum(dO O)). With sink logits (nq), each head's joins every query's
// softmax with a zero value; its gradient dsink (assigned) is -sum P_sink rowsum(dO O).
void attention_reference(const std::vector<double> & qkv, const AttentionShape & a, double scale,
                         std::vector<double> & out, std::vector<double> & lse, const std::vector<double> * dout,
                         std::vector<double> * dqkv, const Dropout & dropout = {},
                         const std::vector<double> * sink = nullptr, std::vector<double> * dsink = nullptr) {
    if (dsink) dsink->assign(static_cast<size_t>(a.nq), 0.0);
    const AttentionIndex ix{a};
    const int64_t        group = a.nq / a.nkv;
    out.assign(static_cast<size_t>(a.s * a.b * a.nq * a.d), 0.0);
    lse.assign(static_cast<size_t>(a.b * a.nq * a.s), 0.0);
    if (dqkv) dqkv->assign(qkv.size(), 0.0);
    std::vector<double> p(static_cast<size_t>(a.s));
    for (int64_t bi = 0; bi < a.b; ++bi) {
        for (int64_t hq = 0; hq < a.nq; ++hq) {
            const int64_t hk = hq / group;
            for (int64_t i = 0; i < a.s; ++i) {
                const int64_t j0 = a.window >= 0 ? std::max<int64_t>(0, i - a.window) : 0;   // the first key seen
                double mx = -std::numeric_limits<double>::infinity();
                for (int64_t j = j0; j <= i; ++j) {
                    double dot = 0;
                    for (int64_t dd = 0; dd < a.d; ++dd) dot += qkv[ix.q(i, bi, hq, dd)] * qkv[ix.k(j, bi, hk, dd)];
                    const bool held = !a.key_mask.defined() || a.key_mask.data<uint8_t>()[(bi * a.s + i) * a.s + j] != 0;
                    p[j] = held ? scale * dot : -std::numeric_limits<double>::infinity();   // e^-inf: exactly 0
                    mx   = std::max(mx, p[j]);
                }
                if (sink) mx = std::max(mx, (*sink)[static_cast<size_t>(hq)]);
                double sum = sink ? std::exp((*sink)[static_cast<size_t>(hq)] - mx) : 0.0;
                for (int64_t j = j0; j <= i; ++j) sum += (p[j] = std::exp(p[j] - mx));
                for (int64_t j = j0; j <= i; ++j) p[j] /= sum;
                lse[static_cast<size_t>((bi * a.nq + hq) * a.s + i)] = mx + std::log(sum);
                const double p_sink = sink ? std::exp((*sink)[static_cast<size_t>(hq)] - mx) / sum : 0.0;
                std::vector<double> z(static_cast<size_t>(i + 1));
                for (int64_t j = j0; j <= i; ++j) z[j] = attention_dropout_factor(dropout, bi, hq, i, j);
                for (int64_t j = j0; j <= i; ++j) {
                    for (int64_t dd = 0; dd < a.d; ++dd) out[ix.o(i, bi, hq, dd)] += z[j] * p[j] * qkv[ix.v(j, bi, hk, dd)];
                }
                if (!dqkv) continue;
                // dV_j += P_ij dO_i;  dS_ij = P_ij (dO_i . V_j - dO_i . O_i);  dQ_i += scale dS_ij K_j;
                // dK_j += scale dS_ij Q_i.
                double delta = 0;
                for (int64_t dd = 0; dd < a.d; ++dd) delta += (*dout)[ix.o(i, bi, hq, dd)] * out[ix.o(i, bi, hq, dd)];
                if (dsink) (*dsink)[static_cast<size_t>(hq)] -= p_sink * delta;
                for (int64_t j = j0; j <= i; ++j) {
                    double dp = 0;
                    for (int64_t dd = 0; dd < a.d; ++dd) dp += (*dout)[ix.o(i, bi, hq, dd)] * qkv[ix.v(j, bi, hk, dd)];
                    const double ds = p[j] * (z[j] * dp - delta);
                    for (int64_t dd = 0; dd < a.d; ++dd) {
                        (*dqkv)[ix.v(j, bi, hk, dd)] += z[j] * p[j] * (*dout)[ix.o(i, bi, hq, dd)];
                        (*dqkv)[ix.q(i, bi, hq, dd)] += scale * ds * qkv[ix.k(j, bi, hk, dd)];
                        (*dqkv)[ix.k(j, bi, hk, dd)] += scale * ds * qkv[ix.q(i, bi, hq, dd)];
                    }
                }
            }
        }
    }
}

double attention_loss(const std::vector<double> & qkv, const AttentionShape & a, double scale,
                      const std::vector<double> & dout, const Dropout & dropout = {},
                      const std::vector<double> * sink = nullptr) {
    std::vector<double> out, lse;
    attention_reference(qkv, a, scale, out, lse, nullptr, nullptr, dropout, sink);
    double loss = 0;
    for (size_t i = 0; i < out.size(); ++i) loss += dout[i] * out[i];
    return loss;
}

}  // namespace

// With `sinks`, each query head's sink logit (in [-1, 3): from a small to a large share of the softmax) joins
// the softmax through Ops::attention_sink_forward after the kernel, and its gradient is added to dsink's
// values by attention_sink_backward.
// With `key_mask`, a key mask (AttentionShape::key_mask, DSA's top k): random keys of each row's, and on every
// third row one key alone, so that whole blocks of 64 keys hold none of a row's.
static void attention_against_reference(const Dropout & dropout, int64_t window = -1, bool sinks = false,
                                        bool key_mask = false) {
    // (s, b, nq, nkv, d, row_stride): GQA with two query blocks of 64; multi-head with padded rows; one
    // key/value head for four query heads. With a window, also three blocks of 64, where the last block's
    // queries see no key of the first.
    std::vector<AttentionShape> shapes = {{70, 2, 4, 2, 8, 8 * 8 + 3}, {5, 3, 2, 2, 4, 6 * 4 + 1}, {9, 1, 4, 1, 16, 6 * 16}};
    if (window >= 0) shapes.push_back({150, 1, 2, 1, 8, 4 * 8});
    int variant = 0;
    for (AttentionShape a : shapes) {
        a.window = window;
        SCOPED_TRACE("attention shape " + std::to_string(variant) + (dropout.enabled() ? " with dropout" : "") +
                     (window >= 0 ? ", window " + std::to_string(window) : "") + (sinks ? ", sinks" : "") +
                     (key_mask ? ", key mask" : ""));
        if (key_mask) {
            a.key_mask = empty({a.b, a.s, a.s}, DType::u8);
            Rng draw(5100 + variant);
            for (int64_t bi = 0; bi < a.b; ++bi) {
                for (int64_t i = 0; i < a.s; ++i) {
                    uint8_t * row = a.key_mask.data<uint8_t>() + (bi * a.s + i) * a.s;
                    for (int64_t j = 0; j < a.s; ++j) row[j] = i % 3 != 2 && draw.below(2) == 0 ? 1 : 0;
                    const int64_t first = window >= 0 ? std::max<int64_t>(0, i - window) : 0;
                    row[first + draw.below(i - first + 1)] = 1;   // at least one key the row sees
                }
            }
        }
        const int64_t       n = a.s * a.b, width = (a.nq + 2 * a.nkv) * a.d;
        const float         scale = 1.0f / std::sqrt(static_cast<float>(a.d));
        Tensor              qkv   = random_f32({n, a.row_stride}, 5000 + 10 * variant, -2.0f, 2.0f);
        Tensor              out = empty({n, a.nq * a.d}), lse = empty({a.b * a.nq * a.s});
        Tensor              dout = random_f32({n, a.nq * a.d}, 5001 + 10 * variant);
        Tensor              dqkv = random_f32({n, a.row_stride}, 5002, 7.0f, 8.0f);   // assigned, not added to
        std::vector<double> ref_out, ref_lse, ref_dqkv, q = values(qkv), dov = values(dout);
        const Tensor        sink = random_f32({a.nq}, 5004 + 10 * variant, -1.0f, 3.0f);
        const Tensor        dsink = random_f32({a.nq}, 5005 + 10 * variant);   // added to
        const std::vector<double> sink_v = values(sink), dsink_before = values(dsink);
        std::vector<double>       ref_dsink;
        attention_reference(q, a, scale, ref_out, ref_lse, &dov, &ref_dqkv, dropout, sinks ? &sink_v : nullptr,
                            sinks ? &ref_dsink : nullptr);
        if (sinks) {   // the sink's reference gradient against central differences too
            for (int64_t h = 0; h < a.nq; ++h) {
                const double        hh = 1e-5;
                std::vector<double> sp = sink_v, sm = sink_v;
                sp[static_cast<size_t>(h)] += hh;
                sm[static_cast<size_t>(h)] -= hh;
                const double fd = (attention_loss(q, a, scale, dov, dropout, &sp) - attention_loss(q, a, scale, dov, dropout, &sm)) /
                                  (2 * hh);
                EXPECT_NEAR(ref_dsink[static_cast<size_t>(h)], fd, 1e-6 * std::max(std::fabs(fd), 1e-3)) << "reference dsink " << h;
            }
        }

        // The reference gradient against central differences of the reference forward, at a few elements.
        Rng pick(5003 + variant);
        for (int t = 0; t < 6; ++t) {
            const size_t        i  = static_cast<size_t>(pick.below(n) * a.row_stride + pick.below(width));
            const double        hh = 1e-5;
            std::vector<double> qp = q, qm = q;
            qp[i] += hh;
            qm[i] -= hh;
            const std::vector<double> * sv = sinks ? &sink_v : nullptr;
            const double fd = (attention_loss(qp, a, scale, dov, dropout, sv) - attention_loss(qm, a, scale, dov, dropout, sv)) / (2 * hh);
            EXPECT_NEAR(ref_dqkv[i], fd, 1e-6 * std::max(std::fabs(fd), 1e-3)) << "reference gradient, element " << i;
        }

        ops().attention_forward(stream(), qkv, out, lse, a, scale, dropout);
        if (sinks) ops().attention_sink_forward(stream(), out, lse, sink, a);
        ops().attention_backward(stream(), qkv, out, dout, lse, dqkv, a, scale, dropout);
        if (sinks) ops().attention_sink_backward(stream(), out, dout, lse, sink, dsink, a);
        synchronize();
        if (sinks) {
            std::vector<double> want(ref_dsink.size());
            for (size_t h = 0; h < want.size(); ++h) want[h] = dsink_before[h] + ref_dsink[h];
            EXPECT_TRUE(close_to_max(name("attention dsink", variant), dsink.data<float>(), want, kAttentionBwTol));
        }
        EXPECT_TRUE(close_to_max(name("attention out", variant), out.data<float>(), ref_out, kAttentionTol));
        EXPECT_TRUE(close(name("attention lse", variant), lse, ref_lse, kAttentionTol, 1.0));
        // dQ, dK, dV separately (each against its own largest value); padding columns are not outputs.
        for (int part = 0; part < 3; ++part) {
            const int64_t       c0 = part == 0 ? 0 : (part == 1 ? a.nq * a.d : (a.nq + a.nkv) * a.d);
            const int64_t       c1 = part == 0 ? a.nq * a.d : (part == 1 ? (a.nq + a.nkv) * a.d : width);
            std::vector<float>  got;
            std::vector<double> ref;
            for (int64_t r = 0; r < n; ++r) {
                for (int64_t c = c0; c < c1; ++c) {
                    got.push_back(dqkv.data<float>()[r * a.row_stride + c]);
                    ref.push_back(ref_dqkv[static_cast<size_t>(r * a.row_stride + c)]);
                }
            }
            EXPECT_TRUE(close_to_max(name(part == 0   ? "attention dq"
                                          : part == 1 ? "attention dk"
                                                      : "attention dv",
                                          variant),
                                     got.data(), ref, kAttentionBwTol));
        }
        ++variant;
    }
}

// ---------------------------------------------------------------------------------------------------
// Cross-entropy and the vocabulary-parallel pieces

namespace {

// Logits (n, stride) in [-4, 4) on the real columns; the padding holds values that would change every
// result were they read (a large one and a NaN).
Tensor ce_logits(int64_t n, int64_t stride, int64_t vocab, uint64_t seed) {
    Tensor t = random_f32({n, stride}, seed, -4.0f, 4.0f);
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t v = vocab; v < stride; ++v) {
            t.data<float>()[r * stride + v] = (v % 2) ? 100.0f : std::numeric_limits<float>::quiet_NaN();
        }
    }
    return t;
}

// Row r of (s, b) rows reads labels[(r % b) * s + r / b].
int32_t label_of(const Tensor & labels, int64_t r, int64_t b, int64_t s) {
    return labels.data<int32_t>()[(r % b) * s + r / b];
}

std::vector<double> logsumexp_rows(const Tensor & logits, int64_t valid) {
    const int64_t       n = logits.size(0), stride = logits.size(1);
    std::vector<double> lse(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) {
        double mx = -std::numeric_limits<double>::infinity(), sum = 0;
        for (int64_t v = 0; v < valid; ++v) mx = std::max<double>(mx, logits.data<float>()[r * stride + v]);
        for (int64_t v = 0; v < valid; ++v) sum += std::exp(logits.data<float>()[r * stride + v] - mx);
        lse[static_cast<size_t>(r)] = mx + std::log(sum);
    }
    return lse;
}

}  // namespace

TEST(OpsAttention, ForwardBackwardAgainstNaiveDoubleAttentionWithGqa) {
    attention_against_reference(Dropout{});
}

// Dropout on the probabilities: the kernel (tiled, the mask redrawn in backward) against the naive
// attention with the same mask, including the gradient's central differences; head offset 3 and sample
// ids far into the stream.
TEST(OpsAttention, DropoutOnTheProbabilitiesAgainstNaiveDoubleAttention) {
    Dropout key;
    key.p          = 0.3f;
    key.seed       = 1234;
    key.site       = dropout_site(2, DropoutKind::attention_probs);
    key.sample_ids = empty({3}, DType::i64);
    for (int64_t j = 0; j < 3; ++j) key.sample_ids.data<int64_t>()[j] = (int64_t{1} << 33) + 7 * j;
    key.batch  = 3;
    key.offset = 3;
    attention_against_reference(key);
}

// A sliding window (--window-size w,0): query i sees keys i - w .. i, the bound included; 1 (itself and the
// one before), 3 (inside a block) and 20 (across blocks, a whole block skipped), with and without dropout.
// (Window 0 leaves each query its own key alone: dQ and dK are 0 but for rounding, nothing to compare.)
TEST(OpsAttention, SlidingWindowAgainstNaiveDoubleAttention) {
    Dropout key;
    key.p    = 0.3f;
    key.seed = 99;
    key.site = dropout_site(1, DropoutKind::attention_probs);
    for (const int64_t window : {1, 3, 20}) attention_against_reference(Dropout{}, window);
    attention_against_reference(key, 20);
}

// A key mask (DSA's top k, AttentionShape::key_mask): each query sees only the keys its row holds, tiles where a row
// holds none skipped, the masked probabilities exactly 0 in forward and backward; with a window too.
TEST(OpsAttention, KeyMaskAgainstNaiveDoubleAttention) {
    attention_against_reference(Dropout{}, -1, false, true);
    attention_against_reference(Dropout{}, 20, false, true);
}

// Attention sinks (--softmax-type learnable / off-by-one): the kernel's (out, lse) then the sink's merge, and
// the kernel's backward from that final pair plus the sink's gradient, against the naive softmax with the
// sink as one more logit; with dropout and with a window too.
TEST(OpsAttention, SinksAgainstNaiveDoubleAttention) {
    Dropout key;
    key.p    = 0.3f;
    key.seed = 7;
    key.site = dropout_site(3, DropoutKind::attention_probs);
    attention_against_reference(Dropout{}, -1, true);
    attention_against_reference(key, 20, true);
}

// Context parallelism's blocks (core/positions.h): the sequence in 2 CP chunks, rank r holding chunks r and
// 2 CP - 1 - r. Each rank's queries against every rank's keys and values (K and V alone, in their own rows
// of 2 nkv d), each block by global positions and merged with attention_merge, give the whole sequence's
// out and lse at the rank's rows; backward per block from the merged out and lse, dQ added over the blocks
// and each block's dK and dV summed at their owner's rows, gives the whole sequence's gradient (the first
// block's gradients assigned, the later ones added). With and
// without dropout (its masks drawn by global positions), at CP 2 and 3, chunks of 35 and 22 rows (blocks of
// 64 that straddle the chunks, and a rank whose first chunk sees no key of a later rank's).
TEST(OpsAttention, ContextParallelBlocksMergeToTheWholeSequence) {
    for (const bool dropped : {false, true}) {
        for (const std::pair<int64_t, int64_t> sizes : {std::pair<int64_t, int64_t>{2, 35}, {3, 22}}) {
            const int64_t cp = sizes.first, chunk = sizes.second;   // plain names: the lambdas below capture them
            SCOPED_TRACE("cp " + std::to_string(cp) + (dropped ? " with dropout" : ""));
            const int64_t b = 2, nq = 4, nkv = 2, d = 8, S = 2 * cp * chunk, local = 2 * chunk;
            const AttentionShape whole{S, b, nq, nkv, d, (nq + 2 * nkv) * d};
            const float          scale = 1.0f / std::sqrt(static_cast<float>(d));
            Dropout              key;
            if (dropped) {
                key.p          = 0.2f;
                key.seed       = 77;
                key.site       = dropout_site(1, DropoutKind::attention_probs);
                key.batch      = b;
                key.offset     = 2;
            }
            Tensor              qkv  = random_f32({S * b, whole.row_stride}, 7100 + cp, -2.0f, 2.0f);
            Tensor              dout = random_f32({S * b, nq * d}, 7101 + cp);
            std::vector<double> ref_out, ref_lse, ref_dqkv, q = values(qkv), dov = values(dout);
            attention_reference(q, whole, scale, ref_out, ref_lse, &dov, &ref_dqkv, key);

            auto positions = [&](int64_t r) { return SeqPositions{r * chunk, chunk, (2 * cp - 1 - r) * chunk}; };
            // Rank r's rows of a whole-sequence (S b, width) tensor, columns [c0, c0 + w).
            auto rows_of = [&](const Tensor & t, int64_t r, int64_t c0, int64_t w) {
                Tensor        out = empty({local * b, w});
                const int64_t width = t.size(1);
                for (int64_t i = 0; i < local; ++i) {
                    for (int64_t bi = 0; bi < b; ++bi) {
                        const float * src = t.data<float>() + (positions(r)(i) * b + bi) * width + c0;
                        std::copy(src, src + w, out.data<float>() + (i * b + bi) * w);
                    }
                }
                return out;
            };
            std::vector<double> got_dkv(static_cast<size_t>(S * b * 2 * nkv * d), 0.0);   // whole-sequence dK | dV
            for (int64_t r = 0; r < cp; ++r) {
                AttentionShape mine = whole;
                mine.s = local;
                mine.row_stride = nq * d;   // Q alone
                mine.s_kv = local;
                mine.kv_row_stride = 2 * nkv * d;
                mine.k_col = 0;
                mine.v_col = nkv * d;
                mine.q_pos = positions(r);
                Tensor q_r = rows_of(qkv, r, 0, nq * d), dout_r = rows_of(dout, r, 0, nq * d);
                Tensor out = empty({local * b, nq * d}), lse = empty({b * nq * local});
                Tensor part = empty({local * b, nq * d}), part_lse = empty({b * nq * local});
                std::vector<Tensor> kvs;
                for (int64_t p = 0; p < cp; ++p) kvs.push_back(rows_of(qkv, p, nq * d, 2 * nkv * d));
                for (int64_t step = 0; step < cp; ++step) {   // the ring's order: own block first
                    const int64_t p = (r - step + cp) % cp;
                    mine.k_pos      = positions(p);
                    if (step == 0) {
                        ops().attention_forward(stream(), q_r, kvs[p], out, lse, mine, scale, key);
                    } else {
                        ops().attention_forward(stream(), q_r, kvs[p], part, part_lse, mine, scale, key);
                        ops().attention_merge(stream(), out, lse, part, part_lse, mine);
                    }
                }
                Tensor dq = empty({local * b, nq * d});
                for (int64_t step = 0; step < cp; ++step) {
                    const int64_t p = (r - step + cp) % cp;
                    mine.k_pos      = positions(p);
                    // The first block's dK, dV are assigned over a random fill, the later ones added to zeros.
                    Tensor dkv = random_f32({local * b, 2 * nkv * d}, 7102, 5.0f, 6.0f);
                    if (step > 0) ops().fill_zero(stream(), dkv);
                    ops().attention_backward(stream(), q_r, kvs[p], out, dout_r, lse, dq, dkv, mine, scale, key,
                                             /*accumulate=*/step > 0);
                    synchronize();
                    for (int64_t i = 0; i < local; ++i) {
                        for (int64_t bi = 0; bi < b; ++bi) {
                            for (int64_t c = 0; c < 2 * nkv * d; ++c) {
                                got_dkv[static_cast<size_t>((positions(p)(i) * b + bi) * 2 * nkv * d + c)] +=
                                    dkv.data<float>()[(i * b + bi) * 2 * nkv * d + c];
                            }
                        }
                    }
                }
                synchronize();
                std::vector<double> want_out, want_lse, want_dq;
                for (int64_t i = 0; i < local; ++i) {
                    for (int64_t bi = 0; bi < b; ++bi) {
                        const int64_t g = positions(r)(i) * b + bi;
                        for (int64_t c = 0; c < nq * d; ++c) {
                            want_out.push_back(ref_out[static_cast<size_t>(g * nq * d + c)]);
                            want_dq.push_back(ref_dqkv[static_cast<size_t>(g * whole.row_stride + c)]);
                        }
                    }
                }
                for (int64_t bh = 0; bh < b * nq; ++bh) {
                    for (int64_t i = 0; i < local; ++i) want_lse.push_back(ref_lse[static_cast<size_t>(bh * S + positions(r)(i))]);
                }
                EXPECT_TRUE(close_to_max(name("cp attention out", static_cast<int>(r)), out.data<float>(), want_out, kAttentionTol));
                EXPECT_TRUE(close(name("cp attention lse", static_cast<int>(r)), lse, want_lse, kAttentionTol, 1.0));
                EXPECT_TRUE(close_to_max(name("cp attention dq", static_cast<int>(r)), dq.data<float>(), want_dq, kAttentionBwTol));
            }
            std::vector<double> want_dkv;
            std::vector<float>  got;
            for (int64_t g = 0; g < S * b; ++g) {
                for (int64_t c = 0; c < 2 * nkv * d; ++c) {
                    want_dkv.push_back(ref_dqkv[static_cast<size_t>(g * whole.row_stride + nq * d + c)]);
                    got.push_back(static_cast<float>(got_dkv[static_cast<size_t>(g * 2 * nkv * d + c)]));
                }
            }
            EXPECT_TRUE(close_to_max("cp attention dk dv", got.data(), want_dkv, kAttentionBwTol));
        }
    }
}

TEST(OpsCrossEntropy, ForwardAndBackwardWithPaddingAndOtherRanksLabels) {
    const int64_t s = 3, b = 2, n = s * b;
    int           variant = 0;
    for (auto [vocab, stride] : {std::pair<int64_t, int64_t>{37, 48}, {64, 64}}) {
        SCOPED_TRACE("vocab " + std::to_string(vocab) + " of " + std::to_string(stride));
        Tensor               logits  = ce_logits(n, stride, vocab, 6000 + variant);
        Tensor               logits0 = clone(logits);
        Rng                  rng(6001 + variant);
        std::vector<int32_t> label_values(static_cast<size_t>(n));
        for (int32_t & l : label_values) l = rng.below(vocab);
        label_values[0] = static_cast<int32_t>(vocab - 1);
        Tensor labels   = int_tensor({b, s}, label_values);
        Tensor loss = empty({n}), lse = empty({n});
        ops().cross_entropy_forward(stream(), logits, labels, loss, lse, vocab);
        synchronize();
        std::vector<double> ref_lse = logsumexp_rows(logits0, vocab), ref_loss(static_cast<size_t>(n));
        for (int64_t r = 0; r < n; ++r) {
            ref_loss[static_cast<size_t>(r)] =
                ref_lse[static_cast<size_t>(r)] - logits0.data<float>()[r * stride + label_of(labels, r, b, s)];
        }
        EXPECT_TRUE(close(name("cross_entropy lse", variant), lse, ref_lse, kCrossEntropyTol, 1.0));
        EXPECT_TRUE(close(name("cross_entropy loss", variant), loss, ref_loss, kCrossEntropyTol, 1.0));
        EXPECT_TRUE(same_bits("forward leaves the logits", logits.data_ptr(), logits0.data_ptr(), logits.nbytes()));

        // Backward in place, from the forward's lse; one row's label is on another rank (-1: no one-hot term),
        // and one row has no loss gradient.
        label_values[3]        = -1;
        Tensor bw_labels       = int_tensor({b, s}, label_values);
        Tensor dloss           = random_f32({n}, 6002 + variant, 0.5f, 1.5f);
        dloss.data<float>()[4] = 0.0f;
        std::vector<double> ref_grad(static_cast<size_t>(n * stride), 0.0);
        for (int64_t r = 0; r < n; ++r) {
            const int32_t label = label_of(bw_labels, r, b, s);
            for (int64_t v = 0; v < vocab; ++v) {
                const double p = std::exp(logits0.data<float>()[r * stride + v] - ref_lse[static_cast<size_t>(r)]);
                ref_grad[static_cast<size_t>(r * stride + v)] = (p - (v == label ? 1.0 : 0.0)) * dloss.data<float>()[r];
            }
        }
        ops().cross_entropy_backward(stream(), logits, bw_labels, lse, dloss, vocab);
        synchronize();
        EXPECT_TRUE(close(name("cross_entropy dlogits", variant), logits, ref_grad, kCrossEntropyTol, 1e-3));
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t v = vocab; v < stride; ++v) {
                EXPECT_EQ(std::bit_cast<uint32_t>(logits.data<float>()[r * stride + v]), 0u)
                    << "padding column " << v << " of row " << r << " is not exactly 0";
            }
        }
        ++variant;
    }
}

TEST(OpsCrossEntropy, VocabularyParallelPieces) {
    const int64_t        s = 4, b = 3, n = s * b, stride = 56, valid = 41;   // valid < stride: a shard's padding
    Tensor               logits = ce_logits(n, stride, valid, 6100);
    Tensor               max = empty({n}), sum = empty({n}), target = empty({n});
    std::vector<int32_t> label_values(static_cast<size_t>(n));
    Rng                  rng(6101);
    for (int32_t & l : label_values) l = rng.below(valid);
    label_values[1] = label_values[6] = -1;   // on another rank's shard: the logit counts 0 here
    Tensor labels                     = int_tensor({b, s}, label_values);

    ops().row_max(stream(), logits, valid, max);
    ops().row_sum_exp(stream(), logits, max, valid, sum);
    ops().label_logit(stream(), logits, labels, target);
    synchronize();
    std::vector<double> ref_max(static_cast<size_t>(n)), ref_sum(ref_max.size()), ref_target(ref_max.size());
    for (int64_t r = 0; r < n; ++r) {
        const float * row = logits.data<float>() + r * stride;
        double        mx  = -std::numeric_limits<double>::infinity();
        for (int64_t v = 0; v < valid; ++v) mx = std::max<double>(mx, row[v]);
        double e = 0;   // around the op's own max (exact: the max of the row), as the op defines the sum
        for (int64_t v = 0; v < valid; ++v) e += std::exp(static_cast<double>(row[v]) - max.data<float>()[r]);
        const int32_t label                = label_of(labels, r, b, s);
        ref_max[static_cast<size_t>(r)]    = mx;
        ref_sum[static_cast<size_t>(r)]    = e;
        ref_target[static_cast<size_t>(r)] = label >= 0 ? row[label] : 0.0;
    }
    EXPECT_TRUE(exact("row_max", max, ref_max));
    EXPECT_TRUE(close("row_sum_exp", sum, ref_sum, 1e-6, 0.0));
    EXPECT_TRUE(exact("label_logit", target, ref_target));

    // lse = max + log(sum), loss = lse - target, on arbitrary rows.
    Tensor              m2 = random_f32({n}, 6102, -3.0f, 3.0f), s2 = random_f32({n}, 6103, 0.5f, 50.0f);
    Tensor              t2 = random_f32({n}, 6104, -3.0f, 3.0f), lse = empty({n}), loss = empty({n});
    std::vector<double> ref_lse(static_cast<size_t>(n)), ref_loss(ref_lse.size());
    for (int64_t r = 0; r < n; ++r) {
        ref_lse[static_cast<size_t>(r)] =
            static_cast<double>(m2.data<float>()[r]) + std::log(static_cast<double>(s2.data<float>()[r]));
        ref_loss[static_cast<size_t>(r)] = ref_lse[static_cast<size_t>(r)] - t2.data<float>()[r];
    }
    ops().lse_and_loss(stream(), m2, s2, t2, lse, loss);
    synchronize();
    EXPECT_TRUE(close("lse_and_loss lse", lse, ref_lse, 1e-6, 1.0));
    EXPECT_TRUE(close("lse_and_loss loss", loss, ref_loss, 1e-6, 1.0));
}

TEST(OpsCrossEntropy, LossGradReadsTheMaskInRowOrder) {
    const int64_t b = 3, s = 5;
    Tensor        mask    = random_f32({b, s}, 6200, 0.0f, 1.0f);
    mask.data<float>()[2] = 0.0f;
    mask.data<float>()[7] = 1.0f;
    const double scale    = 1.0 / 37.0;
    Tensor       dloss    = empty({s * b});
    ops().loss_grad(stream(), mask, scale, dloss);
    synchronize();
    std::vector<double> ref(static_cast<size_t>(s * b));
    for (int64_t si = 0; si < s; ++si) {
        for (int64_t bi = 0; bi < b; ++bi) {
            ref[static_cast<size_t>(si * b + bi)] = static_cast<double>(mask.data<float>()[bi * s + si]) * scale;
        }
    }
    EXPECT_TRUE(exact("loss_grad", dloss, ref));
}

// ---------------------------------------------------------------------------------------------------
// Data movement and reductions

namespace {

// f32 values over many binades (f16 subnormals to beyond f16's range), both signs, exact bf16 and f16
// ties, and the special values.
std::vector<float> conversion_inputs(size_t n, uint64_t seed) {
    Rng                rng(seed);
    std::vector<float> v(n);
    for (size_t i = 0; i < n; ++i) {
        const double mantissa = 1.0 + rng.unit();
        const int    exponent = static_cast<int>(rng.below(40)) - 26;   // 2^-26 .. 2^13
        float        x        = static_cast<float>(std::ldexp(mantissa, exponent));
        if (i % 7 == 3) {   // a bf16 tie: the low 16 bits exactly half way
            x = std::bit_cast<float>((std::bit_cast<uint32_t>(x) & 0xffff0000u) | 0x8000u);
        } else if (i % 7 == 5) {   // an f16 tie (for normal f16 values: 13 dropped bits, half way)
            x = std::bit_cast<float>((std::bit_cast<uint32_t>(x) & 0xffffe000u) | 0x1000u);
        }
        v[i] = (rng.next() & 1) ? -x : x;
    }
    const float specials[] = {0.0f,
                              -0.0f,
                              std::numeric_limits<float>::infinity(),
                              -std::numeric_limits<float>::infinity(),
                              std::numeric_limits<float>::quiet_NaN(),
                              65504.0f,
                              65519.0f,
                              65520.0f,
                              70000.0f,
                              -1e6f,
                              1e30f,
                              0x1p-24f,
                              0x1p-25f,
                              0x1.8p-25f};
    for (size_t i = 0; i < std::size(specials) && i < n; ++i) v[i * 101 % n] = specials[i];
    return v;
}

double round_to(DType dtype, double x) {
    return dtype == DType::bf16  ? round_bf16(x)
           : dtype == DType::f16 ? round_f16(x)
                                 : static_cast<double>(static_cast<float>(x));
}

::testing::AssertionResult nearest_values(const std::string & what, const Tensor & src, const Tensor & dst) {
    for (int64_t i = 0; i < src.numel(); ++i) {
        const double x = element(src, i), got = element(dst, i), expected = round_to(dst.dtype(), x);
        const bool   ok =
            std::isnan(x) ? std::isnan(got) : (got == expected && std::signbit(got) == std::signbit(expected));
        if (!ok) {
            return ::testing::AssertionFailure()
                   << what << ": element " << i << " = " << x << " became " << got << ", expected " << expected;
        }
    }
    return ::testing::AssertionSuccess();
}

}  // namespace

TEST(OpsData, ConvertBetweenF32Bf16F16RoundsToNearestEven) {
    const size_t       n   = 70001;   // over two chunks of 2^15 and a tail
    std::vector<float> in  = conversion_inputs(n, 7000);
    Tensor             f32 = empty({static_cast<int64_t>(n)});
    std::copy(in.begin(), in.end(), f32.data<float>());
    const DType dtypes[] = {DType::f32, DType::bf16, DType::f16};
    // Sources of each dtype: the f32 values, and their bf16 and f16 conversions as the op gives them (each
    // checked first, from f32).
    Tensor sources[3] = {f32, empty({static_cast<int64_t>(n)}, DType::bf16),
                         empty({static_cast<int64_t>(n)}, DType::f16)};
    for (int i = 1; i < 3; ++i) {
        ops().convert(stream(), f32, sources[i]);
        synchronize();
        ASSERT_TRUE(nearest_values(std::string("float32 -> ") + dtype_name(dtypes[i]), f32, sources[i]));
    }
    for (int from = 0; from < 3; ++from) {
        for (int to = 0; to < 3; ++to) {
            Tensor dst = empty({static_cast<int64_t>(n)}, dtypes[to]);
            ops().convert(stream(), sources[from], dst);
            synchronize();
            EXPECT_TRUE(nearest_values(std::string(dtype_name(dtypes[from])) + " -> " + dtype_name(dtypes[to]),
                                       sources[from], dst));
            if (from == to) {
                EXPECT_TRUE(
                    same_bits("convert to the same dtype", dst.data_ptr(), sources[from].data_ptr(), dst.nbytes()));
            }
        }
    }
}

TEST(OpsData, RoundToBf16) {
    const size_t       n  = 40000;
    std::vector<float> in = conversion_inputs(n, 7100);
    Tensor             x = empty({static_cast<int64_t>(n)}), x_bf16 = empty({static_cast<int64_t>(n)}, DType::bf16);
    std::copy(in.begin(), in.end(), x.data<float>());
    ops().round_to_bf16(stream(), x, x_bf16);
    synchronize();
    for (size_t i = 0; i < n; ++i) {
        const double expected = round_bf16(in[i]), got = x.data<float>()[i],
                     bits = element(x_bf16, static_cast<int64_t>(i));
        if (std::isnan(in[i])) {
            EXPECT_TRUE(std::isnan(got) && std::isnan(bits)) << i;
            continue;
        }
        ASSERT_EQ(got, expected) << "x[" << i << "] = " << in[i] << " rounded";
        ASSERT_EQ(std::signbit(got), std::signbit(expected)) << i;
        ASSERT_EQ(std::bit_cast<uint32_t>(x.data<float>()[i]),
                  static_cast<uint32_t>(static_cast<const uint16_t *>(x_bf16.data_ptr())[i]) << 16)
            << "x and x_bf16 hold the same value at " << i;
    }
}

// A block of columns between two row-strided layouts, f32 and bf16; the other columns are untouched;
// a block past either tensor's width is refused on the calling thread.
TEST(OpsData, CopyColumnsMovesABlockBetweenRowStridedLayouts) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
        Tensor src = random_f32({5, 12}, 91), dst = random_f32({5, 7}, 92);
        Tensor src_d = empty({5, 12}, dtype), dst_d = empty({5, 7}, dtype), back = empty({5, 7});
        ops().convert(stream(), src, src_d);
        ops().convert(stream(), dst, dst_d);
        ops().copy_columns(stream(), src_d, 6, dst_d, 2, 4);
        ops().convert(stream(), dst_d, back);
        Tensor src_r = empty({5, 12}), dst_r = empty({5, 7}), dst_rounded = empty({5, 7}, dtype);
        ops().convert(stream(), src_d, src_r);
        ops().convert(stream(), dst, dst_rounded);   // the destination's values before the copy, in its dtype
        ops().convert(stream(), dst_rounded, dst_r);
        synchronize();
        for (int64_t r = 0; r < 5; ++r) {
            for (int64_t c = 0; c < 7; ++c) {
                const bool  moved = c >= 2 && c < 6;
                const float want  = moved ? src_r.data<float>()[r * 12 + 6 + c - 2] : dst_r.data<float>()[r * 7 + c];
                EXPECT_EQ(back.data<float>()[r * 7 + c], want) << dtype_name(dtype) << " row " << r << " column " << c;
            }
        }
        EXPECT_THROW(ops().copy_columns(stream(), src_d, 9, dst_d, 0, 4), Error);
        EXPECT_THROW(ops().copy_columns(stream(), src_d, 0, dst_d, 4, 4), Error);
    }
}

TEST(OpsData, CopyFillZeroScale) {
    // copy: f32, bf16 and i32, into device and pinned host memory, and into a view inside a larger buffer.
    for (DType dtype : {DType::f32, DType::bf16, DType::i32}) {
        for (MemoryKind kind : {MemoryKind::device, MemoryKind::pinned_host}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + " into " + memory_kind_name(kind));
            Tensor typed = dtype == DType::i32 ? empty({1001}, DType::i32) : random_tensor({1001}, dtype, 7200);
            if (dtype == DType::i32) {
                for (int64_t i = 0; i < 1001; ++i) typed.data<int32_t>()[i] = static_cast<int32_t>(i * 7919 - 3000000);
            }
            Tensor buffer = Tensor::empty({1011}, dtype, dev(), TensorOptions{kind, kDefaultPool});
            std::memset(buffer.data_ptr(), 0xab, buffer.nbytes());
            Tensor dst = buffer.slice(5, {1001});
            ops().copy(stream(), typed, dst);
            synchronize();
            EXPECT_TRUE(same_bits("copy", dst.data_ptr(), typed.data_ptr(), typed.nbytes()));
            const auto * bytes = static_cast<const unsigned char *>(buffer.data_ptr());
            const size_t esize = dtype_size(dtype);
            for (size_t i = 0; i < 5 * esize; ++i) EXPECT_EQ(bytes[i], 0xab) << "before the view";
            for (size_t i = 1006 * esize; i < 1011 * esize; ++i) EXPECT_EQ(bytes[i], 0xab) << "after the view";
            // Back from that memory into a fresh device tensor.
            Tensor back = empty({1001}, dtype);
            ops().copy(stream(), dst, back);
            synchronize();
            EXPECT_TRUE(same_bits("copy back", back.data_ptr(), typed.data_ptr(), typed.nbytes()));
        }
    }

    // fill_zero: exactly the view's bytes.
    for (DType dtype : {DType::f32, DType::bf16}) {
        Tensor buffer = empty({4 * 1000}, dtype);
        std::memset(buffer.data_ptr(), 0x5c, buffer.nbytes());
        Tensor view = buffer.slice(1000, {2, 1000});
        ops().fill_zero(stream(), view);
        synchronize();
        const auto * bytes = static_cast<const unsigned char *>(buffer.data_ptr());
        const size_t e     = dtype_size(dtype);
        for (size_t i = 0; i < 4000 * e; ++i) {
            ASSERT_EQ(bytes[i], (i >= 1000 * e && i < 3000 * e) ? 0 : 0x5c) << dtype_name(dtype) << " byte " << i;
        }
    }

    // scale: one f32 multiplication (the product of two floats is exact in double); over chunks of 2^15.
    Tensor              t      = random_f32({70003}, 7300, -3.0f, 3.0f);
    std::vector<double> ref    = values(t);
    const float         factor = 0.3728f;
    for (double & v : ref) v *= static_cast<double>(factor);
    ops().scale(stream(), t, factor);
    synchronize();
    EXPECT_TRUE(exact("scale", t, ref));

    // scale of 16-bit gradient buffers (--grad-reduce-in-bf16, --fp16): the f32 product of the widened value,
    // rounded once to the tensor's dtype.
    for (DType dtype : {DType::bf16, DType::f16}) {
        Tensor half = random_tensor({70003}, dtype, 7301, -3.0f, 3.0f);
        std::vector<double> expected(static_cast<size_t>(half.numel()));
        for (int64_t i = 0; i < half.numel(); ++i) {
            expected[static_cast<size_t>(i)] = round_to(dtype, static_cast<float>(element(half, i)) * factor);
        }
        ops().scale(stream(), half, factor);
        synchronize();
        for (int64_t i = 0; i < half.numel(); ++i) {
            ASSERT_EQ(element(half, i), expected[static_cast<size_t>(i)]) << dtype_name(dtype) << " scale, element " << i;
        }
    }
}

namespace {

constexpr int64_t kSumOfSquaresN = 3 * (int64_t{1} << 16) + 12345;   // 4 chunks of 2^16, the last partial

Tensor sum_of_squares_input() { return random_f32({kSumOfSquaresN}, 7400, -2.0f, 2.0f); }

// The op's (hi, lo) for the input above.
std::pair<float, float> sum_of_squares_pair() {
    Tensor x = sum_of_squares_input(), out = empty({2});
    ops().sum_of_squares(stream(), x, out);
    synchronize();
    return {out.data<float>()[0], out.data<float>()[1]};
}

}  // namespace

TEST(OpsSumOfSquares, HiPlusLoIsTheDoubleSum) {
    Tensor x   = sum_of_squares_input();
    double ref = 0;
    for (int64_t i = 0; i < x.numel(); ++i) ref += static_cast<double>(x.data<float>()[i]) * x.data<float>()[i];
    auto [hi, lo] = sum_of_squares_pair();
    EXPECT_LE(std::fabs(static_cast<double>(hi) + lo - ref), kSumOfSquaresTol * ref)
        << hi << " + " << lo << " vs " << ref;
    EXPECT_LE(std::fabs(static_cast<double>(hi) - ref), kF32Add * ref) << "hi is the sum rounded to f32";
    EXPECT_LE(std::fabs(lo), 0x1p-23 * std::fabs(hi)) << "lo is the rest";

    Tensor small = random_f32({5}, 7401), out = empty({2});
    double r5 = 0;
    for (int64_t i = 0; i < 5; ++i) r5 += static_cast<double>(small.data<float>()[i]) * small.data<float>()[i];
    ops().sum_of_squares(stream(), small, out);
    synchronize();
    EXPECT_LE(std::fabs(static_cast<double>(out.data<float>()[0]) + out.data<float>()[1] - r5), kSumOfSquaresTol * r5);
}

// Run in a child process by SameBitsAtOneAndTwoThreads (the thread budget is fixed per process).
TEST(OpsSumOfSquares, ChildPrintsItsBits) {
    if (!std::getenv("LOOM_TEST_SUM_OF_SQUARES_CHILD")) {
        GTEST_SKIP() << "a helper of OpsSumOfSquares.SameBitsAtOneAndTwoThreads, run in its child processes";
    }
    auto [hi, lo] = sum_of_squares_pair();
    std::printf("sum_of_squares threads %d bits %08" PRIx32 " %08" PRIx32 "\n", num_threads(),
                std::bit_cast<uint32_t>(hi), std::bit_cast<uint32_t>(lo));
}

TEST(OpsSumOfSquares, SameBitsAtOneAndTwoThreads) {
    char          exe[4096];
    const ssize_t len = readlink("/proc/self/exe", exe, sizeof(exe) - 1);
    ASSERT_GT(len, 0);
    exe[len]              = '\0';
    auto [hi, lo]         = sum_of_squares_pair();
    const uint32_t here[] = {std::bit_cast<uint32_t>(hi), std::bit_cast<uint32_t>(lo)};
    for (int threads : {1, 2}) {
        // The child runs the one helper test whatever sharding or report file the parent was given.
        const std::string command =
            "env -u GTEST_SHARD_INDEX -u GTEST_TOTAL_SHARDS -u GTEST_OUTPUT -u GTEST_FILTER "
            "LOOM_NUM_THREADS=" +
            std::to_string(threads) + " LOOM_TEST_SUM_OF_SQUARES_CHILD=1 '" + exe +
            "' --gtest_filter=OpsSumOfSquares.ChildPrintsItsBits 2>&1";
        FILE * pipe = popen(command.c_str(), "r");
        ASSERT_NE(pipe, nullptr) << command;
        char     line[512];
        int      child_threads = -1;
        uint32_t bits[2]       = {0, 0};
        bool     found         = false;
        while (std::fgets(line, sizeof(line), pipe)) {
            if (std::sscanf(line, "sum_of_squares threads %d bits %" SCNx32 " %" SCNx32, &child_threads, &bits[0],
                            &bits[1]) == 3) {
                found = true;
            }
        }
        EXPECT_EQ(pclose(pipe), 0) << command;
        ASSERT_TRUE(found) << command;
        EXPECT_EQ(child_threads, threads);
        EXPECT_EQ(bits[0], here[0]) << "hi at " << threads << " threads vs " << num_threads() << " here";
        EXPECT_EQ(bits[1], here[1]) << "lo at " << threads << " threads vs " << num_threads() << " here";
    }
}

// ---------------------------------------------------------------------------------------------------
// AdamW

TEST(OpsAdamW, FiveStepsAgainstDoubleReferenceWithBf16F32AndNoOutput) {
    const AdamStep hyper{3e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 0};
    const int      steps = 5;
    // A tail only; two chunks of 2^14 and more; the non-temporal output path (2^19 elements and more).
    for (int64_t n : {int64_t{7}, int64_t{40007}, (int64_t{1} << 19) + 5}) {
        SCOPED_TRACE("n = " + std::to_string(n));
        const Tensor        p0 = random_f32({n}, 8000, -1.0f, 1.0f);
        std::vector<Tensor> grads;
        for (int t = 0; t < steps; ++t) grads.push_back(random_f32({n}, 8001 + t));

        // The update of core/host_adam.h in double (with the f32 hyper-parameters' values).
        const double        b1 = hyper.beta1, b2 = hyper.beta2, lr = hyper.lr, eps = hyper.eps, wd = hyper.weight_decay;
        std::vector<double> p = values(p0), m(p.size(), 0.0), v(p.size(), 0.0), m_mag(p.size(), 0.0);
        for (int t = 1; t <= steps; ++t) {
            const double  bc1 = 1.0 - std::pow(b1, t), bc2 = 1.0 - std::pow(b2, t);
            const float * g = grads[static_cast<size_t>(t - 1)].data<float>();
            for (size_t i = 0; i < p.size(); ++i) {
                m[i]     = b1 * m[i] + (1.0 - b1) * g[i];
                m_mag[i] = b1 * m_mag[i] + (1.0 - b1) * std::fabs(g[i]);
                v[i]     = b2 * v[i] + (1.0 - b2) * g[i] * g[i];
                p[i]     = p[i] * (1.0 - lr * wd) - (lr / bc1) * m[i] / (std::sqrt(v[i]) / std::sqrt(bc2) + eps);
            }
        }

        struct Output {
            const char * name;
            bool         defined;
            DType        dtype;
        };
        Tensor first_master;
        for (const Output & output : {Output{"no out", false, DType::f32}, Output{"bf16 out", true, DType::bf16},
                                      Output{"f32 out", true, DType::f32}}) {
            SCOPED_TRACE(output.name);
            const bool  with_out  = output.defined;
            const DType out_dtype = output.dtype;
            Tensor      master = clone(p0), mt = Tensor::zeros({n}, DType::f32, dev()),
                   vt  = Tensor::zeros({n}, DType::f32, dev());
            Tensor out = with_out ? empty({n}, out_dtype) : Tensor();
            for (int t = 1; t <= steps; ++t) {
                AdamStep step = hyper;
                step.step     = t;
                ops().adamw(stream(), master, grads[static_cast<size_t>(t - 1)], mt, vt, out, step);
            }
            synchronize();
            EXPECT_TRUE(within("adamw p", master.data<float>(), p, 1.0,
                               [&](size_t i) { return steps * (0x1p-21 * std::fabs(p[i]) + 0x1p-20 * lr); }));
            EXPECT_TRUE(close_to_magnitude("adamw m", mt, m, m_mag, 1e-6));
            EXPECT_TRUE(close("adamw v", vt, v, 1e-6, 0.0));
            if (with_out && out_dtype == DType::f32) {
                EXPECT_TRUE(same_bits("f32 out is the master", out.data_ptr(), master.data_ptr(), master.nbytes()));
            } else if (with_out) {
                const uint16_t * bits = static_cast<const uint16_t *>(out.data_ptr());
                for (int64_t i = 0; i < n; ++i) {
                    ASSERT_EQ(bf16_value(bits[i]), round_bf16(master.data<float>()[i])) << "bf16 out " << i;
                }
            }
            if (!first_master.defined()) {
                first_master = master;
            } else {
                EXPECT_TRUE(same_bits("master whatever the output", master.data_ptr(), first_master.data_ptr(),
                                      master.nbytes()));
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------------
// ---- bf16 activations. Each op given bf16 activations computes what its f32 kernel computes from the same
// values and rounds each stored result once (nearest, ties to even): its bf16 outputs are exactly the
// rounded f32 outputs of the op on the widened inputs, and its f32 outputs (statistics, losses, parameter
// gradients) the same bits. Exact, for every op below (the references are the backend's own f32 ops, each
// checked against double above).

namespace {

// Random bf16 activations and the same values in f32.
struct Bf16Pair {
    Tensor f, h;
};
Bf16Pair bf16_pair(const Shape & shape, uint64_t seed, float lo = -1.0f, float hi = 1.0f) {
    Bf16Pair p{empty(shape), random_tensor(shape, DType::bf16, seed, lo, hi)};
    convert(p.h.data_ptr(), DType::bf16, p.f.data_ptr(), DType::f32, static_cast<size_t>(p.h.numel()));
    return p;
}
Bf16Pair outputs(const Shape & shape) { return {empty(shape), empty(shape, DType::bf16)}; }
Bf16Pair copy_of(const Bf16Pair & p) { return {clone(p.f), clone(p.h)}; }

// The nearest bf16 of an f32 value, ties to even (NaN is not expected here).
uint16_t nearest_bf16(float v) {
    const uint32_t u = std::bit_cast<uint32_t>(v);
    return static_cast<uint16_t>((u + 0x7fffu + ((u >> 16) & 1u)) >> 16);
}

// got (bf16) holds the nearest bf16 of each element of want (f32).
void expect_rounded(const std::string & what, const Tensor & want, const Tensor & got) {
    synchronize();
    ASSERT_EQ(want.numel(), got.numel()) << what;
    ASSERT_EQ(got.dtype(), DType::bf16) << what;
    const float *    w   = want.data<float>();
    const uint16_t * g   = static_cast<const uint16_t *>(got.data_ptr());
    int64_t          bad = 0, first = -1;
    for (int64_t i = 0; i < want.numel(); ++i) {
        if (g[i] != nearest_bf16(w[i]) && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0) << what << ": " << bad << " of " << want.numel() << " differ, the first at " << first << " ("
                      << (first >= 0 ? bf16_value(g[first]) : 0.0) << " for " << (first >= 0 ? w[first] : 0.0f) << ")";
}
void expect_rounded(const std::string & what, const Bf16Pair & p) { expect_rounded(what, p.f, p.h); }

void expect_same_f32(const std::string & what, const Tensor & want, const Tensor & got) {
    synchronize();
    EXPECT_TRUE(same_bits(what, want.data_ptr(), got.data_ptr(), want.nbytes())) << what;
}

}  // namespace

TEST(OpsBf16Activations, GemmAndGemmBiasRoundTheF32AccumulatorOnce) {
    for (bool ta : {false, true}) {
        const int64_t m = 37, n = 29, k = 70;
        Bf16Pair a = bf16_pair(ta ? Shape{k, m} : Shape{m, k}, 1), b = bf16_pair({n, k}, 2);
        Tensor   bias = random_f32({n}, 3);
        Tensor   c32 = empty({m, n}), c16 = empty({m, n}, DType::bf16);
        // Both read bf16 operands; only the output's dtype differs.
        ops().gemm(stream(), a.h, ta, b.h, true, c32);
        ops().gemm(stream(), a.h, ta, b.h, true, c16);
        expect_rounded(std::string("gemm") + (ta ? " trans_a" : ""), c32, c16);
        ops().gemm_bias(stream(), a.h, ta, b.h, true, c32, bias);
        ops().gemm_bias(stream(), a.h, ta, b.h, true, c16, bias);
        expect_rounded(std::string("gemm_bias") + (ta ? " trans_a" : ""), c32, c16);
    }
}

TEST(OpsBf16Activations, NormsForwardBackwardWithAndWithoutResidual) {
    const int64_t n = 19, h = 72;
    Tensor        gamma = random_f32({h}, 10, 0.5f, 1.5f), beta = random_f32({h}, 11);
    for (bool rms : {false, true}) {
        const std::string name = rms ? "rmsnorm" : "layernorm";
        Bf16Pair x = bf16_pair({n, h}, 12), r = bf16_pair({n, h}, 13), y = outputs({n, h});
        Tensor   mean32 = empty({n}), rstd32 = empty({n}), mean16 = empty({n}), rstd16 = empty({n});
        auto forward = [&](const Tensor & xx, const Tensor & res, const Tensor & yy, const Tensor & mean, const Tensor & rstd) {
            if (rms) {
                ops().rmsnorm_forward(stream(), xx, res, gamma, yy, rstd, 1e-5f);
            } else {
                ops().layernorm_forward(stream(), xx, res, gamma, beta, yy, mean, rstd, 1e-5f);
            }
        };
        forward(x.f, Tensor(), y.f, mean32, rstd32);
        forward(x.h, Tensor(), y.h, mean16, rstd16);
        expect_rounded(name + " y", y);
        expect_same_f32(name + " rstd", rstd32, rstd16);
        if (!rms) expect_same_f32(name + " mean", mean32, mean16);

        // With a residual: x += r is stored rounded, and the norm reads the stored sum.
        Bf16Pair xs = copy_of(x);
        ops().add_inplace(stream(), xs.f, r.f);
        Tensor sum16 = empty({n, h}, DType::bf16);
        ops().convert(stream(), xs.f, sum16);                       // round(x + r)
        ops().convert(stream(), sum16, xs.f);                       // ... read as f32
        forward(xs.f, Tensor(), y.f, mean32, rstd32);
        Bf16Pair xr = copy_of(x);
        forward(xr.h, r.h, y.h, mean16, rstd16);
        expect_same_f32(name + " x + residual", sum16.view({n * h}), xr.h.view({n * h}));
        expect_rounded(name + " y with residual", y);
        expect_same_f32(name + " rstd with residual", rstd32, rstd16);

        Bf16Pair dy = bf16_pair({n, h}, 14), dx = outputs({n, h});
        Tensor   dg32 = random_f32({h}, 15), db32 = random_f32({h}, 16), dg16 = clone(dg32), db16 = clone(db32);
        forward(x.f, Tensor(), y.f, mean32, rstd32);
        if (rms) {
            ops().rmsnorm_backward(stream(), dy.f, x.f, gamma, rstd32, dx.f, dg32);
            ops().rmsnorm_backward(stream(), dy.h, x.h, gamma, rstd32, dx.h, dg16);
        } else {
            ops().layernorm_backward(stream(), dy.f, x.f, gamma, mean32, rstd32, dx.f, dg32, db32);
            ops().layernorm_backward(stream(), dy.h, x.h, gamma, mean32, rstd32, dx.h, dg16, db16);
            expect_same_f32(name + " dbeta", db32, db16);
        }
        expect_rounded(name + " dx", dx);
        expect_same_f32(name + " dgamma", dg32, dg16);

        // A residual path's gradient added in the same pass: in f32 the backward and then add_inplace within
        // one rounding of the terms (the compiler may fuse dx's last product with the addition); in bf16 the
        // f32 sum rounded once.
        Bf16Pair dres = bf16_pair({n, h}, 17), fused = outputs({n, h});
        Tensor   two_steps = clone(dx.f), dg = empty({h}), db = empty({h});
        ops().add_inplace(stream(), two_steps, dres.f);
        if (rms) {
            ops().rmsnorm_backward(stream(), dy.f, x.f, gamma, rstd32, fused.f, dg, dres.f);
            ops().rmsnorm_backward(stream(), dy.h, x.h, gamma, rstd32, fused.h, dg, dres.h);
        } else {
            ops().layernorm_backward(stream(), dy.f, x.f, gamma, mean32, rstd32, fused.f, dg, db, dres.f);
            ops().layernorm_backward(stream(), dy.h, x.h, gamma, mean32, rstd32, fused.h, dg, db, dres.h);
        }
        synchronize();
        int64_t far = 0;
        for (int64_t i = 0; i < n * h; ++i) {
            const double a = dx.f.data<float>()[i], r = dres.f.data<float>()[i];
            far += std::fabs(fused.f.data<float>()[i] - two_steps.data<float>()[i]) > 0x1p-22 * (std::fabs(a) + std::fabs(r));
        }
        EXPECT_EQ(far, 0) << name << " dx + dresidual in f32";
        expect_rounded(name + " dx + dresidual in bf16", fused);
    }
}

TEST(OpsBf16Activations, ElementwiseOps) {
    const int64_t n = 23, f = 40;
    Tensor        bias = random_f32({f}, 20);
    // bias_add, add_inplace, bias_backward
    Bf16Pair y = bf16_pair({n, f}, 21), x = bf16_pair({n, f}, 22);
    ops().bias_add(stream(), y.f, bias);
    ops().bias_add(stream(), y.h, bias);
    expect_rounded("bias_add", y);
    Bf16Pair y2 = bf16_pair({n, f}, 21);
    ops().add_inplace(stream(), y2.f, x.f);
    ops().add_inplace(stream(), y2.h, x.h);
    expect_rounded("add_inplace", y2);
    Tensor db32 = random_f32({f}, 23), db16 = clone(db32);
    ops().bias_backward(stream(), x.f, db32);
    ops().bias_backward(stream(), x.h, db16);
    expect_same_f32("bias_backward", db32, db16);
    // bias + GELU: the biased value is stored rounded, and gelu reads it.
    Bf16Pair pre = bf16_pair({n, f}, 24, -4.0f, 4.0f), act = outputs({n, f});
    ops().bias_gelu_forward(stream(), pre.h, bias, act.h, Tensor());
    Tensor biased = clone(pre.f);
    ops().bias_add(stream(), biased, bias);
    Tensor biased16 = empty({n, f}, DType::bf16);
    ops().convert(stream(), biased, biased16);
    expect_rounded("bias_gelu_forward x", biased, pre.h);
    ops().convert(stream(), biased16, biased);
    ops().bias_gelu_forward(stream(), biased, Tensor(), act.f, Tensor());
    expect_rounded("bias_gelu_forward y", act);
    Bf16Pair dy = bf16_pair({n, f}, 25), dx = outputs({n, f});
    Bf16Pair g  = bf16_pair({n, f}, 26, -4.0f, 4.0f);
    ops().gelu_backward(stream(), g.f, dy.f, dx.f);
    ops().gelu_backward(stream(), g.h, dy.h, dx.h);
    expect_rounded("gelu_backward", dx);
    ops().squared_relu_forward(stream(), g.f, dx.f);
    ops().squared_relu_forward(stream(), g.h, dx.h);
    expect_rounded("squared_relu_forward", dx);
    ops().squared_relu_backward(stream(), g.f, dy.f, dx.f);
    ops().squared_relu_backward(stream(), g.h, dy.h, dx.h);
    expect_rounded("squared_relu_backward", dx);
    // SwiGLU on [gate | up] (n, f) -> (n, f / 2).
    Bf16Pair half_out = outputs({n, f / 2}), half_dy = bf16_pair({n, f / 2}, 27);
    ops().swiglu_forward(stream(), g.f, half_out.f);
    ops().swiglu_forward(stream(), g.h, half_out.h);
    expect_rounded("swiglu_forward", half_out);
    ops().swiglu_backward(stream(), g.f, half_dy.f, dx.f);
    ops().swiglu_backward(stream(), g.h, half_dy.h, dx.h);
    expect_rounded("swiglu_backward", dx);
    // Rope in place (partial, on 3 of 4 heads of 8), and dropout.
    const int64_t s = 6, b = 2;
    Bf16Pair      q = bf16_pair({s * b, 32}, 28);
    ops().rope(stream(), q.f, s, b, 3, 8, 10000.0f, false, 4);
    ops().rope(stream(), q.h, s, b, 3, 8, 10000.0f, false, 4);
    expect_rounded("rope", q);
    Dropout key;
    key.p     = 0.25f;
    key.seed  = 99;
    key.site  = dropout_site(1, DropoutKind::mlp_output);
    key.batch = b;
    Bf16Pair d = bf16_pair({s * b, 32}, 29), dout = outputs({s * b, 32});
    ops().dropout(stream(), d.f, dout.f, key);
    ops().dropout(stream(), d.h, dout.h, key);
    expect_rounded("dropout", dout);
}

// The output gate's op (Ops::output_gate_forward / _backward), with both activations. By hand: x = (2, -4) with gates
// 0 and ln 3 (sigmoids 1/2 and 3/4) in columns 3 and 4 of a row of 6. Sigmoid (--attention-output-gate): y = (1, -3);
// from dy = (1, 1), dx = (1/2, 3/4) and dgate = dy x s (1 - s) = (1/2, -3/4). SiLU (the gated delta-net's gated
// norm), silu(g) = g s: y = (0, -3 ln 3), dx = (0, 3/4 ln 3) and dgate = dy x s (1 + g (1 - s)) = (1, -3 (1 + ln 3 / 4)).
// Then 23 rows of 40 gates at column 37 of rows of 90, against a double reference (2e-6 of each value's scale; f32
// rounds each product once or twice), with dx in dy's place; and in bf16 every result is the f32 op's on the same
// values, rounded once.
TEST(OpsOutputGate, HandValuesDoubleReferenceAndBf16Rounding) {
    const double ln3 = std::log(3.0);
    struct Hand {
        GateActivation act;
        double         y[2], dx[2], dg[2];
    };
    const Hand hands[] = {{GateActivation::sigmoid, {1, -3}, {0.5, 0.75}, {0.5, -0.75}},
                          {GateActivation::silu, {0, -3 * ln3}, {0, 0.75 * ln3}, {1, -3 * (1 + ln3 / 4)}}};
    for (const Hand & hand : hands) {
        const GateActivation act = hand.act;
        const std::string    name = act == GateActivation::silu ? "silu" : "sigmoid";
        Tensor x = empty({1, 2}), src = empty({1, 6}), y = empty({1, 2}), dy = empty({1, 2}), dx = empty({1, 2}), dg = empty({1, 2});
        const float hand_x[] = {2.0f, -4.0f}, hand_src[] = {9.0f, 9.0f, 9.0f, 0.0f, std::log(3.0f), 9.0f}, ones[] = {1.0f, 1.0f};
        std::copy(hand_x, hand_x + 2, x.data<float>());
        std::copy(hand_src, hand_src + 6, src.data<float>());
        std::copy(ones, ones + 2, dy.data<float>());
        ops().output_gate_forward(stream(), x, src, 3, y, act);
        ops().output_gate_backward(stream(), x, src, 3, dy, dx, dg, act);
        synchronize();
        for (int j = 0; j < 2; ++j) {
            EXPECT_NEAR(y.data<float>()[j], hand.y[j], 1e-6) << name << " y " << j;
            EXPECT_NEAR(dx.data<float>()[j], hand.dx[j], 1e-6) << name << " dx " << j;
            EXPECT_NEAR(dg.data<float>()[j], hand.dg[j], 2e-6) << name << " dgate " << j;
        }

        const int64_t n = 23, w = 40, stride = 90, col = 37;
        const Tensor  xs = random_f32({n, w}, 4701, -3.0f, 3.0f), s = random_f32({n, stride}, 4702, -6.0f, 6.0f);
        const Tensor  g  = random_f32({n, w}, 4703);
        Tensor        ys = empty({n, w}), dxs = clone(g), dgs = empty({n, w});
        ops().output_gate_forward(stream(), xs, s, col, ys, act);
        ops().output_gate_backward(stream(), xs, s, col, dxs, dxs, dgs, act);   // dx in place of dy
        synchronize();
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t j = 0; j < w; ++j) {
                const int64_t i = r * w + j;
                const double  gv = element(s, r * stride + col + j), sg = sigmoid_ref(gv), xv = element(xs, i), d = element(g, i);
                const double  a     = act == GateActivation::silu ? gv * sg : sg;
                const double  slope = act == GateActivation::silu ? sg * (1 + gv * (1 - sg)) : sg * (1 - sg);
                EXPECT_NEAR(element(ys, i), xv * a, 2e-6 * std::fabs(xv) * std::max(1.0, std::fabs(gv))) << name << " y " << i;
                EXPECT_NEAR(element(dxs, i), d * a, 2e-6 * std::fabs(d) * std::max(1.0, std::fabs(gv))) << name << " dx " << i;
                EXPECT_NEAR(element(dgs, i), d * xv * slope, 2e-6 * std::fabs(d * xv) * std::max(1.0, std::fabs(gv)))
                    << name << " dgate " << i;
            }
        }
        Bf16Pair xb = bf16_pair({n, w}, 4704, -3.0f, 3.0f), sb = bf16_pair({n, stride}, 4705, -6.0f, 6.0f);
        Bf16Pair dyb = bf16_pair({n, w}, 4706), yb = outputs({n, w}), dxb = outputs({n, w}), dgb = outputs({n, w});
        ops().output_gate_forward(stream(), xb.f, sb.f, col, yb.f, act);
        ops().output_gate_forward(stream(), xb.h, sb.h, col, yb.h, act);
        expect_rounded("output_gate_forward " + name, yb);
        ops().output_gate_backward(stream(), xb.f, sb.f, col, dyb.f, dxb.f, dgb.f, act);
        ops().output_gate_backward(stream(), xb.h, sb.h, col, dyb.h, dxb.h, dgb.h, act);
        expect_rounded("output_gate_backward dx " + name, dxb);
        expect_rounded("output_gate_backward dgate " + name, dgb);
        // The gate columns must lie inside src's rows.
        EXPECT_THROW(ops().output_gate_forward(stream(), xs, s, stride - w + 1, ys, act), Error);
    }
}

namespace {

// The gated delta rule's operands: q and v uniform in [-1, 1), each key scaled to unit length (the layer's L2
// norm does that), log decays g in [-1, 0) and write strengths beta in (0, 1).
struct DeltaRuleCase {
    DeltaRuleShape      d;
    std::vector<double> q, k, v, g, beta;   // rows (t, bi), heads within
};

DeltaRuleCase delta_rule_case(const DeltaRuleShape & d, uint64_t seed) {
    DeltaRuleCase c{d, {}, {}, {}, {}, {}};
    Rng           rng(seed);
    const int64_t n = d.s * d.b;
    for (int64_t i = 0; i < n * d.heads * d.dk; ++i) c.q.push_back(rng.uniform(-1.0f, 1.0f));
    for (int64_t i = 0; i < n * d.heads * d.dk; ++i) c.k.push_back(rng.uniform(-1.0f, 1.0f));
    for (int64_t row = 0; row < n * d.heads; ++row) {
        double norm = 0;
        for (int64_t i = 0; i < d.dk; ++i) norm += c.k[static_cast<size_t>(row * d.dk + i)] * c.k[static_cast<size_t>(row * d.dk + i)];
        for (int64_t i = 0; i < d.dk; ++i) {
            c.k[static_cast<size_t>(row * d.dk + i)] = static_cast<float>(c.k[static_cast<size_t>(row * d.dk + i)] / std::sqrt(norm));
        }
    }
    for (int64_t i = 0; i < n * d.heads * d.dv; ++i) c.v.push_back(rng.uniform(-1.0f, 1.0f));
    for (int64_t i = 0; i < n * d.heads; ++i) c.g.push_back(rng.uniform(-1.0f, 0.0f));
    for (int64_t i = 0; i < n * d.heads; ++i) c.beta.push_back(rng.uniform(0.05f, 0.95f));
    return c;
}

// The rule as Flash Linear Attention's naive recurrent reference states it, in double: o (rows (t, bi), heads).
std::vector<double> delta_rule_reference(const DeltaRuleCase & c) {
    const DeltaRuleShape & d = c.d;
    std::vector<double>    o(static_cast<size_t>(d.s * d.b * d.heads * d.dv));
    for (int64_t bi = 0; bi < d.b; ++bi) {
        for (int64_t h = 0; h < d.heads; ++h) {
            std::vector<double> S(static_cast<size_t>(d.dk * d.dv), 0.0);
            for (int64_t t = 0; t < d.s; ++t) {
                const size_t r = static_cast<size_t>((t * d.b + bi) * d.heads + h);
                const double decay = std::exp(c.g[r]);
                for (double & e : S) e *= decay;
                for (int64_t j = 0; j < d.dv; ++j) {
                    double w = 0;
                    for (int64_t i = 0; i < d.dk; ++i) w += S[static_cast<size_t>(i * d.dv + j)] * c.k[r * d.dk + i];
                    const double u = c.beta[r] * (c.v[r * d.dv + j] - w);
                    for (int64_t i = 0; i < d.dk; ++i) S[static_cast<size_t>(i * d.dv + j)] += c.k[r * d.dk + i] * u;
                }
                for (int64_t j = 0; j < d.dv; ++j) {
                    double acc = 0;
                    for (int64_t i = 0; i < d.dk; ++i) acc += S[static_cast<size_t>(i * d.dv + j)] * d.scale * c.q[r * d.dk + i];
                    o[r * d.dv + j] = acc;
                }
            }
        }
    }
    return o;
}

Tensor f32_of(const std::vector<double> & v) {
    Tensor t = empty({static_cast<int64_t>(v.size())});
    for (size_t i = 0; i < v.size(); ++i) t.data<float>()[i] = static_cast<float>(v[i]);
    return t;
}

}  // namespace

// The central differences (step 1e-3) of `loss` in each element of `at`, and their largest magnitude: what the
// delta-net ops' gradients are held to.
struct Differences {
    std::vector<double> d;
    double              largest = 0;
};
Differences central_differences(const std::vector<double> & at, const std::function<double(const std::vector<double> &)> & loss) {
    Differences out;
    out.d.resize(at.size());
    for (size_t i = 0; i < at.size(); ++i) {
        std::vector<double> up = at, down = at;
        up[i] += 1e-3;
        down[i] -= 1e-3;
        out.d[i]    = (loss(up) - loss(down)) / 2e-3;
        out.largest = std::max(out.largest, std::fabs(out.d[i]));
    }
    return out;
}

// Qwen3-Next's gated delta rule (Ops::gated_delta_rule_forward / _backward), on the CPU. The forward against the
// naive recurrence in double, within 1e-5 of the output's largest; the backward against central differences
// (step 1e-3) of the double reference's sum of o times fixed random weights, within 2e-4 of each operand's
// largest gradient. Two shapes: keys wider than values over 37 steps (three chunks of 16, the last short), and
// the reverse over 16 (exactly one chunk).
TEST(OpsDeltaRule, ForwardAgainstTheRecurrenceAndBackwardAgainstFiniteDifferences) {
    for (const DeltaRuleShape d : {DeltaRuleShape{37, 2, 2, 6, 4, 0.4f}, DeltaRuleShape{16, 1, 3, 3, 5, 0.577f}}) {
        SCOPED_TRACE("s " + std::to_string(d.s) + ", dk " + std::to_string(d.dk) + ", dv " + std::to_string(d.dv));
        DeltaRuleCase c = delta_rule_case(d, 4801 + static_cast<uint64_t>(d.s));
        // The operands as f32 values, and the reference on those same values.
        for (std::vector<double> * v : {&c.q, &c.k, &c.v, &c.g, &c.beta}) {
            for (double & e : *v) e = static_cast<float>(e);
        }
        const std::vector<double> want = delta_rule_reference(c);
        const int64_t n = d.s * d.b;
        Tensor q = f32_of(c.q).view({n, d.heads * d.dk}), k = f32_of(c.k).view({n, d.heads * d.dk});
        Tensor v = f32_of(c.v).view({n, d.heads * d.dv}), g = f32_of(c.g).view({n, d.heads}), beta = f32_of(c.beta).view({n, d.heads});
        Tensor o = empty({n, d.heads * d.dv}), ws = empty({delta_rule_workspace_elements(d)});
        ops().gated_delta_rule_forward(stream(), q, k, v, g, beta, o, ws, d);
        synchronize();
        double largest = 0;
        for (double e : want) largest = std::max(largest, std::fabs(e));
        for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(o.data<float>()[i], want[i], 1e-5 * largest) << "o " << i;

        Rng                 rng(4809);
        std::vector<double> weights(want.size());
        for (double & w : weights) w = rng.uniform(-1.0f, 1.0f);
        Tensor dout = f32_of(weights).view({n, d.heads * d.dv});
        Tensor dq = empty(q.shape()), dk = empty(k.shape()), dv = empty(v.shape()), dg = empty(g.shape()), db = empty(beta.shape());
        ops().gated_delta_rule_backward(stream(), q, k, v, g, beta, dout, dq, dk, dv, dg, db, ws, d);
        synchronize();
        auto loss = [&](const DeltaRuleCase & x) {
            const std::vector<double> out = delta_rule_reference(x);
            double                    sum = 0;
            for (size_t i = 0; i < out.size(); ++i) sum += out[i] * weights[i];
            return sum;
        };
        const std::pair<std::vector<double> DeltaRuleCase::*, const Tensor *> operands[] = {
            {&DeltaRuleCase::q, &dq}, {&DeltaRuleCase::k, &dk}, {&DeltaRuleCase::v, &dv}, {&DeltaRuleCase::g, &dg},
            {&DeltaRuleCase::beta, &db}};
        const char * names[] = {"dq", "dk", "dv", "dg", "dbeta"};
        for (size_t which = 0; which < 5; ++which) {
            std::vector<double> DeltaRuleCase::* member = operands[which].first;
            const Tensor *                       grad   = operands[which].second;
            const Differences fd = central_differences(c.*member, [&](const std::vector<double> & values) {
                DeltaRuleCase x = c;
                x.*member       = values;
                return loss(x);
            });
            for (size_t i = 0; i < fd.d.size(); ++i) {
                EXPECT_NEAR(grad->data<float>()[i], fd.d[i], 2e-4 * fd.largest) << names[which] << " " << i;
            }
        }
    }
}

// The gated delta-net's short convolution (Ops::causal_conv_silu_forward / _backward): 2 sequences of 9 steps, 5
// channels, kernel 4 (Megatron's --linear-conv-kernel-dim default). The forward against the definition in double
// (within 1e-6 of the output's largest), the step-0 edge by hand (only the last tap reads a step); dx and dw
// against central differences (step 1e-3) of the double loss sum(y r), within 1e-4 of their largest; dw adds to
// what it held.
TEST(OpsDeltaRule, CausalConvSiluAgainstItsDefinitionAndFiniteDifferences) {
    const int64_t s = 9, b = 2, C = 5, K = 4, n = s * b;
    Tensor        x = random_f32({n, C}, 4831, -2.0f, 2.0f), w = random_f32({C, K}, 4832), r = random_f32({n, C}, 4833);
    auto reference = [&](const std::vector<double> & xv, const std::vector<double> & wv) {
        std::vector<double> y(static_cast<size_t>(n * C));
        for (int64_t t = 0; t < s; ++t) {
            for (int64_t bi = 0; bi < b; ++bi) {
                for (int64_t c = 0; c < C; ++c) {
                    double pre = 0;
                    for (int64_t j = 0; j < K; ++j) {
                        const int64_t at = t - K + 1 + j;
                        if (at >= 0) pre += wv[static_cast<size_t>(c * K + j)] * xv[static_cast<size_t>((at * b + bi) * C + c)];
                    }
                    y[static_cast<size_t>((t * b + bi) * C + c)] = pre / (1 + std::exp(-pre));
                }
            }
        }
        return y;
    };
    const std::vector<double> xv = values(x), wv = values(w), rv = values(r);
    Tensor y = empty({n, C});
    ops().causal_conv_silu_forward(stream(), x, w, y, s, b);
    synchronize();
    const std::vector<double> want = reference(xv, wv);
    double largest = 0;
    for (double e : want) largest = std::max(largest, std::fabs(e));
    for (size_t i = 0; i < want.size(); ++i) EXPECT_NEAR(element(y, static_cast<int64_t>(i)), want[i], 1e-6 * largest) << "y " << i;
    const double pre0 = wv[K - 1] * xv[0];   // step 0, sequence 0, channel 0: the last tap only
    EXPECT_NEAR(element(y, 0), pre0 / (1 + std::exp(-pre0)), 1e-6);

    Tensor dx = empty({n, C}), dw = empty({C, K});
    std::fill(dw.data<float>(), dw.data<float>() + C * K, 0.5f);   // dw adds to what it holds
    ops().causal_conv_silu_backward(stream(), x, w, r, dx, dw, s, b);
    synchronize();
    auto loss = [&](const std::vector<double> & xs, const std::vector<double> & ws) {
        const std::vector<double> out = reference(xs, ws);
        double                    sum = 0;
        for (size_t i = 0; i < out.size(); ++i) sum += out[i] * rv[i];
        return sum;
    };
    for (const bool weights : {false, true}) {
        const Differences fd = central_differences(weights ? wv : xv, [&](const std::vector<double> & at) {
            return weights ? loss(xv, at) : loss(at, wv);
        });
        for (size_t i = 0; i < fd.d.size(); ++i) {
            const double got = weights ? element(dw, static_cast<int64_t>(i)) - 0.5 : element(dx, static_cast<int64_t>(i));
            EXPECT_NEAR(got, fd.d[i], 1e-4 * fd.largest) << (weights ? "dw " : "dx ") << i;
        }
    }
}

// The L2 norm of the gated delta-net's queries and keys (Ops::l2norm_forward / _backward): row 0 by hand, (3, 4)
// scaled by 1 / sqrt(25 + eps); 13 rows of 7 against a double reference (1e-6 relative) and the backward against
// central differences (step 1e-3) of the double reference, within 1e-4 of the largest gradient.
TEST(OpsDeltaRule, L2NormAgainstItsDefinitionAndFiniteDifferences) {
    const int64_t rows = 13, d = 7;
    const float   eps  = 1e-6f;
    Tensor        x = random_f32({rows, d}, 4841, -2.0f, 2.0f), r = random_f32({rows, d}, 4842);
    float *       x0 = x.data<float>();
    std::fill(x0, x0 + d, 0.0f);
    x0[0] = 3.0f;
    x0[1] = 4.0f;
    auto reference = [&](const std::vector<double> & xv) {
        std::vector<double> y(xv.size());
        for (int64_t i = 0; i < rows; ++i) {
            double ss = 0;
            for (int64_t j = 0; j < d; ++j) ss += xv[static_cast<size_t>(i * d + j)] * xv[static_cast<size_t>(i * d + j)];
            for (int64_t j = 0; j < d; ++j) y[static_cast<size_t>(i * d + j)] = xv[static_cast<size_t>(i * d + j)] / std::sqrt(ss + eps);
        }
        return y;
    };
    const std::vector<double> xv = values(x), rv = values(r), want = reference(xv);
    Tensor y = empty({rows, d}), rstd = empty({rows}), dx = empty({rows, d});
    ops().l2norm_forward(stream(), x, y, rstd, eps);
    ops().l2norm_backward(stream(), r, y, rstd, dx);
    synchronize();
    EXPECT_NEAR(element(y, 0), 0.6, 1e-6);
    EXPECT_NEAR(element(y, 1), 0.8, 1e-6);
    EXPECT_NEAR(element(rstd, 0), 1 / std::sqrt(25 + 1e-6), 1e-8);
    for (size_t i = 0; i < want.size(); ++i) {
        EXPECT_NEAR(element(y, static_cast<int64_t>(i)), want[i], 1e-6 * std::max(1e-3, std::fabs(want[i]))) << "y " << i;
    }
    const Differences fd = central_differences(xv, [&](const std::vector<double> & at) {
        const std::vector<double> y_at = reference(at);
        double                    sum  = 0;
        for (size_t j = 0; j < y_at.size(); ++j) sum += y_at[j] * rv[j];
        return sum;
    });
    for (size_t i = 0; i < fd.d.size(); ++i) EXPECT_NEAR(element(dx, static_cast<int64_t>(i)), fd.d[i], 1e-4 * fd.largest) << "dx " << i;
}

// The gated delta-net's gates (Ops::gdn_gates_forward / _backward): beta = sigmoid(b), g = -e^A_log softplus(a +
// dt_bias), with softplus linear above 20. Row 0 by hand (b = 0: beta 1/2; a + dt_bias = 0 and A_log = ln 2: g =
// -2 ln 2; head 1 above the threshold: g = -(a + dt_bias) e^A_log). 11 rows of 3 heads at column 5 of rows of 14,
// against a double reference (2e-6 relative); the gradients of b, a, A_log and dt_bias against central differences
// of the double reference (step 1e-3, within 1e-4 of each one's largest), the parameters' added to what they held;
// in bf16 the per-row results are the f32 op's on the same values (dsrc rounded once) and the sums the same bits.
TEST(OpsDeltaRule, GatesAgainstTheirDefinitionAndFiniteDifferences) {
    const int64_t n = 11, H = 3, stride = 14, col = 5;
    Tensor src = random_f32({n, stride}, 4851, -4.0f, 4.0f), a_log = random_f32({H}, 4852, 0.0f, 2.7f);
    Tensor dt_bias = random_f32({H}, 4853, 0.5f, 1.5f);
    float * row0 = src.data<float>();
    row0[col]           = 0.0f;                               // b of head 0
    row0[col + H]       = -dt_bias.data<float>()[0];          // a + dt_bias = 0 for head 0
    a_log.data<float>()[0] = std::log(2.0f);
    row0[col + H + 1]   = 30.0f;                               // head 1 past softplus's threshold
    const Tensor dg_in = random_f32({n, H}, 4854), dbeta_in = random_f32({n, H}, 4855);
    auto forward = [&](const std::vector<double> & sv, const std::vector<double> & al, const std::vector<double> & dt) {
        std::vector<double> g(static_cast<size_t>(n * H)), beta(g.size());
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t h = 0; h < H; ++h) {
                const double b = sv[static_cast<size_t>(r * stride + col + h)], x = sv[static_cast<size_t>(r * stride + col + H + h)] + dt[static_cast<size_t>(h)];
                beta[static_cast<size_t>(r * H + h)] = 1 / (1 + std::exp(-b));
                g[static_cast<size_t>(r * H + h)]    = -std::exp(al[static_cast<size_t>(h)]) * (x > 20 ? x : std::log1p(std::exp(x)));
            }
        }
        return std::pair{g, beta};
    };
    const std::vector<double> sv = values(src), al = values(a_log), dt = values(dt_bias), dgv = values(dg_in), dbv = values(dbeta_in);
    Tensor g = empty({n, H}), beta = empty({n, H}), dsrc = empty({n, 2 * H}), da_log = empty({H}), ddt = empty({H});
    std::fill(da_log.data<float>(), da_log.data<float>() + H, 0.25f);   // the parameters' gradients add
    std::fill(ddt.data<float>(), ddt.data<float>() + H, -0.5f);
    ops().gdn_gates_forward(stream(), src, col, a_log, dt_bias, g, beta);
    ops().gdn_gates_backward(stream(), src, col, a_log, dt_bias, dg_in, dbeta_in, dsrc, da_log, ddt);
    synchronize();
    EXPECT_EQ(element(beta, 0), 0.5);
    EXPECT_NEAR(element(g, 0), -2 * std::log(2.0), 1e-6);
    EXPECT_NEAR(element(g, 1), -(30.0 + dt[1]) * std::exp(al[1]), 1e-5 * (30.0 + dt[1]) * std::exp(al[1]));
    const auto [want_g, want_beta] = forward(sv, al, dt);
    for (size_t i = 0; i < want_g.size(); ++i) {
        EXPECT_NEAR(element(g, static_cast<int64_t>(i)), want_g[i], 2e-6 * std::fabs(want_g[i])) << "g " << i;
        EXPECT_NEAR(element(beta, static_cast<int64_t>(i)), want_beta[i], 2e-6 * want_beta[i]) << "beta " << i;
    }
    auto loss = [&](const std::vector<double> & s2, const std::vector<double> & al2, const std::vector<double> & dt2) {
        const auto [gg, bb] = forward(s2, al2, dt2);
        double sum = 0;
        for (size_t i = 0; i < gg.size(); ++i) sum += gg[i] * dgv[i] + bb[i] * dbv[i];
        return sum;
    };
    // src's differences over every column; those of the gate columns, row by row, are dsrc's.
    const Differences fd_src = central_differences(sv, [&](const std::vector<double> & at) { return loss(at, al, dt); });
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < 2 * H; ++j) {
            EXPECT_NEAR(element(dsrc, r * 2 * H + j), fd_src.d[static_cast<size_t>(r * stride + col + j)], 1e-4 * fd_src.largest)
                << "dsrc " << r << ", " << j;
        }
    }
    const Differences fd_a_log = central_differences(al, [&](const std::vector<double> & at) { return loss(sv, at, dt); });
    const Differences fd_dt    = central_differences(dt, [&](const std::vector<double> & at) { return loss(sv, al, at); });
    for (int64_t h = 0; h < H; ++h) {
        EXPECT_NEAR(element(da_log, h) - 0.25, fd_a_log.d[static_cast<size_t>(h)], 1e-4 * fd_a_log.largest) << "da_log " << h;
        EXPECT_NEAR(element(ddt, h) + 0.5, fd_dt.d[static_cast<size_t>(h)], 1e-4 * fd_dt.largest) << "ddt_bias " << h;
    }
    // bf16 src: the per-row results from the same values; dsrc rounded once; the sums the same bits.
    Bf16Pair sb = bf16_pair({n, stride}, 4856, -4.0f, 4.0f), db = outputs({n, 2 * H});
    Tensor   g32 = empty({n, H}), b32 = empty({n, H}), g16 = empty({n, H}), b16 = empty({n, H});
    Tensor   al32 = Tensor::zeros({H}, DType::f32, dev()), dt32 = Tensor::zeros({H}, DType::f32, dev());
    Tensor   al16 = Tensor::zeros({H}, DType::f32, dev()), dt16 = Tensor::zeros({H}, DType::f32, dev());
    ops().gdn_gates_forward(stream(), sb.f, col, a_log, dt_bias, g32, b32);
    ops().gdn_gates_forward(stream(), sb.h, col, a_log, dt_bias, g16, b16);
    ops().gdn_gates_backward(stream(), sb.f, col, a_log, dt_bias, dg_in, dbeta_in, db.f, al32, dt32);
    ops().gdn_gates_backward(stream(), sb.h, col, a_log, dt_bias, dg_in, dbeta_in, db.h, al16, dt16);
    expect_rounded("gdn_gates_backward dsrc", db);
    expect_same_f32("gdn_gates_forward g", g32, g16);
    expect_same_f32("gdn_gates_forward beta", b32, b16);
    expect_same_f32("gdn_gates_backward da_log", al32, al16);
    expect_same_f32("gdn_gates_backward ddt_bias", dt32, dt16);
    // The gate columns must lie inside src's rows.
    EXPECT_THROW(ops().gdn_gates_forward(stream(), src, stride - 2 * H + 1, a_log, dt_bias, g, beta), Error);
}

TEST(OpsBf16Activations, EmbeddingForwardAndBackward) {
    const int64_t b = 2, s = 5, h = 12, vocab = 9;
    Tensor        tokens = int_tensor({b, s}, {0, 3, 8, 3, 1, 2, 2, 7, 0, 5});
    for (DType table : {DType::f32, DType::bf16}) {
        Tensor   wte = random_tensor({vocab, h}, table, 30), wpe = random_tensor({s, h}, table, 31);
        Bf16Pair out = outputs({s * b, h});
        ops().embedding_forward(stream(), tokens, wte, wpe, out.f);
        ops().embedding_forward(stream(), tokens, wte, wpe, out.h);
        expect_rounded(std::string("embedding_forward, ") + dtype_name(table) + " tables", out);
    }
    Bf16Pair dout = bf16_pair({s * b, h}, 32);
    Tensor   dwte32 = random_f32({vocab, h}, 33), dwpe32 = random_f32({s, h}, 34);
    Tensor   dwte16 = clone(dwte32), dwpe16 = clone(dwpe32);
    ops().embedding_backward(stream(), tokens, dout.f, dwte32, dwpe32);
    ops().embedding_backward(stream(), tokens, dout.h, dwte16, dwpe16);
    expect_same_f32("embedding_backward dwte", dwte32, dwte16);
    expect_same_f32("embedding_backward dwpe", dwpe32, dwpe16);
}

TEST(OpsBf16Activations, AttentionForwardBackwardGqaAndABlockOfKeys) {
    const AttentionShape a{37, 2, 4, 2, 8, (4 + 2 * 2) * 8};
    const int64_t        n = a.s * a.b;
    Bf16Pair             qkv = bf16_pair({n, a.row_stride}, 40), out = outputs({n, a.nq * a.d});
    Tensor               lse32 = empty({a.b * a.nq, a.s}), lse16 = empty({a.b * a.nq, a.s});
    const float          scale = 1.0f / std::sqrt(8.0f);
    ops().attention_forward(stream(), qkv.f, out.f, lse32, a, scale);
    ops().attention_forward(stream(), qkv.h, out.h, lse16, a, scale);
    expect_rounded("attention out", out);
    expect_same_f32("attention lse", lse32, lse16);
    // Backward from the bf16 run's out (both read the same values).
    Tensor out_values = empty({n, a.nq * a.d});
    ops().convert(stream(), out.h, out_values);
    Bf16Pair dout = bf16_pair({n, a.nq * a.d}, 41), dqkv = outputs({n, a.row_stride});
    ops().attention_backward(stream(), qkv.f, out_values, dout.f, lse32, dqkv.f, a, scale);
    ops().attention_backward(stream(), qkv.h, out.h, dout.h, lse32, dqkv.h, a, scale);
    expect_rounded("attention dqkv", dqkv);
    // Queries against another block of keys, accumulating into the gradients already there.
    AttentionShape block = a;
    block.kv_row_stride  = 2 * a.nkv * a.d;
    block.k_col          = 0;
    block.v_col          = a.nkv * a.d;
    block.k_pos          = SeqPositions{};
    Bf16Pair kv = bf16_pair({n, block.kv_row_stride}, 42), dkv = bf16_pair({n, block.kv_row_stride}, 43);
    Bf16Pair dq = bf16_pair({n, a.row_stride}, 44);
    ops().attention_backward(stream(), qkv.f, kv.f, out_values, dout.f, lse32, dq.f, dkv.f, block, scale, {}, true);
    ops().attention_backward(stream(), qkv.h, kv.h, out.h, dout.h, lse32, dq.h, dkv.h, block, scale, {}, true);
    expect_rounded("attention dq, accumulated", dq);
    expect_rounded("attention dkv, accumulated", dkv);
}

TEST(OpsBf16Activations, CrossEntropyAndTheVocabularyParallelPieces) {
    const int64_t b = 2, s = 3, n = b * s, stride = 24, vocab = 21;
    Tensor        labels = int_tensor({b, s}, {0, 20, 5, -1, 7, 13});
    Bf16Pair      logits = bf16_pair({n, stride}, 50, -6.0f, 6.0f);
    Tensor        loss32 = empty({n}), lse32 = empty({n}), loss16 = empty({n}), lse16 = empty({n});
    ops().cross_entropy_forward(stream(), logits.f, labels, loss32, lse32, vocab);
    ops().cross_entropy_forward(stream(), logits.h, labels, loss16, lse16, vocab);
    expect_same_f32("cross_entropy_forward loss", loss32, loss16);
    expect_same_f32("cross_entropy_forward lse", lse32, lse16);
    Tensor r32 = empty({n}), r16 = empty({n});
    ops().row_max(stream(), logits.f, vocab, r32);
    ops().row_max(stream(), logits.h, vocab, r16);
    expect_same_f32("row_max", r32, r16);
    Tensor e32 = empty({n}), e16 = empty({n});
    ops().row_sum_exp(stream(), logits.f, r32, vocab, e32);
    ops().row_sum_exp(stream(), logits.h, r32, vocab, e16);
    expect_same_f32("row_sum_exp", e32, e16);
    ops().label_logit(stream(), logits.f, labels, r32);
    ops().label_logit(stream(), logits.h, labels, r16);
    expect_same_f32("label_logit", r32, r16);
    Tensor dloss = random_f32({n}, 51, 0.5f, 1.0f);
    ops().cross_entropy_backward(stream(), logits.f, labels, lse32, dloss, vocab);
    ops().cross_entropy_backward(stream(), logits.h, labels, lse32, dloss, vocab);
    expect_rounded("cross_entropy_backward", logits);
}

// Argument errors: thrown on the calling thread, before anything is enqueued.

namespace {

template <typename Call>
void expect_error_here(const char * what, Call && call) {
    EXPECT_THROW(call(), Error) << what;
    EXPECT_NO_THROW(synchronize()) << what << ": the bad call reached the stream";
}

}  // namespace

TEST(OpsArgumentErrors, Gemm) {
    Tensor a = empty({4, 8}), b = empty({8, 5}), c = empty({4, 5});
    expect_error_here("k mismatch", [&] { ops().gemm(stream(), a, false, b, true, c); });
    expect_error_here("c size", [&] { ops().gemm(stream(), a, false, b, false, empty({4, 6})); });
    expect_error_here("mixed dtypes", [&] { ops().gemm(stream(), a, false, empty({8, 5}, DType::bf16), false, c); });
    expect_error_here("i32 operands", [&] {
        ops().gemm(stream(), empty({4, 8}, DType::i32), false, empty({8, 5}, DType::i32), false, c);
    });
    expect_error_here("f16 c", [&] { ops().gemm(stream(), a, false, b, false, empty({4, 5}, DType::f16)); });
    expect_error_here("bf16 c with accumulate",
                      [&] { ops().gemm(stream(), a, false, b, false, empty({4, 5}, DType::bf16), /*accumulate=*/true); });
    expect_error_here("1-D a", [&] { ops().gemm(stream(), empty({32}), false, b, false, c); });
    expect_error_here("gemm_bias: bias size", [&] { ops().gemm_bias(stream(), a, false, b, false, c, empty({4})); });
    expect_error_here("gemm_bias: bf16 bias",
                      [&] { ops().gemm_bias(stream(), a, false, b, false, c, empty({5}, DType::bf16)); });
    expect_error_here("gemm_bias: 1-D c", [&] { ops().gemm_bias(stream(), a, false, b, false, empty({20}), empty({5})); });
    expect_error_here("gemm_bias: no bias", [&] { ops().gemm_bias(stream(), a, false, b, false, c, Tensor()); });
}

TEST(OpsArgumentErrors, Norms) {
    const int64_t n = 6, h = 8;
    Tensor        x = empty({n, h}), g = empty({h}), y = empty({n, h}), mean = empty({n}), rstd = empty({n});
    expect_error_here("gamma size", [&] {
        ops().layernorm_forward(stream(), x, Tensor(), empty({h + 1}), Tensor(), y, mean, rstd, 1e-5f);
    });
    expect_error_here("beta size",
                      [&] { ops().layernorm_forward(stream(), x, Tensor(), g, empty({h - 1}), y, mean, rstd, 1e-5f); });
    expect_error_here("residual dtype", [&] {
        ops().layernorm_forward(stream(), x, empty({n, h}, DType::bf16), g, Tensor(), y, mean, rstd, 1e-5f);
    });
    expect_error_here("1-D x", [&] { ops().rmsnorm_forward(stream(), empty({n * h}), Tensor(), g, y, rstd, 1e-5f); });
    expect_error_here("rstd size", [&] { ops().rmsnorm_forward(stream(), x, Tensor(), g, y, empty({n + 1}), 1e-5f); });
    expect_error_here("dx size", [&] {
        ops().layernorm_backward(stream(), y, x, g, mean, rstd, empty({n, h + 1}), empty({h}), empty({h}));
    });
    expect_error_here("dgamma dtype", [&] {
        ops().rmsnorm_backward(stream(), y, x, g, rstd, empty({n, h}), empty({h}, DType::bf16));
    });
}

TEST(OpsArgumentErrors, Elementwise) {
    Tensor y = empty({4, 6});
    expect_error_here("bias size", [&] { ops().bias_add(stream(), y, empty({5})); });
    expect_error_here("dbias size", [&] { ops().bias_backward(stream(), y, empty({7})); });
    expect_error_here("add_inplace numel", [&] { ops().add_inplace(stream(), y, empty({23})); });
    expect_error_here("add_inplace dtype", [&] { ops().add_inplace(stream(), empty({4, 6}, DType::i32), y); });
    expect_error_here("gelu y size", [&] { ops().bias_gelu_forward(stream(), y, Tensor(), empty({4, 5}), Tensor()); });
    expect_error_here("gelu x_bf16 dtype", [&] {
        ops().bias_gelu_forward(stream(), y, Tensor(), empty({4, 6}), empty({4, 6}));
    });
    expect_error_here("gelu_backward dx size", [&] { ops().gelu_backward(stream(), y, empty({4, 6}), empty({4, 7})); });
    expect_error_here("swiglu y size", [&] { ops().swiglu_forward(stream(), y, empty({4, 6})); });
    expect_error_here("swiglu dx size", [&] { ops().swiglu_backward(stream(), y, empty({4, 3}), empty({4, 3})); });
    expect_error_here("rope odd d", [&] { ops().rope(stream(), empty({6, 20}), 3, 2, 2, 5, 10000.0f, false); });
    expect_error_here("rope odd rotary dimension",
                      [&] { ops().rope(stream(), empty({6, 20}), 3, 2, 2, 8, 10000.0f, false, 3); });
    expect_error_here("rope heads wider than rows", [&] {
        ops().rope(stream(), empty({6, 20}), 3, 2, 3, 8, 10000.0f, false);
    });
    expect_error_here("rope rows", [&] { ops().rope(stream(), empty({6, 20}), 4, 2, 2, 8, 10000.0f, false); });
    expect_error_here("rope dtype", [&] {
        ops().rope(stream(), empty({6, 20}, DType::f16), 3, 2, 2, 8, 10000.0f, false);
    });
}

TEST(OpsArgumentErrors, Embedding) {
    Tensor tokens = int_tensor({2, 3}, {0, 1, 2, 3, 4, 5}), wte = empty({8, 4}), out = empty({6, 4});
    expect_error_here("f32 tokens", [&] { ops().embedding_forward(stream(), empty({2, 3}), wte, Tensor(), out); });
    expect_error_here("out size", [&] { ops().embedding_forward(stream(), tokens, wte, Tensor(), empty({6, 5})); });
    expect_error_here("wpe dtype", [&] {
        ops().embedding_forward(stream(), tokens, wte, empty({3, 4}, DType::bf16), out);
    });
    expect_error_here("i32 table", [&] {
        ops().embedding_forward(stream(), tokens, empty({8, 4}, DType::i32), Tensor(), out);
    });
    expect_error_here("dout size", [&] { ops().embedding_backward(stream(), tokens, empty({5, 4}), wte, Tensor()); });
    expect_error_here("bf16 dwte", [&] {
        ops().embedding_backward(stream(), tokens, out, empty({8, 4}, DType::bf16), Tensor());
    });
    expect_error_here("shard ids out dtype", [&] {
        ops().vocab_shard_ids(stream(), tokens, 0, 4, empty({2, 3}, DType::i64));
    });
    expect_error_here("shard ids out size",
                      [&] { ops().vocab_shard_ids(stream(), tokens, 0, 4, empty({7}, DType::i32)); });
}

TEST(OpsArgumentErrors, Attention) {
    const AttentionShape a{4, 2, 2, 1, 4, 16};
    const int64_t        n   = 8;
    Tensor               qkv = empty({n, 16}), out = empty({n, 8}), lse = empty({2 * 2 * 4});
    expect_error_here("qkv size", [&] { ops().attention_forward(stream(), empty({n, 15}), out, lse, a, 0.5f); });
    expect_error_here("out size", [&] { ops().attention_forward(stream(), qkv, empty({n, 9}), lse, a, 0.5f); });
    expect_error_here("lse size", [&] { ops().attention_forward(stream(), qkv, out, empty({15}), a, 0.5f); });
    expect_error_here("bf16 qkv", [&] {
        ops().attention_forward(stream(), empty({n, 16}, DType::bf16), out, lse, a, 0.5f);
    });
    expect_error_here("dqkv size", [&] {
        ops().attention_backward(stream(), qkv, out, out, lse, empty({n, 8}), a, 0.5f);
    });
    expect_error_here("dout size", [&] {
        ops().attention_backward(stream(), qkv, out, empty({n, 7}), lse, empty({n, 16}), a, 0.5f);
    });
    Dropout few;   // dropout draws each sequence's mask from its sample id: one is missing
    few.p          = 0.1f;
    few.sample_ids = empty({1}, DType::i64);
    expect_error_here("a sample id per sequence", [&] { ops().attention_forward(stream(), qkv, out, lse, a, 0.5f, few); });
}

TEST(OpsArgumentErrors, CrossEntropy) {
    const int64_t b = 2, s = 3, n = 6;
    Tensor        logits = empty({n, 10}), labels = int_tensor({b, s}, {0, 1, 2, 3, 4, 5}), r = empty({n});
    expect_error_here("labels size", [&] {
        ops().cross_entropy_forward(stream(), logits, int_tensor({1, 5}, {0, 1, 2, 3, 4}), r, empty({n}), 10);
    });
    expect_error_here("f32 labels", [&] {
        ops().cross_entropy_forward(stream(), logits, empty({b, s}), r, empty({n}), 10);
    });
    expect_error_here("vocab > stride",
                      [&] { ops().cross_entropy_forward(stream(), logits, labels, r, empty({n}), 11); });
    expect_error_here("loss size",
                      [&] { ops().cross_entropy_forward(stream(), logits, labels, empty({n + 1}), empty({n}), 10); });
    expect_error_here("dloss size",
                      [&] { ops().cross_entropy_backward(stream(), logits, labels, r, empty({n - 1}), 10); });
    expect_error_here("row_max out", [&] { ops().row_max(stream(), logits, 10, empty({n + 1})); });
    expect_error_here("row_sum_exp max", [&] { ops().row_sum_exp(stream(), logits, empty({n}, DType::bf16), 10, r); });
    expect_error_here("label_logit out", [&] { ops().label_logit(stream(), logits, labels, empty({n}, DType::bf16)); });
    expect_error_here("lse_and_loss size",
                      [&] { ops().lse_and_loss(stream(), r, r, empty({n + 1}), empty({n}), empty({n})); });
    expect_error_here("1-D mask", [&] { ops().loss_grad(stream(), empty({n}), 1.0, empty({n})); });
    expect_error_here("dloss of the mask's size", [&] {
        ops().loss_grad(stream(), empty({b, s}), 1.0, empty({n + 1}));
    });
}

TEST(OpsArgumentErrors, DataMovementAndReductions) {
    Tensor x = empty({12});
    expect_error_here("convert to i32", [&] { ops().convert(stream(), x, empty({12}, DType::i32)); });
    expect_error_here("convert numel", [&] { ops().convert(stream(), x, empty({13}, DType::bf16)); });
    expect_error_here("round_to_bf16 x dtype",
                      [&] { ops().round_to_bf16(stream(), empty({12}, DType::f16), empty({12}, DType::bf16)); });
    expect_error_here("round_to_bf16 copy dtype", [&] { ops().round_to_bf16(stream(), x, empty({12}, DType::f16)); });
    expect_error_here("copy dtype", [&] { ops().copy(stream(), x, empty({12}, DType::i32)); });
    expect_error_here("copy numel", [&] { ops().copy(stream(), x, empty({11})); });
    expect_error_here("scale i32", [&] { ops().scale(stream(), empty({12}, DType::i32), 2.0f); });
    expect_error_here("sum_of_squares out size", [&] { ops().sum_of_squares(stream(), x, empty({3})); });
    expect_error_here("sum_of_squares x dtype",
                      [&] { ops().sum_of_squares(stream(), empty({12}, DType::bf16), empty({2})); });
}

TEST(OpsArgumentErrors, AdamW) {
    const int64_t  n = 16;
    Tensor         p = empty({n}), g = empty({n}), m = empty({n}), v = empty({n});
    const AdamStep step{1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1};
    AdamStep       step0 = step;
    step0.step           = 0;
    expect_error_here("grad size", [&] { ops().adamw(stream(), p, empty({n + 1}), m, v, Tensor(), step); });
    expect_error_here("bf16 m", [&] { ops().adamw(stream(), p, g, empty({n}, DType::bf16), v, Tensor(), step); });
    expect_error_here("i32 out", [&] { ops().adamw(stream(), p, g, m, v, empty({n}, DType::i32), step); });
    expect_error_here("out size", [&] { ops().adamw(stream(), p, g, m, v, empty({n - 1}, DType::bf16), step); });
    expect_error_here("step 0", [&] { ops().adamw(stream(), p, g, m, v, Tensor(), step0); });
}

// ---------------------------------------------------------------------------------------------------
// Arguments the CPU backend once let through to the stream (a wrong dtype found only inside the kernel) or
// not checked at all (a wrong shape read or wrote past a buffer). Out-of-range accesses, were a check to go
// missing again, land inside larger buffers.
TEST(OpsArgumentChecks, DtypesAndShapesAreCheckedOnTheCallingThread) {
    const int64_t n = 6, h = 8;
    Tensor        x = random_f32({n, h}, 9000), g = random_f32({h}, 9001), dx = empty({n, h}), rstd = empty({n}),
           mean      = empty({n});
    // Activations are f32 or bf16, all of one dtype in a call: bf16 among f32 ones, and f16, are refused.
    Tensor bf16_rows = empty({n, h}, DType::bf16), f16_rows = empty({n, h}, DType::f16);
    expect_error_here("layernorm_backward: bf16 dy, f32 x", [&] {
        ops().layernorm_backward(stream(), bf16_rows, x, g, mean, rstd, dx, empty({h}), empty({h}));
    });
    expect_error_here("rmsnorm_backward: bf16 dy, f32 x",
                      [&] { ops().rmsnorm_backward(stream(), bf16_rows, x, g, rstd, dx, empty({h})); });
    expect_error_here("bias_add: f16 y", [&] { ops().bias_add(stream(), f16_rows, g); });
    expect_error_here("bias_backward: f16 dy", [&] { ops().bias_backward(stream(), f16_rows, empty({h})); });
    expect_error_here("swiglu_backward: bf16 x, f32 dy", [&] {
        ops().swiglu_backward(stream(), bf16_rows, empty({n, h / 2}), dx);
    });
    expect_error_here("swiglu_forward: odd width", [&] {
        ops().swiglu_forward(stream(), empty({n, 7}), empty({n, 3}));
    });

    Tensor tokens = int_tensor({2, 3}, {0, 1, 2, 3, 4, 5}), dout = random_f32({6, 4}, 9002);
    expect_error_here("embedding_backward: bf16 dwpe", [&] {
        ops().embedding_backward(stream(), tokens, dout, empty({8, 4}), empty({3, 4}, DType::bf16));
    });
    Tensor wpe_buffer = Tensor::zeros({3 * 4}, DType::f32, dev());
    expect_error_here("embedding_forward: wpe of 2 positions for 3", [&] {
        ops().embedding_forward(stream(), tokens, empty({8, 4}), wpe_buffer.slice(0, {2, 4}), empty({6, 4}));
    });
    expect_error_here("embedding_backward: dwpe of 2 positions for 3", [&] {
        ops().embedding_backward(stream(), tokens, dout, empty({8, 4}), wpe_buffer.slice(0, {2, 4}));
    });

    Tensor labels = int_tensor({2, 3}, {0, 1, 2, 3, 4, 5}), logits16 = empty({6, 10}, DType::f16), r = empty({6});
    expect_error_here("cross_entropy_forward: f16 logits",
                      [&] { ops().cross_entropy_forward(stream(), logits16, labels, r, empty({6}), 10); });
    expect_error_here("cross_entropy_backward: f16 logits",
                      [&] { ops().cross_entropy_backward(stream(), logits16, labels, r, r, 10); });
    expect_error_here("row_max: f16 logits", [&] { ops().row_max(stream(), logits16, 10, r); });
    expect_error_here("row_sum_exp: f16 logits", [&] { ops().row_sum_exp(stream(), logits16, r, 10, empty({6})); });
    expect_error_here("label_logit: f16 logits", [&] { ops().label_logit(stream(), logits16, labels, r); });
    Tensor logit_buffer = Tensor::zeros({7 * 10}, DType::f32, dev());
    expect_error_here("row_max: valid 11 > stride 10", [&] {
        ops().row_max(stream(), logit_buffer.slice(0, {6, 10}), 11, r);
    });

    // nq not a multiple of nkv, and rows narrower than (nq + 2 nkv) d (inside a larger buffer).
    const AttentionShape ragged{4, 2, 3, 2, 4, 7 * 4}, narrow{4, 2, 2, 1, 4, 8};
    Tensor               qkv_buffer = Tensor::zeros({8 * 28 + 16}, DType::f32, dev());
    expect_error_here("attention: nq 3, nkv 2", [&] {
        ops().attention_forward(stream(), qkv_buffer.slice(0, {8, 28}), empty({8, 12}), empty({24}), ragged, 0.5f);
    });
    expect_error_here("attention: row_stride 8 < 16", [&] {
        ops().attention_forward(stream(), qkv_buffer.slice(0, {8, 8}), empty({8, 8}), empty({16}), narrow, 0.5f);
    });
    const AttentionShape no_kv{4, 2, 2, 0, 4, 8};
    expect_error_here("attention: nkv 0", [&] {
        ops().attention_backward(stream(), qkv_buffer.slice(0, {8, 8}), empty({8, 8}), empty({8, 8}), empty({16}),
                                 qkv_buffer.slice(0, {8, 8}), no_kv, 0.5f);
    });
    expect_error_here("cross_entropy_backward: vocab 11 > stride 10", [&] {
        ops().cross_entropy_backward(stream(), logit_buffer.slice(0, {6, 10}), labels, r, r, 11);
    });
}

// A token or label id past the table is refused on the stream, before any row is read or written; the
// error names the op and the id.
TEST(OpsArgumentChecks, IdsPastTheTableAreAnErrorAtTheNextSynchronize) {
    Tensor tokens = int_tensor({2, 3}, {0, 1, 2, 3, 4, 8}), dwte = Tensor::zeros({8, 4}, DType::f32, dev());
    auto   error_at_sync = [&](const char * what, const std::function<void()> & enqueue) {
        SCOPED_TRACE(what);
        enqueue();
        try {
            synchronize();
            ADD_FAILURE() << "no error";
        } catch (const Error & e) {
            EXPECT_NE(std::string(e.message()).find(" 8 at position 5 is outside [0, 8)"), std::string::npos)
                << e.message();
        }
    };
    error_at_sync("embedding_forward", [&] { ops().embedding_forward(stream(), tokens, empty({8, 4}), Tensor(), empty({6, 4})); });
    error_at_sync("embedding_backward", [&] { ops().embedding_backward(stream(), tokens, random_f32({6, 4}, 9200), dwte, Tensor()); });
    for (int64_t i = 0; i < dwte.numel(); ++i) ASSERT_EQ(dwte.data<float>()[i], 0.0f) << "nothing was added";
    error_at_sync("cross_entropy_forward", [&] {
        ops().cross_entropy_forward(stream(), random_f32({6, 8}, 9201), tokens, empty({6}), empty({6}), 8);
    });
}

// cross_entropy_forward with a label of -1 (core/ops.h: the label is on another rank's shard) takes a target
// logit of 0, as label_logit does: loss = lse. (It once read logits[r * stride - 1], the previous row's last
// column.)
TEST(CrossEntropy, ForwardWithAnotherRanksLabelTakesATargetOfZero) {
    const int64_t s = 3, b = 2, n = s * b, vocab = 10, stride = 12;
    Tensor        logits = ce_logits(n, stride, vocab, 9100);   // padding: NaN and 100
    Tensor        labels = int_tensor({b, s}, {1, 2, 3, -1, 5, 6}), loss = empty({n}), lse = empty({n});   // row 1: -1
    ops().cross_entropy_forward(stream(), logits, labels, loss, lse, vocab);
    synchronize();
    std::vector<double> ref_lse = logsumexp_rows(logits, vocab), ref_loss(static_cast<size_t>(n));
    for (int64_t r = 0; r < n; ++r) {
        const int32_t label = label_of(labels, r, b, s);
        ref_loss[static_cast<size_t>(r)] =
            ref_lse[static_cast<size_t>(r)] - (label >= 0 ? logits.data<float>()[r * stride + label] : 0.0);
    }
    EXPECT_TRUE(close("cross_entropy lse", lse, ref_lse, kCrossEntropyTol, 1.0));
    EXPECT_TRUE(close("cross_entropy loss with a -1 label", loss, ref_loss, kCrossEntropyTol, 1.0));
}

// DeepSeek Sparse Attention's indexer ops (core/ops.h) against their definitions in double: 2 sequences of 11, 3
// heads of 8 (the scores with and without the ReLU, and their gradients from random dscores), the target of packed
// rows of 2 heads of 6 (f32 and bf16 rows; each row of it sums to the heads' count) and the KL loss with its
// gradient. Within 1e-5 of each tensor's largest value (f32 sums of at most 11 x 3 x 8 terms); the masked
// entries exactly -inf (scores) and 0 (target, dscores).
TEST(OpsDsa, IndexerScoresTargetAndLossFollowTheirDefinitions) {
    const int64_t s = 11, b = 2, n = s * b, H = 3, d = 8;
    const Tensor  q = random_f32({n, H * d}, 9301), k = random_f32({n, d}, 9302), w = random_f32({n, H}, 9303);
    const Tensor  dscores = random_f32({b, s, s}, 9304);
    const std::vector<double> qv = values(q), kv = values(k), wv = values(w), gv = values(dscores);
    auto z = [&](int64_t bi, int64_t i, int64_t h, int64_t j) {
        double dot = 0;
        for (int64_t x = 0; x < d; ++x) dot += qv[((i * b + bi) * H + h) * d + x] * kv[(j * b + bi) * d + x];
        return dot;
    };
    for (const bool relu : {true, false}) {
        const std::string what = relu ? " with relu" : " without relu";
        Tensor scores = empty({b, s, s}), dq = empty({n, H * d}), dk = empty({n, d}), dw = empty({n, H});
        ops().dsa_index_scores(stream(), q, k, w, s, b, relu, scores);
        ops().dsa_index_scores_backward(stream(), q, k, w, dscores, s, b, relu, dq, dk, dw);
        synchronize();
        std::vector<double> ref(static_cast<size_t>(b * s * s), 0.0), rdq(static_cast<size_t>(n * H * d), 0.0);
        std::vector<double> rdk(static_cast<size_t>(n * d), 0.0), rdw(static_cast<size_t>(n * H), 0.0);
        for (int64_t bi = 0; bi < b; ++bi) {
            for (int64_t i = 0; i < s; ++i) {
                const int64_t ri = i * b + bi;
                for (int64_t j = 0; j <= i; ++j) {
                    const double g = gv[(bi * s + i) * s + j];
                    for (int64_t h = 0; h < H; ++h) {
                        const double zz = z(bi, i, h, j), act = relu ? std::max(zz, 0.0) : zz;
                        ref[(bi * s + i) * s + j] += wv[ri * H + h] * act;
                        rdw[ri * H + h] += g * act;
                        const double dz = (!relu || zz > 0) ? g * wv[ri * H + h] : 0.0;
                        for (int64_t x = 0; x < d; ++x) {
                            rdq[(ri * H + h) * d + x] += dz * kv[(j * b + bi) * d + x];
                            rdk[(j * b + bi) * d + x] += dz * qv[(ri * H + h) * d + x];
                        }
                    }
                }
            }
        }
        std::vector<double> causal = ref;
        for (int64_t bi = 0; bi < b; ++bi) {
            for (int64_t i = 0; i < s; ++i) {
                for (int64_t j = i + 1; j < s; ++j) {
                    EXPECT_EQ(scores.data<float>()[(bi * s + i) * s + j], -std::numeric_limits<float>::infinity());
                    causal[(bi * s + i) * s + j] = 0.0;
                }
            }
        }
        std::vector<float> got = floats(scores);
        for (size_t e = 0; e < got.size(); ++e) {
            if (std::isinf(got[e])) got[e] = 0.0f;
        }
        EXPECT_TRUE(close_to_max("scores" + what, got.data(), causal, 1e-5));
        EXPECT_TRUE(close_to_max("dq" + what, dq.data<float>(), rdq, 1e-5));
        EXPECT_TRUE(close_to_max("dk" + what, dk.data<float>(), rdk, 1e-5));
        EXPECT_TRUE(close_to_max("dw" + what, dw.data<float>(), rdw, 1e-5));
    }

    const int64_t heads = 2, hd = 6, stride = 3 * heads * hd;
    const float   scale = 0.4f;
    for (const DType dtype : {DType::f32, DType::bf16}) {
        const std::string what = dtype == DType::f32 ? " (f32 rows)" : " (bf16 rows)";
        const Tensor rows = random_tensor({n, stride}, dtype, 9305, -2.0f, 2.0f);
        const std::vector<double> rv = values(rows);
        Tensor target = empty({b, s, s});
        ops().dsa_attention_target(stream(), rows, AttentionShape(s, b, heads, heads, hd, stride), scale, target);
        synchronize();
        std::vector<double> ref(static_cast<size_t>(b * s * s), 0.0);
        for (int64_t bi = 0; bi < b; ++bi) {
            for (int64_t i = 0; i < s; ++i) {
                for (int64_t h = 0; h < heads; ++h) {
                    std::vector<double> logit(static_cast<size_t>(i + 1));
                    double              mx = -1e300, sum = 0;
                    for (int64_t j = 0; j <= i; ++j) {
                        double dot = 0;
                        for (int64_t x = 0; x < hd; ++x) {
                            dot += rv[(i * b + bi) * stride + h * hd + x] * rv[(j * b + bi) * stride + heads * hd + h * hd + x];
                        }
                        logit[j] = scale * dot;
                        mx       = std::max(mx, logit[j]);
                    }
                    for (int64_t j = 0; j <= i; ++j) sum += std::exp(logit[j] - mx);
                    for (int64_t j = 0; j <= i; ++j) ref[(bi * s + i) * s + j] += std::exp(logit[j] - mx) / sum;
                }
            }
        }
        EXPECT_TRUE(close_to_max("target" + what, target.data<float>(), ref, 1e-5));
    }

    // The loss from a target of positive weights (rows summing to anything) and scores of either sign.
    const Tensor scores = random_f32({b, s, s}, 9306, -3.0f, 3.0f), target = random_f32({b, s, s}, 9307, 0.0f, 2.0f);
    const float  weight = 0.3f;
    Tensor       kl = empty({n}), grad = empty({b, s, s});
    ops().dsa_indexer_loss(stream(), scores, target, weight, kl, grad);
    synchronize();
    const std::vector<double> sv = values(scores), tv = values(target);
    std::vector<double>       rkl(static_cast<size_t>(n), 0.0), rgrad(static_cast<size_t>(b * s * s), 0.0);
    for (int64_t row = 0; row < n; ++row) {
        const int64_t i = row % s;
        double        total = 0, mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
            total += tv[row * s + j];
            mx = std::max(mx, sv[row * s + j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += std::exp(sv[row * s + j] - mx);
        for (int64_t j = 0; j <= i; ++j) {
            const double T = tv[row * s + j] / total, log_p = sv[row * s + j] - mx - std::log(sum);
            rkl[row] += weight * T * (std::log(std::max(T, 1e-10)) - log_p);
            rgrad[row * s + j] = weight * (std::exp(log_p) - T);
        }
    }
    EXPECT_TRUE(close_to_max("kl", kl.data<float>(), rkl, 1e-5));
    EXPECT_TRUE(close_to_max("dscores", grad.data<float>(), rgrad, 1e-5));
}

// The indexer's ops under context parallelism: a rank's query rows (its two chunks of each sequence, at their global
// positions) against the whole sequences' keys in position order give exactly the rows the whole run gives them:
// scores, the top-k mask (ties everywhere: the scores rounded), the sparse target (from the whole sequences' K | V
// rows apart) and loss, dq and dw bitwise; dk (this rank's queries' share of every key's) summed over the ranks
// within 1e-6 of its largest. CP 2 and 4 over 2 sequences of 16.
TEST(OpsDsa, ContextParallelRowsAreTheWholeSequencesRows) {
    const int64_t S = 16, b = 2, N = S * b, H = 3, d = 8, heads = 2, hd = 6, stride = 3 * heads * hd, topk = 5;
    const float   scale = 0.4f, weight = 0.3f;
    const Tensor  q = random_f32({N, H * d}, 9501), k = random_f32({N, d}, 9502), w = random_f32({N, H}, 9503);
    const Tensor  dscores = random_f32({b, S, S}, 9504), rows = random_f32({N, stride}, 9505, -2.0f, 2.0f);
    Tensor        kv = empty({N, 2 * heads * hd});   // the whole sequences' K | V, apart from their queries
    for (int64_t r = 0; r < N; ++r) {
        std::copy_n(rows.data<float>() + r * stride + heads * hd, 2 * heads * hd, kv.data<float>() + r * 2 * heads * hd);
    }
    // The whole run, ties everywhere in its scores (rounded, as the ReLU's zeros make them).
    Tensor scores = empty({b, S, S}), mask = empty({b, S, S}, DType::u8), target = empty({b, S, S});
    Tensor kl = empty({N}), grad = empty({b, S, S}), dq = empty({N, H * d}), dk = empty({N, d}), dw = empty({N, H});
    ops().dsa_index_scores(stream(), q, k, w, S, b, true, scores);
    synchronize();
    for (int64_t e = 0; e < scores.numel(); ++e) scores.data<float>()[e] = std::round(scores.data<float>()[e] * 2.0f);
    AttentionShape whole(S, b, heads, heads, hd, stride);
    whole.key_mask = mask;
    ops().dsa_topk_mask(stream(), scores, topk, mask);
    ops().dsa_attention_target(stream(), rows, whole, scale, target);
    ops().dsa_indexer_loss(stream(), scores, target, weight, kl, grad, mask);
    ops().dsa_index_scores_backward(stream(), q, k, w, dscores, S, b, true, dq, dk, dw);
    synchronize();
    Tensor index_scores = empty({b, S, S});   // unrounded, for the comparison of dsa_index_scores itself
    ops().dsa_index_scores(stream(), q, k, w, S, b, true, index_scores);
    synchronize();

    for (const int cp : {2, 4}) {
        const int64_t s = S / cp, n = s * b, chunk = s / 2;
        std::vector<double> dk_sum(static_cast<size_t>(N * d), 0.0);
        for (int rank = 0; rank < cp; ++rank) {
            const SeqPositions at{rank * chunk, chunk, (2 * cp - 1 - rank) * chunk};
            const std::string  what = "CP " + std::to_string(cp) + " rank " + std::to_string(rank) + ": ";
            auto local_rows = [&](const Tensor & t) {   // (s b, width) from the whole (S b, width)
                const int64_t width = t.numel() / N;
                Tensor        out   = empty({n, width}, t.dtype());
                for (int64_t i = 0; i < s; ++i) {
                    for (int64_t bi = 0; bi < b; ++bi) {
                        std::memcpy(static_cast<char *>(out.data_ptr()) + (i * b + bi) * width * static_cast<int64_t>(dtype_size(t.dtype())),
                                    static_cast<const char *>(t.data_ptr()) + (at(i) * b + bi) * width * static_cast<int64_t>(dtype_size(t.dtype())),
                                    static_cast<size_t>(width * static_cast<int64_t>(dtype_size(t.dtype()))));
                    }
                }
                return out;
            };
            auto local_planes = [&](const Tensor & t) {   // (b, s, S) from the whole (b, S, S)
                Tensor out = empty({b, s, S}, t.dtype());
                for (int64_t bi = 0; bi < b; ++bi) {
                    for (int64_t i = 0; i < s; ++i) {
                        std::memcpy(static_cast<char *>(out.data_ptr()) + (bi * s + i) * S * static_cast<int64_t>(dtype_size(t.dtype())),
                                    static_cast<const char *>(t.data_ptr()) + (bi * S + at(i)) * S * static_cast<int64_t>(dtype_size(t.dtype())),
                                    static_cast<size_t>(S * static_cast<int64_t>(dtype_size(t.dtype()))));
                    }
                }
                return out;
            };
            auto same = [&](const char * name, const Tensor & got, const Tensor & want) {
                EXPECT_EQ(0, std::memcmp(got.data_ptr(), want.data_ptr(), got.nbytes()))
                    << what << name << " differs from the whole run's rows";
            };
            const Tensor q_r = local_rows(q), w_r = local_rows(w), rows_r = local_rows(rows), scores_r = local_planes(scores);
            Tensor s_r = empty({b, s, S}), mask_r = empty({b, s, S}, DType::u8), target_r = empty({b, s, S});
            Tensor kl_r = empty({n}), grad_r = empty({b, s, S});
            Tensor dq_r = empty({n, H * d}), dk_r = empty({N, d}), dw_r = empty({n, H});
            ops().dsa_index_scores(stream(), q_r, k, w_r, s, b, true, s_r, at);
            ops().dsa_topk_mask(stream(), scores_r, topk, mask_r, at);
            AttentionShape shape = AttentionShape(s, b, heads, heads, hd, stride).against_kv(S);
            shape.q_pos          = at;
            shape.key_mask       = mask_r;
            ops().dsa_attention_target(stream(), rows_r, shape, scale, target_r, kv);
            ops().dsa_indexer_loss(stream(), scores_r, target_r, weight, kl_r, grad_r, mask_r, at);
            ops().dsa_index_scores_backward(stream(), q_r, k, w_r, local_planes(dscores), s, b, true, dq_r, dk_r, dw_r, at);
            synchronize();
            same("scores", s_r, local_planes(index_scores));
            same("the top-k mask", mask_r, local_planes(mask));
            same("the sparse target", target_r, local_planes(target));
            Tensor kl_want = empty({n});   // kl is (b, s): sequence-major
            for (int64_t bi = 0; bi < b; ++bi) {
                for (int64_t i = 0; i < s; ++i) kl_want.data<float>()[bi * s + i] = kl.data<float>()[bi * S + at(i)];
            }
            same("kl", kl_r, kl_want);
            same("dscores", grad_r, local_planes(grad));
            same("dq", dq_r, local_rows(dq));
            same("dw", dw_r, local_rows(dw));
            for (int64_t e = 0; e < N * d; ++e) dk_sum[static_cast<size_t>(e)] += dk_r.data<float>()[e];
        }
        EXPECT_TRUE(close_to_max("dk summed over CP " + std::to_string(cp), dk.data<float>(), dk_sum, 1e-6));
    }
}

// The top-k selection (Ops::dsa_topk_mask) against its definition, key j of row i held when fewer than k causal keys
// outrank it (a higher score, or the same and earlier): 3 sequences of 40, scores of few distinct values (ties
// everywhere, as the ReLU's zeros make them) and continuous ones, k 1, 5 and 40 (every causal key); exact. Then
// the sparse loss: the target's softmax and the KL over each row's selected keys only, against double references
// (within 1e-5 of each tensor's largest), the other keys exactly 0 in target and dscores.
TEST(OpsDsa, TopkMaskAndTheSparseLossFollowTheirDefinitions) {
    const int64_t s = 40, b = 3;
    for (const bool ties : {true, false}) {
        Tensor scores = random_f32({b, s, s}, ties ? 9401 : 9402, -2.0f, 2.0f);
        if (ties) {
            for (int64_t e = 0; e < scores.numel(); ++e) scores.data<float>()[e] = std::max(0.0f, std::round(scores.data<float>()[e]));
        }
        for (const int64_t k : {int64_t{1}, int64_t{5}, s}) {
            Tensor mask = empty({b, s, s}, DType::u8);
            ops().dsa_topk_mask(stream(), scores, k, mask);
            synchronize();
            int64_t wrong = 0, held = 0;
            for (int64_t row = 0; row < b * s; ++row) {
                const int64_t i = row % s;
                const float * sc = scores.data<float>() + row * s;
                for (int64_t j = 0; j < s; ++j) {
                    int64_t above = 0;
                    for (int64_t x = 0; x <= i; ++x) above += sc[x] > sc[j] || (sc[x] == sc[j] && x < j);
                    const bool want = j <= i && above < k;
                    const bool got  = mask.data<uint8_t>()[row * s + j] != 0;
                    wrong += want != got;
                    held += got;
                }
            }
            EXPECT_EQ(wrong, 0) << (ties ? "tied" : "continuous") << " scores, k " << k;
            int64_t want_held = 0;
            for (int64_t i = 0; i < s; ++i) want_held += b * std::min(i + 1, k);
            EXPECT_EQ(held, want_held) << "k " << k;
        }
    }

    // The sparse loss: a mask of k = 4 from random scores; the target of packed rows of 2 heads of 6.
    const int64_t n = s * b, heads = 2, hd = 6, stride = 3 * heads * hd, k = 4;
    const float   scale = 0.4f, weight = 0.3f;
    const Tensor  scores = random_f32({b, s, s}, 9403, -3.0f, 3.0f);
    Tensor        mask   = empty({b, s, s}, DType::u8);
    ops().dsa_topk_mask(stream(), scores, k, mask);
    const Tensor  rows = random_f32({n, stride}, 9404, -2.0f, 2.0f);
    AttentionShape shape(s, b, heads, heads, hd, stride);
    shape.key_mask = mask;
    Tensor target = empty({b, s, s}), kl = empty({n}), grad = empty({b, s, s});
    ops().dsa_attention_target(stream(), rows, shape, scale, target);
    ops().dsa_indexer_loss(stream(), scores, target, weight, kl, grad, mask);
    synchronize();
    const std::vector<double> rv = values(rows), sv = values(scores);
    auto in = [&](int64_t row, int64_t j) { return mask.data<uint8_t>()[row * s + j] != 0; };
    std::vector<double> rt(static_cast<size_t>(b * s * s), 0.0), rkl(static_cast<size_t>(n), 0.0);
    std::vector<double> rgrad(static_cast<size_t>(b * s * s), 0.0);
    for (int64_t row = 0; row < n; ++row) {
        const int64_t bi = row / s, i = row % s;
        for (int64_t h = 0; h < heads; ++h) {
            std::vector<double> logit(static_cast<size_t>(s), 0.0);
            double              mx = -1e300, sum = 0;
            for (int64_t j = 0; j <= i; ++j) {
                if (!in(row, j)) continue;
                double dot = 0;
                for (int64_t x = 0; x < hd; ++x) dot += rv[(i * b + bi) * stride + h * hd + x] * rv[(j * b + bi) * stride + heads * hd + h * hd + x];
                logit[j] = scale * dot;
                mx       = std::max(mx, logit[j]);
            }
            for (int64_t j = 0; j <= i; ++j) sum += in(row, j) ? std::exp(logit[j] - mx) : 0.0;
            for (int64_t j = 0; j <= i; ++j) rt[row * s + j] += in(row, j) ? std::exp(logit[j] - mx) / sum : 0.0;
        }
        double total = 0, mx = -1e300, sum = 0;
        for (int64_t j = 0; j <= i; ++j) {
            if (!in(row, j)) continue;
            total += rt[row * s + j];
            mx = std::max(mx, sv[row * s + j]);
        }
        for (int64_t j = 0; j <= i; ++j) sum += in(row, j) ? std::exp(sv[row * s + j] - mx) : 0.0;
        for (int64_t j = 0; j <= i; ++j) {
            if (!in(row, j)) continue;
            const double T = rt[row * s + j] / total, log_p = sv[row * s + j] - mx - std::log(sum);
            rkl[row] += weight * T * (std::log(std::max(T, 1e-10)) - log_p);
            rgrad[row * s + j] = weight * (std::exp(log_p) - T);
        }
    }
    EXPECT_TRUE(close_to_max("sparse target", target.data<float>(), rt, 1e-5));
    EXPECT_TRUE(close_to_max("sparse kl", kl.data<float>(), rkl, 1e-5));
    EXPECT_TRUE(close_to_max("sparse dscores", grad.data<float>(), rgrad, 1e-5));
    int64_t outside = 0;
    for (int64_t e = 0; e < b * s * s; ++e) {
        if (mask.data<uint8_t>()[e] == 0) outside += target.data<float>()[e] != 0.0f || grad.data<float>()[e] != 0.0f;
    }
    EXPECT_EQ(outside, 0) << "the keys outside the mask take no target and no gradient";
}
