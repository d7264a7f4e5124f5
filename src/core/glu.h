// The gated linear unit's variants beyond plain SwiGLU (Ops::glu_forward, GptConfig::glu_spec), and the output
// gates' activations (Ops::output_gate_forward).
#pragma once

#include <cstdint>

namespace loom {

// A gated linear unit's activation of its gate half: silu(a) = a sigmoid(a), or quick_gelu(a) = a sigmoid(1.702 a)
// (--quick-geglu); `clamp` > 0 clamps both halves first (--activation-func-clamp-value; 0: none), and
// `linear_offset` is added to the linear half (--glu-linear-offset). Ops::glu_forward.
struct GluSpec {
    enum class Gate : uint8_t { silu, quick_gelu };
    Gate  gate          = Gate::silu;
    float clamp         = 0.0f;
    float linear_offset = 0.0f;
};

// Ops::output_gate_forward's activation of the gate: sigmoid (the attention's output gate) or SiLU (the gated
// delta-net's gated norm).
enum class GateActivation : uint8_t { sigmoid, silu };

}  // namespace loom
