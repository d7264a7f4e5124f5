// Optimizer: the one interface the trainer steps, `step(lr) -> {grad_norm, stepped}`, and the one gradient
// norm and clip it runs (Megatron's MegatronOptimizer.step: norm, skip on non-finite, clip, update).
//
// Every optimizer here is AdamW over a list of slots held by one HybridDeviceOptimizer
// (optim/hybrid_optimizer.h): a slot is a window of model values with its f32 gradient and weight decay,
// and the Adam state (f32 master, m, v, one step counter) is kept per slot. With offload fraction 0 (no
// --optimizer-cpu-offload) every slot's state is device memory and the step is the plain AdamW step.
//   AdamW                 the slots are whole parameters (replicated gradients: one rank, or DDP's
//                         all-reduce);
//   DistributedOptimizer  the slots are this data-parallel rank's shard pieces of DDP's buffers (ZeRO-1,
//                         optim/distributed_optimizer.h), and the step ends with DDP's parameter all-gather.
//
// The step, on the device's compute stream (the host sees the updated values once it synchronizes it):
//   0. 16-bit gradients (DDP's buffers in the parameters' dtype: --grad-reduce-in-bf16, --fp16) are widened
//      into the optimizer's f32 copies, one contiguous allocation of the slots' elements in the "grads" pool
//      (Megatron's main_grad copies: 4 bytes per stepped element); everything below reads those;
//   1. norm = sqrt of the sum of squares of the counted gradient views: each view's sum on the stream
//      (Ops::sum_of_squares), read by the host in view order in double, then summed over the `shard`
//      group (ZeRO-1: every element is owned by one rank) and the `model_parallel` group (TP x PP ranks),
//      each as an exact double sum (group_sum). Copies are left out of the count: the tied embedding's
//      copy on the last pipeline stage (`shared`) and TP-replicated parameters on TP ranks other than 0
//      (`tp_duplicate`);
//      Expert parameters (Megatron's expert sub-optimizer) are summed apart when the expert groups are
//      given: over `expert_shard` (ZeRO-1's expert-data-parallel group) and `expert_model_parallel` (ETP x
//      EP x PP: every expert once, as the EP ranks hold different experts and the edp ranks the same ones),
//      and the two totals added (Megatron's sqrt(dense^2 + expert^2));
//   2. a non-finite norm skips the update (stepped = false; Megatron's nan iteration);
//   3. clip: when clip_grad > 0 and norm > clip_grad, every view is scaled by clip_grad / (norm + 1e-6);
//   4. AdamW with lr on every slot (weight decay per slot: 0 for biases and norms);
//   5. the subclass's after-step (the distributed optimizer's parameter all-gather).
// With --optimizer muon the weight matrices' slots step with Muon instead of AdamW in step 4 (optim/muon.h):
// their exp_avg holds the momentum and their exp_avg_sq stays zero.
// step_gated runs steps 0-4 with no host read: with no norm group (one rank) the norm, the skip and the
// clip factor are decided on the stream (Ops::grad_norm_gate, core/grad_norm_gate.h) and the update obeys
// them (Ops::adamw_multi_gated); the host reads the norm and the decision afterwards (finish_gated).
#pragma once

#include "comm/communicator.h"
#include "model/parameter.h"
#include "optim/adamw.h"
#include "optim/hybrid_optimizer.h"
#include "optim/muon.h"

#include <memory>
#include <optional>
#include <span>
#include <vector>

namespace loom::optim {

// A gradient the norm reads and clipping scales.
struct GradView {
    Tensor grad;             // f32 (16-bit gradients are widened into the optimizer's copies first: step 0)
    bool   counted = true;   // adds to the norm (false: a copy another rank or stage counts)
    bool   expert  = false;  // an expert parameter's (summed over the expert groups when given)
};

// The groups the squares are summed over after this rank's own (null: none).
struct NormGroups {
    comm::Communicator * shard          = nullptr;   // ZeRO-1's data-parallel group
    comm::Communicator * model_parallel = nullptr;   // the TP x PP ranks
    // Expert views are summed over these instead when expert_model_parallel is set (else with the rest).
    comm::Communicator * expert_shard          = nullptr;   // ZeRO-1's expert-data-parallel group
    comm::Communicator * expert_model_parallel = nullptr;   // the ETP x EP x PP ranks
};

// Whole main_grads, counted unless shared or tp_duplicate, marked expert as their parameters.
std::vector<GradView> grad_views(const std::vector<model::Parameter *> & params);
// sqrt of the sum of squares of the counted views over the groups (the host waits for the compute stream).
double grad_norm(const std::vector<GradView> & views, const NormGroups & groups = {});
// Scales every view by `factor` on the compute stream.
void   scale_grads(const std::vector<GradView> & views, float factor);
// grad_norm, then the scale of step 3 when the norm is finite; returns the norm before clipping.
double clip_grad_norm(const std::vector<GradView> & views, float max_norm, const NormGroups & groups = {});

struct OptimizerOptions {
    AdamWConfig                  adam;
    float                        clip_grad = 0.0f;   // --clip-grad (0: off)
    std::optional<HybridOptions> offload;            // --optimizer-cpu-offload
    std::optional<MuonConfig>    muon;               // --optimizer muon: Muon steps the weight matrices
    MuonGroups                   muon_groups;        // the TP groups Muon gathers their shards over
    // µP's width multiplier m (1: off): hidden matrices (not the embeddings or the output layer, not Muon's)
    // step with step()'s hidden_lr and eps / m (Megatron's get_mup_config_overrides for Adam).
    double                       mup_width_mult = 1.0;
};

struct StepResult {
    double grad_norm = 0;      // before clipping
    bool   stepped   = false;  // false: non-finite norm, parameters unchanged
};

// A step decided on the device (Optimizer::step_gated): what the host reads once the stream has passed it.
struct GatedStep {
    Tensor gate, norm;   // pinned copies of Ops::grad_norm_gate's outputs: {clip factor, go}, {norm}
};

class Optimizer {
public:
    virtual ~Optimizer() = default;
    Optimizer(const Optimizer &) = delete;
    Optimizer & operator=(const Optimizer &) = delete;

