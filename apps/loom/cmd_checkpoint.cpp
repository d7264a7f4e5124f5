// loom checkpoint info DIR [--verify]: what a checkpoint of `loom train --save` holds.
//
//   loom checkpoint info ckpt                  the tracker's iteration (or ckpt/iter_0000100 itself)
//   loom checkpoint info ckpt --ckpt-step 10   another iteration
//   loom checkpoint info ckpt --verify         also run every check --load runs (CRC-32C, headers, entries)
//
// Prints the iteration, the consumed samples, the model and the layout it was saved from, whether the
// optimizer state is inside (and its step), the files with their sizes, and the tensors with their shapes,
// dtypes and how many pieces each was saved in.
#include "apps/loom/commands.h"
#include "checkpoint/checkpoint.h"
#include "core/error.h"

#include <cstdio>

namespace loom::app {

int cmd_checkpoint(int argc, char ** argv) {
    CLI::App app{"Inspect a checkpoint written by `loom train --save`.", "loom checkpoint"};
    app.require_subcommand(1);
    CLI::App *  info = app.add_subcommand("info", "print what a checkpoint holds");
    std::string dir;
    int64_t     step   = -1;
    bool        check  = false;
    bool        quiet  = false;
    info->add_option("DIR", dir, "the --save folder, or one of its iter_XXXXXXX folders")->required();
    info->add_option("--ckpt-step", step, "the iteration to show (default: the tracker's)");
    info->add_flag("--verify", check, "run every check --load runs: each file's size and CRC-32C, and every tensor "
                                      "read from its pieces");
    info->add_flag("--no-tensors", quiet, "leave out the list of tensors");
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    std::optional<int64_t> wanted;
    if (step >= 0) wanted = step;
    std::optional<std::string> folder = checkpoint::find_checkpoint(dir, wanted);
    LOOM_CHECK(folder, "'" << dir << "' holds no " << checkpoint::kTrackerFile, "give a --save folder of `loom train`");
    checkpoint::Index index = checkpoint::read_index(*folder);
    const nlohmann::json & meta = index.metadata;
    const nlohmann::json   args = meta.value("args", nlohmann::json::object());
    std::printf("checkpoint %s\n", folder->c_str());
    std::printf("  iteration %lld | consumed samples %lld | optimizer state %s", static_cast<long long>(index.iteration),
                static_cast<long long>(meta.value("consumed_train_samples", int64_t(0))),
                index.has_optimizer ? "saved" : "not saved");
    if (index.has_optimizer) std::printf(" (step %lld)", static_cast<long long>(index.optimizer_step));
    std::printf("\n");
    auto arg = [&](const char * key) {
        if (!args.contains(key)) return std::string("?");
        return args[key].is_string() ? args[key].get<std::string>() : args[key].dump();
    };
    std::printf("  model: %s layers, hidden %s, ffn %s, heads %s (groups %s), positions %s, vocab %s, %s, %s\n",
                arg("num_layers").c_str(), arg("hidden_size").c_str(), arg("ffn_hidden_size").c_str(),
                arg("num_attention_heads").c_str(), arg("num_query_groups").c_str(),
                arg("max_position_embeddings").c_str(), arg("vocab_size").c_str(), arg("normalization").c_str(),
                args.value("bf16", false) ? "bf16" : "f32");
    std::printf("  saved from: tp %s, pp %s (virtual stages %s), dp %s, distributed optimizer %s, offload %s\n",
                arg("tensor_model_parallel_size").c_str(), arg("pipeline_model_parallel_size").c_str(),
                arg("num_virtual_stages_per_pipeline_rank").c_str(), arg("data_parallel_size").c_str(),
                arg("use_distributed_optimizer").c_str(), arg("optimizer_cpu_offload").c_str());
    uint64_t total = 0;
    for (const auto & [name, f] : index.files) total += f.bytes;
    std::printf("  files: %zu, %.1f MiB\n", index.files.size(), total / 1048576.0);
    for (const auto & [name, f] : index.files) {
        std::printf("    %-26s %12llu bytes  crc32c %08x\n", name.c_str(), static_cast<unsigned long long>(f.bytes), f.crc32c);
    }
    int64_t elements = 0;
    for (const auto & [name, t] : index.tensors) elements += shape_numel(t.shape);
    std::printf("  tensors: %zu, %lld elements\n", index.tensors.size(), static_cast<long long>(elements));
    if (!quiet) {
        for (const auto & [name, t] : index.tensors) {
            std::printf("    %-48s %-14s %-4s %zu piece%s\n", name.c_str(), shape_string(t.shape).c_str(),
                        t.dtype.c_str(), t.pieces.size(), t.pieces.size() == 1 ? "" : "s");
        }
    }
    if (check) {
        checkpoint::verify(index);
        std::printf("  verified: every file has its size and CRC-32C; every tensor its entries, dtypes, sizes and "
                    "finite values (the checks of --load)\n");
    }
    return 0;
}

}  // namespace loom::app
