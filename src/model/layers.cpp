#include "model/layers.h"

#include "core/error.h"
#include "core/graph.h"
#include "core/ops.h"
#include "model/dsa_indexer.h"
#include "model/gated_delta_net.h"

#include <cmath>
#include <functional>
#include <optional>

namespace loom::model {

Tensor activation(Device & device, int64_t rows, int64_t cols, DType dtype) {
    return Tensor::empty({rows, cols}, dtype, device, {MemoryKind::device, kActivationsPool});
}

Tensor in_dtype(const Tensor & x, DType dtype) {
    if (x.dtype() == dtype) {
        return x;
    }
    Tensor out = Tensor::empty(x.shape(), dtype, x.device(), {MemoryKind::device, kActivationsPool});
    x.device().ops().convert(x.device().compute_stream(), x, out);
    return out;
}

Tensor f32_output_for(const Tensor & t) {
    return t.dtype() == DType::f32 ? t : Tensor::empty(t.shape(), DType::f32, t.device(), {MemoryKind::device, kActivationsPool});
}

Tensor keep_for_backward(Tensor & x, DType dtype) {
    if (dtype == DType::f32 || x.dtype() == dtype) {
        return x;
    }
    LOOM_CHECK(dtype_is_half(dtype) && x.dtype() == DType::f32,
               "keeping a " << dtype_name(x.dtype()) << " activation as " << dtype_name(dtype), "");
    Tensor out = Tensor::empty(x.shape(), dtype, x.device(), {MemoryKind::device, kActivationsPool});
    if (dtype == DType::bf16) {
        x.device().ops().round_to_bf16(x.device().compute_stream(), x, out);
    } else {
        x.device().ops().convert(x.device().compute_stream(), x, out);
    }
    return out;
}

void TensorParallel::all_reduce(const Tensor & t) const {
    if (group && size > 1) group->all_reduce(t, comm::ReduceOp::sum, &t.device().compute_stream());
}

Tensor TensorParallel::reduce_scatter(const Tensor & t) const {
    LOOM_CHECK(t.size(0) % size == 0, t.size(0) << " rows do not split over " << size << " sequence-parallel ranks", "");
    Tensor out = Tensor::empty({t.size(0) / size, t.size(1)}, t.dtype(), t.device(), {MemoryKind::device, kActivationsPool});
    group->reduce_scatter(t, out, comm::ReduceOp::sum, &t.device().compute_stream());
    return out;
}

Tensor TensorParallel::all_gather(const Tensor & t) const {
    Tensor out = Tensor::empty({t.size(0) * size, t.size(1)}, t.dtype(), t.device(), {MemoryKind::device, kActivationsPool});
    group->all_gather(t, out, &t.device().compute_stream());
    return out;
}

TensorParallel::Streams::Streams(Device & device)
    : stream(device.stream_create("tp-comm")), ready(device.event_create()), done(device.event_create()) {}

namespace {

// One step of a tensor-parallel ring (--tp-comm-overlap): `send` to the group's next rank, the previous rank's
// block into `recv` (an all-to-all with one non-empty block each way, as the CP ring's passes). On the tp-comm
// stream once the compute stream has produced `send`, beside whatever the compute stream does next; arrive()
// makes the compute stream wait for it. Inside a graph capture it runs on the compute stream, in line: the
// same blocks in the same order, so the same bits.
class TpRingStep {
public:
    TpRingStep(const TensorParallel & tp, const Tensor & send, const Tensor & recv) : send_(send), streams_(*tp.overlap) {
        Stream & compute = send.device().compute_stream();
        overlapped_      = graph_being_captured() == nullptr;
        Stream & on      = overlapped_ ? *streams_.stream : compute;
        if (overlapped_) {
            compute.record(*streams_.ready);
            on.wait(*streams_.ready);
        }
        std::vector<int64_t> sends(static_cast<size_t>(tp.size), 0), recvs(static_cast<size_t>(tp.size), 0);
        sends[static_cast<size_t>((tp.rank + 1) % tp.size)]           = send.numel();
        recvs[static_cast<size_t>((tp.rank - 1 + tp.size) % tp.size)] = recv.numel();
        tp.group->all_to_all(send, sends, recv, recvs, &on);
        if (overlapped_) on.record(*streams_.done);
    }
    void arrive() {
        if (overlapped_) send_.device().compute_stream().wait(*streams_.done);
    }

private:
    Tensor                    send_;   // read by the tp-comm stream until it arrives
    TensorParallel::Streams & streams_;
    bool                      overlapped_ = false;
};

// The ring's all-gather + GEMM: this rank's block of rows (`local`, rows r) into block r of `gathered` (size blocks),
// then every other rank's around the ring, each block's `product(j)` running on the compute stream while the next
// block travels: block j arrives at step k = rank - j (mod size), and the product of the block in hand overlaps it.
void gather_around_ring(const TensorParallel & tp, const Tensor & local, const Tensor & gathered,
                        const std::function<void(int64_t block)> & product) {
    const int64_t rows = local.size(0);
    Device &      dev  = local.device();
    dev.ops().copy(dev.compute_stream(), local, gathered.narrow(0, tp.rank * rows, rows));
    for (int k = 0; k < tp.size; ++k) {
        const int                 j = (tp.rank - k + tp.size) % tp.size;
        std::optional<TpRingStep> step;
        if (k + 1 < tp.size) {
            step.emplace(tp, gathered.narrow(0, j * rows, rows), gathered.narrow(0, ((j - 1 + tp.size) % tp.size) * rows, rows));
        }
        product(j);
        if (step) step->arrive();
    }
}

// The ring's GEMM + reduce-scatter: this rank's block (rows r) of the sum over the group of every rank's product.
// At step k each rank computes `product(b, part)` for block b = rank - 1 - k (mod size), adds the partial sum the
// previous rank passed it (for the same block) and passes the sum on; the last step's block is its own. Each
// product runs beside the transfer of the step before. The partial sums are in `dtype` (the activations'), each
// step rounding once, as a ring reduce-scatter does.
Tensor reduce_around_ring(const TensorParallel & tp, Device & dev, int64_t rows, int64_t width, DType dtype,
                          const std::function<void(int64_t block, const Tensor & part)> & product) {
    std::optional<TpRingStep> step;
    Tensor                    part, incoming;
    for (int k = 0; k < tp.size; ++k) {
        const int b = (tp.rank - 1 - k + 2 * tp.size) % tp.size;
        part        = activation(dev, rows, width, dtype);
        product(b, part);
        if (step) {
            step->arrive();
            dev.ops().add_inplace(dev.compute_stream(), part, incoming);
            step.reset();
        }
        if (k + 1 < tp.size) {
            incoming = activation(dev, rows, width, dtype);
            step.emplace(tp, part, incoming);
        }
    }
    return part;
}

// Whether a linear runs its collectives as rings (--tp-comm-overlap): sequence-parallel, split, not cast to FP8 (a
// tensorwise FP8 scale is the whole gathered operand's: the blocks cannot be cast one by one).
bool on_ring(const Linear & l) { return l.split != Linear::Split::none && l.tp && l.tp->rings() && !l.fp8; }

// A column-parallel forward's GEMM over its input gathered around the ring (on_ring): `product(x, first, rows)` writes
// output rows [first, first + rows) from x, the input's rows there, once per block as it arrives. Returns the
// gathered input, in the weights' dtype (Context::x).
Tensor gathered_product(const Linear & l, const Tensor & x_rows,
                        const std::function<void(const Tensor & x, int64_t first, int64_t rows)> & product) {
    const Tensor  local = in_dtype(x_rows, l.weight.compute_dtype());
    const int64_t rows  = local.size(0);
    const Tensor  gathered = Tensor::empty({rows * l.tp->size, local.size(1)}, local.dtype(), local.device(),
                                           {MemoryKind::device, kActivationsPool});
    gather_around_ring(*l.tp, local, gathered, [&](int64_t j) { product(gathered.narrow(0, j * rows, rows), j * rows, rows); });
    return gathered;
}

}  // namespace

Dropout dropout_key(const GptConfig & config, const TensorParallel & tp, const DropoutBatch & batch, int64_t layer,
                    DropoutKind kind, int64_t rows, int64_t heads) {
    const float p = kind == DropoutKind::attention_probs ? config.attention_dropout : config.hidden_dropout;
    if (!batch.training || p <= 0.0f) return {};
    Dropout key;
    key.p          = p;
    key.seed       = config.seed;
    key.site       = dropout_site(layer, kind);
    key.sample_ids = batch.sample_ids;
    key.batch      = batch.b;
    key.positions  = batch.positions;
    // Attention: this rank's first head of the model's; hidden: its first row of the sequence's (s, b) rows.
    key.offset = kind == DropoutKind::attention_probs ? tp.rank * heads : tp.sp() ? tp.rank * rows : 0;
    return key;
}

void set_tp_slice(Parameter & p, int dim, std::vector<std::pair<int64_t, int64_t>> ranges, Shape full_shape) {
    p.tp_slice = TpSlice{dim, std::move(ranges), std::move(full_shape)};
}

// ---------------------------------------------------------------------------------------------------
// Linear

Linear::Linear(const std::string & name, int64_t in, int64_t out, bool with_bias, DType dtype, Device & device,
               Split s, const TensorParallel * t)
    : weight(parameter_create(name + ".weight", {out, in}, dtype, device)), has_bias(with_bias), split(s), tp(t) {
    LOOM_CHECK(split == Split::none || tp, "a split linear layer without its tensor-parallel group", "");
    if (has_bias) {
        bias                 = parameter_create(name + ".bias", {out}, dtype, device);
        bias.no_weight_decay = true;
        if (split == Split::row) tp->replicated(bias);   // added after the reduction: every rank's whole
    }
}

void Linear::init(uint64_t seed, float std) {
    parameter_init_normal(weight, seed, std);
    if (has_bias) {
        parameter_init_constant(bias, 0.0f);
    }
}

void Linear::parameters(std::vector<Parameter *> & out) {
    out.push_back(&weight);
    if (has_bias) out.push_back(&bias);
}

Tensor Linear::input_for_backward(const Tensor & x_rows) const {
    // Sequence-parallel column linear: every rank's rows in, this rank's output features out.
    const Tensor x = split == Split::column && tp->sp() ? tp->all_gather(x_rows) : x_rows;
    return in_dtype(x, weight.compute_dtype());
}

void Linear::set_fp8(const Fp8 & formats) {
    fp8 = formats;
    if (formats.param_codes) {
        weight.fp8_blocks = 1;
        weight.fp8_format = formats.forward;
    }
}

void Linear::set_fp8_delayed(Fp8DelayedMetas & metas, int64_t forward_slot, int64_t backward_slot) {
    fp8_forward_meta  = metas.forward.get();
    fp8_backward_meta = metas.backward.get();
    fp8_x_slot        = forward_slot >= 0 ? forward_slot : fp8_forward_meta->add(2);
    fp8_dy_slot       = backward_slot >= 0 ? backward_slot : fp8_backward_meta->add();
}

namespace {

// An FP8 operand cast: by its own current scale, or (delayed) by the scale given, its amax folded where asked.
void fp8_cast(const Tensor & x, Fp8Format format, const Tensor & q, const Tensor & scale_inv, const Fp8Delayed::Operand * d) {
    Ops &    ops    = x.device().ops();
    Stream & stream = x.device().compute_stream();
    if (!d) {
        ops.fp8_quantize(stream, x, format, q, scale_inv);
        return;
    }
    if (d->amax.defined()) ops.fp8_amax(stream, x, d->amax);
    ops.fp8_quantize_scaled(stream, x, format, d->scale, q, scale_inv);
}

AttentionShape against_whole_kv(const AttentionShape & shape, int cp);   // with the context-parallel exchanges, below

}  // namespace

void fp8_product(const Tensor & a, Fp8Format fa, bool trans_a, const Tensor & b, Fp8Format fb, bool trans_b, const Tensor & c,
                 const Tensor & b_scale_inv, Fp8Cast cast, const Fp8Delayed::Operand * da, const Fp8Delayed::Operand * db) {
    Device &            device = a.device();
    Ops &               ops    = device.ops();
    Stream &            stream = device.compute_stream();
    const TensorOptions pool{MemoryKind::device, kActivationsPool};
    if (cast.blockwise || cast.mx) {   // blocks along the reduction: a's columns (its rows when transposed), b's rows (columns)
        LOOM_CHECK(b.dtype() != DType::u8, "block-scaled FP8 of FP8 codes", "--fp8-param-gather keeps tensorwise codes");
        const Tensor  qa = Tensor::empty(a.shape(), DType::bf16, device, pool), qb = Tensor::empty(b.shape(), DType::bf16, device, pool);
        const int64_t k  = cast.mx ? 32 : 128;   // MXFP8: 32 elements along the reduction, weights too
        ops.fp8_quantize_blocks(stream, a, fa, trans_a ? k : 1, trans_a ? 1 : k, qa, cast.mx);
        if (cast.b_weight && !cast.mx) {
            ops.fp8_quantize_blocks(stream, b, fb, 128, 128, qb, false);
        } else {
            ops.fp8_quantize_blocks(stream, b, fb, trans_b ? 1 : k, trans_b ? k : 1, qb, cast.mx);
        }
        ops.gemm(stream, qa, trans_a, qb, trans_b, c);
        return;
    }
    const Tensor qa = Tensor::empty(a.shape(), DType::bf16, device, pool), sa = Tensor::empty({1}, DType::f32, device, pool);
    const Tensor qb = Tensor::empty(b.shape(), DType::bf16, device, pool);
    fp8_cast(a, fa, qa, sa, da);
    Tensor sb = b_scale_inv;
    if (b.dtype() == DType::u8) {   // codes keep their own (current) scale, with delayed scaling too
        LOOM_CHECK(sb.defined() && sb.numel() == 1, "FP8 codes without their scale", "");
        ops.fp8_decode(stream, b, fb, qb);
    } else {
        sb = Tensor::empty({1}, DType::f32, device, pool);
        fp8_cast(b, fb, qb, sb, db);
    }
    ops.gemm(stream, qa, trans_a, qb, trans_b, c);
    ops.scale_by_product(stream, c, sa, sb);
}

void Linear::fp8_forward_product(Context & ctx, const Tensor & x_in, const Tensor & y32) const {
    if (!fp8_forward_meta) {
        fp8_product(x_in, fp8->forward, false, weight.data, fp8->forward, true, y32, weight.fp8_scale_inv,
                    Fp8Cast{fp8->blockwise, true, fp8->mxfp8});
        return;
    }
    // Delayed: the slots' scales now, kept for backward; both amaxes recorded.
    ctx.fp8_scales                 = fp8_forward_meta->snapshot(fp8_x_slot, 2);
    const Fp8Delayed::Operand d_x  = fp8_forward_meta->operand(fp8_x_slot);
    const Fp8Delayed::Operand d_w  = fp8_forward_meta->operand(fp8_x_slot + 1);
    fp8_product(x_in, fp8->forward, false, weight.data, fp8->forward, true, y32, weight.fp8_scale_inv,
                Fp8Cast{fp8->blockwise, true, fp8->mxfp8}, &d_x, &d_w);
}

namespace {

// Linear::forward on the ring (on_ring): a column split multiplies each block of rows as it arrives (the bias in
// each block's epilogue); a row split sums its products for each block around the ring, then adds the bias.
Tensor ring_forward(const Linear & l, Linear::Context & ctx, const Tensor & x_rows, bool add_bias, DType out) {
    Device &      dev    = x_rows.device();
    Ops &         ops    = dev.ops();
    Stream &      stream = dev.compute_stream();
    const int64_t o      = l.weight.data.size(0);
    const Tensor  bias   = l.has_bias && add_bias ? parameter_f32(l.bias) : Tensor();
    if (l.split == Linear::Split::column) {
        const Tensor y = activation(dev, x_rows.size(0) * l.tp->size, o, out);
        ctx.x = gathered_product(l, x_rows, [&](const Tensor & x, int64_t first, int64_t rows) {
            const Tensor y_rows = y.narrow(0, first, rows);
            if (bias.defined()) {
                ops.gemm_bias(stream, x, false, l.weight.data, true, y_rows, bias);
            } else {
                ops.gemm(stream, x, false, l.weight.data, true, y_rows);
            }
        });
        return y;
    }
    const Tensor  x_in = l.input_for_backward(x_rows);
    const int64_t rows = x_in.size(0) / l.tp->size;
    const Tensor  y    = reduce_around_ring(*l.tp, dev, rows, o, out, [&](int64_t block, const Tensor & part) {
        ops.gemm(stream, x_in.narrow(0, block * rows, rows), false, l.weight.data, true, part);
    });
    if (bias.defined()) ops.bias_add(stream, y, bias);
    ctx.x = x_in;
    return y;
}

}  // namespace

Tensor Linear::forward(Context & ctx, const Tensor & x_rows, bool add_bias, std::optional<DType> out) {
    if (on_ring(*this)) return ring_forward(*this, ctx, x_rows, add_bias, out.value_or(x_rows.dtype()));
    Tensor   x_in = input_for_backward(x_rows);
    int64_t  n = x_in.size(0), o = weight.data.size(0);
    Tensor   y      = activation(x_in.device(), n, o, out.value_or(x_rows.dtype()));
    Ops &    ops    = x_in.device().ops();
    Stream & stream = x_in.device().compute_stream();
    // The bias rides in the GEMM's epilogue unless a sum over the TP group comes between them (a row linear
    // adds it once, after the reduction).
    const bool reduced    = split == Split::row && tp->size > 1;
    const bool fused_bias = has_bias && add_bias && !reduced;
    if (fp8) {   // f32 product, the bias added to it, then rounded once into y
        const Tensor y32 = activation(x_in.device(), n, o, DType::f32);
        fp8_forward_product(ctx, x_in, y32);
        if (fused_bias) ops.bias_add(stream, y32, parameter_f32(bias));
        ops.convert(stream, y32, y);
    } else if (fused_bias) {
        ops.gemm_bias(stream, x_in, false, weight.data, true, y, parameter_f32(bias));
    } else {
        ops.gemm(stream, x_in, false, weight.data, true, y);
    }
    if (split == Split::row) {   // partial sums over this rank's input features
        if (tp->sp()) {
            y = tp->reduce_scatter(y);
            n = y.size(0);
        } else {
            tp->all_reduce(y);
        }
    }
    if (has_bias && add_bias && !fused_bias) {
        ops.bias_add(stream, y, parameter_f32(bias));
    }
    ctx.x = x_in;
    return y;
}

Tensor Linear::recompute(const Context & ctx, DType out) const {
    LOOM_CHECK(!has_bias && !(split == Split::row && tp->size > 1) && ctx.x.defined(),
               "recomputing " << weight.name << "'s output", "only a kept input, without a bias or a TP sum, gives it again");
    Tensor y = activation(ctx.x.device(), ctx.x.size(0), weight.data.size(0), out);
    if (fp8) {   // delayed: with the scales the forward used, recording nothing
        const Tensor y32 = activation(ctx.x.device(), ctx.x.size(0), weight.data.size(0), DType::f32);
        const Fp8Delayed::Operand dx{ctx.fp8_scales.defined() ? ctx.fp8_scales.slice(0, {1}) : Tensor(), Tensor()};
        const Fp8Delayed::Operand dw{ctx.fp8_scales.defined() ? ctx.fp8_scales.slice(1, {1}) : Tensor(), Tensor()};
        const bool                delayed = ctx.fp8_scales.defined();
        fp8_product(ctx.x, fp8->forward, false, weight.data, fp8->forward, true, y32, weight.fp8_scale_inv,
                    Fp8Cast{fp8->blockwise, true, fp8->mxfp8}, delayed ? &dx : nullptr, delayed ? &dw : nullptr);
        ctx.x.device().ops().convert(ctx.x.device().compute_stream(), y32, y);
        return y;
    }
    ctx.x.device().ops().gemm(ctx.x.device().compute_stream(), ctx.x, false, weight.data, true, y);
    return y;
}

Tensor Linear::forward_gelu(Context & ctx, const Tensor & x_rows, DType out, Tensor & pre) {
    LOOM_CHECK(!(split == Split::row && tp->size > 1), "Linear::forward_gelu of " << weight.name,
               "a row-parallel linear sums its output first: forward, then bias_gelu_forward");
    if (on_ring(*this)) {   // each block's rows through the GEMM, the bias and GELU as it arrives
        const int64_t n = x_rows.size(0) * tp->size, o = weight.data.size(0);
        pre             = activation(x_rows.device(), n, o, out);
        Tensor       y  = activation(x_rows.device(), n, o, out);
        const Tensor b  = has_bias ? parameter_f32(bias) : Tensor();
        ctx.x = gathered_product(*this, x_rows, [&](const Tensor & x, int64_t first, int64_t rows) {
            x.device().ops().gemm_bias_gelu(x.device().compute_stream(), x, false, weight.data, true,
                                            pre.narrow(0, first, rows), y.narrow(0, first, rows), b);
        });
        return y;
    }
    Tensor        x_in = input_for_backward(x_rows);
    const int64_t n = x_in.size(0), o = weight.data.size(0);
    pre      = activation(x_in.device(), n, o, out);
    Tensor y = activation(x_in.device(), n, o, out);
    if (fp8) {   // gemm_bias_gelu's contract with the FP8 product: pre, then bias and GELU
        const Tensor y32 = activation(x_in.device(), n, o, DType::f32);
        fp8_forward_product(ctx, x_in, y32);
        Ops & ops = x_in.device().ops();
        ops.convert(x_in.device().compute_stream(), y32, pre);
        ops.bias_gelu_forward(x_in.device().compute_stream(), pre, has_bias ? parameter_f32(bias) : Tensor(), y, Tensor());
        ctx.x = x_in;
        return y;
    }
    x_in.device().ops().gemm_bias_gelu(x_in.device().compute_stream(), x_in, false, weight.data, true, pre, y,
                                       has_bias ? parameter_f32(bias) : Tensor());
    ctx.x = x_in;
    return y;
}

Tensor Linear::backward(Context & ctx, const Tensor & dy_rows, const GradReadyFn & ready, const Tensor & gelu_input) {
    Ops &         ops    = dy_rows.device().ops();
    Stream &      stream = dy_rows.device().compute_stream();
    const bool    gathered = split == Split::row && tp->sp();
    const DType   dtype    = weight.compute_dtype();
    // The bias gradient sums dy's rows in the weight gradient's GEMM (its epilogue, where the backend has one)
    // when that GEMM reads the very rows: not after a sequence-parallel gather (the bias sees this rank's rows,
    // a partial sum), nor from a copy in the weights' dtype.
    const bool    bias_in_gemm = has_bias && !gathered && dy_rows.dtype() == dtype && !fp8;
    if (has_bias && !bias_in_gemm) {
        accumulate_grads(stream, {bias.main_grad.view({bias.main_grad.numel()})},
                         [&](std::span<const Tensor> g) { ops.bias_backward(stream, dy_rows, g[0]); });
    }
    // GELU's gradient rides in the product's epilogue unless a sum over the TP group comes between them.
    const bool summed = split == Split::column && tp->size > 1;
    // --tp-comm-overlap (on_ring): a row split's output gradient arrives around the ring one block at a time, each
    // block's rows of dx multiplied as it comes (dx = dy W is row by row).
    const bool ring_gather = gathered && on_ring(*this);
    Tensor     dy, dy_in, dx;
    int64_t    n = 0, in = weight.data.size(1);
    if (ring_gather) {
        const Tensor local = in_dtype(dy_rows, dtype);
        const int64_t rows = local.size(0);
        n     = rows * tp->size;
        dy_in = Tensor::empty({n, local.size(1)}, dtype, dy_rows.device(), {MemoryKind::device, kActivationsPool});
        dx    = activation(dy_rows.device(), n, in, dy_rows.dtype());
        gather_around_ring(*tp, local, dy_in, [&](int64_t j) {
            const Tensor dy_j = dy_in.narrow(0, j * rows, rows), dx_j = dx.narrow(0, j * rows, rows);
            if (gelu_input.defined()) {
                ops.gemm_gelu_backward(stream, dy_j, false, weight.data, false, gelu_input.narrow(0, j * rows, rows), dx_j);
            } else {
                ops.gemm(stream, dy_j, false, weight.data, false, dx_j);
            }
        });
        dy = dy_in;
    } else {
        dy    = gathered ? tp->all_gather(dy_rows) : dy_rows;
        n     = dy.size(0);
        dy_in = in_dtype(dy, dtype);
        dx    = activation(dy.device(), n, in, dy.dtype());
    }
    // Delayed scaling: dy cast by its slot's scale (its amax recorded once, here), x and W by their forward's.
    const bool                delayed = fp8 && fp8_backward_meta != nullptr;
    const Fp8Delayed::Operand d_dy    = delayed ? fp8_backward_meta->operand(fp8_dy_slot) : Fp8Delayed::Operand{};
    const Fp8Delayed::Operand d_dy_again{d_dy.scale, Tensor()};
    const Fp8Delayed::Operand d_x{delayed ? ctx.fp8_scales.slice(0, {1}) : Tensor(), Tensor()};
    const Fp8Delayed::Operand d_w{delayed ? ctx.fp8_scales.slice(1, {1}) : Tensor(), Tensor()};
    if (ring_gather) {
        // dx is done
    } else if (fp8) {   // dx = fp8(dy) fp8(W), then gemm_gelu_backward's contract
        const Tensor dx32 = activation(dy.device(), n, in, DType::f32);
        fp8_product(dy_in, fp8->backward, false, weight.data, fp8->forward, false, dx32, weight.fp8_scale_inv,
                    Fp8Cast{fp8->blockwise, true, fp8->mxfp8}, delayed ? &d_dy : nullptr, delayed ? &d_w : nullptr);
        ops.convert(stream, dx32, dx);
        if (gelu_input.defined() && !summed) ops.gelu_backward(stream, gelu_input, dx, dx);
    } else if (gelu_input.defined() && !summed) {
        ops.gemm_gelu_backward(stream, dy_in, false, weight.data, false, gelu_input, dx);
    } else {
        ops.gemm(stream, dy_in, false, weight.data, false, dx);
    }
    // --tp-comm-overlap: a column split's reduce-scatter of dx runs on the tp-comm stream beside the weight
    // gradient's GEMM (the same collective as without it: the same bits).
    Tensor dx_rows;
    bool   reduced = false;   // on the tp-comm stream: the compute stream waits for its `done`
    if (split == Split::column && tp->rings()) {
        const bool captured = graph_being_captured() != nullptr;
        Stream &   on       = captured ? stream : *tp->overlap->stream;
        dx_rows = Tensor::empty({n / tp->size, in}, dx.dtype(), dx.device(), {MemoryKind::device, kActivationsPool});
        if (!captured) {
            stream.record(*tp->overlap->ready);
            on.wait(*tp->overlap->ready);
        }
        tp->group->reduce_scatter(dx, dx_rows, comm::ReduceOp::sum, &on);
        if (!captured) {
            on.record(*tp->overlap->done);
            reduced = true;
        }
    }
    if (fp8) {   // dW += fp8(dy)^T fp8(x) / (s_dy s_x)
        const Tensor dw32 = activation(dy.device(), weight.data.size(0), in, DType::f32);
        fp8_product(dy_in, fp8->backward, true, ctx.x, fp8->forward, false, dw32, Tensor(), Fp8Cast{fp8->blockwise, false, fp8->mxfp8},
                    delayed ? &d_dy_again : nullptr, delayed ? &d_x : nullptr);
        accumulate_grads(stream, {weight.main_grad}, [&](std::span<const Tensor> g) { ops.add_inplace(stream, g[0], dw32.view(g[0].shape())); });
    } else if (bias_in_gemm) {
        accumulate_grads(stream, {weight.main_grad, bias.main_grad.view({bias.main_grad.numel()})},
                         [&](std::span<const Tensor> g) { ops.gemm_weight_grad(stream, dy_in, ctx.x, g[0], g[1]); });
    } else {
        accumulate_grads(stream, {weight.main_grad}, [&](std::span<const Tensor> g) {
            ops.gemm(stream, dy_in, true, ctx.x, false, g[0], /*accumulate=*/true);
        });
    }
    if (split == Split::column) {   // each rank's output features contribute to dx
        if (dx_rows.defined()) {
            if (reduced) stream.wait(*tp->overlap->done);
            dx = dx_rows;
        } else if (tp->sp()) {
            dx = tp->reduce_scatter(dx);
        } else {
            tp->all_reduce(dx);
        }
    }
    if (gelu_input.defined() && summed) ops.gelu_backward(stream, gelu_input, dx, dx);
    ctx.x          = Tensor();
    ctx.fp8_scales = Tensor();
    if (ready) {
        ready(weight);
        if (has_bias) ready(bias);
    }
    return dx;
}

// ---------------------------------------------------------------------------------------------------
// Norm

Norm::Norm(const std::string & name, int64_t h, Normalization k, float e, DType dtype, Device & device,
           const TensorParallel & tp)
    : weight(parameter_create(name + ".weight", {h}, dtype, device)), kind(k), eps(e) {
    weight.no_weight_decay = true;
    tp.replicated(weight);
    if (kind == Normalization::layernorm) {
        bias                 = parameter_create(name + ".bias", {h}, dtype, device);
        bias.no_weight_decay = true;
        tp.replicated(bias);
    }
}

void Norm::set_one_plus(bool one_plus) {
    one_plus_ = one_plus;
    if (!one_plus_ || ones_.defined()) return;
    ones_ = Tensor::empty({weight.data.numel()}, DType::f32, weight.data.device());
    write_values_f32(ones_, std::vector<float>(static_cast<size_t>(weight.data.numel()), 1.0f));
}

Tensor Norm::scale() const {
    Tensor w = parameter_f32(weight);
    if (!one_plus_) return w;
    Device & device = weight.data.device();
    Tensor   g      = Tensor::empty({weight.data.numel()}, DType::f32, device, {MemoryKind::device, kActivationsPool});
    device.ops().copy(device.compute_stream(), w, g);
    device.ops().add_inplace(device.compute_stream(), g, ones_);
    return g;
}

void Norm::init() {
    parameter_init_constant(weight, one_plus_ ? 0.0f : 1.0f);
    if (kind == Normalization::layernorm) parameter_init_constant(bias, 0.0f);
}

void Norm::parameters(std::vector<Parameter *> & out) {
    out.push_back(&weight);
    if (kind == Normalization::layernorm) out.push_back(&bias);
}

Tensor Norm::forward(Context & ctx, const Tensor & x, const Tensor * residual) {
    int64_t  n = x.size(0), h = x.size(1);
    Tensor   y = activation(x.device(), n, h, x.dtype());
    Tensor   w = scale();
    Ops &    ops    = x.device().ops();
    Stream & stream = x.device().compute_stream();
    ctx.rstd = activation(x.device(), n, 1);
    if (kind == Normalization::layernorm) {
        ctx.mean = activation(x.device(), n, 1);
        ops.layernorm_forward(stream, x, residual ? *residual : Tensor(), w, parameter_f32(bias), y, ctx.mean, ctx.rstd, eps);
    } else {
        ops.rmsnorm_forward(stream, x, residual ? *residual : Tensor(), w, y, ctx.rstd, eps);
    }
    ctx.x = x;
    return y;
}

Tensor Norm::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready, const Tensor & dresidual) {
    int64_t  n = dy.size(0), h = dy.size(1);
    Tensor   dx = activation(dy.device(), n, h, dy.dtype());
    Tensor   w  = scale();
    Ops &    ops    = dy.device().ops();
    Stream & stream = dy.device().compute_stream();
    accumulate_grads(stream, {weight.main_grad, bias.main_grad}, [&](std::span<const Tensor> g) {
        if (kind == Normalization::layernorm) {
            ops.layernorm_backward(stream, dy, ctx.x, w, ctx.mean, ctx.rstd, dx, g[0], g[1], dresidual);
        } else {
            ops.rmsnorm_backward(stream, dy, ctx.x, w, ctx.rstd, dx, g[0], dresidual);
        }
    });
    ctx = Context{};
    if (ready) {
        ready(weight);
        if (kind == Normalization::layernorm) ready(bias);
    }
    return dx;
}

