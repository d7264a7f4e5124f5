#include "train/data_source.h"

#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/fim.h"
#include "data/gpt_dataset.h"
#include "data/llmc_shard.h"

#include <cmath>
#include <cstring>

namespace loom::train {

namespace {

class LoaderSource : public BatchSource {
public:
    LoaderSource(std::unique_ptr<data::TokenDataset> dataset, int64_t mbs, int64_t dp_rank, int64_t dp_size, Device & device)
        : dataset_(std::move(dataset)), loader_(*dataset_, mbs, dp_rank, dp_size, device) {}

    model::MicroBatch next() override {
        data::Batch b = loader_.next();
        model::MicroBatch batch;
        batch.tokens     = b.tokens;
        batch.labels     = b.labels;
        batch.loss_mask  = b.loss_mask;
        batch.sample_ids = b.sample_ids;
        return batch;
    }
    std::string describe() const override { return dataset_->describe(); }
    std::string identity() const override { return dataset_->identity(); }
    void        set_consumed_samples(int64_t consumed) override { loader_.set_consumed_samples(consumed); }

private:
    std::unique_ptr<data::TokenDataset> dataset_;
    data::Loader                        loader_;
};

// This rank's chunks r and 2 CP - 1 - r of each sequence (model::ContextParallel), in position order.
class ContextParallelSource : public BatchSource {
public:
    ContextParallelSource(std::unique_ptr<BatchSource> source, int rank, int size, int64_t mtp_depths)
        : source_(std::move(source)), rank_(rank), size_(size), mtp_depths_(mtp_depths) {}

    model::MicroBatch next() override {
        model::MicroBatch whole = model::add_mtp_targets(source_->next(), mtp_depths_);
        const int64_t     b = whole.tokens.size(0), s = whole.tokens.size(1), chunk = s / (2 * size_);
        LOOM_CHECK(s % (2 * size_) == 0, "a sequence of " << s << " tokens for --context-parallel-size " << size_,
                   "the sequence length must be a multiple of 2 x --context-parallel-size");
        model::MicroBatch mine;
        mine.tokens     = part(whole.tokens, chunk);
        mine.labels     = part(whole.labels, chunk);
        mine.loss_mask  = part(whole.loss_mask, chunk);
        mine.sample_ids = whole.sample_ids;
        const float * mask = whole.loss_mask.data<float>();
        mine.sequence_tokens = 0;
        for (int64_t i = 0; i < b * s; ++i) mine.sequence_tokens += mask[i];
        if (mtp_depths_ > 0) {   // (D, b, s) planes as (D b, s) rows
            auto planes = [&](const Tensor & t) {
                return part(t.view({mtp_depths_ * b, s}), chunk).view({mtp_depths_, b, 2 * chunk});
            };
            mine.mtp_tokens          = planes(whole.mtp_tokens);
            mine.mtp_labels          = planes(whole.mtp_labels);
            mine.mtp_mask            = planes(whole.mtp_mask);
            mine.mtp_sequence_tokens = whole.mtp_sequence_tokens;
        }
        return mine;
    }
    std::string describe() const override { return source_->describe(); }
    std::string identity() const override { return source_->identity(); }
    void        set_consumed_samples(int64_t consumed) override { source_->set_consumed_samples(consumed); }

private:
    // (b, s) -> (b, 2 chunk): this rank's two chunks of each row, in a tensor of the same kind of memory.
    Tensor part(const Tensor & whole, int64_t chunk) const {
        const int64_t b = whole.size(0), s = whole.size(1);
        const size_t  size = dtype_size(whole.dtype()), run = static_cast<size_t>(chunk) * size;
        Tensor        out  = Tensor::empty({b, 2 * chunk}, whole.dtype(), whole.device(), {whole.memory_kind()});
        const char *  from = static_cast<const char *>(whole.data_ptr());
        char *        to   = static_cast<char *>(out.data_ptr());
        for (int64_t bi = 0; bi < b; ++bi) {
            const char * row = from + static_cast<size_t>(bi * s) * size;
            std::memcpy(to + static_cast<size_t>(bi * 2) * run, row + static_cast<size_t>(rank_) * run, run);
            std::memcpy(to + static_cast<size_t>(bi * 2 + 1) * run, row + static_cast<size_t>(2 * size_ - 1 - rank_) * run, run);
        }
        return out;
    }

