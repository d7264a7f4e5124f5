#include "backend/cpu/cpu_ops.h"

#include "backend/cpu/attention.h"
#include "backend/cpu/gemm.h"
#include "backend/cpu/moe.h"
#include "backend/cpu/ops.h"
#include "core/dropout.h"
#include "core/error.h"
#include "core/op_checks.h"
#include "core/host_adam.h"
#include "core/thread_pool.h"

#include <cmath>
#include <cstring>
#include <tuple>
#include <type_traits>
#include <utility>

namespace loom::cpu {

namespace {

using op_checks::expect;
using op_checks::rows_cols;
using op_checks::act;
using op_checks::act_or_null;
using op_checks::with_activations;
using op_checks::with_logits;

float * f32(const Tensor & t) { return t.data<float>(); }
float * f32_or_null(const Tensor & t) { return t.defined() ? t.data<float>() : nullptr; }

// On the stream: every id is -1 or below `limit` (a token or label past the table would read or write
// outside it). The error surfaces at the stream's next synchronize, naming the op.
void check_ids(const Tensor & ids, int64_t limit, const char * op, const char * what) {
    const int32_t * v = ids.data<int32_t>();
    for (int64_t i = 0; i < ids.numel(); ++i) {
        if (v[i] < -1 || v[i] >= limit) op_checks::id_in_range(v[i], i, limit, op, what);
    }
}

class CpuOps final : public Ops {
public:
    void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
              bool accumulate) override {
        const op_checks::GemmDims dims = op_checks::gemm(a, trans_a, b, trans_b, c, accumulate);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;   // plain variables: clang 14 captures no structured bindings
        const DType dtype = a.dtype();
        if (dtype == DType::f64) {
            s.submit([a, b, c, trans_a, trans_b, m, n, k, accumulate] {
                cpu::gemm_f64(trans_a, trans_b, m, n, k, a.data<double>(), b.data<double>(), c.data<double>(), accumulate);
            });
            return;
        }
        const DType c_dtype = c.dtype();
        s.submit([a, b, c, trans_a, trans_b, m, n, k, dtype, c_dtype, accumulate] {
            cpu::gemm(trans_a, trans_b, m, n, k, a.data_ptr(), b.data_ptr(), dtype, c.data_ptr(), c_dtype, accumulate);
        });
    }

    // gemm then bias_add, in one task: the bits of the two ops (a oneDNN bias post-op would round the
    // same sum, but only its own kernels promise that).
    void gemm_bias(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
                   const Tensor & bias) override {
        const op_checks::GemmDims dims = op_checks::gemm_bias(a, trans_a, b, trans_b, c, bias);
        const int64_t             m = dims.m, n = dims.n, k = dims.k;
        const DType dtype = a.dtype();
        s.submit([a, b, c, bias, trans_a, trans_b, m, n, k, dtype] {
            if (c.dtype() == DType::bf16) {
                // The bias joins the f32 accumulator before the one rounding to bf16 (as cuBLASLt's epilogue).
                cpu::gemm_bias_bf16(trans_a, trans_b, m, n, k, a.data_ptr(), b.data_ptr(), dtype, c.data_ptr(),
                                    bias.data<float>());
                return;
            }
            cpu::gemm(trans_a, trans_b, m, n, k, a.data_ptr(), b.data_ptr(), dtype, c.data<float>());
            cpu::bias_add(c.data<float>(), bias.data<float>(), m, n);
        });
    }

