#include "backend/cpu/cpu_device.h"

#include "backend/cpu/cpu_ops.h"
#include "backend/cpu/cpu_stream.h"

#include <cstdlib>
#include <mutex>

namespace loom::cpu {

namespace {

// Host memory aligned for AVX-512 loads; large blocks on 2 MiB boundaries so the kernel can back them
// with huge pages.
class HostMemory : public RawMemory {
public:
    void * raw_alloc(size_t bytes) override {
        size_t alignment = bytes >= (size_t{2} << 20) ? (size_t{2} << 20) : 64;
        size_t rounded   = (bytes + alignment - 1) / alignment * alignment;
        return std::aligned_alloc(alignment, rounded);
    }
    void raw_free(void * ptr, size_t) override { std::free(ptr); }
};

class CpuDevice : public Device {
public:
    CpuDevice()
        : device_memory_(std::make_unique<HostMemory>(), MemoryKind::device, "cpu:0 device"),
          pinned_memory_(std::make_unique<HostMemory>(), MemoryKind::pinned_host, "cpu:0 pinned host"),
          synchronous_(streams_synchronous_from_env()) {}

    DeviceType type() const override { return DeviceType::cpu; }
    int        index() const override { return 0; }

    Allocator & allocator(MemoryKind kind) override {
        return kind == MemoryKind::device ? device_memory_ : pinned_memory_;
    }

    std::unique_ptr<Stream> stream_create(const std::string & name) override {
        return std::make_unique<CpuStream>(*this, name, synchronous_);
    }

    std::unique_ptr<Event> event_create() override { return std::make_unique<CpuEvent>(); }

    Ops & ops() override { return cpu_ops(); }

    Stream & compute_stream() override {
        std::call_once(compute_once_, [this] { compute_ = stream_create("compute"); });
        return *compute_;
    }

private:
    std::once_flag          compute_once_;
    std::unique_ptr<Stream> compute_;
    Allocator device_memory_;
    Allocator pinned_memory_;
    bool      synchronous_;
};

}  // namespace

Device & device() {
    static CpuDevice instance;
    return instance;
}

}  // namespace loom::cpu
