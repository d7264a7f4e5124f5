// The emulated CUDA device's kernel engine (cuda-emu, loom_emu/device.h): runs a grid on the calling OS thread,
// its blocks one after another (x fastest, then y, then z) and the threads of a block as fibers.
//
// A fiber runs until it waits (at __syncthreads or a warp collective) or returns, then switches back to the
// block's scheduler. The scheduler works in rounds: it resumes every runnable fiber once, in thread-index
// order (or in an order drawn from the shuffle seed), and when none is left runnable it releases what can be
// released: every thread at __syncthreads when all threads that have not exited are there, else each warp
// collective whose mask's live lanes are all there. When nothing can be released while threads still wait,
// the block is stuck (a divergent barrier) and the grid fails with a message naming the kernel.
//
// A fiber's stack comes from a per-OS-thread pool and goes back to it as soon as the fiber returns. A thread
// that returns without having waited hands its stack straight to the next thread of the round when that one
// has not started yet, which then runs on it with no switch: a kernel without barriers runs all the threads
// of a block on one stack, with two context switches per block rather than per thread, in the same order. The switch is a few lines of x86-64 assembly (callee-saved registers, MXCSR and the x87
// control word): no system call, unlike swapcontext, which saves the signal mask.
#include "loom_emu/device.h"

#include <sys/mman.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <new>
#include <stdexcept>
#include <string>
#include <vector>

#if !defined(__x86_64__)
#error "cuda-emu's kernel engine switches fibers with x86-64 code"
#endif

#if defined(__SANITIZE_ADDRESS__)
#define LOOM_EMU_ASAN 1
#elif defined(__has_feature)
#if __has_feature(address_sanitizer)
#define LOOM_EMU_ASAN 1
#endif
#endif
#if defined(LOOM_EMU_ASAN)
#include <sanitizer/asan_interface.h>
#include <sanitizer/common_interface_defs.h>
#endif

// Saves the callee-saved registers, MXCSR and the x87 control word on the current stack, stores the stack
// pointer in *save_sp, and resumes the context whose stack pointer is load_sp (saved by an earlier call, or
// made by new_context). The caller-saved registers need no saving: this is a call as far as the compiler knows.
extern "C" __attribute__((visibility("hidden"))) void loom_emu_switch_context(void ** save_sp, void * load_sp);
// The first code a new fiber runs (reached by switch_context's ret): calls r13(r12) and never returns.
extern "C" __attribute__((visibility("hidden"))) void loom_emu_fiber_trampoline();

__asm__(R"(
    .text
    .p2align 4
    .globl loom_emu_switch_context
    .hidden loom_emu_switch_context
    .type loom_emu_switch_context, @function
loom_emu_switch_context:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    subq $8, %rsp
    stmxcsr (%rsp)
    fnstcw 4(%rsp)
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    ldmxcsr (%rsp)
    fldcw 4(%rsp)
    addq $8, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size loom_emu_switch_context, .-loom_emu_switch_context

    .p2align 4
    .globl loom_emu_fiber_trampoline
    .hidden loom_emu_fiber_trampoline
    .type loom_emu_fiber_trampoline, @function
loom_emu_fiber_trampoline:
    .cfi_startproc
    .cfi_undefined rip
    movq %r12, %rdi
    callq *%r13
    ud2
    .cfi_endproc
    .size loom_emu_fiber_trampoline, .-loom_emu_fiber_trampoline
)");

