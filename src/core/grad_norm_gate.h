// The gradient norm's decision, taken where the norm is: the clip factor and whether the optimizer steps at
// all. One definition for the host (optim's clip, the CPU backend) and the CUDA kernel (Ops::grad_norm_gate),
// so a step decided on the device is the step the host would have decided, to the bit.
//
// The norm is optim/optimizer.cpp's with no group to sum over: each counted gradient's (hi, lo) pair from
// Ops::sum_of_squares(_multi), widened and added in double, the dense gradients' in order, the experts' in
// order, the two totals added, the square root taken in double.
#pragma once

#include "core/host_device.h"

#include <cmath>
#include <cstdint>

namespace loom {

// What Ops::grad_norm_gate reads: `pairs` holds dense + expert + losses (hi, lo) pairs, in that order.
struct GradNormGate {
    int64_t dense    = 0;   // the dense gradients' pairs, first
    int64_t expert   = 0;   // then the experts' (summed apart, then added, as optimizer.cpp does)
    int64_t losses   = 0;   // then the per-token losses', which only say whether every loss is finite
    float   max_norm = 0;   // --clip-grad (<= 0: no clipping)
};

// True for a number that is neither infinite nor NaN (x - x is 0 only then; the same test on both sides).
LOOM_HOST_DEVICE inline bool finite_value(double x) { return x - x == 0.0; }

// min(1, max_norm / (norm + 1e-6)), and 1 when clipping is off (max_norm <= 0) or the norm is not finite.
LOOM_HOST_DEVICE inline float clip_factor(double norm, float max_norm) {
    if (max_norm <= 0 || !finite_value(norm)) return 1.0f;
    const double coeff = max_norm / (norm + 1e-6);
    return coeff < 1.0 ? static_cast<float>(coeff) : 1.0f;
}

struct GradNormVerdict {
    double norm;    // the gradients' L2 norm
    float  coeff;   // what each gradient is multiplied by before the update (clip_factor)
    bool   go;      // the norm and every loss are finite: the optimizer steps
};

LOOM_HOST_DEVICE inline GradNormVerdict grad_norm_verdict(const float * pairs, const GradNormGate & g) {
    double dense = 0, expert = 0;
    for (int64_t k = 0; k < g.dense; ++k) dense += static_cast<double>(pairs[2 * k]) + static_cast<double>(pairs[2 * k + 1]);
    for (int64_t k = g.dense; k < g.dense + g.expert; ++k) {
        expert += static_cast<double>(pairs[2 * k]) + static_cast<double>(pairs[2 * k + 1]);
    }
    bool losses_finite = true;
    for (int64_t k = g.dense + g.expert; k < g.dense + g.expert + g.losses; ++k) {
        losses_finite = losses_finite && finite_value(static_cast<double>(pairs[2 * k]) + static_cast<double>(pairs[2 * k + 1]));
    }
    const double norm = sqrt(dense + expert);
    return {norm, clip_factor(norm, g.max_norm), finite_value(norm) && losses_finite};
}

}  // namespace loom
