// LossScaler: the loss scale of 16-bit training (Megatron's grad_scaler.py). The backward pass starts from
// the loss multiplied by scale(), so small gradients survive the f16 GEMM operands; the optimizer multiplies
// the f32 gradients by inv_scale() before the norm, and an update whose gradients are not finite is skipped
// and reported to update().
//
//   constant (--loss-scale S, with --fp16 or --bf16): the scale is S whatever happens (overflowing steps
//       are still skipped);
//   dynamic (--fp16 without --loss-scale): from --initial-loss-scale (2^32); an overflow uses up one of
//       --hysteresis (2) chances, and each overflow once they are gone halves the scale, never below
//       --min-loss-scale (1); --loss-scale-window (1000) clean steps in a row double it and restore the
//       chances. The scale is an f32, as Megatron's tensor is, so halving and doubling are exact.
#pragma once

#include <cstdint>
#include <optional>

namespace loom::optim {

struct LossScalerOptions {
    std::optional<float> constant;                  // --loss-scale (dynamic when absent)
    float                initial    = 4294967296.0f;   // --initial-loss-scale, 2^32
    float                min        = 1.0f;         // --min-loss-scale
    double               window     = 1000;         // --loss-scale-window (a float in Megatron; compared with a count)
    int64_t              hysteresis = 2;            // --hysteresis
};

// What a checkpoint keeps of a dynamic scaler (Megatron's state_dict: scale, growth_tracker,
// hysteresis_tracker); a constant scaler keeps nothing.
struct LossScalerState {
    float   scale              = 1.0f;
    int64_t growth_tracker     = 0;
    int64_t hysteresis_tracker = 0;
};

class LossScaler {
public:
    // Throws naming the flag for a scale <= 0, a minimum above the initial scale, a window or hysteresis < 1.
    explicit LossScaler(const LossScalerOptions & options);

    float scale() const { return scale_; }
    float inv_scale() const { return static_cast<float>(1.0 / static_cast<double>(scale_)); }
    bool  dynamic() const { return !options_.constant.has_value(); }
    // After each step: `found_inf` when the step was skipped for non-finite gradients.
    void  update(bool found_inf);

    LossScalerState state() const { return {scale_, growth_tracker_, hysteresis_tracker_}; }
    void            load(const LossScalerState & state);   // throws on a scale that is not a positive finite f32

private:
    LossScalerOptions options_;
    float             scale_;
    int64_t           growth_tracker_     = 0;
    int64_t           hysteresis_tracker_ = 0;
};

}  // namespace loom::optim
