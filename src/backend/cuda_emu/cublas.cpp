// The emulated device's cuBLAS and cuBLASLt (cuda-emu): handles, descriptors, the algorithm heuristic and the
// products, computed on the host inside a node enqueued on the call's stream (so they are ordered, captured
// and replayed like any kernel). What a GPU library would refuse is refused here:
//   - cublasLtMatmulAlgoGetHeuristic finds no algorithm (CUBLAS_STATUS_NOT_SUPPORTED, count 0) where an
//     operand's declared alignment is under 16 bytes or a leading dimension is not a multiple of 16 bytes,
//     as cuBLASLt's kernels need; gemm.cpp then falls back to cublasGemmEx, which takes any layout;
//   - cublasLtMatmul given pointers less aligned than the algorithm was chosen for returns
//     CUBLAS_STATUS_INVALID_VALUE (on a GPU such a kernel faults on a misaligned vector load);
//   - an operand outside device-addressable memory faults in the node: a sticky launch failure, as a kernel's
//     illegal address would be.
// Arithmetic: op(A) op(B) accumulated in f32 in k order (one multiply and one add per step, never fused),
// bf16 inputs widened exactly; then D = alpha * acc + beta * C (C not read when beta is 0) + bias.
// The GELU epilogues: GELU_AUX(_BIAS) stores that sum to the auxiliary matrix (rounded to its type) and D =
// gelu(sum) of the f32 sum; DGELU gives D = sum * gelu'(aux). GELU is the tanh approximation,
// 0.5 v (1 + tanh(sqrt(2/pi) (v + 0.044715 v^3))), in f32 with std::tanh. As cuBLASLt, the auxiliary matrix
// takes D's type and layout with its own leading dimension, a multiple of 8 elements no less than D's rows,
// and a 16-byte aligned pointer. BGRADB writes the bias gradient, op(B)'s sums over k (one per column of D,
// in k order in f32), to the bias pointer (f32 or D's type). Other epilogues are not emulated (no algorithm).
#include <cublasLt.h>
#include <cublas_v2.h>

#include "half_bits.h"
#include "runtime_internal.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <map>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom_emu {

struct CublasContext {
    cudaStream_t stream    = nullptr;
    cublasMath_t math      = CUBLAS_DEFAULT_MATH;
    void *       workspace = nullptr;   // device memory, as cuBLAS allocates at creation
    void *       user_workspace = nullptr;   // cublasSetWorkspace's, until the next cublasSetStream
    // cuBLAS's own pool: a buffer per stream, allocated by the first GEMM on the stream without a user
    // workspace (the allocation a graph capture must not see).
    std::map<cudaStream_t, void *> pool;
};

struct LtContext {
    int device = 0;
};

struct LtMatmulDesc {
    cublasComputeType_t compute;
    cudaDataType_t      scale;
    cublasOperation_t   transa   = CUBLAS_OP_N;
    cublasOperation_t   transb   = CUBLAS_OP_N;
    cublasLtEpilogue_t  epilogue = CUBLASLT_EPILOGUE_DEFAULT;
    const void *        bias     = nullptr;
    int32_t             bias_type = -1;   // -1: D's type (cuBLASLt's default)
    const void *        aux      = nullptr;   // the GELU epilogues' auxiliary matrix
    int64_t             aux_ld   = 0;
    int32_t             aux_type = -1;        // -1: D's type
};

struct LtMatrixLayout {
    cudaDataType_t type;
    uint64_t       rows;
    uint64_t       cols;
    int64_t        ld;
};

struct LtMatmulPreference {
    size_t   max_workspace = 0;
    uint32_t align[4]      = {256, 256, 256, 256};   // A, B, C, D: cuBLASLt assumes 256 unless told
    uint32_t reduction_mask = CUBLASLT_REDUCTION_SCHEME_MASK;   // every scheme unless told
};

