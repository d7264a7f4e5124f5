// The training loop of one rank: micro-batches -> forward/backward -> finalize gradients -> optimizer
// step (norm, clip, AdamW) -> log. What it trains comes from train/setup.h.
//
// Per iteration (Megatron's semantics): the global batch is split into num_microbatches micro-batches;
// each micro-batch's loss is its masked mean, the iteration's "lm loss" is the mean over micro-batches,
// and gradients are those of that mean (each micro-batch's backward is scaled by
// 1 / (tokens in its mask x num_microbatches)). A non-finite gradient norm skips the update and counts
// as a nan iteration.
//
// Data parallel (a dp_group given): every rank runs num_microbatches() = global batch / (micro-batch x dp)
// micro-batches of its own samples; DDP (ddp/ddp.h) accumulates their gradients in its buffers and
// reduces them over the group, under Megatron's no_sync for all but the last micro-batch; the optimizer is
// AdamW on the replicated gradients, or the distributed optimizer on this rank's shard
// (--use-distributed-optimizer). The logged loss is the mean over the data-parallel ranks.
// --optimizer-cpu-offload steps part of the optimizer on the host (optim/hybrid_optimizer.h), for the
// whole parameters of AdamW or the shard pieces of the distributed optimizer.
//
// On one rank the step is decided on the device and the host reads an iteration's losses and norm after its
// step is enqueued; an iteration that does not log is read while the next one's forward and backward are
// already queued behind it (gated_ and deferrable_ below, docs/gpu.md's host work).
#pragma once

#include "comm/communicator.h"
#include "graphs/full_iteration_graph.h"
#include "graphs/layer_graph_runner.h"
#include "pipeline/executor.h"
#include "train/checkpointing.h"
#include "train/grad_sync.h"
#include "train/options.h"
#include "train/setup.h"
#include "train/reporting.h"
#include "optim/loss_scaler.h"
#include "train/rerun.h"

#include <cstdio>
#include <functional>
#include <chrono>
#include <memory>
#include <optional>

namespace loom::train {

// Where micro-batches come from (the data layer's loader, or a test's generator).
class BatchSource {
public:
    virtual ~BatchSource() = default;
    virtual model::MicroBatch next() = 0;
    virtual std::string       describe() const = 0;
    // What every rank reading the same data holds alike (data::TokenDataset::identity).
    virtual std::string       identity() const { return describe(); }
    // Resume (--load): the next micro-batch starts after `consumed` samples of all ranks. A source that
    // cannot seek refuses.
    virtual void              set_consumed_samples(int64_t consumed);
};

struct TrainSummary {
    std::vector<double> losses;   // lm loss of every iteration this run trained
    std::vector<std::pair<int64_t, double>> validation;   // (iteration, lm loss) of each evaluation
    std::optional<double>                   test;         // the test split's lm loss after training
    int64_t             first_iteration = 1;   // the iteration of losses[0] (after a --load, the one after it)
    std::string         stopped_by;            // "", or why the run ended early ("--exit-interval", "SIGTERM", ...)
    double              tokens_per_second = 0;
    double              tflops            = 0;
    double              seconds           = 0;
    std::vector<double> step_seconds;   // each iteration's step (forward, backward, optimizer), host wall time
    // The device's counted work (Device::work, where its backend counts) after the warm-up iterations (the
    // first two, and with layer graphs those up to the capture) and at the end, and the iterations between.
    std::optional<DeviceWork> work_warm, work_end;
    int64_t                   iterations_after_warmup = 0;
};

class Trainer {
public:
    // Trains what `setup` built (train/setup.h), which outlives the trainer.
    Trainer(const TrainOptions & options, Setup & setup, BatchSource & data);
    // One rank's single model (dp_group null: no DDP buffers, the reference every parallel run is checked
    // against; else DDP over dp_group): the trainer builds and owns the setup over it.
    Trainer(const TrainOptions & options, model::GptModel & model, BatchSource & data,
            std::shared_ptr<comm::Communicator> dp_group = nullptr);
    ~Trainer();

