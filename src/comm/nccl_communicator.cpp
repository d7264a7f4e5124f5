#include "comm/nccl_communicator.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_stream.h"
#include "core/error.h"
#include "core/graph.h"

#include <cuda_runtime.h>
#include <nccl.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <functional>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace loom::comm::inline LOOM_NCCL_NS {

namespace {

// NCCL's description of `status`, and, with a communicator, its last error message (the detail NCCL
// otherwise prints only under NCCL_DEBUG=WARN).
std::string nccl_status_text(ncclResult_t status, ncclComm_t comm) {
    std::string text = ncclGetErrorString(status);
    if (comm != nullptr) {
        const char * last = ncclGetLastError(comm);
        if (last != nullptr && *last != '\0') text += std::string(" (") + last + ")";
    }
    return text;
}

}  // namespace

}  // namespace loom::comm::LOOM_NCCL_NS

// Every NCCL and CUDA call of the communicator names the call, the operation and the group.
#define LOOM_NCCL_OP_CHECK(expr, handle, op, group)                                                      \
    do {                                                                                               \
        ncclResult_t loom_nccl_status_ = (expr);                                                       \
        if (loom_nccl_status_ != ncclSuccess) {                                                        \
            LOOM_THROW("NCCL call `" #expr "` failed in " << (op) << " on group '" << (group)        \
                                                          << "': "                                    \
                                                          << ::loom::comm::nccl_status_text(           \
                                                                 loom_nccl_status_, (handle)),           \
                       "check that every rank of the group issues the same operations in the same "    \
                       "order with matching sizes; run with NCCL_DEBUG=WARN for NCCL's own account");  \
        }                                                                                              \
    } while (0)

#define LOOM_CUDA_OP_CHECK(expr, op, group)                                                            \
    do {                                                                                               \
        cudaError_t loom_cuda_status_ = (expr);                                                        \
        if (loom_cuda_status_ != cudaSuccess) {                                                        \
            LOOM_THROW("CUDA call `" #expr "` failed in " << (op) << " on NCCL group '" << (group)   \
                                                          << "': " << cudaGetErrorString(loom_cuda_status_), \
                       "run with CUDA_LAUNCH_BLOCKING=1 to find the failing kernel");                  \
        }                                                                                              \
    } while (0)

namespace loom::comm::inline LOOM_NCCL_NS {

namespace gpu = ::loom::LOOM_CUDA_NS;   // the CUDA backend these communicators run on

namespace {

ncclDataType_t nccl_type(DType dtype) {
    switch (dtype) {
        case DType::f32:  return ncclFloat32;
        case DType::bf16: return ncclBfloat16;
        case DType::f16:  return ncclFloat16;
        case DType::i32:  return ncclInt32;
        case DType::i64:  return ncclInt64;
        case DType::u8:   return ncclUint8;
        case DType::f64:  return ncclFloat64;
    }
    return ncclUint8;
}

ncclRedOp_t nccl_op(ReduceOp op) {
    switch (op) {
        case ReduceOp::sum: return ncclSum;
        case ReduceOp::avg: return ncclAvg;
        case ReduceOp::max: return ncclMax;
        case ReduceOp::min: return ncclMin;
    }
    return ncclSum;
}

bool overlaps(const void * a, size_t a_bytes, const void * b, size_t b_bytes) {
    auto pa = reinterpret_cast<uintptr_t>(a);
    auto pb = reinterpret_cast<uintptr_t>(b);
    return a_bytes > 0 && b_bytes > 0 && pa < pb + b_bytes && pb < pa + a_bytes;
}

// The NCCL communicator itself, shared by the Communicator and its Works: destroyed when the last of them
// is gone (after the Communicator's stream has drained).
// The watchdog's limit for this process's NCCL waits (NcclContext::set_timeout), in seconds.
std::atomic<double> g_timeout_s{600.0};

// What this process has done on a group, for the roll call (comm/communicator.h): the operations it has
// issued, and the one a host thread waits on now. The MPI engine reads it from its own thread when another
// rank's watchdog asks.
struct WaitBoard {
    std::shared_ptr<std::atomic<uint64_t>> issued = std::make_shared<std::atomic<uint64_t>>(0);
    std::mutex                             mutex;
    const char *                           op = nullptr;   // null: no wait in progress
    uint64_t                               seq  = 0;
    int                                    peer = -1;
    std::chrono::steady_clock::time_point  since;

