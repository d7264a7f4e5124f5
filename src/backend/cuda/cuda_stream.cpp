// The CUDA backend's Stream and Event (cuda_stream.h): a CUDA stream with Loom's host work, event
// ordering, the per-stream GEMM workspace, and capture into CUDA graphs as core/graph.h's segments.
#include "backend/cuda/cuda_stream.h"
#include "backend/cuda/work_counters.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_device.h"
#include "backend/cuda/gemm.h"
#include "core/graph.h"
#include "core/profiler.h"

#include <chrono>
#include <memory>
#include <mutex>

namespace loom::LOOM_CUDA_NS {

// ---- Events

CudaEvent::CudaEvent(int device_index) : device_index_(device_index) {
    DeviceGuard guard(device_index_);
    LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&event_, cudaEventDisableTiming));
}

CudaEvent::~CudaEvent() {
    if (event_ != nullptr) cudaEventDestroy(event_);   // at exit the runtime may be gone: nothing to report
}

bool CudaEvent::query() {
    cudaError_t status = cudaEventQuery(event_);
    if (status == cudaErrorNotReady) return false;
    LOOM_CUDA_CHECK(status);
    return true;
}

void CudaEvent::synchronize() {
    check_not_capturing("a host wait on an event");
    // With work enqueued behind the record the device keeps busy while the host waits: a late read.
    const bool behind = enqueued_ && enqueued_->load() > recorded_at_;
    ++(behind ? work_counters().late_reads : work_counters().host_syncs);
    LOOM_CUDA_CHECK(cudaEventSynchronize(event_));
}

CudaEvent & as_cuda_event(Event & event) {
    auto * cuda_event = dynamic_cast<CudaEvent *>(&event);
    LOOM_CHECK(cuda_event != nullptr, "a CUDA stream was given an event of another backend",
               "create events with the same device as the stream (device.event_create())");
    return *cuda_event;
}

// ---- Streams

namespace {

struct HostWork {
    std::function<void()> work;
    CudaStream *          stream;
};

// Runs on the CUDA runtime's callback thread, in stream order. It must not call CUDA: work that would (an op
// enqueuing kernels) belongs on the host thread, not in submit().
void CUDART_CB run_host_work(void * user_data) {
    std::unique_ptr<HostWork> host_work(static_cast<HostWork *>(user_data));
    try {
        host_work->work();
    } catch (...) {
        host_work->stream->note_error(std::current_exception());
    }
}

// A host node of a captured segment: runs at every replay, so the closure stays with the Graph (keep_work).
void CUDART_CB run_kept_host_work(void * user_data) { (*static_cast<std::function<void()> *>(user_data))(); }

// One run of captured work (core/graph.h's CapturedSegment): the CUDA graph and its executable.
class CudaSegment final : public CapturedSegment {
public:
    CudaSegment(int device_index, cudaGraph_t graph, std::string graph_name)
        : device_index_(device_index), graph_(graph), name_(std::move(graph_name)) {
        DeviceGuard guard(device_index_);
        cudaError_t status = cudaGraphInstantiateWithFlags(&exec_, graph_, 0);
        if (status == cudaSuccess) status = cudaEventCreateWithFlags(&replayed_, cudaEventDisableTiming);
        if (status != cudaSuccess) {
            if (exec_ != nullptr) cudaGraphExecDestroy(exec_);
            cudaGraphDestroy(graph_);
        }
        LOOM_CHECK(status == cudaSuccess,
                   "instantiating a CUDA graph of Loom graph '" << name_ << "' failed: " << cudaGetErrorString(status), "");
    }

    // Waits for the last replay: the Graph drops the tensors and host closures the executable uses next.
    ~CudaSegment() override {
        DeviceGuard guard(device_index_);
        if (launched_) cudaEventSynchronize(replayed_);
        cudaEventDestroy(replayed_);
        cudaGraphExecDestroy(exec_);
        cudaGraphDestroy(graph_);
    }

