// The host Adam bodies (see host_adam.h for the update, the dispatch and the numerics rule).
//
// This file is compiled with -march=x86-64 -ffp-contract=off (src/CMakeLists.txt): code outside the
// target-attributed bodies runs on any x86-64, and no multiply-add is fused unless spelled as fma.
#include "core/host_adam.h"

#include "core/cpu_isa.h"

#include "core/error.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <string>

#if defined(__x86_64__) || defined(_M_X64)
#define LOOM_HOST_ADAM_X86 1
// GCC 12 reports the deliberately undefined pass-through operand of _mm512_sqrt_ps, _mm512_srli_epi32 and
// _mm512_cvtepi32_epi16 as "may be used uninitialized" when they are inlined into a function with a
// target attribute (GCC bug 105593, fixed in 13); the warning sits at those header lines.
#if defined(__GNUC__) && !defined(__clang__)
#pragma GCC diagnostic push
#pragma GCC diagnostic ignored "-Wmaybe-uninitialized"
#include <immintrin.h>
#pragma GCC diagnostic pop
#else
#include <immintrin.h>
#endif
#endif

namespace loom {

namespace {

constexpr int64_t kStreamOutputMin = 1 << 19;   // elements: 15 MB or more of traffic per step

// The per-step scalars, computed once exactly as adamw_update computes them.
struct Coeffs {
    float beta1;
    float beta2;
    float one_minus_beta1;   // 1 - b1
    float one_minus_beta2;   // 1 - b2
    float step_size;         // lr / bc1
    float bc2_sqrt;          // sqrt(bc2)
    float eps;
    float decay;             // 1 - lr * wd
    bool  stream_out;        // write the output with non-temporal stores (SIMD bodies)
};

enum class OutKind { none, bf16, f32 };

// One element: the scalar twin of every SIMD body.
inline void adam_element(const Coeffs & c, float * p, const float * g, float * m, float * v, void * out,
                         OutKind kind, int64_t i) {
    float gi = g[i];
    float mi = std::fma(c.beta1, m[i], c.one_minus_beta1 * gi);
    float vi = std::fma(c.beta2, v[i], (c.one_minus_beta2 * gi) * gi);
    float q  = (c.step_size * mi) / (std::sqrt(vi) / c.bc2_sqrt + c.eps);
    float pi = std::fma(p[i], c.decay, -q);
    m[i]     = mi;
    v[i]     = vi;
    p[i]     = pi;
    if (kind == OutKind::bf16) static_cast<uint16_t *>(out)[i] = f32_to_bf16_bits(pi);
    if (kind == OutKind::f32) static_cast<float *>(out)[i] = pi;
}

template <OutKind kKind>
void body_scalar(const Coeffs & c, float * p, const float * g, float * m, float * v, void * out, int64_t begin,
                 int64_t end) {
    for (int64_t i = begin; i < end; ++i) {
        adam_element(c, p, g, m, v, out, kKind, i);
    }
}

#ifdef LOOM_HOST_ADAM_X86

#define LOOM_TARGET_AVX512 __attribute__((target("avx512f,avx512bw,avx512vl,avx2,fma")))
#define LOOM_TARGET_AVX2   __attribute__((target("avx2,fma")))

// f32_to_bf16_bits on 16 lanes, in 32-bit lanes: round to nearest even, NaN quietened.
LOOM_TARGET_AVX512 inline __m512i bf16_bits_avx512(__m512 x) {
    const __m512i u       = _mm512_castps_si512(x);
    const __m512i high    = _mm512_srli_epi32(u, 16);
    const __m512i bias    = _mm512_add_epi32(_mm512_set1_epi32(0x7fff), _mm512_and_si512(high, _mm512_set1_epi32(1)));
    const __m512i rounded = _mm512_srli_epi32(_mm512_add_epi32(u, bias), 16);
    const __m512i quiet   = _mm512_or_si512(high, _mm512_set1_epi32(0x40));
    const __mmask16 nan   = _mm512_cmpgt_epi32_mask(_mm512_and_si512(u, _mm512_set1_epi32(0x7fffffff)),
                                                    _mm512_set1_epi32(0x7f800000));
    return _mm512_mask_blend_epi32(nan, rounded, quiet);
}

// Elements from `begin` until out + i is aligned to `bytes` (elements of `size` bytes; out is size-aligned).
inline int64_t elements_to_alignment(const void * out, int64_t begin, int64_t end, uintptr_t bytes, uintptr_t size) {
    uintptr_t address = reinterpret_cast<uintptr_t>(out) + static_cast<uintptr_t>(begin) * size;
    return std::min<int64_t>(end - begin, static_cast<int64_t>(((bytes - address % bytes) % bytes) / size));
}

// 16 lanes (those of `mask`) starting at element i. kStream: the output goes out with a non-temporal store
// (all 16 lanes, out + i aligned).
template <OutKind kKind, bool kStream>
LOOM_TARGET_AVX512 inline void adam_avx512(const Coeffs & c, float * p, const float * g, float * m, float * v,
                                           void * out, int64_t i, __mmask16 mask) {
    const __m512 gi = _mm512_maskz_loadu_ps(mask, g + i);
    const __m512 mo = _mm512_maskz_loadu_ps(mask, m + i);
    const __m512 vo = _mm512_maskz_loadu_ps(mask, v + i);
    const __m512 po = _mm512_maskz_loadu_ps(mask, p + i);
    const __m512 mi = _mm512_fmadd_ps(_mm512_set1_ps(c.beta1), mo, _mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta1), gi));
    const __m512 vi = _mm512_fmadd_ps(_mm512_set1_ps(c.beta2), vo,
                                      _mm512_mul_ps(_mm512_mul_ps(_mm512_set1_ps(c.one_minus_beta2), gi), gi));
    const __m512 den = _mm512_add_ps(_mm512_div_ps(_mm512_sqrt_ps(vi), _mm512_set1_ps(c.bc2_sqrt)), _mm512_set1_ps(c.eps));
    const __m512 q   = _mm512_div_ps(_mm512_mul_ps(_mm512_set1_ps(c.step_size), mi), den);
    const __m512 pi  = _mm512_fmsub_ps(po, _mm512_set1_ps(c.decay), q);   // p*decay - q, rounded once
    _mm512_mask_storeu_ps(m + i, mask, mi);
    _mm512_mask_storeu_ps(v + i, mask, vi);
    _mm512_mask_storeu_ps(p + i, mask, pi);
    if constexpr (kKind == OutKind::bf16) {
        const __m256i bits = _mm512_cvtepi32_epi16(bf16_bits_avx512(pi));
        auto *        dst  = static_cast<uint16_t *>(out) + i;
        if constexpr (kStream) _mm256_stream_si256(reinterpret_cast<__m256i *>(dst), bits);
        else _mm256_mask_storeu_epi16(dst, mask, bits);
    }
    if constexpr (kKind == OutKind::f32) {
        float * dst = static_cast<float *>(out) + i;
        if constexpr (kStream) _mm512_stream_ps(dst, pi);
        else _mm512_mask_storeu_ps(dst, mask, pi);
    }
}

