// The CUDA backend's entry point, compiled into the loom command's CUDA plugin (libloom_cuda.so, a shared
// object loaded only when a run asks for a GPU: cuda_plugin.cpp). Everything else the backend calls (core,
// comm) it takes from the loom executable that loads it, which exports them.
#include "apps/loom/gpu_backend.h"

#define LOOM_GPU_BACKEND_ENTRY cuda_backend_of_plugin
#include "apps/loom/gpu_backend.inc"

// The one symbol the loader looks up.
extern "C" __attribute__((visibility("default"))) const loom::app::GpuBackend * loom_cuda_backend() {
    return loom::app::cuda_backend_of_plugin();
}
