// The building blocks of a GPT layer (model/transformer_layer.h composes them; the MoE layer in
// model/moe/ uses them too), each with explicit forward(ctx, x) -> y and backward(ctx, dy) -> dx (no autograd).
//
// A Context holds what one (layer, microbatch) saves for its backward; the caller owns it, so a pipeline
// schedule can keep several microbatches in flight. backward() ADDS weight gradients into main_grad and
// then reports each parameter ready through `ready`, in the order its gradient becomes final.
//
// Activations are (s * b, width) row-major with rows in Megatron's (s, b) order.
// Legend: n = s * b rows, h hidden, f ffn hidden, a heads, g query groups, d head dim.
//
// Precision. With f32 parameters everything is f32. With bf16 parameters (--bf16):
//   - every GEMM reads bf16 operands (weights, the layer input, the output gradient) and accumulates in
//     f32 into an f32 result; weight gradients accumulate into main_grad (f32, or rounded into a bf16
//     buffer with --grad-reduce-in-bf16: model::accumulate_grads);
//   - every activation saved for backward that a GEMM or attention reads is kept in bf16 (the linear
//     inputs, the attention's q/k/v, the MLP's pre-activation); where forward also computes from it, the
//     f32 value is first rounded to bf16 so forward and backward see the same numbers;
//   - norms, softmax and the loss compute in f32 with f32 statistics, and the residual stream between
//     layers stays f32 (Megatron's --fp32-residual-connection): on a CPU the elementwise passes are
//     bandwidth-bound either way, and an f32 residual keeps the bf16 run closest to the f32 one.
#pragma once

#include "comm/communicator.h"
#include "core/dropout.h"
#include "core/ops.h"
#include "model/fp8_delayed.h"
#include "model/gpt_config.h"
#include "model/parameter.h"

#include <map>
#include <memory>
#include <optional>
#include <vector>

namespace loom::model {

// Refuses, naming `flags`, a size the device's backend cannot run (Ops::supports), before anything is built.
void require_supported(Device & device, const OpQuery & query, const char * flags);
// Multi-latent attention's RoPE (core/rope.h): YaRN's scaling with --rope-type yarn (MLA's default), else none.
// The DSA indexer's RoPE takes the same.
RopeScaling mla_rope(const GptConfig & c);
// Allocates an activation (rows, cols) of `dtype` (f32 unless given: statistics, losses, MoE's routing)
// from the "activations" pool.
Tensor activation(Device & device, int64_t rows, int64_t cols, DType dtype = DType::f32);
// x in `dtype`: x itself when it already has it, else a converted copy from the "activations" pool.
Tensor in_dtype(const Tensor & x, DType dtype);
// Where an f32 op writes what belongs in t: t itself when it is f32, else an f32 tensor of its shape from the
// "activations" pool (the caller converts it into t).
Tensor f32_output_for(const Tensor & t);
// What backward keeps of an activation x in the parameters' `dtype`: x itself when it has that dtype (f32,
// or bf16 activations); for an f32 x and bf16, x is rounded to bf16 in place and its bf16 twin returned;
// for f16, a rounded copy.
Tensor keep_for_backward(Tensor & x, DType dtype);

// Tensor parallelism of the layers: the TP group (null: none) and this rank's place in it. Column-parallel
// linears split their output features (their input gradient is summed over the group), row-parallel ones
// their input features (their output is summed over the group before the bias); attention splits heads
// and query groups, the MLP its hidden features, the embedding and output layer the vocabulary.
//
// Sequence parallelism (--sequence-parallel): between the column- and row-parallel pairs each rank holds
// its block of n / tp rows (rows are (s, b) ordered, so a block is a range of positions). A column-
// parallel linear all-gathers its input rows and reduce-scatters its input gradient; a row-parallel one
// reduce-scatters its output (in place of the all-reduce) and all-gathers its output gradient. Norms and
// the residual stream work on the rows of this rank, so their parameters' gradients (and the row-parallel
// biases') are partial sums over rows: they are marked sequence_parallel and the trainer sums them over
// the group.
struct TensorParallel {
    std::shared_ptr<comm::Communicator> group;
    int                                 rank = 0, size = 1;
    bool                                sequence_parallel = false;

