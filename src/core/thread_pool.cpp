#include "core/thread_pool.h"

#include "core/error.h"

#include <sched.h>

#include <algorithm>
#include <atomic>
#include <condition_variable>
#include <cstdlib>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

namespace loom {

namespace {

int budget_from_environment() {
    if (const char * value = std::getenv("LOOM_NUM_THREADS")) {
        char * end = nullptr;
        long   n   = std::strtol(value, &end, 10);
        LOOM_CHECK(end != value && *end == '\0' && n >= 1 && n <= 4096,
                   "LOOM_NUM_THREADS='" << value << "' is not a thread count",
                   "set LOOM_NUM_THREADS to a positive integer, or unset it to use every available core");
        return static_cast<int>(n);
    }
    cpu_set_t set;
    if (sched_getaffinity(0, sizeof(set), &set) == 0) {
        return std::max(1, CPU_COUNT(&set));
    }
    return std::max(1u, std::thread::hardware_concurrency());
}

// The shared state of one parallel_for: chunks are claimed with an atomic counter.
struct Job {
    const std::function<void(int64_t, int64_t)> * fn;
    int64_t              n;
    int64_t              chunk;
    int64_t              num_chunks;
    std::atomic<int64_t> next{0};
    std::atomic<int64_t> done{0};
    std::mutex           mutex;
    std::condition_variable finished;
    std::exception_ptr   error;

    // Runs chunks until none is left; returns after the last chunk this thread finished.
    void work() {
        for (;;) {
            int64_t c = next.fetch_add(1);
            if (c >= num_chunks) {
                return;
            }
            int64_t begin = c * chunk;
            int64_t end   = std::min(n, begin + chunk);
            try {
                (*fn)(begin, end);
            } catch (...) {
                std::lock_guard<std::mutex> lock(mutex);
                if (!error) {
                    error = std::current_exception();
                }
            }
            if (done.fetch_add(1) + 1 == num_chunks) {
                std::lock_guard<std::mutex> lock(mutex);
                finished.notify_all();
            }
        }
    }
};

class ThreadPool {
public:
    explicit ThreadPool(int workers) {
        for (int i = 0; i < workers; ++i) {
            threads_.emplace_back([this] { loop(); });
        }
    }

    ~ThreadPool() {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            stop_ = true;
        }
        wake_.notify_all();
        for (std::thread & t : threads_) {
            t.join();
        }
    }

    int workers() const { return static_cast<int>(threads_.size()); }

    void post(std::shared_ptr<Job> job, int copies) {
        {
            std::lock_guard<std::mutex> lock(mutex_);
            for (int i = 0; i < copies; ++i) {
                queue_.push_back(job);
            }
        }
        wake_.notify_all();
    }

private:
    void loop() {
        for (;;) {
            std::shared_ptr<Job> job;
            {
                std::unique_lock<std::mutex> lock(mutex_);
                wake_.wait(lock, [this] { return stop_ || !queue_.empty(); });
                if (stop_ && queue_.empty()) {
                    return;
                }
                job = std::move(queue_.front());
                queue_.pop_front();
            }
            job->work();
        }
    }

    std::vector<std::thread>          threads_;
    std::mutex                        mutex_;
    std::condition_variable           wake_;
    std::deque<std::shared_ptr<Job>>  queue_;
    bool                              stop_ = false;
};

ThreadPool & pool() {
    static ThreadPool instance(num_threads() - 1);
    return instance;
}

}  // namespace

int num_threads() {
    static const int budget = budget_from_environment();
    return budget;
}

void parallel_for(int64_t n, int64_t grain, const std::function<void(int64_t, int64_t)> & fn) {
    if (n <= 0) {
        return;
    }
    grain               = std::max<int64_t>(1, grain);
    int64_t max_chunks  = std::max<int64_t>(1, n / grain);
    int64_t num_chunks  = std::min<int64_t>(max_chunks, num_threads());
    if (num_chunks == 1) {
        fn(0, n);
        return;
    }
    auto job        = std::make_shared<Job>();
    job->fn         = &fn;
    job->n          = n;
    job->chunk      = (n + num_chunks - 1) / num_chunks;
    job->num_chunks = (n + job->chunk - 1) / job->chunk;
    pool().post(job, static_cast<int>(std::min<int64_t>(job->num_chunks - 1, pool().workers())));
    job->work();
    {
        std::unique_lock<std::mutex> lock(job->mutex);
        job->finished.wait(lock, [&] { return job->done.load() == job->num_chunks; });
    }
    if (job->error) {
        std::rethrow_exception(job->error);
    }
}

}  // namespace loom
