// The flag tables (src/train/flag_table.h) are the one source of docs/megatron_flags.md's flag reference
// and of the checkpoint's args: the committed file must be what they render, and each arg has one flag.
#include "train/flag_table.h"
#include "train/megatron_flags.h"
#include "train/options_parser.h"

#include <gtest/gtest.h>

#include <fstream>
#include <iterator>
#include <set>
#include <string>

using namespace loom;

TEST(FlagDocs, MegatronFlagsMdIsRenderedFromTheTables) {
    const std::string path = std::string(LOOM_SOURCE_DIR) + "/docs/megatron_flags.md";
    std::ifstream     in(path);
    ASSERT_TRUE(in) << path;
    const std::string doc{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    ASSERT_NE(doc.find(train::kGeneratedMarker), std::string::npos) << path << " has lost its generated-part marker";
    const std::string expected = train::splice_generated(doc, train::flag_reference_markdown());
    EXPECT_TRUE(doc == expected) << "docs/megatron_flags.md is stale: the flag tables changed. Regenerate it with "
                                    "`make docs` (build/apps/loom help flags --update docs/megatron_flags.md) and "
                                    "commit the result.";
}

TEST(FlagDocs, EveryFlagIsDeclaredOnceAndEveryArgHasOneFlag) {
    std::set<std::string> names, keys;
    for (const train::FlagInfo & f : train::train_flags()) {
        EXPECT_TRUE(names.insert(f.name).second) << f.name << " is declared twice";
        EXPECT_NE(std::string(f.group), "") << f.name;
        EXPECT_NE(std::string(f.help), "") << f.name;
        if (f.arg.key == nullptr) continue;
        EXPECT_TRUE(keys.insert(f.arg.key).second) << "checkpoint arg " << f.arg.key << " is saved by two flags";
        EXPECT_NE(f.arg.value, nullptr) << f.name;
    }
    for (const train::NoOpFlag & f : train::noop_flags()) {
        EXPECT_EQ(names.count(f.name), 0u) << f.name << " is both a table flag and accepted without effect";
    }
    // The args a checkpoint saved before the tables must still be written (train/checkpointing.cpp adds
    // padded_vocab_size and data_parallel_size, which several flags derive).
    for (const char * key : {"num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads", "num_query_groups",
                             "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "normalization",
                             "swiglu", "qk_layernorm", "position_embedding_type", "add_bias_linear",
                             "untie_embeddings_and_output_weights", "norm_epsilon", "rotary_base", "num_experts",
                             "moe_layer_freq", "moe_ffn_hidden_size", "moe_shared_expert_intermediate_size",
                             "moe_grouped_gemm", "model", "seq_length", "init_method_std", "seed", "bf16",
                             "tensor_model_parallel_size", "pipeline_model_parallel_size",
                             "num_virtual_stages_per_pipeline_rank", "sequence_parallel", "use_distributed_optimizer",
                             "optimizer_cpu_offload", "micro_batch_size", "global_batch_size", "train_iters", "lr",
                             "min_lr", "lr_decay_style", "lr_warmup_iters", "weight_decay", "clip_grad", "data_path",
                             "train_data_path", "valid_data_path", "test_data_path"}) {
        EXPECT_EQ(keys.count(key), 1u) << "no flag saves checkpoint arg " << key;
    }
}
