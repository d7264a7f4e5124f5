// CPU streams and events: asynchrony, order, cross-stream waits (and proof that dropping the wait
// breaks the result), event semantics, error propagation, synchronous mode.
#include "backend/cpu/cpu_device.h"
#include "backend/cpu/cpu_stream.h"

#include "core/profiler.h"
#include "stream_gate.h"

#include <nlohmann/json.hpp>

#include <gtest/gtest.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <future>
#include <map>
#include <set>
#include <thread>
#include <vector>

using namespace loom;
using namespace std::chrono_literals;

namespace {

using loom::testing::Gate;

}  // namespace

TEST(Stream, RunsAsynchronouslyAndInOrder) {
    auto               stream = cpu::device().stream_create("s");
    Gate               gate;
    std::vector<int>   seen;
    stream->submit([&] { gate.pass(); });
    for (int i = 0; i < 10; ++i) {   // fewer than the queue's depth: the host does not block
        stream->submit([&seen, i] { seen.push_back(i); });
    }
    // The host got here while the stream is still blocked at the gate.
    EXPECT_FALSE(stream->query());
    EXPECT_TRUE(seen.empty());
    gate.open();
    stream->synchronize();
    EXPECT_TRUE(stream->query());
    ASSERT_EQ(seen.size(), 10u);
    for (int i = 0; i < 10; ++i) {
        EXPECT_EQ(seen[i], i);
    }
}

// The host runs at most LOOM_STREAM_QUEUE_DEPTH pieces of work ahead of a stream: with the stream held at
// a gate, a submitting thread returns from exactly 4 submits and blocks in the fifth until the gate opens.
TEST(Stream, HostRunAheadIsBoundedByTheQueueDepth) {
    setenv("LOOM_STREAM_QUEUE_DEPTH", "4", 1);
    auto stream = cpu::device().stream_create("bounded");
    unsetenv("LOOM_STREAM_QUEUE_DEPTH");
    Gate             gate;
    std::atomic<int> returned{0};
    std::promise<void> running;
    stream->submit([&] { running.set_value(); gate.pass(); });
    running.get_future().wait();   // the gate's work left the queue: it is empty again
    std::thread producer([&] {
        for (int i = 0; i < 10; ++i) {
            stream->submit([] {});
            ++returned;
        }
    });
    std::this_thread::sleep_for(200ms);
    EXPECT_EQ(returned.load(), 4) << "four submits fill the queue, the fifth waits for room";
    gate.open();
    producer.join();
    stream->synchronize();
    EXPECT_EQ(returned.load(), 10);
}

TEST(Stream, TwoStreamsRunConcurrently) {
    auto a = cpu::device().stream_create("a");
    auto b = cpu::device().stream_create("b");
    // a blocks until b has run: only possible if they do not share one queue.
    Gate b_ran;
    std::atomic<bool> a_done{false};
    a->submit([&] { b_ran.pass(); a_done = true; });
    b->submit([&] { b_ran.open(); });
    a->synchronize();
    b->synchronize();
    EXPECT_TRUE(a_done);
}

// Stream A writes a buffer, stream B reads it. With B waiting on an event recorded after the write, B
// must see the written value; the control below shows that without the wait B reads the old value, so
// this test fails if the wait is dropped.
TEST(Stream, EventWaitOrdersWorkAcrossStreams) {
    auto  a = cpu::device().stream_create("producer");
    auto  b = cpu::device().stream_create("consumer");
    auto  e = cpu::device().event_create();
    Gate  gate;
    int   buffer = 0;
    int   read   = -1;
    a->submit([&] { gate.pass(); buffer = 42; });
    a->record(*e);
    b->wait(*e);
    b->submit([&] { read = buffer; });

    std::this_thread::sleep_for(20ms);
    EXPECT_FALSE(b->query()) << "the consumer must still be waiting for the producer's event";
    EXPECT_FALSE(e->query());
    gate.open();
    b->synchronize();
    EXPECT_EQ(read, 42);
    EXPECT_TRUE(e->query());
    a->synchronize();
}

