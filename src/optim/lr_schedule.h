// The learning-rate schedule: Megatron's OptimizerParamScheduler.get_lr, as a pure function of the step n.
// Megatron counts steps in samples: after k successful updates n = k x samples_per_iteration (the global
// batch), and warmup, decay and WSD lengths are in samples (iterations x global batch, a fraction of the
// decay, or samples as given). Iteration k's update uses the lr at the step before it (n = (k-1) x batch:
// the first update of a warmup from 0 moves nothing), and the log line of iteration k shows the lr at
// n = k x batch, the one the scheduler advanced to, as Megatron's training_log reads it after the step:
//   n <= warmup:             lr = init_lr + (max_lr - init_lr) n / warmup
//   constant:                lr = max_lr
//   n >  decay:              lr = min_lr
//   inverse-square-root:     lr = max(min_lr, max_lr sqrt(max(warmup, 1)) / sqrt(max(n, 1)))
//   otherwise, r = (n - warmup) / (decay - warmup), lr = min_lr + (max_lr - min_lr) c with
//     linear: c = 1 - r;  cosine: c = (1 + cos(pi r)) / 2;
//     WSD: c = 1 until n > decay - wsd, then with q = (n - decay + wsd) / wsd: linear 1 - q, cosine
//          (1 + cos(pi q)) / 2, exponential 2 * 0.5^q - 1, minus_sqrt 1 - sqrt(q)
#pragma once

#include <cstdint>
#include <optional>
#include <string>

namespace loom::optim {

enum class LrDecayStyle { constant, linear, cosine, inverse_square_root, wsd };
enum class WsdDecayStyle { exponential, linear, cosine, minus_sqrt };
LrDecayStyle  lr_decay_style_from_name(const std::string & name);    // --lr-decay-style (WSD, inverse-square-root, ...)
WsdDecayStyle wsd_decay_style_from_name(const std::string & name);   // --lr-wsd-decay-style
const char *  lr_decay_style_name(LrDecayStyle style);              // the flag's spelling of each
const char *  wsd_decay_style_name(WsdDecayStyle style);

struct LrSchedule {
    float         max_lr       = 6e-4f;
    float         min_lr       = 0.0f;
    float         init_lr      = 0.0f;   // --lr-warmup-init
    double        warmup_steps = 0;      // samples
    double        decay_steps  = 1;      // samples, > warmup_steps
    double        wsd_steps    = 0;      // samples of the WSD anneal
    int64_t       samples_per_iteration = 1;
    LrDecayStyle  style     = LrDecayStyle::linear;
    WsdDecayStyle wsd_style = WsdDecayStyle::exponential;

    // --decoupled-lr / --decoupled-min-lr: the embedding's and output layer's own maximum and minimum (the
    // minimum defaults to min_lr), on the same schedule (Megatron's param-group max_lr / min_lr overrides).
    std::optional<float> decoupled_max_lr, decoupled_min_lr;
    // µP (--use-mup): the hidden matrices' maximum and minimum are max_lr and min_lr times this (1 / width
    // multiplier), on the same schedule (Megatron's MuP param-group overrides). Unset: no such group.
    std::optional<double> mup_hidden_scale;

    // The lr after `iteration` iterations of samples_per_iteration samples each.
    float lr_at(int64_t iteration) const { return lr_at_step(steps_after(iteration)); }
    float decoupled_lr_at(int64_t iteration) const { return decoupled_lr_at_step(steps_after(iteration)); }
    // The lr after `n` samples (Megatron's num_steps).
    float lr_at_step(double n) const { return lr_at_step(n, max_lr, min_lr); }
    // The embedding's and output layer's lr: lr_at_step's without --decoupled-lr.
    float decoupled_lr_at_step(double n) const {
        return decoupled_max_lr ? lr_at_step(n, *decoupled_max_lr, decoupled_min_lr.value_or(min_lr)) : lr_at_step(n);
    }
    // µP's hidden matrices' lr (nullopt without µP).
    std::optional<float> hidden_lr_at_step(double n) const {
        if (!mup_hidden_scale) return std::nullopt;
        return lr_at_step(n, static_cast<float>(max_lr * *mup_hidden_scale), static_cast<float>(min_lr * *mup_hidden_scale));
    }
    float  lr_at_step(double n, float max, float min) const;
    double steps_after(int64_t iteration) const {
        return static_cast<double>(iteration) * static_cast<double>(samples_per_iteration);
    }
};

}  // namespace loom::optim
