#include "optim/adamw.h"

#include "core/dtype.h"
#include "core/error.h"
#include "core/grad_norm_gate.h"
#include "core/host_adam.h"
#include "core/thread_pool.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::optim {

void adamw_update(float * p, const float * g, float * m, float * v, int64_t n, float lr, float beta1, float beta2,
                  float eps, float weight_decay, int64_t step, uint16_t * p_bf16) {
    const AdamScalars s         = adam_scalars(lr, beta1, beta2, weight_decay, step);
    const float       bc2_sqrt  = s.bc2_sqrt;
    const float       step_size = s.step_size;
    const float       decay     = s.decay;
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

float clip_coefficient(double norm, float max_norm) { return clip_factor(norm, max_norm); }

}  // namespace loom::optim
