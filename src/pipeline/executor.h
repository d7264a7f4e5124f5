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
// Channels. Every transfer travels on its own directed channel (source rank, destination rank, activation or
// gradient), a two-rank communicator of its own (ProcessGroups::pp_channels), never on the pipeline group: NCCL
// matches sends and receives by their order on a communicator and runs a communicator's operations one after
// another, so on one shared communicator an operation waiting for its peer holds up everything queued behind
// it, which the peer may need first, and interleaved schedules deadlock. The plan (pipeline/p2p_plan.h) gives
// each op's receive, early receive and send with their channels; on each channel both sides issue them in the
// same order, and a simulation of NCCL's semantics over every configuration checks that no rank can hang.
//
// Every stage's work is enqueued on the device's compute stream: a send is posted when the stream reaches
// it (the stream does not wait for the receiver), a receive is waited for by the host before the work that
// reads it is enqueued, and run() waits for the stream at the end, where it reads the losses. Sends are
// asynchronous and complete while later work runs; once a forward's input has arrived, the next receive of
// the same channel is posted (the chunk's next micro-batch without virtual stages), so it overlaps the
// computation in between. Only the activation contexts of (chunk, micro-batch) pairs whose backward has not
// run are kept; their number peaks at min(pp - rank, M) for 1F1B and min(2(pp - rank - 1) + (V - 1) N + 1, M V)
// interleaved, which the executor measures. DDP's no_sync is lifted for each chunk's last micro-batch backward.
//
// Tags: a transfer to virtual stage v for micro-batch m has tag 2 (v M + m) (activation) or that + 1
// (gradient). MPI matches by them, so every receive matches exactly its own message; NCCL ignores them and
// relies on the channels' order.
#pragma once

#include "comm/communicator.h"
#include "model/gpt_model.h"
#include "parallel/process_groups.h"
#include "pipeline/p2p_plan.h"
#include "pipeline/schedule.h"
#include "pipeline/timeline.h"

#include <functional>
#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace loom::pipeline {

class PipelineExecutor {
public:
    // `pp_group` holds the ranks in stage order (null: one stage, the whole model on this rank, run as
    // forward/backward per micro-batch); `channels` are its point-to-point channels (ProcessGroups::pp_channels;
    // every channel the schedule uses must be there when `pp_group` has more than one rank); `chunks` are this
    // rank's model chunks (one without virtual stages); `group_size` is N
    // (--microbatch-group-size-per-virtual-pipeline-stage, 0: pp). With more than one stage the constructor is
    // collective over the pipeline group: it exchanges one element on each channel (see connect_channels()).
    PipelineExecutor(std::vector<model::GptModel *> chunks, std::shared_ptr<comm::Communicator> pp_group,
                     parallel::PipelineChannels channels, int num_microbatches, int group_size = 0);

    struct Result {
        std::vector<model::GptModel::LossSum> losses;   // last stage: each micro-batch's loss, in order
        int    peak_in_flight    = 0;   // activation contexts held at once
        std::vector<TimelineOp> ops;     // when each op computed: ms since run() began (a wait for its input
                                         // is not part of the op, so it shows as a gap)
        std::optional<double> modelled_begin_s;   // on the meta device: its modelled clock when run() began
                                                  // (the ops' times are then that clock's, since then)
        // run() without waiting: each micro-batch's per-token losses (f32, on the device) and, per loss,
        // (their pinned copy, the mask); the sums in `losses` are filled by read_losses().
        std::vector<Tensor>                    token_losses;
        std::vector<std::pair<Tensor, Tensor>> pending_losses;
    };

    // One iteration: next_batch() yields this rank's micro-batches in order (each is used by every chunk);
    // each micro-batch's loss is scaled by 1 / (its tokens x M) as the single-rank trainer does;
    // set_last_microbatch(true) runs before each chunk's last backward (DDP's no_sync), false before the
    // others.
    // wait = false returns once the iteration is enqueued, its loss sums left to read_losses().
    Result run(const std::function<model::MicroBatch()> & next_batch, const model::GradReadyFn & ready,
               const std::function<void(bool)> & set_last_microbatch, bool wait = true);
    // Fills the loss sums of a run() that did not wait, once the compute stream has passed it.
    static void read_losses(Result & result);
    // Forward only (validation): every micro-batch through every chunk in order, each activation context
    // released when its forward ends; the losses as run() gives them, no gradients.
    Result evaluate(const std::function<model::MicroBatch()> & next_batch);
    // The loss scale run()'s backward passes start from (optim/loss_scaler.h; 1 without one): each
    // micro-batch's loss gradient is multiplied by it.
    void   set_loss_scale(double scale) { loss_scale_ = scale; }
    // The strategy run() gives each chunk's layers (model::LayerRun): with `graphs` (captured for this
    // schedule; null: none) every layer outside a full-recompute group replays its graph, else runs eagerly.
    // Evaluation always runs eagerly.
    void   set_layer_graphs(model::LayerGraphs * graphs);

    const std::vector<ScheduleOp> & ops() const { return ops_; }
    const P2PPlan &                 plan() const { return plan_; }
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
    int tag(const Transfer & t) const { return tag(t.consumer, t.microbatch, t.kind == TransferKind::gradient); }

    // A channel as this rank reaches it: its communicator and the other rank's place in it.
    struct Link {
        std::shared_ptr<comm::Communicator> comm;
        int                                 peer = 0;
    };
    const Link & link(const Channel & channel) const;
    // NCCL connects a pair of ranks on its first transfer, a handshake that blocks the host until the peer
    // takes part; one element on every channel this rank uses, in pipeline_channels() order (the same total
    // order on every rank, so each handshake finds its peer), does that before any schedule runs.
    void connect_channels();

    std::vector<model::GptModel *>      chunks_;
    std::shared_ptr<comm::Communicator> pp_;
    std::map<Channel, Link>             links_;   // every channel either plan uses
    int                                 rank_ = 0;
    int                                 microbatches_;
    double                              loss_scale_ = 1.0;
    model::LayerGraphs *                graphs_     = nullptr;
    std::vector<std::vector<model::LayerRun>> runs_;   // [chunk] each layer's strategy in run()
    ScheduleOptions                     options_;
    std::vector<ScheduleOp>             ops_;
    P2PPlan                             plan_;        // run(): the schedule's ops
    P2PPlan                             eval_plan_;   // evaluate(): (chunk 0, m), (chunk 1, m), ... for each m

    Result execute(const P2PPlan & plan, bool forward_only, const std::function<model::MicroBatch()> & next_batch,
                   const model::GradReadyFn & ready, const std::function<void(bool)> & set_last_microbatch,
                   bool wait = true);
};

}  // namespace loom::pipeline
