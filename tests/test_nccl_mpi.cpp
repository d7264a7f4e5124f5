// The NCCL communicator (comm/nccl_communicator.h) against its oracle, the MPI communicator, run by ctest
// under `mpirun -np 2` (labels `gpu` and `mpi`). Every rank's input is a pure function of its global rank;
// each operation runs on the same data through MPI (host tensors) and through NCCL (CUDA tensors), and the
// results are compared:
//   exact (bitwise)          every dtype's max and min; i32/i64 sum; f32 sum (inputs are multiples of 1/64
//                            with at most 8 significant bits, so every f32 sum of them is exact); all_gather,
//                            broadcast, all_to_all (uneven counts, some zero, untouched slack) and send/recv
//   1e-6 x max(1, |ref|)     f32 avg (ncclAvg may scale before summing, MPI after)
//   2^-7 x max(1, |ref|)     bf16 sum and avg (one bf16 ulp: NCCL rounds at each step of its reduction, MPI
//   2^-10 x max(1, |ref|)    f16 sum and avg       once; on two ranks they agree exactly)
// It also checks that a send does not block later work on the caller's stream and that sends and receives
// between two ranks match in issue order, splits (a reversed group, a group that leaves ranks out), the
// barrier, the refusal of host tensors (naming the op and the group), and collectives captured into a Loom
// graph, issued afresh at each replay.
//
// Without a CUDA device every test skips with a message: the communicator was compiled and linked, not run.
// NCCL refuses two ranks of one communicator on one GPU ("Duplicate GPU detected"); where fewer GPUs than
// ranks are visible on this node, main() gives each rank its own NCCL_HOSTID (unless set), so NCCL treats
// the ranks as separate hosts and connects them over its socket transport.
#include "backend/cpu/cpu_device.h"
#include "backend/cuda/cuda_device.h"
#include "comm/mpi_communicator.h"
#include "comm/nccl_communicator.h"
#include "core/graph.h"
#include "core/ops.h"
#include "core/tensor.h"
#include "tests/cuda_transfer.h"
#include "tests/error_text.h"
#include "tests/typed_values.h"

#include "mpi_test_main.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <memory>
#include <string>
#include <thread>
#include <vector>

using namespace loom;
using namespace loom::comm;

namespace {

MpiContext *                 g_mpi = nullptr;
std::unique_ptr<NcclContext> g_nccl;
int                          g_device_index = 0;

// The backend under test: loom::cuda on a GPU, or loom::cuda_emu (the same sources on the emulated device,
// NCCL's semantics between processes over shared memory) in the test_nccl_mpi_emu build of this file.
namespace gpu_backend = loom::LOOM_CUDA_NS;

#define SKIP_WITHOUT_CUDA()                                                                            \
    if (gpu_backend::device_count() == 0) {                                                                   \
        GTEST_SKIP() << "no CUDA device visible: the NCCL communicator was compiled and linked, not run"; \
    }

Device & gpu() { return gpu_backend::device(g_device_index); }
Stream & gs() { return gpu().compute_stream(); }
Ops &    gops() { return gpu().ops(); }

// The NCCL context, made on first use (every rank reaches it in the same test: the skip is the same on all).
NcclContext & nccl() {
    if (!g_nccl) g_nccl = std::make_unique<NcclContext>(*g_mpi, gpu());
    return *g_nccl;
}

// Drops the NCCL communicators before MPI finalises.
class NcclEnvironment : public ::testing::Environment {
public:
    void TearDown() override { g_nccl.reset(); }
};

constexpr DType    kReducible[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::f64};
constexpr DType    kAll[]       = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64, DType::u8, DType::f64};
constexpr ReduceOp kOps[]       = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

double input_value(int global_rank, int64_t i, DType dtype, int salt) {
    switch (dtype) {
        case DType::i32: return static_cast<double>((global_rank * 1013 + i * 7 + salt * 17) % 2001 - 1000);
        case DType::i64: return static_cast<double>((global_rank + 1) * 1000000000000LL + i * 3 + salt - 500000000000LL);
        case DType::u8:  return static_cast<double>((global_rank * 29 + i * 5 + salt) % 256);
        default:         return static_cast<double>((global_rank * 41 + i * 11 + salt * 3) % 255 - 127) / 64.0;
    }
}

