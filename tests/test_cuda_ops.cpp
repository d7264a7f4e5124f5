// The CUDA backend against its oracle, the CPU backend (docs/architecture.md 3.2: a CUDA kernel is done only
// when a test compares it with its CPU twin). Every op runs on the same random inputs on cpu:0 and cuda:0 and the
// results are compared element-wise with the tolerance stated next to each test:
//   exact (bitwise)     copy, copy_columns, fill_zero, convert, round_to_bf16, scale, add_inplace, bias_add,
//                       AdamW and multi-tensor AdamW (the same IEEE operations in the same order, explicit fma
//                       on both sides)
//   1e-5 x max(1, |ref|) norms forward and backward, GELU/SwiGLU (tanh/exp differ by a few ulp)
//   exact (bitwise)     bias_backward, dbeta (f32 sums over rows in core/column_sums.h's order on both)
//   1e-5 / 1e-3 x sum |a_ik b_kj|   GEMM with f32 / bf16 operands (f32 accumulation in another order);
//                       gemm_bias the same with |bias_j| among the terms; the GELU and bias-gradient epilogues
//                       (gemm_bias_gelu, gemm_gelu_backward, gemm_weight_grad) with the bounds beside their tests
//   1e-12 relative      sum_of_squares (double partial sums, tree-reduced on the GPU)
//   exact (bitwise)     dropout (core/dropout.h's hash: the same masks, x * (1 / (1 - p)) the same product),
//                       embedding_forward (f32 and bf16 tables), embedding_backward (each element's f32
//                       additions in the CPU's row order), vocab_shard_ids, row_max, label_logit, loss_grad
//   1e-5 x max(1, |ref|)    rope (cosf/sinf differ by a few ulp), row_sum_exp and cross_entropy_forward's loss
//                       and lse (the sum of exps in another order), lse_and_loss (logf)
//   1e-5 x max(0.01, |ref|) cross_entropy_backward from the same lse (exp_approx's polynomial, which the
//                       host compiler may fuse), its padding exactly 0
//   2e-5 x max(1, |ref|)    attention out and lse, 5e-5 its dqkv (f32 dot products and sums in tiles of 32 keys
//                       and warp trees); a second backward is bitwise the first (no atomics)
// The same ops on bf16 activations: bitwise where the f32 kernels are, else their tolerance plus one bf16 rounding.
// Out-of-range tokens and labels give the CPU's error text at the next synchronize.
// It also checks the CUDA device's allocators (pools, statistics, stream-ordered frees), stream and event
// ordering across two streams, host work via submit, and Loom graph capture into CUDA graphs (replays bitwise
// the eager ops, replayable nodes between segments, a fork/join across streams, the graph pool, refusals).
//
// Without a CUDA device every test skips with a message: the backend was compiled and linked, not run. The
// same file built with LOOM_CUDA_EMU (test_cuda_ops_emu) runs every test on the emulated device, every
// machine, every CI run.
#include "backend/cpu/cpu_device.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/fused_attention_stats.h"
#include "backend/cuda/gemm_plans.h"
#include "core/dropout.h"
#include "core/graph.h"
#include "core/ops.h"
#include "core/tensor.h"
#include "tests/cuda_transfer.h"
#include "tests/error_text.h"
#include "tests/random_values.h"

#include <gtest/gtest.h>

#include <atomic>
#include <bit>
#include <algorithm>
#include <cmath>
#include <cstring>
#include <functional>
#include <memory>
#include <set>
#include <string>
#include <tuple>
#include <vector>

#ifdef LOOM_CUDA_EMU
namespace loom_emu {
long long emu_lt_heuristic_calls();   // the emulated cuBLASLt's count (its cublasLt.h, not on this path)
long long emu_lt_reduced_precision_queries();   // of those, the ones whose preference allowed 16-bit split-K sums
}
#endif

using namespace loom;