// ---------------------------------------------------------------------------------------------------
// SelfAttention

RopeScaling mla_rope(const GptConfig & c) {
    RopeScaling y;
    if (!c.mla_yarn) return y;
    y.factor    = c.rotary_scaling_factor;
    y.amplitude = static_cast<float>(yarn_mscale(c.rotary_scaling_factor, c.mscale) /
                                     yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim));
    return y;
}

void require_supported(Device & device, const OpQuery & query, const char * flags) {
    const OpSupport support = device.ops().supports(query);
    LOOM_CHECK(support.ok, support.why << ": " << flags << " ask for more than " << device.name() << " runs",
               "choose sizes within that limit, or train on another device (--device cpu runs every size)");
}

SelfAttention::SelfAttention(const std::string & name, const GptConfig & c, Device & device, const TensorParallel & t,
                             const ContextParallel & context, int64_t layer)
    : config(c), tp(t), cp(context), cp_comm(context.comm_type(layer)), heads(c.num_attention_heads / t.size),
      groups(c.num_query_groups / t.size),
      qkv(name + ".qkv", c.hidden_size,
          c.multi_latent_attention || c.is_linear_attention_layer(layer)
              ? 0
              : (heads + 2 * groups + (c.attention_output_gate ? heads : 0)) * c.head_dim(),
          c.add_bias_linear && !c.multi_latent_attention, c.params_dtype, device,
          t.size > 1 ? Linear::Split::column : Linear::Split::none, &tp),
      proj(name + ".proj",
           c.is_linear_attention_layer(layer) ? 0 : heads * (c.multi_latent_attention ? c.v_head_dim : c.head_dim()),
           c.hidden_size, c.add_bias_linear, c.params_dtype, device, t.size > 1 ? Linear::Split::row : Linear::Split::none,
           &tp) {
    layer_ = layer;
    if (c.is_linear_attention_layer(layer)) {
        gdn = std::make_unique<GatedDeltaNet>(name, c, device, t, context);
        return;
    }
    if (cp.enabled() && cp_comm == CpCommType::a2a) {   // Megatron's check for the all-to-all of heads
        LOOM_CHECK(heads % cp.size == 0 && groups % cp.size == 0,
                   "--cp-comm-type a2a needs each tensor-parallel rank's " << heads << " attention heads and " << groups
                       << " query groups divisible by --context-parallel-size " << cp.size,
                   "give --cp-comm-type p2p or allgather, or heads (and query groups) divisible by TP x CP");
    }
    if (cp.enabled() && cp_comm == CpCommType::a2a_p2p) {
        LOOM_CHECK(cp.inner && cp.outer, "--cp-comm-type a2a+p2p without its inner and outer groups",
                   "give --hierarchical-context-parallel-sizes");
        const int inner = cp.inner->size();
        LOOM_CHECK(heads % inner == 0 && groups % inner == 0,
                   "--cp-comm-type a2a+p2p needs each tensor-parallel rank's " << heads << " attention heads and " << groups
                       << " query groups divisible by the all-to-all's size " << inner,
                   "choose --hierarchical-context-parallel-sizes whose first size divides the heads");
    }
    LOOM_CHECK(!c.attention_output_gate || !cp.enabled() || cp_comm == CpCommType::p2p || cp_comm == CpCommType::allgather,
               "--attention-output-gate with --cp-comm-type " << (cp_comm == CpCommType::a2a ? "a2a" : "a2a+p2p")
                                                              << " is not supported by Loom",
               "give --cp-comm-type p2p or allgather, which Loom runs with the output gate");
    if (c.softmax_type != SoftmaxType::vanilla) {
        LOOM_CHECK(!cp.enabled() || cp_comm != CpCommType::a2a_p2p,
                   "--softmax-type " << (c.softmax_type == SoftmaxType::learnable ? "learnable" : "off-by-one")
                                     << " with --cp-comm-type a2a+p2p is not supported by Loom",
                   "give --cp-comm-type p2p, allgather or a2a, which Loom runs with attention sinks");
        if (c.softmax_type == SoftmaxType::learnable) {
            // Megatron's DotProductAttention.softmax_offset: one logit per head, this rank's heads under TP; a
            // vector, so no weight decay (Megatron's param groups).
            softmax_offset = parameter_create(name + ".softmax_offset", {heads}, c.params_dtype, device);
            softmax_offset->no_weight_decay = true;
            if (t.size > 1) set_tp_slice(*softmax_offset, 0, {{t.rank * heads, (t.rank + 1) * heads}}, {c.num_attention_heads});
        } else {
            zero_offset = Tensor::empty({heads}, DType::f32, device);
            write_values_f32(zero_offset, std::vector<float>(static_cast<size_t>(heads), 0.0f));
        }
    }
    if (c.multi_latent_attention) {
        // Megatron's MLA under tensor parallelism: the down projections and the latents' norms are whole on
        // every rank (each rank's rows with sequence parallelism, their gradients then summed over the
        // group), the up projections and Q split by heads, the output projection by its input.
        LOOM_CHECK(c.num_attention_heads % t.size == 0, "--num-attention-heads " << c.num_attention_heads
                                                        << " must be divisible by --tensor-model-parallel-size " << t.size, "");
        require_supported(device, {"attention_forward", c.mla_qk_dim(), 0}, "--qk-head-dim + --qk-pos-emb-head-dim");
        const int64_t h = c.hidden_size, a = c.num_attention_heads, dqk = c.mla_qk_dim();
        const int64_t rkv = c.kv_lora_rank, dr = c.qk_pos_emb_head_dim, dkv = c.qk_head_dim + c.v_head_dim;
        auto whole = [&](const char * which, int64_t in, int64_t out) {
            auto l = std::make_unique<Linear>(name + which, in, out, false, c.params_dtype, device);
            tp.replicated(l->weight);
            return l;
        };
        // This rank's heads' rows (`width` each) of the full (a width, in) weight.
        auto by_heads = [&](const char * which, int64_t in, int64_t width) {
            auto l = std::make_unique<Linear>(name + which, in, heads * width, false, c.params_dtype, device,
                                              t.size > 1 ? Linear::Split::column : Linear::Split::none, &tp);
            if (t.size > 1) set_tp_slice(l->weight, 0, {{t.rank * heads * width, (t.rank + 1) * heads * width}}, {a * width, in});
            return l;
        };
        auto norm = [&](const char * which, int64_t width) {
            auto n = std::make_unique<Norm>(name + which, width, c.normalization, c.norm_epsilon, c.params_dtype, device, tp);
            n->set_one_plus(c.apply_layernorm_1p);
            return n;
        };
        mla = std::make_unique<Latent>();
        if (c.q_lora_rank > 0) {
            mla->q_down = whole(".q_down", h, c.q_lora_rank);
            if (c.qk_layernorm) {
                mla->q_norm = norm(".q_norm", c.q_lora_rank);
                // Megatron's param groups decay a "q_layernorm" with --apply-wd-to-qk-layernorm (its
                // "kv_layernorm" matches neither that nor "k_layernorm": never).
                std::vector<Parameter *> params;
                mla->q_norm->parameters(params);
                for (Parameter * p : params) p->no_weight_decay = !c.apply_wd_to_qk_layernorm;
            }
            mla->q_up = by_heads(".q_up", c.q_lora_rank, dqk);
        } else {
            mla->q = by_heads(".q", h, dqk);
        }
        mla->kv_down = whole(".kv_down", h, rkv + dr);
        if (c.qk_layernorm) mla->kv_norm = norm(".kv_norm", rkv);
        mla->kv_up = by_heads(".kv_up", rkv, dkv);
        if (c.dsa_computes_topk(layer)) {   // the others take an earlier layer's top-k (dsa_topk_source)
            // Under context parallelism its queries are this rank's rows, its keys the whole sequences' (allgather).
            LOOM_CHECK(!cp.enabled() || cp_comm == CpCommType::allgather,
                       "the DSA indexer of " << name << " under --cp-comm-type other than allgather", "");
            indexer = std::make_unique<DsaIndexer>(name + ".indexer", c, device, tp, cp);
        }
        if (t.size > 1) {
            set_tp_slice(proj.weight, 1, {{t.rank * heads * c.v_head_dim, (t.rank + 1) * heads * c.v_head_dim}},
                         {h, a * c.v_head_dim});
        }
        return;
    }
    require_supported(device, {"attention_forward", c.head_dim(), 0}, "--hidden-size / --num-attention-heads");
    LOOM_CHECK(c.num_attention_heads % t.size == 0 && c.num_query_groups % t.size == 0,
               "--num-attention-heads " << c.num_attention_heads << " and --num-query-groups " << c.num_query_groups
                                        << " must be divisible by --tensor-model-parallel-size " << t.size, "");
    qkv.weight.fused_rows = {heads * c.head_dim(), groups * c.head_dim(), groups * c.head_dim()};
    if (c.attention_output_gate) qkv.weight.fused_rows.push_back(heads * c.head_dim());   // G: a block of its own for Muon
    if (t.size > 1) {
        // This rank's heads' Q rows, then its groups' K rows, then their V rows (then its heads' gate rows) of the
        // full [Q | K | V | G].
        const int64_t d = c.head_dim(), a = c.num_attention_heads, g = c.num_query_groups;
        std::vector<std::pair<int64_t, int64_t>> rows{{t.rank * heads * d, (t.rank + 1) * heads * d},
                                                      {a * d + t.rank * groups * d, a * d + (t.rank + 1) * groups * d},
                                                      {(a + g) * d + t.rank * groups * d, (a + g) * d + (t.rank + 1) * groups * d}};
        const int64_t full = (a + 2 * g + (c.attention_output_gate ? a : 0)) * d;
        if (c.attention_output_gate) rows.push_back({(a + 2 * g) * d + t.rank * heads * d, (a + 2 * g) * d + (t.rank + 1) * heads * d});
        set_tp_slice(qkv.weight, 0, rows, {full, c.hidden_size});
        if (qkv.has_bias) set_tp_slice(qkv.bias, 0, rows, {full});
        set_tp_slice(proj.weight, 1, {{t.rank * heads * d, (t.rank + 1) * heads * d}}, {c.hidden_size, a * d});
    }
    if (c.qk_layernorm) {
        for (auto [norm, which] : {std::pair{&q_norm, ".q_norm"}, {&k_norm, ".k_norm"}}) {
            *norm = std::make_unique<Norm>(name + which, c.head_dim(), c.normalization, c.norm_epsilon, c.params_dtype, device);
            (*norm)->set_one_plus(c.apply_layernorm_1p);
            std::vector<Parameter *> params;
            (*norm)->parameters(params);
            for (Parameter * p : params) {   // every TP rank holds it whole and feeds it its own heads
                p->tp_duplicate      = t.rank != 0;
                p->sequence_parallel = t.size > 1;
                p->no_weight_decay   = !c.apply_wd_to_qk_layernorm;   // Megatron's special case of its param groups
            }
        }
    }
}

