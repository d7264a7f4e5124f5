// The small GPT the parallel tests train: gpt-tiny shrunk to `layers` layers of hidden 64 (4 heads, MLP
// 256) and sequence 32, micro-batch 1, with warmup and decay over the run, and Megatron's default dropout
// (0.1 hidden, 0.1 attention): every layout must draw the single-rank run's masks to follow it. Each test
// sets its global batch, its iterations and the parallel options on top.
#pragma once

#include "backend/cpu/cpu_device.h"
#include "parallel/process_groups.h"
#include "train/data_source.h"
#include "train/options.h"
#include "train/setup.h"
#include "train/trainer.h"

#include <cstdio>
#include <map>
#include <string>
#include <vector>

namespace loom::testing_models {

inline train::TrainOptions small_gpt_options(int64_t layers, int64_t global_batch, int64_t iterations) {
    train::TrainOptions o;
    o.model                         = model::gpt_preset("gpt-tiny");
    o.model.num_layers              = layers;
    o.model.hidden_size             = 64;
    o.model.ffn_hidden_size         = 256;
    o.model.num_attention_heads     = 4;
    o.model.num_query_groups        = 4;
    o.model.seq_length              = 32;
    o.model.max_position_embeddings = 32;
    o.micro_batch_size  = 1;
    o.global_batch_size = global_batch;
    o.train_iters       = iterations;
    o.lr_warmup_iters   = iterations / 4;
    o.lr_decay_iters    = iterations;
    o.log_interval      = 1000;
    o.model.hidden_dropout    = 0.1f;
    o.model.attention_dropout = 0.1f;
    return o;
}

// DeepSeek's multi-latent attention at toy size (a query latent of 24, a key/value latent of 16, heads of
// 12 + 8, values of 12), a key and value per head.
inline void use_multi_latent_attention(train::TrainOptions & o) {
    o.model.num_query_groups       = o.model.num_attention_heads;
    o.model.multi_latent_attention = true;
    o.model.q_lora_rank            = 24;
    o.model.kv_lora_rank           = 16;
    o.model.qk_head_dim            = 12;
    o.model.qk_pos_emb_head_dim    = 8;
    o.model.v_head_dim             = 12;
}

// DeepSeek Sparse Attention on MLA layers (use_multi_latent_attention first) at toy size: an indexer of 2 heads of
// 16, each row's top half of the keys, the loss over them at coefficient 1, every other layer taking the one
// before's selection (--dsa-indexer-topk-freq 2).
inline void use_sparse_attention(train::TrainOptions & o) {
    o.model.dsa                         = true;
    o.model.dsa_indexer_n_heads         = 2;
    o.model.dsa_indexer_head_dim        = 16;
    o.model.dsa_indexer_topk            = o.model.seq_length / 2;
    o.model.dsa_indexer_use_sparse_loss = true;
    o.model.dsa_indexer_loss_coeff      = 1.0f;
    o.model.dsa_indexer_topk_freq       = 2;
}

// Qwen3-Next's gated delta-net on layers 0, 2, ... (--linear-attention-freq 2), with key and value heads of 8.
inline void use_gated_delta_net(train::TrainOptions & o, int64_t key_heads, int64_t value_heads) {
    o.model.gated_delta_net        = true;
    o.model.linear_attention_freq  = 2;
    o.model.linear_key_head_dim    = 8;
    o.model.linear_value_head_dim  = 8;
    o.model.linear_num_key_heads   = key_heads;
    o.model.linear_num_value_heads = value_heads;
}

// A parameter's values as f32.
inline std::vector<float> parameter_values(const model::Parameter & p) {
    if (p.fp8_codes()) {   // FP8 codes (--fp8-param-gather): their values times their scales
        const Tensor values = model::parameter_f32(p);
        p.data.device().compute_stream().synchronize();
        return values_f32(values);
    }
    std::vector<float> v(static_cast<size_t>(p.numel()));
    convert(p.data.data_ptr(), p.data.dtype(), v.data(), DType::f32, v.size());
    return v;
}

// The single-rank run every parallel layout is checked against: its losses and final weights by name.
struct SingleRankRun {
    std::vector<double>                       losses;
    std::map<std::string, std::vector<float>> params;
    std::vector<float>                        moe_expert_bias;   // (MoE layers, E), --moe-router-enable-expert-bias
};

// `self`: a group of this rank alone, for the options that live in DDP's buffers (ZeRO-1 on one rank); `out`: where
// the trainer logs (Trainer::run's).
inline SingleRankRun train_single_rank(train::TrainOptions o, std::shared_ptr<comm::Communicator> self = nullptr,
                                       FILE * out = nullptr) {
    auto            source = train::make_batch_source(o, cpu::device(), false);
    model::GptModel gpt(o.model, cpu::device());
    gpt.init();
    SingleRankRun run;
    {
        train::Trainer trainer(o, gpt, *source, std::move(self));
        run.losses = trainer.run(out).losses;
    }
    for (model::Parameter * p : gpt.parameters()) run.params[p->name] = parameter_values(*p);
    if (gpt.moe_expert_bias().defined()) {
        cpu::device().compute_stream().synchronize();
        const Tensor bias = gpt.moe_expert_bias();
        run.moe_expert_bias.assign(bias.data<float>(), bias.data<float>() + bias.numel());
    }
    return run;
}

// A parallel layout's run (train::setup over `groups`, each CP rank on its part of the samples): its losses
// and this rank's final weights by name, with the part of the full tensor each holds (tp_slice: its
// tensor-parallel shard, or its experts).
struct LayoutRun {
    std::vector<double>                       losses;
    std::map<std::string, std::vector<float>> params;
    std::map<std::string, model::TpSlice>     slices;
};

inline LayoutRun train_layout(train::TrainOptions o, const parallel::ProcessGroups & groups, FILE * out = nullptr) {
    const int cp     = o.parallel.cp();
    auto      source = train::context_parallel_part(
        train::make_batch_source(o, cpu::device(), false, groups.dp->rank(), o.parallel.dp()), cp > 1 ? groups.cp->rank() : 0, cp,
        o.model.mtp_num_layers);
    train::Setup setup = train::setup(o, groups, cpu::device());
    LayoutRun    run;
    {
        train::Trainer trainer(o, setup, *source);
        run.losses = trainer.run(out).losses;
    }   // the trainer leaves the weights whole (a lazy or sharded gather finished)
    for (model::Parameter * p : setup.parameters()) {
        run.params[p->name] = parameter_values(*p);
        run.slices[p->name] = p->tp_slice;
    }
    return run;
}

}  // namespace loom::testing_models
