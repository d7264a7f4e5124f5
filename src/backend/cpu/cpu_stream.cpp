#include "backend/cpu/cpu_stream.h"

#include "backend/cpu/gemm.h"
#include "core/error.h"
#include "core/graph.h"
#include "core/profiler.h"

#include <chrono>
#include <cstdlib>
#include <sys/prctl.h>

namespace loom::cpu {

namespace {

thread_local bool t_stream_worker = false;   // this thread runs a stream's work: it never blocks in submit

size_t queue_depth_from_env() {
    const char * value = std::getenv("LOOM_STREAM_QUEUE_DEPTH");
    if (value == nullptr || *value == '\0') return 16;
    char *     end   = nullptr;
    const long depth = std::strtol(value, &end, 10);
    LOOM_CHECK(end != value && *end == '\0' && depth >= 1, "LOOM_STREAM_QUEUE_DEPTH='" << value << "'",
               "a positive number of queued pieces of work per stream (default 16)");
    return static_cast<size_t>(depth);
}

}  // namespace

void EventState::complete(uint64_t generation) {
    {
        std::lock_guard<std::mutex> lock(mutex);
        if (generation > completed) {
            completed = generation;
        }
    }
    completed_cv.notify_all();
}

void EventState::wait_for(uint64_t generation) {
    std::unique_lock<std::mutex> lock(mutex);
    completed_cv.wait(lock, [&] { return completed >= generation; });
}

bool CpuEvent::query() {
    std::lock_guard<std::mutex> lock(state_->mutex);
    return state_->completed >= state_->recorded;
}

void CpuEvent::synchronize() {
    check_not_capturing("a host wait on an event");
    uint64_t generation;
    {
        std::lock_guard<std::mutex> lock(state_->mutex);
        generation = state_->recorded;
    }
    state_->wait_for(generation);
}

CpuEvent & as_cpu_event(Event & event) {
    auto * cpu_event = dynamic_cast<CpuEvent *>(&event);
    LOOM_CHECK(cpu_event != nullptr, "a CPU stream was given an event of another backend",
               "create events with the same device as the stream (device.event_create())");
    return *cpu_event;
}

CpuStream::CpuStream(Device & device, std::string name, bool synchronous)
    : device_(device), name_(std::move(name)), synchronous_(synchronous), delay_us_(stream_delay_us_from_env(name_)),
      queue_depth_(queue_depth_from_env()) {
    if (!synchronous_) {
        worker_ = std::thread([this] { loop(); });
    }
}

CpuStream::~CpuStream() {
    if (worker_.joinable()) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        work_cv_.notify_all();
        worker_.join();
    }
}

void CpuStream::run(std::function<void()> & work) {
    try {
        work();
    } catch (...) {
        std::lock_guard<std::mutex> lock(mutex_);
        if (!error_) {
            error_ = std::current_exception();
        }
    }
}

void CpuStream::loop() {
    flush_denormals_on_this_thread();   // kernels run here: the same floating-point mode as the compute threads
    t_stream_worker = true;
    // The stream-delay seam sleeps before each piece of work: with Linux's default timer slack (50 us) a
    // 40 us sleep lasts 150 us on a 2-core VM, 105 us with 1 ns of slack. The delay is the seam's, not the
    // timer's.
    if (delay_us_ > 0) prctl(PR_SET_TIMERSLACK, 1UL, 0UL, 0UL, 0UL);
    for (;;) {
        std::function<void()> work;
        {
            std::unique_lock<std::mutex> lock(mutex_);
            work_cv_.wait(lock, [this] { return stop_ || !queue_.empty(); });
            if (queue_.empty()) {
                return;   // stop_ and drained
            }
            work = std::move(queue_.front());
            queue_.pop_front();
        }
        space_cv_.notify_all();
        if (delay_us_ > 0) std::this_thread::sleep_for(std::chrono::microseconds(delay_us_));
        run(work);
        work = nullptr;   // the tensors it held are released before it counts as finished
        {
            std::lock_guard<std::mutex> lock(mutex_);
            ++finished_;
        }
        idle_cv_.notify_all();
    }
}

void CpuStream::submit(std::function<void()> work, const char * name) {
    if (capture_) {
        capture_->add_work(std::move(work));
        return;
    }
    if (Profiler::active()) {   // --profile: the work's span on this stream
        work = [inner = std::move(work), name, this] {
            const auto begin = std::chrono::steady_clock::now();
            inner();
            Profiler::record(name_, name, begin, std::chrono::steady_clock::now());
        };
    }
    if (synchronous_) {
        run(work);
        return;
    }
    {
        std::unique_lock<std::mutex> lock(mutex_);
        if (!t_stream_worker) space_cv_.wait(lock, [this] { return queue_.size() < queue_depth_; });
        queue_.push_back(std::move(work));
        ++submitted_;
    }
    work_cv_.notify_one();
}

void CpuStream::record(Event & event) {
    if (capture_) {
        as_cpu_event(event);   // checked now, recorded at each replay
        capture_->add_record(event);
        return;
    }
    std::shared_ptr<EventState> state = as_cpu_event(event).state();
    uint64_t                    generation;
    {
        std::lock_guard<std::mutex> lock(state->mutex);
        generation = ++state->recorded;
    }
    submit([state, generation] { state->complete(generation); });
}

void CpuStream::wait(Event & event) {
    if (capture_) {
        as_cpu_event(event);
        capture_->add_wait(event);
        return;
    }
    std::shared_ptr<EventState> state = as_cpu_event(event).state();
    uint64_t                    generation;
    {
        std::lock_guard<std::mutex> lock(state->mutex);
        generation = state->recorded;
    }
    if (generation == 0) {
        return;   // never recorded: complete
    }
    submit([state, generation] { state->wait_for(generation); });
}

void CpuStream::synchronize() {
    check_not_capturing(("a synchronize of stream '" + name_ + "'").c_str());
    std::exception_ptr error;
    {
        std::unique_lock<std::mutex> lock(mutex_);
        idle_cv_.wait(lock, [this] { return finished_ == submitted_; });
        std::swap(error, error_);
    }
    if (error) {
        std::rethrow_exception(error);
    }
}

bool CpuStream::query() {
    std::lock_guard<std::mutex> lock(mutex_);
    return finished_ == submitted_;
}

}  // namespace loom::cpu
