// The emulated device's cuDNN graph API (cuda-emu): backend descriptors built attribute by attribute,
// finalized with the checks cuDNN makes, and an execution plan that runs its operation graph on the host in
// a node on the handle's stream (ordered, captured and replayed like any kernel).
//
// The graph is interpreted, not recognised: each operation (matmul, pointwise, reduction) is computed from
// its tensors' dimensions and strides, in dependency order, so a graph that does not compute attention gives
// something other than attention here too. Arithmetic: every value in f32; non-virtual inputs widened
// exactly from their type, non-virtual outputs rounded to theirs (nearest even); virtual tensors stay f32.
// A reshape reads a virtual tensor's memory through new dimensions and strides (a transpose).
// Matmuls accumulate in k order, one multiply and one add per step. Broadcasting: an input dimension of 1
// repeats; a batch dimension of n against the output's g n (g > 1) maps output index i to input i / g (the
// way grouped-query attention shares key/value heads); a reduction's output dimension of 1 sums (or maxes)
// that dimension, one of n against an input's g n sums each group of g consecutive indices.
//
// What a GPU would refuse is refused: attributes of the wrong type or count, descriptors used before they
// are finalized, a tensor produced twice or read before anything produces it, dimensions that do not
// broadcast, a variant pack that misses a non-virtual tensor, and (at run time, as a sticky launch failure)
// data pointers outside device-addressable memory. The plan asks for a small workspace, which must be
// device memory, so callers' workspace handling is exercised.
#include <cudnn.h>

#include "half_bits.h"
#include "runtime_internal.h"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <limits>
#include <map>
#include <memory>
#include <set>
#include <stdexcept>
#include <string>
#include <vector>

namespace loom_emu {

struct DnnContext {
    cudaStream_t stream = nullptr;
};

namespace dnn_emu {   // a name of its own: the runtime's files share one unity build
using namespace half_bits;

thread_local std::string t_dnn_error;

cudnnStatus_t fail(cudnnStatus_t status, const std::string & why) {
    t_dnn_error = why;
    return status;
}

size_t attribute_element_size(cudnnBackendAttributeType_t type) {
    switch (type) {
    case CUDNN_TYPE_HANDLE:
    case CUDNN_TYPE_VOID_PTR:
    case CUDNN_TYPE_BACKEND_DESCRIPTOR: return sizeof(void *);
    case CUDNN_TYPE_INT64:
    case CUDNN_TYPE_DOUBLE: return 8;
    case CUDNN_TYPE_BOOLEAN: return sizeof(bool);
    case CUDNN_TYPE_FLOAT:
    case CUDNN_TYPE_DATA_TYPE:
    case CUDNN_TYPE_HEUR_MODE:
    case CUDNN_TYPE_POINTWISE_MODE:
    case CUDNN_TYPE_REDUCTION_OPERATOR_TYPE: return 4;
    }
    return 0;
}

size_t data_type_size(int type) {
    switch (type) {
    case CUDNN_DATA_FLOAT:
    case CUDNN_DATA_INT32: return 4;
    case CUDNN_DATA_HALF:
    case CUDNN_DATA_BFLOAT16: return 2;
    case CUDNN_DATA_INT64: return 8;
    case CUDNN_DATA_BOOLEAN: return 1;
    }
    return 0;
}

float load_value(const void * base, int type, int64_t offset) {
    switch (type) {
    case CUDNN_DATA_FLOAT: return static_cast<const float *>(base)[offset];
    case CUDNN_DATA_HALF: return f16_to_float(static_cast<const uint16_t *>(base)[offset]);
    case CUDNN_DATA_BFLOAT16: return bf16_to_float(static_cast<const uint16_t *>(base)[offset]);
    case CUDNN_DATA_INT32: return static_cast<float>(static_cast<const int32_t *>(base)[offset]);
    case CUDNN_DATA_INT64: return static_cast<float>(static_cast<const int64_t *>(base)[offset]);
    case CUDNN_DATA_BOOLEAN: return static_cast<const uint8_t *>(base)[offset] != 0 ? 1.0f : 0.0f;
    }
    return 0.0f;
}

void store_value(void * base, int type, int64_t offset, float v) {
    switch (type) {
    case CUDNN_DATA_FLOAT: static_cast<float *>(base)[offset] = v; return;
    case CUDNN_DATA_HALF: static_cast<uint16_t *>(base)[offset] = float_to_f16(v); return;
    case CUDNN_DATA_BFLOAT16: static_cast<uint16_t *>(base)[offset] = float_to_bf16(v); return;
    case CUDNN_DATA_INT32: static_cast<int32_t *>(base)[offset] = static_cast<int32_t>(v); return;
    case CUDNN_DATA_INT64: static_cast<int64_t *>(base)[offset] = static_cast<int64_t>(v); return;
    case CUDNN_DATA_BOOLEAN: static_cast<uint8_t *>(base)[offset] = v != 0.0f ? 1 : 0; return;
    }
}

std::atomic<int64_t> g_executions{0}, g_operations{0};

}  // namespace dnn_emu

// One descriptor: its attributes as set (type and raw elements), then, once finalized, what they mean.
struct DnnDescriptor {
    struct Attribute {
        cudnnBackendAttributeType_t type;
        int64_t                     count;
        std::vector<unsigned char>  bytes;
    };
    cudnnBackendDescriptorType_t   kind;
    bool                           finalized = false;
    std::map<int, Attribute>       attributes;

    // ---- finalized tensors
    int64_t              uid = 0;
    int                  data_type = 0;
    std::vector<int64_t> dims, strides;
    bool                 is_virtual = false, by_value = false;

