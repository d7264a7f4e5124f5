#include "core/graph.h"

#include "core/error.h"
#include "core/tensor.h"

#include <algorithm>
#include <exception>
#include <mutex>

namespace loom {

namespace {

thread_local Graph * t_capturing = nullptr;

// Every live graph, for collect(): graphs are made and destroyed on host threads.
std::mutex             g_registry_mutex;
std::vector<Graph *> & registry() {
    static std::vector<Graph *> graphs;
    return graphs;
}

}  // namespace

Graph * graph_being_captured() { return t_capturing; }

void check_not_capturing(const char * what) {
    LOOM_CHECK(t_capturing == nullptr, what << " while capturing graph '" << t_capturing->name() << "'",
               "a captured step must not wait on the host: read results after end_capture(), from a replay");
}

Graph::Graph(Device & device, std::string name, std::string pool)
    : device_(device), name_(std::move(name)), pool_(std::move(pool)) {
    device_.allocator(MemoryKind::device).claim_for_graph(pool_);
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    registry().push_back(this);
}

Graph::~Graph() {
    {
        std::lock_guard<std::mutex> lock(g_registry_mutex);
        std::erase(registry(), this);
    }
    // The nodes' tensors go back to the pool before the claim is released. Segments go first (a CUDA
    // segment waits for its last replay to finish), then what their work used.
    nodes_.clear();
    kept_work_.clear();
    kept_.clear();
    held_.clear();
    device_.allocator(MemoryKind::device).release_graph_claim(pool_);
}

void Graph::add_work(std::function<void()> work) {
    nodes_.push_back(Node{Node::Kind::work, std::move(work), nullptr, {}, nullptr, nullptr});
}
void Graph::add_replayable(Prepare prepare, std::string label) {
    nodes_.push_back(Node{Node::Kind::replayable, nullptr, std::move(prepare), std::move(label), nullptr, nullptr});
}
void Graph::add_record(Event & event) { nodes_.push_back(Node{Node::Kind::record, nullptr, nullptr, {}, &event, nullptr}); }
void Graph::add_wait(Event & event) { nodes_.push_back(Node{Node::Kind::wait, nullptr, nullptr, {}, &event, nullptr}); }
void Graph::add_segment(std::shared_ptr<CapturedSegment> segment) {
    nodes_.push_back(Node{Node::Kind::segment, nullptr, nullptr, {}, nullptr, std::move(segment)});
}

void Graph::keep(std::vector<Tensor> tensors) {
    for (Tensor & t : tensors) {
        if (t.defined()) kept_.push_back(std::move(t));
    }
}

std::function<void()> & Graph::keep_work(std::function<void()> work) {
    kept_work_.push_back(std::move(work));
    return kept_work_.back();
}

size_t Graph::num_segments() const {
    return static_cast<size_t>(
        std::count_if(nodes_.begin(), nodes_.end(), [](const Node & n) { return n.kind == Node::Kind::segment; }));
}

size_t Graph::num_replayable_nodes(const std::string & label) const {
    return static_cast<size_t>(std::count_if(nodes_.begin(), nodes_.end(), [&](const Node & n) {
        return n.kind == Node::Kind::replayable && (label.empty() || n.label == label);
    }));
}

void Graph::note_allocation(const std::shared_ptr<Storage> & storage) { allocations_.push_back(storage); }

size_t Graph::hold(const Tensor & t) {
    held_.push_back(t);
    return held_.size() - 1;
}

const Tensor & Graph::held(size_t index) const {
    LOOM_CHECK(index < held_.size(), "output " << index << " of graph '" << name_ << "', which holds " << held_.size(), "");
    return held_[index];
}

size_t Graph::collect(Device & device, const std::string & pool) {
    std::lock_guard<std::mutex> lock(g_registry_mutex);
    std::vector<Graph *> graphs;
    for (Graph * g : registry()) {
        if (&g->device_ == &device && g->pool_ == pool) graphs.push_back(g);
    }
    // The candidates: blocks captured into the pool and not yet released.
    std::vector<std::shared_ptr<Storage>> candidates;
    for (Graph * g : graphs) {
        std::erase_if(g->allocations_, [&](const std::weak_ptr<Storage> & weak) {
            std::shared_ptr<Storage> storage = weak.lock();
            if (!storage || storage->block_released()) return true;
            candidates.push_back(std::move(storage));
            return false;
        });
    }
    if (candidates.empty()) return 0;
    // How many references the graphs hold to each: copying every node and held tensor adds exactly that
    // many. What is left after our own and the graphs' references belongs to the host. (A stream worker
    // dropping a reference meanwhile can only make the host's count look larger: nothing is released early.)
    std::vector<long> before(candidates.size()), graph_refs(candidates.size());
    for (size_t i = 0; i < candidates.size(); ++i) before[i] = candidates[i].use_count();
    {
        std::vector<std::vector<Node>>                   node_copies;
        std::vector<std::vector<Tensor>>                 held_copies;
        std::vector<std::deque<std::function<void()>>>   work_copies;
        for (Graph * g : graphs) {
            node_copies.push_back(g->nodes_);
            held_copies.push_back(g->held_);
            held_copies.push_back(g->kept_);
            work_copies.push_back(g->kept_work_);
        }
        for (size_t i = 0; i < candidates.size(); ++i) graph_refs[i] = candidates[i].use_count() - before[i];
    }
    size_t released = 0;
    for (size_t i = 0; i < candidates.size(); ++i) {
        if (before[i] - 1 - graph_refs[i] == 0) {
            candidates[i]->release_block();
            ++released;
        }
    }
    return released;
}

void Graph::replay(Stream & stream) const {
    LOOM_CHECK(captured_, "replay of graph '" << name_ << "', which has not been captured",
               "capture it first: stream.begin_capture(graph), the work, stream.end_capture()");
    LOOM_CHECK(stream.capture() == nullptr, "replay of graph '" << name_ << "' into a stream that is capturing graph '"
                                                                << stream.capture()->name() << "'",
               "graphs do not nest: replay after end_capture()");
    for (const Node & node : nodes_) {
        switch (node.kind) {
            case Node::Kind::work: stream.submit(node.work); break;
            case Node::Kind::replayable: stream.submit(node.prepare()); break;
            case Node::Kind::record: stream.record(*node.event); break;
            case Node::Kind::wait: stream.wait(*node.event); break;
            case Node::Kind::segment: node.segment->replay(stream); break;
        }
    }
}

void Stream::begin_capture(Graph & graph) {
    LOOM_CHECK(capture_ == nullptr && t_capturing == nullptr,
               "capture of graph '" << graph.name() << "' begun on stream '" << name() << "' while graph '"
                                    << (capture_ ? capture_ : t_capturing)->name() << "' is being captured",
               "end one capture before beginning the next");
    LOOM_CHECK(!graph.captured(), "graph '" << graph.name() << "' is captured again", "capture into a new Graph");
    Graph::collect(device(), graph.pool());   // what earlier captures' tensors the host has let go of since
    // The backend's native capture begins before the allocator redirects this thread: what the backend
    // allocates for itself first (the CUDA stream's GEMM workspace) is persistent state, not the graph's.
    native_capture_begin();
    try {
        device().allocator(MemoryKind::device).begin_capture(graph.name(), graph.pool());
    } catch (...) {
        native_capture_abort();
        throw;
    }
    capture_    = &graph;
    t_capturing = &graph;
}

void Stream::end_capture() {
    LOOM_CHECK(capture_ != nullptr, "end_capture() on stream '" << name() << "', which is not capturing", "");
    Graph &            graph = *capture_;
    std::exception_ptr failed;
    try {
        native_capture_end(graph);   // the last segment (a backend that captures natively)
    } catch (...) {
        failed = std::current_exception();
    }
    device().allocator(MemoryKind::device).end_capture();
    capture_    = nullptr;
    t_capturing = nullptr;
    if (failed) std::rethrow_exception(failed);   // the graph stays uncaptured: replay refuses it
    graph.mark_captured();
    Graph::collect(device(), graph.pool());   // this capture's temporaries
}

void Stream::submit_replayable(std::function<std::function<void()>()> prepare, std::string label) {
    if (capture_ != nullptr) {
        native_capture_end(*capture_);   // a native capture ends into a segment before the node ...
        capture_->add_replayable(std::move(prepare), std::move(label));
        native_capture_begin();          // ... and the next segment begins after it
    } else {
        submit(prepare());
    }
}

}  // namespace loom
