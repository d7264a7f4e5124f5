#include "data/mapped_file.h"

#include "core/error.h"
#include "core/input_file.h"

#include <atomic>
#include <cerrno>
#include <csignal>
#include <cstdlib>
#include <cstring>
#include <fcntl.h>
#include <mutex>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::data {

namespace {

// Mapped files, for the SIGBUS handler: a file truncated by another process while it is mapped turns a read
// of its lost pages into SIGBUS. The handler names the file and exits 2 instead of dying with a signal.
// Slots are claimed under a mutex and read by the handler without one (each field is an atomic).
struct MappedRange {
    std::atomic<const uint8_t *> begin{nullptr};
    std::atomic<size_t>          size{0};
    std::atomic<const char *>    path{nullptr};
};
constexpr int           kMaxRanges = 256;
MappedRange             g_ranges[kMaxRanges];
std::mutex              g_ranges_mutex;
struct sigaction        g_previous_sigbus {};

void on_sigbus(int signal, siginfo_t * info, void * context) {
    const auto * at = static_cast<const uint8_t *>(info->si_addr);
    for (const MappedRange & r : g_ranges) {
        const uint8_t * begin = r.begin.load();
        if (begin != nullptr && at >= begin && at < begin + r.size.load()) {
            const char * path = r.path.load();
            const char   head[] = "loom: the file '";
            const char   tail[] = "' became shorter while Loom read it (another process truncated or rewrote it); "
                                  "stopping\n";
            (void)!::write(2, head, sizeof(head) - 1);
            (void)!::write(2, path, std::strlen(path));
            (void)!::write(2, tail, sizeof(tail) - 1);
            ::_exit(2);
        }
    }
    // Not one of ours: whatever was there before (the default: die with SIGBUS).
    if (g_previous_sigbus.sa_flags & SA_SIGINFO) {
        g_previous_sigbus.sa_sigaction(signal, info, context);
    } else if (g_previous_sigbus.sa_handler != SIG_IGN && g_previous_sigbus.sa_handler != SIG_DFL) {
        g_previous_sigbus.sa_handler(signal);
    } else {
        ::signal(SIGBUS, SIG_DFL);
        ::raise(SIGBUS);
    }
}

void register_range(const uint8_t * begin, size_t size, const std::string & path) {
    std::lock_guard<std::mutex> lock(g_ranges_mutex);
    static bool installed = [] {
        struct sigaction action {};
        action.sa_sigaction = on_sigbus;
        action.sa_flags     = SA_SIGINFO;
        sigemptyset(&action.sa_mask);
        return ::sigaction(SIGBUS, &action, &g_previous_sigbus) == 0;
    }();
    (void)installed;
    for (MappedRange & r : g_ranges) {
        if (r.begin.load() == nullptr) {
            r.path.store(strdup(path.c_str()));
            r.size.store(size);
            r.begin.store(begin);
            return;
        }
    }   // more than kMaxRanges files mapped at once: this one is read without the named message
}

void unregister_range(const uint8_t * begin) {
    std::lock_guard<std::mutex> lock(g_ranges_mutex);
    for (MappedRange & r : g_ranges) {
        if (r.begin.load() == begin) {
            r.begin.store(nullptr);
            std::free(const_cast<char *>(r.path.exchange(nullptr)));
            return;
        }
    }
}

}  // namespace

MappedFile::MappedFile(const std::string & path, const std::string & what) : path_(path) {
    int         fd = open_input_fd(path, what);
    struct stat st {};
    if (::fstat(fd, &st) != 0) {
        int err = errno;
        ::close(fd);
        LOOM_THROW("cannot stat " << what << " '" << path << "': " << std::strerror(err), "check the file");
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
        register_range(data_, size_, path);
    } else {
        ::close(fd);
    }
}

MappedFile::~MappedFile() {
    if (data_ != nullptr) {
        unregister_range(data_);
        ::munmap(const_cast<uint8_t *>(data_), size_);
    }
}

}  // namespace loom::data
