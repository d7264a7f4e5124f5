#include "model/moe/router.h"

#include "core/error.h"
#include "core/ops.h"
#include "core/thread_pool.h"
#include "model/layers.h"

#include <algorithm>
#include <cmath>

namespace loom::model {

namespace {

// The k largest of v[0, E) in descending order, ties toward the lower index.
void topk_desc(const double * v, int64_t E, int64_t k, int32_t * idx) {
    for (int64_t j = 0; j < k; ++j) {
        int64_t best = -1;
        for (int64_t e = 0; e < E; ++e) {
            bool taken = false;
            for (int64_t i = 0; i < j; ++i) taken |= idx[i] == e;
            if (!taken && (best < 0 || v[e] > v[best])) best = e;
        }
        idx[j] = static_cast<int32_t>(best);
    }
}

// s = softmax(l) over E; returns logsumexp(l).
double softmax(const float * l, int64_t E, double * s) {
    double m = l[0];
    for (int64_t e = 1; e < E; ++e) m = std::max(m, static_cast<double>(l[e]));
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (s[e] = std::exp(l[e] - m));
    for (int64_t e = 0; e < E; ++e) s[e] /= sum;
    return m + std::log(sum);
}

double sigmoid(double v) { return 1.0 / (1.0 + std::exp(-v)); }

// The aux loss's scores p over all E (softmax, or sigmoid normalised over E).
void aux_scores(const float * l, int64_t E, MoeScoreFunction f, double * p) {
    if (f == MoeScoreFunction::softmax) {
        softmax(l, E, p);
        return;
    }
    double sum = 0;
    for (int64_t e = 0; e < E; ++e) sum += (p[e] = sigmoid(l[e]));
    for (int64_t e = 0; e < E; ++e) p[e] /= sum + 1e-20;
}

// The routing probabilities of one token's selected experts (before the scaling factor): q (k).
void topk_probs(const float * l, const int32_t * idx, int64_t E, int64_t k, const MoeConfig & moe, double * q,
                double * scratch) {
    if (moe.score_function == MoeScoreFunction::softmax) {
        if (moe.pre_softmax) {
            softmax(l, E, scratch);
            for (int64_t j = 0; j < k; ++j) q[j] = scratch[idx[j]];
        } else {
            double m = l[idx[0]], sum = 0;   // idx[0] holds the largest logit
            for (int64_t j = 0; j < k; ++j) sum += (q[j] = std::exp(l[idx[j]] - m));
            for (int64_t j = 0; j < k; ++j) q[j] /= sum;
        }
    } else {
        double sum = 0;
        for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid(l[idx[j]]));
        if (k > 1) {
            for (int64_t j = 0; j < k; ++j) q[j] /= sum + 1e-20;
        }
    }
}

}  // namespace

Router::Router(const std::string & name, const GptConfig & config, const MoeConfig & m, Device & device,
               const TensorParallel & tensor_parallel)
    : moe(m),
      tp(tensor_parallel),
      weight(parameter_create(name + ".weight", {m.num_experts, config.hidden_size}, config.params_dtype, device)),
      has_bias(config.add_bias_linear) {
    moe_config_validate(moe, config);
    tp.replicated(weight);   // every TP rank routes its own rows with the whole gate
    if (has_bias) {
        bias                 = parameter_create(name + ".bias", {m.num_experts}, config.params_dtype, device);
        bias.no_weight_decay = true;
        tp.replicated(bias);
    }
}

void Router::init(uint64_t seed, float std) {
    // Megatron initialises the gate's weight and its bias with the model's init method.
    parameter_init_normal(weight, seed, std);
    if (has_bias) parameter_init_normal(bias, seed, std);
}

void Router::parameters(std::vector<Parameter *> & out) {
    out.push_back(&weight);
    if (has_bias) out.push_back(&bias);
}

