// The emulated CUDA runtime and cuBLAS(Lt) (src/backend/cuda_emu): stream order and asynchrony, events,
// memory, stream capture and graphs, sticky errors, and the GEMMs against a double reference. These run on
// any machine: the emulator is host code. Where a test shows a race (a missing event wait), it makes the
// race deterministic by holding one stream in a host function until the host releases it.
#include <cublasLt.h>
#include <cublas_v2.h>
#include <cuda_runtime.h>

#include <gtest/gtest.h>

#include <atomic>
#include <chrono>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <vector>

namespace {

// A gate a host function waits at, keeping its stream busy until the test opens it.
struct Gate {
    std::mutex              mutex;
    std::condition_variable cv;
    bool                    open = false;

    void release() {
        {
            std::lock_guard<std::mutex> lock(mutex);
            open = true;
        }
        cv.notify_all();
    }
    static void CUDART_CB wait(void * self) {
        auto *                       g = static_cast<Gate *>(self);
        std::unique_lock<std::mutex> lock(g->mutex);
        g->cv.wait(lock, [g] { return g->open; });
    }
};

void CUDART_CB count(void * counter) { static_cast<std::atomic<int> *>(counter)->fetch_add(1); }

struct Appender {
    std::mutex *       mutex;
    std::vector<int> * out;
    int                value;
    static void CUDART_CB run(void * self) {
        auto *                      a = static_cast<Appender *>(self);
        std::lock_guard<std::mutex> lock(*a->mutex);
        a->out->push_back(a->value);
    }
};

cudaStream_t make_stream() {
    cudaStream_t s = nullptr;
    EXPECT_EQ(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking), cudaSuccess);
    return s;
}

cudaEvent_t make_event() {
    cudaEvent_t e = nullptr;
    EXPECT_EQ(cudaEventCreateWithFlags(&e, cudaEventDisableTiming), cudaSuccess);
    return e;
}

template <typename T>
T * device_alloc(size_t count) {
    T * p = nullptr;
    EXPECT_EQ(cudaMalloc(&p, count * sizeof(T)), cudaSuccess);
    return p;
}

}  // namespace

// ---- Streams and events

