// Host Adam (optim/host_adam.h): every SIMD body this CPU runs against the scalar twin (identical bits),
// every body against adamw_update (identical bits where the compiler contracts adamw_update into the same
// fma, else the header's tolerance, checked here against an uncontracted copy of its formula), sizes with
// every tail length, bf16 and f32 outputs, thread counts, special values, and the run-time selection.
#include "optim/adamw.h"
#include "core/host_adam.h"

#include <gtest/gtest.h>

#include <bit>
#include <cmath>
#include <cstdio>
#include <string>
#include <cstdlib>
#include <cstring>
#include <vector>

using namespace loom;


namespace {

// adamw_update's multiply-adds are contracted by GCC into host Adam's three fma when the test (and so the
// library) is built for a CPU with FMA; then the two agree bit for bit.
#if defined(__GNUC__) && !defined(__clang__) && defined(__FMA__)
constexpr bool kReferenceContractedLikeHostAdam = true;
#else
constexpr bool kReferenceContractedLikeHostAdam = false;
#endif

const int64_t kSizes[] = {0, 1, 15, 16, 17, 1000003};

// A fixed, portable generator (splitmix64).
struct Rng {
    uint64_t state;
    uint64_t next() {
        uint64_t z = (state += 0x9e3779b97f4a7c15ull);
        z          = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
        z          = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
        return z ^ (z >> 31);
    }
    float uniform() { return static_cast<float>(next() >> 40) * 0x1p-24f * 2.0f - 1.0f; }   // [-1, 1)
};

struct AdamState {
    std::vector<float>    p, g, m, v;   // (n)
    std::vector<uint16_t> out_bf16;     // (n)
    std::vector<float>    out_f32;      // (n)
};

// Parameters over several binades, zero moments.
AdamState state_create(int64_t n, uint64_t seed) {
    AdamState s;
    Rng       rng{seed};
    s.p.resize(n);
    s.g.resize(n);
    s.m.assign(n, 0.0f);
    s.v.assign(n, 0.0f);
    s.out_bf16.assign(n, 0);
    s.out_f32.assign(n, 0.0f);
    for (int64_t i = 0; i < n; ++i) s.p[i] = rng.uniform() * std::ldexp(1.0f, static_cast<int>(rng.next() % 12) - 8);
    return s;
}

// The gradient of step `step`: mostly small, some large, some exactly zero.
void grads_fill(AdamState & s, int64_t step) {
    Rng rng{0x1234u + static_cast<uint64_t>(step)};
    for (size_t i = 0; i < s.g.size(); ++i) {
        uint64_t r = rng.next() % 64;
        s.g[i]     = r == 0 ? 0.0f : rng.uniform() * (r == 1 ? 10.0f : 1e-2f);
    }
}

struct Hyper {
    float lr = 1e-3f, beta1 = 0.9f, beta2 = 0.95f, eps = 1e-8f, weight_decay = 0.1f;
};

enum class Out { none, bf16, f32 };
const Out kOuts[] = {Out::none, Out::bf16, Out::f32};
const char * out_name(Out out) { return out == Out::none ? "none" : out == Out::bf16 ? "bf16" : "f32"; }

HostAdamOut out_of(AdamState & s, Out out) {
    if (out == Out::bf16) return {s.out_bf16.data(), DType::bf16};
    if (out == Out::f32) return {s.out_f32.data(), DType::f32};
    return {};
}

void host_step(AdamState & s, const Hyper & h, int64_t step, Out out, HostAdamIsa isa, int threads = 0) {
    host_adam_step(s.p.data(), s.g.data(), s.m.data(), s.v.data(), static_cast<int64_t>(s.p.size()), h.lr,
                          h.beta1, h.beta2, h.eps, h.weight_decay, step, out_of(s, out), {isa, threads});
}

void reference_step(AdamState & s, const Hyper & h, int64_t step) {
    optim::adamw_update(s.p.data(), s.g.data(), s.m.data(), s.v.data(), static_cast<int64_t>(s.p.size()), h.lr,
                        h.beta1, h.beta2, h.eps, h.weight_decay, step, s.out_bf16.data());
}

// adamw_update's formula with every operation rounded on its own (volatile stops any contraction): what
// adamw_update computes when built without FMA.
void uncontracted_step(AdamState & s, const Hyper & h, int64_t step) {
    const float bc1       = 1.0f - std::pow(h.beta1, static_cast<float>(step));
    const float bc2_sqrt  = std::sqrt(1.0f - std::pow(h.beta2, static_cast<float>(step)));
    const float step_size = h.lr / bc1;
    const float decay     = 1.0f - h.lr * h.weight_decay;
    for (size_t i = 0; i < s.p.size(); ++i) {
        float          gi = s.g[i];
        volatile float a  = h.beta1 * s.m[i];
        volatile float b  = (1.0f - h.beta1) * gi;
        float          mi = a + b;
        volatile float c  = h.beta2 * s.v[i];
        volatile float d  = (1.0f - h.beta2) * gi * gi;
        float          vi = c + d;
        volatile float e  = s.p[i] * decay;
        s.m[i]            = mi;
        s.v[i]            = vi;
        s.p[i]            = e - step_size * mi / (std::sqrt(vi) / bc2_sqrt + h.eps);
        s.out_bf16[i]     = f32_to_bf16_bits(s.p[i]);
    }
}

std::vector<HostAdamIsa> supported_isas() {
    std::vector<HostAdamIsa> isas;
    for (HostAdamIsa isa : {HostAdamIsa::scalar, HostAdamIsa::avx2, HostAdamIsa::avx512}) {
        if (host_adam_isa_supported(isa)) isas.push_back(isa);
    }
    return isas;
}

// Identical bits, NaN payloads aside when nan_payloads_may_differ (two NaN operands: x86 returns the
// payload of the first, and bodies may order operands differently).
template <typename T>
int64_t count_mismatches(const std::vector<T> & a, const std::vector<T> & b, bool nan_payloads_may_differ = false) {
    int64_t bad = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        if (std::memcmp(&a[i], &b[i], sizeof(T)) == 0) continue;
        if (nan_payloads_may_differ) {
            float x, y;
            if constexpr (sizeof(T) == 4) {
                x = std::bit_cast<float>(a[i]);
                y = std::bit_cast<float>(b[i]);
            } else {
                x = bf16_bits_to_f32(a[i]);
                y = bf16_bits_to_f32(b[i]);
            }
            if (std::isnan(x) && std::isnan(y)) continue;
        }
        ++bad;
    }
    return bad;
}