void Router::forward(Context & ctx, const Tensor & x, int64_t b, bool training) {
    Ops &    ops    = x.device().ops();
    Stream & stream = x.device().compute_stream();
    ctx.x           = in_dtype(x, weight.data.dtype());
    Tensor logits   = activation(x.device(), x.size(0), moe.num_experts);
    ops.gemm(stream, ctx.x, false, weight.data, true, logits);
    if (has_bias) ops.bias_add(stream, logits, parameter_f32(bias));
    route(ctx, logits, b, training);
}

void Router::route(Context & ctx, const Tensor & logits, int64_t b, bool training) {
    const int64_t n = logits.size(0), E = moe.num_experts, k = moe.topk;
    LOOM_CHECK(logits.dim() == 2 && logits.size(1) == E && logits.dtype() == DType::f32,
               "router logits " << logits.describe() << ", expected (n, " << E << ") float32", "");
    Device & device = logits.device();
    ctx.aux         = training && moe.aux_loss_coeff > 0.0f && moe.load_balancing != MoeLoadBalancing::none;
    ctx.z           = training && moe.z_loss_coeff > 0.0f;
    ctx.groups      = moe.load_balancing == MoeLoadBalancing::seq_aux_loss ? b : 1;
    LOOM_CHECK(b >= 1 && n % b == 0, n << " router rows are not a multiple of the micro-batch size " << b, "");
    ctx.logits  = logits;
    ctx.top_idx = Tensor::empty({n, k}, DType::i32, device, {MemoryKind::device, kActivationsPool});
    ctx.probs   = activation(device, n, k);
    ctx.counts  = Tensor::empty({ctx.groups, E}, DType::i32, device, {MemoryKind::device, kActivationsPool});
    ctx.losses  = Tensor::empty({router_loss_count}, DType::f32, device, {MemoryKind::device, kActivationsPool});

    const MoeConfig cfg = moe;
    const int64_t   G = ctx.groups;
    const bool      aux = ctx.aux, z = ctx.z;
    Tensor          top_idx = ctx.top_idx, probs = ctx.probs, counts = ctx.counts, losses = ctx.losses;
    auto            P      = std::make_shared<std::vector<double>>(G * E);   // the host's, between the two tasks
    auto            lse_sq = std::make_shared<double>(0.0);
    device.compute_stream().submit([=] {
        const float * l  = logits.data<float>();
        int32_t *     ti = top_idx.data<int32_t>();
        float *       pr = probs.data<float>();
        const double  sf = cfg.topk_scaling_factor > 0.0f ? cfg.topk_scaling_factor : 1.0;
        parallel_for(n, 64, [&](int64_t begin, int64_t end) {
            std::vector<double> score(E), q(k), scratch(E);
            for (int64_t x = begin; x < end; ++x) {
                const float * lx = l + x * E;
                // Selection scores: logits (post-softmax; softmax is monotonic), softmax, or sigmoid.
                for (int64_t e = 0; e < E; ++e) score[e] = lx[e];
                if (cfg.score_function == MoeScoreFunction::softmax && cfg.pre_softmax) softmax(lx, E, score.data());
                if (cfg.score_function == MoeScoreFunction::sigmoid) {
                    for (int64_t e = 0; e < E; ++e) score[e] = sigmoid(lx[e]);
                }
                topk_desc(score.data(), E, k, ti + x * k);
                topk_probs(lx, ti + x * k, E, k, cfg, q.data(), scratch.data());
                for (int64_t j = 0; j < k; ++j) pr[x * k + j] = static_cast<float>(sf * q[j]);
            }
        });

        // Each aux-loss group's counts c_i and score sums P over this rank's tokens, in token order (in
        // double). On the stream, so a captured graph's replay clears them too.
        int32_t * c = counts.data<int32_t>();
        std::fill(c, c + G * E, 0);
        std::fill(P->begin(), P->end(), 0.0);
        *lse_sq = 0.0;
        std::vector<double>  p(E);
        std::vector<int32_t> idx(k);
        for (int64_t x = 0; x < n && (aux || z); ++x) {
            const float * lx = l + x * E;
            if (aux) {
                aux_scores(lx, E, cfg.score_function, p.data());
                topk_desc(p.data(), E, k, idx.data());
                for (int64_t e = 0; e < E; ++e) (*P)[(x % G) * E + e] += p[e];
                for (int64_t j = 0; j < k; ++j) c[(x % G) * E + idx[j]] += 1;
            }
            if (z) {
                const double lse = softmax(lx, E, p.data());
                *lse_sq += lse * lse;
            }
        }
    });
    // Sequence parallelism: the counts over the whole sequence (Megatron reduces them over TP x CP).
    if (ctx.aux && tp.sp()) tp.all_reduce(ctx.counts);

    const int64_t tokens = n * (tp.sp() ? tp.size : 1);   // the sequence's rows over the TP group
    device.compute_stream().submit([=] {
        // This rank's share of the losses: summed over a sequence-parallel group, the shares give the
        // single-rank losses (the counts are the group's, the score sums and lse^2 this rank's).
        const int32_t * c = counts.data<int32_t>();
        double aux_loss = 0;
        if (aux) {
            const double T = static_cast<double>(tokens / G);
            for (int64_t i = 0; i < G * E; ++i) aux_loss += (*P)[i] * c[i];
            aux_loss *= static_cast<double>(E) * cfg.aux_loss_coeff / (static_cast<double>(k) * T * T) / G;
        }
        const double z_loss = z ? cfg.z_loss_coeff * *lse_sq / static_cast<double>(tokens) : 0.0;
        float *      out    = losses.data<float>();
        out[router_loss_aux]        = static_cast<float>(aux_loss);
        out[router_loss_aux_logged] = aux ? static_cast<float>(aux_loss / cfg.aux_loss_coeff) : 0.0f;
        out[router_loss_z]          = static_cast<float>(z_loss);
        out[router_loss_z_logged]   = z ? static_cast<float>(z_loss / cfg.z_loss_coeff) : 0.0f;
    });
}

