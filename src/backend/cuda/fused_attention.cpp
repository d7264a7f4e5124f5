// Fused flash attention through cuDNN's graph API (fused_attention.h). Each direction is one operation
// graph of matmuls, pointwise operations and reductions in the pattern cuDNN's flash attention engines fuse
// (docs/gpu.md, "Fused attention"); the graph is finalized, the heuristic's engine configurations tried in
// order until one gives an execution plan, and the plan kept per shape with every descriptor it refers to.
//
// Tensors are [B, H, S, D] views of Loom's (s, b) rows: element (bi, h, i, c) of a tensor with row stride r
// is at (i b + bi) r + h d + c, so the strides are (r, d, b r, 1). Virtual tensors (the scores, the
// probabilities and the softmax's pieces) never reach memory; cuDNN keeps them in its tiles.
#include "backend/cuda/fused_attention.h"

#include "core/error.h"

#include <cudnn.h>

#include <limits>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <tuple>
#include <utility>
#include <vector>

namespace loom::LOOM_CUDA_NS {

namespace {

// The graphs' non-virtual tensors, by unique id (the variant pack names them so).
enum Uid : int64_t {
    kQ = 1, kK, kV, kO, kStats, kScale, kMaskFill, kDO, kDQ, kDK, kDV,
    kKt, kVt,   // k and v again, as the transposed views the products read (the same pointers)
    kFirstVirtual = 100,
};

struct Failed {
    std::string why;
};

void ok(cudnnStatus_t status, const char * what) {
    if (status == CUDNN_STATUS_SUCCESS) return;
    char detail[512] = {};
    cudnnGetLastErrorString(detail, sizeof detail);
    throw Failed{std::string(what) + ": " + cudnnGetErrorString(status) + (detail[0] ? std::string(" (") + detail + ")" : "")};
}

// A backend descriptor, destroyed with its owner.
struct Descriptor {
    cudnnBackendDescriptor_t d = nullptr;
    explicit Descriptor(cudnnBackendDescriptorType_t type) { ok(cudnnBackendCreateDescriptor(type, &d), "cudnnBackendCreateDescriptor"); }
    ~Descriptor() {
        if (d != nullptr) cudnnBackendDestroyDescriptor(d);
    }
    Descriptor(const Descriptor &)             = delete;
    Descriptor & operator=(const Descriptor &) = delete;

    template <class T>
    void set(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const T & value) {
        ok(cudnnBackendSetAttribute(d, name, type, 1, &value), "cudnnBackendSetAttribute");
    }
    template <class T>
    void set_all(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, const std::vector<T> & values) {
        ok(cudnnBackendSetAttribute(d, name, type, static_cast<int64_t>(values.size()), values.data()), "cudnnBackendSetAttribute");
    }
    void finalize(const char * what) { ok(cudnnBackendFinalize(d), what); }
};

using Dims = std::vector<int64_t>;

Dims dense(const Dims & dims) {
    Dims s(dims.size(), 1);
    for (size_t k = dims.size(); k-- > 1;) s[k - 1] = s[k] * dims[k];
    return s;
}

// Builds one operation graph, keeping every descriptor alive for the plan that runs it.
class GraphBuilder {
public:
    explicit GraphBuilder(cudnnHandle_t handle) : handle_(handle) {}

    cudnnBackendDescriptor_t tensor(int64_t uid, cudnnDataType_t type, const Dims & dims, const Dims & strides,
                                    bool is_virtual = false, bool by_value = false) {
        Descriptor & t = make(CUDNN_BACKEND_TENSOR_DESCRIPTOR);
        const int64_t alignment = 16;
        t.set(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, uid);
        t.set(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, type);
        t.set_all(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, dims);
        t.set_all(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, strides);
        t.set(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, alignment);
        t.set(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, is_virtual);
        if (by_value) t.set(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, by_value);
        t.finalize("tensor descriptor");
        return t.d;
    }
    // A virtual f32 tensor (or another type) of `dims`, densely strided.
    cudnnBackendDescriptor_t virt(const Dims & dims, cudnnDataType_t type = CUDNN_DATA_FLOAT) {
        return tensor(next_virtual_++, type, dims, dense(dims), true);
    }
    // A by-value f32 scalar, given to each execution through the variant pack.
    cudnnBackendDescriptor_t scalar(int64_t uid) { return tensor(uid, CUDNN_DATA_FLOAT, {1, 1, 1, 1}, {1, 1, 1, 1}, false, true); }

