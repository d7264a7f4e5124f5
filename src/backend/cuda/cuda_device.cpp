// The CUDA backend's Device (cuda_device.h; its Stream and Event are cuda_stream.cpp's), and the raw memory
// its caching allocators draw from: cudaMalloc for device memory, cudaHostAlloc (portable) for pinned host
// memory. Pools and statistics are core's Allocator's, the same as on the CPU.
#include "backend/cuda/cuda_device.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_ops.h"
#include "backend/cuda/cuda_stream.h"
#include "backend/cuda/fused_attention_stats.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/work_counters.h"
#include "core/graph.h"

#include <nccl.h>

#include <memory>
#include <mutex>

namespace loom::LOOM_CUDA_NS {

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

std::vector<float> fill_on_device(int64_t n, float value) {
    DeviceGuard guard(0);
    float *     device_data = nullptr;
    LOOM_CUDA_CHECK(cudaMalloc(&device_data, n * sizeof(float)));
    kernels::fill_f32(nullptr, device_data, n, value);
    std::vector<float> host(n);
    cudaError_t status = cudaGetLastError();
    if (status == cudaSuccess) status = cudaMemcpy(host.data(), device_data, n * sizeof(float), cudaMemcpyDeviceToHost);
    cudaFree(device_data);
    LOOM_CUDA_CHECK(status);
    return host;
}

// ---- DeviceGuard

DeviceGuard::DeviceGuard(int index) {
    LOOM_CUDA_CHECK(cudaGetDevice(&previous_));
    if (previous_ != index) LOOM_CUDA_CHECK(cudaSetDevice(index));
}

DeviceGuard::~DeviceGuard() {
    int current = -1;
    if (cudaGetDevice(&current) == cudaSuccess && current != previous_) cudaSetDevice(previous_);
}

// ---- Memory and the device

namespace {

// cudaMalloc, cudaFree and their pinned twins are unsafe calls in a thread-local capture: the thread that
// captures switches to relaxed mode for the call (as PyTorch's caching allocator does). An allocation made
// during a capture is not a node: the graph keeps the address, and the block stays in the graph's pool.
class RelaxedCaptureMode {
public:
    RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
    ~RelaxedCaptureMode() { cudaThreadExchangeStreamCaptureMode(&mode_); }
    RelaxedCaptureMode(const RelaxedCaptureMode &)             = delete;
    RelaxedCaptureMode & operator=(const RelaxedCaptureMode &) = delete;

private:
    cudaStreamCaptureMode mode_ = cudaStreamCaptureModeRelaxed;
};

// `allocate(&ptr)` (cudaMalloc or cudaHostAlloc) on device `index`, allowed during a capture; nullptr when out
// of memory (the allocator empties its caches and retries, then throws with its own message).
template <class Allocate> void * allocate_on(int index, Allocate && allocate) {
    DeviceGuard        guard(index);
    RelaxedCaptureMode relaxed;
    void *             ptr    = nullptr;
    const cudaError_t  status = allocate(&ptr);
    if (status == cudaErrorMemoryAllocation) {
        cudaGetLastError();   // not sticky, but leave no error for the next launch check
        return nullptr;
    }
    LOOM_CUDA_CHECK(status);
    return ptr;
}

// cudaMalloc's memory.
class DeviceMemory : public RawMemory {
public:
    explicit DeviceMemory(int index) : index_(index) {}
    void * raw_alloc(size_t bytes) override {
        ++work_counters().device_allocations;
        return allocate_on(index_, [bytes](void ** ptr) { return cudaMalloc(ptr, bytes); });
    }
    // cudaFree waits for the device; the allocator frees only cached blocks, whose last kernels completed
    // before they were cached (stream-ordered frees). Errors at exit (runtime unloaded) are ignored.
    void raw_free(void * ptr, size_t) override {
        int previous = -1;
        cudaGetDevice(&previous);
        if (previous != index_) cudaSetDevice(index_);
        RelaxedCaptureMode relaxed;
        cudaFree(ptr);
        if (previous >= 0 && previous != index_) cudaSetDevice(previous);
    }

private:
    int index_;
};

// cudaHostAlloc's pinned host memory.
class PinnedHostMemory : public RawMemory {
public:
    explicit PinnedHostMemory(int index) : index_(index) {}
    void * raw_alloc(size_t bytes) override {
        return allocate_on(index_, [bytes](void ** ptr) { return cudaHostAlloc(ptr, bytes, cudaHostAllocPortable); });
    }
    void raw_free(void * ptr, size_t) override {
        RelaxedCaptureMode relaxed;
        cudaFreeHost(ptr);
    }

private:
    int index_;
};

class CudaDevice : public Device {
public:
    explicit CudaDevice(int index)
        : index_(index),
          device_memory_(std::make_unique<DeviceMemory>(index), MemoryKind::device, "cuda:" + std::to_string(index) + " device"),
          pinned_memory_(std::make_unique<PinnedHostMemory>(index), MemoryKind::pinned_host,
                         "cuda:" + std::to_string(index) + " pinned host"),
          synchronous_(streams_synchronous_from_env()) {}

    DeviceType   type() const override { return DeviceType::cuda; }
    int          index() const override { return index_; }
    const char * kind_name() const override { return LOOM_CUDA_DEVICE_KIND; }
    std::string  product_name() const override {
        cudaDeviceProp prop{};
        return cudaGetDeviceProperties(&prop, index_) == cudaSuccess ? std::string(prop.name) : std::string();
    }

    Allocator & allocator(MemoryKind kind) override {
        return kind == MemoryKind::device ? device_memory_ : pinned_memory_;
    }

    std::unique_ptr<Stream> stream_create(const std::string & name) override {
        return std::make_unique<CudaStream>(*this, name, synchronous_);
    }

    std::unique_ptr<Event> event_create() override { return std::make_unique<CudaEvent>(index_); }

    Ops & ops() override { return cuda_ops(); }

    Stream & compute_stream() override {
        std::call_once(compute_once_, [this] { compute_ = stream_create("compute"); });
        return *compute_;
    }

    std::optional<DeviceWork> work() override {
        const GemmPlanStats       g = gemm_plan_stats();
        const FusedAttentionStats f = fused_attention_stats();
        return DeviceWork{work_counters().host_syncs.load(), work_counters().device_allocations.load(), g.lookups,
                          g.plans, g.heuristic_queries, work_counters().late_reads.load(),
                          f.forward_calls + f.backward_calls, f.plans, f.refused};
    }

private:
    int                     index_;
    Allocator               device_memory_;   // declared before the stream: destroyed after it
    Allocator               pinned_memory_;
    bool                    synchronous_;
    std::once_flag          compute_once_;
    std::unique_ptr<Stream> compute_;
};

}  // namespace

Device & device(int index) {
    static const int                                count = device_count();
    static std::vector<std::unique_ptr<CudaDevice>> devices(static_cast<size_t>(count));
    static std::mutex                               mutex;
    LOOM_CHECK(index >= 0 && index < count,
               "CUDA device " << index << " requested, but " << count << " CUDA device(s) are visible",
               "check CUDA_VISIBLE_DEVICES and nvidia-smi; a build with LOOM_CUDA=ON still needs a GPU to run CUDA work");
    std::lock_guard<std::mutex> lock(mutex);
    std::unique_ptr<CudaDevice> & slot = devices[static_cast<size_t>(index)];
    if (!slot) slot = std::make_unique<CudaDevice>(index);
    return *slot;
}

}  // namespace loom::LOOM_CUDA_NS