template <OutKind kKind>
LOOM_TARGET_AVX512 void body_avx512(const Coeffs & c, float * p, const float * g, float * m, float * v, void * out,
                                    int64_t begin, int64_t end) {
    int64_t i = begin;
    if (kKind != OutKind::none && c.stream_out) {
        // Masked head up to a 32-byte (bf16) or 64-byte (f32) aligned output, then streaming stores.
        const uintptr_t size = kKind == OutKind::bf16 ? 2 : 4;
        const int64_t   head = elements_to_alignment(out, begin, end, 16 * size, size);
        if (head > 0) adam_avx512<kKind, false>(c, p, g, m, v, out, i, static_cast<__mmask16>((1u << head) - 1u));
        for (i += head; i + 16 <= end; i += 16) {
            adam_avx512<kKind, true>(c, p, g, m, v, out, i, 0xffff);
        }
        _mm_sfence();   // streaming stores are weakly ordered: visible before the caller signals completion
    } else {
        for (; i + 16 <= end; i += 16) {
            adam_avx512<kKind, false>(c, p, g, m, v, out, i, 0xffff);
        }
    }
    if (i < end) {
        adam_avx512<kKind, false>(c, p, g, m, v, out, i, static_cast<__mmask16>((1u << (end - i)) - 1u));
    }
}

