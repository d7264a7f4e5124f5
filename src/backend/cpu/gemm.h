// Row-major GEMM on the CPU through oneDNN, with primitives cached per shape.
//
//   C[M, N]  = op(A)[M, K] * op(B)[K, N]          (accumulate = false)
//   C[M, N] += op(A)[M, K] * op(B)[K, N]          (accumulate = true: weight gradients into main_grad)
//
//   op(A) = A    with A stored (M, K) row-major      op(A) = A^T  with A stored (K, M)  (trans_a)
//   op(B) = B    with B stored (K, N) row-major      op(B) = B^T  with B stored (N, K)  (trans_b)
//
// A and B are f32 or bf16 (both the same); C is f32 (or bf16, rounded once) and the products accumulate in f32 (AMX or
// AVX-512 bf16 dot products where the CPU has them). Where oneDNN has no bf16 matmul (a CPU without
// AVX-512, or LOOM_MAX_CPU_ISA below avx512), bf16 operands are widened to f32 in per-thread scratch and
// the f32 GEMM runs: their values are bf16-exact, so the products and the f32 accumulation are the same
// contract, at the cost of the widening pass. The three uses in a linear layer y = x W^T:
//   forward     y  (s*b, o)  = x (s*b, i) . W^T           gemm(false, true,  sb, o, i, x, W, y)
//   input grad  dx (s*b, i)  = dy (s*b, o) . W             gemm(false, false, sb, i, o, dy, W, dx)
//   weight grad dW (o, i)   += dy^T (o, s*b) . x           gemm(true,  false, o, i, sb, dy, x, dW, true)
//
// oneDNN runs on its OpenMP threads; init_compute_threads() gives them the process's thread budget
// (LOOM_NUM_THREADS) and flushes denormals on them and on Loom's own compute threads.
#pragma once

#include "core/dtype.h"

#include <cstdint>

namespace loom::cpu {

// Whether bf16 GEMMs run oneDNN's bf16 matmul (true) or widen to f32 (false) on this CPU and ISA cap.
bool gemm_bf16_native();

void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
          DType ab_dtype, float * c, bool accumulate = false);
// The same into C of c_dtype: f32, or bf16 (no accumulate), whose elements are the f32 accumulators rounded
// once to nearest even (blocks of rows go through a bounded f32 scratch).
void gemm(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
          DType ab_dtype, void * c, DType c_dtype, bool accumulate);
// C (m, n) bf16 = op(A) op(B) + bias (n) f32, the bias added to the f32 accumulator before the one rounding.
void gemm_bias_bf16(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b,
                    DType ab_dtype, void * c, const float * bias);

// The float64 GEMM (core/gemm_f64.h): C (m, n) = op(A) op(B), or += with accumulate.
void gemm_f64(bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double * a, const double * b,
              double * c, bool accumulate);
// The fp64 router's bias: y (n, h) += bias; dbias += the column sums of dy (core/gemm_f64.h's order).
void bias_add_f64(double * y, const double * bias, int64_t n, int64_t h);
void bias_backward_f64(const double * dy, double * dbias, int64_t n, int64_t h);

// Sets the OpenMP thread count to the budget and turns on FTZ/DAZ on every compute thread; idempotent.
void init_compute_threads();

// Turns on flush-to-zero and denormals-are-zero on the calling thread.
void flush_denormals_on_this_thread();

}  // namespace loom::cpu
