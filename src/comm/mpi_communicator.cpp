#include "comm/mpi_communicator.h"

#include "core/error.h"
#include "core/graph.h"

#include <mpi.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <deque>
#include <string>
#include <vector>
#include <map>
#include <mutex>
#include <thread>

namespace loom::comm {

namespace {

std::string mpi_error_string(int code) {
    char buffer[MPI_MAX_ERROR_STRING];
    int  length = 0;
    if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS) {
        return "MPI error " + std::to_string(code);
    }
    return std::string(buffer, length);
}

}  // namespace

}  // namespace loom::comm

#define LOOM_MPI_CHECK(expr)                                                                           \
    LOOM_CHECK_STATUS(expr, MPI_SUCCESS, ::loom::comm::mpi_error_string, "MPI",                        \
                      "check that every rank issues the same collectives in the same order with "      \
                      "matching sizes")

namespace loom::comm {

namespace {

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

bool overlaps(const void * a, size_t a_bytes, const void * b, size_t b_bytes) {
    auto pa = reinterpret_cast<uintptr_t>(a);
    auto pb = reinterpret_cast<uintptr_t>(b);
    return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

int to_int_count(int64_t count, const char * what) {
    LOOM_CHECK(count >= 0 && count <= INT32_MAX,
               what << " of " << count << " elements exceeds MPI's int count",
               "split the operation into pieces of at most 2^31-1 elements");
    return static_cast<int>(count);
}

}  // namespace

class MpiEngine {
public:
    MpiEngine() {
        thread_ = std::thread([this] { loop(); });
        call([this] {
            int provided = 0;
            LOOM_MPI_CHECK(MPI_Init_thread(nullptr, nullptr, MPI_THREAD_MULTIPLE, &provided));
            LOOM_CHECK(provided >= MPI_THREAD_FUNNELED,
                       "the MPI library provides thread level " << provided << ", Loom needs MPI_THREAD_FUNNELED",
                       "use an MPI built with thread support (Debian's Open MPI is)");
            MPI_Comm_set_errhandler(MPI_COMM_WORLD, MPI_ERRORS_RETURN);
            LOOM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &roll_call_comm_));
            MPI_Comm_set_errhandler(roll_call_comm_, MPI_ERRORS_RETURN);
            MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
            for (int i = 0; i < 4; ++i) {
                MPI_Type_contiguous(1 << i, MPI_BYTE, &element_types_[i]);
                MPI_Type_commit(&element_types_[i]);
            }
        });
    }

    ~MpiEngine() {
        call([this] {
            for (MPI_Datatype & t : element_types_) {
                MPI_Type_free(&t);
            }
            for (MPI_Request & r : answers_) MPI_Request_free(&r);
            MPI_Comm_free(&roll_call_comm_);
            MPI_Finalize();
        });
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        thread_.join();
    }

    // Runs fn on the engine thread and waits for it; rethrows what it throws.
    void call(std::function<void()> fn) {
        auto               done = std::make_shared<WorkState>();
        {
            std::lock_guard<std::mutex> lock(mutex_);
            control_.push_back([fn = std::move(fn), done] {
                std::exception_ptr error;
                try {
                    fn();
                } catch (...) {
                    error = std::current_exception();
                }
                done->complete(error);
            });
        }
        wake_.notify_all();
        done->wait();
    }

