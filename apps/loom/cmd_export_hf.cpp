// loom export-hf: write a model as a Hugging Face GPT-2 folder (config.json + model.safetensors, F32).
//
//   loom export-hf --output gpt-tiny-hf                         gpt-tiny initialised from --seed
//   loom export-hf --model gpt2-124m --vocab-size 50257 --output gpt2-init
//   loom export-hf --load-hf gpt2 --output gpt2-copy            a round trip through Loom's parameters
//   loom export-hf --load ckpt --output trained-hf               a checkpoint of `loom train --save`
//                                                                (--ckpt-step N for another iteration)
//
// The model is built from the same model flags as `loom train` and initialised from --seed, or from
// --load-hf; with --load its shape comes from the checkpoint's args and its weights from the checkpoint
// (the f32 master weights when it was trained in bf16), whatever layout it was saved from. Only GPT-2-shaped models export (LayerNorm, GELU, learned positions, biases, tied output);
// the vocabulary is written unpadded (--vocab-size rows). The folder loads with
// transformers.GPT2LMHeadModel.from_pretrained(DIR) and with `loom eval --load-hf DIR`.
#include "apps/loom/commands.h"
#include "backend/cpu/cpu_device.h"
#include "model/hf_gpt2.h"
#include "train/checkpointing.h"
#include "train/options_parser.h"

#include <cstdio>
#include <filesystem>

namespace loom::app {

int cmd_export_hf(int argc, char ** argv) {
    CLI::App                 app{"Write a GPT-2-shaped model as a Hugging Face folder.", "loom export-hf"};
    train::TrainOptionParser parser(app);
    std::string              output;
    app.add_option("--output", output, "folder to write config.json and model.safetensors to")->required();
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    parser.data_optional();
    train::TrainOptions              options = parser.resolve();
    LOOM_CHECK(options.device != "cuda", "--device cuda: loom export-hf converts the weights on the CPU",
               "leave --device out (or give --device cpu)");
    std::optional<checkpoint::Index> index;
    if (!options.load.empty()) {
        index = train::index_to_read(options, "loom export-hf");
        train::apply_checkpoint_args(options.model, *index);
        options.model.params_dtype = DType::f32;
        options.model.validate();
    }
    model::check_gpt2_architecture(options.model, "export");
    model::GptModel gpt(options.model, cpu::device());
    gpt.init();
    if (!options.load_hf.empty()) {
        model::load_hf_gpt2(gpt, options.load_hf);
    }
    if (index) train::load_weights(*index, gpt);
    model::export_hf_gpt2(gpt, output);
    std::printf("loom export-hf: wrote %s and %s (%lld layers, hidden %lld, heads %lld, vocab %lld, %s)\n",
                (std::filesystem::path(output) / "config.json").c_str(),
                (std::filesystem::path(output) / "model.safetensors").c_str(),
                static_cast<long long>(options.model.num_layers), static_cast<long long>(options.model.hidden_size),
                static_cast<long long>(options.model.num_attention_heads),
                static_cast<long long>(options.model.vocab_size),
                index                    ? ("weights of " + index->folder).c_str()
                : options.load_hf.empty() ? ("initialised from seed " + std::to_string(options.model.seed)).c_str()
                                          : ("weights of " + options.load_hf).c_str());
    return 0;
}

}  // namespace loom::app