    // --tp-comm-overlap: the sequence-parallel linears (Linear) move their rows around the group's ring one
    // block at a time on a stream of their own ("tp-comm"), each block's GEMM running beside the next block's
    // transfer, and a column-parallel backward's reduce-scatter of the input gradient runs beside the weight
    // gradient's GEMM. Null: each collective whole on the compute stream, then its GEMM.
    // At most one transfer is in flight at a time (the compute stream waits for each before the next is
    // issued), so one `done` event serves them all: a wait reads the record before it.
    struct Streams {
        std::unique_ptr<Stream> stream;
        std::unique_ptr<Event>  ready, done;
        explicit Streams(Device & device);
    };
    std::shared_ptr<Streams> overlap;

    bool sp() const { return sequence_parallel && size > 1; }
    // Whether the sequence-parallel linears run their rings (--tp-comm-overlap with sequence parallelism).
    bool rings() const { return overlap != nullptr && sp(); }
    // Sums t over the group in place (nothing without TP).
    void all_reduce(const Tensor & t) const;
    // (n, w) rows -> this rank's block of n / size rows, summed over the group.
    Tensor reduce_scatter(const Tensor & t) const;
    // This rank's block (n / size, w) -> all n rows, in rank order.
    Tensor all_gather(const Tensor & t) const;
    // Marks a parameter every TP rank holds whole: only rank 0's copy counts in the grad norm; with
    // sequence parallelism its gradient (from this rank's rows) is also summed over the group.
    void replicated(Parameter & p) const {
        p.tp_duplicate      = rank != 0;
        p.sequence_parallel = sp();
    }
};

// Context parallelism (--context-parallel-size): the CP group (null: none) and this rank's place in it. The
// sequence is cut in 2 CP chunks and rank r holds chunks r and 2 CP - 1 - r: an early and a late chunk, so
// every rank has the same share of causal attention's work. Everything but attention is per position; the
// kernels read each row's global position (core/positions.h), so dropout masks, rotary angles and learned
// position embeddings are the single-rank run's.
struct ContextParallel {
    std::shared_ptr<comm::Communicator> group;
    int                                 rank = 0, size = 1;
    std::vector<CpCommType>             comm_types{CpCommType::p2p};   // one, or one per layer
    // The TP x CP ranks (Megatron's tp_cp group): with sequence parallelism, every rank holding rows of this
    // rank's sequences (the MoE router sums its balancing counts there). Null without CP.
    std::shared_ptr<comm::Communicator> tp_cp;
    // a2a+p2p (--hierarchical-context-parallel-sizes inner outer): CP rank r = i + o inner, in the inner
    // group of consecutive CP ranks (the heads' all-to-all) and the outer group of every inner group's i-th
    // rank (the ring). Null without a2a+p2p.
    std::shared_ptr<comm::Communicator> inner, outer;
    // The ring's transfers run on their own stream ("cp-comm", with its two events), overlapped with the
    // attention of the block in hand; null: on the compute stream, in line (as inside a graph capture).
    struct Streams {
        std::unique_ptr<Stream> stream;
        std::unique_ptr<Event>  ready, done;
        explicit Streams(Device & device);
    };
    std::shared_ptr<Streams> streams;

