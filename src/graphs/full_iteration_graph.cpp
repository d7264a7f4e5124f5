#include "graphs/full_iteration_graph.h"

#include "core/error.h"


namespace loom::graphs {

namespace {

// A static tensor like `t`, in memory the host fills and the device's kernels or copies read.
Tensor static_like(const Tensor & t, Device & device) {
    return t.defined() ? Tensor::zeros(t.shape(), t.dtype(), device, {host_filled_kind(device)}) : Tensor();
}

}  // namespace

FullIterationGraph::FullIterationGraph(pipeline::PipelineExecutor & executor, const model::GptModel & model)
    : executor_(executor), model_(model), device_(model.device()) {
    LOOM_CHECK(executor.options().pp == 1 && !executor.options().vpp,
               "--cuda-graph-impl full_iteration with a pipeline of " << executor.options().pp << " stages",
               "Loom captures one pipeline stage's iteration: drop --pipeline-model-parallel-size, or use per-layer "
               "graphs (--cuda-graph-impl transformer_engine)");
}

FullIterationGraph::~FullIterationGraph() {
    try {
        device_.compute_stream().synchronize();   // a replay in flight reads the graph's memory
    } catch (...) {
    }
}

void FullIterationGraph::copy_in(const std::vector<model::MicroBatch> & batches) {
    LOOM_CHECK(batches.size() == inputs_.size(), "a full-iteration graph of " << inputs_.size() << " micro-batches given "
                                                                              << batches.size(), "");
    for (size_t k = 0; k < batches.size(); ++k) {
        const model::MicroBatch & from = batches[k];
        model::MicroBatch &       to   = inputs_[k];
        LOOM_CHECK(from.tokens.shape() == to.tokens.shape() && from.sample_ids.defined() == to.sample_ids.defined() &&
                       !from.mtp_tokens.defined(),
                   "micro-batch " << k << " of shape " << from.tokens.describe() << " for a full-iteration graph captured with "
                                  << to.tokens.describe(),
                   "a graph replays static shapes: every micro-batch must have the captured one's");
        model_.check_token_ids(from.tokens);
        const double tokens_now = model::GptModel::loss_tokens(from);
        LOOM_CHECK(!captured() || tokens_now == captured_.losses.at(k).count,
                   "micro-batch " << k << " has " << tokens_now << " tokens in its loss, the full-iteration graph was "
                                  << "captured with " << captured_.losses.at(k).count,
                   "the captured loss gradients are scaled by the capture's token count; the loss mask must not change");
        copy_now(to.tokens, from.tokens);
        copy_now(to.labels, from.labels);
        copy_now(to.loss_mask, from.loss_mask);
        if (to.sample_ids.defined()) copy_now(to.sample_ids, from.sample_ids);
        to.sequence_tokens = from.sequence_tokens;
    }
}

void FullIterationGraph::capture(const std::vector<model::MicroBatch> & batches) {
    LOOM_CHECK(!captured(), "the full-iteration graph is captured twice", "");
    Stream & stream = device_.compute_stream();
    stream.synchronize();
    for (const model::MicroBatch & b : batches) {
        model::MicroBatch in;
        in.tokens     = static_like(b.tokens, device_);
        in.labels     = static_like(b.labels, device_);
        in.loss_mask  = static_like(b.loss_mask, device_);
        in.sample_ids = static_like(b.sample_ids, device_);
        inputs_.push_back(in);
    }
    copy_in(batches);
    auto   graph = std::make_unique<Graph>(device_, "full iteration");
    size_t next  = 0;
    stream.begin_capture(*graph);
    try {
        captured_ = executor_.run([&] { return inputs_.at(next++); },
                                  [this](model::Parameter & p) { reports_.push_back(Report{&p, false}); },
                                  [this](bool last) { reports_.push_back(Report{nullptr, last}); }, /*wait=*/false);
    } catch (...) {
        stream.end_capture();
        throw;
    }
    stream.end_capture();
    graph_ = std::move(graph);
}

FullIterationGraph::Result FullIterationGraph::replay(const std::vector<model::MicroBatch> & batches,
                                                      const model::GradReadyFn &          ready,
                                                      const std::function<void(bool)> &   set_last_microbatch) {
    LOOM_CHECK(captured(), "a full-iteration graph replayed before its capture", "");
    copy_in(batches);
    Stream & stream = device_.compute_stream();
    graph_->replay(stream);
    ++replays_;
    for (const Report & r : reports_) {
        if (r.param == nullptr) {
            if (set_last_microbatch) set_last_microbatch(r.last);
        } else if (ready) {
            ready(*r.param);
        }
    }
    Result result;
    result.losses         = captured_.losses;
    result.peak_in_flight = captured_.peak_in_flight;
    for (size_t k = 0; k < captured_.pending_losses.size(); ++k) {
        result.pending_losses.emplace_back(captured_.pending_losses[k].first, inputs_.at(k).loss_mask);
    }
    stream.synchronize();
    pipeline::PipelineExecutor::read_losses(result);
    return result;
}

}  // namespace loom::graphs
