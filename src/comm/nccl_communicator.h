// The NCCL backend of Communicator, for tensors in CUDA device memory (the CUDA backend). Built only with
// LOOM_CUDA=ON; nothing here needs the CUDA or NCCL headers.
//
// Launch. MPI stays the launcher: an NcclContext is made from the MPI factory (MpiContext) and the CUDA
// device of this rank. For the world and for each group of a split, the group's rank 0 creates an
// ncclUniqueId, the group's MPI communicator broadcasts it, and every member calls ncclCommInitRank (a
// blocking, collective call: every member of the group must create it at the same point, as a split
// already requires).
//
// Ordering. Each communicator owns an internal CUDA stream ("nccl:<group>") on which its NCCL calls are
// enqueued, one issuing thread at a time, in issue order:
//
//   caller stream ──record(ready)──> nccl stream: wait(ready), ncclXxx, record(done) ──> caller stream waits(done)
//
// A send is the exception of communicator.h: the caller's stream does not wait for its `done`. Without a
// stream the data must be ready when the call is made, and Work::wait/test look at `done`. The tensors an
// operation reads or writes are kept (stream-ordered) until it has run on the NCCL stream, so a caller may
// drop them as soon as the call returns. Work::wait and Work::test also ask ncclCommGetAsyncError, so an
// asynchronous NCCL failure (a peer gone, a network error) is a loom::Error naming the operation and group
// rather than a wait forever.
//
// Differences from the MPI backend:
//   - send/recv: NCCL has no tags (the tag is checked, then ignored); the sends and receives between two
//     ranks match in the order they were issued. A send blocks the NCCL stream (not the caller's) until the
//     peer has posted its receive, so two ranks that both send to each other before receiving deadlock:
//     the pipeline gives each directed channel its own communicator for that reason (pipeline/p2p_plan.h).
//   - bf16/f16 reductions reduce in NCCL's own order (the f32 sum of each pair, rounded at each step): on
//     two ranks that is the f32 result rounded once, as communicator.h asks; on more ranks it may differ
//     from it by rounding. avg is ncclAvg.
//   - graph capture: an operation issued on a stream that captures a Loom graph is a replayable node
//     (Stream::submit_replayable), as the MPI backend's: the CUDA capture ends into a segment before it and
//     begins again after it, and each replay issues the operation afresh on the NCCL stream between the
//     segments, with the same events against the replay stream (replay on the stream that captured). The
//     NCCL call is never inside a CUDA graph; the Work returned during capture refuses a wait (the operation
//     completes in each replay). A stream merely forked into another stream's capture is refused.
//   - watchdog: a Work::wait that has waited past NcclContext::set_timeout prints its report to stderr
//     (the operation and its number on the group, the group and the rank), takes a roll call of the group
//     over the launcher (comm/communicator.h's RollCallChannel: each member's MPI engine answers from its
//     own thread how many operations it has issued on the group and which NCCL operation it waits in, and
//     a member that does not answer has stopped), aborts the communicator and throws a RunError (NCCL
//     itself would wait forever). The report is printed first: the abort fails the peers at once, and a
//     peer that ends the job could otherwise stop this rank before its exception is printed.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "comm/communicator.h"
#include "core/device.h"

#include <memory>
#include <string>
#include <vector>

namespace loom::comm::inline LOOM_NCCL_NS {

class NcclContext : public CommunicatorFactory {
public:
    // `launcher`: the MPI factory whose world and splits carry the NCCL unique ids; it must outlive this
    // context. `device`: this rank's CUDA device (cuda::device(i)); every communicator of the context uses
    // it, and NCCL needs a distinct GPU per rank of a group. Creates the world communicator (collective over
    // the launcher's world).
    NcclContext(CommunicatorFactory & launcher, Device & device);
    ~NcclContext() override;
    NcclContext(const NcclContext &) = delete;
    NcclContext & operator=(const NcclContext &) = delete;

    Device & device() const { return device_; }

    // The watchdog of this process's NCCL operations (default 600 s): a Work::wait that has waited longer
    // aborts the communicator (ncclCommAbort, which releases the stream it blocks) and throws naming the
    // operation, the group and the rank. A wait on the host is where NCCL's hangs show: a rank that issued
    // operations in another order, or a stopped peer.
    void set_timeout(double seconds) override;

    std::shared_ptr<Communicator> world() override { return world_; }
    // Splits the launcher's world the same way (its split), then creates one NCCL communicator per group.
    std::shared_ptr<Communicator> split(const std::vector<std::vector<int>> & groups,
                                        const std::string & name) override;

private:
    CommunicatorFactory &         launcher_;
    Device &                      device_;
    std::shared_ptr<Communicator> world_;
};

// The NCCL communicator of the group that `launcher_group` (a communicator of the MPI launcher) spans, on
// `device`, named `name`. Collective over the group's members. Exposed for tests and callers that hold
// their own MPI groups; NcclContext uses it for the world and for each split.
std::shared_ptr<Communicator> make_nccl_communicator(Communicator & launcher_group, Device & device,
                                                     const std::string & name);

}  // namespace loom::comm::LOOM_NCCL_NS
