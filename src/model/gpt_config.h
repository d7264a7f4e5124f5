// GptConfig: the architecture of a GPT, in Megatron's terms, with the GPT-2 and Llama-style presets.
//
//   GPT-2:  LayerNorm, GELU MLP (4h), learned absolute positions, biases, output tied to the embedding
//   Llama:  RMSNorm, SwiGLU MLP, RoPE, no biases, untied output, grouped-query attention
//
// Legend: L layers, h hidden, f ffn hidden, a attention heads, g query groups, d = h / a head dim,
// s sequence length, V vocabulary (padded to a multiple of make_vocab_size_divisible_by).
#pragma once

#include "core/dtype.h"
#include "core/fp8.h"
#include "core/glu.h"
#include "model/moe/moe_options.h"

#include <algorithm>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

namespace loom::model {

// --offload-modules (Megatron's names), bits of GptConfig::offload_modules: the input of the pre-attention norm,
// of the QKV projection (MLA: the down projections), the attention core's Q, K and V, the output projection's
// input (the attention output), the pre-MLP norm's input, the experts' fc1 input and their activation's input.
enum OffloadModule : uint32_t {
    offload_attn_norm  = 1u << 0,
    offload_qkv_linear = 1u << 1,
    offload_core_attn  = 1u << 2,
    offload_attn_proj  = 1u << 3,
    offload_mlp_norm   = 1u << 4,
    offload_expert_fc1 = 1u << 5,
    offload_moe_act    = 1u << 6,
};

// How the ranks of a context-parallel group exchange keys and values (--cp-comm-type): p2p passes each
// rank's K | V around a ring, one block per step, merging the partial attentions by log-sum-exp; allgather
// gathers every rank's K | V first; a2a swaps the sequence split for a head split (all-to-all), runs whole-
// sequence attention on this rank's heads and swaps back; a2a_p2p (a2a+p2p, hierarchical) swaps heads inside
// groups of --hierarchical-context-parallel-sizes' first size and runs the ring across them.
enum class CpCommType { p2p, a2a, allgather, a2a_p2p };


// The attention softmax (--softmax-type): vanilla; off_by_one, a logit of 0 beside every query's scores (a key
// whose value is zero); learnable, one trained logit per head in its place (gpt-oss's attention sinks, each
// layer's softmax_offset parameter).
enum class SoftmaxType { vanilla, off_by_one, learnable };
enum class Normalization { layernorm, rmsnorm };
enum class PositionEmbedding { learned_absolute, rope, none };
// Activation recompute (Megatron's --recompute-granularity / --recompute-method / --recompute-num-layers).
// full: the chosen layers keep only their input in forward and rerun their forward just before their
// backward. uniform: each model chunk's layers in groups of recompute_num_layers, one input kept per
// group; block: the first recompute_num_layers layers of each chunk, one by one, the rest stored as
// usual. selective (core_attn): the attention probabilities are recomputed in backward, which Loom's
// tiled attention always does (it never stores the s x s matrix), so it changes nothing.
enum class RecomputeGranularity { none, full, selective };
enum class RecomputeMethod { uniform, block };

struct GptConfig {
    int64_t           num_layers              = 4;
    int64_t           hidden_size             = 128;
    int64_t           ffn_hidden_size         = 512;
    int64_t           num_attention_heads     = 4;
    int64_t           num_query_groups        = 4;      // = heads unless --group-query-attention
    int64_t           seq_length              = 128;
    int64_t           max_position_embeddings = 128;
    int64_t           vocab_size              = 512;    // before padding
    int64_t           make_vocab_size_divisible_by = 128;
    Normalization     normalization           = Normalization::layernorm;
    bool              swiglu                  = false;  // a gated MLP: fc1 is [gate | linear], 2f wide (SwiGLU, or quick_geglu's)
    bool              quick_geglu             = false;  // --quick-geglu (with swiglu set): quick_gelu(gate) (linear + offset)
    float             glu_linear_offset       = 0.0f;   // --glu-linear-offset
    float             activation_clamp        = 0.0f;   // --activation-func-clamp-value (0: none): gate <= c, |linear| <= c
    bool              squared_relu            = false;  // --squared-relu: the MLPs' activation is max(x, 0)^2
    bool              qk_layernorm            = false;  // --qk-layernorm: each query and key head normalised (over d)
    bool              apply_wd_to_qk_layernorm = false; // --apply-wd-to-qk-layernorm: their parameters decay
    bool              apply_layernorm_1p      = false;  // --apply-layernorm-1p: every norm scales by 1 + weight
    PositionEmbedding position_embedding      = PositionEmbedding::learned_absolute;
    bool              add_bias_linear         = true;
    bool              untie_embeddings_and_output_weights = false;
    float             init_method_std         = 0.02f;
    // µP (--use-mup, Megatron's MuP; docs/mup.md): width multiplier m = hidden / --mup-base-hidden-size. Hidden
    // weights start at std / sqrt(m) (the residual writers at std / (sqrt(2 L) sqrt(m))), the embeddings and an
    // untied output layer at std; attention scores scale by softmax_scale; the embedding's output by
    // mup_embedding_mult and the logits by mup_output_mult (1 / m unless given); the optimizer steps hidden
    // matrices with lr / m and eps / m (optim/optimizer.h).
    bool              use_mup                 = false;
    int64_t           mup_base_hidden_size    = 0;      // 0: hidden_size (m = 1)
    float             mup_embedding_mult      = 1.0f;
    float             mup_output_mult         = 1.0f;   // resolved: 1 / m when --mup-output-mult is left at 1
    // --cross-entropy-loss-fusion: in a training pass the output layer, the loss and the logits' gradient run
    // together in the forward, chunk by chunk of positions (GptModel::fused_classifier), so the whole logits
    // never exist. classifier_chunk_positions: positions per chunk (0: the most whose logits fit
    // kClassifierChunkBytes).
    bool              classifier_fusion          = false;   // kClassifierChunkBytes: gpt_model.h
    int64_t           classifier_chunk_positions = 0;
    float             softmax_scale           = 0.0f;   // 0: 1 / sqrt(head dim) (µP: base / kv_channels^power)
    float             norm_epsilon            = 1e-5f;
    float             rotary_base             = 10000.0f;
    float             rotary_percent          = 1.0f;    // --rotary-percent: the share of each head RoPE turns
    bool              rotary_interleaved      = false;   // --rotary-interleaved: pairs (2i, 2i + 1)
    // --multi-latent-attention (DeepSeek-V2/V3's MLA, Megatron's MLASelfAttention): Q, K and V come from
    // low-rank latents of the input (layers.h's SelfAttention gives the math); every head has its own
    // q_nope, q_pe, k_nope and v, and one k_pe is shared by all. q_lora_rank 0: Q straight from the input.
    bool              multi_latent_attention  = false;
    int64_t           q_lora_rank             = 0;     // --q-lora-rank (0: None)
    int64_t           kv_lora_rank            = 32;    // --kv-lora-rank
    int64_t           qk_head_dim             = 128;   // --qk-head-dim: q_nope and k_nope per head
    int64_t           qk_pos_emb_head_dim     = 64;    // --qk-pos-emb-head-dim: q_pe and k_pe (RoPE'd)
    int64_t           v_head_dim              = 128;   // --v-head-dim
    // MLA's RoPE: YaRN (--rope-type yarn, MLA's default; core/rope.h) or plain (--rope-type rope). The softmax
    // scale is multiplied by yarn_mscale(factor, mscale_all_dim)^2 with either, as Megatron's.
    bool              mla_yarn                = true;
    float             rotary_scaling_factor   = 1.0f;  // --rotary-scaling-factor
    float             mscale                  = 1.0f;  // --mscale
    float             mscale_all_dim          = 0.0f;  // --mscale-all-dim
    // --mtp-num-layers (DeepSeek-V3's multi-token prediction, Megatron's MultiTokenPredictionBlock): depth k
    // (0-based) predicts the token k + 2 positions ahead from the depth before's output (the final norm's for
    // k = 0) and the embedding of the token k + 1 ahead (gpt_model.h gives the math). 0: none (Megatron's None).
    int64_t           mtp_num_layers          = 0;
    float             mtp_loss_scaling_factor = 0.1f;  // --mtp-loss-scaling-factor: the depths' losses' weight, in all
    // Dropout probabilities (Megatron's --hidden-dropout on the embedding and on each attention and MLP
    // output before its residual add; --attention-dropout on the attention probabilities). The library
    // default is none; `loom train` takes Megatron's 0.1 and 0.1. Masks: core/dropout.h.
    float             hidden_dropout          = 0.0f;
    float             attention_dropout       = 0.0f;
    RecomputeGranularity recompute_granularity = RecomputeGranularity::none;
    RecomputeMethod      recompute_method      = RecomputeMethod::uniform;
    int64_t              recompute_num_layers  = 0;   // >= 1 with full
    // Selective recompute's moe_act (--recompute-modules moe_act): the experts' activation output (fc2's
    // input) is dropped once fc2 has run and recomputed from the saved pre-activation in backward (the same
    // kernel on the same values: bitwise the stored one, for f32 and bf16).
    bool                 recompute_moe_act     = false;
    // Selective recompute's mlp and shared_experts: the dense MLP (the MoE layers' shared experts) keeps only
    // its input between forward and backward and reruns its forward just before its backward.
    bool                 recompute_mlp            = false;
    bool                 recompute_shared_experts = false;
    // Selective recompute's layernorm: the outputs of each layer's input norm (and, before a dense MLP, of
    // its pre-MLP norm) are not kept for the next module's weight gradient; backward recomputes them from
    // the norm's saved input.
    bool                 recompute_layernorm      = false;
    // Selective recompute's mla_up_proj: MLA's packed [Q | K | V] rows (the up projections' outputs and the
    // RoPE'd parts) are not kept; backward builds them again from the latents the up projections keep.
    bool                 recompute_mla_up_proj    = false;
    // --fine-grained-activation-offloading --offload-modules: the inputs of these modules that backward reads
    // move to pinned host memory when the layer's forward ends and come back when its backward starts (the
    // same values: a memory choice). Tensors under min_offloaded_tensor_size elements stay.
    uint32_t             offload_modules           = 0;         // OffloadModule bits
    // FP8 GEMMs (--fp8-format, --fp8-recipe tensorwise; docs/fp8.md): the decoder layers' linear layers (not
    // the first fp8_bf16_first and last fp8_bf16_last of them: --first-last-layers-bf16) cast both operands of
    // every GEMM to FP8 with their own current scale; forward tensors in fp8_forward, gradients in fp8_backward.
    bool                 fp8                       = false;
    Fp8Format            fp8_forward               = Fp8Format::e4m3;
    Fp8Format            fp8_backward              = Fp8Format::e4m3;
    int64_t              fp8_bf16_first            = 0;
    int64_t              fp8_bf16_last             = 0;
    // --fp8-param-gather: those layers' weights kept as FP8 codes by the distributed optimizer's buffers
    // (Parameter::fp8_blocks; ddp/ddp.h).
    bool                 fp8_param_gather          = false;
    // --fp8-recipe blockwise: the casts in blocks (1 x 128 activations and gradients, 128 x 128 weights) with
    // power-of-two scales (model::Fp8Cast) instead of one current scale per tensor.
    bool                 fp8_blockwise             = false;
    // --fp8-recipe delayed (model/fp8_delayed.h): each operand's scale from its amax history of fp8_amax_history_len
    // casts, its largest (fp8_amax_max) or most recent, over 2^fp8_margin.
    bool                 fp8_delayed               = false;
    // --fp8-recipe mxfp8: blocks of 32 along each GEMM's reduction with E8M0 scales (model::Fp8Cast::mx).
    bool                 fp8_mx                    = false;
    int64_t              fp8_amax_history_len      = 1;
    bool                 fp8_amax_max              = false;
    int                  fp8_margin                = 0;
    // Whether layer `index` (of the decoder; an MTP depth's index past them counts as the last) runs FP8.
    // Sliding-window attention (--window-size L,0): the layers it applies to see keys p - L .. p, the rest
    // every earlier key. Which layers (Megatron's is_layer_window_attention, by 1-based layer number n): every
    // one without --window-attn-skip-freq; with an integer N those with n % N != 0; with a list, entry n - 1.
    int64_t              window_size       = -1;   // L; -1: no window
    int64_t              window_skip_freq  = 0;    // N; 0: not given
    std::vector<int>     window_layers;            // the list form (1: windowed), one entry per decoder layer
    SoftmaxType          softmax_type      = SoftmaxType::vanilla;   // attention sinks: every layer's
    // --attention-output-gate (Qwen3-Next): the QKV projection also gives a gate per query column, and the
    // attention's output is multiplied by its sigmoid before the output projection.
    bool                 attention_output_gate = false;
    // --experimental-attention-variant gated_delta_net (Qwen3-Next's gated delta-net, model/gated_delta_net.h): the
    // layers the pattern marks run the gated delta-net's linear attention in place of softmax attention. The pattern
    // (--linear-attention-freq, Megatron's get_linear_attention_pattern): with an integer N, layer i (from 0) is
    // linear unless (i + 1) % N == 0; with a list, entry i (1: linear).
    bool                 gated_delta_net        = false;
    int64_t              linear_attention_freq  = 0;   // N; 0 with the list form
    std::vector<int>     linear_attention_layers;      // the list form, one entry per decoder layer
    int64_t              linear_conv_kernel_dim = 4;   // --linear-conv-kernel-dim: the short convolution's taps
    int64_t              linear_key_head_dim    = 128;   // --linear-key-head-dim: dk of its queries and keys
    int64_t              linear_value_head_dim  = 128;   // --linear-value-head-dim: dv of its values and gates
    int64_t              linear_num_key_heads   = 16;    // --linear-num-key-heads
    int64_t              linear_num_value_heads = 32;    // --linear-num-value-heads (a multiple of the key heads)
    // --experimental-attention-variant dsa (DeepSeek Sparse Attention, model/dsa_indexer.h): every MLA layer has
    // an indexer (--dsa-indexer-n-heads heads of --dsa-indexer-head-dim) that picks each query's top
    // --dsa-indexer-topk keys and learns from its KL loss against the main attention (--dsa-indexer-loss-coeff; 0:
    // Megatron's None, no loss).
    bool                 dsa                           = false;
    int64_t              dsa_indexer_n_heads           = 0;
    int64_t              dsa_indexer_head_dim          = 0;
    int64_t              dsa_indexer_topk              = 0;
    float                dsa_indexer_loss_coeff        = 0.0f;
    bool                 dsa_indexer_use_sparse_loss   = false;   // the loss over each row's top k only
    // --dsa-indexer-topk-freq F and --dsa-indexer-skip-topk-offset O (Megatron's index sharing): with F > 1 only
    // some layers have an indexer; the others attend to the top-k keys of an earlier layer (dsa_topk_source).
    int64_t              dsa_indexer_topk_freq         = 1;
    int64_t              dsa_indexer_skip_topk_offset  = 0;
    bool                 dsa_indexer_rope_interleaved  = false;   // its RoPE's pairs (2i, 2i + 1)
    bool                 dsa_indexer_rotate_activation = true;    // the Hadamard rotation of q and k
    bool                 dsa_indexer_scoring_relu      = true;    // relu(q . k) in the scores (else q . k)
    float                dsa_indexer_k_norm_epsilon    = 0.0f;    // 0: norm_epsilon
    // DSA's index sharing (Megatron's is_dsa_skip_topk_layer and source_dsa_compute_layer, over layer numbers n from
    // 1 with o = max(O, 1)): layer n computes its own top-k when max(n - o, 0) is a multiple of F, and a layer that
    // does not takes layer n - ((n - o) mod F)'s. `index` from 0; every layer computes its own with F 1.
    int64_t dsa_topk_source(int64_t index) const {
        const int64_t n = index + 1, o = std::max<int64_t>(dsa_indexer_skip_topk_offset, 1), f = dsa_indexer_topk_freq;
        if (f <= 1 || n <= o) return index;
        return n - (n - o) % f - 1;
    }
    bool dsa_computes_topk(int64_t index) const { return dsa && dsa_topk_source(index) == index; }
    // Whether decoder layer `index` (from 0) is a gated delta-net layer.
    bool is_linear_attention_layer(int64_t index) const {
        if (!gated_delta_net || index >= num_layers) return false;
        if (!linear_attention_layers.empty()) return linear_attention_layers[static_cast<size_t>(index)] != 0;
        return linear_attention_freq > 0 && (index + 1) % linear_attention_freq != 0;
    }
    int64_t attention_window(int64_t index) const {   // index: the decoder layer, from 0
        if (window_size < 0) return -1;
        if (!window_layers.empty()) return window_layers[static_cast<size_t>(index)] != 0 ? window_size : -1;
        if (window_skip_freq > 0) return (index + 1) % window_skip_freq != 0 ? window_size : -1;
        return window_size;
    }
    // The gated MLP's activation when it is not plain SwiGLU (quick-GEGLU, or a clamp): Ops::glu_forward's spec.
    std::optional<GluSpec> glu_spec() const {
        if (!swiglu || (!quick_geglu && activation_clamp == 0.0f && glu_linear_offset == 0.0f)) return std::nullopt;
        return GluSpec{quick_geglu ? GluSpec::Gate::quick_gelu : GluSpec::Gate::silu, activation_clamp, glu_linear_offset};
    }
    bool                 fp8_layer(int64_t index) const {
        return fp8 && index >= fp8_bf16_first && index < num_layers - fp8_bf16_last;
    }
    int64_t              min_offloaded_tensor_size = 1 << 20;   // --min-offloaded-tensor-size
    MoeConfig            moe;                         // --num-experts and --moe-*: MoE MLPs (none by default)
    uint64_t          seed                    = 1234;
    // Parameter and GEMM-operand dtype: f32, or bf16 with --bf16 (master weights stay f32; main_grad too
    // unless DDP's buffers are 16-bit: ddp/ddp.h).
    DType             params_dtype            = DType::f32;
    // The hidden states, attention and MLP tensors and logits between and inside the layers: bf16 with
    // --bf16 (as Megatron), else f32 (an f16 model's stay f32). Statistics, losses and gradients' main_grad
    // are f32 whatever it is.
    DType activations_dtype() const { return params_dtype == DType::bf16 ? DType::bf16 : DType::f32; }

