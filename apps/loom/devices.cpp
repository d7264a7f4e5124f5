#include "apps/loom/devices.h"

#include "backend/cpu/cpu_device.h"
#include "core/error.h"
#ifdef LOOM_WITH_CUDA
#include "backend/cuda/cuda_device.h"
#endif

#include <cstdlib>

namespace loom::app {

namespace {

int first_env(std::initializer_list<const char *> names, int fallback) {
    for (const char * name : names) {
        if (const char * value = std::getenv(name); value && *value) return static_cast<int>(std::strtol(value, nullptr, 10));
    }
    return fallback;
}

int visible_gpus() {
#ifdef LOOM_WITH_CUDA
    return cuda::device_count();
#else
    return 0;
#endif
}

}  // namespace

int local_rank() { return first_env({"OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID", "SLURM_LOCALID"}, 0); }
int local_size() { return first_env({"OMPI_COMM_WORLD_LOCAL_SIZE", "MPI_LOCALNRANKS", "SLURM_NTASKS_PER_NODE"}, 1); }

Device & device_for(const std::string & choice) {
    const bool cuda = choice == "cuda" || (choice == "auto" && visible_gpus() > 0);
    if (!cuda) return cpu::device();
#ifndef LOOM_WITH_CUDA
    LOOM_THROW("--device cuda: this loom was built without the CUDA backend",
               "build with the CUDA toolkit present (LOOM_CUDA=ON, which `make` sets when nvcc is found), or give --device cpu");
#else
    const int gpus = visible_gpus();
    LOOM_CHECK(gpus > 0, "--device cuda: no CUDA device is visible",
               "check nvidia-smi and CUDA_VISIBLE_DEVICES, or give --device cpu");
    const bool shared_hosts = std::getenv("NCCL_HOSTID") != nullptr;
    LOOM_CHECK(local_size() <= gpus || shared_hosts,
               "--device cuda: " << local_size() << " ranks on this node share " << gpus << " GPU(s); NCCL needs a GPU per rank",
               "start at most " << gpus << " ranks per node (mpirun -np), or give --device cpu");
    return cuda::device(local_rank() % gpus);
#endif
}

}  // namespace loom::app
