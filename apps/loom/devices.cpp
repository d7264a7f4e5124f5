#include "apps/loom/devices.h"

#include "apps/loom/gpu_backend.h"
#include "backend/cpu/cpu_device.h"
#include "core/error.h"

#include <cstdlib>
#include <cstring>

namespace loom::app {

namespace {

int first_env(std::initializer_list<const char *> names, int fallback) {
    for (const char * name : names) {
        if (const char * value = std::getenv(name); value && *value) return static_cast<int>(std::strtol(value, nullptr, 10));
    }
    return fallback;
}

int visible_gpus() {
    const GpuBackend * cuda = cuda_backend();   // loads the plugin
    return cuda != nullptr ? cuda->device_count() : 0;
}

}  // namespace

int local_rank() { return first_env({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, 0); }
int local_size() { return first_env({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}, 1); }

Device & device_for(const std::string & choice) {
    if (choice == "cuda-emu") {
        const GpuBackend * emu = cuda_emu_backend();
        LOOM_CHECK(emu != nullptr, "--device cuda-emu: this loom was built without the emulated CUDA device",
                   "configure with LOOM_CUDA_EMU=ON (the default), or give --device cpu");
        const int devices = emu->device_count();
        LOOM_CHECK(devices > 0, "--device cuda-emu: the emulator shows no device (LOOM_EMU_DEVICES=0?)",
                   "unset LOOM_EMU_DEVICES or give it a positive count");
        return emu->device(local_rank() % devices);
    }
    // auto: a GPU if the machine has an NVIDIA driver and the backend sees one; no driver, no plugin loaded.
    const bool cuda = choice == "cuda" || (choice == "auto" && nvidia_driver_present() && visible_gpus() > 0);
    if (!cuda) return cpu::device();
    const GpuBackend * backend = cuda_backend();
    LOOM_CHECK(backend != nullptr, "--device cuda: " << cuda_backend_error(),
               "build with the CUDA toolkit present (LOOM_CUDA=ON, which `make` sets when nvcc is found) and keep "
               "libloom_cuda.so beside loom, with the CUDA libraries on the loader's path; or give --device cpu "
               "(or --device cuda-emu: the CUDA backend on an emulated device)");
    const int gpus = visible_gpus();
    LOOM_CHECK(gpus > 0, "--device cuda: no CUDA device is visible",
               "check nvidia-smi and CUDA_VISIBLE_DEVICES, or give --device cpu");
    const bool shared_hosts = std::getenv("NCCL_HOSTID") != nullptr;
    LOOM_CHECK(local_size() <= gpus || shared_hosts,
               "--device cuda: " << local_size() << " ranks on this node share " << gpus << " GPU(s); NCCL needs a GPU per rank",
               "start at most " << gpus << " ranks per node (mpirun -np), or give --device cpu");
    return backend->device(local_rank() % gpus);
}

std::unique_ptr<comm::CommunicatorFactory> gpu_process_groups(comm::CommunicatorFactory & launcher, Device & device) {
    if (device.type() != DeviceType::cuda) return nullptr;
    const GpuBackend * backend = std::strcmp(device.kind_name(), "cuda-emu") == 0 ? cuda_emu_backend() : cuda_backend();
    LOOM_CHECK(backend != nullptr, "no backend of this build runs device " << device.name(), "");
    return backend->process_groups(launcher, device);
}

}  // namespace loom::app