    // The op's data is ready; post it when its turn on its communicator comes.
    void deliver(std::shared_ptr<MpiOp> op) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            delivered_.push_back(std::move(op));
        }
        wake_.notify_all();
    }

    int new_comm_id() { return next_comm_id_.fetch_add(1); }

    // Engine thread (inside call): names the communicator `comm_id` for the watchdog's roll call. Members
    // of one group register it under the same key: its name, its members and how many groups of that
    // name and membership this process made before it (every member creates them in the same order).
    void register_comm(int comm_id, const std::string & name, const std::vector<int> & members) {
        uint64_t key = 1469598103934665603ull;   // FNV-1a
        auto     mix = [&key](uint64_t v) {
            for (int b = 0; b < 8; ++b) key = (key ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ull;
        };
        for (char c : name) mix(static_cast<uint8_t>(c));
        for (int r : members) mix(static_cast<uint64_t>(r) + 0x100);
        mix(made_[key]++);
        comms_[comm_id] = CommInfo{key, members};
        by_key_[key]    = comm_id;
    }
    void unregister_comm(int comm_id) {
        auto it = comms_.find(comm_id);
        if (it == comms_.end()) return;
        by_key_.erase(it->second.key);
        comms_.erase(it);
    }

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
    void answer_roll_call() {
        if (world_size_ <= 1 || roll_call_comm_ == MPI_COMM_NULL) return;   // NULL: freed before MPI_Finalize
        for (size_t i = 0; i < answers_.size();) {   // answers already sent
            int done = 0;
            MPI_Test(&answers_[i], &done, MPI_STATUS_IGNORE);
            if (done) {
                answers_.erase(answers_.begin() + static_cast<std::ptrdiff_t>(i));
            } else {
                ++i;
            }
        }
        for (;;) {
            int        flag = 0;
            MPI_Status status;
            if (MPI_Iprobe(MPI_ANY_SOURCE, kQuestionTag, roll_call_comm_, &flag, &status) != MPI_SUCCESS || !flag) {
                return;
            }
            RollCallQuestion q;
            MPI_Recv(&q, sizeof(q), MPI_BYTE, status.MPI_SOURCE, kQuestionTag, roll_call_comm_, MPI_STATUS_IGNORE);
            auto a = std::make_shared<RollCallAnswer>();
            a->key = q.key;
            a->seq = q.seq;
            auto it = by_key_.find(q.key);
            if (it != by_key_.end()) {
                const int comm_id = it->second;
                a->posted         = static_cast<int64_t>(queues_[comm_id].next_seq);
            }
            if (!in_flight_.empty()) {   // the oldest operation it waits on, on any group
                const MpiOp & op     = *in_flight_.front();
                const double  waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - op.posted).count();
                char          peer[40] = "";
                if (op.peer >= 0) std::snprintf(peer, sizeof(peer), " with rank %d", op.peer);
                std::snprintf(a->doing, sizeof(a->doing), "waiting %.0f s in %s #%llu%s on group '%s'", waited, op.what,
                              static_cast<unsigned long long>(op.seq), peer, op.group.c_str());
            }
            answers_.emplace_back();
            answer_buffers_.push_back(a);   // kept until the job ends: answers are rare and tiny
            MPI_Isend(a.get(), sizeof(*a), MPI_BYTE, status.MPI_SOURCE, kAnswerTag, roll_call_comm_, &answers_.back());
        }
    }

    // Asks the members of op's group (or its peer) where they are and waits up to `grace` seconds for the
    // answers; returns one line per member that has not done its part.
    std::string roll_call(const MpiOp & op, double grace) {
        auto info = comms_.find(op.comm_id);
        if (world_size_ <= 1 || info == comms_.end()) return "";
        const int        me = process_rank();
        std::vector<int> asked;
        if (op.peer >= 0) {
            if (op.peer < static_cast<int>(info->second.members.size())) asked.push_back(info->second.members[op.peer]);
        } else {
            for (int r : info->second.members) {
                if (r != me) asked.push_back(r);
            }
        }
        question_ = RollCallQuestion{info->second.key, op.seq};   // a member: the sends may outlive this call
        const RollCallQuestion & question = question_;
        std::vector<MPI_Request> sends(asked.size());
        for (size_t i = 0; i < asked.size(); ++i) {
            MPI_Isend(&question, sizeof(question), MPI_BYTE, asked[i], kQuestionTag, roll_call_comm_, &sends[i]);
        }
        std::map<int, RollCallAnswer> answers;
        const auto deadline = std::chrono::steady_clock::now() + std::chrono::duration<double>(grace);
        while (answers.size() < asked.size() && std::chrono::steady_clock::now() < deadline) {
            answer_roll_call();
            int        flag = 0;
            MPI_Status status;
            if (MPI_Iprobe(MPI_ANY_SOURCE, kAnswerTag, roll_call_comm_, &flag, &status) == MPI_SUCCESS && flag) {
                RollCallAnswer a;
                MPI_Recv(&a, sizeof(a), MPI_BYTE, status.MPI_SOURCE, kAnswerTag, roll_call_comm_, MPI_STATUS_IGNORE);
                if (a.key == question.key && a.seq == question.seq) answers[status.MPI_SOURCE] = a;
            } else {
                std::this_thread::sleep_for(std::chrono::milliseconds(1));
            }
        }
        std::string lines;
        char        line[320];
        for (int r : asked) {
            auto it = answers.find(r);
            if (it == answers.end()) {
                std::snprintf(line, sizeof(line),
                              "  rank %d did not answer within %.0f s: it has stopped, crashed, or is blocked inside MPI\n",
                              r, grace);
            } else if (it->second.posted < 0) {
                std::snprintf(line, sizeof(line), "  rank %d answered: it no longer has group '%s'\n", r, op.group.c_str());
            } else if (op.peer < 0 && it->second.posted > static_cast<int64_t>(op.seq)) {
                continue;   // it has posted this collective: it arrived
            } else if (op.peer < 0) {
                std::snprintf(line, sizeof(line),
                              "  rank %d has not arrived: it has posted %lld operation(s) on group '%s', this is #%llu%s%s\n",
                              r, static_cast<long long>(it->second.posted), op.group.c_str(),
                              static_cast<unsigned long long>(op.seq), it->second.doing[0] ? "; it is " : "",
                              it->second.doing);
            } else {
                std::snprintf(line, sizeof(line), "  rank %d answered: it is %s\n", r,
                              it->second.doing[0] ? it->second.doing : "not communicating (busy elsewhere)");
            }
            lines += line;
        }
        for (MPI_Request & r : sends) MPI_Request_free(&r);
        return lines;
    }

    void post(const std::shared_ptr<MpiOp> & op) {
        try {
            op->posted = std::chrono::steady_clock::now();
            op->post(op->requests);
            op->post = nullptr;
            in_flight_.push_back(op);
        } catch (...) {
            op->post = nullptr;
            op->finish = nullptr;
            op->work->complete(std::current_exception());
        }
    }

    // Aborts the job when `op` has been in flight past the timeout: a peer has stopped, crashed or skipped
    // the operation, and every rank would otherwise wait forever (NCCL's watchdog does the same).
    void watch(const MpiOp & op) {
        const double timeout = timeout_s_.load();
        if (timeout <= 0) return;
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - op.posted).count();
        if (waited < timeout) return;
        char peer[64] = "";
        if (op.peer >= 0) std::snprintf(peer, sizeof(peer), " with rank %d of the group", op.peer);
        const std::string missing = roll_call(op, std::clamp(timeout / 5, 1.0, 10.0));
        std::fprintf(stderr,
                     "[rank %d] loom: %s%s on group '%s' has not completed after %.0f s: %s has stopped, crashed "
                     "or is not taking part; aborting the job (--distributed-timeout-minutes)\n%s",
                     process_rank(), op.what, peer, op.group.c_str(), waited,
                     op.peer >= 0 ? "that rank" : "another rank of the group", missing.c_str());
        std::fflush(stderr);
        MPI_Abort(MPI_COMM_WORLD, 1);
        std::_Exit(1);
    }

    // Tests every operation in flight once; returns true if any completed.
    bool progress() {
        bool any = false;
        for (size_t i = 0; i < in_flight_.size();) {
            std::shared_ptr<MpiOp> & op = in_flight_[i];
            int                      flag = 0;
            std::vector<MPI_Status>  statuses(op->requests.size());
            std::exception_ptr       error;
            try {
                if (op->requests.empty()) {
                    flag = 1;
                } else {
                    LOOM_MPI_CHECK(MPI_Testall(static_cast<int>(op->requests.size()), op->requests.data(),
                                               &flag, statuses.data()));
                }
                if (flag && op->finish) {
                    op->finish(statuses);
                }
            } catch (...) {
                error = std::current_exception();
                flag  = 1;
            }
            if (!flag) watch(*op);
            if (flag) {
                // Drop the operation's tensors before anyone can see it complete: a caller that frees
                // its buffers after wait() then finds the allocator's statistics already settled.
                op->finish = nullptr;
                op->work->complete(error);
                in_flight_.erase(in_flight_.begin() + static_cast<std::ptrdiff_t>(i));
                any = true;
            } else {
                ++i;
            }
        }
        return any;
    }

    void loop() {
        int idle_polls = 0;
        for (;;) {
            std::deque<std::function<void()>>   control;
            std::vector<std::shared_ptr<MpiOp>> delivered;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                auto has_news = [this] { return stop_ || !control_.empty() || !delivered_.empty(); };
                if (in_flight_.empty() && world_size_ <= 1) {
                    wake_.wait(lock, has_news);
                } else if (in_flight_.empty()) {
                    // Stay able to answer a roll call while idle (another rank's watchdog may ask).
                    wake_.wait_for(lock, std::chrono::milliseconds(50), has_news);
                } else if (idle_polls > 64) {
                    // Operations are in flight but nothing moves: poll less often, stay wakeable.
                    wake_.wait_for(lock, std::chrono::microseconds(idle_polls > 1024 ? 200 : 20), has_news);
                }
                if (stop_ && control_.empty() && delivered_.empty() && in_flight_.empty()) {
                    return;
                }
                control.swap(control_);
                delivered.swap(delivered_);
            }
            for (auto & fn : control) {
                fn();
            }
            bool moved = !control.empty();
            for (auto & op : delivered) {
                queues_[op->comm_id].ready.emplace(op->seq, std::move(op));
            }
            for (auto & [id, queue] : queues_) {
                for (auto it = queue.ready.find(queue.next_seq); it != queue.ready.end();
                     it = queue.ready.find(queue.next_seq)) {
                    post(it->second);
                    queue.ready.erase(it);
                    ++queue.next_seq;
                    moved = true;
                }
            }
            moved      = progress() || moved;
            idle_polls = moved ? 0 : idle_polls + 1;
            const auto now = std::chrono::steady_clock::now();
            if (now - last_roll_call_check_ > std::chrono::milliseconds(10)) {
                last_roll_call_check_ = now;
                answer_roll_call();
            }
        }
    }

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

