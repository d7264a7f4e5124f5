// Mixture-of-Experts on one rank (src/model/moe/): Megatron's formulas and rules, checked by number.
//
// Gradient checks: central finite differences of a scalar objective evaluated in f32 and summed in double
// (L = <w, y> + aux + z for the layer, with fixed random w), eps = 1e-2 on O(1) inputs and weights,
// accepted when |analytic - numeric| <= 2e-3 (1 + |numeric|) per checked element (as test_model_grad).
// Top-k and capacity dropping are piecewise constant: a probe whose +-eps moves any token to another
// expert (or drops another one) is skipped and counted; each check asserts that most probes ran.
#include "backend/cpu/cpu_device.h"
#include "core/device.h"
#include "core/float_bits.h"
#include "core/ops.h"
#include "model/moe/moe_layer.h"

#include "random_values.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstring>
#include <functional>
#include <numeric>
#include <random>

using namespace loom;
using namespace loom::model;

namespace {

Device & dev() { return cpu::device(); }
void     wait_compute() { dev().compute_stream().synchronize(); }

using loom::testing::random_vector;

template <typename T>
Tensor tensor_of(const std::vector<T> & v, const Shape & shape) {
    Tensor t = Tensor::empty(shape, dtype_of<T>::value, dev());
    std::memcpy(t.data_ptr(), v.data(), v.size() * sizeof(T));
    return t;
}

template <typename T>
std::vector<T> values(const Tensor & t) {
    wait_compute();
    return std::vector<T>(t.data<T>(), t.data<T>() + t.numel());
}

double dot(const std::vector<float> & a, const Tensor & b) {
    const float * p = b.data<float>();
    double        s = 0;
    for (size_t i = 0; i < a.size(); ++i) s += static_cast<double>(a[i]) * p[i];
    return s;
}

// A probe of the objective: its value, and a signature of the routing it took (which expert and row
// each (token, slot) got), so a probe across a routing change can be recognised.
struct Probe {
    double               value;
    std::vector<int32_t> routing;
};

// Compares analytic[i] with the central difference of `loss` in x[i] for `samples` indices (all of them
// when samples >= n); probes whose routing differs from `base` are skipped.
void check_gradient(const std::string & what, float * x, int64_t n, const float * analytic,
                    const std::function<Probe()> & loss, int samples = 24, float eps = 1e-2f, double tol = 2e-3) {
    const std::vector<int32_t> base = loss().routing;
    std::mt19937_64            rng(n * 7919 + what.size());
    int                        bad = 0, skipped = 0, total = 0;
    for (int s = 0; s < std::min<int64_t>(samples, n); ++s) {
        int64_t i    = samples >= n ? s : static_cast<int64_t>(rng() % n);
        float   orig = x[i];
        x[i]         = orig + eps;
        Probe lp     = loss();
        x[i]         = orig - eps;
        Probe lm     = loss();
        x[i]         = orig;
        ++total;
        if (lp.routing != base || lm.routing != base) {
            ++skipped;
            continue;
        }
        double numeric = (lp.value - lm.value) / (2.0 * eps);
        double diff    = std::fabs(analytic[i] - numeric);
        if (diff > tol * (1.0 + std::fabs(numeric)) && ++bad <= 3) {
            ADD_FAILURE() << what << "[" << i << "]: analytic " << analytic[i] << " numeric " << numeric;
        }
    }
    EXPECT_EQ(bad, 0) << what;
    EXPECT_LE(skipped * 4, total) << what << ": " << skipped << " of " << total << " probes crossed a routing change";
}

GptConfig small_config(bool swiglu, bool bias) {
    GptConfig c;
    c.hidden_size     = 8;
    c.ffn_hidden_size = 12;
    c.swiglu          = swiglu;
    c.add_bias_linear = bias;
    return c;
}

// Scales every parameter's values (the 0.02 init would leave the router's logits near zero).
void scale_parameters(std::vector<Parameter *> params, float factor) {
    for (Parameter * p : params) {
        float * w = p->data.data<float>();
        for (int64_t i = 0; i < p->numel(); ++i) w[i] *= factor;
    }
}

// Biases get random values too, so their gradients are not checked at a special point.
void randomise_biases(std::vector<Parameter *> params, uint64_t seed) {
    for (Parameter * p : params) {
        if (p->name.find(".bias") == std::string::npos) continue;
        auto v = random_vector(p->numel(), seed++, 0.5f);
        if (p->data.dtype() == DType::bf16) {   // the nearest bf16 values
            for (size_t i = 0; i < v.size(); ++i) static_cast<uint16_t *>(p->data.data_ptr())[i] = f32_to_bf16_bits(v[i]);
        } else {
            std::memcpy(p->data.data<float>(), v.data(), v.size() * sizeof(float));
        }
    }
}

void zero_grads(const std::vector<Parameter *> & params) {
    for (Parameter * p : params) p->main_grad.fill_zero();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Configuration

TEST(MoeConfig, CapacityIsCeilOfTokensTimesTopkOverExpertsTimesFactor) {
    EXPECT_EQ(moe_capacity(10, 4, 2, 1.0), 5);    // ceil(5.0)
    EXPECT_EQ(moe_capacity(10, 4, 2, 1.1), 6);    // ceil(5.5)
    EXPECT_EQ(moe_capacity(7, 3, 1, 1.0), 3);     // ceil(2.33)
    EXPECT_EQ(moe_capacity(8, 8, 2, 0.5), 1);     // ceil(1.0)
    EXPECT_EQ(moe_capacity(8, 8, 2, 0.0), 0);
    EXPECT_EQ(moe_capacity(4096, 64, 8, 1.25), 640);
    EXPECT_EQ(moe_capacity(6, 4, 2, 2.5), 8);     // above n: padding rows only
}

TEST(MoeConfig, ValidationNamesMegatronsFlags) {
    GptConfig config = small_config(false, false);
    auto message = [&](const MoeConfig & moe) -> std::string {
        try {
            moe_config_validate(moe, config);
        } catch (const Error & e) {
            return e.what();
        }
        return "";
    };
    MoeConfig moe;
    moe.num_experts = 4;
    EXPECT_EQ(message(moe), "");
    moe.topk = 1;
    EXPECT_NE(message(moe).find("Please use --moe-router-pre-softmax when topk is 1."), std::string::npos);
    moe.pre_softmax = true;
    EXPECT_EQ(message(moe), "");
    moe.score_function = MoeScoreFunction::sigmoid;
    moe.pre_softmax    = false;
    EXPECT_EQ(message(moe), "");   // a sigmoid score has a gradient with k = 1
    moe.topk            = 5;
    EXPECT_NE(message(moe).find("--moe-router-topk 5"), std::string::npos);
    moe.topk            = 2;
    moe.pad_to_capacity = true;
    EXPECT_NE(message(moe).find("moe_expert_capacity_factor must be set to use moe_pad_expert_input_to_capacity"),
              std::string::npos);
    moe.capacity_factor = 1.0f;
    EXPECT_EQ(message(moe), "");
    moe.shared_expert_intermediate_size = 16;
    config.add_bias_linear              = true;
    EXPECT_NE(message(moe).find("please set '--disable-bias-linear'"), std::string::npos);
    EXPECT_EQ(moe_load_balancing_parse("sinkhorn"), MoeLoadBalancing::sinkhorn);
    EXPECT_EQ(moe_load_balancing_parse("global_aux_loss"), MoeLoadBalancing::global_aux_loss);
    EXPECT_THROW(moe_load_balancing_parse("quantile_balancing"), Error);
    config.add_bias_linear              = false;
    moe.shared_expert_intermediate_size = 0;
    moe.load_balancing                  = MoeLoadBalancing::sinkhorn;
    moe.topk                            = 1;
    EXPECT_EQ(message(moe), "") << "sinkhorn takes top-1 without --moe-router-pre-softmax, as Megatron";
    moe.aux_loss_coeff = 0.01f;
    EXPECT_NE(message(moe).find("Sinkhorn routing does not support aux loss."), std::string::npos);
    EXPECT_EQ(moe_load_balancing_parse("seq_aux_loss"), MoeLoadBalancing::seq_aux_loss);
}

// ---------------------------------------------------------------------------------------------------
// Router

namespace {

struct RouterRun {
    std::vector<int32_t> top_idx;
    std::vector<float>   probs, losses;
};

RouterRun route(const MoeConfig & moe, const std::vector<float> & logits, int64_t b = 1) {
    GptConfig       config = small_config(false, false);
    Router          router("router", config, moe, dev());
    Router::Context ctx;
    const int64_t   n = static_cast<int64_t>(logits.size()) / moe.num_experts;
    router.route(ctx, tensor_of(logits, {n, moe.num_experts}), b);
    return {values<int32_t>(ctx.top_idx), values<float>(ctx.probs), values<float>(ctx.losses)};
}

std::vector<double> softmax(const float * l, int64_t E) {
    std::vector<double> s(E);
    double              m = *std::max_element(l, l + E), sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(l[e] - m));
    for (auto & v : s) v /= sum;
    return s;
}

}  // namespace

TEST(Router, TopkTiesGoToTheLowestExpertIndex) {
    const std::vector<float> logits = {0, 0, 0, 0,  1, 3, 3, 3,  5, -1, 5, 2};
    for (int variant = 0; variant < 3; ++variant) {
        MoeConfig moe;
        moe.num_experts    = 4;
        moe.topk           = 2;
        moe.pre_softmax    = variant == 1;
        moe.score_function = variant == 2 ? MoeScoreFunction::sigmoid : MoeScoreFunction::softmax;
        RouterRun r        = route(moe, logits);
        EXPECT_EQ(r.top_idx, (std::vector<int32_t>{0, 1, 1, 2, 0, 2})) << "variant " << variant;
        EXPECT_EQ(r.probs[0], r.probs[1]);
        EXPECT_EQ(r.probs[4], r.probs[5]);
    }
}

TEST(Router, ProbabilitiesFollowTheScoreFunction) {
    const std::vector<float> logits = {0.5f, -1.0f, 2.0f, 1.0f};
    MoeConfig                moe;
    moe.num_experts = 4;
    moe.topk        = 2;
    // Post-softmax (Megatron's default): softmax over the two selected logits 2 and 1.
    RouterRun r = route(moe, logits);
    EXPECT_EQ(r.top_idx, (std::vector<int32_t>{2, 3}));
    EXPECT_NEAR(r.probs[0], 1.0 / (1.0 + std::exp(-1.0)), 1e-7);
    EXPECT_NEAR(r.probs[0] + r.probs[1], 1.0, 1e-7);
    // Pre-softmax: the softmax over all four, not renormalised.
    moe.pre_softmax        = true;
    r                      = route(moe, logits);
    std::vector<double> s  = softmax(logits.data(), 4);
    EXPECT_NEAR(r.probs[0], s[2], 1e-7);
    EXPECT_NEAR(r.probs[1], s[3], 1e-7);
    // Sigmoid, k = 2: normalised over the two; k = 1: the sigmoid itself. Scaling factor multiplies.
    moe.pre_softmax    = false;
    moe.score_function = MoeScoreFunction::sigmoid;
    r                  = route(moe, logits);
    const double g2 = 1.0 / (1.0 + std::exp(-2.0)), g3 = 1.0 / (1.0 + std::exp(-1.0));
    EXPECT_NEAR(r.probs[0], g2 / (g2 + g3), 1e-7);
    moe.topk                = 1;
    moe.topk_scaling_factor = 2.5f;
    r                       = route(moe, logits);
    EXPECT_NEAR(r.probs[0], 2.5 * g2, 1e-6);
}

// Group-limited routing, hand-worked. E = 8 in 4 groups of 2, k = 4, 2 groups kept (by the sum of each
// group's k / 2 = 2 largest logits):
//   row 0: logits 5 -5 | 3 3.5 | 1 0.5 | 4.5 -9: sums 0, 6.5, 1.5, -4.5 keep groups 1 and 2, so experts
//          3, 2, 4, 5 (without groups: 0, 6, 3, 2); post-softmax over their logits 3.5 3 1 0.5
//   row 1: all equal: every sum ties, the lower groups 0 and 1 stay, experts 0 1 2 3
TEST(Router, GroupLimitedRoutingSelectsAmongTheBestGroupsExperts) {
    const std::vector<float> logits = {5, -5, 3, 3.5f, 1, 0.5f, 4.5f, -9,  0, 0, 0, 0, 0, 0, 0, 0};
    MoeConfig                moe;
    moe.num_experts = 8;
    moe.topk        = 4;
    RouterRun plain = route(moe, logits);
    EXPECT_EQ(std::vector<int32_t>(plain.top_idx.begin(), plain.top_idx.begin() + 4), (std::vector<int32_t>{0, 6, 3, 2}));
    moe.num_groups  = 4;
    moe.group_topk  = 2;
    RouterRun r     = route(moe, logits);
    EXPECT_EQ(r.top_idx, (std::vector<int32_t>{3, 2, 4, 5, 0, 1, 2, 3}));
    const double e[] = {std::exp(0.0), std::exp(-0.5), std::exp(-2.5), std::exp(-3.0)};
    for (int j = 0; j < 4; ++j) EXPECT_NEAR(r.probs[j], e[j] / (e[0] + e[1] + e[2] + e[3]), 1e-7) << "slot " << j;
    // Megatron's rules, by name; and Loom's: the k experts must fit in the kept groups.
    moe.num_groups = 3;
    EXPECT_THROW(moe_config_validate(moe, small_config(false, false)), Error);
    moe.num_groups = 4;
    moe.group_topk = 1;
    EXPECT_THROW(moe_config_validate(moe, small_config(false, false)), Error);   // 4 experts from one group of 2
}

// Aux-loss-free balancing: the bias joins the sigmoid scores for the selection only. Logits 2 1 0 -1 give
// g = 0.881 0.731 0.5 0.269; a bias of 3 on expert 3 selects it first, and the probabilities are still
// g's, normalised over the two selected: g3 / (g3 + g0), g0 / (g3 + g0).
TEST(Router, ExpertBiasSteersTheSelectionButNotTheProbabilities) {
    MoeConfig moe;
    moe.num_experts    = 4;
    moe.topk           = 2;
    moe.score_function = MoeScoreFunction::sigmoid;
    moe.expert_bias    = true;
    Router          router("router", small_config(false, false), moe, dev());
    const float     bias[] = {0, 0, 0, 3};
    std::memcpy(router.expert_bias.data_ptr(), bias, sizeof(bias));
    Router::Context ctx;
    router.route(ctx, tensor_of(std::vector<float>{2, 1, 0, -1}, {1, 4}), 1);
    EXPECT_EQ(values<int32_t>(ctx.top_idx), (std::vector<int32_t>{3, 0}));
    const double g0 = 1 / (1 + std::exp(-2.0)), g3 = 1 / (1 + std::exp(1.0));
    const std::vector<float> probs = values<float>(ctx.probs);
    EXPECT_NEAR(probs[0], g3 / (g3 + g0), 1e-7);
    EXPECT_NEAR(probs[1], g0 / (g3 + g0), 1e-7);
    moe.score_function = MoeScoreFunction::softmax;   // Megatron's rule
    EXPECT_THROW(moe_config_validate(moe, small_config(false, false)), Error);
}

// Megatron's get_updated_expert_bias by hand: loads 3 1 0 4 (mean 2) move the biases by -r +r +r -r; a
// balanced row does not move; the loads are cleared. Counting adds a dispatch plan's i64 counts.
TEST(Router, ExpertBiasMovesByTheRateTowardTheUnderloadedExperts) {
    Tensor load = tensor_of(std::vector<float>{3, 1, 0, 4, 2, 2, 2, 2}, {2, 4});
    Tensor bias = tensor_of(std::vector<float>{0, 0, 0, 0, 0.25f, 0, 0, 0}, {2, 4});
    dev().ops().moe_count_tokens(dev().compute_stream(), tensor_of(std::vector<int64_t>{1, 0, 0, 1}, {4}), load.narrow(0, 1, 1).view({4}));
    dev().ops().moe_expert_bias_update(dev().compute_stream(), load, bias, 0.5f);
    // Row 1 became 3 2 2 3 (mean 2.5): -r +r +r -r.
    EXPECT_EQ(values<float>(bias), (std::vector<float>{-0.5f, 0.5f, 0.5f, -0.5f, -0.25f, 0.5f, 0.5f, -0.5f}));
    EXPECT_EQ(values<float>(load), std::vector<float>(8, 0.0f));
    Tensor even = tensor_of(std::vector<float>{2, 2, 2, 2}, {1, 4}), still = tensor_of(std::vector<float>{1, 2, 3, 4}, {1, 4});
    dev().ops().moe_expert_bias_update(dev().compute_stream(), even, still, 0.5f);
    EXPECT_EQ(values<float>(still), (std::vector<float>{1, 2, 3, 4})) << "sign(0) is 0";
}

TEST(Router, AuxLossIsTheSwitchFormulaAndTheCoefficientWhenBalanced) {
    const int64_t n = 12, E = 4, k = 2;
    MoeConfig     moe;
    moe.num_experts    = E;
    moe.topk           = k;
    moe.aux_loss_coeff = 0.01f;
    moe.z_loss_coeff   = 0.001f;
    auto logits        = random_vector(n * E, 21, 2.0f);
    RouterRun r        = route(moe, logits);
    // aux = E coeff / (k T^2) sum_i (sum_x p_xi) c_i, p the softmax over all E, c from its top-k.
    std::vector<double> P(E, 0.0), c(E, 0.0);
    double              z = 0;
    for (int64_t x = 0; x < n; ++x) {
        auto p = softmax(&logits[x * E], E);
        std::vector<int64_t> order = {0, 1, 2, 3};
        std::stable_sort(order.begin(), order.end(), [&](int64_t a, int64_t b) { return p[a] > p[b]; });
        for (int64_t e = 0; e < E; ++e) P[e] += p[e];
        for (int64_t j = 0; j < k; ++j) c[order[j]] += 1;
        double m = *std::max_element(&logits[x * E], &logits[x * E] + E), sum = 0;
        for (int64_t e = 0; e < E; ++e) sum += std::exp(logits[x * E + e] - m);
        z += std::pow(m + std::log(sum), 2);
    }
    double aux = 0;
    for (int64_t e = 0; e < E; ++e) aux += P[e] * c[e];
    aux *= E * double(moe.aux_loss_coeff) / (k * double(n) * n);
    EXPECT_NEAR(r.losses[router_loss_aux], aux, 1e-7 * aux);
    EXPECT_NEAR(r.losses[router_loss_aux_logged], aux / moe.aux_loss_coeff, 1e-6);
    EXPECT_NEAR(r.losses[router_loss_z], double(moe.z_loss_coeff) * z / n, 1e-7 * z);
    EXPECT_NEAR(r.losses[router_loss_z_logged], z / n, 1e-6 * z);

    // Balanced: token t prefers experts t and t + 1 (mod 4), so every expert gets T k / E = 2 tokens.
    std::vector<float> balanced(4 * E, 0.0f);
    for (int64_t t = 0; t < 4; ++t) {
        balanced[t * E + t]           = 2.0f;
        balanced[t * E + (t + 1) % E] = 1.5f;
    }
    r = route(moe, balanced);
    EXPECT_NEAR(r.losses[router_loss_aux], moe.aux_loss_coeff, 1e-9);
    EXPECT_NEAR(r.losses[router_loss_aux_logged], 1.0, 1e-6);

    // seq_aux_loss: the aux loss of each sample's s tokens (rows r with r % b == j), averaged over b.
    moe.load_balancing = MoeLoadBalancing::seq_aux_loss;
    const int64_t b = 3, s = n / b;
    r               = route(moe, logits, b);
    double seq      = 0;
    for (int64_t j = 0; j < b; ++j) {
        std::vector<float> rows;
        for (int64_t si = 0; si < s; ++si) rows.insert(rows.end(), &logits[(si * b + j) * E], &logits[(si * b + j) * E] + E);
        MoeConfig one      = moe;
        one.load_balancing = MoeLoadBalancing::aux_loss;
        seq += route(one, rows).losses[router_loss_aux];
    }
    EXPECT_NEAR(r.losses[router_loss_aux], seq / b, 1e-6 * seq);

    // Evaluation computes neither loss.
    GptConfig       config = small_config(false, false);
    Router          router("router", config, moe, dev());
    Router::Context ctx;
    router.route(ctx, tensor_of(logits, {n, E}), b, /*training=*/false);
    EXPECT_EQ(values<float>(ctx.losses), (std::vector<float>{0, 0, 0, 0}));
}

// global_aux_loss: the counts the loss reads are the running mean of the iteration's micro-batches' counts
// (one rank: no other ranks to sum over), so the second micro-batch's loss is the switch formula over its own
// scores with the mean of both micro-batches' counts; reset_global_counts starts a new iteration, whose
// first micro-batch's loss is plain aux_loss's.
TEST(Router, GlobalAuxLossReadsTheMeanCountsOfTheIterationsMicroBatches) {
    const int64_t n = 12, E = 4, k = 2;
    MoeConfig     moe;
    moe.num_experts    = E;
    moe.topk           = k;
    moe.aux_loss_coeff = 0.01f;
    const std::vector<float> first = random_vector(n * E, 31, 2.0f), second = random_vector(n * E, 32, 2.0f);
    MoeConfig global      = moe;
    global.load_balancing = MoeLoadBalancing::global_aux_loss;
    GptConfig       config = small_config(false, false);
    Router          router("router", config, global, dev());
    Router::Context a, b;
    router.route(a, tensor_of(first, {n, E}), 1);
    router.route(b, tensor_of(second, {n, E}), 1);
    // Each micro-batch's own counts (aux_loss's), and its score sums.
    auto counts_of = [&](const std::vector<float> & logits) {
        std::vector<double> c(E, 0.0);
        for (int64_t x = 0; x < n; ++x) {
            auto p = softmax(&logits[x * E], E);
            std::vector<int64_t> order = {0, 1, 2, 3};
            std::stable_sort(order.begin(), order.end(), [&](int64_t u, int64_t v) { return p[u] > p[v]; });
            for (int64_t j = 0; j < k; ++j) c[order[j]] += 1;
        }
        return c;
    };
    const std::vector<double> c1 = counts_of(first), c2 = counts_of(second);
    const std::vector<float>  mean = values<float>(b.counts);
    double                    P_dot_c = 0;
    std::vector<double>       P(E, 0.0);
    for (int64_t x = 0; x < n; ++x) {
        auto p = softmax(&second[x * E], E);
        for (int64_t e = 0; e < E; ++e) P[e] += p[e];
    }
    for (int64_t e = 0; e < E; ++e) {
        EXPECT_EQ(mean[e], static_cast<float>((c1[e] + c2[e]) / 2)) << "expert " << e;
        P_dot_c += P[e] * (c1[e] + c2[e]) / 2;
    }
    const double aux = E * double(moe.aux_loss_coeff) / (k * double(n) * n) * P_dot_c;
    const std::vector<float> losses = values<float>(b.losses);
    EXPECT_NEAR(losses[router_loss_aux], aux, 1e-6 * aux);
    EXPECT_NEAR(losses[router_loss_aux_logged], aux / moe.aux_loss_coeff, 1e-5);
    EXPECT_EQ(values<float>(a.losses)[router_loss_aux], route(moe, first).losses[router_loss_aux])
        << "the first micro-batch: its own counts, as aux_loss";
    router.reset_global_counts();
    Router::Context again;
    router.route(again, tensor_of(second, {n, E}), 1);
    EXPECT_EQ(values<float>(again.losses)[router_loss_aux], route(moe, second).losses[router_loss_aux])
        << "a new iteration starts the mean again";
}

TEST(Router, GradientsMatchFiniteDifferences) {
    const int64_t n = 8, b = 2, h = 6, E = 4;
    struct Case { const char * name; MoeScoreFunction f; bool pre; int64_t k; MoeLoadBalancing lb; float sf; bool bias; };
    const Case cases[] = {
        {"softmax k2", MoeScoreFunction::softmax, false, 2, MoeLoadBalancing::aux_loss, 0.0f, true},
        {"pre-softmax k2", MoeScoreFunction::softmax, true, 2, MoeLoadBalancing::seq_aux_loss, 0.0f, false},
        {"pre-softmax k1", MoeScoreFunction::softmax, true, 1, MoeLoadBalancing::aux_loss, 2.0f, false},
        {"sigmoid k2", MoeScoreFunction::sigmoid, false, 2, MoeLoadBalancing::aux_loss, 0.0f, true},
        {"sigmoid k1", MoeScoreFunction::sigmoid, false, 1, MoeLoadBalancing::seq_aux_loss, 0.0f, false},
        {"sinkhorn k1", MoeScoreFunction::softmax, false, 1, MoeLoadBalancing::sinkhorn, 0.0f, true},
        {"sinkhorn k2", MoeScoreFunction::softmax, false, 2, MoeLoadBalancing::sinkhorn, 0.0f, false},
    };
    // Each objective on its own, so a wrong aux or z gradient cannot hide under the others' size.
    struct Objective { const char * name; float w, aux, z; };
    const Objective objectives[] = {{"probs", 1.0f, 0.0f, 0.0f}, {"aux", 0.0f, 10.0f, 0.0f}, {"z", 0.0f, 0.0f, 1.0f}};
    for (const Case & c : cases) {
        for (const Objective & o : objectives) {
            if (c.lb == MoeLoadBalancing::sinkhorn && o.aux > 0.0f) continue;   // sinkhorn has no aux loss
            MoeConfig moe;
            moe.num_experts         = E;
            moe.topk                = c.k;
            moe.score_function      = c.f;
            moe.pre_softmax         = c.pre;
            moe.load_balancing      = c.lb;
            moe.topk_scaling_factor = c.sf;
            moe.aux_loss_coeff      = o.aux;
            moe.z_loss_coeff        = o.z;
            GptConfig config        = small_config(false, c.bias);
            config.hidden_size      = h;
            Router router("router", config, moe, dev());
            router.init(5, 1.0f);
            std::vector<Parameter *> params;
            router.parameters(params);
            auto         xv = random_vector(n * h, 31);
            Tensor       x  = tensor_of(xv, {n, h});
            auto         wv = random_vector(n * c.k, 32);
            for (auto & v : wv) v *= o.w;
            auto objective = [&] {
                Router::Context ctx;
                router.forward(ctx, x, b);
                wait_compute();
                const float * loss = ctx.losses.data<float>();
                return Probe{dot(wv, ctx.probs) + loss[router_loss_aux] + loss[router_loss_z], values<int32_t>(ctx.top_idx)};
            };
            zero_grads(params);
            Router::Context ctx;
            router.forward(ctx, x, b);
            int    reported = 0;
            Tensor dx       = router.backward(ctx, tensor_of(wv, {n, c.k}), 1.0f, [&](Parameter &) { ++reported; });
            auto   dxv      = values<float>(dx);
            EXPECT_EQ(reported, static_cast<int>(params.size()));
            const std::string what = std::string(c.name) + ", " + o.name + ": ";
            check_gradient(what + "dx", xv.data(), n * h, dxv.data(), [&] {
                std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
                return objective();
            }, 48);
            std::memcpy(x.data<float>(), xv.data(), xv.size() * sizeof(float));
            for (Parameter * p : params) {
                auto grad = values<float>(p->main_grad);
                check_gradient(what + p->name, p->data.data<float>(), p->numel(), grad.data(), objective, 24);
            }
        }
    }
}

// Sinkhorn routing against a reference written here from its definition (Megatron's moe_utils.sinkhorn
// and sinkhorn_load_balancing), on random logits: the same experts, and the probabilities sigmoid(logit)
// for k = 1 or the softmax over all E for k = 2. On logits that all prefer expert 0, plain top-1 sends it
// every token while sinkhorn spreads them (each expert gets between half and twice its share).
TEST(Router, SinkhornSelectsAsItsDefinitionAndBalancesTheExperts) {
    const int64_t n = 32, E = 4;
    for (const int64_t k : {int64_t(1), int64_t(2)}) {
        SCOPED_TRACE("k = " + std::to_string(k));
        std::vector<float> logits = random_vector(n * E, 41 + k);
        for (int64_t x = 0; x < n; ++x) logits[x * E] += 2.0f;   // expert 0 first for nearly every token
        // The reference: d0, d1 from ones, alternating, until the mean change of d1 is at most 1e-4.
        std::vector<double> C(n * E), d0(n, 1.0), d1(E, 1.0);
        for (int64_t i = 0; i < n * E; ++i) C[i] = std::exp(static_cast<double>(logits[i]));
        for (double error = 1e9; error > 1e-4;) {
            for (int64_t x = 0; x < n; ++x) {
                double sum = 0;
                for (int64_t e = 0; e < E; ++e) sum += d1[e] * C[x * E + e];
                d0[x] = 1.0 / n / (sum + 1e-8);
            }
            std::vector<double> next(E);
            error = 0;
            for (int64_t e = 0; e < E; ++e) {
                double sum = 0;
                for (int64_t x = 0; x < n; ++x) sum += d0[x] * C[x * E + e];
                next[e] = 1.0 / E / (sum + 1e-8);
                error += std::abs(next[e] - d1[e]) / E;
            }
            d1 = next;
        }
        MoeConfig moe;
        moe.num_experts    = E;
        moe.topk           = k;
        moe.load_balancing = MoeLoadBalancing::sinkhorn;
        RouterRun             r = route(moe, logits);
        std::vector<int64_t>  load(E, 0);
        for (int64_t x = 0; x < n; ++x) {
            std::vector<int32_t> order(E);
            std::iota(order.begin(), order.end(), 0);
            std::stable_sort(order.begin(), order.end(), [&](int32_t a, int32_t b) {
                return d0[x] * C[x * E + a] * d1[a] > d0[x] * C[x * E + b] * d1[b];
            });
            const std::vector<double> s = softmax(&logits[x * E], E);
            for (int64_t j = 0; j < k; ++j) {
                ASSERT_EQ(r.top_idx[x * k + j], order[j]) << "token " << x << " slot " << j;
                const float  l    = logits[x * E + order[j]];
                const double prob = k == 1 ? 1.0 / (1.0 + std::exp(-static_cast<double>(l))) : s[order[j]];
                EXPECT_NEAR(r.probs[x * k + j], prob, 1e-6) << "token " << x << " slot " << j;
                ++load[order[j]];
            }
        }
        for (int64_t e = 0; e < E; ++e) {
            EXPECT_GE(load[e], n * k / E / 2) << "expert " << e;
            EXPECT_LE(load[e], 2 * n * k / E) << "expert " << e;
        }
        // Plain top-k of the same logits piles onto expert 0; evaluation (no sinkhorn) does too.
        MoeConfig plain  = moe;
        plain.load_balancing = MoeLoadBalancing::none;
        plain.pre_softmax    = true;
        int64_t on_zero = 0;
        for (int32_t i : route(plain, logits).top_idx) on_zero += i == 0;
        EXPECT_GT(on_zero, n * 3 / 4) << "the logits do prefer expert 0";
        EXPECT_LT(load[0], on_zero);
    }
}

// --moe-router-dtype fp32 under bf16 parameters: the gate reads its input unrounded and its weight widened,
// so its logits are the f32 product (to summation order), not the product of the input rounded to bf16.
TEST(Router, Fp32RouterDtypeComputesTheGateInF32) {
    const int64_t n = 16, h = 8, E = 4;
    GptConfig     config = small_config(false, false);
    config.params_dtype  = DType::bf16;
    MoeConfig moe;
    moe.num_experts = E;
    moe.topk        = 2;
    std::vector<float> xv = random_vector(n * h, 51);
    Tensor             x  = tensor_of(xv, {n, h});
    auto logits_of = [&](bool f32) {
        MoeConfig m  = moe;
        if (f32) m.router_dtype = DType::f32;
        Router router("router", config, m, dev());
        router.init(7, 1.0f);
        Router::Context ctx;
        router.forward(ctx, x, 1);
        std::vector<float> w = values<float>(parameter_f32(router.weight));
        return std::pair{values<float>(ctx.logits), w};
    };
    const auto [f32_logits, w] = logits_of(true);
    const auto [bf16_logits, w2] = logits_of(false);
    ASSERT_EQ(w, w2);
    double worst_f32 = 0, worst_bf16 = 0;
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t e = 0; e < E; ++e) {
            double exact = 0;
            for (int64_t i = 0; i < h; ++i) exact += static_cast<double>(xv[r * h + i]) * w[e * h + i];
            worst_f32  = std::max(worst_f32, std::abs(f32_logits[r * E + e] - exact));
            worst_bf16 = std::max(worst_bf16, std::abs(bf16_logits[r * E + e] - exact));
        }
    }
    EXPECT_LT(worst_f32, 1e-5) << "f32 operands";
    EXPECT_GT(worst_bf16, 1e-3) << "without the flag the input is rounded to bf16 (8 bits of mantissa)";
}