    void replay(Stream & stream) const override {
        CudaStream & cs = as_cuda_stream(stream, "replay of a CUDA graph");
        LOOM_CHECK(cs.device_index() == device_index_,
                   "replay of graph '" << name_ << "', captured on cuda:" << device_index_ << ", on stream '"
                                       << cs.name() << "' of cuda:" << cs.device_index(),
                   "replay a graph on a stream of the device it was captured on");
        DeviceGuard guard(device_index_);
        const cudaError_t status = cudaGraphLaunch(exec_, cs.native());
        LOOM_CHECK(status == cudaSuccess, "replay of graph '" << name_ << "' on stream '" << cs.name()
                                                              << "': cudaGraphLaunch failed: " << cudaGetErrorString(status),
                   "run with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel");
        LOOM_CUDA_CHECK(cudaEventRecord(replayed_, cs.native()));
        launched_ = true;
    }

private:
    int             device_index_;
    cudaGraph_t     graph_ = nullptr;
    cudaGraphExec_t exec_  = nullptr;
    cudaEvent_t     replayed_ = nullptr;   // recorded after each launch
    mutable bool    launched_ = false;
    std::string     name_;
};

}  // namespace

CudaStream::CudaStream(Device & device, std::string name, bool synchronous)
    : device_(device), name_(std::move(name)), synchronous_(synchronous) {
    DeviceGuard guard(device_.index());
    LOOM_CUDA_CHECK(cudaStreamCreateWithFlags(&stream_, cudaStreamNonBlocking));
}

CudaStream::~CudaStream() {
    if (stream_ == nullptr) return;
    cudaStreamSynchronize(stream_);   // host work still queued points at this stream; errors have no one to go to
    {
        std::lock_guard<std::mutex> lock(mutex_);
        for (Retained & r : retained_) free_events_.push_back(r.event);
        retained_.clear();
        for (cudaEvent_t e : free_events_) cudaEventDestroy(e);
    }
    cudaStreamDestroy(stream_);
}

int CudaStream::device_index() const { return device_.index(); }

Graph * CudaStream::captured_into(unsigned long long * id) const {
    if (id != nullptr) *id = 0;
    cudaStreamCaptureStatus status  = cudaStreamCaptureStatusNone;
    unsigned long long      capture = 0;
    LOOM_CUDA_CHECK(cudaStreamGetCaptureInfo(stream_, &status, &capture));
    if (status == cudaStreamCaptureStatusNone) return nullptr;
    LOOM_CHECK(status == cudaStreamCaptureStatusActive,
               "CUDA stream '" << name_ << "' is in an invalidated capture"
                               << (capture_ ? " of graph '" + capture_->name() + "'" : std::string()),
               "an illegal CUDA call during the capture (a synchronisation, a query of a captured event) broke it: end_capture() "
               "and capture again without it");
    if (id != nullptr) *id = capture;
    if (capture_ != nullptr) return capture_;
    Graph * graph = graph_being_captured();
    LOOM_CHECK(graph != nullptr,
               "CUDA stream '" << name_ << "' joined a CUDA capture (it waited on an event recorded in one), but "
                               << "this thread captures no Loom graph",
               "fork streams into a capture only from the thread that captures (its ops are kept by that graph)");
    return graph;
}

void CudaStream::native_capture_begin() {
    gemm_workspace();                      // persistent state: allocated before the allocator redirects
    gemm_handles_create(device_.index(), stream_);   // cuBLAS(Lt) handles allocate on creation: never in a capture
    DeviceGuard guard(device_.index());
    LOOM_CUDA_CHECK(cudaStreamBeginCapture(stream_, cudaStreamCaptureModeThreadLocal));
}

