// The point-to-point plan of a pipeline stage, as pure functions: which transfers each op of a rank's schedule
// (schedule.h) receives before it computes and sends after, the channel every transfer travels on, and a
// discrete simulation of all ranks under NCCL's semantics that proves the plan neither deadlocks nor mixes up
// data. The executor (executor.h) issues exactly this plan; ProcessGroups (parallel/process_groups.h) creates
// the channels' communicators.
//
// Symbols: PP pipeline size, r a pipeline rank, V chunks per rank, S = PP V virtual stages, v = c PP + r the
// virtual stage of rank r's chunk c, M microbatches.
//
// Transfers. The forward of (v, m) produces the activation v -> v + 1 of microbatch m (none at v = S - 1); the
// backward of (v, m) produces the input gradient v -> v - 1 (none at v = 0). The forward of (v, m) needs the
// activation v - 1 -> v (none at v = 0), the backward the gradient v + 1 -> v (none at v = S - 1). Virtual
// stage v lives on rank v mod PP, so the last rank's chunk c feeds rank 0's chunk c + 1 (the wrap-around).
//
// Why one communicator per channel. NCCL's point-to-point operations have no tags: the k-th send from a to b on
// a communicator matches the k-th receive on b from a. Every operation of a communicator runs on one stream in
// the order the host issued it, and a send (of anything but a tiny message) completes only when its receive
// has been posted: a rendezvous. With one pipeline communicator, a rank's queue holds its sends and receives
// for both neighbours and both directions interleaved in issue order, so an operation at the head of a queue
// that waits for its partner holds up everything behind it, and a cycle of such waits through the queues and
// the hosts is a deadlock. Interleaved 1F1B with PP 2, V 2 and 4 microbatches deadlocks this way
// (simulate_nccl_p2p(..., P2PMode::single) shows it: rank 1's early receive of its next input sits ahead of the
// send rank 0 waits for, and rank 0 sends that input only after the op it is waiting in). Megatron avoids it
// by pairing each step's sends and receives into batches aligned between neighbours, an alignment that depends
// on its loop structure. Here every directed channel of data has its own communicator instead:
//
//   channel = (source rank, destination rank, kind)          kind: activation (forward) or gradient (backward)
//
// a communicator of just those two ranks, on which only the source sends and only the destination receives.
// For PP 2 the pair (0, 1) has four: activations 0 -> 1 and 1 -> 0 (the wrap-around, interleaved only),
// gradients 1 -> 0 and 0 -> 1 (interleaved only). A send blocked in its rendezvous then holds up nothing but
// the later sends of its own channel, the producer's host never waits for a send, and the consumer's host
// waits only for a receive the op it is about to run needs.
//
// The order argument. On one channel the producer issues its sends in its compute order and the consumer its
// receives in its compute order; both must be the same list of (microbatch, virtual stage), since nothing but
// that order matches them. Every rank's forwards run in schedule-table order, (m, c) for each group of N
// microbatches, for each chunk, for each m of the group; its backwards run in the same order with the chunk
// mirrored (V - 1 - c). Activations r -> r + 1 carry every forward's output of rank r in table order, which is
// the order of rank r + 1's forwards over the same (m, c). The wrap-around PP - 1 -> 0 carries chunks 0..V-2
// of rank PP - 1 to chunks 1..V-1 of rank 0; within each group the table lists the chunks in increasing order,
// so dropping the last chunk on one side and the first on the other leaves the same sequence, shifted by one
// chunk. The gradient channels are the mirror image. Each transfer's `sequence` is its place on its channel as
// the rank that issues it counts; the tests check that producer and consumer count the same for every transfer
// of every rank, and the simulation checks the whole run.
//
// Early receives. Once the op's own input is in, the next receive of the same activation channel is posted
// (`prefetch`), so the next forward's input can arrive while this op computes. It is the channel's next
// receive, never a later one, so receives are still posted in channel order; gradients are received when
// needed, as before.
//
// The simulation (simulate_nccl_p2p) runs every rank's host and every communicator queue of every rank in
// discrete steps. A rank's host walks its ops: it posts the op's receive (unless posted early), waits until it
// has completed, posts the prefetch, computes (instantly; nothing on the compute stream ever waits for a
// transfer) and posts the op's send, then goes on to the next op. Posting appends to the rank's FIFO queue of
// that communicator; operations of a queue run one after another. A send and a receive complete together when
// both are at the heads of their queues on the two ranks, and they match when they are the k-th send a -> b and
// the k-th receive on b from a of that communicator: strict rendezvous, the worst case NCCL allows. It reports
// a deadlock (no host and no queue can move, work left) naming the stuck hosts and queue heads, and a data
// mismatch (a receive matched with the send of another transfer). P2PMode::single puts everything on the one
// pipeline communicator with the early receive the executor used to post (the chunk's next microbatch);
// P2PMode::per_channel is the design above.
//
// Assumptions outside the model: operations on different communicators progress independently (their small
// NCCL kernels can be resident at once next to the compute stream's), and NCCL's lazy connection set-up, a
// host-side handshake on a channel's first transfer, is taken out of the schedule by the executor, which
// exchanges one element on every channel in the channels' creation order when it is built.
#pragma once