// --moe-router-dtype fp64: the gate's GEMM in f64 gives f64 logits, each the double sum of the products of
// the f32 input and the bf16 weight widened (exact products, so the in-order sum is the reference's bits
// whatever the compiler fuses) plus the bias, and the logits' gradient flows back as f64, rounded once to f32
// for dx, the weight's and the bias's gradients: within 1e-6 of the fp32 router's (the same math; routing
// identical here).
TEST(Router, Fp64RouterDtypeComputesTheGateAndItsGradientsInF64) {
    const int64_t n = 16, h = 8, E = 4;
    GptConfig     config = small_config(false, false);
    config.params_dtype  = DType::bf16;
    config.add_bias_linear = true;
    MoeConfig moe;
    moe.num_experts    = E;
    moe.topk           = 2;
    moe.aux_loss_coeff = 0.01f;
    moe.z_loss_coeff   = 0.001f;
    std::vector<float> xv = random_vector(n * h, 53), dpv = random_vector(n * moe.topk, 54);
    Tensor             x = tensor_of(xv, {n, h}), dprobs = tensor_of(dpv, {n, moe.topk});
    struct Run {
        Router::Context     ctx;
        std::vector<float>  w, b, dx, dw, db;
        std::vector<int32_t> top_idx;
    };
    auto run = [&](DType dtype) {
        MoeConfig m    = moe;
        m.router_dtype = dtype;
        Router router("router", config, m, dev());
        router.init(7, 1.0f);
        Run r;
        router.forward(r.ctx, x, 1);
        r.w       = values<float>(parameter_f32(router.weight));
        r.b       = values<float>(parameter_f32(router.bias));
        r.top_idx = values<int32_t>(r.ctx.top_idx);
        Router::Context kept = r.ctx;
        Tensor          dx   = router.backward(r.ctx, dprobs, 1.0f, nullptr);
        r.ctx                = kept;
        r.dx                 = values<float>(dx);
        r.dw                 = values<float>(router.weight.main_grad);
        r.db                 = values<float>(router.bias.main_grad);
        return r;
    };
    const Run f64 = run(DType::f64), f32 = run(DType::f32);
    ASSERT_EQ(f64.ctx.logits.dtype(), DType::f64);
    ASSERT_EQ(f64.w, f32.w);
    const std::vector<double> logits = values<double>(f64.ctx.logits);
    for (int64_t r = 0; r < n; ++r) {
        for (int64_t e = 0; e < E; ++e) {
            double exact = 0;
            for (int64_t i = 0; i < h; ++i) exact += static_cast<double>(xv[r * h + i]) * static_cast<double>(f64.w[e * h + i]);
            ASSERT_EQ(logits[r * E + e], exact + static_cast<double>(f64.b[e])) << "row " << r << ", expert " << e;
        }
    }
    ASSERT_EQ(f64.top_idx, f32.top_idx);
    auto close = [](const std::vector<float> & a, const std::vector<float> & b, const char * what) {
        ASSERT_EQ(a.size(), b.size());
        for (size_t i = 0; i < a.size(); ++i) {
            EXPECT_NEAR(a[i], b[i], 1e-6 * std::max(1.0f, std::fabs(b[i]))) << what << " " << i;
        }
    };
    close(f64.dx, f32.dx, "dx");
    close(f64.dw, f32.dw, "weight gradient");
    close(f64.db, f32.db, "bias gradient");
}

