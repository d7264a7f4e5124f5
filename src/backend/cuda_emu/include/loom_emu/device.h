// The device-side language of the emulated CUDA device (cuda-emu): what a kernel written for nvcc needs to
// compile as host C++ and run on kernel_engine.cpp's fibers. The runtime stand-in's cuda_runtime.h includes
// this header after loom_emu/base.h and brings namespace loom_emu into the global namespace, so kernels find
// __syncthreads, __shfl_down_sync, atomicAdd, ... by unqualified lookup as they would under nvcc.
//
// The model. A grid runs on the OS thread that launches it (a stream's worker thread), its blocks one after
// another; the threads of a block are fibers on that OS thread, each running until it waits at a barrier, a
// warp collective or returns. So:
//   - __shared__ is `static thread_local`: one instance per OS thread, which is one per running block. Static
//     shared memory keeps what the previous block on that OS thread left there (the real device's is
//     undefined at block start too); dynamic shared memory (LOOM_DYNAMIC_SHARED) is filled with 0xFF bytes
//     at every block start, so a kernel that reads it before writing it sees NaNs and -1s.
//   - threadIdx, blockIdx, blockDim and gridDim read the running fiber's and block's state.
//   - Warp collectives (__shfl_*_sync, __ballot_sync, __syncwarp, ...) wait for every lane of the mask that
//     has not exited; lanes past blockDim and exited lanes are inactive, and reading an inactive lane gives
//     the caller's own value. __syncthreads waits for every thread of the block that has not exited.
//   - Atomics are real atomics: kernels on different streams run on different OS threads.
//   - The _rn intrinsics round each operation on its own: they are never contracted into an fma, whatever
//     -ffp-contract says (plain `a * b + c` in a kernel follows the compiler's flag: build with
//     -ffp-contract=off for the exact CPU twins).
// x86-64 only (the engine's context switch).
#pragma once

#include "loom_emu/base.h"

#include <cmath>
#include <cstdint>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

// ---- Qualifiers: host C++ has one address space and one kind of function.
#define __global__
#define __device__
#define __host__
#define __constant__
#define __forceinline__ inline
#define __launch_bounds__(...)
#define __shared__ static thread_local

// ---- Built-in variables: the running fiber's thread and the running block (see engine_internal below).
#define threadIdx (::loom_emu::engine_internal::tl_thread->thread_idx)
#define blockIdx (::loom_emu::engine_internal::tl_block->block_idx)
#define blockDim (::loom_emu::engine_internal::tl_block->block_dim)
#define gridDim (::loom_emu::engine_internal::tl_block->grid_dim)

// LOOM_LAUNCH(kernel, grid, block, smem, stream)(args...) is kernel<<<grid, block, smem, stream>>>(args...)
// (backend/cuda/launch.h). A function template kernel is named with its template arguments.
#define LOOM_LAUNCH(kernel, grid, block, smem, stream)                                                  \
    ::loom_emu::Launch(kernel, #kernel, ::loom_emu::dim3(grid), ::loom_emu::dim3(block),                \
                       static_cast<size_t>(smem), (stream))
// LOOM_DYNAMIC_SHARED(float, smem); is extern __shared__ float smem[]; the block's dynamic shared memory.
#define LOOM_DYNAMIC_SHARED(type, name) type * name = ::loom_emu::dynamic_shared<type>()

