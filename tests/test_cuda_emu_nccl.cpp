// The NCCL stand-in of the emulated CUDA device (backend/cuda_emu/nccl.cpp), between real processes: each test
// forks its ranks itself (no mpirun), runs a scenario in every child through the public CUDA and NCCL stand-in
// API only (cudaStreamCreate, cudaMalloc, cudaMemcpy, cudaStreamSynchronize/Query, the NCCL calls), and the
// parent asserts that every child exited cleanly within a time limit (a hang is killed and reported). The
// parent makes the ids (ncclGetUniqueId touches no device) and never uses the runtime itself, so the children
// start from a process without threads.
//
// Checked: all_reduce sum/avg/max/min over f32, bf16 and i32 on 2, 3 and 4 ranks against the rank-order rule
// bit for bit (bf16 accumulated in f32 and rounded once), messages larger than a slot, reduce_scatter and
// all_gather (in place too), broadcast from a non-zero root, reduce, grouped send/recv both ways, an all_to_all
// with uneven and empty blocks, two communicators on the same ranks, a collective order mismatch, the rendezvous
// deadlock of two ungrouped sends (not complete after 2 s, then ncclCommAbort ends it with an error), a rank that
// dies while its peers wait (an error naming it), a peer that destroys the communicator early, the optional
// timeout, argument checks, and that no shared-memory name is left.
#include <cuda_runtime.h>
#include <nccl.h>

#include <gtest/gtest.h>

#include <signal.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <functional>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Checks inside a child: gtest's assertions would be recorded in the child's copy of gtest, so a child prints
// what failed and reports through its exit status.

int g_rank     = -1;
int g_failures = 0;

void child_failure(const char * file, int line, const std::string & what) {
    ++g_failures;
    std::fprintf(stderr, "[rank %d] %s:%d: %s\n", g_rank, file, line, what.c_str());
}

