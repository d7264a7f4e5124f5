// Gradient checks for every layer kernel and the whole GPT, against central finite differences.
//
// Forward and backward run in f32. A scalar objective L = sum_i w_i y_i (fixed random w) turns each
// kernel into a function whose gradient the backward must produce; L is accumulated in double and
// perturbations use eps = 1e-2 on O(1) inputs, so the f32 round-off of L (~1e-7 |L|) divided by eps
// stays far below the tolerance: |analytic - numeric| <= 2e-3 * (1 + |numeric|) per checked element.
// The attention kernel's forward is also compared with a direct O(s^2) evaluation in double.
#include "backend/cpu/attention.h"
#include "backend/cpu/cpu_device.h"
#include "backend/cpu/ops.h"
#include "backend/cpu/vec_math.h"
#include "core/device.h"
#include "model/dsa_indexer.h"
#include "model/gated_delta_net.h"
#include "model/gpt_model.h"

#include "random_values.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <cstring>
#include <functional>
#include <random>

using namespace loom;

namespace {

using loom::testing::random_vector;

double dot(const std::vector<float> & a, const float * b) {
    double s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * b[i];
    return s;
}

// Compares analytic[i] with the central difference of `loss` in x[i] for `samples` indices.
void check_gradient(const std::string & what, float * x, int64_t n, const float * analytic,
                    const std::function<double()> & loss, int samples = 24, float eps = 1e-2f, double tol = 2e-3) {
    std::mt19937_64 rng(n * 7919 + what.size());
    int             bad = 0;
    for (int k = 0; k < samples; ++k) {
        int64_t i    = samples >= n ? k % n : static_cast<int64_t>(rng() % n);
        float   orig = x[i];
        x[i]         = orig + eps;
        double lp    = loss();
        x[i]         = orig - eps;
        double lm    = loss();
        x[i]         = orig;
        double numeric = (lp - lm) / (2.0 * eps);
        double diff    = std::fabs(analytic[i] - numeric);
        if (diff > tol * (1.0 + std::fabs(numeric)) && ++bad <= 3) {
            ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
        }
    }
    EXPECT_EQ(bad, 0) << what;
}

// Probes per parameter tensor in the whole-model checks: six, or two under the sanitizers (`make
// test-sanitize`), where a forward is about twenty times slower and the run is there for memory errors,
// which every code path run once finds; the uninstrumented suite checks the six.
#if defined(__has_feature)
#if __has_feature(address_sanitizer) || __has_feature(undefined_behavior_sanitizer)
#define LOOM_TEST_SANITIZED 1
#endif
#endif
#if defined(__SANITIZE_ADDRESS__)
#define LOOM_TEST_SANITIZED 1
#endif
#if defined(LOOM_TEST_SANITIZED)
constexpr int kModelProbes = 2;
#else
constexpr int kModelProbes = 6;
#endif

}  // namespace

TEST(Kernels, LayerNormAndRmsNormGradients) {
    const int64_t n = 6, h = 40;
    auto x = random_vector(n * h, 1), gamma = random_vector(h, 2), beta = random_vector(h, 3), w = random_vector(n * h, 4);
    std::vector<float> y(n * h), mean(n), rstd(n), dx(n * h), dgamma(h, 0), dbeta(h, 0);
    auto ln = [&] {
        cpu::layernorm_forward(x.data(), gamma.data(), beta.data(), y.data(), mean.data(), rstd.data(), n, h, 1e-5f);
        return dot(w, y.data());
    };
    ln();
    cpu::layernorm_backward(w.data(), x.data(), gamma.data(), mean.data(), rstd.data(), dx.data(), dgamma.data(), dbeta.data(), n, h);
    check_gradient("layernorm dx", x.data(), n * h, dx.data(), ln);
    check_gradient("layernorm dgamma", gamma.data(), h, dgamma.data(), ln);
    check_gradient("layernorm dbeta", beta.data(), h, dbeta.data(), ln);

    std::fill(dgamma.begin(), dgamma.end(), 0.0f);
    auto rms = [&] {
        cpu::rmsnorm_forward(x.data(), gamma.data(), y.data(), rstd.data(), n, h, 1e-5f);
        return dot(w, y.data());
    };
    rms();
    cpu::rmsnorm_backward(w.data(), x.data(), gamma.data(), rstd.data(), dx.data(), dgamma.data(), n, h);
    check_gradient("rmsnorm dx", x.data(), n * h, dx.data(), rms);
    check_gradient("rmsnorm dgamma", gamma.data(), h, dgamma.data(), rms);
}

TEST(Kernels, ActivationGradients) {
    const int64_t n = 5, f = 24;
    auto x = random_vector(n * 2 * f, 5, 3.0f), w = random_vector(n * 2 * f, 6);
    std::vector<float> y(n * 2 * f), dx(n * 2 * f);
    auto gelu = [&] {
        cpu::gelu_forward(x.data(), y.data(), n * 2 * f);
        return dot(w, y.data());
    };
    cpu::gelu_backward(x.data(), w.data(), dx.data(), n * 2 * f);
    check_gradient("gelu", x.data(), n * 2 * f, dx.data(), gelu);
    // GELU(1) with the tanh approximation.
    float one = 1.0f, g;
    cpu::gelu_forward(&one, &g, 1);
    EXPECT_NEAR(g, 0.841192f, 1e-5f);

    std::vector<float> wf(w.begin(), w.begin() + n * f);
    auto swiglu = [&] {
        cpu::swiglu_forward(x.data(), y.data(), n, f);
        return dot(wf, y.data());
    };
    cpu::swiglu_backward(x.data(), wf.data(), dx.data(), n, f);
    check_gradient("swiglu", x.data(), n * 2 * f, dx.data(), swiglu);

    auto squared_relu = [&] {
        cpu::squared_relu_forward(x.data(), y.data(), n * 2 * f);
        return dot(w, y.data());
    };
    cpu::squared_relu_backward(x.data(), w.data(), dx.data(), n * 2 * f);
    check_gradient("squared_relu", x.data(), n * 2 * f, dx.data(), squared_relu);
    const float in[3] = {-2.0f, 0.0f, 1.5f};
    float       out[3];
    cpu::squared_relu_forward(in, out, 3);
    EXPECT_EQ(out[0], 0.0f);
    EXPECT_EQ(out[1], 0.0f);
    EXPECT_EQ(out[2], 2.25f);
}

TEST(Kernels, RopeIsARotationAndItsInverseUndoesIt) {
    const int64_t s = 7, b = 2, heads = 3, d = 8;
    auto x = random_vector(s * b * heads * d, 7);
    auto y = x;
    cpu::rope_apply(y.data(), heads * d, s, b, heads, d, 10000.0f, false);
    // Position 0 is unchanged; norms of each head are preserved everywhere.
    for (int64_t i = 0; i < b * heads * d; ++i) EXPECT_FLOAT_EQ(y[i], x[i]);
    for (int64_t row = 0; row < s * b * heads; ++row) {
        double nx = 0, ny = 0;
        for (int64_t j = 0; j < d; ++j) {
            nx += x[row * d + j] * x[row * d + j];
            ny += y[row * d + j] * y[row * d + j];
        }
        EXPECT_NEAR(nx, ny, 1e-4);
    }
    cpu::rope_apply(y.data(), heads * d, s, b, heads, d, 10000.0f, true);
    for (size_t i = 0; i < x.size(); ++i) EXPECT_NEAR(y[i], x[i], 1e-5f);
}

TEST(Kernels, CrossEntropyGradient) {
    const int64_t s = 3, b = 2, V = 11;
    auto logits = random_vector(s * b * V, 8, 2.0f);
    std::vector<int32_t> labels = {1, 5, 10, 0, 3, 7};
    std::vector<float>   loss(s * b), lse(s * b), dloss = {0.5f, 1.0f, 0.0f, 2.0f, 1.5f, 1.0f};
    auto total = [&] {
        cpu::cross_entropy_forward(logits.data(), labels.data(), loss.data(), lse.data(), s, b, V, V);
        return dot(dloss, loss.data());
    };
    total();
    // Row r = si * b + bi reads labels[bi * s + si].
    double direct = 0;
    for (int64_t v = 0; v < V; ++v) direct += std::exp(static_cast<double>(logits[v]));
    EXPECT_NEAR(loss[0], std::log(direct) - logits[labels[0]], 1e-5);
    auto grad = logits;
    cpu::cross_entropy_backward(grad.data(), labels.data(), lse.data(), dloss.data(), s, b, V, V);
    check_gradient("cross_entropy", logits.data(), s * b * V, grad.data(), total, 40);
}

namespace {

// Direct causal attention in double for one (sequence, head): the reference for the tiled kernel.
void naive_attention(const std::vector<float> & qkv, const cpu::AttentionShape & a, float scale, std::vector<double> & out) {
    int64_t group = a.nq / a.nkv;
    out.assign(a.s * a.b * a.nq * a.d, 0.0);
    for (int64_t bi = 0; bi < a.b; ++bi) {
        for (int64_t hq = 0; hq < a.nq; ++hq) {
            int64_t hk = hq / group;
            for (int64_t i = 0; i < a.s; ++i) {
                const float *       q = &qkv[(i * a.b + bi) * a.row_stride + hq * a.d];
                std::vector<double> sc(i + 1);
                double              mx = -1e300;
                for (int64_t j = 0; j <= i; ++j) {
                    const float * k = &qkv[(j * a.b + bi) * a.row_stride + (a.nq + hk) * a.d];
                    double        v = 0;
                    for (int64_t dd = 0; dd < a.d; ++dd) v += static_cast<double>(q[dd]) * k[dd];
                    sc[j] = v * scale;
                    mx    = std::max(mx, sc[j]);
                }
                double sum = 0;
                for (auto & v : sc) sum += (v = std::exp(v - mx));
                for (int64_t j = 0; j <= i; ++j) {
                    const float * v = &qkv[(j * a.b + bi) * a.row_stride + (a.nq + a.nkv + hk) * a.d];
                    for (int64_t dd = 0; dd < a.d; ++dd) out[(i * a.b + bi) * a.nq * a.d + hq * a.d + dd] += sc[j] / sum * v[dd];
                }
            }
        }
    }
}

}  // namespace

TEST(Kernels, TiledAttentionMatchesDirectEvaluationAndItsGradient) {
    // s = 150 spans three 64-blocks with a ragged end; 4 query heads share 2 key/value heads.
    cpu::AttentionShape a{150, 2, 4, 2, 16, (4 + 2 * 2) * 16};
    float               scale = 0.25f;
    auto qkv = random_vector(a.s * a.b * a.row_stride, 9);
    std::vector<float>  out(a.s * a.b * a.nq * a.d), lse(a.b * a.nq * a.s);
    cpu::attention_forward(qkv.data(), qkv.data(), out.data(), lse.data(), a, scale);
    std::vector<double> ref;
    naive_attention(qkv, a, scale, ref);
    double worst = 0;
    for (size_t i = 0; i < out.size(); ++i) worst = std::max(worst, std::fabs(out[i] - ref[i]));
    EXPECT_LT(worst, 2e-6) << "tiled forward vs direct evaluation";

    auto w = random_vector(out.size(), 10);
    std::vector<float> dqkv(qkv.size());
    cpu::attention_backward(qkv.data(), qkv.data(), out.data(), w.data(), lse.data(), dqkv.data(), dqkv.data(), a, scale);
    auto objective = [&] {
        cpu::attention_forward(qkv.data(), qkv.data(), out.data(), lse.data(), a, scale);
        return dot(w, out.data());
    };
    // Check Q, K and V entries separately, including early and late positions.
    std::mt19937_64 rng(11);
    int bad = 0;
    for (int k = 0; k < 90; ++k) {
        int64_t row = static_cast<int64_t>(rng() % (a.s * a.b));
        int64_t col = (k % 3) * (k % 3 == 0 ? 0 : 1) ;
        col = k % 3 == 0 ? static_cast<int64_t>(rng() % (a.nq * a.d))
            : k % 3 == 1 ? a.nq * a.d + static_cast<int64_t>(rng() % (a.nkv * a.d))
                         : (a.nq + a.nkv) * a.d + static_cast<int64_t>(rng() % (a.nkv * a.d));
        int64_t i = row * a.row_stride + col;
        float   orig = qkv[i];
        qkv[i] = orig + 1e-2f;
        double lp = objective();
        qkv[i] = orig - 1e-2f;
        double lm = objective();
        qkv[i] = orig;
        double numeric = (lp - lm) / 2e-2;
        if (std::fabs(dqkv[i] - numeric) > 2e-3 * (1 + std::fabs(numeric)) && ++bad <= 3) {
            ADD_FAILURE() << "attention dqkv[row " << row << ", col " << col << "]: analytic " << dqkv[i] << " numeric " << numeric;
        }
    }
    EXPECT_EQ(bad, 0);
}

