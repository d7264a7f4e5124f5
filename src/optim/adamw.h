// AdamW's hyper-parameters with Megatron's defaults, the update's scalar reference, and the clipping factor.
// The optimizers themselves are in optim/optimizer.h, the learning-rate schedule in optim/lr_schedule.h.
//
// Update of one element at step t (1-based), gradient g = main_grad, decoupled weight decay wd:
//   p  <- p - lr * wd * p                       (only parameters with decay: not biases or norms)
//   m  <- b1 m + (1 - b1) g
//   v  <- b2 v + (1 - b2) g^2
//   p  <- p - lr * (m / (1 - b1^t)) / (sqrt(v / (1 - b2^t)) + eps)
// Defaults (Megatron): b1 0.9, b2 0.999, eps 1e-8, weight decay 0.01. State m, v are f32 in the
// "optimizer" pool of the parameter's device allocator. A 16-bit parameter also gets an f32 master copy
// there (Megatron's mixed precision: 2 bytes of bf16 weight + 4 of main_grad + 12 of master, m and v);
// the step updates the master and writes it back rounded to the parameter's dtype in the same pass.
//
// Clipping (optim/optimizer.h): norm = sqrt(sum over all main_grad elements of g^2); if clip > 0 and
// norm > clip, every gradient is scaled by clip / (norm + 1e-6).
#pragma once

#include "comm/communicator.h"
#include "core/device.h"

#include <cstdint>

namespace loom::optim {

struct AdamWConfig {
    float lr           = 6e-4f;
    float beta1        = 0.9f;
    float beta2        = 0.999f;
    float eps          = 1e-8f;
    float weight_decay = 0.01f;
};

// The fused update of n elements (the scalar reference; vectorised by the compiler). When p_bf16 is
// given, the updated p is also written to it rounded to bf16 (the model's copy of an f32 master).
void adamw_update(float * p, const float * g, float * m, float * v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, uint16_t * p_bf16 = nullptr);

// The sum of `value` over the group, the same on every rank and as exact as a double sum: each rank's
// value travels as an f32 pair (hi, lo) with hi + lo = value to ~1e-14, and every rank adds the gathered
// pairs in rank order. `device` holds the small exchange tensors.
double group_sum(double value, comm::Communicator & group, Device & device);
// The factor gradients are scaled by: core/grad_norm_gate.h's clip_factor (the one definition the device's
// gate shares): min(1, max_norm / (norm + 1e-6)), and 1 when clipping is off or the norm is not finite.
float  clip_coefficient(double norm, float max_norm);

}  // namespace loom::optim
