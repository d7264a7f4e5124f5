#include "backend/cuda/gemm.h"

#include "backend/cuda/cuda_check.h"

#include <compare>
#include <map>
#include <memory>
#include <mutex>
#include <utility>
#include <vector>

namespace loom::LOOM_CUDA_NS {

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

// One cuBLAS handle per stream, for the shapes cuBLASLt has no kernel for (gemm_lt's fallback). A handle
// is bound to its stream and to the stream's GEMM workspace at every call (cublasSetStream resets the
// workspace to cuBLAS's own pool, whose per-stream buffer cuBLAS would allocate at the stream's first GEMM:
// inside a capture, an allocation that breaks it). Per stream, so two threads driving two streams never
// re-bind one handle under each other. Created before a capture begins (gemm_handles_create); kept until exit.
cublasHandle_t blas_handle(int device_index, cudaStream_t stream) {
    static std::mutex                                          mutex;
    static std::map<std::pair<int, cudaStream_t>, cublasHandle_t> handles;
    std::lock_guard<std::mutex>                                lock(mutex);
    cublasHandle_t & handle = handles[{device_index, stream}];
    if (handle == nullptr) {
        LOOM_CUBLAS_CHECK(cublasCreate(&handle));
        LOOM_CUBLAS_CHECK(cublasSetMathMode(handle, CUBLAS_PEDANTIC_MATH));   // no TF32, as cuBLASLt's path
    }
    return handle;
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

// The epilogues this file runs (cuBLASLt's names without the prefix).
enum class Epilogue { none, bias, gelu_aux, gelu_aux_bias, dgelu, bgradb };

// The bias pointer: the bias added, or (BGRADB) the bias gradient written.
bool has_bias(Epilogue e) { return e == Epilogue::bias || e == Epilogue::gelu_aux_bias || e == Epilogue::bgradb; }
bool has_aux(Epilogue e) { return e == Epilogue::gelu_aux || e == Epilogue::gelu_aux_bias || e == Epilogue::dgelu; }

cublasLtEpilogue_t lt_epilogue(Epilogue e) {
    switch (e) {
        case Epilogue::none: return CUBLASLT_EPILOGUE_DEFAULT;
        case Epilogue::bias: return CUBLASLT_EPILOGUE_BIAS;
        case Epilogue::gelu_aux: return CUBLASLT_EPILOGUE_GELU_AUX;
        case Epilogue::gelu_aux_bias: return CUBLASLT_EPILOGUE_GELU_AUX_BIAS;
        case Epilogue::dgelu: return CUBLASLT_EPILOGUE_DGELU;
        case Epilogue::bgradb: return CUBLASLT_EPILOGUE_BGRADB;
    }
    return CUBLASLT_EPILOGUE_DEFAULT;
}

// One call's cuBLASLt plan: the descriptors of c (m, n) = op(a) op(b) with its epilogue, and the heuristic's
// algorithm for them. `found` is false where cuBLASLt has no kernel for the operands' alignments or leading
// dimensions (or for the epilogue); any other failure throws.
struct LtPlan {
    MatmulDesc                      desc;
    Layout                          layout_a, layout_b, layout_c;
    Preference                      preference;
    cublasOperation_t               op_a, op_b;        // cuBLASLt's A is Loom's b, its B Loom's a
    uint64_t                        a_rows, b_rows;    // their leading dimensions
    cudaDataType_t                  ab_type;
    cudaDataType_t                  c_type;            // C and D: f32, or bf16 (the accumulator rounded once)
    cublasLtMatmulHeuristicResult_t heuristic{};
    bool                            found = false;

    Epilogue                        epilogue;          // its pointers (bias, aux) set at each run
    std::mutex                      run_mutex;         // a cached plan's descriptor is shared: one run at a time

    LtPlan(cublasLtHandle_t handle, size_t workspace_bytes, bool trans_a, bool trans_b, int64_t m, int64_t n,
           int64_t k, const void * a, const void * b, GemmOperands ab, const void * c, bool c_bf16, Epilogue epilogue_,
           const float * bias_values, const void * aux)
        : op_a(trans_b ? CUBLAS_OP_T : CUBLAS_OP_N), op_b(trans_a ? CUBLAS_OP_T : CUBLAS_OP_N), a_rows(trans_b ? k : n),
          b_rows(trans_a ? m : k),
          ab_type(ab == GemmOperands::bf16 ? CUDA_R_16BF : ab == GemmOperands::f16 ? CUDA_R_16F : CUDA_R_32F),
          c_type(c_bf16 ? CUDA_R_16BF : CUDA_R_32F), epilogue(epilogue_) {
        LOOM_CUBLAS_CHECK(cublasLtMatmulDescCreate(&desc.handle, CUBLAS_COMPUTE_32F, CUDA_R_32F));
        LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSA, &op_a, sizeof(op_a)));
        LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_TRANSB, &op_b, sizeof(op_b)));
        if (epilogue != Epilogue::none) {
            const cublasLtEpilogue_t lt = lt_epilogue(epilogue);
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE, &lt, sizeof(lt)));
        }
        // The heuristic reads the pointers' alignments, so they are set before it runs.
        if (has_bias(epilogue)) {
            // D (n, m) column-major: the bias runs along D's n rows, broadcast over its m columns, i.e. one
            // value per output feature of Loom's (m, n). Its type is f32 (added to the f32 accumulator), stated
            // rather than defaulted. BGRADB's gradient runs along D's m columns instead: one value per row of
            // Loom's c, the sum over k of cuBLASLt's B (Loom's a), f32 as D.
            const int32_t bias_type = CUDA_R_32F;
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                             &bias_values, sizeof(bias_values)));
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE,
                                                             &bias_type, sizeof(bias_type)));
        }
        if (has_aux(epilogue)) {
            // GELU's input, laid out as D (n rows of Loom's features, ld n), of D's type (cuBLASLt's default).
            const int64_t aux_ld = n;
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                             sizeof(aux)));
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_LD, &aux_ld,
                                                             sizeof(aux_ld)));
        }

        const uint64_t a_cols = trans_b ? n : k, b_cols = trans_a ? k : m;
        LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_a.handle, ab_type, a_rows, a_cols, static_cast<int64_t>(a_rows)));
        LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_b.handle, ab_type, b_rows, b_cols, static_cast<int64_t>(b_rows)));
        LOOM_CUBLAS_CHECK(cublasLtMatrixLayoutCreate(&layout_c.handle, c_type, n, m, n));

        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceCreate(&preference.handle));
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES,
                                                               &workspace_bytes, sizeof(workspace_bytes)));
        // Split-K partial sums reduced in f32 only, never in a 16-bit output's type (in place or in the
        // workspace): what Megatron's --disable-bf16-reduced-precision-matmul asks of PyTorch, always.
        const uint32_t reduction = CUBLASLT_REDUCTION_SCHEME_COMPUTE_TYPE;
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_REDUCTION_SCHEME_MASK,
                                                               &reduction, sizeof(reduction)));
        const uint32_t align_a = alignment_of(b), align_b = alignment_of(a), align_c = alignment_of(c);
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES,
                                                               &align_a, sizeof(align_a)));
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES,
                                                               &align_b, sizeof(align_b)));
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES,
                                                               &align_c, sizeof(align_c)));
        LOOM_CUBLAS_CHECK(cublasLtMatmulPreferenceSetAttribute(preference.handle, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES,
                                                               &align_c, sizeof(align_c)));

        int            count  = 0;
        cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc.handle, layout_a.handle, layout_b.handle,
                                                               layout_c.handle, layout_c.handle, preference.handle, 1,
                                                               &heuristic, &count);
        if (status != CUBLAS_STATUS_NOT_SUPPORTED) LOOM_CUBLAS_CHECK(status);
        found = status == CUBLAS_STATUS_SUCCESS && count > 0;
    }

    void run(cublasLtHandle_t handle, cudaStream_t stream, void * workspace, size_t workspace_bytes, const void * a,
             const void * b, void * c, bool accumulate, const float * bias_values = nullptr, const void * aux = nullptr) {
        const float                 alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        std::lock_guard<std::mutex> lock(run_mutex);
        if (has_bias(epilogue)) {
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_BIAS_POINTER,
                                                             &bias_values, sizeof(bias_values)));
        }
        if (has_aux(epilogue)) {
            LOOM_CUBLAS_CHECK(cublasLtMatmulDescSetAttribute(desc.handle, CUBLASLT_MATMUL_DESC_EPILOGUE_AUX_POINTER, &aux,
                                                             sizeof(aux)));
        }
        LOOM_CUBLAS_CHECK(cublasLtMatmul(handle, desc.handle, &alpha, b, layout_a.handle, a, layout_b.handle, &beta, c,
                                         layout_c.handle, c, layout_c.handle, &heuristic.algo, workspace,
                                         workspace_bytes, stream));
    }
};

