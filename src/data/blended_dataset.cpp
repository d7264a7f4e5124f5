#include "data/blended_dataset.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <cmath>
#include <cstdlib>
#include <sstream>

namespace loom::data {

namespace {

std::string strip(const std::string & word) {
    const size_t a = word.find_first_not_of(" \t\n\r\f\v"), b = word.find_last_not_of(" \t\n\r\f\v");
    return a == std::string::npos ? std::string() : word.substr(a, b - a + 1);
}

// Python's float(word): surrounding whitespace allowed, decimal or inf/nan, no hexadecimal; std::nullopt
// when the word is not a number.
std::optional<double> as_number(const std::string & word) {
    const std::string text = strip(word);
    if (text.empty() || text.find_first_of("xX") != std::string::npos) return std::nullopt;
    char * end = nullptr;
    errno      = 0;
    const double value = std::strtod(text.c_str(), &end);
    if (end != text.c_str() + text.size()) return std::nullopt;
    return value;
}

// numpy's pairwise summation of float64 (pairwise_sum_DOUBLE): sequential below 8 values, 8 running sums
// up to 128, halved (on a multiple of 8) above.
double pairwise_sum(const double * a, size_t n) {
    if (n < 8) {
        double sum = 0.0;
        for (size_t i = 0; i < n; ++i) sum += a[i];
        return sum;
    }
    if (n <= 128) {
        double r[8];
        for (int j = 0; j < 8; ++j) r[j] = a[j];
        size_t i = 8;
        for (; i < n - n % 8; i += 8) {
            for (int j = 0; j < 8; ++j) r[j] += a[i + j];
        }
        double sum = ((r[0] + r[1]) + (r[2] + r[3])) + ((r[4] + r[5]) + (r[6] + r[7]));
        for (; i < n; ++i) sum += a[i];
        return sum;
    }
    size_t half = n / 2;
    half -= half % 8;
    return pairwise_sum(a, half) + pairwise_sum(a + half, n - half);
}

}  // namespace

Blend parse_blend(std::span<const std::string> words, const std::string & flag) {
    const std::string pairs_hint = "give each weight before its prefix (" + flag + " 0.3 A 0.7 B), or prefixes alone (" +
                                   flag + " A B: weighted by their sizes)";
    LOOM_CHECK(!words.empty(), flag << " needs at least one dataset prefix", pairs_hint);
    const size_t n = words.size();
    Blend        blend;
    bool         pairs = false;
    if (n % 2 == 0) {
        std::optional<size_t> number, other;   // the first weight position that is (is not) a number
        for (size_t i = 0; i < n; i += 2) {
            if (as_number(words[i]) && !number) number = i;
            if (!as_number(words[i]) && !other) other = i;
        }
        LOOM_CHECK(!(number && other), flag << ": '" << words[*other] << "' (word " << *other + 1
                                            << ") is not a number, and '" << words[*number] << "' (word " << *number + 1
                                            << ") is a weight: the list mixes WEIGHT PREFIX pairs with prefixes alone",
                   pairs_hint);
        pairs = number.has_value();
    }
    if (pairs) {
        for (size_t i = 0; i < n; i += 2) {
            const double      w      = *as_number(words[i]);
            const std::string prefix = strip(words[i + 1]);
            LOOM_CHECK(std::isfinite(w) && w > 0.0,
                       flag << ": the weight '" << words[i] << "' (word " << i + 1 << ") of '" << prefix << "' is "
                            << (std::isfinite(w) ? (w < 0 ? "negative" : "zero") : "not a finite number"),
                       "weights must be finite numbers > 0 (they are normalised to sum to 1); leave a dataset out "
                       "rather than giving it the weight 0");
            LOOM_CHECK(!prefix.empty() && !as_number(prefix),
                       flag << ": '" << words[i + 1] << "' (word " << i + 2 << ") stands where the prefix of weight '"
                            << words[i] << "' belongs, and is " << (prefix.empty() ? "empty" : "a number"),
                       pairs_hint);
            blend.weights.push_back(w);
            blend.prefixes.push_back(prefix);
        }
        return blend;
    }
    for (size_t i = 0; i < n; ++i) {
        const std::string prefix = strip(words[i]);
        LOOM_CHECK(!prefix.empty(), flag << ": word " << i + 1 << " is empty", pairs_hint);
        LOOM_CHECK(!as_number(prefix), flag << ": '" << words[i] << "' (word " << i + 1 << ") reads as a weight, but the "
                                            << n << " words are not WEIGHT PREFIX pairs"
                                            << (n % 2 == 1 ? " (an odd count)" : " (a weight must come before its prefix)"),
                   pairs_hint);
        blend.prefixes.push_back(prefix);
    }
    return blend;
}

std::vector<double> normalize_weights(std::span<const double> weights) {
    // numpy.sum: the identity 0.0 plus the pairwise sum of each chunk of the iterator's buffer (8192).
    constexpr size_t kChunk = 8192;
    double           sum    = 0.0;
    for (size_t at = 0; at < weights.size(); at += kChunk) {
        sum += pairwise_sum(weights.data() + at, std::min(kChunk, weights.size() - at));
    }
    LOOM_CHECK(std::isfinite(sum) && sum > 0.0, "blend weights summing to " << sum, "give positive finite weights");
    std::vector<double> normalized(weights.begin(), weights.end());
    for (double & w : normalized) w /= sum;
    return normalized;
}

std::vector<int64_t> samples_per_dataset(std::span<const double> normalized_weights, int64_t size, double surplus) {
    std::vector<int64_t> sizes;
    for (double w : normalized_weights) {
        const double target = std::ceil(static_cast<double>(size) * w);
        sizes.push_back(static_cast<int64_t>(std::ceil(target * (1.0 + surplus))));
    }
    return sizes;
}

BlendingIndex build_blending_index(std::span<const double> weights, int64_t size) {
    const size_t k = weights.size();
    LOOM_CHECK(k >= 1 && k < 32767, "a blend of " << k << " datasets", "Megatron's blends hold 1 to 32766 datasets");
    LOOM_CHECK(size >= 0, "a blend of " << size << " samples", "");
    BlendingIndex index;
    index.dataset_index.resize(static_cast<size_t>(size));
    index.dataset_sample_index.resize(static_cast<size_t>(size));
    std::vector<int64_t> taken(k, 0);
    for (int64_t i = 0; i < size; ++i) {
        const double at   = std::max(static_cast<double>(i), 1.0);
        size_t       best = 0;
        double       most = weights[0] * at - static_cast<double>(taken[0]);
        for (size_t d = 1; d < k; ++d) {
            const double error = weights[d] * at - static_cast<double>(taken[d]);
            if (error > most) {   // strictly: a tie goes to the lower index
                most = error;
                best = d;
            }
        }
        index.dataset_index[static_cast<size_t>(i)]        = static_cast<int16_t>(best);
        index.dataset_sample_index[static_cast<size_t>(i)] = taken[best]++;
    }
    return index;
}

// ---------------------------------------------------------------------------------------------------

BlendedDataset::BlendedDataset(std::vector<std::unique_ptr<GptDataset>> datasets, std::vector<double> weights,
                               int64_t size, std::string name, const IndexCacheOptions & cache)
    : datasets_(std::move(datasets)), name_(std::move(name)) {
    LOOM_CHECK(!datasets_.empty() && datasets_.size() == weights.size() && datasets_.size() < 32767,
               "a blend of " << datasets_.size() << " datasets with " << weights.size() << " weights", "");
    for (double w : weights) LOOM_CHECK(std::isfinite(w) && w > 0.0, "a blend weight of " << w, "weights must be > 0");
    weights_ = normalize_weights(weights);
    for (const auto & d : datasets_) {
        LOOM_CHECK(d->seq_length() == datasets_.front()->seq_length(), "a blend of datasets of different sequence lengths",
                   "");
        vocab_size_ = std::max(vocab_size_, d->vocab_size());
    }

    nlohmann::ordered_json description;
    description["class"] = "BlendedDataset";
    description["datasets"] = nlohmann::ordered_json::array();
    for (const auto & d : datasets_) description["datasets"].push_back(nlohmann::ordered_json::parse(d->cache_description()));
    description["split"]         = name_;
    description["weights"]       = weights_;
    description["size"]          = size;
    description["index_builder"] = "loom-1: build_blending_indices (src/data/blended_dataset.h)";
    static const std::string arrays[] = {"dataset_index.npy", "dataset_sample_index.npy"};
    const IndexCacheEntry    entry(cache, description.dump(4), "BlendedDataset", name_);
    const char * hint = "delete the files of this set (the files sharing its hash prefix) and run again; Loom rebuilds "
                        "and rewrites them";

    if (entry.complete(arrays)) {
        entry.check_description();
        NpyArray<int16_t> which  = read_npy<int16_t>(entry.path(arrays[0]));
        NpyArray<int64_t> sample = read_npy<int64_t>(entry.path(arrays[1]));
        LOOM_CHECK(which.shape == std::vector<int64_t>{size}, "'" << entry.path(arrays[0]) << "' holds "
                                                                  << which.values.size() << " values, and the blend has "
                                                                  << size << " samples",
                   hint);
        LOOM_CHECK(sample.shape == std::vector<int64_t>{size}, "'" << entry.path(arrays[1]) << "' holds "
                                                                   << sample.values.size() << " values, and the blend has "
                                                                   << size << " samples",
                   hint);
        for (size_t i = 0; i < which.values.size(); ++i) {
            const int16_t d = which.values[i];
            LOOM_CHECK(d >= 0 && static_cast<size_t>(d) < datasets_.size(),
                       "'" << entry.path(arrays[0]) << "' names dataset " << d << " of a blend of " << datasets_.size(), hint);
            LOOM_CHECK(sample.values[i] >= 0 && sample.values[i] < datasets_[static_cast<size_t>(d)]->num_samples(),
                       "'" << entry.path(arrays[1]) << "' asks dataset " << d << " for sample " << sample.values[i]
                           << ", outside its " << datasets_[static_cast<size_t>(d)]->num_samples(),
                       hint);
        }
        index_.dataset_index        = std::move(which.values);
        index_.dataset_sample_index = std::move(sample.values);
        loaded_from_cache_          = true;
        cache_note_                 = " [indices loaded from " + cache.path + "]";
        return;
    }

    index_ = build_blending_index(weights_, size);
    // Megatron's IndexError: a dataset asked for more samples than it was built with.
    std::vector<int64_t> drawn(datasets_.size(), 0);
    for (int16_t d : index_.dataset_index) ++drawn[static_cast<size_t>(d)];
    for (size_t d = 0; d < datasets_.size(); ++d) {
        LOOM_CHECK(drawn[d] <= datasets_[d]->num_samples(),
                   "the " << name_ << " blend draws " << drawn[d] << " samples from dataset " << d << " ('"
                          << datasets_[d]->indexed_dataset().prefix() << "'), more than the "
                          << datasets_[d]->num_samples() << " it was built with",
                   "raise --mid-level-dataset-surplus (default 0.005), e.g. two- or ten-fold, so that each dataset is "
                   "built with more samples than the blend draws from it");
    }
    if (!entry.start_writing(cache_note_)) return;
    const std::vector<int64_t> shape{size};
    write_npy<int16_t>(entry.path(arrays[0]), index_.dataset_index, shape);
    write_npy<int64_t>(entry.path(arrays[1]), index_.dataset_sample_index, shape);
    entry.write_description();
}

std::string BlendedDataset::text(bool cache_notes) const {
    std::ostringstream os;
    os << "Megatron blend of " << datasets_.size() << " datasets (" << name_ << " split, " << num_samples()
       << " samples, vocab " << vocab_size_ << ", weights";
    for (double w : weights_) os << " " << w;
    os << ")";
    if (cache_notes) os << cache_note_;
    for (size_t d = 0; d < datasets_.size(); ++d) {
        os << (d == 0 ? ": " : "; ") << (cache_notes ? datasets_[d]->describe() : datasets_[d]->identity());
    }
    return os.str();
}

void BlendedDataset::sample(int64_t index, std::span<int32_t> out) const {
    LOOM_CHECK(index >= 0 && index < num_samples(), "sample " << index << " outside [0, " << num_samples() << ")", "");
    const size_t i = static_cast<size_t>(index);
    datasets_[static_cast<size_t>(index_.dataset_index[i])]->sample(index_.dataset_sample_index[i], out);
}

// ---------------------------------------------------------------------------------------------------

std::unique_ptr<TokenDataset> open_blended_split(const Blend & blend, const std::optional<std::string> & split,
                                                 Split which, int64_t num_samples, const GptDatasetOptions & o) {
    const size_t k = blend.prefixes.size();
    LOOM_CHECK(k >= 1 && (blend.weights.empty() || blend.weights.size() == k),
               "a blend of " << k << " prefixes and " << blend.weights.size() << " weights", "");
    const std::string name     = split_name(which);
    auto              open_one = [&](const std::string & prefix, int64_t samples) {
        auto          data  = std::make_shared<const IndexedDataset>(prefix);
        DocumentRange range = split ? split_documents(*split, data->num_sequences())[static_cast<size_t>(which)]
                                    : DocumentRange{0, data->num_sequences()};
        auto dataset = std::make_unique<GptDataset>(data, range, o.seq_length, samples, o.seed, o.vocab_size, name, o.cache);
        dataset->set_fim(o.fim);
        return dataset;
    };
    // One prefix: its GPT dataset, no blending layer (per split, also with a weight).
    if (k == 1 && (blend.weights.empty() || !split)) return open_one(blend.prefixes.front(), num_samples);

    std::vector<std::unique_ptr<GptDataset>> datasets;
    if (!blend.weights.empty()) {
        LOOM_CHECK(num_samples > 0, "a weighted blend needs the number of samples of its split", "");
        const std::vector<double>  weights = normalize_weights(blend.weights);
        const std::vector<int64_t> target  = samples_per_dataset(weights, num_samples);
        const std::vector<int64_t> built   = samples_per_dataset(weights, num_samples, o.mid_level_dataset_surplus);
        int64_t                    size    = 0;
        for (size_t d = 0; d < k; ++d) {
            datasets.push_back(open_one(blend.prefixes[d], built[d]));
            size += target[d];
        }
        return std::make_unique<BlendedDataset>(std::move(datasets), weights, size, name, o.cache);
    }
    // Prefixes alone: one epoch of each, weighted by its samples.
    std::vector<double> lengths;
    int64_t             total = 0;
    for (size_t d = 0; d < k; ++d) {
        datasets.push_back(open_one(blend.prefixes[d], 0));
        lengths.push_back(static_cast<double>(datasets.back()->num_samples()));
        total += datasets.back()->num_samples();
    }
    const int64_t size = num_samples > 0 ? std::min(num_samples, total) : total;
    return std::make_unique<BlendedDataset>(std::move(datasets), lengths, size, name, o.cache);
}

}  // namespace loom::data
