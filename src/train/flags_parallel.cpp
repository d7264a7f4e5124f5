// Parallelism: the sizes and the data-parallel size they leave, how layers split over pipeline stages,
// DDP (ddp/ddp.h) and the hybrid device optimizer (optim/hybrid_optimizer.h).
#include "core/error.h"
#include "ddp/ddp.h"
#include "optim/hybrid_optimizer.h"
#include "pipeline/layer_assignment.h"
#include "pipeline/schedule.h"
#include "parallel/parallel_config.h"
#include "train/flag_table.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <algorithm>
#include <limits>

namespace loom::train {

namespace {

using json = nlohmann::json;
using O    = TrainOptions;
using P    = ParallelFlags;
using D    = ddp::DdpConfig;
using H    = optim::HybridOptions;

constexpr const char * kDist = "distributed";

const Flag<TrainOptions> kParallelOptionFlags[] = {
    {"--sequence-parallel", kDist, &O::sequence_parallel,
     "norms and the residual stream on sequence shards; all-gather / reduce-scatter in place of all-reduce", kPlain,
     {"sequence_parallel", [](const O & o) -> json { return o.sequence_parallel; }}},
    {"--microbatch-group-size-per-virtual-pipeline-stage", kDist, &O::microbatch_group_size,
     "micro-batches per group of the interleaved schedule (default: the pipeline size)"},
    {"--num-layers-per-virtual-pipeline-stage", kDist, &O::layers_per_virtual_stage,
     "layers per model chunk (the other way to ask for virtual stages)"},
    {"--decoder-first-pipeline-num-layers", kDist, &O::first_stage_layers, "layers of the first pipeline stage"},
    {"--decoder-last-pipeline-num-layers", kDist, &O::last_stage_layers, "layers of the last pipeline stage"},
    {"--account-for-embedding-in-pipeline-split", kDist, &O::account_for_embedding_in_pipeline_split,
     "count the embedding as a layer when splitting layers over pipeline stages (the first chunk holds one fewer)"},
    {"--account-for-loss-in-pipeline-split", kDist, &O::account_for_loss_in_pipeline_split,
     "count the loss as a layer when splitting layers over pipeline stages (the last chunk holds one fewer)"},
    {"--pipeline-model-parallel-layout", kDist, &O::pipeline_layout,
     "the layers of each virtual pipeline stage, in model order: E embedding, t decoder layer, m MTP layer, L loss, "
     "'|' between stages, (...)*n and x*n repeats (\"Et*3|(tt|)*6tmL\"); the stage count / PP is the virtual stages"},
    {"--use-tp-pp-dp-mapping", kDist, &O::use_tp_pp_dp_mapping,
     "order the ranks tp-cp-ep-pp-dp (pipeline stages of one data-parallel replica adjacent) instead of "
     "tp-cp-ep-dp-pp"},
    {"--distributed-timeout-minutes", kDist, &O::distributed_timeout_minutes,
     "abort the job when a collective or transfer waits this long for another rank", kShowDefault},
    {"--check-weight-hash-across-dp-replicas-interval", kDist, &O::check_weight_hash_interval,
     "every this many iterations the data-parallel replicas compare a digest of each parameter, and stop (exit 1) "
     "naming those that differ"},
    {"--no-check-for-nan-in-loss-and-grad", kDist, &O::check_for_nan_in_loss_and_grad,
     "skip the update of an iteration whose loss or gradient norm is not finite, and go on", kNegated},
    {"--use-precision-aware-optimizer", kDist, &O::use_precision_aware_optimizer,
     "Megatron's precision-aware Adam (needed by --optimizer-cpu-offload): Loom's AdamW, its state in the dtypes "
     "below, all f32"},
    {"--main-grads-dtype", kDist, &O::main_grads_dtype, "with the precision-aware optimizer: fp32 (bf16 is refused)",
     kShowDefault},
    {"--main-params-dtype", kDist, &O::main_params_dtype, "with the precision-aware optimizer: fp32 (fp16 is refused)",
     kShowDefault},
    {"--exp-avg-dtype", kDist, &O::exp_avg_dtype, "with the precision-aware optimizer: fp32 (fp16, bf16, fp8 refused)",
     kShowDefault},
    {"--exp-avg-sq-dtype", kDist, &O::exp_avg_sq_dtype,
     "with the precision-aware optimizer: fp32 (fp16, bf16, fp8 refused)", kShowDefault},
    {"--optimizer-cpu-offload", kDist, &O::optimizer_cpu_offload,
     "step part of the optimizer on the host (hybrid device optimizer)", kPlain,
     {"optimizer_cpu_offload", [](const O & o) -> json { return o.optimizer_cpu_offload; }}},
};

// The sizes, read into `parallel` (TrainOptions::parallel) by resolve_parallel_sizes.
const Flag<ParallelFlags> kParallelFlags[] = {
    {"--tensor-model-parallel-size", kDist, &P::tensor_parallel_size,
     "tensor-parallel ranks (heads, MLP features and vocabulary split)", kShowDefault,
     {"tensor_model_parallel_size", [](const O & o) -> json { return o.parallel.tp(); }}},
    {"--pipeline-model-parallel-size", kDist, &P::pipeline_parallel_size,
     "pipeline stages (1F1B); the ranks mpirun starts are pp x dp", kShowDefault,
     {"pipeline_model_parallel_size", [](const O & o) -> json { return o.parallel.pp(); }}},
    {"--num-virtual-stages-per-pipeline-rank", kDist, &P::virtual_pipeline_size,
     "model chunks per pipeline rank (interleaved 1F1B)", kPlain,
     {"num_virtual_stages_per_pipeline_rank", [](const O & o) -> json { return o.parallel.vpp().value_or(0); }}},
    {"--expert-model-parallel-size", kDist, &P::expert_parallel_size,
     "expert-parallel ranks: each holds --num-experts / this many experts (they divide the data-parallel ranks)"},
    {"--expert-tensor-parallel-size", kDist, &P::expert_tensor_parallel_size,
     "tensor-parallel ranks of each expert's features (default: --tensor-model-parallel-size)"},
    {"--context-parallel-size", kDist, &P::context_parallel_size,
     "context-parallel ranks: each holds 2 of the sequence's 2 x CP chunks (docs/design/context_parallelism.md)"},
    {"--overlap-param-gather-with-optimizer-step", kDist, &P::overlap_param_gather_with_optimizer_step,
     "an overlap choice (the first bucket's gather with the optimizer step) under Megatron's rules: with "
     "--use-distributed-optimizer, --overlap-param-gather and virtual pipeline stages; as Megatron, every model "
     "chunk's buffers are then one bucket each (the numbers are the same)"},
    {"--cp-comm-type", kDist, &P::cp_comm_type,
     "p2p, a2a, allgather or a2a+p2p (one, or one per layer): how context-parallel ranks exchange keys and values (a "
     "ring of K|V blocks, an all-to-all of heads, an all-gather, or an all-to-all inside groups and a ring across them)",
     kList | kShowDefault},
    {"--hierarchical-context-parallel-sizes", kDist, &P::hierarchical_cp_sizes,
     "the context-parallel group's inner (all-to-all) and outer (ring) sizes for a2a+p2p (their product is "
     "--context-parallel-size)", kList},
    {"--tp-comm-overlap", kDist, &P::tp_comm_overlap,
     "tensor-parallel communication overlap, under Megatron's rule (--sequence-parallel): the sequence-parallel "
     "linears pass their rows around the TP ring one block at a time on a stream of their own, each block's GEMM "
     "beside the next block's transfer (all-gather + GEMM; GEMM + reduce-scatter in forward), and a column-parallel "
     "backward's reduce-scatter runs beside its weight-gradient GEMM; under an FP8 recipe only the latter (a "
     "tensorwise scale is the whole gathered operand's)"},
    {"--tp-comm-overlap-cfg", kDist, &P::tp_comm_overlap_cfg,
     "the userbuffer settings file of --tp-comm-overlap (not read: Loom has no userbuffers)"},
    {"--use-megatron-fsdp", kDist, &P::use_megatron_fsdp,
     "Megatron-FSDP: buckets by module (the embedding, each layer, the output), sharded over the data-parallel ranks "
     "as --data-parallel-sharding-strategy says (docs/design/ddp_and_optimizers.md 1.16)"},
    {"--use-torch-fsdp2", kDist, &P::use_torch_fsdp2,
     "PyTorch FSDP2 (weights, gradients and optimizer state sharded over the data-parallel ranks), under Megatron's "
     "rules for it; Loom runs it as --use-megatron-fsdp optim_grads_params: the same sums and bytes per rank, shards "
     "by module instead of by parameter"},
    {"--megatron-fsdp-version", kDist, &P::megatron_fsdp_version, "Megatron-FSDP's implementation: 1 (Loom's)",
     kShowDefault},
    {"--data-parallel-sharding-strategy", kDist, &P::data_parallel_sharding_strategy,
     "no_shard, optim, optim_grads or optim_grads_params: what each data-parallel rank keeps only its shard of "
     "under --use-megatron-fsdp (the optimizer state; and the gradients; and the weights too)", kShowDefault},
    {"--outer-dp-sharding-strategy", kDist, &P::outer_dp_sharding_strategy,
     "no_shard or optim: the outer group's strategy of hybrid sharding (Megatron's HSDP, with "
     "--num-distributed-optimizer-instances > 1: each instance shards, the instances replicate; Loom runs no_shard)",
     kShowDefault},
    {"--megatron-fsdp-main-params-dtype", kDist, &P::fsdp_main_params_dtype,
     "the FSDP optimizer's master weights: fp32 (Loom keeps f32 masters; auto means fp32 for an f32 model)", kShowDefault},
    {"--megatron-fsdp-main-grads-dtype", kDist, &P::fsdp_main_grads_dtype,
     "the FSDP gradient buffers: auto or fp32 (Loom accumulates gradients in f32)", kShowDefault},
    {"--megatron-fsdp-grad-comm-dtype", kDist, &P::fsdp_grad_comm_dtype,
     "the dtype FSDP's gradient collectives run in: fp32, bf16 or fp16 (each bucket rounded before its collective, "
     "widened after: half the bytes; accumulation stays f32), or auto (bf16 with --grad-reduce-in-bf16 under "
     "--bf16, else f32)", kShowDefault},
    {"--ddp-bucket-size", kDist, &P::bucket_size,
     "elements per gradient bucket (default max(40M, 1M x dp) with --overlap-grad-reduce, else one bucket)"},
    {"--accumulate-allreduce-grads-in-fp32", "mixed precision", &P::grads_in_fp32,
     "accumulate and reduce gradients in f32: Megatron turns it on for --bf16 (unless --grad-reduce-in-bf16); "
     "with --fp16 and without it the gradient buffers are f16"},
    {"--grad-reduce-in-bf16", "mixed precision", &P::grad_reduce_in_bf16,
     "with --bf16 (Megatron reads it only then): the gradient buffers are bf16 and their data-parallel collectives "
     "run in bf16 (half the bytes of each); every layer's contribution is computed in f32 and rounded into the "
     "buffer, and the optimizer steps f32 copies of its gradients. With --use-megatron-fsdp only the collectives "
     "are bf16"},
};

const Flag<ddp::DdpConfig> kDdpFlags[] = {
    {"--use-distributed-optimizer", kDist, &D::use_distributed_optimizer,
     "ZeRO-1: shard the optimizer state and f32 master weights over data-parallel ranks", kPlain,
     {"use_distributed_optimizer", [](const O & o) -> json { return o.ddp.use_distributed_optimizer; }}},
    {"--overlap-grad-reduce", kDist, &D::overlap_grad_reduce,
     "reduce each bucket group's gradients as soon as backward has produced them"},
    {"--overlap-param-gather", kDist, &D::overlap_param_gather,
     "all-gather updated parameters lazily before each layer's forward (distributed optimizer)"},
    {"--ddp-average-in-collective", kDist, &D::average_in_collective,
     "average in the collective instead of scaling gradients by 1/dp first"},
    {"--ddp-pad-buckets-for-high-nccl-busbw", kDist, &D::pad_buckets_for_high_nccl_busbw,
     "pad buckets to a multiple of lcm(dp, 128, 65536)"},
    {"--num-distributed-optimizer-instances", kDist, &D::num_distributed_optimizer_instances,
     "partial distributed optimizer: the data-parallel ranks form this many instances, each sharding the optimizer "
     "over its own ranks, the instances all-reducing their shards", kShowDefault},
    {"--check-for-nan-in-loss-and-grad", kDist, &D::check_for_nan_in_grad,
     "stop on a non-finite loss or gradient norm (the default); given explicitly, also scan every "
     "bucket before its reduction to name the rank and parameter (a host pass over the gradients)"},
};

const Flag<optim::HybridOptions> kOffloadFlags[] = {
    {"--optimizer-offload-fraction", kDist, &H::offload_fraction,
     "share of the optimizer state (a prefix of the parameters) stepped on the host, in [0, 1]", kShowDefault},
    {"--overlap-cpu-optimizer-d2h-h2d", kDist, &H::overlap_d2h_h2d,
     "one host optimizer per parameter, overlapped with the gradient and parameter copies"},
    {"--no-pin-cpu-grads", kDist, &H::pin_cpu_grads, "host gradient buffers in pageable memory", kNegated},
    {"--no-pin-cpu-params", kDist, &H::pin_cpu_params, "host master weights and state in pageable memory", kNegated},
};

}  // namespace

std::span<const Flag<TrainOptions>> parallel_option_flags() { return kParallelOptionFlags; }
std::span<const Flag<ParallelFlags>> parallel_flags() { return kParallelFlags; }
std::span<const Flag<ddp::DdpConfig>> ddp_flags() { return kDdpFlags; }
std::span<const Flag<optim::HybridOptions>> offload_flags() { return kOffloadFlags; }

void resolve_parallel_sizes(const ParallelFlags & f, int64_t num_experts, const Given & given, int64_t world_size,
                            TrainOptions & o) {
    // Megatron's checks of the context-parallel flags (arguments.py, TransformerConfig), at any size.
    for (const std::string & type : f.cp_comm_type) {
        LOOM_CHECK(type == "p2p" || type == "a2a" || type == "allgather" || type == "a2a+p2p",
                   "--cp-comm-type '" << type << "' is not one of p2p, a2a, allgather, a2a+p2p", "");
    }
    if (!f.hierarchical_cp_sizes.empty()) {
        int64_t product = 1;
        for (const std::string & word : f.hierarchical_cp_sizes) {
            const std::optional<std::string> plain = python_int_text(word);
            LOOM_CHECK(plain && plain->size() < 10 && std::stoll(*plain) >= 1,
                       "--hierarchical-context-parallel-sizes: '" << word << "' is not a positive integer", "");
            product *= std::stoll(*plain);
        }
        LOOM_CHECK(product == f.context_parallel_size,
                   "--hierarchical-context-parallel-sizes multiply to " << product << ", not --context-parallel-size "
                                                                        << f.context_parallel_size,
                   "their product is the context-parallel size");
    }
    const bool hierarchical = std::find(f.cp_comm_type.begin(), f.cp_comm_type.end(), "a2a+p2p") != f.cp_comm_type.end();
    LOOM_CHECK(!hierarchical || !f.hierarchical_cp_sizes.empty(),
               "--hierarchical-context-parallel-sizes must be set when a2a+p2p is used in cp comm", "");
    o.hierarchical_cp_sizes.clear();
    if (hierarchical && f.context_parallel_size > 1) {
        for (const std::string & word : f.hierarchical_cp_sizes) o.hierarchical_cp_sizes.push_back(std::stoll(*python_int_text(word)));
        LOOM_CHECK(o.hierarchical_cp_sizes.size() == 2,
                   "--hierarchical-context-parallel-sizes with " << o.hierarchical_cp_sizes.size()
                                                                  << " sizes: Loom's a2a+p2p takes two levels",
                   "give the all-to-all's size and the ring's, e.g. --hierarchical-context-parallel-sizes 2 2");
    }
    // Megatron's argument checks of expert parallelism (validate_args) come before the world's decomposition.
    LOOM_CHECK(f.expert_parallel_size >= 1, "--expert-model-parallel-size must be >= 1, got " << f.expert_parallel_size,
               "parallel sizes are positive integers");
    LOOM_CHECK(f.expert_parallel_size == 1 || num_experts > 0, "num_experts must be non None to use expert model parallelism", "");
    LOOM_CHECK(num_experts % f.expert_parallel_size == 0, "Number of experts should be a multiple of expert model parallel_size.", "");
    auto size = [](int64_t value, const char * flag) {   // ParallelConfig's sizes are ints
        LOOM_CHECK(value <= std::numeric_limits<int>::max(), flag << " " << value << " is larger than any world size",
                   "give the number of ranks of that parallel dimension");
        return static_cast<int>(value);
    };
    parallel::ParallelSizes sizes;
    sizes.world_size = size(world_size, "the world size");
    sizes.tp         = size(f.tensor_parallel_size, "--tensor-model-parallel-size");
    sizes.pp         = size(f.pipeline_parallel_size, "--pipeline-model-parallel-size");
    sizes.cp         = size(f.context_parallel_size, "--context-parallel-size");
    sizes.ep         = size(f.expert_parallel_size, "--expert-model-parallel-size");
    // Megatron's default: the experts' tensor parallelism is the dense layers'.
    if (given("--expert-tensor-parallel-size")) sizes.etp = size(f.expert_tensor_parallel_size, "--expert-tensor-parallel-size");
    if (given("--num-virtual-stages-per-pipeline-rank")) {
        sizes.vpp = size(f.virtual_pipeline_size, "--num-virtual-stages-per-pipeline-rank");
    }
    if (!o.pipeline_layout.empty()) {   // the layout's stages give the virtual stages (Megatron's arguments.py)
        const size_t stages = pipeline::parse_pipeline_layout(o.pipeline_layout).size();
        LOOM_CHECK(!given("--num-virtual-stages-per-pipeline-rank") && o.layers_per_virtual_stage == 0,
                   "No more than one of the following arguments can be set at the same time: "
                   "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank, "
                   "--pipeline-model-parallel-layout",
                   "the layout's stages give the virtual stages");
        LOOM_CHECK(stages % static_cast<size_t>(sizes.pp) == 0,
                   "The length of pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size ("
                       << stages << " stages, --pipeline-model-parallel-size " << sizes.pp << ")",
                   "");
        if (stages / static_cast<size_t>(sizes.pp) > 1) sizes.vpp = static_cast<int>(stages / static_cast<size_t>(sizes.pp));
    }
    if (o.use_tp_pp_dp_mapping) sizes.order = "tp-cp-ep-pp-dp";   // Megatron's initialize.py
    o.parallel = parallel::ParallelConfig::create(sizes);   // throws naming the flags
}


void resolve_ddp(const ParallelFlags & f, const Given & given, TrainOptions & o) {
    if (given("--ddp-bucket-size")) o.ddp.bucket_size = f.bucket_size;
    o.overlap_param_gather_with_optimizer_step = f.overlap_param_gather_with_optimizer_step;
    if (f.overlap_param_gather_with_optimizer_step) {   // Megatron's asserts (arguments.py)
        LOOM_CHECK(o.ddp.use_distributed_optimizer,
                   "--overlap-param-gather-with-optimizer-step only supported with distributed optimizer", "");
        LOOM_CHECK(o.ddp.overlap_param_gather,
                   "Must use --overlap-param-gather-with-optimizer-step with --overlap-param-gather", "");
        LOOM_CHECK(f.virtual_pipeline_size > 0 || o.layers_per_virtual_stage > 0,   // either form of virtual stages
                   "--overlap-param-gather-with-optimizer-step only supported with interleaved pipeline parallelism",
                   "give --num-virtual-stages-per-pipeline-rank or --num-layers-per-virtual-pipeline-stage");
    }
    // Megatron turns sequence parallelism off without tensor parallelism, then asserts it for the overlap.
    LOOM_CHECK(!f.tp_comm_overlap || (o.sequence_parallel && o.parallel.tp() > 1),
               "Tensor parallel communication/GEMM overlap can happen only when sequence parallelism is enabled",
               "--tp-comm-overlap needs --sequence-parallel with --tensor-model-parallel-size > 1");
    o.tp_comm_overlap = f.tp_comm_overlap;
    LOOM_CHECK(f.cp_comm_type.size() == 1 || static_cast<int64_t>(f.cp_comm_type.size()) == o.model.num_layers,
               "Length of cp_comm_type (" << f.cp_comm_type.size() << ") should equal to the total number of "
                                          << "transformer layers (" << o.model.num_layers << ")!",
               "give one value, or one per layer");
    o.cp_comm_types.clear();
    for (const std::string & type : f.cp_comm_type) {
        o.cp_comm_types.push_back(type == "a2a"         ? model::CpCommType::a2a
                                  : type == "allgather" ? model::CpCommType::allgather
                                  : type == "a2a+p2p"   ? model::CpCommType::a2a_p2p
                                                        : model::CpCommType::p2p);
    }
    // Megatron's accumulate_allreduce_grads_in_fp32: forced on for --bf16 unless --grad-reduce-in-bf16, off by
    // default for --fp16; without it the gradient buffers (and their collectives) are in the parameters' 16-bit
    // dtype. Megatron-FSDP keeps Loom's f32 buffers and runs only its collectives in bf16 (its
    // --megatron-fsdp-grad-comm-dtype auto).
    if (f.grad_reduce_in_bf16 && o.bf16) o.ddp.grad_comm_dtype = DType::bf16;
    resolve_fsdp(f, given, o);
    const bool in_fp32 = o.bf16 ? !f.grad_reduce_in_bf16 : !o.fp16 || f.grads_in_fp32;
    if (!in_fp32 && !o.ddp.use_megatron_fsdp) o.ddp.grad_reduce_in_fp32 = false;
    o.ddp.validate();
    const int64_t instances = o.ddp.num_distributed_optimizer_instances;   // parallel_state.py's asserts
    LOOM_CHECK(o.parallel.dp() * o.parallel.cp() % instances == 0,
               "Data parallel size should be divisible by partial DistOpt shard factor: data-parallel size "
                   << o.parallel.dp() << (o.parallel.cp() > 1 ? " x context-parallel size " + std::to_string(o.parallel.cp()) : "")
                   << ", --num-distributed-optimizer-instances " << instances, "");
    LOOM_CHECK(o.parallel.edp() % instances == 0,
               "Expert data parallel size should be divisible by partial DistOpt shard factor: expert data-parallel "
               "size " << o.parallel.edp() << ", --num-distributed-optimizer-instances " << instances, "");
    LOOM_CHECK(!given("--check-weight-hash-across-dp-replicas-interval") || o.check_weight_hash_interval >= 1,
               "--check-weight-hash-across-dp-replicas-interval must be >= 1, got " << o.check_weight_hash_interval, "");
    LOOM_CHECK(o.check_for_nan_in_loss_and_grad || !o.ddp.check_for_nan_in_grad,
               "--check-for-nan-in-loss-and-grad and --no-check-for-nan-in-loss-and-grad together", "give one of them");
}

void check_offload(const TrainOptions & o) {
    const struct { const char * flag; const std::string & value; std::vector<const char *> choices; } dtypes[] = {
        {"--main-grads-dtype", o.main_grads_dtype, {"fp32", "bf16"}},
        {"--main-params-dtype", o.main_params_dtype, {"fp32", "fp16"}},
        {"--exp-avg-dtype", o.exp_avg_dtype, {"fp32", "fp16", "bf16", "fp8"}},
        {"--exp-avg-sq-dtype", o.exp_avg_sq_dtype, {"fp32", "fp16", "bf16", "fp8"}},
    };
    for (const auto & d : dtypes) {   // argparse's choices, then what Loom's optimizer keeps
        check_choice(d.flag, d.value, std::span<const char * const>(d.choices));
        LOOM_CHECK(d.value == "fp32", d.flag << " " << d.value << " is not supported: Loom's optimizer keeps its "
                                             << "gradients, master weights and moments in f32",
                   "leave " << d.flag << " at fp32");
    }
    LOOM_CHECK(!o.optimizer_cpu_offload || o.use_precision_aware_optimizer,
               "The optimizer cpu offload must be used in conjunction with `--use-precision-aware-optimizer`, as the "
               "hybrid device optimizer reuses the code path of this flag.",
               "add --use-precision-aware-optimizer (Megatron's rule)");
    LOOM_CHECK(o.offload.offload_fraction >= 0.0f && o.offload.offload_fraction <= 1.0f,
               "--optimizer-offload-fraction " << o.offload.offload_fraction << " is outside [0, 1]",
               "give the share of the optimizer state to step on the host, 0 (none) to 1 (all)");
}

void validate_layout(const TrainOptions & o) {
    const model::GptConfig & m = o.model;
    LOOM_CHECK(o.parallel.pp() > 1 ||
                   (o.layers_per_virtual_stage == 0 && o.first_stage_layers == 0 && o.last_stage_layers == 0),
               "--num-layers-per-virtual-pipeline-stage, --decoder-first-pipeline-num-layers and "
               "--decoder-last-pipeline-num-layers need --pipeline-model-parallel-size > 1",
               "they describe how layers split over pipeline stages");
    if (o.parallel.tp() > 1) {
        const int64_t tp = o.parallel.tp();
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
    if (m.gated_delta_net) {   // TransformerConfig's check: its heads split over TP x CP
        const int64_t tp_cp = o.parallel.tp() * o.parallel.cp();
        LOOM_CHECK(m.linear_num_key_heads % tp_cp == 0 && m.linear_num_value_heads % tp_cp == 0,
                   "--linear-num-key-heads " << m.linear_num_key_heads << " and --linear-num-value-heads "
                                             << m.linear_num_value_heads << " must be multiples of --tensor-model-parallel-size x "
                                             << "--context-parallel-size = " << tp_cp, "");
    }
    if (o.parallel.cp() > 1) {   // Megatron's checks (arguments.py, TransformerConfig), then Loom's limits
        const int64_t cp = o.parallel.cp(), tp = o.parallel.tp();
        LOOM_CHECK(m.seq_length % (2 * cp) == 0,
                   "seq-length should be a multiple of 2 * context-parallel-size if context-parallel-size > 1.",
                   "--seq-length " << m.seq_length << " with --context-parallel-size " << cp
                                   << ": each rank holds two of the sequence's 2 x CP chunks");
        LOOM_CHECK(!o.sequence_parallel || tp == 1 || m.seq_length % (2 * cp * tp) == 0,
                   "--seq-length " << m.seq_length << " is not a multiple of 2 x --context-parallel-size (" << cp
                                   << ") x --tensor-model-parallel-size (" << tp << ") with --sequence-parallel",
                   "each tensor-parallel rank holds an equal block of each context-parallel rank's positions");
        for (size_t i = 0; i < o.cp_comm_types.size(); ++i) {
            if (o.cp_comm_types[i] != model::CpCommType::a2a && o.cp_comm_types[i] != model::CpCommType::a2a_p2p) continue;
            // a2a splits the heads over CP, a2a+p2p over its all-to-all's size.
            const int64_t a2a = o.cp_comm_types[i] == model::CpCommType::a2a ? cp : o.hierarchical_cp_sizes.at(0);
            LOOM_CHECK(m.num_attention_heads % (tp * a2a) == 0 && m.num_query_groups % (tp * a2a) == 0,
                       "--cp-comm-type " << (a2a == cp && o.cp_comm_types[i] == model::CpCommType::a2a ? "a2a" : "a2a+p2p")
                           << (o.cp_comm_types.size() > 1 ? " (layer " + std::to_string(i) + ")" : "")
                           << " needs --num-attention-heads " << m.num_attention_heads << " and --num-query-groups "
                           << m.num_query_groups << " divisible by --tensor-model-parallel-size x the all-to-all's size = "
                           << tp * a2a,
                       "the all-to-all gives each context-parallel rank an equal share of each tensor-parallel rank's heads");
        }
    }
    if (!o.pipeline_layout.empty()) pipeline::assign_layers(o.layer_split());   // validates it; throws naming the flag
    if (o.parallel.pp() > 1) {
        LOOM_CHECK(o.load_hf.empty(), "--load-hf with --pipeline-model-parallel-size " << o.parallel.pp(),
                   "loading Hugging Face weights into pipeline stages is not supported yet; train from --seed");
        pipeline::LayerSplitOptions split  = o.layer_split();
        pipeline::LayerAssignment   layout = pipeline::assign_layers(split);   // throws naming the flags
        // DSA's shared top-k travels within one forward of one model chunk: each layer's source on its own chunk.
        for (int rank = 0; rank < layout.pp && o.model.dsa_indexer_topk_freq > 1; ++rank) {
            for (int chunk = 0; chunk < layout.num_chunks; ++chunk) {
                const pipeline::LayerRange r = layout.at(rank, chunk);
                for (int layer = r.begin; layer < r.end; ++layer) {
                    const int64_t source = o.model.dsa_topk_source(layer);
                    LOOM_CHECK(source >= r.begin,
                               "--dsa-indexer-topk-freq " << o.model.dsa_indexer_topk_freq << ": layer " << layer + 1
                                   << " takes the top-k of layer " << source + 1 << ", which is on another pipeline "
                                   << (layout.num_chunks > 1 ? "chunk" : "stage") << " (layers " << r.begin + 1 << " to "
                                   << r.end << " are on pipeline rank " << rank << ")",
                               "Loom shares a top-k within a pipeline chunk: start each chunk at a layer that computes "
                               "its own (--dsa-indexer-skip-topk-offset, or the pipeline split)");
                }
            }
        }
        pipeline::ScheduleOptions   schedule;
        schedule.pp = split.pp;
        if (layout.num_chunks > 1) schedule.vpp = layout.num_chunks;
        if (o.microbatch_group_size > 0) schedule.microbatch_group_size = static_cast<int>(o.microbatch_group_size);
        // Every batch the run takes: the global batch, or each of a batch-size schedule's (those micro x dp
        // divides; the trainer refuses the others before the run reaches them).
        std::vector<int64_t> batches{o.global_batch_size};
        if (!o.batch_schedule.empty()) batches.clear();
        for (const auto & entry : o.batch_schedule) {
            if (entry.second % (o.micro_batch_size * o.parallel.dp()) == 0) batches.push_back(entry.second);
        }
        for (const int64_t batch : batches) {
            schedule.num_microbatches = static_cast<int>(batch / (o.micro_batch_size * o.parallel.dp()));
            pipeline::validate_schedule(schedule);
        }
    }
}

pipeline::LayerSplitOptions TrainOptions::layer_split() const {
    pipeline::LayerSplitOptions split;
    split.num_layers = static_cast<int>(model.num_layers);
    split.pp         = parallel.pp();
    split.vpp        = parallel.vpp();
    if (layers_per_virtual_stage > 0) split.num_layers_per_virtual_stage = static_cast<int>(layers_per_virtual_stage);
    if (first_stage_layers > 0) split.first_stage_layers = static_cast<int>(first_stage_layers);
    if (last_stage_layers > 0) split.last_stage_layers = static_cast<int>(last_stage_layers);
    split.account_for_embedding = account_for_embedding_in_pipeline_split;
    split.account_for_loss      = account_for_loss_in_pipeline_split;
    if (!pipeline_layout.empty()) split.layout = pipeline::parse_pipeline_layout(pipeline_layout);
    split.mtp_num_layers        = static_cast<int>(model.mtp_num_layers);
    return split;
}

}  // namespace loom::train
