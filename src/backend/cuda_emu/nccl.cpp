// The NCCL stand-in of the emulated CUDA device (nccl.h): NCCL's semantics between the processes (or threads) of
// one machine, over a POSIX shared-memory segment per communicator. No MPI: like NCCL, it needs only the id that
// the caller passes from one rank to the others.
//
// The segment. ncclGetUniqueId puts a fresh shared-memory name in the id. Rank 0 creates the segment (O_EXCL)
// and initialises it, then sets its magic; the other ranks retry opening it until the magic is there. Every rank
// registers its pid, and the last one to arrive unlinks the name, so nothing is left in /dev/shm when a process
// dies later (the mappings keep the memory alive). The segment holds, per rank, kDepth slots of `coll_chunk`
// bytes for collectives and, per ordered pair of ranks (src, dst), a mailbox of kDepth slots of `p2p_chunk` bytes
// for sends and receives, with their sequence counters as lock-free std::atomic (address-free, so they work
// between processes).
//
// Collectives. All collectives of a communicator take global steps, numbered alike on every rank since the ranks
// run the same collectives in the same order. In step s a rank writes its part of the data into its slot s %
// kDepth (once every rank has consumed step s - kDepth), publishes s, waits for the ranks it reads from to have
// published s, reads their slots and marks s consumed. Every rank reduces all the ranks' slots itself, in rank
// order, so the result is deterministic and the same on every rank; large messages take several steps.
//
// Sends and receives. A receive first posts itself (the pair's `recv_posted` counter); the matching send starts
// only then, moves the data through the mailbox slot by slot, and completes once the receiver has read the last
// slot. So a send is a rendezvous, as on NCCL: two ranks that each send to the other before receiving, outside a
// group, wait forever (until aborted).
//
// Execution. Each call (or each stream's share of a group) is one unit enqueued on its stream with
// loom_emu::enqueue; the stream's worker runs it. A unit's operations are state machines that the worker steps
// in turn until all have completed, so the operations of a group progress together. When a unit runs, its
// operations take their tickets: the collective index of their communicator, or the index of the send (receive)
// to that peer. An operation starts once the previous one with the same kind of ticket has completed on this
// rank, which keeps a communicator's operations in order even when they run on several streams.
//
// Failures. While it waits, a unit checks (each round without progress) the communicator's abort flag and the
// segment's failure flag (set by a rank that aborted or failed), and, every 100 ms, whether the peer it waits
// for still exists (its pid) or has destroyed the communicator; LOOM_EMU_NCCL_TIMEOUT_S (default 0: none) bounds
// a wait without progress. A failure is recorded on the communicator (ncclCommGetAsyncError, ncclGetLastError)
// and, unless it came from a peer, set on the segment so the peers' waiting operations stop too, naming this
// rank. A failed operation leaves its output undefined and the stream goes on, as NCCL's kernels do on abort.
//
// Environment: LOOM_EMU_NCCL_TIMEOUT_S, LOOM_EMU_NCCL_INIT_TIMEOUT_S (default 60), LOOM_EMU_NCCL_CHUNK_BYTES
// (collective slot, default 1 MiB), LOOM_EMU_NCCL_P2P_CHUNK_BYTES (mailbox slot, default 128 KiB) (the slot
// sizes of rank 0 hold for the whole communicator), NCCL_DEBUG (WARN or INFO: failures are also printed).
#include <nccl.h>

#include "half_bits.h"

#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cerrno>
#include <chrono>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <fstream>
#include <memory>
#include <mutex>
#include <new>
#include <random>
#include <sstream>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace loom_emu {