// The plans of the run, by everything their descriptors and the heuristic's choice depend on: the shape,
// transposes and operand type, the workspace, the epilogue, and the alignments the heuristic was told
// (the operands' addresses change from call to call, their alignments seldom do). A step after warm-up
// finds every plan here and asks the heuristic nothing. Kept until exit: a model's GEMM shapes are few.
struct PlanKey {
    int          device;
    size_t       workspace_bytes;
    bool         trans_a, trans_b, c_bf16;
    Epilogue     epilogue;
    int64_t      m, n, k;
    GemmOperands ab;
    uint32_t     align_a, align_b, align_c, align_bias, align_aux;
    auto         operator<=>(const PlanKey &) const = default;
};

std::mutex                                   g_plans_mutex;
std::map<PlanKey, std::unique_ptr<LtPlan>> * g_plans = new std::map<PlanKey, std::unique_ptr<LtPlan>>;   // never freed: plans outlive static destruction
GemmPlanStats                                g_plan_stats;

LtPlan & plan_for(int device_index, cublasLtHandle_t handle, size_t workspace_bytes, bool trans_a, bool trans_b,
                  int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab, const void * c,
                  bool c_bf16, Epilogue epilogue = Epilogue::none, const float * bias = nullptr,
                  const void * aux = nullptr) {
    const PlanKey key{device_index, workspace_bytes, trans_a, trans_b, c_bf16, epilogue, m, n, k, ab,
                      alignment_of(a), alignment_of(b), alignment_of(c), has_bias(epilogue) ? alignment_of(bias) : 0u,
                      has_aux(epilogue) ? alignment_of(aux) : 0u};
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    ++g_plan_stats.lookups;
    std::unique_ptr<LtPlan> & plan = (*g_plans)[key];
    if (plan == nullptr) {
        ++g_plan_stats.heuristic_queries;
        plan = std::make_unique<LtPlan>(handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, c_bf16, epilogue,
                                        bias, aux);
    }
    return *plan;
}

}  // namespace

