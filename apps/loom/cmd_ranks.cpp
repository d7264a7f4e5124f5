// loom ranks: the process groups of a parallel configuration, without launching anything.
//
//   loom ranks --world-size 16 --tp 4 --pp 2                 dense TP4-PP2-DP2 (docs/design/parallel_state.md 3)
//   loom ranks --world-size 16 --tp 4 --pp 2 --etp 1 --ep 4  plus MoE ETP1-EP4-EDP2-PP2
//   loom ranks ... --json                                    one JSON object, groups in reference order
#include "apps/loom/commands.h"
#include "core/error.h"
#include "parallel/parallel_config.h"
#include "parallel/rank_map.h"

#include <CLI/CLI.hpp>

#include <iostream>

namespace loom::app {

int cmd_ranks(int argc, char ** argv) {
    CLI::App app{"Print every process group of both rank generators (dense tp-cp-dp-pp and expert "
                 "etp-ep-edp-pp) and each rank's coordinates.",
                 "loom ranks"};
    parallel::ParallelSizes sizes;
    int  etp = 0;
    int  vpp = 0;
    bool json = false;
    app.add_option("--world-size,--world_size", sizes.world_size, "number of ranks")->required();
    app.add_option("--tp,--tensor-model-parallel-size", sizes.tp, "tensor-parallel size");
    app.add_option("--pp,--pipeline-model-parallel-size", sizes.pp, "pipeline-parallel size");
    app.add_option("--cp,--context-parallel-size", sizes.cp, "context-parallel size");
    app.add_option("--ep,--expert-model-parallel-size", sizes.ep, "expert-parallel size");
    app.add_option("--etp,--expert-tensor-parallel-size", etp, "tensor-parallel size inside experts (default: tp)");
    app.add_option("--vpp,--num-virtual-stages-per-pipeline-rank", vpp, "virtual pipeline stages per rank");
    app.add_option("--order", sizes.order, "axes from fastest to slowest varying")->capture_default_str();
    app.add_flag("--json", json, "print one JSON object instead of tables");

    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    // Every rank is a line (or a JSON object): past a million ranks, more than any cluster, the listing
    // would only exhaust memory.
    constexpr int kMaxRanks = 1 << 20;
    LOOM_CHECK(sizes.world_size <= kMaxRanks,
               "--world-size " << sizes.world_size << " is more ranks than `loom ranks` lists (at most " << kMaxRanks << ")",
               "the groups repeat with the world size: list a smaller world of the same layout");
    if (app.count("--etp")) {
        sizes.etp = etp;
    }
    if (app.count("--vpp")) {
        sizes.vpp = vpp;
    }

    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);   // throws: exit 2, no stdout
    if (json) {
        std::cout << parallel::rank_map_json(config).dump() << "\n";
    } else {
        parallel::print_rank_map(std::cout, config);
    }
    return 0;
}

}  // namespace loom::app
