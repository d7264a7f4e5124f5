// AdamW against a double-precision reference, Megatron's parameter groups, the LR schedules at known
// points, global-norm clipping, and the optimizer interface's step (norm, skip, clip, update).
#include "backend/cpu/cpu_device.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "optim/optimizer.h"

#include <gtest/gtest.h>

#include <cmath>
#include <random>

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

// The loss scaler against Megatron's DynamicGradScaler.update, transcribed here: an overflow resets the
// growth count and spends one of the hysteresis chances, and once they are spent halves the scale (never
// below the minimum); `window` clean steps double it and restore the chances. 2000 random steps with
// overflows at several rates, and the scripted sequence of a run's start.
TEST(LossScaler, FollowsMegatronsDynamicGradScaler) {
    struct Reference {   // grad_scaler.py, float32 scale
        float   scale, min;
        double  window;
        int64_t hysteresis, growth = 0, chances;
        void    update(bool found_inf) {
            if (found_inf) {
                growth = 0;
                chances -= 1;
                if (chances <= 0) scale = std::max(scale * 0.5f, min);
            } else {
                growth += 1;
                if (static_cast<double>(growth) == window) {
                    growth  = 0;
                    chances = hysteresis;
                    scale   = scale * 2.0f;
                }
            }
        }
    };
    std::mt19937 rng(7);
    for (const double rate : {0.05, 0.3, 0.7}) {
        optim::LossScalerOptions o;
        o.initial = 65536.0f, o.min = 4.0f, o.window = 7, o.hysteresis = 3;
        optim::LossScaler scaler(o);
        Reference         ref{65536.0f, 4.0f, 7, 3, 0, 3};
        std::bernoulli_distribution overflow(rate);
        for (int step = 0; step < 2000; ++step) {
            const bool inf = overflow(rng);
            scaler.update(inf);
            ref.update(inf);
            ASSERT_EQ(scaler.scale(), ref.scale) << "rate " << rate << ", step " << step;
            ASSERT_EQ(scaler.state().growth_tracker, ref.growth);
            ASSERT_EQ(scaler.state().hysteresis_tracker, ref.chances);
        }
    }
    // Megatron's defaults: 2^32; the first overflow only spends a chance, each later one halves; the floor.
    optim::LossScalerOptions defaults;
    defaults.min = 1024.0f;
    optim::LossScaler scaler(defaults);
    EXPECT_EQ(scaler.scale(), 4294967296.0f);
    scaler.update(true);
    EXPECT_EQ(scaler.scale(), 4294967296.0f) << "hysteresis 2: the first overflow is tolerated";
    scaler.update(true);
    EXPECT_EQ(scaler.scale(), 2147483648.0f);
    for (int i = 0; i < 40; ++i) scaler.update(true);
    EXPECT_EQ(scaler.scale(), 1024.0f) << "never below --min-loss-scale";
    for (int i = 0; i < 999; ++i) scaler.update(false);
    EXPECT_EQ(scaler.scale(), 1024.0f);
    scaler.update(false);
    EXPECT_EQ(scaler.scale(), 2048.0f) << "doubled after --loss-scale-window (1000) clean steps";
    EXPECT_EQ(scaler.inv_scale(), 1.0f / 2048.0f);
    EXPECT_EQ(scaler.state().hysteresis_tracker, 2) << "the chances restored";

    // A constant scale (--loss-scale) never moves, and loads nothing.
    optim::LossScalerOptions constant;
    constant.constant = 512.0f;
    optim::LossScaler fixed(constant);
    for (int i = 0; i < 10; ++i) fixed.update(i % 2 == 0);
    fixed.load({8.0f, 1, 1});
    EXPECT_EQ(fixed.scale(), 512.0f);
    EXPECT_FALSE(fixed.dynamic());

    // The state round trip, and what is refused by name.
    optim::LossScaler other(defaults);
    other.load(scaler.state());
    EXPECT_EQ(other.scale(), scaler.scale());
    EXPECT_EQ(other.state().hysteresis_tracker, scaler.state().hysteresis_tracker);
    auto refused = [](optim::LossScalerOptions o, const char * flag) {
        try {
            optim::LossScaler s(o);
            ADD_FAILURE() << flag << " was accepted";
        } catch (const Error & e) {
            EXPECT_NE(e.message().find(flag), std::string::npos) << e.message();
        }
    };
    optim::LossScalerOptions bad = defaults;
    bad.min = 8589934592.0f;
    refused(bad, "--min-loss-scale");
    bad = defaults, bad.hysteresis = 0;
    refused(bad, "--hysteresis");
    bad = defaults, bad.window = 0;
    refused(bad, "--loss-scale-window");
    bad = defaults, bad.constant = -1.0f;
    refused(bad, "--loss-scale");
}