    std::string doing(const std::string & group) {
        std::lock_guard<std::mutex> lock(mutex);
        if (op == nullptr) return "";
        const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - since).count();
        return detail::concat("waiting ", static_cast<int>(waited), " s in NCCL ", op, " #", seq,
                              peer >= 0 ? detail::concat(" with rank ", peer) : std::string(), " on group '", group, "'");
    }
};

struct NcclState {
    ncclComm_t  comm = nullptr;
    std::string name;
    int         rank = 0, size = 1;
    std::string device;
    bool        aborted = false;   // by the watchdog: the communicator is unusable
    std::shared_ptr<WaitBoard>       board = std::make_shared<WaitBoard>();
    std::unique_ptr<RollCallChannel> roll_call;   // over the launcher's group (null: no side channel)

    ~NcclState() {
        // At exit NCCL may be gone: nothing to report. An aborted communicator is already freed (ncclCommAbort).
        if (comm != nullptr && !aborted) ncclCommDestroy(comm);
    }

    // The communicator's asynchronous error ("" if none): a peer that died, a network failure, an abort.
    std::string async_error(const char * op) const {
        ncclResult_t async = ncclSuccess;
        LOOM_NCCL_OP_CHECK(ncclCommGetAsyncError(comm, &async), comm, op, name);
        if (async == ncclSuccess || async == ncclInProgress) return "";
        return nccl_status_text(async, comm);
    }
};

class NcclWork : public Work {
public:
    // Operation #seq of the group (`peer`: the other rank, for a send or recv).
    NcclWork(std::shared_ptr<NcclState> state, std::unique_ptr<gpu::CudaEvent> done, const char * op, uint64_t seq,
             int peer)
        : state_(std::move(state)), done_(std::move(done)), op_(op), seq_(seq), peer_(peer) {}

    void wait() override {
        check_not_capturing("a wait on an NCCL operation");
        const auto start = std::chrono::steady_clock::now();
        WaitBoard & board = *state_->board;
        {
            std::lock_guard<std::mutex> lock(board.mutex);
            board.op    = op_;
            board.seq   = seq_;
            board.peer  = peer_;
            board.since = start;
        }
        struct Done {   // the board forgets the wait however it ends
            WaitBoard & board;
            ~Done() {
                std::lock_guard<std::mutex> lock(board.mutex);
                board.op = nullptr;
            }
        } done{board};
        while (!poll()) {
            std::this_thread::sleep_for(std::chrono::microseconds(20));
            const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            if (waited > g_timeout_s.load()) time_out(waited);
        }
        LOOM_CHECK(error_.empty(),
                   "NCCL " << op_ << " on group '" << state_->name << "' failed asynchronously: " << error_,
                   "a peer stopped or the transport failed; run with NCCL_DEBUG=WARN for NCCL's own account");
    }

