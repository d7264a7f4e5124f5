// The GPT-2 BPE vocabulary (JSON) and merges readers, then an encode and decode. Input: the vocabulary,
// a NUL byte, the merges, a NUL byte, the text to encode.
#include "data/gpt2_bpe.h"
#include "fuzz/fuzz_input.h"

#include <string_view>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    std::string_view input(reinterpret_cast<const char *>(data), size);
    size_t           a = input.find('\0');
    if (a == std::string_view::npos) return 0;
    size_t b = input.find('\0', a + 1);
    if (b == std::string_view::npos) b = size;
    const std::string dir = loom::fuzz::scratch_dir();
    loom::fuzz::write_file(dir + "/vocab.json", data, a);
    loom::fuzz::write_file(dir + "/merges.txt", data + a + 1, b - a - 1);
    try {
        loom::data::Gpt2BpeTokenizer tokenizer(dir + "/vocab.json", dir + "/merges.txt");
        std::vector<int32_t> ids = tokenizer.encode(b < size ? input.substr(b + 1) : std::string_view("hello world"));
        tokenizer.decode(ids);
    } catch (const loom::Error &) {
    }
    return 0;
}