namespace {

// The norm of `count` heads of d starting at column `col` of each row of qkv (n, w), in place: the heads
// are copied out to (n count, d) rows, normalised, and the result copied back.
void head_norm_forward(Norm & norm, Norm::Context & ctx, const Tensor & qkv, int64_t col, int64_t count, int64_t d) {
    Ops &    ops    = qkv.device().ops();
    Stream & stream = qkv.device().compute_stream();
    const int64_t n = qkv.size(0);
    Tensor heads = activation(qkv.device(), n, count * d, qkv.dtype());
    ops.copy_columns(stream, qkv, col, heads, 0, count * d);
    Tensor y = norm.forward(ctx, heads.view({n * count, d}));
    ops.copy_columns(stream, y.view({n, count * d}), 0, qkv, col, count * d);
}

// Its backward on the gradient dqkv, in place; adds into the norm's parameter gradients.
void head_norm_backward(Norm & norm, Norm::Context & ctx, const Tensor & dqkv, int64_t col, int64_t count, int64_t d,
                        const GradReadyFn & ready) {
    Ops &    ops    = dqkv.device().ops();
    Stream & stream = dqkv.device().compute_stream();
    const int64_t n = dqkv.size(0);
    Tensor dy = activation(dqkv.device(), n, count * d, dqkv.dtype());
    ops.copy_columns(stream, dqkv, col, dy, 0, count * d);
    Tensor dx = norm.backward(ctx, dy.view({n * count, d}), ready);
    ops.copy_columns(stream, dx.view({n, count * d}), 0, dqkv, col, count * d);
}

}  // namespace