    bool test() override { return poll(); }

private:
    // The watchdog: the operation never completed. Its account goes to stderr before the communicator is
    // aborted: the abort fails the peers' operations at once, and a peer that ends the job (MPI_Abort)
    // could otherwise kill this process before its exception is printed. Aborting releases the NCCL
    // stream the operation blocks, so the process can end; the exception then stops this rank.
    [[noreturn]] void time_out(double waited) {
        const std::string report = detail::concat(
            "NCCL ", op_, " #", seq_, peer_ >= 0 ? detail::concat(" with rank ", peer_) : std::string(), " on group '",
            state_->name, "' (rank ", state_->rank, " of ", state_->size, ", ", state_->device, ") has waited ",
            static_cast<int>(waited),
            " s for its peers: a rank of the group has not issued the matching operation (operations issued in "
            "another order: a deadlock; or a stopped rank)");
        std::fprintf(stderr, "[rank %d] loom: %s\n", process_rank(), report.c_str());
        std::fflush(stderr);
        // Where the others are, asked over the launcher (MPI), whose engine answers while its host thread
        // is blocked here: the ranks that have not arrived, and what each waits on.
        if (state_->roll_call) {
            const std::string lines = state_->roll_call->ask(seq_, peer_, std::clamp(g_timeout_s.load() / 5, 1.0, 10.0));
            std::fprintf(stderr, "%s", lines.c_str());
        }
        std::fprintf(stderr, "  HINT: every rank of a group must issue the same NCCL operations in the same order; "
                             "--distributed-timeout-minutes sets how long a wait may take\n");
        std::fflush(stderr);
        if (!state_->aborted) {
            state_->aborted = true;
            ncclCommAbort(state_->comm);
        }
        throw RunError(detail::concat("NCCL ", op_, " on group '", state_->name, "' timed out after ",
                                      static_cast<int>(waited), " s (the watchdog's report is above)"),
                       "", __FILE__, __LINE__);
    }

    // True once the operation has completed or the communicator has failed (error_ says which).
    bool poll() {
        if (finished_) return true;
        error_ = state_->async_error(op_);
        if (!error_.empty()) return finished_ = true;
        cudaError_t status = cudaEventQuery(done_->native());
        if (status == cudaErrorNotReady) return false;
        LOOM_CUDA_OP_CHECK(status, op_, state_->name);
        return finished_ = true;
    }

    std::shared_ptr<NcclState>       state_;
    std::unique_ptr<gpu::CudaEvent> done_;
    const char *                     op_;
    bool                             finished_ = false;
    std::string                      error_;
    uint64_t                         seq_  = 0;
    int                              peer_ = -1;
};

class NcclCommunicator : public Communicator {
public:
    NcclCommunicator(std::shared_ptr<NcclState> state, Device & device, int rank, int size,
                     std::vector<int> global_ranks, std::string name)
        : state_(std::move(state)),
          device_(device),
          rank_(rank),
          size_(size),
          global_ranks_(std::move(global_ranks)),
          name_(std::move(name)) {
        stream_      = device_.stream_create("nccl:" + name_);
        nccl_stream_ = &gpu::as_cuda_stream(*stream_, "the NCCL communicator");
        ready_       = std::make_unique<gpu::CudaEvent>(device_.index());
        barrier_     = Tensor::zeros({1}, DType::i32, device_, TensorOptions{MemoryKind::device, "comm"});
    }

    ~NcclCommunicator() override {
        try {
            stream_->synchronize();   // NCCL's work on the stream must end before the communicator goes
        } catch (...) {
        }
    }

    int                      rank() const override { return rank_; }
    int                      size() const override { return size_; }
    const std::vector<int> & global_ranks() const override { return global_ranks_; }
    const std::string &      name() const override { return name_; }

protected:
    WorkPtr do_all_reduce(const Tensor & t, ReduceOp op, Stream * stream) override {
        check_cuda_tensor(t, "all_reduce", "input/output");
        ncclComm_t comm = state_->comm;
        return issue("all_reduce", stream, true, {t}, [=, this](cudaStream_t s) {
            if (t.numel() == 0) return;
            LOOM_NCCL_OP_CHECK(ncclAllReduce(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                                             nccl_type(t.dtype()), nccl_op(op), comm, s),
                               comm, "all_reduce", name_);
        });
    }