namespace {

// The backend under test: loom::cuda on a GPU, or loom::cuda_emu (the same sources on the emulated device)
// in the test_cuda_ops_emu build of this file, which defines LOOM_CUDA_EMU.
namespace gpu_backend = loom::LOOM_CUDA_NS;

#define SKIP_WITHOUT_CUDA()                                                                            \
    if (gpu_backend::device_count() == 0) {                                                            \
        GTEST_SKIP() << "no CUDA device on this machine: the CUDA backend was compiled and linked, not run"; \
    }

Device & gpu() { return gpu_backend::device(0); }
// Elements for the tests that need work long enough for another stream or the host to overtake it: a GPU
// needs millions; the emulated device runs kernels on the CPU, where a few hundred thousand take as long.
int64_t long_work_elements(int64_t on_a_gpu) {
    return std::string(gpu().kind_name()) == "cuda-emu" ? on_a_gpu / 64 : on_a_gpu;
}
Stream & gs() { return gpu().compute_stream(); }
Ops &    gops() { return gpu().ops(); }
Device & cpu_dev() { return cpu::device(); }
Stream & cs() { return cpu_dev().compute_stream(); }
Ops &    cops() { return cpu_dev().ops(); }

Tensor cpu_tensor(const Shape & shape, DType dtype = DType::f32) { return Tensor::empty(shape, dtype, cpu_dev()); }

// f32 values uniform in [-scale, scale], converted to `dtype` (f32, bf16, f16) on the host.
Tensor random_cpu(const Shape & shape, uint64_t seed, float scale = 1.0f, DType dtype = DType::f32) {
    Tensor             t = cpu_tensor(shape, dtype);
    std::vector<float> v = loom::testing::random_vector(t.numel(), seed, scale);
    convert(v.data(), DType::f32, t.data_ptr(), dtype, v.size());
    return t;
}

// CPU <-> cuda:0 (tests/cuda_transfer.h).
Tensor to_gpu(const Tensor & host) { return loom::testing::to_gpu(host, gpu()); }
using loom::testing::to_cpu;

Tensor clone_cpu(const Tensor & t) {
    Tensor c = cpu_tensor(t.shape(), t.dtype());
    c.copy_from(t);
    return c;
}

std::vector<double> values(const Tensor & t) {
    std::vector<double> out(static_cast<size_t>(t.numel()));
    std::vector<float>  f(out.size());
    convert(t.data_ptr(), t.dtype(), f.data(), DType::f32, f.size());
    for (size_t i = 0; i < f.size(); ++i) out[i] = f[i];
    return out;
}

void expect_bitwise(const Tensor & ref, const Tensor & got, const std::string & what) {
    ASSERT_EQ(ref.nbytes(), got.nbytes()) << what;
    const auto * a = static_cast<const unsigned char *>(ref.data_ptr());
    const auto * b = static_cast<const unsigned char *>(got.data_ptr());
    size_t       bad = 0, first = 0;
    for (size_t i = 0; i < ref.nbytes(); ++i) {
        if (a[i] != b[i] && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " bytes differ, the first at byte " << first;
}

// |got - ref| <= tol * max(floor, |ref|) element-wise (floor 1: values of order 1 are compared absolutely).
void expect_close(const Tensor & ref, const Tensor & got, double tol, const std::string & what, double floor = 1.0) {
    std::vector<double> r = values(ref), g = values(got);
    ASSERT_EQ(r.size(), g.size()) << what;
    double worst = 0;
    size_t at    = 0;
    for (size_t i = 0; i < r.size(); ++i) {
        double err = std::fabs(g[i] - r[i]) / std::max(floor, std::fabs(r[i]));
        if (!(err <= worst)) {   // NaN counts as the worst
            worst = std::isnan(err) ? INFINITY : err;
            at    = i;
        }
    }
    EXPECT_LE(worst, tol) << what << ": worst relative error at element " << at << " (cpu " << r[at] << ", cuda " << g[at] << ")";
}

// ---------------------------------------------------------------------------------------------- GEMM

TEST(CudaOps, GemmF32Bf16AndF16EveryTransposeWithAndWithoutAccumulateMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    struct Case { int64_t m, n, k; };
    uint64_t seed = 100;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        const double tol = dtype == DType::f32 ? 1e-5 : 1e-3;
        for (Case sz : {Case{1, 1, 1}, Case{37, 53, 71}, Case{128, 64, 256}, Case{5, 300, 17}}) {
            for (int t = 0; t < 8; ++t) {
                const bool ta = t & 1, tb = t & 2, acc = t & 4;
                const std::string what = std::string(dtype_name(dtype)) + " m " + std::to_string(sz.m) + " n " +
                                         std::to_string(sz.n) + " k " + std::to_string(sz.k) + (ta ? " ta" : "") +
                                         (tb ? " tb" : "") + (acc ? " accumulate" : "");
                // a is a view one element into its storage, so its address is only 2- or 4-byte aligned.
                Tensor a_store = random_cpu({sz.m * sz.k + 1}, ++seed, 1.0f, dtype);
                Tensor a       = a_store.slice(1, ta ? Shape{sz.k, sz.m} : Shape{sz.m, sz.k});
                Tensor b       = random_cpu(tb ? Shape{sz.n, sz.k} : Shape{sz.k, sz.n}, ++seed, 1.0f, dtype);
                Tensor c0      = random_cpu({sz.m, sz.n}, ++seed);
                Tensor c_cpu   = clone_cpu(c0);
                cops().gemm(cs(), a, ta, b, tb, c_cpu, acc);
                cs().synchronize();
                Tensor a_gpu = to_gpu(a_store).slice(1, a.shape());
                Tensor c_gpu = to_gpu(c0);
                gops().gemm(gs(), a_gpu, ta, to_gpu(b), tb, c_gpu, acc);
                Tensor got = to_cpu(c_gpu);
                // Tolerance per element: tol * sum_k |a_ik b_kj| (+ |c0| accumulating).
                std::vector<double> av = values(a), bv = values(b), c0v = values(c0), ref = values(c_cpu), g = values(got);
                for (int64_t i = 0; i < sz.m; ++i) {
                    for (int64_t j = 0; j < sz.n; ++j) {
                        double mag = acc ? std::fabs(c0v[i * sz.n + j]) : 0.0;
                        for (int64_t p = 0; p < sz.k; ++p) {
                            mag += std::fabs((ta ? av[p * sz.m + i] : av[i * sz.k + p]) * (tb ? bv[j * sz.k + p] : bv[p * sz.n + j]));
                        }
                        ASSERT_LE(std::fabs(g[i * sz.n + j] - ref[i * sz.n + j]), tol * mag + 1e-30)
                            << what << " at (" << i << ", " << j << ")";
                    }
                }
            }
        }
    }
}

// gemm_bias against the CPU's gemm + bias_add, the GEMM's tolerance with |bias_j| among the terms. Aligned
// operands take cuBLASLt's bias epilogue; `offset` 1 puts a, the bias and c one element into their storage
// (2- or 4-byte aligned), where cuBLASLt may have no epilogue kernel and the product plus bias_add's kernel
// run instead; k = 0 always takes that path (c is the bias).
// cuBLASLt's plans (descriptors, layouts and the heuristic's algorithm) are cached per shape, transposes,
// operand type, epilogue and alignments: a GEMM whose kind was seen before, on other tensors, makes no
// heuristic query, so a training step after warm-up makes none. On cuda-emu the emulated library's own count
// of heuristic calls agrees with the backend's.
TEST(CudaOps, AGemmOfAKindSeenBeforeMakesNoHeuristicQuery) {
    SKIP_WITHOUT_CUDA();
    const int64_t m = 72, n = 40, k = 24;   // a shape no other test uses: the cache lives as long as the process
    auto          gemm = [&](bool bias, bool ta) {
        Tensor a = to_gpu(random_cpu(ta ? Shape{k, m} : Shape{m, k}, 951, 1.0f, DType::bf16));
        Tensor b = to_gpu(random_cpu({k, n}, 952, 1.0f, DType::bf16));
        Tensor c = Tensor::empty({m, n}, DType::f32, gpu());
        if (bias) {
            gops().gemm_bias(gs(), a, ta, b, false, c, to_gpu(random_cpu({n}, 953)));
        } else {
            gops().gemm(gs(), a, ta, b, false, c);
        }
        gs().synchronize();
    };
    struct Count { int64_t lookups, queries; long long library, reduced; };
    auto now = [] {
        const gpu_backend::GemmPlanStats st = gpu_backend::gemm_plan_stats();
#ifdef LOOM_CUDA_EMU
        return Count{st.lookups, st.heuristic_queries, loom_emu::emu_lt_heuristic_calls(),
                     loom_emu::emu_lt_reduced_precision_queries()};
#else
        return Count{st.lookups, st.heuristic_queries, 0, 0};
#endif
    };
    const struct { bool bias, ta; int64_t new_queries; const char * what; } calls[] = {
        {false, false, 1, "first of its kind"}, {false, false, 0, "again, on other tensors"},
        {true, false, 1, "with the bias epilogue"}, {true, false, 0, "with the bias epilogue again"},
        {false, true, 1, "a transposed operand"}, {false, false, 0, "the first kind once more"}};
    for (const auto & call : calls) {
        const Count before = now();
        gemm(call.bias, call.ta);
        const Count after = now();
        EXPECT_EQ(after.lookups - before.lookups, 1) << call.what;
        EXPECT_EQ(after.queries - before.queries, call.new_queries) << call.what;
#ifdef LOOM_CUDA_EMU
        EXPECT_EQ(after.library - before.library, call.new_queries) << call.what << ": the emulated library's count";
        // Every plan restricts split-K sums to f32 (--disable-bf16-reduced-precision-matmul, always on).
        EXPECT_EQ(after.reduced - before.reduced, 0) << call.what << ": a plan allowed split-K sums in the output type";
#endif
    }
}

TEST(CudaOps, GemmBiasF32Bf16AndF16MatchesTheCpusGemmThenBiasAdd) {
    SKIP_WITHOUT_CUDA();
    struct Case { int64_t m, n, k, offset; };
    uint64_t seed = 900;
    for (DType dtype : {DType::f32, DType::bf16, DType::f16}) {
        const double tol = dtype == DType::f32 ? 1e-5 : 1e-3;
        for (Case sz : {Case{128, 64, 256, 0}, Case{37, 48, 40, 0}, Case{64, 96, 32, 0}, Case{37, 53, 71, 1},
                        Case{5, 300, 17, 1}, Case{1, 1, 1, 0}, Case{6, 3, 0, 0}}) {
            for (int t = 0; t < 4; ++t) {
                const bool        ta = t & 1, tb = t & 2;
                const std::string what = std::string(dtype_name(dtype)) + " m " + std::to_string(sz.m) + " n " +
                                         std::to_string(sz.n) + " k " + std::to_string(sz.k) + " offset " +
                                         std::to_string(sz.offset) + (ta ? " ta" : "") + (tb ? " tb" : "");
                const int64_t o       = sz.offset;
                // Storage one element longer than the views: never empty (k = 0) when copied to the GPU.
                Tensor        a_store = random_cpu({sz.m * sz.k + o + 1}, ++seed, 1.0f, dtype);
                Tensor        a       = a_store.slice(o, ta ? Shape{sz.k, sz.m} : Shape{sz.m, sz.k});
                Tensor        b_store = random_cpu({sz.n * sz.k + 1}, ++seed, 1.0f, dtype);
                Tensor        b       = b_store.slice(0, tb ? Shape{sz.n, sz.k} : Shape{sz.k, sz.n});
                Tensor        bias_store = random_cpu({sz.n + o}, ++seed);
                Tensor        bias       = bias_store.slice(o, Shape{sz.n});
                Tensor        c_store    = random_cpu({sz.m * sz.n + o}, ++seed);   // overwritten
                Tensor        c_cpu      = clone_cpu(c_store).slice(o, Shape{sz.m, sz.n});
                cops().gemm(cs(), a, ta, b, tb, c_cpu);
                cops().bias_add(cs(), c_cpu, bias);
                cs().synchronize();
                Tensor c_gpu = to_gpu(c_store).slice(o, Shape{sz.m, sz.n});
                gops().gemm_bias(gs(), to_gpu(a_store).slice(o, a.shape()), ta, to_gpu(b_store).slice(0, b.shape()), tb, c_gpu,
                                 to_gpu(bias_store).slice(o, Shape{sz.n}));
                Tensor got = to_cpu(c_gpu);
                std::vector<double> av = values(a), bv = values(b), biasv = values(bias), ref = values(c_cpu),
                                    g = values(got);
                for (int64_t i = 0; i < sz.m; ++i) {
                    for (int64_t j = 0; j < sz.n; ++j) {
                        double mag = std::fabs(biasv[j]);
                        for (int64_t p = 0; p < sz.k; ++p) {
                            mag += std::fabs((ta ? av[p * sz.m + i] : av[i * sz.k + p]) * (tb ? bv[j * sz.k + p] : bv[p * sz.n + j]));
                        }
                        ASSERT_LE(std::fabs(g[i * sz.n + j] - ref[i * sz.n + j]), tol * mag + 1e-30)
                            << what << " at (" << i << ", " << j << ")";
                    }
                }
            }
        }
    }
}

// gemm_bias_gelu and gemm_gelu_backward against their contract on the CPU: gemm, then bias_gelu_forward or
// gelu_backward. Aligned operands with n a multiple of 8 take cuBLASLt's GELU_AUX(_BIAS) and DGELU epilogues
// (on cuda-emu the test holds that they ran, by gemm_plan_stats' counts); n = 53 (the auxiliary matrix's
// leading dimension is not a multiple of 8), operands one element into their storage, or k = 0 fall back to
// the product and the activation's kernel. Per element, with G = sum_k |a_ik b_kj| (+ |bias_j|), the GEMM's
// tol (1e-5 f32, 1e-3 bf16) and gelu' <= 1.13:
//   pre  tol G, and for bf16 also 2^-8 (|pre| + G): the CPU rounds the product, then the sum with the bias;
//        the epilogue rounds the sum once
//   y    1.13 x pre's bound + 1e-5 max(1, |y|), and for bf16 also 2^-8 |y|: the epilogue's GELU reads the f32
//        sum where the CPU reads the stored pre
//   dx   1.13 tol G + 1e-5 max(1, |dx|); for bf16 also 2^-8 (|dx| + 1.13 G): the CPU rounds the product before
//        gelu' multiplies it
TEST(CudaOps, GeluEpiloguesMatchTheCpusGemmThenGelu) {
    SKIP_WITHOUT_CUDA();
    struct Case { int64_t m, n, k, offset; bool fused; };
    uint64_t seed = 1700;
    for (DType dtype : {DType::f32, DType::bf16}) {
        const double tol = dtype == DType::f32 ? 1e-5 : 1e-3, r = dtype == DType::bf16 ? 1.0 / 256 : 0.0;
        for (Case sz : {Case{64, 96, 48, 0, true}, Case{37, 53, 40, 0, false}, Case{64, 96, 48, 1, false},
                        Case{6, 8, 0, 0, false}}) {
            for (int variant = 0; variant < 4; ++variant) {
                const bool        with_bias = variant & 1, trans = variant & 2;   // trans: a and b transposed
                const int64_t     m = sz.m, n = sz.n, k = sz.k, o = sz.offset;
                const std::string what = std::string(dtype_name(dtype)) + " m " + std::to_string(m) + " n " +
                                         std::to_string(n) + " k " + std::to_string(k) + " offset " + std::to_string(o) +
                                         (with_bias ? " bias" : "") + (trans ? " ta tb" : "");
                Tensor a_store = random_cpu({m * k + o + 1}, ++seed, 1.0f, dtype);
                Tensor a       = a_store.slice(o, trans ? Shape{k, m} : Shape{m, k});
                Tensor b_store = random_cpu({n * k + 1}, ++seed, 1.0f, dtype);
                Tensor b       = b_store.slice(0, trans ? Shape{n, k} : Shape{k, n});
                Tensor bias_store = random_cpu({n + o}, ++seed);
                Tensor bias       = with_bias ? bias_store.slice(o, Shape{n}) : Tensor();
                Tensor pre_store  = random_cpu({m * n + o}, ++seed, 2.0f, dtype);   // backward's input
                Tensor pre_in     = pre_store.slice(o, Shape{m, n});

                // The CPU: the contract's two steps.
                Tensor pre_c = cpu_tensor({m, n}, dtype), y_c = cpu_tensor({m, n}, dtype), dx_c = cpu_tensor({m, n}, dtype);
                cops().gemm_bias_gelu(cs(), a, trans, b, trans, pre_c, y_c, bias);
                cops().gemm_gelu_backward(cs(), a, trans, b, trans, pre_in, dx_c);
                cs().synchronize();

                // The device, its outputs `o` elements into their storage as the inputs.
                const gpu_backend::GemmPlanStats before = gpu_backend::gemm_plan_stats();
                Tensor a_g = to_gpu(a_store).slice(o, a.shape()), b_g = to_gpu(b_store).slice(0, b.shape());
                Tensor bias_g = with_bias ? to_gpu(bias_store).slice(o, Shape{n}) : Tensor();
                Tensor pre_g  = Tensor::empty({m * n + o}, dtype, gpu()).slice(o, Shape{m, n});
                Tensor y_g    = Tensor::empty({m * n + o}, dtype, gpu()).slice(o, Shape{m, n});
                Tensor dx_g   = Tensor::empty({m * n + o}, dtype, gpu()).slice(o, Shape{m, n});
                gops().gemm_bias_gelu(gs(), a_g, trans, b_g, trans, pre_g, y_g, bias_g);
                gops().gemm_gelu_backward(gs(), a_g, trans, b_g, trans, to_gpu(pre_store).slice(o, Shape{m, n}), dx_g);
                gs().synchronize();
                const gpu_backend::GemmPlanStats after = gpu_backend::gemm_plan_stats();
#ifdef LOOM_CUDA_EMU
                EXPECT_EQ(after.gelu_epilogues - before.gelu_epilogues, sz.fused ? 1 : 0) << what << ": GELU_AUX ran";
                EXPECT_EQ(after.dgelu_epilogues - before.dgelu_epilogues, sz.fused ? 1 : 0) << what << ": DGELU ran";
#else
                (void)before, (void)after;   // cuBLASLt's kernels for the epilogues vary by GPU and version
#endif
                std::vector<double> av = values(a), bv = values(b), biasv = with_bias ? values(bias) : std::vector<double>(n, 0.0);
                std::vector<double> pre_ref = values(pre_c), y_ref = values(y_c), dx_ref = values(dx_c);
                std::vector<double> pre_got = values(to_cpu(pre_g)), y_got = values(to_cpu(y_g)), dx_got = values(to_cpu(dx_g));
                for (int64_t i = 0; i < m; ++i) {
                    for (int64_t j = 0; j < n; ++j) {
                        double g = 0;
                        for (int64_t p = 0; p < k; ++p) {
                            g += std::fabs((trans ? av[p * m + i] : av[i * k + p]) * (trans ? bv[j * k + p] : bv[p * n + j]));
                        }
                        const size_t e   = static_cast<size_t>(i * n + j);
                        const double gb  = g + std::fabs(biasv[j]);
                        const std::string at = what + " at (" + std::to_string(i) + ", " + std::to_string(j) + ")";
                        const double pre_bound = tol * gb + r * (std::fabs(pre_ref[e]) + g) + 1e-30;
                        ASSERT_LE(std::fabs(pre_got[e] - pre_ref[e]), pre_bound) << "pre, " << at;
                        ASSERT_LE(std::fabs(y_got[e] - y_ref[e]), 1.13 * pre_bound + 1e-5 * std::max(1.0, std::fabs(y_ref[e])) +
                                                                     r * std::fabs(y_ref[e]))
                            << "y, " << at;
                        ASSERT_LE(std::fabs(dx_got[e] - dx_ref[e]), 1.13 * tol * g + 1e-5 * std::max(1.0, std::fabs(dx_ref[e])) +
                                                                       r * (std::fabs(dx_ref[e]) + 1.13 * g))
                            << "dx, " << at;
                    }
                }
            }
        }
    }
}

// gemm_weight_grad against its contract on the CPU: bias_backward(dy, dbias), then dw += dy^T x. Aligned
// operands take cuBLASLt's BGRADB epilogue (on cuda-emu the test holds that it ran), whose bias gradient is
// added to dbias; dy one element into its storage, or no rows, falls back to bias_backward's kernel and the
// product. Per element: dw within the GEMM's tol (1e-5 f32, 1e-3 bf16) x (|dw0| + sum_r |dy_ri x_rj|); dbias
// within 1e-5 x (|dbias0| + sum_r |dy_ri|) (f32 sums of the same values in another order).
TEST(CudaOps, WeightGradWithTheBiasGradientInTheEpilogueMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    struct Case { int64_t rows, o, in, offset; bool fused; };
    uint64_t seed = 1800;
    for (DType dtype : {DType::f32, DType::bf16}) {
        const double tol = dtype == DType::f32 ? 1e-5 : 1e-3;
        for (Case sz : {Case{64, 96, 48, 0, true}, Case{37, 40, 24, 0, true}, Case{64, 96, 48, 1, false},
                        Case{0, 8, 16, 0, false}}) {
            const int64_t     rows = sz.rows, o = sz.o, in = sz.in, off = sz.offset;
            const std::string what = std::string(dtype_name(dtype)) + " rows " + std::to_string(rows) + " o " +
                                     std::to_string(o) + " in " + std::to_string(in) + " offset " + std::to_string(off);
            Tensor dy_store = random_cpu({rows * o + off + 1}, ++seed, 1.0f, dtype);
            Tensor dy       = dy_store.slice(off, Shape{rows, o});
            Tensor x        = random_cpu({rows, in}, ++seed, 1.0f, dtype);
            Tensor dw0 = random_cpu({o, in}, ++seed), dbias0 = random_cpu({o}, ++seed);
            Tensor dw_c = clone_cpu(dw0), dbias_c = clone_cpu(dbias0);
            cops().gemm_weight_grad(cs(), dy, x, dw_c, dbias_c);
            cs().synchronize();

            const gpu_backend::GemmPlanStats before = gpu_backend::gemm_plan_stats();
            Tensor dw_g = to_gpu(dw0), dbias_g = to_gpu(dbias0);
            gops().gemm_weight_grad(gs(), to_gpu(dy_store).slice(off, Shape{rows, o}), to_gpu(x), dw_g, dbias_g);
            gs().synchronize();
            const gpu_backend::GemmPlanStats after = gpu_backend::gemm_plan_stats();
#ifdef LOOM_CUDA_EMU
            EXPECT_EQ(after.bgrad_epilogues - before.bgrad_epilogues, sz.fused ? 1 : 0) << what << ": BGRADB ran";
#else
            (void)before, (void)after;
#endif
            std::vector<double> dyv = values(dy), xv = values(x), dw0v = values(dw0), db0v = values(dbias0);
            std::vector<double> dw_ref = values(dw_c), dw_got = values(to_cpu(dw_g));
            std::vector<double> db_ref = values(dbias_c), db_got = values(to_cpu(dbias_g));
            for (int64_t i = 0; i < o; ++i) {
                double mag = std::fabs(db0v[i]);
                for (int64_t r = 0; r < rows; ++r) mag += std::fabs(dyv[r * o + i]);
                ASSERT_LE(std::fabs(db_got[i] - db_ref[i]), 1e-5 * mag) << what << ": dbias at " << i;
                for (int64_t j = 0; j < in; ++j) {
                    double g = std::fabs(dw0v[i * in + j]);
                    for (int64_t r = 0; r < rows; ++r) g += std::fabs(dyv[r * o + i] * xv[r * in + j]);
                    ASSERT_LE(std::fabs(dw_got[i * in + j] - dw_ref[i * in + j]), tol * g) << what << ": dw at (" << i
                                                                                           << ", " << j << ")";
                }
            }
        }
    }
}

// ---------------------------------------------------------------------------------------------- Norms

TEST(CudaOps, LayerNormAndRmsNormForwardBackwardMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 67, h = 1000;   // h: several strides of a 256-thread block, not a multiple of it
    const float   eps = 1e-5f;
    for (int variant = 0; variant < 6; ++variant) {
        const bool rms = variant >= 4, residual_on = variant & 1, beta_on = !rms && (variant & 2);
        const std::string what = std::string(rms ? "rmsnorm" : "layernorm") + (residual_on ? " +residual" : "") +
                                 (beta_on ? " +beta" : "");
        Tensor x = random_cpu({n, h}, 200 + variant, 2.0f), residual = random_cpu({n, h}, 210 + variant);
        Tensor gamma = random_cpu({h}, 220 + variant), beta = random_cpu({h}, 230 + variant);
        Tensor dy = random_cpu({n, h}, 240 + variant), dgamma0 = random_cpu({h}, 250 + variant), dbeta0 = random_cpu({h}, 260);

        Tensor xc = clone_cpu(x), yc = cpu_tensor({n, h}), mc = cpu_tensor({n}), rc = cpu_tensor({n});
        Tensor dxc = cpu_tensor({n, h}), dgc = clone_cpu(dgamma0), dbc = clone_cpu(dbeta0);
        Tensor xg = to_gpu(x), yg = Tensor::empty({n, h}, DType::f32, gpu()), mg = Tensor::empty({n}, DType::f32, gpu());
        Tensor rg = Tensor::empty({n}, DType::f32, gpu()), dxg = Tensor::empty({n, h}, DType::f32, gpu());
        Tensor dgg = to_gpu(dgamma0), dbg = to_gpu(dbeta0);
        Tensor res_c = residual_on ? residual : Tensor(), res_g = residual_on ? to_gpu(residual) : Tensor();
        if (rms) {
            cops().rmsnorm_forward(cs(), xc, res_c, gamma, yc, rc, eps);
            cops().rmsnorm_backward(cs(), dy, xc, gamma, rc, dxc, dgc);
            Tensor gamma_g = to_gpu(gamma);
            gops().rmsnorm_forward(gs(), xg, res_g, gamma_g, yg, rg, eps);
            gops().rmsnorm_backward(gs(), to_gpu(dy), xg, gamma_g, rg, dxg, dgg);
        } else {
            Tensor beta_c = beta_on ? beta : Tensor(), beta_g = beta_on ? to_gpu(beta) : Tensor();
            Tensor dbeta_c = beta_on ? dbc : Tensor(), dbeta_g = beta_on ? dbg : Tensor();
            cops().layernorm_forward(cs(), xc, res_c, gamma, beta_c, yc, mc, rc, eps);
            cops().layernorm_backward(cs(), dy, xc, gamma, mc, rc, dxc, dgc, dbeta_c);
            Tensor gamma_g = to_gpu(gamma);
            gops().layernorm_forward(gs(), xg, res_g, gamma_g, beta_g, yg, mg, rg, eps);
            gops().layernorm_backward(gs(), to_gpu(dy), xg, gamma_g, mg, rg, dxg, dgg, dbeta_g);
        }
        cs().synchronize();
        expect_close(xc, to_cpu(xg), 0.0, what + ": x (plus residual)");
        expect_close(yc, to_cpu(yg), 1e-5, what + ": y");
        expect_close(rc, to_cpu(rg), 1e-5, what + ": rstd");
        if (!rms) expect_close(mc, to_cpu(mg), 1e-5, what + ": mean");
        expect_close(dxc, to_cpu(dxg), 1e-5, what + ": dx");
        expect_close(dgc, to_cpu(dgg), 1e-5, what + ": dgamma (added to)");
        // dbeta adds dy alone, in core/column_sums.h's order on both (67 rows: chunks of 64 and 3): bitwise.
        if (beta_on) expect_bitwise(dbc, to_cpu(dbg), what + ": dbeta (added to)");
    }
}

// ---------------------------------------------------------------------------------------------- Elementwise

// bias_backward adds in core/column_sums.h's order on both devices: 129 rows are chunks of 64, 64 and 1, so
// the GPU's chunk sums and their total give the CPU's bits.
TEST(CudaOps, BiasAddAddInplaceScaleAndBiasBackwardAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 129, h = 300;
    Tensor y = random_cpu({n, h}, 300), bias = random_cpu({h}, 301), x = random_cpu({n, h}, 302), db0 = random_cpu({h}, 303);
    Tensor yc = clone_cpu(y), dbc = clone_cpu(db0);
    cops().bias_add(cs(), yc, bias);
    cops().add_inplace(cs(), yc, x);
    cops().scale(cs(), yc, 0.37f);
    cops().bias_backward(cs(), x, dbc);
    cs().synchronize();
    Tensor yg = to_gpu(y), dbg = to_gpu(db0), xg = to_gpu(x);
    gops().bias_add(gs(), yg, to_gpu(bias));
    gops().add_inplace(gs(), yg, xg);
    gops().scale(gs(), yg, 0.37f);
    gops().bias_backward(gs(), xg, dbg);
    expect_bitwise(yc, to_cpu(yg), "bias_add, add_inplace, scale");
    expect_bitwise(dbc, to_cpu(dbg), "bias_backward");
    for (DType dtype : {DType::bf16, DType::f16}) {   // 16-bit gradient buffers' scale
        Tensor half_c = random_cpu({n, h}, 304, 3.0f, dtype), half_g = to_gpu(half_c);
        cops().scale(cs(), half_c, 0.37f);
        cs().synchronize();
        gops().scale(gs(), half_g, 0.37f);
        expect_bitwise(half_c, to_cpu(half_g), std::string("scale ") + dtype_name(dtype));
    }
}

TEST(CudaOps, GeluAndSwigluForwardBackwardMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 33, f = 517;
    for (int variant = 0; variant < 4; ++variant) {
        const bool bias_on = variant & 1, bf16_on = variant & 2;
        const std::string what = std::string("bias_gelu_forward") + (bias_on ? " +bias" : "") + (bf16_on ? " +x_bf16" : "");
        Tensor x = random_cpu({n, f}, 400 + variant, 5.0f), bias = random_cpu({f}, 410 + variant);
        Tensor xc = clone_cpu(x), yc = cpu_tensor({n, f}), bc = cpu_tensor({n, f}, DType::bf16);
        Tensor xg = to_gpu(x), yg = Tensor::empty({n, f}, DType::f32, gpu()), bg = Tensor::empty({n, f}, DType::bf16, gpu());
        cops().bias_gelu_forward(cs(), xc, bias_on ? bias : Tensor(), yc, bf16_on ? bc : Tensor());
        gops().bias_gelu_forward(gs(), xg, bias_on ? to_gpu(bias) : Tensor(), yg, bf16_on ? bg : Tensor());
        cs().synchronize();
        expect_bitwise(xc, to_cpu(xg), what + ": x");
        if (bf16_on) expect_bitwise(bc, to_cpu(bg), what + ": x_bf16");
        expect_close(yc, to_cpu(yg), 1e-5, what + ": y");
    }
    Tensor x = random_cpu({n, f}, 420, 5.0f), dy = random_cpu({n, f}, 421);
    Tensor dxc = cpu_tensor({n, f}), dxg = Tensor::empty({n, f}, DType::f32, gpu());
    cops().gelu_backward(cs(), x, dy, dxc);
    gops().gelu_backward(gs(), to_gpu(x), to_gpu(dy), dxg);
    cs().synchronize();
    expect_close(dxc, to_cpu(dxg), 1e-5, "gelu_backward");

    Tensor xs = random_cpu({n, 2 * f}, 430, 4.0f), dys = random_cpu({n, f}, 431);
    Tensor yc = cpu_tensor({n, f}), dxs = cpu_tensor({n, 2 * f});
    Tensor xsg = to_gpu(xs), yg = Tensor::empty({n, f}, DType::f32, gpu()), dxsg = Tensor::empty({n, 2 * f}, DType::f32, gpu());
    cops().swiglu_forward(cs(), xs, yc);
    cops().swiglu_backward(cs(), xs, dys, dxs);
    gops().swiglu_forward(gs(), xsg, yg);
    gops().swiglu_backward(gs(), xsg, to_gpu(dys), dxsg);
    cs().synchronize();
    expect_close(yc, to_cpu(yg), 1e-5, "swiglu_forward");
    expect_close(dxs, to_cpu(dxsg), 1e-5, "swiglu_backward");
    // The gated variants (gpt-oss's quick-GEGLU with its clamp 7 and offset 1; SwiGLU clamped): the same
    // formula as the CPU's, the clamps' bounds in reach of the values (x up to 4 in magnitude).
    for (const GluSpec glu : {GluSpec{GluSpec::Gate::quick_gelu, 2.5f, 1.0f}, GluSpec{GluSpec::Gate::silu, 1.5f, 0.0f}}) {
        cops().glu_forward(cs(), xs, yc, glu);
        cops().glu_backward(cs(), xs, dys, dxs, glu);
        gops().glu_forward(gs(), xsg, yg, glu);
        gops().glu_backward(gs(), xsg, to_gpu(dys), dxsg, glu);
        cs().synchronize();
        const std::string what = glu.gate == GluSpec::Gate::quick_gelu ? "quick_geglu" : "clamped swiglu";
        expect_close(yc, to_cpu(yg), 1e-5, what + " forward");
        expect_close(dxs, to_cpu(dxsg), 1e-5, what + " backward");
    }

    // Squared ReLU: one rounding each way on both devices, so the results are bitwise the CPU's.
    Tensor xr = random_cpu({n, f}, 440, 3.0f), dyr = random_cpu({n, f}, 441);
    Tensor yrc = cpu_tensor({n, f}), dxrc = cpu_tensor({n, f});
    Tensor yrg = Tensor::empty({n, f}, DType::f32, gpu()), dxrg = Tensor::empty({n, f}, DType::f32, gpu());
    cops().squared_relu_forward(cs(), xr, yrc);
    cops().squared_relu_backward(cs(), xr, dyr, dxrc);
    gops().squared_relu_forward(gs(), to_gpu(xr), yrg);
    gops().squared_relu_backward(gs(), to_gpu(xr), to_gpu(dyr), dxrg);
    cs().synchronize();
    expect_bitwise(yrc, to_cpu(yrg), "squared_relu_forward");
    expect_bitwise(dxrc, to_cpu(dxrg), "squared_relu_backward");
}

// ---------------------------------------------------------------------------------------------- Data movement

// Values that exercise rounding: ties, subnormals of every format, overflow, infinities, NaNs with payloads.
Tensor conversion_inputs(int64_t n) {
    Tensor             t = random_cpu({n}, 500, 1000.0f);
    float *            p = t.data<float>();
    const uint32_t     specials[] = {0x00000000u, 0x80000000u, 0x7f800000u, 0xff800000u, 0x7fc00000u, 0x7f800001u,
                                     0xffa12345u, 0x00000001u, 0x807fffffu, 0x3f808000u, 0x3f818000u, 0x477fe000u,
                                     0x477ff000u, 0x7f7fffffu, 0x33800000u, 0x38800000u, 0x387fc000u, 0x3f800fffu};
    for (size_t i = 0; i < std::size(specials); ++i) p[i] = std::bit_cast<float>(specials[i]);
    for (int64_t i = std::size(specials); i < n; i += 7) p[i] = std::ldexp(p[i], -int(i % 150));   // small magnitudes
    return t;
}

TEST(CudaOps, ConvertBetweenF32Bf16F16IsBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    const int64_t n   = 70001;
    Tensor        f32 = conversion_inputs(n);
    for (DType mid : {DType::bf16, DType::f16}) {
        for (DType back : {DType::f32, DType::bf16, DType::f16}) {
            const std::string what = std::string("float32 -> ") + dtype_name(mid) + " -> " + dtype_name(back);
            Tensor mc = cpu_tensor({n}, mid), bc = cpu_tensor({n}, back);
            cops().convert(cs(), f32, mc);
            cops().convert(cs(), mc, bc);
            Tensor mg = Tensor::empty({n}, mid, gpu()), bg = Tensor::empty({n}, back, gpu());
            gops().convert(gs(), to_gpu(f32), mg);
            gops().convert(gs(), mg, bg);
            cs().synchronize();
            expect_bitwise(mc, to_cpu(mg), what + " (first step)");
            expect_bitwise(bc, to_cpu(bg), what);
        }
    }
    Tensor xc = clone_cpu(f32), bc = cpu_tensor({n}, DType::bf16);
    Tensor xg = to_gpu(f32), bg = Tensor::empty({n}, DType::bf16, gpu());
    cops().round_to_bf16(cs(), xc, bc);
    gops().round_to_bf16(gs(), xg, bg);
    cs().synchronize();
    expect_bitwise(xc, to_cpu(xg), "round_to_bf16: x");
    expect_bitwise(bc, to_cpu(bg), "round_to_bf16: x_bf16");
}

TEST(CudaOps, CopyCopyColumnsAndFillZeroAreExact) {
    SKIP_WITHOUT_CUDA();
    Tensor src = random_cpu({45, 31}, 600), dst0 = random_cpu({45, 50}, 601);
    // device -> device, pinned -> device and device -> pinned all through ops().copy.
    Tensor a = to_gpu(src), b = Tensor::empty({45, 31}, DType::f32, gpu());
    gops().copy(gs(), a, b);
    expect_bitwise(src, to_cpu(b), "copy");
    Tensor dc = clone_cpu(dst0), dg = to_gpu(dst0);
    cops().copy_columns(cs(), src, 3, dc, 17, 20);
    gops().copy_columns(gs(), b, 3, dg, 17, 20);
    cs().synchronize();
    expect_bitwise(dc, to_cpu(dg), "copy_columns");
    gops().fill_zero(gs(), dg.narrow(0, 10, 5));
    Tensor expect = clone_cpu(dc);
    std::memset(expect.data<float>() + 10 * 50, 0, 5 * 50 * sizeof(float));
    expect_bitwise(expect, to_cpu(dg), "fill_zero of rows 10..14");
}

TEST(CudaOps, SumOfSquaresHiPlusLoIsTheCpusDoubleSum) {
    SKIP_WITHOUT_CUDA();
    const int64_t n   = 3 * (int64_t{1} << 16) + 12345;   // 4 chunks of 2^16, the last partial
    Tensor        x   = random_cpu({n}, 700, 2.0f);
    Tensor        oc  = cpu_tensor({2});
    Tensor        og  = Tensor::empty({2}, DType::f32, gpu());
    cops().sum_of_squares(cs(), x, oc);
    gops().sum_of_squares(gs(), to_gpu(x), og);
    cs().synchronize();
    Tensor       got = to_cpu(og);
    const double ref = double(oc.data<float>()[0]) + oc.data<float>()[1];
    const double gpu_sum = double(got.data<float>()[0]) + got.data<float>()[1];
    EXPECT_LE(std::fabs(gpu_sum - ref), 1e-12 * ref) << "cpu " << ref << ", cuda " << gpu_sum;
    EXPECT_EQ(got.data<float>()[0], static_cast<float>(gpu_sum)) << "out[0] is the sum rounded to f32";
}

// fp8_quantize (tensorwise current scaling), scale_by_product and scale_by_reciprocal: the CPU's on the hand-worked case of
// core/fp8.h (x = (1, -3.5, 0.3, 2): s = 128, q = (128, -448, 40, 256)), then bitwise the CPU's on a tensor of
// several amax chunks, f32 and bf16 inputs, both formats.
TEST(CudaOps, Fp8QuantizeAndScaleByProductAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    Tensor hand = cpu_tensor({4}), q = cpu_tensor({4}, DType::bf16), inv = cpu_tensor({1});
    const float xs[] = {1.0f, -3.5f, 0.3f, 2.0f}, want[] = {128.0f, -448.0f, 40.0f, 256.0f};
    std::copy(xs, xs + 4, hand.data<float>());
    cops().fp8_quantize(cs(), hand, Fp8Format::e4m3, q, inv);
    cs().synchronize();
    for (int i = 0; i < 4; ++i) EXPECT_EQ(bf16_bits_to_f32(static_cast<uint16_t *>(q.data_ptr())[i]), want[i]) << i;
    EXPECT_EQ(inv.data<float>()[0], 1.0f / 128.0f);
    const int64_t n = 2 * (int64_t{1} << 16) + 777;   // three amax chunks, the last partial
    for (const DType dtype : {DType::f32, DType::bf16}) {
        for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
            Tensor x  = random_cpu({n}, 720, 5.0f, dtype);
            Tensor qc = cpu_tensor({n}, DType::bf16), ic = cpu_tensor({1});
            Tensor qg = Tensor::empty({n}, DType::bf16, gpu()), ig = Tensor::empty({1}, DType::f32, gpu());
            cops().fp8_quantize(cs(), x, format, qc, ic);
            cs().synchronize();
            gops().fp8_quantize(gs(), to_gpu(x), format, qg, ig);
            expect_bitwise(qc, to_cpu(qg), "fp8_quantize values");
            expect_bitwise(ic, to_cpu(ig), "fp8_quantize scale_inv");
        }
    }
    Tensor t = random_cpu({300}, 721), a = cpu_tensor({1}), b = cpu_tensor({1});
    a.data<float>()[0] = 0.37f;
    b.data<float>()[0] = 1.0f / 448.0f;
    Tensor tc = clone_cpu(t), tg = to_gpu(t);
    cops().scale_by_product(cs(), tc, a, b);
    cs().synchronize();
    gops().scale_by_product(gs(), tg, to_gpu(a), to_gpu(b));
    expect_bitwise(tc, to_cpu(tg), "scale_by_product");
    // scale_by_reciprocal: scale's bits with the factor 1 / d read on the device (a running mean's divide by 3).
    Tensor d = cpu_tensor({1}), rc = clone_cpu(t), rs = clone_cpu(t), rg = to_gpu(t);
    d.data<float>()[0] = 3.0f;
    cops().scale_by_reciprocal(cs(), rc, d);
    cops().scale(cs(), rs, 1.0f / 3.0f);
    cs().synchronize();
    expect_bitwise(rs, rc, "scale_by_reciprocal against scale by 1 / 3");
    gops().scale_by_reciprocal(gs(), rg, to_gpu(d));
    expect_bitwise(rc, to_cpu(rg), "scale_by_reciprocal");
}

// --fp8-param-gather's ops. On the CPU: fp8_decode gives every code's value (core/fp8.h's, which test_fp8 holds to
// the formats' definition); fp8_amax folds pieces into one amax; fp8_encode with that amax on the hand-worked
// case (x = (1, -3.5, 0.3, 2): s = 128, values (128, -448, 40, 256)); and encode then decode is fp8_quantize's q
// to the bit. Then the CUDA kernels bitwise the CPU's over several amax chunks, both formats.
// The shared expert's gate (--moe-shared-expert-gate). By hand: logit 0 gives 1/2, ln 3 gives 3/4; a row (2, -4)
// with logit 0 becomes (1, -2); its backward from dy = (1, 1) and m = (2, -4): dm = (0.5, 0.5), dlogit = (2 - 4)
// x 1/4 = -0.5. Then rows of 37 columns on both devices: the same f32 operations in the same order, exp
// against the device's expf, within 1e-6; dm may be dy itself.
TEST(CudaOps, SharedExpertGateMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    Tensor y = cpu_tensor({2, 2}), logits = cpu_tensor({2});
    write_values_f32(y, std::vector<float>{2.0f, -4.0f, 4.0f, 8.0f});
    write_values_f32(logits, std::vector<float>{0.0f, std::log(3.0f)});
    Tensor m = clone_cpu(y);
    cops().sigmoid_gate_forward(cs(), y, logits);
    cs().synchronize();
    EXPECT_EQ(y.data<float>()[0], 1.0f);
    EXPECT_EQ(y.data<float>()[1], -2.0f);
    EXPECT_NEAR(y.data<float>()[2], 3.0f, 1e-6);
    Tensor dy = cpu_tensor({2, 2}), dm = cpu_tensor({2, 2}), dl = cpu_tensor({2});
    write_values_f32(dy, std::vector<float>{1.0f, 1.0f, 0.0f, 0.0f});
    cops().sigmoid_gate_backward(cs(), dy, m, logits, dm, dl);
    cs().synchronize();
    EXPECT_EQ(dm.data<float>()[0], 0.5f);
    EXPECT_EQ(dl.data<float>()[0], -0.5f);
    EXPECT_EQ(dl.data<float>()[1], 0.0f);
    for (const bool in_place : {false, true}) {
        const Tensor ym = random_cpu({70, 37}, 4901, 3.0f), lg = random_cpu({70}, 4902, 4.0f), g = random_cpu({70, 37}, 4903);
        Tensor yc = clone_cpu(ym), yg = to_gpu(ym);
        cops().sigmoid_gate_forward(cs(), yc, lg);
        gops().sigmoid_gate_forward(gs(), yg, to_gpu(lg));
        Tensor dmc = in_place ? clone_cpu(g) : cpu_tensor({70, 37}), dlc = cpu_tensor({70});
        Tensor dyg = to_gpu(g), dmg = in_place ? dyg : Tensor::empty({70, 37}, DType::f32, gpu());
        Tensor dlg = Tensor::empty({70}, DType::f32, gpu());
        const Tensor dyc = in_place ? dmc : g;
        cops().sigmoid_gate_backward(cs(), dyc, ym, lg, dmc, dlc);
        cs().synchronize();
        gops().sigmoid_gate_backward(gs(), dyg, to_gpu(ym), to_gpu(lg), dmg, dlg);
        const std::string what = in_place ? "in place" : "apart";
        expect_close(yc, to_cpu(yg), 1e-6, what + ": y");
        expect_close(dmc, to_cpu(dmg), 1e-6, what + ": dm");
        expect_close(dlc, to_cpu(dlg), 1e-5, what + ": dlogits");
    }
}

namespace {

// Each device result within tol of the CPU's (relative to the larger of 1 and the value, or with `of_largest`
// to the CPU tensor's largest magnitude); on cuda-emu, whose kernels are the same code compiled for the host
// (with the host's expf), the same bits.
struct CpuAndDevice {
    const Tensor * cpu;
    const Tensor * dev;
    const char *   name;
};
void expect_each_matches_cpu(std::initializer_list<CpuAndDevice> results, double tol, const std::string & what, bool of_largest) {
    const bool emu = std::string(gpu().kind_name()) == "cuda-emu";
    for (const CpuAndDevice & r : results) {
        const Tensor got   = to_cpu(*r.dev);
        double       floor = 1.0;
        if (of_largest) {
            floor = 0;
            for (double e : values(*r.cpu)) floor = std::max(floor, std::fabs(e));
        }
        expect_close(*r.cpu, got, tol, what + ": " + r.name, floor);
        if (emu) expect_bitwise(*r.cpu, got, what + ": " + r.name);
    }
}

}  // namespace

// The gated delta rule on the device against the CPU: the same loops in the same order (a thread per column of the
// state, then per row), so on cuda-emu the same bits; on a GPU, whose expf differs in the last bit, within 1e-5 of
// each output's largest. Keys of 40 and values of 24 (threads past one warp, neither a multiple of the other) over
// 37 steps (three chunks, the last short), 3 heads of 2 sequences; and 64 x 64 over 20 steps.
TEST(CudaOps, GatedDeltaRuleMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    for (const DeltaRuleShape d : {DeltaRuleShape{37, 2, 3, 40, 24, 0.158f}, DeltaRuleShape{20, 1, 2, 64, 64, 0.125f}}) {
        const std::string what = "dk " + std::to_string(d.dk) + ", dv " + std::to_string(d.dv);
        const int64_t     n = d.s * d.b, H = d.heads;
        const Tensor q = random_cpu({n, H * d.dk}, 4921, 1.0f), k = random_cpu({n, H * d.dk}, 4922, 0.3f);
        const Tensor v = random_cpu({n, H * d.dv}, 4923, 1.0f), dout = random_cpu({n, H * d.dv}, 4924, 1.0f);
        Tensor g = random_cpu({n, H}, 4925, 0.5f), beta = random_cpu({n, H}, 4926, 0.4f);
        for (int64_t i = 0; i < n * H; ++i) {   // decays in [-1, 0], strengths in (0.1, 0.9)
            g.data<float>()[i]    = g.data<float>()[i] - 0.5f;
            beta.data<float>()[i] = beta.data<float>()[i] + 0.5f;
        }
        const int64_t ws_n = delta_rule_workspace_elements(d);
        Tensor oc = cpu_tensor({n, H * d.dv}), wsc = cpu_tensor({ws_n});
        Tensor dqc = cpu_tensor({n, H * d.dk}), dkc = cpu_tensor({n, H * d.dk}), dvc = cpu_tensor({n, H * d.dv});
        Tensor dgc = cpu_tensor({n, H}), dbc = cpu_tensor({n, H});
        cops().gated_delta_rule_forward(cs(), q, k, v, g, beta, oc, wsc, d);
        cops().gated_delta_rule_backward(cs(), q, k, v, g, beta, dout, dqc, dkc, dvc, dgc, dbc, wsc, d);
        cs().synchronize();
        const Tensor qg = to_gpu(q), kg = to_gpu(k), vg = to_gpu(v), gg = to_gpu(g), bg = to_gpu(beta), dog = to_gpu(dout);
        auto on_gpu = [&](const Shape & shape) { return Tensor::empty(shape, DType::f32, gpu()); };
        Tensor og = on_gpu({n, H * d.dv}), wsg = on_gpu({ws_n}), dqg = on_gpu({n, H * d.dk}), dkg = on_gpu({n, H * d.dk});
        Tensor dvg = on_gpu({n, H * d.dv}), dgg = on_gpu({n, H}), dbg = on_gpu({n, H});
        gops().gated_delta_rule_forward(gs(), qg, kg, vg, gg, bg, og, wsg, d);
        gops().gated_delta_rule_backward(gs(), qg, kg, vg, gg, bg, dog, dqg, dkg, dvg, dgg, dbg, wsg, d);
        expect_each_matches_cpu({{&oc, &og, "o"}, {&dqc, &dqg, "dq"}, {&dkc, &dkg, "dk"}, {&dvc, &dvg, "dv"},
                                 {&dgc, &dgg, "dg"}, {&dbc, &dbg, "dbeta"}},
                                1e-5, what, true);
    }
}

// The short convolution on the device, bitwise the CPU's on cuda-emu (within 1e-5 of each output's largest on a
// GPU): 3 sequences of 40 steps, 70 channels, kernels of 4 and 2; dw adds to what it holds.
TEST(CudaOps, CausalConvSiluMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    for (const int64_t K : {4, 2}) {
        const int64_t s = 40, b = 3, C = 70, n = s * b;
        const Tensor  x = random_cpu({n, C}, 4931, 2.0f), w = random_cpu({C, K}, 4932, 1.0f), dy = random_cpu({n, C}, 4933, 1.0f);
        const Tensor  dw0 = random_cpu({C, K}, 4934, 1.0f);
        Tensor        yc = cpu_tensor({n, C}), dxc = cpu_tensor({n, C}), dwc = clone_cpu(dw0);
        cops().causal_conv_silu_forward(cs(), x, w, yc, s, b);
        cops().causal_conv_silu_backward(cs(), x, w, dy, dxc, dwc, s, b);
        cs().synchronize();
        const Tensor xg = to_gpu(x), wg = to_gpu(w);
        Tensor yg = Tensor::empty({n, C}, DType::f32, gpu()), dxg = Tensor::empty({n, C}, DType::f32, gpu()), dwg = to_gpu(dw0);
        gops().causal_conv_silu_forward(gs(), xg, wg, yg, s, b);
        gops().causal_conv_silu_backward(gs(), xg, wg, to_gpu(dy), dxg, dwg, s, b);
        expect_each_matches_cpu({{&yc, &yg, "y"}, {&dxc, &dxg, "dx"}, {&dwc, &dwg, "dw"}}, 1e-5, "kernel " + std::to_string(K), true);
    }
}

// The gated delta-net's L2 norm and gates on the device, bitwise the CPU's on cuda-emu (within 1e-5 of each output's
// largest on a GPU, whose expf and log1pf may differ in a last bit): 300 rows of 64 for the norm; 70 rows of 5 heads at
// column 9 of rows of 30 for the gates, in f32 and bf16, with the parameters' gradients added to what they held.
TEST(CudaOps, DeltaNetNormAndGatesMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const Tensor x = random_cpu({300, 64}, 4921, 2.0f), dy = random_cpu({300, 64}, 4922);
    Tensor yc = cpu_tensor({300, 64}), rc = cpu_tensor({300}), dxc = cpu_tensor({300, 64});
    cops().l2norm_forward(cs(), x, yc, rc, 1e-6f);
    cops().l2norm_backward(cs(), dy, yc, rc, dxc);
    cs().synchronize();
    Tensor yg = Tensor::empty({300, 64}, DType::f32, gpu()), rg = Tensor::empty({300}, DType::f32, gpu());
    Tensor dxg = Tensor::empty({300, 64}, DType::f32, gpu());
    gops().l2norm_forward(gs(), to_gpu(x), yg, rg, 1e-6f);
    gops().l2norm_backward(gs(), to_gpu(dy), yg, rg, dxg);
    expect_each_matches_cpu({{&yc, &yg, "y"}, {&rc, &rg, "rstd"}, {&dxc, &dxg, "dx"}}, 1e-5, "l2norm", true);

    const int64_t n = 70, H = 5, col = 9;
    const Tensor a_log = random_cpu({H}, 4923), dt_bias = random_cpu({H}, 4924);
    const Tensor dg = random_cpu({n, H}, 4925), dbeta = random_cpu({n, H}, 4926);
    for (const DType dtype : {DType::f32, DType::bf16}) {
        const std::string what = std::string("gates ") + (dtype == DType::f32 ? "f32" : "bf16");
        const Tensor src = random_cpu({n, 30}, 4927, 6.0f, dtype);
        Tensor gc = cpu_tensor({n, H}), bc = cpu_tensor({n, H}), dsc = cpu_tensor({n, 2 * H}, dtype);
        Tensor alc = random_cpu({H}, 4928), dtc = random_cpu({H}, 4929);
        const Tensor alg = to_gpu(alc), dtg = to_gpu(dtc);   // before the CPU adds into them
        cops().gdn_gates_forward(cs(), src, col, a_log, dt_bias, gc, bc);
        cops().gdn_gates_backward(cs(), src, col, a_log, dt_bias, dg, dbeta, dsc, alc, dtc);
        cs().synchronize();
        const Tensor sg = to_gpu(src), ag = to_gpu(a_log), tg = to_gpu(dt_bias);
        Tensor gg = Tensor::empty({n, H}, DType::f32, gpu()), bg = Tensor::empty({n, H}, DType::f32, gpu());
        Tensor dsg = Tensor::empty({n, 2 * H}, dtype, gpu());
        gops().gdn_gates_forward(gs(), sg, col, ag, tg, gg, bg);
        gops().gdn_gates_backward(gs(), sg, col, ag, tg, to_gpu(dg), to_gpu(dbeta), dsg, alg, dtg);
        expect_each_matches_cpu({{&gc, &gg, "g"}, {&bc, &bg, "beta"}, {&dsc, &dsg, "dsrc"}, {&alc, &alg, "da_log"},
                                 {&dtc, &dtg, "ddt_bias"}},
                                dtype == DType::f32 ? 1e-5 : 4e-3, what, true);
    }
}

// DeepSeek Sparse Attention's indexer ops on the device: the scores (with and without the ReLU) and their gradients,
// 2 sequences of 13 with 3 heads of 8; the target of packed rows of 2 heads of 6 in f32 and bf16; the KL loss and its
// gradient. The same f32 operations in the CPU's order, so bitwise on cuda-emu (whose expf and logf are the host's);
// within 1e-5 of each output's largest on a GPU. The masked scores are -inf there too (compared bitwise).
TEST(CudaOps, DsaIndexerOpsMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t s = 13, b = 2, n = s * b, H = 3, d = 8;
    const Tensor  q = random_cpu({n, H * d}, 5101), k = random_cpu({n, d}, 5102), w = random_cpu({n, H}, 5103);
    const Tensor  dscores = random_cpu({b, s, s}, 5104);
    for (const bool relu : {true, false}) {
        const std::string what = relu ? "dsa scores with relu" : "dsa scores without relu";
        Tensor sc = cpu_tensor({b, s, s}), dqc = cpu_tensor({n, H * d}), dkc = cpu_tensor({n, d}), dwc = cpu_tensor({n, H});
        cops().dsa_index_scores(cs(), q, k, w, s, b, relu, sc);
        cops().dsa_index_scores_backward(cs(), q, k, w, dscores, s, b, relu, dqc, dkc, dwc);
        cs().synchronize();
        Tensor sg = Tensor::empty({b, s, s}, DType::f32, gpu()), dqg = Tensor::empty({n, H * d}, DType::f32, gpu());
        Tensor dkg = Tensor::empty({n, d}, DType::f32, gpu()), dwg = Tensor::empty({n, H}, DType::f32, gpu());
        const Tensor qg = to_gpu(q), kg = to_gpu(k), wg = to_gpu(w);
        gops().dsa_index_scores(gs(), qg, kg, wg, s, b, relu, sg);
        gops().dsa_index_scores_backward(gs(), qg, kg, wg, to_gpu(dscores), s, b, relu, dqg, dkg, dwg);
        gs().synchronize();
        const Tensor back = to_cpu(sg);   // the -inf entries: bitwise on every device
        for (int64_t e = 0; e < b * s * s; ++e) {
            if (e % s > e / s % s) EXPECT_EQ(back.data<float>()[e], -std::numeric_limits<float>::infinity()) << what << " " << e;
        }
        Tensor finite_c = clone_cpu(sc), finite_g = clone_cpu(back);
        for (Tensor * t : {&finite_c, &finite_g}) {
            for (int64_t e = 0; e < t->numel(); ++e) {
                if (std::isinf(t->data<float>()[e])) t->data<float>()[e] = 0.0f;
            }
        }
        expect_each_matches_cpu({{&finite_c, &finite_g, "scores"}, {&dqc, &dqg, "dq"}, {&dkc, &dkg, "dk"}, {&dwc, &dwg, "dw"}},
                                1e-5, what, true);
    }
    const int64_t heads = 2, hd = 6, stride = 3 * heads * hd;
    for (const DType dtype : {DType::f32, DType::bf16}) {
        const std::string what = dtype == DType::f32 ? "dsa target f32" : "dsa target bf16";
        const Tensor rows = random_cpu({n, stride}, 5105, 2.0f, dtype);
        const AttentionShape shape(s, b, heads, heads, hd, stride);
        Tensor tc = cpu_tensor({b, s, s}), tg = Tensor::empty({b, s, s}, DType::f32, gpu());
        cops().dsa_attention_target(cs(), rows, shape, 0.4f, tc);
        cs().synchronize();
        gops().dsa_attention_target(gs(), to_gpu(rows), shape, 0.4f, tg);
        expect_each_matches_cpu({{&tc, &tg, "target"}}, 1e-5, what, true);
    }
    const Tensor scores = random_cpu({b, s, s}, 5106, 3.0f), target = random_cpu({b, s, s}, 5107);
    Tensor       positive = clone_cpu(target);   // a target's entries are probabilities' sums: >= 0
    for (int64_t e = 0; e < positive.numel(); ++e) positive.data<float>()[e] = std::fabs(positive.data<float>()[e]);
    Tensor klc = cpu_tensor({n}), gc = cpu_tensor({b, s, s});
    cops().dsa_indexer_loss(cs(), scores, positive, 0.3f, klc, gc);
    cs().synchronize();
    Tensor klg = Tensor::empty({n}, DType::f32, gpu()), gg = Tensor::empty({b, s, s}, DType::f32, gpu());
    gops().dsa_indexer_loss(gs(), to_gpu(scores), to_gpu(positive), 0.3f, klg, gg);
    expect_each_matches_cpu({{&klc, &klg, "kl"}, {&gc, &gg, "dscores"}}, 1e-5, "dsa loss", true);

    // The top-k selection (k 1, 4 and every key; scores rounded to whole numbers and clamped at 0 too, so that ties
    // decide) is exact on every device; the sparse loss's target and KL over a mask of k = 4 as above.
    for (const bool ties : {false, true}) {
        Tensor ranked = clone_cpu(scores);
        if (ties) {
            for (int64_t e = 0; e < ranked.numel(); ++e) ranked.data<float>()[e] = std::max(0.0f, std::round(ranked.data<float>()[e]));
        }
        for (const int64_t k : {int64_t{1}, int64_t{4}, s}) {
            Tensor mc = cpu_tensor({b, s, s}, DType::u8), mg = Tensor::empty({b, s, s}, DType::u8, gpu());
            cops().dsa_topk_mask(cs(), ranked, k, mc);
            cs().synchronize();
            gops().dsa_topk_mask(gs(), to_gpu(ranked), k, mg);
            expect_bitwise(mc, to_cpu(mg), "dsa top-" + std::to_string(k) + (ties ? " tied" : ""));
        }
    }
    Tensor mask = cpu_tensor({b, s, s}, DType::u8);
    cops().dsa_topk_mask(cs(), scores, 4, mask);
    cs().synchronize();
    const Tensor  rows = random_cpu({n, stride}, 5108, 2.0f);
    AttentionShape sc_shape(s, b, heads, heads, hd, stride), sg_shape = sc_shape;
    sc_shape.key_mask = mask;
    sg_shape.key_mask = to_gpu(mask);
    Tensor tc = cpu_tensor({b, s, s}), tg = Tensor::empty({b, s, s}, DType::f32, gpu());
    cops().dsa_attention_target(cs(), rows, sc_shape, 0.4f, tc);
    cops().dsa_indexer_loss(cs(), scores, tc, 0.3f, klc, gc, mask);
    cs().synchronize();
    gops().dsa_attention_target(gs(), to_gpu(rows), sg_shape, 0.4f, tg);
    gops().dsa_indexer_loss(gs(), to_gpu(scores), tg, 0.3f, klg, gg, sg_shape.key_mask);
    expect_each_matches_cpu({{&tc, &tg, "sparse target"}, {&klc, &klg, "sparse kl"}, {&gc, &gg, "sparse dscores"}}, 1e-5,
                            "dsa sparse loss", true);

    // Under context parallelism: CP 2's rank 1 of sequences of 12 (its query rows at positions 3..5 and 6..8) against
    // the whole sequences' keys, every op as above.
    const int64_t      S = 12, sl = 6, nl = sl * b;
    const SeqPositions at{3, 3, 6};
    const Tensor ql = random_cpu({nl, H * d}, 5109), kw = random_cpu({S * b, d}, 5110), wl = random_cpu({nl, H}, 5111);
    const Tensor dl = random_cpu({b, sl, S}, 5112), rl = random_cpu({nl, stride}, 5113, 2.0f);
    const Tensor kv = random_cpu({S * b, 2 * heads * hd}, 5114, 2.0f), sl_scores = random_cpu({b, sl, S}, 5115, 3.0f);
    Tensor tl = random_cpu({b, sl, S}, 5116);
    for (int64_t e = 0; e < tl.numel(); ++e) tl.data<float>()[e] = std::fabs(tl.data<float>()[e]);
    Tensor scc = cpu_tensor({b, sl, S}), dqc = cpu_tensor({nl, H * d}), dkc = cpu_tensor({S * b, d}), dwc = cpu_tensor({nl, H});
    Tensor mcc = cpu_tensor({b, sl, S}, DType::u8), tcc = cpu_tensor({b, sl, S}), klcc = cpu_tensor({nl}), gcc = cpu_tensor({b, sl, S});
    cops().dsa_index_scores(cs(), ql, kw, wl, sl, b, true, scc, at);
    cops().dsa_index_scores_backward(cs(), ql, kw, wl, dl, sl, b, true, dqc, dkc, dwc, at);
    cops().dsa_topk_mask(cs(), sl_scores, 4, mcc, at);
    AttentionShape cp_shape = AttentionShape(sl, b, heads, heads, hd, stride).against_kv(S);
    cp_shape.q_pos          = at;
    AttentionShape cp_c = cp_shape, cp_g = cp_shape;
    cp_c.key_mask = mcc;
    cops().dsa_attention_target(cs(), rl, cp_c, 0.4f, tcc, kv);
    cops().dsa_indexer_loss(cs(), sl_scores, tl, 0.3f, klcc, gcc, mcc, at);
    cs().synchronize();
    Tensor scg = Tensor::empty({b, sl, S}, DType::f32, gpu()), dqg = Tensor::empty({nl, H * d}, DType::f32, gpu());
    Tensor dkg = Tensor::empty({S * b, d}, DType::f32, gpu()), dwg = Tensor::empty({nl, H}, DType::f32, gpu());
    Tensor mcg = Tensor::empty({b, sl, S}, DType::u8, gpu()), tcg = Tensor::empty({b, sl, S}, DType::f32, gpu());
    Tensor klcg = Tensor::empty({nl}, DType::f32, gpu()), gcg = Tensor::empty({b, sl, S}, DType::f32, gpu());
    const Tensor qlg = to_gpu(ql), kwg = to_gpu(kw), wlg = to_gpu(wl);
    gops().dsa_index_scores(gs(), qlg, kwg, wlg, sl, b, true, scg, at);
    gops().dsa_index_scores_backward(gs(), qlg, kwg, wlg, to_gpu(dl), sl, b, true, dqg, dkg, dwg, at);
    gops().dsa_topk_mask(gs(), to_gpu(sl_scores), 4, mcg, at);
    cp_g.key_mask = mcg;
    gops().dsa_attention_target(gs(), to_gpu(rl), cp_g, 0.4f, tcg, to_gpu(kv));
    gops().dsa_indexer_loss(gs(), to_gpu(sl_scores), to_gpu(tl), 0.3f, klcg, gcg, mcg, at);
    const Tensor back = to_cpu(scg);
    Tensor       finite_c = clone_cpu(scc), finite_g = clone_cpu(back);
    int64_t      later = 0;   // the keys after each row's position: -inf on every device
    for (int64_t e = 0; e < back.numel(); ++e) {
        const bool after = e % S > at(e / S % sl);
        later += after && back.data<float>()[e] == -std::numeric_limits<float>::infinity();
        EXPECT_EQ(after, std::isinf(back.data<float>()[e])) << "cp scores " << e;
        if (after) finite_c.data<float>()[e] = finite_g.data<float>()[e] = 0.0f;
    }
    EXPECT_GT(later, 0);
    expect_bitwise(mcc, to_cpu(mcg), "dsa top-4 under context parallelism");
    expect_each_matches_cpu({{&finite_c, &finite_g, "cp scores"}, {&dqc, &dqg, "cp dq"}, {&dkc, &dkg, "cp dk"},
                             {&dwc, &dwg, "cp dw"}, {&tcc, &tcg, "cp sparse target"}, {&klcc, &klcg, "cp sparse kl"},
                             {&gcc, &gcg, "cp sparse dscores"}},
                            1e-5, "dsa under context parallelism", true);
}

// The output gate's op on the device, with both activations (sigmoid: --attention-output-gate; SiLU: the gated
// delta-net's gated norm): 70 rows of 37 gates at column 11 of rows of 60, in f32 and bf16, against the CPU's (the
// same f32 operations in the same order, exp against the device's expf): within 1e-6 in f32 (2e-5 with SiLU's
// larger values), one bf16 step (4e-3) in bf16 where an f32 result's last bit may round either way; on cuda-emu,
// whose expf is the host's, the same bits. dx may be dy.
TEST(CudaOps, OutputGateMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    for (const GateActivation act : {GateActivation::sigmoid, GateActivation::silu}) {
        for (const DType dtype : {DType::f32, DType::bf16}) {
            const std::string what = std::string(act == GateActivation::silu ? "silu " : "sigmoid ") + (dtype == DType::f32 ? "f32" : "bf16");
            const double tol = dtype == DType::f32 ? (act == GateActivation::silu ? 2e-5 : 1e-6) : 4e-3;
            const Tensor x = random_cpu({70, 37}, 4911, 3.0f, dtype), src = random_cpu({70, 60}, 4912, 6.0f, dtype);
            const Tensor dy = random_cpu({70, 37}, 4913, 1.0f, dtype);
            Tensor yc = cpu_tensor({70, 37}, dtype), dxc = clone_cpu(dy), dgc = cpu_tensor({70, 37}, dtype);
            cops().output_gate_forward(cs(), x, src, 11, yc, act);
            cops().output_gate_backward(cs(), x, src, 11, dxc, dxc, dgc, act);
            cs().synchronize();
            const Tensor xg = to_gpu(x), sg = to_gpu(src);
            Tensor yg = Tensor::empty({70, 37}, dtype, gpu()), dxg = to_gpu(dy), dgg = Tensor::empty({70, 37}, dtype, gpu());
            gops().output_gate_forward(gs(), xg, sg, 11, yg, act);
            gops().output_gate_backward(gs(), xg, sg, 11, dxg, dxg, dgg, act);
            expect_each_matches_cpu({{&yc, &yg, "y"}, {&dxc, &dxg, "dx"}, {&dgc, &dgg, "dgate"}}, tol, what, false);
        }
    }
}

// --fp8-recipe delayed's two ops. The update by hand: a history of 3 rows over 5 operands (row 0 the newest
// amaxes), margin 1, e4m3. Operand 0's column (2, 4, 1): max 4, s = 448 / 4 / 2 = 56; most_recent 2, s = 112.
// Operand 1's row 0 is 0: max takes the rows below (8: s 28); most_recent keeps the
// previous scale. A NaN amax keeps the scale under either algo, as torch.max's NaN does in Transformer
// Engine (the NaN never replaces nor is replaced). Operand 3: all zeros, its scale kept; operand 4: Inf
// at row 1, kept. After it, each column moved up a row with the old row 0 at the bottom, and row 0 cleared.
// Then the scaled cast (saturating past 448) and both ops on the device, bitwise the CPU's.
TEST(CudaOps, Fp8DelayedScalingOpsFollowTheRecipeAndAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    const float inf = std::numeric_limits<float>::infinity(), nan = std::numeric_limits<float>::quiet_NaN();
    const std::vector<float> history = {2, 0, nan, 0, 1,     // row 0
                                        4, 8, 8, 0, inf,     // row 1
                                        1, 3, 1, 0, 2};      // row 2
    const std::vector<float> before = {5, 6, 7, 9, 10};
    for (const bool max_algo : {true, false}) {
        const std::string what = max_algo ? "max" : "most_recent";
        Tensor h = cpu_tensor({3, 5}), sc = cpu_tensor({5});
        write_values_f32(h, history);
        write_values_f32(sc, before);
        Tensor hg = to_gpu(h), sg = to_gpu(sc);
        cops().fp8_delayed_update(cs(), h, sc, Fp8Format::e4m3, 1, max_algo);
        cs().synchronize();
        gops().fp8_delayed_update(gs(), hg, sg, Fp8Format::e4m3, 1, max_algo);
        const std::vector<float> want_max = {56, 28, 7, 9, 10}, want_recent = {112, 6, 7, 9, 224};
        const std::vector<float> & want = max_algo ? want_max : want_recent;
        for (int j = 0; j < 5; ++j) EXPECT_EQ(sc.data<float>()[j], want[static_cast<size_t>(j)]) << what << ": scale " << j;
        const float * got = h.data<float>();
        for (int j = 0; j < 5; ++j) {
            EXPECT_EQ(got[j], 0.0f) << what << ": row 0 cleared, operand " << j;
            EXPECT_EQ(float_to_bits(got[5 + j]), float_to_bits(history[static_cast<size_t>(10 + j)])) << what << ": row 1 <- row 2";
            EXPECT_EQ(float_to_bits(got[10 + j]), float_to_bits(history[static_cast<size_t>(j)])) << what << ": row 2 <- row 0";
        }
        expect_bitwise(h, to_cpu(hg), what + ": history on the device");
        expect_bitwise(sc, to_cpu(sg), what + ": scales on the device");
    }
    // A history of one row: its amax is that row's, then cleared.
    Tensor one = cpu_tensor({1, 2}), s1 = cpu_tensor({2});
    write_values_f32(one, std::vector<float>{7, 0});
    write_values_f32(s1, std::vector<float>{1, 3});
    cops().fp8_delayed_update(cs(), one, s1, Fp8Format::e5m2, 0, false);
    cs().synchronize();
    EXPECT_EQ(s1.data<float>()[0], 57344.0f / 7.0f);
    EXPECT_EQ(s1.data<float>()[1], 3.0f);
    EXPECT_EQ(one.data<float>()[0], 0.0f);
    // The cast by a given scale: 1.5 x 256 = 384 (exact in e4m3), 2 x 256 = 512 saturates to 448, -0.3 x 256 =
    // -76.8 -> -80 (steps of 8 in [64, 128)); q holds the FP8 values, scale_inv 1 / 256.
    for (const DType dtype : {DType::f32, DType::bf16}) {
        Tensor x = cpu_tensor({3}, DType::f32);
        write_values_f32(x, std::vector<float>{1.5f, 2.0f, -0.3f});
        if (dtype == DType::bf16) x = random_cpu({333}, 4801, 3.0f, DType::bf16);
        Tensor scale = cpu_tensor({1}), q = cpu_tensor({x.numel()}, DType::bf16), inv = cpu_tensor({1});
        write_values_f32(scale, std::vector<float>{256.0f});
        cops().fp8_quantize_scaled(cs(), x, Fp8Format::e4m3, scale, q, inv);
        cs().synchronize();
        if (dtype == DType::f32) {
            const std::vector<double> got = values(q);
            EXPECT_EQ(got, (std::vector<double>{384.0, 448.0, -80.0}));
            EXPECT_EQ(inv.data<float>()[0], 1.0f / 256.0f);
        }
        Tensor qg = Tensor::empty({x.numel()}, DType::bf16, gpu()), ig = Tensor::empty({1}, DType::f32, gpu());
        gops().fp8_quantize_scaled(gs(), to_gpu(x), Fp8Format::e4m3, to_gpu(scale), qg, ig);
        expect_bitwise(q, to_cpu(qg), std::string("scaled cast ") + dtype_name(dtype));
        expect_bitwise(inv, to_cpu(ig), std::string("scale_inv ") + dtype_name(dtype));
    }
}

TEST(CudaOps, Fp8CodesEncodeDecodeAndAmaxAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
        Tensor codes = cpu_tensor({256}, DType::u8), values = cpu_tensor({256}, DType::bf16);
        for (int c = 0; c < 256; ++c) static_cast<uint8_t *>(codes.data_ptr())[c] = static_cast<uint8_t>(c);
        cops().fp8_decode(cs(), codes, format, values);
        cs().synchronize();
        for (int c = 0; c < 256; ++c) {
            const float want = f32_from_fp8(static_cast<uint8_t>(c), format);
            const float got  = bf16_bits_to_f32(static_cast<uint16_t *>(values.data_ptr())[c]);
            if (std::isnan(want)) {
                EXPECT_TRUE(std::isnan(got)) << c;
            } else {
                EXPECT_EQ(got, want) << "code " << c;
            }
        }
        Tensor values_g = Tensor::empty({256}, DType::bf16, gpu());
        gops().fp8_decode(gs(), to_gpu(codes), format, values_g);
        expect_bitwise(values, to_cpu(values_g), "fp8_decode of every code");
    }
    Tensor hand = cpu_tensor({4}), amax = cpu_tensor({1}), codes = cpu_tensor({4}, DType::u8), inv = cpu_tensor({1});
    const float xs[] = {1.0f, -3.5f, 0.3f, 2.0f}, want[] = {128.0f, -448.0f, 40.0f, 256.0f};
    std::copy(xs, xs + 4, hand.data<float>());
    amax.data<float>()[0] = 0.5f;   // a previous piece's
    cops().fp8_amax(cs(), hand.slice(2, {2}), amax);
    cs().synchronize();
    EXPECT_EQ(amax.data<float>()[0], 2.0f);
    cops().fp8_amax(cs(), hand.slice(0, {2}), amax);
    cops().fp8_encode(cs(), hand, Fp8Format::e4m3, amax, codes, inv);
    cs().synchronize();
    EXPECT_EQ(amax.data<float>()[0], 3.5f);
    for (int i = 0; i < 4; ++i) {
        EXPECT_EQ(f32_from_fp8(static_cast<uint8_t *>(codes.data_ptr())[i], Fp8Format::e4m3), want[i]) << i;
    }
    EXPECT_EQ(inv.data<float>()[0], 1.0f / 128.0f);
    const int64_t n = 2 * (int64_t{1} << 16) + 777;   // three amax chunks, the last partial
    for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
        Tensor x  = random_cpu({n}, 730, 5.0f);
        Tensor q  = cpu_tensor({n}, DType::bf16), qi = cpu_tensor({1});
        Tensor ac = cpu_tensor({1}), cc = cpu_tensor({n}, DType::u8), ic = cpu_tensor({1}), dc = cpu_tensor({n}, DType::bf16);
        ac.data<float>()[0] = 0.0f;
        cops().fp8_quantize(cs(), x, format, q, qi);
        cops().fp8_amax(cs(), x, ac);
        cops().fp8_encode(cs(), x, format, ac, cc, ic);
        cops().fp8_decode(cs(), cc, format, dc);
        cs().synchronize();
        expect_bitwise(q, dc, "encode then decode against fp8_quantize's values");
        expect_bitwise(qi, ic, "encode's scale_inv against fp8_quantize's");
        Tensor ag = to_gpu(cpu_tensor({1})), cg = Tensor::empty({n}, DType::u8, gpu()), ig = Tensor::empty({1}, DType::f32, gpu());
        gops().fill_zero(gs(), ag);
        const Tensor xg = to_gpu(x);
        gops().fp8_amax(gs(), xg, ag);
        gops().fp8_encode(gs(), xg, format, ag, cg, ig);
        expect_bitwise(ac, to_cpu(ag), "fp8_amax");
        expect_bitwise(cc, to_cpu(cg), "fp8_encode codes");
        expect_bitwise(ic, to_cpu(ig), "fp8_encode scale_inv");
        Tensor xb = random_cpu({n}, 731, 5.0f, DType::bf16), ab = cpu_tensor({1}), abg = to_gpu(cpu_tensor({1}));
        ab.data<float>()[0] = 0.0f;
        gops().fill_zero(gs(), abg);
        cops().fp8_amax(cs(), xb, ab);
        cs().synchronize();
        gops().fp8_amax(gs(), to_gpu(xb), abg);
        expect_bitwise(ab, to_cpu(abg), "fp8_amax of bf16");
    }
}