#include "pipeline/schedule.h"

#include <optional>
#include <string>
#include <vector>

namespace loom::pipeline {

enum class TransferKind { activation, gradient };
const char * transfer_kind_name(TransferKind kind);   // "activation", "gradient"

// A directed channel between two pipeline ranks (in-group ranks of the pipeline group).
struct Channel {
    int          src  = 0;
    int          dst  = 0;
    TransferKind kind = TransferKind::activation;
};
bool        operator==(const Channel & a, const Channel & b);
bool        operator<(const Channel & a, const Channel & b);
std::string channel_label(const Channel & channel);   // "activation 0->1"

// Every channel a pipeline of `pp` ranks can use, in the order ProcessGroups creates their communicators: for
// each rank r, the activations r -> (r + 1) mod PP, then the gradients (r + 1) mod PP -> r. The pairs through
// the wrap-around (PP - 1 and 0) carry data only in interleaved schedules. Empty for PP 1.
std::vector<Channel> pipeline_channels(int pp);

// One transfer of one microbatch between neighbouring virtual stages.
struct Transfer {
    TransferKind kind       = TransferKind::activation;
    int          microbatch = 0;
    int          producer   = 0;   // virtual stage that computes it
    int          consumer   = 0;   // virtual stage that reads it: producer + 1 (activation) or - 1 (gradient)
    Channel      channel;
    int          sequence = 0;     // its place among the channel's transfers, as the issuing rank counts
};
// The same data (kind, microbatch, stages); the channel and sequence are where it travels, not what it is.
bool        same_data(const Transfer & a, const Transfer & b);
std::string transfer_label(const Transfer & t);   // "activation v1->v2 mb 3 (#5 on activation 1->0)"

// What one op of a rank's order receives and sends.
struct OpTransfers {
    ScheduleOp              op;
    std::optional<Transfer> receive;           // needed before the op computes
    bool                    received_early = false;   // `receive` was posted by an earlier op's prefetch
    std::optional<Transfer> prefetch;          // posted once `receive` has completed, before computing
    std::optional<Transfer> send;              // produced by the op, posted after it computes
};

// A channel as one rank uses it.
struct ChannelUse {
    Channel channel;
    bool    send = false;   // this rank is the source (else the destination)
    int     peer = 0;       // the other pipeline rank
};

struct P2PPlan {
    int                      rank = 0;
    std::vector<ChannelUse>  channels;   // those this rank sends or receives on, sorted by channel
    std::vector<OpTransfers> ops;        // one per op, in order
};

// The plan for rank `rank` running schedule_ops(options, rank), or the given ops (a permutation the executor
// runs instead, such as evaluation_ops()). Validates the options and the rank.
P2PPlan p2p_plan(const ScheduleOptions & options, int rank);
P2PPlan p2p_plan(const ScheduleOptions & options, int rank, const std::vector<ScheduleOp> & ops);

// The forward-only order the executor's evaluate() runs: for each microbatch, every chunk in order.
std::vector<ScheduleOp> evaluation_ops(int num_microbatches, int num_chunks);

// Every channel some rank of the pipeline uses with these options, sorted.
std::vector<Channel> channels_used(const ScheduleOptions & options);

enum class P2PMode { single, per_channel };
const char * p2p_mode_name(P2PMode mode);   // "single communicator", "per-channel communicators"

// "pp 2 vpp 2 M 4 N 2" (and " forward-only"): how the messages below name a configuration.
std::string schedule_label(const ScheduleOptions & options);

// Runs all ranks of `options` under NCCL's semantics (see the top of this file); "" when every rank finishes
// with every transfer matched to its own data, else what went wrong. The second form runs the given per-rank
// op lists (each a permutation of the rank's forwards and backwards).
std::string simulate_nccl_p2p(const ScheduleOptions & options, P2PMode mode);
std::string simulate_nccl_p2p(const ScheduleOptions & options, P2PMode mode,
                              const std::vector<std::vector<ScheduleOp>> & ops_per_rank);

}  // namespace loom::pipeline
