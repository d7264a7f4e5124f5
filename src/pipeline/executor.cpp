#include "pipeline/executor.h"

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <map>
#include <string>
#include <tuple>

namespace loom::pipeline {

PipelineExecutor::PipelineExecutor(std::vector<model::GptModel *> chunks,
                                   std::shared_ptr<comm::Communicator> pp_group, parallel::PipelineChannels channels,
                                   int num_microbatches, int group_size)
    : chunks_(std::move(chunks)), pp_(std::move(pp_group)), microbatches_(num_microbatches) {
    LOOM_CHECK(!chunks_.empty(), "a pipeline stage without model chunks", "");
    rank_                     = pp_ ? pp_->rank() : 0;
    options_.pp               = pp_ ? pp_->size() : 1;
    LOOM_CHECK(chunks_.size() == 1 || pp_, "model chunks without a pipeline group", "");
    options_.num_microbatches = num_microbatches;
    if (chunks_.size() > 1) {
        options_.vpp = static_cast<int>(chunks_.size());
        if (group_size > 0) options_.microbatch_group_size = group_size;
    }
    validate_schedule(options_);
    set_layer_graphs(nullptr);
    ops_       = schedule_ops(options_, rank_);
    plan_      = p2p_plan(options_, rank_, ops_);
    eval_plan_ = p2p_plan(options_, rank_, evaluation_ops(num_microbatches, static_cast<int>(chunks_.size())));
    // LOOM_PP_ONE_COMMUNICATOR=1, a test seam, sends every transfer over the pipeline group itself, as Loom did
    // before the channels: under NCCL's semantics an interleaved schedule then deadlocks (tests/test_cuda_train.cpp
    // shows the watchdog catching it on the emulated device).
    const char * seam          = std::getenv("LOOM_PP_ONE_COMMUNICATOR");
    const bool   one_pp_comm   = seam != nullptr && std::string(seam) == "1";
    // Resolve every channel either plan uses to its communicator now, so a missing one is an error here rather
    // than a hang in the middle of a schedule.
    for (const P2PPlan * plan : {&plan_, &eval_plan_}) {
        for (const ChannelUse & use : plan->channels) {
            if (links_.count(use.channel)) continue;
            const bool gradient = use.channel.kind == TransferKind::gradient;
            Link       l;
            if (one_pp_comm) {
                l.comm = pp_;
                l.peer = use.send ? use.channel.dst : use.channel.src;
                links_.emplace(use.channel, std::move(l));
                continue;
            }
            l.comm = channels.find(use.channel.src, use.channel.dst, gradient);
            LOOM_CHECK(l.comm, "pipeline rank " << rank_ << " has no communicator for the "
                                                << channel_label(use.channel) << " channel of a " << options_.pp
                                                << "-stage pipeline",
                       "build the process groups with ProcessGroups::create, which splits the pipeline channels "
                       "(pp_channels) next to the pipeline group");
            LOOM_CHECK(l.comm->size() == 2 && l.comm->rank() == (use.send ? 0 : 1),
                       "the communicator '" << l.comm->name() << "' of the " << channel_label(use.channel)
                                            << " channel has " << l.comm->size() << " ranks, this one at "
                                            << l.comm->rank(),
                       "a channel's communicator holds its source (rank 0) and destination (rank 1)");
            l.peer = use.send ? 1 : 0;
            links_.emplace(use.channel, std::move(l));
        }
    }
    if (!one_pp_comm) connect_channels();
}

const PipelineExecutor::Link & PipelineExecutor::link(const Channel & channel) const {
    auto it = links_.find(channel);
    LOOM_CHECK(it != links_.end(), "no communicator for the pipeline channel " << channel_label(channel), "");
    return it->second;
}

void PipelineExecutor::connect_channels() {
    if (links_.empty()) return;
    Device & device = chunks_[0]->device();
    Stream & stream = device.compute_stream();
    for (const Channel & channel : pipeline_channels(options_.pp)) {
        auto it = links_.find(channel);
        if (it == links_.end()) continue;
        // Both ends use a channel or neither (the plans are functions of the same options), so each waits here
        // only for a peer that is on its way to the same channel.
        Tensor t = Tensor::zeros({1}, DType::f32, device, {MemoryKind::device, "activations"});
        if (channel.src == rank_) {
            it->second.comm->send(t, it->second.peer, 0, &stream)->wait();
        } else {
            it->second.comm->recv(t, it->second.peer, 0)->wait();
        }
    }
}

void PipelineExecutor::set_layer_graphs(model::LayerGraphs * graphs) {
    graphs_ = graphs;
    runs_.clear();
    for (const model::GptModel * chunk : chunks_) runs_.push_back(chunk->layer_runs(graphs));
}

PipelineExecutor::Result PipelineExecutor::run(const std::function<model::MicroBatch()> & next_batch,
                                               const model::GradReadyFn &                 ready,
                                               const std::function<void(bool)> &          set_last_microbatch,
                                               bool                                       wait) {
    return execute(plan_, false, next_batch, ready, set_last_microbatch, wait);
}

void PipelineExecutor::read_losses(Result & result) {
    for (size_t k = 0; k < result.pending_losses.size(); ++k) {
        const auto & [losses, mask] = result.pending_losses[k];
        result.losses[k].sum = model::GptModel::masked_loss_sum(losses, mask);
    }
    result.pending_losses.clear();
}

PipelineExecutor::Result PipelineExecutor::evaluate(const std::function<model::MicroBatch()> & next_batch) {
    return execute(eval_plan_, true, next_batch, nullptr, nullptr);
}

PipelineExecutor::Result PipelineExecutor::execute(const P2PPlan & plan, bool forward_only,
                                                   const std::function<model::MicroBatch()> & next_batch,
                                                   const model::GradReadyFn &                 ready,
                                                   const std::function<void(bool)> &          set_last_microbatch,
                                                   bool                                       wait) {
    const int     pp = options_.pp;
    const int     chunks = static_cast<int>(chunks_.size()), stages = pp * chunks;
    const int64_t h      = chunks_[0]->config().hidden_size;
    const DType   act    = chunks_[0]->config().activations_dtype();   // what the stages send each other
    Device &      device = chunks_[0]->device();
    auto          virtual_stage = [&](int chunk) { return chunk * pp + rank_; };

    struct InFlight {
        model::GptModel::Context ctx;
        double                   tokens = 1;
    };
    using DataKey = std::tuple<int, int, int>;   // kind, consumer virtual stage, micro-batch
    auto data_key = [](const Transfer & t) { return DataKey{static_cast<int>(t.kind), t.consumer, t.microbatch}; };
    std::map<std::pair<int, int>, InFlight>         in_flight;   // (chunk, micro-batch)
    std::map<int, model::MicroBatch>                batches;     // micro-batch -> its data, until chunk 0's backward
    std::vector<std::pair<comm::WorkPtr, Tensor>>   sends;       // kept alive until sent, and no longer
    std::map<DataKey, std::pair<comm::WorkPtr, Tensor>> posted;  // receives posted ahead of their op
    std::vector<std::pair<Tensor, Tensor>>          pending_losses;   // (token_loss, mask), read after the stream
    Stream &                                        stream = device.compute_stream();
    // Receives are posted in the plan's order, which is their channel's order on both sides.
    auto post = [&](const Transfer & t, int64_t numel) {
        Tensor buffer = Tensor::empty({numel}, act, device, {MemoryKind::device, "activations"});
        const Link & l = link(t.channel);
        posted[data_key(t)] = {l.comm->recv(buffer, l.peer, tag(t)), buffer};
    };
    // Waits for `t` (posting it first unless an earlier op did) and returns it as a rows x h tensor.
    auto receive = [&](const Transfer & t, int64_t rows) {
        if (!posted.count(data_key(t))) post(t, rows * h);
        auto it = posted.find(data_key(t));
        it->second.first->wait();
        Tensor buffer = it->second.second;
        posted.erase(it);
        LOOM_CHECK(buffer.numel() == rows * h, "pipeline " << transfer_label(t) << " was received early into "
                                                           << buffer.numel() << " elements, it needs " << rows * h,
                   "every micro-batch of an iteration must have the same shape");
        return buffer.view({rows, h});
    };
    auto send = [&](const Transfer & t, const Tensor & data) {
        // Posted once the stream has computed `data`; the stream goes on without waiting for it. The sends
        // that have completed give their tensors back: a stage's outputs would otherwise pile up for the
        // whole iteration, one per micro-batch (what `loom plan` showed: the first stage's peak grew with the
        // number of micro-batches).
        std::erase_if(sends, [](const std::pair<comm::WorkPtr, Tensor> & s) { return s.first->test(); });
        const Link & l = link(t.channel);
        sends.emplace_back(l.comm->send(data, l.peer, tag(t), &stream), data);
    };

    Result     result;
    const auto begin          = std::chrono::steady_clock::now();
    // On the meta device the ops' times are its modelled clock's (plan/meta_device.h), not the host's.
    result.modelled_begin_s = stream.modelled_seconds();
    auto ms_since_begin     = [&] {
        if (result.modelled_begin_s) return (*stream.modelled_seconds() - *result.modelled_begin_s) * 1e3;
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    };
    for (const OpTransfers & step : plan.ops) {
        const ScheduleOp & op = step.op;
        const int          mb = op.microbatch, c = op.chunk, v = virtual_stage(c);
        model::GptModel &  model = *chunks_[c];
        double             start = 0;   // when the computation begins: waiting for a transfer shows as a gap
        if (op.forward) {
            if (!batches.count(mb)) batches[mb] = next_batch();   // chunk 0 runs micro-batch m first
            const model::MicroBatch & batch = batches[mb];
            const int64_t rows = model.activation_rows(batch.tokens.size(1), batch.tokens.size(0));
            Tensor                    input;
            if (step.receive) {   // v > 0
                input = receive(*step.receive, rows);
                // The channel's next input arrives while this one computes; it has this micro-batch's shape.
                if (step.prefetch) {
                    const model::GptModel & next = *chunks_[step.prefetch->consumer / pp];
                    post(*step.prefetch, next.activation_rows(batch.tokens.size(1), batch.tokens.size(0)) * h);
                }
            }
            InFlight & slot = in_flight[{c, mb}];
            slot.ctx.training   = !forward_only;   // validation drops nothing out
            slot.ctx.chunk      = c;               // the layer graphs' (chunk, micro-batch, layer)
            slot.ctx.microbatch = mb;
            if (!forward_only) {
                slot.ctx.runs         = runs_[static_cast<size_t>(c)];
                slot.ctx.graphs       = graphs_;
                slot.ctx.loss_scale   = loss_scale_;     // the fused classifier's gradients, in the forward
                slot.ctx.microbatches = microbatches_;
            }
            start           = ms_since_begin();
            Tensor out      = model.forward_stage(slot.ctx, batch, input);
            if (v == stages - 1) {
                result.losses.push_back(slot.ctx.loss);
                pending_losses.emplace_back(host_copy_async(slot.ctx.token_loss), batch.loss_mask);   // read after the one wait
                if (!wait) result.token_losses.push_back(slot.ctx.token_loss);
                slot.tokens = std::max(slot.ctx.loss.count, 1.0);
            }
            if (step.send) send(*step.send, out);   // v < stages - 1
            result.peak_in_flight = std::max(result.peak_in_flight, static_cast<int>(in_flight.size()));
            if (forward_only) {   // nothing will run backward: release the activations now
                in_flight.erase({c, mb});
                if (c == chunks - 1) batches.erase(mb);
            }
        } else {
            auto it = in_flight.find({c, mb});
            LOOM_CHECK(it != in_flight.end(), "pipeline order runs the backward of chunk " << c << ", micro-batch "
                                                                                          << mb << " before its forward", "");
            if (set_last_microbatch) set_last_microbatch(mb == microbatches_ - 1);
            InFlight &    slot = it->second;
            const int64_t rows = model.activation_rows(slot.ctx.s, slot.ctx.b);
            Tensor        dy;
            if (step.receive) dy = receive(*step.receive, rows);   // v < stages - 1
            double scale = loss_scale_ / (slot.tokens * static_cast<double>(microbatches_));
            start        = ms_since_begin();
            Tensor dx    = model.backward_stage(slot.ctx, scale, dy, ready);
            if (step.send) send(*step.send, dx);   // v > 0
            in_flight.erase(it);
            if (c == 0) batches.erase(mb);
        }
        result.ops.push_back(TimelineOp{op, start, ms_since_begin()});
    }
    // The iteration's work is enqueued; wait for it, then read the losses it computed (or leave that to the
    // caller's read_losses).
    result.pending_losses = std::move(pending_losses);
    if (wait) {
        stream.synchronize();
        read_losses(result);
    }
    for (auto & [work, tensor] : sends) work->wait();
    LOOM_CHECK(in_flight.empty() && posted.empty(), "pipeline iteration ended with "
                                                        << in_flight.size() << " micro-batches in flight", "");
    return result;
}

Timeline PipelineExecutor::gather_timeline(const Result & mine, comm::Communicator & pp, const ScheduleOptions & options,
                                           Device & device) {
    // Each op as 5 floats: forward, chunk, microbatch, start, end; every stage has 2M ops.
    const int64_t per_rank = static_cast<int64_t>(mine.ops.size()) * 5;
    std::vector<float> local(static_cast<size_t>(per_rank));
    for (size_t i = 0; i < mine.ops.size(); ++i) {
        const TimelineOp & t = mine.ops[i];
        float *            v = local.data() + 5 * i;
        v[0] = t.op.forward ? 1.0f : 0.0f;
        v[1] = static_cast<float>(t.op.chunk);
        v[2] = static_cast<float>(t.op.microbatch);
        v[3] = static_cast<float>(t.start);
        v[4] = static_cast<float>(t.end);
    }
    const std::vector<float> all = comm::all_gather_values(pp, device, std::move(local));
    Timeline timeline;
    timeline.options                  = options;
    timeline.unit_time                = false;
    timeline.ranks.resize(static_cast<size_t>(pp.size()));
    for (int r = 0; r < pp.size(); ++r) {
        for (size_t i = 0; i < mine.ops.size(); ++i) {
            const float * v = all.data() + r * per_rank + 5 * static_cast<int64_t>(i);
            timeline.ranks[r].push_back(TimelineOp{ScheduleOp{v[0] != 0.0f, static_cast<int>(v[1]), static_cast<int>(v[2])},
                                                   v[3], v[4]});
        }
    }
    return timeline;
}

}  // namespace loom::pipeline
