// `loom train`'s command line: NUL-separated arguments through CLI11 and TrainOptionParser::resolve (the
// flags, defaults and every validation). Parse errors and loom::Error are the expected refusals.
#include "fuzz/fuzz_input.h"
#include "train/megatron_flags.h"
#include "train/options_parser.h"

#include <CLI/CLI.hpp>

#include <vector>

extern "C" int LLVMFuzzerTestOneInput(const uint8_t * data, size_t size) {
    std::vector<std::string> args{"loom train"};
    std::string              current;
    for (size_t i = 0; i < size && args.size() < 64; ++i) {
        if (data[i] == 0) {
            args.push_back(current);
            current.clear();
        } else {
            current.push_back(static_cast<char>(data[i]));
        }
    }
    if (!current.empty()) args.push_back(current);
    std::vector<char *> argv;
    for (std::string & a : args) argv.push_back(a.data());
    try {
        CLI::App                      app{"fuzz", "loom train"};
        loom::train::TrainOptionParser parser(app);
        loom::train::check_option_values(app, static_cast<int>(argv.size()), argv.data());
        app.parse(static_cast<int>(argv.size()), argv.data());
        loom::train::TrainOptions options = parser.resolve(1 + (size % 4));
        loom::train::estimate_memory(options);
    } catch (const CLI::Error &) {
    } catch (const loom::Error &) {
    }
    return 0;
}
