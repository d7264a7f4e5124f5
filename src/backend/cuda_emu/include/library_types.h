// The emulated device's stand-in for CUDA's library_types.h (cuda-emu): the data types cuBLAS(Lt) and
// other CUDA libraries name their operands with, with CUDA's values.
#pragma once

namespace loom_emu {

enum cudaDataType_t : int {
    CUDA_R_16F  = 2,
    CUDA_C_16F  = 6,
    CUDA_R_16BF = 14,
    CUDA_C_16BF = 15,
    CUDA_R_32F  = 0,
    CUDA_C_32F  = 4,
    CUDA_R_64F  = 1,
    CUDA_C_64F  = 5,
    CUDA_R_8I   = 3,
    CUDA_R_8U   = 8,
    CUDA_R_32I  = 10,
    CUDA_R_32U  = 12,
};
using cudaDataType = cudaDataType_t;

}  // namespace loom_emu

using namespace loom_emu;
