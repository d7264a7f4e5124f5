// The CUDA backend's kernels, as plain launch functions over raw device pointers (kernels.cu). Each one
// enqueues its kernel on `stream` and returns; argument checking, tensor lifetimes and launch-error checks
// belong to the caller (cuda_ops.cpp). This header is read by nvcc in C++17 and by the C++20 host code,
// so it includes no Loom header but the namespace macro (cuda_namespace.h), core/positions.h (a plain
// C++17 struct with host-device members) and core/column_sums.h (the rows' order of column sums).
//
// Every kernel is the twin of a CPU kernel (backend/cpu/ops.h) and follows its contract; where the CPU
// computes in double (norm statistics, sum of squares) so does the GPU. Reductions run in a fixed order
// for a fixed launch shape, so results are deterministic run to run.
//
// Legend: n rows (= s * b), h hidden, f ffn hidden.
#pragma once

#include "backend/cuda/cuda_namespace.h"
#include "core/column_sums.h"
#include "core/float_bits.h"
#include "core/fp8.h"
#include "core/glu.h"
#include "core/grad_norm_gate.h"
#include "core/positions.h"

#include <cuda_runtime.h>

#include <cstdint>

namespace loom::LOOM_CUDA_NS::kernels {

// The floating formats of convert() (f64 there only; the other kernels take f32, bf16 or f16); values match
// core's DType numbering only by name.
enum class Float : int { f32, bf16, f16, f64 };

void fill_f32(cudaStream_t stream, float * data, int64_t n, float value);
// dst = src converted, bit for bit as core/dtype.h's scalar conversions (nearest even, NaN payload kept).
void convert(cudaStream_t stream, const void * src, Float src_kind, void * dst, Float dst_kind, int64_t n);
// x rounded to bf16 in place, its bits written to x_bf16.
void round_to_bf16(cudaStream_t stream, float * x, uint16_t * x_bf16, int64_t n);

void scale(cudaStream_t stream, void * x, Float kind, float factor, int64_t n);   // x = kind(f32(x) * factor)
// Ops::fp8_quantize: partial holds fp8_quantize_chunks(n) doubles and scale one float of scratch.
int64_t fp8_quantize_chunks(int64_t n);
void    fp8_quantize(cudaStream_t stream, const void * x, Float kind, int64_t n, Fp8Format format, uint16_t * q,
                     float * scale_inv, double * partial, float * scale);
// Ops::fp8_quantize_blocks: scale holds one float per block of scratch.
void    fp8_quantize_blocks(cudaStream_t stream, const void * x, Float kind, int64_t rows, int64_t cols, Fp8Format format,
                            int64_t block_rows, int64_t block_cols, float * scale, uint16_t * q, bool mx);
// Ops::fp8_amax (partial: fp8_quantize_chunks(n) doubles of scratch), fp8_encode and fp8_decode.
void    fp8_amax(cudaStream_t stream, const void * x, Float kind, int64_t n, double * partial, float * amax);
void    fp8_encode(cudaStream_t stream, const float * x, int64_t n, Fp8Format format, const float * amax, uint8_t * codes,
                   float * scale_inv);
void    fp8_decode(cudaStream_t stream, const uint8_t * codes, int64_t n, Fp8Format format, uint16_t * q);
// Ops::sigmoid_gate_forward and _backward: y, dy, m, dm (n, h); logits, dlogits (n).
void    sigmoid_gate_forward(cudaStream_t stream, float * y, const float * logits, int64_t n, int64_t h);
void    sigmoid_gate_backward(cudaStream_t stream, const float * dy, const float * m, const float * logits, float * dm,
                              float * dlogits, int64_t n, int64_t h);
// Ops::fp8_quantize_scaled and Ops::fp8_delayed_update (history: len rows of n).
void    fp8_quantize_scaled(cudaStream_t stream, const void * x, Float kind, int64_t n, Fp8Format format, const float * scale,
                            uint16_t * q, float * scale_inv);
void    fp8_delayed_update(cudaStream_t stream, float * history, float * scale, int64_t len, int64_t n, Fp8Format format,
                           int margin, bool max_algo);
// t *= 1 / d[0] (Ops::scale_by_reciprocal).
void scale_by_reciprocal(cudaStream_t stream, float * t, const float * d, int64_t n);
// t *= a[0] * b[0] (Ops::scale_by_product).
void scale_by_product(cudaStream_t stream, float * t, const float * a, const float * b, int64_t n);
// x *= float(1 / max(sqrt(double(sums[0]) + sums[1]), eps)) (Ops::scale_by_inverse_norm).
void scale_by_inverse_norm(cudaStream_t stream, float * x, const float * sums, double eps, int64_t n);
// C (m, n) = op(A) op(B) in float64 (core/gemm_f64.h's arithmetic), or += with accumulate; one thread per element.
void gemm_f64(cudaStream_t stream, bool trans_a, bool trans_b, int64_t m, int64_t n, int64_t k, const double * a,
              const double * b, double * c, bool accumulate);
// The fp64 router's bias (core/gemm_f64.h): y (n, h) += bias; dbias += the column sums of dy, one thread per column.
void bias_add_f64(cudaStream_t stream, double * y, const double * bias, int64_t n, int64_t h);
void bias_backward_f64(cudaStream_t stream, const double * dy, double * dbias, int64_t n, int64_t h);
// Ops over activations take them as T: float, or Bf16 (core/float_bits.h), computed in f32 and stored once.
template <class T> void add_inplace(cudaStream_t stream, T * y, const T * x, int64_t n);
template <class T> void bias_add(cudaStream_t stream, T * y, const float * bias, int64_t n, int64_t h);
// Scratch (floats) a column sum of n rows by h columns needs (core/column_sums.h): none for one chunk.
inline int64_t column_sum_scratch(int64_t n, int64_t h) { return column_sum_chunks(n) > 1 ? column_sum_chunks(n) * h : 0; }
// dbias[j] += dy[0, j] + dy[1, j] + ... in core/column_sums.h's order (the CPU's: the same f32 additions);
// partial: column_sum_scratch(n, h) floats.
template <class T> void bias_backward(cudaStream_t stream, const T * dy, float * dbias, float * partial, int64_t n, int64_t h);

// Number of doubles of scratch sum_of_squares needs for n elements: one per chunk of 2^16.
int64_t sum_of_squares_chunks(int64_t n);
// out[0] = the double sum of x^2 rounded to f32, out[1] = the rest. Partial sums per chunk of 2^16 elements
// (a block each, tree-reduced in double), then added in chunk order by one thread.
void sum_of_squares(cudaStream_t stream, const float * x, int64_t n, double * partial, float * out);
// sum_of_squares of up to kSquaresMultiTensors tensors in two launches, passed by value: block c of the first
// sums chunk c - chunk_begin[t] of the tensor t whose chunks hold it (the single kernel's chunk and tree),
// thread t of the second adds tensor t's partials in order into out[2 t], out[2 t + 1].
constexpr int kSquaresMultiTensors = 64;
struct SquaresMulti {
    const float * x[kSquaresMultiTensors];
    int64_t       n[kSquaresMultiTensors];
    int64_t       chunk_begin[kSquaresMultiTensors + 1];   // chunk_begin[count]: every tensor's chunks
    int           count = 0;
};
void sum_of_squares_multi(cudaStream_t stream, const SquaresMulti & tensors, double * partial, float * out);

// Norms, one block per row, row statistics in double as the CPU's. residual may be null (else x += residual
// first, written back); beta may be null; mean is null for RMSNorm.
template <class T>
void layernorm_forward(cudaStream_t stream, T * x, const T * residual, const float * gamma, const float * beta, T * y,
                       float * mean, float * rstd, int64_t n, int64_t h, float eps);
template <class T>
void rmsnorm_forward(cudaStream_t stream, T * x, const T * residual, const float * gamma, T * y, float * rstd, int64_t n,
                     int64_t h, float eps);
// dx assigned; dgamma (and dbeta, may be null) added to, over rows in core/column_sums.h's order; partial:
// 2 column_sum_scratch(n, h) floats.
// dres (optional): a residual path's gradient, added to dx before it is stored.
template <class T>
void layernorm_backward(cudaStream_t stream, const T * dy, const T * x, const float * gamma, const float * mean,
                        const float * rstd, T * dx, float * dgamma, float * dbeta, float * partial, int64_t n, int64_t h,
                        const T * dres = nullptr);
template <class T>
void rmsnorm_backward(cudaStream_t stream, const T * dy, const T * x, const float * gamma, const float * rstd, T * dx,
                      float * dgamma, float * partial, int64_t n, int64_t h, const T * dres = nullptr);

// GELU (tanh approximation) fused with the bias; x_bf16 may be null (see core/ops.h).
template <class T>
void bias_gelu_forward(cudaStream_t stream, T * x, const float * bias, T * y, uint16_t * x_bf16, int64_t n, int64_t f);
template <class T> void gelu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t count);
template <class T> void swiglu_forward(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t f);
template <class T> void swiglu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t n, int64_t f);
// Ops::glu_forward / glu_backward: backend/cpu/ops.cpp's glu_forward and glu_backward, operation for operation.
template <class T> void glu_forward(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t f, GluSpec glu);
template <class T> void glu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t n, int64_t f, GluSpec glu);
template <class T> void squared_relu_forward(cudaStream_t stream, const T * x, T * y, int64_t count);
// Ops::gated_delta_rule_forward / _backward, f32: a block per (sequence, head), whose workspace region is
// `region` floats from workspace + block * region (core/ops.h's delta_rule_workspace_elements), states kept every
// `chunk` steps. dk, dv <= 256.
struct DeltaRuleDims {
    int64_t s, b, heads, dk, dv, chunk, region;
    float   scale;
};
void gated_delta_rule_forward(cudaStream_t stream, const float * q, const float * k, const float * v, const float * g,
                              const float * beta, float * o, float * workspace, DeltaRuleDims d);