    // y = mode(x[, b[, t]]); GEN_INDEX's axis in `axis`.
    void pointwise(cudnnPointwiseMode_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t b,
                   cudnnBackendDescriptor_t t, cudnnBackendDescriptor_t y, int64_t axis = -1) {
        Descriptor & pw = make(CUDNN_BACKEND_POINTWISE_DESCRIPTOR);
        pw.set(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, mode);
        pw.set(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
        if (axis >= 0) pw.set(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, axis);
        pw.finalize("pointwise descriptor");
        Descriptor & op = make(CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, pw.d);
        op.set(CUDNN_ATTR_OPERATION_POINTWISE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x);
        if (b != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b);
        if (t != nullptr) op.set(CUDNN_ATTR_OPERATION_POINTWISE_TDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, t);
        op.set(CUDNN_ATTR_OPERATION_POINTWISE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y);
        op.finalize("pointwise operation");
        ops_.push_back(op.d);
    }
    // c = a b over the last two dimensions, batched over the others.
    void matmul(cudnnBackendDescriptor_t a, cudnnBackendDescriptor_t b, cudnnBackendDescriptor_t c) {
        Descriptor & mm = make(CUDNN_BACKEND_MATMUL_DESCRIPTOR);
        mm.set(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
        mm.finalize("matmul descriptor");
        Descriptor & op = make(CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_MATMUL_ADESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, a);
        op.set(CUDNN_ATTR_OPERATION_MATMUL_BDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, b);
        op.set(CUDNN_ATTR_OPERATION_MATMUL_CDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, c);
        op.set(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, mm.d);
        op.finalize("matmul operation");
        ops_.push_back(op.d);
    }
    // y: x's elements under y's dimensions and strides (a transpose of a virtual tensor's tiles).
    void reshape(cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        Descriptor & op = make(CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_RESHAPE_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x);
        op.set(CUDNN_ATTR_OPERATION_RESHAPE_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y);
        op.finalize("reshape operation");
        ops_.push_back(op.d);
    }
    int64_t next_uid() { return next_virtual_++; }
    // y = the ADD or MAX of x over the dimensions where y has 1.
    void reduction(cudnnReduceTensorOp_t mode, cudnnBackendDescriptor_t x, cudnnBackendDescriptor_t y) {
        Descriptor & r = make(CUDNN_BACKEND_REDUCTION_DESCRIPTOR);
        r.set(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, mode);
        r.set(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, CUDNN_DATA_FLOAT);
        r.finalize("reduction descriptor");
        Descriptor & op = make(CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR);
        op.set(CUDNN_ATTR_OPERATION_REDUCTION_XDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, x);
        op.set(CUDNN_ATTR_OPERATION_REDUCTION_YDESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, y);
        op.set(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, r.d);
        op.finalize("reduction operation");
        ops_.push_back(op.d);
    }

    // The graph, the heuristic's configurations tried in order, the first plan that finalizes.
    cudnnBackendDescriptor_t plan(int64_t * workspace) {
        Descriptor & graph = make(CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR);
        graph.set(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, handle_);
        graph.set_all(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, ops_);
        graph.finalize("operation graph");
        Descriptor & heuristic = make(CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR);
        heuristic.set(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, graph.d);
        heuristic.set(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, CUDNN_HEUR_MODE_A);
        heuristic.finalize("engine heuristic");
        int64_t count = 0;
        ok(cudnnBackendGetAttribute(heuristic.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, 0, &count,
                                    nullptr),
           "the engine heuristic's result count");
        if (count <= 0) throw Failed{"cuDNN's heuristic found no engine for the graph"};
        std::vector<cudnnBackendDescriptor_t> configs;
        for (int64_t i = 0; i < count; ++i) configs.push_back(make(CUDNN_BACKEND_ENGINECFG_DESCRIPTOR).d);
        int64_t returned = 0;
        ok(cudnnBackendGetAttribute(heuristic.d, CUDNN_ATTR_ENGINEHEUR_RESULTS, CUDNN_TYPE_BACKEND_DESCRIPTOR, count,
                                    &returned, configs.data()),
           "the engine heuristic's results");
        std::string last;
        for (int64_t i = 0; i < returned; ++i) {
            Descriptor & plan = make(CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR);
            try {
                plan.set(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, handle_);
                plan.set(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, configs[static_cast<size_t>(i)]);
                plan.finalize("execution plan");
                int64_t got = 0;
                ok(cudnnBackendGetAttribute(plan.d, CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE, CUDNN_TYPE_INT64, 1, &got,
                                            workspace),
                   "the plan's workspace size");
                return plan.d;
            } catch (const Failed & f) {
                last = f.why;   // the next configuration
            }
        }
        throw Failed{"none of the heuristic's " + std::to_string(returned) + " engine configurations built a plan: " + last};
    }

    std::vector<std::unique_ptr<Descriptor>> take() { return std::move(kept_); }

private:
    Descriptor & make(cudnnBackendDescriptorType_t type) {
        kept_.push_back(std::make_unique<Descriptor>(type));
        return *kept_.back();
    }

    cudnnHandle_t                            handle_;
    std::vector<std::unique_ptr<Descriptor>> kept_;
    std::vector<cudnnBackendDescriptor_t>    ops_;
    int64_t                                  next_virtual_ = kFirstVirtual;
};

// [B, H, S, D] over rows of `row` elements, and its transpose in the last two dimensions.
Dims heads(const FusedAttentionShape & a, int64_t h) { return {a.b, h, a.s, a.d}; }
Dims head_strides(const FusedAttentionShape & a, int64_t row) { return {row, a.d, a.b * row, 1}; }
Dims heads_t(const FusedAttentionShape & a, int64_t h) { return {a.b, h, a.d, a.s}; }
Dims head_strides_t(const FusedAttentionShape & a, int64_t row) { return {row, a.d, 1, a.b * row}; }
Dims stats_dims(const FusedAttentionShape & a) { return {a.b, a.nq, a.s, 1}; }
Dims stats_strides(const FusedAttentionShape & a) { return {a.nq * a.s, a.s, 1, 1}; }

// The scaled, causally masked scores S = scale q k^T (key j after query i filled with the mask value), as a
// virtual [B, H, S, S] tensor.
cudnnBackendDescriptor_t masked_scores(GraphBuilder & g, const FusedAttentionShape & a, cudnnDataType_t io) {
    auto q      = g.tensor(kQ, io, heads(a, a.nq), head_strides(a, a.q_row));
    auto kt     = g.tensor(kKt, io, heads_t(a, a.nkv), head_strides_t(a, a.kv_row));
    const Dims  ss{a.b, a.nq, a.s, a.s};
    auto scores = g.virt(ss);
    g.matmul(q, kt, scores);
    auto scaled = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_MUL, scores, g.scalar(kScale), nullptr, scaled);
    auto row  = g.virt(ss, CUDNN_DATA_INT32);
    auto col  = g.virt(ss, CUDNN_DATA_INT32);
    auto keep = g.virt(ss, CUDNN_DATA_BOOLEAN);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, nullptr, row, 2);
    g.pointwise(CUDNN_POINTWISE_GEN_INDEX, scaled, nullptr, nullptr, col, 3);
    g.pointwise(CUDNN_POINTWISE_CMP_GE, row, col, nullptr, keep);
    auto masked = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_BINARY_SELECT, scaled, g.scalar(kMaskFill), keep, masked);
    return masked;
}

// The forward: softmax with its statistics (max + log of the sum of exponentials), then P v.
void build_forward(GraphBuilder & g, const FusedAttentionShape & a, cudnnDataType_t io) {
    auto         masked = masked_scores(g, a, io);
    const Dims   ss{a.b, a.nq, a.s, a.s}, rows{a.b, a.nq, a.s, 1};
    auto max = g.virt(rows);
    g.reduction(CUDNN_REDUCE_TENSOR_MAX, masked, max);
    auto shifted = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_SUB, masked, max, nullptr, shifted);
    auto e = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, e);
    auto sum = g.virt(rows);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, e, sum);
    auto log_sum = g.virt(rows);
    g.pointwise(CUDNN_POINTWISE_LOG, sum, nullptr, nullptr, log_sum);
    auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, stats_dims(a), stats_strides(a));
    g.pointwise(CUDNN_POINTWISE_ADD, max, log_sum, nullptr, stats);
    auto p = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_DIV, e, sum, nullptr, p);
    auto v = g.tensor(kV, io, heads(a, a.nkv), head_strides(a, a.kv_row));
    auto o = g.tensor(kO, io, heads(a, a.nq), head_strides(a, a.o_row));
    g.matmul(p, v, o);
}