    bool enabled() const { return size > 1; }
    // Rank r's positions for a local sequence of s_local = 2 chunks (identity without CP).
    SeqPositions positions(int64_t s_local, int r) const {
        if (size == 1) return {};
        const int64_t chunk = s_local / 2;
        return {r * chunk, chunk, (2 * static_cast<int64_t>(size) - 1 - r) * chunk};
    }
    SeqPositions positions(int64_t s_local) const { return positions(s_local, rank); }
    CpCommType   comm_type(int64_t layer) const {
        return comm_types.size() == 1 ? comm_types[0] : comm_types.at(static_cast<size_t>(layer));
    }
};

// A row block of columns for the all-to-all of heads: CP rank j's share is columns [base + j w, base + (j + 1) w).
struct HeadColumns {
    int64_t base, width;
};

// The all-to-all of heads over the whole CP group (--cp-comm-type a2a, and the gated delta-net under CP), with the
// rows in position order: this rank's local rows (s b, every head, f32) <-> the whole sequence's rows (S b, S = CP s)
// of this rank's share of the heads, the `columns` blocks' shares side by side. A rank's rows are its two chunks.
// sequence_to_heads writes this rank's rows into the blocks' columns of `local` (f32).
Tensor heads_to_sequence(const ContextParallel & cp, const Tensor & local, int64_t s, int64_t b,
                         const std::vector<HeadColumns> & columns);
void   sequence_to_heads(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b,
                         const std::vector<HeadColumns> & columns, const Tensor & local);

// Every CP rank's local rows side by side (CP blocks of s b rows in rank order, as an all-gather leaves them) <-> the
// whole sequences' rows in position order (S b, S = CP s), any width and dtype.
Tensor ranks_to_sequence(const ContextParallel & cp, const Tensor & ranks, int64_t s, int64_t b);
Tensor sequence_to_ranks(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b);
// This rank's rows (s b, w) gathered from every CP rank into the whole sequences' rows in position order (S b, w), and
// the transpose: each rank's share of every row's gradient (S b, w), summed over the group onto this rank's rows.
Tensor gather_sequence(const ContextParallel & cp, const Tensor & local, int64_t s, int64_t b);
Tensor reduce_scatter_sequence(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b);

// What a micro-batch's dropout masks are drawn from (core/dropout.h): the global sample index of each of
// its b columns (i64, host-readable; undefined: 0 .. b-1), whether it trains (evaluation drops nothing),
// and its rows' global positions (context parallelism).
struct DropoutBatch {
    Tensor       sample_ids;   // (b)
    int64_t      b        = 1;
    bool         training = true;
    SeqPositions positions;
    // And one more per-forward record beside the keys: the selections of DSA's layers that compute their own top-k,
    // by layer index, for the layers that share them (--dsa-indexer-topk-freq > 1); null: nothing shared.
    std::map<int64_t, Tensor> * dsa_topk = nullptr;
    bool                        recompute = false;   // full recompute's rerun of a forward in backward
};

// The key of the dropout `kind` of layer `layer` (-1: the embedding) over hidden (rows, w) activations of
// this rank (its sequence-parallel block of rows) or over its attention heads; disabled when p is 0 or
// the batch does not train.
Dropout dropout_key(const GptConfig & config, const TensorParallel & tp, const DropoutBatch & batch, int64_t layer,
                    DropoutKind kind, int64_t rows = 0, int64_t heads = 0);

// Sets p's tensor-parallel slice: dim 0 (rows) or 1 (columns) of `full_shape`, the given ranges.
void set_tp_slice(Parameter & p, int dim, std::vector<std::pair<int64_t, int64_t>> ranges, Shape full_shape);

class Linear {
public:
    enum class Split { none, column, row };

    // y (n, out) = x (n, in) W^T + bias;  W (out, in).
    // in, out: this rank's sizes (the local shard's). With a split, the caller sets the weight's and the
    // column-parallel bias's tp_slice; a row-parallel bias is replicated.
    Linear(const std::string & name, int64_t in, int64_t out, bool bias, DType dtype, Device & device,
           Split split = Split::none, const TensorParallel * tp = nullptr);
    struct Context {
        Tensor x;            // the input, in the weight's dtype
        Tensor fp8_scales;   // --fp8-recipe delayed: the scales forward cast x and W with (2 f32), for backward
    };

