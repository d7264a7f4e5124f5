// --bf16 mixed precision against the f32 model: the same seed gives the same weights rounded once, the
// loss and every gradient agree within bf16's precision, training follows the f32 curve, the optimizer's
// f32 master weights are what the bf16 parameters are rounded from, and the memory per parameter is
// Megatron's 2 (bf16 weight) + 4 (f32 main_grad) + 12 (master, m, v) bytes; the activations are bf16 and
// their peak about half the f32 run's.
//
// Tolerances: bf16 keeps 8 significant bits (relative rounding error 2^-9 = 0.2%). Every GEMM operand is
// rounded once, so a forward through a few layers moves the loss by well under 1%, and gradients keep
// their direction (cosine > 0.99 per parameter) while individual elements may move by a few percent.
#include "backend/cpu/cpu_device.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include <gtest/gtest.h>

#include <cstdio>
#include <cmath>

using namespace loom;

namespace {

model::GptConfig tiny(const std::string & preset, DType dtype) {
    model::GptConfig c = model::gpt_preset(preset);
    c.num_layers       = 2;
    c.seq_length       = 64;
    c.max_position_embeddings = 64;
    c.params_dtype     = dtype;
    return c;
}

model::MicroBatch batch_of(const model::GptConfig & c, int64_t b, uint64_t seed) {
    Device &          device = cpu::device();
    model::MicroBatch mb;
    mb.tokens    = Tensor::empty({b, c.seq_length}, DType::i32, device);
    mb.labels    = Tensor::empty({b, c.seq_length}, DType::i32, device);
    mb.loss_mask = Tensor::empty({b, c.seq_length}, DType::f32, device);
    uint64_t state = seed;
    for (int64_t i = 0; i < b * c.seq_length; ++i) {
        state = state * 6364136223846793005ull + 1442695040888963407ull;
        mb.tokens.data<int32_t>()[i] = static_cast<int32_t>((state >> 33) % c.vocab_size);
        mb.labels.data<int32_t>()[i] = static_cast<int32_t>((state >> 13) % c.vocab_size);
        mb.loss_mask.data<float>()[i] = i % 7 == 3 ? 0.0f : 1.0f;
    }
    return mb;
}

double cosine(const std::vector<float> & a, const std::vector<float> & b) {
    double ab = 0, aa = 0, bb = 0;
    for (size_t i = 0; i < a.size(); ++i) {
        ab += static_cast<double>(a[i]) * b[i];
        aa += static_cast<double>(a[i]) * a[i];
        bb += static_cast<double>(b[i]) * b[i];
    }
    return aa == 0 && bb == 0 ? 1.0 : ab / std::sqrt(aa * bb);
}

// Forward and backward of one batch in f32 and in bf16 from the same seed; compares losses and gradients.
void expect_bf16_agrees(const std::string & preset) {
    SCOPED_TRACE(preset);
    Device &        device = cpu::device();
    model::GptModel f32(tiny(preset, DType::f32), device), b16(tiny(preset, DType::bf16), device);
    f32.init();
    b16.init();
    auto pf = f32.parameters(), pb = b16.parameters();
    ASSERT_EQ(pf.size(), pb.size());
    for (size_t k = 0; k < pf.size(); ++k) {
        ASSERT_EQ(pb[k]->data.dtype(), DType::bf16) << pb[k]->name;
        ASSERT_EQ(pb[k]->main_grad.dtype(), DType::f32) << pb[k]->name;
        // Same draws, rounded once to nearest: bitwise the rounding of the f32 weights.
        const float *    w  = pf[k]->data.data<float>();
        const uint16_t * wb = static_cast<const uint16_t *>(pb[k]->data.data_ptr());
        for (int64_t i = 0; i < pf[k]->numel(); ++i) {
            ASSERT_EQ(wb[i], f32_to_bf16_bits(w[i])) << pb[k]->name << "[" << i << "]";
        }
    }

    model::MicroBatch mb = batch_of(f32.config(), 3, 11);
    model::GptModel::Context cf, cb;
    auto lf = f32.forward(cf, mb), lb = b16.forward(cb, mb);
    EXPECT_NEAR(lb.mean(), lf.mean(), 5e-3 * lf.mean()) << "loss within 0.5%";
    EXPECT_NE(lb.mean(), lf.mean()) << "the bf16 run really computes in bf16";
    f32.backward(cf, 1.0 / lf.count, nullptr);
    b16.backward(cb, 1.0 / lb.count, nullptr);
    cpu::device().compute_stream().synchronize();   // backward is stream work: wait before reading main_grad
    double worst = 1.0;
    for (size_t k = 0; k < pf.size(); ++k) {
        double c = cosine(values_f32(pf[k]->main_grad), values_f32(pb[k]->main_grad));
        EXPECT_GT(c, 0.99) << pb[k]->name;
        worst = std::min(worst, c);
    }
    testing::Test::RecordProperty("worst_gradient_cosine", std::to_string(worst));
    EXPECT_NEAR(optim::grad_norm(optim::grad_views(pb)), optim::grad_norm(optim::grad_views(pf)), 0.02 * optim::grad_norm(optim::grad_views(pf))) << "global norm within 2%";
}

}  // namespace