    // ---- finalized operations: the operation's kind, its mode, its tensors (x, b, t inputs; y output)
    std::vector<DnnDescriptor *> inputs;
    DnnDescriptor *              output = nullptr;
    int                          mode   = 0;     // pointwise mode or reduction operator
    int64_t                      axis   = 0;     // GEN_INDEX's
    // ---- finalized graphs: operations in dependency order
    std::vector<DnnDescriptor *> ops;
    // ---- engine configs and plans: the graph they run
    DnnDescriptor * graph = nullptr;
    int64_t         workspace = 0;
    // ---- variant packs
    std::vector<int64_t> uids;
    std::vector<void *>  pointers;
    void *               workspace_pointer = nullptr;

    template <class T>
    bool get(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, T * out) const {
        auto it = attributes.find(name);
        if (it == attributes.end() || it->second.type != type || it->second.count != 1) return false;
        std::memcpy(out, it->second.bytes.data(), sizeof(T));
        return true;
    }
    template <class T>
    bool get_all(cudnnBackendAttributeName_t name, cudnnBackendAttributeType_t type, std::vector<T> * out) const {
        auto it = attributes.find(name);
        if (it == attributes.end() || it->second.type != type) return false;
        out->resize(static_cast<size_t>(it->second.count));
        if (!out->empty()) std::memcpy(out->data(), it->second.bytes.data(), out->size() * sizeof(T));
        return true;
    }
    bool has(cudnnBackendAttributeName_t name) const { return attributes.count(name) != 0; }
};

namespace dnn_emu {

int64_t numel(const std::vector<int64_t> & dims) {
    int64_t n = 1;
    for (int64_t d : dims) n *= d;
    return n;
}

// The offset of the element at `index` (of `out_dims`) in a tensor of `dims` and `strides`, broadcast as the
// file's head says (dims[k] == 1 repeats; out_dims[k] == g dims[k] maps i to i / g).
int64_t broadcast_offset(const std::vector<int64_t> & index, const std::vector<int64_t> & out_dims,
                         const std::vector<int64_t> & dims, const std::vector<int64_t> & strides) {
    int64_t offset = 0;
    for (size_t k = 0; k < dims.size(); ++k) {
        const int64_t i = dims[k] == out_dims[k] ? index[k] : dims[k] == 1 ? 0 : index[k] / (out_dims[k] / dims[k]);
        offset += i * strides[k];
    }
    return offset;
}

bool broadcasts_to(const std::vector<int64_t> & dims, const std::vector<int64_t> & out) {
    if (dims.size() != out.size()) return false;
    for (size_t k = 0; k < dims.size(); ++k) {
        if (dims[k] != out[k] && dims[k] != 1 && (dims[k] <= 0 || out[k] % dims[k] != 0)) return false;
    }
    return true;
}

bool next_index(std::vector<int64_t> & index, const std::vector<int64_t> & dims) {
    for (size_t k = dims.size(); k-- > 0;) {
        if (++index[k] < dims[k]) return true;
        index[k] = 0;
    }
    return false;
}

cudnnStatus_t finalize_tensor(DnnDescriptor & d) {
    int64_t alignment = 0;
    if (!d.get(CUDNN_ATTR_TENSOR_UNIQUE_ID, CUDNN_TYPE_INT64, &d.uid) ||
        !d.get(CUDNN_ATTR_TENSOR_DATA_TYPE, CUDNN_TYPE_DATA_TYPE, &d.data_type) ||
        !d.get_all(CUDNN_ATTR_TENSOR_DIMENSIONS, CUDNN_TYPE_INT64, &d.dims) ||
        !d.get_all(CUDNN_ATTR_TENSOR_STRIDES, CUDNN_TYPE_INT64, &d.strides) ||
        !d.get(CUDNN_ATTR_TENSOR_BYTE_ALIGNMENT, CUDNN_TYPE_INT64, &alignment)) {
        return fail(CUDNN_STATUS_BAD_PARAM, "tensor: unique id, data type, dimensions, strides and alignment are required");
    }
    if (d.dims.size() != d.strides.size() || d.dims.empty() || d.dims.size() > 8 || data_type_size(d.data_type) == 0 ||
        alignment <= 0) {
        return fail(CUDNN_STATUS_BAD_PARAM, "tensor " + std::to_string(d.uid) + ": bad dimensions, strides, type or alignment");
    }
    for (size_t k = 0; k < d.dims.size(); ++k) {
        if (d.dims[k] <= 0 || d.strides[k] < 0) return fail(CUDNN_STATUS_BAD_PARAM, "tensor: non-positive dimension");
    }
    if (d.has(CUDNN_ATTR_TENSOR_IS_VIRTUAL)) d.get(CUDNN_ATTR_TENSOR_IS_VIRTUAL, CUDNN_TYPE_BOOLEAN, &d.is_virtual);
    if (d.has(CUDNN_ATTR_TENSOR_IS_BY_VALUE)) d.get(CUDNN_ATTR_TENSOR_IS_BY_VALUE, CUDNN_TYPE_BOOLEAN, &d.by_value);
    if (d.by_value && (d.is_virtual || numel(d.dims) != 1)) {
        return fail(CUDNN_STATUS_BAD_PARAM, "tensor: a by-value tensor holds one element and is not virtual");
    }
    return CUDNN_STATUS_SUCCESS;
}

DnnDescriptor * tensor_attribute(const DnnDescriptor & d, cudnnBackendAttributeName_t name) {
    DnnDescriptor * t = nullptr;
    if (!d.get(name, CUDNN_TYPE_BACKEND_DESCRIPTOR, &t) || t == nullptr) return nullptr;
    if (t->kind != CUDNN_BACKEND_TENSOR_DESCRIPTOR || !t->finalized) return nullptr;
    return t;
}

bool unary_mode(int mode) {
    return mode == CUDNN_POINTWISE_EXP || mode == CUDNN_POINTWISE_LOG || mode == CUDNN_POINTWISE_NEG ||
           mode == CUDNN_POINTWISE_IDENTITY || mode == CUDNN_POINTWISE_RECIPROCAL || mode == CUDNN_POINTWISE_GEN_INDEX;
}
bool binary_mode(int mode) {
    return mode == CUDNN_POINTWISE_ADD || mode == CUDNN_POINTWISE_MUL || mode == CUDNN_POINTWISE_MIN ||
           mode == CUDNN_POINTWISE_MAX || mode == CUDNN_POINTWISE_DIV || mode == CUDNN_POINTWISE_SUB ||
           mode == CUDNN_POINTWISE_CMP_GT || mode == CUDNN_POINTWISE_CMP_GE || mode == CUDNN_POINTWISE_CMP_LT ||
           mode == CUDNN_POINTWISE_CMP_LE;
}

cudnnStatus_t finalize_pointwise_op(DnnDescriptor & d) {
    DnnDescriptor * pw = nullptr;
    if (!d.get(CUDNN_ATTR_OPERATION_POINTWISE_PW_DESCRIPTOR, CUDNN_TYPE_BACKEND_DESCRIPTOR, &pw) || pw == nullptr ||
        pw->kind != CUDNN_BACKEND_POINTWISE_DESCRIPTOR || !pw->finalized) {
        return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: a finalized pointwise descriptor is required");
    }
    d.mode = pw->mode;
    d.axis = pw->axis;
    DnnDescriptor * x = tensor_attribute(d, CUDNN_ATTR_OPERATION_POINTWISE_XDESC);
    DnnDescriptor * y = tensor_attribute(d, CUDNN_ATTR_OPERATION_POINTWISE_YDESC);
    if (x == nullptr || y == nullptr) return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: x and y are required");
    d.inputs = {x};
    if (!unary_mode(d.mode)) {
        DnnDescriptor * b = tensor_attribute(d, CUDNN_ATTR_OPERATION_POINTWISE_BDESC);
        if (b == nullptr) return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: its mode needs b");
        d.inputs.push_back(b);
        if (d.mode == CUDNN_POINTWISE_BINARY_SELECT) {
            DnnDescriptor * t = tensor_attribute(d, CUDNN_ATTR_OPERATION_POINTWISE_TDESC);
            if (t == nullptr) return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: binary select needs t");
            d.inputs.push_back(t);
        }
    }
    d.output = y;
    for (DnnDescriptor * in : d.inputs) {
        if (!broadcasts_to(in->dims, y->dims)) {
            return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: tensor " + std::to_string(in->uid) +
                                                    " does not broadcast to " + std::to_string(y->uid));
        }
    }
    if (d.mode == CUDNN_POINTWISE_GEN_INDEX && (d.axis < 0 || d.axis >= static_cast<int64_t>(y->dims.size()))) {
        return fail(CUDNN_STATUS_BAD_PARAM, "pointwise operation: GEN_INDEX's axis is out of range");
    }
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalize_matmul_op(DnnDescriptor & d) {
    DnnDescriptor * a = tensor_attribute(d, CUDNN_ATTR_OPERATION_MATMUL_ADESC);
    DnnDescriptor * b = tensor_attribute(d, CUDNN_ATTR_OPERATION_MATMUL_BDESC);
    DnnDescriptor * c = tensor_attribute(d, CUDNN_ATTR_OPERATION_MATMUL_CDESC);
    DnnDescriptor * m = nullptr;
    if (a == nullptr || b == nullptr || c == nullptr ||
        !d.get(CUDNN_ATTR_OPERATION_MATMUL_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &m) || m == nullptr ||
        m->kind != CUDNN_BACKEND_MATMUL_DESCRIPTOR || !m->finalized) {
        return fail(CUDNN_STATUS_BAD_PARAM, "matmul operation: a, b, c and a finalized matmul descriptor are required");
    }
    const size_t r = c->dims.size();
    if (r < 2 || a->dims.size() != r || b->dims.size() != r || a->dims[r - 1] != b->dims[r - 2] ||
        a->dims[r - 2] != c->dims[r - 2] || b->dims[r - 1] != c->dims[r - 1]) {
        return fail(CUDNN_STATUS_BAD_PARAM, "matmul operation: a (.., m, k), b (.., k, n) and c (.., m, n) disagree");
    }
    for (size_t k = 0; k + 2 < r; ++k) {
        for (const DnnDescriptor * in : {a, b}) {
            if (in->dims[k] != c->dims[k] && in->dims[k] != 1 && c->dims[k] % in->dims[k] != 0) {
                return fail(CUDNN_STATUS_BAD_PARAM, "matmul operation: batch dimensions do not broadcast");
            }
        }
    }
    d.inputs = {a, b};
    d.output = c;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t finalize_reduction_op(DnnDescriptor & d) {
    DnnDescriptor * x = tensor_attribute(d, CUDNN_ATTR_OPERATION_REDUCTION_XDESC);
    DnnDescriptor * y = tensor_attribute(d, CUDNN_ATTR_OPERATION_REDUCTION_YDESC);
    DnnDescriptor * r = nullptr;
    if (x == nullptr || y == nullptr || !d.get(CUDNN_ATTR_OPERATION_REDUCTION_DESC, CUDNN_TYPE_BACKEND_DESCRIPTOR, &r) ||
        r == nullptr || r->kind != CUDNN_BACKEND_REDUCTION_DESCRIPTOR || !r->finalized) {
        return fail(CUDNN_STATUS_BAD_PARAM, "reduction operation: x, y and a finalized reduction descriptor are required");
    }
    if (!broadcasts_to(y->dims, x->dims)) {
        return fail(CUDNN_STATUS_BAD_PARAM, "reduction operation: y's dimensions do not divide x's");
    }
    d.mode   = r->mode;
    d.inputs = {x};
    d.output = y;
    return CUDNN_STATUS_SUCCESS;
}

// A reshape reads x's memory through y's dimensions and strides: both virtual (dense x), the same number of
// elements, y's strides a permutation of a dense layout (a transpose).
cudnnStatus_t finalize_reshape_op(DnnDescriptor & d) {
    DnnDescriptor * x = tensor_attribute(d, CUDNN_ATTR_OPERATION_RESHAPE_XDESC);
    DnnDescriptor * y = tensor_attribute(d, CUDNN_ATTR_OPERATION_RESHAPE_YDESC);
    if (x == nullptr || y == nullptr) return fail(CUDNN_STATUS_BAD_PARAM, "reshape operation: x and y are required");
    if (!x->is_virtual || !y->is_virtual || numel(x->dims) != numel(y->dims)) {
        return fail(CUDNN_STATUS_NOT_SUPPORTED, "reshape operation: only a view of a virtual tensor is emulated");
    }
    int64_t extent = 1;
    for (size_t k = 0; k < y->dims.size(); ++k) extent += (y->dims[k] - 1) * y->strides[k];
    if (extent != numel(x->dims)) return fail(CUDNN_STATUS_BAD_PARAM, "reshape operation: y's strides leave x's memory");
    d.inputs = {x};
    d.output = y;
    return CUDNN_STATUS_SUCCESS;
}

// The graph's operations in dependency order: an operation runs once every tensor it reads is either not
// produced inside the graph (an input) or produced by an operation already placed. A virtual tensor must be
// produced; no tensor may be produced twice.
cudnnStatus_t finalize_graph(DnnDescriptor & d) {
    DnnContext * handle = nullptr;
    std::vector<DnnDescriptor *> ops;
    if (!d.get(CUDNN_ATTR_OPERATIONGRAPH_HANDLE, CUDNN_TYPE_HANDLE, &handle) || handle == nullptr ||
        !d.get_all(CUDNN_ATTR_OPERATIONGRAPH_OPS, CUDNN_TYPE_BACKEND_DESCRIPTOR, &ops) || ops.empty()) {
        return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: a handle and operations are required");
    }
    std::map<int64_t, DnnDescriptor *> producer;
    for (DnnDescriptor * op : ops) {
        if (op == nullptr || !op->finalized || op->output == nullptr) {
            return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: every operation must be finalized");
        }
        if (!producer.emplace(op->output->uid, op).second) {
            return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: tensor " + std::to_string(op->output->uid) + " is produced twice");
        }
    }
    // One unique id, one tensor: two descriptors of an id must agree on everything.
    std::map<int64_t, const DnnDescriptor *> by_uid;
    for (DnnDescriptor * op : ops) {
        std::vector<DnnDescriptor *> tensors = op->inputs;
        tensors.push_back(op->output);
        for (const DnnDescriptor * t : tensors) {
            const DnnDescriptor * seen = by_uid.emplace(t->uid, t).first->second;
            if (seen->dims != t->dims || seen->strides != t->strides || seen->data_type != t->data_type ||
                seen->is_virtual != t->is_virtual || seen->by_value != t->by_value) {
                return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: two different tensors share unique id " + std::to_string(t->uid));
            }
        }
    }
    std::set<DnnDescriptor *> placed;
    d.ops.clear();
    while (d.ops.size() < ops.size()) {
        bool progress = false;
        for (DnnDescriptor * op : ops) {
            if (placed.count(op) != 0) continue;
            bool ready = true;
            for (DnnDescriptor * in : op->inputs) {
                auto it = producer.find(in->uid);
                if (it == producer.end()) {
                    if (in->is_virtual) {
                        return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: virtual tensor " + std::to_string(in->uid) +
                                                                " is read but never produced");
                    }
                } else if (placed.count(it->second) == 0) {
                    ready = false;
                }
            }
            if (!ready) continue;
            placed.insert(op);
            d.ops.push_back(op);
            progress = true;
        }
        if (!progress) return fail(CUDNN_STATUS_BAD_PARAM, "operation graph: its operations form a cycle");
    }
    return CUDNN_STATUS_SUCCESS;
}

// ---- Execution: every tensor's values as f32, dense in its dimensions' row-major order.

struct Values {
    std::vector<int64_t> dims;
    std::vector<float>   v;
};

struct Run {
    std::map<int64_t, void *>   pointers;   // non-virtual tensors' data
    std::map<int64_t, float>    scalars;    // by-value tensors' values, read when the graph was enqueued
    std::map<int64_t, Values>   values;     // every tensor computed or read so far
};

std::vector<int64_t> dense_strides(const std::vector<int64_t> & dims) {
    std::vector<int64_t> s(dims.size(), 1);
    for (size_t k = dims.size(); k-- > 1;) s[k - 1] = s[k] * dims[k];
    return s;
}

const Values & read(Run & run, const DnnDescriptor & t) {
    auto it = run.values.find(t.uid);
    if (it != run.values.end()) return it->second;
    Values & out = run.values[t.uid];
    out.dims     = t.dims;
    out.v.resize(static_cast<size_t>(numel(t.dims)));
    if (t.by_value) {
        out.v[0] = run.scalars.at(t.uid);
        return out;
    }
    const void *         base = run.pointers.at(t.uid);
    std::vector<int64_t> index(t.dims.size(), 0);
    size_t               n = 0;
    do {
        int64_t offset = 0;
        for (size_t k = 0; k < index.size(); ++k) offset += index[k] * t.strides[k];
        out.v[n++] = load_value(base, t.data_type, offset);
    } while (next_index(index, t.dims));
    return out;
}

void write(Run & run, const DnnDescriptor & t, Values computed) {
    if (!t.is_virtual) {
        void *               base = run.pointers.at(t.uid);
        std::vector<int64_t> index(t.dims.size(), 0);
        size_t               n = 0;
        do {
            int64_t offset = 0;
            for (size_t k = 0; k < index.size(); ++k) offset += index[k] * t.strides[k];
            store_value(base, t.data_type, offset, computed.v[n]);
            computed.v[n] = load_value(base, t.data_type, offset);   // readers see the stored (rounded) value
            ++n;
        } while (next_index(index, t.dims));
    }
    run.values[t.uid] = std::move(computed);
}

float pointwise(int mode, float x, float b, float t) {
    switch (mode) {
    case CUDNN_POINTWISE_ADD: return x + b;
    case CUDNN_POINTWISE_MUL: return x * b;
    case CUDNN_POINTWISE_MIN: return std::min(x, b);
    case CUDNN_POINTWISE_MAX: return std::max(x, b);
    case CUDNN_POINTWISE_DIV: return x / b;
    case CUDNN_POINTWISE_SUB: return x - b;
    case CUDNN_POINTWISE_EXP: return std::exp(x);
    case CUDNN_POINTWISE_LOG: return std::log(x);
    case CUDNN_POINTWISE_NEG: return -x;
    case CUDNN_POINTWISE_IDENTITY: return x;
    case CUDNN_POINTWISE_RECIPROCAL: return 1.0f / x;
    case CUDNN_POINTWISE_CMP_GT: return x > b ? 1.0f : 0.0f;
    case CUDNN_POINTWISE_CMP_GE: return x >= b ? 1.0f : 0.0f;
    case CUDNN_POINTWISE_CMP_LT: return x < b ? 1.0f : 0.0f;
    case CUDNN_POINTWISE_CMP_LE: return x <= b ? 1.0f : 0.0f;
    case CUDNN_POINTWISE_BINARY_SELECT: return t != 0.0f ? x : b;
    }
    throw std::runtime_error("cudnn emulation: pointwise mode " + std::to_string(mode));
}

void run_pointwise(Run & run, const DnnDescriptor & op) {
    const DnnDescriptor & y = *op.output;
    std::vector<const Values *> in;
    for (const DnnDescriptor * t : op.inputs) in.push_back(&read(run, *t));
    std::vector<std::vector<int64_t>> in_strides;
    for (const Values * v : in) in_strides.push_back(dense_strides(v->dims));
    Values out{y.dims, std::vector<float>(static_cast<size_t>(numel(y.dims)))};
    std::vector<int64_t> index(y.dims.size(), 0);
    size_t               n = 0;
    do {
        float a[3] = {0.0f, 0.0f, 0.0f};
        for (size_t i = 0; i < in.size(); ++i) {
            a[i] = in[i]->v[static_cast<size_t>(broadcast_offset(index, y.dims, in[i]->dims, in_strides[i]))];
        }
        out.v[n++] = op.mode == CUDNN_POINTWISE_GEN_INDEX ? static_cast<float>(index[static_cast<size_t>(op.axis)])
                                                           : pointwise(op.mode, a[0], a[1], a[2]);
    } while (next_index(index, y.dims));
    write(run, y, std::move(out));
}

void run_matmul(Run & run, const DnnDescriptor & op) {
    const DnnDescriptor & c  = *op.output;
    const Values &        a  = read(run, *op.inputs[0]);
    const Values &        b  = read(run, *op.inputs[1]);
    const size_t          r  = c.dims.size();
    const int64_t         m = c.dims[r - 2], n = c.dims[r - 1], k = a.dims[r - 1];
    const std::vector<int64_t> as = dense_strides(a.dims), bs = dense_strides(b.dims);
    Values out{c.dims, std::vector<float>(static_cast<size_t>(numel(c.dims)))};
    std::vector<int64_t> batch_dims(c.dims.begin(), c.dims.end() - 2);
    // The operands' batch dimensions, with c's matrix dimensions (index 0 there) for the offsets.
    std::vector<int64_t> a_batch = a.dims, b_batch = b.dims;
    std::copy(c.dims.end() - 2, c.dims.end(), a_batch.end() - 2);
    std::copy(c.dims.end() - 2, c.dims.end(), b_batch.end() - 2);
    std::vector<int64_t> index(r, 0);
    size_t               o = 0;
    for (;;) {
        std::vector<int64_t> ai = index, bi = index;
        ai[r - 2] = ai[r - 1] = bi[r - 2] = bi[r - 1] = 0;
        const int64_t a0 = broadcast_offset(ai, c.dims, a_batch, as), b0 = broadcast_offset(bi, c.dims, b_batch, bs);
        for (int64_t i = 0; i < m; ++i) {
            for (int64_t j = 0; j < n; ++j) {
                float acc = 0.0f;
                for (int64_t p = 0; p < k; ++p) {
                    const float prod = a.v[static_cast<size_t>(a0 + i * as[r - 2] + p * as[r - 1])] *
                                       b.v[static_cast<size_t>(b0 + p * bs[r - 2] + j * bs[r - 1])];
                    acc += prod;
                }
                out.v[o++] = acc;
            }
        }
        if (batch_dims.empty()) break;
        std::vector<int64_t> bidx(index.begin(), index.end() - 2);
        if (!next_index(bidx, batch_dims)) break;
        std::copy(bidx.begin(), bidx.end(), index.begin());
    }
    write(run, c, std::move(out));
}

void run_reshape(Run & run, const DnnDescriptor & op) {
    const DnnDescriptor & y = *op.output;
    const Values &        x = read(run, *op.inputs[0]);   // dense: its memory offset is its index
    Values out{y.dims, std::vector<float>(static_cast<size_t>(numel(y.dims)))};
    std::vector<int64_t> index(y.dims.size(), 0);
    size_t               n = 0;
    do {
        int64_t offset = 0;
        for (size_t k = 0; k < index.size(); ++k) offset += index[k] * y.strides[k];
        out.v[n++] = x.v[static_cast<size_t>(offset)];
    } while (next_index(index, y.dims));
    run.values[y.uid] = std::move(out);
}

void run_reduction(Run & run, const DnnDescriptor & op) {
    const DnnDescriptor & y  = *op.output;
    const Values &        x  = read(run, *op.inputs[0]);
    const bool            max = op.mode == CUDNN_REDUCE_TENSOR_MAX;
    Values out{y.dims, std::vector<float>(static_cast<size_t>(numel(y.dims)),
                                          max ? -std::numeric_limits<float>::infinity() : 0.0f)};
    const std::vector<int64_t> ys = dense_strides(y.dims);
    std::vector<int64_t>       index(x.dims.size(), 0);
    size_t                     n = 0;
    do {   // in x's row-major order: each output's terms in increasing index order
        float &     acc = out.v[static_cast<size_t>(broadcast_offset(index, x.dims, y.dims, ys))];
        const float v   = x.v[n++];
        acc             = max ? std::max(acc, v) : acc + v;
    } while (next_index(index, x.dims));
    write(run, y, std::move(out));
}

}  // namespace dnn_emu

// ---- API

using namespace dnn_emu;

size_t cudnnGetVersion() { return 91000; }

const char * cudnnGetErrorString(cudnnStatus_t status) {
    switch (status) {
    case CUDNN_STATUS_SUCCESS: return "CUDNN_STATUS_SUCCESS";
    case CUDNN_STATUS_NOT_INITIALIZED: return "CUDNN_STATUS_NOT_INITIALIZED";
    case CUDNN_STATUS_BAD_PARAM: return "CUDNN_STATUS_BAD_PARAM";
    case CUDNN_STATUS_NOT_SUPPORTED: return "CUDNN_STATUS_NOT_SUPPORTED";
    case CUDNN_STATUS_INTERNAL_ERROR: return "CUDNN_STATUS_INTERNAL_ERROR";
    case CUDNN_STATUS_EXECUTION_FAILED: return "CUDNN_STATUS_EXECUTION_FAILED";
    }
    return "CUDNN_STATUS_UNKNOWN";
}

void cudnnGetLastErrorString(char * message, size_t max_size) {
    if (message == nullptr || max_size == 0) return;
    const size_t n = std::min(max_size - 1, t_dnn_error.size());
    std::memcpy(message, t_dnn_error.data(), n);
    message[n] = '\0';
    t_dnn_error.clear();
}

cudnnStatus_t cudnnCreate(cudnnHandle_t * handle) {
    if (handle == nullptr) return CUDNN_STATUS_BAD_PARAM;
    *handle = new DnnContext{};
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnDestroy(cudnnHandle_t handle) {
    if (handle == nullptr) return CUDNN_STATUS_BAD_PARAM;
    delete handle;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnSetStream(cudnnHandle_t handle, cudaStream_t stream) {
    if (handle == nullptr) return CUDNN_STATUS_BAD_PARAM;
    handle->stream = stream;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendCreateDescriptor(cudnnBackendDescriptorType_t descriptorType,
                                           cudnnBackendDescriptor_t * descriptor) {
    if (descriptor == nullptr) return CUDNN_STATUS_BAD_PARAM;
    switch (descriptorType) {
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR:
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR:
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR:
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR:
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR:
    case CUDNN_BACKEND_MATMUL_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR:
    case CUDNN_BACKEND_REDUCTION_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR:
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: break;
    default: return fail(CUDNN_STATUS_NOT_SUPPORTED, "descriptor type " + std::to_string(descriptorType) + " is not emulated");
    }
    *descriptor       = new DnnDescriptor{};
    (*descriptor)->kind = descriptorType;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendDestroyDescriptor(cudnnBackendDescriptor_t descriptor) {
    if (descriptor == nullptr) return CUDNN_STATUS_BAD_PARAM;
    delete descriptor;
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendSetAttribute(cudnnBackendDescriptor_t descriptor, cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType, int64_t elementCount,
                                       const void * arrayOfElements) {
    if (descriptor == nullptr || elementCount < 0 || (elementCount > 0 && arrayOfElements == nullptr)) {
        return CUDNN_STATUS_BAD_PARAM;
    }
    if (descriptor->finalized) return fail(CUDNN_STATUS_BAD_PARAM, "descriptor is already finalized");
    const size_t size = attribute_element_size(attributeType);
    if (size == 0) return fail(CUDNN_STATUS_NOT_SUPPORTED, "attribute type " + std::to_string(attributeType));
    DnnDescriptor::Attribute a{attributeType, elementCount, {}};
    a.bytes.resize(size * static_cast<size_t>(elementCount));
    if (elementCount > 0) std::memcpy(a.bytes.data(), arrayOfElements, a.bytes.size());
    descriptor->attributes[attributeName] = std::move(a);
    return CUDNN_STATUS_SUCCESS;
}

cudnnStatus_t cudnnBackendFinalize(cudnnBackendDescriptor_t descriptor) {
    if (descriptor == nullptr) return CUDNN_STATUS_BAD_PARAM;
    DnnDescriptor & d = *descriptor;
    if (d.finalized) return fail(CUDNN_STATUS_BAD_PARAM, "descriptor is already finalized");
    cudnnStatus_t status = CUDNN_STATUS_SUCCESS;
    switch (d.kind) {
    case CUDNN_BACKEND_TENSOR_DESCRIPTOR: status = finalize_tensor(d); break;
    case CUDNN_BACKEND_POINTWISE_DESCRIPTOR: {
        int prec = 0;
        if (!d.get(CUDNN_ATTR_POINTWISE_MODE, CUDNN_TYPE_POINTWISE_MODE, &d.mode) ||
            !d.get(CUDNN_ATTR_POINTWISE_MATH_PREC, CUDNN_TYPE_DATA_TYPE, &prec) || prec != CUDNN_DATA_FLOAT) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "pointwise: a mode and f32 math precision are required");
        } else if (!unary_mode(d.mode) && !binary_mode(d.mode) && d.mode != CUDNN_POINTWISE_BINARY_SELECT) {
            status = fail(CUDNN_STATUS_NOT_SUPPORTED, "pointwise mode " + std::to_string(d.mode) + " is not emulated");
        } else if (d.mode == CUDNN_POINTWISE_GEN_INDEX && !d.get(CUDNN_ATTR_POINTWISE_AXIS, CUDNN_TYPE_INT64, &d.axis)) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "pointwise: GEN_INDEX needs an axis");
        }
        break;
    }
    case CUDNN_BACKEND_MATMUL_DESCRIPTOR: {
        int comp = 0;
        if (!d.get(CUDNN_ATTR_MATMUL_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &comp) || comp != CUDNN_DATA_FLOAT) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "matmul: an f32 compute type is required");
        }
        break;
    }
    case CUDNN_BACKEND_REDUCTION_DESCRIPTOR: {
        int comp = 0;
        if (!d.get(CUDNN_ATTR_REDUCTION_OPERATOR, CUDNN_TYPE_REDUCTION_OPERATOR_TYPE, &d.mode) ||
            !d.get(CUDNN_ATTR_REDUCTION_COMP_TYPE, CUDNN_TYPE_DATA_TYPE, &comp) || comp != CUDNN_DATA_FLOAT ||
            (d.mode != CUDNN_REDUCE_TENSOR_ADD && d.mode != CUDNN_REDUCE_TENSOR_MAX)) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "reduction: ADD or MAX and an f32 compute type are required");
        }
        break;
    }
    case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: status = finalize_pointwise_op(d); break;
    case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: status = finalize_matmul_op(d); break;
    case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: status = finalize_reduction_op(d); break;
    case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: status = finalize_reshape_op(d); break;
    case CUDNN_BACKEND_OPERATIONGRAPH_DESCRIPTOR: status = finalize_graph(d); break;
    case CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR: {
        int mode = 0;
        if (!d.get(CUDNN_ATTR_ENGINEHEUR_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d.graph) || d.graph == nullptr ||
            !d.graph->finalized || !d.get(CUDNN_ATTR_ENGINEHEUR_MODE, CUDNN_TYPE_HEUR_MODE, &mode)) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "engine heuristic: a finalized graph and a mode are required");
        }
        break;
    }
    case CUDNN_BACKEND_ENGINE_DESCRIPTOR:
        if (!d.get(CUDNN_ATTR_ENGINE_OPERATION_GRAPH, CUDNN_TYPE_BACKEND_DESCRIPTOR, &d.graph) || d.graph == nullptr ||
            !d.graph->finalized) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "engine: a finalized graph is required");
        }
        break;
    case CUDNN_BACKEND_ENGINECFG_DESCRIPTOR: {
        DnnDescriptor * engine = nullptr;
        if (d.graph == nullptr) {   // not filled by the heuristic: built from an engine
            if (!d.get(CUDNN_ATTR_ENGINECFG_ENGINE, CUDNN_TYPE_BACKEND_DESCRIPTOR, &engine) || engine == nullptr ||
                !engine->finalized) {
                status = fail(CUDNN_STATUS_BAD_PARAM, "engine config: a finalized engine is required");
                break;
            }
            d.graph = engine->graph;
        }
        break;
    }
    case CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR: {
        DnnDescriptor * config = nullptr;
        DnnContext *    handle = nullptr;
        if (!d.get(CUDNN_ATTR_EXECUTION_PLAN_HANDLE, CUDNN_TYPE_HANDLE, &handle) || handle == nullptr ||
            !d.get(CUDNN_ATTR_EXECUTION_PLAN_ENGINE_CONFIG, CUDNN_TYPE_BACKEND_DESCRIPTOR, &config) || config == nullptr ||
            !config->finalized || config->graph == nullptr) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "execution plan: a handle and a finalized engine config are required");
            break;
        }
        d.graph     = config->graph;
        d.workspace = 256 * static_cast<int64_t>(d.graph->ops.size());   // checked to be device memory at run
        break;
    }
    case CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR: {
        if (!d.get_all(CUDNN_ATTR_VARIANT_PACK_UNIQUE_IDS, CUDNN_TYPE_INT64, &d.uids) ||
            !d.get_all(CUDNN_ATTR_VARIANT_PACK_DATA_POINTERS, CUDNN_TYPE_VOID_PTR, &d.pointers) ||
            d.uids.size() != d.pointers.size()) {
            status = fail(CUDNN_STATUS_BAD_PARAM, "variant pack: as many data pointers as unique ids are required");
            break;
        }
        if (d.has(CUDNN_ATTR_VARIANT_PACK_WORKSPACE)) {
            d.get(CUDNN_ATTR_VARIANT_PACK_WORKSPACE, CUDNN_TYPE_VOID_PTR, &d.workspace_pointer);
        }
        break;
    }
    default: status = CUDNN_STATUS_NOT_SUPPORTED;
    }
    if (status == CUDNN_STATUS_SUCCESS) d.finalized = true;
    return status;
}

