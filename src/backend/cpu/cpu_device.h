// The CPU backend's Device: host memory accounted as "device" and "pinned host" by two caching
// allocators, and streams that are real worker threads (cpu_stream.h).
#pragma once

#include "core/device.h"

namespace loom::cpu {

// The process's CPU device (cpu:0).
Device & device();

}  // namespace loom::cpu
