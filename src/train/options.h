// The options of `loom train` and `loom eval`, resolved: what every part of a run reads. The flags that fill
// them (Megatron's spellings, defaults and help, one table per config) are parsed by train/options_parser.h.
//
// A model is a preset (--model, Loom's shortcut; default gpt-tiny) overridden by any of Megatron's model
// flags given explicitly.
#pragma once

#include "ddp/ddp.h"
#include "model/gpt_config.h"
#include "optim/adamw.h"
#include "optim/loss_scaler.h"
#include "optim/lr_schedule.h"
#include "pipeline/layer_assignment.h"
#include "optim/hybrid_optimizer.h"
#include "optim/muon.h"
#include "parallel/parallel_config.h"

#include <cstdint>
#include <limits>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

struct TrainOptions {
    // Model.
    std::string model_preset = "gpt-tiny";
    model::GptConfig model;          // resolved: preset + explicit flags
    std::string load_hf;             // Hugging Face GPT-2 folder: the shape from its config.json, its weights
                                     // loaded after init (model/hf_gpt2.h)

    // Batch and iterations.
    int64_t micro_batch_size  = 8;
    int64_t global_batch_size = 0;   // 0: micro_batch_size x dp
    int64_t train_iters       = 300;
    // A global batch that grows with the samples consumed: --step-batch-size-schedule "THRESHOLD:BATCH ..."
    // (thresholds in tokens, K/M/B/T suffixes, the first 0; Megatron then sets the global batch to micro x
    // dp, which the learning-rate schedule and the validation batch use) or the older --rampup-batch-size
    // START INCREMENT SAMPLES (from START to --global-batch-size in equal steps over SAMPLES samples).
    // Resolved into batch_schedule: (first sample, global batch) pairs, the first at 0; empty: constant.
    std::string                              step_batch_size_schedule;
    std::vector<std::string>                 rampup_batch_size;
    std::vector<std::pair<int64_t, int64_t>> batch_schedule;
    int64_t eval_global_batch_size = 0;   // --eval-global-batch-size; 0: the global batch
    // The global batch of the iteration that starts after `consumed` samples.
    int64_t global_batch_size_at(int64_t consumed) const;
    // The samples train_iters iterations consume.
    int64_t train_samples_total() const;

    // Optimizer and schedule.
    optim::AdamWConfig adam{2e-3f};
    float              min_lr           = 0.0f;       // Megatron's defaults: no warmup, linear decay to 0
    std::optional<optim::MuonConfig> muon;                // --optimizer muon (unset: adam)
    // --optimizer as Megatron names the one resolved: "muon" or "adam" (the checkpoint's arg).
    const char * optimizer() const { return muon ? "muon" : "adam"; }
    std::optional<float> decoupled_lr, decoupled_min_lr;   // the embedding's and output layer's (None: --lr, --min-lr)
    int64_t            lr_warmup_iters  = 0;
    std::string        lr_decay_style   = "linear";
    int64_t            lr_decay_iters   = 0;   // 0: train_iters
    // Megatron's other ways to give the schedule: in samples (--train-samples, --lr-decay-samples,
    // --lr-warmup-samples), as a fraction of the decay (--lr-warmup-fraction), and WSD's anneal.
    int64_t            train_samples        = 0;    // 0: iteration-based
    int64_t            lr_decay_samples     = 0;
    int64_t            lr_warmup_samples    = 0;
    double             lr_warmup_fraction   = -1;   // < 0: not given
    float              lr_warmup_init       = 0.0f;
    std::string        lr_wsd_decay_style   = "exponential";
    int64_t            lr_wsd_decay_iters   = 0;
    int64_t            lr_wsd_decay_samples = 0;
    // The schedule in Megatron's units (samples), from the flags above and the global batch.
    optim::LrSchedule lr_schedule() const;
    float              clip_grad        = 1.0f;
    bool               bf16             = false;
    bool               fp16             = false;   // f16 parameters and GEMM operands, with a loss scaler
    // The loss scaler (optim/loss_scaler.h): --loss-scale (0: none given, dynamic with --fp16), and the
    // dynamic scaler's --initial-loss-scale, --min-loss-scale, --loss-scale-window and --hysteresis.
    float              loss_scale         = 0.0f;
    float              initial_loss_scale = 4294967296.0f;
    float              min_loss_scale     = 1.0f;
    double             loss_scale_window  = 1000;
    int64_t            hysteresis         = 2;
    // The scaler these ask for: with --fp16, or with --bf16 and --loss-scale (Megatron's rule); none otherwise.
    std::optional<optim::LossScalerOptions> loss_scaler() const;
    // Hybrid device optimizer (optim/hybrid_optimizer.h): --optimizer-cpu-offload, with
    // --optimizer-offload-fraction, --overlap-cpu-optimizer-d2h-h2d, --no-pin-cpu-grads, --no-pin-cpu-params.
    bool                 optimizer_cpu_offload = false;
    // --use-precision-aware-optimizer (Megatron: Transformer Engine's FusedAdam, which the CPU offload needs)
    // with its state dtypes; Loom's AdamW keeps every one of them in f32 (the flags' defaults): other values
    // are refused by name.
    bool                 use_precision_aware_optimizer = false;
    std::string          main_grads_dtype = "fp32", main_params_dtype = "fp32", exp_avg_dtype = "fp32",
                         exp_avg_sq_dtype = "fp32";
    optim::HybridOptions offload;

