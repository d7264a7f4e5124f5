// Graph capture and replay on the CPU backend (core/graph.h): nothing runs while capturing; a replay
// enqueues the nodes in order and returns before they run; the captured addresses are baked in (a replay
// reads what its tensors hold then); allocations go to the graph's pool, and every forbidden call (a host
// synchronize, a host event wait, an allocation from a persistent pool) is an error naming the graph.
#include "backend/cpu/cpu_device.h"
#include "core/graph.h"
#include "core/ops.h"
#include "core/tensor.h"
#include "error_text.h"

#include "stream_gate.h"

#include <gtest/gtest.h>

#include <future>
#include <memory>
#include <string>
#include <vector>

using namespace loom;

namespace {

Device & dev() { return cpu::device(); }

using loom::testing::Gate;

}  // namespace

TEST(Graph, NothingRunsDuringCaptureAndReplayRunsTheNodesInOrderAsynchronously) {
    auto             stream = dev().stream_create("capture");
    std::vector<int> seen;
    Graph            graph(dev(), "five nodes");
    stream->begin_capture(graph);
    for (int i = 0; i < 5; ++i) stream->submit([&seen, i] { seen.push_back(i); });
    stream->end_capture();
    EXPECT_EQ(graph.num_nodes(), 5u);
    stream->synchronize();
    EXPECT_TRUE(seen.empty()) << "captured work does not run";

    Gate gate;
    stream->submit([&] { gate.pass(); });
    graph.replay(*stream);
    graph.replay(*stream);
    EXPECT_TRUE(seen.empty()) << "replay returns before its nodes run";
    gate.open();
    stream->synchronize();
    EXPECT_EQ(seen, (std::vector<int>{0, 1, 2, 3, 4, 0, 1, 2, 3, 4}));
}

