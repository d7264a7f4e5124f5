#include "data/gpt_dataset.h"

#include "core/crc32c.h"
#include "core/error.h"
#include "data/fim.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <limits>
#include <numeric>
#include <sstream>

namespace loom::data {

const char * split_name(Split split) {
    switch (split) {
        case Split::train: return "train";
        case Split::valid: return "valid";
        case Split::test:  return "test";
    }
    return "?";
}

std::array<double, 3> parse_split(const std::string & split) {
    std::array<double, 3> weights{0.0, 0.0, 0.0};
    size_t                count = 0, start = 0;
    while (start <= split.size()) {
        size_t      stop = split.find_first_of(",/", start);
        std::string part = split.substr(start, stop == std::string::npos ? std::string::npos : stop - start);
        size_t      a = part.find_first_not_of(' '), b = part.find_last_not_of(' ');
        part = a == std::string::npos ? "" : part.substr(a, b - a + 1);
        LOOM_CHECK(count < 3, "--split '" << split << "' has more than 3 weights",
                   "give at most three weights, train,valid,test (e.g. --split 969,30,1)");
        double value = -1.0;
        size_t used  = 0;
        try {
            value = std::stod(part, &used);
        } catch (const std::exception &) {
            used = 0;
        }
        LOOM_CHECK(!part.empty() && used == part.size() && std::isfinite(value) && value >= 0.0,
                   "--split '" << split << "': weight " << count + 1 << " ('" << part
                               << "') is not a non-negative number",
                   "give comma-separated weights train,valid,test, e.g. --split 969,30,1");
        weights[count++] = value;
        if (stop == std::string::npos) break;
        start = stop + 1;
    }
    double sum = weights[0] + weights[1] + weights[2];
    LOOM_CHECK(sum > 0.0, "--split '" << split << "' has weights summing to 0",
               "give at least one positive weight, e.g. --split 969,30,1");
    for (double & w : weights) w /= sum;
    return weights;
}

std::array<DocumentRange, 3> split_documents(const std::string & split, int64_t num_documents) {
    std::array<double, 3> weights = parse_split(split);
    std::array<int64_t, 4> bounds{0, 0, 0, 0};
    for (int i = 0; i < 3; ++i) {
        // Python's round(): half to even, which nearbyint gives in the default rounding mode.
        bounds[i + 1] = bounds[i] + static_cast<int64_t>(std::nearbyint(weights[i] * static_cast<double>(num_documents)));
    }
    int64_t excess = bounds[3] - num_documents;
    for (int i = 1; i < 4; ++i) bounds[i] = std::clamp<int64_t>(bounds[i] - excess, 0, num_documents);
    return {DocumentRange{bounds[0], bounds[1]}, DocumentRange{bounds[1], bounds[2]}, DocumentRange{bounds[2], bounds[3]}};
}

uint64_t draw_below(std::mt19937_64 & rng, uint64_t m) {
    // Reject the 2^64 mod m smallest draws so that every residue is equally likely.
    const uint64_t threshold = (0 - m) % m;
    uint64_t       x;
    do {
        x = rng();
    } while (x < threshold);
    return x % m;
}

std::vector<int32_t> build_document_index(std::span<const int32_t> documents, int64_t num_epochs,
                                          std::mt19937_64 & rng, bool separate_final_epoch) {
    if (!separate_final_epoch || num_epochs == 1) {
        std::vector<int32_t> index;
        index.reserve(documents.size() * static_cast<size_t>(num_epochs));
        for (int64_t e = 0; e < num_epochs; ++e) index.insert(index.end(), documents.begin(), documents.end());
        shuffle_in_place(std::span<int32_t>(index), rng);
        return index;
    }
    std::vector<int32_t> first = build_document_index(documents, num_epochs - 1, rng, false);
    std::vector<int32_t> last  = build_document_index(documents, 1, rng, false);
    first.insert(first.end(), last.begin(), last.end());
    return first;
}

std::vector<int64_t> build_sample_index(std::span<const int32_t> sizes, std::span<const int32_t> document_index,
                                        int64_t seq_length, int64_t tokens_per_epoch, int64_t num_epochs) {
    LOOM_CHECK(seq_length >= 1, "seq_length must be positive, got " << seq_length, "raise --seq-length");
    const int64_t total       = num_epochs * tokens_per_epoch;
    const int64_t num_samples = total >= 1 ? (total - 1) / seq_length : 0;
    std::vector<int64_t> index(2 * static_cast<size_t>(num_samples + 1));
    const int64_t        positions = static_cast<int64_t>(document_index.size());
    int64_t              position = 0, offset = 0;
    index[0] = 0;
    index[1] = 0;
    for (int64_t k = 1; k <= num_samples; ++k) {
        int64_t remaining = seq_length + 1;
        while (remaining != 0) {
            LOOM_CHECK(position < positions, "sample index: ran past the document index at sample " << k,
                       "tokens_per_epoch does not match the documents' sizes");
            int32_t id = document_index[position];
            LOOM_CHECK(id >= 0 && static_cast<size_t>(id) < sizes.size(), "sample index: document id " << id
                                                                          << " outside the " << sizes.size() << " sequences",
                       "");
            int64_t length = sizes[id] - offset;
            remaining -= length;
            if (remaining <= 0) {
                offset += remaining + length - 1;   // the sample's last token, also the next sample's first
                remaining = 0;
            } else {
                ++position;
                offset = 0;
            }
        }
        index[2 * k]     = position;
        index[2 * k + 1] = offset;
    }
    return index;
}

std::vector<int64_t> build_shuffle_index(int64_t num_samples, int64_t total_size, std::mt19937_64 & rng) {
    std::vector<int64_t> index(static_cast<size_t>(total_size));
    std::iota(index.begin(), index.end(), int64_t{0});
    shuffle_in_place(std::span<int64_t>(index.data(), static_cast<size_t>(num_samples)), rng);
    if (num_samples < total_size) {
        shuffle_in_place(std::span<int64_t>(index.data() + num_samples, static_cast<size_t>(total_size - num_samples)), rng);
    }
    return index;
}

GptIndexPlan plan_gpt_sample_index(std::span<const int32_t> sizes, DocumentRange range, int64_t seq_length,
                                   int64_t num_samples) {
    LOOM_CHECK(seq_length >= 1, "seq_length must be positive, got " << seq_length, "raise --seq-length");
    LOOM_CHECK(range.begin >= 0 && range.begin <= range.end && range.end <= static_cast<int64_t>(sizes.size()),
               "document range [" << range.begin << ", " << range.end << ") outside the " << sizes.size() << " documents",
               "");
    LOOM_CHECK(range.end <= std::numeric_limits<int32_t>::max(), "more than 2^31 documents", "");
    GptIndexPlan plan;
    for (int64_t d = range.begin; d < range.end; ++d) plan.tokens_per_epoch += sizes[static_cast<size_t>(d)];
    const int64_t t = plan.tokens_per_epoch;
    if (num_samples > 0 && t > 0) {
        const int64_t requested = num_samples * seq_length + 1;
        for (int64_t tokens = t; tokens < requested; tokens += t) ++plan.num_epochs;
    }
    if (plan.num_epochs > 1) {
        plan.samples_before_final       = ((plan.num_epochs - 1) * t - 1) / seq_length;
        int64_t samples_from_final      = num_samples - plan.samples_before_final;
        int64_t samples_per_epoch       = (t - 1) / seq_length;
        plan.separate_final_epoch       = samples_from_final < static_cast<int64_t>(0.80 * static_cast<double>(samples_per_epoch));
    }
    const int64_t tokens = plan.num_epochs * t;
    plan.total_samples   = tokens >= 1 ? (tokens - 1) / seq_length : 0;
    LOOM_CHECK(plan.total_samples > 0, "documents [" << range.begin << ", " << range.end << ") hold " << t
                                                     << " tokens, not one sample of seq_length + 1 = " << seq_length + 1,
               "lower --seq-length, give this split more documents with --split, or use a larger dataset");
    return plan;
}

GptSampleIndex build_gpt_sample_index(std::span<const int32_t> sizes, DocumentRange range, int64_t seq_length,
                                      int64_t num_samples, uint64_t seed) {
    const GptIndexPlan plan = plan_gpt_sample_index(sizes, range, seq_length, num_samples);
    GptSampleIndex     result;
    result.tokens_per_epoch     = plan.tokens_per_epoch;
    result.num_epochs           = plan.num_epochs;
    result.separate_final_epoch = plan.separate_final_epoch;
    std::vector<int32_t> documents(static_cast<size_t>(range.size()));
    std::iota(documents.begin(), documents.end(), static_cast<int32_t>(range.begin));

    std::mt19937_64 rng(seed);
    result.document_index = build_document_index(documents, result.num_epochs, rng, result.separate_final_epoch);
    result.sample_index   = build_sample_index(sizes, result.document_index, seq_length, plan.tokens_per_epoch,
                                               result.num_epochs);
    const int64_t total   = static_cast<int64_t>(result.sample_index.size() / 2) - 1;
    LOOM_CHECK(total == plan.total_samples, "sample index of " << total << " samples, planned " << plan.total_samples, "");
    result.shuffle_index = build_shuffle_index(result.separate_final_epoch ? plan.samples_before_final : total, total, rng);
    return result;
}

namespace {

// The indices of a complete cached set, checked against the plan and the documents (data/index_cache.h):
// shapes first, then every value, so that no sample can read outside the split.
GptSampleIndex load_gpt_sample_index(const IndexCacheEntry & entry, const GptIndexPlan & plan,
                                     std::span<const int32_t> sizes, DocumentRange range) {
    const char * hint = "delete the files of this set (the files sharing its hash prefix) and run again; Loom "
                        "rebuilds and rewrites them";
    entry.check_description();
    GptSampleIndex index;
    index.tokens_per_epoch     = plan.tokens_per_epoch;
    index.num_epochs           = plan.num_epochs;
    index.separate_final_epoch = plan.separate_final_epoch;

    const std::string    document_file = entry.path("document_index.npy");
    NpyArray<int32_t>    documents     = read_npy<int32_t>(document_file);
    const int64_t        positions     = plan.num_epochs * range.size();
    LOOM_CHECK(documents.shape == std::vector<int64_t>{positions},
               "'" << document_file << "' holds " << documents.values.size() << " document ids, and " << plan.num_epochs
                   << " epoch(s) of the documents [" << range.begin << ", " << range.end << ") are " << positions,
               hint);
    for (int32_t d : documents.values) {
        LOOM_CHECK(d >= range.begin && d < range.end, "'" << document_file << "' holds document id " << d << ", outside the split's ["
                                                          << range.begin << ", " << range.end << ")",
                   hint);
    }
    index.document_index = std::move(documents.values);

    const std::string sample_file = entry.path("sample_index.npy");
    NpyArray<int64_t> samples     = read_npy<int64_t>(sample_file);
    LOOM_CHECK((samples.shape == std::vector<int64_t>{plan.total_samples + 1, 2}),
               "'" << sample_file << "' holds " << samples.values.size() << " values, and the sample index of "
                   << plan.total_samples << " samples is (" << plan.total_samples + 1 << ", 2)",
               hint);
    for (int64_t k = 0; k <= plan.total_samples; ++k) {
        const int64_t p = samples.values[static_cast<size_t>(2 * k)], o = samples.values[static_cast<size_t>(2 * k + 1)];
        bool ok = p >= 0 && p < positions && o >= 0;
        if (ok) {
            const int32_t length = sizes[static_cast<size_t>(index.document_index[static_cast<size_t>(p)])];
            ok = o < length || o == 0;
        }
        if (ok && k > 0) {
            const int64_t p0 = samples.values[static_cast<size_t>(2 * k - 2)], o0 = samples.values[static_cast<size_t>(2 * k - 1)];
            ok = p > p0 || (p == p0 && o > o0);
        }
        LOOM_CHECK(ok, "'" << sample_file << "' entry " << k << " = (" << p << ", " << o
                           << ") is not a boundary inside the document index, after the one before",
                   hint);
    }
    index.sample_index = std::move(samples.values);

    const std::string shuffle_file = entry.path("shuffle_index.npy");
    NpyArray<int64_t> shuffle      = read_npy<int64_t>(shuffle_file);
    LOOM_CHECK(shuffle.shape == std::vector<int64_t>{plan.total_samples},
               "'" << shuffle_file << "' holds " << shuffle.values.size() << " values, and the split has "
                   << plan.total_samples << " samples",
               hint);
    std::vector<bool> seen(static_cast<size_t>(plan.total_samples), false);
    for (int64_t v : shuffle.values) {
        LOOM_CHECK(v >= 0 && v < plan.total_samples && !seen[static_cast<size_t>(v)],
                   "'" << shuffle_file << "' is not a permutation of the " << plan.total_samples << " samples (value " << v
                       << ")",
                   hint);
        seen[static_cast<size_t>(v)] = true;
    }
    index.shuffle_index = std::move(shuffle.values);
    return index;
}

}  // namespace

void GptDataset::load_or_build(std::span<const int32_t> sizes, int64_t num_samples, const IndexCacheOptions & cache) {
    const GptIndexPlan plan = plan_gpt_sample_index(sizes, range_, seq_length_, num_samples);
    // Everything the indices depend on (data/index_cache.h), in Megatron's key order where the keys are
    // Megatron's.
    nlohmann::ordered_json d;
    d["class"]            = "GPTDataset";
    d["dataset_path"]     = data_->prefix();
    d["num_samples"]      = num_samples > 0 ? nlohmann::ordered_json(num_samples) : nlohmann::ordered_json(nullptr);
    d["index_split"]      = name_;
    d["random_seed"]      = seed_;
    d["sequence_length"]  = seq_length_;
    d["document_range"]   = {range_.begin, range_.end};
    d["num_sequences"]    = data_->num_sequences();
    d["tokens_per_epoch"] = plan.tokens_per_epoch;
    // The indices are a function of the split's document lengths: another dataset written at the same prefix
    // with as many documents and tokens, but other lengths, is another set, not a stale hit.
    const std::span<const int32_t> lengths = sizes.subspan(static_cast<size_t>(range_.begin),
                                                           static_cast<size_t>(range_.end - range_.begin));
    char lengths_crc[9];
    std::snprintf(lengths_crc, sizeof lengths_crc, "%08x", crc32c(lengths.data(), lengths.size_bytes()));
    d["document_lengths_crc32c"] = lengths_crc;
    d["index_builder"]    = "loom-1: mt19937_64, Fisher-Yates from the back (src/data/gpt_dataset.h)";
    description_          = d.dump(4);

    static const std::string arrays[] = {"document_index.npy", "sample_index.npy", "shuffle_index.npy"};
    const IndexCacheEntry    entry(cache, description_, "GPTDataset", name_);
    if (entry.complete(arrays)) {
        index_             = load_gpt_sample_index(entry, plan, sizes, range_);
        loaded_from_cache_ = true;
        cache_note_        = " [indices loaded from " + cache.path + "]";
        return;
    }
    index_ = build_gpt_sample_index(sizes, range_, seq_length_, num_samples, seed_);
    if (!entry.start_writing(cache_note_)) return;
    const int64_t positions = static_cast<int64_t>(index_.document_index.size());
    const int64_t samples   = index_.num_samples();
    write_npy<int32_t>(entry.path(arrays[0]), index_.document_index, std::vector<int64_t>{positions});
    write_npy<int64_t>(entry.path(arrays[1]), index_.sample_index, std::vector<int64_t>{samples + 1, 2});
    write_npy<int64_t>(entry.path(arrays[2]), index_.shuffle_index, std::vector<int64_t>{samples});
    entry.write_description();
}

// ---------------------------------------------------------------------------------------------------

GptDataset::GptDataset(std::shared_ptr<const IndexedDataset> data, DocumentRange range, int64_t seq_length,
                       int64_t num_samples, uint64_t seed, int64_t vocab_size, std::string name,
                       const IndexCacheOptions & cache)
    : data_(std::move(data)), range_(range), seq_length_(seq_length), vocab_size_(vocab_size), seed_(seed),
      name_(std::move(name)) {
    LOOM_CHECK(seq_length >= 1, "--seq-length must be positive, got " << seq_length, "");
    LOOM_CHECK(range.size() > 0, "the " << name_ << " split of '" << data_->prefix() << "' has no documents (range ["
                                        << range.begin << ", " << range.end << ") of " << data_->num_sequences() << ")",
               "give the " << name_ << " split a larger weight in --split, or use a dataset with more documents");
    std::vector<int32_t> sizes = data_->sequence_lengths();
    try {
        load_or_build(sizes, num_samples, cache);
    } catch (const Error & e) {
        LOOM_THROW("the " << name_ << " split of '" << data_->prefix() << "': " << e.message(), e.hint());
    }
    // The token range, once at open: a bad token is found now, not when its sample is drawn hours in.
    const auto [lowest, highest] = data_->token_range();
    LOOM_CHECK(lowest >= 0, "'" << data_file_path(data_->prefix()) << "' holds token id " << lowest
                                << ", and token ids are >= 0",
               "the .idx's dtype code does not match the .bin, or the data is corrupt");
    if (vocab_size_ <= 0) {
        // Inferring the vocabulary trusts the largest id. One corrupt id far above the rest would silently
        // make the model that much wider; an end-of-document id at the top of the vocabulary is fine, as it
        // only ever ends a sequence.
        const IndexedDataset::TopTokenUse use = data_->top_token_use(highest);
        LOOM_CHECK(!(use.inner_sequence >= 0 && highest >= 2 * (use.next_below + 1)),
                   "'" << data_file_path(data_->prefix()) << "' holds token id " << highest << " (sequence "
                       << use.inner_sequence << ", token " << use.inner_offset << "), more than twice any other id (the "
                       << "next largest is " << use.next_below << "); taking the vocabulary from the data would make it "
                       << highest + 1,
                   "the data may be corrupt; if the id is real, give the vocabulary with --vocab-size");
        vocab_size_ = highest + 1;
    } else {
        LOOM_CHECK(highest < vocab_size_, "'" << data_file_path(data_->prefix()) << "' holds token id " << highest
                                              << ", outside the vocabulary of " << vocab_size_ << " (--vocab-size)",
                   "raise --vocab-size above the largest token id, or drop it to take the dataset's");
    }
}

std::string GptDataset::identity() const {
    std::ostringstream os;
    os << "Megatron dataset " << data_->prefix() << " (" << name_ << " split: documents [" << range_.begin << ", "
       << range_.end << ") of " << data_->num_sequences() << ", " << index_.tokens_per_epoch << " tokens/epoch, "
       << index_.num_epochs << " epoch" << (index_.num_epochs > 1 ? "s" : "") << ", " << num_samples()
       << " samples, vocab " << vocab_size_ << ", seed " << seed_ << ")";
    if (fim_) os << " with " << fim_->describe();
    return os.str();
}

void GptDataset::sample(int64_t index, std::span<int32_t> out) const {
    LOOM_CHECK(index >= 0 && index < num_samples(), "sample " << index << " outside [0, " << num_samples() << ")", "");
    sample_unshuffled(index_.shuffle_index[static_cast<size_t>(index)], out);
    if (fim_) fim_->apply(index, out);
}

void GptDataset::sample_unshuffled(int64_t index, std::span<int32_t> out) const {
    const int64_t total = static_cast<int64_t>(index_.sample_index.size() / 2) - 1;
    LOOM_CHECK(index >= 0 && index < total, "sample " << index << " outside [0, " << total << ")", "");
    LOOM_CHECK(static_cast<int64_t>(out.size()) == seq_length_ + 1,
               "a sample holds seq_length + 1 = " << seq_length_ + 1 << " tokens, the buffer " << out.size(), "");
    const int64_t * e  = index_.sample_index.data() + 2 * index;
    int64_t         p0 = e[0], o0 = e[1], p1 = e[2], o1 = e[3];
    size_t          at = 0;
    for (int64_t p = p0; p <= p1; ++p) {
        int32_t id     = index_.document_index[static_cast<size_t>(p)];
        int64_t offset = p == p0 ? o0 : 0;
        int64_t end    = p == p1 ? o1 + 1 : data_->sequence_length(id);
        int64_t n      = end - offset;
        if (n <= 0) continue;
        LOOM_CHECK(at + static_cast<size_t>(n) <= out.size(), "sample " << index << " of '" << data_->prefix()
                                                                        << "' runs past seq_length + 1 tokens", "");
        data_->read(id, offset, out.subspan(at, static_cast<size_t>(n)));
        at += static_cast<size_t>(n);
    }
    LOOM_CHECK(at == out.size(), "sample " << index << " of '" << data_->prefix() << "' gathered " << at
                                           << " tokens, expected " << out.size(),
               "");
    for (int32_t t : out) {
        LOOM_CHECK(t >= 0 && t < vocab_size_, "'" << data_file_path(data_->prefix()) << "' holds token id " << t
                                                  << " (in sample " << index << "), outside the vocabulary of "
                                                  << vocab_size_,
                   "raise --vocab-size above the largest token id, or drop it to take the dataset's");
    }
}

std::unique_ptr<GptDataset> open_gpt_dataset(const std::string & prefix, const std::string & split, Split which,
                                             int64_t seq_length, int64_t num_samples, uint64_t seed,
                                             int64_t vocab_size, const IndexCacheOptions & cache) {
    auto data = std::make_shared<const IndexedDataset>(prefix);
    std::array<DocumentRange, 3> ranges = split_documents(split, data->num_sequences());
    return std::make_unique<GptDataset>(data, ranges[static_cast<int>(which)], seq_length, num_samples, seed,
                                        vocab_size, split_name(which), cache);
}

}  // namespace loom::data
