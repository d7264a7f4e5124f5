#include "parallel/parallel_config.h"

#include "core/error.h"

#include <sstream>

namespace loom::parallel {

namespace {

void check_positive(int value, const char * flag) {
    LOOM_CHECK(value >= 1, flag << " must be >= 1, got " << value, "parallel sizes are positive integers");
}

// "valid values of --tensor-model-parallel-size here: 1, 2, 4, 8"
std::string divisors_of(int n) {
    std::ostringstream os;
    for (int d = 1; d <= n; ++d) {
        if (n % d == 0) {
            os << (d == 1 ? "" : ", ") << d;
        }
    }
    return os.str();
}

bool ends_with_pp(const std::string & order) {
    return order.size() >= 2 && order.compare(order.size() - 2, 2, "pp") == 0;
}

}  // namespace

ParallelConfig::ParallelConfig(const ParallelSizes & s, int etp, int dp, int edp)
    : world_size_(s.world_size), tp_(s.tp), pp_(s.pp), cp_(s.cp), ep_(s.ep), etp_(etp), dp_(dp), edp_(edp),
      vpp_(s.vpp && *s.vpp > 1 ? s.vpp : std::nullopt),
      dense_(s.tp, 1, dp, s.pp, s.cp, s.order),
      expert_(etp, s.ep, edp, s.pp, 1, s.order) {
    order_ = dense_.order();
}

ParallelConfig ParallelConfig::create(const ParallelSizes & s) {
    LOOM_CHECK(s.world_size >= 1, "the world size must be >= 1, got " << s.world_size, "");
    check_positive(s.tp, "--tensor-model-parallel-size");
    check_positive(s.pp, "--pipeline-model-parallel-size");
    check_positive(s.cp, "--context-parallel-size");
    check_positive(s.ep, "--expert-model-parallel-size");
    int etp = s.etp.value_or(s.tp);
    check_positive(etp, "--expert-tensor-parallel-size");
    if (s.vpp) {
        check_positive(*s.vpp, "--num-virtual-stages-per-pipeline-rank");
        LOOM_CHECK(*s.vpp == 1 || s.pp > 1,
                   "--num-virtual-stages-per-pipeline-rank " << *s.vpp << " needs pipeline parallelism, but "
                       "--pipeline-model-parallel-size is 1",
                   "set --pipeline-model-parallel-size >= 2, or drop the virtual stages");
    }

    int model = s.tp * s.cp * s.pp;
    LOOM_CHECK(s.world_size % model == 0,
               "world size " << s.world_size << " is not divisible by --tensor-model-parallel-size (" << s.tp
                             << ") x --context-parallel-size (" << s.cp << ") x --pipeline-model-parallel-size ("
                             << s.pp << ") = " << model,
               "use a world size that is a multiple of " << model << ", or sizes whose product divides "
                   << s.world_size << " (its divisors: " << divisors_of(s.world_size) << ")");
    int expert_model = etp * s.ep * s.pp;
    LOOM_CHECK(s.world_size % expert_model == 0,
               "world size " << s.world_size << " is not divisible by --expert-tensor-parallel-size (" << etp
                             << ") x --expert-model-parallel-size (" << s.ep
                             << ") x --pipeline-model-parallel-size (" << s.pp << ") = " << expert_model,
               "choose expert sizes whose product with the pipeline size divides " << s.world_size
                   << " (its divisors: " << divisors_of(s.world_size) << ")");
    int dp  = s.world_size / model;
    int edp = s.world_size / expert_model;

    // The order applies to both generators: every axis of size > 1 in either must be named.
    struct Named { const char * axis; bool needed; const char * why; };
    const Named named[] = {
        {"tp", s.tp > 1 || etp > 1, "--tensor-model-parallel-size or --expert-tensor-parallel-size is > 1"},
        {"cp", s.cp > 1, "--context-parallel-size is > 1"},
        {"ep", s.ep > 1, "--expert-model-parallel-size is > 1"},
        {"dp", dp > 1 || edp > 1, "the (expert) data-parallel size derived from the world size is > 1"},
        {"pp", s.pp > 1, "--pipeline-model-parallel-size is > 1"},
    };
    std::string dashed = "-" + s.order + "-";
    for (const Named & n : named) {
        LOOM_CHECK(!n.needed || dashed.find(std::string("-") + n.axis + "-") != std::string::npos,
                   "--order '" << s.order << "' does not name " << n.axis << ", but " << n.why,
                   "name every axis whose size is > 1, e.g. the default " << kDefaultOrder);
    }
    ParallelConfig config(s, etp, dp, edp);   // the generators check unknown and repeated axes

    LOOM_CHECK(ends_with_pp(config.dense_.order()) || s.pp == 1 || edp == dp,
               "--order '" << s.order << "' does not end in pp, so the expert data-parallel size ("
                           << edp << " = world / (etp x ep x pp)) must equal the data-parallel size (" << dp
                           << " = world / (tp x cp x pp))",
               "end the order in pp (the default tp-cp-ep-dp-pp), or choose --expert-tensor-parallel-size x "
               "--expert-model-parallel-size = --tensor-model-parallel-size x --context-parallel-size");
    LOOM_CHECK(config.dense_.get_ranks("pp") == config.expert_.get_ranks("pp"),
               "with --order '" << s.order << "' the pipeline groups of the dense layers and of the expert "
                                   "layers differ",
               "both decompositions must share the pipeline ranks; end the order in pp");
    return config;
}

RankGroups ParallelConfig::embedding_groups() const {
    RankGroups groups;
    for (const std::vector<int> & pipeline : dense_.get_ranks("pp")) {
        if (pipeline.size() == 1) {
            groups.push_back(pipeline);
        } else {
            groups.push_back({pipeline.front(), pipeline.back()});
        }
    }
    return groups;
}

RankGroups ParallelConfig::position_embedding_groups() const {
    RankGroups groups;
    for (const std::vector<int> & pipeline : dense_.get_ranks("pp")) {
        groups.push_back({pipeline.front()});
    }
    return groups;
}

std::string ParallelConfig::summary() const {
    std::ostringstream os;
    os << "world " << world_size_ << " = tp " << tp_ << " x cp " << cp_ << " x dp " << dp_ << " x pp " << pp_
       << "; experts: etp " << etp_ << " x ep " << ep_ << " x edp " << edp_ << " x pp " << pp_;
    if (vpp_) {
        os << "; vpp " << *vpp_;
    }
    os << "; order " << order_;
    return os.str();
}

}  // namespace loom::parallel