namespace {

model::MicroBatch make_batch(int64_t b, int64_t s, int64_t vocab, uint64_t seed, Device & device) {
    model::MicroBatch batch;
    batch.tokens    = Tensor::empty({b, s}, DType::i32, device);
    batch.labels    = Tensor::empty({b, s}, DType::i32, device);
    batch.loss_mask = Tensor::empty({b, s}, DType::f32, device);
    std::mt19937_64 rng(seed);
    for (int64_t i = 0; i < b * s; ++i) {
        batch.tokens.data<int32_t>()[i]  = static_cast<int32_t>(rng() % vocab);
        batch.labels.data<int32_t>()[i]  = static_cast<int32_t>(rng() % vocab);
        batch.loss_mask.data<float>()[i] = (i % 7 == 3) ? 0.0f : 1.0f;   // some masked positions
    }
    return batch;
}

// weight_scale: the matrices' init scaled up so every path carries signal at f32 precision (10; less where the
// layers turn too far from linear over the differences' step); `adjust` sets other starting values after it.
void check_model_gradients(model::GptConfig config, float weight_scale = 10.0f,
                           const std::function<void(model::GptModel &)> & adjust = {}) {
    Device &        device = cpu::device();
    model::GptModel gpt(config, device);
    gpt.init();
    for (model::Parameter * p : gpt.parameters()) {
        if (p->data.dim() == 2) {
            float * w = p->data.data<float>();
            for (int64_t i = 0; i < p->numel(); ++i) w[i] *= weight_scale;
        }
    }
    if (adjust) adjust(gpt);
    model::MicroBatch batch = make_batch(2, config.seq_length, config.vocab_size, 12, device);
    // What backward differentiates: the main loss's sum, and with MTP each depth's masked mean (of its own
    // tokens) weighted by the main tokens x scale / D (gpt_model.h).
    auto loss = [&] {
        model::GptModel::Context            ctx;
        const model::GptModel::LossSum      main  = gpt.forward(ctx, batch);
        const std::vector<double>           depth = gpt.take_mtp_losses();
        double                              total = main.sum;
        for (double l : depth) total += main.count * config.mtp_loss_scaling_factor / static_cast<double>(depth.size()) * l;
        return total;
    };
    gpt.zero_grad();
    model::GptModel::Context ctx;
    gpt.forward(ctx, batch);
    gpt.take_mtp_losses();
    std::vector<std::string> ready;
    gpt.backward(ctx, 1.0, [&](model::Parameter & p) { ready.push_back(p.name); });
    cpu::device().compute_stream().synchronize();   // backward is stream work: wait before reading main_grad
    auto params = gpt.parameters();
    EXPECT_EQ(ready.size(), params.size()) << "every parameter is reported ready exactly once";
    for (model::Parameter * p : params) {
        std::vector<float> grad(p->main_grad.data<float>(), p->main_grad.data<float>() + p->numel());
        check_gradient(p->name, p->data.data<float>(), p->numel(), grad.data(), loss, kModelProbes, 1e-2f, 5e-3);
    }
}

// The models the gradient checks run: GPT-2 style (LayerNorm, GELU, learned positions) and Llama style
// (RMSNorm, SwiGLU, RoPE, GQA), 2 layers of hidden 32 over 70 positions (two attention blocks of 64).
model::GptConfig gpt2_style_grad_config() {
    model::GptConfig c;
    c.num_layers = 2;
    c.hidden_size = 32;
    c.ffn_hidden_size = 64;
    c.num_attention_heads = 4;
    c.num_query_groups = 4;
    c.seq_length = 70;
    c.max_position_embeddings = 80;
    c.vocab_size = 50;
    return c;
}

model::GptConfig llama_style_grad_config() {
    model::GptConfig c = model::gpt_preset("llama-tiny");
    c.num_layers = 2;
    c.hidden_size = 32;
    c.ffn_hidden_size = 48;
    c.num_attention_heads = 4;
    c.num_query_groups = 2;
    c.seq_length = 70;
    c.vocab_size = 50;
    return c;
}

}  // namespace

TEST(GptModel, Gpt2StyleGradientsMatchFiniteDifferences) { check_model_gradients(gpt2_style_grad_config()); }

TEST(GptModel, LlamaStyleGradientsMatchFiniteDifferences) { check_model_gradients(llama_style_grad_config()); }

// Dropout's masks are a function of the key alone, so the loss is a deterministic function of the
// weights and its gradient (each mask applied again in backward) matches central differences.
TEST(GptModel, DropoutGradientsMatchFiniteDifferences) {
    model::GptConfig c = gpt2_style_grad_config();
    c.hidden_dropout    = 0.1f;
    c.attention_dropout = 0.2f;
    check_model_gradients(c);
}

namespace {

// Two layers over 96 positions: two attention blocks (64 + 32), every recomputed module twice.
model::GptConfig small_recompute_config() {
    model::GptConfig c;
    c.num_layers = 2;
    c.hidden_size = 64;
    c.ffn_hidden_size = 256;
    c.num_attention_heads = 4;
    c.num_query_groups = 4;
    c.seq_length = 96;
    c.max_position_embeddings = 96;
    c.vocab_size = 64;
    c.hidden_dropout    = 0.1f;
    c.attention_dropout = 0.1f;
    return c;
}

struct StepResult {
    double                          loss = 0;
    std::vector<std::vector<float>> grads;
    int64_t                         peak_activations = 0;   // bytes of the "activations" pool, forward + backward
    int64_t                         saved_activations = 0;  // bytes it holds between forward and backward
};

StepResult one_step(const model::GptConfig & c, bool training = true, int64_t * offloaded = nullptr) {
    Device &        device = cpu::device();
    model::GptModel gpt(c, device);
    gpt.init();
    model::MicroBatch batch = make_batch(4, c.seq_length, c.vocab_size, 21, device);
    batch.sample_ids        = Tensor::empty({4}, DType::i64, device);
    for (int64_t j = 0; j < 4; ++j) batch.sample_ids.data<int64_t>()[j] = 1000 + j;
    gpt.zero_grad();
    device.compute_stream().synchronize();
    device.allocator().reset_peak();
    const int64_t before = device.allocator().pool_stats("activations").allocated;
    StepResult    result;
    {
        model::GptModel::Context ctx;
        ctx.training = training;
        result.loss  = gpt.forward(ctx, batch).mean();   // forward() waits for the stream
        result.saved_activations = device.allocator().pool_stats("activations").allocated - before;
        if (offloaded) *offloaded = device.allocator(MemoryKind::pinned_host).pool_stats("offloaded activations").allocated;
        gpt.backward(ctx, 1.0, nullptr);
        device.compute_stream().synchronize();
    }
    result.peak_activations = device.allocator().pool_stats("activations").peak_allocated - before;
    for (auto * p : gpt.parameters()) result.grads.emplace_back(p->main_grad.data<float>(), p->main_grad.data<float>() + p->numel());
    return result;
}

}  // namespace

namespace {

// The same loss and every gradient bit for bit.
void expect_bitwise(const StepResult & got, const StepResult & want) {
    EXPECT_EQ(got.loss, want.loss);
    ASSERT_EQ(got.grads.size(), want.grads.size());
    for (size_t i = 0; i < want.grads.size(); ++i) {
        ASSERT_EQ(std::memcmp(got.grads[i].data(), want.grads[i].data(), want.grads[i].size() * sizeof(float)), 0)
            << "gradient " << i;
    }
}

}  // namespace

// Selective recompute of moe_act (--recompute-modules moe_act): the experts' activation output is not kept
// between forward and backward but recomputed from the saved pre-activation, so the gradients are bitwise
// the stored run's (f32 and bf16; SwiGLU and GELU experts; grouped and one GEMM per expert) and the bytes
// held after forward (the allocator's "activations" pool, read once forward has synchronized) fall by
// exactly those outputs: every routed row's f features, in the parameters' dtype, in each MoE layer.
TEST(GptModel, SelectiveRecomputeOfMoeActIsBitwiseAndHoldsLessAfterForward) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
        for (const bool swiglu : {false, true}) {
            for (const bool grouped : {false, true}) {
                model::GptConfig c  = small_recompute_config();
                c.params_dtype      = dtype;
                c.swiglu            = swiglu;
                c.moe.num_experts   = 4;
                c.moe.topk          = 2;
                c.moe.grouped_gemm  = grouped;
                c.moe.aux_loss_coeff = 1e-2f;
                SCOPED_TRACE(std::string(dtype_name(dtype)) + (swiglu ? " swiglu" : " gelu") + (grouped ? " grouped" : " per expert"));
                const StepResult stored = one_step(c);
                c.recompute_granularity = model::RecomputeGranularity::selective;
                c.recompute_moe_act     = true;
                const StepResult recomputed = one_step(c);
                expect_bitwise(recomputed, stored);
                // Every token goes to topk experts: 4 x seq x topk routed rows of f features per layer.
                const int64_t rows = 4 * c.seq_length * c.moe.topk, f = c.moe.expert_ffn(c);
                const int64_t bytes = c.num_layers * rows * f * static_cast<int64_t>(dtype_size(dtype));
                EXPECT_EQ(stored.saved_activations - recomputed.saved_activations, bytes)
                    << stored.saved_activations << " stored, " << recomputed.saved_activations << " recomputed";
            }
        }
    }
}

// Selective recompute of mlp and shared_experts (--recompute-modules mlp shared_experts): the dense MLP, and
// the MoE layers' shared experts, keep only their input between forward and backward and rerun their forward
// just before their backward. Gradients bitwise the stored run's; the bytes held after forward fall by each
// such MLP's pre-activation (f1 = f, or 2f with SwiGLU) and activation output (f) for every row, in the
// parameters' dtype (the input, in the dtype fc1 reads, is held either way).
TEST(GptModel, SelectiveRecomputeOfMlpAndSharedExpertsIsBitwiseAndHoldsLessAfterForward) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
        for (const bool swiglu : {false, true}) {
            for (const bool shared : {false, true}) {
                model::GptConfig c = small_recompute_config();
                c.params_dtype     = dtype;
                c.swiglu           = swiglu;
                int64_t f          = c.ffn_hidden_size;
                if (shared) {   // MoE layers with a shared expert of 96 features
                    c.moe.num_experts                     = 4;
                    c.moe.topk                            = 2;
                    c.moe.aux_loss_coeff                  = 1e-2f;
                    c.moe.shared_expert_intermediate_size = 96;
                    f                                     = 96;
                    c.add_bias_linear                     = false;   // shared experts take no biases
                }
                SCOPED_TRACE(std::string(dtype_name(dtype)) + (swiglu ? " swiglu" : " gelu") + (shared ? " shared experts" : " dense mlp"));
                const StepResult stored = one_step(c);
                c.recompute_granularity = model::RecomputeGranularity::selective;
                (shared ? c.recompute_shared_experts : c.recompute_mlp) = true;
                const StepResult recomputed = one_step(c);
                expect_bitwise(recomputed, stored);
                const int64_t rows = 4 * c.seq_length, f1 = swiglu ? 2 * f : f;
                const int64_t bytes = c.num_layers * rows * (f1 + f) * static_cast<int64_t>(dtype_size(dtype));
                EXPECT_EQ(stored.saved_activations - recomputed.saved_activations, bytes)
                    << stored.saved_activations << " stored, " << recomputed.saved_activations << " recomputed";
            }
        }
    }
}

// Selective recompute of layernorm (--recompute-modules layernorm): the outputs of each layer's input norm
// and pre-MLP norm, which the QKV projection and the MLP's fc1 keep for their weight gradients, are dropped
// after forward and recomputed in backward from the norms' saved inputs. Gradients bitwise the stored run's
// (LayerNorm and RMSNorm, f32 and bf16, with and without mlp recompute); the bytes held after forward fall by
// exactly two norm outputs per layer (every row's h values, in the parameters' dtype). A MoE layer drops
// only its input norm's (its pre-MLP norm's output feeds the router and the experts).
TEST(GptModel, SelectiveRecomputeOfLayernormIsBitwiseAndHoldsLessAfterForward) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
        for (const bool rms : {false, true}) {
            for (const int variant : {0, 1, 2}) {   // dense; dense with mlp recompute; MoE
                model::GptConfig c = small_recompute_config();
                c.params_dtype     = dtype;
                if (rms) c.normalization = model::Normalization::rmsnorm;
                if (variant == 2) {
                    c.moe.num_experts    = 4;
                    c.moe.topk           = 2;
                    c.moe.aux_loss_coeff = 1e-2f;
                }
                c.recompute_granularity = model::RecomputeGranularity::selective;
                c.recompute_mlp         = variant == 1;
                SCOPED_TRACE(std::string(dtype_name(dtype)) + (rms ? " rmsnorm" : " layernorm") +
                             (variant == 0 ? " dense" : variant == 1 ? " dense, mlp recomputed" : " moe"));
                const StepResult stored = one_step(c);
                c.recompute_layernorm   = true;
                const StepResult recomputed = one_step(c);
                expect_bitwise(recomputed, stored);
                const int64_t rows = 4 * c.seq_length, norms = variant == 2 ? 1 : 2;
                const int64_t bytes = c.num_layers * norms * rows * c.hidden_size * static_cast<int64_t>(dtype_size(dtype));
                EXPECT_EQ(stored.saved_activations - recomputed.saved_activations, bytes)
                    << stored.saved_activations << " stored, " << recomputed.saved_activations << " recomputed";
            }
        }
    }
}

// Evaluation drops nothing: its loss is the dropout-free model's, bitwise; training with dropout differs.
// Multi-latent attention under selective recompute (f32 and bf16; with and without the query latent):
//  - layernorm: the input norm's output, which the first projections (q or q_down, and kv_down) keep, is
//    dropped after forward and set again from the recomputed norm; the bytes held after forward fall by one
//    norm output per layer (the projections share it) and by the pre-MLP norm's;
//  - mla_up_proj: the packed [Q | K | V] rows are rebuilt in backward from the latents the up projections
//    keep, and every row's k_pe is kept instead: the bytes fall by the rows' (n x 3 a (dn + dr)) less k_pe's
//    (n x dr).
// Gradients bitwise the stored run's in every case.
TEST(GptModel, SelectiveRecomputeOfMlaIsBitwiseAndHoldsLessAfterForward) {
    for (const DType dtype : {DType::f32, DType::bf16}) {
        for (const bool q_latent : {true, false}) {
            model::GptConfig c       = small_recompute_config();
            c.params_dtype           = dtype;
            c.normalization          = model::Normalization::rmsnorm;
            c.position_embedding     = model::PositionEmbedding::rope;
            c.add_bias_linear        = false;
            c.multi_latent_attention = true;
            c.q_lora_rank            = q_latent ? 24 : 0;
            c.kv_lora_rank           = 16;
            c.qk_head_dim            = 12;
            c.qk_pos_emb_head_dim    = 8;
            c.v_head_dim             = 12;
            c.qk_layernorm           = q_latent;
            c.recompute_granularity  = model::RecomputeGranularity::selective;
            SCOPED_TRACE(std::string(dtype_name(dtype)) + (q_latent ? " query latent" : " queries from x"));
            const StepResult stored = one_step(c);
            const int64_t    rows = 4 * c.seq_length, size = static_cast<int64_t>(dtype_size(dtype));
            c.recompute_layernorm   = true;
            const StepResult norms = one_step(c);
            expect_bitwise(norms, stored);
            EXPECT_EQ(stored.saved_activations - norms.saved_activations, c.num_layers * 2 * rows * c.hidden_size * size)
                << "layernorm: " << stored.saved_activations << " stored, " << norms.saved_activations << " recomputed";
            c.recompute_layernorm   = false;
            c.recompute_mla_up_proj = true;
            const StepResult up = one_step(c);
            expect_bitwise(up, stored);
            const int64_t a = c.num_attention_heads, dqk = c.mla_qk_dim(), dr = c.qk_pos_emb_head_dim;
            EXPECT_EQ(stored.saved_activations - up.saved_activations, c.num_layers * rows * (3 * a * dqk - dr) * size)
                << "mla_up_proj: " << stored.saved_activations << " stored, " << up.saved_activations << " recomputed";
        }
    }
}

