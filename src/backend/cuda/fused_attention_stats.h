// What the fused attention of fused_attention.h has done (no CUDA header: tests and the device read it).
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <cstdint>

namespace loom::LOOM_CUDA_NS {

// In this process: plans built (one per shape and direction), shapes cuDNN refused (each then runs Loom's
// kernel), forward and backward calls run through cuDNN.
struct FusedAttentionStats {
    int64_t plans = 0, refused = 0, forward_calls = 0, backward_calls = 0;
};
FusedAttentionStats fused_attention_stats();

}  // namespace loom::LOOM_CUDA_NS
