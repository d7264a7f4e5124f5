#include "backend/cuda/gemm.h"

#include "backend/cuda/cuda_check.h"

#include <memory>
#include <mutex>
#include <vector>

namespace loom::cuda {

namespace {

// One cuBLASLt handle per device, created on first use and kept until exit.
cublasLtHandle_t lt_handle(int device_index) {
    static std::mutex                    mutex;
    static std::vector<cublasLtHandle_t> handles;
    std::lock_guard<std::mutex>          lock(mutex);
    if (static_cast<size_t>(device_index) >= handles.size()) handles.resize(device_index + 1, nullptr);
    if (handles[device_index] == nullptr) LOOM_CUBLAS_CHECK(cublasLtCreate(&handles[device_index]));
    return handles[device_index];
}

// One cuBLAS handle per device, for the shapes cuBLASLt has no kernel for (gemm_lt's fallback).
cublasHandle_t blas_handle(int device_index) {
    static std::mutex                  mutex;
    static std::vector<cublasHandle_t> handles;
    std::lock_guard<std::mutex>        lock(mutex);
    if (static_cast<size_t>(device_index) >= handles.size()) handles.resize(device_index + 1, nullptr);
    if (handles[device_index] == nullptr) {
        LOOM_CUBLAS_CHECK(cublasCreate(&handles[device_index]));
        LOOM_CUBLAS_CHECK(cublasSetMathMode(handles[device_index], CUBLAS_PEDANTIC_MATH));   // no TF32, as cuBLASLt's path
    }
    return handles[device_index];
}

// The largest power of two (up to 256) dividing the address: cuBLASLt assumes 256-byte alignment unless told,
// and views (Tensor::slice) can start anywhere.
uint32_t alignment_of(const void * p) {
    uintptr_t address = reinterpret_cast<uintptr_t>(p);
    uint32_t  align   = 256;
    while (align > 1 && address % align != 0) align /= 2;
    return align;
}

// RAII over the cuBLASLt descriptors of one call.
struct MatmulDesc {
    cublasLtMatmulDesc_t handle = nullptr;
    ~MatmulDesc() { if (handle) cublasLtMatmulDescDestroy(handle); }
};
struct Layout {
    cublasLtMatrixLayout_t handle = nullptr;
    ~Layout() { if (handle) cublasLtMatrixLayoutDestroy(handle); }
};
struct Preference {
    cublasLtMatmulPreference_t handle = nullptr;
    ~Preference() { if (handle) cublasLtMatmulPreferenceDestroy(handle); }
};

}  // namespace

void gemm_handles_create(int device_index) {
    lt_handle(device_index);
    blas_handle(device_index);
}

void gemm_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
             bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, bool bf16, float * c,
             bool accumulate) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
        if (!accumulate) LOOM_CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(m * n) * sizeof(float), stream));
        return;
    }
    const cudaDataType_t ab_type = bf16 ? CUDA_R_16BF : CUDA_R_32F;

    MatmulDesc desc;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F));
    const cublasOperation_t op_a = trans_b ? CUBLAS_OP_T : CUBLAS_OP_N;   // cuBLASLt's A is Loom's b
    const cublasOperation_t op_b = trans_a ? CUBLAS_OP_T : CUBLAS_OP_N;
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));

    const uint64_t a_rows = trans_b ? k : n, a_cols = trans_b ? n : k;
    const uint64_t b_rows = trans_a ? m : k, b_cols = trans_a ? k : m;
    Layout         layout_a, layout_b, layout_c;
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_a.handle, ab_type, a_rows, a_cols, static_cast<int64_t>(a_rows)));
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_b.handle, ab_type, b_rows, b_cols, static_cast<int64_t>(b_rows)));
    LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_c.handle, CUDA_R_32F, n, m, n));

    Preference preference;
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.handle));
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                           &workspace_bytes, sizeof(workspace_bytes)));
    const uint32_t align_a = alignment_of(b), align_b = alignment_of(a), align_c = alignment_of(c);
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                           &align_a, sizeof(align_a)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                           &align_b, sizeof(align_b)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                           &align_c, sizeof(align_c)));
    LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                           &align_c, sizeof(align_c)));

    cublasLtHandle_t                handle = lt_handle(device_index);
    cublasLtMatmulHeuristicResult_t heuristic{};
    int                             found = 0;
    cublasStatus_t                  status = cublasLtMatmulAlgoGetHeuristic(
        handle, desc.handle, layout_a.handle, layout_b.handle, layout_c.handle, layout_c.handle, preference.handle, 1,
        &heuristic, &found);
    if (status == CUBLAS_STATUS_NOT_SUPPORTED || (status == CUBLAS_STATUS_SUCCESS && found == 0)) {
        // No cuBLASLt kernel for these alignments or leading dimensions: cublasGemmEx takes any.
        const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        cublasHandle_t blas = blas_handle(device_index);
        LOOM_CUBLAS_CHECK(cublasSetStream(blas, stream));
        LOOM_CUBLAS_CHECK(cublasGemmEx(blas, op_a, op_b, static_cast<int>(n), static_cast<int>(m), static_cast<int>(k),
                                       &alpha, b, ab_type, static_cast<int>(a_rows), a, ab_type, static_cast<int>(b_rows),
                                       &beta, c, CUDA_R_32F, static_cast<int>(n), CUBLAS_COMPUTE_32F,
                                       CUBLAS_GEMM_DEFAULT));
        return;
    }
    LOOM_CUBLAS_CHECK(status);
    LOOM_CHECK(found > 0,
               "cuBLASLt has no algorithm for a " << (bf16 ? "bfloat16" : "float32") << " GEMM of (" << m << ", " << k
                                                  << ") x (" << k << ", " << n << ")"
                                                  << (trans_a ? ", a transposed" : "") << (trans_b ? ", b transposed" : ""),
               "operand addresses aligned to " << align_b << "/" << align_a << "/" << align_c
                                               << " bytes; 16-byte aligned operands widen the choice");

    const float alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
    LOOM_CUBLAS_CHECK(cublasLtMatmul(handle, desc.handle, &alpha, b, layout_a.handle, a, layout_b.handle, &beta, c,
                                     layout_c.handle, c, layout_c.handle, &heuristic.algo, workspace, workspace_bytes,
                                     stream));
}

}  // namespace loom::cuda
