// loom eval: the mean lm loss and perplexity of a model over --eval-iters batches, in full (f32) precision.
//
//   loom eval --eval-iters 20                                    gpt-tiny at its seed, synthetic data
//   loom eval --data-path corpus_text_document --eval-iters 50   the validation range of --split
//   loom eval --load-hf gpt2 --llmc-shard val.bin --seq-length 1024 --micro-batch-size 4
//                                                                Hugging Face GPT-2 weights (model/hf_gpt2.h)
//   loom eval --load ckpt --use-checkpoint-args --eval-iters 20  a checkpoint of `loom train --save`
//
// Prints Megatron's validation line: " validation loss at iteration 0 | lm loss value: ... | lm loss PPL: ... |".
// The model is initialised from --seed, or takes its shape and weights from a Hugging Face GPT-2 folder
// with --load-hf, or takes its weights from a checkpoint with --load (its shape with --use-checkpoint-args);
// the validation line then names the checkpoint's iteration. The softmax covers the real vocabulary only (model/gpt_model.h), so an imported model
// scores Hugging Face's own loss whatever the padding.
#include "apps/loom/commands.h"
#include "apps/loom/devices.h"
#include "train/options_parser.h"
#include "model/hf_gpt2.h"
#include "train/checkpointing.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include <cmath>
#include <cstdio>

namespace loom::app {

int cmd_eval(int argc, char ** argv) {
    CLI::App                 app{"Evaluate a GPT's lm loss and perplexity.", "loom eval"};
    train::TrainOptionParser parser(app);
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    train::TrainOptions options    = parser.resolve();
    const int64_t       eval_iters = options.eval_iters;
    LOOM_CHECK(eval_iters >= 1, "--eval-iters must be >= 1, got " << eval_iters, "");
    LOOM_CHECK(eval_iters <= (int64_t(1) << 40) / options.eval_global_batch_size,
               "--eval-iters " << eval_iters << " x global batch " << options.eval_global_batch_size
                               << " samples is more than Loom evaluates (2^40)",
               "evaluate fewer batches");
    std::optional<checkpoint::Index> index;
    if (!options.load.empty()) index = train::index_to_read(options, "loom eval");
    Device &            device  = device_for(options.device);
    auto data = train::make_batch_source(options, device, parser.vocab_given(), 0, 1, data::Split::valid,
                                         eval_iters * options.eval_global_batch_size);
    options.model.validate();
    model::GptModel gpt(options.model, device);
    gpt.init();
    if (!options.load_hf.empty()) {
        model::load_hf_gpt2(gpt, options.load_hf);
    }
    if (index) {
        train::check_checkpoint_args(options, *index);
        train::load_weights(*index, gpt);
    }
    double sum = 0, count = 0;
    for (int64_t k = 0; k < eval_iters * options.eval_num_microbatches(); ++k) {
        model::GptModel::Context ctx;
        ctx.training                  = false;   // evaluation drops nothing out
        model::GptModel::LossSum loss = gpt.forward(ctx, data->next());
        sum += loss.sum;
        count += loss.count;
    }
    double mean = sum / std::max(count, 1.0);
    std::printf("data: %s\n", data->describe().c_str());
    std::printf("%s\n", train::megatron_validation_lines(
                             "iteration " + std::to_string(index ? index->iteration : 0), mean).c_str());
    return 0;
}

}  // namespace loom::app
