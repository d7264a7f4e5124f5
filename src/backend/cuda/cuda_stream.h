// CUDA streams and events behind core's Stream and Event (core/device.h).
//
//   CudaStream   a non-blocking cudaStream_t on one device. submit(host work) enqueues it with
//                cudaLaunchHostFunc; record/wait are cudaEventRecord / cudaStreamWaitEvent; synchronize is
//                cudaStreamSynchronize and rethrows the first error raised by host work since the last one.
//   CudaEvent    a cudaEvent_t created with cudaEventDisableTiming. CUDA's semantics are core's: wait and
//                synchronize refer to the last record; an event never recorded counts as complete.
//
// Stream-ordered frees. An op enqueues its kernel and hands the tensors it read or wrote to retain(): the
// stream records an event after the kernel and keeps the tensors until that event has completed (checked
// without blocking at the next retain() and at synchronize()). Only then does their memory go back to the
// caching allocator, so a block is never handed out while a kernel on any stream may still use it, and the
// caller may drop its tensors as soon as the op returns (core/ops.h).
//
// Graph capture. Loom graphs (core/graph.h) are not yet captured into CUDA graphs: while a Loom graph
// capture is active on a CUDA stream, every submit, record, wait and op launch throws naming the graph,
// rather than running work that the capture would silently miss.
//
// With LOOM_SYNC_STREAMS=1 every op synchronizes its stream after launching, so a failing kernel is
// reported by the op that launched it.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

#include <cuda_runtime.h>

#include <deque>
#include <exception>
#include <mutex>
#include <vector>

namespace loom::cuda {

// Makes `index` the calling thread's current device for the guard's lifetime.
class DeviceGuard {
public:
    explicit DeviceGuard(int index);
    ~DeviceGuard();
    DeviceGuard(const DeviceGuard &)             = delete;
    DeviceGuard & operator=(const DeviceGuard &) = delete;

private:
    int previous_ = -1;
};

class CudaEvent : public Event {
public:
    explicit CudaEvent(int device_index);
    ~CudaEvent() override;
    bool query() override;
    void synchronize() override;

    cudaEvent_t native() const { return event_; }
    int         device_index() const { return device_index_; }

private:
    cudaEvent_t event_ = nullptr;
    int         device_index_;
};

class CudaStream : public Stream {
public:
    CudaStream(Device & device, std::string name, bool synchronous);
    ~CudaStream() override;

    Device &            device() override { return device_; }
    const std::string & name() const override { return name_; }
    void submit(std::function<void()> work) override;
    void record(Event & event) override;
    void wait(Event & event) override;
    void synchronize() override;
    bool query() override;

    // The stream kernels of `op` are launched on; throws while a Loom graph capture is active on it. The
    // calling thread's current device is the stream's device afterwards.
    cudaStream_t launch(const char * op);
    // After launching `op`'s kernels: throws on a launch error, keeps `tensors` until the kernels have run
    // (see above), and synchronizes under LOOM_SYNC_STREAMS=1.
    void launched(const char * op, std::vector<Tensor> tensors);

    cudaStream_t native() const { return stream_; }
    int          device_index() const;

    // cuBLASLt's workspace for GEMMs on this stream (one per stream: GEMMs on two streams may overlap).
    void * gemm_workspace();
    static constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;

    // Host work's error path (called from the host function).
    void note_error(std::exception_ptr error);

private:
    void check_not_captured(const char * what) const;
    void reap_locked(bool all);

    struct Retained {
        cudaEvent_t         event;
        std::vector<Tensor> tensors;
    };

    Device &                 device_;
    std::string              name_;
    bool                     synchronous_;
    cudaStream_t             stream_ = nullptr;
    std::mutex               mutex_;
    std::deque<Retained>     retained_;      // oldest first
    std::vector<cudaEvent_t> free_events_;   // recycled for retain
    std::exception_ptr       error_;
    Tensor                   workspace_;     // (kGemmWorkspaceBytes) u8, created on first GEMM
};

CudaStream & as_cuda_stream(Stream & stream, const char * op);
CudaEvent &  as_cuda_event(Event & event);

}  // namespace loom::cuda
