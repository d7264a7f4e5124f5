// Batch, iterations, the learning-rate schedule and Adam: Megatron's flags, its rules (arguments.py's
// asserts, training.py's get_optimizer_param_scheduler) and the schedule they derive.
#include "core/error.h"
#include "optim/adamw.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdio>
#include <sstream>

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
    {"--optimizer", "training", &OptimFlags::optimizer,
     "adam, or muon (the weight matrices; AdamW the rest); dist_muon is muon with --use-distributed-optimizer",
     kShowDefault, {"optimizer", [](const O & o) -> json { return o.optimizer(); }}},
    {"--muon-momentum", kReg, &OptimFlags::muon_momentum, "Muon's momentum factor", kShowDefault},
    {"--muon-no-split-qkv", kReg, &OptimFlags::muon_split_qkv,
     "orthogonalize a QKV weight whole, not its Q, K and V blocks apart", kNegated},
    {"--muon-nesterov", kReg, &OptimFlags::muon_nesterov, "Nesterov momentum in Muon's update"},
    {"--muon-scale-mode", kReg, &OptimFlags::muon_scale_mode,
     "spectral (sqrt of the larger side), unit_rms_norm (sqrt rows/cols) or shape_scaling (sqrt max(1, rows/cols))",
     kShowDefault},
    {"--muon-fp32-matmul-prec", kReg, &OptimFlags::muon_fp32_matmul_prec,
     "Newton-Schulz matmuls: medium (bf16 operands and results, f32 accumulation) or high (f32)", kShowDefault},
    {"--muon-coefficient-type", kReg, &OptimFlags::muon_coefficient_type,
     "Newton-Schulz coefficients: quintic, simple, polar_express, cans or aol", kShowDefault},
    {"--muon-num-ns-steps", kReg, &OptimFlags::muon_num_ns_steps, "Newton-Schulz steps", kShowDefault},
    {"--muon-tp-mode", kReg, &OptimFlags::muon_tp_mode,
     "duplicated or distributed (the whole matrix, the same update at any TP), or blockwise (each TP shard apart)",
     kShowDefault},
    {"--muon-use-syrk", kReg, &OptimFlags::muon_use_syrk,
     "a kernel choice for the Gram matrix X X^T; Loom's GEMM computes the same product"},
    {"--muon-extra-scale-factor", kReg, &OptimFlags::muon_extra_scale_factor, "a factor on Muon's update",
     kShowDefault},
    {"--muon-scalar-optimizer", kReg, &OptimFlags::muon_scalar_optimizer,
     "the optimizer of the parameters Muon leaves out (embeddings, biases, norms): adam", kShowDefault},
    {"--no-use-layer-wise-param-layout", "mixed precision", &OptimFlags::use_layer_wise_param_layout,
     "Megatron's buffer layout choice for distributed Muon; Loom's ZeRO-1 Muon has one layout, and the update is "
     "the same", kNegated},
};

const Flag<TrainOptions> kScheduleFlags[] = {
    {"--micro-batch-size", "training", &O::micro_batch_size, "sequences per microbatch", kShowDefault,
     {"micro_batch_size", [](const O & o) -> json { return o.micro_batch_size; }}},
    {"--global-batch-size", "training", &O::global_batch_size, "sequences per iteration (default: micro x dp)", kPlain,
     {"global_batch_size", [](const O & o) -> json { return o.global_batch_size; }}},
    {"--step-batch-size-schedule", "training", &O::step_batch_size_schedule,
     "a growing global batch: \"THRESHOLD:BATCH ...\", thresholds in tokens (K, M, B, T suffixes), the first 0; "
     "instead of --global-batch-size"},
    {"--rampup-batch-size", "training", &O::rampup_batch_size,
     "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT to --global-batch-size over SAMPLES "
     "samples (deprecated upstream for --step-batch-size-schedule, which Loom also takes)",
     kList},
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
    {"--fp16", "mixed precision", &O::fp16,
     "f16 parameters, GEMM operands and saved activations with a loss scaler (dynamic unless --loss-scale); f32 grads "
     "and master weights", kPlain,
     {"fp16", [](const O & o) -> json { return o.fp16; }}},
    {"--loss-scale", "mixed precision", &O::loss_scale,
     "a constant loss scale (with --fp16 or --bf16); without it --fp16 scales dynamically"},
    {"--initial-loss-scale", "mixed precision", &O::initial_loss_scale, "the dynamic loss scale's start",
     kShowDefault},
    {"--min-loss-scale", "mixed precision", &O::min_loss_scale, "the dynamic loss scale's floor", kShowDefault},
    {"--loss-scale-window", "mixed precision", &O::loss_scale_window,
     "steps without overflow before the dynamic loss scale doubles", kShowDefault},
    {"--hysteresis", "mixed precision", &O::hysteresis,
     "overflowing steps the dynamic loss scale tolerates before it halves", kShowDefault},
};

