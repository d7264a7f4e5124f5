#include "backend/cuda/cuda_ops.h"

#include "backend/cuda/attention_kernels.h"
#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_stream.h"
#include "backend/cuda/fused_attention.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/kernels.h"
#include "backend/cuda/moe_kernels.h"
#include "core/dropout.h"
#include "core/error.h"
#include "core/host_adam.h"
#include "core/op_checks.h"

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <mutex>
#include <optional>
#include <set>
#include <string>
#include <sstream>
#include <tuple>
#include <type_traits>
#include <utility>

namespace loom::LOOM_CUDA_NS {

namespace {

using op_checks::expect;
using op_checks::rows_cols;
using op_checks::act;
using op_checks::act_or_null;
using op_checks::with_activations;
using op_checks::with_logits;

float *    f32(const Tensor & t) { return t.data<float>(); }
float *    f32_or_null(const Tensor & t) { return t.defined() ? t.data<float>() : nullptr; }
uint16_t * bits16(const Tensor & t) { return static_cast<uint16_t *>(t.data_ptr()); }

// Every tensor an op touches lives on the stream's CUDA device: device or pinned host memory for a kernel;
// a copy (`copy_only`: cudaMemcpy*Async, which stages pageable memory itself) may also take pageable host
// memory, which no kernel can address.
void expect_on(const CudaStream & s, const std::vector<Tensor> & tensors, const char * op, bool copy_only = false) {
    for (const Tensor & t : tensors) {
        if (!t.defined()) continue;
        LOOM_CHECK(t.device().type() == DeviceType::cuda && t.device().index() == s.device_index(),
                   op << ": " << t.describe() << " is not on cuda:" << s.device_index(),
                   "copy host tensors to the device first (a pinned_host tensor of the CUDA device and ops().copy)");
        LOOM_CHECK(copy_only || t.memory_kind() != MemoryKind::pageable_host,
                   op << ": " << t.describe() << " is pageable host memory, which a kernel cannot address",
                   "copy it into device or pinned memory first (ops().copy takes pageable memory)");
    }
}

kernels::Float float_kind(DType dtype) {
    switch (dtype) {
        case DType::f32: return kernels::Float::f32;
        case DType::bf16: return kernels::Float::bf16;
        case DType::f64: return kernels::Float::f64;
        default: return kernels::Float::f16;
    }
}

// Device scratch of t's dtype and element count, freed in stream order with the op's tensors.
Tensor scratch_like(CudaStream & cs, const Tensor & t) {
    return Tensor::empty({std::max<int64_t>(t.numel(), 1)}, t.dtype(), cs.device(),
                         TensorOptions{MemoryKind::device, kActivationsPool});
}

// Ids read on the device (tokens, labels) are checked there: kernels::find_bad_id records the first one
// outside [-1, limit) with an atomicMin on a device word (device memory: an atomic over the bus on pinned
// memory needs PCIe atomics, which a virtual machine may not give). The word is reset in stream order before
// the kernel, so every replay of a captured op starts clean, and copied after the op's kernels into a
// pinned word that host work enqueued behind the copy reads, raising the CPU backend's error
// (op_checks::id_in_range) at the stream's next synchronize. The kernels themselves read such an id as -1,
// so nothing outside a table is read or written.
class BadIdCheck {
public:
    // On `stream`, the stream cs.launch() returned for the op.
    BadIdCheck(CudaStream & cs, cudaStream_t stream)
        : device_(cs.id_check_word(MemoryKind::device)), host_(cs.id_check_word(MemoryKind::pinned_host)) {
        LOOM_CUDA_CHECK(cudaMemsetAsync(device_.data_ptr(), 0xff, sizeof(uint64_t), stream));
    }

    unsigned long long * word() const { return static_cast<unsigned long long *>(device_.data_ptr()); }

    // After the op's kernels and before cs.launched(held): the copy to the host and the host's check. The
    // op keeps both words (`held`) until the copy has run; the host work keeps the pinned one.
    void report(CudaStream & cs, cudaStream_t stream, int64_t limit, const char * op, const char * what,
                std::vector<Tensor> & held) const {
        LOOM_CUDA_CHECK(cudaMemcpyAsync(host_.data_ptr(), device_.data_ptr(), sizeof(uint64_t),
                                        cudaMemcpyDeviceToHost, stream));
        held.push_back(device_);
        held.push_back(host_);
        cs.submit([word = host_, limit, op, what] {
            const uint64_t first = *static_cast<const volatile uint64_t *>(word.data_ptr());
            if (first == ~uint64_t{0}) return;
            op_checks::id_in_range(static_cast<int32_t>(static_cast<uint32_t>(first & 0xffffffffu)),
                                   static_cast<int64_t>(first >> 32), limit, op, what);
        });
    }

private:
    Tensor device_;
    Tensor host_;
};

// A dropout key's sample ids on the device (null when it has none). They usually sit in pinned host memory
// (the data loader's): copied to the device once, rather than read over the bus by every element; the
// copy joins `held`.
const int64_t * device_sample_ids(CudaStream & cs, cudaStream_t stream, const Dropout & key, std::vector<Tensor> & held) {
    if (!key.sample_ids.defined()) return nullptr;
    Tensor ids = scratch_like(cs, key.sample_ids);
    if (key.sample_ids.nbytes() > 0) {
        LOOM_CUDA_CHECK(cudaMemcpyAsync(ids.data_ptr(), key.sample_ids.data_ptr(), key.sample_ids.nbytes(),
                                        cudaMemcpyDefault, stream));
    }
    held.push_back(ids);
    return ids.data<int64_t>();
}

kernels::AttentionDims attention_dims(const AttentionShape & a) {
    return {a.s,    a.b,           a.nq,         a.nkv,        a.d,     a.row_stride,
            a.keys(), a.kv_stride(), a.k_column(), a.v_column(), a.q_pos, a.k_pos, a.window,
            a.key_mask.defined() ? a.key_mask.data<uint8_t>() : nullptr};
}

// The limits of the CUDA kernels (Ops::supports): attention keeps a (32, d) block per 256 threads in
// registers, d up to kAttentionMaxHeadDim; the router keeps a token's top-k in a per-thread array.
OpSupport cuda_supports(const OpQuery & q) {
    std::ostringstream why;
    const std::string  op = q.op;
    if (op.rfind("attention", 0) == 0 && q.head_dim > kernels::kAttentionMaxHeadDim) {
        why << q.op << ": head dimension " << q.head_dim << " on CUDA (the CUDA attention takes heads of up to "
            << kernels::kAttentionMaxHeadDim << ")";
    } else if (op.rfind("moe_", 0) == 0 && q.topk > kernels::kMoeMaxTopk) {
        why << q.op << ": top-" << q.topk << " routing on CUDA (the CUDA router selects up to " << kernels::kMoeMaxTopk
            << " experts per token)";
    }
    return {why.str().empty(), why.str()};
}

void require(const OpQuery & q) {
    const OpSupport s = cuda_supports(q);
    LOOM_CHECK(s.ok, s.why, "");
}

void check_head_dim(const AttentionShape & a, const char * op) { require({op, a.d, 0}); }

// The shape cuDNN's fused attention (fused_attention.h) takes for this call, or none where the call is not
// plain causal attention of its own keys in bf16: f32, dropout, a window, a key mask, another block's keys
// or positions (context parallelism), gradients added rather than assigned, a head size not a multiple of 8
// or over 128, or rows and columns not 16-byte aligned all run Loom's own kernel.
std::optional<FusedAttentionShape> fused_attention_shape(const Tensor & q, const Tensor & out, const AttentionShape & a,
                                                         const Dropout & dropout, bool accumulate) {
    const SeqPositions identity;
    const bool plain = !dropout.enabled() && !accumulate && a.window < 0 && !a.key_mask.defined() && a.keys() == a.s &&
                       a.q_pos.first == identity.first && a.q_pos.split == identity.split &&
                       a.k_pos.first == identity.first && a.k_pos.split == identity.split;
    const bool typed = q.dtype() == DType::bf16 && out.dtype() == DType::bf16;   // activations are f32 or bf16
    const bool sized = a.d % 8 == 0 && a.d <= 128 && a.nkv > 0 && a.nq % a.nkv == 0 && a.row_stride % 8 == 0 &&
                       a.kv_stride() % 8 == 0 && a.k_column() % 8 == 0 && a.v_column() % 8 == 0 &&
                       (a.nq * a.d) % 8 == 0;
    if (!plain || !typed || !sized) return std::nullopt;
    FusedAttentionShape f;
    f.b = a.b, f.s = a.s, f.nq = a.nq, f.nkv = a.nkv, f.d = a.d;
    f.q_row = a.row_stride, f.kv_row = a.kv_stride(), f.o_row = a.nq * a.d;
    f.bf16 = q.dtype() == DType::bf16;
    return f;
}

// The plan's workspace for this call (the stream's activations pool), or none where cuDNN refused the shape
// (said once per shape on stderr; Loom's kernel runs).
std::optional<Tensor> fused_attention_workspace(CudaStream & cs, const FusedAttentionShape & f, bool backward) {
    std::string   why;
    const int64_t bytes = fused_attention_prepare(cs.device_index(), f, backward, &why);
    if (bytes < 0) {
        static std::mutex              mutex;
        static std::set<std::string>   said;
        std::lock_guard<std::mutex>    lock(mutex);
        if (said.insert(why).second) {
            std::fprintf(stderr, "WARNING: cuDNN fused attention %s refused (b %lld s %lld heads %lld/%lld d %lld): %s; Loom's kernel runs\n",
                         backward ? "backward" : "forward", static_cast<long long>(f.b), static_cast<long long>(f.s),
                         static_cast<long long>(f.nq), static_cast<long long>(f.nkv), static_cast<long long>(f.d), why.c_str());
        }
        return std::nullopt;
    }
    return Tensor::empty({std::max<int64_t>(bytes, 1)}, DType::u8, cs.device(), TensorOptions{MemoryKind::device, kActivationsPool});
}

template <class T>
const void * column(const Tensor & t, int64_t col) {
    return static_cast<const T *>(t.data_ptr()) + col;
}

// The attention dropout's key as the kernels take it (backend/cpu/cpu_ops.cpp's attention_dropout: the
// key's offset is the head offset).
kernels::AttentionKey attention_key(CudaStream & cs, cudaStream_t stream, const Dropout & key, std::vector<Tensor> & held) {
    kernels::AttentionKey k{};
    k.dropped = key.enabled();
    if (!k.dropped) return k;
    k.seed        = key.seed;
    k.site        = key.site;
    k.head_offset = key.offset;
    k.threshold   = dropout_threshold(key.p);
    k.keep_scale  = 1.0f / (1.0f - key.p);   // f32, as the CPU computes it
    k.sample_ids  = device_sample_ids(cs, stream, key, held);
    return k;
}

// A router's arguments as the kernels take them.
kernels::MoeRoutingArgs routing_args(const MoeRouting & r, const char * op) {
    require({op, 0, r.topk});
    return {r.experts, r.topk, r.sigmoid, r.pre_softmax, r.scaling > 0.0f ? static_cast<double>(r.scaling) : 1.0,
            r.num_groups, r.group_topk};
}

kernels::MoeLossArgs loss_args(const MoeRouterLoss & l) { return {l.groups, l.tokens, l.aux_coeff, l.z_coeff}; }

// Device scratch of `count` elements of `dtype`, freed in stream order with the op's tensors.
Tensor scratch_of(CudaStream & cs, int64_t count, DType dtype) {
    return Tensor::empty({std::max<int64_t>(count, 1)}, dtype, cs.device(), TensorOptions{MemoryKind::device, kActivationsPool});
}

// The chunks' sums of a column sum (kernels::column_sum_scratch), or no tensor where one chunk needs none.
Tensor column_sum_scratch(CudaStream & cs, int64_t floats) { return floats > 0 ? scratch_of(cs, floats, DType::f32) : Tensor(); }

GemmOperands gemm_operands(DType dtype) {
    return dtype == DType::bf16 ? GemmOperands::bf16 : dtype == DType::f16 ? GemmOperands::f16 : GemmOperands::f32;
}

// The scalars of core's adam_scalars, the host kernel's own.
kernels::AdamCoeffs adam_coeffs(const AdamStep & a) {
    const AdamScalars   sc = adam_scalars(a.lr, a.beta1, a.beta2, a.weight_decay, a.step);
    kernels::AdamCoeffs c;
    c.beta1           = a.beta1;
    c.beta2           = a.beta2;
    c.one_minus_beta1 = sc.one_minus_beta1;
    c.one_minus_beta2 = sc.one_minus_beta2;
    c.step_size       = sc.step_size;
    c.bc2_sqrt        = sc.bc2_sqrt;
    c.eps             = a.eps;
    c.decay           = sc.decay;
    return c;
}

kernels::AdamOut adam_out(const Tensor & out) {
    return !out.defined() ? kernels::AdamOut::none : out.dtype() == DType::bf16 ? kernels::AdamOut::bf16 : kernels::AdamOut::f32;
}

class CudaOps final : public Ops {
public:
    OpSupport supports(const OpQuery & query) const override { return cuda_supports(query); }