cudnnStatus_t cudnnBackendGetAttribute(cudnnBackendDescriptor_t descriptor, cudnnBackendAttributeName_t attributeName,
                                       cudnnBackendAttributeType_t attributeType, int64_t requestedElementCount,
                                       int64_t * elementCount, void * arrayOfElements) {
    if (descriptor == nullptr || !descriptor->finalized) return CUDNN_STATUS_BAD_PARAM;
    DnnDescriptor & d = *descriptor;
    if (d.kind == CUDNN_BACKEND_ENGINEHEUR_DESCRIPTOR && attributeName == CUDNN_ATTR_ENGINEHEUR_RESULTS &&
        attributeType == CUDNN_TYPE_BACKEND_DESCRIPTOR) {
        // One engine: the interpreter. The caller created the config descriptors the results are written to.
        if (elementCount != nullptr) *elementCount = 1;
        if (requestedElementCount >= 1 && arrayOfElements != nullptr) {
            DnnDescriptor * config = static_cast<DnnDescriptor **>(arrayOfElements)[0];
            if (config == nullptr || config->kind != CUDNN_BACKEND_ENGINECFG_DESCRIPTOR) return CUDNN_STATUS_BAD_PARAM;
            config->graph     = d.graph;
            config->finalized = true;
        }
        return CUDNN_STATUS_SUCCESS;
    }
    if (d.kind == CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR && attributeName == CUDNN_ATTR_EXECUTION_PLAN_WORKSPACE_SIZE &&
        attributeType == CUDNN_TYPE_INT64 && requestedElementCount >= 1 && arrayOfElements != nullptr) {
        if (elementCount != nullptr) *elementCount = 1;
        *static_cast<int64_t *>(arrayOfElements) = d.workspace;
        return CUDNN_STATUS_SUCCESS;
    }
    return fail(CUDNN_STATUS_NOT_SUPPORTED, "attribute " + std::to_string(attributeName) + " is not readable here");
}

