// MPI communicator tests, run by ctest under `mpirun --oversubscribe -np N` for N = 1, 2, 4, 8.
//
// Every collective and dtype is compared with a serial computation of the same result: each rank's
// input is a pure function of its global rank, so every rank can compute what every other rank holds.
// The suite runs in the world and, on 8 ranks, inside each group kind of a tp2-cp2-pp2 world and of an
// etp1-ep4-pp2 MoE world. Float inputs are multiples of 1/64 with at most 8 significant bits, so they
// are exact in bf16 and f16 and every f32 sum of them is exact: results are compared bitwise, and a
// 16-bit reduction must equal the exact sum rounded once.
#include "backend/cpu/cpu_device.h"
#include "comm/agreement.h"
#include "comm/counting_communicator.h"
#include "comm/mpi_communicator.h"
#include "parallel/parallel_config.h"
#include "parallel/process_groups.h"

#include "mpi_test_main.h"
#include "typed_values.h"

#include <gtest/gtest.h>

#include <algorithm>
#include <chrono>
#include <cstring>
#include <thread>

using namespace loom;
using namespace loom::comm;

namespace {

MpiContext * g_mpi = nullptr;

constexpr DType kReducible[] = {DType::f32, DType::bf16, DType::f16, DType::i32, DType::i64};
constexpr ReduceOp kOps[]    = {ReduceOp::sum, ReduceOp::avg, ReduceOp::max, ReduceOp::min};

double input_value(int global_rank, int64_t i, DType dtype, int salt = 0) {
    switch (dtype) {
        case DType::i32: return static_cast<double>((global_rank * 1009 + i * 7 + salt * 13) % 2001 - 1000);
        case DType::i64: return static_cast<double>((global_rank + 1) * 1000000000000LL + i * 3 + salt - 500000000000LL);
        case DType::u8:  return static_cast<double>((global_rank * 31 + i * 5 + salt) % 256);
        default:         return static_cast<double>((global_rank * 37 + i * 11 + salt * 5) % 255 - 127) / 64.0;
    }
}

using loom::testing::tensor_of;

std::vector<double> inputs_of(int global_rank, int64_t n, DType dtype, int salt = 0) {
    std::vector<double> v(n);
    for (int64_t i = 0; i < n; ++i) {
        v[i] = input_value(global_rank, i, dtype, salt);
    }
    return v;
}

// The reduction over members' inputs as the contract defines it: f32 accumulation for floats (exact
// here) and avg = sum * (1 / size); f64 accumulation for float64 and avg = sum / size; exact integer
// arithmetic for integers.
std::vector<double> reduce_serial(const std::vector<int> & members, int64_t n, DType dtype, ReduceOp op,
                                  int64_t first = 0) {
    std::vector<double> out(n);
    bool floating = dtype_is_floating(dtype);
    for (int64_t i = 0; i < n; ++i) {
        float   f = 0;
        double  d = 0;
        int64_t k = 0;
        for (size_t m = 0; m < members.size(); ++m) {
            double v = input_value(members[m], first + i, dtype);
            if (m == 0) {
                f = static_cast<float>(v);
                d = v;
                k = static_cast<int64_t>(v);
                continue;
            }
            switch (op) {
                case ReduceOp::sum:
                case ReduceOp::avg: f += static_cast<float>(v); d += v; k += static_cast<int64_t>(v); break;
                case ReduceOp::max:
                    f = std::max(f, static_cast<float>(v)), d = std::max(d, v), k = std::max(k, static_cast<int64_t>(v));
                    break;
                case ReduceOp::min:
                    f = std::min(f, static_cast<float>(v)), d = std::min(d, v), k = std::min(k, static_cast<int64_t>(v));
                    break;
            }
        }
        if (op == ReduceOp::avg) {
            f *= 1.0f / static_cast<float>(members.size());
            d /= static_cast<double>(members.size());
        }
        out[i] = dtype == DType::f64 ? d : floating ? static_cast<double>(f) : static_cast<double>(k);
    }
    return out;
}

// Bitwise comparison; reports the first differing element.
void expect_same_bytes(const Tensor & actual, const Tensor & expected, const std::string & what) {
    ASSERT_EQ(actual.nbytes(), expected.nbytes()) << what;
    if (std::memcmp(actual.data_ptr(), expected.data_ptr(), actual.nbytes()) == 0) {
        return;
    }
    size_t es = dtype_size(actual.dtype());
    for (int64_t i = 0; i < actual.numel(); ++i) {
        if (std::memcmp(static_cast<char *>(actual.data_ptr()) + i * es,
                        static_cast<char *>(expected.data_ptr()) + i * es, es) != 0) {
            ADD_FAILURE() << what << ": first mismatch at element " << i << " of " << actual.numel();
            return;
        }
    }
}

std::string label(const Communicator & c, const char * op, DType d, const char * extra = "") {
    return c.name() + "(size " + std::to_string(c.size()) + ")." + op + " " + dtype_name(d) + " " + extra;
}

void check_all_reduce(Communicator & c) {
    const int64_t n = 257;
    for (DType d : kReducible) {
        for (ReduceOp op : kOps) {
            if (op == ReduceOp::avg && !dtype_is_floating(d)) {
                continue;
            }
            Tensor t = tensor_of(d, inputs_of(c.global_ranks()[c.rank()], n, d));
            c.all_reduce(t, op)->wait();
            expect_same_bytes(t, tensor_of(d, reduce_serial(c.global_ranks(), n, d, op)),
                              label(c, "all_reduce", d, reduce_op_name(op)));
        }
    }
    // avg on integers is refused before anything is posted, on every rank alike.
    Tensor ints = tensor_of(DType::i32, inputs_of(0, 4, DType::i32));
    EXPECT_THROW(c.all_reduce(ints, ReduceOp::avg), Error);
    Tensor bytes = tensor_of(DType::u8, inputs_of(0, 4, DType::u8));
    EXPECT_THROW(c.all_reduce(bytes, ReduceOp::sum), Error);
}

void check_reduce_scatter(Communicator & c) {
    const int64_t block = 67;
    const int64_t n     = block * c.size();
    int           me    = c.global_ranks()[c.rank()];
    for (DType d : kReducible) {
        for (ReduceOp op : kOps) {
            if (op == ReduceOp::avg && !dtype_is_floating(d)) {
                continue;
            }
            Tensor in  = tensor_of(d, inputs_of(me, n, d));
            Tensor out = Tensor::zeros({block}, d, cpu::device());
            c.reduce_scatter(in, out, op)->wait();
            expect_same_bytes(out, tensor_of(d, reduce_serial(c.global_ranks(), block, d, op, block * c.rank())),
                              label(c, "reduce_scatter", d, reduce_op_name(op)));
        }
    }
    // The distributed-optimizer pattern: the output is this rank's block of the input buffer itself.
    for (DType d : {DType::f32, DType::bf16}) {
        Tensor in  = tensor_of(d, inputs_of(me, n, d));
        Tensor out = in.slice(block * c.rank(), {block});
        c.reduce_scatter(in, out, ReduceOp::sum)->wait();
        expect_same_bytes(out, tensor_of(d, reduce_serial(c.global_ranks(), block, d, ReduceOp::sum, block * c.rank())),
                          label(c, "reduce_scatter", d, "aliased"));
    }
    Tensor bad_out = Tensor::zeros({block + 1}, DType::f32, cpu::device());
    EXPECT_THROW(c.reduce_scatter(tensor_of(DType::f32, inputs_of(me, n, DType::f32)), bad_out, ReduceOp::sum), Error);
}

void check_all_gather(Communicator & c) {
    const int64_t n  = 37;
    int           me = c.global_ranks()[c.rank()];
    for (DType d : kAllDTypes) {
        std::vector<double> expected;
        for (int g : c.global_ranks()) {
            std::vector<double> part = inputs_of(g, n, d);
            expected.insert(expected.end(), part.begin(), part.end());
        }
        Tensor in  = tensor_of(d, inputs_of(me, n, d));
        Tensor out = Tensor::zeros({n * c.size()}, d, cpu::device());
        c.all_gather(in, out)->wait();
        expect_same_bytes(out, tensor_of(d, expected), label(c, "all_gather", d));

        // In place: the input is this rank's slot of the output (the param all-gather pattern).
        Tensor full = Tensor::zeros({n * c.size()}, d, cpu::device());
        Tensor slot = full.slice(n * c.rank(), {n});
        slot.copy_from(in);
        c.all_gather(slot, full)->wait();
        expect_same_bytes(full, tensor_of(d, expected), label(c, "all_gather", d, "in place"));
    }
}

void check_broadcast(Communicator & c) {
    const int64_t n  = 53;
    int           me = c.global_ranks()[c.rank()];
    for (DType d : kAllDTypes) {
        for (int root = 0; root < c.size(); ++root) {
            Tensor t = tensor_of(d, inputs_of(me, n, d));
            c.broadcast(t, root)->wait();
            expect_same_bytes(t, tensor_of(d, inputs_of(c.global_ranks()[root], n, d)),
                              label(c, "broadcast", d, ("root " + std::to_string(root)).c_str()));
        }
    }
}

void check_all_to_all(Communicator & c) {
    int                  size = c.size();
    int                  me   = c.rank();
    std::vector<int64_t> send_counts(size), recv_counts(size);
    for (int p = 0; p < size; ++p) {
        send_counts[p] = (me + 2 * p) % 3 + 1;   // what I send to p
        recv_counts[p] = (p + 2 * me) % 3 + 1;   // what p sends to me
    }
    for (DType d : kAllDTypes) {
        // Element j of the block from global rank g to group rank p encodes (g, p, j).
        // Small enough to be exact in every dtype, u8 included (g < 8, p < 8, j < 3).
        auto code = [&](int g, int p, int64_t j) { return static_cast<double>(g * 24 + p * 3 + j); };
        std::vector<double> send, expected;
        for (int p = 0; p < size; ++p) {
            for (int64_t j = 0; j < send_counts[p]; ++j) send.push_back(code(c.global_ranks()[me], p, j));
            for (int64_t j = 0; j < recv_counts[p]; ++j) expected.push_back(code(c.global_ranks()[p], me, j));
        }
        Tensor in  = tensor_of(d, send);
        Tensor out = Tensor::zeros({static_cast<int64_t>(expected.size())}, d, cpu::device());
        c.all_to_all(in, send_counts, out, recv_counts)->wait();
        expect_same_bytes(out, tensor_of(d, expected), label(c, "all_to_all", d));
    }
}

void check_send_recv(Communicator & c) {
    const int64_t n    = 300;
    int           next = (c.rank() + 1) % c.size();
    int           prev = (c.rank() + c.size() - 1) % c.size();
    for (DType d : kAllDTypes) {
        Tensor  out = tensor_of(d, inputs_of(c.global_ranks()[c.rank()], n, d, 3));
        Tensor  in  = Tensor::zeros({n}, d, cpu::device());
        WorkPtr r   = c.recv(in, prev, 7);
        WorkPtr s   = c.send(out, next, 7);
        s->wait();
        r->wait();
        EXPECT_TRUE(r->test() && s->test());
        expect_same_bytes(in, tensor_of(d, inputs_of(c.global_ranks()[prev], n, d, 3)), label(c, "send/recv", d));
    }
}

// An all-reduce issued on a stream must start after the stream's earlier work (which fills the input
// late) and later work on the stream must see its result.
void check_stream_ordering(Communicator & c) {
    const int64_t n      = 129;
    auto          stream = cpu::device().stream_create("comm-test");
    Tensor        t      = Tensor::zeros({n}, DType::f32, cpu::device());
    Tensor        seen   = Tensor::zeros({n}, DType::f32, cpu::device());
    Tensor        values = tensor_of(DType::f32, inputs_of(c.global_ranks()[c.rank()], n, DType::f32));
    stream->submit([t, values]() mutable {
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
        t.copy_from(values);
    });
    WorkPtr work = c.all_reduce(t, ReduceOp::sum, stream.get());
    stream->submit([t, seen]() mutable { seen.copy_from(t); });
    stream->synchronize();
    EXPECT_TRUE(work->test());
    expect_same_bytes(seen, tensor_of(DType::f32, reduce_serial(c.global_ranks(), n, DType::f32, ReduceOp::sum)),
                      label(c, "all_reduce", DType::f32, "on a stream"));
}

void run_suite(Communicator & c) {
    SCOPED_TRACE(c.name());
    check_all_reduce(c);
    check_reduce_scatter(c);
    check_all_gather(c);
    check_broadcast(c);
    check_all_to_all(c);
    check_send_recv(c);
    check_stream_ordering(c);
    c.barrier()->wait();
}

void run_in_every_group_kind(const parallel::ParallelSizes & sizes) {
    if (g_mpi->world_size() != sizes.world_size) {
        GTEST_SKIP() << "needs " << sizes.world_size << " ranks (mpirun -np " << sizes.world_size << ")";
    }
    parallel::ParallelConfig config = parallel::ParallelConfig::create(sizes);
    parallel::ProcessGroups  groups = parallel::ProcessGroups::create(config, *g_mpi);
    int tested = 0;
    for (const parallel::GroupKind & kind : parallel::group_kinds(config)) {
        auto comm = groups.by_name(kind.name, kind.expert);
        // The communicator's members are the generator's group holding this rank.
        bool in_a_group = false;
        for (const auto & group : kind.groups) {
            if (std::find(group.begin(), group.end(), g_mpi->world_rank()) != group.end()) {
                in_a_group = true;
                ASSERT_TRUE(comm != nullptr) << kind.name;
                EXPECT_EQ(comm->global_ranks(), group) << kind.name;
            }
        }
        if (!in_a_group) {
            EXPECT_EQ(comm, nullptr) << kind.name;
            continue;
        }
        run_suite(*comm);
        ++tested;
    }
    EXPECT_GE(tested, 15);
    g_mpi->world()->barrier()->wait();
}

}  // namespace

