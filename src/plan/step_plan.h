// `loom plan`'s step time: the stages of a layout put together.
//
// plan_rank_memory, with a CostModel, runs one rank's iteration on the meta device and gives its schedule's
// ops at their modelled times, alone (its neighbours are never late). A step plan runs one rank of each
// pipeline stage (rank 0's pipeline group: the other data-, tensor- and context-parallel ranks of a stage
// run the same schedule on the same shapes), then simulates the schedule across the stages with each op at
// its stage's modelled duration and each transfer at its modelled cost (pipeline/timeline.h): the waits
// of the real schedule, its bubble, appear there. The step is the slowest stage's
//
//   step = head + end of its last op in the simulated schedule + tail
//
// where head and tail are its own work before and after the schedule (gradient reduction left exposed,
// the optimizer, parameter gathers). FLOPs are Megatron's count for one global batch
// (GptConfig::training_flops_per_token); under full recompute the recomputed forward of the recomputed
// layers is counted too, as Megatron's papers count it.
#pragma once

#include "pipeline/timeline.h"
#include "plan/cost_model.h"
#include "plan/memory_plan.h"
#include "train/options.h"

#include <vector>

namespace loom::plan {

struct StepPlan {
    std::vector<RankMemory> stages;        // one rank per pipeline stage, in stage order, with its time
    pipeline::Timeline      timeline;      // the schedule across the stages, ms
    double                  step_s          = 0;
    int                     slowest_stage   = 0;
    double                  model_flops     = 0;   // one global batch, Megatron's count (recompute included)
    double                  tflops_per_gpu  = 0;
    double                  mfu             = 0;   // of the GPU's dense 16-bit (or TF32) peak
};

// Megatron's FLOPs for one global batch of `options` (with the recomputed forward under full recompute).
double megatron_flops(const train::TrainOptions & options);

// MoE layers are timed with balanced routing (plan/meta_device.h).
//
// With `sampled`, the stages run only M' = min(M, 2 PP) micro-batches on the meta device, enough for the
// schedule's steady state and its peak in flight (at most PP for 1F1B and under 2 PP interleaved: the same
// memory peaks), and the schedule of all M micro-batches is simulated with their durations: the first
// M'/2 micro-batches' ops time the first ones, the last M' - M'/2 the last, and the middle ones repeat the
// steady state's. A layout search plans that way; test_plan_time holds it to the whole plan.
StepPlan plan_step(const train::TrainOptions & options, int world_size, const CostModel & costs, bool sampled = false);

}  // namespace loom::plan
