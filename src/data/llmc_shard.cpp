#include "data/llmc_shard.h"

#include "core/atomic_file.h"

#include "core/error.h"

#include <algorithm>
#include <array>
#include <cstring>
#include <cerrno>
#include <cstdio>
#include <sstream>
#include <unistd.h>
#include <vector>

namespace loom::data {

namespace {

constexpr const char * kShardHint =
    "pass a token shard written by llm.c's dev/data scripts (e.g. fineweb_train_000001.bin); regenerate it if it "
    "was truncated";

}  // namespace

LlmcShardDataset::LlmcShardDataset(const std::string & path, int64_t seq_length, int64_t vocab_size)
    : file_(path, "llm.c shard"), seq_length_(seq_length) {
    const size_t header = kLlmcHeaderInts * sizeof(int32_t);
    LOOM_CHECK(file_.size() >= header, "llm.c shard '" << path << "' is truncated: " << file_.size()
                                                       << " bytes, fewer than the 1024-byte header (256 x int32)",
               kShardHint);
    int32_t magic   = file_.load<int32_t>(0);
    int32_t version = file_.load<int32_t>(4);
    int32_t count   = file_.load<int32_t>(8);
    LOOM_CHECK(magic == kLlmcMagicGpt2 || magic == kLlmcMagicLlama3,
               "llm.c shard '" << path << "' has a bad magic h[0] = " << magic << ", expected " << kLlmcMagicGpt2
                               << " (GPT-2) or " << kLlmcMagicLlama3 << " (Llama 3)",
               "this is not an llm.c token shard (eval files use magic 20240522 and are not training data); "
                   << kShardHint);
    int32_t expected_version = magic == kLlmcMagicGpt2 ? kLlmcVersionGpt2 : kLlmcVersionLlama3;
    LOOM_CHECK(version == expected_version,
               "llm.c shard '" << path << "' has version h[1] = " << version << " with magic " << magic
                               << "; that magic goes with version " << expected_version,
               "version 1 is GPT-2 (uint16 tokens), version 7 is Llama 3 (uint32 tokens); " << kShardHint);
    wide_ = magic == kLlmcMagicLlama3;
    LOOM_CHECK(count >= 0, "llm.c shard '" << path << "' has a negative token count h[2] = " << count, kShardHint);
    num_tokens_ = count;
    const size_t item     = wide_ ? 4 : 2;
    const size_t expected = header + static_cast<size_t>(count) * item;
    LOOM_CHECK(file_.size() == expected,
               "llm.c shard '" << path << "' has " << file_.size() << " bytes, but its header says h[2] = " << count
                               << " tokens of " << item << " bytes: 1024 + " << count << " x " << item << " = "
                               << expected << " bytes",
               "the shard is " << (file_.size() < expected ? "truncated" : "longer than its header says") << "; "
                               << kShardHint);
    LOOM_CHECK(seq_length >= 1, "--seq-length must be positive, got " << seq_length, "");
    LOOM_CHECK(num_tokens_ >= seq_length + 1,
               "llm.c shard '" << path << "' holds " << num_tokens_ << " tokens, fewer than one sample of --seq-length "
                               << seq_length << " + 1",
               "use a larger shard or a shorter --seq-length");
    num_samples_ = (num_tokens_ - 1) / seq_length;
    vocab_size_  = vocab_size > 0 ? vocab_size : (wide_ ? kLlmcVocabLlama3 : kLlmcVocabGpt2);
}

int32_t LlmcShardDataset::token(int64_t i) const {
    const size_t header = kLlmcHeaderInts * sizeof(int32_t);
    if (wide_) return static_cast<int32_t>(file_.load<uint32_t>(header + 4 * static_cast<size_t>(i)));
    return static_cast<int32_t>(file_.load<uint16_t>(header + 2 * static_cast<size_t>(i)));
}

std::string LlmcShardDataset::describe() const {
    std::ostringstream os;
    os << "llm.c shard " << file_.path() << " (" << (wide_ ? "Llama 3, uint32" : "GPT-2, uint16") << " tokens, "
       << num_tokens_ << " tokens, " << num_samples_ << " samples, vocab " << vocab_size_ << ")";
    return os.str();
}

void LlmcShardDataset::sample(int64_t index, std::span<int32_t> out) const {
    LOOM_CHECK(index >= 0 && index < num_samples_, "sample " << index << " outside [0, " << num_samples_ << ") of '"
                                                             << file_.path() << "'",
               "");
    LOOM_CHECK(static_cast<int64_t>(out.size()) == seq_length_ + 1,
               "a sample holds seq_length + 1 = " << seq_length_ + 1 << " tokens, the buffer " << out.size(), "");
    int64_t start = index * seq_length_;
    for (size_t i = 0; i < out.size(); ++i) {
        out[i] = token(start + static_cast<int64_t>(i));
        LOOM_CHECK(out[i] < vocab_size_, "llm.c shard '" << file_.path() << "' holds token id " << out[i]
                                                         << " at token " << start + static_cast<int64_t>(i)
                                                         << ", outside the vocabulary of " << vocab_size_,
                   "raise --vocab-size above the largest token id, or check that the shard matches the tokenizer");
    }
}

void write_llmc_shard(const std::string & path, std::span<const int32_t> tokens, bool llama3) {
    LOOM_CHECK(tokens.size() < (size_t{1} << 31), "an llm.c shard holds fewer than 2^31 tokens, got " << tokens.size(),
               "write several shards");
    std::array<int32_t, kLlmcHeaderInts> header{};
    header[0] = llama3 ? kLlmcMagicLlama3 : kLlmcMagicGpt2;
    header[1] = llama3 ? kLlmcVersionLlama3 : kLlmcVersionGpt2;
    header[2] = static_cast<int32_t>(tokens.size());
    std::vector<uint8_t> body(tokens.size() * (llama3 ? 4 : 2));
    for (size_t i = 0; i < tokens.size(); ++i) {
        int64_t t = tokens[i];
        LOOM_CHECK(t >= 0 && t <= (llama3 ? int64_t{0xffffffff} : int64_t{0xffff}),
                   "token " << t << " does not fit the " << (llama3 ? "uint32" : "uint16") << " tokens of '" << path << "'",
                   "write a Llama 3 (uint32) shard for vocabularies above 65535");
        if (llama3) {
            uint32_t v = static_cast<uint32_t>(t);
            std::memcpy(body.data() + 4 * i, &v, 4);
        } else {
            uint16_t v = static_cast<uint16_t>(t);
            std::memcpy(body.data() + 2 * i, &v, 2);
        }
    }
    AtomicFile file(path);
    file.write(header.data(), header.size() * sizeof(int32_t));
    file.write(body.data(), body.size());
    file.commit();
}

}  // namespace loom::data