// --fp8-recipe blockwise's cast: on the CPU the hand-worked case (e4m3, blocks of 1 x 2 over a 2 x 3 tensor: the
// blocks' power-of-two scales 128, 1024, 4 and 64; 400 ties between 384 and 416 and takes the even 384), then the
// CUDA kernels bitwise the CPU's for the three block shapes the GEMMs use, on shapes that leave partial blocks.
TEST(CudaOps, Fp8QuantizeBlocksIsTheBlockRuleAndBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    Tensor      hand = cpu_tensor({2, 3}), q = cpu_tensor({2, 3}, DType::bf16);
    const float xs[] = {1.0f, -3.5f, 0.3f, 100.0f, 0.01f, 7.0f};
    const float want[] = {1.0f, -3.5f, 0.3125f, 96.0f, 0.009765625f, 7.0f};
    std::copy(xs, xs + 6, hand.data<float>());
    cops().fp8_quantize_blocks(cs(), hand, Fp8Format::e4m3, 1, 2, q, false);
    cs().synchronize();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(bf16_bits_to_f32(static_cast<uint16_t *>(q.data_ptr())[i]), want[i]) << i;
    // MXFP8's rule on blocks of 1 x 3, which here gives the values above: the first row's amax 3.5 makes 3.5 / 448 =
    // 2^-7, so x 128 (0.3 -> 38.4 -> 40 -> 0.3125); the second's 100 / 448 rounds up to 2^-2, so x 4 (400 ties to
    // 384 -> 96, 0.04 -> 0.0390625 -> 0.009765625, 28 -> 7).
    cops().fp8_quantize_blocks(cs(), hand, Fp8Format::e4m3, 1, 3, q, true);
    cs().synchronize();
    for (int i = 0; i < 6; ++i) EXPECT_EQ(bf16_bits_to_f32(static_cast<uint16_t *>(q.data_ptr())[i]), want[i]) << "mx " << i;
    // Just past the format's largest: 449 / 448 rounds up to 2^1, so x 1/2: 224.5 -> 224 -> 448, no saturation.
    Tensor edge = cpu_tensor({1, 2}), qe = cpu_tensor({1, 2}, DType::bf16);
    write_values_f32(edge, std::vector<float>{449.0f, 1.0f});
    cops().fp8_quantize_blocks(cs(), edge, Fp8Format::e4m3, 1, 2, qe, true);
    cs().synchronize();
    EXPECT_EQ(bf16_bits_to_f32(static_cast<uint16_t *>(qe.data_ptr())[0]), 448.0f) << "449 / 2 = 224.5 -> 224, times 2";
    // Each block shape once in each format, f32 and bf16 inputs alternating; MXFP8's two shapes.
    const std::tuple<int64_t, int64_t, bool> shapes[] = {{1, 128, false}, {128, 1, false}, {128, 128, false},
                                                         {1, 32, true},   {32, 1, true}};
    int                                      round    = 0;
    for (const auto & [br, bc, mx] : shapes) {
        for (const Fp8Format format : {Fp8Format::e4m3, Fp8Format::e5m2}) {
            const DType dtype = round++ % 2 == 0 ? DType::f32 : DType::bf16;
            Tensor      x     = random_cpu({260, 200}, 740, 5.0f, dtype);
            Tensor      qc = cpu_tensor({260, 200}, DType::bf16), qg = Tensor::empty({260, 200}, DType::bf16, gpu());
            cops().fp8_quantize_blocks(cs(), x, format, br, bc, qc, mx);
            cs().synchronize();
            gops().fp8_quantize_blocks(gs(), to_gpu(x), format, br, bc, qg, mx);
            expect_bitwise(qc, to_cpu(qg), std::string(mx ? "mxfp8 " : "fp8_quantize_blocks ") + std::to_string(br) + " x " +
                                               std::to_string(bc));
        }
    }
}