    // add_bias = false leaves the bias to the caller, to fuse it into the next elementwise kernel
    // (Megatron's skip_bias_add); backward still produces its gradient. The output is in `out` (the
    // activations' dtype), by default x's.
    Tensor forward(Context & ctx, const Tensor & x, bool add_bias = true, std::optional<DType> out = std::nullopt);
    // forward followed by the bias and GELU (Megatron's bias_gelu fusion), in one GEMM epilogue where the backend
    // has one (Ops::gemm_bias_gelu): returns gelu(x W^T + b) in `out`, and sets `pre` to x W^T + b, which GELU's
    // backward reads. Not for a split that sums its output over the TP group (the sum comes before the bias).
    Tensor forward_gelu(Context & ctx, const Tensor & x, DType out, Tensor & pre);
    // forward's output again from the input it kept (ctx.x), in `out`: the same GEMM on the same values, so
    // the same bits. For a layer without a bias whose output needs no sum over the TP group.
    Tensor recompute(const Context & ctx, DType out) const;
    // With `gelu_input` defined, the layer's input was gelu(gelu_input) and the result is the gradient with
    // respect to gelu_input: dx * gelu'(gelu_input), in the GEMM's epilogue where no TP sum comes between them
    // (Ops::gemm_gelu_backward).
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready, const Tensor & gelu_input = Tensor());
    // What forward keeps of its input for the weight's gradient (Context::x): the rows (every rank's with a
    // sequence-parallel column split), in the weight's dtype. A recompute sets Context::x from it.
    Tensor input_for_backward(const Tensor & x_rows) const;
    void   init(uint64_t seed, float std);
    void   parameters(std::vector<Parameter *> & out);

    Parameter                weight;   // (out, in)
    Parameter                bias;     // (out), undefined data when absent
    bool                     has_bias;
    Split                    split = Split::none;
    const TensorParallel *   tp    = nullptr;
    // FP8 GEMMs (--fp8-format with --fp8-recipe tensorwise; unset: the weights' dtype): each GEMM's two
    // operands cast to FP8 by their own current scale (Ops::fp8_quantize), multiplied with f32 accumulation and
    // scaled back (Ops::scale_by_product): forward x and W in `forward`, backward's dy in `backward` (hybrid:
    // e5m2). The bias and the kept input are not cast; backward casts x and W again (the same values).
    // With param_codes (--fp8-param-gather) the weight is kept as FP8 codes in `forward` with its scale
    // (Parameter::fp8_blocks), and the GEMMs read those instead of casting it. With blockwise (--fp8-recipe
    // blockwise) every operand is cast in blocks instead (fp8_product).
    struct Fp8 {
        Fp8Format forward = Fp8Format::e4m3, backward = Fp8Format::e4m3;
        bool      param_codes = false;
        bool      blockwise   = false;
        bool      mxfp8       = false;
    };
    std::optional<Fp8>       fp8;
    void                     set_fp8(const Fp8 & formats);
    // --fp8-recipe delayed (model/fp8_delayed.h): x and W take two slots of the forward's set, dy one of the
    // backward's. Given slots (expert layers keep theirs by global expert), or new ones.
    void                     set_fp8_delayed(Fp8DelayedMetas & metas, int64_t forward_slot = -1, int64_t backward_slot = -1);
    // The forward's FP8 product y32 = fp8(x) fp8(W)^T: current scales, or (delayed) the slots', kept in ctx.
    void                     fp8_forward_product(Context & ctx, const Tensor & x_in, const Tensor & y32) const;
    Fp8Delayed *             fp8_forward_meta  = nullptr;
    Fp8Delayed *             fp8_backward_meta = nullptr;
    int64_t                  fp8_x_slot = -1, fp8_dy_slot = -1;   // W's is fp8_x_slot + 1

};

// How fp8_product casts its operands (--fp8-recipe): tensorwise, one current scale per operand; or blockwise,
// power-of-two scales per block as Transformer Engine's Float8BlockScaling: an activation or a gradient in 1 x 128
// blocks along the GEMM's reduction (rows of 128 of a transposed operand), a weight (b_weight) in 128 x 128.
struct Fp8Cast {
    bool blockwise = false;
    bool b_weight  = false;
    // --fp8-recipe mxfp8 (Transformer Engine's MXFP8BlockScaling): every operand, weights included, in blocks of
    // 32 along the GEMM's reduction (1 x 32, or 32 x 1 transposed) with E8M0 scales (mxfp8_block_scale).
    bool mx        = false;
};

