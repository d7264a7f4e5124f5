// `loom plan --search`: every layout of a model on a cluster, the ones that fit ranked by predicted step time.
//
// A layout is TP x PP x CP (x DP, the rest of the world), virtual stages, the micro-batch size and full
// recompute or none; the search always shards the optimizer (--use-distributed-optimizer, both overlaps) and
// runs sequence parallelism with TP, its collectives overlapped with the GEMMs (--tp-comm-overlap), as Megatron's
// large runs do. The candidates are enumerated within
// Megatron's rules (TP within a node and dividing the heads and query groups, PP dividing the layers, the
// micro-batches filling the global batch), then cut in three steps, cheapest first, per family (TP, PP, CP):
//
//   1. set-up only, rank 0: if the weights, gradients and optimizer state alone exceed the GPU's usable
//      memory, no variant of the family fits;
//   2. the family's smallest variant (micro-batch 1, full recompute, no virtual stages), planned whole: if
//      its peak does not fit, none of the family's does;
//   3. the other variants, planned whole (plan_step: memory and time of every stage), without recompute
//      first (recompute is planned only where that does not fit: it adds work and saves memory) and in
//      growing micro-batches until one does not fit (a larger one only adds memory).
//
// Every rejected family keeps the reason, in words, with the numbers.
#pragma once

#include "plan/cost_model.h"
#include "train/options.h"

#include <functional>
#include <optional>
#include <string>
#include <vector>

namespace loom::plan {

struct Layout {
    int                tp = 1, pp = 1, cp = 1;
    std::optional<int> vpp;
    int64_t            micro_batch    = 1;
    bool               full_recompute = false;

    // Megatron's flags for it ("--tensor-model-parallel-size", "8", ...).
    std::vector<std::string> flags() const;
    std::string              describe(int world_size) const;   // "TP 8, PP 2, CP 1, DP 4, micro-batch 1, ..."
};

struct Candidate {
    Layout  layout;
    double  step_s = 0, tflops_per_gpu = 0, mfu = 0, bubble = 0;
    int64_t peak_bytes = 0;   // the most loaded stage's
};

struct RejectedFamily {
    std::string family;   // "TP 1, PP 1, CP 1"
    std::string why;
};

struct SearchResult {
    std::vector<Candidate>      fitting;    // fastest first
    std::vector<RejectedFamily> rejected;
    int                         planned = 0;   // whole plans run
    int                         enumerated = 0;
};

// `options_for` gives the resolved options of a layout (the user's flags with the layout's), throwing
// loom::Error where they are invalid. `base` is any of them (the model and the batch are read from it).
SearchResult search_layouts(const train::TrainOptions & base, int world_size, const CostModel & costs,
                            const std::function<train::TrainOptions(const Layout &)> & options_for);

// The flags a search chooses itself; a user who gives one is told to leave it out.
const std::vector<std::string> & searched_flags();

}  // namespace loom::plan