TEST(CudaEmuRuntime, StreamRunsInOrderAndAsynchronously) {
    cudaStream_t     s = make_stream();
    Gate             gate;
    std::mutex       mutex;
    std::vector<int> order;
    Appender         first{&mutex, &order, 1}, second{&mutex, &order, 2};
    int *            d = device_alloc<int>(4);

    ASSERT_EQ(cudaLaunchHostFunc(s, Gate::wait, &gate), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(s, Appender::run, &first), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d, 0, 4 * sizeof(int), s), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(s, Appender::run, &second), cudaSuccess);

    // The calls returned with the stream held at the gate: nothing after it has run.
    std::this_thread::sleep_for(std::chrono::milliseconds(20));
    EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
    {
        std::lock_guard<std::mutex> lock(mutex);
        EXPECT_TRUE(order.empty());
    }
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);   // NotReady is a status, not an error

    gate.release();
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(cudaStreamQuery(s), cudaSuccess);
    EXPECT_EQ(order, (std::vector<int>{1, 2}));
    int host[4];
    ASSERT_EQ(cudaMemcpy(host, d, sizeof(host), cudaMemcpyDeviceToHost), cudaSuccess);
    for (int v : host) EXPECT_EQ(v, 0);
    EXPECT_EQ(cudaFree(d), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// Stream b copies what stream a writes. Stream a is held at a gate until b has had every chance to run:
// without the event wait b copies the stale bytes, with it b copies a's.
TEST(CudaEmuRuntime, EventWaitOrdersTwoStreams) {
    cudaStream_t a = make_stream(), b = make_stream();
    cudaEvent_t  written = make_event();
    const size_t n       = 64;
    float *      src     = device_alloc<float>(n);
    float *      dst     = device_alloc<float>(n);
    std::vector<float> ones(n, 1.0f), host(n);

    for (bool with_wait : {false, true}) {
        ASSERT_EQ(cudaMemset(src, 0, n * sizeof(float)), cudaSuccess);
        ASSERT_EQ(cudaMemset(dst, 0, n * sizeof(float)), cudaSuccess);

        // a writes ones into src, held behind the gate; b copies src to dst.
        float * staged = device_alloc<float>(n);
        ASSERT_EQ(cudaMemcpy(staged, ones.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
        Gate hold;
        ASSERT_EQ(cudaLaunchHostFunc(a, Gate::wait, &hold), cudaSuccess);
        ASSERT_EQ(cudaMemcpyAsync(src, staged, n * sizeof(float), cudaMemcpyDeviceToDevice, a), cudaSuccess);
        ASSERT_EQ(cudaEventRecord(written, a), cudaSuccess);
        if (with_wait) {
            ASSERT_EQ(cudaStreamWaitEvent(b, written, 0), cudaSuccess);
        }
        ASSERT_EQ(cudaMemcpyAsync(dst, src, n * sizeof(float), cudaMemcpyDeviceToDevice, b), cudaSuccess);
        if (with_wait) {
            std::this_thread::sleep_for(std::chrono::milliseconds(20));
            EXPECT_EQ(cudaStreamQuery(b), cudaErrorNotReady);
            EXPECT_EQ(cudaEventQuery(written), cudaErrorNotReady);
            hold.release();
            ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);
        } else {
            ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);   // runs while a is still held
            hold.release();
        }
        ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
        EXPECT_EQ(cudaEventQuery(written), cudaSuccess);
        ASSERT_EQ(cudaMemcpy(host.data(), dst, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
        EXPECT_EQ(host[0], with_wait ? 1.0f : 0.0f) << (with_wait ? "with" : "without") << " the wait";
        EXPECT_EQ(host[n - 1], with_wait ? 1.0f : 0.0f);
        EXPECT_EQ(cudaFree(staged), cudaSuccess);
    }
    EXPECT_EQ(cudaFree(src), cudaSuccess);
    EXPECT_EQ(cudaFree(dst), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(written), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(a), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(b), cudaSuccess);
}

// A wait refers to the record made before it; a later record of the same event does not affect it.
TEST(CudaEmuRuntime, WaitRefersToTheRecordAtTheTimeOfTheCall) {
    cudaStream_t a = make_stream(), b = make_stream();
    cudaEvent_t  e = make_event();
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);   // completes at once
    ASSERT_EQ(cudaStreamSynchronize(a), cudaSuccess);
    Gate gate;
    std::atomic<int> ran{0};
    ASSERT_EQ(cudaStreamWaitEvent(b, e, 0), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(a, Gate::wait, &gate), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(e, a), cudaSuccess);   // a new record, held by the gate
    ASSERT_EQ(cudaLaunchHostFunc(b, count, &ran), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(b), cudaSuccess);   // not blocked by the later record
    EXPECT_EQ(ran.load(), 1);
    EXPECT_EQ(cudaEventQuery(e), cudaErrorNotReady);
    gate.release();
    EXPECT_EQ(cudaEventSynchronize(e), cudaSuccess);
    EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(a), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(b), cudaSuccess);
}

TEST(CudaEmuRuntime, EventNeverRecordedIsComplete) {
    cudaEvent_t  e = make_event();
    cudaStream_t s = make_stream();
    EXPECT_EQ(cudaEventQuery(e), cudaSuccess);
    EXPECT_EQ(cudaEventSynchronize(e), cudaSuccess);
    std::atomic<int> ran{0};
    EXPECT_EQ(cudaStreamWaitEvent(s, e, 0), cudaSuccess);
    EXPECT_EQ(cudaLaunchHostFunc(s, count, &ran), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(ran.load(), 1);
    EXPECT_EQ(cudaEventDestroy(e), cudaSuccess);
    EXPECT_EQ(cudaEventQuery(e), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidResourceHandle);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

// ---- Memory

TEST(CudaEmuRuntime, SynchronousCopiesAndGarbageFill) {
    const size_t n = 1000;
    float *      d = device_alloc<float>(n);
    ASSERT_NE(d, nullptr);
    EXPECT_EQ(reinterpret_cast<uintptr_t>(d) % 256, 0u);
    std::vector<unsigned char> raw(16);
    ASSERT_EQ(cudaMemcpy(raw.data(), d, raw.size(), cudaMemcpyDefault), cudaSuccess);
    for (unsigned char byte : raw) EXPECT_EQ(byte, 0xA5) << "fresh device memory shows the garbage pattern";

    std::vector<float> in(n), out(n, -1.0f);
    for (size_t i = 0; i < n; ++i) in[i] = static_cast<float>(i) * 0.5f;
    ASSERT_EQ(cudaMemcpy(d, in.data(), n * sizeof(float), cudaMemcpyHostToDevice), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(out.data(), d, n * sizeof(float), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(in, out);

    // The registry knows the allocation's extent and which side is the device.
    EXPECT_EQ(cudaMemcpy(out.data(), d, (n + 1) * sizeof(float), cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    EXPECT_EQ(cudaMemcpy(out.data(), in.data(), sizeof(float), cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    EXPECT_EQ(cudaMemcpy(d, out.data(), sizeof(float), cudaMemcpyDeviceToHost), cudaErrorInvalidValue);
    EXPECT_EQ(cudaGetLastError(), cudaErrorInvalidValue);

    // The legacy stream is ordered with the synchronous copy.
    ASSERT_EQ(cudaMemsetAsync(d, 0, n * sizeof(float), nullptr), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(out.data(), d, n * sizeof(float), cudaMemcpyDefault), cudaSuccess);
    for (float v : out) ASSERT_EQ(v, 0.0f);
    EXPECT_EQ(cudaFree(d), cudaSuccess);
}

TEST(CudaEmuRuntime, PointerAttributesTellPinnedFromDevice) {
    int count = 0;
    ASSERT_EQ(cudaGetDeviceCount(&count), cudaSuccess);
    ASSERT_GE(count, 2);
    EXPECT_EQ(cudaSetDevice(count), cudaErrorInvalidDevice);
    ASSERT_EQ(cudaSetDevice(1), cudaSuccess);
    void * device = nullptr;
    void * pinned = nullptr;
    ASSERT_EQ(cudaMalloc(&device, 1000), cudaSuccess);
    ASSERT_EQ(cudaHostAlloc(&pinned, 1000, cudaHostAllocPortable), cudaSuccess);
    ASSERT_EQ(cudaSetDevice(0), cudaSuccess);

    cudaPointerAttributes attributes{};
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, static_cast<char *>(device) + 10), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeDevice);
    EXPECT_EQ(attributes.device, 1);
    EXPECT_EQ(attributes.hostPointer, nullptr);
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, pinned), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeHost);
    EXPECT_EQ(attributes.hostPointer, pinned);
    int pageable = 0;
    ASSERT_EQ(cudaPointerGetAttributes(&attributes, &pageable), cudaSuccess);
    EXPECT_EQ(attributes.type, cudaMemoryTypeUnregistered);

    EXPECT_EQ(cudaFree(pinned), cudaErrorInvalidValue);
    EXPECT_EQ(cudaFreeHost(device), cudaErrorInvalidValue);
    EXPECT_EQ(cudaFree(&pageable), cudaErrorInvalidValue);
    EXPECT_EQ(cudaFree(static_cast<char *>(device) + 256), cudaErrorInvalidValue);
    cudaGetLastError();
    EXPECT_EQ(cudaFree(device), cudaSuccess);
    EXPECT_EQ(cudaFreeHost(pinned), cudaSuccess);
}

TEST(CudaEmuRuntime, AllocationBeyondCapacityFails) {
    size_t free_before = 0, total = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_before, &total), cudaSuccess);
    emu_set_device_memory_capacity(size_t{64} << 20);
    void * a = nullptr;
    void * b = nullptr;
    ASSERT_EQ(cudaMalloc(&a, size_t{40} << 20), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b, size_t{40} << 20), cudaErrorMemoryAllocation);
    EXPECT_EQ(b, nullptr);
    EXPECT_EQ(cudaGetLastError(), cudaErrorMemoryAllocation);
    EXPECT_EQ(cudaGetLastError(), cudaSuccess);   // not sticky
    size_t free_now = 0;
    ASSERT_EQ(cudaMemGetInfo(&free_now, &total), cudaSuccess);
    EXPECT_EQ(total, size_t{64} << 20);
    ASSERT_EQ(cudaFree(a), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&b, size_t{40} << 20), cudaSuccess);
    EXPECT_EQ(cudaFree(b), cudaSuccess);
    emu_set_device_memory_capacity(total == 0 ? 0 : (size_t{16384} << 20));
}

// ---- Capture and graphs

TEST(CudaEmuRuntime, CapturedWorkRunsOnlyAtReplay) {
    cudaStream_t     s = make_stream();
    std::atomic<int> runs{0};
    int *            d = device_alloc<int>(8);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long      id     = 0;
    ASSERT_EQ(cudaStreamGetCaptureInfo(s, &status, &id), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusActive);
    EXPECT_NE(id, 0u);
    ASSERT_EQ(cudaLaunchHostFunc(s, count, &runs), cudaSuccess);
    ASSERT_EQ(cudaMemsetAsync(d, 0, 8 * sizeof(int), s), cudaSuccess);
    std::this_thread::sleep_for(std::chrono::milliseconds(10));
    EXPECT_EQ(runs.load(), 0);
    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    ASSERT_NE(graph, nullptr);
    ASSERT_EQ(cudaStreamGetCaptureInfo(s, &status, &id), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusNone);
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    EXPECT_EQ(nodes, 2u);
    EXPECT_EQ(runs.load(), 0);
    int host[8];
    ASSERT_EQ(cudaMemcpy(host, d, sizeof(host), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_NE(host[0], 0) << "the captured memset must not have run";

    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiateWithFlags(&exec, graph, 0), cudaSuccess);
    for (int i = 0; i < 5; ++i) ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    EXPECT_EQ(runs.load(), 5);
    ASSERT_EQ(cudaMemcpy(host, d, sizeof(host), cudaMemcpyDeviceToHost), cudaSuccess);
    EXPECT_EQ(host[0], 0);
    EXPECT_EQ(cudaGraphExecDestroy(exec), cudaSuccess);
    EXPECT_EQ(cudaGraphDestroy(graph), cudaSuccess);
    EXPECT_EQ(cudaFree(d), cudaSuccess);
    EXPECT_EQ(cudaStreamDestroy(s), cudaSuccess);
}

TEST(CudaEmuRuntime, ForkAndJoinAcrossStreams) {
    cudaStream_t     origin = make_stream(), side = make_stream();
    cudaEvent_t      fork = make_event(), join = make_event();
    std::mutex       mutex;
    std::vector<int> order;
    Appender         a{&mutex, &order, 1}, b{&mutex, &order, 2}, c{&mutex, &order, 3};

    ASSERT_EQ(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(origin, Appender::run, &a), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, origin), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    unsigned long long      origin_id = 0, side_id = 0;
    ASSERT_EQ(cudaStreamGetCaptureInfo(origin, &status, &origin_id), cudaSuccess);
    ASSERT_EQ(cudaStreamGetCaptureInfo(side, &status, &side_id), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusActive);
    EXPECT_EQ(side_id, origin_id);
    EXPECT_EQ(cudaEventQuery(fork), cudaErrorCapturedEvent);   // illegal: and it invalidates the capture
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(origin, &graph), cudaErrorStreamCaptureInvalidated);
    EXPECT_EQ(graph, nullptr);
    cudaGetLastError();

    // Again, legally.
    ASSERT_EQ(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(origin, Appender::run, &a), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, origin), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(side, Appender::run, &b), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(join, side), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(origin, join, 0), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(origin, Appender::run, &c), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(origin, &graph), cudaSuccess);
    ASSERT_EQ(cudaStreamGetCaptureInfo(side, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusNone);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, origin), cudaSuccess);
    ASSERT_EQ(cudaGraphLaunch(exec, origin), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(origin), cudaSuccess);
    EXPECT_EQ(order, (std::vector<int>{1, 2, 3, 1, 2, 3}));
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);

    // A fork never joined: the capture fails, and ends for both streams.
    ASSERT_EQ(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, origin), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(side, Appender::run, &b), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(origin, Appender::run, &c), cudaSuccess);
    EXPECT_EQ(cudaStreamEndCapture(side, &graph), cudaErrorStreamCaptureUnmatched);   // not the origin
    cudaGetLastError();
    EXPECT_EQ(cudaStreamEndCapture(origin, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();

    ASSERT_EQ(cudaStreamBeginCapture(origin, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaEventRecord(fork, origin), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(side, fork, 0), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(side, Appender::run, &b), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(origin, Appender::run, &c), cudaSuccess);
    EXPECT_EQ(cudaStreamEndCapture(origin, &graph), cudaErrorStreamCaptureUnjoined);
    EXPECT_EQ(graph, nullptr);
    ASSERT_EQ(cudaStreamGetCaptureInfo(side, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusNone);
    cudaGetLastError();
    EXPECT_EQ(order.size(), 6u) << "no captured work ran";

    cudaEventDestroy(fork);
    cudaEventDestroy(join);
    cudaStreamDestroy(origin);
    cudaStreamDestroy(side);
}

TEST(CudaEmuRuntime, UnsafeCallsFollowTheCaptureMode) {
    cudaStream_t s = make_stream();
    void *       p = nullptr;

    // Thread-local capture: this thread's cudaMalloc is refused and invalidates the capture.
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_EQ(cudaMalloc(&p, 1024), cudaErrorStreamCaptureUnsupported);
    cudaStreamCaptureStatus status = cudaStreamCaptureStatusNone;
    ASSERT_EQ(cudaStreamGetCaptureInfo(s, &status), cudaSuccess);
    EXPECT_EQ(status, cudaStreamCaptureStatusInvalidated);
    EXPECT_EQ(cudaMemsetAsync(nullptr, 0, 0, s), cudaErrorStreamCaptureInvalidated);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();

    // The same call in relaxed mode is legal; another thread (global mode) ignores a thread-local capture.
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cudaStreamCaptureMode mode = cudaStreamCaptureModeRelaxed;
    ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
    EXPECT_EQ(mode, cudaStreamCaptureModeGlobal);
    EXPECT_EQ(cudaMalloc(&p, 1024), cudaSuccess);
    EXPECT_EQ(cudaFree(p), cudaSuccess);
    ASSERT_EQ(cudaThreadExchangeStreamCaptureMode(&mode), cudaSuccess);
    cudaError_t other = cudaErrorUnknown;
    std::thread([&] {
        void * q = nullptr;
        other    = cudaMalloc(&q, 1024);
        if (other == cudaSuccess) cudaFree(q);
    }).join();
    EXPECT_EQ(other, cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    cudaGraphDestroy(graph);

    // A global capture: another thread in global mode is refused too.
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeGlobal), cudaSuccess);
    std::thread([&] {
        void * q = nullptr;
        other    = cudaMalloc(&q, 1024);
    }).join();
    EXPECT_EQ(other, cudaErrorStreamCaptureUnsupported);
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();

    // Synchronising a capturing stream is illegal.
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
    EXPECT_EQ(cudaStreamSynchronize(s), cudaErrorStreamCaptureUnsupported);
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeRelaxed), cudaSuccess);
    EXPECT_EQ(cudaDeviceSynchronize(), cudaErrorStreamCaptureUnsupported);
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();
    cudaStreamDestroy(s);
}

