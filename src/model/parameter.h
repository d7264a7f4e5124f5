// Parameter: a model weight, its gradient accumulator and the attributes the parallel layers need.
//
// backward() ADDS into main_grad (so microbatches accumulate) and then reports the parameter ready
// through the GradReadyFn it was given; DDP buckets count these reports to launch their reductions.
// data and main_grad are Tensors so the DDP buffers can later re-point them at views of one flat buffer.
#pragma once

#include "core/fp8.h"
#include "core/tensor.h"

#include <cstdint>
#include <functional>
#include <initializer_list>
#include <span>
#include <string>
#include <utility>
#include <vector>

namespace loom::model {

// The part of a full tensor one tensor-parallel rank holds: along `dim` (0: rows, or the elements of a
// vector; 1: columns of a 2-D weight), the listed [begin, end) ranges, concatenated in order. A column-
// parallel QKV weight, for example, holds its heads' Q rows, then its groups' K rows, then V rows. Expert
// parallelism marks grouped expert tensors (E, F1, h) the same way: dim 0, this rank's experts.
//
// A slice holds, along `dim`, the listed index ranges (back to back), and every index of the other
// dimensions, except that with dim >= 1 a tensor of experts may also hold only `outer`, a range of dim 0:
// a grouped expert tensor (E, F1, h) split over expert ranks (dim 0) and expert-tensor-parallel ranks
// (dim 1 or 2) at once.
struct TpSlice {
    int                                      dim = -1;   // -1: the whole tensor (not split)
    std::vector<std::pair<int64_t, int64_t>> ranges;
    Shape                                    full_shape;
    std::pair<int64_t, int64_t>              outer{0, -1};   // dim >= 1: the range of dim 0 held (end -1: all)
};

// Calls fn(local_offset, full_offset, count) for every contiguous run of the slice's elements, in local
// (row-major) order: where each run of the rank's tensor lies in the full row-major tensor.
void tp_slice_runs(const TpSlice & slice, const std::function<void(int64_t, int64_t, int64_t)> & fn);
// This rank's shard of a full row-major tensor's values.
std::vector<float> tp_extract(const TpSlice & slice, const float * full);

struct Parameter {
    std::string name;                    // "layers.3.mlp.fc1.weight"
    Tensor      data;                    // model dtype (f32, or bf16 with --bf16)
    Tensor      main_grad;               // same shape: f32, or the parameter's 16-bit dtype where DDP's
                                         // buffers follow it (--grad-reduce-in-bf16, --fp16)
    bool        no_weight_decay  = false;   // biases and norm weights (Megatron's param groups)
    bool        embedding_or_output = false;   // the word embedding and the output layer: --decoupled-lr
    bool        embedding_class  = false;   // those and the position embedding: µP steps them unscaled
    bool        shared_embedding = false;   // word embedding tied to the output layer
    bool        shared = false;             // a copy another pipeline stage also holds (the last stage's tied
                                            // word embedding): counted once, on its owner, in the grad norm
    TpSlice     tp_slice;                   // which part of the full tensor this rank holds (dim -1: all)
    bool        tp_duplicate = false;       // replicated across TP and this is not TP rank 0: left out of
                                            // the grad norm (its gradient equals rank 0's)
    bool        sequence_parallel = false;  // replicated across TP but fed this rank's sequence rows only: its
                                            // gradient is summed over the TP group before the step
    bool        expert = false;             // MoE expert weight (reduced over expert-data-parallel)
    std::vector<int64_t> fused_rows;        // a fused weight's row blocks, this rank's rows of each (QKV: Q, K,
                                            // V), which Muon orthogonalizes apart (optim/muon.h); empty: one block
    // --fp8-param-gather: an FP8 GEMM weight the model keeps as FP8 codes. The layer marks it (fp8_blocks > 0)
    // and DDP re-points data at its u8 buffer (ddp/ddp.h): fp8_blocks equal runs of dim 0 (a grouped expert
    // tensor: one per expert, else 1), block b's values the codes times fp8_scale_inv[b] (f32, device), in
    // fp8_format. The optimizer steps an f32 main copy; data is re-encoded from it after every step.
    int64_t              fp8_blocks = 0;
    Fp8Format            fp8_format = Fp8Format::e4m3;
    Tensor               fp8_scale_inv;
    DType                fp8_model_dtype = DType::bf16;   // the model's dtype, which its codes replaced
    bool                 fp8_codes() const { return data.defined() && data.dtype() == DType::u8; }
    // The dtype the layer computes in: the weights' dtype (the model's when they are FP8 codes).
    DType                compute_dtype() const { return fp8_codes() ? fp8_model_dtype : data.dtype(); }

