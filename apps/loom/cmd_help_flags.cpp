// `loom help flags`: docs/megatron_flags.md's flag reference, rendered from the flag tables
// (train/flag_table.h). With --update FILE it rewrites what follows the marker in FILE, keeping the prose
// before it; tests/test_flag_docs.cpp fails when the committed file is stale.
#include "apps/loom/commands.h"
#include "core/error.h"
#include "train/flag_table.h"
#include "train/options_parser.h"

#include <cstdio>
#include <fstream>
#include <iterator>
#include <sstream>

namespace loom::app {

int cmd_help_flags(int argc, char ** argv) {
    CLI::App    app{"Print the flag reference of docs/megatron_flags.md, generated from the flag tables.",
                 "loom help flags"};
    std::string update;
    app.add_option("--update", update, "rewrite the generated part of this file (docs/megatron_flags.md)");
    if (std::optional<int> status = parse_arguments(app, argc, argv)) return *status;
    const std::string generated = train::flag_reference_markdown();
    if (update.empty()) {
        std::fputs(generated.c_str(), stdout);
        return 0;
    }
    std::ifstream in(update);
    LOOM_CHECK(in, "--update '" << update << "' cannot be read", "give the path of docs/megatron_flags.md");
    const std::string doc{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    in.close();
    std::ofstream out(update, std::ios::trunc);
    out << train::splice_generated(doc, generated);
    LOOM_CHECK(out.good(), "--update '" << update << "' cannot be written", "");
    std::printf("%s: the flag reference rewritten from the flag tables\n", update.c_str());
    return 0;
}

}  // namespace loom::app