// "THRESHOLD:BATCH ..." (spaces or commas between entries), Megatron's StepBatchsizeNumMicroBatchesCalculator:
// each number int(float(text) x 10^3/6/9/12 for a K/M/B/T suffix), thresholds in tokens (Megatron always
// passes the sequence length) turned into samples, sorted, the first 0 and strictly increasing, every
// batch >= 1. Whether micro x dp divides a batch is checked where the run reaches it (train/trainer.cpp).
std::vector<std::pair<int64_t, int64_t>> parse_step_batch_size_schedule(const std::string & text, int64_t seq_length) {
    auto number = [&](const std::string & given, const std::string & entry) {
        const char * const kHint = "write each entry THRESHOLD:BATCH, e.g. \"0:384 200B:768\"";
        std::string        word  = given;
        for (char & c : word) c = static_cast<char>(std::toupper(static_cast<unsigned char>(c)));
        double scale = 1;
        if (!word.empty() && std::string("KMBT").find(word.back()) != std::string::npos) {
            scale = std::pow(1000.0, 1 + static_cast<double>(std::string("KMBT").find(word.back())));
            word.pop_back();
        }
        const std::optional<std::string> plain = python_float_text(word);
        LOOM_CHECK(plain, "--step-batch-size-schedule: '" << entry << "' has '" << given << "', not a number", kHint);
        const double value = std::stod(*plain) * scale;
        LOOM_CHECK(std::isfinite(value) && value >= 0 && value < 0x1p62,
                   "--step-batch-size-schedule: '" << entry << "' is outside [0, 2^62)", kHint);
        return static_cast<int64_t>(value);
    };
    std::string spaced = text;
    for (char & c : spaced) c = c == ',' ? ' ' : c;
    std::vector<std::pair<int64_t, int64_t>> schedule;
    std::istringstream words(spaced);
    for (std::string entry; words >> entry;) {
        const size_t colon = entry.find(':');
        LOOM_CHECK(colon != std::string::npos,
                   "--step-batch-size-schedule: invalid schedule entry \"" << entry << "\"",
                   "Expected format: \"THRESHOLD:BATCH_SIZE\"");
        const int64_t threshold = number(entry.substr(0, colon), entry) / std::max<int64_t>(1, seq_length);
        schedule.emplace_back(threshold, number(entry.substr(colon + 1), entry));
    }
    std::stable_sort(schedule.begin(), schedule.end(), [](const auto & a, const auto & b) { return a.first < b.first; });
    LOOM_CHECK(!schedule.empty(), "--step-batch-size-schedule '" << text << "' has no entries", "");
    LOOM_CHECK(schedule[0].first == 0, "--step-batch-size-schedule: first schedule entry must have threshold 0, got "
                                           << schedule[0].first << " samples",
               "start the schedule with 0:BATCH");
    for (size_t i = 0; i < schedule.size(); ++i) {
        LOOM_CHECK(i == 0 || schedule[i].first > schedule[i - 1].first,
                   "--step-batch-size-schedule: schedule thresholds must be strictly increasing, got "
                       << schedule[i - 1].first << " before " << schedule[i].first << " samples",
                   "thresholds closer than one sequence's tokens fall on the same sample");
        LOOM_CHECK(schedule[i].second >= 1 && schedule[i].second <= (int64_t(1) << 40),
                   "--step-batch-size-schedule: batch size must lie in [1, 2^40], got " << schedule[i].second, "");
    }
    return schedule;
}

