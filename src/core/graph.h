// Graph: stream work recorded once and replayed many times (a CUDA graph's contract, on every backend).
//
//   Graph g(device, "layer 3 fwd, mb 0");          // claims its pool ("graphs" unless told)
//   stream.begin_capture(g);                         // from here the stream records instead of running:
//   layer.forward(ctx, x);                           //   kernels, event records and event waits become nodes,
//   stream.end_capture();                            //   allocations come from the graph's pool
//   g.replay(stream);  g.replay(stream);             // each enqueues the nodes in order and returns at once
//
// During capture (on the capturing thread):
//   - submit/record/wait on the capturing stream append a node (CPU) or are captured into the current
//     segment (CUDA, see below); nothing runs;
//   - allocations from the default and activations pools come from the graph's pool, and one from any
//     other pool is an error naming the graph (allocator.h): persistent state exists before capture;
//   - a host synchronisation of any stream, or a host wait on an event, is an error naming the graph:
//     a captured step cannot depend on the host seeing results.
//
// How a backend records. The CPU backend records every submit, record and wait as a node of its own.
// A backend that captures natively (CUDA: cudaStreamBeginCapture on the stream) records runs of work
// itself and hands each run to the graph as one CapturedSegment node, which the graph replays through a
// virtual call; a replayable node ends the current segment and the next begins after it, so a graph is
// segment, replayable, segment, ... in capture order. What a segment's work uses on the host side stays
// alive with the graph: the tensors of its kernels (keep) and the closures of its host work (keep_work),
// both counted as graph references by collect(). See backend/cuda/cuda_stream.h for what CUDA captures
// and what it refuses.
//
// Replay enqueues the recorded nodes on the given stream in capture order: the same kernels on the same
// addresses ("baked in"): a replay reads whatever its input tensors hold at the time it runs, so callers
// copy new inputs into the captured tensors (not new tensors) before replaying. Work that must differ per
// replay on the host side (a collective takes a new sequence number each time) is captured as a
// replayable node: Stream::submit_replayable's `prepare` runs on the host at each replay and returns the
// work to enqueue.
//
// Memory follows a CUDA graph's private pool. The nodes hold the tensors they were given, but a block
// allocated during a capture goes back to the pool's free list as soon as only graphs refer to it (the
// host has dropped every tensor on it): collect() finds those blocks when a capture begins or ends, and
// releases them while the graphs keep the address (Storage::release_block). A later capture may be handed
// the same block, which is valid because graphs sharing a pool are replayed in the order they were
// captured: what a graph leaves in a released block is dead by the time a later graph overwrites it.
// A graph's own outputs, wanted after a replay, are kept with hold() (a reference the host does not
// count), so they too are released once the host stops using them at capture time. Every graph claims
// its pool, so empty_cache of that pool is an error until the graphs are destroyed.
#pragma once

#include "core/device.h"

#include <deque>
#include <functional>
#include <memory>
#include <string>
#include <vector>

namespace loom {

inline constexpr const char * kGraphPool = "graphs";

class Storage;
class Tensor;

// A run of captured work that a backend replays as a whole (a CUDA graph's executable). The graph owns it
// and destroys it before the tensors it kept; replay enqueues the run on `stream` and returns at once.
class CapturedSegment {
public:
    virtual ~CapturedSegment() = default;
    virtual void replay(Stream & stream) const = 0;
};

class Graph {
public:
    Graph(Device & device, std::string name, std::string pool = kGraphPool);
    ~Graph();
    Graph(const Graph &)             = delete;
    Graph & operator=(const Graph &) = delete;

    const std::string & name() const { return name_; }
    const std::string & pool() const { return pool_; }
    size_t              num_nodes() const { return nodes_.size(); }
    // The nodes re-prepared at each replay (collectives); with a label, those captured under it (the
    // communicators label theirs with the operation: "all_reduce", "all_to_all", ...).
    size_t              num_replayable_nodes(const std::string & label = "") const;
    // The backend segments among the nodes (CUDA: one per run of work between replayable nodes; CPU: 0).
    size_t              num_segments() const;
    bool                captured() const { return captured_; }

    // Enqueues every node on `stream` in capture order; returns without waiting for them.
    void replay(Stream & stream) const;

    // Keeps t with the graph (its output, read after each replay) without counting as a host reference:
    // held(index) returns it. Hold outputs before end_capture().
    size_t         hold(const Tensor & t);
    const Tensor & held(size_t index) const;

    // Releases every block captured into `pool` of `device` that only graphs refer to (see above).
    // Stream::begin_capture and end_capture call it; returns the number of blocks released.
    static size_t collect(Device & device, const std::string & pool);

    // The capturing stream's side (Stream::begin_capture/end_capture and the backends' record paths).
    using Prepare = std::function<std::function<void()>()>;
    void add_work(std::function<void()> work);
    void add_replayable(Prepare prepare, std::string label = "");
    void add_record(Event & event);
    void add_wait(Event & event);
    void add_segment(std::shared_ptr<CapturedSegment> segment);
    // What a backend's segment uses, kept for the graph's lifetime: the tensors of a captured kernel, and
    // the closure of captured host work (the reference stays valid: the backend's node points at it).
    void                    keep(std::vector<Tensor> tensors);
    std::function<void()> & keep_work(std::function<void()> work);
    void mark_captured() { captured_ = true; }
    void note_allocation(const std::shared_ptr<Storage> & storage);

private:
    struct Node {
        enum class Kind { work, replayable, record, wait, segment } kind;
        std::function<void()>            work;      // kind work
        Prepare                          prepare;   // kind replayable
        std::string                      label;     // kind replayable: what it is (num_replayable_nodes)
        Event *                          event;     // kind record / wait: the caller keeps it alive while the graph lives
        std::shared_ptr<CapturedSegment> segment;   // kind segment
    };

    Device &                            device_;
    std::string                         name_, pool_;
    std::vector<Node>                   nodes_;
    std::vector<Tensor>                 held_;
    std::vector<Tensor>                 kept_;        // the tensors of the segments' kernels
    std::deque<std::function<void()>>   kept_work_;   // the segments' host work (a deque: stable references)
    std::vector<std::weak_ptr<Storage>> allocations_;   // made during its capture, not yet released
    bool                                captured_ = false;
};

// The graph the calling thread is capturing (null: none): host waits check it to refuse.
Graph * graph_being_captured();
// Throws naming the graph when the calling thread is capturing; `what` names the forbidden call.
void    check_not_capturing(const char * what);

}  // namespace loom