TEST(GptModel, DropoutOnlyWhenTraining) {
    model::GptConfig c = small_recompute_config(), plain = c;
    plain.hidden_dropout = plain.attention_dropout = 0.0f;
    const double without = one_step(plain).loss, evaluated = one_step(c, false).loss, trained = one_step(c).loss;
    EXPECT_EQ(evaluated, without);
    EXPECT_GT(std::fabs(trained - without), 1e-4) << "dropout 0.1 changes the loss";
}

// Full activation recompute (uniform groups of 1 and 2, block of 3) gives bitwise the gradients of the
// run that stores everything, dropout included, and holds fewer activation bytes at its peak: the peak
// is measured from the allocator's "activations" pool over one forward and backward.
//
// It holds both with the worker-thread stream, whose queue bounds how far the host runs ahead (and with
// it how many enqueued kernels' tensors are still allocated: cpu_stream.h), and with streams inline
// (LOOM_SYNC_STREAMS=1, the ctest entry test_model_grad_sync_streams), where a block is free once its last
// user drops it, as with a GPU's stream-ordered caching allocator.
TEST(GptModel, FullRecomputeIsBitwiseAndLowersTheActivationPeak) {
    model::GptConfig stored = small_recompute_config();
    stored.num_layers       = 4;
    const StepResult       base   = one_step(stored);
    struct Variant { model::RecomputeMethod method; int64_t layers; const char * name; };
    const Variant variants[] = {{model::RecomputeMethod::uniform, 1, "uniform 1"},
                                {model::RecomputeMethod::uniform, 2, "uniform 2"},
                                {model::RecomputeMethod::block, 3, "block 3"}};
    std::printf("activation peak: stored %.2f MiB\n", base.peak_activations / 1048576.0);
    for (const Variant & v : variants) {
        model::GptConfig c     = stored;
        c.recompute_granularity = model::RecomputeGranularity::full;
        c.recompute_method      = v.method;
        c.recompute_num_layers  = v.layers;
        const StepResult r     = one_step(c);
        EXPECT_EQ(r.loss, base.loss) << v.name;
        ASSERT_EQ(r.grads.size(), base.grads.size());
        for (size_t k = 0; k < r.grads.size(); ++k) {
            ASSERT_EQ(0, std::memcmp(r.grads[k].data(), base.grads[k].data(), r.grads[k].size() * sizeof(float)))
                << v.name << ": gradient " << k << " differs";
        }
        std::printf("activation peak: %s %.2f MiB (%.0f%% of stored)\n", v.name, r.peak_activations / 1048576.0,
                    100.0 * r.peak_activations / base.peak_activations);
        // Four layers stored hold about 4 layers' activations at the peak; recompute holds the checkpoints
        // plus at most one group's: at least 25% less in each variant.
        EXPECT_LT(r.peak_activations, base.peak_activations * 3 / 4) << v.name;
    }
}

// --fine-grained-activation-offloading: every module Megatron names offloaded (min size 0), in a dense
// Llama-style model, with MLA, and with grouped SwiGLU experts: the loss and every gradient bit for bit the
// run without, the bytes held in the activations pool after forward lower by exactly the bytes in pinned host
// memory, which is empty again once backward has brought them back.
TEST(GptModel, FineGrainedActivationOffloadingIsBitwiseAndHoldsLessAfterForward) {
    struct Variant { const char * name; bool mla, moe; };
    for (const Variant & v : {Variant{"dense", false, false}, Variant{"mla", true, false}, Variant{"moe", false, true}}) {
        SCOPED_TRACE(v.name);
        model::GptConfig c = small_recompute_config();
        c.normalization    = model::Normalization::rmsnorm;
        c.swiglu           = true;
        c.position_embedding = model::PositionEmbedding::rope;
        c.add_bias_linear  = false;
        if (v.mla) {
            c.multi_latent_attention = true;
            c.q_lora_rank            = 24;
            c.kv_lora_rank           = 16;
            c.qk_head_dim            = 16;
            c.qk_pos_emb_head_dim    = 8;
            c.v_head_dim             = 16;
        }
        if (v.moe) {
            c.moe.num_experts  = 4;
            c.moe.topk         = 2;
            c.moe.grouped_gemm = true;
        }
        const StepResult base = one_step(c);
        c.offload_modules = model::offload_attn_norm | model::offload_qkv_linear | model::offload_core_attn |
                            model::offload_attn_proj | model::offload_mlp_norm | model::offload_expert_fc1 |
                            model::offload_moe_act;
        c.min_offloaded_tensor_size = 0;
        int64_t          offloaded  = -1;
        const StepResult r          = one_step(c, true, &offloaded);
        expect_bitwise(r, base);
        EXPECT_GT(offloaded, 0);
        EXPECT_EQ(base.saved_activations - r.saved_activations, offloaded) << "held after forward: moved, not copied";
        EXPECT_EQ(cpu::device().allocator(MemoryKind::pinned_host).pool_stats("offloaded activations").allocated, 0);
        std::printf("[offload %s] after forward: %.1f KiB in the activations pool, %.1f KiB without; %.1f KiB on the host\n",
                    v.name, r.saved_activations / 1024.0, base.saved_activations / 1024.0, offloaded / 1024.0);
    }
}

// --qk-layernorm: the per-head norms of Q and K (LayerNorm for GPT-2 style, RMSNorm with GQA and RoPE
// for Llama style) and everything upstream of them.
TEST(GptModel, QkLayernormGradientsMatchFiniteDifferences) {
    model::GptConfig c = gpt2_style_grad_config();
    c.qk_layernorm = true;
    check_model_gradients(c);
    model::GptConfig l = llama_style_grad_config();
    l.qk_layernorm = true;
    check_model_gradients(l);
}

namespace {

// Multi-latent attention at small sizes: 4 heads of q_nope / k_nope 6, RoPE'd part 4, values 5, latents
// of rank 12 (queries) and 8 (keys and values).
model::GptConfig mla_grad_config(bool q_latent, bool latent_norms) {
    model::GptConfig c       = llama_style_grad_config();
    c.num_query_groups       = c.num_attention_heads;
    c.multi_latent_attention = true;
    c.q_lora_rank            = q_latent ? 12 : 0;
    c.kv_lora_rank           = 8;
    c.qk_head_dim            = 6;
    c.qk_pos_emb_head_dim    = 4;
    c.v_head_dim             = 5;
    c.qk_layernorm           = latent_norms;
    return c;
}

// YaRN over an original context of 4096 with dr = 4: pair 0 keeps RoPE's frequency, pair 1 blends it with
// it / 40.
model::GptConfig yarn_mla_config() {
    model::GptConfig c      = mla_grad_config(true, true);
    c.rotary_scaling_factor = 40.0f;
    c.mscale                = 1.0f;
    c.mscale_all_dim        = 0.8f;
    return c;
}

}  // namespace

// Multi-token prediction: each depth's norms, eh_proj and layer, the shared embedding's lookups of the tokens
// ahead and the shared output layer, and the chain from depth to depth into the final norm's output. Untied
// with two depths, then tied (the output layer is the embedding) with one and another loss weight.
TEST(GptModel, MultiTokenPredictionGradientsMatchFiniteDifferences) {
    model::GptConfig c = llama_style_grad_config();
    c.seq_length       = 20;
    c.mtp_num_layers   = 2;
    {
        SCOPED_TRACE("untied, 2 depths");
        check_model_gradients(c);
    }
    c.untie_embeddings_and_output_weights = false;
    c.mtp_num_layers                      = 1;
    c.mtp_loss_scaling_factor             = 0.7f;
    SCOPED_TRACE("tied, 1 depth");
    check_model_gradients(c);
}

// µP's multipliers in the gradient: the embedding's output times 1.7 (the MTP depth's embedding too), the
// logits times 0.6 (its own, and the depth's), attention scores by 1 / d^0.8; the finite differences see the
// same function.
TEST(GptModel, MupMultipliersGradientsMatchFiniteDifferences) {
    model::GptConfig c   = llama_style_grad_config();
    c.seq_length         = 20;
    c.mtp_num_layers     = 1;
    c.use_mup            = true;
    c.mup_base_hidden_size = c.hidden_size / 2;
    c.mup_embedding_mult = 1.7f;
    c.mup_output_mult    = 0.6f;
    c.softmax_scale      = static_cast<float>(1.0 / std::pow(static_cast<double>(c.head_dim()), 0.8));
    check_model_gradients(c);
}

// µP's init: with the width multiplier 4 every hidden weight is the multiplier-1 model's draw over 2 (the
// same seeded draws times std / sqrt(4)), the residual writers' too; the embeddings and the output layer
// are drawn unscaled.
TEST(GptModel, MupInitScalesHiddenWeightsByOneOverTheRootOfTheWidthMultiplier) {
    model::GptConfig plain = llama_style_grad_config();
    model::GptConfig mup   = plain;
    mup.use_mup            = true;
    mup.mup_base_hidden_size = plain.hidden_size / 4;
    model::GptModel a(plain, cpu::device()), b(mup, cpu::device());
    a.init();
    b.init();
    const std::vector<model::Parameter *> pa = a.parameters(), pb = b.parameters();
    ASSERT_EQ(pa.size(), pb.size());
    int hidden = 0;
    for (size_t k = 0; k < pa.size(); ++k) {
        const bool  scaled = !pa[k]->embedding_class && pa[k]->data.dim() >= 2;
        const float factor = scaled ? 0.5f : 1.0f;
        hidden += scaled ? 1 : 0;
        const float * x = pa[k]->data.data<float>();
        const float * y = pb[k]->data.data<float>();
        for (int64_t i = 0; i < pa[k]->numel(); ++i) ASSERT_EQ(y[i], x[i] * factor) << pa[k]->name << " " << i;
    }
    EXPECT_GT(hidden, 4);
}

// The planes worked by hand (b 1, s 5, D 2): depth k's token, label and mask are those k + 1 ahead, 0 past
// the end; and with every eh_proj zero each depth's layer sees zeros, so its output (RMSNorm of 0) is 0, its
// logits are 0 and its loss is ln(vocab) exactly, whatever the tokens.
TEST(GptModel, MultiTokenPredictionTargetsRollAndAZeroProjectionScoresLnVocab) {
    Device &          device = cpu::device();
    model::MicroBatch batch  = make_batch(1, 5, 50, 3, device);
    const int32_t     tokens[] = {11, 12, 13, 14, 15}, labels[] = {12, 13, 14, 15, 16};
    const float       mask[]   = {1, 1, 0, 1, 1};
    std::memcpy(batch.tokens.data<int32_t>(), tokens, sizeof(tokens));
    std::memcpy(batch.labels.data<int32_t>(), labels, sizeof(labels));
    std::memcpy(batch.loss_mask.data<float>(), mask, sizeof(mask));
    const model::MicroBatch planes = model::add_mtp_targets(batch, 2);
    const std::vector<int32_t> want_tokens = {12, 13, 14, 15, 0, 13, 14, 15, 0, 0};
    const std::vector<int32_t> want_labels = {13, 14, 15, 16, 0, 14, 15, 16, 0, 0};
    const std::vector<float>   want_mask   = {1, 0, 1, 1, 0, 0, 1, 1, 0, 0};
    EXPECT_EQ(std::vector<int32_t>(planes.mtp_tokens.data<int32_t>(), planes.mtp_tokens.data<int32_t>() + 10), want_tokens);
    EXPECT_EQ(std::vector<int32_t>(planes.mtp_labels.data<int32_t>(), planes.mtp_labels.data<int32_t>() + 10), want_labels);
    EXPECT_EQ(std::vector<float>(planes.mtp_mask.data<float>(), planes.mtp_mask.data<float>() + 10), want_mask);
    EXPECT_EQ(planes.mtp_sequence_tokens, (std::vector<double>{3.0, 2.0}));

    model::GptConfig c = llama_style_grad_config();
    c.mtp_num_layers   = 2;
    model::GptModel gpt(c, device);
    gpt.init();
    for (model::Parameter * p : gpt.parameters()) {
        if (p->name.find("eh_proj") != std::string::npos) std::memset(p->data.data<float>(), 0, p->numel() * sizeof(float));
    }
    model::GptModel::Context ctx;
    gpt.forward(ctx, make_batch(2, c.seq_length, c.vocab_size, 5, device));
    const std::vector<double> losses = gpt.take_mtp_losses();
    ASSERT_EQ(losses.size(), 2u);
    for (double l : losses) EXPECT_NEAR(l, std::log(static_cast<double>(c.vocab_size)), 1e-6);
    EXPECT_TRUE(gpt.take_mtp_losses() == std::vector<double>(2, 0.0)) << "taking them clears them";
}

