// GELU's tanh approximation (Megatron's bias_gelu), one formula for the host and the CUDA kernels. Each
// backend passes its own tanh of gelu_tanh_arg(v): the CPU a vectorisable approximation, CUDA tanhf.
//   gelu(v)  = 0.5 v (1 + tanh(u)),  u = sqrt(2/pi) (v + 0.044715 v^3)
//   gelu'(v) = 0.5 (1 + t) + 0.5 v (1 - t^2) du/dv,  t = tanh(u),  du/dv = sqrt(2/pi) (1 + 3 * 0.044715 v^2)
#pragma once

#include "core/host_device.h"

namespace loom {

inline constexpr float kGeluC = 0.7978845608028654f;   // sqrt(2 / pi)

LOOM_HOST_DEVICE inline float gelu_tanh_arg(float v) { return kGeluC * (v + 0.044715f * v * v * v); }
LOOM_HOST_DEVICE inline float gelu_from_tanh(float v, float t) { return 0.5f * v * (1.0f + t); }
LOOM_HOST_DEVICE inline float gelu_grad_from_tanh(float v, float t) {
    const float du = kGeluC * (1.0f + 3.0f * 0.044715f * v * v);
    return 0.5f * (1.0f + t) + 0.5f * v * (1.0f - t * t) * du;
}

}  // namespace loom
