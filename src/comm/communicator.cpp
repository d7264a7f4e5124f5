#include "comm/communicator.h"

#include "core/error.h"
#include "core/graph.h"

#include <cstring>
#include <numeric>

namespace loom::comm {

const char * reduce_op_name(ReduceOp op) {
    switch (op) {
        case ReduceOp::sum: return "sum";
        case ReduceOp::avg: return "avg";
        case ReduceOp::max: return "max";
        case ReduceOp::min: return "min";
    }
    return "unknown";
}

const char * op_kind_name(OpKind kind) {
    switch (kind) {
        case OpKind::all_reduce:     return "all_reduce";
        case OpKind::reduce_scatter: return "reduce_scatter";
        case OpKind::all_gather:     return "all_gather";
        case OpKind::broadcast:      return "broadcast";
        case OpKind::all_to_all:     return "all_to_all";
        case OpKind::send:           return "send";
        case OpKind::recv:           return "recv";
        case OpKind::barrier:        return "barrier";
    }
    return "unknown";
}

namespace {

void check_defined(const Tensor & t, const Communicator & c, const char * op, const char * what) {
    LOOM_CHECK(t.defined(), c.name() << "." << op << ": the " << what << " tensor is undefined", "");
}

void check_reducible(const Tensor & t, ReduceOp op, const Communicator & c, const char * kind) {
    DType d = t.dtype();
    LOOM_CHECK(d == DType::f32 || d == DType::bf16 || d == DType::f16 || d == DType::i32 || d == DType::i64 ||
                   d == DType::f64,
               c.name() << "." << kind << " of a " << dtype_name(d) << " tensor",
               "reductions support float32, bfloat16, float16, float64, int32 and int64");
    LOOM_CHECK(op != ReduceOp::avg || dtype_is_floating(d),
               c.name() << "." << kind << " with op avg on a " << dtype_name(d) << " tensor",
               "average floating tensors only; reduce integers with sum and divide where needed");
}

void check_peer(int peer, const Communicator & c, const char * op) {
    LOOM_CHECK(peer >= 0 && peer < c.size(),
               c.name() << "." << op << ": peer " << peer << " is not a rank of a group of " << c.size(), "");
}

}  // namespace

namespace {
std::atomic<bool> g_flip_next_reduction{false};
}  // namespace

void flip_next_reduction() { g_flip_next_reduction.store(true); }

std::string describe(const IssuedOp & op) {
    if (op.kind == OpKind::send || op.kind == OpKind::recv) {
        return "transfer of " + std::to_string(op.numel) + " " + dtype_name(op.dtype) + " (tag " + std::to_string(op.tag) + ")";
    }
    std::string text = std::string(op_kind_name(op.kind));
    if (op.kind == OpKind::barrier) return text;
    text += op.kind == OpKind::all_to_all ? std::string(" of ") + dtype_name(op.dtype)
                                          : " of " + std::to_string(op.numel) + " " + dtype_name(op.dtype);
    if (op.reduce >= 0) text += std::string(" (") + reduce_op_name(static_cast<ReduceOp>(op.reduce)) + ")";
    if (op.root >= 0) text += " from rank " + std::to_string(op.root);
    return text;
}

namespace {

// Appends `op` to `ops`: the running digest (FNV-1a over each of `fields`' 8 bytes) and the kept last ones.
void append(IssuedOps & ops, IssuedOp op, std::initializer_list<uint64_t> fields) {
    op.digest_before = ops.digest;
    for (const uint64_t v : fields) {
        for (int b = 0; b < 8; ++b) ops.digest = (ops.digest ^ ((v >> (8 * b)) & 0xff)) * 0x100000001b3ull;
    }
    ops.last[ops.count % ops.last.size()] = op;
    ++ops.count;
}

}  // namespace

void Communicator::note(OpKind kind, DType dtype, int64_t numel, int reduce, int root) {
    std::lock_guard<std::mutex> lock(issued_mutex_);
    append(issued_, IssuedOp{kind, dtype, reduce, root, numel},
           {static_cast<uint64_t>(kind), static_cast<uint64_t>(dtype), static_cast<uint64_t>(reduce + 1),
            static_cast<uint64_t>(root + 1), static_cast<uint64_t>(numel)});
}

// The digest leaves the direction out: a send and the receive that matches it add the same fields.
void Communicator::note_transfer(int peer, bool sent, const Tensor & t, int tag) {
    std::lock_guard<std::mutex> lock(issued_mutex_);
    IssuedOp                    op{sent ? OpKind::send : OpKind::recv, t.dtype(), -1, -1, t.numel()};
    op.tag = tag;
    append(transfers_[{peer, sent}], op,
           {static_cast<uint64_t>(t.dtype()), static_cast<uint64_t>(t.numel()), static_cast<uint64_t>(tag)});
}

std::vector<Transfers> Communicator::transfers() const {
    std::lock_guard<std::mutex> lock(issued_mutex_);
    std::vector<Transfers>      out;
    for (int peer = 0; peer < size(); ++peer) {
        if (peer == rank()) continue;
        for (const bool sent : {true, false}) {
            const auto it = transfers_.find({peer, sent});
            out.push_back({peer, sent, it != transfers_.end() ? it->second : IssuedOps{}});
        }
    }
    return out;
}

WorkPtr Communicator::all_reduce(const Tensor & t, ReduceOp op, Stream * stream) {
    check_defined(t, *this, "all_reduce", "input/output");
    check_reducible(t, op, *this, "all_reduce");
    if (g_flip_next_reduction.exchange(false)) op = op == ReduceOp::max ? ReduceOp::sum : ReduceOp::max;
    note(OpKind::all_reduce, t.dtype(), t.numel(), static_cast<int>(op), -1);
    return do_all_reduce(t, op, stream);
}

WorkPtr Communicator::reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream) {
    check_defined(in, *this, "reduce_scatter", "input");
    check_defined(out, *this, "reduce_scatter", "output");
    check_reducible(in, op, *this, "reduce_scatter");
    LOOM_CHECK(in.dtype() == out.dtype(),
               name() << ".reduce_scatter: input is " << dtype_name(in.dtype()) << ", output "
                      << dtype_name(out.dtype()),
               "input and output must have the same dtype");
    LOOM_CHECK(in.numel() == out.numel() * size(),
               name() << ".reduce_scatter: input has " << in.numel() << " elements, output " << out.numel()
                      << ", group size " << size(),
               "the input must hold exactly group size x output elements (equal blocks)");
    note(OpKind::reduce_scatter, in.dtype(), in.numel(), static_cast<int>(op), -1);
    return do_reduce_scatter(in, out, op, stream);
}

