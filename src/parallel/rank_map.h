// The rank map: every group of both generators and each rank's coordinates, as `loom ranks` prints it
// and as every training job prints it at start-up (users ask which ranks share data: the data sampler
// splits the global batch over dp, without cp; cp ranks of one dp rank see the same samples).
#pragma once

#include "parallel/parallel_config.h"

#include <nlohmann/json.hpp>

#include <ostream>

namespace loom::parallel {

// {"world_size", "tp", "cp", "pp", "dp", "ep", "etp", "edp", "order", "dense": {...}, "expert": {...}}
nlohmann::ordered_json rank_map_json(const ParallelConfig & config);

// A table of every group kind, then one line per global rank with its coordinates.
void print_rank_map(std::ostream & os, const ParallelConfig & config);

}  // namespace loom::parallel
