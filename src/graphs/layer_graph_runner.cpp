#include "graphs/layer_graph_runner.h"

#include "core/error.h"
#include "core/ops.h"

#include <algorithm>
#include <numeric>

namespace loom::graphs {

namespace {

GraphPlanOptions plan_options(const std::vector<model::GptModel *> & chunks, const pipeline::ScheduleOptions & schedule,
                              int rank) {
    GraphPlanOptions options;
    options.schedule = schedule;
    options.rank     = rank;
    for (model::GptModel * chunk : chunks) options.layers_per_chunk.push_back(static_cast<int>(chunk->num_layers()));
    return options;
}

}  // namespace

LayerGraphRunner::LayerGraphRunner(std::vector<model::GptModel *> chunks, const pipeline::ScheduleOptions & schedule,
                                   int rank, int64_t seq_length, int64_t micro_batch_size, Scope scope)
    : device_(chunks.at(0)->device()), chunks_(std::move(chunks)), plan_(plan_graphs(plan_options(chunks_, schedule, rank))),
      s_(seq_length), b_(micro_batch_size), scope_(scope) {
    const model::GptConfig & config = chunks_[0]->config();
    LOOM_CHECK(config.recompute_granularity != model::RecomputeGranularity::full,
               "--cuda-graph-impl transformer_engine with --recompute-granularity full",
               "full recompute is only supported with full iteration CUDA graph (Megatron's rule): drop one of them");
    LOOM_CHECK(static_cast<int>(chunks_.size()) == plan_.num_chunks,
               chunks_.size() << " model chunks for a schedule of " << plan_.num_chunks << " per rank", "");
    rows_   = chunks_[0]->activation_rows(s_, b_);
    hidden_ = config.hidden_size;
    act_    = config.activations_dtype();
    const TensorOptions static_pool{MemoryKind::device, kGraphStaticPool};
    for (int set = 0; set < plan_.num_input_sets(); ++set) {
        set_inputs_.push_back(Tensor::zeros({rows_, hidden_}, act_, device_, static_pool));
        set_sample_ids_.push_back(Tensor::zeros({b_}, DType::i64, device_, static_pool));
    }
    for (int buffer = 0; buffer < plan_.num_grad_output_buffers(); ++buffer) {
        grad_outputs_.push_back(Tensor::zeros({rows_, hidden_}, act_, device_, static_pool));
    }
    LOOM_CHECK(!scope_.moe_preprocess || scope_.moe_router, "moe_preprocess cuda graph is only supported with moe_router cuda graph.", "");
    const model::TransformerLayer * split_layer = nullptr;   // any layer captured up to its router
    for (size_t c = 0; c < chunks_.size(); ++c) {
        for (int64_t l = 0; l < chunks_[c]->num_layers(); ++l) {
            const model::TransformerLayer & layer = chunks_[c]->layer(l);
            if (split(static_cast<int>(c), l)) split_layer = &layer;
            // With moe_router, dense layers are captured whole (--cuda-graph-modules attn mlp moe_router); with
            // attn, MoE layers up to norm2 as dense ones.
            LOOM_CHECK(!layer.moe || scope_.moe_router || scope_.attn || (config.moe.drops() && config.moe.pad_to_capacity),
                       "a graph of the whole MoE layer " << layer.index << " without drop-and-pad",
                       "a dropless dispatch reads each expert's token count on the host: add --moe-expert-capacity-factor "
                       "and --moe-pad-expert-input-to-capacity, or capture up to the router (--cuda-graph-modules attn moe_router)");
        }
    }
    if (split_layer) {   // every split layer's head takes gradients of the same shapes
        const bool at_norm2 = !split_layer->moe || scope_.attn;
        for (const std::vector<int64_t> & shape : split_layer->head_grad_shapes(rows_, at_norm2)) {
            // The residual's gradient in the activations' dtype, then the router's (f32) or norm2's output's (the
            // activations' dtype).
            const DType dtype = head_grads_.empty() || at_norm2 ? act_ : DType::f32;
            head_grads_.push_back(Tensor::zeros(shape, dtype, device_, static_pool));
        }
    }
    head_outputs_.resize(static_cast<size_t>(plan_.num_graphs));
    iota_ids_ = Tensor::empty({b_}, DType::i64, device_, static_pool);
    Tensor iota = Tensor::empty({b_}, DType::i64, device_, {host_filled_kind(device_)});
    std::iota(iota.data<int64_t>(), iota.data<int64_t>() + b_, int64_t{0});
    copy_now(iota_ids_, iota);
    graphs_.resize(static_cast<size_t>(plan_.num_graphs));
    outputs_.assign(graphs_.size(), 0);
    ready_order_.resize(graphs_.size());
}

LayerGraphRunner::~LayerGraphRunner() {
    try {
        device_.compute_stream().synchronize();   // replays in flight read the graphs' memory
    } catch (...) {
    }
}

void LayerGraphRunner::capture() {
    LOOM_CHECK(!captured_, "the layer graphs are captured twice", "");
    Stream & stream = device_.compute_stream();
    stream.synchronize();
    std::vector<std::unique_ptr<model::TransformerLayer::Context>> contexts(graphs_.size());   // by FWD id
    // DSA's shared selections (DropoutBatch::dsa_topk), one record per chunk and micro-batch slot as a forward of the
    // model keeps one: a layer without an indexer captures the read of its source layer's mask, which the source's
    // FWD graph writes at every replay. Dropped at the slot's first backward (the sources' contexts keep the masks).
    std::map<std::pair<int, int>, std::map<int64_t, Tensor>> dsa_topk;
    for (const GraphStep & step : plan_.timeline) {
        model::TransformerLayer & layer = chunks_[step.chunk]->layer(step.layer);
        auto graph = std::make_unique<Graph>(device_, "layer " + std::to_string(layer.index) + " " + step_label(step));
        const size_t  id     = static_cast<size_t>(step.graph_id);
        const int64_t before = device_.allocator().pool_stats(graph->pool()).allocated;
        stream.begin_capture(*graph);
        const bool split_layer = split(step.chunk, step.layer);
        if (step.kind == GraphKind::forward) {
            contexts[id] = std::make_unique<model::TransformerLayer::Context>();
            const model::DropoutBatch batch{set_sample_ids_[step.input_set], b_, true,
                                            chunks_[0]->context_parallel().positions(s_),
                                            &dsa_topk[{step.chunk, step.microbatch}]};
            const Tensor &            x = set_inputs_[step.input_set];
            if (split_layer) {
                for (const Tensor & t : layer.forward_head(*contexts[id], x, s_, b_, batch, scope_.moe_preprocess, scope_.attn)) {
                    head_outputs_[id].push_back(graph->hold(t));
                }
            } else {
                outputs_[id] = graph->hold(layer.forward(*contexts[id], x, s_, b_, batch));
            }
        } else {
            dsa_topk.erase({step.chunk, step.microbatch});
            const size_t forward_id = static_cast<size_t>(graph_id(plan_, GraphKind::forward, step.chunk, step.microbatch, step.layer));
            std::vector<model::Parameter *> & order = ready_order_[id];
            const model::GradReadyFn record = [&order](model::Parameter & p) { order.push_back(&p); };
            if (split_layer) {
                outputs_[id] = graph->hold(layer.backward_head(*contexts[forward_id], head_grads_, record, scope_.attn));
            } else {
                outputs_[id] = graph->hold(layer.backward(*contexts[forward_id], grad_outputs_[step.grad_output_buffer], record));
            }
            contexts[forward_id].reset();   // its saved activations go back to the pool at end_capture
        }
        stream.end_capture();
        if (step.kind == GraphKind::forward) {
            saved_bytes_ = std::max(saved_bytes_, device_.allocator().pool_stats(graph->pool()).allocated - before);
        }
        graphs_[id] = std::move(graph);
    }
    captured_ = true;
}

size_t LayerGraphRunner::num_collective_nodes(const std::string & op) const {
    size_t n = 0;
    for (const auto & graph : graphs_) n += graph ? graph->num_replayable_nodes(op) : 0;
    return n;
}

bool LayerGraphRunner::split(int chunk, int64_t layer) const {
    const bool moe = chunks_[static_cast<size_t>(chunk)]->layer(layer).moe != nullptr;
    return moe ? scope_.moe_router || scope_.attn : scope_.attn;
}

const GraphStep & LayerGraphRunner::expect_step(GraphKind kind, int chunk, int m, int layer) {
    const GraphStep & step = plan_.timeline[position_];
    LOOM_CHECK(step.kind == kind && step.chunk == chunk && step.microbatch == m && step.layer == layer,
               "the schedule ran " << graph_kind_name(kind) << " of chunk " << chunk << ", micro-batch " << m
                                   << ", layer " << layer << " where the captured timeline has "
                                   << step_label(step) << " (step " << position_ << ")",
               "graphs sharing a pool replay in the order they were captured: the micro-batch count and the "
               "pipeline schedule must not change after capture");
    position_ = (position_ + 1) % plan_.timeline.size();
    ++replays_;
    return step;
}

Tensor LayerGraphRunner::forward(int chunk, int microbatch, int64_t layer, const Tensor & x, const model::DropoutBatch & batch) {
    const auto        c    = static_cast<size_t>(chunk);
    const GraphStep & step = expect_step(GraphKind::forward, chunk, microbatch % plan_.captured_microbatches,
                                         static_cast<int>(layer));
    LOOM_CHECK(x.dtype() == act_ && x.numel() == rows_ * hidden_ && batch.b == b_ && batch.training,
               "a training call of layer graph " << step_label(step) << " with input " << x.describe() << " and "
                                                 << batch.b << " sequences",
               "graphs have static shapes: (" << rows_ << ", " << hidden_ << ") " << dtype_name(act_)
                                              << " and --micro-batch-size " << b_);
    Ops &          ops    = device_.ops();
    Stream &       stream = device_.compute_stream();
    const Tensor & input  = set_inputs_[step.input_set];
    if (x.data_ptr() != input.data_ptr()) ops.copy(stream, x.view({rows_, hidden_}), input);
    ops.copy(stream, batch.sample_ids.defined() ? batch.sample_ids : iota_ids_, set_sample_ids_[step.input_set]);
    const Graph & graph = *graphs_[static_cast<size_t>(step.graph_id)];
    graph.replay(stream);
    if (split(chunk, layer)) {
        // The head's outputs, copied out before any later graph can reuse their blocks; the tail runs
        // eagerly from them with this micro-batch's routing.
        std::vector<Tensor> head;
        for (const size_t i : head_outputs_[static_cast<size_t>(step.graph_id)]) {
            const Tensor & held = graph.held(i);
            head.push_back(held.defined() ? Tensor::empty(held.shape(), held.dtype(), device_,
                                                          {MemoryKind::device, kActivationsPool})
                                          : Tensor());
            if (held.defined()) ops.copy(stream, held, head.back());
        }
        EagerSegment & eager = eager_[{chunk, step.microbatch, layer}];
        eager                = EagerSegment{};
        return chunks_[c]->layer(layer).forward_tail(eager.ctx, head, s_, b_, batch, scope_.attn);
    }
    const Tensor & y = graph.held(outputs_[static_cast<size_t>(step.graph_id)]);
    if (layer + 1 < chunks_[c]->num_layers()) return y;   // copied into the next layer's input before it replays
    Tensor out = model::activation(device_, rows_, hidden_, act_);
    ops.copy(stream, y, out);
    return out;
}

Tensor LayerGraphRunner::backward(int chunk, int microbatch, int64_t layer, const Tensor & dy, const model::GradReadyFn & ready) {
    const auto        c    = static_cast<size_t>(chunk);
    const GraphStep & step = expect_step(GraphKind::backward, chunk, microbatch % plan_.captured_microbatches,
                                         static_cast<int>(layer));
    LOOM_CHECK(dy.dtype() == act_ && dy.numel() == rows_ * hidden_,
               "layer graph " << step_label(step) << " given the output gradient " << dy.describe(),
               "graphs have static shapes: (" << rows_ << ", " << hidden_ << ") " << dtype_name(act_));
    Ops &          ops         = device_.ops();
    Stream &       stream      = device_.compute_stream();
    if (split(chunk, layer)) {
        // The tail's backward first (the experts' parameters report ready from it), then its gradients of
        // the head's outputs into the buffers every head's BWD graph reads.
        auto it = eager_.find({chunk, step.microbatch, layer});
        LOOM_CHECK(it != eager_.end(), "the backward of " << step_label(step) << " without its forward", "");
        const std::vector<Tensor> grads =
            chunks_[c]->layer(layer).backward_tail(it->second.ctx, dy.view({rows_, hidden_}), ready, scope_.attn);
        eager_.erase(it);
        LOOM_CHECK(grads.size() == head_grads_.size(), "the tail of " << step_label(step) << " gave " << grads.size()
                                                                      << " gradients for " << head_grads_.size() << " buffers", "");
        for (size_t i = 0; i < grads.size(); ++i) ops.copy(stream, grads[i], head_grads_[i]);
    } else {
        const Tensor & grad_output = grad_outputs_[step.grad_output_buffer];
        if (dy.data_ptr() != grad_output.data_ptr()) ops.copy(stream, dy.view({rows_, hidden_}), grad_output);
    }
    const Graph & graph = *graphs_[static_cast<size_t>(step.graph_id)];
    graph.replay(stream);
    if (ready) {
        for (model::Parameter * p : ready_order_[static_cast<size_t>(step.graph_id)]) ready(*p);
    }
    const Tensor & dx = graph.held(outputs_[static_cast<size_t>(step.graph_id)]);
    if (layer > 0) return dx;   // copied into the shared grad-output buffer before the next backward replays
    Tensor out = model::activation(device_, rows_, hidden_, act_);
    ops.copy(stream, dx, out);
    return out;
}

}  // namespace loom::graphs
