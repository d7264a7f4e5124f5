// llm.c token shards: the header, then a few samples (each token checked against the vocabulary).
#include "data/llmc_shard.h"
#include "fuzz/fuzz_input.h"

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string path = loom::fuzz::scratch_dir() + "/shard.bin";
    loom::fuzz::write_file(path, data, size);
    try {
        loom::data::LlmcShardDataset ds(path, 4, 0);
        std::vector<int32_t> window(5);
        for (int64_t i = 0; i < std::min<int64_t>(ds.num_samples(), 16); ++i) ds.sample(i, window);
    } catch (const loom::Error &) {
    }
    return 0;
}
