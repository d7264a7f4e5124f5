// How kernels.cu launches kernels and declares dynamic shared memory, so the same source compiles with
// nvcc for a GPU and as host C++ for the emulated device (cuda-emu, whose cuda_runtime.h defines both):
//   LOOM_LAUNCH(kernel, grid, block, smem_bytes, stream)(args...)   kernel<<<grid, block, smem, stream>>>(args...)
//   LOOM_DYNAMIC_SHARED(float, smem);                                extern __shared__ float smem[];
#pragma once

#include <cuda_runtime.h>

#ifndef LOOM_LAUNCH
#define LOOM_LAUNCH(kernel, grid, block, smem, stream) kernel<<<(grid), (block), (smem), (stream)>>>
#endif
#ifndef LOOM_DYNAMIC_SHARED
#define LOOM_DYNAMIC_SHARED(type, name) extern __shared__ type name[]
#endif