void gated_delta_rule_backward(cudaStream_t stream, const float * q, const float * k, const float * v, const float * g,
                               const float * beta, const float * dout, float * dq, float * dk, float * dv, float * dg,
                               float * dbeta, float * workspace, DeltaRuleDims d);
// Ops::causal_conv_silu_forward / _backward: x, y, dy, dx (s b, C); w, dw (C, K).
void causal_conv_silu_forward(cudaStream_t stream, const float * x, const float * w, float * y, int64_t s, int64_t b,
                              int64_t C, int64_t K);
void causal_conv_silu_backward(cudaStream_t stream, const float * x, const float * w, const float * dy, float * dx,
                               float * dw, int64_t s, int64_t b, int64_t C, int64_t K);
// Ops::output_gate_forward / _backward: x, y, dy, dx, dgate (n, w); the gate of row r at gate + r * stride.
template <class T>
void output_gate_forward(cudaStream_t stream, const T * x, const T * gate, int64_t stride, T * y, int64_t n, int64_t w,
                         GateActivation act);
template <class T>
void output_gate_backward(cudaStream_t stream, const T * x, const T * gate, int64_t stride, const T * dy, T * dx, T * dgate,
                          int64_t n, int64_t w, GateActivation act);
// Ops::dsa_index_scores, _backward, dsa_topk_mask, dsa_attention_target and dsa_indexer_loss, f32 but the packed
// [Q | K | V] rows (T): q (s b, H d), k (S b, d), w (s b, H) and their gradients; scores, dscores, target, the masks
// (b, s, S; the target's and the loss's null for every causal key); kl (b s).
void dsa_index_scores(cudaStream_t stream, const float * q, const float * k, const float * w, float * scores,
                      const DsaRows & rows, int64_t H, int64_t d, bool relu);
