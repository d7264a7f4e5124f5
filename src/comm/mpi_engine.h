// The MPI progress engine behind MpiCommunicator. Internal to the comm library: only
// mpi_communicator.cpp includes it; mpi_communicator.h explains the design from the caller's side.
//
// One engine thread per process owns every MPI call: it initialises and finalises MPI, runs what callers
// hand it with call() (creating and freeing communicators), posts the nonblocking operations (MpiOp) that
// they deliver and drives them to completion with MPI_Testall, completing each operation's WorkState.
// Operations start in issue order per communicator: each carries a sequence number of its communicator,
// and the engine posts them in that order whatever order they are delivered in.
//
// The watchdog: an operation in flight past the timeout means a member of its group stopped, crashed or
// skipped it, and every rank would otherwise wait forever. The engine first takes a roll call of the
// group's members (of the peer, for a send or recv) on a communicator of its own, so its message names the
// ranks that did not arrive, then aborts the job.
//
// These names live in loom::comm, where mpi_communicator.h declares MpiEngine, but are not part of the
// library's interface.
#pragma once

#include "comm/communicator.h"
#include "core/error.h"

#include <mpi.h>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <deque>
#include <exception>
#include <functional>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace loom::comm {

// The text of an MPI error code (LOOM_MPI_CHECK's message).
std::string mpi_error_string(int code);

}  // namespace loom::comm

#define LOOM_MPI_CHECK(expr)                                                                           \
    LOOM_CHECK_STATUS(expr, MPI_SUCCESS, ::loom::comm::mpi_error_string, "MPI",                        \
                      "check that every rank issues the same collectives in the same order with "      \
                      "matching sizes")

namespace loom::comm {

// Completion state shared by the caller's Work, the engine and stream tasks.
class WorkState : public Work {
public:
    void wait() override {
        std::unique_lock<std::mutex> lock(mutex_);
        done_cv_.wait(lock, [this] { return done_; });
        if (error_) {
            std::rethrow_exception(error_);
        }
    }

    bool test() override {
        std::lock_guard<std::mutex> lock(mutex_);
        return done_;
    }

    void complete(std::exception_ptr error) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            done_  = true;
            error_ = std::move(error);
        }
        done_cv_.notify_all();
    }

private:
    std::mutex              mutex_;
    std::condition_variable done_cv_;
    bool                    done_ = false;
    std::exception_ptr      error_;
};

// One operation on its way through the engine.
struct MpiOp {
    int                                       comm_id = 0;
    uint64_t                                  seq     = 0;
    // Posts the nonblocking MPI calls (engine thread), appending their requests.
    std::function<void(std::vector<MPI_Request> &)> post;
    // Runs once every request has completed (engine thread): unstage, check received sizes.
    std::function<void(const std::vector<MPI_Status> &)> finish;
    std::shared_ptr<WorkState>                work = std::make_shared<WorkState>();
    std::vector<MPI_Request>                  requests;
    // For the watchdog's message: the operation, its group, and when it was posted.
    const char *                              what = "";
    int                                       peer = -1;   // send / recv: the other rank (in the group)
    std::string                               group;
    std::chrono::steady_clock::time_point     posted;
};

class MpiEngine {
public:
    MpiEngine();
    ~MpiEngine();

    // Runs fn on the engine thread and waits for it; rethrows what it throws.
    void call(std::function<void()> fn);

    // The op's data is ready; post it when its turn on its communicator comes.
    void deliver(std::shared_ptr<MpiOp> op);

    int new_comm_id() { return next_comm_id_.fetch_add(1); }

    // Engine thread (inside call): names the communicator `comm_id` for the watchdog's roll call. Members
    // of one group register it under the same key: its name, its members and how many groups of that
    // name and membership this process made before it (every member creates them in the same order).
    void register_comm(int comm_id, const std::string & name, const std::vector<int> & members);
    void unregister_comm(int comm_id);

