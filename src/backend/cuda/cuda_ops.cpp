#include "backend/cuda/cuda_ops.h"

#include "backend/cuda/cuda_check.h"
#include "backend/cuda/cuda_stream.h"
#include "backend/cuda/gemm.h"
#include "backend/cuda/kernels.h"
#include "core/error.h"
#include "core/op_checks.h"

#include <cmath>
#include <tuple>
#include <utility>

namespace loom::cuda {

namespace {

using op_checks::expect;
using op_checks::rows_cols;

float *    f32(const Tensor & t) { return t.data<float>(); }
float *    f32_or_null(const Tensor & t) { return t.defined() ? t.data<float>() : nullptr; }
uint16_t * bits16(const Tensor & t) { return static_cast<uint16_t *>(t.data_ptr()); }

// The ops of core/ops.h not written for CUDA yet: each throws naming itself.
[[noreturn]] void not_implemented(const char * op) {
    LOOM_THROW(op << " is not implemented on CUDA yet",
               "run this model on the CPU backend, or implement " << op
                                                                  << " in src/backend/cuda (its CPU twin is in src/backend/cpu)");
}



// Every tensor a kernel touches lives on the stream's CUDA device (device or pinned host memory).
void expect_on(const CudaStream & s, const std::vector<Tensor> & tensors, const char * op) {
    for (const Tensor & t : tensors) {
        if (!t.defined()) continue;
        LOOM_CHECK(t.device().type() == DeviceType::cuda && t.device().index() == s.device_index(),
                   op << ": " << t.describe() << " is not on cuda:" << s.device_index(),
                   "copy host tensors to the device first (a pinned_host tensor of the CUDA device and ops().copy)");
    }
}

kernels::Float float_kind(DType dtype) {
    return dtype == DType::f32 ? kernels::Float::f32 : dtype == DType::bf16 ? kernels::Float::bf16 : kernels::Float::f16;
}

class CudaOps final : public Ops {
public:
    void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
              bool accumulate) override {
        const op_checks::GemmDims dims = op_checks::gemm(a, trans_a, b, trans_b, c);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;   // plain variables: clang 14 captures no structured bindings
        CudaStream & cs     = start(s, "gemm", {a, b, c});
        cudaStream_t stream = cs.launch("gemm");   // refuses a capture before the workspace is allocated
        gemm_lt(cs.device_index(), stream, cs.gemm_workspace(), CudaStream::kGemmWorkspaceBytes, trans_a, trans_b, m,
                n, k, a.data_ptr(), b.data_ptr(), a.dtype() == DType::bf16, f32(c), accumulate);
        cs.launched("gemm", {a, b, c});
    }

