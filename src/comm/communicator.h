// Communicator: the collectives and point-to-point operations of one process group.
//
//   all_reduce(t, op)                  t = op over ranks of t                        (in place)
//   reduce_scatter(in, out, op)        out = block `rank` of (op over ranks of in);  in.numel = size * out.numel
//   all_gather(in, out)                out = concat over ranks of in;                out.numel = size * in.numel
//   broadcast(t, root)                 t = t of `root`
//   all_to_all(in, send_counts, out, recv_counts)
//                                      block p of in (send_counts[p] elements, blocks back to back) goes
//                                      to rank p; block p of out comes from rank p
//   send(t, peer, tag) / recv(t, peer, tag)
//   barrier()
//
// ReduceOp: sum, avg (sum / size, floating dtypes only), max, min. Reductions of bf16 and f16 accumulate
// in f32 and round once, so the result equals the f32 reduction of the same values rounded to 16 bits.
//
// Asynchrony and ordering. Every operation returns a Work at once and completes later; wait() blocks
// the host until it has, test() asks. Passing a stream orders the operation inside it: it starts only
// after the work already submitted to that stream, and work submitted to the stream afterwards starts
// only after it completes (as a NCCL call on a CUDA stream); a send is the exception: it starts after the
// stream's earlier work, but later work on the stream does not wait for it (a pipeline stage's stream
// must not block until its neighbour posts the matching receive; the tensor stays alive until sent, and
// its Work says when it may be overwritten). Without a stream, the data must be ready
// when the call is made. Operations on one communicator start in the order they were issued, on every
// rank, so all ranks must issue them in the same order (as MPI and NCCL require).
//
// Arguments are checked here, before any backend sees them: a wrong size or dtype is a loom::Error on
// the calling rank, never a hang inside a collective.
#pragma once

#include "core/device.h"
#include "core/tensor.h"

#include <array>
#include <atomic>
#include <cstdint>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <span>
#include <string>
#include <vector>

namespace loom::comm {

enum class ReduceOp { sum, avg, max, min };
const char * reduce_op_name(ReduceOp op);

enum class OpKind { all_reduce, reduce_scatter, all_gather, broadcast, all_to_all, send, recv, barrier };
inline constexpr int kNumOpKinds = 8;
const char * op_kind_name(OpKind kind);

class Work {
public:
    virtual ~Work() = default;
    // Blocks until the operation has completed; rethrows its error, if any.
    virtual void wait() = 0;
    // True when the operation has completed (successfully or not).
    virtual bool test() = 0;
};
using WorkPtr = std::shared_ptr<Work>;

// What an operation issued on a stream capturing a graph returns (every backend issues it afresh at each
// replay, core/graph.h's replayable node): it completes in each replay, never on the host, so a wait is
// refused naming the graph.
class CapturedWork : public Work {
public:
    explicit CapturedWork(std::string graph) : graph_(std::move(graph)) {}
    void wait() override;
    bool test() override { return false; }

private:
    std::string graph_;
};

// The roll call of another transport over the same ranks (NCCL's, whose own waits cannot ask anyone): a
// group registered with a communicator that has a side channel (MPI's engine, which answers other ranks'
// questions from its own thread while this process is blocked elsewhere).
struct RollCallSubject {
    std::shared_ptr<std::atomic<uint64_t>> posted;   // operations this process has issued on the group
    std::function<std::string()>           doing;    // what it waits on there ("" none); any thread
};

class RollCallChannel {
public:
    virtual ~RollCallChannel() = default;
    // Asks the group's other members (the peer only, for a send or recv: `peer` >= 0, its group rank) where
    // they are in operation #seq, waiting up to `grace` seconds; one line per member that has not done its
    // part, naming it: one that does not answer has stopped, crashed or is blocked.
    virtual std::string ask(uint64_t seq, int peer, double grace) = 0;
};

// The collectives a communicator has issued, in order, as its callers asked for them: how many, a running
// digest (FNV-1a) of each one's kind, element count, dtype, reduction and root, and the last few, for a
// report. Every member of a group issues the same collectives, so the members must agree on all of it
// (comm/agreement.h's check_issued). Sends and receives are not counted: the two ends issue different ones.
// An all_to_all counts without its size (each rank sends what its data routes).
struct IssuedOp {
    OpKind  kind   = OpKind::barrier;
    DType   dtype  = DType::f32;
    int     reduce = -1;   // ReduceOp, or -1
    int      root   = -1;   // broadcast: the root; else -1
    int64_t  numel  = 0;
    uint64_t digest_before = 0;   // the running digest of the collectives before this one
    int      tag    = -1;   // a transfer's tag; else -1
};
// "all_reduce of 1 float32 (sum)", "broadcast of 8 uint8 from rank 0"; a transfer (send or recv) as both of
// its ends see it: "transfer of 4096 float32 (tag 6)".
std::string describe(const IssuedOp & op);

struct IssuedOps {
    uint64_t                count  = 0;
    uint64_t                digest = 0xcbf29ce484222325ull;
    std::array<IssuedOp, 16> last{};   // the last min(count, 16): collective #k (0-based) at k % 16
};

// The point-to-point transfers a communicator has issued with one peer in one direction (sent to it, or
// received from it), as IssuedOps over each transfer's element count, dtype and tag: the sender's record of
// what it sent must equal the receiver's record of what it received (comm/agreement.h's check_transfers).
struct Transfers {
    int       peer = 0;      // group rank
    bool      sent = false;  // true: this rank sent them to `peer`; false: received them from it
    IssuedOps ops;
};

// A test seam: the next all_reduce this process issues uses another reduction (sum <-> max) than its caller
// asked for, as a rank whose schedule diverged silently would (LOOM_FAULT's diverge_op).
void flip_next_reduction();

class Communicator {
public:
    virtual ~Communicator() = default;

