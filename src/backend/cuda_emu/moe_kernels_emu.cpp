// moe_kernels.cu compiled as host C++ for the emulated device (as kernels_emu.cpp does for kernels.cu).
#include "backend/cuda/moe_kernels.cu"
