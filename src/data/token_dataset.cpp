#include "data/token_dataset.h"

#include "core/error.h"
#include "core/input_file.h"

#include <algorithm>
#include <fstream>
#include <iterator>
#include <random>
#include <sstream>

namespace loom::data {

namespace {

// SplitMix64: a stateless hash of (seed, index) into a stream start.
uint64_t mix(uint64_t x) {
    x += 0x9e3779b97f4a7c15ull;
    x = (x ^ (x >> 30)) * 0xbf58476d1ce4e5b9ull;
    x = (x ^ (x >> 27)) * 0x94d049bb133111ebull;
    return x ^ (x >> 31);
}

}  // namespace

SyntheticDataset::SyntheticDataset(int64_t vocab_size, int64_t seq_length, uint64_t seed, int64_t num_samples,
                                   int64_t first_sample)
    : vocab_(vocab_size), seq_length_(seq_length), num_samples_(num_samples), first_sample_(first_sample), seed_(seed) {
    LOOM_CHECK(vocab_size >= kSuccessors, "the synthetic dataset needs a vocabulary of at least " << kSuccessors
                                                                                                 << ", got " << vocab_size,
               "raise --vocab-size");
    std::mt19937_64 rng(mix(seed));
    successors_.resize(vocab_ * kSuccessors);
    for (int64_t t = 0; t < vocab_; ++t) {
        for (int k = 0; k < kSuccessors; ++k) {
            successors_[t * kSuccessors + k] = static_cast<int32_t>(rng() % static_cast<uint64_t>(vocab_));
        }
    }
}

std::string SyntheticDataset::describe() const {
    std::ostringstream os;
    os << "synthetic Markov chain (vocab " << vocab_ << ", seed " << seed_ << ", entropy floor " << kEntropyNats
       << " nats/token)";
    return os.str();
}

void SyntheticDataset::sample(int64_t index, std::span<int32_t> out) const {
    uint64_t state = mix(seed_ ^ mix(static_cast<uint64_t>(index + first_sample_)));
    auto     next  = [&] { return state = mix(state); };
    int32_t  token = static_cast<int32_t>(next() % static_cast<uint64_t>(vocab_));
    for (size_t i = 0; i < out.size(); ++i) {
        out[i]    = token;
        uint64_t u = next() % 100;   // 55 / 25 / 15 / 5
        int      k = u < 55 ? 0 : u < 80 ? 1 : u < 95 ? 2 : 3;
        token      = successors_[token * kSuccessors + k];
    }
}

TextFileDataset::TextFileDataset(const std::string & path, int64_t seq_length) : path_(path), seq_length_(seq_length) {
    const std::string text = read_input_file(path, "--text-file");
    bytes_.assign(text.begin(), text.end());
    LOOM_CHECK(static_cast<int64_t>(bytes_.size()) >= seq_length + 1,
               "--text-file '" << path << "' holds " << bytes_.size() << " bytes, fewer than one sample of --seq-length "
                               << seq_length << " + 1",
               "use a longer file or a shorter --seq-length");
    num_samples_ = (static_cast<int64_t>(bytes_.size()) - 1) / seq_length;
}

std::string TextFileDataset::describe() const {
    return "text file " + path_ + " (" + std::to_string(bytes_.size()) + " bytes, byte tokens)";
}

void TextFileDataset::sample(int64_t index, std::span<int32_t> out) const {
    int64_t start = index * seq_length_;
    for (size_t i = 0; i < out.size(); ++i) out[i] = bytes_[start + static_cast<int64_t>(i)];
}

Loader::Loader(const TokenDataset & dataset, int64_t micro_batch_size, int64_t dp_rank, int64_t dp_size, Device & device,
               int64_t consumed_samples)
    : dataset_(dataset), micro_batch_size_(micro_batch_size), dp_rank_(dp_rank), dp_size_(dp_size), device_(device),
      consumed_(consumed_samples) {
    LOOM_CHECK(dp_rank >= 0 && dp_rank < dp_size, "data-parallel rank " << dp_rank << " outside a group of " << dp_size, "");
    LOOM_CHECK(micro_batch_size >= 1, "--micro-batch-size must be positive, got " << micro_batch_size, "");
    LOOM_CHECK(dataset.num_samples() >= 1, "the dataset " << dataset.describe() << " holds no sample",
               "use more data or a shorter --seq-length");
    set_consumed_samples(consumed_samples);
}

void Loader::set_consumed_samples(int64_t consumed) {
    LOOM_CHECK(consumed >= 0, "consumed samples must not be negative, got " << consumed, "");
    consumed_ = consumed;
}

int64_t Loader::sample_index(int64_t j) const {
    return (consumed_ + dp_rank_ * micro_batch_size_ + j) % dataset_.num_samples();
}

Batch Loader::next_microbatch() {
    int64_t b = micro_batch_size_, s = dataset_.seq_length();
    Batch   batch;
    const MemoryKind host = host_filled_kind(device_);   // the model copies it to the device where that differs
    batch.tokens    = Tensor::empty({b, s}, DType::i32, device_, {host, "data"});
    batch.labels    = Tensor::empty({b, s}, DType::i32, device_, {host, "data"});
    batch.loss_mask = Tensor::empty({b, s}, DType::f32, device_, {host, "data"});
    batch.sample_ids = Tensor::empty({b}, DType::i64, device_, {MemoryKind::pinned_host, "data"});
    std::vector<int32_t> window(s + 1);
    int32_t * tokens = batch.tokens.data<int32_t>();
    int32_t * labels = batch.labels.data<int32_t>();
    float *   mask   = batch.loss_mask.data<float>();
    for (int64_t j = 0; j < b; ++j) {
        batch.sample_ids.data<int64_t>()[j] = consumed_ + dp_rank_ * micro_batch_size_ + j;
        dataset_.sample(sample_index(j), window);
        std::copy(window.begin(), window.end() - 1, tokens + j * s);
        std::copy(window.begin() + 1, window.end(), labels + j * s);
        std::fill(mask + j * s, mask + (j + 1) * s, 1.0f);
    }
    consumed_ += b * dp_size_;
    return batch;
}

}  // namespace loom::data
