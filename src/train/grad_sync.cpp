#include "train/grad_sync.h"

namespace loom::train {

GradSync::GradSync(ddp::DistributedDataParallel * ddp, std::vector<model::GptModel *> chunks,
                   std::vector<model::Parameter *> params, ddp::FinalizeGroups groups, Device & device)
    : ddp_(ddp), chunks_(std::move(chunks)), params_(std::move(params)), groups_(groups), device_(device) {
    if (ddp_) {
        ready_ = ddp_->grad_ready();
        last_  = [d = ddp_](bool last) { d->set_last_microbatch(last); };
    }
}

void GradSync::begin() {
    if (ddp_) {
        ddp_->zero_grad_buffer();
    } else {
        for (model::GptModel * chunk : chunks_) chunk->zero_grad();
    }
}

void GradSync::restart() {
    wait_reductions();   // the first run's reductions, before their buffers are zeroed
    begin();
}

void GradSync::finish() { ddp::finalize_grads(ddp_, params_, groups_, device_); }

void GradSync::wait_reductions() {
    if (ddp_) ddp_->finish_grad_sync();
}

void GradSync::start_gather() {
    if (ddp_) ddp_->start_param_sync();   // a no-op without the distributed optimizer
}

void GradSync::whole() {
    if (ddp_) ddp_->finish_param_sync();
}

}  // namespace loom::train
