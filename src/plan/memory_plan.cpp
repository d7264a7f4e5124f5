#include "plan/memory_plan.h"

#include "core/error.h"
#include "parallel/process_groups.h"
#include "plan/meta_device.h"
#include "train/data_source.h"
#include "train/setup.h"
#include "train/trainer.h"

namespace loom::plan {

namespace {

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
    once.train_iters         = 1;
    once.log_interval        = 1000000;
    once.save.clear();
    once.load.clear();
    once.tensorboard_dir.clear();
    once.eval_interval = 0;
    once.eval_iters    = 0;
    return once;
}

int64_t RankMemory::device_total() const {
    int64_t total = 0;
    for (const auto & [pool, bytes] : device) total += bytes;
    return total;
}

RankMemory plan_rank_memory(const train::TrainOptions & options, int world_size, int rank) {
    LOOM_CHECK(rank >= 0 && rank < world_size, "rank " << rank << " of a plan for " << world_size << " ranks", "");
    MetaDevice              device;
    MetaCommunicatorFactory factory(world_size, rank);
    RankMemory              plan;
    plan.rank = rank;
    {
        const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
            options.parallel, factory, options.ddp.num_distributed_optimizer_instances, options.hierarchical_cp_sizes);
        train::Setup setup = train::setup(options, groups, device, /*init_values=*/false);
        plan.device      = pools_of(device.allocator(MemoryKind::device));
        plan.pinned      = pools_of(device.allocator(MemoryKind::pinned_host));
        plan.device_peak = device.allocator(MemoryKind::device).stats().peak_allocated;
        // One iteration of the schedule, for the activations' peak.
        if (options.model.moe.enabled()) return plan;
        plan.iteration_planned   = true;
        train::TrainOptions once = one_iteration(options);
        std::unique_ptr<train::BatchSource> data = train::context_parallel_part(
            train::make_batch_source(once, device, true, groups.dp ? groups.dp->rank() : 0, once.parallel.dp()),
            groups.cp ? groups.cp->rank() : 0, once.parallel.cp());
        Allocator &   memory = device.allocator(MemoryKind::device);
        const int64_t states = memory.stats().allocated;
        memory.reset_peak();
        {
            train::Trainer trainer(once, setup, *data);
            trainer.run(nullptr);
        }
        plan.activations_peak = memory.pool_stats(kActivationsPool).peak_allocated;
        plan.iteration_peak   = memory.stats().peak_allocated - states;
    }
    return plan;
}

}  // namespace loom::plan
