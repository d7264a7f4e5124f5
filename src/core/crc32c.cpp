#include "core/crc32c.h"

#include <array>
#include <cstring>

namespace loom {

namespace {

constexpr uint32_t kCrcPoly = 0x82F63B78u;   // Castagnoli, reflected

const std::array<uint32_t, 256> & crc_table() {
    static const std::array<uint32_t, 256> table = [] {
        std::array<uint32_t, 256> t{};
        for (uint32_t i = 0; i < 256; ++i) {
            uint32_t c = i;
            for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ kCrcPoly : c >> 1;
            t[i] = c;
        }
        return t;
    }();
    return table;
}

uint32_t crc32c_table(const uint8_t * p, size_t n, uint32_t crc) {
    const auto & t = crc_table();
    for (size_t i = 0; i < n; ++i) crc = t[(crc ^ p[i]) & 0xFF] ^ (crc >> 8);
    return crc;
}

__attribute__((target("sse4.2"))) uint32_t crc32c_sse42(const uint8_t * p, size_t n, uint32_t crc) {
    uint64_t c = crc;
    for (; n >= 8; n -= 8, p += 8) {
        uint64_t word;
        std::memcpy(&word, p, 8);
        c = __builtin_ia32_crc32di(c, word);
    }
    uint32_t c32 = static_cast<uint32_t>(c);
    for (; n > 0; --n, ++p) c32 = __builtin_ia32_crc32qi(c32, *p);
    return c32;
}

}  // namespace

uint32_t crc32c(const void * data, size_t bytes, uint32_t crc) {
    static const bool hardware = __builtin_cpu_supports("sse4.2");
    const auto *      p        = static_cast<const uint8_t *>(data);
    crc                        = ~crc;
    crc = hardware ? crc32c_sse42(p, bytes, crc) : crc32c_table(p, bytes, crc);
    return ~crc;
}

}  // namespace loom
