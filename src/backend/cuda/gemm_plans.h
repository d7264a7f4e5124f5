// What the cuBLASLt plan cache of gemm.cpp has done (no CUDA header: tests and the device read it).
#pragma once

#include "backend/cuda/cuda_namespace.h"

#include <cstdint>

namespace loom::LOOM_CUDA_NS {

// The cuBLASLt plans of this process (descriptors, layouts and the heuristic's algorithm, cached per shape,
// transposes, operand type, epilogue and the operands' alignments): GEMMs that looked one up, the
// heuristic queries made (one per plan created), the plans held, and the products that ran GELU in their
// epilogue (GELU_AUX with or without the bias, DGELU) or summed a bias gradient in it (BGRADB) rather than
// falling back to a separate kernel.
struct GemmPlanStats {
    int64_t lookups = 0, heuristic_queries = 0, plans = 0;
    int64_t gelu_epilogues = 0, dgelu_epilogues = 0, bgrad_epilogues = 0;
};
GemmPlanStats gemm_plan_stats();

}  // namespace loom::LOOM_CUDA_NS