#define EMU_CHECK(cond)                                                                                \
    do {                                                                                               \
        if (!(cond)) child_failure(__FILE__, __LINE__, "check failed: " #cond);                        \
    } while (0)

#define EMU_CHECK_EQ(a, b)                                                                             \
    do {                                                                                               \
        auto emu_a_ = (a);                                                                             \
        auto emu_b_ = (b);                                                                             \
        if (!(emu_a_ == emu_b_)) {                                                                     \
            std::ostringstream emu_text_;                                                              \
            emu_text_ << "check failed: " #a " == " #b " (" << emu_a_ << " vs " << emu_b_ << ")";      \
            child_failure(__FILE__, __LINE__, emu_text_.str());                                        \
        }                                                                                              \
    } while (0)

#define NCCL_CHECK(expr)                                                                               \
    do {                                                                                               \
        ncclResult_t emu_status_ = (expr);                                                             \
        if (emu_status_ != ncclSuccess) {                                                              \
            child_failure(__FILE__, __LINE__, std::string(#expr " failed: ") + ncclGetErrorString(emu_status_) + \
                                                  ": " + ncclGetLastError(nullptr));                    \
        }                                                                                              \
    } while (0)

#define CUDA_CHECK(expr)                                                                               \
    do {                                                                                               \
        cudaError_t emu_status_ = (expr);                                                              \
        if (emu_status_ != cudaSuccess) {                                                              \
            child_failure(__FILE__, __LINE__, std::string(#expr " failed: ") + cudaGetErrorString(emu_status_)); \
        }                                                                                              \
    } while (0)

// ---------------------------------------------------------------------------------------------------------------
// Forking the ranks.

ncclUniqueId make_id() {
    ncclUniqueId id;
    EXPECT_EQ(ncclGetUniqueId(&id), ncclSuccess);
    return id;
}

// The segment's file under /dev/shm while its name exists.
bool shm_name_exists(const ncclUniqueId & id) {
    std::string path = std::string("/dev/shm") + id.internal;
    struct stat info;
    return stat(path.c_str(), &info) == 0;
}

// Runs `body(rank)` in `nranks` child processes and expects each to exit with status 0 within `timeout_s`;
// the ranks in `killed` must instead end by SIGKILL (they kill themselves on purpose).
void run_ranks(int nranks, const std::function<void(int)> & body, const std::vector<int> & killed = {},
               int timeout_s = 60) {
    std::fflush(stdout);
    std::fflush(stderr);
    std::vector<pid_t> pids(static_cast<size_t>(nranks), -1);
    for (int r = 0; r < nranks; ++r) {
        pid_t pid = fork();
        ASSERT_GE(pid, 0) << "fork failed";
        if (pid == 0) {
            g_rank = r;
            int status = 0;
            try {
                body(r);
                status = g_failures == 0 ? 0 : 1;
            } catch (const std::exception & error) {
                std::fprintf(stderr, "[rank %d] exception: %s\n", r, error.what());
                status = 2;
            }
            std::fflush(stdout);
            std::fflush(stderr);
            _exit(status);   // no static destructors, gtest reports or stream threads of the child
        }
        pids[static_cast<size_t>(r)] = pid;
    }
    // Reap whichever child ends first, promptly: a dead rank must not linger as a zombie for its peers.
    auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(timeout_s);
    int  left     = nranks;
    std::vector<int> statuses(static_cast<size_t>(nranks), -1);
    while (left > 0) {
        int   status = 0;
        pid_t pid    = waitpid(-1, &status, WNOHANG);
        if (pid > 0) {
            for (int r = 0; r < nranks; ++r) {
                if (pids[static_cast<size_t>(r)] == pid) statuses[static_cast<size_t>(r)] = status;
            }
            --left;
            continue;
        }
        if (std::chrono::steady_clock::now() > deadline) {
            for (int r = 0; r < nranks; ++r) {
                if (statuses[static_cast<size_t>(r)] == -1) {
                    ADD_FAILURE() << "rank " << r << " did not finish within " << timeout_s << " s: killed";
                    kill(pids[static_cast<size_t>(r)], SIGKILL);
                }
            }
            while (left > 0 && waitpid(-1, nullptr, 0) > 0) --left;
            return;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(5));
    }
    for (int r = 0; r < nranks; ++r) {
        int  status    = statuses[static_cast<size_t>(r)];
        bool must_die  = std::find(killed.begin(), killed.end(), r) != killed.end();
        if (must_die) {
            EXPECT_TRUE(WIFSIGNALED(status) && WTERMSIG(status) == SIGKILL) << "rank " << r << " was to kill itself";
        } else {
            EXPECT_TRUE(WIFEXITED(status) && WEXITSTATUS(status) == 0)
                << "rank " << r << " failed (exit status " << (WIFEXITED(status) ? WEXITSTATUS(status) : -1)
                << ", signal " << (WIFSIGNALED(status) ? WTERMSIG(status) : 0) << "): see its messages above";
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Inside a child.

struct Member {
    ncclComm_t   comm   = nullptr;
    cudaStream_t stream = nullptr;
    int          rank   = 0;
    int          size   = 0;
};

Member join(const ncclUniqueId & id, int nranks, int rank) {
    Member m;
    m.rank = rank;
    m.size = nranks;
    CUDA_CHECK(cudaStreamCreate(&m.stream));
    NCCL_CHECK(ncclCommInitRank(&m.comm, nranks, id, rank));
    int count = -1;
    int user  = -1;
    NCCL_CHECK(ncclCommCount(m.comm, &count));
    NCCL_CHECK(ncclCommUserRank(m.comm, &user));
    EMU_CHECK_EQ(count, nranks);
    EMU_CHECK_EQ(user, rank);
    return m;
}

void sync_and_check(const Member & m) {
    CUDA_CHECK(cudaStreamSynchronize(m.stream));
    ncclResult_t async = ncclInternalError;
    NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
    if (async != ncclSuccess) {
        child_failure(__FILE__, __LINE__, std::string("asynchronous NCCL error: ") + ncclGetLastError(m.comm));
    }
}

void leave(Member & m) {
    NCCL_CHECK(ncclCommDestroy(m.comm));
    CUDA_CHECK(cudaStreamDestroy(m.stream));
}

template <typename T>
T * upload(const std::vector<T> & host) {
    void * device = nullptr;
    CUDA_CHECK(cudaMalloc(&device, std::max<size_t>(1, host.size()) * sizeof(T)));
    if (!host.empty()) CUDA_CHECK(cudaMemcpy(device, host.data(), host.size() * sizeof(T), cudaMemcpyHostToDevice));
    return static_cast<T *>(device);
}

template <typename T>
std::vector<T> download(const T * device, size_t count) {
    std::vector<T> host(count);
    if (count > 0) CUDA_CHECK(cudaMemcpy(host.data(), device, count * sizeof(T), cudaMemcpyDeviceToHost));
    return host;
}

// bf16 in the test's own words: from f32 by rounding to nearest even (no NaNs here), to f32 exactly.
uint16_t to_bf16(float value) {
    uint32_t bits;
    std::memcpy(&bits, &value, 4);
    return static_cast<uint16_t>((bits + 0x7fffu + ((bits >> 16) & 1u)) >> 16);
}

float from_bf16(uint16_t h) {
    uint32_t bits = static_cast<uint32_t>(h) << 16;
    float    value;
    std::memcpy(&value, &bits, 4);
    return value;
}

// Inputs, a pure function of the rank and the index: 20-bit mantissas over 2^-8..2^8, so that most sums of
// three or more of them round, and differently in another order.
uint32_t mix(int rank, size_t i) {
    uint64_t h = ((static_cast<uint64_t>(rank) + 1) * 0x9e3779b97f4a7c15ULL) ^
                 ((static_cast<uint64_t>(i) + 7) * 0xc2b2ae3d27d4eb4fULL);
    h ^= h >> 29;
    h *= 0xbf58476d1ce4e5b9ULL;
    h ^= h >> 32;
    return static_cast<uint32_t>(h);
}

float f32_input(int rank, size_t i) {
    uint32_t h        = mix(rank, i);
    int      mantissa = static_cast<int>(h & 0xfffffu) - 0x80000;
    int      exponent = static_cast<int>((h >> 20) % 17) - 8 - 19;
    return std::ldexp(static_cast<float>(mantissa), exponent);
}

// Multiples of 2^-8 with at most 8 significant bits: exact in bf16, and rank 0's 1.0 plus the others' small
// values at index 0 separates rounding once from rounding at each step.
uint16_t bf16_input(int rank, size_t i) {
    if (i == 0) return to_bf16(rank == 0 ? 1.0f : 0x1p-8f);
    int value = static_cast<int>((static_cast<size_t>(rank) * 31 + i * 17) % 255) - 127;
    return to_bf16(static_cast<float>(value) * 0x1p-8f * static_cast<float>(1 + (i % 3)));
}

int32_t i32_input(int rank, size_t i) {
    return static_cast<int32_t>((static_cast<size_t>(rank) * 7919 + i * 104729) % 20001) - 10000;
}

template <typename A>
A combine(ncclRedOp_t op, A a, A b) {
    switch (op) {
        case ncclMax: return b > a ? b : a;
        case ncclMin: return b < a ? b : a;
        default:      return a + b;
    }
}

// The expected reduction at index i: inputs in rank order, accumulated in f32 (bf16 too) or i32.
float expect_f32(ncclRedOp_t op, int nranks, size_t i) {
    float acc = f32_input(0, i);
    for (int q = 1; q < nranks; ++q) acc = combine(op, acc, f32_input(q, i));
    return op == ncclAvg ? acc / static_cast<float>(nranks) : acc;
}

uint16_t expect_bf16(ncclRedOp_t op, int nranks, size_t i) {
    float acc = from_bf16(bf16_input(0, i));
    for (int q = 1; q < nranks; ++q) acc = combine(op, acc, from_bf16(bf16_input(q, i)));
    return to_bf16(op == ncclAvg ? acc / static_cast<float>(nranks) : acc);
}

int32_t expect_i32(ncclRedOp_t op, int nranks, size_t i) {
    int32_t acc = i32_input(0, i);
    for (int q = 1; q < nranks; ++q) acc = combine(op, acc, i32_input(q, i));
    return acc;
}

// Counts the mismatches of `got` against `expected(i)` (bitwise), reporting the first.
template <typename T, typename Expected>
void expect_all(const std::vector<T> & got, Expected expected, const std::string & what) {
    size_t bad   = 0;
    size_t first = 0;
    for (size_t i = 0; i < got.size(); ++i) {
        T want = expected(i);
        if (std::memcmp(&got[i], &want, sizeof(T)) != 0) {
            if (bad++ == 0) first = i;
        }
    }
    if (bad > 0) {
        std::ostringstream text;
        text.precision(9);
        text << what << ": " << bad << " of " << got.size() << " elements differ, first at " << first << " (got "
             << +got[first] << ", expected " << +expected(first) << ")";
        child_failure(__FILE__, __LINE__, text.str());
    }
}

std::string op_text(ncclRedOp_t op) {
    switch (op) {
        case ncclSum: return "sum";
        case ncclAvg: return "avg";
        case ncclMax: return "max";
        case ncclMin: return "min";
        default:      return "op";
    }
}

// One all_reduce of `count` elements, checked against the rank-order rule; out of place unless `in_place`.
void all_reduce_case(Member & m, ncclDataType_t type, ncclRedOp_t op, size_t count, bool in_place) {
    std::string what = "all_reduce " + op_text(op) + " of " + std::to_string(count) + " on " +
                       std::to_string(m.size) + " ranks" + (in_place ? " in place" : "");
    if (type == ncclFloat32) {
        std::vector<float> in(count);
        for (size_t i = 0; i < count; ++i) in[i] = f32_input(m.rank, i);
        float * send = upload(in);
        float * recv = in_place ? send : upload(std::vector<float>(count, -1.0f));
        NCCL_CHECK(ncclAllReduce(send, recv, count, ncclFloat32, op, m.comm, m.stream));
        sync_and_check(m);
        expect_all(download(recv, count), [&](size_t i) { return expect_f32(op, m.size, i); }, "f32 " + what);
    } else if (type == ncclBfloat16) {
        std::vector<uint16_t> in(count);
        for (size_t i = 0; i < count; ++i) in[i] = bf16_input(m.rank, i);
        uint16_t * send = upload(in);
        uint16_t * recv = in_place ? send : upload(std::vector<uint16_t>(count, 0xffff));
        NCCL_CHECK(ncclAllReduce(send, recv, count, ncclBfloat16, op, m.comm, m.stream));
        sync_and_check(m);
        std::vector<uint16_t> got = download(recv, count);
        expect_all(got, [&](size_t i) { return expect_bf16(op, m.size, i); }, "bf16 " + what);
        // 1 + (n-1) * 2^-8 rounded once: on three ranks 1 + 2^-7 exactly, where rounding each step gives 1.
        if (op == ncclSum && m.size == 3) EMU_CHECK_EQ(from_bf16(got[0]), 1.0f + 0x1p-7f);
    } else {
        std::vector<int32_t> in(count);
        for (size_t i = 0; i < count; ++i) in[i] = i32_input(m.rank, i);
        int32_t * send = upload(in);
        int32_t * recv = in_place ? send : upload(std::vector<int32_t>(count, -1));
        NCCL_CHECK(ncclAllReduce(send, recv, count, ncclInt32, op, m.comm, m.stream));
        sync_and_check(m);
        expect_all(download(recv, count), [&](size_t i) { return expect_i32(op, m.size, i); }, "i32 " + what);
    }
}

class NcclEmuRanks : public ::testing::TestWithParam<int> {};

TEST_P(NcclEmuRanks, AllReduceFollowsRankOrderBitForBit) {
    const int    nranks = GetParam();
    ncclUniqueId id     = make_id();
    run_ranks(nranks, [&](int rank) {
        Member m = join(id, nranks, rank);
        for (ncclRedOp_t op : {ncclSum, ncclAvg, ncclMax, ncclMin}) {
            all_reduce_case(m, ncclFloat32, op, 1000, false);
            all_reduce_case(m, ncclBfloat16, op, 1000, op == ncclMax);
            if (op != ncclAvg) all_reduce_case(m, ncclInt32, op, 1000, op == ncclSum);
        }
        // Larger than a slot (1 MiB): several steps, in place.
        all_reduce_case(m, ncclFloat32, ncclSum, (size_t{3} << 20) / 4 + 17, true);
        leave(m);
    });
    EXPECT_FALSE(shm_name_exists(id)) << "the segment's name was left in /dev/shm";
}

INSTANTIATE_TEST_SUITE_P(Ranks, NcclEmuRanks, ::testing::Values(2, 3, 4),
                         [](const ::testing::TestParamInfo<int> & info) {
                             return std::to_string(info.param) + "Ranks";
                         });

TEST(NcclEmu, ReduceScatterOutOfPlaceAndInPlace) {
    const int    nranks = 3;
    ncclUniqueId id     = make_id();
    run_ranks(nranks, [&](int rank) {
        Member m = join(id, nranks, rank);
        // 200000 elements per block: the slot's third holds 87381, so three steps.
        for (size_t block : {size_t{1000}, size_t{200000}}) {
            for (bool in_place : {false, true}) {
                size_t             total = block * nranks;
                std::vector<float> in(total);
                for (size_t i = 0; i < total; ++i) in[i] = f32_input(rank, i);
                float * send = upload(in);
                float * recv = in_place ? send + block * rank : upload(std::vector<float>(block, -1.0f));
                NCCL_CHECK(ncclReduceScatter(send, recv, block, ncclFloat32, ncclSum, m.comm, m.stream));
                sync_and_check(m);
                expect_all(download(recv, block),
                           [&](size_t i) { return expect_f32(ncclSum, nranks, block * rank + i); },
                           "reduce_scatter of " + std::to_string(block) + (in_place ? " in place" : ""));
            }
        }
        leave(m);
    });
}

TEST(NcclEmu, AllGatherOutOfPlaceAndInPlace) {
    const int    nranks = 3;
    ncclUniqueId id     = make_id();
    run_ranks(nranks, [&](int rank) {
        Member m = join(id, nranks, rank);
        for (size_t count : {size_t{777}, size_t{300000}}) {
            for (bool in_place : {false, true}) {
                std::vector<uint16_t> mine(count);
                for (size_t i = 0; i < count; ++i) mine[i] = bf16_input(rank, i);
                std::vector<uint16_t> all(count * nranks, 0xffff);
                uint16_t *            recv = upload(all);
                uint16_t *            send = recv + count * rank;
                if (in_place) {
                    CUDA_CHECK(cudaMemcpy(send, mine.data(), count * 2, cudaMemcpyHostToDevice));
                } else {
                    send = upload(mine);
                }
                NCCL_CHECK(ncclAllGather(send, recv, count, ncclBfloat16, m.comm, m.stream));
                sync_and_check(m);
                expect_all(download(recv, count * nranks),
                           [&](size_t i) { return bf16_input(static_cast<int>(i / count), i % count); },
                           "all_gather of " + std::to_string(count) + (in_place ? " in place" : ""));
            }
        }
        leave(m);
    });
}

TEST(NcclEmu, BroadcastFromANonZeroRootAndReduce) {
    const int    nranks = 3;
    ncclUniqueId id     = make_id();
    run_ranks(nranks, [&](int rank) {
        Member m = join(id, nranks, rank);
        const int root = 2;
        for (size_t count : {size_t{5}, size_t{400000}}) {
            std::vector<int32_t> data(count);
            for (size_t i = 0; i < count; ++i) data[i] = rank == root ? i32_input(root, i) : -7;
            int32_t * buffer = upload(data);   // in place: NCCL reads sendbuff on the root only
            NCCL_CHECK(ncclBroadcast(buffer, buffer, count, ncclInt32, root, m.comm, m.stream));
            sync_and_check(m);
            expect_all(download(buffer, count), [&](size_t i) { return i32_input(root, i); },
                       "broadcast of " + std::to_string(count) + " from rank 2");
        }
        // reduce to rank 1: only the root's output is written.
        std::vector<int32_t> in(1000);
        for (size_t i = 0; i < in.size(); ++i) in[i] = i32_input(rank, i);
        int32_t * send = upload(in);
        int32_t * recv = upload(std::vector<int32_t>(in.size(), 12345));
        NCCL_CHECK(ncclReduce(send, recv, in.size(), ncclInt32, ncclMax, 1, m.comm, m.stream));
        sync_and_check(m);
        expect_all(download(recv, in.size()),
                   [&](size_t i) { return rank == 1 ? expect_i32(ncclMax, nranks, i) : int32_t{12345}; },
                   "reduce max to rank 1");
        leave(m);
    });
}

// Both ranks send to each other and receive in one group: the group progresses both, so no deadlock. Two
// messages each way, larger than a mailbox slot, match in issue order.
TEST(NcclEmu, GroupedSendRecvBothWays) {
    ncclUniqueId id = make_id();
    run_ranks(2, [&](int rank) {
        Member m    = join(id, 2, rank);
        int    peer = 1 - rank;
        size_t big  = 300000;
        std::vector<int32_t> first(big);
        std::vector<int32_t> second(17);
        for (size_t i = 0; i < big; ++i) first[i] = i32_input(rank, i);
        for (size_t i = 0; i < second.size(); ++i) second[i] = -i32_input(rank, i + 5);
        int32_t * send_first  = upload(first);
        int32_t * send_second = upload(second);
        int32_t * recv_first  = upload(std::vector<int32_t>(big, 0));
        int32_t * recv_second = upload(std::vector<int32_t>(second.size(), 0));
        NCCL_CHECK(ncclGroupStart());
        NCCL_CHECK(ncclSend(send_first, big, ncclInt32, peer, m.comm, m.stream));
        NCCL_CHECK(ncclGroupStart());   // nested: launches at the outer end
        NCCL_CHECK(ncclSend(send_second, second.size(), ncclInt32, peer, m.comm, m.stream));
        NCCL_CHECK(ncclGroupEnd());
        NCCL_CHECK(ncclRecv(recv_first, big, ncclInt32, peer, m.comm, m.stream));
        NCCL_CHECK(ncclRecv(recv_second, second.size(), ncclInt32, peer, m.comm, m.stream));
        NCCL_CHECK(ncclGroupEnd());
        sync_and_check(m);
        expect_all(download(recv_first, big), [&](size_t i) { return i32_input(peer, i); }, "first message");
        expect_all(download(recv_second, second.size()), [&](size_t i) { return -i32_input(peer, i + 5); },
                   "second message");
        leave(m);
    });
}

// Loom's all_to_all: one group of sends and receives, blocks of uneven sizes, empty ones skipped (as Loom does).
TEST(NcclEmu, AllToAllWithUnevenAndEmptyBlocks) {
    const int    nranks = 4;
    ncclUniqueId id     = make_id();
    auto count = [](int src, int dst) { return static_cast<size_t>((src * 3 + dst * 5) % 4) * 50000; };   // zeros too
    auto value = [](int src, int dst, size_t i) { return static_cast<int32_t>(src * 1000000 + dst * 100000 + i); };
    run_ranks(nranks, [&](int rank) {
        Member               m = join(id, nranks, rank);
        std::vector<int32_t> in;
        size_t               received = 0;
        for (int p = 0; p < nranks; ++p) {
            for (size_t i = 0; i < count(rank, p); ++i) in.push_back(value(rank, p, i));
            received += count(p, rank);
        }
        int32_t * send = upload(in);
        int32_t * recv = upload(std::vector<int32_t>(received + 3, -1));   // slack that must stay untouched
        size_t    send_offset = 0;
        size_t    recv_offset = 0;
        NCCL_CHECK(ncclGroupStart());
        for (int p = 0; p < nranks; ++p) {
            if (count(rank, p) > 0) {
                NCCL_CHECK(ncclSend(send + send_offset, count(rank, p), ncclInt32, p, m.comm, m.stream));
            }
            if (count(p, rank) > 0) {
                NCCL_CHECK(ncclRecv(recv + recv_offset, count(p, rank), ncclInt32, p, m.comm, m.stream));
            }
            send_offset += count(rank, p);
            recv_offset += count(p, rank);
        }
        NCCL_CHECK(ncclGroupEnd());
        sync_and_check(m);
        std::vector<int32_t> expected;
        for (int p = 0; p < nranks; ++p) {
            for (size_t i = 0; i < count(p, rank); ++i) expected.push_back(value(p, rank, i));
        }
        expected.resize(received + 3, -1);
        expect_all(download(recv, received + 3), [&](size_t i) { return expected[i]; }, "all_to_all");
        leave(m);
    });
}

// Two communicators on the same ranks match independently: rank 1 issues B's collective before A's (on two
// streams, or in one group) and both still meet their partners. Within one communicator, collectives match in
// issue order: a rank that swaps two collectives is told so (NCCL would compute garbage or hang).
TEST(NcclEmu, CommunicatorsMatchInIssueOrderIndependently) {
    ncclUniqueId id_a = make_id();
    ncclUniqueId id_b = make_id();
    ncclUniqueId id_c = make_id();
    run_ranks(2, [&](int rank) {
        Member a = join(id_a, 2, rank);
        Member b = join(id_b, 2, rank);
        std::vector<float> ones(1000, 1.0f);
        std::vector<float> twos(1000, 2.0f);
        float *            x = upload(ones);
        float *            y = upload(twos);
        for (int round = 0; round < 3; ++round) {
            if (rank == 0) {
                NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, a.comm, a.stream));
                NCCL_CHECK(ncclAllReduce(y, y, 1000, ncclFloat32, ncclMax, b.comm, b.stream));
            } else {
                NCCL_CHECK(ncclAllReduce(y, y, 1000, ncclFloat32, ncclMax, b.comm, b.stream));
                NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, a.comm, a.stream));
            }
            // On one communicator, two collectives in issue order: sum then max, the same on both ranks.
            NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, a.comm, a.stream));
        }
        sync_and_check(a);
        sync_and_check(b);
        expect_all(download(x, 1000), [](size_t) { return 64.0f; }, "communicator A: 1 doubled six times");
        expect_all(download(y, 1000), [](size_t) { return 2.0f; }, "communicator B");
        // One group over both communicators on one stream, in opposite orders on the two ranks: a group launches
        // as one unit, so its operations progress together (ungrouped on one stream this would deadlock).
        NCCL_CHECK(ncclGroupStart());
        if (rank == 0) {
            NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, a.comm, a.stream));
            NCCL_CHECK(ncclAllReduce(y, y, 1000, ncclFloat32, ncclSum, b.comm, a.stream));
        } else {
            NCCL_CHECK(ncclAllReduce(y, y, 1000, ncclFloat32, ncclSum, b.comm, a.stream));
            NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, a.comm, a.stream));
        }
        NCCL_CHECK(ncclGroupEnd());
        sync_and_check(a);
        sync_and_check(b);
        expect_all(download(x, 1000), [](size_t) { return 128.0f; }, "communicator A in the group");
        expect_all(download(y, 1000), [](size_t) { return 4.0f; }, "communicator B in the group");
        leave(a);
        leave(b);

        // Swapped order on one communicator: rank 0 all_reduces then all_gathers, rank 1 the other way round.
        Member c = join(id_c, 2, rank);
        float * gathered = upload(std::vector<float>(2000, 0.0f));
        // The second call may already be refused (the communicator failed in the first): either is right.
        if (rank == 0) {
            NCCL_CHECK(ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, c.comm, c.stream));
            ncclAllGather(x, gathered, 1000, ncclFloat32, c.comm, c.stream);
        } else {
            NCCL_CHECK(ncclAllGather(x, gathered, 1000, ncclFloat32, c.comm, c.stream));
            ncclAllReduce(x, x, 1000, ncclFloat32, ncclSum, c.comm, c.stream);
        }
        CUDA_CHECK(cudaStreamSynchronize(c.stream));
        ncclResult_t async = ncclSuccess;
        NCCL_CHECK(ncclCommGetAsyncError(c.comm, &async));
        EMU_CHECK(async == ncclInvalidUsage || async == ncclRemoteError);
        std::string text = ncclGetLastError(c.comm);
        EMU_CHECK(text.find("collective #0") != std::string::npos);
        NCCL_CHECK(ncclCommDestroy(c.comm));
    });
}

