// LOOM_HOST_DEVICE: a function that runs on the host and, compiled by nvcc, in CUDA kernels
// (backend/cuda/kernels.cu), so both backends compute with one definition of it.
#pragma once

#if defined(__CUDACC__)
#define LOOM_HOST_DEVICE __host__ __device__
#else
#define LOOM_HOST_DEVICE
#endif
