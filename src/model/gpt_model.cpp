#include "model/gpt_model.h"

#include "backend/cpu/gemm.h"
#include "backend/cpu/ops.h"

#include <algorithm>
#include <cmath>

namespace loom::model {

GptModel::GptModel(const GptConfig & config, Device & device, const PipelineStage & stage, const TensorParallel & tp)
    : config_(config), stage_(stage), device_(device), vocab_(config.padded_vocab_size(tp.size)), tp_(tp) {
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
    if (stage_.pre_process || (stage_.post_process && tied)) {
        wte_ = parameter_create("embedding.word_embeddings.weight", {vocab_local_, config_.hidden_size}, dtype, device);
        wte_.shared_embedding = tied;
        wte_.shared           = !stage_.pre_process;
        vocab_parallel(wte_);
    }
    if (stage_.pre_process && config_.position_embedding == PositionEmbedding::learned_absolute) {
        wpe_ = parameter_create("embedding.position_embeddings.weight",
                                {config_.max_position_embeddings, config_.hidden_size}, dtype, device);
        tp_.replicated(wpe_);
        wpe_.sequence_parallel = false;   // its gradient comes from every position's (all-gathered) rows
    }
    for (int64_t i = stage_.first_layer; i < stage_.first_layer + stage_.num_layers; ++i) {
        layers_.push_back(std::make_unique<TransformerLayer>(i, config_, device, tp_));
    }
    if (stage_.post_process) {
        final_norm_ = std::make_unique<Norm>("final_norm", config_.hidden_size, config_.normalization,
                                             config_.norm_epsilon, dtype, device, tp_);
        if (!tied) {
            output_ = parameter_create("output_layer.weight", {vocab_local_, config_.hidden_size}, dtype, device);
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
    if (output_.data.defined()) parameter_init_normal(output_, seed, config_.init_method_std);
}

std::vector<Parameter *> GptModel::parameters() {
    std::vector<Parameter *> out;
    if (stage_.pre_process && wte_.data.defined()) out.push_back(&wte_);
    if (wpe_.data.defined()) out.push_back(&wpe_);
    for (auto & layer : layers_) layer->parameters(out);
    if (final_norm_) final_norm_->parameters(out);
    if (output_.data.defined()) out.push_back(&output_);
    if (!stage_.pre_process && wte_.data.defined()) out.push_back(&wte_);   // the last stage's tied copy
    return out;
}

void GptModel::zero_grad() {
    for (Parameter * p : parameters()) p->main_grad.fill_zero();
}

std::vector<int32_t> GptModel::local_tokens(const Tensor & tokens) const {
    const int32_t *      t = tokens.data<int32_t>();
    std::vector<int32_t> local(static_cast<size_t>(tokens.numel()));
    for (size_t i = 0; i < local.size(); ++i) {
        local[i] = t[i] >= vocab_begin_ && t[i] < vocab_begin_ + vocab_local_ ? static_cast<int32_t>(t[i] - vocab_begin_) : -1;
    }
    return local;
}

GptModel::LossSum GptModel::forward(Context & ctx, const MicroBatch & batch) {
    LOOM_CHECK(stage_.pre_process && stage_.post_process, "forward() of a pipeline stage",
               "run a stage with forward_stage()");
    forward_stage(ctx, batch, Tensor());
    return ctx.loss;
}

void GptModel::backward(Context & ctx, double loss_scale, const GradReadyFn & ready) {
    backward_stage(ctx, loss_scale, Tensor(), ready);
}

Tensor GptModel::forward_stage(Context & ctx, const MicroBatch & batch, const Tensor & input) {
    int64_t b = batch.tokens.size(0), s = batch.tokens.size(1), h = config_.hidden_size;
    ctx.s     = s;
    ctx.b     = b;
    ctx.batch = batch;
    ctx.layers.resize(layers_.size());

    Tensor x;
    if (stage_.pre_process) {
        LOOM_CHECK(s <= config_.seq_length || config_.position_embedding != PositionEmbedding::learned_absolute,
                   "micro-batch of sequence length " << s << " for a model with --seq-length " << config_.seq_length, "");
        const int32_t * tokens = batch.tokens.data<int32_t>();
        for (int64_t i = 0; i < b * s; ++i) {
            LOOM_CHECK(tokens[i] >= 0 && tokens[i] < config_.vocab_size,
                       "token id " << tokens[i] << " outside the vocabulary of " << config_.vocab_size,
                       "the dataset's vocabulary must fit the model's (--vocab-size / the tokenizer)");
        }
        if (pre_forward_) {
            pre_forward_(wpe_.data.defined() ? std::vector<Parameter *>{&wte_, &wpe_} : std::vector<Parameter *>{&wte_});
        }
        x = activation(device_, s * b, h);
        // Vocabulary-parallel: each rank embeds its tokens (zeros for the rest), rank 0 adds the positions,
        // and the sum over the group is the embedding.
        std::vector<int32_t> local = tp_.size > 1 ? local_tokens(batch.tokens) : std::vector<int32_t>();
        const int32_t *      ids   = tp_.size > 1 ? local.data() : tokens;
        const bool           pos   = wpe_.data.defined() && tp_.rank == 0;
        if (wte_.data.dtype() == DType::f32) {
            cpu::embedding_forward(ids, wte_.data.data<float>(), pos ? wpe_.data.data<float>() : nullptr,
                                   x.data<float>(), s, b, h);
        } else {
            cpu::embedding_forward(ids, static_cast<const uint16_t *>(wte_.data.data_ptr()),
                                   pos ? static_cast<const uint16_t *>(wpe_.data.data_ptr()) : nullptr, x.data<float>(),
                                   s, b, h);
        }
        if (tp_.sp()) {
            x = tp_.reduce_scatter(x);   // sequence parallel: this rank's rows of the sum
        } else {
            tp_.all_reduce(x);
        }
    } else {
        LOOM_CHECK(input.defined() && input.numel() == activation_rows(s, b) * h,
                   "pipeline stage input of " << (input.defined() ? input.numel() : 0) << " elements, expected "
                                              << activation_rows(s, b) * h << " (rows x h)", "");
        x = input;
    }
    for (size_t i = 0; i < layers_.size(); ++i) {
        if (pre_forward_) {
            std::vector<Parameter *> params;
            layers_[i]->parameters(params);
            pre_forward_(params);
        }
        x = layers_[i]->forward(ctx.layers[i], x, s, b);
    }
    if (!stage_.post_process) {
        return x;
    }
    if (pre_forward_) {
        std::vector<Parameter *> params;
        final_norm_->parameters(params);
        params.push_back(output_.data.defined() ? &output_ : &wte_);
        pre_forward_(params);
    }
    const Parameter & out_w = output_.data.defined() ? output_ : wte_;
    DType             dtype = out_w.data.dtype();
    Tensor normed = final_norm_->forward(ctx.final_norm, x);
    if (tp_.sp()) normed = tp_.all_gather(normed);   // every position's hidden state for the vocabulary shard
    ctx.final_hidden = in_dtype(normed, dtype);
    ctx.logits     = activation(device_, s * b, vocab_local_);
    ctx.lse        = activation(device_, s * b, 1);
    ctx.token_loss = activation(device_, s * b, 1);
    cpu::gemm(false, true, s * b, vocab_local_, h, ctx.final_hidden.data_ptr(), out_w.data.data_ptr(), dtype,
              ctx.logits.data<float>());
    if (tp_.size == 1) {
        cpu::cross_entropy_forward(ctx.logits.data<float>(), batch.labels.data<int32_t>(), ctx.token_loss.data<float>(),
                                   ctx.lse.data<float>(), s, b, vocab_, config_.vocab_size);
    } else {
        vocab_parallel_cross_entropy(ctx, batch);
    }
    LossSum       result;
    const float * mask = batch.loss_mask.data<float>();
    const float * loss = ctx.token_loss.data<float>();
    for (int64_t r = 0; r < s * b; ++r) {
        float m = mask[(r % b) * s + r / b];
        result.sum += static_cast<double>(m) * loss[r];
        result.count += m;
    }
    ctx.loss = result;
    return Tensor();
}

Tensor GptModel::backward_stage(Context & ctx, double loss_scale, const Tensor & dy, const GradReadyFn & ready) {
    int64_t s = ctx.s, b = ctx.b, h = config_.hidden_size;
    Tensor  dx;
    if (stage_.post_process) {
        Tensor        dloss = activation(device_, s * b, 1);
        const float * mask  = ctx.batch.loss_mask.data<float>();
        for (int64_t r = 0; r < s * b; ++r) {
            dloss.data<float>()[r] = static_cast<float>(mask[(r % b) * s + r / b] * loss_scale);
        }
        std::vector<int32_t> local = tp_.size > 1 ? local_tokens(ctx.batch.labels) : std::vector<int32_t>();
        cpu::cross_entropy_backward(ctx.logits.data<float>(),
                                    tp_.size > 1 ? local.data() : ctx.batch.labels.data<int32_t>(), ctx.lse.data<float>(),
                                    dloss.data<float>(), s, b, vocab_local_, local_valid_vocab());
        Parameter & out_w   = output_.data.defined() ? output_ : wte_;
        DType       dtype   = out_w.data.dtype();
        Tensor      dlogits = in_dtype(ctx.logits, dtype);
        ctx.logits          = Tensor();
        dx                  = activation(device_, s * b, h);
        cpu::gemm(false, false, s * b, h, vocab_local_, dlogits.data_ptr(), out_w.data.data_ptr(), dtype, dx.data<float>());
        if (tp_.sp()) {   // every vocabulary shard contributes to the hidden state's gradient
            dx = tp_.reduce_scatter(dx);
        } else {
            tp_.all_reduce(dx);
        }
        cpu::gemm(true, false, vocab_local_, h, s * b, dlogits.data_ptr(), ctx.final_hidden.data_ptr(), dtype,
                  out_w.main_grad.data<float>(), true);
        ctx.lse = ctx.token_loss = ctx.final_hidden = Tensor();
        dlogits = Tensor();
        // The output weight is final here, unless the same tensor also embeds tokens on this stage.
        if (ready && (output_.data.defined() || !stage_.pre_process)) ready(out_w);
        dx = final_norm_->backward(ctx.final_norm, dx, ready);
    } else {
        LOOM_CHECK(dy.defined() && dy.numel() == activation_rows(s, b) * h,
                   "pipeline stage output gradient of " << (dy.defined() ? dy.numel() : 0) << " elements, expected "
                                                        << activation_rows(s, b) * h, "");
        dx = dy;
    }
    for (size_t i = layers_.size(); i-- > 0;) {
        dx = layers_[i]->backward(ctx.layers[i], dx, ready);
    }
    if (stage_.pre_process) {
        if (tp_.sp()) dx = tp_.all_gather(dx);   // the lookup's gradient needs every position
        std::vector<int32_t> local = tp_.size > 1 ? local_tokens(ctx.batch.tokens) : std::vector<int32_t>();
        cpu::embedding_backward(tp_.size > 1 ? local.data() : ctx.batch.tokens.data<int32_t>(), dx.data<float>(),
                                wte_.main_grad.data<float>(), wpe_.data.defined() ? wpe_.main_grad.data<float>() : nullptr,
                                s, b, h, vocab_local_);
        if (ready) {
            if (wpe_.data.defined()) ready(wpe_);
            ready(wte_);   // tied on one stage: both the output-layer and the embedding contributions are in
        }
        dx = Tensor();
    }
    ctx.batch = MicroBatch{};
    return dx;
}

int64_t GptModel::local_valid_vocab() const {
    return std::clamp<int64_t>(config_.vocab_size - vocab_begin_, 0, vocab_local_);
}

void GptModel::vocab_parallel_cross_entropy(Context & ctx, const MicroBatch & batch) {
    // loss = log(sum over all ranks' columns of exp(logit - max)) + max - logit[label], with the max, the
    // sum and the label's logit each combined over the group: the full logits are never gathered.
    const int64_t n = ctx.s * ctx.b, s = ctx.s, b = ctx.b, valid = local_valid_vocab();
    const float * logits = ctx.logits.data<float>();
    Tensor        max    = activation(device_, n, 1);
    Tensor        sum    = activation(device_, n, 1);
    Tensor        target = activation(device_, n, 1);
    cpu::row_max(logits, n, vocab_local_, valid, max.data<float>());
    tp_.group->all_reduce(max, comm::ReduceOp::max)->wait();
    cpu::row_sum_exp(logits, max.data<float>(), n, vocab_local_, valid, sum.data<float>());
    tp_.all_reduce(sum);
    std::vector<int32_t> labels = local_tokens(batch.labels);
    for (int64_t r = 0; r < n; ++r) {
        int32_t label = labels[(r % b) * s + r / b];
        target.data<float>()[r] = label >= 0 ? logits[r * vocab_local_ + label] : 0.0f;
    }
    tp_.all_reduce(target);
    for (int64_t r = 0; r < n; ++r) {
        float lse = max.data<float>()[r] + std::log(sum.data<float>()[r]);
        ctx.lse.data<float>()[r]        = lse;
        ctx.token_loss.data<float>()[r] = lse - target.data<float>()[r];
    }
}

}  // namespace loom::model
