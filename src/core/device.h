// Device, Stream and Event: the execution interfaces every backend implements.
//
// A Stream is an ordered, asynchronous queue of work. Work submitted to a stream runs in submission
// order, concurrently with the host thread and with other streams. An Event marks a point in a stream:
//
//   stream_a.submit(write);  stream_a.record(e);      // e completes when `write` has run
//   stream_b.wait(e);        stream_b.submit(read);   // `read` cannot start before e completes
//   e.synchronize();                                  // the host blocks until e completes
//
// Event semantics follow CUDA's: wait() and synchronize() refer to the most recent record() issued
// before them; an event never recorded counts as complete. On the CPU backend each stream is a worker
// thread, so a missing wait shows up as a wrong result in a CPU test, the same class of bug that breaks
// overlap on a GPU. Setting LOOM_SYNC_STREAMS=1 makes every stream run its work inline on the
// submitting thread, for debugging.
#pragma once

#include "core/allocator.h"

#include <functional>
#include <memory>
#include <optional>
#include <string>

namespace loom {

enum class DeviceType : uint8_t { cpu, cuda };
const char * device_type_name(DeviceType type);

// True when LOOM_SYNC_STREAMS is set to something other than "0" or empty.
bool streams_synchronous_from_env();

class Event {
public:
    virtual ~Event() = default;
    // True when the work before the last record() has completed (or the event was never recorded).
    virtual bool query() = 0;
    // Blocks the host until query() would return true.
    virtual void synchronize() = 0;
};

class Device;
class Graph;
class Ops;

class Stream {
public:
    virtual ~Stream() = default;

    virtual Device & device() = 0;
    virtual const std::string & name() const = 0;

    // Enqueues host work: a kernel on the CPU backend, a host callback on CUDA. `name` labels it in a
    // profile (core/profiler.h): by default the calling function's name (the Ops method: "gemm", ...).
    virtual void submit(std::function<void()> work, const char * name = __builtin_FUNCTION()) = 0;
    virtual void record(Event & event) = 0;
    virtual void wait(Event & event) = 0;
    // Blocks the host until everything submitted so far has run. Rethrows the first error raised by
    // work on this stream since the last synchronize().
    virtual void synchronize() = 0;
    // True when everything submitted so far has run.
    virtual bool query() = 0;
    // On the meta device with a time model (plan/meta_device.h): the modelled time, in seconds, at which
    // work submitted now would start on this stream. No value on a real device.
    virtual std::optional<double> modelled_seconds() const { return std::nullopt; }

    // Graph capture (core/graph.h): until end_capture(), work, event records and event waits submitted to
    // this stream are recorded into `graph` instead of run, and the calling thread's device allocations
    // come from the graph's pool. One capture at a time per thread and per stream.
    void    begin_capture(Graph & graph);
    void    end_capture();
    Graph * capture() const { return capture_; }
    // Work whose host side must run again at every replay: `prepare` runs now (or, while capturing, at
    // each replay of the graph) and the work it returns is submitted. `label` names it in the graph.
    void submit_replayable(std::function<std::function<void()>()> prepare, std::string label = "");

protected:
    // A backend that captures natively (CUDA) overrides these; the CPU backend records nodes itself and
    // leaves them empty. begin: start recording on the native stream (before the allocator redirects the
    // thread's allocations to the graph's pool). end: stop, and add what was recorded to `graph` as a
    // CapturedSegment (core/graph.h); called before each replayable node and by end_capture(). abort: stop
    // and drop what was recorded (a begin_capture that failed after native_capture_begin).
    virtual void native_capture_begin() {}
    virtual void native_capture_end(Graph & graph) { (void)graph; }
    virtual void native_capture_abort() noexcept {}

    Graph * capture_ = nullptr;   // backends record into it while it is set
};

// The host-side work a device's backend did (Device::work): host synchronisations (a stream's or an event's),
// device allocations (the caching allocator drawing new memory from the driver), GEMMs, and the cuBLASLt
// plans they went through with the heuristic queries that made them.
struct DeviceWork {
    int64_t host_syncs = 0, device_allocations = 0, gemms = 0, gemm_plans = 0, heuristic_queries = 0;
    int64_t late_reads = 0;   // waits for an event with more work enqueued behind it (not host_syncs)
    // Attention calls run through cuDNN's fused attention, its plans, and the shapes cuDNN refused (CUDA).
    int64_t fused_attention = 0, fused_attention_plans = 0, fused_attention_refused = 0;
};

class Device {
public:
    virtual ~Device() = default;

    virtual DeviceType type() const = 0;
    virtual int        index() const = 0;
    std::string        name() const;   // "cpu:0", "cuda:1", "cuda-emu:0"
    // What name() calls the device: its type's name, or a backend's own ("cuda-emu" for the emulated GPU,
    // whose type is cuda: it runs the CUDA backend).
    virtual const char * kind_name() const { return device_type_name(type()); }
    // The hardware's own name where the backend knows it (CUDA: cudaDeviceProp::name, "NVIDIA H100 80GB
    // HBM3"), else empty.
    virtual std::string product_name() const { return {}; }

    virtual Allocator & allocator(MemoryKind kind = MemoryKind::device) = 0;
    virtual std::unique_ptr<Stream> stream_create(const std::string & name) = 0;
    virtual std::unique_ptr<Event>  event_create() = 0;

    // The device's kernels (core/ops.h).
    virtual Ops &    ops() = 0;
    // The stream layers compute on, named "compute": one per device, created with it. Layers enqueue their
    // kernels here and return; whoever reads a result on the host waits for it first.
    virtual Stream & compute_stream() = 0;

    // What the backend counted so far in this process, where it counts (the CUDA backend): for the end of a
    // run's summary and for tests that hold a step to no host work.
    virtual std::optional<DeviceWork> work() { return std::nullopt; }
};

// Test seam: LOOM_STREAM_DELAY_US=name=us[,name=us...] makes the streams of that name sleep that long
// before each piece of work, so a missing event wait shows up as a wrong result. "compute" and
// "ddp-comm" are the streams the equivalence tests delay. Returns 0 for a stream not named.
int64_t stream_delay_us_from_env(const std::string & stream_name);

}  // namespace loom