namespace {

constexpr uint64_t kAlgoMagic       = 0x4c6f6f6d456d7531ull;   // marks an algorithm this heuristic returned
constexpr uint32_t kKernelAlignment = 16;                      // what cuBLASLt's kernels need (bytes)

size_t element_size(cudaDataType_t type) {
    switch (type) {
        case CUDA_R_32F: return 4;
        case CUDA_R_16BF: return 2;
        case CUDA_R_16F: return 2;
        default: return 0;
    }
}

float load(const void * base, cudaDataType_t type, size_t index) {
    if (type == CUDA_R_32F) return static_cast<const float *>(base)[index];
    if (type == CUDA_R_16F) return half_bits::f16_to_float(static_cast<const uint16_t *>(base)[index]);
    return half_bits::bf16_to_float(static_cast<const uint16_t *>(base)[index]);
}

void store(void * base, cudaDataType_t type, size_t index, float value) {
    if (type == CUDA_R_32F) {
        static_cast<float *>(base)[index] = value;
    } else {
        static_cast<uint16_t *>(base)[index] = half_bits::float_to_bf16(value);
    }
}

// One matrix operand as a product reads it: column-major, `rows` x `cols` stored (before op), leading
// dimension `ld` in elements.
struct Operand {
    const void *   data;
    cudaDataType_t type;
    size_t         rows, cols, ld;

