#include "parallel/rank_map.h"

#include "parallel/process_groups.h"

#include <iomanip>
#include <sstream>

namespace loom::parallel {

nlohmann::ordered_json rank_map_json(const ParallelConfig & config) {
    nlohmann::ordered_json out;
    out["world_size"] = config.world_size();
    out["tp"]         = config.tp();
    out["cp"]         = config.cp();
    out["pp"]         = config.pp();
    out["dp"]         = config.dp();
    out["ep"]         = config.ep();
    out["etp"]        = config.etp();
    out["edp"]        = config.edp();
    out["order"]      = config.order();
    out["dense"]      = nlohmann::ordered_json::object();
    out["expert"]     = nlohmann::ordered_json::object();
    for (const GroupKind & kind : group_kinds(config)) {
        out[kind.expert ? "expert" : "dense"][kind.name] = kind.groups;
    }
    return out;
}

namespace {

std::string groups_string(const RankGroups & groups) {
    std::ostringstream os;
    for (size_t g = 0; g < groups.size(); ++g) {
        os << (g ? " " : "") << "[";
        for (size_t i = 0; i < groups[g].size(); ++i) {
            os << (i ? "," : "") << groups[g][i];
        }
        os << "]";
    }
    return os.str();
}

}  // namespace

void print_rank_map(std::ostream & os, const ParallelConfig & config) {
    os << config.summary() << "\n\n";
    std::vector<GroupKind> kinds = group_kinds(config);
    for (bool expert : {false, true}) {
        os << (expert ? "expert groups (etp-ep-edp-pp)" : "dense groups (tp-cp-dp-pp)") << "\n";
        for (const GroupKind & kind : kinds) {
            if (kind.expert == expert) {
                os << "  " << std::left << std::setw(20) << kind.name << groups_string(kind.groups) << "\n";
            }
        }
        os << "\n";
    }
    const RankGenerator & d = config.dense();
    const RankGenerator & e = config.expert();
    os << "rank    tp  cp  dp  pp |  etp  ep edp  pp\n";
    for (int r = 0; r < config.world_size(); ++r) {
        os << std::right << std::setw(4) << r << "  " << std::setw(4) << d.coordinate(r, "tp") << std::setw(4)
           << d.coordinate(r, "cp") << std::setw(4) << d.coordinate(r, "dp") << std::setw(4)
           << d.coordinate(r, "pp") << " | " << std::setw(4) << e.coordinate(r, "tp") << std::setw(4)
           << e.coordinate(r, "ep") << std::setw(4) << e.coordinate(r, "dp") << std::setw(4)
           << e.coordinate(r, "pp") << "\n";
    }
    os << "\nThe data sampler splits the global batch over dp (" << config.dp()
       << " ranks); the cp ranks of one dp rank see the same samples and split the sequence.\n";
}

}  // namespace loom::parallel