WorkPtr Communicator::all_gather(const Tensor & in, const Tensor & out, Stream * stream) {
    check_defined(in, *this, "all_gather", "input");
    check_defined(out, *this, "all_gather", "output");
    LOOM_CHECK(in.dtype() == out.dtype(),
               name() << ".all_gather: input is " << dtype_name(in.dtype()) << ", output "
                      << dtype_name(out.dtype()),
               "input and output must have the same dtype");
    LOOM_CHECK(out.numel() == in.numel() * size(),
               name() << ".all_gather: input has " << in.numel() << " elements, output " << out.numel()
                      << ", group size " << size(),
               "the output must hold exactly group size x input elements");
    note(OpKind::all_gather, in.dtype(), in.numel(), -1, -1);
    return do_all_gather(in, out, stream);
}

WorkPtr Communicator::broadcast(const Tensor & t, int root, Stream * stream) {
    check_defined(t, *this, "broadcast", "input/output");
    check_peer(root, *this, "broadcast");
    note(OpKind::broadcast, t.dtype(), t.numel(), -1, root);
    return do_broadcast(t, root, stream);
}

WorkPtr Communicator::all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                                 std::span<const int64_t> recv_counts, Stream * stream) {
    check_defined(in, *this, "all_to_all", "input");
    check_defined(out, *this, "all_to_all", "output");
    LOOM_CHECK(in.dtype() == out.dtype(), name() << ".all_to_all: input and output dtypes differ", "");
    LOOM_CHECK(static_cast<int>(send_counts.size()) == size() && static_cast<int>(recv_counts.size()) == size(),
               name() << ".all_to_all: " << send_counts.size() << " send counts and " << recv_counts.size()
                      << " receive counts for a group of " << size(),
               "give one count per rank of the group");
    int64_t sent     = std::accumulate(send_counts.begin(), send_counts.end(), int64_t{0});
    int64_t received = std::accumulate(recv_counts.begin(), recv_counts.end(), int64_t{0});
    for (int p = 0; p < size(); ++p) {
        LOOM_CHECK(send_counts[p] >= 0 && recv_counts[p] >= 0,
                   name() << ".all_to_all: negative count for peer " << p, "");
    }
    LOOM_CHECK(sent <= in.numel() && received <= out.numel(),
               name() << ".all_to_all: counts sum to " << sent << " sent / " << received
                      << " received, tensors hold " << in.numel() << " / " << out.numel(),
               "the input must hold every block sent and the output every block received");
    note(OpKind::all_to_all, in.dtype(), 0, -1, -1);
    return do_all_to_all(in, send_counts, out, recv_counts, stream);
}

