#include "plan/memory_plan.h"

#include "core/error.h"
#include "data/token_dataset.h"
#include "parallel/process_groups.h"
#include "plan/meta_device.h"
#include "train/data_source.h"
#include "train/setup.h"
#include "train/trainer.h"

namespace loom::plan {

namespace {

// Samples of the right length and no content (token 0): a plan's micro-batches have the run's shapes, and
// the meta device reads no values, so neither the flags' data files nor a synthetic chain are needed.
class ShapeOnlyDataset final : public data::TokenDataset {
public:
    ShapeOnlyDataset(int64_t vocab, int64_t seq) : vocab_(vocab), seq_(seq) {}
    int64_t     num_samples() const override { return int64_t{1} << 40; }
    int64_t     vocab_size() const override { return vocab_; }
    int64_t     seq_length() const override { return seq_; }
    std::string describe() const override { return "shapes only (loom plan)"; }
    void        sample(int64_t, std::span<int32_t> out) const override { std::fill(out.begin(), out.end(), 0); }

private:
    int64_t vocab_, seq_;
};

std::map<std::string, int64_t> pools_of(const Allocator & allocator) {
    std::map<std::string, int64_t> bytes;
    for (const std::string & pool : allocator.pool_names()) {
        const int64_t held = allocator.pool_stats(pool).allocated;
        if (held > 0) bytes[pool] = held;
    }
    return bytes;
}

}  // namespace

train::TrainOptions one_iteration(const train::TrainOptions & options) {
    train::TrainOptions once = options;
    // With layer graphs, the eager warm-up iterations and the first that replays the graphs captured
    // before it: the graphs' pools are allocated then, and held after.
    once.train_iters         = options.layer_graphs ? options.cuda_graph_warmup_steps + 1 : 1;
    once.log_interval        = 1000000;
    once.save.clear();
    once.load.clear();
    once.tensorboard_dir.clear();
    once.timeline_file.clear();
    // The meta device's values mean nothing: a loss or norm it reads back must neither stop nor repeat the
    // iteration.
    once.rerun_mode                     = "disabled";
    once.error_injection_rate           = 0;
    once.check_for_nan_in_loss_and_grad = false;
    once.eval_interval = 0;
    once.eval_iters    = 0;
    return once;
}

int64_t RankMemory::device_total() const {
    int64_t total = 0;
    for (const auto & [pool, bytes] : device) total += bytes;
    return total;
}

RankMemory plan_rank_memory(const train::TrainOptions & options, int world_size, int rank, const CostModel * costs,
                            bool iteration) {
    LOOM_CHECK(rank >= 0 && rank < world_size, "rank " << rank << " of a plan for " << world_size << " ranks", "");
    MetaDevice              device(costs);
    MetaCommunicatorFactory factory(world_size, rank, &device.clock());
    RankMemory              plan;
    plan.rank = rank;
    {
        const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
            options.parallel, factory, options.ddp.num_distributed_optimizer_instances, options.hierarchical_cp_sizes);
        plan.pipeline_ranks = groups.pp ? groups.pp->global_ranks() : std::vector<int>{rank};
        train::Setup setup  = train::setup(options, groups, device, /*init_values=*/false);
        plan.device      = pools_of(device.allocator(MemoryKind::device));
        plan.pinned      = pools_of(device.allocator(MemoryKind::pinned_host));
        plan.device_peak = device.allocator(MemoryKind::device).stats().peak_allocated;
        // One iteration of the schedule, for the activations' peak.
        if (!iteration) return plan;
        plan.iteration_planned   = true;
        train::TrainOptions once = one_iteration(options);
        // A timed plan runs eagerly: the meta device's graphs record nothing to replay, so a replayed layer
        // would cost nothing (graphs save launches, which the roofline charges per kernel either way).
        if (costs) {
            once.layer_graphs = false;
            once.train_iters  = 1;
        }
        std::unique_ptr<train::BatchSource> data = train::context_parallel_part(
            train::loader_source(std::make_unique<ShapeOnlyDataset>(once.model.vocab_size, once.model.seq_length),
                                 once.micro_batch_size, groups.dp ? groups.dp->rank() : 0, once.parallel.dp(), device),
            groups.cp ? groups.cp->rank() : 0, once.parallel.cp(), once.model.mtp_num_layers);
        Allocator &   memory = device.allocator(MemoryKind::device);
        const int64_t states = memory.stats().allocated;
        memory.reset_peak();
        {
            train::Trainer trainer(once, setup, *data);
            MetaClock &    clock = device.clock();
            const double   start = std::max(clock.host, clock.horizon);
            clock.totals.clear();
            trainer.run(nullptr);
            if (costs) {
                const pipeline::PipelineExecutor::Result & schedule = trainer.last_schedule();
                RankTime                                   time;
                time.schedule    = trainer.schedule();
                time.ops         = schedule.ops;
                time.totals      = clock.totals;
                const double end = std::max(clock.host, clock.horizon);
                const double begin = schedule.modelled_begin_s.value_or(start);
                const double last  = schedule.ops.empty() ? 0.0 : schedule.ops.back().end / 1e3;
                time.head_s      = begin - start;
                time.tail_s      = end - (begin + last);
                time.iteration_s = end - start;
                if (auto recv = time.totals.find("recv"); recv != time.totals.end() && recv->second.calls > 0) {
                    time.transfer_s = recv->second.seconds / static_cast<double>(recv->second.calls);
                }
                plan.time = std::move(time);
            }
        }
        plan.activations_peak = memory.pool_stats(kActivationsPool).peak_allocated;
        plan.iteration_peak   = memory.stats().peak_allocated - states;
    }
    return plan;
}

}  // namespace loom::plan