// c (f32) = op(fp8(a)) op(fp8(b)) / (s_a s_b): each operand cast to FP8 (format fa, fb) by its own current scale
// (Ops::fp8_quantize), the product with f32 accumulation, scaled back (Ops::scale_by_product). The GEMMs of an
// FP8 Linear and of each FP8 expert. A u8 b is a weight's FP8 codes (--fp8-param-gather) with 1 / s_b in
// b_scale_inv: decoded (Ops::fp8_decode), not cast. Blockwise, each operand is cast and scaled back block by
// block (Ops::fp8_quantize_blocks) before the product.
// With delayed scaling, da and db give an operand's scale and where its amax goes (Ops::fp8_quantize_scaled,
// Ops::fp8_amax) instead of its own current scale.
void fp8_product(const Tensor & a, Fp8Format fa, bool trans_a, const Tensor & b, Fp8Format fb, bool trans_b, const Tensor & c,
                 const Tensor & b_scale_inv = Tensor(), Fp8Cast cast = {}, const Fp8Delayed::Operand * da = nullptr,
                 const Fp8Delayed::Operand * db = nullptr);

class Norm {
public:
    Norm(const std::string & name, int64_t h, Normalization kind, float eps, DType dtype, Device & device,
         const TensorParallel & tp = {});
    struct Context { Tensor x, mean, rstd; };

    // With a residual, x += residual first, in the same pass over each row (the fused residual + norm of
    // a pre-norm block); x then holds the sum, which the caller keeps as the residual stream.
    Tensor forward(Context & ctx, const Tensor & x, const Tensor * residual = nullptr);
    // With `dresidual`, dx also takes it in the same pass: the gradient of the residual path around the norm.
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready, const Tensor & dresidual = Tensor());
    void   init();
    void   parameters(std::vector<Parameter *> & out);
    // --apply-layernorm-1p (Megatron's zero-centred gamma): the weight starts at 0 and the kernels scale by
    // 1 + weight; its gradient is the scale's. Set before init().
    void   set_one_plus(bool one_plus);

    Parameter     weight;   // (h)
    Parameter     bias;     // (h), LayerNorm only
    Normalization kind;
    float         eps;

private:
    Tensor scale() const;   // what the kernels multiply by: the weight, or 1 + it
    bool   one_plus_ = false;
    Tensor ones_;           // (h) f32 ones, with one_plus_
};

class GatedDeltaNet;          // model/gated_delta_net.h
struct GatedDeltaNetContext;
class DsaIndexer;             // model/dsa_indexer.h
struct DsaIndexerContext;

