// Token datasets and the loader that turns them into micro-batches.
//
// A TokenDataset yields samples of seq_length + 1 tokens: the first seq_length are the inputs, the last
// seq_length the labels (inputs shifted by one).
//
// SyntheticDataset (the default when no data is given) is learnable: a fixed random sparse Markov chain
// over the vocabulary. Every token has 4 successors, drawn once from the seed, taken with probabilities
// 0.55, 0.25, 0.15, 0.05. A model that learns the chain reaches the chain's entropy,
//   H = -(0.55 ln 0.55 + 0.25 ln 0.25 + 0.15 ln 0.15 + 0.05 ln 0.05) = 1.1098 nats per token
// (a little less where two successors of a token coincide),
// against ln V (6.24 for V = 512) for a model that knows nothing. Sample i is generated from (seed, i)
// alone, so any rank can produce any sample.
//
// TextFileDataset tokenises a file by bytes (vocabulary 256) and cuts it into consecutive windows of
// seq_length + 1 bytes with stride seq_length.
//
// Loader: Megatron's pretraining sampler. Iteration k's global batch is samples
// [consumed, consumed + global_batch); it is served as num_microbatches micro-batches of mbs x dp
// samples, of which data-parallel rank r takes the r-th contiguous mbs. Sample indices wrap around the
// dataset (epochs).
#pragma once

#include "core/device.h"
#include "core/tensor.h"

#include <cstdint>
#include <span>
#include <string>
#include <vector>

namespace loom::data {

class TokenDataset {
public:
    virtual ~TokenDataset() = default;
    virtual int64_t     num_samples() const = 0;
    virtual int64_t     vocab_size() const = 0;
    virtual int64_t     seq_length() const = 0;
    virtual std::string describe() const = 0;
    // Writes the seq_length + 1 tokens of sample `index` (0 <= index < num_samples()).
    virtual void sample(int64_t index, std::span<int32_t> out) const = 0;
};

class SyntheticDataset : public TokenDataset {
public:
    SyntheticDataset(int64_t vocab_size, int64_t seq_length, uint64_t seed, int64_t num_samples = int64_t{1} << 40);

    int64_t     num_samples() const override { return num_samples_; }
    int64_t     vocab_size() const override { return vocab_; }
    int64_t     seq_length() const override { return seq_length_; }
    std::string describe() const override;
    void        sample(int64_t index, std::span<int32_t> out) const override;

    static constexpr int    kSuccessors = 4;
    static constexpr double kEntropyNats = 1.1098;   // of the successor distribution below

private:
    int64_t              vocab_, seq_length_, num_samples_;
    uint64_t             seed_;
    std::vector<int32_t> successors_;   // (V, 4)
};

class TextFileDataset : public TokenDataset {
public:
    TextFileDataset(const std::string & path, int64_t seq_length);

    int64_t     num_samples() const override { return num_samples_; }
    int64_t     vocab_size() const override { return 256; }
    int64_t     seq_length() const override { return seq_length_; }
    std::string describe() const override;
    void        sample(int64_t index, std::span<int32_t> out) const override;

private:
    std::string          path_;
    std::vector<uint8_t> bytes_;
    int64_t              seq_length_, num_samples_;
};

struct Batch {
    Tensor tokens;      // (b, s) int32
    Tensor labels;      // (b, s) int32
    Tensor loss_mask;   // (b, s) f32
};

class Loader {
public:
    Loader(const TokenDataset & dataset, int64_t micro_batch_size, int64_t dp_rank, int64_t dp_size, Device & device,
           int64_t consumed_samples = 0);

    // The next micro-batch of this rank; after num_microbatches calls, the next global batch begins.
    Batch   next();
    int64_t consumed_samples() const { return consumed_; }

private:
    const TokenDataset & dataset_;
    int64_t              micro_batch_size_, dp_rank_, dp_size_;
    Device &             device_;
    int64_t              consumed_;   // samples of all ranks before the next micro-batch
};

}  // namespace loom::data
