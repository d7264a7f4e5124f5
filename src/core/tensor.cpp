#include "core/tensor.h"

#include "core/graph.h"
#include "core/ops.h"

#include <cstring>
#include <sstream>

namespace loom {

int64_t shape_numel(const Shape & shape) {
    int64_t n = 1;
    for (int64_t d : shape) {
        n *= d;
    }
    return n;
}

std::string shape_string(const Shape & shape) {
    std::ostringstream os;
    os << "(";
    for (size_t i = 0; i < shape.size(); ++i) {
        os << (i ? ", " : "") << shape[i];
    }
    os << (shape.size() == 1 ? ",)" : ")");
    return os.str();
}

namespace {

void check_shape(const Shape & shape) {
    for (int64_t d : shape) {
        LOOM_CHECK(d >= 0, "negative dimension in shape " << shape_string(shape),
                   "every dimension must be >= 0");
    }
}

// The bytes of a tensor of `shape` and `dtype`, refusing a count that overflows (or passes 2^62).
size_t checked_bytes(const Shape & shape, DType dtype) {
    check_shape(shape);
    size_t bytes = dtype_size(dtype);
    for (int64_t d : shape) {
        LOOM_CHECK(!__builtin_mul_overflow(bytes, static_cast<size_t>(d), &bytes) && bytes <= (size_t(1) << 62),
                   "a tensor of shape " << shape_string(shape) << " and dtype " << dtype_name(dtype)
                                        << " is larger than any memory (its byte count overflows)",
                   "lower the sizes that make it (batch, sequence, hidden, vocabulary)");
    }
    return bytes;
}

}  // namespace

Storage::Storage(Device & device, size_t bytes, MemoryKind kind, const std::string & pool)
    : device_(&device), nbytes_(bytes), kind_(kind) {
    LOOM_CHECK(kind != MemoryKind::pageable_host, "an allocation of pageable_host memory from pool '" << pool << "'",
               "pageable host memory is the caller's own: wrap it with Tensor::from_blob, or allocate pinned_host");
    allocator_ = &device.allocator(kind);
    block_     = allocator_->allocate(bytes, pool);
    data_  = block_.ptr;
}

Storage::Storage(Device & device, void * external, size_t bytes, MemoryKind kind)
    : device_(&device), data_(external), nbytes_(bytes), kind_(kind) {}

Storage::~Storage() {   // noexcept: Allocator::deallocate never throws
    if (allocator_ != nullptr) {
        allocator_->deallocate(block_);
    }
}

void Storage::release_block() noexcept {
    if (allocator_ != nullptr) {
        allocator_->deallocate(block_);
        allocator_ = nullptr;
        released_  = true;
    }
}

std::shared_ptr<Storage> Storage::unbacked(Device & device) {
    auto storage       = std::make_shared<Storage>(device, nullptr, 0, MemoryKind::device);
    storage->unbacked_ = true;
    return storage;
}

Tensor::Tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, DType dtype)
    : storage_(std::move(storage)), offset_(offset), shape_(std::move(shape)), dtype_(dtype) {
    numel_ = shape_numel(shape_);
}

Tensor Tensor::unbacked(const Shape & shape, DType dtype, Device & device) {
    check_shape(shape);
    return Tensor(Storage::unbacked(device), 0, shape, dtype);
}

Tensor Tensor::empty(const Shape & shape, DType dtype, Device & device, const TensorOptions & options) {
    const size_t bytes = checked_bytes(shape, dtype);
    auto   storage = std::make_shared<Storage>(device, bytes, options.memory_kind, options.pool);
    // A device allocation on a capturing thread came from the graph's pool: the graph tracks it, so the
    // block returns to the pool once only graphs refer to it (Graph::collect).
    if (Graph * graph = graph_being_captured(); graph != nullptr && options.memory_kind == MemoryKind::device) {
        graph->note_allocation(storage);
    }
    return Tensor(std::move(storage), 0, shape, dtype);
}

Tensor Tensor::zeros(const Shape & shape, DType dtype, Device & device, const TensorOptions & options) {
    Tensor t = empty(shape, dtype, device, options);
    if (t.host_addressable()) {
        t.fill_zero();
    } else {   // device memory: zeroed in order on the compute stream, before any kernel there reads it
        device.ops().fill_zero(device.compute_stream(), t);
    }
    return t;
}

