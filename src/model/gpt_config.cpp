#include "model/gpt_config.h"

#include <cmath>

#include "core/error.h"
#include "core/ops.h"

namespace loom::model {

float GptConfig::hidden_init_std() const {
    if (!use_mup) return init_method_std;
    return static_cast<float>(init_method_std / std::sqrt(mup_width_mult()));
}

float GptConfig::residual_init_std() const {
    const float plain = init_method_std / std::sqrt(2.0f * static_cast<float>(num_layers));   // Megatron's scaled init
    if (!use_mup) return plain;
    return static_cast<float>(init_method_std / (std::sqrt(2.0 * static_cast<double>(num_layers)) * std::sqrt(mup_width_mult())));
}

int64_t GptConfig::padded_vocab_size(int64_t tp) const {
    int64_t multiple = make_vocab_size_divisible_by * tp;
    return (vocab_size + multiple - 1) / multiple * multiple;
}

void GptConfig::validate() const {
    // Every size fits 32 bits, so products of two stay far from int64's limit (the memory estimate of
    // train/options.h refuses what a machine cannot hold).
    constexpr int64_t kMax = int64_t(1) << 31;
    const struct { const char * flag; int64_t value; } sizes[] = {
        {"--num-layers", num_layers},       {"--hidden-size", hidden_size},
        {"--ffn-hidden-size", ffn_hidden_size}, {"--num-attention-heads", num_attention_heads},
        {"--num-query-groups", num_query_groups}, {"--seq-length", seq_length},
        {"--max-position-embeddings", max_position_embeddings}, {"--vocab-size", vocab_size},
        {"--make-vocab-size-divisible-by", make_vocab_size_divisible_by},
    };
    for (const auto & size : sizes) {
        LOOM_CHECK(size.value <= kMax, size.flag << " " << size.value << " is larger than 2^31", "");
    }
    LOOM_CHECK(num_layers >= 1, "--num-layers must be >= 1, got " << num_layers, "");
    LOOM_CHECK(hidden_size >= 1 && num_attention_heads >= 1 && hidden_size % num_attention_heads == 0,
               "--hidden-size " << hidden_size << " is not divisible by --num-attention-heads " << num_attention_heads,
               "choose a hidden size that is a multiple of the number of heads");
    LOOM_CHECK(num_query_groups >= 1 && num_attention_heads % num_query_groups == 0,
               "--num-attention-heads " << num_attention_heads << " is not divisible by --num-query-groups "
                                        << num_query_groups,
               "the query groups must divide the heads");
    LOOM_CHECK(position_embedding != PositionEmbedding::rope || head_dim() % 2 == 0,
               "--position-embedding-type rope needs an even head dimension, got " << head_dim(), "");
    if (multi_latent_attention) {
        LOOM_CHECK(q_lora_rank >= 0 && kv_lora_rank >= 1 && qk_head_dim >= 1 && v_head_dim >= 1 &&
                       qk_pos_emb_head_dim >= 2 && qk_pos_emb_head_dim % 2 == 0 && v_head_dim <= mla_qk_dim(),
                   "multi-latent attention sizes: --q-lora-rank " << q_lora_rank << ", --kv-lora-rank " << kv_lora_rank
                       << ", --qk-head-dim " << qk_head_dim << ", --qk-pos-emb-head-dim " << qk_pos_emb_head_dim
                       << ", --v-head-dim " << v_head_dim,
                   "ranks and widths >= 1, an even RoPE part, values no wider than a query head");
        LOOM_CHECK(num_query_groups == num_attention_heads, "--group-query-attention with --multi-latent-attention", "");
        LOOM_CHECK(!attention_output_gate, "Output gate is not supported for MLA yet.",
                   "--attention-output-gate with --multi-latent-attention (Megatron's MLA refuses it too)");
    }
    if (dsa) {   // Megatron's requirements (its DSA spec and AbsorbedMLASelfAttention), then Loom's limits
        LOOM_CHECK(multi_latent_attention, "Currently only MLA supports sparse attention.",
                   "--experimental-attention-variant dsa needs --multi-latent-attention");
        LOOM_CHECK(!add_bias_linear, "DSA uses AbsorbedMLASelfAttention, which requires add_bias_linear=False",
                   "give --disable-bias-linear");
        LOOM_CHECK(q_lora_rank > 0, "--experimental-attention-variant dsa needs --q-lora-rank",
                   "the indexer's queries come from the query latent");
        LOOM_CHECK(dsa_indexer_n_heads >= 1 && dsa_indexer_head_dim >= 1 && dsa_indexer_topk >= 1,
                   "--experimental-attention-variant dsa needs --dsa-indexer-n-heads, --dsa-indexer-head-dim and "
                   "--dsa-indexer-topk >= 1, got " << dsa_indexer_n_heads << ", " << dsa_indexer_head_dim << " and "
                                                   << dsa_indexer_topk, "");
        LOOM_CHECK(dsa_indexer_head_dim >= qk_pos_emb_head_dim,
                   "--dsa-indexer-head-dim " << dsa_indexer_head_dim << " is narrower than its RoPE part, --qk-pos-emb-head-dim "
                                             << qk_pos_emb_head_dim, "");
        LOOM_CHECK(std::isfinite(dsa_indexer_loss_coeff) && dsa_indexer_loss_coeff >= 0.0f,
                   "--dsa-indexer-loss-coeff must be >= 0, got " << dsa_indexer_loss_coeff, "");
        LOOM_CHECK(dsa_indexer_topk_freq >= 1 && dsa_indexer_skip_topk_offset >= 0,
                   "--dsa-indexer-topk-freq " << dsa_indexer_topk_freq << " and --dsa-indexer-skip-topk-offset "
                                              << dsa_indexer_skip_topk_offset,
                   "a frequency >= 1 and an offset >= 0");
    }
    if (gated_delta_net) {   // TransformerConfig's checks, then Loom's kernels' widths
        LOOM_CHECK(linear_attention_freq > 0 || !linear_attention_layers.empty(),
                   "linear_attention_freq must be set for linear gdn.", "give --linear-attention-freq");
        LOOM_CHECK(linear_attention_layers.empty() || static_cast<int64_t>(linear_attention_layers.size()) == num_layers,
                   "Invalid length of linear_attention_pattern: " << linear_attention_layers.size() << ", expected "
                                                                 << num_layers, "give --linear-attention-freq one entry per layer");
        LOOM_CHECK(linear_conv_kernel_dim >= 1 && linear_key_head_dim >= 1 && linear_value_head_dim >= 1 &&
                       linear_num_key_heads >= 1 && linear_num_value_heads >= 1,
                   "gated delta-net sizes: --linear-conv-kernel-dim " << linear_conv_kernel_dim << ", --linear-key-head-dim "
                       << linear_key_head_dim << ", --linear-value-head-dim " << linear_value_head_dim
                       << ", --linear-num-key-heads " << linear_num_key_heads << ", --linear-num-value-heads "
                       << linear_num_value_heads, "each must be >= 1");
        LOOM_CHECK(linear_num_value_heads % linear_num_key_heads == 0,
                   "linear_num_value_heads (" << linear_num_value_heads << ") must be a multiple of linear_num_key_heads ("
                                              << linear_num_key_heads << ").", "");
        LOOM_CHECK(linear_key_head_dim <= kDeltaRuleMaxDim && linear_value_head_dim <= kDeltaRuleMaxDim,
                   "--linear-key-head-dim " << linear_key_head_dim << " and --linear-value-head-dim " << linear_value_head_dim
                                            << ": Loom's delta rule takes heads up to " << kDeltaRuleMaxDim << " wide",
                   "Qwen3-Next's are 128");
        const int64_t in_proj = 2 * linear_key_head_dim * linear_num_key_heads +
                                2 * linear_value_head_dim * linear_num_value_heads + 2 * linear_num_value_heads;
        const int64_t align = fp8_mx ? 32 : 16;   // Megatron's get_fp8_align_size
        LOOM_CHECK(!fp8 || in_proj % align == 0,
                   "For FP8, the innermost dimension of the GDN layer input projection output tensor must be a multiple of "
                       << align << ".",
                   "the input projection's " << in_proj << " outputs: 2 key dims + 2 value dims + 2 value heads");
        // Loom's limit, refused by name until it is built and tested with the gated delta-net.
        LOOM_CHECK(mtp_num_layers == 0, "--experimental-attention-variant gated_delta_net with --mtp-num-layers is not supported by Loom",
                   "drop one of them");
    }
    LOOM_CHECK(mtp_num_layers >= 0 && mtp_num_layers <= 64, "--mtp-num-layers must be between 1 and 64, got " << mtp_num_layers, "");
    LOOM_CHECK(mtp_num_layers == 0 || position_embedding != PositionEmbedding::learned_absolute,
               "--mtp-num-layers with --position-embedding-type learned_absolute is not supported by Loom",
               "use --position-embedding-type rope or none");
    LOOM_CHECK(!recompute_mla_up_proj || multi_latent_attention,
               "mla_up_proj in recompute_modules is only supported with multi_latent_attention.", "");
    LOOM_CHECK(!(swiglu && squared_relu), "--squared-relu and --swiglu are both given",
               "choose one MLP activation (Megatron asserts the same)");
    LOOM_CHECK(!quick_geglu || swiglu, "quick_geglu without a gated MLP (GptConfig::swiglu)",
               "--quick-geglu sets both; a config built by hand must too");
    LOOM_CHECK(seq_length >= 1, "--seq-length must be >= 1", "");
    LOOM_CHECK(position_embedding != PositionEmbedding::learned_absolute || seq_length <= max_position_embeddings,
               "--seq-length " << seq_length << " exceeds --max-position-embeddings " << max_position_embeddings,
               "raise --max-position-embeddings or shorten the sequence");
    LOOM_CHECK(vocab_size >= 1, "vocabulary size must be >= 1", "");
    LOOM_CHECK(make_vocab_size_divisible_by >= 1,
               "--make-vocab-size-divisible-by must be >= 1, got " << make_vocab_size_divisible_by,
               "the vocabulary is padded to a multiple of it (Megatron's default is 128)");
    LOOM_CHECK(ffn_hidden_size >= 1, "--ffn-hidden-size must be >= 1", "");
}

int64_t GptConfig::num_parameters() const {
    int64_t h = hidden_size, f = ffn_hidden_size, V = padded_vocab_size();
    int64_t d = head_dim(), kv = num_query_groups * d;
    int64_t bias = add_bias_linear ? 1 : 0;
    int64_t norm = normalization == Normalization::layernorm ? 2 * h : h;
    int64_t attn = h * (h + 2 * kv) + bias * (h + 2 * kv) + h * h + bias * h;
    if (attention_output_gate) attn += h * h + bias * h;   // the gate's columns of the QKV projection
    int64_t fc1  = swiglu ? 2 * f : f;
    int64_t mlp  = h * fc1 + bias * fc1 + f * h + bias * h;
    int64_t qk_norm = qk_layernorm ? 2 * (normalization == Normalization::layernorm ? 2 * d : d) : 0;
    if (multi_latent_attention) {   // no biases but the projection's; the latents' norms with --qk-layernorm
        const int64_t a = num_attention_heads, per_norm = normalization == Normalization::layernorm ? 2 : 1;
        const int64_t q = q_lora_rank > 0 ? h * q_lora_rank + q_lora_rank * a * mla_qk_dim() : h * a * mla_qk_dim();
        const int64_t kv = h * (kv_lora_rank + qk_pos_emb_head_dim) + kv_lora_rank * a * (qk_head_dim + v_head_dim);
        attn    = q + kv + a * v_head_dim * h + bias * h;
        qk_norm = qk_layernorm ? per_norm * ((q_lora_rank > 0 ? q_lora_rank : 0) + kv_lora_rank) : 0;
    }
    // A DSA layer's indexer (on the layers that compute their own top-k): wq_b, wk, its key LayerNorm (weight and bias)
    // and weights_proj.
    const int64_t indexer = dsa ? q_lora_rank * dsa_indexer_n_heads * dsa_indexer_head_dim + h * dsa_indexer_head_dim +
                                      2 * dsa_indexer_head_dim + h * dsa_indexer_n_heads
                                : 0;
    const int64_t sinks = softmax_type == SoftmaxType::learnable ? num_attention_heads : 0;   // softmax_offset
    // An MoE layer's MLP: the router (E, h) and its bias (E) with the model's biases (Megatron's router.bias), E
    // experts (with biases, as the dense MLP), the shared expert (no biases: Megatron's) and its gate (1, h).
    int64_t moe_mlp = 0;
    if (moe.enabled()) {
        const int64_t fe = moe.expert_ffn(*this), fe1 = swiglu ? 2 * fe : fe, fs = moe.shared_expert_intermediate_size;
        moe_mlp = moe.num_experts * (h + bias) + moe.num_experts * (h * fe1 + bias * fe1 + fe * h + bias * h);
        if (fs > 0) moe_mlp += h * (swiglu ? 2 * fs : fs) + fs * h + (moe.shared_expert_gate ? h : 0);
    }
    // A gated delta-net layer's attention: the input projection [q | k | v | z | b | a] and the output projection
    // (no biases: Megatron's), the convolution over q, k and v, A_log and dt_bias per value head, the gated norm
    // over dv.
    const int64_t qk = linear_key_head_dim * linear_num_key_heads, v = linear_value_head_dim * linear_num_value_heads;
    const int64_t linear_attn = h * (2 * qk + 2 * v + 2 * linear_num_value_heads) + (2 * qk + v) * linear_conv_kernel_dim +
                                2 * linear_num_value_heads +
                                (normalization == Normalization::layernorm ? 2 : 1) * linear_value_head_dim + v * h;
    // An MTP depth's layer is of the last layer's kind (index num_layers); DSA numbers the depths' layers from 1 on
    // their own (dsa_index k for depth k), as Megatron's MTP layers.
    auto per_layer_of = [&](int64_t index, int64_t dsa_index) {
        const int64_t attention = is_linear_attention_layer(index)
                                      ? linear_attn
                                      : attn + qk_norm + sinks + (dsa_computes_topk(dsa_index) ? indexer : 0);
        return 2 * norm + attention + (is_moe_layer(index) ? moe_mlp : mlp);
    };
    int64_t total = V * h + norm;
    for (int64_t i = 0; i < num_layers; ++i) total += per_layer_of(i, i);
    for (int64_t k = 0; k < mtp_num_layers; ++k) {   // each depth: a layer, three norms, eh_proj
        total += per_layer_of(num_layers, k) + 3 * norm + 2 * h * h;
    }
    if (position_embedding == PositionEmbedding::learned_absolute) total += max_position_embeddings * h;
    if (untie_embeddings_and_output_weights) total += V * h;
    return total;
}

double GptConfig::layers_forward_flops_per_token() const {
    const double h = static_cast<double>(hidden_size), s = static_cast<double>(seq_length);
    const double q = static_cast<double>(num_attention_heads * head_dim());
    const double kv = static_cast<double>(num_query_groups * head_dim());
    const double gated = swiglu ? 3 : 2;   // SwiGLU's first GEMM is twice as wide
    // QKV and the projection, then the scores and the weighted values over s keys, halved for the mask.
    double attention = 2 * h * (q + 2 * kv) + 2 * q * h + 2 * 2 * s * q / 2;
    if (attention_output_gate) attention += 2 * h * q;   // the gate's columns of QKV (Megatron counts them too)
    if (multi_latent_attention) {   // Megatron's MLA count: the latents' GEMMs (and norms), the projection, the core
        const double a = static_cast<double>(num_attention_heads), dqk = static_cast<double>(mla_qk_dim());
        const double dn = static_cast<double>(qk_head_dim), dr = static_cast<double>(qk_pos_emb_head_dim);
        const double dv = static_cast<double>(v_head_dim), rq = static_cast<double>(q_lora_rank);
        const double rkv = static_cast<double>(kv_lora_rank);
        const double q_term = q_lora_rank > 0 ? rq * (h + a * dqk + 1) : h * a * dqk;
        attention = 2 * (q_term + rkv * (h + a * (dn + dv) + 1) + h * dr + a * dv * h) + s * a * (dqk + dv);
    }
    // A gated delta-net layer (Megatron's count): the two projections, the convolution, and the delta rule's four
    // products of dv x dv per value head.
    const double qk = static_cast<double>(linear_key_head_dim * linear_num_key_heads);
    const double nv = static_cast<double>(linear_num_value_heads), dv = static_cast<double>(linear_value_head_dim);
    const double linear_attention = 2 * (h * (2 * qk + 2 * nv * dv + 2 * nv) +
                                         static_cast<double>(linear_conv_kernel_dim) * (2 * qk + nv * dv) + nv * dv * dv * 4 +
                                         h * nv * dv);
    // The MTP depths' layers (of the last layer's kind) and, per depth, its three norms and eh_proj (Megatron's
    // count: 3h + 2h^2 multiply-adds).
    double total = static_cast<double>(mtp_num_layers) * 2 * (3 * h + 2 * h * h);
    for (int64_t layer = 0; layer < num_layers + mtp_num_layers; ++layer) {
        double mlp = 2 * h * static_cast<double>(ffn_hidden_size) * gated;
        if (is_moe_layer(layer)) {
            mlp = 2 * h * static_cast<double>(moe.expert_ffn(*this) * moe.topk) * gated +
                  2 * h * static_cast<double>(moe.shared_expert_intermediate_size) * gated;
        }
        total += (is_linear_attention_layer(layer) ? linear_attention : attention) + mlp;
    }
    return total;
}

double GptConfig::output_forward_flops_per_token(int64_t tp) const {
    // The MTP depths' logits use the same output layer, each once more.
    return 2 * static_cast<double>(hidden_size) * static_cast<double>(padded_vocab_size(tp)) *
           static_cast<double>(1 + mtp_num_layers);
}

double GptConfig::training_flops_per_token(int64_t tp) const {
    return 3 * (layers_forward_flops_per_token() + output_forward_flops_per_token(tp));
}

GptConfig gpt_preset(const std::string & name) {
    GptConfig c;
    // The toy models' shape (gpt-oss-tiny, qwen3-next-tiny): 4 layers of hidden 128, 8 heads in 2 query groups,
    // sequence 128, vocabulary 512, RMSNorm.
    auto toy_shape = [&] {
        c.num_layers              = 4;
        c.hidden_size             = 128;
        c.ffn_hidden_size         = 128;
        c.num_attention_heads     = 8;
        c.num_query_groups        = 2;
        c.seq_length              = 128;
        c.max_position_embeddings = c.seq_length;
        c.vocab_size              = 512;
        c.normalization           = Normalization::rmsnorm;
    };
    auto gpt2 = [&](int64_t layers, int64_t hidden, int64_t heads) {
        c.num_layers = layers;
        c.hidden_size = hidden;
        c.ffn_hidden_size = 4 * hidden;
        c.num_attention_heads = heads;
        c.num_query_groups = heads;
        c.seq_length = 1024;
        c.max_position_embeddings = 1024;
        c.vocab_size = 50257;
    };
    if (name == "gpt2-124m") gpt2(12, 768, 12);
    else if (name == "gpt2-350m") gpt2(24, 1024, 16);
    else if (name == "gpt2-774m") gpt2(36, 1280, 20);
    else if (name == "gpt2-1.5b") gpt2(48, 1600, 25);
    else if (name == "gpt-tiny") {
        // The default: small enough to train a few hundred steps in minutes on two cores.
    } else if (name == "llama-tiny") {
        c.normalization = Normalization::rmsnorm;
        c.swiglu = true;
        c.ffn_hidden_size = 352;
        c.position_embedding = PositionEmbedding::rope;
        c.add_bias_linear = false;
        c.untie_embeddings_and_output_weights = true;
        c.num_query_groups = 2;
    } else if (name == "gpt3-175b") {   // Brown et al. (2020), Table 2.1
        gpt2(96, 12288, 96);
        c.seq_length = c.max_position_embeddings = 2048;
    } else if (name == "llama3-8b" || name == "llama3-70b" || name == "llama3-405b") {
        // The Llama 3 Herd of Models (Dubey et al., 2024), Table 3: 8 key/value heads, RoPE base 500 000,
        // a 128K vocabulary; sequences of 8192.
        const bool small = name == "llama3-8b", large = name == "llama3-405b";
        c.num_layers              = small ? 32 : large ? 126 : 80;
        c.hidden_size             = small ? 4096 : large ? 16384 : 8192;
        c.ffn_hidden_size         = small ? 14336 : large ? 53248 : 28672;
        c.num_attention_heads     = small ? 32 : large ? 128 : 64;
        c.num_query_groups        = 8;
        c.seq_length              = 8192;
        c.max_position_embeddings = 8192;
        c.vocab_size              = 128256;
        c.normalization           = Normalization::rmsnorm;
        c.swiglu                  = true;
        c.position_embedding      = PositionEmbedding::rope;
        c.rotary_base             = 500000.0f;
        c.add_bias_linear         = false;
        c.untie_embeddings_and_output_weights = true;
    } else if (name == "deepseek-v3" || name == "deepseek-v3-tiny") {
        // DeepSeek-V3 (DeepSeek-AI, 2024, the technical report's section 4.2 and its released config): MLA with
        // YaRN (factor 40), the first 3 of 61 layers dense, then 256 routed experts (top 8 of the 4 best of 8
        // groups, sigmoid scores scaled by 2.5, aux-loss-free expert bias) and one shared expert of 2048, one MTP
        // depth; RMSNorm, SwiGLU, no biases, untied, a 129 280-token vocabulary, sequences of 4096. The tiny one
        // keeps every feature at toy size (4 layers, the first dense; 8 experts in 4 groups) for CPU runs.
        const bool tiny = name == "deepseek-v3-tiny";
        c.num_layers              = tiny ? 4 : 61;
        c.hidden_size             = tiny ? 128 : 7168;
        c.ffn_hidden_size         = tiny ? 256 : 18432;
        c.num_attention_heads     = tiny ? 4 : 128;
        c.num_query_groups        = c.num_attention_heads;
        c.seq_length              = tiny ? 128 : 4096;
        c.max_position_embeddings = c.seq_length;
        c.vocab_size              = tiny ? 512 : 129280;
        c.normalization           = Normalization::rmsnorm;
        c.norm_epsilon            = 1e-6f;
        c.swiglu                  = true;
        c.position_embedding      = PositionEmbedding::rope;
        c.add_bias_linear         = false;
        c.untie_embeddings_and_output_weights = true;
        c.qk_layernorm            = true;   // MLA's latent norms
        c.multi_latent_attention  = true;
        c.q_lora_rank             = tiny ? 32 : 1536;
        c.kv_lora_rank            = tiny ? 16 : 512;
        c.qk_head_dim             = tiny ? 16 : 128;
        c.qk_pos_emb_head_dim     = tiny ? 8 : 64;
        c.v_head_dim              = tiny ? 16 : 128;
        c.mla_yarn                = true;
        c.rotary_scaling_factor   = 40.0f;
        c.mscale                  = 1.0f;
        c.mscale_all_dim          = 1.0f;
        c.mtp_num_layers          = 1;
        MoeConfig & m             = c.moe;
        m.num_experts             = tiny ? 8 : 256;
        m.topk                    = tiny ? 2 : 8;
        m.ffn_hidden_size         = tiny ? 64 : 2048;
        m.shared_expert_intermediate_size = tiny ? 64 : 2048;
        m.score_function          = MoeScoreFunction::sigmoid;
        m.topk_scaling_factor     = 2.5f;
        m.num_groups              = tiny ? 4 : 8;
        m.group_topk              = tiny ? 2 : 4;
        m.expert_bias             = true;
        m.bias_update_rate        = 1e-3f;
        m.aux_loss_coeff          = 1e-4f;   // the sequence-wise balance loss's small weight
        m.load_balancing          = MoeLoadBalancing::seq_aux_loss;
        m.grouped_gemm            = true;
        m.layer_pattern.assign(static_cast<size_t>(c.num_layers), 1);
        for (int64_t i = 0; i < (tiny ? 1 : 3); ++i) m.layer_pattern[static_cast<size_t>(i)] = 0;
    } else if (name == "gpt-oss-tiny") {
        // gpt-oss's layers (OpenAI's gpt-oss-20b model card; Megatron's gpt-oss example) at toy size: attention
        // sinks, a sliding window of 16 keys on the odd layers (the model's 128 shrunk), grouped-query attention,
        // 4 experts (top 2) of quick-GEGLU with offset 1 and clamp 7, biases, RMSNorm, RoPE, untied. Its head
        // dimension is hidden / heads: Loom has no other (the real model's 64 x 64 heads over 2880 are not it).
        toy_shape();
        c.swiglu                  = true;
        c.quick_geglu             = true;
        c.glu_linear_offset       = 1.0f;
        c.activation_clamp        = 7.0f;
        c.position_embedding      = PositionEmbedding::rope;
        c.rotary_base             = 150000.0f;
        c.untie_embeddings_and_output_weights = true;
        c.softmax_type            = SoftmaxType::learnable;
        c.window_size             = 15;   // Megatron's (L, 0): L earlier keys and the query's own
        c.window_skip_freq        = 2;
        MoeConfig & m             = c.moe;
        m.num_experts             = 4;
        m.topk                    = 2;
        m.ffn_hidden_size         = 128;
        m.aux_loss_coeff          = 1e-3f;
        m.z_loss_coeff            = 1e-3f;
        m.grouped_gemm            = true;
        m.layer_pattern.assign(static_cast<size_t>(c.num_layers), 1);
    } else if (name == "qwen3-next-tiny") {
        // Qwen3-Next's layers (Qwen3-Next-80B-A3B's config; Megatron's gdn functional tests) at toy size: the gated
        // delta-net on three layers of four (--linear-attention-freq 4) with two key heads over four value heads,
        // gated attention with GQA, Q and K norms and RoPE over a quarter of each head on the fourth, zero-centred
        // RMSNorms, 8 experts (top 2) and a gated shared expert on every layer, no biases, untied.
        toy_shape();
        c.apply_layernorm_1p      = true;
        c.swiglu                  = true;
        c.position_embedding      = PositionEmbedding::rope;
        c.rotary_percent          = 0.25f;
        c.rotary_base             = 10000000.0f;
        c.qk_layernorm            = true;
        c.add_bias_linear         = false;
        c.untie_embeddings_and_output_weights = true;
        c.attention_output_gate   = true;
        c.gated_delta_net         = true;
        c.linear_attention_freq   = 4;
        c.linear_conv_kernel_dim  = 4;
        c.linear_key_head_dim     = 32;
        c.linear_value_head_dim   = 32;
        c.linear_num_key_heads    = 2;
        c.linear_num_value_heads  = 4;
        MoeConfig & m             = c.moe;
        m.num_experts             = 8;
        m.topk                    = 2;
        m.ffn_hidden_size         = 64;
        m.shared_expert_intermediate_size = 64;
        m.shared_expert_gate      = true;
        m.aux_loss_coeff          = 1e-3f;
        m.grouped_gemm            = true;
        m.layer_pattern.assign(static_cast<size_t>(c.num_layers), 1);
    } else {
        LOOM_THROW("unknown model preset '" << name << "'",
                   "presets: gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b, gpt3-175b, llama3-8b, llama3-70b, llama3-405b, "
                   "deepseek-v3, gpt-tiny, llama-tiny, deepseek-v3-tiny, gpt-oss-tiny, qwen3-next-tiny");
    }
    return c;
}

}  // namespace loom::model
