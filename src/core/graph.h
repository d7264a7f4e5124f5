// Graph: stream work recorded once and replayed many times (a CUDA graph's contract, on every backend).
//
//   Graph g(device, "layer 3 fwd, mb 0");          // claims its pool ("graphs" unless told)
//   stream.begin_capture(g);                         // from here the stream records instead of running:
//   layer.forward(ctx, x);                           //   kernels, event records and event waits become nodes,
//   stream.end_capture();                            //   allocations come from the graph's pool
//   g.replay(stream);  g.replay(stream);             // each enqueues the nodes in order and returns at once
//
// During capture (on the capturing thread):
//   - submit/record/wait on the capturing stream append a node; nothing runs;
//   - allocations from the default and activations pools come from the graph's pool, and one from any
//     other pool is an error naming the graph (allocator.h): persistent state exists before capture;
//   - a host synchronisation of any stream, or a host wait on an event, is an error naming the graph:
//     a captured step cannot depend on the host seeing results.
//
// Replay enqueues the recorded nodes on the given stream in capture order: the same kernels on the same
// addresses ("baked in"): a replay reads whatever its input tensors hold at the time it runs, so callers
// copy new inputs into the captured tensors (not new tensors) before replaying. The nodes hold the tensors
// they were given, so every block a graph touched stays allocated while the graph lives; the graph's
// claim on its pool makes empty_cache of that pool an error until then. Several graphs share one pool.
#pragma once

#include "core/device.h"

#include <functional>
#include <string>
#include <vector>

namespace loom {

inline constexpr const char * kGraphPool = "graphs";

class Graph {
public:
    Graph(Device & device, std::string name, std::string pool = kGraphPool);
    ~Graph();
    Graph(const Graph &)             = delete;
    Graph & operator=(const Graph &) = delete;

    const std::string & name() const { return name_; }
    const std::string & pool() const { return pool_; }
    size_t              num_nodes() const { return nodes_.size(); }
    bool                captured() const { return captured_; }

    // Enqueues every node on `stream` in capture order; returns without waiting for them.
    void replay(Stream & stream) const;

    // The capturing stream's side (Stream::begin_capture/end_capture and the backends' record paths).
    void add_work(std::function<void()> work);
    void add_record(Event & event);
    void add_wait(Event & event);
    void mark_captured() { captured_ = true; }

private:
    struct Node {
        enum class Kind { work, record, wait } kind;
        std::function<void()> work;    // kind work
        Event *               event;   // kind record / wait: the caller keeps it alive while the graph lives
    };

    Device &          device_;
    std::string       name_, pool_;
    std::vector<Node> nodes_;
    bool              captured_ = false;
};

// The graph the calling thread is capturing (null: none): host waits check it to refuse.
Graph * graph_being_captured();
// Throws naming the graph when the calling thread is capturing; `what` names the forbidden call.
void    check_not_capturing(const char * what);

}  // namespace loom
