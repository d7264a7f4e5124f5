#include "optim/lr_schedule.h"

#include "core/error.h"

#include <algorithm>
#include <cmath>

namespace loom::optim {

LrDecayStyle lr_decay_style_from_name(const std::string & name) {
    if (name == "constant") return LrDecayStyle::constant;
    if (name == "linear") return LrDecayStyle::linear;
    if (name == "cosine") return LrDecayStyle::cosine;
    if (name == "inverse-square-root") return LrDecayStyle::inverse_square_root;
    if (name == "WSD") return LrDecayStyle::wsd;
    LOOM_THROW("--lr-decay-style '" << name << "' is not supported",
               "use constant, linear, cosine, inverse-square-root or WSD (Megatron's choices)");
}

WsdDecayStyle wsd_decay_style_from_name(const std::string & name) {
    if (name == "exponential") return WsdDecayStyle::exponential;
    if (name == "linear") return WsdDecayStyle::linear;
    if (name == "cosine") return WsdDecayStyle::cosine;
    if (name == "minus_sqrt") return WsdDecayStyle::minus_sqrt;
    LOOM_THROW("--lr-wsd-decay-style '" << name << "' is not supported", "use exponential, linear, cosine or minus_sqrt");
}

const char * lr_decay_style_name(LrDecayStyle style) {
    switch (style) {
        case LrDecayStyle::constant: return "constant";
        case LrDecayStyle::linear: return "linear";
        case LrDecayStyle::cosine: return "cosine";
        case LrDecayStyle::inverse_square_root: return "inverse-square-root";
        case LrDecayStyle::wsd: return "WSD";
    }
    return "?";
}

const char * wsd_decay_style_name(WsdDecayStyle style) {
    switch (style) {
        case WsdDecayStyle::exponential: return "exponential";
        case WsdDecayStyle::linear: return "linear";
        case WsdDecayStyle::cosine: return "cosine";
        case WsdDecayStyle::minus_sqrt: return "minus_sqrt";
    }
    return "?";
}

float LrSchedule::lr_at_step(double n, float max_lr, float min_lr) const {
    if (warmup_steps > 0 && n <= warmup_steps) {
        return static_cast<float>(init_lr + (static_cast<double>(max_lr) - init_lr) * n / warmup_steps);
    }
    if (style == LrDecayStyle::constant) return max_lr;
    if (n > decay_steps) return min_lr;
    if (style == LrDecayStyle::inverse_square_root) {
        const double lr = max_lr * std::sqrt(std::max(warmup_steps, 1.0)) / std::sqrt(std::max(n, 1.0));
        return static_cast<float>(std::max(static_cast<double>(min_lr), lr));
    }
    const double ratio = (n - warmup_steps) / (decay_steps - warmup_steps);
    double       coeff = 1.0;
    switch (style) {
        case LrDecayStyle::linear: coeff = 1.0 - ratio; break;
        case LrDecayStyle::cosine: coeff = 0.5 * (std::cos(M_PI * ratio) + 1.0); break;
        case LrDecayStyle::wsd: {
            const double anneal_start = decay_steps - wsd_steps;
            if (n <= anneal_start) break;
            const double q = (n - anneal_start) / wsd_steps;
            switch (wsd_style) {
                case WsdDecayStyle::linear: coeff = 1.0 - q; break;
                case WsdDecayStyle::cosine: coeff = 0.5 * (std::cos(M_PI * q) + 1.0); break;
                case WsdDecayStyle::exponential: coeff = 2.0 * std::pow(0.5, q) - 1.0; break;
                case WsdDecayStyle::minus_sqrt: coeff = 1.0 - std::sqrt(q); break;
            }
            break;
        }
        default: break;
    }
    return static_cast<float>(min_lr + coeff * (static_cast<double>(max_lr) - min_lr));
}

}  // namespace loom::optim