// ---- Muon (optim/muon.h)

namespace {

using Matrix = std::vector<double>;   // row-major

// A random orthogonal n x n matrix: Gram-Schmidt (twice, for double's sake) on Gaussian columns.
Matrix random_orthogonal(int64_t n, std::mt19937 & rng) {
    std::normal_distribution<double> normal;
    Matrix                           q(static_cast<size_t>(n * n));
    for (double & v : q) v = normal(rng);
    for (int64_t j = 0; j < n; ++j) {
        for (int pass = 0; pass < 2; ++pass) {
            for (int64_t k = 0; k < j; ++k) {
                double dot = 0;
                for (int64_t i = 0; i < n; ++i) dot += q[i * n + j] * q[i * n + k];
                for (int64_t i = 0; i < n; ++i) q[i * n + j] -= dot * q[i * n + k];
            }
        }
        double norm = 0;
        for (int64_t i = 0; i < n; ++i) norm += q[i * n + j] * q[i * n + j];
        for (int64_t i = 0; i < n; ++i) q[i * n + j] /= std::sqrt(norm);
    }
    return q;
}

// The quintic set's map of one normalised singular value over five steps: NS(U S V^T) = U f(S / |S|_F) V^T,
// since every step is an odd polynomial of X applied as a X + (b X X^T + c (X X^T)^2) X.
double quintic_map(double s) {
    for (const auto & abc : optim::muon_coefficients("quintic", 5)) s = abc[0] * s + abc[1] * s * s * s + abc[2] * std::pow(s, 5);
    return s;
}

}  // namespace

// NS of X = U diag(s) V^T (U, V random orthogonal, s spread over [0.05, 1] before the normalisation) against
// U diag(f(s / |s|)) V^T computed here in double, for a wide and a tall matrix (the tall one runs on X^T X):
// f32 within 1e-5 of it, bf16 (Megatron's default precision) within 1e-2. The orthogonalisation error bound:
// over normalised singular values in [0.01, 1] five quintic steps land in [0.9777, 1.0318] (computed below on
// a grid), so |O O^T - I| (the smaller side's Gram matrix) is at most 1.0318^2 - 1 = 0.065 elementwise, which
// both precisions keep.
TEST(Muon, NewtonSchulzMapsEachSingularValueWithinTheStatedBound) {
    double lo = 2, hi = 0;
    for (int i = 0; i <= 4000; ++i) {
        const double f = quintic_map(0.01 * std::pow(100.0, i / 4000.0));
        lo             = std::min(lo, f);
        hi             = std::max(hi, f);
    }
    EXPECT_GT(lo, 0.977);
    EXPECT_LT(hi, 1.032);

    Device &     device = cpu::device();
    std::mt19937 rng(7);
    for (const auto & shape : {std::pair<int64_t, int64_t>{24, 40}, {40, 24}}) {
        const int64_t r = shape.first, c = shape.second, k = std::min(r, c);
        const Matrix  u = random_orthogonal(r, rng), v = random_orthogonal(c, rng);
        std::vector<double> s(static_cast<size_t>(k));
        double              norm = 0;
        for (int64_t i = 0; i < k; ++i) norm += (s[i] = std::pow(0.05, static_cast<double>(i) / (k - 1))) * s[i];
        norm = std::sqrt(norm);
        Tensor x = Tensor::empty({r, c}, DType::f32, device);
        Matrix expected(static_cast<size_t>(r * c));
        for (int64_t i = 0; i < r; ++i) {
            for (int64_t j = 0; j < c; ++j) {
                double xv = 0, ev = 0;
                for (int64_t l = 0; l < k; ++l) {
                    xv += u[i * r + l] * s[l] * v[j * c + l];
                    ev += u[i * r + l] * quintic_map(s[l] / norm) * v[j * c + l];
                }
                x.data<float>()[i * c + j] = static_cast<float>(3.0 * xv);   // NS ignores the scale
                expected[i * c + j]        = ev;
            }
        }
        for (const bool bf16 : {false, true}) {
            optim::MuonConfig config;
            config.bf16_matmul = bf16;
            Tensor out         = Tensor::empty({r, c}, DType::f32, device);
            optim::newton_schulz(x, out, config);
            device.compute_stream().synchronize();
            const float * o     = out.data<float>();
            double        worst = 0, gram = 0;
            for (int64_t i = 0; i < r * c; ++i) worst = std::max(worst, std::fabs(o[i] - expected[i]));
            for (int64_t a = 0; a < k; ++a) {   // O O^T (wide) or O^T O (tall)
                for (int64_t b = 0; b < k; ++b) {
                    double dot = 0;
                    for (int64_t l = 0; l < std::max(r, c); ++l) {
                        dot += r <= c ? double(o[a * c + l]) * o[b * c + l] : double(o[l * c + a]) * o[l * c + b];
                    }
                    gram = std::max(gram, std::fabs(dot - (a == b ? 1.0 : 0.0)));
                }
            }
            SCOPED_TRACE(std::to_string(r) + " x " + std::to_string(c) + (bf16 ? " bf16" : " f32"));
            EXPECT_LT(worst, bf16 ? 1e-2 : 1e-5);
            EXPECT_LT(gram, 0.065);
            std::printf("[NS %lld x %lld %s] worst |O - U f(S) V^T| %.3g, worst |Gram - I| %.3g\n",
                        static_cast<long long>(r), static_cast<long long>(c), bf16 ? "bf16" : "f32", worst, gram);
        }
    }
}

