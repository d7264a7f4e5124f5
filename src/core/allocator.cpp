#include "core/allocator.h"

#include "core/error.h"

#include <algorithm>
#include <bit>
#include <cstdio>
#include <cstdlib>

namespace loom {

const char * memory_kind_name(MemoryKind kind) {
    switch (kind) {
        case MemoryKind::device: return "device";
        case MemoryKind::pinned_host: return "pinned_host";
        case MemoryKind::pageable_host: return "pageable_host";
    }
    return "?";
}

Allocator::Allocator(std::unique_ptr<RawMemory> raw, MemoryKind kind, std::string name)
    : raw_(std::move(raw)), kind_(kind), name_(std::move(name)) {}

Allocator::~Allocator() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Pool & pool : pools_) {
        release_cache_locked(pool);
    }
}

size_t Allocator::class_size(size_t bytes) {
    constexpr size_t kMin   = 512;
    constexpr size_t kLarge = size_t{64} << 20;
    constexpr size_t kPage  = size_t{2} << 20;
    if (bytes <= kMin) {
        return kMin;
    }
    if (bytes > kLarge) {
        return (bytes + kPage - 1) / kPage * kPage;
    }
    // Four classes per power of two: step = 2^(floor(log2(n-1)) - 2).
    size_t octave = std::bit_floor(bytes - 1);
    size_t step   = octave / 4;
    return (bytes + step - 1) / step * step;
}

int Allocator::pool_index_locked(const std::string & name) {
    for (size_t i = 0; i < pools_.size(); ++i) {
        if (pools_[i].name == name) {
            return static_cast<int>(i);
        }
    }
    pools_.push_back(Pool{name, {}, {}});
    return static_cast<int>(pools_.size() - 1);
}

void Allocator::note_peaks_locked(Pool & pool) {
    pool.stats.peak_allocated = std::max(pool.stats.peak_allocated, pool.stats.allocated);
    pool.stats.peak_reserved  = std::max(pool.stats.peak_reserved, pool.stats.reserved);
    total_.peak_allocated     = std::max(total_.peak_allocated, total_.allocated);
    total_.peak_reserved      = std::max(total_.peak_reserved, total_.reserved);
}

Block Allocator::allocate(size_t bytes, const std::string & requested_pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    const std::string * chosen = &requested_pool;
    if (capture_ && capture_->thread == std::this_thread::get_id()) {
        LOOM_CHECK(requested_pool == kDefaultPool || requested_pool == kActivationsPool || requested_pool == capture_->pool,
                   "allocation of " << bytes << " bytes from pool '" << requested_pool << "' of allocator '" << name_
                                    << "' while capturing graph '" << capture_->graph << "'",
                   "a captured step allocates only activations (into the graph's pool '" << capture_->pool
                       << "'); create parameters, buffers and optimizer state before capture");
        chosen = &capture_->pool;
    }
    const std::string & pool_name = *chosen;
    int    index = pool_index_locked(pool_name);
    Pool & pool  = pools_[index];

    Block block;
    block.size = bytes;
    block.pool = index;
    if (bytes > 0) {
        block.capacity = class_size(bytes);
        auto cached = pool.cache.find(block.capacity);
        if (cached != pool.cache.end() && !cached->second.empty()) {
            block.ptr = cached->second.back();
            cached->second.pop_back();
        } else {
            block.ptr = raw_->raw_alloc(block.capacity);
            if (block.ptr == nullptr) {
                // Give cached blocks back and retry once before failing.
                for (Pool & p : pools_) {
                    release_cache_locked(p);
                }
                block.ptr = raw_->raw_alloc(block.capacity);
            }
            LOOM_CHECK(block.ptr != nullptr,
                       "out of " << memory_kind_name(kind_) << " memory in allocator '" << name_
                                 << "': could not allocate " << bytes << " bytes (pool '" << pool_name
                                 << "', " << total_.allocated << " bytes in use, " << total_.reserved
                                 << " reserved)",
                       "reduce --micro-batch-size or the model size, or shard more (tensor, pipeline or "
                       "distributed-optimizer parallelism)");
            pool.stats.reserved += static_cast<int64_t>(block.capacity);
            total_.reserved     += static_cast<int64_t>(block.capacity);
        }
    }
    pool.stats.allocated  += static_cast<int64_t>(bytes);
    total_.allocated      += static_cast<int64_t>(bytes);
    pool.stats.num_allocs += 1;
    total_.num_allocs     += 1;
    pool.stats.active     += 1;
    total_.active         += 1;
    note_peaks_locked(pool);
    return block;
}

