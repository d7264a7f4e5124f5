// The pipeline's point-to-point plan (pipeline/p2p_plan.h): every transfer's channel and its place on it agree
// between producer and consumer, and the simulation of all ranks under NCCL's semantics (FIFO per communicator,
// no tags, strict rendezvous) finishes without deadlock or mismatched data with one communicator per channel,
// over the golden configurations of test_schedule.cpp and a sweep of PP 2..8, VPP none and 1..4, M 1..16 and 32,
// every valid N, training and forward-only, plus the executor's evaluation order. With everything on the one
// pipeline communicator, as the executor had it, interleaved PP 2 VPP 2 M 4 deadlocks: the reason for channels.
#include "core/error.h"
#include "pipeline/p2p_plan.h"
#include "pipeline/schedule.h"
#include "tests/schedule_options.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <cstdio>
#include <map>
#include <optional>
#include <set>
#include <string>
#include <tuple>
#include <vector>

using namespace loom;
using namespace loom::pipeline;

namespace {

using loom::testing::schedule;

bool valid(const ScheduleOptions & o) {
    try {
        validate_schedule(o);
        return true;
    } catch (const Error &) {
        return false;
    }
}

bool contains(const std::string & haystack, const std::string & needle) {
    return haystack.find(needle) != std::string::npos;
}

// Every configuration of the sweep that validate_schedule accepts, each once (an explicit N equal to the
// default PP is the same schedule as none).
std::vector<ScheduleOptions> sweep() {
    std::vector<ScheduleOptions> all;
    for (int pp = 2; pp <= 8; ++pp) {
        for (std::optional<int> vpp : {std::optional<int>{}, std::optional<int>{1}, std::optional<int>{2},
                                       std::optional<int>{3}, std::optional<int>{4}}) {
            std::vector<int> ms;
            for (int m = 1; m <= 16; ++m) ms.push_back(m);
            ms.push_back(32);
            for (int m : ms) {
                std::vector<std::optional<int>> group_sizes = {std::nullopt};
                if (vpp) {
                    for (int n = 1; n <= m; ++n) {
                        if (n != pp) group_sizes.push_back(n);
                    }
                }
                for (std::optional<int> n : group_sizes) {
                    for (bool forward_only : {false, true}) {
                        ScheduleOptions o = schedule(pp, vpp, m, n, forward_only);
                        if (valid(o)) all.push_back(o);
                    }
                }
            }
        }
    }
    return all;
}

// The golden configurations of test_schedule.cpp (worked examples, warm-up and validation cases).
std::vector<ScheduleOptions> golden() {
    return {
        schedule(4, 2, 8),       schedule(2, 2, 5, 3),    schedule(4, 2, 8, 4),    schedule(4, 2, 4, 4),
        schedule(4, 2, 8, 8),    schedule(4, {}, 8),      schedule(4, 1, 8),       schedule(4, {}, 2),
        schedule(8, 1, 8),       schedule(4, 3, 4),       schedule(8, {}, 3),      schedule(1, {}, 4),
        schedule(1, 1, 4),       schedule(4, {}, 8, {}, true), schedule(4, 1, 8, {}, true),
        schedule(4, 2, 8, {}, true), schedule(4, 3, 8, {}, true),
    };
}

using DataKey = std::tuple<int, int, int>;   // kind, consumer virtual stage, microbatch

DataKey key_of(const Transfer & t) { return {static_cast<int>(t.kind), t.consumer, t.microbatch}; }

// The order argument of p2p_plan.h, checked directly: every transfer is sent once and received once, on the
// same channel, with the same place on it counted by both sides. Returns "" or what differs.
std::string check_sequences(const ScheduleOptions & o, const std::vector<std::vector<ScheduleOp>> & ops) {
    std::map<DataKey, Transfer> sent, received;
    for (int r = 0; r < o.pp; ++r) {
        P2PPlan plan = p2p_plan(o, r, ops[r]);
        for (const OpTransfers & op : plan.ops) {
            if (op.send) {
                if (op.send->channel.src != r) return "rank " + std::to_string(r) + " sends on a channel not its own";
                if (!sent.emplace(key_of(*op.send), *op.send).second) return "sent twice: " + transfer_label(*op.send);
            }
            if (op.receive) {
                if (op.receive->channel.dst != r) {
                    return "rank " + std::to_string(r) + " receives on a channel not its own";
                }
                if (!received.emplace(key_of(*op.receive), *op.receive).second) {
                    return "received twice: " + transfer_label(*op.receive);
                }
            }
        }
    }
    if (sent.size() != received.size()) {
        return std::to_string(sent.size()) + " transfers sent, " + std::to_string(received.size()) + " received";
    }
    for (const auto & [key, s] : sent) {
        auto it = received.find(key);
        if (it == received.end()) return "never received: " + transfer_label(s);
        const Transfer & r = it->second;
        if (!(r.channel == s.channel) || r.sequence != s.sequence) {
            return "sent as " + transfer_label(s) + ", received as " + transfer_label(r);
        }
    }
    return "";
}

std::vector<std::vector<ScheduleOp>> schedule_ops_of(const ScheduleOptions & o) {
    std::vector<std::vector<ScheduleOp>> ops;
    for (int r = 0; r < o.pp; ++r) ops.push_back(schedule_ops(o, r));
    return ops;
}

std::vector<std::vector<ScheduleOp>> evaluation_ops_of(const ScheduleOptions & o) {
    return std::vector<std::vector<ScheduleOp>>(static_cast<size_t>(o.pp),
                                                evaluation_ops(o.num_microbatches, num_model_chunks(o)));
}

}  // namespace

