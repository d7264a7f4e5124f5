// CPU streams and events.
//
// A CpuStream owns one worker thread and a FIFO of work; the worker runs the work in order. record()
// enqueues a marker that completes the event's current generation; wait() enqueues a task that blocks
// the worker until that generation has completed. Errors thrown by work are kept (the first one) and
// rethrown by synchronize(); later work still runs so that events recorded after a failure complete and
// no other stream waits forever.
//
// With synchronous = true (LOOM_SYNC_STREAMS=1) there is no worker: submit() runs the work on the calling
// thread before returning, so a program behaves as if every stream were the host.
//
// Run-ahead is bounded: submit() from the host blocks while more than `queue_depth` pieces of work wait
// (LOOM_STREAM_QUEUE_DEPTH, default 16; a GPU's launch queue is bounded the same way). Every tensor an
// enqueued kernel holds stays allocated until the kernel has run, so an unbounded queue lets the host
// enqueue a whole iteration ahead and hold every temporary of it at once: the activation peak would be set
// by the run-ahead, not by what the model keeps (a GPT step measured 2x its synchronous peak, and full
// recompute, which must free activations to save anything, saved nothing). A stream's own worker never
// blocks in submit (work that submits more work cannot deadlock on its own queue).
#pragma once

#include "core/device.h"

#include <condition_variable>
#include <cstdint>
#include <deque>
#include <exception>
#include <memory>
#include <mutex>
#include <thread>

namespace loom::cpu {

// The shared state of an event; tasks on streams hold it, so an event may die before its markers run.
struct EventState {
    std::mutex              mutex;
    std::condition_variable completed_cv;
    uint64_t                recorded  = 0;   // generations recorded so far
    uint64_t                completed = 0;   // highest generation completed

    void complete(uint64_t generation);
    void wait_for(uint64_t generation);
};

class CpuEvent : public Event {
public:
    CpuEvent() : state_(std::make_shared<EventState>()) {}
    bool query() override;
    void synchronize() override;
    const std::shared_ptr<EventState> & state() const { return state_; }

private:
    std::shared_ptr<EventState> state_;
};

class CpuStream : public Stream {
public:
    CpuStream(Device & device, std::string name, bool synchronous);
    ~CpuStream() override;

    Device &            device() override { return device_; }
    const std::string & name() const override { return name_; }
    void submit(std::function<void()> work, const char * name = __builtin_FUNCTION()) override;
    void record(Event & event) override;
    void wait(Event & event) override;
    void synchronize() override;
    bool query() override;

    bool synchronous() const { return synchronous_; }

private:
    void loop();
    void run(std::function<void()> & work);

    Device &                          device_;
    std::string                       name_;
    bool                              synchronous_;
    int64_t                           delay_us_ = 0;   // LOOM_STREAM_DELAY_US test seam
    size_t                            queue_depth_;
    std::condition_variable           space_cv_;       // the queue fell to queue_depth_
    std::mutex                        mutex_;
    std::condition_variable           work_cv_;
    std::condition_variable           idle_cv_;
    std::deque<std::function<void()>> queue_;
    uint64_t                          submitted_ = 0;
    uint64_t                          finished_  = 0;
    bool                              stop_      = false;
    std::exception_ptr                error_;
    std::thread                       worker_;
};

CpuEvent & as_cpu_event(Event & event);

}  // namespace loom::cpu
