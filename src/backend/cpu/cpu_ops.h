// The CPU backend's ops table (core/ops.h): each op checks its arguments on the caller's thread and
// enqueues the kernel of backend/cpu (ops.h, gemm.h, attention.h) on the given stream, holding its tensors
// until it has run.
#pragma once

#include "core/ops.h"

namespace loom::cpu {

// The process's CPU ops (stateless; one instance).
Ops & cpu_ops();

}  // namespace loom::cpu