// A host tensor of n elements of rank `global_rank`'s input (exact in every dtype).
Tensor host_input(DType dtype, int64_t n, int global_rank, int salt) {
    std::vector<double> v(static_cast<size_t>(n));
    for (int64_t i = 0; i < n; ++i) v[static_cast<size_t>(i)] = input_value(global_rank, i, dtype, salt);
    return loom::testing::tensor_of(dtype, v);
}

Tensor to_gpu(const Tensor & host) { return loom::testing::to_gpu(host, gpu()); }
using loom::testing::to_cpu;

Tensor clone_host(const Tensor & t) {
    Tensor c = Tensor::empty(t.shape(), t.dtype(), cpu::device());
    c.copy_from(t);
    return c;
}

std::vector<double> values(const Tensor & t) {
    std::vector<double> out(static_cast<size_t>(t.numel()));
    for (int64_t i = 0; i < t.numel(); ++i) {
        switch (t.dtype()) {
            case DType::i32: out[i] = t.data<int32_t>()[i]; break;
            case DType::i64: out[i] = static_cast<double>(t.data<int64_t>()[i]); break;
            case DType::u8:  out[i] = t.data<uint8_t>()[i]; break;
            default: {
                float f = 0;
                convert(static_cast<const char *>(t.data_ptr()) + i * dtype_size(t.dtype()), t.dtype(), &f, DType::f32, 1);
                out[i] = f;
            }
        }
    }
    return out;
}

void expect_bitwise(const Tensor & ref, const Tensor & got, const std::string & what) {
    ASSERT_EQ(ref.nbytes(), got.nbytes()) << what;
    const auto * a = static_cast<const unsigned char *>(ref.data_ptr());
    const auto * b = static_cast<const unsigned char *>(got.data_ptr());
    size_t       bad = 0, first = 0;
    for (size_t i = 0; i < ref.nbytes(); ++i) {
        if (a[i] != b[i] && bad++ == 0) first = i;
    }
    EXPECT_EQ(bad, 0u) << what << ": " << bad << " bytes differ from MPI's, the first at byte " << first;
}

void expect_close(const Tensor & ref, const Tensor & got, double tol, const std::string & what) {
    std::vector<double> r = values(ref), g = values(got);
    ASSERT_EQ(r.size(), g.size()) << what;
    double worst = 0;
    size_t at    = 0;
    for (size_t i = 0; i < r.size(); ++i) {
        double err = std::fabs(g[i] - r[i]) / std::max(1.0, std::fabs(r[i]));
        if (!(err <= worst)) {
            worst = std::isnan(err) ? INFINITY : err;
            at    = i;
        }
    }
    EXPECT_LE(worst, tol) << what << ": worst relative error at element " << at << " (mpi " << r[at] << ", nccl "
                          << g[at] << ")";
}

// The tolerance of the header's table: 0 means bitwise.
double tolerance(DType dtype, ReduceOp op) {
    if (op == ReduceOp::max || op == ReduceOp::min) return 0;
    switch (dtype) {
        case DType::f32:  return op == ReduceOp::avg ? 1e-6 : 0;
        case DType::bf16: return std::ldexp(1.0, -7);
        case DType::f16:  return std::ldexp(1.0, -10);
        default:          return 0;
    }
}

void compare(const Tensor & mpi, const Tensor & nccl_result, double tol, const std::string & what) {
    if (tol == 0) {
        expect_bitwise(mpi, nccl_result, what);
    } else {
        expect_close(mpi, nccl_result, tol, what);
    }
}

std::string label(const char * op, DType dtype, ReduceOp rop, bool on_stream) {
    return std::string(op) + " " + reduce_op_name(rop) + " " + dtype_name(dtype) + (on_stream ? " on a stream" : " without a stream");
}

// Runs `issue` on the GPU with or without the compute stream: without one, the inputs are made ready
// first (as communicator.h asks) and the Work is waited on before the results are read; with one, the
// results are read on the stream before the Work is waited on.
template <typename Issue>
void run_nccl(bool on_stream, Issue && issue) {
    if (!on_stream) gs().synchronize();
    WorkPtr work = issue(on_stream ? &gs() : nullptr);
    if (!on_stream) work->wait();
    gs().synchronize();
    work->wait();
    EXPECT_TRUE(work->test());
}

}  // namespace