void dsa_index_scores_backward(cudaStream_t stream, const float * q, const float * k, const float * w, const float * dscores,
                               float * dq, float * dk, float * dw, const DsaRows & rows, int64_t H, int64_t d, bool relu);
void dsa_topk_mask(cudaStream_t stream, const float * scores, int64_t k, uint8_t * mask, const DsaRows & rows);
template <class T>
void dsa_attention_target(cudaStream_t stream, const T * q_k_v, const T * kv, float * target, const DsaRows & rows,
                          int64_t heads, int64_t d, int64_t row_stride, int64_t kv_stride, int64_t k_col, float scale,
                          const uint8_t * key_mask);
void dsa_indexer_loss(cudaStream_t stream, const float * scores, const float * target, float weight, float * kl,
                      float * dscores, const DsaRows & rows, const uint8_t * mask);
// Ops::l2norm_forward / _backward, f32: x, y, dy, dx (rows, d); rstd (rows).
void l2norm_forward(cudaStream_t stream, const float * x, float * y, float * rstd, int64_t rows, int64_t d, float eps);
void l2norm_backward(cudaStream_t stream, const float * dy, const float * y, const float * rstd, float * dx, int64_t rows,
                     int64_t d);
// Ops::gdn_gates_forward / _backward: src's b of row r at src + r * stride, its a H further; g, beta, dg, dbeta (n, H);
// dsrc (n, 2 H); a_log, dt_bias, da_log, ddt_bias (H).
template <class T>
void gdn_gates_forward(cudaStream_t stream, const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                       float * g, float * beta, int64_t n, int64_t H);
template <class T>
void gdn_gates_backward(cudaStream_t stream, const T * src, int64_t stride, const float * a_log, const float * dt_bias,
                        const float * dg, const float * dbeta, T * dsrc, float * da_log, float * ddt_bias, int64_t n,
                        int64_t H);