// Two ranks that each send to the other before receiving, outside a group, deadlock as on NCCL (a send waits for
// the matching receive); ncclCommAbort ends the wait with an error instead of a hang.
TEST(NcclEmu, UngroupedCrossSendsDeadlockUntilAborted) {
    ncclUniqueId id      = make_id();
    ncclUniqueId barrier = make_id();
    run_ranks(2, [&](int rank) {
        Member m    = join(id, 2, rank);
        Member bar  = join(barrier, 2, rank);
        int    peer = 1 - rank;
        // Everything is uploaded first: cudaMemcpy runs on the legacy stream, which would wait for the deadlock.
        int32_t * out   = upload(std::vector<int32_t>(1000, rank));
        int32_t * in    = upload(std::vector<int32_t>(1000, -1));
        int32_t * token = upload(std::vector<int32_t>(1, 1));
        NCCL_CHECK(ncclSend(out, 1000, ncclInt32, peer, m.comm, m.stream));
        NCCL_CHECK(ncclRecv(in, 1000, ncclInt32, peer, m.comm, m.stream));
        std::this_thread::sleep_for(std::chrono::seconds(2));
        EMU_CHECK_EQ(cudaStreamQuery(m.stream), cudaErrorNotReady);
        ncclResult_t async = ncclInternalError;
        NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
        EMU_CHECK_EQ(async, ncclSuccess);
        // Both ranks have seen the deadlock before either aborts (an abort also stops the peer's operations).
        NCCL_CHECK(ncclAllReduce(token, token, 1, ncclInt32, ncclSum, bar.comm, bar.stream));
        sync_and_check(bar);
        if (rank == 0) NCCL_CHECK(ncclCommAbort(m.comm));
        // Rank 1 does not abort: the peer's abort stops its operations, naming rank 0.
        CUDA_CHECK(cudaStreamSynchronize(m.stream));
        NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
        std::string text = ncclGetLastError(m.comm);
        if (rank == 0) {
            EMU_CHECK_EQ(async, ncclSystemError);
            EMU_CHECK(text.find("ncclCommAbort") != std::string::npos);
        } else {
            EMU_CHECK_EQ(async, ncclRemoteError);
            EMU_CHECK(text.find("rank 0") != std::string::npos);
        }
        EMU_CHECK(text.find("ncclSend") != std::string::npos);
        // Later calls on the failed communicator are refused at once.
        EMU_CHECK(ncclAllReduce(token, token, 1, ncclInt32, ncclSum, m.comm, m.stream) != ncclSuccess);
        NCCL_CHECK(ncclCommDestroy(m.comm));
        leave(bar);
    });
}