TEST(NcclMpi, AllReduceMatchesMpi) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi = *g_mpi->world();
    Communicator & nc  = *nccl().world();
    const int      me  = g_mpi->world_rank();
    int            k   = 0;
    for (DType dtype : kReducible) {
        for (ReduceOp op : kOps) {
            if (op == ReduceOp::avg && !dtype_is_floating(dtype)) continue;
            bool   on_stream = (k++ % 2) == 0;
            Tensor host      = host_input(dtype, 1037, me, k);
            Tensor expected  = clone_host(host);
            mpi.all_reduce(expected, op)->wait();
            Tensor d = to_gpu(host);
            run_nccl(on_stream, [&](Stream * s) { return nc.all_reduce(d, op, s); });
            compare(expected, to_cpu(d), tolerance(dtype, op), label("all_reduce", dtype, op, on_stream));
        }
    }
}

TEST(NcclMpi, ReduceScatterMatchesMpi) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi = *g_mpi->world();
    Communicator & nc  = *nccl().world();
    const int      me  = g_mpi->world_rank();
    const int64_t  n   = 129;
    int            k   = 0;
    for (DType dtype : kReducible) {
        for (ReduceOp op : kOps) {
            if (op == ReduceOp::avg && !dtype_is_floating(dtype)) continue;
            bool   on_stream = (k++ % 2) == 1;
            Tensor in        = host_input(dtype, n * mpi.size(), me, k);
            Tensor expected  = Tensor::zeros({n}, dtype, cpu::device());
            mpi.reduce_scatter(in, expected, op)->wait();
            Tensor d_in  = to_gpu(in);
            Tensor d_out = to_gpu(Tensor::zeros({n}, dtype, cpu::device()));
            run_nccl(on_stream, [&](Stream * s) { return nc.reduce_scatter(d_in, d_out, op, s); });
            compare(expected, to_cpu(d_out), tolerance(dtype, op), label("reduce_scatter", dtype, op, on_stream));
        }
    }
    // In place: the output is this rank's block of the input (NCCL's own in-place form).
    Tensor in       = host_input(DType::f32, n * mpi.size(), me, 99);
    Tensor expected = Tensor::zeros({n}, DType::f32, cpu::device());
    mpi.reduce_scatter(in, expected, ReduceOp::sum)->wait();
    Tensor d_in = to_gpu(in);
    Tensor slot = d_in.slice(n * nc.rank(), {n});
    run_nccl(true, [&](Stream * s) { return nc.reduce_scatter(d_in, slot, ReduceOp::sum, s); });
    expect_bitwise(expected, to_cpu(slot), "reduce_scatter in place");
}

TEST(NcclMpi, AllGatherMatchesMpi) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi = *g_mpi->world();
    Communicator & nc  = *nccl().world();
    const int      me  = g_mpi->world_rank();
    const int64_t  n   = 333;
    int            k   = 0;
    for (DType dtype : kAll) {
        bool   on_stream = (k++ % 2) == 0;
        Tensor in        = host_input(dtype, n, me, k);
        Tensor expected  = Tensor::zeros({n * mpi.size()}, dtype, cpu::device());
        mpi.all_gather(in, expected)->wait();
        Tensor d_in  = to_gpu(in);
        Tensor d_out = to_gpu(Tensor::zeros({n * mpi.size()}, dtype, cpu::device()));
        run_nccl(on_stream, [&](Stream * s) { return nc.all_gather(d_in, d_out, s); });
        expect_bitwise(expected, to_cpu(d_out), std::string("all_gather ") + dtype_name(dtype));

        // In place: the input is this rank's slot of the output (the distributed optimizer's gather).
        Tensor full = Tensor::zeros({n * mpi.size()}, dtype, cpu::device());
        std::memcpy(static_cast<char *>(full.data_ptr()) + in.nbytes() * nc.rank(), in.data_ptr(), in.nbytes());
        Tensor d_full = to_gpu(full);
        Tensor slot   = d_full.slice(n * nc.rank(), {n});
        run_nccl(!on_stream, [&](Stream * s) { return nc.all_gather(slot, d_full, s); });
        expect_bitwise(expected, to_cpu(d_full), std::string("all_gather in place ") + dtype_name(dtype));
    }
}