void expect_same_bits(const AdamState & a, const AdamState & b, const std::string & what, bool nans = false) {
    EXPECT_EQ(count_mismatches(a.p, b.p, nans), 0) << what << ": p";
    EXPECT_EQ(count_mismatches(a.m, b.m, nans), 0) << what << ": m";
    EXPECT_EQ(count_mismatches(a.v, b.v, nans), 0) << what << ": v";
    EXPECT_EQ(count_mismatches(a.out_bf16, b.out_bf16, nans), 0) << what << ": bf16 output";
    EXPECT_EQ(count_mismatches(a.out_f32, b.out_f32, nans), 0) << what << ": f32 output";
}

}  // namespace

TEST(HostAdam, EveryBodyMatchesTheScalarTwinBitForBit) {
    for (HostAdamIsa isa : supported_isas()) {
        for (int64_t n : kSizes) {
            for (Out out : kOuts) {
                for (float wd : {0.0f, 0.1f}) {
                    Hyper h;
                    h.weight_decay = wd;
                    AdamState twin = state_create(n, 7), body = twin;
                    for (int64_t step = 1; step <= 3; ++step) {
                        grads_fill(twin, step);
                        grads_fill(body, step);
                        host_step(twin, h, step, out, HostAdamIsa::scalar);
                        host_step(body, h, step, out, isa);
                    }
                    expect_same_bits(body, twin, std::string(host_adam_isa_name(isa)) + " n=" +
                                                     std::to_string(n) + " out=" + out_name(out) +
                                                     " wd=" + std::to_string(wd));
                }
            }
        }
    }
}

