// Flag tables: each config that `loom train` fills from Megatron's command line declares its flags once, in
// a table beside the code that resolves it. An entry names the flag, the member its value lands in, the
// help group of Megatron's arguments.py, the help text, and, where the checkpoint records it, the arg it is
// saved as and whether a --load checkpoint must agree with it.
//
// From the tables come: the CLI11 registration (add_flags), --help's groups (group_like_megatron), the
// checkpoint's args and their contradiction check on load (checkpoint_args, train/checkpointing.cpp) and
// the flag reference of docs/megatron_flags.md (render_flags_markdown, `loom help flags`).
//
// Adding a flag is one entry in its config's table and the code that acts on the value.
#pragma once

#include <CLI/CLI.hpp>
#include <nlohmann/json.hpp>

#include <cstdint>
#include <initializer_list>
#include <optional>
#include <span>
#include <string>
#include <string_view>
#include <type_traits>
#include <variant>
#include <vector>

namespace loom::train {

struct TrainOptions;

// The checkpoint arg a flag is saved as: Megatron's name in the checkpoint's args and the resolved value
// (after presets, --load-hf and the other flags), read from the options.
struct CheckpointArg {
    const char * key = nullptr;                                   // nullptr: not saved
    nlohmann::json (*value)(const TrainOptions &) = nullptr;
    // The model's shape: a --load checkpoint saved with another value is refused naming the flag.
    bool must_match = false;
};

// How the value is taken (argparse's spelling in the comments).
enum FlagTraits : unsigned {
    kPlain       = 0,
    kShowDefault = 1u << 0,   // --help prints "[default]" (the default is Megatron's and meaningful)
    kList        = 1u << 1,   // nargs='*' taking one or more words; given twice, the last list wins
    kNegated     = 1u << 2,   // a switch that sets its bool member to false (--no-...; the member is the positive)
};

// Where a value lands: a member of the owning config, of one of the types Megatron's flags take.
template <class Owner>
using FlagMember = std::variant<int64_t Owner::*, uint64_t Owner::*, float Owner::*, double Owner::*, bool Owner::*,
                                std::string Owner::*, std::vector<std::string> Owner::*, std::vector<float> Owner::*>;

template <class Owner> struct Flag {
    const char *      name;
    const char *      group;   // Megatron's help group (train/megatron_flags.h), or kLoomGroup
    FlagMember<Owner> member;
    const char *      help;
    unsigned          traits = kPlain;
    CheckpointArg     arg    = {};
};

// The help group of flags that are Loom's own (or that Loom has not placed in one of Megatron's).
inline constexpr const char * kLoomGroup = "Loom (not Megatron's)";

// One flag of any table, without its member: what the checkpoint and the docs read.
struct FlagInfo {
    const char *  name;
    const char *  group;
    const char *  help;
    unsigned      traits;
    CheckpointArg arg;
};

// A value a 32-bit float member holds: a finite number past its range, or a nonzero one that would round to
// zero, is refused naming the flag (it read as inf or 0, and a range check then blamed the value given).
CLI::Validator float32_range();

// Registers each flag of `table` on `app`, its value landing in `owner` (which must outlive the parse).
template <class Owner> void add_flags(CLI::App & app, std::span<const Flag<Owner>> table, Owner & owner) {
    for (const Flag<Owner> & f : table) {
        std::visit(
            [&](auto member) {
                auto &        value  = owner.*member;
                using T              = std::remove_reference_t<decltype(value)>;
                CLI::Option * option = nullptr;
                if constexpr (std::is_same_v<T, bool>) {
                    if (f.traits & kNegated) {
                        option = app.add_flag_function(f.name, [&value](std::int64_t count) { value = count <= 0; }, f.help);
                    } else {
                        option = app.add_flag(f.name, value, f.help);
                    }
                    // A switch takes no value: argparse refuses `--swiglu=false` ("ignored explicit argument").
                    option->disable_flag_override();
                } else {
                    option = app.add_option(f.name, value, f.help);
                    if (f.traits & kList) option->expected(1, -1)->trigger_on_parse();
                    if constexpr (std::is_same_v<T, float> || std::is_same_v<T, std::vector<float>>) {
                        option->check(float32_range());
                    }
                }
                if (f.traits & kShowDefault) option->capture_default_str();
                option->group(f.group);
            },
            f.member);
    }
}

// The same flags without their members.
template <class Owner> void append_info(std::vector<FlagInfo> & out, std::span<const Flag<Owner>> table) {
    for (const Flag<Owner> & f : table) out.push_back({f.name, f.group, f.help, f.traits, f.arg});
}

// Every integer and floating-point option of `app` reads its value as argparse does, with Python's int()
// and float(): surrounding whitespace ignored, underscores allowed between digits, an integer in decimal
// only ("010" is 10, not octal 8; "0x10" and "1e3" are refused), a float without C's hexadecimal form, and
// an empty value refused. An integer past int64's range is refused too: CLI11 would clamp it to the largest
// value, which then runs "forever", where argparse reads it exactly. The error names the flag and the value.
void read_numbers_as_argparse(CLI::App & app);

// argparse's check of a `choices=` flag, with its message: "argument FLAG: invalid choice: 'V' (choose
// from 'a', 'b')".
void check_choice(const char * flag, const std::string & value, std::span<const char * const> choices);
inline void check_choice(const char * flag, const std::string & value, std::initializer_list<const char *> choices) {
    check_choice(flag, value, std::span<const char * const>(choices.begin(), choices.size()));
}

// Python's int() and float() of `text`, as the decimal spelling C++ reads back unchanged (no underscores,
// no leading zeros, no surrounding whitespace); nullopt where Python raises ValueError.
std::optional<std::string> python_int_text(std::string_view text);
std::optional<std::string> python_float_text(std::string_view text);

// Prints the groups of `app` in the order arguments.py adds them (CLI11 prints them in the order their
// first option was added).
void group_like_megatron(CLI::App & app);

// The flag reference of docs/megatron_flags.md: every group of `app` (registered by TrainOptionParser)
// with its flags, defaults and help, the flags accepted without effect and the refusals with a hint.
std::string render_flags_markdown(const CLI::App & app);

// docs/megatron_flags.md is written prose up to kGeneratedMarker and the rendered reference after it.
inline constexpr const char * kGeneratedMarker =
    "<!-- Generated from the flag tables (src/train/flags_*.cpp) by `loom help flags --update "
    "docs/megatron_flags.md`; edit the tables, not what follows. -->";
// `doc` with everything after the marker replaced by `generated` (the marker appended if missing).
std::string splice_generated(const std::string & doc, const std::string & generated);

}  // namespace loom::train
