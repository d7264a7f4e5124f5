#include "train/progress_log.h"

#include "core/error.h"

#include <cstdio>
#include <cstdlib>
#include <ctime>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <vector>

namespace loom::train {

namespace {

std::string path_of(const std::string & save) { return (std::filesystem::path(save) / "progress.txt").string(); }

std::string now_text() {
    const std::time_t t = std::time(nullptr);
    std::tm           local{};
    localtime_r(&t, &local);
    char text[32];
    std::strftime(text, sizeof(text), "%Y-%m-%d %H:%M:%S", &local);
    return text;
}

// The field "<name>: <value>" of a tab-separated line, or "" without it.
std::string field(const std::string & line, const std::string & name) {
    std::stringstream cells(line);
    for (std::string cell; std::getline(cells, cell, '\t');) {
        if (cell.rfind(name + ": ", 0) == 0) return cell.substr(name.size() + 2);
    }
    return "";
}

}  // namespace

void append_progress(const std::string & save, int world, const std::string & message) {
    std::error_code ec;
    std::filesystem::create_directories(save, ec);
    const char * job = std::getenv("SLURM_JOB_ID");
    std::ofstream out(path_of(save), std::ios::app);
    out << now_text() << "\tJob ID: " << (job ? job : "") << "\t# GPUs: " << world << "\t" << message << "\n";
    out.flush();
    LOOM_CHECK(out.good(), "--log-progress: cannot append to '" << path_of(save) << "'", "check the --save folder");
}

std::string saved_checkpoint_message(const std::string & save, int world, int64_t iteration, double flops,
                                     double job_flops, double job_seconds, double tokens, bool async) {
    // The cumulative start: the first "Starting job" after which every line has this world size, and the
    // operations of the last save before it.
    std::ifstream            in(path_of(save));
    std::vector<std::string> lines;
    for (std::string line; std::getline(in, line);) lines.push_back(line);
    std::string start_time;
    double      start_flops = 0;
    for (size_t i = lines.size(); i-- > 0;) {
        if (field(lines[i], "# GPUs") != std::to_string(world)) break;
        if (lines[i].size() >= 12 && lines[i].compare(lines[i].size() - 12, 12, "Starting job") == 0) {
            start_time  = lines[i].substr(0, 19);
            start_flops = 0;
            for (size_t j = i; j-- > 0;) {
                const std::string f = field(lines[j], "Floating-point operations");
                if (!f.empty()) {
                    start_flops = std::strtod(f.c_str(), nullptr);
                    break;
                }
            }
        }
    }
    double elapsed = job_seconds;
    if (!start_time.empty()) {
        std::tm tm{};
        if (strptime(start_time.c_str(), "%Y-%m-%d %H:%M:%S", &tm) != nullptr) {
            tm.tm_isdst = -1;
            elapsed     = std::max(job_seconds, std::difftime(std::time(nullptr), std::mktime(&tm)));
        }
    }
    auto per_gpu = [world](double ops, double seconds) { return seconds > 0 ? ops / (seconds * 1e12 * world) : 0.0; };
    char text[512];
    std::snprintf(text, sizeof(text),
                  "%s\tIteration: %lld\tJob throughput: %.1f TFLOP/s/GPU\tCumulative throughput: %.1f TFLOP/s/GPU\t"
                  "Floating-point operations: %.2e\tTokens (in billions): %.2f",
                  async ? "Saving async checkpoint" : "Saved checkpoint", static_cast<long long>(iteration),
                  per_gpu(job_flops, job_seconds), per_gpu(flops - start_flops, elapsed), flops, tokens / 1e9);
    return text;
}

}  // namespace loom::train
