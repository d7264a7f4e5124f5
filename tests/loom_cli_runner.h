// Runs the built `loom` command (LOOM_CLI_PATH, set by CMake) through the shell and captures its output,
// for tests of the command line. `redirect` picks the stream captured: "2>&1" both, "2>/dev/null" stdout,
// "2>&1 >/dev/null" stderr.
#pragma once

#include <gtest/gtest.h>

#include <array>
#include <cstdio>
#include <string>
#include <sys/wait.h>

struct CliRun {
    int         status;   // exit status, -1 if killed
    std::string out;
};

// Runs a shell command line and captures its output.
inline CliRun run_command(const std::string & command) {
    FILE *      pipe    = popen(command.c_str(), "r");
    EXPECT_NE(pipe, nullptr) << command;
    std::string            out;
    std::array<char, 4096> buffer;
    size_t                 n;
    while (pipe && (n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
    int status = pipe ? pclose(pipe) : -1;
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}

// `loom <args>` without its start-of-run plan (LOOM_RUN_PLAN=0: the CPU calibration costs seconds under the
// sanitizers); a test of the plan's figures runs the command itself.
inline CliRun run_loom(const std::string & args, const std::string & redirect = "2>&1") {
    return run_command("LOOM_RUN_PLAN=0 " + std::string(LOOM_CLI_PATH) + " " + args + " " + redirect);
}

#ifdef LOOM_MPIEXEC
// `loom <args>` under mpirun on np ranks (np 1: without mpirun); `env` prefixes the command line
// ("NAME=value ..."). The MPI environment comes from ctest (LOOM_MPI_ENV in tests/CMakeLists.txt).
inline CliRun run_loom_mpi(int np, const std::string & args, const std::string & env = "") {
    if (np == 1) return run_command("LOOM_RUN_PLAN=0 " + env + " " + LOOM_CLI_PATH + " " + args + " 2>&1");
    return run_command("LOOM_RUN_PLAN=0 " + env + " " + LOOM_MPIEXEC + " --oversubscribe -x LOOM_RUN_PLAN -np " +
                       std::to_string(np) + " " + LOOM_CLI_PATH + " " + args + " 2>&1");
}
#endif
