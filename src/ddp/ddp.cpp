#include "ddp/ddp.h"

#include "core/error.h"
#include "core/ops.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <unordered_map>

namespace loom::ddp {

void DdpConfig::validate() const {
    LOOM_CHECK(!overlap_param_gather || use_distributed_optimizer,
               "--overlap-param-gather needs --use-distributed-optimizer",
               "only the distributed optimizer gathers parameters; add --use-distributed-optimizer or drop "
               "--overlap-param-gather");
    LOOM_CHECK(!overlap_param_gather || overlap_grad_reduce, "--overlap-param-gather needs --overlap-grad-reduce",
               "Megatron requires both overlaps together; add --overlap-grad-reduce");
    LOOM_CHECK(num_distributed_optimizer_instances >= 1,
               "--num-distributed-optimizer-instances must be >= 1, got " << num_distributed_optimizer_instances, "");
    LOOM_CHECK(num_distributed_optimizer_instances == 1 || use_distributed_optimizer,
               "Partial DistOpt cannot be used without DistOpt",
               "--num-distributed-optimizer-instances > 1 needs --use-distributed-optimizer");
    LOOM_CHECK(!bucket_size || *bucket_size >= 1, "--ddp-bucket-size must be >= 1 element, got " << *bucket_size,
               "omit it for Megatron's default, max(40M, 1M x dp) elements with --overlap-grad-reduce");
}

std::optional<int64_t> effective_bucket_size(const DdpConfig & config, int64_t dp) {
    if (!config.overlap_grad_reduce) return std::nullopt;
    return config.bucket_size ? config.bucket_size : std::optional<int64_t>(default_bucket_size(dp));
}

std::vector<ParamSpec> param_specs(const std::vector<model::Parameter *> & params, const std::vector<int> & chunk_of_param) {
    LOOM_CHECK(chunk_of_param.empty() || chunk_of_param.size() == params.size(),
               chunk_of_param.size() << " model chunks given for " << params.size() << " parameters", "");
    std::vector<ParamSpec> specs;
    for (size_t i = 0; i < params.size(); ++i) {
        const model::Parameter * p = params[i];
        specs.push_back(ParamSpec{p->name, p->data.shape(), p->data.dtype(), p->shared_embedding, p->expert,
                                  chunk_of_param.empty() ? 0 : chunk_of_param[i]});
    }
    return specs;
}

DistributedDataParallel::DistributedDataParallel(std::vector<model::Parameter *> params, const DdpConfig & config,
                                                 std::shared_ptr<comm::Communicator> dp_group, Device & device,
                                                 std::shared_ptr<comm::Communicator> expert_dp_group,
                                                 std::shared_ptr<comm::Communicator> inter_group,
                                                 std::shared_ptr<comm::Communicator> inter_expert_group,
                                                 const DdpPlacement & placement)
    : config_(config),
      dp_group_(std::move(dp_group)),
      expert_dp_group_(expert_dp_group ? std::move(expert_dp_group) : dp_group_),
      inter_group_(std::move(inter_group)),
      inter_expert_group_(inter_expert_group ? std::move(inter_expert_group) : inter_group_),
      full_dp_(dp_group_->size() * (inter_group_ ? inter_group_->size() : 1)),
      device_(device),
      params_(std::move(params)) {
    config_.validate();
    LOOM_CHECK((inter_group_ != nullptr) == (config_.num_distributed_optimizer_instances > 1) &&
                   (!inter_group_ || inter_group_->size() == config_.num_distributed_optimizer_instances),
               "--num-distributed-optimizer-instances " << config_.num_distributed_optimizer_instances
                                                        << " without its instance groups",
               "build the process groups with the same number of instances");
    // No relation between the two sizes is assumed: with MoE parallel folding the expert-data-parallel
    // group may be smaller than the data-parallel one (EP > 1) or larger (ETP < TP: the tensor-parallel
    // peers hold the same whole experts and see different tokens).
    // Expert parameters get buffers of their own (after the dense ones, as Megatron lays them out) and reduce
    // over the expert-data-parallel group, scaled by 1 / dp like every other gradient (the header).
    for (const model::Parameter * p : params_) {
        LOOM_CHECK(p->main_grad.dtype() == DType::f32, "parameter " << p->name << " has a "
                                                                    << dtype_name(p->main_grad.dtype()) << " main_grad",
                   "Loom accumulates gradients in float32");
    }
    specs_ = param_specs(params_, placement.chunk_of_param);
    int64_t       dp = dp_group_->size();
    LayoutOptions options;
    options.dp                              = dp;
    options.edp                             = expert_dp_group_->size();
    options.use_distributed_optimizer       = config_.use_distributed_optimizer;
    options.bucket_size                     = effective_bucket_size(config_, full_dp_);   // Megatron's: the whole dp
    options.pad_buckets_for_high_nccl_busbw = config_.pad_buckets_for_high_nccl_busbw;
    options.grad_reduce_in_fp32             = true;
    options.pipeline_rank                   = placement.pipeline_rank;
    options.overlap_param_gather_with_optimizer_step = placement.overlap_param_gather_with_optimizer_step;
    layout_ = compute_layout(specs_, options);

    // Buffers, and every parameter re-pointed at its range (values kept, padding zero), once the compute
    // stream has finished with the old tensors.
    device_.compute_stream().synchronize();
    for (const BufferLayout & buffer : layout_.buffers) {
        Tensor grads = Tensor::zeros({buffer.numel}, DType::f32, device_, {MemoryKind::device, "grads"});
        Tensor weights;
        if (config_.use_distributed_optimizer) {
            weights = Tensor::zeros({buffer.numel}, buffer.param_dtype, device_, {MemoryKind::device, "weights"});
        }
        for (const ParamPlace & place : buffer.params) {
            model::Parameter * p = params_[place.param];
            Tensor grad = grads.slice(place.start, p->main_grad.shape());
            copy_now(grad, p->main_grad);
            p->main_grad = grad;
            if (weights.defined()) {
                Tensor data = weights.slice(place.start, p->data.shape());
                copy_now(data, p->data);
                p->data = data;
            }
        }
        grad_buffers_.push_back(grads);
        param_buffers_.push_back(weights);
    }

    group_of_param_.assign(params_.size(), -1);
    member_of_param_.assign(params_.size(), -1);
    for (const std::vector<BucketRef> & refs : layout_.bucket_groups) {
        Group group;
        group.buckets = refs;
        for (const BucketRef & ref : refs) {
            for (int param : layout_.buffers[ref.buffer].buckets[ref.bucket].params) {
                group_of_param_[param]  = static_cast<int>(groups_.size());
                member_of_param_[param] = static_cast<int>(group.params.size());
                group.params.push_back(param);
            }
        }
        group.golden.assign(group.params.size(), 0);
        group.count.assign(group.params.size(), 0);
        groups_.push_back(std::move(group));
    }
    for (size_t i = 0; i < params_.size(); ++i) index_[params_[i]] = static_cast<int>(i);
    comm_stream_ = device_.stream_create("ddp-comm");
    grads_ready_ = device_.event_create();
    params_updated_ = device_.event_create();
}

DistributedDataParallel::~DistributedDataParallel() {
    for (Group & group : groups_) {
        for (auto * works : {&group.grad_work, &group.gather_work}) {
            for (comm::WorkPtr & work : *works) {
                try {
                    work->wait();
                } catch (...) {   // a destructor must not throw; the error surfaced where it was waited on
                }
            }
        }
    }
}

comm::Communicator & DistributedDataParallel::buffer_group(int buffer) {
    return layout_.buffers[static_cast<size_t>(buffer)].is_expert_parallel ? *expert_dp_group_ : *dp_group_;
}

Tensor DistributedDataParallel::bucket_view(const Tensor & buffer, const BucketLayout & bucket) const {
    return buffer.slice(bucket.offset, {bucket.numel});
}

void DistributedDataParallel::zero_grad_buffer() {
    for (Group & group : groups_) wait_grad_sync(group);
    bool recorded = false;
    for (const Group & group : groups_) {
        recorded = recorded || std::any_of(group.count.begin(), group.count.end(), [](int c) { return c > 0; });
    }
    if (first_iteration_ && recorded) {
        // The first iteration's readiness reports become the golden counts; every parameter must have
        // reported, or an overlapped reduction would wait for it forever.
        for (Group & group : groups_) {
            for (size_t m = 0; m < group.params.size(); ++m) {
                LOOM_CHECK(group.count[m] > 0, "parameter " << params_[group.params[m]]->name
                                                            << " never reported its gradient ready in the first iteration",
                           "every layer's backward must call the gradient-ready callback for each of its parameters");
            }
            group.golden = group.count;
        }
        first_iteration_ = false;
    }
    for (Tensor & grads : grad_buffers_) device_.ops().fill_zero(device_.compute_stream(), grads);
    for (Group & group : groups_) {
        std::fill(group.count.begin(), group.count.end(), 0);
        group.grad_launched = false;
    }
    last_microbatch_ = true;
}

model::GradReadyFn DistributedDataParallel::grad_ready() {
    return [this](model::Parameter & p) {
        if (!last_microbatch_) {
            return;   // no_sync: gradients accumulate, nothing is counted or launched
        }
        auto it = index_.find(&p);
        LOOM_CHECK(it != index_.end(), "gradient-ready report for " << p.name << ", which DDP does not hold", "");
        Group & group = groups_[group_of_param_[it->second]];
        ++group.count[member_of_param_[it->second]];
        if (config_.overlap_grad_reduce && !first_iteration_ && !group.grad_launched && group.count == group.golden) {
            launch_grad_sync(group);
        }
    };
}

void DistributedDataParallel::launch_grad_sync(Group & group) {
    LOOM_CHECK(!group.grad_launched, "a second gradient reduction of a bucket group while one is outstanding", "");
    const int64_t   dp = full_dp_;
    comm::ReduceOp  op = config_.average_in_collective ? comm::ReduceOp::avg : comm::ReduceOp::sum;
    // The gradients are final once the compute stream has run the backward work enqueued so far: the comm
    // stream waits for that point before it touches them.
    Stream & compute = device_.compute_stream();
    compute.record(*grads_ready_);
    comm_stream_->wait(*grads_ready_);
    if (config_.check_for_nan_in_grad) grads_ready_->synchronize();   // the host reads them to check
    for (const BucketRef & ref : group.buckets) {
        const BucketLayout & bucket = layout_.buffers[ref.buffer].buckets[ref.bucket];
        Tensor               grads  = bucket_view(grad_buffers_[ref.buffer], bucket);
        if (config_.check_for_nan_in_grad) {
            const Tensor host = host_readable(grads);
            for (const ParamPlace & place : layout_.buffers[ref.buffer].params) {
                if (place.bucket != ref.bucket) continue;
                const float * pg = host.data<float>() + (place.start - bucket.offset);
                for (int64_t i = 0; i < place.end - place.start; ++i) {
                    LOOM_CHECK(std::isfinite(pg[i]),
                               "rank " << dp_group_->global_ranks()[dp_group_->rank()] << ": gradient of "
                                       << params_[place.param]->name << " is " << pg[i] << " at element " << i
                                       << " before the data-parallel reduction (bucket " << ref.bucket << ")",
                               "--check-for-nan-in-loss-and-grad stops here; lower --lr, check the data, or "
                               "enable --clip-grad");
                }
            }
        }
        // docs/design/ddp_and_optimizers.md 1.8: 1/dp before a sum, or edp/dp before an average over the buffer's group
        // (1 for dense ones).
        comm::Communicator & reducer = buffer_group(ref.buffer);
        const int64_t        n       = reducer.size();
        const float factor = config_.average_in_collective ? static_cast<float>(n) / static_cast<float>(dp)
                                                           : 1.0f / static_cast<float>(dp);
        if (factor != 1.0f) device_.ops().scale(*comm_stream_, grads, factor);
        if (config_.use_distributed_optimizer) {
            int64_t shard = bucket.numel / n;
            Tensor  mine  = grads.narrow(0, reducer.rank() * shard, shard);
            group.grad_work.push_back(reducer.reduce_scatter(grads, mine, op, comm_stream_.get()));
            // Several instances: this instance's sum of the shard, summed with the other instances' (the
            // factor above already divides by every data-parallel rank; an average in the collective
            // averaged within the instance only).
            comm::Communicator * inter = layout_.buffers[ref.buffer].is_expert_parallel ? inter_expert_group_.get()
                                                                                         : inter_group_.get();
            if (inter) group.grad_work.push_back(inter->all_reduce(mine, comm::ReduceOp::sum, comm_stream_.get()));
        } else {
            group.grad_work.push_back(reducer.all_reduce(grads, op, comm_stream_.get()));
        }
    }
    group.grad_launched = true;
    if (!config_.overlap_grad_reduce) {
        wait_grad_sync(group);
    }
}

void DistributedDataParallel::wait_grad_sync(Group & group) {
    for (comm::WorkPtr & work : group.grad_work) work->wait();
    group.grad_work.clear();
}

void DistributedDataParallel::finish_grad_sync() {
    for (Group & group : groups_) {
        if (!group.grad_launched) launch_grad_sync(group);
    }
    for (Group & group : groups_) wait_grad_sync(group);
}

void DistributedDataParallel::dispatch_gather(int index) {
    Group & group = groups_[index];
    for (const BucketRef & ref : group.buckets) {
        const BucketLayout & bucket = layout_.buffers[ref.buffer].buckets[ref.bucket];
        comm::Communicator & gather = buffer_group(ref.buffer);
        Tensor               whole  = bucket_view(param_buffers_[ref.buffer], bucket);
        int64_t              shard  = bucket.numel / gather.size();
        group.gather_work.push_back(
            gather.all_gather(whole.narrow(0, gather.rank() * shard, shard), whole, comm_stream_.get()));
    }
    group.gather_dispatched = true;
}

void DistributedDataParallel::wait_gather(int index) {
    for (comm::WorkPtr & work : groups_[index].gather_work) work->wait();
    groups_[index].gather_work.clear();
}

void DistributedDataParallel::start_param_sync() {
    if (!config_.use_distributed_optimizer) return;
    // The optimizer updated the shards on the compute stream: the gathers (on the comm stream) start after.
    device_.compute_stream().record(*params_updated_);
    comm_stream_->wait(*params_updated_);
    for (Group & group : groups_) {
        LOOM_CHECK(group.gather_work.empty(), "a parameter all-gather is still outstanding at the next step", "");
        group.gather_dispatched = false;
    }
    if (config_.overlap_param_gather) {
        pending_gathers_ = true;   // ensure_params_ready() dispatches and waits, group by group
        for (Group & group : groups_) group.gather_pending = true;
        return;
    }
    for (int g = static_cast<int>(groups_.size()); g-- > 0;) dispatch_gather(g);
    for (int g = static_cast<int>(groups_.size()); g-- > 0;) wait_gather(g);
}

void DistributedDataParallel::ensure_params_ready(const std::vector<model::Parameter *> & params) {
    if (!pending_gathers_) return;
    for (const model::Parameter * p : params) {
        auto it = index_.find(p);
        if (it == index_.end()) continue;
        int g = group_of_param_[it->second];
        if (!groups_[g].gather_pending) continue;
        if (!groups_[g].gather_dispatched) dispatch_gather(g);
        wait_gather(g);
        groups_[g].gather_pending = false;
        // Forward runs from the model's input (the highest group) down: start the next one now.
        if (g > 0 && groups_[g - 1].gather_pending && !groups_[g - 1].gather_dispatched) dispatch_gather(g - 1);
    }
    pending_gathers_ = std::any_of(groups_.begin(), groups_.end(), [](const Group & x) { return x.gather_pending; });
}

void DistributedDataParallel::finish_param_sync() {
    if (!pending_gathers_) return;
    for (int g = static_cast<int>(groups_.size()); g-- > 0;) {
        if (groups_[g].gather_pending && !groups_[g].gather_dispatched) dispatch_gather(g);
    }
    for (int g = static_cast<int>(groups_.size()); g-- > 0;) {
        if (groups_[g].gather_pending) {
            wait_gather(g);
            groups_[g].gather_pending = false;
        }
    }
    pending_gathers_ = false;
}

}  // namespace loom::ddp