SelfAttention::~SelfAttention() = default;

void SelfAttention::init(uint64_t seed, float std, float output_std) {
    if (gdn) {
        gdn->init(seed, std, output_std);
        return;
    }
    if (mla) {   // Megatron's: every projection with the init method, the output one scaled, norms at one
        for (Linear * l : {mla->q.get(), mla->q_down.get(), mla->q_up.get(), mla->kv_down.get(), mla->kv_up.get()}) {
            if (l) l->init(seed, std);
        }
        for (Norm * n : {mla->q_norm.get(), mla->kv_norm.get()}) {
            if (n) n->init();
        }
        if (indexer) indexer->init(seed, std);
        proj.init(seed, output_std);
        if (softmax_offset) parameter_init_normal(*softmax_offset, seed, std);
        return;
    }
    if (softmax_offset) parameter_init_normal(*softmax_offset, seed, std);   // Megatron's init_method
    qkv.init(seed, std);
    proj.init(seed, output_std);
    if (q_norm) {
        q_norm->init();
        k_norm->init();
    }
}

void SelfAttention::parameters(std::vector<Parameter *> & out) {
    if (gdn) {
        gdn->parameters(out);
        return;
    }
    if (mla) {   // in forward order
        if (mla->q) mla->q->parameters(out);
        if (mla->q_down) mla->q_down->parameters(out);
        if (mla->q_norm) mla->q_norm->parameters(out);
        if (mla->q_up) mla->q_up->parameters(out);
        mla->kv_down->parameters(out);
        if (mla->kv_norm) mla->kv_norm->parameters(out);
        mla->kv_up->parameters(out);
        if (indexer) indexer->parameters(out);
        if (softmax_offset) out.push_back(&*softmax_offset);
        proj.parameters(out);
        return;
    }
    qkv.parameters(out);
    if (q_norm) {
        q_norm->parameters(out);
        k_norm->parameters(out);
    }
    if (softmax_offset) out.push_back(&*softmax_offset);
    proj.parameters(out);
}

namespace {

AttentionShape attention_shape(const GptConfig & c, int64_t heads, int64_t groups, int64_t s, int64_t b,
                               const ContextParallel & cp, int64_t window) {
    int64_t        d = c.head_dim();
    // QKV's rows hold [Q | K | V] of this rank's heads and groups, then with --attention-output-gate its heads' gates.
    AttentionShape shape{s, b, heads, groups, d, (heads + 2 * groups + (c.attention_output_gate ? heads : 0)) * d};
    shape.q_pos = shape.k_pos = cp.positions(s);
    shape.window = window;
    return shape;
}

// --attention-output-gate: the first gate column of QKV's rows, after [Q | K | V].
int64_t gate_column(const AttentionShape & shape) { return (shape.nq + 2 * shape.nkv) * shape.d; }

}  // namespace

namespace {

// MLA's softmax scale, YaRN's mscale(f, mscale_all_dim)^2 / sqrt(dqk) (core/rope.h).
float mla_softmax_scale(const GptConfig & c) {
    const double m = yarn_mscale(c.rotary_scaling_factor, c.mscale_all_dim);
    return static_cast<float>(m * m / std::sqrt(static_cast<double>(c.mla_qk_dim())));
}

// MLA's attention operands: a query and a key/value head per head, each of dn + dr (V padded), rows of
// [Q heads | K heads | V heads].
AttentionShape mla_shape(const GptConfig & c, int64_t heads, int64_t s, int64_t b, const ContextParallel & cp,
                         int64_t window) {
    const int64_t  dqk = c.mla_qk_dim();
    AttentionShape shape{s, b, heads, heads, dqk, 3 * heads * dqk};
    shape.q_pos = shape.k_pos = cp.positions(s);
    shape.window = window;
    return shape;
}

}  // namespace

void SelfAttention::sink_forward(const Tensor & out, const Tensor & lse, const AttentionShape & shape, int64_t first) const {
    if (!softmax_offset && !zero_offset.defined()) return;
    const Tensor logits = softmax_offset ? parameter_f32(*softmax_offset) : zero_offset;
    out.device().ops().attention_sink_forward(out.device().compute_stream(), out, lse, logits.narrow(0, first, shape.nq), shape);
}

void SelfAttention::sink_backward(const Tensor & out, const Tensor & d_out, const Tensor & lse, const AttentionShape & shape,
                                  int64_t first) {
    if (!softmax_offset) return;   // off-by-one's zeros take no gradient
    Ops &        ops    = out.device().ops();
    Stream &     stream = out.device().compute_stream();
    const Tensor logits = parameter_f32(*softmax_offset);
    accumulate_grads(stream, {softmax_offset->main_grad}, [&](std::span<const Tensor> g) {
        ops.attention_sink_backward(stream, out, d_out, lse, logits.narrow(0, first, shape.nq),
                                    g[0].narrow(0, first, shape.nq), shape);
    });
}

void SelfAttention::attend(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape,
                           float scale, const Dropout & dropout) {
    if (!cp.enabled()) {
        q_k_v.device().ops().attention_forward(q_k_v.device().compute_stream(), q_k_v, out, ctx.lse, shape, scale, dropout);
        sink_forward(out, ctx.lse, shape, 0);
        return;
    }
    // The forward reads q_k_v as computed; backward reads ctx.qkv, the same values (rounded first). The
    // blocks are merged in f32 (attention_merge): bf16 activations are widened around the exchanges.
    const Tensor out32 = f32_output_for(out);
    cp_forward(ctx, in_dtype(q_k_v, DType::f32), out32, shape, scale, dropout);
    if (out32.data_ptr() != out.data_ptr()) q_k_v.device().ops().convert(q_k_v.device().compute_stream(), out32, out);
}

void SelfAttention::attend_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                                    const Tensor & d_qkv, const AttentionShape & shape, float scale) {
    Ops &    ops    = q_k_v.device().ops();
    Stream & stream = q_k_v.device().compute_stream();
    if (!cp.enabled()) {
        ops.attention_backward(stream, q_k_v, out, d_out, ctx.lse, d_qkv, shape, scale, ctx.dropout);
        sink_backward(out, d_out, ctx.lse, shape, 0);
        return;
    }
    // The ring's and the gather's lse is this rank's queries' over every head (a2a's: its own heads, there).
    if (cp_comm == CpCommType::p2p || cp_comm == CpCommType::allgather) {
        sink_backward(in_dtype(out, DType::f32), in_dtype(d_out, DType::f32), ctx.lse, shape, 0);
    }
    const Tensor d_qkv32 = f32_output_for(d_qkv);   // in f32, as the forward
    cp_backward(ctx, in_dtype(q_k_v, DType::f32), in_dtype(out, DType::f32), in_dtype(d_out, DType::f32), d_qkv32,
                shape, scale);
    if (d_qkv32.data_ptr() != d_qkv.data_ptr()) ops.convert(stream, d_qkv32, d_qkv);
}

