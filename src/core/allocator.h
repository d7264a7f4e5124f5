// Caching allocator with size classes, named pools and statistics.
//
// Every byte a tensor holds comes from an Allocator, and the allocator keeps the books that the memory
// claims of later issues are asserted from (bytes per parameter of the distributed optimizer, device
// memory saved by offloading, graph pools bounded by the pipeline depth).
//
//   requested n bytes ──size class──> block of class_size(n) bytes
//       class_size(n) = 512                              n <= 512
//                       n rounded up to 1/4 of its octave  512 < n <= 64 MiB  (at most 25% slack)
//                       n rounded up to 2 MiB              n >  64 MiB
//   free: the block goes back to its pool's cache, keyed by class size; the next request of the same
//   class in the same pool reuses it without touching the raw memory backend.
//
// Statistics (per pool, and summed over pools):
//   allocated      bytes requested by live allocations (what the program asked for)
//   peak_allocated the maximum of `allocated` since start or the last reset_peak()
//   reserved       bytes held from the backend: live blocks plus cached free blocks
//   peak_reserved  the maximum of `reserved`
//   num_allocs     allocations served since start (cache hits included); num_frees likewise
//   active         live allocations
//
// A device's allocators come in two memory kinds, accounted separately: device memory and pinned host
// memory (on the CPU backend both are host memory; the split still tells them apart). Pools are named;
// "default" is where allocations go unless told otherwise. A later issue captures graphs into private
// pools, whose cached blocks are never handed to another pool.
#pragma once

#include <cstddef>
#include <cstdint>
#include <map>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <vector>

namespace loom {

// Where a tensor's bytes live. device: the device's own memory; pinned_host: host memory the device can reach
// (page-locked on a GPU: kernels and asynchronous copies may use it); pageable_host: ordinary host memory
// handed in with Tensor::from_blob, which the host reads and writes and copies move, but which no kernel may
// touch (a GPU cannot address it). No allocator hands out pageable_host memory.
enum class MemoryKind : uint8_t { device, pinned_host, pageable_host };
const char * memory_kind_name(MemoryKind kind);

inline constexpr const char * kDefaultPool = "default";
// Where layers allocate what lives for one step (activations, their gradients, workspaces).
inline constexpr const char * kActivationsPool = "activations";

struct AllocatorStats {
    int64_t allocated      = 0;
    int64_t peak_allocated = 0;
    int64_t reserved       = 0;
    int64_t peak_reserved  = 0;
    int64_t num_allocs     = 0;
    int64_t num_frees      = 0;
    int64_t active         = 0;
};

// One allocation: where it lives and how to give it back.
struct Block {
    void *  ptr      = nullptr;
    size_t  size     = 0;    // bytes requested
    size_t  capacity = 0;    // bytes of the size class actually held
    int     pool     = -1;   // pool index inside the allocator
};

// Where a caching allocator gets its memory: malloc-like calls of one backend.
class RawMemory {
public:
    virtual ~RawMemory() = default;
    virtual void * raw_alloc(size_t bytes) = 0;
    virtual void   raw_free(void * ptr, size_t bytes) = 0;
};

class Allocator {
public:
    Allocator(std::unique_ptr<RawMemory> raw, MemoryKind kind, std::string name);
    ~Allocator();
    Allocator(const Allocator &) = delete;
    Allocator & operator=(const Allocator &) = delete;

    // bytes == 0 gives an empty block (ptr == nullptr) that still counts as an allocation.
    Block allocate(size_t bytes, const std::string & pool = kDefaultPool);
    // Never throws (it runs in ~Storage): a block it cannot cache is freed.
    void  deallocate(const Block & block) noexcept;

    AllocatorStats stats() const;                              // summed over all pools
    AllocatorStats pool_stats(const std::string & pool) const; // zeros for a pool never used
    std::vector<std::string> pool_names() const;

    // Peak of every pool (and of the sum) restarts from the current value.
    void reset_peak();
    // Gives every cached free block back to the raw backend (of one pool, or of all). A pool that live
    // graphs hold (claim_for_graph) is refused by name; empty_cache() passes over such pools.
    void empty_cache();
    void empty_cache(const std::string & pool);

    // Graph capture (core/graph.h). While the calling thread captures `graph`, its allocations from the
    // default and activations pools come from `pool`; one from any other pool throws naming the graph
    // (persistent state must exist before capture). Other threads allocate as usual.
    void begin_capture(const std::string & graph, const std::string & pool);
    void end_capture();
    // A live graph's claim on its pool (its baked addresses point into it); release when it dies.
    void claim_for_graph(const std::string & pool);
    void release_graph_claim(const std::string & pool) noexcept;

    MemoryKind          kind() const { return kind_; }
    const std::string & name() const { return name_; }

    static size_t class_size(size_t bytes);

private:
    struct Pool {
        std::string                              name;
        AllocatorStats                           stats;
        std::map<size_t, std::vector<void *>>    cache;   // class size -> free blocks
    };

    int  pool_index_locked(const std::string & name);
    void release_cache_locked(Pool & pool);
    void note_peaks_locked(Pool & pool);

    std::unique_ptr<RawMemory> raw_;
    MemoryKind                 kind_;
    std::string                name_;
    mutable std::mutex         mutex_;
    std::vector<Pool>          pools_;
    AllocatorStats             total_;
    struct Capture {
        std::string        graph, pool;
        std::thread::id    thread;
        std::vector<Block> deferred;   // the pool's blocks freed during the capture, freed at its end
    };
    void deallocate_locked(const Block & block) noexcept;
    std::unique_ptr<Capture>   capture_;        // the capture in progress, if any
    std::map<std::string, int> graph_claims_;   // pool -> live graphs
};

}  // namespace loom