    WorkPtr do_reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream) override {
        check_cuda_tensor(in, "reduce_scatter", "input");
        check_cuda_tensor(out, "reduce_scatter", "output");
        ncclComm_t comm = state_->comm;
        // NCCL's in place is out == block `rank` of in; any other overlap receives into a staging tensor.
        bool in_place = out.data_ptr() == static_cast<char *>(in.data_ptr()) + out.nbytes() * rank_;
        bool aliased  = !in_place && overlaps(in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes());
        Tensor staged = aliased ? Tensor::empty({out.numel()}, out.dtype(), device_, TensorOptions{MemoryKind::device, "comm"})
                                : out;
        return issue("reduce_scatter", stream, true, {in, out, staged}, [=, this](cudaStream_t s) {
            if (out.numel() == 0) return;
            LOOM_NCCL_OP_CHECK(ncclReduceScatter(in.data_ptr(), staged.data_ptr(), static_cast<size_t>(out.numel()),
                                                 nccl_type(in.dtype()), nccl_op(op), comm, s),
                               comm, "reduce_scatter", name_);
            if (aliased) {
                LOOM_CUDA_OP_CHECK(cudaMemcpyAsync(out.data_ptr(), staged.data_ptr(), out.nbytes(),
                                                   cudaMemcpyDeviceToDevice, s),
                                   "reduce_scatter", name_);
            }
        });
    }

    WorkPtr do_all_gather(const Tensor & in, const Tensor & out, Stream * stream) override {
        check_cuda_tensor(in, "all_gather", "input");
        check_cuda_tensor(out, "all_gather", "output");
        ncclComm_t comm = state_->comm;
        // The distributed optimizer gathers a shard that is a view of its own slot: NCCL's in place. Any
        // other overlap sends from a staging copy of the input.
        bool in_place = in.data_ptr() == static_cast<char *>(out.data_ptr()) + in.nbytes() * rank_;
        bool aliased  = !in_place && overlaps(in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes());
        Tensor staged = aliased ? Tensor::empty({in.numel()}, in.dtype(), device_, TensorOptions{MemoryKind::device, "comm"})
                                : in;
        return issue("all_gather", stream, true, {in, out, staged}, [=, this](cudaStream_t s) {
            if (in.numel() == 0) return;
            if (aliased) {
                LOOM_CUDA_OP_CHECK(cudaMemcpyAsync(staged.data_ptr(), in.data_ptr(), in.nbytes(),
                                                   cudaMemcpyDeviceToDevice, s),
                                   "all_gather", name_);
            }
            LOOM_NCCL_OP_CHECK(ncclAllGather(staged.data_ptr(), out.data_ptr(), static_cast<size_t>(in.numel()),
                                             nccl_type(in.dtype()), comm, s),
                               comm, "all_gather", name_);
        });
    }

    WorkPtr do_broadcast(const Tensor & t, int root, Stream * stream) override {
        check_cuda_tensor(t, "broadcast", "input/output");
        ncclComm_t comm = state_->comm;
        return issue("broadcast", stream, true, {t}, [=, this](cudaStream_t s) {
            if (t.numel() == 0) return;
            LOOM_NCCL_OP_CHECK(ncclBroadcast(t.data_ptr(), t.data_ptr(), static_cast<size_t>(t.numel()),
                                             nccl_type(t.dtype()), root, comm, s),
                               comm, "broadcast", name_);
        });
    }

