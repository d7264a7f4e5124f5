// The argument checks every backend's Ops run before enqueueing anything (core/ops.h states the contracts):
// one place, so the CPU backend and the CUDA backend refuse the same calls with the same messages.
#pragma once

#include "core/error.h"
#include "core/tensor.h"

#include <cstdint>
#include <utility>

namespace loom::op_checks {

// t is defined, of `dtype`, and (numel >= 0) has numel elements.
inline void expect(const Tensor & t, DType dtype, int64_t numel, const char * op, const char * what) {
    LOOM_CHECK(t.defined(), op << ": " << what << " is missing", "");
    LOOM_CHECK(t.dtype() == dtype, op << ": " << what << " is " << t.describe() << ", expected " << dtype_name(dtype), "");
    LOOM_CHECK(numel < 0 || t.numel() == numel,
               op << ": " << what << " has " << t.numel() << " elements, expected " << numel, "");
}

// Rows and width of a 2-D (or flattened (n, w)) activation.
inline std::pair<int64_t, int64_t> rows_cols(const Tensor & t, const char * op) {
    LOOM_CHECK(t.dim() == 2, op << ": expected a 2-D (rows, width) tensor, got " << t.describe(), "");
    return {t.size(0), t.size(1)};
}

// c (m, n) f32 = op(a) (m, k) op(b) (k, n), a and b both f32 or both bf16.
struct GemmDims {
    int64_t m, n, k;
};
inline GemmDims gemm(const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c) {
    LOOM_CHECK(a.dim() == 2 && b.dim() == 2, "gemm of " << a.describe() << " and " << b.describe(), "gemm takes 2-D operands");
    LOOM_CHECK(a.dtype() == b.dtype() && (a.dtype() == DType::f32 || a.dtype() == DType::bf16),
               "gemm of " << a.describe() << " and " << b.describe(), "operands are both float32 or both bfloat16");
    const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
    const int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
    LOOM_CHECK(k == kb, "gemm: op(a) is " << m << "x" << k << ", op(b) " << kb << "x" << n, "");
    expect(c, DType::f32, m * n, "gemm", "c");
    return {m, n, k};
}

// A norm's forward operands over n rows of width h (the residual optional).
inline void norm(const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y, const Tensor & rstd,
                 int64_t n, int64_t h, const char * op) {
    expect(x, DType::f32, n * h, op, "x");
    if (residual.defined()) expect(residual, DType::f32, n * h, op, "residual");
    expect(gamma, DType::f32, h, op, "gamma");
    expect(y, DType::f32, n * h, op, "y");
    expect(rstd, DType::f32, n, op, "rstd");
}

}  // namespace loom::op_checks
