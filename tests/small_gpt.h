// The small GPT the parallel tests train: gpt-tiny shrunk to `layers` layers of hidden 64 (4 heads, MLP
// 256) and sequence 32, micro-batch 1, with warmup and decay over the run. Each test sets its global
// batch, its iterations and the parallel options on top.
#pragma once

#include "train/options.h"

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
    return o;
}

}  // namespace loom::testing_models
