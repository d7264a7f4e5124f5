// CPU kernels of the transformer layers (f32 arithmetic; exp and tanh through vec_math.h so the loops vectorise). Activations use Megatron's layout (s, b, h): row
// r = si * b + bi holds token si of sequence bi, so a sequence shard is a contiguous block of rows.
//
// Conventions: "forward" kernels assign their outputs; "backward" kernels assign the input gradient and
// ADD parameter gradients into their (main_grad) outputs, so gradients accumulate over microbatches.
// Row loops run on the compute thread budget (parallel_for); inner loops run over the contiguous last
// dimension so the compiler vectorises them.
//
// Legend: n rows (= s * b), h hidden, f ffn hidden, V vocab, d head dim.
#pragma once

#include "core/glu.h"
#include "core/positions.h"

#include "core/dtype.h"
#include "core/float_bits.h"
#include "core/ops.h"

#include <cmath>
#include <cstdint>

namespace loom::cpu {

// Activations are float or Bf16 (T, core/float_bits.h): each kernel reads them as f32, computes in f32 and
// stores its outputs rounded to T (nearest even); statistics, losses and parameter gradients are f32. Both
// types are instantiated in ops.cpp; the float instantiation is the f32 kernel, bit for bit.

// y = (x - mean) * rstd * gamma + beta, per row; mean, rstd (n) are saved for backward. beta may be null.
template <class T>
void layernorm_forward(const T * x, const float * gamma, const float * beta, T * y, float * mean, float * rstd,
                       int64_t n, int64_t h, float eps);
// dx also takes dres (n, h) where given: dx = norm's dx + dres, one rounding (a residual path's gradient).
template <class T>
void layernorm_backward(const T * dy, const T * x, const float * gamma, const float * mean, const float * rstd, T * dx,
                        float * dgamma, float * dbeta, int64_t n, int64_t h, const T * dres = nullptr);

// Fused residual + LayerNorm, one pass per row: x += residual (rounded to T), then the LayerNorm of the sum
// into y.
template <class T>
void add_layernorm_forward(T * x, const T * residual, const float * gamma, const float * beta, T * y, float * mean,
                           float * rstd, int64_t n, int64_t h, float eps);

// y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps).
template <class T>
void rmsnorm_forward(const T * x, const float * gamma, T * y, float * rstd, int64_t n, int64_t h, float eps);
// Fused residual + RMSNorm: x += residual, then the RMSNorm of the sum into y.
template <class T>
void add_rmsnorm_forward(T * x, const T * residual, const float * gamma, T * y, float * rstd, int64_t n, int64_t h,
                         float eps);
template <class T>
void rmsnorm_backward(const T * dy, const T * x, const float * gamma, const float * rstd, T * dx, float * dgamma,
                      int64_t n, int64_t h, const T * dres = nullptr);

// y[r, :] += bias; dbias += sum over rows of dy.
template <class T> void bias_add(T * y, const float * bias, int64_t n, int64_t h);
template <class T> void bias_backward(const T * dy, float * dbias, int64_t n, int64_t h);

// GELU, tanh approximation (GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const float * x, float * y, int64_t count);
template <class T> void gelu_backward(const T * x, const T * dy, T * dx, int64_t count);
// Fused bias + GELU on (n, f) rows, one pass: x += bias (bias may be null; stored rounded to T, and gelu
// reads the stored value), y = gelu(x). With x_bf16 (f32 x only), the biased x is rounded to bf16 there (and
// gelu reads the rounded value) while x itself is left as it was.
template <class T> void bias_gelu_forward(T * x, const float * bias, T * y, uint16_t * x_bf16, int64_t n, int64_t f);

// SwiGLU on (n, 2f) input [gate | up] -> (n, f): y = silu(gate) * up.
template <class T> void swiglu_forward(const T * x, T * y, int64_t n, int64_t f);
template <class T> void swiglu_backward(const T * x, const T * dy, T * dx, int64_t n, int64_t f);
template <class T> void glu_forward(const T * x, T * y, int64_t n, int64_t f, const GluSpec & glu);
template <class T> void glu_backward(const T * x, const T * dy, T * dx, int64_t n, int64_t f, const GluSpec & glu);

// Squared ReLU, elementwise: y = max(x, 0)^2, dx = dy * 2 max(x, 0).
template <class T> void squared_relu_forward(const T * x, T * y, int64_t count);
// sigmoid(v) = 1 / (1 + e^-v) in f32, as the CUDA kernels form it (kernels.cu's sigmoid_rn): the shared expert's
// gate, the attention's output gate and SiLU's gradient in the short convolution.
inline float sigmoid_f32(float v) { return 1.0f / (1.0f + std::exp(-v)); }

// Ops::gated_delta_rule_forward / _backward (backend/cpu/delta_rule.cpp).
void gated_delta_rule_forward(const float * q, const float * k, const float * v, const float * g, const float * beta,
                              float * o, float * workspace, const DeltaRuleShape & d);
void gated_delta_rule_backward(const float * q, const float * k, const float * v, const float * g, const float * beta,
                               const float * dout, float * dq, float * dk, float * dv, float * dg, float * dbeta,
                               float * workspace, const DeltaRuleShape & d);
// Ops::causal_conv_silu_forward / _backward (backend/cpu/delta_rule.cpp): x, y, dy, dx (s b, C); w, dw (C, K).
void causal_conv_silu_forward(const float * x, const float * w, float * y, int64_t s, int64_t b, int64_t C, int64_t K);
void causal_conv_silu_backward(const float * x, const float * w, const float * dy, float * dx, float * dw, int64_t s,
                               int64_t b, int64_t C, int64_t K);
// Ops::output_gate_forward / _backward (backend/cpu/delta_rule.cpp): x, y, dy, dx, dgate (n, w); the gate of row r
// at gate + r * stride.
template <class T>
void output_gate_forward(const T * x, const T * gate, int64_t stride, T * y, int64_t n, int64_t w, GateActivation act);
template <class T>
void output_gate_backward(const T * x, const T * gate, int64_t stride, const T * dy, T * dx, T * dgate, int64_t n, int64_t w,
                          GateActivation act);
// Ops::l2norm_forward / _backward (backend/cpu/delta_rule.cpp): x, y, dy, dx (rows, d); rstd (rows).
void l2norm_forward(const float * x, float * y, float * rstd, int64_t rows, int64_t d, float eps);
void l2norm_backward(const float * dy, const float * y, const float * rstd, float * dx, int64_t rows, int64_t d);
// Ops::gdn_gates_forward / _backward (backend/cpu/delta_rule.cpp): src's b of row r at src + r * stride, its a H
// further; g, beta, dg, dbeta (n, H); dsrc (n, 2 H).
template <class T>
void gdn_gates_forward(const T * src, int64_t stride, const float * a_log, const float * dt_bias, float * g, float * beta,
                       int64_t n, int64_t H);
template <class T>
void gdn_gates_backward(const T * src, int64_t stride, const float * a_log, const float * dt_bias, const float * dg,
                        const float * dbeta, T * dsrc, float * da_log, float * ddt_bias, int64_t n, int64_t H);
template <class T> void squared_relu_backward(const T * x, const T * dy, T * dx, int64_t count);

// y += x (residual), count elements.
template <class T> void add_inplace(T * y, const T * x, int64_t count);

// Embedding: out (s, b, h) = wte[tokens[bi, si]] (+ wpe[si]), summed in f32; tokens are (b, s).
template <class T>
void embedding_forward(const int32_t * tokens, const float * wte, const float * wpe, T * out, int64_t s, int64_t b,
                       int64_t h, const SeqPositions & positions = {});
// The same with bf16 tables (bit patterns).
template <class T>
void embedding_forward(const int32_t * tokens, const uint16_t * wte_bf16, const uint16_t * wpe_bf16, T * out,
                       int64_t s, int64_t b, int64_t h, const SeqPositions & positions = {});
// dwte[token] += dout; dwpe[positions(si)] += dout (wpe may be null).
template <class T>
void embedding_backward(const int32_t * tokens, const T * dout, float * dwte, float * dwpe, int64_t s, int64_t b,
                        int64_t h, int64_t vocab, const SeqPositions & positions = {});

// Rotary position embedding, in place on `heads` heads of dimension d in each row of x (row stride in
// elements; rows are (s, b)); inverse = true rotates back (the backward of a rotation is the inverse
// rotation). The first r = rotary_dim elements of each head turn (0: r = d), the rest pass; pair i is
// (i, i + r/2) (non-interleaved halves, Megatron's default) or (2i, 2i + 1) (interleaved), and turns by
// positions(si) * base^(-2i / r).
// With `scaling`: YaRN's frequencies and amplitude (core/rope.h); inverse is then the transpose.
template <class T>
void rope_apply(T * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, float base, bool inverse,
                int64_t rotary_dim = 0, bool interleaved = false, const SeqPositions & positions = {},
                const RopeScaling & scaling = {});

// Cross-entropy over logits (n, stride) with labels (b, s) read in (s, b) row order; only the first
// `vocab` columns are real tokens, the rest (vocabulary padding) are outside the softmax. Forward:
// loss[r] = logsumexp(logits[r, :vocab]) - logits[r, label]; lse[r] saved. Backward, in place: logits[r]
// becomes (softmax - onehot(label)) * dloss[r] on the real columns and exactly 0 on the padding.
template <class T>
void cross_entropy_forward(const T * logits, const int32_t * labels, float * loss, float * lse, int64_t s, int64_t b,
                           int64_t stride, int64_t vocab);
template <class T>
void cross_entropy_backward(T * logits_to_grad, const int32_t * labels, const float * lse, const float * dloss,
                            int64_t s, int64_t b, int64_t stride, int64_t vocab);
// (A negative label, or token in the embedding kernels, belongs to another tensor-parallel rank's part of
// the vocabulary: that row takes no one-hot term / embeds to zero / adds no gradient.)

// Vocabulary-parallel cross-entropy's pieces, over the first `valid` of `stride` columns of n rows: each
// row's max, and its sum of exp(logit - max[r]); the caller combines them over the ranks.
template <class T> void row_max(const T * logits, int64_t n, int64_t stride, int64_t valid, float * out);
template <class T>
void row_sum_exp(const T * logits, const float * max, int64_t n, int64_t stride, int64_t valid, float * out);

// n elements from src_dtype to dst_dtype (f32, bf16, f16) on the compute threads.
void convert_parallel(const void * src, DType src_dtype, void * dst, DType dst_dtype, int64_t n);

// x *= factor, n elements, on the compute threads.
void scale_parallel(void * x, DType dtype, float factor, int64_t n);   // x = dtype(f32(x) * factor)
// The sum of x[i]^2 in double: partial sums over fixed chunks of 2^16 elements, added in chunk order (the
// same bits at any thread count).
double sum_of_squares(const float * x, int64_t n);

// Rounds x to bf16 in place and writes the bf16 bit patterns to x_bf16: afterwards x holds exactly the
// values x_bf16 stores, so a forward computed from x and a backward from x_bf16 see the same numbers.
void round_to_bf16(float * x, uint16_t * x_bf16, int64_t n);

// Ops::dsa_index_scores, _backward, dsa_topk_mask, dsa_attention_target and dsa_indexer_loss (backend/cpu/dsa.cpp):
// q (s b, H d), k (S b, d), w (s b, H) and their gradients; scores, dscores, target, mask (b, s, S); kl (b s); the
// loss's mask null for every causal key.
void dsa_index_scores(const float * q, const float * k, const float * w, float * scores, const DsaRows & rows, int64_t H,
                      int64_t d, bool relu);
void dsa_index_scores_backward(const float * q, const float * k, const float * w, const float * dscores, float * dq,
                               float * dk, float * dw, const DsaRows & rows, int64_t H, int64_t d, bool relu);
void dsa_topk_mask(const float * scores, int64_t k, uint8_t * mask, const DsaRows & rows);
template <class T>
void dsa_attention_target(const T * q_k_v, const T * kv, float * target, const AttentionShape & shape, float scale);
void dsa_indexer_loss(const float * scores, const float * target, float weight, float * kl, float * dscores,
                      const DsaRows & rows, const uint8_t * mask);

}  // namespace loom::cpu