// scale_by_inverse_norm divides by the norm read from sum_of_squares' pair on the device: bitwise the CPU's
// for the same pair (f32 inv formed in double on both), and eps taking over for a zero tensor.
TEST(CudaOps, ScaleByInverseNormIsBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    Tensor x = random_cpu({37, 41}, 710, 3.0f), sums = cpu_tensor({2});
    cops().sum_of_squares(cs(), x, sums);
    Tensor xc = clone_cpu(x);
    cops().scale_by_inverse_norm(cs(), xc, sums, 1e-15);
    cs().synchronize();
    Tensor xg = to_gpu(x);
    gops().scale_by_inverse_norm(gs(), xg, to_gpu(sums), 1e-15);
    expect_bitwise(xc, to_cpu(xg), "scale_by_inverse_norm");
    double norm = 0;
    for (int64_t i = 0; i < xc.numel(); ++i) norm += double(xc.data<float>()[i]) * xc.data<float>()[i];
    EXPECT_NEAR(std::sqrt(norm), 1.0, 1e-6) << "unit Frobenius norm";
    Tensor zero = cpu_tensor({4}), zsums = cpu_tensor({2});
    zero.fill_zero();
    zsums.fill_zero();
    Tensor zg = to_gpu(zero);
    gops().scale_by_inverse_norm(gs(), zg, to_gpu(zsums), 1e-15);
    expect_bitwise(zero, to_cpu(zg), "a zero tensor stays zero (eps)");
}

// sum_of_squares_multi: 70 tensors (two launches' worth of 64), empty ones and ones of several chunks among
// them: every pair is bitwise the single-tensor op's on the device (the same chunks, trees and order), so the
// gradient norm keeps its bits.
TEST(CudaOps, SumOfSquaresMultiGivesEachTensorsPairBitwise) {
    SKIP_WITHOUT_CUDA();
    std::vector<Tensor> xs;
    for (int t = 0; t < 70; ++t) {
        const int64_t n = t % 17 == 5 ? 0 : t == 7 ? 2 * (int64_t{1} << 16) + 77 : (t * 7919) % 20011 + 1;
        xs.push_back(to_gpu(random_cpu({std::max<int64_t>(n, 1)}, 2400 + t, 1.5f)).slice(0, {n}));
    }
    Tensor multi = Tensor::empty({2 * 70}, DType::f32, gpu()), single = Tensor::empty({2 * 70}, DType::f32, gpu());
    gops().sum_of_squares_multi(gs(), xs, multi);
    for (size_t t = 0; t < xs.size(); ++t) gops().sum_of_squares(gs(), xs[t], single.slice(static_cast<int64_t>(2 * t), {2}));
    expect_bitwise(to_cpu(single), to_cpu(multi), "sum_of_squares_multi against sum_of_squares, tensor by tensor");
    const Tensor pairs = to_cpu(multi);
    EXPECT_EQ(pairs.data<float>()[2 * 5], 0.0f) << "an empty tensor's sum";
    EXPECT_GT(pairs.data<float>()[2 * 7], 0.0f);
}

TEST(CudaOps, AdamWFiveStepsGiveTheCpusBitsWithBf16F32AndNoOutput) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 100003;
    for (int kind = 0; kind < 3; ++kind) {
        const DType       out_dtype = kind == 1 ? DType::bf16 : DType::f32;
        const std::string what      = kind == 0 ? "no output" : kind == 1 ? "bf16 output" : "f32 output";
        Tensor p = random_cpu({n}, 800), m = random_cpu({n}, 801, 0.1f), v = random_cpu({n}, 802, 0.01f);
        float * vp = v.data<float>();
        for (int64_t i = 0; i < n; ++i) vp[i] = std::fabs(vp[i]);   // second moments are non-negative
        Tensor pc = clone_cpu(p), mc = clone_cpu(m), vc = clone_cpu(v), oc = cpu_tensor({n}, out_dtype);
        Tensor pg = to_gpu(p), mg = to_gpu(m), vg = to_gpu(v), og = Tensor::empty({n}, out_dtype, gpu());
        for (int64_t step = 1; step <= 5; ++step) {
            Tensor   g = random_cpu({n}, 810 + step, 0.5f);
            AdamStep a{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, step};
            cops().adamw(cs(), pc, g, mc, vc, kind ? oc : Tensor(), a);
            gops().adamw(gs(), pg, to_gpu(g), mg, vg, kind ? og : Tensor(), a);
            cs().synchronize();
        }
        expect_bitwise(pc, to_cpu(pg), "adamw " + what + ": master");
        expect_bitwise(mc, to_cpu(mg), "adamw " + what + ": m");
        expect_bitwise(vc, to_cpu(vg), "adamw " + what + ": v");
        if (kind) expect_bitwise(oc, to_cpu(og), "adamw " + what + ": out");
    }
}

// adamw_multi: 30 tensors (two launches of up to 24), of sizes from 0 to a few thousand, each with its own
// learning rate, weight decay and output (none, bf16, f32), two steps: every tensor's master, m, v and output
// bitwise what the CPU's adamw gives tensor by tensor (the multi-tensor kernel shares the per-element code).
TEST(CudaOps, AdamWMultiGivesTheCpusBitsTensorByTensor) {
    SKIP_WITHOUT_CUDA();
    struct One { Tensor p, m, v, out, pg, mg, vg, og; AdamStep a; };
    std::vector<One> all;
    for (int t = 0; t < 30; ++t) {
        const int64_t n   = t == 3 ? 0 : (t * 977) % 4099 + 1;
        const DType   out = t % 3 == 1 ? DType::bf16 : DType::f32;
        One           o;
        o.p = random_cpu({n}, 2000 + t);
        o.m = random_cpu({n}, 2100 + t, 0.1f);
        o.v = random_cpu({n}, 2200 + t, 0.01f);
        for (int64_t i = 0; i < n; ++i) o.v.data<float>()[i] = std::fabs(o.v.data<float>()[i]);
        o.pg  = to_gpu(o.p);
        o.mg  = to_gpu(o.m);
        o.vg  = to_gpu(o.v);
        o.out = t % 3 == 0 ? Tensor() : cpu_tensor({n}, out);
        o.og  = t % 3 == 0 ? Tensor() : Tensor::empty({n}, out, gpu());
        o.a   = AdamStep{1e-3f * static_cast<float>(1 + t % 4), 0.9f, 0.95f, 1e-8f, t % 2 ? 0.0f : 0.1f, 0};
        all.push_back(std::move(o));
    }
    for (int64_t step = 1; step <= 2; ++step) {
        std::vector<AdamwTensors> entries;
        for (size_t t = 0; t < all.size(); ++t) {
            One &  o = all[t];
            Tensor g = random_cpu({o.p.numel()}, 2300 + 31 * step + static_cast<uint64_t>(t), 0.5f);
            o.a.step = step;
            cops().adamw(cs(), o.p, g, o.m, o.v, o.out, o.a);
            entries.push_back({o.pg, to_gpu(g), o.mg, o.vg, o.og, o.a});
        }
        gops().adamw_multi(gs(), entries);
    }
    cs().synchronize();
    for (size_t t = 0; t < all.size(); ++t) {
        const One &       o    = all[t];
        const std::string what = "adamw_multi tensor " + std::to_string(t);
        expect_bitwise(o.p, to_cpu(o.pg), what + ": master");
        expect_bitwise(o.m, to_cpu(o.mg), what + ": m");
        expect_bitwise(o.v, to_cpu(o.vg), what + ": v");
        if (o.out.defined()) expect_bitwise(o.out, to_cpu(o.og), what + ": out");
    }
}