namespace {

using namespace half_bits;

using Clock = std::chrono::steady_clock;

constexpr uint64_t kMagic      = 0x6c6f6f6d2d6e636cULL;   // "loom-ncl"
constexpr int      kDepth      = 2;                       // slots per rank (collectives) and per pair (p2p)
constexpr char     kIdPrefix[] = "/loom-nccl-";
constexpr uint32_t kJoined     = 1;
constexpr uint32_t kDeparted   = 2;
constexpr size_t   kPoisonText = 1024;

static_assert(std::atomic<uint64_t>::is_always_lock_free, "shared-memory counters must be lock-free");
static_assert(std::atomic<uint32_t>::is_always_lock_free, "shared-memory counters must be lock-free");
static_assert(std::atomic<int32_t>::is_always_lock_free, "shared-memory counters must be lock-free");

// ---------------------------------------------------------------------------------------------------------------
// Environment and messages.

double env_seconds(const char * name, double fallback) {
    const char * text = std::getenv(name);
    if (text == nullptr || *text == '\0') return fallback;
    char * end   = nullptr;
    double value = std::strtod(text, &end);
    return end != text && value >= 0 ? value : fallback;
}

size_t env_bytes(const char * name, size_t fallback) {
    const char * text = std::getenv(name);
    if (text == nullptr || *text == '\0') return fallback;
    char *             end   = nullptr;
    unsigned long long value = std::strtoull(text, &end, 10);
    return end != text && value > 0 ? static_cast<size_t>(value) : fallback;
}

// 0 means no timeout: Loom has its own watchdog, which aborts the communicator and reports.
double op_timeout_s() {
    static const double value = env_seconds("LOOM_EMU_NCCL_TIMEOUT_S", 0);
    return value;
}

bool debug_warn() {
    static const bool value = [] {
        const char * text = std::getenv("NCCL_DEBUG");
        if (text == nullptr) return false;
        std::string level(text);
        for (char & ch : level) ch = static_cast<char>(std::toupper(static_cast<unsigned char>(ch)));
        return level == "WARN" || level == "INFO" || level == "TRACE";
    }();
    return value;
}

void warn(const std::string & text) {
    if (!debug_warn()) return;
    std::fprintf(stderr, "[pid %d] NCCL WARN (loom-emu) %s\n", static_cast<int>(getpid()), text.c_str());
}

// The error of this thread's last failed call, for ncclGetLastError without a failed communicator.
thread_local std::string t_last_nccl_error;

ncclResult_t call_error(ncclResult_t code, std::string text) {
    warn(text);
    t_last_nccl_error = std::move(text);
    return code;
}

const char * type_name(ncclDataType_t type) {
    switch (type) {
        case ncclInt8:     return "int8";
        case ncclUint8:    return "uint8";
        case ncclInt32:    return "int32";
        case ncclUint32:   return "uint32";
        case ncclInt64:    return "int64";
        case ncclUint64:   return "uint64";
        case ncclFloat16:  return "float16";
        case ncclFloat32:  return "float32";
        case ncclFloat64:  return "float64";
        case ncclBfloat16: return "bfloat16";
        default:           return "unknown type";
    }
}

size_t type_size(ncclDataType_t type) {
    switch (type) {
        case ncclInt8:
        case ncclUint8:    return 1;
        case ncclFloat16:
        case ncclBfloat16: return 2;
        case ncclInt32:
        case ncclUint32:
        case ncclFloat32:  return 4;
        default:           return 8;
    }
}

bool is_floating(ncclDataType_t type) {
    return type == ncclFloat16 || type == ncclFloat32 || type == ncclFloat64 || type == ncclBfloat16;
}

const char * op_name(ncclRedOp_t op) {
    switch (op) {
        case ncclSum:  return "sum";
        case ncclProd: return "prod";
        case ncclMax:  return "max";
        case ncclMin:  return "min";
        case ncclAvg:  return "avg";
        default:       return "unknown op";
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Reductions: out[i] = in[0][i] op in[1][i] op ... in rank order, accumulated in Acc and stored once.

template <typename T>
struct Plain {
    using Acc = T;
    static Acc load(const char * p, size_t i) {
        T value;
        std::memcpy(&value, p + i * sizeof(T), sizeof(T));
        return value;
    }
    static void store(char * p, size_t i, Acc value) { std::memcpy(p + i * sizeof(T), &value, sizeof(T)); }
};

// A 16-bit float format accumulated in f32: widened exactly on load, rounded once on store.
template <float (*Widen)(uint16_t), uint16_t (*Narrow)(float)>
struct Float16Format {
    using Acc = float;
    static Acc load(const char * p, size_t i) {
        uint16_t h;
        std::memcpy(&h, p + i * 2, 2);
        return Widen(h);
    }
    static void store(char * p, size_t i, Acc value) {
        uint16_t h = Narrow(value);
        std::memcpy(p + i * 2, &h, 2);
    }
};
using Half   = Float16Format<f16_to_float, float_to_f16>;
using BFloat = Float16Format<bf16_to_float, float_to_bf16>;

// Integer sums and products wrap around (in the unsigned type, so without undefined behaviour), as on a GPU.
struct SumOp {
    template <typename A>
    A operator()(A a, A b) const {
        if constexpr (std::is_integral_v<A>) {
            using U = std::make_unsigned_t<A>;
            return static_cast<A>(static_cast<U>(static_cast<U>(a) + static_cast<U>(b)));
        } else {
            return a + b;
        }
    }
};

struct ProdOp {
    template <typename A>
    A operator()(A a, A b) const {
        if constexpr (std::is_integral_v<A>) {
            using U = std::conditional_t<(sizeof(A) < sizeof(unsigned)), unsigned, std::make_unsigned_t<A>>;
            return static_cast<A>(static_cast<U>(a) * static_cast<U>(b));
        } else {
            return a * b;
        }
    }
};

struct MaxOp {
    template <typename A>
    A operator()(A a, A b) const { return b > a ? b : a; }
};

struct MinOp {
    template <typename A>
    A operator()(A a, A b) const { return b < a ? b : a; }
};

template <typename Codec, typename Combine>
void reduce_loop(const char * const * in, int nranks, char * out, size_t count, bool average) {
    using Acc = typename Codec::Acc;
    Combine combine;
    for (size_t i = 0; i < count; ++i) {
        Acc acc = Codec::load(in[0], i);
        for (int q = 1; q < nranks; ++q) acc = combine(acc, Codec::load(in[q], i));
        if constexpr (std::is_floating_point_v<Acc>) {
            if (average) acc = acc / static_cast<Acc>(nranks);
        }
        Codec::store(out, i, acc);
    }
}

template <typename Codec>
void reduce_codec(ncclRedOp_t op, const char * const * in, int nranks, char * out, size_t count) {
    switch (op) {
        case ncclSum:  reduce_loop<Codec, SumOp>(in, nranks, out, count, false); break;
        case ncclAvg:  reduce_loop<Codec, SumOp>(in, nranks, out, count, true); break;
        case ncclProd: reduce_loop<Codec, ProdOp>(in, nranks, out, count, false); break;
        case ncclMax:  reduce_loop<Codec, MaxOp>(in, nranks, out, count, false); break;
        case ncclMin:  reduce_loop<Codec, MinOp>(in, nranks, out, count, false); break;
        default:       break;   // refused when issued
    }
}

void reduce(ncclDataType_t type, ncclRedOp_t op, const char * const * in, int nranks, char * out, size_t count) {
    switch (type) {
        case ncclInt8:     reduce_codec<Plain<int8_t>>(op, in, nranks, out, count); break;
        case ncclUint8:    reduce_codec<Plain<uint8_t>>(op, in, nranks, out, count); break;
        case ncclInt32:    reduce_codec<Plain<int32_t>>(op, in, nranks, out, count); break;
        case ncclUint32:   reduce_codec<Plain<uint32_t>>(op, in, nranks, out, count); break;
        case ncclInt64:    reduce_codec<Plain<int64_t>>(op, in, nranks, out, count); break;
        case ncclUint64:   reduce_codec<Plain<uint64_t>>(op, in, nranks, out, count); break;
        case ncclFloat16:  reduce_codec<Half>(op, in, nranks, out, count); break;
        case ncclFloat32:  reduce_codec<Plain<float>>(op, in, nranks, out, count); break;
        case ncclFloat64:  reduce_codec<Plain<double>>(op, in, nranks, out, count); break;
        case ncclBfloat16: reduce_codec<BFloat>(op, in, nranks, out, count); break;
        default:           break;
    }
}

// ---------------------------------------------------------------------------------------------------------------
// The shared segment.

enum class Kind : uint32_t { none = 0, all_reduce, reduce_scatter, all_gather, broadcast, reduce, send, recv };

const char * kind_name(Kind kind) {
    switch (kind) {
        case Kind::all_reduce:     return "ncclAllReduce";
        case Kind::reduce_scatter: return "ncclReduceScatter";
        case Kind::all_gather:     return "ncclAllGather";
        case Kind::broadcast:      return "ncclBroadcast";
        case Kind::reduce:         return "ncclReduce";
        case Kind::send:           return "ncclSend";
        case Kind::recv:           return "ncclRecv";
        default:                   return "nothing";
    }
}

bool is_reduction(Kind kind) {
    return kind == Kind::all_reduce || kind == Kind::reduce_scatter || kind == Kind::reduce;
}
bool has_root(Kind kind) { return kind == Kind::broadcast || kind == Kind::reduce; }

// What a rank's collective in a step is, so that the readers can tell a mismatch from data.
struct CollMeta {
    uint64_t ticket;   // the collective's index on its communicator
    uint64_t count;
    uint64_t bytes;
    uint32_t kind;
    int32_t  type;
    int32_t  op;
    int32_t  root;
};

struct alignas(64) SharedRank {
    std::atomic<int32_t>  pid{0};     // claimed when the rank joins
    std::atomic<uint32_t> state{0};   // kJoined, then kDeparted at ncclCommDestroy
    uint64_t              start_time = 0;   // with the pid, tells a dead process from a reused pid
    alignas(64) std::atomic<uint64_t> published{0};   // the last step whose data is in this rank's slot
    CollMeta meta[kDepth] = {};
    alignas(64) std::atomic<uint64_t> consumed{0};   // the last step this rank has read the slots of
};

struct SlotMeta {
    uint64_t ticket;   // 1 + the send's index to this peer
    uint64_t bytes;    // the whole message's size
};

struct alignas(64) Mailbox {
    alignas(64) std::atomic<uint64_t> recv_posted{0};   // receiver: receives posted so far
    alignas(64) std::atomic<uint64_t> written{0};       // sender: slots written so far
    SlotMeta meta[kDepth] = {};
    alignas(64) std::atomic<uint64_t> read{0};   // receiver: slots read so far
};

struct alignas(64) Header {
    std::atomic<uint64_t> magic{0};
    int32_t               nranks      = 0;
    uint64_t              total_bytes = 0;
    uint64_t              coll_chunk  = 0;
    uint64_t              p2p_chunk   = 0;
    std::atomic<uint32_t> arrived{0};
    std::atomic<uint32_t> poison{0};   // 0 fine, 1 being set, 2 + r: rank r failed (poison_text says how)
    char                  poison_text[kPoisonText] = {};
};

struct Layout {
    size_t ranks = 0;
    size_t boxes = 0;
    size_t coll  = 0;
    size_t p2p   = 0;
    size_t total = 0;
};

size_t round_up(size_t value, size_t to) { return (value + to - 1) / to * to; }

Layout layout(int nranks, size_t coll_chunk, size_t p2p_chunk) {
    auto   n = static_cast<size_t>(nranks);
    Layout l;
    l.ranks = round_up(sizeof(Header), 4096);
    l.boxes = l.ranks + n * sizeof(SharedRank);
    l.coll  = round_up(l.boxes + n * n * sizeof(Mailbox), 4096);
    l.p2p   = l.coll + n * kDepth * coll_chunk;
    l.total = l.p2p + n * n * kDepth * p2p_chunk;
    return l;
}

// A process's start time (in clock ticks since boot), which with its pid names it uniquely; 0 if unknown.
uint64_t process_start_time(int pid) {
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string   text;
    if (!std::getline(stat, text)) return 0;
    size_t close = text.rfind(')');   // the command name may hold spaces and parentheses
    if (close == std::string::npos) return 0;
    std::istringstream fields(text.substr(close + 1));
    std::string        field;
    for (int i = 3; i <= 22 && fields >> field; ++i) {
        if (i == 22) return std::strtoull(field.c_str(), nullptr, 10);
    }
    return 0;
}

// False once the process is gone: no such pid, a zombie, or the pid now names a younger process.
bool process_alive(int pid, uint64_t start_time) {
    if (pid <= 0) return false;
    if (kill(pid, 0) != 0 && errno == ESRCH) return false;
    std::ifstream stat("/proc/" + std::to_string(pid) + "/stat");
    std::string   text;
    if (!std::getline(stat, text)) return true;   // no /proc to look at: trust kill()
    size_t close = text.rfind(')');
    if (close == std::string::npos || close + 2 >= text.size()) return true;
    char state = text[close + 2];
    if (state == 'Z' || state == 'X' || state == 'x') return false;
    uint64_t now = process_start_time(pid);
    return start_time == 0 || now == 0 || now == start_time;
}

// ---------------------------------------------------------------------------------------------------------------
// A communicator on this rank.

struct CommState {
    std::string name;   // the segment's name, from the id
    int         rank   = 0;
    int         nranks = 1;

    void *       base  = MAP_FAILED;
    size_t       bytes = 0;
    Header *     header = nullptr;
    SharedRank * ranks  = nullptr;
    Mailbox *    boxes  = nullptr;
    char *       coll   = nullptr;
    char *       p2p    = nullptr;
    size_t       coll_chunk = 0;
    size_t       p2p_chunk  = 0;

    // Tickets, taken when a unit starts (ticket_mutex), and this rank's completed operations of each kind.
    std::mutex                               ticket_mutex;
    uint64_t                                 coll_issued = 0;
    std::atomic<uint64_t>                    coll_done{0};
    uint64_t                                 next_step = 0;   // owned by the running collective
    std::vector<uint64_t>                    send_issued;
    std::vector<uint64_t>                    recv_issued;
    std::unique_ptr<std::atomic<uint64_t>[]> send_done;
    std::unique_ptr<std::atomic<uint64_t>[]> recv_done;

    std::atomic<bool> aborted{false};
    std::atomic<bool> destroyed{false};
    std::atomic<int>  active{0};   // units of this communicator running now

    // The first error; error_text is written once, before `error` (release), and never changed after.
    std::mutex                error_mutex;
    std::atomic<ncclResult_t> error{ncclSuccess};
    std::string               error_text;

    ~CommState() {
        if (base != MAP_FAILED) munmap(base, bytes);
    }

    Mailbox & box(int src, int dst) { return boxes[static_cast<size_t>(src) * nranks + dst]; }

    char * coll_slot(int r, uint64_t step) {
        return coll + (static_cast<size_t>(r) * kDepth + step % kDepth) * coll_chunk;
    }

    char * p2p_slot(int src, int dst, uint64_t slot) {
        return p2p + ((static_cast<size_t>(src) * nranks + dst) * kDepth + slot % kDepth) * p2p_chunk;
    }

    std::string where() const {
        return "rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " of communicator " + name;
    }

    // Tells the peers that this rank failed (first failure of any rank wins): their waits stop, naming it.
    void poison(const std::string & text) {
        uint32_t expected = 0;
        if (!header->poison.compare_exchange_strong(expected, 1, std::memory_order_acq_rel)) return;
        std::snprintf(header->poison_text, kPoisonText, "%s", text.c_str());
        header->poison.store(2 + static_cast<uint32_t>(rank), std::memory_order_release);
    }

    void fail(ncclResult_t code, const std::string & text, bool tell_peers) {
        bool first = false;
        {
            std::lock_guard<std::mutex> lock(error_mutex);
            if (error.load(std::memory_order_relaxed) == ncclSuccess) {
                error_text = text;
                error.store(code, std::memory_order_release);
                first = true;
            }
        }
        if (first) warn(text);
        if (tell_peers) poison(text);
    }
};

}  // namespace

// The handle: frees the communicator at ncclCommDestroy, while units still queued keep its state alive.
struct ncclComm {
    std::shared_ptr<CommState> state;
};

namespace {

// ---------------------------------------------------------------------------------------------------------------
// Operations and units.

struct OpDesc {
    Kind                       kind = Kind::none;
    std::shared_ptr<CommState> comm;
    const char *               send  = nullptr;
    char *                     recv  = nullptr;
    size_t                     count = 0;   // recvcount (reduce_scatter), sendcount (all_gather), else count
    ncclDataType_t             type  = ncclInt8;
    ncclRedOp_t                op    = ncclSum;
    int                        peer  = 0;   // root (broadcast, reduce) or peer (send, recv)
    cudaStream_t               stream = nullptr;
};

struct Unit {
    std::vector<OpDesc> ops;
};

enum class Step { blocked, advanced, done, failed };

struct Failure {
    ncclResult_t code = ncclSuccess;
    std::string  text;
    bool         tell_peers = true;
};

// An operation while its unit runs.
struct Exec {
    const OpDesc *             d = nullptr;
    CommState *                c = nullptr;
    int                        phase  = 0;
    uint64_t                   ticket = 0;
    uint64_t                   base   = 0;   // first step (collective) or slot (p2p) of the operation
    uint64_t                   steps  = 0;
    uint64_t                   j      = 0;   // steps done
    size_t                     per_step = 0;   // elements per step (collective) or bytes per slot (p2p)
    int                        blocked_on = -1;   // the peer rank it waits for, -1 for none (or this rank's turn)
    bool                       finished   = false;
    std::vector<const char *>  inputs;
};

std::string describe(const OpDesc & d) {
    std::ostringstream text;
    text << kind_name(d.kind) << " of " << d.count << " x " << type_name(d.type);
    if (is_reduction(d.kind)) text << " (" << op_name(d.op) << ")";
    if (has_root(d.kind)) text << " with root " << d.peer;
    if (d.kind == Kind::send) text << " to rank " << d.peer;
    if (d.kind == Kind::recv) text << " from rank " << d.peer;
    return text.str();
}

std::string describe(const Exec & e) {
    std::ostringstream text;
    text << describe(*e.d);
    if (e.d->kind == Kind::send || e.d->kind == Kind::recv) {
        text << " (its " << (e.d->kind == Kind::send ? "send #" : "receive #") << e.ticket << ")";
    } else {
        text << " (collective #" << e.ticket << ")";
    }
    text << " on " << e.c->where();
    return text.str();
}

std::string describe_meta(const CollMeta & m) {
    OpDesc d;
    d.kind  = static_cast<Kind>(m.kind);
    d.count = m.count;
    d.type  = static_cast<ncclDataType_t>(m.type);
    d.op    = static_cast<ncclRedOp_t>(m.op);
    d.peer  = m.root;
    return describe(d);
}

bool coll_reads_from(const Exec & e, int q) {
    switch (e.d->kind) {
        case Kind::broadcast: return q == e.d->peer;
        case Kind::reduce:    return e.c->rank == e.d->peer;
        default:              return true;
    }
}

// The steps of a collective and the elements each moves (per rank's block, for reduce_scatter).
void plan_collective(Exec & e) {
    size_t elem  = type_size(e.d->type);
    size_t chunk = e.c->coll_chunk;
    if (e.d->kind == Kind::reduce_scatter) chunk /= static_cast<size_t>(e.c->nranks);
    e.per_step = std::max<size_t>(1, chunk / elem);
    e.steps    = (e.d->count + e.per_step - 1) / e.per_step;
}

void write_step(Exec & e, char * slot) {
    const OpDesc & d    = *e.d;
    size_t         elem = type_size(d.type);
    size_t         from = e.j * e.per_step;
    size_t         n    = std::min(e.per_step, d.count - from);
    switch (d.kind) {
        case Kind::all_reduce:
        case Kind::reduce:
        case Kind::all_gather:
            std::memcpy(slot, d.send + from * elem, n * elem);
            break;
        case Kind::broadcast:
            if (e.c->rank == d.peer) std::memcpy(slot, d.send + from * elem, n * elem);
            break;
        case Kind::reduce_scatter:
            for (int b = 0; b < e.c->nranks; ++b) {
                std::memcpy(slot + static_cast<size_t>(b) * e.per_step * elem,
                            d.send + (static_cast<size_t>(b) * d.count + from) * elem, n * elem);
            }
            break;
        default:
            break;
    }
}

void read_step(Exec & e, uint64_t step) {
    const OpDesc & d    = *e.d;
    CommState &    c    = *e.c;
    size_t         elem = type_size(d.type);
    size_t         from = e.j * e.per_step;
    size_t         n    = std::min(e.per_step, d.count - from);
    switch (d.kind) {
        case Kind::all_reduce:
        case Kind::reduce:
            if (d.kind == Kind::reduce && c.rank != d.peer) break;
            for (int q = 0; q < c.nranks; ++q) e.inputs[q] = c.coll_slot(q, step);
            reduce(d.type, d.op, e.inputs.data(), c.nranks, d.recv + from * elem, n);
            break;
        case Kind::reduce_scatter:
            for (int q = 0; q < c.nranks; ++q) {
                e.inputs[q] = c.coll_slot(q, step) + static_cast<size_t>(c.rank) * e.per_step * elem;
            }
            reduce(d.type, d.op, e.inputs.data(), c.nranks, d.recv + from * elem, n);
            break;
        case Kind::all_gather:
            for (int q = 0; q < c.nranks; ++q) {
                std::memcpy(d.recv + (static_cast<size_t>(q) * d.count + from) * elem, c.coll_slot(q, step), n * elem);
            }
            break;
        case Kind::broadcast:
            if (c.rank != d.peer || d.recv != d.send) {
                std::memcpy(d.recv + from * elem, c.coll_slot(d.peer, step), n * elem);
            }
            break;
        default:
            break;
    }
}

CollMeta meta_of(const Exec & e) {
    CollMeta m;
    m.ticket = e.ticket;
    m.count  = e.d->count;
    m.bytes  = e.d->count * type_size(e.d->type);
    m.kind   = static_cast<uint32_t>(e.d->kind);
    m.type   = e.d->type;
    m.op     = e.d->op;
    m.root   = has_root(e.d->kind) ? e.d->peer : -1;
    return m;
}

// Whether two ranks' collectives of the same index agree: the kind, the root, and the size (for a reduction
// also the type and the operator; the others only move bytes).
bool same_collective(const CollMeta & a, const CollMeta & b) {
    if (a.ticket != b.ticket || a.kind != b.kind || a.root != b.root || a.bytes != b.bytes) return false;
    if (is_reduction(static_cast<Kind>(a.kind))) return a.type == b.type && a.op == b.op && a.count == b.count;
    return true;
}

Step blocked(Exec & e, int peer, bool advanced) {
    e.blocked_on = peer;
    return advanced ? Step::advanced : Step::blocked;
}

Step progress_collective(Exec & e, Failure & failure) {
    CommState & c        = *e.c;
    bool        advanced = false;
    for (;;) {
        uint64_t step = e.base + e.j + 1;
        switch (e.phase) {
            case 0:   // this rank's turn: the previous collective has completed here
                if (c.coll_done.load(std::memory_order_acquire) != e.ticket) return blocked(e, -1, advanced);
                plan_collective(e);
                e.base  = c.next_step;
                e.j     = 0;
                e.phase = 1;
                advanced = true;
                if (e.steps == 0) {
                    c.coll_done.store(e.ticket + 1, std::memory_order_release);
                    return Step::done;
                }
                break;
            case 1:   // write this rank's part once every rank has read the slot's previous step
                if (step > kDepth) {
                    for (int q = 0; q < c.nranks; ++q) {
                        if (c.ranks[q].consumed.load(std::memory_order_acquire) < step - kDepth) {
                            return blocked(e, q, advanced);
                        }
                    }
                }
                write_step(e, c.coll_slot(c.rank, step));
                c.ranks[c.rank].meta[step % kDepth] = meta_of(e);
                c.ranks[c.rank].published.store(step, std::memory_order_release);
                e.phase  = 2;
                advanced = true;
                break;
            case 2: {   // read the step once the ranks read from have published it
                for (int q = 0; q < c.nranks; ++q) {
                    if (coll_reads_from(e, q) && c.ranks[q].published.load(std::memory_order_acquire) < step) {
                        return blocked(e, q, advanced);
                    }
                }
                CollMeta mine = meta_of(e);
                for (int q = 0; q < c.nranks; ++q) {
                    if (!coll_reads_from(e, q)) continue;
                    const CollMeta & theirs = c.ranks[q].meta[step % kDepth];
                    if (!same_collective(mine, theirs)) {
                        failure.code = ncclInvalidUsage;
                        failure.text = describe(e) + " met, as rank " + std::to_string(q) + "'s collective #" +
                                       std::to_string(theirs.ticket) + ", " + describe_meta(theirs) +
                                       ": every rank must issue the same collectives in the same order";
                        return Step::failed;
                    }
                }
                read_step(e, step);
                c.ranks[c.rank].consumed.store(step, std::memory_order_release);
                advanced = true;
                if (++e.j == e.steps) {
                    c.next_step = e.base + e.steps;
                    c.coll_done.store(e.ticket + 1, std::memory_order_release);
                    return Step::done;
                }
                e.phase = 1;
                break;
            }
            default:
                return Step::done;
        }
    }
}

Step progress_send(Exec & e, Failure &) {
    CommState & c        = *e.c;
    const int   peer     = e.d->peer;
    Mailbox &   box      = c.box(c.rank, peer);
    bool        advanced = false;
    for (;;) {
        switch (e.phase) {
            case 0:   // this rank's turn: the previous send to the peer has completed
                if (c.send_done[peer].load(std::memory_order_acquire) != e.ticket) return blocked(e, -1, advanced);
                e.phase  = 1;
                advanced = true;
                break;
            case 1:   // the rendezvous: the peer has posted the matching receive
                if (box.recv_posted.load(std::memory_order_acquire) < e.ticket + 1) return blocked(e, peer, advanced);
                e.per_step = c.p2p_chunk;
                e.steps    = (e.d->count * type_size(e.d->type) + e.per_step - 1) / e.per_step;
                e.base     = box.written.load(std::memory_order_relaxed);
                e.j        = 0;
                e.phase    = 2;
                advanced   = true;
                break;
            case 2: {   // fill the mailbox's free slots
                while (e.j < e.steps) {
                    uint64_t written = box.written.load(std::memory_order_relaxed);
                    if (written - box.read.load(std::memory_order_acquire) >= kDepth) return blocked(e, peer, advanced);
                    size_t bytes = e.d->count * type_size(e.d->type);
                    size_t from  = e.j * e.per_step;
                    size_t n     = std::min(e.per_step, bytes - from);
                    std::memcpy(c.p2p_slot(c.rank, peer, written), e.d->send + from, n);
                    box.meta[written % kDepth] = SlotMeta{e.ticket + 1, bytes};
                    box.written.store(written + 1, std::memory_order_release);
                    ++e.j;
                    advanced = true;
                }
                e.phase = 3;
                break;
            }
            case 3:   // complete once the receiver has taken the last slot
                if (box.read.load(std::memory_order_acquire) < e.base + e.steps) return blocked(e, peer, advanced);
                c.send_done[peer].store(e.ticket + 1, std::memory_order_release);
                return Step::done;
            default:
                return Step::done;
        }
    }
}

Step progress_recv(Exec & e, Failure & failure) {
    CommState & c        = *e.c;
    const int   peer     = e.d->peer;
    Mailbox &   box      = c.box(peer, c.rank);
    bool        advanced = false;
    size_t      bytes    = e.d->count * type_size(e.d->type);
    for (;;) {
        switch (e.phase) {
            case 0:   // this rank's turn: the previous receive from the peer has completed
                if (c.recv_done[peer].load(std::memory_order_acquire) != e.ticket) return blocked(e, -1, advanced);
                e.per_step = c.p2p_chunk;
                e.steps    = (bytes + e.per_step - 1) / e.per_step;
                e.base     = box.read.load(std::memory_order_relaxed);
                e.j        = 0;
                box.recv_posted.store(e.ticket + 1, std::memory_order_release);
                e.phase  = 1;
                advanced = true;
                break;
            case 1:
                while (e.j < e.steps) {
                    uint64_t read = box.read.load(std::memory_order_relaxed);
                    if (box.written.load(std::memory_order_acquire) <= read) return blocked(e, peer, advanced);
                    const SlotMeta & meta = box.meta[read % kDepth];
                    if (meta.ticket != e.ticket + 1 || meta.bytes != bytes) {
                        failure.code = ncclInvalidUsage;
                        failure.text = describe(e) + " (" + std::to_string(bytes) + " bytes) met a send of " +
                                       std::to_string(meta.bytes) + " bytes (its send #" +
                                       std::to_string(meta.ticket - 1) + " to this rank): a send and its " +
                                       "receive must have the same size";
                        return Step::failed;
                    }
                    size_t from = e.j * e.per_step;
                    size_t n    = std::min(e.per_step, bytes - from);
                    std::memcpy(e.d->recv + from, c.p2p_slot(peer, c.rank, read), n);
                    box.read.store(read + 1, std::memory_order_release);
                    ++e.j;
                    advanced = true;
                }
                c.recv_done[peer].store(e.ticket + 1, std::memory_order_release);
                return Step::done;
            default:
                return Step::done;
        }
    }
}

Step progress(Exec & e, Failure & failure) {
    switch (e.d->kind) {
        case Kind::send: return progress_send(e, failure);
        case Kind::recv: return progress_recv(e, failure);
        default:         return progress_collective(e, failure);
    }
}

// Waiting without starving the other processes of a small machine: spin briefly, then yield, then sleep.
class Backoff {
public:
    void reset() { rounds_ = 0; }
    void pause() {
        if (rounds_ < 64) {
#if defined(__x86_64__) || defined(__i386__)
            __builtin_ia32_pause();
#endif
        } else if (rounds_ < 128) {
            sched_yield();
        } else {
            int doublings = std::min(rounds_ - 128, 6);
            std::this_thread::sleep_for(std::chrono::microseconds(16 << doublings));   // up to ~1 ms
        }
        ++rounds_;
    }

private:
    int rounds_ = 0;
};

// Why the peer can no longer take part ("" while it can): it destroyed the communicator, or its process is gone.
std::string peer_gone(CommState & c, int q) {
    SharedRank & peer = c.ranks[q];
    if (peer.state.load(std::memory_order_acquire) == kDeparted) {
        return "rank " + std::to_string(q) + " destroyed the communicator (ncclCommDestroy) while this rank " +
               "waits for it: the ranks issued different operations";
    }
    int pid = peer.pid.load(std::memory_order_acquire);
    if (!process_alive(pid, peer.start_time)) {
        return "rank " + std::to_string(q) + " (pid " + std::to_string(pid) + ") exited while this rank waits for it";
    }
    return "";
}

class UnitRun {
public:
    explicit UnitRun(const Unit & unit) {
        for (const OpDesc & d : unit.ops) {
            CommState * c = d.comm.get();
            if (std::find(comms_.begin(), comms_.end(), c) == comms_.end()) comms_.push_back(c);
        }
        for (CommState * c : comms_) c->active.fetch_add(1, std::memory_order_acq_rel);
        execs_.resize(unit.ops.size());
        for (size_t i = 0; i < unit.ops.size(); ++i) {
            execs_[i].d = &unit.ops[i];
            execs_[i].c = unit.ops[i].comm.get();
            execs_[i].inputs.resize(static_cast<size_t>(execs_[i].c->nranks));
        }
    }

    ~UnitRun() {
        for (CommState * c : comms_) c->active.fetch_sub(1, std::memory_order_acq_rel);
    }

    void run() {
        if (!usable(true)) return;
        take_tickets();
        Backoff     backoff;
        Clock::time_point last_progress = Clock::now();
        Clock::time_point next_check    = last_progress + std::chrono::milliseconds(100);
        size_t            left          = execs_.size();
        while (left > 0) {
            bool advanced = false;
            for (Exec & e : execs_) {
                if (e.finished) continue;
                if (!step(e, advanced, left)) return;
            }
            if (advanced) {
                backoff.reset();
                last_progress = Clock::now();
                continue;
            }
            if (!usable(false)) return;
            backoff.pause();
            Clock::time_point now = Clock::now();
            if (now < next_check) continue;
            next_check = now + std::chrono::milliseconds(100);
            if (!check_peers(left)) return;
            double timeout = op_timeout_s();
            if (timeout > 0 && now - last_progress > std::chrono::duration<double>(timeout)) {
                const Exec & e = first_waiting();
                fail(ncclSystemError,
                     describe(e) + " made no progress for " + std::to_string(timeout) +
                         " s (LOOM_EMU_NCCL_TIMEOUT_S)" + waiting_for(e),
                     true);
                return;
            }
        }
    }

private:
    // Steps one operation; false once the unit failed.
    bool step(Exec & e, bool & advanced, size_t & left) {
        Failure failure;
        Step    result = progress(e, failure);
        if (result == Step::failed) {
            fail(failure.code, failure.text, failure.tell_peers);
            return false;
        }
        if (result == Step::done) {
            e.finished = true;
            --left;
        }
        if (result != Step::blocked) advanced = true;
        return true;
    }

    static std::string waiting_for(const Exec & e) {
        return e.blocked_on >= 0 ? ", waiting for rank " + std::to_string(e.blocked_on) : "";
    }

    const Exec & first_waiting() const {
        for (const Exec & e : execs_) {
            if (!e.finished && e.blocked_on >= 0) return e;
        }
        for (const Exec & e : execs_) {
            if (!e.finished) return e;
        }
        return execs_.front();
    }

    void take_tickets() {
        for (Exec & e : execs_) {
            CommState &                 c = *e.c;
            std::lock_guard<std::mutex> lock(c.ticket_mutex);
            switch (e.d->kind) {
                case Kind::send: e.ticket = c.send_issued[e.d->peer]++; break;
                case Kind::recv: e.ticket = c.recv_issued[e.d->peer]++; break;
                default:         e.ticket = c.coll_issued++; break;
            }
        }
    }

    // A failure of one operation stops the unit and fails every communicator in it (a group is one launch).
    void fail(ncclResult_t code, const std::string & text, bool tell_peers) {
        for (CommState * c : comms_) c->fail(code, text, tell_peers);
    }

    // False (the unit stops) once a communicator of the unit has failed, was aborted (or, for a unit that is
    // starting, destroyed) here, or a peer reported a failure.
    bool usable(bool at_start) {
        for (CommState * c : comms_) {
            ncclResult_t recorded = c->error.load(std::memory_order_acquire);
            if (recorded != ncclSuccess) {
                // Already recorded (by another unit, or an abort): the other communicators of the unit fail alike.
                // The text is immutable once the error is set.
                fail(recorded, c->error_text, false);
                return false;
            }
            // A running unit is waited for by ncclCommDestroy; only one that starts after it is refused.
            if (at_start && c->destroyed.load(std::memory_order_acquire)) {
                fail(ncclInvalidUsage, "an operation of " + c->where() + " ran after ncclCommDestroy", false);
                return false;
            }
            if (c->aborted.load(std::memory_order_acquire)) {
                const Exec * e = waiting_on(c);
                fail(ncclSystemError,
                     (e != nullptr ? describe(*e) : "an operation on " + c->where()) +
                         " was stopped by ncclCommAbort on this rank" + (e != nullptr ? waiting_for(*e) : ""),
                     false);
                return false;
            }
            uint32_t poison = c->header->poison.load(std::memory_order_acquire);
            if (poison >= 2 && static_cast<int>(poison - 2) != c->rank) {
                std::string  why(c->header->poison_text, strnlen(c->header->poison_text, kPoisonText));
                const Exec * e = waiting_on(c);
                fail(ncclRemoteError,
                     (e != nullptr ? describe(*e) : "an operation on " + c->where()) + " stopped: rank " +
                         std::to_string(poison - 2) + " failed: " + why,
                     false);
                return false;
            }
        }
        return true;
    }

    const Exec * waiting_on(CommState * c) const {
        const Exec * found = nullptr;
        for (const Exec & e : execs_) {
            if (e.finished || e.c != c) continue;
            if (e.blocked_on >= 0) return &e;
            if (found == nullptr) found = &e;
        }
        return found;
    }

    // Fails the unit if an operation waits for a peer that is gone. The peer may have done its part just before it
    // left, so each suspect operation is stepped once more before it is failed.
    bool check_peers(size_t & left) {
        for (Exec & e : execs_) {
            if (e.finished || e.blocked_on < 0 || e.blocked_on == e.c->rank) continue;
            int         peer = e.blocked_on;
            std::string why  = peer_gone(*e.c, peer);
            if (why.empty()) continue;
            bool advanced = false;
            if (!step(e, advanced, left)) return false;
            if (e.finished || advanced) continue;
            fail(ncclRemoteError, describe(e) + ": " + why, true);
            return false;
        }
        return true;
    }

    std::vector<CommState *> comms_;
    std::vector<Exec>        execs_;
};

void run_unit(const Unit & unit) {
    try {
        UnitRun run(unit);
        run.run();
    } catch (const std::exception & error) {
        for (const OpDesc & d : unit.ops) {
            d.comm->fail(ncclInternalError, std::string("an NCCL operation failed on the emulator: ") + error.what(),
                         true);
        }
    }
}

// ---------------------------------------------------------------------------------------------------------------
// Issuing.

struct GroupState {
    int                 depth = 0;
    std::vector<OpDesc> ops;
    ncclResult_t        error = ncclSuccess;
    std::string         error_text;
};

thread_local GroupState t_group;

ncclResult_t launch(cudaStream_t stream, std::vector<OpDesc> ops, const char * name) {
    auto        unit   = std::make_shared<Unit>();
    unit->ops          = std::move(ops);
    cudaError_t status = enqueue(stream, [unit] { run_unit(*unit); }, name);
    if (status != cudaSuccess) {
        return call_error(ncclUnhandledCudaError, std::string(name) + ": enqueueing on the stream failed with CUDA " +
                                                      "error " + std::to_string(static_cast<int>(status)));
    }
    return ncclSuccess;
}

ncclResult_t group_error(ncclResult_t code, std::string text) {
    if (t_group.depth > 0 && t_group.error == ncclSuccess) {
        t_group.error      = code;
        t_group.error_text = text;
    }
    return call_error(code, std::move(text));
}

// Checks a call's arguments, then enqueues it (or adds it to this thread's group).
ncclResult_t issue(OpDesc d, ncclComm_t comm, const char * name) {
    const std::string fn = kind_name(d.kind);
    if (comm == nullptr || !comm->state) return group_error(ncclInvalidArgument, fn + ": the communicator is null");
    CommState & c = *comm->state;
    if (d.type < 0 || d.type >= ncclNumTypes) {
        return group_error(ncclInvalidArgument, fn + ": invalid data type " + std::to_string(static_cast<int>(d.type)));
    }
    if (is_reduction(d.kind)) {
        if (d.op < 0 || d.op >= ncclNumOps) {
            return group_error(ncclInvalidArgument,
                               fn + ": invalid reduction " + std::to_string(static_cast<int>(d.op)));
        }
        if (d.op == ncclAvg && !is_floating(d.type)) {
            return group_error(ncclInvalidArgument,
                               fn + ": ncclAvg is for floating-point types, not " + type_name(d.type));
        }
    }
    bool uses_peer = has_root(d.kind) || d.kind == Kind::send || d.kind == Kind::recv;
    if (uses_peer && (d.peer < 0 || d.peer >= c.nranks)) {
        return group_error(ncclInvalidArgument, fn + ": " + (has_root(d.kind) ? "root " : "peer ") +
                                                    std::to_string(d.peer) + " is not a rank of " + c.where());
    }
    if (d.count > 0) {
        bool needs_send = d.kind != Kind::recv && (d.kind != Kind::broadcast || c.rank == d.peer);
        bool needs_recv = d.kind != Kind::send && (d.kind != Kind::reduce || c.rank == d.peer);
        if ((needs_send && d.send == nullptr) || (needs_recv && d.recv == nullptr)) {
            return group_error(ncclInvalidArgument,
                               fn + ": a null buffer for " + std::to_string(d.count) + " elements");
        }
    }
    if (c.destroyed.load()) return group_error(ncclInvalidUsage, fn + ": " + c.where() + " was destroyed");
    ncclResult_t failed = c.error.load(std::memory_order_acquire);
    if (failed != ncclSuccess) {
        std::string text;
        {
            std::lock_guard<std::mutex> lock(c.error_mutex);
            text = c.error_text;
        }
        return group_error(failed, fn + " on a communicator that has failed: " + text);
    }
    if (c.aborted.load()) return group_error(ncclInvalidUsage, fn + ": " + c.where() + " was aborted");
    // Nothing to move: NCCL launches nothing either, on every rank alike.
    if (d.count == 0) return ncclSuccess;
    d.comm = comm->state;
    if (t_group.depth > 0) {
        t_group.ops.push_back(std::move(d));
        return ncclSuccess;
    }
    cudaStream_t stream = d.stream;
    std::vector<OpDesc> ops;
    ops.push_back(std::move(d));
    return launch(stream, std::move(ops), name);
}

// ---------------------------------------------------------------------------------------------------------------
// Creating the segment.

std::atomic<uint64_t> g_id_counter{0};

ncclResult_t init_error(ncclResult_t code, const std::string & text) {
    return call_error(code, "ncclCommInitRank: " + text);
}

}  // namespace

// ---------------------------------------------------------------------------------------------------------------
// The API.

ncclResult_t ncclGetVersion(int * version) {
    if (version == nullptr) return call_error(ncclInvalidArgument, "ncclGetVersion: version is null");
    *version = NCCL_VERSION_CODE;
    return ncclSuccess;
}

ncclResult_t ncclGetUniqueId(ncclUniqueId * unique_id) {
    if (unique_id == nullptr) return call_error(ncclInvalidArgument, "ncclGetUniqueId: the id pointer is null");
    std::random_device random;
    uint64_t           nonce = (static_cast<uint64_t>(random()) << 32) ^ random();
    char               name[NCCL_UNIQUE_ID_BYTES];
    std::snprintf(name, sizeof(name), "%s%d-%llu-%016llx", kIdPrefix, static_cast<int>(getpid()),
                  static_cast<unsigned long long>(g_id_counter.fetch_add(1)), static_cast<unsigned long long>(nonce));
    std::memset(unique_id->internal, 0, sizeof(unique_id->internal));
    std::memcpy(unique_id->internal, name, std::strlen(name));
    return ncclSuccess;
}

ncclResult_t ncclCommInitRank(ncclComm_t * comm, int nranks, ncclUniqueId comm_id, int rank) {
    if (comm == nullptr) return init_error(ncclInvalidArgument, "the communicator pointer is null");
    *comm = nullptr;
    if (nranks < 1) return init_error(ncclInvalidArgument, "nranks is " + std::to_string(nranks) + ", not at least 1");
    if (rank < 0 || rank >= nranks) {
        return init_error(ncclInvalidArgument, "rank " + std::to_string(rank) + " is not in [0, " +
                                                   std::to_string(nranks) + ")");
    }
    size_t length = strnlen(comm_id.internal, NCCL_UNIQUE_ID_BYTES);
    std::string name(comm_id.internal, length);
    if (length == NCCL_UNIQUE_ID_BYTES || name.rfind(kIdPrefix, 0) != 0) {
        return init_error(ncclInvalidArgument, "the id was not made by ncclGetUniqueId (of the cuda-emu NCCL)");
    }
    const double      timeout  = env_seconds("LOOM_EMU_NCCL_INIT_TIMEOUT_S", 60);
    Clock::time_point deadline = Clock::now() + std::chrono::duration_cast<Clock::duration>(
                                                    std::chrono::duration<double>(timeout));
    const std::string who =
        "rank " + std::to_string(rank) + " of " + std::to_string(nranks) + " of communicator " + name;

    auto state    = std::make_shared<CommState>();
    state->name   = name;
    state->rank   = rank;
    state->nranks = nranks;

    if (rank == 0) {
        size_t coll_chunk = std::max<size_t>(round_up(env_bytes("LOOM_EMU_NCCL_CHUNK_BYTES", size_t{1} << 20), 64),
                                             static_cast<size_t>(nranks) * 64);
        size_t p2p_chunk =
            std::max<size_t>(round_up(env_bytes("LOOM_EMU_NCCL_P2P_CHUNK_BYTES", size_t{128} << 10), 64), 64);
        Layout l          = layout(nranks, coll_chunk, p2p_chunk);
        int    fd         = shm_open(name.c_str(), O_RDWR | O_CREAT | O_EXCL, 0600);
        if (fd < 0) {
            return init_error(ncclSystemError, who + ": creating the shared memory failed: " + std::strerror(errno));
        }
        if (ftruncate(fd, static_cast<off_t>(l.total)) != 0) {
            int error = errno;
            close(fd);
            shm_unlink(name.c_str());
            return init_error(ncclSystemError, who + ": sizing the shared memory to " + std::to_string(l.total) +
                                                   " bytes failed: " + std::strerror(error));
        }
        void * base = mmap(nullptr, l.total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int    error = errno;
        close(fd);
        if (base == MAP_FAILED) {
            shm_unlink(name.c_str());
            return init_error(ncclSystemError, who + ": mapping the shared memory failed: " + std::strerror(error));
        }
        state->base  = base;
        state->bytes = l.total;
        auto * bytes = static_cast<char *>(base);
        auto * header        = new (bytes) Header;
        header->nranks       = nranks;
        header->total_bytes  = l.total;
        header->coll_chunk   = coll_chunk;
        header->p2p_chunk    = p2p_chunk;
        for (int q = 0; q < nranks; ++q) new (bytes + l.ranks + q * sizeof(SharedRank)) SharedRank;
        for (size_t b = 0; b < static_cast<size_t>(nranks) * nranks; ++b) {
            new (bytes + l.boxes + b * sizeof(Mailbox)) Mailbox;
        }
        header->magic.store(kMagic, std::memory_order_release);
    } else {
        // Rank 0 may not have created the segment yet: retry until it has, and has set the magic.
        int fd = -1;
        for (;;) {
            fd = shm_open(name.c_str(), O_RDWR, 0600);
            if (fd >= 0) break;
            if (errno != ENOENT) {
                return init_error(ncclSystemError, who + ": opening the shared memory failed: " + std::strerror(errno));
            }
            if (Clock::now() > deadline) {
                return init_error(ncclSystemError, who + ": rank 0 did not create the communicator within " +
                                                       std::to_string(timeout) + " s (LOOM_EMU_NCCL_INIT_TIMEOUT_S)");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        Header * header = nullptr;
        void *   first  = MAP_FAILED;
        for (;;) {
            struct stat info;
            if (first == MAP_FAILED && fstat(fd, &info) == 0 && static_cast<size_t>(info.st_size) >= sizeof(Header)) {
                first = mmap(nullptr, sizeof(Header), PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
                if (first != MAP_FAILED) header = static_cast<Header *>(first);
            }
            if (header != nullptr && header->magic.load(std::memory_order_acquire) == kMagic) break;
            if (Clock::now() > deadline) {
                if (first != MAP_FAILED) munmap(first, sizeof(Header));
                close(fd);
                return init_error(ncclSystemError, who + ": rank 0 did not finish creating the communicator within " +
                                                       std::to_string(timeout) + " s");
            }
            std::this_thread::sleep_for(std::chrono::milliseconds(1));
        }
        size_t total = header->total_bytes;
        int    made  = header->nranks;
        munmap(first, sizeof(Header));
        if (made != nranks) {
            close(fd);
            return init_error(ncclInvalidArgument, who + ": rank 0 made the communicator for " + std::to_string(made) +
                                                       " ranks");
        }
        void * base  = mmap(nullptr, total, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
        int    error = errno;
        close(fd);
        if (base == MAP_FAILED) {
            return init_error(ncclSystemError, who + ": mapping the shared memory failed: " + std::strerror(error));
        }
        state->base  = base;
        state->bytes = total;
    }

    auto * bytes      = static_cast<char *>(state->base);
    state->header     = reinterpret_cast<Header *>(bytes);
    state->coll_chunk = state->header->coll_chunk;
    state->p2p_chunk  = state->header->p2p_chunk;
    Layout l          = layout(nranks, state->coll_chunk, state->p2p_chunk);
    state->ranks      = reinterpret_cast<SharedRank *>(bytes + l.ranks);
    state->boxes      = reinterpret_cast<Mailbox *>(bytes + l.boxes);
    state->coll       = bytes + l.coll;
    state->p2p        = bytes + l.p2p;
    state->send_issued.assign(static_cast<size_t>(nranks), 0);
    state->recv_issued.assign(static_cast<size_t>(nranks), 0);
    state->send_done = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(nranks));
    state->recv_done = std::make_unique<std::atomic<uint64_t>[]>(static_cast<size_t>(nranks));
    for (int q = 0; q < nranks; ++q) {
        state->send_done[q].store(0);
        state->recv_done[q].store(0);
    }

    // Join: claim the rank, then wait for the others. The last to arrive removes the name.
    SharedRank & me       = state->ranks[rank];
    int32_t      expected = 0;
    if (!me.pid.compare_exchange_strong(expected, static_cast<int32_t>(getpid()))) {
        return init_error(ncclInvalidArgument,
                          who + ": the rank has already joined (pid " + std::to_string(expected) + ")");
    }
    me.start_time = process_start_time(getpid());
    me.state.store(kJoined, std::memory_order_release);
    if (state->header->arrived.fetch_add(1, std::memory_order_acq_rel) + 1 == static_cast<uint32_t>(nranks)) {
        shm_unlink(name.c_str());
    }
    Backoff backoff;
    while (state->header->arrived.load(std::memory_order_acquire) < static_cast<uint32_t>(nranks)) {
        if (Clock::now() > deadline) {
            uint32_t arrived = state->header->arrived.load();
            shm_unlink(name.c_str());   // nobody else will: do not leave the name behind
            std::string text = who + ": only " + std::to_string(arrived) + " of " + std::to_string(nranks) +
                               " ranks joined within " + std::to_string(timeout) + " s (LOOM_EMU_NCCL_INIT_TIMEOUT_S)";
            state->poison(text);
            return init_error(ncclSystemError, text);
        }
        backoff.pause();
    }
    *comm = new ncclComm{std::move(state)};
    return ncclSuccess;
}

ncclResult_t ncclCommDestroy(ncclComm_t comm) {
    if (comm == nullptr) return call_error(ncclInvalidArgument, "ncclCommDestroy: the communicator is null");
    CommState & c = *comm->state;
    c.destroyed.store(true, std::memory_order_release);
    while (c.active.load(std::memory_order_acquire) > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    c.ranks[c.rank].state.store(kDeparted, std::memory_order_release);
    delete comm;
    return ncclSuccess;
}

ncclResult_t ncclCommAbort(ncclComm_t comm) {
    if (comm == nullptr) return call_error(ncclInvalidArgument, "ncclCommAbort: the communicator is null");
    CommState & c = *comm->state;
    if (!c.aborted.exchange(true, std::memory_order_acq_rel)) {
        c.poison("rank " + std::to_string(c.rank) + " aborted the communicator (ncclCommAbort)");
    }
    while (c.active.load(std::memory_order_acquire) > 0) std::this_thread::sleep_for(std::chrono::microseconds(200));
    c.fail(ncclSystemError, c.where() + " was aborted (ncclCommAbort)", false);
    return ncclSuccess;
}

ncclResult_t ncclCommGetAsyncError(ncclComm_t comm, ncclResult_t * async_error) {
    if (comm == nullptr || async_error == nullptr) {
        return call_error(ncclInvalidArgument, "ncclCommGetAsyncError: a null argument");
    }
    *async_error = comm->state->error.load(std::memory_order_acquire);
    return ncclSuccess;
}

ncclResult_t ncclCommCount(const ncclComm_t comm, int * count) {
    if (comm == nullptr || count == nullptr) return call_error(ncclInvalidArgument, "ncclCommCount: a null argument");
    *count = comm->state->nranks;
    return ncclSuccess;
}

ncclResult_t ncclCommUserRank(const ncclComm_t comm, int * rank) {
    if (comm == nullptr || rank == nullptr) return call_error(ncclInvalidArgument, "ncclCommUserRank: a null argument");
    *rank = comm->state->rank;
    return ncclSuccess;
}

const char * ncclGetErrorString(ncclResult_t result) {
    switch (result) {
        case ncclSuccess:            return "no error";
        case ncclUnhandledCudaError: return "unhandled CUDA error (see ncclGetLastError)";
        case ncclSystemError:        return "system error (see ncclGetLastError)";
        case ncclInternalError:      return "internal error of the NCCL emulator";
        case ncclInvalidArgument:    return "invalid argument (see ncclGetLastError)";
        case ncclInvalidUsage:       return "invalid usage (see ncclGetLastError)";
        case ncclRemoteError:        return "a remote rank failed or exited (see ncclGetLastError)";
        case ncclInProgress:         return "operation in progress";
        default:                     return "unknown NCCL result code";
    }
}

const char * ncclGetLastError(ncclComm_t comm) {
    if (comm != nullptr && comm->state && comm->state->error.load(std::memory_order_acquire) != ncclSuccess) {
        return comm->state->error_text.c_str();
    }
    return t_last_nccl_error.c_str();
}

namespace {

// The byte views of the buffers an OpDesc holds.
const char * in(const void * buffer) { return static_cast<const char *>(buffer); }
char *       out(void * buffer) { return static_cast<char *>(buffer); }

}  // namespace

ncclResult_t ncclAllReduce(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype,
                           ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::all_reduce, .comm = nullptr, .send = in(sendbuff), .recv = out(recvbuff),
                        .count = count, .type = datatype, .op = op, .stream = stream},
                 comm, "ncclAllReduce");
}

ncclResult_t ncclReduceScatter(const void * sendbuff, void * recvbuff, size_t recvcount, ncclDataType_t datatype,
                               ncclRedOp_t op, ncclComm_t comm, cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::reduce_scatter, .comm = nullptr, .send = in(sendbuff), .recv = out(recvbuff),
                        .count = recvcount, .type = datatype, .op = op, .stream = stream},
                 comm, "ncclReduceScatter");
}

ncclResult_t ncclAllGather(const void * sendbuff, void * recvbuff, size_t sendcount, ncclDataType_t datatype,
                           ncclComm_t comm, cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::all_gather, .comm = nullptr, .send = in(sendbuff), .recv = out(recvbuff),
                        .count = sendcount, .type = datatype, .stream = stream},
                 comm, "ncclAllGather");
}

ncclResult_t ncclBroadcast(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype, int root,
                           ncclComm_t comm, cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::broadcast, .comm = nullptr, .send = in(sendbuff), .recv = out(recvbuff),
                        .count = count, .type = datatype, .peer = root, .stream = stream},
                 comm, "ncclBroadcast");
}

