#include "data/mapped_file.h"

#include "core/error.h"
#include "core/input_file.h"

#include <cerrno>
#include <fcntl.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::data {

MappedFile::MappedFile(const std::string & path, const std::string & what) : path_(path) {
    require_regular_file(path, what);
    int fd = ::open(path.c_str(), O_RDONLY | O_CLOEXEC);
    LOOM_CHECK(fd >= 0, "cannot open " << what << " '" << path << "': " << std::strerror(errno),
               "check that the file exists and is readable");
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        LOOM_THROW("cannot stat " << what << " '" << path << "': " << std::strerror(err), "check the file");
    }
    if (!S_ISREG(st.st_mode)) {
        ::close(fd);
        LOOM_THROW(what << " '" << path << "' is not a regular file", "pass the path of a file, not a directory");
    }
    size_ = static_cast<size_t>(st.st_size);
    if (size_ > 0) {
        void * p = ::mmap(nullptr, size_, PROT_READ, MAP_SHARED, fd, 0);
        int    err = errno;
        ::close(fd);
        LOOM_CHECK(p != MAP_FAILED, "cannot map " << what << " '" << path << "' (" << size_ << " bytes) into memory: "
                                                  << std::strerror(err),
                   "check the address-space limit (ulimit -v) and that the file system supports mmap");
        data_ = static_cast<const uint8_t *>(p);
    } else {
        ::close(fd);
    }
}

MappedFile::~MappedFile() {
    if (data_ != nullptr) {
        ::munmap(const_cast<uint8_t *>(data_), size_);
    }
}

}  // namespace loom::data