    // The DDP wrapper (null without a data-parallel group).
    ddp::DistributedDataParallel * ddp() { return setup_.ddp.get(); }
    optim::Optimizer &             optimizer() { return *setup_.optimizer; }
    // The most activation contexts the pipeline executor held at once (0 without pipelining).
    int peak_in_flight() const { return peak_in_flight_; }
    // On the meta device (plan/meta_device.h), the last iteration's schedule as the executor ran it: its ops'
    // modelled times, which loom plan reads. Empty on a real device (no copy per iteration there).
    const pipeline::PipelineExecutor::Result & last_schedule() const { return last_schedule_; }
    const pipeline::ScheduleOptions &          schedule() const { return executor_->options(); }
    // The layer graphs (--cuda-graph-impl transformer_engine) once captured; null before and without.
    const graphs::LayerGraphRunner * layer_graphs() const { return layer_graphs_.get(); }
    const graphs::FullIterationGraph * full_iteration_graph() const { return full_iteration_.get(); }

    // Runs the iterations after the loaded one (none: 0) up to options.train_iters, saving and stopping as
    // --save-interval, --exit-interval, --exit-duration-in-mins and --exit-signal-handler say; log lines go
    // to `out` (null: silent).
    TrainSummary run(FILE * out);
    // What the constructor loaded (--load), if anything.
    const Resumed & resumed() const { return resumed_; }
    int64_t         iteration() const { return iteration_; }
    int64_t         consumed_samples() const { return consumed_; }
    // One iteration; returns its lm loss.
    double step(IterationStats & stats);
    // Validation (--eval-interval, --eval-iters): `valid` yields this rank's share of the validation split's
    // batches; run() evaluates every --eval-interval iterations and after the last one.
    void   set_validation(BatchSource * valid) { valid_ = valid; }
    // The test split's batches: run() evaluates them once after training ("on test set", Megatron's do_test).
    void   set_test(BatchSource * test) { test_ = test; }
    // --eval-iters forward-only iterations on the validation batches (or `source`'s); the token-weighted
    // mean lm loss over every micro-batch of every data-parallel rank (the same on every rank).
    double evaluate() { return evaluate(*valid_); }
    double evaluate(BatchSource & source);

private:
    Trainer(const TrainOptions & options, std::unique_ptr<Setup> owned, Setup * setup, BatchSource & data);

