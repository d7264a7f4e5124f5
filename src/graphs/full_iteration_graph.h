// FullIterationGraph: one graph of a whole iteration's forward and backward passes, every micro-batch of it
// (Megatron's --cuda-graph-impl full_iteration: the forward-backward path in one graph, the optimizer step
// outside it), captured once after --cuda-graph-warmup-steps eager iterations and replayed by every later
// iteration. docs/design/schedules_and_graphs.md section 4.
//
//   FullIterationGraph g(executor, model);
//   g.capture(batches);                          // the executor's run() over static copies of `batches`,
//                                                // captured on the compute stream: nothing runs
//   Result r = g.replay(batches, ready, last);   // every iteration, the capture's included
//
// Inputs. The micro-batches' tensors (tokens, labels, loss mask, sample ids) are copied into static host
// tensors before capture, and the captured kernels (or, on a GPU, the captured copies to device memory) read
// them there; replay() copies each iteration's micro-batches into the same tensors first. replay() waits for
// the stream before it returns, so the next copy never overwrites what a replay still reads. Each copy is
// checked as forward_stage checks a batch: its shape, its token ids against the vocabulary, and its token
// count, which the captured loss gradients were scaled by (1 / (tokens x M)) and must therefore not change.
//
// Gradients. During the capture the backward passes' ready reports and the executor's set_last_microbatch
// calls go to a recorder; after each replay they are made in the recorded order, so DDP's bucket reductions
// run on its stream once the graph's gradients are final (they do not overlap the backward inside the
// graph, whose reductions Megatron captures too). Collectives inside the passes (tensor and context
// parallelism) are captured as replayable nodes (core/graph.h), issued afresh at each replay.
//
// What it covers (train/flags_graphs.cpp refuses the rest by name): one pipeline stage; no MoE layer (the
// dispatch reads token counts on the host); no MTP (its planes are cut on the host); no dynamic loss scale
// (the scale is baked into the captured loss gradients); no Megatron-FSDP or activation offloading (both
// issue work from the host during the passes). DDP, the distributed optimizer (its optimizer offloaded too),
// TP, SP, CP, and full and selective recompute run inside it unchanged. The graph's memory is its pool's
// ("graphs"): every micro-batch's activations, as the eager iteration's.
#pragma once

#include "core/graph.h"
#include "model/gpt_model.h"
#include "pipeline/executor.h"

#include <functional>
#include <memory>
#include <vector>

namespace loom::graphs {

class FullIterationGraph {
public:
    using Result = pipeline::PipelineExecutor::Result;

    // `executor` runs this rank's one stage (`model`); both outlive the graph.
    FullIterationGraph(pipeline::PipelineExecutor & executor, const model::GptModel & model);
    ~FullIterationGraph();
    FullIterationGraph(const FullIterationGraph &)             = delete;
    FullIterationGraph & operator=(const FullIterationGraph &) = delete;

    // Captures the executor's run() over `batches` (this iteration's micro-batches, in order); runs nothing.
    void capture(const std::vector<model::MicroBatch> & batches);
    // One iteration over `batches`: copied into the static inputs, the graph replayed, the recorded reports
    // made to `ready` and `set_last_microbatch`; waits for the stream and returns run()'s Result (the
    // losses read).
    Result replay(const std::vector<model::MicroBatch> & batches, const model::GradReadyFn & ready,
                  const std::function<void(bool)> & set_last_microbatch);

    bool          captured() const { return graph_ != nullptr; }
    const Graph & graph() const { return *graph_; }
    int64_t       num_replays() const { return replays_; }

private:
    void copy_in(const std::vector<model::MicroBatch> & batches);

    // A report the capture recorded: a parameter's gradient ready, or (param null) set_last_microbatch(last).
    struct Report {
        model::Parameter * param = nullptr;
        bool               last  = false;
    };

    pipeline::PipelineExecutor &   executor_;
    const model::GptModel &        model_;
    Device &                       device_;
    std::unique_ptr<Graph>         graph_;
    std::vector<model::MicroBatch> inputs_;     // the static micro-batches the graph reads
    Result                         captured_;   // the capture's losses (token counts) and their copies
    std::vector<Report>            reports_;
    int64_t                        replays_ = 0;
};

}  // namespace loom::graphs
