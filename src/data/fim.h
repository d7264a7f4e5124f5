// Fill-in-the-middle samples (--fim-data): Megatron's GPTFIMDataset, the transformation of Bavarian et al.
// (2022, "Efficient Training of Language Models to Fill in the Middle") applied to each sample of a GPT
// dataset after it is read (docs/fim.md).
//
// A sample (seq_length + 1 ids) is cut at every end-of-document id E (the id of --fim-eod-token) into
// segments. Each non-empty segment is transformed on its own and followed by E again; the segment after the
// last E is transformed too, even when empty. A segment that is empty because two E are adjacent (or the
// sample starts with E) is dropped with its E, as Megatron drops it. Transforming a segment:
//
//   with probability --fim-rate (else the segment is kept as it is):
//     text    = the segment decoded (the tokenizer's end-of-text ids left out), as Unicode code points,
//               ill-formed UTF-8 replaced by U+FFFD one maximal subpart at a time (Python's 'replace');
//     i <= j  = two positions drawn uniformly from [0, len(text)], sorted;
//     prefix, middle, suffix = text[0, i), text[i, j), text[j, len), each encoded again;
//     with probability --fim-spm-rate the SPM order, else PSM:
//       SPM: <P> <S> suffix <M> prefix middle          PSM: <P> prefix <S> suffix <M> middle
//     where <P>, <M>, <S> are the ids of --fim-prefix-token, --fim-middle-token, --fim-suffix-token.
//
// With --fim-split-sample T, a segment holding the token T is first cut at each T (with probability
// --fim-rate; else kept whole); each fragment is transformed with probability --fim-fragment-rate and
// followed by T, the same dropping of empty fragments applying. With --fim-no-prefix X, a segment whose text
// starts with X is kept as it is.
//
// The result is cut to seq_length + 1 ids, or padded with the id of --fim-pad-token. A token is looked up
// as the tokenizer's vocabulary spells it; one the vocabulary lacks stands for "<|endoftext|>" (GPT-2's
// unknown token, which is what Megatron's tokenizer returns for it).
//
// Randomness. Megatron draws from one numpy RandomState per dataset object in the order its data-loader
// workers happen to read samples, so its FIM samples depend on --num-workers, the data-parallel size and
// whether the run was resumed. Loom draws sample i's decisions from its own generator, seeded with (seed,
// i): the same sample comes out the same on every layout, after a resume and on any rank. The draws are,
// in Megatron's order: the split decision (with --fim-split-sample), then per segment or fragment the FIM
// decision, the two positions, the SPM decision. A decision of probability p is u < p for a uniform u of
// 53 bits; a position is an unbiased draw from [0, len] (data/gpt_dataset.h's draw_below).
#pragma once

#include "data/gpt2_bpe.h"

#include <cstdint>
#include <memory>
#include <mutex>
#include <optional>
#include <random>
#include <span>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

struct FimOptions {
    double                     rate          = 0.5;   // --fim-rate
    double                     spm_rate      = 0.5;   // --fim-spm-rate
    std::string                split_sample;          // --fim-split-sample ("": none)
    std::optional<double>      fragment_rate;         // --fim-fragment-rate (needed with split_sample)
    std::optional<std::string> no_prefix;             // --fim-no-prefix
    std::string prefix_token = "<fim_prefix>", middle_token = "<fim_middle>", suffix_token = "<fim_suffix>",
                pad_token = "<fim_pad>", eod_token = std::string(kGpt2EndOfText);
};

// The code points of `bytes` read as UTF-8, each maximal ill-formed subpart replaced by U+FFFD (Unicode's
// recommended practice; Python's errors='replace').
std::u32string decode_utf8_lossy(std::string_view bytes);
std::string    encode_utf8(std::u32string_view text);

class FimTransform {
public:
    // Looks the tokens up in `tokenizer` (which must hold "<|endoftext|>") and checks the rates.
    FimTransform(std::shared_ptr<Gpt2BpeTokenizer> tokenizer, FimOptions options, uint64_t seed);

    // Rewrites `sample`, sample `index` of its dataset, in place (see the top of this file).
    void apply(int64_t index, std::span<int32_t> sample) const;

    struct Ids {
        int32_t prefix = -1, middle = -1, suffix = -1, pad = -1, eod = -1;
        int32_t split = -1;   // --fim-split-sample's id, -1 without it
    };
    const Ids &        ids() const { return ids_; }
    const FimOptions & options() const { return options_; }
    std::string        describe() const;

private:
    using Rng = std::mt19937_64;
    using Ids32 = std::vector<int32_t>;
    bool  decide(Rng & rng, double p) const;
    Ids32 permute(std::span<const int32_t> segment, double rate, Rng & rng) const;
    Ids32 split_and_permute(std::span<const int32_t> segment, Rng & rng) const;

    std::shared_ptr<Gpt2BpeTokenizer> tokenizer_;   // encode() caches: used under mutex_
    FimOptions                        options_;
    uint64_t                          seed_;
    Ids                               ids_;
    int32_t                           special_ = -1;   // "<|endoftext|>": left out of the decoded text
    mutable std::mutex                mutex_;
};

}  // namespace loom::data