Tensor Tensor::from_blob(void * data, const Shape & shape, DType dtype, Device & device, MemoryKind kind) {
    const size_t bytes = checked_bytes(shape, dtype);
    auto   storage = std::make_shared<Storage>(device, data, bytes, kind);
    return Tensor(std::move(storage), 0, shape, dtype);
}

int64_t Tensor::size(int64_t d) const {
    int64_t n = dim();
    LOOM_CHECK(d >= -n && d < n, "dimension " << d << " out of range for shape " << shape_string(shape_), "");
    return shape_[d < 0 ? d + n : d];
}

Device & Tensor::device() const {
    LOOM_CHECK(defined(), "device() of an undefined tensor", "");
    return storage_->device();
}

bool Tensor::host_addressable() const {
    return device().type() == DeviceType::cpu || memory_kind() != MemoryKind::device;
}

MemoryKind Tensor::memory_kind() const {
    LOOM_CHECK(defined(), "memory_kind() of an undefined tensor", "");
    return storage_->memory_kind();
}

void * Tensor::data_ptr() const {
    LOOM_CHECK(!storage_ || !storage_->unbacked(), "a read of a tensor with no memory (an FSDP unit's values or "
                                                   "gradients outside their use: ddp/ddp.h)", "");
    if (!storage_ || storage_->data() == nullptr) {
        return nullptr;
    }
    return static_cast<char *>(storage_->data()) + offset_ * static_cast<int64_t>(dtype_size(dtype_));
}

Tensor Tensor::view(const Shape & shape) const {
    LOOM_CHECK(defined(), "view() of an undefined tensor", "");
    Shape   resolved = shape;
    int     inferred = -1;
    int64_t known    = 1;
    for (size_t i = 0; i < resolved.size(); ++i) {
        if (resolved[i] == -1) {
            LOOM_CHECK(inferred < 0, "view " << shape_string(shape) << " has more than one -1",
                       "at most one dimension can be inferred");
            inferred = static_cast<int>(i);
        } else {
            LOOM_CHECK(resolved[i] >= 0, "negative dimension in view " << shape_string(shape), "");
            known *= resolved[i];
        }
    }
    if (inferred >= 0) {
        LOOM_CHECK(known > 0 && numel_ % known == 0,
                   "cannot view " << shape_string(shape_) << " as " << shape_string(shape), "");
        resolved[inferred] = numel_ / known;
    }
    LOOM_CHECK(shape_numel(resolved) == numel_,
               "cannot view " << shape_string(shape_) << " (" << numel_ << " elements) as "
                              << shape_string(shape) << " (" << shape_numel(resolved) << " elements)",
               "a view keeps the number of elements");
    return Tensor(storage_, offset_, resolved, dtype_);
}

Tensor Tensor::flatten() const { return view({numel_}); }

Tensor Tensor::narrow(int64_t d, int64_t start, int64_t length) const {
    int64_t n = dim();
    LOOM_CHECK(d >= -n && d < n, "narrow: dimension " << d << " out of range for " << shape_string(shape_), "");
    if (d < 0) {
        d += n;
    }
    LOOM_CHECK(start >= 0 && length >= 0 && start + length <= shape_[d],
               "narrow(" << d << ", " << start << ", " << length << ") out of range for "
                         << shape_string(shape_),
               "");
    for (int64_t i = 0; i < d; ++i) {
        LOOM_CHECK(shape_[i] == 1,
                   "narrow along dimension " << d << " of " << shape_string(shape_)
                                             << " would not be contiguous",
                   "narrow along the first dimension whose size is not 1, or view() the tensor first");
    }
    int64_t inner = 1;
    for (int64_t i = d + 1; i < n; ++i) {
        inner *= shape_[i];
    }
    Shape shape = shape_;
    shape[d]    = length;
    return Tensor(storage_, offset_ + start * inner, shape, dtype_);
}

Tensor Tensor::slice(int64_t offset, const Shape & shape) const {
    check_shape(shape);
    int64_t count = shape_numel(shape);
    LOOM_CHECK(offset >= 0 && offset + count <= numel_,
               "slice of " << count << " elements at offset " << offset << " is outside a tensor of "
                           << numel_ << " elements",
               "");
    return Tensor(storage_, offset_ + offset, shape, dtype_);
}