    IssuedOps issued() const {
        std::lock_guard<std::mutex> lock(issued_mutex_);
        return issued_;
    }
    // With every other member, in group-rank order: what was sent to it and what was received from it
    // (empty records where nothing was), so both ends of every direction report one.
    std::vector<Transfers> transfers() const;

    // Registers `subject`, a group of another transport over this communicator's members named `name`, for
    // the roll call; every member must open it, in the same order. Null where there is no side channel.
    // The channel unregisters when destroyed.
    virtual std::unique_ptr<RollCallChannel> open_roll_call(const std::string & name, RollCallSubject subject) {
        (void)name;
        (void)subject;
        return nullptr;
    }

    virtual int                      rank() const = 0;
    virtual int                      size() const = 0;
    // The members' global (world) ranks, in in-group rank order.
    virtual const std::vector<int> & global_ranks() const = 0;
    virtual const std::string &      name() const = 0;

    WorkPtr all_reduce(const Tensor & t, ReduceOp op, Stream * stream = nullptr);
    WorkPtr reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream = nullptr);
    WorkPtr all_gather(const Tensor & in, const Tensor & out, Stream * stream = nullptr);
    WorkPtr broadcast(const Tensor & t, int root, Stream * stream = nullptr);
    WorkPtr all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                       std::span<const int64_t> recv_counts, Stream * stream = nullptr);
    WorkPtr send(const Tensor & t, int peer, int tag, Stream * stream = nullptr);
    WorkPtr recv(const Tensor & t, int peer, int tag, Stream * stream = nullptr);
    WorkPtr barrier(Stream * stream = nullptr);

protected:
    void note(OpKind kind, DType dtype, int64_t numel, int reduce, int root);

    virtual WorkPtr do_all_reduce(const Tensor & t, ReduceOp op, Stream * stream) = 0;
    virtual WorkPtr do_reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream) = 0;
    virtual WorkPtr do_all_gather(const Tensor & in, const Tensor & out, Stream * stream) = 0;
    virtual WorkPtr do_broadcast(const Tensor & t, int root, Stream * stream) = 0;
    virtual WorkPtr do_all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                                  std::span<const int64_t> recv_counts, Stream * stream) = 0;
    virtual WorkPtr do_send(const Tensor & t, int peer, int tag, Stream * stream) = 0;
    virtual WorkPtr do_recv(const Tensor & t, int peer, int tag, Stream * stream) = 0;
    virtual WorkPtr do_barrier(Stream * stream) = 0;

private:
    mutable std::mutex issued_mutex_;
    IssuedOps          issued_;
    std::map<std::pair<int, bool>, IssuedOps> transfers_;   // (peer, sent) -> the transfers, under issued_mutex_
    void note_transfer(int peer, bool sent, const Tensor & t, int tag);
};

// Collectives over a few host values (losses, token counts, flags, timings, norm partials), staged through
// an f32 tensor in `device`'s memory, since an NCCL group reduces device memory only. Blocking; every member
// passes the same number of values. On the CPU the values are reduced where they are.
//
//   std::vector<float> totals = all_reduce_values(*dp, device, {sum, count}, ReduceOp::sum);
std::vector<float> all_reduce_values(Communicator & group, Device & device, std::vector<float> values, ReduceOp op);
std::vector<float> broadcast_values(Communicator & group, Device & device, std::vector<float> values, int root);
// Every member's values, in rank order (size() * values.size()).
std::vector<float> all_gather_values(Communicator & group, Device & device, std::vector<float> values);

// Creates communicators: the world, and sub-groups from a partition of the world's ranks.
class CommunicatorFactory {
public:
    virtual ~CommunicatorFactory() = default;
    virtual std::shared_ptr<Communicator> world() = 0;
    // Every world rank must call this with the same `groups` (disjoint lists of world ranks, each list
    // in in-group rank order). Returns the communicator of the group holding this rank, or null if no
    // group holds it.
    virtual std::shared_ptr<Communicator> split(const std::vector<std::vector<int>> & groups,
                                                const std::string & name) = 0;
    // The watchdog's limit: an operation that waits longer for its peers than `seconds` ends the job with
    // a message naming the operation, the group and this rank (Megatron's --distributed-timeout-minutes).
    // LOOM_DISTRIBUTED_TIMEOUT_S overrides it (a test seam).
    virtual void set_timeout(double seconds) = 0;
};

}  // namespace loom::comm
