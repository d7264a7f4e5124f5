// The emulated device's CUDA runtime (cuda-emu): devices, memory, streams, events, stream capture and
// graphs with CUDA's semantics, on the host. It is meant to fail where a GPU would: work runs asynchronously
// on a worker thread per stream, so a missing event wait is a real race; fresh device memory holds a garbage
// pattern, so a read before the first write shows; a kernel fault is a sticky error; and the capture rules
// (forks and joins, unsafe calls, isolation) are CUDA's, so a capture a GPU would refuse is refused here.
//
// State. One process-wide mutex (State::mutex) guards the registries (allocations, streams, events) and all
// capture state. Each stream has its own mutex and condition variable for its queue and progress counters;
// the order is State::mutex, then a stream's. A stream's worker never takes State::mutex while it holds its
// own, and runs work with no lock held, so work may call back into the runtime (the kernel engine's
// launches do not, but an NCCL operation's bookkeeping may).
//
// Positions. A stream counts the items enqueued on it and the items completed; an event's record is the
// pair (stream, count after its marker), complete once the stream's completed count reaches it. A wait is an
// item that blocks its worker until another stream's completed count reaches the recorded position.
//
// Environment: LOOM_EMU_DEVICES (device count, default 8), LOOM_EMU_MEMORY_MB (each device's memory,
// default 16384), both read once at first use.
#include <cuda_runtime.h>

#include "runtime_internal.h"

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <exception>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>
#include <thread>
#include <unordered_map>
#include <unordered_set>
#include <vector>

namespace loom_emu {

namespace {

constexpr unsigned char kGarbageByte   = 0xA5;   // fresh device memory: 0xA5A5A5A5 is -2.9e-16 as f32
constexpr size_t        kDeviceAlign   = 256;    // cudaMalloc's alignment
constexpr size_t        kHostAlign     = 4096;   // pinned memory is page aligned
constexpr int           kRuntimeVersion = 12080;
constexpr int           kDriverVersion  = 12080;

enum class AllocKind { device, pinned_host };

struct Allocation {
    size_t    size;
    AllocKind kind;
    int       device;
};

struct Capture;

// One item of a stream's queue: its work and the name errors give it.
struct Item {
    std::function<void()> work;
    std::string           name;
};

// The queue of one stream and its worker. `enqueued` counts the items pushed, `completed` those done.
struct StreamQueue {
    int          device;
    unsigned int flags;
    bool         legacy;

    std::mutex              mutex;
    std::condition_variable cv;   // new items (the worker), progress (waiters)
    std::deque<Item>        items;
    uint64_t                enqueued  = 0;
    uint64_t                completed = 0;
    bool                    stopping  = false;
    std::thread             worker;   // started by the first enqueue

    StreamQueue(int d, unsigned int f, bool l) : device(d), flags(f), legacy(l) {}
};

}  // namespace

// cudaStream_t points at a StreamState; its queue is shared with the event records that refer to it, so a
// record stays readable after the stream is destroyed.
struct StreamState {
    std::shared_ptr<StreamQueue> queue;
    // Capture state, guarded by State::mutex: the capture this stream takes part in, and its current
    // dependencies in that capture's graph (node indices; kRoot is the capture's start).
    Capture *         capture = nullptr;
    std::vector<long> frontier;
};

namespace {

constexpr long kRoot = -1;

// A node of a captured graph: work run at each replay, or a wait on an event recorded outside any capture
// (cudaEventWaitExternal), resolved at each launch to the event's latest record.
struct Node {
    std::function<void()> work;
    std::string           name;
    EventState *          external_event = nullptr;
    std::vector<long>     deps;
};

struct Record {
    std::shared_ptr<StreamQueue> queue;      // null: never recorded (complete)
    uint64_t                     position = 0;
};

}  // namespace

struct GraphNodeState {
    char unused;
};

struct GraphState {
    int                         device = 0;
    std::vector<Node>           nodes;
    std::vector<GraphNodeState> handles;   // cudaGraphGetNodes's node handles
};

struct GraphExecState {
    int                                      device = 0;
    std::shared_ptr<const std::vector<Node>> nodes;
    Record                                   last_launch;   // where the latest launch ends (launches serialize)
};

struct EventState {
    int          device;
    unsigned int flags;
    // The last record: outside any capture (record.queue set, or nothing), or inside capture `capture_id`
    // (an edge of that capture's graph: `frontier` is the recording stream's dependencies at the record).
    Record             record;
    unsigned long long capture_id = 0;
    std::vector<long>  frontier;
};

namespace {

struct Capture {
    unsigned long long         id;
    cudaStreamCaptureMode      mode;
    std::thread::id            thread;
    StreamState *              origin;
    GraphState *               graph;
    std::vector<StreamState *> streams;   // origin first, then forked streams
    bool                       invalidated = false;
};

size_t env_size(const char * name, size_t fallback) {
    const char * value = std::getenv(name);
    if (value == nullptr || *value == '\0') return fallback;
    char *             end = nullptr;
    unsigned long long v   = std::strtoull(value, &end, 10);
    if (end == value || *end != '\0') {
        std::fprintf(stderr, "loom_emu: ignoring %s=%s (not a number)\n", name, value);
        return fallback;
    }
    return static_cast<size_t>(v);
}

struct State {
    std::mutex mutex;

    int                 device_count;
    size_t              capacity;          // bytes per device
    std::vector<size_t> used;              // bytes allocated per device

    std::map<uintptr_t, Allocation> allocations;   // by start address

    std::unordered_map<StreamState *, std::unique_ptr<StreamState>> streams;
    std::vector<std::unique_ptr<StreamState>>                       legacy;   // per device, created lazily
    std::unordered_set<EventState *>                                events;
    std::unordered_set<GraphState *>                                graphs;
    std::unordered_set<GraphExecState *>                            execs;

    std::map<unsigned long long, Capture *> captures;   // active ones
    unsigned long long                      next_capture_id = 1;

    std::mutex                         smem_mutex;
    std::unordered_map<const void *, size_t> smem;   // cudaFuncSetAttribute's dynamic shared memory

    std::atomic<int> sticky{cudaSuccess};

