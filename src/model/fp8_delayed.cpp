#include "model/fp8_delayed.h"

#include "comm/communicator.h"
#include "core/allocator.h"
#include "core/device.h"
#include "core/error.h"
#include "core/ops.h"

#include <vector>

namespace loom::model {

Fp8Delayed::Fp8Delayed(Fp8Format format, int64_t history_len, bool max_algo, int margin)
    : format_(format), len_(history_len), max_algo_(max_algo), margin_(margin) {
    LOOM_CHECK(history_len >= 1, "--fp8-amax-history-len must be at least 1, got " << history_len, "");
}

int64_t Fp8Delayed::add(int64_t count) {
    LOOM_CHECK(!allocated(), "an FP8 operand added after its delayed-scaling state was allocated", "");
    const int64_t first = slots_;
    slots_ += count;
    return first;
}

void Fp8Delayed::allocate(Device & device) {
    if (slots_ == 0) return;
    history_ = Tensor::zeros({len_, slots_}, DType::f32, device, {MemoryKind::device, "weights"});
    scale_   = Tensor::empty({slots_}, DType::f32, device, {MemoryKind::device, "weights"});
    write_values_f32(scale_, std::vector<float>(static_cast<size_t>(slots_), 1.0f));
}

Fp8Delayed::Operand Fp8Delayed::operand(int64_t slot, bool record) const {
    return Operand{scale_.slice(slot, {1}), record && recording_ ? history_.flatten().slice(slot, {1}) : Tensor()};
}

Tensor Fp8Delayed::snapshot(int64_t first, int64_t count) const {
    Device & device = scale_.device();
    Tensor   out    = Tensor::empty({count}, DType::f32, device, {MemoryKind::device, kActivationsPool});
    device.ops().copy(device.compute_stream(), scale_.slice(first, {count}), out);
    return out;
}

void Fp8Delayed::update(comm::Communicator * group) const {
    if (!allocated()) return;
    Device & device = history_.device();
    Stream & stream = device.compute_stream();
    if (group && group->size() > 1) group->all_reduce(history_.flatten().slice(0, {slots_}), comm::ReduceOp::max, &stream);
    device.ops().fp8_delayed_update(stream, history_, scale_, format_, margin_, max_algo_);
}

}  // namespace loom::model