// A rank that dies while its peers wait: their collective fails with an error naming it instead of hanging.
TEST(NcclEmu, ARankThatDiesFailsItsPeersNamingIt) {
    const int    nranks = 3;
    ncclUniqueId id     = make_id();
    run_ranks(
        nranks,
        [&](int rank) {
            Member  m    = join(id, nranks, rank);
            float * data = upload(std::vector<float>(400000, 1.0f));
            NCCL_CHECK(ncclAllReduce(data, data, 400000, ncclFloat32, ncclSum, m.comm, m.stream));
            sync_and_check(m);
            if (rank == 1) raise(SIGKILL);
            auto start = std::chrono::steady_clock::now();
            NCCL_CHECK(ncclAllReduce(data, data, 400000, ncclFloat32, ncclSum, m.comm, m.stream));
            CUDA_CHECK(cudaStreamSynchronize(m.stream));
            double seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
            ncclResult_t async = ncclSuccess;
            NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
            EMU_CHECK_EQ(async, ncclRemoteError);
            std::string text = ncclGetLastError(m.comm);
            EMU_CHECK(text.find("rank 1") != std::string::npos);
            EMU_CHECK(seconds < 10);
            if (g_failures > 0) std::fprintf(stderr, "[rank %d] the error was: %s\n", rank, text.c_str());
            NCCL_CHECK(ncclCommDestroy(m.comm));
        },
        {1});
    EXPECT_FALSE(shm_name_exists(id));
}

