// Batch, iterations, the learning-rate schedule and Adam: Megatron's flags, its rules (arguments.py's
// asserts, training.py's get_optimizer_param_scheduler) and the schedule they derive.
#include "core/error.h"
#include "optim/adamw.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <cmath>

namespace loom::train {

namespace {

using json = nlohmann::json;
using O    = TrainOptions;
using A    = optim::AdamWConfig;

constexpr const char * kLr  = "learning rate";
constexpr const char * kReg = "regularization";

const Flag<optim::AdamWConfig> kAdamFlags[] = {
    {"--lr", kLr, &A::lr, "maximum learning rate", kShowDefault, {"lr", [](const O & o) -> json { return o.adam.lr; }}},
    {"--weight-decay", kReg, &A::weight_decay, "decoupled weight decay", kShowDefault,
     {"weight_decay", [](const O & o) -> json { return o.adam.weight_decay; }}},
    {"--adam-beta1", kReg, &A::beta1, "Adam beta1", kShowDefault},
    {"--adam-beta2", kReg, &A::beta2, "Adam beta2", kShowDefault},
    {"--adam-eps", kReg, &A::eps, "Adam epsilon", kShowDefault},
};

const Flag<OptimFlags> kOptimFlags[] = {
    {"--decoupled-lr", kLr, &OptimFlags::decoupled_lr,
     "the word embedding's and output layer's learning rate, on the same schedule (default: --lr)"},
    {"--decoupled-min-lr", kLr, &OptimFlags::decoupled_min_lr, "their minimum learning rate (default: --min-lr)"},
};

const Flag<TrainOptions> kScheduleFlags[] = {
    {"--micro-batch-size", "training", &O::micro_batch_size, "sequences per microbatch", kShowDefault,
     {"micro_batch_size", [](const O & o) -> json { return o.micro_batch_size; }}},
    {"--global-batch-size", "training", &O::global_batch_size, "sequences per iteration (default: micro x dp)", kPlain,
     {"global_batch_size", [](const O & o) -> json { return o.global_batch_size; }}},
    {"--train-iters", "training", &O::train_iters, "training iterations", kShowDefault,
     {"train_iters", [](const O & o) -> json { return o.train_iters; }}},
    {"--min-lr", kLr, &O::min_lr, "minimum learning rate", kShowDefault,
     {"min_lr", [](const O & o) -> json { return o.min_lr; }}},
    {"--lr-warmup-iters", kLr, &O::lr_warmup_iters, "linear warmup iterations", kShowDefault,
     {"lr_warmup_iters", [](const O & o) -> json { return o.lr_warmup_iters; }}},
    {"--lr-decay-style", kLr, &O::lr_decay_style, "constant, linear or cosine", kShowDefault,
     {"lr_decay_style", [](const O & o) -> json { return o.lr_decay_style; }}},
    {"--lr-decay-iters", kLr, &O::lr_decay_iters, "iterations to decay over (default: --train-iters)"},
    {"--train-samples", "training", &O::train_samples, "samples to train on (sample-based; instead of --train-iters)"},
    {"--lr-decay-samples", kLr, &O::lr_decay_samples, "samples to decay over (default: --train-samples)"},
    {"--lr-warmup-samples", kLr, &O::lr_warmup_samples, "linear warmup samples (sample-based)"},
    {"--lr-warmup-fraction", kLr, &O::lr_warmup_fraction, "warmup as a fraction of the decay"},
    {"--lr-warmup-init", kLr, &O::lr_warmup_init, "learning rate at the start of warmup", kShowDefault},
    {"--lr-wsd-decay-style", kLr, &O::lr_wsd_decay_style, "WSD anneal: exponential, linear, cosine or minus_sqrt",
     kShowDefault},
    {"--lr-wsd-decay-iters", kLr, &O::lr_wsd_decay_iters, "iterations of the WSD anneal"},
    {"--lr-wsd-decay-samples", kLr, &O::lr_wsd_decay_samples, "samples of the WSD anneal"},
    {"--clip-grad", kReg, &O::clip_grad, "clip gradients to this global norm (0: off)", kShowDefault,
     {"clip_grad", [](const O & o) -> json { return o.clip_grad; }}},
    {"--bf16", "mixed precision", &O::bf16,
     "bf16 parameters, GEMM operands and saved activations; f32 grads and master weights", kPlain,
     {"bf16", [](const O & o) -> json { return o.bf16; }}},
    {"--fp16", "mixed precision", &O::fp16, "float16 with loss scaling (not supported: use --bf16)"},
};

}  // namespace

std::span<const Flag<optim::AdamWConfig>> adam_flags() { return kAdamFlags; }
std::span<const Flag<OptimFlags>> optim_flags() { return kOptimFlags; }
std::span<const Flag<TrainOptions>> schedule_flags() { return kScheduleFlags; }

void resolve_decoupled_lr(const OptimFlags & f, const Given & given, TrainOptions & o) {
    for (auto [flag, value, target] : {std::tuple{"--decoupled-lr", f.decoupled_lr, &o.decoupled_lr},
                                       {"--decoupled-min-lr", f.decoupled_min_lr, &o.decoupled_min_lr}}) {
        if (!given(flag)) continue;
        LOOM_CHECK(std::isfinite(value) && value >= 0.0f, flag << " must be a finite number >= 0, got " << value, "");
        *target = value;
    }
}

void resolve_batch(TrainOptions & o) {
    LOOM_CHECK(o.micro_batch_size >= 1 && o.micro_batch_size <= (int64_t(1) << 31),
               "--micro-batch-size must lie in [1, 2^31], got " << o.micro_batch_size, "");
    LOOM_CHECK(o.global_batch_size >= 0 && o.global_batch_size <= (int64_t(1) << 40),
               "--global-batch-size must lie in [1, 2^40], got " << o.global_batch_size, "");
    const int64_t dp = o.parallel.dp();
    if (o.global_batch_size == 0) o.global_batch_size = o.micro_batch_size * dp;
    LOOM_CHECK(o.global_batch_size % (o.micro_batch_size * dp) == 0,
               "--global-batch-size " << o.global_batch_size << " is not a multiple of --micro-batch-size "
                                      << o.micro_batch_size << " x data-parallel size " << dp,
               "choose a global batch that " << o.micro_batch_size * dp << " divides (each of the " << dp
                                             << " data-parallel ranks runs whole micro-batches)");
}

// Either iteration-based or sample-based, never a mix; the warmup shorter than the decay.
void resolve_schedule(const Given & given, TrainOptions & o) {
    LOOM_CHECK(o.train_iters >= 1 && o.train_samples >= 0, "--train-iters and --train-samples must be >= 1", "");
    const bool samples = given("--train-samples");
    if (samples) {
        LOOM_CHECK(!given("--train-iters"), "--train-samples with --train-iters", "give one of them (expected "
                                                                                  "sample-based training)");
        LOOM_CHECK(o.train_samples >= o.global_batch_size,
                   "--train-samples " << o.train_samples << " is less than one global batch of " << o.global_batch_size,
                   "");
        LOOM_CHECK(!given("--lr-decay-iters") && !given("--lr-warmup-iters") && !given("--lr-wsd-decay-iters"),
                   "--lr-decay-iters, --lr-warmup-iters and --lr-wsd-decay-iters count iterations, and --train-samples "
                   "asks for sample-based training",
                   "give --lr-decay-samples, --lr-warmup-samples or --lr-wsd-decay-samples");
        o.train_iters = o.train_samples / o.global_batch_size;   // Megatron's update_train_iters
    } else {
        LOOM_CHECK(!given("--lr-decay-samples") && !given("--lr-warmup-samples") && !given("--lr-wsd-decay-samples"),
                   "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples need --train-samples",
                   "give the lengths in iterations (--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters), or "
                   "train for --train-samples");
    }
    LOOM_CHECK(!given("--lr-warmup-fraction") || (!given("--lr-warmup-iters") && !given("--lr-warmup-samples")),
               "--lr-warmup-fraction with --lr-warmup-" << (samples ? "samples" : "iters"), "can only specify one of them");
    LOOM_CHECK(!given("--lr-warmup-fraction") || (std::isfinite(o.lr_warmup_fraction) && o.lr_warmup_fraction >= 0 &&
                                                  o.lr_warmup_fraction < 1),
               "--lr-warmup-fraction must lie in [0, 1), got " << o.lr_warmup_fraction, "");
    LOOM_CHECK(o.lr_warmup_iters >= 0 && o.lr_warmup_samples >= 0, "--lr-warmup-iters and --lr-warmup-samples must be "
                                                                   ">= 0", "");
    LOOM_CHECK(std::isfinite(o.lr_warmup_init) && o.lr_warmup_init >= 0,
               "--lr-warmup-init must be a finite number >= 0, got " << o.lr_warmup_init, "");
    const optim::LrDecayStyle style = optim::lr_decay_style_from_name(o.lr_decay_style);
    optim::wsd_decay_style_from_name(o.lr_wsd_decay_style);
    if (o.lr_decay_iters == 0) o.lr_decay_iters = o.train_iters;
    if (o.lr_decay_samples == 0) o.lr_decay_samples = o.train_samples;
    LOOM_CHECK(o.lr_decay_iters >= 1 && o.lr_decay_samples >= 0, "--lr-decay-iters and --lr-decay-samples must be >= 1", "");
    LOOM_CHECK(style != optim::LrDecayStyle::wsd || given("--lr-wsd-decay-iters") || given("--lr-wsd-decay-samples"),
               "--lr-decay-style WSD needs the length of its anneal",
               "give --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)");
    const optim::LrSchedule s = o.lr_schedule();
    LOOM_CHECK(s.warmup_steps < s.decay_steps,
               "the warmup (" << s.warmup_steps << " samples) is not shorter than the decay (" << s.decay_steps
                              << " samples): --lr-warmup-* must be shorter than --lr-decay-* (default: the whole run)",
               "shorten the warmup or lengthen the decay");
    LOOM_CHECK(style != optim::LrDecayStyle::wsd || (s.wsd_steps > 0 && s.wsd_steps <= s.decay_steps),
               "the WSD anneal (" << s.wsd_steps << " samples) must lie in (0, the decay of " << s.decay_steps
                                  << " samples]",
               "");
    LOOM_CHECK(o.train_iters <= (int64_t(1) << 62) / o.global_batch_size / std::max<int64_t>(1, o.model.seq_length),
               "--train-iters " << o.train_iters << " x --global-batch-size " << o.global_batch_size
                                << " x --seq-length tokens overflows a 64-bit count", "");
}

// Finite and in range, each message naming its flag: a NaN or an infinity here would train on garbage.
void validate_hyperparameters(const TrainOptions & o) {
    auto finite = [](double x) { return std::isfinite(x); };
    LOOM_CHECK(finite(o.adam.lr) && o.adam.lr > 0, "--lr must be a finite number > 0, got " << o.adam.lr, "");
    LOOM_CHECK(finite(o.min_lr) && o.min_lr >= 0 && o.min_lr <= o.adam.lr,
               "--min-lr " << o.min_lr << " must lie in [0, --lr " << o.adam.lr << "]", "");
    LOOM_CHECK(finite(o.adam.beta1) && o.adam.beta1 >= 0 && o.adam.beta1 < 1,
               "--adam-beta1 must lie in [0, 1), got " << o.adam.beta1, "Megatron's default is 0.9");
    LOOM_CHECK(finite(o.adam.beta2) && o.adam.beta2 >= 0 && o.adam.beta2 < 1,
               "--adam-beta2 must lie in [0, 1), got " << o.adam.beta2, "Megatron's default is 0.999");
    LOOM_CHECK(finite(o.adam.eps) && o.adam.eps > 0, "--adam-eps must be a finite number > 0, got " << o.adam.eps,
               "it keeps the update finite where the second moment is 0; Megatron's default is 1e-8");
    LOOM_CHECK(finite(o.adam.weight_decay) && o.adam.weight_decay >= 0,
               "--weight-decay must be a finite number >= 0, got " << o.adam.weight_decay, "");
    LOOM_CHECK(finite(o.clip_grad) && o.clip_grad >= 0,
               "--clip-grad must be a finite number >= 0, got " << o.clip_grad, "0 turns clipping off");
    LOOM_CHECK(finite(o.model.init_method_std) && o.model.init_method_std > 0,
               "--init-method-std must be a finite number > 0, got " << o.model.init_method_std, "");
}

void resolve_precision(TrainOptions & o) {
    LOOM_CHECK(!o.fp16, "--fp16 (float16 parameters with dynamic loss scaling) is not supported",
               "use --bf16, which needs no loss scaling, or train in float32");
    o.model.params_dtype = o.bf16 ? DType::bf16 : DType::f32;
}

// Megatron counts the schedule's steps in samples: lengths given in iterations are multiplied by the
// global batch.
optim::LrSchedule TrainOptions::lr_schedule() const {
    optim::LrSchedule s;
    s.max_lr                = adam.lr;
    s.min_lr                = min_lr;
    s.init_lr               = lr_warmup_init;
    s.samples_per_iteration = global_batch_size;
    s.style                 = optim::lr_decay_style_from_name(lr_decay_style);
    s.wsd_style             = optim::wsd_decay_style_from_name(lr_wsd_decay_style);
    const double batch      = static_cast<double>(global_batch_size);
    if (train_samples > 0) {
        s.decay_steps  = static_cast<double>(lr_decay_samples);
        s.wsd_steps    = static_cast<double>(lr_wsd_decay_samples);
        s.warmup_steps = static_cast<double>(lr_warmup_samples);
    } else {
        s.decay_steps  = static_cast<double>(lr_decay_iters) * batch;
        s.wsd_steps    = static_cast<double>(lr_wsd_decay_iters) * batch;
        s.warmup_steps = static_cast<double>(lr_warmup_iters) * batch;
    }
    if (lr_warmup_fraction >= 0) s.warmup_steps = lr_warmup_fraction * s.decay_steps;
    s.decoupled_max_lr = decoupled_lr;
    s.decoupled_min_lr = decoupled_min_lr;
    return s;
}

}  // namespace loom::train
