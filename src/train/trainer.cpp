#include "train/trainer.h"

#include "comm/agreement.h"
#include "core/device.h"
#include "core/atomic_file.h"
#include "core/fault_injection.h"
#include "core/profiler.h"
#include "model/moe/router.h"
#include "train/progress_log.h"
#include "train/stop_policy.h"

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <sstream>
#include <cmath>
#include <cstdio>
#include <unistd.h>

namespace loom::train {

namespace {

std::unique_ptr<Setup> single_model_setup(const TrainOptions & options, model::GptModel & model,
                                          std::shared_ptr<comm::Communicator> dp_group) {
    parallel::ProcessGroups groups;
    groups.dp = std::move(dp_group);
    return std::make_unique<Setup>(setup(options, {&model}, groups));
}

}  // namespace

Trainer::Trainer(const TrainOptions & options, model::GptModel & model, BatchSource & data,
                 std::shared_ptr<comm::Communicator> dp_group)
    : Trainer(options, single_model_setup(options, model, std::move(dp_group)), nullptr, data) {}

Trainer::Trainer(const TrainOptions & options, Setup & setup, BatchSource & data)
    : Trainer(options, nullptr, &setup, data) {}

Trainer::Trainer(const TrainOptions & options, std::unique_ptr<Setup> owned, Setup * setup, BatchSource & data)
    : options_(options), own_setup_(std::move(owned)), setup_(setup ? *setup : *own_setup_),
      model_(*setup_.chunks.at(0)), data_(data), params_(setup_.parameters()),
      sync_(setup_.ddp.get(), setup_.chunks, params_,
            ddp::FinalizeGroups{setup_.groups.embedding.get(), setup_.groups.tp.get()}, model_.device()) {
    if (setup_.groups.pp && setup_.groups.pp->size() > 1) stages_ = setup_.groups.pp.get();
    // One executor for every layout: without a pipeline group it runs forward/backward per micro-batch.
    // Its transfers go over the pipeline's channel communicators, built next to the pipeline group.
    scheduler_.schedule    = options.lr_schedule();
    {
        comm::Communicator * everyone = setup_.all_ranks();
        const char *         node     = std::getenv("LOOM_RERUN_NODE");   // a test seam: "another node"
        char                 host[256] = {};
        if (node == nullptr) node = ::gethostname(host, sizeof(host) - 1) == 0 ? host : "unknown";
        Device & device = model_.device();
        RerunStateMachine::ReduceAny any = [everyone, &device](std::vector<bool> flags) {
            if (!everyone || everyone->size() == 1) return flags;
            std::vector<float> values(flags.begin(), flags.end());
            values = comm::all_reduce_values(*everyone, device, values, comm::ReduceOp::max);
            for (size_t i = 0; i < flags.size(); ++i) flags[i] = values[i] > 0.0f;
            return flags;
        };
        rerun_ = std::make_unique<RerunStateMachine>(
            RerunOptions{rerun_mode_from_name(options.rerun_mode), options.error_injection_rate,
                         rerun_diagnostic_from_name(options.error_injection_type)},
            everyone ? everyone->rank() : 0, node, device.index(), options.model.seed, std::move(any));
    }
    resumed_               = load_checkpoint(options_, setup_);
    if (!resumed_.rerun.is_null()) {   // each rank's own part (its failed validation, where it ran)
        comm::Communicator * everyone = setup_.all_ranks();
        const int            world    = everyone ? everyone->size() : 1;
        const nlohmann::json & saved  = resumed_.rerun;
        LOOM_CHECK(saved.is_object() && saved.value("world_size", 0) == world && saved.contains("ranks") &&
                       saved["ranks"].is_array() && static_cast<int>(saved["ranks"].size()) == world,
                   "the rerun state of '" << resumed_.folder << "' was saved by "
                                          << (saved.is_object() ? saved.value("world_size", 0) : 0) << " ranks, this job has "
                                          << world,
                   "rerun the iteration with the layout that saved it (the same ranks), or --rerun-mode disabled to "
                   "ignore the state");
        rerun_->load_state_dict(saved["ranks"][static_cast<size_t>(everyone ? everyone->rank() : 0)]);
    }
    if (!resumed_.folder.empty()) {
        iteration_ = resumed_.iteration;
        consumed_  = resumed_.consumed_samples;
        if (consumed_ > 0) data_.set_consumed_samples(consumed_);
        if (resumed_.scheduler) {
            scheduler_ = *resumed_.scheduler;
        } else if (!options_.finetune && !options_.no_load_optim) {   // a checkpoint saved without the schedule
            scheduler_.num_steps = static_cast<double>(consumed_);
        }
    }
    if (const std::optional<optim::LossScalerOptions> scaling = options_.loss_scaler()) {
        scaler_ = std::make_unique<optim::LossScaler>(*scaling);
        LOOM_CHECK(!options_.layer_graphs || !options_.model.moe.enabled() || !scaler_->dynamic(),
                   "a dynamic loss scale with MoE layers in layer graphs: the auxiliary loss's gradient is captured "
                   "with the scale of the capture",
                   "give a constant --loss-scale, or train without --cuda-graph-impl");
        // The scaler's state comes back with the optimizer's (Megatron's grad_scaler), not after --finetune.
        if (resumed_.grad_scaler && !options_.finetune && !options_.no_load_optim) scaler_->load(*resumed_.grad_scaler);
    }
    start_iteration_ = iteration_;
    // Every batch the schedule still reaches must split into whole micro-batches on each data-parallel rank
    // (Megatron checks each as training reaches it; here before the first collective).
    const int64_t per_step = options_.micro_batch_size * options_.parallel.dp();
    for (size_t i = 0; i < options_.batch_schedule.size(); ++i) {
        const auto & [first, size] = options_.batch_schedule[i];
        if (i + 1 < options_.batch_schedule.size() && options_.batch_schedule[i + 1].first <= consumed_) continue;
        LOOM_CHECK(size % per_step == 0,
                   "the batch-size schedule's global batch " << size << " (from sample " << first
                       << ") is not divisible by micro_batch_size (" << options_.micro_batch_size
                       << ") * data_parallel_size (" << options_.parallel.dp() << ")",
                   (options_.rampup_batch_size.empty() ? "--step-batch-size-schedule" : "--rampup-batch-size")
                       << ": give batches that are multiples of " << per_step);
    }
    LOOM_CHECK(options_.batch_schedule.empty() || (!options_.layer_graphs && !options_.full_iteration_graph),
               "--step-batch-size-schedule and --rampup-batch-size change the number of micro-batches, which the layer "
               "graphs of --cuda-graph-impl are captured for",
               "train with a constant --global-batch-size, or without --cuda-graph-impl");
    follow_batch_schedule();
    if (!options_.batch_schedule.empty() || options_.eval_num_microbatches() != microbatches_) {
        eval_executor_ = make_executor(options_.eval_num_microbatches());
    }
    comm::Communicator * everyone = setup_.all_ranks();
    const RerunMode      rerun    = rerun_->mode();
    gated_ = (!everyone || everyone->size() == 1) && (!setup_.groups.dp || setup_.groups.dp->size() == 1) && !scaler_ &&
             rerun != RerunMode::report_stats && options_.error_injection_rate == 0 && !options_.model.moe.enabled() &&
             options_.model.mtp_num_layers == 0 && !options_.model.dsa && setup_.optimizer->gated_step_supported() &&
             !options_.full_iteration_graph;
    deferrable_ = gated_ && !options_.log_num_zeros_in_grad && !options_.log_params_norm &&
                  options_.timing_log_level == 0 && options_.batch_schedule.empty();
    if (gated_) {
        for (std::unique_ptr<Event> & event : events_) event = model_.device().event_create();
    }
}

std::unique_ptr<pipeline::PipelineExecutor> Trainer::make_executor(int64_t microbatches) const {
    // One executor for every layout: without a pipeline group it runs forward/backward per micro-batch.
    // Its transfers go over the pipeline's channel communicators, built next to the pipeline group.
    return std::make_unique<pipeline::PipelineExecutor>(
        setup_.chunks, stages_ ? setup_.groups.pp : nullptr, stages_ ? setup_.groups.pp_channels : parallel::PipelineChannels{},
        static_cast<int>(microbatches), static_cast<int>(options_.microbatch_group_size));
}

void Trainer::follow_batch_schedule() {
    const int64_t batch = options_.global_batch_size_at(consumed_);
    if (batch == global_batch_) return;
    global_batch_ = batch;
    microbatches_ = batch / (options_.micro_batch_size * options_.parallel.dp());
    executor_     = make_executor(microbatches_);
    executor_->set_layer_graphs(layer_graphs_.get());
    for (model::GptModel * chunk : setup_.chunks) {
        chunk->set_aux_loss_scale(1.0f / static_cast<float>(microbatches_));
    }
}

void Trainer::moe_losses(IterationStats & stats) {
    stats.tracked_losses.clear();
    stats.moe_layer_losses.clear();
    const model::MoeConfig & moe = options_.model.moe;
    if (!moe.enabled()) return;
    Device &      device = model_.device();
    // Megatron's tracker counts the MTP depths' layers as layers after the decoder's.
    const int64_t L      = options_.model.num_layers + options_.model.mtp_num_layers;
    // The four sums over layers, then with per-layer logging each layer's four: reduced together.
    std::vector<std::array<double, 4>> layer_values(static_cast<size_t>(L));
    std::vector<float>                 sums(4, 0.0f);
    for (model::GptModel * chunk : setup_.chunks) {
        const std::array<double, 4> mine = chunk->take_moe_losses(options_.moe_per_layer_logging ? &layer_values : nullptr);
        for (size_t i = 0; i < mine.size(); ++i) sums[i] += static_cast<float>(mine[i]);
    }
    if (options_.moe_per_layer_logging) {
        for (const std::array<double, 4> & v : layer_values) {
            for (double x : v) sums.push_back(static_cast<float>(x));
        }
    }
    if (stages_) sums = comm::all_reduce_values(*stages_, device, sums, comm::ReduceOp::sum);   // every stage's layers
    // Each rank's share of its sequences' losses: summed over the ranks holding the other rows (TP with
    // sequence parallelism, and CP).
    const bool sp = setup_.groups.tp && setup_.groups.tp->size() > 1 && options_.sequence_parallel;
    const bool cp = setup_.groups.cp && setup_.groups.cp->size() > 1;
    if (comm::Communicator * rows = cp ? (sp ? setup_.groups.tp_cp.get() : setup_.groups.cp.get())
                                       : (sp ? setup_.groups.tp.get() : nullptr)) {
        sums = comm::all_reduce_values(*rows, device, sums, comm::ReduceOp::sum);
    }
    if (const comm::Communicator * dp = setup_.groups.dp.get(); dp && dp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.dp, device, sums, comm::ReduceOp::avg);
        // global_aux_loss is one loss of the whole batch, each rank's rows a share: Megatron sums it over
        // the TP x DP x CP ranks instead of averaging over DP.
        if (moe.load_balancing == model::MoeLoadBalancing::global_aux_loss) {
            for (size_t i = 0; i < sums.size(); ++i) {
                if (i % 4 < 2) sums[i] *= static_cast<float>(dp->size());   // aux and aux / coeff, of each set of four
            }
        }
    }
    int64_t layers = 0;
    for (int64_t i = 0; i < L; ++i) layers += options_.model.is_moe_layer(i) ? 1 : 0;
    const double per_microbatch       = 1.0 / static_cast<double>(microbatches_);
    const double per_layer_microbatch = per_microbatch / static_cast<double>(layers);
    // Megatron's tracked names; per layer "moe/<name>_layer_<i>" for every layer (Megatron's tracker holds
    // one value per layer of the model), each scaled by 1 / micro-batches as its tracker's report does.
    auto add = [&](const std::string & name, size_t index) {
        stats.tracked_losses.emplace_back(name, sums[index] * per_layer_microbatch);
        if (!options_.moe_per_layer_logging) return;
        for (int64_t i = 0; i < L; ++i) {
            stats.moe_layer_losses.emplace_back("moe/" + name + "_layer_" + std::to_string(i),
                                                sums[4 + 4 * static_cast<size_t>(i) + index] * per_microbatch);
        }
    };
    if (moe.load_balancing != model::MoeLoadBalancing::none && moe.load_balancing != model::MoeLoadBalancing::sinkhorn) {
        add(moe.load_balancing == model::MoeLoadBalancing::seq_aux_loss      ? "seq_load_balancing_loss"
            : moe.load_balancing == model::MoeLoadBalancing::global_aux_loss ? "global_load_balancing_loss"
                                                                             : "load_balancing_loss",
            model::router_loss_aux_logged);
    }
    if (moe.z_loss_coeff > 0.0f) add("z_loss", model::router_loss_z_logged);
}

