#include "core/graph.h"

#include "core/error.h"

namespace loom {

namespace {

thread_local Graph * t_capturing = nullptr;

}  // namespace

Graph * graph_being_captured() { return t_capturing; }

void check_not_capturing(const char * what) {
    LOOM_CHECK(t_capturing == nullptr, what << " while capturing graph '" << t_capturing->name() << "'",
               "a captured step must not wait on the host: read results after end_capture(), from a replay");
}

Graph::Graph(Device & device, std::string name, std::string pool)
    : device_(device), name_(std::move(name)), pool_(std::move(pool)) {
    device_.allocator(MemoryKind::device).claim_for_graph(pool_);
}

Graph::~Graph() { device_.allocator(MemoryKind::device).release_graph_claim(pool_); }

void Graph::add_work(std::function<void()> work) { nodes_.push_back(Node{Node::Kind::work, std::move(work), nullptr}); }
void Graph::add_record(Event & event) { nodes_.push_back(Node{Node::Kind::record, nullptr, &event}); }
void Graph::add_wait(Event & event) { nodes_.push_back(Node{Node::Kind::wait, nullptr, &event}); }

void Graph::replay(Stream & stream) const {
    LOOM_CHECK(captured_, "replay of graph '" << name_ << "', which has not been captured",
               "capture it first: stream.begin_capture(graph), the work, stream.end_capture()");
    LOOM_CHECK(stream.capture() == nullptr, "replay of graph '" << name_ << "' into a stream that is capturing graph '"
                                                                << stream.capture()->name() << "'",
               "graphs do not nest: replay after end_capture()");
    for (const Node & node : nodes_) {
        switch (node.kind) {
            case Node::Kind::work: stream.submit(node.work); break;
            case Node::Kind::record: stream.record(*node.event); break;
            case Node::Kind::wait: stream.wait(*node.event); break;
        }
    }
}

void Stream::begin_capture(Graph & graph) {
    LOOM_CHECK(capture_ == nullptr && t_capturing == nullptr,
               "capture of graph '" << graph.name() << "' begun on stream '" << name() << "' while graph '"
                                    << (capture_ ? capture_ : t_capturing)->name() << "' is being captured",
               "end one capture before beginning the next");
    LOOM_CHECK(!graph.captured(), "graph '" << graph.name() << "' is captured again", "capture into a new Graph");
    device().allocator(MemoryKind::device).begin_capture(graph.name(), graph.pool());
    capture_    = &graph;
    t_capturing = &graph;
}

void Stream::end_capture() {
    LOOM_CHECK(capture_ != nullptr, "end_capture() on stream '" << name() << "', which is not capturing", "");
    device().allocator(MemoryKind::device).end_capture();
    capture_->mark_captured();
    capture_    = nullptr;
    t_capturing = nullptr;
}

}  // namespace loom
