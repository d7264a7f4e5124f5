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
// Graph capture (core/graph.h). begin_capture(graph) on a CudaStream starts cudaStreamBeginCapture on its
// native stream in cudaStreamCaptureModeThreadLocal (other threads' unsafe calls stay legal; the allocator's
// cudaMalloc/cudaFree switch this thread to relaxed mode for their call, as PyTorch's caching allocator
// does). While it captures:
//   - kernels and async copies that ops launch become CUDA graph nodes; the tensors an op hands to
//     launched() are kept by the Graph (Graph::keep) instead of by the stream-ordered frees above, whose
//     events cannot be queried inside a capture;
//   - submit(host work) becomes a host node (cudaLaunchHostFunc is legal in a capture) that runs at every
//     replay; its closure is kept by the Graph (Graph::keep_work) and its errors go to the capturing stream;
//   - record(e) on the capturing stream, and a wait by another stream on it, is CUDA's fork: that stream
//     joins the capture and what ops launch on it is captured too (into the same Graph, found through the
//     thread's graph_being_captured()); the capturing stream's wait on an event that stream recorded is the
//     join. Every forked stream must be joined before end_capture() and before a replayable node (CUDA:
//     cudaErrorStreamCaptureUnjoined, reported naming the graph). A record inside a capture is an edge of the
//     CUDA graph, not a record another stream can wait on after a replay (record on the replay stream after
//     replay() for that; on the CPU the record node is re-recorded at each replay);
//   - a wait on an event last recorded outside any capture becomes an external event wait node
//     (cudaEventWaitExternal): each replay waits on the event again (CUDA's event wait node; the CPU
//     backend's replayed wait node likewise waits on the event's latest record at each replay). A wait on an event last recorded inside another capture (an earlier graph, or this one
//     before a replayable node ended its segment) is refused naming the graph and the recording stream: that
//     record was a graph edge, and nothing would be waited on;
//   - a replayable node (Stream::submit_replayable) ends the CUDA capture into a cudaGraphExec (a
//     CapturedSegment of the Graph), keeps the node, and begins the next capture. Replay launches each
//     segment with cudaGraphLaunch on the replay stream and runs each replayable node's prepare on the host
//     between them, submitting its work, in capture order;
//   - host synchronisation (Stream::synchronize, Event::synchronize) is refused by core naming the graph;
//     an allocation from a pool other than default/activations is refused by the allocator. A stream's GEMM
//     workspace and the cuBLAS handles are created when its capture begins, so a GEMM on the capturing
//     stream is legal; a forked stream that never ran a GEMM before the capture has no workspace yet and its
//     first GEMM is refused (run one GEMM on it eagerly first).
// A segment records an event after each replay; destroying the Graph waits for it before destroying the
// executable and dropping the kept tensors (so destroy graphs outside a capture). The ops that check ids on
// the device (BadIdCheck in cuda_ops.cpp) reset their device word in stream order, so each replay of a
// graph reports only the bad ids of its own inputs.
//
// With LOOM_SYNC_STREAMS=1 every op synchronizes its stream after launching, so a failing kernel is
// reported by the op that launched it (not while capturing: the capture cannot synchronize).
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "core/device.h"
#include "core/tensor.h"

#include <cuda_runtime.h>

#include <atomic>
#include <deque>
#include <memory>
#include <exception>
#include <mutex>
#include <vector>

namespace loom::LOOM_CUDA_NS {

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

    // The CUDA capture the last record was made in (0: recorded outside any capture, or never), and the
    // stream that made it: what a wait during a capture decides on (see above).
    unsigned long long  capture_id() const { return capture_id_; }
    const std::string & recorded_by() const { return recorded_by_; }
    // `enqueued` is the recording stream's count of work (CudaStream::enqueued) and `at` its value at the
    // record: a wait with work enqueued after the record is a late read, not a host synchronisation.
    void note_record(unsigned long long capture_id, const std::string & stream,
                     std::shared_ptr<const std::atomic<uint64_t>> enqueued, uint64_t at) {
        capture_id_  = capture_id;
        recorded_by_ = stream;
        enqueued_    = std::move(enqueued);
        recorded_at_ = at;
    }

private:
    cudaEvent_t        event_ = nullptr;
    int                device_index_;
    unsigned long long capture_id_ = 0;
    std::string        recorded_by_;
    std::shared_ptr<const std::atomic<uint64_t>> enqueued_;
    uint64_t                                     recorded_at_ = 0;
};

class CudaStream : public Stream {
public:
    CudaStream(Device & device, std::string name, bool synchronous);
    ~CudaStream() override;

    Device &            device() override { return device_; }
    const std::string & name() const override { return name_; }
    void submit(std::function<void()> work, const char * name = __builtin_FUNCTION()) override;
    void record(Event & event) override;
    void wait(Event & event) override;
    void synchronize() override;
    bool query() override;

    // The stream kernels of `op` are launched on (capturing or not). The calling thread's current device is
    // the stream's device afterwards.
    cudaStream_t launch(const char * op);
    // After launching `op`'s kernels: throws on a launch error, keeps `tensors` until the kernels have run
    // (see above; while capturing, the Graph keeps them), and synchronizes under LOOM_SYNC_STREAMS=1.
    void launched(const char * op, std::vector<Tensor> tensors);

    cudaStream_t native() const { return stream_; }
    int          device_index() const;
    // True while the native stream captures: its own Loom capture, or one it joined by waiting on an event
    // recorded in a capture (a fork). capture() says only the former.
    bool         capturing() const { return captured_into() != nullptr; }

    // cuBLASLt's workspace for GEMMs on this stream (one per stream: GEMMs on two streams may overlap).
    void * gemm_workspace();
    static constexpr size_t kGemmWorkspaceBytes = size_t{32} << 20;
    // The words of the ops that check ids on this stream (cuda_ops.cpp's BadIdCheck): one the kernels write
    // in device memory, one the host reads in pinned memory. Reused op after op: the stream orders each op's
    // reset and copy after the previous op's host read. Created on first use, like the workspace.
    const Tensor & id_check_word(MemoryKind kind);

    // Host work's error path (called from the host function).
    void note_error(std::exception_ptr error);

protected:
    void native_capture_begin() override;
    void native_capture_end(Graph & graph) override;
    void native_capture_abort() noexcept override;

private:
    // The Graph the native stream is capturing into (its own Loom capture, or one it joined by a fork);
    // null when it is not capturing. `id` gets CUDA's capture id (0 when not capturing).
    Graph * captured_into(unsigned long long * id = nullptr) const;
    void    reap_locked(bool all);

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
    Tensor                   id_word_device_, id_word_host_;   // (1) i64 each, created on first id check
    // Ops launched and host work submitted so far: what tells a late read from a host synchronisation.
    std::shared_ptr<std::atomic<uint64_t>> enqueued_ = std::make_shared<std::atomic<uint64_t>>(0);
};

CudaStream & as_cuda_stream(Stream & stream, const char * op);
CudaEvent &  as_cuda_event(Event & event);

}  // namespace loom::LOOM_CUDA_NS