// An event wait node (cudaEventWaitExternal) waits, at each replay, for the event's latest record as of
// the launch; a plain wait on an uncaptured event breaks the capture's isolation.
TEST(CudaEmuRuntime, ExternalEventWaitNodeWaitsAtEachReplay) {
    cudaStream_t     s = make_stream(), producer = make_stream();
    cudaEvent_t      ready = make_event();
    std::atomic<int> runs{0};
    ASSERT_EQ(cudaEventRecord(ready, producer), cudaSuccess);
    ASSERT_EQ(cudaStreamSynchronize(producer), cudaSuccess);

    cudaGraph_t graph = nullptr;
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    EXPECT_EQ(cudaStreamWaitEvent(s, ready, cudaEventWaitDefault), cudaErrorStreamCaptureIsolation);
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();

    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    ASSERT_EQ(cudaStreamWaitEvent(s, ready, cudaEventWaitExternal), cudaSuccess);
    ASSERT_EQ(cudaLaunchHostFunc(s, count, &runs), cudaSuccess);
    ASSERT_EQ(cudaStreamEndCapture(s, &graph), cudaSuccess);
    size_t nodes = 0;
    ASSERT_EQ(cudaGraphGetNodes(graph, nullptr, &nodes), cudaSuccess);
    EXPECT_EQ(nodes, 2u);
    cudaGraphExec_t exec = nullptr;
    ASSERT_EQ(cudaGraphInstantiate(&exec, graph, 0), cudaSuccess);

    for (int replay = 1; replay <= 2; ++replay) {
        Gate gate;
        ASSERT_EQ(cudaLaunchHostFunc(producer, Gate::wait, &gate), cudaSuccess);
        ASSERT_EQ(cudaEventRecord(ready, producer), cudaSuccess);   // the record this replay must wait for
        ASSERT_EQ(cudaGraphLaunch(exec, s), cudaSuccess);
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        EXPECT_EQ(runs.load(), replay - 1) << "replay " << replay << " ran before the event's latest record";
        EXPECT_EQ(cudaStreamQuery(s), cudaErrorNotReady);
        gate.release();
        ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
        EXPECT_EQ(runs.load(), replay);
    }
    cudaGraphExecDestroy(exec);
    cudaGraphDestroy(graph);
    cudaEventDestroy(ready);
    cudaStreamDestroy(s);
    cudaStreamDestroy(producer);
}

