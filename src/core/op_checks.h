// The argument checks every backend's Ops run before enqueueing anything (core/ops.h states the contracts):
// one place, so the CPU backend and the CUDA backend refuse the same calls with the same messages.
#pragma once

#include "core/error.h"
#include "core/float_bits.h"
#include "core/ops.h"
#include "core/tensor.h"

#include <cstdint>
#include <initializer_list>
#include <tuple>
#include <utility>

namespace loom::op_checks {

// t is defined, of `dtype`, and (numel >= 0) has numel elements.
inline void expect(const Tensor & t, DType dtype, int64_t numel, const char * op, const char * what) {
    LOOM_CHECK(t.defined(), op << ": " << what << " is missing", "");
    LOOM_CHECK(t.dtype() == dtype, op << ": " << what << " is " << t.describe() << ", expected " << dtype_name(dtype), "");
    LOOM_CHECK(numel < 0 || t.numel() == numel,
               op << ": " << what << " has " << t.numel() << " elements, expected " << numel, "");
}

// An activation's storage dtype: f32, or bf16 (--bf16 runs; the kernels compute in f32 and round each stored
// result once). The other activations of the call must have the same one.
inline DType activations(const Tensor & t, const char * op, const char * what) {
    LOOM_CHECK(t.defined(), op << ": " << what << " is missing", "");
    LOOM_CHECK(t.dtype() == DType::f32 || t.dtype() == DType::bf16,
               op << ": " << what << " is " << t.describe() << ", expected float32 or bfloat16", "");
    return t.dtype();
}

// Calls fn with a null T * for the storage type of activations of `dtype` as activations() checked it:
// float, or Bf16 (core/float_bits.h), the kernels' template argument (both backends dispatch through this).
template <class Fn>
void with_activations(const Tensor & t, Fn && fn) {
    if (t.dtype() == DType::bf16) {
        fn(static_cast<Bf16 *>(nullptr));
    } else {
        fn(static_cast<float *>(nullptr));
    }
}
template <class T> T * act(const Tensor & t) { return static_cast<T *>(t.data_ptr()); }
template <class T> T * act_or_null(const Tensor & t) { return t.defined() ? static_cast<T *>(t.data_ptr()) : nullptr; }

// Rows and width of a 2-D (or flattened (n, w)) activation.
inline std::pair<int64_t, int64_t> rows_cols(const Tensor & t, const char * op) {
    LOOM_CHECK(t.dim() == 2, op << ": expected a 2-D (rows, width) tensor, got " << t.describe(), "");
    return {t.size(0), t.size(1)};
}

// c (m, n) = op(a) (m, k) op(b) (k, n), a and b both f32, both bf16 or both f16, c f32 (or bf16 without
// accumulate); or all three f64.
struct GemmDims {
    int64_t m, n, k;
};
inline GemmDims gemm(const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
                     bool accumulate = false) {
    LOOM_CHECK(a.dim() == 2 && b.dim() == 2, "gemm of " << a.describe() << " and " << b.describe(), "gemm takes 2-D operands");
    LOOM_CHECK(a.dtype() == b.dtype() && (a.dtype() == DType::f32 || dtype_is_half(a.dtype()) || a.dtype() == DType::f64),
               "gemm of " << a.describe() << " and " << b.describe(),
               "operands are both float32, both bfloat16, both float16 or both float64");
    const int64_t m = trans_a ? a.size(1) : a.size(0), k = trans_a ? a.size(0) : a.size(1);
    const int64_t kb = trans_b ? b.size(1) : b.size(0), n = trans_b ? b.size(0) : b.size(1);
    LOOM_CHECK(k == kb, "gemm: op(a) is " << m << "x" << k << ", op(b) " << kb << "x" << n, "");
    const bool into_bf16 = c.defined() && c.dtype() == DType::bf16 && a.dtype() != DType::f64;
    LOOM_CHECK(!(into_bf16 && accumulate), "gemm: accumulating into " << c.describe(), "accumulate into float32");
    expect(c, a.dtype() == DType::f64 ? DType::f64 : into_bf16 ? DType::bf16 : DType::f32, m * n, "gemm", "c");
    return {m, n, k};
}

// gemm's checks, and bias (n) f32 for c (m, n).
inline GemmDims gemm_bias(const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
                          const Tensor & bias) {
    LOOM_CHECK(a.dtype() != DType::f64, "gemm_bias of float64 operands", "gemm, then add the bias with a rank-1 gemm");
    const GemmDims dims = gemm(a, trans_a, b, trans_b, c);
    LOOM_CHECK(c.dim() == 2 && c.size(0) == dims.m, "gemm_bias: c is " << c.describe() << ", expected (" << dims.m
                                                                       << ", " << dims.n << ")", "");
    expect(bias, DType::f32, dims.n, "gemm_bias", "bias");
    return dims;
}

// gemm_bias_gelu: pre and y (m, n) of one activations dtype, the bias (n) f32 when given.
inline GemmDims gemm_bias_gelu(const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & pre,
                               const Tensor & y, const Tensor & bias) {
    LOOM_CHECK(a.dtype() != DType::f64, "gemm_bias_gelu of float64 operands", "float32, bfloat16 or float16 operands");
    const GemmDims dims = gemm(a, trans_a, b, trans_b, pre);
    LOOM_CHECK(pre.dim() == 2 && pre.size(0) == dims.m, "gemm_bias_gelu: pre is " << pre.describe() << ", expected ("
                                                                                  << dims.m << ", " << dims.n << ")", "");
    expect(y, pre.dtype(), dims.m * dims.n, "gemm_bias_gelu", "y");
    if (bias.defined()) expect(bias, DType::f32, dims.n, "gemm_bias_gelu", "bias");
    return dims;
}

// gemm_weight_grad: dw (o, in) += dy (n, o)^T x (n, in); dbias (o) f32.
inline GemmDims gemm_weight_grad(const Tensor & dy, const Tensor & x, const Tensor & dw, const Tensor & dbias) {
    LOOM_CHECK(dy.dtype() != DType::f64, "gemm_weight_grad of float64 operands", "float32, bfloat16 or float16 operands");
    const GemmDims dims = gemm(dy, true, x, false, dw, /*accumulate=*/true);
    LOOM_CHECK(dw.dim() == 2 && dw.size(0) == dims.m, "gemm_weight_grad: dw is " << dw.describe() << ", expected ("
                                                                                << dims.m << ", " << dims.n << ")", "");
    expect(dbias, DType::f32, dims.m, "gemm_weight_grad", "dbias");
    return dims;
}

// gemm_gelu_backward: pre and dx (m, n) of one activations dtype.
inline GemmDims gemm_gelu_backward(const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & pre,
                                   const Tensor & dx) {
    LOOM_CHECK(a.dtype() != DType::f64, "gemm_gelu_backward of float64 operands", "float32, bfloat16 or float16 operands");
    const GemmDims dims = gemm(a, trans_a, b, trans_b, dx);
    LOOM_CHECK(dx.dim() == 2 && dx.size(0) == dims.m, "gemm_gelu_backward: dx is " << dx.describe() << ", expected ("
                                                                                   << dims.m << ", " << dims.n << ")", "");
    expect(pre, dx.dtype(), dims.m * dims.n, "gemm_gelu_backward", "pre");
    return dims;
}

// A norm's forward operands over n rows of width h (the residual optional).
inline void norm(const Tensor & x, const Tensor & residual, const Tensor & gamma, const Tensor & y, const Tensor & rstd,
                 int64_t n, int64_t h, const char * op) {
    const DType act = activations(x, op, "x");
    expect(x, act, n * h, op, "x");
    if (residual.defined()) expect(residual, act, n * h, op, "residual");
    expect(gamma, DType::f32, h, op, "gamma");
    expect(y, act, n * h, op, "y");
    expect(rstd, DType::f32, n, op, "rstd");
}

// ---- Ids read where the kernel runs (tokens, labels): -1 (another rank's shard) or below `limit`. The
// CPU checks every id on its stream before its kernel; the CUDA kernels record the first id outside that
// range and host work after them raises this error. Either way it surfaces at the stream's next
// synchronize, naming the op and the id's position in the (b, s) tensor.
inline void id_in_range(int64_t value, int64_t position, int64_t limit, const char * op, const char * what) {
    LOOM_CHECK(value >= -1 && value < limit,
               op << ": " << what << " " << value << " at position " << position << " is outside [0, " << limit << ")",
               "token ids must be below the vocabulary size");
}

// rope over `heads` heads of d in the rows of x (seq * batch, stride); returns (rows, stride).
inline std::pair<int64_t, int64_t> rope(const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d,
                                        int64_t rotary_dim = 0) {
    const std::pair<int64_t, int64_t> nw = rows_cols(x, "rope");
    activations(x, "rope", "x");
    LOOM_CHECK(nw.first == seq * batch && heads * d <= nw.second && d % 2 == 0,
               "rope over " << heads << " heads of " << d << " in rows of " << x.describe(), "");
    LOOM_CHECK(rotary_dim >= 0 && rotary_dim <= d && rotary_dim % 2 == 0,
               "rope: rotary dimension " << rotary_dim << " of heads of " << d, "an even number in [2, d] (0: d)");
    return nw;
}

// A dropout key: p in [0, 1), sample ids (when given) i64 and at least one per batch column.
inline void dropout_key(const Dropout & key, const char * op) {
    LOOM_CHECK(key.p >= 0.0f && key.p < 1.0f, op << ": dropout probability " << key.p, "a probability in [0, 1)");
    if (key.sample_ids.defined()) {
        expect(key.sample_ids, DType::i64, -1, op, "sample_ids");
        LOOM_CHECK(key.sample_ids.numel() >= key.batch || !key.enabled(),
                   op << ": " << key.sample_ids.numel() << " sample ids for a batch of " << key.batch, "");
    }
}

// ---- Causal attention (core/ops.h): q (and dq) rows of shape.row_stride holding Q first; kv (and dkv) rows
// of kv_stride() holding K at k_column() and V at v_column(); out (and dout) (s b, nq d), all of one
// activations dtype (f32 or bf16; attention_merge f32); lse f32 (b, nq, s); the dropout key with a sample id
// per sequence.
inline void attention_shape(const AttentionShape & a, const char * op) {
    LOOM_CHECK(a.s > 0 && a.b > 0 && a.d > 0 && a.nkv > 0 && a.nq % a.nkv == 0 && a.row_stride >= a.nq * a.d,
               op << ": " << a.nq << " query heads over " << a.nkv << " key/value heads of " << a.d
                  << " in rows of " << a.row_stride,
               "query heads are a multiple of the key/value heads, and a row holds [Q | K | V]");
    const int64_t width = a.nkv * a.d;
    LOOM_CHECK(a.keys() > 0 && a.k_column() >= 0 && a.v_column() >= 0 && a.k_column() + width <= a.kv_stride() &&
                   a.v_column() + width <= a.kv_stride(),
               op << ": keys and values at columns " << a.k_column() << " and " << a.v_column() << " of rows of "
                  << a.kv_stride() << " (" << a.nkv << " heads of " << a.d << ")", "");
}
inline void attention_key(const AttentionShape & a, const Dropout & key, const char * op) {
    dropout_key(key, op);
    LOOM_CHECK(!key.enabled() || !key.sample_ids.defined() || key.sample_ids.numel() >= a.b,
               op << ": " << key.sample_ids.numel() << " sample ids for " << a.b << " sequences", "");
}
// A key mask (AttentionShape::key_mask, the indexer's top k): (b, s, s_kv) u8, the keys in position order.
inline bool identity(const SeqPositions & p) { return p.first == 0 && p.split == INT64_MAX; }
inline void key_mask(const AttentionShape & a, const char * op) {
    if (!a.key_mask.defined()) return;
    expect(a.key_mask, DType::u8, a.b * a.s * a.keys(), op, "the key mask");
    LOOM_CHECK(identity(a.k_pos), op << ": a key mask over keys at context-parallel positions",
               "the key mask's columns are whole sequences' keys in position order");
}

inline void attention_forward(const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & lse,
                              const AttentionShape & a, const Dropout & key) {
    attention_shape(a, "attention_forward");
    const int64_t n = a.s * a.b;
    const DType act = activations(q, "attention_forward", "q");
    expect(q, act, n * a.row_stride, "attention_forward", "q");
    expect(kv, act, a.keys() * a.b * a.kv_stride(), "attention_forward", "kv");
    expect(out, act, n * a.nq * a.d, "attention_forward", "out");
    expect(lse, DType::f32, n * a.nq, "attention_forward", "lse");
    attention_key(a, key, "attention_forward");
    key_mask(a, "attention_forward");
}
inline void attention_backward(const Tensor & q, const Tensor & kv, const Tensor & out, const Tensor & dout,
                               const Tensor & lse, const Tensor & dq, const Tensor & dkv, const AttentionShape & a,
                               const Dropout & key) {
    attention_shape(a, "attention_backward");
    const int64_t n = a.s * a.b;
    const DType act = activations(q, "attention_backward", "q");
    expect(q, act, n * a.row_stride, "attention_backward", "q");
    expect(dq, act, n * a.row_stride, "attention_backward", "dq");
    expect(kv, act, a.keys() * a.b * a.kv_stride(), "attention_backward", "kv");
    expect(dkv, act, a.keys() * a.b * a.kv_stride(), "attention_backward", "dkv");
    expect(out, act, n * a.nq * a.d, "attention_backward", "out");
    expect(dout, act, n * a.nq * a.d, "attention_backward", "dout");
    expect(lse, DType::f32, n * a.nq, "attention_backward", "lse");
    attention_key(a, key, "attention_backward");
    key_mask(a, "attention_backward");
}
inline void attention_merge(const Tensor & out, const Tensor & lse, const Tensor & part_out, const Tensor & part_lse,
                            const AttentionShape & a) {
    const int64_t n = a.s * a.b;
    LOOM_CHECK(n > 0 && a.nq > 0 && a.d > 0, "attention_merge: " << a.s << " x " << a.b << " queries of " << a.nq
                                                                 << " heads of " << a.d, "");
    expect(out, DType::f32, n * a.nq * a.d, "attention_merge", "out");
    expect(part_out, DType::f32, n * a.nq * a.d, "attention_merge", "part_out");
    expect(lse, DType::f32, n * a.nq, "attention_merge", "lse");
    expect(part_lse, DType::f32, n * a.nq, "attention_merge", "part_lse");
}

inline void attention_sink(const Tensor & out, const Tensor * dout, const Tensor & lse, const Tensor & sink,
                           const Tensor * dsink, const AttentionShape & a, const char * op) {
    const int64_t n = a.s * a.b;
    LOOM_CHECK(n > 0 && a.nq > 0 && a.d > 0, op << ": " << a.s << " x " << a.b << " queries of " << a.nq << " heads of " << a.d,
               "");
    const DType act = activations(out, op, "out");
    expect(out, act, n * a.nq * a.d, op, "out");
    if (dout) expect(*dout, act, n * a.nq * a.d, op, "dout");
    expect(lse, DType::f32, n * a.nq, op, "lse");
    expect(sink, DType::f32, a.nq, op, "sink");
    if (dsink) expect(*dsink, DType::f32, a.nq, op, "dsink");
}

// Hidden dropout of x (n, w) into y; returns (n, w).
inline std::pair<int64_t, int64_t> dropout(const Tensor & x, const Tensor & y, const Dropout & key) {
    const std::pair<int64_t, int64_t> nw = rows_cols(x, "dropout");
    expect(y, activations(x, "dropout", "x"), nw.first * nw.second, "dropout", "y");
    dropout_key(key, "dropout");
    LOOM_CHECK(key.offset >= 0 && key.batch >= 1, "dropout: rows from " << key.offset << " in columns of " << key.batch, "");
    return nw;
}

// The embedding's operands: tokens (b, s) i32, tables (V, h) and (P >= s, h) of one float dtype, out (s b, h).
struct EmbeddingDims {
    int64_t b, s, h;
};
inline EmbeddingDims embedding_forward(const Tensor & tokens, const Tensor & wte, const Tensor & wpe, const Tensor & out,
                                       const SeqPositions & positions = {}) {
    LOOM_CHECK(tokens.dim() == 2, "embedding_forward: tokens " << tokens.describe(), "tokens are (b, s)");
    expect(tokens, DType::i32, -1, "embedding_forward", "tokens");
    LOOM_CHECK(wte.defined() && wte.dim() == 2 && (wte.dtype() == DType::f32 || wte.dtype() == DType::bf16),
               "embedding table " << wte.describe(), "");
    const int64_t b = tokens.size(0), seq = tokens.size(1), h = wte.size(1);
    expect(out, activations(out, "embedding_forward", "out"), seq * b * h, "embedding_forward", "out");
    if (wpe.defined()) {
        expect(wpe, wte.dtype(), -1, "embedding_forward", "wpe");
        LOOM_CHECK(wpe.dim() == 2 && (seq == 0 || wpe.size(0) > positions(seq - 1)) && wpe.size(1) == h,
                   "embedding_forward: position table " << wpe.describe() << " for positions up to "
                                                        << positions(seq - 1) << " of " << h, "");
    }
    return {b, seq, h};
}
inline EmbeddingDims embedding_backward(const Tensor & tokens, const Tensor & dout, const Tensor & dwte,
                                        const Tensor & dwpe, const SeqPositions & positions = {}) {
    LOOM_CHECK(tokens.dim() == 2, "embedding_backward: tokens " << tokens.describe(), "tokens are (b, s)");
    expect(tokens, DType::i32, -1, "embedding_backward", "tokens");
    expect(dwte, DType::f32, -1, "embedding_backward", "dwte");
    LOOM_CHECK(dwte.dim() == 2, "embedding_backward: dwte " << dwte.describe(), "");
    const int64_t b = tokens.size(0), seq = tokens.size(1), h = dwte.size(1);
    expect(dout, activations(dout, "embedding_backward", "dout"), seq * b * h, "embedding_backward", "dout");
    if (dwpe.defined()) {
        expect(dwpe, DType::f32, -1, "embedding_backward", "dwpe");
        LOOM_CHECK(dwpe.dim() == 2 && (seq == 0 || dwpe.size(0) > positions(seq - 1)) && dwpe.size(1) == h,
                   "embedding_backward: dwpe " << dwpe.describe() << " for positions up to " << positions(seq - 1)
                                               << " of " << h, "");
    }
    return {b, seq, h};
}

inline void vocab_shard_ids(const Tensor & ids, const Tensor & out) {
    expect(ids, DType::i32, -1, "vocab_shard_ids", "ids");
    expect(out, DType::i32, ids.numel(), "vocab_shard_ids", "out");
}

// Logits (n, stride) f32 or bf16 whose first `valid` columns are read; returns (n, stride).
inline std::pair<int64_t, int64_t> logits(const Tensor & logits, int64_t valid, const char * op) {
    activations(logits, op, "logits");
    const std::pair<int64_t, int64_t> ns = rows_cols(logits, op);
    LOOM_CHECK(valid >= 0 && valid <= ns.second, op << ": " << valid << " columns of " << logits.describe(), "");
    return ns;
}
// Labels (b, s) i32 for n rows.
inline void labels(const Tensor & labels, int64_t n, const char * op) {
    LOOM_CHECK(labels.dim() == 2, op << ": labels " << labels.describe(), "labels are (b, s)");
    expect(labels, DType::i32, n, op, "labels");
}
inline std::pair<int64_t, int64_t> cross_entropy(const Tensor & logits_t, const Tensor & labels_t, const Tensor & lse,
                                                 int64_t vocab, const char * op) {
    const std::pair<int64_t, int64_t> ns = logits(logits_t, vocab, op);
    labels(labels_t, ns.first, op);
    expect(lse, DType::f32, ns.first, op, "lse");
    return ns;
}

// Five row vectors of one length; returns it.
inline int64_t lse_and_loss(const Tensor & max, const Tensor & sum, const Tensor & target, const Tensor & lse,
                            const Tensor & loss) {
    const int64_t n = max.numel();
    for (const Tensor * t : {&max, &sum, &target, &lse, &loss}) expect(*t, DType::f32, n, "lse_and_loss", "row vector");
    return n;
}

// mask (b, s) f32 and dloss of its size; returns (b, s).
inline std::pair<int64_t, int64_t> loss_grad(const Tensor & mask, const Tensor & dloss) {
    LOOM_CHECK(mask.dim() == 2, "loss_grad: mask " << mask.describe(), "the loss mask is (b, s)");
    expect(mask, DType::f32, -1, "loss_grad", "mask");
    expect(dloss, DType::f32, mask.numel(), "loss_grad", "dloss");
    return {mask.size(0), mask.size(1)};
}

// ---- Mixture of Experts (core/ops.h). Router logits (n, E) f32; returns n.
inline int64_t moe_logits(const Tensor & logits, const MoeRouting & r, const char * op) {
    LOOM_CHECK(r.experts >= 1 && r.topk >= 1 && r.topk <= r.experts,
               op << ": top-" << r.topk << " of " << r.experts << " experts", "");
    const std::pair<int64_t, int64_t> nw = rows_cols(logits, op);
    LOOM_CHECK(logits.dtype() == DType::f32 || logits.dtype() == DType::f64,
               op << ": logits are " << logits.describe() << ", expected float32 or float64 (--moe-router-dtype fp64)", "");
    LOOM_CHECK(nw.second == r.experts, op << ": logits " << logits.describe() << " for " << r.experts << " experts", "");
    return nw.first;
}
// Calls fn with the router's logits as the kernels read them: const float *, or const double * with
// --moe-router-dtype fp64 (both backends dispatch through this).
template <typename Fn>
void with_logits(const Tensor & logits, Fn && fn) {
    if (logits.dtype() == DType::f64) {
        fn(static_cast<const double *>(logits.data_ptr()));
    } else {
        fn(static_cast<const float *>(logits.data_ptr()));
    }
}
// counts (G, E) f32 for n rows in G groups.
inline void moe_counts(const Tensor & counts, int64_t n, int64_t groups, int64_t experts, const char * op) {
    LOOM_CHECK(groups >= 1 && n % groups == 0, op << ": " << n << " rows in " << groups << " groups", "");
    expect(counts, DType::f32, groups * experts, op, "counts");
}
inline void moe_router_loss(const MoeRouterLoss & loss, int64_t n, const char * op) {
    LOOM_CHECK(loss.tokens >= n && loss.tokens % loss.groups == 0 && loss.aux_coeff >= 0.0f && loss.z_coeff >= 0.0f,
               op << ": " << loss.tokens << " tokens in " << loss.groups << " groups (aux " << loss.aux_coeff
                  << ", z " << loss.z_coeff << ") for " << n << " rows", "");
}
inline void moe_count_tokens(const Tensor & tokens_per_expert, const Tensor & load) {
    expect(tokens_per_expert, DType::i64, -1, "moe_count_tokens", "tokens_per_expert");
    expect(load, DType::f32, tokens_per_expert.numel(), "moe_count_tokens", "load");
}
// Returns (rows, experts).
inline std::pair<int64_t, int64_t> moe_expert_bias_update(const Tensor & load, const Tensor & bias) {
    const std::pair<int64_t, int64_t> re = rows_cols(load, "moe_expert_bias_update");
    expect(load, DType::f32, -1, "moe_expert_bias_update", "load");
    expect(bias, DType::f32, load.numel(), "moe_expert_bias_update", "bias");
    return re;
}
// The plan's slots (n, k): expert_of i32 and probs f32; the outputs' sizes; returns (n, k).
inline std::pair<int64_t, int64_t> moe_plan(const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec,
                                            const Tensor & plan_probs, const Tensor & row_of,
                                            const Tensor & token_of_row, const Tensor & tokens_per_expert) {
    LOOM_CHECK(expert_of.dim() == 2, "moe_plan: expert_of " << expert_of.describe(), "slots are (n, k)");
    const int64_t n = expert_of.size(0), k = expert_of.size(1);
    expect(expert_of, DType::i32, -1, "moe_plan", "expert_of");
    expect(probs, DType::f32, n * k, "moe_plan", "probs");
    expect(plan_probs, DType::f32, n * k, "moe_plan", "plan_probs");
    expect(row_of, DType::i32, n * k, "moe_plan", "row_of");
    expect(tokens_per_expert, DType::i64, spec.experts, "moe_plan", "tokens_per_expert");
    LOOM_CHECK(spec.first >= 0 && spec.experts >= 1 && (!spec.padded || spec.capacity >= 0),
               "moe_plan over experts [" << spec.first << ", " << spec.first + spec.experts << ") with capacity "
                                         << spec.capacity, "padding needs a capacity");
    const int64_t rows_max = spec.padded ? spec.experts * spec.capacity : n * k;
    expect(token_of_row, DType::i32, -1, "moe_plan", "token_of_row");
    LOOM_CHECK(token_of_row.numel() >= rows_max,
               "moe_plan: token_of_row has " << token_of_row.numel() << " rows, the plan may use " << rows_max, "");
    return {n, k};
}
// x (m, h) f32 and out (rows, h) f32 rows of one width; returns (rows, h).
inline std::pair<int64_t, int64_t> moe_rows(const Tensor & x, const Tensor & out, const char * op) {
    const std::pair<int64_t, int64_t> mh = rows_cols(x, op);
    expect(x, DType::f32, -1, op, "input");
    const std::pair<int64_t, int64_t> rh = rows_cols(out, op);
    expect(out, DType::f32, -1, op, "output");
    LOOM_CHECK(mh.second == rh.second, op << ": rows of " << x.describe() << " into " << out.describe(), "");
    return rh;
}
// row_of (n, k) i32 and weights (n, k) f32 (optional) for n rows; returns k.
inline int64_t moe_slots(const Tensor & row_of, const Tensor & weights, int64_t n, const char * op) {
    LOOM_CHECK(row_of.dim() == 2 && row_of.size(0) == n, op << ": row_of " << row_of.describe() << " for " << n << " rows", "");
    expect(row_of, DType::i32, -1, op, "row_of");
    if (weights.defined()) expect(weights, DType::f32, row_of.numel(), op, "weights");
    return row_of.size(1);
}

// Each MoE op's operands (core/ops.h); each returns the sizes its kernels take.
inline int64_t moe_topk(const Tensor & logits, const MoeRouting & r, const Tensor & expert_bias, const Tensor & top_idx,
                        const Tensor & probs) {
    const int64_t n = moe_logits(logits, r, "moe_topk");
    if (r.group_topk > 0) {
        LOOM_CHECK(r.num_groups >= 1 && r.num_groups <= kMoeMaxGroups && r.experts % r.num_groups == 0 &&
                       r.group_topk <= r.num_groups && r.topk <= r.group_topk * (r.experts / r.num_groups),
                   "moe_topk: top-" << r.topk << " of the experts of " << r.group_topk << " of " << r.num_groups
                                    << " groups of " << r.experts << " experts", "");
    }
    if (expert_bias.defined()) {
        LOOM_CHECK(r.sigmoid, "moe_topk: an expert bias with softmax scores", "aux-loss-free routing is sigmoid's");
        expect(expert_bias, DType::f32, r.experts, "moe_topk", "expert_bias");
    }
    expect(top_idx, DType::i32, n * r.topk, "moe_topk", "top_idx");
    expect(probs, DType::f32, n * r.topk, "moe_topk", "probs");
    return n;
}
// Returns n, the rows routed (of the N rows of logits, from `first`).
inline int64_t moe_sinkhorn_topk(const Tensor & logits, int64_t first, const MoeRouting & r, const Tensor & top_idx,
                                 const Tensor & probs) {
    const int64_t N = moe_logits(logits, r, "moe_sinkhorn_topk");
    const int64_t n = top_idx.numel() / std::max<int64_t>(r.topk, 1);
    LOOM_CHECK(first >= 0 && first + n <= N, "moe_sinkhorn_topk: rows [" << first << ", " << first + n
                                                                          << ") of logits with " << N << " rows", "");
    expect(top_idx, DType::i32, n * r.topk, "moe_sinkhorn_topk", "top_idx");
    expect(probs, DType::f32, n * r.topk, "moe_sinkhorn_topk", "probs");
    return n;
}
inline int64_t moe_aux_counts(const Tensor & logits, const MoeRouting & r, int64_t groups, const Tensor & counts) {
    const int64_t n = moe_logits(logits, r, "moe_aux_counts");
    moe_counts(counts, n, groups, r.experts, "moe_aux_counts");
    return n;
}
inline int64_t moe_router_losses(const Tensor & logits, const Tensor & counts, const MoeRouting & r,
                                 const MoeRouterLoss & loss, const Tensor & losses) {
    const int64_t n = moe_logits(logits, r, "moe_router_losses");
    moe_counts(counts, n, loss.groups, r.experts, "moe_router_losses");
    moe_router_loss(loss, n, "moe_router_losses");
    expect(losses, DType::f32, 4, "moe_router_losses", "losses");
    return n;
}
inline int64_t moe_router_backward(const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs,
                                   const Tensor & counts, const MoeRouting & r, const MoeRouterLoss & loss,
                                   const Tensor & dlogits) {
    const int64_t n = moe_logits(logits, r, "moe_router_backward");
    expect(top_idx, DType::i32, n * r.topk, "moe_router_backward", "top_idx");
    expect(dprobs, DType::f32, n * r.topk, "moe_router_backward", "dprobs");
    moe_counts(counts, n, loss.groups, r.experts, "moe_router_backward");
    moe_router_loss(loss, n, "moe_router_backward");
    expect(dlogits, logits.dtype(), n * r.experts, "moe_router_backward", "dlogits");
    return n;
}
inline void moe_plan_experts(const Tensor & row_of, const Tensor & tokens_per_expert, const Tensor & expert_of) {
    expect(row_of, DType::i32, -1, "moe_plan_experts", "row_of");
    expect(tokens_per_expert, DType::i64, -1, "moe_plan_experts", "tokens_per_expert");
    expect(expert_of, DType::i32, row_of.numel(), "moe_plan_experts", "expert_of");
}
// Returns (rows, h).
inline std::pair<int64_t, int64_t> moe_gather_rows(const Tensor & x, const Tensor & index, const Tensor & out) {
    const std::pair<int64_t, int64_t> rh = moe_rows(x, out, "moe_gather_rows");
    expect(index, DType::i32, rh.first, "moe_gather_rows", "index");
    return rh;
}
struct MoeCombineDims {
    int64_t rows, n, k, h;   // src rows, dst rows (tokens), slots per token, width
};
inline MoeCombineDims moe_combine(const Tensor & src, const Tensor & row_of, const Tensor & weights, const Tensor & dst) {
    const std::pair<int64_t, int64_t> nh = moe_rows(src, dst, "moe_combine");
    const int64_t                     k  = moe_slots(row_of, weights, nh.first, "moe_combine");
    return {src.size(0), nh.first, k, nh.second};
}
inline MoeCombineDims moe_combine_backward(const Tensor & dy, const Tensor & src, const Tensor & weights,
                                           const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc,
                                           const Tensor & dweights) {
    const char * op = "moe_combine_backward";
    const std::pair<int64_t, int64_t> rh = moe_rows(dy, src, op);
    const int64_t                     n  = dy.size(0);
    LOOM_CHECK(weights.defined(), op << ": weights are missing", "");
    const int64_t k = moe_slots(row_of, weights, n, op);
    expect(token_of_row, DType::i32, -1, op, "token_of_row");
    LOOM_CHECK(token_of_row.numel() >= rh.first, op << ": " << token_of_row.numel() << " row tokens for " << rh.first << " rows", "");
    expect(dsrc, DType::f32, rh.first * rh.second, op, "dsrc");
    expect(dweights, DType::f32, n * k, op, "dweights");
    return {rh.first, n, k, rh.second};
}

// ---- Per op: each returns the sizes its kernels take (rows and width where it has them).

inline std::pair<int64_t, int64_t> layernorm_forward(const Tensor & x, const Tensor & residual, const Tensor & gamma,
                                                     const Tensor & beta, const Tensor & y, const Tensor & mean,
                                                     const Tensor & rstd) {
    const auto [n, h] = rows_cols(x, "layernorm_forward");
    op_checks::norm(x, residual, gamma, y, rstd, n, h, "layernorm_forward");
    expect(mean, DType::f32, n, "layernorm_forward", "mean");
    if (beta.defined()) expect(beta, DType::f32, h, "layernorm_forward", "beta");
    return {n, h};
}

inline std::pair<int64_t, int64_t> rmsnorm_forward(const Tensor & x, const Tensor & residual, const Tensor & gamma,
                                                   const Tensor & y, const Tensor & rstd) {
    const auto [n, h] = rows_cols(x, "rmsnorm_forward");
    op_checks::norm(x, residual, gamma, y, rstd, n, h, "rmsnorm_forward");
    return {n, h};
}

inline std::pair<int64_t, int64_t> layernorm_backward(const Tensor & dy, const Tensor & x, const Tensor & gamma,
                                                      const Tensor & mean, const Tensor & rstd, const Tensor & dx,
                                                      const Tensor & dgamma, const Tensor & dbeta,
                                                      const Tensor & dresidual = Tensor()) {
    const auto [n, h] = rows_cols(dy, "layernorm_backward");
    const DType act = activations(x, "layernorm_backward", "x");
    for (const Tensor * t : {&dy, &x, &dx}) expect(*t, act, n * h, "layernorm_backward", "dy/x/dx");
    if (dresidual.defined()) expect(dresidual, act, n * h, "layernorm_backward", "dresidual");
    for (const Tensor * t : {&gamma, &dgamma}) expect(*t, DType::f32, h, "layernorm_backward", "gamma/dgamma");
    if (dbeta.defined()) expect(dbeta, DType::f32, h, "layernorm_backward", "dbeta");   // optional, as beta
    for (const Tensor * t : {&mean, &rstd}) expect(*t, DType::f32, n, "layernorm_backward", "statistics");
    return {n, h};
}

inline std::pair<int64_t, int64_t> rmsnorm_backward(const Tensor & dy, const Tensor & x, const Tensor & gamma,
                                                    const Tensor & rstd, const Tensor & dx, const Tensor & dgamma,
                                                    const Tensor & dresidual = Tensor()) {
    const auto [n, h] = rows_cols(dy, "rmsnorm_backward");
    const DType act = activations(x, "rmsnorm_backward", "x");
    for (const Tensor * t : {&dy, &x, &dx}) expect(*t, act, n * h, "rmsnorm_backward", "dy/x/dx");
    if (dresidual.defined()) expect(dresidual, act, n * h, "rmsnorm_backward", "dresidual");
    for (const Tensor * t : {&gamma, &dgamma}) expect(*t, DType::f32, h, "rmsnorm_backward", "gamma/dgamma");
    expect(rstd, DType::f32, n, "rmsnorm_backward", "rstd");
    return {n, h};
}

// y (n, h) f32 or bf16 and bias (h) f32, or both f64 (the fp64 router's logits).
inline std::pair<int64_t, int64_t> bias_add(const Tensor & y, const Tensor & bias) {
    const auto [n, h] = rows_cols(y, "bias_add");
    const bool f64 = y.dtype() == DType::f64;
    if (!f64) activations(y, "bias_add", "y");
    expect(bias, f64 ? DType::f64 : DType::f32, h, "bias_add", "bias");
    return {n, h};
}

// dy (n, h) f32 or bf16 and dbias (h) f32, or both f64.
inline std::pair<int64_t, int64_t> bias_backward(const Tensor & dy, const Tensor & dbias) {
    const auto [n, h] = rows_cols(dy, "bias_backward");
    const bool f64 = dy.dtype() == DType::f64;
    if (!f64) activations(dy, "bias_backward", "dy");
    expect(dbias, f64 ? DType::f64 : DType::f32, h, "bias_backward", "dbias");
    return {n, h};
}

inline void add_inplace(const Tensor & y, const Tensor & x) {
    expect(x, activations(y, "add_inplace", "y"), y.numel(), "add_inplace", "x");
}

inline std::pair<int64_t, int64_t> bias_gelu_forward(const Tensor & x, const Tensor & bias, const Tensor & y,
                                                     const Tensor & x_bf16) {
    const auto [n, f] = rows_cols(x, "bias_gelu_forward");
    const DType act = activations(x, "bias_gelu_forward", "x");
    expect(y, act, n * f, "bias_gelu_forward", "y");
    if (bias.defined()) expect(bias, DType::f32, f, "bias_gelu_forward", "bias");
    if (x_bf16.defined()) {
        LOOM_CHECK(act == DType::f32, "bias_gelu_forward: a bf16 copy of the bf16 x " << x.describe(),
                   "x_bf16 is for float32 x; bf16 x holds the rounded values itself");
        expect(x_bf16, DType::bf16, n * f, "bias_gelu_forward", "x_bf16");
    }
    return {n, f};
}

inline void gelu_backward(const Tensor & x, const Tensor & dy, const Tensor & dx) {
    const DType act = activations(x, "gelu_backward", "x");
    expect(dy, act, x.numel(), "gelu_backward", "dy");
    expect(dx, act, x.numel(), "gelu_backward", "dx");
}

inline void squared_relu_forward(const Tensor & x, const Tensor & y) {
    expect(y, activations(x, "squared_relu_forward", "x"), x.numel(), "squared_relu_forward", "y");
}

inline void squared_relu_backward(const Tensor & x, const Tensor & dy, const Tensor & dx) {
    const DType act = activations(x, "squared_relu_backward", "x");
    expect(dy, act, x.numel(), "squared_relu_backward", "dy");
    expect(dx, act, x.numel(), "squared_relu_backward", "dx");
}

inline std::pair<int64_t, int64_t> swiglu_forward(const Tensor & x, const Tensor & y) {
    const auto [n, two_f] = rows_cols(x, "swiglu_forward");
    const DType act = activations(x, "swiglu_forward", "x");
    LOOM_CHECK(two_f % 2 == 0, "swiglu_forward: x " << x.describe() << " has an odd width", "x is [gate | up]");
    expect(y, act, n * (two_f / 2), "swiglu_forward", "y");
    return {n, two_f};
}

inline std::pair<int64_t, int64_t> swiglu_backward(const Tensor & x, const Tensor & dy, const Tensor & dx) {
    const auto [n, two_f] = rows_cols(x, "swiglu_backward");
    const DType act = activations(x, "swiglu_backward", "x");
    LOOM_CHECK(two_f % 2 == 0, "swiglu_backward: x " << x.describe() << " has an odd width", "x is [gate | up]");
    expect(dy, act, n * (two_f / 2), "swiglu_backward", "dy");
    expect(dx, act, n * two_f, "swiglu_backward", "dx");
    return {n, two_f};
}

// The rows of logits the label ops read: n = b seq rows of `stride` columns, labels (b, seq).
struct LabelDims {
    int64_t n = 0, stride = 0, b = 0, seq = 0;
};

inline LabelDims cross_entropy_forward(const Tensor & logits, const Tensor & labels, const Tensor & loss,
                                       const Tensor & lse, int64_t vocab) {
    const auto [n, stride] = op_checks::cross_entropy(logits, labels, lse, vocab, "cross_entropy_forward");
    expect(loss, DType::f32, n, "cross_entropy_forward", "loss");
    return {n, stride, labels.size(0), labels.size(1)};
}

inline LabelDims cross_entropy_backward(const Tensor & logits, const Tensor & labels, const Tensor & lse,
                                        const Tensor & dloss, int64_t vocab) {
    const auto [n, stride] = op_checks::cross_entropy(logits, labels, lse, vocab, "cross_entropy_backward");
    expect(dloss, DType::f32, n, "cross_entropy_backward", "dloss");
    return {n, stride, labels.size(0), labels.size(1)};
}

inline std::pair<int64_t, int64_t> row_max(const Tensor & logits, int64_t valid, const Tensor & out) {
    const auto [n, stride] = op_checks::logits(logits, valid, "row_max");
    expect(out, DType::f32, n, "row_max", "out");
    return {n, stride};
}

inline std::pair<int64_t, int64_t> row_sum_exp(const Tensor & logits, const Tensor & max, int64_t valid,
                                               const Tensor & out) {
    const auto [n, stride] = op_checks::logits(logits, valid, "row_sum_exp");
    expect(max, DType::f32, n, "row_sum_exp", "max");
    expect(out, DType::f32, n, "row_sum_exp", "out");
    return {n, stride};
}

inline LabelDims label_logit(const Tensor & logits, const Tensor & labels, const Tensor & out) {
    const auto [n, stride] = op_checks::logits(logits, 0, "label_logit");
    op_checks::labels(labels, n, "label_logit");
    expect(out, DType::f32, n, "label_logit", "out");
    return {n, stride, labels.size(0), labels.size(1)};
}

inline void convert(const Tensor & src, const Tensor & dst) {
    LOOM_CHECK(dtype_is_floating(src.dtype()) && dtype_is_floating(dst.dtype()) && src.numel() == dst.numel(),
               "convert " << src.describe() << " to " << dst.describe(), "");
    LOOM_CHECK(src.dtype() != DType::f64 || dst.dtype() == DType::f64 || dst.dtype() == DType::f32,
               "convert " << src.describe() << " to " << dst.describe(), "convert float64 to float32 first (core/dtype.h)");
}

inline void round_to_bf16(const Tensor & x, const Tensor & x_bf16) {
    expect(x, DType::f32, -1, "round_to_bf16", "x");
    expect(x_bf16, DType::bf16, x.numel(), "round_to_bf16", "x_bf16");
}

inline void copy(const Tensor & src, const Tensor & dst) {
    LOOM_CHECK(src.dtype() == dst.dtype() && src.numel() == dst.numel(),
               "copy " << src.describe() << " to " << dst.describe(), "copies keep the dtype and element count");
}

inline void copy_columns(const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col, int64_t width) {
    LOOM_CHECK(src.dim() == 2 && dst.dim() == 2 && src.dtype() == dst.dtype() && src.size(0) == dst.size(0),
               "copy_columns from " << src.describe() << " to " << dst.describe(), "2-D tensors of one dtype and row count");
    LOOM_CHECK(width >= 0 && src_col >= 0 && dst_col >= 0 && src_col + width <= src.size(1) &&
                   dst_col + width <= dst.size(1),
               "copy_columns of " << width << " columns from column " << src_col << " of " << src.describe()
                                  << " to column " << dst_col << " of " << dst.describe(), "");
}

// scale's tensor: f32, bf16 or f16.
inline void scale(const Tensor & t) {
    LOOM_CHECK(t.defined() && (t.dtype() == DType::f32 || dtype_is_half(t.dtype())),
               "scale: t is " << (t.defined() ? t.describe() : std::string("missing")), "scale takes f32, bf16 or f16");
}

inline void fp8_quantize(const Tensor & x, const Tensor & q, const Tensor & scale_inv) {
    LOOM_CHECK(x.defined() && (x.dtype() == DType::f32 || x.dtype() == DType::bf16) && q.defined() &&
                   q.dtype() == DType::bf16 && q.numel() == x.numel() && scale_inv.defined() &&
                   scale_inv.dtype() == DType::f32 && scale_inv.numel() == 1,
               "fp8_quantize: x " << (x.defined() ? x.describe() : std::string("missing")) << ", q "
                                  << (q.defined() ? q.describe() : std::string("missing")),
               "x is f32 or bf16, q bf16 of its numel, scale_inv one f32");
}

inline void fp8_amax(const Tensor & x, const Tensor & amax) {
    LOOM_CHECK(x.defined() && (x.dtype() == DType::f32 || x.dtype() == DType::bf16) && amax.defined() &&
                   amax.dtype() == DType::f32 && amax.numel() == 1,
               "fp8_amax: x " << (x.defined() ? x.describe() : std::string("missing")), "x is f32 or bf16, amax one f32");
}

inline void fp8_encode(const Tensor & x, const Tensor & amax, const Tensor & codes, const Tensor & scale_inv) {
    LOOM_CHECK(x.defined() && x.dtype() == DType::f32 && codes.defined() && codes.dtype() == DType::u8 &&
                   codes.numel() == x.numel() && amax.defined() && amax.dtype() == DType::f32 && amax.numel() == 1 &&
                   scale_inv.defined() && scale_inv.dtype() == DType::f32 && scale_inv.numel() == 1,
               "fp8_encode: x " << (x.defined() ? x.describe() : std::string("missing")) << ", codes "
                                << (codes.defined() ? codes.describe() : std::string("missing")),
               "x f32, codes u8 of its numel, amax and scale_inv one f32 each");
}

inline void fp8_decode(const Tensor & codes, const Tensor & q) {
    LOOM_CHECK(codes.defined() && codes.dtype() == DType::u8 && q.defined() && q.dtype() == DType::bf16 &&
                   q.numel() == codes.numel(),
               "fp8_decode: codes " << (codes.defined() ? codes.describe() : std::string("missing")) << ", q "
                                    << (q.defined() ? q.describe() : std::string("missing")),
               "codes u8, q bf16 of their numel");
}

inline void fp8_quantize_scaled(const Tensor & x, const Tensor & scale, const Tensor & q, const Tensor & scale_inv) {
    fp8_quantize(x, q, scale_inv);
    LOOM_CHECK(scale.defined() && scale.dtype() == DType::f32 && scale.numel() == 1,
               "fp8_quantize_scaled: scale " << (scale.defined() ? scale.describe() : std::string("missing")), "one f32 scale");
}

// The shared expert's gate: y, dy, m, dm (n, h) f32; logits, dlogits (n) f32.
inline void sigmoid_gate(const Tensor & y, const Tensor & logits, const char * op) {
    LOOM_CHECK(y.defined() && y.dtype() == DType::f32 && y.dim() == 2 && logits.defined() && logits.dtype() == DType::f32 &&
                   logits.numel() == y.size(0),
               op << ": y " << (y.defined() ? y.describe() : std::string("missing")) << ", logits "
                  << (logits.defined() ? logits.describe() : std::string("missing")),
               "y (n, h) f32 and one f32 logit per row");
}

// x (n, w) and each of `same` like it; src (n, >= gate_col + w) of x's dtype. Returns (n, w, src's row stride).
inline std::tuple<int64_t, int64_t, int64_t> output_gate(const Tensor & x, const Tensor & src, int64_t gate_col,
                                                         std::initializer_list<const Tensor *> same, const char * op) {
    const DType act = activations(x, op, "x");
    LOOM_CHECK(x.dim() == 2, op << ": x is " << x.describe() << ", expected (n, w)", "");
    for (const Tensor * t : same) {
        expect(*t, act, x.numel(), op, "an operand");
        LOOM_CHECK(t->dim() == 2 && t->size(0) == x.size(0), op << ": " << t->describe() << " beside x " << x.describe(), "");
    }
    expect(src, act, -1, op, "src");
    LOOM_CHECK(src.dim() == 2 && src.size(0) == x.size(0) && gate_col >= 0 && gate_col + x.size(1) <= src.size(1),
               op << ": gate columns [" << gate_col << ", " << gate_col + x.size(1) << ") of src " << src.describe()
                  << " for x " << x.describe(), "");
    return {x.size(0), x.size(1), src.size(1)};
}

// x (rows, d) f32 and each of `like_x` as x; rstd (rows) f32. Returns (rows, d).
inline std::pair<int64_t, int64_t> l2norm(const Tensor & x, std::initializer_list<const Tensor *> like_x, const Tensor & rstd,
                                          const char * op) {
    expect(x, DType::f32, -1, op, "x");
    LOOM_CHECK(x.dim() == 2 && x.size(1) >= 1, op << ": x is " << x.describe() << ", expected (rows, d)", "");
    for (const Tensor * t : like_x) {
        expect(*t, DType::f32, x.numel(), op, "an operand like x");
    }
    expect(rstd, DType::f32, x.size(0), op, "rstd");
    return {x.size(0), x.size(1)};
}

// src (n, >= col + 2 H) in the activations' dtype; a_log, dt_bias (H) f32; g, beta and dg, dbeta (n, H) f32; dsrc
// (n, 2 H) of src's dtype; da_log, ddt_bias (H) f32. Returns (n, H, src's row stride).
inline std::tuple<int64_t, int64_t, int64_t> gdn_gates(const Tensor & src, int64_t col, const Tensor & a_log,
                                                       const Tensor & dt_bias, std::initializer_list<const Tensor *> per_row,
                                                       const char * op) {
    activations(src, op, "src");
    expect(a_log, DType::f32, -1, op, "a_log");
    const int64_t H = a_log.numel();
    expect(dt_bias, DType::f32, H, op, "dt_bias");
    LOOM_CHECK(src.dim() == 2 && H >= 1 && col >= 0 && col + 2 * H <= src.size(1),
               op << ": columns [" << col << ", " << col + 2 * H << ") of src " << src.describe() << " for " << H << " heads", "");
    const int64_t n = src.size(0);
    for (const Tensor * t : per_row) expect(*t, DType::f32, n * H, op, "a per-head operand (g, beta or their gradients)");
    return {n, H, src.size(1)};
}

inline std::tuple<int64_t, int64_t, int64_t> gdn_gates_backward(const Tensor & src, int64_t col, const Tensor & a_log,
                                                                const Tensor & dt_bias, const Tensor & dg,
                                                                const Tensor & dbeta, const Tensor & dsrc,
                                                                const Tensor & da_log, const Tensor & ddt_bias) {
    const char * op = "gdn_gates_backward";
    const auto   dims = gdn_gates(src, col, a_log, dt_bias, {&dg, &dbeta}, op);
    expect(dsrc, src.dtype(), std::get<0>(dims) * 2 * std::get<1>(dims), op, "dsrc");
    expect(da_log, DType::f32, std::get<1>(dims), op, "da_log");
    expect(ddt_bias, DType::f32, std::get<1>(dims), op, "ddt_bias");
    return dims;
}

// The gated delta rule's operands: f32, of DeltaRuleShape's sizes.
inline void delta_rule(const DeltaRuleShape & d, std::initializer_list<const Tensor *> keys,
                       std::initializer_list<const Tensor *> values, std::initializer_list<const Tensor *> gates,
                       const Tensor & workspace, const char * op) {
    LOOM_CHECK(d.s >= 1 && d.b >= 1 && d.heads >= 1 && d.dk >= 1 && d.dv >= 1 && d.dk <= kDeltaRuleMaxDim &&
                   d.dv <= kDeltaRuleMaxDim,
               op << ": " << d.s << " steps of " << d.b << " sequences, " << d.heads << " heads, keys of " << d.dk
                  << " and values of " << d.dv, "widths at most " << kDeltaRuleMaxDim);
    const int64_t n = d.s * d.b;
    for (const Tensor * t : keys) expect(*t, DType::f32, n * d.heads * d.dk, op, "a query or key operand");
    for (const Tensor * t : values) expect(*t, DType::f32, n * d.heads * d.dv, op, "a value operand");
    for (const Tensor * t : gates) expect(*t, DType::f32, n * d.heads, op, "a gate operand (g or beta)");
    expect(workspace, DType::f32, -1, op, "workspace");
    LOOM_CHECK(workspace.numel() >= delta_rule_workspace_elements(d),
               op << ": workspace of " << workspace.numel() << " elements, " << delta_rule_workspace_elements(d) << " needed",
               "size it with delta_rule_workspace_elements");
}

inline void delta_rule_forward(const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g, const Tensor & beta,
                               const Tensor & o, const Tensor & workspace, const DeltaRuleShape & d) {
    delta_rule(d, {&q, &k}, {&v, &o}, {&g, &beta}, workspace, "gated_delta_rule_forward");
}

inline void delta_rule_backward(const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g, const Tensor & beta,
                                const Tensor & dout, const Tensor & dq, const Tensor & dk, const Tensor & dv,
                                const Tensor & dg, const Tensor & dbeta, const Tensor & workspace, const DeltaRuleShape & d) {
    delta_rule(d, {&q, &k, &dq, &dk}, {&v, &dout, &dv}, {&g, &beta, &dg, &dbeta}, workspace, "gated_delta_rule_backward");
}

// x (s b, C) f32 and each of `like_x` as x; w (C, K) f32. Returns (C, K).
inline std::pair<int64_t, int64_t> causal_conv(const Tensor & x, const Tensor & w, std::initializer_list<const Tensor *> like_x,
                                               int64_t seq, int64_t batch, const char * op) {
    expect(x, DType::f32, -1, op, "x");
    expect(w, DType::f32, -1, op, "w");
    LOOM_CHECK(seq >= 1 && batch >= 1 && x.dim() == 2 && x.size(0) == seq * batch && w.dim() == 2 && w.size(0) == x.size(1) &&
                   w.size(1) >= 1,
               op << ": x " << x.describe() << ", w " << w.describe() << " for " << seq << " steps of " << batch << " sequences",
               "x (s b, C), w (C, K)");
    for (const Tensor * t : like_x) {
        expect(*t, DType::f32, x.numel(), op, "an operand like x");
    }
    return {w.size(0), w.size(1)};
}

inline std::pair<int64_t, int64_t> causal_conv_backward(const Tensor & x, const Tensor & w, const Tensor & dy, const Tensor & dx,
                                                        const Tensor & dw, int64_t seq, int64_t batch) {
    expect(dw, DType::f32, w.numel(), "causal_conv_silu_backward", "dw");
    return causal_conv(x, w, {&dy, &dx}, seq, batch, "causal_conv_silu_backward");
}

// history (len, n) f32, scale (n) f32.
inline void fp8_delayed_update(const Tensor & history, const Tensor & scale) {
    LOOM_CHECK(history.defined() && history.dtype() == DType::f32 && history.dim() == 2 && history.size(0) >= 1 &&
                   scale.defined() && scale.dtype() == DType::f32 && scale.numel() == history.size(1),
               "fp8_delayed_update: history " << (history.defined() ? history.describe() : std::string("missing")) << ", scale "
                                              << (scale.defined() ? scale.describe() : std::string("missing")),
               "history (len, n) f32 and scale (n) f32");
}

inline void fp8_quantize_blocks(const Tensor & x, int64_t block_rows, int64_t block_cols, const Tensor & q) {
    LOOM_CHECK(x.defined() && (x.dtype() == DType::f32 || x.dtype() == DType::bf16) && x.dim() == 2 && q.defined() &&
                   q.dtype() == DType::bf16 && q.shape() == x.shape() && block_rows >= 1 && block_cols >= 1,
               "fp8_quantize_blocks: x " << (x.defined() ? x.describe() : std::string("missing")) << ", q "
                                         << (q.defined() ? q.describe() : std::string("missing")) << ", blocks "
                                         << block_rows << " x " << block_cols,
               "x 2-D f32 or bf16, q bf16 of its shape, blocks of at least 1 x 1");
}

inline void scale_by_reciprocal(const Tensor & t, const Tensor & d) {
    LOOM_CHECK(t.defined() && t.dtype() == DType::f32 && d.defined() && d.dtype() == DType::f32 && d.numel() == 1,
               "scale_by_reciprocal: t " << (t.defined() ? t.describe() : std::string("missing")), "f32 t and one f32 d");
}

inline void scale_by_product(const Tensor & t, const Tensor & a, const Tensor & b) {
    LOOM_CHECK(t.defined() && t.dtype() == DType::f32 && a.defined() && a.dtype() == DType::f32 && a.numel() == 1 &&
                   b.defined() && b.dtype() == DType::f32 && b.numel() == 1,
               "scale_by_product: t " << (t.defined() ? t.describe() : std::string("missing")), "f32 t and two f32 scalars");
}

inline void scale_by_inverse_norm(const Tensor & t, const Tensor & sums) {
    LOOM_CHECK(t.defined() && t.dtype() == DType::f32 && sums.defined() && sums.dtype() == DType::f32 && sums.numel() == 2,
               "scale_by_inverse_norm: t " << (t.defined() ? t.describe() : std::string("missing")) << ", sums "
                                           << (sums.defined() ? sums.describe() : std::string("missing")),
               "t is f32 and sums sum_of_squares' (2) f32 pair");
}

inline void sum_of_squares(const Tensor & x, const Tensor & out) {
    expect(x, DType::f32, -1, "sum_of_squares", "x");
    expect(out, DType::f32, 2, "sum_of_squares", "out");
}

inline int64_t adamw(const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v, const Tensor & out,
                     const AdamStep & a) {
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
    return n;
}

// grad_norm_gate's tensors: 2 (dense + expert + losses) f32 pairs, a 2-f32 gate and a 1-f64 norm.
inline void grad_norm_gate(const Tensor & pairs, const GradNormGate & g, const Tensor & gate, const Tensor & norm) {
    LOOM_CHECK(g.dense >= 0 && g.expert >= 0 && g.losses >= 0,
               "grad_norm_gate: " << g.dense << " dense, " << g.expert << " expert and " << g.losses << " loss pairs", "");
    expect(pairs, DType::f32, 2 * (g.dense + g.expert + g.losses), "grad_norm_gate", "pairs");
    expect(gate, DType::f32, 2, "grad_norm_gate", "gate");
    expect(norm, DType::f64, 1, "grad_norm_gate", "norm");
}

// Ops::dsa_index_scores / _backward: q (n, H d), w (n, H) and their gradients f32, n = s b; k (S b, d) f32, the keys
// of whole sequences (S >= s); scores and dscores (b, s, S) f32. Returns H, d and S.
struct DsaIndexSizes {
    int64_t H, d, keys;
};
inline DsaIndexSizes dsa_index(const Tensor & q, const Tensor & k, const Tensor & w, const Tensor & scores, int64_t seq,
                               int64_t batch, const char * op) {
    LOOM_CHECK(seq >= 1 && batch >= 1, op << ": sequence " << seq << " and batch " << batch << " must be >= 1", "");
    const int64_t n = seq * batch;
    LOOM_CHECK(k.defined() && k.dim() == 2 && k.size(0) % batch == 0 && k.size(0) >= n,
               op << ": k must be (S " << batch << ", d) with S >= " << seq << ", got " << k.describe(), "");
    LOOM_CHECK(w.defined() && w.dim() == 2 && w.size(0) == n, op << ": w must be (" << n << ", H), got " << w.describe(), "");
    const int64_t d = k.size(1), H = w.size(1), keys = k.size(0) / batch;
    expect(q, DType::f32, n * H * d, op, "q");
    expect(k, DType::f32, keys * batch * d, op, "k");
    expect(w, DType::f32, n * H, op, "w");
    expect(scores, DType::f32, batch * seq * keys, op, "the scores");
    return {H, d, keys};
}

// The indexer's (b, s, S) planes: scores f32, S >= s. Returns s and S.
inline std::pair<int64_t, int64_t> dsa_plane(const Tensor & scores, const char * op) {
    LOOM_CHECK(scores.defined() && scores.dim() == 3 && scores.size(2) >= scores.size(1),
               op << ": the scores must be (b, s, S) with S >= s, got " << scores.describe(), "");
    expect(scores, DType::f32, scores.numel(), op, "the scores");
    return {scores.size(1), scores.size(2)};
}

// Ops::dsa_topk_mask: scores (b, s, S) f32, mask (b, s, S) u8, k >= 1. Returns s and S.
inline std::pair<int64_t, int64_t> dsa_topk_mask(const Tensor & scores, int64_t k, const Tensor & mask) {
    const char * op = "dsa_topk_mask";
    const auto   sizes = dsa_plane(scores, op);
    LOOM_CHECK(k >= 1, op << ": top-" << k, "k >= 1");
    expect(mask, DType::u8, scores.numel(), op, "the mask");
    return sizes;
}

// Ops::dsa_attention_target: packed query rows of nq = nkv heads against the keys of whole sequences (kv, or the
// queries' own rows), no window.
inline void dsa_attention_target(const Tensor & q_k_v, const Tensor & kv, const AttentionShape & shape,
                                 const Tensor & target) {
    const char * op = "dsa_attention_target";
    activations(q_k_v, op, "q_k_v");
    key_mask(shape, op);
    LOOM_CHECK(shape.nq == shape.nkv && shape.keys() >= shape.s && identity(shape.k_pos) && shape.window < 0 &&
                   shape.s >= 1 && shape.b >= 1,
               op << ": heads " << shape.nq << " / " << shape.nkv << ", keys " << shape.keys() << " of " << shape.s
                  << " queries, window " << shape.window,
               "the indexer's target is whole sequences' causal attention, a key head per query head");
    LOOM_CHECK(q_k_v.numel() >= shape.s * shape.b * shape.row_stride, op << ": q_k_v " << q_k_v.describe()
                                                                         << " is smaller than its shape's rows", "");
    LOOM_CHECK(!kv.defined() || kv.numel() >= shape.keys() * shape.b * shape.kv_stride(),
               op << ": kv " << kv.describe() << " is smaller than its shape's key rows", "");
    LOOM_CHECK(kv.defined() || shape.keys() == shape.s, op << ": " << shape.keys() << " keys from the queries' own "
                                                           << shape.s << " rows", "give the keys' rows");
    expect(target, DType::f32, shape.b * shape.s * shape.keys(), op, "the target");
}

// Ops::dsa_indexer_loss: scores, target, dscores (b, s, S) f32, kl (b s) f32. Returns s and S.
inline std::pair<int64_t, int64_t> dsa_indexer_loss(const Tensor & scores, const Tensor & target, const Tensor & kl,
                                                    const Tensor & dscores, const Tensor & mask) {
    const char * op    = "dsa_indexer_loss";
    const auto   sizes = dsa_plane(scores, op);
    const int64_t n    = scores.numel();
    expect(target, DType::f32, n, op, "the target");
    expect(dscores, DType::f32, n, op, "dscores");
    expect(kl, DType::f32, scores.size(0) * sizes.first, op, "kl");
    if (mask.defined()) expect(mask, DType::u8, n, op, "the mask");
    return sizes;
}

}  // namespace loom::op_checks