// f32_to_bf16_bits on 8 lanes, packed to 8 x uint16.
LOOM_TARGET_AVX2 inline __m128i bf16_bits_avx2(__m256 x) {
    const __m256i u       = _mm256_castps_si256(x);
    const __m256i high    = _mm256_srli_epi32(u, 16);
    const __m256i bias    = _mm256_add_epi32(_mm256_set1_epi32(0x7fff), _mm256_and_si256(high, _mm256_set1_epi32(1)));
    const __m256i rounded = _mm256_srli_epi32(_mm256_add_epi32(u, bias), 16);
    const __m256i quiet   = _mm256_or_si256(high, _mm256_set1_epi32(0x40));
    const __m256i nan     = _mm256_cmpgt_epi32(_mm256_and_si256(u, _mm256_set1_epi32(0x7fffffff)),
                                               _mm256_set1_epi32(0x7f800000));
    const __m256i bits    = _mm256_blendv_epi8(rounded, quiet, nan);   // every lane <= 0xffff: packus is exact
    return _mm_packus_epi32(_mm256_castsi256_si128(bits), _mm256_extracti128_si256(bits, 1));
}

// 8 lanes starting at element i; kStream as in adam_avx512 (out + i aligned to 16 bytes for bf16, 32 for f32).
template <OutKind kKind, bool kStream>
LOOM_TARGET_AVX2 inline void adam_avx2(const Coeffs & c, float * p, const float * g, float * m, float * v, void * out,
                                       int64_t i) {
    const __m256 gi  = _mm256_loadu_ps(g + i);
    const __m256 mi  = _mm256_fmadd_ps(_mm256_set1_ps(c.beta1), _mm256_loadu_ps(m + i),
                                       _mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta1), gi));
    const __m256 vi  = _mm256_fmadd_ps(_mm256_set1_ps(c.beta2), _mm256_loadu_ps(v + i),
                                       _mm256_mul_ps(_mm256_mul_ps(_mm256_set1_ps(c.one_minus_beta2), gi), gi));
    const __m256 den = _mm256_add_ps(_mm256_div_ps(_mm256_sqrt_ps(vi), _mm256_set1_ps(c.bc2_sqrt)), _mm256_set1_ps(c.eps));
    const __m256 q   = _mm256_div_ps(_mm256_mul_ps(_mm256_set1_ps(c.step_size), mi), den);
    const __m256 pi  = _mm256_fmsub_ps(_mm256_loadu_ps(p + i), _mm256_set1_ps(c.decay), q);
    _mm256_storeu_ps(m + i, mi);
    _mm256_storeu_ps(v + i, vi);
    _mm256_storeu_ps(p + i, pi);
    if constexpr (kKind == OutKind::bf16) {
        auto * dst = reinterpret_cast<__m128i *>(static_cast<uint16_t *>(out) + i);
        if constexpr (kStream) _mm_stream_si128(dst, bf16_bits_avx2(pi));
        else _mm_storeu_si128(dst, bf16_bits_avx2(pi));
    }
    if constexpr (kKind == OutKind::f32) {
        float * dst = static_cast<float *>(out) + i;
        if constexpr (kStream) _mm256_stream_ps(dst, pi);
        else _mm256_storeu_ps(dst, pi);
    }
}

