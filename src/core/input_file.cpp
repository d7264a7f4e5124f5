#include "core/input_file.h"

#include "core/error.h"

#include <cerrno>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

namespace loom {

namespace {

const char * kind_of(mode_t mode) {
    if (S_ISDIR(mode)) return "a folder";
    if (S_ISFIFO(mode)) return "a FIFO (named pipe)";
    if (S_ISSOCK(mode)) return "a socket";
    if (S_ISCHR(mode) || S_ISBLK(mode)) return "a device";
    return "not a regular file";
}

}  // namespace

void require_regular_file(const std::string & path, const std::string & what) {
    struct stat st {};
    LOOM_CHECK(::stat(path.c_str(), &st) == 0, "cannot read " << what << " '" << path << "': " << std::strerror(errno),
               "check the path and its permissions");
    LOOM_CHECK(S_ISREG(st.st_mode), what << " '" << path << "' is " << kind_of(st.st_mode) << ", not a regular file",
               "Loom reads its inputs from files; write the stream to a file first");
    LOOM_CHECK(::access(path.c_str(), R_OK) == 0, "cannot read " << what << " '" << path << "': " << std::strerror(errno),
               "check the file's permissions");
}

}  // namespace loom
