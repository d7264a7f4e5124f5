// The Megatron .idx/.bin reader and the GPT sample index over it. Input: u16 little-endian length k of the
// .idx, then k bytes of .idx, then the .bin.
#include "data/gpt_dataset.h"
#include "data/indexed_dataset.h"
#include "fuzz/fuzz_input.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    if (size < 2) return 0;
    size_t k = std::min<size_t>(size - 2, static_cast<size_t>(data[0] | (data[1] << 8)));
    const std::string prefix = loom::fuzz::scratch_dir() + "/ds";
    loom::fuzz::write_file(prefix + ".idx", data + 2, k);
    loom::fuzz::write_file(prefix + ".bin", data + 2 + k, size - 2 - k);
    try {
        loom::data::IndexedDataset ds(prefix);
        ds.token_range();
        for (int64_t i = 0; i < std::min<int64_t>(ds.num_sequences(), 64); ++i) ds.sequence(i);
        auto gpt = loom::data::open_gpt_dataset(prefix, "1,1,1", loom::data::Split::train, 8, 16, 1234, 0);
        std::vector<int32_t> window(9);
        for (int64_t i = 0; i < std::min<int64_t>(gpt->num_samples(), 8); ++i) gpt->sample(i, window);
    } catch (const loom::Error &) {
    }
    return 0;
}