// A fault in a node is a sticky error: every later call reports it. It poisons the process, so it runs in a
// child (the death test's fresh process).
TEST(CudaEmuRuntimeDeathTest, ThrowingNodeMakesTheErrorSticky) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    EXPECT_EXIT(
        {
            cudaStream_t s = nullptr;
            cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking);
            loom_emu::enqueue(s, [] { throw std::runtime_error("out-of-bounds write"); }, "faulty_kernel");
            bool ok = cudaStreamSynchronize(s) == cudaErrorLaunchFailure;
            ok      = ok && cudaGetLastError() == cudaErrorLaunchFailure;
            ok      = ok && cudaGetLastError() == cudaErrorLaunchFailure;   // sticky: not reset
            void * p = nullptr;
            ok       = ok && cudaMalloc(&p, 16) == cudaErrorLaunchFailure;
            ok       = ok && cudaMemsetAsync(p, 0, 0, s) == cudaErrorLaunchFailure;
            std::exit(ok ? 0 : 1);
        },
        ::testing::ExitedWithCode(0), "faulty_kernel.*out-of-bounds write");
}

TEST(CudaEmuRuntime, FuncAttributeRaisesTheDynamicSharedMemoryLimit) {
    struct Kernels {   // two distinct functions (different bodies: never folded into one address)
        static void a(float * x) { x[0] = 1.0f; }
        static void b(float * x) { x[1] = 2.0f; }
    };
    EXPECT_EQ(loom_emu::kernel_max_dynamic_smem(reinterpret_cast<const void *>(&Kernels::a)), 48u * 1024);
    EXPECT_EQ(cudaFuncSetAttribute(Kernels::a, cudaFuncAttributeMaxDynamicSharedMemorySize, 100 * 1024), cudaSuccess);
    EXPECT_EQ(loom_emu::kernel_max_dynamic_smem(reinterpret_cast<const void *>(&Kernels::a)), 100u * 1024);
    EXPECT_EQ(loom_emu::kernel_max_dynamic_smem(reinterpret_cast<const void *>(&Kernels::b)), 48u * 1024);
    EXPECT_EQ(cudaFuncSetAttribute(Kernels::b, cudaFuncAttributeMaxDynamicSharedMemorySize, 228 * 1024),
              cudaErrorInvalidValue);
    cudaGetLastError();
    EXPECT_EQ(cudaFuncSetAttribute(Kernels::a, cudaFuncAttributeMaxDynamicSharedMemorySize, 48 * 1024), cudaSuccess);
}

