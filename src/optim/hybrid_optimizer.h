// HybridDeviceOptimizer (HDO): AdamW whose state lives partly in device memory and partly in host memory,
// the host part stepped by the host (docs/design/ddp_and_optimizers.md section 3; the section numbers below refer to
// that document).
//
// It steps a list of slots: each slot is a window of model values in device memory (f32 or bf16), its f32
// gradient in device memory, and a weight decay. The slots are the whole parameters of the replicated
// path, or the owned shard pieces of the distributed optimizer. This is the one Adam state of every
// optimizer (optim/optimizer.h): fraction 0 offloads nothing, and the step is then the plain AdamW step,
// one Ops::adamw per slot on the caller's stream (no host work, no side streams).
//
// Split (section 3.2, exact): a prefix of the slots, in slot order, is offloaded until the offloaded numel
// reaches f * total. The test comes before the add, so the slot that crosses the threshold is offloaded
// whole (overshoot by at most one slot); f = 0 offloads nothing (0 < 0 is false), f = 1 everything.
//   numels (10, 20, 30, 40), f = 0.3: threshold 30; offload 10 (0 < 30), 20 (10 < 30), stop at 30: 2 slots.
//   f = 0.35: threshold 35; 10, 20, 30 (30 < 35): 60 offloaded, 3 slots.
//
// State (bytes per element; "optimizer" pool of the allocator named):
//   device slot, bf16 values: master f32, m, v           12   device allocator
//   device slot, f32 values:  m, v (the values are the master) 8
//   host slot (any dtype):    master f32, m, v           12   pinned host allocator (pageable host memory,
//                             gradient f32                4   held by the optimizer, with --no-pin-cpu-params
//                                                             / --no-pin-cpu-grads)
// so offloading a bf16 element saves 12 device bytes and costs 16 pinned host bytes.
//
// Step (section 3.5, with the fixes of 3.7), `current` is the caller's stream that produced the gradients and
// will read the values next (all device work goes through the device's ops, core/ops.h):
//   1. record `start` on current; the d2h and h2d streams wait on it (gradients final, earlier readers of
//      the values done);
//   2. on d2h: per host group, copy each slot's gradient to its host gradient buffer (Ops::copy), then
//      record the group's d2h event. With overlap a group is one slot; without, one group holds every
//      host slot and d2h = h2d = current;
//   3. on current: the device slots' AdamW (Ops::adamw; after everything the caller queued before, which
//      is where a gradient cast or scale would run: hazard a);
//   4. per host group, in order: the host waits on its d2h event, runs host AdamW (core/host_adam.h) on
//      its slots, submits the H2D copies (f32 master -> model dtype, Ops::convert) on h2d, records the
//      group's h2d event, and current waits on it (the h2d event, not the d2h one). Group k's host step
//      runs while group k+1's D2H and group k-1's H2D are in flight.
// Hazards of section 3.7, each tested in tests/test_hybrid_optimizer.cpp:
//   (a) the device step is ordered after the caller's stream (grad casts/scales there);
//   (b) every slot, device or host, f32 or bf16, reads its gradient from the one grad tensor of the slot;
//   (c) a slot whose grad is missing this step (set_grad(i, Tensor())) is not updated at all;
//   (d) one step counter (steps()/set_steps()), passed to every part.
// Bitwise equal to AdamW / the plain distributed optimizer for every f and with or without overlap: every
// element goes through host_adam_step with the same arguments, and the bf16 write-back rounds the same way.
#pragma once

#include "core/device.h"
#include "core/tensor.h"
#include "optim/adamw.h"

#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace loom::optim {

struct HybridOptions {
    float offload_fraction = 0.0f;    // --optimizer-offload-fraction, in [0, 1]
    bool  overlap_d2h_h2d  = false;   // --overlap-cpu-optimizer-d2h-h2d: one host group per slot, side streams
    bool  pin_cpu_grads    = true;    // --no-pin-cpu-grads clears it
    bool  pin_cpu_params   = true;    // --no-pin-cpu-params clears it
    bool  unsafe_skip_h2d_wait = false;   // tests only: drop the current stream's wait on the h2d events
};

struct HybridSlot {
    Tensor values;              // (n) f32 or bf16, device memory, updated in place
    Tensor grad;                // (n) f32, device memory; undefined: no gradient (not updated)
    float  weight_decay = 0.0f;
    bool   decoupled_lr = false;   // steps with the embedding's and output layer's lr (--decoupled-lr)
    bool   momentum_only = false;  // a Muon matrix's (optim/muon.h): m alone, no v; stepped by Muon, never here
    bool   mup_hidden    = false;  // a µP hidden matrix: steps with hidden_lr when given
    float  eps_scale     = 1.0f;   // Adam's eps times this (µP: 1 / width multiplier for hidden matrices)
};

// Which slots are offloaded, by section 3.2's rule. Throws when fraction is outside [0, 1].
std::vector<bool> hybrid_offload_split(const std::vector<int64_t> & numels, double fraction);

// Where one slot's state lives: (n) f32 views into the optimizer's arrays, in device memory or host memory
// (host_readable / values_f32 read any of them, core/tensor.h).
struct HybridSlotState {
    bool    offloaded = false;
    int64_t numel     = 0;
    Tensor  master;       // the f32 master: host copy, device copy (bf16 values), or the values (device f32)
    Tensor  exp_avg;      // m
    Tensor  exp_avg_sq;   // v (undefined for a momentum_only slot)
};