Tensor SelfAttention::mla_packed_rows(const Tensor & q, const Tensor & kv, const Tensor & k_pe, int64_t s, int64_t b) const {
    const AttentionShape shape  = mla_shape(config, heads, s, b, cp, window);
    Ops &                ops    = q.device().ops();
    Stream &             stream = q.device().compute_stream();
    const int64_t a = heads, dn = config.qk_head_dim, dr = config.qk_pos_emb_head_dim, dv = config.v_head_dim, dqk = dn + dr;
    Tensor q_k_v = activation(q.device(), s * b, shape.row_stride, q.dtype());
    ops.fill_zero(stream, q_k_v);   // V's padding
    for (int64_t h = 0; h < a; ++h) {
        ops.copy_columns(stream, q, h * dqk + dn, q_k_v, h * dqk, dr);                     // q_pe
        ops.copy_columns(stream, q, h * dqk, q_k_v, h * dqk + dr, dn);                     // q_nope
        ops.copy_columns(stream, k_pe, 0, q_k_v, (a + h) * dqk, dr);                       // k_pe, every head's
        ops.copy_columns(stream, kv, h * (dn + dv), q_k_v, (a + h) * dqk + dr, dn);        // k_nope
        ops.copy_columns(stream, kv, h * (dn + dv) + dn, q_k_v, (2 * a + h) * dqk, dv);    // v
    }
    ops.rope(stream, q_k_v, s, b, 2 * a, dqk, config.rotary_base, false, dr, /*interleaved=*/true, shape.q_pos,
             mla_rope(config));
    return q_k_v;
}

void SelfAttention::release_input(Context & ctx) const {
    if (gdn) {
        gdn->release_input(*ctx.linear);
        return;
    }
    if (!mla) {
        ctx.qkv_ctx.x = Tensor();
        return;
    }
    (mla->q ? ctx.latent.q : ctx.latent.q_down).x = Tensor();
    ctx.latent.kv_down.x = Tensor();
}

void SelfAttention::restore_input(Context & ctx, const Tensor & x_rows) const {
    if (gdn) {
        gdn->restore_input(*ctx.linear, x_rows);
        return;
    }
    if (!mla) {
        ctx.qkv_ctx.x = qkv.input_for_backward(x_rows);
        return;
    }
    if (mla->q) {
        ctx.latent.q.x = mla->q->input_for_backward(x_rows);
    } else {
        ctx.latent.q_down.x = mla->q_down->input_for_backward(x_rows);
    }
    ctx.latent.kv_down.x = mla->kv_down->input_for_backward(x_rows);
}

Tensor SelfAttention::mla_forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const Dropout & dropout) {
    const AttentionShape shape = mla_shape(config, heads, s, b, cp, window);
    Ops &          ops    = x.device().ops();
    Stream &       stream = x.device().compute_stream();
    const int64_t  a = heads, dn = config.qk_head_dim, dr = config.qk_pos_emb_head_dim, dv = config.v_head_dim;
    const int64_t  dqk = dn + dr, rkv = config.kv_lora_rank, n = s * b;   // every row (gathered under SP)
    Context::Latent & c = ctx.latent;
    ctx.s       = s;
    ctx.b       = b;
    ctx.dropout = config.dsa ? Dropout{} : dropout;
    Tensor q, q_latent;
    if (mla->q) {
        q = mla->q->forward(c.q, x);
    } else {
        q_latent = mla->q_down->forward(c.q_down, x);
        if (mla->q_norm) q_latent = mla->q_norm->forward(c.q_norm, q_latent);
        q = mla->q_up->forward(c.q_up, q_latent);
    }
    // This rank's rows (a block of them with sequence parallelism) down to [c | k_pe]; k_pe then for every row.
    const Tensor ckv    = mla->kv_down->forward(c.kv_down, x);   // (rows, rkv + dr)
    const int64_t rows  = x.size(0);
    Tensor       latent = activation(x.device(), rows, rkv, ckv.dtype());
    ops.copy_columns(stream, ckv, 0, latent, 0, rkv);
    Tensor k_pe = activation(x.device(), rows, dr, ckv.dtype());
    ops.copy_columns(stream, ckv, rkv, k_pe, 0, dr);
    if (tp.sp()) k_pe = tp.all_gather(k_pe);
    if (mla->kv_norm) latent = mla->kv_norm->forward(c.kv_norm, latent);
    const Tensor kv = mla->kv_up->forward(c.kv_up, latent);       // (n, a (dn + dv))
    Tensor q_k_v = mla_packed_rows(q, kv, k_pe, s, b);
    ctx.qkv    = keep_for_backward(q_k_v, config.params_dtype);
    Tensor out = activation(x.device(), n, a * dqk, q_k_v.dtype());
    ctx.lse    = activation(x.device(), b * a, s);
    // DSA: the indexer scores every row's keys (from every row of x and the q latent) when it picks fewer than all
    // of them or learns in this pass; the attention then sees each row's top k. Its attention has no dropout
    // (Megatron's DSAttention has none).
    // With --dsa-indexer-topk-freq > 1 a layer without an indexer takes its source layer's selection from this
    // micro-batch's forward (ctx.dsa_topk, the model's per-forward record), and a layer with one records its own.
    ctx.indexer.reset();
    ctx.key_mask = Tensor();
    const bool learns = indexer && ctx.training && config.dsa_indexer_loss_coeff > 0.0f;
    Tensor     scores;
    if (indexer && (learns || config.dsa_indexer_topk < s * cp.size)) {
        auto ictx    = std::make_shared<DsaIndexerContext>();
        scores       = indexer->score(*ictx, tp.sp() ? tp.all_gather(x) : x, tp.sp() ? tp.all_gather(q_latent) : q_latent,
                                      s, b);
        ctx.key_mask = indexer->select(scores);
        if (learns) ctx.indexer = std::move(ictx);
    }
    if (config.dsa && ctx.dsa_topk != nullptr) {
        const int64_t source = config.dsa_topk_source(layer_);
        if (source == layer_) {
            (*ctx.dsa_topk)[layer_] = ctx.key_mask;
        } else {
            const auto found = ctx.dsa_topk->find(source);
            LOOM_CHECK(found != ctx.dsa_topk->end(),
                       "DSA layer " << layer_ + 1 << " takes the top-k of layer " << source + 1
                                    << ", which has not run in this forward",
                       "the flags keep a layer and its --dsa-indexer-topk-freq source on one pipeline chunk");
            ctx.key_mask = found->second;
        }
    }
    AttentionShape attended = shape;
    attended.key_mask       = ctx.key_mask;
    // Under context parallelism the selection attends to (and the indexer's target reads) the whole sequences' keys,
    // gathered once for both.
    const bool whole = cp.enabled() && (ctx.key_mask.defined() || learns);
    if (whole) ctx.whole_kv = whole_kv(in_dtype(q_k_v, DType::f32), shape);
    attend(ctx, q_k_v, out, attended, mla_softmax_scale(config), config.dsa ? Dropout{} : dropout);
    if (learns) {
        indexer->loss_forward(*ctx.indexer, scores, whole ? in_dtype(q_k_v, DType::f32) : q_k_v, ctx.whole_kv,
                              whole ? against_whole_kv(shape, cp.size) : shape, mla_softmax_scale(config), ctx.key_mask,
                              !ctx.recomputing);
    }
    ctx.whole_kv = Tensor();
    if (config.recompute_mla_up_proj) {   // backward builds the rows again from the latents and k_pe
        ctx.qkv = Tensor();
        c.k_pe  = k_pe;
    }
    Tensor out_v = activation(x.device(), n, a * dv, out.dtype());
    for (int64_t h = 0; h < a; ++h) ops.copy_columns(stream, out, h * dqk, out_v, h * dv, dv);
    return proj.forward(ctx.proj_ctx, out_v);
}

Tensor SelfAttention::mla_backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    const AttentionShape shape = mla_shape(config, heads, ctx.s, ctx.b, cp, window);
    Ops &          ops    = dy.device().ops();
    Stream &       stream = dy.device().compute_stream();
    Device &       device = dy.device();
    const int64_t  a = heads, dn = config.qk_head_dim, dr = config.qk_pos_emb_head_dim, dv = config.v_head_dim;
    const int64_t  dqk = dn + dr, rkv = config.kv_lora_rank, n = ctx.s * ctx.b;
    const DType    act = dy.dtype();
    Context::Latent & c = ctx.latent;
    // The attention's output and its gradient, padded back to dn + dr per head (the padding columns of the
    // output are exactly 0: V's are).
    const Tensor out_v   = in_dtype(ctx.proj_ctx.x, act);   // before proj.backward releases it
    const Tensor d_out_v = proj.backward(ctx.proj_ctx, dy, ready);
    Tensor       out = activation(device, n, a * dqk, act), d_out = activation(device, n, a * dqk, act);
    ops.fill_zero(stream, out);
    ops.fill_zero(stream, d_out);
    for (int64_t h = 0; h < a; ++h) {
        ops.copy_columns(stream, out_v, h * dv, out, h * dqk, dv);
        ops.copy_columns(stream, d_out_v, h * dv, d_out, h * dqk, dv);
    }
    if (!ctx.qkv.defined()) {   // --recompute-modules mla_up_proj: the up projections and RoPE again
        const Tensor q  = mla->q ? mla->q->recompute(c.q, act) : mla->q_up->recompute(c.q_up, act);
        Tensor       rows = mla_packed_rows(q, mla->kv_up->recompute(c.kv_up, act), c.k_pe, ctx.s, ctx.b);
        ctx.qkv = keep_for_backward(rows, config.params_dtype);   // rounded as forward kept them
        c.k_pe  = Tensor();
    }
    const Tensor q_k_v = in_dtype(ctx.qkv, act);
    Tensor       d_qkv = activation(device, n, shape.row_stride, act);
    AttentionShape attended = shape;
    attended.key_mask       = ctx.key_mask;   // DSA's top k, as forward attended
    attend_backward(ctx, q_k_v, out, d_out, d_qkv, attended, mla_softmax_scale(config));
    ctx.key_mask = Tensor();
    if (softmax_offset && ready) ready(*softmax_offset);
    ops.rope(stream, d_qkv, ctx.s, ctx.b, 2 * a, dqk, config.rotary_base, true, dr, /*interleaved=*/true, shape.q_pos,
             mla_rope(config));
    ctx.qkv = ctx.lse = Tensor();
    ctx.dropout       = Dropout{};
    // Back to the projections' layouts; k_pe's gradient sums every head's.
    Tensor dq = activation(device, n, a * dqk, act), dkv = activation(device, n, a * (dn + dv), act);
    Tensor dckv, dk_pe = activation(device, n, dr, act);
    Tensor head_pe = activation(device, n, dr, act);
    for (int64_t h = 0; h < a; ++h) {
        ops.copy_columns(stream, d_qkv, h * dqk, dq, h * dqk + dn, dr);
        ops.copy_columns(stream, d_qkv, h * dqk + dr, dq, h * dqk, dn);
        ops.copy_columns(stream, d_qkv, (a + h) * dqk + dr, dkv, h * (dn + dv), dn);
        ops.copy_columns(stream, d_qkv, (2 * a + h) * dqk, dkv, h * (dn + dv) + dn, dv);
        ops.copy_columns(stream, d_qkv, (a + h) * dqk, h == 0 ? dk_pe : head_pe, 0, dr);
        if (h > 0) ops.add_inplace(stream, dk_pe, head_pe);
    }
    // This rank's heads' share of k_pe's gradient: summed over the group (and cut to this rank's rows with SP).
    if (tp.sp()) {
        dk_pe = tp.reduce_scatter(dk_pe);
    } else {
        tp.all_reduce(dk_pe);
    }
    Tensor dlatent = mla->kv_up->backward(c.kv_up, dkv, ready);   // this rank's rows
    if (mla->kv_norm) dlatent = mla->kv_norm->backward(c.kv_norm, dlatent, ready);
    dckv = activation(device, dlatent.size(0), rkv + dr, act);
    ops.copy_columns(stream, dlatent, 0, dckv, 0, rkv);
    ops.copy_columns(stream, dk_pe, 0, dckv, rkv, dr);
    Tensor dx = mla->kv_down->backward(c.kv_down, dckv, ready);
    Tensor dx_q;
    if (mla->q) {
        dx_q = mla->q->backward(c.q, dq, ready);
    } else {
        Tensor dq_latent = mla->q_up->backward(c.q_up, dq, ready);
        if (mla->q_norm) dq_latent = mla->q_norm->backward(c.q_norm, dq_latent, ready);
        dx_q = mla->q_down->backward(c.q_down, dq_latent, ready);
    }
    ops.add_inplace(stream, dx, dx_q);
    if (indexer) {   // its loss's gradients, which reach its own weights only
        if (ctx.indexer) {
            indexer->backward(*ctx.indexer, ready);
        } else {
            indexer->skip_backward(ready);
        }
        ctx.indexer.reset();
    }
    return dx;
}