TEST(Stream, WithoutTheEventWaitTheConsumerReadsStaleData) {
    auto a = cpu::device().stream_create("producer");
    auto b = cpu::device().stream_create("consumer");
    Gate gate;
    int  buffer = 0;
    int  read   = -1;
    a->submit([&] { gate.pass(); buffer = 42; });
    b->submit([&] { read = buffer; });   // no wait: runs at once
    b->synchronize();
    EXPECT_EQ(read, 0) << "control: the read raced ahead of the write, as a dropped wait would";
    gate.open();
    a->synchronize();
}

TEST(Event, FollowsTheLatestRecordAndNeverRecordedIsComplete) {
    auto s = cpu::device().stream_create("s");
    auto e = cpu::device().event_create();
    EXPECT_TRUE(e->query()) << "an event never recorded is complete";
    e->synchronize();

    Gate first, second;
    s->submit([&] { first.pass(); });
    s->record(*e);
    s->submit([&] { second.pass(); });
    EXPECT_FALSE(e->query());
    first.open();
    e->synchronize();   // returns once the first record is reached
    EXPECT_TRUE(e->query());
    s->record(*e);      // re-record: now refers to after `second`
    EXPECT_FALSE(e->query());
    second.open();
    e->synchronize();
    EXPECT_TRUE(e->query());
    s->synchronize();
}

TEST(Event, AWaitRefersToTheRecordBeforeIt) {
    auto a = cpu::device().stream_create("a");
    auto b = cpu::device().stream_create("b");
    auto e = cpu::device().event_create();
    Gate hold;
    a->record(*e);          // generation 1: completes at once
    e->synchronize();
    b->wait(*e);            // waits for generation 1 only
    std::atomic<bool> b_ran{false};
    b->submit([&] { b_ran = true; });
    a->submit([&] { hold.pass(); });
    a->record(*e);          // generation 2, blocked; must not hold b back
    b->synchronize();
    EXPECT_TRUE(b_ran);
    hold.open();
    a->synchronize();
}

TEST(Stream, ErrorsSurfaceAtSynchronizeAndLaterWorkStillRuns) {
    auto s = cpu::device().stream_create("s");
    auto e = cpu::device().event_create();
    std::atomic<bool> later{false};
    s->submit([] { throw std::runtime_error("kernel failed"); });
    s->submit([&] { later = true; });
    s->record(*e);
    e->synchronize();   // events after a failure still complete
    EXPECT_TRUE(later);
    EXPECT_THROW(s->synchronize(), std::runtime_error);
    EXPECT_NO_THROW(s->synchronize()) << "the error is reported once";
}

TEST(Stream, SynchronousModeRunsOnTheSubmittingThread) {
    cpu::CpuStream s(cpu::device(), "sync", /*synchronous=*/true);
    std::thread::id ran_on;
    int             value = 0;
    s.submit([&] { ran_on = std::this_thread::get_id(); value = 1; });
    EXPECT_EQ(ran_on, std::this_thread::get_id());
    EXPECT_EQ(value, 1) << "synchronous work has run when submit returns";
    EXPECT_TRUE(s.query());
}

TEST(Stream, SyncStreamsEnvironmentVariableIsRead) {
    setenv("LOOM_SYNC_STREAMS", "1", 1);
    EXPECT_TRUE(streams_synchronous_from_env());
    setenv("LOOM_SYNC_STREAMS", "0", 1);
    EXPECT_FALSE(streams_synchronous_from_env());
    unsetenv("LOOM_SYNC_STREAMS");
    EXPECT_FALSE(streams_synchronous_from_env());
}