// The sets cycle (quintic) or repeat their last triple (polar_express); the scale modes; names refused.
TEST(Muon, CoefficientSchedulesScaleModesAndRefusals) {
    const auto q = optim::muon_coefficients("quintic", 7);
    EXPECT_EQ(q[5], q[0]);
    EXPECT_EQ(q[6], q[1]);
    const auto p = optim::muon_coefficients("polar_express", 10);
    EXPECT_EQ(p[9], p[7]);
    EXPECT_NE(p[7], p[6]);
    EXPECT_FLOAT_EQ(optim::muon_scale_factor(16, 64, optim::MuonScaleMode::spectral), 8.0f);
    EXPECT_FLOAT_EQ(optim::muon_scale_factor(64, 16, optim::MuonScaleMode::unit_rms_norm), 2.0f);
    EXPECT_FLOAT_EQ(optim::muon_scale_factor(16, 64, optim::MuonScaleMode::shape_scaling), 1.0f);
    EXPECT_FLOAT_EQ(optim::muon_scale_factor(64, 16, optim::MuonScaleMode::shape_scaling), 2.0f);
    for (const auto & bad : {std::pair<std::string, int>{"cubic7", 5}, {"quintic", 0}}) {
        try {
            (void)optim::muon_coefficients(bad.first, bad.second);
            ADD_FAILURE() << bad.first << " " << bad.second << " was taken";
        } catch (const Error & e) {
            EXPECT_NE(std::string(e.what()).find(bad.first == "cubic7" ? "--muon-coefficient-type 'cubic7'" : "--muon-num-ns-steps"),
                      std::string::npos) << e.what();
        }
    }
}

