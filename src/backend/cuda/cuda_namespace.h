// Where the CUDA backend's sources put their names. The GPU build compiles them into loom::cuda (and the
// NCCL communicator into loom::comm::on_cuda); the emulated device compiles the same sources as host C++ with
// LOOM_CUDA_EMU defined, into loom::cuda_emu (loom::comm::on_cuda_emu), so one binary holds both backends
// without a clash. The communicator's namespace is inline: callers name its classes comm::NcclContext
// either way. LOOM_CUDA_DEVICE_KIND is what the device calls itself ("cuda:0", "cuda-emu:0").
#pragma once

#if defined(LOOM_CUDA_EMU)
#define LOOM_CUDA_NS cuda_emu
#define LOOM_NCCL_NS on_cuda_emu
#define LOOM_CUDA_DEVICE_KIND "cuda-emu"
#else
#define LOOM_CUDA_NS cuda
#define LOOM_NCCL_NS on_cuda
#define LOOM_CUDA_DEVICE_KIND "cuda"
#endif
