// DistributedDataParallel: the model's gradients (and, with the distributed optimizer, its weights) in
// contiguous buffers laid out by ddp/layout.h, reduced over the data-parallel group bucket group by
// bucket group (docs/design/ddp_and_optimizers.md section 1; the section numbers below refer to that document).
//
// One iteration, as the trainer drives it:
//
//   zero_grad_buffer()                      zero the grad buffers; the first iteration's readiness
//                                           counts become the golden counts
//   for each microbatch k:
//     set_last_microbatch(k == last)        Megatron's no_sync: only the last microbatch counts readiness
//     model.forward / model.backward(..., grad_ready())
//                                           layers ADD into main_grad (a view of the grad buffer) and
//                                           report each parameter ready; with --overlap-grad-reduce a
//                                           bucket group whose parameters have all reported launches its
//                                           collective at once (not in the first iteration, whose counts
//                                           are being recorded)
//   finish_grad_sync()                      launch what has not been launched, wait for everything
//   optimizer step                          (optim/distributed_optimizer.h with the distributed optimizer)
//   start_param_sync()                      distributed optimizer: all-gather the updated shards, now or,
//                                           with --overlap-param-gather, lazily before each layer's forward
//                                           (ensure_params_ready, installed as the model's pre-forward hook);
//                                           the comm stream first waits on an event recorded on the compute
//                                           stream, where the optimizer's update was enqueued
//   finalize_grads (ddp/finalize_grads.h)   the trainer's step between the two: the DP reduction, then the
//                                           tied-embedding and sequence-parallel all-reduces
//
// Collectives per bucket group: the bucket's local gradients are scaled in place by 1/dp (or reduced
// with AVG under --ddp-average-in-collective), then reduce-scattered into the rank's shard of the same
// buffer (distributed optimizer: only that shard is valid afterwards) or all-reduced whole.
//
// Expert parameters (Parameter::expert) sit in buffers of their own that reduce and shard over the
// expert-data-parallel group (edp ranks) instead (sections 1.2, 1.8, 1.14). Their factor is still 1/dp, not
// 1/edp (edp/dp before an AVG over edp): an expert's gradient already sums the tokens of the EP ranks that
// sent it rows, so summing over edp and dividing by dp = ep x edp (TP = 1) is the average over the dense
// data-parallel ranks, as for every other gradient. With
// --check-for-nan-in-loss-and-grad a non-finite local gradient stops the run before the collective,
// naming the rank and the parameter.
//
// Gradients are accumulated and reduced in f32 (DdpConfig::grad_reduce_in_fp32, Megatron's
// --accumulate-allreduce-grads-in-fp32, which it turns on for --bf16), or, without it, in each parameter's
// own dtype (--grad-reduce-in-bf16 under --bf16; --fp16 by default): every buffer then holds bf16 or f16
// gradients, half the bytes (docs/design/ddp_and_optimizers.md 1.17). Each layer still computes its
// contribution in f32 and rounds the sum into the buffer once (model::accumulate_grads), the collectives
// run in the buffer's dtype, and the optimizer widens its gradients to f32 before it reads them. Layers report a parameter ready when
// they have enqueued its gradient's kernels on the device's compute stream, not when those have run: a
// launch records an event on the compute stream, the communication stream waits on it, then scales the
// bucket and runs its collective, so backward compute and reductions overlap. Zeroing the buffers is
// compute-stream work too; finish_grad_sync() returns once every reduction has completed.
#pragma once

#include "comm/communicator.h"
#include "ddp/layout.h"
#include "model/parameter.h"

#include <memory>
#include <optional>
#include <unordered_map>
#include <vector>

