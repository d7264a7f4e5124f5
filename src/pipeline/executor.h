// PipelineExecutor: runs one training iteration of this rank's pipeline stage by walking its schedule
// order (pipeline/schedule.h) with real point-to-point transfers between neighbouring stages.
//
//   +1 (forward of micro-batch m):  receive the previous stage's output for m (first stage: embed the
//                                   tokens), run forward_stage, send the output to the next stage (last
//                                   stage: keep the loss)
//   -1 (backward of micro-batch m): receive the next stage's input gradient for m (last stage: start from
//                                   the loss), run backward_stage, send the input gradient back
//
// Sends are asynchronous and complete while later work runs; the receive of the next forward's input is
// posted as soon as the previous forward has started, so it overlaps the computation in between. Only
// the activation contexts of micro-batches whose backward has not run are kept: their number peaks at
// min(pp - rank, M) for 1F1B, which the executor measures. DDP's no_sync is lifted for the last
// micro-batch's backward, so gradient reduction starts (with --overlap-grad-reduce) during it.
//
// Tags: micro-batch m's activation travels with tag 2m, its gradient with 2m + 1, so a transfer can only
// ever match its own message.
#pragma once

#include "comm/communicator.h"
#include "model/gpt_model.h"
#include "pipeline/schedule.h"
#include "pipeline/timeline.h"

#include <functional>
#include <memory>

namespace loom::pipeline {

class PipelineExecutor {
public:
    // `pp_group` holds the stages in order (rank r runs stage r); `model` is this rank's stage.
    PipelineExecutor(model::GptModel & model, std::shared_ptr<comm::Communicator> pp_group, int num_microbatches);

    struct Result {
        double loss_sum_of_means = 0;   // last stage: sum over micro-batches of each one's mean loss
        int    peak_in_flight    = 0;   // activation contexts held at once
        std::vector<TimelineOp> ops;     // when each op computed: ms since run() began (a wait for its input
                                         // is not part of the op, so it shows as a gap)
    };

    // One iteration: next_batch() yields this rank's micro-batches in order; each micro-batch's loss is
    // scaled by 1 / (its tokens x M) as the single-rank trainer does; set_last_microbatch(true) runs
    // before the last backward (DDP's no_sync), false before the others.
    Result run(const std::function<model::MicroBatch()> & next_batch, const model::GradReadyFn & ready,
               const std::function<void(bool)> & set_last_microbatch);

    const std::vector<ScheduleOp> & ops() const { return ops_; }

    // Every stage's ops of one iteration, gathered over the pipeline group (collective), as a measured
    // Timeline for timeline_svg(). Times are ms since each stage's run() began; start the iteration right
    // after a barrier so the stages' clocks line up.
    static Timeline gather_timeline(const Result & mine, comm::Communicator & pp, int num_microbatches);

private:
    Tensor receive(int peer, int tag, int64_t numel);

    model::GptModel &                   model_;
    std::shared_ptr<comm::Communicator> pp_;
    int                                 microbatches_;
    std::vector<ScheduleOp>             ops_;
};

}  // namespace loom::pipeline
