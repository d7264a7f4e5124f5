#include "core/atomic_file.h"

#include "core/error.h"

#include <cerrno>
#include <cstring>
#include <fcntl.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom {

void check_written(std::FILE * file, const std::string & what, const std::string & hint) {
    if (std::fflush(file) == 0 && !std::ferror(file)) return;
    const int err = errno;
    std::clearerr(file);   // a caller that goes on writing elsewhere does not see this failure again
    throw OutputError(detail::concat("cannot write ", what, ": ", std::strerror(err)), hint, __FILE__, __LINE__);
}

std::FILE * open_for_writing(const std::string & path) {
    const int fd = ::open(path.c_str(), O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0644);
    if (fd < 0) return nullptr;
    std::FILE * f = ::fdopen(fd, "wb");
    if (f == nullptr) {
        const int err = errno;
        ::close(fd);
        errno = err;
    }
    return f;
}

AtomicFile::AtomicFile(const std::string & path)
    : path_(path), tmp_(path + ".tmp." + std::to_string(::getpid())), file_(open_for_writing(tmp_)) {
    LOOM_CHECK(file_ != nullptr, "cannot create '" << tmp_ << "': " << (errno == ELOOP ? "it is a symbolic link" : std::strerror(errno)),
               "check that the output folder exists and is writable");
}

AtomicFile::~AtomicFile() {
    if (file_ != nullptr) std::fclose(file_);
    if (!committed_) std::remove(tmp_.c_str());
}

void AtomicFile::write(const void * data, size_t bytes) {
    if (bytes != 0 && std::fwrite(data, 1, bytes, file_) != bytes) {
        LOOM_THROW("cannot write " << bytes << " bytes to '" << tmp_ << "': " << std::strerror(errno),
                   "check the free space and permissions of the output folder");
    }
}

void AtomicFile::commit() {
    LOOM_CHECK(file_ != nullptr, "commit() of '" << path_ << "' twice", "");
    bool ok  = std::fflush(file_) == 0 && ::fsync(fileno(file_)) == 0;
    int  err = errno;
    ok       = std::fclose(file_) == 0 && ok;
    file_    = nullptr;
    LOOM_CHECK(ok, "cannot write '" << tmp_ << "': " << std::strerror(err), "check the free space of the output folder");
    rename_into_place(tmp_, path_);
    committed_ = true;
}

void write_file_atomically(const std::string & path, std::string_view bytes) {
    AtomicFile file(path);
    file.write(bytes.data(), bytes.size());
    file.commit();
}

void rename_into_place(const std::string & tmp, const std::string & path) {
    struct stat st;
    if (::stat(path.c_str(), &st) == 0 && !S_ISREG(st.st_mode)) {
        std::remove(tmp.c_str());
        LOOM_THROW("'" << path << "' exists and is not a regular file ("
                       << (S_ISDIR(st.st_mode) ? "a folder" : S_ISFIFO(st.st_mode) ? "a FIFO" : "a device or special file")
                       << "); Loom does not replace it",
                   "write the output to a regular file path");
    }
    if (std::rename(tmp.c_str(), path.c_str()) != 0) {
        int err = errno;
        std::remove(tmp.c_str());
        LOOM_THROW("cannot rename '" << tmp << "' to '" << path << "': " << std::strerror(err),
                   "check the permissions of the output folder");
    }
    // The rename itself is durable once the folder is.
    size_t      slash  = path.find_last_of('/');
    std::string folder = slash == std::string::npos ? "." : slash == 0 ? "/" : path.substr(0, slash);
    int         fd     = ::open(folder.c_str(), O_RDONLY | O_DIRECTORY);
    if (fd >= 0) {
        ::fsync(fd);
        ::close(fd);
    }
}

}  // namespace loom