void Trainer::mtp_losses(IterationStats & stats) {
    const int64_t depths = options_.model.mtp_num_layers;
    if (depths == 0) return;
    std::vector<float> sums(static_cast<size_t>(depths), 0.0f);
    for (model::GptModel * chunk : setup_.chunks) {
        const std::vector<double> mine = chunk->take_mtp_losses();
        for (size_t k = 0; k < mine.size(); ++k) sums[k] += static_cast<float>(mine[k]);
    }
    Device & device = model_.device();
    if (stages_) sums = comm::all_reduce_values(*stages_, device, sums, comm::ReduceOp::sum);   // the last stage's
    // Each CP rank's sums are its share of the whole sequences' (over their token counts); every TP rank has
    // every row's loss (the vocabulary-parallel cross-entropy), so TP adds nothing.
    if (setup_.groups.cp && setup_.groups.cp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.cp, device, sums, comm::ReduceOp::sum);
    }
    if (const comm::Communicator * dp = setup_.groups.dp.get(); dp && dp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.dp, device, sums, comm::ReduceOp::avg);
    }
    for (int64_t k = 0; k < depths; ++k) {
        stats.tracked_losses.emplace_back("mtp_" + std::to_string(k + 1) + " loss",
                                          sums[static_cast<size_t>(k)] / static_cast<double>(microbatches_));
    }
}