// A rank that destroys the communicator while a peer still waits for it (the ranks issued different operations):
// the peer fails naming it.
TEST(NcclEmu, APeerThatLeavesEarlyFailsTheWaitingRank) {
    ncclUniqueId id = make_id();
    run_ranks(2, [&](int rank) {
        Member  m    = join(id, 2, rank);
        float * data = upload(std::vector<float>(10, 1.0f));
        if (rank == 0) {
            NCCL_CHECK(ncclAllReduce(data, data, 10, ncclFloat32, ncclSum, m.comm, m.stream));
            CUDA_CHECK(cudaStreamSynchronize(m.stream));
            ncclResult_t async = ncclSuccess;
            NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
            EMU_CHECK_EQ(async, ncclRemoteError);
            EMU_CHECK(std::string(ncclGetLastError(m.comm)).find("rank 1 destroyed") != std::string::npos);
        }
        leave(m);
    });
}

// LOOM_EMU_NCCL_TIMEOUT_S bounds a wait without progress (off by default: Loom's watchdog aborts instead).
TEST(NcclEmu, TheOptionalTimeoutEndsAWaitWithoutProgress) {
    ncclUniqueId id = make_id();
    run_ranks(2, [&](int rank) {
        setenv("LOOM_EMU_NCCL_TIMEOUT_S", "0.5", 1);
        Member  m    = join(id, 2, rank);
        float * data = upload(std::vector<float>(10, 1.0f));
        if (rank == 0) {
            NCCL_CHECK(ncclAllReduce(data, data, 10, ncclFloat32, ncclSum, m.comm, m.stream));
            CUDA_CHECK(cudaStreamSynchronize(m.stream));
            ncclResult_t async = ncclSuccess;
            NCCL_CHECK(ncclCommGetAsyncError(m.comm, &async));
            EMU_CHECK_EQ(async, ncclSystemError);
            std::string text = ncclGetLastError(m.comm);
            EMU_CHECK(text.find("LOOM_EMU_NCCL_TIMEOUT_S") != std::string::npos);
            EMU_CHECK(text.find("waiting for rank 1") != std::string::npos);
        } else {
            std::this_thread::sleep_for(std::chrono::milliseconds(1500));   // alive, but issues nothing
        }
        leave(m);
    });
}