namespace loom::ddp {

// Megatron-FSDP's --data-parallel-sharding-strategy: what each data-parallel rank keeps only its shard of.
enum class FsdpSharding { no_shard, optim, optim_grads, optim_grads_params };

struct DdpConfig {
    bool                   use_distributed_optimizer       = false;
    // --use-megatron-fsdp: buckets are the model's units (the embedding, each layer, the final norm with the
    // output layer), and with optim_grads each unit's gradients are reduce-scattered into the rank's shard
    // after every micro-batch's backward, with optim_grads_params its values are also gathered before each
    // use and given back after (the header). The distributed optimizer shards the Adam state for every
    // strategy but no_shard.
    bool                   use_megatron_fsdp               = false;
    FsdpSharding           fsdp_sharding                   = FsdpSharding::optim_grads_params;
    // --megatron-fsdp-grad-comm-dtype: the dtype gradients travel in. bf16 or f16: each bucket is rounded to
    // it on the communication stream before its collective and the result widened back to f32 after (half
    // the bytes on the wire; gradients still accumulate in f32).
    DType                  grad_comm_dtype                 = DType::f32;
    // Megatron's grad_reduce_in_fp32: the gradient buffers in f32; false: in their parameters' dtype (the
    // header). Megatron-FSDP keeps f32 buffers (its own --megatron-fsdp-main-grads-dtype).
    bool                   grad_reduce_in_fp32             = true;
    bool                   overlap_grad_reduce             = false;
    bool                   overlap_param_gather            = false;
    std::optional<int64_t> bucket_size;                     // --ddp-bucket-size; nullopt: Megatron's default
    bool                   pad_buckets_for_high_nccl_busbw = false;
    bool                   average_in_collective           = false;
    bool                   check_for_nan_in_grad           = false;
    // --num-distributed-optimizer-instances N: the data-parallel ranks form N instances of dp / N consecutive
    // ranks; each instance shards the optimizer over its own ranks (reduce-scatter and all-gather within it)
    // and the instances all-reduce their shards (Megatron's partial distributed optimizer).
    int64_t                num_distributed_optimizer_instances = 1;

    // Rejects --overlap-param-gather without the distributed optimizer or without --overlap-grad-reduce
    // and a bucket size below 1, naming the flags.
    void validate() const;
    bool shards_grads() const { return use_megatron_fsdp && fsdp_sharding >= FsdpSharding::optim_grads; }
    bool shards_params() const { return use_megatron_fsdp && fsdp_sharding == FsdpSharding::optim_grads_params; }
};

// The allocator pool of FSDP's whole buckets (values and gradients between their gathering and release):
// memory that comes and goes, kept apart from the "weights" and "grads" pools of what a rank keeps.
inline constexpr const char * kFsdpUnshardedPool = "fsdp-unsharded";

// --data-parallel-sharding-strategy's names.
const char * fsdp_sharding_name(FsdpSharding sharding);

// The bucket size the first model chunk of the first pipeline stage uses (section 1.5): without
// --overlap-grad-reduce none (one bucket per buffer, apart from the shared embedding's); else
// --ddp-bucket-size when given, or Megatron's default max(40M, 1M x dp). The layout leaves the other
// chunks and stages unbucketed (layout.h).
std::optional<int64_t> effective_bucket_size(const DdpConfig & config, int64_t dp);

// Where a rank's parameters sit in the pipeline: the model chunk of each parameter (in order; empty: all in
// chunk 0), the rank's pipeline stage, and --overlap-param-gather-with-optimizer-step (no chunk bucketed).
struct DdpPlacement {
    std::vector<int> chunk_of_param;
    std::vector<int> unit_of_param;   // Megatron-FSDP's units (model::GptModel::parameter_units)
    int64_t          pipeline_rank = 0;
    bool             overlap_param_gather_with_optimizer_step = false;
};

// The layout parameters of a model, in registration order (chunk 0 unless `chunk_of_param` says; unit 0
// unless `unit_of_param` says).
std::vector<ParamSpec> param_specs(const std::vector<model::Parameter *> & params,
                                   const std::vector<int> & chunk_of_param = {}, const std::vector<int> & unit_of_param = {});

class DistributedDataParallel {
public:
    // Re-points every parameter's main_grad (and, with the distributed optimizer, its data) at views of
    // the buffers, keeping their values. `dp_group` reduces and shards the dense buffers, `expert_dp_group`
    // (null: dp_group) the expert buffers. With several distributed-optimizer instances these are the
    // instance's own ranks (Megatron's intra-partial groups), and `inter_group` / `inter_expert_group` join
    // the ranks holding the same shard in every instance: each shard, reduce-scattered in its instance, is
    // then all-reduced over them.
    DistributedDataParallel(std::vector<model::Parameter *> params, const DdpConfig & config,
                            std::shared_ptr<comm::Communicator> dp_group, Device & device,
                            std::shared_ptr<comm::Communicator> expert_dp_group = nullptr,
                            std::shared_ptr<comm::Communicator> inter_group = nullptr,
                            std::shared_ptr<comm::Communicator> inter_expert_group = nullptr,
                            const DdpPlacement & placement = {});
    ~DistributedDataParallel();
    DistributedDataParallel(const DistributedDataParallel &) = delete;
    DistributedDataParallel & operator=(const DistributedDataParallel &) = delete;

