// Ops: every kernel the layers above the backends run (model, optim, ddp, pipeline, train), as one
// virtual call each on the Device's ops table (ggml's backend interface is the model). Each call takes
// Tensors and the Stream to run on: it checks its arguments on the calling thread (a wrong shape or dtype
// is a loom::Error there and then, never on a stream) and enqueues the kernel; the result is ready for
// later work on the same stream, and for the host only after it waits on an event recorded after it (or
// synchronizes the stream). The tensors an op was given stay alive until its kernel has run, so memory is
// freed in stream order whatever the caller drops.
//
// Conventions (as the CPU kernels, backend/cpu/ops.h): activations are (n, width) row-major with rows in
// Megatron's (s, b) order, n = s * b, and f32 or bf16 (--bf16), one dtype for all of a call's activations:
// the kernels read them as f32, compute in f32 and round each stored result once; statistics, losses and
// parameter gradients are f32 whatever the activations are (op_checks::activations). "forward" ops assign their outputs; "backward" ops assign the input
// gradient and ADD into parameter gradients (main_grad), so micro-batches accumulate. An optional tensor
// argument is passed as an undefined Tensor().
//
// The CPU backend registers its kernels (backend/cpu/cpu_ops.cpp); tests/test_backend_ops.cpp checks each
// op against a double-precision host reference at every dispatch level, and a later backend joins it.
#pragma once

#include "core/grad_norm_gate.h"
#include "core/glu.h"
#include "core/positions.h"
#include "core/rope.h"
#include "core/fp8.h"
#include "core/tensor.h"

#include <cstdint>
#include <span>
#include <string>

namespace loom {

// Causal self-attention over the rows of a QKV projection, each row [Q | K | V]: nq query heads, nkv key/
// value heads (query head hq reads group hq / (nq / nkv)), head dimension d.
//
// Keys and values may come from another tensor (context parallelism: a block of another rank's sequence):
// kv's rows (s_kv, b) of kv_row_stride hold K at column k_col and V at v_col. Key j is visible to query i
// when k_pos(j) <= q_pos(i) (global positions, core/positions.h); the defaults are the query tensor's own
// [Q | K | V] rows at the same positions, which is plain causal attention.
struct AttentionShape {
    AttentionShape() = default;
    // The query side; the key side defaults to the queries' own [Q | K | V] rows at the same positions.
    AttentionShape(int64_t s_, int64_t b_, int64_t nq_, int64_t nkv_, int64_t d_, int64_t row_stride_)
        : s(s_), b(b_), nq(nq_), nkv(nkv_), d(d_), row_stride(row_stride_) {}

    int64_t s          = 0;   // query rows' sequence length
    int64_t b          = 0;   // micro-batch size
    int64_t nq         = 0;   // query heads
    int64_t nkv        = 0;   // key/value heads (query groups)
    int64_t d          = 0;   // head dimension
    int64_t row_stride = 0;   // elements between consecutive (s, b) rows of q and dq
    int64_t      s_kv          = 0;    // key rows' sequence length (0: s)
    int64_t      kv_row_stride = 0;    // elements between rows of kv and dkv (0: row_stride)
    int64_t      k_col         = -1;   // K's first column in kv (-1: nq d, after Q)
    int64_t      v_col         = -1;   // V's first column in kv (-1: (nq + nkv) d)
    SeqPositions q_pos, k_pos;
    // A sliding window (--window-size L,0): query position p sees keys at p - window .. p; -1: every earlier
    // key (causal only).
    int64_t      window = -1;
    // A key mask on top of the causal and window ones (DeepSeek Sparse Attention's top-k, Ops::dsa_topk_mask):
    // (b, s, s_kv) u8, nonzero where query row i of sequence bi may see key row j; undefined: every key. The keys
    // are whole sequences in position order (k_pos the identity); the queries may be at any positions (context
    // parallelism: this rank's chunks against every rank's keys). A query must keep at least one key.
    Tensor       key_mask;