std::string Tensor::describe() const {
    if (!defined()) {
        return "undefined tensor";
    }
    std::ostringstream os;
    os << dtype_name(dtype_) << shape_string(shape_) << " on " << device().name() << " "
       << memory_kind_name(memory_kind());
    return os.str();
}

namespace {
// copy_from and fill_zero touch memory from the host: CPU memory or pinned host memory, never a GPU's.
void check_host_access(const Tensor & t, const char * what) {
    LOOM_CHECK(!t.defined() || t.host_addressable(),
               what << " on the host of " << t.describe() << ", which the host cannot address",
               "use the device's ops (ops().copy, ops().fill_zero) on a stream, or a pinned_host tensor");
}
}  // namespace

void Tensor::copy_from(const Tensor & src) {
    LOOM_CHECK(src.dtype_ == dtype_ && src.numel_ == numel_,
               "copy_from " << src.describe() << " into " << describe(), "dtype and numel must match");
    check_host_access(*this, "copy_from");
    check_host_access(src, "copy_from");
    if (nbytes() > 0) {
        std::memmove(data_ptr(), src.data_ptr(), nbytes());
    }
}

void Tensor::fill_zero() {
    check_host_access(*this, "fill_zero");
    if (nbytes() > 0) {
        std::memset(data_ptr(), 0, nbytes());
    }
}

Tensor host_readable(const Tensor & t) {
    if (!t.defined() || t.host_addressable()) return t;
    return read_after_stream(t);   // a pinned copy, waited for
}

Tensor host_copy_async(const Tensor & t) {
    if (!t.defined() || t.host_addressable()) return t;
    Device & device = t.device();
    Tensor   pinned = Tensor::empty(t.shape(), t.dtype(), device, {MemoryKind::pinned_host});
    device.ops().copy(device.compute_stream(), t, pinned);
    return pinned;
}

Tensor read_after_stream(const Tensor & t) {
    if (!t.defined()) return t;
    const Tensor host = host_copy_async(t);
    t.device().compute_stream().synchronize();
    return host;
}

void copy_now(const Tensor & dst, const Tensor & src) {
    LOOM_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
               "copy_now " << src.describe() << " into " << dst.describe(), "dtype and numel must match");
    if (dst.host_addressable() && src.host_addressable()) {
        Tensor(dst).copy_from(src);   // a handle to the same storage
        return;
    }
    Device & device = dst.host_addressable() ? src.device() : dst.device();
    device.ops().copy(device.compute_stream(), src, dst);
    device.compute_stream().synchronize();   // `src` may be gone (or rewritten) once this returns
}

std::vector<float> values_f32(const Tensor & t) {
    const Tensor       host = host_readable(t);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    convert(host.data_ptr(), host.dtype(), values.data(), DType::f32, values.size());
    return values;
}

void write_values_f32(const Tensor & t, std::span<const float> values) {
    LOOM_CHECK(static_cast<int64_t>(values.size()) == t.numel(),
               values.size() << " values for " << t.describe(), "give one value per element");
    if (t.host_addressable()) {
        convert(values.data(), DType::f32, t.data_ptr(), t.dtype(), values.size());
        return;
    }
    Tensor pinned = Tensor::empty(t.shape(), t.dtype(), t.device(), {MemoryKind::pinned_host});
    convert(values.data(), DType::f32, pinned.data_ptr(), pinned.dtype(), values.size());
    copy_now(t, pinned);
}

Tensor host_blob(std::vector<float> & values, Device & device) {
    // A vector's memory is pageable: copies take it, kernels of a GPU cannot.
    return Tensor::from_blob(values.data(), {static_cast<int64_t>(values.size())}, DType::f32, device,
                             device.type() == DeviceType::cpu ? MemoryKind::device : MemoryKind::pageable_host);
}

MemoryKind host_filled_kind(const Device & device) {
    return device.type() == DeviceType::cpu ? MemoryKind::device : MemoryKind::pinned_host;
}

Tensor device_resident(const Tensor & t, Stream & stream) {
    if (!t.defined() || t.device().type() == DeviceType::cpu || t.memory_kind() == MemoryKind::device) return t;
    Tensor d = Tensor::empty(t.shape(), t.dtype(), t.device(), {MemoryKind::device, kActivationsPool});
    t.device().ops().copy(stream, t, d);
    return d;
}

}  // namespace loom
