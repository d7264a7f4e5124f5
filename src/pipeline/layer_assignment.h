// Which transformer layers each pipeline rank's model chunks hold, as the reference assigns them
// (Megatron's get_num_layers_to_build / get_transformer_layer_offset), and the validation of the split.
//
// Virtual stage v of the model is chunk v of every rank, in rank order: the model runs rank 0 chunk 0,
// rank 1 chunk 0, ..., rank PP-1 chunk 0, rank 0 chunk 1, ... With n_r layers on rank r (summed over its
// V chunks) every chunk of rank r holds n_r / V consecutive layers and
//
//   first layer of (rank r, chunk c) = c * L / V + sum_{r' < r} n_{r'} / V
//
// Even split: n_r = L / PP, so L must be divisible by PP x V.
// Uneven ends (--decoder-first-pipeline-num-layers F, --decoder-last-pipeline-num-layers X): rank 0
// holds F, rank PP-1 holds X, and the other ("middle") ranks share the rest evenly; a flag left unset
// makes its rank a middle one. With V chunks F, X and the middle ranks' count must each divide by V.
//
// Virtual stages come from --num-virtual-stages-per-pipeline-rank V, or from
// --num-layers-per-virtual-pipeline-stage n as V = (L / PP) / n (even split only); at most one of them.
//
// Embedding and loss counted as layers (--account-for-embedding-in-pipeline-split E,
// --account-for-loss-in-pipeline-split S, Megatron's standalone embedding and loss stages): L + E + S must
// divide by PP x V into chunks of c = (L + E + S) / (PP x V); every chunk holds c layers but the model's first
// (rank 0, chunk 0), which holds c - E, and its last (rank PP-1, chunk V-1), which holds c - S; either may be
// empty (a stage of the embedding or the loss alone). Layers follow the model order of the chunks.
// L 6, PP 4, V 2, E and S: rank 0 chunk 0 = [] and chunk 1 = [3], rank 1 [0] and [4], rank 2 [1] and [5],
// rank 3 [2] and [].
//
// A custom layout (--pipeline-model-parallel-layout, Megatron's PipelineParallelLayerLayout): the virtual stages
// in model order, separated by '|', each a string of E (the embedding), t (a decoder layer), m (an MTP depth)
// and L (the loss); "(ab|)*n" and "x*n" repeat, commas are cosmetic. Its stage count divided by PP is V.
// Each stage holds its t's, in order; Loom keeps E in the first stage and L and every m in the last (the
// stages that embed and compute the loss), where Megatron also lets an MTP depth stand on a rank of its own.
// "Et*3|(tt|)*6tmL" with PP 2: rank 0 chunks [0, 3) [5, 7) [9, 11) [13, 15), rank 1 [3, 5) [7, 9) [11, 13)
// [15, 16) and the MTP depth.
//
// Worked example (docs/design/schedules_and_graphs.md 1.7): L 32, PP 4, V 2: rank 0 chunk 0 = layers 0-3,
// chunk 1 = 16-19; rank 1 4-7 and 20-23; rank 2 8-11 and 24-27; rank 3 12-15 and 28-31.
// Uneven: L 10, PP 4, F 1, X 3: rank 0 [0], rank 1 [1, 2, 3], rank 2 [4, 5, 6], rank 3 [7, 8, 9].
#pragma once

#include <optional>
#include <string>
#include <vector>

namespace loom::pipeline {

struct LayerSplitOptions {
    int                num_layers = 1;                    // L, --num-layers
    int                pp         = 1;                    // --pipeline-model-parallel-size
    std::optional<int> vpp;                               // --num-virtual-stages-per-pipeline-rank
    std::optional<int> num_layers_per_virtual_stage;      // --num-layers-per-virtual-pipeline-stage
    std::optional<int> first_stage_layers;                // --decoder-first-pipeline-num-layers
    std::optional<int> last_stage_layers;                 // --decoder-last-pipeline-num-layers
    bool               account_for_embedding = false;     // --account-for-embedding-in-pipeline-split
    bool               account_for_loss      = false;     // --account-for-loss-in-pipeline-split
    std::vector<std::string> layout;                      // --pipeline-model-parallel-layout, parsed (empty: none)
    int                mtp_num_layers = 0;                // --mtp-num-layers (the layout's m's)
};

// --pipeline-model-parallel-layout's stages, unrolled (Megatron's parse_str_to_list); throws naming the flag
// on a character other than E, L, t, m.
std::vector<std::string> parse_pipeline_layout(const std::string & text);

struct LayerRange {
    int begin;   // first global layer, 0-based
    int end;     // one past the last
    int size() const { return end - begin; }
};
bool operator==(const LayerRange & a, const LayerRange & b);

struct LayerAssignment {
    int                                  pp         = 1;
    int                                  num_chunks = 1;   // V (1 without virtual stages)
    std::vector<std::vector<LayerRange>> ranges;           // [rank][chunk]

    const LayerRange & at(int rank, int chunk) const { return ranges[rank][chunk]; }
};

// The virtual pipeline size the flags ask for (unset: no virtual stages); throws loom::Error naming the
// flags when they conflict or do not divide.
std::optional<int> resolve_virtual_stages(const LayerSplitOptions & options);

// Validates the whole split and returns every rank's chunks; throws loom::Error naming the flags.
LayerAssignment assign_layers(const LayerSplitOptions & options);

}  // namespace loom::pipeline
