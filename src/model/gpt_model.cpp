#include "model/gpt_model.h"

#include "core/ops.h"
#include "model/dsa_indexer.h"
#include "model/moe/moe_layer.h"

#include <algorithm>
#include <cmath>

namespace loom::model {

GptModel::GptModel(const GptConfig & config, Device & device, const PipelineStage & stage, const TensorParallel & tp,
                   const ExpertParallel & ep, const ContextParallel & cp)
    : config_(config), stage_(stage), device_(device), vocab_(config.padded_vocab_size(tp.size)), tp_(tp), ep_(ep),
      cp_(cp) {
    LOOM_CHECK(!tp_.sp() || config_.seq_length % tp_.size == 0,
               "--seq-length " << config_.seq_length << " is not divisible by --tensor-model-parallel-size " << tp_.size,
               "--sequence-parallel splits the positions evenly over the tensor-parallel ranks");
    vocab_local_ = vocab_ / tp_.size;
    vocab_begin_ = tp_.rank * vocab_local_;
    config_.validate();
    if (stage_.num_layers < 0) stage_.num_layers = config_.num_layers - stage_.first_layer;
    LOOM_CHECK(stage_.first_layer >= 0 && stage_.num_layers >= 0 &&
                   stage_.first_layer + stage_.num_layers <= config_.num_layers,
               "pipeline stage with layers [" << stage_.first_layer << ", " << stage_.first_layer + stage_.num_layers
                                              << ") of a model with --num-layers " << config_.num_layers, "");
    DType dtype = config_.params_dtype;
    bool  tied  = !config_.untie_embeddings_and_output_weights;
    auto vocab_parallel = [&](Parameter & p) {
        if (tp_.size > 1) set_tp_slice(p, 0, {{vocab_begin_, vocab_begin_ + vocab_local_}}, {vocab_, config_.hidden_size});
    };
    // MTP embeds tokens on the last stage: it holds the word embedding whether or not the output layer is it.
    const bool mtp = stage_.post_process && config_.mtp_num_layers > 0;
    if (stage_.pre_process || (stage_.post_process && (tied || mtp))) {
        wte_ = parameter_create("embedding.word_embeddings.weight", {vocab_local_, config_.hidden_size}, dtype, device);
        wte_.shared_embedding = tied || config_.mtp_num_layers > 0;
        wte_.embedding_or_output = true;
        wte_.embedding_class     = true;
        wte_.shared           = !stage_.pre_process;
        vocab_parallel(wte_);
    }
    if (stage_.pre_process && config_.position_embedding == PositionEmbedding::learned_absolute) {
        wpe_ = parameter_create("embedding.position_embeddings.weight",
                                {config_.max_position_embeddings, config_.hidden_size}, dtype, device);
        tp_.replicated(wpe_);
        wpe_.sequence_parallel = false;   // its gradient comes from every position's (all-gathered) rows
        wpe_.embedding_class   = true;
    }
    for (int64_t i = stage_.first_layer; i < stage_.first_layer + stage_.num_layers; ++i) {
        layers_.push_back(std::make_unique<TransformerLayer>(i, config_, device, tp_, ep_, cp_));
    }
    for (int64_t k = 0; mtp && k < config_.mtp_num_layers; ++k) {
        const std::string name = "mtp.layers." + std::to_string(k);
        const int64_t     h    = config_.hidden_size;
        MtpDepth          depth;
        auto norm = [&](const char * part) {
            auto n = std::make_unique<Norm>(name + "." + part, h, config_.normalization, config_.norm_epsilon, dtype, device, tp_);
            n->set_one_plus(config_.apply_layernorm_1p);
            return n;
        };
        depth.enorm      = norm("enorm");
        depth.hnorm      = norm("hnorm");
        depth.final_norm = norm("final_layernorm");
        // Megatron's eh_proj is column-parallel with its output gathered: the whole (h, 2h) map on every
        // rank. Loom keeps it whole (replicated); under sequence parallelism each rank maps its own rows.
        depth.eh_proj = std::make_unique<Linear>(name + ".eh_proj", 2 * h, h, false, dtype, device, Linear::Split::none, &tp_);
        tp_.replicated(depth.eh_proj->weight);
        depth.layer = std::make_unique<TransformerLayer>(config_.num_layers + k, config_, device, tp_, ep_, cp_,
                                                         name + ".transformer_layer");
        mtp_.push_back(std::move(depth));
    }
    if (config_.moe.expert_bias && num_moe_layers() > 0) {   // one tensor each, for one collective and one update
        const int64_t E = config_.moe.num_experts, rows = num_moe_layers();
        moe_expert_bias_ = Tensor::zeros({rows, E}, DType::f32, device, {MemoryKind::device, "moe-expert-bias"});
        moe_expert_load_ = Tensor::zeros({rows, E}, DType::f32, device, {MemoryKind::device, "moe-expert-bias"});
        int64_t row = 0;
        for (TransformerLayer * layer : all_layers()) {
            if (!layer->moe) continue;
            layer->moe->router.expert_bias = moe_expert_bias_.narrow(0, row, 1).view({E});
            layer->moe->router.expert_load = moe_expert_load_.narrow(0, row, 1).view({E});
            ++row;
        }
    }
    if (stage_.post_process) {
        final_norm_ = std::make_unique<Norm>("final_norm", config_.hidden_size, config_.normalization,
                                             config_.norm_epsilon, dtype, device, tp_);
        final_norm_->set_one_plus(config_.apply_layernorm_1p);
        if (!tied) {
            output_ = parameter_create("output_layer.weight", {vocab_local_, config_.hidden_size}, dtype, device);
            output_.embedding_or_output = true;
            output_.embedding_class     = true;
            vocab_parallel(output_);
        }
    }
}

void GptModel::init() {
    uint64_t seed = config_.seed;
    if (wte_.data.defined()) parameter_init_normal(wte_, seed, config_.init_method_std);
    if (wpe_.data.defined()) parameter_init_normal(wpe_, seed, config_.init_method_std);
    for (auto & layer : layers_) layer->init(seed);
    if (final_norm_) final_norm_->init();
    for (MtpDepth & depth : mtp_) {   // Megatron's init_method for eh_proj, its layer's as a decoder layer's
        depth.enorm->init();
        depth.hnorm->init();
        depth.eh_proj->init(seed, config_.hidden_init_std());
        depth.layer->init(seed);
        depth.final_norm->init();
    }
    if (output_.data.defined()) parameter_init_normal(output_, seed, config_.init_method_std);
}

std::vector<Parameter *> GptModel::parameters() {
    std::vector<Parameter *> out;
    if (stage_.pre_process && wte_.data.defined()) out.push_back(&wte_);
    if (wpe_.data.defined()) out.push_back(&wpe_);
    for (auto & layer : layers_) layer->parameters(out);
    if (final_norm_) final_norm_->parameters(out);
    mtp_parameters(out);
    if (output_.data.defined()) out.push_back(&output_);
    if (!stage_.pre_process && wte_.data.defined()) out.push_back(&wte_);   // the last stage's copy (tied or MTP)
    return out;
}

void GptModel::mtp_parameters(std::vector<Parameter *> & out) {
    for (MtpDepth & depth : mtp_) {
        depth.enorm->parameters(out);
        depth.hnorm->parameters(out);
        depth.eh_proj->parameters(out);
        depth.layer->parameters(out);
        depth.final_norm->parameters(out);
    }
}

std::vector<TransformerLayer *> GptModel::all_layers() const {
    std::vector<TransformerLayer *> out;
    for (const auto & layer : layers_) out.push_back(layer.get());
    for (const MtpDepth & depth : mtp_) out.push_back(depth.layer.get());
    return out;
}


std::vector<Parameter *> GptModel::embedding_params() {
    return wpe_.data.defined() ? std::vector<Parameter *>{&wte_, &wpe_} : std::vector<Parameter *>{&wte_};
}

std::vector<Parameter *> GptModel::layer_params(size_t i) {
    std::vector<Parameter *> params;
    layers_[i]->parameters(params);
    return params;
}

std::vector<Parameter *> GptModel::output_params() {
    std::vector<Parameter *> params;
    final_norm_->parameters(params);
    mtp_parameters(params);
    params.push_back(output_.data.defined() ? &output_ : &wte_);
    if (!mtp_.empty() && output_.data.defined()) params.push_back(&wte_);   // the depths embed tokens
    return params;
}

std::vector<int> GptModel::parameter_units() {
    std::vector<int>         units;
    std::vector<Parameter *> params;
    if (stage_.pre_process && wte_.data.defined()) units.push_back(0);
    if (wpe_.data.defined()) units.push_back(0);
    for (size_t i = 0; i < layers_.size(); ++i) {
        params.clear();
        layers_[i]->parameters(params);
        units.insert(units.end(), params.size(), static_cast<int>(i) + 1);
    }
    const int last = static_cast<int>(layers_.size()) + 1;
    params.clear();
    if (final_norm_) final_norm_->parameters(params);
    mtp_parameters(params);
    units.insert(units.end(), params.size(), last);
    if (output_.data.defined()) units.push_back(last);
    if (!stage_.pre_process && wte_.data.defined()) units.push_back(last);
    LOOM_CHECK(units.size() == parameters().size(), "FSDP units for " << units.size() << " of " << parameters().size()
                                                                      << " parameters", "");
    return units;
}

void GptModel::zero_grad() {
    for (Parameter * p : parameters()) device_.ops().fill_zero(device_.compute_stream(), p->main_grad);
}

Tensor GptModel::local_tokens(const Tensor & tokens) const {
    if (tp_.size == 1) return tokens;
    Tensor local = Tensor::empty(tokens.shape(), DType::i32, device_, {MemoryKind::device, kActivationsPool});
    device_.ops().vocab_shard_ids(device_.compute_stream(), tokens, vocab_begin_, vocab_local_, local);
    return local;
}

double GptModel::loss_tokens(const MicroBatch & batch) {
    // Context parallelism: the loss is a mean over the whole sequences' tokens (this rank's sum is a share).
    if (batch.sequence_tokens >= 0) return batch.sequence_tokens;
    const float * mask = batch.loss_mask.data<float>();
    double        count = 0;
    for (int64_t i = 0; i < batch.loss_mask.numel(); ++i) count += mask[i];   // 0s and 1s: exact in any order
    return count;
}

void GptModel::check_token_ids(const Tensor & tokens) const {
    const int32_t * ids = tokens.data<int32_t>();
    for (int64_t i = 0; i < tokens.numel(); ++i) {
        LOOM_CHECK(ids[i] >= 0 && ids[i] < config_.vocab_size,
                   "token id " << ids[i] << " outside the vocabulary of " << config_.vocab_size,
                   "the dataset's vocabulary must fit the model's (--vocab-size / the tokenizer)");
    }
}

double GptModel::masked_loss_sum(const Tensor & token_loss, const Tensor & mask) {
    const int64_t b = mask.size(0), s = mask.size(1);
    const Tensor  losses = host_readable(token_loss);
    const float * m      = mask.data<float>();
    const float * l      = losses.data<float>();
    double        sum = 0;
    for (int64_t r = 0; r < s * b; ++r) sum += static_cast<double>(m[(r % b) * s + r / b]) * l[r];
    return sum;
}

GptModel::LossSum GptModel::forward(Context & ctx, const MicroBatch & batch) {
    LOOM_CHECK(stage_.pre_process && stage_.post_process, "forward() of a pipeline stage",
               "run a stage with forward_stage()");
    forward_stage(ctx, batch, Tensor());
    ctx.loss.sum = masked_loss_sum(read_after_stream(ctx.token_loss), batch.loss_mask);   // the per-token losses
    return ctx.loss;
}

void GptModel::backward(Context & ctx, double loss_scale, const GradReadyFn & ready) {
    backward_stage(ctx, loss_scale, Tensor(), ready);
}

Tensor GptModel::forward_stage(Context & ctx, const MicroBatch & batch, const Tensor & input) {
    int64_t  b = batch.tokens.size(0), s = batch.tokens.size(1), h = config_.hidden_size;
    Ops &    ops    = device_.ops();
    Stream & stream = device_.compute_stream();
    ctx.s     = s;
    ctx.b     = b;
    // The host reads `batch` (token checks, the mask's count); kernels read ctx.batch, the same tensors in
    // device memory (a loader's pinned batch is copied there once).
    ctx.batch            = MicroBatch{};
    ctx.batch.tokens     = stage_.pre_process ? device_resident(batch.tokens, stream) : Tensor();
    ctx.batch.labels     = stage_.post_process ? device_resident(batch.labels, stream) : Tensor();
    ctx.batch.loss_mask  = stage_.post_process ? device_resident(batch.loss_mask, stream) : Tensor();
    ctx.batch.sample_ids = batch.sample_ids;
    const bool mtp = !mtp_.empty() && ctx.training;
    if (mtp) {
        LOOM_CHECK(batch.mtp_tokens.defined() || !cp_.enabled(), "a context-parallel micro-batch without its MTP planes",
                   "cut the whole sequences' planes (add_mtp_targets) before their CP chunks");
        const MicroBatch planes = batch.mtp_tokens.defined() ? batch : add_mtp_targets(batch, config_.mtp_num_layers);
        ctx.batch.mtp_tokens          = device_resident(planes.mtp_tokens, stream);
        ctx.batch.mtp_labels          = device_resident(planes.mtp_labels, stream);
        ctx.batch.mtp_mask            = device_resident(planes.mtp_mask, stream);
        ctx.batch.mtp_sequence_tokens = planes.mtp_sequence_tokens;
        ctx.mtp_host_mask             = planes.mtp_mask;
    }
    ctx.layers.resize(layers_.size());
    const SeqPositions positions = cp_.positions(s);
    ctx.dsa_topk.clear();
    const DropoutBatch dropout_batch{batch.sample_ids, b, ctx.training, positions, &ctx.dsa_topk};

    Tensor x;
    if (stage_.pre_process) {
        LOOM_CHECK(positions(s - 1) < config_.seq_length || config_.position_embedding != PositionEmbedding::learned_absolute,
                   "micro-batch of sequence length " << positions(s - 1) + 1 << " for a model with --seq-length "
                                                     << config_.seq_length, "");
        LOOM_CHECK(!cp_.enabled() || s % 2 == 0, "a context-parallel micro-batch of " << s << " positions",
                   "each rank holds two chunks of the same length");
        check_token_ids(batch.tokens);
        call(hooks_.before_forward, [&] { return embedding_params(); });
        x = activation(device_, s * b, h, config_.activations_dtype());
        // Vocabulary-parallel: each rank embeds its tokens (zeros for the rest), rank 0 adds the positions,
        // and the sum over the group is the embedding.
        const bool pos = wpe_.data.defined() && tp_.rank == 0;
        // The kernels read f32 or bf16 tables; an f16 model's are widened first.
        const bool wide = wte_.data.dtype() == DType::f16;
        ops.embedding_forward(stream, local_tokens(ctx.batch.tokens), wide ? parameter_f32(wte_) : wte_.data,
                              pos ? (wide ? parameter_f32(wpe_) : wpe_.data) : Tensor(), x, positions);
        if (tp_.sp()) {
            x = tp_.reduce_scatter(x);   // sequence parallel: this rank's rows of the sum
        } else {
            tp_.all_reduce(x);
        }
        scale_by(x, config_.mup_embedding_mult);   // µP's embedding multiplier
        ctx.embedding_dropout = dropout_key(config_, tp_, dropout_batch, -1, DropoutKind::attention_output, x.size(0));
        if (ctx.embedding_dropout.enabled()) ops.dropout(stream, x, x, ctx.embedding_dropout);
        call(hooks_.after_forward, [&] { return embedding_params(); });
    } else {
        LOOM_CHECK(input.defined() && input.numel() == activation_rows(s, b) * h,
                   "pipeline stage input of " << (input.defined() ? input.numel() : 0) << " elements, expected "
                                              << activation_rows(s, b) * h << " (rows x h)", "");
        x = input;
    }
    // Full recompute: a group's first layer keeps its input, and every layer of the group drops what it
    // saved for backward as soon as its forward has run (backward_stage reruns the group).
    if (ctx.runs.empty()) ctx.runs = layer_runs(nullptr);
    check_runs(ctx);
    ctx.checkpoints.assign(layers_.size(), Tensor());
    std::vector<char> group_input(layers_.size(), 0);
    for (const auto & group : recompute_groups()) group_input[group.first] = 1;
    for (size_t i = 0; i < layers_.size(); ++i) {
        call(hooks_.before_forward, [&] { return layer_params(i); });
        const LayerRun run = ctx.runs[i];
        if (group_input[i]) ctx.checkpoints[i] = x;
        if (run == LayerRun::graph) {
            x = ctx.graphs->forward(ctx.chunk, ctx.microbatch, static_cast<int64_t>(i), x, dropout_batch);
        } else {
            x = layers_[i]->forward(ctx.layers[i], x, s, b, dropout_batch);
        }
        if (run == LayerRun::recompute) ctx.layers[i] = TransformerLayer::Context{};
        call(hooks_.after_forward, [&] { return layer_params(i); });
    }
    if (!stage_.post_process) {
        return x;
    }
    call(hooks_.before_forward, [&] { return output_params(); });
    Parameter &  out_w       = output_.data.defined() ? output_ : wte_;
    const Tensor normed_rows = final_norm_->forward(ctx.final_norm, x);
    // every position's hidden state for the vocabulary shard
    ctx.final_hidden = in_dtype(tp_.sp() ? tp_.all_gather(normed_rows) : normed_rows, out_w.data.dtype());
    // The token count comes from the mask, which the host holds; the loss itself is read once the stream
    // has computed ctx.token_loss (masked_loss_sum, after a synchronization: forward() or the executor).
    LossSum result;
    result.count = loss_tokens(batch);
    // Fused in a training pass whose scale is known, unless Megatron-FSDP shards the gradients (its buffers
    // are only there during the backward).
    if (config_.classifier_fusion && ctx.training && ctx.microbatches > 0 && !hooks_.before_backward) {
        // The executor's scale, as it computes it for backward_stage.
        ctx.classifier_scale = ctx.loss_scale / (std::max(result.count, 1.0) * static_cast<double>(ctx.microbatches));
        fused_classifier(ctx, out_w);
    } else {
        ctx.logits = activation(device_, s * b, vocab_local_, config_.activations_dtype());
        ops.gemm(stream, ctx.final_hidden, false, out_w.data, true, ctx.logits);
        scale_by(ctx.logits, config_.mup_output_mult);   // µP's output multiplier
        cross_entropy(ctx.logits, ctx.batch.labels, ctx.lse, ctx.token_loss);
    }
    if (mtp) mtp_forward(ctx, batch, normed_rows, dropout_batch);
    call(hooks_.after_forward, [&] { return output_params(); });
    result.sum = std::nan("");
    ctx.loss   = result;
    return Tensor();
}

Tensor GptModel::backward_stage(Context & ctx, double loss_scale, const Tensor & dy, const GradReadyFn & ready) {
    int64_t  s = ctx.s, b = ctx.b, h = config_.hidden_size;
    Ops &    ops    = device_.ops();
    Stream & stream = device_.compute_stream();
    Tensor   dx;
    if (stage_.post_process) {
        call(hooks_.before_backward, [&] { return output_params(); });
        Tensor dmtp;   // the MTP depths' gradient of the final norm's output, first (the output weight's last)
        if (!ctx.mtp.empty()) dmtp = mtp_backward(ctx, loss_scale, ready);
        Parameter & out_w = output_.data.defined() ? output_ : wte_;
        Tensor      dlogits;
        if (ctx.classifier_dx.defined()) {   // the fused classifier's forward computed both gradients
            LOOM_CHECK(loss_scale == ctx.classifier_scale, "the fused classifier computed its gradients with loss scale "
                                                               << ctx.classifier_scale << ", the backward has " << loss_scale,
                       "the executor gives a training forward the scale its backward will have");
            dx                = ctx.classifier_dx;
            ctx.classifier_dx = Tensor();
        } else {
            Tensor dloss = activation(device_, s * b, 1);
            // Context parallelism: the gradients are averaged over the data- and context-parallel ranks
            // together (dp_cp), where the CP ranks' shares must add up: each starts from CP times its share
            // (Megatron's loss * context_parallel_size).
            ops.loss_grad(stream, ctx.batch.loss_mask, loss_scale * cp_.size, dloss);
            ops.cross_entropy_backward(stream, ctx.logits, local_tokens(ctx.batch.labels), ctx.lse, dloss, local_valid_vocab());
            scale_by(ctx.logits, config_.mup_output_mult);
            dlogits    = in_dtype(ctx.logits, out_w.data.dtype());
            ctx.logits = Tensor();
            dx         = activation(device_, s * b, h, config_.activations_dtype());
            ops.gemm(stream, dlogits, false, out_w.data, false, dx);
        }
        if (tp_.sp()) {   // every vocabulary shard contributes to the hidden state's gradient
            dx = tp_.reduce_scatter(dx);
        } else {
            tp_.all_reduce(dx);
        }
        if (dlogits.defined()) {
            accumulate_grads(stream, {out_w.main_grad}, [&](std::span<const Tensor> g) {
                ops.gemm(stream, dlogits, true, ctx.final_hidden, false, g[0], /*accumulate=*/true);
            });
        }
        ctx.lse = ctx.token_loss = ctx.final_hidden = Tensor();
        dlogits = Tensor();
        if (dmtp.defined()) ops.add_inplace(stream, dx, dmtp);
        // The output weight is final here, unless the same tensor also embeds tokens on this stage.
        if (ready && (output_.data.defined() || !stage_.pre_process)) ready(out_w);
        dx = final_norm_->backward(ctx.final_norm, dx, ready);
        call(hooks_.after_backward, [&] { return output_params(); });
    } else {
        LOOM_CHECK(dy.defined() && dy.numel() == activation_rows(s, b) * h,
                   "pipeline stage output gradient of " << (dy.defined() ? dy.numel() : 0) << " elements, expected "
                                                        << activation_rows(s, b) * h, "");
        dx = dy;
    }
    const std::vector<std::pair<int64_t, int64_t>> groups = recompute_groups();
    // A recomputed group's layers rerun with the forward's record of DSA's selections (a layer may take one from a
    // group not rerun yet), and log no second indexer loss.
    const DropoutBatch dropout_batch{ctx.batch.sample_ids, b, ctx.training, cp_.positions(s), &ctx.dsa_topk, true};
    for (int64_t i = static_cast<int64_t>(layers_.size()); i-- > 0;) {
        for (const auto & [begin, end] : groups) {
            if (end - 1 != i) continue;
            // The group's forward again from its input, keeping everything this time: the same kernels
            // on the same values (and the same dropout keys) give bitwise the same activations.
            Tensor y = ctx.checkpoints[begin];
            for (int64_t k = begin; k < end; ++k) {
                call(hooks_.before_backward, [&] { return layer_params(static_cast<size_t>(k)); });
                y = layers_[k]->forward(ctx.layers[k], y, s, b, dropout_batch);
            }
            ctx.checkpoints[begin] = Tensor();
        }
        call(hooks_.before_backward, [&] { return layer_params(static_cast<size_t>(i)); });
        if (ctx.runs[static_cast<size_t>(i)] == LayerRun::graph) {
            dx = ctx.graphs->backward(ctx.chunk, ctx.microbatch, i, dx, ready);
        } else {
            dx = layers_[i]->backward(ctx.layers[i], dx, ready);
        }
        call(hooks_.after_backward, [&] { return layer_params(static_cast<size_t>(i)); });
    }
    if (stage_.pre_process) {
        call(hooks_.before_backward, [&] { return embedding_params(); });
        if (ctx.embedding_dropout.enabled()) ops.dropout(stream, dx, dx, ctx.embedding_dropout);
        scale_by(dx, config_.mup_embedding_mult);
        if (tp_.sp()) dx = tp_.all_gather(dx);   // the lookup's gradient needs every position
        accumulate_grads(stream, {wte_.main_grad, wpe_.data.defined() ? wpe_.main_grad : Tensor()},
                         [&](std::span<const Tensor> g) {
                             ops.embedding_backward(stream, local_tokens(ctx.batch.tokens), dx, g[0], g[1], cp_.positions(s));
                         });
        if (ready) {
            if (wpe_.data.defined()) ready(wpe_);
            ready(wte_);   // tied on one stage: both the output-layer and the embedding contributions are in
        }
        call(hooks_.after_backward, [&] { return embedding_params(); });
        dx = Tensor();
    }
    ctx.batch = MicroBatch{};
    ctx.dsa_topk.clear();
    return dx;
}

void GptModel::set_aux_loss_scale(float scale) {
    // Context parallelism: each CP rank's router losses are its share, and the gradients are averaged over
    // dp x cp; as with the language-model loss, each share's gradient starts CP times larger.
    for (TransformerLayer * layer : all_layers()) {
        if (layer->moe) layer->moe->aux_loss_backward_scale = scale * static_cast<float>(cp_.size);
        if (layer->attention.indexer) layer->attention.indexer->loss_backward_scale = scale * static_cast<float>(cp_.size);
    }
}

double GptModel::take_dsa_losses() {
    double sum = 0.0;
    for (TransformerLayer * layer : all_layers()) {
        DsaIndexer * indexer = layer->attention.indexer.get();
        if (!indexer) continue;
        sum += host_readable(indexer->loss).data<float>()[0];
        device_.ops().fill_zero(device_.compute_stream(), indexer->loss);
    }
    return sum;
}

std::vector<std::pair<std::string, Tensor>> GptModel::buffers() const {
    std::vector<std::pair<std::string, Tensor>> out;
    for (const TransformerLayer * layer : all_layers()) {   // delayed FP8's state, as Transformer Engine's extra state
        if (!layer->fp8_delayed.forward) continue;
        const std::string & norm = layer->norm1.weight.name;   // "<layer>.norm1.weight"
        const std::string   at   = norm.substr(0, norm.rfind(".norm1.weight"));
        for (const auto & [which, meta] : {std::pair{"forward", layer->fp8_delayed.forward.get()},
                                           std::pair{"backward", layer->fp8_delayed.backward.get()}}) {
            if (!meta->allocated()) continue;
            out.emplace_back(at + ".fp8_" + which + "_amax_history", meta->history());
            out.emplace_back(at + ".fp8_" + which + "_scale", meta->scale());
        }
    }
    for (const TransformerLayer * layer : all_layers()) {
        if (!layer->moe || !layer->moe->router.expert_bias.defined()) continue;
        const std::string & weight = layer->moe->router.weight.name;   // "<layer>.mlp.router.weight"
        out.emplace_back(weight.substr(0, weight.rfind('.')) + ".expert_bias", layer->moe->router.expert_bias);
    }
    return out;
}

void GptModel::update_moe_expert_bias() {
    if (!moe_expert_load_.defined()) return;
    Stream & stream = device_.compute_stream();
    if (ep_.tp_dp_cp) ep_.tp_dp_cp->all_reduce(moe_expert_load_, comm::ReduceOp::sum, &stream);
    device_.ops().moe_expert_bias_update(stream, moe_expert_load_, moe_expert_bias_, config_.moe.bias_update_rate);
}

void GptModel::reset_moe_global_counts() {
    for (TransformerLayer * layer : all_layers()) {
        if (layer->moe) layer->moe->router.reset_global_counts();
    }
}

std::array<double, 4> GptModel::take_moe_losses(std::vector<std::array<double, 4>> * per_layer) {
    std::array<double, 4> sums{};
    for (TransformerLayer * layer : all_layers()) {
        if (!layer->moe) continue;
        const Tensor  host   = host_readable(layer->moe_losses);
        const float * values = host.data<float>();
        for (size_t i = 0; i < sums.size(); ++i) sums[i] += values[i];
        if (per_layer) {
            for (size_t i = 0; i < sums.size(); ++i) per_layer->at(static_cast<size_t>(layer->index))[i] += values[i];
        }
        device_.ops().fill_zero(device_.compute_stream(), layer->moe_losses);
    }
    return sums;
}

int64_t GptModel::num_moe_layers() const {
    const std::vector<TransformerLayer *> layers = all_layers();
    return std::count_if(layers.begin(), layers.end(), [](const TransformerLayer * layer) { return layer->moe != nullptr; });
}

std::vector<std::pair<int64_t, int64_t>> GptModel::recompute_groups() const {
    std::vector<std::pair<int64_t, int64_t>> groups;
    if (config_.recompute_granularity != RecomputeGranularity::full) return groups;
    const int64_t layers = static_cast<int64_t>(layers_.size()), n = config_.recompute_num_layers;
    LOOM_CHECK(n >= 1, "full activation recompute of groups of " << n << " layers", "--recompute-num-layers must be >= 1");
    if (config_.recompute_method == RecomputeMethod::uniform) {
        for (int64_t begin = 0; begin < layers; begin += n) groups.emplace_back(begin, std::min(begin + n, layers));
    } else {
        for (int64_t i = 0; i < std::min(n, layers); ++i) groups.emplace_back(i, i + 1);
    }
    return groups;
}

std::vector<LayerRun> GptModel::layer_runs(const LayerGraphs * graphs) const {
    std::vector<LayerRun> runs(layers_.size(), graphs ? LayerRun::graph : LayerRun::eager);
    for (const auto & [begin, end] : recompute_groups()) {
        for (int64_t i = begin; i < end; ++i) runs[static_cast<size_t>(i)] = LayerRun::recompute;
    }
    return runs;
}

void GptModel::check_runs(const Context & ctx) const {
    LOOM_CHECK(ctx.runs.size() == layers_.size(),
               "layer strategies for " << ctx.runs.size() << " layers on a chunk of " << layers_.size(), "");
    const std::vector<LayerRun> expected = layer_runs(nullptr);
    for (size_t i = 0; i < layers_.size(); ++i) {
        // Backward reruns recompute_groups(): the forward must have dropped exactly those layers' contexts.
        LOOM_CHECK((ctx.runs[i] == LayerRun::recompute) == (expected[i] == LayerRun::recompute),
                   "layer " << i << " of the chunk is " << (expected[i] == LayerRun::recompute ? "" : "not ")
                            << "in a full-recompute group, and its strategy says otherwise", "");
        LOOM_CHECK(ctx.runs[i] != LayerRun::graph || (ctx.graphs && ctx.training),
                   "layer " << i << " is to replay a graph " << (ctx.training ? "without graphs" : "in an evaluation pass"), "");
    }
}

int64_t GptModel::local_valid_vocab() const {
    return std::clamp<int64_t>(config_.vocab_size - vocab_begin_, 0, vocab_local_);
}

void GptModel::scale_by(const Tensor & t, float factor) {
    if (factor != 1.0f) device_.ops().scale(device_.compute_stream(), t, factor);
}

// Per chunk of positions [p0, p0 + pc) (rows [p0 b, (p0 + pc) b) of the (s b) rows): its logits (rows x V / tp),
// their loss and lse, their gradient in place (dloss = mask x scale x cp, then µP's multiplier), and that
// gradient times W (the chunk's rows of ctx.classifier_dx) and times the chunk's hidden states (into W's
// main_grad). Only one chunk's logits are alive at a time. With one chunk every number is the unfused path's.
void GptModel::fused_classifier(Context & ctx, Parameter & out_w) {
    const int64_t s = ctx.s, b = ctx.b, n = s * b;
    Ops &         ops    = device_.ops();
    Stream &      stream = device_.compute_stream();
    const DType   act    = config_.activations_dtype();
    const int64_t chunk  = classifier_chunk_positions(s, b);
    Tensor        dloss  = activation(device_, n, 1);
    ops.loss_grad(stream, ctx.batch.loss_mask, ctx.classifier_scale * cp_.size, dloss);
    ctx.lse           = activation(device_, n, 1);
    ctx.token_loss    = activation(device_, n, 1);
    ctx.classifier_dx = activation(device_, n, config_.hidden_size, act);
    for (int64_t p0 = 0; p0 < s; p0 += chunk) {
        const int64_t pc = std::min(chunk, s - p0), r0 = p0 * b, rows = pc * b;
        const Tensor  hidden = ctx.final_hidden.narrow(0, r0, rows);
        Tensor        labels = ctx.batch.labels;   // (b, pc): the chunk's columns
        if (pc < s) {
            labels = Tensor::empty({b, pc}, DType::i32, device_, {MemoryKind::device, kActivationsPool});
            ops.copy_columns(stream, ctx.batch.labels, p0, labels, 0, pc);
        }
        Tensor logits = activation(device_, rows, vocab_local_, act);
        ops.gemm(stream, hidden, false, out_w.data, true, logits);
        scale_by(logits, config_.mup_output_mult);   // µP's output multiplier
        Tensor lse, loss;
        cross_entropy(logits, labels, lse, loss);
        ops.copy(stream, lse, ctx.lse.narrow(0, r0, rows));
        ops.copy(stream, loss, ctx.token_loss.narrow(0, r0, rows));
        ops.cross_entropy_backward(stream, logits, local_tokens(labels), lse, dloss.narrow(0, r0, rows), local_valid_vocab());
        scale_by(logits, config_.mup_output_mult);
        const Tensor dlogits = in_dtype(logits, out_w.data.dtype());
        ops.gemm(stream, dlogits, false, out_w.data, false, ctx.classifier_dx.narrow(0, r0, rows));
        accumulate_grads(stream, {out_w.main_grad}, [&](std::span<const Tensor> g) {
            ops.gemm(stream, dlogits, true, hidden, false, g[0], /*accumulate=*/true);
        });
    }
}

int64_t GptModel::classifier_chunk_positions(int64_t s, int64_t b) const {
    if (config_.classifier_chunk_positions > 0) return std::min(config_.classifier_chunk_positions, s);
    const int64_t row_bytes = vocab_local_ * static_cast<int64_t>(dtype_size(config_.activations_dtype()));
    return std::clamp<int64_t>(kClassifierChunkBytes / std::max<int64_t>(row_bytes * b, 1), 1, s);
}

void GptModel::cross_entropy(const Tensor & logits, const Tensor & labels, Tensor & lse, Tensor & token_loss) {
    const int64_t n      = logits.size(0);
    Ops &         ops    = device_.ops();
    Stream &      stream = device_.compute_stream();
    lse        = activation(device_, n, 1);
    token_loss = activation(device_, n, 1);
    if (tp_.size == 1) {
        ops.cross_entropy_forward(stream, logits, labels, token_loss, lse, config_.vocab_size);
        return;
    }
    // Vocabulary-parallel: loss = log(sum over all ranks' columns of exp(logit - max)) + max - logit[label],
    // with the max, the sum and the label's logit each combined over the group: the full logits are never
    // gathered.
    const int64_t valid  = local_valid_vocab();
    Tensor        max    = activation(device_, n, 1);
    Tensor        sum    = activation(device_, n, 1);
    Tensor        target = activation(device_, n, 1);
    ops.row_max(stream, logits, valid, max);
    tp_.group->all_reduce(max, comm::ReduceOp::max, &stream);
    ops.row_sum_exp(stream, logits, max, valid, sum);
    tp_.all_reduce(sum);
    ops.label_logit(stream, logits, local_tokens(labels), target);
    tp_.all_reduce(target);
    ops.lse_and_loss(stream, max, sum, target, lse, token_loss);
}

MicroBatch add_mtp_targets(MicroBatch batch, int64_t depths) {
    if (depths == 0) return batch;
    const int64_t b = batch.tokens.size(0), s = batch.tokens.size(1);
    LOOM_CHECK(batch.labels.defined() && batch.loss_mask.defined() && batch.labels.size(1) == s,
               "MTP planes of a micro-batch without its labels and mask", "");
    const MemoryKind kind = batch.tokens.memory_kind();
    batch.mtp_tokens = Tensor::zeros({depths, b, s}, DType::i32, batch.tokens.device(), {kind});
    batch.mtp_labels = Tensor::zeros({depths, b, s}, DType::i32, batch.tokens.device(), {kind});
    batch.mtp_mask   = Tensor::zeros({depths, b, s}, DType::f32, batch.tokens.device(), {kind});
    batch.mtp_sequence_tokens.assign(static_cast<size_t>(depths), 0.0);
    const int32_t * tokens = batch.tokens.data<int32_t>();
    const int32_t * labels = batch.labels.data<int32_t>();
    const float *   mask   = batch.loss_mask.data<float>();
    for (int64_t k = 0; k < depths; ++k) {
        int32_t * t = batch.mtp_tokens.data<int32_t>() + k * b * s;
        int32_t * l = batch.mtp_labels.data<int32_t>() + k * b * s;
        float *   m = batch.mtp_mask.data<float>() + k * b * s;
        for (int64_t r = 0; r < b; ++r) {
            for (int64_t i = 0; i + k + 1 < s; ++i) {
                t[r * s + i] = tokens[r * s + i + k + 1];
                l[r * s + i] = labels[r * s + i + k + 1];
                m[r * s + i] = mask[r * s + i + k + 1];
                batch.mtp_sequence_tokens[static_cast<size_t>(k)] += m[r * s + i];
            }
        }
    }
    return batch;
}

namespace {
// Plane k of a (D, b, s) tensor, as (b, s).
Tensor plane(const Tensor & planes, int64_t k) {
    return planes.narrow(0, k, 1).view({planes.size(1), planes.size(2)});
}
}  // namespace

void GptModel::mtp_forward(Context & ctx, const MicroBatch & batch, const Tensor & h0, const DropoutBatch & dropout_batch) {
    const int64_t     s = ctx.s, b = ctx.b, h = config_.hidden_size, rows = h0.size(0);
    const int64_t     depths = static_cast<int64_t>(mtp_.size());
    const DType       act    = config_.activations_dtype();
    Ops &             ops    = device_.ops();
    Stream &          stream = device_.compute_stream();
    const Parameter & out_w  = output_.data.defined() ? output_ : wte_;
    const bool        wide   = wte_.data.dtype() == DType::f16;
    ctx.mtp.assign(static_cast<size_t>(depths), Context::MtpDepth{});
    // DSA numbers the depths' layers on their own (GptConfig::num_parameters): their shared selections apart from
    // the decoder's.
    std::map<int64_t, Tensor> depth_topk;
    DropoutBatch              depths_batch = dropout_batch;
    depths_batch.dsa_topk                  = &depth_topk;
    Tensor prev = h0;
    for (int64_t k = 0; k < depths; ++k) {
        Context::MtpDepth & c     = ctx.mtp[static_cast<size_t>(k)];
        MtpDepth &          depth = mtp_[static_cast<size_t>(k)];
        c.tokens = local_tokens(plane(ctx.batch.mtp_tokens, k));
        c.labels = plane(ctx.batch.mtp_labels, k);
        c.mask   = plane(ctx.batch.mtp_mask, k);
        // The embedding of the token k + 1 ahead (Megatron's embedding module: no positions with RoPE, its
        // dropout); a dropout site of its own, past every layer's.
        Tensor e = activation(device_, s * b, h, act);
        ops.embedding_forward(stream, c.tokens, wide ? parameter_f32(wte_) : wte_.data, Tensor(), e, cp_.positions(s));
        if (tp_.sp()) {
            e = tp_.reduce_scatter(e);
        } else {
            tp_.all_reduce(e);
        }
        scale_by(e, config_.mup_embedding_mult);
        c.embedding_dropout = dropout_key(config_, tp_, dropout_batch, config_.num_layers + depths + k,
                                          DropoutKind::attention_output, rows);
        if (c.embedding_dropout.enabled()) ops.dropout(stream, e, e, c.embedding_dropout);
        const Tensor a   = depth.enorm->forward(c.enorm, e);
        const Tensor hn  = depth.hnorm->forward(c.hnorm, prev);
        Tensor       cat = activation(device_, rows, 2 * h, act);
        ops.copy_columns(stream, a, 0, cat, 0, h);
        ops.copy_columns(stream, hn, 0, cat, h, h);
        const Tensor p   = depth.eh_proj->forward(c.eh_proj, cat);
        const Tensor y   = depth.layer->forward(c.layer, p, s, b, depths_batch);
        prev             = depth.final_norm->forward(c.final_norm, y);
        c.final_hidden   = in_dtype(tp_.sp() ? tp_.all_gather(prev) : prev, out_w.data.dtype());
        c.logits         = activation(device_, s * b, vocab_local_, act);
        ops.gemm(stream, c.final_hidden, false, out_w.data, true, c.logits);
        scale_by(c.logits, config_.mup_output_mult);
        cross_entropy(c.logits, c.labels, c.lse, c.token_loss);
        // Its token count: the whole sequences' under context parallelism, as the main loss's.
        const Tensor mask = plane(ctx.mtp_host_mask, k);
        if (cp_.enabled()) {
            c.loss.count = batch.mtp_sequence_tokens.at(static_cast<size_t>(k));
        } else {
            const float * m = mask.data<float>();
            for (int64_t i = 0; i < b * s; ++i) c.loss.count += m[i];
        }
        pending_mtp_.push_back(PendingMtpLoss{c.token_loss, mask, c.loss.count, static_cast<size_t>(k)});
    }
}

Tensor GptModel::mtp_backward(Context & ctx, double loss_scale, const GradReadyFn & ready) {
    const int64_t s = ctx.s, b = ctx.b, h = config_.hidden_size;
    const int64_t depths = static_cast<int64_t>(ctx.mtp.size());
    Ops &         ops    = device_.ops();
    Stream &      stream = device_.compute_stream();
    Parameter &   out_w  = output_.data.defined() ? output_ : wte_;
    const DType   act    = config_.activations_dtype();
    // Each token of depth k weighs scale / D / (its tokens) per micro-batch where the main loss's weigh
    // 1 / (main tokens): loss_scale (the main token's factor) times main tokens / depth tokens (Megatron's
    // MTPLossAutoScaler with the main loss's scale, and the same ratio under --calculate-per-token-loss).
    const double main_tokens = std::max(ctx.loss.count, 1.0);
    Tensor       dnext;   // the gradient of depth k's output from depth k + 1
    for (int64_t k = depths - 1; k >= 0; --k) {
        Context::MtpDepth & c     = ctx.mtp[static_cast<size_t>(k)];
        MtpDepth &          depth = mtp_[static_cast<size_t>(k)];
        const double factor = loss_scale * main_tokens / std::max(c.loss.count, 1.0) *
                              static_cast<double>(config_.mtp_loss_scaling_factor) / static_cast<double>(depths);
        Tensor dloss = activation(device_, s * b, 1);
        ops.loss_grad(stream, c.mask, factor * cp_.size, dloss);
        ops.cross_entropy_backward(stream, c.logits, local_tokens(c.labels), c.lse, dloss, local_valid_vocab());
        scale_by(c.logits, config_.mup_output_mult);
        Tensor dlogits = in_dtype(c.logits, out_w.data.dtype());
        c.logits       = Tensor();
        Tensor dout    = activation(device_, s * b, h, act);
        ops.gemm(stream, dlogits, false, out_w.data, false, dout);
        if (tp_.sp()) {
            dout = tp_.reduce_scatter(dout);
        } else {
            tp_.all_reduce(dout);
        }
        accumulate_grads(stream, {out_w.main_grad}, [&](std::span<const Tensor> g) {
            ops.gemm(stream, dlogits, true, c.final_hidden, false, g[0], /*accumulate=*/true);
        });
        if (dnext.defined()) ops.add_inplace(stream, dout, dnext);
        const Tensor dy   = depth.final_norm->backward(c.final_norm, dout, ready);
        const Tensor dp   = depth.layer->backward(c.layer, dy, ready);
        const Tensor dcat = depth.eh_proj->backward(c.eh_proj, dp, ready);
        const int64_t rows = dcat.size(0);
        Tensor da = activation(device_, rows, h, act), dh = activation(device_, rows, h, act);
        ops.copy_columns(stream, dcat, 0, da, 0, h);
        ops.copy_columns(stream, dcat, h, dh, 0, h);
        dnext     = depth.hnorm->backward(c.hnorm, dh, ready);
        Tensor de = depth.enorm->backward(c.enorm, da, ready);
        if (c.embedding_dropout.enabled()) ops.dropout(stream, de, de, c.embedding_dropout);
        scale_by(de, config_.mup_embedding_mult);
        if (tp_.sp()) de = tp_.all_gather(de);
        accumulate_grads(stream, {wte_.main_grad, Tensor()}, [&](std::span<const Tensor> g) {
            ops.embedding_backward(stream, c.tokens, de, g[0], g[1], cp_.positions(s));
        });
        c = Context::MtpDepth{};
    }
    ctx.mtp.clear();
    // The word embedding's copy on a later stage is final here (on the first stage its own backward ends it;
    // a tied one is the output weight, reported by the caller).
    if (ready && !stage_.pre_process && output_.data.defined()) ready(wte_);
    return dnext;
}

std::vector<double> GptModel::take_mtp_losses() {
    std::vector<double> sums(mtp_.size(), 0.0);
    for (const PendingMtpLoss & p : pending_mtp_) {
        sums[p.depth] += masked_loss_sum(host_readable(p.token_loss), p.mask) / std::max(p.count, 1.0);
    }
    pending_mtp_.clear();
    return sums;
}

}  // namespace loom::model