    size_t extent_bytes() const { return rows == 0 || cols == 0 ? 0 : ((cols - 1) * ld + rows) * element_size(type); }
};

// Everything a product node needs, captured by value at the call (descriptors may be destroyed right
// after it, and a captured node replays with these values).
struct Product {
    bool           trans_a, trans_b;
    size_t         m, n, k;
    float          alpha, beta;
    Operand        a, b;
    const void *   c;
    cudaDataType_t c_type;
    size_t         ldc;
    void *         d;
    cudaDataType_t d_type;
    size_t         ldd;
    const void *   bias;   // m values (one per row of D) or null
    cudaDataType_t bias_type;
    void *         bias_grad;   // BGRADB's output: n values (one per column of D), of bias_type
    enum class Gelu { none, forward, backward } gelu = Gelu::none;   // GELU_AUX(_BIAS), DGELU
    const void *   aux;    // written by forward (through a const_cast: the descriptor holds one pointer type)
    cudaDataType_t aux_type;
    size_t         aux_ld;
    const char *   name;
};

float gelu(float v) { return 0.5f * v * (1.0f + std::tanh(0.7978845608f * (v + 0.044715f * v * v * v))); }
float gelu_grad(float v) {
    const float t = std::tanh(0.7978845608f * (v + 0.044715f * v * v * v));
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * 0.7978845608f * (1.0f + 3.0f * 0.044715f * v * v);
}

void check_accessible(const Product & p, const void * ptr, size_t bytes, const char * what) {
    if (!device_accessible(ptr, bytes)) {
        throw std::runtime_error(std::string(p.name) + ": " + what + " (" + std::to_string(bytes) +
                                 " bytes) is not in device-addressable memory: an illegal address on a GPU");
    }
}

// D = alpha op(A) op(B) + beta C + bias, blocked over rows of D and groups of its columns so that a slice of
// op(A) is reused from cache; each element's sum still runs over k in order.
void run_product(const Product & p) {
    const size_t m = p.m, n = p.n, k = p.k;
    check_accessible(p, p.a.data, p.a.extent_bytes(), "operand A");
    check_accessible(p, p.b.data, p.b.extent_bytes(), "operand B");
    const size_t d_extent = n == 0 ? 0 : ((n - 1) * p.ldd + m) * element_size(p.d_type);
    check_accessible(p, p.d, d_extent, "output D");
    if (p.beta != 0.0f) {
        check_accessible(p, p.c, n == 0 ? 0 : ((n - 1) * p.ldc + m) * element_size(p.c_type), "input C");
    }
    if (p.bias != nullptr) check_accessible(p, p.bias, m * element_size(p.bias_type), "the bias");
    if (p.bias_grad != nullptr) check_accessible(p, p.bias_grad, n * element_size(p.bias_type), "the bias gradient");
    if (p.gelu != Product::Gelu::none) {
        check_accessible(p, p.aux, n == 0 ? 0 : ((n - 1) * p.aux_ld + m) * element_size(p.aux_type),
                         "the epilogue's auxiliary matrix");
    }

    // op(A) as a contiguous column-major (m, k) f32 matrix, op(B) as n contiguous columns of k.
    std::vector<float> a(m * k), b(n * k);
    for (size_t col = 0; col < p.a.cols; ++col) {
        for (size_t row = 0; row < p.a.rows; ++row) {
            const float v = load(p.a.data, p.a.type, col * p.a.ld + row);
            if (p.trans_a) {
                a[row * m + col] = v;   // op(A)[col, row]
            } else {
                a[col * m + row] = v;
            }
        }
    }
    for (size_t col = 0; col < p.b.cols; ++col) {
        for (size_t row = 0; row < p.b.rows; ++row) {
            const float v = load(p.b.data, p.b.type, col * p.b.ld + row);
            if (p.trans_b) {
                b[row * k + col] = v;   // op(B)[col, row]: column `row` of op(B)
            } else {
                b[col * k + row] = v;
            }
        }
    }

    if (p.bias_grad != nullptr) {
        for (size_t j = 0; j < n; ++j) {
            float sum = 0.0f;
            for (size_t q = 0; q < k; ++q) sum = sum + b[j * k + q];
            store(p.bias_grad, p.bias_type, j, sum);
        }
    }

    constexpr size_t   kRowBlock = 256, kCols = 4;
    std::vector<float> acc(kRowBlock * kCols);
    for (size_t i0 = 0; i0 < m; i0 += kRowBlock) {
        const size_t rows = std::min(kRowBlock, m - i0);
        for (size_t j0 = 0; j0 < n; j0 += kCols) {
            const size_t cols = std::min(kCols, n - j0);
            std::fill(acc.begin(), acc.end(), 0.0f);
            for (size_t q = 0; q < k; ++q) {
                const float * ap = &a[q * m + i0];
                for (size_t jj = 0; jj < cols; ++jj) {
                    const float bq  = b[(j0 + jj) * k + q];
                    float *     out = &acc[jj * kRowBlock];
                    for (size_t i = 0; i < rows; ++i) {
                        const float product = ap[i] * bq;
                        out[i]              = out[i] + product;
                    }
                }
            }
            for (size_t jj = 0; jj < cols; ++jj) {
                const size_t j = j0 + jj;
                for (size_t i = 0; i < rows; ++i) {
                    float v = p.alpha * acc[jj * kRowBlock + i];
                    if (p.beta != 0.0f) v = v + p.beta * load(p.c, p.c_type, j * p.ldc + i0 + i);
                    if (p.bias != nullptr) v = v + load(p.bias, p.bias_type, i0 + i);
                    if (p.gelu == Product::Gelu::forward) {
                        store(const_cast<void *>(p.aux), p.aux_type, j * p.aux_ld + i0 + i, v);
                        v = gelu(v);
                    } else if (p.gelu == Product::Gelu::backward) {
                        v = v * gelu_grad(load(p.aux, p.aux_type, j * p.aux_ld + i0 + i));
                    }
                    store(p.d, p.d_type, j * p.ldd + i0 + i, v);
                }
            }
        }
    }
}

cublasStatus_t launch_product(cudaStream_t stream, Product p) {
    if (p.m == 0 || p.n == 0) return CUBLAS_STATUS_SUCCESS;
    const cudaError_t status = enqueue(stream, [p] { run_product(p); }, p.name);
    if (status != cudaSuccess) {
        set_last_error(status);
        return CUBLAS_STATUS_EXECUTION_FAILED;
    }
    return CUBLAS_STATUS_SUCCESS;
}

bool scalar_compute(cublasComputeType_t compute) {
    return compute == CUBLAS_COMPUTE_32F || compute == CUBLAS_COMPUTE_32F_PEDANTIC;
}

// The operand types emulated: A and B both f32, both bf16 or both f16; C and D f32, or bf16 with bf16 A.
bool types_supported(cudaDataType_t ab_a, cudaDataType_t ab_b, cudaDataType_t c, cudaDataType_t d) {
    if (ab_a != ab_b || element_size(ab_a) == 0) return false;
    if (c != d) return false;
    return c == CUDA_R_32F || (c == ab_a && c != CUDA_R_16F);
}

uint32_t alignment_of(const void * p) {
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    uint32_t        align   = 256;
    while (align > 1 && address % align != 0) align /= 2;
    return align;
}

// The shapes of op(A) (m, k), op(B) (k, n), C and D (m, n) must agree and leading dimensions cover rows.
cublasStatus_t lt_shape(const LtMatmulDesc & desc, const LtMatrixLayout & A, const LtMatrixLayout & B,
                        const LtMatrixLayout & C, const LtMatrixLayout & D, size_t * m, size_t * n, size_t * k) {
    const bool     ta = desc.transa != CUBLAS_OP_N, tb = desc.transb != CUBLAS_OP_N;
    const uint64_t am = ta ? A.cols : A.rows, ak = ta ? A.rows : A.cols;
    const uint64_t bk = tb ? B.cols : B.rows, bn = tb ? B.rows : B.cols;
    if (ak != bk || C.rows != am || C.cols != bn || D.rows != am || D.cols != bn) return CUBLAS_STATUS_INVALID_VALUE;
    for (const LtMatrixLayout * l : {&A, &B, &C, &D}) {
        if (l->ld < 1 || static_cast<uint64_t>(l->ld) < l->rows) return CUBLAS_STATUS_INVALID_VALUE;
    }
    *m = am;
    *n = bn;
    *k = ak;
    return CUBLAS_STATUS_SUCCESS;
}

// The bias pointer: read (BIAS, GELU_AUX_BIAS) or written (BGRADB).
bool has_bias(cublasLtEpilogue_t e) {
    return e == CUBLASLT_EPILOGUE_BIAS || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_BGRADB;
}
bool has_aux(cublasLtEpilogue_t e) {
    return e == CUBLASLT_EPILOGUE_GELU_AUX || e == CUBLASLT_EPILOGUE_GELU_AUX_BIAS || e == CUBLASLT_EPILOGUE_DGELU;
}
bool epilogue_emulated(cublasLtEpilogue_t e) { return e == CUBLASLT_EPILOGUE_DEFAULT || has_bias(e) || has_aux(e); }

// What the epilogue needs beyond the product: a bias of f32 or D's type; an auxiliary matrix of D's type whose
// leading dimension is a multiple of 8 elements covering D's rows.
bool epilogue_operands_valid(const LtMatmulDesc & desc, const LtMatrixLayout & D) {
    if (has_bias(desc.epilogue)) {
        const int32_t bias_type = desc.bias_type < 0 ? D.type : desc.bias_type;
        if (desc.bias == nullptr || (bias_type != CUDA_R_32F && bias_type != D.type)) return false;
    }
    if (has_aux(desc.epilogue)) {
        const int32_t aux_type = desc.aux_type < 0 ? D.type : desc.aux_type;
        if (desc.aux == nullptr || aux_type != D.type) return false;
        if (desc.aux_ld < static_cast<int64_t>(D.rows) || desc.aux_ld % 8 != 0) return false;
    }
    return true;
}

template <typename T>
cublasStatus_t read_attribute(T * out, const void * buf, size_t size) {
    if (buf == nullptr || size != sizeof(T)) return CUBLAS_STATUS_INVALID_VALUE;
    std::memcpy(out, buf, sizeof(T));
    return CUBLAS_STATUS_SUCCESS;
}

}  // namespace