// START INCREMENT SAMPLES, Megatron's RampupBatchsizeNumMicroBatchesCalculator: after c samples the batch is
// START + INCREMENT x int(c / (SAMPLES / steps)) until c exceeds SAMPLES, then the global batch; as a
// schedule, step k starts at the first c where that int() reaches k.
std::vector<std::pair<int64_t, int64_t>> rampup_schedule(const std::vector<std::string> & words, int64_t global) {
    LOOM_CHECK(words.size() == 3, "--rampup-batch-size takes 3 values (START INCREMENT SAMPLES), got " << words.size(),
               "e.g. --rampup-batch-size 16 8 300000");
    int64_t v[3];
    for (size_t i = 0; i < 3; ++i) {
        const std::optional<std::string> plain = python_int_text(words[i]);
        LOOM_CHECK(plain && plain->size() < 19, "--rampup-batch-size: '" << words[i] << "' is not an integer", "");
        v[i] = std::stoll(*plain);
    }
    const int64_t start = v[0], increment = v[1], samples = v[2];
    LOOM_CHECK(start >= 1 && increment >= 1 && samples >= 1,
               "--rampup-batch-size " << start << " " << increment << " " << samples << ": each value must be >= 1", "");
    LOOM_CHECK(start < global && (global - start) % increment == 0,
               "--rampup-batch-size: expected global batch size interval (" << global - start
                   << ") to be divisible by global batch size increment (" << increment << ") and positive",
               "--global-batch-size " << global << " is where the ramp ends");
    const int64_t steps = (global - start) / increment;
    LOOM_CHECK(steps <= 1000000, "--rampup-batch-size: " << steps << " increments", "ramp in fewer, larger steps");
    const double per_step = static_cast<double>(samples) / static_cast<double>(steps);
    std::vector<std::pair<int64_t, int64_t>> schedule{{0, start}};
    for (int64_t k = 1; k <= steps; ++k) {
        auto reached = [&](int64_t c) { return static_cast<int64_t>(static_cast<double>(c) / per_step) >= k; };
        int64_t c = static_cast<int64_t>(std::ceil(static_cast<double>(k) * per_step));
        while (c > schedule.back().first + 1 && reached(c - 1)) --c;
        while (!reached(c)) ++c;
        if (c <= schedule.back().first) schedule.back().second = start + k * increment;
        else schedule.emplace_back(c, start + k * increment);
    }
    // Past SAMPLES (c > SAMPLES) the global batch, which the last step already is.
    return schedule;
}

// The iterations --train-samples makes (Megatron's update_train_iters): with a step schedule, iterations
// until the samples are consumed; with a ramp, those up to the end of the ramp, then whole global batches
// (Python's floor division); otherwise whole global batches.
int64_t iterations_for_samples(const TrainOptions & o) {
    const auto & s = o.batch_schedule;
    if (s.empty()) return o.train_samples / o.global_batch_size;
    const bool ramp  = !o.rampup_batch_size.empty();
    // Megatron's loops: `while consumed < samples` (a schedule), `while consumed <= ramp and consumed <=
    // samples` (a ramp): every iteration that starts below `end`.
    const int64_t end = ramp ? std::min(s.back().first, o.train_samples) + 1 : o.train_samples;
    int64_t consumed = 0, iterations = 0;
    for (size_t i = 0; i < s.size() && consumed < end; ++i) {
        const int64_t stop = std::min(end, i + 1 < s.size() ? s[i + 1].first : end);
        if (consumed >= stop) continue;
        const int64_t n = (stop - consumed + s[i].second - 1) / s[i].second;
        consumed += n * s[i].second;
        iterations += n;
    }
    if (ramp) {
        const int64_t rest = o.train_samples - consumed;
        iterations += rest >= 0 ? rest / o.global_batch_size : -((-rest + o.global_batch_size - 1) / o.global_batch_size);
    }
    return iterations;
}

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