// MLA's every projection, the latents' norms, the shared k_pe (its gradient summed over the heads), the
// padded values and the interleaved RoPE of the pe parts: central differences.
TEST(GptModel, MultiLatentAttentionGradientsMatchFiniteDifferences) {
    for (const bool q_latent : {true, false}) {
        SCOPED_TRACE(q_latent ? "query latent, latent norms" : "queries from x, no norms");
        check_model_gradients(mla_grad_config(q_latent, q_latent));
    }
    SCOPED_TRACE("YaRN, factor 40 (RoPE's backward the transpose of a scaled rotation)");
    check_model_gradients(yarn_mla_config());
}

// One MLA layer against Megatron's MLASelfAttention written out in double with its own layout: each head
// [nope | pe], the pe parts de-interleaved and turned by halves (rotate_half), keys' k_pe shared, values of
// dv (no padding), causal softmax at 1 / sqrt(dn + dr). Loom's layout (pe first, pairs turned in place,
// values padded) must give the same output: 1e-5 relative to the output's largest value.
namespace {

void expect_mla_matches_megatron(model::GptConfig c) {
    c.seq_length       = 9;
    const int64_t s = c.seq_length, b = 2, n = s * b, h = c.hidden_size, a = c.num_attention_heads;
    const int64_t dn = c.qk_head_dim, dr = c.qk_pos_emb_head_dim, dv = c.v_head_dim, dqk = dn + dr;
    const int64_t rq = c.q_lora_rank, rkv = c.kv_lora_rank;
    Device &             device = cpu::device();
    model::SelfAttention attn("attention", c, device);
    attn.init(7, 0.3f, 0.3f);
    std::vector<model::Parameter *> params;
    attn.parameters(params);
    for (model::Parameter * p : params) {   // norms away from 1, so that their weights count
        if (p->data.dim() == 1) {
            for (int64_t i = 0; i < p->numel(); ++i) p->data.data<float>()[i] = 1.0f + 0.1f * static_cast<float>(i % 5);
        }
    }
    const std::vector<float> xv = random_vector(n * h, 71);
    Tensor                   x  = Tensor::empty({n, h}, DType::f32, device);
    std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
    model::SelfAttention::Context ctx;
    Tensor y = attn.forward(ctx, x, s, b);
    device.compute_stream().synchronize();

    auto weight = [&](const model::Linear & l) { return l.weight.data.data<float>(); };
    // out[r][o] = sum_i in[r][i] w[o][i]
    auto linear = [](const std::vector<double> & in, int64_t rows, int64_t width, const float * w, int64_t out_width) {
        std::vector<double> out(static_cast<size_t>(rows * out_width), 0.0);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t o = 0; o < out_width; ++o) {
                double sum = 0;
                for (int64_t i = 0; i < width; ++i) sum += in[r * width + i] * w[o * width + i];
                out[r * out_width + o] = sum;
            }
        }
        return out;
    };
    auto rmsnorm = [&](std::vector<double> v, int64_t rows, int64_t width, const float * gamma) {
        for (int64_t r = 0; r < rows; ++r) {
            double ms = 0;
            for (int64_t i = 0; i < width; ++i) ms += v[r * width + i] * v[r * width + i];
            const double rstd = 1.0 / std::sqrt(ms / static_cast<double>(width) + c.norm_epsilon);
            for (int64_t i = 0; i < width; ++i) v[r * width + i] *= rstd * gamma[i];
        }
        return v;
    };
    // Megatron's MLA RoPE: YarnRotaryEmbedding's frequencies (or RotaryEmbedding's with --rope-type rope) and
    // concentration factor, its softmax scale mscale(f, mscale_all_dim)^2 / sqrt(dqk) with either.
    const double f = c.rotary_scaling_factor, base = c.rotary_base, pi = 3.14159265358979323846;
    auto mscale = [&](double m) { return f <= 1 ? 1.0 : 0.1 * m * std::log(f) + 1.0; };
    auto dim_of = [&](double rotations) { return dr * std::log(4096.0 / (rotations * 2 * pi)) / (2 * std::log(base)); };
    double low = std::max(std::floor(dim_of(32.0)), 0.0), high = std::min(std::ceil(dim_of(1.0)), double(dr - 1));
    if (low == high) high += 0.001;
    std::vector<double> inv_freq(static_cast<size_t>(dr / 2));
    for (int64_t k = 0; k < dr / 2; ++k) {
        const double extra = std::pow(base, -2.0 * k / dr), keep = 1.0 - std::clamp((k - low) / (high - low), 0.0, 1.0);
        inv_freq[k]        = c.mla_yarn ? extra / f * (1 - keep) + extra * keep : extra;
    }
    const double amplitude = c.mla_yarn ? mscale(c.mscale) / mscale(c.mscale_all_dim) : 1.0;
    // apply_rotary_pos_emb with mla_rotary_interleaved: [t0::2 | t1::2], then (t cos + rotate_half(t) sin) times
    // the amplitude, pair k's angle repeated over both halves.
    auto mla_rope = [&](const double * t, int64_t position, double * out) {
        std::vector<double> d(static_cast<size_t>(dr));
        for (int64_t i = 0; i < dr / 2; ++i) {
            d[i]          = t[2 * i];
            d[i + dr / 2] = t[2 * i + 1];
        }
        for (int64_t i = 0; i < dr; ++i) {
            const double angle = static_cast<double>(position) * inv_freq[i % (dr / 2)];
            const double rot   = i < dr / 2 ? -d[i + dr / 2] : d[i - dr / 2];
            out[i]             = amplitude * (d[i] * std::cos(angle) + rot * std::sin(angle));
        }
    };
    const std::vector<double> xd(xv.begin(), xv.end());
    const model::SelfAttention::Latent & m = *attn.mla;
    const std::vector<double> q = linear(rmsnorm(linear(xd, n, h, weight(*m.q_down), rq), n, rq, m.q_norm->weight.data.data<float>()),
                                         n, rq, weight(*m.q_up), a * dqk);
    const std::vector<double> ckv = linear(xd, n, h, weight(*m.kv_down), rkv + dr);
    std::vector<double>       latent(static_cast<size_t>(n * rkv));
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t i = 0; i < rkv; ++i) latent[r * rkv + i] = ckv[r * (rkv + dr) + i];
    }
    const std::vector<double> kv = linear(rmsnorm(latent, n, rkv, m.kv_norm->weight.data.data<float>()), n, rkv,
                                          weight(*m.kv_up), a * (dn + dv));
    // Rows are (position, sample) pairs: r = position * b + sample.
    std::vector<double> query(static_cast<size_t>(n * a * dqk)), key(static_cast<size_t>(n * a * dqk));
    for (int64_t r = 0; r < n; ++r) {
        std::vector<double> k_pe(static_cast<size_t>(dr));
        mla_rope(&ckv[r * (rkv + dr) + rkv], r / b, k_pe.data());
        for (int64_t hd = 0; hd < a; ++hd) {
            double * qo = &query[(r * a + hd) * dqk];
            double * ko = &key[(r * a + hd) * dqk];
            for (int64_t i = 0; i < dn; ++i) {
                qo[i] = q[r * a * dqk + hd * dqk + i];
                ko[i] = kv[r * a * (dn + dv) + hd * (dn + dv) + i];
            }
            mla_rope(&q[r * a * dqk + hd * dqk + dn], r / b, qo + dn);
            for (int64_t i = 0; i < dr; ++i) ko[dn + i] = k_pe[i];
        }
    }
    std::vector<double> out(static_cast<size_t>(n * a * dv), 0.0);
    const double        scale = mscale(c.mscale_all_dim) * mscale(c.mscale_all_dim) / std::sqrt(static_cast<double>(dqk));
    for (int64_t bi = 0; bi < b; ++bi) {
        for (int64_t hd = 0; hd < a; ++hd) {
            for (int64_t i = 0; i < s; ++i) {
                const int64_t       ri = i * b + bi;
                std::vector<double> score(static_cast<size_t>(i + 1));
                double              top = -1e300, sum = 0;
                for (int64_t j = 0; j <= i; ++j) {
                    double dotp = 0;
                    for (int64_t k = 0; k < dqk; ++k) dotp += query[(ri * a + hd) * dqk + k] * key[((j * b + bi) * a + hd) * dqk + k];
                    score[j] = dotp * scale;
                    top      = std::max(top, score[j]);
                }
                for (int64_t j = 0; j <= i; ++j) sum += (score[j] = std::exp(score[j] - top));
                for (int64_t j = 0; j <= i; ++j) {
                    for (int64_t k = 0; k < dv; ++k) {
                        out[(ri * a + hd) * dv + k] += score[j] / sum * kv[(j * b + bi) * a * (dn + dv) + hd * (dn + dv) + dn + k];
                    }
                }
            }
        }
    }
    const std::vector<double> expected = linear(out, n, a * dv, weight(attn.proj), h);
    double largest = 0, worst = 0;
    for (double v : expected) largest = std::max(largest, std::fabs(v));
    for (int64_t i = 0; i < n * h; ++i) worst = std::max(worst, std::fabs(y.data<float>()[i] - expected[i]));
    EXPECT_GT(largest, 0.1) << "the output carries signal";
    EXPECT_LT(worst, 1e-5 * largest) << "largest |y| " << largest;
}

}  // namespace

TEST(MultiLatentAttention, MatchesMegatronsFormulationWrittenOut) {
    {
        SCOPED_TRACE("YaRN at factor 1 (Megatron's defaults): RoPE");
        expect_mla_matches_megatron(mla_grad_config(true, true));
    }
    {
        SCOPED_TRACE("YaRN, factor 40: its frequencies, an amplitude of mscale(40, 1) / mscale(40, 0.8), a larger softmax scale");
        expect_mla_matches_megatron(yarn_mla_config());
    }
    {
        SCOPED_TRACE("--rope-type rope with factor 40: RoPE's frequencies, still the larger softmax scale");
        model::GptConfig c = yarn_mla_config();
        c.mla_yarn         = false;
        expect_mla_matches_megatron(c);
    }
}

// --rotary-percent 0.5 (RoPE turns the first half of each head) and --rotary-interleaved (pairs 2i, 2i+1):
// the backward's inverse rotation is the forward's, whichever elements it turns.
TEST(GptModel, PartialAndInterleavedRopeGradientsMatchFiniteDifferences) {
    for (const bool interleaved : {false, true}) {
        SCOPED_TRACE(interleaved ? "interleaved, half" : "halves, half");
        model::GptConfig l   = llama_style_grad_config();
        l.rotary_percent     = 0.5f;
        l.rotary_interleaved = interleaved;
        check_model_gradients(l);
    }
}

// --apply-layernorm-1p: every norm (final, per layer, and the per-head Q and K norms) scales by 1 + weight.
TEST(GptModel, ZeroCentredNormGradientsMatchFiniteDifferences) {
    model::GptConfig c = gpt2_style_grad_config();
    c.apply_layernorm_1p = true;
    check_model_gradients(c);
    model::GptConfig l = llama_style_grad_config();
    l.apply_layernorm_1p = true;
    l.qk_layernorm       = true;
    check_model_gradients(l);
}

// --squared-relu: every MLP's activation is max(x, 0)^2 (the GPT-2-style model, with its biases).
TEST(GptModel, SquaredReluGradientsMatchFiniteDifferences) {
    model::GptConfig c = gpt2_style_grad_config();
    c.squared_relu     = true;
    check_model_gradients(c);
}

// --quick-geglu with gpt-oss's --glu-linear-offset 1: the GPT-2-style model's MLPs gated, quick_gelu(gate)
// (linear + 1); a clamp of 1000 (no value reaches it: the clamp's edges are the op test's).
TEST(GptModel, QuickGegluGradientsMatchFiniteDifferences) {
    model::GptConfig c  = gpt2_style_grad_config();
    c.swiglu            = true;
    c.quick_geglu       = true;
    c.glu_linear_offset = 1.0f;
    c.activation_clamp  = 1000.0f;
    check_model_gradients(c);
}

// gpt-oss's attention: learnable sinks (each layer's softmax_offset, one logit per head) with a sliding window of
// 20 on the first layer (--window-attn-skip-freq 2), on the Llama-style model (GQA, RoPE); and off-by-one's
// fixed zero logit, which has no parameter.
TEST(GptModel, AttentionSinksGradientsMatchFiniteDifferences) {
    model::GptConfig c = llama_style_grad_config();
    c.softmax_type     = model::SoftmaxType::learnable;
    c.window_size      = 20;
    c.window_skip_freq = 2;
    check_model_gradients(c);
    c.softmax_type = model::SoftmaxType::off_by_one;
    check_model_gradients(c);
}

// Qwen3-Next's gated attention (--attention-output-gate): the QKV projection's gate columns and the output's
// sigmoid, on the Llama-style model (GQA, RoPE, Q and K norms) and on the GPT-2-style one (QKV with biases).
TEST(GptModel, AttentionOutputGateGradientsMatchFiniteDifferences) {
    model::GptConfig l      = llama_style_grad_config();
    l.attention_output_gate = true;
    l.qk_layernorm          = true;
    check_model_gradients(l);
    model::GptConfig c      = gpt2_style_grad_config();
    c.attention_output_gate = true;
    check_model_gradients(c);
}