// What fp64 is for: logits closer than an f32 ulp still order the experts. 1 and 1 + 2^-30 are one f32
// value (a tie, which goes to the lower expert), two f64 values (expert 1 wins); and f64 logits that hold
// f32 values route, weigh and count exactly as the f32 logits do.
TEST(Router, Fp64LogitsOrderExpertsF32CannotTellApart) {
    const int64_t E = 4;
    MoeConfig     moe;
    moe.num_experts = E;
    moe.topk        = 1;
    moe.pre_softmax = true;
    GptConfig config = small_config(false, false);
    auto top1 = [&](const Tensor & logits) {
        Router          router("router", config, moe, dev());
        Router::Context ctx;
        router.route(ctx, logits, 1);
        return std::pair{values<int32_t>(ctx.top_idx), values<float>(ctx.probs)};
    };
    const std::vector<double> close_pair = {1.0, 1.0 + 0x1p-30, -1.0, -2.0};
    std::vector<float>        as_f32(close_pair.begin(), close_pair.end());
    EXPECT_EQ(top1(tensor_of(close_pair, {1, E})).first[0], 1) << "f64 logits tell 1 + 2^-30 from 1";
    EXPECT_EQ(top1(tensor_of(as_f32, {1, E})).first[0], 0) << "in f32 they tie, and the tie goes to expert 0";

    moe.topk           = 2;
    moe.pre_softmax    = false;
    moe.aux_loss_coeff = 0.01f;
    moe.z_loss_coeff   = 0.001f;
    const int64_t      n = 24;
    std::vector<float> lv = random_vector(n * E, 55);
    for (float & v : lv) v *= 3.0f;
    std::vector<double> widened(lv.begin(), lv.end());
    Router          a("router", config, moe, dev()), b("router", config, moe, dev());
    Router::Context ca, cb;
    a.route(ca, tensor_of(lv, {n, E}), 1);
    b.route(cb, tensor_of(widened, {n, E}), 1);
    EXPECT_EQ(values<int32_t>(ca.top_idx), values<int32_t>(cb.top_idx));
    EXPECT_EQ(values<float>(ca.probs), values<float>(cb.probs));
    EXPECT_EQ(values<float>(ca.counts), values<float>(cb.counts));
    EXPECT_EQ(values<float>(ca.losses), values<float>(cb.losses));
    std::vector<float> dpv = random_vector(n * moe.topk, 56);
    const std::vector<float>  d32 = values<float>(a.logits_backward(ca, tensor_of(dpv, {n, moe.topk}), 0.5f));
    const std::vector<double> d64 = values<double>(b.logits_backward(cb, tensor_of(dpv, {n, moe.topk}), 0.5f));
    for (size_t i = 0; i < d32.size(); ++i) EXPECT_EQ(d32[i], static_cast<float>(d64[i])) << "dlogits " << i;
}

