// The CUDA backend's public surface: device discovery and the process's CUDA devices (core/device.h's
// Device on CUDA: streams, events, caching allocators over cudaMalloc and pinned host memory, and the ops
// of cuda_ops.cpp). Built only with LOOM_CUDA=ON; nothing here needs the CUDA headers.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "core/device.h"
#include "core/error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::LOOM_CUDA_NS {

// Number of visible CUDA devices; 0 without a driver or a device.
int device_count();
// "CUDA runtime 13000, cuBLASLt ..., NCCL ..."
std::string versions();
// Fills n floats on device 0 with a kernel and copies them back (the smallest end-to-end check).
std::vector<float> fill_on_device(int64_t n, float value);

// The process's CUDA device `index` ("cuda:index"), created on first use and alive until exit; throws
// naming the index when there is no such device.
Device & device(int index = 0);

}  // namespace loom::LOOM_CUDA_NS
