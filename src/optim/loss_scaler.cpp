#include "optim/loss_scaler.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace loom::optim {

LossScaler::LossScaler(const LossScalerOptions & options) : options_(options) {
    if (options.constant) {
        LOOM_CHECK(std::isfinite(*options.constant) && *options.constant > 0.0f,
                   "--loss-scale must be a positive number, got " << *options.constant, "");
        scale_ = *options.constant;
        return;
    }
    LOOM_CHECK(std::isfinite(options.initial) && options.initial > 0.0f,
               "--initial-loss-scale must be a positive number, got " << options.initial, "");
    LOOM_CHECK(std::isfinite(options.min) && options.min > 0.0f && options.min <= options.initial,
               "--min-loss-scale " << options.min << " must be positive and at most --initial-loss-scale "
                                   << options.initial,
               "");
    LOOM_CHECK(std::isfinite(options.window) && options.window > 0,
               "--loss-scale-window must be positive, got " << options.window, "");
    LOOM_CHECK(options.hysteresis > 0, "--hysteresis must be positive, got " << options.hysteresis, "");
    scale_              = options.initial;
    hysteresis_tracker_ = options.hysteresis;
}

void LossScaler::update(bool found_inf) {
    if (!dynamic()) return;
    if (found_inf) {
        growth_tracker_ = 0;
        --hysteresis_tracker_;
        if (hysteresis_tracker_ <= 0) scale_ = std::max(scale_ * 0.5f, options_.min);
    } else {
        ++growth_tracker_;
        if (static_cast<double>(growth_tracker_) == options_.window) {
            growth_tracker_     = 0;
            hysteresis_tracker_ = options_.hysteresis;
            scale_              = scale_ * 2.0f;
        }
    }
}

void LossScaler::load(const LossScalerState & state) {
    if (!dynamic()) return;   // Megatron's constant scaler loads nothing
    LOOM_CHECK(std::isfinite(state.scale) && state.scale > 0.0f, "a saved loss scale of " << state.scale,
               "the checkpoint's grad_scaler is damaged");
    scale_              = state.scale;
    growth_tracker_     = state.growth_tracker;
    hysteresis_tracker_ = state.hysteresis_tracker;
}

}  // namespace loom::optim
