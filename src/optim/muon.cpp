#include "optim/muon.h"

#include "core/error.h"
#include "core/ops.h"
#include "model/parameter.h"

#include <algorithm>
#include <cmath>
#include <map>

namespace loom::optim {

namespace {

struct CoefficientSet {
    bool                              repeat_last;   // past the list: repeat its last triple (else cycle)
    std::vector<std::array<float, 3>> triples;
};

// The published sets, as Megatron's emerging_optimizers package lists them (docs/muon.md names each source).
const std::map<std::string, CoefficientSet> & coefficient_sets() {
    static const std::map<std::string, CoefficientSet> sets = {
        {"simple", {false, {{3.4445f, -4.7750f, 2.0315f}}}},
        {"quintic",
         {false,
          {{4.0848f, -6.8946f, 2.9270f},
           {3.9505f, -6.3029f, 2.6377f},
           {3.7418f, -5.5913f, 2.3037f},
           {2.8769f, -3.1427f, 1.2046f},
           {2.8366f, -3.0525f, 1.2012f}}}},
        {"polar_express",
         {true,
          {{8.2051f, -22.9019f, 16.4607f},
           {4.0664f, -2.8612f, 0.5184f},
           {3.9096f, -2.8234f, 0.5250f},
           {3.2856f, -2.4153f, 0.4853f},
           {2.2779f, -1.6198f, 0.3985f},
           {1.8726f, -1.2307f, 0.3585f},
           {1.8564f, -1.2132f, 0.3568f},
           {1.8750f, -1.2500f, 0.3750f}}}},
        {"cans",
         {true,
          {{8.4703f, -25.1081f, 18.6293f},
           {4.1828f, -3.1087f, 0.5806f},
           {3.9619f, -2.9541f, 0.5630f},
           {3.2866f, -2.4647f, 0.5074f},
           {2.2737f, -1.6447f, 0.4162f}}}},
        {"aol",
         {false,
          {{4.0098f, -7.0585f, 2.4635f},
           {3.4585f, -5.5479f, 2.5959f},
           {2.7573f, -3.2939f, 1.4254f},
           {2.7215f, -3.0494f, 1.3169f}}}},
    };
    return sets;
}

}  // namespace

const std::vector<std::string> & muon_coefficient_types() {
    static const std::vector<std::string> names = [] {
        std::vector<std::string> n;
        for (const auto & entry : coefficient_sets()) n.push_back(entry.first);
        return n;
    }();
    return names;
}

std::vector<std::array<float, 3>> muon_coefficients(const std::string & type, int steps) {
    const auto it = coefficient_sets().find(type);
    if (it == coefficient_sets().end()) {
        std::string names;
        for (const std::string & n : muon_coefficient_types()) names += (names.empty() ? "" : ", ") + n;
        LOOM_THROW("--muon-coefficient-type '" << type << "' is not one Loom takes", "give one of " << names);
    }
    LOOM_CHECK(steps >= 1, "--muon-num-ns-steps must be at least 1, got " << steps, "");
    const CoefficientSet &            set = it->second;
    std::vector<std::array<float, 3>> out;
    for (int k = 0; k < steps; ++k) {
        const size_t n = set.triples.size();
        const size_t i = set.repeat_last ? std::min(static_cast<size_t>(k), n - 1) : static_cast<size_t>(k) % n;
        out.push_back(set.triples[i]);
    }
    return out;
}

MuonScaleMode muon_scale_mode_from_name(const std::string & name) {
    if (name == "spectral") return MuonScaleMode::spectral;
    if (name == "unit_rms_norm") return MuonScaleMode::unit_rms_norm;
    if (name == "shape_scaling") return MuonScaleMode::shape_scaling;
    LOOM_THROW("--muon-scale-mode '" << name << "' is not a scale mode", "give spectral, unit_rms_norm or shape_scaling");
}

MuonTpMode muon_tp_mode_from_name(const std::string & name) {
    if (name == "duplicated") return MuonTpMode::duplicated;
    if (name == "distributed") return MuonTpMode::distributed;
    if (name == "blockwise") return MuonTpMode::blockwise;
    LOOM_THROW("--muon-tp-mode '" << name << "' is not a mode", "give duplicated, distributed or blockwise");
}

float muon_scale_factor(int64_t rows, int64_t cols, MuonScaleMode mode) {
    const double r = static_cast<double>(rows), c = static_cast<double>(cols);
    switch (mode) {
    case MuonScaleMode::spectral: return static_cast<float>(std::sqrt(std::max(r, c)));
    case MuonScaleMode::unit_rms_norm: return static_cast<float>(std::sqrt(r / c));
    case MuonScaleMode::shape_scaling: return static_cast<float>(std::sqrt(std::max(1.0, r / c)));
    }
    return 1.0f;
}

void newton_schulz(const Tensor & x, const Tensor & out, const MuonConfig & config) {
    LOOM_CHECK(x.dim() == 2 && x.dtype() == DType::f32 && out.shape() == x.shape() && out.dtype() == DType::f32,
               "Newton-Schulz of " << x.describe() << " into " << out.describe(), "");
    Device &      device = x.device();
    Stream &      s      = device.compute_stream();
    Ops &         ops    = device.ops();
    const int64_t rows = x.size(0), cols = x.size(1);
    // X is (rows, cols) throughout; the iteration runs on the smaller side: A = X X^T (rows x rows) when
    // rows <= cols, else A = X^T X and X <- a X + X B (the same as transposing, stepping and transposing back:
    // B is symmetric).
    const bool    wide = rows <= cols;
    const int64_t k    = wide ? rows : cols;

    // X = x / max(|x|_F, 1e-15), the norm read on the device (no host synchronisation).
    Tensor sums = Tensor::empty({2}, DType::f32, device);
    ops.sum_of_squares(s, x, sums);
    ops.copy(s, x, out);
    ops.scale_by_inverse_norm(s, out, sums, 1e-15);
    const DType wd = config.bf16_matmul ? DType::bf16 : DType::f32;   // the iteration's dtype
    Tensor      X  = out;
    if (config.bf16_matmul) {
        X = Tensor::empty({rows, cols}, DType::bf16, device);
        ops.convert(s, out, X);
    }
    Tensor A  = Tensor::empty({k, k}, wd, device);
    Tensor AA = Tensor::empty({k, k}, DType::f32, device);
    Tensor P  = Tensor::empty({rows, cols}, DType::f32, device);
    // bf16: f32 copies of A and X for the sums, and B rounded for its product
    Tensor Aw = config.bf16_matmul ? Tensor::empty({k, k}, DType::f32, device) : A;
    Tensor B  = config.bf16_matmul ? Tensor::empty({k, k}, DType::bf16, device) : AA;
    for (const std::array<float, 3> & abc : muon_coefficients(config.coefficient_type, config.num_ns_steps)) {
        const float a = abc[0], b = abc[1], c = abc[2];
        if (wide) {
            ops.gemm(s, X, false, X, true, A);
        } else {
            ops.gemm(s, X, true, X, false, A);
        }
        if (config.bf16_matmul) ops.convert(s, A, Aw);
        // B = b A + c A A, rounded once into B's dtype
        if (c != 0.0f) {
            ops.gemm(s, A, false, A, false, AA);
            ops.scale(s, AA, c);
            ops.scale(s, Aw, b);
            ops.add_inplace(s, AA, Aw);
        } else {
            ops.scale(s, Aw, b);
            ops.copy(s, Aw, AA);
        }
        if (config.bf16_matmul) ops.convert(s, AA, B);
        // X <- a X + B X (or X B), rounded once into X's dtype
        if (wide) {
            ops.gemm(s, B, false, X, false, P);
        } else {
            ops.gemm(s, X, false, B, false, P);
        }
        if (config.bf16_matmul) {
            ops.convert(s, X, out);
            ops.scale(s, out, a);
            ops.add_inplace(s, P, out);
            ops.convert(s, P, X);
        } else {
            ops.scale(s, X, a);
            ops.add_inplace(s, X, P);
        }
    }
    if (config.bf16_matmul) ops.convert(s, X, out);
}

bool muon_steps(const model::Parameter & p) {
    if (p.embedding_or_output) return false;
    return p.data.dim() == 2 || (p.expert && p.data.dim() == 3);
}

MuonUpdate::MuonUpdate(MuonConfig config, std::vector<Matrix> matrices)
    : config_(std::move(config)), matrices_(std::move(matrices)) {
    (void)muon_coefficients(config_.coefficient_type, config_.num_ns_steps);   // named refusals before a step
}

void MuonUpdate::orthogonalize(const Tensor & local, const Tensor & update, comm::Communicator * gather, int dim) {
    Device &      device = local.device();
    Stream &      s      = device.compute_stream();
    Ops &         ops    = device.ops();
    const int64_t r = local.size(0), c = local.size(1);
    const float   extra = config_.extra_scale_factor;
    if (!gather || gather->size() == 1 || config_.tp_mode == MuonTpMode::blockwise || dim < 0) {
        newton_schulz(local, update, config_);
        ops.scale(s, update, muon_scale_factor(r, c, config_.scale_mode) * extra);
        return;
    }
    const int64_t t       = gather->size();
    Tensor        stacked = Tensor::empty({t * r * c}, DType::f32, device);
    gather->all_gather(local.flatten(), stacked, &s);
    Tensor full;
    if (dim == 0) {   // the ranks' row blocks one after another: the whole matrix, rows permuted at most
        full = stacked.view({t * r, c});
    } else {          // column blocks: placed side by side
        full = Tensor::empty({r, t * c}, DType::f32, device);
        for (int64_t k = 0; k < t; ++k) ops.copy_columns(s, stacked.slice(k * r * c, {r, c}), 0, full, k * c, c);
    }
    Tensor out = Tensor::empty(full.shape(), DType::f32, device);
    newton_schulz(full, out, config_);
    ops.scale(s, out, muon_scale_factor(full.size(0), full.size(1), config_.scale_mode) * extra);
    const int64_t mine = gather->rank();
    if (dim == 0) {
        ops.copy(s, out.slice(mine * r * c, {r, c}), update);
    } else {
        ops.copy_columns(s, out, mine * c, update, 0, c);
    }
}

void MuonUpdate::step(float lr) {
    const float beta = config_.momentum;
    for (Matrix & m : matrices_) {
        const model::Parameter & p      = *m.param;
        Device &                 device = p.data.device();
        Stream &                 s      = device.compute_stream();
        Ops &                    ops    = device.ops();
        const int64_t            n      = p.numel();
        // 1. Decoupled weight decay and the momentum, on this rank's pieces; the matrix's momentum (or
        //    Nesterov's blend) into `work` at the pieces' places.
        Tensor work = m.shard ? Tensor::zeros({n}, DType::f32, device) : Tensor::empty({n}, DType::f32, device);
        for (const Piece & piece : m.pieces) {
            const int64_t k = piece.momentum.numel();
            if (piece.weight_decay != 0.0f) ops.scale(s, piece.master, 1.0f - lr * piece.weight_decay);
            Tensor g = Tensor::empty({k}, DType::f32, device);
            ops.copy(s, piece.grad, g);
            ops.scale(s, g, 1.0f - beta);
            ops.scale(s, piece.momentum, beta);
            ops.add_inplace(s, piece.momentum, g);
            Tensor dst = work.slice(piece.offset, {k});
            ops.copy(s, piece.momentum, dst);
            if (config_.nesterov) {   // b M + (1 - b) G, with g still (1 - b) G
                ops.scale(s, dst, beta);
                ops.add_inplace(s, dst, g);
            }
        }
        if (m.shard && m.shard->size() > 1) m.shard->all_reduce(work, comm::ReduceOp::sum, &s);
        // 2. Orthogonalize each matrix (each expert's; each of Q, K and V with the split) into `update`.
        const int64_t experts = p.data.dim() == 3 ? p.data.size(0) : 1;
        const int64_t rows = p.data.size(-2), cols = p.data.size(-1);
        // The TP split as a matrix dimension (an expert tensor's dim 0 is the experts: not a split of a matrix).
        int dim = p.tp_slice.dim - (p.data.dim() == 3 ? 1 : 0);
        if (p.tp_slice.dim < 0 || dim < 0) dim = -1;
        std::vector<int64_t> blocks = config_.split_qkv && !p.fused_rows.empty() ? p.fused_rows : std::vector<int64_t>{rows};
        Tensor update = Tensor::empty({n}, DType::f32, device);
        for (int64_t e = 0; e < experts; ++e) {
            int64_t row = 0;
            for (const int64_t block : blocks) {
                const int64_t at = (e * rows + row) * cols;
                orthogonalize(work.slice(at, {block, cols}), update.slice(at, {block, cols}), m.gather, dim);
                row += block;
            }
            LOOM_CHECK(row == rows, p.name << ": fused row blocks sum to " << row << " of " << rows << " rows", "");
        }
        // 3. W <- W - lr O on this rank's pieces; 16-bit values get the master rounded.
        for (const Piece & piece : m.pieces) {
            Tensor u = update.slice(piece.offset, {piece.master.numel()});
            ops.scale(s, u, -lr);
            ops.add_inplace(s, piece.master, u);
            if (piece.values.defined()) ops.convert(s, piece.master, piece.values);
        }
    }
}

}  // namespace loom::optim
