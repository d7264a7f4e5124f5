#include "core/input_file.h"

#include "core/error.h"

#include <cerrno>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
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

int open_input_fd(const std::string & path, const std::string & what) {
    int fd = ::open(path.c_str(), O_RDONLY | O_NONBLOCK | O_CLOEXEC);
    LOOM_CHECK(fd >= 0, "cannot read " << what << " '" << path << "': " << std::strerror(errno),
               "check the path and its permissions");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        LOOM_THROW("cannot stat " << what << " '" << path << "': " << std::strerror(err), "check the file");
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        LOOM_THROW(what << " '" << path << "' is " << kind_of(st.st_mode) << ", not a regular file",
                   "Loom reads its inputs from files; write the stream to a file first");
    }
    int flags = ::fcntl(fd, F_GETFL);
    if (flags < 0 || ::fcntl(fd, F_SETFL, flags & ~O_NONBLOCK) != 0) {
        int err = errno;
        ::close(fd);
        LOOM_THROW("cannot read " << what << " '" << path << "': " << std::strerror(err), "check the file");
    }
    return fd;
}

InputStream open_input_file(const std::string & path, const std::string & what) {
    int          fd = open_input_fd(path, what);
    std::FILE * f  = ::fdopen(fd, "rb");
    if (f == nullptr) {
        int err = errno;
        ::close(fd);
        LOOM_THROW("cannot read " << what << " '" << path << "': " << std::strerror(err), "check the file");
    }
    return InputStream(f);
}

std::string read_input_file(const std::string & path, const std::string & what) {
    InputStream in = open_input_file(path, what);
    std::string text;
    char        buffer[1 << 16];
    size_t      n;
    while ((n = std::fread(buffer, 1, sizeof(buffer), in.get())) > 0) text.append(buffer, n);
    LOOM_CHECK(!std::ferror(in.get()), "error reading " << what << " '" << path << "': " << std::strerror(errno),
               "check the file and the device it is on");
    return text;
}

bool read_line(std::FILE * in, std::string & line) {
    char *  buffer   = nullptr;
    size_t  capacity = 0;
    ssize_t n        = ::getline(&buffer, &capacity, in);
    if (n >= 0) line.assign(buffer, static_cast<size_t>(n));
    std::free(buffer);
    if (n < 0) return false;
    if (!line.empty() && line.back() == '\n') line.pop_back();
    return true;
}

}  // namespace loom