    void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
              bool accumulate) override {
        const op_checks::GemmDims dims = op_checks::gemm(a, trans_a, b, trans_b, c, accumulate);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;   // plain variables: clang 14 captures no structured bindings
        CudaStream & cs     = start(s, "gemm", {a, b, c});
        if (a.dtype() == DType::f64) {   // the router's fp64 GEMMs: a kernel of core/gemm_f64.h's arithmetic
            kernels::gemm_f64(cs.launch("gemm"), trans_a, trans_b, m, n, k, a.data<double>(), b.data<double>(),
                              c.data<double>(), accumulate);
            cs.launched("gemm", {a, b, c});
            return;
        }
        cudaStream_t stream = cs.launch("gemm");   // refuses a capture before the workspace is allocated
        gemm_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a, trans_b, m,
                n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), c.data_ptr(), c.dtype() == DType::bf16, accumulate);
        cs.launched("gemm", {a, b, c});
    }

    // cuBLASLt's bias epilogue where it has a kernel for the operands; else the product and bias_add's kernel.
    void gemm_bias(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
                   const Tensor & bias) override {
        const op_checks::GemmDims dims = op_checks::gemm_bias(a, trans_a, b, trans_b, c, bias);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;
        CudaStream & cs     = start(s, "gemm_bias", {a, b, c, bias});
        cudaStream_t stream = cs.launch("gemm_bias");
        if (!gemm_bias_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a,
                          trans_b, m, n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), f32(bias), c.data_ptr(),
                          c.dtype() == DType::bf16)) {
            with_activations(c, [&]<class T>(T *) { kernels::bias_add(stream, act<T>(c), f32(bias), m, n); });
        }
        cs.launched("gemm_bias", {a, b, c, bias});
    }

    // cuBLASLt's GELU_AUX(_BIAS) epilogue where it has a kernel; else the product and bias_gelu_forward's kernel.
    void gemm_bias_gelu(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & pre,
                        const Tensor & y, const Tensor & bias) override {
        const op_checks::GemmDims dims = op_checks::gemm_bias_gelu(a, trans_a, b, trans_b, pre, y, bias);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;
        std::vector<Tensor>       held{a, b, pre, y, bias};
        CudaStream &              cs     = start(s, "gemm_bias_gelu", held);
        cudaStream_t              stream = cs.launch("gemm_bias_gelu");
        const bool                c_bf16 = y.dtype() == DType::bf16;
        if (!gemm_gelu_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a,
                          trans_b, m, n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), f32_or_null(bias),
                          pre.data_ptr(), y.data_ptr(), c_bf16)) {
            gemm_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a, trans_b, m,
                    n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), pre.data_ptr(), c_bf16, false);
            with_activations(pre, [&]<class T>(T *) {
                kernels::bias_gelu_forward(stream, act<T>(pre), f32_or_null(bias), act<T>(y), nullptr, m, n);
            });
        }
        cs.launched("gemm_bias_gelu", std::move(held));
    }

    // cuBLASLt's BGRADB epilogue where it has a kernel: the bias gradient, written to a scratch vector, is added
    // to dbias; else bias_backward's kernel and the product.
    void gemm_weight_grad(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & dw, const Tensor & dbias) override {
        const op_checks::GemmDims dims = op_checks::gemm_weight_grad(dy, x, dw, dbias);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;
        CudaStream &              cs      = start(s, "gemm_weight_grad", {dy, x, dw, dbias});
        Tensor                    scratch = scratch_of(cs, std::max<int64_t>(m, 1), DType::f32);
        Tensor                    partial = column_sum_scratch(cs, kernels::column_sum_scratch(k, m));
        cudaStream_t              stream  = cs.launch("gemm_weight_grad");
        if (gemm_bgradb_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, true, false,
                           m, n, k, dy.data_ptr(), x.data_ptr(), gemm_operands(dy.dtype()), f32(dw), true, f32(scratch))) {
            kernels::add_inplace(stream, f32(dbias), f32(scratch), m);
        } else {
            with_activations(dy, [&]<class T>(T *) {
                kernels::bias_backward(stream, act<T>(dy), f32(dbias), f32_or_null(partial), k, m);
            });
            gemm_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, true, false, m, n,
                    k, dy.data_ptr(), x.data_ptr(), gemm_operands(dy.dtype()), dw.data_ptr(), false, true);
        }
        cs.launched("gemm_weight_grad", {dy, x, dw, dbias, scratch, partial});
    }

    // cuBLASLt's DGELU epilogue where it has a kernel; else the product and gelu_backward's kernel in place.
    void gemm_gelu_backward(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b,
                            const Tensor & pre, const Tensor & dx) override {
        const op_checks::GemmDims dims = op_checks::gemm_gelu_backward(a, trans_a, b, trans_b, pre, dx);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;
        CudaStream &              cs     = start(s, "gemm_gelu_backward", {a, b, pre, dx});
        cudaStream_t              stream = cs.launch("gemm_gelu_backward");
        const bool                c_bf16 = dx.dtype() == DType::bf16;
        if (!gemm_dgelu_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a,
                           trans_b, m, n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), pre.data_ptr(),
                           dx.data_ptr(), c_bf16)) {
            gemm_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a, trans_b, m,
                    n, k, a.data_ptr(), b.data_ptr(), gemm_operands(a.dtype()), dx.data_ptr(), c_bf16, false);
            with_activations(dx, [&]<class T>(T *) {
                kernels::gelu_backward(stream, act<T>(pre), act<T>(dx), act<T>(dx), dx.numel());
            });
        }
        cs.launched("gemm_gelu_backward", {a, b, pre, dx});
    }

    void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma,
                           const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd,
                           float eps) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::layernorm_forward(x, residual, gamma, beta, y, mean, rstd);
        std::vector<Tensor> held{x, residual, gamma, beta, y, mean, rstd};
        CudaStream &        cs = start(s, "layernorm_forward", held);
        cudaStream_t        stream = cs.launch("layernorm_forward");
        with_activations(x, [&]<class T>(T *) {
            kernels::layernorm_forward(stream, act<T>(x), act_or_null<T>(residual), f32(gamma), f32_or_null(beta), act<T>(y),
                                       f32(mean), f32(rstd), n, h, eps);
        });
        cs.launched("layernorm_forward", std::move(held));
    }

    void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y,
                         const Tensor & rstd, float eps) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::rmsnorm_forward(x, residual, gamma, y, rstd);
        std::vector<Tensor> held{x, residual, gamma, y, rstd};
        CudaStream &        cs = start(s, "rmsnorm_forward", held);
        cudaStream_t        stream = cs.launch("rmsnorm_forward");
        with_activations(x, [&]<class T>(T *) {
            kernels::rmsnorm_forward(stream, act<T>(x), act_or_null<T>(residual), f32(gamma), act<T>(y), f32(rstd), n, h, eps);
        });
        cs.launched("rmsnorm_forward", std::move(held));
    }

    void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & mean,
                            const Tensor & rstd, const Tensor & dx, const Tensor & dgamma, const Tensor & dbeta,
                            const Tensor & dresidual) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, dresidual);
        std::vector<Tensor> held{dy, x, gamma, mean, rstd, dx, dgamma, dbeta, dresidual};
        CudaStream &        cs      = start(s, "layernorm_backward", held);
        Tensor              partial = column_sum_scratch(cs, 2 * kernels::column_sum_scratch(n, h));
        cudaStream_t        stream  = cs.launch("layernorm_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::layernorm_backward(stream, act<T>(dy), act<T>(x), f32(gamma), f32(mean), f32(rstd), act<T>(dx),
                                        f32(dgamma), f32_or_null(dbeta), f32_or_null(partial), n, h,
                                        act_or_null<T>(dresidual));
        });
        held.push_back(partial);
        cs.launched("layernorm_backward", std::move(held));
    }

    void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & rstd,
                          const Tensor & dx, const Tensor & dgamma, const Tensor & dresidual) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma, dresidual);
        std::vector<Tensor> held{dy, x, gamma, rstd, dx, dgamma, dresidual};
        CudaStream &        cs      = start(s, "rmsnorm_backward", held);
        Tensor              partial = column_sum_scratch(cs, kernels::column_sum_scratch(n, h));
        cudaStream_t        stream  = cs.launch("rmsnorm_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::rmsnorm_backward(stream, act<T>(dy), act<T>(x), f32(gamma), f32(rstd), act<T>(dx), f32(dgamma),
                                      f32_or_null(partial), n, h, act_or_null<T>(dresidual));
        });
        held.push_back(partial);
        cs.launched("rmsnorm_backward", std::move(held));
    }

    void bias_add(Stream & s, const Tensor & y, const Tensor & bias) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::bias_add(y, bias);
        CudaStream & cs = start(s, "bias_add", {y, bias});
        if (y.dtype() == DType::f64) {
            kernels::bias_add_f64(cs.launch("bias_add"), y.data<double>(), bias.data<double>(), n, h);
        } else {
            cudaStream_t stream = cs.launch("bias_add");
            with_activations(y, [&]<class T>(T *) { kernels::bias_add(stream, act<T>(y), f32(bias), n, h); });
        }
        cs.launched("bias_add", {y, bias});
    }

    void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::bias_backward(dy, dbias);
        if (dy.dtype() == DType::f64) {
            CudaStream & cs = start(s, "bias_backward", {dy, dbias});
            kernels::bias_backward_f64(cs.launch("bias_backward"), dy.data<double>(), dbias.data<double>(), n, h);
            cs.launched("bias_backward", {dy, dbias});
            return;
        }
        CudaStream & cs      = start(s, "bias_backward", {dy, dbias});
        Tensor       partial = column_sum_scratch(cs, kernels::column_sum_scratch(n, h));
        cudaStream_t stream  = cs.launch("bias_backward");
        with_activations(dy, [&]<class T>(T *) {
            kernels::bias_backward(stream, act<T>(dy), f32(dbias), f32_or_null(partial), n, h);
        });
        cs.launched("bias_backward", {dy, dbias, partial});
    }

    void add_inplace(Stream & s, const Tensor & y, const Tensor & x) override {
        op_checks::add_inplace(y, x);
        CudaStream & cs = start(s, "add_inplace", {y, x});
        cudaStream_t stream = cs.launch("add_inplace");
        with_activations(y, [&]<class T>(T *) { kernels::add_inplace(stream, act<T>(y), act<T>(x), y.numel()); });
        cs.launched("add_inplace", {y, x});
    }

    void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y,
                           const Tensor & x_bf16) override {
        int64_t n, f;
        std::tie(n, f) = op_checks::bias_gelu_forward(x, bias, y, x_bf16);
        std::vector<Tensor> held{x, bias, y, x_bf16};
        CudaStream &        cs = start(s, "bias_gelu_forward", held);
        cudaStream_t        stream = cs.launch("bias_gelu_forward");
        with_activations(x, [&]<class T>(T *) {
            kernels::bias_gelu_forward(stream, act<T>(x), f32_or_null(bias), act<T>(y),
                                       x_bf16.defined() ? bits16(x_bf16) : nullptr, n, f);
        });
        cs.launched("bias_gelu_forward", std::move(held));
    }

    void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        op_checks::gelu_backward(x, dy, dx);
        CudaStream & cs = start(s, "gelu_backward", {x, dy, dx});
        cudaStream_t stream = cs.launch("gelu_backward");
        with_activations(x, [&]<class T>(T *) { kernels::gelu_backward(stream, act<T>(x), act<T>(dy), act<T>(dx), x.numel()); });
        cs.launched("gelu_backward", {x, dy, dx});
    }

    void causal_conv_silu_forward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & y, int64_t seq,
                                  int64_t batch) override {
        int64_t C, K;
        std::tie(C, K) = op_checks::causal_conv(x, w, {&y}, seq, batch, "causal_conv_silu_forward");
        CudaStream & cs = start(s, "causal_conv_silu_forward", {x, w, y});
        kernels::causal_conv_silu_forward(cs.launch("causal_conv_silu_forward"), f32(x), f32(w), f32(y), seq, batch, C, K);
        cs.launched("causal_conv_silu_forward", {x, w, y});
    }

    void causal_conv_silu_backward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & dy, const Tensor & dx,
                                   const Tensor & dw, int64_t seq, int64_t batch) override {
        int64_t C, K;
        std::tie(C, K) = op_checks::causal_conv_backward(x, w, dy, dx, dw, seq, batch);
        CudaStream & cs = start(s, "causal_conv_silu_backward", {x, w, dy, dx, dw});
        kernels::causal_conv_silu_backward(cs.launch("causal_conv_silu_backward"), f32(x), f32(w), f32(dy), f32(dx), f32(dw),
                                           seq, batch, C, K);
        cs.launched("causal_conv_silu_backward", {x, w, dy, dx, dw});
    }

    static kernels::DeltaRuleDims delta_rule_dims(const DeltaRuleShape & d) {
        const int64_t chunks = (d.s + kDeltaRuleChunk - 1) / kDeltaRuleChunk;
        return {d.s, d.b, d.heads, d.dk, d.dv, kDeltaRuleChunk, (chunks + kDeltaRuleChunk + 1) * d.dk * d.dv, d.scale};
    }

    void gated_delta_rule_forward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                  const Tensor & beta, const Tensor & o, const Tensor & workspace,
                                  const DeltaRuleShape & shape) override {
        op_checks::delta_rule_forward(q, k, v, g, beta, o, workspace, shape);
        CudaStream & cs = start(s, "gated_delta_rule_forward", {q, k, v, g, beta, o, workspace});
        kernels::gated_delta_rule_forward(cs.launch("gated_delta_rule_forward"), f32(q), f32(k), f32(v), f32(g), f32(beta),
                                          f32(o), f32(workspace), delta_rule_dims(shape));
        cs.launched("gated_delta_rule_forward", {q, k, v, g, beta, o, workspace});
    }

    void gated_delta_rule_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                   const Tensor & beta, const Tensor & dout, const Tensor & dq, const Tensor & dk,
                                   const Tensor & dv, const Tensor & dg, const Tensor & dbeta, const Tensor & workspace,
                                   const DeltaRuleShape & shape) override {
        op_checks::delta_rule_backward(q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, workspace, shape);
        CudaStream & cs = start(s, "gated_delta_rule_backward", {q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, workspace});
        kernels::gated_delta_rule_backward(cs.launch("gated_delta_rule_backward"), f32(q), f32(k), f32(v), f32(g), f32(beta),
                                           f32(dout), f32(dq), f32(dk), f32(dv), f32(dg), f32(dbeta), f32(workspace),
                                           delta_rule_dims(shape));
        cs.launched("gated_delta_rule_backward", {q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, workspace});
    }

    void output_gate_forward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & y,
                             GateActivation activation) override {
        int64_t n, w, stride;
        std::tie(n, w, stride) = op_checks::output_gate(x, src, gate_col, {&y}, "output_gate_forward");
        CudaStream & cs     = start(s, "output_gate_forward", {x, src, y});
        cudaStream_t stream = cs.launch("output_gate_forward");
        with_activations(x, [&]<class T>(T *) {
            kernels::output_gate_forward(stream, act<T>(x), act<T>(src) + gate_col, stride, act<T>(y), n, w, activation);
        });
        cs.launched("output_gate_forward", {x, src, y});
    }

    void output_gate_backward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & dy,
                              const Tensor & dx, const Tensor & dgate, GateActivation activation) override {
        int64_t n, w, stride;
        std::tie(n, w, stride) = op_checks::output_gate(x, src, gate_col, {&dy, &dx, &dgate}, "output_gate_backward");
        CudaStream & cs     = start(s, "output_gate_backward", {x, src, dy, dx, dgate});
        cudaStream_t stream = cs.launch("output_gate_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::output_gate_backward(stream, act<T>(x), act<T>(src) + gate_col, stride, act<T>(dy), act<T>(dx),
                                          act<T>(dgate), n, w, activation);
        });
        cs.launched("output_gate_backward", {x, src, dy, dx, dgate});
    }

    void l2norm_forward(Stream & s, const Tensor & x, const Tensor & y, const Tensor & rstd, float eps) override {
        int64_t rows, d;
        std::tie(rows, d) = op_checks::l2norm(x, {&y}, rstd, "l2norm_forward");
        CudaStream & cs = start(s, "l2norm_forward", {x, y, rstd});
        kernels::l2norm_forward(cs.launch("l2norm_forward"), f32(x), f32(y), f32(rstd), rows, d, eps);
        cs.launched("l2norm_forward", {x, y, rstd});
    }

    void l2norm_backward(Stream & s, const Tensor & dy, const Tensor & y, const Tensor & rstd, const Tensor & dx) override {
        int64_t rows, d;
        std::tie(rows, d) = op_checks::l2norm(dy, {&y, &dx}, rstd, "l2norm_backward");
        CudaStream & cs = start(s, "l2norm_backward", {dy, y, rstd, dx});
        kernels::l2norm_backward(cs.launch("l2norm_backward"), f32(dy), f32(y), f32(rstd), f32(dx), rows, d);
        cs.launched("l2norm_backward", {dy, y, rstd, dx});
    }

    void dsa_index_scores(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, int64_t seq, int64_t batch,
                          bool relu, const Tensor & scores, const SeqPositions & q_pos) override {
        const auto    n = op_checks::dsa_index(q, k, w, scores, seq, batch, "dsa_index_scores");
        const DsaRows rows{seq, batch, n.keys, q_pos};
        CudaStream &  cs = start(s, "dsa_index_scores", {q, k, w, scores});
        kernels::dsa_index_scores(cs.launch("dsa_index_scores"), f32(q), f32(k), f32(w), f32(scores), rows, n.H, n.d, relu);
        cs.launched("dsa_index_scores", {q, k, w, scores});
    }

    void dsa_index_scores_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, const Tensor & dscores,
                                   int64_t seq, int64_t batch, bool relu, const Tensor & dq, const Tensor & dk,
                                   const Tensor & dw, const SeqPositions & q_pos) override {
        const auto n = op_checks::dsa_index(q, k, w, dscores, seq, batch, "dsa_index_scores_backward");
        op_checks::dsa_index(dq, dk, dw, dscores, seq, batch, "dsa_index_scores_backward");
        const DsaRows rows{seq, batch, n.keys, q_pos};
        CudaStream &  cs = start(s, "dsa_index_scores_backward", {q, k, w, dscores, dq, dk, dw});
        kernels::dsa_index_scores_backward(cs.launch("dsa_index_scores_backward"), f32(q), f32(k), f32(w), f32(dscores),
                                           f32(dq), f32(dk), f32(dw), rows, n.H, n.d, relu);
        cs.launched("dsa_index_scores_backward", {q, k, w, dscores, dq, dk, dw});
    }

    void dsa_topk_mask(Stream & s, const Tensor & scores, int64_t k, const Tensor & mask,
                       const SeqPositions & q_pos) override {
        const auto [seq, keys] = op_checks::dsa_topk_mask(scores, k, mask);
        const DsaRows rows{seq, scores.size(0), keys, q_pos};
        CudaStream &  cs = start(s, "dsa_topk_mask", {scores, mask});
        kernels::dsa_topk_mask(cs.launch("dsa_topk_mask"), f32(scores), k, mask.data<uint8_t>(), rows);
        cs.launched("dsa_topk_mask", {scores, mask});
    }

    void dsa_attention_target(Stream & s, const Tensor & q_k_v, const AttentionShape & shape, float scale,
                              const Tensor & target, const Tensor & kv) override {
        op_checks::dsa_attention_target(q_k_v, kv, shape, target);
        const Tensor keys = kv.defined() ? kv : q_k_v;
        LOOM_CHECK(keys.dtype() == q_k_v.dtype(), "dsa_attention_target: kv " << keys.describe() << " and q_k_v "
                                                                              << q_k_v.describe() << " differ in dtype", "");
        const DsaRows rows{shape.s, shape.b, shape.keys(), shape.q_pos};
        CudaStream &  cs     = start(s, "dsa_attention_target", {q_k_v, keys, target, shape.key_mask});
        cudaStream_t  stream = cs.launch("dsa_attention_target");
        const uint8_t * key_mask = shape.key_mask.defined() ? shape.key_mask.data<uint8_t>() : nullptr;
        with_activations(q_k_v, [&]<class T>(T *) {
            kernels::dsa_attention_target(stream, act<T>(q_k_v), act<T>(keys), f32(target), rows, shape.nq, shape.d,
                                          shape.row_stride, shape.kv_stride(), shape.k_column(), scale, key_mask);
        });
        cs.launched("dsa_attention_target", {q_k_v, keys, target, shape.key_mask});
    }

    void dsa_indexer_loss(Stream & s, const Tensor & scores, const Tensor & target, float weight, const Tensor & kl,
                          const Tensor & dscores, const Tensor & mask, const SeqPositions & q_pos) override {
        const auto [seq, keys] = op_checks::dsa_indexer_loss(scores, target, kl, dscores, mask);
        const DsaRows rows{seq, scores.size(0), keys, q_pos};
        CudaStream &  cs = start(s, "dsa_indexer_loss", {scores, target, kl, dscores, mask});
        kernels::dsa_indexer_loss(cs.launch("dsa_indexer_loss"), f32(scores), f32(target), weight, f32(kl), f32(dscores), rows,
                                  mask.defined() ? mask.data<uint8_t>() : nullptr);
        cs.launched("dsa_indexer_loss", {scores, target, kl, dscores, mask});
    }

    void gdn_gates_forward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                           const Tensor & g, const Tensor & beta) override {
        int64_t n, H, stride;
        std::tie(n, H, stride) = op_checks::gdn_gates(src, col, a_log, dt_bias, {&g, &beta}, "gdn_gates_forward");
        CudaStream & cs     = start(s, "gdn_gates_forward", {src, a_log, dt_bias, g, beta});
        cudaStream_t stream = cs.launch("gdn_gates_forward");
        with_activations(src, [&]<class T>(T *) {
            kernels::gdn_gates_forward(stream, act<T>(src) + col, stride, f32(a_log), f32(dt_bias), f32(g), f32(beta), n, H);
        });
        cs.launched("gdn_gates_forward", {src, a_log, dt_bias, g, beta});
    }

    void gdn_gates_backward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                            const Tensor & dg, const Tensor & dbeta, const Tensor & dsrc, const Tensor & da_log,
                            const Tensor & ddt_bias) override {
        int64_t n, H, stride;
        std::tie(n, H, stride) = op_checks::gdn_gates_backward(src, col, a_log, dt_bias, dg, dbeta, dsrc, da_log, ddt_bias);
        CudaStream & cs     = start(s, "gdn_gates_backward", {src, a_log, dt_bias, dg, dbeta, dsrc, da_log, ddt_bias});
        cudaStream_t stream = cs.launch("gdn_gates_backward");
        with_activations(src, [&]<class T>(T *) {
            kernels::gdn_gates_backward(stream, act<T>(src) + col, stride, f32(a_log), f32(dt_bias), f32(dg), f32(dbeta),
                                        act<T>(dsrc), f32(da_log), f32(ddt_bias), n, H);
        });
        cs.launched("gdn_gates_backward", {src, a_log, dt_bias, dg, dbeta, dsrc, da_log, ddt_bias});
    }

    void squared_relu_forward(Stream & s, const Tensor & x, const Tensor & y) override {
        op_checks::squared_relu_forward(x, y);
        CudaStream & cs = start(s, "squared_relu_forward", {x, y});
        cudaStream_t stream = cs.launch("squared_relu_forward");
        with_activations(x, [&]<class T>(T *) { kernels::squared_relu_forward(stream, act<T>(x), act<T>(y), x.numel()); });
        cs.launched("squared_relu_forward", {x, y});
    }

    void squared_relu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        op_checks::squared_relu_backward(x, dy, dx);
        CudaStream & cs = start(s, "squared_relu_backward", {x, dy, dx});
        cudaStream_t stream = cs.launch("squared_relu_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::squared_relu_backward(stream, act<T>(x), act<T>(dy), act<T>(dx), x.numel());
        });
        cs.launched("squared_relu_backward", {x, dy, dx});
    }

    void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_forward(x, y);
        CudaStream & cs = start(s, "swiglu_forward", {x, y});
        cudaStream_t stream = cs.launch("swiglu_forward");
        with_activations(x, [&]<class T>(T *) { kernels::swiglu_forward(stream, act<T>(x), act<T>(y), n, two_f / 2); });
        cs.launched("swiglu_forward", {x, y});
    }

    void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_backward(x, dy, dx);
        CudaStream & cs = start(s, "swiglu_backward", {x, dy, dx});
        cudaStream_t stream = cs.launch("swiglu_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::swiglu_backward(stream, act<T>(x), act<T>(dy), act<T>(dx), n, two_f / 2);
        });
        cs.launched("swiglu_backward", {x, dy, dx});
    }
    void glu_forward(Stream & s, const Tensor & x, const Tensor & y, const GluSpec & glu) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_forward(x, y);
        CudaStream & cs = start(s, "glu_forward", {x, y});
        cudaStream_t stream = cs.launch("glu_forward");
        with_activations(x, [&]<class T>(T *) { kernels::glu_forward(stream, act<T>(x), act<T>(y), n, two_f / 2, glu); });
        cs.launched("glu_forward", {x, y});
    }

    void glu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx, const GluSpec & glu) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_backward(x, dy, dx);
        CudaStream & cs = start(s, "glu_backward", {x, dy, dx});
        cudaStream_t stream = cs.launch("glu_backward");
        with_activations(x, [&]<class T>(T *) {
            kernels::glu_backward(stream, act<T>(x), act<T>(dy), act<T>(dx), n, two_f / 2, glu);
        });
        cs.launched("glu_backward", {x, dy, dx});
    }


    void rope(Stream & s, const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d, float base,
              bool inverse, int64_t rotary_dim, bool interleaved, const SeqPositions & positions,
              const RopeScaling & scaling) override {
        const int64_t stride = op_checks::rope(x, seq, batch, heads, d, rotary_dim).second;
        const int64_t r      = rotary_dim > 0 ? rotary_dim : d;
        // The frequencies as backend/cpu/ops.cpp's rope_apply computes them (host std::pow: the same bits),
        // staged through pinned memory into device scratch; the stream keeps both until the kernel has run.
        CudaStream &  cs   = start(s, "rope", {x});
        const int64_t half = r / 2;
        Tensor        host = Tensor::empty({std::max<int64_t>(half, 1)}, DType::f32, cs.device(),
                                           TensorOptions{MemoryKind::pinned_host});
        const std::vector<float> frequencies = rope_inv_freq(base, r, scaling);
        std::copy(frequencies.begin(), frequencies.end(), host.data<float>());
        Tensor       inv_freq = scratch_like(cs, host);
        cudaStream_t stream   = cs.launch("rope");
        LOOM_CUDA_CHECK(cudaMemcpyAsync(inv_freq.data_ptr(), host.data_ptr(), host.nbytes(), cudaMemcpyDefault, stream));
        with_activations(x, [&]<class T>(T *) {
            kernels::rope(stream, act<T>(x), stride, seq, batch, heads, d, r, interleaved, f32(inv_freq), inverse, positions,
                          scaling.amplitude);
        });
        cs.launched("rope", {x, host, inv_freq});
    }

    void dropout(Stream & s, const Tensor & x, const Tensor & y, const Dropout & key) override {
        int64_t n, w;
        std::tie(n, w) = op_checks::dropout(x, y, key);
        kernels::DropoutKey k;
        k.seed       = key.seed;
        k.site       = key.site;
        k.batch      = key.batch;
        k.offset     = key.offset;
        k.positions  = key.positions;
        k.threshold  = dropout_threshold(key.p);
        k.keep_scale = 1.0f / (1.0f - key.p);   // f32, as the CPU computes it
        std::vector<Tensor> held{x, y, key.sample_ids};
        CudaStream &        cs     = start(s, "dropout", held);
        cudaStream_t        stream = cs.launch("dropout");
        k.sample_ids               = device_sample_ids(cs, stream, key, held);
        with_activations(x, [&]<class T>(T *) { kernels::dropout(stream, act<T>(x), act<T>(y), n, w, k); });
        cs.launched("dropout", std::move(held));
    }

    void embedding_forward(Stream & s, const Tensor & tokens, const Tensor & wte, const Tensor & wpe,
                           const Tensor & out, const SeqPositions & positions) override {
        const op_checks::EmbeddingDims dims = op_checks::embedding_forward(tokens, wte, wpe, out, positions);
        const int64_t                  vocab = wte.size(0);
        launch_with_id_check(s, "embedding_forward", {tokens, wte, wpe, out}, tokens, vocab, "token", [&](cudaStream_t stream) {
            with_activations(out, [&]<class T>(T *) {
                kernels::embedding_forward(stream, tokens.data<int32_t>(), wte.data_ptr(), wpe.defined() ? wpe.data_ptr() : nullptr,
                                           float_kind(wte.dtype()), act<T>(out), dims.s, dims.b, dims.h, vocab, positions);
            });
        });
    }

    void embedding_backward(Stream & s, const Tensor & tokens, const Tensor & dout, const Tensor & dwte,
                            const Tensor & dwpe, const SeqPositions & positions) override {
        const op_checks::EmbeddingDims dims = op_checks::embedding_backward(tokens, dout, dwte, dwpe, positions);
        const int64_t                  vocab = dwte.size(0);
        const Tensor keys = Tensor::empty({kernels::embedding_backward_keys(dims.s * dims.b)}, DType::i64, dwte.device(),
                                          TensorOptions{MemoryKind::device, kActivationsPool});
        launch_with_id_check(s, "embedding_backward", {tokens, dout, dwte, dwpe, keys}, tokens, vocab, "token", [&](cudaStream_t stream) {
            with_activations(dout, [&]<class T>(T *) {
                kernels::embedding_backward(stream, tokens.data<int32_t>(), act<T>(dout), f32(dwte), f32_or_null(dwpe), dims.s,
                                            dims.b, dims.h, vocab, positions, static_cast<uint64_t *>(keys.data_ptr()));
            });
        });
    }

    void vocab_shard_ids(Stream & s, const Tensor & ids, int64_t begin, int64_t count, const Tensor & out) override {
        op_checks::vocab_shard_ids(ids, out);
        CudaStream & cs = start(s, "vocab_shard_ids", {ids, out});
        kernels::vocab_shard_ids(cs.launch("vocab_shard_ids"), ids.data<int32_t>(), ids.numel(), begin, count,
                                 out.data<int32_t>());
        cs.launched("vocab_shard_ids", {ids, out});
    }

    void attention_forward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & lse,
                           const AttentionShape & shape, float scale, const Dropout & dropout) override {
        op_checks::attention_forward(q, kv, out, lse, shape, dropout);
        check_head_dim(shape, "attention_forward");
        std::vector<Tensor> held{q, kv, out, lse, dropout.sample_ids, shape.key_mask};
        CudaStream &        cs     = start(s, "attention_forward", held);
        if (const auto f = fused_attention_shape(q, out, shape, dropout, false)) {
            if (const auto workspace = fused_attention_workspace(cs, *f, false)) {
                cudaStream_t stream = cs.launch("attention_forward");
                fused_attention_forward(cs.device_index(), stream, *f, q.data_ptr(),
                                        column<uint16_t>(kv, shape.k_column()), column<uint16_t>(kv, shape.v_column()),
                                        out.data_ptr(), f32(lse), scale, workspace->data_ptr());
                held.push_back(*workspace);
                cs.launched("attention_forward", std::move(held));
                return;
            }
        }
        cudaStream_t        stream = cs.launch("attention_forward");
        const kernels::AttentionKey key = attention_key(cs, stream, dropout, held);
        with_activations(q, [&]<class T>(T *) {
            LOOM_CUDA_CHECK(kernels::attention_forward(stream, act<T>(q), act<T>(kv), act<T>(out), f32(lse),
                                                       attention_dims(shape), scale, key));
        });
        cs.launched("attention_forward", std::move(held));
    }
    void attention_backward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & dout,
                            const Tensor & lse, const Tensor & dq, const Tensor & dkv, const AttentionShape & shape,
                            float scale, const Dropout & dropout, bool accumulate) override {
        op_checks::attention_backward(q, kv, out, dout, lse, dq, dkv, shape, dropout);
        check_head_dim(shape, "attention_backward");
        std::vector<Tensor> held{q, kv, out, dout, lse, dq, dkv, dropout.sample_ids, shape.key_mask};
        CudaStream &        cs     = start(s, "attention_backward", held);
        if (const auto f = fused_attention_shape(q, out, shape, dropout, accumulate);
            f && dout.dtype() == q.dtype() && dq.dtype() == q.dtype() && dkv.dtype() == q.dtype()) {
            if (const auto workspace = fused_attention_workspace(cs, *f, true)) {
                cudaStream_t stream = cs.launch("attention_backward");
                fused_attention_backward(cs.device_index(), stream, *f, q.data_ptr(),
                                         column<uint16_t>(kv, shape.k_column()), column<uint16_t>(kv, shape.v_column()),
                                         out.data_ptr(), dout.data_ptr(), f32(lse), dq.data_ptr(),
                                         const_cast<void *>(column<uint16_t>(dkv, shape.k_column())),
                                         const_cast<void *>(column<uint16_t>(dkv, shape.v_column())), scale,
                                         workspace->data_ptr());
                held.push_back(*workspace);
                cs.launched("attention_backward", std::move(held));
                return;
            }
        }
        Tensor              delta  = scratch_like(cs, lse);   // rowsum(dO * O), (b, nq, s) as lse
        cudaStream_t        stream = cs.launch("attention_backward");
        const kernels::AttentionKey key = attention_key(cs, stream, dropout, held);
        with_activations(q, [&]<class T>(T *) {
            LOOM_CUDA_CHECK(kernels::attention_backward(stream, act<T>(q), act<T>(kv), act<T>(out), act<T>(dout), f32(lse),
                                                        f32(delta), act<T>(dq), act<T>(dkv), attention_dims(shape), scale, key,
                                                        accumulate));
        });
        held.push_back(delta);
        cs.launched("attention_backward", std::move(held));
    }
    void attention_merge(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & part_out,
                         const Tensor & part_lse, const AttentionShape & shape) override {
        op_checks::attention_merge(out, lse, part_out, part_lse, shape);
        std::vector<Tensor> held{out, lse, part_out, part_lse};
        CudaStream &        cs = start(s, "attention_merge", held);
        LOOM_CUDA_CHECK(kernels::attention_merge(cs.launch("attention_merge"), f32(out), f32(lse), f32(part_out),
                                                 f32(part_lse), shape.s, shape.b, shape.nq, shape.d));
        cs.launched("attention_merge", std::move(held));
    }

    void attention_sink_forward(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & sink,
                                const AttentionShape & shape) override {
        op_checks::attention_sink(out, nullptr, lse, sink, nullptr, shape, "attention_sink_forward");
        std::vector<Tensor> held{out, lse, sink};
        CudaStream &        cs     = start(s, "attention_sink_forward", held);
        cudaStream_t        stream = cs.launch("attention_sink_forward");
        with_activations(out, [&]<class T>(T *) {
            LOOM_CUDA_CHECK(kernels::attention_sink_forward(stream, act<T>(out), f32(lse), f32(sink), shape.s, shape.b,
                                                            shape.nq, shape.d));
        });
        cs.launched("attention_sink_forward", std::move(held));
    }
    void attention_sink_backward(Stream & s, const Tensor & out, const Tensor & dout, const Tensor & lse, const Tensor & sink,
                                 const Tensor & dsink, const AttentionShape & shape) override {
        static_assert(kernels::kSinkLanes == loom::kSinkLanes, "the CPU's lanes and the CUDA block's threads");
        op_checks::attention_sink(out, &dout, lse, sink, &dsink, shape, "attention_sink_backward");
        std::vector<Tensor> held{out, dout, lse, sink, dsink};
        CudaStream &        cs     = start(s, "attention_sink_backward", held);
        cudaStream_t        stream = cs.launch("attention_sink_backward");
        with_activations(out, [&]<class T>(T *) {
            LOOM_CUDA_CHECK(kernels::attention_sink_backward(stream, act<T>(out), act<T>(dout), f32(lse), f32(sink),
                                                             f32(dsink), shape.s, shape.b, shape.nq, shape.d));
        });
        cs.launched("attention_sink_backward", std::move(held));
    }

    void cross_entropy_forward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & loss,
                               const Tensor & lse, int64_t vocab) override {
        const op_checks::LabelDims d = op_checks::cross_entropy_forward(logits, labels, loss, lse, vocab);
        launch_with_id_check(s, "cross_entropy_forward", {logits, labels, loss, lse}, labels, vocab, "label", [&](cudaStream_t stream) {
            with_activations(logits, [&]<class T>(T *) {
                kernels::cross_entropy_forward(stream, act<T>(logits), labels.data<int32_t>(), f32(loss), f32(lse), d.seq, d.b,
                                               d.stride, vocab);
            });
        });
    }

    void cross_entropy_backward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & lse,
                                const Tensor & dloss, int64_t vocab) override {
        const op_checks::LabelDims d = op_checks::cross_entropy_backward(logits, labels, lse, dloss, vocab);
        launch_with_id_check(s, "cross_entropy_backward", {logits, labels, lse, dloss}, labels, vocab, "label", [&](cudaStream_t stream) {
            with_activations(logits, [&]<class T>(T *) {
                kernels::cross_entropy_backward(stream, act<T>(logits), labels.data<int32_t>(), f32(lse), f32(dloss), d.seq,
                                                d.b, d.stride, vocab);
            });
        });
    }

    void row_max(Stream & s, const Tensor & logits, int64_t valid, const Tensor & out) override {
        int64_t n, stride;
        std::tie(n, stride) = op_checks::row_max(logits, valid, out);
        CudaStream & cs = start(s, "row_max", {logits, out});
        cudaStream_t stream = cs.launch("row_max");
        with_activations(logits, [&]<class T>(T *) { kernels::row_max(stream, act<T>(logits), n, stride, valid, f32(out)); });
        cs.launched("row_max", {logits, out});
    }

    void row_sum_exp(Stream & s, const Tensor & logits, const Tensor & max, int64_t valid, const Tensor & out) override {
        int64_t n, stride;
        std::tie(n, stride) = op_checks::row_sum_exp(logits, max, valid, out);
        CudaStream & cs = start(s, "row_sum_exp", {logits, max, out});
        cudaStream_t stream = cs.launch("row_sum_exp");
        with_activations(logits, [&]<class T>(T *) {
            kernels::row_sum_exp(stream, act<T>(logits), f32(max), n, stride, valid, f32(out));
        });
        cs.launched("row_sum_exp", {logits, max, out});
    }

    void label_logit(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & out) override {
        const op_checks::LabelDims d = op_checks::label_logit(logits, labels, out);
        launch_with_id_check(s, "label_logit", {logits, labels, out}, labels, d.stride, "label", [&](cudaStream_t stream) {
            with_activations(logits, [&]<class T>(T *) {
                kernels::label_logit(stream, act<T>(logits), labels.data<int32_t>(), f32(out), d.seq, d.b, d.stride);
            });
        });
    }

    void lse_and_loss(Stream & s, const Tensor & max, const Tensor & sum, const Tensor & target, const Tensor & lse,
                      const Tensor & loss) override {
        const int64_t       n = op_checks::lse_and_loss(max, sum, target, lse, loss);
        std::vector<Tensor> held{max, sum, target, lse, loss};
        CudaStream &        cs = start(s, "lse_and_loss", held);
        kernels::lse_and_loss(cs.launch("lse_and_loss"), f32(max), f32(sum), f32(target), f32(lse), f32(loss), n);
        cs.launched("lse_and_loss", std::move(held));
    }

    void loss_grad(Stream & s, const Tensor & mask, double scale, const Tensor & dloss) override {
        int64_t b, seq;
        std::tie(b, seq) = op_checks::loss_grad(mask, dloss);
        CudaStream & cs = start(s, "loss_grad", {mask, dloss});
        kernels::loss_grad(cs.launch("loss_grad"), f32(mask), scale, f32(dloss), seq, b);
        cs.launched("loss_grad", {mask, dloss});
    }

    void convert(Stream & s, const Tensor & src, const Tensor & dst) override {
        op_checks::convert(src, dst);
        CudaStream & cs     = start(s, "convert", {src, dst});
        cudaStream_t stream = cs.launch("convert");
        if (src.dtype() == dst.dtype()) {
            if (src.nbytes() > 0 && src.data_ptr() != dst.data_ptr()) {
                LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDefault, stream));
            }
        } else {
            kernels::convert(stream, src.data_ptr(), float_kind(src.dtype()), dst.data_ptr(), float_kind(dst.dtype()),
                             src.numel());
        }
        cs.launched("convert", {src, dst});
    }

    void round_to_bf16(Stream & s, const Tensor & x, const Tensor & x_bf16) override {
        op_checks::round_to_bf16(x, x_bf16);
        CudaStream & cs = start(s, "round_to_bf16", {x, x_bf16});
        kernels::round_to_bf16(cs.launch("round_to_bf16"), f32(x), bits16(x_bf16), x.numel());
        cs.launched("round_to_bf16", {x, x_bf16});
    }

    void copy(Stream & s, const Tensor & src, const Tensor & dst) override {
        op_checks::copy(src, dst);
        CudaStream & cs     = start(s, "copy", {src, dst}, /*copy_only=*/true);
        cudaStream_t stream = cs.launch("copy");
        if (src.nbytes() > 0) {
            LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDefault, stream));
        }
        cs.launched("copy", {src, dst});
    }

    void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col,
                      int64_t width) override {
        op_checks::copy_columns(src, src_col, dst, dst_col, width);
        CudaStream & cs     = start(s, "copy_columns", {src, dst}, /*copy_only=*/true);
        cudaStream_t stream = cs.launch("copy_columns");
        const size_t elem   = dtype_size(src.dtype());
        if (width > 0 && src.size(0) > 0) {
            LOOM_CUDA_CHECK(cudaMemcpy2DAsync(static_cast<char *>(dst.data_ptr()) + dst_col * elem, dst.size(1) * elem,
                                              static_cast<const char *>(src.data_ptr()) + src_col * elem,
                                              src.size(1) * elem, width * elem, src.size(0), cudaMemcpyDefault, stream));
        }
        cs.launched("copy_columns", {src, dst});
    }

    void fill_zero(Stream & s, const Tensor & t) override {
        CudaStream & cs     = start(s, "fill_zero", {t});
        cudaStream_t stream = cs.launch("fill_zero");
        if (t.nbytes() > 0) LOOM_CUDA_CHECK(cudaMemsetAsync(t.data_ptr(), 0, t.nbytes(), stream));
        cs.launched("fill_zero", {t});
    }

    void scale(Stream & s, const Tensor & t, float factor) override {
        op_checks::scale(t);
        CudaStream & cs = start(s, "scale", {t});
        kernels::scale(cs.launch("scale"), t.data_ptr(), float_kind(t.dtype()), factor, t.numel());
        cs.launched("scale", {t});
    }

    void fp8_quantize(Stream & s, const Tensor & x, Fp8Format format, const Tensor & q, const Tensor & scale_inv) override {
        op_checks::fp8_quantize(x, q, scale_inv);
        CudaStream & cs = start(s, "fp8_quantize", {x, q, scale_inv});
        // Scratch: each chunk's largest |x| and the scale, freed in stream order with the op's tensors.
        Tensor partial = Tensor::empty({std::max<int64_t>(kernels::fp8_quantize_chunks(x.numel()), 1)}, DType::f64,
                                       cs.device(), TensorOptions{MemoryKind::device, kActivationsPool});
        Tensor scale = Tensor::empty({1}, DType::f32, cs.device(), TensorOptions{MemoryKind::device, kActivationsPool});
        kernels::fp8_quantize(cs.launch("fp8_quantize"), x.data_ptr(), float_kind(x.dtype()), x.numel(), format,
                              static_cast<uint16_t *>(q.data_ptr()), f32(scale_inv), static_cast<double *>(partial.data_ptr()),
                              f32(scale));
        cs.launched("fp8_quantize", {x, q, scale_inv, partial, scale});
    }

    void fp8_quantize_blocks(Stream & s, const Tensor & x, Fp8Format format, int64_t block_rows, int64_t block_cols,
                             const Tensor & q, bool mx) override {
        op_checks::fp8_quantize_blocks(x, block_rows, block_cols, q);
        CudaStream &  cs     = start(s, "fp8_quantize_blocks", {x, q});
        const int64_t blocks = ((x.size(0) + block_rows - 1) / block_rows) * ((x.size(1) + block_cols - 1) / block_cols);
        Tensor        scale  = Tensor::empty({std::max<int64_t>(blocks, 1)}, DType::f32, cs.device(),
                                             TensorOptions{MemoryKind::device, kActivationsPool});
        kernels::fp8_quantize_blocks(cs.launch("fp8_quantize_blocks"), x.data_ptr(), float_kind(x.dtype()), x.size(0), x.size(1),
                                     format, block_rows, block_cols, f32(scale), static_cast<uint16_t *>(q.data_ptr()), mx);
        cs.launched("fp8_quantize_blocks", {x, q, scale});
    }

    void sigmoid_gate_forward(Stream & s, const Tensor & y, const Tensor & logits) override {
        op_checks::sigmoid_gate(y, logits, "sigmoid_gate_forward");
        CudaStream & cs = start(s, "sigmoid_gate_forward", {y, logits});
        kernels::sigmoid_gate_forward(cs.launch("sigmoid_gate_forward"), f32(y), f32(logits), y.size(0), y.size(1));
        cs.launched("sigmoid_gate_forward", {y, logits});
    }

    void sigmoid_gate_backward(Stream & s, const Tensor & dy, const Tensor & m, const Tensor & logits, const Tensor & dm,
                               const Tensor & dlogits) override {
        op_checks::sigmoid_gate(dy, logits, "sigmoid_gate_backward");
        op_checks::sigmoid_gate(m, logits, "sigmoid_gate_backward");
        op_checks::sigmoid_gate(dm, dlogits, "sigmoid_gate_backward");
        CudaStream & cs = start(s, "sigmoid_gate_backward", {dy, m, logits, dm, dlogits});
        kernels::sigmoid_gate_backward(cs.launch("sigmoid_gate_backward"), f32(dy), f32(m), f32(logits), f32(dm), f32(dlogits),
                                       dy.size(0), dy.size(1));
        cs.launched("sigmoid_gate_backward", {dy, m, logits, dm, dlogits});
    }

    void fp8_quantize_scaled(Stream & s, const Tensor & x, Fp8Format format, const Tensor & scale, const Tensor & q,
                             const Tensor & scale_inv) override {
        op_checks::fp8_quantize_scaled(x, scale, q, scale_inv);
        CudaStream & cs = start(s, "fp8_quantize_scaled", {x, scale, q, scale_inv});
        kernels::fp8_quantize_scaled(cs.launch("fp8_quantize_scaled"), x.data_ptr(), float_kind(x.dtype()), x.numel(), format,
                                     f32(scale), static_cast<uint16_t *>(q.data_ptr()), f32(scale_inv));
        cs.launched("fp8_quantize_scaled", {x, scale, q, scale_inv});
    }

    void fp8_delayed_update(Stream & s, const Tensor & history, const Tensor & scale, Fp8Format format, int margin,
                            bool max_algo) override {
        op_checks::fp8_delayed_update(history, scale);
        CudaStream & cs = start(s, "fp8_delayed_update", {history, scale});
        kernels::fp8_delayed_update(cs.launch("fp8_delayed_update"), f32(history), f32(scale), history.size(0),
                                    history.size(1), format, margin, max_algo);
        cs.launched("fp8_delayed_update", {history, scale});
    }

    void fp8_amax(Stream & s, const Tensor & x, const Tensor & amax) override {
        op_checks::fp8_amax(x, amax);
        CudaStream & cs = start(s, "fp8_amax", {x, amax});
        Tensor partial = Tensor::empty({std::max<int64_t>(kernels::fp8_quantize_chunks(x.numel()), 1)}, DType::f64,
                                       cs.device(), TensorOptions{MemoryKind::device, kActivationsPool});
        kernels::fp8_amax(cs.launch("fp8_amax"), x.data_ptr(), float_kind(x.dtype()), x.numel(),
                          static_cast<double *>(partial.data_ptr()), f32(amax));
        cs.launched("fp8_amax", {x, amax, partial});
    }

    void fp8_encode(Stream & s, const Tensor & x, Fp8Format format, const Tensor & amax, const Tensor & codes,
                    const Tensor & scale_inv) override {
        op_checks::fp8_encode(x, amax, codes, scale_inv);
        CudaStream & cs = start(s, "fp8_encode", {x, amax, codes, scale_inv});
        kernels::fp8_encode(cs.launch("fp8_encode"), f32(x), x.numel(), format, f32(amax),
                            static_cast<uint8_t *>(codes.data_ptr()), f32(scale_inv));
        cs.launched("fp8_encode", {x, amax, codes, scale_inv});
    }

    void fp8_decode(Stream & s, const Tensor & codes, Fp8Format format, const Tensor & q) override {
        op_checks::fp8_decode(codes, q);
        CudaStream & cs = start(s, "fp8_decode", {codes, q});
        kernels::fp8_decode(cs.launch("fp8_decode"), static_cast<const uint8_t *>(codes.data_ptr()), codes.numel(), format,
                            static_cast<uint16_t *>(q.data_ptr()));
        cs.launched("fp8_decode", {codes, q});
    }

    void scale_by_reciprocal(Stream & s, const Tensor & t, const Tensor & d) override {
        op_checks::scale_by_reciprocal(t, d);
        CudaStream & cs = start(s, "scale_by_reciprocal", {t, d});
        kernels::scale_by_reciprocal(cs.launch("scale_by_reciprocal"), f32(t), f32(d), t.numel());
        cs.launched("scale_by_reciprocal", {t, d});
    }

    void scale_by_product(Stream & s, const Tensor & t, const Tensor & a, const Tensor & b) override {
        op_checks::scale_by_product(t, a, b);
        CudaStream & cs = start(s, "scale_by_product", {t, a, b});
        kernels::scale_by_product(cs.launch("scale_by_product"), f32(t), f32(a), f32(b), t.numel());
        cs.launched("scale_by_product", {t, a, b});
    }

    void scale_by_inverse_norm(Stream & s, const Tensor & t, const Tensor & sums, double eps) override {
        op_checks::scale_by_inverse_norm(t, sums);
        CudaStream & cs = start(s, "scale_by_inverse_norm", {t, sums});
        kernels::scale_by_inverse_norm(cs.launch("scale_by_inverse_norm"), t.data<float>(), sums.data<float>(), eps,
                                       t.numel());
        cs.launched("scale_by_inverse_norm", {t, sums});
    }

    void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) override {
        op_checks::sum_of_squares(x, out);
        CudaStream &  cs     = start(s, "sum_of_squares", {x, out});
        cudaStream_t  stream = cs.launch("sum_of_squares");
        const int64_t chunks = kernels::sum_of_squares_chunks(x.numel());
        // Scratch for the per-chunk partial sums, freed in stream order with the op's tensors.
        Tensor partial = Tensor::empty({std::max<int64_t>(chunks, 1)}, DType::i64, cs.device(),
                                       TensorOptions{MemoryKind::device, kActivationsPool});
        kernels::sum_of_squares(stream, f32(x), x.numel(), static_cast<double *>(partial.data_ptr()), f32(out));
        cs.launched("sum_of_squares", {x, out, partial});
    }

    // kernels::kSquaresMultiTensors tensors per pair of launches: GPT-2's 148 gradients in 6 launches, not 296.
    void sum_of_squares_multi(Stream & s, std::span<const Tensor> xs, const Tensor & out) override {
        LOOM_CHECK(out.dtype() == DType::f32 && out.numel() == 2 * static_cast<int64_t>(xs.size()),
                   "sum_of_squares_multi: out is " << out.describe() << " for " << xs.size() << " tensors",
                   "out holds a (hi, lo) f32 pair per tensor");
        for (size_t first = 0; first < xs.size(); first += kernels::kSquaresMultiTensors) {
            const size_t          count = std::min<size_t>(kernels::kSquaresMultiTensors, xs.size() - first);
            const Tensor          pairs = out.slice(static_cast<int64_t>(2 * first), {static_cast<int64_t>(2 * count)});
            kernels::SquaresMulti args;
            std::vector<Tensor>   held{pairs};
            args.chunk_begin[0] = 0;
            for (size_t t = 0; t < count; ++t) {
                const Tensor & x = xs[first + t];
                op_checks::sum_of_squares(x, pairs.slice(static_cast<int64_t>(2 * t), {2}));
                args.x[t]               = f32(x);
                args.n[t]               = x.numel();
                args.chunk_begin[t + 1] = args.chunk_begin[t] + kernels::sum_of_squares_chunks(x.numel());
                held.push_back(x);
            }
            args.count          = static_cast<int>(count);
            CudaStream &  cs     = start(s, "sum_of_squares_multi", held);
            Tensor        partial = Tensor::empty({std::max<int64_t>(args.chunk_begin[count], 1)}, DType::i64, cs.device(),
                                                  TensorOptions{MemoryKind::device, kActivationsPool});
            kernels::sum_of_squares_multi(cs.launch("sum_of_squares_multi"), args,
                                          static_cast<double *>(partial.data_ptr()), f32(pairs));
            held.push_back(partial);
            cs.launched("sum_of_squares_multi", std::move(held));
        }
    }

    // ---- Mixture of Experts (moe_kernels.h)
    void moe_topk(Stream & s, const Tensor & logits, const MoeRouting & r, const Tensor & expert_bias,
                  const Tensor & top_idx, const Tensor & probs) override {
        const int64_t                 n    = op_checks::moe_topk(logits, r, expert_bias, top_idx, probs);
        const kernels::MoeRoutingArgs args = routing_args(r, "moe_topk");
        CudaStream &                  cs   = start(s, "moe_topk", {logits, expert_bias, top_idx, probs});
        cudaStream_t                  stream = cs.launch("moe_topk");
        const float *                 bias   = expert_bias.defined() ? f32(expert_bias) : nullptr;
        with_logits(logits, [&](const auto * l) {
            kernels::moe_topk(stream, l, n, args, bias, top_idx.data<int32_t>(), f32(probs));
        });
        cs.launched("moe_topk", {logits, expert_bias, top_idx, probs});
    }

    void moe_count_tokens(Stream & s, const Tensor & tokens_per_expert, const Tensor & load) override {
        op_checks::moe_count_tokens(tokens_per_expert, load);
        CudaStream & cs = start(s, "moe_count_tokens", {tokens_per_expert, load});
        kernels::moe_count_tokens(cs.launch("moe_count_tokens"), tokens_per_expert.data<int64_t>(), load.numel(), f32(load));
        cs.launched("moe_count_tokens", {tokens_per_expert, load});
    }

    void moe_expert_bias_update(Stream & s, const Tensor & load, const Tensor & bias, float rate) override {
        const auto [rows, experts] = op_checks::moe_expert_bias_update(load, bias);
        CudaStream & cs = start(s, "moe_expert_bias_update", {load, bias});
        kernels::moe_expert_bias_update(cs.launch("moe_expert_bias_update"), f32(load), f32(bias), rows, experts, rate);
        cs.launched("moe_expert_bias_update", {load, bias});
    }

    void moe_sinkhorn_topk(Stream & s, const Tensor & logits, int64_t first, const MoeRouting & r, const Tensor & top_idx,
                           const Tensor & probs) override {
        const int64_t                 n    = op_checks::moe_sinkhorn_topk(logits, first, r, top_idx, probs);
        const int64_t                 N    = logits.size(0);
        const kernels::MoeRoutingArgs args = routing_args(r, "moe_sinkhorn_topk");
        CudaStream &                  cs   = start(s, "moe_sinkhorn_topk", {logits, top_idx, probs});
        cudaStream_t                  stream  = cs.launch("moe_sinkhorn_topk");
        Tensor                        scratch = scratch_of(cs, kernels::moe_sinkhorn_scratch(N, r.experts), DType::i64);
        with_logits(logits, [&](const auto * l) {
            kernels::moe_sinkhorn_topk(stream, l, N, first, n, args, static_cast<double *>(scratch.data_ptr()),
                                       top_idx.data<int32_t>(), f32(probs));
        });
        cs.launched("moe_sinkhorn_topk", {logits, top_idx, probs, scratch});
    }

    void moe_aux_counts(Stream & s, const Tensor & logits, const MoeRouting & r, int64_t groups,
                        const Tensor & counts) override {
        const int64_t                 n    = op_checks::moe_aux_counts(logits, r, groups, counts);
        const kernels::MoeRoutingArgs args = routing_args(r, "moe_aux_counts");
        CudaStream &                  cs   = start(s, "moe_aux_counts", {logits, counts});
        cudaStream_t                  stream = cs.launch("moe_aux_counts");
        with_logits(logits, [&](const auto * l) { kernels::moe_aux_counts(stream, l, n, args, groups, counts.data<float>()); });
        cs.launched("moe_aux_counts", {logits, counts});
    }

    void moe_router_losses(Stream & s, const Tensor & logits, const Tensor & counts, const MoeRouting & r,
                           const MoeRouterLoss & loss, const Tensor & losses) override {
        const int64_t                 n    = op_checks::moe_router_losses(logits, counts, r, loss, losses);
        const kernels::MoeRoutingArgs args = routing_args(r, "moe_router_losses");
        CudaStream &                  cs   = start(s, "moe_router_losses", {logits, counts, losses});
        cudaStream_t                  stream = cs.launch("moe_router_losses");
        Tensor scratch = scratch_of(cs, kernels::moe_router_losses_scratch(n, loss.groups, r.experts), DType::i64);
        with_logits(logits, [&](const auto * l) {
            kernels::moe_router_losses(stream, l, n, counts.data<float>(), args, loss_args(loss),
                                       static_cast<double *>(scratch.data_ptr()), f32(losses));
        });
        cs.launched("moe_router_losses", {logits, counts, losses, scratch});
    }

    void moe_router_backward(Stream & s, const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs,
                             const Tensor & counts, const MoeRouting & r, const MoeRouterLoss & loss, float loss_scale,
                             const Tensor & dlogits) override {
        const int64_t n = op_checks::moe_router_backward(logits, top_idx, dprobs, counts, r, loss, dlogits);
        const kernels::MoeRoutingArgs args = routing_args(r, "moe_router_backward");
        const std::vector<Tensor>     held{logits, top_idx, dprobs, counts, dlogits};
        CudaStream &                  cs = start(s, "moe_router_backward", held);
        cudaStream_t                  stream = cs.launch("moe_router_backward");
        with_logits(logits, [&](const auto * l) {
            using T = std::remove_cvref_t<decltype(*l)>;
            kernels::moe_router_backward(stream, l, n, top_idx.data<int32_t>(), f32(dprobs), counts.data<float>(), args,
                                         loss_args(loss), loss_scale, static_cast<T *>(dlogits.data_ptr()));
        });
        cs.launched("moe_router_backward", held);
    }

    void moe_plan(Stream & s, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec,
                  const Tensor & plan_probs, const Tensor & row_of, const Tensor & token_of_row,
                  const Tensor & tokens_per_expert) override {
        int64_t n, k;
        std::tie(n, k) = op_checks::moe_plan(expert_of, probs, spec, plan_probs, row_of, token_of_row, tokens_per_expert);
        std::vector<Tensor> held{expert_of, probs, plan_probs, row_of, token_of_row, tokens_per_expert};
        CudaStream &        cs      = start(s, "moe_plan", held);
        cudaStream_t        stream  = cs.launch("moe_plan");
        Tensor              scratch = scratch_of(cs, kernels::moe_plan_scratch(n * k, spec.experts), DType::i32);
        kernels::moe_plan(stream, expert_of.data<int32_t>(), f32(probs), n, k,
                          {spec.first, spec.experts, spec.capacity, spec.padded, spec.drop_by_probs}, f32(plan_probs),
                          row_of.data<int32_t>(), token_of_row.data<int32_t>(), token_of_row.numel(),
                          tokens_per_expert.data<int64_t>(), scratch.data<int32_t>());
        held.push_back(scratch);
        cs.launched("moe_plan", held);
    }

    void moe_plan_experts(Stream & s, const Tensor & row_of, const Tensor & tokens_per_expert,
                          const Tensor & expert_of) override {
        op_checks::moe_plan_experts(row_of, tokens_per_expert, expert_of);
        CudaStream & cs = start(s, "moe_plan_experts", {row_of, tokens_per_expert, expert_of});
        kernels::moe_plan_experts(cs.launch("moe_plan_experts"), row_of.data<int32_t>(), row_of.numel(),
                                  tokens_per_expert.data<int64_t>(), tokens_per_expert.numel(), expert_of.data<int32_t>());
        cs.launched("moe_plan_experts", {row_of, tokens_per_expert, expert_of});
    }

    void moe_gather_rows(Stream & s, const Tensor & x, const Tensor & index, const Tensor & out) override {
        int64_t rows, h;
        std::tie(rows, h) = op_checks::moe_gather_rows(x, index, out);
        CudaStream & cs   = start(s, "moe_gather_rows", {x, index, out});
        kernels::moe_gather_rows(cs.launch("moe_gather_rows"), f32(x), x.size(0), index.data<int32_t>(), rows, h, f32(out));
        cs.launched("moe_gather_rows", {x, index, out});
    }

    void moe_combine(Stream & s, const Tensor & src, const Tensor & row_of, const Tensor & weights,
                     const Tensor & dst) override {
        const op_checks::MoeCombineDims d  = op_checks::moe_combine(src, row_of, weights, dst);
        CudaStream &                    cs = start(s, "moe_combine", {src, row_of, weights, dst});
        kernels::moe_combine(cs.launch("moe_combine"), f32(src), row_of.data<int32_t>(), f32_or_null(weights), d.n, d.k,
                             d.h, f32(dst));
        cs.launched("moe_combine", {src, row_of, weights, dst});
    }

    void moe_combine_backward(Stream & s, const Tensor & dy, const Tensor & src, const Tensor & weights,
                              const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc,
                              const Tensor & dweights) override {
        const op_checks::MoeCombineDims d =
            op_checks::moe_combine_backward(dy, src, weights, row_of, token_of_row, dsrc, dweights);
        const std::vector<Tensor> held{dy, src, weights, row_of, token_of_row, dsrc, dweights};
        CudaStream &              cs = start(s, "moe_combine_backward", held);
        kernels::moe_combine_backward(cs.launch("moe_combine_backward"), f32(dy), f32(src), d.rows, f32(weights),
                                      row_of.data<int32_t>(), token_of_row.data<int32_t>(), d.n, d.k, d.h, f32(dsrc),
                                      f32(dweights));
        cs.launched("moe_combine_backward", held);
    }

    void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v,
               const Tensor & out, const AdamStep & a) override {
        const int64_t             n = op_checks::adamw(master, grad, m, v, out, a);
        const kernels::AdamCoeffs c = adam_coeffs(a);
        std::vector<Tensor>       held{master, grad, m, v, out};
        CudaStream &              cs = start(s, "adamw", held);
        kernels::adamw(cs.launch("adamw"), f32(master), f32(grad), f32(m), f32(v), out.defined() ? out.data_ptr() : nullptr,
                       adam_out(out), n, c);
        cs.launched("adamw", std::move(held));
    }

    // kernels::kAdamMultiTensors entries per launch: GPT-2's 148 tensors in 7 launches, not 148.
    void adamw_multi(Stream & s, std::span<const AdamwTensors> entries) override { adamw_launches(s, entries, Tensor()); }

    void adamw_multi_gated(Stream & s, std::span<const AdamwTensors> entries, const Tensor & gate) override {
        expect(gate, DType::f32, 2, "adamw_multi_gated", "gate");
        adamw_launches(s, entries, gate);
    }

    void grad_norm_gate(Stream & s, const Tensor & pairs, const GradNormGate & g, const Tensor & gate,
                        const Tensor & norm) override {
        op_checks::grad_norm_gate(pairs, g, gate, norm);
        CudaStream & cs = start(s, "grad_norm_gate", {pairs, gate, norm});
        kernels::grad_norm_gate(cs.launch("grad_norm_gate"), f32(pairs), g, f32(gate), static_cast<double *>(norm.data_ptr()));
        cs.launched("grad_norm_gate", {pairs, gate, norm});
    }