template <OutKind kKind>
LOOM_TARGET_AVX2 void body_avx2(const Coeffs & c, float * p, const float * g, float * m, float * v, void * out,
                                int64_t begin, int64_t end) {
    int64_t i = begin;
    if (kKind != OutKind::none && c.stream_out) {
        // Scalar-twin head up to a 16-byte (bf16) or 32-byte (f32) aligned output, then streaming stores.
        const uintptr_t size = kKind == OutKind::bf16 ? 2 : 4;
        const int64_t   head = elements_to_alignment(out, begin, end, 8 * size, size);
        for (; i < begin + head; ++i) adam_element(c, p, g, m, v, out, kKind, i);
        for (; i + 8 <= end; i += 8) adam_avx2<kKind, true>(c, p, g, m, v, out, i);
        _mm_sfence();
    } else {
        for (; i + 8 <= end; i += 8) adam_avx2<kKind, false>(c, p, g, m, v, out, i);
    }
    for (; i < end; ++i) {
        adam_element(c, p, g, m, v, out, kKind, i);
    }
}

#endif  // LOOM_HOST_ADAM_X86

using Body = void (*)(const Coeffs &, float *, const float *, float *, float *, void *, int64_t, int64_t);

Body body_for(HostAdamIsa isa, OutKind kind) {
    switch (isa) {
#ifdef LOOM_HOST_ADAM_X86
        case HostAdamIsa::avx512:
            return kind == OutKind::none ? body_avx512<OutKind::none>
                 : kind == OutKind::bf16 ? body_avx512<OutKind::bf16>
                                         : body_avx512<OutKind::f32>;
        case HostAdamIsa::avx2:
            return kind == OutKind::none ? body_avx2<OutKind::none>
                 : kind == OutKind::bf16 ? body_avx2<OutKind::bf16>
                                         : body_avx2<OutKind::f32>;
#endif
        default:
            return kind == OutKind::none ? body_scalar<OutKind::none>
                 : kind == OutKind::bf16 ? body_scalar<OutKind::bf16>
                                         : body_scalar<OutKind::f32>;
    }
}

}  // namespace

const char * host_adam_isa_name(HostAdamIsa isa) {
    switch (isa) {
        case HostAdamIsa::automatic: return "automatic";
        case HostAdamIsa::scalar:    return "scalar";
        case HostAdamIsa::avx2:      return "avx2";
        case HostAdamIsa::avx512:    return "avx512";
    }
    return "unknown";
}

HostAdamIsa host_adam_isa_from_name(std::string_view name) {
    for (HostAdamIsa isa : {HostAdamIsa::automatic, HostAdamIsa::scalar, HostAdamIsa::avx2, HostAdamIsa::avx512}) {
        if (name == host_adam_isa_name(isa)) return isa;
    }
    LOOM_THROW("unknown host Adam body '" << name << "'", "use scalar, avx2, avx512 or automatic");
}

bool host_adam_isa_supported(HostAdamIsa isa) {
    switch (isa) {
        case HostAdamIsa::automatic:
        case HostAdamIsa::scalar:
            return true;
#ifdef LOOM_HOST_ADAM_X86
        case HostAdamIsa::avx2:
            return cpu_isa() >= CpuIsa::avx2;
        case HostAdamIsa::avx512:
            return cpu_isa() >= CpuIsa::avx512;
#endif
        default:
            return false;
    }
}

HostAdamIsa host_adam_isa_best() {
    if (host_adam_isa_supported(HostAdamIsa::avx512)) return HostAdamIsa::avx512;
    if (host_adam_isa_supported(HostAdamIsa::avx2)) return HostAdamIsa::avx2;
    return HostAdamIsa::scalar;
}