// Captured: y = 2 (x + x) through a temporary allocated during capture. Each replay reads the values x
// holds when it runs, through the addresses captured, and the temporary lives in the graph's pool.
TEST(Graph, AddressesAreBakedInAndCapturedAllocationsComeFromTheGraphPool) {
    Stream & stream = dev().compute_stream();
    Ops &    ops    = dev().ops();
    Tensor   x      = Tensor::empty({4, 8}, DType::f32, dev());
    Tensor   y      = Tensor::empty({4, 8}, DType::f32, dev());
    const int64_t before = dev().allocator().pool_stats("baked").allocated;
    Graph    graph(dev(), "y = 2 (x + x)", "baked");
    void *   temporary = nullptr;
    {
        stream.begin_capture(graph);
        Tensor t = Tensor::empty({4, 8}, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        temporary = t.data_ptr();
        ops.copy(stream, x, t);
        ops.add_inplace(stream, t, x);
        ops.scale(stream, t, 2.0f);
        ops.copy(stream, t, y);
        stream.end_capture();
        EXPECT_EQ(dev().allocator().pool_stats("baked").allocated - before, 4 * 8 * 4) << "t came from the graph's pool";
        EXPECT_EQ(dev().allocator().pool_stats("baked").active, 1) << "the host still holds t";
        EXPECT_EQ(Graph::collect(dev(), "baked"), 0u);
    }   // the host lets go of t: only the graph refers to it, so its block goes back to the pool
    EXPECT_EQ(Graph::collect(dev(), "baked"), 1u);
    EXPECT_EQ(dev().allocator().pool_stats("baked").allocated, before);
    EXPECT_EQ(dev().allocator().pool_stats("baked").active, 0);
    for (float base : {1.0f, -3.5f}) {
        for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = base + static_cast<float>(i);
        graph.replay(stream);
        stream.synchronize();
        for (int64_t i = 0; i < y.numel(); ++i) ASSERT_EQ(y.data<float>()[i], 4.0f * (base + static_cast<float>(i)));
    }
    EXPECT_NE(temporary, nullptr);
}

TEST(Graph, ForbiddenCallsDuringCaptureAreErrorsNamingTheGraph) {
    Stream &               stream = dev().compute_stream();
    std::unique_ptr<Event> event  = dev().event_create();
    Graph                  graph(dev(), "layer 3 forward, micro-batch 0");
    stream.begin_capture(graph);
    const std::string sync = error_of([&] { stream.synchronize(); });
    EXPECT_NE(sync.find("a synchronize of stream 'compute' while capturing graph 'layer 3 forward, micro-batch 0'"),
              std::string::npos) << sync;
    auto other = dev().stream_create("other");
    EXPECT_NE(error_of([&] { other->synchronize(); }).find("while capturing graph 'layer 3"), std::string::npos);
    stream.record(*event);   // recorded into the graph, not run
    EXPECT_NE(error_of([&] { event->synchronize(); }).find("a host wait on an event while capturing graph"),
              std::string::npos);
    const std::string alloc = error_of([&] { Tensor::empty({16}, DType::f32, dev(), {MemoryKind::device, "params"}); });
    EXPECT_NE(alloc.find("from pool 'params'"), std::string::npos) << alloc;
    EXPECT_NE(alloc.find("while capturing graph 'layer 3 forward, micro-batch 0'"), std::string::npos) << alloc;
    Graph nested(dev(), "nested");
    EXPECT_NE(error_of([&] { other->begin_capture(nested); }).find("while graph 'layer 3"), std::string::npos);
    stream.end_capture();
    EXPECT_EQ(graph.num_nodes(), 1u) << "the event record";
    // After capture every call is allowed again; the other thread was never capturing.
    EXPECT_NO_THROW(stream.synchronize());
    EXPECT_NO_THROW(Tensor::empty({16}, DType::f32, dev(), {MemoryKind::device, "params"}));
    EXPECT_NE(error_of([&] { stream.begin_capture(graph); }).find("is captured again"), std::string::npos);
}

TEST(Graph, EmptyCacheOfAPoolWithLiveGraphsIsRefused) {
    Allocator & allocator = dev().allocator();
    {
        Graph graph(dev(), "holder", "held pool");
        EXPECT_NE(error_of([&] { allocator.empty_cache("held pool"); }).find("which 1 live graph(s) hold"),
                  std::string::npos);
        EXPECT_NO_THROW(allocator.empty_cache());   // passes over the held pool
    }
    EXPECT_NO_THROW(allocator.empty_cache("held pool"));
}

// Two graphs in one pool, captured in their replay order: a block the first graph's capture let go of is
// handed to the second (its temporary, and its output once the host stops reading it at capture time),
// and replaying both in that order still computes both results, because each replay is done with the
// block before the next overwrites it. A block the host still holds is not reused.
TEST(Graph, TwoGraphsInOnePoolReuseFreedBlocksAndReplayInCaptureOrder) {
    Stream &      stream = dev().compute_stream();
    Ops &         ops    = dev().ops();
    const Shape   shape{8, 16};
    Tensor        x = Tensor::empty(shape, DType::f32, dev()), y1 = Tensor::empty(shape, DType::f32, dev());
    Tensor        y2 = Tensor::empty(shape, DType::f32, dev());
    Graph         first(dev(), "first", "reuse"), second(dev(), "second", "reuse");
    Allocator &   allocator = dev().allocator();
    const int64_t before    = allocator.pool_stats("reuse").allocated;
    void *        first_temporary = nullptr;
    void *        kept            = nullptr;
    Tensor        keep;   // allocated in the first capture and still held by the host
    stream.begin_capture(first);
    {
        Tensor t = Tensor::empty(shape, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        keep     = Tensor::empty(shape, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        first_temporary = t.data_ptr();
        kept            = keep.data_ptr();
        ops.copy(stream, x, t);
        ops.scale(stream, t, 3.0f);   // t = 3x
        ops.copy(stream, t, y1);
        ops.fill_zero(stream, keep);
    }
    stream.end_capture();   // t is dropped: its block goes back to the pool
    EXPECT_EQ(allocator.pool_stats("reuse").allocated - before, 8 * 16 * 4) << "only `keep` stays allocated";
    stream.begin_capture(second);
    {
        Tensor t = Tensor::empty(shape, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        Tensor u = Tensor::empty(shape, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        EXPECT_EQ(t.data_ptr(), first_temporary) << "the first graph's temporary block is handed out again";
        EXPECT_NE(u.data_ptr(), kept) << "a block the host holds is not";
        ops.copy(stream, x, t);
        ops.add_inplace(stream, t, x);   // t = 2x
        ops.copy(stream, t, y2);
    }
    stream.end_capture();
    for (float base : {0.5f, 7.0f}) {
        for (int64_t i = 0; i < x.numel(); ++i) x.data<float>()[i] = base + static_cast<float>(i);
        first.replay(stream);
        second.replay(stream);
        stream.synchronize();
        for (int64_t i = 0; i < x.numel(); ++i) {
            ASSERT_EQ(y1.data<float>()[i], 3.0f * x.data<float>()[i]);
            ASSERT_EQ(y2.data<float>()[i], 2.0f * x.data<float>()[i]);
        }
    }
    keep = Tensor();
    EXPECT_EQ(Graph::collect(dev(), "reuse"), 1u);
    EXPECT_EQ(allocator.pool_stats("reuse").allocated, before);
}

// A held output is reachable after the capture without counting as the host's; a replayable node's host
// side runs again at every replay.
TEST(Graph, HeldOutputsAndReplayableNodes) {
    Stream & stream = dev().compute_stream();
    Graph    graph(dev(), "held", "held-pool");
    int      prepared = 0, ran = 0;
    size_t   index    = 0;
    void *   address  = nullptr;
    stream.begin_capture(graph);
    {
        Tensor out = Tensor::empty({4}, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        address    = out.data_ptr();
        dev().ops().fill_zero(stream, out);
        stream.submit_replayable([&]() -> std::function<void()> {
            ++prepared;
            return [&] { ++ran; };
        });
        index = graph.hold(out);
    }
    stream.end_capture();
    EXPECT_EQ(prepared, 0) << "nothing is prepared during capture";
    EXPECT_EQ(graph.held(index).data_ptr(), address);
    EXPECT_TRUE(graph.held(index).storage()->block_released()) << "only the graph holds it";
    graph.replay(stream);
    graph.replay(stream);
    EXPECT_EQ(prepared, 2) << "prepared on the host at each replay";
    stream.synchronize();
    EXPECT_EQ(ran, 2);
    stream.submit_replayable([&]() -> std::function<void()> { return [&] { ++ran; }; });
    stream.synchronize();
    EXPECT_EQ(ran, 3) << "without capture it runs at once";
}

namespace {

// A run of work a "native" backend captured: replayed as one node, by submitting its work in order.
class FakeSegment final : public CapturedSegment {
public:
    explicit FakeSegment(std::vector<std::function<void()>> work) : work_(std::move(work)) {}
    void replay(Stream & stream) const override {
        for (const std::function<void()> & w : work_) stream.submit(w);
    }

private:
    std::vector<std::function<void()>> work_;
};

// A stream that captures the way the CUDA backend does (through core's native_capture_* hooks), over a CPU
// stream: work submitted while its native capture is on collects into a segment, which it hands to the graph
// when the capture ends or a replayable node splits it. The tensors a submit names are kept by the graph.
class SegmentingStream final : public Stream {
public:
    explicit SegmentingStream(Device & device) : inner_(device.stream_create("segmenting")) {}

    Device &            device() override { return inner_->device(); }
    const std::string & name() const override { return inner_->name(); }
    void                submit(std::function<void()> work, const char * name = __builtin_FUNCTION()) override {
        if (native_) {
            pending_.push_back(std::move(work));
        } else {
            inner_->submit(std::move(work), name);
        }
    }
    void submit_using(std::function<void()> work, std::vector<Tensor> tensors) {
        if (native_) capture()->keep(std::move(tensors));
        submit(std::move(work));
    }
    void record(Event & event) override { inner_->record(event); }
    void wait(Event & event) override { inner_->wait(event); }
    void synchronize() override { inner_->synchronize(); }
    bool query() override { return inner_->query(); }

    int begins = 0, ends = 0;

protected:
    void native_capture_begin() override {
        ++begins;
        native_ = true;
    }
    void native_capture_end(Graph & graph) override {
        ++ends;
        native_ = false;
        graph.add_segment(std::make_shared<FakeSegment>(std::move(pending_)));
        pending_.clear();
    }

private:
    std::unique_ptr<Stream>            inner_;
    bool                               native_ = false;
    std::vector<std::function<void()>> pending_;
};

}  // namespace

// The path the CUDA backend takes through core, run on the CPU: segment, replayable, segment in capture
// order; each replay runs them in that order with prepare between; what the segments keep is counted as
// the graph's, so a block only they refer to is released at end_capture like a node's.
TEST(Graph, NativeCaptureSegmentsAReplayableNodeSplitsReplayInCaptureOrder) {
    SegmentingStream         stream(dev());
    std::vector<std::string> log;   // written on the stream's worker, read after synchronize
    int                      prepared = 0;
    void *                   address  = nullptr;
    Graph                    graph(dev(), "segmented", "segmented-pool");
    stream.begin_capture(graph);
    EXPECT_EQ(stream.begins, 1);
    {
        Tensor temporary = Tensor::empty({16}, DType::f32, dev(), {MemoryKind::device, kActivationsPool});
        address          = temporary.data_ptr();
        stream.submit_using([&log] { log.push_back("a"); }, {temporary});
        stream.submit([&log] { log.push_back("b"); });
        stream.submit_replayable([&]() -> std::function<void()> {
            ++prepared;
            return [&log] { log.push_back("r"); };
        });
        EXPECT_EQ(stream.ends, 1) << "the replayable node ended the first segment";
        EXPECT_EQ(stream.begins, 2) << "and began the next";
        stream.submit([&log] { log.push_back("c"); });
    }   // the host drops the temporary: only the graph keeps it
    stream.end_capture();
    EXPECT_EQ(stream.ends, 2);
    EXPECT_EQ(graph.num_nodes(), 3u);
    EXPECT_EQ(graph.num_segments(), 2u);
    EXPECT_EQ(graph.num_replayable_nodes(), 1u);
    EXPECT_EQ(dev().allocator().pool_stats("segmented-pool").allocated, 0)
        << "the kept temporary's block went back to the pool's free list at end_capture";
    stream.synchronize();
    EXPECT_TRUE(log.empty()) << "nothing runs during capture";
    graph.replay(stream);
    graph.replay(stream);
    stream.synchronize();
    EXPECT_EQ(prepared, 2);
    EXPECT_EQ(log, (std::vector<std::string>{"a", "b", "r", "c", "a", "b", "r", "c"}));
    Tensor again = Tensor::empty({16}, DType::f32, dev(), {MemoryKind::device, "segmented-pool"});
    EXPECT_EQ(again.data_ptr(), address) << "the released block is the pool's to hand out again";
}