    // Parallelism: the layout resolve() made of the size flags (ParallelFlags, train/flag_values.h) for the
    // world size, validated there and only there (parallel/parallel_config.h): every size is read from it
    // (tp(), pp(), dp(), ep(), etp(), vpp()), and the process groups are built from it.
    parallel::ParallelConfig parallel;
    bool           sequence_parallel      = false;   // --sequence-parallel (with tensor parallelism)
    // --tp-comm-overlap: the sequence-parallel linears' collectives as rings beside their GEMMs
    // (model::TensorParallel::overlap).
    bool           tp_comm_overlap        = false;
    bool           moe_per_layer_logging  = false;   // --moe-per-layer-logging: per-layer router losses to TensorBoard
    // --overlap-param-gather-with-optimizer-step: under Megatron's rules, and like Megatron every model chunk
    // then lays out unbucketed (ddp/layout.h).
    bool           overlap_param_gather_with_optimizer_step = false;
    // --cp-comm-type: one for every layer, or one per layer (context parallelism, model::ContextParallel).
    std::vector<model::CpCommType> cp_comm_types{model::CpCommType::p2p};
    // --hierarchical-context-parallel-sizes (a2a+p2p: the all-to-all's size, then the ring's); empty: none.
    std::vector<int64_t>           hierarchical_cp_sizes;
    int64_t        microbatch_group_size  = 0;   // --microbatch-group-size-per-virtual-pipeline-stage (0: pp)
    int64_t        layers_per_virtual_stage = 0;   // --num-layers-per-virtual-pipeline-stage (0: unset)
    int64_t        first_stage_layers       = 0;   // --decoder-first-pipeline-num-layers (0: even split)
    int64_t        last_stage_layers        = 0;   // --decoder-last-pipeline-num-layers (0: even split)
    bool           account_for_embedding_in_pipeline_split = false;   // the embedding counts as a layer
    bool           account_for_loss_in_pipeline_split      = false;   // the loss counts as a layer
    std::string    pipeline_layout;   // --pipeline-model-parallel-layout ("": none; pipeline/layer_assignment.h)

    // How the layers split over pipeline stages and virtual stages (pipeline/layer_assignment.h).
    pipeline::LayerSplitOptions layer_split() const;
    ddp::DdpConfig ddp;                 // --use-distributed-optimizer, --overlap-grad-reduce, ...
    // A non-finite loss or gradient norm stops the run (exit 1), as Megatron's default; off
    // (--no-check-for-nan-in-loss-and-grad), such an iteration skips its update and counts as a nan iteration.
    bool           check_for_nan_in_loss_and_grad = true;
    // The rerun state machine (train/rerun.h): --rerun-mode, --error-injection-rate, --error-injection-type.
    std::string    rerun_mode           = "validate_results";   // Megatron's default
    int64_t        error_injection_rate = 0;
    std::string    error_injection_type = "transient_error";
    // Per-layer graphs (graphs/layer_graph_runner.h): --cuda-graph-impl transformer_engine captures every
    // transformer layer's forward and backward after --cuda-graph-warmup-steps eager iterations of this run.
    bool           layer_graphs = false;
    int64_t        cuda_graph_warmup_steps = 3;   // Megatron's default
    // --cuda-graph-modules attn moe_router [moe_preprocess]: MoE layers captured up to their router (and
    // their dispatch plan); the rest runs eagerly (graphs/layer_graph_runner.h).
    bool           graph_moe_router = false, graph_moe_preprocess = false;
    bool           graph_attn = false;   // --cuda-graph-modules attn: the MLP or MoE layer outside the graphs
    // --cuda-graph-impl full_iteration: each iteration's forward and backward passes one graph, captured after the
    // warm-up (graphs/full_iteration_graph.h).
    bool           full_iteration_graph = false;
    int64_t        distributed_timeout_minutes = 10;   // the MPI watchdog (comm/mpi_communicator.h)
    // --check-weight-hash-across-dp-replicas-interval: every this many iterations the data-parallel replicas
    // compare a digest of each parameter (0: never).
    int64_t        check_weight_hash_interval = 0;
    bool           print_layout = false;   // print DDP's buffer layout on rank 0
    std::string    device = "auto";        // --device: auto (cuda when built with it and a GPU is visible), cpu, cuda
    int64_t        logging_level = -1;         // --logging-level (-1: None; then MEGATRON_LOGGING_LEVEL)
    std::string    timeline_file;          // --timeline: the last iteration's measured pipeline timeline (SVG)