void CudaStream::native_capture_end(Graph & graph) {
    DeviceGuard guard(device_.index());
    cudaGraph_t cuda_graph = nullptr;
    cudaError_t status     = cudaStreamEndCapture(stream_, &cuda_graph);
    if (status != cudaSuccess) cudaGetLastError();   // the failure is reported here, not by the next launch
    LOOM_CHECK(status == cudaSuccess,
               "ending the CUDA capture of graph '" << graph.name() << "' on stream '" << name_
                                                     << "' failed: " << cudaGetErrorString(status),
               "if unjoined: a stream that waited on an event recorded in the capture (a fork) must be waited on by "
               "the capturing stream (a join) before end_capture() and before a replayable node; if invalidated: an "
               "illegal call was made during the capture");
    size_t nodes = 0;
    status       = cudaGraphGetNodes(cuda_graph, nullptr, &nodes);
    if (status != cudaSuccess || nodes == 0) {   // nothing between two replayable nodes: no segment
        cudaGraphDestroy(cuda_graph);
        LOOM_CUDA_CHECK(status);
        return;
    }
    graph.add_segment(std::make_shared<CudaSegment>(device_.index(), cuda_graph, graph.name()));
}

void CudaStream::native_capture_abort() noexcept {
    int previous = -1;
    cudaGetDevice(&previous);
    cudaSetDevice(device_.index());
    cudaGraph_t cuda_graph = nullptr;
    if (cudaStreamEndCapture(stream_, &cuda_graph) == cudaSuccess && cuda_graph != nullptr) cudaGraphDestroy(cuda_graph);
    cudaGetLastError();
    if (previous >= 0) cudaSetDevice(previous);
}

void CudaStream::note_error(std::exception_ptr error) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!error_) error_ = std::move(error);
}

void CudaStream::submit(std::function<void()> work, const char * name) {
    DeviceGuard guard(device_.index());
    ++*enqueued_;
    if (Profiler::active() && !captured_into()) {   // --profile: the host work's span (kernels are not timed)
        work = [inner = std::move(work), name, this] {
            const auto begin = std::chrono::steady_clock::now();
            inner();
            Profiler::record(name_, name, begin, std::chrono::steady_clock::now());
        };
    }
    if (Graph * graph = captured_into()) {   // a host node, run at every replay
        std::function<void()> & kept = graph->keep_work([work = std::move(work), this] {
            try {
                work();
            } catch (...) {
                note_error(std::current_exception());
            }
        });
        LOOM_CUDA_CHECK(cudaLaunchHostFunc(stream_, run_kept_host_work, &kept));
        return;
    }
    auto host_work = std::make_unique<HostWork>(HostWork{std::move(work), this});
    LOOM_CUDA_CHECK(cudaLaunchHostFunc(stream_, run_host_work, host_work.get()));
    host_work.release();   // run_host_work owns it now
    if (synchronous_) synchronize();
}

void CudaStream::record(Event & event) {
    CudaEvent & e = as_cuda_event(event);
    LOOM_CHECK(e.device_index() == device_.index(),
               "record on stream '" << name_ << "' of cuda:" << device_.index() << " of an event of cuda:" << e.device_index(),
               "record events created by the stream's own device");
    DeviceGuard        guard(device_.index());
    unsigned long long capture = 0;
    captured_into(&capture);   // inside a capture the record is an edge of the CUDA graph (a fork point)
    LOOM_CUDA_CHECK(cudaEventRecord(e.native(), stream_));
    e.note_record(capture, name_, enqueued_, enqueued_->load());
}

void CudaStream::wait(Event & event) {
    CudaEvent &        e = as_cuda_event(event);
    DeviceGuard        guard(device_.index());
    unsigned long long capture = 0;
    Graph *            graph   = captured_into(&capture);
    unsigned int       flags   = cudaEventWaitDefault;
    if (graph != nullptr && e.capture_id() != capture) {
        LOOM_CHECK(e.capture_id() == 0,
                   "stream '" << name_ << "' waits, while capturing graph '" << graph->name()
                              << "', on an event last recorded by stream '" << e.recorded_by()
                              << "' inside another CUDA capture (an earlier graph, or this graph before a replayable "
                                 "node ended its segment)",
                   "a record inside a capture is a graph edge, not an event a later capture can wait on: record the "
                   "event again outside the capture, or keep the record and the wait in one segment");
        flags = cudaEventWaitExternal;   // recorded outside any capture: an event wait node, at each replay
    }
    LOOM_CUDA_CHECK(cudaStreamWaitEvent(stream_, e.native(), flags));
}

