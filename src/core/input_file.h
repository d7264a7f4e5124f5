// Inputs are regular files, opened so that nothing about the path can hang or mislead a reader. Opening a
// FIFO for reading blocks until a writer appears (forever, when none will), and a folder or a device given
// where a file belongs makes readers fail far from the cause. Every reader of a user-given path opens it
// here: the open itself is non-blocking, and the check is made on the descriptor that is then read (fstat),
// so a path swapped for a FIFO between a check and an open cannot slip through.
#pragma once

#include <cstdio>
#include <memory>
#include <string>

namespace loom {

struct FileCloser {
    void operator()(std::FILE * f) const noexcept {
        if (f != nullptr) std::fclose(f);
    }
};
using InputStream = std::unique_ptr<std::FILE, FileCloser>;

// Opens `path` for reading (O_RDONLY | O_NONBLOCK | O_CLOEXEC), refuses anything that is not a regular file
// (a FIFO, socket, device or folder), then restores blocking reads. Returns the descriptor, which the caller
// owns. Errors throw loom::Error naming `what` (e.g. "--text-file") and the path.
int open_input_fd(const std::string & path, const std::string & what);

// The same, as a buffered stream ("rb").
InputStream open_input_file(const std::string & path, const std::string & what);

// The whole file.
std::string read_input_file(const std::string & path, const std::string & what);

// Reads one line (without its '\n') from `in`; false at the end of the file.
bool read_line(std::FILE * in, std::string & line);

}  // namespace loom
