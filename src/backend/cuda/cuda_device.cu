// The CUDA backend, first piece: status checks for CUDA, cuBLAS and NCCL generated like every other
// library check, device discovery, and a fill kernel that proves nvcc, cudart, cuBLAS(Lt) and NCCL
// compile and link. Streams, events, the caching allocator's raw memory and kernels follow with the
// issues that need them; the CPU backend is their oracle.
#include "backend/cuda/cuda_device.h"

#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>
#include <nccl.h>

namespace loom::cuda {

namespace {

const char * cublas_status_string(cublasStatus_t status) { return cublasGetStatusString(status); }

}  // namespace

#define LOOM_CUDA_CHECK(expr)                                                                          \
    LOOM_CHECK_STATUS(expr, cudaSuccess, cudaGetErrorString, "CUDA",                                   \
                      "run with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel")
#define LOOM_CUBLAS_CHECK(expr)                                                                        \
    LOOM_CHECK_STATUS(expr, CUBLAS_STATUS_SUCCESS, cublas_status_string, "cuBLAS", "")
#define LOOM_NCCL_CHECK(expr)                                                                          \
    LOOM_CHECK_STATUS(expr, ncclSuccess, ncclGetErrorString, "NCCL", "run with NCCL_DEBUG=INFO")

int device_count() {
    int count = 0;
    if (cudaGetDeviceCount(&count) != cudaSuccess) {
        cudaGetLastError();   // no driver or no device: clear the sticky error, report none
        return 0;
    }
    return count;
}

std::string versions() {
    int runtime = 0;
    LOOM_CUDA_CHECK(cudaRuntimeGetVersion(&runtime));
    int nccl = 0;
    LOOM_NCCL_CHECK(ncclGetVersion(&nccl));
    size_t cublaslt = cublasLtGetVersion();
    return "CUDA runtime " + std::to_string(runtime) + ", cuBLASLt " + std::to_string(cublaslt) + ", NCCL " +
           std::to_string(nccl);
}

namespace {

__global__ void fill_kernel(float * data, int64_t n, float value) {
    int64_t i = blockIdx.x * static_cast<int64_t>(blockDim.x) + threadIdx.x;
    if (i < n) {
        data[i] = value;
    }
}

}  // namespace

std::vector<float> fill_on_device(int64_t n, float value) {
    float * device_data = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&device_data, n * sizeof(float)));
    int threads = 256;
    int blocks  = static_cast<int>((n + threads - 1) / threads);
    fill_kernel<<<blocks, threads>>>(device_data, n, value);
    std::vector<float> host(n);
    cudaError_t status = cudaMemcpy(host.data(), device_data, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(device_data);
    LOOM_CUDA_CHECK(status);
    return host;
}

}  // namespace loom::cuda
