// CountingCommunicator: forwards every operation to another communicator and counts, per operation
// kind, the calls and the bytes. Tests of DDP and pipeline schedules assert on these counts (one
// reduce-scatter per bucket group per step, never two: Megatron-LM#775).
//
// Bytes counted per call: all_reduce and broadcast the tensor; reduce_scatter its input (the full,
// unreduced data); all_gather its output (the full, gathered data); all_to_all the elements sent;
// send and recv the message; barrier 0.
#pragma once

#include "comm/communicator.h"

#include <array>
#include <atomic>

namespace loom::comm {

struct OpCount {
    int64_t calls = 0;
    int64_t bytes = 0;
};

class CountingCommunicator : public Communicator {
public:
    explicit CountingCommunicator(std::shared_ptr<Communicator> inner) : inner_(std::move(inner)) {}

    int                      rank() const override { return inner_->rank(); }
    int                      size() const override { return inner_->size(); }
    const std::vector<int> & global_ranks() const override { return inner_->global_ranks(); }
    const std::string &      name() const override { return inner_->name(); }

    OpCount count(OpKind kind) const;
    void    reset();

protected:
    WorkPtr do_all_reduce(const Tensor & t, ReduceOp op, Stream * stream) override;
    WorkPtr do_reduce_scatter(const Tensor & in, const Tensor & out, ReduceOp op, Stream * stream) override;
    WorkPtr do_all_gather(const Tensor & in, const Tensor & out, Stream * stream) override;
    WorkPtr do_broadcast(const Tensor & t, int root, Stream * stream) override;
    WorkPtr do_all_to_all(const Tensor & in, std::span<const int64_t> send_counts, const Tensor & out,
                          std::span<const int64_t> recv_counts, Stream * stream) override;
    WorkPtr do_send(const Tensor & t, int peer, int tag, Stream * stream) override;
    WorkPtr do_recv(const Tensor & t, int peer, int tag, Stream * stream) override;
    WorkPtr do_barrier(Stream * stream) override;

private:
    void note(OpKind kind, int64_t bytes);

    std::shared_ptr<Communicator>                    inner_;
    std::array<std::atomic<int64_t>, kNumOpKinds>    calls_{};
    std::array<std::atomic<int64_t>, kNumOpKinds>    bytes_{};
};

}  // namespace loom::comm