    State() {
        device_count = static_cast<int>(env_size("LOOM_EMU_DEVICES", 8));
        capacity     = env_size("LOOM_EMU_MEMORY_MB", 16384) << 20;
        used.assign(static_cast<size_t>(std::max(device_count, 0)), 0);
        legacy.resize(used.size());
    }
};

// Never destroyed: worker threads may still run while static objects of other translation units (the
// backend's devices and their streams) are destroyed at exit.
State & state() {
    static State * s = new State;
    return *s;
}

thread_local int                   t_device       = 0;
thread_local cudaError_t           t_last_error   = cudaSuccess;
thread_local cudaStreamCaptureMode t_capture_mode = cudaStreamCaptureModeGlobal;
thread_local StreamQueue *         t_worker_of    = nullptr;   // set on a stream's worker thread

// Every runtime call's result goes through here: a failure becomes the thread's last error (not NotReady,
// which is a status rather than an error, as in CUDA).
cudaError_t result(cudaError_t error) {
    if (error != cudaSuccess && error != cudaErrorNotReady) t_last_error = error;
    return error;
}

cudaError_t sticky() { return static_cast<cudaError_t>(state().sticky.load()); }

// ---- Queues

void wait_position(StreamQueue & q, uint64_t position) {
    std::unique_lock<std::mutex> lock(q.mutex);
    q.cv.wait(lock, [&] { return q.completed >= position; });
}

bool reached(const Record & r) {
    if (!r.queue) return true;
    std::lock_guard<std::mutex> lock(r.queue->mutex);
    return r.queue->completed >= r.position;
}

void run_worker(StreamQueue * q) {
    t_device    = q->device;
    t_worker_of = q;
    for (;;) {
        Item item;
        {
            std::unique_lock<std::mutex> lock(q->mutex);
            q->cv.wait(lock, [&] { return !q->items.empty() || q->stopping; });
            if (q->items.empty()) return;
            item = std::move(q->items.front());
            q->items.pop_front();
        }
        // After a fault the device's context is lost: nothing more runs, but positions still advance so no
        // waiter hangs.
        if (sticky() == cudaSuccess) {
            try {
                item.work();
            } catch (const std::exception & e) {
                std::fprintf(stderr, "loom_emu: '%s' failed on stream %p of device %d: %s\n", item.name.c_str(),
                             static_cast<void *>(q), q->device, e.what());
                state().sticky.store(cudaErrorLaunchFailure);
            } catch (...) {
                std::fprintf(stderr, "loom_emu: '%s' failed on stream %p of device %d (a non-standard exception)\n",
                             item.name.c_str(), static_cast<void *>(q), q->device);
                state().sticky.store(cudaErrorLaunchFailure);
            }
        }
        item = Item{};   // the closure's captures are released before the position advances
        {
            std::lock_guard<std::mutex> lock(q->mutex);
            ++q->completed;
        }
        q->cv.notify_all();
    }
}

// Appends to a stream's queue; returns the position the item completes at.
uint64_t push(StreamQueue & q, std::function<void()> work, std::string name) {
    uint64_t position;
    {
        std::lock_guard<std::mutex> lock(q.mutex);
        if (!q.worker.joinable()) q.worker = std::thread(run_worker, &q);
        q.items.push_back(Item{std::move(work), std::move(name)});
        position = ++q.enqueued;
    }
    q.cv.notify_all();
    return position;
}

uint64_t tail_position(StreamQueue & q) {
    std::lock_guard<std::mutex> lock(q.mutex);
    return q.enqueued;
}

void stop(StreamQueue & q) {
    {
        std::lock_guard<std::mutex> lock(q.mutex);
        q.stopping = true;
    }
    q.cv.notify_all();
    if (q.worker.joinable()) {
        if (q.worker.get_id() == std::this_thread::get_id()) {
            q.worker.detach();
        } else {
            q.worker.join();
        }
    }
}

// ---- Streams, resolved under State::mutex

StreamState * legacy_stream_locked(int device) {
    State & s = state();
    auto &  slot = s.legacy[static_cast<size_t>(device)];
    if (!slot) {
        slot        = std::make_unique<StreamState>();
        slot->queue = std::make_shared<StreamQueue>(device, cudaStreamDefault, true);
    }
    return slot.get();
}

// nullptr is the current device's legacy stream; anything else must be a live stream.
StreamState * resolve_locked(cudaStream_t stream) {
    State & s = state();
    if (stream == nullptr) {
        if (t_device < 0 || t_device >= s.device_count) return nullptr;
        return legacy_stream_locked(t_device);
    }
    return s.streams.count(stream) != 0 ? stream : nullptr;
}

// The legacy stream's implicit ordering with blocking streams (those created without cudaStreamNonBlocking)
// of its device: work on one waits for what was enqueued on the others before it.
void add_implicit_waits_locked(StreamState * st) {
    State &       s = state();
    StreamQueue & q = *st->queue;
    if (q.flags & cudaStreamNonBlocking) return;
    std::vector<Record> waits;
    auto                consider = [&](StreamState * other) {
        if (other == st || other->queue->device != q.device || (other->queue->flags & cudaStreamNonBlocking)) return;
        Record r{other->queue, tail_position(*other->queue)};
        if (!reached(r)) waits.push_back(r);
    };
    if (q.legacy) {
        for (auto & entry : s.streams) consider(entry.first);
    } else if (s.legacy[static_cast<size_t>(q.device)]) {
        consider(s.legacy[static_cast<size_t>(q.device)].get());
    }
    for (Record & r : waits) {
        push(q, [r] { wait_position(*r.queue, r.position); }, "implicit legacy-stream wait");
    }
}

// ---- Capture

void invalidate(Capture * c) {
    if (c != nullptr) c->invalidated = true;
}

// CUDA's rule for potentially unsafe calls (allocation, synchronous copies) while captures are active: a
// thread in relaxed mode may make them; otherwise not while it has a capture of its own that was not begun
// in relaxed mode, nor, in global mode, while another thread has a capture begun in global mode. The
// offending captures are invalidated.
cudaError_t check_unsafe_call_locked() {
    if (t_capture_mode == cudaStreamCaptureModeRelaxed) return cudaSuccess;
    bool refused = false;
    for (auto & entry : state().captures) {
        Capture * c = entry.second;
        if (c->mode == cudaStreamCaptureModeRelaxed) continue;
        const bool mine = c->thread == std::this_thread::get_id();
        if (mine || (t_capture_mode == cudaStreamCaptureModeGlobal && c->mode == cudaStreamCaptureModeGlobal)) {
            invalidate(c);
            refused = true;
        }
    }
    return refused ? cudaErrorStreamCaptureUnsupported : cudaSuccess;
}

// Whether the legacy stream of `device` may be used: not while a blocking stream of the device captures
// (the implicit dependency would cross the capture's boundary).
cudaError_t check_legacy_use_locked(int device) {
    for (auto & entry : state().captures) {
        for (StreamState * st : entry.second->streams) {
            if (st->queue->device == device && !(st->queue->flags & cudaStreamNonBlocking)) {
                invalidate(entry.second);
                return cudaErrorStreamCaptureImplicit;
            }
        }
    }
    return cudaSuccess;
}

long add_node_locked(StreamState * st, Node node) {
    Capture * c = st->capture;
    node.deps   = st->frontier;
    c->graph->nodes.push_back(std::move(node));
    const long index = static_cast<long>(c->graph->nodes.size()) - 1;
    st->frontier.assign(1, index);
    return index;
}

void leave_capture_locked(Capture * c) {
    for (StreamState * st : c->streams) {
        st->capture = nullptr;
        st->frontier.clear();
    }
    state().captures.erase(c->id);
}

// True when every forked stream's dependencies are among the origin's (it has been joined).
bool joined_locked(const Capture & c) {
    const std::vector<Node> & nodes = c.graph->nodes;
    std::vector<char>         ancestor(nodes.size(), 0);
    std::vector<long>         todo(c.origin->frontier);
    while (!todo.empty()) {
        const long n = todo.back();
        todo.pop_back();
        if (n == kRoot || ancestor[static_cast<size_t>(n)]) continue;
        ancestor[static_cast<size_t>(n)] = 1;
        for (long d : nodes[static_cast<size_t>(n)].deps) todo.push_back(d);
    }
    for (StreamState * st : c.streams) {
        if (st == c.origin) continue;
        for (long n : st->frontier) {
            if (n != kRoot && !ancestor[static_cast<size_t>(n)]) return false;
        }
    }
    return true;
}

// Enqueues work on a resolved stream (capturing or not); State::mutex held.
cudaError_t enqueue_locked(StreamState * st, std::function<void()> work, const char * name) {
    if (st->capture != nullptr) {
        if (st->capture->invalidated) return cudaErrorStreamCaptureInvalidated;
        add_node_locked(st, Node{std::move(work), name != nullptr ? name : "work", nullptr, {}});
        return cudaSuccess;
    }
    if (st->queue->legacy) {
        if (cudaError_t e = check_legacy_use_locked(st->queue->device); e != cudaSuccess) return e;
    }
    add_implicit_waits_locked(st);
    push(*st->queue, std::move(work), name != nullptr ? name : "work");
    return cudaSuccess;
}

// ---- Memory registry (State::mutex held)

const Allocation * find_locked(const void * p, uintptr_t * start = nullptr) {
    State &         s       = state();
    const uintptr_t address = reinterpret_cast<uintptr_t>(p);
    auto            it      = s.allocations.upper_bound(address);
    if (it == s.allocations.begin()) return nullptr;
    --it;
    if (address >= it->first + std::max<size_t>(it->second.size, 1)) return nullptr;
    if (start != nullptr) *start = it->first;
    return &it->second;
}

// Checks that [p, p + bytes) lies in one allocation the device can address (device memory, or pinned host
// memory, which is mapped for every device); `device_side` false asks for host-addressable memory instead.
cudaError_t check_range_locked(const void * p, size_t bytes, bool device_side) {
    if (bytes == 0) return cudaSuccess;
    if (p == nullptr) return cudaErrorInvalidValue;
    uintptr_t          start = 0;
    const Allocation * a     = find_locked(p, &start);
    if (device_side) {
        if (a == nullptr) return cudaErrorInvalidValue;
    } else {
        if (a == nullptr) return cudaSuccess;   // pageable host memory
        if (a->kind == AllocKind::device) return cudaErrorInvalidValue;
    }
    if (reinterpret_cast<uintptr_t>(p) + bytes > start + a->size) return cudaErrorInvalidValue;
    return cudaSuccess;
}

bool is_pageable_locked(const void * p) { return find_locked(p) == nullptr; }

// Validates a copy's ranges for its direction. cudaMemcpyDefault infers it from the registry (unified
// addressing); an explicit direction must match the pointers.
cudaError_t check_copy_locked(void * dst, const void * src, size_t bytes, cudaMemcpyKind kind) {
    if (bytes == 0) return cudaSuccess;
    if (dst == nullptr || src == nullptr) return cudaErrorInvalidValue;
    switch (kind) {
        case cudaMemcpyHostToHost:
            if (cudaError_t e = check_range_locked(src, bytes, false); e != cudaSuccess) return e;
            return check_range_locked(dst, bytes, false);
        case cudaMemcpyHostToDevice:
            if (cudaError_t e = check_range_locked(src, bytes, false); e != cudaSuccess) return e;
            return check_range_locked(dst, bytes, true);
        case cudaMemcpyDeviceToHost:
            if (cudaError_t e = check_range_locked(src, bytes, true); e != cudaSuccess) return e;
            return check_range_locked(dst, bytes, false);
        case cudaMemcpyDeviceToDevice:
            if (cudaError_t e = check_range_locked(src, bytes, true); e != cudaSuccess) return e;
            return check_range_locked(dst, bytes, true);
        case cudaMemcpyDefault: {
            // Each side is checked against what it is: registered ranges must hold the whole copy.
            for (const void * p : {static_cast<const void *>(dst), src}) {
                if (find_locked(p) != nullptr) {
                    if (cudaError_t e = check_range_locked(p, bytes, true); e != cudaSuccess) return e;
                }
            }
            return cudaSuccess;
        }
    }
    return cudaErrorInvalidMemcpyDirection;
}

void wait_device_streams_locked(int device, std::vector<Record> & out) {
    State & s = state();
    for (auto & entry : s.streams) {
        StreamQueue & q = *entry.first->queue;
        if (q.device == device) out.push_back(Record{entry.first->queue, tail_position(q)});
    }
    if (s.legacy[static_cast<size_t>(device)]) {
        StreamQueue & q = *s.legacy[static_cast<size_t>(device)]->queue;
        out.push_back(Record{s.legacy[static_cast<size_t>(device)]->queue, tail_position(q)});
    }
}

// Waits, without State::mutex, for the positions gathered under it (never for the calling worker's own).
void wait_all(const std::vector<Record> & records) {
    for (const Record & r : records) {
        if (r.queue && t_worker_of != r.queue.get()) wait_position(*r.queue, r.position);
    }
}

// A synchronous copy or memset: the work runs on the legacy stream of the current device, and the call
// returns once it has run.
cudaError_t run_synchronously(std::function<void()> work, const char * name) {
    StreamState * st = nullptr;
    Record        done;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (cudaError_t e = check_unsafe_call_locked(); e != cudaSuccess) return e;
        st = resolve_locked(nullptr);
        if (st == nullptr) return cudaErrorInvalidDevice;
        if (cudaError_t e = enqueue_locked(st, std::move(work), name); e != cudaSuccess) return e;
        done = Record{st->queue, tail_position(*st->queue)};
    }
    wait_all({done});
    return sticky();
}

}  // namespace

