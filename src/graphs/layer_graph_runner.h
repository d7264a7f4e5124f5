// LayerGraphRunner: per-layer graphs of one pipeline rank's transformer layers, captured in the order the
// schedule runs them and replayed in that order (Megatron's --cuda-graph-impl transformer_engine;
// docs/design/schedules_and_graphs.md sections 2 and 6).
//
//   runner(chunks, schedule, rank, s, b)    plans (graphs/planner.h): timeline T, static input sets, ...
//   runner.capture()                        captures FWD(c, m, l) and BWD(c, m, l) for every step of T
//   executor.set_layer_graphs(&runner)      the executor's graph strategy (model::LayerRun::graph) for every
//                                           layer outside a full-recompute group; each training layer call
//                                           of chunk c becomes a replay:
//
//     forward(c, mb, l, x): m = mb mod Mc (c, mb: the executor's chunk and micro-batch, which the model passes
//                        on from its Context: the runner counts nothing); x and the batch's
//                        sample ids (the dropout masks' key) are copied into the static input set the
//                        plan gives (c, m, l) unless x already is it; FWD(c, m, l) is replayed; its output
//                        is returned (the chunk's last layer: copied out, see below)
//     backward(c, mb, l, dy): m = mb mod Mc; dy is copied
//                        into the grad-output buffer every BWD graph shares; BWD(c, m, l) is replayed;
//                        the layer's parameters are reported ready in the order its eager backward reports
//                        them, after the replay is enqueued, so DDP's bucket reductions still overlap
//
// Each replay must be the next step of T: the runtime schedule produces exactly T, and a call out of order
// is an error naming both steps, because graphs sharing a pool are only valid replayed in capture order.
//
// Memory. Static input sets (X and sample ids) and the grad-output buffers are allocated before capture
// from the "graph-static" pool; everything a layer allocates during capture comes from the "graphs" pool
// (core/graph.h): a FWD graph's saved activations stay allocated until its BWD graph has been captured, its
// temporaries and output go back to the pool when its capture ends (the output is consumed by the copy
// into the next layer's static input, which the stream runs before any later graph), so the pool's peak
// is what the eager schedule's activations peak is: L P_r layer contexts plus one layer's workspace, the
// same for every M. The chunk's last output and first input gradient are copied out into ordinary
// activations, because a point-to-point send reads them after later graphs have run.
//
// Dense partial capture (--cuda-graph-modules attn) is the same with a dense layer's head (attention and
// norm2) and tail (the MLP), which has no host read but runs eagerly as the user asked.
//
// MoE partial capture (--cuda-graph-modules attn moe_router [moe_preprocess]; section 6.6): a MoE layer's
// graphs cover its head only (TransformerLayer::forward_head: attention, norm2, the router, and with
// moe_preprocess the dispatch plan), whose outputs are fixed-size; the runner holds them as a list and knows
// nothing of what they are (the MoE layer does: MoELayer::router_outputs). After the FWD replay they are
// copied out, and the tail runs outside any graph: the host reads each expert's row count once the stream
// has computed the routing, then the dispatch, experts and combine run with the routing of this very
// micro-batch (a captured dispatch would replay the routing of the capture). Backward runs the tail first;
// its gradients of the head's outputs go into the buffers every head's BWD graph reads
// (TransformerLayer::head_grad_shapes) and the BWD graph replays. The tail's context is kept per (chunk,
// micro-batch, layer) until its backward.
//
// During capture nothing runs: parameters, main_grad and the optimizer's state are untouched, DDP's hooks
// are not called (the backward reports go to a recorder), and a collective inside a layer (tensor
// parallelism) is recorded as a replayable node that issues a fresh operation at every replay.
#pragma once

#include "core/graph.h"
#include "graphs/planner.h"
#include "model/gpt_model.h"

#include <map>
#include <memory>
#include <tuple>
#include <vector>