TEST(CudaEmuRuntime, ErrorStringsAreCudas) {
    EXPECT_STREQ(cudaGetErrorString(cudaErrorMemoryAllocation), "out of memory");
    EXPECT_STREQ(cudaGetErrorName(cudaErrorStreamCaptureUnjoined), "cudaErrorStreamCaptureUnjoined");
    EXPECT_STREQ(cudaGetErrorString(cudaErrorLaunchFailure), "unspecified launch failure");
    EXPECT_STREQ(cublasGetStatusString(CUBLAS_STATUS_NOT_SUPPORTED), "the functionality requested is not supported");
    int version = 0;
    EXPECT_EQ(cudaRuntimeGetVersion(&version), cudaSuccess);
    EXPECT_GE(version, 12000);
    EXPECT_GE(cublasLtGetVersion(), 120000u);
}

// ---- cuBLAS(Lt)

namespace {

uint16_t to_bf16(float f) {
    uint32_t w;
    std::memcpy(&w, &f, 4);
    w += 0x7fff + ((w >> 16) & 1);
    return static_cast<uint16_t>(w >> 16);
}

float from_bf16(uint16_t b) {
    uint32_t w = static_cast<uint32_t>(b) << 16;
    float    f;
    std::memcpy(&f, &w, 4);
    return f;
}

// A column-major operand on the device, f32 or bf16, and its values as the device holds them.
struct Matrix {
    size_t             rows, cols;
    bool               bf16;
    std::vector<float> values;   // column-major, exactly representable in the operand's type
    void *             device = nullptr;

