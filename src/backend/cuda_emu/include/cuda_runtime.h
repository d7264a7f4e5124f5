// The emulated device's stand-in for CUDA's runtime header (cuda-emu). The CUDA backend's host sources
// compile against it with a host C++ compiler and run on the CPU with CUDA's semantics: streams are queues
// run in order by a worker thread each, events mark positions in them, stream capture builds graphs that
// replay their nodes, and allocations are host memory kept in a registry that knows which device owns each
// range. Names, signatures and enum values are CUDA's (runtime 12.x), declared in namespace loom_emu and
// brought into the global namespace at the end, as the real header declares them there.
//
// Only what the backend, its tests and the other cuda-emu parts use is declared; runtime.cpp defines it.
// The kernel engine (loom_emu/device.h) adds __global__, threadIdx, the launch macro and device intrinsics.
#pragma once

#include <loom_emu/base.h>

#if __has_include(<loom_emu/device.h>)
#include <loom_emu/device.h>
#endif

#include <cstddef>
#include <cstdint>

#ifndef CUDART_CB
#define CUDART_CB
#endif

#ifndef CUDART_VERSION
#define CUDART_VERSION 12080
#endif

namespace loom_emu {

// CUDA's error codes beyond base.h's subset, with CUDA's values (an enum with a fixed underlying type holds
// any int, so these are ordinary cudaError_t values).
inline constexpr cudaError_t cudaErrorInvalidPitchValue  = static_cast<cudaError_t>(12);
inline constexpr cudaError_t cudaErrorInvalidSymbol      = static_cast<cudaError_t>(13);
inline constexpr cudaError_t cudaErrorIllegalState       = static_cast<cudaError_t>(401);
inline constexpr cudaError_t cudaErrorMisalignedAddress  = static_cast<cudaError_t>(716);
inline constexpr cudaError_t cudaErrorCapturedEvent      = static_cast<cudaError_t>(907);

using cudaError = cudaError_t;

// ---- Handles (opaque; defined in runtime.cpp)

struct EventState;
struct GraphState;
struct GraphExecState;
struct GraphNodeState;

using cudaEvent_t     = EventState *;
using cudaGraph_t     = GraphState *;
using cudaGraphExec_t = GraphExecState *;
using cudaGraphNode_t = GraphNodeState *;

// ---- Flags and enums (CUDA's values)

constexpr unsigned int cudaStreamDefault     = 0x00;
constexpr unsigned int cudaStreamNonBlocking = 0x01;

constexpr unsigned int cudaEventDefault       = 0x00;
constexpr unsigned int cudaEventBlockingSync  = 0x01;
constexpr unsigned int cudaEventDisableTiming = 0x02;
constexpr unsigned int cudaEventInterprocess  = 0x04;

constexpr unsigned int cudaEventWaitDefault  = 0x00;
constexpr unsigned int cudaEventWaitExternal = 0x01;

constexpr unsigned int cudaHostAllocDefault       = 0x00;
constexpr unsigned int cudaHostAllocPortable      = 0x01;
constexpr unsigned int cudaHostAllocMapped        = 0x02;
constexpr unsigned int cudaHostAllocWriteCombined = 0x04;

constexpr unsigned long long cudaGraphInstantiateFlagAutoFreeOnLaunch = 1;
constexpr unsigned long long cudaGraphInstantiateFlagUpload           = 2;
constexpr unsigned long long cudaGraphInstantiateFlagDeviceLaunch     = 4;
constexpr unsigned long long cudaGraphInstantiateFlagUseNodePriority  = 8;

enum cudaMemcpyKind : int {
    cudaMemcpyHostToHost     = 0,
    cudaMemcpyHostToDevice   = 1,
    cudaMemcpyDeviceToHost   = 2,
    cudaMemcpyDeviceToDevice = 3,
    cudaMemcpyDefault        = 4,
};

enum cudaMemoryType : int {
    cudaMemoryTypeUnregistered = 0,
    cudaMemoryTypeHost         = 1,
    cudaMemoryTypeDevice       = 2,
    cudaMemoryTypeManaged      = 3,
};

struct cudaPointerAttributes {
    cudaMemoryType type;
    int            device;
    void *         devicePointer;
    void *         hostPointer;
};

enum cudaStreamCaptureStatus : int {
    cudaStreamCaptureStatusNone        = 0,
    cudaStreamCaptureStatusActive      = 1,
    cudaStreamCaptureStatusInvalidated = 2,
};

enum cudaStreamCaptureMode : int {
    cudaStreamCaptureModeGlobal      = 0,
    cudaStreamCaptureModeThreadLocal = 1,
    cudaStreamCaptureModeRelaxed     = 2,
};

enum cudaFuncAttribute : int {
    cudaFuncAttributeMaxDynamicSharedMemorySize    = 8,
    cudaFuncAttributePreferredSharedMemoryCarveout = 9,
};

// CUDA 12's edge data (cudaStreamGetCaptureInfo's optional out-parameter); the emulator's graphs have
// default edges only.
struct cudaGraphEdgeData {
    unsigned char from_port;
    unsigned char to_port;
    unsigned char type;
    unsigned char reserved[5];
};

// The fields of cudaDeviceProp the emulated device reports (an H100-like device).
struct cudaDeviceProp {
    char   name[256];
    size_t totalGlobalMem;
    size_t sharedMemPerBlock;
    size_t sharedMemPerBlockOptin;
    int    regsPerBlock;
    int    warpSize;
    int    maxThreadsPerBlock;
    int    maxThreadsDim[3];
    int    maxGridSize[3];
    int    multiProcessorCount;
    int    major;
    int    minor;
    int    unifiedAddressing;
};

typedef void(CUDART_CB * cudaHostFn_t)(void * userData);

// ---- Errors and versions

cudaError_t  cudaGetLastError();
cudaError_t  cudaPeekAtLastError();
const char * cudaGetErrorString(cudaError_t error);
const char * cudaGetErrorName(cudaError_t error);
cudaError_t  cudaRuntimeGetVersion(int * runtimeVersion);
cudaError_t  cudaDriverGetVersion(int * driverVersion);

// ---- Devices

cudaError_t cudaGetDeviceCount(int * count);
cudaError_t cudaSetDevice(int device);
cudaError_t cudaGetDevice(int * device);
cudaError_t cudaGetDeviceProperties(cudaDeviceProp * prop, int device);
cudaError_t cudaDeviceSynchronize();
cudaError_t cudaMemGetInfo(size_t * free, size_t * total);

// ---- Memory

cudaError_t cudaMalloc(void ** devPtr, size_t size);
cudaError_t cudaFree(void * devPtr);
cudaError_t cudaHostAlloc(void ** pHost, size_t size, unsigned int flags);
cudaError_t cudaMallocHost(void ** ptr, size_t size);
cudaError_t cudaFreeHost(void * ptr);
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes * attributes, const void * ptr);

