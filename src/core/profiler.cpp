#include "core/profiler.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <atomic>
#include <map>
#include <mutex>

namespace loom {

namespace {

std::atomic<bool>                     g_active{false};
std::mutex                            g_mutex;
std::vector<TraceEvent>               g_events;
std::chrono::steady_clock::time_point g_origin;

int64_t micros(std::chrono::steady_clock::time_point t) {
    return std::chrono::duration_cast<std::chrono::microseconds>(t - g_origin).count();
}

}  // namespace

bool Profiler::active() { return g_active.load(std::memory_order_relaxed); }

void Profiler::start() {
    std::lock_guard<std::mutex> lock(g_mutex);
    g_events.clear();
    g_origin = std::chrono::steady_clock::now();
    g_active.store(true);
}

std::vector<TraceEvent> Profiler::stop() {
    g_active.store(false);
    std::lock_guard<std::mutex> lock(g_mutex);
    std::vector<TraceEvent> out = std::move(g_events);
    g_events.clear();
    std::stable_sort(out.begin(), out.end(), [](const TraceEvent & a, const TraceEvent & b) { return a.begin_us < b.begin_us; });
    return out;
}

void Profiler::record(const std::string & stream, const char * name, std::chrono::steady_clock::time_point begin,
                      std::chrono::steady_clock::time_point end) {
    std::lock_guard<std::mutex> lock(g_mutex);
    if (!g_active.load()) return;   // stopped while the work ran
    g_events.push_back(TraceEvent{name ? name : "work", stream, micros(begin), micros(end)});
}

std::string chrome_trace_json(const std::vector<TraceEvent> & events, int rank, const std::string & device,
                              const std::string & metadata_note) {
    using json = nlohmann::json;
    json                       trace = json::array();
    std::map<std::string, int> threads;   // stream -> tid, in order of first appearance
    for (const TraceEvent & e : events) {
        if (threads.emplace(e.stream, static_cast<int>(threads.size()) + 1).second) {
            trace.push_back({{"ph", "M"}, {"name", "thread_name"}, {"pid", rank}, {"tid", threads[e.stream]},
                             {"args", {{"name", e.stream}}}});
        }
    }
    trace.push_back({{"ph", "M"}, {"name", "process_name"}, {"pid", rank}, {"tid", 0},
                     {"args", {{"name", "rank " + std::to_string(rank) + " (" + device + ")"}}}});
    for (const TraceEvent & e : events) {
        trace.push_back({{"ph", "X"}, {"name", e.name}, {"cat", e.stream}, {"pid", rank}, {"tid", threads[e.stream]},
                         {"ts", e.begin_us}, {"dur", std::max<int64_t>(0, e.end_us - e.begin_us)}});
    }
    return json{{"traceEvents", trace}, {"displayTimeUnit", "ms"}, {"otherData", {{"note", metadata_note}}}}.dump();
}

}  // namespace loom
