// The compute thread budget shared by every kernel of the process.
//
// LOOM_NUM_THREADS sets it (default: the cores this process may run on, from its affinity mask). One
// pool of budget-1 worker threads serves all callers; parallel_for splits [0, n) into chunks of at
// least `grain`, and the calling thread works on chunks too, so concurrent callers (kernels of two
// streams) share the budget instead of oversubscribing it, and a caller never waits on a busy pool: if no
// worker is free, it runs every chunk itself.
#pragma once

#include <cstdint>
#include <functional>

namespace loom {

// The budget: LOOM_NUM_THREADS if set (>= 1), else the available cores.
int num_threads();

// Calls fn(begin, end) over disjoint ranges covering [0, n), possibly concurrently; returns when all are
// done. An exception thrown by fn is rethrown here (the first one).
void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)> & fn);

}  // namespace loom