    // Data.
    // --data-path: one Megatron .bin/.idx prefix, several, or weight/prefix pairs (data/blended_dataset.h),
    // cut by --split; or Megatron's blend per split, each dataset whole (--train-data-path, ...).
    std::vector<std::string> data_path;
    std::vector<std::string> train_data_path, valid_data_path, test_data_path;
    std::string              data_cache_path;                    // --data-cache-path (data/index_cache.h)
    double                   mid_level_dataset_surplus = 0.005;   // extra samples built per blended dataset
    bool        per_split_data() const {
        return !train_data_path.empty() || !valid_data_path.empty() || !test_data_path.empty();
    }
    std::string split = "969,30,1";
    std::string text_file;          // a plain text file, byte tokens
    std::string llmc_shard;         // an llm.c token shard
    bool        use_tp_pp_dp_mapping = false;   // ranks ordered tp-cp-ep-pp-dp instead of tp-cp-ep-dp-pp
    bool        mock_data = false;  // --mock-data: Loom's synthetic dataset (a sparse Markov chain)
    // --tokenizer-type GPT2BPETokenizer (with --vocab-file, --merge-file) or NullTokenizer (with --vocab-size):
    // the vocabulary size comes from the tokenizer, padded as Megatron pads it; the data's ids must fit it.
    std::string tokenizer_type, vocab_file, merge_file;
    // --fim-data: fill-in-the-middle samples (data/fim.h), with Megatron's defaults; an empty string and a NaN
    // rate stand for Megatron's None.
    bool        fim_data = false;
    double      fim_rate = 0.5, fim_spm_rate = 0.5;
    double      fim_fragment_rate = std::numeric_limits<double>::quiet_NaN();
    std::string fim_split_sample, fim_no_prefix;
    std::string fim_prefix_token = "<fim_prefix>", fim_middle_token = "<fim_middle>", fim_suffix_token = "<fim_suffix>",
                fim_pad_token = "<fim_pad>", fim_eod_token = "<|endoftext|>";

    // Checkpoints (train/checkpointing.h): Megatron's flags and defaults.
    std::string save;                       // --save DIR
    std::string load;                       // --load DIR
    int64_t     save_interval = 0;          // --save-interval (0: only at the end)
    bool        async_save    = false;      // --async-save: written from a host snapshot on a thread
    bool        log_progress  = false;      // --log-progress: <save>/progress.txt (train/progress_log.h)
    int64_t     save_retain_interval = 0;   // --save-retain-interval: keep only multiples of it and the latest
    bool        no_save_optim = false, no_load_optim = false, no_load_rng = false, finetune = false;
    int64_t     ckpt_step = -1;             // --ckpt-step (-1: the tracker's iteration)
    std::string ckpt_format = "torch_dist"; // the only format: Loom's, under Megatron's default name
    bool        use_checkpoint_args = false;
    // --dist-ckpt-strictness: what a --load does with the model's tensors the checkpoint lacks ("unexpected")
    // and the checkpoint's tensors the model does not use ("missing"); Megatron's values and default.
    std::string dist_ckpt_strictness = "assume_ok_unexpected";
    // The schedule a --load resumes (train/checkpointing.h): by default the flags must give the
    // checkpoint's; --override-opt_param-scheduler takes the flags', --use-checkpoint-opt_param-scheduler
    // the checkpoint's.
    bool        override_opt_param_scheduler = false, use_checkpoint_opt_param_scheduler = false;
    bool        exit_on_missing_checkpoint = false;   // --load without a checkpoint is an error, not a warning
    int64_t     exit_interval = 0;          // --exit-interval: stop (after saving) at a multiple of it
    double      exit_duration_in_mins = 0;  // --exit-duration-in-mins: stop (after saving) past it
    bool        exit_signal_handler = false;   // the --exit-signal: finish the iteration, save, exit 0
    std::string exit_signal = "SIGTERM";       // --exit-signal: Python's signal.Signals name of the signal