HostAdamIsa host_adam_isa_resolve(HostAdamIsa isa) {
    if (isa == HostAdamIsa::automatic) {
        const char * forced = std::getenv("LOOM_HOST_ADAM_ISA");
        if (forced == nullptr || *forced == '\0') return host_adam_isa_best();
        isa = host_adam_isa_from_name(forced);
        if (isa == HostAdamIsa::automatic) return host_adam_isa_best();
        LOOM_CHECK(host_adam_isa_supported(isa), "LOOM_HOST_ADAM_ISA=" << forced << " but this CPU cannot run it",
                   "unset LOOM_HOST_ADAM_ISA or set it to " << host_adam_isa_name(host_adam_isa_best())
                                                            << " or below (avx512 > avx2 > scalar)");
        return isa;
    }
    LOOM_CHECK(host_adam_isa_supported(isa), "host Adam body " << host_adam_isa_name(isa) << " is not supported by this CPU",
               "use HostAdamIsa::automatic, or a body up to " << host_adam_isa_name(host_adam_isa_best()));
    return isa;
}

int64_t host_adam_bytes_per_element(const HostAdamOut & out) {
    if (out.data == nullptr) return 28;
    return 28 + static_cast<int64_t>(dtype_size(out.dtype));
}

AdamScalars adam_scalars(float lr, float beta1, float beta2, float weight_decay, int64_t step) {
    AdamScalars s;
    s.one_minus_beta1 = 1.0f - beta1;
    s.one_minus_beta2 = 1.0f - beta2;
    s.step_size       = lr / (1.0f - std::pow(beta1, static_cast<float>(step)));
    s.bc2_sqrt        = std::sqrt(1.0f - std::pow(beta2, static_cast<float>(step)));
    s.decay           = 1.0f - lr * weight_decay;
    return s;
}

void host_adam_step(float * p, const float * g, float * m, float * v, int64_t n, float lr, float beta1,
                    float beta2, float eps, float weight_decay, int64_t step, HostAdamOut out,
                    const HostAdamOptions & options) {
    LOOM_CHECK(step >= 1, "host Adam step " << step, "steps count from 1 (bias correction 1 - beta^step)");
    LOOM_CHECK(n >= 0, "host Adam on " << n << " elements", "");
    OutKind kind = OutKind::none;
    if (out.data != nullptr) {
        LOOM_CHECK(out.dtype == DType::bf16 || out.dtype == DType::f32,
                   "host Adam output in " << dtype_name(out.dtype), "the model copy is bfloat16 or float32");
        kind = out.dtype == DType::bf16 ? OutKind::bf16 : OutKind::f32;
    }
    const Body body = body_for(host_adam_isa_resolve(options.isa), kind);
    if (n == 0) return;

    const AdamScalars s = adam_scalars(lr, beta1, beta2, weight_decay, step);
    Coeffs            c;
    c.beta1           = beta1;
    c.beta2           = beta2;
    c.one_minus_beta1 = s.one_minus_beta1;
    c.one_minus_beta2 = s.one_minus_beta2;
    c.step_size       = s.step_size;
    c.bc2_sqrt        = s.bc2_sqrt;
    c.eps             = eps;
    c.decay           = s.decay;
    // A step this large streams through memory: its output would leave the caches before anyone reads it,
    // so the SIMD bodies write it with non-temporal stores and save the read-for-ownership of its lines
    // (2 or 4 bytes per element, about 7% of a bf16-output step).
    c.stream_out      = n >= kStreamOutputMin;

    // Chunks of whole 64-byte lines (16 floats), at least kMinChunk elements each.
    constexpr int64_t kLine     = 16;
    constexpr int64_t kMinChunk = 1 << 14;
    const int64_t     threads   = options.threads > 0 ? options.threads : num_threads();
    int64_t           chunks    = std::clamp<int64_t>(n / kMinChunk, 1, threads);
    const int64_t     chunk     = ((n + chunks - 1) / chunks + kLine - 1) / kLine * kLine;
    chunks                      = (n + chunk - 1) / chunk;
    if (chunks == 1) {
        body(c, p, g, m, v, out.data, 0, n);
        return;
    }
    parallel_for(chunks, 1, [&](int64_t first, int64_t last) {
        for (int64_t k = first; k < last; ++k) {
            body(c, p, g, m, v, out.data, k * chunk, std::min(n, (k + 1) * chunk));
        }
    });
}

}  // namespace loom
