#include "ddp/ddp.h"

#include "core/error.h"
#include "core/ops.h"

#include <algorithm>
#include <cmath>
#include <sstream>
#include <unordered_map>

namespace loom::ddp {

const char * fsdp_sharding_name(FsdpSharding sharding) {
    switch (sharding) {
    case FsdpSharding::no_shard: return "no_shard";
    case FsdpSharding::optim: return "optim";
    case FsdpSharding::optim_grads: return "optim_grads";
    case FsdpSharding::optim_grads_params: return "optim_grads_params";
    }
    return "?";
}

void DdpConfig::validate() const {
    LOOM_CHECK(!use_megatron_fsdp || use_distributed_optimizer == (fsdp_sharding != FsdpSharding::no_shard),
               "--use-megatron-fsdp with --data-parallel-sharding-strategy " << fsdp_sharding_name(fsdp_sharding)
                                                                             << (use_distributed_optimizer ? " and" : " without")
                                                                             << " the distributed optimizer",
               "every strategy but no_shard shards the optimizer state (the options resolve this)");
    LOOM_CHECK(!overlap_param_gather || use_distributed_optimizer || use_megatron_fsdp,
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
    LOOM_CHECK(grad_reduce_in_fp32 || !use_megatron_fsdp,
               "--use-megatron-fsdp with 16-bit gradient buffers (--grad-reduce-in-bf16 or --fp16 without "
               "--accumulate-allreduce-grads-in-fp32)",
               "Megatron-FSDP's buffers are f32 in Loom; its collectives' dtype is --megatron-fsdp-grad-comm-dtype");
    LOOM_CHECK(!bucket_size || *bucket_size >= 1, "--ddp-bucket-size must be >= 1 element, got " << *bucket_size,
               "omit it for Megatron's default, max(40M, 1M x dp) elements with --overlap-grad-reduce");
}

std::optional<int64_t> effective_bucket_size(const DdpConfig & config, int64_t dp) {
    if (!config.overlap_grad_reduce) return std::nullopt;
    return config.bucket_size ? config.bucket_size : std::optional<int64_t>(default_bucket_size(dp));
}

std::vector<ParamSpec> param_specs(const std::vector<model::Parameter *> & params, const std::vector<int> & chunk_of_param,
                                   const std::vector<int> & unit_of_param) {
    LOOM_CHECK(chunk_of_param.empty() || chunk_of_param.size() == params.size(),
               chunk_of_param.size() << " model chunks given for " << params.size() << " parameters", "");
    LOOM_CHECK(unit_of_param.empty() || unit_of_param.size() == params.size(),
               unit_of_param.size() << " FSDP units given for " << params.size() << " parameters", "");
    std::vector<ParamSpec> specs;
    for (size_t i = 0; i < params.size(); ++i) {
        const model::Parameter * p = params[i];
        specs.push_back(ParamSpec{p->name, p->data.shape(), p->compute_dtype(), p->shared_embedding, p->expert,
                                  chunk_of_param.empty() ? 0 : chunk_of_param[i], unit_of_param.empty() ? 0 : unit_of_param[i],
                                  p->fp8_blocks > 0});
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
        LOOM_CHECK(p->fp8_blocks == 0 || config_.use_distributed_optimizer,
                   "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or inference mode",
                   "the FP8 codes of " << p->name << " are encoded from the distributed optimizer's shards: add "
                                       "--use-distributed-optimizer");
        LOOM_CHECK(p->fp8_blocks == 0 || (!p->fp8_codes() && p->numel() % p->fp8_blocks == 0),
                   "parameter " << p->name << " marked for FP8 codes in " << p->fp8_blocks << " blocks",
                   "a layer marks an unconverted weight whose rows split evenly into the blocks");
        LOOM_CHECK(p->main_grad.dtype() == DType::f32 || p->main_grad.dtype() == p->data.dtype(),
                   "parameter " << p->name << " has a " << dtype_name(p->main_grad.dtype()) << " main_grad",
                   "gradients are float32 or the parameter's own dtype");
    }
    LOOM_CHECK(!config_.use_megatron_fsdp || !placement.unit_of_param.empty(), "Megatron-FSDP without the model's units",
               "pass the model's parameter units (GptModel::parameter_units) in the placement");
    specs_ = param_specs(params_, placement.chunk_of_param, config_.use_megatron_fsdp ? placement.unit_of_param : std::vector<int>{});
    int64_t       dp = dp_group_->size();
    LayoutOptions options;
    options.dp                              = dp;
    options.edp                             = expert_dp_group_->size();
    options.use_distributed_optimizer       = config_.use_distributed_optimizer;
    options.bucket_size                     = effective_bucket_size(config_, full_dp_);   // Megatron's: the whole dp
    options.pad_buckets_for_high_nccl_busbw = config_.pad_buckets_for_high_nccl_busbw;
    options.grad_reduce_in_fp32             = config_.grad_reduce_in_fp32;
    options.pipeline_rank                   = placement.pipeline_rank;
    options.overlap_param_gather_with_optimizer_step = placement.overlap_param_gather_with_optimizer_step;
    options.fsdp_units                      = config_.use_megatron_fsdp;
    layout_ = compute_layout(specs_, options);

    // Buffers, and every parameter re-pointed at its range (values kept, padding zero), once the compute
    // stream has finished with the old tensors.
    device_.compute_stream().synchronize();
    main_buffers_.resize(layout_.buffers.size());
    main_start_.resize(layout_.buffers.size());
    fp8_pieces_.resize(layout_.buffers.size());
    fp8_amax_.resize(layout_.buffers.size());
    fp8_blocks_.resize(layout_.buffers.size());
    for (size_t b = 0; b < layout_.buffers.size(); ++b) {
        const BufferLayout & buffer = layout_.buffers[b];
        if (buffer.param_dtype == DType::u8) init_fp8_buffer(static_cast<int>(b));
    }
    for (size_t b = 0; b < layout_.buffers.size(); ++b) {
        const BufferLayout & buffer = layout_.buffers[b];
        if (config_.shards_grads()) {
            // FSDP: the rank's shards; each bucket is whole only while its unit is in use (unsharded_*).
            comm::Communicator & group = buffer_group(static_cast<int>(b));
            std::vector<int64_t> starts;
            int64_t              shard_numel = 0;
            for (const BucketLayout & bucket : buffer.buckets) {
                starts.push_back(shard_numel);
                shard_numel += bucket.numel / group.size();
            }
            shard_start_.push_back(starts);
            grad_buffers_.push_back(Tensor::zeros({shard_numel}, DType::f32, device_, {MemoryKind::device, "grads"}));
            param_buffers_.push_back(Tensor::zeros({config_.shards_params() ? shard_numel : buffer.numel}, buffer.param_dtype,
                                                   device_, {MemoryKind::device, "weights"}));
            unsharded_grads_.emplace_back(buffer.buckets.size());
            unsharded_params_.emplace_back(buffer.buckets.size());
            for (const BucketLayout & bucket : buffer.buckets) {
                const int64_t shard = bucket.numel / group.size();
                Tensor        whole = config_.shards_params()
                                          ? Tensor::zeros({bucket.numel}, buffer.param_dtype, device_, {MemoryKind::device, "weights"})
                                          : param_buffers_.back().slice(bucket.offset, {bucket.numel});
                for (const ParamPlace & place : buffer.params) {
                    if (place.bucket != bucket.id) continue;
                    model::Parameter * p = params_[place.param];
                    Tensor data = whole.slice(place.start - bucket.offset, p->data.shape());
                    if (data.dtype() == p->data.dtype()) copy_now(data, p->data);   // FP8 codes: encoded below
                    p->data = data;
                }
                if (config_.shards_params()) {   // the rank's shard of the values; the whole bucket goes
                    copy_now(param_buffers_.back().slice(starts[static_cast<size_t>(bucket.id)], {shard}),
                             whole.narrow(0, group.rank() * shard, shard));
                    point_at(static_cast<int>(b), bucket.id, Tensor(), /*grads=*/false);
                }
                point_at(static_cast<int>(b), bucket.id, Tensor(), /*grads=*/true);
            }
            continue;
        }
        Tensor grads = Tensor::zeros({buffer.numel}, buffer.grad_dtype, device_, {MemoryKind::device, "grads"});
        Tensor weights;
        if (config_.use_distributed_optimizer) {
            weights = Tensor::zeros({buffer.numel}, buffer.param_dtype, device_, {MemoryKind::device, "weights"});
        }
        for (const ParamPlace & place : buffer.params) {
            model::Parameter * p = params_[place.param];
            Tensor grad = grads.slice(place.start, p->main_grad.shape());
            if (grad.dtype() == p->main_grad.dtype()) {
                copy_now(grad, p->main_grad);
            } else {   // a 16-bit buffer: the values rounded to it
                device_.ops().convert(device_.compute_stream(), p->main_grad, grad);
                device_.compute_stream().synchronize();
            }
            p->main_grad = grad;
            if (weights.defined()) {
                Tensor data = weights.slice(place.start, p->data.shape());
                if (data.dtype() == p->data.dtype()) copy_now(data, p->data);   // FP8 codes: encoded below
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
    if (has_fp8_codes_) {   // the first codes, from the initial values; FSDP's sharded units gather on use
        encode_fp8_params();
        if (!config_.shards_params()) {
            device_.compute_stream().record(*params_updated_);
            comm_stream_->wait(*params_updated_);
            for (int g = static_cast<int>(groups_.size()); g-- > 0;) dispatch_gather(g);
            for (int g = static_cast<int>(groups_.size()); g-- > 0;) {
                wait_gather(g);
                groups_[g].gather_dispatched = false;
            }
        }
    }
}

void DistributedDataParallel::init_fp8_buffer(int b) {
    // Called before any parameter is re-pointed: their data still hold the initial values, whole.
    const BufferLayout & buffer = layout_.buffers[static_cast<size_t>(b)];
    comm::Communicator & group  = buffer_group(b);
    Ops &                ops    = device_.ops();
    Stream &             stream = device_.compute_stream();
    int64_t              numel  = 0;
    for (const BucketLayout & bucket : buffer.buckets) {
        main_start_[b].push_back(numel);
        numel += bucket.numel / group.size();
    }
    // The main values are the f32 master the optimizer steps (as a 16-bit weight's master): its pool.
    main_buffers_[b] = Tensor::zeros({numel}, DType::f32, device_, {MemoryKind::device, "optimizer"});
    int64_t                          slots = 0;
    std::unordered_map<int, int64_t> first_slot;
    for (const ParamPlace & place : buffer.params) {
        model::Parameter * p = params_[place.param];
        p->fp8_model_dtype   = p->data.dtype();
        p->fp8_scale_inv     = Tensor::zeros({p->fp8_blocks}, DType::f32, device_, {MemoryKind::device, "weights"});
        fp8_blocks_[b].emplace_back(place.param, slots);
        first_slot[place.param] = slots;
        slots += p->fp8_blocks;
    }
    const std::vector<std::vector<ShardRange>> ranges = shard_ranges(buffer, group.rank());
    for (size_t k = 0; k < ranges.size(); ++k) {
        for (const ShardRange & r : ranges[k]) {
            model::Parameter * p = params_[r.param];
            const int64_t      n = r.param_end - r.param_start;
            Tensor main = main_buffers_[b].slice(main_start_[b][k] + r.gbuf_local_start, {n});
            ops.convert(stream, p->data.flatten().slice(r.param_start, {n}), main);
            fp8_pieces_[b].push_back(Fp8Piece{r.param, static_cast<int>(k), r, main, Tensor(), first_slot.at(r.param)});
        }
    }
    fp8_amax_[b]   = Tensor::zeros({slots}, DType::f32, device_, {MemoryKind::device, "weights"});
    fp8_no_values_ = Tensor::empty({0}, DType::f32, device_);
    fp8_no_codes_  = Tensor::empty({0}, DType::u8, device_);
    has_fp8_codes_ = true;
    stream.synchronize();
}

Tensor DistributedDataParallel::codes_shard(int buffer, int bucket, const ShardRange & range) {
    const int64_t n = range.gbuf_world_end - range.gbuf_world_start;
    if (config_.shards_params()) return param_buffers_[buffer].slice(shard_start_[buffer][bucket] + range.gbuf_local_start, {n});
    return param_buffers_[buffer].slice(range.gbuf_world_start, {n});
}

void DistributedDataParallel::encode_fp8_params() {
    if (!has_fp8_codes_) return;
    Ops &    ops    = device_.ops();
    Stream & stream = device_.compute_stream();
    for (size_t b = 0; b < layout_.buffers.size(); ++b) {
        if (!main_buffers_[b].defined()) continue;
        // Each block's piece of a shard piece: [lo, hi) of the parameter's elements, and the block.
        auto blocks_of = [&](const Fp8Piece & piece, auto && fn) {
            const model::Parameter & p     = *params_[piece.param];
            const int64_t            block = p.numel() / p.fp8_blocks;
            for (int64_t k = piece.range.param_start / block; k * block < piece.range.param_end; ++k) {
                const int64_t lo = std::max(piece.range.param_start, k * block);
                const int64_t hi = std::min(piece.range.param_end, (k + 1) * block);
                fn(p, k, lo - piece.range.param_start, hi - lo);
            }
        };
        const Tensor & amax = fp8_amax_[b];
        ops.fill_zero(stream, amax);
        for (const Fp8Piece & piece : fp8_pieces_[b]) {
            blocks_of(piece, [&](const model::Parameter &, int64_t k, int64_t at, int64_t n) {
                ops.fp8_amax(stream, piece.main.slice(at, {n}), amax.slice(piece.amax_slot + k, {1}));
            });
        }
        // Every rank's pieces: the amax of each whole block (Megatron's amax all-reduce over the
        // data-parallel group before it casts its shards).
        buffer_group(static_cast<int>(b)).all_reduce(amax, comm::ReduceOp::max, &stream)->wait();
        for (const auto & [param, slot] : fp8_blocks_[b]) {   // every block's 1 / s, owned here or not
            const model::Parameter & p = *params_[param];
            for (int64_t k = 0; k < p.fp8_blocks; ++k) {
                ops.fp8_encode(stream, fp8_no_values_, p.fp8_format, amax.slice(slot + k, {1}), fp8_no_codes_,
                               p.fp8_scale_inv.slice(k, {1}));
            }
        }
        for (Fp8Piece & piece : fp8_pieces_[b]) {
            if (!piece.codes.defined()) piece.codes = codes_shard(static_cast<int>(b), piece.bucket, piece.range);
            blocks_of(piece, [&](const model::Parameter & p, int64_t k, int64_t at, int64_t n) {
                ops.fp8_encode(stream, piece.main.slice(at, {n}), p.fp8_format, amax.slice(piece.amax_slot + k, {1}),
                               piece.codes.slice(at, {n}), p.fp8_scale_inv.slice(k, {1}));
            });
        }
    }
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
    if (config_.shards_grads()) {   // the shards accumulate every micro-batch's reduced unit gradients
        for (Group & group : groups_) {
            LOOM_CHECK(!group.grads_live, "a unit's gradients were made whole and never reduced", "");
            std::fill(group.count.begin(), group.count.end(), 0);
        }
        for (Tensor & grads : grad_buffers_) device_.ops().fill_zero(device_.compute_stream(), grads);
        last_microbatch_ = true;
        return;
    }
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
        if (config_.shards_grads()) {   // every micro-batch: a unit reduces once all its gradients are final
            auto it = index_.find(&p);
            LOOM_CHECK(it != index_.end(), "gradient-ready report for " << p.name << ", which DDP does not hold", "");
            const int g = group_of_param_[it->second];
            Group &   group = groups_[g];
            int &     count = group.count[member_of_param_[it->second]];
            LOOM_CHECK(group.grads_live && count == 0, "parameter " << p.name << " reported its gradient ready "
                                                                    << (group.grads_live ? "twice" : "outside its unit's backward"),
                       "Megatron-FSDP reduces each unit once per micro-batch: a layer reports each parameter once, "
                       "after the unit's before_backward hook");
            count = 1;
            if (std::all_of(group.count.begin(), group.count.end(), [](int c) { return c == 1; })) reduce_unit(g);
            return;
        }
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
        if (config_.check_for_nan_in_grad) check_finite(ref.buffer, ref.bucket, grads);
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
            group.grad_work.push_back(reduce_scatter_grads(reducer, grads, mine, op, group.in_flight));
            // Several instances: this instance's sum of the shard, summed with the other instances' (the
            // factor above already divides by every data-parallel rank; an average in the collective
            // averaged within the instance only).
            comm::Communicator * inter = layout_.buffers[ref.buffer].is_expert_parallel ? inter_expert_group_.get()
                                                                                         : inter_group_.get();
            if (inter) group.grad_work.push_back(inter->all_reduce(mine, comm::ReduceOp::sum, comm_stream_.get()));
        } else {
            group.grad_work.push_back(all_reduce_grads(reducer, grads, op, group.in_flight));
        }
    }
    group.grad_launched = true;
    if (!config_.overlap_grad_reduce) {
        wait_grad_sync(group);
    }
}

void DistributedDataParallel::check_finite(int buffer, int bucket_id, const Tensor & grads) const {
    const BucketLayout & bucket = layout_.buffers[static_cast<size_t>(buffer)].buckets[static_cast<size_t>(bucket_id)];
    const std::vector<float> host = values_f32(grads);   // 16-bit buffers widened
    for (const ParamPlace & place : layout_.buffers[static_cast<size_t>(buffer)].params) {
        if (place.bucket != bucket_id) continue;
        const float * pg = host.data() + (place.start - bucket.offset);
        for (int64_t i = 0; i < place.end - place.start; ++i) {
            LOOM_CHECK(std::isfinite(pg[i]),
                       "rank " << dp_group_->global_ranks()[dp_group_->rank()] << ": gradient of "
                               << params_[place.param]->name << " is " << pg[i] << " at element " << i
                               << " before the data-parallel reduction (bucket " << bucket_id << ")",
                       "--check-for-nan-in-loss-and-grad stops here; lower --lr, check the data, or "
                       "enable --clip-grad");
        }
    }
}

void DistributedDataParallel::wait_grad_sync(Group & group) {
    for (comm::WorkPtr & work : group.grad_work) work->wait();
    group.grad_work.clear();
    if (!group.in_flight.empty()) {   // work queued after the collectives (widening, a shard's sum) has run
        comm_stream_->synchronize();
        group.in_flight.clear();
    }
}

comm::WorkPtr DistributedDataParallel::reduce_scatter_grads(comm::Communicator & group, const Tensor & grads,
                                                            const Tensor & out, comm::ReduceOp op, std::vector<Tensor> & keep) {
    if (config_.grad_comm_dtype == DType::f32 || grads.dtype() != DType::f32) {
        return group.reduce_scatter(grads, out, op, comm_stream_.get());
    }
    Ops &  ops    = device_.ops();
    Tensor narrow = Tensor::empty({grads.numel()}, config_.grad_comm_dtype, device_, {MemoryKind::device, "comm"});
    Tensor block  = Tensor::empty({out.numel()}, config_.grad_comm_dtype, device_, {MemoryKind::device, "comm"});
    ops.convert(*comm_stream_, grads, narrow);
    comm::WorkPtr work = group.reduce_scatter(narrow, block, op, comm_stream_.get());
    ops.convert(*comm_stream_, block, out);
    keep.push_back(narrow);
    keep.push_back(block);
    return work;
}

comm::WorkPtr DistributedDataParallel::all_reduce_grads(comm::Communicator & group, const Tensor & grads, comm::ReduceOp op,
                                                        std::vector<Tensor> & keep) {
    if (config_.grad_comm_dtype == DType::f32 || grads.dtype() != DType::f32) {
        return group.all_reduce(grads, op, comm_stream_.get());
    }
    Tensor narrow = Tensor::empty({grads.numel()}, config_.grad_comm_dtype, device_, {MemoryKind::device, "comm"});
    device_.ops().convert(*comm_stream_, grads, narrow);
    comm::WorkPtr work = group.all_reduce(narrow, op, comm_stream_.get());
    device_.ops().convert(*comm_stream_, narrow, grads);
    keep.push_back(narrow);
    return work;
}

void DistributedDataParallel::finish_grad_sync() {
    if (config_.shards_grads()) {   // every unit reduced itself in every micro-batch's backward
        for (const Group & group : groups_) {
            for (size_t m = 0; m < group.params.size() && group.grads_live; ++m) {
                LOOM_CHECK(group.count[m] == 1, "parameter " << params_[group.params[m]]->name
                                                             << " never reported its gradient ready in the last backward",
                           "every layer's backward must call the gradient-ready callback for each of its parameters");
            }
        }
        for (Group & group : groups_) wait_grad_sync(group);   // the optimizer reads the shards next
        return;
    }
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
    encode_fp8_params();   // --fp8-param-gather: the codes of the updated shards, then their gather
    if (config_.shards_params()) {   // the gathered values are stale: each unit gathers again before its use
        for (int g = 0; g < static_cast<int>(groups_.size()); ++g) release_unit(g);
        return;
    }
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
    if (config_.shards_params()) {
        for (int g = static_cast<int>(groups_.size()); g-- > 0;) gather_unit(g);
        return;
    }
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

std::vector<int> DistributedDataParallel::groups_of(const std::vector<model::Parameter *> & params) const {
    std::vector<int> groups;
    for (const model::Parameter * p : params) {
        auto it = index_.find(p);
        if (it == index_.end()) continue;
        const int g = group_of_param_[it->second];
        if (std::find(groups.begin(), groups.end(), g) == groups.end()) groups.push_back(g);
    }
    return groups;
}

model::ParamHooks DistributedDataParallel::param_hooks() {
    using Params = std::vector<model::Parameter *>;
    model::ParamHooks hooks;
    if (config_.overlap_param_gather || config_.shards_params()) {
        hooks.before_forward = [this](const Params & ps) { before_forward(ps); };
    }
    if (config_.shards_params()) {
        hooks.after_forward  = [this](const Params & ps) { after_forward(ps); };
        hooks.after_backward = [this](const Params & ps) { after_backward(ps); };
    }
    if (config_.shards_grads()) hooks.before_backward = [this](const Params & ps) { before_backward(ps); };
    return hooks;
}

void DistributedDataParallel::before_forward(const std::vector<model::Parameter *> & params) {
    if (!config_.shards_params()) {
        ensure_params_ready(params);
        return;
    }
    const std::vector<int> groups = groups_of(params);
    for (int g : groups) gather_unit(g);
    // Forward runs from the model's input (the last group) down: the next unit's gather overlaps this one's
    // compute (--overlap-param-gather).
    if (config_.overlap_param_gather && !groups.empty()) prefetch_unit(groups.front() - 1);
}

void DistributedDataParallel::after_forward(const std::vector<model::Parameter *> & params) {
    if (!config_.shards_params()) return;
    for (int g : groups_of(params)) release_unit(g);
}

void DistributedDataParallel::before_backward(const std::vector<model::Parameter *> & params) {
    const std::vector<int> groups = groups_of(params);
    for (int g : groups) {
        if (config_.shards_params()) gather_unit(g);
        if (config_.shards_grads()) make_grads_whole(g);
    }
    // Backward runs from the output (group 0) up.
    if (config_.shards_params() && config_.overlap_param_gather && !groups.empty()) prefetch_unit(groups.front() + 1);
}

void DistributedDataParallel::after_backward(const std::vector<model::Parameter *> & params) {
    if (!config_.shards_params()) return;
    for (int g : groups_of(params)) {
        if (!groups_[g].grads_live) release_unit(g);   // reduced: this backward is done with the unit
    }
}

void DistributedDataParallel::point_at(int buffer, int bucket, const Tensor & whole, bool grads) {
    const BufferLayout & layout = layout_.buffers[static_cast<size_t>(buffer)];
    const int64_t        offset = layout.buckets[static_cast<size_t>(bucket)].offset;
    for (const ParamPlace & place : layout.params) {
        if (place.bucket != bucket) continue;
        model::Parameter * p      = params_[place.param];
        Tensor &           target = grads ? p->main_grad : p->data;
        target = whole.defined() ? whole.slice(place.start - offset, target.shape())
                                 : Tensor::unbacked(target.shape(), target.dtype(), device_);
    }
    (grads ? unsharded_grads_ : unsharded_params_)[static_cast<size_t>(buffer)][static_cast<size_t>(bucket)] = whole;
}

void DistributedDataParallel::dispatch_unit_gather(int g) {
    Group & group = groups_[g];
    if (group.gathered || group.gather_dispatched) return;
    // Fresh memory may be a block that work queued earlier on the compute stream still reads (the allocator
    // reuses blocks in host order): the communication stream writes it after that work.
    device_.compute_stream().record(*params_updated_);
    comm_stream_->wait(*params_updated_);
    for (const BucketRef & ref : group.buckets) {
        const BucketLayout & bucket = layout_.buffers[ref.buffer].buckets[ref.bucket];
        comm::Communicator & gather = buffer_group(ref.buffer);
        const int64_t        shard  = bucket.numel / gather.size();
        Tensor whole = Tensor::empty({bucket.numel}, layout_.buffers[ref.buffer].param_dtype, device_,
                                     {MemoryKind::device, kFsdpUnshardedPool});
        group.gather_work.push_back(gather.all_gather(
            param_buffers_[ref.buffer].slice(shard_start_[ref.buffer][ref.bucket], {shard}), whole, comm_stream_.get()));
        point_at(ref.buffer, ref.bucket, whole, /*grads=*/false);   // read only after gather_unit's wait
    }
    group.gather_dispatched = true;
}

void DistributedDataParallel::gather_unit(int g) {
    Group & group = groups_[g];
    if (group.gathered) return;
    dispatch_unit_gather(g);
    wait_gather(g);
    group.gather_dispatched = false;
    group.gathered          = true;
}

void DistributedDataParallel::prefetch_unit(int g) {
    if (g >= 0 && g < static_cast<int>(groups_.size())) dispatch_unit_gather(g);
}

void DistributedDataParallel::release_unit(int g) {
    Group & group = groups_[g];
    if (group.gather_dispatched) gather_unit(g);   // a prefetch in flight writes the memory: let it land
    if (!group.gathered) return;
    // Work already queued that reads the values holds its own reference: the memory returns to the pool
    // when the last of it has run.
    for (const BucketRef & ref : group.buckets) point_at(ref.buffer, ref.bucket, Tensor(), /*grads=*/false);
    group.gathered = false;
}

void DistributedDataParallel::make_grads_whole(int g) {
    Group & group = groups_[g];
    if (group.grads_live) return;
    wait_grad_sync(group);   // the previous micro-batch's reduction, if still in flight
    for (const BucketRef & ref : group.buckets) {
        const BucketLayout & bucket = layout_.buffers[ref.buffer].buckets[ref.bucket];
        Tensor grads = Tensor::empty({bucket.numel}, DType::f32, device_, {MemoryKind::device, kFsdpUnshardedPool});
        device_.ops().fill_zero(device_.compute_stream(), grads);
        point_at(ref.buffer, ref.bucket, grads, /*grads=*/true);
    }
    std::fill(group.count.begin(), group.count.end(), 0);
    group.grads_live = true;
}

void DistributedDataParallel::reduce_unit(int g) {
    Group &        group = groups_[g];
    const bool     avg   = config_.average_in_collective;
    Stream &       compute = device_.compute_stream();
    compute.record(*grads_ready_);
    comm_stream_->wait(*grads_ready_);
    if (config_.check_for_nan_in_grad) grads_ready_->synchronize();
    for (const BucketRef & ref : group.buckets) {
        const BucketLayout & bucket  = layout_.buffers[ref.buffer].buckets[ref.bucket];
        const Tensor         grads   = unsharded_grads_[ref.buffer][ref.bucket];
        comm::Communicator & reducer = buffer_group(ref.buffer);
        const int64_t        n       = reducer.size();
        if (config_.check_for_nan_in_grad) check_finite(ref.buffer, ref.bucket, grads);
        // As launch_grad_sync: 1/dp before a sum, edp/dp before an average over the buffer's group.
        const float factor = avg ? static_cast<float>(n) / static_cast<float>(full_dp_) : 1.0f / static_cast<float>(full_dp_);
        if (factor != 1.0f) device_.ops().scale(*comm_stream_, grads, factor);
        Tensor received = Tensor::empty({bucket.numel / n}, DType::f32, device_, {MemoryKind::device, kFsdpUnshardedPool});
        group.grad_work.push_back(reduce_scatter_grads(reducer, grads, received, avg ? comm::ReduceOp::avg : comm::ReduceOp::sum,
                                                       group.in_flight));
        // Hybrid sharding (several instances): each instance's shard, summed with the other instances'.
        comm::Communicator * inter = layout_.buffers[ref.buffer].is_expert_parallel ? inter_expert_group_.get()
                                                                                     : inter_group_.get();
        if (inter) group.grad_work.push_back(inter->all_reduce(received, comm::ReduceOp::sum, comm_stream_.get()));
        // This micro-batch's share joins the shard's sum, after the collective on the same stream.
        device_.ops().add_inplace(*comm_stream_, grad_buffers_[ref.buffer].slice(shard_start_[ref.buffer][ref.bucket],
                                                                                 {received.numel()}),
                                  received);
        // Both stay referenced until the reduction is complete (wait_grad_sync): their memory is not handed
        // to other work while the communication stream may still read it.
        group.in_flight.push_back(grads);
        group.in_flight.push_back(received);
        point_at(ref.buffer, ref.bucket, Tensor(), /*grads=*/true);
    }
    group.grads_live = false;
    if (!config_.overlap_grad_reduce) wait_grad_sync(group);
}

Tensor DistributedDataParallel::param_shard(int buffer, int bucket, const ShardRange & range) {
    const int64_t n = range.gbuf_world_end - range.gbuf_world_start;
    if (main_buffers_[buffer].defined()) return main_buffers_[buffer].slice(main_start_[buffer][bucket] + range.gbuf_local_start, {n});
    return codes_shard(buffer, bucket, range);
}

Tensor DistributedDataParallel::grad_shard(int buffer, int bucket, const ShardRange & range) {
    const int64_t n = range.gbuf_world_end - range.gbuf_world_start;
    if (config_.shards_grads()) return grad_buffers_[buffer].slice(shard_start_[buffer][bucket] + range.gbuf_local_start, {n});
    return grad_buffers_[buffer].slice(range.gbuf_world_start, {n});
}

std::vector<Tensor> DistributedDataParallel::reduced_grads(const model::Parameter & p) {
    if (!config_.shards_grads()) return {p.main_grad};
    auto it = index_.find(&p);
    LOOM_CHECK(it != index_.end(), "the reduced gradient of " << p.name << ", which DDP does not hold", "");
    if (shard_pieces_.empty()) {   // once: every parameter's pieces in this rank's shards
        shard_pieces_.resize(params_.size());
        for (size_t b = 0; b < layout_.buffers.size(); ++b) {
            const auto ranges = shard_ranges(layout_.buffers[b], buffer_group(static_cast<int>(b)).rank());
            for (size_t k = 0; k < ranges.size(); ++k) {
                for (const ShardRange & r : ranges[k]) {
                    shard_pieces_[static_cast<size_t>(r.param)].push_back(grad_shard(static_cast<int>(b), static_cast<int>(k), r));
                }
            }
        }
    }
    return shard_pieces_[static_cast<size_t>(it->second)];
}

}  // namespace loom::ddp