// Misaligned starts and every tail length from 0 to 40: the masked (avx512) and scalar (avx2) tails.
TEST(HostAdam, UnalignedStartsAndEveryTailLengthMatchTheTwin) {
    for (HostAdamIsa isa : supported_isas()) {
        for (int64_t offset = 0; offset < 3; ++offset) {
            for (int64_t n = 0; n <= 40; ++n) {
                AdamState twin = state_create(n + offset, 11), body = twin;
                grads_fill(twin, 1);
                grads_fill(body, 1);
                Hyper h;
                for (AdamState * s : {&twin, &body}) {
                    host_adam_step(s->p.data() + offset, s->g.data() + offset, s->m.data() + offset,
                                          s->v.data() + offset, n, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, 1,
                                          {s->out_bf16.data() + offset, DType::bf16},
                                          {s == &twin ? HostAdamIsa::scalar : isa, 1});
                }
                expect_same_bits(body, twin, std::string(host_adam_isa_name(isa)) + " offset=" +
                                                 std::to_string(offset) + " n=" + std::to_string(n));
            }
        }
    }
}

// Steps of at least 2^19 elements write the output with streaming stores after an aligning head: every
// head length (output offsets 0..15 elements) and both output dtypes.
TEST(HostAdam, StreamedOutputsAtEveryAlignmentMatchTheTwin) {
    const int64_t n = (1 << 19) + 37;
    for (HostAdamIsa isa : supported_isas()) {
        for (Out out : {Out::bf16, Out::f32}) {
            for (int64_t offset : {0, 1, 3, 8, 15}) {
                AdamState twin = state_create(n + offset, 13), body = twin;
                grads_fill(twin, 1);
                grads_fill(body, 1);
                Hyper h;
                for (AdamState * s : {&twin, &body}) {
                    HostAdamOut o = out == Out::bf16 ? HostAdamOut{s->out_bf16.data() + offset, DType::bf16}
                                                            : HostAdamOut{s->out_f32.data() + offset, DType::f32};
                    host_adam_step(s->p.data() + offset, s->g.data() + offset, s->m.data() + offset,
                                          s->v.data() + offset, n, h.lr, h.beta1, h.beta2, h.eps, h.weight_decay, 1, o,
                                          {s == &twin ? HostAdamIsa::scalar : isa, 3});
                }
                expect_same_bits(body, twin, std::string(host_adam_isa_name(isa)) + " out=" + out_name(out) +
                                                 " offset=" + std::to_string(offset));
            }
        }
    }
}

TEST(HostAdam, MatchesAdamwUpdateWithinTheStatedRule) {
    constexpr int kSteps = 4;
    for (HostAdamIsa isa : supported_isas()) {
        for (int64_t n : kSizes) {
            for (float wd : {0.0f, 0.1f}) {
                Hyper h;
                h.weight_decay = wd;
                AdamState ref = state_create(n, 3), bf16 = ref, f32 = ref;
                for (int64_t step = 1; step <= kSteps; ++step) {
                    for (AdamState * s : {&ref, &bf16, &f32}) grads_fill(*s, step);
                    reference_step(ref, h, step);
                    host_step(bf16, h, step, Out::bf16, isa);
                    host_step(f32, h, step, Out::f32, isa);
                }
                const std::string what = std::string(host_adam_isa_name(isa)) + " n=" + std::to_string(n) +
                                         " wd=" + std::to_string(wd);
                // The f32 output is the updated master itself.
                EXPECT_EQ(count_mismatches(f32.out_f32, f32.p), 0) << what;
                if (kReferenceContractedLikeHostAdam) {
                    EXPECT_EQ(count_mismatches(bf16.p, ref.p), 0) << what << ": p";
                    EXPECT_EQ(count_mismatches(bf16.m, ref.m), 0) << what << ": m";
                    EXPECT_EQ(count_mismatches(bf16.v, ref.v), 0) << what << ": v";
                    EXPECT_EQ(count_mismatches(bf16.out_bf16, ref.out_bf16), 0) << what << ": bf16 output";
                    EXPECT_EQ(count_mismatches(f32.p, ref.p), 0) << what << ": p (f32 output run)";
                }
                for (int64_t i = 0; i < n; ++i) {
                    float tol = kSteps * (0x1p-21f * std::fabs(ref.p[i]) + 0x1p-20f * h.lr);
                    ASSERT_LE(std::fabs(bf16.p[i] - ref.p[i]), tol) << what << " element " << i;
                    ASSERT_EQ(bf16.out_bf16[i], f32_to_bf16_bits(bf16.p[i])) << what << " element " << i;
                }
            }
        }
    }
}