TEST(MpiComm, WorldMatchesTheLaunch) {
    auto world = g_mpi->world();
    EXPECT_EQ(world->size(), g_mpi->world_size());
    EXPECT_EQ(world->rank(), g_mpi->world_rank());
    EXPECT_EQ(process_rank(), g_mpi->world_rank());
}

TEST(MpiComm, EveryCollectiveAndDtypeInTheWorld) { run_suite(*g_mpi->world()); }

TEST(MpiComm, SixteenBitSumsRoundOnceNotPerStep) {
    // Summing in bf16 step by step would round after every addition; the contract is one rounding of the
    // f32 sum. With 8 significant bits per input and sums needing more, the two differ somewhere.
    auto          world = g_mpi->world();
    const int64_t n     = 512;
    Tensor        t     = tensor_of(DType::bf16, inputs_of(world->rank(), n, DType::bf16));
    world->all_reduce(t, ReduceOp::sum)->wait();
    int differs_from_stepwise = 0;
    for (int64_t i = 0; i < n; ++i) {
        float step = 0;
        for (int g = 0; g < world->size(); ++g) {
            step = bf16_bits_to_f32(f32_to_bf16_bits(step + static_cast<float>(input_value(g, i, DType::bf16))));
        }
        differs_from_stepwise += t.data<bf16_t>()[i].bits != f32_to_bf16_bits(step);
    }
    if (world->size() >= 4) {
        EXPECT_GT(differs_from_stepwise, 0) << "the inputs do not tell one rounding from many";
    }
}