cudnnStatus_t cudnnBackendExecute(cudnnHandle_t handle, cudnnBackendDescriptor_t executionPlan,
                                  cudnnBackendDescriptor_t variantPack) {
    if (handle == nullptr) return CUDNN_STATUS_NOT_INITIALIZED;
    if (executionPlan == nullptr || variantPack == nullptr || !executionPlan->finalized || !variantPack->finalized ||
        executionPlan->kind != CUDNN_BACKEND_EXECUTION_PLAN_DESCRIPTOR ||
        variantPack->kind != CUDNN_BACKEND_VARIANT_PACK_DESCRIPTOR) {
        return fail(CUDNN_STATUS_BAD_PARAM, "execute: a finalized plan and variant pack are required");
    }
    const DnnDescriptor & plan = *executionPlan;
    const DnnDescriptor & pack = *variantPack;
    if (plan.workspace > 0 && (pack.workspace_pointer == nullptr ||
                               !device_accessible(pack.workspace_pointer, static_cast<size_t>(plan.workspace)))) {
        return fail(CUDNN_STATUS_BAD_PARAM, "execute: the plan's workspace must be device memory of its size");
    }
    auto run = std::make_shared<Run>();
    for (size_t i = 0; i < pack.uids.size(); ++i) run->pointers[pack.uids[i]] = pack.pointers[i];
    // Every non-virtual tensor of the graph needs its pointer; by-value scalars are read now, as cuDNN reads
    // them when the call is made (and, in a capture, bakes them into the graph).
    std::vector<const DnnDescriptor *> tensors;
    for (const DnnDescriptor * op : plan.graph->ops) {
        for (const DnnDescriptor * t : op->inputs) tensors.push_back(t);
        tensors.push_back(op->output);
    }
    for (const DnnDescriptor * t : tensors) {
        if (t->is_virtual || run->scalars.count(t->uid) != 0) continue;
        auto it = run->pointers.find(t->uid);
        if (it == run->pointers.end() || it->second == nullptr) {
            return fail(CUDNN_STATUS_BAD_PARAM, "execute: the variant pack has no pointer for tensor " + std::to_string(t->uid));
        }
        if (t->by_value) run->scalars[t->uid] = load_value(it->second, t->data_type, 0);
    }
    const DnnDescriptor * graph = plan.graph;
    const cudaError_t     queued = enqueue(
        handle->stream,
        [run, graph, tensors] {
            for (const DnnDescriptor * t : tensors) {   // a kernel's illegal address: the node fails
                if (t->is_virtual || t->by_value) continue;
                int64_t extent = 1;
                for (size_t k = 0; k < t->dims.size(); ++k) extent += (t->dims[k] - 1) * t->strides[k];
                if (!device_accessible(run->pointers.at(t->uid), static_cast<size_t>(extent) * data_type_size(t->data_type))) {
                    throw std::runtime_error("cudnnBackendExecute: tensor " + std::to_string(t->uid) +
                                             " lies outside device memory");
                }
            }
            Run & r = *run;
            r.values.clear();
            for (const DnnDescriptor * op : graph->ops) {
                switch (op->kind) {
                case CUDNN_BACKEND_OPERATION_POINTWISE_DESCRIPTOR: run_pointwise(r, *op); break;
                case CUDNN_BACKEND_OPERATION_MATMUL_DESCRIPTOR: run_matmul(r, *op); break;
                case CUDNN_BACKEND_OPERATION_REDUCTION_DESCRIPTOR: run_reduction(r, *op); break;
                case CUDNN_BACKEND_OPERATION_RESHAPE_DESCRIPTOR: run_reshape(r, *op); break;
                default: throw std::runtime_error("cudnnBackendExecute: unexpected operation");
                }
            }
            g_executions.fetch_add(1);
            g_operations.fetch_add(static_cast<int64_t>(graph->ops.size()));
        },
        "cudnnBackendExecute");
    if (queued != cudaSuccess) {
        set_last_error(queued);
        return CUDNN_STATUS_EXECUTION_FAILED;
    }
    return CUDNN_STATUS_SUCCESS;
}

DnnExecutionStats cudnn_emu_stats() { return {g_executions.load(), g_operations.load()}; }

}  // namespace loom_emu