    WorkPtr do_all_to_all(const Tensor & in, std::span<const int64_t> send_span, const Tensor & out,
                          std::span<const int64_t> recv_span, Stream * stream) override {
        check_cuda_tensor(in, "all_to_all", "input");
        check_cuda_tensor(out, "all_to_all", "output");
        LOOM_CHECK(!overlaps(in.data_ptr(), in.nbytes(), out.data_ptr(), out.nbytes()),
                   "nccl all_to_all on group '" << name_ << "': the input and output tensors overlap",
                   "exchange into a separate output tensor");
        ncclComm_t     comm = state_->comm;
        ncclDataType_t type = nccl_type(in.dtype());
        size_t         elem = dtype_size(in.dtype());
        // Owned copies: a captured operation runs again at each replay, after the caller's spans are gone.
        std::vector<int64_t> send_counts(send_span.begin(), send_span.end());
        std::vector<int64_t> recv_counts(recv_span.begin(), recv_span.end());
        return issue("all_to_all", stream, true, {in, out}, [=, this](cudaStream_t s) {
            LOOM_NCCL_OP_CHECK(ncclGroupStart(), comm, "all_to_all", name_);
            try {
                size_t send_offset = 0;
                size_t recv_offset = 0;
                for (int p = 0; p < size_; ++p) {
                    auto sent     = static_cast<size_t>(send_counts[p]);
                    auto received = static_cast<size_t>(recv_counts[p]);
                    if (sent > 0) {
                        LOOM_NCCL_OP_CHECK(ncclSend(static_cast<char *>(in.data_ptr()) + send_offset * elem, sent,
                                                    type, p, comm, s),
                                           comm, "all_to_all", name_);
                    }
                    if (received > 0) {
                        LOOM_NCCL_OP_CHECK(ncclRecv(static_cast<char *>(out.data_ptr()) + recv_offset * elem, received,
                                                    type, p, comm, s),
                                           comm, "all_to_all", name_);
                    }
                    send_offset += sent;
                    recv_offset += received;
                }
            } catch (...) {
                ncclGroupEnd();   // close the group; the first error is the one reported
                throw;
            }
            LOOM_NCCL_OP_CHECK(ncclGroupEnd(), comm, "all_to_all", name_);
        });
    }

    // The caller's stream does not wait for a send (communicator.h): the tensor is kept until sent.
    WorkPtr do_send(const Tensor & t, int peer, int tag, Stream * stream) override {
        check_cuda_tensor(t, "send", "input");
        ncclComm_t comm = state_->comm;
        return issue("send", stream, /*stream_waits=*/false, {t}, [=, this](cudaStream_t s) {
            if (t.numel() == 0) return;
            LOOM_NCCL_OP_CHECK(ncclSend(t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm, s),
                               comm, "send", name_);
        }, peer);
    }

    WorkPtr do_recv(const Tensor & t, int peer, int tag, Stream * stream) override {
        check_cuda_tensor(t, "recv", "output");
        ncclComm_t comm = state_->comm;
        return issue("recv", stream, true, {t}, [=, this](cudaStream_t s) {
            if (t.numel() == 0) return;
            LOOM_NCCL_OP_CHECK(ncclRecv(t.data_ptr(), static_cast<size_t>(t.numel()), nccl_type(t.dtype()), peer, comm, s),
                               comm, "recv", name_);
        }, peer);
    }

    // A one-element all_reduce: complete on every rank only once every rank has issued it.
    WorkPtr do_barrier(Stream * stream) override {
        ncclComm_t comm = state_->comm;
        return issue("barrier", stream, true, {barrier_}, [=, this](cudaStream_t s) {
            LOOM_NCCL_OP_CHECK(ncclAllReduce(barrier_.data_ptr(), barrier_.data_ptr(), 1, ncclInt32, ncclSum, comm, s),
                               comm, "barrier", name_);
        });
    }

private:
    void check_cuda_tensor(const Tensor & t, const char * op, const char * what) const {
        LOOM_CHECK(t.device().type() == DeviceType::cuda && t.memory_kind() == MemoryKind::device,
                   "nccl " << op << " on group '" << name_ << "': the " << what << " tensor is in "
                           << memory_kind_name(t.memory_kind()) << " memory of " << t.device().name()
                           << ", and NCCL communicates CUDA device memory only",
                   "copy the tensor to the CUDA device first, or use the MPI communicator for host tensors");
        LOOM_CHECK(t.device().index() == device_.index(),
                   "nccl " << op << " on group '" << name_ << "': the " << what << " tensor is on "
                           << t.device().name() << ", the group's communicator on " << device_.name(),
                   "communicate tensors of the device the NcclContext was made for");
    }

