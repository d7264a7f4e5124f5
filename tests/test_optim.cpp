// AdamW against a double-precision reference, Megatron's parameter groups, the LR schedules at known
// points, global-norm clipping, and the optimizer interface's step (norm, skip, clip, update).
#include "backend/cpu/cpu_device.h"
#include "optim/adamw.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>

using namespace loom;

TEST(AdamW, MatchesADoublePrecisionReferenceOverTenSteps) {
    const int64_t n = 1000;
    std::vector<float>  p(n), g(n), m(n, 0), v(n, 0);
    std::vector<double> pd(n), md(n, 0), vd(n, 0);
    for (int64_t i = 0; i < n; ++i) pd[i] = p[i] = std::sin(0.1 * i);
    const double lr = 1e-2, b1 = 0.9, b2 = 0.95, eps = 1e-8, wd = 0.1;
    for (int step = 1; step <= 10; ++step) {
        for (int64_t i = 0; i < n; ++i) g[i] = static_cast<float>(std::cos(0.37 * i * step));
        for (int64_t i = 0; i < n; ++i) {
            double gi = g[i];
            pd[i] *= 1 - lr * wd;
            md[i] = b1 * md[i] + (1 - b1) * gi;
            vd[i] = b2 * vd[i] + (1 - b2) * gi * gi;
            double mh = md[i] / (1 - std::pow(b1, step)), vh = vd[i] / (1 - std::pow(b2, step));
            pd[i] -= lr * mh / (std::sqrt(vh) + eps);
        }
        optim::adamw_update(p.data(), g.data(), m.data(), v.data(), n, lr, b1, b2, eps, wd, step);
    }
    double worst = 0;
    for (int64_t i = 0; i < n; ++i) worst = std::max(worst, std::fabs(p[i] - pd[i]));
    EXPECT_LT(worst, 2e-6) << "f32 update vs double reference after 10 steps";
}

TEST(AdamW, BiasesAndNormsGetNoWeightDecay) {
    Device &         device = cpu::device();
    model::Parameter w = model::parameter_create("w", {4}, DType::f32, device);
    model::Parameter b = model::parameter_create("b", {4}, DType::f32, device);
    b.no_weight_decay  = true;
    model::parameter_init_constant(w, 1.0f);
    model::parameter_init_constant(b, 1.0f);
    optim::AdamWConfig cfg;
    cfg.weight_decay = 0.5f;
    optim::AdamW opt({&w, &b}, cfg);
    optim::StepResult r = opt.step(0.1f);   // zero gradients: only decay moves the weights
    EXPECT_TRUE(r.stepped);
    EXPECT_EQ(r.grad_norm, 0.0);
    device.compute_stream().synchronize();   // the update is compute-stream work
    EXPECT_FLOAT_EQ(w.data.data<float>()[0], 1.0f - 0.1f * 0.5f);
    EXPECT_FLOAT_EQ(b.data.data<float>()[0], 1.0f);
    EXPECT_EQ(opt.steps(), 1);
    EXPECT_EQ(device.allocator().pool_stats("optimizer").allocated >= 2 * 2 * 4 * 4, true);
}

TEST(LrSchedule, WarmupThenDecayToMinimum) {
    optim::LrSchedule s;
    s.max_lr = 1.0f;
    s.min_lr = 0.1f;
    s.warmup_steps = 10;
    s.decay_steps = 110;
    s.style = optim::LrDecayStyle::cosine;
    EXPECT_FLOAT_EQ(s.lr_at(1), 0.1f);
    EXPECT_FLOAT_EQ(s.lr_at(10), 1.0f);
    EXPECT_NEAR(s.lr_at(60), 0.55f, 1e-6f);     // halfway: (1 + cos(pi/2)) / 2
    EXPECT_NEAR(s.lr_at(110), 0.1f, 1e-6f);
    EXPECT_FLOAT_EQ(s.lr_at(500), 0.1f);
    s.style = optim::LrDecayStyle::linear;
    EXPECT_NEAR(s.lr_at(35), 1.0f - 0.9f * 0.25f, 1e-6f);
    s.style = optim::LrDecayStyle::constant;
    EXPECT_FLOAT_EQ(s.lr_at(90), 1.0f);
    EXPECT_THROW(optim::lr_decay_style_from_name("inverse-square-root-ish"), Error);
}

