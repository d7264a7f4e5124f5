#include "optim/hybrid_optimizer.h"

#include "core/error.h"
#include "core/host_adam.h"
#include "core/ops.h"

#include <algorithm>

namespace loom::optim {

std::vector<bool> hybrid_offload_split(const std::vector<int64_t> & numels, double fraction) {
    LOOM_CHECK(fraction >= 0.0 && fraction <= 1.0, "--optimizer-offload-fraction " << fraction << " is outside [0, 1]",
               "give a fraction of the optimizer state between 0 and 1");
    int64_t total = 0;
    for (int64_t n : numels) total += n;
    const double      threshold = static_cast<double>(total) * fraction;
    int64_t           offloaded = 0;
    std::vector<bool> result(numels.size(), false);
    for (size_t i = 0; i < numels.size(); ++i) {
        if (static_cast<double>(offloaded) < threshold) {   // tested before adding: the crossing slot goes whole
            result[i] = true;
            offloaded += numels[i];
        }
    }
    return result;
}

HybridDeviceOptimizer::HybridDeviceOptimizer(Device & device, std::vector<HybridSlot> slots,
                                             const AdamWConfig & config, const HybridOptions & options)
    : device_(device), config_(config), options_(options) {
    std::vector<int64_t> numels;
    for (const HybridSlot & s : slots) {
        LOOM_CHECK(s.values.defined() && (s.values.dtype() == DType::f32 || dtype_is_half(s.values.dtype())),
                   "hybrid optimizer slot " << numels.size() << " has no f32, bf16 or f16 values",
                   "parameters are float32, bfloat16 or float16");
        LOOM_CHECK(!s.grad.defined() || (s.grad.dtype() == DType::f32 && s.grad.numel() == s.values.numel()),
                   "hybrid optimizer slot " << numels.size() << ": the gradient must be f32 with the values' numel",
                   "");
        numels.push_back(s.values.numel());
    }
    std::vector<bool> offload = hybrid_offload_split(numels, options_.offload_fraction);

    int64_t dev_numel = 0, dev_v = 0, dev_master = 0, host_numel = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
        SlotInfo info;
        info.slot      = std::move(slots[i]);
        info.offloaded = offload[i];
        int64_t n      = info.slot.values.numel();
        LOOM_CHECK(!info.offloaded || !info.slot.momentum_only,
                   "hybrid optimizer slot " << i << " is a Muon matrix's, offloaded to the host", "the host step is AdamW's");
        if (info.offloaded) {
            info.state   = host_numel;
            info.v_state = host_numel;
            host_numel += n;
        } else {
            info.state = dev_numel;
            dev_numel += n;
            if (!info.slot.momentum_only) {
                info.v_state = dev_v;
                dev_v += n;
            }
            if (dtype_is_half(info.slot.values.dtype())) {
                info.master = dev_master;
                dev_master += n;
            }
        }
        slots_.push_back(std::move(info));
    }

    TensorOptions dev_options{MemoryKind::device, "optimizer"};
    dev_m_ = Tensor::zeros({dev_numel}, DType::f32, device_, dev_options);
    dev_v_ = Tensor::zeros({dev_v}, DType::f32, device_, dev_options);
    if (dev_master > 0) dev_master_ = Tensor::empty({dev_master}, DType::f32, device_, dev_options);

    auto host_array = [&](HostArray & a, bool pinned) {
        if (host_numel == 0) return;
        if (pinned) {
            a.tensor = Tensor::zeros({host_numel}, DType::f32, device_, TensorOptions{MemoryKind::pinned_host, "optimizer"});
        } else {
            a.pageable.assign(static_cast<size_t>(host_numel), 0.0f);
            // Pageable memory says so: copies stage it, and no kernel is handed it (step() converts through a
            // device copy).
            const MemoryKind kind = device_.type() == DeviceType::cpu ? MemoryKind::device : MemoryKind::pageable_host;
            a.tensor = Tensor::from_blob(a.pageable.data(), {host_numel}, DType::f32, device_, kind);
        }
    };
    host_array(host_master_, options_.pin_cpu_params);
    host_array(host_m_, options_.pin_cpu_params);
    host_array(host_v_, options_.pin_cpu_params);
    host_array(host_grad_, options_.pin_cpu_grads);