ncclResult_t ncclReduce(const void * sendbuff, void * recvbuff, size_t count, ncclDataType_t datatype,
                        ncclRedOp_t op, int root, ncclComm_t comm, cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::reduce, .comm = nullptr, .send = in(sendbuff), .recv = out(recvbuff),
                        .count = count, .type = datatype, .op = op, .peer = root, .stream = stream},
                 comm, "ncclReduce");
}

ncclResult_t ncclSend(const void * sendbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::send, .comm = nullptr, .send = in(sendbuff), .count = count, .type = datatype,
                        .peer = peer, .stream = stream},
                 comm, "ncclSend");
}

ncclResult_t ncclRecv(void * recvbuff, size_t count, ncclDataType_t datatype, int peer, ncclComm_t comm,
                      cudaStream_t stream) {
    return issue(OpDesc{.kind = Kind::recv, .comm = nullptr, .recv = out(recvbuff), .count = count, .type = datatype,
                        .peer = peer, .stream = stream},
                 comm, "ncclRecv");
}

ncclResult_t ncclGroupStart() {
    if (t_group.depth++ == 0) {
        t_group.ops.clear();
        t_group.error = ncclSuccess;
        t_group.error_text.clear();
    }
    return ncclSuccess;
}

ncclResult_t ncclGroupEnd() {
    if (t_group.depth == 0) return call_error(ncclInvalidUsage, "ncclGroupEnd without ncclGroupStart");
    if (--t_group.depth > 0) return ncclSuccess;
    std::vector<OpDesc> ops = std::move(t_group.ops);
    t_group.ops.clear();
    if (t_group.error != ncclSuccess) {
        // A call of the group failed: the group launches nothing, and its end reports that call's error.
        t_last_nccl_error = t_group.error_text;
        return t_group.error;
    }
    // One unit per stream, in the order the streams first appear; each keeps its operations' issue order.
    std::vector<cudaStream_t> streams;
    for (const OpDesc & d : ops) {
        if (std::find(streams.begin(), streams.end(), d.stream) == streams.end()) streams.push_back(d.stream);
    }
    ncclResult_t result = ncclSuccess;
    for (cudaStream_t stream : streams) {
        std::vector<OpDesc> mine;
        for (const OpDesc & d : ops) {
            if (d.stream == stream) mine.push_back(d);
        }
        ncclResult_t status = launch(stream, std::move(mine), "ncclGroup");
        if (result == ncclSuccess) result = status;
    }
    return result;
}

}  // namespace loom_emu
