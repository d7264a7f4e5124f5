#include "comm/mpi_engine.h"

#include "core/error.h"

#include <mpi.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <string>
#include <thread>
#include <vector>

namespace loom::comm {

std::string mpi_error_string(int code) {
    char buffer[MPI_MAX_ERROR_STRING];
    int  length = 0;
    if (MPI_Error_string(code, buffer, &length) != MPI_SUCCESS) {
        return "MPI error " + std::to_string(code);
    }
    return std::string(buffer, length);
}

MpiEngine::MpiEngine() {
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

MpiEngine::~MpiEngine() {
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

void MpiEngine::call(std::function<void()> fn) {
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

void MpiEngine::deliver(std::shared_ptr<MpiOp> op) {
    {
        std::lock_guard<std::mutex> lock(mutex_);
        delivered_.push_back(std::move(op));
    }
    wake_.notify_all();
}

void MpiEngine::register_comm(int comm_id, const std::string & name, const std::vector<int> & members) {
    uint64_t key = 1469598103934665603ull;   // FNV-1a
    auto     mix = [&key](uint64_t v) {
        for (int b = 0; b < 8; ++b) key = (key ^ ((v >> (8 * b)) & 0xff)) * 1099511628211ull;
    };
    for (char c : name) mix(static_cast<uint8_t>(c));
    for (int r : members) mix(static_cast<uint64_t>(r) + 0x100);
    mix(made_[key]++);
    comms_[comm_id] = CommInfo{key, members, name, {}};
    by_key_[key]    = comm_id;
}

int MpiEngine::register_external(const std::string & name, const std::vector<int> & members, RollCallSubject subject) {
    const int id = new_comm_id();
    call([&] {
        register_comm(id, name, members);
        comms_[id].subject = std::move(subject);
    });
    return id;
}

void MpiEngine::unregister_external(int id) {
    call([&] { unregister_comm(id); });
}

std::string MpiEngine::roll_call_external(int id, uint64_t seq, int peer, double grace) {
    std::string lines;
    call([&] {
        auto info = comms_.find(id);
        if (info == comms_.end()) return;
        MpiOp op;
        op.comm_id = id;
        op.seq     = seq;
        op.peer    = peer;
        op.group   = info->second.name;
        lines      = roll_call(op, grace);
    });
    return lines;
}

void MpiEngine::unregister_comm(int comm_id) {
    auto it = comms_.find(comm_id);
    if (it == comms_.end()) return;
    by_key_.erase(it->second.key);
    comms_.erase(it);
}

void MpiEngine::answer_roll_call() {
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
            const int        comm_id = it->second;
            const CommInfo & info    = comms_[comm_id];
            a->posted = static_cast<int64_t>(info.subject.posted ? info.subject.posted->load() : queues_[comm_id].next_seq);
        }
        if (!in_flight_.empty()) {   // the oldest operation it waits on, on any group
            const MpiOp & op     = *in_flight_.front();
            const double  waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - op.posted).count();
            char          peer[40] = "";
            if (op.peer >= 0) std::snprintf(peer, sizeof(peer), " with rank %d", op.peer);
            std::snprintf(a->doing, sizeof(a->doing), "waiting %.0f s in %s #%llu%s on group '%s'", waited, op.what,
                          static_cast<unsigned long long>(op.seq), peer, op.group.c_str());
        } else {   // or what it waits on in another transport (an NCCL operation)
            for (const auto & [id, info] : comms_) {
                if (!info.subject.doing) continue;
                const std::string doing = info.subject.doing();
                if (doing.empty()) continue;
                std::snprintf(a->doing, sizeof(a->doing), "%s", doing.c_str());
                break;
            }
        }
        answers_.emplace_back();
        answer_buffers_.push_back(a);   // kept until the job ends: answers are rare and tiny
        MPI_Isend(a.get(), sizeof(*a), MPI_BYTE, status.MPI_SOURCE, kAnswerTag, roll_call_comm_, &answers_.back());
    }
}

std::string MpiEngine::roll_call(const MpiOp & op, double grace) {
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

void MpiEngine::post(const std::shared_ptr<MpiOp> & op) {
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

void MpiEngine::watch(const MpiOp & op) {
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

bool MpiEngine::progress() {
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

void MpiEngine::loop() {
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

}  // namespace loom::comm
