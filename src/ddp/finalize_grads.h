// finalize_grads: what happens to the gradients between the last backward and the optimizer (Megatron's
// finalize_model_grads), in this order:
//   1. DDP finishes the data-parallel reduction (launching what --overlap-grad-reduce did not) and waits;
//   2. the tied word embedding: the first stage's embedding gradient plus the last stage's output-layer
//      gradient, on both (an all-reduce over the embedding group, when it spans two ranks). After the
//      data-parallel reduction: with the distributed optimizer both stages hold the same owned range, the
//      embedding being alone in its bucket on each;
//   3. sequence parallelism: norms and row-parallel biases saw this rank's rows only; their gradients are
//      summed over the TP group (the whole main_grad: with ZeRO-1 the TP ranks' layouts are the same, so
//      the owned ranges match).
// Steps 2 and 3 are ordered on the device's compute stream (the optimizer's norm reads them there).
#pragma once

#include "comm/communicator.h"
#include "ddp/ddp.h"
#include "model/parameter.h"

#include <vector>

namespace loom::ddp {

struct FinalizeGroups {
    comm::Communicator * embedding = nullptr;   // the first and last pipeline stages (null: none)
    comm::Communicator * tp        = nullptr;   // the tensor-parallel group (null: none)
};

// ddp null: no data-parallel reduction (one rank).
void finalize_grads(DistributedDataParallel * ddp, const std::vector<model::Parameter *> & params,
                    const FinalizeGroups & groups, Device & device);

}  // namespace loom::ddp