namespace loom_emu {

constexpr int warpSize = kWarpSize;

// ---- The kernel engine's interface (kernel_engine.cpp).

// One grid as the engine runs it. `name` labels the kernel in errors and must outlive the run.
struct GridLaunch {
    dim3         grid;
    dim3         block;
    size_t       dynamic_smem;
    const char * name;
};

// cudaSuccess, or cudaErrorInvalidConfiguration where CUDA would refuse the launch: a block of 0 or more than
// 1024 threads or a dimension past its limit (1024, 1024, 64), a grid dimension of 0 or past its limit
// (2^31 - 1, 65535, 65535), dynamic shared memory past max_dynamic_smem.
cudaError_t check_launch(const GridLaunch & launch, size_t max_dynamic_smem);

// Runs every block of the grid on the calling thread and returns when all its threads have returned; each
// emulated thread calls thread_main(closure). Throws std::runtime_error naming the kernel where a thread
// throws (its message included) and where the block cannot go on: every thread that has not exited waits,
// but at barriers that cannot all be released (a warp collective whose lanes wait at __syncthreads,
// __syncthreads reached at different places of the source, lanes of one warp collective with different
// masks). Exceptions never cross a fiber switch: the engine catches them in the fiber and rethrows here.
void run_grid(const GridLaunch & launch, void (*thread_main)(const void *), const void * closure);

// The order in which the threads of a block run between two barriers: thread-index order by default; with
// a seed, an order drawn per block and per barrier round from it, so a kernel that races on shared memory
// (reads what another thread writes without a barrier between) gives results that change with the seed.
// The seed comes from set_shuffle_seed when set, else from the environment variable LOOM_EMU_SHUFFLE (a
// number; read at every launch, so a test may setenv it), else there is none.
void set_shuffle_seed(uint64_t seed);
void clear_shuffle_seed();   // back to LOOM_EMU_SHUFFLE

// The bytes of stack each fiber gets: LOOM_EMU_STACK_KB KiB (read once), 64 KiB by default (256 KiB under
// AddressSanitizer, whose frames are larger). A kernel whose locals overflow it hits a guard page.
size_t fiber_stack_bytes();

namespace engine_internal {

struct ThreadState {
    uint3 thread_idx;
};

struct BlockState {
    uint3  block_idx;
    dim3   block_dim;
    dim3   grid_dim;
    void * dynamic_smem;
};

// Set by the engine before it resumes a fiber or starts a block; null outside a kernel.
inline thread_local const ThreadState * tl_thread = nullptr;
inline thread_local const BlockState *  tl_block  = nullptr;

// What a lane gets back from a warp collective: the value of its source lane (its own where that lane is
// outside the collective), the predicates of the lanes that took part and the set of those lanes.
struct WarpResult {
    uint64_t value;
    unsigned ballot;
    unsigned group;
};

// What a thread gets back from a block barrier: how many threads passed a true predicate, and how many passed.
struct BarrierResult {
    int count;
    int threads;
};

// The waits themselves; `what` names the intrinsic in error messages, file and line its call.
BarrierResult block_barrier(int predicate, const char * what, const char * file, int line);
WarpResult    warp_collective(unsigned mask, uint64_t value, int src_lane, int predicate, const char * what,
                              const char * file, int line);
unsigned      warp_active_mask();

inline unsigned lane_id() {
    const uint3 t = threadIdx;
    const dim3  b = blockDim;
    return (t.x + b.x * (t.y + b.y * t.z)) % kWarpSize;
}

template <typename T>
inline uint64_t to_bits(T value) {
    static_assert(std::is_trivially_copyable_v<T> && sizeof(T) <= sizeof(uint64_t), "a warp value is 8 bytes at most");
    uint64_t bits = 0;
    std::memcpy(&bits, &value, sizeof(T));
    return bits;
}

template <typename T>
inline T from_bits(uint64_t bits) {
    T value;
    std::memcpy(&value, &bits, sizeof(T));
    return value;
}

template <typename To, typename From>
inline To bit_cast(From value) {
    static_assert(sizeof(To) == sizeof(From), "a bit cast keeps the size");
    To to;
    std::memcpy(&to, &value, sizeof(To));
    return to;
}

// A width of a shuffle: a power of two up to 32 (anything else is undefined in CUDA; read as 32).
inline unsigned shuffle_width(int width) {
    return width >= 1 && width <= kWarpSize && (width & (width - 1)) == 0 ? static_cast<unsigned>(width) : kWarpSize;
}

// The value as it is, opaque to the optimiser: an operation whose operands and result pass through this is
// rounded on its own and never contracted with a neighbour into an fma.
template <typename T>
inline T opaque(T value) {
#if defined(__x86_64__)
    __asm__("" : "+x"(value));
#endif
    return value;
}

// Atomically replaces *address with update(old) and returns old (bitwise compare, so NaNs terminate).
template <typename T, typename Update>
inline T atomic_update(T * address, Update update) {
    T old;
    __atomic_load(address, &old, __ATOMIC_RELAXED);
    T desired = update(old);
    while (!__atomic_compare_exchange(address, &old, &desired, true, __ATOMIC_RELAXED, __ATOMIC_RELAXED)) {
        desired = update(old);
    }
    return old;
}

}  // namespace engine_internal

// The block's dynamic shared memory (LOOM_DYNAMIC_SHARED), 64-byte aligned.
template <typename T>
inline T * dynamic_shared() {
    return static_cast<T *>(engine_internal::tl_block->dynamic_smem);
}

// ---- Launches

// A grid with its kernel and a copy of its arguments, converted to the kernel's parameter types: what a
// launch enqueues. Every emulated thread calls the kernel with its own copy of the parameters.
template <typename... Params>
struct KernelClosure {
    void (*kernel)(Params...);
    GridLaunch                           launch;
    std::tuple<std::decay_t<Params>...> params;