// Megatron counts schedule steps in samples: with a global batch of 4, iteration k is step 4k.
TEST(LrSchedule, CountsSamplesAndHasMegatronsOtherStyles) {
    optim::LrSchedule s;
    s.max_lr                = 1.0f;
    s.min_lr                = 0.0f;
    s.init_lr               = 0.2f;   // --lr-warmup-init
    s.samples_per_iteration = 4;
    s.warmup_steps          = 16;     // 4 iterations
    s.decay_steps           = 80;     // 20 iterations
    s.style                 = optim::LrDecayStyle::linear;
    EXPECT_FLOAT_EQ(s.lr_at(1), 0.2f + 0.8f * 4 / 16);
    EXPECT_FLOAT_EQ(s.lr_at(4), 1.0f);
    EXPECT_NEAR(s.lr_at(12), 1.0f - 32.0f / 64.0f, 1e-6f);
    // inverse-square-root: max_lr sqrt(warmup) / sqrt(n), not below min_lr.
    s.style  = optim::LrDecayStyle::inverse_square_root;
    s.min_lr = 0.3f;
    EXPECT_NEAR(s.lr_at(9), 4.0f / 6.0f, 1e-6f);   // n = 36
    EXPECT_NEAR(s.lr_at(20), 4.0f / std::sqrt(80.0f), 1e-6f);   // n = 80: 0.447
    s.min_lr = 0.5f;
    EXPECT_FLOAT_EQ(s.lr_at(20), 0.5f) << "clamped to min_lr";
    // WSD: flat until the anneal (the last 16 samples of the decay), then each anneal style.
    s.style     = optim::LrDecayStyle::wsd;
    s.min_lr    = 0.0f;
    s.wsd_steps = 16;
    EXPECT_FLOAT_EQ(s.lr_at(16), 1.0f);   // n = 64 = decay - wsd: still flat
    const std::pair<optim::WsdDecayStyle, float> anneal[] = {
        {optim::WsdDecayStyle::linear, 0.5f}, {optim::WsdDecayStyle::cosine, 0.5f},
        {optim::WsdDecayStyle::exponential, 2.0f * std::sqrt(0.5f) - 1.0f},
        {optim::WsdDecayStyle::minus_sqrt, 1.0f - std::sqrt(0.5f)}};
    for (const auto & [style, halfway] : anneal) {
        s.wsd_style = style;
        EXPECT_NEAR(s.lr_at(18), halfway, 1e-6f) << static_cast<int>(style);   // n = 72: halfway through
        EXPECT_NEAR(s.lr_at(20), 0.0f, 1e-6f) << static_cast<int>(style);
    }
    EXPECT_EQ(optim::lr_decay_style_from_name("WSD"), optim::LrDecayStyle::wsd);
    EXPECT_EQ(optim::wsd_decay_style_from_name("minus_sqrt"), optim::WsdDecayStyle::minus_sqrt);
    EXPECT_THROW(optim::wsd_decay_style_from_name("step"), Error);
}

TEST(GradClip, ScalesToTheMaximumNormOnlyWhenAbove) {
    Device &         device = cpu::device();
    model::Parameter a = model::parameter_create("a", {2}, DType::f32, device);
    model::Parameter b = model::parameter_create("b", {1}, DType::f32, device);
    a.main_grad.data<float>()[0] = 3.0f;
    a.main_grad.data<float>()[1] = 0.0f;
    b.main_grad.data<float>()[0] = 4.0f;
    const std::vector<optim::GradView> views = optim::grad_views({&a, &b});
    EXPECT_DOUBLE_EQ(optim::clip_grad_norm(views, 10.0f), 5.0);
    EXPECT_FLOAT_EQ(a.main_grad.data<float>()[0], 3.0f);
    EXPECT_DOUBLE_EQ(optim::clip_grad_norm(views, 1.0f), 5.0);
    EXPECT_NEAR(optim::grad_norm(views), 1.0, 1e-6);
    b.shared = true;   // a copy another stage counts: left out of the norm, still scaled
    EXPECT_NEAR(optim::grad_norm(optim::grad_views({&a, &b})), 0.6, 1e-6);
}

// step(): the norm of the gradients before clipping, the clipped update, and a skipped step on a
// non-finite norm that leaves weights, state and step count alone.
TEST(Optimizer, StepClipsAndSkipsNonFiniteNorms) {
    Device &         device = cpu::device();
    model::Parameter w      = model::parameter_create("w", {2}, DType::f32, device);
    model::Parameter ref    = model::parameter_create("ref", {2}, DType::f32, device);
    model::parameter_init_constant(w, 1.0f);
    model::parameter_init_constant(ref, 1.0f);
    optim::OptimizerOptions clipped;
    clipped.clip_grad = 1.0f;
    optim::AdamW opt({&w}, clipped);
    optim::AdamW plain({&ref}, optim::OptimizerOptions{});
    w.main_grad.data<float>()[0]   = 30.0f;
    w.main_grad.data<float>()[1]   = 40.0f;
    ref.main_grad.data<float>()[0] = 0.6f;   // the clipped gradient, (30, 40) * 1 / (50 + 1e-6)
    ref.main_grad.data<float>()[1] = 0.8f;
    optim::StepResult r = opt.step(0.1f);
    EXPECT_TRUE(r.stepped);
    EXPECT_DOUBLE_EQ(r.grad_norm, 50.0);
    plain.step(0.1f);
    device.compute_stream().synchronize();
    EXPECT_NEAR(w.main_grad.data<float>()[0], 0.6f, 1e-6f) << "clipping scales the gradient itself";
    EXPECT_NEAR(w.data.data<float>()[0], ref.data.data<float>()[0], 1e-6f);
    EXPECT_NEAR(w.data.data<float>()[1], ref.data.data<float>()[1], 1e-6f);

    const float before = w.data.data<float>()[0];
    w.main_grad.data<float>()[1] = std::nanf("");
    r = opt.step(0.1f);
    device.compute_stream().synchronize();
    EXPECT_FALSE(r.stepped);
    EXPECT_TRUE(std::isnan(r.grad_norm));
    EXPECT_EQ(w.data.data<float>()[0], before);
    EXPECT_EQ(opt.steps(), 1);
}