// The backward from the forward's statistics: P = exp(S - stats); dv = P^T dout; dP = dout v^T;
// dS = P (dP - rowsum(dout o)); dq = scale dS k; dk = scale dS^T q. The transposed products read the
// virtual P and dS through cuDNN's transposed layouts of the same tiles.
void build_backward(GraphBuilder & g, const FusedAttentionShape & a, cudnnDataType_t io) {
    auto       masked = masked_scores(g, a, io);
    const Dims ss{a.b, a.nq, a.s, a.s}, rows{a.b, a.nq, a.s, 1}, full{a.b, a.nq, a.s, a.d};
    auto stats = g.tensor(kStats, CUDNN_DATA_FLOAT, stats_dims(a), stats_strides(a));
    auto shifted = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_SUB, masked, stats, nullptr, shifted);
    auto p = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_EXP, shifted, nullptr, nullptr, p);
    // rowsum(dout o)
    auto o    = g.tensor(kO, io, heads(a, a.nq), head_strides(a, a.o_row));
    auto dout = g.tensor(kDO, io, heads(a, a.nq), head_strides(a, a.o_row));
    auto prod = g.virt(full);
    g.pointwise(CUDNN_POINTWISE_MUL, dout, o, nullptr, prod);
    auto dot = g.virt(rows);
    g.reduction(CUDNN_REDUCE_TENSOR_ADD, prod, dot);
    // dP = dout v^T, dS = P (dP - dot)
    auto vt = g.tensor(kVt, io, heads_t(a, a.nkv), head_strides_t(a, a.kv_row));
    auto dp = g.virt(ss);
    g.matmul(dout, vt, dp);
    auto centred = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_SUB, dp, dot, nullptr, centred);
    auto ds = g.virt(ss);
    g.pointwise(CUDNN_POINTWISE_MUL, p, centred, nullptr, ds);
    auto scale = g.scalar(kScale);
    // dq = scale dS k
    auto k       = g.tensor(kK, io, heads(a, a.nkv), head_strides(a, a.kv_row));
    auto dq_raw  = g.virt(full);
    g.matmul(ds, k, dq_raw);
    g.pointwise(CUDNN_POINTWISE_MUL, dq_raw, scale, nullptr, g.tensor(kDQ, io, heads(a, a.nq), head_strides(a, a.q_row)));
    // dv = P^T dout and dk = scale dS^T q, per query head, then summed over each key/value head's group.
    const Dims ts{a.b, a.nq, a.s, a.s}, ts_strides{a.nq * a.s * a.s, a.s * a.s, 1, a.s};
    auto pt = g.tensor(g.next_uid(), CUDNN_DATA_FLOAT, ts, ts_strides, true);
    g.reshape(p, pt);
    auto dst = g.tensor(g.next_uid(), CUDNN_DATA_FLOAT, ts, ts_strides, true);
    g.reshape(ds, dst);
    auto q      = g.tensor(kQ, io, heads(a, a.nq), head_strides(a, a.q_row));
    auto dv     = g.tensor(kDV, io, heads(a, a.nkv), head_strides(a, a.kv_row));
    auto dk     = g.tensor(kDK, io, heads(a, a.nkv), head_strides(a, a.kv_row));
    auto dk_raw = g.virt(full);
    g.matmul(dst, q, dk_raw);
    if (a.nq == a.nkv) {
        g.matmul(pt, dout, dv);
        g.pointwise(CUDNN_POINTWISE_MUL, dk_raw, scale, nullptr, dk);
    } else {
        auto dv_heads = g.virt(full);
        g.matmul(pt, dout, dv_heads);
        g.reduction(CUDNN_REDUCE_TENSOR_ADD, dv_heads, dv);
        auto dk_heads = g.virt(full);
        g.pointwise(CUDNN_POINTWISE_MUL, dk_raw, scale, nullptr, dk_heads);
        g.reduction(CUDNN_REDUCE_TENSOR_ADD, dk_heads, dk);
    }
}

