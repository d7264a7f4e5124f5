// Megatron's command line as Loom reads it: argparse's rules where CLI11's differ, the flags Loom accepts
// without acting on them (they choose an implementation on Megatron's side, and Loom's behaviour is the
// one they ask for), the flags it refuses with a hint, and the help groups of Megatron's arguments.py.
//
// The accepted no-op flags and the refusal hints are rendered into docs/megatron_flags.md (train/flag_table.h);
// the help groups are named by each flag's table entry.
#pragma once

#include <CLI/CLI.hpp>

#include <map>
#include <span>
#include <string>
#include <vector>

namespace loom::train {

// A Megatron flag Loom accepts and ignores. `values` is nullptr for a switch, else the values accepted,
// separated by '|' (any other value is refused naming the flag, as the behaviour would differ).
struct NoOpFlag {
    const char * name;
    const char * values;
    const char * reason;
};
std::span<const NoOpFlag> noop_flags();

// Registers the no-op flags on `app` (their values land in `sink`, which must outlive the parse).
void add_noop_flags(CLI::App & app, std::vector<std::string> & sink);

// argparse's rule, which CLI11 does not have: an option that takes a value cannot take a word that looks
// like a flag ("--split --bf16" is "argument --split: expected one argument", not a split named "--bf16").
// A negative number is a value. Throws loom::Error naming the option. Run it before CLI11 parses.
void check_option_values(const CLI::App & app, int argc, const char * const * argv);

// The error for the words CLI11 did not expect (CLI::App::remaining() with allow_extras): each flag on its
// own line with the values that followed it, a hint where Loom has an equivalent, in the order given.
// Empty when there are none.
std::string unsupported_flags_message(const std::vector<std::string> & remaining);

// Megatron flags Loom refuses, with what to do instead (only where Loom has something to offer).
const std::map<std::string, std::string> & refusal_hints();

}  // namespace loom::train