// ---- base.h

cudaError_t enqueue(cudaStream_t stream, std::function<void()> work, const char * name) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return e;
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr) return cudaErrorInvalidResourceHandle;
    return enqueue_locked(st, std::move(work), name);
}

void set_last_error(cudaError_t error) {
    if (error != cudaSuccess) t_last_error = error;
}

size_t kernel_max_dynamic_smem(const void * kernel) {
    State &                     s = state();
    std::lock_guard<std::mutex> lock(s.smem_mutex);
    auto                        it = s.smem.find(kernel);
    return it == s.smem.end() ? kDefaultSharedMemoryPerBlock : it->second;
}

// ---- Errors and versions

cudaError_t cudaGetLastError() {
    if (cudaError_t e = sticky(); e != cudaSuccess) return e;
    const cudaError_t e = t_last_error;
    t_last_error        = cudaSuccess;
    return e;
}

cudaError_t cudaPeekAtLastError() {
    if (cudaError_t e = sticky(); e != cudaSuccess) return e;
    return t_last_error;
}

namespace {

struct ErrorText {
    cudaError_t  code;
    const char * name;
    const char * text;
};

constexpr ErrorText kErrorTexts[] = {
    {cudaSuccess, "cudaSuccess", "no error"},
    {cudaErrorInvalidValue, "cudaErrorInvalidValue", "invalid argument"},
    {cudaErrorMemoryAllocation, "cudaErrorMemoryAllocation", "out of memory"},
    {cudaErrorInitializationError, "cudaErrorInitializationError", "initialization error"},
    {cudaErrorInvalidConfiguration, "cudaErrorInvalidConfiguration", "invalid configuration argument"},
    {cudaErrorInvalidPitchValue, "cudaErrorInvalidPitchValue", "invalid pitch argument"},
    {cudaErrorInvalidSymbol, "cudaErrorInvalidSymbol", "invalid device symbol"},
    {cudaErrorInvalidDevicePointer, "cudaErrorInvalidDevicePointer", "invalid device pointer"},
    {cudaErrorInvalidMemcpyDirection, "cudaErrorInvalidMemcpyDirection", "invalid copy direction for memcpy"},
    {cudaErrorNoDevice, "cudaErrorNoDevice", "no CUDA-capable device is detected"},
    {cudaErrorInvalidDevice, "cudaErrorInvalidDevice", "invalid device ordinal"},
    {cudaErrorInvalidResourceHandle, "cudaErrorInvalidResourceHandle", "invalid resource handle"},
    {cudaErrorIllegalState, "cudaErrorIllegalState", "the operation cannot be performed in the present state"},
    {cudaErrorNotReady, "cudaErrorNotReady", "device not ready"},
    {cudaErrorIllegalAddress, "cudaErrorIllegalAddress", "an illegal memory access was encountered"},
    {cudaErrorMisalignedAddress, "cudaErrorMisalignedAddress", "misaligned address"},
    {cudaErrorLaunchFailure, "cudaErrorLaunchFailure", "unspecified launch failure"},
    {cudaErrorNotSupported, "cudaErrorNotSupported", "operation not supported"},
    {cudaErrorStreamCaptureUnsupported, "cudaErrorStreamCaptureUnsupported",
     "operation not permitted when stream is capturing"},
    {cudaErrorStreamCaptureInvalidated, "cudaErrorStreamCaptureInvalidated",
     "operation failed due to a previous error during capture"},
    {cudaErrorStreamCaptureMerge, "cudaErrorStreamCaptureMerge",
     "operation would result in a merge of separate capture sequences"},
    {cudaErrorStreamCaptureUnmatched, "cudaErrorStreamCaptureUnmatched",
     "capture was not ended in the same stream as it began"},
    {cudaErrorStreamCaptureUnjoined, "cudaErrorStreamCaptureUnjoined", "capturing stream has unjoined work"},
    {cudaErrorStreamCaptureIsolation, "cudaErrorStreamCaptureIsolation",
     "dependency created on uncaptured work in another stream"},
    {cudaErrorStreamCaptureImplicit, "cudaErrorStreamCaptureImplicit",
     "operation would make the legacy stream depend on a capturing blocking stream"},
    {cudaErrorCapturedEvent, "cudaErrorCapturedEvent",
     "operation not permitted on an event last recorded in a capturing stream"},
    {cudaErrorStreamCaptureWrongThread, "cudaErrorStreamCaptureWrongThread",
     "attempt to terminate a thread-local capture sequence from another thread"},
    {cudaErrorUnknown, "cudaErrorUnknown", "unknown error"},
};

const ErrorText * error_text(cudaError_t error) {
    for (const ErrorText & t : kErrorTexts) {
        if (t.code == error) return &t;
    }
    return nullptr;
}

}  // namespace