TEST(NcclEmu, RefusesBadArguments) {
    ncclUniqueId id = make_id();
    run_ranks(1, [&](int) {
        ncclComm_t comm = nullptr;
        EMU_CHECK_EQ(ncclCommInitRank(&comm, 0, id, 0), ncclInvalidArgument);
        EMU_CHECK_EQ(ncclCommInitRank(&comm, 2, id, 2), ncclInvalidArgument);
        ncclUniqueId foreign;
        std::memset(&foreign, 'x', sizeof(foreign));
        EMU_CHECK_EQ(ncclCommInitRank(&comm, 1, foreign, 0), ncclInvalidArgument);
        Member m = join(id, 1, 0);
        int32_t * ints = upload(std::vector<int32_t>{3, 4});
        EMU_CHECK_EQ(ncclAllReduce(ints, ints, 2, ncclInt32, ncclAvg, m.comm, m.stream), ncclInvalidArgument);
        EMU_CHECK(std::string(ncclGetLastError(nullptr)).find("ncclAvg") != std::string::npos);
        EMU_CHECK_EQ(ncclSend(ints, 2, ncclInt32, 1, m.comm, m.stream), ncclInvalidArgument);
        EMU_CHECK_EQ(ncclBroadcast(ints, ints, 2, ncclInt32, -1, m.comm, m.stream), ncclInvalidArgument);
        EMU_CHECK_EQ(ncclAllReduce(ints, nullptr, 2, ncclInt32, ncclSum, m.comm, m.stream), ncclInvalidArgument);
        EMU_CHECK_EQ(ncclGroupEnd(), ncclInvalidUsage);
        // A failed call inside a group fails the group: nothing of it is launched.
        NCCL_CHECK(ncclGroupStart());
        EMU_CHECK_EQ(ncclSend(ints, 2, ncclInt32, 5, m.comm, m.stream), ncclInvalidArgument);
        EMU_CHECK_EQ(ncclGroupEnd(), ncclInvalidArgument);
        // One rank: a sum is a copy; an empty operation is no operation.
        int32_t * out = upload(std::vector<int32_t>{0, 0});
        NCCL_CHECK(ncclAllReduce(ints, out, 2, ncclInt32, ncclSum, m.comm, m.stream));
        NCCL_CHECK(ncclAllReduce(nullptr, nullptr, 0, ncclInt32, ncclSum, m.comm, m.stream));
        sync_and_check(m);
        EMU_CHECK(download(out, 2) == (std::vector<int32_t>{3, 4}));
        int version = 0;
        NCCL_CHECK(ncclGetVersion(&version));
        EMU_CHECK_EQ(version, NCCL_VERSION_CODE);
        leave(m);
    });
}

}  // namespace