    void operator()() const { run_grid(launch, &KernelClosure::thread_main, this); }

    static void thread_main(const void * self) {
        const KernelClosure & c = *static_cast<const KernelClosure *>(self);
        std::apply(c.kernel, c.params);
    }
};

// LOOM_LAUNCH's callable: checks the configuration as CUDA does (a bad one is recorded with set_last_error and
// nothing runs) and enqueues the grid on the stream.
template <typename... Params>
class Launch {
  public:
    using Kernel = void (*)(Params...);

    Launch(Kernel kernel, const char * name, dim3 grid, dim3 block, size_t dynamic_smem, cudaStream_t stream)
        : kernel_(kernel), launch_{grid, block, dynamic_smem, name}, stream_(stream) {}

    template <typename... Args>
    void operator()(Args &&... args) const {
        static_assert(sizeof...(Args) == sizeof...(Params), "LOOM_LAUNCH: not as many arguments as the kernel takes");
        const size_t      max_smem = kernel_max_dynamic_smem(reinterpret_cast<const void *>(kernel_));
        const cudaError_t checked  = check_launch(launch_, max_smem);
        if (checked != cudaSuccess) {
            set_last_error(checked);
            return;
        }
        const KernelClosure<Params...> closure{
            kernel_, launch_, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
        const cudaError_t queued = enqueue(stream_, closure, launch_.name);
        if (queued != cudaSuccess) set_last_error(queued);
    }

  private:
    Kernel       kernel_;
    GridLaunch   launch_;
    cudaStream_t stream_;
};

// Runs kernel<<<grid, block, dynamic_smem>>>(args...) at once on the calling thread, outside any stream (the
// engine's tests; run_grid's exceptions propagate). `name` must outlive the call.
template <typename... Params, typename... Args>
void run_kernel(void (*kernel)(Params...), const char * name, dim3 grid, dim3 block, size_t dynamic_smem,
                Args &&... args) {
    static_assert(sizeof...(Args) == sizeof...(Params), "run_kernel: not as many arguments as the kernel takes");
    const GridLaunch               launch{grid, block, dynamic_smem, name};
    const KernelClosure<Params...> closure{
        kernel, launch, std::tuple<std::decay_t<Params>...>(std::forward<Args>(args)...)};
    closure();
}

// ---- Synchronisation

inline void __syncthreads(const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    engine_internal::block_barrier(1, "__syncthreads", file, line);
}
inline int __syncthreads_count(int predicate, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    return engine_internal::block_barrier(predicate != 0, "__syncthreads_count", file, line).count;
}
inline int __syncthreads_and(int predicate, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const engine_internal::BarrierResult r =
        engine_internal::block_barrier(predicate != 0, "__syncthreads_and", file, line);
    return r.count == r.threads;
}
inline int __syncthreads_or(int predicate, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    return engine_internal::block_barrier(predicate != 0, "__syncthreads_or", file, line).count != 0;
}

inline void __syncwarp(unsigned mask = 0xffffffffu, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const int lane = static_cast<int>(engine_internal::lane_id());
    engine_internal::warp_collective(mask, 0, lane, 0, "__syncwarp", file, line);
}

inline unsigned __activemask() { return engine_internal::warp_active_mask(); }

inline void __threadfence() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_block() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
inline void __threadfence_system() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }

// ---- Warp shuffles and votes (CUDA's lane rules for width: a segment of `width` lanes; an index outside the
// segment reads the caller's own value for up and down, the index modulo width for __shfl_sync).

template <typename T>
inline T __shfl_sync(unsigned mask, T var, int src_lane, int width = kWarpSize, const char * file = __builtin_FILE(),
                     int line = __builtin_LINE()) {
    const unsigned w    = engine_internal::shuffle_width(width);
    const unsigned lane = engine_internal::lane_id();
    const unsigned src  = (lane & ~(w - 1)) + (static_cast<unsigned>(src_lane) & (w - 1));
    return engine_internal::from_bits<T>(engine_internal::warp_collective(
        mask, engine_internal::to_bits(var), static_cast<int>(src), 0, "__shfl_sync", file, line).value);
}

template <typename T>
inline T __shfl_up_sync(unsigned mask, T var, unsigned delta, int width = kWarpSize,
                        const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const unsigned w    = engine_internal::shuffle_width(width);
    const unsigned lane = engine_internal::lane_id();
    const unsigned src  = (lane & (w - 1)) >= delta ? lane - delta : lane;
    return engine_internal::from_bits<T>(engine_internal::warp_collective(
        mask, engine_internal::to_bits(var), static_cast<int>(src), 0, "__shfl_up_sync", file, line).value);
}

template <typename T>
inline T __shfl_down_sync(unsigned mask, T var, unsigned delta, int width = kWarpSize,
                          const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const unsigned w    = engine_internal::shuffle_width(width);
    const unsigned lane = engine_internal::lane_id();
    const unsigned src  = delta < w - (lane & (w - 1)) ? lane + delta : lane;
    return engine_internal::from_bits<T>(engine_internal::warp_collective(
        mask, engine_internal::to_bits(var), static_cast<int>(src), 0, "__shfl_down_sync", file, line).value);
}

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T var, int lane_mask, int width = kWarpSize,
                         const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const unsigned w    = engine_internal::shuffle_width(width);
    const unsigned lane = engine_internal::lane_id();
    const unsigned j    = lane ^ (static_cast<unsigned>(lane_mask) & (kWarpSize - 1));
    const unsigned src  = j <= ((lane & ~(w - 1)) | (w - 1)) ? j : lane;   // PTX shfl.bfly: up to the segment's end
    return engine_internal::from_bits<T>(engine_internal::warp_collective(
        mask, engine_internal::to_bits(var), static_cast<int>(src), 0, "__shfl_xor_sync", file, line).value);
}

