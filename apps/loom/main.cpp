// loom: the command-line entry point.
//
//   loom train     train a GPT on this rank
//   loom eval      lm loss and perplexity of a model
//   loom data      convert text into a Megatron dataset
//   loom ranks     print the process groups of a parallel configuration (see `loom ranks --help`)
//   loom layout    print DDP's param-and-grad buffers, buckets and shard ranges for a parameter list
//   loom export-hf write a model as a Hugging Face GPT-2 folder
//   loom schedule  print or draw the pipeline-parallel schedule of every rank (1F1B, interleaved)
//   loom plan      the memory each rank of a run holds, by pool, planned on the meta device
//   loom checkpoint info   what a checkpoint of `loom train --save` holds
//   loom help [command]    the list of commands, or a command's options (as `loom <command> --help`)
//   loom help flags [--update FILE]   the flag reference of docs/megatron_flags.md, from the flag tables
//   loom --version         the version and the backends this build holds
//
// Only this file turns a loom::Error into an exit status (2: the input was at fault) and a message on
// stderr.
#include "apps/loom/commands.h"
#include "apps/loom/gpu_backend.h"
#include "core/atomic_file.h"
#include "core/error.h"
#include "train/rerun.h"

#include <cerrno>
#include <cstdio>
#include <cstring>
#include <exception>
#include <fcntl.h>
#include <string>
#include <unistd.h>

namespace {

struct Command {
    const char * name;
    int (*run)(int, char **);
    const char * help;
};

const Command kCommands[] = {
    {"train", loom::app::cmd_train, "train a GPT (the main job; `loom train --help` lists Megatron's flags)"},
    {"eval", loom::app::cmd_eval, "mean lm loss and perplexity of a model over --eval-iters batches"},
    {"data", loom::app::cmd_data, "convert text or JSON lines into a Megatron .bin/.idx dataset (byte or GPT-2 BPE tokens)"},
    {"ranks", loom::app::cmd_ranks, "print the process groups and rank map of a parallel configuration"},
    {"layout", loom::app::cmd_layout, "print DDP's param-and-grad buffers, buckets and distributed-optimizer shards"},
    {"export-hf", loom::app::cmd_export_hf, "write a GPT-2-shaped model as a Hugging Face config.json + model.safetensors"},
    {"checkpoint", loom::app::cmd_checkpoint, "`checkpoint info DIR [--verify]`: what a checkpoint of `loom train --save` holds"},
    {"plan", loom::app::cmd_plan, "the memory each rank of a run holds, by pool, from the allocator's books (no memory or work needed)"},
    {"schedule", loom::app::cmd_schedule, "print or draw (--svg) the pipeline schedule of every rank: warm-up, order, peak in flight"},
};

void print_usage(FILE * out) {
    std::fprintf(out, "usage: loom <command> [options]\n\ncommands:\n");
    for (const Command & c : kCommands) {
        std::fprintf(out, "  %-10s %s\n", c.name, c.help);
    }
    std::fprintf(out, "\n`loom <command> --help` (or `loom help <command>`) describes a command's options;\n"
                      "`loom --version` names the version and the backends of this build.\n");
}

// "loom 0.1.0" and a line per backend: what --device can name, and what each sees.
void print_version() {
    std::printf("loom %s\n", LOOM_VERSION);
    std::printf("backends: cpu");
    for (const loom::app::GpuBackend * gpu : {loom::app::cuda_backend(), loom::app::cuda_emu_backend()}) {
        if (gpu != nullptr) std::printf(", %s (%d device(s) visible)", gpu->kind, gpu->device_count());
    }
    std::printf("\n");
}

}  // namespace

// A standard stream the launcher left closed would be the number the first file opened gets, and what is
// printed would land in that file (a checkpoint, the --log-file). Each closed one is held by /dev/null;
// a closed standard output is refused: what it would have shown is lost.
static bool standard_output_is_open() {
    bool stdout_open = true;
    for (int fd : {STDIN_FILENO, STDOUT_FILENO, STDERR_FILENO}) {
        if (fcntl(fd, F_GETFD) != -1 || errno != EBADF) continue;
        const int held = open("/dev/null", fd == STDIN_FILENO ? O_RDONLY : O_WRONLY);
        if (held != fd && held >= 0) close(held);
        if (fd == STDOUT_FILENO) stdout_open = false;
    }
    return stdout_open;
}

int main(int argc, char ** argv) {
    if (!standard_output_is_open()) {
        std::fprintf(stderr, "loom: standard output is closed: what this command prints would be lost\n"
                             "  HINT: redirect it to a file, or to /dev/null to discard it\n");
        return 1;
    }
    if (argc < 2 || std::strcmp(argv[1], "--help") == 0 || std::strcmp(argv[1], "-h") == 0 ||
        (std::strcmp(argv[1], "help") == 0 && argc == 2)) {
        print_usage(argc < 2 ? stderr : stdout);
        return argc < 2 ? loom::app::kExitBadInput : 0;
    }
    if (std::strcmp(argv[1], "--version") == 0 || std::strcmp(argv[1], "version") == 0) {
        print_version();
        return 0;
    }
    if (std::strcmp(argv[1], "help") == 0 && std::strcmp(argv[2], "flags") == 0) {
        try {
            return loom::app::cmd_help_flags(argc - 2, argv + 2);
        } catch (const std::exception & e) {
            std::fprintf(stderr, "loom help flags: %s\n", e.what());
            return loom::app::kExitBadInput;
        }
    }
    if (std::strcmp(argv[1], "help") == 0) {   // `loom help train` is `loom train --help`
        char   help_flag[] = "--help";
        char * args[]      = {argv[2], help_flag, nullptr};
        for (const Command & c : kCommands) {
            if (std::strcmp(argv[2], c.name) == 0) return c.run(2, args);
        }
        std::fprintf(stderr, "loom help: unknown command '%s'\n\n", argv[2]);
        print_usage(stderr);
        return loom::app::kExitBadInput;
    }
    for (const Command & c : kCommands) {
        if (std::strcmp(argv[1], c.name) == 0) {
            try {
                const int status = c.run(argc - 1, argv + 1);
                // What the command printed is part of its result: a standard output that is full or closed
                // fails the command (coreutils' rule) rather than exiting 0 with the output lost.
                loom::check_written(stdout, "standard output",
                                    "standard output is full, closed or gone: redirect it to a file on a file "
                                    "system with space");
                return status;
            } catch (const loom::train::RerunExit & e) {   // the rerun state machine's decision (train/rerun.h)
                std::fprintf(stderr, "loom %s: %s\n", c.name, e.what());
                return e.code();
            } catch (const loom::RunError & e) {
                std::fprintf(stderr, "loom %s: %s\n", c.name, e.what());
                return 1;
            } catch (const loom::Error & e) {
                std::fprintf(stderr, "loom %s: %s\n", c.name, e.what());
                return loom::app::kExitBadInput;
            } catch (const std::exception & e) {
                std::fprintf(stderr, "loom %s: %s\n", c.name, e.what());
                return 1;
            }
        }
    }
    std::fprintf(stderr, "loom: unknown command '%s'\n\n", argv[1]);
    print_usage(stderr);
    return loom::app::kExitBadInput;
}