namespace {

MPI_Datatype reduce_type(DType dtype) {
    switch (dtype) {
        case DType::i32: return MPI_INT32_T;
        case DType::i64: return MPI_INT64_T;
        default:         return MPI_FLOAT;   // f32, and bf16/f16 staged as f32
    }
}

MPI_Op reduce_mpi_op(ReduceOp op) {
    switch (op) {
        case ReduceOp::max: return MPI_MAX;
        case ReduceOp::min: return MPI_MIN;
        default:            return MPI_SUM;   // avg = sum, then / size
    }
}

// An f32 staging tensor in the "comm" pool of t's allocator.
Tensor staging_f32(const Tensor & t, int64_t numel) {
    return Tensor::empty({numel}, DType::f32, t.device(), TensorOptions{t.memory_kind(), "comm"});
}

void scale_f32(float * data, int64_t n, float factor) {
    for (int64_t i = 0; i < n; ++i) {
        data[i] *= factor;
    }
}

class MpiCommunicator : public Communicator {
public:
    MpiCommunicator(std::shared_ptr<MpiEngine> engine, MPI_Comm comm, std::vector<int> global_ranks,
                    std::string name)
        : engine_(std::move(engine)),
          comm_(comm),
          id_(engine_->new_comm_id()),
          global_ranks_(std::move(global_ranks)),
          name_(std::move(name)) {
        engine_->call([this] {
            MPI_Comm_rank(comm_, &rank_);
            MPI_Comm_size(comm_, &size_);
            MPI_Comm_set_errhandler(comm_, MPI_ERRORS_RETURN);
            engine_->register_comm(id_, name_, global_ranks_);
        });
    }