void resolve_optimizer(const OptimFlags & f, TrainOptions & o) {
    std::string name = f.optimizer;
    if (name == "dist_muon") {   // deprecated upstream for --optimizer muon --use-distributed-optimizer
        name                            = "muon";
        o.ddp.use_distributed_optimizer = true;
    }
    LOOM_CHECK(name == "adam" || name == "muon", "--optimizer " << f.optimizer << " is not one Loom runs",
               "give adam or muon (sgd, lion, soap and adaptive_muon are Megatron's, not Loom's)");
    if (name == "adam") return;   // Megatron reads the --muon-* flags only for Muon; so does Loom
    LOOM_CHECK(!o.fp16, "emerging optimizer with fp16 is not supported.", "train Muon with --bf16 or in f32");
    LOOM_CHECK(!o.ddp.use_megatron_fsdp, "Emerging optimizer does not support Megatron-FSDP for now.",
               "drop --use-megatron-fsdp, or train with --optimizer adam");
    LOOM_CHECK(!o.optimizer_cpu_offload, "--optimizer muon with --optimizer-cpu-offload",
               "the host step is AdamW's; train Muon without the offload");
    LOOM_CHECK(f.muon_scalar_optimizer == "adam",
               "--muon-scalar-optimizer " << f.muon_scalar_optimizer << " is not one Loom runs",
               "give adam (lion is Megatron's, not Loom's)");
    LOOM_CHECK(f.muon_fp32_matmul_prec == "medium" || f.muon_fp32_matmul_prec == "high",
               "--muon-fp32-matmul-prec " << f.muon_fp32_matmul_prec << " is not one Loom runs",
               "give medium (bf16 Newton-Schulz matmuls, Megatron's default) or high (f32)");
    LOOM_CHECK(std::isfinite(f.muon_momentum) && f.muon_momentum >= 0.0f && f.muon_momentum < 1.0f,
               "--muon-momentum must lie in [0, 1), got " << f.muon_momentum, "");
    LOOM_CHECK(std::isfinite(f.muon_extra_scale_factor),
               "--muon-extra-scale-factor must be a finite number, got " << f.muon_extra_scale_factor, "");
    LOOM_CHECK(f.muon_num_ns_steps >= 1 && f.muon_num_ns_steps <= 100,
               "--muon-num-ns-steps must lie in [1, 100], got " << f.muon_num_ns_steps, "");
    optim::MuonConfig m;
    m.momentum           = f.muon_momentum;
    m.nesterov           = f.muon_nesterov;
    m.split_qkv          = f.muon_split_qkv;
    m.scale_mode         = optim::muon_scale_mode_from_name(f.muon_scale_mode);
    m.extra_scale_factor = f.muon_extra_scale_factor;
    m.num_ns_steps       = static_cast<int>(f.muon_num_ns_steps);
    m.coefficient_type   = f.muon_coefficient_type;
    m.bf16_matmul        = f.muon_fp32_matmul_prec == "medium";
    m.tp_mode            = optim::muon_tp_mode_from_name(f.muon_tp_mode);
    (void)optim::muon_coefficients(m.coefficient_type, m.num_ns_steps);   // an unknown type, named
    o.muon = m;
}

