// What a training run reports, and where it goes. The trainer produces events (an iteration ended, a log
// window closed, an evaluation finished, a message for the console); each sink writes the ones it keeps:
//   ConsoleSink      Megatron's log line, the timers block, validation lines, the progress bar on a terminal
//   JsonLinesSink    --log-file: one JSON object per log line
//   TensorBoardSink  --tensorboard-dir: Megatron's training_log scalars, by iteration and "vs samples"
// make_report_sinks() builds the ones the options ask for (the files on rank 0 only). The trainer never
// formats output itself; a new destination is a new sink. A sink whose stream fails throws OutputError
// (core/atomic_file.h): the trainer drops it, stops the run at the next log iteration on every rank, saves
// if --save is given, and ends with exit status 1 naming the stream.
#pragma once

#include "core/atomic_file.h"
#include "train/options.h"
#include "train/tensorboard.h"

#include <cstdint>
#include <cstdio>
#include <memory>
#include <optional>
#include <string>
#include <utility>
#include <vector>

namespace loom::train {

struct IterationStats {
    int64_t iteration         = 0;
    int64_t consumed_samples  = 0;
    double  elapsed_ms        = 0;   // mean over the log interval
    double  tflops            = 0;   // achieved, per rank
    double  learning_rate     = 0;
    int64_t global_batch_size = 0;
    double  lm_loss           = 0;   // mean over the log interval
    // The other keys of Megatron's total_loss_dict, in its order, each a mean over the log interval:
    //  - MoE: the tracked router losses, each the mean over MoE layers of its per-micro-batch mean, by name
    //    ("load_balancing_loss", "seq_load_balancing_loss", "z_loss");
    //  - MTP: "mtp_<k> loss", depth k's per-micro-batch mean cross-entropy, averaged over micro-batches.
    std::vector<std::pair<std::string, double>> tracked_losses;
    // --moe-per-layer-logging: Megatron's per-layer tags ("moe/load_balancing_loss_layer_3"), each layer's
    // per-micro-batch mean of this iteration (0 for a dense layer); TensorBoard only.
    std::vector<std::pair<std::string, double>> moe_layer_losses;
    double  loss_scale        = 1.0;
    double  grad_norm         = 0;
    double  num_zeros         = -1;   // --log-num-zeros-in-grad (< 0: not logged)
    double  params_norm       = -1;   // --log-params-norm (< 0: not logged)
    int64_t skipped_iterations = 0;
    int64_t nan_iterations     = 0;
};

// Megatron's log line: " [time] iteration  k/ N | consumed samples: ... | number of nan iterations:   0 |".
std::string megatron_log_line(const IterationStats & stats, int64_t train_iters, bool with_throughput);
// Megatron's validation report: a line of dashes, " validation loss at <where> | lm loss value: 6.081085E+00 |
// lm loss PPL: 4.374914E+02 | ", the dashes again (PPL = exp(min(loss, 20))).
std::string megatron_validation_lines(const std::string & where, double loss);
// The same keys as one JSON object (one line of --log-file).
std::string metrics_json(const IterationStats & stats);

// The iterations since the last log line: their losses and MoE losses summed, and when the window began.
class LogWindow {
public:
    explicit LogWindow(double start_seconds) : start_(start_seconds) {}
    void    add(double loss, const IterationStats & stats);
    int64_t iterations() const { return iterations_; }
    // The window's means in `last` (this iteration's stats), its time per iteration and throughput from
    // `flops_per_iteration`; then a new window starts at `now_seconds`.
    IterationStats close(IterationStats last, double now_seconds, double flops_per_iteration);

private:
    double                                      start_;
    double                                      loss_ = 0;
    int64_t                                     iterations_ = 0;
    std::vector<std::pair<std::string, double>> moe_;
};

// One iteration as the sinks see it.
struct IterationReport {
    int64_t                iteration = 0;
    double                 loss      = 0;   // this iteration's lm loss
    const IterationStats * stats     = nullptr;   // this iteration's
    // At a log line (every --log-interval and the last iteration): the window's means and, with
    // --timing-log-level, Megatron's timers block; else null and empty.
    const IterationStats * window    = nullptr;
    std::string            timers;
    // For the progress bar: the first iteration of this run and the seconds since it started.
    int64_t                first_iteration = 1;
    double                 seconds         = 0;
};

enum class EvalSplit { validation, test };

class ReportSink {
public:
    virtual ~ReportSink() = default;
    virtual void iteration(const IterationReport & report) = 0;
    // An evaluation after `iteration` (at --eval-interval, or `after_training`), `consumed` samples in.
    virtual void evaluation(EvalSplit split, int64_t iteration, int64_t consumed, bool after_training, double loss) = 0;
    // A line for whoever reads the run as it goes (checkpoint loads and saves, the reason for stopping).
    virtual void message(const std::string & line) { (void)line; }
    virtual void flush() {}
};

class ConsoleSink : public ReportSink {
public:
    // `progress_bar`: between log lines, redraw a bar in place (`out` is a terminal).
    ConsoleSink(FILE * out, const TrainOptions & options, bool progress_bar);
    void iteration(const IterationReport & report) override;
    void evaluation(EvalSplit split, int64_t iteration, int64_t consumed, bool after_training, double loss) override;
    void message(const std::string & line) override;

private:
    void written();   // flushes; throws OutputError when the stream failed

    FILE *               out_;
    const TrainOptions & options_;
    bool                 progress_bar_;
};

class JsonLinesSink : public ReportSink {
public:
    explicit JsonLinesSink(const std::string & path);   // refuses a file it cannot open, naming --log-file
    ~JsonLinesSink() override;
    void iteration(const IterationReport & report) override;
    void evaluation(EvalSplit, int64_t, int64_t, bool, double) override {}

private:
    std::string path_;
    FILE *      file_ = nullptr;
};

class TensorBoardSink : public ReportSink {
public:
    // `world_size`: logged with --log-world-size-to-tensorboard; `device`: the allocator whose statistics
    // --log-memory-to-tensorboard logs.
    TensorBoardSink(const TrainOptions & options, int world_size, Device & device);
    void iteration(const IterationReport & report) override;
    void evaluation(EvalSplit split, int64_t iteration, int64_t consumed, bool after_training, double loss) override;
    void flush() override { board_.flush(); }

private:
    const TrainOptions & options_;
    TensorBoardWriter    board_;
    int                  world_size_;
    Device &             device_;
};

// The sinks `options` asks for: the console (with `out`), and on rank 0 the --log-file and
// --tensorboard-dir writers.
std::vector<std::unique_ptr<ReportSink>> make_report_sinks(const TrainOptions & options, FILE * out, int rank,
                                                           int world_size, Device & device);

}  // namespace loom::train
