// The flags of `loom train` by the config they fill, each with its table (train/flag_table.h) and the
// rules that resolve it: the table in src/train/flags_<config>.cpp, next to its rules.
//
// Most flags land straight in TrainOptions (or a config it holds: AdamWConfig, DdpConfig, HybridOptions).
// The structs here hold the flags that cannot: those applied only when given (the model's shape over the
// --model preset), and those resolved together into another type (the MoE, graph and recompute rules).
#pragma once

#include "model/gpt_config.h"
#include "train/flag_table.h"

#include <CLI/CLI.hpp>

#include <cstdint>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::ddp {
struct DdpConfig;
}
namespace loom::optim {
struct AdamWConfig;
struct HybridOptions;
}

namespace loom::train {

struct TrainOptions;

// Whether a flag was given on the command line (argparse's "is not None" for flags whose default means
// "not given").
class Given {
public:
    explicit Given(const CLI::App & app) : app_(app) {}
    bool operator()(const char * flag) const { return app_.count(flag) > 0; }

private:
    const CLI::App & app_;
};

// The model's shape (flags_model.cpp): each overrides the --model preset (or --load-hf's config.json)
// only when given.
struct ModelFlags {
    int64_t     num_layers = 0, hidden_size = 0, ffn_hidden_size = 0, heads = 0, query_groups = 0;
    int64_t     seq_length = 0, max_pos = 0, vocab_size = 0, vocab_divisible = 0;
    bool        gqa = false, swiglu = false, squared_relu = false, disable_bias = false, untie = false, qk_layernorm = false;
    bool        no_position_embedding = false;   // --no-position-embedding (deprecated upstream; only with rope)
    bool        use_rotary = false;              // --use-rotary-position-embeddings (deprecated upstream: rope)
    bool        apply_wd_to_qk_layernorm = false;
    bool        apply_layernorm_1p = false;
    std::string normalization, position_embedding;
    float       init_std = 0, norm_epsilon = 0, rotary_percent = 1.0f;
    // µP and the attention scale (TransformerConfig's fields; 0: None).
    bool        use_mup = false;
    int64_t     mup_base_hidden_size = 0;
    float       mup_embedding_mult = 1.0f, mup_output_mult = 1.0f, mup_base_head_dim = 0.0f, mup_attn_scale_power = 1.0f;
    float       softmax_scale = 0.0f;
    // The gated MLP's quick-GEGLU, offset and clamp (TransformerConfig's glu_linear_offset and
    // activation_func_clamp_value; the clamp's None: not given).
    bool        quick_geglu = false;
    bool        attention_output_gate = false;   // --attention-output-gate (TransformerConfig's)
    bool        cross_entropy_loss_fusion = false;         // --cross-entropy-loss-fusion (ModelParallelConfig's)
    std::string cross_entropy_fusion_impl = "native";      // --cross-entropy-fusion-impl
    int64_t     cross_entropy_chunk_positions = 0;         // Loom's: positions per fused chunk (0: by bytes)
    // The gated delta-net (TransformerConfig's experimental_attention_variant and linear_* fields, Megatron's
    // defaults; "": None).
    std::string attention_variant, linear_attention_freq;
    int64_t     linear_conv_kernel_dim = 4, linear_key_head_dim = 128, linear_value_head_dim = 128;
    int64_t     linear_num_key_heads = 16, linear_num_value_heads = 32;
    // DeepSeek Sparse Attention (TransformerConfig's dsa_* fields, Megatron's defaults; 0: None).
    int64_t     dsa_indexer_n_heads = 0, dsa_indexer_head_dim = 0, dsa_indexer_topk = 0;
    int64_t     dsa_indexer_topk_freq = 1, dsa_indexer_skip_topk_offset = 0;
    float       dsa_indexer_loss_coeff = 0.0f, dsa_indexer_k_norm_epsilon = 0.0f;
    bool        dsa_indexer_use_sparse_loss = false, dsa_indexer_rope_interleaved = false, dsa_indexer_k_norm_fp32 = false;
    bool        dsa_indexer_rotate_activation = true, dsa_indexer_scoring_relu = true;
    std::string dsa_kernel_backend = "none";
    std::string window_size, window_skip_freq;   // --window-size "L,R" (tuple_type), --window-attn-skip-freq
    std::string softmax_type = "vanilla";         // --softmax-type (TransformerConfig's Literal)
    float       glu_linear_offset = 0.0f, activation_clamp = 0.0f;
    // FP8 (TransformerConfig's fields; "": --fp8-format None).
    std::string fp8_format, fp8_recipe = "delayed", fp8_amax_compute_algo = "most_recent";
    int64_t     fp8_margin = 0, fp8_amax_history_len = 1, fp8_bf16_first = 1, fp8_bf16_last = 1;
    bool        fp8_param_gather = false, first_last_layers_bf16 = false;
    bool        rotary_interleaved = false;
    int64_t     rotary_base = 0, kv_channels = 0;
    // Multi-latent attention (Megatron's defaults; q_lora_rank 0: None) and its RoPE's type and YaRN scaling.
    bool        mla = false;
    int64_t     q_lora_rank = 0, kv_lora_rank = 32, qk_head_dim = 128, qk_pos_emb_head_dim = 64, v_head_dim = 128;
    std::string rope_type;   // "": None (MLA: yarn)
    float       rotary_scaling_factor = 1.0f, mscale = 1.0f, mscale_all_dim = 0.0f;
    int64_t     mtp_num_layers = 0;              // 0: None
    float       mtp_loss_scaling_factor = 0.1f;
    uint64_t    seed = 0;
    float       hidden_dropout = 0.1f, attention_dropout = 0.1f;   // Megatron's defaults
};
std::span<const Flag<ModelFlags>> model_flags();
std::span<const Flag<TrainOptions>> model_option_flags();   // --model, --load-hf
// The flags given in `f` onto `o.model` (already the preset or --load-hf's shape); throws naming the flag.
void resolve_model_shape(const ModelFlags & f, const Given & given, TrainOptions & o);
// --norm-epsilon, --rotary-base, and the values Loom accepts of --rotary-percent and --kv-channels.
void check_model_flags(const ModelFlags & f, const Given & given, TrainOptions & o);
void check_dropout(const ModelFlags & f);

// --recompute-* (flags_recompute.cpp), Megatron's rules.
struct RecomputeFlags {
    std::string              granularity, method;   // "": None
    int64_t                  num_layers  = 0;
    bool                     activations = false;
    std::vector<std::string> modules;
    // --fine-grained-activation-offloading and its TransformerConfig fields (Megatron's defaults).
    bool                     offloading = false, delay_offload_until_cuda_graph = false;
    std::vector<std::string> offload_modules;
    int64_t                  min_offloaded_tensor_size = 1 << 20, delta_offload_bytes = 0;
    float                    activation_offload_fraction = 1.0f;
};
std::span<const Flag<RecomputeFlags>> recompute_flags();
void resolve_recompute(const RecomputeFlags & f, const Given & given, model::GptConfig & m);

// --num-experts and --moe-* (flags_moe.cpp), resolved into model.moe.
struct MoeFlags {
    int64_t                  num_experts = 0, topk = 2, ffn = 0, shared_ffn = 0;
    bool                     shared_gate = false;   // --moe-shared-expert-gate
    std::string              layer_freq = "1", score_function = "softmax", drop_policy = "probs";
    std::string              dispatcher = "allgather";
    std::string              router_dtype;   // --moe-router-dtype ("": None, the model's dtype)
    std::vector<std::string> load_balancing{"aux_loss"};
    std::vector<float>       aux_loss_coeff{0.0f};
    float                    z_loss_coeff = 0.0f, capacity_factor = 0.0f, topk_scaling = 0.0f;
    int64_t                  num_groups = 0, group_topk = 0;   // 0: None
    float                    bias_update_rate = 1e-3f;
    bool                     pre_softmax = false, pad = false, grouped_gemm = false, expert_bias = false;
    bool                     per_layer_logging = false;   // --moe-per-layer-logging
};
std::span<const Flag<MoeFlags>> moe_flags();
void resolve_moe(const MoeFlags & f, const Given & given, TrainOptions & o);

// --cuda-graph-* (flags_graphs.cpp), Megatron's rules, into layer_graphs and the MoE graph scopes.
struct GraphFlags {
    std::string              impl = "none";
    std::vector<std::string> modules, scope;
    bool                     enable = false, external = false;
};
std::span<const Flag<GraphFlags>> graph_flags();
std::span<const Flag<TrainOptions>> graph_option_flags();   // --cuda-graph-warmup-steps
void resolve_cuda_graphs(const GraphFlags & f, const MoeFlags & moe, TrainOptions & o);

// Parallelism (flags_parallel.cpp): the sizes, the layer split over stages, DDP and the hybrid optimizer.
struct ParallelFlags {
    int64_t tensor_parallel_size        = 1;   // --tensor-model-parallel-size
    int64_t pipeline_parallel_size      = 1;   // --pipeline-model-parallel-size
    int64_t virtual_pipeline_size       = 0;   // --num-virtual-stages-per-pipeline-rank (0: none)
    int64_t expert_parallel_size        = 1;   // --expert-model-parallel-size
    int64_t expert_tensor_parallel_size = 1;   // --expert-tensor-parallel-size (default: the dense tp)
    int64_t context_parallel_size = 1;
    int64_t bucket_size           = 0;       // --ddp-bucket-size, applied when given
    bool    grads_in_fp32         = false;   // --accumulate-allreduce-grads-in-fp32
    bool    grad_reduce_in_bf16   = false;   // --grad-reduce-in-bf16: with --bf16, bf16 gradient buffers
    bool    overlap_param_gather_with_optimizer_step = false;   // accepted under Megatron's rules
    bool    tp_comm_overlap = false;   // --tp-comm-overlap: accepted under Megatron's rule (sequence parallelism)
    std::string tp_comm_overlap_cfg;   // --tp-comm-overlap-cfg: Transformer Engine's userbuffer settings (unread)
    // --cp-comm-type (one value, or one per layer) and --hierarchical-context-parallel-sizes: how context-
    // parallel ranks exchange keys and values, validated as Megatron does; without context parallelism
    // (the only size Loom runs) nothing is exchanged.
    std::vector<std::string> cp_comm_type{"p2p"};
    std::vector<std::string> hierarchical_cp_sizes;
    // Megatron-FSDP (ddp/ddp.h): --use-megatron-fsdp and its strategy and dtype choices, Megatron's defaults.
    bool        use_megatron_fsdp     = false;
    bool        use_torch_fsdp2       = false;   // run as Megatron-FSDP optim_grads_params, under its own rules
    int64_t     megatron_fsdp_version = 1;
    std::string data_parallel_sharding_strategy = "optim_grads_params";
    std::string outer_dp_sharding_strategy      = "no_shard";
    std::string fsdp_main_params_dtype = "fp32", fsdp_main_grads_dtype = "auto", fsdp_grad_comm_dtype = "auto";
};
std::span<const Flag<ParallelFlags>> parallel_flags();
std::span<const Flag<TrainOptions>> parallel_option_flags();
std::span<const Flag<ddp::DdpConfig>> ddp_flags();
std::span<const Flag<optim::HybridOptions>> offload_flags();
// The sizes against `world_size`, validated once (parallel/parallel_config.h): TrainOptions::parallel, the
// data-parallel size and the experts' tensor-parallel size (before the model is resolved). `num_experts`: the
// MoE layers' experts (--num-experts', or the --model preset's; 0: none), which expert parallelism must divide.
void resolve_parallel_sizes(const ParallelFlags & f, int64_t num_experts, const Given & given, int64_t world_size,
                            TrainOptions & o);
// --ddp-bucket-size when given, DDP's rules and the NaN flags' contradiction.
void resolve_ddp(const ParallelFlags & f, const Given & given, TrainOptions & o);
// --use-megatron-fsdp / --use-torch-fsdp2 and their choices into o.ddp (flags_fsdp.cpp; resolve_ddp calls it).
void resolve_fsdp(const ParallelFlags & f, const Given & given, TrainOptions & o);
void check_offload(const TrainOptions & o);
// The model's split over tensor-parallel ranks and pipeline stages (after the model is resolved).
void validate_layout(const TrainOptions & o);

// Batch, iterations, learning rate and Adam (flags_optim.cpp).
struct OptimFlags {
    float decoupled_lr = 0.0f, decoupled_min_lr = 0.0f;   // applied when given
    // --optimizer and Muon's flags (Megatron's defaults), resolved into TrainOptions::muon.
    std::string optimizer              = "adam";
    float       muon_momentum          = 0.9f;
    bool        muon_split_qkv         = true;
    bool        muon_nesterov          = false;
    std::string muon_scale_mode        = "spectral";
    std::string muon_fp32_matmul_prec  = "medium";
    std::string muon_coefficient_type  = "quintic";
    int64_t     muon_num_ns_steps      = 5;
    std::string muon_tp_mode           = "duplicated";
    bool        muon_use_syrk          = false;
    float       muon_extra_scale_factor = 1.0f;
    std::string muon_scalar_optimizer  = "adam";
    bool        use_layer_wise_param_layout = true;
};
std::span<const Flag<OptimFlags>> optim_flags();
std::span<const Flag<TrainOptions>> schedule_flags();
std::span<const Flag<optim::AdamWConfig>> adam_flags();
void resolve_decoupled_lr(const OptimFlags & f, const Given & given, TrainOptions & o);
// --optimizer adam or muon (dist_muon: muon with --use-distributed-optimizer), Muon's flags into
// TrainOptions::muon, and what Muon cannot run with refused by name (after resolve_ddp).
void resolve_optimizer(const OptimFlags & f, TrainOptions & o);
// The global batch (default micro x dp) and its divisibility.
void resolve_batch(const Given & given, TrainOptions & o);
// Megatron's schedule rules; sample-based training sets train_iters, unset decay lengths the run's.
void resolve_schedule(const Given & given, TrainOptions & o);
void validate_hyperparameters(const TrainOptions & o);
// --fp16 refused; --bf16 into the model's parameter dtype.
void resolve_precision(TrainOptions & o);

// Checkpoints and the exit flags (flags_checkpoint.cpp).
std::span<const Flag<TrainOptions>> checkpoint_flags();
void validate_checkpoint_flags(const TrainOptions & o, const Given & given);

// Logging, TensorBoard, validation and the run's own outputs (flags_logging.cpp).
std::span<const Flag<TrainOptions>> logging_flags();
void validate_logging(const Given & given, const TrainOptions & o);

// Data sources and the tokenizer (flags_data.cpp).
std::span<const Flag<TrainOptions>> data_flags();
void validate_data(const Given & given, const TrainOptions & o, bool data_optional);

// The step that reads files (resolve_files.cpp): --load-hf's config.json, the tokenizer's vocabulary and
// --use-checkpoint-args' index, each where the flags' order of precedence needs it.
// --load-hf: its shape (the model, unless --model is given too); the check that the flags agree with it.
std::optional<model::GptConfig> read_hf_shape(const Given & given, TrainOptions & o);
void check_hf_shape(const model::GptConfig & hf, const ModelFlags & f, const Given & given, const TrainOptions & o);
void apply_tokenizer(TrainOptions & o, bool vocab_size_given);
void apply_checkpoint_shape(TrainOptions & o);

}  // namespace loom::train
