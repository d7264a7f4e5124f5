// kernels.cu compiled as host C++ for the emulated device: the same source the GPU build gives nvcc, with
// the emulator's cuda_runtime.h providing __global__, threadIdx, __syncthreads, LOOM_LAUNCH and the rest.
#include "backend/cuda/kernels.cu"