const char * cudaGetErrorString(cudaError_t error) {
    const ErrorText * t = error_text(error);
    return t != nullptr ? t->text : "unrecognized error code";
}

const char * cudaGetErrorName(cudaError_t error) {
    const ErrorText * t = error_text(error);
    return t != nullptr ? t->name : "cudaErrorUnknown";
}

cudaError_t cudaRuntimeGetVersion(int * runtimeVersion) {
    if (runtimeVersion == nullptr) return result(cudaErrorInvalidValue);
    *runtimeVersion = kRuntimeVersion;
    return cudaSuccess;
}

cudaError_t cudaDriverGetVersion(int * driverVersion) {
    if (driverVersion == nullptr) return result(cudaErrorInvalidValue);
    *driverVersion = kDriverVersion;
    return cudaSuccess;
}

// ---- Devices

cudaError_t cudaGetDeviceCount(int * count) {
    if (count == nullptr) return result(cudaErrorInvalidValue);
    *count = state().device_count;
    return *count > 0 ? cudaSuccess : result(cudaErrorNoDevice);
}

cudaError_t cudaSetDevice(int device) {
    if (device < 0 || device >= state().device_count) return result(cudaErrorInvalidDevice);
    t_device = device;
    return sticky() != cudaSuccess ? result(sticky()) : cudaSuccess;
}

cudaError_t cudaGetDevice(int * device) {
    if (device == nullptr) return result(cudaErrorInvalidValue);
    if (state().device_count <= 0) return result(cudaErrorNoDevice);
    *device = t_device;
    return cudaSuccess;
}

cudaError_t cudaGetDeviceProperties(cudaDeviceProp * prop, int device) {
    if (prop == nullptr) return result(cudaErrorInvalidValue);
    if (device < 0 || device >= state().device_count) return result(cudaErrorInvalidDevice);
    *prop = cudaDeviceProp{};
    std::snprintf(prop->name, sizeof(prop->name), "Loom emulated device %d", device);
    prop->totalGlobalMem         = state().capacity;
    prop->sharedMemPerBlock      = kDefaultSharedMemoryPerBlock;
    prop->sharedMemPerBlockOptin = kMaxSharedMemoryPerBlock;
    prop->regsPerBlock           = 65536;
    prop->warpSize               = kWarpSize;
    prop->maxThreadsPerBlock     = static_cast<int>(kMaxThreadsPerBlock);
    prop->maxThreadsDim[0] = prop->maxThreadsDim[1] = 1024;
    prop->maxThreadsDim[2] = 64;
    prop->maxGridSize[0]   = 0x7fffffff;
    prop->maxGridSize[1] = prop->maxGridSize[2] = 65535;
    prop->multiProcessorCount = 132;
    prop->major               = 9;
    prop->minor               = 0;
    prop->unifiedAddressing   = 1;
    return cudaSuccess;
}

cudaError_t cudaDeviceSynchronize() {
    std::vector<Record> records;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        bool                        refused = false;
        for (auto & entry : state().captures) {
            for (StreamState * st : entry.second->streams) {
                if (st->queue->device == t_device) {
                    invalidate(entry.second);
                    refused = true;
                }
            }
        }
        if (refused) return result(cudaErrorStreamCaptureUnsupported);
        wait_device_streams_locked(t_device, records);
    }
    wait_all(records);
    return result(sticky());
}