// ---- cuBLAS

const char * cublasGetStatusName(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "CUBLAS_STATUS_SUCCESS";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "CUBLAS_STATUS_NOT_INITIALIZED";
        case CUBLAS_STATUS_ALLOC_FAILED: return "CUBLAS_STATUS_ALLOC_FAILED";
        case CUBLAS_STATUS_INVALID_VALUE: return "CUBLAS_STATUS_INVALID_VALUE";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "CUBLAS_STATUS_ARCH_MISMATCH";
        case CUBLAS_STATUS_MAPPING_ERROR: return "CUBLAS_STATUS_MAPPING_ERROR";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "CUBLAS_STATUS_EXECUTION_FAILED";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "CUBLAS_STATUS_INTERNAL_ERROR";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "CUBLAS_STATUS_NOT_SUPPORTED";
        case CUBLAS_STATUS_LICENSE_ERROR: return "CUBLAS_STATUS_LICENSE_ERROR";
    }
    return "CUBLAS_STATUS_UNKNOWN";
}

const char * cublasGetStatusString(cublasStatus_t status) {
    switch (status) {
        case CUBLAS_STATUS_SUCCESS: return "success";
        case CUBLAS_STATUS_NOT_INITIALIZED: return "the library was not initialized";
        case CUBLAS_STATUS_ALLOC_FAILED: return "the resource allocation failed";
        case CUBLAS_STATUS_INVALID_VALUE: return "an invalid numeric value was used as an argument";
        case CUBLAS_STATUS_ARCH_MISMATCH: return "an absent device architectural feature is required";
        case CUBLAS_STATUS_MAPPING_ERROR: return "an access to GPU memory space failed";
        case CUBLAS_STATUS_EXECUTION_FAILED: return "the GPU program failed to execute";
        case CUBLAS_STATUS_INTERNAL_ERROR: return "an internal operation failed";
        case CUBLAS_STATUS_NOT_SUPPORTED: return "the functionality requested is not supported";
        case CUBLAS_STATUS_LICENSE_ERROR: return "an error detected when checking the current licensing";
    }
    return "unknown error";
}

