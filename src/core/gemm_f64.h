// The float64 GEMM's arithmetic (core/ops.h's gemm with float64 operands, for --moe-router-dtype fp64), and
// bias_backward's in float64: one definition for the CPU loop and the CUDA kernel, so every backend gives the
// same bits. Element (i, j) of
// op(A) op(B) is summed over p = 0 .. k-1 in order, each product and each sum rounded on its own (never
// fused into an fma: the CUDA build spells the rounded operations, the host files that include this are
// compiled with -ffp-contract=off), then added to C's value when accumulating.
#pragma once

#include "core/host_device.h"

#include <cstdint>

namespace loom {

LOOM_HOST_DEVICE inline double gemm_f64_element(const double * a, bool trans_a, const double * b, bool trans_b,
                                                int64_t m, int64_t n, int64_t k, int64_t i, int64_t j) {
    double sum = 0.0;
    for (int64_t p = 0; p < k; ++p) {
        const double x = trans_a ? a[p * m + i] : a[i * k + p];
        const double y = trans_b ? b[j * k + p] : b[p * n + j];
#if defined(__CUDA_ARCH__)
        sum = __dadd_rn(sum, __dmul_rn(x, y));
#else
        sum = sum + x * y;
#endif
    }
    return sum;
}

LOOM_HOST_DEVICE inline double gemm_f64_accumulate(double c, double product) {
#if defined(__CUDA_ARCH__)
    return __dadd_rn(c, product);
#else
    return c + product;
#endif
}

// bias_backward's column c of dy (n, h) in float64: the rows summed in order, then added to dbias[c].
LOOM_HOST_DEVICE inline double column_sum_f64(const double * dy, int64_t n, int64_t h, int64_t c, double dbias) {
    double sum = 0.0;
    for (int64_t r = 0; r < n; ++r) sum = gemm_f64_accumulate(sum, dy[r * h + c]);
    return gemm_f64_accumulate(dbias, sum);
}

}  // namespace loom
