#include "train/data_source.h"

#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data/llmc_shard.h"

namespace loom::train {

namespace {

class LoaderSource : public BatchSource {
public:
    LoaderSource(std::unique_ptr<data::TokenDataset> dataset, int64_t mbs, int64_t dp_rank, int64_t dp_size, Device & device)
        : dataset_(std::move(dataset)), loader_(*dataset_, mbs, dp_rank, dp_size, device) {}

    model::MicroBatch next() override {
        data::Batch b = loader_.next();
        return model::MicroBatch{b.tokens, b.labels, b.loss_mask, b.sample_ids};
    }
    std::string describe() const override { return dataset_->describe(); }
    std::string identity() const override { return dataset_->identity(); }
    void        set_consumed_samples(int64_t consumed) override { loader_.set_consumed_samples(consumed); }

private:
    std::unique_ptr<data::TokenDataset> dataset_;
    data::Loader                        loader_;
};

}  // namespace

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
    return std::make_unique<LoaderSource>(std::move(dataset), options.micro_batch_size, dp_rank, dp_size, device);
}

}  // namespace loom::train