    const TrainOptions &                        options_;
    std::unique_ptr<Setup>                      own_setup_;   // the single-model constructor's
    Setup &                                     setup_;
    model::GptModel &                           model_;   // the first chunk
    BatchSource &                               data_;
    std::vector<model::Parameter *>             params_;
    GradSync                                    sync_;   // every call into data parallelism
    comm::Communicator *                        stages_ = nullptr;   // the pipeline group, with more than one stage
    std::unique_ptr<pipeline::PipelineExecutor> executor_;   // every layout, one stage included
    std::unique_ptr<pipeline::PipelineExecutor> eval_executor_;   // --eval-global-batch-size's micro-batches
    // The global batch of the iteration in hand and its micro-batches per data-parallel rank (they change
    // with --step-batch-size-schedule and --rampup-batch-size: the executor is rebuilt for the new count).
    int64_t                                     global_batch_  = 0;
    int64_t                                     microbatches_  = 0;
    std::unique_ptr<pipeline::PipelineExecutor> make_executor(int64_t microbatches) const;
    // Sets the batch of the iteration that starts after consumed_ samples.
    void                                        follow_batch_schedule();
    std::unique_ptr<graphs::LayerGraphRunner>   layer_graphs_;   // --cuda-graph-impl transformer_engine, once captured
    // --cuda-graph-impl full_iteration: made after the warm-up, captured by the next run_schedule.
    std::unique_ptr<graphs::FullIterationGraph> full_iteration_;
    int64_t                                     start_iteration_ = 0;   // the iteration this run started after
    // The MoE router losses of the iteration just run into stats.tracked_losses (and, with
    // --moe-per-layer-logging, stats.moe_layer_losses), reduced over the pipeline (sum over layers), the
    // ranks holding the same sequences' other rows (sum of shares) and data-parallel ranks (mean).
    void moe_losses(IterationStats & stats);
    // --mtp-num-layers: each depth's loss of the iteration just run, appended to stats.tracked_losses as
    // "mtp_<k> loss": per micro-batch the masked mean cross-entropy over the whole sequences, averaged over
    // micro-batches and data-parallel ranks (Megatron's MTPLossLoggingHelper).
    void mtp_losses(IterationStats & stats);
    // --experimental-attention-variant dsa: the indexers' loss ("indexer loss"), over the stages, averaged over DP.
    void dsa_losses(IterationStats & stats);
    int                                         peak_in_flight_ = 0;
    pipeline::PipelineExecutor::Result          last_schedule_;
    // The learning-rate schedule and the samples it has stepped over (Megatron's OptimizerParamScheduler:
    // it steps only after a successful update).
    SchedulerState                              scheduler_;
    std::unique_ptr<RerunStateMachine>          rerun_;   // --rerun-mode (train/rerun.h)
    // Runs the iteration's forward and backward again on the same batch (the rerun state machine's call).
    void restart_iteration(int64_t consumed_before);
    // Saves iteration_ - 1 (the state before this iteration's step) with the rerun machine's state.
    void save_for_rerun(int64_t consumed_before);
    // --check-weight-hash-across-dp-replicas-interval: each data-parallel group (expert parameters: the
    // expert-data-parallel group) compares every parameter's digest; a difference stops every rank.
    void check_weight_hashes(int64_t iteration);
    // --async-save: the save in flight (at most one), committed once every rank's part is written: checked
    // after each iteration (a collective then), waited for at the next save and at the end of the run.
    std::unique_ptr<checkpoint::SaveInProgress> pending_save_;
    void finish_async_save(bool blocking);
    // --log-progress: the save line of train/progress_log.h (rank 0), from this job's start.
    void log_progress_of_save(int64_t iteration);
    std::chrono::steady_clock::time_point job_start_ = std::chrono::steady_clock::now();
    int64_t                               job_start_consumed_ = 0;
    // --profile: stops the profile after iteration `last` and writes this rank's trace.
    void write_profile(int rank, int64_t last);
    BatchSource *                               valid_ = nullptr;
    BatchSource *                               test_  = nullptr;
    // --timing-log-level: seconds spent in each timed part since the last log line.
    static constexpr const char *               kTimerNames[3] = {"forward-backward", "all-grads-sync", "optimizer"};
    double                                      timer_seconds_[3] = {0, 0, 0};
    // Megatron's timers block for the last `iterations` in --timing-log-option's form, "(min, max) time across
    // ranks (ms):" by default (collective).
    std::string                                 timers_block(int64_t iterations);

    // Where run() reports (train/reporting.h), while it runs.
    std::vector<std::unique_ptr<ReportSink>>    sinks_;
    // The first sink failure of this rank (an OutputError's text): the sink is dropped, the run stops.
    std::optional<OutputError>                  output_failure_;
    template <class Call> void to_sinks(Call && call);
    void report_message(const std::string & line);
    void report_evaluation(EvalSplit split, int64_t iteration, bool after_training, double loss);