    Matrix(size_t r, size_t c, bool b, std::mt19937 & rng) : rows(r), cols(c), bf16(b), values(r * c) {
        std::uniform_real_distribution<float> dist(-1.0f, 1.0f);
        for (float & v : values) v = bf16 ? from_bf16(to_bf16(dist(rng))) : dist(rng);
        const size_t bytes = values.size() * (bf16 ? 2 : 4);
        EXPECT_EQ(cudaMalloc(&device, bytes), cudaSuccess);
        if (bf16) {
            std::vector<uint16_t> bits(values.size());
            for (size_t i = 0; i < values.size(); ++i) bits[i] = to_bf16(values[i]);
            EXPECT_EQ(cudaMemcpy(device, bits.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
        } else {
            EXPECT_EQ(cudaMemcpy(device, values.data(), bytes, cudaMemcpyHostToDevice), cudaSuccess);
        }
    }
    ~Matrix() { cudaFree(device); }
    float at(size_t r, size_t c) const { return values[c * rows + r]; }
};

// Runs D (m, n) = op(A) op(B) [+ bias] through the heuristic and cublasLtMatmul, as gemm.cpp does.
cublasStatus_t lt_matmul(cublasLtHandle_t handle, cudaStream_t stream, cublasOperation_t ta, cublasOperation_t tb,
                         const Matrix & a, const Matrix & b, float * d, size_t m, size_t n, const float * bias,
                         float beta, int * found) {
    cublasLtMatmulDesc_t       desc = nullptr;
    cublasLtMatrixLayout_t     la = nullptr, lb = nullptr, lc = nullptr;
    cublasLtMatmulPreference_t pref = nullptr;
    EXPECT_EQ(cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F), CUBLAS_STATUS_SUCCESS);
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSA, &ta, sizeof(ta));
    cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_TRANSB, &tb, sizeof(tb));
    if (bias != nullptr) {
        const cublasLtEpilogue_t epilogue  = CUBLASLT_EPILOGUE_BIAS;
        const int32_t            bias_type = CUDA_R_32F;
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_EPILOGUE, &epilogue, sizeof(epilogue));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_POINTER, &bias, sizeof(bias));
        cublasLtMatmulDescSetAttribute(desc, CUBLASLT_MATMUL_DESC_BIAS_DATA_TYPE, &bias_type, sizeof(bias_type));
    }
    const cudaDataType_t type = a.bf16 ? CUDA_R_16BF : CUDA_R_32F;
    cublasLtMatrixLayoutCreate(&la, type, a.rows, a.cols, static_cast<int64_t>(a.rows));
    cublasLtMatrixLayoutCreate(&lb, type, b.rows, b.cols, static_cast<int64_t>(b.rows));
    cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, m, n, static_cast<int64_t>(m));
    cublasLtMatmulPreferenceCreate(&pref);
    const size_t workspace = 1 << 20;
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MAX_WORKSPACE_BYTES, &workspace, sizeof(workspace));
    auto align = [](const void * p) {
        uint32_t v = 256;
        while (v > 1 && reinterpret_cast<uintptr_t>(p) % v != 0) v /= 2;
        return v;
    };
    const uint32_t align_a = align(a.device), align_b = align(b.device), align_d = align(d);
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a, sizeof(align_a));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_B_BYTES, &align_b, sizeof(align_b));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_C_BYTES, &align_d, sizeof(align_d));
    cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_D_BYTES, &align_d, sizeof(align_d));
    cublasLtMatmulHeuristicResult_t heuristic{};
    *found                = 0;
    cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(handle, desc, la, lb, lc, lc, pref, 1, &heuristic, found);
    if (status == CUBLAS_STATUS_SUCCESS && *found > 0) {
        const float alpha = 1.0f;
        status = cublasLtMatmul(handle, desc, &alpha, a.device, la, b.device, lb, &beta, d, lc, d, lc, &heuristic.algo,
                                nullptr, 0, stream);
    }
    cublasLtMatmulPreferenceDestroy(pref);
    cublasLtMatrixLayoutDestroy(la);
    cublasLtMatrixLayoutDestroy(lb);
    cublasLtMatrixLayoutDestroy(lc);
    cublasLtMatmulDescDestroy(desc);
    return status;
}

}  // namespace