namespace loom::graphs {

inline constexpr const char * kGraphStaticPool = "graph-static";

// What the graphs cover: the whole layer (default; a MoE layer needs drop-and-pad), a MoE layer up to its
// router (moe_router), with the dispatch plan (moe_preprocess), or a dense layer up to norm2 (attn).
struct LayerGraphScope {
    bool moe_router     = false;   // MoE layers captured up to their router; dense layers beside them whole
    bool moe_preprocess = false;
    bool attn           = false;   // every layer captured up to norm2 (attn): the MLP or MoE layer runs eagerly
};

class LayerGraphRunner : public model::LayerGraphs {
public:
    // `chunks`: this rank's model chunks in order (V of them); `schedule`: the training schedule (PP, V,
    // M, N); `rank`: this rank's pipeline rank; s, b: the sequence length (this rank's share of it with
    // context parallelism) and micro-batch size every micro-batch has (graphs have static shapes).
    using Scope = LayerGraphScope;
    LayerGraphRunner(std::vector<model::GptModel *> chunks, const pipeline::ScheduleOptions & schedule, int rank,
                     int64_t seq_length, int64_t micro_batch_size, Scope scope = {});
    ~LayerGraphRunner() override;
    LayerGraphRunner(const LayerGraphRunner &)             = delete;
    LayerGraphRunner & operator=(const LayerGraphRunner &) = delete;

    // Captures every graph in T order on the compute stream; then hand the runner to the executor.
    void capture();

    const GraphPlan & plan() const { return plan_; }
    size_t            num_graphs() const { return graphs_.size(); }
    int64_t           num_replays() const { return replays_; }
    // Collectives recorded into the graphs (tensor parallelism's; none with TP 1).
    size_t            num_collective_nodes(const std::string & op = "") const;   // op: "all_to_all", ... ("": all)
    // The most bytes a layer's forward left allocated in the graph pool after its capture (its saved
    // activations, what stays live until its backward).
    int64_t           saved_bytes_per_layer() const { return saved_bytes_; }

    // model::LayerGraphs
    Tensor forward(int chunk, int microbatch, int64_t layer, const Tensor & x, const model::DropoutBatch & batch) override;
    Tensor backward(int chunk, int microbatch, int64_t layer, const Tensor & dy, const model::GradReadyFn & ready) override;

private:
    // The next step of T must be `kind` of (chunk, m, layer); throws naming both otherwise.
    const GraphStep & expect_step(GraphKind kind, int chunk, int m, int layer);
    bool split(int chunk, int64_t layer) const;   // a MoE layer captured up to its router

    // A split layer's tail: its eager context, from its forward to its backward.
    struct EagerSegment {
        model::TransformerLayer::Context ctx;
    };

    Device &                                 device_;
    std::vector<model::GptModel *>           chunks_;
    GraphPlan                                plan_;
    int64_t                                  s_, b_, rows_, hidden_;
    DType                                    act_ = DType::f32;   // the activations' dtype (GptConfig)
    std::vector<Tensor>                      set_inputs_;       // [P1 set] X (rows, h) in act_
    std::vector<Tensor>                      set_sample_ids_;   // [P1 set] (b) i64
    std::vector<Tensor>                      grad_outputs_;     // [P2 buffer] dY (rows, h) in act_
    // Split layers' grad-output buffers, shared by all their BWD graphs (TransformerLayer::head_grad_shapes).
    std::vector<Tensor>                      head_grads_;
    Scope                                    scope_;
    std::vector<std::vector<size_t>>         head_outputs_;     // [graph id] split FWD: the head's held outputs
    std::map<std::tuple<int, int, int64_t>, EagerSegment> eager_;   // (chunk, m, layer) in flight
    Tensor                                   iota_ids_;         // 0 .. b-1: a batch without sample ids
    std::vector<std::unique_ptr<Graph>>      graphs_;           // [graph id]
    std::vector<size_t>                      outputs_;          // [graph id] the held output's index
    std::vector<std::vector<model::Parameter *>> ready_order_;  // [graph id] BWD: its eager ready reports
    size_t                                   position_ = 0;     // the next step of T
    int64_t                                  replays_  = 0;
    int64_t                                  saved_bytes_ = 0;
    bool                                     captured_ = false;
};

}  // namespace loom::graphs
