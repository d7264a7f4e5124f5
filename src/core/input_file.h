// Inputs are regular files. Opening a FIFO for reading blocks until a writer appears (forever, when none
// will), and a folder or a device given where a file belongs makes readers fail far from the cause; every
// reader of a user-given path calls this first, so the error names the file and what it was meant to be.
#pragma once

#include <string>

namespace loom {

// Throws loom::Error naming `what` (e.g. "--text-file") and `path` when the path does not exist, cannot be
// read, or is not a regular file (a FIFO, socket, device or folder). Does not open the file.
void require_regular_file(const std::string & path, const std::string & what);

}  // namespace loom
