// A checkpoint's index.json: every field read_index validates (format, counters, metadata, files, tensors
// and their pieces), then verify() over what it accepted. The folder holds one 64-byte file,
// rank_00000.safetensors, so an index may list it with its true size and reach the shard checks.
#include "checkpoint/checkpoint.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string dir = loom::fuzz::scratch_dir() + "/iter_0000002";
    static const bool made = [&] {
        std::filesystem::create_directories(dir);
        const uint8_t zeros[64] = {};
        loom::fuzz::write_file(dir + "/rank_00000.safetensors", zeros, sizeof(zeros));
        return true;
    }();
    (void)made;
    loom::fuzz::write_file(dir + "/index.json", data, size);
    try {
        const loom::checkpoint::Index index = loom::checkpoint::read_index(dir);
        loom::checkpoint::verify(index);
    } catch (const loom::Error &) {
    }
    return 0;
}