inline unsigned __ballot_sync(unsigned mask, int predicate, const char * file = __builtin_FILE(),
                              int line = __builtin_LINE()) {
    return engine_internal::warp_collective(mask, 0, static_cast<int>(engine_internal::lane_id()), predicate != 0,
                                            "__ballot_sync", file, line)
        .ballot;
}

inline int __any_sync(unsigned mask, int predicate, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    return engine_internal::warp_collective(mask, 0, static_cast<int>(engine_internal::lane_id()), predicate != 0,
                                            "__any_sync", file, line)
               .ballot != 0;
}

inline int __all_sync(unsigned mask, int predicate, const char * file = __builtin_FILE(), int line = __builtin_LINE()) {
    const engine_internal::WarpResult r = engine_internal::warp_collective(
        mask, 0, static_cast<int>(engine_internal::lane_id()), predicate != 0, "__all_sync", file, line);
    return r.ballot == r.group;
}

// ---- Atomics (relaxed, as CUDA's; each returns the old value)

inline int atomicAdd(int * address, int val) { return __atomic_fetch_add(address, val, __ATOMIC_RELAXED); }
inline unsigned atomicAdd(unsigned * address, unsigned val) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
}
inline unsigned long long atomicAdd(unsigned long long * address, unsigned long long val) {
    return __atomic_fetch_add(address, val, __ATOMIC_RELAXED);
}
inline float atomicAdd(float * address, float val) {
    return engine_internal::atomic_update(address, [val](float old) { return engine_internal::opaque(old + val); });
}
inline double atomicAdd(double * address, double val) {
    return engine_internal::atomic_update(address, [val](double old) { return engine_internal::opaque(old + val); });
}