    void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma,
                           const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd,
                           float eps) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(x, "layernorm_forward");
        op_checks::norm(x, residual, gamma, y, rstd, n, h, "layernorm_forward");
        expect(mean, DType::f32, n, "layernorm_forward", "mean");
        if (beta.defined()) expect(beta, DType::f32, h, "layernorm_forward", "beta");
        std::vector<Tensor> held{x, residual, gamma, beta, y, mean, rstd};
        CudaStream &        cs = start(s, "layernorm_forward", held);
        kernels::layernorm_forward(cs.launch("layernorm_forward"), f32(x), f32_or_null(residual), f32(gamma),
                                   f32_or_null(beta), f32(y), f32(mean), f32(rstd), n, h, eps);
        cs.launched("layernorm_forward", std::move(held));
    }

    void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y,
                         const Tensor & rstd, float eps) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(x, "rmsnorm_forward");
        op_checks::norm(x, residual, gamma, y, rstd, n, h, "rmsnorm_forward");
        std::vector<Tensor> held{x, residual, gamma, y, rstd};
        CudaStream &        cs = start(s, "rmsnorm_forward", held);
        kernels::rmsnorm_forward(cs.launch("rmsnorm_forward"), f32(x), f32_or_null(residual), f32(gamma), f32(y),
                                 f32(rstd), n, h, eps);
        cs.launched("rmsnorm_forward", std::move(held));
    }

    void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & mean,
                            const Tensor & rstd, const Tensor & dx, const Tensor & dgamma,
                            const Tensor & dbeta) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(dy, "layernorm_backward");
        for (const Tensor * t : {&dy, &x, &dx}) expect(*t, DType::f32, n * h, "layernorm_backward", "dy/x/dx");
        for (const Tensor * t : {&gamma, &dgamma}) expect(*t, DType::f32, h, "layernorm_backward", "gamma/dgamma");
        if (dbeta.defined()) expect(dbeta, DType::f32, h, "layernorm_backward", "dbeta");
        for (const Tensor * t : {&mean, &rstd}) expect(*t, DType::f32, n, "layernorm_backward", "statistics");
        std::vector<Tensor> held{dy, x, gamma, mean, rstd, dx, dgamma, dbeta};
        CudaStream &        cs = start(s, "layernorm_backward", held);
        kernels::layernorm_backward(cs.launch("layernorm_backward"), f32(dy), f32(x), f32(gamma), f32(mean), f32(rstd),
                                    f32(dx), f32(dgamma), f32_or_null(dbeta), n, h);
        cs.launched("layernorm_backward", std::move(held));
    }

    void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & rstd,
                          const Tensor & dx, const Tensor & dgamma) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(dy, "rmsnorm_backward");
        for (const Tensor * t : {&dy, &x, &dx}) expect(*t, DType::f32, n * h, "rmsnorm_backward", "dy/x/dx");
        for (const Tensor * t : {&gamma, &dgamma}) expect(*t, DType::f32, h, "rmsnorm_backward", "gamma/dgamma");
        expect(rstd, DType::f32, n, "rmsnorm_backward", "rstd");
        std::vector<Tensor> held{dy, x, gamma, rstd, dx, dgamma};
        CudaStream &        cs = start(s, "rmsnorm_backward", held);
        kernels::rmsnorm_backward(cs.launch("rmsnorm_backward"), f32(dy), f32(x), f32(gamma), f32(rstd), f32(dx),
                                  f32(dgamma), n, h);
        cs.launched("rmsnorm_backward", std::move(held));
    }

    void bias_add(Stream & s, const Tensor & y, const Tensor & bias) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(y, "bias_add");
        expect(y, DType::f32, -1, "bias_add", "y");
        expect(bias, DType::f32, h, "bias_add", "bias");
        CudaStream & cs = start(s, "bias_add", {y, bias});
        kernels::bias_add(cs.launch("bias_add"), f32(y), f32(bias), n, h);
        cs.launched("bias_add", {y, bias});
    }

    void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) override {
        int64_t n, h;
        std::tie(n, h) = rows_cols(dy, "bias_backward");
        expect(dy, DType::f32, -1, "bias_backward", "dy");
        expect(dbias, DType::f32, h, "bias_backward", "dbias");
        CudaStream & cs = start(s, "bias_backward", {dy, dbias});
        kernels::bias_backward(cs.launch("bias_backward"), f32(dy), f32(dbias), n, h);
        cs.launched("bias_backward", {dy, dbias});
    }

    void add_inplace(Stream & s, const Tensor & y, const Tensor & x) override {
        expect(y, DType::f32, -1, "add_inplace", "y");
        expect(x, DType::f32, y.numel(), "add_inplace", "x");
        CudaStream & cs = start(s, "add_inplace", {y, x});
        kernels::add_inplace(cs.launch("add_inplace"), f32(y), f32(x), y.numel());
        cs.launched("add_inplace", {y, x});
    }

    void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y,
                           const Tensor & x_bf16) override {
        int64_t n, f;
        std::tie(n, f) = rows_cols(x, "bias_gelu_forward");
        expect(x, DType::f32, -1, "bias_gelu_forward", "x");
        expect(y, DType::f32, n * f, "bias_gelu_forward", "y");
        if (bias.defined()) expect(bias, DType::f32, f, "bias_gelu_forward", "bias");
        if (x_bf16.defined()) expect(x_bf16, DType::bf16, n * f, "bias_gelu_forward", "x_bf16");
        std::vector<Tensor> held{x, bias, y, x_bf16};
        CudaStream &        cs = start(s, "bias_gelu_forward", held);
        kernels::bias_gelu_forward(cs.launch("bias_gelu_forward"), f32(x), f32_or_null(bias), f32(y),
                                   x_bf16.defined() ? bits16(x_bf16) : nullptr, n, f);
        cs.launched("bias_gelu_forward", std::move(held));
    }

    void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        expect(x, DType::f32, -1, "gelu_backward", "x");
        expect(dy, DType::f32, x.numel(), "gelu_backward", "dy");
        expect(dx, DType::f32, x.numel(), "gelu_backward", "dx");
        CudaStream & cs = start(s, "gelu_backward", {x, dy, dx});
        kernels::gelu_backward(cs.launch("gelu_backward"), f32(x), f32(dy), f32(dx), x.numel());
        cs.launched("gelu_backward", {x, dy, dx});
    }

    void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) override {
        int64_t n, two_f;
        std::tie(n, two_f) = rows_cols(x, "swiglu_forward");
        expect(x, DType::f32, -1, "swiglu_forward", "x");
        LOOM_CHECK(two_f % 2 == 0, "swiglu_forward: x " << x.describe() << " has an odd width", "x is [gate | up]");
        expect(y, DType::f32, n * (two_f / 2), "swiglu_forward", "y");
        CudaStream & cs = start(s, "swiglu_forward", {x, y});
        kernels::swiglu_forward(cs.launch("swiglu_forward"), f32(x), f32(y), n, two_f / 2);
        cs.launched("swiglu_forward", {x, y});
    }

    void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        int64_t n, two_f;
        std::tie(n, two_f) = rows_cols(x, "swiglu_backward");
        expect(x, DType::f32, -1, "swiglu_backward", "x");
        LOOM_CHECK(two_f % 2 == 0, "swiglu_backward: x " << x.describe() << " has an odd width", "x is [gate | up]");
        expect(dy, DType::f32, n * (two_f / 2), "swiglu_backward", "dy");
        expect(dx, DType::f32, n * two_f, "swiglu_backward", "dx");
        CudaStream & cs = start(s, "swiglu_backward", {x, dy, dx});
        kernels::swiglu_backward(cs.launch("swiglu_backward"), f32(x), f32(dy), f32(dx), n, two_f / 2);
        cs.launched("swiglu_backward", {x, dy, dx});
    }

    void rope(Stream &, const Tensor &, int64_t, int64_t, int64_t, int64_t, float, bool) override {
        not_implemented("rope");
    }
    void dropout(Stream &, const Tensor &, const Tensor &, const Dropout &) override { not_implemented("dropout"); }
    void embedding_forward(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &) override {
        not_implemented("embedding_forward");
    }
    void embedding_backward(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &) override {
        not_implemented("embedding_backward");
    }
    void vocab_shard_ids(Stream &, const Tensor &, int64_t, int64_t, const Tensor &) override {
        not_implemented("vocab_shard_ids");
    }
    void attention_forward(Stream &, const Tensor &, const Tensor &, const Tensor &, const AttentionShape &, float,
                           const Dropout &) override {
        not_implemented("attention_forward");
    }
    void attention_backward(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                            const AttentionShape &, float, const Dropout &) override {
        not_implemented("attention_backward");
    }
    void cross_entropy_forward(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                               int64_t) override {
        not_implemented("cross_entropy_forward");
    }
    void cross_entropy_backward(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &,
                                int64_t) override {
        not_implemented("cross_entropy_backward");
    }
    void row_max(Stream &, const Tensor &, int64_t, const Tensor &) override { not_implemented("row_max"); }
    void row_sum_exp(Stream &, const Tensor &, const Tensor &, int64_t, const Tensor &) override {
        not_implemented("row_sum_exp");
    }
    void label_logit(Stream &, const Tensor &, const Tensor &, const Tensor &) override { not_implemented("label_logit"); }
    void lse_and_loss(Stream &, const Tensor &, const Tensor &, const Tensor &, const Tensor &, const Tensor &) override {
        not_implemented("lse_and_loss");
    }
    void loss_grad(Stream &, const Tensor &, double, const Tensor &) override { not_implemented("loss_grad"); }

    void convert(Stream & s, const Tensor & src, const Tensor & dst) override {
        LOOM_CHECK(dtype_is_floating(src.dtype()) && dtype_is_floating(dst.dtype()) && src.numel() == dst.numel(),
                   "convert " << src.describe() << " to " << dst.describe(), "");
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
        expect(x, DType::f32, -1, "round_to_bf16", "x");
        expect(x_bf16, DType::bf16, x.numel(), "round_to_bf16", "x_bf16");
        CudaStream & cs = start(s, "round_to_bf16", {x, x_bf16});
        kernels::round_to_bf16(cs.launch("round_to_bf16"), f32(x), bits16(x_bf16), x.numel());
        cs.launched("round_to_bf16", {x, x_bf16});
    }

    void copy(Stream & s, const Tensor & src, const Tensor & dst) override {
        LOOM_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
                   "copy " << src.describe() << " to " << dst.describe(), "copies keep the dtype and element count");
        CudaStream & cs     = start(s, "copy", {src, dst});
        cudaStream_t stream = cs.launch("copy");
        if (src.nbytes() > 0) {
            LOOM_CUDA_CHECK(cudaMemcpyAsync(dst.data_ptr(), src.data_ptr(), src.nbytes(), cudaMemcpyDefault, stream));
        }
        cs.launched("copy", {src, dst});
    }

    void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col,
                      int64_t width) override {
        LOOM_CHECK(src.dim() == 2 && dst.dim() == 2 && src.dtype() == dst.dtype() && src.size(0) == dst.size(0),
                   "copy_columns from " << src.describe() << " to " << dst.describe(), "2-D tensors of one dtype and row count");
        LOOM_CHECK(width >= 0 && src_col >= 0 && dst_col >= 0 && src_col + width <= src.size(1) &&
                       dst_col + width <= dst.size(1),
                   "copy_columns of " << width << " columns from column " << src_col << " of " << src.describe()
                                      << " to column " << dst_col << " of " << dst.describe(), "");
        CudaStream & cs     = start(s, "copy_columns", {src, dst});
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
        expect(t, DType::f32, -1, "scale", "t");
        CudaStream & cs = start(s, "scale", {t});
        kernels::scale(cs.launch("scale"), f32(t), factor, t.numel());
        cs.launched("scale", {t});
    }

    void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) override {
        expect(x, DType::f32, -1, "sum_of_squares", "x");
        expect(out, DType::f32, 2, "sum_of_squares", "out");
        CudaStream &  cs     = start(s, "sum_of_squares", {x, out});
        cudaStream_t  stream = cs.launch("sum_of_squares");
        const int64_t chunks = kernels::sum_of_squares_chunks(x.numel());
        // Scratch for the per-chunk partial sums, freed in stream order with the op's tensors.
        Tensor partial = Tensor::empty({std::max<int64_t>(chunks, 1)}, DType::i64, cs.device(),
                                       TensorOptions{MemoryKind::device, kActivationsPool});
        kernels::sum_of_squares(stream, f32(x), x.numel(), static_cast<double *>(partial.data_ptr()), f32(out));
        cs.launched("sum_of_squares", {x, out, partial});
    }

    void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v,
               const Tensor & out, const AdamStep & a) override {
        expect(master, DType::f32, -1, "adamw", "master");
        const int64_t n = master.numel();
        expect(grad, DType::f32, n, "adamw", "grad");
        expect(m, DType::f32, n, "adamw", "m");
        expect(v, DType::f32, n, "adamw", "v");
        if (out.defined()) {
            LOOM_CHECK(out.numel() == n && (out.dtype() == DType::bf16 || out.dtype() == DType::f32),
                       "adamw: out is " << out.describe() << " for " << n << " elements", "out is bf16 or f32");
        }
        LOOM_CHECK(a.step >= 1, "adamw: step " << a.step, "the first step is 1");
        // The scalars exactly as core/host_adam.cpp computes them (on the host, in f32).
        kernels::AdamCoeffs c;
        c.beta1           = a.beta1;
        c.beta2           = a.beta2;
        c.one_minus_beta1 = 1.0f - a.beta1;
        c.one_minus_beta2 = 1.0f - a.beta2;
        c.step_size       = a.lr / (1.0f - std::pow(a.beta1, static_cast<float>(a.step)));
        c.bc2_sqrt        = std::sqrt(1.0f - std::pow(a.beta2, static_cast<float>(a.step)));
        c.eps             = a.eps;
        c.decay           = 1.0f - a.lr * a.weight_decay;
        const kernels::AdamOut kind = !out.defined()              ? kernels::AdamOut::none
                                      : out.dtype() == DType::bf16 ? kernels::AdamOut::bf16
                                                                   : kernels::AdamOut::f32;
        std::vector<Tensor> held{master, grad, m, v, out};
        CudaStream &        cs = start(s, "adamw", held);
        kernels::adamw(cs.launch("adamw"), f32(master), f32(grad), f32(m), f32(v), out.defined() ? out.data_ptr() : nullptr,
                       kind, n, c);
        cs.launched("adamw", std::move(held));
    }

private:
    // The CUDA stream of `s`, after checking that every tensor lives on its device.
    static CudaStream & start(Stream & s, const char * op, const std::vector<Tensor> & tensors) {
        CudaStream & cs = as_cuda_stream(s, op);
        expect_on(cs, tensors, op);
        return cs;
    }

};

}  // namespace

Ops & cuda_ops() {
    static CudaOps instance;
    return instance;
}

}  // namespace loom::cuda
