#include "parallel/process_groups.h"

#include "core/error.h"

namespace loom::parallel {

std::vector<GroupKind> group_kinds(const ParallelConfig & config) {
    const RankGenerator & d = config.dense();
    const RankGenerator & e = config.expert();
    return {
        {"tp", false, d.get_ranks("tp")},
        {"cp", false, d.get_ranks("cp")},
        {"dp", false, d.get_ranks("dp")},
        {"pp", false, d.get_ranks("pp")},
        {"dp-cp", false, d.get_ranks("dp-cp")},
        {"tp-pp", false, d.get_ranks("tp-pp")},
        {"tp-cp", false, d.get_ranks("tp-cp")},
        {"tp-dp-cp", false, d.get_ranks("tp-dp-cp")},
        {"tp-dp", false, d.get_ranks("tp-dp")},
        {"embedding", false, config.embedding_groups()},
        {"position-embedding", false, config.position_embedding_groups()},
        {"ep", true, e.get_ranks("ep")},
        {"tp", true, e.get_ranks("tp")},
        {"dp", true, e.get_ranks("dp")},
        {"tp-ep", true, e.get_ranks("tp-ep")},
        {"tp-ep-pp", true, e.get_ranks("tp-ep-pp")},
        {"pp", true, e.get_ranks("pp")},
    };
}

namespace {

using Member = ProcessGroups::CommPtr ProcessGroups::*;

// Where each group kind lives in the bundle; the expert pp groups are the dense pp groups.
Member member_of(const std::string & kind, bool expert) {
    struct Entry { const char * name; bool expert; Member member; };
    static const Entry entries[] = {
        {"tp", false, &ProcessGroups::tp},
        {"cp", false, &ProcessGroups::cp},
        {"dp", false, &ProcessGroups::dp},
        {"pp", false, &ProcessGroups::pp},
        {"dp-cp", false, &ProcessGroups::dp_cp},
        {"tp-pp", false, &ProcessGroups::tp_pp},
        {"tp-cp", false, &ProcessGroups::tp_cp},
        {"tp-dp-cp", false, &ProcessGroups::tp_dp_cp},
        {"tp-dp", false, &ProcessGroups::tp_dp},
        {"embedding", false, &ProcessGroups::embedding},
        {"position-embedding", false, &ProcessGroups::position_embedding},
        {"ep", true, &ProcessGroups::expert_ep},
        {"tp", true, &ProcessGroups::expert_tp},
        {"dp", true, &ProcessGroups::expert_dp},
        {"tp-ep", true, &ProcessGroups::expert_tp_ep},
        {"tp-ep-pp", true, &ProcessGroups::expert_tp_ep_pp},
        {"pp", true, &ProcessGroups::pp},
    };
    for (const Entry & e : entries) {
        if (e.expert == expert && kind == e.name) {
            return e.member;
        }
    }
    LOOM_THROW("unknown " << (expert ? "expert " : "") << "group kind '" << kind << "'",
               "dense kinds: tp cp dp pp dp-cp tp-pp tp-cp tp-dp-cp tp-dp embedding position-embedding; "
               "expert kinds: ep tp dp tp-ep tp-ep-pp pp");
}

}  // namespace

namespace {

// Each group cut into `parts` runs of consecutive ranks (intra), and the ranks at the same place of every
// run (inter).
std::pair<RankGroups, RankGroups> instance_groups(const RankGroups & groups, int64_t parts) {
    RankGroups intra, inter;
    for (const std::vector<int> & group : groups) {
        const size_t run = group.size() / static_cast<size_t>(parts);
        for (int64_t i = 0; i < parts; ++i) {
            intra.emplace_back(group.begin() + static_cast<std::ptrdiff_t>(i * run),
                               group.begin() + static_cast<std::ptrdiff_t>((i + 1) * run));
        }
        for (size_t j = 0; j < run; ++j) {
            std::vector<int> across;
            for (int64_t i = 0; i < parts; ++i) across.push_back(group[static_cast<size_t>(i) * run + j]);
            inter.push_back(std::move(across));
        }
    }
    return {intra, inter};
}

}  // namespace

ProcessGroups ProcessGroups::create(const ParallelConfig & config, comm::CommunicatorFactory & factory,
                                    int64_t dist_opt_instances, const std::vector<int64_t> & hierarchical_cp) {
    CommPtr world = factory.world();
    LOOM_CHECK(world->size() == config.world_size(),
               "the parallel configuration is for a world of " << config.world_size() << " ranks, but "
                   << world->size() << " were launched",
               "launch " << config.world_size() << " ranks (mpirun -np " << config.world_size()
                         << "), or change the parallel sizes");
    // Megatron's checks of the instances (parallel_state.py), before any split.
    LOOM_CHECK(dist_opt_instances >= 1 && config.dp() * config.cp() % dist_opt_instances == 0,
               "Data parallel size should be divisible by partial DistOpt shard factor: data-parallel size "
                   << config.dp() << (config.cp() > 1 ? " x context-parallel size " + std::to_string(config.cp()) : "")
                   << ", --num-distributed-optimizer-instances " << dist_opt_instances, "");
    LOOM_CHECK(config.edp() % dist_opt_instances == 0,
               "Expert data parallel size should be divisible by partial DistOpt shard factor: expert data-parallel "
               "size " << config.edp() << ", --num-distributed-optimizer-instances " << dist_opt_instances, "");
    LOOM_CHECK(hierarchical_cp.empty() ||
                   (hierarchical_cp.size() == 2 && hierarchical_cp[0] >= 1 && hierarchical_cp[1] >= 1 &&
                    hierarchical_cp[0] * hierarchical_cp[1] == config.cp()),
               "--hierarchical-context-parallel-sizes of " << hierarchical_cp.size() << " sizes for a2a+p2p over --context-parallel-size "
                                                           << config.cp(),
               "give two sizes, the all-to-all's and the ring's, whose product is the context-parallel size");
    ProcessGroups groups;
    groups.world = world;
    // Every rank walks the same kinds in the same order: the splits are collective over the world.
    for (const GroupKind & kind : group_kinds(config)) {
        if (kind.expert && kind.name == "pp") {
            continue;   // the dense pp communicator serves (the config checked the groups are equal)
        }
        groups.*member_of(kind.name, kind.expert) =
            factory.split(kind.groups, (kind.expert ? "expert-" : "") + kind.name);
    }
    // The pipeline's channels: one split per channel position, holding that pair of every pipeline group (they
    // are disjoint because the pipeline groups are), in the same order on every rank.
    const RankGroups pp_groups = config.dense().get_ranks("pp");
    const int        pp        = config.pp();
    auto             add       = [&](int src, int dst, bool gradient) {
        RankGroups pairs;
        for (const std::vector<int> & group : pp_groups) pairs.push_back({group[src], group[dst]});
        const std::string name = std::string(gradient ? "pp-gradients-" : "pp-activations-") + std::to_string(src) +
                                 "-" + std::to_string(dst);
        if (CommPtr comm = factory.split(pairs, name)) {
            groups.pp_channels.channels.push_back(PipelineChannel{src, dst, gradient, std::move(comm)});
        }
    };
    if (pp > 1) {
        for (int r = 0; r < pp; ++r) {
            add(r, (r + 1) % pp, false);
            add((r + 1) % pp, r, true);
        }
    }
    if (!hierarchical_cp.empty()) {
        const auto [inner, outer] = instance_groups(config.dense().get_ranks("cp"), hierarchical_cp[1]);
        groups.cp_inner           = factory.split(inner, "cp-inner");
        groups.cp_outer           = factory.split(outer, "cp-outer");
    }
    if (dist_opt_instances > 1) {
        // Megatron's instances split the data- and context-parallel ranks, which reduce the gradients together.
        const auto [intra, inter] = instance_groups(config.dense().get_ranks(config.cp() > 1 ? "dp-cp" : "dp"),
                                                    dist_opt_instances);
        groups.intra_dp           = factory.split(intra, "intra-dp");
        groups.inter_dp           = factory.split(inter, "inter-dp");
        const auto [expert_intra, expert_inter] = instance_groups(config.expert().get_ranks("dp"), dist_opt_instances);
        groups.intra_expert_dp = factory.split(expert_intra, "expert-intra-dp");
        groups.inter_expert_dp = factory.split(expert_inter, "expert-inter-dp");
    }
    return groups;
}

std::shared_ptr<comm::Communicator> PipelineChannels::find(int src, int dst, bool gradient) const {
    for (const PipelineChannel & channel : channels) {
        if (channel.src == src && channel.dst == dst && channel.gradient == gradient) return channel.comm;
    }
    return nullptr;
}

ProcessGroups::CommPtr ProcessGroups::by_name(const std::string & kind, bool expert) const {
    return this->*member_of(kind, expert);
}

}  // namespace loom::parallel
