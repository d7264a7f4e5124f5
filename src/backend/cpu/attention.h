// Causal self-attention, tiled like FlashAttention: no s x s matrix is ever materialised.
//
// Queries are the (s, b) rows of q (Q: nq heads of d from column 0); keys and values the (s_kv, b) rows of
// kv (K and V: nkv heads of d from columns k_col and v_col); for the QKV projection's [Q | K | V] rows both
// are the same tensor. Query head hq reads key/value head hq / (nq / nkv) (grouped-query attention; nkv = nq
// is multi-head). Key j is visible to query i when k_pos(j) <= q_pos(i) (core/positions.h; both increase,
// so a block of keys past a block of queries' last position is skipped whole).
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

#include "core/float_bits.h"
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

// out (s, b, nq * d); lse (b, nq, s). A query with no visible key: out 0, lse -inf.
// q, kv, out (and dout, dq, dkv) are float or Bf16 (core/float_bits.h): read as f32, computed in f32, each
// output stored once; lse is f32.
template <class T>
void attention_forward(const T * q, const T * kv, T * out, float * lse, const AttentionShape & shape, float scale,
                       const AttentionDropout & dropout = {});
// dq has the layout of q, dkv of kv (they may be the same rows); their Q, K and V columns are assigned, or
// added to with accumulate. out and lse are the queries' final ones (every key block merged).
template <class T>
void attention_backward(const T * q, const T * kv, const T * out, const T * dout, const float * lse, T * dq, T * dkv,
                        const AttentionShape & shape, float scale, const AttentionDropout & dropout = {},
                        bool accumulate = false);
// (out, lse) merged with (part_out, part_lse) in place (core/ops.h's attention_merge).
void attention_merge(float * out, float * lse, const float * part_out, const float * part_lse, int64_t s, int64_t b,
                     int64_t nq, int64_t d);

// Attention sinks on the final (out, lse) (core/ops.h's attention_sink_forward / attention_sink_backward).
template <class T>
void attention_sink_forward(T * out, float * lse, const float * sink, int64_t s, int64_t b, int64_t nq, int64_t d);
template <class T>
void attention_sink_backward(const T * out, const T * dout, const float * lse, const float * sink, float * dsink, int64_t s,
                             int64_t b, int64_t nq, int64_t d);

}  // namespace loom::cpu
