// GEMM through cuBLASLt (host code). Loom's matrices are row-major; cuBLASLt's are column-major, so
// c (m, n) = op(a) op(b) is computed as the column-major product c^T (n, m) = op(b)^T op(a)^T:
//
//   cuBLASLt A = b   rows x cols = trans_b ? (k, n) : (n, k), ld = rows, op = trans_b ? T : N
//   cuBLASLt B = a   rows x cols = trans_a ? (m, k) : (k, m), ld = rows, op = trans_a ? T : N
//   cuBLASLt C = D = c   (n, m), ld = n, f32
//
// a and b are both f32, both bf16 or both f16 (GemmOperands); the compute type is CUBLAS_COMPUTE_32F (f32 accumulation, no TF32),
// alpha = 1, beta = accumulate ? 1 : 0. k = 0 gives c = 0 (or leaves it, accumulating). Operands are
// often views into flat buffers, so their addresses are passed to cuBLASLt's heuristic as the alignment
// it may assume; where it has no kernel (cuBLASLt wants 16-byte alignment for most), cublasGemmEx with the
// same types and compute type runs the product instead. m, n, k must fit in int for that fallback. The plans
// are cached (gemm_plan_stats): a shape seen before makes no heuristic query.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "backend/cuda/gemm_plans.h"

#include <cuda_runtime.h>

#include <cstddef>
#include <cstdint>

namespace loom::LOOM_CUDA_NS {

// Creates the device's cuBLASLt handle and `stream`'s cuBLAS handle if they do not exist yet (a capture
// begins with it: creating a handle allocates, which a CUDA graph capture must not see). GEMMs run in the
// stream's own workspace (CudaStream::gemm_workspace), cuBLASLt's and cuBLAS's fallback alike.
void gemm_handles_create(int device_index, cudaStream_t stream);

// The element type of both operands.
enum class GemmOperands { f32, bf16, f16 };

void gemm_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
             bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab, void * c,
             bool c_bf16, bool accumulate);

// c (m, n) = op(a) op(b) + bias (n, f32, one value per column of c) through cuBLASLt's bias epilogue
// (CUBLASLT_EPILOGUE_BIAS: the bias is added to the f32 result before the store, bias of D's type, f32).
// Returns false where the epilogue did not run (k = 0, or no cuBLASLt kernel with the epilogue for these
// alignments): then c holds the plain product (gemm_lt, with its cublasGemmEx fallback) and the caller
// adds the bias.
bool gemm_bias_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                  bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                  const float * bias, void * c, bool c_bf16);

// c (m, n) = gelu(op(a) op(b) + bias) with the sum before GELU stored to `pre` (m, n, c's type, the epilogue's
// auxiliary output): CUBLASLT_EPILOGUE_GELU_AUX_BIAS, or GELU_AUX without a bias (bias null). GELU is
// cuBLASLt's tanh approximation of the f32 sum. Returns false, having run nothing, where cuBLASLt has no
// kernel with the epilogue (k = 0, alignments, or pre's leading dimension n not a multiple of 8): the caller
// runs the product and the activation's kernel.
bool gemm_gelu_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                  bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                  const float * bias, void * pre, void * c, bool c_bf16);

// c (m, n) = op(a) op(b) (+= with accumulate; c f32) and bias_grad (m, f32) = the sums over k of op(a)'s rows,
// written, in cuBLASLt's order (CUBLASLT_EPILOGUE_BGRADB: cuBLASLt's B is Loom's a). Returns false, having run
// nothing, where cuBLASLt has no kernel for it (k = 0, alignments).
bool gemm_bgradb_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                    bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                    float * c, bool accumulate, float * bias_grad);

// c (m, n) = (op(a) op(b)) * gelu'(pre), pre (m, n) of c's type read by the epilogue (CUBLASLT_EPILOGUE_DGELU).
// Returns false, having run nothing, where cuBLASLt has no kernel for it (as gemm_gelu_lt).
bool gemm_dgelu_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                   bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                   const void * pre, void * c, bool c_bf16);

}  // namespace loom::LOOM_CUDA_NS