    ~MpiCommunicator() override {
        engine_->call([this] {
            engine_->unregister_comm(id_);
            MPI_Comm_free(&comm_);
        });
    }

    int                      rank() const override { return rank_; }
    int                      size() const override { return size_; }
    const std::vector<int> & global_ranks() const override { return global_ranks_; }
    const std::string &      name() const override { return name_; }

protected:
    WorkPtr do_all_reduce(const Tensor & t, ReduceOp op, Stream * stream) override {
        auto mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "all_reduce";
        int  count  = to_int_count(t.numel(), "all_reduce");
        bool staged = t.dtype() == DType::bf16 || t.dtype() == DType::f16;
        MPI_Comm comm = comm_;
        int      size = size_;
        auto     staging = std::make_shared<Tensor>();
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            void * buffer = t.data_ptr();
            if (staged) {
                *staging = staging_f32(t, t.numel());
                convert(t.data_ptr(), t.dtype(), staging->data_ptr(), DType::f32, t.numel());
                buffer = staging->data_ptr();
            }
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Iallreduce(MPI_IN_PLACE, buffer, count, reduce_type(t.dtype()), reduce_mpi_op(op),
                                          comm, &requests.back()));
        };
        mpi_op->finish = [=](const std::vector<MPI_Status> &) {
            float * result = staged ? staging->data<float>() : (t.dtype() == DType::f32 ? t.data<float>() : nullptr);
            if (op == ReduceOp::avg) {
                scale_f32(result, t.numel(), 1.0f / static_cast<float>(size));
            }
            if (staged) {
                convert(result, DType::f32, t.data_ptr(), t.dtype(), t.numel());
                *staging = Tensor();
            }
        };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream) override {
        auto mpi_op  = std::make_shared<MpiOp>();
        mpi_op->what = "reduce_scatter";
        int  count   = to_int_count(out.numel(), "reduce_scatter");
        bool staged  = in.dtype() == DType::bf16 || in.dtype() == DType::f16;
        // MPI forbids aliasing send and receive buffers: receive into staging when out overlaps in.
        bool aliased = overlaps(in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes());
        MPI_Comm comm = comm_;
        int      size = size_;
        auto     staged_in  = std::make_shared<Tensor>();
        auto     staged_out = std::make_shared<Tensor>();
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            const void * send = in.data_ptr();
            void *       recv = out.data_ptr();
            if (staged) {
                *staged_in = staging_f32(in, in.numel());
                convert(in.data_ptr(), in.dtype(), staged_in->data_ptr(), DType::f32, in.numel());
                send = staged_in->data_ptr();
            }
            if (staged || aliased) {
                *staged_out = Tensor::empty({out.numel()}, staged ? DType::f32 : out.dtype(), out.device(),
                                            TensorOptions{out.memory_kind(), "comm"});
                recv = staged_out->data_ptr();
            }
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Ireduce_scatter_block(send, recv, count, reduce_type(in.dtype()), reduce_mpi_op(op),
                                                     comm, &requests.back()));
        };
        mpi_op->finish = [=](const std::vector<MPI_Status> &) {
            const Tensor & result = (staged || aliased) ? *staged_out : out;
            if (op == ReduceOp::avg && result.dtype() == DType::f32) {
                scale_f32(result.data<float>(), result.numel(), 1.0f / static_cast<float>(size));
            }
            if (staged) {
                convert(result.data_ptr(), DType::f32, out.data_ptr(), out.dtype(), out.numel());
            } else if (aliased) {
                std::memcpy(out.data_ptr(), result.data_ptr(), out.nbytes());
            }
            *staged_in  = Tensor();
            *staged_out = Tensor();
        };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_all_gather(const Tensor & in, const Tensor & out, Stream * stream) override {
        auto   mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "all_gather";
        int    count  = to_int_count(in.numel(), "all_gather");
        size_t block  = in.nbytes();
        // The distributed optimizer gathers a shard that is a view of its own slot in the full buffer:
        // that is MPI_IN_PLACE. Any other overlap goes through a staging copy of the input.
        bool in_place = in.data_ptr() == static_cast<char *>(out.data_ptr()) + block * rank_;
        bool aliased  = !in_place && overlaps(in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes());
        MPI_Comm     comm  = comm_;
        MPI_Datatype type  = engine_->element_type(dtype_size(in.dtype()));
        auto         staged_in = std::make_shared<Tensor>();
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            const void * send = in_place ? MPI_IN_PLACE : in.data_ptr();
            if (aliased) {
                *staged_in = Tensor::empty({in.numel()}, in.dtype(), in.device(), TensorOptions{in.memory_kind(), "comm"});
                staged_in->copy_from(in);
                send = staged_in->data_ptr();
            }
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Iallgather(send, count, type, out.data_ptr(), count, type, comm, &requests.back()));
        };
        mpi_op->finish = [=](const std::vector<MPI_Status> &) { *staged_in = Tensor(); };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_broadcast(const Tensor & t, int root, Stream * stream) override {
        auto         mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "broadcast";
        int          count  = to_int_count(t.numel(), "broadcast");
        MPI_Comm     comm   = comm_;
        MPI_Datatype type   = engine_->element_type(dtype_size(t.dtype()));
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Ibcast(t.data_ptr(), count, type, root, comm, &requests.back()));
        };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                          std::span<const int64_t> recv_counts, Stream * stream) override {
        auto mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "all_to_all";
        auto counts = std::make_shared<std::vector<int>>(4 * size_);   // send counts, send displs, recv ...
        int64_t send_offset = 0;
        int64_t recv_offset = 0;
        for (int p = 0; p < size_; ++p) {
            (*counts)[p]             = to_int_count(send_counts[p], "all_to_all block");
            (*counts)[size_ + p]     = to_int_count(send_offset, "all_to_all offset");
            (*counts)[2 * size_ + p] = to_int_count(recv_counts[p], "all_to_all block");
            (*counts)[3 * size_ + p] = to_int_count(recv_offset, "all_to_all offset");
            send_offset += send_counts[p];
            recv_offset += recv_counts[p];
        }
        MPI_Comm     comm = comm_;
        int          size = size_;
        MPI_Datatype type = engine_->element_type(dtype_size(in.dtype()));
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            const int * c = counts->data();
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Ialltoallv(in.data_ptr(), c, c + size, type, out.data_ptr(), c + 2 * size,
                                          c + 3 * size, type, comm, &requests.back()));
        };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_send(const Tensor & t, int peer, int tag, Stream * stream) override {
        check_tag(tag);
        auto         mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "send";
        mpi_op->peer = peer;
        int          count  = to_int_count(t.numel(), "send");
        MPI_Comm     comm   = comm_;
        MPI_Datatype type   = engine_->element_type(dtype_size(t.dtype()));
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Isend(t.data_ptr(), count, type, peer, tag, comm, &requests.back()));
        };
        return issue(std::move(mpi_op), stream, /*stream_waits=*/false);
    }

    WorkPtr do_recv(const Tensor & t, int peer, int tag, Stream * stream) override {
        check_tag(tag);
        auto         mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "recv";
        mpi_op->peer = peer;
        int          count  = to_int_count(t.numel(), "recv");
        MPI_Comm     comm   = comm_;
        MPI_Datatype type   = engine_->element_type(dtype_size(t.dtype()));
        std::string  name   = name_;
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Irecv(t.data_ptr(), count, type, peer, tag, comm, &requests.back()));
        };
        mpi_op->finish = [=](const std::vector<MPI_Status> & statuses) {
            int received = 0;
            MPI_Get_count(&statuses[0], type, &received);
            LOOM_CHECK(received == count,
                       name << ".recv from rank " << peer << " tag " << tag << ": expected " << count
                            << " elements, received " << received,
                       "the sender's tensor must have the receiver's number of elements and dtype");
        };
        return issue(std::move(mpi_op), stream);
    }

    WorkPtr do_barrier(Stream * stream) override {
        auto     mpi_op = std::make_shared<MpiOp>();
        mpi_op->what = "barrier";
        MPI_Comm comm   = comm_;
        mpi_op->post = [=](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Ibarrier(comm, &requests.back()));
        };
        return issue(std::move(mpi_op), stream);
    }

