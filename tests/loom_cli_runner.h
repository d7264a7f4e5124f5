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

inline CliRun run_loom(const std::string & args, const std::string & redirect = "2>&1") {
    std::string command = std::string(LOOM_CLI_PATH) + " " + args + " " + redirect;
    FILE *      pipe    = popen(command.c_str(), "r");
    EXPECT_NE(pipe, nullptr) << command;
    std::string            out;
    std::array<char, 4096> buffer;
    size_t                 n;
    while (pipe && (n = fread(buffer.data(), 1, buffer.size(), pipe)) > 0) out.append(buffer.data(), n);
    int status = pipe ? pclose(pipe) : -1;
    return {WIFEXITED(status) ? WEXITSTATUS(status) : -1, out};
}