    // Masters start from the model values, after the compute stream has written them; host groups: one
    // per slot with overlap, else one in all.
    for (int i = 0; i < num_slots(); ++i) {
        SlotInfo &      s  = slots_[static_cast<size_t>(i)];
        HybridSlotState st = slot_state(i);
        if (!st.master.shares_storage(s.slot.values)) device_.ops().convert(device_.compute_stream(), s.slot.values, st.master);
        if (!s.offloaded) continue;
        if (options_.overlap_d2h_h2d || groups_.empty()) groups_.emplace_back();
        groups_.back().push_back(i);
    }
    device_.compute_stream().synchronize();

    if (!groups_.empty()) {   // host work: the side streams
        d2h_ = device_.stream_create("hdo-d2h");
        h2d_ = device_.stream_create("hdo-h2d");
    }
    start_ = device_.event_create();
    for (size_t g = 0; g < groups_.size(); ++g) {
        d2h_events_.push_back(device_.event_create());
        h2d_events_.push_back(device_.event_create());
    }
}

HybridDeviceOptimizer::~HybridDeviceOptimizer() {
    // Queued copies may point into this object's pageable host buffers (on the side streams, or on the
    // compute stream without overlap).
    if (groups_.empty()) return;
    for (Stream * s : {&device_.compute_stream(), d2h_.get(), h2d_.get()}) {
        if (!s) continue;
        try {
            s->synchronize();
        } catch (...) {
        }
    }
}

void HybridDeviceOptimizer::set_grad(int slot, Tensor grad) {
    LOOM_CHECK(slot >= 0 && slot < num_slots(), "hybrid optimizer slot " << slot << " of " << num_slots(), "");
    SlotInfo & s = slots_[static_cast<size_t>(slot)];
    LOOM_CHECK(!grad.defined() || (grad.dtype() == DType::f32 && grad.numel() == s.slot.values.numel()),
               "hybrid optimizer slot " << slot << ": the gradient must be f32 with the values' numel", "");
    s.slot.grad = std::move(grad);
}

void HybridDeviceOptimizer::set_weight_decay(int slot, float weight_decay) {
    LOOM_CHECK(slot >= 0 && slot < num_slots(), "hybrid optimizer slot " << slot << " of " << num_slots(), "");
    slots_[static_cast<size_t>(slot)].slot.weight_decay = weight_decay;
}

Stream & HybridDeviceOptimizer::h2d_stream() {
    LOOM_CHECK(h2d_ != nullptr, "the hybrid optimizer has no H2D stream: no slot is offloaded", "");
    return *h2d_;
}

Stream & HybridDeviceOptimizer::d2h_stream() {
    LOOM_CHECK(d2h_ != nullptr, "the hybrid optimizer has no D2H stream: no slot is offloaded", "");
    return *d2h_;
}

int HybridDeviceOptimizer::num_offloaded() const {
    int k = 0;
    for (const SlotInfo & s : slots_) k += s.offloaded ? 1 : 0;
    return k;
}

int64_t HybridDeviceOptimizer::offloaded_numel() const {
    int64_t n = 0;
    for (const SlotInfo & s : slots_) n += s.offloaded ? s.slot.values.numel() : 0;
    return n;
}

// `t` where a kernel on `stream` can read it: itself, or (pageable host memory, --no-pin-cpu-params) a device
// copy made on `stream`, freed in stream order after its reader.
Tensor HybridDeviceOptimizer::kernel_readable(Stream & stream, const Tensor & t) const {
    if (t.memory_kind() != MemoryKind::pageable_host) return t;
    Tensor staged = Tensor::empty(t.shape(), t.dtype(), device_, TensorOptions{MemoryKind::device, "optimizer-staging"});
    device_.ops().copy(stream, t, staged);
    return staged;
}

HybridSlotState HybridDeviceOptimizer::slot_state(int slot) const {
    LOOM_CHECK(slot >= 0 && slot < num_slots(), "hybrid optimizer slot " << slot << " of " << num_slots(), "");
    const SlotInfo & s = slots_[static_cast<size_t>(slot)];
    HybridSlotState  r;
    r.offloaded = s.offloaded;
    r.numel     = s.slot.values.numel();
    if (s.offloaded) {
        r.master     = host_master_.slice(s.state, r.numel);
        r.exp_avg    = host_m_.slice(s.state, r.numel);
        r.exp_avg_sq = host_v_.slice(s.state, r.numel);
    } else {
        r.master     = s.master >= 0 ? dev_master_.slice(s.master, {r.numel}) : s.slot.values;
        r.exp_avg    = dev_m_.slice(s.state, {r.numel});
        if (s.v_state >= 0) r.exp_avg_sq = dev_v_.slice(s.v_state, {r.numel});
    }
    return r;
}

