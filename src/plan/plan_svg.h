// `loom plan --svg`: the plan as a picture. One horizontal bar per planned rank, its segments the pools it holds
// between iterations (weights, grads, optimizer, ...) in proportion to their bytes, then the iteration's peak above
// them, on one scale for every rank with the GPU's usable memory marked; with a timeline (--gpu), the predicted
// pipeline schedule below the bars (pipeline::timeline_svg).
#pragma once

#include "pipeline/timeline.h"
#include "plan/memory_plan.h"

#include <cstdint>
#include <string>
#include <vector>

namespace loom::plan {

// usable_bytes: the GPU's usable memory, drawn as a line (0: none, a plan without --gpu).
std::string plan_svg(const std::vector<RankMemory> & ranks, int64_t usable_bytes, const pipeline::Timeline * timeline);

}  // namespace loom::plan
