// loom train: train a GPT on one rank (the main job).
//
//   loom train                                   gpt-tiny on the built-in synthetic dataset
//   loom train --model gpt2-124m --data-path corpus_text_document --micro-batch-size 4 --seq-length 256
//   loom train --load-hf gpt2 --data-path corpus_text_document   fine-tune Hugging Face GPT-2 weights
//
// Prints Megatron's per-iteration line every --log-interval iterations, optionally writes the same keys
// as JSON lines (--log-file), and ends with a summary: tokens/s, achieved TFLOP/s, peak memory by pool.
#include "apps/loom/commands.h"
#include "backend/cpu/cpu_device.h"
#include "model/hf_gpt2.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include <CLI/CLI.hpp>

#include <cstdio>

namespace loom::app {

namespace {

void print_summary(const train::TrainSummary & s, const model::GptModel & gpt) {
    std::printf("\ntraining summary: %zu iterations in %.1f s | %.0f tokens/s | %.3f TFLOP/s achieved | "
                "lm loss %.4f -> %.4f\n",
                s.losses.size(), s.seconds, s.tokens_per_second, s.tflops, s.losses.front(), s.losses.back());
    Allocator & device = cpu::device().allocator(MemoryKind::device);
    std::printf("peak memory (%s): %.1f MiB allocated, %.1f MiB reserved\n", device.name().c_str(),
                device.stats().peak_allocated / 1048576.0, device.stats().peak_reserved / 1048576.0);
    for (const std::string & pool : device.pool_names()) {
        AllocatorStats p = device.pool_stats(pool);
        std::printf("  %-12s peak %9.1f MiB   in use %9.1f MiB\n", pool.c_str(), p.peak_allocated / 1048576.0,
                    p.allocated / 1048576.0);
    }
    (void)gpt;
}

}  // namespace

int cmd_train(int argc, char ** argv) {
    CLI::App app{"Train a GPT on this rank.", "loom train"};
    train::TrainOptionParser parser(app);
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    train::TrainOptions options = parser.resolve();
    Device &            device  = cpu::device();
    std::unique_ptr<train::BatchSource> data = train::make_batch_source(options, device, parser.vocab_given());
    options.model.validate();

    model::GptModel gpt(options.model, device);
    gpt.init();
    if (!options.load_hf.empty()) {
        model::load_hf_gpt2(gpt, options.load_hf);   // the shape was checked against config.json by resolve()
    }
    std::printf("loom train: %s, %lld parameters, %lld layers, hidden %lld, heads %lld, seq %lld, vocab %lld (padded %lld)\n",
                options.model_preset.c_str(), static_cast<long long>(options.model.num_parameters()),
                static_cast<long long>(options.model.num_layers), static_cast<long long>(options.model.hidden_size),
                static_cast<long long>(options.model.num_attention_heads), static_cast<long long>(options.model.seq_length),
                static_cast<long long>(options.model.vocab_size),
                static_cast<long long>(options.model.padded_vocab_size()));
    std::printf("data: %s | micro-batch %lld, global batch %lld, %lld iterations\n", data->describe().c_str(),
                static_cast<long long>(options.micro_batch_size), static_cast<long long>(options.global_batch_size),
                static_cast<long long>(options.train_iters));
    train::Trainer      trainer(options, gpt, *data);
    train::TrainSummary summary = trainer.run(stdout);
    print_summary(summary, gpt);
    return 0;
}

}  // namespace loom::app
