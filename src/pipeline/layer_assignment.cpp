#include "pipeline/layer_assignment.h"

#include "core/error.h"

#include <algorithm>
#include <regex>

namespace loom::pipeline {

bool operator==(const LayerRange & a, const LayerRange & b) { return a.begin == b.begin && a.end == b.end; }

std::vector<std::string> parse_pipeline_layout(const std::string & text) {
    std::string unrolled;
    for (char c : text) {
        if (c != ',') unrolled += c;   // purely cosmetic commas
    }
    // "(ab|cd)*2" -> "ab|cdab|cd", then "x*3" -> "xxx" (Megatron's two patterns, in its order).
    for (const std::regex & pattern : {std::regex(R"(\(([^)]+)\)\*(\d+))"), std::regex(R"((.)\*(\d+))")}) {
        std::string out;
        std::smatch m;
        std::string rest = unrolled;
        while (std::regex_search(rest, m, pattern)) {
            const long n = std::stol(m[2].str());
            LOOM_CHECK(n >= 0 && n <= 100000, "--pipeline-model-parallel-layout '" << text << "' repeats " << m[0].str()
                                                  << " " << n << " times", "");
            out += m.prefix().str();
            for (long i = 0; i < n; ++i) out += m[1].str();
            rest = m.suffix().str();
        }
        unrolled = out + rest;
    }
    std::vector<std::string> stages(1);
    for (char c : unrolled) {
        if (c == '|') {
            stages.emplace_back();
            continue;
        }
        LOOM_CHECK(c == 'E' || c == 'L' || c == 't' || c == 'm',
                   "--pipeline-model-parallel-layout '" << text << "': invalid layer character '" << c << "'",
                   "known layer characters: E (embedding), t (decoder layer), m (MTP layer), L (loss)");
        stages.back() += c;
    }
    return stages;
}

std::optional<int> resolve_virtual_stages(const LayerSplitOptions & o) {
    LOOM_CHECK(o.num_layers >= 1, "--num-layers must be >= 1, got " << o.num_layers, "");
    LOOM_CHECK(o.pp >= 1, "--pipeline-model-parallel-size must be >= 1, got " << o.pp, "");
    if (!o.layout.empty()) {   // Megatron's arguments.py and TransformerConfig checks
        LOOM_CHECK(!o.num_layers_per_virtual_stage && (!o.vpp || *o.vpp == static_cast<int>(o.layout.size()) / o.pp),
                   "No more than one of the following arguments can be set at the same time: "
                   "--num-layers-per-virtual-pipeline-stage, --num-virtual-stages-per-pipeline-rank, "
                   "--pipeline-model-parallel-layout",
                   "the layout's stages give the virtual stages");
        LOOM_CHECK(!o.first_stage_layers && !o.last_stage_layers && !o.account_for_embedding && !o.account_for_loss,
                   "pipeline_model_parallel_layout cannot be set with other pipeline layout arguments "
                   "(--decoder-first/last-pipeline-num-layers, --account-for-embedding/loss-in-pipeline-split)",
                   "");
        LOOM_CHECK(o.layout.size() % static_cast<size_t>(o.pp) == 0,
                   "The length of pipeline_model_parallel_layout must be divisible by pipeline_model_parallel_size ("
                       << o.layout.size() << " stages, --pipeline-model-parallel-size " << o.pp << ")",
                   "");
        const int v = static_cast<int>(o.layout.size()) / o.pp;
        return v > 1 ? std::optional<int>(v) : std::nullopt;
    }
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

namespace {

// The layout's stages as chunks: Megatron's validate_layer_layout, then what Loom's stages hold.
LayerAssignment layout_assignment(const LayerSplitOptions & o, int v) {
    const std::vector<std::string> & stages = o.layout;
    std::string flat;
    for (const std::string & stage : stages) flat += stage;
    auto count = [](const std::string & x, char c) { return static_cast<int>(std::count(x.begin(), x.end(), c)); };
    LOOM_CHECK(!flat.empty() && flat.front() == 'E', "The first layer must be embedding (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(flat.back() == 'L', "The last layer must be loss (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(count(flat, 'E') == 1, "Embedding must be specified exactly once (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(count(flat, 'L') == 1, "Loss must be specified exactly once (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(count(flat, 't') == o.num_layers, "Number of decoder layers " << count(flat, 't')
                                                     << " must match num_layers " << o.num_layers
                                                     << " (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(count(flat, 'm') == o.mtp_num_layers,
               "Number of mtp layers in layout must match mtp_num_layers (" << count(flat, 'm') << " in "
                   "--pipeline-model-parallel-layout, --mtp-num-layers " << o.mtp_num_layers << ")", "");
    const size_t first_m = flat.find('m');
    LOOM_CHECK(first_m == std::string::npos || flat.find('t', first_m) == std::string::npos,
               "decoder layers must be placed before MTP layers (--pipeline-model-parallel-layout)", "");
    LOOM_CHECK(count(stages.front(), 'E') == 1, "--pipeline-model-parallel-layout puts the embedding after an empty stage",
               "Loom embeds on the first virtual stage: start the layout with E");
    LOOM_CHECK(count(stages.back(), 'L') == 1 && count(stages.back(), 'm') == o.mtp_num_layers,
               "--pipeline-model-parallel-layout puts " << (count(stages.back(), 'L') == 0 ? "the loss" : "an MTP layer")
                   << " before the last stage, which Loom does not support",
               "Loom computes the MTP depths and the loss on the last virtual stage: end the layout with "
                   << std::string(static_cast<size_t>(o.mtp_num_layers), 'm') << "L");
    LayerAssignment a;
    a.pp         = o.pp;
    a.num_chunks = v;
    a.ranges.assign(o.pp, std::vector<LayerRange>(v));
    int next = 0;
    for (size_t i = 0; i < stages.size(); ++i) {   // model order: chunk c of every rank, then chunk c + 1
        const int size = count(stages[i], 't');
        a.ranges[i % static_cast<size_t>(o.pp)][i / static_cast<size_t>(o.pp)] = {next, next + size};
        next += size;
    }
    return a;
}

}  // namespace

LayerAssignment assign_layers(const LayerSplitOptions & o) {
    const std::optional<int> vpp = resolve_virtual_stages(o);
    const int                v   = vpp.value_or(1);
    const int                pp  = o.pp;
    const int                l   = o.num_layers;
    std::vector<int>         per_rank(pp);   // n_r, over all of rank r's chunks
    if (!o.layout.empty()) return layout_assignment(o, v);

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