// Qwen3-Next's gated delta-net (--experimental-attention-variant gated_delta_net) on the first of the two layers
// (--linear-attention-freq 2), the second softmax attention: every parameter of the input projection, the
// convolution, A_log, dt_bias, the gated norm and the output projection. On the Llama-style model with two value heads
// per key head and zero-centred norms over 70 positions (five of the delta rule's chunks, the last short), and on
// the GPT-2-style one (a LayerNorm, so the gated norm has a bias) with one value head per key head.
TEST(GptModel, GatedDeltaNetGradientsMatchFiniteDifferences) {
    auto gdn = [](model::GptConfig c, int64_t key_heads, int64_t value_heads) {
        c.gated_delta_net        = true;
        c.linear_attention_freq  = 2;
        c.linear_key_head_dim    = 8;
        c.linear_value_head_dim  = 6;
        c.linear_num_key_heads   = key_heads;
        c.linear_num_value_heads = value_heads;
        return c;
    };
    // The matrices' init times 3 (times 10 the delta rule's decays bend the loss too far over the step of 1e-2),
    // and decays of e^-0.03 to e^-0.3 per step (A = 0.05 .. 0.3, softplus(a + dt_bias) about 0.13 .. 1) so the state
    // carries over many steps and A_log's and dt_bias's gradients are far above f32's noise.
    auto slow_decay = [](model::GptModel & gpt) {
        for (model::Parameter * p : gpt.parameters()) {
            const bool a_log = p->name.ends_with(".A_log"), dt_bias = p->name.ends_with(".dt_bias");
            if (!a_log && !dt_bias) continue;
            std::vector<float> v(static_cast<size_t>(p->numel()));
            for (size_t i = 0; i < v.size(); ++i) {
                v[i] = a_log ? std::log(0.05f + 0.25f * static_cast<float>(i) / static_cast<float>(v.size())) : -2.0f + 0.5f * static_cast<float>(i);
            }
            std::copy(v.begin(), v.end(), p->data.data<float>());
        }
    };
    model::GptConfig l      = gdn(llama_style_grad_config(), 2, 4);
    l.apply_layernorm_1p    = true;
    l.attention_output_gate = true;
    check_model_gradients(l, 3.0f, slow_decay);
    check_model_gradients(gdn(gpt2_style_grad_config(), 2, 2), 3.0f, slow_decay);
}

// The gated delta-net layer against Megatron's GatedDeltaNet.forward written out in double: the input projection's
// columns [q | k | v | z | b | a], the causal depthwise convolution with SiLU over [q | k | v], the L2 norms of each q
// and k head (eps 1e-6 inside the root), each key head repeated over its value heads (repeat_interleave), beta =
// sigmoid(b), g = -e^A_log softplus(a + dt_bias), the delta rule's recurrence from a zero state (scale dk^-1/2), the
// zero-centred RMSNorm over each head's dv times silu(z), and the output projection. Two sequences of 21 steps,
// three key heads of 5 over six value heads of 4, four taps; within 1e-5 of the output's largest.
TEST(GatedDeltaNet, MatchesMegatronsFormulationWrittenOut) {
    model::GptConfig c       = llama_style_grad_config();
    c.gated_delta_net        = true;
    c.linear_attention_freq  = 1;
    c.linear_key_head_dim    = 5;
    c.linear_value_head_dim  = 4;
    c.linear_num_key_heads   = 3;
    c.linear_num_value_heads = 6;
    c.apply_layernorm_1p     = true;
    const int64_t s = 21, b = 2, n = s * b, h = c.hidden_size, nk = 3, nv = 6, dk = 5, dv = 4, K = 4, rep = nv / nk;
    const int64_t C = 2 * nk * dk + nv * dv, W = C + nv * dv + 2 * nv;
    Device &             device = cpu::device();
    model::GatedDeltaNet gdn("gdn", c, device);
    gdn.init(11, 0.3f, 0.3f);
    for (int64_t i = 0; i < nv; ++i) {   // decays that carry the state (A = 0.1 .. 0.35), norms away from 1
        gdn.a_log.data.data<float>()[i]   = std::log(0.1f + 0.05f * static_cast<float>(i));
        gdn.dt_bias.data.data<float>()[i] = -1.0f + 0.3f * static_cast<float>(i);
    }
    for (int64_t i = 0; i < dv; ++i) gdn.out_norm.weight.data.data<float>()[i] = 0.1f * static_cast<float>(i) - 0.15f;
    const std::vector<float> xv = random_vector(n * h, 73);
    Tensor                   x  = Tensor::empty({n, h}, DType::f32, device);
    std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
    model::GatedDeltaNet::Context ctx;
    const Tensor y = gdn.forward(ctx, x, s, b);
    device.compute_stream().synchronize();

    auto at = [](const std::vector<double> & v, int64_t r, int64_t width, int64_t col) { return v[static_cast<size_t>(r * width + col)]; };
    auto linear = [](const std::vector<double> & in, int64_t rows, int64_t width, const float * w, int64_t out_width) {
        std::vector<double> out(static_cast<size_t>(rows * out_width), 0.0);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t o = 0; o < out_width; ++o) {
                double sum = 0;
                for (int64_t i = 0; i < width; ++i) sum += in[static_cast<size_t>(r * width + i)] * w[o * width + i];
                out[static_cast<size_t>(r * out_width + o)] = sum;
            }
        }
        return out;
    };
    auto sigmoid = [](double v) { return 1 / (1 + std::exp(-v)); };
    const std::vector<double> P = linear(std::vector<double>(xv.begin(), xv.end()), n, h, gdn.in_proj.weight.data.data<float>(), W);
    const float *             taps = gdn.conv.data.data<float>();
    std::vector<double>       conv(static_cast<size_t>(n * C));   // rows (t, bi) as the activations'
    for (int64_t t = 0; t < s; ++t) {
        for (int64_t bi = 0; bi < b; ++bi) {
            for (int64_t ch = 0; ch < C; ++ch) {
                double pre = 0;
                for (int64_t j = 0; j < K; ++j) {
                    if (t - K + 1 + j >= 0) pre += taps[ch * K + j] * at(P, (t - K + 1 + j) * b + bi, W, ch);
                }
                conv[static_cast<size_t>((t * b + bi) * C + ch)] = pre * sigmoid(pre);
            }
        }
    }
    auto unit = [&](int64_t r, int64_t col) {   // an L2-normed head of dk at column col of conv's row r
        std::vector<double> v(static_cast<size_t>(dk));
        double              ss = 0;
        for (int64_t i = 0; i < dk; ++i) ss += at(conv, r, C, col + i) * at(conv, r, C, col + i);
        for (int64_t i = 0; i < dk; ++i) v[static_cast<size_t>(i)] = at(conv, r, C, col + i) / std::sqrt(ss + 1e-6);
        return v;
    };
    std::vector<double> out(static_cast<size_t>(n * nv * dv));
    for (int64_t bi = 0; bi < b; ++bi) {
        for (int64_t hv = 0; hv < nv; ++hv) {
            const int64_t       hk = hv / rep;
            std::vector<double> S(static_cast<size_t>(dk * dv), 0.0);
            for (int64_t t = 0; t < s; ++t) {
                const int64_t             r = t * b + bi;
                const std::vector<double> q = unit(r, hk * dk), k = unit(r, nk * dk + hk * dk);
                const double beta  = sigmoid(at(P, r, W, C + nv * dv + hv));
                const double a     = at(P, r, W, C + nv * dv + nv + hv) + gdn.dt_bias.data.data<float>()[hv];
                const double g     = -std::exp(gdn.a_log.data.data<float>()[hv]) * std::log1p(std::exp(a));
                for (double & e : S) e *= std::exp(g);
                for (int64_t j = 0; j < dv; ++j) {
                    double sk = 0;
                    for (int64_t i = 0; i < dk; ++i) sk += S[static_cast<size_t>(i * dv + j)] * k[static_cast<size_t>(i)];
                    const double u = beta * (at(conv, r, C, 2 * nk * dk + hv * dv + j) - sk);
                    for (int64_t i = 0; i < dk; ++i) S[static_cast<size_t>(i * dv + j)] += k[static_cast<size_t>(i)] * u;
                }
                for (int64_t j = 0; j < dv; ++j) {
                    double o = 0;
                    for (int64_t i = 0; i < dk; ++i) o += S[static_cast<size_t>(i * dv + j)] * q[static_cast<size_t>(i)] / std::sqrt(double(dk));
                    out[static_cast<size_t>(r * nv * dv + hv * dv + j)] = o;
                }
            }
        }
    }
    std::vector<double> gated(out.size());
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t hv = 0; hv < nv; ++hv) {
            double ms = 0;
            for (int64_t j = 0; j < dv; ++j) ms += at(out, r, nv * dv, hv * dv + j) * at(out, r, nv * dv, hv * dv + j);
            const double rstd = 1 / std::sqrt(ms / double(dv) + c.norm_epsilon);
            for (int64_t j = 0; j < dv; ++j) {
                const double z = at(P, r, W, C + hv * dv + j);
                gated[static_cast<size_t>(r * nv * dv + hv * dv + j)] =
                    at(out, r, nv * dv, hv * dv + j) * rstd * (1 + gdn.out_norm.weight.data.data<float>()[j]) * z * sigmoid(z);
            }
        }
    }
    const std::vector<double> expected = linear(gated, n, nv * dv, gdn.out_proj.weight.data.data<float>(), h);
    double largest = 0, worst = 0;
    for (double v : expected) largest = std::max(largest, std::fabs(v));
    for (int64_t i = 0; i < n * h; ++i) worst = std::max(worst, std::fabs(y.data<float>()[i] - expected[static_cast<size_t>(i)]));
    EXPECT_GT(largest, 0.1) << "the output carries signal";
    EXPECT_LT(worst, 1e-5 * largest) << "largest |y| " << largest;
}

// DeepSeek Sparse Attention: the indexer's weights against finite differences of its loss alone, every other weight
// against the language-model loss alone (the indexer's inputs and target are detached: its loss sends nothing into
// the main model), over two MLA layers with a query latent. Three indexer heads of 8 (wider than MLA's RoPE part of
// 4) with the top-k every key; the default (Hadamard rotation, ReLU scores, RoPE in halves), then neither rotation nor
// ReLU and interleaved RoPE; then that again with each row attending to its top half of the keys and the sparse loss,
// checking the weights no selection depends on (the selection is not differentiable: a step that reorders two
// scores moves the loss by a jump). The indexer's own gradient with the sparse loss is its ops' (OpsDsa). A loss
// coefficient of 50 so its gradients carry signal at f32.
namespace {

model::GptConfig dsa_grad_config(bool defaults, bool sparse = false) {
    model::GptConfig c              = mla_grad_config(true, true);
    c.add_bias_linear               = false;
    c.dsa                           = true;
    c.dsa_indexer_n_heads           = 3;
    c.dsa_indexer_head_dim          = 8;
    c.dsa_indexer_topk              = sparse ? c.seq_length / 2 : c.seq_length;
    c.dsa_indexer_use_sparse_loss   = sparse;
    c.dsa_indexer_loss_coeff        = 50.0f;
    c.dsa_indexer_rotate_activation = defaults;
    c.dsa_indexer_scoring_relu      = defaults;
    c.dsa_indexer_rope_interleaved  = !defaults;
    return c;
}

}  // namespace

TEST(GptModel, DsaIndexerGradientsMatchFiniteDifferencesOfItsLossAlone) {
    for (const std::pair<bool, bool> mode : {std::pair{true, false}, std::pair{false, false}, std::pair{false, true}}) {
        const bool defaults = mode.first, sparse = mode.second;
        SCOPED_TRACE(defaults ? "rotation, ReLU, RoPE in halves"
                              : (sparse ? "the top half of the keys, the sparse loss" : "no rotation, no ReLU, interleaved RoPE"));
        const model::GptConfig config = dsa_grad_config(defaults, sparse);
        Device &               device = cpu::device();
        model::GptModel        gpt(config, device);
        gpt.init();
        for (model::Parameter * p : gpt.parameters()) {
            if (p->data.dim() != 2) continue;
            for (int64_t i = 0; i < p->numel(); ++i) p->data.data<float>()[i] *= 10.0f;
        }
        model::MicroBatch batch = make_batch(2, config.seq_length, config.vocab_size, 12, device);
        double            indexer_loss = 0.0;
        auto              main_loss    = [&] {
            model::GptModel::Context ctx;
            const double             sum = gpt.forward(ctx, batch).sum;
            indexer_loss                  = gpt.take_dsa_losses();
            return sum;
        };
        auto dsa_loss = [&] {
            main_loss();
            return indexer_loss;
        };
        gpt.zero_grad();
        model::GptModel::Context ctx;
        gpt.forward(ctx, batch);
        EXPECT_GT(gpt.take_dsa_losses(), 1e-3) << "the indexer's loss carries signal";
        std::vector<std::string> ready;
        gpt.backward(ctx, 1.0, [&](model::Parameter & p) { ready.push_back(p.name); });
        device.compute_stream().synchronize();
        const std::vector<model::Parameter *> params = gpt.parameters();
        EXPECT_EQ(ready.size(), params.size()) << "every parameter is reported ready exactly once";
        int indexer_tensors = 0, checked = 0;
        // With a top k below the sequence, a weight that reaches some layer's scores moves its selection under a
        // finite difference's step (the losses jump there); the weights after the last layer's selection do not:
        // its main attention's own projections, the output projection, the MLP, the final norm and the output
        // layer. Their gradients run back through the masked attention.
        auto after_selection = [](const std::string & name) {
            if (name.rfind("layers.", 0) != 0) return name.find("embedding") == std::string::npos;
            if (name.rfind("layers.1.", 0) != 0) return false;
            for (const char * part : {".kv_down.", ".kv_norm.", ".kv_up.", ".q_up.", ".proj.", ".norm2.", ".mlp."}) {
                if (name.find(part) != std::string::npos) return true;
            }
            return false;
        };
        for (model::Parameter * p : params) {
            const bool indexer = p->name.find(".indexer.") != std::string::npos;
            indexer_tensors += indexer ? 1 : 0;
            if (sparse && !after_selection(p->name)) continue;
            ++checked;
            std::vector<float> grad(p->main_grad.data<float>(), p->main_grad.data<float>() + p->numel());
            // The indexer's: a step of 1e-3, across which fewer of the scores' ReLUs change sides.
            check_gradient(p->name, p->data.data<float>(), p->numel(), grad.data(),
                           indexer ? std::function<double()>(dsa_loss) : std::function<double()>(main_loss), kModelProbes,
                           indexer ? 1e-3f : 1e-2f, 5e-3);
        }
        EXPECT_EQ(indexer_tensors, 2 * 5) << "wq_b, wk, the key norm's weight and bias and weights_proj of each layer";
        EXPECT_GE(checked, sparse ? 8 : static_cast<int>(params.size()));
    }
}

