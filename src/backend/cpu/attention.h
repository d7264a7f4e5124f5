// Causal self-attention, tiled like FlashAttention: no s x s matrix is ever materialised.
//
// Input rows are the (s, b) rows of the QKV projection, each row laid out [Q | K | V]:
//   Q: nq heads of d, K: nkv heads of d, V: nkv heads of d   (row_stride >= (nq + 2 nkv) d)
// Query head hq reads key/value head hq / (nq / nkv) (grouped-query attention; nkv = nq is multi-head).
//
// Forward, per (sequence, query head) and per block of Br queries, over the key blocks up to the diagonal:
//   S = scale Q_i K_j^T (causal mask),  m' = max(m, rowmax S),  P = exp(S - m'),
//   l' = e^(m - m') l + rowsum P,  O_i = e^(m - m') O_i + P V_j;   finally O_i /= l, lse_i = m + log l.
// Only lse (b, nq, s) is kept for backward, which recomputes P = exp(S - lse) block by block:
//   D_i = rowsum(dO_i * O_i),  dV_j += P^T dO_i,  dP = dO_i V_j^T,  dS = P (dP - D_i),
//   dQ_i += scale dS K_j,  dK_j += scale dS^T Q_i.
// Dropout on the probabilities (core/dropout.h) multiplies each P by z = mask / (1 - p) after the
// softmax: forward accumulates O_i += (z P) V_j while l sums the undropped P; backward redraws z and uses
//   dV_j += (z P)^T dO_i,  dP = z (dO_i V_j^T),  dS = P (dP - D_i)   with D_i = rowsum(dO_i * O_i) unchanged,
// since rowsum(P * dP) = rowsum(dO_i * (z P) V) = rowsum(dO_i * O_i).
// Backward runs one task per (sequence, key/value head) so the query heads sharing it add into dK, dV
// without races. Memory: O(Br x Bc) scratch per thread.
#pragma once

#include "core/ops.h"

#include <cstdint>

namespace loom::cpu {

using AttentionShape = loom::AttentionShape;   // core/ops.h

// The probabilities' dropout: head hq of a call is head_offset + hq of the model; sample_ids (b) are the
// batch columns' global sample indices (null: 0 .. b-1). p = 0: none.
struct AttentionDropout {
    float           p           = 0.0f;
    uint64_t        seed        = 0;
    uint64_t        site        = 0;
    const int64_t * sample_ids  = nullptr;
    int64_t         head_offset = 0;
};

// out (s, b, nq * d); lse (b, nq, s).
void attention_forward(const float * qkv, float * out, float * lse, const AttentionShape & shape, float scale,
                       const AttentionDropout & dropout = {});
// dqkv has the layout of qkv and is assigned (not accumulated).
void attention_backward(const float * qkv, const float * out, const float * dout, const float * lse, float * dqkv,
                        const AttentionShape & shape, float scale, const AttentionDropout & dropout = {});

}  // namespace loom::cpu
