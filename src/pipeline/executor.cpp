#include "pipeline/executor.h"

#include "backend/cpu/cpu_device.h"
#include "core/error.h"

#include <algorithm>
#include <chrono>
#include <map>

namespace loom::pipeline {

PipelineExecutor::PipelineExecutor(model::GptModel & model, std::shared_ptr<comm::Communicator> pp_group,
                                   int num_microbatches)
    : model_(model), pp_(std::move(pp_group)), microbatches_(num_microbatches) {
    ScheduleOptions options;
    options.pp               = pp_->size();
    options.num_microbatches = num_microbatches;
    validate_schedule(options);
    ops_ = schedule_ops(options, pp_->rank());
}

Tensor PipelineExecutor::receive(int peer, int tag, int64_t numel) {
    Tensor t = Tensor::empty({numel}, DType::f32, model_.device(), {MemoryKind::device, "activations"});
    pp_->recv(t, peer, tag)->wait();
    return t;
}

PipelineExecutor::Result PipelineExecutor::run(const std::function<model::MicroBatch()> & next_batch,
                                               const model::GradReadyFn &                 ready,
                                               const std::function<void(bool)> &          set_last_microbatch) {
    const int     rank = pp_->rank(), size = pp_->size();
    const bool    first = rank == 0, last = rank == size - 1;
    const int64_t h     = model_.config().hidden_size;

    struct InFlight {
        model::GptModel::Context ctx;
        double                   tokens = 1;
    };
    std::map<int, InFlight>                        in_flight;
    std::vector<std::pair<comm::WorkPtr, Tensor>>  sends;             // kept alive until sent
    std::map<int, std::pair<comm::WorkPtr, Tensor>> posted_inputs;    // forward inputs received ahead
    auto post_input = [&](int mb, int64_t numel) {
        if (first || mb >= microbatches_ || posted_inputs.count(mb)) return;
        Tensor t = Tensor::empty({numel}, DType::f32, model_.device(), {MemoryKind::device, "activations"});
        posted_inputs[mb] = {pp_->recv(t, rank - 1, 2 * mb), t};
    };

    Result result;
    int    backwards = 0;
    const auto begin = std::chrono::steady_clock::now();
    auto ms_since_begin = [&begin] {
        return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - begin).count();
    };
    for (const ScheduleOp & op : ops_) {
        const int mb    = op.microbatch;
        double    start = 0;   // when the computation begins: waiting for a transfer shows as a gap
        if (op.forward) {
            model::MicroBatch batch = next_batch();
            const int64_t     numel = batch.tokens.numel() * h;   // (s * b, h)
            Tensor            input;
            if (!first) {
                post_input(mb, numel);
                auto it = posted_inputs.find(mb);
                it->second.first->wait();
                input = it->second.second.view({batch.tokens.numel(), h});
                posted_inputs.erase(it);
                post_input(mb + 1, numel);   // the next forward's input arrives while this one computes
            }
            InFlight & slot = in_flight[mb];
            start           = ms_since_begin();
            Tensor     out  = model_.forward_stage(slot.ctx, batch, input);
            if (last) {
                result.loss_sum_of_means += slot.ctx.loss.mean();
                slot.tokens = std::max(slot.ctx.loss.count, 1.0);
            } else {
                sends.emplace_back(pp_->send(out, rank + 1, 2 * mb), out);
            }
            result.peak_in_flight = std::max(result.peak_in_flight, static_cast<int>(in_flight.size()));
        } else {
            auto it = in_flight.find(mb);
            LOOM_CHECK(it != in_flight.end(), "pipeline order runs the backward of micro-batch " << mb
                                                                                             << " before its forward", "");
            if (set_last_microbatch) set_last_microbatch(backwards == microbatches_ - 1);
            InFlight & slot = it->second;
            Tensor     dy;
            if (!last) {
                dy = receive(rank + 1, 2 * mb + 1, slot.ctx.s * slot.ctx.b * h).view({slot.ctx.s * slot.ctx.b, h});
            }
            double scale = 1.0 / (slot.tokens * static_cast<double>(microbatches_));
            start        = ms_since_begin();
            Tensor dx    = model_.backward_stage(slot.ctx, scale, dy, ready);
            if (!first) {
                sends.emplace_back(pp_->send(dx, rank - 1, 2 * mb + 1), dx);
            }
            in_flight.erase(it);
            ++backwards;
        }
        result.ops.push_back(TimelineOp{op, start, ms_since_begin()});
    }
    for (auto & [work, tensor] : sends) work->wait();
    LOOM_CHECK(in_flight.empty() && posted_inputs.empty(), "pipeline iteration ended with "
                                                               << in_flight.size() << " micro-batches in flight", "");
    return result;
}

Timeline PipelineExecutor::gather_timeline(const Result & mine, comm::Communicator & pp, int num_microbatches) {
    // Each op as 5 floats: forward, chunk, microbatch, start, end; every stage has 2M ops.
    const int64_t per_rank = static_cast<int64_t>(mine.ops.size()) * 5;
    Device &      device   = cpu::device();
    Tensor        local    = Tensor::empty({per_rank}, DType::f32, device);
    Tensor        all      = Tensor::empty({per_rank * pp.size()}, DType::f32, device);
    for (size_t i = 0; i < mine.ops.size(); ++i) {
        const TimelineOp & t = mine.ops[i];
        float *            v = local.data<float>() + 5 * i;
        v[0] = t.op.forward ? 1.0f : 0.0f;
        v[1] = static_cast<float>(t.op.chunk);
        v[2] = static_cast<float>(t.op.microbatch);
        v[3] = static_cast<float>(t.start);
        v[4] = static_cast<float>(t.end);
    }
    pp.all_gather(local, all)->wait();
    Timeline timeline;
    timeline.options.pp               = pp.size();
    timeline.options.num_microbatches = num_microbatches;
    timeline.unit_time                = false;
    timeline.ranks.resize(static_cast<size_t>(pp.size()));
    for (int r = 0; r < pp.size(); ++r) {
        for (size_t i = 0; i < mine.ops.size(); ++i) {
            const float * v = all.data<float>() + r * per_rank + 5 * static_cast<int64_t>(i);
            timeline.ranks[r].push_back(TimelineOp{ScheduleOp{v[0] != 0.0f, static_cast<int>(v[1]), static_cast<int>(v[2])},
                                                   v[3], v[4]});
        }
    }
    return timeline;
}

}  // namespace loom::pipeline