// ---------------------------------------------------------------------------------------------------
// Dispatch

namespace {

DispatchPlan plan_for(const std::vector<int32_t> & top_idx, const std::vector<float> & probs, int64_t k,
                      const MoeConfig & moe) {
    const int64_t n = static_cast<int64_t>(top_idx.size()) / k;
    return dispatch_plan_create(tensor_of(top_idx, {n, k}), tensor_of(probs, {n, k}), moe);
}

}  // namespace

TEST(Dispatch, UnpermuteOfPermuteIsXForOneExpertAndTwiceXForTwo) {
    const int64_t n = 7, h = 5, E = 3;
    auto          xv = random_vector(n * h, 41);
    Tensor        x  = tensor_of(xv, {n, h});
    MoeConfig     moe;
    moe.num_experts = E;
    {
        DispatchPlan plan   = plan_for({2, 0, 1, 2, 2, 0, 1}, std::vector<float>(n, 1.0f), 1, moe);
        auto         counts = dispatch_plan_counts(plan);
        EXPECT_EQ(counts, (std::vector<int64_t>{2, 2, 3}));
        Tensor xp = moe_permute(x, plan, n);
        // Expert-major, token order inside each expert: tokens 1 5 | 2 6 | 0 3 4.
        auto xpv = values<float>(xp);
        const int order[] = {1, 5, 2, 6, 0, 3, 4};
        for (int64_t r = 0; r < n; ++r) EXPECT_EQ(0, std::memcmp(&xpv[r * h], &xv[order[r] * h], h * sizeof(float)));
        EXPECT_EQ(values<float>(moe_unpermute(xp, plan)), xv);
        EXPECT_EQ(values<float>(moe_permute_backward(xp, plan)), xv);
    }
    {
        DispatchPlan plan = plan_for({2, 0, 0, 1, 1, 2, 0, 2, 2, 1, 0, 1, 1, 0}, std::vector<float>(2 * n, 1.0f), 2, moe);
        auto         counts = dispatch_plan_counts(plan);
        Tensor       xp     = moe_permute(x, plan, 2 * n);
        auto         twice  = xv;
        for (auto & v : twice) v *= 2.0f;
        EXPECT_EQ(values<float>(moe_unpermute(xp, plan)), twice);
        EXPECT_EQ(values<float>(moe_permute_backward(xp, plan)), twice);
    }
}

