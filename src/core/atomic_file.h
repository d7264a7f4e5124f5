// Writing a file so that a crash or a kill at any instant leaves either the old file or the new one, never
// a half-written one: write <path>.tmp.<pid>, flush and fsync it, rename it over <path>, fsync the folder.
// Every writer of user-visible output (safetensors, llm.c shards, Megatron .bin/.idx, timelines) goes
// through here.
//
// The rename is refused when <path> exists and is not a regular file: renaming over /dev/full, a FIFO or
// a folder would replace it (as root, a device node), so the error names the path instead.
#pragma once

#include "core/error.h"

#include <cstddef>
#include <cstdio>
#include <string>
#include <string_view>

namespace loom {

// A stream of a run's output (standard output, --log-file, TensorBoard's events) could not be written: a
// full disk, a closed or vanished stream. A failure of the run (exit status 1), not of its input.
class OutputError : public RunError {
public:
    using RunError::RunError;
};

// Flushes `file` and throws OutputError naming `what` ("standard output", "--log-file 'x'") when the flush
// or an earlier write into it failed; `hint` says what the user can do.
void check_written(std::FILE * file, const std::string & what, const std::string & hint);

class AtomicFile {
public:
    // Creates <path>.tmp.<pid>; throws naming it when it cannot.
    explicit AtomicFile(const std::string & path);
    // Without commit(), the temporary file is removed and <path> is left as it was.
    ~AtomicFile();
    AtomicFile(const AtomicFile &)             = delete;
    AtomicFile & operator=(const AtomicFile &) = delete;

    void write(const void * data, size_t bytes);
    // Flushes, fsyncs, closes and renames into place (rename_into_place).
    void commit();

    const std::string & path() const { return path_; }
    const std::string & temporary_path() const { return tmp_; }

private:
    std::string path_, tmp_;
    std::FILE * file_;
    bool        committed_ = false;
};

// fopen(path, "wb") that refuses to write through a symbolic link (O_NOFOLLOW: errno ELOOP when the last
// component is one); nullptr and errno on failure. Every file Loom writes is opened through here.
std::FILE * open_for_writing(const std::string & path);

// The whole of `bytes` as <path>, atomically.
void write_file_atomically(const std::string & path, std::string_view bytes);

// Renames the finished temporary file `tmp` over `path` (refusing a `path` that exists and is not a
// regular file, and removing `tmp` then), then fsyncs path's folder.
void rename_into_place(const std::string & tmp, const std::string & path);

}  // namespace loom