void resolve_batch(const Given & given, TrainOptions & o) {
    LOOM_CHECK(o.micro_batch_size >= 1 && o.micro_batch_size <= (int64_t(1) << 31),
               "--micro-batch-size must lie in [1, 2^31], got " << o.micro_batch_size, "");
    LOOM_CHECK(o.global_batch_size >= 0 && o.global_batch_size <= (int64_t(1) << 40),
               "--global-batch-size must lie in [1, 2^40], got " << o.global_batch_size, "");
    const bool stepped = given("--step-batch-size-schedule"), ramped = given("--rampup-batch-size");
    LOOM_CHECK(!stepped || !given("--global-batch-size"), "Cannot specify both --step-batch-size-schedule and "
                                                          "--global-batch-size",
               "the schedule's last batch is the global batch");
    LOOM_CHECK(!stepped || !ramped, "--step-batch-size-schedule with --rampup-batch-size", "give one of them");
    const int64_t dp = o.parallel.dp();
    if (o.global_batch_size == 0) o.global_batch_size = o.micro_batch_size * dp;
    LOOM_CHECK(o.global_batch_size % (o.micro_batch_size * dp) == 0,
               "--global-batch-size " << o.global_batch_size << " is not a multiple of --micro-batch-size "
                                      << o.micro_batch_size << " x data-parallel size " << dp,
               "choose a global batch that " << o.micro_batch_size * dp << " divides (each of the " << dp
                                             << " data-parallel ranks runs whole micro-batches)");
    if (stepped) o.batch_schedule = parse_step_batch_size_schedule(o.step_batch_size_schedule, o.model.seq_length);
    if (ramped) o.batch_schedule = rampup_schedule(o.rampup_batch_size, o.global_batch_size);
    if (o.eval_global_batch_size == 0) o.eval_global_batch_size = o.global_batch_size;
    LOOM_CHECK(o.eval_global_batch_size >= 1 && o.eval_global_batch_size <= (int64_t(1) << 40) &&
                   o.eval_global_batch_size % (o.micro_batch_size * dp) == 0,
               "eval_global_batch_size (" << o.eval_global_batch_size << ") must be divisible by eval_micro_batch_size ("
                                          << o.micro_batch_size << ") * data_parallel_size (" << dp << ")",
               "give --eval-global-batch-size a multiple of " << o.micro_batch_size * dp);
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
        o.train_iters = iterations_for_samples(o);   // Megatron's update_train_iters
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
    int64_t largest = o.global_batch_size;   // the largest batch an iteration may take
    for (const auto & entry : o.batch_schedule) largest = std::max(largest, entry.second);
    LOOM_CHECK(o.train_iters <= (int64_t(1) << 62) / largest / std::max<int64_t>(1, o.model.seq_length),
               "--train-iters " << o.train_iters << " x --global-batch-size " << largest
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
    LOOM_CHECK(!(o.fp16 && o.bf16), "--fp16 and --bf16 together", "choose one 16-bit dtype (Megatron asserts the same)");
    LOOM_CHECK(std::isfinite(o.loss_scale) && o.loss_scale >= 0.0f,
               "--loss-scale must be a positive number, got " << o.loss_scale, "");
    o.model.params_dtype = o.bf16 ? DType::bf16 : o.fp16 ? DType::f16 : DType::f32;
    if (o.fp16 && o.loss_scale == 0.0f) {
        // Megatron: overflowing gradients are the dynamic scaler's signal, not an error.
        if (o.check_for_nan_in_loss_and_grad || o.ddp.check_for_nan_in_grad) {
            std::fprintf(stderr, "WARNING: Setting args.check_for_nan_in_loss_and_grad to False since dynamic loss "
                                 "scaling is being used\n");
        }
        o.check_for_nan_in_loss_and_grad = false;
        o.ddp.check_for_nan_in_grad      = false;
    }
    if (o.loss_scale > 0.0f && !o.fp16 && !o.bf16) {
        std::fprintf(stderr, "WARNING: --loss-scale without --fp16 or --bf16 has no effect (Megatron's f32 optimizer "
                             "does not scale)\n");
    }
    if (const std::optional<optim::LossScalerOptions> scaler = o.loss_scaler()) optim::LossScaler check(*scaler);
}

std::optional<optim::LossScalerOptions> TrainOptions::loss_scaler() const {
    if (!fp16 && !(bf16 && loss_scale > 0.0f)) return std::nullopt;
    optim::LossScalerOptions s;
    if (loss_scale > 0.0f) s.constant = loss_scale;
    s.initial    = initial_loss_scale;
    s.min        = min_loss_scale;
    s.window     = loss_scale_window;
    s.hysteresis = hysteresis;
    return s;
}

int64_t TrainOptions::global_batch_size_at(int64_t consumed) const {
    int64_t batch = global_batch_size;
    for (const auto & [first, size] : batch_schedule) {
        if (consumed < first) break;
        batch = size;
    }
    return batch;
}

int64_t TrainOptions::train_samples_total() const {
    // Segment by segment of the schedule: the iterations that start inside [c, next threshold) each take
    // that segment's batch.
    int64_t consumed = 0, left = train_iters;
    for (size_t i = 0; i < batch_schedule.size() && left > 0; ++i) {
        if (i + 1 < batch_schedule.size() && consumed >= batch_schedule[i + 1].first) continue;
        const int64_t size = batch_schedule[i].second;
        const int64_t n    = i + 1 < batch_schedule.size()
                                 ? std::min(left, (batch_schedule[i + 1].first - consumed + size - 1) / size)
                                 : left;
        consumed += n * size;
        left -= n;
    }
    return consumed + left * global_batch_size;
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
    if (model.mup_width_mult() != 1.0) s.mup_hidden_scale = 1.0 / model.mup_width_mult();
    return s;
}

}  // namespace loom::train