    // Validation: every --eval-interval iterations (0: none) and after training, --eval-iters batches.
    int64_t     eval_interval = 0;
    int64_t     eval_iters    = 100;

    // TensorBoard (train/tensorboard.h): Megatron's scalars under Megatron's tags, rank 0 writes.
    std::string tensorboard_dir;
    int64_t     tensorboard_log_interval          = 1;
    int64_t     tensorboard_queue_size            = 1000;   // accepted; every logged iteration is flushed
    bool        log_timers_to_tensorboard         = false;
    bool        log_memory_to_tensorboard         = false;
    bool        log_validation_ppl_to_tensorboard = false;
    bool        log_loss_scale_to_tensorboard     = true;   // --no-log-loss-scale-to-tensorboard
    bool        log_world_size_to_tensorboard     = false;
    int64_t     timing_log_level      = 0;       // >= 1: Megatron's timers block after each log line
    std::string timing_log_option     = "minmax";   // the block's form: max, minmax or all
    bool        log_params_norm       = false;   // " params norm: " in the log line (after the step)
    bool        log_num_zeros_in_grad = false;   // " num zeros: " in the log line

    // Logging.
    int64_t     log_interval = 100;
    std::string log_file;           // JSON lines, one object per logged iteration (rank 0 writes it)
    // --wandb-project, --wandb-entity, --wandb-exp-name, --wandb-save-dir: accepted with a warning (no W&B
    // client here; the scalars go to TensorBoard and --log-file).
    std::string wandb_project, wandb_entity, wandb_exp_name, wandb_save_dir;
    bool        log_throughput = false;   // --log-throughput: the TFLOP/s field of the log line
    // --profile: a Chrome trace of every stream's work (core/profiler.h) for the iterations after
    // --profile-step-start completed ones up to --profile-step-end (Megatron's window: 11 and 12 by default),
    // on --profile-ranks (none given: every rank), written to --tensorboard-dir (else --save, else the
    // working folder) as loom_profile_rank<R>.json.
    bool                     profile              = false;
    int64_t                  profile_step_start   = 10;
    int64_t                  profile_step_end     = 12;
    std::vector<std::string> profile_ranks;
    bool                     use_pytorch_profiler = false;   // accepted: Loom's trace is the same either way
    std::string              profile_file(int rank) const;

    // Micro-batches per iteration on each data-parallel rank.
    int64_t num_microbatches() const { return global_batch_size / (micro_batch_size * parallel.dp()); }
    int64_t eval_num_microbatches() const {
        return (eval_global_batch_size > 0 ? eval_global_batch_size : global_batch_size) / (micro_batch_size * parallel.dp());
    }
};

// What one rank of a training run needs, estimated before anything is allocated (bytes, as doubles: the
// sizes may be absurd). weights: the parameter dtype; grads: the main_grad buffers (f32, or 16-bit with the
// optimizer's f32 copies: ddp/ddp.h); optimizer: f32 m and v, plus the f32 master with --bf16, divided over
// data-parallel ranks with --use-distributed-optimizer;
// activations: Megatron's s·b·h·34 bytes per layer (16-bit; without its 5·a·s² term, as Loom's tiled
// attention keeps no s x s scores), doubled for f32, over TP, for the layers of one stage and as many
// micro-batches as the first stage holds (pp), plus three f32 copies of the logits (s·b·V/tp). GPT-2 124M,
// micro-batch 1, sequence 1024, f32: 1.26 GiB estimated, 1.33 GiB measured (the allocator's peak).
struct MemoryEstimate {
    double weights = 0, grads = 0, optimizer = 0, activations = 0;
    double total() const { return weights + grads + optimizer + activations; }
};
MemoryEstimate estimate_memory(const TrainOptions & options);

// Refuses a run whose estimate, times the ranks on this machine, exceeds its memory, naming the flags.
void check_memory(const TrainOptions & options, int64_t world_size);

}  // namespace loom::train
