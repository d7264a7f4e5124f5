#include "train/trainer.h"

#include "model/moe/router.h"

#include "core/device.h"
#include "data/mapped_file.h"
#include "ddp/finalize_grads.h"
#include "model/moe/router.h"

#include <atomic>
#include <chrono>
#include <cmath>
#include <csignal>
#include <thread>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <new>
#include <nlohmann/json.hpp>
#include <unistd.h>

namespace loom::train {

namespace {

std::string timestamp() {
    auto        now  = std::chrono::system_clock::now();
    std::time_t secs = std::chrono::system_clock::to_time_t(now);
    auto        us   = std::chrono::duration_cast<std::chrono::microseconds>(now.time_since_epoch()).count() % 1000000;
    std::tm     tm;
    localtime_r(&secs, &tm);
    char buffer[64];
    std::strftime(buffer, sizeof(buffer), "%Y-%m-%d %H:%M:%S", &tm);
    char out[80];
    std::snprintf(out, sizeof(out), "%s.%06lld", buffer, static_cast<long long>(us));
    return out;
}

}  // namespace

std::string megatron_log_line(const IterationStats & s, int64_t train_iters, bool with_throughput) {
    char buffer[1024];
    int  n = std::snprintf(buffer, sizeof(buffer), " [%s] iteration %8lld/%8lld | consumed samples: %12lld | "
                           "elapsed time per iteration (ms): %.1f |",
                           timestamp().c_str(), static_cast<long long>(s.iteration), static_cast<long long>(train_iters),
                           static_cast<long long>(s.consumed_samples), s.elapsed_ms);
    if (with_throughput) {
        n += std::snprintf(buffer + n, sizeof(buffer) - n, " throughput per GPU (TFLOP/s/GPU): %.1f |", s.tflops);
    }
    n += std::snprintf(buffer + n, sizeof(buffer) - n, " learning rate: %.6E | global batch size: %5lld | lm loss: %.6E |",
                       s.learning_rate, static_cast<long long>(s.global_batch_size), s.lm_loss);
    // The MoE losses follow lm loss, as the other keys of Megatron's total_loss_dict do.
    for (const auto & [name, value] : s.moe_losses) {
        n += std::snprintf(buffer + n, sizeof(buffer) - n, " %s: %.6E |", name.c_str(), value);
    }
    n += std::snprintf(buffer + n, sizeof(buffer) - n, " loss scale: %.1f | grad norm: %.3f |", s.loss_scale, s.grad_norm);
    if (s.num_zeros >= 0) n += std::snprintf(buffer + n, sizeof(buffer) - n, " num zeros: %.1f |", s.num_zeros);
    if (s.params_norm >= 0) n += std::snprintf(buffer + n, sizeof(buffer) - n, " params norm: %.3f |", s.params_norm);
    std::snprintf(buffer + n, sizeof(buffer) - n, " number of skipped iterations: %3lld | number of nan iterations: %3lld |",
                  static_cast<long long>(s.skipped_iterations), static_cast<long long>(s.nan_iterations));
    return buffer;
}

std::string metrics_json(const IterationStats & s) {
    nlohmann::ordered_json j;
    j["iteration"]                   = s.iteration;
    j["consumed samples"]            = s.consumed_samples;
    j["elapsed time per iteration (ms)"] = s.elapsed_ms;
    j["throughput per GPU (TFLOP/s/GPU)"] = s.tflops;
    j["learning rate"]               = s.learning_rate;
    j["global batch size"]           = s.global_batch_size;
    j["lm loss"]                     = s.lm_loss;
    for (const auto & [name, value] : s.moe_losses) j[name] = value;
    j["loss scale"]                  = s.loss_scale;
    j["grad norm"]                   = s.grad_norm;
    if (s.num_zeros >= 0) j["num zeros"] = s.num_zeros;
    if (s.params_norm >= 0) j["params norm"] = s.params_norm;
    j["number of skipped iterations"] = s.skipped_iterations;
    j["number of nan iterations"]    = s.nan_iterations;
    return j.dump();
}

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
      model_(*setup_.chunks.at(0)), data_(data), params_(setup_.parameters()) {
    if (setup_.groups.pp && setup_.groups.pp->size() > 1) stages_ = setup_.groups.pp.get();
    // One executor for every layout: without a pipeline group it runs forward/backward per micro-batch.
    // Its transfers go over the pipeline's channel communicators, built next to the pipeline group.
    executor_ = std::make_unique<pipeline::PipelineExecutor>(
        setup_.chunks, stages_ ? setup_.groups.pp : nullptr,
        stages_ ? setup_.groups.pp_channels : parallel::PipelineChannels{},
        static_cast<int>(options_.num_microbatches()), static_cast<int>(options_.microbatch_group_size));
    if (setup_.ddp) grad_ready_ = setup_.ddp->grad_ready();
    schedule_              = options.lr_schedule();
    resumed_               = load_checkpoint(options_, setup_);
    if (!resumed_.folder.empty()) {
        iteration_ = resumed_.iteration;
        consumed_  = resumed_.consumed_samples;
        if (consumed_ > 0) data_.set_consumed_samples(consumed_);
    }
    start_iteration_ = iteration_;
    for (model::GptModel * chunk : setup_.chunks) {
        chunk->set_moe_aux_loss_scale(1.0f / static_cast<float>(options_.num_microbatches()));
    }
}

std::vector<std::pair<std::string, double>> Trainer::moe_losses() {
    const model::MoeConfig & moe = options_.model.moe;
    if (!moe.enabled()) return {};
    Device &           device = model_.device();
    std::vector<float> sums(4, 0.0f);
    for (model::GptModel * chunk : setup_.chunks) {
        const std::array<double, 4> mine = chunk->take_moe_losses();
        for (size_t i = 0; i < mine.size(); ++i) sums[i] += static_cast<float>(mine[i]);
    }
    if (stages_) sums = comm::all_reduce_values(*stages_, device, sums, comm::ReduceOp::sum);   // every stage's layers
    if (const comm::Communicator * tp = setup_.groups.tp.get(); tp && tp->size() > 1 && options_.sequence_parallel) {
        sums = comm::all_reduce_values(*setup_.groups.tp, device, sums, comm::ReduceOp::sum);   // each rank's share of its sequence's
    }
    if (const comm::Communicator * dp = setup_.groups.dp.get(); dp && dp->size() > 1) {
        sums = comm::all_reduce_values(*setup_.groups.dp, device, sums, comm::ReduceOp::avg);
    }
    int64_t layers = 0;
    for (int64_t i = 0; i < options_.model.num_layers; ++i) layers += moe.is_moe_layer(i) ? 1 : 0;
    const double per_layer_microbatch = 1.0 / (static_cast<double>(options_.num_microbatches()) * static_cast<double>(layers));
    std::vector<std::pair<std::string, double>> out;
    if (moe.load_balancing != model::MoeLoadBalancing::none) {
        out.emplace_back(moe.load_balancing == model::MoeLoadBalancing::seq_aux_loss ? "seq_load_balancing_loss"
                                                                                   : "load_balancing_loss",
                         sums[model::router_loss_aux_logged] * per_layer_microbatch);
    }
    if (moe.z_loss_coeff > 0.0f) out.emplace_back("z_loss", sums[model::router_loss_z_logged] * per_layer_microbatch);
    return out;
}

void BatchSource::set_consumed_samples(int64_t consumed) {
    LOOM_THROW("the data source " << describe() << " cannot resume after " << consumed << " samples",
               "resume with a data source that can seek (--data-path, --llmc-shard, --text-file or synthetic data)");
}

Trainer::~Trainer() {
    // Whoever reads the model next sees it whole (a lazy parameter all-gather finished) and stepped.
    try {
        if (setup_.ddp) setup_.ddp->finish_param_sync();
        model_.device().compute_stream().synchronize();
    } catch (...) {
    }
}

namespace {

// The fault-injection seam: LOOM_FAULT=<rank>:<iteration>:<fault> makes world rank <rank> fail at the start
// of <iteration>, so a test can check that the job ends instead of hanging. Faults: bad_alloc (a
// std::bad_alloc, as an allocation that failed), missing_file (a loom::Error from opening a file that does
// not exist), sigstop (the process stops: its peers wait in their next collective until the watchdog),
// stall (the host thread sleeps forever outside communication, as a rank stuck in compute or I/O would:
// its engine still answers the watchdog's roll call).
void inject_fault(int64_t iteration) {
    static const char * spec = std::getenv("LOOM_FAULT");
    if (!spec) return;
    int  rank = -1;
    long at   = -1;
    char fault[32] = {};
    if (std::sscanf(spec, "%d:%ld:%31s", &rank, &at, fault) != 3 || rank != process_rank() || at != iteration) return;
    const std::string kind = fault;
    if (kind == "bad_alloc") throw std::bad_alloc();
    if (kind == "missing_file") data::MappedFile("/nonexistent/loom-fault-injection.bin", "injected fault");
    if (kind == "sigstop") std::raise(SIGSTOP);
    if (kind == "stall") {
        for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
    }
}

}  // namespace

// One iteration, phase by phase: begin (fault seam, zeroed gradients, the layer graphs' capture once the
// warm-up is over), the pipeline schedule's forward and backward passes, the gradients' final reduction, the
// optimizer step, and the loss every rank logs.
double Trainer::step(IterationStats & stats) {
    begin_iteration();
    const pipeline::PipelineExecutor::Result r = run_schedule(stats);
    const double loss_sum = checked_loss_sum(r);
    consumed_ += options_.global_batch_size;
    timed(1, [&] {
        ddp::finalize_grads(setup_.ddp.get(), params_,
                            ddp::FinalizeGroups{setup_.groups.embedding.get(), setup_.groups.tp.get()}, model_.device());
    });
    const float lr = schedule_.lr_at(iteration_);
    optim::StepResult result;
    timed(2, [&] {
        result = setup_.optimizer->step(lr, schedule_.decoupled_max_lr
                                                ? std::optional<float>(schedule_.decoupled_lr_at(iteration_))
                                                : std::nullopt);
        if (options_.timing_log_level >= 1) model_.device().compute_stream().synchronize();   // the step itself
    });
    if (options_.log_num_zeros_in_grad) stats.num_zeros = setup_.optimizer->count_zeros();
    if (options_.log_params_norm) stats.params_norm = setup_.optimizer->params_norm();
    if (!result.stepped) {
        // Every rank computed the same norm, so every rank stops here together.
        if (options_.check_for_nan_in_loss_and_grad) {
            throw RunError(detail::concat("the gradient norm is ", result.grad_norm, " at iteration ", iteration_),
                           "lower --lr or enable --clip-grad; --no-check-for-nan-in-loss-and-grad skips such "
                           "iterations instead",
                           __FILE__, __LINE__);
        }
        ++nan_iterations_;
    }
    stats.iteration          = iteration_;
    stats.consumed_samples   = consumed_;
    stats.learning_rate      = lr;
    stats.global_batch_size  = options_.global_batch_size;
    stats.grad_norm          = result.grad_norm;
    stats.nan_iterations     = nan_iterations_;
    stats.skipped_iterations = nan_iterations_;
    return exchanged_loss(loss_sum / static_cast<double>(options_.num_microbatches()));
}

void Trainer::timed(int timer, const std::function<void()> & work) {
    const auto start = std::chrono::steady_clock::now();
    work();
    timer_seconds_[timer] += std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
}

void Trainer::begin_iteration() {
    ++iteration_;
    inject_fault(iteration_);
    if (setup_.ddp) {
        setup_.ddp->zero_grad_buffer();
    } else {
        for (model::GptModel * chunk : setup_.chunks) chunk->zero_grad();
    }
    if (options_.layer_graphs && !layer_graphs_ && iteration_ - 1 - start_iteration_ == options_.cuda_graph_warmup_steps) {
        // After the eager warm-up iterations, before this one (Megatron's create_cudagraphs): capture runs
        // nothing, so there is no gradient or optimizer state to undo.
        layer_graphs_ = std::make_unique<graphs::LayerGraphRunner>(setup_.chunks, executor_->options(),
                                                                   stages_ ? stages_->rank() : 0,
                                                                   options_.model.seq_length, options_.micro_batch_size,
                                                                   graphs::LayerGraphScope{options_.graph_moe_router,
                                                                                           options_.graph_moe_preprocess});
        layer_graphs_->capture();
    }
}

pipeline::PipelineExecutor::Result Trainer::run_schedule(IterationStats & stats) {
    ddp::DistributedDataParallel * d = setup_.ddp.get();
    // --timeline draws the last iteration as measured.
    const bool drawn = stages_ && !options_.timeline_file.empty() && iteration_ == options_.train_iters;
    pipeline::PipelineExecutor::Result r;
    timed(0, [&] {
        if (drawn) stages_->barrier()->wait();   // the stages start the drawn iteration together
        r = executor_->run([this] { return data_.next(); }, grad_ready_,
                           d ? std::function<void(bool)>([d](bool last) { d->set_last_microbatch(last); }) : nullptr);
        peak_in_flight_  = std::max(peak_in_flight_, r.peak_in_flight);
        stats.moe_losses = moe_losses();   // run() waited for the stream
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

double Trainer::checked_loss_sum(const pipeline::PipelineExecutor::Result & r) const {
    double total = 0;   // the micro-batches' mean losses (last stage)
    for (size_t k = 0; k < r.losses.size(); ++k) {
        if (options_.check_for_nan_in_loss_and_grad && !std::isfinite(r.losses[k].sum)) {
            throw RunError(detail::concat("lm loss is ", r.losses[k].sum, " in micro-batch ", k, " of iteration ",
                                          iteration_),
                           "lower --lr, check the data, or give --no-check-for-nan-in-loss-and-grad to skip such "
                           "iterations",
                           __FILE__, __LINE__);
        }
        total += r.losses[k].mean();
    }
    return total;
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
    // Per iteration in ms; min and max over every rank (two all-reduces of three values).
    std::vector<float> lo(3), hi(3);
    for (int i = 0; i < 3; ++i) {
        lo[i] = hi[i] = static_cast<float>(timer_seconds_[i] * 1000.0 / static_cast<double>(std::max<int64_t>(iterations, 1)));
        timer_seconds_[i] = 0;
    }
    if (comm::Communicator * everyone = setup_.all_ranks(); everyone && everyone->size() > 1) {
        lo = comm::all_reduce_values(*everyone, model_.device(), lo, comm::ReduceOp::min);
        hi = comm::all_reduce_values(*everyone, model_.device(), hi, comm::ReduceOp::max);
    }
    std::string block = "(min, max) time across ranks (ms):";
    char        line[128];
    for (int i = 0; i < 3; ++i) {
        std::string name = std::string(kTimerNames[i]) + " ";
        name.resize(std::max<size_t>(name.size(), 48), '.');
        std::snprintf(line, sizeof(line), "\n    %s: (%.2f, %.2f)", name.c_str(), lo[i], hi[i]);
        block += line;
    }
    return block;
}

void Trainer::log_validation(TensorBoardWriter & board, int64_t iteration, double loss) const {
    board.add_scalar("lm loss validation", loss, iteration);
    board.add_scalar("lm loss validation vs samples", loss, consumed_);
    if (options_.log_validation_ppl_to_tensorboard) {
        const double ppl = std::exp(std::min(loss, 20.0));
        board.add_scalar("lm loss validation ppl", ppl, iteration);
        board.add_scalar("lm loss validation ppl vs samples", ppl, consumed_);
    }
}

double Trainer::evaluate(BatchSource & source) {
    double sum = 0, count = 0;
    for (int64_t k = 0; k < options_.eval_iters; ++k) {
        pipeline::PipelineExecutor::Result r = executor_->evaluate([&source] { return source.next(); });
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

std::string megatron_validation_lines(const std::string & where, double loss) {
    char line[256];
    std::snprintf(line, sizeof(line), " validation loss at %s | lm loss value: %.6E | lm loss PPL: %.6E | ",
                  where.c_str(), loss, std::exp(std::min(loss, 20.0)));
    const std::string dashes(std::strlen(line) + 1, '-');
    return dashes + "\n" + line + "\n" + dashes;
}

namespace {

std::atomic<bool> g_sigterm{false};

extern "C" void on_sigterm(int) { g_sigterm.store(true); }

}  // namespace

void Trainer::save(FILE * out) {
    if (out) {
        std::fprintf(out, "saving checkpoint at iteration %7lld to %s in torch_dist format\n",
                     static_cast<long long>(iteration_), options_.save.c_str());
        std::fflush(out);
    }
    checkpoint::SaveStats stats = save_checkpoint(options_, setup_, iteration_, consumed_);
    if (out) {
        std::fprintf(out, "  successfully saved checkpoint from iteration %7lld to %s [ %.1f MiB in %.3f s ]\n",
                     static_cast<long long>(iteration_), options_.save.c_str(), stats.bytes / 1048576.0, stats.seconds);
    }
}

TrainSummary Trainer::run(FILE * out) {
    TrainSummary summary;
    summary.first_iteration = iteration_ + 1;
    if (out && !resumed_.folder.empty()) {
        std::fprintf(out, "  successfully loaded checkpoint from %s at iteration %lld (consumed samples %lld) in %.3f s\n",
                     resumed_.folder.c_str(), static_cast<long long>(resumed_.iteration),
                     static_cast<long long>(resumed_.consumed_samples), resumed_.seconds);
    } else if (out && !options_.load.empty()) {
        std::fprintf(out, "WARNING: could not find a checkpoint in %s (no %s); training from scratch\n",
                     options_.load.c_str(), checkpoint::kTrackerFile);
    }
    // The ranks agree on stopping: a flag any rank raised stops all of them after the same iteration.
    comm::Communicator * everyone = setup_.all_ranks();
    std::unique_ptr<TensorBoardWriter> board;
    if (!options_.tensorboard_dir.empty() && (!everyone || everyone->rank() == 0)) {
        board = std::make_unique<TensorBoardWriter>(options_.tensorboard_dir);
    }
    FILE *       log_file = nullptr;
    if (!options_.log_file.empty() && (!everyone || everyone->rank() == 0)) {   // one writer: rank 0

        log_file = std::fopen(options_.log_file.c_str(), "w");
        LOOM_CHECK(log_file != nullptr, "cannot open --log-file '" << options_.log_file << "' for writing",
                   "check that the directory exists and is writable");
    }
    struct sigaction previous {};
    if (options_.exit_signal_handler) {
        struct sigaction action {};
        action.sa_handler = on_sigterm;
        sigemptyset(&action.sa_mask);
        sigaction(SIGTERM, &action, &previous);
    }
    auto any_rank = [&](bool local) {
        if (!everyone || everyone->size() == 1) return local;
        return comm::all_reduce_values(*everyone, model_.device(), {local ? 1.0f : 0.0f}, comm::ReduceOp::max)[0] > 0.0f;
    };
    bool   progress_bar = out != nullptr && isatty(fileno(out));
    // Per rank, as Megatron's "throughput per GPU".
    double flops_per_iteration = model_.config().training_flops_per_token() *
                                 static_cast<double>(options_.global_batch_size * model_.config().seq_length) /
                                 static_cast<double>(options_.data_parallel_size * options_.pipeline_parallel_size *
                                                     options_.tensor_parallel_size);
    auto   start        = std::chrono::steady_clock::now();
    auto   window_start = start;
    double window_loss  = 0;
    int64_t window_iters = 0;
    std::vector<std::pair<std::string, double>> window_moe;   // MoE losses summed over the window
    bool    saved_last   = false;   // the last iteration run has been saved
    for (int64_t k = iteration_ + 1; k <= options_.train_iters; ++k) {
        IterationStats stats;
        double         loss = step(stats);
        summary.losses.push_back(loss);
        window_loss += loss;
        if (window_moe.empty()) window_moe = stats.moe_losses;
        else for (size_t i = 0; i < window_moe.size(); ++i) window_moe[i].second += stats.moe_losses[i].second;
        ++window_iters;
        if (board && k % options_.tensorboard_log_interval == 0) {
            // Megatron's training_log: each scalar by iteration and "vs samples".
            auto both = [&](const std::string & tag, double value) {
                board->add_scalar(tag, value, k);
                board->add_scalar(tag + " vs samples", value, consumed_);
            };
            both("learning-rate", stats.learning_rate);
            both("batch-size", static_cast<double>(stats.global_batch_size));
            both("lm loss", loss);
            if (options_.log_loss_scale_to_tensorboard) both("loss-scale", 1.0);
            if (options_.log_world_size_to_tensorboard) {
                both("world-size", static_cast<double>(everyone ? everyone->size() : 1));
            }
            both("grad-norm", stats.grad_norm);
            for (const auto & [name, value] : stats.moe_losses) board->add_scalar(name, value, k);   // the MoE tracker's
            if (stats.num_zeros >= 0) both("num-zeros", stats.num_zeros);
            if (stats.params_norm >= 0) both("params-norm", stats.params_norm);
            if (options_.log_memory_to_tensorboard) {
                const AllocatorStats m = model_.device().allocator(MemoryKind::device).stats();
                board->add_scalar("mem-reserved-bytes", static_cast<double>(m.reserved), k);
                board->add_scalar("mem-allocated-bytes", static_cast<double>(m.allocated), k);
                board->add_scalar("mem-max-allocated-bytes", static_cast<double>(m.peak_allocated), k);
                board->add_scalar("mem-allocated-count", static_cast<double>(m.active), k);
            }
        }
        if (k % options_.log_interval == 0 || k == options_.train_iters) {
            auto   now     = std::chrono::steady_clock::now();
            double seconds = std::chrono::duration<double>(now - window_start).count();
            stats.elapsed_ms = seconds * 1000.0 / static_cast<double>(window_iters);
            stats.tflops     = flops_per_iteration / (stats.elapsed_ms / 1000.0) / 1e12;
            stats.lm_loss    = window_loss / static_cast<double>(window_iters);
            stats.moe_losses = window_moe;
            for (auto & entry : stats.moe_losses) entry.second /= static_cast<double>(window_iters);
            if (board && options_.log_timers_to_tensorboard) {
                board->add_scalar("iteration-time", stats.elapsed_ms / 1000.0, k);
            }
            if (board && options_.log_throughput) board->add_scalar("throughput", stats.tflops, k);
            if (out) {
                std::fprintf(out, "%s%s\n", progress_bar ? "\r\033[K" : "",
                             megatron_log_line(stats, options_.train_iters, options_.log_throughput).c_str());
            }
            if (options_.timing_log_level >= 1) {
                const std::string block = timers_block(window_iters);   // every rank takes part
                if (out) std::fprintf(out, "%s\n", block.c_str());
            }
            if (log_file) {
                std::fprintf(log_file, "%s\n", metrics_json(stats).c_str());
                LOOM_CHECK(std::fflush(log_file) == 0 && !std::ferror(log_file),
                           "cannot write --log-file '" << options_.log_file << "': " << std::strerror(errno),
                           "check the free space of its file system");
            }
            window_start = now;
            window_loss  = 0;
            window_moe.clear();
            window_iters = 0;
        } else if (progress_bar) {
            double elapsed = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            double done    = static_cast<double>(k - summary.first_iteration + 1);
            double eta     = elapsed / done * static_cast<double>(options_.train_iters - k);
            int    width   = 30;
            int    filled  = static_cast<int>(width * k / options_.train_iters);
            std::fprintf(out, "\r[%.*s%*s] %lld/%lld  loss %.4f  ETA %.0fs", filled, "##############################",
                         width - filled, "", static_cast<long long>(k), static_cast<long long>(options_.train_iters), loss, eta);
            std::fflush(out);
        }
        if (valid_ && options_.eval_interval > 0 && k % options_.eval_interval == 0) {
            const double loss = evaluate();
            summary.validation.emplace_back(k, loss);
            if (out) std::fprintf(out, "%s\n", megatron_validation_lines("iteration " + std::to_string(k), loss).c_str());
            if (board) log_validation(*board, k, loss);
        }
        if (board) board->flush();
        saved_last = false;
        if (!options_.save.empty() && options_.save_interval > 0 && k % options_.save_interval == 0) {
            save(out);
            saved_last = true;
        }
        // Megatron's order: the signal, the duration, the interval; each saves (with --save) and stops.
        if (options_.exit_signal_handler && any_rank(g_sigterm.load())) {
            summary.stopped_by = "SIGTERM";
        } else if (options_.exit_duration_in_mins > 0 &&
                   any_rank(std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count() / 60.0 >
                            options_.exit_duration_in_mins)) {
            summary.stopped_by = "--exit-duration-in-mins";
        } else if (options_.exit_interval > 0 && k % options_.exit_interval == 0) {
            summary.stopped_by = "--exit-interval";
        }
        if (!summary.stopped_by.empty()) break;
    }
    if (!options_.save.empty() && !summary.losses.empty() && !saved_last) save(out);
    if (valid_ && !summary.losses.empty()) {   // Megatron's pretrain(): validation after training
        const int64_t last = summary.first_iteration + static_cast<int64_t>(summary.losses.size()) - 1;
        const double  loss = evaluate();
        summary.validation.emplace_back(last, loss);
        if (board) {
            log_validation(*board, last, loss);
            board->flush();
        }
        if (out) {
            std::fprintf(out, "%s\n",
                         megatron_validation_lines("iteration " + std::to_string(last) + " on validation set", loss).c_str());
        }
    }
    if (test_ && !summary.losses.empty()) {   // and on the test split (not written to TensorBoard)
        const int64_t last = summary.first_iteration + static_cast<int64_t>(summary.losses.size()) - 1;
        summary.test       = evaluate(*test_);
        if (out) {
            std::fprintf(out, "%s\n",
                         megatron_validation_lines("iteration " + std::to_string(last) + " on test set", *summary.test).c_str());
        }
    }
    if (out && !summary.stopped_by.empty()) {
        std::fprintf(out, "exiting program at iteration %lld (%s)\n", static_cast<long long>(iteration_),
                     summary.stopped_by.c_str());
    }
    if (options_.exit_signal_handler) sigaction(SIGTERM, &previous, nullptr);
    model_.device().compute_stream().synchronize();   // the last step's update is part of the run
    summary.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    const double iterations = static_cast<double>(summary.losses.size());
    double tokens   = iterations * static_cast<double>(options_.global_batch_size * model_.config().seq_length);
    summary.tokens_per_second = tokens / summary.seconds;
    summary.tflops = flops_per_iteration * iterations / summary.seconds / 1e12;
    if (log_file) std::fclose(log_file);
    return summary;
}

}  // namespace loom::train
