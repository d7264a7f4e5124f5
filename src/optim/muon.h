// Muon (--optimizer muon): momentum SGD whose update of each weight matrix is its momentum orthogonalized by
// a Newton-Schulz iteration, scaled by the matrix's shape (Megatron's TensorParallelMuon over the
// emerging_optimizers package's OrthogonalizedOptimizer). docs/muon.md gives the rules and their sources.
//
// Which parameters: every weight matrix except the word embedding and the output layer (Megatron routes
// those, and every parameter that is not 2-D, to Adam). A grouped expert tensor (E, rows, cols) is E
// matrices, one per expert, as Transformer Engine's grouped linear holds them. Biases and norm weights step
// with AdamW (optim/adamw.h), in the same Optimizer, over the same gradient norm and clip.
//
// Update of one matrix at lr, decoupled weight decay wd, gradient G (after the norm's clip):
//   W <- W - lr wd W
//   M <- b M + (1 - b) G                        (b: --muon-momentum, default 0.9)
//   N  = M, or with --muon-nesterov b M + (1 - b) G
//   O  = NS(N) * scale(rows, cols) * --muon-extra-scale-factor
//   W <- W - lr O
// NS (newton_schulz below): X = N / max(|N|_F, 1e-15), transposed when rows > cols; then per step k, with
// (a, b, c) the coefficient set's k-th triple,
//   A = X X^T,  B = b A + c A A,  X <- a X + B X,
// and the transpose undone. With --muon-fp32-matmul-prec medium (Megatron's default) X, A and B are bf16 and
// every product is an f32 accumulation rounded once to bf16, as torch's bf16 matmuls; high computes in f32.
// scale: spectral sqrt(max(rows, cols)); unit_rms_norm sqrt(rows / cols); shape_scaling sqrt(max(1, rows / cols)).
//
// Fused QKV: with the split on (Megatron's default; --muon-no-split-qkv clears it) a QKV weight's Q, K and V
// row blocks are orthogonalized apart (Parameter::fused_rows).
// Tensor parallelism (--muon-tp-mode): duplicated (default) and distributed orthogonalize the whole matrix
// (its TP shards all-gathered, every rank computing the same whole and keeping its part): the result does not
// depend on TP. Loom computes distributed the duplicated way (Megatron's help: the same update). blockwise
// orthogonalizes each rank's shard on its own, scaled by the shard's shape. The shards are gathered in rank
// order: for a weight split along its rows into several ranges (QKV, SwiGLU's fc1) that is the whole matrix
// with its rows permuted, and NS(P X) = P NS(X), so the result is the whole matrix's.
// ZeRO-1 (--use-distributed-optimizer): the momentum is sharded as Adam's moments are; each step sums the
// owned pieces of every matrix over the data-parallel group (each element owned once: exact), every rank
// orthogonalizes it whole and updates the pieces it owns. Megatron's layer-wise optimizer gives the same
// update.
#pragma once

#include "comm/communicator.h"
#include "core/device.h"
#include "core/tensor.h"

#include <array>
#include <cstdint>
#include <string>
#include <vector>

namespace loom::model {
struct Parameter;
}

namespace loom::optim {

enum class MuonScaleMode { spectral, unit_rms_norm, shape_scaling };
enum class MuonTpMode { duplicated, distributed, blockwise };

struct MuonConfig {
    float              momentum           = 0.9f;    // --muon-momentum
    bool               nesterov           = false;   // --muon-nesterov
    bool               split_qkv          = true;    // --muon-no-split-qkv clears it
    MuonScaleMode      scale_mode         = MuonScaleMode::spectral;   // --muon-scale-mode
    float              extra_scale_factor = 1.0f;    // --muon-extra-scale-factor
    int                num_ns_steps       = 5;       // --muon-num-ns-steps
    std::string        coefficient_type   = "quintic";   // --muon-coefficient-type
    bool               bf16_matmul        = true;    // --muon-fp32-matmul-prec medium (high: false)
    MuonTpMode         tp_mode            = MuonTpMode::duplicated;   // --muon-tp-mode
};

// The names Loom takes for --muon-coefficient-type, and the (a, b, c) of each of `steps` steps (quintic,
// simple and aol cycle through their sets; polar_express and cans repeat their last). Throws naming the flag
// and the value for any other name or steps < 1.
const std::vector<std::string> &        muon_coefficient_types();
std::vector<std::array<float, 3>>       muon_coefficients(const std::string & type, int steps);
MuonScaleMode                           muon_scale_mode_from_name(const std::string & name);
MuonTpMode                              muon_tp_mode_from_name(const std::string & name);
float                                   muon_scale_factor(int64_t rows, int64_t cols, MuonScaleMode mode);

// out (rows, cols) f32 = NS(x) for x (rows, cols) f32, on the device's compute stream (x is not changed),
// with no host read (the norm divides on the device: Ops::scale_by_inverse_norm).
void newton_schulz(const Tensor & x, const Tensor & out, const MuonConfig & config);

// The groups a matrix's shards are gathered over (null: not split, or one rank).
struct MuonGroups {
    comm::Communicator * tp        = nullptr;   // dense weights' tensor-parallel group
    comm::Communicator * expert_tp = nullptr;   // expert weights' (--expert-tensor-parallel-size)
};

// Whether Muon steps `p` (else AdamW does).
bool muon_steps(const model::Parameter & p);

// The Muon part of an Optimizer's step: its matrices' slots (windows of the Adam state's slots: the
// momentum is the slot's exp_avg, the master its master) and what it needs to orthogonalize them whole.
class MuonUpdate {
public:
    struct Piece {
        Tensor  master, momentum, grad;   // (n) f32 views: the slot's master, exp_avg and gradient
        Tensor  values;                   // the model's values when they are 16-bit (rounded from master), else undefined
        int64_t offset = 0;               // where the piece starts in its parameter's elements
        float   weight_decay = 0.0f;
    };
    struct Matrix {
        const model::Parameter * param = nullptr;
        std::vector<Piece>       pieces;          // this rank's (all of it without ZeRO-1; possibly none with it)
        comm::Communicator *     shard  = nullptr;   // ZeRO-1's group the pieces are summed over (null: whole here)
        comm::Communicator *     gather = nullptr;   // the TP group its shards are gathered over (null: none)
    };

    MuonUpdate(MuonConfig config, std::vector<Matrix> matrices);
    // One update of every matrix at lr, on the compute stream.
    void step(float lr);

    const MuonConfig & config() const { return config_; }
    int64_t            num_matrices() const { return static_cast<int64_t>(matrices_.size()); }

private:
    // Orthogonalizes the (rows, cols) block `local` of this rank's momentum into `update` (the same shape),
    // gathering the block's shards over `gather` along `dim` (0 rows, 1 columns) first.
    void orthogonalize(const Tensor & local, const Tensor & update, comm::Communicator * gather, int dim);

    MuonConfig          config_;
    std::vector<Matrix> matrices_;
};

}  // namespace loom::optim
