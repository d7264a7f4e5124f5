#include "optim/adamw.h"

#include "core/error.h"
#include "core/thread_pool.h"
#include "core/host_adam.h"

#include <algorithm>
#include <cmath>
#include <vector>

namespace loom::optim {

LrDecayStyle lr_decay_style_from_name(const std::string & name) {
    if (name == "constant") return LrDecayStyle::constant;
    if (name == "linear") return LrDecayStyle::linear;
    if (name == "cosine") return LrDecayStyle::cosine;
    LOOM_THROW("--lr-decay-style '" << name << "' is not supported", "use constant, linear or cosine");
}

float LrSchedule::lr_at(int64_t k) const {
    if (warmup_iters > 0 && k <= warmup_iters) {
        return max_lr * static_cast<float>(k) / static_cast<float>(warmup_iters);
    }
    if (style == LrDecayStyle::constant) {
        return max_lr;
    }
    if (k > decay_iters) {
        return min_lr;
    }
    double ratio = decay_iters > warmup_iters
                       ? static_cast<double>(k - warmup_iters) / static_cast<double>(decay_iters - warmup_iters)
                       : 1.0;
    double coeff = style == LrDecayStyle::linear ? 1.0 - ratio : 0.5 * (std::cos(M_PI * ratio) + 1.0);
    return static_cast<float>(min_lr + coeff * (max_lr - min_lr));
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

AdamW::AdamW(std::vector<model::Parameter *> params, const AdamWConfig & config)
    : params_(std::move(params)), config_(config) {
    for (model::Parameter * p : params_) {
        TensorOptions options{MemoryKind::device, "optimizer"};
        exp_avg_.push_back(Tensor::zeros(p->data.shape(), DType::f32, p->data.device(), options));
        exp_avg_sq_.push_back(Tensor::zeros(p->data.shape(), DType::f32, p->data.device(), options));
        Tensor master;
        if (p->data.dtype() != DType::f32) {
            LOOM_CHECK(p->data.dtype() == DType::bf16, "AdamW on " << dtype_name(p->data.dtype()) << " parameter "
                                                                   << p->name, "parameters are float32 or bfloat16");
            master = Tensor::empty(p->data.shape(), DType::f32, p->data.device(), options);
            convert(p->data.data_ptr(), p->data.dtype(), master.data_ptr(), DType::f32, static_cast<size_t>(p->numel()));
        }
        master_.push_back(master);
    }
}

void AdamW::step(float lr) {
    // The host steps: the gradients (and the weights' last readers) are compute-stream work.
    if (!params_.empty()) params_.front()->main_grad.device().compute_stream().synchronize();
    ++step_;
    for (size_t k = 0; k < params_.size(); ++k) {
        model::Parameter * p = params_[k];
        float              wd = p->no_weight_decay ? 0.0f : config_.weight_decay;
        bool               mixed = master_[k].defined();
        // The CPU backend's memory is host memory: the SIMD host kernel, adamw_update's twin.
        host_adam_step(mixed ? master_[k].data<float>() : p->data.data<float>(), p->main_grad.data<float>(),
                       exp_avg_[k].data<float>(), exp_avg_sq_[k].data<float>(), p->numel(), lr, config_.beta1,
                       config_.beta2, config_.eps, wd, step_,
                       mixed ? HostAdamOut{p->data.data_ptr(), DType::bf16} : HostAdamOut{});
    }
}

double grad_norm(const std::vector<model::Parameter *> & params) {
    if (!params.empty()) params.front()->main_grad.device().compute_stream().synchronize();   // the host reads them
    // Per parameter, partial sums over fixed chunks (summed in chunk order afterwards): the result does
    // not depend on the thread count.
    constexpr int64_t kChunk = 1 << 16;
    double            total  = 0;
    for (model::Parameter * p : params) {
        const float *       g = p->main_grad.data<float>();
        const int64_t       n = p->numel(), chunks = (n + kChunk - 1) / kChunk;
        std::vector<double> partial(static_cast<size_t>(chunks), 0.0);
        parallel_for(chunks, 1, [&](int64_t begin, int64_t end) {
            for (int64_t c = begin; c < end; ++c) {
                double s = 0;
                for (int64_t i = c * kChunk; i < std::min(n, (c + 1) * kChunk); ++i) s += static_cast<double>(g[i]) * g[i];
                partial[static_cast<size_t>(c)] = s;
            }
        });
        for (double s : partial) total += s;
    }
    return std::sqrt(total);
}

double grad_norm_squared_unshared(const std::vector<model::Parameter *> & params) {
    std::vector<model::Parameter *> owned;
    for (model::Parameter * p : params) {
        if (!p->shared && !p->tp_duplicate) owned.push_back(p);
    }
    double norm = grad_norm(owned);
    return norm * norm;
}

double group_sum(double value, comm::Communicator & group, Device & device) {
    Tensor   mine   = Tensor::empty({2}, DType::f32, device);
    Tensor   all    = Tensor::empty({2 * static_cast<int64_t>(group.size())}, DType::f32, device);
    float    hi     = static_cast<float>(value);
    mine.data<float>()[0] = hi;
    mine.data<float>()[1] = static_cast<float>(value - static_cast<double>(hi));
    group.all_gather(mine, all)->wait();
    double total = 0;
    for (int r = 0; r < group.size(); ++r) {
        total += static_cast<double>(all.data<float>()[2 * r]) + static_cast<double>(all.data<float>()[2 * r + 1]);
    }
    return total;
}

float clip_coefficient(double norm, float max_norm) {
    if (max_norm <= 0 || !std::isfinite(norm)) return 1.0f;
    double coeff = max_norm / (norm + 1e-6);
    return coeff < 1.0 ? static_cast<float>(coeff) : 1.0f;
}

double clip_grad_norm(const std::vector<model::Parameter *> & params, float max_norm,
                      comm::Communicator & model_parallel) {
    LOOM_CHECK(!params.empty(), "clipping the gradients of no parameters", "");
    double norm  = std::sqrt(group_sum(grad_norm_squared_unshared(params), model_parallel, params.front()->main_grad.device()));
    float  coeff = clip_coefficient(norm, max_norm);
    if (coeff != 1.0f) scale_grads(params, coeff);
    return norm;
}

void scale_grads(const std::vector<model::Parameter *> & params, float factor) {
    if (!params.empty()) params.front()->main_grad.device().compute_stream().synchronize();
    for (model::Parameter * p : params) {
        float * g = p->main_grad.data<float>();
        parallel_for(p->numel(), 1 << 15, [&](int64_t begin, int64_t end) {
            for (int64_t i = begin; i < end; ++i) g[i] *= factor;
        });
    }
}

double clip_grad_norm(const std::vector<model::Parameter *> & params, float max_norm) {
    double norm  = grad_norm(params);
    float  coeff = clip_coefficient(norm, max_norm);
    if (coeff != 1.0f) scale_grads(params, coeff);
    return norm;
}

}  // namespace loom::optim