cudaError_t cudaMemGetInfo(size_t * free, size_t * total) {
    if (free == nullptr || total == nullptr) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    State &                     s = state();
    std::lock_guard<std::mutex> lock(s.mutex);
    const size_t                used = s.used[static_cast<size_t>(t_device)];
    *total                           = s.capacity;
    *free                            = s.capacity > used ? s.capacity - used : 0;
    return cudaSuccess;
}

void emu_set_device_memory_capacity(size_t bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    state().capacity = bytes;
}

// ---- Memory

cudaError_t cudaMalloc(void ** devPtr, size_t size) {
    if (devPtr == nullptr) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    *devPtr = nullptr;
    if (size == 0) return cudaSuccess;
    State & s       = state();
    size_t  rounded = (size + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign;
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (cudaError_t e = check_unsafe_call_locked(); e != cudaSuccess) return result(e);
        size_t & used = s.used[static_cast<size_t>(t_device)];
        if (rounded > s.capacity || used > s.capacity - rounded) return result(cudaErrorMemoryAllocation);
        used += rounded;
    }
    void * p = std::aligned_alloc(kDeviceAlign, rounded);
    if (p == nullptr) {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.used[static_cast<size_t>(t_device)] -= rounded;
        return result(cudaErrorMemoryAllocation);
    }
    std::memset(p, kGarbageByte, rounded);
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.allocations[reinterpret_cast<uintptr_t>(p)] = Allocation{size, AllocKind::device, t_device};
    }
    *devPtr = p;
    return cudaSuccess;
}

cudaError_t cudaFree(void * devPtr) {
    if (devPtr == nullptr) return cudaSuccess;
    State &             s = state();
    std::vector<Record> records;
    int                 device = 0;
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (cudaError_t e = check_unsafe_call_locked(); e != cudaSuccess) return result(e);
        auto it = s.allocations.find(reinterpret_cast<uintptr_t>(devPtr));
        if (it == s.allocations.end() || it->second.kind != AllocKind::device) return result(cudaErrorInvalidValue);
        device = it->second.device;
        // cudaFree synchronizes the device: no kernel still running may use the memory being freed.
        wait_device_streams_locked(device, records);
    }
    wait_all(records);
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        auto                        it = s.allocations.find(reinterpret_cast<uintptr_t>(devPtr));
        if (it == s.allocations.end()) return result(cudaErrorInvalidValue);   // freed by another thread meanwhile
        s.used[static_cast<size_t>(device)] -= (it->second.size + kDeviceAlign - 1) / kDeviceAlign * kDeviceAlign;
        s.allocations.erase(it);
    }
    std::free(devPtr);
    return result(sticky());
}

cudaError_t cudaHostAlloc(void ** pHost, size_t size, unsigned int flags) {
    if (pHost == nullptr || flags > (cudaHostAllocPortable | cudaHostAllocMapped | cudaHostAllocWriteCombined)) {
        return result(cudaErrorInvalidValue);
    }
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    *pHost = nullptr;
    State & s = state();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (cudaError_t e = check_unsafe_call_locked(); e != cudaSuccess) return result(e);
    }
    const size_t rounded = (std::max<size_t>(size, 1) + kHostAlign - 1) / kHostAlign * kHostAlign;
    void *       p       = std::aligned_alloc(kHostAlign, rounded);
    if (p == nullptr) return result(cudaErrorMemoryAllocation);
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        s.allocations[reinterpret_cast<uintptr_t>(p)] = Allocation{size, AllocKind::pinned_host, t_device};
    }
    *pHost = p;
    return cudaSuccess;
}

cudaError_t cudaMallocHost(void ** ptr, size_t size) { return cudaHostAlloc(ptr, size, cudaHostAllocDefault); }

cudaError_t cudaFreeHost(void * ptr) {
    if (ptr == nullptr) return cudaSuccess;
    State & s = state();
    {
        std::lock_guard<std::mutex> lock(s.mutex);
        if (cudaError_t e = check_unsafe_call_locked(); e != cudaSuccess) return result(e);
        auto it = s.allocations.find(reinterpret_cast<uintptr_t>(ptr));
        if (it == s.allocations.end() || it->second.kind != AllocKind::pinned_host) {
            return result(cudaErrorInvalidValue);
        }
        s.allocations.erase(it);
    }
    std::free(ptr);
    return result(sticky());
}

cudaError_t cudaPointerGetAttributes(cudaPointerAttributes * attributes, const void * ptr) {
    if (attributes == nullptr) return result(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(state().mutex);
    const Allocation *          a = find_locked(ptr);
    if (a == nullptr) {
        *attributes = cudaPointerAttributes{cudaMemoryTypeUnregistered, -2, nullptr, nullptr};
        return cudaSuccess;
    }
    void * p = const_cast<void *>(ptr);
    if (a->kind == AllocKind::device) {
        *attributes = cudaPointerAttributes{cudaMemoryTypeDevice, a->device, p, nullptr};
    } else {
        *attributes = cudaPointerAttributes{cudaMemoryTypeHost, a->device, p, p};
    }
    return cudaSuccess;
}

namespace {

// The copy and memset work items; the captured pointers and sizes are the call's.
std::function<void()> copy_work(void * dst, const void * src, size_t bytes) {
    return [dst, src, bytes] {
        if (bytes > 0) std::memmove(dst, src, bytes);
    };
}

// An async copy or memset: validated now, run in stream order. A copy to or from pageable host memory is
// staged by CUDA, which makes it synchronous for the host; here the call waits for it to have run.
cudaError_t async_op(cudaStream_t stream, std::function<void()> work, const char * name, bool pageable) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return e;
    Record done;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        StreamState *               st = resolve_locked(stream);
        if (st == nullptr) return cudaErrorInvalidResourceHandle;
        if (cudaError_t e = enqueue_locked(st, std::move(work), name); e != cudaSuccess) return e;
        if (!pageable || st->capture != nullptr) return cudaSuccess;
        done = Record{st->queue, tail_position(*st->queue)};
    }
    wait_all({done});
    return sticky();
}

}  // namespace

cudaError_t cudaMemcpy(void * dst, const void * src, size_t count, cudaMemcpyKind kind) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (cudaError_t e = check_copy_locked(dst, src, count, kind); e != cudaSuccess) return result(e);
    }
    return result(run_synchronously(copy_work(dst, src, count), "cudaMemcpy"));
}

cudaError_t cudaMemcpyAsync(void * dst, const void * src, size_t count, cudaMemcpyKind kind, cudaStream_t stream) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    bool pageable = false;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (cudaError_t e = check_copy_locked(dst, src, count, kind); e != cudaSuccess) return result(e);
        pageable = count > 0 && (is_pageable_locked(dst) || is_pageable_locked(src));
    }
    return result(async_op(stream, copy_work(dst, src, count), "cudaMemcpyAsync", pageable));
}

