// The CUDA backend's counts of host-side work (core/device.h's DeviceWork): host synchronisations and device
// allocations, incremented where the backend makes them (cuda_stream.cpp, cuda_device.cpp).
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <atomic>
#include <cstdint>

namespace loom::LOOM_CUDA_NS {

struct WorkCounters {
    // late_reads: host waits on an event with more work enqueued behind it on its stream (the device stays
    // busy); host_syncs: every other wait, which leaves the device idle until the host enqueues again.
    std::atomic<int64_t> host_syncs{0}, late_reads{0}, device_allocations{0};
};

inline WorkCounters & work_counters() {
    static WorkCounters counters;
    return counters;
}

}  // namespace loom::LOOM_CUDA_NS