// The wrapper's one state for the whole model, whichever side each slot's state lives on: per slot its
// f32 master (the values themselves for an f32 device slot), m and v, and the one step counter (Megatron's
// master_param, exp_avg, exp_avg_sq and step). A state taken with one offload fraction or overlap setting
// loads into an optimizer over the same slots with any other.
struct HybridSlotStateDict {
    std::vector<float> master, exp_avg, exp_avg_sq;
};
struct HybridStateDict {
    int64_t                          step = 0;
    std::vector<HybridSlotStateDict> slots;
};

class HybridDeviceOptimizer {
public:
    HybridDeviceOptimizer(Device & device, std::vector<HybridSlot> slots, const AdamWConfig & config,
                          const HybridOptions & options);
    ~HybridDeviceOptimizer();
    HybridDeviceOptimizer(const HybridDeviceOptimizer &) = delete;
    HybridDeviceOptimizer & operator=(const HybridDeviceOptimizer &) = delete;

    // One step with lr (weight decay from each slot). With `current`, the work is ordered on it and
    // anything submitted to it afterwards sees the updated values; without, the host sees them on return.
    // decoupled_lr: the lr of the slots marked decoupled_lr (default: lr).
    // gate: Ops::grad_norm_gate's (f32 {clip factor, go}) on the device, read by the update itself; the
    // counter counts the step, and the caller calls skipped() once it learns the gate was closed. Only
    // without offloaded slots (their host step would have to wait for the gate).
    // hidden_lr: the lr of the slots marked mup_hidden (default: lr).
    void step(float lr, Stream * current = nullptr, std::optional<float> decoupled_lr = std::nullopt,
              const Tensor & gate = Tensor(), std::optional<float> hidden_lr = std::nullopt);
    // A gated step the device skipped: the counter goes back, as if step() had not been called.
    void skipped() { --step_; }

    // The gradient slot i reads from the next step on (undefined: none).
    void set_grad(int slot, Tensor grad);
    void set_weight_decay(int slot, float weight_decay);

    int64_t steps() const { return step_; }
    void    set_steps(int64_t steps) { step_ = steps; }   // after a checkpoint load

    int                     num_slots() const { return static_cast<int>(slots_.size()); }
    int                     num_offloaded() const;
    int64_t                 offloaded_numel() const;
    // Views of the state: read them after the queued steps have run (the compute stream synchronized, or
    // step() called without a stream).
    HybridSlotState         slot_state(int slot) const;
    // The slot as given (its values view tells a checkpoint which elements of its parameter it holds).
    const HybridSlot &      slot(int i) const { return slots_.at(static_cast<size_t>(i)).slot; }

    // Copies every slot's state out (after the queued steps have run).
    HybridStateDict state_dict() const;
    // Restores it: masters, moments and the step; each slot's model values become its master in the
    // model's dtype, as after a step. Throws naming the slot when the sizes do not match.
    void            load_state_dict(const HybridStateDict & state);
    // One slot's part of it (numel elements each), without building the whole dict (a checkpoint load).
    void            load_slot_state(int slot, std::span<const float> master, std::span<const float> exp_avg,
                                    std::span<const float> exp_avg_sq);
    int                     num_host_groups() const { return static_cast<int>(groups_.size()); }
    const HybridOptions &   options() const { return options_; }
    // The side streams (tests delay them to prove the waits); they exist only when a slot is offloaded.
    Stream &                h2d_stream();
    Stream &                d2h_stream();

private:
    // Waits for the compute stream and the side streams (the host then reads or writes the state).
    void synchronize() const;
    // `t` where a kernel on `stream` can read it (a device copy of pageable host memory).
    Tensor kernel_readable(Stream & stream, const Tensor & t) const;

    // f32 host memory: pinned (a tensor of the pinned host allocator) or pageable (owned here, `tensor`
    // a view of it, of kind pageable_host on a GPU: copies take it, kernels are handed a device copy).
    struct HostArray {
        Tensor             tensor;     // (n)
        std::vector<float> pageable;   // (n), or empty when pinned
        float *            data() { return tensor.data<float>(); }
        Tensor             slice(int64_t offset, int64_t n) const { return tensor.slice(offset, {n}); }
    };

    struct SlotInfo {
        HybridSlot slot;
        bool       offloaded = false;
        int64_t    state     = 0;    // offset into the m/v (and host master/grad) arrays of its side
        int64_t    master    = -1;   // device side, bf16 values: offset into dev_master_
        int64_t    v_state   = -1;   // offset into the v array of its side (-1: momentum_only, none)
    };

    Device &                             device_;
    AdamWConfig                          config_;
    HybridOptions                        options_;
    std::vector<SlotInfo>                slots_;
    std::vector<std::vector<int>>        groups_;     // host slots per host sub-optimizer
    // Flat state, slots in order, each slot's elements at SlotInfo::state (master at SlotInfo::master).
    Tensor                               dev_master_;   // (device bf16 elements) f32, optimizer pool
    Tensor                               dev_m_, dev_v_;   // (device elements) f32, optimizer pool
    HostArray                            host_master_, host_m_, host_v_;   // (host elements) f32
    HostArray                            host_grad_;    // (host elements) f32, the D2H copies land here
    std::unique_ptr<Stream>              d2h_, h2d_;   // only with offloaded slots
    std::unique_ptr<Event>               start_;
    std::vector<std::unique_ptr<Event>>  d2h_events_, h2d_events_;   // per host group
    int64_t                              step_ = 0;
};

}  // namespace loom::optim