cudaError_t cudaMemcpy2DAsync(void * dst, size_t dpitch, const void * src, size_t spitch, size_t width, size_t height,
                              cudaMemcpyKind kind, cudaStream_t stream) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    if (width > dpitch || width > spitch) return result(cudaErrorInvalidPitchValue);
    if (width == 0 || height == 0) return result(async_op(stream, [] {}, "cudaMemcpy2DAsync", false));
    bool pageable = false;
    {
        // Each side's extent: from its start to the end of its last row.
        std::lock_guard<std::mutex> lock(state().mutex);
        const size_t                dst_extent = dpitch * (height - 1) + width;
        const size_t                src_extent = spitch * (height - 1) + width;
        cudaError_t                 e          = cudaSuccess;
        if (kind == cudaMemcpyDefault) {
            for (auto [p, extent] : {std::pair<const void *, size_t>{dst, dst_extent}, {src, src_extent}}) {
                if (e == cudaSuccess && find_locked(p) != nullptr) e = check_range_locked(p, extent, true);
            }
        } else {
            const bool src_device = kind == cudaMemcpyDeviceToHost || kind == cudaMemcpyDeviceToDevice;
            const bool dst_device = kind == cudaMemcpyHostToDevice || kind == cudaMemcpyDeviceToDevice;
            if (kind > cudaMemcpyDefault) e = cudaErrorInvalidMemcpyDirection;
            if (e == cudaSuccess) e = check_range_locked(src, src_extent, src_device);
            if (e == cudaSuccess) e = check_range_locked(dst, dst_extent, dst_device);
        }
        if (e != cudaSuccess) return result(e);
        pageable = is_pageable_locked(dst) || is_pageable_locked(src);
    }
    auto work = [dst, dpitch, src, spitch, width, height] {
        for (size_t row = 0; row < height; ++row) {
            std::memmove(static_cast<char *>(dst) + row * dpitch, static_cast<const char *>(src) + row * spitch, width);
        }
    };
    return result(async_op(stream, work, "cudaMemcpy2DAsync", pageable));
}

cudaError_t cudaMemset(void * devPtr, int value, size_t count) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (cudaError_t e = check_range_locked(devPtr, count, true); e != cudaSuccess) return result(e);
    }
    return result(run_synchronously([devPtr, value, count] { std::memset(devPtr, value, count); }, "cudaMemset"));
}

cudaError_t cudaMemsetAsync(void * devPtr, int value, size_t count, cudaStream_t stream) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (cudaError_t e = check_range_locked(devPtr, count, true); e != cudaSuccess) return result(e);
    }
    return result(async_op(stream, [devPtr, value, count] { std::memset(devPtr, value, count); }, "cudaMemsetAsync",
                           false));
}

// ---- Streams

cudaError_t cudaStreamCreate(cudaStream_t * pStream) { return cudaStreamCreateWithFlags(pStream, cudaStreamDefault); }

cudaError_t cudaStreamCreateWithFlags(cudaStream_t * pStream, unsigned int flags) {
    if (pStream == nullptr || (flags & ~cudaStreamNonBlocking) != 0) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    auto st   = std::make_unique<StreamState>();
    st->queue = std::make_shared<StreamQueue>(t_device, flags, false);
    std::lock_guard<std::mutex> lock(state().mutex);
    *pStream = st.get();
    state().streams.emplace(st.get(), std::move(st));
    return cudaSuccess;
}

// Drains the stream, joins its worker and releases it. A stream taking part in a capture invalidates it.
cudaError_t cudaStreamDestroy(cudaStream_t stream) {
    std::unique_ptr<StreamState> owned;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        auto                        it = state().streams.find(stream);
        if (stream == nullptr || it == state().streams.end()) return result(cudaErrorInvalidResourceHandle);
        if (Capture * c = stream->capture) {
            invalidate(c);
            c->streams.erase(std::find(c->streams.begin(), c->streams.end(), stream));
            if (c->origin == stream) {
                leave_capture_locked(c);
                delete c->graph;
                delete c;
            }
        }
        owned = std::move(it->second);
        state().streams.erase(it);
    }
    stop(*owned->queue);
    return result(sticky());
}

namespace {

// The positions a synchronisation of `st` waits for: its own tail, and for the legacy stream also the
// tails of its device's blocking streams. State::mutex held.
std::vector<Record> sync_positions_locked(StreamState * st) {
    std::vector<Record> records{Record{st->queue, tail_position(*st->queue)}};
    if (st->queue->legacy) {
        for (auto & entry : state().streams) {
            StreamQueue & q = *entry.first->queue;
            if (q.device == st->queue->device && !(q.flags & cudaStreamNonBlocking)) {
                records.push_back(Record{entry.first->queue, tail_position(q)});
            }
        }
    }
    return records;
}

}  // namespace

namespace {

// What a synchronize or a query of `stream` waits for (its work and, for the legacy default stream, the
// blocking streams'); cudaSuccess, or the error the call returns: a bad handle, or a stream that captures
// (the capture is invalidated, as CUDA does).
cudaError_t stream_sync_positions(cudaStream_t stream, std::vector<Record> & records) {
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr) return cudaErrorInvalidResourceHandle;
    if (st->capture != nullptr) {
        invalidate(st->capture);
        return cudaErrorStreamCaptureUnsupported;
    }
    records = sync_positions_locked(st);
    return cudaSuccess;
}

}  // namespace

cudaError_t cudaStreamSynchronize(cudaStream_t stream) {
    std::vector<Record> records;
    if (cudaError_t e = stream_sync_positions(stream, records); e != cudaSuccess) return result(e);
    wait_all(records);
    return result(sticky());
}

cudaError_t cudaStreamQuery(cudaStream_t stream) {
    std::vector<Record> records;
    if (cudaError_t e = stream_sync_positions(stream, records); e != cudaSuccess) return result(e);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    for (const Record & r : records) {
        if (!reached(r)) return cudaErrorNotReady;
    }
    return cudaSuccess;
}

cudaError_t cudaLaunchHostFunc(cudaStream_t stream, cudaHostFn_t fn, void * userData) {
    if (fn == nullptr) return result(cudaErrorInvalidValue);
    return result(enqueue(stream, [fn, userData] { fn(userData); }, "host function"));
}

// ---- Events

namespace {

bool live_event_locked(cudaEvent_t event) { return event != nullptr && state().events.count(event) != 0; }

// An event last recorded inside a capture may not be queried or waited on by the host: while the capture
// is active the attempt also invalidates it.
cudaError_t refuse_captured_event_locked(EventState * e) {
    auto it = state().captures.find(e->capture_id);
    if (it != state().captures.end()) invalidate(it->second);
    return cudaErrorCapturedEvent;
}

}  // namespace

cudaError_t cudaEventCreate(cudaEvent_t * event) { return cudaEventCreateWithFlags(event, cudaEventDefault); }