// The step decided on the device (optim::Optimizer::step_gated): grad_norm_gate's clip factor, go flag and
// norm, on both backends, bitwise what the host computes from the same (hi, lo) pairs in double (the dense
// pairs, then the experts', added; the norm's square root; max_norm / (norm + 1e-6) below 1); a NaN
// gradient pair or an infinite loss pair closes the gate. adamw_multi_gated then obeys it: a closed gate
// changes nothing, an open one scales each gradient by the factor (Ops::scale's bits) and steps as adamw.
TEST(CudaOps, TheGradNormGateDecidesTheStepAsTheHostWould) {
    SKIP_WITHOUT_CUDA();
    const GradNormGate layout{5, 3, 2, 0.0f};
    struct Case { float max_norm; int bad; };   // bad: 0 none, 1 a NaN gradient pair, 2 an infinite loss pair
    for (const Case c : {Case{0.5f, 0}, Case{1e6f, 0}, Case{0.0f, 0}, Case{0.5f, 1}, Case{0.5f, 2}}) {
        const std::string what = "max_norm " + std::to_string(c.max_norm) + ", case " + std::to_string(c.bad);
        Tensor pairs = random_cpu({20}, 4100, 3.0f);
        for (int64_t k = 0; k < 20; k += 2) {   // (hi, lo): a sum of squares and its small remainder
            pairs.data<float>()[k] = std::fabs(pairs.data<float>()[k]);
            pairs.data<float>()[k + 1] *= 1e-7f;
        }
        if (c.bad == 1) pairs.data<float>()[6] = NAN;
        if (c.bad == 2) pairs.data<float>()[18] = INFINITY;
        GradNormGate g = layout;
        g.max_norm     = c.max_norm;
        // The host's arithmetic, written out.
        double dense = 0, expert = 0;
        for (int k = 0; k < 5; ++k) dense += double(pairs.data<float>()[2 * k]) + double(pairs.data<float>()[2 * k + 1]);
        for (int k = 5; k < 8; ++k) expert += double(pairs.data<float>()[2 * k]) + double(pairs.data<float>()[2 * k + 1]);
        const double norm  = std::sqrt(dense + expert);
        const double ratio = c.max_norm / (norm + 1e-6);
        const float  coeff = c.max_norm > 0 && std::isfinite(norm) && ratio < 1.0 ? static_cast<float>(ratio) : 1.0f;
        const bool   go    = c.bad == 0;
        Tensor gate_c = cpu_tensor({2}), norm_c = cpu_tensor({1}, DType::f64);
        Tensor gate_g = Tensor::zeros({2}, DType::f32, gpu()), norm_g = Tensor::zeros({1}, DType::f64, gpu());
        cops().grad_norm_gate(cs(), pairs, g, gate_c, norm_c);
        gops().grad_norm_gate(gs(), to_gpu(pairs), g, gate_g, norm_g);
        cs().synchronize();
        Tensor gate_back = to_cpu(gate_g), norm_back = to_cpu(norm_g);
        for (const Tensor * gate : {&gate_c, &gate_back}) {
            EXPECT_EQ(gate->data<float>()[1], go ? 1.0f : 0.0f) << what;
            if (go) EXPECT_EQ(std::memcmp(gate->data<float>(), &coeff, sizeof(float)), 0) << what << ": " << gate->data<float>()[0];
        }
        if (c.bad != 1) {
            EXPECT_EQ(std::memcmp(norm_c.data<double>(), &norm, sizeof(double)), 0) << what;
            EXPECT_EQ(std::memcmp(norm_back.data<double>(), &norm, sizeof(double)), 0) << what;
        }
        if (c.max_norm == 0.5f && go) EXPECT_LT(coeff, 1.0f) << "the case clips";

        // Three tensors (one in a second dtype of output) stepped through the gate the GPU computed.
        std::vector<AdamwTensors> host, device;
        std::vector<Tensor>       p0;
        for (int t = 0; t < 3; ++t) {
            const int64_t n = 1000 + 333 * t;
            Tensor p = random_cpu({n}, 4200 + t), m = random_cpu({n}, 4210 + t, 0.1f), v = random_cpu({n}, 4220 + t, 0.01f);
            for (int64_t i = 0; i < n; ++i) v.data<float>()[i] = std::fabs(v.data<float>()[i]);
            Tensor grad = random_cpu({n}, 4230 + t, 0.5f);
            Tensor out  = t == 1 ? cpu_tensor({n}, DType::bf16) : Tensor();
            const AdamStep a{1e-3f, 0.9f, 0.95f, 1e-8f, 0.1f, 3};
            device.push_back({to_gpu(p), to_gpu(grad), to_gpu(m), to_gpu(v), t == 1 ? Tensor::zeros({n}, DType::bf16, gpu()) : Tensor(), a});
            p0.push_back(clone_cpu(p));
            host.push_back({p, grad, m, v, out, a});
        }
        gops().adamw_multi_gated(gs(), device, gate_g);
        if (go) {
            for (const AdamwTensors & e : host) {
                cops().scale(cs(), e.grad, coeff);
                cops().adamw(cs(), e.master, e.grad, e.m, e.v, e.out, e.step);
            }
        }
        cs().synchronize();
        for (size_t t = 0; t < host.size(); ++t) {
            const std::string tensor = what + ", tensor " + std::to_string(t);
            expect_bitwise(host[t].master, to_cpu(device[t].master), tensor + ": master");
            expect_bitwise(host[t].grad, to_cpu(device[t].grad), tensor + ": grad");
            expect_bitwise(host[t].m, to_cpu(device[t].m), tensor + ": m");
            expect_bitwise(host[t].v, to_cpu(device[t].v), tensor + ": v");
            if (go && host[t].out.defined()) expect_bitwise(host[t].out, to_cpu(device[t].out), tensor + ": out");
            if (!go) expect_bitwise(p0[t], to_cpu(device[t].master), tensor + ": untouched");
        }
    }
}

// ---------------------------------------------------------------------------------------------- Rotary embedding, dropout

// Partial and interleaved, then the same with YaRN's frequencies and amplitude (MLA's RoPE: factor 40 over
// an original context of 64, amplitude 1.1).
TEST(CudaOps, PartialInterleavedRopeMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t seq = 11, b = 2, heads = 3, d = 32, stride = heads * d + 7;
    RopeScaling   yarn;
    yarn.factor                 = 40.0f;
    yarn.original_max_positions = 64;
    yarn.amplitude              = 1.1f;
    for (const bool scaled : {false, true}) {
        for (bool inverse : {false, true}) {
            Tensor x  = random_cpu({seq * b, stride}, 1100 + inverse, 2.0f);
            Tensor xc = clone_cpu(x), xg = to_gpu(x);
            cops().rope(cs(), xc, seq, b, heads, d, 10000.0f, inverse, 16, true, {}, scaled ? yarn : RopeScaling{});
            gops().rope(gs(), xg, seq, b, heads, d, 10000.0f, inverse, 16, true, {}, scaled ? yarn : RopeScaling{});
            cs().synchronize();
            expect_close(xc, to_cpu(xg), 1e-5, std::string(scaled ? "yarn " : "") +
                                                   (inverse ? "partial interleaved rope inverse" : "partial interleaved rope"));
        }
    }
}

TEST(CudaOps, RopeForwardAndInverseMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t seq = 37, b = 3, heads = 5, d = 64, stride = heads * d + 17;   // 17 columns rope leaves alone
    for (bool inverse : {false, true}) {
        const std::string what = inverse ? "rope inverse" : "rope";
        Tensor x  = random_cpu({seq * b, stride}, 1000 + inverse, 2.0f);
        Tensor xc = clone_cpu(x), xg = to_gpu(x);
        cops().rope(cs(), xc, seq, b, heads, d, 10000.0f, inverse);
        gops().rope(gs(), xg, seq, b, heads, d, 10000.0f, inverse);
        cs().synchronize();
        Tensor got = to_cpu(xg);
        expect_close(xc, got, 1e-5, what);
        for (int64_t r = 0; r < seq * b; ++r) {
            ASSERT_EQ(std::memcmp(got.data<float>() + r * stride + heads * d, x.data<float>() + r * stride + heads * d,
                                  17 * sizeof(float)), 0)
                << what << ": row " << r << "'s columns past the heads changed";
        }
    }
}

// The masks are core/dropout.h's on both sides: bitwise, with and without sample ids (in device and in
// pinned memory), at a row offset into the (s, b) rows, in place, and at p = 0.
TEST(CudaOps, DropoutMasksAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 48, w = 300, batch = 4;
    Tensor        ids = cpu_tensor({batch}, DType::i64);
    for (int64_t j = 0; j < batch; ++j) ids.data<int64_t>()[j] = 1000 + 7 * j;
    Tensor ids_pinned = Tensor::empty({batch}, DType::i64, gpu(), {MemoryKind::pinned_host});
    ids_pinned.copy_from(ids);
    for (int variant = 0; variant < 5; ++variant) {
        // 0: no sample ids; 1: ids in device memory; 2: ids pinned; 3: in place (y is x); 4: p = 0
        const std::string what = "dropout variant " + std::to_string(variant);
        Dropout kc;
        kc.p      = variant == 4 ? 0.0f : 0.3f;
        kc.seed   = 1234;
        kc.site   = dropout_site(2, DropoutKind::mlp_output);
        kc.batch  = batch;
        kc.offset = 8;   // a sequence-parallel block of rows: positions from 2
        Dropout kg = kc;
        if (variant == 1 || variant == 2 || variant == 3) {
            kc.sample_ids = ids;
            kg.sample_ids = variant == 2 ? ids_pinned : to_gpu(ids);
        }
        Tensor x  = random_cpu({n, w}, 1100 + variant);
        Tensor xc = clone_cpu(x), yc = variant == 3 ? xc : cpu_tensor({n, w});
        Tensor xg = to_gpu(x), yg = variant == 3 ? xg : Tensor::empty({n, w}, DType::f32, gpu());
        cops().dropout(cs(), xc, yc, kc);
        gops().dropout(gs(), xg, yg, kg);
        cs().synchronize();
        Tensor got = to_cpu(yg);
        expect_bitwise(yc, got, what);
        int64_t dropped = 0;
        for (int64_t i = 0; i < n * w; ++i) dropped += got.data<float>()[i] == 0.0f;
        if (variant == 4) {
            EXPECT_EQ(dropped, 0) << what;
        } else {
            EXPECT_NEAR(double(dropped) / double(n * w), 0.3, 0.02) << what << ": the mask drops about p";
        }
    }
    // Another site or seed draws another mask.
    Dropout a;
    a.p     = 0.5f;
    a.batch = batch;
    Dropout other = a;
    other.site    = 5;
    Tensor x = random_cpu({n, w}, 1110), ya = Tensor::empty({n, w}, DType::f32, gpu()), yb = Tensor::empty({n, w}, DType::f32, gpu());
    Tensor xg = to_gpu(x);
    gops().dropout(gs(), xg, ya, a);
    gops().dropout(gs(), xg, yb, other);
    Tensor ga = to_cpu(ya), gb = to_cpu(yb);
    EXPECT_NE(std::memcmp(ga.data_ptr(), gb.data_ptr(), ga.nbytes()), 0) << "sites 0 and 5 drew the same mask";
}

// ---------------------------------------------------------------------------------------------- Embedding

// (b, s) ids in [0, limit), every `minus_every`-th one -1 (another rank's shard).
Tensor random_ids(int64_t b, int64_t seq, int64_t limit, uint64_t seed, int64_t minus_every) {
    Tensor             t = cpu_tensor({b, seq}, DType::i32);
    std::vector<float> u = loom::testing::random_vector(t.numel(), seed, 1.0f);
    for (int64_t i = 0; i < t.numel(); ++i) {
        const auto id          = static_cast<int32_t>(std::min<int64_t>(limit - 1, int64_t((u[i] + 1.0f) * 0.5f * limit)));
        t.data<int32_t>()[i]   = minus_every > 0 && i % minus_every == 3 ? -1 : id;
    }
    return t;
}

TEST(CudaOps, EmbeddingForwardIsBitwiseTheCpusForF32AndBf16Tables) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 3, seq = 41, vocab = 97, h = 130, positions = 50;
    Tensor        tokens = random_ids(b, seq, vocab, 1200, 11);
    for (DType dtype : {DType::f32, DType::bf16}) {
        for (bool with_wpe : {false, true}) {
            const std::string what = std::string("embedding_forward ") + dtype_name(dtype) + (with_wpe ? " +wpe" : "");
            Tensor wte = random_cpu({vocab, h}, 1201, 1.0f, dtype), wpe = random_cpu({positions, h}, 1202, 1.0f, dtype);
            Tensor oc = cpu_tensor({seq * b, h}), og = Tensor::empty({seq * b, h}, DType::f32, gpu());
            cops().embedding_forward(cs(), tokens, wte, with_wpe ? wpe : Tensor(), oc);
            gops().embedding_forward(gs(), to_gpu(tokens), to_gpu(wte), with_wpe ? to_gpu(wpe) : Tensor(), og);
            cs().synchronize();
            expect_bitwise(oc, to_cpu(og), what);
        }
    }
}

// Each dwte / dwpe element adds its rows in the CPU's row order: the same f32 sums, bit for bit. A small
// vocabulary repeats tokens many times (long runs after the CUDA path's sort by token); a large one makes
// runs of one row. 148 rows sort as 256 keys (the padding's sort last), and every 7th id is -1 (no row).
TEST(CudaOps, EmbeddingBackwardAddsInTheCpusOrderBitwise) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 4, seq = 37, positions = 40;
    struct Case { int64_t vocab, h; };
    for (Case c : {Case{13, 300}, Case{5000, 64}, Case{257, 1000}}) {
        for (bool with_wpe : {false, true}) {
            const std::string what = "embedding_backward vocab " + std::to_string(c.vocab) + " h " + std::to_string(c.h) +
                                     (with_wpe ? " +dwpe" : "");
            Tensor tokens = random_ids(b, seq, c.vocab, 1300 + c.vocab, 7);
            Tensor dout = random_cpu({seq * b, c.h}, 1301), dwte0 = random_cpu({c.vocab, c.h}, 1302);
            Tensor dwpe0 = random_cpu({positions, c.h}, 1303);
            Tensor dwtec = clone_cpu(dwte0), dwpec = clone_cpu(dwpe0), dwteg = to_gpu(dwte0), dwpeg = to_gpu(dwpe0);
            cops().embedding_backward(cs(), tokens, dout, dwtec, with_wpe ? dwpec : Tensor());
            gops().embedding_backward(gs(), to_gpu(tokens), to_gpu(dout), dwteg, with_wpe ? dwpeg : Tensor());
            cs().synchronize();
            expect_bitwise(dwtec, to_cpu(dwteg), what + ": dwte (added to)");
            expect_bitwise(dwpec, to_cpu(dwpeg), what + ": dwpe (added to, or untouched)");
        }
    }
}

TEST(CudaOps, VocabShardIdsAreBitwiseTheCpus) {
    SKIP_WITHOUT_CUDA();
    Tensor ids = random_ids(5, 77, 200, 1400, 9);
    Tensor oc = cpu_tensor({5, 77}, DType::i32), og = Tensor::empty({5, 77}, DType::i32, gpu());
    cops().vocab_shard_ids(cs(), ids, 50, 70, oc);
    gops().vocab_shard_ids(gs(), to_gpu(ids), 50, 70, og);
    cs().synchronize();
    expect_bitwise(oc, to_cpu(og), "vocab_shard_ids [50, 120)");
}

// ---------------------------------------------------------------------------------------------- Cross-entropy

TEST(CudaOps, CrossEntropyForwardBackwardMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 3, seq = 29, n = seq * b, vocab = 1000, stride = 1024;   // 24 columns of padding
    Tensor        logits = random_cpu({n, stride}, 1500, 6.0f);
    Tensor        labels = random_ids(b, seq, vocab, 1501, 5);
    Tensor lc = cpu_tensor({n}), ec = cpu_tensor({n}), lg = Tensor::empty({n}, DType::f32, gpu()), eg = Tensor::empty({n}, DType::f32, gpu());
    Tensor logits_g = to_gpu(logits), labels_g = to_gpu(labels);
    cops().cross_entropy_forward(cs(), logits, labels, lc, ec, vocab);
    gops().cross_entropy_forward(gs(), logits_g, labels_g, lg, eg, vocab);
    cs().synchronize();
    expect_close(lc, to_cpu(lg), 1e-5, "cross_entropy_forward: loss");
    expect_close(ec, to_cpu(eg), 1e-5, "cross_entropy_forward: lse");

    // Backward from the same lse (the CPU's), so the comparison is of the backward alone.
    Tensor dloss = random_cpu({n}, 1502);
    Tensor gc    = clone_cpu(logits);
    cops().cross_entropy_backward(cs(), gc, labels, ec, dloss, vocab);
    gops().cross_entropy_backward(gs(), logits_g, labels_g, to_gpu(ec), to_gpu(dloss), vocab);
    cs().synchronize();
    Tensor got = to_cpu(logits_g);
    expect_close(gc, got, 1e-5, "cross_entropy_backward", 0.01);
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t v = vocab; v < stride; ++v) {
            ASSERT_EQ(std::bit_cast<uint32_t>(got.data<float>()[r * stride + v]), 0u) << "padding at row " << r << " column " << v;
        }
    }
}

TEST(CudaOps, VocabParallelPiecesMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 2, seq = 23, n = seq * b, valid = 700, stride = 768;
    Tensor        logits = random_cpu({n, stride}, 1600, 6.0f);
    float *       x      = logits.data<float>();
    for (int64_t v = 0; v < stride; ++v) x[v] = v >= valid ? 100.0f : 0.0f;   // row 0: zeros, padding larger
    x[0] = -0.0f;                                                              // the CPU keeps the first maximum: -0
    x[stride + 5] = std::nanf("");                                             // row 1: a NaN, ignored by std::max
    x[2 * stride + 600] = 50.0f;                                               // row 2: one large logit
    Tensor labels = random_ids(b, seq, stride, 1601, 6);                       // labels may point into the padding
    Tensor logits_g = to_gpu(logits), labels_g = to_gpu(labels);

    Tensor mc = cpu_tensor({n}), mg = Tensor::empty({n}, DType::f32, gpu());
    cops().row_max(cs(), logits, valid, mc);
    gops().row_max(gs(), logits_g, valid, mg);
    cs().synchronize();
    expect_bitwise(mc, to_cpu(mg), "row_max");
    EXPECT_TRUE(std::signbit(mc.data<float>()[0])) << "the CPU's row 0 maximum is -0 (the first of the equal zeros)";

    Tensor sc = cpu_tensor({n}), sg = Tensor::empty({n}, DType::f32, gpu());
    Tensor rows_ok = cpu_tensor({n, stride});   // row_sum_exp without the NaN row: the CPU's sum is NaN there too
    rows_ok.copy_from(logits);
    rows_ok.data<float>()[stride + 5] = 1.0f;
    cops().row_max(cs(), rows_ok, valid, mc);
    cops().row_sum_exp(cs(), rows_ok, mc, valid, sc);
    gops().row_sum_exp(gs(), to_gpu(rows_ok), to_gpu(mc), valid, sg);
    cs().synchronize();
    expect_close(sc, to_cpu(sg), 1e-5, "row_sum_exp");

    Tensor tc = cpu_tensor({n}), tg = Tensor::empty({n}, DType::f32, gpu());
    cops().label_logit(cs(), rows_ok, labels, tc);
    gops().label_logit(gs(), to_gpu(rows_ok), labels_g, tg);
    cs().synchronize();
    expect_bitwise(tc, to_cpu(tg), "label_logit");

    Tensor ec = cpu_tensor({n}), lc = cpu_tensor({n}), eg = Tensor::empty({n}, DType::f32, gpu()), lg = Tensor::empty({n}, DType::f32, gpu());
    cops().lse_and_loss(cs(), mc, sc, tc, ec, lc);
    gops().lse_and_loss(gs(), to_gpu(mc), to_gpu(sc), to_gpu(tc), eg, lg);
    cs().synchronize();
    expect_close(ec, to_cpu(eg), 1e-5, "lse_and_loss: lse");
    expect_close(lc, to_cpu(lg), 1e-5, "lse_and_loss: loss");

    Tensor mask = random_cpu({b, seq}, 1602);
    for (int64_t i = 0; i < mask.numel(); ++i) mask.data<float>()[i] = mask.data<float>()[i] > 0.0f ? 1.0f : 0.0f;
    Tensor dc = cpu_tensor({n}), dg = Tensor::empty({n}, DType::f32, gpu());
    cops().loss_grad(cs(), mask, 1.0 / 3.0, dc);
    gops().loss_grad(gs(), to_gpu(mask), 1.0 / 3.0, dg);
    cs().synchronize();
    expect_bitwise(dc, to_cpu(dg), "loss_grad");
}

// A token or label past the table: the CPU's error, word for word, at the next synchronize.
TEST(CudaOps, OutOfRangeIdsRaiseTheCpusErrorAtSynchronize) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 2, seq = 5, vocab = 11, h = 8;
    Tensor        tokens = random_ids(b, seq, vocab, 1700, 0);
    tokens.data<int32_t>()[7] = int32_t(vocab);   // the first bad id, at position 7
    tokens.data<int32_t>()[9] = -5;
    Tensor wte = random_cpu({vocab, h}, 1701), out = cpu_tensor({seq * b, h});
    cops().embedding_forward(cs(), tokens, wte, Tensor(), out);
    const std::string cpu_text = error_of([&] { cs().synchronize(); });
    gops().embedding_forward(gs(), to_gpu(tokens), to_gpu(wte), Tensor(), Tensor::empty({seq * b, h}, DType::f32, gpu()));
    const std::string gpu_text = error_of([&] { gs().synchronize(); });
    EXPECT_NE(cpu_text.find("embedding_forward: token 11 at position 7 is outside [0, 11)"), std::string::npos) << cpu_text;
    EXPECT_EQ(gpu_text, cpu_text);

    Tensor logits = random_cpu({seq * b, 16}, 1702), loss = cpu_tensor({seq * b}), lse = cpu_tensor({seq * b});
    cops().cross_entropy_forward(cs(), logits, tokens, loss, lse, vocab);
    const std::string cpu_ce = error_of([&] { cs().synchronize(); });
    gops().cross_entropy_forward(gs(), to_gpu(logits), to_gpu(tokens), Tensor::empty({seq * b}, DType::f32, gpu()),
                                 Tensor::empty({seq * b}, DType::f32, gpu()), vocab);
    const std::string gpu_ce = error_of([&] { gs().synchronize(); });
    EXPECT_NE(cpu_ce.find("cross_entropy_forward: label 11 at position 7"), std::string::npos) << cpu_ce;
    EXPECT_EQ(gpu_ce, cpu_ce);
    gs().synchronize();   // reported once
}

// ---------------------------------------------------------------------------------------------- Attention

// One attention case on both backends: forward (out, lse) and backward (dqkv, its padding columns left as
// they were) from the same qkv, dout and the CPU's out and lse, so each comparison isolates one kernel.
// With bf16_values, qkv and dout hold bf16-representable values (what a bf16 model feeds: its kept QKV
// is bf16, converted to f32 for the op, which takes f32 only, as the CPU's).
struct AttentionCase {
    AttentionShape a;
    bool           bf16_values;
    bool           dropout;
    bool           key_mask = false;   // DSA's top k: random keys of each row, one key alone on every third row
};

std::string attention_name(const AttentionCase & c) {
    const AttentionShape & a = c.a;
    return "attention s " + std::to_string(a.s) + " b " + std::to_string(a.b) + " nq " + std::to_string(a.nq) +
           " nkv " + std::to_string(a.nkv) + " d " + std::to_string(a.d) + " stride " + std::to_string(a.row_stride) +
           (c.bf16_values ? " bf16 values" : " f32") + (c.dropout ? " dropout" : "") + (c.key_mask ? " key mask" : "");
}

Tensor rounded_to_bf16(const Tensor & t) {
    std::vector<uint16_t> bits(static_cast<size_t>(t.numel()));
    convert(t.data_ptr(), DType::f32, bits.data(), DType::bf16, bits.size());
    Tensor r = cpu_tensor(t.shape());
    convert(bits.data(), DType::bf16, r.data_ptr(), DType::f32, bits.size());
    return r;
}

