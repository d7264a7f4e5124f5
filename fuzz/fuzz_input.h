// Shared by the fuzz targets: the input written to a file in memory (/dev/shm when present), since Loom's
// readers take paths; and the rule that a loom::Error is the expected way to refuse bad input.
#pragma once

#include "core/error.h"

#include <cstdint>
#include <cstdio>
#include <filesystem>
#include <string>
#include <unistd.h>

namespace loom::fuzz {

inline std::string scratch_dir() {
    static const std::string dir = [] {
        std::string base = std::filesystem::exists("/dev/shm") ? "/dev/shm" : std::filesystem::temp_directory_path().string();
        std::string d    = base + "/loom_fuzz_" + std::to_string(::getpid());
        std::filesystem::create_directories(d);
        return d;
    }();
    return dir;
}

inline void write_file(const std::string & path, const uint8_t * data, size_t size) {
    std::FILE * f = std::fopen(path.c_str(), "wb");
    if (!f) std::abort();
    if (size) std::fwrite(data, 1, size, f);
    std::fclose(f);
}

}  // namespace loom::fuzz