namespace {

// Newton-Schulz in double with the quintic set, written out here as the published iteration.
Matrix ns_reference(const Matrix & m, int64_t r, int64_t c) {
    const bool    tall = r > c;
    const int64_t k = tall ? c : r, n = tall ? r : c;   // X is k x n
    Matrix        x(static_cast<size_t>(k * n));
    double        norm = 0;
    for (double v : m) norm += v * v;
    for (int64_t i = 0; i < r; ++i) {
        for (int64_t j = 0; j < c; ++j) (tall ? x[j * n + i] : x[i * n + j]) = m[i * c + j] / std::sqrt(norm);
    }
    for (const auto & abc : optim::muon_coefficients("quintic", 5)) {
        Matrix a(static_cast<size_t>(k * k), 0), b(static_cast<size_t>(k * k), 0), next(x.size(), 0);
        for (int64_t i = 0; i < k; ++i)
            for (int64_t j = 0; j < k; ++j)
                for (int64_t l = 0; l < n; ++l) a[i * k + j] += x[i * n + l] * x[j * n + l];
        for (int64_t i = 0; i < k; ++i) {
            for (int64_t j = 0; j < k; ++j) {
                double aa = 0;
                for (int64_t l = 0; l < k; ++l) aa += a[i * k + l] * a[l * k + j];
                b[i * k + j] = abc[1] * a[i * k + j] + abc[2] * aa;
            }
        }
        for (int64_t i = 0; i < k; ++i) {
            for (int64_t j = 0; j < n; ++j) {
                double bx = 0;
                for (int64_t l = 0; l < k; ++l) bx += b[i * k + l] * x[l * n + j];
                next[i * n + j] = abc[0] * x[i * n + j] + bx;
            }
        }
        x = next;
    }
    Matrix out(m.size());
    for (int64_t i = 0; i < r; ++i)
        for (int64_t j = 0; j < c; ++j) out[i * c + j] = tall ? x[j * n + i] : x[i * n + j];
    return out;
}

}  // namespace

// An optimizer with Muon over a weight matrix and a bias: two steps against the update rule in double
// (decoupled weight decay, momentum (1 - b) G then b M + (1 - b) G, the spectral scale sqrt(max(rows, cols))
// and --muon-extra-scale-factor), the bias bitwise what AdamW alone makes of it; and a QKV weight's Q, K and V
// blocks orthogonalized apart (fused_rows).
TEST(Muon, StepsWeightMatricesByTheRuleAndTheRestWithAdamW) {
    Device &         device = cpu::device();
    const int64_t    r = 6, c = 10;
    model::Parameter w    = model::parameter_create("w", {r, c}, DType::f32, device);
    model::Parameter bias = model::parameter_create("b", {r}, DType::f32, device);
    model::Parameter ref  = model::parameter_create("ref", {r}, DType::f32, device);
    bias.no_weight_decay = ref.no_weight_decay = true;
    model::parameter_init_normal(w, 3, 0.5f);
    model::parameter_init_constant(bias, 0.25f);
    model::parameter_init_constant(ref, 0.25f);
    optim::OptimizerOptions options;
    options.adam.weight_decay = 0.1f;
    options.muon.emplace();
    options.muon->bf16_matmul        = false;
    options.muon->extra_scale_factor = 0.2f;
    optim::AdamW opt({&w, &bias}, options);
    optim::AdamW plain({&ref}, optim::OptimizerOptions{});
    ASSERT_NE(opt.muon(), nullptr);
    EXPECT_EQ(opt.muon()->num_matrices(), 1) << "the bias is AdamW's";

    const double lr = 0.01, wd = 0.1, beta = 0.9, scale = std::sqrt(10.0) * 0.2;
    Matrix       wd_ref(static_cast<size_t>(r * c)), mom(static_cast<size_t>(r * c), 0);
    for (int64_t i = 0; i < r * c; ++i) wd_ref[i] = w.data.data<float>()[i];
    for (int step = 1; step <= 2; ++step) {
        for (int64_t i = 0; i < r * c; ++i) {
            const float g              = static_cast<float>(std::sin(0.7 * i + step));
            w.main_grad.data<float>()[i] = g;
            mom[i]                     = beta * mom[i] + (1 - beta) * g;
        }
        for (int64_t i = 0; i < r; ++i) bias.main_grad.data<float>()[i] = ref.main_grad.data<float>()[i] = 0.1f * i - 0.2f;
        EXPECT_TRUE(opt.step(static_cast<float>(lr)).stepped);
        plain.step(static_cast<float>(lr));
        const Matrix o = ns_reference(mom, r, c);
        for (int64_t i = 0; i < r * c; ++i) wd_ref[i] = wd_ref[i] * (1 - lr * wd) - lr * scale * o[i];
    }
    device.compute_stream().synchronize();
    double worst = 0;
    for (int64_t i = 0; i < r * c; ++i) worst = std::max(worst, std::fabs(w.data.data<float>()[i] - wd_ref[i]));
    EXPECT_LT(worst, 1e-6);
    for (int64_t i = 0; i < r; ++i) EXPECT_EQ(bias.data.data<float>()[i], ref.data.data<float>()[i]) << i;

    // A fused [Q | K | V] weight (4 + 2 + 2 rows): each block is NS'd and scaled by its own shape.
    model::Parameter qkv = model::parameter_create("qkv", {8, c}, DType::f32, device);
    model::parameter_init_normal(qkv, 5, 0.5f);
    qkv.fused_rows = {4, 2, 2};
    Matrix before(static_cast<size_t>(8 * c)), grad(before.size());
    for (int64_t i = 0; i < 8 * c; ++i) {
        before[i] = qkv.data.data<float>()[i];
        qkv.main_grad.data<float>()[i] = static_cast<float>(grad[i] = std::cos(1.3 * i));
    }
    optim::OptimizerOptions no_decay = options;
    no_decay.adam.weight_decay       = 0.0f;
    optim::AdamW fused({&qkv}, no_decay);
    fused.step(static_cast<float>(lr));
    device.compute_stream().synchronize();
    double  worst_fused = 0;
    int64_t row         = 0;
    for (int64_t block : {4, 2, 2}) {
        Matrix m(grad.begin() + row * c, grad.begin() + (row + block) * c);
        for (double & v : m) v *= 1 - beta;
        const Matrix o = ns_reference(m, block, c);
        for (int64_t i = 0; i < block * c; ++i) {
            const double want = before[row * c + i] - lr * std::sqrt(10.0) * 0.2 * o[i];
            worst_fused       = std::max(worst_fused, std::fabs(qkv.data.data<float>()[row * c + i] - want));
        }
        row += block;
    }
    EXPECT_LT(worst_fused, 1e-6);
}

