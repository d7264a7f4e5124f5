// The CUDA backend's ops table (core/ops.h): each op checks its arguments on the caller's thread exactly as
// the CPU's do, enqueues its kernels (kernels.h, gemm.h) on the given CUDA stream and hands its tensors to
// the stream until they have run (cuda_stream.h). Every op of core/ops.h is written; attention alone adds a
// CUDA limit, heads of up to kernels::kAttentionMaxHeadDim (256).
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "core/ops.h"

namespace loom::LOOM_CUDA_NS {

// The process's CUDA ops (stateless apart from cuBLASLt handles; one instance for every device).
Ops & cuda_ops();

}  // namespace loom::LOOM_CUDA_NS