private:
    void check_tag(int tag) const {
        LOOM_CHECK(tag <= 32767, name_ << ": tag " << tag << " is above 32767, the largest tag MPI guarantees",
                   "use tags in [0, 32767]");
    }

    WorkPtr issue(std::shared_ptr<MpiOp> op, Stream * stream, bool stream_waits = true) {
        op->comm_id = id_;
        op->group   = name_;
        if (stream != nullptr && stream->capture() != nullptr) return capture(*op, *stream, stream_waits);
        op->seq     = next_seq_->fetch_add(1);
        std::shared_ptr<WorkState> work = op->work;
        if (stream == nullptr) {
            engine_->deliver(std::move(op));
        } else {
            std::shared_ptr<MpiEngine> engine = engine_;
            stream->submit([engine, op] { engine->deliver(op); });
            if (stream_waits) stream->submit([work] { work->wait(); });
        }
        return work;
    }

    // While `stream` captures a graph the operation is a template: every replay issues a fresh copy, with
    // the next sequence number of the communicator taken when the replay is enqueued (host order, as an
    // eager call would take it) and its own completion. The template's tensors are held by the node, so
    // the graph counts them as its own (Graph::collect).
    WorkPtr capture(const MpiOp & op, Stream & stream, bool stream_waits) {
        MpiOp tmpl = op;
        tmpl.work  = nullptr;
        stream.submit_replayable([engine = engine_, next_seq = next_seq_, tmpl, stream_waits]() -> std::function<void()> {
            auto copy  = std::make_shared<MpiOp>(tmpl);
            copy->seq  = next_seq->fetch_add(1);
            copy->work = std::make_shared<WorkState>();
            return [engine, copy, stream_waits] {
                engine->deliver(copy);
                if (stream_waits) copy->work->wait();
            };
        }, op.what);
        return std::make_shared<CapturedWork>(stream.capture()->name());
    }

    std::shared_ptr<MpiEngine>             engine_;
    MPI_Comm                               comm_;
    int                                    id_;
    int                                    rank_ = 0;
    int                                    size_ = 1;
    std::vector<int>                       global_ranks_;
    std::string                            name_;
    std::shared_ptr<std::atomic<uint64_t>> next_seq_ = std::make_shared<std::atomic<uint64_t>>(0);
};