    int64_t keys() const { return s_kv > 0 ? s_kv : s; }
    // These queries against a K | V tensor of its own (rows of 2 nkv d, K first) holding `keys` rows per sequence.
    AttentionShape against_kv(int64_t keys) const {
        AttentionShape a = *this;
        a.s_kv           = keys;
        a.kv_row_stride  = 2 * nkv * d;
        a.k_col          = 0;
        a.v_col          = nkv * d;
        return a;
    }
    int64_t kv_stride() const { return kv_row_stride > 0 ? kv_row_stride : row_stride; }
    int64_t k_column() const { return k_col >= 0 ? k_col : nq * d; }
    int64_t v_column() const { return v_col >= 0 ? v_col : (nq + nkv) * d; }
};

// A dropout's key (core/dropout.h): which mask to draw. p = 0 is no dropout.
//   hidden (n, w) activations: row r is row offset + r of the rank's (s, b) rows (sequence parallelism
//   holds a block of them), local position (offset + r) / batch, global position positions(that) (context
//   parallelism), batch column (offset + r) % batch;
//   attention probabilities: query head h of the call is head offset + h of the model (tensor parallelism).
struct Dropout {
    float    p      = 0.0f;
    uint64_t seed   = 0;
    uint64_t site   = 0;   // dropout_site(layer, kind)
    Tensor   sample_ids;   // (b) i64, host-readable: each batch column's global sample index; undefined: 0 .. b-1
    int64_t  batch  = 1;
    int64_t  offset = 0;
    SeqPositions positions;   // hidden dropout: the rows' global positions
    bool     enabled() const { return p > 0.0f; }
};

// One AdamW step's scalars (core/host_adam.h's update; step t >= 1 counts this step).
struct AdamStep {
    float   lr;
    float   beta1;
    float   beta2;
    float   eps;
    float   weight_decay;
    int64_t step;
};

// One tensor's AdamW in a multi-tensor step (Ops::adamw_multi): adamw's arguments.
struct AdamwTensors {
    Tensor   master, grad, m, v, out;
    AdamStep step;
};

// ---- Mixture of Experts (model/moe/router.h and model/moe/token_dispatcher.h give the math and layouts)

// How a router turns logits (n, E) into each token's k experts and their probabilities.
struct MoeRouting {
    int64_t experts     = 0;       // E
    int64_t topk        = 0;       // k
    bool    sigmoid     = false;   // --moe-router-score-function sigmoid (else softmax)
    bool    pre_softmax = false;   // softmax over all E before the top-k (softmax only)
    float   scaling     = 1.0f;    // --moe-router-topk-scaling-factor (1 when unset)
    // Group-limited routing (--moe-router-num-groups G, --moe-router-group-topk g; 0: off): the experts fall
    // into G groups of E / G in index order; a token keeps the g groups whose k / g largest selection scores
    // sum highest (ties toward the lower group), and selects its k experts among theirs. G <= kMoeMaxGroups.
    int64_t num_groups  = 0;
    int64_t group_topk  = 0;
};

inline constexpr int64_t kMoeMaxGroups = 64;

// The lanes of Ops::attention_sink_backward's sums (a CUDA block's threads).
inline constexpr int64_t kSinkLanes = 256;

// The gated delta rule's operands (Ops::gated_delta_rule_forward): b sequences of s steps, H heads, keys of dk
// and values of dv; rows (t, bi) as the activations' (row t b + bi).
struct DeltaRuleShape {
    int64_t s = 0, b = 0, heads = 0, dk = 0, dv = 0;
    float   scale = 1.0f;   // the queries' (FLA's default: dk^-1/2)
};
// The backward keeps the state every kDeltaRuleChunk steps and recomputes each chunk's states from it.
inline constexpr int64_t kDeltaRuleChunk = 16;
inline constexpr int64_t kDeltaRuleMaxDim = 256;   // dk and dv at most (a CUDA block's threads)
// The f32 elements of the workspace both passes take: per (sequence, head), the chunks' states, a chunk's
// states and one more state (dk x dv each).
inline int64_t delta_rule_workspace_elements(const DeltaRuleShape & d) {
    const int64_t chunks = (d.s + kDeltaRuleChunk - 1) / kDeltaRuleChunk;
    return d.b * d.heads * (chunks + kDeltaRuleChunk + 1) * d.dk * d.dv;
}

// The load-balancing aux loss and the z-loss of a router (either coefficient 0: that loss is off).
struct MoeRouterLoss {
    int64_t groups    = 1;      // G: 1, or the micro-batch size with seq_aux_loss (row r is in group r % G)
    int64_t tokens    = 0;      // T: the rows of the whole sequence (over a sequence-parallel group)
    float   aux_coeff = 0.0f;   // --moe-aux-loss-coeff
    float   z_coeff   = 0.0f;   // --moe-z-loss-coeff
};

// A dispatch plan over the experts [first, first + experts) (model/moe/token_dispatcher.h): slots whose
// expert is outside that range, or -1, get no row.
struct MoePlanSpec {
    int64_t first         = 0;
    int64_t experts       = 0;
    int64_t capacity      = -1;     // rows an expert keeps at most; -1: no dropping
    bool    padded        = false;  // every expert gets exactly `capacity` rows (padding rows: token -1)
    bool    drop_by_probs = true;   // over capacity, keep the highest probabilities (else the earliest tokens)
};

// A question setup asks a backend before it builds anything: can it run `op` at these sizes? Only the sizes
// some backend limits are asked; 0 where the question does not concern them.
struct OpQuery {
    const char * op       = "";   // an Ops method's name: "attention_forward", "moe_topk", ...
    int64_t      head_dim = 0;    // attention's head dimension
    int64_t      topk     = 0;    // experts a router selects per token
};

struct OpSupport {
    bool        ok = true;
    std::string why;   // when not ok: the op, the size and the backend's limit
};

class Ops {
public:
    virtual ~Ops() = default;

    // Whether this backend runs the query's op at its sizes (every backend runs every op; some bound a
    // size). Model setup asks first, so a run the backend cannot do is refused before anything is
    // allocated, naming the flags; the op itself refuses the same sizes with the same words.
    virtual OpSupport supports(const OpQuery & query) const {
        (void)query;
        return {};
    }

    // ---- GEMM
    // c (m, n) = op(a) op(b), or += with accumulate. op(a) is (m, k): a stored (m, k), or (k, m) with
    // trans_a; op(b) is (k, n): b stored (k, n), or (n, k) with trans_b. a and b are f32 or bf16 (the same),
    // c is f32, or bf16 without accumulate (the f32 accumulator rounded once); the products accumulate in f32.
    virtual void gemm(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b, const Tensor & c,
                      bool accumulate = false) = 0;
    // c (m, n) = op(a) op(b) + bias, bias (n) f32 added to every row: a linear layer's forward with its bias
    // in the GEMM's epilogue where the backend has one. Its contract is gemm followed by bias_add (the CPU
    // runs exactly those two steps, so the bits are theirs); a backend may instead add the bias to the f32
    // accumulator before the store (cuBLASLt's bias epilogue). Into a bf16 c, the bias always joins the f32
    // accumulator before the one rounding. No accumulate: a bias is added once.
    virtual void gemm_bias(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b,
                           const Tensor & c, const Tensor & bias) = 0;
    // An MLP's first linear with its bias and GELU: pre (m, n) = op(a) op(b) + bias (bias optional), kept for
    // backward, and y = gelu(pre); pre and y in the activations' dtype. Its contract is gemm into pre followed
    // by bias_gelu_forward(pre, bias, y) (what this default runs, so the CPU keeps those bits); a backend may
    // run both in the GEMM's epilogue (cuBLASLt's GELU_AUX_BIAS), where gelu reads the f32 sum, not the stored
    // pre, and uses the library's own tanh.
    virtual void gemm_bias_gelu(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b,
                                const Tensor & pre, const Tensor & y, const Tensor & bias) {
        gemm(s, a, trans_a, b, trans_b, pre);
        bias_gelu_forward(s, pre, bias, y, Tensor());
    }
    // The backward of gelu after a GEMM: dx (m, n) = (op(a) op(b)) * gelu'(pre), pre and dx in the activations'
    // dtype. Its contract is gemm into dx followed by gelu_backward(pre, dx, dx) (this default); a backend may
    // apply gelu' in the GEMM's epilogue (cuBLASLt's DGELU) to the f32 product, rounding once.
    virtual void gemm_gelu_backward(Stream & s, const Tensor & a, bool trans_a, const Tensor & b, bool trans_b,
                                    const Tensor & pre, const Tensor & dx) {
        gemm(s, a, trans_a, b, trans_b, dx);
        gelu_backward(s, pre, dx, dx);
    }
    // A linear layer's parameter gradients from its output gradient dy (n, o) and input x (n, in), both of the
    // GEMM operands' dtype: dw (o, in, f32) += dy^T x and dbias (o, f32) += sum_r dy. Its contract is
    // bias_backward(dy, dbias) then gemm(dy^T, x) accumulating into dw (this default); a backend may sum the
    // bias gradient in the GEMM's epilogue (cuBLASLt's BGRADB, over the product's k dimension, in its order).
    virtual void gemm_weight_grad(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & dw,
                                  const Tensor & dbias) {
        bias_backward(s, dy, dbias);
        gemm(s, dy, true, x, false, dw, /*accumulate=*/true);
    }

