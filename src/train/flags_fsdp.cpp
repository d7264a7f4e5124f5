// Megatron-FSDP's and Torch FSDP2's flags resolved into DdpConfig (ddp/ddp.h; docs/design/ddp_and_optimizers.md
// 1.16): Megatron's choices and asserts with its messages, then what Loom's implementation refuses by name.
#include "core/error.h"
#include "ddp/ddp.h"
#include "train/flag_table.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <initializer_list>
#include <string>

namespace loom::train {

namespace {

// --use-torch-fsdp2: Megatron's asserts (arguments.py), in its words.
void check_torch_fsdp2(const Given & given, const TrainOptions & o) {
    LOOM_CHECK(o.parallel.pp() == 1, "--use-torch-fsdp2 is not supported with pipeline parallelism", "");
    LOOM_CHECK(o.parallel.ep() == 1, "--use-torch-fsdp2 is not supported with expert parallelism", "");
    LOOM_CHECK(!o.ddp.use_distributed_optimizer, "--use-torch-fsdp2 is not supported with MCore's distributed optimizer", "");
    LOOM_CHECK(given("--no-gradient-accumulation-fusion"),
               "--use-torch-fsdp2 is not supported with gradient accumulation fusion",
               "Megatron fuses gradient accumulation by default; add --no-gradient-accumulation-fusion");
    LOOM_CHECK(o.ckpt_format == "torch_dist" || o.ckpt_format == "torch_dcp",
               "--use-torch-fsdp2 requires --ckpt-format torch_dist or torch_dcp", "");
    LOOM_CHECK(o.model.untie_embeddings_and_output_weights, "--use-torch-fsdp2 requires --untie-embeddings-and-output-weights", "");
    LOOM_CHECK(!o.fp16, "--use-torch-fsdp2 not supported with fp16 yet", "");
}

}  // namespace

// --use-megatron-fsdp: Megatron's choices and rules (arguments.py), then what Loom's implementation refuses.
void resolve_fsdp(const ParallelFlags & f, const Given & given, TrainOptions & o) {
    check_choice("--data-parallel-sharding-strategy", f.data_parallel_sharding_strategy,
                 {"no_shard", "optim", "optim_grads", "optim_grads_params"});
    check_choice("--outer-dp-sharding-strategy", f.outer_dp_sharding_strategy, {"no_shard", "optim"});
    check_choice("--megatron-fsdp-main-params-dtype", f.fsdp_main_params_dtype, {"fp32", "bf16", "fp16", "auto"});
    check_choice("--megatron-fsdp-main-grads-dtype", f.fsdp_main_grads_dtype, {"fp32", "bf16", "fp16", "auto"});
    check_choice("--megatron-fsdp-grad-comm-dtype", f.fsdp_grad_comm_dtype, {"fp32", "fp16", "bf16", "auto"});
    LOOM_CHECK(f.megatron_fsdp_version == 1 || f.megatron_fsdp_version == 2,
               "argument --megatron-fsdp-version: invalid choice: " << f.megatron_fsdp_version << " (choose from 1, 2)", "");
    if (f.use_torch_fsdp2) {
        check_torch_fsdp2(given, o);
        LOOM_CHECK(!f.use_megatron_fsdp, "--use-torch-fsdp2 and --use-megatron-fsdp together", "give one of them");
    }
    if (!f.use_megatron_fsdp && !f.use_torch_fsdp2) return;   // Megatron reads the FSDP choices only with one
    LOOM_CHECK(f.megatron_fsdp_version == 1 || f.use_torch_fsdp2, "--megatron-fsdp-version 2 is not supported by Loom",
               "Loom implements Megatron-FSDP version 1 (the default), which runs with the distributed optimizer");
    // Torch FSDP2 shards everything: Megatron-FSDP's optim_grads_params (its own strategy flag is not read).
    const std::string strategy = f.use_torch_fsdp2 ? std::string("optim_grads_params") : f.data_parallel_sharding_strategy;
    o.ddp.use_megatron_fsdp = true;
    o.ddp.fsdp_sharding     = strategy == "no_shard" ? ddp::FsdpSharding::no_shard
                              : strategy == "optim"  ? ddp::FsdpSharding::optim
                              : strategy == "optim_grads" ? ddp::FsdpSharding::optim_grads
                                                          : ddp::FsdpSharding::optim_grads_params;
    // Megatron-FSDP version 1 runs with the distributed optimizer; with no_shard Loom's optimizer is then
    // simply unsharded (every rank steps every element, as Megatron's no_shard does).
    o.ddp.use_distributed_optimizer = o.ddp.fsdp_sharding != ddp::FsdpSharding::no_shard;
    // Hybrid sharding (Megatron's HSDP): with several instances each shards over its own ranks, and the
    // outer group replicates (no_shard); sharding the optimizer over the outer group too is not Loom's.
    LOOM_CHECK(o.ddp.num_distributed_optimizer_instances == 1 || f.outer_dp_sharding_strategy == "no_shard",
               "--outer-dp-sharding-strategy " << f.outer_dp_sharding_strategy << " is not supported by Loom",
               "Loom's hybrid sharding (--num-distributed-optimizer-instances > 1) replicates over the outer group: "
               "--outer-dp-sharding-strategy no_shard");
    LOOM_CHECK(!(o.ddp.fsdp_sharding == ddp::FsdpSharding::optim_grads_params && o.check_weight_hash_interval > 0),
               "check_weight_hash_across_dp_replicas_interval is not supported with optim_grads_params", "");
    LOOM_CHECK(!o.ddp.shards_grads() || !o.layer_graphs,
               "--cuda-graph-impl transformer_engine with --data-parallel-sharding-strategy " << strategy,
               "a captured layer keeps the addresses of its weights and gradients, which sharding gives back between "
               "uses; use --data-parallel-sharding-strategy optim or no_shard with layer graphs");
    // The dtype choices: Loom keeps f32 masters and f32 gradients, reduced in f32.
    LOOM_CHECK(f.fsdp_main_params_dtype == "fp32" || (f.fsdp_main_params_dtype == "auto" && !o.bf16 && !o.fp16),
               "--megatron-fsdp-main-params-dtype " << f.fsdp_main_params_dtype << " is not supported by Loom",
               "Loom's optimizer keeps f32 master weights; leave it at fp32");
    LOOM_CHECK(f.fsdp_main_grads_dtype == "fp32" || f.fsdp_main_grads_dtype == "auto",
               "--megatron-fsdp-main-grads-dtype " << f.fsdp_main_grads_dtype << " is not supported by Loom",
               "Loom accumulates gradients in f32 (auto and fp32 both mean that)");
    // The gradients travel in bf16 or f16 when asked (auto: as the DDP flags say: f32, or bf16 with
    // --grad-reduce-in-bf16 under --bf16).
    if (f.fsdp_grad_comm_dtype != "auto") {
        o.ddp.grad_comm_dtype = f.fsdp_grad_comm_dtype == "bf16"   ? DType::bf16
                                : f.fsdp_grad_comm_dtype == "fp16" ? DType::f16
                                                                   : DType::f32;
    }
}


}  // namespace loom::train