TEST(Dispatch, DroppingKeepsTheHighestProbsOrTheEarliestTokensAndPads) {
    // The worked example of token_dispatcher.h: C = ceil(4 * 1 / 2 * 1.0) = 2, expert 1 gets 3 tokens.
    const std::vector<int32_t> top_idx = {1, 0, 1, 1};
    const std::vector<float>   probs   = {0.5f, 0.9f, 0.7f, 0.6f};
    MoeConfig                  moe;
    moe.num_experts     = 2;
    moe.capacity_factor = 1.0f;
    DispatchPlan plan   = plan_for(top_idx, probs, 1, moe);
    EXPECT_EQ(plan.capacity, 2);
    EXPECT_EQ(dispatch_plan_counts(plan), (std::vector<int64_t>{1, 2}));
    EXPECT_EQ(values<int32_t>(plan.row_of), (std::vector<int32_t>{-1, 0, 1, 2}));   // token 0 (0.5) dropped
    EXPECT_EQ(values<float>(plan.probs), (std::vector<float>{0.0f, 0.9f, 0.7f, 0.6f}));

    moe.drop_policy = MoeDropPolicy::position;
    plan            = plan_for(top_idx, probs, 1, moe);
    EXPECT_EQ(values<int32_t>(plan.row_of), (std::vector<int32_t>{1, 0, 2, -1}));   // token 3 (the last) dropped
    EXPECT_EQ(values<int32_t>(plan.token_of_row), (std::vector<int32_t>{1, 0, 2, -1}));

    // Padded: two rows per expert whatever the routing; expert 0's second row is a zero row.
    moe.drop_policy     = MoeDropPolicy::probs;
    moe.pad_to_capacity = true;
    plan                = plan_for(top_idx, probs, 1, moe);
    EXPECT_EQ(dispatch_plan_counts(plan), (std::vector<int64_t>{2, 2}));
    EXPECT_EQ(values<int32_t>(plan.row_of), (std::vector<int32_t>{-1, 0, 2, 3}));
    EXPECT_EQ(values<int32_t>(plan.token_of_row), (std::vector<int32_t>{1, -1, 2, 3}));
    const int64_t h  = 3;
    auto          xv = random_vector(4 * h, 42);
    Tensor        xp = moe_permute(tensor_of(xv, {4, h}), plan, 4);
    auto          xpv = values<float>(xp);
    EXPECT_EQ(std::vector<float>(xpv.begin() + h, xpv.begin() + 2 * h), std::vector<float>(h, 0.0f));
    // A dropped token gets nothing back and passes no gradient; its probability's gradient is 0.
    Tensor y = moe_unpermute(xp, plan);
    auto   yv = values<float>(y);
    EXPECT_EQ(std::vector<float>(yv.begin(), yv.begin() + h), std::vector<float>(h, 0.0f));
    Tensor dyp, dprobs;
    moe_unpermute_backward(tensor_of(std::vector<float>(4 * h, 1.0f), {4, h}), xp, plan, dyp, dprobs);
    EXPECT_EQ(values<float>(dprobs)[0], 0.0f);
    auto dyv = values<float>(dyp);
    EXPECT_EQ(std::vector<float>(dyv.begin() + h, dyv.begin() + 2 * h), std::vector<float>(h, 0.0f));
    auto dxv = values<float>(moe_permute_backward(dyp, plan));
    EXPECT_EQ(std::vector<float>(dxv.begin(), dxv.begin() + h), std::vector<float>(h, 0.0f));

    // A capacity above the tokens pads with zero rows only: C = ceil(4 * 1 / 2 * 2.5) = 5.
    moe.capacity_factor = 2.5f;
    plan                = plan_for(top_idx, probs, 1, moe);
    EXPECT_EQ(dispatch_plan_counts(plan), (std::vector<int64_t>{5, 5}));
    EXPECT_EQ(values<int32_t>(plan.row_of), (std::vector<int32_t>{5, 0, 6, 7}));
}

