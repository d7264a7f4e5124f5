#include "plan/memory_plan.h"

#include "core/error.h"
#include "parallel/process_groups.h"
#include "plan/meta_device.h"
#include "train/setup.h"

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
        const train::Setup setup = train::setup(options, groups, device, /*init_values=*/false);
        plan.device      = pools_of(device.allocator(MemoryKind::device));
        plan.pinned      = pools_of(device.allocator(MemoryKind::pinned_host));
        plan.device_peak = device.allocator(MemoryKind::device).stats().peak_allocated;
    }
    return plan;
}

}  // namespace loom::plan
