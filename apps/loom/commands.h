// The subcommands of `loom`. Each parses its own arguments and returns the process exit status; errors
// are thrown as loom::Error and turned into exit status 2 (bad input) by main().
#pragma once

namespace loom::app {

inline constexpr int kExitBadInput = 2;

int cmd_ranks(int argc, char ** argv);
int cmd_train(int argc, char ** argv);
int cmd_data(int argc, char ** argv);

}  // namespace loom::app