template <typename T>
cudaError_t cudaMalloc(T ** devPtr, size_t size) {
    return cudaMalloc(reinterpret_cast<void **>(devPtr), size);
}
template <typename T>
cudaError_t cudaMallocHost(T ** ptr, size_t size) {
    return cudaMallocHost(reinterpret_cast<void **>(ptr), size);
}
template <typename T>
cudaError_t cudaHostAlloc(T ** ptr, size_t size, unsigned int flags) {
    return cudaHostAlloc(reinterpret_cast<void **>(ptr), size, flags);
}

cudaError_t cudaMemcpy(void * dst, const void * src, size_t count, cudaMemcpyKind kind);
cudaError_t cudaMemcpyAsync(void * dst, const void * src, size_t count, cudaMemcpyKind kind,
                            cudaStream_t stream = nullptr);
cudaError_t cudaMemcpy2DAsync(void * dst, size_t dpitch, const void * src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream = nullptr);
cudaError_t cudaMemset(void * devPtr, int value, size_t count);
cudaError_t cudaMemsetAsync(void * devPtr, int value, size_t count, cudaStream_t stream = nullptr);

// ---- Streams

cudaError_t cudaStreamCreate(cudaStream_t * pStream);
cudaError_t cudaStreamCreateWithFlags(cudaStream_t * pStream, unsigned int flags);
cudaError_t cudaStreamDestroy(cudaStream_t stream);
cudaError_t cudaStreamSynchronize(cudaStream_t stream);
cudaError_t cudaStreamQuery(cudaStream_t stream);
cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags = 0);
cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void * userData);

// ---- Events

cudaError_t cudaEventCreate(cudaEvent_t * event);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t * event, unsigned int flags);
cudaError_t cudaEventDestroy(cudaEvent_t event);
cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream = nullptr);
cudaError_t cudaEventQuery(cudaEvent_t event);
cudaError_t cudaEventSynchronize(cudaEvent_t event);

// ---- Stream capture and graphs

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode);
cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t * pGraph);
cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus * pCaptureStatus);
cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus * captureStatus_out,
                                     unsigned long long * id_out = nullptr, cudaGraph_t * graph_out = nullptr,
                                     const cudaGraphNode_t ** dependencies_out = nullptr,
                                     const cudaGraphEdgeData ** edgeData_out = nullptr,
                                     size_t * numDependencies_out = nullptr);
cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode * mode);
cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t * nodes, size_t * numNodes);
cudaError_t cudaGraphInstantiate(cudaGraphExec_t * pGraphExec, cudaGraph_t graph, unsigned long long flags = 0);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t * pGraphExec, cudaGraph_t graph,
                                          unsigned long long flags = 0);
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec);
cudaError_t cudaGraphDestroy(cudaGraph_t graph);

// ---- Kernel attributes

// The C form; the template below is the C++ overload kernels.cu calls with a kernel function.
cudaError_t cudaFuncSetAttribute(const void * func, cudaFuncAttribute attr, int value);

template <typename T>
cudaError_t cudaFuncSetAttribute(T * entry, cudaFuncAttribute attr, int value) {
    return cudaFuncSetAttribute(reinterpret_cast<const void *>(entry), attr, value);
}

// ---- Emulator controls (not CUDA): for tests that need a setting after the runtime has read its
// environment (LOOM_EMU_DEVICES, LOOM_EMU_MEMORY_MB).

// Sets every device's memory capacity in bytes (allocations already made keep counting against it).
void emu_set_device_memory_capacity(size_t bytes);

}  // namespace loom_emu

using namespace loom_emu;