// Multi-latent attention (--multi-latent-attention; DeepSeek-V2/V3, Megatron's MLASelfAttention), with a
// heads, dn = --qk-head-dim, dr = --qk-pos-emb-head-dim, dv = --v-head-dim, rq / rkv the latent ranks:
//   q      = W_q x, or with --q-lora-rank W_q_up norm(W_q_down x)        (n, a (dn + dr)), heads [q_nope | q_pe]
//   [c | k_pe] = W_kv_down x                                              (n, rkv + dr)
//   kv     = W_kv_up norm(c)                                              (n, a (dn + dv)), heads [k_nope | v]
//   (the two norms only with --qk-layernorm, of --normalization, as Megatron's MLA layer specs)
//   head h attends with Q_h = [rope(q_pe_h) | q_nope_h], K_h = [rope(k_pe) | k_nope_h] (one k_pe for every
//   head), V_h = [v_h | 0] padded to dn + dr, scale 1 / sqrt(dn + dr); its output's first dv columns go to
//   the output projection (a dv -> h).
// Megatron's MLA RoPE de-interleaves each pe part and turns pairs (i, i + dr/2); turning the pairs (2i, 2i + 1)
// in place, as here, gives the same values in another order, the same for Q and K, so the same scores; the
// pe parts stand first in each head for the same reason (Ops::rope turns the leading dr of a head). Under
// Megatron's YaRN (MLA's default RoPE, core/rope.h) the frequencies are YaRN's and cos and sin scaled by its
// concentration factor, and the softmax scale is yarn_mscale(factor, mscale_all_dim)^2 / sqrt(dn + dr).
// Tensor parallelism splits the heads (W_q / W_q_up and W_kv_up by rows, the output projection by columns);
// W_q_down, W_kv_down and the norms are whole on every rank, applied to its rows (a block of them under
// sequence parallelism, k_pe then gathered over the group for every head's keys).
//
// On the layers GptConfig::is_linear_attention_layer marks, the gated delta-net (model/gated_delta_net.h) runs in
// place of all of this: forward, backward, init and parameters are its own (qkv and proj then have no parameter).
class SelfAttention {
public:
    // `layer`: the model's layer index (its --cp-comm-type, and whether it is a gated delta-net layer).
    SelfAttention(const std::string & name, const GptConfig & config, Device & device, const TensorParallel & tp = {},
                  const ContextParallel & cp = {}, int64_t layer = 0);
    ~SelfAttention();
    struct Context {
        Linear::Context qkv_ctx, proj_ctx;   // proj_ctx.x is the attention output (n, a d)
        Tensor          qkv;   // (n, (a + 2g) d) after RoPE, in the parameters' dtype
        Tensor          lse;   // (b, a, s)
        Tensor          ungated;   // --attention-output-gate: the attention's output before the gate (n, a d)
        int64_t         s = 0, b = 0;
        Dropout         dropout;   // of the probabilities
        Norm::Context   q_norm, k_norm;   // --qk-layernorm: inputs (n a, d), (n g, d) and statistics
        struct Latent {   // MLA's: qkv is (n, 3 a (dn + dr)), proj_ctx.x the (n, a dv) outputs
            Linear::Context q, q_down, q_up, kv_down, kv_up;
            Norm::Context   q_norm, kv_norm;
            Tensor          k_pe;   // (n, dr), every row's: kept instead of qkv with --recompute-modules mla_up_proj
        } latent;
        std::shared_ptr<GatedDeltaNetContext> linear;   // a gated delta-net layer's
        std::shared_ptr<DsaIndexerContext>    indexer;  // a DSA layer's, when its loss ran in forward
        Tensor          key_mask;   // a DSA layer's top-k keys (b, s, S) u8, when fewer than every causal key
        // DSA under context parallelism: the whole sequences' K | V rows (whole_kv), while the forward needs them.
        Tensor          whole_kv;
        bool training = false;   // a training forward (the DSA indexer's loss runs in those only)
        // DSA: the forward's record of each computing layer's selection, by layer index (DropoutBatch::dsa_topk).
        std::map<int64_t, Tensor> * dsa_topk = nullptr;
        bool recomputing = false;   // full recompute's rerun: the indexer's loss is not logged a second time
    };