void HybridDeviceOptimizer::step(float lr, Stream * current, std::optional<float> decoupled_lr, const Tensor & gate,
                                 std::optional<float> hidden_lr) {
    LOOM_CHECK(!gate.defined() || groups_.empty(), "a step gated on the device with " << num_offloaded()
                                                       << " slots offloaded to the host", "");
    ++step_;   // the one step counter (hazard d)
    const bool    overlap = options_.overlap_d2h_h2d;
    Ops &         ops     = device_.ops();
    // Without a caller's stream the host sees the values on return: the work runs on the compute stream,
    // after what produced the gradients, and the host waits for it at the end.
    Stream &      cur     = current ? *current : device_.compute_stream();
    // The side streams exist only when a slot is offloaded (overlap with nothing offloaded uses none).
    Stream &      d2h     = overlap && d2h_ ? *d2h_ : cur;
    Stream &      h2d     = overlap && h2d_ ? *h2d_ : cur;
    const AdamWConfig c   = config_;
    auto slot_lr = [&](const HybridSlot & slot) {
        if (slot.mup_hidden && hidden_lr) return *hidden_lr;
        return slot.decoupled_lr && decoupled_lr ? *decoupled_lr : lr;
    };
    auto slot_eps = [&](const HybridSlot & slot) { return slot.eps_scale == 1.0f ? c.eps : c.eps * slot.eps_scale; };
    auto args    = [&](const HybridSlot & slot) {
        return AdamStep{slot_lr(slot), c.beta1, c.beta2, slot_eps(slot), slot.weight_decay, step_};
    };

    // Which slots have a gradient this step, decided once (hazard c: the others are not touched).
    std::vector<bool> has_grad(slots_.size());
    for (size_t i = 0; i < slots_.size(); ++i) has_grad[i] = slots_[i].slot.grad.defined();

    // 1. Gradients are final and earlier readers of the values are done.
    if (overlap && !groups_.empty()) {
        cur.record(*start_);
        d2h.wait(*start_);
        h2d.wait(*start_);
    }

    // 2. D2H gradient copies, one event per host group.
    for (size_t g = 0; g < groups_.size(); ++g) {
        for (int i : groups_[g]) {
            if (!has_grad[static_cast<size_t>(i)]) continue;
            const SlotInfo & s = slots_[static_cast<size_t>(i)];
            ops.copy(d2h, s.slot.grad, host_grad_.slice(s.state, s.slot.values.numel()));
        }
        d2h.record(*d2h_events_[g]);
    }

    // 3. The device part, on the caller's stream: after whatever produced or cast the gradients (hazard a).
    // One multi-tensor AdamW over the slots (a few launches on a GPU), then the f16 values' rounding passes.
    std::vector<AdamwTensors> device_part;
    std::vector<size_t>       rounded;   // f16 values: the master steps, then a rounding pass writes them
    for (size_t i = 0; i < slots_.size(); ++i) {
        const SlotInfo & s = slots_[i];
        if (s.offloaded || !has_grad[i] || s.slot.momentum_only) continue;   // a Muon matrix steps in Muon
        const int64_t n = s.slot.values.numel();
        if (s.master >= 0 && s.slot.values.dtype() == DType::bf16) {   // the f32 master steps, the values get it rounded
            device_part.push_back({dev_master_.slice(s.master, {n}), s.slot.grad, dev_m_.slice(s.state, {n}),
                                   dev_v_.slice(s.v_state, {n}), s.slot.values, args(s.slot)});
        } else if (s.master >= 0) {
            device_part.push_back({dev_master_.slice(s.master, {n}), s.slot.grad, dev_m_.slice(s.state, {n}),
                                   dev_v_.slice(s.v_state, {n}), Tensor(), args(s.slot)});
            rounded.push_back(i);
        } else {               // f32 values are their own master
            device_part.push_back({s.slot.values, s.slot.grad, dev_m_.slice(s.state, {n}), dev_v_.slice(s.v_state, {n}),
                                   Tensor(), args(s.slot)});
        }
    }
    if (gate.defined()) {
        ops.adamw_multi_gated(cur, device_part, gate);
    } else {
        ops.adamw_multi(cur, device_part);
    }
    for (size_t i : rounded) {
        const SlotInfo & s = slots_[i];
        ops.convert(cur, dev_master_.slice(s.master, {s.slot.values.numel()}), s.slot.values);
    }

    // 4. Host groups in order: wait for the gradients, step, copy the values back on h2d.
    for (size_t g = 0; g < groups_.size(); ++g) {
        d2h_events_[g]->synchronize();
        for (int i : groups_[g]) {
            if (!has_grad[static_cast<size_t>(i)]) continue;
            SlotInfo &    s = slots_[static_cast<size_t>(i)];
            const int64_t n = s.slot.values.numel();
            host_adam_step(host_master_.data() + s.state, host_grad_.data() + s.state, host_m_.data() + s.state,
                           host_v_.data() + s.state, n, slot_lr(s.slot), c.beta1, c.beta2, slot_eps(s.slot), s.slot.weight_decay,
                           step_);
            ops.convert(h2d, kernel_readable(h2d, host_master_.slice(s.state, n)), s.slot.values);
        }
        h2d.record(*h2d_events_[g]);
        if (overlap && !options_.unsafe_skip_h2d_wait) {
            cur.wait(*h2d_events_[g]);   // the h2d event (upstream once waited on the d2h one)
        }
    }

    if (!current) cur.synchronize();
}

