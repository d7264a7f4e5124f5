#include "core/error.h"
#include "train/options.h"

#include <cstdlib>
#include <unistd.h>

namespace loom::train {

MemoryEstimate estimate_memory(const TrainOptions & o) {
    const model::GptConfig & m = o.model;
    const double h = static_cast<double>(m.hidden_size), f = static_cast<double>(m.ffn_hidden_size);
    const double L = static_cast<double>(m.num_layers), V = static_cast<double>(m.vocab_size);
    const double s = static_cast<double>(m.seq_length);
    const double b = static_cast<double>(o.micro_batch_size);
    const double tp = static_cast<double>(o.parallel.tp()), pp = static_cast<double>(o.parallel.pp());
    const double dp = static_cast<double>(o.parallel.dp());
    // Parameters in double (an int64 count could overflow): embeddings, and per layer QKV, projection, MLP.
    const double per_layer = 4 * h * h + h * f * (m.swiglu ? 3 : 2) + 8 * h;
    const double params    = (V * h * (m.untie_embeddings_and_output_weights ? 2 : 1) +
                           static_cast<double>(m.max_position_embeddings) * h + L * per_layer) / (tp * pp);
    MemoryEstimate e;
    // Megatron-FSDP keeps only the shards of what its strategy shards (ddp_and_optimizers.md 1.16).
    e.weights   = params * (o.bf16 || o.fp16 ? 2 : 4) / (o.ddp.shards_params() ? dp : 1);
    const double stepped = o.ddp.use_distributed_optimizer ? dp : 1;   // the optimizer's share
    e.grads = o.ddp.grad_reduce_in_fp32 ? params * 4 / (o.ddp.shards_grads() ? dp : 1)
                                        : params * 2 + params * 4 / stepped;   // 16-bit buffers, f32 copies
    e.optimizer = params * (o.bf16 || o.fp16 ? 12 : 8) / stepped;
    const double in_flight = std::min(pp, static_cast<double>(std::max<int64_t>(1, o.num_microbatches())));
    e.activations = in_flight * (L / pp * s * b * h * 34 * 2 / tp + 3 * 4 * s * b * V / tp);
    return e;
}

void check_memory(const TrainOptions & o, int64_t world_size) {
    const MemoryEstimate e = estimate_memory(o);
    int64_t ranks_here = world_size;   // the ranks sharing this machine's memory
    if (const char * local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) ranks_here = std::max(1L, std::atol(local));
    const double machine = static_cast<double>(sysconf(_SC_PHYS_PAGES)) * static_cast<double>(sysconf(_SC_PAGE_SIZE));
    const double gib     = 1024.0 * 1024.0 * 1024.0;
    LOOM_CHECK(e.total() * static_cast<double>(ranks_here) <= machine,
               "the model and batch need an estimated " << e.total() / gib << " GiB per rank (weights "
                   << e.weights / gib << ", gradients " << e.grads / gib << ", optimizer " << e.optimizer / gib
                   << ", activations " << e.activations / gib << ") x " << ranks_here << " rank(s), and this machine has "
                   << machine / gib << " GiB",
               "lower --num-layers, --hidden-size, --ffn-hidden-size, --vocab-size, --seq-length or "
               "--micro-batch-size, or shard the model (--tensor-model-parallel-size, --pipeline-model-parallel-size, "
               "--use-distributed-optimizer, --use-megatron-fsdp)");
}

}  // namespace loom::train
