#include "train/checkpointing.h"
#include "train/options_parser.h"

#include "core/error.h"

#include <chrono>

namespace loom::train {

using json = nlohmann::json;

namespace {

// The MoE args a checkpoint written before Loom had experts lacks: a dense model's.
json saved_or_dense(const json & saved, const char * key) {
    if (saved.contains(key)) return saved[key];
    if (std::string(key) == "moe_layer_freq") return 1;
    if (std::string(key) == "moe_grouped_gemm") return false;
    return nullptr;
}

bool is_moe_arg(const char * key) { return std::string(key).rfind("moe_", 0) == 0 || std::string(key) == "num_experts"; }

const json & saved_args(const checkpoint::Index & index) {
    LOOM_CHECK(index.metadata.is_object() && index.metadata.contains("args") && index.metadata["args"].is_object(),
               "checkpoint index '" << index.path() << "' has no args", "it was not written by `loom train --save`");
    return index.metadata["args"];
}

checkpoint::RankContents rank_contents(const TrainOptions & options, Setup & setup) {
    checkpoint::RankContents rank;
    rank.params    = setup.parameters();
    rank.optimizer = setup.optimizer.get();
    rank.world     = setup.all_ranks();
    // Without ZeRO-1 every data-parallel rank holds the same state: the first one writes it.
    rank.writes = options.ddp.use_distributed_optimizer || !setup.groups.dp || setup.groups.dp->rank() == 0;
    // Experts: the EP ranks hold different experts, the expert-data-parallel ranks the same ones.
    const auto & edp    = setup.groups.expert_dp ? setup.groups.expert_dp : setup.groups.dp;
    rank.writes_experts = options.ddp.use_distributed_optimizer || !edp || edp->rank() == 0;
    return rank;
}

}  // namespace

// The args the flag tables save (train/flag_table.h), plus the sizes derived from several flags.
json checkpoint_metadata(const TrainOptions & o, int64_t consumed_samples) {
    json args = json::object();
    for (const FlagInfo & f : train_flags()) {
        if (f.arg.key == nullptr) continue;
        json value = f.arg.value(o);
        if (!value.is_discarded()) args[f.arg.key] = std::move(value);
    }
    args["padded_vocab_size"]  = o.model.padded_vocab_size(o.parallel.tp());
    args["data_parallel_size"] = o.parallel.dp();
    return {{"args", args}, {"consumed_train_samples", consumed_samples}, {"rng", {{"seed", o.model.seed}}}};
}

// Each arg a table marks must_match, named by its flag.
void check_checkpoint_args(const TrainOptions & options, const checkpoint::Index & index) {
    const json & saved = saved_args(index);
    for (const FlagInfo & f : train_flags()) {
        if (!f.arg.must_match) continue;
        const char * key = f.arg.key;
        LOOM_CHECK(saved.contains(key) || is_moe_arg(key), "checkpoint index '" << index.path() << "' has no arg " << key, "");
        const json was = saved_or_dense(saved, key);
        const json now = f.arg.value(options);
        if (was == now) continue;
        LOOM_THROW(f.name << ": the model has " << key << " = " << now.dump() << ", the checkpoint in '"
                          << index.folder << "' has " << was.dump(),
                   "give the model flags the checkpoint was saved with, or --use-checkpoint-args to take them from it");
    }
}

void apply_checkpoint_args(model::GptConfig & m, const checkpoint::Index & index) {
    const json & a = saved_args(index);
    try {
        m.num_layers                   = a.at("num_layers").get<int64_t>();
        m.hidden_size                  = a.at("hidden_size").get<int64_t>();
        m.ffn_hidden_size              = a.at("ffn_hidden_size").get<int64_t>();
        m.num_attention_heads          = a.at("num_attention_heads").get<int64_t>();
        m.num_query_groups             = a.at("num_query_groups").get<int64_t>();
        m.max_position_embeddings      = a.at("max_position_embeddings").get<int64_t>();
        m.seq_length                   = a.at("seq_length").get<int64_t>();
        m.vocab_size                   = a.at("vocab_size").get<int64_t>();
        m.make_vocab_size_divisible_by = a.at("make_vocab_size_divisible_by").get<int64_t>();
        m.normalization = a.at("normalization") == "RMSNorm" ? model::Normalization::rmsnorm : model::Normalization::layernorm;
        m.swiglu        = a.at("swiglu").get<bool>();
        m.qk_layernorm  = a.value("qk_layernorm", false);   // absent from checkpoints written before the flag
        const std::string position = a.at("position_embedding_type").get<std::string>();
        m.position_embedding = position == "rope"   ? model::PositionEmbedding::rope
                               : position == "none" ? model::PositionEmbedding::none
                                                    : model::PositionEmbedding::learned_absolute;
        m.add_bias_linear                     = a.at("add_bias_linear").get<bool>();
        m.untie_embeddings_and_output_weights = a.at("untie_embeddings_and_output_weights").get<bool>();
        m.norm_epsilon                        = a.at("norm_epsilon").get<float>();
        m.rotary_base                         = a.at("rotary_base").get<float>();
        m.init_method_std                     = a.at("init_method_std").get<float>();
        // The MoE shape (the router's other settings are training choices, given as flags).
        if (const json experts = saved_or_dense(a, "num_experts"); !experts.is_null()) {
            m.moe.num_experts = experts.get<int64_t>();
            const json freq   = saved_or_dense(a, "moe_layer_freq");
            if (freq.is_array()) {
                m.moe.layer_pattern = freq.get<std::vector<int>>();
            } else {
                m.moe.layer_freq = freq.get<int64_t>();
            }
            m.moe.ffn_hidden_size = saved_or_dense(a, "moe_ffn_hidden_size").get<int64_t>();
            const json shared     = saved_or_dense(a, "moe_shared_expert_intermediate_size");
            m.moe.shared_expert_intermediate_size = shared.is_null() ? 0 : shared.get<int64_t>();
            m.moe.grouped_gemm                    = saved_or_dense(a, "moe_grouped_gemm").get<bool>();
        }
    } catch (const json::exception & e) {
        LOOM_THROW("checkpoint index '" << index.path() << "' has malformed args: " << e.what(),
                   "give the model flags instead of --use-checkpoint-args");
    }
}

std::optional<std::string> checkpoint_to_load(const TrainOptions & o) {
    std::optional<int64_t> step;
    if (o.ckpt_step >= 0) step = o.ckpt_step;
    return checkpoint::find_checkpoint(o.load, step);
}

Resumed load_checkpoint(const TrainOptions & options, Setup & setup) {
    Resumed resumed;
    if (options.load.empty()) return resumed;
    const auto start = std::chrono::steady_clock::now();
    std::optional<std::string> folder = checkpoint_to_load(options);
    LOOM_CHECK(folder || !options.exit_on_missing_checkpoint,
               "--exit-on-missing-checkpoint: '" << options.load << "' holds no checkpoint (no "
                                                 << checkpoint::kTrackerFile << ")",
               "give the --save folder of a run, or leave the flag out to train from scratch");
    if (!folder) return resumed;
    checkpoint::Index index = checkpoint::read_index(*folder);
    check_checkpoint_args(options, index);
    checkpoint::LoadOptions load;
    load.optimizer  = !options.no_load_optim && !options.finetune;
    load.vocab_size = options.model.vocab_size;
    checkpoint::load(index, rank_contents(options, setup), load);
    resumed.folder = *folder;
    if (!options.finetune) {
        resumed.iteration = index.iteration;
        LOOM_CHECK(index.metadata.contains("consumed_train_samples"),
                   "checkpoint index '" << index.path() << "' has no consumed_train_samples", "");
        resumed.consumed_samples = index.metadata["consumed_train_samples"].get<int64_t>();
    }
    resumed.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return resumed;
}

checkpoint::Index index_to_read(const TrainOptions & o, const char * command) {
    LOOM_CHECK(o.save.empty() && o.save_interval == 0 && o.exit_interval == 0 && o.exit_duration_in_mins == 0 &&
                   !o.exit_signal_handler,
               "--save, --save-interval and the --exit-* flags are flags of `loom train`, not of `" << command << "`",
               "leave them out");
    std::optional<std::string> folder = checkpoint_to_load(o);
    LOOM_CHECK(folder, "--load '" << o.load << "' holds no " << checkpoint::kTrackerFile,
               "give the --save folder of a `loom train` run");
    return checkpoint::read_index(*folder);
}

void load_weights(const checkpoint::Index & index, model::GptModel & model) {
    checkpoint::RankContents contents;
    contents.params = model.parameters();
    checkpoint::LoadOptions load;
    load.optimizer  = false;
    load.vocab_size = model.config().vocab_size;
    checkpoint::load(index, contents, load);
}

checkpoint::SaveStats save_checkpoint(const TrainOptions & options, Setup & setup, int64_t iteration,
                                      int64_t consumed_samples) {
    return checkpoint::save(options.save, iteration, checkpoint_metadata(options, consumed_samples),
                            rank_contents(options, setup), !options.no_save_optim);
}

}  // namespace loom::train
