// The GPT dataset over a Megatron indexed dataset: train/valid/test splits of the documents, and the
// document, sample and shuffle indices of megatron/core/datasets/gpt_dataset.py and helpers.cpp.
//
// Documents. As in Megatron's GPTDataset, the unit that is split and shuffled is a sequence of the .idx
// (preprocess_data.py writes one sequence per document, so at the "document" level the two coincide).
//
// Split (--split "969,30,1"): the weights are normalised, w_i / sum(w) (missing ones are 0), and the
// documents [0, D) are cut as _get_split_indices does:
//   b_0 = 0,  b_{i+1} = b_i + round(w_i * D)   (round half to even, like Python's round)
//   b_i -= b_3 - D for i >= 1                  (so the last boundary is exactly D)
// train = [b_0, b_1), valid = [b_1, b_2), test = [b_2, b_3).
// Example: D = 1000, "969,30,1" -> train [0, 969), valid [969, 999), test [999, 1000).
//
// Epochs. With T tokens in a split and seq_length s, one epoch gives floor((T - 1) / s) samples (the last
// token of a sample is the first of the next). For num_samples requested, the epoch count E is the
// smallest with E * T >= num_samples * s + 1. When E > 1 and the last epoch would be used for less than
// 80% of its samples, the last epoch is shuffled apart ("separate final epoch"), as Megatron does, so the
// samples it contributes are spread over the whole document set instead of bunched at the end.
//
// Document index: the split's documents repeated E times and shuffled (the first E - 1 epochs together
// and the last one on its own when separated).
//
// Sample index (build_sample_idx): entry k = (position p in the document index, token offset o); sample k
// is the tokens from (p_k, o_k) to (p_{k+1}, o_{k+1}) inclusive: seq_length + 1 tokens that run across
// document boundaries, and sample k + 1 starts on the last token of sample k. Worked example, documents
// of 4, 3 and 5 tokens in document-index order, seq_length 3:
//   tokens  a0 a1 a2 a3 | b0 b1 b2 | c0 c1 c2 c3 c4          T = 12, floor(11 / 3) = 3 samples
//   index   (0,0) (0,3) (1,2) (2,2)
//   samples [a0 a1 a2 a3] [a3 b0 b1 b2] [b2 c0 c1 c2]        (c3 c4 are left over)
//
// Shuffle index: a permutation of the samples (the final epoch's samples permuted apart when separated);
// sample(i) returns sample shuffle_index[i].
//
// Randomness. Exact parity with numpy.random.RandomState is NOT a goal: one std::mt19937_64 seeded with
// `seed` drives, in this order, the document-index shuffle(s) and then the shuffle-index shuffle(s). Each
// shuffle is Fisher-Yates from the back, for i = n-1 down to 1: j = draw_below(i + 1), swap(a[i], a[j]),
// where draw_below(m) takes 64-bit draws x, rejects those below 2^64 mod m, and returns x mod m (unbiased
// and identical on every platform, unlike std::uniform_int_distribution). Same seed, same samples.
//
// The indices are built in memory on construction. With --data-cache-path they are cached as .npy files,
// as Megatron caches them, and a later run with the same description loads them (data/index_cache.h).
#pragma once

#include "data/index_cache.h"
#include "data/indexed_dataset.h"
#include "data/token_dataset.h"

#include <array>
#include <cstdint>
#include <memory>
#include <random>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

class FimTransform;

enum class Split { train = 0, valid = 1, test = 2 };
const char * split_name(Split split);   // "train", "valid", "test"

struct DocumentRange {
    int64_t begin = 0, end = 0;   // [begin, end)
    int64_t size() const { return end - begin; }
    bool    operator==(const DocumentRange &) const = default;
};

// "969,30,1" (commas or slashes; up to 3 non-negative weights, missing ones 0) -> normalised weights.
std::array<double, 3> parse_split(const std::string & split);
// The train, valid and test document ranges of num_documents documents (see the top of this file).
std::array<DocumentRange, 3> split_documents(const std::string & split, int64_t num_documents);

// A uniform draw from [0, m) (m >= 1) by rejection; see "Randomness" above.
uint64_t draw_below(std::mt19937_64 & rng, uint64_t m);
// Fisher-Yates from the back with draw_below.
template <typename T> void shuffle_in_place(std::span<T> values, std::mt19937_64 & rng) {
    for (size_t i = values.size(); i > 1; --i) {
        size_t j = static_cast<size_t>(draw_below(rng, i));
        std::swap(values[i - 1], values[j]);
    }
}

// The documents repeated num_epochs times and shuffled; with separate_final_epoch the first
// num_epochs - 1 epochs are shuffled together and the last one apart (Megatron's _build_document_index).
std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          std::mt19937_64 & rng, bool separate_final_epoch);