    void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma,
                           const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd,
                           float eps) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::layernorm_forward(x, residual, gamma, beta, y, mean, rstd);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                if (residual.defined()) {
                    add_layernorm_forward(act<T>(x), act<T>(residual), f32(gamma), f32_or_null(beta), act<T>(y),
                                          f32(mean), f32(rstd), n, h, eps);
                } else {
                    cpu::layernorm_forward(act<T>(x), f32(gamma), f32_or_null(beta), act<T>(y), f32(mean), f32(rstd), n,
                                           h, eps);
                }
            });
        });
    }

    void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y,
                         const Tensor & rstd, float eps) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::rmsnorm_forward(x, residual, gamma, y, rstd);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                if (residual.defined()) {
                    add_rmsnorm_forward(act<T>(x), act<T>(residual), f32(gamma), act<T>(y), f32(rstd), n, h, eps);
                } else {
                    cpu::rmsnorm_forward(act<T>(x), f32(gamma), act<T>(y), f32(rstd), n, h, eps);
                }
            });
        });
    }

    void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & mean,
                            const Tensor & rstd, const Tensor & dx, const Tensor & dgamma, const Tensor & dbeta,
                            const Tensor & dresidual) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::layernorm_backward(dy, x, gamma, mean, rstd, dx, dgamma, dbeta, dresidual);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::layernorm_backward(act<T>(dy), act<T>(x), f32(gamma), f32(mean), f32(rstd), act<T>(dx), f32(dgamma),
                                        f32_or_null(dbeta), n, h, act_or_null<T>(dresidual));
            });
        });
    }

    void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma, const Tensor & rstd,
                          const Tensor & dx, const Tensor & dgamma, const Tensor & dresidual) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::rmsnorm_backward(dy, x, gamma, rstd, dx, dgamma, dresidual);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::rmsnorm_backward(act<T>(dy), act<T>(x), f32(gamma), f32(rstd), act<T>(dx), f32(dgamma), n, h,
                                      act_or_null<T>(dresidual));
            });
        });
    }

    void bias_add(Stream & s, const Tensor & y, const Tensor & bias) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::bias_add(y, bias);
        if (y.dtype() == DType::f64) {
            s.submit([=] { cpu::bias_add_f64(y.data<double>(), bias.data<double>(), n, h); });
            return;
        }
        s.submit([=] { with_activations(y, [&]<class T>(T *) { cpu::bias_add(act<T>(y), f32(bias), n, h); }); });
    }

    void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) override {
        int64_t n, h;
        std::tie(n, h) = op_checks::bias_backward(dy, dbias);
        if (dy.dtype() == DType::f64) {
            s.submit([=] { cpu::bias_backward_f64(dy.data<double>(), dbias.data<double>(), n, h); });
            return;
        }
        s.submit([=] { with_activations(dy, [&]<class T>(T *) { cpu::bias_backward(act<T>(dy), f32(dbias), n, h); }); });
    }

    void add_inplace(Stream & s, const Tensor & y, const Tensor & x) override {
        op_checks::add_inplace(y, x);
        s.submit([=] { with_activations(y, [&]<class T>(T *) { cpu::add_inplace(act<T>(y), act<T>(x), y.numel()); }); });
    }

    void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y,
                           const Tensor & x_bf16) override {
        int64_t n, f;
        std::tie(n, f) = op_checks::bias_gelu_forward(x, bias, y, x_bf16);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::bias_gelu_forward(act<T>(x), f32_or_null(bias), act<T>(y),
                                       x_bf16.defined() ? static_cast<uint16_t *>(x_bf16.data_ptr()) : nullptr, n, f);
            });
        });
    }

    void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        op_checks::gelu_backward(x, dy, dx);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) { cpu::gelu_backward(act<T>(x), act<T>(dy), act<T>(dx), x.numel()); });
        });
    }

    void squared_relu_forward(Stream & s, const Tensor & x, const Tensor & y) override {
        op_checks::squared_relu_forward(x, y);
        s.submit([=] { with_activations(x, [&]<class T>(T *) { cpu::squared_relu_forward(act<T>(x), act<T>(y), x.numel()); }); });
    }

    void squared_relu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        op_checks::squared_relu_backward(x, dy, dx);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::squared_relu_backward(act<T>(x), act<T>(dy), act<T>(dx), x.numel());
            });
        });
    }

    void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_forward(x, y);
        s.submit([=] { with_activations(x, [&]<class T>(T *) { cpu::swiglu_forward(act<T>(x), act<T>(y), n, two_f / 2); }); });
    }

    void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_backward(x, dy, dx);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) { cpu::swiglu_backward(act<T>(x), act<T>(dy), act<T>(dx), n, two_f / 2); });
        });
    }
    void glu_forward(Stream & s, const Tensor & x, const Tensor & y, const GluSpec & glu) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_forward(x, y);
        s.submit([=] { with_activations(x, [&]<class T>(T *) { cpu::glu_forward(act<T>(x), act<T>(y), n, two_f / 2, glu); }); });
    }

    void glu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx, const GluSpec & glu) override {
        int64_t n, two_f;
        std::tie(n, two_f) = op_checks::swiglu_backward(x, dy, dx);
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) { cpu::glu_backward(act<T>(x), act<T>(dy), act<T>(dx), n, two_f / 2, glu); });
        });
    }


    void rope(Stream & s, const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d, float base,
              bool inverse, int64_t rotary_dim, bool interleaved, const SeqPositions & positions,
              const RopeScaling & scaling) override {
        const int64_t stride = op_checks::rope(x, seq, batch, heads, d, rotary_dim).second;
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                rope_apply(act<T>(x), stride, seq, batch, heads, d, base, inverse, rotary_dim, interleaved, positions,
                           scaling);
            });
        });
    }

    void embedding_forward(Stream & s, const Tensor & tokens, const Tensor & wte, const Tensor & wpe,
                           const Tensor & out, const SeqPositions & positions) override {
        const op_checks::EmbeddingDims dims = op_checks::embedding_forward(tokens, wte, wpe, out, positions);
        const int64_t                  b = dims.b, seq = dims.s, h = dims.h;
        s.submit([=] {
            check_ids(tokens, wte.size(0), "embedding_forward", "token");
            const int32_t * ids = tokens.data<int32_t>();
            with_activations(out, [&]<class T>(T *) {
                if (wte.dtype() == DType::f32) {
                    cpu::embedding_forward(ids, f32(wte), f32_or_null(wpe), act<T>(out), seq, b, h, positions);
                } else {
                    cpu::embedding_forward(ids, static_cast<const uint16_t *>(wte.data_ptr()),
                                           wpe.defined() ? static_cast<const uint16_t *>(wpe.data_ptr()) : nullptr,
                                           act<T>(out), seq, b, h, positions);
                }
            });
        });
    }

    void embedding_backward(Stream & s, const Tensor & tokens, const Tensor & dout, const Tensor & dwte,
                            const Tensor & dwpe, const SeqPositions & positions) override {
        const op_checks::EmbeddingDims dims = op_checks::embedding_backward(tokens, dout, dwte, dwpe, positions);
        const int64_t                  b = dims.b, seq = dims.s, h = dims.h;
        const int64_t vocab = dwte.size(0);
        s.submit([=] {
            check_ids(tokens, vocab, "embedding_backward", "token");
            with_activations(dout, [&]<class T>(T *) {
                cpu::embedding_backward(tokens.data<int32_t>(), act<T>(dout), f32(dwte), f32_or_null(dwpe), seq, b, h,
                                        vocab, positions);
            });
        });
    }

    void vocab_shard_ids(Stream & s, const Tensor & ids, int64_t begin, int64_t count, const Tensor & out) override {
        op_checks::vocab_shard_ids(ids, out);
        s.submit([=] {
            const int32_t * in = ids.data<int32_t>();
            int32_t *       o  = out.data<int32_t>();
            for (int64_t i = 0; i < ids.numel(); ++i) {
                o[i] = in[i] >= begin && in[i] < begin + count ? static_cast<int32_t>(in[i] - begin) : -1;
            }
        });
    }

    void dropout(Stream & s, const Tensor & x, const Tensor & y, const Dropout & key) override {
        int64_t n, w;
        std::tie(n, w) = op_checks::dropout(x, y, key);
        s.submit([=] {
            const uint32_t  threshold  = dropout_threshold(key.p);
            const float     keep_scale = 1.0f / (1.0f - key.p);
            const int64_t * ids        = key.sample_ids.defined() ? key.sample_ids.data<int64_t>() : nullptr;
            with_activations(x, [&]<class T>(T *) {
                const T * in  = act<T>(x);
                T *       out = act<T>(y);
                parallel_for(n, 16, [&](int64_t begin, int64_t end) {
                    for (int64_t r = begin; r < end; ++r) {
                        const int64_t g = key.offset + r, position = key.positions(g / key.batch), column = g % key.batch;
                        const uint64_t base = dropout_base(key.seed, key.site, ids ? ids[column] : column);
                        const T *      xr   = in + r * w;
                        T *            yr   = out + r * w;
                        for (int64_t c = 0; c < w; ++c) {
                            yr[c] = from_f32<T>(dropout_keep_hidden(base, position, c, threshold) ? to_f32(xr[c]) * keep_scale
                                                                                                   : 0.0f);
                        }
                    }
                });
            });
        });
    }

    void attention_forward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & lse,
                           const AttentionShape & shape, float scale, const Dropout & dropout) override {
        op_checks::attention_forward(q, kv, out, lse, shape, dropout);
        s.submit([=] {
            with_activations(q, [&]<class T>(T *) {
                cpu::attention_forward(act<T>(q), act<T>(kv), act<T>(out), f32(lse), shape, scale, attention_dropout(dropout));
            });
        });
    }

    void attention_backward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & dout,
                            const Tensor & lse, const Tensor & dq, const Tensor & dkv, const AttentionShape & shape,
                            float scale, const Dropout & dropout, bool accumulate) override {
        op_checks::attention_backward(q, kv, out, dout, lse, dq, dkv, shape, dropout);
        s.submit([=] {
            with_activations(q, [&]<class T>(T *) {
                cpu::attention_backward(act<T>(q), act<T>(kv), act<T>(out), act<T>(dout), f32(lse), act<T>(dq), act<T>(dkv),
                                        shape, scale, attention_dropout(dropout), accumulate);
            });
        });
    }

    void attention_merge(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & part_out,
                         const Tensor & part_lse, const AttentionShape & shape) override {
        op_checks::attention_merge(out, lse, part_out, part_lse, shape);
        s.submit([=] { cpu::attention_merge(f32(out), f32(lse), f32(part_out), f32(part_lse), shape.s, shape.b, shape.nq, shape.d); });
    }

    void attention_sink_forward(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & sink,
                                const AttentionShape & shape) override {
        op_checks::attention_sink(out, nullptr, lse, sink, nullptr, shape, "attention_sink_forward");
        s.submit([=] {
            with_activations(out, [&]<class T>(T *) {
                cpu::attention_sink_forward(act<T>(out), f32(lse), f32(sink), shape.s, shape.b, shape.nq, shape.d);
            });
        });
    }

    void attention_sink_backward(Stream & s, const Tensor & out, const Tensor & dout, const Tensor & lse, const Tensor & sink,
                                 const Tensor & dsink, const AttentionShape & shape) override {
        op_checks::attention_sink(out, &dout, lse, sink, &dsink, shape, "attention_sink_backward");
        s.submit([=] {
            with_activations(out, [&]<class T>(T *) {
                cpu::attention_sink_backward(act<T>(out), act<T>(dout), f32(lse), f32(sink), f32(dsink), shape.s, shape.b,
                                             shape.nq, shape.d);
            });
        });
    }

    void cross_entropy_forward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & loss,
                               const Tensor & lse, int64_t vocab) override {
        const op_checks::LabelDims d = op_checks::cross_entropy_forward(logits, labels, loss, lse, vocab);
        s.submit([=] {
            check_ids(labels, vocab, "cross_entropy_forward", "label");
            with_activations(logits, [&]<class T>(T *) {
                cpu::cross_entropy_forward(act<T>(logits), labels.data<int32_t>(), f32(loss), f32(lse), d.seq, d.b, d.stride,
                                           vocab);
            });
        });
    }

    void cross_entropy_backward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & lse,
                                const Tensor & dloss, int64_t vocab) override {
        const op_checks::LabelDims d = op_checks::cross_entropy_backward(logits, labels, lse, dloss, vocab);
        s.submit([=] {
            check_ids(labels, vocab, "cross_entropy_backward", "label");
            with_activations(logits, [&]<class T>(T *) {
                cpu::cross_entropy_backward(act<T>(logits), labels.data<int32_t>(), f32(lse), f32(dloss), d.seq, d.b,
                                            d.stride, vocab);
            });
        });
    }

    void row_max(Stream & s, const Tensor & logits, int64_t valid, const Tensor & out) override {
        int64_t n, stride;
        std::tie(n, stride) = op_checks::row_max(logits, valid, out);
        s.submit([=] {
            with_activations(logits, [&]<class T>(T *) { cpu::row_max(act<T>(logits), n, stride, valid, f32(out)); });
        });
    }

    void row_sum_exp(Stream & s, const Tensor & logits, const Tensor & max, int64_t valid, const Tensor & out) override {
        int64_t n, stride;
        std::tie(n, stride) = op_checks::row_sum_exp(logits, max, valid, out);
        s.submit([=] {
            with_activations(logits, [&]<class T>(T *) {
                cpu::row_sum_exp(act<T>(logits), f32(max), n, stride, valid, f32(out));
            });
        });
    }

    void label_logit(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & out) override {
        const op_checks::LabelDims d = op_checks::label_logit(logits, labels, out);
        const int64_t n = d.n, stride = d.stride, b = d.b, seq = d.seq;
        s.submit([=] {
            check_ids(labels, stride, "label_logit", "label");
            const int32_t * l = labels.data<int32_t>();
            float *         o = f32(out);
            with_activations(logits, [&]<class T>(T *) {
                const T * x = act<T>(logits);
                for (int64_t r = 0; r < n; ++r) {
                    int32_t label = l[(r % b) * seq + r / b];
                    o[r]          = label >= 0 ? to_f32(x[r * stride + label]) : 0.0f;
                }
            });
        });
    }

    void lse_and_loss(Stream & s, const Tensor & max, const Tensor & sum, const Tensor & target, const Tensor & lse,
                      const Tensor & loss) override {
        const int64_t n = op_checks::lse_and_loss(max, sum, target, lse, loss);
        s.submit([=] {
            for (int64_t r = 0; r < n; ++r) {
                float l       = f32(max)[r] + std::log(f32(sum)[r]);
                f32(lse)[r]   = l;
                f32(loss)[r]  = l - f32(target)[r];
            }
        });
    }

    void loss_grad(Stream & s, const Tensor & mask, double scale, const Tensor & dloss) override {
        int64_t b, seq;
        std::tie(b, seq) = op_checks::loss_grad(mask, dloss);
        s.submit([=] {
            const float * m = f32(mask);
            float *       d = f32(dloss);
            for (int64_t r = 0; r < seq * b; ++r) d[r] = static_cast<float>(m[(r % b) * seq + r / b] * scale);
        });
    }

    void convert(Stream & s, const Tensor & src, const Tensor & dst) override {
        op_checks::convert(src, dst);
        s.submit([=] { convert_parallel(src.data_ptr(), src.dtype(), dst.data_ptr(), dst.dtype(), src.numel()); });
    }

    void round_to_bf16(Stream & s, const Tensor & x, const Tensor & x_bf16) override {
        op_checks::round_to_bf16(x, x_bf16);
        s.submit([=] { cpu::round_to_bf16(f32(x), static_cast<uint16_t *>(x_bf16.data_ptr()), x.numel()); });
    }

    void copy(Stream & s, const Tensor & src, const Tensor & dst) override {
        op_checks::copy(src, dst);
        s.submit([=] { std::memcpy(dst.data_ptr(), src.data_ptr(), src.nbytes()); });
    }

    void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col,
                      int64_t width) override {
        op_checks::copy_columns(src, src_col, dst, dst_col, width);
        s.submit([=] {
            const size_t elem = dtype_size(src.dtype());
            const auto * in   = static_cast<const char *>(src.data_ptr());
            auto *       out  = static_cast<char *>(dst.data_ptr());
            for (int64_t r = 0; r < src.size(0); ++r) {
                std::memcpy(out + (r * dst.size(1) + dst_col) * elem, in + (r * src.size(1) + src_col) * elem, width * elem);
            }
        });
    }

    void fill_zero(Stream & s, const Tensor & t) override {
        s.submit([t] { std::memset(t.data_ptr(), 0, t.nbytes()); });
    }

    void scale(Stream & s, const Tensor & t, float factor) override {
        op_checks::scale(t);
        s.submit([t, factor] { scale_parallel(t.data_ptr(), t.dtype(), factor, t.numel()); });
    }

    void scale_by_inverse_norm(Stream & s, const Tensor & t, const Tensor & sums, double eps) override {
        op_checks::scale_by_inverse_norm(t, sums);
        s.submit([t, sums, eps] {
            const double norm = std::sqrt(static_cast<double>(f32(sums)[0]) + static_cast<double>(f32(sums)[1]));
            scale_parallel(t.data_ptr(), t.dtype(), static_cast<float>(1.0 / std::max(norm, eps)), t.numel());
        });
    }

    void fp8_quantize(Stream & s, const Tensor & x, Fp8Format format, const Tensor & q, const Tensor & scale_inv) override {
        op_checks::fp8_quantize(x, q, scale_inv);
        s.submit([x, format, q, scale_inv] {
            const int64_t n = x.numel();
            std::vector<float> wide;
            const float * v = x.dtype() == DType::f32 ? x.data<float>() : nullptr;
            if (!v) {
                wide.resize(static_cast<size_t>(n));
                loom::convert(x.data_ptr(), x.dtype(), wide.data(), DType::f32, n);
                v = wide.data();
            }
            uint32_t amax = 0;
            for (int64_t i = 0; i < n; ++i) amax = std::max(amax, float_to_bits(v[i]) & 0x7FFFFFFFu);
            const float scale = fp8_scale_from_amax(bits_to_float(amax), format);
            uint16_t *  out   = static_cast<uint16_t *>(q.data_ptr());
            for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(fp8_round(v[i] * scale, format));
            f32(scale_inv)[0] = 1.0f / scale;
        });
    }

    void gated_delta_rule_forward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                  const Tensor & beta, const Tensor & o, const Tensor & workspace,
                                  const DeltaRuleShape & shape) override {
        op_checks::delta_rule_forward(q, k, v, g, beta, o, workspace, shape);
        s.submit([=] { cpu::gated_delta_rule_forward(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(o), f32(workspace), shape); });
    }

    void gated_delta_rule_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                   const Tensor & beta, const Tensor & dout, const Tensor & dq, const Tensor & dk,
                                   const Tensor & dv, const Tensor & dg, const Tensor & dbeta, const Tensor & workspace,
                                   const DeltaRuleShape & shape) override {
        op_checks::delta_rule_backward(q, k, v, g, beta, dout, dq, dk, dv, dg, dbeta, workspace, shape);
        s.submit([=] {
            cpu::gated_delta_rule_backward(f32(q), f32(k), f32(v), f32(g), f32(beta), f32(dout), f32(dq), f32(dk), f32(dv),
                                           f32(dg), f32(dbeta), f32(workspace), shape);
        });
    }

    void causal_conv_silu_forward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & y, int64_t seq,
                                  int64_t batch) override {
        int64_t C, K;
        std::tie(C, K) = op_checks::causal_conv(x, w, {&y}, seq, batch, "causal_conv_silu_forward");
        s.submit([=] { cpu::causal_conv_silu_forward(f32(x), f32(w), f32(y), seq, batch, C, K); });
    }

    void causal_conv_silu_backward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & dy, const Tensor & dx,
                                   const Tensor & dw, int64_t seq, int64_t batch) override {
        int64_t C, K;
        std::tie(C, K) = op_checks::causal_conv_backward(x, w, dy, dx, dw, seq, batch);
        s.submit([=] { cpu::causal_conv_silu_backward(f32(x), f32(w), f32(dy), f32(dx), f32(dw), seq, batch, C, K); });
    }

    void output_gate_forward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & y,
                             GateActivation activation) override {
        int64_t n, w, stride;
        std::tie(n, w, stride) = op_checks::output_gate(x, src, gate_col, {&y}, "output_gate_forward");
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::output_gate_forward(act<T>(x), act<T>(src) + gate_col, stride, act<T>(y), n, w, activation);
            });
        });
    }

    void output_gate_backward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & dy,
                              const Tensor & dx, const Tensor & dgate, GateActivation activation) override {
        int64_t n, w, stride;
        std::tie(n, w, stride) = op_checks::output_gate(x, src, gate_col, {&dy, &dx, &dgate}, "output_gate_backward");
        s.submit([=] {
            with_activations(x, [&]<class T>(T *) {
                cpu::output_gate_backward(act<T>(x), act<T>(src) + gate_col, stride, act<T>(dy), act<T>(dx),
                                          act<T>(dgate), n, w, activation);
            });
        });
    }

    void dsa_index_scores(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, int64_t seq, int64_t batch,
                          bool relu, const Tensor & scores, const SeqPositions & q_pos) override {
        const auto    n = op_checks::dsa_index(q, k, w, scores, seq, batch, "dsa_index_scores");
        const DsaRows rows{seq, batch, n.keys, q_pos};
        s.submit([=] { cpu::dsa_index_scores(f32(q), f32(k), f32(w), f32(scores), rows, n.H, n.d, relu); });
    }

    void dsa_index_scores_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, const Tensor & dscores,
                                   int64_t seq, int64_t batch, bool relu, const Tensor & dq, const Tensor & dk,
                                   const Tensor & dw, const SeqPositions & q_pos) override {
        const auto n = op_checks::dsa_index(q, k, w, dscores, seq, batch, "dsa_index_scores_backward");
        op_checks::dsa_index(dq, dk, dw, dscores, seq, batch, "dsa_index_scores_backward");
        const DsaRows rows{seq, batch, n.keys, q_pos};
        s.submit([=] {
            cpu::dsa_index_scores_backward(f32(q), f32(k), f32(w), f32(dscores), f32(dq), f32(dk), f32(dw), rows, n.H, n.d,
                                           relu);
        });
    }

    void dsa_topk_mask(Stream & s, const Tensor & scores, int64_t k, const Tensor & mask,
                       const SeqPositions & q_pos) override {
        const auto [seq, keys] = op_checks::dsa_topk_mask(scores, k, mask);
        const DsaRows rows{seq, scores.size(0), keys, q_pos};
        s.submit([=] { cpu::dsa_topk_mask(f32(scores), k, mask.data<uint8_t>(), rows); });
    }

    void dsa_attention_target(Stream & s, const Tensor & q_k_v, const AttentionShape & shape, float scale,
                              const Tensor & target, const Tensor & kv) override {
        op_checks::dsa_attention_target(q_k_v, kv, shape, target);
        const Tensor keys = kv.defined() ? kv : q_k_v;
        LOOM_CHECK(keys.dtype() == q_k_v.dtype(), "dsa_attention_target: kv " << keys.describe() << " and q_k_v "
                                                                              << q_k_v.describe() << " differ in dtype", "");
        s.submit([=] {
            with_activations(q_k_v, [&]<class T>(T *) {
                cpu::dsa_attention_target(static_cast<const T *>(q_k_v.data_ptr()), static_cast<const T *>(keys.data_ptr()),
                                          f32(target), shape, scale);
            });
        });
    }

    void dsa_indexer_loss(Stream & s, const Tensor & scores, const Tensor & target, float weight, const Tensor & kl,
                          const Tensor & dscores, const Tensor & mask, const SeqPositions & q_pos) override {
        const auto [seq, keys] = op_checks::dsa_indexer_loss(scores, target, kl, dscores, mask);
        const DsaRows rows{seq, scores.size(0), keys, q_pos};
        s.submit([=] {
            cpu::dsa_indexer_loss(f32(scores), f32(target), weight, f32(kl), f32(dscores), rows,
                                  mask.defined() ? mask.data<uint8_t>() : nullptr);
        });
    }

    void l2norm_forward(Stream & s, const Tensor & x, const Tensor & y, const Tensor & rstd, float eps) override {
        int64_t rows, d;
        std::tie(rows, d) = op_checks::l2norm(x, {&y}, rstd, "l2norm_forward");
        s.submit([=] { cpu::l2norm_forward(f32(x), f32(y), f32(rstd), rows, d, eps); });
    }

    void l2norm_backward(Stream & s, const Tensor & dy, const Tensor & y, const Tensor & rstd, const Tensor & dx) override {
        int64_t rows, d;
        std::tie(rows, d) = op_checks::l2norm(dy, {&y, &dx}, rstd, "l2norm_backward");
        s.submit([=] { cpu::l2norm_backward(f32(dy), f32(y), f32(rstd), f32(dx), rows, d); });
    }

    void gdn_gates_forward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                           const Tensor & g, const Tensor & beta) override {
        int64_t n, H, stride;
        std::tie(n, H, stride) = op_checks::gdn_gates(src, col, a_log, dt_bias, {&g, &beta}, "gdn_gates_forward");
        s.submit([=] {
            with_activations(src, [&]<class T>(T *) {
                cpu::gdn_gates_forward(act<T>(src) + col, stride, f32(a_log), f32(dt_bias), f32(g), f32(beta), n, H);
            });
        });
    }

    void gdn_gates_backward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                            const Tensor & dg, const Tensor & dbeta, const Tensor & dsrc, const Tensor & da_log,
                            const Tensor & ddt_bias) override {
        int64_t n, H, stride;
        std::tie(n, H, stride) = op_checks::gdn_gates_backward(src, col, a_log, dt_bias, dg, dbeta, dsrc, da_log, ddt_bias);
        s.submit([=] {
            with_activations(src, [&]<class T>(T *) {
                cpu::gdn_gates_backward(act<T>(src) + col, stride, f32(a_log), f32(dt_bias), f32(dg), f32(dbeta), act<T>(dsrc),
                                        f32(da_log), f32(ddt_bias), n, H);
            });
        });
    }

    void sigmoid_gate_forward(Stream & s, const Tensor & y, const Tensor & logits) override {
        op_checks::sigmoid_gate(y, logits, "sigmoid_gate_forward");
        s.submit([y, logits] {
            const int64_t n = y.size(0), h = y.size(1);
            parallel_for(n, 16, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    const float g = cpu::sigmoid_f32(f32(logits)[r]);
                    float *     row = f32(y) + r * h;
                    for (int64_t j = 0; j < h; ++j) row[j] *= g;
                }
            });
        });
    }

    void sigmoid_gate_backward(Stream & s, const Tensor & dy, const Tensor & m, const Tensor & logits, const Tensor & dm,
                               const Tensor & dlogits) override {
        op_checks::sigmoid_gate(dy, logits, "sigmoid_gate_backward");
        op_checks::sigmoid_gate(m, logits, "sigmoid_gate_backward");
        op_checks::sigmoid_gate(dm, dlogits, "sigmoid_gate_backward");
        s.submit([dy, m, logits, dm, dlogits] {
            const int64_t n = dy.size(0), h = dy.size(1);
            parallel_for(n, 16, [&](int64_t begin, int64_t end) {
                for (int64_t r = begin; r < end; ++r) {
                    const float   g  = cpu::sigmoid_f32(f32(logits)[r]);
                    const float * d  = f32(dy) + r * h;
                    const float * mv = f32(m) + r * h;
                    float         sum = 0.0f;
                    for (int64_t j = 0; j < h; ++j) sum += d[j] * mv[j];
                    f32(dlogits)[r] = sum * (g * (1.0f - g));
                    float * out = f32(dm) + r * h;
                    for (int64_t j = 0; j < h; ++j) out[j] = d[j] * g;
                }
            });
        });
    }

    void fp8_quantize_scaled(Stream & s, const Tensor & x, Fp8Format format, const Tensor & scale, const Tensor & q,
                             const Tensor & scale_inv) override {
        op_checks::fp8_quantize_scaled(x, scale, q, scale_inv);
        s.submit([x, format, scale, q, scale_inv] {
            const int64_t      n = x.numel();
            std::vector<float> wide(static_cast<size_t>(n));
            loom::convert(x.data_ptr(), x.dtype(), wide.data(), DType::f32, n);
            const float s_ = f32(scale)[0];
            uint16_t *  out = static_cast<uint16_t *>(q.data_ptr());
            for (int64_t i = 0; i < n; ++i) out[i] = f32_to_bf16_bits(fp8_round(wide[i] * s_, format));
            f32(scale_inv)[0] = 1.0f / s_;
        });
    }

    void fp8_delayed_update(Stream & s, const Tensor & history, const Tensor & scale, Fp8Format format, int margin,
                            bool max_algo) override {
        op_checks::fp8_delayed_update(history, scale);
        s.submit([history, scale, format, margin, max_algo] {
            const int64_t len = history.size(0), n = history.size(1);
            float *       h   = f32(history);
            for (int64_t j = 0; j < n; ++j) {
                float amax = h[j];
                if (max_algo) {
                    for (int64_t r = 1; r < len; ++r) {   // a NaN never replaces (nor is replaced): as the CUDA kernel
                        if (h[r * n + j] > amax) amax = h[r * n + j];
                    }
                }
                f32(scale)[j]   = fp8_delayed_scale(amax, f32(scale)[j], format, margin);
                const float now = h[j];
                for (int64_t r = 0; r + 1 < len; ++r) h[r * n + j] = h[(r + 1) * n + j];
                h[(len - 1) * n + j] = now;
                h[j]                 = 0.0f;
            }
        });
    }

    void fp8_quantize_blocks(Stream & s, const Tensor & x, Fp8Format format, int64_t block_rows, int64_t block_cols,
                             const Tensor & q, bool mx) override {
        op_checks::fp8_quantize_blocks(x, block_rows, block_cols, q);
        s.submit([x, format, block_rows, block_cols, q, mx] {
            const int64_t      rows = x.size(0), cols = x.size(1);
            std::vector<float> wide(static_cast<size_t>(x.numel()));
            loom::convert(x.data_ptr(), x.dtype(), wide.data(), DType::f32, x.numel());
            uint16_t * out = static_cast<uint16_t *>(q.data_ptr());
            for (int64_t r0 = 0; r0 < rows; r0 += block_rows) {
                for (int64_t c0 = 0; c0 < cols; c0 += block_cols) {
                    const int64_t r1 = std::min(rows, r0 + block_rows), c1 = std::min(cols, c0 + block_cols);
                    uint32_t      amax = 0;
                    for (int64_t r = r0; r < r1; ++r) {
                        for (int64_t c = c0; c < c1; ++c) amax = std::max(amax, float_to_bits(wide[r * cols + c]) & 0x7FFFFFFFu);
                    }
                    const float scale = mx ? mxfp8_block_scale(bits_to_float(amax), format)
                                           : fp8_scale_from_amax(bits_to_float(amax), format, /*pow2=*/true);
                    for (int64_t r = r0; r < r1; ++r) {
                        for (int64_t c = c0; c < c1; ++c) {
                            out[r * cols + c] = f32_to_bf16_bits(fp8_round(wide[r * cols + c] * scale, format) / scale);
                        }
                    }
                }
            }
        });
    }

    void fp8_amax(Stream & s, const Tensor & x, const Tensor & amax) override {
        op_checks::fp8_amax(x, amax);
        s.submit([x, amax] {
            const int64_t n    = x.numel();
            uint32_t      bits = float_to_bits(f32(amax)[0]) & 0x7FFFFFFFu;
            if (x.dtype() == DType::f32) {
                for (int64_t i = 0; i < n; ++i) bits = std::max(bits, float_to_bits(x.data<float>()[i]) & 0x7FFFFFFFu);
            } else {   // bf16: the f32 bits are its 16 bits shifted up
                const uint16_t * v = static_cast<const uint16_t *>(x.data_ptr());
                for (int64_t i = 0; i < n; ++i) bits = std::max(bits, (static_cast<uint32_t>(v[i]) << 16) & 0x7FFFFFFFu);
            }
            f32(amax)[0] = bits_to_float(bits);
        });
    }

    void fp8_encode(Stream & s, const Tensor & x, Fp8Format format, const Tensor & amax, const Tensor & codes,
                    const Tensor & scale_inv) override {
        op_checks::fp8_encode(x, amax, codes, scale_inv);
        s.submit([x, format, amax, codes, scale_inv] {
            const float   scale = fp8_scale_from_amax(f32(amax)[0], format);
            const float * v     = x.data<float>();
            uint8_t *     out   = static_cast<uint8_t *>(codes.data_ptr());
            for (int64_t i = 0; i < x.numel(); ++i) out[i] = fp8_from_f32(v[i] * scale, format);
            f32(scale_inv)[0] = 1.0f / scale;
        });
    }

    void fp8_decode(Stream & s, const Tensor & codes, Fp8Format format, const Tensor & q) override {
        op_checks::fp8_decode(codes, q);
        s.submit([codes, format, q] {
            const uint8_t * in  = static_cast<const uint8_t *>(codes.data_ptr());
            uint16_t *      out = static_cast<uint16_t *>(q.data_ptr());
            for (int64_t i = 0; i < codes.numel(); ++i) out[i] = f32_to_bf16_bits(f32_from_fp8(in[i], format));
        });
    }

    void scale_by_reciprocal(Stream & s, const Tensor & t, const Tensor & d) override {
        op_checks::scale_by_reciprocal(t, d);
        s.submit([t, d] { scale_parallel(t.data_ptr(), t.dtype(), 1.0f / f32(d)[0], t.numel()); });
    }

    void scale_by_product(Stream & s, const Tensor & t, const Tensor & a, const Tensor & b) override {
        op_checks::scale_by_product(t, a, b);
        s.submit([t, a, b] { scale_parallel(t.data_ptr(), t.dtype(), f32(a)[0] * f32(b)[0], t.numel()); });
    }

    void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) override {
        op_checks::sum_of_squares(x, out);
        s.submit([x, out] {
            const double sum = cpu::sum_of_squares(f32(x), x.numel());
            const float  hi  = static_cast<float>(sum);
            f32(out)[0]      = hi;
            f32(out)[1]      = static_cast<float>(sum - static_cast<double>(hi));
        });
    }

    // ---- Mixture of Experts (backend/cpu/moe.h)
    void moe_topk(Stream & s, const Tensor & logits, const MoeRouting & r, const Tensor & expert_bias,
                  const Tensor & top_idx, const Tensor & probs) override {
        const int64_t n = op_checks::moe_topk(logits, r, expert_bias, top_idx, probs);
        s.submit([=] {
            with_logits(logits, [&](const auto * l) {
                cpu::moe_topk(l, n, r, f32_or_null(expert_bias), top_idx.data<int32_t>(), f32(probs));
            });
        });
    }

    void moe_count_tokens(Stream & s, const Tensor & tokens_per_expert, const Tensor & load) override {
        op_checks::moe_count_tokens(tokens_per_expert, load);
        s.submit([=] { cpu::moe_count_tokens(tokens_per_expert.data<int64_t>(), load.numel(), f32(load)); });
    }

    void moe_expert_bias_update(Stream & s, const Tensor & load, const Tensor & bias, float rate) override {
        const std::pair<int64_t, int64_t> re = op_checks::moe_expert_bias_update(load, bias);
        s.submit([=] { cpu::moe_expert_bias_update(f32(load), f32(bias), re.first, re.second, rate); });
    }

    void moe_sinkhorn_topk(Stream & s, const Tensor & logits, int64_t first, const MoeRouting & r,
                           const Tensor & top_idx, const Tensor & probs) override {
        const int64_t n = op_checks::moe_sinkhorn_topk(logits, first, r, top_idx, probs);
        const int64_t N = logits.size(0);
        s.submit([=] {
            with_logits(logits, [&](const auto * l) {
                cpu::moe_sinkhorn_topk(l, N, first, n, r, top_idx.data<int32_t>(), f32(probs));
            });
        });
    }

    void moe_aux_counts(Stream & s, const Tensor & logits, const MoeRouting & r, int64_t groups,
                        const Tensor & counts) override {
        const int64_t n = op_checks::moe_aux_counts(logits, r, groups, counts);
        s.submit([=] {
            with_logits(logits, [&](const auto * l) { cpu::moe_aux_counts(l, n, r, groups, counts.data<float>()); });
        });
    }

    void moe_router_losses(Stream & s, const Tensor & logits, const Tensor & counts, const MoeRouting & r,
                           const MoeRouterLoss & loss, const Tensor & losses) override {
        const int64_t n = op_checks::moe_router_losses(logits, counts, r, loss, losses);
        s.submit([=] {
            with_logits(logits, [&](const auto * l) {
                cpu::moe_router_losses(l, n, counts.data<float>(), r, loss, f32(losses));
            });
        });
    }

    void moe_router_backward(Stream & s, const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs,
                             const Tensor & counts, const MoeRouting & r, const MoeRouterLoss & loss, float loss_scale,
                             const Tensor & dlogits) override {
        const int64_t n = op_checks::moe_router_backward(logits, top_idx, dprobs, counts, r, loss, dlogits);
        s.submit([=] {
            with_logits(logits, [&](const auto * l) {
                using T = std::remove_cvref_t<decltype(*l)>;
                cpu::moe_router_backward(l, n, top_idx.data<int32_t>(), f32(dprobs), counts.data<float>(), r, loss,
                                         loss_scale, static_cast<T *>(dlogits.data_ptr()));
            });
        });
    }

    void moe_plan(Stream & s, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec,
                  const Tensor & plan_probs, const Tensor & row_of, const Tensor & token_of_row,
                  const Tensor & tokens_per_expert) override {
        int64_t n, k;
        std::tie(n, k) = op_checks::moe_plan(expert_of, probs, spec, plan_probs, row_of, token_of_row, tokens_per_expert);
        s.submit([=] {
            cpu::moe_plan(expert_of.data<int32_t>(), f32(probs), n, k, spec, f32(plan_probs), row_of.data<int32_t>(),
                          token_of_row.data<int32_t>(), token_of_row.numel(), tokens_per_expert.data<int64_t>());
        });
    }

    void moe_plan_experts(Stream & s, const Tensor & row_of, const Tensor & tokens_per_expert,
                          const Tensor & expert_of) override {
        op_checks::moe_plan_experts(row_of, tokens_per_expert, expert_of);
        s.submit([=] {
            cpu::moe_plan_experts(row_of.data<int32_t>(), row_of.numel(), tokens_per_expert.data<int64_t>(),
                                  tokens_per_expert.numel(), expert_of.data<int32_t>());
        });
    }

    void moe_gather_rows(Stream & s, const Tensor & x, const Tensor & index, const Tensor & out) override {
        int64_t rows, h;
        std::tie(rows, h) = op_checks::moe_gather_rows(x, index, out);
        s.submit([=] { cpu::moe_gather_rows(f32(x), x.size(0), index.data<int32_t>(), rows, h, f32(out)); });
    }

    void moe_combine(Stream & s, const Tensor & src, const Tensor & row_of, const Tensor & weights,
                     const Tensor & dst) override {
        const op_checks::MoeCombineDims d = op_checks::moe_combine(src, row_of, weights, dst);
        const int64_t                   n = d.n, k = d.k, h = d.h;
        s.submit([=] { cpu::moe_combine(f32(src), row_of.data<int32_t>(), f32_or_null(weights), n, k, h, f32(dst)); });
    }

    void moe_combine_backward(Stream & s, const Tensor & dy, const Tensor & src, const Tensor & weights,
                              const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc,
                              const Tensor & dweights) override {
        const op_checks::MoeCombineDims d =
            op_checks::moe_combine_backward(dy, src, weights, row_of, token_of_row, dsrc, dweights);
        const int64_t rows = d.rows, n = d.n, k = d.k, h = d.h;
        s.submit([=] {
            cpu::moe_combine_backward(f32(dy), f32(src), rows, f32(weights), row_of.data<int32_t>(),
                                      token_of_row.data<int32_t>(), n, k, h, f32(dsrc), f32(dweights));
        });
    }

    void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v,
               const Tensor & out, const AdamStep & a) override {
        const int64_t n = op_checks::adamw(master, grad, m, v, out, a);
        s.submit([=] {
            host_adam_step(f32(master), f32(grad), f32(m), f32(v), n, a.lr, a.beta1, a.beta2, a.eps, a.weight_decay,
                           a.step, out.defined() ? HostAdamOut{out.data_ptr(), out.dtype()} : HostAdamOut{});
        });
    }

    void grad_norm_gate(Stream & s, const Tensor & pairs, const GradNormGate & g, const Tensor & gate,
                        const Tensor & norm) override {
        op_checks::grad_norm_gate(pairs, g, gate, norm);
        s.submit([=] {
            const GradNormVerdict v = grad_norm_verdict(pairs.data<float>(), g);
            gate.data<float>()[0]   = v.coeff;
            gate.data<float>()[1]   = v.go ? 1.0f : 0.0f;
            norm.data<double>()[0]  = v.norm;
        });
    }

    // One task: the gate is read when the stream reaches it, after what computed it.
    void adamw_multi_gated(Stream & s, std::span<const AdamwTensors> entries, const Tensor & gate) override {
        expect(gate, DType::f32, 2, "adamw_multi_gated", "gate");
        for (const AdamwTensors & e : entries) op_checks::adamw(e.master, e.grad, e.m, e.v, e.out, e.step);
        s.submit([list = std::vector<AdamwTensors>(entries.begin(), entries.end()), gate] {
            const float coeff = gate.data<float>()[0];
            if (gate.data<float>()[1] == 0.0f) return;
            for (const AdamwTensors & e : list) {
                const AdamStep & a = e.step;
                if (coeff != 1.0f) scale_parallel(e.grad.data_ptr(), DType::f32, coeff, e.grad.numel());
                host_adam_step(f32(e.master), f32(e.grad), f32(e.m), f32(e.v), e.master.numel(), a.lr, a.beta1, a.beta2,
                               a.eps, a.weight_decay, a.step,
                               e.out.defined() ? HostAdamOut{e.out.data_ptr(), e.out.dtype()} : HostAdamOut{});
            }
        });
    }

private:
    // Read on the stream, where the sample ids are ready.
    static AttentionDropout attention_dropout(const Dropout & key) {
        return {key.p, key.seed, key.site, key.sample_ids.defined() ? key.sample_ids.data<int64_t>() : nullptr,
                key.offset};
    }
};

}  // namespace

Ops & cpu_ops() {
    static CpuOps instance;
    return instance;
}

}  // namespace loom::cpu