Tensor SelfAttention::forward(Context & ctx, const Tensor & x, int64_t s, int64_t b, const Dropout & dropout) {
    if (gdn) {
        if (!ctx.linear) ctx.linear = std::make_shared<GatedDeltaNetContext>();
        return gdn->forward(*ctx.linear, x, s, b);
    }
    if (mla) return mla_forward(ctx, x, s, b, dropout);
    AttentionShape shape  = attention_shape(config, heads, groups, s, b, cp, window);
    Ops &          ops    = x.device().ops();
    Stream &       stream = x.device().compute_stream();
    ctx.s       = s;
    ctx.b       = b;
    ctx.dropout = dropout;
    Tensor q_k_v = qkv.forward(ctx.qkv_ctx, x);
    if (q_norm) {
        head_norm_forward(*q_norm, ctx.q_norm, q_k_v, 0, shape.nq, shape.d);
        head_norm_forward(*k_norm, ctx.k_norm, q_k_v, shape.nq * shape.d, shape.nkv, shape.d);
    }
    if (config.position_embedding == PositionEmbedding::rope) {
        // Q and K heads are adjacent in each row: rotate nq + nkv heads at once.
        ops.rope(stream, q_k_v, s, b, shape.nq + shape.nkv, shape.d, config.rotary_base, false, config.rotary_dim(),
                 config.rotary_interleaved, shape.q_pos);
    }
    ctx.qkv    = keep_for_backward(q_k_v, config.params_dtype);
    Tensor out = activation(x.device(), s * b, shape.nq * shape.d, q_k_v.dtype());
    ctx.lse    = activation(x.device(), b * shape.nq, s);
    attend(ctx, q_k_v, out, shape, config.softmax_scale > 0.0f ? config.softmax_scale : 1.0f / std::sqrt(static_cast<float>(shape.d)), dropout);
    if (config.attention_output_gate) {   // out * sigmoid(G), G the gate columns after [Q | K | V]
        Tensor gated = activation(x.device(), s * b, shape.nq * shape.d, out.dtype());
        ops.output_gate_forward(stream, out, q_k_v, gate_column(shape), gated, GateActivation::sigmoid);
        ctx.ungated = keep_for_backward(out, config.params_dtype);
        out         = gated;
    }
    return proj.forward(ctx.proj_ctx, out);   // keeps `out` (in the parameters' dtype) for both backwards
}

Tensor SelfAttention::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    if (gdn) return gdn->backward(*ctx.linear, dy, ready);
    if (mla) return mla_backward(ctx, dy, ready);
    AttentionShape shape  = attention_shape(config, heads, groups, ctx.s, ctx.b, cp, window);
    Ops &          ops    = dy.device().ops();
    Stream &       stream = dy.device().compute_stream();
    const DType act = dy.dtype();
    // The attention's output (before the gate, with one), read before proj.backward releases it.
    Tensor out   = in_dtype(config.attention_output_gate ? ctx.ungated : ctx.proj_ctx.x, act);
    Tensor d_out = proj.backward(ctx.proj_ctx, dy, ready);
    Tensor q_k_v = in_dtype(ctx.qkv, act);
    Tensor d_qkv = activation(dy.device(), ctx.s * ctx.b, shape.row_stride, act);
    Tensor d_gate;
    if (config.attention_output_gate) {   // d_out becomes the ungated output's gradient, in place
        d_gate = activation(dy.device(), ctx.s * ctx.b, shape.nq * shape.d, act);
        ops.output_gate_backward(stream, out, q_k_v, gate_column(shape), d_out, d_out, d_gate, GateActivation::sigmoid);
        ctx.ungated = Tensor();
    }
    attend_backward(ctx, q_k_v, out, d_out, d_qkv, shape, config.softmax_scale > 0.0f ? config.softmax_scale : 1.0f / std::sqrt(static_cast<float>(shape.d)));
    // After the attention's backward, which may write whole rows of d_qkv (context parallelism's f32 copy).
    if (d_gate.defined()) ops.copy_columns(stream, d_gate, 0, d_qkv, gate_column(shape), shape.nq * shape.d);
    if (softmax_offset && ready) ready(*softmax_offset);
    if (config.position_embedding == PositionEmbedding::rope) {
        ops.rope(stream, d_qkv, ctx.s, ctx.b, shape.nq + shape.nkv, shape.d, config.rotary_base, true,
                 config.rotary_dim(), config.rotary_interleaved, shape.q_pos);
    }
    if (q_norm) {   // K's first: its parameters' gradients are final first, in reverse forward order
        head_norm_backward(*k_norm, ctx.k_norm, d_qkv, shape.nq * shape.d, shape.nkv, shape.d, ready);
        head_norm_backward(*q_norm, ctx.q_norm, d_qkv, 0, shape.nq, shape.d, ready);
    }
    ctx.qkv = ctx.lse = Tensor();
    ctx.dropout       = Dropout{};
    return qkv.backward(ctx.qkv_ctx, d_qkv, ready);
}

// ---------------------------------------------------------------------------------------------------
// Context parallelism (ContextParallel in layers.h)

ContextParallel::Streams::Streams(Device & device)
    : stream(device.stream_create("cp-comm")), ready(device.event_create()), done(device.event_create()) {}

namespace {

// Tensors sent to the next rank of the CP ring, the previous rank's received in their place (an all-to-
// all with one non-empty block each way: deadlock-free on any transport, each rank sending and receiving
// at once). On the CP stream the transfers start once the compute stream has produced the tensors and
// run while it computes; arrive() makes the compute stream wait for them before it reads what came.
class RingPass {
public:
    // Around the ring of `ring` (the CP group, or a2a+p2p's outer group).
    RingPass(const ContextParallel & cp, std::initializer_list<Tensor> tensors, comm::Communicator * ring = nullptr)
    {
        comm::Communicator & group = ring ? *ring : *cp.group;
        const int            rank = group.rank(), size = group.size();
        Device &             dev     = tensors.begin()->device();
        Stream &             compute = dev.compute_stream();
        overlapped_ = cp.streams && graph_being_captured() == nullptr;
        Stream & on = overlapped_ ? *cp.streams->stream : compute;
        if (overlapped_) {
            compute.record(*cp.streams->ready);
            on.wait(*cp.streams->ready);
            done_ = dev.event_create();   // its own: another pass may be issued before this one arrives
        }
        for (const Tensor & t : tensors) {
            Tensor out = Tensor::empty(t.shape(), t.dtype(), dev, {MemoryKind::device, kActivationsPool});
            std::vector<int64_t> send(static_cast<size_t>(size), 0), recv(static_cast<size_t>(size), 0);
            send[static_cast<size_t>((rank + 1) % size)]        = t.numel();
            recv[static_cast<size_t>((rank - 1 + size) % size)] = t.numel();
            group.all_to_all(t, send, out, recv, &on);
            received_.push_back(out);
            sent_.push_back(t);
        }
        if (overlapped_) on.record(*done_);
    }
    // The received tensors, in the order sent, once the compute stream may read them.
    std::vector<Tensor> arrive() {
        if (overlapped_) received_.front().device().compute_stream().wait(*done_);
        return received_;
    }

private:
    bool                    overlapped_ = false;
    std::unique_ptr<Event>  done_;
    std::vector<Tensor>     received_;
    std::vector<Tensor>     sent_;   // read by the CP stream until done_: kept from reuse while the pass lives
};

// This rank's K | V (adjacent in each [Q | K | V] row) as a tensor of its own: the block that travels.
Tensor own_kv_block(const Tensor & q_k_v, const AttentionShape & shape) {
    Device &      dev      = q_k_v.device();
    const int64_t kv_width = 2 * shape.nkv * shape.d;
    Tensor        kv       = activation(dev, shape.s * shape.b, kv_width);
    dev.ops().copy_columns(dev.compute_stream(), q_k_v, shape.nq * shape.d, kv, 0, kv_width);
    return kv;
}

// `shape`'s queries against a separate K | V block of as many rows: rows of 2 nkv d, K first.
AttentionShape against_kv_block(const AttentionShape & shape) { return shape.against_kv(shape.keys()); }

// `shape`'s queries against the whole sequences' K | V blocks in position order (SelfAttention::whole_kv): CP s keys.
AttentionShape against_whole_kv(const AttentionShape & shape, int cp) {
    AttentionShape whole = shape.against_kv(shape.s * cp);
    whole.k_pos          = SeqPositions{};
    return whole;
}

// The all-to-all of heads over `group` (of `size` ranks): this rank's rows (n = s b) of every head ->
// every member's rows of this rank's share of the heads, member-major ((size n, width): block i is member
// i's rows). Block j of the exchange carries this rank's rows of member j's heads.
Tensor exchange_heads(comm::Communicator & group, int size, const Tensor & local, int64_t n,
                      const std::vector<HeadColumns> & columns) {
    Device & dev    = local.device();
    Ops &    ops    = dev.ops();
    Stream & stream = dev.compute_stream();
    int64_t  width  = 0;
    for (const HeadColumns & c : columns) width += c.width;
    Tensor send = activation(dev, size * n, width), recv = activation(dev, size * n, width);
    for (int j = 0; j < size; ++j) {
        const Tensor block = send.narrow(0, j * n, n);
        int64_t      at    = 0;
        for (const HeadColumns & c : columns) {
            ops.copy_columns(stream, local, c.base + j * c.width, block, at, c.width);
            at += c.width;
        }
    }
    const std::vector<int64_t> counts(static_cast<size_t>(size), n * width);
    group.all_to_all(send, counts, recv, counts, &stream);
    return recv;
}

// exchange_heads' inverse: member-major rows of this rank's heads -> this rank's rows of every head, into
// `local`'s columns.
void exchange_heads_back(comm::Communicator & group, int size, const Tensor & members, int64_t n,
                         const std::vector<HeadColumns> & columns, const Tensor & local) {
    Device &      dev    = members.device();
    Ops &         ops    = dev.ops();
    Stream &      stream = dev.compute_stream();
    const int64_t width  = members.size(1);
    Tensor        recv   = activation(dev, size * n, width);
    const std::vector<int64_t> counts(static_cast<size_t>(size), n * width);
    group.all_to_all(members, counts, recv, counts, &stream);
    for (int j = 0; j < size; ++j) {
        const Tensor block = recv.narrow(0, j * n, n);
        int64_t      at    = 0;
        for (const HeadColumns & c : columns) {
            ops.copy_columns(stream, block, at, local, c.base + j * c.width, c.width);
            at += c.width;
        }
    }
}

}  // namespace

Tensor ranks_to_sequence(const ContextParallel & cp, const Tensor & ranks, int64_t s, int64_t b) {
    Device &      dev = ranks.device();
    const int64_t n = s * b, chunk_rows = s / 2 * b;
    Tensor        whole = activation(dev, cp.size * n, ranks.size(1), ranks.dtype());
    for (int i = 0; i < cp.size; ++i) {   // rank i's chunks i and 2 CP - 1 - i
        const SeqPositions at = cp.positions(s, i);
        dev.ops().copy(dev.compute_stream(), ranks.narrow(0, i * n, chunk_rows), whole.narrow(0, at(0) * b, chunk_rows));
        dev.ops().copy(dev.compute_stream(), ranks.narrow(0, i * n + chunk_rows, chunk_rows),
                       whole.narrow(0, at(s / 2) * b, chunk_rows));
    }
    return whole;
}

Tensor sequence_to_ranks(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b) {
    Device &      dev = whole.device();
    const int64_t n = s * b, chunk_rows = s / 2 * b;
    Tensor        ranks = activation(dev, cp.size * n, whole.size(1), whole.dtype());
    for (int i = 0; i < cp.size; ++i) {
        const SeqPositions at = cp.positions(s, i);
        dev.ops().copy(dev.compute_stream(), whole.narrow(0, at(0) * b, chunk_rows), ranks.narrow(0, i * n, chunk_rows));
        dev.ops().copy(dev.compute_stream(), whole.narrow(0, at(s / 2) * b, chunk_rows),
                       ranks.narrow(0, i * n + chunk_rows, chunk_rows));
    }
    return ranks;
}

Tensor gather_sequence(const ContextParallel & cp, const Tensor & local, int64_t s, int64_t b) {
    Device & dev      = local.device();
    Tensor   gathered = activation(dev, cp.size * s * b, local.size(1), local.dtype());
    cp.group->all_gather(local, gathered, &dev.compute_stream());
    return ranks_to_sequence(cp, gathered, s, b);
}

Tensor reduce_scatter_sequence(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b) {
    Device & dev  = whole.device();
    Tensor   mine = activation(dev, s * b, whole.size(1), whole.dtype());
    cp.group->reduce_scatter(sequence_to_ranks(cp, whole, s, b), mine, comm::ReduceOp::sum, &dev.compute_stream());
    return mine;
}

