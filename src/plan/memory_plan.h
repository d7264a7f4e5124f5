// `loom plan`'s memory per rank: what train::setup allocates for one rank of a layout (its pipeline stage's
// model chunks, DDP's buffers and buckets, the optimizer's state, on the device and in pinned host memory),
// built by that same code on the meta device (plan/meta_device.h) and read from the allocators' books, pool
// by pool. Nothing is estimated: the real run's allocator holds the same bytes per pool once it has set up
// (tests/test_plan_mpi.cpp asserts it for a grid of layouts), whatever the model's size, since the meta
// device reserves address space it never touches.
#pragma once

#include "train/options.h"

#include <cstdint>
#include <map>
#include <string>
#include <vector>

namespace loom::plan {

struct RankMemory {
    int                            rank = 0;
    std::map<std::string, int64_t> device;   // pool -> bytes held after set-up ("weights", "grads", "optimizer", ...)
    std::map<std::string, int64_t> pinned;   // pinned host memory by pool (the offloaded optimizer's staging)
    int64_t                        device_peak = 0;   // the most set-up held at once (before DDP re-points the
                                                      // model's first gradients at its buffers)
    // One iteration, planned unless the model has MoE layers (they route by the data, which the meta device
    // does not compute: its logits read back as zeros).
    bool                           iteration_planned = false;
    int64_t                        activations_peak = 0;   // the "activations" pool's peak over one iteration
    int64_t                        iteration_peak   = 0;   // the most every pool held at once in that iteration,
                                                           // above what set-up and the data source hold

    int64_t device_total() const;
    // The most the device holds at once: device_total() plus the iteration's peak above it (device_total()
    // alone where the iteration is not planned).
    int64_t device_peak_total() const { return device_total() + (iteration_planned ? iteration_peak : 0); }
};

// `options` for the one iteration a plan runs: no checkpoint saved or loaded, no evaluation, no log line.
train::TrainOptions one_iteration(const train::TrainOptions & options);

// The memory rank `rank` of `world_size` ranks holds once `options` are set up, and at the peak of one
// iteration (the Trainer's, run on the meta device). `options` are resolved for that world size
// (train::TrainOptionParser::plan_only).
RankMemory plan_rank_memory(const train::TrainOptions & options, int world_size, int rank);

}  // namespace loom::plan