std::atomic<bool> g_context_alive{false};

}  // namespace

MpiContext::MpiContext() {
    LOOM_CHECK(!g_context_alive.exchange(true), "a second MpiContext in one process",
               "create one MpiContext in main() and pass its communicators down");
    engine_ = std::make_shared<MpiEngine>();
    MPI_Comm world = MPI_COMM_NULL;
    engine_->call([&] {
        LOOM_MPI_CHECK(MPI_Comm_dup(MPI_COMM_WORLD, &world));
        MPI_Comm_rank(MPI_COMM_WORLD, &world_rank_);
        MPI_Comm_size(MPI_COMM_WORLD, &world_size_);
    });
    set_process_rank(world_rank_);
    std::vector<int> ranks(world_size_);
    for (int r = 0; r < world_size_; ++r) {
        ranks[r] = r;
    }
    world_ = std::make_shared<MpiCommunicator>(engine_, world, std::move(ranks), "world");
}

MpiContext::~MpiContext() {
    world_.reset();
    engine_.reset();   // finalises MPI once the last communicator holding the engine is gone
    g_context_alive = false;
}

std::shared_ptr<Communicator> MpiContext::split(const std::vector<std::vector<int>> & groups,
                                                const std::string & name) {
    int color = MPI_UNDEFINED;
    int key   = 0;
    std::vector<int> members;
    std::vector<int> seen(world_size_, 0);
    for (size_t g = 0; g < groups.size(); ++g) {
        for (size_t i = 0; i < groups[g].size(); ++i) {
            int r = groups[g][i];
            LOOM_CHECK(r >= 0 && r < world_size_,
                       "group '" << name << "' names rank " << r << " in a world of " << world_size_, "");
            LOOM_CHECK(seen[r]++ == 0, "group '" << name << "' lists rank " << r << " twice",
                       "groups of one split must be disjoint");
            if (r == world_rank_) {
                color   = static_cast<int>(g);
                key     = static_cast<int>(i);
                members = groups[g];
            }
        }
    }
    MPI_Comm comm = MPI_COMM_NULL;
    engine_->call([&] { LOOM_MPI_CHECK(MPI_Comm_split(MPI_COMM_WORLD, color, key, &comm)); });
    if (color == MPI_UNDEFINED) {
        return nullptr;
    }
    return std::make_shared<MpiCommunicator>(engine_, comm, std::move(members), name);
}

void MpiContext::set_timeout(double seconds) {
    if (const char * seam = std::getenv("LOOM_DISTRIBUTED_TIMEOUT_S")) seconds = std::strtod(seam, nullptr);
    engine_->set_timeout(seconds);
}

void MpiContext::abort(int exit_code) {
    MPI_Abort(MPI_COMM_WORLD, exit_code);
    std::_Exit(exit_code);
}

}  // namespace loom::comm