    // Steps 1-5 above; the embedding and output layer step with decoupled_lr when given (--decoupled-lr).
    // grad_scale != 1 first multiplies every gradient by it (the loss scaler's 1 / scale: Megatron's
    // unscale of the main gradients), so the norm, the non-finite check and the clip see true gradients.
    // hidden_lr: µP's hidden matrices' lr (with OptimizerOptions::mup_width_mult; default lr).
    StepResult step(float lr, std::optional<float> decoupled_lr = std::nullopt, float grad_scale = 1.0f,
                    std::optional<float> hidden_lr = std::nullopt);
    // The same step with no host read: the norm (no group to sum over), the skip and the clip factor are
    // decided on the stream (Ops::grad_norm_gate, core/grad_norm_gate.h's arithmetic, the host's to the bit)
    // and the update obeys them (Ops::adamw_multi_gated). `losses` (f32 tensors) join the decision: a
    // non-finite element skips the step as a non-finite norm does. The step counter counts the step until
    // finish_gated says otherwise. Only where gated_step_supported().
    GatedStep  step_gated(float lr, std::optional<float> decoupled_lr, std::span<const Tensor> losses,
                          std::optional<float> hidden_lr = std::nullopt);
    // The result of a gated step, once the compute stream has passed it (the caller waited); a step the
    // device skipped is taken back from the step counter.
    StepResult finish_gated(const GatedStep & step);
    // No norm group (one rank), no slot offloaded to the host, and AdamW alone.
    bool       gated_step_supported() const;
    // --optimizer muon's part of the step (null: AdamW steps every slot).
    const MuonUpdate * muon() const { return muon_.get(); }
    // --log-num-zeros-in-grad: zero elements of the gradients the norm counts, over the same groups (read on
    // the host: the CPU backend's memory).
    double count_zeros() const;
    // --log-params-norm: the L2 norm of the model's values, each counted once (not the last stage's copy of
    // the tied embedding, not TP-replicated copies), over the TP x PP group (experts: over ETP x EP x PP);
    // every data-parallel rank holds the whole model (its EP share), so the norm is the same on all of them. bf16 values are widened to f32.
    double params_norm() const;

    int64_t                 steps() const { return state_->steps(); }
    const OptimizerOptions & options() const { return options_; }
    // The slot-based Adam state (what a checkpoint saves) and, per slot, the index of its parameter in
    // params() (a parameter may own several slots: one per bucket its shard range touches).
    HybridDeviceOptimizer &                 state() { return *state_; }
    const std::vector<int> &                slot_params() const { return slot_params_; }
    // Per slot, where it starts in its parameter's (flattened) elements.
    const std::vector<int64_t> &            slot_offsets() const { return slot_offsets_; }
    const std::vector<model::Parameter *> & params() const { return params_; }

protected:
    Optimizer(std::vector<model::Parameter *> params, const OptimizerOptions & options, NormGroups groups);
    // Builds the state over `slots` (slot_params[i]: the parameter of slot i, slot_offsets[i]: where the
    // slot starts in it) and the views the norm reads.
    void         init(std::vector<HybridSlot> slots, std::vector<int> slot_params, std::vector<int64_t> slot_offsets,
                      std::vector<GradView> views);

private:
    // Step 0's set-up: points 16-bit slot gradients (and their views) at f32 copies.
    void widen_16bit_grads(std::vector<HybridSlot> & slots, std::vector<GradView> & views);

    std::vector<model::Parameter *>        params_;
    OptimizerOptions                       options_;
    NormGroups                             groups_;
    std::vector<GradView>                  views_;
    // Step 0: each 16-bit slot gradient and its f32 copy (a piece of widened_storage_).
    std::vector<std::pair<Tensor, Tensor>> widened_;
    Tensor                                 widened_storage_;
    std::vector<int>                       slot_params_;
    std::vector<int64_t>                   slot_offsets_;
    std::unique_ptr<HybridDeviceOptimizer> state_;
    std::unique_ptr<MuonUpdate>            muon_;                    // --optimizer muon: the matrices' update
    Tensor                                 gate_, norm_;             // step_gated's, on the device
    Tensor                                 host_gate_, host_norm_;   // their pinned copies (GatedStep)
};

// AdamW over whole parameters.
class AdamW final : public Optimizer {
public:
    // model_parallel: the TP x PP group the norm sums over (null: none); expert_model_parallel: the ETP x
    // EP x PP group the expert parameters' part sums over (null: with the rest).
    AdamW(std::vector<model::Parameter *> params, const OptimizerOptions & options,
          comm::Communicator * model_parallel = nullptr, comm::Communicator * expert_model_parallel = nullptr);
    AdamW(std::vector<model::Parameter *> params, const AdamWConfig & config)
        : AdamW(std::move(params), OptimizerOptions{config, 0.0f, std::nullopt, std::nullopt, {}, 1.0}) {}
};

}  // namespace loom::optim
