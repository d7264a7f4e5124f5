// The emulated CUDA device's shared vocabulary (cuda-emu): what its runtime (cuda_runtime.h stand-in), its
// kernel engine (loom_emu/device.h) and its NCCL (nccl.h stand-in) agree on. Everything lives in namespace
// loom_emu, so a binary may also link the real CUDA runtime without a symbol clash; the stand-in headers
// bring the names into the global namespace for the backend's sources.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>

namespace loom_emu {

// The subset of CUDA's error codes the runtime stand-in returns (CUDA's own values).
enum cudaError_t : int {
    cudaSuccess                        = 0,
    cudaErrorInvalidValue              = 1,
    cudaErrorMemoryAllocation          = 2,
    cudaErrorInitializationError       = 3,
    cudaErrorInvalidConfiguration      = 9,
    cudaErrorInvalidDevicePointer      = 17,
    cudaErrorInvalidMemcpyDirection    = 21,
    cudaErrorNoDevice                  = 100,
    cudaErrorInvalidDevice             = 101,
    cudaErrorInvalidResourceHandle     = 400,
    cudaErrorNotReady                  = 600,
    cudaErrorIllegalAddress            = 700,
    cudaErrorLaunchFailure             = 719,
    cudaErrorNotSupported              = 801,
    cudaErrorStreamCaptureUnsupported  = 900,
    cudaErrorStreamCaptureInvalidated  = 901,
    cudaErrorStreamCaptureMerge        = 902,
    cudaErrorStreamCaptureUnmatched    = 903,
    cudaErrorStreamCaptureUnjoined     = 904,
    cudaErrorStreamCaptureIsolation    = 905,
    cudaErrorStreamCaptureImplicit     = 906,
    cudaErrorStreamCaptureWrongThread  = 908,
    cudaErrorUnknown                   = 999,
};

struct uint3 {
    unsigned int x, y, z;
};

struct dim3 {
    unsigned int x = 1, y = 1, z = 1;
    constexpr dim3(unsigned int vx = 1, unsigned int vy = 1, unsigned int vz = 1) : x(vx), y(vy), z(vz) {}
    constexpr dim3(uint3 v) : x(v.x), y(v.y), z(v.z) {}
    constexpr operator uint3() const { return uint3{x, y, z}; }
};

// A stream of the emulated device (defined by the runtime, runtime.cpp). nullptr is the legacy default stream.
struct StreamState;
using cudaStream_t = StreamState *;

// Runs `work` on `stream` after everything enqueued there before, asynchronously on the stream's own
// worker thread; while the stream captures, adds it to the capture as a node instead (run at each replay of
// the graph, in capture order). `name` labels the node in errors and traces. Returns cudaSuccess, or the
// error the enclosing CUDA call returns (an invalid stream, an invalidated capture). Work that throws is
// reported as cudaErrorLaunchFailure by the next synchronising call, with the exception's text on stderr.
cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, const char * name);

// The calling thread's last error, as cudaGetLastError/cudaPeekAtLastError return it: a kernel launch with
// a bad configuration records its error here (the launch itself returns nothing, as in CUDA).
void set_last_error(cudaError_t error);

// The dynamic shared memory a kernel may use, in bytes: 48 KiB unless cudaFuncSetAttribute(kernel,
// cudaFuncAttributeMaxDynamicSharedMemorySize, n) raised it (to at most kMaxSharedMemoryPerBlock).
size_t kernel_max_dynamic_smem(const void * kernel);

constexpr size_t       kDefaultSharedMemoryPerBlock = 48 * 1024;
constexpr size_t       kMaxSharedMemoryPerBlock     = 227 * 1024;   // an H100's opt-in limit
constexpr unsigned int kMaxThreadsPerBlock          = 1024;
constexpr int          kWarpSize                    = 32;

}  // namespace loom_emu
