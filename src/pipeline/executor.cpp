#include "pipeline/executor.h"

#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <map>

namespace loom::pipeline {

PipelineExecutor::PipelineExecutor(std::vector<model::GptModel *> chunks,
                                   std::shared_ptr<comm::Communicator> pp_group, int num_microbatches, int group_size)
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
    ops_ = schedule_ops(options_, rank_);
    for (int m = 0; m < num_microbatches; ++m) {
        for (int c = 0; c < static_cast<int>(chunks_.size()); ++c) forward_ops_.push_back(ScheduleOp{true, c, m});
    }
}

PipelineExecutor::Result PipelineExecutor::run(const std::function<model::MicroBatch()> & next_batch,
                                               const model::GradReadyFn &                 ready,
                                               const std::function<void(bool)> &          set_last_microbatch) {
    return execute(ops_, false, next_batch, ready, set_last_microbatch);
}

PipelineExecutor::Result PipelineExecutor::evaluate(const std::function<model::MicroBatch()> & next_batch) {
    return execute(forward_ops_, true, next_batch, nullptr, nullptr);
}

PipelineExecutor::Result PipelineExecutor::execute(const std::vector<ScheduleOp> & ops, bool forward_only,
                                                   const std::function<model::MicroBatch()> & next_batch,
                                                   const model::GradReadyFn &                 ready,
                                                   const std::function<void(bool)> &          set_last_microbatch) {
    const int     rank = rank_, pp = options_.pp;
    const int     chunks = static_cast<int>(chunks_.size()), stages = pp * chunks;
    const int64_t h      = chunks_[0]->config().hidden_size;
    Device &      device = chunks_[0]->device();
    auto          virtual_stage = [&](int chunk) { return chunk * pp + rank; };
    // The rank holding virtual stage v.
    auto          rank_of = [&](int v) { return v % pp; };

    struct InFlight {
        model::GptModel::Context ctx;
        double                   tokens = 1;
    };
    std::map<std::pair<int, int>, InFlight>         in_flight;   // (chunk, micro-batch)
    std::map<int, model::MicroBatch>                batches;     // micro-batch -> its data, until chunk 0's backward
    std::vector<std::pair<comm::WorkPtr, Tensor>>   sends;       // kept alive until sent
    std::map<std::pair<int, int>, std::pair<comm::WorkPtr, Tensor>> posted;   // forward inputs received ahead
    std::vector<std::pair<Tensor, Tensor>>          pending_losses;   // (token_loss, mask), read after the stream
    Stream &                                        stream = device.compute_stream();
    auto post_input = [&](int chunk, int mb, int64_t numel) {
        const int v = virtual_stage(chunk);
        if (v == 0 || mb >= microbatches_ || posted.count({chunk, mb})) return;
        Tensor t = Tensor::empty({numel}, DType::f32, device, {MemoryKind::device, "activations"});
        posted[{chunk, mb}] = {pp_->recv(t, rank_of(v - 1), tag(v, mb, false)), t};
    };

    Result     result;
    const auto begin          = std::chrono::steady_clock::now();
    auto       ms_since_begin = [&begin] {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    };
    for (const ScheduleOp & op : ops) {
        const int          mb = op.microbatch, c = op.chunk, v = virtual_stage(c);
        model::GptModel &  model = *chunks_[c];
        double             start = 0;   // when the computation begins: waiting for a transfer shows as a gap
        if (op.forward) {
            if (!batches.count(mb)) batches[mb] = next_batch();   // chunk 0 runs micro-batch m first
            const model::MicroBatch & batch = batches[mb];
            const int64_t rows = model.activation_rows(batch.tokens.size(1), batch.tokens.size(0));
            Tensor                    input;
            if (v > 0) {
                post_input(c, mb, rows * h);
                auto it = posted.find({c, mb});
                it->second.first->wait();
                input = it->second.second.view({rows, h});
                posted.erase(it);
                post_input(c, mb + 1, rows * h);   // the chunk's next input arrives while this one computes
            }
            InFlight & slot = in_flight[{c, mb}];
            slot.ctx.training = !forward_only;   // validation drops nothing out
            start           = ms_since_begin();
            Tensor out      = model.forward_stage(slot.ctx, batch, input);
            if (v == stages - 1) {
                result.losses.push_back(slot.ctx.loss);
                pending_losses.emplace_back(slot.ctx.token_loss, batch.loss_mask);
                slot.tokens = std::max(slot.ctx.loss.count, 1.0);
            } else {
                // Posted once the stream has computed `out`; the stream goes on without waiting for it.
                sends.emplace_back(pp_->send(out, rank_of(v + 1), tag(v + 1, mb, false), &stream), out);
            }
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
            if (v < stages - 1) {
                dy = Tensor::empty({rows * h}, DType::f32, device, {MemoryKind::device, "activations"});
                pp_->recv(dy, rank_of(v + 1), tag(v, mb, true))->wait();
                dy = dy.view({rows, h});
            }
            double scale = 1.0 / (slot.tokens * static_cast<double>(microbatches_));
            start        = ms_since_begin();
            Tensor dx    = model.backward_stage(slot.ctx, scale, dy, ready);
            if (v > 0) {
                sends.emplace_back(pp_->send(dx, rank_of(v - 1), tag(v - 1, mb, true), &stream), dx);
            }
            in_flight.erase(it);
            if (c == 0) batches.erase(mb);
        }
        result.ops.push_back(TimelineOp{op, start, ms_since_begin()});
    }
    // The iteration's work is enqueued; wait for it, then read the losses it computed.
    stream.synchronize();
    for (size_t k = 0; k < pending_losses.size(); ++k) {
        result.losses[k].sum = model::GptModel::masked_loss_sum(pending_losses[k].first, pending_losses[k].second);
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