    // A group of another transport over `members` (comm/communicator.h's RollCallSubject: NCCL's), known to
    // the roll call as a communicator is: this engine answers other ranks' questions about it from the
    // subject, and asks about it for that transport's watchdog. Any thread; returns its id.
    int         register_external(const std::string & name, const std::vector<int> & members, RollCallSubject subject);
    void        unregister_external(int id);
    // The roll call for operation #seq of that group (`peer`: its group rank, for a send or recv), taken on
    // the engine thread; returns the lines naming the members that have not done their part.
    std::string roll_call_external(int id, uint64_t seq, int peer, double grace);

    // The watchdog: an operation in flight longer than this ends the job (0: never).
    void set_timeout(double seconds) { timeout_s_.store(seconds); }

    // An MPI datatype of `bytes` contiguous bytes (1, 2, 4 or 8): counts are in elements, not bytes.
    MPI_Datatype element_type(size_t bytes) const {
        switch (bytes) {
            case 1: return element_types_[0];
            case 2: return element_types_[1];
            case 4: return element_types_[2];
            default: return element_types_[3];
        }
    }

private:
    struct CommQueue {
        uint64_t                                        next_seq = 0;
        std::map<uint64_t, std::shared_ptr<MpiOp>>      ready;
    };
    struct CommInfo {
        uint64_t         key = 0;
        std::vector<int> members;   // world ranks
        std::string      name;
        RollCallSubject  subject;   // another transport's group: what it has posted and waits on
    };
    // The roll call: when an operation times out, its rank asks the other members of the group where
    // they are, on a communicator of its own, and every engine answers from its loop, also while it
    // waits on something else. A member that does not answer has stopped, crashed or is blocked inside
    // MPI; one that answers says how many operations it has posted on the group and what it is waiting on.
    struct RollCallQuestion {
        uint64_t key = 0, seq = 0;
    };
    struct RollCallAnswer {
        uint64_t key = 0, seq = 0;
        int64_t  posted = -1;   // operations posted on the group; -1: the group is unknown (freed)
        char     doing[120] = {};   // the oldest operation it waits on; empty: none
    };
    static constexpr int kQuestionTag = 32001;
    static constexpr int kAnswerTag   = 32002;

    // Answers every question that has arrived (engine thread; cheap when none has).
    void answer_roll_call();

    // Asks the members of op's group (or its peer) where they are and waits up to `grace` seconds for the
    // answers; returns one line per member that has not done its part.
    std::string roll_call(const MpiOp & op, double grace);

    void post(const std::shared_ptr<MpiOp> & op);

    // Aborts the job when `op` has been in flight past the timeout: a peer has stopped, crashed or skipped
    // the operation, and every rank would otherwise wait forever (NCCL's watchdog does the same).
    void watch(const MpiOp & op);

    // Tests every operation in flight once; returns true if any completed.
    bool progress();

    void loop();

    std::thread                            thread_;
    std::mutex                             mutex_;
    std::condition_variable                wake_;
    bool                                   stop_ = false;
    std::deque<std::function<void()>>      control_;
    std::vector<std::shared_ptr<MpiOp>>    delivered_;
    // Engine thread only:
    std::map<int, CommQueue>               queues_;
    std::vector<std::shared_ptr<MpiOp>>    in_flight_;
    MPI_Datatype                           element_types_[4] = {};
    std::atomic<int>                       next_comm_id_{0};
    std::atomic<double>                    timeout_s_{600.0};   // Megatron's --distributed-timeout-minutes 10
    // The roll call (engine thread only):
    int                                    world_size_     = 1;
    MPI_Comm                               roll_call_comm_ = MPI_COMM_NULL;
    std::map<int, CommInfo>                comms_;
    std::map<uint64_t, int>                by_key_;
    std::map<uint64_t, uint64_t>           made_;
    std::vector<MPI_Request>               answers_;
    std::vector<std::shared_ptr<RollCallAnswer>> answer_buffers_;
    RollCallQuestion                       question_;
    std::chrono::steady_clock::time_point  last_roll_call_check_;
};

}  // namespace loom::comm