// ---- The plans, per device, shape and direction, and the device's handle.

struct Plan {
    std::vector<std::unique_ptr<Descriptor>> descriptors;
    cudnnBackendDescriptor_t                 plan      = nullptr;
    int64_t                                  workspace = -1;   // -1: cuDNN refused the shape
    std::string                              why;
};

struct Cache {
    std::mutex                                                   mutex;
    std::map<int, cudnnHandle_t>                                 handles;
    std::map<std::tuple<int, FusedAttentionShape, bool>, Plan>  plans;
    FusedAttentionStats                                          stats;
};

Cache & cache() {
    static Cache * c = new Cache;   // kept until exit: captured graphs may replay the plans' kernels to the end
    return *c;
}

cudnnHandle_t handle_locked(Cache & c, int device_index) {
    cudnnHandle_t & h = c.handles[device_index];
    if (h == nullptr) ok(cudnnCreate(&h), "cudnnCreate");
    return h;
}

const Plan & plan_locked(Cache & c, int device_index, const FusedAttentionShape & shape, bool backward) {
    auto key = std::make_tuple(device_index, shape, backward);
    auto it  = c.plans.find(key);
    if (it != c.plans.end()) return it->second;
    Plan p;
    try {
        GraphBuilder          g(handle_locked(c, device_index));
        const cudnnDataType_t io = shape.bf16 ? CUDNN_DATA_BFLOAT16 : CUDNN_DATA_HALF;
        if (backward) {
            build_backward(g, shape, io);
        } else {
            build_forward(g, shape, io);
        }
        p.plan        = g.plan(&p.workspace);
        p.descriptors = g.take();
        ++c.stats.plans;
    } catch (const Failed & f) {
        p.workspace = -1;
        p.why       = f.why;
        ++c.stats.refused;
    }
    return c.plans.emplace(key, std::move(p)).first->second;
}

