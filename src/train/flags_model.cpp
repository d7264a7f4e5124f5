// The model's shape: Megatron's network-size flags over Loom's --model preset, and the args a checkpoint
// records of it (the ones that decide the parameters must agree on --load).
#include "core/error.h"
#include "core/rope.h"
#include "model/gpt_config.h"
#include "train/flag_values.h"
#include "train/layer_pattern.h"
#include "train/options.h"

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>

namespace loom::train {

namespace {

using json = nlohmann::json;
using M    = ModelFlags;

const char * normalization_name(model::Normalization n) {
    return n == model::Normalization::rmsnorm ? "RMSNorm" : "LayerNorm";
}

const char * softmax_type_name(model::SoftmaxType t) {
    switch (t) {
        case model::SoftmaxType::off_by_one: return "off-by-one";
        case model::SoftmaxType::learnable: return "learnable";
        default: return "vanilla";
    }
}

const char * position_name(model::PositionEmbedding p) {
    switch (p) {
        case model::PositionEmbedding::rope: return "rope";
        case model::PositionEmbedding::none: return "none";
        default: return "learned_absolute";
    }
}

constexpr const char * kSize = "network size";

// An MLA size as the checkpoint's args hold it: null in a model without MLA.
json mla_size(const TrainOptions & o, int64_t value) { return o.model.multi_latent_attention ? json(value) : json(nullptr); }
// A gated delta-net size as the checkpoint's args hold it: null in a model without one.
json gdn_size(const TrainOptions & o, int64_t value) { return o.model.gated_delta_net ? json(value) : json(nullptr); }
json dsa_value(const TrainOptions & o, int64_t value) { return o.model.dsa ? json(value) : json(nullptr); }
// DSA's index sharing decides which layers have an indexer: recorded when it shares (null: every layer its own).
json dsa_sharing(const TrainOptions & o, int64_t value) {
    return o.model.dsa && o.model.dsa_indexer_topk_freq > 1 ? json(value) : json(nullptr);
}

constexpr const char * kTransformer = "transformer configuration";

const Flag<TrainOptions> kModelOptionFlags[] = {
    {"--model", kLoomGroup, &TrainOptions::model_preset,
     "model preset: gpt-tiny, llama-tiny, deepseek-v3-tiny, gpt-oss-tiny, qwen3-next-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt3-175b, llama3-8b, "
     "llama3-70b, llama3-405b, deepseek-v3", kShowDefault,
     {"model", [](const TrainOptions & o) -> json { return o.model_preset; }}},
    {"--load-hf", kLoomGroup, &TrainOptions::load_hf,
     "Hugging Face GPT-2 folder (config.json + model.safetensors): its shape and weights"},
};

const Flag<ModelFlags> kModelFlags[] = {
    {"--num-layers", kSize, &M::num_layers, "transformer layers", kPlain,
     {"num_layers", [](const TrainOptions & o) -> json { return o.model.num_layers; }, true}},
    {"--hidden-size", kSize, &M::hidden_size, "hidden size", kPlain,
     {"hidden_size", [](const TrainOptions & o) -> json { return o.model.hidden_size; }, true}},
    {"--ffn-hidden-size", kSize, &M::ffn_hidden_size,
     "MLP hidden size (default 4 x hidden; int(8 x hidden / 3 / 64) x 64 with --swiglu)", kPlain,
     {"ffn_hidden_size", [](const TrainOptions & o) -> json { return o.model.ffn_hidden_size; }, true}},
    {"--num-attention-heads", kSize, &M::heads, "attention heads", kPlain,
     {"num_attention_heads", [](const TrainOptions & o) -> json { return o.model.num_attention_heads; }, true}},
    {"--group-query-attention", kSize, &M::gqa, "use grouped-query attention (with --num-query-groups)"},
    {"--num-query-groups", kSize, &M::query_groups, "key/value heads with --group-query-attention", kPlain,
     {"num_query_groups", [](const TrainOptions & o) -> json { return o.model.num_query_groups; }, true}},
    {"--seq-length", "data and dataloader", &M::seq_length, "sequence length", kPlain,
     {"seq_length", [](const TrainOptions & o) -> json { return o.model.seq_length; }}},
    {"--max-position-embeddings", kSize, &M::max_pos, "learned position embeddings", kPlain,
     {"max_position_embeddings", [](const TrainOptions & o) -> json { return o.model.max_position_embeddings; }, true}},
    {"--vocab-size", kSize, &M::vocab_size, "vocabulary size (default: the dataset's)", kPlain,
     {"vocab_size", [](const TrainOptions & o) -> json { return o.model.vocab_size; }, true}},
    {"--make-vocab-size-divisible-by", kSize, &M::vocab_divisible, "pad the vocabulary to a multiple of this", kPlain,
     {"make_vocab_size_divisible_by", [](const TrainOptions & o) -> json { return o.model.make_vocab_size_divisible_by; }}},
    {"--normalization", kSize, &M::normalization, "LayerNorm or RMSNorm", kPlain,
     {"normalization", [](const TrainOptions & o) -> json { return normalization_name(o.model.normalization); }, true}},
    {"--swiglu", kSize, &M::swiglu, "SwiGLU MLP", kPlain,
     {"swiglu", [](const TrainOptions & o) -> json { return o.model.swiglu; }, true}},
    {"--quick-geglu", kSize, &M::quick_geglu,
     "gated MLP with quick-GELU: x sigmoid(1.702 x) of the gate times the linear half (gpt-oss)", kPlain,
     {"quick_geglu", [](const TrainOptions & o) -> json { return o.model.quick_geglu; }, true}},
    {"--window-size", kSize, &M::window_size,
     "sliding-window attention \"L,R\": each query sees the L keys before it and itself (R must be 0: causal); "
     "(-1, 0) is plain causal attention", kPlain,
     {"window_size", [](const TrainOptions & o) -> json {
          return o.model.window_size >= 0 ? json::array({o.model.window_size, 0}) : json(nullptr);
      }, true}},
    {"--window-attn-skip-freq", kSize, &M::window_skip_freq,
     "which layers take the window: an integer N (layer n windowed when n % N != 0), or a list expression of 1 "
     "(window) and 0 (full), one per layer", kPlain,
     {"window_attn_skip_freq", [](const TrainOptions & o) -> json {
          if (!o.model.window_layers.empty()) return json(o.model.window_layers);
          return o.model.window_skip_freq > 0 ? json(o.model.window_skip_freq) : json(nullptr);
      }, true}},
    {"--softmax-type", kTransformer, &M::softmax_type,
     "the attention softmax: vanilla; off-by-one (a logit of 0 beside every query's scores); learnable (one trained "
     "logit per head, gpt-oss's attention sinks)", kShowDefault,
     {"softmax_type", [](const TrainOptions & o) -> json { return softmax_type_name(o.model.softmax_type); }, true}},
    {"--cross-entropy-loss-fusion", kTransformer, &M::cross_entropy_loss_fusion,
     "in training passes, the output layer, the loss and the logits' gradient computed together in the forward, "
     "chunk by chunk of positions, so the whole logits never exist (docs/fused_classifier.md)"},
    {"--cross-entropy-fusion-impl", kTransformer, &M::cross_entropy_fusion_impl,
     "native (Loom's fused classifier) or te (refused, as Megatron refuses it with --cross-entropy-loss-fusion)",
     kShowDefault},
    {"--cross-entropy-chunk-positions", kLoomGroup, &M::cross_entropy_chunk_positions,
     "with --cross-entropy-loss-fusion, the positions each chunk of logits covers (0: the most whose logits fit "
     "256 MiB)", kShowDefault},
    {"--attention-output-gate", kTransformer, &M::attention_output_gate,
     "gate the attention's output: QKV also projects one gate per query column, and the output is multiplied by its "
     "sigmoid before the output projection (Qwen3-Next)", kPlain,
     {"attention_output_gate", [](const TrainOptions & o) -> json { return o.model.attention_output_gate; }, true}},
    {"--experimental-attention-variant", kTransformer, &M::attention_variant,
     "gated_delta_net (or gdn): Qwen3-Next's gated delta-net linear attention on the layers --linear-attention-freq "
     "marks; dsa: DeepSeek Sparse Attention's indexer on every MLA layer (gdn2 is refused)", kPlain,
     {"experimental_attention_variant", [](const TrainOptions & o) -> json {
          return o.model.gated_delta_net ? json("gdn") : o.model.dsa ? json("dsa") : json(nullptr);
      }, true}},
    {"--dsa-indexer-n-heads", kTransformer, &M::dsa_indexer_n_heads, "the DSA indexer's heads", kPlain,
     {"dsa_indexer_n_heads", [](const TrainOptions & o) -> json { return dsa_value(o, o.model.dsa_indexer_n_heads); }, true}},
    {"--dsa-indexer-head-dim", kTransformer, &M::dsa_indexer_head_dim, "the DSA indexer's head width", kPlain,
     {"dsa_indexer_head_dim", [](const TrainOptions & o) -> json { return dsa_value(o, o.model.dsa_indexer_head_dim); }, true}},
    {"--dsa-indexer-topk", kTransformer, &M::dsa_indexer_topk,
     "the keys each query attends to, the indexer's highest-scoring (--seq-length or more: every causal key)", kPlain,
     {"dsa_indexer_topk", [](const TrainOptions & o) -> json { return dsa_value(o, o.model.dsa_indexer_topk); }, false}},
    {"--dsa-indexer-topk-freq", kTransformer, &M::dsa_indexer_topk_freq,
     "every this many layers one computes its top-k keys (and has an indexer); the layers between take it", kShowDefault,
     {"dsa_indexer_topk_freq", [](const TrainOptions & o) -> json { return dsa_sharing(o, o.model.dsa_indexer_topk_freq); },
      true}},
    {"--dsa-indexer-skip-topk-offset", kTransformer, &M::dsa_indexer_skip_topk_offset,
     "the first layers that compute their own top-k before --dsa-indexer-topk-freq shares them", kShowDefault,
     {"dsa_indexer_skip_topk_offset",
      [](const TrainOptions & o) -> json { return dsa_sharing(o, o.model.dsa_indexer_skip_topk_offset); }, true}},
    {"--dsa-indexer-loss-coeff", kTransformer, &M::dsa_indexer_loss_coeff,
     "the weight of the indexer's KL loss against the main attention (not given or 0: no loss, the indexer untrained)",
     kPlain, {"dsa_indexer_loss_coeff", [](const TrainOptions & o) -> json {
          return o.model.dsa && o.model.dsa_indexer_loss_coeff > 0 ? json(o.model.dsa_indexer_loss_coeff) : json(nullptr);
      }, false}},
    {"--dsa-indexer-use-sparse-loss", kTransformer, &M::dsa_indexer_use_sparse_loss,
     "the KL loss over each query's top-k keys only (with a top-k of every causal key, the dense loss)"},
    {"--dsa-kernel-backend", kTransformer, &M::dsa_kernel_backend, "none (Loom's kernels; tilelang and cudnn are refused)",
     kShowDefault},
    {"--dsa-indexer-rope-interleaved", kTransformer, &M::dsa_indexer_rope_interleaved,
     "the indexer's RoPE turns pairs (2i, 2i + 1) instead of (i, i + r/2)"},
    {"--no-dsa-indexer-rotate-activation", kTransformer, &M::dsa_indexer_rotate_activation,
     "no Hadamard rotation of the indexer's queries and keys", kNegated},
    {"--disable-dsa-indexer-rotate-activation", kTransformer, &M::dsa_indexer_rotate_activation,
     "the same as --no-dsa-indexer-rotate-activation", kNegated},
    {"--no-dsa-indexer-scoring-relu", kTransformer, &M::dsa_indexer_scoring_relu,
     "the indexer's scores sum w q.k instead of w relu(q.k)", kNegated},
    {"--disable-dsa-indexer-scoring-relu", kTransformer, &M::dsa_indexer_scoring_relu,
     "the same as --no-dsa-indexer-scoring-relu", kNegated},
    {"--dsa-indexer-k-norm-epsilon", kTransformer, &M::dsa_indexer_k_norm_epsilon,
     "the epsilon of the indexer's key LayerNorm (not given: --norm-epsilon)"},
    {"--dsa-indexer-k-norm-fp32", kTransformer, &M::dsa_indexer_k_norm_fp32,
     "the indexer's key LayerNorm in f32 (Loom's norms compute in f32 and round their output once: always so)"},
    {"--linear-attention-freq", "experimental_attention_variant", &M::linear_attention_freq,
     "which layers run the gated delta-net: an integer N (layer i, from 0, unless (i + 1) % N == 0), or a list "
     "expression of 1 (linear) and 0 (softmax attention), one per layer", kPlain,
     {"linear_attention_freq", [](const TrainOptions & o) -> json {
          if (!o.model.linear_attention_layers.empty()) return json(o.model.linear_attention_layers);
          return o.model.gated_delta_net ? json(o.model.linear_attention_freq) : json(nullptr);
      }, true}},
    {"--linear-conv-kernel-dim", kTransformer, &M::linear_conv_kernel_dim, "the gated delta-net's convolution taps",
     kShowDefault, {"linear_conv_kernel_dim", [](const TrainOptions & o) -> json { return gdn_size(o, o.model.linear_conv_kernel_dim); }, true}},
    {"--linear-key-head-dim", kTransformer, &M::linear_key_head_dim, "the gated delta-net's query and key head width",
     kShowDefault, {"linear_key_head_dim", [](const TrainOptions & o) -> json { return gdn_size(o, o.model.linear_key_head_dim); }, true}},
    {"--linear-value-head-dim", kTransformer, &M::linear_value_head_dim, "the gated delta-net's value and gate head width",
     kShowDefault, {"linear_value_head_dim", [](const TrainOptions & o) -> json { return gdn_size(o, o.model.linear_value_head_dim); }, true}},
    {"--linear-num-key-heads", kTransformer, &M::linear_num_key_heads, "the gated delta-net's query and key heads",
     kShowDefault, {"linear_num_key_heads", [](const TrainOptions & o) -> json { return gdn_size(o, o.model.linear_num_key_heads); }, true}},
    {"--linear-num-value-heads", kTransformer, &M::linear_num_value_heads,
     "the gated delta-net's value and gate heads (a multiple of its key heads)", kShowDefault,
     {"linear_num_value_heads", [](const TrainOptions & o) -> json { return gdn_size(o, o.model.linear_num_value_heads); }, true}},
    {"--glu-linear-offset", kTransformer, &M::glu_linear_offset,
     "added to a gated MLP's linear half before the product (gpt-oss: 1)", kShowDefault,
     {"glu_linear_offset", [](const TrainOptions & o) -> json { return o.model.glu_linear_offset; }, true}},
    {"--activation-func-clamp-value", kTransformer, &M::activation_clamp,
     "a gated MLP's gate clamped to <= c and its linear half to [-c, c] before the activation (gpt-oss: 7)", kPlain,
     {"activation_func_clamp_value", [](const TrainOptions & o) -> json {
          return o.model.activation_clamp > 0 ? json(o.model.activation_clamp) : json(nullptr);
      }, true}},
    {"--squared-relu", kSize, &M::squared_relu, "squared ReLU MLP activation, max(x, 0)^2 (instead of GELU)", kPlain,
     {"squared_relu", [](const TrainOptions & o) -> json { return o.model.squared_relu; }, true}},
    {"--position-embedding-type", kSize, &M::position_embedding, "learned_absolute, rope or none", kPlain,
     {"position_embedding_type", [](const TrainOptions & o) -> json { return position_name(o.model.position_embedding); },
      true}},
    {"--use-rotary-position-embeddings", kSize, &M::use_rotary,
     "deprecated upstream: --position-embedding-type rope (it overrides that flag, as Megatron's legacy rule does)"},
    {"--no-position-embedding", kSize, &M::no_position_embedding,
     "deprecated upstream: accepted with --position-embedding-type rope (where it has no effect), refused otherwise"},
    {"--disable-bias-linear", kSize, &M::disable_bias, "no biases in linear layers", kPlain,
     {"add_bias_linear", [](const TrainOptions & o) -> json { return o.model.add_bias_linear; }, true}},
    {"--qk-layernorm", kSize, &M::qk_layernorm,
     "normalise each query and key head (over the head dimension, with --normalization) before RoPE", kPlain,
     {"qk_layernorm", [](const TrainOptions & o) -> json { return o.model.qk_layernorm; }, true}},
    {"--apply-layernorm-1p", kSize, &M::apply_layernorm_1p,
     "zero-centred norm weights: every norm scales by 1 + weight, the weight starting at 0", kPlain,
     {"apply_layernorm_1p", [](const TrainOptions & o) -> json { return o.model.apply_layernorm_1p; }, true}},
    {"--apply-wd-to-qk-layernorm", "regularization", &M::apply_wd_to_qk_layernorm,
     "apply --weight-decay to the --qk-layernorm parameters too (other norms and biases never decay)"},
    {"--untie-embeddings-and-output-weights", kSize, &M::untie, "separate output layer weight", kPlain,
     {"untie_embeddings_and_output_weights",
      [](const TrainOptions & o) -> json { return o.model.untie_embeddings_and_output_weights; }, true}},
    {"--init-method-std", "initialization", &M::init_std, "std of the normal initialisation", kPlain,
     {"init_method_std", [](const TrainOptions & o) -> json { return o.model.init_method_std; }}},
    {"--use-mup", kTransformer, &M::use_mup,
     "µP: hidden weights' init std, lr and Adam eps over the width multiplier, attention scores by 1 / d, logits by 1 / "
     "the multiplier (docs/mup.md)", kPlain, {"use_mup", [](const TrainOptions & o) -> json { return o.model.use_mup; }}},
    {"--mup-base-hidden-size", kTransformer, &M::mup_base_hidden_size,
     "µP's base width: the multiplier is --hidden-size over it (default: --hidden-size)", kPlain,
     {"mup_base_hidden_size", [](const TrainOptions & o) -> json { return o.model.mup_base_hidden_size; }}},
    {"--mup-embedding-mult", kTransformer, &M::mup_embedding_mult,
     "µP: a factor on the embedding's output", kShowDefault},
    {"--mup-output-mult", kTransformer, &M::mup_output_mult,
     "µP: a factor on the logits (left at 1: 1 / the width multiplier)", kShowDefault},
    {"--mup-base-head-dim", kTransformer, &M::mup_base_head_dim,
     "µP: attention scores scale by sqrt(this) / kv_channels^power (default: 1 / kv_channels^power)"},
    {"--mup-attn-scale-power", kTransformer, &M::mup_attn_scale_power,
     "µP: the power of kv_channels the attention scores are divided by (0.5: the standard scale)", kShowDefault},
    {"--fp8-format", kTransformer, &M::fp8_format,
     "FP8 GEMMs in the decoder layers' linear layers: e4m3 (every operand) or hybrid (e5m2 gradients); docs/fp8.md",
     kPlain, {"fp8", [](const TrainOptions & o) -> json {
          return o.model.fp8 ? json(o.model.fp8_backward == Fp8Format::e5m2 ? "hybrid" : "e4m3") : json(nullptr);
      }}},
    {"--fp8-recipe", kTransformer, &M::fp8_recipe,
     "the FP8 scaling: delayed (each GEMM operand's scale from its earlier casts' amax history), tensorwise (its "
     "current amax), blockwise (power-of-two scales per 1 x 128 block of activations and gradients, 128 x 128 of "
     "weights) or mxfp8 (E8M0 scales per 32 elements along each GEMM's reduction); docs/fp8.md", kShowDefault},
    {"--fp8-margin", kTransformer, &M::fp8_margin, "delayed scaling's margin: its scales over 2^margin",
     kShowDefault},
    {"--fp8-amax-history-len", kTransformer, &M::fp8_amax_history_len,
     "delayed scaling's amax history: the casts each scale is formed from", kShowDefault},
    {"--fp8-amax-compute-algo", kTransformer, &M::fp8_amax_compute_algo,
     "delayed scaling's amax from its history: most_recent or max", kShowDefault},
    {"--fp8-param-gather", "mixed precision", &M::fp8_param_gather,
     "the FP8 GEMMs' weights kept and gathered as FP8 codes, encoded from the distributed optimizer's f32 shards "
     "(docs/fp8.md)"},
    {"--first-last-layers-bf16", kTransformer, &M::first_last_layers_bf16,
     "with FP8: the first --num-layers-at-start-in-bf16 and last --num-layers-at-end-in-bf16 layers in bf16"},
    {"--num-layers-at-start-in-bf16", kTransformer, &M::fp8_bf16_first,
     "with --first-last-layers-bf16: the decoder layers at the start kept in bf16", kShowDefault},
    {"--num-layers-at-end-in-bf16", kTransformer, &M::fp8_bf16_last,
     "with --first-last-layers-bf16: the decoder layers at the end kept in bf16", kShowDefault},
    {"--softmax-scale", kTransformer, &M::softmax_scale,
     "the attention scores' scale (default 1 / sqrt(kv_channels); MLA keeps its own)", kPlain,
     {"softmax_scale", [](const TrainOptions & o) -> json {
          return o.model.softmax_scale > 0 ? json(o.model.softmax_scale) : json(nullptr);
      }}},
    {"--norm-epsilon", kSize, &M::norm_epsilon, "epsilon of LayerNorm / RMSNorm (default 1e-5)", kPlain,
     {"norm_epsilon", [](const TrainOptions & o) -> json { return o.model.norm_epsilon; }, true}},
    {"--rotary-base", kSize, &M::rotary_base, "base of the rotary embeddings' frequencies (default 10000)", kPlain,
     {"rotary_base", [](const TrainOptions & o) -> json { return o.model.rotary_base; }, true}},
    {"--rotary-percent", kSize, &M::rotary_percent,
     "share of each head's dimension RoPE turns (the first int(d x percent) elements; the rest pass unturned)",
     kShowDefault, {"rotary_percent", [](const TrainOptions & o) -> json { return o.model.rotary_percent; }, true}},
    {"--rotary-interleaved", kSize, &M::rotary_interleaved,
     "RoPE turns the pairs (2i, 2i + 1) rather than the halves (i, i + d/2)", kPlain,
     {"rotary_interleaved", [](const TrainOptions & o) -> json { return o.model.rotary_interleaved; }, true}},
    {"--kv-channels", kSize, &M::kv_channels, "head dimension (only hidden / heads in Loom; unused with MLA)"},
    {"--multi-latent-attention", kSize, &M::mla,
     "multi-latent attention (DeepSeek-V2/V3): Q, K and V from low-rank latents, a shared RoPE'd key part", kPlain,
     {"multi_latent_attention", [](const TrainOptions & o) -> json { return o.model.multi_latent_attention; }, true}},
    {"--q-lora-rank", kSize, &M::q_lora_rank, "MLA: the query latent's rank (default: none, Q straight from x)", kPlain,
     {"q_lora_rank", [](const TrainOptions & o) -> json {
          return o.model.multi_latent_attention && o.model.q_lora_rank > 0 ? json(o.model.q_lora_rank) : json(nullptr);
      }, true}},
    {"--kv-lora-rank", kSize, &M::kv_lora_rank, "MLA: the key/value latent's rank", kShowDefault,
     {"kv_lora_rank", [](const TrainOptions & o) -> json { return mla_size(o, o.model.kv_lora_rank); }, true}},
    {"--qk-head-dim", kSize, &M::qk_head_dim, "MLA: each query and key head's part without RoPE", kShowDefault,
     {"qk_head_dim", [](const TrainOptions & o) -> json { return mla_size(o, o.model.qk_head_dim); }, true}},
    {"--qk-pos-emb-head-dim", kSize, &M::qk_pos_emb_head_dim, "MLA: each query and key head's RoPE'd part",
     kShowDefault, {"qk_pos_emb_head_dim", [](const TrainOptions & o) -> json { return mla_size(o, o.model.qk_pos_emb_head_dim); }, true}},
    {"--v-head-dim", kSize, &M::v_head_dim, "MLA: each value head's width", kShowDefault,
     {"v_head_dim", [](const TrainOptions & o) -> json { return mla_size(o, o.model.v_head_dim); }, true}},
    {"--rope-type", kSize, &M::rope_type, "MLA's RoPE: rope, or yarn (its default)", kPlain,
     {"rope_type", [](const TrainOptions & o) -> json {
          return o.model.multi_latent_attention ? json(o.model.mla_yarn ? "yarn" : "rope") : json(nullptr);
      }}},
    {"--rotary-scaling-factor", kSize, &M::rotary_scaling_factor,
     "MLA: YaRN's context scaling factor (1: plain RoPE's frequencies)", kShowDefault,
     {"rotary_scaling_factor", [](const TrainOptions & o) -> json { return o.model.rotary_scaling_factor; }}},
    {"--mscale", kSize, &M::mscale, "MLA: YaRN's mscale (cos and sin scaled by mscale / mscale_all_dim's)", kShowDefault,
     {"mscale", [](const TrainOptions & o) -> json { return o.model.mscale; }}},
    {"--mscale-all-dim", kSize, &M::mscale_all_dim,
     "MLA: YaRN's mscale_all_dim (also squared into the softmax scale, with either RoPE type)", kShowDefault,
     {"mscale_all_dim", [](const TrainOptions & o) -> json { return o.model.mscale_all_dim; }}},
    {"--mtp-num-layers", kSize, &M::mtp_num_layers,
     "multi-token prediction depths (DeepSeek-V3): each a projection and a transformer layer on the last stage", kPlain,
     {"mtp_num_layers", [](const TrainOptions & o) -> json {
          return o.model.mtp_num_layers > 0 ? json(o.model.mtp_num_layers) : json(nullptr);
      }, true}},
    {"--mtp-loss-scaling-factor", kSize, &M::mtp_loss_scaling_factor,
     "the MTP depths' losses' weight in the training loss, shared out equally between them", kShowDefault,
     {"mtp_loss_scaling_factor", [](const TrainOptions & o) -> json { return o.model.mtp_loss_scaling_factor; }}},
    {"--seed", "initialization", &M::seed, "random seed (initialisation and data order)", kPlain,
     {"seed", [](const TrainOptions & o) -> json { return o.model.seed; }}},
    {"--hidden-dropout", "regularization", &M::hidden_dropout,
     "dropout probability on the embedding and on each attention and MLP output before its residual add", kShowDefault},
    {"--attention-dropout", "regularization", &M::attention_dropout,
     "dropout probability on the attention probabilities (not in DSA's attention, as Megatron's)", kShowDefault},
};

}  // namespace

std::span<const Flag<TrainOptions>> model_option_flags() { return kModelOptionFlags; }
std::span<const Flag<ModelFlags>> model_flags() { return kModelFlags; }

namespace {

// --fp8-format and its recipe (Megatron's TransformerConfig checks, then what Loom's FP8 takes).
void resolve_fp8(const ModelFlags & f, TrainOptions & o) {
    model::GptConfig & m = o.model;
    if (f.fp8_format.empty()) {
        LOOM_CHECK(!f.fp8_param_gather, "--fp8-param-gather without --fp8-format", "");
        return;
    }
    LOOM_CHECK(f.fp8_format == "e4m3" || f.fp8_format == "hybrid",
               "argument --fp8-format: invalid choice: '" << f.fp8_format << "' (choose from 'e4m3', 'hybrid')", "");
    const std::string & r = f.fp8_recipe;
    LOOM_CHECK(r == "tensorwise" || r == "delayed" || r == "mxfp8" || r == "blockwise" || r == "custom",
               "argument --fp8-recipe: invalid choice: '" << r << "' (choose from 'tensorwise', 'delayed', 'mxfp8', "
                                                                 "'blockwise', 'custom')", "");
    LOOM_CHECK(f.fp8_amax_compute_algo == "most_recent" || f.fp8_amax_compute_algo == "max",
               "argument --fp8-amax-compute-algo: invalid choice: '" << f.fp8_amax_compute_algo
                                                                     << "' (choose from 'most_recent', 'max')", "");
    LOOM_CHECK(!(f.first_last_layers_bf16 && r == "delayed"), "Delayed scaling does not support first / last layer in BF16.", "");
    LOOM_CHECK(r != "custom", "--fp8-recipe custom is not supported by Loom",
               "Loom trains FP8 with --fp8-recipe delayed (amax histories), tensorwise (each GEMM operand scaled by its "
               "own amax), blockwise (by blocks of 128) or mxfp8 (by blocks of 32 with E8M0 scales)");
    LOOM_CHECK(f.fp8_amax_history_len >= 1, "--fp8-amax-history-len must be at least 1, got " << f.fp8_amax_history_len, "");
    LOOM_CHECK(f.fp8_margin >= 0 && f.fp8_margin <= 126, "--fp8-margin must be between 0 and 126, got " << f.fp8_margin,
               "the scale is divided by 2^margin");
    LOOM_CHECK(!(f.fp8_param_gather && (r == "blockwise" || r == "mxfp8")),
               "--fp8-param-gather with --fp8-recipe " << r << " is not supported by Loom",
               "Loom keeps FP8 codes with one scale per weight (tensorwise): drop one of them");
    LOOM_CHECK(!o.fp16, "--fp8-format with --fp16 is not supported by Loom",
               "Loom's FP8 GEMMs take bf16 or f32 weights and activations: use --bf16, or neither");
    m.fp8          = true;
    m.fp8_param_gather = f.fp8_param_gather;   // its optimizer's conditions: check_fp8_param_gather
    m.fp8_blockwise    = r == "blockwise";
    m.fp8_delayed      = r == "delayed";
    m.fp8_mx           = r == "mxfp8";
    m.fp8_amax_history_len = f.fp8_amax_history_len;
    m.fp8_amax_max         = f.fp8_amax_compute_algo == "max";
    m.fp8_margin           = static_cast<int>(f.fp8_margin);
    m.fp8_forward  = Fp8Format::e4m3;
    m.fp8_backward = f.fp8_format == "hybrid" ? Fp8Format::e5m2 : Fp8Format::e4m3;
    if (f.first_last_layers_bf16) {
        const int64_t per_stage = m.num_layers / std::max<int64_t>(1, o.parallel.pp());
        for (auto [name, value] : {std::pair{"num_layers_at_start_in_bf16", f.fp8_bf16_first},
                                   {"num_layers_at_end_in_bf16", f.fp8_bf16_last}}) {
            LOOM_CHECK(value >= 0 && value <= per_stage, name << " (" << value << ") must be between 0 and number of layers per "
                                                                   "pipeline stage (" << per_stage << ").", "");
        }
        m.fp8_bf16_first = f.fp8_bf16_first;
        m.fp8_bf16_last  = f.fp8_bf16_last;
    }
}

// --window-size (Megatron's tuple_type: "L,R" or "(L,R)") and --window-attn-skip-freq (moe_freq_type: an
// integer or a list expression), by Megatron's is_layer_window_attention. Loom's limits, refused by name: a
// right window (keys after the query), a left one below -1, and a window under MTP.
void resolve_window(const ModelFlags & f, const Given & given, model::GptConfig & m) {
    if (!given("--window-size")) return;   // Megatron reads the skip frequency only with a window
    std::string text = f.window_size;
    text.erase(std::remove_if(text.begin(), text.end(), [](char c) { return c == '(' || c == ')'; }), text.end());
    std::vector<int64_t> sides;
    for (size_t at = 0; at <= text.size();) {
        const size_t comma = std::min(text.find(',', at), text.size());
        const std::string part = text.substr(at, comma - at);
        char *            end  = nullptr;
        errno                  = 0;
        const long long   v    = std::strtoll(part.c_str(), &end, 10);
        LOOM_CHECK(!part.empty() && *end == '\0' && errno == 0,
                   "argument --window-size: invalid tuple_type value: '" << f.window_size << "'", "");
        sides.push_back(v);
        at = comma + 1;
    }
    LOOM_CHECK(sides.size() == 2, "--window-size '" << f.window_size << "' is not a pair (left, right)",
               "give the window as L,0");
    LOOM_CHECK(sides[1] == 0, "--window-size with a right side of " << sides[1] << " is not supported by Loom",
               "Loom's GPT attention is causal: give L,0");
    LOOM_CHECK(sides[0] >= -1, "--window-size's left side must be >= -1 (-1: unlimited), got " << sides[0], "");
    if (sides[0] < 0) return;   // (-1, 0): causal attention, no window
    LOOM_CHECK(m.mtp_num_layers == 0, "--window-size with --mtp-num-layers is not supported by Loom",
               "Loom's MTP depths take no window: drop one of them");
    m.window_size = sides[0];
    if (!given("--window-attn-skip-freq")) return;
    const LayerFrequency freq = parse_layer_frequency(f.window_skip_freq, "--window-attn-skip-freq", "window_attn_skip_freq",
                                                      m.num_layers);
    m.window_layers    = freq.layers;
    m.window_skip_freq = freq.every;
}

// --glu-linear-offset and --activation-func-clamp-value (TransformerConfig's checks). Both act on gated MLPs
// only (--swiglu, --quick-geglu), as Megatron's glu(); with SwiGLU the clamp needs MoE and no offset.
void resolve_glu(const ModelFlags & f, const Given & given, model::GptConfig & m) {
    if (given("--glu-linear-offset")) {
        LOOM_CHECK(std::isfinite(f.glu_linear_offset), "--glu-linear-offset must be finite, got " << f.glu_linear_offset, "");
        m.glu_linear_offset = f.glu_linear_offset;
    }
    if (!given("--activation-func-clamp-value")) return;
    LOOM_CHECK(std::isfinite(f.activation_clamp) && f.activation_clamp > 0,
               (m.swiglu && !m.quick_geglu ? "activation_func_clamp_value for SwiGLU must be finite and greater than zero."
                                           : "--activation-func-clamp-value must be a finite number > 0"),
               "got " << f.activation_clamp << (m.swiglu && !m.quick_geglu ? "" : " (Loom's limit: a clamp to [-c, c] needs c > 0)"));
    if (m.swiglu && !m.quick_geglu) {
        LOOM_CHECK(m.moe.num_experts > 0 || given("--num-experts"), "activation_func_clamp_value for SwiGLU is only supported with MoE.", "");
        LOOM_CHECK(m.glu_linear_offset == 0.0f,
                   "glu_linear_offset must be zero when activation_func_clamp_value is set for SwiGLU.", "");
    }
    m.activation_clamp = f.activation_clamp;
}

// --softmax-scale and µP (Megatron's TransformerConfig.__post_init__), after the model's shape.
void resolve_mup(const ModelFlags & f, const Given & given, model::GptConfig & m) {
    if (given("--softmax-scale")) {
        LOOM_CHECK(std::isfinite(f.softmax_scale) && f.softmax_scale > 0,
                   "--softmax-scale must be a finite number > 0, got " << f.softmax_scale, "");
        m.softmax_scale = f.softmax_scale;
    }
    m.use_mup = f.use_mup;
    if (!m.use_mup) return;   // Megatron reads the --mup-* values only with --use-mup
    m.mup_base_hidden_size = given("--mup-base-hidden-size") ? f.mup_base_hidden_size : m.hidden_size;
    LOOM_CHECK(m.mup_base_hidden_size > 0, "--mup-base-hidden-size must be positive.", "");
    for (auto [flag, value] : {std::pair{"--mup-embedding-mult", f.mup_embedding_mult}, {"--mup-output-mult", f.mup_output_mult},
                               {"--mup-attn-scale-power", f.mup_attn_scale_power}}) {
        LOOM_CHECK(std::isfinite(value), flag << " must be a finite number, got " << value, "");
    }
    LOOM_CHECK(!given("--mup-base-head-dim") || (std::isfinite(f.mup_base_head_dim) && f.mup_base_head_dim > 0),
               "--mup-base-head-dim must be a finite number > 0, got " << f.mup_base_head_dim, "");
    const double width = m.mup_width_mult();
    if (!given("--softmax-scale")) {   // 1 / d instead of 1 / sqrt(d)
        const double base = given("--mup-base-head-dim") ? std::sqrt(static_cast<double>(f.mup_base_head_dim)) : 1.0;
        m.softmax_scale   = static_cast<float>(base / std::pow(static_cast<double>(m.head_dim()), f.mup_attn_scale_power));
    }
    m.mup_embedding_mult = f.mup_embedding_mult;
    m.mup_output_mult    = f.mup_output_mult == 1.0f && width != 1.0 ? static_cast<float>(1.0 / width) : f.mup_output_mult;
}

}  // namespace

void resolve_model_shape(const ModelFlags & f, const Given & given, TrainOptions & o) {
    model::GptConfig & m = o.model;
    if (given("--num-layers")) m.num_layers = f.num_layers;
    if (given("--hidden-size")) {
        m.hidden_size = f.hidden_size;
        if (!given("--ffn-hidden-size")) m.ffn_hidden_size = 4 * f.hidden_size;
    }
    if (given("--ffn-hidden-size")) m.ffn_hidden_size = f.ffn_hidden_size;
    if (given("--num-attention-heads")) {
        m.num_attention_heads = f.heads;
        m.num_query_groups    = f.heads;
    }
    if (given("--num-query-groups") && !f.gqa) {
        LOOM_THROW("--num-query-groups " << f.query_groups << " without --group-query-attention",
                   "add --group-query-attention to use grouped-query attention");
    }
    if (f.gqa) {
        LOOM_CHECK(given("--num-query-groups"), "--group-query-attention needs --num-query-groups", "");
        m.num_query_groups = f.query_groups;
    }
    if (given("--seq-length")) {
        m.seq_length = f.seq_length;
        if (!given("--max-position-embeddings")) m.max_position_embeddings = std::max(m.max_position_embeddings, f.seq_length);
    }
    if (given("--max-position-embeddings")) m.max_position_embeddings = f.max_pos;
    if (given("--vocab-size")) m.vocab_size = f.vocab_size;
    if (given("--make-vocab-size-divisible-by")) m.make_vocab_size_divisible_by = f.vocab_divisible;
    if (given("--normalization")) {
        if (f.normalization == "LayerNorm") m.normalization = model::Normalization::layernorm;
        else if (f.normalization == "RMSNorm") m.normalization = model::Normalization::rmsnorm;
        else LOOM_THROW("--normalization '" << f.normalization << "' is not supported", "use LayerNorm or RMSNorm");
    }
    if (f.swiglu) m.swiglu = true;
    if (f.squared_relu) m.squared_relu = true;
    // Megatron's MLP width when none is given: 4h, or with SwiGLU two thirds of it rounded down to a
    // multiple of 64 (the same parameter count as a 4h GELU MLP, roughly).
    if (!given("--ffn-hidden-size") && (given("--hidden-size") || f.swiglu)) {
        m.ffn_hidden_size = m.swiglu ? (4 * m.hidden_size * 2 / 3) / 64 * 64 : 4 * m.hidden_size;
    }
    if (given("--softmax-type")) {   // else the preset's
        LOOM_CHECK(f.softmax_type == "vanilla" || f.softmax_type == "off-by-one" || f.softmax_type == "learnable",
                   "argument --softmax-type: invalid choice: '" << f.softmax_type
                                                                << "' (choose from 'vanilla', 'off-by-one', 'learnable')", "");
        m.softmax_type = f.softmax_type == "learnable"    ? model::SoftmaxType::learnable
                         : f.softmax_type == "off-by-one" ? model::SoftmaxType::off_by_one
                                                          : model::SoftmaxType::vanilla;
    }
    if (f.attention_output_gate) m.attention_output_gate = true;
    // Megatron's choices and its assert (validate_args), then Loom's chunk.
    LOOM_CHECK(f.cross_entropy_fusion_impl == "native" || f.cross_entropy_fusion_impl == "te",
               "argument --cross-entropy-fusion-impl: invalid choice: '" << f.cross_entropy_fusion_impl
                                                                       << "' (choose from 'native', 'te')", "");
    LOOM_CHECK(!(f.cross_entropy_loss_fusion && f.cross_entropy_fusion_impl == "te"),
               "Transformer Engine cross entropy loss fusion is disabled due to stability issues. Use "
               "--cross-entropy-fusion-impl native, or omit --cross-entropy-loss-fusion.", "");
    LOOM_CHECK(f.cross_entropy_chunk_positions >= 0,
               "--cross-entropy-chunk-positions must be >= 0, got " << f.cross_entropy_chunk_positions, "0 sizes the chunks by bytes");
    m.classifier_fusion          = f.cross_entropy_loss_fusion;
    m.classifier_chunk_positions = f.cross_entropy_chunk_positions;
    if (f.quick_geglu) {   // gated, at the width Megatron gives it without --swiglu (4h unless given)
        LOOM_CHECK(!f.swiglu && !f.squared_relu, "--quick-geglu with --" << (f.swiglu ? "swiglu" : "squared-relu"),
                   "choose one MLP activation (Megatron asserts the same)");
        m.swiglu      = true;
        m.quick_geglu = true;
    }
    if (given("--position-embedding-type")) {
        if (f.position_embedding == "learned_absolute") m.position_embedding = model::PositionEmbedding::learned_absolute;
        else if (f.position_embedding == "rope") m.position_embedding = model::PositionEmbedding::rope;
        else if (f.position_embedding == "none") m.position_embedding = model::PositionEmbedding::none;
        else LOOM_THROW("--position-embedding-type '" << f.position_embedding << "' is not supported",
                        "use learned_absolute, rope or none");
    }
    if (f.use_rotary) m.position_embedding = model::PositionEmbedding::rope;   // Megatron's legacy RoPE argument
    // Megatron's rule (arguments.py): the deprecated switch only rides along with RoPE.
    LOOM_CHECK(!f.no_position_embedding || m.position_embedding == model::PositionEmbedding::rope,
               "--no-position-embedding is deprecated, use --position-embedding-type",
               "--position-embedding-type none (or rope, with which --no-position-embedding has no effect)");
    if (f.disable_bias) m.add_bias_linear = false;
    if (f.qk_layernorm) m.qk_layernorm = true;
    if (f.apply_wd_to_qk_layernorm) m.apply_wd_to_qk_layernorm = true;
    if (f.apply_layernorm_1p) m.apply_layernorm_1p = true;
    if (f.untie) m.untie_embeddings_and_output_weights = true;
    if (given("--init-method-std")) m.init_method_std = f.init_std;
    if (given("--seed")) m.seed = f.seed;
    m.hidden_dropout    = f.hidden_dropout;
    m.attention_dropout = f.attention_dropout;
}

namespace {

// --multi-latent-attention and its sizes, and the RoPE type: Megatron's rules, then what Loom's MLA runs.
void check_mla_flags(const ModelFlags & f, const Given & given, TrainOptions & o) {
    model::GptConfig & m = o.model;
    LOOM_CHECK(f.rope_type.empty() || f.rope_type == "rope" || f.rope_type == "yarn",
               "argument --rope-type: invalid choice: '" << f.rope_type << "' (choose from 'rope', 'yarn')", "");
    LOOM_CHECK(f.mla || f.rope_type != "yarn", "--rope-type yarn without --multi-latent-attention is not supported by Loom",
               "Megatron reads --rope-type only in MLA; give --position-embedding-type rope");
    LOOM_CHECK(std::isfinite(f.rotary_scaling_factor) && f.rotary_scaling_factor > 0.0f,
               "--rotary-scaling-factor must be a finite number > 0, got " << f.rotary_scaling_factor, "");
    LOOM_CHECK(std::isfinite(f.mscale) && std::isfinite(f.mscale_all_dim),
               "--mscale " << f.mscale << " and --mscale-all-dim " << f.mscale_all_dim << " must be finite", "");
    if (!f.mla) {
        for (const char * flag : {"--q-lora-rank", "--kv-lora-rank", "--qk-head-dim", "--qk-pos-emb-head-dim", "--v-head-dim"}) {
            LOOM_CHECK(!given(flag), flag << " without --multi-latent-attention", "add --multi-latent-attention");
        }
        return;
    }
    LOOM_CHECK(!given("--q-lora-rank") || f.q_lora_rank >= 1, "--q-lora-rank must be >= 1, got " << f.q_lora_rank, "");
    const struct { const char * flag; int64_t value; } sizes[] = {
        {"--kv-lora-rank", f.kv_lora_rank}, {"--qk-head-dim", f.qk_head_dim},
        {"--qk-pos-emb-head-dim", f.qk_pos_emb_head_dim}, {"--v-head-dim", f.v_head_dim}};
    for (const auto & size : sizes) {
        LOOM_CHECK(size.value >= 1 && size.value <= (int64_t(1) << 20), size.flag << " must be between 1 and 2^20, got " << size.value, "");
    }
    LOOM_CHECK(f.qk_pos_emb_head_dim % 2 == 0, "--qk-pos-emb-head-dim " << f.qk_pos_emb_head_dim << " is odd",
               "RoPE turns its elements in pairs");
    LOOM_CHECK(f.v_head_dim <= f.qk_head_dim + f.qk_pos_emb_head_dim,
               "--v-head-dim " << f.v_head_dim << " is wider than a query head (--qk-head-dim + --qk-pos-emb-head-dim = "
                               << f.qk_head_dim + f.qk_pos_emb_head_dim << ")",
               "Loom pads each value head to the query heads' width");
    LOOM_CHECK(m.num_query_groups == m.num_attention_heads, "--group-query-attention with --multi-latent-attention",
               "MLA has a key and value per head (Megatron asserts the same)");
    LOOM_CHECK(f.rotary_percent == 1.0f, "--rotary-percent " << f.rotary_percent << " with --multi-latent-attention",
               "MLA turns the whole --qk-pos-emb-head-dim");
    m.multi_latent_attention = true;
    m.q_lora_rank            = given("--q-lora-rank") ? f.q_lora_rank : 0;
    m.kv_lora_rank           = f.kv_lora_rank;
    m.qk_head_dim            = f.qk_head_dim;
    m.qk_pos_emb_head_dim    = f.qk_pos_emb_head_dim;
    m.v_head_dim             = f.v_head_dim;
    m.mla_yarn               = f.rope_type != "rope";   // Megatron: MLA takes YaRN unless told otherwise
    m.rotary_scaling_factor  = f.rotary_scaling_factor;
    m.mscale                 = f.mscale;
    m.mscale_all_dim         = f.mscale_all_dim;
    const double concentration = yarn_mscale(m.rotary_scaling_factor, m.mscale_all_dim);
    LOOM_CHECK(concentration > 0.0 && (!m.mla_yarn || yarn_mscale(m.rotary_scaling_factor, m.mscale) > 0.0),
               "--mscale " << f.mscale << " / --mscale-all-dim " << f.mscale_all_dim << " at --rotary-scaling-factor "
                           << f.rotary_scaling_factor << " give YaRN a scale <= 0", "");
}

// --experimental-attention-variant dsa's flags: TransformerConfig's checks of them, Loom's limits (sizes and the
// model's requirements are GptConfig::validate's).
void resolve_dsa(const ModelFlags & f, const Given & given, model::GptConfig & m) {
    LOOM_CHECK(f.dsa_indexer_topk_freq >= 1, "dsa_indexer_topk_freq must be >= 1, got " << f.dsa_indexer_topk_freq, "");
    LOOM_CHECK(f.dsa_indexer_skip_topk_offset >= 0,
               "dsa_indexer_skip_topk_offset must be >= 0, got " << f.dsa_indexer_skip_topk_offset, "");
    const std::string & backend = f.dsa_kernel_backend;
    LOOM_CHECK(backend == "none" || backend == "tilelang" || backend == "cudnn",
               "argument --dsa-kernel-backend: invalid choice: '" << backend << "' (choose from 'none', 'tilelang', 'cudnn')", "");
    LOOM_CHECK(backend == "none", "--dsa-kernel-backend " << backend << " is not supported by Loom",
               "give --dsa-kernel-backend none: Loom runs DSA with its own kernels on every device");
    LOOM_CHECK(!given("--dsa-indexer-k-norm-epsilon") ||
                   (std::isfinite(f.dsa_indexer_k_norm_epsilon) && f.dsa_indexer_k_norm_epsilon > 0.0f),
               "--dsa-indexer-k-norm-epsilon must be a finite number > 0, got " << f.dsa_indexer_k_norm_epsilon, "");
    m.dsa                           = true;
    m.dsa_indexer_n_heads           = f.dsa_indexer_n_heads;
    m.dsa_indexer_head_dim          = f.dsa_indexer_head_dim;
    m.dsa_indexer_topk              = f.dsa_indexer_topk;
    m.dsa_indexer_loss_coeff        = f.dsa_indexer_loss_coeff;
    m.dsa_indexer_use_sparse_loss   = f.dsa_indexer_use_sparse_loss;
    m.dsa_indexer_topk_freq         = f.dsa_indexer_topk_freq;
    m.dsa_indexer_skip_topk_offset  = f.dsa_indexer_skip_topk_offset;
    m.dsa_indexer_rope_interleaved  = f.dsa_indexer_rope_interleaved;
    m.dsa_indexer_rotate_activation = f.dsa_indexer_rotate_activation;
    m.dsa_indexer_scoring_relu      = f.dsa_indexer_scoring_relu;
    m.dsa_indexer_k_norm_epsilon    = f.dsa_indexer_k_norm_epsilon;
}

// --experimental-attention-variant and the gated delta-net's sizes: TransformerConfig's choices and checks (its
// validation in GptConfig::validate), the sizes refused without the variant as MLA's are without MLA.
void resolve_linear_attention(const ModelFlags & f, const Given & given, model::GptConfig & m) {
    const char * sizes[] = {"--linear-attention-freq", "--linear-conv-kernel-dim", "--linear-key-head-dim",
                            "--linear-value-head-dim", "--linear-num-key-heads", "--linear-num-value-heads"};
    const std::string & v = f.attention_variant;
    if (!given("--experimental-attention-variant") || v != "dsa") {   // what only DSA reads: the table's --*dsa-* flags
        for (const Flag<ModelFlags> & flag : model_flags()) {
            if (std::string_view(flag.name).find("-dsa-") == std::string_view::npos) continue;
            LOOM_CHECK(!given(flag.name), flag.name << " without --experimental-attention-variant dsa",
                       "add --experimental-attention-variant dsa");
        }
    }
    if (!given("--experimental-attention-variant")) {
        for (const char * flag : sizes) {
            LOOM_CHECK(!given(flag), flag << " without --experimental-attention-variant",
                       "add --experimental-attention-variant gated_delta_net");
        }
        return;
    }
    LOOM_CHECK(v == "gdn" || v == "gdn2" || v == "dsa" || v == "gated_delta_net",
               "argument --experimental-attention-variant: invalid choice: '" << v
                                                                            << "' (choose from 'gdn', 'gdn2', 'dsa', 'gated_delta_net')", "");
    LOOM_CHECK(v != "gdn2", "--experimental-attention-variant gdn2 is not supported by Loom",
               "Loom runs gated_delta_net (gdn) and dsa");
    if (v == "dsa") {
        for (const char * flag : sizes) {
            LOOM_CHECK(!given(flag), flag << " with --experimental-attention-variant dsa",
                       "the gated delta-net's flags apply to --experimental-attention-variant gated_delta_net");
        }
        resolve_dsa(f, given, m);
        return;
    }
    LOOM_CHECK(given("--linear-attention-freq"), "linear_attention_freq must be set for linear gdn.",
               "give --linear-attention-freq");
    const LayerFrequency freq = parse_layer_frequency(f.linear_attention_freq, "--linear-attention-freq",
                                                      "linear_attention_pattern", m.num_layers);
    m.gated_delta_net         = true;
    m.linear_attention_freq   = freq.every;
    m.linear_attention_layers = freq.layers;
    m.linear_conv_kernel_dim  = f.linear_conv_kernel_dim;
    m.linear_key_head_dim     = f.linear_key_head_dim;
    m.linear_value_head_dim   = f.linear_value_head_dim;
    m.linear_num_key_heads    = f.linear_num_key_heads;
    m.linear_num_value_heads  = f.linear_num_value_heads;
}

}  // namespace

void check_model_flags(const ModelFlags & f, const Given & given, TrainOptions & o) {
    model::GptConfig & m = o.model;
    resolve_mup(f, given, m);
    resolve_glu(f, given, m);
    resolve_fp8(f, o);
    if (given("--norm-epsilon")) {
        LOOM_CHECK(std::isfinite(f.norm_epsilon) && f.norm_epsilon > 0,
                   "--norm-epsilon must be a finite number > 0, got " << f.norm_epsilon, "Megatron's default is 1e-5");
        m.norm_epsilon = f.norm_epsilon;
    }
    if (given("--rotary-base")) {
        LOOM_CHECK(f.rotary_base >= 2, "--rotary-base must be >= 2, got " << f.rotary_base, "Megatron's default is 10000");
        m.rotary_base = static_cast<float>(f.rotary_base);
    }
    LOOM_CHECK(f.rotary_percent > 0.0f && f.rotary_percent <= 1.0f,
               "--rotary-percent must lie in (0, 1], got " << f.rotary_percent, "Megatron's default is 1.0");
    m.rotary_percent     = f.rotary_percent;
    m.rotary_interleaved = f.rotary_interleaved;
    LOOM_CHECK(m.position_embedding != model::PositionEmbedding::rope || (m.rotary_dim() >= 2 && m.rotary_dim() % 2 == 0),
               "--rotary-percent " << f.rotary_percent << " turns " << m.rotary_dim() << " of each head's "
                                   << m.head_dim() << " elements, which RoPE cannot pair",
               "choose a share that leaves an even number of at least 2");
    check_mla_flags(f, given, o);
    // Multi-token prediction: Megatron's position-embedding rule, then Loom's.
    if (given("--mtp-num-layers")) {
        LOOM_CHECK(f.mtp_num_layers >= 1 && f.mtp_num_layers <= 64,
                   "--mtp-num-layers must be between 1 and 64, got " << f.mtp_num_layers, "");
        LOOM_CHECK(m.position_embedding != model::PositionEmbedding::learned_absolute,
                   "--mtp-num-layers with --position-embedding-type learned_absolute is not supported by Loom",
                   "use --position-embedding-type rope or none");
        m.mtp_num_layers = f.mtp_num_layers;
    }
    LOOM_CHECK(std::isfinite(f.mtp_loss_scaling_factor),
               "--mtp-loss-scaling-factor must be finite, got " << f.mtp_loss_scaling_factor, "");
    m.mtp_loss_scaling_factor = f.mtp_loss_scaling_factor;
    resolve_window(f, given, m);   // after MTP's depths
    resolve_linear_attention(f, given, m);
    LOOM_CHECK(!given("--kv-channels") || m.multi_latent_attention || f.kv_channels == m.head_dim(),
               "--kv-channels " << f.kv_channels << " is not supported by Loom: its heads are hidden / heads = "
                                << m.head_dim() << " wide",
               "drop --kv-channels, or choose --hidden-size and --num-attention-heads so that it is their quotient");
}

void check_dropout(const ModelFlags & f) {
    for (auto [flag, p] : {std::pair{"--hidden-dropout", f.hidden_dropout}, {"--attention-dropout", f.attention_dropout}}) {
        LOOM_CHECK(p >= 0.0f && p < 1.0f, flag << " " << p << " is not a probability in [0, 1)",
                   "Megatron's default is 0.1; 0 turns the dropout off");
    }
}

}  // namespace loom::train