namespace loom_emu {

namespace {

// ---- Configuration

std::atomic<bool>     g_seed_set{false};
std::atomic<uint64_t> g_seed{0};

// The shuffle seed of a launch: set_shuffle_seed's, else LOOM_EMU_SHUFFLE's (a number; another text is
// hashed), else none.
bool shuffle_seed(uint64_t * seed) {
    if (g_seed_set.load(std::memory_order_acquire)) {
        *seed = g_seed.load(std::memory_order_relaxed);
        return true;
    }
    const char * text = std::getenv("LOOM_EMU_SHUFFLE");
    if (text == nullptr || *text == '\0') return false;
    char *                   end   = nullptr;
    const unsigned long long value = std::strtoull(text, &end, 0);
    if (*end == '\0') {
        *seed = value;
    } else {
        uint64_t h = 1469598103934665603ull;   // FNV-1a
        for (const char * c = text; *c != '\0'; ++c) h = (h ^ static_cast<unsigned char>(*c)) * 1099511628211ull;
        *seed = h;
    }
    return true;
}

uint64_t splitmix64(uint64_t * state) {
    uint64_t z = (*state += 0x9e3779b97f4a7c15ull);
    z          = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z          = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

// ---- Stacks

struct Stack {
    char * region    = nullptr;   // the mapping: a guard page, then the usable stack
    size_t bytes     = 0;         // the usable part
    bool   abandoned = false;     // its fiber never returned (an aborted block): frames left behind
    char * bottom() const { return region + page_bytes(); }
    char * top() const { return bottom() + bytes; }
    static size_t page_bytes() {
        static const size_t page = static_cast<size_t>(sysconf(_SC_PAGESIZE));
        return page;
    }
};

// Stacks of one OS thread, kept for its next fibers and unmapped when the thread exits.
class StackPool {
  public:
    StackPool() = default;
    StackPool(const StackPool &) = delete;
    StackPool & operator=(const StackPool &) = delete;
    ~StackPool() {
        for (const Stack & s : free_) munmap(s.region, s.bytes + Stack::page_bytes());
    }

    Stack acquire() {
        Stack s;
        if (!free_.empty()) {
            s = free_.back();
            free_.pop_back();
        } else {
            s.bytes      = fiber_stack_bytes();
            const size_t page = Stack::page_bytes();
            void *       p    = mmap(nullptr, s.bytes + page, PROT_READ | PROT_WRITE,
                                     MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE | MAP_STACK, -1, 0);
            if (p == MAP_FAILED) throw std::bad_alloc();
            s.region = static_cast<char *>(p);
            mprotect(s.region, page, PROT_NONE);   // the guard: an overflowing kernel faults instead of corrupting
        }
#if defined(LOOM_EMU_ASAN)
        // A fiber that never returned leaves its frames' redzones poisoned. (One that returned leaves only
        // fiber_entry's frame, which the next fiber's fiber_entry lays out the same way.)
        if (s.abandoned) __asan_unpoison_memory_region(s.bottom(), s.bytes);
#endif
        s.abandoned = false;
        return s;
    }

    void release(const Stack & s) { free_.push_back(s); }

  private:
    std::vector<Stack> free_;
};

thread_local StackPool tl_stacks;

// ---- Fibers

enum class FiberState : uint8_t { fresh, runnable, block_wait, warp_wait, done };

struct Fiber {
    engine_internal::ThreadState thread;   // first: what threadIdx reads
    FiberState                   state = FiberState::fresh;
    unsigned                     index = 0;   // the linear thread index
    void *                       sp    = nullptr;
    Stack                        stack;
    void *                       fake_stack = nullptr;   // AddressSanitizer's, while switched out
    // Where it waits.
    const char * what = nullptr;
    const char * file = nullptr;
    int          line = 0;
    unsigned     mask = 0;
    int          src_lane  = 0;
    int          predicate = 0;
    uint64_t     value     = 0;
    // What the release gives back.
    engine_internal::WarpResult    warp_result{};
    engine_internal::BarrierResult barrier_result{};
};

class GridRunner;
thread_local GridRunner * tl_runner = nullptr;

bool same_site(const Fiber & a, const Fiber & b) {
    return a.line == b.line && (a.file == b.file || std::strcmp(a.file, b.file) == 0);
}

std::string dims(uint3 v) {
    return "(" + std::to_string(v.x) + ", " + std::to_string(v.y) + ", " + std::to_string(v.z) + ")";
}

class GridRunner {
  public:
    GridRunner(const GridLaunch & launch, void (*thread_main)(const void *), const void * closure)
        : launch_(launch), thread_main_(thread_main), closure_(closure) {
        const dim3 b = launch.block;
        threads_     = b.x * b.y * b.z;
        fibers_.resize(threads_);
        for (unsigned i = 0; i < threads_; ++i) {
            fibers_[i].index             = i;
            fibers_[i].thread.thread_idx = uint3{i % b.x, i / b.x % b.y, i / (b.x * b.y)};
        }
        runnable_.reserve(threads_);
        shuffled_ = shuffle_seed(&seed_);
        smem_     = static_cast<char *>(::operator new(launch.dynamic_smem, std::align_val_t{64}));
        unsigned mxcsr = 0;
        uint16_t fpucw = 0;
        __asm__ volatile("stmxcsr %0" : "=m"(mxcsr));
        __asm__ volatile("fnstcw %0" : "=m"(fpucw));
        fp_control_ = static_cast<uint64_t>(mxcsr) | static_cast<uint64_t>(fpucw) << 32;
    }

    GridRunner(const GridRunner &) = delete;
    GridRunner & operator=(const GridRunner &) = delete;

    ~GridRunner() {
        abandon_fibers();
        ::operator delete(smem_, std::align_val_t{64});
    }

    void run() {
        const dim3 g = launch_.grid;
        for (unsigned z = 0; z < g.z; ++z) {
            for (unsigned y = 0; y < g.y; ++y) {
                for (unsigned x = 0; x < g.x; ++x) run_block(uint3{x, y, z});
            }
        }
    }

    // ---- Called on a fiber (through the engine_internal entry points)

    engine_internal::BarrierResult block_barrier(int predicate, const char * what, const char * file, int line) {
        Fiber & f  = *current_;
        f.predicate = predicate;
        wait_at(f, FiberState::block_wait, what, file, line);
        return f.barrier_result;
    }

    engine_internal::WarpResult warp_collective(unsigned mask, uint64_t value, int src_lane, int predicate,
                                                const char * what, const char * file, int line) {
        Fiber & f  = *current_;
        f.mask      = mask | 1u << (f.index % kWarpSize);   // the caller always takes part
        f.value     = value;
        f.src_lane  = src_lane;
        f.predicate = predicate;
        wait_at(f, FiberState::warp_wait, what, file, line);
        return f.warp_result;
    }

    // The fiber waits in `state` at the call `what` (file:line, for the engine's reports) until released.
    void wait_at(Fiber & f, FiberState state, const char * what, const char * file, int line) {
        f.state = state;
        f.what  = what;
        f.file  = file;
        f.line  = line;
        park(f);
    }

    unsigned warp_active_mask() const {
        const unsigned first = current_->index / kWarpSize * kWarpSize;
        const unsigned end   = std::min(threads_, first + kWarpSize);
        unsigned       mask  = 0;
        for (unsigned i = first; i < end; ++i) {
            if (fibers_[i].state != FiberState::done) mask |= 1u << (i - first);
        }
        return mask;
    }

  private:
    void run_block(uint3 block_idx) {
        block_.block_idx          = block_idx;
        block_.block_dim          = launch_.block;
        block_.grid_dim           = launch_.grid;
        block_.dynamic_smem       = smem_;
        engine_internal::tl_block = &block_;
        std::memset(smem_, 0xff, launch_.dynamic_smem);   // poison: reading it before writing it shows
        if (shuffled_) {   // each block its own order, the same at every run
            const uint64_t gx = launch_.grid.x, gy = launch_.grid.y;
            rng_              = seed_ ^ ((block_idx.x + gx * (block_idx.y + gy * block_idx.z)) * 0xd1b54a32d192ed03ull);
        }

        runnable_.clear();
        for (unsigned i = 0; i < threads_; ++i) {
            fibers_[i].state = FiberState::fresh;
            runnable_.push_back(i);
        }
        live_ = threads_;
        for (;;) {
            if (shuffled_) shuffle_runnable();
            for (at_ = 0; at_ < runnable_.size(); ++at_) {   // a chain of fresh threads moves at_ on
                resume(fibers_[runnable_[at_]]);
                if (error_) fail_thread();
            }
            if (live_ == 0) break;
            release_waiters();
        }
    }

    void shuffle_runnable() {
        for (size_t i = runnable_.size(); i > 1; --i) {
            const size_t j = static_cast<size_t>(splitmix64(&rng_) % i);
            std::swap(runnable_[i - 1], runnable_[j]);
        }
    }

    // Switches to f until it waits or returns.
    void resume(Fiber & f) {
        if (f.state == FiberState::fresh) {
            f.stack = tl_stacks.acquire();
            f.sp    = new_context(f);
        }
        f.state                    = FiberState::runnable;
        current_                   = &f;
        engine_internal::tl_thread = &f.thread;
#if defined(LOOM_EMU_ASAN)
        __sanitizer_start_switch_fiber(&scheduler_fake_stack_, f.stack.bottom(), f.stack.bytes);
#endif
        loom_emu_switch_context(&scheduler_sp_, f.sp);
#if defined(LOOM_EMU_ASAN)
        __sanitizer_finish_switch_fiber(scheduler_fake_stack_, nullptr, nullptr);
#endif
        Fiber & last = *current_;   // f, or the last thread of the chain f started
        if (last.state == FiberState::done) {
            tl_stacks.release(last.stack);
            last.stack = Stack{};
        }
    }

    // The thread a returning one hands its stack to: the round's next, when it has not started and no thread
    // has thrown; else null, and the returning thread switches back to the scheduler.
    Fiber * next_fresh() {
        if (error_ || at_ + 1 >= runnable_.size()) return nullptr;
        Fiber & next = fibers_[runnable_[at_ + 1]];
        if (next.state != FiberState::fresh) return nullptr;
        ++at_;
        return &next;
    }

    // The frame loom_emu_switch_context pops for a fiber's first switch: saved FP control, r15, r14, r13 (the
    // entry), r12 (the fiber), rbx, rbp, and the return address (the trampoline), ending 16-byte aligned so
    // that the trampoline's call sees the ABI's alignment.
    void * new_context(Fiber & f) {
        uintptr_t  top   = (reinterpret_cast<uintptr_t>(f.stack.top()) & ~uintptr_t{15}) - 16;
        uint64_t * frame = reinterpret_cast<uint64_t *>(top) - 8;
        frame[0]         = fp_control_;
        frame[1]         = 0;   // r15
        frame[2]         = 0;   // r14
        frame[3]         = reinterpret_cast<uint64_t>(&GridRunner::fiber_entry);   // r13
        frame[4]         = reinterpret_cast<uint64_t>(&f);                          // r12
        frame[5]         = 0;                                                       // rbx
        frame[6]         = 0;                                                       // rbp
        frame[7]         = reinterpret_cast<uint64_t>(&loom_emu_fiber_trampoline);
        return frame;
    }

    // A fiber's life: the kernel, then the kernel of each fresh thread it hands its stack to (next_fresh), then
    // back to the scheduler for good. Exceptions stop here: the unwinder never crosses a switch; the scheduler
    // rethrows (fail_thread).
    static void fiber_entry(Fiber * f) {
        GridRunner * self = tl_runner;
#if defined(LOOM_EMU_ASAN)
        __sanitizer_finish_switch_fiber(nullptr, &self->scheduler_stack_bottom_, &self->scheduler_stack_bytes_);
#endif
        for (;;) {
            try {
                self->thread_main_(self->closure_);
            } catch (...) {
                if (!self->error_) {
                    self->error_        = std::current_exception();
                    self->error_thread_ = f->thread.thread_idx;
                }
            }
            f->state = FiberState::done;
            --self->live_;
            Fiber * next = self->next_fresh();
            if (next == nullptr) break;
            next->stack                = f->stack;   // this stack, with no frame of f's left on it
            f->stack                   = Stack{};
            next->state                = FiberState::runnable;
            self->current_             = next;
            engine_internal::tl_thread = &next->thread;
            f                          = next;
        }
#if defined(LOOM_EMU_ASAN)
        __sanitizer_start_switch_fiber(nullptr, self->scheduler_stack_bottom_, self->scheduler_stack_bytes_);
#endif
        loom_emu_switch_context(&f->sp, self->scheduler_sp_);
        __builtin_unreachable();
    }

    // Switches from the waiting fiber f back to the scheduler; returns when the scheduler resumes f.
    void park(Fiber & f) {
#if defined(LOOM_EMU_ASAN)
        __sanitizer_start_switch_fiber(&f.fake_stack, scheduler_stack_bottom_, scheduler_stack_bytes_);
#endif
        loom_emu_switch_context(&f.sp, scheduler_sp_);
#if defined(LOOM_EMU_ASAN)
        __sanitizer_finish_switch_fiber(f.fake_stack, nullptr, nullptr);
#endif
    }

    // Makes runnable what the waits allow, in thread-index order; fails when nothing can go on.
    void release_waiters() {
        runnable_.clear();
        unsigned at_block = 0, first_block = 0;
        for (unsigned i = 0; i < threads_; ++i) {
            if (fibers_[i].state == FiberState::block_wait && at_block++ == 0) first_block = i;
        }
        if (at_block == live_) {
            int count = 0;
            for (unsigned i = 0; i < threads_; ++i) {
                const Fiber & f = fibers_[i];
                if (f.state != FiberState::block_wait) continue;
                if (!same_site(f, fibers_[first_block])) fail_stuck("__syncthreads reached at different places");
                count += f.predicate;
            }
            for (unsigned i = 0; i < threads_; ++i) {
                Fiber & f = fibers_[i];
                if (f.state != FiberState::block_wait) continue;
                f.barrier_result = engine_internal::BarrierResult{count, static_cast<int>(live_)};
                f.state          = FiberState::runnable;
                runnable_.push_back(i);
            }
            return;
        }
        for (unsigned first = 0; first < threads_; first += kWarpSize) release_warp(first);
        if (runnable_.empty()) fail_stuck("every thread that has not exited waits, and no wait can end");
    }

    // Releases the collectives of the warp starting at thread `first` whose lanes have all arrived: the
    // lanes of the mask that have not exited, each with the same mask.
    void release_warp(unsigned first) {
        const unsigned lanes = std::min<unsigned>(kWarpSize, threads_ - first);
        unsigned       live = 0, waiting = 0;
        for (unsigned l = 0; l < lanes; ++l) {
            const FiberState s = fibers_[first + l].state;
            if (s != FiberState::done) live |= 1u << l;
            if (s == FiberState::warp_wait) waiting |= 1u << l;
        }
        unsigned handled = 0;
        for (unsigned l = 0; l < lanes; ++l) {
            if ((waiting >> l & 1u) == 0 || (handled >> l & 1u) != 0) continue;
            const unsigned mask  = fibers_[first + l].mask;
            const unsigned group = mask & live;
            if ((group & ~waiting) != 0) continue;   // a lane of the mask is elsewhere
            bool same_mask = true;
            for (unsigned m = 0; m < lanes; ++m) {
                if ((group >> m & 1u) != 0 && fibers_[first + m].mask != mask) same_mask = false;
            }
            if (!same_mask) continue;
            unsigned ballot = 0;
            for (unsigned m = 0; m < lanes; ++m) {
                if ((group >> m & 1u) != 0 && fibers_[first + m].predicate != 0) ballot |= 1u << m;
            }
            for (unsigned m = 0; m < lanes; ++m) {
                if ((group >> m & 1u) == 0) continue;
                Fiber &        f   = fibers_[first + m];
                const unsigned src = static_cast<unsigned>(f.src_lane);
                const uint64_t v   = src < kWarpSize && (group >> src & 1u) != 0 ? fibers_[first + src].value : f.value;
                f.warp_result      = engine_internal::WarpResult{v, ballot, group};
                f.state            = FiberState::runnable;
            }
            handled |= group;
        }
        for (unsigned m = 0; m < lanes; ++m) {
            if ((handled >> m & 1u) != 0) runnable_.push_back(first + m);
        }
    }

    std::string where() const {
        return "kernel '" + std::string(launch_.name) + "' (grid " + dims(launch_.grid) + ", block " +
               dims(launch_.block) + "), block " + dims(block_.block_idx);
    }

    // The block cannot go on: names every place threads wait at, with how many wait there.
    [[noreturn]] void fail_stuck(const char * why) {
        std::string message = "loom_emu: " + where() + " is stuck: " + why + ".";
        unsigned    exited  = 0;
        std::vector<const Fiber *> sites;
        std::vector<unsigned>      counts;
        for (const Fiber & f : fibers_) {
            if (f.state == FiberState::done) {
                ++exited;
                continue;
            }
            size_t s = 0;
            while (s < sites.size() && !(same_site(*sites[s], f) && sites[s]->mask == f.mask &&
                                         std::strcmp(sites[s]->what, f.what) == 0)) {
                ++s;
            }
            if (s == sites.size()) {
                sites.push_back(&f);
                counts.push_back(0);
            }
            ++counts[s];
        }
        for (size_t s = 0; s < sites.size(); ++s) {
            const Fiber & f = *sites[s];
            message += " " + std::to_string(counts[s]) + " thread(s) from thread " + dims(f.thread.thread_idx) +
                       " wait at " + f.what + " (" + f.file + ":" + std::to_string(f.line) + ")";
            if (f.state == FiberState::warp_wait) {
                char mask[16];
                std::snprintf(mask, sizeof(mask), "0x%08x", f.mask);
                message += std::string(" with mask ") + mask;
            }
            message += ";";
        }
        message += " " + std::to_string(exited) + " thread(s) exited.";
        abandon_fibers();
        throw std::runtime_error(message);
    }

    // A thread threw: the block stops there (the threads still waiting never resume).
    [[noreturn]] void fail_thread() {
        std::exception_ptr error = error_;
        error_                   = nullptr;
        abandon_fibers();
        const std::string context = "loom_emu: " + where() + ", thread " + dims(error_thread_) + " threw: ";
        try {
            std::rethrow_exception(error);
        } catch (const std::exception & e) {
            throw std::runtime_error(context + e.what());
        } catch (...) {
            throw std::runtime_error(context + "an exception that is no std::exception");
        }
    }

    // Drops the fibers that still wait (their frames are never unwound) and takes their stacks back.
    void abandon_fibers() {
        for (Fiber & f : fibers_) {
            if (f.stack.region != nullptr) {
                f.stack.abandoned = true;
                tl_stacks.release(f.stack);
                f.stack = Stack{};
            }
            f.state = FiberState::done;
        }
        live_ = 0;
    }

    const GridLaunch & launch_;
    void (*thread_main_)(const void *);
    const void *                  closure_;
    unsigned                      threads_ = 0;
    std::vector<Fiber>            fibers_;
    std::vector<unsigned>         runnable_;
    size_t                        at_ = 0;   // the round's place in runnable_
    unsigned                      live_ = 0;
    Fiber *                       current_ = nullptr;
    engine_internal::BlockState   block_{};
    char *                        smem_ = nullptr;
    uint64_t                      fp_control_ = 0;
    bool                          shuffled_ = false;
    uint64_t                      seed_ = 0;
    uint64_t                      rng_ = 0;
    void *                        scheduler_sp_ = nullptr;
#if defined(LOOM_EMU_ASAN)
    void *                        scheduler_fake_stack_   = nullptr;
    const void *                  scheduler_stack_bottom_ = nullptr;
    size_t                        scheduler_stack_bytes_  = 0;
#endif
    std::exception_ptr            error_;
    uint3                         error_thread_{0, 0, 0};
};

GridRunner & running(const char * what) {
    if (tl_runner == nullptr || engine_internal::tl_thread == nullptr) {
        throw std::logic_error(std::string("loom_emu: ") + what + " called outside a kernel");
    }
    return *tl_runner;
}

}  // namespace

// ---- The public entry points

cudaError_t check_launch(const GridLaunch & launch, size_t max_dynamic_smem) {
    const dim3 b = launch.block, g = launch.grid;
    if (b.x == 0 || b.y == 0 || b.z == 0 || b.x > 1024 || b.y > 1024 || b.z > 64) return cudaErrorInvalidConfiguration;
    if (static_cast<uint64_t>(b.x) * b.y * b.z > kMaxThreadsPerBlock) return cudaErrorInvalidConfiguration;
    if (g.x == 0 || g.y == 0 || g.z == 0 || g.x > 0x7fffffffu || g.y > 65535 || g.z > 65535) {
        return cudaErrorInvalidConfiguration;
    }
    if (launch.dynamic_smem > max_dynamic_smem) return cudaErrorInvalidConfiguration;
    return cudaSuccess;
}

void run_grid(const GridLaunch & launch, void (*thread_main)(const void *), const void * closure) {
    if (check_launch(launch, kMaxSharedMemoryPerBlock) != cudaSuccess) {
        throw std::invalid_argument("loom_emu: kernel '" + std::string(launch.name) + "' launched with grid " +
                                    dims(launch.grid) + ", block " + dims(launch.block) + " and " +
                                    std::to_string(launch.dynamic_smem) + " bytes of dynamic shared memory");
    }
    // The state of an enclosing grid, should a grid be run from inside one (the engine itself never does).
    GridRunner * const                         outer_runner = tl_runner;
    const engine_internal::ThreadState * const outer_thread = engine_internal::tl_thread;
    const engine_internal::BlockState * const  outer_block  = engine_internal::tl_block;
    struct Restore {
        GridRunner *                         runner;
        const engine_internal::ThreadState * thread;
        const engine_internal::BlockState *  block;
        ~Restore() {
            tl_runner                  = runner;
            engine_internal::tl_thread = thread;
            engine_internal::tl_block  = block;
        }
    } restore{outer_runner, outer_thread, outer_block};
    GridRunner runner(launch, thread_main, closure);
    tl_runner = &runner;
    runner.run();
}

void set_shuffle_seed(uint64_t seed) {
    g_seed.store(seed, std::memory_order_relaxed);
    g_seed_set.store(true, std::memory_order_release);
}

void clear_shuffle_seed() { g_seed_set.store(false, std::memory_order_release); }

size_t fiber_stack_bytes() {
    static const size_t bytes = [] {
#if defined(LOOM_EMU_ASAN)
        size_t kib = 256;
#else
        size_t kib = 64;
#endif
        if (const char * text = std::getenv("LOOM_EMU_STACK_KB"); text != nullptr && *text != '\0') {
            const unsigned long long v = std::strtoull(text, nullptr, 10);
            if (v > 0) kib = static_cast<size_t>(v);
        }
        kib                = std::max<size_t>(kib, 16);
        const size_t page  = Stack::page_bytes();
        return (kib * 1024 + page - 1) / page * page;
    }();
    return bytes;
}

namespace engine_internal {

BarrierResult block_barrier(int predicate, const char * what, const char * file, int line) {
    return running(what).block_barrier(predicate, what, file, line);
}

WarpResult warp_collective(unsigned mask, uint64_t value, int src_lane, int predicate, const char * what,
                           const char * file, int line) {
    return running(what).warp_collective(mask, value, src_lane, predicate, what, file, line);
}

unsigned warp_active_mask() { return running("__activemask").warp_active_mask(); }

}  // namespace engine_internal

}  // namespace loom_emu
