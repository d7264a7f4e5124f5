// The GPU backends this build of loom holds: the CUDA backend (LOOM_WITH_CUDA_PLUGIN: a real GPU through the
// CUDA runtime, cuBLASLt and NCCL, in a plugin loaded at run time) and the emulated CUDA device (LOOM_WITH_CUDA_EMU: the same backend sources
// compiled as host C++ over the cuda-emu runtime, which runs kernels on the CPU with CUDA's semantics).
// Each is one table of entry points, compiled from gpu_backend.inc once per backend.
#pragma once

#include "comm/communicator.h"
#include "core/device.h"

#include <memory>
#include <string>

namespace loom::app {

struct GpuBackend {
    const char * kind;                  // what --device calls it: "cuda" or "cuda-emu"
    int (*device_count)();              // visible devices (0 without a driver or a GPU)
    Device & (*device)(int index);      // the process's device `index`
    // The process groups' communicators on `device`: NCCL over the launcher (MPI carries the ids).
    std::unique_ptr<comm::CommunicatorFactory> (*process_groups)(comm::CommunicatorFactory & launcher, Device & device);
};

// nullptr where this build does not hold the backend. The CUDA backend is a plugin loaded on the first call
// (cuda_plugin.cpp); cuda_backend_error() then says why it is not there.
const GpuBackend * cuda_backend();
const GpuBackend * cuda_emu_backend();
std::string        cuda_backend_error();
// Whether this machine has an NVIDIA driver (its device files): --device auto loads the CUDA plugin only then.
bool               nvidia_driver_present();

}  // namespace loom::app
