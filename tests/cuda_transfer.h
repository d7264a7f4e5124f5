// Copies between the CPU device and a CUDA device in the GPU tests, through pinned staging tensors.
#pragma once

#include "backend/cpu/cpu_device.h"
#include "core/ops.h"
#include "core/tensor.h"

namespace loom::testing {

// A CPU tensor's copy on `gpu`, enqueued on its compute stream (the stream holds the staging tensor until
// the copy has run).
inline Tensor to_gpu(const Tensor & host, Device & gpu) {
    Tensor pinned = Tensor::empty(host.shape(), host.dtype(), gpu, {MemoryKind::pinned_host});
    pinned.copy_from(host);
    Tensor d = Tensor::empty(host.shape(), host.dtype(), gpu);
    gpu.ops().copy(gpu.compute_stream(), pinned, d);
    return d;
}

// A GPU tensor's values in a CPU tensor, after everything enqueued on its device's compute stream.
inline Tensor to_cpu(const Tensor & d) {
    Device & gpu    = d.device();
    Tensor   pinned = Tensor::empty(d.shape(), d.dtype(), gpu, {MemoryKind::pinned_host});
    gpu.ops().copy(gpu.compute_stream(), d, pinned);
    gpu.compute_stream().synchronize();
    Tensor h = Tensor::empty(d.shape(), d.dtype(), cpu::device());
    h.copy_from(pinned);
    return h;
}

}  // namespace loom::testing