    // `dropout`: the probabilities' key (off when not enabled).
    Tensor forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const Dropout & dropout = {});
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    // --recompute-modules layernorm: the input the first projections keep for their weights' gradients (the
    // norm's output: QKV's, or MLA's q / q_down and kv_down) dropped after forward, and set again from the
    // recomputed rows before backward (each projection's input_for_backward of them: the same bits).
    void   release_input(Context & ctx) const;
    void   restore_input(Context & ctx, const Tensor & x_rows) const;
    void   init(uint64_t seed, float std, float output_std);
    void   parameters(std::vector<Parameter *> & out);

    const GptConfig & config;
    TensorParallel    tp;
    ContextParallel   cp;
    CpCommType        cp_comm = CpCommType::p2p;
    int64_t           heads, groups;   // this rank's: a / tp, g / tp
    Linear            qkv;    // h -> (a + 2g) d / tp, rows [Q | K | V] of this rank's heads and groups (then [G],
                              // their a d / tp gates, with --attention-output-gate)
    Linear            proj;   // a d / tp -> h, row-parallel
    // --qk-layernorm: one norm over d shared by every query head, one by every key head (Megatron's
    // q_layernorm / k_layernorm, of the model's --normalization), applied before RoPE. Under TP each rank
    // sees its own heads, so their gradients are summed over the group.
    std::unique_ptr<Norm> q_norm, k_norm;
    // --multi-latent-attention: these instead of qkv (which then has no rows and no parameter).
    struct Latent {
        std::unique_ptr<Linear> q;         // h -> a (dn + dr), without --q-lora-rank
        std::unique_ptr<Linear> q_down;    // h -> rq
        std::unique_ptr<Norm>   q_norm;    // over rq (--qk-layernorm)
        std::unique_ptr<Linear> q_up;      // rq -> a (dn + dr)
        std::unique_ptr<Linear> kv_down;   // h -> rkv + dr
        std::unique_ptr<Norm>   kv_norm;   // over rkv (--qk-layernorm)
        std::unique_ptr<Linear> kv_up;     // rkv -> a (dn + dv)
    };
    std::unique_ptr<Latent> mla;
    // --experimental-attention-variant dsa (model/dsa_indexer.h): MLA's layers score their keys with an indexer.
    std::unique_ptr<DsaIndexer> indexer;
    std::unique_ptr<GatedDeltaNet> gdn;   // a gated delta-net layer's (--experimental-attention-variant)
    int64_t                 window = -1;   // GptConfig::attention_window of this layer
    int64_t                 layer_ = 0;    // the model's index of this layer (DSA's top-k sharing)
    // Attention sinks (GptConfig::softmax_type): learnable, this rank's heads' logits (a parameter, split by
    // heads under TP as the heads are); off-by-one, zeros (zero_offset). Neither: no sink.
    std::optional<Parameter> softmax_offset;
    Tensor                   zero_offset;

private:
    // The attention of packed [Q | K | V] rows into out (and ctx.lse), through the context-parallel exchanges
    // when there are several CP ranks; and its backward into d_qkv.
    void   attend(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape, float scale,
                  const Dropout & dropout);
    void   attend_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                           const Tensor & d_qkv, const AttentionShape & shape, float scale);
    // The sink of heads [first, first + shape.nq) of this rank's on the final (out, lse) of shape's queries, and
    // its gradient added to softmax_offset's (Ops::attention_sink_forward / _backward). No-ops without sinks.
    void   sink_forward(const Tensor & out, const Tensor & lse, const AttentionShape & shape, int64_t first) const;
    void   sink_backward(const Tensor & out, const Tensor & d_out, const Tensor & lse, const AttentionShape & shape,
                         int64_t first);
    Tensor mla_forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const Dropout & dropout);
    // MLA's packed [Q | K | V] rows from q (n, a (dn + dr)), kv (n, a (dn + dv)) and k_pe (n, dr), RoPE'd.
    Tensor mla_packed_rows(const Tensor & q, const Tensor & kv, const Tensor & k_pe, int64_t s, int64_t b) const;
    Tensor mla_backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    // Attention over the whole sequence from this rank's rows (context parallelism, by cp_comm): out and
    // ctx.lse of this rank's queries; backward assigns d_qkv's Q, K and V columns.
    void cp_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape, float scale,
                    const Dropout & dropout);
    void cp_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                     const Tensor & d_qkv, const AttentionShape & shape, float scale);
    // Every CP rank's K | V of q_k_v (f32 packed rows of `shape`), the whole sequences' rows in position order: what
    // DSA's selection attends to (its key mask's columns are key positions) and its indexer's target reads.
    Tensor whole_kv(const Tensor & q_k_v, const AttentionShape & shape) const;
    // The a2a variant: this rank's rows of every head <-> every rank's rows (the whole sequence, in order) of
    // this rank's share of the heads.
    void a2a_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape, float scale,
                     const Dropout & dropout);
    void a2a_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                      const Tensor & d_qkv, const AttentionShape & shape, float scale);
    // The a2a+p2p variant: the heads' all-to-all inside the inner group, then the ring of the inner groups'
    // K | V across the outer group, block by block (member by member).
    void hierarchical_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape,
                              float scale, const Dropout & dropout);
    void hierarchical_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                               const Tensor & d_qkv, const AttentionShape & shape, float scale);
};