void Allocator::deallocate(const Block & block) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    if (block.pool < 0 || block.pool >= static_cast<int>(pools_.size())) {   // a bug, not an input: stop here
        std::fprintf(stderr, "loom: deallocate of a block that allocator '%s' did not hand out\n", name_.c_str());
        std::abort();
    }
    if (capture_ && pools_[block.pool].name == capture_->pool) {
        // A block of the pool being captured into stays allocated until the capture ends: a backend's
        // captured work holds every block it touches (CUDA's launched(), the CPU's recorded closures), so
        // a block the host drops mid-capture is reused only by later captures. Backends whose captures
        // record nothing (the meta device of loom plan) get the same pool this way.
        try {
            capture_->deferred.push_back(block);
            return;
        } catch (...) {   // no memory to defer it: free it now (only the pool's reuse changes)
        }
    }
    deallocate_locked(block);
}

void Allocator::deallocate_locked(const Block & block) noexcept {
    Pool & pool = pools_[block.pool];
    if (block.ptr != nullptr) {
        try {
            pool.cache[block.capacity].push_back(block.ptr);
        } catch (...) {   // no memory to cache it (bad_alloc): give the block back instead of throwing
            raw_->raw_free(block.ptr, block.capacity);
            pool.stats.reserved -= static_cast<int64_t>(block.capacity);
            total_.reserved     -= static_cast<int64_t>(block.capacity);
        }
    }
    pool.stats.allocated -= static_cast<int64_t>(block.size);
    total_.allocated     -= static_cast<int64_t>(block.size);
    pool.stats.num_frees += 1;
    total_.num_frees     += 1;
    pool.stats.active    -= 1;
    total_.active        -= 1;
}

void Allocator::release_cache_locked(Pool & pool) {
    for (auto & [capacity, blocks] : pool.cache) {
        for (void * ptr : blocks) {
            raw_->raw_free(ptr, capacity);
            pool.stats.reserved -= static_cast<int64_t>(capacity);
            total_.reserved     -= static_cast<int64_t>(capacity);
        }
        blocks.clear();
    }
    pool.cache.clear();
}

AllocatorStats Allocator::stats() const {
    std::lock_guard<std::mutex> lock(mutex_);
    return total_;
}

AllocatorStats Allocator::pool_stats(const std::string & name) const {
    std::lock_guard<std::mutex> lock(mutex_);
    for (const Pool & pool : pools_) {
        if (pool.name == name) {
            return pool.stats;
        }
    }
    return AllocatorStats{};
}

std::vector<std::string> Allocator::pool_names() const {
    std::lock_guard<std::mutex> lock(mutex_);
    std::vector<std::string> names;
    for (const Pool & pool : pools_) {
        names.push_back(pool.name);
    }
    return names;
}

void Allocator::reset_peak() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Pool & pool : pools_) {
        pool.stats.peak_allocated = pool.stats.allocated;
        pool.stats.peak_reserved  = pool.stats.reserved;
    }
    total_.peak_allocated = total_.allocated;
    total_.peak_reserved  = total_.reserved;
}

void Allocator::empty_cache() {
    std::lock_guard<std::mutex> lock(mutex_);
    for (Pool & pool : pools_) {
        if (graph_claims_.count(pool.name) == 0) release_cache_locked(pool);
    }
}

void Allocator::empty_cache(const std::string & name) {
    std::lock_guard<std::mutex> lock(mutex_);
    auto claim = graph_claims_.find(name);
    LOOM_CHECK(claim == graph_claims_.end(), "empty_cache of pool '" << name << "' of allocator '" << name_ << "', which "
                                                                     << claim->second << " live graph(s) hold",
               "destroy the graphs captured into the pool first");
    for (Pool & pool : pools_) {
        if (pool.name == name) {
            release_cache_locked(pool);
        }
    }
}

void Allocator::begin_capture(const std::string & graph, const std::string & pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    LOOM_CHECK(!capture_, "capture of graph '" << graph << "' begun while graph '" << capture_->graph
                                                << "' is being captured (allocator '" << name_ << "')",
               "end one capture before beginning the next");
    capture_ = std::make_unique<Capture>(Capture{graph, pool, std::this_thread::get_id(), {}});
}

void Allocator::end_capture() {
    std::lock_guard<std::mutex> lock(mutex_);
    if (!capture_) return;
    for (const Block & block : capture_->deferred) deallocate_locked(block);
    capture_.reset();
}

void Allocator::claim_for_graph(const std::string & pool) {
    std::lock_guard<std::mutex> lock(mutex_);
    ++graph_claims_[pool];
}

void Allocator::release_graph_claim(const std::string & pool) noexcept {
    std::lock_guard<std::mutex> lock(mutex_);
    auto it = graph_claims_.find(pool);
    if (it != graph_claims_.end() && --it->second == 0) graph_claims_.erase(it);
}

}  // namespace loom
