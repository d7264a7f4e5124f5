// llm.c token shards (karpathy/llm.c dev/data/data_common.py, read as llmc/dataloader.h does).
//
//   bytes 0..1023   header: 256 x int32, little-endian
//                     h[0] magic    20240520 (GPT-2)   or 20240801 (Llama 3)
//                     h[1] version  1 (uint16 tokens)  or 7 (uint32 tokens)
//                     h[2] token count n (< 2^31); the other 253 entries are 0
//   bytes 1024..    n tokens, uint16 or uint32; documents are separated by EOT tokens, nothing else
//
// The file size must be exactly 1024 + n * itemsize; a wrong magic, a version that does not belong to
// the magic, or a size mismatch is a loom::Error naming the file and the field.
//
// Samples are consecutive windows of seq_length + 1 tokens with stride seq_length (the last token of a
// sample is the first of the next): sample i = tokens [i s, i s + s + 1), floor((n - 1) / s) samples.
// Worked example: n = 10, s = 4: samples [t0..t4], [t4..t8]; t9 is left over.
#pragma once

#include "data/mapped_file.h"
#include "data/token_dataset.h"

#include <cstdint>
#include <span>
#include <string>

namespace loom::data {

inline constexpr int32_t kLlmcMagicGpt2      = 20240520;
inline constexpr int32_t kLlmcVersionGpt2    = 1;   // uint16 tokens
inline constexpr int32_t kLlmcMagicLlama3    = 20240801;
inline constexpr int32_t kLlmcVersionLlama3  = 7;   // uint32 tokens
inline constexpr size_t  kLlmcHeaderInts     = 256;
inline constexpr int64_t kLlmcVocabGpt2      = 50257;
inline constexpr int64_t kLlmcVocabLlama3    = 128256;

class LlmcShardDataset : public TokenDataset {
public:
    // vocab_size 0: the tokenizer's, by magic (50257 for GPT-2, 128256 for Llama 3). Every token read is
    // checked against the vocabulary; one outside it throws naming the file and the token's position.
    LlmcShardDataset(const std::string & path, int64_t seq_length, int64_t vocab_size = 0);

    int64_t     num_samples() const override { return num_samples_; }
    int64_t     vocab_size() const override { return vocab_size_; }
    int64_t     seq_length() const override { return seq_length_; }
    std::string describe() const override;
    void        sample(int64_t index, std::span<int32_t> out) const override;

    int64_t num_tokens() const { return num_tokens_; }
    int32_t token(int64_t i) const;

private:
    MappedFile file_;
    bool       wide_ = false;   // uint32 tokens (Llama 3)
    int64_t    num_tokens_ = 0, seq_length_ = 0, vocab_size_ = 0, num_samples_ = 0;
};

// Writes a shard (GPT-2 layout with uint16 tokens, or Llama 3 with uint32), atomically (temporary name,
// then rename). Used by tests and converters.
void write_llmc_shard(const std::string & path, std::span<const int32_t> tokens, bool llama3 = false);

}  // namespace loom::data