TEST(NcclMpi, BroadcastMatchesMpi) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi = *g_mpi->world();
    Communicator & nc  = *nccl().world();
    const int      me  = g_mpi->world_rank();
    for (int root = 0; root < mpi.size(); ++root) {
        for (DType dtype : {DType::f32, DType::bf16, DType::i64, DType::u8}) {
            bool   on_stream = (root % 2) == 0;
            Tensor host      = host_input(dtype, 517, me, root);
            Tensor expected  = clone_host(host);
            mpi.broadcast(expected, root)->wait();
            Tensor d = to_gpu(host);
            run_nccl(on_stream, [&](Stream * s) { return nc.broadcast(d, root, s); });
            expect_bitwise(expected, to_cpu(d), "broadcast from " + std::to_string(root) + " " + dtype_name(dtype));
        }
    }
}

// Uneven blocks, some empty, with slack at the end of both tensors that must stay untouched.
TEST(NcclMpi, AllToAllWithUnevenCountsMatchesMpi) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi  = *g_mpi->world();
    Communicator & nc   = *nccl().world();
    const int      me   = g_mpi->world_rank();
    const int      size = mpi.size();
    auto count = [](int from, int to) -> int64_t { return ((from + 2 * to) % 3) * 5 + (from == to ? 3 : 0); };
    std::vector<int64_t> send_counts(size), recv_counts(size);
    int64_t              sent = 0, received = 0;
    for (int p = 0; p < size; ++p) {
        send_counts[p] = count(me, p);
        recv_counts[p] = count(p, me);
        sent += send_counts[p];
        received += recv_counts[p];
    }
    int k = 0;
    for (DType dtype : {DType::f32, DType::bf16, DType::i32, DType::i64}) {
        bool   on_stream = (k++ % 2) == 0;
        Tensor in        = host_input(dtype, sent + 4, me, k);
        Tensor out_init  = host_input(dtype, received + 6, 1000 + me, k);   // the slack's sentinel values
        Tensor expected  = clone_host(out_init);
        mpi.all_to_all(in, send_counts, expected, recv_counts)->wait();
        Tensor d_in  = to_gpu(in);
        Tensor d_out = to_gpu(out_init);
        run_nccl(on_stream, [&](Stream * s) { return nc.all_to_all(d_in, send_counts, d_out, recv_counts, s); });
        expect_bitwise(expected, to_cpu(d_out), std::string("all_to_all ") + dtype_name(dtype));
    }
}

