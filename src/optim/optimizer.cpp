#include "optim/optimizer.h"

#include "core/error.h"
#include "core/ops.h"

#include <cmath>

namespace loom::optim {

std::vector<GradView> grad_views(const std::vector<model::Parameter *> & params) {
    std::vector<GradView> views;
    views.reserve(params.size());
    for (model::Parameter * p : params) {
        views.push_back(GradView{p->main_grad.flatten(), !p->shared && !p->tp_duplicate, p->expert});
    }
    return views;
}

namespace {

// The dense and expert parts of a sum over views, each summed over its groups, added (expert views count with
// the dense ones when no expert group is given). Every rank of the groups calls this (a rank that owns no
// piece still takes part in the group sums).
double group_total(double dense, double expert, const NormGroups & groups, Device & device) {
    if (!groups.expert_model_parallel) dense += expert;
    if (groups.shard) dense = group_sum(dense, *groups.shard, device);
    if (groups.model_parallel) dense = group_sum(dense, *groups.model_parallel, device);
    if (!groups.expert_model_parallel) return dense;
    if (groups.expert_shard) expert = group_sum(expert, *groups.expert_shard, device);
    return dense + group_sum(expert, *groups.expert_model_parallel, device);
}

// grad_norm on `device`.
double norm_on(Device & device, const std::vector<GradView> & views, const NormGroups & groups) {
    Stream & stream = device.compute_stream();
    // One (hi, lo) pair per counted view, summed by the host in view order: the same bits at any thread
    // count, and no reduction of partial sums on the device.
    int64_t counted = 0;
    for (const GradView & v : views) counted += v.counted ? 1 : 0;
    Tensor              sums = Tensor::zeros({2 * std::max<int64_t>(counted, 1)}, DType::f32, device);
    std::vector<Tensor> grads;
    for (const GradView & v : views) {
        if (v.counted) grads.push_back(v.grad);
    }
    device.ops().sum_of_squares_multi(stream, grads, sums.slice(0, {2 * counted}));
    const Tensor  host  = read_after_stream(sums);   // the step's one read of the gradients
    const float * pairs = host.data<float>();
    double        dense = 0, expert = 0;
    int64_t       k     = 0;
    for (const GradView & v : views) {
        if (!v.counted) continue;
        const double sq = static_cast<double>(pairs[2 * k]) + static_cast<double>(pairs[2 * k + 1]);
        (v.expert ? expert : dense) += sq;
        ++k;
    }
    return std::sqrt(group_total(dense, expert, groups, device));
}

}  // namespace

double grad_norm(const std::vector<GradView> & views, const NormGroups & groups) {
    LOOM_CHECK(!views.empty(), "the gradient norm of no gradients", "");
    return norm_on(views.front().grad.device(), views, groups);
}

void scale_grads(const std::vector<GradView> & views, float factor) {
    for (const GradView & v : views) {
        Device & device = v.grad.device();
        device.ops().scale(device.compute_stream(), v.grad, factor);
    }
}

double clip_grad_norm(const std::vector<GradView> & views, float max_norm, const NormGroups & groups) {
    const double norm  = grad_norm(views, groups);
    const float  coeff = clip_coefficient(norm, max_norm);
    if (coeff != 1.0f) scale_grads(views, coeff);
    return norm;
}

Optimizer::Optimizer(std::vector<model::Parameter *> params, const OptimizerOptions & options, NormGroups groups)
    : params_(std::move(params)), options_(options), groups_(groups) {
    LOOM_CHECK(!params_.empty(), "an optimizer over no parameters", "");
}

void Optimizer::init(std::vector<HybridSlot> slots, std::vector<int> slot_params, std::vector<int64_t> slot_offsets,
                     std::vector<GradView> views) {
    LOOM_CHECK(slot_params.size() == slots.size() && slot_offsets.size() == slots.size(),
               slots.size() << " optimizer slots with " << slot_params.size() << " parameters and " << slot_offsets.size()
                            << " offsets", "");
    slot_params_  = std::move(slot_params);
    slot_offsets_ = std::move(slot_offsets);
    widen_16bit_grads(slots, views);
    views_       = std::move(views);
    HybridOptions offload;   // fraction 0: every slot's state in device memory, the plain step
    if (options_.offload) offload = *options_.offload;
    // µP's hidden matrices: their own lr and eps / m (Muon's matrices take Muon's rule instead).
    if (options_.mup_width_mult != 1.0) {
        for (size_t i = 0; i < slots.size(); ++i) {
            const model::Parameter & p = *params_[static_cast<size_t>(slot_params_[i])];
            if (p.embedding_class || p.data.dim() < 2 || (options_.muon && muon_steps(p))) continue;
            slots[i].mup_hidden = true;
            slots[i].eps_scale  = static_cast<float>(1.0 / options_.mup_width_mult);
        }
    }
    // Muon's slots: their gradients are Muon's, so the Adam step leaves them alone (an undefined gradient).
    std::vector<Tensor> muon_grads(slots.size());
    if (options_.muon) {
        LOOM_CHECK(offload.offload_fraction == 0.0f, "--optimizer muon with --optimizer-offload-fraction "
                                                         << offload.offload_fraction,
                   "the host step is AdamW's; train Muon without --optimizer-cpu-offload");
        for (size_t i = 0; i < slots.size(); ++i) {
            if (!muon_steps(*params_[static_cast<size_t>(slot_params_[i])])) continue;
            muon_grads[i]          = slots[i].grad;
            slots[i].grad          = Tensor();
            slots[i].momentum_only = true;
        }
    }
    state_ = std::make_unique<HybridDeviceOptimizer>(params_.front()->data.device(), std::move(slots), options_.adam,
                                                     offload);
    if (!options_.muon) return;
    // Every Muon parameter in parameter order (the same on every rank of its groups, which each matrix's
    // collectives need), with the pieces of it this rank steps.
    std::vector<MuonUpdate::Matrix> matrices;
    std::vector<int>                matrix_of(params_.size(), -1);
    for (size_t i = 0; i < params_.size(); ++i) {
        const model::Parameter * p = params_[i];
        if (!muon_steps(*p)) continue;
        MuonUpdate::Matrix m;
        m.param  = p;
        m.shard  = p->expert ? groups_.expert_shard : groups_.shard;
        m.gather = p->expert ? options_.muon_groups.expert_tp : options_.muon_groups.tp;
        matrix_of[i] = static_cast<int>(matrices.size());
        matrices.push_back(std::move(m));
    }
    for (int i = 0; i < state_->num_slots(); ++i) {
        const int m = matrix_of[static_cast<size_t>(slot_params_[static_cast<size_t>(i)])];
        if (m < 0) continue;
        const HybridSlotState st    = state_->slot_state(i);
        const HybridSlot &    slot  = state_->slot(i);
        MuonUpdate::Piece     piece;
        piece.master       = st.master;
        piece.momentum     = st.exp_avg;
        piece.grad         = muon_grads[static_cast<size_t>(i)];
        piece.values       = slot.values.dtype() == DType::f32 ? Tensor() : slot.values;
        piece.offset       = slot_offsets_[static_cast<size_t>(i)];
        piece.weight_decay = slot.weight_decay;
        matrices[static_cast<size_t>(m)].pieces.push_back(piece);
    }
    muon_ = std::make_unique<MuonUpdate>(*options_.muon, std::move(matrices));
}

void Optimizer::widen_16bit_grads(std::vector<HybridSlot> & slots, std::vector<GradView> & views) {
    int64_t total = 0;
    for (const HybridSlot & slot : slots) {
        if (slot.grad.defined() && slot.grad.dtype() != DType::f32) total += slot.grad.numel();
    }
    if (total == 0) return;
    // Both optimizers read slot i's gradient through view i.
    LOOM_CHECK(views.size() == slots.size(), views.size() << " gradient views over " << slots.size() << " slots", "");
    widened_storage_ = Tensor::zeros({total}, DType::f32, slots.front().grad.device(), {MemoryKind::device, "grads"});
    int64_t at       = 0;
    for (size_t i = 0; i < slots.size(); ++i) {
        Tensor & grad = slots[i].grad;
        if (!grad.defined() || grad.dtype() == DType::f32) continue;
        LOOM_CHECK(views[i].grad.data_ptr() == grad.data_ptr() && views[i].grad.numel() == grad.numel(),
                   "gradient view " << i << " is not its slot's gradient", "");
        Tensor wide = widened_storage_.slice(at, {grad.numel()});
        at += grad.numel();
        widened_.emplace_back(grad, wide);
        grad          = wide;
        views[i].grad = wide;
    }
}

StepResult Optimizer::step(float lr, std::optional<float> decoupled_lr, float grad_scale, std::optional<float> hidden_lr) {
    StepResult result;
    for (const auto & [narrow, wide] : widened_) {
        Device & device = wide.device();
        device.ops().convert(device.compute_stream(), narrow, wide);
    }
    if (grad_scale != 1.0f) scale_grads(views_, grad_scale);
    result.grad_norm = norm_on(params_.front()->data.device(), views_, groups_);
    if (!std::isfinite(result.grad_norm)) return result;
    const float coeff = clip_coefficient(result.grad_norm, options_.clip_grad);
    if (coeff != 1.0f) scale_grads(views_, coeff);
    state_->step(lr, &params_.front()->data.device().compute_stream(), decoupled_lr, Tensor(), hidden_lr);
    if (muon_) muon_->step(lr);
    result.stepped = true;
    return result;
}

bool Optimizer::gated_step_supported() const {
    return !groups_.shard && !groups_.model_parallel && !groups_.expert_shard && !groups_.expert_model_parallel &&
           state_->num_offloaded() == 0 && !muon_;
}

GatedStep Optimizer::step_gated(float lr, std::optional<float> decoupled_lr, std::span<const Tensor> losses,
                                std::optional<float> hidden_lr) {
    LOOM_CHECK(gated_step_supported(), "a step decided on the device over norm groups or offloaded slots", "");
    Device & device = params_.front()->data.device();
    Stream & stream = device.compute_stream();
    Ops &    ops    = device.ops();
    for (const auto & [narrow, wide] : widened_) ops.convert(stream, narrow, wide);
    // The pairs in the order core/grad_norm_gate.h sums them: dense views, expert views, then the losses.
    std::vector<Tensor> xs;
    GradNormGate        g;
    for (const bool expert : {false, true}) {
        for (const GradView & v : views_) {
            if (!v.counted || v.expert != expert) continue;
            xs.push_back(v.grad);
            ++(expert ? g.expert : g.dense);
        }
    }
    xs.insert(xs.end(), losses.begin(), losses.end());
    g.losses   = static_cast<int64_t>(losses.size());
    g.max_norm = options_.clip_grad;
    if (!gate_.defined()) {
        gate_      = Tensor::zeros({2}, DType::f32, device);
        norm_      = Tensor::zeros({1}, DType::f64, device);
        host_gate_ = Tensor::zeros({2}, DType::f32, device, {MemoryKind::pinned_host});
        host_norm_ = Tensor::zeros({1}, DType::f64, device, {MemoryKind::pinned_host});
    }
    const int64_t n     = static_cast<int64_t>(xs.size());
    const Tensor  pairs = Tensor::empty({2 * std::max<int64_t>(n, 1)}, DType::f32, device).slice(0, {2 * n});
    ops.sum_of_squares_multi(stream, xs, pairs);
    ops.grad_norm_gate(stream, pairs, g, gate_, norm_);
    state_->step(lr, &stream, decoupled_lr, gate_, hidden_lr);
    ops.copy(stream, gate_, host_gate_);
    ops.copy(stream, norm_, host_norm_);
    return GatedStep{host_gate_, host_norm_};
}

StepResult Optimizer::finish_gated(const GatedStep & step) {
    StepResult result;
    result.grad_norm = step.norm.data<double>()[0];
    result.stepped   = step.gate.data<float>()[1] != 0.0f;
    if (!result.stepped) state_->skipped();
    return result;
}

double Optimizer::count_zeros() const {
    Device & device = params_.front()->data.device();
    device.compute_stream().synchronize();
    double zeros[2] = {0, 0};   // dense, expert
    for (const GradView & v : views_) {
        if (!v.counted) continue;
        const Tensor  host = host_readable(v.grad);
        const float * g    = host.data<float>();
        for (int64_t i = 0; i < v.grad.numel(); ++i) zeros[v.expert ? 1 : 0] += g[i] == 0.0f ? 1.0 : 0.0;
    }
    return group_total(zeros[0], zeros[1], groups_, device);
}

double Optimizer::params_norm() const {
    Device & device = params_.front()->data.device();
    double   sum[2] = {0, 0};   // dense, expert
    for (const model::Parameter * p : params_) {   // one at a time: a bf16 model is widened a parameter at a time
        if (p->shared || p->tp_duplicate) continue;
        const double norm = norm_on(device, {GradView{model::parameter_f32(*p), true}}, NormGroups{});
        sum[p->expert ? 1 : 0] += norm * norm;
    }
    // Every data-parallel rank holds the values whole: only the model-parallel groups sum.
    return std::sqrt(group_total(sum[0], sum[1], NormGroups{nullptr, groups_.model_parallel, nullptr, groups_.expert_model_parallel},
                                 device));
}

AdamW::AdamW(std::vector<model::Parameter *> params, const OptimizerOptions & options,
             comm::Communicator * model_parallel, comm::Communicator * expert_model_parallel)
    : Optimizer(std::move(params), options, NormGroups{nullptr, model_parallel, nullptr, expert_model_parallel}) {
    std::vector<HybridSlot> slots;
    std::vector<int>        slot_params;
    for (size_t i = 0; i < this->params().size(); ++i) {
        model::Parameter * p = this->params()[i];
        slots.push_back(HybridSlot{p->data.flatten(), p->main_grad.flatten(),
                                   p->no_weight_decay ? 0.0f : options.adam.weight_decay, p->embedding_or_output});
        slot_params.push_back(static_cast<int>(i));
    }
    std::vector<int64_t> offsets(slots.size(), 0);   // each slot a whole parameter
    init(std::move(slots), std::move(slot_params), std::move(offsets), grad_views(this->params()));
}

}  // namespace loom::optim