template <class T> void squared_relu_backward(cudaStream_t stream, const T * x, const T * dy, T * dx, int64_t count);

// AdamW, the scalars of core/host_adam.h computed on the host exactly as there; the element update uses
// the same IEEE operations in the same order (explicit fma, no contraction), so it gives the host's bits.
struct AdamCoeffs {
    float beta1, beta2;
    float one_minus_beta1, one_minus_beta2;
    float step_size;   // lr / (1 - beta1^t)
    float bc2_sqrt;    // sqrt(1 - beta2^t)
    float eps;
    float decay;       // 1 - lr * wd
};
enum class AdamOut : int { none, f32, bf16 };
void adamw(cudaStream_t stream, float * p, const float * g, float * m, float * v, void * out, AdamOut out_kind,
           int64_t n, const AdamCoeffs & c);
// Up to kAdamMultiTensors tensors' AdamW in one launch, passed by value (about 2.5 KB of the 4 KB a kernel's
// parameters may take): thread i steps element i - begin[t] of the tensor t whose range holds it, with
// adamw's arithmetic and that tensor's coefficients.
constexpr int kAdamMultiTensors = 24;
struct AdamMultiEntry {
    float *       p;
    float *       g;   // written only by a gated step that clips
    float *       m;
    float *       v;
    void *        out;
    AdamOut       out_kind;
    AdamCoeffs    c;
};
struct AdamMulti {
    AdamMultiEntry entries[kAdamMultiTensors];
    int64_t        begin[kAdamMultiTensors + 1];   // begin[t]: the first element of tensor t; begin[count]: the total
    int            count = 0;
    // Ops::adamw_multi_gated's gate (f32 {clip factor, go}) in device memory, or nullptr: every thread reads
    // it; go 0 writes nothing, a factor other than 1 scales each gradient in place before its update.
    const float *  gate  = nullptr;
};
void adamw_multi(cudaStream_t stream, const AdamMulti & tensors);
// core/grad_norm_gate.h's verdict of `pairs` on one thread: gate <- {clip factor, go}, norm <- the norm.
void grad_norm_gate(cudaStream_t stream, const float * pairs, const GradNormGate & g, float * gate, double * norm);

// ---- Ids, rotary embedding, dropout, embedding, cross-entropy (twins of backend/cpu/ops.cpp and of the
// inline kernels of backend/cpu/cpu_ops.cpp). Ids (tokens, labels) outside [-1, limit) are read as -1 by
// every kernel below (nothing outside a table is touched); find_bad_id reports them.

// *first_bad = min over the ids outside [-1, limit) of (position << 32 | the id's 32 bits); the caller sets
// it to ~0 first, so ~0 afterwards means every id is in range.
void find_bad_id(cudaStream_t stream, const int32_t * ids, int64_t n, int64_t limit, unsigned long long * first_bad);

// Rotary embedding in place on the first `heads` heads of d in every (s, b) row of x (row stride in
// elements): the first r elements of each head, in pairs (i, i + r/2) or interleaved (2i, 2i + 1), as
// backend/cpu/ops.h's rope_apply. inv_freq (r / 2, device memory) is the CPU's table, computed on the host.
// Row si turns by its global position positions(si).
template <class T>
void rope(cudaStream_t stream, T * x, int64_t row_stride, int64_t s, int64_t b, int64_t heads, int64_t d, int64_t r,
          bool interleaved, const float * inv_freq, bool inverse, SeqPositions positions, float amplitude);

