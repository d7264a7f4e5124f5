// loom layout: DDP's param-and-grad buffers for a parameter list, without launching anything.
//
//   loom layout --params model.json --dp 4                                 buffers, buckets, one bar each
//   loom layout --params model.json --dp 4 --use-distributed-optimizer    plus padding and each rank's shard
//   loom layout ... --json                                                one JSON object (issue 4's schema)
//
// model.json: {"params": [[name, [d0, d1, ...], dtype, {"shared_embedding": true, "allreduce": false,
// "chunk": 1}?], ...]} in registration (forward) order, chunk by chunk (model chunks after the first, as a
// virtual pipeline rank holds them, are laid out as Megatron's DDP of each chunk: unbucketed, one group).
#include "apps/loom/commands.h"
#include "ddp/layout.h"

#include <CLI/CLI.hpp>

#include <iostream>
#include <string>

namespace loom::app {

int cmd_layout(int argc, char ** argv) {
    CLI::App app{"Print DDP's contiguous param-and-grad buffers for a list of parameters: the buffers "
                 "(one per param dtype, grad dtype and expert flag), each parameter's range (reverse "
                 "registration order), the buckets and their padding, the bucket groups and, with the "
                 "distributed optimizer, the range of every parameter each data-parallel rank owns.\n"
                 "Unlike `loom train`, which applies Megatron's default bucket size max(40M, 1M*dp) "
                 "elements with --overlap-grad-reduce, loom layout describes the buffers for the options "
                 "given: without --bucket-size every buffer is one bucket (no size limit).",
                 "loom layout"};
    std::string     params_path;
    int64_t         dp          = 1;
    int64_t         edp         = 1;
    int64_t         bucket_size = 0;
    ddp::LayoutOptions options;
    bool            json = false;
    app.add_option("--params", params_path,
                   "JSON file {\"params\": [[name, [d0, ...], dtype, {\"shared_embedding\": true, "
                   "\"allreduce\": false, \"chunk\": 1}?], ...]} in registration order, chunk by chunk")
        ->required();
    app.add_option("--dp", dp, "data-parallel size: dense buffers are reduced (and sharded) over it")
        ->capture_default_str();
    app.add_option("--edp", edp, "expert data-parallel size for params with \"allreduce\": false (default: --dp)");
    app.add_flag("--use-distributed-optimizer", options.use_distributed_optimizer,
                 "shard over DP ranks: 64-element param starts, bucket ends padded to lcm(dp, 128), the shared "
                 "embedding in its own bucket, and each rank's shard ranges");
    app.add_option("--bucket-size,--ddp-bucket-size", bucket_size,
                   "elements per bucket: a bucket closes after the param that reaches it (default: no limit, "
                   "one bucket per buffer)");
    app.add_flag("--ddp-pad-buckets-for-high-nccl-busbw", options.pad_buckets_for_high_nccl_busbw,
                 "pad bucket ends to lcm(dp, 128, 65536) instead of lcm(dp, 128)");
    app.add_flag("--grad-reduce-in-fp32,--accumulate-allreduce-grads-in-fp32", options.grad_reduce_in_fp32,
                 "float32 grad buffers whatever the param dtype");
    app.add_option("--pipeline-rank", options.pipeline_rank,
                   "the pipeline stage these parameters are on: after the first, no buffer is cut by --bucket-size "
                   "(Megatron's DDP on later stages)")
        ->capture_default_str();
    app.add_flag("--overlap-param-gather-with-optimizer-step", options.overlap_param_gather_with_optimizer_step,
                 "no model chunk cut by --bucket-size, each chunk's buckets one group (Megatron's disable_bucketing)");
    app.add_flag("--json", json, "print one JSON object instead of the table");

    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    options.dp  = dp;
    options.edp = app.count("--edp") ? edp : dp;
    if (app.count("--bucket-size")) {
        options.bucket_size = bucket_size;
    }

    // Both throw loom::Error on bad input: exit 2, nothing on stdout.
    std::vector<ddp::ParamSpec> params = ddp::read_param_specs(params_path);
    ddp::Layout                 layout = ddp::compute_layout(params, options);
    const bool                  shards = options.use_distributed_optimizer;
    std::string out = json ? ddp::layout_json(layout, params, shards) + "\n" : ddp::layout_table(layout, params, shards);
    std::cout << out;
    return 0;
}

}  // namespace loom::app
