// core/gemm_f64.h's arithmetic on the CPU (this file is compiled with -ffp-contract=off: no product may be
// fused into its sum, or the CPU's bits would differ from the CUDA kernel's).
#include "backend/cpu/gemm.h"

#include "core/gemm_f64.h"
#include "core/thread_pool.h"

namespace loom::cpu {

void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double * a, const double * b,
              double * c, bool accumulate) {
    parallel_for(m, 1, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            for (int64_t j = 0; j < n; ++j) {
                const double product = gemm_f64_element(a, trans_a, b, trans_b, m, n, k, i, j);
                c[i * n + j]         = accumulate ? gemm_f64_accumulate(c[i * n + j], product) : product;
            }
        }
    });
}

void bias_add_f64(double * y, const double * bias, int64_t n, int64_t h) {
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t c = 0; c < h; ++c) y[r * h + c] = gemm_f64_accumulate(y[r * h + c], bias[c]);
    }
}

void bias_backward_f64(const double * dy, double * dbias, int64_t n, int64_t h) {
    for (int64_t c = 0; c < h; ++c) dbias[c] = column_sum_f64(dy, n, h, c, dbias[c]);
}

}  // namespace loom::cpu