    int64_t numel() const { return data.numel(); }
};

using GradReadyFn = std::function<void(Parameter &)>;

// Calls around each module's forward and backward, with the module's parameters (GptModel::set_param_hooks;
// DDP's are DistributedDataParallel::param_hooks).
struct ParamHooks {
    using Fn = std::function<void(const std::vector<Parameter *> &)>;
    Fn before_forward, after_forward, before_backward, after_backward;
};

// Allocates data of `dtype` (filled by the caller) and a zeroed f32 main_grad (DDP may re-point it at a
// 16-bit buffer).
Parameter parameter_create(const std::string & name, const Shape & shape, DType dtype, Device & device);

// Fills with N(0, std^2) from a stream seeded by (seed, name): every layout of the same model gets the
// same values for the same parameter (a tensor-parallel shard draws the full tensor and keeps its
// tp_slice). The f32 draws are rounded once to the parameter's dtype, so a bf16 model starts from the f32
// model's weights rounded to nearest.
void parameter_init_normal(Parameter & p, uint64_t seed, float std);
// Fills with U(lo, hi) draws from the same kind of stream, each passed through `map` when given (the gated delta-net's
// A_log: log of U(1, 16)).
void parameter_init_uniform(Parameter & p, uint64_t seed, double lo, double hi, double (*map)(double) = nullptr);
void parameter_init_constant(Parameter & p, float value);

// Adds a backward op's contributions to main_grads (undefined entries pass through): `add` receives f32
// tensors of the same shapes to ADD into, as the ops' gradient outputs expect. An f32 main_grad is handed
// over itself; a 16-bit one (DDP's buffer in the parameter's dtype) as an f32 copy of its values, rounded
// back once `add` has enqueued its kernels: round(main_grad + contribution), what a GEMM accumulating into
// a 16-bit C with f32 arithmetic computes. Every op runs on `stream`. With f32 gradients (the usual case,
// once per weight-gradient op) nothing is allocated on the host.
bool                any_16bit_grads(std::span<const Tensor> main_grads);
std::vector<Tensor> widen_grads(Stream & stream, std::span<const Tensor> main_grads);
void                narrow_grads(Stream & stream, std::span<const Tensor> wide, std::span<const Tensor> main_grads);

template <typename Add>
void accumulate_grads(Stream & stream, std::initializer_list<Tensor> main_grads, Add && add) {
    const std::span<const Tensor> grads(main_grads.begin(), main_grads.size());
    if (!any_16bit_grads(grads)) {
        add(grads);
        return;
    }
    const std::vector<Tensor> wide = widen_grads(stream, grads);
    add(std::span<const Tensor>(wide));
    narrow_grads(stream, wide, grads);
}

// The parameter's values as f32: `data` itself when it is f32, else a converted copy (for the small
// vectors, biases and norm weights, that f32 kernels read). FP8 codes give their values times their scales.
Tensor parameter_f32(const Parameter & p);
// Writes this rank's whole values (its numel, f32, from the host): rounded to its dtype, or, for FP8 codes,
// encoded block by block by each block's own amax, as DistributedDataParallel::encode_fp8_params does.
void   parameter_write_f32(Parameter & p, std::span<const float> values);

}  // namespace loom::model
