// Tensor: a dtype, a shape and a window onto shared storage. No autograd, no strides.
//
// A tensor is always contiguous: element (i0, i1, ..., ik) lives at
//   storage.data + (offset + ((i0 * d1 + i1) * d2 + ... ) ) * dtype_size.
// Views share storage and never copy: view() reshapes, flatten() is view({numel}), narrow() takes a
// contiguous range along one dimension, slice() carves a shaped tensor out of a flat range. slice() is
// what the DDP buffers rely on: one flat buffer per (param dtype, grad dtype), each parameter's data and
// main_grad being shaped views into it.
//
//   Tensor buffer = Tensor::empty({1024}, DType::f32, device);          // (n)
//   Tensor w      = buffer.slice(64, {16, 32});                         // (h, 4h/...) view at 64
//   Tensor row    = w.narrow(0, 3, 1);                                  // (1, 32), still contiguous
//
// Storage frees its block through the allocator that gave it when the last tensor sharing it dies.
#pragma once

#include "core/allocator.h"
#include "core/device.h"
#include "core/dtype.h"
#include "core/error.h"

#include <cstdint>
#include <initializer_list>
#include <memory>
#include <span>
#include <string>
#include <vector>

namespace loom {

using Shape = std::vector<int64_t>;

int64_t     shape_numel(const Shape & shape);
std::string shape_string(const Shape & shape);   // "(2, 3, 4)"

class Storage {
public:
    // Allocates `bytes` from `device`'s allocator of the given memory kind, in `pool`.
    Storage(Device & device, size_t bytes, MemoryKind kind, const std::string & pool);
    // Wraps memory owned elsewhere (host memory of the CPU backend); nothing is freed.
    Storage(Device & device, void * external, size_t bytes, MemoryKind kind);
    ~Storage();
    Storage(const Storage &) = delete;
    Storage & operator=(const Storage &) = delete;

    void *     data() const { return data_; }
    size_t     nbytes() const { return nbytes_; }
    Device &   device() const { return *device_; }
    MemoryKind memory_kind() const { return kind_; }

    // Gives the block back to its pool now while this Storage keeps its address (a CUDA graph's weak
    // reference): graphs whose nodes still point here may find it handed to a later capture, which replay
    // order makes safe (core/graph.h). The destructor then frees nothing. Idempotent.
    void release_block() noexcept;
    bool block_released() const { return released_; }

    // No memory at all (Tensor::unbacked): data() is null and a tensor's data_ptr() throws.
    static std::shared_ptr<Storage> unbacked(Device & device);
    bool unbacked() const { return unbacked_; }

private:
    Device *    device_;
    Allocator * allocator_ = nullptr;   // null for external memory
    Block       block_;
    void *      data_;
    size_t      nbytes_;
    MemoryKind  kind_;
    bool        released_ = false;
    bool        unbacked_ = false;
};

struct TensorOptions {
    MemoryKind  memory_kind = MemoryKind::device;
    std::string pool        = kDefaultPool;
};

class Tensor {
public:
    Tensor() = default;

    static Tensor empty(const Shape & shape, DType dtype, Device & device, const TensorOptions & options = {});
    static Tensor zeros(const Shape & shape, DType dtype, Device & device, const TensorOptions & options = {});
    // A shape and a dtype with no memory behind them: defined(), and data_ptr() throws. What an FSDP-sharded
    // parameter's values or gradient are between uses (ddp/ddp.h); kernels queued earlier keep the memory
    // they were given alive, as with any tensor.
    static Tensor unbacked(const Shape & shape, DType dtype, Device & device);
    // A tensor over memory the caller owns and keeps alive (host memory, CPU backend).
    static Tensor from_blob(void * data, const Shape & shape, DType dtype, Device & device,
                            MemoryKind kind = MemoryKind::device);