// DSA's index sharing (--dsa-indexer-topk-freq 2) over three layers: layers 1 and 3 have an indexer and select
// their own keys; layer 2 has none (no parameter of it exists) and attends to exactly layer 1's selection, the same
// mask. The backward reports every parameter ready once, and the logged loss is the two indexers'.
TEST(GptModel, DsaLayersBetweenIndexersAttendToTheirSourcesSelection) {
    model::GptConfig config      = dsa_grad_config(false, true);
    config.num_layers            = 3;
    config.dsa_indexer_topk_freq = 2;
    Device &        device       = cpu::device();
    model::GptModel gpt(config, device);
    gpt.init();
    int indexers = 0;
    for (model::Parameter * p : gpt.parameters()) indexers += p->name.find(".indexer.wk.") != std::string::npos;
    EXPECT_EQ(indexers, 2) << "layers 1 and 3";
    model::MicroBatch        batch = make_batch(2, config.seq_length, config.vocab_size, 13, device);
    model::GptModel::Context ctx;
    gpt.forward(ctx, batch);
    ASSERT_EQ(ctx.layers.size(), 3u);
    const Tensor & first = ctx.layers[0].attn.key_mask, & second = ctx.layers[1].attn.key_mask, & third = ctx.layers[2].attn.key_mask;
    ASSERT_TRUE(first.defined() && second.defined() && third.defined()) << "a top-k below the sequence selects";
    EXPECT_EQ(second.data_ptr(), first.data_ptr()) << "layer 2 attends to layer 1's selection";
    EXPECT_NE(third.data_ptr(), first.data_ptr()) << "layer 3 selects its own";
    EXPECT_GT(gpt.take_dsa_losses(), 1e-3);
    std::vector<std::string> ready;
    gpt.backward(ctx, 1.0, [&](model::Parameter & p) { ready.push_back(p.name); });
    device.compute_stream().synchronize();
    EXPECT_EQ(ready.size(), gpt.parameters().size()) << "every parameter is reported ready exactly once";
}

// One DSA layer's indexer loss against its definition written out in double from the layer's weights and input
// (Megatron's DSAIndexer and compute_dsa_indexer_loss): q = RoPE(W_qb qr) and k = RoPE(LayerNorm(W_k x)) per
// head, RoPE over the first 4 elements in halves (rotate_half), each rotated by Hadamard's matrix over 8 / sqrt(8),
// w = W_w x / sqrt(3 x 8), the scores, the main attention's causal probabilities summed over the heads (from the
// layer's own MLA rows, which MultiLatentAttention.MatchesMegatronsFormulationWrittenOut checks) and normalised,
// and the mean over rows of KL(target || softmax(scores)) times the coefficient. Within 1e-5 relative.
TEST(DsaIndexer, LossMatchesMegatronsFormulationWrittenOut) {
    model::GptConfig c = dsa_grad_config(true);
    c.seq_length       = 9;
    c.dsa_indexer_topk = 9;
    const int64_t s = c.seq_length, b = 2, n = s * b, h = c.hidden_size, a = c.num_attention_heads;
    const int64_t H = c.dsa_indexer_n_heads, d = c.dsa_indexer_head_dim, dr = c.qk_pos_emb_head_dim, rq = c.q_lora_rank;
    const int64_t dqk = c.qk_head_dim + dr;
    Device &             device = cpu::device();
    model::SelfAttention attn("attention", c, device);
    attn.init(7, 0.3f, 0.3f);
    const std::vector<float> xv = random_vector(n * h, 71);
    Tensor                   x  = Tensor::empty({n, h}, DType::f32, device);
    std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
    model::SelfAttention::Context ctx;
    ctx.training = true;
    attn.forward(ctx, x, s, b);
    device.compute_stream().synchronize();
    const double got = attn.indexer->loss.data<float>()[0];

    auto linear = [](const std::vector<double> & in, int64_t rows, int64_t width, const model::Linear & l, int64_t out_width) {
        const float *       w = l.weight.data.data<float>();
        std::vector<double> out(static_cast<size_t>(rows * out_width), 0.0);
        for (int64_t r = 0; r < rows; ++r) {
            for (int64_t o = 0; o < out_width; ++o) {
                for (int64_t i = 0; i < width; ++i) out[r * out_width + o] += in[r * width + i] * w[o * width + i];
            }
        }
        return out;
    };
    const std::vector<double> xd(xv.begin(), xv.end());
    // qr: the query latent after its RMSNorm (Megatron's q_layernorm with --qk-layernorm).
    std::vector<double> qr = linear(xd, n, h, *attn.mla->q_down, rq);
    for (int64_t r = 0; r < n; ++r) {
        double ms = 0;
        for (int64_t i = 0; i < rq; ++i) ms += qr[r * rq + i] * qr[r * rq + i];
        const double rstd = 1.0 / std::sqrt(ms / static_cast<double>(rq) + c.norm_epsilon);
        for (int64_t i = 0; i < rq; ++i) qr[r * rq + i] *= rstd * attn.mla->q_norm->weight.data.data<float>()[i];
    }
    const model::DsaIndexer & ix = *attn.indexer;
    std::vector<double>       q = linear(qr, n, rq, ix.wq_b, H * d), k = linear(xd, n, h, ix.wk, d);
    const std::vector<double> w = linear(xd, n, h, ix.weights_proj, H);
    for (int64_t r = 0; r < n; ++r) {   // k's LayerNorm (eps 1e-5, its weight 1 and bias 0 at init)
        double mean = 0, var = 0;
        for (int64_t i = 0; i < d; ++i) mean += k[r * d + i] / static_cast<double>(d);
        for (int64_t i = 0; i < d; ++i) var += (k[r * d + i] - mean) * (k[r * d + i] - mean) / static_cast<double>(d);
        for (int64_t i = 0; i < d; ++i) k[r * d + i] = (k[r * d + i] - mean) / std::sqrt(var + c.norm_epsilon);
    }
    // rotate_half RoPE on the first dr elements at position r / b, base 10000 (YaRN at factor 1), then Hadamard.
    auto turn = [&](double * t, int64_t position) {
        std::vector<double> pe(t, t + dr);
        for (int64_t i = 0; i < dr; ++i) {
            const double angle = static_cast<double>(position) * std::pow(10000.0, -2.0 * static_cast<double>(i % (dr / 2)) / dr);
            const double rot   = i < dr / 2 ? -pe[i + dr / 2] : pe[i - dr / 2];
            t[i]               = pe[i] * std::cos(angle) + rot * std::sin(angle);
        }
        std::vector<double> v(t, t + d);
        for (int64_t o = 0; o < d; ++o) {
            double sum = 0;
            for (int64_t i = 0; i < d; ++i) sum += ((std::popcount(static_cast<unsigned>(o & i)) % 2) ? -v[i] : v[i]);
            t[o] = sum / std::sqrt(static_cast<double>(d));
        }
    };
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t hd = 0; hd < H; ++hd) turn(&q[(r * H + hd) * d], r / b);
        turn(&k[r * d], r / b);
    }
    // The main attention's rows: [Q | K | V] of a heads of dqk each, Loom's layout, f32.
    const float * rows   = ctx.qkv.data<float>();
    const int64_t stride = 3 * a * dqk;
    const double  scale  = 1.0 / std::sqrt(static_cast<double>(dqk));
    double        want   = 0;
    for (int64_t bi = 0; bi < b; ++bi) {
        for (int64_t i = 0; i < s; ++i) {
            const int64_t       ri = i * b + bi;
            std::vector<double> target(static_cast<size_t>(i + 1), 0.0), score(static_cast<size_t>(i + 1), 0.0);
            for (int64_t hd = 0; hd < a; ++hd) {
                std::vector<double> logit(static_cast<size_t>(i + 1));
                double              top = -1e300, sum = 0;
                for (int64_t j = 0; j <= i; ++j) {
                    double dot = 0;
                    for (int64_t x2 = 0; x2 < dqk; ++x2) dot += rows[ri * stride + hd * dqk + x2] * rows[(j * b + bi) * stride + (a + hd) * dqk + x2];
                    logit[j] = scale * dot;
                    top      = std::max(top, logit[j]);
                }
                for (int64_t j = 0; j <= i; ++j) sum += std::exp(logit[j] - top);
                for (int64_t j = 0; j <= i; ++j) target[j] += std::exp(logit[j] - top) / sum;
            }
            double total = 0, top = -1e300, sum = 0;
            for (int64_t j = 0; j <= i; ++j) {
                total += target[j];
                for (int64_t hd = 0; hd < H; ++hd) {
                    double dot = 0;
                    for (int64_t x2 = 0; x2 < d; ++x2) dot += q[(ri * H + hd) * d + x2] * k[(j * b + bi) * d + x2];
                    score[j] += w[ri * H + hd] / std::sqrt(static_cast<double>(H * d)) * std::max(dot, 0.0);
                }
                top = std::max(top, score[j]);
            }
            for (int64_t j = 0; j <= i; ++j) sum += std::exp(score[j] - top);
            for (int64_t j = 0; j <= i; ++j) {
                const double T = target[j] / total;
                want += T * (std::log(T) - (score[j] - top - std::log(sum)));
            }
        }
    }
    want *= c.dsa_indexer_loss_coeff / static_cast<double>(n);
    EXPECT_GT(want, 1e-3) << "the loss carries signal";
    EXPECT_NEAR(got, want, 1e-5 * want);
}

// The indexer learns from its loss alone: on one DSA layer with fixed main weights (so a fixed target), twenty plain
// gradient steps on the indexer's weights take its KL to under half of where it started, every step lower.
TEST(DsaIndexer, GradientStepsOnItsWeightsAloneLowerItsLoss) {
    model::GptConfig c = dsa_grad_config(true);
    c.seq_length       = 16;
    c.dsa_indexer_topk = 16;
    c.dsa_indexer_loss_coeff = 1.0f;
    const int64_t s = c.seq_length, b = 2, n = s * b, h = c.hidden_size;
    Device &             device = cpu::device();
    model::SelfAttention attn("attention", c, device);
    attn.init(7, 0.3f, 0.3f);
    std::vector<model::Parameter *> indexer;
    attn.indexer->parameters(indexer);
    const std::vector<float> xv = random_vector(n * h, 72);
    Tensor                   x  = Tensor::empty({n, h}, DType::f32, device);
    std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
    const Tensor        dy = Tensor::zeros({n, h}, DType::f32, device);
    std::vector<double> losses;
    for (int step = 0; step < 20; ++step) {
        for (model::Parameter * p : indexer) std::memset(p->main_grad.data_ptr(), 0, static_cast<size_t>(p->main_grad.nbytes()));
        model::SelfAttention::Context ctx;
        ctx.training = true;
        attn.forward(ctx, x, s, b);
        attn.backward(ctx, dy, [](model::Parameter &) {});
        device.compute_stream().synchronize();
        losses.push_back(attn.indexer->loss.data<float>()[0]);
        attn.indexer->loss.data<float>()[0] = 0.0f;
        for (model::Parameter * p : indexer) {
            for (int64_t i = 0; i < p->numel(); ++i) p->data.data<float>()[i] -= 2.0f * p->main_grad.data<float>()[i];
        }
    }
    std::printf("dsa indexer alone: KL %.5f -> %.5f over 20 steps\n", losses.front(), losses.back());
    EXPECT_GT(losses.front(), 1e-2) << "the untrained indexer is far from the attention";
    for (size_t i = 1; i < losses.size(); ++i) EXPECT_LT(losses[i], losses[i - 1]) << "step " << i;
    EXPECT_LT(losses.back(), 0.5 * losses.front());
}

TEST(GptModel, GradientsAccumulateAcrossMicrobatches) {
    model::GptConfig c;
    c.num_layers = 1;
    c.hidden_size = 32;
    c.ffn_hidden_size = 64;
    c.num_attention_heads = 2;
    c.num_query_groups = 2;
    c.seq_length = 16;
    c.max_position_embeddings = 16;
    c.vocab_size = 40;
    model::GptModel gpt(c, cpu::device());
    gpt.init();
    model::MicroBatch batch = make_batch(2, 16, 40, 13, cpu::device());
    gpt.zero_grad();
    for (int k = 0; k < 2; ++k) {
        model::GptModel::Context ctx;
        gpt.forward(ctx, batch);
        gpt.backward(ctx, 0.5, nullptr);
    }
    cpu::device().compute_stream().synchronize();   // backward is stream work: wait before reading main_grad
    std::vector<std::vector<float>> twice;
    for (auto * p : gpt.parameters()) twice.emplace_back(p->main_grad.data<float>(), p->main_grad.data<float>() + p->numel());
    gpt.zero_grad();
    model::GptModel::Context ctx;
    gpt.forward(ctx, batch);
    gpt.backward(ctx, 1.0, nullptr);
    cpu::device().compute_stream().synchronize();   // backward is stream work: wait before reading main_grad
    auto params = gpt.parameters();
    for (size_t k = 0; k < params.size(); ++k) {
        const float * once = params[k]->main_grad.data<float>();
        for (int64_t i = 0; i < params[k]->numel(); ++i) {
            ASSERT_NEAR(twice[k][i], once[i], 1e-6f + 1e-5f * std::fabs(once[i])) << params[k]->name;
        }
    }
}