TEST(Stream, ManyProducersAndConsumersStayOrderedByEvents) {
    // A chain over four streams: each adds to a shared counter after waiting for the previous step's
    // event. Any dropped or misordered wait breaks the exact final sequence.
    constexpr int kSteps = 400;
    std::vector<std::unique_ptr<Stream>> streams;
    for (int i = 0; i < 4; ++i) {
        streams.push_back(cpu::device().stream_create("chain" + std::to_string(i)));
    }
    std::vector<std::unique_ptr<Event>> events;
    for (int i = 0; i < kSteps; ++i) {
        events.push_back(cpu::device().event_create());
    }
    std::vector<int> log;
    for (int i = 0; i < kSteps; ++i) {
        Stream & s = *streams[i % 4];
        if (i > 0) {
            s.wait(*events[i - 1]);
        }
        s.submit([&log, i] { log.push_back(i); });
        s.record(*events[i]);
    }
    for (auto & s : streams) {
        s->synchronize();
    }
    ASSERT_EQ(log.size(), static_cast<size_t>(kSteps));
    for (int i = 0; i < kSteps; ++i) {
        EXPECT_EQ(log[i], i);
    }
}

// --profile's timeline (core/profiler.h): while a profile is taken, every piece of work a stream runs is
// one event on that stream, named by its submitter (the calling function by default), the event records
// and waits included; the events of one stream do not overlap and follow submission order; nothing is
// recorded outside start()..stop(); the Chrome trace names each stream's thread.
TEST(Profiler, EveryPieceOfWorkIsOneEventOnItsStreamAndTheTraceNamesTheStreams) {
    auto a = cpu::device().stream_create("alpha-stream");
    auto b = cpu::device().stream_create("beta-stream");
    auto e = cpu::device().event_create();
    a->submit([] {}, "before");   // not profiled
    a->synchronize();
    Profiler::start();
    for (int i = 0; i < 5; ++i) a->submit([] { std::this_thread::sleep_for(1ms); }, "alpha");
    a->record(*e);
    b->wait(*e);
    for (int i = 0; i < 3; ++i) b->submit([] {}, "beta");
    b->submit([] {});   // named after this function
    a->synchronize();
    b->synchronize();
    const std::vector<TraceEvent> events = Profiler::stop();
    a->submit([] {}, "after");   // not profiled
    a->synchronize();

    auto count = [&](const std::string & stream, const std::string & name) {
        return std::count_if(events.begin(), events.end(),
                             [&](const TraceEvent & x) { return x.stream == stream && x.name == name; });
    };
    EXPECT_EQ(count("alpha-stream", "alpha"), 5);
    EXPECT_EQ(count("alpha-stream", "record"), 1);
    EXPECT_EQ(count("beta-stream", "wait"), 1);
    EXPECT_EQ(count("beta-stream", "beta"), 3);
    EXPECT_EQ(count("beta-stream", "TestBody"), 1);
    EXPECT_EQ(events.size(), 11u) << "nothing else, nothing before start() or after stop()";
    for (const std::string stream : {"alpha-stream", "beta-stream"}) {
        int64_t end = -1;
        for (const TraceEvent & x : events) {
            if (x.stream != stream) continue;
            EXPECT_LE(x.begin_us, x.end_us);
            EXPECT_GE(x.begin_us, end) << stream << ": one piece of work at a time, in order";
            end = x.end_us;
        }
    }
    const int64_t slept = std::count_if(events.begin(), events.end(), [](const TraceEvent & x) {
        return x.name == "alpha" && x.end_us - x.begin_us >= 1000;
    });
    EXPECT_EQ(slept, 5) << "each event spans its work";

    const nlohmann::json trace = nlohmann::json::parse(chrome_trace_json(events, 3, "cpu:0", "test"));
    std::map<int, std::string> threads;
    int64_t                    complete = 0;
    for (const nlohmann::json & x : trace["traceEvents"]) {
        EXPECT_EQ(x["pid"], 3);
        if (x["ph"] == "M" && x["name"] == "thread_name") threads[x["tid"].get<int>()] = x["args"]["name"];
        if (x["ph"] == "X") ++complete;
    }
    EXPECT_EQ(complete, 11);
    ASSERT_EQ(threads.size(), 2u);
    std::set<std::string> names;
    for (const auto & [tid, name] : threads) names.insert(name);
    EXPECT_EQ(names, (std::set<std::string>{"alpha-stream", "beta-stream"}));
}