// Megatron's build_sample_idx with add_extra_token = 1 and drop_last_partial_sequence: sizes are the
// token counts of every sequence of the dataset (indexed by the ids in document_index); returns
// num_samples + 1 pairs (position in document_index, token offset), flat: (num_samples + 1, 2).
std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t tokens_per_epoch, int64_t num_epochs);

// [0, num_samples) shuffled, then [num_samples, total_size) shuffled apart (Megatron's _build_shuffle_index).
std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, std::mt19937_64 & rng);

// The sizes of the indices for the documents of `range`, computed from the sizes alone (what
// build_gpt_sample_index builds, and what a cached set must hold). Throws when the range holds no sample
// of seq_length + 1 tokens.
struct GptIndexPlan {
    int64_t tokens_per_epoch     = 0;   // T
    int64_t num_epochs           = 1;   // E
    bool    separate_final_epoch = false;
    int64_t samples_before_final = 0;   // floor(((E - 1) T - 1) / s), when the final epoch is separate
    int64_t total_samples        = 0;   // floor((E T - 1) / s)
};
GptIndexPlan plan_gpt_sample_index(std::span<const int32_t> sizes, DocumentRange range, int64_t seq_length,
                                   int64_t num_samples);

struct GptSampleIndex {
    int64_t              tokens_per_epoch = 0;
    int64_t              num_epochs = 0;
    bool                 separate_final_epoch = false;
    std::vector<int32_t> document_index;   // (E * documents) sequence ids
    std::vector<int64_t> sample_index;     // (num_samples + 1, 2) position in document_index, token offset
    std::vector<int64_t> shuffle_index;    // (num_samples)
    int64_t num_samples() const { return static_cast<int64_t>(shuffle_index.size()); }
};

// All three indices for the documents of `range` (sizes: every sequence's length). num_samples <= 0 asks
// for one epoch. Throws when the range holds no sample of seq_length + 1 tokens.
GptSampleIndex build_gpt_sample_index(std::span<const int32_t> sizes, DocumentRange range, int64_t seq_length,
                                      int64_t num_samples, uint64_t seed);

class GptDataset : public TokenDataset {
public:
    // The documents of `range` of an opened indexed dataset. vocab_size 0: the largest token id + 1
    // (one pass over the .bin); otherwise every token read is checked against vocab_size, and one outside
    // it throws naming the .bin. num_samples <= 0: one epoch. `name` is the split's ("train", "valid",
    // "test"); with cache.path the indices are loaded from or written to the cache (data/index_cache.h).
    GptDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange range, int64_t seq_length,
               int64_t num_samples, uint64_t seed, int64_t vocab_size = 0, std::string name = "train",
               const IndexCacheOptions & cache = {});

    int64_t     num_samples() const override { return index_.num_samples(); }
    int64_t     vocab_size() const override { return vocab_size_; }
    int64_t     seq_length() const override { return seq_length_; }
    std::string describe() const override { return identity() + cache_note_; }
    std::string identity() const override;
    // Sample shuffle_index[index]; with a FIM transform, transformed (data/fim.h).
    void sample(int64_t index, std::span<int32_t> out) const override;
    // --fim-data: every sample() goes through `fim` (null: none); identity() names it.
    void set_fim(std::shared_ptr<const FimTransform> fim) { fim_ = std::move(fim); }
    // Sample `index` of the sample index, before shuffling (what the tests walk in order).
    void sample_unshuffled(int64_t index, std::span<int32_t> out) const;

    const GptSampleIndex & index() const { return index_; }
    const DocumentRange &  range() const { return range_; }
    const IndexedDataset & indexed_dataset() const { return *data_; }
    // The JSON text that names the cached indices (data/index_cache.h): Megatron's unique description.
    const std::string &    cache_description() const { return description_; }
    // Whether the indices came from --data-cache-path rather than being built.
    bool                   loaded_from_cache() const { return loaded_from_cache_; }

private:
    void load_or_build(std::span<const int32_t> sizes, int64_t num_samples, const IndexCacheOptions & cache);

    std::shared_ptr<const IndexedDataset> data_;
    DocumentRange                         range_;
    int64_t                               seq_length_, vocab_size_;
    uint64_t                              seed_;
    std::string                           name_;
    GptSampleIndex                        index_;
    std::string                           description_, cache_note_;   // cache_note_: where the indices came from
    bool                                  loaded_from_cache_ = false;
    std::shared_ptr<const FimTransform>   fim_;
};

// --data-path PREFIX --split S: the `which` split of the dataset at `prefix`.
std::unique_ptr<GptDataset> open_gpt_dataset(const std::string & prefix, const std::string & split, Split which,
                                             int64_t seq_length, int64_t num_samples, uint64_t seed,
                                             int64_t vocab_size = 0, const IndexCacheOptions & cache = {});

}  // namespace loom::data
