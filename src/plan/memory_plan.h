// `loom plan`'s memory per rank: what train::setup allocates for one rank of a layout (its pipeline stage's
// model chunks, DDP's buffers and buckets, the optimizer's state, on the device and in pinned host memory),
// built by that same code on the meta device (plan/meta_device.h) and read from the allocators' books, pool
// by pool. Nothing is estimated: the real run's allocator holds the same bytes per pool once it has set up
// (tests/test_plan_mpi.cpp asserts it for a grid of layouts), whatever the model's size, since the meta
// device reserves address space it never touches.
#pragma once

#include "pipeline/timeline.h"
#include "plan/cost_model.h"
#include "plan/meta_device.h"
#include "train/options.h"

#include <cstdint>
#include <map>
#include <optional>
#include <string>
#include <vector>

namespace loom::plan {

// One rank's iteration on the meta device with a CostModel: its schedule's ops at their modelled times, and
// what it does before and after them. Alone, as if its pipeline neighbours were never late (plan_step puts
// the stages together).
struct RankTime {
    pipeline::ScheduleOptions          schedule;
    std::vector<pipeline::TimelineOp>  ops;              // in schedule order, ms since the schedule began
    double                             head_s     = 0;   // from the iteration's start to the schedule's
    double                             tail_s     = 0;   // from its last op's end to the iteration's last work:
                                                         // exposed gradient reduction, optimizer, gathers
    double                             transfer_s = 0;   // one stage output (or its gradient) to a neighbour
    double                             iteration_s = 0;  // head, schedule and tail, alone
    std::map<std::string, OpTotal>     totals;           // the iteration's ops and collectives by name
};

struct RankMemory {
    int                            rank = 0;
    std::vector<int>               pipeline_ranks;   // its pipeline group's members in stage order (itself alone
                                                     // without pipelining)
    std::map<std::string, int64_t> device;   // pool -> bytes held after set-up ("weights", "grads", "optimizer", ...)
    std::map<std::string, int64_t> pinned;   // pinned host memory by pool (the offloaded optimizer's staging)
    int64_t                        device_peak = 0;   // the most set-up held at once (before DDP re-points the
                                                      // model's first gradients at its buffers)
    // One iteration (not planned with `iteration` false). MoE layers route round-robin on the meta device
    // (balanced: plan/meta_device.h), the load a working balancer aims for; a real run's routing follows its
    // data, so its expert inputs differ unless they are padded to capacity.
    bool                           iteration_planned = false;
    int64_t                        activations_peak = 0;   // the "activations" pool's peak over one iteration
    int64_t                        iteration_peak   = 0;   // the most every pool held at once in that iteration,
                                                           // above what set-up and the data source hold
    std::optional<RankTime>        time;   // with a CostModel, where the iteration is planned

    int64_t device_total() const;
    // The most the device holds at once: device_total() plus the iteration's peak above it (device_total()
    // alone where the iteration is not planned).
    int64_t device_peak_total() const { return device_total() + (iteration_planned ? iteration_peak : 0); }
};

// `options` for the one iteration a plan runs: no checkpoint saved or loaded, no evaluation, no log line.
// With layer graphs (--cuda-graph-impl transformer_engine), the warm-up iterations before it too: the peaks
// are then those of the first iteration that replays the graphs, with their pools held.
train::TrainOptions one_iteration(const train::TrainOptions & options);

// The memory rank `rank` of `world_size` ranks holds once `options` are set up, and at the peak of one
// iteration (the Trainer's, run on the meta device). `options` are resolved for that world size
// (train::TrainOptionParser::plan_only).
// With `costs`, the iteration also keeps modelled time (RankMemory::time). Without `iteration`, only set-up
// is planned (what the rank holds between iterations): a layout search's first, cheap cut.
RankMemory plan_rank_memory(const train::TrainOptions & options, int world_size, int rank,
                            const CostModel * costs = nullptr, bool iteration = true);

}  // namespace loom::plan
