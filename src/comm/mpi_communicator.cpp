#include "comm/mpi_communicator.h"

#include "comm/mpi_engine.h"
#include "core/error.h"
#include "core/graph.h"

#include <mpi.h>

#include <atomic>
#include <cstdlib>
#include <cstring>
#include <string>
#include <vector>

namespace loom::comm {

namespace {

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

MPI_Datatype reduce_type(DType dtype) {
    switch (dtype) {
        case DType::i32: return MPI_INT32_T;
        case DType::i64: return MPI_INT64_T;
        case DType::f64: return MPI_DOUBLE;
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

    // The engine answers and asks for another transport's group over these members (its watchdog).
    std::unique_ptr<RollCallChannel> open_roll_call(const std::string & name, RollCallSubject subject) override {
        class Channel : public RollCallChannel {
        public:
            Channel(std::shared_ptr<MpiEngine> engine, int id) : engine_(std::move(engine)), id_(id) {}
            ~Channel() override { engine_->unregister_external(id_); }
            std::string ask(uint64_t seq, int peer, double grace) override {
                return engine_->roll_call_external(id_, seq, peer, grace);
            }

        private:
            std::shared_ptr<MpiEngine> engine_;
            int                        id_;
        };
        const int id = engine_->register_external(name, global_ranks_, std::move(subject));
        return std::make_unique<Channel>(engine_, id);
    }

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
            if (op == ReduceOp::avg && t.dtype() == DType::f64) {
                double * result = t.data<double>();
                for (int64_t i = 0; i < t.numel(); ++i) result[i] /= static_cast<double>(size);
            } else if (op == ReduceOp::avg) {
                float * result = staged ? staging->data<float>() : t.data<float>();
                scale_f32(result, t.numel(), 1.0f / static_cast<float>(size));
            }
            if (staged) {
                convert(staging->data_ptr(), DType::f32, t.data_ptr(), t.dtype(), t.numel());
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
            } else if (op == ReduceOp::avg && result.dtype() == DType::f64) {
                double * values = result.data<double>();
                for (int64_t i = 0; i < result.numel(); ++i) values[i] /= static_cast<double>(size);
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
        auto [mpi_op, count, type] = point_to_point("send", t, peer, tag);
        MPI_Comm comm = comm_;
        mpi_op->post  = [=, count = count, type = type](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Isend(t.data_ptr(), count, type, peer, tag, comm, &requests.back()));
        };
        return issue(std::move(mpi_op), stream, /*stream_waits=*/false);
    }

    WorkPtr do_recv(const Tensor & t, int peer, int tag, Stream * stream) override {
        auto [mpi_op, count, type] = point_to_point("recv", t, peer, tag);
        MPI_Comm    comm = comm_;
        std::string name = name_;
        mpi_op->post     = [=, count = count, type = type](std::vector<MPI_Request> & requests) {
            requests.emplace_back();
            LOOM_MPI_CHECK(MPI_Irecv(t.data_ptr(), count, type, peer, tag, comm, &requests.back()));
        };
        mpi_op->finish = [=, count = count, type = type](const std::vector<MPI_Status> & statuses) {
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
    // A send's or receive's operation (tag checked) with the element count and MPI type of `t`.
    struct PointToPoint {
        std::shared_ptr<MpiOp> op;
        int                    count;
        MPI_Datatype           type;
    };
    PointToPoint point_to_point(const char * what, const Tensor & t, int peer, int tag) const {
        check_tag(tag);
        auto mpi_op  = std::make_shared<MpiOp>();
        mpi_op->what = what;
        mpi_op->peer = peer;
        return {mpi_op, to_int_count(t.numel(), what), engine_->element_type(dtype_size(t.dtype()))};
    }

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
            const char * what = op->what;   // a literal: it outlives the profile's record
            stream->submit([engine, op] { engine->deliver(op); }, what);
            if (stream_waits) stream->submit([work] { work->wait(); }, what);
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
