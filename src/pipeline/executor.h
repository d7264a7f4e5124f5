// PipelineExecutor: runs one training iteration of this rank's pipeline stage(s) by walking its schedule
// order (pipeline/schedule.h) with real point-to-point transfers between neighbouring stages.
//
// With V model chunks per rank (interleaved 1F1B, --num-virtual-stages-per-pipeline-rank V), chunk c of
// rank r is virtual stage v = c * pp + r: its input comes from virtual stage v - 1 (rank r - 1's chunk c,
// or the last rank's chunk c - 1 when r = 0) and its output goes to v + 1. Without virtual stages V = 1
// and this is plain 1F1B.
//
//   +c (forward of chunk c, micro-batch m):  receive virtual stage v - 1's output for m (v = 0: embed
//                                   the tokens), run forward_stage, send the output on (the last virtual
//                                   stage keeps the loss)
//   -c (backward of chunk c, micro-batch m): receive v + 1's input gradient for m (last virtual stage:
//                                   start from the loss), run backward_stage, send the input gradient back
//
// Every stage's work is enqueued on the device's compute stream: a send is posted when the stream reaches
// it (the stream does not wait for the receiver), a receive is waited for by the host before the work that
// reads it is enqueued, and run() waits for the stream at the end, where it reads the losses. Sends are
// asynchronous and complete while later work runs; a forward's input receive is posted when
// the previous forward of the same chunk starts, so it overlaps the computation in between. Only the
// activation contexts of (chunk, micro-batch) pairs whose backward has not run are kept; their number
// peaks at min(pp - rank, M) for 1F1B and min(2(pp - rank - 1) + (V - 1) N + 1, M V) interleaved, which
// the executor measures. DDP's no_sync is lifted for each chunk's last micro-batch backward.
//
// Tags: a transfer to virtual stage v for micro-batch m has tag 2 (v M + m) (activation) or that + 1
// (gradient), so every receive matches exactly its own message.
#pragma once

#include "comm/communicator.h"
#include "model/gpt_model.h"
#include "pipeline/schedule.h"
#include "pipeline/timeline.h"

#include <functional>
#include <memory>
#include <vector>

namespace loom::pipeline {

class PipelineExecutor {
public:
    // `pp_group` holds the ranks in stage order (null: one stage, the whole model on this rank, run as
    // forward/backward per micro-batch); `chunks` are this rank's model chunks (one without virtual
    // stages); `group_size` is N (--microbatch-group-size-per-virtual-pipeline-stage, 0: pp).
    PipelineExecutor(std::vector<model::GptModel *> chunks, std::shared_ptr<comm::Communicator> pp_group,
                     int num_microbatches, int group_size = 0);

    struct Result {
        std::vector<model::GptModel::LossSum> losses;   // last stage: each micro-batch's loss, in order
        int    peak_in_flight    = 0;   // activation contexts held at once
        std::vector<TimelineOp> ops;     // when each op computed: ms since run() began (a wait for its input
                                         // is not part of the op, so it shows as a gap)
    };

    // One iteration: next_batch() yields this rank's micro-batches in order (each is used by every chunk);
    // each micro-batch's loss is scaled by 1 / (its tokens x M) as the single-rank trainer does;
    // set_last_microbatch(true) runs before each chunk's last backward (DDP's no_sync), false before the
    // others.
    Result run(const std::function<model::MicroBatch()> & next_batch, const model::GradReadyFn & ready,
               const std::function<void(bool)> & set_last_microbatch);
    // Forward only (validation): every micro-batch through every chunk in order, each activation context
    // released when its forward ends; the losses as run() gives them, no gradients.
    Result evaluate(const std::function<model::MicroBatch()> & next_batch);

    const std::vector<ScheduleOp> & ops() const { return ops_; }
    const ScheduleOptions &         options() const { return options_; }

    // Every stage's ops of one iteration, gathered over the pipeline group (collective), as a measured
    // Timeline for timeline_svg(). Times are ms since each stage's run() began; start the iteration right
    // after a barrier so the stages' clocks line up.
    static Timeline gather_timeline(const Result & mine, comm::Communicator & pp, const ScheduleOptions & options,
                                    Device & device);

private:
    int tag(int virtual_stage, int microbatch, bool gradient) const {
        return 2 * (virtual_stage * microbatches_ + microbatch) + (gradient ? 1 : 0);
    }

    std::vector<model::GptModel *>      chunks_;
    std::shared_ptr<comm::Communicator> pp_;
    int                                 rank_ = 0;
    int                                 microbatches_;
    ScheduleOptions                     options_;
    std::vector<ScheduleOp>             ops_;
    std::vector<ScheduleOp>             forward_ops_;   // evaluate(): (chunk 0, m), (chunk 1, m), ... for each m

    Result execute(const std::vector<ScheduleOp> & ops, bool forward_only,
                   const std::function<model::MicroBatch()> & next_batch, const model::GradReadyFn & ready,
                   const std::function<void(bool)> & set_last_microbatch);
};

}  // namespace loom::pipeline
