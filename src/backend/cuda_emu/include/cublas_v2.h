// The emulated device's stand-in for cuBLAS (cuda-emu): the handle, status, operation and compute-type
// vocabulary (shared with cublasLt.h, as cublas_api.h is in CUDA) and cublasGemmEx, computed on the host in a
// node on the handle's stream (cublas.cpp). Names, signatures and values are cuBLAS 12's.
#pragma once

#include <cuda_runtime.h>
#include <library_types.h>

#include <cstddef>

namespace loom_emu {

enum cublasStatus_t : int {
    CUBLAS_STATUS_SUCCESS          = 0,
    CUBLAS_STATUS_NOT_INITIALIZED  = 1,
    CUBLAS_STATUS_ALLOC_FAILED     = 3,
    CUBLAS_STATUS_INVALID_VALUE    = 7,
    CUBLAS_STATUS_ARCH_MISMATCH    = 8,
    CUBLAS_STATUS_MAPPING_ERROR    = 11,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_INTERNAL_ERROR   = 14,
    CUBLAS_STATUS_NOT_SUPPORTED    = 15,
    CUBLAS_STATUS_LICENSE_ERROR    = 16,
};

enum cublasOperation_t : int {
    CUBLAS_OP_N = 0,
    CUBLAS_OP_T = 1,
    CUBLAS_OP_C = 2,
};

enum cublasMath_t : int {
    CUBLAS_DEFAULT_MATH                            = 0,
    CUBLAS_TENSOR_OP_MATH                          = 1,
    CUBLAS_PEDANTIC_MATH                           = 2,
    CUBLAS_TF32_TENSOR_OP_MATH                     = 3,
    CUBLAS_MATH_DISALLOW_REDUCED_PRECISION_REDUCTION = 16,
};

enum cublasComputeType_t : int {
    CUBLAS_COMPUTE_16F           = 64,
    CUBLAS_COMPUTE_16F_PEDANTIC  = 65,
    CUBLAS_COMPUTE_32F           = 68,
    CUBLAS_COMPUTE_32F_PEDANTIC  = 69,
    CUBLAS_COMPUTE_32F_FAST_16F  = 74,
    CUBLAS_COMPUTE_32F_FAST_16BF = 75,
    CUBLAS_COMPUTE_32F_FAST_TF32 = 77,
    CUBLAS_COMPUTE_64F           = 70,
    CUBLAS_COMPUTE_64F_PEDANTIC  = 71,
    CUBLAS_COMPUTE_32I           = 72,
    CUBLAS_COMPUTE_32I_PEDANTIC  = 73,
};

enum cublasGemmAlgo_t : int {
    CUBLAS_GEMM_DEFAULT           = -1,
    CUBLAS_GEMM_DEFAULT_TENSOR_OP = 99,
};

struct CublasContext;
using cublasHandle_t = CublasContext *;

const char * cublasGetStatusName(cublasStatus_t status);
const char * cublasGetStatusString(cublasStatus_t status);

cublasStatus_t cublasCreate(cublasHandle_t * handle);
cublasStatus_t cublasDestroy(cublasHandle_t handle);
// As cuBLAS: binding a stream also resets the handle's workspace to cuBLAS's own pool, whose buffer for a
// stream is allocated (cudaMalloc) by the first GEMM on it, unless cublasSetWorkspace gives one first.
cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId);
cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void * workspace, size_t workspaceSizeInBytes);
cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t * streamId);
cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode);
cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t * mode);

// C (m, n) = alpha op(A) op(B) + beta C, column-major, scalars read from host memory at the call.
cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void * alpha, const void * A, cudaDataType Atype, int lda, const void * B,
                            cudaDataType Btype, int ldb, const void * beta, void * C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo);

}  // namespace loom_emu

using namespace loom_emu;
