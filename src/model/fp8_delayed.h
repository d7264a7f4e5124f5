// Delayed scaling (--fp8-recipe delayed; Transformer Engine's DelayedScaling recipe, Megatron's default FP8
// recipe): each FP8 GEMM operand casts with a scale formed from the amaxes of its earlier casts, not from its
// own. Per operand, an amax history of --fp8-amax-history-len entries and the scale:
//   - a cast multiplies by the scale as it stands (values past the format's largest saturate) and folds the
//     operand's amax into its history's row 0 (Ops::fp8_amax, Ops::fp8_quantize_scaled);
//   - after the pass that cast it (a layer's forward, or its backward), the row-0 amaxes are reduced (max) over
//     the ranks that share the stage (TP x DP x CP), then each operand's amax is its history's largest (max) or
//     row 0 (most_recent), its scale (fp8_max / amax) / 2^margin (the old one kept for an amax of 0 or not
//     finite), and the history rolled one row (Ops::fp8_delayed_update).
// The first cast uses a scale of 1. Backward casts a layer's inputs and weights again with the scales their
// forward used (kept in the layer's context), recording nothing: Transformer Engine's backward reuses the
// forward's FP8 tensors, whose values these are.
#pragma once

#include "core/fp8.h"
#include "core/tensor.h"

#include <cstdint>
#include <memory>

namespace loom::comm {
class Communicator;
}

namespace loom::model {

class Fp8Delayed {
public:
    // One operand: cast by scale[0]; its amax folded into amax[0] (undefined: cast, not recorded).
    struct Operand {
        Tensor scale, amax;
    };

    Fp8Delayed(Fp8Format format, int64_t history_len, bool max_algo, int margin);

    // A new operand's slot; `count` consecutive slots (their first returned). Before allocate().
    int64_t add(int64_t count = 1);
    int64_t size() const { return slots_; }
    // The history (len, slots) zeros and every scale 1, on `device`.
    void    allocate(Device & device);
    bool    allocated() const { return history_.defined(); }

    // Slot's operand; its amax recorded when `record` and the set is recording (set_recording: an evaluation's
    // forward casts without recording).
    Operand operand(int64_t slot, bool record = true) const;
    void    set_recording(bool on) { recording_ = on; }
    // Slots [first, first + count)'s scales now, into a new (count) f32 tensor of the activations pool: what a
    // forward's casts used, for its backward.
    Tensor  snapshot(int64_t first, int64_t count) const;
    // The update after a pass: row 0 reduced (max) over `group` (null: this rank alone), then the scales and
    // the history (Ops::fp8_delayed_update), on the compute stream.
    void    update(comm::Communicator * group) const;

    // Checkpointed with the model (replicated over TP x DP x CP): the history and the scales.
    const Tensor & history() const { return history_; }
    const Tensor & scale() const { return scale_; }
    Fp8Format      format() const { return format_; }

private:
    Fp8Format format_;
    int64_t   len_;
    bool      max_algo_;
    int       margin_;
    int64_t   slots_ = 0;
    bool      recording_ = true;
    Tensor    history_, scale_;
};

// A layer's two sets: the forward's operands (inputs and weights, in --fp8-format's forward format) and the
// backward's (output gradients, in its backward format).
struct Fp8DelayedMetas {
    std::unique_ptr<Fp8Delayed> forward, backward;
};

}  // namespace loom::model
