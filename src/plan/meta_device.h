// The meta device: Loom's layers, DDP and optimizers built for one rank of any layout and model size without
// the memory or the work. Its allocators are Loom's caching allocators over address space reserved and
// never touched (mmap with MAP_NORESERVE: a page costs memory only if written, and nothing writes them), its
// streams drop the work submitted to them, its ops do nothing, and its communicators complete every
// operation at once. What it keeps exactly is the allocators' books: every tensor the real run allocates is
// allocated here by the same code, of the same size, in the same pool, so a plan reads a rank's bytes per
// pool from the statistics (plan/memory_plan.h). Values read back are zeros, so what depends on data (MoE
// routing counts, a loss) is not planned from this device.
//
// With a CostModel (plan/cost_model.h) the device also keeps time: each stream has a modelled clock that
// every op and every collective issued on it advances by its modelled cost, starting no earlier than the
// host's clock; an event takes its stream's time when recorded, a stream waiting for it moves up to that
// time, and a host synchronisation (a stream's, an event's, a collective's wait) moves the host's clock up
// to the work it waits for. A collective issued without a stream starts at the host's time. So a rank's
// iteration on this device has the timing of its real sequence of kernels and collectives, each at its
// modelled cost, with what overlaps on a GPU overlapping here.
#pragma once

#include "comm/communicator.h"
#include "core/device.h"
#include "plan/cost_model.h"

#include <algorithm>
#include <map>
#include <memory>
#include <string>
#include <vector>

namespace loom::plan {

// The calls of one op (or collective) and their modelled totals.
struct OpTotal {
    int64_t calls   = 0;
    double  flops   = 0;
    double  bytes   = 0;
    double  seconds = 0;
};

// The modelled time of a meta device: the host's clock, the latest end of any work, and the totals by op.
struct MetaClock {
    const CostModel *               costs   = nullptr;   // null: no time is kept
    double                          host    = 0;
    double                          horizon = 0;
    std::map<std::string, OpTotal>  totals;   // by op name ("gemm", "attention_backward", "all_reduce", ...)

    // Work of `seconds` on a stream whose clock is `stream`: it starts when both the stream and the host
    // reach it; returns its end, which the stream's clock becomes unless the work does not hold the stream.
    double run(double & stream, const char * op, double flops, double bytes, double seconds, bool holds_stream = true);
    void   wait_until(double t) { host = std::max(host, t); }
};

// Reports itself as a CUDA device (type cuda, kind "meta"): memory of kind `device` is then not host
// addressable, so host paths copy through the (empty) ops instead of writing the reserved pages.
class MetaDevice final : public Device {
public:
    // With `costs`, ops and collectives keep modelled time (the clock()); without, they only allocate.
    explicit MetaDevice(const CostModel * costs = nullptr);
    ~MetaDevice() override;

    DeviceType   type() const override { return DeviceType::cuda; }
    int          index() const override { return 0; }
    const char * kind_name() const override { return "meta"; }

    Allocator &             allocator(MemoryKind kind = MemoryKind::device) override;
    std::unique_ptr<Stream> stream_create(const std::string & name) override;
    std::unique_ptr<Event>  event_create() override;
    Ops &                   ops() override;
    Stream &                compute_stream() override;

    MetaClock & clock() { return clock_; }

private:
    MetaClock                  clock_;
    std::unique_ptr<Allocator> device_memory_, pinned_memory_;
    std::unique_ptr<Ops>       ops_;
    std::unique_ptr<Stream>    compute_;
};

// A group of `size` ranks seen from `rank`, every operation complete on return (nothing moves).
class MetaCommunicator final : public comm::Communicator {
public:
    // `clock`: the device's, when collectives keep time (null: they do not).
    MetaCommunicator(std::vector<int> global_ranks, int rank, std::string name, MetaClock * clock = nullptr);
    int                      rank() const override { return rank_; }
    int                      size() const override { return static_cast<int>(global_ranks_.size()); }
    const std::vector<int> & global_ranks() const override { return global_ranks_; }
    const std::string &      name() const override { return name_; }

protected:
    comm::WorkPtr do_all_reduce(const Tensor & t, comm::ReduceOp, Stream * s) override;
    comm::WorkPtr do_reduce_scatter(const Tensor & in, const Tensor &, comm::ReduceOp, Stream * s) override;
    comm::WorkPtr do_all_gather(const Tensor &, const Tensor & out, Stream * s) override;
    comm::WorkPtr do_broadcast(const Tensor & t, int, Stream * s) override;
    comm::WorkPtr do_all_to_all(const Tensor & in, std::span<const int64_t>, const Tensor &, std::span<const int64_t>,
                                Stream * s) override;
    comm::WorkPtr do_send(const Tensor & t, int peer, int, Stream * s) override;
    comm::WorkPtr do_recv(const Tensor & t, int peer, int, Stream * s) override;
    comm::WorkPtr do_barrier(Stream * s) override;

private:
    // Completes at the modelled end of `kind` over `ranks` with `bytes` (at once without a clock).
    comm::WorkPtr modelled(const char * op, CollectiveKind kind, double bytes, const std::vector<int> & ranks,
                           Stream * stream, bool holds_stream = true, int peers = -1);

    std::vector<int> global_ranks_;
    int              rank_;
    std::string      name_;
    MetaClock *      clock_;
};

// The communicators world rank `rank` of `world_size` ranks would hold (ProcessGroups::create splits the
// same groups on it as on MPI).
class MetaCommunicatorFactory final : public comm::CommunicatorFactory {
public:
    MetaCommunicatorFactory(int world_size, int rank, MetaClock * clock = nullptr)
        : world_size_(world_size), rank_(rank), clock_(clock) {}
    std::shared_ptr<comm::Communicator> world() override;
    std::shared_ptr<comm::Communicator> split(const std::vector<std::vector<int>> & groups, const std::string & name) override;
    void                                set_timeout(double) override {}

private:
    int         world_size_, rank_;
    MetaClock * clock_;
};

}  // namespace loom::plan