    int64_t head_dim() const { return hidden_size / num_attention_heads; }
    // µP's width multiplier hidden / base (1 without µP) and the init std of hidden weights and residual writers.
    double            mup_width_mult() const {
        return use_mup && mup_base_hidden_size > 0 ? static_cast<double>(hidden_size) / static_cast<double>(mup_base_hidden_size) : 1.0;
    }
    float             hidden_init_std() const;
    float             residual_init_std() const;
    // Whether layer `index` has a Mixture of Experts: the pattern's for the decoder's layers; an MTP depth's
    // layer (index num_layers + k) is of the last decoder layer's kind, as Megatron builds it.
    bool    is_moe_layer(int64_t index) const { return moe.is_moe_layer(std::min(index, num_layers - 1)); }
    // MLA: each query and key head's width (q_nope or k_nope, then the RoPE'd part).
    int64_t mla_qk_dim() const { return qk_head_dim + qk_pos_emb_head_dim; }
    // The elements of each head RoPE turns: Megatron's int(kv_channels * rotary_percent).
    int64_t rotary_dim() const { return static_cast<int64_t>(static_cast<double>(head_dim()) * rotary_percent); }
    int64_t padded_vocab_size(int64_t tp = 1) const;
    // Checks the shapes agree (heads divide hidden, groups divide heads, ...); throws naming the flags.
    void validate() const;
    // Parameters of the model (with the padded vocabulary).
    int64_t num_parameters() const;
    // Training FLOPs per token (forward + backward = 3 x forward, 2 per multiply-add), counted from the
    // GEMMs as Megatron's num_floating_point_operations does: QKV, attention scores and values (halved for
    // the causal mask), projection, MLP (SwiGLU's first GEMM x 2 wide; an MoE layer's top-k experts and its
    // shared experts), output layer (its vocabulary padded for `tp` ranks, as Megatron pads it).
    double training_flops_per_token(int64_t tp = 1) const;
    double layers_forward_flops_per_token() const;              // the transformer layers' forward share of it
    double output_forward_flops_per_token(int64_t tp = 1) const;   // the output layer's forward: 2 h V
};

// "deepseek-v3" (MLA, MoE with the expert bias and group-limited routing, MTP) and "deepseek-v3-tiny" (the same
// features at toy size),
// "gpt2-124m", "gpt2-350m", "gpt2-774m", "gpt2-1.5b", "gpt3-175b", "llama3-8b", "llama3-70b", "llama3-405b" (for
// loom plan: far beyond one machine), "gpt-tiny" (the default small model), "llama-tiny", "gpt-oss-tiny" (gpt-oss's
// attention sinks, sliding windows and quick-GEGLU experts at toy size), "qwen3-next-tiny" (Qwen3-Next's gated
// delta-net and gated attention with a gated shared expert, at toy size).
GptConfig gpt_preset(const std::string & name);

}  // namespace loom::model
