#include "backend/cpu/gemm.h"

#include "backend/cpu/dnnl_check.h"
#include "backend/cpu/ops.h"
#include "core/cpu_isa.h"
#include "core/float_bits.h"
#include "core/thread_pool.h"

#include <oneapi/dnnl/dnnl.hpp>
#include <omp.h>
#include <xmmintrin.h>

#include <algorithm>
#include <map>
#include <mutex>
#include <tuple>
#include <vector>

namespace loom::cpu {

void flush_denormals_on_this_thread() {
    _mm_setcsr(_mm_getcsr() | 0x8040u);   // FTZ (bit 15) | DAZ (bit 6)
}

void init_compute_threads() {
    static std::once_flag once;
    std::call_once(once, [] {
        // Loom's own pool threads: one chunk per thread, each sets its MXCSR.
        parallel_for(num_threads(), 1, [](int64_t, int64_t) { flush_denormals_on_this_thread(); });
    });
    // OpenMP's thread count is per calling thread, and each thread that opens parallel regions (the host,
    // a stream's worker) has its own team: set both up once on every thread that runs a GEMM.
    thread_local bool team_ready = false;
    if (!team_ready) {
        int threads = num_threads();
        omp_set_num_threads(threads);
#pragma omp parallel num_threads(threads)
        flush_denormals_on_this_thread();
        flush_denormals_on_this_thread();
        team_ready = true;
    }
}

namespace {

// (trans_a, trans_b, m, n, k, dtype, accumulate, a_ld): a_ld is the stride between stored rows of A.
using Key = std::tuple<bool, bool, int64_t, int64_t, int64_t, int, bool, int64_t>;

struct Cached {
    dnnl::matmul             primitive;
    dnnl::memory::desc       a, b, c;
    bool                     widen = false;   // bf16 operands widened to f32 (no native bf16 matmul)
};

struct GemmCache {
    dnnl::engine                    engine{dnnl::engine::kind::cpu, 0};
    dnnl::stream                    stream{engine};
    std::mutex                      mutex;
    std::map<Key, Cached>           primitives;
};

GemmCache & cache() {
    static GemmCache instance;
    return instance;
}

dnnl::memory::data_type dnnl_type(DType d) {
    return d == DType::bf16 ? dnnl::memory::data_type::bf16 : dnnl::memory::data_type::f32;
}

Cached make_primitive(const Key & key, dnnl::engine & engine) {
    auto [trans_a, trans_b, m, n, k, dtype, accumulate, a_ld] = key;
    using dims = dnnl::memory::dims;
    auto dt    = dnnl_type(static_cast<DType>(dtype));
    // A logical (M, K): row-major strides (a_ld, 1), or (1, a_ld) when stored transposed as (K, M).
    dnnl::memory::desc a_md(dims{m, k}, dt, trans_a ? dims{1, a_ld} : dims{a_ld, 1});
    dnnl::memory::desc b_md(dims{k, n}, dt, trans_b ? dims{1, k} : dims{n, 1});
    dnnl::memory::desc c_md(dims{m, n}, dnnl::memory::data_type::f32, dims{n, 1});
    dnnl::primitive_attr attr;
    if (accumulate) {
        dnnl::post_ops ops;
        ops.append_sum(1.0f);
        attr.set_post_ops(ops);
    }
    dnnl::matmul::desc           desc(a_md, b_md, c_md);
    dnnl::matmul::primitive_desc pd(desc, attr, engine);
    return Cached{dnnl::matmul(pd), a_md, b_md, c_md};
}

}  // namespace

bool gemm_bf16_native() {
    // oneDNN's bf16 matmul needs AVX-512 (native dot products with AVX512-BF16 or AMX, emulated on
    // AVX512_CORE); below that, or under LOOM_MAX_CPU_ISA=avx2, Loom widens the operands itself.
    return cpu_isa() >= CpuIsa::avx512;
}

namespace {

// gemm with the stored rows of A a_ld elements apart (k, or m with trans_a, for a whole matrix).
void gemm_strided(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, int64_t a_ld,
                  const void * b, DType ab_dtype, float * c, bool accumulate) {
    LOOM_CHECK(ab_dtype == DType::f32 || dtype_is_half(ab_dtype),
               "gemm of " << dtype_name(ab_dtype) << " inputs", "gemm takes float32, bfloat16 or float16 inputs");
    if (m == 0 || n == 0) {
        return;
    }
    if (k == 0) {
        if (!accumulate) {
            std::fill(c, c + m * n, 0.0f);
        }
        return;
    }
    init_compute_threads();
    GemmCache & g = cache();
    Key         key{trans_a, trans_b, m, n, k, static_cast<int>(ab_dtype), accumulate, a_ld};
    Cached      p;
    {
        std::lock_guard<std::mutex> lock(g.mutex);
        auto it = g.primitives.find(key);
        if (it == g.primitives.end()) {
            if (ab_dtype == DType::f16 || (ab_dtype == DType::bf16 && !gemm_bf16_native())) {   // f16: always widened
                it = g.primitives.emplace(key, Cached{{}, {}, {}, {}, true}).first;
            } else {
                try {
                    it = g.primitives.emplace(key, make_primitive(key, g.engine)).first;
                } catch (const dnnl::error & e) {
                    // This oneDNN has no bf16 matmul for the shape on this CPU: widen instead.
                    LOOM_CHECK(ab_dtype == DType::bf16, "oneDNN has no matmul for " << m << "x" << n << "x" << k << " "
                                                                                    << dtype_name(ab_dtype) << ": " << e.what(),
                               "set ONEDNN_VERBOSE=1 to see why");
                    it = g.primitives.emplace(key, Cached{{}, {}, {}, {}, true}).first;
                }
            }
        }
        p = it->second;
    }
    if (p.widen) {
        // The operands' values are bf16- or f16-exact, so the f32 GEMM of their widened copies computes the
        // same products (exact in f32) with the same f32 accumulation: the contract of the 16-bit GEMM.
        thread_local std::vector<float> wide_a, wide_b;
        wide_a.resize(static_cast<size_t>(m * k));
        wide_b.resize(static_cast<size_t>(k * n));
        const int64_t rows = trans_a ? k : m, cols = trans_a ? m : k;   // A as stored
        if (a_ld == cols) {
            convert_parallel(a, ab_dtype, wide_a.data(), DType::f32, m * k);
        } else {
            for (int64_t r = 0; r < rows; ++r) {
                convert(static_cast<const char *>(a) + r * a_ld * dtype_size(ab_dtype), ab_dtype, wide_a.data() + r * cols,
                        DType::f32, static_cast<size_t>(cols));
            }
        }
        convert_parallel(b, ab_dtype, wide_b.data(), DType::f32, k * n);
        gemm_strided(trans_a, trans_b, m, n, k, wide_a.data(), cols, wide_b.data(), DType::f32, c, accumulate);
        return;
    }
    dnnl::memory a_mem(p.a, g.engine, const_cast<void *>(a));
    dnnl::memory b_mem(p.b, g.engine, const_cast<void *>(b));
    dnnl::memory c_mem(p.c, g.engine, c);
    // oneDNN streams on the CPU execute in the calling thread; a local stream keeps concurrent callers
    // (two Loom streams) independent.
    dnnl::stream stream(g.engine);
    p.primitive.execute(stream, {{DNNL_ARG_SRC, a_mem}, {DNNL_ARG_WEIGHTS, b_mem}, {DNNL_ARG_DST, c_mem}});
    stream.wait();
}

// C (m, n) bf16 = op(A) op(B) (+ bias), each element's f32 accumulator (plus its bias) rounded once. Blocks of
// rows go through an f32 scratch of at most kScratchBytes.
void gemm_into_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
                    DType ab_dtype, void * c, const float * bias) {
    constexpr int64_t kScratchBytes = 16 << 20;
    if (m == 0 || n == 0) return;
    const int64_t             block = std::clamp<int64_t>(kScratchBytes / (n * 4), 1, m);
    thread_local std::vector<float> part;
    part.resize(static_cast<size_t>(block * n));
    // 16-bit operands this CPU multiplies as f32 are widened once here, not once per block of rows (B whole
    // each time: for a vocabulary's logits, a dozen times over).
    if (ab_dtype == DType::f16 || (ab_dtype == DType::bf16 && !gemm_bf16_native())) {
        thread_local std::vector<float> wide_a, wide_b;
        wide_a.resize(static_cast<size_t>(m * k));
        wide_b.resize(static_cast<size_t>(k * n));
        convert_parallel(a, ab_dtype, wide_a.data(), DType::f32, m * k);
        convert_parallel(b, ab_dtype, wide_b.data(), DType::f32, k * n);
        a        = wide_a.data();
        b        = wide_b.data();
        ab_dtype = DType::f32;
    }
    const size_t   elem  = dtype_size(ab_dtype);
    const int64_t  a_ld  = trans_a ? m : k;
    uint16_t *     out   = static_cast<uint16_t *>(c);
    for (int64_t r0 = 0; r0 < m; r0 += block) {
        const int64_t rows = std::min(block, m - r0);
        // Rows r0.. of op(A): stored rows r0.. of A, or its columns r0.. when transposed.
        const void * a_rows = static_cast<const char *>(a) + (trans_a ? r0 : r0 * k) * elem;
        float * const scratch = part.data();   // a pointer: the pool's threads have thread_locals of their own
        gemm_strided(trans_a, trans_b, rows, n, k, a_rows, a_ld, b, ab_dtype, scratch, false);
        parallel_for(rows, 16, [&](int64_t begin, int64_t end) {
            for (int64_t r = begin; r < end; ++r) {
                const float * pr = scratch + r * n;
                uint16_t *    cr = out + (r0 + r) * n;
                for (int64_t j = 0; j < n; ++j) cr[j] = f32_to_bf16_bits(bias ? pr[j] + bias[j] : pr[j]);
            }
        });
    }
}

}  // namespace

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
          DType ab_dtype, float * c, bool accumulate) {
    gemm_strided(trans_a, trans_b, m, n, k, a, trans_a ? m : k, b, ab_dtype, c, accumulate);
}

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
          DType ab_dtype, void * c, DType c_dtype, bool accumulate) {
    if (c_dtype == DType::f32) return gemm(trans_a, trans_b, m, n, k, a, b, ab_dtype, static_cast<float *>(c), accumulate);
    LOOM_CHECK(c_dtype == DType::bf16 && !accumulate, "a gemm into " << dtype_name(c_dtype) << (accumulate ? " with accumulate" : ""),
               "gemm writes f32, or bf16 without accumulate");
    gemm_into_bf16(trans_a, trans_b, m, n, k, a, b, ab_dtype, c, nullptr);
}

void gemm_bias_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
                    DType ab_dtype, void * c, const float * bias) {
    gemm_into_bf16(trans_a, trans_b, m, n, k, a, b, ab_dtype, c, bias);
}

}  // namespace loom::cpu
