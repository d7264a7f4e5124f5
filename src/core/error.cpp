#include "core/error.h"

#include <atomic>
#include <cstdlib>

namespace loom {

namespace {

int rank_from_environment() {
    for (const char * name : {"OMPI_COMM_WORLD_RANK", "RANK", "PMI_RANK", "SLURM_PROCID"}) {
        if (const char * value = std::getenv(name)) {
            return std::atoi(value);
        }
    }
    return -1;
}

std::atomic<int> & rank_slot() {
    static std::atomic<int> rank{rank_from_environment()};
    return rank;
}

std::string format(const std::string & message, const std::string & hint, const char * file, int line,
                   int rank) {
    std::ostringstream os;
    if (rank >= 0) {
        os << "[rank " << rank << "] ";
    }
    os << file << ":" << line << ": " << message;
    if (!hint.empty()) {
        os << "\n  HINT: " << hint;
    }
    return os.str();
}

}  // namespace

int  process_rank() { return rank_slot().load(); }
void set_process_rank(int rank) { rank_slot().store(rank); }

namespace {
std::atomic<int> & logging_threshold() {
    static std::atomic<int> level{kLogInfo};
    return level;
}
}  // namespace

void set_logging_level(int level) { logging_threshold().store(level); }
bool logging_enabled(int level) { return level >= logging_threshold().load(); }

Error::Error(std::string message, std::string hint, const char * file, int line)
    : std::runtime_error(format(message, hint, file, line, process_rank())),
      message_(std::move(message)),
      hint_(std::move(hint)),
      file_(file),
      line_(line),
      rank_(process_rank()) {}

}  // namespace loom