// ---------------------------------------------------------------------------------------------------
// Experts and the layer

namespace {

struct LayerRun {
    std::vector<float>              y, dx, losses;
    std::vector<std::vector<float>> grads;   // in parameters() order
    std::vector<std::string>        ready;
};

LayerRun run_layer(MoELayer & layer, const std::vector<float> & xv, const std::vector<float> & wv, int64_t s, int64_t b) {
    const int64_t            h = xv.size() / (s * b);
    std::vector<Parameter *> params;
    layer.parameters(params);
    zero_grads(params);
    MoELayer::Context ctx;
    LayerRun          run;
    Tensor            y = layer.forward(ctx, tensor_of(xv, {s * b, h}), s, b);
    run.y               = values<float>(y);
    run.losses          = values<float>(ctx.router.losses);
    Tensor dx = layer.backward(ctx, tensor_of(wv, {s * b, h}), [&](Parameter & p) { run.ready.push_back(p.name); });
    run.dx    = values<float>(dx);
    for (Parameter * p : params) run.grads.push_back(values<float>(p->main_grad));
    return run;
}

}  // namespace

TEST(Experts, GroupedGemmIsBitwiseTheSequentialLoop) {
    const int64_t s = 5, b = 2, E = 6;
    // SwiGLU / GELU x no bias / biases; 2 and 3 padded to a capacity below the busiest expert's load;
    // 4 and 5 with bf16 parameters (GEMM operands and saved activations in bf16); 6 and 7 squared ReLU
    // (--squared-relu), 6 with biases, 7 in bf16; 8 (SwiGLU) and 9 (GELU, biases) with FP8 GEMMs (--fp8-format
    // hybrid: each expert's rows and weight cast by their own scales, docs/fp8.md), where the loop's experts are
    // MLPs of FP8 Linears (the cast rule test_model_grad checks).
    for (int variant = 0; variant < 10; ++variant) {
        const bool fp8 = variant >= 8;
        GptConfig config = small_config(/*swiglu=*/(variant % 2 == 0 && variant < 6) || variant == 8,
                                        /*bias=*/variant == 1 || variant == 2 || variant == 6 || variant == 9);
        if (variant == 4 || variant == 5 || variant == 7 || fp8) config.params_dtype = DType::bf16;
        config.squared_relu = variant == 6 || variant == 7;
        MoeConfig moe;
        moe.num_experts = E;   // 10 tokens x 2 over 6 experts: some may get none
        moe.topk        = 2;
        if (variant == 2 || variant == 3) {
            moe.capacity_factor = 0.5f;
            moe.pad_to_capacity = true;
        }
        MoELayer loop("mlp", config, moe, dev());
        moe.grouped_gemm = true;
        MoELayer grouped("mlp", config, moe, dev());
        loop.init(3, 0.5f, 0.3f);
        grouped.init(3, 0.5f, 0.3f);
        if (fp8) {
            const model::Linear::Fp8 formats{Fp8Format::e4m3, Fp8Format::e5m2};
            loop.set_fp8(formats);
            grouped.set_fp8(formats);
            ASSERT_TRUE(loop.experts.local[0]->fc1.fp8 && grouped.experts.fp8);
        }
        // The same seed gives the same values in both layouts (the grouped slices draw under the loop's names).
        const int64_t f1 = config.swiglu ? 2 * config.ffn_hidden_size : config.ffn_hidden_size;
        const size_t  bytes = f1 * config.hidden_size * dtype_size(config.params_dtype);
        for (int64_t e = 0; e < E; ++e) {
            EXPECT_EQ(0, std::memcmp(loop.experts.local[e]->fc1.weight.data.data_ptr(),
                                     static_cast<const char *>(grouped.experts.fc1_weight.data.data_ptr()) + e * bytes, bytes));
        }
        if (config.add_bias_linear) {
            std::vector<Parameter *> lp, gp;
            loop.parameters(lp);
            grouped.parameters(gp);
            randomise_biases(lp, 7);
            // The same bias values in the grouped layout: expert e's row e.
            const size_t bias_bytes = dtype_size(loop.experts.local[0]->fc1.bias.data.dtype());   // the params' dtype
            for (int64_t e = 0; e < E; ++e) {
                std::memcpy(static_cast<char *>(grouped.experts.fc1_bias.data.data_ptr()) + e * f1 * bias_bytes,
                            loop.experts.local[e]->fc1.bias.data.data_ptr(), f1 * bias_bytes);
                std::memcpy(static_cast<char *>(grouped.experts.fc2_bias.data.data_ptr()) + e * config.hidden_size * bias_bytes,
                            loop.experts.local[e]->fc2.bias.data.data_ptr(), config.hidden_size * bias_bytes);
            }
            std::memcpy(grouped.router.bias.data.data_ptr(), loop.router.bias.data.data_ptr(),
                        E * dtype_size(loop.router.bias.data.dtype()));
        }
        auto     xv = random_vector(s * b * config.hidden_size, 51);
        auto     wv = random_vector(s * b * config.hidden_size, 52);
        LayerRun a  = run_layer(loop, xv, wv, s, b);
        LayerRun g  = run_layer(grouped, xv, wv, s, b);
        const std::string what = "variant " + std::to_string(variant);
        if (fp8) {
            grouped.experts.fp8.reset();   // the same layer without the casts
            const LayerRun plain = run_layer(grouped, xv, wv, s, b);
            EXPECT_NE(plain.y, g.y) << what << ": the FP8 casts change the output";
            const size_t fc1_weight = config.add_bias_linear ? 2 : 1;   // after the router's parameters
            EXPECT_NE(plain.grads[fc1_weight], g.grads[fc1_weight]) << what << ": and the experts' weight gradients";
        }
        EXPECT_EQ(0, std::memcmp(a.y.data(), g.y.data(), a.y.size() * sizeof(float))) << what << ": y";
        EXPECT_EQ(0, std::memcmp(a.dx.data(), g.dx.data(), a.dx.size() * sizeof(float))) << what << ": dx";
        // Gradients: the router's, then each expert's against its slice of the grouped tensors.
        EXPECT_EQ(a.grads[0], g.grads[0]) << what << ": router weight";
        const int64_t per_expert = config.add_bias_linear ? 4 : 2;
        const int64_t first      = config.add_bias_linear ? 2 : 1;   // after the router's parameters
        for (int64_t kind = 0; kind < per_expert; ++kind) {
            const std::vector<float> & all = g.grads[first + kind];   // fc1.w, (fc1.b), fc2.w, (fc2.b)
            const int64_t              size = all.size() / E;
            for (int64_t e = 0; e < E; ++e) {
                const std::vector<float> & one = a.grads[first + e * per_expert + kind];
                ASSERT_EQ(static_cast<int64_t>(one.size()), size);
                EXPECT_EQ(0, std::memcmp(one.data(), all.data() + e * size, size * sizeof(float)))
                    << what << ": expert " << e << " parameter kind " << kind;
            }
        }
        EXPECT_EQ(a.ready.size(), a.grads.size());
        EXPECT_EQ(g.ready.size(), g.grads.size());
    }
}