    void zero_grad_buffer();
    void set_last_microbatch(bool last) { last_microbatch_ = last; }
    // The callback to hand to backward.
    model::GradReadyFn grad_ready();
    void finish_grad_sync();

    void start_param_sync();
    // Pre-forward hook: the buckets holding `params` are gathered before this returns (a no-op unless
    // --overlap-param-gather left gathers pending).
    void ensure_params_ready(const std::vector<model::Parameter *> & params);
    // Completes every pending gather (before evaluation, export or a checkpoint); with optim_grads_params
    // every unit is gathered and stays so until its next use gives it back.
    void finish_param_sync();

    // Megatron-FSDP's module hooks (model::ParamHooks; no-ops for what the strategy does not shard):
    // before a module's forward its units' values are gathered, after it given back; before its backward
    // they are gathered again and its units' gradient buckets made whole (zeroed); after it, the units
    // whose gradients have all been reported ready (grad_ready: reduce-scattered at once) give their values
    // back.
    void before_forward(const std::vector<model::Parameter *> & params);
    void after_forward(const std::vector<model::Parameter *> & params);
    void before_backward(const std::vector<model::Parameter *> & params);
    void after_backward(const std::vector<model::Parameter *> & params);

    // The model hooks this configuration needs (--overlap-param-gather's pre-forward wait; Megatron-FSDP's
    // four), to install on every model chunk; empty members for the rest.
    model::ParamHooks param_hooks();

    // This rank's shard of a bucket's values or gradients as the optimizer steps it (the piece `range` of
    // bucket `bucket` of buffer `buffer`): a view of the whole buffer, or of the shard-only storage where
    // the strategy keeps only the shard. In a buffer of FP8 codes, the values are the f32 main copy.
    Tensor param_shard(int buffer, int bucket, const ShardRange & range);
    // --fp8-param-gather: re-encodes the FP8 codes of this rank's shards from their f32 main values, each
    // weight block by its amax over the data-parallel group (one max all-reduce per buffer), and sets every
    // block's scale_inv. start_param_sync() runs it first; a no-op without FP8 codes.
    void   encode_fp8_params();
    Tensor grad_shard(int buffer, int bucket, const ShardRange & range);
    // The gradient of `p` after the reduction: main_grad, or the pieces of it this rank's shards hold
    // (possibly none) where gradients are sharded.
    std::vector<Tensor> reduced_grads(const model::Parameter & p);

    const DdpConfig &                       config() const { return config_; }
    const Layout &                          layout() const { return layout_; }
    const std::vector<ParamSpec> &          specs() const { return specs_; }
    const std::vector<model::Parameter *> & params() const { return params_; }
    comm::Communicator &                    dp_group() { return *dp_group_; }
    int64_t                                 dp_rank() const { return dp_group_->rank(); }
    int64_t                                 dp_size() const { return dp_group_->size(); }
    comm::Communicator &                    expert_dp_group() { return *expert_dp_group_; }
    // The group that reduces and shards a buffer of layout().buffers: dp, or expert dp for expert buffers.
    comm::Communicator &                    buffer_group(int buffer);
    Tensor &                                grad_buffer(int buffer) { return grad_buffers_[buffer]; }
    Tensor &                                param_buffer(int buffer) { return param_buffers_[buffer]; }
    int64_t                                 num_bucket_groups() const { return static_cast<int64_t>(groups_.size()); }

private:
    struct Group {
        std::vector<BucketRef> buckets;
        std::vector<int>       params;           // indices into params_
        std::vector<int>       golden, count;    // readiness reports per member, golden from iteration 1
        bool                   grad_launched = false;
        bool                   gather_dispatched = false;
        bool                   gather_pending = false;    // --overlap-param-gather: not gathered yet
        std::vector<comm::WorkPtr> grad_work, gather_work;
        bool                   gathered   = false;   // FSDP optim_grads_params: the unit's values are whole
        bool                   grads_live = false;   // FSDP optim_grads(_params): its gradient buckets are whole
        std::vector<Tensor>    in_flight;            // what a reduction still in flight reads and writes
    };

