// Rank generation and parallel configuration: the worked examples of docs/design/parallel_state.md section 3
// (the Seed001* tests: its two 16-rank jobs; SpecExample*: its tp 2, pp 2 dp groups), the
// partition and intersection properties over many configurations, and every rejected configuration.
#include "core/error.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"
#include "parallel/rank_generator.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <set>
#include <string>

using namespace loom;
using namespace loom::parallel;

namespace {

ParallelConfig make(int world, int tp, int pp, int cp = 1, int ep = 1, std::optional<int> etp = std::nullopt,
                    std::string order = kDefaultOrder) {
    ParallelSizes s;
    s.world_size = world;
    s.tp         = tp;
    s.pp         = pp;
    s.cp         = cp;
    s.ep         = ep;
    s.etp        = etp;
    s.order      = std::move(order);
    return ParallelConfig::create(s);
}

// The message of the Error thrown by creating this configuration ("" if accepted).
std::string rejection(const ParallelSizes & s) {
    try {
        ParallelConfig::create(s);
    } catch (const Error & e) {
        return e.message() + " | " + e.hint();
    }
    return "";
}

}  // namespace

TEST(RankGenerator, Seed001DenseTp4Pp2Dp2) {
    ParallelConfig c = make(16, 4, 2);
    EXPECT_EQ(c.dp(), 2);
    EXPECT_EQ(c.dense().get_ranks("dp"),
              (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
    EXPECT_EQ(c.dense().get_ranks("tp"), (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
    EXPECT_EQ(c.dense().get_ranks("pp"),
              (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    // Model parallel (tp-pp): tp fastest inside the group.
    EXPECT_EQ(c.dense().get_ranks("tp-pp"),
              (RankGroups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
    EXPECT_EQ(c.embedding_groups(),
              (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    EXPECT_EQ(c.position_embedding_groups(), (RankGroups{{0}, {1}, {2}, {3}, {4}, {5}, {6}, {7}}));
}

TEST(RankGenerator, Seed001MoeEtp1Ep4Edp2Pp2) {
    ParallelConfig c = make(16, 4, 2, 1, 4, 1);
    EXPECT_EQ(c.etp(), 1);
    EXPECT_EQ(c.edp(), 2);
    EXPECT_EQ(c.expert().get_ranks("ep"), (RankGroups{{0, 1, 2, 3}, {4, 5, 6, 7}, {8, 9, 10, 11}, {12, 13, 14, 15}}));
    EXPECT_EQ(c.expert().get_ranks("dp"),
              (RankGroups{{0, 4}, {1, 5}, {2, 6}, {3, 7}, {8, 12}, {9, 13}, {10, 14}, {11, 15}}));
    EXPECT_EQ(c.expert().get_ranks("pp"),
              (RankGroups{{0, 8}, {1, 9}, {2, 10}, {3, 11}, {4, 12}, {5, 13}, {6, 14}, {7, 15}}));
    // etp 1: sixteen singleton expert-tp groups.
    RankGroups etp = c.expert().get_ranks("tp");
    ASSERT_EQ(etp.size(), 16u);
    for (int r = 0; r < 16; ++r) {
        EXPECT_EQ(etp[r], std::vector<int>{r});
    }
    EXPECT_EQ(c.expert().get_ranks("tp-ep-pp"),
              (RankGroups{{0, 1, 2, 3, 8, 9, 10, 11}, {4, 5, 6, 7, 12, 13, 14, 15}}));
    // The dense side of the same job is unchanged by the expert sizes.
    EXPECT_EQ(c.dense().get_ranks("tp"), make(16, 4, 2).dense().get_ranks("tp"));
}

TEST(RankGenerator, SpecExampleDpGroupsOfTp2Pp2) {
    ParallelConfig c = make(16, 2, 2);
    EXPECT_EQ(c.dense().get_ranks("dp"), (RankGroups{{0, 2, 4, 6}, {1, 3, 5, 7}, {8, 10, 12, 14}, {9, 11, 13, 15}}));
}

TEST(RankGenerator, TokenOrderDoesNotMatterAndInGroupOrderFollowsTheGenerator) {
    ParallelConfig c = make(16, 2, 2, 2);   // tp 2, cp 2, dp 2, pp 2
    EXPECT_EQ(c.dense().get_ranks("dp-cp"), c.dense().get_ranks("cp-dp"));
    // cp (stride 2) varies faster than dp (stride 4) inside a dp-cp group.
    EXPECT_EQ(c.dense().get_ranks("dp-cp")[0], (std::vector<int>{0, 2, 4, 6}));
    EXPECT_EQ(c.dense().get_ranks("cp")[0], (std::vector<int>{0, 2}));
    EXPECT_EQ(c.dense().get_ranks("dp")[0], (std::vector<int>{0, 4}));
}

TEST(RankGenerator, MissingSizeOneAxesAreAppendedInReferenceOrder) {
    RankGenerator g(2, 1, 2, 1, 1, "tp-dp");
    EXPECT_EQ(g.order(), "tp-dp-pp-ep-cp");
    RankGenerator h(1, 1, 1, 1, 1, "");
    EXPECT_EQ(h.order(), "tp-pp-dp-ep-cp");
    EXPECT_THROW(RankGenerator(2, 1, 2, 2, 1, "tp-dp"), Error) << "pp of size 2 missing from the order";
    EXPECT_THROW(RankGenerator(2, 1, 2, 1, 1, "tp-xp-dp"), Error);
    EXPECT_THROW(RankGenerator(2, 1, 2, 1, 1, "tp-dp-tp"), Error);
    EXPECT_THROW(g.get_ranks("tp-zz"), Error);
}

TEST(RankGenerator, CoordinatesReconstructTheGlobalRank) {
    ParallelConfig c = make(24, 2, 3, 2);   // dp 2
    for (int r = 0; r < 24; ++r) {
        const RankGenerator & d = c.dense();
        int rebuilt = d.coordinate(r, "tp") + d.coordinate(r, "cp") * 2 + d.coordinate(r, "dp") * 4 +
                      d.coordinate(r, "pp") * 8;
        EXPECT_EQ(rebuilt, r);
        // A rank's coordinate on an axis is its index in its group of that axis.
        for (const char * axis : {"tp", "cp", "dp", "pp"}) {
            for (const auto & group : d.get_ranks(axis)) {
                auto it = std::find(group.begin(), group.end(), r);
                if (it != group.end()) {
                    EXPECT_EQ(it - group.begin(), d.coordinate(r, axis)) << axis << " rank " << r;
                }
            }
        }
    }
}

// Over many configurations: every group kind partitions the world into equal groups; two groups of
// kinds with disjoint axis sets share at most one rank, and in general a group of A meets a group of B
// in nothing or in exactly one group of the kind masked by the common axes.
TEST(RankGenerator, EveryGroupKindPartitionsTheWorldAndKindsIntersectAsTheMathSays) {
    const std::vector<std::string> axes  = {"tp", "cp", "dp", "pp"};
    const std::vector<std::string> kinds = {"tp", "cp", "dp", "pp", "dp-cp", "tp-pp", "tp-cp", "tp-dp-cp", "tp-dp"};
    int configs = 0;
    for (int world : {1, 2, 4, 8, 12, 16, 24, 32}) {
        for (int tp : {1, 2, 4}) {
            for (int cp : {1, 2}) {
                for (int pp : {1, 2, 3, 4}) {
                    if (world % (tp * cp * pp) != 0) {
                        continue;
                    }
                    ParallelConfig        c = make(world, tp, pp, cp);
                    const RankGenerator & g = c.dense();
                    ++configs;
                    for (const std::string & kind : kinds) {
                        RankGroups groups = g.get_ranks(kind);
                        std::vector<int> seen(world, 0);
                        for (const auto & group : groups) {
                            ASSERT_EQ(group.size(), groups[0].size());
                            for (int r : group) {
                                ASSERT_TRUE(r >= 0 && r < world);
                                seen[r]++;
                            }
                        }
                        for (int r = 0; r < world; ++r) {
                            ASSERT_EQ(seen[r], 1) << kind << " world " << world << " rank " << r;
                        }
                    }
                    auto axes_of = [&](const std::string & kind) {
                        std::set<std::string> s;
                        for (const std::string & a : axes) {
                            if (("-" + kind + "-").find("-" + a + "-") != std::string::npos) s.insert(a);
                        }
                        return s;
                    };
                    for (const std::string & ka : kinds) {
                        for (const std::string & kb : kinds) {
                            std::set<std::string> common;
                            for (const std::string & a : axes_of(ka)) {
                                if (axes_of(kb).count(a)) common.insert(a);
                            }
                            std::set<std::vector<int>> allowed;
                            if (common.empty()) {
                                for (int r = 0; r < world; ++r) allowed.insert({r});
                            } else {
                                std::string token;
                                for (const std::string & a : common) token += (token.empty() ? "" : "-") + a;
                                for (auto group : g.get_ranks(token)) {
                                    std::sort(group.begin(), group.end());
                                    allowed.insert(group);
                                }
                            }
                            for (auto a : g.get_ranks(ka)) {
                                std::sort(a.begin(), a.end());
                                for (auto b : g.get_ranks(kb)) {
                                    std::sort(b.begin(), b.end());
                                    std::vector<int> meet;
                                    std::set_intersection(a.begin(), a.end(), b.begin(), b.end(), std::back_inserter(meet));
                                    if (meet.empty()) continue;
                                    ASSERT_TRUE(allowed.count(meet)) << ka << " x " << kb << " world " << world;
                                    if (common.empty()) {
                                        ASSERT_EQ(meet.size(), 1u);
                                    }
                                }
                            }
                        }
                    }
                }
            }
        }
    }
    EXPECT_GT(configs, 40);
}

TEST(RankGenerator, ExpertAndDenseShareThePipelineRanks) {
    for (int ep : {1, 2, 4}) {
        for (int etp : {1, 2}) {
            ParallelConfig c = make(16, 2, 2, 1, ep, etp);
            EXPECT_EQ(c.dense().get_ranks("pp"), c.expert().get_ranks("pp"));
            for (const GroupKind & k : group_kinds(c)) {
                std::vector<int> seen(16, 0);
                for (const auto & group : k.groups) {
                    for (int r : group) seen[r]++;
                }
                int expected = (k.name == "embedding" || k.name == "position-embedding") ? -1 : 1;
                for (int r = 0; r < 16 && expected == 1; ++r) {
                    EXPECT_EQ(seen[r], 1) << (k.expert ? "expert " : "") << k.name << " rank " << r;
                }
            }
        }
    }
}

TEST(RankGenerator, EmbeddingGroupsAreFirstAndLastPipelineStages) {
    ParallelConfig c = make(8, 1, 4);
    EXPECT_EQ(c.embedding_groups(), (RankGroups{{0, 6}, {1, 7}}));
    EXPECT_EQ(c.position_embedding_groups(), (RankGroups{{0}, {1}}));
    ParallelConfig flat = make(2, 1, 1);
    EXPECT_EQ(flat.embedding_groups(), (RankGroups{{0}, {1}}));
}

TEST(ParallelConfig, DerivesSizesAndSummarises) {
    ParallelConfig c = make(16, 4, 2, 1, 4, 1);
    EXPECT_EQ(c.summary(),
              "world 16 = tp 4 x cp 1 x dp 2 x pp 2; experts: etp 1 x ep 4 x edp 2 x pp 2; order tp-cp-ep-dp-pp");
    ParallelSizes s;
    s.world_size = 8;
    s.pp         = 2;
    s.vpp        = 1;
    EXPECT_FALSE(ParallelConfig::create(s).vpp().has_value()) << "vpp 1 is normalised to none";
    s.vpp = 2;
    EXPECT_EQ(ParallelConfig::create(s).vpp(), 2);
}

TEST(ParallelConfig, RejectedConfigurationsNameTheFlags) {
    ParallelSizes s;
    s.world_size = 12;
    s.tp         = 8;
    std::string m = rejection(s);
    EXPECT_NE(m.find("--tensor-model-parallel-size (8)"), std::string::npos) << m;
    EXPECT_NE(m.find("--pipeline-model-parallel-size"), std::string::npos) << m;
    EXPECT_NE(m.find("divisors: 1, 2, 3, 4, 6, 12"), std::string::npos) << m;

    s    = ParallelSizes{};
    s.world_size = 8;
    s.tp         = 2;
    s.ep         = 8;
    m = rejection(s);
    EXPECT_NE(m.find("--expert-model-parallel-size (8)"), std::string::npos) << m;

    s = ParallelSizes{};
    s.world_size = 8;
    s.tp         = 0;
    m = rejection(s);
    EXPECT_NE(m.find("--tensor-model-parallel-size must be >= 1"), std::string::npos) << m;

    s = ParallelSizes{};
    s.world_size = 8;
    s.tp         = 2;
    s.order      = "cp-dp-pp";
    m = rejection(s);
    EXPECT_NE(m.find("does not name tp"), std::string::npos) << m;
    EXPECT_NE(m.find("--tensor-model-parallel-size"), std::string::npos) << m;

    s = ParallelSizes{};
    s.world_size = 8;
    s.order      = "tp-cp-ep-dp-pp-xx";
    m = rejection(s);
    EXPECT_NE(m.find("unknown axis 'xx'"), std::string::npos) << m;

    s = ParallelSizes{};
    s.world_size = 4;
    s.vpp        = 2;
    m = rejection(s);
    EXPECT_NE(m.find("--num-virtual-stages-per-pipeline-rank"), std::string::npos) << m;

    // Order not ending in pp: expert dp must equal dp.
    s = ParallelSizes{};
    s.world_size = 8;
    s.tp = 2; s.cp = 2; s.pp = 2; s.ep = 2; s.etp = 1;
    s.order = "tp-cp-ep-pp-dp";
    m = rejection(s);
    EXPECT_NE(m.find("does not end in pp"), std::string::npos) << m;
    // ... and is accepted when they agree.
    s.cp = 1;
    EXPECT_EQ(rejection(s), "");
}