void attention_matches_the_cpu(const AttentionCase & c, uint64_t seed, double fwd_tol, double bwd_tol) {
    AttentionShape         a    = c.a;   // the CPU's: its key mask in host memory
    AttentionShape         ag   = c.a;   // the device's
    if (c.key_mask) {
        a.key_mask = cpu_tensor({a.b, a.s, a.s}, DType::u8);
        uint64_t state = seed;
        auto     draw  = [&state] { return (state = state * 6364136223846793005ull + 1442695040888963407ull) >> 33; };
        for (int64_t bi = 0; bi < a.b; ++bi) {
            for (int64_t i = 0; i < a.s; ++i) {
                uint8_t * row = a.key_mask.data<uint8_t>() + (bi * a.s + i) * a.s;
                for (int64_t j = 0; j < a.s; ++j) row[j] = i % 3 != 2 && draw() % 2 == 0 ? 1 : 0;
                const int64_t first = a.window >= 0 ? std::max<int64_t>(0, i - a.window) : 0;
                row[first + static_cast<int64_t>(draw() % static_cast<uint64_t>(i - first + 1))] = 1;   // one key it sees
            }
        }
        ag.key_mask = to_gpu(a.key_mask);
    }
    const std::string      what = attention_name(c);
    const int64_t          n = a.s * a.b;
    const float            scale = 1.0f / std::sqrt(static_cast<float>(a.d));
    Tensor qkv  = random_cpu({n, a.row_stride}, seed, 1.5f);
    Tensor dout = random_cpu({n, a.nq * a.d}, seed + 1);
    if (c.bf16_values) {
        qkv  = rounded_to_bf16(qkv);
        dout = rounded_to_bf16(dout);
    }
    Tensor dqkv_init = random_cpu({n, a.row_stride}, seed + 2, 8.0f);   // assigned, padding untouched

    Dropout kc;
    Dropout kg;
    Tensor  ids = cpu_tensor({a.b}, DType::i64);
    if (c.dropout) {
        kc.p      = 0.25f;
        kc.seed   = 4321;
        kc.site   = dropout_site(1, DropoutKind::attention_probs);
        kc.batch  = a.b;
        kc.offset = 3;   // tensor parallelism: these are heads 3 .. of the model
        for (int64_t j = 0; j < a.b; ++j) ids.data<int64_t>()[j] = (int64_t{1} << 33) + 5 * j;
        kc.sample_ids = ids;
        kg            = kc;
        Tensor pinned = Tensor::empty({a.b}, DType::i64, gpu(), {MemoryKind::pinned_host});
        pinned.copy_from(ids);
        kg.sample_ids = pinned;
    }

    // CPU: the oracle.
    Tensor out_c = cpu_tensor({n, a.nq * a.d}), lse_c = cpu_tensor({a.b * a.nq * a.s});
    Tensor dqkv_c = clone_cpu(dqkv_init);
    cops().attention_forward(cs(), qkv, out_c, lse_c, a, scale, kc);
    cops().attention_backward(cs(), qkv, out_c, dout, lse_c, dqkv_c, a, scale, kc);
    cs().synchronize();

    // CUDA: forward on its own; backward from the CPU's out and lse (the same inputs as the CPU's backward).
    Tensor qkv_g = to_gpu(qkv), dout_g = to_gpu(dout);
    Tensor out_g = Tensor::empty({n, a.nq * a.d}, DType::f32, gpu()), lse_g = Tensor::empty({a.b * a.nq * a.s}, DType::f32, gpu());
    gops().attention_forward(gs(), qkv_g, out_g, lse_g, ag, scale, kg);
    Tensor dqkv_g = to_gpu(dqkv_init);
    gops().attention_backward(gs(), qkv_g, to_gpu(out_c), dout_g, to_gpu(lse_c), dqkv_g, ag, scale, kg);
    Tensor dqkv_first = to_cpu(dqkv_g);
    // Deterministic: a second backward gives the same bits.
    gops().attention_backward(gs(), qkv_g, to_gpu(out_c), dout_g, to_gpu(lse_c), dqkv_g, ag, scale, kg);

    expect_close(out_c, to_cpu(out_g), fwd_tol, what + ": out");
    expect_close(lse_c, to_cpu(lse_g), fwd_tol, what + ": lse");
    expect_close(dqkv_c, dqkv_first, bwd_tol, what + ": dqkv");
    expect_bitwise(dqkv_first, to_cpu(dqkv_g), what + ": dqkv run twice");
}

// Sequence lengths below, at and past the 32-row tile (1, 31, 33, 64, 70, 129), MHA, GQA and one key/value
// head, head dimensions 5 (odd), 8, 16, 64, 128 and 256 (over 48 KiB of shared memory), rows with padding.
// Tolerances, |cuda - cpu| <= tol x max(1, |cpu|) element-wise: the same f32 operations and exp_approx on
// both sides, the dot products and sums in another order (tiles of 32 keys, warp trees, fused multiply-adds):
//   out and lse 2e-5, dqkv 5e-5 (sums over every query of a key and the group's heads)
// and the same for bf16-valued inputs (the op computes in f32 either way).
const AttentionShape kAttentionShapes[] = {
    {1, 1, 2, 2, 8, 6 * 8},             // one token
    {31, 2, 4, 4, 16, 12 * 16 + 5},     // MHA, one partial tile, padded rows
    {33, 3, 2, 1, 5, 4 * 5},            // one key/value head, odd d, one full tile and one row
    {70, 2, 4, 2, 8, 8 * 8 + 3},        // GQA, two full tiles and 6 rows
    {64, 1, 8, 2, 64, 12 * 64},         // GQA, exactly two tiles
    {129, 2, 6, 3, 128, 12 * 128},      // GQA d 128: 66 KiB of shared memory in backward
    {45, 1, 2, 1, 256, 4 * 256 + 7},    // d 256, the CUDA maximum
};

TEST(CudaOps, AttentionForwardBackwardMatchTheCpuMhaGqaF32) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 2000;
    for (const AttentionShape & a : kAttentionShapes) attention_matches_the_cpu({a, false, false}, seed += 10, 2e-5, 5e-5);
}

TEST(CudaOps, AttentionForwardBackwardMatchTheCpuWithBf16Values) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 3000;
    for (const AttentionShape & a : kAttentionShapes) attention_matches_the_cpu({a, true, false}, seed += 10, 2e-5, 5e-5);
}

// Dropout on the probabilities: the CPU's masks (core/dropout.h's hash, the head offset and sample ids of
// the key), redrawn in backward. A wrong mask moves out by whole probabilities, far past the tolerance.
TEST(CudaOps, AttentionWithDropoutMatchesTheCpuMasks) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 4000;
    for (const AttentionShape & a : kAttentionShapes) {
        attention_matches_the_cpu({a, false, true}, seed += 10, 2e-5, 5e-5);
        attention_matches_the_cpu({a, true, true}, seed += 10, 2e-5, 5e-5);
    }
}

// Sliding windows (--window-size w,0): 1, 20 (tiles of 32 keys wholly before a query tile's window are
// skipped) and 40, with and without dropout, on the shapes past one tile.
TEST(CudaOps, AttentionSlidingWindowMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 4500;
    for (const int64_t window : {1, 20, 40}) {
        for (AttentionShape a : {kAttentionShapes[3], kAttentionShapes[5]}) {
            a.window = window;
            attention_matches_the_cpu({a, false, false}, seed += 10, 2e-5, 5e-5);
            attention_matches_the_cpu({a, true, true}, seed += 10, 2e-5, 5e-5);
        }
    }
}

// A key mask (DSA's top k): the masked keys' probabilities exactly 0 on both sides, tiles where a row holds no key
// skipped; on the shapes past one tile, f32 and bf16 values, with a window once.
TEST(CudaOps, AttentionKeyMaskMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 4600;
    for (AttentionShape a : {kAttentionShapes[2], kAttentionShapes[3], kAttentionShapes[4]}) {
        attention_matches_the_cpu({a, false, false, true}, seed += 10, 2e-5, 5e-5);
        attention_matches_the_cpu({a, true, false, true}, seed += 10, 2e-5, 5e-5);
    }
    AttentionShape windowed = kAttentionShapes[3];
    windowed.window         = 20;
    attention_matches_the_cpu({windowed, false, false, true}, seed += 10, 2e-5, 5e-5);
}

// Plain causal attention in bf16 runs through cuDNN's fused attention (fused_attention.h): on the
// emulated device, cuDNN's stand-in interprets the operation graph Loom builds, so this holds that the graph
// computes attention (the scores, the causal mask, the softmax and its statistics, and the backward's
// transposed products and grouped sums). The CPU computes in f32 from the same (rounded) values.
// Tolerances, element-wise against max(1, |cpu|): out 8e-3 (its bf16 rounding, 2^-8, and the probabilities'
// f32 sums in another order), lse 1e-4 (f32 sums; the CPU's exp_approx against exp), dq, dk and dv 1.6e-2
// (bf16 gradients summed over keys and over a group's query heads). A second
// backward repeats the bits. The counts hold that the fused path ran, once per call, and built one plan per
// shape and direction.
TEST(CudaOps, PlainCausalAttentionRunsThroughCudnnAndMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 4800;
    const AttentionShape shapes[] = {
        {31, 2, 4, 4, 16, 12 * 16 + 8},   // MHA, padded rows
        {70, 2, 4, 2, 8, 8 * 8 + 8},      // GQA
        {33, 1, 2, 1, 64, 4 * 64},        // one key/value head
    };
    for (const DType dtype : {DType::bf16}) {
        const double k = 1.0;
        for (const AttentionShape & a : shapes) {
            const std::string what = "fused attention s " + std::to_string(a.s) + " nq " + std::to_string(a.nq) + " nkv " +
                                     std::to_string(a.nkv) + " d " + std::to_string(a.d) + " " + dtype_name(dtype);
            const int64_t n     = a.s * a.b;
            const float   scale = 1.0f / std::sqrt(static_cast<float>(a.d));
            const Tensor  qkv16 = random_cpu({n, a.row_stride}, seed += 10, 1.5f, dtype);
            const Tensor  dout16 = random_cpu({n, a.nq * a.d}, seed + 1, 1.0f, dtype);
            auto widen = [](const Tensor & t) {
                Tensor f = cpu_tensor(t.shape());
                convert(t.data_ptr(), t.dtype(), f.data_ptr(), DType::f32, static_cast<size_t>(t.numel()));
                return f;
            };
            const Tensor qkv = widen(qkv16), dout = widen(dout16);
            Tensor out_c = cpu_tensor({n, a.nq * a.d}), lse_c = cpu_tensor({a.b * a.nq * a.s});
            Tensor dqkv_c = cpu_tensor({n, a.row_stride});
            cops().attention_forward(cs(), qkv, out_c, lse_c, a, scale);
            cops().attention_backward(cs(), qkv, out_c, dout, lse_c, dqkv_c, a, scale);
            cs().synchronize();

            const gpu_backend::FusedAttentionStats before = gpu_backend::fused_attention_stats();
            Tensor qkv_g = to_gpu(qkv16), out_g = Tensor::empty({n, a.nq * a.d}, dtype, gpu());
            Tensor lse_g = Tensor::empty({a.b * a.nq * a.s}, DType::f32, gpu());
            gops().attention_forward(gs(), qkv_g, out_g, lse_g, a, scale);
            // Backward from the forward's own out (its rounding is the forward's error, checked above).
            Tensor dqkv_g = Tensor::empty({n, a.row_stride}, dtype, gpu());
            gops().attention_backward(gs(), qkv_g, out_g, to_gpu(dout16), lse_g, dqkv_g, a, scale);
            const Tensor dqkv_first = to_cpu(dqkv_g);
            gops().attention_backward(gs(), qkv_g, out_g, to_gpu(dout16), lse_g, dqkv_g, a, scale);
            const gpu_backend::FusedAttentionStats after = gpu_backend::fused_attention_stats();
            EXPECT_EQ(after.forward_calls - before.forward_calls, 1) << what;
            EXPECT_EQ(after.backward_calls - before.backward_calls, 2) << what;
            EXPECT_EQ(after.refused, 0) << what;
            EXPECT_LE(after.plans - before.plans, 2) << what;

            expect_close(out_c, widen(to_cpu(out_g)), 8e-3 * k, what + ": out");
            expect_close(lse_c, to_cpu(lse_g), 1e-4, what + ": lse");
            // Only the Q, K and V columns are gradients (the padding is the op's to leave).
            Tensor got = widen(dqkv_first), ref = dqkv_c;
            const int64_t used = (a.nq + 2 * a.nkv) * a.d;
            Tensor got_used = cpu_tensor({n, used}), ref_used = cpu_tensor({n, used});
            for (int64_t r = 0; r < n; ++r) {
                std::memcpy(got_used.data<float>() + r * used, got.data<float>() + r * a.row_stride, used * sizeof(float));
                std::memcpy(ref_used.data<float>() + r * used, ref.data<float>() + r * a.row_stride, used * sizeof(float));
            }
            expect_close(ref_used, got_used, 1.6e-2 * k, what + ": dqkv");
            expect_bitwise(dqkv_first, to_cpu(dqkv_g), what + ": dqkv run twice");
        }
    }
    // The same shape again makes no new plan.
    const gpu_backend::FusedAttentionStats before = gpu_backend::fused_attention_stats();
    const AttentionShape a = shapes[0];
    Tensor qkv_g = to_gpu(random_cpu({a.s * a.b, a.row_stride}, 4999, 1.0f, DType::bf16));
    gops().attention_forward(gs(), qkv_g, Tensor::empty({a.s * a.b, a.nq * a.d}, DType::bf16, gpu()),
                             Tensor::empty({a.b * a.nq * a.s}, DType::f32, gpu()), a, 0.25f);
    gs().synchronize();
    EXPECT_EQ(gpu_backend::fused_attention_stats().plans, before.plans);
    EXPECT_EQ(gpu_backend::fused_attention_stats().forward_calls, before.forward_calls + 1);
}

// Attention sinks: the sink's merge into (out, lse) and its gradient, on f32 and bf16 outputs, with fewer
// (b, i) entries per head than the backward's 256 lanes, a few more, and several per lane. Tolerances,
// element-wise against max(1, |cpu|): out and lse 2e-6 in f32 (one exp, log and product each; the device's
// expf and logf against the host's), a bf16 out 4e-3 (its rounding, where the factors differ in the last
// bit); dsink 1e-5 (the same lanes and order, each delta's products possibly fused). Run twice, the
// gradient's bits repeat.
TEST(CudaOps, AttentionSinksMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    uint64_t seed = 4700;
    for (const AttentionShape & a : {AttentionShape{33, 3, 2, 1, 5, 4 * 5}, AttentionShape{129, 2, 6, 3, 16, 12 * 16},
                                     AttentionShape{700, 2, 4, 2, 8, 8 * 8}}) {
        for (const DType dtype : {DType::f32, DType::bf16}) {
            const std::string what = "sinks s " + std::to_string(a.s) + " b " + std::to_string(a.b) + " " + dtype_name(dtype);
            const int64_t     n = a.s * a.b;
            const Tensor out = random_cpu({n, a.nq * a.d}, seed += 10, 1.0f, dtype), dout = random_cpu({n, a.nq * a.d}, seed + 1, 1.0f, dtype);
            const Tensor lse = random_cpu({a.b * a.nq * a.s}, seed + 2, 3.0f), sink = random_cpu({a.nq}, seed + 3, 3.0f);
            const Tensor dsink = random_cpu({a.nq}, seed + 4);
            Tensor out_c = clone_cpu(out), lse_c = clone_cpu(lse), dsink_c = clone_cpu(dsink);
            cops().attention_sink_forward(cs(), out_c, lse_c, sink, a);
            cops().attention_sink_backward(cs(), out_c, dout, lse_c, sink, dsink_c, a);
            cs().synchronize();
            Tensor out_g = to_gpu(out), lse_g = to_gpu(lse), dsink_g = to_gpu(dsink), sink_g = to_gpu(sink);
            gops().attention_sink_forward(gs(), out_g, lse_g, sink_g, a);
            expect_close(out_c, to_cpu(out_g), dtype == DType::f32 ? 2e-6 : 4e-3, what + ": out");
            expect_close(lse_c, to_cpu(lse_g), 2e-6, what + ": lse");
            // The backward from the CPU's final pair (the same inputs as the CPU's backward).
            const Tensor out_cg = to_gpu(out_c), lse_cg = to_gpu(lse_c), dout_g = to_gpu(dout);
            gops().attention_sink_backward(gs(), out_cg, dout_g, lse_cg, sink_g, dsink_g, a);
            const Tensor first = to_cpu(dsink_g);
            expect_close(dsink_c, first, 1e-5, what + ": dsink");
            Tensor again = to_gpu(dsink);
            gops().attention_sink_backward(gs(), out_cg, dout_g, lse_cg, sink_g, again, a);
            expect_bitwise(first, to_cpu(again), what + ": dsink run twice");
        }
    }
}

// Context parallelism's blocks: CP 2 with chunks of 35 rows, each rank's queries (Q alone) against its own
// keys and values and then the other rank's (K | V rows, global positions: rank 0's first chunk sees none of
// rank 1's keys, which leaves lse -inf there before the merge), merged; backward per block from the merged
// out and lse, the second block's gradients added. Dropout on, drawn by global positions. The same
// tolerances as above.
TEST(CudaOps, AttentionContextParallelBlocksMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t chunk = 35, local = 2 * chunk, b = 2, nq = 4, nkv = 2, d = 8;
    const float   scale = 1.0f / std::sqrt(static_cast<float>(d));
    for (int64_t r = 0; r < 2; ++r) {
        const std::string what = "cp 2 rank " + std::to_string(r);
        AttentionShape    a{local, b, nq, nkv, d, nq * d};
        a.s_kv          = local;
        a.kv_row_stride = 2 * nkv * d;
        a.k_col         = 0;
        a.v_col         = nkv * d;
        a.q_pos         = SeqPositions{r * chunk, chunk, (3 - r) * chunk};
        const SeqPositions peer{(1 - r) * chunk, chunk, (2 + r) * chunk};
        Tensor  q = random_cpu({local * b, nq * d}, 5100 + r, 1.5f), kv_own = random_cpu({local * b, 2 * nkv * d}, 5102, 1.5f);
        Tensor  kv_peer = random_cpu({local * b, 2 * nkv * d}, 5103, 1.5f), dout = random_cpu({local * b, nq * d}, 5104);
        Dropout kc;
        kc.p      = 0.25f;
        kc.seed   = 99;
        kc.site   = dropout_site(0, DropoutKind::attention_probs);
        kc.batch  = b;
        auto run = [&](Ops & o, Stream & st, Device & dev, auto place) {
            Tensor out = Tensor::empty({local * b, nq * d}, DType::f32, dev), lse = Tensor::empty({b * nq * local}, DType::f32, dev);
            Tensor part = Tensor::empty({local * b, nq * d}, DType::f32, dev), part_lse = Tensor::empty({b * nq * local}, DType::f32, dev);
            Tensor qd = place(q), own = place(kv_own), other = place(kv_peer), dod = place(dout);
            AttentionShape first = a, second = a;
            first.k_pos  = a.q_pos;
            second.k_pos = peer;
            o.attention_forward(st, qd, own, out, lse, first, scale, kc);
            o.attention_forward(st, qd, other, part, part_lse, second, scale, kc);
            o.attention_merge(st, out, lse, part, part_lse, first);
            Tensor dq = Tensor::empty({local * b, nq * d}, DType::f32, dev);
            Tensor d_own = Tensor::empty({local * b, 2 * nkv * d}, DType::f32, dev), d_other = Tensor::empty({local * b, 2 * nkv * d}, DType::f32, dev);
            o.fill_zero(st, d_other);
            o.attention_backward(st, qd, own, out, dod, lse, dq, d_own, first, scale, kc, false);
            o.attention_backward(st, qd, other, out, dod, lse, dq, d_other, second, scale, kc, true);
            st.synchronize();
            return std::vector<Tensor>{to_cpu(out), to_cpu(lse), to_cpu(dq), to_cpu(d_own), to_cpu(d_other)};
        };
        const std::vector<Tensor> c = run(cops(), cs(), cpu_dev(), [](const Tensor & t) { return t; });
        const std::vector<Tensor> g = run(gops(), gs(), gpu(), [](const Tensor & t) { return to_gpu(t); });
        const char * names[] = {": out", ": lse", ": dq", ": dkv own", ": dkv peer"};
        for (size_t i = 0; i < c.size(); ++i) expect_close(c[i], g[i], i < 2 ? 2e-5 : 5e-5, what + names[i]);
    }
}

// The argument checks are the CPU's (core/op_checks.h), word for word; heads past 256 are refused on CUDA.
TEST(CudaOps, AttentionArgumentErrorsAreTheCpus) {
    SKIP_WITHOUT_CUDA();
    const AttentionShape a{4, 2, 2, 1, 4, 16};
    const int64_t        n = 8;
    auto both = [&](const std::string & what, const std::function<void(Ops &, Stream &, Device &)> & call) {
        const std::string c = error_of([&] { call(cops(), cs(), cpu_dev()); });
        const std::string g = error_of([&] { call(gops(), gs(), gpu()); });
        EXPECT_EQ(g, c) << what;
    };
    auto t = [](Device & dev, const Shape & shape, DType dtype = DType::f32) { return Tensor::empty(shape, dtype, dev); };
    both("qkv size", [&](Ops & o, Stream & s, Device & d) {
        o.attention_forward(s, t(d, {n, 15}), t(d, {n, 8}), t(d, {16}), a, 0.5f);
    });
    // A wrong dtype's text names the tensor's device: the rest is the CPU's.
    const std::string f16_text = error_of([&] {
        gops().attention_forward(gs(), t(gpu(), {n, 16}, DType::f16), t(gpu(), {n, 8}), t(gpu(), {16}), a, 0.5f);
    });
    EXPECT_NE(f16_text.find("attention_forward: q is"), std::string::npos) << f16_text;
    EXPECT_NE(f16_text.find("expected float32 or bfloat16"), std::string::npos) << f16_text;
    const std::string mixed_text = error_of([&] {
        gops().attention_forward(gs(), t(gpu(), {n, 16}, DType::bf16), t(gpu(), {n, 8}), t(gpu(), {16}), a, 0.5f);
    });
    EXPECT_NE(mixed_text.find("attention_forward: out is float32"), std::string::npos) << mixed_text;
    EXPECT_NE(mixed_text.find("expected bfloat16"), std::string::npos) << mixed_text;
    both("bad groups", [&](Ops & o, Stream & s, Device & d) {
        o.attention_forward(s, t(d, {n, 16}), t(d, {n, 8}), t(d, {16}), AttentionShape{4, 2, 3, 2, 4, 16}, 0.5f);
    });
    both("dout size", [&](Ops & o, Stream & s, Device & d) {
        o.attention_backward(s, t(d, {n, 16}), t(d, {n, 8}), t(d, {n, 7}), t(d, {16}), t(d, {n, 16}), a, 0.5f);
    });
    Dropout few;
    few.p          = 0.1f;
    few.sample_ids = cpu_tensor({1}, DType::i64);
    both("one sample id for two sequences", [&](Ops & o, Stream & s, Device & d) {
        o.attention_forward(s, t(d, {n, 16}), t(d, {n, 8}), t(d, {16}), a, 0.5f, few);
    });
    const AttentionShape wide{2, 1, 1, 1, 264, 3 * 264};
    const std::string    text = error_of([&] {
        gops().attention_forward(gs(), t(gpu(), {2, 3 * 264}), t(gpu(), {2, 264}), t(gpu(), {2}), wide, 0.1f);
    });
    EXPECT_NE(text.find("head dimension 264 on CUDA"), std::string::npos) << text;
}

// ---------------------------------------------------------------------------------------------- bf16 activations
// The ops on bf16 activations (--bf16): each reads f32, computes as its f32 kernel and rounds each stored result
// once. Where the f32 kernels give the CPU's bits, so do these; elsewhere the f32 tolerance above plus one bf16
// rounding (2^-8 relative) of a value the two sides computed a few ulp apart.

namespace {

// Runs `op` on CPU copies of `tensors` and on GPU copies, and returns both sets, read back.
std::pair<std::vector<Tensor>, std::vector<Tensor>> on_both(
    const std::vector<Tensor> & tensors, const std::function<void(Ops &, Stream &, std::vector<Tensor> &)> & op) {
    std::vector<Tensor> c, g;
    for (const Tensor & t : tensors) {
        c.push_back(clone_cpu(t));
        g.push_back(to_gpu(t));
    }
    op(cops(), cs(), c);
    op(gops(), gs(), g);
    cs().synchronize();
    gs().synchronize();
    for (Tensor & t : g) t = to_cpu(t);
    return {c, g};
}

}  // namespace