inline int atomicSub(int * address, int val) { return __atomic_fetch_sub(address, val, __ATOMIC_RELAXED); }
inline unsigned atomicSub(unsigned * address, unsigned val) {
    return __atomic_fetch_sub(address, val, __ATOMIC_RELAXED);
}

#define LOOM_EMU_ATOMIC_MIN_MAX(T)                                                                               \
    inline T atomicMin(T * address, T val) {                                                                     \
        return engine_internal::atomic_update(address, [val](T old) { return val < old ? val : old; });         \
    }                                                                                                            \
    inline T atomicMax(T * address, T val) {                                                                     \
        return engine_internal::atomic_update(address, [val](T old) { return old < val ? val : old; });         \
    }
LOOM_EMU_ATOMIC_MIN_MAX(int)
LOOM_EMU_ATOMIC_MIN_MAX(unsigned)
LOOM_EMU_ATOMIC_MIN_MAX(long long)
LOOM_EMU_ATOMIC_MIN_MAX(unsigned long long)
#undef LOOM_EMU_ATOMIC_MIN_MAX

#define LOOM_EMU_ATOMIC_BITS(T)                                                                                  \
    inline T atomicAnd(T * address, T val) { return __atomic_fetch_and(address, val, __ATOMIC_RELAXED); }        \
    inline T atomicOr(T * address, T val) { return __atomic_fetch_or(address, val, __ATOMIC_RELAXED); }          \
    inline T atomicXor(T * address, T val) { return __atomic_fetch_xor(address, val, __ATOMIC_RELAXED); }        \
    inline T atomicCAS(T * address, T compare, T val) {                                                          \
        __atomic_compare_exchange_n(address, &compare, val, false, __ATOMIC_RELAXED, __ATOMIC_RELAXED);         \
        return compare;                                                                                          \
    }                                                                                                            \
    inline T atomicExch(T * address, T val) { return __atomic_exchange_n(address, val, __ATOMIC_RELAXED); }
LOOM_EMU_ATOMIC_BITS(int)
LOOM_EMU_ATOMIC_BITS(unsigned)
LOOM_EMU_ATOMIC_BITS(unsigned long long)
#undef LOOM_EMU_ATOMIC_BITS

inline float atomicExch(float * address, float val) {
    float old;
    __atomic_exchange(address, &val, &old, __ATOMIC_RELAXED);
    return old;
}

// ---- Bit casts

inline unsigned int __float_as_uint(float x) { return engine_internal::bit_cast<unsigned int>(x); }
inline float        __uint_as_float(unsigned int x) { return engine_internal::bit_cast<float>(x); }
inline int          __float_as_int(float x) { return engine_internal::bit_cast<int>(x); }
inline float        __int_as_float(int x) { return engine_internal::bit_cast<float>(x); }
inline long long    __double_as_longlong(double x) { return engine_internal::bit_cast<long long>(x); }
inline double       __longlong_as_double(long long x) { return engine_internal::bit_cast<double>(x); }

// ---- IEEE operations rounded one by one (never fused; see opaque)

namespace engine_internal {
template <typename T>
inline T add_rn(T a, T b) { return opaque(opaque(a) + opaque(b)); }
template <typename T>
inline T sub_rn(T a, T b) { return opaque(opaque(a) - opaque(b)); }
template <typename T>
inline T mul_rn(T a, T b) { return opaque(opaque(a) * opaque(b)); }
template <typename T>
inline T div_rn(T a, T b) { return opaque(opaque(a) / opaque(b)); }
template <typename T>
inline T sqrt_rn(T a) { return opaque(std::sqrt(opaque(a))); }
}  // namespace engine_internal

