#include "ddp/finalize_grads.h"

namespace loom::ddp {

void finalize_grads(DistributedDataParallel * ddp, const std::vector<model::Parameter *> & params,
                    const FinalizeGroups & groups, Device & device) {
    if (ddp) ddp->finish_grad_sync();
    Stream & stream = device.compute_stream();
    if (groups.embedding && groups.embedding->size() > 1) {
        for (model::Parameter * p : params) {
            if (!p->shared_embedding) continue;
            // FSDP with sharded gradients: the word embedding is alone in its bucket on both stages (the
            // distributed optimizer's layout), so the two stages' pieces cover the same elements.
            for (const Tensor & grad : ddp ? ddp->reduced_grads(*p) : std::vector<Tensor>{p->main_grad}) {
                groups.embedding->all_reduce(grad, comm::ReduceOp::sum, &stream);
            }
        }
    }
    if (groups.tp && groups.tp->size() > 1) {
        for (model::Parameter * p : params) {
            if (!p->sequence_parallel) continue;
            // FSDP with sharded gradients: the TP peers' shards cover the same elements (same layout, same
            // data-parallel rank), so the pieces sum as the whole gradients would.
            for (const Tensor & grad : ddp ? ddp->reduced_grads(*p) : std::vector<Tensor>{p->main_grad}) {
                groups.tp->all_reduce(grad, comm::ReduceOp::sum, &stream);
            }
        }
    }
}

}  // namespace loom::ddp