Tensor Router::logits_backward(Context & ctx, const Tensor & dprobs, float loss_scale) {
    const int64_t n = ctx.logits.size(0), E = moe.num_experts, k = moe.topk;
    LOOM_CHECK(dprobs.dtype() == DType::f32 && dprobs.numel() == n * k,
               "router dprobs " << dprobs.describe() << ", expected (" << n << ", " << k << ") float32", "");
    Device & device  = dprobs.device();
    Tensor   dlogits = activation(device, n, E);
    const MoeConfig cfg = moe;
    const int64_t   G   = ctx.groups;
    const bool      aux = ctx.aux, z = ctx.z;
    Tensor          logits = ctx.logits, top_idx = ctx.top_idx, counts = ctx.counts;
    const int64_t   tokens = n * (tp.sp() ? tp.size : 1);
    device.compute_stream().submit([=] {
        const float *   l  = logits.data<float>();
        const int32_t * ti = top_idx.data<int32_t>();
        const float *   dp = dprobs.data<float>();
        const int32_t * c  = counts.data<int32_t>();
        float *         dl = dlogits.data<float>();
        const double    sf = cfg.topk_scaling_factor > 0.0f ? cfg.topk_scaling_factor : 1.0;
        // d aux / d p_xi = c_gi * E coeff / (k T^2 G), times the caller's scale.
        const double T         = static_cast<double>(tokens / G);
        const double aux_unit  = aux ? loss_scale * static_cast<double>(E) * cfg.aux_loss_coeff / (k * T * T) / G : 0.0;
        const double z_unit    = z ? loss_scale * cfg.z_loss_coeff * 2.0 / static_cast<double>(tokens) : 0.0;
        parallel_for(n, 64, [&](int64_t begin, int64_t end) {
            std::vector<double> d(E), s(E), q(k), dq(k);
            for (int64_t x = begin; x < end; ++x) {
                const float *   lx  = l + x * E;
                const int32_t * idx = ti + x * k;
                std::fill(d.begin(), d.end(), 0.0);
                for (int64_t j = 0; j < k; ++j) dq[j] = sf * dp[x * k + j];
                if (cfg.score_function == MoeScoreFunction::softmax) {
                    if (cfg.pre_softmax) {   // probs_j = sf s_idx_j with s the softmax over all E
                        softmax(lx, E, s.data());
                        std::vector<double> ds(E, 0.0);
                        double              dot = 0;
                        for (int64_t j = 0; j < k; ++j) {
                            ds[idx[j]] = dq[j];
                            dot += s[idx[j]] * dq[j];
                        }
                        for (int64_t e = 0; e < E; ++e) d[e] += s[e] * (ds[e] - dot);
                    } else {   // probs = sf softmax over the k selected logits
                        topk_probs(lx, idx, E, k, cfg, q.data(), s.data());
                        double dot = 0;
                        for (int64_t j = 0; j < k; ++j) dot += q[j] * dq[j];
                        for (int64_t j = 0; j < k; ++j) d[idx[j]] += q[j] * (dq[j] - dot);
                    }
                } else {   // sigmoid, normalised over the k when k > 1
                    double sum = 0, dot = 0;
                    for (int64_t j = 0; j < k; ++j) sum += (q[j] = sigmoid(lx[idx[j]]));
                    const double S = sum + 1e-20;
                    if (k > 1) {
                        for (int64_t j = 0; j < k; ++j) dot += q[j] / S * dq[j];
                    }
                    for (int64_t j = 0; j < k; ++j) {
                        const double dg = k > 1 ? (dq[j] - dot) / S : dq[j];
                        d[idx[j]] += dg * q[j] * (1.0 - q[j]);
                    }
                }
                if (aux) {
                    const int32_t * cg = c + (x % G) * E;
                    if (cfg.score_function == MoeScoreFunction::softmax) {
                        softmax(lx, E, s.data());
                        double dot = 0;
                        for (int64_t e = 0; e < E; ++e) dot += s[e] * cg[e] * aux_unit;
                        for (int64_t e = 0; e < E; ++e) d[e] += s[e] * (cg[e] * aux_unit - dot);
                    } else {   // p = g / (sum_E g + 1e-20)
                        double sum = 0, dot = 0;
                        for (int64_t e = 0; e < E; ++e) sum += (s[e] = sigmoid(lx[e]));
                        const double S = sum + 1e-20;
                        for (int64_t e = 0; e < E; ++e) dot += s[e] / S * cg[e] * aux_unit;
                        for (int64_t e = 0; e < E; ++e) d[e] += (cg[e] * aux_unit - dot) / S * s[e] * (1.0 - s[e]);
                    }
                }
                if (z) {   // d/dl (lse^2) = 2 lse softmax(l)
                    const double lse = softmax(lx, E, s.data());
                    for (int64_t e = 0; e < E; ++e) d[e] += z_unit * lse * s[e];
                }
                for (int64_t e = 0; e < E; ++e) dl[x * E + e] = static_cast<float>(d[e]);
            }
        });
    });
    return dlogits;
}

Tensor Router::backward(Context & ctx, const Tensor & dprobs, float loss_scale, const GradReadyFn & ready) {
    Tensor   dlogits = logits_backward(ctx, dprobs, loss_scale);
    Ops &    ops     = dlogits.device().ops();
    Stream & stream  = dlogits.device().compute_stream();
    if (has_bias) ops.bias_backward(stream, dlogits, bias.main_grad);
    Tensor dl_in = in_dtype(dlogits, weight.data.dtype());
    Tensor dx    = activation(dlogits.device(), dlogits.size(0), weight.data.size(1));
    ops.gemm(stream, dl_in, false, weight.data, false, dx);
    ops.gemm(stream, dl_in, true, ctx.x, false, weight.main_grad, /*accumulate=*/true);
    Tensor losses = ctx.losses;   // still readable for logging
    ctx           = Context();
    ctx.losses    = losses;
    if (ready) {
        ready(weight);
        if (has_bias) ready(bias);
    }
    return dx;
}

}  // namespace loom::model
