#include "optim/distributed_optimizer.h"

#include "core/error.h"

namespace loom::optim {

DistributedOptimizer::DistributedOptimizer(ddp::DistributedDataParallel & ddp, const OptimizerOptions & options,
                                           comm::Communicator * model_parallel, comm::Communicator * expert_model_parallel)
    : Optimizer(ddp.params(), options,
                NormGroups{&ddp.dp_group(), model_parallel, &ddp.expert_dp_group(), expert_model_parallel}),
      ddp_(ddp) {
    LOOM_CHECK(ddp_.config().use_distributed_optimizer, "DistributedOptimizer over buffers laid out without it",
               "construct DDP with use_distributed_optimizer");
    struct Piece {
        int             param;    // index into ddp.params()
        int             buffer;
        int             bucket;
        ddp::ShardRange range;
    };
    std::vector<Piece>  pieces;
    const ddp::Layout & layout = ddp_.layout();
    for (size_t b = 0; b < layout.buffers.size(); ++b) {
        const ddp::BufferLayout & buffer = layout.buffers[b];
        LOOM_CHECK(buffer.param_dtype == DType::f32 || dtype_is_half(buffer.param_dtype) || buffer.param_dtype == DType::u8,
                   "distributed optimizer over " << dtype_name(buffer.param_dtype) << " parameters",
                   "parameters are float32, bfloat16 or float16, or FP8 codes (u8) with f32 main values");
        const std::vector<std::vector<ddp::ShardRange>> ranges = ddp::shard_ranges(buffer, ddp_.buffer_group(static_cast<int>(b)).rank());
        for (size_t k = 0; k < ranges.size(); ++k) {
            for (const ddp::ShardRange & r : ranges[k]) {
                pieces.push_back(Piece{r.param, static_cast<int>(b), static_cast<int>(k), r});
                owned_ += r.gbuf_world_end - r.gbuf_world_start;
            }
        }
    }
    // The slot order of docs/design/ddp_and_optimizers.md 2.3, which decides what an offload fraction offloads (3.2):
    // the param groups with the default weight decay first, then the no-decay group (biases, norms); inside a group,
    // f32-native pieces before 16-bit ones; each in buffer, bucket, placement order (the pieces' order).
    std::vector<HybridSlot> slots;
    std::vector<int>        slot_params;
    std::vector<int64_t>    slot_offsets;
    std::vector<GradView>   views;
    for (int group = 0; group < 2; ++group) {
        for (int native = 1; native >= 0; --native) {
            for (const Piece & piece : pieces) {
                const model::Parameter * p = ddp_.params()[piece.param];
                if (static_cast<int>(p->no_weight_decay) != group || (p->data.dtype() == DType::f32) != (native == 1)) {
                    continue;
                }
                Tensor values = ddp_.param_shard(piece.buffer, piece.bucket, piece.range);
                Tensor grad   = ddp_.grad_shard(piece.buffer, piece.bucket, piece.range);
                slots.push_back(HybridSlot{values, grad, p->no_weight_decay ? 0.0f : options.adam.weight_decay,
                                           p->embedding_or_output});
                slot_params.push_back(piece.param);
                slot_offsets.push_back(piece.range.param_start);
                // Counted once: on the first stage (not the tied copy), on TP rank 0 for replicated ones.
                views.push_back(GradView{grad, !p->shared && !p->tp_duplicate, p->expert});
            }
        }
    }
    init(std::move(slots), std::move(slot_params), std::move(slot_offsets), std::move(views));
}

}  // namespace loom::optim