TEST(CudaOps, Bf16ActivationsMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    constexpr double kBf16 = 0x1p-8;
    const int64_t    n = 24, h = 64;
    auto bf = [](const Shape & shape, uint64_t seed, float scale = 1.0f) { return random_cpu(shape, seed, scale, DType::bf16); };
    auto f32 = [](const Shape & shape, uint64_t seed, float scale = 1.0f) { return random_cpu(shape, seed, scale); };
    // GEMM into bf16, with and without the bias epilogue.
    {
        auto [c, g] = on_both({bf({n, h}, 1), bf({48, h}, 2), cpu_tensor({n, 48}, DType::bf16), f32({48}, 3)},
                              [](Ops & o, Stream & s, std::vector<Tensor> & t) { o.gemm(s, t[0], false, t[1], true, t[2]); });
        expect_close(c[2], g[2], 1e-3 + kBf16, "gemm into bf16");
        auto [cb, gb] = on_both({bf({n, h}, 1), bf({48, h}, 2), cpu_tensor({n, 48}, DType::bf16), f32({48}, 3)},
                                [](Ops & o, Stream & s, std::vector<Tensor> & t) { o.gemm_bias(s, t[0], false, t[1], true, t[2], t[3]); });
        expect_close(cb[2], gb[2], 1e-3 + kBf16, "gemm_bias into bf16");
    }
    // Norms: residual add (bitwise), y and dx (tolerance), dgamma and dbeta.
    {
        auto [c, g] = on_both({bf({n, h}, 4), bf({n, h}, 5), f32({h}, 6), f32({h}, 7), cpu_tensor({n, h}, DType::bf16),
                               cpu_tensor({n}), cpu_tensor({n})},
                              [](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                  o.layernorm_forward(s, t[0], t[1], t[2], t[3], t[4], t[5], t[6], 1e-5f);
                              });
        expect_bitwise(c[0], g[0], "layernorm x += residual in bf16");
        expect_close(c[4], g[4], 1e-5 + kBf16, "layernorm y in bf16");
        auto [cb, gb] = on_both({bf({n, h}, 8), c[0], f32({h}, 6), c[5], c[6], cpu_tensor({n, h}, DType::bf16),
                                 cpu_tensor({h}), cpu_tensor({h}), bf({n, h}, 23)},
                                [](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                    o.fill_zero(s, t[6]);
                                    o.fill_zero(s, t[7]);
                                    o.layernorm_backward(s, t[0], t[1], t[2], t[3], t[4], t[5], t[6], t[7], t[8]);
                                });
        expect_close(cb[5], gb[5], 1e-5 + kBf16, "layernorm dx + dresidual in bf16");
        expect_close(cb[6], gb[6], 1e-5, "layernorm dgamma from bf16");
        expect_bitwise(cb[7], gb[7], "layernorm dbeta from bf16");
    }
    // Elementwise: bias_add, add_inplace, dropout and bias_backward bitwise; GELU, SwiGLU, rope within tolerance.
    {
        Dropout key;
        key.p     = 0.2f;
        key.seed  = 5;
        key.batch = 2;
        auto [c, g] = on_both({bf({n, h}, 9), bf({n, h}, 10), f32({h}, 11), cpu_tensor({n, h}, DType::bf16), cpu_tensor({h})},
                              [&](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                  o.bias_add(s, t[0], t[2]);
                                  o.add_inplace(s, t[0], t[1]);
                                  o.dropout(s, t[0], t[3], key);
                                  o.fill_zero(s, t[4]);
                                  o.bias_backward(s, t[3], t[4]);
                              });
        expect_bitwise(c[0], g[0], "bias_add, add_inplace in bf16");
        expect_bitwise(c[3], g[3], "dropout in bf16");
        expect_bitwise(c[4], g[4], "bias_backward from bf16");
        auto [ca, ga] = on_both({bf({n, h}, 12, 3.0f), f32({h}, 13), cpu_tensor({n, h}, DType::bf16), bf({n, h}, 14),
                                 cpu_tensor({n, h}, DType::bf16), cpu_tensor({n, h / 2}, DType::bf16), bf({n, h / 2}, 15)},
                                [](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                    o.swiglu_forward(s, t[0], t[5]);
                                    o.swiglu_backward(s, t[0], t[6], t[4]);
                                    o.bias_gelu_forward(s, t[0], t[1], t[2], Tensor());
                                    o.rope(s, t[3], 12, 2, 4, 16, 10000.0f, false);
                                });
        expect_close(ca[5], ga[5], 1e-5 + kBf16, "swiglu_forward in bf16");
        expect_close(ca[4], ga[4], 1e-5 + kBf16, "swiglu_backward in bf16");
        expect_bitwise(ca[0], ga[0], "bias_gelu_forward's biased x in bf16");
        expect_close(ca[2], ga[2], 1e-5 + kBf16, "bias_gelu_forward y in bf16");
        expect_close(ca[3], ga[3], 1e-5 + kBf16, "rope in bf16");
    }
    // Embedding forward (bitwise) and backward (bitwise), cross-entropy.
    {
        Tensor tokens = cpu_tensor({2, 12}, DType::i32);
        for (int64_t i = 0; i < tokens.numel(); ++i) tokens.data<int32_t>()[i] = static_cast<int32_t>((i * 7) % 40);
        auto [c, g] = on_both({tokens, bf({40, h}, 16), bf({12, h}, 17), cpu_tensor({n, h}, DType::bf16), bf({n, h}, 18),
                               cpu_tensor({40, h}), cpu_tensor({12, h})},
                              [](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                  o.embedding_forward(s, t[0], t[1], t[2], t[3]);
                                  o.fill_zero(s, t[5]);
                                  o.fill_zero(s, t[6]);
                                  o.embedding_backward(s, t[0], t[4], t[5], t[6]);
                              });
        expect_bitwise(c[3], g[3], "embedding_forward into bf16");
        expect_bitwise(c[5], g[5], "embedding_backward dwte from bf16");
        expect_bitwise(c[6], g[6], "embedding_backward dwpe from bf16");
        Tensor labels = cpu_tensor({2, 12}, DType::i32);
        for (int64_t i = 0; i < labels.numel(); ++i) labels.data<int32_t>()[i] = static_cast<int32_t>((i * 5) % 37);
        auto [cl, gl] = on_both({bf({n, 40}, 19, 4.0f), labels, cpu_tensor({n}), cpu_tensor({n}), f32({n}, 20)},
                                [](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                    o.cross_entropy_forward(s, t[0], t[1], t[2], t[3], 37);
                                    o.cross_entropy_backward(s, t[0], t[1], t[3], t[4], 37);
                                });
        expect_close(cl[2], gl[2], 1e-5, "cross_entropy_forward loss from bf16");
        expect_close(cl[0], gl[0], 1e-5 + kBf16, "cross_entropy_backward in bf16", 0.01);
    }
    // Attention, GQA, forward and backward.
    {
        const AttentionShape a{40, 2, 4, 2, 16, (4 + 2 * 2) * 16};
        const int64_t        rows = a.s * a.b;
        auto [c, g] = on_both({bf({rows, a.row_stride}, 21), cpu_tensor({rows, a.nq * a.d}, DType::bf16),
                               cpu_tensor({a.b * a.nq, a.s}), bf({rows, a.nq * a.d}, 22),
                               cpu_tensor({rows, a.row_stride}, DType::bf16)},
                              [&](Ops & o, Stream & s, std::vector<Tensor> & t) {
                                  o.attention_forward(s, t[0], t[1], t[2], a, 0.25f);
                                  o.attention_backward(s, t[0], t[1], t[3], t[2], t[4], a, 0.25f);
                              });
        expect_close(c[1], g[1], 2e-5 + kBf16, "attention out in bf16");
        expect_close(c[2], g[2], 2e-5, "attention lse from bf16");
        expect_close(c[4], g[4], 5e-5 + kBf16, "attention dqkv in bf16");
    }
}

// ---------------------------------------------------------------------------------------------- Mixture of Experts
// The router's ops compute in double and round once: 1e-6 x max(1e-3, |ref|) (a GPU's exp and log differ
// from the host's by an ulp of a double; the emulated device gives the CPU's bits). The expert choices and
// the dispatch plan (integers, and probabilities copied) are bitwise; combining rows adds the same f32
// products in slot order: 1e-6 x max(1, |ref|) (the host compiler may fuse them).

struct RouterCase {
    const char * name;
    MoeRouting   routing;
    int64_t      groups;
    bool         expert_bias = false;   // a random bias in [-0.5, 0.5) added to the selection's scores
};

TEST(CudaOps, MoeRouterTopkLossesAndBackwardMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 96, E = 8;
    const RouterCase cases[] = {
        {"softmax top-2", {E, 2, false, false, 1.0f}, 1},
        {"pre-softmax top-1, seq aux over 4 samples", {E, 1, false, true, 1.0f}, 4},
        {"sigmoid top-3 scaled 2.5", {E, 3, true, false, 2.5f}, 2},
        {"sigmoid top-1", {E, 1, true, false, 1.0f}, 1},
        {"sigmoid top-4, expert bias, group-limited (top-2 of 4 groups)", {E, 4, true, false, 1.0f, 4, 2}, 1, true},
        {"softmax top-2, group-limited (top-1 of 2 groups)", {E, 2, false, false, 1.0f, 2, 1}, 1},
    };
    for (const RouterCase & c : cases) {
        const int64_t k      = c.routing.topk;
        Tensor        logits = random_cpu({n, E}, 1700 + k, 3.0f);
        logits.data<float>()[5 * E + 2] = logits.data<float>()[5 * E + 6] = 10.0f;   // a tie for first place
        Tensor        logits_g = to_gpu(logits);
        Tensor        ic = cpu_tensor({n, k}, DType::i32), pc = cpu_tensor({n, k});
        Tensor        ig = Tensor::empty({n, k}, DType::i32, gpu()), pg = Tensor::empty({n, k}, DType::f32, gpu());
        Tensor        bias = c.expert_bias ? random_cpu({E}, 1720, 0.5f) : Tensor();
        cops().moe_topk(cs(), logits, c.routing, bias, ic, pc);
        gops().moe_topk(gs(), logits_g, c.routing, bias.defined() ? to_gpu(bias) : Tensor(), ig, pg);
        Tensor cc = cpu_tensor({c.groups, E}), cg = Tensor::empty({c.groups, E}, DType::f32, gpu());
        cops().moe_aux_counts(cs(), logits, c.routing, c.groups, cc);
        gops().moe_aux_counts(gs(), logits_g, c.routing, c.groups, cg);
        const MoeRouterLoss loss{c.groups, 2 * n, 0.01f, 0.001f};   // as the first of two sequence-parallel ranks
        Tensor lc = cpu_tensor({4}), lg = Tensor::empty({4}, DType::f32, gpu());
        cops().moe_router_losses(cs(), logits, cc, c.routing, loss, lc);
        gops().moe_router_losses(gs(), logits_g, cg, c.routing, loss, lg);
        Tensor dprobs = random_cpu({n, k}, 1710 + k);
        Tensor dc = cpu_tensor({n, E}), dg = Tensor::empty({n, E}, DType::f32, gpu());
        cops().moe_router_backward(cs(), logits, ic, dprobs, cc, c.routing, loss, 0.5f, dc);
        gops().moe_router_backward(gs(), logits_g, ig, to_gpu(dprobs), cg, c.routing, loss, 0.5f, dg);
        cs().synchronize();
        const std::string what = c.name;
        expect_bitwise(ic, to_cpu(ig), what + ": top_idx");
        if (!c.expert_bias && c.routing.group_topk == 0) {
            EXPECT_EQ(ic.data<int32_t>()[5 * k], 2) << what << ": ties go to the lower expert";
            if (k > 1) {
                EXPECT_EQ(ic.data<int32_t>()[5 * k + 1], 6) << what;
            }
        }
        if (c.routing.group_topk > 0) {   // every token's experts lie in group_topk groups
            const int64_t per = E / c.routing.num_groups;
            for (int64_t x = 0; x < n; ++x) {
                std::set<int32_t> groups;
                for (int64_t j = 0; j < k; ++j) groups.insert(ic.data<int32_t>()[x * k + j] / static_cast<int32_t>(per));
                EXPECT_LE(static_cast<int64_t>(groups.size()), c.routing.group_topk) << what << ": token " << x;
            }
        }
        expect_close(pc, to_cpu(pg), 1e-6, what + ": probs", 1e-3);
        expect_bitwise(cc, to_cpu(cg), what + ": aux counts");
        expect_close(lc, to_cpu(lg), 1e-6, what + ": losses", 1e-3);
        expect_close(dc, to_cpu(dg), 1e-6, what + ": dlogits", 1e-3);
        int64_t routed = 0;
        for (int64_t i = 0; i < c.groups * E; ++i) routed += static_cast<int64_t>(cc.data<float>()[i]);
        EXPECT_EQ(routed, n * k) << what << ": every token counted k times";
    }
}

// Aux-loss-free balancing's bookkeeping: counting a plan's tokens and moving the biases, bitwise the CPU's.
TEST(CudaOps, MoeExpertBiasCountsAndUpdatesMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t rows = 3, E = 8;
    Tensor        counts = cpu_tensor({E}, DType::i64);
    for (int64_t e = 0; e < E; ++e) counts.data<int64_t>()[e] = (e * 7) % 5;
    Tensor load = random_cpu({rows, E}, 1730, 4.0f), bias = random_cpu({rows, E}, 1731, 0.1f);
    for (int64_t i = 0; i < rows * E; ++i) load.data<float>()[i] = std::round(std::fabs(load.data<float>()[i]));
    Tensor load_g = to_gpu(load), bias_g = to_gpu(bias);
    cops().moe_count_tokens(cs(), counts, load.narrow(0, 1, 1).view({E}));
    gops().moe_count_tokens(gs(), to_gpu(counts), load_g.narrow(0, 1, 1).view({E}));
    cops().moe_expert_bias_update(cs(), load, bias, 1e-3f);
    gops().moe_expert_bias_update(gs(), load_g, bias_g, 1e-3f);
    cs().synchronize();
    expect_bitwise(bias, to_cpu(bias_g), "expert bias");
    expect_bitwise(load, to_cpu(load_g), "loads (cleared)");
}

// Sinkhorn routing (--moe-router-load-balancing-type sinkhorn): the balancing over all 96 rows of a micro-
// batch and the selection of a rank's 32 of them (rows 32..63, as the second of three sequence-parallel
// ranks), top-1 with sigmoid probabilities and top-2 with a softmax over all experts, as the router asks.
// The expert choices are bitwise the CPU's and the probabilities within the router's tolerance.
TEST(CudaOps, MoeSinkhornRoutingMatchesTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t N = 96, n = 32, first = 32, E = 8;
    for (const MoeRouting & routing : {MoeRouting{E, 1, true, false, 1.0f}, MoeRouting{E, 2, false, true, 1.0f}}) {
        const int64_t     k = routing.topk;
        const std::string what = "sinkhorn top-" + std::to_string(k);
        Tensor logits = random_cpu({N, E}, 1800 + k, 2.0f);
        Tensor ic = cpu_tensor({n, k}, DType::i32), pc = cpu_tensor({n, k});
        Tensor ig = Tensor::empty({n, k}, DType::i32, gpu()), pg = Tensor::empty({n, k}, DType::f32, gpu());
        cops().moe_sinkhorn_topk(cs(), logits, first, routing, ic, pc);
        gops().moe_sinkhorn_topk(gs(), to_gpu(logits), first, routing, ig, pg);
        cs().synchronize();
        expect_bitwise(ic, to_cpu(ig), what + ": top_idx");
        expect_close(pc, to_cpu(pg), 1e-6, what + ": probs", 1e-3);
        // Balanced: sinkhorn spreads the 32 rows' first choices over the experts, unlike the raw top-1.
        std::vector<int> used(E, 0);
        for (int64_t x = 0; x < n; ++x) used[static_cast<size_t>(ic.data<int32_t>()[x * k])] = 1;
        EXPECT_GE(std::count(used.begin(), used.end(), 1), E / 2) << what;
    }
}

// --moe-router-dtype fp64: the float64 GEMM (core/gemm_f64.h: each element summed in order, nothing fused) is
// bitwise the CPU's on every device, plain and accumulating, transposed either way; convert between f64 and f32
// and the f64 bias add and column sums are bitwise too; and the router's ops read f64 logits (full double precision here) with the f32 case's
// tolerances, the expert choices and counts bitwise, dlogits f64.
TEST(CudaOps, Float64GemmConvertAndRouterOpsMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    auto random_f64 = [](const Shape & shape, uint64_t seed) {
        Tensor t = cpu_tensor(shape, DType::f64);
        Tensor a = random_cpu(shape, seed, 3.0f), b = random_cpu(shape, seed + 1, 1e-6f);
        for (int64_t i = 0; i < t.numel(); ++i) {
            t.data<double>()[i] = static_cast<double>(a.data<float>()[i]) + static_cast<double>(b.data<float>()[i]);
        }
        return t;
    };
    const int64_t m = 37, n = 9, k = 70;
    for (int variant = 0; variant < 4; ++variant) {
        const bool ta = variant & 1, tb = variant & 2;
        Tensor     a  = random_f64(ta ? Shape{k, m} : Shape{m, k}, 1900 + variant);
        Tensor     b  = random_f64(tb ? Shape{n, k} : Shape{k, n}, 1910 + variant);
        Tensor     c0 = random_f64({m, n}, 1920 + variant);
        for (bool acc : {false, true}) {
            Tensor cc = cpu_tensor({m, n}, DType::f64);
            std::memcpy(cc.data_ptr(), c0.data_ptr(), cc.nbytes());
            Tensor cg = to_gpu(c0);
            cops().gemm(cs(), a, ta, b, tb, cc, acc);
            gops().gemm(gs(), to_gpu(a), ta, to_gpu(b), tb, cg, acc);
            cs().synchronize();
            expect_bitwise(cc, to_cpu(cg), "gemm f64 variant " + std::to_string(variant) + (acc ? " +=" : ""));
        }
    }
    Tensor wide = random_f64({1000}, 1930), narrow_c = cpu_tensor({1000}), back_c = cpu_tensor({1000}, DType::f64);
    Tensor narrow_g = Tensor::empty({1000}, DType::f32, gpu()), back_g = Tensor::empty({1000}, DType::f64, gpu());
    cops().convert(cs(), wide, narrow_c);
    cops().convert(cs(), narrow_c, back_c);
    gops().convert(gs(), to_gpu(wide), narrow_g);
    gops().convert(gs(), narrow_g, back_g);
    cs().synchronize();
    expect_bitwise(narrow_c, to_cpu(narrow_g), "convert f64 -> f32");
    expect_bitwise(back_c, to_cpu(back_g), "convert f32 -> f64");
    Tensor y = random_f64({129, 7}, 1931), bias = random_f64({7}, 1932), db0 = random_f64({7}, 1933);
    Tensor yc = cpu_tensor({129, 7}, DType::f64), dbc = cpu_tensor({7}, DType::f64);
    std::memcpy(yc.data_ptr(), y.data_ptr(), y.nbytes());
    std::memcpy(dbc.data_ptr(), db0.data_ptr(), db0.nbytes());
    Tensor yg = to_gpu(y), dbg = to_gpu(db0);
    cops().bias_add(cs(), yc, bias);
    cops().bias_backward(cs(), y, dbc);
    gops().bias_add(gs(), yg, to_gpu(bias));
    gops().bias_backward(gs(), to_gpu(y), dbg);
    cs().synchronize();
    expect_bitwise(yc, to_cpu(yg), "bias_add f64");
    expect_bitwise(dbc, to_cpu(dbg), "bias_backward f64");

    const int64_t    rows = 64, E = 8;
    const MoeRouting routing{E, 2, false, false, 1.0f};
    const MoeRouterLoss loss{1, rows, 0.01f, 0.001f};
    Tensor logits = random_f64({rows, E}, 1940), logits_g = to_gpu(logits);
    Tensor ic = cpu_tensor({rows, 2}, DType::i32), pc = cpu_tensor({rows, 2});
    Tensor ig = Tensor::empty({rows, 2}, DType::i32, gpu()), pg = Tensor::empty({rows, 2}, DType::f32, gpu());
    cops().moe_topk(cs(), logits, routing, Tensor(), ic, pc);
    gops().moe_topk(gs(), logits_g, routing, Tensor(), ig, pg);
    Tensor cc = cpu_tensor({1, E}), cg = Tensor::empty({1, E}, DType::f32, gpu());
    cops().moe_aux_counts(cs(), logits, routing, 1, cc);
    gops().moe_aux_counts(gs(), logits_g, routing, 1, cg);
    Tensor lc = cpu_tensor({4}), lg = Tensor::empty({4}, DType::f32, gpu());
    cops().moe_router_losses(cs(), logits, cc, routing, loss, lc);
    gops().moe_router_losses(gs(), logits_g, cg, routing, loss, lg);
    Tensor dprobs = random_cpu({rows, 2}, 1950);
    Tensor dc = cpu_tensor({rows, E}, DType::f64), dg = Tensor::empty({rows, E}, DType::f64, gpu());
    cops().moe_router_backward(cs(), logits, ic, dprobs, cc, routing, loss, 0.5f, dc);
    gops().moe_router_backward(gs(), logits_g, ig, to_gpu(dprobs), cg, routing, loss, 0.5f, dg);
    Tensor sc = cpu_tensor({rows, 2}, DType::i32), sp = cpu_tensor({rows, 2});
    Tensor sg = Tensor::empty({rows, 2}, DType::i32, gpu()), spg = Tensor::empty({rows, 2}, DType::f32, gpu());
    cops().moe_sinkhorn_topk(cs(), logits, 0, routing, sc, sp);
    gops().moe_sinkhorn_topk(gs(), logits_g, 0, routing, sg, spg);
    cs().synchronize();
    expect_bitwise(ic, to_cpu(ig), "f64 logits: top_idx");
    expect_close(pc, to_cpu(pg), 1e-6, "f64 logits: probs", 1e-3);
    expect_bitwise(cc, to_cpu(cg), "f64 logits: aux counts");
    expect_close(lc, to_cpu(lg), 1e-6, "f64 logits: losses", 1e-3);
    expect_close(dc, to_cpu(dg), 1e-6, "f64 logits: dlogits", 1e-3);
    expect_bitwise(sc, to_cpu(sg), "f64 logits: sinkhorn top_idx");
    expect_close(sp, to_cpu(spg), 1e-6, "f64 logits: sinkhorn probs", 1e-3);
}

// Slots (n, k) routed to experts [0, E), with -1 every `minus_every` and repeated probabilities (ties).
void random_slots(int64_t n, int64_t k, int64_t E, uint64_t seed, int64_t minus_every, Tensor & expert_of, Tensor & probs) {
    expert_of = random_ids(n, k, E, seed, minus_every);
    probs     = random_cpu({n, k}, seed + 1, 1.0f);
    for (int64_t i = 0; i < n * k; ++i) probs.data<float>()[i] = std::round(std::fabs(probs.data<float>()[i]) * 8.0f) / 8.0f;
}