TEST(MpiComm, OperationsStartInIssueOrderEvenWhenAStreamHoldsTheFirst) {
    // Even ranks hold their first all-reduce on a busy stream, odd ranks do not; a second all-reduce is
    // issued without a stream right after. If the engine posted operations as they arrived, even and odd
    // ranks would pair the first with the second and every result would be wrong.
    auto   world  = g_mpi->world();
    auto   stream = cpu::device().stream_create("held");
    Tensor a      = tensor_of(DType::f32, inputs_of(world->rank(), 64, DType::f32));
    Tensor b      = tensor_of(DType::f32, inputs_of(world->rank(), 64, DType::f32, 1));
    Tensor b_ref  = tensor_of(DType::f32, inputs_of(world->rank(), 64, DType::f32, 1));
    if (world->rank() % 2 == 0) {
        stream->submit([] { std::this_thread::sleep_for(std::chrono::milliseconds(30)); });
    }
    WorkPtr wa = world->all_reduce(a, ReduceOp::sum, stream.get());
    WorkPtr wb = world->all_reduce(b, ReduceOp::max);
    wb->wait();
    wa->wait();
    stream->synchronize();
    expect_same_bytes(a, tensor_of(DType::f32, reduce_serial(world->global_ranks(), 64, DType::f32, ReduceOp::sum)),
                      "held all_reduce");
    std::vector<double> bmax(64);
    for (int64_t i = 0; i < 64; ++i) {
        bmax[i] = -1e9;
        for (int g : world->global_ranks()) bmax[i] = std::max(bmax[i], input_value(g, i, DType::f32, 1));
    }
    expect_same_bytes(b, tensor_of(DType::f32, bmax), "second all_reduce");
}