    // Empty operations call no NCCL function (NCCL may refuse their null buffers); every rank skips the same
    // ones, since sizes must match across the group (and across a send's pair) anyway.
    //
    // Enqueues `enqueue` on the NCCL stream after the caller's earlier work on `stream` (if any); the
    // caller's stream waits for it unless `stream_waits` is false (a send). `tensors` are kept until the
    // operation has run.
    //
    // On a stream capturing a Loom graph the operation becomes a replayable node (core/graph.h), as the MPI
    // communicator's do: the CUDA capture ends into a segment before it and begins again after it, and each
    // replay issues the operation afresh between the segments, ordered after the previous one on the replay
    // stream by the same events (so replay a graph on the stream that captured it). The NCCL call itself is
    // never inside a CUDA graph; the graph keeps the closure, its tensors and this communicator's stream in
    // use, so the communicator must outlive the graph. A stream only forked into someone else's capture is
    // refused: it cannot end the capture into a segment.
    WorkPtr issue(const char * op, Stream * stream, bool stream_waits, std::vector<Tensor> tensors,
                  std::function<void(cudaStream_t)> enqueue, int peer = -1) {
        gpu::CudaStream * caller = nullptr;
        if (stream != nullptr) {
            caller = dynamic_cast<gpu::CudaStream *>(stream);
            LOOM_CHECK(caller != nullptr && caller->device_index() == device_.index(),
                       "nccl " << op << " on group '" << name_ << "' ordered on stream '" << stream->name() << "' of "
                               << stream->device().name() << ", the group's communicator is on " << device_.name(),
                       "pass a stream of the communicator's CUDA device (device.compute_stream() or stream_create())");
            if (Graph * graph = stream->capture()) {
                stream->submit_replayable(
                    [this, op, caller, stream_waits, tensors, enqueue, peer]() -> std::function<void()> {
                        launch(op, caller, stream_waits, tensors, enqueue, peer);
                        return [] {};
                    },
                    std::string("nccl ") + op);
                return std::make_shared<CapturedWork>(graph->name());
            }
            LOOM_CHECK(!caller->capturing(),
                       "nccl " << op << " on group '" << name_ << "' issued on stream '" << stream->name()
                               << "', which is forked into the capture of graph '"
                               << (graph_being_captured() ? graph_being_captured()->name() : std::string("?")) << "'",
                       "issue NCCL operations inside a capture on the capturing stream itself");
        }
        return launch(op, caller, stream_waits, std::move(tensors), enqueue, peer);
    }

    // issue()'s eager part: the operation on the NCCL stream now, between events on the caller's stream.
    WorkPtr launch(const char * op, gpu::CudaStream * caller, bool stream_waits, std::vector<Tensor> tensors,
                   const std::function<void(cudaStream_t)> & enqueue, int peer) {
        std::lock_guard<std::mutex> lock(mutex_);   // NCCL calls of one communicator: one thread, issue order
        const uint64_t              seq = state_->board->issued->fetch_add(1);
        gpu::DeviceGuard           guard(device_.index());
        cudaStream_t                s = nccl_stream_->native();
        if (caller != nullptr) {
            LOOM_CUDA_OP_CHECK(cudaEventRecord(ready_->native(), caller->native()), op, name_);
            LOOM_CUDA_OP_CHECK(cudaStreamWaitEvent(s, ready_->native(), 0), op, name_);
        }
        enqueue(s);
        auto done = std::make_unique<gpu::CudaEvent>(device_.index());
        LOOM_CUDA_OP_CHECK(cudaEventRecord(done->native(), s), op, name_);
        if (caller != nullptr && stream_waits) {
            LOOM_CUDA_OP_CHECK(cudaStreamWaitEvent(caller->native(), done->native(), 0), op, name_);
        }
        nccl_stream_->launched(op, std::move(tensors));   // stream-ordered: freed once the NCCL stream has passed
        return std::make_shared<NcclWork>(state_, std::move(done), op, seq, peer);
    }