cudaError_t cudaEventCreateWithFlags(cudaEvent_t * event, unsigned int flags) {
    if (event == nullptr ||
        (flags & ~(cudaEventBlockingSync | cudaEventDisableTiming | cudaEventInterprocess)) != 0) {
        return result(cudaErrorInvalidValue);
    }
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    auto *                      e = new EventState{t_device, flags, Record{}, 0, {}};
    std::lock_guard<std::mutex> lock(state().mutex);
    state().events.insert(e);
    *event = e;
    return cudaSuccess;
}

cudaError_t cudaEventDestroy(cudaEvent_t event) {
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (!live_event_locked(event)) return result(cudaErrorInvalidResourceHandle);
        state().events.erase(event);
    }
    delete event;   // pending waits hold the record's queue, not the event
    return result(sticky());
}

cudaError_t cudaEventRecord(cudaEvent_t event, cudaStream_t stream) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr || !live_event_locked(event)) return result(cudaErrorInvalidResourceHandle);
    if (event->device != st->queue->device) return result(cudaErrorInvalidResourceHandle);
    if (Capture * c = st->capture) {
        // A record inside a capture is an edge of its graph: what waits on it depends on the stream's
        // dependencies now, and nothing is enqueued.
        if (c->invalidated) return result(cudaErrorStreamCaptureInvalidated);
        event->record     = Record{};
        event->capture_id = c->id;
        event->frontier   = st->frontier;
        return cudaSuccess;
    }
    if (cudaError_t e = enqueue_locked(st, [] {}, "cudaEventRecord"); e != cudaSuccess) return result(e);
    event->record     = Record{st->queue, tail_position(*st->queue)};
    event->capture_id = 0;
    event->frontier.clear();
    return cudaSuccess;
}

cudaError_t cudaEventQuery(cudaEvent_t event) {
    Record record;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (!live_event_locked(event)) return result(cudaErrorInvalidResourceHandle);
        if (event->capture_id != 0) return result(refuse_captured_event_locked(event));
        record = event->record;
    }
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    return reached(record) ? cudaSuccess : cudaErrorNotReady;
}

cudaError_t cudaEventSynchronize(cudaEvent_t event) {
    Record record;
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (!live_event_locked(event)) return result(cudaErrorInvalidResourceHandle);
        if (event->capture_id != 0) return result(refuse_captured_event_locked(event));
        record = event->record;
    }
    wait_all({record});
    return result(sticky());
}

cudaError_t cudaStreamWaitEvent(cudaStream_t stream, cudaEvent_t event, unsigned int flags) {
    if ((flags & ~cudaEventWaitExternal) != 0) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr || !live_event_locked(event)) return result(cudaErrorInvalidResourceHandle);
    State & s = state();

    if (Capture * c = st->capture) {
        if (c->invalidated) return result(cudaErrorStreamCaptureInvalidated);
        if (event->capture_id == c->id) {   // a join (or any edge within the capture)
            for (long n : event->frontier) {
                if (std::find(st->frontier.begin(), st->frontier.end(), n) == st->frontier.end()) {
                    st->frontier.push_back(n);
                }
            }
            return cudaSuccess;
        }
        if (event->capture_id != 0) {
            invalidate(c);
            return result(s.captures.count(event->capture_id) != 0 ? cudaErrorStreamCaptureMerge
                                                                    : cudaErrorStreamCaptureIsolation);
        }
        if (flags & cudaEventWaitExternal) {   // an event wait node, resolved at each launch
            add_node_locked(st, Node{nullptr, "event wait node", event, {}});
            return cudaSuccess;
        }
        if (!event->record.queue) return cudaSuccess;   // never recorded: nothing to wait for
        invalidate(c);   // a dependency on uncaptured work
        return result(cudaErrorStreamCaptureIsolation);
    }

    if (event->capture_id != 0) {
        auto it = s.captures.find(event->capture_id);
        if (it == s.captures.end()) return result(cudaErrorCapturedEvent);
        // A fork: the stream joins the capture the event was recorded in, after the record's dependencies.
        Capture * c = it->second;
        if (st->queue->legacy) {
            invalidate(c);
            return result(cudaErrorStreamCaptureUnsupported);
        }
        if (c->invalidated) return result(cudaErrorStreamCaptureInvalidated);
        st->capture  = c;
        st->frontier = event->frontier;
        c->streams.push_back(st);
        return cudaSuccess;
    }
    if (reached(event->record)) return cudaSuccess;
    const Record r = event->record;
    return result(enqueue_locked(st, [r] { wait_position(*r.queue, r.position); }, "cudaStreamWaitEvent"));
}

// ---- Stream capture

cudaError_t cudaStreamBeginCapture(cudaStream_t stream, cudaStreamCaptureMode mode) {
    if (mode != cudaStreamCaptureModeGlobal && mode != cudaStreamCaptureModeThreadLocal &&
        mode != cudaStreamCaptureModeRelaxed) {
        return result(cudaErrorInvalidValue);
    }
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    State &                     s = state();
    if (stream == nullptr) return result(cudaErrorStreamCaptureUnsupported);   // the legacy stream cannot capture
    StreamState * st = resolve_locked(stream);
    if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
    if (st->capture != nullptr) return result(cudaErrorIllegalState);
    auto * graph   = new GraphState;
    graph->device  = st->queue->device;
    auto * c       = new Capture{s.next_capture_id++, mode, std::this_thread::get_id(), st, graph, {st}};
    st->capture    = c;
    st->frontier   = {kRoot};
    s.captures[c->id] = c;
    return cudaSuccess;
}

cudaError_t cudaStreamEndCapture(cudaStream_t stream, cudaGraph_t * pGraph) {
    if (pGraph == nullptr) return result(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
    Capture * c = st->capture;
    if (c == nullptr) return result(cudaErrorIllegalState);
    if (c->origin != st) {
        invalidate(c);
        return result(cudaErrorStreamCaptureUnmatched);
    }
    if (c->mode != cudaStreamCaptureModeRelaxed && c->thread != std::this_thread::get_id()) {
        return result(cudaErrorStreamCaptureWrongThread);
    }
    // The capture ends for every stream in it, whatever the outcome.
    cudaError_t outcome = cudaSuccess;
    if (c->invalidated) {
        outcome = cudaErrorStreamCaptureInvalidated;
    } else if (!joined_locked(*c)) {
        outcome = cudaErrorStreamCaptureUnjoined;
    }
    leave_capture_locked(c);
    if (outcome == cudaSuccess) {
        *pGraph = c->graph;
        state().graphs.insert(c->graph);
    } else {
        *pGraph = nullptr;
        delete c->graph;
    }
    delete c;
    return result(outcome);
}

cudaError_t cudaStreamIsCapturing(cudaStream_t stream, cudaStreamCaptureStatus * pCaptureStatus) {
    return cudaStreamGetCaptureInfo(stream, pCaptureStatus);
}

cudaError_t cudaStreamGetCaptureInfo(cudaStream_t stream, cudaStreamCaptureStatus * captureStatus_out,
                                     unsigned long long * id_out, cudaGraph_t * graph_out,
                                     const cudaGraphNode_t ** dependencies_out, const cudaGraphEdgeData ** edgeData_out,
                                     size_t * numDependencies_out) {
    if (captureStatus_out == nullptr) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr) return result(cudaErrorInvalidResourceHandle);
    Capture * c        = st->capture;
    *captureStatus_out = c == nullptr     ? cudaStreamCaptureStatusNone
                         : c->invalidated ? cudaStreamCaptureStatusInvalidated
                                          : cudaStreamCaptureStatusActive;
    if (id_out != nullptr && c != nullptr) *id_out = c->id;
    if (graph_out != nullptr) *graph_out = c != nullptr ? c->graph : nullptr;
    // The emulator's graphs expose no node handles for dependencies: reported as none.
    if (dependencies_out != nullptr) *dependencies_out = nullptr;
    if (edgeData_out != nullptr) *edgeData_out = nullptr;
    if (numDependencies_out != nullptr) *numDependencies_out = 0;
    return cudaSuccess;
}