WorkPtr Communicator::send(const Tensor & t, int peer, int tag, Stream * stream) {
    check_defined(t, *this, "send", "input");
    check_peer(peer, *this, "send");
    LOOM_CHECK(tag >= 0, name() << ".send: negative tag " << tag, "");
    note_transfer(peer, true, t, tag);
    return do_send(t, peer, tag, stream);
}

WorkPtr Communicator::recv(const Tensor & t, int peer, int tag, Stream * stream) {
    check_defined(t, *this, "recv", "output");
    check_peer(peer, *this, "recv");
    LOOM_CHECK(tag >= 0, name() << ".recv: negative tag " << tag, "");
    note_transfer(peer, false, t, tag);
    return do_recv(t, peer, tag, stream);
}

void CapturedWork::wait() {
    check_not_capturing("a wait on a collective");
    LOOM_CHECK(false, "a wait on a collective captured into graph '" << graph_ << "'",
               "a captured collective completes in each replay: wait on the replay's stream instead");
}

WorkPtr Communicator::barrier(Stream * stream) {
    note(OpKind::barrier, DType::u8, 0, -1, -1);
    return do_barrier(stream);
}

namespace {

// `values` in a tensor the group can reduce: the values themselves on the CPU, a device copy elsewhere.
Tensor staged(std::vector<float> & values, Device & device) {
    Tensor host = host_blob(values, device);
    if (device.type() == DeviceType::cpu) return host;
    Tensor on_device = Tensor::empty(host.shape(), DType::f32, device);
    copy_now(on_device, host);
    return on_device;
}

std::vector<float> unstaged(const Tensor & t) {
    Tensor             host = host_readable(t);
    std::vector<float> values(static_cast<size_t>(t.numel()));
    if (!values.empty()) std::memcpy(values.data(), host.data_ptr(), values.size() * sizeof(float));
    return values;
}

}  // namespace

std::vector<float> all_reduce_values(Communicator & group, Device & device, std::vector<float> values, ReduceOp op) {
    Tensor t = staged(values, device);
    group.all_reduce(t, op)->wait();
    return unstaged(t);
}

std::vector<float> broadcast_values(Communicator & group, Device & device, std::vector<float> values, int root) {
    Tensor t = staged(values, device);
    group.broadcast(t, root)->wait();
    return unstaged(t);
}

std::vector<float> all_gather_values(Communicator & group, Device & device, std::vector<float> values) {
    Tensor mine = staged(values, device);
    Tensor all  = Tensor::empty({mine.numel() * group.size()}, DType::f32, device);
    group.all_gather(mine, all)->wait();
    return unstaged(all);
}

}  // namespace loom::comm
