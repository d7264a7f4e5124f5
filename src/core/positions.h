// Where the rows of an (s, b) activation sit in the whole sequence. With context parallelism each rank
// holds two chunks of it (model/context_parallel.h): local positions [0, split) are global positions
// [first, first + split) and local positions [split, s) continue from `second`. The default maps every
// local position to itself. Positions are increasing (second >= first + split), so a block of local rows
// spans the global positions between its first and last row's.
//
// The kernels read global positions wherever a position matters: rotary angles, learned position
// embeddings, dropout masks (core/dropout.h) and the causal mask of attention. So a context-parallel rank
// computes exactly what the single-rank run computes for the same tokens.
#pragma once

#include <cstdint>

#if defined(__CUDACC__)
#define LOOM_POSITIONS_HD __host__ __device__
#else
#define LOOM_POSITIONS_HD
#endif

namespace loom {

struct SeqPositions {
    int64_t first  = 0;
    int64_t split  = INT64_MAX;
    int64_t second = 0;

    LOOM_POSITIONS_HD constexpr int64_t operator()(int64_t i) const { return i < split ? first + i : second + (i - split); }
};

// The rows of DeepSeek Sparse Attention's indexer ops (Ops::dsa_*): s query rows of each of b sequences at positions
// q_pos, against the `keys` keys of each whole sequence in position order; row (bi, i)'s causal keys are 0 .. q_pos(i).
struct DsaRows {
    int64_t      s = 0, b = 0, keys = 0;
    SeqPositions q_pos;

    LOOM_POSITIONS_HD constexpr int64_t last(int64_t i) const { return q_pos(i); }
};

}  // namespace loom