    // step()'s phases.
    void   begin_iteration();
    pipeline::PipelineExecutor::Result run_schedule(IterationStats & stats, bool wait = true);
    // step()'s phases: the loss scale every backward starts from; the schedule, run again while the rerun
    // state machine asks (its checkpoint-and-exit decision taken after), returning the micro-batches' loss
    // sum; the optimizer step at the scheduler's lr, which advances only after a successful update.
    void              apply_loss_scale();
    double            run_with_reruns(IterationStats & stats, int64_t consumed_before);
    optim::StepResult optimizer_step(IterationStats & stats);
    // --log-num-zeros-in-grad and --log-params-norm after the step (the latter once the gathers are done).
    void              optimizer_stats(IterationStats & stats);
    // The sum of the micro-batches' mean losses; throws on a non-finite one (--check-for-nan-in-loss-and-grad).
    double checked_loss_sum(const pipeline::PipelineExecutor::Result & r, int64_t iteration) const;
    // Context parallelism: each rank's loss sums cover its positions; this sums them over the CP group, so
    // every CP rank holds its micro-batches' whole losses (the counts are the whole sequences' already).
    void sum_losses_over_context(pipeline::PipelineExecutor::Result & r) const;
    // The iteration's loss as every rank logs it: from the last stage, averaged over data-parallel ranks.
    double exchanged_loss(double loss) const;
    // Runs `work` and adds its seconds to timer `timer` (kTimerNames).
    void   timed(int timer, const std::function<void()> & work);
    int64_t                                     iteration_ = 0;
    int64_t                                     consumed_  = 0;
    int64_t                                     nan_iterations_ = 0;
    int64_t                                     skipped_iterations_ = 0;   // updates not made (overflows too)
    std::unique_ptr<optim::LossScaler>          scaler_;   // --fp16, or --bf16 with --loss-scale
    Resumed                                     resumed_;

    // Saves a checkpoint of the current iteration (--save) and reports Megatron's lines.
    void save();

    // ---- The step decided on the device (optim::Optimizer::step_gated, docs/gpu.md's host work)
    // gated_: one rank, no loss scaler, no rerun that repeats a finite result (report_stats, injected
    // errors), no MoE layer (its losses and token counts are read per iteration) and an optimizer whose norm
    // needs no group. The host then waits for an iteration once, after its step is enqueued.
    bool gated_ = false;
    // deferrable_: gated_, and nothing else read on the host per iteration (--log-num-zeros-in-grad,
    // --log-params-norm, --timing-log-level, a batch-size schedule): run() reads such an iteration's values
    // while the next one is enqueued behind it, unless the iteration logs, evaluates, saves, checks
    // weights, profiles or ends the run.
    bool deferrable_ = false;
    // An iteration enqueued on the gated path: its forward and backward, then its step.
    struct Enqueued {
        int64_t                            iteration = 0, consumed_before = 0, global_batch = 0;
        pipeline::PipelineExecutor::Result schedule;   // the losses' pinned copies, not yet read
        optim::GatedStep                   step;
        Event *                            done = nullptr;   // recorded after the step (events_)
    };
    std::unique_ptr<Event> events_[2];   // alternate iterations' `done`: one may be read while the next is enqueued
    Enqueued enqueue_forward_backward();
    void     enqueue_step(Enqueued & e);
    // Waits for `e` (a late read when the next iteration is enqueued behind it), reads its losses and step,
    // and brings the host's state (rerun machine, schedule, counts) to the device's decision; returns the
    // lm loss. A failed validation reruns `e`'s iteration in place (its step did not happen: the gate held
    // its losses), which ends the run as Megatron's machine decides.
    double   resolve(Enqueued & e, IterationStats & stats);
    // Whether the loss of `iteration` is validated (the rerun machine's NaN and Inf checks), so it joins the
    // device's decision.
    bool     validates_losses(int64_t iteration) const;
    // The rerun machine's checkpoint-and-exit decision for the iteration that started after consumed_before.
    void     rerun_decision(int64_t consumed_before);
    // After the optimizer's result: the schedule advances, or the skip is counted (or ends the run).
    void     account_step(const optim::StepResult & result, int64_t iteration, int64_t global_batch);
};

}  // namespace loom::train