TEST(GptModel, ParameterCountMatchesTheConfigFormula) {
    model::GptConfig c = model::gpt_preset("gpt2-124m");
    // Hugging Face counts 124,439,808 with V = 50257; padding V to 50304 (a multiple of 128) adds
    // 47 x 768 = 36,096.
    EXPECT_EQ(c.num_parameters(), 124439808 + 47 * 768);
    for (const bool q_latent : {false, true}) {   // MLA: every projection and latent norm counted
        model::GptConfig mla = mla_grad_config(q_latent, q_latent);
        model::GptModel  gpt(mla, cpu::device());
        int64_t          total = 0;
        for (auto * p : gpt.parameters()) total += p->numel();
        EXPECT_EQ(total, mla.num_parameters()) << "MLA" << (q_latent ? " with a query latent" : "");
    }
    for (const bool qk : {false, true}) {   // with --qk-layernorm, and with the attention's output gate
        for (const char * preset : {"gpt-tiny", "llama-tiny"}) {
            model::GptConfig tiny      = model::gpt_preset(preset);
            tiny.qk_layernorm          = qk;
            tiny.attention_output_gate = qk;
            model::GptModel gpt(tiny, cpu::device());
            int64_t         total = 0;
            for (auto * p : gpt.parameters()) total += p->numel();
            EXPECT_EQ(total, tiny.num_parameters()) << preset << (qk ? " --qk-layernorm --attention-output-gate" : "");
        }
    }
    // MoE layers (their experts, biases, shared expert and gate), MLA with MTP, attention sinks.
    model::GptConfig gated = model::gpt_preset("llama-tiny");
    gated.moe.num_experts                     = 4;
    gated.moe.layer_pattern                   = {0, 1, 1, 1};
    gated.moe.shared_expert_intermediate_size = 64;
    gated.moe.shared_expert_gate              = true;
    model::GptConfig biased                   = model::gpt_preset("gpt-tiny");
    biased.moe.num_experts                    = 4;
    model::GptConfig gdn_layers               = model::gpt_preset("gpt-tiny");
    gdn_layers.gated_delta_net                = true;
    gdn_layers.linear_attention_layers        = {1, 0, 1, 0};
    gdn_layers.linear_num_key_heads           = 2;
    gdn_layers.linear_num_value_heads         = 4;
    gdn_layers.linear_key_head_dim            = 16;
    gdn_layers.linear_value_head_dim          = 24;
    for (const auto & [name, c] : {std::pair{"deepseek-v3-tiny", model::gpt_preset("deepseek-v3-tiny")},
                                   std::pair{"gpt-oss-tiny", model::gpt_preset("gpt-oss-tiny")},
                                   std::pair{"qwen3-next-tiny", model::gpt_preset("qwen3-next-tiny")},
                                   std::pair{"gpt-tiny, gated delta-net on layers 0 and 2 (a LayerNorm: its bias)", gdn_layers},
                                   std::pair{"llama-tiny, 3 MoE layers, gated shared expert", gated},
                                   std::pair{"gpt-tiny, MoE with biases", biased}}) {
        model::GptModel gpt(c, cpu::device());
        int64_t         total = 0;
        for (auto * p : gpt.parameters()) total += p->numel();
        EXPECT_EQ(total, c.num_parameters()) << name;
    }
}

// vec_math.h's claims: exp within 3e-7 relative on [-87, 88] (against double exp), tanh within 2e-7
// absolute, NaN propagates, and the clamped ends stay finite.
TEST(VecMath, ExpTanhSigmoidMeetTheirStatedAccuracy) {
    double worst_exp = 0, worst_tanh = 0;
    for (double x = -87.0; x <= 88.0; x += 0.000731) {
        float  xf  = static_cast<float>(x);
        double ref = std::exp(static_cast<double>(xf));
        worst_exp  = std::max(worst_exp, std::fabs(cpu::exp_approx(xf) - ref) / ref);
    }
    for (double u = -20.0; u <= 20.0; u += 0.0001) {
        float uf   = static_cast<float>(u);
        worst_tanh = std::max(worst_tanh, std::fabs(cpu::tanh_approx(uf) - std::tanh(static_cast<double>(uf))));
    }
    EXPECT_LT(worst_exp, 3e-7);
    EXPECT_LT(worst_tanh, 2e-7);
    EXPECT_EQ(cpu::tanh_approx(100.0f), 1.0f);
    EXPECT_EQ(cpu::tanh_approx(-100.0f), -1.0f);
    EXPECT_NEAR(cpu::sigmoid_approx(0.0f), 0.5f, 1e-7f);
    EXPECT_TRUE(std::isnan(cpu::exp_approx(std::nanf(""))));
    EXPECT_LT(cpu::exp_approx(-INFINITY), 1e-37f);
    EXPECT_TRUE(std::isfinite(cpu::exp_approx(1000.0f)));
}

// The fused residual + norm kernels equal the add followed by the plain norm, bit for bit, and leave
// the sum in x.
TEST(FusedKernels, ResidualPlusNormEqualsAddThenNorm) {
    const int64_t      n = 37, h = 96;
    std::vector<float> x = random_vector(n * h, 1), r = random_vector(n * h, 2), g = random_vector(h, 3),
                       b = random_vector(h, 4);
    std::vector<float> sum(n * h);
    for (int64_t i = 0; i < n * h; ++i) sum[i] = x[i] + r[i];
    std::vector<float> y1(n * h), y2(n * h), m1(n), m2(n), s1(n), s2(n);
    cpu::layernorm_forward(sum.data(), g.data(), b.data(), y1.data(), m1.data(), s1.data(), n, h, 1e-5f);
    std::vector<float> xf = x;
    cpu::add_layernorm_forward(xf.data(), r.data(), g.data(), b.data(), y2.data(), m2.data(), s2.data(), n, h, 1e-5f);
    EXPECT_EQ(xf, sum);
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(m1, m2);
    EXPECT_EQ(s1, s2);
    cpu::rmsnorm_forward(sum.data(), g.data(), y1.data(), s1.data(), n, h, 1e-5f);
    xf = x;
    cpu::add_rmsnorm_forward(xf.data(), r.data(), g.data(), y2.data(), s2.data(), n, h, 1e-5f);
    EXPECT_EQ(xf, sum);
    EXPECT_EQ(y1, y2);
    EXPECT_EQ(s1, s2);
}

// A (rows, cols) bf16 CPU tensor of N(0, scale^2) draws, each rounded once.
static Tensor bf16_normal(std::mt19937 & rng, int64_t rows, int64_t cols, float scale) {
    std::normal_distribution<float> normal;
    Tensor                          t = Tensor::empty({rows, cols}, DType::bf16, cpu::device());
    for (int64_t i = 0; i < rows * cols; ++i) static_cast<uint16_t *>(t.data_ptr())[i] = f32_to_bf16_bits(scale * normal(rng));
    return t;
}

// FP8 GEMMs in a linear layer (--fp8-format, tensorwise): forward, the input's gradient and the weight's
// against the rule written out here in double with core/fp8.h's casts: each operand cast to FP8 by its own
// scale fmax / amax, the exact products summed and divided by both scales. Forward and dx are rounded once
// to bf16 (within 2^-7 relative of the reference, a bf16 step and the f32 sums' order); dW accumulates in f32
// (within 1e-5). Hybrid: dy in e5m2 (a reference that casts dy to e4m3 instead is off by far more and fails).
TEST(Linear, Fp8GemmsFollowTheCastRuleForwardAndBackward) {
    Device &      device = cpu::device();
    const int64_t n = 24, in = 40, out = 16;
    model::Linear lin("fp8", in, out, true, DType::bf16, device);
    lin.init(5, 0.3f);
    for (int64_t j = 0; j < out; ++j) static_cast<uint16_t *>(lin.bias.data.data_ptr())[j] = f32_to_bf16_bits(0.01f * static_cast<float>(j));
    lin.fp8 = model::Linear::Fp8{Fp8Format::e4m3, Fp8Format::e5m2};
    std::mt19937 rng(3);
    auto         bf16_tensor = [&](int64_t rows, int64_t cols, float scale) { return bf16_normal(rng, rows, cols, scale); };
    const Tensor x = bf16_tensor(n, in, 2.0f), dy = bf16_tensor(n, out, 1e-3f);
    // The cast of a tensor: its values times s = fmax / amax, each to the nearest FP8 value; and 1 / s.
    auto cast = [](const Tensor & t, Fp8Format f, std::vector<double> & q) {
        float amax = 0;
        for (int64_t i = 0; i < t.numel(); ++i) amax = std::max(amax, std::fabs(bf16_bits_to_f32(static_cast<uint16_t *>(t.data_ptr())[i])));
        const float s = fp8_scale_from_amax(amax, f);
        q.resize(static_cast<size_t>(t.numel()));
        for (int64_t i = 0; i < t.numel(); ++i) q[i] = fp8_round(bf16_bits_to_f32(static_cast<uint16_t *>(t.data_ptr())[i]) * s, f);
        return static_cast<double>(1.0f / s);   // the op's scale_inv
    };
    std::vector<double> qx, qw, qdy;
    const double sx = cast(x, Fp8Format::e4m3, qx), sw = cast(lin.weight.data, Fp8Format::e4m3, qw),
                 sdy = cast(dy, Fp8Format::e5m2, qdy);   // the inverse scales
    model::Linear::Context ctx;
    const Tensor y  = lin.forward(ctx, x);
    const Tensor dx = lin.backward(ctx, dy, nullptr);
    device.compute_stream().synchronize();
    double worst_y = 0, worst_dx = 0, worst_dw = 0;
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < out; ++j) {
            double acc = 0;
            for (int64_t k = 0; k < in; ++k) acc += qx[r * in + k] * qw[j * in + k];
            const double want = acc * sx * sw + bf16_bits_to_f32(static_cast<uint16_t *>(lin.bias.data.data_ptr())[j]);
            const double got  = bf16_bits_to_f32(static_cast<uint16_t *>(y.data_ptr())[r * out + j]);
            worst_y = std::max(worst_y, std::fabs(got - want) / std::max(std::fabs(want), 1e-3));
        }
        for (int64_t k = 0; k < in; ++k) {
            double acc = 0;
            for (int64_t j = 0; j < out; ++j) acc += qdy[r * out + j] * qw[j * in + k];
            const double want = acc * sdy * sw;
            const double got  = bf16_bits_to_f32(static_cast<uint16_t *>(dx.data_ptr())[r * in + k]);
            worst_dx = std::max(worst_dx, std::fabs(got - want) / std::max(std::fabs(want), 1e-6));
        }
    }
    for (int64_t j = 0; j < out; ++j) {
        for (int64_t k = 0; k < in; ++k) {
            double acc = 0;
            for (int64_t r = 0; r < n; ++r) acc += qdy[r * out + j] * qx[r * in + k];
            const double want = acc * sdy * sx;
            worst_dw = std::max(worst_dw, std::fabs(lin.weight.main_grad.data<float>()[j * in + k] - want) /
                                              std::max(std::fabs(want), 1e-9));
        }
    }
    std::printf("[fp8 linear] worst relative error: y %.3g, dx %.3g, dW %.3g\n", worst_y, worst_dx, worst_dw);
    EXPECT_LT(worst_y, 1.0 / 128);
    EXPECT_LT(worst_dx, 1.0 / 128);
    EXPECT_LT(worst_dw, 1e-5);
}