// The tolerance the header states for a differently contracted adamw_update holds against the
// uncontracted formula (what adamw_update computes without FMA), and is not vacuous.
TEST(HostAdam, StatedToleranceCoversAnUncontractedReference) {
    constexpr int kSteps = 4;
    const int64_t n      = 1000003;
    Hyper         h;
    AdamState     ref = state_create(n, 5), host = ref;
    for (int64_t step = 1; step <= kSteps; ++step) {
        grads_fill(ref, step);
        grads_fill(host, step);
        uncontracted_step(ref, h, step);
        host_step(host, h, step, Out::bf16, host_adam_isa_best());
    }
    int64_t differ = 0;
    double  worst  = 0;   // the largest |p - p_ref| as a fraction of the tolerance
    for (int64_t i = 0; i < n; ++i) {
        float tol = kSteps * (0x1p-21f * std::fabs(ref.p[i]) + 0x1p-20f * h.lr);
        float d   = std::fabs(host.p[i] - ref.p[i]);
        differ += d != 0;
        worst = std::max(worst, static_cast<double>(d / tol));
        ASSERT_EQ(host.out_bf16[i], f32_to_bf16_bits(host.p[i])) << "element " << i;
    }
    EXPECT_LE(worst, 1.0) << "|p - p_ref| / tolerance";
    EXPECT_GT(differ, 0) << "the uncontracted reference rounds differently somewhere";
    std::printf("uncontracted reference: %lld of %lld elements differ, worst |p - p_ref| = %.3f x tolerance\n",
                static_cast<long long>(differ), static_cast<long long>(n), worst);
}

TEST(HostAdam, ThreadCountsGiveIdenticalBits) {
    const int64_t n = 1000003;
    for (HostAdamIsa isa : supported_isas()) {
        Hyper     h;
        AdamState one = state_create(n, 9);
        grads_fill(one, 1);
        host_step(one, h, 1, Out::bf16, isa, 1);
        for (int threads : {2, 3, 7, 61}) {
            AdamState s = state_create(n, 9);
            grads_fill(s, 1);
            host_step(s, h, 1, Out::bf16, isa, threads);
            expect_same_bits(s, one, std::string(host_adam_isa_name(isa)) + " threads=" + std::to_string(threads));
        }
    }
}