// Rank 0 sends three messages to rank 1 on its compute stream, then checks that the stream runs on while
// rank 1 has not yet posted a receive (a send must not block later work on the caller's stream); rank 1
// receives them in order on its stream and reads each after its receive, then sends one back without a
// stream.
TEST(NcclMpi, SendRecvKeepOrderAndSendsDoNotBlockTheStream) {
    SKIP_WITHOUT_CUDA();
    Communicator & mpi = *g_mpi->world();
    Communicator & nc  = *nccl().world();
    if (mpi.size() < 2) GTEST_SKIP() << "send/recv needs two ranks";
    const int     me = g_mpi->world_rank();
    const int64_t n  = 4099;
    std::vector<Tensor> messages;
    for (int m = 0; m < 3; ++m) messages.push_back(host_input(DType::f32, n, 0, 100 + m));
    if (me == 0) {
        std::vector<WorkPtr> sends;
        std::vector<Tensor>  on_gpu;
        for (int m = 0; m < 3; ++m) {
            on_gpu.push_back(to_gpu(messages[m]));   // enqueued on the stream: the send must wait for it
            sends.push_back(nc.send(on_gpu.back(), 1, m, &gs()));
        }
        Tensor later = to_gpu(Tensor::zeros({16}, DType::f32, cpu::device()));
        gops().scale(gs(), later, 2.0f);
        auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(20);
        bool ran      = false;
        while (!(ran = gs().query()) && std::chrono::steady_clock::now() < deadline) {
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        EXPECT_TRUE(ran) << "work after a send on the caller's stream waited for the peer's receive";
        mpi.barrier()->wait();   // only now does rank 1 post its receives
        for (WorkPtr & w : sends) w->wait();
        Tensor back = to_gpu(Tensor::zeros({n}, DType::f32, cpu::device()));
        gs().synchronize();
        nc.recv(back, 1, 7)->wait();
        expect_bitwise(messages[2], to_cpu(back), "the message sent back without a stream");
    } else {
        mpi.barrier()->wait();
        if (me == 1) {
            std::vector<Tensor> received;
            for (int m = 0; m < 3; ++m) {
                received.push_back(to_gpu(Tensor::zeros({n}, DType::f32, cpu::device())));
                nc.recv(received.back(), 0, m, &gs());
            }
            for (int m = 0; m < 3; ++m) {
                expect_bitwise(messages[m], to_cpu(received[m]), "message " + std::to_string(m) + " in issue order");
            }
            Tensor reply = to_gpu(messages[2]);
            gs().synchronize();
            nc.send(reply, 0, 7)->wait();
        }
    }
    nc.barrier()->wait();
}

TEST(NcclMpi, BarrierCompletesWithAndWithoutAStream) {
    SKIP_WITHOUT_CUDA();
    Communicator & nc = *nccl().world();
    nc.barrier()->wait();
    WorkPtr w = nc.barrier(&gs());
    gs().synchronize();
    w->wait();
    EXPECT_TRUE(w->test());
}

// A reversed world, and a group that leaves rank 0 out: ranks and members follow the groups, and the
// collectives agree with MPI's split of the same groups.
TEST(NcclMpi, SplitGroupsMatchMpi) {
    SKIP_WITHOUT_CUDA();
    const int        me   = g_mpi->world_rank();
    const int        size = g_mpi->world_size();
    std::vector<int> reversed;
    for (int r = size - 1; r >= 0; --r) reversed.push_back(r);
    std::shared_ptr<Communicator> mpi_rev = g_mpi->split({reversed}, "reversed");
    std::shared_ptr<Communicator> nc_rev  = nccl().split({reversed}, "reversed");
    ASSERT_NE(nc_rev, nullptr);
    EXPECT_EQ(nc_rev->rank(), size - 1 - me);
    EXPECT_EQ(nc_rev->size(), size);
    EXPECT_EQ(nc_rev->global_ranks(), reversed);
    EXPECT_EQ(nc_rev->name(), "reversed");
    const int64_t n  = 77;
    Tensor        in = host_input(DType::i64, n, me, 5);
    Tensor expected  = Tensor::zeros({n * size}, DType::i64, cpu::device());
    mpi_rev->all_gather(in, expected)->wait();
    Tensor d_in  = to_gpu(in);
    Tensor d_out = to_gpu(Tensor::zeros({n * size}, DType::i64, cpu::device()));
    run_nccl(true, [&](Stream * s) { return nc_rev->all_gather(d_in, d_out, s); });
    expect_bitwise(expected, to_cpu(d_out), "all_gather in the reversed group");

    std::vector<int> without_0;
    for (int r = 1; r < size; ++r) without_0.push_back(r);
    std::shared_ptr<Communicator> mpi_part = g_mpi->split({without_0}, "without-0");
    std::shared_ptr<Communicator> nc_part  = nccl().split({without_0}, "without-0");
    if (me == 0) {
        EXPECT_EQ(nc_part, nullptr);
        return;
    }
    ASSERT_NE(nc_part, nullptr);
    EXPECT_EQ(nc_part->rank(), me - 1);
    Tensor x       = host_input(DType::i32, 300, me, 6);
    Tensor x_ref   = clone_host(x);
    mpi_part->all_reduce(x_ref, ReduceOp::sum)->wait();
    Tensor d_x = to_gpu(x);
    run_nccl(false, [&](Stream * s) { return nc_part->all_reduce(d_x, ReduceOp::sum, s); });
    expect_bitwise(x_ref, to_cpu(d_x), "all_reduce in the group without rank 0");
}

TEST(NcclMpi, HostTensorsAreRefusedNamingTheOpAndGroup) {
    SKIP_WITHOUT_CUDA();
    Communicator & nc   = *nccl().world();
    Tensor         host = Tensor::zeros({8}, DType::f32, cpu::device());
    std::string    text = error_of([&] { nc.all_reduce(host, ReduceOp::sum); });
    EXPECT_NE(text.find("all_reduce"), std::string::npos) << text;
    EXPECT_NE(text.find("group 'world'"), std::string::npos) << text;
    EXPECT_NE(text.find("NCCL communicates CUDA device memory only"), std::string::npos) << text;
    Tensor pinned = Tensor::zeros({8}, DType::f32, gpu(), {MemoryKind::pinned_host});
    text          = error_of([&] { nc.broadcast(pinned, 0); });
    EXPECT_NE(text.find("broadcast"), std::string::npos) << text;
    EXPECT_NE(text.find("pinned"), std::string::npos) << text;
    Tensor d        = Tensor::zeros({8}, DType::f32, gpu());
    Tensor host_all = Tensor::zeros({8 * nc.size()}, DType::f32, cpu::device());
    text            = error_of([&] { nc.all_gather(d, host_all); });
    EXPECT_NE(text.find("all_gather"), std::string::npos) << text;
    EXPECT_NE(text.find("output"), std::string::npos) << text;
}

// An all_reduce captured into a Loom graph is a replayable node between two CUDA segments: nothing runs
// during the capture, a wait on the captured Work is refused, and each replay reduces the values the tensor
// holds then (the kernel after it, in the next segment, sees the sum): exact, the inputs are small integers.
TEST(NcclMpi, ACapturedAllReduceRunsAtEachReplay) {
    SKIP_WITHOUT_CUDA();
    Communicator & nc   = *nccl().world();
    const int      me   = g_mpi->world_rank();
    const int      size = g_mpi->world_size();
    Tensor         d    = Tensor::zeros({8}, DType::f32, gpu());
    gs().synchronize();
    Graph graph(gpu(), "layer 0 bwd");
    gs().begin_capture(graph);
    WorkPtr work = nc.all_reduce(d, ReduceOp::sum, &gs());
    gops().scale(gs(), d, 0.5f);
    gs().end_capture();
    EXPECT_EQ(graph.num_replayable_nodes("nccl all_reduce"), 1u);
    EXPECT_EQ(graph.num_segments(), 1u) << "nothing before the collective, the scale after it";
    const std::string text = error_of([&] { work->wait(); });
    EXPECT_NE(text.find("captured into graph 'layer 0 bwd'"), std::string::npos) << text;
    for (float v : values_f32(d)) ASSERT_EQ(v, 0.0f) << "the capture ran nothing";
    for (int replay = 0; replay < 3; ++replay) {
        std::vector<float> mine(8, static_cast<float>(me + 1 + replay));
        write_values_f32(d, mine);
        graph.replay(gs());
        const float want = 0.5f * static_cast<float>(size * (size + 1) / 2 + size * replay);
        for (float v : values_f32(d)) ASSERT_EQ(v, want) << "replay " << replay;
    }
    // A stream merely forked into the capture cannot end it into a segment: refused, naming the graph.
    auto  side = gpu().stream_create("forked");
    auto  fork = gpu().event_create();
    Graph second(gpu(), "layer 1 bwd");
    gs().begin_capture(second);
    gs().record(*fork);
    side->wait(*fork);
    const std::string forked = error_of([&] { nc.all_reduce(d, ReduceOp::sum, side.get()); });
    side->record(*fork);
    gs().wait(*fork);
    gs().end_capture();
    EXPECT_NE(forked.find("forked into the capture of graph 'layer 1 bwd'"), std::string::npos) << forked;
    nc.barrier()->wait();   // nothing was enqueued by the refusal: the group is still in step
}

int main(int argc, char ** argv) {
    // NCCL refuses two ranks of a communicator on one GPU; ranks sharing one are told apart as hosts.
    const int devices = gpu_backend::device_count();
    if (devices > 0) {
        const char * local_size = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE");
        const char * world_rank = std::getenv("OMPI_COMM_WORLD_RANK");
        const char * local_rank = std::getenv("OMPI_COMM_WORLD_LOCAL_RANK");
        if (local_rank != nullptr) g_device_index = std::atoi(local_rank) % devices;
        if (local_size != nullptr && world_rank != nullptr && std::atoi(local_size) > devices) {
            setenv("NCCL_HOSTID", (std::string("loom-test-rank-") + world_rank).c_str(), 0);
        }
    }
    ::testing::AddGlobalTestEnvironment(new NcclEnvironment);
    return loom::testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi);
}
