#include "optim/distributed_optimizer.h"

#include "core/error.h"
#include "core/host_adam.h"

#include <cmath>

namespace loom::optim {

DistributedOptimizer::DistributedOptimizer(ddp::DistributedDataParallel & ddp, const AdamWConfig & config,
                                           const std::optional<HybridOptions> & offload)
    : ddp_(ddp), config_(config) {
    LOOM_CHECK(ddp_.config().use_distributed_optimizer, "DistributedOptimizer over buffers laid out without it",
               "construct DDP with use_distributed_optimizer");
    const ddp::Layout & layout = ddp_.layout();
    for (size_t b = 0; b < layout.buffers.size(); ++b) {
        const ddp::BufferLayout & buffer = layout.buffers[b];
        int64_t                   state  = 0;
        for (const std::vector<ddp::ShardRange> & bucket : ddp::shard_ranges(buffer, ddp_.dp_rank())) {
            for (const ddp::ShardRange & r : bucket) {
                int64_t n = r.gbuf_world_end - r.gbuf_world_start;
                pieces_.push_back(Piece{r.param, static_cast<int>(b), r.gbuf_world_start, n, state});
                state += n;
            }
        }
        owned_ += state;
        if (offload) {
            master_.emplace_back();
            continue;
        }
        Device &      device = ddp_.grad_buffer(static_cast<int>(b)).device();
        TensorOptions options{MemoryKind::device, "optimizer"};
        exp_avg_.push_back(Tensor::zeros({state}, DType::f32, device, options));
        exp_avg_sq_.push_back(Tensor::zeros({state}, DType::f32, device, options));
        Tensor master;
        if (buffer.param_dtype != DType::f32) {
            LOOM_CHECK(buffer.param_dtype == DType::bf16, "distributed optimizer over "
                                                              << dtype_name(buffer.param_dtype) << " parameters",
                       "parameters are float32 or bfloat16");
            master = Tensor::empty({state}, DType::f32, device, options);
        }
        master_.push_back(master);
    }
    if (offload) {
        // Spec 3.2's HDO order, which decides what a fraction offloads: the param groups with the default
        // weight decay first, then the no-decay group (biases, norms); inside a group, f32-native shards
        // before 16-bit ones; each in buffer, bucket, placement order (the pieces' order).
        std::vector<const Piece *> order;
        for (int group = 0; group < 2; ++group) {
            for (int native = 1; native >= 0; --native) {
                for (const Piece & piece : pieces_) {
                    const model::Parameter * p = ddp_.params()[piece.param];
                    if (static_cast<int>(p->no_weight_decay) == group && (p->data.dtype() == DType::f32) == (native == 1)) {
                        order.push_back(&piece);
                    }
                }
            }
        }
        std::vector<HybridSlot> slots;
        for (const Piece * slot_piece : order) {
            const Piece &            piece = *slot_piece;
            const model::Parameter * p     = ddp_.params()[piece.param];
            slot_params_.push_back(piece.param);
            Tensor values = ddp_.param_buffer(piece.buffer).slice(piece.world_start, {piece.numel});
            Tensor grad   = ddp_.grad_buffer(piece.buffer).slice(piece.world_start, {piece.numel});
            slots.push_back(HybridSlot{values, grad, p->no_weight_decay ? 0.0f : config_.weight_decay});
        }
        hybrid_ = std::make_unique<HybridDeviceOptimizer>(ddp_.grad_buffer(0).device(), std::move(slots), config_,
                                                          *offload);
        return;
    }
    // f32 masters start from the (identical on every rank) model weights.
    for (const Piece & piece : pieces_) {
        if (!master_[piece.buffer].defined()) continue;
        const uint16_t * w = static_cast<const uint16_t *>(ddp_.param_buffer(piece.buffer).data_ptr()) + piece.world_start;
        convert_bf16_to_f32(w, master_[piece.buffer].data<float>() + piece.state, static_cast<size_t>(piece.numel));
    }
}

DistributedOptimizer::StepResult DistributedOptimizer::step(float lr, float clip_grad,
                                                            comm::Communicator * model_parallel) {
    StepResult result;
    double     local = 0;
    ddp_.grad_buffer(0).device().compute_stream().synchronize();   // the host reads the reduced gradients
    for (const Piece & piece : pieces_) {
        const model::Parameter * p = ddp_.params()[piece.param];
        if (p->shared || p->tp_duplicate) continue;   // counted once: on the first stage, on TP rank 0
        const float * g = ddp_.grad_buffer(piece.buffer).data<float>() + piece.world_start;
        double        s = 0;
        for (int64_t i = 0; i < piece.numel; ++i) s += static_cast<double>(g[i]) * g[i];
        local += s;
    }
    // Over the data-parallel group (each element is owned by one rank), then over the model-parallel ranks.
    Device & device = ddp_.grad_buffer(0).device();
    double   total  = group_sum(local, ddp_.dp_group(), device);
    if (model_parallel) total = group_sum(total, *model_parallel, device);
    result.grad_norm = std::sqrt(total);
    if (!std::isfinite(result.grad_norm)) {
        return result;
    }
    const float coeff = clip_coefficient(result.grad_norm, clip_grad);
    if (coeff != 1.0f) {
        for (const Piece & piece : pieces_) {
            float * g = ddp_.grad_buffer(piece.buffer).data<float>() + piece.world_start;
            for (int64_t i = 0; i < piece.numel; ++i) g[i] *= coeff;
        }
    }
    ++step_;
    if (hybrid_) {
        hybrid_->step(lr);   // the host sees the updated shard on return
        result.stepped = true;
        ddp_.start_param_sync();
        return result;
    }
    for (const Piece & piece : pieces_) {
        model::Parameter * p = ddp_.params()[piece.param];
        float *            g = ddp_.grad_buffer(piece.buffer).data<float>() + piece.world_start;
        float      wd     = p->no_weight_decay ? 0.0f : config_.weight_decay;
        float *    m      = exp_avg_[piece.buffer].data<float>() + piece.state;
        float *    v      = exp_avg_sq_[piece.buffer].data<float>() + piece.state;
        Tensor &   params = ddp_.param_buffer(piece.buffer);
        if (master_[piece.buffer].defined()) {
            host_adam_step(master_[piece.buffer].data<float>() + piece.state, g, m, v, piece.numel, lr, config_.beta1,
                           config_.beta2, config_.eps, wd, step_,
                           HostAdamOut{static_cast<uint16_t *>(params.data_ptr()) + piece.world_start, DType::bf16});
        } else {
            host_adam_step(params.data<float>() + piece.world_start, g, m, v, piece.numel, lr, config_.beta1,
                           config_.beta2, config_.eps, wd, step_);
        }
    }
    result.stepped = true;
    ddp_.start_param_sync();
    return result;
}

}  // namespace loom::optim