    void launch_grad_sync(Group & group);
    void wait_grad_sync(Group & group);
    void dispatch_gather(int group);
    void wait_gather(int group);
    Tensor bucket_view(const Tensor & buffer, const BucketLayout & bucket) const;
    std::vector<int> groups_of(const std::vector<model::Parameter *> & params) const;
    // Megatron-FSDP's per-unit steps (the header).
    // Points the values (or main_grads) of a bucket's parameters at their ranges of `whole`, or at
    // unbacked tensors when it is undefined, and keeps `whole` as the bucket's unsharded tensor.
    void point_at(int buffer, int bucket, const Tensor & whole, bool grads);
    void dispatch_unit_gather(int group);
    void gather_unit(int group);
    void prefetch_unit(int group);   // a group index out of range: nothing
    // The data-parallel collectives of a bucket's gradients, on the communication stream: a reduce-scatter
    // of `grads` into `out` (the rank's block), or an all-reduce in place. f32 gradients travel in
    // config_.grad_comm_dtype, with scratch in the narrower dtype kept in `keep` until the work is waited
    // for; 16-bit ones in their own dtype.
    comm::WorkPtr reduce_scatter_grads(comm::Communicator & group, const Tensor & grads, const Tensor & out,
                                       comm::ReduceOp op, std::vector<Tensor> & keep);
    comm::WorkPtr all_reduce_grads(comm::Communicator & group, const Tensor & grads, comm::ReduceOp op,
                                   std::vector<Tensor> & keep);
    void release_unit(int group);
    void make_grads_whole(int group);
    void reduce_unit(int group);
    // --check-for-nan-in-loss-and-grad: `grads` is bucket `bucket` of `buffer`, on the host's side.
    void check_finite(int buffer, int bucket, const Tensor & grads) const;

    DdpConfig                           config_;
    std::shared_ptr<comm::Communicator> dp_group_;
    std::shared_ptr<comm::Communicator> expert_dp_group_;
    std::shared_ptr<comm::Communicator> inter_group_, inter_expert_group_;   // null: one instance
    int64_t                             full_dp_ = 1;   // every data-parallel rank, all instances
    Device &                            device_;
    std::vector<model::Parameter *>     params_;
    std::vector<ParamSpec>              specs_;
    Layout                              layout_;
    // Per buffer: the whole buffer, or this rank's shards of its buckets back to back where the strategy
    // keeps only the shard (FSDP: the gradients with optim_grads, the values too with optim_grads_params).
    std::vector<Tensor>                 grad_buffers_, param_buffers_;
    // --fp8-param-gather, per buffer of codes (empty for the others): the f32 main values of this rank's
    // shards back to back (bucket k's at main_start_[b][k]), what the optimizer steps; the pieces the rank
    // owns; one amax per weight block of the buffer.
    struct Fp8Piece {
        int        param = 0, bucket = 0;
        ShardRange range;
        Tensor     main, codes;     // the piece's f32 main values and its codes in the u8 buffer
        int64_t    amax_slot = 0;   // its parameter's first block's slot in fp8_amax_
    };
    Tensor                              fp8_no_values_, fp8_no_codes_;   // empty: fp8_encode of a scale alone
    std::vector<Tensor>                 main_buffers_;
    std::vector<std::vector<int64_t>>   main_start_;
    std::vector<std::vector<Fp8Piece>>  fp8_pieces_;
    std::vector<Tensor>                 fp8_amax_;
    std::vector<std::vector<std::pair<int, int64_t>>> fp8_blocks_;   // per buffer: (param, its first amax slot)
    bool                                has_fp8_codes_ = false;
    // Sets up buffer b of FP8 codes: its main storage and pieces from the parameters' initial values.
    void                                init_fp8_buffer(int b);
    // The values buffer's shard of `range` (for FP8 codes: where the codes of the rank's piece live).
    Tensor                              codes_shard(int buffer, int bucket, const ShardRange & range);
    // FSDP, per buffer and bucket: the whole bucket while its unit is in use (undefined between uses; the
    // main_grads or values of its parameters are views of it, or unbacked), and where the rank's shard
    // starts in the shard storage.
    std::vector<std::vector<Tensor>>    unsharded_grads_, unsharded_params_;
    std::vector<std::vector<int64_t>>   shard_start_;
    std::vector<std::vector<Tensor>>    shard_pieces_;   // per parameter, its reduced_grads (filled on first use)
    std::vector<Group>                  groups_;
    std::vector<int>                    group_of_param_, member_of_param_;
    std::unordered_map<const model::Parameter *, int> index_;   // parameter -> index into params_
    std::unique_ptr<Stream>             comm_stream_;
    std::unique_ptr<Event>              grads_ready_;   // recorded on the compute stream before each reduction
    std::unique_ptr<Event>              params_updated_;   // recorded on it after the optimizer step
    bool                                first_iteration_ = true;
    bool                                last_microbatch_ = true;
    bool                                pending_gathers_ = false;
};

}  // namespace loom::ddp