TEST(Bf16, Gpt2LossAndGradientsAgreeWithF32) { expect_bf16_agrees("gpt-tiny"); }

TEST(Bf16, LlamaLossAndGradientsAgreeWithF32) { expect_bf16_agrees("llama-tiny"); }

TEST(Bf16, TrainingFollowsTheF32CurveAndKeepsF32Masters) {
    train::TrainOptions o;
    o.micro_batch_size  = 4;
    o.global_batch_size = 8;
    o.train_iters       = 20;
    o.lr_warmup_iters   = 5;
    o.lr_decay_iters    = 20;
    o.log_interval      = 100;
    std::vector<double> curves[2];
    for (int run = 0; run < 2; ++run) {
        o.model    = tiny("gpt-tiny", run == 0 ? DType::f32 : DType::bf16);
        auto source = train::make_batch_source(o, cpu::device(), false);
        model::GptModel gpt(o.model, cpu::device());
        gpt.init();
        train::Trainer  trainer(o, gpt, *source);
        curves[run] = trainer.run(nullptr).losses;
    }
    ASSERT_EQ(curves[0].size(), 20u);
    for (size_t i = 0; i < 20; ++i) {
        // 1% of the loss per iteration: bf16 rounding of the updates accumulates slowly over 20 steps.
        EXPECT_NEAR(curves[1][i], curves[0][i], 0.01 * curves[0][i]) << "iteration " << i + 1;
    }
    EXPECT_LT(curves[1].back(), curves[1].front() - 0.5) << "bf16 training learns";
}

TEST(Bf16, ActivationsAreBf16AndPeakAtAboutHalfTheF32Runs) {
    // Megatron keeps the hidden states, the attention and MLP tensors and the logits in the model's dtype;
    // so does Loom with --bf16 (softmax and norm statistics, losses and main_grad stay f32). The activations
    // pool of the same step then peaks at about half the f32 run's (the bound is the 0.55 the GPU-speed
    // issue asks of GPT-2 124M; bench/bf16_activations.sh measures that model). Run with streams inline
    // (the ctest entry test_bf16_sync_streams, tests/CMakeLists.txt says why).
    Device &    device = cpu::device();
    Allocator & alloc  = device.allocator(MemoryKind::device);
    int64_t     peaks[2];
    for (int run = 0; run < 2; ++run) {
        train::TrainOptions o;
        o.micro_batch_size  = 4;
        o.global_batch_size = 4;
        o.train_iters       = 1;
        o.log_interval      = 100;
        o.model             = tiny("gpt-tiny", run == 0 ? DType::f32 : DType::bf16);
        auto            source = train::make_batch_source(o, device, false);
        model::GptModel gpt(o.model, device);
        gpt.init();
        train::Trainer trainer(o, gpt, *source);
        device.compute_stream().synchronize();
        alloc.reset_peak();
        trainer.run(nullptr);
        device.compute_stream().synchronize();
        peaks[run] = alloc.pool_stats("activations").peak_allocated;
    }
    ASSERT_GT(peaks[0], 0);
    const double ratio = static_cast<double>(peaks[1]) / static_cast<double>(peaks[0]);
    std::printf("[bf16 activations] peak %lld bytes against f32's %lld: %.3f\n", static_cast<long long>(peaks[1]),
                static_cast<long long>(peaks[0]), ratio);
    EXPECT_LE(ratio, 0.55) << peaks[1] << " bytes against " << peaks[0];
    EXPECT_GE(ratio, 0.35) << "about half: the same tensors at half the bytes (the allocator's size classes round each)";
}

