// The resolve step that reads files: --load-hf's config.json, the tokenizer's vocabulary and the
// --use-checkpoint-args index. The other steps only read the flags.
#include "core/error.h"
#include "data/gpt2_bpe.h"
#include "model/hf_gpt2.h"
#include "train/checkpointing.h"
#include "train/flag_values.h"
#include "train/options.h"

namespace loom::train {

std::optional<model::GptConfig> read_hf_shape(const Given & given, TrainOptions & o) {
    if (o.load_hf.empty()) return std::nullopt;
    model::GptConfig hf = model::gpt_config_from_hf(o.load_hf);
    if (!given("--model")) o.model = hf;   // a --model preset given as well must agree (check_hf_shape)
    return hf;
}

void check_hf_shape(const model::GptConfig & hf, const ModelFlags & f, const Given & given, const TrainOptions & o) {
    // Checked first: a longer --seq-length has raised the positions.
    LOOM_CHECK(!given("--seq-length") || f.seq_length <= hf.max_position_embeddings,
               "--seq-length " << f.seq_length << " exceeds n_positions = " << hf.max_position_embeddings
                               << " in '" << o.load_hf << "/config.json'",
               "the checkpoint has learned positions for " << hf.max_position_embeddings << " tokens");
    model::check_gpt2_architecture(o.model, "import");
    model::check_hf_gpt2_compatible(hf, o.model, o.load_hf);
}

// --tokenizer-type: the vocabulary size from the tokenizer (Megatron's build_tokenizer), before padding.
void apply_tokenizer(TrainOptions & o, bool vocab_size_given) {
    const bool files = !o.vocab_file.empty() || !o.merge_file.empty();
    if (o.tokenizer_type.empty()) {
        if (!files) return;   // Loom's extension: the vocabulary is the data's
        o.tokenizer_type = "GPT2BPETokenizer";   // pretrain_gpt.py's args_defaults
    }
    if (o.tokenizer_type == "GPT2BPETokenizer") {
        LOOM_CHECK(!o.vocab_file.empty() && !o.merge_file.empty(),
                   "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
                   "give GPT-2's vocab.json and merges.txt (the files the dataset was tokenised with)");
        const data::Gpt2BpeTokenizer tokenizer(o.vocab_file, o.merge_file);
        LOOM_CHECK(!vocab_size_given || o.model.vocab_size == tokenizer.vocab_size(),
                   "--vocab-size " << o.model.vocab_size << " contradicts --vocab-file '" << o.vocab_file << "', which holds "
                                   << tokenizer.vocab_size() << " tokens",
                   "drop --vocab-size: GPT2BPETokenizer takes the vocabulary from its files");
        o.model.vocab_size = tokenizer.vocab_size();
        return;
    }
    if (o.tokenizer_type == "NullTokenizer") {
        LOOM_CHECK(vocab_size_given, "--tokenizer-type NullTokenizer needs --vocab-size", "the ids are taken as they are");
        LOOM_CHECK(!files, "--tokenizer-type NullTokenizer reads no --vocab-file or --merge-file", "drop them");
        return;
    }
    LOOM_THROW("--tokenizer-type " << o.tokenizer_type << " is not supported by Loom",
               "Loom accepts GPT2BPETokenizer (--vocab-file, --merge-file) and NullTokenizer (--vocab-size); without "
               "--tokenizer-type the vocabulary is the dataset's largest id + 1");
}

void apply_checkpoint_shape(TrainOptions & o) {
    if (!o.use_checkpoint_args) return;
    // The checkpoint's shape wins over the flags, as Megatron's load_args_from_checkpoint.
    std::optional<std::string> folder = checkpoint_to_load(o);
    LOOM_CHECK(folder, "--use-checkpoint-args: '" << o.load << "' holds no " << checkpoint::kTrackerFile,
               "give a --load folder that holds a checkpoint");
    apply_checkpoint_args(o.model, checkpoint::read_index(*folder));
}

}  // namespace loom::train
