// What the emulated device's cuBLAS(Lt) (cublas.cpp) asks the runtime (runtime.cpp) beyond CUDA's API: the
// memory registry's answer to "may a kernel touch this range", so a GEMM given a bad pointer faults the way
// a kernel would. Private to the runtime's two files.
#pragma once

#include <cstddef>

namespace loom_emu {

// True when [p, p + bytes) lies inside one live allocation a device kernel can address (device memory, or
// pinned host memory, mapped for every device). Empty ranges are accessible.
bool device_accessible(const void * p, size_t bytes);

}  // namespace loom_emu
