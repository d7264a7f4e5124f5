// The order in which every backend adds a column of rows into an accumulator: the bias gradient
// (dbias[j] += sum over rows of dy[r][j]) and the norms' parameter gradients (dgamma, dbeta). One order,
// fixed by the shape alone (never by a thread count or a GPU's width), so the CPU and the CUDA kernels give
// the same bits, run to run:
//
//   rows in chunks of kColumnSumRows; chunk 0's rows are added to the accumulator one by one, in row order;
//   every later chunk is summed by itself from zero, in row order, and that sum is added to the accumulator,
//   chunks in order.
//
// So n <= kColumnSumRows rows are the plain serial sum, and a GPU reduces 16 384 rows as 256 chunks summed
// side by side, then 256 partial sums per column, instead of one thread walking all the rows of its column.
#pragma once

#include <cstdint>

namespace loom {

constexpr int64_t kColumnSumRows = 64;

// The chunks n rows make (at least one, so an empty sum still writes its accumulator).
constexpr int64_t column_sum_chunks(int64_t n) { return n <= kColumnSumRows ? 1 : (n + kColumnSumRows - 1) / kColumnSumRows; }

}  // namespace loom