    // ---- Norms, per row of x (n, h); statistics (n) are f32 and saved for backward.
    // With `residual` defined, x += residual first in the same pass (x then holds the sum).
    virtual void layernorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma,
                                   const Tensor & beta, const Tensor & y, const Tensor & mean, const Tensor & rstd,
                                   float eps) = 0;
    virtual void rmsnorm_forward(Stream & s, const Tensor & x, const Tensor & residual, const Tensor & gamma,
                                 const Tensor & y, const Tensor & rstd, float eps) = 0;
    // dx assigned; dgamma, dbeta (main_grads) added to. With `dresidual` defined (n, h), dx also takes it: the
    // gradient of a residual path around the norm, added in f32 before dx is stored (one pass, one rounding).
    virtual void layernorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma,
                                    const Tensor & mean, const Tensor & rstd, const Tensor & dx, const Tensor & dgamma,
                                    const Tensor & dbeta, const Tensor & dresidual = Tensor()) = 0;
    virtual void rmsnorm_backward(Stream & s, const Tensor & dy, const Tensor & x, const Tensor & gamma,
                                  const Tensor & rstd, const Tensor & dx, const Tensor & dgamma,
                                  const Tensor & dresidual = Tensor()) = 0;

    // ---- Elementwise (activations f32 or bf16; biases f32)
    virtual void bias_add(Stream & s, const Tensor & y, const Tensor & bias) = 0;          // y[r, :] += bias
    virtual void bias_backward(Stream & s, const Tensor & dy, const Tensor & dbias) = 0;   // dbias += sum_r dy
    virtual void add_inplace(Stream & s, const Tensor & y, const Tensor & x) = 0;          // y += x
    // GELU (tanh approximation). Forward fused with the bias: x += bias (bias optional), y = gelu(x); with
    // x_bf16 defined, the biased x is rounded to bf16 there (gelu reads the rounded value), x unchanged.
    virtual void bias_gelu_forward(Stream & s, const Tensor & x, const Tensor & bias, const Tensor & y,
                                   const Tensor & x_bf16) = 0;
    virtual void gelu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) = 0;
    // SwiGLU on x (n, 2f) = [gate | up] -> y (n, f) = silu(gate) * up.
    virtual void swiglu_forward(Stream & s, const Tensor & x, const Tensor & y) = 0;
    virtual void swiglu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) = 0;
    // A gated linear unit on x (n, 2f) = [gate | linear] with GluSpec's activation, clamp and offset (gpt-oss's
    // quick-GEGLU; SwiGLU with a clamp): a = gate, b = linear, clamped to a <= c and -c <= b <= c when c > 0,
    // y = act(a) (b + offset). Backward passes the gradient where the clamp let the value through (c included).
    virtual void glu_forward(Stream & s, const Tensor & x, const Tensor & y, const GluSpec & glu) = 0;
    virtual void glu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx, const GluSpec & glu) = 0;
    // Squared ReLU (--squared-relu), elementwise: y = max(x, 0)^2; dx = dy * 2 max(x, 0).
    virtual void squared_relu_forward(Stream & s, const Tensor & x, const Tensor & y) = 0;
    virtual void squared_relu_backward(Stream & s, const Tensor & x, const Tensor & dy, const Tensor & dx) = 0;
    // Rotary embedding, in place, on the first `heads` heads of dimension d of every (s, b) row of x: the
    // first rotary_dim elements of each head turn (0: all d; --rotary-percent), in pairs (i, i + rotary_dim/2)
    // or, interleaved (--rotary-interleaved), (2i, 2i + 1), pair i by the angle p * base^(-2i / rotary_dim)
    // for the row's global position p = positions(si). With `scaling`, YaRN's frequencies (core/rope.h's
    // rope_inv_freq) and cos and sin times its amplitude. `inverse` applies the transpose (the backward):
    // the opposite angle, the same amplitude (the inverse rotation when the amplitude is 1).
    virtual void rope(Stream & s, const Tensor & x, int64_t seq, int64_t batch, int64_t heads, int64_t d, float base,
                      bool inverse, int64_t rotary_dim = 0, bool interleaved = false,
                      const SeqPositions & positions = {}, const RopeScaling & scaling = {}) = 0;
    // y = x * mask / (1 - p) with the mask of `key` (y may be x). Its own backward: dx = dropout(dy), same key.
    virtual void dropout(Stream & s, const Tensor & x, const Tensor & y, const Dropout & key) = 0;

    // ---- Embedding. tokens (b, s) i32 (-1: another tensor-parallel rank's row: embeds to zero, adds no
    // gradient); wte (V, h) and wpe (P, h, optional) f32 or bf16; out (s * b, h) f32 or bf16. Position si of the
    // tokens reads wpe row positions(si).
    virtual void embedding_forward(Stream & s, const Tensor & tokens, const Tensor & wte, const Tensor & wpe,
                                   const Tensor & out, const SeqPositions & positions = {}) = 0;
    // dwte[token] += dout; dwpe[positions(si)] += dout (dwpe optional).
    virtual void embedding_backward(Stream & s, const Tensor & tokens, const Tensor & dout, const Tensor & dwte,
                                    const Tensor & dwpe, const SeqPositions & positions = {}) = 0;
    // out[i] = ids[i] - begin where begin <= ids[i] < begin + count, else -1 (a vocabulary shard's rows).
    virtual void vocab_shard_ids(Stream & s, const Tensor & ids, int64_t begin, int64_t count, const Tensor & out) = 0;

    // ---- Attention (q, kv, out and their gradients f32 or bf16; lse f32; attention_merge f32), tiled: no s x s
    // matrix. Queries from q's rows, keys and values from kv's (AttentionShape); out (s b, nq d) and lse (b, nq, s) assigned. A query that sees no key of the call
    // gets out 0 and lse -inf (attention_merge then takes the other blocks'). With `dropout` enabled the
    // probabilities are dropped out (after the softmax, before the values) with its mask, drawn by global
    // query and key positions; backward redraws the same mask.
    virtual void attention_forward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out,
                                   const Tensor & lse, const AttentionShape & shape, float scale,
                                   const Dropout & dropout = {}) = 0;
    // From the final out and lse of the queries (over every key block, merged): dq's Q columns (q's layout)
    // and dkv's K and V columns (kv's) get this block's gradients, assigned or, with accumulate, added. dq
    // and dkv may be one tensor (the [Q | K | V] rows); their other columns are untouched.
    virtual void attention_backward(Stream & s, const Tensor & q, const Tensor & kv, const Tensor & out,
                                    const Tensor & dout, const Tensor & lse, const Tensor & dq, const Tensor & dkv,
                                    const AttentionShape & shape, float scale, const Dropout & dropout = {},
                                    bool accumulate = false) = 0;
    // Merges the attention of the same queries over another block of keys into (out, lse), in place:
    // lse' = log(e^lse + e^part_lse), out' = out e^(lse - lse') + part_out e^(part_lse - lse'). out and
    // part_out (s b, nq d), lse and part_lse (b, nq, s) f32 of shape's queries; a query whose part_lse is
    // -inf (it saw no key of that block) keeps its out and lse.
    virtual void attention_merge(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & part_out,
                                 const Tensor & part_lse, const AttentionShape & shape) = 0;

    // Attention sinks (--softmax-type learnable or off-by-one): one logit per query head, sink (nq) f32, joins
    // every query's softmax with a zero value. On the final (out, lse) of shape's queries (every key block
    // merged), in place: lse' = log(e^lse + e^sink[h]), out *= e^(lse - lse') (out f32 or bf16, lse f32).
    virtual void attention_sink_forward(Stream & s, const Tensor & out, const Tensor & lse, const Tensor & sink,
                                        const AttentionShape & shape) = 0;
    // With that final out and lse', attention_backward gives the queries', keys' and values' gradients as they
    // are. This adds the sink's into dsink (nq) f32: dsink[h] += -sum over (b, i) of e^(sink[h] - lse'[b, h, i])
    // rowsum(dout * out)[i, b, h], the terms summed in kSinkLanes strided lanes (lane k: entries k, k + lanes,
    // ... in (b, i) order), then the lanes in order, on every backend.
    virtual void attention_sink_backward(Stream & s, const Tensor & out, const Tensor & dout, const Tensor & lse,
                                         const Tensor & sink, const Tensor & dsink, const AttentionShape & shape) = 0;

    // The plain causal attention of [Q | K | V] rows: q and kv are the same tensor.
    void attention_forward(Stream & s, const Tensor & qkv, const Tensor & out, const Tensor & lse,
                           const AttentionShape & shape, float scale, const Dropout & dropout = {}) {
        attention_forward(s, qkv, qkv, out, lse, shape, scale, dropout);
    }
    void attention_backward(Stream & s, const Tensor & qkv, const Tensor & out, const Tensor & dout,
                            const Tensor & lse, const Tensor & dqkv, const AttentionShape & shape, float scale,
                            const Dropout & dropout = {}) {
        attention_backward(s, qkv, qkv, out, dout, lse, dqkv, dqkv, shape, scale, dropout, false);
    }

    // ---- Cross-entropy over logits (n, stride), f32 or bf16, whose first `vocab` columns are real tokens;
    // labels (b, s) i32 read in (s, b) row order (-1: the label is on another rank's shard). Forward: loss[r],
    // lse[r] (f32).
    // Backward in place: logits become (softmax - onehot) * dloss[r], exactly 0 on the padding.
    virtual void cross_entropy_forward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & loss,
                                       const Tensor & lse, int64_t vocab) = 0;
    virtual void cross_entropy_backward(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & lse,
                                        const Tensor & dloss, int64_t vocab) = 0;
    // Vocabulary-parallel pieces over the first `valid` columns: each row's max; its sum of exp(x - max);
    // the label's logit (0 where the label is -1); lse = max + log(sum) and loss = lse - target.
    virtual void row_max(Stream & s, const Tensor & logits, int64_t valid, const Tensor & out) = 0;
    virtual void row_sum_exp(Stream & s, const Tensor & logits, const Tensor & max, int64_t valid,
                             const Tensor & out) = 0;
    virtual void label_logit(Stream & s, const Tensor & logits, const Tensor & labels, const Tensor & out) = 0;
    virtual void lse_and_loss(Stream & s, const Tensor & max, const Tensor & sum, const Tensor & target,
                              const Tensor & lse, const Tensor & loss) = 0;
    // dloss[r] = mask[(b, s) of row r] * scale, rows in (s, b) order; mask (b, s) f32.
    virtual void loss_grad(Stream & s, const Tensor & mask, double scale, const Tensor & dloss) = 0;

    // ---- Data movement and reductions
    // dst = src converted (f32, bf16, f16), same numel.
    virtual void convert(Stream & s, const Tensor & src, const Tensor & dst) = 0;
    // x rounded to bf16 in place and its bf16 bits written to x_bf16: afterwards they hold the same values.
    virtual void round_to_bf16(Stream & s, const Tensor & x, const Tensor & x_bf16) = 0;
    // Copies src into dst (same dtype and numel), between any memory kinds of the device.
    virtual void copy(Stream & s, const Tensor & src, const Tensor & dst) = 0;
    // dst[r, dst_col .. dst_col + width) = src[r, src_col .. src_col + width) for every row r of two 2-D
    // tensors of one dtype and row count (a block of columns between row-strided layouts).
    virtual void copy_columns(Stream & s, const Tensor & src, int64_t src_col, const Tensor & dst, int64_t dst_col,
                              int64_t width) = 0;
    virtual void fill_zero(Stream & s, const Tensor & t) = 0;
    // In place: t = t * factor in f32, rounded back to t's dtype (f32, bf16 or f16).
    virtual void scale(Stream & s, const Tensor & t, float factor) = 0;
    // out (2) f32 = the sum of the squares of x (f32) as a pair: out[0] is the sum rounded to f32, out[1]
    // the rest (out[0] + out[1] equals the double sum to about 1e-14). The sum is taken in double over
    // fixed chunks added in order, so its bits do not depend on the thread count.
    virtual void sum_of_squares(Stream & s, const Tensor & x, const Tensor & out) = 0;
    // In place: t (f32) = t * inv in f32, where inv = float(1 / max(sqrt(double(sums[0]) + sums[1]), eps)) is
    // read on the device from sum_of_squares' pair: a tensor divided by its norm with no host read (Muon's
    // Newton-Schulz, optim/muon.h).
    virtual void scale_by_inverse_norm(Stream & s, const Tensor & t, const Tensor & sums, double eps) = 0;

    // ---- FP8 (core/fp8.h), tensorwise current scaling
    // amax = the largest |x| (compared as bit patterns: deterministic, a NaN the largest), s =
    // fp8_scale_from_amax(amax, format), q = the FP8 values of x * s (each exact in bf16), scale_inv[0] = 1 / s.
    // x is f32 or bf16, q bf16 of x's numel, scale_inv (1) f32: all on the device, no host read.
    virtual void fp8_quantize(Stream & s, const Tensor & x, Fp8Format format, const Tensor & q, const Tensor & scale_inv) = 0;
    // --fp8-param-gather's weights, kept as FP8 codes (ddp/ddp.h): amax (1) f32 = the larger of amax[0] and the
    // largest |x| (x f32 or bf16), compared as bit patterns as fp8_quantize does; several calls fold a tensor's
    // pieces into one amax.
    virtual void fp8_amax(Stream & s, const Tensor & x, const Tensor & amax) = 0;
    // codes (u8) = the FP8 codes of x * s, s = fp8_scale_from_amax(amax[0], format) (x f32 of codes' numel), and
    // scale_inv[0] = 1 / s: fp8_quantize with the amax given, its codes kept instead of their values.
    virtual void fp8_encode(Stream & s, const Tensor & x, Fp8Format format, const Tensor & amax, const Tensor & codes,
                            const Tensor & scale_inv) = 0;
    // q (bf16) = the values of FP8 codes (each exact in bf16): a GEMM operand as fp8_quantize's q.
    virtual void fp8_decode(Stream & s, const Tensor & codes, Fp8Format format, const Tensor & q) = 0;
    // --fp8-recipe delayed: q = the FP8 values of x * s with the s given (scale[0], f32: an earlier amax's,
    // model/fp8_delayed.h; values past the format's largest saturate), scale_inv[0] = 1 / s.
    virtual void fp8_quantize_scaled(Stream & s, const Tensor & x, Fp8Format format, const Tensor & scale, const Tensor & q,
                                     const Tensor & scale_inv) = 0;
    // Delayed scaling's update of n operands (Transformer Engine's amax history and scale update): history (len, n)
    // f32 row 0 holds each operand's amax since the last update. For each operand: amax = the largest of its
    // column (max_algo) or row 0 (most_recent); scale[j] = fp8_delayed_scale(amax, scale[j], format, margin);
    // then the column rolled one row up (row 0 to row len - 1) and row 0 cleared.
    virtual void fp8_delayed_update(Stream & s, const Tensor & history, const Tensor & scale, Fp8Format format,
                                    int margin, bool max_algo) = 0;
    // --fp8-recipe blockwise: x (rows, cols; f32 or bf16) in blocks of block_rows x block_cols (the last ones
    // partial), each cast by its own power-of-two scale s = fp8_scale_from_amax(block amax, format, pow2) and
    // scaled back: q (bf16, x's shape) = fp8_round(x s) / s, exact in bf16. A GEMM of such operands with f32
    // accumulation is the block-scaled FP8 GEMM (each product of two FP8 values is exact in f32). With `mx`
    // (--fp8-recipe mxfp8) s is MXFP8's E8M0 rule instead, mxfp8_block_scale(block amax, format).
    virtual void fp8_quantize_blocks(Stream & s, const Tensor & x, Fp8Format format, int64_t block_rows, int64_t block_cols,
                                     const Tensor & q, bool mx) = 0;
    // In place: t (f32) *= 1 / d[0] (the reciprocal rounded to f32, then the product: scale's arithmetic with a
    // factor the stream holds, as a running mean over replayed graphs needs).
    virtual void scale_by_reciprocal(Stream & s, const Tensor & t, const Tensor & d) = 0;
    // In place: t (f32) *= a[0] * b[0] (the product in f32): a GEMM of quantized operands scaled back.
    virtual void scale_by_product(Stream & s, const Tensor & t, const Tensor & a, const Tensor & b) = 0;
    // sum_of_squares of each xs[i] into out[2 i .. 2 i + 1] (out: 2 xs.size() f32). Its contract is that loop
    // (this default); a backend may run many tensors in one launch, each pair with sum_of_squares' bits.
    virtual void sum_of_squares_multi(Stream & s, std::span<const Tensor> xs, const Tensor & out) {
        for (size_t i = 0; i < xs.size(); ++i) sum_of_squares(s, xs[i], out.slice(static_cast<int64_t>(2 * i), {2}));
    }

    // ---- Mixture of Experts. Router: logits (n, E) f32; top_idx (n, k) i32; probs (n, k) f32.
    // Each token's k experts by descending score (ties toward the lower expert) and their probabilities.
    // expert_bias (E) f32, or no tensor: aux-loss-free balancing (sigmoid only), selecting by sigmoid(logit) +
    // bias while the probabilities stay the unbiased scores'.
    virtual void moe_topk(Stream & s, const Tensor & logits, const MoeRouting & routing, const Tensor & expert_bias,
                          const Tensor & top_idx, const Tensor & probs) = 0;
    // Megatron's sinkhorn routing while training (--moe-router-load-balancing-type sinkhorn): the k experts
    // of rows [first, first + n) of logits (N, E) f32 by descending sinkhorn(logits) over all N rows (ties
    // toward the lower expert), and their probabilities from the same rows' logits as moe_topk gives them
    // with `routing` (sigmoid for k = 1, a softmax over all E for k > 1, as the caller sets it). sinkhorn
    // alternates d0 = 1/N / (C d1 + 1e-8) and d1 = 1/E / (C^T d0 + 1e-8) over C = exp(logits), from ones,
    // until the mean |change of d1| is at most 1e-4; the scores are d0_x C_xe d1_e.
    virtual void moe_sinkhorn_topk(Stream & s, const Tensor & logits, int64_t first, const MoeRouting & routing,
                                   const Tensor & top_idx, const Tensor & probs) = 0;
    // counts (G, E) f32: per aux-loss group, the tokens whose top-k of the aux scores holds each expert
    // (whole numbers; f32 so that global_aux_loss can pass their running mean over micro-batches).
    virtual void moe_aux_counts(Stream & s, const Tensor & logits, const MoeRouting & routing, int64_t groups,
                                const Tensor & counts) = 0;
    // losses (4) f32: aux, aux / aux_coeff, z, z / z_coeff (model/moe/router.h's RouterLoss), this rank's
    // share; counts (G, E) f32 as moe_aux_counts gave them (summed over a sequence-parallel group, or
    // global_aux_loss's mean).
    virtual void moe_router_losses(Stream & s, const Tensor & logits, const Tensor & counts, const MoeRouting & routing,
                                   const MoeRouterLoss & loss, const Tensor & losses) = 0;
    // dlogits (n, E) f32 assigned: from dprobs (n, k) and loss_scale times the aux and z gradients.
    virtual void moe_router_backward(Stream & s, const Tensor & logits, const Tensor & top_idx, const Tensor & dprobs,
                                     const Tensor & counts, const MoeRouting & routing, const MoeRouterLoss & loss,
                                     float loss_scale, const Tensor & dlogits) = 0;
    // Aux-loss-free balancing's bookkeeping. load (E) f32 += tokens_per_expert (E) i64 (a dispatch plan's).
    virtual void moe_count_tokens(Stream & s, const Tensor & tokens_per_expert, const Tensor & load) = 0;
    // A shared expert's gate (--moe-shared-expert-gate), f32: y (n, h) row r times sigmoid(logits[r]), in place
    // (sigmoid(v) = 1 / (1 + e^-v) in f32). Backward from dy and the ungated m (both (n, h)): dm = dy sigmoid(logit)
    // (dm may be dy), dlogits[r] = (sum over j of dy m, in j order) s (1 - s).
    virtual void sigmoid_gate_forward(Stream & s, const Tensor & y, const Tensor & logits) = 0;
    virtual void sigmoid_gate_backward(Stream & s, const Tensor & dy, const Tensor & m, const Tensor & logits, const Tensor & dm,
                                       const Tensor & dlogits) = 0;
    // The gated delta rule (Qwen3-Next's gated delta-net; the recurrent form of Flash Linear Attention's
    // chunk_gated_delta_rule), f32. For each sequence and head, from the state S = 0 (dk x dv), step t:
    //   S~ = e^(g_t) S;   u_t = beta_t (v_t - S~^T k_t);   S = S~ + k_t u_t^T;   o_t = S^T (scale q_t)
    // q, k (n, H dk), v and o (n, H dv), g (log decays) and beta (n, H), with n = s b. Every sum runs in index
    // order in f32 on every backend (each CUDA thread owns a column or a row of S), so the backends agree to the
    // bit where their exp does. workspace: delta_rule_workspace_elements f32.
    virtual void gated_delta_rule_forward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                          const Tensor & beta, const Tensor & o, const Tensor & workspace,
                                          const DeltaRuleShape & shape) = 0;
    // Backward from dout (like o): dq, dk, dv, dg and dbeta (like their operands) assigned. The states come back
    // from the inputs: the forward's again, kept every kDeltaRuleChunk steps, each chunk's recomputed in reverse.
    virtual void gated_delta_rule_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & v, const Tensor & g,
                                           const Tensor & beta, const Tensor & dout, const Tensor & dq, const Tensor & dk,
                                           const Tensor & dv, const Tensor & dg, const Tensor & dbeta,
                                           const Tensor & workspace, const DeltaRuleShape & shape) = 0;
    // The gated delta-net's short convolution (Megatron's causal_conv1d with SiLU, no bias), f32: depthwise and
    // causal over each sequence's steps. For channel c at step t, with x before step 0 taken as 0:
    //   pre = sum over j < K of w[c, j] x[t - K + 1 + j, c] (j in order);   y = pre / (1 + e^-pre)
    // x, y (n, C) with rows (t, bi) as the activations'; w (C, K). Backward from dy: dx assigned, and dw +=
    // the sum over the rows, in row order, of dpre x; pre is recomputed, not kept.
    virtual void causal_conv_silu_forward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & y, int64_t seq,
                                          int64_t batch) = 0;
    virtual void causal_conv_silu_backward(Stream & s, const Tensor & x, const Tensor & w, const Tensor & dy, const Tensor & dx,
                                           const Tensor & dw, int64_t seq, int64_t batch) = 0;
    // An output gate: y (n, w) = x * act(g) elementwise, in f32 and rounded to y's dtype, where g is columns
    // [gate_col, gate_col + w) of src's rows. x, y, src in the activations' dtype (f32 or bf16). act is sigmoid (the
    // attention's --attention-output-gate, Megatron's _apply_output_gate; g the QKV projection's gate columns) or
    // SiLU, g sigmoid(g) (the gated delta-net's gated norm; g its input projection's z columns). Backward, each in
    // f32 and rounded: dx = dy act(g) (dx may be dy) and dgate (n, w) = (dy x) act'(g), with sigmoid' = s (1 - s)
    // and SiLU' = s (1 + g (1 - s)), s = sigmoid(g).
    virtual void output_gate_forward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & y,
                                     GateActivation act) = 0;
    virtual void output_gate_backward(Stream & s, const Tensor & x, const Tensor & src, int64_t gate_col, const Tensor & dy,
                                      const Tensor & dx, const Tensor & dgate, GateActivation act) = 0;
    // The L2 norm of each row of x (rows, d), f32 (the gated delta-net's queries and keys, FLA's l2norm):
    //   rstd = 1 / sqrt(sum of x_i^2 in i order + eps),   y = x rstd
    // rstd (rows) f32 is kept for backward: dx = rstd (dy - y (sum of dy_i y_i in i order)).
    virtual void l2norm_forward(Stream & s, const Tensor & x, const Tensor & y, const Tensor & rstd, float eps) = 0;
    virtual void l2norm_backward(Stream & s, const Tensor & dy, const Tensor & y, const Tensor & rstd, const Tensor & dx) = 0;
    // The gated delta-net's per-head gates (Megatron's GatedDeltaNet._compute_gates), f32, from src's columns
    // [col, col + H) (b) and [col + H, col + 2 H) (a) of each row (the input projection's, in the activations' dtype):
    //   beta = sigmoid(b),   g = -e^(A_log) softplus(a + dt_bias)       (softplus(x) = x above 20, as torch's)
    // a_log, dt_bias (H) f32; g, beta (n, H) f32. Backward from dg and dbeta: dsrc (n, 2 H) in src's dtype assigned
    // ([db | da]), and the sums over the rows, in row order, of da (into ddt_bias) and of dg g (into da_log) added.
    virtual void gdn_gates_forward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                                   const Tensor & g, const Tensor & beta) = 0;
    virtual void gdn_gates_backward(Stream & s, const Tensor & src, int64_t col, const Tensor & a_log, const Tensor & dt_bias,
                                    const Tensor & dg, const Tensor & dbeta, const Tensor & dsrc, const Tensor & da_log,
                                    const Tensor & ddt_bias) = 0;
    // DeepSeek Sparse Attention's indexer (model/dsa_indexer.h), f32, over one micro-batch's rows (row i b + bi is
    // query row i of sequence bi, as the activations'), the queries at positions q_pos (context parallelism: this
    // rank's two chunks; by default 0 .. s-1) against the keys of whole sequences in position order (S = k's rows / b;
    // key row j b + bi is position j). q (s b, H d), k (S b, d), w (s b, H); scores (b, s, S):
    //   z[i, h, j] = q[r_i, h] . k[r_j] (d order),  scores[bi, i, j] = sum over h in order of w[r_i, h] relu(z)
    // for keys j <= q_pos(i) (without `relu`, z itself), -inf for later keys.
    virtual void dsa_index_scores(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w, int64_t seq,
                                  int64_t batch, bool relu, const Tensor & scores, const SeqPositions & q_pos = {}) = 0;
    // Backward from dscores (b, s, S), read for j <= q_pos(i) only: dq, dk, dw (like q, k, w) assigned,
    //   dw[r_i, h] = sum over j <= q_pos(i) of dscores relu(z),   dz = dscores w[r_i, h] relu'(z)   (relu' 1 for z > 0)
    //   dq[r_i, h] = sum over j <= q_pos(i) of dz k[r_j],   dk[r_j] = sum over rows i with q_pos(i) >= j, then h, of
    //   dz q[r_i, h]
    // every sum in index order (under context parallelism dk holds this rank's queries' share of every key's).
    virtual void dsa_index_scores_backward(Stream & s, const Tensor & q, const Tensor & k, const Tensor & w,
                                           const Tensor & dscores, int64_t seq, int64_t batch, bool relu,
                                           const Tensor & dq, const Tensor & dk, const Tensor & dw,
                                           const SeqPositions & q_pos = {}) = 0;
    // The top `k` keys of each query row by the indexer's scores (b, s, S) f32 (rows at positions q_pos, keys in
    // position order): mask (b, s, S) u8 gets 1 at the keys j <= q_pos(i) of row (bi, i) that fewer than k other
    // keys j' <= q_pos(i) outrank, 0 elsewhere, where j' outranks j when scores[j'] > scores[j], or they are equal
    // and j' < j (ties to the earlier key). A row with at most k causal keys keeps them all.
    virtual void dsa_topk_mask(Stream & s, const Tensor & scores, int64_t k, const Tensor & mask,
                               const SeqPositions & q_pos = {}) = 0;
    // The indexer's target: the causal attention probabilities of the packed [Q | K | V] query rows at positions
    // shape.q_pos against the keys of `kv` (undefined: q_k_v's own rows) in position order (shape.keys() of them,
    // k_pos the identity; shape's nq = nkv heads of d, no window), summed over the heads: for keys j <= q_pos(i),
    //   target[bi, i, j] = sum over h in order of softmax over j' <= q_pos(i) of (scale q_h(i) . k_h(j'))
    // (f32, the exponentials' sum in key order), 0 for later keys; target (b, s, S). With shape.key_mask (the sparse
    // loss) both the softmax and the target keep only the keys the mask holds.
    virtual void dsa_attention_target(Stream & s, const Tensor & q_k_v, const AttentionShape & shape, float scale,
                                      const Tensor & target, const Tensor & kv = {}) = 0;
    // The indexer's KL loss and its gradient, per row (bi, i) over keys j <= q_pos(i): with T = target / max(sum of
    // target, 1e-10) and p = softmax(scores) (f32, sums in key order),
    //   kl[bi s + i] = weight * sum over j of T (log max(T, 1e-10) - log p),   dscores = weight (p - T)
    // (dscores 0 for later keys). scores, target, dscores (b, s, S); kl (b s) f32. With `mask` (b, s, S) u8 defined
    // (the sparse loss) the keys it does not hold leave both softmaxes and the sums, and take dscores 0.
    virtual void dsa_indexer_loss(Stream & s, const Tensor & scores, const Tensor & target, float weight,
                                  const Tensor & kl, const Tensor & dscores, const Tensor & mask = {},
                                  const SeqPositions & q_pos = {}) = 0;
    // For every row r of load and bias (R, E) f32: bias[r, e] += rate * sign(mean over e of load[r] - load[r, e])
    // (sign 0 at 0; the mean in double), then load = 0. Megatron's get_updated_expert_bias.
    virtual void moe_expert_bias_update(Stream & s, const Tensor & load, const Tensor & bias, float rate) = 0;
    // Dispatch plan for expert_of (n, k) i32 and probs (n, k) f32: plan_probs (n, k) f32 (0 where no row),
    // row_of (n, k) i32 (-1: no row), token_of_row (rows_max) i32 (-1: padding or unused), tokens_per_expert
    // (experts) i64.
    virtual void moe_plan(Stream & s, const Tensor & expert_of, const Tensor & probs, const MoePlanSpec & spec,
                          const Tensor & plan_probs, const Tensor & row_of, const Tensor & token_of_row,
                          const Tensor & tokens_per_expert) = 0;
    // expert_of (n, k) i32: the expert of each slot's row, -1 where it has none (rows are expert-major).
    virtual void moe_plan_experts(Stream & s, const Tensor & row_of, const Tensor & tokens_per_expert,
                                  const Tensor & expert_of) = 0;
    // out (r, h) = x[index[r]] for each r (zero where index[r] is -1): x (m, h) f32, index (r) i32.
    virtual void moe_gather_rows(Stream & s, const Tensor & x, const Tensor & index, const Tensor & out) = 0;
    // dst (n, h) = sum over j of weights[t, j] * src[row_of[t, j]] (weights undefined: 1), slots in order,
    // from zero; slots without a row add nothing. src (rows, h) f32, row_of (n, k) i32.
    virtual void moe_combine(Stream & s, const Tensor & src, const Tensor & row_of, const Tensor & weights,
                             const Tensor & dst) = 0;
    // moe_combine's backward with weights: dsrc[row_of[t, j]] = weights[t, j] dy[t] (0 on rows no slot
    // has); dweights[t, j] = <dy[t], src[row_of[t, j]]> (0 without a row).
    virtual void moe_combine_backward(Stream & s, const Tensor & dy, const Tensor & src, const Tensor & weights,
                                      const Tensor & row_of, const Tensor & token_of_row, const Tensor & dsrc,
                                      const Tensor & dweights) = 0;

    // ---- Optimizer
    // AdamW on n elements: master (f32), m and v updated in place from grad (f32, all n elements); with
    // `out` defined (n elements, bf16 or f32), the updated master is also written there in out's dtype.
    virtual void adamw(Stream & s, const Tensor & master, const Tensor & grad, const Tensor & m, const Tensor & v,
                       const Tensor & out, const AdamStep & step) = 0;
    // adamw on each entry, in order (the entries' tensors are disjoint). Its contract is that loop (this
    // default); a backend may run many entries in one launch, each element's arithmetic unchanged (the bits
    // of adamw).
    virtual void adamw_multi(Stream & s, std::span<const AdamwTensors> entries) {
        for (const AdamwTensors & e : entries) adamw(s, e.master, e.grad, e.m, e.v, e.out, e.step);
    }
    // The gradient norm's decision on the stream (core/grad_norm_gate.h's grad_norm_verdict of `pairs`, f32,
    // laid out as `g` says): gate (f32, 2) <- {clip factor, 1 if the optimizer steps else 0}, norm (f64, 1)
    // <- the norm. No host reads anything: adamw_multi_gated reads the gate.
    virtual void grad_norm_gate(Stream & s, const Tensor & pairs, const GradNormGate & g, const Tensor & gate,
                                const Tensor & norm) = 0;
    // adamw_multi decided on the device: where gate[1] (f32) is 0 nothing is written; else each entry's grad
    // is first multiplied in place by gate[0] (the clip factor; the same bits as Ops::scale), then adamw_multi.
    virtual void adamw_multi_gated(Stream & s, std::span<const AdamwTensors> entries, const Tensor & gate) = 0;
};

}  // namespace loom