void CudaStream::synchronize() {
    check_not_capturing(("a synchronize of stream '" + name_ + "'").c_str());
    DeviceGuard guard(device_.index());
    ++work_counters().host_syncs;
    LOOM_CUDA_CHECK(cudaStreamSynchronize(stream_));
    std::exception_ptr error;
    {
        std::lock_guard<std::mutex> lock(mutex_);
        reap_locked(true);
        std::swap(error, error_);
    }
    if (error) std::rethrow_exception(error);
}

bool CudaStream::query() {
    cudaError_t status = cudaStreamQuery(stream_);
    if (status == cudaErrorNotReady) return false;
    LOOM_CUDA_CHECK(status);
    return true;
}

cudaStream_t CudaStream::launch(const char *) {
    ++*enqueued_;
    LOOM_CUDA_CHECK(cudaSetDevice(device_.index()));
    return stream_;
}

void CudaStream::reap_locked(bool all) {
    while (!retained_.empty()) {
        Retained & oldest = retained_.front();
        if (!all) {
            cudaError_t status = cudaEventQuery(oldest.event);
            if (status == cudaErrorNotReady) return;
            LOOM_CUDA_CHECK(status);
        }
        free_events_.push_back(oldest.event);
        retained_.pop_front();   // the tensors' blocks go back to their allocators' caches here
    }
}

void CudaStream::launched(const char * op, std::vector<Tensor> tensors) {
    LOOM_CHECK_STATUS(cudaGetLastError(), cudaSuccess, cudaGetErrorString, "CUDA",
                      "launching the kernels of " << op << " on stream '" << name_ << "' failed");
    if (Graph * graph = captured_into()) {   // the graph keeps them: its replays use them
        graph->keep(std::move(tensors));
        return;
    }
    {
        std::lock_guard<std::mutex> lock(mutex_);
        reap_locked(false);
        cudaEvent_t event = nullptr;
        if (free_events_.empty()) {
            LOOM_CUDA_CHECK(cudaEventCreateWithFlags(&event, cudaEventDisableTiming));
        } else {
            event = free_events_.back();
            free_events_.pop_back();
        }
        cudaError_t status = cudaEventRecord(event, stream_);
        if (status != cudaSuccess) free_events_.push_back(event);
        LOOM_CUDA_CHECK(status);
        retained_.push_back(Retained{event, std::move(tensors)});
    }
    if (synchronous_) synchronize();
}

void * CudaStream::gemm_workspace() {
    if (!workspace_.defined()) {
        workspace_ = Tensor::empty({static_cast<int64_t>(kGemmWorkspaceBytes)}, DType::u8, device_,
                                   TensorOptions{MemoryKind::device, "cublas-workspace"});
    }
    return workspace_.data_ptr();
}

const Tensor & CudaStream::id_check_word(MemoryKind kind) {
    Tensor & word = kind == MemoryKind::device ? id_word_device_ : id_word_host_;
    if (!word.defined()) word = Tensor::empty({1}, DType::i64, device_, TensorOptions{kind, "id-checks"});
    return word;
}

CudaStream & as_cuda_stream(Stream & stream, const char * op) {
    auto * cuda_stream = dynamic_cast<CudaStream *>(&stream);
    LOOM_CHECK(cuda_stream != nullptr, op << " of the CUDA ops on stream '" << stream.name() << "' of " << stream.device().name(),
               "run CUDA ops on a stream of the CUDA device (device.compute_stream() or device.stream_create())");
    return *cuda_stream;
}

}  // namespace loom::LOOM_CUDA_NS
