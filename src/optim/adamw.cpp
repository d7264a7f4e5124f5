#include "optim/adamw.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

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

float LrSchedule::lr_at(int64_t k, float max_lr, float min_lr) const {
    const double n = static_cast<double>(k) * static_cast<double>(samples_per_iteration);
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

void adamw_update(float * p, const float * g, float * m, float * v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, uint16_t * p_bf16) {
    const float bc1       = 1.0f - std::pow(beta1, static_cast<float>(step));
    const float bc2_sqrt  = std::sqrt(1.0f - std::pow(beta2, static_cast<float>(step)));
    const float step_size = lr / bc1;
    const float decay     = 1.0f - lr * weight_decay;
    parallel_for(n, 1 << 14, [&](int64_t begin, int64_t end) {
        for (int64_t i = begin; i < end; ++i) {
            float gi = g[i];
            float mi = beta1 * m[i] + (1.0f - beta1) * gi;
            float vi = beta2 * v[i] + (1.0f - beta2) * gi * gi;
            m[i]     = mi;
            v[i]     = vi;
            p[i]     = p[i] * decay - step_size * mi / (std::sqrt(vi) / bc2_sqrt + eps);
        }
        if (p_bf16) {
            convert_f32_to_bf16(p + begin, p_bf16 + begin, static_cast<size_t>(end - begin));
        }
    });
}

double group_sum(double value, comm::Communicator & group, Device & device) {
    const float              hi  = static_cast<float>(value);
    const std::vector<float> all = comm::all_gather_values(group, device, {hi, static_cast<float>(value - static_cast<double>(hi))});
    double                   total = 0;
    for (int r = 0; r < group.size(); ++r) total += static_cast<double>(all[2 * r]) + static_cast<double>(all[2 * r + 1]);
    return total;
}

float clip_coefficient(double norm, float max_norm) {
    if (max_norm <= 0 || !std::isfinite(norm)) return 1.0f;
    double coeff = max_norm / (norm + 1e-6);
    return coeff < 1.0 ? static_cast<float>(coeff) : 1.0f;
}

}  // namespace loom::optim