inline float  __fadd_rn(float a, float b) { return engine_internal::add_rn(a, b); }
inline float  __fsub_rn(float a, float b) { return engine_internal::sub_rn(a, b); }
inline float  __fmul_rn(float a, float b) { return engine_internal::mul_rn(a, b); }
inline float  __fdiv_rn(float a, float b) { return engine_internal::div_rn(a, b); }
inline float  __frcp_rn(float a) { return engine_internal::div_rn(1.0f, a); }
inline float  __fsqrt_rn(float a) { return engine_internal::sqrt_rn(a); }
inline float  __fmaf_rn(float a, float b, float c) { return std::fma(a, b, c); }
inline double __dadd_rn(double a, double b) { return engine_internal::add_rn(a, b); }
inline double __dsub_rn(double a, double b) { return engine_internal::sub_rn(a, b); }
inline double __dmul_rn(double a, double b) { return engine_internal::mul_rn(a, b); }
inline double __ddiv_rn(double a, double b) { return engine_internal::div_rn(a, b); }
inline double __drcp_rn(double a) { return engine_internal::div_rn(1.0, a); }
inline double __dsqrt_rn(double a) { return engine_internal::sqrt_rn(a); }
inline double __fma_rn(double a, double b, double c) { return std::fma(a, b, c); }

// The fast and the plain math of CUDA that <cmath> lacks. (glibc's <math.h> itself declares __expf, __logf,
// __sinf, __cosf, __powf, ... as its exact functions, so those are not redefined here.)
inline float rsqrtf(float x) { return 1.0f / std::sqrt(x); }
inline double rsqrt(double x) { return 1.0 / std::sqrt(x); }
inline float __fdividef(float a, float b) { return a / b; }
inline float __saturatef(float x) { return x >= 1.0f ? 1.0f : (x > 0.0f ? x : 0.0f); }   // NaN -> 0 as CUDA's

// ---- Integer intrinsics

inline int __popc(unsigned x) { return __builtin_popcount(x); }
inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
inline int __clz(int x) { return x == 0 ? 32 : __builtin_clz(static_cast<unsigned>(x)); }
inline int __clzll(long long x) { return x == 0 ? 64 : __builtin_clzll(static_cast<unsigned long long>(x)); }
inline int __ffs(int x) { return __builtin_ffs(x); }
inline int __ffsll(long long x) { return __builtin_ffsll(x); }
inline unsigned __brev(unsigned x) {
    x = ((x >> 1) & 0x55555555u) | ((x & 0x55555555u) << 1);
    x = ((x >> 2) & 0x33333333u) | ((x & 0x33333333u) << 2);
    x = ((x >> 4) & 0x0f0f0f0fu) | ((x & 0x0f0f0f0fu) << 4);
    x = ((x >> 8) & 0x00ff00ffu) | ((x & 0x00ff00ffu) << 8);
    return (x >> 16) | (x << 16);
}

template <typename T>
inline T __ldg(const T * address) {
    return *address;
}

// ---- min and max as CUDA's math headers declare them (plain overloads, so std::min stays unambiguous where
// both are visible).
#define LOOM_EMU_MIN_MAX(T)                                 \
    inline T min(T a, T b) { return b < a ? b : a; }       \
    inline T max(T a, T b) { return a < b ? b : a; }
LOOM_EMU_MIN_MAX(int)
LOOM_EMU_MIN_MAX(unsigned)
LOOM_EMU_MIN_MAX(long)
LOOM_EMU_MIN_MAX(unsigned long)
LOOM_EMU_MIN_MAX(long long)
LOOM_EMU_MIN_MAX(unsigned long long)
#undef LOOM_EMU_MIN_MAX
inline float min(float a, float b) { return std::fmin(a, b); }
inline float max(float a, float b) { return std::fmax(a, b); }
inline double min(double a, double b) { return std::fmin(a, b); }
inline double max(double a, double b) { return std::fmax(a, b); }

}  // namespace loom_emu
