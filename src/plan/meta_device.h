// The meta device: Loom's layers, DDP and optimizers built for one rank of any layout and model size without
// the memory or the work. Its allocators are Loom's caching allocators over address space reserved and
// never touched (mmap with MAP_NORESERVE: a page costs memory only if written, and nothing writes them), its
// streams drop the work submitted to them, its ops do nothing, and its communicators complete every
// operation at once. What it keeps exactly is the allocators' books: every tensor the real run allocates is
// allocated here by the same code, of the same size, in the same pool, so a plan reads a rank's bytes per
// pool from the statistics (plan/memory_plan.h). Values read back are zeros, so what depends on data (MoE
// routing counts, a loss) is not planned from this device.
#pragma once

#include "comm/communicator.h"
#include "core/device.h"

#include <memory>
#include <string>
#include <vector>

namespace loom::plan {

// Reports itself as a CUDA device (type cuda, kind "meta"): memory of kind `device` is then not host
// addressable, so host paths copy through the (empty) ops instead of writing the reserved pages.
class MetaDevice final : public Device {
public:
    MetaDevice();
    ~MetaDevice() override;

    DeviceType   type() const override { return DeviceType::cuda; }
    int          index() const override { return 0; }
    const char * kind_name() const override { return "meta"; }

    Allocator &             allocator(MemoryKind kind = MemoryKind::device) override;
    std::unique_ptr<Stream> stream_create(const std::string & name) override;
    std::unique_ptr<Event>  event_create() override;
    Ops &                   ops() override;
    Stream &                compute_stream() override;

private:
    std::unique_ptr<Allocator> device_memory_, pinned_memory_;
    std::unique_ptr<Ops>       ops_;
    std::unique_ptr<Stream>    compute_;
};

// A group of `size` ranks seen from `rank`, every operation complete on return (nothing moves).
class MetaCommunicator final : public comm::Communicator {
public:
    MetaCommunicator(std::vector<int> global_ranks, int rank, std::string name);
    int                      rank() const override { return rank_; }
    int                      size() const override { return static_cast<int>(global_ranks_.size()); }
    const std::vector<int> & global_ranks() const override { return global_ranks_; }
    const std::string &      name() const override { return name_; }

protected:
    comm::WorkPtr do_all_reduce(const Tensor &, comm::ReduceOp, Stream *) override { return done(); }
    comm::WorkPtr do_reduce_scatter(const Tensor &, const Tensor &, comm::ReduceOp, Stream *) override { return done(); }
    comm::WorkPtr do_all_gather(const Tensor &, const Tensor &, Stream *) override { return done(); }
    comm::WorkPtr do_broadcast(const Tensor &, int, Stream *) override { return done(); }
    comm::WorkPtr do_all_to_all(const Tensor &, std::span<const int64_t>, const Tensor &, std::span<const int64_t>,
                                Stream *) override {
        return done();
    }
    comm::WorkPtr do_send(const Tensor &, int, int, Stream *) override { return done(); }
    comm::WorkPtr do_recv(const Tensor &, int, int, Stream *) override { return done(); }
    comm::WorkPtr do_barrier(Stream *) override { return done(); }

private:
    static comm::WorkPtr done();

    std::vector<int> global_ranks_;
    int              rank_;
    std::string      name_;
};

// The communicators world rank `rank` of `world_size` ranks would hold (ProcessGroups::create splits the
// same groups on it as on MPI).
class MetaCommunicatorFactory final : public comm::CommunicatorFactory {
public:
    MetaCommunicatorFactory(int world_size, int rank) : world_size_(world_size), rank_(rank) {}
    std::shared_ptr<comm::Communicator> world() override;
    std::shared_ptr<comm::Communicator> split(const std::vector<std::vector<int>> & groups, const std::string & name) override;
    void                                set_timeout(double) override {}

private:
    int world_size_, rank_;
};

}  // namespace loom::plan
