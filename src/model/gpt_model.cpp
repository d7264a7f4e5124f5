#include "model/gpt_model.h"

#include "backend/cpu/gemm.h"
#include "backend/cpu/ops.h"

namespace loom::model {

GptModel::GptModel(const GptConfig & config, Device & device, const PipelineStage & stage)
    : config_(config), stage_(stage), device_(device), vocab_(config.padded_vocab_size()) {
    config_.validate();
    if (stage_.num_layers < 0) stage_.num_layers = config_.num_layers - stage_.first_layer;
    LOOM_CHECK(stage_.first_layer >= 0 && stage_.num_layers >= 0 &&
                   stage_.first_layer + stage_.num_layers <= config_.num_layers,
               "pipeline stage with layers [" << stage_.first_layer << ", " << stage_.first_layer + stage_.num_layers
                                              << ") of a model with --num-layers " << config_.num_layers, "");
    DType dtype = config_.params_dtype;
    bool  tied  = !config_.untie_embeddings_and_output_weights;
    if (stage_.pre_process || (stage_.post_process && tied)) {
        wte_ = parameter_create("embedding.word_embeddings.weight", {vocab_, config_.hidden_size}, dtype, device);
        wte_.shared_embedding    = tied;
        wte_.tensor_parallel_dim = 0;
        wte_.shared              = !stage_.pre_process;
    }
    if (stage_.pre_process && config_.position_embedding == PositionEmbedding::learned_absolute) {
        wpe_ = parameter_create("embedding.position_embeddings.weight",
                                {config_.max_position_embeddings, config_.hidden_size}, dtype, device);
    }
    for (int64_t i = stage_.first_layer; i < stage_.first_layer + stage_.num_layers; ++i) {
        layers_.push_back(std::make_unique<TransformerLayer>(i, config_, device));
    }
    if (stage_.post_process) {
        final_norm_ = std::make_unique<Norm>("final_norm", config_.hidden_size, config_.normalization,
                                             config_.norm_epsilon, dtype, device);
        if (!tied) {
            output_ = parameter_create("output_layer.weight", {vocab_, config_.hidden_size}, dtype, device);
            output_.tensor_parallel_dim = 0;
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
        if (wte_.data.dtype() == DType::f32) {
            cpu::embedding_forward(tokens, wte_.data.data<float>(),
                                   wpe_.data.defined() ? wpe_.data.data<float>() : nullptr, x.data<float>(), s, b, h);
        } else {
            auto bits = [](const Parameter & p) {
                return p.data.defined() ? static_cast<const uint16_t *>(p.data.data_ptr()) : nullptr;
            };
            cpu::embedding_forward(tokens, bits(wte_), bits(wpe_), x.data<float>(), s, b, h);
        }
    } else {
        LOOM_CHECK(input.defined() && input.numel() == s * b * h,
                   "pipeline stage input of " << (input.defined() ? input.numel() : 0) << " elements, expected "
                                              << s * b * h << " (s x b x h)", "");
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
    ctx.final_hidden = in_dtype(final_norm_->forward(ctx.final_norm, x), dtype);
    ctx.logits     = activation(device_, s * b, vocab_);
    ctx.lse        = activation(device_, s * b, 1);
    ctx.token_loss = activation(device_, s * b, 1);
    cpu::gemm(false, true, s * b, vocab_, h, ctx.final_hidden.data_ptr(), out_w.data.data_ptr(), dtype,
              ctx.logits.data<float>());
    cpu::cross_entropy_forward(ctx.logits.data<float>(), batch.labels.data<int32_t>(), ctx.token_loss.data<float>(),
                               ctx.lse.data<float>(), s, b, vocab_, config_.vocab_size);
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
        cpu::cross_entropy_backward(ctx.logits.data<float>(), ctx.batch.labels.data<int32_t>(), ctx.lse.data<float>(),
                                    dloss.data<float>(), s, b, vocab_, config_.vocab_size);
        Parameter & out_w   = output_.data.defined() ? output_ : wte_;
        DType       dtype   = out_w.data.dtype();
        Tensor      dlogits = in_dtype(ctx.logits, dtype);
        ctx.logits          = Tensor();
        dx                  = activation(device_, s * b, h);
        cpu::gemm(false, false, s * b, h, vocab_, dlogits.data_ptr(), out_w.data.data_ptr(), dtype, dx.data<float>());
        cpu::gemm(true, false, vocab_, h, s * b, dlogits.data_ptr(), ctx.final_hidden.data_ptr(), dtype,
                  out_w.main_grad.data<float>(), true);
        ctx.lse = ctx.token_loss = ctx.final_hidden = Tensor();
        dlogits = Tensor();
        // The output weight is final here, unless the same tensor also embeds tokens on this stage.
        if (ready && (output_.data.defined() || !stage_.pre_process)) ready(out_w);
        dx = final_norm_->backward(ctx.final_norm, dx, ready);
    } else {
        LOOM_CHECK(dy.defined() && dy.numel() == s * b * h,
                   "pipeline stage output gradient of " << (dy.defined() ? dy.numel() : 0) << " elements, expected "
                                                        << s * b * h, "");
        dx = dy;
    }
    for (size_t i = layers_.size(); i-- > 0;) {
        dx = layers_[i]->backward(ctx.layers[i], dx, ready);
    }
    if (stage_.pre_process) {
        cpu::embedding_backward(ctx.batch.tokens.data<int32_t>(), dx.data<float>(), wte_.main_grad.data<float>(),
                                wpe_.data.defined() ? wpe_.main_grad.data<float>() : nullptr, s, b, h, vocab_);
        if (ready) {
            if (wpe_.data.defined()) ready(wpe_);
            ready(wte_);   // tied on one stage: both the output-layer and the embedding contributions are in
        }
        dx = Tensor();
    }
    ctx.batch = MicroBatch{};
    return dx;
}

}  // namespace loom::model