TEST(MpiComm, ManyOutstandingOperationsComplete) {
    auto                world = g_mpi->world();
    std::vector<Tensor> ts;
    std::vector<WorkPtr> works;
    for (int k = 0; k < 32; ++k) {
        ts.push_back(tensor_of(DType::f32, inputs_of(world->rank(), 100, DType::f32)));
        works.push_back(world->all_reduce(ts.back(), k % 2 ? ReduceOp::max : ReduceOp::sum));
    }
    for (int k = 31; k >= 0; --k) {
        works[k]->wait();
    }
    for (int k = 0; k < 32; ++k) {
        expect_same_bytes(ts[k],
                          tensor_of(DType::f32, reduce_serial(world->global_ranks(), 100, DType::f32,
                                                              k % 2 ? ReduceOp::max : ReduceOp::sum)),
                          "outstanding " + std::to_string(k));
    }
}

TEST(MpiComm, RecvOfTheWrongSizeIsAnErrorNamingThePeer) {
    auto world = g_mpi->world();
    if (world->size() < 2) {
        GTEST_SKIP() << "needs 2 ranks";
    }
    if (world->rank() == 0) {
        world->send(Tensor::zeros({4}, DType::f32, cpu::device()), 1, 11)->wait();
    } else if (world->rank() == 1) {
        WorkPtr r = world->recv(Tensor::zeros({8}, DType::f32, cpu::device()), 0, 11);
        try {
            r->wait();
            ADD_FAILURE() << "a short message must be an error";
        } catch (const Error & e) {
            EXPECT_NE(e.message().find("expected 8 elements, received 4"), std::string::npos) << e.what();
        }
    }
    world->barrier()->wait();
}

