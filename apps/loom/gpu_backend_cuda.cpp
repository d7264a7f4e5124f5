// The CUDA backend's entry points (gpu_backend.h); without it, cuda_backend() is nullptr.
#include "apps/loom/gpu_backend.h"

#ifdef LOOM_WITH_CUDA
#define LOOM_GPU_BACKEND_ENTRY cuda_backend
#include "apps/loom/gpu_backend.inc"
#else
namespace loom::app {
const GpuBackend * cuda_backend() { return nullptr; }
}  // namespace loom::app
#endif