TEST(CudaOps, MoeDispatchPlansAreBitwiseTheCpusWithCapacityPaddingAndLocalExperts) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 40, k = 2, E = 4;
    const struct {
        const char * name;
        MoePlanSpec  spec;
        int64_t      minus_every;
    } cases[] = {
        {"dropless", {0, E, -1, false, true}, 0},
        {"capacity 12, by probability", {0, E, 12, false, true}, 0},
        {"capacity 12, by position, padded", {0, E, 12, true, false}, 0},
        {"capacity 25, by probability, padded", {0, E, 25, true, true}, 0},
        {"local experts [1, 3) of gathered slots with drops", {1, 2, -1, false, true}, 7},
    };
    for (const auto & c : cases) {
        Tensor expert_of, probs;
        random_slots(n, k, E, 1800, c.minus_every, expert_of, probs);
        const int64_t rows = c.spec.padded ? c.spec.experts * c.spec.capacity : n * k;
        Tensor pc = cpu_tensor({n, k}), rc = cpu_tensor({n, k}, DType::i32), tc = cpu_tensor({rows}, DType::i32),
               nc = cpu_tensor({c.spec.experts}, DType::i64);
        Tensor pg = Tensor::empty({n, k}, DType::f32, gpu()), rg = Tensor::empty({n, k}, DType::i32, gpu()),
               tg = Tensor::empty({rows}, DType::i32, gpu()), ng = Tensor::empty({c.spec.experts}, DType::i64, gpu());
        cops().moe_plan(cs(), expert_of, probs, c.spec, pc, rc, tc, nc);
        gops().moe_plan(gs(), to_gpu(expert_of), to_gpu(probs), c.spec, pg, rg, tg, ng);
        Tensor ec = cpu_tensor({n, k}, DType::i32), eg = Tensor::empty({n, k}, DType::i32, gpu());
        cops().moe_plan_experts(cs(), rc, nc, ec);
        gops().moe_plan_experts(gs(), rg, ng, eg);
        cs().synchronize();
        const std::string what = c.name;
        expect_bitwise(pc, to_cpu(pg), what + ": plan probs");
        expect_bitwise(rc, to_cpu(rg), what + ": row_of");
        expect_bitwise(tc, to_cpu(tg), what + ": token_of_row");
        expect_bitwise(nc, to_cpu(ng), what + ": tokens_per_expert");
        expect_bitwise(ec, to_cpu(eg), what + ": experts of the rows");
        // What the plan means, checked on the CPU's: each expert keeps at most the capacity, a kept slot's
        // expert is its own (shifted by the first local expert), a dropped slot keeps no probability.
        for (int64_t e = 0; e < c.spec.experts; ++e) {
            if (c.spec.capacity >= 0) {
                EXPECT_LE(nc.data<int64_t>()[e], c.spec.capacity) << what;
            }
        }
        for (int64_t a = 0; a < n * k; ++a) {
            if (rc.data<int32_t>()[a] < 0) {
                EXPECT_EQ(pc.data<float>()[a], 0.0f) << what << " slot " << a;
            } else {
                EXPECT_EQ(ec.data<int32_t>()[a] + c.spec.first, expert_of.data<int32_t>()[a]) << what << " slot " << a;
            }
        }
    }
}

TEST(CudaOps, MoeGatherCombineAndCombineBackwardMatchTheCpu) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = 33, k = 2, E = 3, h = 70;
    Tensor        expert_of, probs;
    random_slots(n, k, E, 1900, 0, expert_of, probs);
    const MoePlanSpec spec{0, E, 20, true, true};   // drops and padding rows
    const int64_t     rows = E * 20;
    Tensor pc = cpu_tensor({n, k}), rc = cpu_tensor({n, k}, DType::i32), tc = cpu_tensor({rows}, DType::i32),
           nc = cpu_tensor({E}, DType::i64);
    cops().moe_plan(cs(), expert_of, probs, spec, pc, rc, tc, nc);
    cs().synchronize();
    Tensor x = random_cpu({n, h}, 1902), xc = cpu_tensor({rows, h}), xg = Tensor::empty({rows, h}, DType::f32, gpu());
    Tensor tg = to_gpu(tc), rg = to_gpu(rc), pg = to_gpu(pc);
    cops().moe_gather_rows(cs(), x, tc, xc);
    gops().moe_gather_rows(gs(), to_gpu(x), tg, xg);
    Tensor yp = random_cpu({rows, h}, 1903), yc = cpu_tensor({n, h}), yg = Tensor::empty({n, h}, DType::f32, gpu());
    Tensor uc = cpu_tensor({n, h}), ug = Tensor::empty({n, h}, DType::f32, gpu());
    Tensor yp_g = to_gpu(yp);
    cops().moe_combine(cs(), yp, rc, pc, yc);
    gops().moe_combine(gs(), yp_g, rg, pg, yg);
    cops().moe_combine(cs(), yp, rc, Tensor(), uc);
    gops().moe_combine(gs(), yp_g, rg, Tensor(), ug);
    Tensor dy = random_cpu({n, h}, 1904), dsc = cpu_tensor({rows, h}), dwc = cpu_tensor({n, k});
    Tensor dsg = Tensor::empty({rows, h}, DType::f32, gpu()), dwg = Tensor::empty({n, k}, DType::f32, gpu());
    cops().moe_combine_backward(cs(), dy, yp, pc, rc, tc, dsc, dwc);
    gops().moe_combine_backward(gs(), to_gpu(dy), yp_g, pg, rg, tg, dsg, dwg);
    cs().synchronize();
    expect_bitwise(xc, to_cpu(xg), "moe_gather_rows (padding rows zero)");
    expect_close(yc, to_cpu(yg), 1e-6, "moe_combine weighted");
    expect_close(uc, to_cpu(ug), 1e-6, "moe_combine unweighted");
    expect_close(dsc, to_cpu(dsg), 1e-6, "moe_combine_backward: rows");
    expect_close(dwc, to_cpu(dwg), 1e-6, "moe_combine_backward: weights", 1e-3);
    for (int64_t r = 0; r < rows; ++r) {
        if (tc.data<int32_t>()[r] >= 0) continue;
        for (int64_t c = 0; c < h; ++c) ASSERT_EQ(xc.data<float>()[r * h + c], 0.0f) << "padding row " << r;
    }
}

TEST(CudaOps, MoeRouterRefusesMoreExpertsPerTokenThanItsArrayHolds) {
    SKIP_WITHOUT_CUDA();
    const MoeRouting r{80, 70, false, false, 1.0f};
    Tensor logits = Tensor::empty({4, 80}, DType::f32, gpu());
    Tensor idx = Tensor::empty({4, 70}, DType::i32, gpu()), probs = Tensor::empty({4, 70}, DType::f32, gpu());
    EXPECT_NE(error_of([&] { gops().moe_topk(gs(), logits, r, Tensor(), idx, probs); }).find("moe_topk: top-70 routing on CUDA"),
              std::string::npos);
}

// ---------------------------------------------------------------------------------------------- Refusals

TEST(CudaOps, HostTensorsAndHostAccessToDeviceMemoryAreRefused) {
    SKIP_WITHOUT_CUDA();
    Tensor      host = random_cpu({16}, 900);
    Tensor      dev  = Tensor::empty({16}, DType::f32, gpu());
    std::string text = error_of([&] { gops().add_inplace(gs(), dev, host); });
    EXPECT_NE(text.find("is not on cuda:0"), std::string::npos) << text;
    text = error_of([&] { dev.fill_zero(); });
    EXPECT_NE(text.find("the host cannot address"), std::string::npos) << text;
}

// ---------------------------------------------------------------------------------------------- Graphs

// h (m, n) = a (m, k) w (n, k)^T + bias; y = gelu(h).
void gemm_bias_gelu(Stream & s, const Tensor & a, const Tensor & w, const Tensor & bias, const Tensor & h,
                    const Tensor & y) {
    gops().gemm(s, a, false, w, true, h, false);
    gops().bias_add(s, h, bias);
    gops().bias_gelu_forward(s, h, Tensor(), y, Tensor());
}

TEST(CudaGraphs, GemmBiasGeluGraphReplaysBitwiseTheEagerOpsAfterItsInputChangesInPlace) {
    SKIP_WITHOUT_CUDA();
    const int64_t m = 64, n = 96, k = 128;
    Tensor        w = to_gpu(random_cpu({n, k}, 1101)), bias = to_gpu(random_cpu({n}, 1102));
    Tensor        a = to_gpu(random_cpu({m, k}, 1103));   // the graph's input: new values are copied into it
    Tensor        h = Tensor::empty({m, n}, DType::f32, gpu()), y = Tensor::empty({m, n}, DType::f32, gpu());
    gops().fill_zero(gs(), y);
    gs().synchronize();
    Graph graph(gpu(), "cuda test: gemm bias gelu");
    gs().begin_capture(graph);
    gemm_bias_gelu(gs(), a, w, bias, h, y);
    gs().end_capture();
    EXPECT_EQ(graph.num_segments(), 1u);
    Tensor untouched = to_cpu(y);
    for (int64_t i = 0; i < untouched.numel(); ++i) ASSERT_EQ(untouched.data<float>()[i], 0.0f) << "capture ran element " << i;
    for (uint64_t seed : {uint64_t{1104}, uint64_t{1105}}) {
        Tensor input = to_gpu(random_cpu({m, k}, seed));
        Tensor ref_h = Tensor::empty({m, n}, DType::f32, gpu()), ref_y = Tensor::empty({m, n}, DType::f32, gpu());
        gemm_bias_gelu(gs(), input, w, bias, ref_h, ref_y);   // eager
        gops().copy(gs(), input, a);                          // in place: the graph reads a's address
        graph.replay(gs());
        expect_bitwise(to_cpu(ref_h), to_cpu(h), "h after a replay, input seed " + std::to_string(seed));
        expect_bitwise(to_cpu(ref_y), to_cpu(y), "y after a replay, input seed " + std::to_string(seed));
    }
}

// A GEMM cuBLASLt has no kernel for (an operand 4 bytes into its storage) runs cuBLAS's fallback. Captured on
// a stream that never ran a GEMM, the fallback must not allocate (cuBLAS's own per-stream pool would, at the
// stream's first GEMM, and break the capture): it runs in the stream's workspace with the stream's handle, so
// the capture holds and each replay is bitwise the eager product.
TEST(CudaGraphs, AMisalignedGemmCapturedOnAFreshStreamRunsTheFallbackInTheStreamsWorkspace) {
    SKIP_WITHOUT_CUDA();
    const int64_t m = 33, n = 17, k = 29;
    Tensor        a_store = to_gpu(random_cpu({m * k + 1}, 1201));
    Tensor        a       = a_store.slice(1, {m, k});
    Tensor        b       = to_gpu(random_cpu({k, n}, 1202));
    Tensor        eager   = Tensor::empty({m, n}, DType::f32, gpu()), c = Tensor::empty({m, n}, DType::f32, gpu());
    gops().gemm(gs(), a, false, b, false, eager, false);
    gs().synchronize();
    std::unique_ptr<Stream> fresh = gpu().stream_create("fresh gemm stream");
    Graph                   graph(gpu(), "cuda test: misaligned gemm");
    fresh->begin_capture(graph);
    gops().gemm(*fresh, a, false, b, false, c, false);
    fresh->end_capture();
    for (int replay = 0; replay < 2; ++replay) {
        gops().fill_zero(*fresh, c);
        graph.replay(*fresh);
        fresh->synchronize();
        expect_bitwise(to_cpu(eager), to_cpu(c), "the captured fallback GEMM, replay " + std::to_string(replay));
    }
}

// A captured op checks its ids on the device at each replay from a clean word (reset in stream order): a
// replay reports the bad id of its own input, and the replay after the input was fixed reports nothing.
TEST(CudaGraphs, EachReplayChecksItsOwnIds) {
    SKIP_WITHOUT_CUDA();
    const int64_t b = 2, seq = 5, vocab = 11, h = 8;
    Tensor        good = random_ids(b, seq, vocab, 1800, 0);
    Tensor        bad  = clone_cpu(good);
    bad.data<int32_t>()[7] = int32_t(vocab);
    Tensor tokens = to_gpu(good), wte = to_gpu(random_cpu({vocab, h}, 1801));
    Tensor out    = Tensor::empty({seq * b, h}, DType::f32, gpu());
    gs().synchronize();
    Graph graph(gpu(), "cuda test: embedding ids");
    gs().begin_capture(graph);
    gops().embedding_forward(gs(), tokens, wte, Tensor(), out);
    gs().end_capture();
    graph.replay(gs());
    EXPECT_NO_THROW(gs().synchronize()) << "good ids";
    gops().copy(gs(), to_gpu(bad), tokens);
    graph.replay(gs());
    const std::string text = error_of([&] { gs().synchronize(); });
    EXPECT_NE(text.find("embedding_forward: token 11 at position 7 is outside [0, 11)"), std::string::npos) << text;
    gops().copy(gs(), to_gpu(good), tokens);
    graph.replay(gs());
    EXPECT_NO_THROW(gs().synchronize()) << "good ids again: the last replay's bad id is not reported twice";
}

TEST(CudaGraphs, AReplayableNodeSplitsTheCaptureAndItsPrepareRunsBetweenTheSegmentsAtEachReplay) {
    SKIP_WITHOUT_CUDA();
    Tensor ones = cpu_tensor({256});
    for (int64_t i = 0; i < 256; ++i) ones.data<float>()[i] = 1.0f;
    Tensor x = to_gpu(ones);
    Tensor p = Tensor::empty({256}, DType::f32, gpu(), {MemoryKind::pinned_host});
    gs().synchronize();
    Graph              graph(gpu(), "cuda test: replayable in the middle");
    int                prepares = 0;
    std::vector<float> seen;   // what the replayable's host work read, on the runtime's callback thread
    gs().begin_capture(graph);
    gops().scale(gs(), x, 2.0f);
    gops().copy(gs(), x, p);
    gs().submit_replayable(
        [&]() -> std::function<void()> {
            ++prepares;
            return [&] { seen.push_back(p.data<float>()[255]); };
        },
        "test");
    gops().scale(gs(), x, 3.0f);
    gops().copy(gs(), x, p);
    gs().end_capture();
    EXPECT_EQ(prepares, 0) << "prepare runs at each replay, not at capture";
    EXPECT_EQ(graph.num_segments(), 2u);
    EXPECT_EQ(graph.num_replayable_nodes("test"), 1u);
    graph.replay(gs());
    graph.replay(gs());
    gs().synchronize();
    EXPECT_EQ(prepares, 2);
    // x: 1 -> 2 (seen) -> 6 -> 12 (seen) -> 36: the host work ran after its replay's first segment and
    // before its second.
    EXPECT_EQ(seen, (std::vector<float>{2.0f, 12.0f}));
    EXPECT_EQ(p.data<float>()[255], 36.0f);
}

TEST(CudaGraphs, AForkAndJoinAcrossTwoStreamsAndAWaitOnAnOutsideEventAreCapturedAndReplayed) {
    SKIP_WITHOUT_CUDA();
    const int64_t n      = int64_t{1} << 20;
    auto          side   = gpu().stream_create("graph-side");
    auto          before = gpu().event_create(), forked = gpu().event_create(), joined = gpu().event_create();
    Tensor        xc = random_cpu({n}, 1201), yc = random_cpu({n}, 1202), zc = random_cpu({n}, 1203);
    Tensor        x = to_gpu(xc), y = to_gpu(yc), z = to_gpu(zc);
    gs().synchronize();
    gops().scale(*side, z, 0.5f);   // eager, before the capture: the graph waits on it at each replay
    side->record(*before);
    Graph graph(gpu(), "cuda test: fork join");
    gs().begin_capture(graph);
    gs().wait(*before);             // recorded outside the capture: an external event wait node
    gops().scale(gs(), x, 2.0f);
    gs().record(*forked);
    side->wait(*forked);            // the fork: side joins the capture
    gops().add_inplace(*side, y, x);
    side->record(*joined);
    gs().wait(*joined);             // the join
    gops().add_inplace(gs(), x, y);
    gops().add_inplace(gs(), x, z);
    gs().end_capture();
    side->synchronize();
    cops().scale(cs(), zc, 0.5f);
    for (int replay = 0; replay < 2; ++replay) {
        graph.replay(gs());
        cops().scale(cs(), xc, 2.0f);
        cops().add_inplace(cs(), yc, xc);
        cops().add_inplace(cs(), xc, yc);
        cops().add_inplace(cs(), xc, zc);
    }
    cs().synchronize();
    expect_bitwise(xc, to_cpu(x), "x after two replays");
    expect_bitwise(yc, to_cpu(y), "y (written by the forked stream) after two replays");
}

TEST(CudaGraphs, TensorsAllocatedDuringCaptureComeFromTheGraphPoolAndLiveAsLongAsTheGraph) {
    SKIP_WITHOUT_CUDA();
    const std::string pool  = "cuda-test-graph-pool";
    Allocator &       alloc = gpu().allocator(MemoryKind::device);
    Tensor            xc    = random_cpu({4096}, 1301);
    Tensor            x = to_gpu(xc), out = Tensor::empty({4096}, DType::f32, gpu());
    gs().synchronize();
    {
        Graph graph(gpu(), "cuda test: graph pool", pool);
        gs().begin_capture(graph);
        {
            Tensor tmp = Tensor::empty({4096}, DType::f32, gpu(), TensorOptions{MemoryKind::device, kActivationsPool});
            gops().copy(gs(), x, tmp);
            gops().scale(gs(), tmp, 3.0f);
            gops().copy(gs(), tmp, out);
            EXPECT_EQ(alloc.pool_stats(pool).active, 1) << "an activations allocation during capture is the graph pool's";
        }   // the host drops tmp: the graph keeps its address
        gs().end_capture();
        graph.replay(gs());
        cops().scale(cs(), xc, 3.0f);
        cs().synchronize();
        expect_bitwise(xc, to_cpu(out), "out after a replay whose temporary the host dropped at capture");
    }
    EXPECT_EQ(alloc.pool_stats(pool).active, 0) << "the graph's blocks go back to its pool when it is destroyed";
    alloc.empty_cache(pool);
}

TEST(CudaGraphs, HostSynchronisationAndAWaitAcrossSegmentsAreRefusedNamingTheGraph) {
    SKIP_WITHOUT_CUDA();
    Tensor x = to_gpu(random_cpu({1024}, 1401));
    auto   e = gpu().event_create();
    gs().synchronize();
    Graph graph(gpu(), "layer 0 fwd, mb 0");
    gs().begin_capture(graph);
    gops().scale(gs(), x, 2.0f);
    std::string sync      = error_of([&] { gs().synchronize(); });
    std::string host_wait = error_of([&] { e->synchronize(); });
    gs().record(*e);
    gs().submit_replayable([] { return std::function<void()>([] {}); });
    std::string across = error_of([&] { gs().wait(*e); });   // e was recorded in the previous segment
    gops().scale(gs(), x, 0.5f);
    gs().end_capture();
    EXPECT_NE(sync.find("synchronize of stream 'compute' while capturing graph 'layer 0 fwd, mb 0'"), std::string::npos) << sync;
    EXPECT_NE(host_wait.find("while capturing graph 'layer 0 fwd, mb 0'"), std::string::npos) << host_wait;
    EXPECT_NE(across.find("capturing graph 'layer 0 fwd, mb 0'"), std::string::npos) << across;
    EXPECT_NE(across.find("inside another CUDA capture"), std::string::npos) << across;
    EXPECT_EQ(graph.num_segments(), 2u);
    graph.replay(gs());   // the refusals left the capture intact
    gs().synchronize();
}

// ---------------------------------------------------------------------------------------------- Allocator

TEST(CudaAllocator, PoolsAndStatisticsAsOnTheCpuForDeviceAndPinnedMemory) {
    SKIP_WITHOUT_CUDA();
    for (MemoryKind kind : {MemoryKind::device, MemoryKind::pinned_host}) {
        Allocator &       alloc = gpu().allocator(kind);
        const std::string pool  = std::string("cuda-test-") + memory_kind_name(kind);
        EXPECT_EQ(alloc.kind(), kind);
        const size_t bytes = 3 * 1000 * 1000 + 17;
        const size_t cap   = Allocator::class_size(bytes);
        {
            Block block = alloc.allocate(bytes, pool);
            ASSERT_NE(block.ptr, nullptr);
            AllocatorStats s = alloc.pool_stats(pool);
            EXPECT_EQ(s.allocated, int64_t(bytes));
            EXPECT_EQ(s.reserved, int64_t(cap));
            EXPECT_EQ(s.active, 1);
            alloc.deallocate(block);
            s = alloc.pool_stats(pool);
            EXPECT_EQ(s.allocated, 0);
            EXPECT_EQ(s.reserved, int64_t(cap)) << "a freed block stays cached in its pool";
            Block again = alloc.allocate(bytes - 5, pool);   // same size class: a cache hit
            EXPECT_EQ(again.ptr, block.ptr);
            EXPECT_EQ(alloc.pool_stats(pool).reserved, int64_t(cap));
            EXPECT_EQ(alloc.pool_stats(pool).num_allocs, 2);
            EXPECT_EQ(alloc.pool_stats(pool).peak_allocated, int64_t(bytes));
            alloc.deallocate(again);
        }
        alloc.empty_cache(pool);
        EXPECT_EQ(alloc.pool_stats(pool).reserved, 0);
        EXPECT_EQ(alloc.pool_stats(pool).num_frees, 2);
    }
}

TEST(CudaAllocator, ATensorDroppedAfterAnOpIsFreedInStreamOrder) {
    SKIP_WITHOUT_CUDA();
    const std::string pool  = "cuda-test-stream-order";
    Allocator &       alloc = gpu().allocator(MemoryKind::device);
    gs().synchronize();
    {
        Tensor big = Tensor::empty({long_work_elements(int64_t{1} << 24)}, DType::f32, gpu(), {MemoryKind::device, pool});
        for (int i = 0; i < 20; ++i) gops().scale(gs(), big, 1.0f);
    }   // the host drops it while the kernels may still run
    EXPECT_EQ(alloc.pool_stats(pool).allocated, 4 * long_work_elements(int64_t{1} << 24))
        << "the stream holds the tensor until its kernels ran";
    gs().synchronize();
    EXPECT_EQ(alloc.pool_stats(pool).allocated, 0) << "synchronize gives it back";
    alloc.empty_cache(pool);
}

// ---------------------------------------------------------------------------------------------- Streams, events

TEST(CudaStreams, EventOrdersWorkAcrossTwoStreams) {
    SKIP_WITHOUT_CUDA();
    const int64_t n = long_work_elements(int64_t{1} << 22);
    auto          a = gpu().stream_create("a");
    auto          b = gpu().stream_create("b");
    auto          e = gpu().event_create();
    EXPECT_TRUE(e->query()) << "an event never recorded counts as complete";
    e->synchronize();
    Tensor ones_host = cpu_tensor({n});
    for (int64_t i = 0; i < n; ++i) ones_host.data<float>()[i] = 1.0f;
    Tensor one = to_gpu(ones_host);   // copied on the compute stream: done before a and b start
    gs().synchronize();
    Tensor x = Tensor::empty({n}, DType::f32, gpu()), y = Tensor::empty({n}, DType::f32, gpu());
    gops().fill_zero(*a, x);
    for (int i = 0; i < 100; ++i) gops().add_inplace(*a, x, one);   // long enough that b would overtake a
    a->record(*e);
    b->wait(*e);
    gops().copy(*b, x, y);
    b->synchronize();
    EXPECT_TRUE(e->query());
    Tensor got = to_cpu(y);
    for (int64_t i = 0; i < n; i += 409) ASSERT_EQ(got.data<float>()[i], 100.0f) << "element " << i;
    EXPECT_TRUE(a->query());
}

TEST(CudaStreams, HostWorkRunsInStreamOrderAndItsErrorsSurfaceAtSynchronize) {
    SKIP_WITHOUT_CUDA();
    auto   s      = gpu().stream_create("host-work");
    Tensor x      = to_gpu(random_cpu({4096}, 950));
    Tensor pinned = Tensor::empty({4096}, DType::f32, gpu(), {MemoryKind::pinned_host});
    gs().synchronize();
    gops().scale(*s, x, 2.0f);
    gops().copy(*s, x, pinned);
    std::atomic<float> seen{0.0f};
    s->submit([&] { seen = pinned.data<float>()[4095]; });   // runs after the copy, on the runtime's thread
    s->synchronize();
    Tensor expect = to_cpu(x);
    EXPECT_EQ(seen.load(), expect.data<float>()[4095]);
    s->submit([] { LOOM_THROW("host work failed on purpose", ""); });
    std::string text = error_of([&] { s->synchronize(); });
    EXPECT_NE(text.find("host work failed on purpose"), std::string::npos) << text;
    s->synchronize();   // the error was reported once
}

}  // namespace