GemmPlanStats gemm_plan_stats() {
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    GemmPlanStats stats = g_plan_stats;
    stats.plans         = static_cast<int64_t>(g_plans->size());
    return stats;
}

void gemm_handles_create(int device_index, cudaStream_t stream) {
    lt_handle(device_index);
    blas_handle(device_index, stream);
}

void gemm_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
             bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab, void * c,
             bool c_bf16, bool accumulate) {
    if (m == 0 || n == 0) return;
    if (k == 0) {
        const size_t elem = c_bf16 ? 2 : sizeof(float);
        if (!accumulate) LOOM_CUDA_CHECK(cudaMemsetAsync(c, 0, static_cast<size_t>(m * n) * elem, stream));
        return;
    }
    cublasLtHandle_t handle = lt_handle(device_index);
    LtPlan &         plan   = plan_for(device_index, handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, c_bf16);
    if (!plan.found) {
        // No cuBLASLt kernel for these alignments or leading dimensions: cublasGemmEx takes any.
        const float    alpha = 1.0f, beta = accumulate ? 1.0f : 0.0f;
        cublasHandle_t blas  = blas_handle(device_index, stream);
        LOOM_CUBLAS_CHECK(cublasSetStream(blas, stream));
        LOOM_CUBLAS_CHECK(cublasSetWorkspace(blas, workspace, workspace_bytes));
        LOOM_CUBLAS_CHECK(cublasGemmEx(blas, plan.op_a, plan.op_b, static_cast<int>(n), static_cast<int>(m),
                                       static_cast<int>(k), &alpha, b, plan.ab_type, static_cast<int>(plan.a_rows), a,
                                       plan.ab_type, static_cast<int>(plan.b_rows), &beta, c, plan.c_type,
                                       static_cast<int>(n), CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT));
        return;
    }
    plan.run(handle, stream, workspace, workspace_bytes, a, b, c, accumulate);
}

