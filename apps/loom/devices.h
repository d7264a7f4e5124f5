// The device a command computes on, from --device (train/options.h): cpu, cuda, or auto (cuda when this
// build has the CUDA backend and a GPU is visible, else cpu). Under mpirun each process of a node takes
// the GPU of its node-local rank.
#pragma once

#include "comm/communicator.h"
#include "core/device.h"

#include <memory>
#include <string>

namespace loom::app {

// This process's rank among the processes mpirun started on its node, and their number (Open MPI, MPICH
// or Slurm's variables; 0 and 1 without a launcher).
int local_rank();
int local_size();

// The device --device names for this process. Throws naming --device when it names cuda and this build
// has no CUDA backend or no GPU is visible, or when more processes share the node's GPUs than there are
// GPUs (NCCL needs one per rank; NCCL_HOSTID set per rank lets tests share one). cuda-emu is the CUDA
// backend on the emulated device (every build has it unless configured with LOOM_CUDA_EMU=OFF); each
// process of a node takes the emulated device of its node-local rank.
Device & device_for(const std::string & choice);

// The communicators of the process groups on a GPU device (NCCL over `launcher`, of the device's backend);
// nullptr on the CPU, whose groups are the launcher's own (MPI).
std::unique_ptr<comm::CommunicatorFactory> gpu_process_groups(comm::CommunicatorFactory & launcher, Device & device);

}  // namespace loom::app
