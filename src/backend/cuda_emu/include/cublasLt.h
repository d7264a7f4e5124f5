// The emulated device's stand-in for cuBLASLt (cuda-emu): handles, matmul descriptors, matrix layouts,
// preferences, the algorithm heuristic and cublasLtMatmul, computed on the host in a node on the given
// stream (cublas.cpp). Names, signatures and enum values are cuBLASLt 12's; only what gemm.cpp uses has
// behaviour behind it (other attributes are refused with CUBLAS_STATUS_INVALID_VALUE).
#pragma once

#include <cublas_v2.h>

#include <cstddef>
#include <cstdint>

namespace loom_emu {

struct LtContext;
struct LtMatmulDesc;
struct LtMatrixLayout;
struct LtMatmulPreference;

using cublasLtHandle_t           = LtContext *;
using cublasLtMatmulDesc_t       = LtMatmulDesc *;
using cublasLtMatrixLayout_t     = LtMatrixLayout *;
using cublasLtMatmulPreference_t = LtMatmulPreference *;

struct cublasLtMatmulAlgo_t {
    uint64_t data[8];
};

struct cublasLtMatmulHeuristicResult_t {
    cublasLtMatmulAlgo_t algo;
    size_t               workspaceSize;
    cublasStatus_t       state;
    float                wavesCount;
    int                  reserved[4];
};

enum cublasLtMatmulDescAttributes_t : int {
    CUBLASLT_MATMUL_DESC_COMPUTE_TYPE   = 0,
    CUBLASLT_MATMUL_DESC_SCALE_TYPE     = 1,
    CUBLASLT_MATMUL_DESC_POINTER_MODE   = 2,
    CUBLASLT_MATMUL_DESC_TRANSA         = 3,
    CUBLASLT_MATMUL_DESC_TRANSB         = 4,
    CUBLASLT_MATMUL_DESC_TRANSC         = 5,
    CUBLASLT_MATMUL_DESC_FILL_MODE      = 6,
    CUBLASLT_MATMUL_DESC_EPILOGUE       = 7,
    CUBLASLT_MATMUL_DESC_BIAS_POINTER   = 8,
    CUBLASLT_MATMUL_DESC_BIAS_BATCH_STRIDE = 10,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER = 11,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD = 12,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_BATCH_STRIDE = 13,
    CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE = 22,
    CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE = 26,
};

enum cublasLtEpilogue_t : int {
    CUBLASLT_EPILOGUE_DEFAULT   = 1,
    CUBLASLT_EPILOGUE_RELU      = 2,
    CUBLASLT_EPILOGUE_BIAS      = 4,
    CUBLASLT_EPILOGUE_RELU_BIAS = 6,
    CUBLASLT_EPILOGUE_GELU      = 32,
    CUBLASLT_EPILOGUE_GELU_BIAS = 36,
    CUBLASLT_EPILOGUE_GELU_AUX      = 32 | 128,
    CUBLASLT_EPILOGUE_GELU_AUX_BIAS = 32 | 128 | 4,
    CUBLASLT_EPILOGUE_DGELU         = 64 | 128,
    CUBLASLT_EPILOGUE_DGELU_BGRAD   = 64 | 128 | 16,
    CUBLASLT_EPILOGUE_BGRADA        = 256,
    CUBLASLT_EPILOGUE_BGRADB        = 512,
};

enum cublasLtMatrixLayoutAttribute_t : int {
    CUBLASLT_MATRIX_LAYOUT_TYPE                 = 0,
    CUBLASLT_MATRIX_LAYOUT_ORDER                = 1,
    CUBLASLT_MATRIX_LAYOUT_ROWS                 = 2,
    CUBLASLT_MATRIX_LAYOUT_COLS                 = 3,
    CUBLASLT_MATRIX_LAYOUT_LD                   = 4,
    CUBLASLT_MATRIX_LAYOUT_BATCH_COUNT          = 5,
    CUBLASLT_MATRIX_LAYOUT_STRIDED_BATCH_OFFSET = 6,
};

enum cublasLtReductionScheme_t : int {
    CUBLASLT_REDUCTION_SCHEME_NONE         = 0,
    CUBLASLT_REDUCTION_SCHEME_INPLACE      = 1,
    CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE = 2,
    CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE  = 4,
    CUBLASLT_REDUCTION_SCHEME_MASK         = 0x7,
};

enum cublasLtMatmulPreferenceAttributes_t : int {
    CUBLASLT_MATMUL_PREF_SEARCH_MODE           = 0,
    CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES   = 1,
    CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK = 3,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES = 5,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES = 6,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES = 7,
    CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES = 8,
};

size_t cublasLtGetVersion();

cublasStatus_t cublasLtCreate(cublasLtHandle_t * lightHandle);
cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle);

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t * matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType);
cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc);
cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void * buf, size_t sizeInBytes);

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t * matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld);
cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout);

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t * pref);
cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref);
cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void * buf,
                                                    size_t sizeInBytes);

// Returns CUBLAS_STATUS_NOT_SUPPORTED with no result where no kernel fits (as cuBLASLt does): operands whose
// declared alignment is under 16 bytes, leading dimensions that are not a multiple of 16 bytes, types or
// epilogues outside those emulated.
cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int * returnAlgoCount);

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void * alpha,
                              const void * A, cublasLtMatrixLayout_t Adesc, const void * B,
                              cublasLtMatrixLayout_t Bdesc, const void * beta, const void * C,
                              cublasLtMatrixLayout_t Cdesc, void * D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t * algo, void * workspace, size_t workspaceSizeInBytes,
                              cudaStream_t stream);

// Emulator control (not cuBLASLt): the cublasLtMatmulAlgoGetHeuristic calls this process has made, for
// tests that hold a step to no heuristic query once its plans are cached.
long long emu_lt_heuristic_calls();

}  // namespace loom_emu

using namespace loom_emu;
