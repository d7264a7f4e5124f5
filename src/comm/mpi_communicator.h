// The MPI backend of Communicator, for tensors in host memory (the CPU backend).
//
// Threading. One engine thread per process makes every MPI call: it initialises MPI, creates and frees
// communicators, posts nonblocking operations (MPI_Iallreduce, MPI_Isend, ...) and drives them to
// completion with MPI_Testall, then finalises. Callers on any thread (the host, CPU stream workers)
// only hand it operations, so MPI is used from a single thread whatever the caller does, and no caller
// ever blocks inside MPI.
//
//   caller ──issue(op, seq)──> [stream: after earlier work] ──deliver──> engine: post in seq order
//                                                                        ──test──> finish, Work done
//
// Ordering. Each operation takes a sequence number of its communicator when it is issued; the engine
// posts a communicator's operations strictly in that order, even when one issued on a busy stream
// arrives after a later one issued without a stream. Operations on different communicators progress
// independently.
//
// Watchdog. The engine sees every operation in flight; one in flight longer than the timeout (set_timeout)
// means a peer stopped, crashed or never issued it, so the engine says so on stderr and aborts the job
// instead of letting every rank wait forever. Before it aborts it takes a roll call of the group (of the
// peer, for a send or recv) on a communicator of its own: every engine answers from its loop with how many
// operations it has posted on the group and what it is waiting on, so the message names each rank that did
// not arrive, and says whether it did not answer (stopped, crashed) or is busy or waiting elsewhere.
//
// 16-bit reductions are staged through an f32 buffer from the "comm" pool of the tensor's allocator:
// convert up, reduce in f32, convert down once.
#pragma once

#include "comm/communicator.h"

#include <memory>

namespace loom::comm {

class MpiEngine;

class MpiContext : public CommunicatorFactory {
public:
    // Initialises MPI (once per process; a second context in the same process is an error).
    MpiContext();
    ~MpiContext() override;
    MpiContext(const MpiContext &) = delete;
    MpiContext & operator=(const MpiContext &) = delete;

    int world_rank() const { return world_rank_; }
    int world_size() const { return world_size_; }

    std::shared_ptr<Communicator> world() override { return world_; }
    std::shared_ptr<Communicator> split(const std::vector<std::vector<int>> & groups,
                                        const std::string & name) override;

    // The watchdog: an operation that has been in flight for `seconds` (default 600, Megatron's
    // --distributed-timeout-minutes 10) prints which operation and group on stderr and aborts the job.
    // LOOM_DISTRIBUTED_TIMEOUT_S overrides it (a test seam).
    void set_timeout(double seconds) override;

    // Terminates every rank of the job (after an error on this one, so the others do not hang).
    [[noreturn]] void abort(int exit_code);

private:
    std::shared_ptr<MpiEngine>    engine_;
    std::shared_ptr<Communicator> world_;
    int                           world_rank_ = 0;
    int                           world_size_ = 1;
};

}  // namespace loom::comm
