// Hugging Face config.json: the GPT-2 shape, then the architecture and shape checks.
#include "fuzz/fuzz_input.h"
#include "model/hf_gpt2.h"

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    const std::string dir = loom::fuzz::scratch_dir() + "/hf";
    std::filesystem::create_directories(dir);
    loom::fuzz::write_file(dir + "/config.json", data, size);
    try {
        loom::model::GptConfig config = loom::model::gpt_config_from_hf(dir);
        config.validate();
        loom::model::check_gpt2_architecture(config, "import");
        config.num_parameters();
    } catch (const loom::Error &) {
    }
    return 0;
}
