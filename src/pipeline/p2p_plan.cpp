#include "pipeline/p2p_plan.h"

#include "core/error.h"

#include <algorithm>
#include <deque>
#include <map>
#include <set>
#include <sstream>
#include <tuple>

namespace loom::pipeline {

namespace {

// Which receive an op posts early once its own input is in.
enum class PrefetchRule {
    next_on_channel,   // the channel's next receive (the per-channel design: keeps the channel's order)
    next_microbatch,   // the same chunk's next microbatch (the executor on one communicator, before channels)
};

// What a transfer is, without where it travels: the key both sides agree on.
using DataKey = std::tuple<int, int, int>;   // kind, consumer virtual stage, microbatch

DataKey data_key(const Transfer & t) { return {static_cast<int>(t.kind), t.consumer, t.microbatch}; }

P2PPlan build_plan(const ScheduleOptions & options, int rank, const std::vector<ScheduleOp> & ops, PrefetchRule rule) {
    validate_schedule(options);
    LOOM_CHECK(rank >= 0 && rank < options.pp,
               "pipeline rank " << rank << " is out of range for --pipeline-model-parallel-size " << options.pp,
               "use a rank in 0.." << options.pp - 1);
    const int pp = options.pp, chunks = num_model_chunks(options), stages = pp * chunks;
    const int microbatches = options.num_microbatches;
    auto      rank_of      = [pp](int v) { return v % pp; };
    auto      transfer     = [&](TransferKind kind, int producer, int consumer, int mb) {
        Transfer t;
        t.kind       = kind;
        t.microbatch = mb;
        t.producer   = producer;
        t.consumer   = consumer;
        t.channel    = Channel{rank_of(producer), rank_of(consumer), kind};
        return t;
    };

    P2PPlan plan;
    plan.rank = rank;
    plan.ops.reserve(ops.size());
    for (const ScheduleOp & op : ops) {
        LOOM_CHECK(op.chunk >= 0 && op.chunk < chunks && op.microbatch >= 0 && op.microbatch < microbatches,
                   "pipeline op " << op_label(op) << " is outside " << chunks << " chunks and " << microbatches
                                  << " microbatches", "");
        OpTransfers o;
        o.op        = op;
        const int v = op.chunk * pp + rank;
        if (op.forward) {
            if (v > 0) o.receive = transfer(TransferKind::activation, v - 1, v, op.microbatch);
            if (v < stages - 1) o.send = transfer(TransferKind::activation, v, v + 1, op.microbatch);
        } else {
            if (v < stages - 1) o.receive = transfer(TransferKind::gradient, v + 1, v, op.microbatch);
            if (v > 0) o.send = transfer(TransferKind::gradient, v, v - 1, op.microbatch);
        }
        plan.ops.push_back(o);
    }

    // Each side numbers a channel's transfers in the order it issues them, which is its compute order.
    std::map<Channel, int>              sent, received;
    std::map<Channel, std::vector<int>> receivers;   // channel -> the ops receiving on it, in order
    std::set<std::pair<Channel, bool>>  uses;
    for (size_t j = 0; j < plan.ops.size(); ++j) {
        OpTransfers & o = plan.ops[j];
        if (o.receive) {
            o.receive->sequence = received[o.receive->channel]++;
            receivers[o.receive->channel].push_back(static_cast<int>(j));
            uses.insert({o.receive->channel, false});
        }
        if (o.send) {
            o.send->sequence = sent[o.send->channel]++;
            uses.insert({o.send->channel, true});
        }
    }
    for (const auto & [channel, send] : uses) {
        plan.channels.push_back(ChannelUse{channel, send, send ? channel.dst : channel.src});
    }

    // Early receives, for forward inputs only (gradients are received when the backward needs them).
    std::map<std::pair<int, int>, int> forward_at;   // (chunk, microbatch) -> op index
    for (size_t j = 0; j < plan.ops.size(); ++j) {
        if (plan.ops[j].op.forward) forward_at[{plan.ops[j].op.chunk, plan.ops[j].op.microbatch}] = static_cast<int>(j);
    }
    for (size_t j = 0; j < plan.ops.size(); ++j) {
        OpTransfers & o = plan.ops[j];
        if (!o.op.forward || !o.receive) continue;
        int target = -1;
        if (rule == PrefetchRule::next_on_channel) {
            const std::vector<int> & on_channel = receivers[o.receive->channel];
            const size_t             next       = static_cast<size_t>(o.receive->sequence) + 1;
            if (next < on_channel.size()) target = on_channel[next];
        } else {
            auto it = forward_at.find({o.op.chunk, o.op.microbatch + 1});
            if (it != forward_at.end() && it->second > static_cast<int>(j)) target = it->second;
        }
        if (target < 0 || plan.ops[target].received_early) continue;
        plan.ops[target].received_early = true;
        o.prefetch                       = plan.ops[target].receive;
    }
    return plan;
}

// One posted operation of the simulation.
struct Posted {
    int      rank  = 0;
    int      comm  = 0;
    bool     send  = false;
    int      peer  = 0;
    int      match = 0;   // k: the k-th send rank -> peer (or receive on rank from peer) on this communicator
    Transfer transfer;
    bool     done = false;
};

std::string describe(const Posted & p) {
    std::ostringstream os;
    os << (p.send ? "send " : "receive ") << transfer_label(p.transfer) << (p.send ? " to rank " : " from rank ")
       << p.peer;
    return os.str();
}

}  // namespace

const char * transfer_kind_name(TransferKind kind) {
    return kind == TransferKind::activation ? "activation" : "gradient";
}

bool operator==(const Channel & a, const Channel & b) {
    return a.src == b.src && a.dst == b.dst && a.kind == b.kind;
}

bool operator<(const Channel & a, const Channel & b) {
    return std::make_tuple(a.src, a.dst, static_cast<int>(a.kind)) <
           std::make_tuple(b.src, b.dst, static_cast<int>(b.kind));
}

std::string channel_label(const Channel & channel) {
    return std::string(transfer_kind_name(channel.kind)) + " " + std::to_string(channel.src) + "->" +
           std::to_string(channel.dst);
}

std::vector<Channel> pipeline_channels(int pp) {
    std::vector<Channel> channels;
    if (pp < 2) return channels;
    for (int r = 0; r < pp; ++r) {
        const int next = (r + 1) % pp;
        channels.push_back(Channel{r, next, TransferKind::activation});
        channels.push_back(Channel{next, r, TransferKind::gradient});
    }
    return channels;
}

bool same_data(const Transfer & a, const Transfer & b) {
    return a.kind == b.kind && a.microbatch == b.microbatch && a.producer == b.producer && a.consumer == b.consumer;
}

std::string transfer_label(const Transfer & t) {
    std::ostringstream os;
    os << transfer_kind_name(t.kind) << " v" << t.producer << "->v" << t.consumer << " mb " << t.microbatch << " (#"
       << t.sequence << " on " << channel_label(t.channel) << ")";
    return os.str();
}

P2PPlan p2p_plan(const ScheduleOptions & options, int rank) {
    return build_plan(options, rank, schedule_ops(options, rank), PrefetchRule::next_on_channel);
}

P2PPlan p2p_plan(const ScheduleOptions & options, int rank, const std::vector<ScheduleOp> & ops) {
    return build_plan(options, rank, ops, PrefetchRule::next_on_channel);
}

std::vector<ScheduleOp> evaluation_ops(int num_microbatches, int num_chunks) {
    std::vector<ScheduleOp> ops;
    for (int m = 0; m < num_microbatches; ++m) {
        for (int c = 0; c < num_chunks; ++c) ops.push_back(ScheduleOp{true, c, m});
    }
    return ops;
}

std::vector<Channel> channels_used(const ScheduleOptions & options) {
    std::set<Channel> used;
    for (int r = 0; r < options.pp; ++r) {
        for (const ChannelUse & use : p2p_plan(options, r).channels) used.insert(use.channel);
    }
    return {used.begin(), used.end()};
}

const char * p2p_mode_name(P2PMode mode) {
    return mode == P2PMode::single ? "single communicator" : "per-channel communicators";
}

std::string schedule_label(const ScheduleOptions & options) {
    std::ostringstream os;
    os << "pp " << options.pp;
    if (options.vpp) os << " vpp " << *options.vpp;
    os << " M " << options.num_microbatches;
    if (options.vpp) os << " N " << microbatch_group_size(options);
    if (options.forward_only) os << " forward-only";
    return os.str();
}

std::string simulate_nccl_p2p(const ScheduleOptions & options, P2PMode mode) {
    validate_schedule(options);
    std::vector<std::vector<ScheduleOp>> ops;
    for (int r = 0; r < options.pp; ++r) ops.push_back(schedule_ops(options, r));
    return simulate_nccl_p2p(options, mode, ops);
}

std::string simulate_nccl_p2p(const ScheduleOptions & options, P2PMode mode,
                              const std::vector<std::vector<ScheduleOp>> & ops_per_rank) {
    validate_schedule(options);
    const int pp = options.pp;
    LOOM_CHECK(static_cast<int>(ops_per_rank.size()) == pp,
               "simulate_nccl_p2p needs the ops of " << pp << " ranks, got " << ops_per_rank.size(), "");
    const std::string where = schedule_label(options) + ", " + p2p_mode_name(mode);
    const PrefetchRule rule = mode == P2PMode::single ? PrefetchRule::next_microbatch : PrefetchRule::next_on_channel;
    std::vector<P2PPlan> plans;
    for (int r = 0; r < pp; ++r) plans.push_back(build_plan(options, r, ops_per_rank[r], rule));

    // Communicators: the pipeline group (id 0) for `single`, else one per channel of pipeline_channels().
    const std::vector<Channel> channels = pipeline_channels(pp);
    auto comm_of = [&](const Channel & channel) {
        if (mode == P2PMode::single) return 0;
        auto it = std::find(channels.begin(), channels.end(), channel);
        LOOM_CHECK(it != channels.end(), where << ": " << channel_label(channel) << " is not a pipeline channel", "");
        return static_cast<int>(it - channels.begin());
    };
    auto comm_name = [&](int comm) {
        return mode == P2PMode::single ? std::string("pp") : channel_label(channels[comm]);
    };

    std::vector<Posted>                              posted;
    std::map<std::pair<int, int>, std::deque<int>>   queues;    // (rank, communicator) -> posted, in issue order
    std::map<std::tuple<int, int, int, bool>, int>   issued;    // (communicator, src, dst, send) -> count
    std::vector<std::map<DataKey, int>>              receives(static_cast<size_t>(pp));   // per rank: data -> posted
    std::vector<size_t>                              next_op(static_cast<size_t>(pp), 0);
    auto post = [&](int rank, const Transfer & t, bool send) {
        Posted p;
        p.rank     = rank;
        p.comm     = comm_of(t.channel);
        p.send     = send;
        p.peer     = send ? t.channel.dst : t.channel.src;
        p.match    = issued[{p.comm, t.channel.src, t.channel.dst, send}]++;
        p.transfer = t;
        posted.push_back(p);
        const int id = static_cast<int>(posted.size()) - 1;
        queues[{rank, p.comm}].push_back(id);
        if (!send) receives[rank][data_key(t)] = id;
    };

    for (;;) {
        bool progress = false;
        // Hosts: each runs until it must wait for a receive.
        for (int r = 0; r < pp; ++r) {
            const std::vector<OpTransfers> & ops = plans[r].ops;
            while (next_op[r] < ops.size()) {
                const OpTransfers & o = ops[next_op[r]];
                if (o.receive) {
                    auto it = receives[r].find(data_key(*o.receive));
                    if (it == receives[r].end()) {
                        post(r, *o.receive, false);
                        progress = true;
                        it = receives[r].find(data_key(*o.receive));
                    }
                    if (!posted[it->second].done) break;
                }
                if (o.prefetch) {
                    if (receives[r].count(data_key(*o.prefetch))) {
                        return where + ": rank " + std::to_string(r) + " posts " + transfer_label(*o.prefetch) +
                               " twice";
                    }
                    post(r, *o.prefetch, false);
                }
                if (o.send) post(r, *o.send, true);
                ++next_op[r];
                progress = true;
            }
        }
        // Communicators: a send at the head of its queue completes with the receive at the head of the peer's.
        for (auto & [key, queue] : queues) {
            while (!queue.empty()) {
                Posted & s = posted[queue.front()];
                if (!s.send) break;
                auto peer_queue = queues.find({s.peer, s.comm});
                if (peer_queue == queues.end() || peer_queue->second.empty()) break;
                Posted & q = posted[peer_queue->second.front()];
                if (q.send || q.peer != s.rank || q.match != s.match) break;
                if (!same_data(s.transfer, q.transfer)) {
                    return where + ": data mismatch on " + comm_name(s.comm) + ": rank " + std::to_string(s.rank) +
                           "'s " + describe(s) + " is matched by rank " + std::to_string(q.rank) + "'s " + describe(q);
                }
                s.done = q.done = true;
                queue.pop_front();
                peer_queue->second.pop_front();
                progress = true;
            }
        }
        bool finished = true;
        for (int r = 0; r < pp; ++r) finished = finished && next_op[r] == plans[r].ops.size();
        for (const auto & [key, queue] : queues) finished = finished && queue.empty();
        if (finished) return "";
        if (progress) continue;

        std::ostringstream os;
        os << where << ": deadlock;";
        for (int r = 0; r < pp; ++r) {
            if (next_op[r] < plans[r].ops.size()) {
                const OpTransfers & o = plans[r].ops[next_op[r]];
                os << " rank " << r << " waits at " << op_label(o.op) << " for " << transfer_label(*o.receive) << ";";
            }
        }
        for (const auto & [key, queue] : queues) {
            if (queue.empty()) continue;
            os << " rank " << key.first << " on " << comm_name(key.second) << ": " << describe(posted[queue.front()])
               << " at the head (" << queue.size() << " queued);";
        }
        std::string message = os.str();
        message.pop_back();
        return message;
    }
}

}  // namespace loom::pipeline