// cuBLAS allocates device memory at creation (its workspace), so creating a handle is an unsafe call
// inside a capture, as on a GPU.
cublasStatus_t cublasCreate(cublasHandle_t * handle) {
    if (handle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    void * workspace = nullptr;
    if (cudaMalloc(&workspace, size_t{4} << 20) != cudaSuccess) return CUBLAS_STATUS_ALLOC_FAILED;
    *handle = new CublasContext{nullptr, CUBLAS_DEFAULT_MATH, workspace, nullptr, {}};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasDestroy(cublasHandle_t handle) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    cudaFree(handle->workspace);
    for (auto & [stream, buffer] : handle->pool) cudaFree(buffer);
    delete handle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetStream(cublasHandle_t handle, cudaStream_t streamId) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->stream         = streamId;
    handle->user_workspace = nullptr;   // cuBLAS: back to the default pool
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetWorkspace(cublasHandle_t handle, void * workspace, size_t workspaceSizeInBytes) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (workspace == nullptr && workspaceSizeInBytes > 0) return CUBLAS_STATUS_INVALID_VALUE;
    handle->user_workspace = workspace;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetStream(cublasHandle_t handle, cudaStream_t * streamId) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (streamId == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *streamId = handle->stream;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasSetMathMode(cublasHandle_t handle, cublasMath_t mode) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    handle->math = mode;   // every mode computes in plain f32 here (no TF32 to emulate)
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGetMathMode(cublasHandle_t handle, cublasMath_t * mode) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (mode == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *mode = handle->math;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasGemmEx(cublasHandle_t handle, cublasOperation_t transa, cublasOperation_t transb, int m, int n,
                            int k, const void * alpha, const void * A, cudaDataType Atype, int lda, const void * B,
                            cudaDataType Btype, int ldb, const void * beta, void * C, cudaDataType Ctype, int ldc,
                            cublasComputeType_t computeType, cublasGemmAlgo_t algo) {
    if (handle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    const bool ta = transa != CUBLAS_OP_N, tb = transb != CUBLAS_OP_N;
    if (m < 0 || n < 0 || k < 0 || alpha == nullptr || beta == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    if (lda < std::max(1, ta ? k : m) || ldb < std::max(1, tb ? n : k) || ldc < std::max(1, m)) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    if (!scalar_compute(computeType) || !types_supported(Atype, Btype, Ctype, Ctype)) {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (algo != CUBLAS_GEMM_DEFAULT && algo != CUBLAS_GEMM_DEFAULT_TENSOR_OP) return CUBLAS_STATUS_INVALID_VALUE;
    Product p{};
    p.trans_a = ta;
    p.trans_b = tb;
    p.m = static_cast<size_t>(m), p.n = static_cast<size_t>(n), p.k = static_cast<size_t>(k);
    p.alpha   = *static_cast<const float *>(alpha);
    p.beta    = *static_cast<const float *>(beta);
    const size_t um = static_cast<size_t>(m), un = static_cast<size_t>(n), uk = static_cast<size_t>(k);
    p.a       = Operand{A, Atype, ta ? uk : um, ta ? um : uk, static_cast<size_t>(lda)};
    p.b       = Operand{B, Btype, tb ? un : uk, tb ? uk : un, static_cast<size_t>(ldb)};
    p.c = C, p.c_type = Ctype, p.ldc = static_cast<size_t>(ldc);
    p.d = C, p.d_type = Ctype, p.ldd = static_cast<size_t>(ldc);
    p.bias    = nullptr;
    p.name    = "cublasGemmEx";
    if (handle->user_workspace == nullptr && !handle->pool.count(handle->stream)) {
        // The pool's buffer for this stream, allocated now as cuBLAS does: inside a thread-local capture on this
        // thread the allocation invalidates the capture, and the launch below then fails with it.
        void * buffer = nullptr;
        if (cudaMalloc(&buffer, size_t{4} << 20) != cudaSuccess) return CUBLAS_STATUS_ALLOC_FAILED;
        handle->pool[handle->stream] = buffer;
    }
    return launch_product(handle->stream, p);
}

// ---- cuBLASLt

size_t cublasLtGetVersion() { return 120804; }

cublasStatus_t cublasLtCreate(cublasLtHandle_t * lightHandle) {
    if (lightHandle == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    int device = 0;
    cudaGetDevice(&device);
    *lightHandle = new LtContext{device};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtDestroy(cublasLtHandle_t lightHandle) {
    if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    delete lightHandle;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescCreate(cublasLtMatmulDesc_t * matmulDesc, cublasComputeType_t computeType,
                                        cudaDataType_t scaleType) {
    if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *matmulDesc = new LtMatmulDesc{computeType, scaleType};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescDestroy(cublasLtMatmulDesc_t matmulDesc) {
    delete matmulDesc;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulDescSetAttribute(cublasLtMatmulDesc_t matmulDesc, cublasLtMatmulDescAttributes_t attr,
                                              const void * buf, size_t sizeInBytes) {
    if (matmulDesc == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
        case CUBLASLT_MATMUL_DESC_TRANSA: return read_attribute(&matmulDesc->transa, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_TRANSB: return read_attribute(&matmulDesc->transb, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE: return read_attribute(&matmulDesc->epilogue, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_BIAS_POINTER: return read_attribute(&matmulDesc->bias, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE: return read_attribute(&matmulDesc->bias_type, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER: return read_attribute(&matmulDesc->aux, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD: return read_attribute(&matmulDesc->aux_ld, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_DATA_TYPE: return read_attribute(&matmulDesc->aux_type, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_COMPUTE_TYPE: return read_attribute(&matmulDesc->compute, buf, sizeInBytes);
        case CUBLASLT_MATMUL_DESC_SCALE_TYPE: return read_attribute(&matmulDesc->scale, buf, sizeInBytes);
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
}

cublasStatus_t cublasLtMatrixLayoutCreate(cublasLtMatrixLayout_t * matLayout, cudaDataType type, uint64_t rows,
                                          uint64_t cols, int64_t ld) {
    if (matLayout == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *matLayout = new LtMatrixLayout{type, rows, cols, ld};
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatrixLayoutDestroy(cublasLtMatrixLayout_t matLayout) {
    delete matLayout;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceCreate(cublasLtMatmulPreference_t * pref) {
    if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    *pref = new LtMatmulPreference;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceDestroy(cublasLtMatmulPreference_t pref) {
    delete pref;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmulPreferenceSetAttribute(cublasLtMatmulPreference_t pref,
                                                    cublasLtMatmulPreferenceAttributes_t attr, const void * buf,
                                                    size_t sizeInBytes) {
    if (pref == nullptr) return CUBLAS_STATUS_INVALID_VALUE;
    switch (attr) {
        case CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES:
            return read_attribute(&pref->max_workspace, buf, sizeInBytes);
        case CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK: return read_attribute(&pref->reduction_mask, buf, sizeInBytes);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES: return read_attribute(&pref->align[0], buf, sizeInBytes);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES: return read_attribute(&pref->align[1], buf, sizeInBytes);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES: return read_attribute(&pref->align[2], buf, sizeInBytes);
        case CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES: return read_attribute(&pref->align[3], buf, sizeInBytes);
        default: return CUBLAS_STATUS_INVALID_VALUE;
    }
}

namespace {
std::atomic<long long> g_heuristic_calls{0};
std::atomic<long long> g_reduced_precision_queries{0};   // preferences that allow a split-K sum in the output type
}  // namespace

long long emu_lt_heuristic_calls() { return g_heuristic_calls.load(); }
long long emu_lt_reduced_precision_queries() { return g_reduced_precision_queries.load(); }

cublasStatus_t cublasLtMatmulAlgoGetHeuristic(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t operationDesc,
                                              cublasLtMatrixLayout_t Adesc, cublasLtMatrixLayout_t Bdesc,
                                              cublasLtMatrixLayout_t Cdesc, cublasLtMatrixLayout_t Ddesc,
                                              cublasLtMatmulPreference_t preference, int requestedAlgoCount,
                                              cublasLtMatmulHeuristicResult_t heuristicResultsArray[],
                                              int * returnAlgoCount) {
    ++g_heuristic_calls;
    if (preference != nullptr &&
        (preference->reduction_mask & (CUBLASLT_REDUCTION_SCHEME_INPLACE | CUBLASLT_REDUCTION_SCHEME_OUTPUT_TYPE)) != 0) {
        ++g_reduced_precision_queries;
    }
    if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (operationDesc == nullptr || Adesc == nullptr || Bdesc == nullptr || Cdesc == nullptr || Ddesc == nullptr ||
        preference == nullptr || requestedAlgoCount < 1 || heuristicResultsArray == nullptr ||
        returnAlgoCount == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    *returnAlgoCount = 0;
    size_t m = 0, n = 0, k = 0;
    if (cublasStatus_t s = lt_shape(*operationDesc, *Adesc, *Bdesc, *Cdesc, *Ddesc, &m, &n, &k);
        s != CUBLAS_STATUS_SUCCESS) {
        return s;
    }
    const LtMatmulDesc & desc = *operationDesc;
    if (!scalar_compute(desc.compute) || desc.scale != CUDA_R_32F ||
        !types_supported(Adesc->type, Bdesc->type, Cdesc->type, Ddesc->type)) {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (!epilogue_emulated(desc.epilogue) || !epilogue_operands_valid(desc, *Ddesc)) return CUBLAS_STATUS_NOT_SUPPORTED;
    // The kernels' vector loads: every operand 16-byte aligned, every column starting 16-byte aligned.
    const LtMatrixLayout * layouts[4] = {Adesc, Bdesc, Cdesc, Ddesc};
    for (int i = 0; i < 4; ++i) {
        if (preference->align[i] < kKernelAlignment) return CUBLAS_STATUS_NOT_SUPPORTED;
        if ((static_cast<uint64_t>(layouts[i]->ld) * element_size(layouts[i]->type)) % kKernelAlignment != 0) {
            return CUBLAS_STATUS_NOT_SUPPORTED;
        }
    }
    if (has_bias(desc.epilogue) && alignment_of(desc.bias) < kKernelAlignment) return CUBLAS_STATUS_NOT_SUPPORTED;
    if (has_aux(desc.epilogue) && alignment_of(desc.aux) < kKernelAlignment) return CUBLAS_STATUS_NOT_SUPPORTED;
    cublasLtMatmulHeuristicResult_t & r = heuristicResultsArray[0];
    r                                   = cublasLtMatmulHeuristicResult_t{};
    r.algo.data[0]                      = kAlgoMagic;
    for (int i = 0; i < 4; ++i) r.algo.data[1 + i] = std::min<uint32_t>(preference->align[i], 256);
    r.workspaceSize  = 0;
    r.state          = CUBLAS_STATUS_SUCCESS;
    r.wavesCount     = 1.0f;
    *returnAlgoCount = 1;
    return CUBLAS_STATUS_SUCCESS;
}

cublasStatus_t cublasLtMatmul(cublasLtHandle_t lightHandle, cublasLtMatmulDesc_t computeDesc, const void * alpha,
                              const void * A, cublasLtMatrixLayout_t Adesc, const void * B,
                              cublasLtMatrixLayout_t Bdesc, const void * beta, const void * C,
                              cublasLtMatrixLayout_t Cdesc, void * D, cublasLtMatrixLayout_t Ddesc,
                              const cublasLtMatmulAlgo_t * algo, void * workspace, size_t workspaceSizeInBytes,
                              cudaStream_t stream) {
    (void)workspace;
    (void)workspaceSizeInBytes;   // the algorithms returned need none
    if (lightHandle == nullptr) return CUBLAS_STATUS_NOT_INITIALIZED;
    if (computeDesc == nullptr || Adesc == nullptr || Bdesc == nullptr || Cdesc == nullptr || Ddesc == nullptr ||
        alpha == nullptr || beta == nullptr) {
        return CUBLAS_STATUS_INVALID_VALUE;
    }
    const LtMatmulDesc & desc = *computeDesc;
    size_t               m = 0, n = 0, k = 0;
    if (cublasStatus_t s = lt_shape(desc, *Adesc, *Bdesc, *Cdesc, *Ddesc, &m, &n, &k); s != CUBLAS_STATUS_SUCCESS) {
        return s;
    }
    if (!scalar_compute(desc.compute) || desc.scale != CUDA_R_32F ||
        !types_supported(Adesc->type, Bdesc->type, Cdesc->type, Ddesc->type) || !epilogue_emulated(desc.epilogue)) {
        return CUBLAS_STATUS_NOT_SUPPORTED;
    }
    if (!epilogue_operands_valid(desc, *Ddesc)) return CUBLAS_STATUS_INVALID_VALUE;
    if (has_aux(desc.epilogue) && alignment_of(desc.aux) < kKernelAlignment) return CUBLAS_STATUS_INVALID_VALUE;
    if (has_bias(desc.epilogue) && alignment_of(desc.bias) < kKernelAlignment) return CUBLAS_STATUS_INVALID_VALUE;
    if (C != D && Cdesc->ld != Ddesc->ld) return CUBLAS_STATUS_NOT_SUPPORTED;   // in-place needs one layout
    // An algorithm chose its kernel for the alignments the preference declared: pointers (and columns) less
    // aligned than that are a misaligned access on a GPU.
    if (algo != nullptr) {
        if (algo->data[0] != kAlgoMagic) return CUBLAS_STATUS_INVALID_VALUE;
        const void *           pointers[4] = {A, B, C, D};
        const LtMatrixLayout * layouts[4]  = {Adesc, Bdesc, Cdesc, Ddesc};
        for (int i = 0; i < 4; ++i) {
            const uint32_t need = static_cast<uint32_t>(algo->data[1 + i]);
            if (alignment_of(pointers[i]) < need ||
                (static_cast<uint64_t>(layouts[i]->ld) * element_size(layouts[i]->type)) % kKernelAlignment != 0) {
                return CUBLAS_STATUS_INVALID_VALUE;
            }
        }
    }
    Product p{};
    p.trans_a = desc.transa != CUBLAS_OP_N;
    p.trans_b = desc.transb != CUBLAS_OP_N;
    p.m = m, p.n = n, p.k = k;
    p.alpha = *static_cast<const float *>(alpha);
    p.beta  = *static_cast<const float *>(beta);
    p.a     = Operand{A, Adesc->type, Adesc->rows, Adesc->cols, static_cast<size_t>(Adesc->ld)};
    p.b     = Operand{B, Bdesc->type, Bdesc->rows, Bdesc->cols, static_cast<size_t>(Bdesc->ld)};
    p.c = C, p.c_type = Cdesc->type, p.ldc = static_cast<size_t>(Cdesc->ld);
    p.d = D, p.d_type = Ddesc->type, p.ldd = static_cast<size_t>(Ddesc->ld);
    if (has_bias(desc.epilogue)) {
        p.bias_type = static_cast<cudaDataType_t>(desc.bias_type < 0 ? Ddesc->type : desc.bias_type);
        if (desc.epilogue == CUBLASLT_EPILOGUE_BGRADB) {
            p.bias_grad = const_cast<void *>(desc.bias);   // the descriptor holds one pointer type for both uses
        } else {
            p.bias = desc.bias;
        }
    }
    if (has_aux(desc.epilogue)) {
        p.gelu     = desc.epilogue == CUBLASLT_EPILOGUE_DGELU ? Product::Gelu::backward : Product::Gelu::forward;
        p.aux      = desc.aux;
        p.aux_type = Ddesc->type;
        p.aux_ld   = static_cast<size_t>(desc.aux_ld);
    }
    p.name = "cublasLtMatmul";
    return launch_product(stream, p);
}

}  // namespace loom_emu