// Every element against a double reference over the same (bf16-exact) inputs. The f32 sum of k products
// differs from the exact one by at most about k * 2^-24 * sum |a b|: the tolerance is 2 k 2^-24 sum |a b|.
TEST(CudaEmuCublas, LtMatmulMatchesADoubleReference) {
    cudaStream_t     s = make_stream();
    cublasLtHandle_t lt = nullptr;
    cublasHandle_t   blas = nullptr;
    ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cublasSetStream(blas, s), CUBLAS_STATUS_SUCCESS);
    std::mt19937 rng(7);
    const size_t m = 40, n = 24, k = 56;

    for (bool bf16 : {false, true}) {
        for (int t = 0; t < 4; ++t) {
            for (bool with_bias : {false, true}) {
                const cublasOperation_t ta = (t & 1) ? CUBLAS_OP_T : CUBLAS_OP_N;
                const cublasOperation_t tb = (t & 2) ? CUBLAS_OP_T : CUBLAS_OP_N;
                const Matrix a(ta == CUBLAS_OP_N ? m : k, ta == CUBLAS_OP_N ? k : m, bf16, rng);
                const Matrix b(tb == CUBLAS_OP_N ? k : n, tb == CUBLAS_OP_N ? n : k, bf16, rng);
                const Matrix bias(m, 1, false, rng);
                float *      d      = device_alloc<float>(m * n);
                float *      d_blas = device_alloc<float>(m * n);
                int          found  = 0;
                const float * bias_ptr = with_bias ? static_cast<float *>(bias.device) : nullptr;
                ASSERT_EQ(lt_matmul(lt, s, ta, tb, a, b, d, m, n, bias_ptr, 0.0f, &found),
                          CUBLAS_STATUS_SUCCESS);
                ASSERT_EQ(found, 1);
                const float alpha = 1.0f, beta = 0.0f;
                const cudaDataType_t type = bf16 ? CUDA_R_16BF : CUDA_R_32F;
                ASSERT_EQ(cublasGemmEx(blas, ta, tb, static_cast<int>(m), static_cast<int>(n), static_cast<int>(k),
                                       &alpha, a.device, type, static_cast<int>(a.rows), b.device, type,
                                       static_cast<int>(b.rows), &beta, d_blas, CUDA_R_32F, static_cast<int>(m),
                                       CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT),
                          CUBLAS_STATUS_SUCCESS);
                std::vector<float> got(m * n), got_blas(m * n);
                ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
                ASSERT_EQ(cudaMemcpy(got.data(), d, m * n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
                ASSERT_EQ(cudaMemcpy(got_blas.data(), d_blas, m * n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
                for (size_t j = 0; j < n; ++j) {
                    for (size_t i = 0; i < m; ++i) {
                        double exact = 0.0, magnitude = 0.0;
                        for (size_t p = 0; p < k; ++p) {
                            const double x = ta == CUBLAS_OP_N ? a.at(i, p) : a.at(p, i);
                            const double y = tb == CUBLAS_OP_N ? b.at(p, j) : b.at(j, p);
                            exact += x * y;
                            magnitude += std::fabs(x * y);
                        }
                        const double tolerance = 2.0 * k * std::ldexp(1.0, -24) * magnitude + 1e-30;
                        const double with      = exact + (with_bias ? bias.at(i, 0) : 0.0);
                        const double rounding  = with_bias ? std::ldexp(1.0, -23) * (std::fabs(exact) + 1.0) : 0.0;
                        ASSERT_NEAR(got[j * m + i], with, tolerance + rounding)
                            << "bf16 " << bf16 << " transa " << ta << " transb " << tb << " bias " << with_bias
                            << " at (" << i << ", " << j << ")";
                        // cublasGemmEx computes the same sums in the same order: the same bits before the bias.
                        ASSERT_NEAR(got_blas[j * m + i], exact, tolerance);
                        if (!with_bias) {
                            ASSERT_EQ(got_blas[j * m + i], got[j * m + i]);
                        }
                    }
                }
                cudaFree(d);
                cudaFree(d_blas);
            }
        }
    }
    cublasLtDestroy(lt);
    cublasDestroy(blas);
    cudaStreamDestroy(s);
}

// Accumulation (beta = 1) adds to what C holds; beta = 0 never reads C (a NaN there does not propagate).
TEST(CudaEmuCublas, BetaAccumulatesAndZeroBetaIgnoresC) {
    cudaStream_t     s  = make_stream();
    cublasLtHandle_t lt = nullptr;
    ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    std::mt19937 rng(3);
    const size_t m = 8, n = 8, k = 8;
    const Matrix a(m, k, false, rng), b(k, n, false, rng);
    float *      d = device_alloc<float>(m * n);
    std::vector<float> nan(m * n, std::nanf("")), first(m * n), second(m * n);
    ASSERT_EQ(cudaMemcpy(d, nan.data(), m * n * 4, cudaMemcpyHostToDevice), cudaSuccess);
    int found = 0;
    ASSERT_EQ(lt_matmul(lt, s, CUBLAS_OP_N, CUBLAS_OP_N, a, b, d, m, n, nullptr, 0.0f, &found), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(first.data(), d, m * n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (float v : first) ASSERT_FALSE(std::isnan(v));
    ASSERT_EQ(lt_matmul(lt, s, CUBLAS_OP_N, CUBLAS_OP_N, a, b, d, m, n, nullptr, 1.0f, &found), CUBLAS_STATUS_SUCCESS);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    ASSERT_EQ(cudaMemcpy(second.data(), d, m * n * 4, cudaMemcpyDeviceToHost), cudaSuccess);
    for (size_t i = 0; i < m * n; ++i) ASSERT_EQ(second[i], first[i] + first[i]);
    cudaFree(d);
    cublasLtDestroy(lt);
    cudaStreamDestroy(s);
}

// The heuristic has no kernel for an operand aligned to less than 16 bytes, nor for a leading dimension
// that is not a multiple of 16 bytes; a matmul given pointers less aligned than its algorithm assumed fails.
TEST(CudaEmuCublas, HeuristicRefusesMisalignedOperands) {
    cudaStream_t     s  = make_stream();
    cublasLtHandle_t lt = nullptr;
    ASSERT_EQ(cublasLtCreate(&lt), CUBLAS_STATUS_SUCCESS);
    float * buffer = device_alloc<float>(4096);

    auto heuristic = [&](uint32_t align_a, int64_t lda, int * found) {
        cublasLtMatmulDesc_t       desc = nullptr;
        cublasLtMatrixLayout_t     la = nullptr, lb = nullptr, lc = nullptr;
        cublasLtMatmulPreference_t pref = nullptr;
        cublasLtMatmulDescCreate(&desc, CUBLAS_COMPUTE_32F, CUDA_R_32F);
        cublasLtMatrixLayoutCreate(&la, CUDA_R_32F, 8, 8, lda);
        cublasLtMatrixLayoutCreate(&lb, CUDA_R_32F, 8, 8, 8);
        cublasLtMatrixLayoutCreate(&lc, CUDA_R_32F, 8, 8, 8);
        cublasLtMatmulPreferenceCreate(&pref);
        cublasLtMatmulPreferenceSetAttribute(pref, CUBLASLT_MATMUL_PREF_MIN_ALIGNMENT_A_BYTES, &align_a,
                                             sizeof(align_a));
        cublasLtMatmulHeuristicResult_t result{};
        const cublasStatus_t status = cublasLtMatmulAlgoGetHeuristic(lt, desc, la, lb, lc, lc, pref, 1, &result, found);
        if (status == CUBLAS_STATUS_SUCCESS && *found == 1) {
            // A misaligned A for an algorithm chosen for 16-byte alignment.
            const float alpha = 1.0f, beta = 0.0f;
            EXPECT_EQ(cublasLtMatmul(lt, desc, &alpha, buffer + 1, la, buffer + 512, lb, &beta, buffer + 1024, lc,
                                     buffer + 1024, lc, &result.algo, nullptr, 0, s),
                      CUBLAS_STATUS_INVALID_VALUE);
        }
        cublasLtMatmulPreferenceDestroy(pref);
        cublasLtMatrixLayoutDestroy(la);
        cublasLtMatrixLayoutDestroy(lb);
        cublasLtMatrixLayoutDestroy(lc);
        cublasLtMatmulDescDestroy(desc);
        return status;
    };
    int found = -1;
    EXPECT_EQ(heuristic(16, 8, &found), CUBLAS_STATUS_SUCCESS);
    EXPECT_EQ(found, 1);
    EXPECT_EQ(heuristic(4, 8, &found), CUBLAS_STATUS_NOT_SUPPORTED);
    EXPECT_EQ(found, 0);
    EXPECT_EQ(heuristic(256, 9, &found), CUBLAS_STATUS_NOT_SUPPORTED);   // 36-byte columns
    EXPECT_EQ(found, 0);
    ASSERT_EQ(cudaStreamSynchronize(s), cudaSuccess);
    cudaFree(buffer);
    cublasLtDestroy(lt);
    cudaStreamDestroy(s);
}

// Creating a cuBLAS handle allocates: inside a thread-local capture it fails and invalidates the capture
// (gemm.h: handles are created before a capture begins).
TEST(CudaEmuCublas, HandleCreationInsideACaptureFails) {
    cudaStream_t s = make_stream();
    ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
    cublasHandle_t blas = nullptr;
    EXPECT_EQ(cublasCreate(&blas), CUBLAS_STATUS_ALLOC_FAILED);
    cudaGraph_t graph = nullptr;
    EXPECT_EQ(cudaStreamEndCapture(s, &graph), cudaErrorStreamCaptureInvalidated);
    cudaGetLastError();
    cudaStreamDestroy(s);
}

// cuBLAS's own workspace pool allocates a stream's buffer at the stream's first GEMM: a GEMM captured on a
// stream that never ran one breaks the capture, unless the handle was given a workspace (cublasSetWorkspace,
// after cublasSetStream, which resets it) — what backend/cuda/gemm.cpp's fallback does.
TEST(CudaEmuCublas, FirstGemmOnAStreamAllocatesUnlessGivenAWorkspace) {
    float * buffer = device_alloc<float>(4096);
    void *  workspace = nullptr;
    ASSERT_EQ(cudaMalloc(&workspace, size_t{1} << 20), cudaSuccess);
    cublasHandle_t blas = nullptr;
    ASSERT_EQ(cublasCreate(&blas), CUBLAS_STATUS_SUCCESS);
    const float alpha = 1.0f, beta = 0.0f;
    auto gemm = [&] {
        return cublasGemmEx(blas, CUBLAS_OP_N, CUBLAS_OP_N, 8, 8, 8, &alpha, buffer, CUDA_R_32F, 8, buffer + 64,
                            CUDA_R_32F, 8, &beta, buffer + 128, CUDA_R_32F, 8, CUBLAS_COMPUTE_32F, CUBLAS_GEMM_DEFAULT);
    };
    for (bool given : {false, true}) {
        cudaStream_t s = make_stream();
        ASSERT_EQ(cublasSetStream(blas, s), CUBLAS_STATUS_SUCCESS);
        if (given) {
            ASSERT_EQ(cublasSetWorkspace(blas, workspace, size_t{1} << 20), CUBLAS_STATUS_SUCCESS);
        }
        ASSERT_EQ(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal), cudaSuccess);
        gemm();
        cudaGraph_t graph = nullptr;
        EXPECT_EQ(cudaStreamEndCapture(s, &graph), given ? cudaSuccess : cudaErrorStreamCaptureInvalidated)
            << (given ? "with a workspace" : "cuBLAS's own pool");
        if (graph != nullptr) cudaGraphDestroy(graph);
        cudaGetLastError();
        cudaStreamDestroy(s);
    }
    cublasDestroy(blas);
    cudaFree(workspace);
    cudaFree(buffer);
}