// Hidden dropout of x (n, w) into y (may be x): core/dropout.h's hash, bit for bit. sample_ids (batch, in
// device memory) may be null (column c is sample c); keep_scale = 1 / (1 - p) in f32 as the CPU computes it.
struct DropoutKey {
    uint64_t        seed;
    uint64_t        site;
    const int64_t * sample_ids;
    int64_t         batch;
    int64_t         offset;
    uint32_t        threshold;
    float           keep_scale;
    SeqPositions    positions;   // local position -> global position
};
template <class T> void dropout(cudaStream_t stream, const T * x, T * y, int64_t n, int64_t w, const DropoutKey & key);

// out (s * b, h) = wte[tokens[bi, si]] (0 for -1) + wpe[positions(si)] (wpe may be null), tables f32 or
// bf16 (both the same; Float::f16 is not a table format).
template <class T>
void embedding_forward(cudaStream_t stream, const int32_t * tokens, const void * wte, const void * wpe, Float kind,
                       T * out, int64_t s, int64_t b, int64_t h, int64_t vocab, SeqPositions positions);
// dwte[token] += dout rows and dwpe[positions(si)] += dout rows (dwpe may be null), each element's additions
// in row order as the CPU's, with no atomics: the same bits as the CPU. dwte's: the rows sorted by token
// (a bitonic sort of embedding_backward_keys(s * b) keys in `keys`, device scratch), then a thread per token
// and column adds that token's rows, so no thread reads every token.
int64_t embedding_backward_keys(int64_t rows);   // the next power of two
template <class T>
void embedding_backward(cudaStream_t stream, const int32_t * tokens, const T * dout, float * dwte, float * dwpe, int64_t s,
                        int64_t b, int64_t h, int64_t vocab, SeqPositions positions, uint64_t * keys);
// out[i] = ids[i] - begin where begin <= ids[i] < begin + count, else -1.
void vocab_shard_ids(cudaStream_t stream, const int32_t * ids, int64_t n, int64_t begin, int64_t count, int32_t * out);

// One block per row of logits (n, stride): max over the first `valid` columns (the CPU's value bit for bit:
// the first maximum in column order), and the sum of exp(x - max) (exp as the CPU's exp_approx, summed in
// double over a fixed tree, rounded to f32).
template <class T>
void row_max(cudaStream_t stream, const T * logits, int64_t n, int64_t stride, int64_t valid, float * out);
template <class T>
void row_sum_exp(cudaStream_t stream, const T * logits, const float * max, int64_t n, int64_t stride, int64_t valid,
                 float * out);
// labels (b, s) read in (s, b) row order. Forward: lse[r] = max + log(sum) (log in double), loss[r] = lse -
// the label's logit (0 for -1). Backward in place: (exp(x - lse) - onehot) * dloss[r], 0 on the padding.
template <class T>
void cross_entropy_forward(cudaStream_t stream, const T * logits, const int32_t * labels, float * loss, float * lse,
                           int64_t s, int64_t b, int64_t stride, int64_t vocab);
template <class T>
void cross_entropy_backward(cudaStream_t stream, T * logits, const int32_t * labels, const float * lse,
                            const float * dloss, int64_t s, int64_t b, int64_t stride, int64_t vocab);
// out[r] = logits[r, label] (0 for -1), labels (b, s) in (s, b) row order; labels >= stride read as -1.
template <class T>
void label_logit(cudaStream_t stream, const T * logits, const int32_t * labels, float * out, int64_t s, int64_t b,
                 int64_t stride);
// lse = max + logf(sum), loss = lse - target.
void lse_and_loss(cudaStream_t stream, const float * max, const float * sum, const float * target, float * lse,
                  float * loss, int64_t n);
// dloss[r] = float(mask[(r % b) * s + r / b] * scale), the product in double.
void loss_grad(cudaStream_t stream, const float * mask, double scale, float * dloss, int64_t s, int64_t b);

}  // namespace loom::LOOM_CUDA_NS::kernels