Tensor heads_to_sequence(const ContextParallel & cp, const Tensor & local, int64_t s, int64_t b,
                         const std::vector<HeadColumns> & columns) {
    return ranks_to_sequence(cp, exchange_heads(*cp.group, cp.size, local, s * b, columns), s, b);
}

void sequence_to_heads(const ContextParallel & cp, const Tensor & whole, int64_t s, int64_t b,
                       const std::vector<HeadColumns> & columns, const Tensor & local) {
    exchange_heads_back(*cp.group, cp.size, sequence_to_ranks(cp, whole, s, b), s * b, columns, local);
}

Tensor SelfAttention::whole_kv(const Tensor & q_k_v, const AttentionShape & shape) const {
    return gather_sequence(cp, own_kv_block(q_k_v, shape), shape.s, shape.b);
}

void SelfAttention::cp_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape,
                               float scale, const Dropout & dropout) {
    if (cp_comm == CpCommType::a2a) return a2a_forward(ctx, q_k_v, out, shape, scale, dropout);
    if (cp_comm == CpCommType::a2a_p2p) return hierarchical_forward(ctx, q_k_v, out, shape, scale, dropout);
    if (shape.key_mask.defined()) {   // DSA's selection: this rank's queries against the whole sequences' keys at once
        const Tensor kv = ctx.whole_kv.defined() ? ctx.whole_kv : whole_kv(q_k_v, shape);
        q_k_v.device().ops().attention_forward(q_k_v.device().compute_stream(), q_k_v, kv, out, ctx.lse,
                                               against_whole_kv(shape, cp.size), scale, dropout);
        sink_forward(out, ctx.lse, shape, 0);
        return;
    }
    Device &      dev    = q_k_v.device();
    Ops &         ops    = dev.ops();
    Stream &      stream = dev.compute_stream();
    const int64_t n = shape.s * shape.b, kv_width = 2 * shape.nkv * shape.d;
    Tensor        kv = own_kv_block(q_k_v, shape);
    Tensor gathered;
    if (cp_comm == CpCommType::allgather) {
        gathered = activation(dev, cp.size * n, kv_width);
        cp.group->all_gather(kv, gathered, &stream);
    }
    AttentionShape block = against_kv_block(shape);
    Tensor part = activation(dev, n, shape.nq * shape.d), part_lse = activation(dev, shape.b * shape.nq, shape.s);
    // Step k holds rank (r - k)'s keys: its own first, then the ring's order; the next block travels while
    // this one's attention runs (double-buffered: the block in hand and the one arriving). Each block's
    // attention skips the key tiles past its queries' positions, so a step computes only what the causal
    // mask leaves.
    for (int step = 0; step < cp.size; ++step) {
        const int peer = (cp.rank - step + cp.size) % cp.size;
        std::optional<RingPass> next;
        if (cp_comm == CpCommType::p2p && step + 1 < cp.size) next.emplace(cp, std::initializer_list<Tensor>{kv});
        const Tensor keys = cp_comm == CpCommType::allgather ? gathered.narrow(0, peer * n, n) : kv;
        block.k_pos       = cp.positions(shape.s, peer);
        if (step == 0) {
            ops.attention_forward(stream, q_k_v, keys, out, ctx.lse, block, scale, dropout);
        } else {
            ops.attention_forward(stream, q_k_v, keys, part, part_lse, block, scale, dropout);
            ops.attention_merge(stream, out, ctx.lse, part, part_lse, shape);
        }
        if (next) kv = next->arrive().front();
    }
    sink_forward(out, ctx.lse, shape, 0);   // once every block is merged
}

void SelfAttention::cp_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                                const Tensor & d_qkv, const AttentionShape & shape, float scale) {
    if (cp_comm == CpCommType::a2a) return a2a_backward(ctx, q_k_v, out, d_out, d_qkv, shape, scale);
    if (cp_comm == CpCommType::a2a_p2p) return hierarchical_backward(ctx, q_k_v, out, d_out, d_qkv, shape, scale);
    Device &      dev    = q_k_v.device();
    Ops &         ops    = dev.ops();
    Stream &      stream = dev.compute_stream();
    const int64_t n = shape.s * shape.b, kv_width = 2 * shape.nkv * shape.d;
    Tensor mine;   // this rank's dK | dV, summed over every rank's queries
    if (shape.key_mask.defined()) {   // DSA's selection, as forward: the whole sequences' keys gathered again
        const Tensor kv  = whole_kv(q_k_v, shape);
        const Tensor dkv = activation(dev, kv.size(0), kv_width);
        ops.attention_backward(stream, q_k_v, kv, out, d_out, ctx.lse, d_qkv, dkv, against_whole_kv(shape, cp.size), scale,
                               ctx.dropout);
        mine = reduce_scatter_sequence(cp, dkv, shape.s, shape.b);
        ops.copy_columns(stream, mine, 0, d_qkv, shape.nq * shape.d, kv_width);
        return;
    }
    Tensor        kv = own_kv_block(q_k_v, shape);
    AttentionShape block = against_kv_block(shape);
    if (cp_comm == CpCommType::allgather) {
        // Every block's dK | dV from this rank's queries, then each block's sum over the ranks to its owner.
        Tensor gathered = activation(dev, cp.size * n, kv_width), dkv = activation(dev, cp.size * n, kv_width);
        cp.group->all_gather(kv, gathered, &stream);
        ops.fill_zero(stream, dkv);
        for (int step = 0; step < cp.size; ++step) {
            const int peer = (cp.rank - step + cp.size) % cp.size;
            block.k_pos    = cp.positions(shape.s, peer);
            ops.attention_backward(stream, q_k_v, gathered.narrow(0, peer * n, n), out, d_out, ctx.lse, d_qkv,
                                   dkv.narrow(0, peer * n, n), block, scale, ctx.dropout, step > 0);
        }
        mine = activation(dev, n, kv_width);
        cp.group->reduce_scatter(dkv, mine, comm::ReduceOp::sum, &stream);
    } else {
        // The ring again, each block followed by its dK | dV: a block's gradient starts at its owner, gains
        // each rank's share as it passes, and one last step takes it home. Both travel while attention
        // runs: the keys and values of the next step, and the partial gradient of the block in hand, which
        // this rank computes apart and adds once it has arrived.
        std::optional<RingPass> partial;   // the sum so far of the block in hand's dK | dV, arriving
        for (int step = 0; step < cp.size; ++step) {
            const int peer = (cp.rank - step + cp.size) % cp.size;
            std::optional<RingPass> next_kv;
            if (step + 1 < cp.size) next_kv.emplace(cp, std::initializer_list<Tensor>{kv});
            block.k_pos = cp.positions(shape.s, peer);
            Tensor dkv  = activation(dev, n, kv_width);
            if (step > 0) ops.fill_zero(stream, dkv);   // dQ accumulates over the steps, this share starts at zero
            ops.attention_backward(stream, q_k_v, kv, out, d_out, ctx.lse, d_qkv, dkv, block, scale, ctx.dropout,
                                   step > 0);
            if (partial) ops.add_inplace(stream, dkv, partial->arrive().front());
            partial.emplace(cp, std::initializer_list<Tensor>{dkv});   // to the block's next holder, or home
            if (next_kv) kv = next_kv->arrive().front();
        }
        mine = partial->arrive().front();
    }
    ops.copy_columns(stream, mine, 0, d_qkv, shape.nq * shape.d, kv_width);
}

namespace {

// The [Q | K | V] columns of the a2a exchange, and the attention output's.
std::vector<HeadColumns> qkv_head_columns(const AttentionShape & a, int cp) {
    const int64_t hs = a.nq / cp * a.d, gs = a.nkv / cp * a.d;
    return {{0, hs}, {a.nq * a.d, gs}, {(a.nq + a.nkv) * a.d, gs}};
}
std::vector<HeadColumns> out_head_columns(const AttentionShape & a, int cp) { return {{0, a.nq / cp * a.d}}; }

// The whole sequence's attention of this rank's share of the heads.
AttentionShape whole_shape(const AttentionShape & a, int cp) {
    const int64_t  hs = a.nq / cp, gs = a.nkv / cp;
    AttentionShape whole{a.s * cp, a.b, hs, gs, a.d, (hs + 2 * gs) * a.d};
    whole.window = a.window;   // the whole sequence in order: its positions are its rows
    return whole;
}

}  // namespace

void SelfAttention::a2a_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const AttentionShape & shape,
                                float scale, const Dropout & dropout) {
    Device &             dev   = q_k_v.device();
    const AttentionShape whole = whole_shape(shape, cp.size);
    Dropout              key   = dropout;
    key.offset += cp.rank * whole.nq;   // this rank's first head of the tensor-parallel rank's
    const Tensor qkv_whole = heads_to_sequence(cp, q_k_v, shape.s, shape.b, qkv_head_columns(shape, cp.size));
    Tensor       out_whole = activation(dev, whole.s * whole.b, whole.nq * whole.d);
    dev.ops().attention_forward(dev.compute_stream(), qkv_whole, out_whole, ctx.lse, whole, scale, key);
    sink_forward(out_whole, ctx.lse, whole, cp.rank * whole.nq);
    sequence_to_heads(cp, out_whole, shape.s, shape.b, out_head_columns(shape, cp.size), out);
}

void SelfAttention::a2a_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out, const Tensor & d_out,
                                 const Tensor & d_qkv, const AttentionShape & shape, float scale) {
    // The forward's exchanges again (nothing of the whole sequence is kept between the passes), then the
    // whole sequence's backward and the gradient back to the rows.
    Device &             dev   = q_k_v.device();
    const AttentionShape whole = whole_shape(shape, cp.size);
    Dropout              key   = ctx.dropout;
    key.offset += cp.rank * whole.nq;
    const std::vector<HeadColumns> qkv_columns = qkv_head_columns(shape, cp.size);
    const Tensor qkv_whole  = heads_to_sequence(cp, q_k_v, shape.s, shape.b, qkv_columns);
    const Tensor out_whole  = heads_to_sequence(cp, out, shape.s, shape.b, out_head_columns(shape, cp.size));
    const Tensor dout_whole = heads_to_sequence(cp, d_out, shape.s, shape.b, out_head_columns(shape, cp.size));
    Tensor       dqkv_whole = activation(dev, whole.s * whole.b, whole.row_stride);
    dev.ops().attention_backward(dev.compute_stream(), qkv_whole, out_whole, dout_whole, ctx.lse, dqkv_whole, whole,
                                 scale, key);
    sink_backward(out_whole, dout_whole, ctx.lse, whole, cp.rank * whole.nq);
    sequence_to_heads(cp, dqkv_whole, shape.s, shape.b, qkv_columns, d_qkv);
}

namespace {

// a2a+p2p's blocks: member i of the inner group (CP rank o ci + i for outer rank o) holds its two chunks;
// this rank attends for its share of the heads (hs query heads, gs groups) of every member's rows.
struct Hierarchy {
    int                      ci, co, inner_rank, outer_rank;
    int64_t                  n, hs, gs;
    std::vector<HeadColumns> columns;   // [Q | K | V] of this rank's heads
    AttentionShape           block;     // a member's queries against a member's K | V block
    Dropout                  key;       // the probabilities' key, at this rank's first head
    Hierarchy(const ContextParallel & cp, const AttentionShape & shape, const Dropout & dropout)
        : ci(cp.inner->size()), co(cp.outer->size()), inner_rank(cp.inner->rank()), outer_rank(cp.outer->rank()),
          n(shape.s * shape.b), hs(shape.nq / ci), gs(shape.nkv / ci),
          columns{{0, hs * shape.d}, {shape.nq * shape.d, gs * shape.d}, {(shape.nq + shape.nkv) * shape.d, gs * shape.d}},
          block(against_kv_block({shape.s, shape.b, hs, gs, shape.d, (hs + 2 * gs) * shape.d})), key(dropout) {
        key.offset += inner_rank * hs;
    }
    int cp_rank(int outer, int member) const { return outer * ci + member; }
};

}  // namespace

