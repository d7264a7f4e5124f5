// CRC-32C (Castagnoli): the checksum of checkpoint files and of TensorBoard's event records.
#pragma once

#include <cstddef>
#include <cstdint>

namespace loom {

// CRC-32C of `bytes`, continuing from `crc` (0 to start); SSE4.2's instruction where the CPU has it, a table
// elsewhere (the same values).
uint32_t crc32c(const void * data, size_t bytes, uint32_t crc = 0);

}  // namespace loom
