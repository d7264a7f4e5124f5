#include "train/reporting.h"

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/device.h"

#include <algorithm>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstring>
#include <ctime>
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

// "iteration 40", "iteration 40 on validation set", "iteration 40 on test set": Megatron's words for where
// an evaluation ran.
std::string evaluation_site(EvalSplit split, int64_t iteration, bool after_training) {
    std::string where = "iteration " + std::to_string(iteration);
    if (split == EvalSplit::test) return where + " on test set";
    return after_training ? where + " on validation set" : where;
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
    for (const auto & [name, value] : s.tracked_losses) {
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
    for (const auto & [name, value] : s.tracked_losses) j[name] = value;
    j["loss scale"]                  = s.loss_scale;
    j["grad norm"]                   = s.grad_norm;
    if (s.num_zeros >= 0) j["num zeros"] = s.num_zeros;
    if (s.params_norm >= 0) j["params norm"] = s.params_norm;
    j["number of skipped iterations"] = s.skipped_iterations;
    j["number of nan iterations"]    = s.nan_iterations;
    return j.dump();
}

std::string megatron_validation_lines(const std::string & where, double loss) {
    char line[256];
    std::snprintf(line, sizeof(line), " validation loss at %s | lm loss value: %.6E | lm loss PPL: %.6E | ",
                  where.c_str(), loss, std::exp(std::min(loss, 20.0)));
    const std::string dashes(std::strlen(line) + 1, '-');
    return dashes + "\n" + line + "\n" + dashes;
}

// ---- LogWindow

void LogWindow::add(double loss, const IterationStats & stats) {
    loss_ += loss;
    if (moe_.empty()) {
        moe_ = stats.tracked_losses;
    } else {
        for (size_t i = 0; i < moe_.size(); ++i) moe_[i].second += stats.tracked_losses[i].second;
    }
    ++iterations_;
}

IterationStats LogWindow::close(IterationStats last, double now_seconds, double flops_per_iteration) {
    const double n   = static_cast<double>(iterations_);
    last.elapsed_ms  = (now_seconds - start_) * 1000.0 / n;
    last.tflops      = flops_per_iteration / (last.elapsed_ms / 1000.0) / 1e12;
    last.lm_loss     = loss_ / n;
    last.tracked_losses  = moe_;
    for (auto & entry : last.tracked_losses) entry.second /= n;
    start_      = now_seconds;
    loss_       = 0;
    iterations_ = 0;
    moe_.clear();
    return last;
}

// ---- ConsoleSink

ConsoleSink::ConsoleSink(FILE * out, const TrainOptions & options, bool progress_bar)
    : out_(out), options_(options), progress_bar_(progress_bar) {}

// Each line reaches the stream when it is printed (as Megatron's print(..., flush=True)); one that cannot
// stops the run (Trainer::run) rather than training on with its log lost.
void ConsoleSink::written() {
    check_written(out_, "the training log to standard output",
                  "standard output is full, closed or gone: redirect it to a file on a file system with space");
}

void ConsoleSink::iteration(const IterationReport & r) {
    if (r.window) {
        std::fprintf(out_, "%s%s\n", progress_bar_ ? "\r\033[K" : "",
                     megatron_log_line(*r.window, options_.train_iters, options_.log_throughput).c_str());
        if (!r.timers.empty()) std::fprintf(out_, "%s\n", r.timers.c_str());
        written();
    } else if (progress_bar_) {
        const double done   = static_cast<double>(r.iteration - r.first_iteration + 1);
        const double eta    = r.seconds / done * static_cast<double>(options_.train_iters - r.iteration);
        const int    width  = 30;
        const int    filled = static_cast<int>(width * r.iteration / options_.train_iters);
        std::fprintf(out_, "\r[%.*s%*s] %lld/%lld  loss %.4f  ETA %.0fs", filled, "##############################",
                     width - filled, "", static_cast<long long>(r.iteration),
                     static_cast<long long>(options_.train_iters), r.loss, eta);
        written();
    }
}

void ConsoleSink::evaluation(EvalSplit split, int64_t iteration, int64_t, bool after_training, double loss) {
    std::fprintf(out_, "%s\n", megatron_validation_lines(evaluation_site(split, iteration, after_training), loss).c_str());
    written();
}

void ConsoleSink::message(const std::string & line) {
    std::fprintf(out_, "%s\n", line.c_str());
    written();
}

// ---- JsonLinesSink

JsonLinesSink::JsonLinesSink(const std::string & path) : path_(path) {
    // A symbolic link put in place after the flags were checked is refused, not written through.
    file_ = open_for_writing(path);
    LOOM_CHECK(file_ != nullptr, "cannot open --log-file '" << path_ << "' for writing: "
                                                             << (errno == ELOOP ? "it is a symbolic link" : std::strerror(errno)),
               "give the path of a file in a folder that exists and is writable");
}

JsonLinesSink::~JsonLinesSink() { std::fclose(file_); }

void JsonLinesSink::iteration(const IterationReport & r) {
    if (!r.window) return;
    std::fprintf(file_, "%s\n", metrics_json(*r.window).c_str());
    check_written(file_, "--log-file '" + path_ + "'", "check the free space of its file system");
}

// ---- TensorBoardSink

TensorBoardSink::TensorBoardSink(const TrainOptions & options, int world_size, Device & device)
    : options_(options), board_(options.tensorboard_dir), world_size_(world_size), device_(device) {}

void TensorBoardSink::iteration(const IterationReport & r) {
    const IterationStats & stats = *r.stats;
    const int64_t          k     = r.iteration;
    if (k % options_.tensorboard_log_interval == 0) {
        // Megatron's training_log: each scalar by iteration and "vs samples".
        auto both = [&](const std::string & tag, double value) {
            board_.add_scalar(tag, value, k);
            board_.add_scalar(tag + " vs samples", value, stats.consumed_samples);
        };
        both("learning-rate", stats.learning_rate);
        both("batch-size", static_cast<double>(stats.global_batch_size));
        both("lm loss", r.loss);
        if (options_.log_loss_scale_to_tensorboard) both("loss-scale", stats.loss_scale);
        if (options_.log_world_size_to_tensorboard) both("world-size", static_cast<double>(world_size_));
        both("grad-norm", stats.grad_norm);
        for (const auto & [name, value] : stats.tracked_losses) board_.add_scalar(name, value, k);   // the MoE tracker's
        for (const auto & [tag, value] : stats.moe_layer_losses) board_.add_scalar(tag, value, k);
        if (stats.num_zeros >= 0) both("num-zeros", stats.num_zeros);
        if (stats.params_norm >= 0) both("params-norm", stats.params_norm);
        if (options_.log_memory_to_tensorboard) {
            const AllocatorStats m = device_.allocator(MemoryKind::device).stats();
            board_.add_scalar("mem-reserved-bytes", static_cast<double>(m.reserved), k);
            board_.add_scalar("mem-allocated-bytes", static_cast<double>(m.allocated), k);
            board_.add_scalar("mem-max-allocated-bytes", static_cast<double>(m.peak_allocated), k);
            board_.add_scalar("mem-allocated-count", static_cast<double>(m.active), k);
        }
    }
    if (r.window) {
        if (options_.log_timers_to_tensorboard) board_.add_scalar("iteration-time", r.window->elapsed_ms / 1000.0, k);
        if (options_.log_throughput) board_.add_scalar("throughput", r.window->tflops, k);
    }
}

void TensorBoardSink::evaluation(EvalSplit split, int64_t iteration, int64_t consumed, bool, double loss) {
    if (split != EvalSplit::validation) return;   // Megatron writes the test split's loss to the console only
    board_.add_scalar("lm loss validation", loss, iteration);
    board_.add_scalar("lm loss validation vs samples", loss, consumed);
    if (options_.log_validation_ppl_to_tensorboard) {
        const double ppl = std::exp(std::min(loss, 20.0));
        board_.add_scalar("lm loss validation ppl", ppl, iteration);
        board_.add_scalar("lm loss validation ppl vs samples", ppl, consumed);
    }
}

std::vector<std::unique_ptr<ReportSink>> make_report_sinks(const TrainOptions & options, FILE * out, int rank,
                                                           int world_size, Device & device) {
    std::vector<std::unique_ptr<ReportSink>> sinks;
    if (out) sinks.push_back(std::make_unique<ConsoleSink>(out, options, isatty(fileno(out)) != 0));
    if (rank != 0) return sinks;   // one writer of each file: rank 0
    if (!options.tensorboard_dir.empty()) sinks.push_back(std::make_unique<TensorBoardSink>(options, world_size, device));
    if (!options.log_file.empty()) sinks.push_back(std::make_unique<JsonLinesSink>(options.log_file));
    return sinks;
}

}  // namespace loom::train
