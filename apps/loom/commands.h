// The subcommands of `loom`. Each parses its own arguments and returns the process exit status; errors
// are thrown as loom::Error and turned into exit status 2 (bad input) by main().
#pragma once

#include "train/megatron_flags.h"

#include <CLI/CLI.hpp>

#include <optional>

namespace loom::app {

inline constexpr int kExitBadInput = 2;

// Parses a command's arguments. Returns the exit status when the command must stop here (0 after
// --help, kExitBadInput after a parse error, with CLI11's message on stderr), or nothing to go on. A value
// that looks like a flag is refused first, as argparse does (throws loom::Error naming the option).
inline std::optional<int> parse_arguments(CLI::App & app, int argc, char ** argv) {
    train::check_option_values(app, argc, argv);
    try {
        app.parse(argc, argv);
    } catch (const CLI::CallForHelp & e) {
        return app.exit(e);
    } catch (const CLI::ParseError & e) {
        app.exit(e);
        return kExitBadInput;
    }
    return std::nullopt;
}

int cmd_ranks(int argc, char ** argv);
int cmd_layout(int argc, char ** argv);
int cmd_train(int argc, char ** argv);
int cmd_data(int argc, char ** argv);
int cmd_eval(int argc, char ** argv);
int cmd_export_hf(int argc, char ** argv);
int cmd_schedule(int argc, char ** argv);
int cmd_checkpoint(int argc, char ** argv);
int cmd_plan(int argc, char ** argv);
// `loom help flags [--update FILE]`: the flag reference of docs/megatron_flags.md, printed or written into FILE.
int cmd_help_flags(int argc, char ** argv);

}  // namespace loom::app