    std::unique_ptr<BatchSource> source_;
    int                          rank_, size_;
    int64_t                      mtp_depths_;
};

// --fim-data's transform (validated by validate_fim), over its own copy of the tokenizer.
std::shared_ptr<const data::FimTransform> fim_transform(const TrainOptions & o) {
    data::FimOptions fim;
    fim.rate     = o.fim_rate;
    fim.spm_rate = o.fim_spm_rate;
    fim.split_sample = o.fim_split_sample;
    if (!std::isnan(o.fim_fragment_rate)) fim.fragment_rate = o.fim_fragment_rate;
    if (!o.fim_no_prefix.empty()) fim.no_prefix = o.fim_no_prefix;
    fim.prefix_token = o.fim_prefix_token;
    fim.middle_token = o.fim_middle_token;
    fim.suffix_token = o.fim_suffix_token;
    fim.pad_token    = o.fim_pad_token;
    fim.eod_token    = o.fim_eod_token;
    return std::make_shared<const data::FimTransform>(std::make_shared<data::Gpt2BpeTokenizer>(o.vocab_file, o.merge_file),
                                                      std::move(fim), o.model.seed);
}

}  // namespace

std::unique_ptr<BatchSource> context_parallel_part(std::unique_ptr<BatchSource> source, int rank, int size,
                                                   int64_t mtp_depths) {
    if (size <= 1) return source;
    return std::make_unique<ContextParallelSource>(std::move(source), rank, size, mtp_depths);
}

std::unique_ptr<BatchSource> make_batch_source(TrainOptions & options, Device & device, bool vocab_given,
                                               int64_t dp_rank, int64_t dp_size, data::Split split, int64_t num_samples) {
    if (num_samples == 0) {
        num_samples = options.train_samples_total();
    }
    int64_t seq = options.model.seq_length;
    std::unique_ptr<data::TokenDataset> dataset;
    if (!options.data_path.empty() || options.per_split_data()) {
        // The split's range of --split of every dataset of the blend (or, per split, its blend of whole
        // datasets), enough samples for every iteration; the vocabulary is the datasets' largest token + 1
        // unless --vocab-size was given (then every token must fit it). Data-parallel rank 0 writes the
        // --data-cache-path indices; the others load them, or build their own on a miss.
        const bool        per_split = options.per_split_data();
        const char *      flags[]   = {"--train-data-path", "--valid-data-path", "--test-data-path"};
        const std::vector<std::string> * lists[] = {&options.train_data_path, &options.valid_data_path,
                                                    &options.test_data_path};
        const std::string flag  = per_split ? flags[static_cast<int>(split)] : "--data-path";
        const auto &      words = per_split ? *lists[static_cast<int>(split)] : options.data_path;
        LOOM_CHECK(!words.empty(), "the " << data::split_name(split) << " split has no data: " << flag << " was not given",
                   "give " << flag << " with the other per-split paths");
        data::GptDatasetOptions gpt;
        gpt.seq_length                = seq;
        gpt.seed                      = options.model.seed;
        gpt.vocab_size                = vocab_given ? options.model.vocab_size : 0;
        gpt.mid_level_dataset_surplus = options.mid_level_dataset_surplus;
        gpt.cache                     = data::IndexCacheOptions{options.data_cache_path, dp_rank == 0};
        if (options.fim_data) gpt.fim = fim_transform(options);
        dataset = data::open_blended_split(data::parse_blend(words, flag),
                                           per_split ? std::nullopt : std::optional<std::string>(options.split), split,
                                           num_samples, gpt);
    } else if (!options.llmc_shard.empty()) {
        dataset = std::make_unique<data::LlmcShardDataset>(options.llmc_shard, seq,
                                                           vocab_given ? options.model.vocab_size : 0);
    } else if (!options.text_file.empty()) {
        dataset = std::make_unique<data::TextFileDataset>(options.text_file, seq);
    } else {
        const int64_t first = split == data::Split::train ? 0 : int64_t{1} << (split == data::Split::valid ? 41 : 42);
        dataset = std::make_unique<data::SyntheticDataset>(options.model.vocab_size, seq, options.model.seed,
                                                           int64_t{1} << 40, first);
    }
    if (!vocab_given) {
        options.model.vocab_size = dataset->vocab_size();
    }
    LOOM_CHECK(options.model.vocab_size >= dataset->vocab_size(),
               "--vocab-size " << options.model.vocab_size << " is smaller than the dataset's vocabulary "
                               << dataset->vocab_size() << " (" << dataset->describe() << ")",
               "drop --vocab-size to take the dataset's");
    return loader_source(std::move(dataset), options.micro_batch_size, dp_rank, dp_size, device);
}

std::unique_ptr<BatchSource> loader_source(std::unique_ptr<data::TokenDataset> dataset, int64_t micro_batch_size,
                                           int64_t dp_rank, int64_t dp_size, Device & device) {
    return std::make_unique<LoaderSource>(std::move(dataset), micro_batch_size, dp_rank, dp_size, device);
}

}  // namespace loom::train
