// Profiler: a timeline of every stream's work for `--profile` (Megatron's --profile-step-start/-end), written
// as a Chrome trace (the JSON that chrome://tracing and ui.perfetto.dev open).
//
// While a profiler is active (start() until stop()), each piece of work a CPU stream runs is one event:
// its name (the Ops call or collective that submitted it: Stream::submit's name), the stream's name (one
// trace thread per stream: compute, ddp-comm, copies, ...), and when it began and ended on that stream's
// worker. Event records and waits are work too ("record", "wait"). On CUDA devices the host work of a stream
// (callbacks) is recorded; its kernels are not yet (the trace says so in its metadata).
//
//   Profiler::start();           ... steps ...           std::vector<TraceEvent> e = Profiler::stop();
//   write chrome_trace_json(e, rank, "cpu:0") to a file
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

namespace loom {

struct TraceEvent {
    std::string name;     // "gemm", "all_reduce", ...
    std::string stream;   // the stream's name
    int64_t     begin_us = 0, end_us = 0;   // microseconds since start()
};

class Profiler {
public:
    // Whether a profile is being taken (cheap: one atomic load), for the streams' submit paths.
    static bool active();
    static void start();
    // Ends the profile and returns its events, ordered by begin time.
    static std::vector<TraceEvent> stop();
    // One piece of work that ran on `stream` (thread-safe).
    static void record(const std::string & stream, const char * name, std::chrono::steady_clock::time_point begin,
                       std::chrono::steady_clock::time_point end);
};

// The events as a Chrome trace: {"traceEvents": [...]} with one complete ("X") event per piece of work,
// process `rank` (named "rank R (<device>)"), one thread per stream (named after it), and `metadata`.
std::string chrome_trace_json(const std::vector<TraceEvent> & events, int rank, const std::string & device,
                              const std::string & metadata_note);

}  // namespace loom