// µP's optimizer groups (Megatron's get_mup_config_overrides for Adam): with width multiplier 4 a hidden
// matrix steps with the hidden lr and eps / 4; an embedding-class matrix and a bias with the base lr and eps.
// Each against the scalar AdamW update with those arguments.
TEST(Mup, HiddenMatricesStepWithTheirOwnLrAndEps) {
    Device &         device = cpu::device();
    model::Parameter w      = model::parameter_create("w", {3, 4}, DType::f32, device);
    model::Parameter e      = model::parameter_create("e", {3, 4}, DType::f32, device);
    model::Parameter b      = model::parameter_create("b", {4}, DType::f32, device);
    e.embedding_class = true;
    b.no_weight_decay = true;
    for (model::Parameter * p : {&w, &e, &b}) {
        for (int64_t i = 0; i < p->numel(); ++i) {
            p->data.data<float>()[i]      = 0.1f * static_cast<float>(i) - 0.3f;
            p->main_grad.data<float>()[i] = 1e-7f * static_cast<float>(i + 1);   // small: eps matters
        }
    }
    optim::OptimizerOptions options;
    options.mup_width_mult = 4.0;
    optim::AdamW opt({&w, &e, &b}, options);
    const float lr = 1e-2f, hidden_lr = 2.5e-3f;
    opt.step(lr, std::nullopt, 1.0f, hidden_lr);
    device.compute_stream().synchronize();
    const optim::AdamWConfig c;
    for (const auto & entry : {std::pair{&w, true}, std::pair{&e, false}, std::pair{&b, false}}) {
        model::Parameter * p = entry.first;
        std::vector<float> ref(static_cast<size_t>(p->numel())), g(ref.size()), m(ref.size(), 0), v(ref.size(), 0);
        for (size_t i = 0; i < ref.size(); ++i) {
            ref[i] = 0.1f * static_cast<float>(i) - 0.3f;
            g[i]   = 1e-7f * static_cast<float>(i + 1);
        }
        optim::adamw_update(ref.data(), g.data(), m.data(), v.data(), p->numel(), entry.second ? hidden_lr : lr, c.beta1,
                            c.beta2, entry.second ? c.eps * 0.25f : c.eps, p->no_weight_decay ? 0.0f : c.weight_decay, 1);
        for (size_t i = 0; i < ref.size(); ++i) EXPECT_NEAR(p->data.data<float>()[i], ref[i], 1e-7f) << p->name << " " << i;
    }
    // The hidden step differs from the base one: the test sees the groups.
    EXPECT_GT(std::fabs(w.data.data<float>()[5] - e.data.data<float>()[5]), 1e-4f);
}
