#include "train/options.h"

#include "core/error.h"
#include "train/checkpointing.h"
#include "train/megatron_flags.h"
#include "data/blended_dataset.h"
#include "data/gpt2_bpe.h"
#include "model/hf_gpt2.h"
#include "model/moe/moe_config.h"
#include "pipeline/layer_assignment.h"
#include "pipeline/schedule.h"

#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <filesystem>
#include <unistd.h>
#include <optional>

namespace loom::train {

TrainOptionParser::TrainOptionParser(CLI::App & app) : app_(app) {
    TrainOptions & o = opts_;
    // argparse's rule: a flag given twice takes its last value (launch scripts append "$@" to their flags).
    app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    // Flags CLI11 does not know are collected and refused together in resolve(), one per line.
    app.allow_extras();
    app.add_option("--model", o.model_preset,
                   "model preset: gpt-tiny, llama-tiny, gpt2-124m, gpt2-350m, gpt2-774m, gpt2-1.5b")->capture_default_str();
    app.add_option("--num-layers", num_layers_, "transformer layers");
    app.add_option("--hidden-size", hidden_size_, "hidden size");
    app.add_option("--ffn-hidden-size", ffn_hidden_size_,
                   "MLP hidden size (default 4 x hidden; int(8 x hidden / 3 / 64) x 64 with --swiglu)");
    app.add_option("--num-attention-heads", heads_, "attention heads");
    app.add_flag("--group-query-attention", gqa_, "use grouped-query attention (with --num-query-groups)");
    app.add_option("--num-query-groups", query_groups_, "key/value heads with --group-query-attention");
    app.add_option("--seq-length", seq_length_, "sequence length");
    app.add_option("--max-position-embeddings", max_pos_, "learned position embeddings");
    app.add_option("--vocab-size", vocab_size_, "vocabulary size (default: the dataset's)");
    app.add_option("--make-vocab-size-divisible-by", vocab_divisible_, "pad the vocabulary to a multiple of this");
    app.add_option("--normalization", normalization_, "LayerNorm or RMSNorm");
    app.add_flag("--swiglu", swiglu_, "SwiGLU MLP");
    app.add_option("--position-embedding-type", position_embedding_, "learned_absolute, rope or none");
    app.add_flag("--disable-bias-linear", disable_bias_, "no biases in linear layers");
    app.add_flag("--qk-layernorm", qk_layernorm_,
                 "normalise each query and key head (over the head dimension, with --normalization) before RoPE");
    app.add_flag("--untie-embeddings-and-output-weights", untie_, "separate output layer weight");
    app.add_option("--init-method-std", init_std_, "std of the normal initialisation");
    app.add_option("--norm-epsilon", norm_epsilon_, "epsilon of LayerNorm / RMSNorm (default 1e-5)");
    app.add_option("--rotary-base", rotary_base_, "base of the rotary embeddings' frequencies (default 10000)");
    app.add_option("--rotary-percent", rotary_percent_, "share of the head dimension rotated (only 1.0 in Loom)");
    app.add_option("--kv-channels", kv_channels_, "head dimension (only hidden / heads in Loom)");
    app.add_option("--seed", seed_, "random seed (initialisation and data order)");
    app.add_option("--load-hf", o.load_hf,
                   "Hugging Face GPT-2 folder (config.json + model.safetensors): its shape and weights");

    app.add_option("--micro-batch-size", o.micro_batch_size, "sequences per microbatch")->capture_default_str();
    app.add_option("--global-batch-size", o.global_batch_size, "sequences per iteration (default: micro x dp)");
    app.add_option("--train-iters", o.train_iters, "training iterations")->capture_default_str();
    app.add_option("--lr", o.adam.lr, "maximum learning rate")->capture_default_str();
    app.add_option("--min-lr", o.min_lr, "minimum learning rate")->capture_default_str();
    app.add_option("--decoupled-lr", decoupled_lr_,
                   "the word embedding's and output layer's learning rate, on the same schedule (default: --lr)");
    app.add_option("--decoupled-min-lr", decoupled_min_lr_,
                   "their minimum learning rate (default: --min-lr)");
    app.add_option("--lr-warmup-iters", o.lr_warmup_iters, "linear warmup iterations")->capture_default_str();
    app.add_option("--lr-decay-style", o.lr_decay_style, "constant, linear or cosine")->capture_default_str();
    app.add_option("--lr-decay-iters", o.lr_decay_iters, "iterations to decay over (default: --train-iters)");
    app.add_option("--train-samples", o.train_samples, "samples to train on (sample-based; instead of --train-iters)");
    app.add_option("--lr-decay-samples", o.lr_decay_samples, "samples to decay over (default: --train-samples)");
    app.add_option("--lr-warmup-samples", o.lr_warmup_samples, "linear warmup samples (sample-based)");
    app.add_option("--lr-warmup-fraction", o.lr_warmup_fraction, "warmup as a fraction of the decay");
    app.add_option("--lr-warmup-init", o.lr_warmup_init, "learning rate at the start of warmup")->capture_default_str();
    app.add_option("--lr-wsd-decay-style", o.lr_wsd_decay_style, "WSD anneal: exponential, linear, cosine or "
                                                                  "minus_sqrt")->capture_default_str();
    app.add_option("--lr-wsd-decay-iters", o.lr_wsd_decay_iters, "iterations of the WSD anneal");
    app.add_option("--lr-wsd-decay-samples", o.lr_wsd_decay_samples, "samples of the WSD anneal");
    app.add_option("--weight-decay", o.adam.weight_decay, "decoupled weight decay")->capture_default_str();
    app.add_option("--adam-beta1", o.adam.beta1, "Adam beta1")->capture_default_str();
    app.add_option("--adam-beta2", o.adam.beta2, "Adam beta2")->capture_default_str();
    app.add_option("--adam-eps", o.adam.eps, "Adam epsilon")->capture_default_str();
    app.add_option("--clip-grad", o.clip_grad, "clip gradients to this global norm (0: off)")->capture_default_str();
    app.add_flag("--bf16", o.bf16, "bf16 parameters, GEMM operands and saved activations; f32 grads and master weights");
    app.add_flag("--fp16", o.fp16, "float16 with loss scaling (not supported: use --bf16)");

    app.add_flag("--optimizer-cpu-offload", o.optimizer_cpu_offload,
                 "step part of the optimizer on the host (hybrid device optimizer)");
    app.add_option("--optimizer-offload-fraction", o.offload.offload_fraction,
                   "share of the optimizer state (a prefix of the parameters) stepped on the host, in [0, 1]")
        ->capture_default_str();
    app.add_flag("--overlap-cpu-optimizer-d2h-h2d", o.offload.overlap_d2h_h2d,
                 "one host optimizer per parameter, overlapped with the gradient and parameter copies");
    app.add_flag("--no-pin-cpu-grads", no_pin_cpu_grads_, "host gradient buffers in pageable memory");
    app.add_flag("--no-pin-cpu-params", no_pin_cpu_params_, "host master weights and state in pageable memory");

    app.add_flag("--use-distributed-optimizer", o.ddp.use_distributed_optimizer,
                 "ZeRO-1: shard the optimizer state and f32 master weights over data-parallel ranks");
    app.add_flag("--overlap-grad-reduce", o.ddp.overlap_grad_reduce,
                 "reduce each bucket group's gradients as soon as backward has produced them");
    app.add_flag("--overlap-param-gather", o.ddp.overlap_param_gather,
                 "all-gather updated parameters lazily before each layer's forward (distributed optimizer)");
    app.add_option("--ddp-bucket-size", bucket_size_, "elements per gradient bucket (default max(40M, 1M x dp) "
                                                      "with --overlap-grad-reduce, else one bucket)");
    app.add_flag("--ddp-average-in-collective", o.ddp.average_in_collective,
                 "average in the collective instead of scaling gradients by 1/dp first");
    app.add_flag("--ddp-pad-buckets-for-high-nccl-busbw", o.ddp.pad_buckets_for_high_nccl_busbw,
                 "pad buckets to a multiple of lcm(dp, 128, 65536)");
    app.add_flag("--accumulate-allreduce-grads-in-fp32", grads_in_fp32_,
                 "accumulate and reduce gradients in f32 (always on in Loom)");
    app.add_flag("--check-for-nan-in-loss-and-grad", o.ddp.check_for_nan_in_grad,
                 "stop on a non-finite loss or gradient norm (the default); given explicitly, also scan every "
                 "bucket before its reduction to name the rank and parameter (a host pass over the gradients)");
    app.add_flag("--no-check-for-nan-in-loss-and-grad", no_check_nan_,
                 "skip the update of an iteration whose loss or gradient norm is not finite, and go on");
    app.add_option("--distributed-timeout-minutes", o.distributed_timeout_minutes,
                   "abort the job when a collective or transfer waits this long for another rank")
        ->capture_default_str();
    app.add_flag("--print-layout", o.print_layout, "print the DDP buffer layout (as `loom layout`) on rank 0");
    app.add_option("--device", o.device,
                   "where the model trains: cpu, cuda (one GPU per rank, NCCL between ranks), cuda-emu (the CUDA "
                   "backend on an emulated GPU that runs on the CPU), or auto: cuda when this build has the CUDA "
                   "backend and a GPU is visible, else cpu")
        ->capture_default_str();
    app.add_option("--timeline", o.timeline_file,
                   "write the last iteration's measured pipeline timeline (one row per stage) as an SVG");
    app.add_option("--num-virtual-stages-per-pipeline-rank", o.virtual_pipeline_size,
                   "model chunks per pipeline rank (interleaved 1F1B)");
    app.add_option("--microbatch-group-size-per-virtual-pipeline-stage", o.microbatch_group_size,
                   "micro-batches per group of the interleaved schedule (default: the pipeline size)");
    app.add_option("--tensor-model-parallel-size", o.tensor_parallel_size,
                   "tensor-parallel ranks (heads, MLP features and vocabulary split)")->capture_default_str();
    app.add_flag("--sequence-parallel", o.sequence_parallel,
                 "norms and the residual stream on sequence shards; all-gather / reduce-scatter in place of all-reduce");
    app.add_option("--num-layers-per-virtual-pipeline-stage", o.layers_per_virtual_stage,
                   "layers per model chunk (the other way to ask for virtual stages)");
    app.add_option("--decoder-first-pipeline-num-layers", o.first_stage_layers, "layers of the first pipeline stage");
    app.add_option("--decoder-last-pipeline-num-layers", o.last_stage_layers, "layers of the last pipeline stage");
    app.add_option("--pipeline-model-parallel-size", o.pipeline_parallel_size,
                   "pipeline stages (1F1B); the ranks mpirun starts are pp x dp")->capture_default_str();

    // nargs='*' lists; given twice, the last list wins (argparse's rule), which trigger_on_parse gives.
    app.add_option("--data-path", o.data_path,
                   "Megatron dataset prefix(es) PREFIX [PREFIX ...] (PREFIX.bin / PREFIX.idx; several are weighted by "
                   "their sizes), or weight/prefix pairs W1 PREFIX1 W2 PREFIX2 ..., split by --split")
        ->expected(1, -1)->trigger_on_parse();
    app.add_option("--train-data-path", o.train_data_path,
                   "the training blend, as --data-path, each dataset whole (instead of --data-path and --split)")
        ->expected(1, -1)->trigger_on_parse();
    app.add_option("--valid-data-path", o.valid_data_path, "the validation blend, as --train-data-path")
        ->expected(1, -1)->trigger_on_parse();
    app.add_option("--test-data-path", o.test_data_path, "the test blend, as --train-data-path")
        ->expected(1, -1)->trigger_on_parse();
    app.add_option("--data-cache-path", o.data_cache_path,
                   "folder to cache the datasets' document, sample and shuffle indices in (.npy), and load them from");
    app.add_option("--mid-level-dataset-surplus", o.mid_level_dataset_surplus,
                   "the share of extra samples each dataset of a weighted blend is built with")
        ->capture_default_str();
    app.add_option("--tokenizer-type", o.tokenizer_type,
                   "GPT2BPETokenizer (the vocabulary of --vocab-file and --merge-file) or NullTokenizer "
                   "(--vocab-size ids); without it the vocabulary is the data's largest id + 1");
    app.add_option("--vocab-file", o.vocab_file, "GPT-2 BPE vocabulary (vocab.json) for GPT2BPETokenizer");
    app.add_option("--merge-file", o.merge_file, "GPT-2 BPE merges (merges.txt) for GPT2BPETokenizer");
    app.add_flag("--mock-data", o.mock_data,
                 "train on Loom's synthetic dataset (a random sparse Markov chain over --vocab-size tokens, "
                 "default 512, with a known entropy floor)");
    app.add_option("--split", o.split, "train,valid,test weights over documents")->capture_default_str();
    app.add_option("--text-file", o.text_file, "a plain text file, tokenised by bytes");
    app.add_option("--llmc-shard", o.llmc_shard, "an llm.c token shard");
    app.add_option("--save", o.save, "folder to save checkpoints to (DIR/iter_XXXXXXX)");
    app.add_option("--load", o.load, "folder to resume from (its latest_checkpointed_iteration.txt, or --ckpt-step)");
    app.add_option("--save-interval", o.save_interval, "iterations between checkpoints (and one at the end)");
    app.add_flag("--no-save-optim", o.no_save_optim, "save the parameters only");
    app.add_flag("--no-load-optim", o.no_load_optim, "load the parameters only; the optimizer starts afresh");
    app.add_flag("--no-load-rng", o.no_load_rng, "do not load the random state (Loom keeps none after initialisation)");
    app.add_flag("--finetune", o.finetune, "load the parameters only and start from iteration 0");
    app.add_option("--ckpt-step", o.ckpt_step, "load this iteration instead of the latest");
    app.add_option("--ckpt-format", o.ckpt_format, "checkpoint format: torch_dist (Loom's reshardable format)")
        ->capture_default_str();
    app.add_flag("--use-checkpoint-args", o.use_checkpoint_args, "take the model's shape from the --load checkpoint");
    app.add_flag("--exit-on-missing-checkpoint", o.exit_on_missing_checkpoint,
                 "stop with an error when --load holds no checkpoint (default: a warning, then train from scratch)");
    app.add_option("--exit-interval", o.exit_interval, "stop (after saving) when the iteration is a multiple of this");
    app.add_option("--exit-duration-in-mins", o.exit_duration_in_mins, "stop (after saving) after this many minutes");
    app.add_flag("--exit-signal-handler", o.exit_signal_handler,
                 "on SIGTERM, finish the iteration, save and exit 0");
    app.add_option("--log-interval", o.log_interval, "iterations between log lines")->capture_default_str();
    app.add_option("--log-file", o.log_file, "write the logged metrics as JSON lines to this file");
    app.add_flag("--log-throughput", o.log_throughput, "add the achieved TFLOP/s to the log line");
    app.add_option("--tensorboard-dir", o.tensorboard_dir, "write TensorBoard event files here (rank 0)");
    app.add_option("--tensorboard-log-interval", o.tensorboard_log_interval, "iterations between TensorBoard scalars")
        ->capture_default_str();
    app.add_option("--tensorboard-queue-size", o.tensorboard_queue_size,
                   "accepted; Loom flushes the event file at every logged iteration")->capture_default_str();
    app.add_flag("--log-timers-to-tensorboard", o.log_timers_to_tensorboard, "iteration-time to TensorBoard");
    app.add_flag("--log-memory-to-tensorboard", o.log_memory_to_tensorboard,
                 "the device allocator's bytes to TensorBoard (mem-reserved-bytes, mem-allocated-bytes, ...)");
    app.add_flag("--log-validation-ppl-to-tensorboard", o.log_validation_ppl_to_tensorboard,
                 "the validation perplexity to TensorBoard as well");
    app.add_flag("--no-log-loss-scale-to-tensorboard", no_log_loss_scale_, "leave loss-scale out of TensorBoard");
    app.add_flag("--log-world-size-to-tensorboard", o.log_world_size_to_tensorboard, "world-size to TensorBoard");
    app.add_flag("--log-params-norm", o.log_params_norm, "the parameters' L2 norm in the log line");
    app.add_option("--timing-log-level", o.timing_log_level,
                   "0: no timers; 1 and 2: forward-backward, all-grads-sync and optimizer times, (min, max) over ranks, "
                   "after each log line")->capture_default_str();
    app.add_flag("--log-num-zeros-in-grad", o.log_num_zeros_in_grad, "the gradients' zero count in the log line");
    app.add_option("--eval-interval", o.eval_interval,
                   "iterations between validations (and one after training); without it, none");
    app.add_option("--eval-iters", o.eval_iters, "global batches of the validation split per validation")
        ->capture_default_str();
    app.add_option("--hidden-dropout", hidden_dropout_,
                   "dropout probability on the embedding and on each attention and MLP output before its residual add")
        ->capture_default_str();
    app.add_option("--attention-dropout", attention_dropout_, "dropout probability on the attention probabilities")
        ->capture_default_str();
    app.add_option("--recompute-granularity", recompute_granularity_,
                   "activation recompute: full (whole layers, see --recompute-method) or selective (core_attn, which "
                   "Loom's tiled attention always recomputes)");
    app.add_option("--recompute-method", recompute_method_,
                   "full recompute: uniform (groups of --recompute-num-layers, one input kept each) or block (the first "
                   "--recompute-num-layers layers of each pipeline stage)");
    app.add_option("--recompute-num-layers", recompute_num_layers_, "layers per group (uniform) or per stage (block)");
    app.add_flag("--recompute-activations", recompute_activations_, "the same as --recompute-granularity selective");
    app.add_option("--recompute-modules", recompute_modules_, "selective recompute's modules (Loom: core_attn)");
    app.add_option("--num-experts", num_experts_, "experts per MoE layer (none: dense MLPs)");
    app.add_option("--moe-layer-freq", moe_layer_freq_,
                   "which layers are MoE: an integer N (layers 0, N, 2N, ...) or a Python list expression such as "
                   "\"([1]*3+[0]*1)*2\" with one entry per layer")
        ->capture_default_str();
    app.add_option("--moe-ffn-hidden-size", moe_ffn_, "each expert's MLP width (default --ffn-hidden-size)");
    app.add_option("--moe-router-topk", moe_topk_, "experts per token")->capture_default_str();
    app.add_option("--moe-router-score-function", moe_score_function_, "softmax or sigmoid")->capture_default_str();
    app.add_flag("--moe-router-pre-softmax", moe_pre_softmax_, "softmax over all experts before the top-k");
    app.add_option("--moe-router-topk-scaling-factor", moe_topk_scaling_, "multiplies the routing probabilities");
    app.add_option("--moe-router-load-balancing-type", moe_load_balancing_, "aux_loss, seq_aux_loss or none")
        ->capture_default_str();
    app.add_option("--moe-aux-loss-coeff", moe_aux_loss_coeff_, "the load-balancing loss's coefficient")
        ->capture_default_str();
    app.add_option("--moe-z-loss-coeff", moe_z_loss_coeff_, "the router z-loss's coefficient (default: none)");
    app.add_option("--moe-expert-capacity-factor", moe_capacity_factor_,
                   "each expert takes at most ceil(tokens x topk / experts x factor) tokens; the rest are dropped "
                   "(default: none, dropless)");
    app.add_flag("--moe-pad-expert-input-to-capacity", moe_pad_, "pad every expert's input to its capacity");
    app.add_option("--moe-token-drop-policy", moe_drop_policy_, "probs (keep the most probable) or position (the first)")
        ->capture_default_str();
    app.add_flag("--moe-grouped-gemm", moe_grouped_gemm_, "every expert's GEMMs in one grouped call (bitwise the loop)");
    app.add_option("--moe-shared-expert-intermediate-size", moe_shared_ffn_, "a shared expert of this width");
    app.add_option("--moe-token-dispatcher-type", moe_dispatcher_,
                   "how tokens reach the expert-parallel ranks' experts: allgather (gather every rank's tokens, reduce-scatter "
                   "the outputs) or alltoall (send each token to its experts' ranks); with --expert-model-parallel-size 1 "
                   "both permute the same tokens on one rank")
        ->capture_default_str();
    app.add_option("--cuda-graph-impl", cuda_graph_impl_,
                   "none, or transformer_engine: capture every transformer layer's forward and backward per "
                   "micro-batch as graphs after --cuda-graph-warmup-steps eager iterations, and replay them "
                   "(local and full_iteration are Megatron's other implementations, not Loom's)")
        ->capture_default_str();
    app.add_option("--cuda-graph-modules", cuda_graph_modules_,
                   "what each layer graph covers: nothing given (or full) is the whole layer, which is all Loom "
                   "captures; attn, mlp, moe, moe_router, moe_preprocess, mamba are refused");
    app.add_option("--cuda-graph-scope", cuda_graph_scope_, "deprecated spelling of --cuda-graph-modules");
    app.add_option("--cuda-graph-warmup-steps", o.cuda_graph_warmup_steps,
                   "eager iterations before the layer graphs are captured")
        ->capture_default_str();
    app.add_flag("--enable-cuda-graph", enable_cuda_graph_, "deprecated: --cuda-graph-impl local (not Loom's)");
    app.add_flag("--external-cuda-graph", external_cuda_graph_, "deprecated: --cuda-graph-impl transformer_engine");
    app.add_option("--context-parallel-size", context_parallel_size_, "context-parallel ranks (only 1 in Loom)");
    app.add_option("--expert-model-parallel-size", expert_parallel_size_, "expert-parallel ranks: each holds --num-experts / this many experts (they divide the data-parallel ranks)");
    app.add_option("--expert-tensor-parallel-size", expert_tensor_parallel_size_,
                   "tensor-parallel ranks of each expert's features (default: --tensor-model-parallel-size)");
    app.add_flag("--use-tp-pp-dp-mapping", o.use_tp_pp_dp_mapping,
                 "order the ranks tp-cp-ep-pp-dp (pipeline stages of one data-parallel replica adjacent) instead of "
                 "tp-cp-ep-dp-pp");
    add_noop_flags(app, noop_values_);

    // An integer past int64's range is an error (CLI11 would clamp it to the largest value, which then runs
    // "forever"); argparse reads such a value exactly, so it never means the clamped one.
    CLI::Validator int64_range(
        [](std::string & value) {
            errno = 0;
            char * end = nullptr;
            std::strtoll(value.c_str(), &end, 10);
            return errno == ERANGE ? std::string("value out of the range of a 64-bit integer") : std::string();
        },
        "", "int64");
    for (CLI::Option * option : app.get_options()) {
        if (option->get_type_name() == "INT") option->check(int64_range);
    }
    group_like_megatron(app);
}

namespace {

// --moe-layer-freq's Python list expression: sums of lists and parenthesised sums, each repeated with
// "* N" ("([1]*3+[0]*1)*2" -> 1 1 1 0 1 1 1 0), the subset of Python Megatron's examples use.
class LayerPatternParser {
public:
    explicit LayerPatternParser(const std::string & text) : text_(text) {}
    std::vector<int> parse() {
        std::vector<int> out = sum();
        skip();
        LOOM_CHECK(at_ == text_.size(), "--moe-layer-freq '" << text_ << "': unexpected '" << text_.substr(at_) << "'",
                   "write an integer or a list expression such as \"([1]*3+[0]*1)*2\"");
        return out;
    }

private:
    void skip() { while (at_ < text_.size() && text_[at_] == ' ') ++at_; }
    bool take(char c) {
        skip();
        if (at_ < text_.size() && text_[at_] == c) return ++at_, true;
        return false;
    }
    int64_t integer() {
        skip();
        size_t end = at_;
        while (end < text_.size() && std::isdigit(static_cast<unsigned char>(text_[end]))) ++end;
        LOOM_CHECK(end > at_ && end - at_ < 10, "--moe-layer-freq '" << text_ << "': a number expected at '" << text_.substr(at_) << "'", "");
        int64_t value = std::stoll(text_.substr(at_, end - at_));
        at_ = end;
        return value;
    }
    std::vector<int> atom() {
        std::vector<int> out;
        if (take('(')) {
            out = sum();
            LOOM_CHECK(take(')'), "--moe-layer-freq '" << text_ << "': a ')' is missing", "");
        } else {
            LOOM_CHECK(take('['), "--moe-layer-freq '" << text_ << "': a list or '(' expected at '" << text_.substr(at_) << "'", "");
            if (!take(']')) {
                do out.push_back(static_cast<int>(integer())); while (take(','));
                LOOM_CHECK(take(']'), "--moe-layer-freq '" << text_ << "': a ']' is missing", "");
            }
        }
        while (take('*')) {
            const int64_t times = integer();
            LOOM_CHECK(times <= 100000, "--moe-layer-freq '" << text_ << "': a repeat of " << times, "");
            std::vector<int> repeated;
            for (int64_t i = 0; i < times; ++i) repeated.insert(repeated.end(), out.begin(), out.end());
            out = std::move(repeated);
        }
        return out;
    }
    std::vector<int> sum() {
        std::vector<int> out = atom();
        while (take('+')) {
            std::vector<int> more = atom();
            out.insert(out.end(), more.begin(), more.end());
        }
        return out;
    }