void Trainer::dsa_losses(IterationStats & stats) {
    if (!options_.model.dsa || options_.model.dsa_indexer_loss_coeff <= 0.0f) return;
    std::vector<float> sums{0.0f};
    for (model::GptModel * chunk : setup_.chunks) sums[0] += static_cast<float>(chunk->take_dsa_losses());
    Device & device = model_.device();
    // Every stage's layers; every TP rank holds the whole loss (the indexer sees every row), so TP adds nothing; each
    // CP rank's is its share of the whole sequences'.
    if (stages_) sums = comm::all_reduce_values(*stages_, device, sums, comm::ReduceOp::sum);
    if (setup_.groups.cp && setup_.groups.cp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.cp, device, sums, comm::ReduceOp::sum);
    }
    if (const comm::Communicator * dp = setup_.groups.dp.get(); dp && dp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.dp, device, sums, comm::ReduceOp::avg);
    }
    // Megatron's DSAIndexerLossLoggingHelper: the layers' sum over the micro-batches, averaged over both.
    stats.tracked_losses.emplace_back("indexer loss", sums[0] / static_cast<double>(microbatches_) /
                                                          static_cast<double>(options_.model.num_layers));
}

void BatchSource::set_consumed_samples(int64_t consumed) {
    LOOM_THROW("the data source " << describe() << " cannot resume after " << consumed << " samples",
               "resume with a data source that can seek (--data-path, --llmc-shard, --text-file or synthetic data)");
}

Trainer::~Trainer() {
    // Whoever reads the model next sees it whole (a lazy parameter all-gather finished) and stepped.
    try {
        sync_.whole();
        model_.device().compute_stream().synchronize();
    } catch (...) {
    }
}

// One iteration, phase by phase: begin (fault seam, zeroed gradients, the layer graphs' capture once the
// warm-up is over), the pipeline schedule's forward and backward passes, the gradients' final reduction, the
// optimizer step, and the loss every rank logs.
double Trainer::step(IterationStats & stats) {
    if (gated_) {
        Enqueued e = enqueue_forward_backward();
        enqueue_step(e);
        return resolve(e, stats);
    }
    follow_batch_schedule();
    apply_loss_scale();
    begin_iteration();
    const int64_t before   = consumed_;
    const double  loss_sum = run_with_reruns(stats, before);
    consumed_ += global_batch_;
    timed(1, [&] { sync_.finish(); });
    const optim::StepResult result = optimizer_step(stats);
    if (result.stepped) sync_.start_gather();
    optimizer_stats(stats);
    stats.iteration         = iteration_;
    stats.consumed_samples  = consumed_;
    stats.learning_rate     = scheduler_.schedule.lr_at_step(scheduler_.num_steps);
    stats.global_batch_size = global_batch_;
    stats.grad_norm         = result.grad_norm;
    if (scaler_) {
        scaler_->update(!result.stepped);   // Megatron's order: after the unscaled gradients were checked
        stats.loss_scale = scaler_->scale();
    }
    const double loss = exchanged_loss(loss_sum / static_cast<double>(microbatches_));
    if (scaler_ && !std::isfinite(loss)) ++nan_iterations_;
    stats.nan_iterations     = nan_iterations_;
    stats.skipped_iterations = skipped_iterations_;
    return loss;
}

Trainer::Enqueued Trainer::enqueue_forward_backward() {
    follow_batch_schedule();
    begin_iteration();
    Enqueued e;
    e.iteration       = iteration_;
    e.consumed_before = consumed_;
    e.global_batch    = global_batch_;
    IterationStats none;   // MoE's losses: none on this path
    e.schedule = run_schedule(none, /*wait=*/false);
    consumed_ += global_batch_;
    return e;
}

bool Trainer::validates_losses(int64_t iteration) const {
    // The machine validates from the run's second iteration on (RerunStateMachine::validate_result).
    return options_.check_for_nan_in_loss_and_grad && rerun_->mode() == RerunMode::validate_results &&
           iteration > start_iteration_ + 1;
}

namespace {

// The lrs a step at `at` samples uses: the base, --decoupled-lr's (the embedding's and output layer's) and
// µP's hidden matrices'.
struct StepLrs {
    float                lr;
    std::optional<float> decoupled, hidden;
};
StepLrs step_lrs(const optim::LrSchedule & schedule, double at) {
    return {schedule.lr_at_step(at),
            schedule.decoupled_max_lr ? std::optional<float>(schedule.decoupled_lr_at_step(at)) : std::nullopt,
            schedule.hidden_lr_at_step(at)};
}

}  // namespace

void Trainer::enqueue_step(Enqueued & e) {
    timed(1, [&] { sync_.finish(); });
    const optim::LrSchedule & schedule = scheduler_.schedule;   // as optimizer_step: the current lr
    const double              at       = scheduler_.num_steps;
    std::vector<Tensor>       losses;   // a validated loss that is not finite must leave the step undone
    if (validates_losses(e.iteration)) {
        for (size_t k = 0; k < e.schedule.losses.size(); ++k) {
            if (e.schedule.losses[k].count > 0) losses.push_back(e.schedule.token_losses[k]);   // else its mean is 0
        }
    }
    timed(2, [&] {
        const StepLrs lrs = step_lrs(schedule, at);
        e.step            = setup_.optimizer->step_gated(lrs.lr, lrs.decoupled, losses, lrs.hidden);
    });
    sync_.start_gather();   // a step the device skipped gathers the same values again
    e.done = events_[e.iteration % 2].get();
    model_.device().compute_stream().record(*e.done);
}

double Trainer::resolve(Enqueued & e, IterationStats & stats) {
    e.done->synchronize();
    pipeline::PipelineExecutor::read_losses(e.schedule);
    // The rerun machine sees the run that was enqueued, as run_with_reruns shows it each run.
    rerun_->set_iteration(e.iteration);
    rerun_->should_run_forward_backward();
    double loss_sum = checked_loss_sum(e.schedule, e.iteration);
    if (rerun_->should_run_forward_backward()) {   // a failed validation: the iteration runs again in place
        LOOM_CHECK(!setup_.optimizer->finish_gated(e.step).stepped,
                   "iteration " << e.iteration << " is to run again, but its step was applied", "");
        iteration_ = e.iteration;   // the next iteration, if enqueued, is dropped: its gradients are zeroed
        consumed_  = e.consumed_before + e.global_batch;
        do {
            restart_iteration(e.consumed_before);
            loss_sum = checked_loss_sum(run_schedule(stats), e.iteration);
        } while (rerun_->should_run_forward_backward());
        rerun_decision(e.consumed_before);
        LOOM_THROW("the rerun of iteration " << e.iteration << " (loss " << loss_sum << ") ended without the rerun "
                                             << "state machine's exit", "");
    }
    rerun_decision(e.consumed_before);
    const optim::StepResult result = setup_.optimizer->finish_gated(e.step);
    account_step(result, e.iteration, e.global_batch);
    optimizer_stats(stats);
    stats.iteration          = e.iteration;
    stats.consumed_samples   = e.consumed_before + e.global_batch;
    stats.learning_rate      = scheduler_.schedule.lr_at_step(scheduler_.num_steps);
    stats.global_batch_size  = e.global_batch;
    stats.grad_norm          = result.grad_norm;
    stats.nan_iterations     = nan_iterations_;
    stats.skipped_iterations = skipped_iterations_;
    return exchanged_loss(loss_sum / static_cast<double>(microbatches_));
}