TEST(MoELayer, GradientsMatchFiniteDifferences) {
    const int64_t s = 4, b = 2;
    struct Case { const char * name; bool swiglu, bias, grouped; MoeConfig moe; bool squared_relu = false, quick_geglu = false; };
    std::vector<Case> cases;
    {
        MoeConfig m;   // GELU with biases, post-softmax top-2, aux and z losses, no dropping
        m.num_experts = 4, m.topk = 2, m.aux_loss_coeff = 0.5f, m.z_loss_coeff = 0.1f;
        cases.push_back({"gelu bias softmax k2", false, true, false, m});
    }
    {
        MoeConfig m;   // SwiGLU grouped, pre-softmax, dropping by probs padded to capacity, shared expert
        m.num_experts = 4, m.topk = 2, m.pre_softmax = true, m.aux_loss_coeff = 0.5f, m.capacity_factor = 1.0f;
        m.pad_to_capacity = true, m.grouped_gemm = true, m.shared_expert_intermediate_size = 6;
        cases.push_back({"swiglu grouped pre-softmax padded shared", true, false, true, m});
    }
    {
        MoeConfig m;   // sigmoid top-1, seq_aux_loss, dropping by position without padding
        m.num_experts = 3, m.topk = 1, m.score_function = MoeScoreFunction::sigmoid;
        m.load_balancing = MoeLoadBalancing::seq_aux_loss, m.aux_loss_coeff = 0.5f, m.capacity_factor = 1.0f;
        m.drop_policy = MoeDropPolicy::position, m.z_loss_coeff = 0.1f;
        cases.push_back({"sigmoid k1 seq_aux position", false, false, false, m});
    }
    {
        MoeConfig m;   // --squared-relu, grouped with biases; then without, beside a shared expert (the same activation)
        m.num_experts = 4, m.topk = 2, m.aux_loss_coeff = 0.5f, m.grouped_gemm = true;
        cases.push_back({"squared relu grouped bias", false, true, true, m, true});
        m.shared_expert_intermediate_size = 6;
        cases.push_back({"squared relu grouped shared", false, false, true, m, true});
        // gpt-oss's activation: quick-GEGLU with the linear half's offset 1, grouped beside a shared expert, then
        // grouped with biases (the clamp, at 50, holds no value of these; its edges are the op test's).
        cases.push_back({"quick geglu grouped shared", true, false, true, m, false, true});
        m.shared_expert_intermediate_size = 0;
        cases.push_back({"quick geglu grouped bias", true, true, true, m, false, true});
    }
    {
        MoeConfig m;   // Qwen3-Next's shared expert gate: SwiGLU grouped beside a gated shared expert
        m.num_experts = 4, m.topk = 2, m.aux_loss_coeff = 0.5f, m.grouped_gemm = true;
        m.shared_expert_intermediate_size = 6, m.shared_expert_gate = true;
        cases.push_back({"swiglu grouped gated shared", true, false, true, m});
    }
    {
        MoeConfig m;   // DeepSeek-V3's router: sigmoid top-2 with an expert bias, in 2 groups of 2 (group top-1)
        m.num_experts = 4, m.topk = 2, m.score_function = MoeScoreFunction::sigmoid, m.aux_loss_coeff = 0.5f;
        m.expert_bias = true, m.num_groups = 2, m.group_topk = 1;
        cases.push_back({"sigmoid k2 expert bias, group-limited", false, false, false, m});
    }
    for (const Case & c : cases) {
        GptConfig config = small_config(c.swiglu, c.bias);
        config.squared_relu = c.squared_relu;
        if (c.quick_geglu) config.quick_geglu = true, config.glu_linear_offset = 1.0f, config.activation_clamp = 50.0f;
        MoELayer  layer("mlp", config, c.moe, dev());
        layer.init(9, 0.5f, 0.5f);
        if (c.moe.expert_bias) {   // a bias that changes the selection (it selects; the probabilities ignore it)
            const float bias[] = {0.3f, -0.2f, 0.1f, -0.4f};
            std::memcpy(layer.router.expert_bias.data_ptr(), bias, sizeof(bias));
        }
        std::vector<Parameter *> params;
        layer.parameters(params);
        scale_parameters({&layer.router.weight}, 2.0f);   // logits of order 1
        randomise_biases(params, 90);
        const int64_t h  = config.hidden_size;
        auto          xv = random_vector(s * b * h, 61);
        auto          wv = random_vector(s * b * h, 62);
        Tensor        x  = tensor_of(xv, {s * b, h});
        auto objective = [&] {
            MoELayer::Context ctx;
            Tensor            y = layer.forward(ctx, x, s, b);
            wait_compute();
            const float * loss = ctx.router.losses.data<float>();
            Probe         probe{dot(wv, y) + loss[router_loss_aux] + loss[router_loss_z], values<int32_t>(ctx.router.top_idx)};
            auto          rows = values<int32_t>(ctx.plan.row_of);
            probe.routing.insert(probe.routing.end(), rows.begin(), rows.end());
            // The aux loss's counts come from the unbiased top-k: with an expert bias they can change where
            // the routing does not.
            for (float count : values<float>(ctx.router.counts)) probe.routing.push_back(static_cast<int32_t>(count));
            return probe;
        };
        LayerRun run = run_layer(layer, xv, wv, s, b);
        EXPECT_EQ(run.ready.size(), params.size()) << c.name << ": every parameter is reported ready once";
        if (c.quick_geglu) {   // the experts run quick-GEGLU: SwiGLU in their place gives another output
            layer.experts.expert_config.quick_geglu = false;
            EXPECT_NE(run_layer(layer, xv, wv, s, b).y, run.y) << c.name;
            layer.experts.expert_config.quick_geglu = true;
        }
        EXPECT_GT(run.losses[router_loss_aux], 0.0f);
        check_gradient(std::string(c.name) + ": dx", x.data<float>(), s * b * h, run.dx.data(), objective, 64);
        for (size_t i = 0; i < params.size(); ++i) {
            check_gradient(std::string(c.name) + ": " + params[i]->name, params[i]->data.data<float>(), params[i]->numel(),
                           run.grads[i].data(), objective, 12);
        }
    }
}