TEST(MpiComm, CountingWrapperCountsCallsAndBytesPerKind) {
    auto                 inner = g_mpi->world();
    CountingCommunicator counting(inner);
    Tensor               t   = Tensor::zeros({100}, DType::f32, cpu::device());
    Tensor               out = Tensor::zeros({100 * inner->size()}, DType::f32, cpu::device());
    counting.all_reduce(t, ReduceOp::sum)->wait();
    counting.all_reduce(t, ReduceOp::sum)->wait();
    counting.all_gather(t, out)->wait();
    counting.barrier()->wait();
    EXPECT_EQ(counting.count(OpKind::all_reduce).calls, 2);
    EXPECT_EQ(counting.count(OpKind::all_reduce).bytes, 800);
    EXPECT_EQ(counting.count(OpKind::all_gather).calls, 1);
    EXPECT_EQ(counting.count(OpKind::all_gather).bytes, 400 * inner->size());
    EXPECT_EQ(counting.count(OpKind::barrier).calls, 1);
    EXPECT_EQ(counting.count(OpKind::reduce_scatter).calls, 0);
    // Rejected calls are not counted: validation runs before the wrapper forwards.
    EXPECT_THROW(counting.all_gather(t, t.slice(0, {1})), Error);
    EXPECT_EQ(counting.count(OpKind::all_gather).calls, 1);
    counting.reset();
    EXPECT_EQ(counting.count(OpKind::all_reduce).calls, 0);
}

TEST(MpiComm, EveryGroupKindOfTp2Cp2Pp2World) {
    parallel::ParallelSizes sizes;
    sizes.world_size = 8;
    sizes.tp         = 2;
    sizes.cp         = 2;
    sizes.pp         = 2;
    run_in_every_group_kind(sizes);
}

TEST(MpiComm, EveryGroupKindOfEtp1Ep4Pp2MoeWorld) {
    parallel::ParallelSizes sizes;
    sizes.world_size = 8;
    sizes.pp         = 2;
    sizes.ep         = 4;
    sizes.etp        = 1;
    run_in_every_group_kind(sizes);
}

// Agreement (comm/agreement.h): ranks launched alike pass; a rank that differs is named, on every rank, with
// each value and the ranks holding it, whatever the lengths of the ranks' settings.
std::vector<Setting> common_settings() { return {{"--seq-length", "128"}, {"--lr", "0.0001"}, {"--bf16", "false"}}; }

TEST(Agreement, RanksLaunchedAlikePass) {
    const std::vector<Setting> settings = common_settings();
    EXPECT_NO_THROW(check_agreement(*g_mpi->world(), cpu::device(), settings, "different options"));
}

TEST(Agreement, AValueOnTheLastRankIsNamedOnEveryRank) {
    auto                 world    = g_mpi->world();
    std::vector<Setting> settings = common_settings();
    if (world->rank() == world->size() - 1) settings[1].value = "0.0002";
    if (world->size() == 1) {
        EXPECT_NO_THROW(check_agreement(*world, cpu::device(), settings, "different options"));
        return;
    }
    std::vector<int> others(static_cast<size_t>(world->size() - 1));
    for (size_t r = 0; r < others.size(); ++r) others[r] = static_cast<int>(r);
    const std::string expected = "different options:\n    --lr: 0.0001 on " + rank_list(others) + "; 0.0002 on rank " +
                                 std::to_string(world->size() - 1);
    try {
        check_agreement(*world, cpu::device(), settings, "different options");
        ADD_FAILURE() << "no error on rank " << world->rank();
    } catch (const Error & e) {
        EXPECT_EQ(e.message(), expected);
    }
    // The exchange completed on every rank: the world still works.
    world->barrier()->wait();
}