cudaError_t cudaThreadExchangeStreamCaptureMode(cudaStreamCaptureMode * mode) {
    if (mode == nullptr) return result(cudaErrorInvalidValue);
    if (*mode != cudaStreamCaptureModeGlobal && *mode != cudaStreamCaptureModeThreadLocal &&
        *mode != cudaStreamCaptureModeRelaxed) {
        return result(cudaErrorInvalidValue);
    }
    std::swap(*mode, t_capture_mode);
    return cudaSuccess;
}

// ---- Graphs

cudaError_t cudaGraphGetNodes(cudaGraph_t graph, cudaGraphNode_t * nodes, size_t * numNodes) {
    if (numNodes == nullptr) return result(cudaErrorInvalidValue);
    std::lock_guard<std::mutex> lock(state().mutex);
    if (state().graphs.count(graph) == 0) return result(cudaErrorInvalidValue);
    if (nodes != nullptr) {
        // Node handles are addresses in the graph's own array, meaningful only as identities.
        graph->handles.resize(graph->nodes.size());
        for (size_t i = 0; i < *numNodes; ++i) nodes[i] = i < graph->handles.size() ? &graph->handles[i] : nullptr;
    }
    *numNodes = graph->nodes.size();
    return cudaSuccess;
}

cudaError_t cudaGraphInstantiate(cudaGraphExec_t * pGraphExec, cudaGraph_t graph, unsigned long long flags) {
    return cudaGraphInstantiateWithFlags(pGraphExec, graph, flags);
}

cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t * pGraphExec, cudaGraph_t graph, unsigned long long flags) {
    if (pGraphExec == nullptr || flags > 15) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    if (state().graphs.count(graph) == 0) return result(cudaErrorInvalidValue);
    auto * exec   = new GraphExecState;
    exec->device  = graph->device;
    exec->nodes   = std::make_shared<const std::vector<Node>>(graph->nodes);   // the exec outlives the graph
    state().execs.insert(exec);
    *pGraphExec = exec;
    return cudaSuccess;
}

// Enqueues the executable's nodes on the stream in capture order (a valid schedule of the graph: capture
// order is a topological order of its dependencies). A wait node waits on its event's latest record as of
// this launch. Launching into a capturing stream adds the nodes to that capture.
cudaError_t cudaGraphLaunch(cudaGraphExec_t graphExec, cudaStream_t stream) {
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    std::lock_guard<std::mutex> lock(state().mutex);
    StreamState *               st = resolve_locked(stream);
    if (st == nullptr || state().execs.count(graphExec) == 0) return result(cudaErrorInvalidResourceHandle);
    const std::shared_ptr<const std::vector<Node>> nodes = graphExec->nodes;
    if (Capture * c = st->capture) {
        if (c->invalidated) return result(cudaErrorStreamCaptureInvalidated);
        for (const Node & node : *nodes) add_node_locked(st, Node{node.work, node.name, node.external_event, {}});
        return cudaSuccess;
    }
    if (st->queue->legacy) {
        if (cudaError_t e = check_legacy_use_locked(st->queue->device); e != cudaSuccess) return result(e);
    }
    add_implicit_waits_locked(st);
    // CUDA orders a launch behind the previous launch of the same executable, on whatever stream it was.
    const Record previous = graphExec->last_launch;
    if (previous.queue && previous.queue != st->queue && !reached(previous)) {
        push(*st->queue, [previous] { wait_position(*previous.queue, previous.position); }, "previous graph launch");
    }
    for (size_t i = 0; i < nodes->size(); ++i) {
        const Node & node = (*nodes)[i];
        if (node.external_event != nullptr) {
            EventState * e = node.external_event;
            if (!live_event_locked(e) || e->capture_id != 0 || reached(e->record)) continue;
            const Record r = e->record;
            push(*st->queue, [r] { wait_position(*r.queue, r.position); }, node.name);
            continue;
        }
        push(*st->queue, [nodes, i] { (*nodes)[i].work(); }, node.name);
    }
    graphExec->last_launch = Record{st->queue, tail_position(*st->queue)};
    return cudaSuccess;
}

cudaError_t cudaGraphExecDestroy(cudaGraphExec_t graphExec) {
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (state().execs.erase(graphExec) == 0) return result(cudaErrorInvalidValue);
    }
    delete graphExec;   // launches in flight keep the nodes
    return cudaSuccess;
}

cudaError_t cudaGraphDestroy(cudaGraph_t graph) {
    {
        std::lock_guard<std::mutex> lock(state().mutex);
        if (state().graphs.erase(graph) == 0) return result(cudaErrorInvalidValue);
    }
    delete graph;
    return cudaSuccess;
}

// ---- Kernel attributes

cudaError_t cudaFuncSetAttribute(const void * func, cudaFuncAttribute attr, int value) {
    if (func == nullptr) return result(cudaErrorInvalidValue);
    if (cudaError_t e = sticky(); e != cudaSuccess) return result(e);
    switch (attr) {
        case cudaFuncAttributeMaxDynamicSharedMemorySize: {
            if (value < 0 || static_cast<size_t>(value) > kMaxSharedMemoryPerBlock) {
                return result(cudaErrorInvalidValue);
            }
            std::lock_guard<std::mutex> lock(state().smem_mutex);
            state().smem[func] = static_cast<size_t>(value);
            return cudaSuccess;
        }
        case cudaFuncAttributePreferredSharedMemoryCarveout:
            if (value < -1 || value > 100) return result(cudaErrorInvalidValue);
            return cudaSuccess;   // a performance hint: nothing to emulate
    }
    return result(cudaErrorInvalidValue);
}

}  // namespace loom_emu

// ---- runtime_internal.h

namespace loom_emu {

bool device_accessible(const void * p, size_t bytes) {
    std::lock_guard<std::mutex> lock(state().mutex);
    return check_range_locked(p, bytes, true) == cudaSuccess;
}

}  // namespace loom_emu
