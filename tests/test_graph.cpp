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