    std::shared_ptr<NcclState>       state_;   // declared first: the communicator goes after the stream
    Device &                         device_;
    int                              rank_ = 0;
    int                              size_ = 1;
    std::vector<int>                 global_ranks_;
    std::string                      name_;
    std::unique_ptr<Stream>          stream_;
    gpu::CudaStream *               nccl_stream_ = nullptr;
    std::unique_ptr<gpu::CudaEvent> ready_;
    Tensor                           barrier_;
    std::mutex                       mutex_;
};

}  // namespace

std::shared_ptr<Communicator> make_nccl_communicator(Communicator & launcher_group, Device & device,
                                                     const std::string & name) {
    LOOM_CHECK(device.type() == DeviceType::cuda,
               "an NCCL communicator for group '" << name << "' on " << device.name(),
               "NCCL communicates between CUDA devices: pass cuda::device(i)");
    const int rank = launcher_group.rank();
    const int size = launcher_group.size();
    // The group's rank 0 makes the unique id; the launcher (MPI) broadcasts it through pinned host memory.
    ncclUniqueId id;
    std::memset(&id, 0, sizeof(id));
    Tensor buffer = Tensor::zeros({static_cast<int64_t>(sizeof(id))}, DType::u8, device,
                                  TensorOptions{MemoryKind::pinned_host, "comm"});
    if (rank == 0) {
        LOOM_NCCL_OP_CHECK(ncclGetUniqueId(&id), nullptr, "init", name);
        std::memcpy(buffer.data_ptr(), &id, sizeof(id));
    }
    launcher_group.broadcast(buffer, 0)->wait();
    std::memcpy(&id, buffer.data_ptr(), sizeof(id));

    auto state    = std::make_shared<NcclState>();
    state->name   = name;
    state->rank   = rank;
    state->size   = size;
    state->device = device.name();
    {
        gpu::DeviceGuard guard(device.index());
        ncclResult_t      status = ncclCommInitRank(&state->comm, size, id, rank);
        if (status != ncclSuccess) state->comm = nullptr;   // nothing of a failed init to destroy
        LOOM_CHECK(status == ncclSuccess,
                   "NCCL call `ncclCommInitRank` failed in init on group '" << name << "' (rank " << rank << " of "
                       << size << ", " << device.name() << "): " << nccl_status_text(status, nullptr),
                   "NCCL needs a distinct GPU per rank of a group (\"Duplicate GPU detected\" under NCCL_DEBUG=WARN): "
                   "check CUDA_VISIBLE_DEVICES and the device each rank picks");
    }
    // The watchdog's roll call goes over the launcher (every member registers the group, in the same order).
    RollCallSubject subject;
    subject.posted   = state->board->issued;
    subject.doing    = [board = state->board, name] { return board->doing(name); };
    state->roll_call = launcher_group.open_roll_call("nccl:" + name, std::move(subject));
    return std::make_shared<NcclCommunicator>(std::move(state), device, rank, size, launcher_group.global_ranks(), name);
}

NcclContext::NcclContext(CommunicatorFactory & launcher, Device & device) : launcher_(launcher), device_(device) {
    std::shared_ptr<Communicator> world = launcher_.world();
    LOOM_CHECK(world != nullptr, "the launcher of an NcclContext has no world communicator", "");
    world_ = make_nccl_communicator(*world, device_, "world");
}

NcclContext::~NcclContext() = default;

void NcclContext::set_timeout(double seconds) {
    if (const char * seam = std::getenv("LOOM_DISTRIBUTED_TIMEOUT_S")) seconds = std::strtod(seam, nullptr);
    g_timeout_s.store(seconds);
}

std::shared_ptr<Communicator> NcclContext::split(const std::vector<std::vector<int>> & groups,
                                                 const std::string & name) {
    std::shared_ptr<Communicator> group = launcher_.split(groups, name);   // checks the groups, collective
    if (group == nullptr) return nullptr;
    return make_nccl_communicator(*group, device_, name);
}

}  // namespace loom::comm::LOOM_NCCL_NS
