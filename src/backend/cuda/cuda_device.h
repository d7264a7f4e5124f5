// The CUDA backend's public surface so far (see cuda_device.cu). Built only with LOOM_CUDA=ON.
#pragma once

#include "core/error.h"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::cuda {

// Number of visible CUDA devices; 0 without a driver or a device.
int device_count();
// "CUDA runtime 13000, cuBLASLt ..., NCCL ..."
std::string versions();
// Fills n floats on device 0 with a kernel and copies them back (the smallest end-to-end check).
std::vector<float> fill_on_device(int64_t n, float value);

}  // namespace loom::cuda
