// CPU kernels of the transformer layers (f32; exp and tanh through vec_math.h so the loops vectorise). Activations use Megatron's layout (s, b, h): row
// r = si * b + bi holds token si of sequence bi, so a sequence shard is a contiguous block of rows.
//
// Conventions: "forward" kernels assign their outputs; "backward" kernels assign the input gradient and
// ADD parameter gradients into their (main_grad) outputs, so gradients accumulate over microbatches.
// Row loops run on the compute thread budget (parallel_for); inner loops run over the contiguous last
// dimension so the compiler vectorises them.
//
// Legend: n rows (= s * b), h hidden, f ffn hidden, V vocab, d head dim.
#pragma once

#include "core/positions.h"

#include "core/dtype.h"

#include <cstdint>

namespace loom::cpu {

// y = (x - mean) * rstd * gamma + beta, per row; mean, rstd (n) are saved for backward. beta may be null.
void layernorm_forward(const float * x, const float * gamma, const float * beta, float * y, float * mean,
                       float * rstd, int64_t n, int64_t h, float eps);
void layernorm_backward(const float * dy, const float * x, const float * gamma, const float * mean,
                        const float * rstd, float * dx, float * dgamma, float * dbeta, int64_t n, int64_t h);

// Fused residual + LayerNorm, one pass per row: x += residual, then the LayerNorm of the sum into y.
void add_layernorm_forward(float * x, const float * residual, const float * gamma, const float * beta, float * y,
                           float * mean, float * rstd, int64_t n, int64_t h, float eps);

// y = x * rstd * gamma, rstd = 1 / sqrt(mean(x^2) + eps).
void rmsnorm_forward(const float * x, const float * gamma, float * y, float * rstd, int64_t n, int64_t h, float eps);
// Fused residual + RMSNorm: x += residual, then the RMSNorm of the sum into y.
void add_rmsnorm_forward(float * x, const float * residual, const float * gamma, float * y, float * rstd, int64_t n,
                         int64_t h, float eps);
void rmsnorm_backward(const float * dy, const float * x, const float * gamma, const float * rstd, float * dx,
                      float * dgamma, int64_t n, int64_t h);

// y[r, :] += bias; dbias += sum over rows of dy.
void bias_add(float * y, const float * bias, int64_t n, int64_t h);
void bias_backward(const float * dy, float * dbias, int64_t n, int64_t h);

// GELU, tanh approximation (GPT-2's): 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3))).
void gelu_forward(const float * x, float * y, int64_t count);
void gelu_backward(const float * x, const float * dy, float * dx, int64_t count);
// Fused bias + GELU on (n, f) rows, one pass: x += bias (bias may be null), y = gelu(x). With x_bf16, the
// biased x is rounded to bf16 there (and gelu reads the rounded value) while x itself is left as it was.
void bias_gelu_forward(float * x, const float * bias, float * y, uint16_t * x_bf16, int64_t n, int64_t f);

// SwiGLU on (n, 2f) input [gate | up] -> (n, f): y = silu(gate) * up.
void swiglu_forward(const float * x, float * y, int64_t n, int64_t f);
void swiglu_backward(const float * x, const float * dy, float * dx, int64_t n, int64_t f);

// Squared ReLU, elementwise: y = max(x, 0)^2, dx = dy * 2 max(x, 0).
void squared_relu_forward(const float * x, float * y, int64_t count);
void squared_relu_backward(const float * x, const float * dy, float * dx, int64_t count);

// y += x (residual), count elements.
void add_inplace(float * y, const float * x, int64_t count);

// Embedding: out (s, b, h) = wte[tokens[bi, si]] (+ wpe[si]); tokens are (b, s).
void embedding_forward(const int32_t * tokens, const float * wte, const float * wpe, float * out, int64_t s,
                       int64_t b, int64_t h, const SeqPositions & positions = {});
// The same with bf16 tables (bit patterns), summed in f32.
void embedding_forward(const int32_t * tokens, const uint16_t * wte_bf16, const uint16_t * wpe_bf16, float * out,
                       int64_t s, int64_t b, int64_t h, const SeqPositions & positions = {});
// dwte[token] += dout; dwpe[positions(si)] += dout (wpe may be null).
void embedding_backward(const int32_t * tokens, const float * dout, float * dwte, float * dwpe, int64_t s,
                        int64_t b, int64_t h, int64_t vocab, const SeqPositions & positions = {});

// Rotary position embedding, in place on `heads` heads of dimension d in each row of x (row stride in
// elements; rows are (s, b)); inverse = true rotates back (the backward of a rotation is the inverse
// rotation). The first r = rotary_dim elements of each head turn (0: r = d), the rest pass; pair i is
// (i, i + r/2) (non-interleaved halves, Megatron's default) or (2i, 2i + 1) (interleaved), and turns by
// positions(si) * base^(-2i / r).
void rope_apply(float * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, float base,
                bool inverse, int64_t rotary_dim = 0, bool interleaved = false, const SeqPositions & positions = {});

// Cross-entropy over logits (n, stride) with labels (b, s) read in (s, b) row order; only the first
// `vocab` columns are real tokens, the rest (vocabulary padding) are outside the softmax. Forward:
// loss[r] = logsumexp(logits[r, :vocab]) - logits[r, label]; lse[r] saved. Backward, in place: logits[r]
// becomes (softmax - onehot(label)) * dloss[r] on the real columns and exactly 0 on the padding.
void cross_entropy_forward(const float * logits, const int32_t * labels, float * loss, float * lse, int64_t s,
                           int64_t b, int64_t stride, int64_t vocab);
void cross_entropy_backward(float * logits_to_grad, const int32_t * labels, const float * lse,
                            const float * dloss, int64_t s, int64_t b, int64_t stride, int64_t vocab);
// (A negative label, or token in the embedding kernels, belongs to another tensor-parallel rank's part of
// the vocabulary: that row takes no one-hot term / embeds to zero / adds no gradient.)

// Vocabulary-parallel cross-entropy's pieces, over the first `valid` of `stride` columns of n rows: each
// row's max, and its sum of exp(logit - max[r]); the caller combines them over the ranks.
void row_max(const float * logits, int64_t n, int64_t stride, int64_t valid, float * out);
void row_sum_exp(const float * logits, const float * max, int64_t n, int64_t stride, int64_t valid, float * out);

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

}  // namespace loom::cpu