void Trainer::apply_loss_scale() {
    if (!scaler_) return;
    // Every backward starts from the loss times the scale, the MoE auxiliary losses' too.
    executor_->set_loss_scale(scaler_->scale());
    for (model::GptModel * chunk : setup_.chunks) {
        chunk->set_aux_loss_scale(scaler_->scale() / static_cast<float>(microbatches_));
    }
}

double Trainer::run_with_reruns(IterationStats & stats, int64_t consumed_before) {
    pipeline::PipelineExecutor::Result r;
    double                             loss_sum = 0;
    rerun_->set_iteration(iteration_);
    for (bool again = false; rerun_->should_run_forward_backward(); again = true) {
        if (again) restart_iteration(consumed_before);
        r        = run_schedule(stats);
        loss_sum = checked_loss_sum(r, iteration_);
    }
    rerun_decision(consumed_before);
    return loss_sum;
}

void Trainer::rerun_decision(int64_t consumed_before) {
    const RerunStateMachine::Decision decision = rerun_->should_checkpoint_and_exit();
    if (decision.checkpoint) save_for_rerun(consumed_before);
    if (decision.exit) {
        const std::string why = decision.checkpoint && options_.save.empty()
                                    ? "Exiting now without a checkpoint (no --save). Resume the job from its last "
                                      "checkpoint on another device to rerun the iteration and establish a diagnostic"
                                    : decision.why;
        throw RerunExit(decision.code, detail::concat(why, " (iteration ", iteration_, ", exit status ", decision.code, ")"));
    }
    if (const std::string report = rerun_->take_stats_report(); !report.empty()) {
        std::fprintf(stderr, "%s\n", report.c_str());
    }
}

optim::StepResult Trainer::optimizer_step(IterationStats & stats) {
    // Megatron's order: the step uses the scheduler's current lr, then the scheduler advances (after a
    // successful update only), and the log line shows the lr it advanced to.
    const optim::LrSchedule & schedule = scheduler_.schedule;
    const double              at       = scheduler_.num_steps;
    const StepLrs             lrs      = step_lrs(schedule, at);
    optim::StepResult result;
    timed(2, [&] {
        result = setup_.optimizer->step(lrs.lr, lrs.decoupled, scaler_ ? scaler_->inv_scale() : 1.0f, lrs.hidden);
        if (options_.timing_log_level >= 1) model_.device().compute_stream().synchronize();   // the step itself
    });
    account_step(result, iteration_, global_batch_);
    return result;
}

void Trainer::account_step(const optim::StepResult & result, int64_t iteration, int64_t global_batch) {
    if (!result.stepped) {
        // Every rank computed the same norm, so every rank stops here together.
        if (options_.check_for_nan_in_loss_and_grad) {
            throw RunError(detail::concat("the gradient norm is ", result.grad_norm, " at iteration ", iteration),
                           "lower --lr or enable --clip-grad; --no-check-for-nan-in-loss-and-grad skips such "
                           "iterations instead",
                           __FILE__, __LINE__);
        }
        ++skipped_iterations_;
        if (!scaler_) ++nan_iterations_;   // with a scaler an overflow is a skipped step; a NaN loss is counted below
    } else {
        scheduler_.num_steps += static_cast<double>(global_batch);
    }
}

void Trainer::optimizer_stats(IterationStats & stats) {
    if (options_.log_num_zeros_in_grad) stats.num_zeros = setup_.optimizer->count_zeros();
    if (options_.log_params_norm) {
        sync_.whole();   // the values whole: pending or sharded gathers done
        stats.params_norm = setup_.optimizer->params_norm();
    }
}