TEST(MoELayer, CapacityZeroDropsEveryTokenAndLeavesTheSharedExpert) {
    GptConfig config = small_config(false, false);
    MoeConfig moe;
    moe.num_experts     = 4;
    moe.topk            = 2;
    moe.capacity_factor = 0.0f;   // C = 0: every token dropped, the output is the shared expert's alone
    moe.shared_expert_intermediate_size = 6;
    MoELayer layer("mlp", config, moe, dev());
    layer.init(4, 0.5f, 0.5f);
    auto xv = random_vector(8 * config.hidden_size, 71), wv = random_vector(8 * config.hidden_size, 72);
    LayerRun run = run_layer(layer, xv, wv, 4, 2);
    Mlp::Context ctx;
    Tensor shared = layer.shared_expert->forward(ctx, tensor_of(xv, {8, config.hidden_size}));
    EXPECT_EQ(run.y, values<float>(shared));
    std::vector<Parameter *> params;
    layer.parameters(params);
    EXPECT_EQ(run.ready.size(), params.size());
}

TEST(Experts, ExpertsWithoutTokensAddNoGradientAndAreStillReportedReady) {
    // One token, top-2 of 4 experts: two experts get no rows.
    GptConfig config = small_config(true, false);
    MoeConfig moe;
    moe.num_experts = 4;
    moe.topk        = 2;
    for (bool grouped : {false, true}) {
        moe.grouped_gemm = grouped;
        MoELayer layer("mlp", config, moe, dev());
        layer.init(8, 0.5f, 0.5f);
        auto     xv  = random_vector(config.hidden_size, 81), wv = random_vector(config.hidden_size, 82);
        LayerRun run = run_layer(layer, xv, wv, 1, 1);
        std::vector<Parameter *> params;
        layer.parameters(params);
        EXPECT_EQ(run.ready.size(), params.size());
        int64_t zero_experts = 0;
        for (int64_t e = 0; e < 4; ++e) {
            // fc2's weight gradient of expert e: its own tensor, or its slice of the grouped one.
            const std::vector<float> & g = grouped ? run.grads[2] : run.grads[1 + e * 2 + 1];
            const int64_t size = grouped ? g.size() / 4 : g.size(), begin = grouped ? e * size : 0;
            bool all_zero = std::all_of(g.begin() + begin, g.begin() + begin + size, [](float v) { return v == 0.0f; });
            zero_experts += all_zero;
        }
        EXPECT_EQ(zero_experts, 2) << (grouped ? "grouped" : "sequential");
    }
}