class Mlp {
public:
    Mlp(const std::string & name, const GptConfig & config, Device & device, const TensorParallel & tp = {});
    struct Context {
        Linear::Context fc1_ctx, fc2_ctx;
        Tensor          pre_act;   // in the parameters' dtype
        Tensor          input;     // with `recompute`: the input (in the parameters' dtype), all that is kept
        DType           activations = DType::f32;   // the dtype of the input given and of the output
    };

    Tensor forward(Context & ctx, const Tensor & x);
    Tensor backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready);
    void   init(uint64_t seed, float std, float output_std);
    void   parameters(std::vector<Parameter *> & out);

private:
    // Forward keeping what backward reads; the output and intermediates in `activations`.
    Tensor forward_kept(Context & ctx, const Tensor & x, DType activations);

public:
    const GptConfig & config;
    TensorParallel    tp;
    int64_t           ffn;   // this rank's hidden features: f / tp
    bool              recompute_act = false;   // fc2's input dropped after forward, recomputed in backward
    bool              recompute     = false;   // only the input kept; forward rerun before backward
    Linear            fc1;   // h -> f / tp (2f / tp with SwiGLU: [gate | up] of this rank's features)
    Linear            fc2;   // f / tp -> h, row-parallel
};

// A gated MLP's activation of pre (n, 2f) = [gate | linear] into act (n, f), and its backward: SwiGLU's ops,
// or Ops::glu_forward / glu_backward with config.glu_spec() (quick-GEGLU, a clamp, an offset).
void gated_forward(const GptConfig & config, Stream & stream, const Tensor & pre, const Tensor & act);
void gated_backward(const GptConfig & config, Stream & stream, const Tensor & pre, const Tensor & d_act, const Tensor & d_pre);

// The MLP activation of `config` (gated, squared ReLU or GELU) of a saved pre-activation (f32, its bias
// already added) into act: what forward computed from the same values, for activation recompute.
void recompute_activation(const GptConfig & config, const Tensor & pre, const Tensor & act);

// Expert parallelism of the MoE layers (--expert-model-parallel-size): the EP group (null: none) and this
// rank's place in it. Rank r of P holds experts [r E / P, (r + 1) E / P) of every MoE layer; the tokens
// reach them through the dispatcher (model/moe/moe_layer.h). Every rank routes its own tokens (with
// sequence parallelism, its block of the sequence).
//
// Expert tensor parallelism (--expert-tensor-parallel-size, MoE parallel folding): the ETP ranks of one EP
// rank split each of its experts' hidden features as a tensor-parallel MLP does (fc1 by output features,
// fc2 by input features), and each sees the tokens all of them received. The dispatcher exchanges over the
// ETP x EP group (`tp_ep`, in-group rank = tp_rank + rank * tp_size) and sums the ETP ranks' partial outputs
// itself, so the experts run no collective of their own.
struct ExpertParallel {
    std::shared_ptr<comm::Communicator> group;   // EP
    int                                 rank = 0, size = 1;
    std::shared_ptr<comm::Communicator> tp_ep;   // ETP x EP (null while both are 1)
    int                                 tp_rank = 0, tp_size = 1;
    // The TP x DP x CP ranks: global_aux_loss sums its routing counts over them (null: this rank alone).
    std::shared_ptr<comm::Communicator> tp_dp_cp;

    int exchange_size() const { return size * tp_size; }   // the dispatcher's group: ETP x EP ranks
};

}  // namespace loom::model