TEST(Bf16, ParametersAreTheRoundedMasterWeightsAfterEachStep) {
    Device &         device = cpu::device();
    model::Parameter p = model::parameter_create("w", {1000}, DType::bf16, device);
    model::parameter_init_normal(p, 5, 0.02f);
    float * g = p.main_grad.data<float>();
    for (int i = 0; i < 1000; ++i) g[i] = std::sin(0.1f * i) * 1e-3f;
    std::vector<float> start = values_f32(p.data);
    optim::AdamW       adam({&p}, optim::AdamWConfig{});
    // A learning rate of 1e-5 moves each weight (|w| ~ 0.02) by ~1e-5 per step: below half a bf16 ulp
    // (~6e-5 at 0.02), so a bf16-only update would leave most weights unchanged forever. With an f32
    // master the moves accumulate and show after enough steps.
    for (int step = 0; step < 30; ++step) adam.step(1e-5f);
    device.compute_stream().synchronize();   // the updates are compute-stream work
    std::vector<float> end = values_f32(p.data);
    int moved = 0;
    for (int i = 0; i < 1000; ++i) moved += end[i] != start[i];
    EXPECT_GT(moved, 500) << "small updates accumulate in the f32 master";
    // The same update on an f32 parameter from the same start: the bf16 weights are its rounding.
    model::Parameter q = model::parameter_create("w", {1000}, DType::f32, device);
    std::copy(start.begin(), start.end(), q.data.data<float>());
    std::copy(g, g + 1000, q.main_grad.data<float>());
    optim::AdamW ref({&q}, optim::AdamWConfig{});
    for (int step = 0; step < 30; ++step) ref.step(1e-5f);
    device.compute_stream().synchronize();
    const uint16_t * bits = static_cast<const uint16_t *>(p.data.data_ptr());
    for (int i = 0; i < 1000; ++i) {
        ASSERT_EQ(bits[i], f32_to_bf16_bits(q.data.data<float>()[i])) << i;
    }
}

TEST(Bf16, BytesPerParameterAreTwoPlusFourPlusTwelve) {
    Device &    device = cpu::device();
    Allocator & alloc  = device.allocator(MemoryKind::device);
    auto        bytes  = [&](const char * pool) {
        device.compute_stream().synchronize();   // memory is freed in stream order
        return alloc.pool_stats(pool).allocated;
    };
    for (DType dtype : {DType::f32, DType::bf16}) {
        SCOPED_TRACE(dtype_name(dtype));
        int64_t w0 = bytes("weights"), g0 = bytes("grads"), o0 = bytes("optimizer");
        {
            model::GptModel gpt(tiny("gpt-tiny", dtype), device);
            gpt.init();
            int64_t n = gpt.config().num_parameters();
            optim::AdamW adam(gpt.parameters(), optim::AdamWConfig{});
            adam.step(1e-3f);
            device.compute_stream().synchronize();
            EXPECT_EQ(bytes("weights") - w0, static_cast<int64_t>(dtype_size(dtype)) * n);
            EXPECT_EQ(bytes("grads") - g0, 4 * n);
            // m and v, plus the f32 master of a bf16 parameter.
            EXPECT_EQ(bytes("optimizer") - o0, (dtype == DType::bf16 ? 12 : 8) * n);
        }
        EXPECT_EQ(bytes("weights"), w0) << "everything is returned";
    }
}