    const std::string & text_;
    size_t              at_ = 0;
};

}  // namespace

// --num-experts and --moe-*: Megatron's defaults, choices and checks (arguments.py, transformer_config.py,
// model/moe/moe_config.h); what Loom's single-rank experts cannot do is refused by name.
void TrainOptionParser::resolve_moe(TrainOptions & o) const {
    auto given = [&](const char * flag) { return app_.count(flag) > 0; };
    model::MoeConfig & moe = o.model.moe;
    LOOM_CHECK(expert_parallel_size_ == 1 || given("--num-experts"), "num_experts must be non None to use expert model parallelism", "");
    if (!given("--num-experts")) {
        for (const char * flag : {"--moe-ffn-hidden-size", "--moe-grouped-gemm", "--moe-shared-expert-intermediate-size"}) {
            LOOM_CHECK(!given(flag), flag << " without --num-experts", "add --num-experts E to make the MLPs Mixtures of Experts");
        }
        return;
    }
    LOOM_CHECK(num_experts_ >= 1, "--num-experts must be >= 1, got " << num_experts_, "");
    LOOM_CHECK(num_experts_ % expert_parallel_size_ == 0, "Number of experts should be a multiple of expert model parallel_size.", "");
    moe.num_experts = num_experts_;
    moe.topk        = moe_topk_;
    LOOM_CHECK(moe_score_function_ == "softmax" || moe_score_function_ == "sigmoid",
               "--moe-router-score-function " << moe_score_function_ << " is not supported by Loom", "use softmax or sigmoid");
    moe.score_function      = moe_score_function_ == "sigmoid" ? model::MoeScoreFunction::sigmoid : model::MoeScoreFunction::softmax;
    moe.pre_softmax         = moe_pre_softmax_;
    moe.topk_scaling_factor = given("--moe-router-topk-scaling-factor") ? moe_topk_scaling_ : 0.0f;
    LOOM_CHECK(moe_load_balancing_.size() == 1 && moe_aux_loss_coeff_.size() == 1,
               "--moe-router-load-balancing-type and --moe-aux-loss-coeff with several values (combined balancing losses) "
               "are not supported by Loom", "give one type and one coefficient");
    moe.load_balancing = model::moe_load_balancing_parse(moe_load_balancing_[0]);
    moe.aux_loss_coeff = moe_aux_loss_coeff_[0];
    moe.z_loss_coeff   = given("--moe-z-loss-coeff") ? moe_z_loss_coeff_ : 0.0f;
    moe.capacity_factor = given("--moe-expert-capacity-factor") ? moe_capacity_factor_ : -1.0f;
    LOOM_CHECK(!given("--moe-expert-capacity-factor") || moe_capacity_factor_ >= 0.0f,
               "--moe-expert-capacity-factor must be >= 0, got " << moe_capacity_factor_, "");
    moe.pad_to_capacity = moe_pad_;
    LOOM_CHECK(moe_drop_policy_ == "probs" || moe_drop_policy_ == "position",
               "argument --moe-token-drop-policy: invalid choice: '" << moe_drop_policy_ << "' (choose from 'probs', 'position')", "");
    moe.drop_policy     = moe_drop_policy_ == "position" ? model::MoeDropPolicy::position : model::MoeDropPolicy::probs;
    moe.ffn_hidden_size = moe_ffn_;
    moe.grouped_gemm    = moe_grouped_gemm_;
    moe.shared_expert_intermediate_size = moe_shared_ffn_;
    LOOM_CHECK(moe_dispatcher_ == "allgather" || moe_dispatcher_ == "alltoall" || moe_dispatcher_ == "flex",
               "argument --moe-token-dispatcher-type: invalid choice: '" << moe_dispatcher_
                                                                         << "' (choose from 'allgather', 'alltoall', 'flex')", "");
    LOOM_CHECK(moe_dispatcher_ != "flex", "--moe-token-dispatcher-type flex is not supported by Loom", "use allgather or alltoall");
    moe.dispatcher = moe_dispatcher_ == "alltoall" ? model::MoeDispatcher::alltoall : model::MoeDispatcher::allgather;
    if (moe_layer_freq_.find('[') != std::string::npos) {
        moe.layer_pattern = LayerPatternParser(moe_layer_freq_).parse();
        LOOM_CHECK(static_cast<int64_t>(moe.layer_pattern.size()) == o.model.num_layers,
                   "Invalid length of moe_layer_pattern: " << moe.layer_pattern.size() << ", expected " << o.model.num_layers
                                                           << ", current moe layer pattern: " << moe_layer_freq_, "");
        for (int v : moe.layer_pattern) LOOM_CHECK(v == 0 || v == 1, "--moe-layer-freq '" << moe_layer_freq_ << "': entries are 0 or 1", "");
    } else {
        char * end = nullptr;
        errno      = 0;
        const long long n = std::strtoll(moe_layer_freq_.c_str(), &end, 10);
        LOOM_CHECK(end != moe_layer_freq_.c_str() && *end == '\0' && errno == 0 && n >= 1,
                   "--moe-layer-freq '" << moe_layer_freq_ << "' is neither an integer >= 1 nor a list expression", "");
        moe.layer_freq = n;
    }
    model::moe_config_validate(moe, o.model);
    // Megatron raises this in MoELayer.forward while training; Loom refuses before any rank starts.
    LOOM_CHECK(o.tensor_parallel_size == 1 || o.sequence_parallel,
               "During training, performance may degrade if MoE and tensor parallelism are enabled without also enabling "
               "sequence parallelism.",
               "add --sequence-parallel to --num-experts with --tensor-model-parallel-size " << o.tensor_parallel_size);
    const int64_t etp = o.expert_tensor_parallel_size;
    LOOM_CHECK(moe.expert_ffn(o.model) % etp == 0,
               "the experts' hidden size " << moe.expert_ffn(o.model) << " (--moe-ffn-hidden-size, or --ffn-hidden-size) "
                                           << "is not divisible by --expert-tensor-parallel-size " << etp,
               "each expert-tensor-parallel rank takes an equal share of every expert's features");
    LOOM_CHECK(moe.shared_expert_intermediate_size % o.tensor_parallel_size == 0,
               "--moe-shared-expert-intermediate-size " << moe.shared_expert_intermediate_size
                                                        << " is not divisible by --tensor-model-parallel-size "
                                                        << o.tensor_parallel_size,
               "the shared expert is split over the tensor-parallel ranks as a dense MLP");
    LOOM_CHECK(etp == 1 || !o.model.add_bias_linear,
               "biases in the experts with --expert-tensor-parallel-size " << etp << " are not supported by Loom",
               "pass --disable-bias-linear (Megatron's alltoall dispatcher refuses expert biases as well)");
}

// Megatron's rules (arguments.py validate_args, TransformerConfig.__post_init__), in its words where it has
// them; what Loom does not implement is refused by name.
void TrainOptionParser::resolve_cuda_graphs(TrainOptions & o) const {
    std::string impl = cuda_graph_impl_;
    if (enable_cuda_graph_ || external_cuda_graph_) {
        LOOM_CHECK(impl == "none", "Do not use --enable-cuda-graph or --external-cuda-graph with --cuda-graph-impl.", "");
        LOOM_CHECK(!(enable_cuda_graph_ && external_cuda_graph_),
                   "--enable-cuda-graph and --external-cuda-graph cannot be enabled at the same time.", "");
        impl = enable_cuda_graph_ ? "local" : "transformer_engine";
        if (process_rank() <= 0) {   // Megatron's warn_rank_0
            std::fprintf(stderr, "WARNING: %s is deprecated, use --cuda-graph-impl=%s instead.\n",
                         enable_cuda_graph_ ? "--enable-cuda-graph" : "--external-cuda-graph", impl.c_str());
        }
    }
    LOOM_CHECK(impl == "none" || impl == "local" || impl == "transformer_engine" || impl == "full_iteration",
               "argument --cuda-graph-impl: invalid choice: '" << impl
                                                              << "' (choose from 'none', 'local', 'transformer_engine', 'full_iteration')",
               "");
    LOOM_CHECK(impl == "none" || impl == "transformer_engine",
               "--cuda-graph-impl " << impl << " is not supported by Loom",
               "Loom captures per-layer graphs: --cuda-graph-impl transformer_engine");
    LOOM_CHECK(cuda_graph_scope_.empty() || cuda_graph_modules_.empty(),
               "--cuda-graph-scope and --cuda-graph-modules cannot be used together.", "--cuda-graph-scope is deprecated");
    std::vector<std::string> modules = cuda_graph_scope_.empty() ? cuda_graph_modules_ : cuda_graph_scope_;
    if (!cuda_graph_scope_.empty() && process_rank() <= 0) {
        std::fprintf(stderr, "WARNING: --cuda-graph-scope is deprecated, use --cuda-graph-modules instead.\n");
    }
    static const std::vector<std::string> known = {"attn", "mlp", "moe", "moe_router", "moe_preprocess", "mamba", "full"};
    for (const std::string & module : modules) {
        LOOM_CHECK(std::find(known.begin(), known.end(), module) != known.end(),
                   "argument --cuda-graph-modules: invalid choice: '" << module
                                                                     << "' (choose from 'attn', 'mlp', 'moe', 'moe_router', "
                                                                        "'moe_preprocess', 'mamba')", "");
    }
    auto has = [&](const char * m) { return std::find(modules.begin(), modules.end(), m) != modules.end(); };
    LOOM_CHECK(!(has("moe") && has("moe_router")), "cuda_graph_modules must not contain both moe and moe_router.", "");
    LOOM_CHECK(!has("moe_preprocess") || has("moe_router"),
               "moe_preprocess cuda graph is only supported with moe_router cuda graph.", "");
    const model::MoeConfig & moe = o.model.moe;
    LOOM_CHECK(!(has("moe") || has("moe_router")) || moe.num_experts > 1, "moe cuda graph is only supported for MoE.",
               "the MoE scopes need --num-experts > 1");
    bool every_layer_moe = moe.enabled();
    for (int64_t i = 0; i < o.model.num_layers; ++i) every_layer_moe = every_layer_moe && moe.is_moe_layer(i);
    const bool drop_pad = moe.drops() && moe.pad_to_capacity;
    LOOM_CHECK(!has("mlp") || !every_layer_moe, "mlp cuda graph is only supported for dense layers, but not found in the model.", "");
    LOOM_CHECK(!has("moe") || drop_pad, "moe cuda graph is only supported with drop-padding MoE.",
               "add --moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity, or capture up to the router (moe_router)");
    LOOM_CHECK(!has("moe_preprocess") || moe_dispatcher_ != "alltoall" || !moe.drops(),
               "moe_preprocess cuda graph is not supported when there are DtoH copies and synchronizations in the preprocess step.", "");
    LOOM_CHECK(!has("mamba"), "--cuda-graph-modules mamba: Loom has no Mamba layers", "");
    // What Loom captures: whole layers (no modules, full, or attn + moe of drop-and-pad MoE layers), or
    // every layer a MoE layer up to its router (attn moe_router [moe_preprocess]).
    std::vector<std::string> named;
    for (const std::string & m : modules) {
        if (m != "full" && std::find(named.begin(), named.end(), m) == named.end()) named.push_back(m);
    }
    std::sort(named.begin(), named.end());
    using Modules = std::vector<std::string>;
    const bool whole   = named.empty() || (named == Modules{"attn", "moe"} && every_layer_moe);
    const bool partial = (named == Modules{"attn", "moe_router"} || named == Modules{"attn", "moe_preprocess", "moe_router"}) &&
                         every_layer_moe;
    if (impl != "none") {
        std::string given;
        for (const std::string & m : named) given += (given.empty() ? "" : " ") + m;
        LOOM_CHECK(whole || partial, "--cuda-graph-modules " << given << " is not supported by Loom",
                   "Loom captures whole layers (no --cuda-graph-modules, or attn moe of drop-and-pad MoE layers), or, "
                   "with every layer MoE, each layer up to its router: attn moe_router [moe_preprocess]");
    }
    o.graph_moe_router     = partial;
    o.graph_moe_preprocess = partial && has("moe_preprocess");
    LOOM_CHECK(o.cuda_graph_warmup_steps >= 0, "--cuda-graph-warmup-steps must be >= 0, got " << o.cuda_graph_warmup_steps, "");
    o.layer_graphs = impl == "transformer_engine";
    if (o.layer_graphs) {
        LOOM_CHECK(!o.model.moe.enabled() || o.model.moe.pad_to_capacity || o.graph_moe_router,
                   "--cuda-graph-impl transformer_engine with dropless MoE layers",
                   "a dropless dispatch reads each expert's token count on the host, which no graph can; add "
                   "--moe-expert-capacity-factor and --moe-pad-expert-input-to-capacity (Megatron's rule for graphing "
                   "whole MoE layers), or capture each layer up to its router: --cuda-graph-modules attn moe_router");
        LOOM_CHECK(o.model.recompute_granularity != model::RecomputeGranularity::full,
                   "full recompute is only supported with full iteration CUDA graph.",
                   "drop --recompute-granularity full, or --cuda-graph-impl");
    }
}

void TrainOptionParser::resolve_recompute(model::GptConfig & m) const {
    std::string granularity = recompute_activations_ ? "selective" : recompute_granularity_;   // arguments.py's rule
    LOOM_CHECK(granularity.empty() || granularity == "full" || granularity == "selective",
               "argument --recompute-granularity: invalid choice: '" << granularity << "' (choose from 'full', 'selective')", "");
    LOOM_CHECK(recompute_method_.empty() || recompute_method_ == "uniform" || recompute_method_ == "block",
               "argument --recompute-method: invalid choice: '" << recompute_method_ << "' (choose from 'uniform', 'block')", "");
    const bool num_given = app_.count("--recompute-num-layers") > 0;
    if (granularity == "full") {
        LOOM_CHECK(!recompute_method_.empty(),
                   "Using recompute_granularity: full so recompute_method must be \"block\" or \"uniform\"",
                   "add --recompute-method uniform or --recompute-method block");
        LOOM_CHECK(num_given && recompute_num_layers_ >= 1,
                   "When using recompute_granularity: full recompute_num_layers must be between 1 and "
                   "num_layers_per_pipeline_rank" << (num_given ? " (--recompute-num-layers " + std::to_string(recompute_num_layers_) + ")" : ""),
                   "add --recompute-num-layers N");
        m.recompute_granularity = model::RecomputeGranularity::full;
        m.recompute_method      = recompute_method_ == "block" ? model::RecomputeMethod::block : model::RecomputeMethod::uniform;
        m.recompute_num_layers  = recompute_num_layers_;
    } else if (granularity == "selective") {
        LOOM_CHECK(recompute_method_.empty(), "recompute method is not yet supported for selective recomputing granularity",
                   "drop --recompute-method, or use --recompute-granularity full");
        LOOM_CHECK(!num_given, "When using recompute_granularity: selective recompute_num_layers must be None",
                   "drop --recompute-num-layers");
        for (const std::string & module : recompute_modules_) {
            LOOM_CHECK(module == "core_attn", "--recompute-modules " << module << " is not supported by Loom",
                       "Loom recomputes core_attn (its tiled attention never stores the probabilities); for more, use "
                       "--recompute-granularity full");
        }
        m.recompute_granularity = model::RecomputeGranularity::selective;
    }
    // Without a granularity, --recompute-method and --recompute-num-layers recompute nothing, in Megatron too.
}

MemoryEstimate estimate_memory(const TrainOptions & o) {
    const model::GptConfig & m = o.model;
    const double h = static_cast<double>(m.hidden_size), f = static_cast<double>(m.ffn_hidden_size);
    const double L = static_cast<double>(m.num_layers), V = static_cast<double>(m.vocab_size);
    const double s = static_cast<double>(m.seq_length);
    const double b = static_cast<double>(o.micro_batch_size);
    const double tp = static_cast<double>(o.tensor_parallel_size), pp = static_cast<double>(o.pipeline_parallel_size);
    const double dp = static_cast<double>(o.data_parallel_size);
    // Parameters in double (an int64 count could overflow): embeddings, and per layer QKV, projection, MLP.
    const double per_layer = 4 * h * h + h * f * (m.swiglu ? 3 : 2) + 8 * h;
    const double params    = (V * h * (m.untie_embeddings_and_output_weights ? 2 : 1) +
                           static_cast<double>(m.max_position_embeddings) * h + L * per_layer) / (tp * pp);
    MemoryEstimate e;
    e.weights   = params * (o.bf16 ? 2 : 4);
    e.grads     = params * 4;
    e.optimizer = params * (o.bf16 ? 12 : 8) / (o.ddp.use_distributed_optimizer ? dp : 1);
    const double in_flight = std::min(pp, static_cast<double>(std::max<int64_t>(1, o.num_microbatches())));
    e.activations = in_flight * (L / pp * s * b * h * 34 * 2 / tp + 3 * 4 * s * b * V / tp);
    return e;
}

optim::LrSchedule TrainOptions::lr_schedule() const {
    optim::LrSchedule s;
    s.max_lr                = adam.lr;
    s.min_lr                = min_lr;
    s.init_lr               = lr_warmup_init;
    s.samples_per_iteration = global_batch_size;
    s.style                 = optim::lr_decay_style_from_name(lr_decay_style);
    s.wsd_style             = optim::wsd_decay_style_from_name(lr_wsd_decay_style);
    const double batch      = static_cast<double>(global_batch_size);
    if (train_samples > 0) {
        s.decay_steps  = static_cast<double>(lr_decay_samples);
        s.wsd_steps    = static_cast<double>(lr_wsd_decay_samples);
        s.warmup_steps = static_cast<double>(lr_warmup_samples);
    } else {
        s.decay_steps  = static_cast<double>(lr_decay_iters) * batch;
        s.wsd_steps    = static_cast<double>(lr_wsd_decay_iters) * batch;
        s.warmup_steps = static_cast<double>(lr_warmup_iters) * batch;
    }
    if (lr_warmup_fraction >= 0) s.warmup_steps = lr_warmup_fraction * s.decay_steps;
    s.decoupled_max_lr = decoupled_lr;
    s.decoupled_min_lr = decoupled_min_lr;
    return s;
}

pipeline::LayerSplitOptions TrainOptions::layer_split() const {
    pipeline::LayerSplitOptions split;
    split.num_layers = static_cast<int>(model.num_layers);
    split.pp         = static_cast<int>(pipeline_parallel_size);
    if (virtual_pipeline_size > 0) split.vpp = static_cast<int>(virtual_pipeline_size);
    if (layers_per_virtual_stage > 0) split.num_layers_per_virtual_stage = static_cast<int>(layers_per_virtual_stage);
    if (first_stage_layers > 0) split.first_stage_layers = static_cast<int>(first_stage_layers);
    if (last_stage_layers > 0) split.last_stage_layers = static_cast<int>(last_stage_layers);
    return split;
}

namespace {

// Finite and in range, each message naming its flag: a NaN or an infinity here would train on garbage.
void validate_hyperparameters(const TrainOptions & o) {
    auto finite = [](double x) { return std::isfinite(x); };
    LOOM_CHECK(finite(o.adam.lr) && o.adam.lr > 0, "--lr must be a finite number > 0, got " << o.adam.lr, "");
    LOOM_CHECK(finite(o.min_lr) && o.min_lr >= 0 && o.min_lr <= o.adam.lr,
               "--min-lr " << o.min_lr << " must lie in [0, --lr " << o.adam.lr << "]", "");
    LOOM_CHECK(finite(o.adam.beta1) && o.adam.beta1 >= 0 && o.adam.beta1 < 1,
               "--adam-beta1 must lie in [0, 1), got " << o.adam.beta1, "Megatron's default is 0.9");
    LOOM_CHECK(finite(o.adam.beta2) && o.adam.beta2 >= 0 && o.adam.beta2 < 1,
               "--adam-beta2 must lie in [0, 1), got " << o.adam.beta2, "Megatron's default is 0.999");
    LOOM_CHECK(finite(o.adam.eps) && o.adam.eps > 0, "--adam-eps must be a finite number > 0, got " << o.adam.eps,
               "it keeps the update finite where the second moment is 0; Megatron's default is 1e-8");
    LOOM_CHECK(finite(o.adam.weight_decay) && o.adam.weight_decay >= 0,
               "--weight-decay must be a finite number >= 0, got " << o.adam.weight_decay, "");
    LOOM_CHECK(finite(o.clip_grad) && o.clip_grad >= 0,
               "--clip-grad must be a finite number >= 0, got " << o.clip_grad, "0 turns clipping off");
    LOOM_CHECK(finite(o.model.init_method_std) && o.model.init_method_std > 0,
               "--init-method-std must be a finite number > 0, got " << o.model.init_method_std, "");
}

// Sizes past what a rank could hold are refused before anything is allocated (the products would
// otherwise overflow, or allocate until the machine gives out), naming the flags that set them.
void check_memory(const TrainOptions & o, int64_t world_size) {
    const MemoryEstimate e = estimate_memory(o);
    int64_t ranks_here = world_size;   // the ranks sharing this machine's memory
    if (const char * local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) ranks_here = std::max(1L, std::atol(local));
    const double machine = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    const double gib     = 1024.0 * 1024.0 * 1024.0;
    LOOM_CHECK(e.total() * static_cast<double>(ranks_here) <= machine,
               "the model and batch need an estimated " << e.total() / gib << " GiB per rank (weights "
                   << e.weights / gib << ", gradients " << e.grads / gib << ", optimizer " << e.optimizer / gib
                   << ", activations " << e.activations / gib << ") x " << ranks_here << " rank(s), and this machine has "
                   << machine / gib << " GiB",
               "lower --num-layers, --hidden-size, --ffn-hidden-size, --vocab-size, --seq-length or "
               "--micro-batch-size, or shard the model (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
               "--use-distributed-optimizer)");
}

// An output path given by `flag`: its folder exists, and it is not a folder or a FIFO (which would block
// the writer until a reader appears). Checked before anything is built.
void check_output_path(const std::string & path, const char * flag) {
    namespace fs = std::filesystem;
    std::error_code ec;
    const fs::path  parent = fs::path(path).parent_path().empty() ? fs::path(".") : fs::path(path).parent_path();
    LOOM_CHECK(fs::is_directory(parent, ec), flag << " '" << path << "': the folder '" << parent.string()
                                                  << "' does not exist", "create it first");
    const fs::file_status status = fs::status(path, ec);
    LOOM_CHECK(!fs::is_directory(status) && !fs::is_fifo(status),
               flag << " '" << path << "' is a " << (fs::is_directory(status) ? "folder" : "FIFO") << ", not a file",
               "give the path of a file to write");
}

// Megatron's schedule flags (arguments.py's asserts, training.py's get_optimizer_param_scheduler): either
// iteration-based or sample-based, never a mix; the warmup shorter than the decay.
template <typename Given> void validate_schedule(TrainOptions & o, const Given & given) {
    const bool samples = given("--train-samples");
    if (samples) {
        LOOM_CHECK(!given("--train-iters"), "--train-samples with --train-iters", "give one of them (expected "
                                                                                  "sample-based training)");
        LOOM_CHECK(o.train_samples >= o.global_batch_size,
                   "--train-samples " << o.train_samples << " is less than one global batch of " << o.global_batch_size,
                   "");
        LOOM_CHECK(!given("--lr-decay-iters") && !given("--lr-warmup-iters") && !given("--lr-wsd-decay-iters"),
                   "--lr-decay-iters, --lr-warmup-iters and --lr-wsd-decay-iters count iterations, and --train-samples "
                   "asks for sample-based training",
                   "give --lr-decay-samples, --lr-warmup-samples or --lr-wsd-decay-samples");
        o.train_iters = o.train_samples / o.global_batch_size;   // Megatron's update_train_iters
    } else {
        LOOM_CHECK(!given("--lr-decay-samples") && !given("--lr-warmup-samples") && !given("--lr-wsd-decay-samples"),
                   "--lr-decay-samples, --lr-warmup-samples and --lr-wsd-decay-samples need --train-samples",
                   "give the lengths in iterations (--lr-decay-iters, --lr-warmup-iters, --lr-wsd-decay-iters), or "
                   "train for --train-samples");
    }
    LOOM_CHECK(!given("--lr-warmup-fraction") || (!given("--lr-warmup-iters") && !given("--lr-warmup-samples")),
               "--lr-warmup-fraction with --lr-warmup-" << (samples ? "samples" : "iters"), "can only specify one of them");
    LOOM_CHECK(!given("--lr-warmup-fraction") || (std::isfinite(o.lr_warmup_fraction) && o.lr_warmup_fraction >= 0 &&
                                                  o.lr_warmup_fraction < 1),
               "--lr-warmup-fraction must lie in [0, 1), got " << o.lr_warmup_fraction, "");
    LOOM_CHECK(o.lr_warmup_iters >= 0 && o.lr_warmup_samples >= 0, "--lr-warmup-iters and --lr-warmup-samples must be "
                                                                   ">= 0", "");
    LOOM_CHECK(std::isfinite(o.lr_warmup_init) && o.lr_warmup_init >= 0,
               "--lr-warmup-init must be a finite number >= 0, got " << o.lr_warmup_init, "");
    const optim::LrDecayStyle style = optim::lr_decay_style_from_name(o.lr_decay_style);
    optim::wsd_decay_style_from_name(o.lr_wsd_decay_style);
    if (o.lr_decay_iters == 0) o.lr_decay_iters = o.train_iters;
    if (o.lr_decay_samples == 0) o.lr_decay_samples = o.train_samples;
    LOOM_CHECK(o.lr_decay_iters >= 1 && o.lr_decay_samples >= 0, "--lr-decay-iters and --lr-decay-samples must be >= 1", "");
    LOOM_CHECK(style != optim::LrDecayStyle::wsd || given("--lr-wsd-decay-iters") || given("--lr-wsd-decay-samples"),
               "--lr-decay-style WSD needs the length of its anneal",
               "give --lr-wsd-decay-iters (or --lr-wsd-decay-samples with --train-samples)");
    const optim::LrSchedule s = o.lr_schedule();
    LOOM_CHECK(s.warmup_steps < s.decay_steps,
               "the warmup (" << s.warmup_steps << " samples) is not shorter than the decay (" << s.decay_steps
                              << " samples): --lr-warmup-* must be shorter than --lr-decay-* (default: the whole run)",
               "shorten the warmup or lengthen the decay");
    LOOM_CHECK(style != optim::LrDecayStyle::wsd || (s.wsd_steps > 0 && s.wsd_steps <= s.decay_steps),
               "the WSD anneal (" << s.wsd_steps << " samples) must lie in (0, the decay of " << s.decay_steps
                                  << " samples]",
               "");
}

// --tokenizer-type: the vocabulary size from the tokenizer (Megatron's build_tokenizer), before padding.
void apply_tokenizer(TrainOptions & o, bool vocab_size_given) {
    const bool files = !o.vocab_file.empty() || !o.merge_file.empty();
    if (o.tokenizer_type.empty()) {
        if (!files) return;   // Loom's extension: the vocabulary is the data's
        o.tokenizer_type = "GPT2BPETokenizer";   // pretrain_gpt.py's args_defaults
    }
    if (o.tokenizer_type == "GPT2BPETokenizer") {
        LOOM_CHECK(!o.vocab_file.empty() && !o.merge_file.empty(),
                   "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
                   "give GPT-2's vocab.json and merges.txt (the files the dataset was tokenised with)");
        const data::Gpt2BpeTokenizer tokenizer(o.vocab_file, o.merge_file);
        LOOM_CHECK(!vocab_size_given || o.model.vocab_size == tokenizer.vocab_size(),
                   "--vocab-size " << o.model.vocab_size << " contradicts --vocab-file '" << o.vocab_file << "', which holds "
                                   << tokenizer.vocab_size() << " tokens",
                   "drop --vocab-size: GPT2BPETokenizer takes the vocabulary from its files");
        o.model.vocab_size = tokenizer.vocab_size();
        return;
    }
    if (o.tokenizer_type == "NullTokenizer") {
        LOOM_CHECK(vocab_size_given, "--tokenizer-type NullTokenizer needs --vocab-size", "the ids are taken as they are");
        LOOM_CHECK(!files, "--tokenizer-type NullTokenizer reads no --vocab-file or --merge-file", "drop them");
        return;
    }
    LOOM_THROW("--tokenizer-type " << o.tokenizer_type << " is not supported by Loom",
               "Loom accepts GPT2BPETokenizer (--vocab-file, --merge-file) and NullTokenizer (--vocab-size); without "
               "--tokenizer-type the vocabulary is the dataset's largest id + 1");
}

// --save, --load and the exit flags.
void validate_checkpoint_flags(const TrainOptions & o, bool save_interval_given, bool exit_interval_given,
                               bool ckpt_step_given) {
    LOOM_CHECK(o.ckpt_format == "torch_dist",
               "--ckpt-format " << o.ckpt_format << " is not supported by Loom",
               "Loom writes one format, sharded safetensors in parameter space that reshard across DP, TP and PP; "
               "it answers to Megatron's default name, torch_dist (leave the flag out)");
    LOOM_CHECK(!save_interval_given || o.save_interval >= 1, "--save-interval must be >= 1, got " << o.save_interval, "");
    LOOM_CHECK(!exit_interval_given || o.exit_interval >= 1, "--exit-interval must be >= 1, got " << o.exit_interval, "");
    LOOM_CHECK(std::isfinite(o.exit_duration_in_mins) && o.exit_duration_in_mins >= 0,
               "--exit-duration-in-mins must be a finite number >= 0, got " << o.exit_duration_in_mins, "");
    LOOM_CHECK(!ckpt_step_given || o.ckpt_step >= 0, "--ckpt-step must be >= 0, got " << o.ckpt_step, "");
    LOOM_CHECK(o.ckpt_step < 0 || !o.load.empty(), "--ckpt-step " << o.ckpt_step << " without --load",
               "give the folder to load from with --load");
    LOOM_CHECK(!o.use_checkpoint_args || !o.load.empty(), "--use-checkpoint-args without --load",
               "give the folder to load from with --load");
    LOOM_CHECK(!o.finetune || !o.load.empty(), "--finetune without --load", "give the folder to load from with --load");
}

// --data-path and the per-split paths parse as Megatron's get_blend_from_list (errors name the flag and the
// word), before anything is opened; --data-cache-path is a folder or can become one.
void validate_data_paths(const TrainOptions & o, bool split_given) {
    if (!o.data_path.empty()) data::parse_blend(o.data_path, "--data-path");
    if (!o.train_data_path.empty()) data::parse_blend(o.train_data_path, "--train-data-path");
    if (!o.valid_data_path.empty()) data::parse_blend(o.valid_data_path, "--valid-data-path");
    if (!o.test_data_path.empty()) data::parse_blend(o.test_data_path, "--test-data-path");
    LOOM_CHECK(!(o.per_split_data() && split_given),
               "--split with --train-data-path, --valid-data-path or --test-data-path",
               "the per-split paths use each dataset whole; drop --split, or give --data-path to split one blend");
    LOOM_CHECK(std::isfinite(o.mid_level_dataset_surplus) && o.mid_level_dataset_surplus >= 0,
               "--mid-level-dataset-surplus must be a finite number >= 0, got " << o.mid_level_dataset_surplus,
               "Megatron's default is 0.005");
    if (!o.data_cache_path.empty()) {
        std::error_code ec;
        LOOM_CHECK(!std::filesystem::exists(o.data_cache_path, ec) || std::filesystem::is_directory(o.data_cache_path, ec),
                   "--data-cache-path '" << o.data_cache_path << "' exists and is not a folder",
                   "give a folder (Loom creates it when it does not exist)");
    }
}

}  // namespace

TrainOptions TrainOptionParser::resolve(int64_t world_size) {
    const std::string unsupported = unsupported_flags_message(app_.remaining());
    LOOM_CHECK(unsupported.empty(), unsupported,
               "docs/megatron_flags.md lists the Megatron flags Loom accepts; `loom train --help` groups them");
    TrainOptions o = opts_;
    LOOM_CHECK(context_parallel_size_ == 1, "--context-parallel-size " << context_parallel_size_
                                                                       << " is not supported by Loom (no context parallelism yet)",
               "only --context-parallel-size 1 is accepted");
    LOOM_CHECK(expert_parallel_size_ >= 1, "--expert-model-parallel-size must be >= 1, got " << expert_parallel_size_, "");
    o.expert_parallel_size = expert_parallel_size_;
    // Megatron's default: the experts' tensor parallelism is the dense layers'.
    LOOM_CHECK(app_.count("--expert-tensor-parallel-size") == 0 || expert_tensor_parallel_size_ >= 1,
               "--expert-tensor-parallel-size must be >= 1, got " << expert_tensor_parallel_size_, "");
    o.expert_tensor_parallel_size =
        app_.count("--expert-tensor-parallel-size") > 0 ? expert_tensor_parallel_size_ : o.tensor_parallel_size;
    for (auto [flag, p] : {std::pair{"--hidden-dropout", hidden_dropout_}, {"--attention-dropout", attention_dropout_}}) {
        LOOM_CHECK(p >= 0.0f && p < 1.0f, flag << " " << p << " is not a probability in [0, 1)",
                   "Megatron's default is 0.1; 0 turns the dropout off");
    }
    const int64_t model_parallel = o.tensor_parallel_size * o.pipeline_parallel_size;
    LOOM_CHECK(o.tensor_parallel_size >= 1 && o.pipeline_parallel_size >= 1 && world_size % model_parallel == 0,
               "world size " << world_size << " is not divisible by --tensor-model-parallel-size "
                             << o.tensor_parallel_size << " x --pipeline-model-parallel-size " << o.pipeline_parallel_size,
               "start a multiple of " << model_parallel << " ranks; the data-parallel size is the quotient");
    o.data_parallel_size = world_size / model_parallel;
    o.model        = model::gpt_preset(o.model_preset);
    model::GptConfig & m = o.model;
    auto given = [&](const char * flag) { return app_.count(flag) > 0; };
    // --load-hf: the shape comes from config.json; a --model preset or model flag given as well must agree.
    std::optional<model::GptConfig> hf;
    if (!o.load_hf.empty()) {
        hf = model::gpt_config_from_hf(o.load_hf);
        if (!given("--model")) m = *hf;
    }
    if (given("--num-layers")) m.num_layers = num_layers_;
    if (given("--hidden-size")) {
        m.hidden_size = hidden_size_;
        if (!given("--ffn-hidden-size")) m.ffn_hidden_size = 4 * hidden_size_;
    }
    if (given("--ffn-hidden-size")) m.ffn_hidden_size = ffn_hidden_size_;
    if (given("--num-attention-heads")) {
        m.num_attention_heads = heads_;
        m.num_query_groups    = heads_;
    }
    if (given("--num-query-groups") && !gqa_) {
        LOOM_THROW("--num-query-groups " << query_groups_ << " without --group-query-attention",
                   "add --group-query-attention to use grouped-query attention");
    }
    if (gqa_) {
        LOOM_CHECK(given("--num-query-groups"), "--group-query-attention needs --num-query-groups", "");
        m.num_query_groups = query_groups_;
    }
    if (given("--seq-length")) {
        m.seq_length = seq_length_;
        if (!given("--max-position-embeddings")) m.max_position_embeddings = std::max(m.max_position_embeddings, seq_length_);
    }
    if (given("--max-position-embeddings")) m.max_position_embeddings = max_pos_;
    if (given("--vocab-size")) m.vocab_size = vocab_size_;
    if (given("--make-vocab-size-divisible-by")) m.make_vocab_size_divisible_by = vocab_divisible_;
    if (given("--normalization")) {
        if (normalization_ == "LayerNorm") m.normalization = model::Normalization::layernorm;
        else if (normalization_ == "RMSNorm") m.normalization = model::Normalization::rmsnorm;
        else LOOM_THROW("--normalization '" << normalization_ << "' is not supported", "use LayerNorm or RMSNorm");
    }
    if (swiglu_) m.swiglu = true;
    // Megatron's MLP width when none is given: 4h, or with SwiGLU two thirds of it rounded down to a
    // multiple of 64 (the same parameter count as a 4h GELU MLP, roughly).
    if (!given("--ffn-hidden-size") && (given("--hidden-size") || swiglu_)) {
        m.ffn_hidden_size = m.swiglu ? (4 * m.hidden_size * 2 / 3) / 64 * 64 : 4 * m.hidden_size;
    }
    if (given("--position-embedding-type")) {
        if (position_embedding_ == "learned_absolute") m.position_embedding = model::PositionEmbedding::learned_absolute;
        else if (position_embedding_ == "rope") m.position_embedding = model::PositionEmbedding::rope;
        else if (position_embedding_ == "none") m.position_embedding = model::PositionEmbedding::none;
        else LOOM_THROW("--position-embedding-type '" << position_embedding_ << "' is not supported",
                        "use learned_absolute, rope or none");
    }
    if (disable_bias_) m.add_bias_linear = false;
    if (qk_layernorm_) m.qk_layernorm = true;
    if (untie_) m.untie_embeddings_and_output_weights = true;
    if (given("--init-method-std")) m.init_method_std = init_std_;
    for (auto [flag, value, target] : {std::tuple{"--decoupled-lr", decoupled_lr_, &o.decoupled_lr},
                                       {"--decoupled-min-lr", decoupled_min_lr_, &o.decoupled_min_lr}}) {
        if (!given(flag)) continue;
        LOOM_CHECK(std::isfinite(value) && value >= 0.0f, flag << " must be a finite number >= 0, got " << value, "");
        *target = value;
    }
    m.hidden_dropout    = hidden_dropout_;
    m.attention_dropout = attention_dropout_;
    resolve_recompute(m);
    if (given("--norm-epsilon")) {
        LOOM_CHECK(std::isfinite(norm_epsilon_) && norm_epsilon_ > 0,
                   "--norm-epsilon must be a finite number > 0, got " << norm_epsilon_, "Megatron's default is 1e-5");
        m.norm_epsilon = norm_epsilon_;
    }
    if (given("--rotary-base")) {
        LOOM_CHECK(rotary_base_ >= 2, "--rotary-base must be >= 2, got " << rotary_base_, "Megatron's default is 10000");
        m.rotary_base = static_cast<float>(rotary_base_);
    }
    LOOM_CHECK(rotary_percent_ == 1.0f, "--rotary-percent " << rotary_percent_ << " is not supported by Loom",
               "Loom rotates the whole head dimension (--rotary-percent 1.0, Megatron's default)");
    LOOM_CHECK(!given("--kv-channels") || kv_channels_ == m.head_dim(),
               "--kv-channels " << kv_channels_ << " is not supported by Loom: its heads are hidden / heads = "
                                << m.head_dim() << " wide",
               "drop --kv-channels, or choose --hidden-size and --num-attention-heads so that it is their quotient");
    apply_tokenizer(o, given("--vocab-size"));
    resolve_moe(o);
    // The experts' decomposition (parallel/parallel_config.h: world = etp x ep x edp x pp).
    LOOM_CHECK(world_size % (o.expert_tensor_parallel_size * o.pipeline_parallel_size * o.expert_parallel_size) == 0,
               "world size " << world_size << " is not divisible by --expert-tensor-parallel-size "
                             << o.expert_tensor_parallel_size << " x --expert-model-parallel-size " << o.expert_parallel_size
                             << " x --pipeline-model-parallel-size " << o.pipeline_parallel_size,
               "choose expert sizes whose product with the pipeline size divides the world size");
    resolve_cuda_graphs(o);
    if (given("--seed")) m.seed = seed_;
    validate_checkpoint_flags(o, given("--save-interval"), given("--exit-interval"), given("--ckpt-step"));
    if (o.use_checkpoint_args) {   // the checkpoint's shape wins over the flags, as Megatron's load_args_from_checkpoint
        std::optional<std::string> folder = checkpoint_to_load(o);
        LOOM_CHECK(folder, "--use-checkpoint-args: '" << o.load << "' holds no " << checkpoint::kTrackerFile,
                   "give a --load folder that holds a checkpoint");
        apply_checkpoint_args(m, checkpoint::read_index(*folder));
    }
    if (hf) {
        // Checked first: a longer --seq-length has raised the positions above.
        LOOM_CHECK(!given("--seq-length") || seq_length_ <= hf->max_position_embeddings,
                   "--seq-length " << seq_length_ << " exceeds n_positions = " << hf->max_position_embeddings
                                   << " in '" << o.load_hf << "/config.json'",
                   "the checkpoint has learned positions for " << hf->max_position_embeddings << " tokens");
        model::check_gpt2_architecture(m, "import");
        model::check_hf_gpt2_compatible(*hf, m, o.load_hf);
    }

    LOOM_CHECK(o.micro_batch_size >= 1 && o.micro_batch_size <= (int64_t(1) << 31),
               "--micro-batch-size must lie in [1, 2^31], got " << o.micro_batch_size, "");
    LOOM_CHECK(o.global_batch_size >= 0 && o.global_batch_size <= (int64_t(1) << 40),
               "--global-batch-size must lie in [1, 2^40], got " << o.global_batch_size, "");
    const int64_t dp = o.data_parallel_size;
    if (o.global_batch_size == 0) o.global_batch_size = o.micro_batch_size * dp;
    LOOM_CHECK(o.global_batch_size % (o.micro_batch_size * dp) == 0,
               "--global-batch-size " << o.global_batch_size << " is not a multiple of --micro-batch-size "
                                      << o.micro_batch_size << " x data-parallel size " << dp,
               "choose a global batch that " << o.micro_batch_size * dp << " divides (each of the " << dp
                                             << " data-parallel ranks runs whole micro-batches)");
    if (app_.count("--ddp-bucket-size") > 0) o.ddp.bucket_size = bucket_size_;
    o.ddp.validate();
    LOOM_CHECK(!(no_check_nan_ && o.ddp.check_for_nan_in_grad),
               "--check-for-nan-in-loss-and-grad and --no-check-for-nan-in-loss-and-grad together", "give one of them");
    o.check_for_nan_in_loss_and_grad = !no_check_nan_;
    LOOM_CHECK(o.train_iters >= 1 && o.train_samples >= 0, "--train-iters and --train-samples must be >= 1", "");
    validate_schedule(o, given);
    LOOM_CHECK(o.train_iters <= (int64_t(1) << 62) / o.global_batch_size / std::max<int64_t>(1, o.model.seq_length),
               "--train-iters " << o.train_iters << " x --global-batch-size " << o.global_batch_size
                                << " x --seq-length tokens overflows a 64-bit count", "");
    validate_hyperparameters(o);
    LOOM_CHECK(o.log_interval >= 1, "--log-interval must be >= 1", "");
    o.log_loss_scale_to_tensorboard = !no_log_loss_scale_;
    LOOM_CHECK(o.timing_log_level >= 0 && o.timing_log_level <= 2,
               "--timing-log-level must be 0, 1 or 2, got " << o.timing_log_level, "");
    LOOM_CHECK(o.tensorboard_log_interval >= 1 && o.tensorboard_queue_size >= 1,
               "--tensorboard-log-interval and --tensorboard-queue-size must be >= 1", "");
    if (!o.tensorboard_dir.empty()) {
        std::error_code ec;
        LOOM_CHECK(!std::filesystem::exists(o.tensorboard_dir, ec) || std::filesystem::is_directory(o.tensorboard_dir, ec),
                   "--tensorboard-dir '" << o.tensorboard_dir << "' exists and is not a folder", "give a folder");
    }
    LOOM_CHECK(!given("--eval-interval") || o.eval_interval >= 1, "--eval-interval must be >= 1, got " << o.eval_interval,
               "leave it out to train without validation");
    LOOM_CHECK(o.eval_iters >= 0 && o.eval_iters <= (int64_t(1) << 40) / o.global_batch_size,
               "--eval-iters " << o.eval_iters << " x global batch " << o.global_batch_size
                               << " samples is outside what Loom evaluates [0, 2^40]",
               "");
    if (!o.log_file.empty()) check_output_path(o.log_file, "--log-file");
    if (!o.timeline_file.empty()) {
        LOOM_CHECK(o.pipeline_parallel_size > 1, "--timeline draws the pipeline stages' measured timeline; it needs "
                                                 "--pipeline-model-parallel-size > 1",
                   "`loom schedule --svg` draws a schedule without running one");
        check_output_path(o.timeline_file, "--timeline");
    }
    LOOM_CHECK(o.device == "auto" || o.device == "cpu" || o.device == "cuda" || o.device == "cuda-emu",
               "--device " << o.device << " is not a device Loom trains on", "give --device cpu, cuda, cuda-emu or auto");
    LOOM_CHECK(o.distributed_timeout_minutes >= 1,
               "--distributed-timeout-minutes must be >= 1, got " << o.distributed_timeout_minutes, "");
    int sources = !o.data_path.empty() + o.per_split_data() + !o.text_file.empty() + !o.llmc_shard.empty() + o.mock_data;
    LOOM_CHECK(sources <= 1,
               "--data-path, --train-data-path (with --valid-data-path, --test-data-path), --mock-data, --text-file and "
               "--llmc-shard are exclusive (" << sources << " given)",
               "train on one data source at a time");
    validate_data_paths(o, given("--split"));
    LOOM_CHECK(sources == 1 || data_optional_, "no data: give --data-path PREFIX (a Megatron .bin/.idx dataset), or --mock-data",
               "as Megatron, Loom needs a data source; --mock-data trains on Loom's synthetic dataset, and "
               "--text-file / --llmc-shard read a text file or an llm.c shard");
    LOOM_CHECK(!o.fp16, "--fp16 (float16 parameters with dynamic loss scaling) is not supported",
               "use --bf16, which needs no loss scaling, or train in float32");
    LOOM_CHECK(o.offload.offload_fraction >= 0.0f && o.offload.offload_fraction <= 1.0f,
               "--optimizer-offload-fraction " << o.offload.offload_fraction << " is outside [0, 1]",
               "give the share of the optimizer state to step on the host, 0 (none) to 1 (all)");
    o.offload.pin_cpu_grads  = !no_pin_cpu_grads_;
    o.offload.pin_cpu_params = !no_pin_cpu_params_;
    m.params_dtype = o.bf16 ? DType::bf16 : DType::f32;
    LOOM_CHECK(o.pipeline_parallel_size > 1 ||
                   (o.layers_per_virtual_stage == 0 && o.first_stage_layers == 0 && o.last_stage_layers == 0),
               "--num-layers-per-virtual-pipeline-stage, --decoder-first-pipeline-num-layers and "
               "--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1",
               "they describe how layers split over pipeline stages");
    LOOM_CHECK(o.virtual_pipeline_size <= 1 || o.pipeline_parallel_size > 1,
               "--num-virtual-stages-per-pipeline-rank " << o.virtual_pipeline_size
                                                          << " needs --pipeline-model-parallel-size > 1",
               "virtual stages interleave the chunks of several pipeline ranks");
    if (o.tensor_parallel_size > 1) {
        const int64_t tp = o.tensor_parallel_size;
        LOOM_CHECK(m.num_attention_heads % tp == 0 && m.num_query_groups % tp == 0 && m.ffn_hidden_size % tp == 0,
                   "--num-attention-heads " << m.num_attention_heads << ", --num-query-groups " << m.num_query_groups
                                            << " and --ffn-hidden-size " << m.ffn_hidden_size
                                            << " must all be divisible by --tensor-model-parallel-size " << tp,
                   "each tensor-parallel rank takes an equal share of heads, query groups and MLP features");
        LOOM_CHECK(!o.sequence_parallel || m.seq_length % tp == 0,
                   "--seq-length " << m.seq_length << " is not divisible by --tensor-model-parallel-size " << tp,
                   "--sequence-parallel gives each tensor-parallel rank an equal block of positions");
        LOOM_CHECK(o.load_hf.empty(), "--load-hf with --tensor-model-parallel-size " << tp,
                   "loading Hugging Face weights into tensor-parallel shards is not supported yet; train from --seed");
    }
    if (o.pipeline_parallel_size > 1) {
        LOOM_CHECK(o.load_hf.empty(), "--load-hf with --pipeline-model-parallel-size " << o.pipeline_parallel_size,
                   "loading Hugging Face weights into pipeline stages is not supported yet; train from --seed");
        pipeline::LayerSplitOptions split  = o.layer_split();
        pipeline::LayerAssignment   layout = pipeline::assign_layers(split);   // throws naming the flags
        pipeline::ScheduleOptions   schedule;
        schedule.pp = split.pp;
        if (layout.num_chunks > 1) schedule.vpp = layout.num_chunks;
        schedule.num_microbatches = static_cast<int>(o.num_microbatches());
        if (o.microbatch_group_size > 0) schedule.microbatch_group_size = static_cast<int>(o.microbatch_group_size);
        pipeline::validate_schedule(schedule);
    }
    m.validate();
    check_memory(o, world_size);
    return o;
}

}  // namespace loom::train
