// Weighted blends of Megatron datasets: --data-path 0.3 A 0.7 B, as megatron/core/datasets reads and builds
// them (utils.py get_blend_from_list and normalize, blended_megatron_dataset_builder.py, blended_dataset.py,
// helpers.cpp build_blending_indices).
//
// The list (parse_blend). --data-path takes either prefixes alone, "A B C", or weight/prefix pairs,
// "0.3 A 0.7 B". As get_blend_from_list: a list of even length whose every word at positions 0, 2, 4, ...
// reads as a number (Python's float()) is pairs; any other list is prefixes alone (prefixes are stripped
// of surrounding spaces). Loom refuses what Megatron would turn into a confusing failure later, naming the
// flag and the word: a list that mixes numbers and non-numbers in the weight positions, a weight that is
// not a finite number > 0 (Megatron's BlendedDataset asserts w > 0), and a list of prefixes alone with a
// word that reads as a number ("0.3 A 0.7": an odd count with weights; Loom does not take a number as a
// prefix).
//
// The blend of a split of N samples (BlendedMegatronDatasetBuilder):
//   one prefix without a weight:  the GPT dataset of that prefix alone, N samples (no blending layer; the
//                                 samples are exactly those of gpt_dataset.h)
//   weights w (normalised twice, as the builder and then BlendedDataset normalise: w_d / sum(w), the sum
//   added as numpy.sum adds float64):
//       dataset d is built with  ceil(ceil(N w_d) (1 + surplus))  samples   (surplus: --mid-level-dataset-surplus,
//                                                                         0.005 by default, the same for
//                                                                         train, valid and test)
//       the blend has            S = sum_d ceil(N w_d)  samples (>= N)
//   prefixes without weights: each dataset is one epoch of its split, the weights are their sample
//       counts L_d, and the blend has S = min(N, sum_d L_d) samples (fewer than N when the data is short;
//       the loader then wraps around, where Megatron would stop).
// --train-data-path / --valid-data-path / --test-data-path (Megatron's blend_per_split) use each dataset
// whole for their split instead of its --split range, and there one prefix is never blended, with or
// without a weight.
//
// The blending index (build_blending_indices): with c_d = 0 samples taken from each dataset so far, for
// i = 0 .. S-1, sample i comes from the dataset d with the largest error
//       e_d = w_d * max(i, 1) - c_d          (ties to the lowest d)
// and is sample c_d of that dataset; then c_d += 1. The greedy keeps every count near w_d i: with two
// datasets the counts of the whole blend are within one sample of w_d S; with more they can drift a
// little past one (1.23 samples at worst in random trials of three datasets). tests/test_data.cpp checks
// |c_d - w_d S| <= 1 for (0.3, 0.7) and (0.2, 0.5, 0.3) at every S up to 2000.
// Worked example, w = (0.3, 0.7), N = 10: the datasets are built with ceil(3 x 1.005) = 4 and
// ceil(7 x 1.005) = 8 samples, S = 3 + 7 = 10, and
//       i               0    1    2    3    4    5    6    7    8    9
//       e_0            0.3  0.3 -0.4 -0.1  0.2 -0.5 -0.2  0.1 -0.6 -0.3
//       e_1            0.7 -0.3  0.4  0.1 -0.2  0.5  0.2 -0.1  0.6  0.3
//       dataset         1    0    1    1    0    1    1    0    1    1
//       its sample      0    0    1    2    1    3    4    2    5    6
// A dataset asked for more samples than it was built with is an error (Megatron's IndexError), with the
// hint to raise --mid-level-dataset-surplus.
//
// The vocabulary of a blend is the largest of its datasets' (each inferred from its data, or each checked
// against --vocab-size). Its indices are cached with the GPT datasets' under --data-cache-path
// (data/index_cache.h: <md5>-BlendedDataset-<split>-dataset_index.npy, -dataset_sample_index.npy).
#pragma once

#include "data/gpt_dataset.h"
#include "data/index_cache.h"
#include "data/token_dataset.h"