    bool          defined() const { return storage_ != nullptr; }
    DType         dtype() const { return dtype_; }
    const Shape & shape() const { return shape_; }
    int64_t       dim() const { return static_cast<int64_t>(shape_.size()); }
    int64_t       size(int64_t d) const;   // negative d counts from the end
    int64_t       numel() const { return numel_; }
    size_t        nbytes() const { return static_cast<size_t>(numel_) * dtype_size(dtype_); }
    int64_t       offset() const { return offset_; }   // in elements, from the start of storage
    Device &      device() const;
    MemoryKind    memory_kind() const;
    // True when the host may read and write the elements: CPU memory, or pinned host memory of any device.
    bool          host_addressable() const;
    const std::shared_ptr<Storage> & storage() const { return storage_; }

    void * data_ptr() const;
    template <typename T> T * data() const {
        LOOM_CHECK(dtype_of<T>::value == dtype_,
                   "typed access as " << dtype_name(dtype_of<T>::value) << " to a " << dtype_name(dtype_)
                                      << " tensor",
                   "use data<T>() with the tensor's element type");
        return static_cast<T *>(data_ptr());
    }

    // Same storage, new shape with the same number of elements; one dimension may be -1.
    Tensor view(const Shape & shape) const;
    Tensor flatten() const;
    // Elements [start, start + length) along `dim`; the result must be contiguous, so every dimension
    // before `dim` must have size 1.
    Tensor narrow(int64_t dim, int64_t start, int64_t length) const;
    // The flat elements [offset, offset + numel(shape)) of this tensor, seen with `shape`.
    Tensor slice(int64_t offset, const Shape & shape) const;

    bool shares_storage(const Tensor & other) const { return storage_ && storage_ == other.storage_; }
    // "bfloat16(4, 8) on cpu:0 device"
    std::string describe() const;

    // Copies the elements of src (same dtype and numel) into this tensor, on the host, now. Both must be
    // host-addressable (copy_now and host_readable stage device memory).
    void copy_from(const Tensor & src);
    void fill_zero();

private:
    Tensor(std::shared_ptr<Storage> storage, int64_t offset, Shape shape, DType dtype);

    std::shared_ptr<Storage> storage_;
    int64_t                  offset_ = 0;
    Shape                    shape_;
    int64_t                  numel_  = 0;
    DType                    dtype_  = DType::f32;
};

// Host transfers for the host's side of a run (set-up, checks, logging, checkpoints; never a step's hot
// path), the same code on every backend. Host-addressable tensors are read or written in place and in
// host order, as copy_from does: the caller has synchronized whatever writes them. Device memory is read
// or written by a copy on its device's compute stream, which these synchronize.
//
//   Tensor loss = host_readable(ctx.token_loss);   // `t` itself on the CPU; a pinned copy of GPU memory
//   copy_now(bucket_view, p.main_grad);            // any memory on either side, done on return
Tensor host_readable(const Tensor & t);
void   copy_now(const Tensor & dst, const Tensor & src);
// The step's own reads, one synchronization for all of them: host_copy_async enqueues a copy of `t` into
// pinned host memory on the compute stream (`t` itself where it is host-addressable) and returns it; its
// values are there once the caller has waited for the compute stream. read_after_stream waits for the
// compute stream, then returns `t`'s values on the host: one synchronization on every backend.
Tensor host_copy_async(const Tensor & t);
Tensor read_after_stream(const Tensor & t);
// A host vector seen as a host-addressable tensor of `device` (the vector keeps the memory; nothing is
// copied), for copy_now and the communicators' host-value helpers: pageable_host memory on a GPU, which
// copies take and kernels refuse.
Tensor host_blob(std::vector<float> & values, Device & device);
// A float tensor's values as f32 on the host, and f32 host values written into a float tensor (rounded to
// its dtype): any memory, blocking as above.
std::vector<float> values_f32(const Tensor & t);
void               write_values_f32(const Tensor & t, std::span<const float> values);
// Memory the host fills and kernels of `device` read: the device's own memory on the CPU, pinned host
// memory on a GPU (a data loader's batches).
MemoryKind host_filled_kind(const Device & device);
// `t` itself when kernels of its device read it where it is (device memory, or any CPU memory); else a copy
// in device memory (activations pool) enqueued on `stream`: a loader's pinned batch on a GPU.
Tensor device_resident(const Tensor & t, Stream & stream);

}  // namespace loom