TEST(Agreement, ASettingOneRankAloneHasIsNamedAsAbsentElsewhere) {
    auto                 world    = g_mpi->world();
    std::vector<Setting> settings = common_settings();
    // Rank 0's message is the longest: the others' are padded to it.
    if (world->rank() == 0) settings.insert(settings.begin() + 1, {"--data-path", std::string(300, 'x')});
    if (world->size() == 1) return;
    try {
        check_agreement(*world, cpu::device(), settings, "different options");
        ADD_FAILURE() << "no error on rank " << world->rank();
    } catch (const Error & e) {
        EXPECT_EQ(e.message(), "different options:\n    --data-path: " + std::string(300, 'x') + " on rank 0; (absent) on " +
                                   (world->size() == 2 ? std::string("rank 1") : "ranks 1-" + std::to_string(world->size() - 1)));
    }
}

// The running check: collectives that all ranks issued alike pass; a rank whose all-reduce used another
// reduction (it completes) is named, on every rank, with its last collective beside the others'.
TEST(Agreement, CollectivesThatDivergedWithoutHangingAreNamed) {
    auto world = g_mpi->world();
    if (world->size() == 1) return;
    // A group of its own: the other tests' collectives on the world are not part of this one.
    std::vector<int> everyone(static_cast<size_t>(world->size()));
    for (size_t r = 0; r < everyone.size(); ++r) everyone[r] = static_cast<int>(r);
    std::shared_ptr<Communicator> group = g_mpi->split({everyone}, "checked");
    Communicator * const          kinds[] = {group.get(), nullptr};
    std::vector<float>            values  = {1.0f, 2.0f};
    all_reduce_values(*group, cpu::device(), values, ReduceOp::sum);
    EXPECT_NO_THROW(check_issued(*world, cpu::device(), kinds));
    if (world->rank() == world->size() - 1) flip_next_reduction();
    const std::vector<float> reduced = all_reduce_values(*group, cpu::device(), values, ReduceOp::sum);
    try {
        check_issued(*world, cpu::device(), kinds);
        ADD_FAILURE() << "no error on rank " << world->rank();
    } catch (const RunError & e) {
        const std::string others = world->size() == 2 ? "rank 0" : "ranks 0-" + std::to_string(world->size() - 2);
        // The first divergent collective, by number, with each reduction and the ranks that used it.
        EXPECT_NE(e.message().find("group 'checked' of ranks 0-" + std::to_string(world->size() - 1) +
                                   ", collective #2: all_reduce of 2 float32 (sum) on " + others +
                                   "; all_reduce of 2 float32 (max) on rank " + std::to_string(world->size() - 1)),
                  std::string::npos)
            << e.message();
        EXPECT_EQ(e.message().find("collective #1:"), std::string::npos) << "#1 agreed\n" << e.message();
    }
}

TEST(Agreement, ReportLinesAndRankLists) {
    EXPECT_EQ(rank_list(std::vector<int>{3}), "rank 3");
    EXPECT_EQ(rank_list(std::vector<int>{0, 1, 2, 5, 7, 8}), "ranks 0-2, 5, 7-8");
    const std::vector<std::vector<Setting>> ranks = {
        {{"a", "1"}, {"b", ""}, {"c", "x"}}, {{"a", "1"}, {"b", "2"}, {"c", "x"}}, {{"a", "1"}, {"c", "y"}}};
    EXPECT_EQ(disagreements(ranks),
              (std::vector<std::string>{"b: '' on rank 0; 2 on rank 1; (absent) on rank 2", "c: x on ranks 0-1; y on rank 2"}));
    EXPECT_TRUE(disagreements({ranks[0], ranks[0]}).empty());
    const std::vector<Setting> settings = common_settings();
    const std::vector<Setting> back     = decode_settings(encode_settings(settings));
    ASSERT_EQ(back.size(), settings.size());
    for (size_t i = 0; i < back.size(); ++i) EXPECT_EQ(back[i].name + "=" + back[i].value, settings[i].name + "=" + settings[i].value);
    EXPECT_THROW(decode_settings(std::string("--lr\0" "1", 6)), Error);
}

int main(int argc, char ** argv) { return loom::testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