void execute_locked(Cache & c, int device_index, cudaStream_t stream, const Plan & p, std::vector<int64_t> uids,
                    std::vector<void *> pointers, void * workspace, const char * what) {
    LOOM_CHECK(p.plan != nullptr, what << ": no cuDNN plan for this shape (" << p.why << ")", "");
    cudnnHandle_t h = handle_locked(c, device_index);
    try {
        ok(cudnnSetStream(h, stream), "cudnnSetStream");
        Descriptor pack(CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR);
        pack.set_all(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, uids);
        pack.set_all(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, pointers);
        pack.set(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, workspace);
        pack.finalize("variant pack");
        ok(cudnnBackendExecute(h, p.plan, pack.d), "cudnnBackendExecute");
    } catch (const Failed & f) {
        LOOM_CHECK(false, what << ": " << f.why, "");
    }
}

}  // namespace

bool fused_attention_built() { return true; }

int64_t fused_attention_prepare(int device_index, const FusedAttentionShape & shape, bool backward, std::string * why) {
    Cache &                     c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    const Plan &                p = plan_locked(c, device_index, shape, backward);
    if (why != nullptr) *why = p.why;
    return p.workspace;
}

void fused_attention_forward(int device_index, cudaStream_t stream, const FusedAttentionShape & shape, const void * q,
                             const void * k, const void * v, void * out, float * lse, float scale, void * workspace) {
    Cache &                     c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    const Plan &                p = plan_locked(c, device_index, shape, false);
    float                       fill = -std::numeric_limits<float>::infinity();
    execute_locked(c, device_index, stream, p, {kQ, kKt, kV, kO, kStats, kScale, kMaskFill},
                   {const_cast<void *>(q), const_cast<void *>(k), const_cast<void *>(v), out, lse, &scale, &fill},
                   workspace, "fused attention forward");
    ++c.stats.forward_calls;
}

void fused_attention_backward(int device_index, cudaStream_t stream, const FusedAttentionShape & shape, const void * q,
                              const void * k, const void * v, const void * out, const void * dout, const float * lse,
                              void * dq, void * dk, void * dv, float scale, void * workspace) {
    Cache &                     c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    const Plan &                p = plan_locked(c, device_index, shape, true);
    float                       fill = -std::numeric_limits<float>::infinity();
    execute_locked(c, device_index, stream, p, {kQ, kK, kKt, kVt, kO, kDO, kStats, kScale, kMaskFill, kDQ, kDK, kDV},
                   {const_cast<void *>(q), const_cast<void *>(k), const_cast<void *>(k), const_cast<void *>(v), const_cast<void *>(out),
                    const_cast<void *>(dout), const_cast<float *>(lse), &scale, &fill, dq, dk, dv},
                   workspace, "fused attention backward");
    ++c.stats.backward_calls;
}

FusedAttentionStats fused_attention_stats() {
    Cache &                     c = cache();
    std::lock_guard<std::mutex> lock(c.mutex);
    return c.stats;
}

}  // namespace loom::LOOM_CUDA_NS
