#include "pipeline/layer_assignment.h"

#include "core/error.h"

namespace loom::pipeline {

bool operator==(const LayerRange & a, const LayerRange & b) { return a.begin == b.begin && a.end == b.end; }

std::optional<int> resolve_virtual_stages(const LayerSplitOptions & o) {
    LOOM_CHECK(o.num_layers >= 1, "--num-layers must be >= 1, got " << o.num_layers, "");
    LOOM_CHECK(o.pp >= 1, "--pipeline-model-parallel-size must be >= 1, got " << o.pp, "");
    LOOM_CHECK(!(o.vpp && o.num_layers_per_virtual_stage),
               "only one of --num-virtual-stages-per-pipeline-rank and --num-layers-per-virtual-pipeline-stage "
               "can be set",
               "drop one of them");
    std::optional<int> vpp = o.vpp;
    if (o.num_layers_per_virtual_stage) {
        const int n = *o.num_layers_per_virtual_stage;
        LOOM_CHECK(n >= 1, "--num-layers-per-virtual-pipeline-stage must be >= 1, got " << n, "");
        LOOM_CHECK(!o.first_stage_layers && !o.last_stage_layers,
                   "--num-layers-per-virtual-pipeline-stage cannot be combined with "
                   "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers",
                   "use --num-virtual-stages-per-pipeline-rank with uneven first and last stages");
        LOOM_CHECK(o.num_layers % o.pp == 0,
                   "--num-layers " << o.num_layers << " is not divisible by --pipeline-model-parallel-size " << o.pp,
                   "use a multiple of " << o.pp << " layers");
        const int per_rank = o.num_layers / o.pp;
        LOOM_CHECK(per_rank % n == 0,
                   "the " << per_rank << " layers per pipeline rank (--num-layers " << o.num_layers
                          << " / --pipeline-model-parallel-size " << o.pp
                          << ") are not divisible by --num-layers-per-virtual-pipeline-stage " << n,
                   "use a divisor of " << per_rank << " for --num-layers-per-virtual-pipeline-stage");
        vpp = per_rank / n;
    }
    if (vpp) {
        LOOM_CHECK(*vpp >= 1, "--num-virtual-stages-per-pipeline-rank must be >= 1, got " << *vpp, "");
        LOOM_CHECK(*vpp == 1 || o.pp > 1,
                   "virtual pipeline stages (" << *vpp << " per rank) need pipeline parallelism, but "
                       "--pipeline-model-parallel-size is 1",
                   "set --pipeline-model-parallel-size >= 2, or drop the virtual stages");
    }
    return vpp;
}

LayerAssignment assign_layers(const LayerSplitOptions & o) {
    const std::optional<int> vpp = resolve_virtual_stages(o);
    const int                v   = vpp.value_or(1);
    const int                pp  = o.pp;
    const int                l   = o.num_layers;
    std::vector<int>         per_rank(pp);   // n_r, over all of rank r's chunks

    if (o.account_for_embedding || o.account_for_loss) {   // Megatron's transformer_config.py checks
        LOOM_CHECK(!o.first_stage_layers && !o.last_stage_layers,
                   "num_layers_in_first_pipeline_stage and num_layers_in_last_pipeline_stage cannot be set at the "
                   "same time with account_for_embedding_in_pipeline_split and account_for_loss_in_pipeline_split",
                   "drop --decoder-first/last-pipeline-num-layers or the --account-for-* flags");
        const int counted = l + (o.account_for_embedding ? 1 : 0) + (o.account_for_loss ? 1 : 0);
        LOOM_CHECK(counted % pp == 0,
                   "number of middle layers: " << counted << " must be divisible by middle pipeline_model_parallel_size "
                                               << pp,
                   "--num-layers plus the embedding and loss the --account-for-* flags count must divide over the "
                   "pipeline stages");
        LOOM_CHECK((counted / pp) % v == 0, "num_layers_per_pipeline_rank " << counted / pp
                                                << " should be divisible by vp_size " << v,
                   "");
        const int chunk = counted / (pp * v);
        LayerAssignment a;
        a.pp         = pp;
        a.num_chunks = v;
        a.ranges.assign(pp, std::vector<LayerRange>(v));
        int next = 0;
        for (int c = 0; c < v; ++c) {   // model order: chunk c of every rank, then chunk c + 1
            for (int r = 0; r < pp; ++r) {
                int size = chunk;
                if (o.account_for_embedding && r == 0 && c == 0) --size;
                if (o.account_for_loss && r == pp - 1 && c == v - 1) --size;
                LOOM_CHECK(size >= 0, "Not enough layers in the " << (r == 0 ? "first" : "last")
                                                                  << " virtual pipeline stage",
                           "");
                a.ranges[r][c] = {next, next + size};
                next += size;
            }
        }
        return a;
    }
    if (o.first_stage_layers || o.last_stage_layers) {
        LOOM_CHECK(pp > 1,
                   "--decoder-first-pipeline-num-layers / --decoder-last-pipeline-num-layers need pipeline "
                   "parallelism, but --pipeline-model-parallel-size is 1",
                   "set --pipeline-model-parallel-size >= 2, or drop the uneven stage flags");
        const int first = o.first_stage_layers.value_or(0);
        const int last  = o.last_stage_layers.value_or(0);
        LOOM_CHECK(!o.first_stage_layers || first >= 1,
                   "--decoder-first-pipeline-num-layers must be >= 1, got " << first, "");
        LOOM_CHECK(!o.last_stage_layers || last >= 1, "--decoder-last-pipeline-num-layers must be >= 1, got " << last, "");
        const int middle_layers = l - first - last;
        const int middle_stages = pp - (o.first_stage_layers ? 1 : 0) - (o.last_stage_layers ? 1 : 0);
        LOOM_CHECK(middle_layers >= 0,
                   "--decoder-first-pipeline-num-layers " << first << " + --decoder-last-pipeline-num-layers " << last
                       << " exceed --num-layers " << l,
                   "the first and last stages can hold at most " << l << " layers together");
        if (middle_stages == 0) {
            LOOM_CHECK(middle_layers == 0,
                       "with --pipeline-model-parallel-size " << pp << " there are no middle stages, so "
                           "--decoder-first-pipeline-num-layers " << first << " + --decoder-last-pipeline-num-layers "
                           << last << " must equal --num-layers " << l,
                       "set the two flags to add up to " << l);
        } else {
            LOOM_CHECK(middle_layers % middle_stages == 0,
                       "the " << middle_layers << " layers left after --decoder-first-pipeline-num-layers / "
                           "--decoder-last-pipeline-num-layers do not divide over the " << middle_stages
                           << " middle pipeline stages",
                       "choose the uneven stages so that --num-layers minus them is a multiple of " << middle_stages);
        }
        const int middle = middle_stages ? middle_layers / middle_stages : 0;
        for (int r = 0; r < pp; ++r) per_rank[r] = middle;
        if (o.first_stage_layers) per_rank[0] = first;
        if (o.last_stage_layers) per_rank[pp - 1] = last;
        if (v > 1) {
            LOOM_CHECK(!o.first_stage_layers || first % v == 0,
                       "--decoder-first-pipeline-num-layers " << first << " is not divisible by the " << v
                           << " virtual stages per rank (--num-virtual-stages-per-pipeline-rank)",
                       "use a multiple of " << v << " layers on the first stage");
            LOOM_CHECK(!o.last_stage_layers || last % v == 0,
                       "--decoder-last-pipeline-num-layers " << last << " is not divisible by the " << v
                           << " virtual stages per rank (--num-virtual-stages-per-pipeline-rank)",
                       "use a multiple of " << v << " layers on the last stage");
            LOOM_CHECK(middle_stages == 0 || middle % v == 0,
                       "the " << middle << " layers on each middle pipeline stage are not divisible by the " << v
                              << " virtual stages per rank (--num-virtual-stages-per-pipeline-rank)",
                       "choose --num-layers and the uneven stages so that each middle stage holds a multiple of "
                           << v << " layers");
        }
    } else {
        LOOM_CHECK(l % (pp * v) == 0,
                   "--num-layers " << l << " is not divisible by --pipeline-model-parallel-size " << pp
                       << (vpp ? " x virtual stages per rank " + std::to_string(v) : std::string()) << " = " << pp * v,
                   "use a multiple of " << pp * v << " layers"
                       << (vpp ? ", fewer virtual stages (--num-virtual-stages-per-pipeline-rank)" : "")
                       << ", or uneven ends (--decoder-first-pipeline-num-layers / "
                          "--decoder-last-pipeline-num-layers)");
        for (int r = 0; r < pp; ++r) per_rank[r] = l / pp;
    }

    LayerAssignment a;
    a.pp         = pp;
    a.num_chunks = v;
    a.ranges.assign(pp, std::vector<LayerRange>(v));
    int before = 0;   // sum of n_{r'} / V over the ranks before r
    for (int r = 0; r < pp; ++r) {
        const int size = per_rank[r] / v;
        for (int c = 0; c < v; ++c) {
            const int begin = c * (l / v) + before;
            a.ranges[r][c]  = {begin, begin + size};
        }
        before += size;
    }
    return a;
}

}  // namespace loom::pipeline
