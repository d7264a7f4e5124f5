// Dropout masks drawn from a counter-based hash: every element's keep/drop decision is a pure function of
// (seed, site, global sample index, and the element's place in the whole model's tensor), never of which
// rank computes it or in what order. So DP, TP (with or without sequence parallelism) and PP layouts draw
// the very masks the single-rank run draws, a recomputed forward (activation recompute) redraws them
// bitwise, and no mask is stored between forward and backward: backward redraws it.
//
// (Megatron draws from torch's stateful generators: the default one seeded seed + 100 pp_rank for hidden
// dropout, the tensor-parallel tracker seed + 2718 + tp_rank for attention dropout and for everything
// under sequence parallelism. Its masks therefore change with the layout, and a recomputed forward must
// save and restore the generator states. Loom's masks are what its single-rank run draws, in every layout.)
//
// Keys. site = 4 (layer + 1) + kind, kind 0 the attention probabilities, 1 the attention output (hidden
// dropout), 2 the MLP output (hidden dropout); layer -1 (site 0..3) is the embedding. For an element:
//   hidden (s * b, h) activations, row r of the whole sequence (r = position * b + column), feature c:
//       u = fmix64(base(sample of column) + position * 2^32 + c)
//   attention probabilities, query head hq of the whole model, query i, key j:
//       u = fmix64(fmix64(base(sample) ^ (hq * 2^40 + i)) + j)
//   base(sample) = fmix64(seed * K1 ^ fmix64(site * K2 + sample))
// and the element is kept when the top 32 bits of u are >= threshold = round(p * 2^32): kept elements are
// scaled by 1 / (1 - p), dropped ones become 0. fmix64 is MurmurHash3's 64-bit finaliser.
//
// Dropout is linear in its input, so the backward of y = mask(x) is dx = mask(dy), with the same key.
#pragma once

#include "core/host_device.h"

#include <algorithm>
#include <cmath>
#include <cstdint>

// The hash functions below run on the host and, compiled by nvcc, in CUDA kernels (backend/cuda/kernels.cu):
// one definition, so both backends draw the same masks.

namespace loom {

LOOM_HOST_DEVICE inline constexpr uint64_t fmix64(uint64_t k) {
    k ^= k >> 33;
    k *= 0xff51afd7ed558ccdULL;
    k ^= k >> 33;
    k *= 0xc4ceb9fe1a85ec53ULL;
    k ^= k >> 33;
    return k;
}

enum class DropoutKind : int64_t { attention_probs = 0, attention_output = 1, mlp_output = 2 };

// The site of a dropout in the model: layer -1 is the embedding (kind ignored).
inline constexpr uint64_t dropout_site(int64_t layer, DropoutKind kind) {
    return layer < 0 ? 0 : static_cast<uint64_t>(4 * (layer + 1) + static_cast<int64_t>(kind));
}

// p in [0, 1) -> the 32-bit threshold below which an element is dropped.
inline uint32_t dropout_threshold(float p) {
    return static_cast<uint32_t>(std::min(std::llround(static_cast<double>(p) * 4294967296.0), 4294967295LL));
}

LOOM_HOST_DEVICE inline constexpr uint64_t dropout_base(uint64_t seed, uint64_t site, int64_t sample) {
    return fmix64(seed * 0x9e3779b97f4a7c15ULL ^ fmix64(site * 0xd6e8feb86659fd93ULL + static_cast<uint64_t>(sample)));
}

LOOM_HOST_DEVICE inline constexpr bool dropout_keep_hidden(uint64_t base, int64_t position, int64_t feature, uint32_t threshold) {
    return static_cast<uint32_t>(fmix64(base + (static_cast<uint64_t>(position) << 32) + static_cast<uint64_t>(feature)) >> 32) >=
           threshold;
}

LOOM_HOST_DEVICE inline constexpr uint64_t dropout_attention_row(uint64_t base, int64_t head, int64_t query) {
    return fmix64(base ^ ((static_cast<uint64_t>(head) << 40) + static_cast<uint64_t>(query)));
}

LOOM_HOST_DEVICE inline constexpr bool dropout_keep_attention(uint64_t row, int64_t key, uint32_t threshold) {
    return static_cast<uint32_t>(fmix64(row + static_cast<uint64_t>(key)) >> 32) >= threshold;
}

}  // namespace loom