void SelfAttention::hierarchical_forward(Context & ctx, const Tensor & q_k_v, const Tensor & out,
                                         const AttentionShape & shape, float scale, const Dropout & dropout) {
    Device &       dev    = q_k_v.device();
    Ops &          ops    = dev.ops();
    Stream &       stream = dev.compute_stream();
    Hierarchy      h(cp, shape, dropout);
    AttentionShape block = h.block;
    const int64_t  n = h.n, hs = h.hs, d = shape.d, kv_width = block.kv_row_stride;
    // The inner group's rows (member-major) of this rank's heads, and their K | V, the block that travels.
    const Tensor members = exchange_heads(*cp.inner, h.ci, q_k_v, n, h.columns);
    Tensor       kv      = activation(dev, h.ci * n, kv_width);
    ops.copy_columns(stream, members, hs * d, kv, 0, kv_width);
    Tensor out_m = activation(dev, h.ci * n, hs * d);
    Tensor part = activation(dev, n, hs * d), part_lse = activation(dev, shape.b * hs, shape.s);
    // ctx.lse holds member i's (b, hs, s) at i b hs s: as many values as the plain lse.
    auto lse_of = [&](int i) { return ctx.lse.slice(i * shape.b * hs * shape.s, {shape.b * hs, shape.s}); };
    for (int step = 0; step < h.co; ++step) {
        const int               peer = (h.outer_rank - step + h.co) % h.co;
        std::optional<RingPass> next;
        if (step + 1 < h.co) next.emplace(cp, std::initializer_list<Tensor>{kv}, cp.outer.get());
        for (int i = 0; i < h.ci; ++i) {
            block.q_pos = cp.positions(shape.s, h.cp_rank(h.outer_rank, i));
            const Tensor q_i = members.narrow(0, i * n, n), out_i = out_m.narrow(0, i * n, n);
            for (int j = 0; j < h.ci; ++j) {
                block.k_pos = cp.positions(shape.s, h.cp_rank(peer, j));
                const Tensor kv_j = kv.narrow(0, j * n, n);
                if (step == 0 && j == 0) {
                    ops.attention_forward(stream, q_i, kv_j, out_i, lse_of(i), block, scale, h.key);
                } else {
                    ops.attention_forward(stream, q_i, kv_j, part, part_lse, block, scale, h.key);
                    ops.attention_merge(stream, out_i, lse_of(i), part, part_lse, block);
                }
            }
        }
        if (next) kv = next->arrive().front();
    }
    exchange_heads_back(*cp.inner, h.ci, out_m, n, {h.columns.front()}, out);
}

void SelfAttention::hierarchical_backward(Context & ctx, const Tensor & q_k_v, const Tensor & out,
                                          const Tensor & d_out, const Tensor & d_qkv, const AttentionShape & shape,
                                          float scale) {
    // The forward's head exchanges again, then the ring with each block's dK | dV travelling with it (all
    // accumulated from zero: a member's dQ and a block's dK | dV each gather several blocks' shares).
    Device &       dev    = q_k_v.device();
    Ops &          ops    = dev.ops();
    Stream &       stream = dev.compute_stream();
    Hierarchy      h(cp, shape, ctx.dropout);
    AttentionShape block = h.block;
    const int64_t  n = h.n, hs = h.hs, d = shape.d, kv_width = block.kv_row_stride;
    const std::vector<HeadColumns> out_columns{h.columns.front()};
    const Tensor members = exchange_heads(*cp.inner, h.ci, q_k_v, n, h.columns);
    const Tensor out_m   = exchange_heads(*cp.inner, h.ci, out, n, out_columns);
    const Tensor dout_m  = exchange_heads(*cp.inner, h.ci, d_out, n, out_columns);
    Tensor       kv      = activation(dev, h.ci * n, kv_width);
    ops.copy_columns(stream, members, hs * d, kv, 0, kv_width);
    Tensor dmembers = activation(dev, h.ci * n, block.row_stride);
    ops.fill_zero(stream, dmembers);
    auto lse_of = [&](int i) { return ctx.lse.slice(i * shape.b * hs * shape.s, {shape.b * hs, shape.s}); };
    // As cp_backward's ring: this step's share of the block's dK | dV apart, the partial sum arriving meanwhile.
    std::optional<RingPass> partial;
    for (int step = 0; step < h.co; ++step) {
        const int               peer = (h.outer_rank - step + h.co) % h.co;
        std::optional<RingPass> next;
        if (step + 1 < h.co) next.emplace(cp, std::initializer_list<Tensor>{kv}, cp.outer.get());
        Tensor dkv = activation(dev, h.ci * n, kv_width);
        ops.fill_zero(stream, dkv);
        for (int i = 0; i < h.ci; ++i) {
            block.q_pos = cp.positions(shape.s, h.cp_rank(h.outer_rank, i));
            for (int j = 0; j < h.ci; ++j) {
                block.k_pos = cp.positions(shape.s, h.cp_rank(peer, j));
                ops.attention_backward(stream, members.narrow(0, i * n, n), kv.narrow(0, j * n, n),
                                       out_m.narrow(0, i * n, n), dout_m.narrow(0, i * n, n), lse_of(i),
                                       dmembers.narrow(0, i * n, n), dkv.narrow(0, j * n, n), block, scale, h.key, true);
            }
        }
        if (partial) ops.add_inplace(stream, dkv, partial->arrive().front());
        partial.emplace(cp, std::initializer_list<Tensor>{dkv}, cp.outer.get());   // to the next holder, or home
        if (next) kv = next->arrive().front();
    }
    ops.copy_columns(stream, partial->arrive().front(), 0, dmembers, hs * d, kv_width);
    exchange_heads_back(*cp.inner, h.ci, dmembers, n, h.columns, d_qkv);
}

// ---------------------------------------------------------------------------------------------------
// Mlp

Mlp::Mlp(const std::string & name, const GptConfig & c, Device & device, const TensorParallel & t)
    : config(c), tp(t), ffn(c.ffn_hidden_size / t.size),
      fc1(name + ".fc1", c.hidden_size, c.swiglu ? 2 * ffn : ffn, c.add_bias_linear, c.params_dtype, device,
          t.size > 1 ? Linear::Split::column : Linear::Split::none, &tp),
      fc2(name + ".fc2", ffn, c.hidden_size, c.add_bias_linear, c.params_dtype, device,
          t.size > 1 ? Linear::Split::row : Linear::Split::none, &tp) {
    LOOM_CHECK(c.ffn_hidden_size % t.size == 0, "--ffn-hidden-size " << c.ffn_hidden_size
                                                                      << " must be divisible by --tensor-model-parallel-size "
                                                                      << t.size, "");
    if (t.size > 1) {
        const int64_t f = c.ffn_hidden_size, r = t.rank;
        std::vector<std::pair<int64_t, int64_t>> rows{{r * ffn, (r + 1) * ffn}};
        if (c.swiglu) rows.push_back({f + r * ffn, f + (r + 1) * ffn});   // [gate | up]: this rank's part of each
        set_tp_slice(fc1.weight, 0, rows, {c.swiglu ? 2 * f : f, c.hidden_size});
        if (fc1.has_bias) set_tp_slice(fc1.bias, 0, rows, {c.swiglu ? 2 * f : f});
        set_tp_slice(fc2.weight, 1, {{r * ffn, (r + 1) * ffn}}, {c.hidden_size, f});
    }
}

void Mlp::init(uint64_t seed, float std, float output_std) {
    fc1.init(seed, std);
    fc2.init(seed, output_std);
}

void Mlp::parameters(std::vector<Parameter *> & out) {
    fc1.parameters(out);
    fc2.parameters(out);
}

Tensor Mlp::forward(Context & ctx, const Tensor & x) {
    if (!recompute) return forward_kept(ctx, x, x.dtype());
    // Only the input is kept, in the dtype fc1's GEMM reads (with sequence parallelism fc1 gathers these
    // rows again): the rerun computes from the very values.
    Tensor input    = in_dtype(x, config.params_dtype);
    Tensor y        = forward_kept(ctx, input, x.dtype());
    ctx             = Context{};
    ctx.input       = input;
    ctx.activations = x.dtype();
    return y;
}

Tensor Mlp::forward_kept(Context & ctx, const Tensor & x, DType activations) {
    // fc1's output has every position's rows (with sequence parallelism, more than x has).
    const int64_t f = ffn;
    Ops &         ops    = x.device().ops();
    Stream &      stream = x.device().compute_stream();
    Tensor        act;
    if (config.swiglu) {
        Tensor pre  = fc1.forward(ctx.fc1_ctx, x, true, activations);
        act         = activation(x.device(), pre.size(0), f, pre.dtype());
        ctx.pre_act = keep_for_backward(pre, config.params_dtype);
        gated_forward(config, stream, pre, act);
    } else if (config.squared_relu) {
        Tensor pre  = fc1.forward(ctx.fc1_ctx, x, true, activations);
        act         = activation(x.device(), pre.size(0), f, pre.dtype());
        ctx.pre_act = keep_for_backward(pre, config.params_dtype);
        ops.squared_relu_forward(stream, pre, act);
    } else if (activations == config.params_dtype) {
        // fc1's product, its bias and GELU in one GEMM epilogue where the backend has one; the biased
        // pre-activation is kept for backward in the activations' dtype.
        Tensor pre;
        act         = fc1.forward_gelu(ctx.fc1_ctx, x, activations, pre);
        ctx.pre_act = pre;
    } else {
        // Another dtype for the activations than the weights' (a bf16 MoE layer's f32 insides, an f16 model):
        // bias and GELU in one pass over the (n, f) pre-activation, which keeps the biased value (rounded to
        // the weights' dtype for backward).
        Tensor pre  = fc1.forward(ctx.fc1_ctx, x, /*add_bias=*/false, activations);
        act         = activation(x.device(), pre.size(0), f, pre.dtype());
        Tensor bias = fc1.has_bias ? parameter_f32(fc1.bias) : Tensor();
        if (pre.dtype() == DType::f32 && config.params_dtype == DType::bf16) {
            // f32 activations of a bf16 model (a MoE layer's experts): the op writes the rounded biased value
            // to the bf16 copy backward keeps, and gelu reads that rounded value too.
            ctx.pre_act = Tensor::empty(pre.shape(), DType::bf16, x.device(), {MemoryKind::device, kActivationsPool});
            ops.bias_gelu_forward(stream, pre, bias, act, ctx.pre_act);
        } else {
            ops.bias_gelu_forward(stream, pre, bias, act, Tensor());
            ctx.pre_act = keep_for_backward(pre, config.params_dtype);   // pre itself, or (f16) a rounded copy
        }
    }
    Tensor y = fc2.forward(ctx.fc2_ctx, act);
    if (recompute_act) ctx.fc2_ctx.x = Tensor();   // backward recomputes it
    return y;
}

void gated_forward(const GptConfig & config, Stream & stream, const Tensor & pre, const Tensor & act) {
    if (const std::optional<GluSpec> glu = config.glu_spec()) {
        pre.device().ops().glu_forward(stream, pre, act, *glu);
    } else {
        pre.device().ops().swiglu_forward(stream, pre, act);
    }
}

void gated_backward(const GptConfig & config, Stream & stream, const Tensor & pre, const Tensor & d_act, const Tensor & d_pre) {
    if (const std::optional<GluSpec> glu = config.glu_spec()) {
        pre.device().ops().glu_backward(stream, pre, d_act, d_pre, *glu);
    } else {
        pre.device().ops().swiglu_backward(stream, pre, d_act, d_pre);
    }
}

void recompute_activation(const GptConfig & config, const Tensor & pre, const Tensor & act) {
    Ops &    ops    = pre.device().ops();
    Stream & stream = pre.device().compute_stream();
    if (config.swiglu) {
        gated_forward(config, stream, pre, act);
    } else if (config.squared_relu) {
        ops.squared_relu_forward(stream, pre, act);
    } else {
        ops.bias_gelu_forward(stream, pre, Tensor(), act, Tensor());   // no bias: the saved value has it
    }
}

Tensor Mlp::backward(Context & ctx, const Tensor & dy, const GradReadyFn & ready) {
    if (recompute) {   // the forward again, keeping everything this time
        const Tensor input       = ctx.input;
        const DType  activations = ctx.activations;
        ctx                      = Context{};
        forward_kept(ctx, input, activations);
    }
    if (recompute_act && !ctx.fc2_ctx.x.defined()) {
        Tensor act = activation(dy.device(), ctx.pre_act.size(0), ffn, dy.dtype());
        recompute_activation(config, in_dtype(ctx.pre_act, dy.dtype()), act);
        ctx.fc2_ctx.x = in_dtype(act, config.params_dtype);
    }
    Tensor d_pre;
    if (config.swiglu || config.squared_relu) {
        Tensor  d_act = fc2.backward(ctx.fc2_ctx, dy, ready);
        int64_t n     = d_act.size(0);   // every position's rows, as fc1 produced them
        Tensor  pre   = in_dtype(ctx.pre_act, dy.dtype());
        d_pre         = activation(dy.device(), n, pre.size(1), dy.dtype());
        Ops &   ops   = dy.device().ops();
        if (config.swiglu) {
            gated_backward(config, dy.device().compute_stream(), pre, d_act, d_pre);
        } else {
            ops.squared_relu_backward(dy.device().compute_stream(), pre, d_act, d_pre);
        }
    } else {
        // GELU's gradient in fc2's dx product.
        d_pre = fc2.backward(ctx.fc2_ctx, dy, ready, in_dtype(ctx.pre_act, dy.dtype()));
    }
    ctx.pre_act = Tensor();
    return fc1.backward(ctx.fc1_ctx, d_pre, ready);
}

}  // namespace loom::model