// Arbitrary bit patterns (NaN, Inf, subnormals, bf16 rounding ties) in p, g, m, v: the SIMD bodies'
// bf16 rounding and NaN handling are the scalar f32_to_bf16_bits.
TEST(HostAdam, SpecialValuesMatchTheTwin) {
    const int64_t n = 4099;
    Rng           rng{42};
    AdamState     base = state_create(n, 1);
    for (int64_t i = 0; i < n; ++i) {
        uint32_t bits = static_cast<uint32_t>(rng.next());
        if (i % 5 == 0) bits = (bits & 0xffff0000u) | 0x8000u;   // a tie between two bf16 values
        if (i % 7 == 0) bits &= 0x807fffffu;                     // subnormal
        base.p[i] = std::bit_cast<float>(bits);
        base.g[i] = i % 3 == 0 ? std::bit_cast<float>(static_cast<uint32_t>(rng.next())) : rng.uniform();
        base.m[i] = i % 11 == 0 ? std::bit_cast<float>(static_cast<uint32_t>(rng.next())) : 0.0f;
        base.v[i] = i % 13 == 0 ? std::bit_cast<float>(static_cast<uint32_t>(rng.next())) : 0.0f;
    }
    for (float lr : {0.0f, 1e-3f}) {
        Hyper h;
        h.lr = lr;
        for (HostAdamIsa isa : supported_isas()) {
            AdamState twin = base, body = base;
            host_step(twin, h, 1, Out::bf16, HostAdamIsa::scalar);
            host_step(body, h, 1, Out::bf16, isa);
            expect_same_bits(body, twin, std::string(host_adam_isa_name(isa)) + " lr=" + std::to_string(lr), true);
        }
    }
    // With lr 0 and zero moments p is unchanged (fma(p, 1, -0)): the output is exactly its bf16 rounding.
    Hyper h;
    h.lr = 0.0f;
    AdamState s = base;
    for (int64_t i = 0; i < n; ++i) s.g[i] = 0.0f, s.m[i] = 0.0f, s.v[i] = 0.0f;
    AdamState before = s;
    host_step(s, h, 1, Out::bf16, host_adam_isa_best());
    for (int64_t i = 0; i < n; ++i) {
        if (std::isnan(before.p[i])) {
            ASSERT_TRUE(std::isnan(bf16_bits_to_f32(s.out_bf16[i]))) << i;
        } else {
            ASSERT_EQ(s.out_bf16[i], f32_to_bf16_bits(before.p[i])) << i;
        }
    }
}

TEST(HostAdam, BodySelection) {
    EXPECT_TRUE(host_adam_isa_supported(host_adam_isa_best()));
    for (HostAdamIsa isa : {HostAdamIsa::automatic, HostAdamIsa::scalar, HostAdamIsa::avx2, HostAdamIsa::avx512}) {
        EXPECT_EQ(host_adam_isa_from_name(host_adam_isa_name(isa)), isa);
    }
    EXPECT_THROW(host_adam_isa_from_name("sse9"), Error);

    unsetenv("LOOM_HOST_ADAM_ISA");
    EXPECT_EQ(host_adam_isa_resolve(HostAdamIsa::automatic), host_adam_isa_best());
    setenv("LOOM_HOST_ADAM_ISA", "scalar", 1);
    EXPECT_EQ(host_adam_isa_resolve(HostAdamIsa::automatic), HostAdamIsa::scalar);
    EXPECT_EQ(host_adam_isa_resolve(host_adam_isa_best()), host_adam_isa_best())
        << "an explicit body wins over the environment";
    setenv("LOOM_HOST_ADAM_ISA", "bogus", 1);
    EXPECT_THROW(host_adam_isa_resolve(HostAdamIsa::automatic), Error);
    for (HostAdamIsa isa : {HostAdamIsa::avx2, HostAdamIsa::avx512}) {
        setenv("LOOM_HOST_ADAM_ISA", host_adam_isa_name(isa), 1);
        if (host_adam_isa_supported(isa)) {
            EXPECT_EQ(host_adam_isa_resolve(HostAdamIsa::automatic), isa);
        } else {
            EXPECT_THROW(host_adam_isa_resolve(HostAdamIsa::automatic), Error);
            EXPECT_THROW(host_adam_isa_resolve(isa), Error);
        }
    }
    unsetenv("LOOM_HOST_ADAM_ISA");

    // Arguments are checked before any work.
    float x = 0;
    EXPECT_THROW(host_adam_step(&x, &x, &x, &x, 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 0), Error);
    EXPECT_THROW(host_adam_step(&x, &x, &x, &x, 1, 1e-3f, 0.9f, 0.95f, 1e-8f, 0.0f, 1, {&x, DType::i32}), Error);
    EXPECT_EQ(host_adam_bytes_per_element({}), 28);
    EXPECT_EQ(host_adam_bytes_per_element({&x, DType::bf16}), 30);
    EXPECT_EQ(host_adam_bytes_per_element({&x, DType::f32}), 32);
}
