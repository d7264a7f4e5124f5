#include "comm/counting_communicator.h"

namespace loom::comm {

void CountingCommunicator::note(OpKind kind, int64_t bytes) {
    calls_[static_cast<int>(kind)] += 1;
    bytes_[static_cast<int>(kind)] += bytes;
}

OpCount CountingCommunicator::count(OpKind kind) const {
    return OpCount{calls_[static_cast<int>(kind)].load(), bytes_[static_cast<int>(kind)].load()};
}

void CountingCommunicator::reset() {
    for (int i = 0; i < kNumOpKinds; ++i) {
        calls_[i] = 0;
        bytes_[i] = 0;
    }
}

WorkPtr CountingCommunicator::do_all_reduce(const Tensor & t, ReduceOp op, Stream * stream) {
    note(OpKind::all_reduce, static_cast<int64_t>(t.nbytes()));
    return inner_->all_reduce(t, op, stream);
}

WorkPtr CountingCommunicator::do_reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op,
                                                Stream * stream) {
    note(OpKind::reduce_scatter, static_cast<int64_t>(in.nbytes()));
    return inner_->reduce_scatter(in, out, op, stream);
}

WorkPtr CountingCommunicator::do_all_gather(const Tensor & in, const Tensor & out, Stream * stream) {
    note(OpKind::all_gather, static_cast<int64_t>(out.nbytes()));
    return inner_->all_gather(in, out, stream);
}

WorkPtr CountingCommunicator::do_broadcast(const Tensor & t, int root, Stream * stream) {
    note(OpKind::broadcast, static_cast<int64_t>(t.nbytes()));
    return inner_->broadcast(t, root, stream);
}

WorkPtr CountingCommunicator::do_all_to_all(const Tensor & in, std::span<const int64_t> send_counts,
                                            const Tensor & out, std::span<const int64_t> recv_counts,
                                            Stream * stream) {
    int64_t elements = 0;
    for (int64_t c : send_counts) {
        elements += c;
    }
    note(OpKind::all_to_all, elements * static_cast<int64_t>(dtype_size(in.dtype())));
    return inner_->all_to_all(in, send_counts, out, recv_counts, stream);
}

WorkPtr CountingCommunicator::do_send(const Tensor & t, int peer, int tag, Stream * stream) {
    note(OpKind::send, static_cast<int64_t>(t.nbytes()));
    return inner_->send(t, peer, tag, stream);
}

WorkPtr CountingCommunicator::do_recv(const Tensor & t, int peer, int tag, Stream * stream) {
    note(OpKind::recv, static_cast<int64_t>(t.nbytes()));
    return inner_->recv(t, peer, tag, stream);
}

WorkPtr CountingCommunicator::do_barrier(Stream * stream) {
    note(OpKind::barrier, 0);
    return inner_->barrier(stream);
}

}  // namespace loom::comm
