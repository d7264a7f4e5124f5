// Data sources (Megatron's --data-path blends, per-split blends, --mock-data, and Loom's own text and
// llm.c sources) and the tokenizer flags; the tokenizer's files are read in resolve_files.cpp.
#include "core/error.h"
#include "data/blended_dataset.h"
#include "train/flag_values.h"
#include "train/options.h"

#include <cmath>
#include <filesystem>

namespace loom::train {

namespace {

using json = nlohmann::json;
using O    = TrainOptions;

constexpr const char * kData = "data and dataloader";

// The per-split blends are saved only when given (checkpoints of --data-path runs have no such keys).
json per_split(const O & o, const std::vector<std::string> & paths) {
    return o.per_split_data() ? json(paths) : json(json::value_t::discarded);
}

// nargs='*' lists (kList); given twice, the last list wins (argparse's rule).
const Flag<TrainOptions> kDataFlags[] = {
    {"--data-path", kData, &O::data_path,
     "Megatron dataset prefix(es) PREFIX [PREFIX ...] (PREFIX.bin / PREFIX.idx; several are weighted by "
     "their sizes), or weight/prefix pairs W1 PREFIX1 W2 PREFIX2 ..., split by --split", kList,
     {"data_path", [](const O & o) -> json { return o.data_path; }}},   // a list, as Megatron's nargs='*'
    {"--train-data-path", kData, &O::train_data_path,
     "the training blend, as --data-path, each dataset whole (instead of --data-path and --split)", kList,
     {"train_data_path", [](const O & o) { return per_split(o, o.train_data_path); }}},
    {"--valid-data-path", kData, &O::valid_data_path, "the validation blend, as --train-data-path", kList,
     {"valid_data_path", [](const O & o) { return per_split(o, o.valid_data_path); }}},
    {"--test-data-path", kData, &O::test_data_path, "the test blend, as --train-data-path", kList,
     {"test_data_path", [](const O & o) { return per_split(o, o.test_data_path); }}},
    {"--data-cache-path", kData, &O::data_cache_path,
     "folder to cache the datasets' document, sample and shuffle indices in (.npy), and load them from"},
    {"--mid-level-dataset-surplus", kData, &O::mid_level_dataset_surplus,
     "the share of extra samples each dataset of a weighted blend is built with", kShowDefault},
    {"--tokenizer-type", "tokenizer", &O::tokenizer_type,
     "GPT2BPETokenizer (the vocabulary of --vocab-file and --merge-file) or NullTokenizer "
     "(--vocab-size ids); without it the vocabulary is the data's largest id + 1"},
    {"--vocab-file", "tokenizer", &O::vocab_file, "GPT-2 BPE vocabulary (vocab.json) for GPT2BPETokenizer"},
    {"--merge-file", "tokenizer", &O::merge_file, "GPT-2 BPE merges (merges.txt) for GPT2BPETokenizer"},
    {"--mock-data", kData, &O::mock_data,
     "train on Loom's synthetic dataset (a random sparse Markov chain over --vocab-size tokens, "
     "default 512, with a known entropy floor)"},
    {"--split", kData, &O::split, "train,valid,test weights over documents", kShowDefault},
    {"--fim-data", kData, &O::fim_data,
     "fill-in-the-middle samples (Megatron's GPTFIMDataset; docs/fim.md): each document of a sample cut at two "
     "random characters and reordered prefix-suffix-middle with sentinel tokens; needs --data-path and the GPT-2 "
     "tokenizer"},
    {"--fim-rate", kData, &O::fim_rate, "with --fim-data, the probability that a document is transformed", kShowDefault},
    {"--fim-spm-rate", kData, &O::fim_spm_rate,
     "with --fim-data, the probability that a transformed document takes the suffix-prefix-middle order", kShowDefault},
    {"--fim-split-sample", kData, &O::fim_split_sample,
     "with --fim-data, a token at which each document is cut into fragments transformed on their own"},
    {"--fim-fragment-rate", kData, &O::fim_fragment_rate,
     "with --fim-split-sample, the probability that a fragment is transformed"},
    {"--fim-no-prefix", kData, &O::fim_no_prefix, "with --fim-data, text that keeps a document starting with it as it is"},
    {"--fim-prefix-token", kData, &O::fim_prefix_token, "the FIM prefix sentinel, as the vocabulary spells it", kShowDefault},
    {"--fim-middle-token", kData, &O::fim_middle_token, "the FIM middle sentinel", kShowDefault},
    {"--fim-suffix-token", kData, &O::fim_suffix_token, "the FIM suffix sentinel", kShowDefault},
    {"--fim-pad-token", kData, &O::fim_pad_token, "the token a FIM sample is padded with", kShowDefault},
    {"--fim-eod-token", kData, &O::fim_eod_token, "the end-of-document token FIM cuts samples at", kShowDefault},
    {"--text-file", kLoomGroup, &O::text_file, "a plain text file, tokenised by bytes"},
    {"--llmc-shard", kLoomGroup, &O::llmc_shard, "an llm.c token shard"},
};

// Megatron's asserts (validate_args) in its words, then what Loom's FIM needs (data/fim.h).
void validate_fim(const Given & given, const TrainOptions & o) {
    LOOM_CHECK(!o.mock_data, "Mock dataset is not supported with FIM dataset.",
               "FIM rewrites text: give --data-path with the tokenizer's --vocab-file and --merge-file");
    LOOM_CHECK(o.fim_rate != 0, "--fim-rate should be specified.", "Megatron refuses a rate of 0; drop --fim-data instead");
    LOOM_CHECK(o.fim_spm_rate != 0, "--fim-spm-rate should be specified.",
               "Megatron refuses an SPM rate of 0 (every transformed document in PSM order)");
    auto probability = [](double p, const char * flag) {
        LOOM_CHECK(std::isfinite(p) && p >= 0 && p <= 1, flag << " must be a probability in [0, 1], got " << p, "");
    };
    probability(o.fim_rate, "--fim-rate");
    probability(o.fim_spm_rate, "--fim-spm-rate");
    if (given("--fim-fragment-rate")) probability(o.fim_fragment_rate, "--fim-fragment-rate");
    LOOM_CHECK(o.fim_split_sample.empty() || given("--fim-fragment-rate"), "--fim-split-sample needs --fim-fragment-rate",
               "the probability that each fragment between the split tokens is transformed");
    LOOM_CHECK(!given("--fim-no-prefix") || !o.fim_no_prefix.empty(),
               "--fim-no-prefix '' would keep every document as it is", "give the text that marks documents to keep");
    LOOM_CHECK(o.text_file.empty() && o.llmc_shard.empty(),
               "--fim-data reads Megatron datasets, not --text-file or --llmc-shard", "give --data-path");
    LOOM_CHECK((o.tokenizer_type.empty() || o.tokenizer_type == "GPT2BPETokenizer") && !o.vocab_file.empty() &&
                   !o.merge_file.empty(),
               "--fim-data needs the GPT-2 BPE tokenizer (--vocab-file and --merge-file)",
               "FIM decodes each document to text and encodes its pieces again with the dataset's tokenizer");
}

}  // namespace

std::span<const Flag<TrainOptions>> data_flags() { return kDataFlags; }

void validate_data(const Given & given, const TrainOptions & o, bool data_optional) {
    int sources = !o.data_path.empty() + o.per_split_data() + !o.text_file.empty() + !o.llmc_shard.empty() + o.mock_data;
    LOOM_CHECK(sources <= 1,
               "--data-path, --train-data-path (with --valid-data-path, --test-data-path), --mock-data, --text-file and "
               "--llmc-shard are exclusive (" << sources << " given)",
               "train on one data source at a time");
    // The blends parse as Megatron's get_blend_from_list (errors name the flag and the word), before
    // anything is opened; --data-cache-path is a folder or can become one.
    if (!o.data_path.empty()) data::parse_blend(o.data_path, "--data-path");
    if (!o.train_data_path.empty()) data::parse_blend(o.train_data_path, "--train-data-path");
    if (!o.valid_data_path.empty()) data::parse_blend(o.valid_data_path, "--valid-data-path");
    if (!o.test_data_path.empty()) data::parse_blend(o.test_data_path, "--test-data-path");
    LOOM_CHECK(!(o.per_split_data() && given("--split")),
               "--split with --train-data-path, --valid-data-path or --test-data-path",
               "the per-split paths use each dataset whole; drop --split, or give --data-path to split one blend");
    LOOM_CHECK(std::isfinite(o.mid_level_dataset_surplus) && o.mid_level_dataset_surplus >= 0,
               "--mid-level-dataset-surplus must be a finite number >= 0, got " << o.mid_level_dataset_surplus,
               "Megatron's default is 0.005");
    if (!o.data_cache_path.empty()) {
        std::error_code ec;
        LOOM_CHECK(!std::filesystem::exists(o.data_cache_path, ec) || std::filesystem::is_directory(o.data_cache_path, ec),
                   "--data-cache-path '" << o.data_cache_path << "' exists and is not a folder",
                   "give a folder (Loom creates it when it does not exist)");
    }
    if (o.fim_data) validate_fim(given, o);
    LOOM_CHECK(sources == 1 || data_optional, "no data: give --data-path PREFIX (a Megatron .bin/.idx dataset), or --mock-data",
               "as Megatron, Loom needs a data source; --mock-data trains on Loom's synthetic dataset, and "
               "--text-file / --llmc-shard read a text file or an llm.c shard");
}

}  // namespace loom::train