// The proof that the design matters: today's single communicator hangs on the smallest interleaved case.
TEST(P2PPlan, SingleCommunicatorDeadlocksInterleavedPp2Vpp2M4) {
    const std::string message = simulate_nccl_p2p(schedule(2, 2, 4), P2PMode::single);
    EXPECT_TRUE(contains(message, "deadlock")) << message;
    EXPECT_TRUE(contains(message, "pp 2 vpp 2 M 4 N 2")) << message;
    EXPECT_TRUE(contains(message, "rank 0")) << message;
    EXPECT_TRUE(contains(message, "rank 1")) << message;
    EXPECT_TRUE(contains(message, "at the head")) << message;
    EXPECT_EQ(simulate_nccl_p2p(schedule(2, 2, 4), P2PMode::per_channel), "");
}

TEST(P2PPlan, GoldenConfigurationsFinishWithPerChannelCommunicators) {
    for (const ScheduleOptions & o : golden()) {
        SCOPED_TRACE(schedule_label(o));
        EXPECT_EQ(simulate_nccl_p2p(o, P2PMode::per_channel), "");
        EXPECT_EQ(check_sequences(o, schedule_ops_of(o)), "");
    }
}

// Every valid configuration of the sweep, training or forward-only, and the executor's evaluation order.
TEST(P2PPlan, SweepFinishesWithPerChannelCommunicators) {
    int checked = 0, per_channel_failures = 0, single_failures = 0, single_interleaved_failures = 0;
    for (const ScheduleOptions & o : sweep()) {
        SCOPED_TRACE(schedule_label(o));
        ++checked;
        const std::string per_channel = simulate_nccl_p2p(o, P2PMode::per_channel);
        EXPECT_EQ(per_channel, "");
        const std::string evaluation = simulate_nccl_p2p(o, P2PMode::per_channel, evaluation_ops_of(o));
        EXPECT_EQ(evaluation, "") << "evaluation order";
        EXPECT_EQ(check_sequences(o, schedule_ops_of(o)), "");
        EXPECT_EQ(check_sequences(o, evaluation_ops_of(o)), "") << "evaluation order";
        if (!per_channel.empty() || !evaluation.empty()) ++per_channel_failures;
        if (!simulate_nccl_p2p(o, P2PMode::single).empty()) {
            ++single_failures;
            if (o.vpp) ++single_interleaved_failures;
        }
    }
    std::printf("[p2p plan] %d configurations: per-channel failures %d; single communicator failures %d "
                "(%d interleaved)\n",
                checked, per_channel_failures, single_failures, single_interleaved_failures);
    EXPECT_GT(checked, 3000);
    EXPECT_EQ(per_channel_failures, 0);
    EXPECT_GT(single_failures, 0);
    // Without virtual stages the single communicator was enough: its hangs are all interleaved schedules.
    EXPECT_EQ(single_failures, single_interleaved_failures);
}

// The simulation catches a consumer whose order differs from its producer's: rank 0 runs the evaluation order
// (microbatch-major) while rank 1 runs the schedule table's (chunk-major within a group of N).
TEST(P2PPlan, SimulationReportsMismatchedOrders) {
    const ScheduleOptions o = schedule(2, 2, 4, {}, true);
    std::vector<std::vector<ScheduleOp>> ops = {evaluation_ops(4, 2), schedule_ops(o, 1)};
    const std::string message = simulate_nccl_p2p(o, P2PMode::per_channel, ops);
    EXPECT_TRUE(contains(message, "data mismatch")) << message;
    EXPECT_TRUE(contains(message, "activation 0->1")) << message;
    EXPECT_NE(check_sequences(o, ops), "");
}