void HybridDeviceOptimizer::synchronize() const {
    device_.compute_stream().synchronize();
    for (Stream * s : {d2h_.get(), h2d_.get()}) {
        if (s) s->synchronize();
    }
}

HybridStateDict HybridDeviceOptimizer::state_dict() const {
    synchronize();
    HybridStateDict state;
    state.step = step_;
    for (int i = 0; i < num_slots(); ++i) {
        HybridSlotState     st = slot_state(i);
        HybridSlotStateDict slot;
        slot.master     = values_f32(st.master);
        slot.exp_avg    = values_f32(st.exp_avg);
        if (st.exp_avg_sq.defined()) slot.exp_avg_sq = values_f32(st.exp_avg_sq);
        state.slots.push_back(std::move(slot));
    }
    return state;
}

void HybridDeviceOptimizer::load_state_dict(const HybridStateDict & state) {
    LOOM_CHECK(static_cast<int>(state.slots.size()) == num_slots(),
               "optimizer state of " << state.slots.size() << " slots for an optimizer of " << num_slots(),
               "load the state into an optimizer over the same parameters");
    for (int i = 0; i < num_slots(); ++i) {
        const HybridSlotStateDict & slot  = state.slots[static_cast<size_t>(i)];
        const int64_t               numel = slots_[static_cast<size_t>(i)].slot.values.numel();
        LOOM_CHECK(static_cast<int64_t>(slot.master.size()) == numel && slot.exp_avg.size() == slot.master.size() &&
                       (slot.exp_avg_sq.size() == slot.master.size() || slots_[static_cast<size_t>(i)].v_state < 0),
                   "optimizer state of slot " << i << " holds " << slot.master.size() << " elements, the slot " << numel,
                   "load the state into an optimizer over the same parameters");
        load_slot_state(i, slot.master, slot.exp_avg, slot.exp_avg_sq);
    }
    step_ = state.step;
}

void HybridDeviceOptimizer::load_slot_state(int slot, std::span<const float> master, std::span<const float> exp_avg,
                                            std::span<const float> exp_avg_sq) {
    synchronize();
    HybridSlotState st = slot_state(slot);
    LOOM_CHECK(static_cast<int64_t>(master.size()) == st.numel && exp_avg.size() == master.size() &&
                   (exp_avg_sq.size() == master.size() || !st.exp_avg_sq.defined()),
               "optimizer state of slot " << slot << " holds " << master.size() << " elements, the slot " << st.numel,
               "load the state into an optimizer over the same parameters");
    write_values_f32(st.exp_avg, exp_avg);
    if (st.exp_avg_sq.defined()) write_values_f32(st.exp_avg_sq, exp_avg_sq);   // a Muon matrix has none
    write_values_f32(st.master, master);
    const Tensor & values = slots_[static_cast<size_t>(slot)].slot.values;
    if (!st.master.shares_storage(values)) {   // else the values are the master
        device_.ops().convert(device_.compute_stream(), kernel_readable(device_.compute_stream(), st.master), values);
        device_.compute_stream().synchronize();
    }
}

}  // namespace loom::optim