void Trainer::timed(int timer, const std::function<void()> & work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    timer_seconds_[timer] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Trainer::begin_iteration() {
    ++iteration_;
    const FaultAction fault = inject_fault(iteration_);
    if (fault == FaultAction::extra_collective && setup_.all_ranks()) {
        // A schedule that diverged: one all-reduce the other ranks never issue.
        comm::all_reduce_values(*setup_.all_ranks(), model_.device(), {1.0f}, comm::ReduceOp::sum);
    }
    if (fault == FaultAction::other_reduction) comm::flip_next_reduction();
    if (fault == FaultAction::extra_transfer) {   // a send its peer never receives (on the first channel it sends on)
        for (const parallel::PipelineChannel & channel : setup_.groups.pp_channels.channels) {
            if (channel.comm->rank() != 0) continue;
            const Tensor one = Tensor::zeros({1}, DType::f32, model_.device());
            channel.comm->send(one, 1, 0, &model_.device().compute_stream())->wait();
            break;
        }
    }
    if (fault == FaultAction::perturb_param && !params_.empty()) {   // a replica whose weights drifted
        model_.device().compute_stream().synchronize();
        std::vector<float> v = values_f32(params_.front()->data);
        v.front() += 1.0f;
        write_values_f32(params_.front()->data, v);
    }
    sync_.begin();
    for (model::GptModel * chunk : setup_.chunks) chunk->reset_moe_global_counts();
    if (options_.layer_graphs && !layer_graphs_ && iteration_ - 1 - start_iteration_ == options_.cuda_graph_warmup_steps) {
        // After the eager warm-up iterations, before this one (Megatron's create_cudagraphs): capture runs
        // nothing, so there is no gradient or optimizer state to undo.
        layer_graphs_ = std::make_unique<graphs::LayerGraphRunner>(setup_.chunks, executor_->options(),
                                                                   stages_ ? stages_->rank() : 0,
                                                                   options_.model.seq_length / options_.parallel.cp(),
                                                                   options_.micro_batch_size,
                                                                   graphs::LayerGraphScope{options_.graph_moe_router,
                                                                                           options_.graph_moe_preprocess,
                                                                                           options_.graph_attn});
        layer_graphs_->capture();
        executor_->set_layer_graphs(layer_graphs_.get());
    }
    if (options_.full_iteration_graph && !full_iteration_ && iteration_ - 1 - start_iteration_ == options_.cuda_graph_warmup_steps) {
        full_iteration_ = std::make_unique<graphs::FullIterationGraph>(*executor_, model_);
    }
}

pipeline::PipelineExecutor::Result Trainer::run_schedule(IterationStats & stats, bool wait) {
    // --timeline draws the last iteration as measured.
    const bool drawn = stages_ && !options_.timeline_file.empty() && iteration_ == options_.train_iters;
    pipeline::PipelineExecutor::Result r;
    timed(0, [&] {
        if (drawn) stages_->barrier()->wait();   // the stages start the drawn iteration together
        if (full_iteration_) {   // wait: the full-iteration path is never gated
            std::vector<model::MicroBatch> batches;
            for (int64_t k = 0; k < microbatches_; ++k) batches.push_back(data_.next());
            // --overlap-param-gather's gathers are issued from the forward hooks, which a replay does not call:
            // the weights are gathered whole before the graph runs.
            sync_.whole();
            if (!full_iteration_->captured()) full_iteration_->capture(batches);
            r = full_iteration_->replay(batches, sync_.ready(), sync_.last());
        } else {
            r = executor_->run([this] { return data_.next(); }, sync_.ready(), sync_.last(), wait);
        }
        peak_in_flight_  = std::max(peak_in_flight_, r.peak_in_flight);
        if (r.modelled_begin_s) last_schedule_ = r;   // the meta device's: loom plan reads it
        if (!wait) return;   // the gated path: one rank, no MoE layer and no MTP, nothing below to do
        for (model::GptModel * chunk : setup_.chunks) chunk->update_moe_expert_bias();
        sum_losses_over_context(r);
        moe_losses(stats);   // run() waited for the stream
        mtp_losses(stats);
        dsa_losses(stats);
    });
    if (drawn) {
        pipeline::Timeline timeline = pipeline::PipelineExecutor::gather_timeline(r, *stages_, executor_->options(),
                                                                                  model_.device());
        const comm::Communicator * dp = setup_.groups.dp.get();
        if (stages_->rank() == 0 && (!dp || dp->rank() == 0)) {
            pipeline::write_file_atomically(options_.timeline_file, pipeline::timeline_svg(timeline));
        }
    }
    return r;
}

void Trainer::restart_iteration(int64_t consumed_before) {
    sync_.restart();
    data_.set_consumed_samples(consumed_before);   // the same batch again
}

void Trainer::check_weight_hashes(int64_t iteration) {
    sync_.whole();   // every replica's gathered weights
    model_.device().compute_stream().synchronize();     // the last step has written them (values_f32 reads
                                                        // host memory as it is)
    comm::Communicator * everyone = setup_.all_ranks();
    Device &             device   = model_.device();
    // One line per parameter: its name and the digest of its values' bits (comm::digest).
    auto digests = [&](bool expert) {
        std::string lines;
        for (const model::Parameter * p : params_) {
            if (p->expert != expert) continue;
            const std::vector<float> v = values_f32(p->data);
            const uint64_t h = comm::digest({reinterpret_cast<const char *>(v.data()), v.size() * sizeof(float)});
            char           hex[24];
            std::snprintf(hex, sizeof(hex), "%016llx", static_cast<unsigned long long>(h));
            lines += p->name + " " + hex + "\n";
        }
        return lines;
    };
    std::string differ;   // "name on ranks ..." of this rank's groups
    for (const bool expert : {false, true}) {
        comm::Communicator * group = expert && setup_.groups.expert_dp ? setup_.groups.expert_dp.get() : setup_.groups.dp.get();
        if (!group || group->size() == 1) continue;
        const std::vector<std::string> all = comm::all_gather_strings(*group, device, digests(expert));
        for (size_t r = 1; r < all.size(); ++r) {
            if (all[r] == all[0]) continue;
            std::istringstream a(all[0]), b(all[r]);
            for (std::string la, lb; std::getline(a, la) && std::getline(b, lb);) {
                if (la != lb) {
                    differ += "\n    " + la.substr(0, la.find(' ')) + ": group rank 0 and group rank " + std::to_string(r) +
                              (expert ? " (expert-data-parallel)" : " (data-parallel)");
                    break;
                }
            }
        }
    }
    const bool any = everyone && everyone->size() > 1
                         ? comm::all_reduce_values(*everyone, device, {differ.empty() ? 0.0f : 1.0f}, comm::ReduceOp::max)[0] > 0
                         : !differ.empty();
    if (any) {
        throw RunError(detail::concat("Parameter hashes not matching across DP replicas after ", iteration, " iterations",
                                      differ.empty() ? std::string(" (on another rank's group)") : ":" + differ),
                       "a replica's weights drifted (a faulty device, or a bug): resume from the last checkpoint",
                       __FILE__, __LINE__);
    }
    report_message(">>> Weight hashes match after " + std::to_string(iteration) + " iterations...");
}

double Trainer::checked_loss_sum(const pipeline::PipelineExecutor::Result & r, int64_t iteration) const {
    double total = 0;   // the micro-batches' mean losses (last stage)
    const bool validated = options_.check_for_nan_in_loss_and_grad && rerun_->mode() != RerunMode::disabled;
    for (size_t k = 0; k < r.losses.size(); ++k) {
        if (validated) {   // Megatron's loss_func checks, through the rerun state machine
            const double loss = r.losses[k].mean();
            rerun_->validate_result(loss, std::isnan(loss), "found NaN in local forward loss calculation");
            rerun_->validate_result(loss, std::isinf(loss), "found Inf in local forward loss calculation");
        } else if (options_.check_for_nan_in_loss_and_grad && !std::isfinite(r.losses[k].sum)) {
            throw RunError(detail::concat("lm loss is ", r.losses[k].sum, " in micro-batch ", k, " of iteration ",
                                          iteration),
                           "lower --lr, check the data, or give --no-check-for-nan-in-loss-and-grad to skip such "
                           "iterations",
                           __FILE__, __LINE__);
        }
        total += r.losses[k].mean();
    }
    return total;
}

void Trainer::sum_losses_over_context(pipeline::PipelineExecutor::Result & r) const {
    comm::Communicator * cp = setup_.groups.cp.get();
    if (!cp || cp->size() == 1 || r.losses.empty()) return;   // every CP rank is on the same stage
    std::vector<float> sums;
    for (const model::GptModel::LossSum & loss : r.losses) sums.push_back(static_cast<float>(loss.sum));
    sums = comm::all_reduce_values(*cp, model_.device(), std::move(sums), comm::ReduceOp::sum);
    for (size_t k = 0; k < r.losses.size(); ++k) r.losses[k].sum = sums[k];
}

double Trainer::exchanged_loss(double loss) const {
    if (stages_) {   // only the last stage computed the loss
        loss = comm::broadcast_values(*stages_, model_.device(), {static_cast<float>(loss)}, stages_->size() - 1)[0];
    }
    const comm::Communicator * dp = setup_.groups.dp.get();
    if (dp && dp->size() > 1) {
        loss = comm::all_reduce_values(*setup_.groups.dp, model_.device(), {static_cast<float>(loss)}, comm::ReduceOp::avg)[0];
    }
    return loss;
}

std::string Trainer::timers_block(int64_t iterations) {
    // Per iteration in ms, every rank's (one all-gather of three values each), in --timing-log-option's form
    // (Megatron's Timers: "max", "minmax" or "all").
    std::vector<float> mine(3);
    for (int i = 0; i < 3; ++i) {
        mine[i] = static_cast<float>(timer_seconds_[i] * 1000.0 / static_cast<double>(std::max<int64_t>(iterations, 1)));
        timer_seconds_[i] = 0;
    }
    comm::Communicator *     everyone = setup_.all_ranks();
    const int                ranks    = everyone ? everyone->size() : 1;
    const std::vector<float> all      = ranks > 1 ? comm::all_gather_values(*everyone, model_.device(), mine) : mine;
    const std::string &      option   = options_.timing_log_option;
    std::string block = option == "all" ? "times across ranks (ms):" : option == "max" ? "max time across ranks (ms):"
                                                                                       : "(min, max) time across ranks (ms):";
    char line[128];
    for (int i = 0; i < 3; ++i) {
        if (option == "all") {
            block += std::string("\n  ") + kTimerNames[i] + ":";
            for (int r = 0; r < ranks; ++r) {
                std::snprintf(line, sizeof(line), "\n     rank %2d: %.2f", r, all[static_cast<size_t>(r * 3 + i)]);
                block += line;
            }
            continue;
        }
        float lo = all[static_cast<size_t>(i)], hi = lo;
        for (int r = 1; r < ranks; ++r) {
            lo = std::min(lo, all[static_cast<size_t>(r * 3 + i)]);
            hi = std::max(hi, all[static_cast<size_t>(r * 3 + i)]);
        }
        std::string name = std::string(kTimerNames[i]) + " ";
        name.resize(std::max<size_t>(name.size(), 48), '.');
        if (option == "max") {
            std::snprintf(line, sizeof(line), "\n    %s: %.2f", name.c_str(), hi);
        } else {
            std::snprintf(line, sizeof(line), "\n    %s: (%.2f, %.2f)", name.c_str(), lo, hi);
        }
        block += line;
    }
    return block;
}

double Trainer::evaluate(BatchSource & source) {
    double sum = 0, count = 0;
    for (int64_t k = 0; k < options_.eval_iters; ++k) {
        pipeline::PipelineExecutor & executor = eval_executor_ ? *eval_executor_ : *executor_;
        pipeline::PipelineExecutor::Result r = executor.evaluate([&source] { return source.next(); });
        sum_losses_over_context(r);
        for (const model::GptModel::LossSum & loss : r.losses) {
            sum += loss.sum;
            count += loss.count;
        }
    }
    // Only the last stage holds losses; summing over the pipeline and data-parallel groups gives every rank
    // the same total (as doubles, in f32 pairs would be overkill: one value per evaluation).
    std::vector<float> totals{static_cast<float>(sum), static_cast<float>(count)};
    if (stages_) totals = comm::all_reduce_values(*stages_, model_.device(), totals, comm::ReduceOp::sum);
    if (setup_.groups.dp && setup_.groups.dp->size() > 1) {
        totals = comm::all_reduce_values(*setup_.groups.dp, model_.device(), totals, comm::ReduceOp::sum);
    }
    return static_cast<double>(totals[0]) / std::max(1.0, static_cast<double>(totals[1]));
}

namespace {

// The running check of comm/agreement.h over every group kind of the layout (the pipeline's point-to-point
// channels have their own: check_transfers).
void check_collectives(const parallel::ProcessGroups & g, comm::Communicator & everyone, Device & device) {
    comm::Communicator * const kinds[] = {
        g.world.get(),     g.tp.get(),        g.pp.get(),        g.dp.get(),        g.cp.get(),
        g.dp_cp.get(),     g.tp_pp.get(),     g.tp_cp.get(),     g.tp_dp_cp.get(),  g.tp_dp.get(),
        g.embedding.get(), g.position_embedding.get(),           g.expert_ep.get(), g.expert_tp.get(),
        g.expert_dp.get(), g.expert_tp_ep.get(), g.expert_tp_ep_pp.get()};
    comm::check_issued(everyone, device, kinds);
}

std::string padded(int64_t iteration) {   // Megatron's %7d
    char text[32];
    std::snprintf(text, sizeof(text), "%7lld", static_cast<long long>(iteration));
    return text;
}

}  // namespace

void Trainer::log_progress_of_save(int64_t iteration) {
    comm::Communicator * everyone = setup_.all_ranks();
    if (!options_.log_progress || (everyone && everyone->rank() != 0)) return;
    const int    world = everyone ? everyone->size() : 1;
    const double per_sample =
        model_.config().training_flops_per_token(options_.parallel.tp()) * static_cast<double>(model_.config().seq_length);
    const double seconds =
        std::chrono::duration<double>(std::chrono::steady_clock::now() - job_start_).count();
    append_progress(options_.save, world,
                    saved_checkpoint_message(options_.save, world, iteration, per_sample * static_cast<double>(consumed_),
                                             per_sample * static_cast<double>(consumed_ - job_start_consumed_), seconds,
                                             static_cast<double>(consumed_) * static_cast<double>(model_.config().seq_length),
                                             options_.async_save));
}

void Trainer::write_profile(int rank, int64_t last) {
    // What this iteration enqueued on the compute stream has run. No collective here: with --profile-ranks
    // only some ranks arrive (--overlap-param-gather's gathers, dispatched in the next forward, are the
    // next iteration's work).
    model_.device().compute_stream().synchronize();
    const std::vector<TraceEvent> events = Profiler::stop();
    const std::string             path   = options_.profile_file(rank);
    const std::string note = "iterations " + std::to_string(options_.profile_step_start + 1) + " to " + std::to_string(last) +
                             (model_.device().name().rfind("cpu", 0) == 0 ? "" : "; CUDA kernels are not timed yet, host work is");
    const std::string text = chrome_trace_json(events, rank, model_.device().name(), note);
    AtomicFile        file(path);
    file.write(text.data(), text.size());
    file.commit();
    report_message("profile of " + note + " (" + std::to_string(events.size()) + " stream operations on rank " +
                   std::to_string(rank) + ") written to " + path);
}

void Trainer::save() {
    finish_async_save(/*blocking=*/true);   // one save in flight at a time
    report_message("saving checkpoint at iteration " + padded(iteration_) + " to " + options_.save + " in torch_dist format" +
                   (options_.async_save ? " (asynchronously)" : ""));
    pending_save_ = begin_save_checkpoint(options_, setup_, iteration_, consumed_, scheduler_,
                                          scaler_ && scaler_->dynamic() ? std::optional(scaler_->state()) : std::nullopt,
                                          options_.async_save);
    if (options_.async_save) log_progress_of_save(iteration_);   // Megatron's "Saving async checkpoint", now
    if (!options_.async_save) finish_async_save(/*blocking=*/true);
}

void Trainer::finish_async_save(bool blocking) {
    if (!pending_save_) return;
    comm::Communicator * everyone = setup_.all_ranks();
    if (!blocking) {   // every rank asks whether every rank's part is written (Megatron's per-iteration check)
        std::vector<float> waiting{pending_save_->written() ? 0.0f : 1.0f};
        if (everyone && everyone->size() > 1) {
            waiting = comm::all_reduce_values(*everyone, model_.device(), waiting, comm::ReduceOp::max);
        }
        if (waiting[0] > 0.0f) return;
    }
    const bool                   writer    = !everyone || everyone->rank() == 0;   // the tracker's writer
    const std::optional<int64_t> previous  = writer ? tracked_iteration(options_.save) : std::nullopt;
    const int64_t                iteration = pending_save_->iteration();
    std::unique_ptr<checkpoint::SaveInProgress> save = std::move(pending_save_);
    const checkpoint::SaveStats stats = checkpoint::finish_save(*save, everyone);
    if (!options_.async_save) log_progress_of_save(iteration);
    if (writer && retire_checkpoint(options_, previous, iteration) && options_.log_progress) {
        append_progress(options_.save, everyone ? everyone->size() : 1,
                        "Deleted checkpoint\tIteration: " + std::to_string(*previous));
    }
    char sizes[96];
    std::snprintf(sizes, sizeof(sizes), " [ %.1f MiB in %.3f s ]", stats.bytes / 1048576.0, stats.seconds);
    report_message("  successfully saved checkpoint from iteration " + padded(iteration) + " to " + options_.save + sizes);
}

void Trainer::save_for_rerun(int64_t consumed_before) {
    if (options_.save.empty()) {
        return;   // the exit's message says so
    }
    sync_.wait_reductions();
    // Every rank's state: each holds its own failed validation (Megatron's per-rank ShardedObject).
    nlohmann::json       states   = nlohmann::json::array({rerun_->state_dict()});
    comm::Communicator * everyone = setup_.all_ranks();
    if (everyone && everyone->size() > 1) {
        states = nlohmann::json::array();
        for (const std::string & s : comm::all_gather_strings(*everyone, model_.device(), rerun_->state_dict().dump())) {
            states.push_back(nlohmann::json::parse(s));
        }
    }
    report_message("saving checkpoint at iteration " + padded(iteration_ - 1) + " to " + options_.save +
                   " in torch_dist format (to rerun iteration " + std::to_string(iteration_) + ")");
    finish_async_save(/*blocking=*/true);
    save_checkpoint(options_, setup_, iteration_ - 1, consumed_before, scheduler_,
                    {{"world_size", everyone ? everyone->size() : 1}, {"ranks", states}},
                    scaler_ && scaler_->dynamic() ? std::optional(scaler_->state()) : std::nullopt);
}

// Each sink in turn; one whose stream fails is dropped, and its failure kept for run() to act on.
template <class Call> void Trainer::to_sinks(Call && call) {
    for (size_t i = 0; i < sinks_.size();) {
        try {
            call(*sinks_[i]);
            ++i;
        } catch (const OutputError & e) {
            if (!output_failure_) output_failure_ = e;
            sinks_.erase(sinks_.begin() + static_cast<std::ptrdiff_t>(i));
        }
    }
}

void Trainer::report_message(const std::string & line) {
    to_sinks([&](ReportSink & sink) { sink.message(line); });
}

void Trainer::report_evaluation(EvalSplit split, int64_t iteration, bool after_training, double loss) {
    to_sinks([&](ReportSink & sink) { sink.evaluation(split, iteration, consumed_, after_training, loss); });
}

// The loop: an iteration, its report, an evaluation at --eval-interval, a save at --save-interval, and the
// stop policy; after it the last save, the evaluations after training and the summary.
TrainSummary Trainer::run(FILE * out) {
    TrainSummary summary;
    summary.first_iteration = iteration_ + 1;
    comm::Communicator * everyone = setup_.all_ranks();
    sinks_ = make_report_sinks(options_, out, everyone ? everyone->rank() : 0, everyone ? everyone->size() : 1,
                               model_.device());
    if (!resumed_.folder.empty()) {
        char line[512];
        std::snprintf(line, sizeof(line), "  successfully loaded checkpoint from %s at iteration %lld (consumed samples %lld) in %.3f s",
                      resumed_.folder.c_str(), static_cast<long long>(resumed_.iteration),
                      static_cast<long long>(resumed_.consumed_samples), resumed_.seconds);
        report_message(line);
        for (const std::string & note : resumed_.notes) report_message(note);
    } else if (!options_.load.empty()) {
        report_message("WARNING: could not find a checkpoint in " + options_.load + " (no " + checkpoint::kTrackerFile +
                       "); training from scratch");
    } else if (options_.finetune) {   // Megatron loads nothing without --load, and says nothing
        report_message("WARNING: --finetune without --load: there is no checkpoint to fine-tune from; training from "
                       "scratch");
    }
    StopPolicy stop(options_, everyone, model_.device());
    job_start_          = std::chrono::steady_clock::now();
    job_start_consumed_ = consumed_;
    if (options_.log_progress && !options_.save.empty() && (!everyone || everyone->rank() == 0)) {
        append_progress(options_.save, everyone ? everyone->size() : 1, "Starting job");
    }
    // Per rank, as Megatron's "throughput per GPU".
    const double flops_per_sample = model_.config().training_flops_per_token(options_.parallel.tp()) *
                                    static_cast<double>(model_.config().seq_length) /
                                    static_cast<double>(options_.parallel.world_size());
    const int64_t consumed_at_start = consumed_;
    const auto start   = std::chrono::steady_clock::now();
    auto       seconds = [&start] { return std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count(); };
    LogWindow  window(0.0);
    bool       saved_last = false;   // the last iteration run has been saved
    const int  rank       = everyone ? everyone->rank() : 0;
    const bool profiled   = options_.profile && (options_.profile_ranks.empty() ||
                                                std::find(options_.profile_ranks.begin(), options_.profile_ranks.end(),
                                                          std::to_string(rank)) != options_.profile_ranks.end());
    // Iterations that may still allocate, plan and capture: the first two (the first plans every GEMM and
    // fills the caching allocator; in the second the host, no longer waiting on first-time work, runs further
    // ahead of the device and the activations' pool grows by a few blocks), a third where iterations are read
    // late (the first that is enqueued behind an unread one holds two iterations' blocks), and with layer
    // graphs the capture's.
    const bool    graphs            = options_.layer_graphs || options_.full_iteration_graph;
    const int64_t warmup_iterations = (graphs ? options_.cuda_graph_warmup_steps + 2 : 2) + (deferrable_ ? 1 : 0);
    // What follows an iteration once its values are read: its report, evaluation, save and checks.
    auto after = [&](int64_t k, double loss, IterationStats & stats) {
        if (Profiler::active() && k == options_.profile_step_end) write_profile(rank, k);
        summary.losses.push_back(loss);
        window.add(loss, stats);
        IterationReport report;
        report.iteration       = k;
        report.loss            = loss;
        report.stats           = &stats;
        report.first_iteration = summary.first_iteration;
        report.seconds         = seconds();
        IterationStats logged;
        if (k % options_.log_interval == 0 || k == options_.train_iters) {
            if (options_.timing_log_level >= 1) report.timers = timers_block(window.iterations());   // collective
            logged        = window.close(stats, report.seconds, flops_per_sample * static_cast<double>(global_batch_));
            report.window = &logged;
        }
        to_sinks([&](ReportSink & sink) { sink.iteration(report); });
        if (valid_ && options_.eval_interval > 0 && k % options_.eval_interval == 0) {
            const double valid_loss = evaluate();
            summary.validation.emplace_back(k, valid_loss);
            report_evaluation(EvalSplit::validation, k, false, valid_loss);
        }
        to_sinks([](ReportSink & sink) { sink.flush(); });
        saved_last = false;
        finish_async_save(/*blocking=*/false);   // commits a save in flight once every rank has written its part
        if (!options_.save.empty() && options_.save_interval > 0 && k % options_.save_interval == 0) {
            save();
            saved_last = true;
        }
        if (options_.check_weight_hash_interval > 0 && k % options_.check_weight_hash_interval == 0) {
            check_weight_hashes(k);
        }
        // Each log line, the ranks compare the collectives each group has issued, and the transfers each
        // pipeline channel's two ends have: a schedule that diverged without hanging (another size, dtype or
        // reduction, a transfer never received) is named here, not by its wrong numbers.
        if (everyone && everyone->size() > 1 && (k % options_.log_interval == 0 || k == options_.train_iters)) {
            check_collectives(setup_.groups, *everyone, model_.device());
            if (options_.parallel.pp() > 1) {
                std::vector<comm::Communicator *> channels;
                for (const auto & channel : setup_.groups.pp_channels.channels) channels.push_back(channel.comm.get());
                comm::check_transfers(*everyone, model_.device(), channels);
            }
        }
    };
    // An iteration whose values the host reads while the next one is enqueued (deferrable_): none of the
    // above but its report and counts falls on it.
    auto read_now = [&](int64_t k) {
        const auto every = [k](int64_t interval) { return interval > 0 && k % interval == 0; };
        return !deferrable_ || k == summary.first_iteration || k == options_.train_iters || every(options_.log_interval) ||
               (valid_ && every(options_.eval_interval)) || (!options_.save.empty() && every(options_.save_interval)) ||
               every(options_.check_weight_hash_interval) || every(options_.exit_interval) ||
               (profiled && k == options_.profile_step_end);
    };
    std::optional<Enqueued> pending;   // the gated path's iteration whose values are not read yet
    for (int64_t k = iteration_ + 1; k <= options_.train_iters; ++k) {
        if (profiled && k - 1 == options_.profile_step_start) Profiler::start();   // Megatron's window
        if (k == summary.first_iteration + warmup_iterations) summary.work_warm = model_.device().work();
        IterationStats stats;
        const auto     step_start = std::chrono::steady_clock::now();
        double         loss       = 0;
        bool           read       = true;    // this iteration's values are read now
        bool           stop_asked = false;   // the stop policy has seen this iteration
        if (!gated_) {
            loss = step(stats);
        } else {
            Enqueued e = enqueue_forward_backward();
            if (pending) {   // the previous iteration, read while this one's forward and backward are queued
                IterationStats previous;
                const double   previous_loss = resolve(*pending, previous);
                const int64_t  previous_k    = pending->iteration;
                pending.reset();
                after(previous_k, previous_loss, previous);
            }
            enqueue_step(e);
            read = read_now(k);
            if (!read) {   // a stop (signal, time) is asked now: the run ends with this iteration read
                summary.stopped_by = stop.after(k, seconds(), false);
                stop_asked         = true;
                read               = !summary.stopped_by.empty();
            }
            if (read) {
                loss = resolve(e, stats);
            } else {
                pending = std::move(e);
            }
        }
        summary.step_seconds.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - step_start).count());
        if (read) after(k, loss, stats);
        if (!stop_asked) summary.stopped_by = stop.after(k, seconds(), output_failure_.has_value());
        if (!summary.stopped_by.empty()) break;
    }
    LOOM_CHECK(!pending, "the run ended with iteration " << pending->iteration << " unread", "");
    if (summary.work_warm) {
        summary.work_end                = model_.device().work();
        summary.iterations_after_warmup = static_cast<int64_t>(summary.losses.size()) - warmup_iterations;
    }
    if (!options_.save.empty() && !summary.losses.empty() && !saved_last) save();
    finish_async_save(/*blocking=*/true);   // the run ends with its last checkpoint committed
    const int64_t last = summary.first_iteration + static_cast<int64_t>(summary.losses.size()) - 1;
    const bool    lost = summary.stopped_by == StopPolicy::kOutputFailed;
    if (lost && output_failure_) {   // this rank's stream failed: the others stop here too, saved as this one
        throw OutputError(detail::concat(output_failure_->message(), " (the run stopped after iteration ", iteration_,
                                         options_.save.empty() ? std::string()
                                                               : "; the checkpoint is saved in " + options_.save,
                                         ")"),
                          output_failure_->hint(), output_failure_->file(), output_failure_->line());
    }
    if (lost) {   // another rank's stream failed: it ends the job with the message
        sinks_.clear();
        return summary;
    }
    if (valid_ && !summary.losses.empty()) {   // Megatron's pretrain(): validation after training
        const double loss = evaluate();
        summary.validation.emplace_back(last, loss);
        report_evaluation(EvalSplit::validation, last, true, loss);
        to_sinks([](ReportSink & sink) { sink.flush(); });
    }
    if (test_ && !summary.losses.empty()) {   // and on the test split
        summary.test = evaluate(*test_);
        report_evaluation(EvalSplit::test, last, true, *summary.test);
    }
    if (!summary.stopped_by.empty()) {
        report_message("exiting program at iteration " + std::to_string(iteration_) + " (" + summary.stopped_by + ")");
    }
    model_.device().compute_stream().synchronize();   // the last step's update is part of the run
    if (Profiler::active()) write_profile(rank, iteration_);   // the run ended inside the window
    summary.seconds = seconds();
    const double samples    = static_cast<double>(consumed_ - consumed_at_start);
    const double tokens     = samples * static_cast<double>(model_.config().seq_length);
    summary.tokens_per_second = tokens / summary.seconds;
    summary.tflops            = flops_per_sample * samples / summary.seconds / 1e12;
    sinks_.clear();
    return summary;
}

}  // namespace loom::train