// --fp8-recipe delayed: the same layer over three micro-batches whose inputs differ in size (x at 2, 8 and 0.5,
// dy at 1e-3, 4e-3 and 2e-3), with histories of 2 casts, algo max and margin 1, as Transformer Engine's
// DelayedScaling. Step k casts by the scale the update after step k - 1 formed (the first by 1): s = 448 / 2 /
// max(amax_(k-1), amax_(k-2)) for x and W (e4m3), 57344 / 2 / ... for dy (e5m2); backward casts x and W again by
// their forward's scales. Each output against the rule in double with those scales (bounds as the tensorwise
// case), the scales bitwise, and the history after the last update: row 0 cleared, row 1 the last amax.
TEST(Linear, Fp8DelayedScalingCastsByTheAmaxHistory) {
    Device &      device = cpu::device();
    const int64_t n = 24, in = 40, out = 16;
    model::Linear lin("fp8d", in, out, false, DType::bf16, device);
    lin.init(7, 0.3f);
    lin.fp8 = model::Linear::Fp8{Fp8Format::e4m3, Fp8Format::e5m2};
    model::Fp8DelayedMetas metas;
    metas.forward  = std::make_unique<model::Fp8Delayed>(Fp8Format::e4m3, 2, true, 1);
    metas.backward = std::make_unique<model::Fp8Delayed>(Fp8Format::e5m2, 2, true, 1);
    lin.set_fp8_delayed(metas);
    metas.forward->allocate(device);
    metas.backward->allocate(device);
    std::mt19937 rng(5);
    auto         bf16_tensor = [&](int64_t rows, int64_t cols, float scale) { return bf16_normal(rng, rows, cols, scale); };
    auto value = [](const Tensor & t, int64_t i) { return bf16_bits_to_f32(static_cast<const uint16_t *>(t.data_ptr())[i]); };
    auto amax_of = [&](const Tensor & t) {
        float a = 0;
        for (int64_t i = 0; i < t.numel(); ++i) a = std::max(a, std::fabs(value(t, i)));
        return a;
    };
    auto cast = [&](const Tensor & t, Fp8Format f, float s, std::vector<double> & q) {
        q.resize(static_cast<size_t>(t.numel()));
        for (int64_t i = 0; i < t.numel(); ++i) q[i] = fp8_round(value(t, i) * s, f);
        return static_cast<double>(1.0f / s);
    };
    const float w_amax = amax_of(lin.weight.data);
    float       sx = 1, sw = 1, sdy = 1, prev_x = 0, prev_dy = 0, prev_w = 0;
    std::vector<double> dw_want(static_cast<size_t>(out * in), 0.0);
    double worst_y = 0, worst_dx = 0;
    const float x_sizes[] = {2.0f, 8.0f, 0.5f}, dy_sizes[] = {1e-3f, 4e-3f, 2e-3f};
    float       last_x = 0, last_dy = 0;
    for (int k = 0; k < 3; ++k) {
        const Tensor x = bf16_tensor(n, in, x_sizes[k]), dy = bf16_tensor(n, out, dy_sizes[k]);
        std::vector<double> qx, qw, qdy;
        const double ix = cast(x, Fp8Format::e4m3, sx, qx), iw = cast(lin.weight.data, Fp8Format::e4m3, sw, qw);
        const double idy = cast(dy, Fp8Format::e5m2, sdy, qdy);
        model::Linear::Context ctx;
        const Tensor y = lin.forward(ctx, x);
        metas.forward->update(nullptr);
        const Tensor dx = lin.backward(ctx, dy, nullptr);
        metas.backward->update(nullptr);
        device.compute_stream().synchronize();
        for (int64_t r = 0; r < n; ++r) {
            for (int64_t j = 0; j < out; ++j) {
                double acc = 0;
                for (int64_t c = 0; c < in; ++c) acc += qx[r * in + c] * qw[j * in + c];
                const double want = acc * ix * iw;
                worst_y = std::max(worst_y, std::fabs(value(y, r * out + j) - want) / std::max(std::fabs(want), 1e-3));
            }
            for (int64_t c = 0; c < in; ++c) {
                double acc = 0;
                for (int64_t j = 0; j < out; ++j) acc += qdy[r * out + j] * qw[j * in + c];
                const double want = acc * idy * iw;
                worst_dx = std::max(worst_dx, std::fabs(value(dx, r * in + c) - want) / std::max(std::fabs(want), 1e-6));
            }
        }
        for (int64_t j = 0; j < out; ++j) {
            for (int64_t c = 0; c < in; ++c) {
                double acc = 0;
                for (int64_t r = 0; r < n; ++r) acc += qdy[r * out + j] * qx[r * in + c];
                dw_want[static_cast<size_t>(j * in + c)] += acc * idy * ix;
            }
        }
        // The update after this step: the history holds this step's amax and the one before (max of two).
        const float ax = amax_of(x), ady = amax_of(dy);
        sx      = fp8_delayed_scale(std::max(ax, prev_x), sx, Fp8Format::e4m3, 1);
        sw      = fp8_delayed_scale(std::max(w_amax, prev_w), sw, Fp8Format::e4m3, 1);
        sdy     = fp8_delayed_scale(std::max(ady, prev_dy), sdy, Fp8Format::e5m2, 1);
        prev_x  = ax;
        prev_w  = w_amax;
        prev_dy = ady;
        last_x  = ax;
        last_dy = ady;
    }
    double worst_dw = 0, largest_dw = 0;
    for (double v : dw_want) largest_dw = std::max(largest_dw, std::fabs(v));
    for (int64_t i = 0; i < out * in; ++i) {
        worst_dw = std::max(worst_dw, std::fabs(lin.weight.main_grad.data<float>()[i] - dw_want[static_cast<size_t>(i)]) / largest_dw);
    }
    std::printf("[fp8 delayed linear] worst relative error: y %.3g, dx %.3g, dW %.3g of its largest\n", worst_y, worst_dx, worst_dw);
    EXPECT_LT(worst_y, 1.0 / 128);
    EXPECT_LT(worst_dx, 1.0 / 128);
    EXPECT_LT(worst_dw, 1e-5);
    EXPECT_EQ(metas.forward->scale().data<float>()[0], sx) << "x's scale after three updates";
    EXPECT_EQ(metas.forward->scale().data<float>()[1], sw) << "W's";
    EXPECT_EQ(metas.backward->scale().data<float>()[0], sdy) << "dy's";
    EXPECT_NE(sx, fp8_delayed_scale(last_x, 1.0f, Fp8Format::e4m3, 1)) << "the test's steps must tell max from most_recent";
    const float * hx = metas.forward->history().data<float>();   // (2, 2): row 0 then row 1
    EXPECT_EQ(hx[0], 0.0f) << "row 0 cleared by the update";
    EXPECT_EQ(hx[2], last_x) << "row 1: the last step's amax";
    EXPECT_EQ(metas.backward->history().data<float>()[1], last_dy);
}

// --fp8-recipe blockwise: the same layer with power-of-two scales per block, against the rule in double: x in
// 1 x 128 blocks along its features for forward, dy in 1 x 128 along its features for dx, both in 128 x 1 along
// the tokens for dW (the reduction of each GEMM), W in 128 x 128. Shapes that leave partial blocks on every
// side (300 features, 160 outputs, 200 tokens). Bounds as the tensorwise case (dW's of its largest element); a
// reference that casts dW's operands along the features instead (the forward's blocks) is off by far more and
// fails.
static void block_scaled_linear_follows_the_rule(bool mx) {
    Device &      device = cpu::device();
    const int64_t n = 200, in = 300, out = 160;
    model::Linear lin("fp8b", in, out, true, DType::bf16, device);
    lin.init(6, 0.3f);
    lin.fp8 = model::Linear::Fp8{Fp8Format::e4m3, Fp8Format::e5m2, false, !mx, mx};
    const int64_t kb = mx ? 32 : 128;   // MXFP8: 32 along the reduction, the weight too (no 2-D blocks)
    std::mt19937                    rng(4);
    std::normal_distribution<float> normal;
    // Token rows of two magnitudes 2^14 apart, x large where dy is small: blocks along the features give each row
    // its own scale, blocks along the tokens cast the small rows of x near the bottom of e4m3's range.
    auto values = [&, mx](int64_t rows, int64_t cols, float scale, int large_rows, Tensor & t) {
        t = Tensor::empty({rows, cols}, DType::bf16, device);
        std::vector<double> v(static_cast<size_t>(rows * cols));
        for (int64_t i = 0; i < rows * cols; ++i) {
            // MXFP8: the magnitudes alternate by runs of 32 rows (one in four large for x, three in four for dy), so
            // its token blocks of 32 each hold one magnitude where blockwise's 128 would hold both.
            const int64_t r     = i / cols;
            const bool    large = mx ? ((r / 32) % 4 == 0) == (large_rows == 1) : r % 2 == large_rows;
            const float   value = scale * normal(rng) * (large ? 16384.0f : 1.0f);
            static_cast<uint16_t *>(t.data_ptr())[i] = f32_to_bf16_bits(value);
            v[static_cast<size_t>(i)]                = bf16_bits_to_f32(f32_to_bf16_bits(value));
        }
        return v;
    };
    Tensor    x, dy;
    const std::vector<double> vx = values(n, in, 1.0f, 1, x), vdy = values(n, out, 1e-3f, 0, dy);
    std::vector<double>       vw(static_cast<size_t>(out * in));
    for (int64_t i = 0; i < out * in; ++i) vw[i] = bf16_bits_to_f32(static_cast<uint16_t *>(lin.weight.data.data_ptr())[i]);
    // Each block's values cast by s = the power of two at or below fmax / amax (MXFP8: the reciprocal of amax / fmax
    // rounded up to a power of two), and divided by it again.
    auto cast_blocks = [](const std::vector<double> & v, int64_t rows, int64_t cols, int64_t br, int64_t bc, Fp8Format f,
                          bool mx_rule) {
        std::vector<double> q(v.size());
        for (int64_t r0 = 0; r0 < rows; r0 += br) {
            for (int64_t c0 = 0; c0 < cols; c0 += bc) {
                float amax = 0;
                for (int64_t r = r0; r < std::min(rows, r0 + br); ++r) {
                    for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c) amax = std::max(amax, static_cast<float>(std::fabs(v[r * cols + c])));
                }
                const float s = mx_rule ? mxfp8_block_scale(amax, f) : fp8_scale_from_amax(amax, f, true);
                for (int64_t r = r0; r < std::min(rows, r0 + br); ++r) {
                    for (int64_t c = c0; c < std::min(cols, c0 + bc); ++c) {
                        q[r * cols + c] = static_cast<double>(fp8_round(static_cast<float>(v[r * cols + c]) * s, f)) / s;
                    }
                }
            }
        }
        return q;
    };
    auto blocks = [&](const std::vector<double> & v, int64_t rows, int64_t cols, int64_t br, int64_t bc, Fp8Format f) {
        return cast_blocks(v, rows, cols, br, bc, f, mx);
    };
    const auto qx  = blocks(vx, n, in, 1, kb, Fp8Format::e4m3);
    const auto qw  = mx ? blocks(vw, out, in, 1, kb, Fp8Format::e4m3) : blocks(vw, out, in, 128, 128, Fp8Format::e4m3);
    const auto cw  = mx ? blocks(vw, out, in, kb, 1, Fp8Format::e4m3) : qw;   // dgrad's W: along its rows (out)
    const auto qdy = blocks(vdy, n, out, 1, kb, Fp8Format::e5m2);
    const auto cx = blocks(vx, n, in, kb, 1, Fp8Format::e4m3), cdy = blocks(vdy, n, out, kb, 1, Fp8Format::e5m2);
    model::Linear::Context ctx;
    const Tensor y  = lin.forward(ctx, x);
    const Tensor dx = lin.backward(ctx, dy, nullptr);
    device.compute_stream().synchronize();
    // The other recipe's forward blocks (blockwise's for MXFP8, MXFP8's for blockwise), to show the test tells them apart.
    const int64_t other_kb = mx ? 128 : 32;
    auto other_blocks = [&](const std::vector<double> & v, int64_t rows, int64_t cols, int64_t br, int64_t bc,
                            Fp8Format f = Fp8Format::e4m3) { return cast_blocks(v, rows, cols, br, bc, f, !mx); };
    const auto ox = other_blocks(vx, n, in, 1, other_kb);
    const auto ow = mx ? other_blocks(vw, out, in, 128, 128) : other_blocks(vw, out, in, 1, other_kb);
    const auto ocx = other_blocks(vx, n, in, other_kb, 1), ocdy = other_blocks(vdy, n, out, other_kb, 1, Fp8Format::e5m2);
    double     worst_other_dw = 0;
    double worst_y = 0, worst_dx = 0, worst_dw = 0, worst_wrong = 0, largest_dw = 0, worst_other_y = 0;
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t j = 0; j < out; ++j) {
            double acc = 0, other = 0;
            for (int64_t k = 0; k < in; ++k) {
                acc += qx[r * in + k] * qw[j * in + k];
                other += ox[r * in + k] * ow[j * in + k];
            }
            const double got = bf16_bits_to_f32(static_cast<uint16_t *>(y.data_ptr())[r * out + j]);
            worst_y = std::max(worst_y, std::fabs(got - acc) / std::max(std::fabs(acc), 1e-3));
            worst_other_y = std::max(worst_other_y, std::fabs(got - other) / std::max(std::fabs(other), 1e-3));
        }
        for (int64_t k = 0; k < in; ++k) {
            double acc = 0;
            for (int64_t j = 0; j < out; ++j) acc += qdy[r * out + j] * cw[j * in + k];
            const double got = bf16_bits_to_f32(static_cast<uint16_t *>(dx.data_ptr())[r * in + k]);
            worst_dx = std::max(worst_dx, std::fabs(got - acc) / std::max(std::fabs(acc), 1e-6));
        }
    }
    for (int64_t j = 0; j < out; ++j) {
        for (int64_t k = 0; k < in; ++k) {
            double acc = 0, wrong = 0, other = 0;
            for (int64_t r = 0; r < n; ++r) {
                acc += cdy[r * out + j] * cx[r * in + k];
                wrong += qdy[r * out + j] * qx[r * in + k];
                other += ocdy[r * out + j] * ocx[r * in + k];
            }
            const double got = lin.weight.main_grad.data<float>()[j * in + k];
            worst_dw       = std::max(worst_dw, std::fabs(got - acc));
            worst_wrong    = std::max(worst_wrong, std::fabs(got - wrong));
            worst_other_dw = std::max(worst_other_dw, std::fabs(got - other));
            largest_dw  = std::max(largest_dw, std::fabs(acc));
        }
    }
    worst_dw /= largest_dw;   // of the gradient's largest element: sums of 200 terms of both signs
    worst_wrong /= largest_dw;
    worst_other_dw /= largest_dw;
    std::printf("[%s linear] worst relative error: y %.3g, dx %.3g, dW %.3g of its largest (against feature blocks: %.3g; "
                "against the other recipe's blocks: y %.3g, dW %.3g)\n",
                mx ? "mxfp8" : "fp8 blockwise", worst_y, worst_dx, worst_dw, worst_wrong, worst_other_y, worst_other_dw);
    EXPECT_LT(worst_y, 1.0 / 128);
    EXPECT_LT(worst_dx, 1.0 / 128);
    EXPECT_LT(worst_dw, 1e-5);
    // The checks can tell the rules apart: blocks along the features (the rows' two magnitudes alternate), and the
    // other recipe's token blocks and scales (MXFP8's runs of 32 rows of one magnitude).
    if (!mx) {
        EXPECT_GT(worst_wrong, 1e-3) << "the weight gradient's blocks run along the tokens";
    }
    EXPECT_GT(worst_other_dw, 1e-3) << "the other recipe's blocks give another weight gradient";
}

TEST(Linear, Fp8BlockwiseGemmsFollowTheBlockRule) { block_scaled_linear_follows_the_rule(false); }

// --fp8-recipe mxfp8: the same layer and bounds with MXFP8's blocks of 32 along each GEMM's reduction (the weight's
// along its rows for forward, its columns for dgrad) and E8M0 scales. The rows' magnitudes alternate by runs of
// 32: a reference with blockwise's 128-row blocks is off by 6.1e-2 of dW's largest and fails.
TEST(Linear, Mxfp8GemmsFollowTheBlockRule) { block_scaled_linear_follows_the_rule(true); }
