// Token datasets and the loader that turns them into micro-batches.
//
// A TokenDataset yields samples of seq_length + 1 tokens: the first seq_length are the inputs, the last
// seq_length the labels (inputs shifted by one). The sources behind this one interface:
//
//   GptDataset        (gpt_dataset.h)   --data-path PREFIX: a split of a Megatron .bin/.idx, sampled
//                                       across document boundaries and shuffled as Megatron does
//   BlendedDataset    (blended_dataset.h) --data-path 0.3 A 0.7 B: Megatron's weighted blend of them
//   LlmcShardDataset  (llmc_shard.h)    an llm.c token shard, consecutive windows
//   TextFileDataset   (here)            a plain text file, byte tokens
//   SyntheticDataset  (here)            learnable synthetic tokens, the default when no data is given
//
// SyntheticDataset (the default when no data is given) is learnable: a fixed random sparse Markov chain
// over the vocabulary. Every token has 4 successors, drawn once from the seed, taken with probabilities
// 0.55, 0.25, 0.15, 0.05. A model that learns the chain reaches the chain's entropy,
//   H = -(0.55 ln 0.55 + 0.25 ln 0.25 + 0.15 ln 0.15 + 0.05 ln 0.05) = 1.1098 nats per token
// (a little less where two successors of a token coincide),
// against ln V (6.24 for V = 512) for a model that knows nothing; a model that only learns the bigram
// counts already gets there, so a small transformer's loss falls well below ln V within a few hundred
// steps. Each sample starts from a uniformly drawn token (an input, never a label), so H is the floor of
// the loss at every position. Sample i is generated from (seed, i) alone, so any rank can produce any
// sample.
//
// TextFileDataset tokenises a file by bytes (vocabulary 256) and cuts it into consecutive windows of
// seq_length + 1 bytes with stride seq_length.
//
// Loader: Megatron's pretraining sampler (MegatronPretrainingSampler). Iteration k's global batch of
// gbs = mbs x num_microbatches x dp samples is [consumed, consumed + gbs); it is served as
// num_microbatches micro-batches of mbs x dp consecutive samples, of which data-parallel rank r takes the
// r-th contiguous mbs. Each next_microbatch() advances consumed_samples by mbs x dp, so after one
// iteration it has advanced by the global batch, and a loader built with (or set to) Megatron's
// consumed_train_samples resumes where the run stopped. Sample indices wrap around the dataset (epochs).
// Worked example, mbs 2, dp 2, num_microbatches 2 (gbs 8), consumed 0:
//   micro-batch 0: rank 0 samples 0 1, rank 1 samples 2 3;  micro-batch 1: rank 0 4 5, rank 1 6 7
//   each rank's consumed_samples() is 8 after its second call.
// Batch: tokens (b, s) = sample[0, s), labels (b, s) = sample[1, s + 1), loss_mask (b, s) all ones.
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
    // What the dataset is, the same on every rank that reads the same data (describe() less where this
    // rank's indices came from): what the ranks of a job must agree on.
    virtual std::string identity() const { return describe(); }
    // Writes the seq_length + 1 tokens of sample `index` (0 <= index < num_samples()).
    virtual void sample(int64_t index, std::span<int32_t> out) const = 0;
};

class SyntheticDataset : public TokenDataset {
public:
    // `first_sample` offsets the sample stream: the validation and test splits draw other samples of the
    // same chain (2^41 and 2^42 on).
    SyntheticDataset(int64_t vocab_size, int64_t seq_length, uint64_t seed, int64_t num_samples = int64_t{1} << 40,
                     int64_t first_sample = 0);

    int64_t     num_samples() const override { return num_samples_; }
    int64_t     vocab_size() const override { return vocab_; }
    int64_t     seq_length() const override { return seq_length_; }
    std::string describe() const override;
    void        sample(int64_t index, std::span<int32_t> out) const override;

    static constexpr int    kSuccessors = 4;
    static constexpr double kEntropyNats = 1.1098;   // of the successor distribution below

private:
    int64_t              vocab_, seq_length_, num_samples_, first_sample_;
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
    Tensor sample_ids;  // (b) int64: each row's place in the sample stream (consumed + r mbs + j, before
                        // wrapping around the dataset), the same in every layout
};

class Loader {
public:
    Loader(const TokenDataset & dataset, int64_t micro_batch_size, int64_t dp_rank, int64_t dp_size, Device & device,
           int64_t consumed_samples = 0);

    // The next micro-batch of this rank; after num_microbatches calls, the next global batch begins.
    Batch   next_microbatch();
    Batch   next() { return next_microbatch(); }
    // Samples of all ranks consumed before the next micro-batch (Megatron's consumed_train_samples).
    int64_t consumed_samples() const { return consumed_; }
    // Resume: the next micro-batch starts at `consumed` (a multiple of the global batch for a resume at an
    // iteration boundary).
    void    set_consumed_samples(int64_t consumed);
    // The dataset sample that row j of this rank's next micro-batch holds.
    int64_t sample_index(int64_t j) const;

private:
    const TokenDataset & dataset_;
    int64_t              micro_batch_size_, dp_rank_, dp_size_;
    Device &             device_;
    int64_t              consumed_;   // samples of all ranks before the next micro-batch
};

}  // namespace loom::data
