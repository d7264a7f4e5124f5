// The emulated CUDA device's entry points (gpu_backend.h); without it, cuda_emu_backend() is nullptr.
#include "apps/loom/gpu_backend.h"

#ifdef LOOM_WITH_CUDA_EMU
#define LOOM_CUDA_EMU 1
#define LOOM_GPU_BACKEND_ENTRY cuda_emu_backend
#include "apps/loom/gpu_backend.inc"
#else
namespace loom::app {
const GpuBackend * cuda_emu_backend() { return nullptr; }
}  // namespace loom::app
#endif