bool gemm_bias_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                  bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                  const float * bias, void * c, bool c_bf16) {
    if (m == 0 || n == 0) return true;   // nothing to add to
    if (k > 0) {
        cublasLtHandle_t handle = lt_handle(device_index);
        LtPlan &         plan   = plan_for(device_index, handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c,
                                           c_bf16, Epilogue::bias, bias);
        if (plan.found) {
            plan.run(handle, stream, workspace, workspace_bytes, a, b, c, /*accumulate=*/false, bias);
            return true;
        }
    }
    gemm_lt(device_index, stream, workspace, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, c_bf16, false);
    return false;
}

bool gemm_gelu_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                  bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                  const float * bias, void * pre, void * c, bool c_bf16) {
    if (m == 0 || n == 0) return true;
    if (k == 0) return false;
    const Epilogue   epilogue = bias != nullptr ? Epilogue::gelu_aux_bias : Epilogue::gelu_aux;
    cublasLtHandle_t handle   = lt_handle(device_index);
    LtPlan & plan = plan_for(device_index, handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, c_bf16, epilogue,
                             bias, pre);
    if (!plan.found) return false;
    plan.run(handle, stream, workspace, workspace_bytes, a, b, c, /*accumulate=*/false, bias, pre);
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    ++g_plan_stats.gelu_epilogues;
    return true;
}

bool gemm_dgelu_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                   bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                   const void * pre, void * c, bool c_bf16) {
    if (m == 0 || n == 0) return true;
    if (k == 0) return false;
    cublasLtHandle_t handle = lt_handle(device_index);
    LtPlan & plan = plan_for(device_index, handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, c_bf16,
                             Epilogue::dgelu, nullptr, pre);
    if (!plan.found) return false;
    plan.run(handle, stream, workspace, workspace_bytes, a, b, c, /*accumulate=*/false, nullptr, pre);
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    ++g_plan_stats.dgelu_epilogues;
    return true;
}

bool gemm_bgradb_lt(int device_index, cudaStream_t stream, void * workspace, size_t workspace_bytes, bool trans_a,
                    bool trans_b, int64_t m, int64_t n, int64_t k, const void * a, const void * b, GemmOperands ab,
                    float * c, bool accumulate, float * bias_grad) {
    if (m == 0 || n == 0 || k == 0) return false;
    cublasLtHandle_t handle = lt_handle(device_index);
    LtPlan & plan = plan_for(device_index, handle, workspace_bytes, trans_a, trans_b, m, n, k, a, b, ab, c, false,
                             Epilogue::bgradb, bias_grad);
    if (!plan.found) return false;
    plan.run(handle, stream, workspace, workspace_bytes, a, b, c, accumulate, bias_grad);
    std::lock_guard<std::mutex> lock(g_plans_mutex);
    ++g_plan_stats.bgrad_epilogues;
    return true;
}

}  // namespace loom::LOOM_CUDA_NS