#include <cstdint>
#include <memory>
#include <optional>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

// Megatron's blend: prefixes, and a weight per prefix as given (not normalised), or none.
struct Blend {
    std::vector<std::string> prefixes;
    std::vector<double>      weights;   // empty: none given
};

// The words of --data-path (or of `flag`) as described at the top of this file; throws naming `flag` and
// the word at fault.
Blend parse_blend(std::span<const std::string> words, const std::string & flag = "--data-path");

// Megatron's normalize: w_d / sum(w), with the sum as numpy.sum adds float64 (pairwise in blocks of 8 up
// to 128, recursively halved above, in chunks of 8192), so the weights are Megatron's to the last bit.
std::vector<double> normalize_weights(std::span<const double> weights);

// _get_size_per_split_per_dataset for one split: ceil(ceil(size x w_d) x (1 + surplus)) for each d.
std::vector<int64_t> samples_per_dataset(std::span<const double> normalized_weights, int64_t size, double surplus = 0.0);

struct BlendingIndex {
    std::vector<int16_t> dataset_index;          // (S) the dataset of each sample of the blend
    std::vector<int64_t> dataset_sample_index;   // (S) the sample of that dataset
};
// build_blending_indices: `size` samples following `weights` (normalised), see the top of this file.
BlendingIndex build_blending_index(std::span<const double> weights, int64_t size);

class BlendedDataset : public TokenDataset {
public:
    // `weights` are normalised here (again, as Megatron's BlendedDataset does); `size` is S. Throws when
    // a dataset is asked for more samples than it has. `name` is the split's.
    BlendedDataset(std::vector<std::unique_ptr<GptDataset>> datasets, std::vector<double> weights, int64_t size,
                   std::string name, const IndexCacheOptions & cache = {});

    int64_t     num_samples() const override { return static_cast<int64_t>(index_.dataset_index.size()); }
    int64_t     vocab_size() const override { return vocab_size_; }
    int64_t     seq_length() const override { return datasets_.front()->seq_length(); }
    std::string describe() const override { return text(true); }
    std::string identity() const override { return text(false); }
    // Sample dataset_sample_index[i] of dataset dataset_index[i].
    void        sample(int64_t index, std::span<int32_t> out) const override;

    const BlendingIndex &                            index() const { return index_; }
    const std::vector<double> &                      weights() const { return weights_; }
    const std::vector<std::unique_ptr<GptDataset>> & datasets() const { return datasets_; }
    bool                                             loaded_from_cache() const { return loaded_from_cache_; }

private:
    std::string text(bool cache_notes) const;   // describe() with or without where the indices came from

    std::vector<std::unique_ptr<GptDataset>> datasets_;
    std::vector<double>                      weights_;   // normalised
    std::string                              name_, cache_note_;   // where the indices came from
    int64_t                                  vocab_size_ = 0;
    BlendingIndex                            index_;
    bool                                     loaded_from_cache_ = false;
};

// What every GPT dataset of a blend is built with.
struct GptDatasetOptions {
    int64_t           seq_length = 0;
    uint64_t          seed       = 0;
    int64_t           vocab_size = 0;        // 0: each dataset's largest id + 1
    double            mid_level_dataset_surplus = 0.005;
    IndexCacheOptions cache;                 // --data-cache-path
    std::shared_ptr<const FimTransform> fim;  // --fim-data: every GPT dataset's samples transformed (data/fim.h)
};

// The `which` split of `blend`, N = num_samples (> 0) samples, as the builder makes it (see the top of
// this file): a GptDataset for one prefix without a weight, a BlendedDataset otherwise. `split` is --split,
// cut over each dataset's documents; std::nullopt takes each dataset whole (--train-data-path, ...).
std::unique_ptr<TokenDataset> open_blended_split(const Blend & blend, const std::optional<std::string> & split,
                                                 Split which, int64_t num_samples, const GptDatasetOptions & options);

}  // namespace loom::data