TEST(P2PPlan, ChannelsAreTheRingAndTheWrapAroundOnlyInterleaved) {
    const std::vector<Channel> ring = pipeline_channels(4);
    ASSERT_EQ(ring.size(), 8u);
    EXPECT_EQ(ring[0], (Channel{0, 1, TransferKind::activation}));
    EXPECT_EQ(ring[1], (Channel{1, 0, TransferKind::gradient}));
    EXPECT_EQ(ring[6], (Channel{3, 0, TransferKind::activation}));
    EXPECT_EQ(ring[7], (Channel{0, 3, TransferKind::gradient}));
    EXPECT_TRUE(pipeline_channels(1).empty());
    EXPECT_EQ(pipeline_channels(2).size(), 4u);   // 0->1 and 1->0 of each kind

    for (const ScheduleOptions & o : sweep()) {
        SCOPED_TRACE(schedule_label(o));
        const std::vector<Channel> all  = pipeline_channels(o.pp);
        const std::vector<Channel> used = channels_used(o);
        for (const Channel & c : used) EXPECT_NE(std::find(all.begin(), all.end(), c), all.end()) << channel_label(c);
        const bool wrap_used = std::any_of(used.begin(), used.end(), [&](const Channel & c) {
            return c.kind == TransferKind::activation ? c.dst == 0 : c.src == 0 && c.dst == o.pp - 1;
        });
        const bool several_chunks = num_model_chunks(o) > 1;
        EXPECT_EQ(wrap_used, several_chunks);
        // Forward-only runs send no gradients.
        const bool gradients = std::any_of(used.begin(), used.end(),
                                           [](const Channel & c) { return c.kind == TransferKind::gradient; });
        EXPECT_EQ(gradients, !o.forward_only);
    }
}

TEST(P2PPlan, Pp2Vpp2RanksUseFourChannelsWithTheirPeer) {
    const ScheduleOptions o = schedule(2, 2, 4);
    for (int r = 0; r < 2; ++r) {
        P2PPlan plan = p2p_plan(o, r);
        ASSERT_EQ(plan.channels.size(), 4u) << "rank " << r;
        int sends = 0;
        for (const ChannelUse & use : plan.channels) {
            EXPECT_EQ(use.peer, 1 - r);
            sends += use.send ? 1 : 0;
        }
        EXPECT_EQ(sends, 2) << "rank " << r;
    }
    // Rank 0's F1.0 (virtual stage 2) reads virtual stage 1's output over the wrap-around channel.
    P2PPlan plan = p2p_plan(o, 0);
    auto    f10  = std::find_if(plan.ops.begin(), plan.ops.end(),
                                [](const OpTransfers & t) { return t.op == ScheduleOp{true, 1, 0}; });
    ASSERT_NE(f10, plan.ops.end());
    ASSERT_TRUE(f10->receive.has_value());
    EXPECT_EQ(f10->receive->channel, (Channel{1, 0, TransferKind::activation}));
    EXPECT_EQ(f10->receive->producer, 1);
    EXPECT_EQ(f10->receive->consumer, 2);
    ASSERT_TRUE(f10->send.has_value());
    EXPECT_EQ(f10->send->channel, (Channel{0, 1, TransferKind::activation}));
}

// Early receives: the channel's next receive. Without interleaving that is the chunk's next microbatch, as the
// executor posted before channels; with interleaving it can be another chunk's input at a group's end, but
// never skips a receive of the channel.
TEST(P2PPlan, EarlyReceiveIsTheChannelsNextReceive) {
    for (const ScheduleOptions & o : sweep()) {
        SCOPED_TRACE(schedule_label(o));
        for (int r = 0; r < o.pp; ++r) {
            P2PPlan                 plan = p2p_plan(o, r);
            std::map<Channel, int>  posted;   // channel -> receives posted so far
            std::set<DataKey>       early;
            for (const OpTransfers & t : plan.ops) {
                if (t.receive) {
                    EXPECT_EQ(t.received_early, early.count(key_of(*t.receive)) == 1) << op_label(t.op);
                    if (!t.received_early) {
                        EXPECT_EQ(t.receive->sequence, posted[t.receive->channel]++);
                    }
                }
                if (t.prefetch) {
                    ASSERT_TRUE(t.op.forward && t.receive);
                    EXPECT_EQ(t.prefetch->channel, t.receive->channel);
                    EXPECT_EQ(t.prefetch->sequence, t.receive->sequence + 1);
                    EXPECT_EQ(t.prefetch->sequence, posted[t.prefetch->channel]++);
                    early.insert(key_of(*t.prefetch));
                    if (!o.vpp) {
                        EXPECT_EQ(t.prefetch->microbatch, t.op.microbatch + 1) << op_label(t.op);
                        EXPECT_EQ(t.prefetch->consumer, t.receive->consumer) << op_label(t.op);
                    }
                }
            }
        }
    }
}

TEST(P2PPlan, NoPipeliningHasNoTransfers) {
    P2PPlan plan = p2p_plan(schedule(1, {}, 4), 0);
    EXPECT_TRUE(plan.channels.empty());
    for (const OpTransfers & t : plan.ops) EXPECT_FALSE(t.receive || t.send || t.prefetch);
    EXPECT_EQ(simulate_nccl_p2p(schedule(1, {}, 4), P2PMode::single), "");
}

TEST(P2PPlan, RejectsBadRanksAndOps) {
    EXPECT_THROW(p2p_plan(schedule(4, 2, 8), 4), Error);
    EXPECT_THROW(p2p_plan(schedule(4, 2, 8), 0, {ScheduleOp{true, 2, 0}}), Error);
    EXPECT_THROW(p2p_plan(schedule(4, 2, 7, 4), 0), Error);   // invalid schedule
}