private:
    // adamw_multi's launches, each reading `gate` when it is defined.
    void adamw_launches(Stream & s, std::span<const AdamwTensors> entries, const Tensor & gate) {
        for (size_t first = 0; first < entries.size(); first += kernels::kAdamMultiTensors) {
            const size_t        count = std::min<size_t>(kernels::kAdamMultiTensors, entries.size() - first);
            kernels::AdamMulti  args;
            std::vector<Tensor> held;
            args.begin[0] = 0;
            for (size_t t = 0; t < count; ++t) {
                const AdamwTensors & e = entries[first + t];
                const int64_t        n = op_checks::adamw(e.master, e.grad, e.m, e.v, e.out, e.step);
                args.entries[t] = kernels::AdamMultiEntry{f32(e.master), f32(e.grad), f32(e.m), f32(e.v),
                                                          e.out.defined() ? e.out.data_ptr() : nullptr, adam_out(e.out),
                                                          adam_coeffs(e.step)};
                args.begin[t + 1] = args.begin[t] + n;
                held.insert(held.end(), {e.master, e.grad, e.m, e.v, e.out});
            }
            args.count      = static_cast<int>(count);
            if (gate.defined()) {
                args.gate = f32(gate);
                held.push_back(gate);
            }
            CudaStream & cs = start(s, "adamw_multi", held);
            kernels::adamw_multi(cs.launch("adamw_multi"), args);
            cs.launched("adamw_multi", std::move(held));
        }
    }

    // The CUDA stream of `s`, after checking that every tensor lives on its device.
    static CudaStream & start(Stream & s, const char * op, const std::vector<Tensor> & tensors, bool copy_only = false) {
        CudaStream & cs = as_cuda_stream(s, op);
        expect_on(cs, tensors, op, copy_only);
        return cs;
    }

    // An op whose kernels index by ids (tokens, labels) that must lie in [0, limit): the first id out of range
    // is found on the device before `run_kernels(stream)` runs, and the host names it once the stream got there
    // (op_checks::id_in_range's message, as the CPU gives it).
    template <class Kernels>
    static void launch_with_id_check(Stream & s, const char * op, std::vector<Tensor> held, const Tensor & ids,
                                     int64_t limit, const char * what, Kernels && run_kernels) {
        CudaStream &     cs     = start(s, op, held);
        cudaStream_t     stream = cs.launch(op);
        const BadIdCheck bad(cs, stream);
        kernels::find_bad_id(stream, ids.data<int32_t>(), ids.numel(), limit, bad.word());
        run_kernels(stream);
        bad.report(cs, stream, limit, op, what, held);
        cs.launched(op, std::move(held));
    }

};

}  // namespace

Ops & cuda_ops() {
    static CudaOps instance;
    return instance;
}

}  // namespace loom::LOOM_CUDA_NS
