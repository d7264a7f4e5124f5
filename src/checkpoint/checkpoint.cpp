#include "checkpoint/checkpoint.h"

#include <cstdint>

#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "core/error.h"
#include "core/input_file.h"
#include "core/json_checks.h"
#include "io/safetensors.h"

#include <algorithm>
#include <array>
#include <chrono>
#include <cmath>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <ctime>
#include <fcntl.h>
#include <filesystem>
#include <fstream>
#include <atomic>
#include <memory>
#include <thread>
#include <set>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::checkpoint {

namespace fs = std::filesystem;
using json   = nlohmann::json;

std::string iteration_folder(int64_t iteration) {
    char name[32];
    std::snprintf(name, sizeof(name), "iter_%07lld", static_cast<long long>(iteration));
    return name;
}

namespace {

std::string hex32(uint32_t v) {
    char s[16];
    std::snprintf(s, sizeof(s), "%08x", v);
    return s;
}

std::string rank_file(int rank, const char * extension) {
    char name[64];
    std::snprintf(name, sizeof(name), "rank_%05d.%s", rank, extension);
    return name;
}

std::string entry_name(const std::string & tensor, int64_t begin, const char * kind) {
    return tensor + ":" + std::to_string(begin) + ":" + kind;
}

// The test seam of the top of checkpoint.h: SIGKILL at the k-th point.
void kill_point() {
    static const long kill_at = [] {
        const char * v = std::getenv("LOOM_CHECKPOINT_KILL_AT");
        return v ? std::strtol(v, nullptr, 10) : 0L;
    }();
    static std::atomic<long> count{0};   // the writer thread of --async-save counts too
    if (kill_at > 0 && ++count == kill_at) {
        std::fflush(nullptr);
        std::raise(SIGKILL);
    }
}

void barrier(comm::Communicator * world) {
    if (world && world->size() > 1) world->barrier()->wait();
}

void fsync_folder(const std::string & path) {
    int fd = ::open(path.c_str(), O_RDONLY | O_DIRECTORY);
    LOOM_CHECK(fd >= 0, "cannot open folder '" << path << "' to flush it: " << std::strerror(errno), "");
    int rc = ::fsync(fd);
    ::close(fd);
    LOOM_CHECK(rc == 0, "cannot flush folder '" << path << "': " << std::strerror(errno), "");
}

// Calls fn(local_offset, full_offset, length) for the contiguous runs that elements [begin, end) of a
// piece's TP part occupy in the full tensor of shape `full` (row-major): model::tp_slice_runs, clipped.
template <typename Fn>
void for_each_run(const Piece & p, const Shape & full, Fn && fn) {
    if (p.begin >= p.end) return;
    if (p.tp_dim < 0) {
        fn(p.begin, p.begin, p.end - p.begin);
        return;
    }
    model::tp_slice_runs(model::TpSlice{p.tp_dim, p.tp_ranges, full, p.tp_outer}, [&](int64_t local, int64_t at, int64_t n) {
        const int64_t lo = std::max(p.begin, local), hi = std::min(p.end, local + n);
        if (lo < hi) fn(lo, at + (lo - local), hi - lo);
    });
}

// --- writing --------------------------------------------------------------------------------------------

struct WriteEntry {
    std::string name;
    std::string dtype;   // "F32" / "BF16" / "F16"
    int64_t     numel = 0;
    Tensor      values;   // any memory: read through host_readable as it is written, one entry at a time
};

struct RankPiece {
    model::Parameter * param;
    int64_t            begin, end;
    int                slot;
};

// Streams the entries as one safetensors file through the atomic writer; returns its size and CRC-32C.
FileRecord write_shard(const std::string & path, const std::vector<WriteEntry> & entries) {
    json     header = json::object();
    uint64_t offset = 0;
    for (const WriteEntry & e : entries) {
        const uint64_t bytes = static_cast<uint64_t>(e.numel) * (e.dtype == "F32" ? 4u : 2u);
        header[e.name]       = {{"dtype", e.dtype}, {"shape", {e.numel}}, {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
    }
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');
    const uint64_t length = text.size();
    AtomicFile     file(path);
    FileRecord     record;
    auto put = [&](const void * data, size_t bytes) {
        file.write(data, bytes);
        record.crc32c = crc32c(data, bytes, record.crc32c);
        record.bytes += bytes;
    };
    put(&length, 8);
    put(text.data(), text.size());
    kill_point();
    for (size_t i = 0; i < entries.size(); ++i) {
        const WriteEntry & e = entries[i];
        const Tensor host = host_readable(e.values);   // on a GPU one entry's pinned copy at a time
        put(host.data_ptr(), static_cast<size_t>(e.numel) * (e.dtype == "F32" ? 4u : 2u));
        if (i == entries.size() / 2) kill_point();
    }
    file.commit();
    kill_point();
    return record;
}

json tp_ranges_json(const std::vector<std::pair<int64_t, int64_t>> & ranges) {
    json r = json::array();
    for (auto [a, b] : ranges) r.push_back({a, b});
    return r;
}

// Where optimizer slot i starts in its parameter's elements.
int64_t slot_offset(optim::Optimizer & opt, int i, const model::Parameter &) {
    return opt.slot_offsets()[static_cast<size_t>(i)];
}

// This rank's pieces: its optimizer's slots over the parameters it writes (see the top of checkpoint.h).
std::vector<RankPiece> rank_pieces(const RankContents & rank) {
    std::vector<RankPiece> pieces;
    if (!rank.optimizer) return pieces;
    optim::Optimizer & opt = *rank.optimizer;
    for (int i = 0; i < opt.state().num_slots(); ++i) {
        model::Parameter * p = opt.params()[static_cast<size_t>(opt.slot_params()[static_cast<size_t>(i)])];
        if (p->shared || p->tp_duplicate || !(p->expert ? rank.writes_experts : rank.writes)) continue;
        const int64_t begin = slot_offset(opt, i, *p);
        pieces.push_back(RankPiece{p, begin, begin + opt.state().slot(i).values.numel(), i});
    }
    return pieces;
}

}  // namespace

SaveFolderLock::SaveFolderLock(const std::string & dir) {
    std::error_code ec;
    fs::create_directories(dir, ec);
    LOOM_CHECK(!ec && fs::is_directory(dir), "cannot create --save folder '" << dir << "': "
                                                 << (ec ? ec.message() : std::string("a file has that name")),
               "give the path of a folder this job can write");
    const std::string path = (fs::path(dir) / kSaveLockFile).string();
    fd_ = ::open(path.c_str(), O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0644);
    LOOM_CHECK(fd_ >= 0, "cannot open the --save folder's lock '" << path << "': "
                             << (errno == ELOOP ? "it is a symbolic link" : std::strerror(errno)),
               "check that the --save folder is writable");
    struct flock lock {};
    lock.l_type   = F_WRLCK;
    lock.l_whence = SEEK_SET;
    if (::fcntl(fd_, F_OFD_SETLK, &lock) != 0) {
        const int err = errno;
        char      holder[256] = {};
        const ssize_t n = ::pread(fd_, holder, sizeof(holder) - 1, 0);
        std::string who(holder, n > 0 ? static_cast<size_t>(n) : 0);
        while (!who.empty() && (who.back() == '\n' || who.back() == '\0')) who.pop_back();
        ::close(fd_);
        fd_ = -1;
        LOOM_CHECK(err != EAGAIN && err != EACCES, "--save folder '" << dir << "' is held by another job ("
                                                       << (who.empty() ? std::string("its holder is not recorded") : who)
                                                       << ")",
                   "give each job its own --save folder, or wait for that job to end");
        LOOM_THROW("cannot lock the --save folder's '" << path << "': " << std::strerror(err),
                   "a file system without locks? give a --save folder on a local or NFS file system");
    }
    char host[128] = "?";
    ::gethostname(host, sizeof(host) - 1);
    const std::time_t now = std::time(nullptr);
    char              since[64];
    std::strftime(since, sizeof(since), "%Y-%m-%d %H:%M:%S", std::localtime(&now));
    const std::string who = detail::concat("pid ", ::getpid(), " on ", host, ", since ", since, "\n");
    if (::ftruncate(fd_, 0) != 0 || ::pwrite(fd_, who.data(), who.size(), 0) != static_cast<ssize_t>(who.size())) {
        // The lock is held either way; only the holder's description is missing.
    }
}

SaveFolderLock::~SaveFolderLock() {
    if (fd_ >= 0) ::close(fd_);
}

// What a save carries from begin_save to finish_save: this rank's entries (snapshots in host memory when
// written in the background), its part of the index, and the writer thread.
struct SaveInProgress::State {
    std::string             dir, final_folder, tmp_folder;
    int64_t                 iteration = 0;
    json                    metadata;
    bool                    with_optimizer = false;
    int64_t                 optimizer_step = 0;
    int                     my_rank = 0, world = 1;
    std::vector<WriteEntry> entries;
    json                    tensors = json::object();
    int64_t                 my_bytes = 0;
    std::chrono::steady_clock::time_point start;
    std::thread             writer;
    std::atomic<bool>       written{false};
    std::exception_ptr      error;

    // Step 2 of the top of checkpoint.h: this rank's shard and its description (no collective: it may run
    // on the writer thread, which touches no device stream: the snapshots are host memory).
    void write() {
        try {
            if (const char * delay = std::getenv("LOOM_CHECKPOINT_WRITE_DELAY_MS")) {   // a test seam: a slow disk
                std::this_thread::sleep_for(std::chrono::milliseconds(std::strtol(delay, nullptr, 10)));
            }
            if (!entries.empty()) {
                FileRecord record = write_shard((fs::path(tmp_folder) / rank_file(my_rank, "safetensors")).string(), entries);
                json       part   = {{"file", rank_file(my_rank, "safetensors")},
                                     {"bytes", record.bytes},
                                     {"crc32c", hex32(record.crc32c)},
                                     {"tensors", tensors}};
                write_file_atomically((fs::path(tmp_folder) / rank_file(my_rank, "json")).string(), part.dump());
                my_bytes = static_cast<int64_t>(record.bytes);
                kill_point();
            }
        } catch (...) {
            error = std::current_exception();
        }
        written.store(true);
    }
};

SaveInProgress::SaveInProgress(std::unique_ptr<State> state) : state_(std::move(state)) {}

SaveInProgress::~SaveInProgress() {
    if (state_ && state_->writer.joinable()) state_->writer.join();   // never committed: the tracker is untouched
}

bool SaveInProgress::written() const { return state_->written.load(); }
int64_t SaveInProgress::iteration() const { return state_->iteration; }

std::unique_ptr<SaveInProgress> begin_save(const std::string & dir, int64_t iteration, const json & metadata,
                                           const RankContents & rank, bool with_optimizer, bool background) {
    auto st            = std::make_unique<SaveInProgress::State>();
    st->start          = std::chrono::steady_clock::now();
    st->dir            = dir;
    st->iteration      = iteration;
    st->metadata       = metadata;
    st->with_optimizer = with_optimizer;
    st->optimizer_step = rank.optimizer ? rank.optimizer->steps() : 0;
    st->my_rank        = rank.world ? rank.world->rank() : 0;
    st->world          = rank.world ? rank.world->size() : 1;
    st->final_folder   = (fs::path(dir) / iteration_folder(iteration)).string();
    st->tmp_folder     = st->final_folder + ".tmp";
    const int my_rank  = st->my_rank;
    if (!rank.params.empty()) rank.params.front()->data.device().compute_stream().synchronize();
    if (my_rank == 0) {
        std::error_code ec;
        fs::create_directories(dir, ec);
        LOOM_CHECK(!ec && fs::is_directory(dir), "cannot create --save folder '" << dir << "': " << ec.message(),
                   "check that the path is a writable folder");
        for (const fs::directory_entry & e : fs::directory_iterator(dir)) {   // left by a killed save
            const std::string name = e.path().filename().string();
            if (e.is_directory() && name.rfind("iter_", 0) == 0 && name.size() > 4 &&
                name.compare(name.size() - 4, 4, ".tmp") == 0) {
                fs::remove_all(e.path(), ec);
            }
        }
        fs::create_directory(st->tmp_folder, ec);
        LOOM_CHECK(!ec, "cannot create checkpoint folder '" << st->tmp_folder << "': " << ec.message(), "");
        kill_point();
    }
    barrier(rank.world);

    // This rank's pieces: in background, copied now into host memory (the "checkpoint" pool), so training
    // may change the model while they are written.
    auto snapshot = [&](const Tensor & t) {
        if (!background) return t;
        Tensor copy = Tensor::empty({t.numel()}, t.dtype(), t.device(), {MemoryKind::pinned_host, "checkpoint"});
        copy_now(copy, t.flatten());
        return copy;
    };
    for (const RankPiece & piece : rank_pieces(rank)) {
        model::Parameter & p     = *piece.param;
        const int64_t      n     = piece.end - piece.begin;
        // FP8 codes (--fp8-param-gather) save their f32 main values, what the optimizer's slot holds.
        const DType        dtype = p.fp8_codes() ? DType::f32 : p.data.dtype();
        LOOM_CHECK(dtype == DType::f32 || dtype_is_half(dtype),
                   "checkpoint of parameter " << p.name << " in " << dtype_name(dtype), "");
        const char * values_dtype = dtype == DType::f32 ? "F32" : dtype == DType::bf16 ? "BF16" : "F16";
        st->entries.push_back(WriteEntry{entry_name(p.name, piece.begin, "values"), values_dtype, n,
                                         snapshot(rank.optimizer->state().slot(piece.slot).values)});
        if (with_optimizer) {
            optim::HybridSlotState slot = rank.optimizer->state().slot_state(piece.slot);
            if (dtype != DType::f32) {
                st->entries.push_back(WriteEntry{entry_name(p.name, piece.begin, "master"), "F32", n, snapshot(slot.master)});
            }
            st->entries.push_back(WriteEntry{entry_name(p.name, piece.begin, "exp_avg"), "F32", n, snapshot(slot.exp_avg)});
            // A Muon matrix has no second moment: zeros keep every tensor's entries alike (and load as none).
            const Tensor v = slot.exp_avg_sq.defined() ? snapshot(slot.exp_avg_sq)
                                                       : Tensor::zeros({n}, DType::f32, slot.exp_avg.device(),
                                                                       {MemoryKind::pinned_host, "checkpoint"});
            st->entries.push_back(WriteEntry{entry_name(p.name, piece.begin, "exp_avg_sq"), "F32", n, v});
        }
        const model::TpSlice & slice = p.tp_slice;
        json &                 t     = st->tensors[p.name];
        if (t.is_null()) {
            t = {{"shape", slice.dim < 0 ? p.data.shape() : slice.full_shape}, {"dtype", values_dtype},
                 {"pieces", json::array()}};
        }
        json piece_json = {{"file", rank_file(my_rank, "safetensors")}, {"tp_dim", slice.dim},
                           {"tp_ranges", tp_ranges_json(slice.ranges)}, {"local_shape", p.data.shape()},
                           {"range", {piece.begin, piece.end}}};
        if (slice.dim >= 1 && slice.outer.second >= 0) piece_json["tp_outer"] = {slice.outer.first, slice.outer.second};
        t["pieces"].push_back(piece_json);
    }
    for (const Buffer & b : rank.writes_buffers ? rank.buffers : std::vector<Buffer>{}) {
        LOOM_CHECK(b.data.dtype() == DType::f32, "checkpoint of buffer " << b.name << " in " << dtype_name(b.data.dtype()), "");
        st->entries.push_back(WriteEntry{entry_name(b.name, 0, "values"), "F32", b.data.numel(), snapshot(b.data)});
        st->tensors[b.name] = {{"shape", b.data.shape()}, {"dtype", "F32"},
                               {"pieces", json::array({{{"file", rank_file(my_rank, "safetensors")}, {"tp_dim", -1},
                                                        {"tp_ranges", json::array()}, {"local_shape", b.data.shape()},
                                                        {"range", {0, b.data.numel()}}}})}};
    }
    SaveInProgress::State * raw = st.get();
    if (background) {
        raw->writer = std::thread([raw] { raw->write(); });
    } else {
        raw->write();
    }
    return std::unique_ptr<SaveInProgress>(new SaveInProgress(std::move(st)));
}

SaveStats finish_save(SaveInProgress & save, comm::Communicator * world) {
    SaveInProgress::State & st = *save.state_;
    if (st.writer.joinable()) st.writer.join();
    // A rank whose shard could not be written stops here, naming the file; its exit ends the job before
    // rank 0 commits anything (the others wait at the barrier below).
    if (st.error) std::rethrow_exception(st.error);
    const int my_rank = st.my_rank, world_size = st.world;
    const std::string & tmp_folder = st.tmp_folder, & final_folder = st.final_folder, & dir = st.dir;
    barrier(world);

    // 3. Rank 0 merges, commits the folder, then the tracker.
    int64_t index_bytes = 0;
    if (my_rank == 0) {
        json index = {{"format", "loom-checkpoint"},
                      {"version", kFormatVersion},
                      {"iteration", st.iteration},
                      {"metadata", st.metadata},
                      {"optimizer", {{"saved", st.with_optimizer}, {"step", st.optimizer_step}}},
                      {"files", json::object()},
                      {"tensors", json::object()}};
        std::vector<std::string> parts;
        for (int r = 0; r < world_size; ++r) {
            const std::string part_path = (fs::path(tmp_folder) / rank_file(r, "json")).string();
            if (!fs::exists(part_path)) continue;   // a rank with nothing to write
            std::ifstream in(part_path);
            json          part = json::parse(in, json_parse_checks<json>("'" + part_path + "'"));
            index["files"][part["file"].get<std::string>()] = {{"bytes", part["bytes"]}, {"crc32c", part["crc32c"]}};
            for (auto & [name, t] : part["tensors"].items()) {
                json & merged = index["tensors"][name];
                if (merged.is_null()) {
                    merged = t;
                } else {
                    for (json & piece : t["pieces"]) merged["pieces"].push_back(piece);
                }
            }
            parts.push_back(part_path);
        }
        const std::string text = index.dump(1);
        write_file_atomically((fs::path(tmp_folder) / kIndexFile).string(), text);
        index_bytes = static_cast<int64_t>(text.size());
        kill_point();
        for (const std::string & part : parts) fs::remove(part);
        fsync_folder(tmp_folder);
        kill_point();
        std::error_code ec;
        if (fs::exists(final_folder)) {   // saved again at the same iteration: the new one replaces it
            const std::string old = final_folder + ".old";
            fs::remove_all(old, ec);
            fs::rename(final_folder, old, ec);
            LOOM_CHECK(!ec, "cannot move the earlier '" << final_folder << "' aside: " << ec.message(), "");
            fs::rename(tmp_folder, final_folder, ec);
            fs::remove_all(old);
        } else {
            fs::rename(tmp_folder, final_folder, ec);
        }
        LOOM_CHECK(!ec, "cannot rename '" << tmp_folder << "' to '" << final_folder << "': " << ec.message(), "");
        fsync_folder(dir);
        kill_point();
        write_file_atomically((fs::path(dir) / kTrackerFile).string(), std::to_string(st.iteration) + "\n");
        kill_point();
    }
    barrier(world);   // every rank returns once the checkpoint is complete
    SaveStats stats;
    stats.bytes = st.my_bytes + index_bytes;   // rank 0: every file, from the index
    if (my_rank == 0) {
        stats.bytes = index_bytes;
        for (const fs::directory_entry & e : fs::directory_iterator(final_folder)) {
            if (e.is_regular_file() && e.path().filename() != kIndexFile) stats.bytes += static_cast<int64_t>(e.file_size());
        }
    }
    stats.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - st.start).count();
    return stats;
}

SaveStats save(const std::string & dir, int64_t iteration, const json & metadata, const RankContents & rank,
               bool with_optimizer) {
    std::unique_ptr<SaveInProgress> s = begin_save(dir, iteration, metadata, rank, with_optimizer, /*background=*/false);
    return finish_save(*s, rank.world);
}

// --- reading --------------------------------------------------------------------------------------------

std::optional<std::string> find_checkpoint(const std::string & dir, std::optional<int64_t> step) {
    // As Megatron: a --load folder without a tracker (or not there yet, as on a job's first run) holds no
    // checkpoint; the caller decides whether that is an error (--exit-on-missing-checkpoint).
    if (!step && !fs::exists(dir)) return std::nullopt;
    LOOM_CHECK(fs::is_directory(dir), "--load '" << dir << "' is not a folder", "give the --save folder of a run");
    if (fs::exists(fs::path(dir) / kIndexFile)) return dir;   // an iteration folder itself
    std::string folder;
    if (step) {
        folder = (fs::path(dir) / iteration_folder(*step)).string();
        LOOM_CHECK(fs::is_directory(folder), "--ckpt-step " << *step << ": '" << folder << "' does not exist",
                   "the folder holds the iterations named by its iter_* folders");
        return folder;
    }
    const std::string tracker = (fs::path(dir) / kTrackerFile).string();
    if (!fs::exists(tracker)) return std::nullopt;
    std::string text = read_input_file(tracker, "checkpoint tracker");
    while (!text.empty() && (text.back() == '\n' || text.back() == ' ' || text.back() == '\r')) text.pop_back();
    char *    end       = nullptr;
    long long iteration = std::strtoll(text.c_str(), &end, 10);
    LOOM_CHECK(!text.empty() && end && *end == '\0' && iteration >= 0,
               "'" << tracker << "' holds '" << text.substr(0, 40) << "', not an iteration number",
               "it is written by --save; 'release' checkpoints of Megatron's torch format are not supported");
    folder = (fs::path(dir) / iteration_folder(iteration)).string();
    LOOM_CHECK(fs::is_directory(folder), "'" << tracker << "' names iteration " << iteration << " but '" << folder
                                             << "' does not exist",
               "the folder was moved or deleted; give --ckpt-step for another iteration");
    return folder;
}

namespace {

Shape shape_from(const json & j, const std::string & what, const std::string & where) {
    LOOM_CHECK(j.is_array() && !j.empty() && j.size() <= 8, where << ": " << what << " is not a shape", "");
    Shape s;
    for (const json & d : j) {
        LOOM_CHECK(d.is_number_integer() && d.get<int64_t>() >= 0 && d.get<int64_t>() < (int64_t(1) << 40),
                   where << ": " << what << " has a bad size", "");
        s.push_back(d.get<int64_t>());
    }
    return s;
}

int64_t numel_checked(const Shape & s, const std::string & where) {
    int64_t n = 1;
    for (int64_t d : s) {
        LOOM_CHECK(d == 0 || n <= (int64_t(1) << 40) / d, where << ": shape too large", "");
        n *= d;
    }
    return n;
}

const char * kCorruptHint = "the checkpoint is damaged or was not written by Loom; load an earlier iteration "
                            "with --ckpt-step";

// An integer field: a JSON integer in int64's range. A number such as 1e95 (which nlohmann would convert with
// undefined behaviour) or a larger unsigned one is refused naming the field.
int64_t integer(const json & v, const std::string & what, const std::string & where) {
    LOOM_CHECK(v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)),
               "'" << where << "': " << what << " is " << v.dump().substr(0, 40) << ", not an integer", kCorruptHint);
    return v.get<int64_t>();
}

}  // namespace

Index read_index(const std::string & folder) {
    Index index;
    index.folder            = folder;
    const std::string where = index.path();
    LOOM_CHECK(fs::exists(where), "checkpoint index '" << where << "' is missing", kCorruptHint);
    const std::string text = read_input_file(where, "checkpoint index");
    json              j;
    try {
        j = json::parse(text, json_parse_checks<json>("checkpoint index '" + where + "'", JsonKeys::unique), true, false);
    } catch (const json::exception & e) {
        LOOM_THROW("checkpoint index '" << where << "' is not valid JSON: " << json_error_text(e), kCorruptHint);
    }
    try {
        LOOM_CHECK(j.is_object() && j.value("format", "") == "loom-checkpoint",
                   "'" << where << "' is not a Loom checkpoint index (no \"format\": \"loom-checkpoint\")", kCorruptHint);
        LOOM_CHECK(integer(j.at("version"), "version", where) == kFormatVersion,
                   "'" << where << "' has format version " << j.at("version") << ", this Loom reads " << kFormatVersion, "");
        index.iteration      = integer(j.at("iteration"), "iteration", where);
        index.metadata       = j.at("metadata");
        index.has_optimizer  = j.at("optimizer").at("saved").get<bool>();
        index.optimizer_step = integer(j.at("optimizer").at("step"), "optimizer step", where);
        // The counters a resume continues from: in range, and the iteration the folder's name says.
        LOOM_CHECK(index.iteration >= 0, "'" << where << "': iteration " << index.iteration << " is negative", kCorruptHint);
        const std::string named = fs::path(folder).filename().string();
        LOOM_CHECK(named.rfind("iter_", 0) != 0 || named == iteration_folder(index.iteration),
                   "'" << where << "': iteration " << index.iteration << " is not the iteration of its folder '" << named << "'",
                   kCorruptHint);
        LOOM_CHECK(index.optimizer_step >= 0, "'" << where << "': optimizer step " << index.optimizer_step << " is negative",
                   kCorruptHint);
        LOOM_CHECK(index.metadata.is_object(), "'" << where << "': \"metadata\" is " << index.metadata.type_name()
                                                   << ", not an object",
                   kCorruptHint);
        if (const auto consumed = index.metadata.find("consumed_train_samples"); consumed != index.metadata.end()) {
            LOOM_CHECK(consumed->is_number_integer() && consumed->get<int64_t>() >= 0 &&
                           consumed->get<int64_t>() <= (int64_t{1} << 53),
                       "'" << where << "': consumed_train_samples " << consumed->dump() << " is not a count of samples",
                       kCorruptHint);
        }
        for (auto & [name, f] : j.at("files").items()) {
            LOOM_CHECK(name.find('/') == std::string::npos && name.find("..") == std::string::npos,
                       where << ": file name '" << name << "' leaves the folder", kCorruptHint);
            FileRecord record;
            const int64_t bytes = integer(f.at("bytes"), "the size of file '" + name + "'", where);
            LOOM_CHECK(bytes >= 0, "'" << where << "': file '" << name << "' has " << bytes << " bytes", kCorruptHint);
            record.bytes = static_cast<uint64_t>(bytes);
            const std::string crc = f.at("crc32c").get<std::string>();
            LOOM_CHECK(crc.size() == 8 && crc.find_first_not_of("0123456789abcdefABCDEF") == std::string::npos,
                       "'" << where << "': file '" << name << "' has crc32c '" << crc.substr(0, 40)
                           << "', not 8 hexadecimal digits",
                       kCorruptHint);
            record.crc32c = static_cast<uint32_t>(std::strtoul(crc.c_str(), nullptr, 16));
            const fs::path path = fs::path(folder) / name;
            LOOM_CHECK(fs::is_regular_file(path), "checkpoint file '" << path.string() << "' is missing (listed in '"
                                                                     << where << "')", kCorruptHint);
            const uint64_t size = fs::file_size(path);
            LOOM_CHECK(size == record.bytes, "checkpoint file '" << path.string() << "' holds " << size
                                                                << " bytes, its index says " << record.bytes,
                       "the file was truncated or replaced; " << kCorruptHint);
            index.files[name] = record;
        }
        for (auto & [name, t] : j.at("tensors").items()) {
            TensorRecord  record;
            const std::string what = where + ": tensor " + name;
            record.shape = shape_from(t.at("shape"), "shape", what);
            record.dtype = t.at("dtype").get<std::string>();
            LOOM_CHECK(record.dtype == "F32" || record.dtype == "BF16" || record.dtype == "F16",
                       what << " has dtype " << record.dtype, kCorruptHint);
            const int64_t numel   = numel_checked(record.shape, what);
            int64_t       covered = 0;
            for (const json & pj : t.at("pieces")) {
                Piece p;
                p.file = pj.at("file").get<std::string>();
                LOOM_CHECK(index.files.count(p.file), what << " has a piece in '" << p.file << "', which the index does not list",
                           kCorruptHint);
                const int64_t tp_dim = integer(pj.at("tp_dim"), name + "'s tp_dim", where);
                LOOM_CHECK(tp_dim >= -1 && tp_dim < static_cast<int64_t>(record.shape.size()),
                           what << " has tp_dim " << tp_dim, kCorruptHint);
                p.tp_dim = static_cast<int>(tp_dim);
                int64_t extent = p.tp_dim < 0 ? 0 : record.shape[static_cast<size_t>(p.tp_dim)], held = 0;
                for (const json & r : pj.at("tp_ranges")) {
                    int64_t a = integer(r.at(0), name + "'s tp_ranges", where), b = integer(r.at(1), name + "'s tp_ranges", where);
                    LOOM_CHECK(0 <= a && a <= b && b <= extent, what << ": range [" << a << ", " << b << ") outside "
                                                                     << extent, kCorruptHint);
                    p.tp_ranges.emplace_back(a, b);
                    held += b - a;
                }
                p.local_shape = shape_from(pj.at("local_shape"), "local_shape", what);
                Shape expected = record.shape;
                if (p.tp_dim >= 0) expected[static_cast<size_t>(p.tp_dim)] = held;
                if (pj.contains("tp_outer")) {
                    const int64_t a = integer(pj.at("tp_outer").at(0), name + "'s tp_outer", where),
                                  b = integer(pj.at("tp_outer").at(1), name + "'s tp_outer", where);
                    LOOM_CHECK(p.tp_dim >= 1 && 0 <= a && a <= b && b <= record.shape[0],
                               what << ": outer range [" << a << ", " << b << ") outside " << record.shape[0] << " (tp_dim "
                                    << p.tp_dim << ")", kCorruptHint);
                    p.tp_outer    = {a, b};
                    expected[0]   = b - a;
                }
                LOOM_CHECK(p.local_shape == expected, what << ": a piece's local shape " << shape_string(p.local_shape)
                                                           << " does not match its ranges", kCorruptHint);
                p.begin = integer(pj.at("range").at(0), name + "'s range", where);
                p.end   = integer(pj.at("range").at(1), name + "'s range", where);
                LOOM_CHECK(0 <= p.begin && p.begin <= p.end && p.end <= shape_numel(p.local_shape),
                           what << ": piece range [" << p.begin << ", " << p.end << ") outside its part", kCorruptHint);
                covered += p.end - p.begin;
                record.pieces.push_back(std::move(p));
            }
            LOOM_CHECK(covered == numel, what << ": its pieces hold " << covered << " elements, the shape "
                                             << shape_string(record.shape) << " has " << numel, kCorruptHint);
            index.tensors[name] = std::move(record);
        }
    } catch (const json::exception & e) {
        LOOM_THROW("checkpoint index '" << where << "' is malformed: " << json_error_text(e), kCorruptHint);
    }
    return index;
}

namespace {

// The shard files a rank reads, each opened (and checksummed) once.
class FileCache {
public:
    explicit FileCache(const Index & index) : index_(index) {}

    const io::SafetensorsFile & open(const std::string & name) {
        auto it = files_.find(name);
        if (it != files_.end()) return *it->second;
        const std::string path = (fs::path(index_.folder) / name).string();
        check_file(path, index_.files.at(name));
        auto file = std::make_unique<io::SafetensorsFile>(path);
        return *files_.emplace(name, std::move(file)).first->second;
    }

    static void check_file(const std::string & path, const FileRecord & record) {
        InputStream f = open_input_file(path, "checkpoint file");
        std::vector<char> buffer(size_t(8) << 20);
        uint32_t          crc   = 0;
        uint64_t          total = 0;
        size_t            n;
        while ((n = std::fread(buffer.data(), 1, buffer.size(), f.get())) > 0) {
            crc = crc32c(buffer.data(), n, crc);
            total += n;
        }
        LOOM_CHECK(total == record.bytes, "checkpoint file '" << path << "' holds " << total << " bytes, its index says "
                                                              << record.bytes, kCorruptHint);
        LOOM_CHECK(crc == record.crc32c, "checkpoint file '" << path << "' fails its checksum (CRC-32C " << hex32(crc)
                                                             << ", the index says " << hex32(record.crc32c) << ")",
                   "the file is corrupt; " << kCorruptHint);
    }

private:
    const Index &                                                    index_;
    std::map<std::string, std::unique_ptr<io::SafetensorsFile>> files_;
};

// The full tensor's `kind` from every piece, into `full` (`scratch` holds a piece that must be scattered).
// The buffers are reused from tensor to tensor: fresh pages for every tensor would cost more than the copy.
void assemble(const Index & index, const std::string & name, const TensorRecord & t, const char * kind,
              FileCache & files, std::vector<float> & full, std::vector<float> & scratch) {
    full.resize(static_cast<size_t>(shape_numel(t.shape)));
    for (const Piece & p : t.pieces) {
        const io::SafetensorsFile & file  = files.open(p.file);
        const std::string              entry = entry_name(name, p.begin, kind);
        LOOM_CHECK(file.contains(entry), "checkpoint file '" << file.path() << "' has no entry '" << entry
                                                             << "' (listed in '" << index.path() << "')", kCorruptHint);
        const int64_t numel = shape_numel(file.entry(entry).shape);
        LOOM_CHECK(numel == p.end - p.begin, "checkpoint file '" << file.path() << "': entry '" << entry << "' holds "
                                                                 << numel << " elements, the index says " << p.end - p.begin,
                   kCorruptHint);
        // The parameter's values in its saved dtype, the master and Adam's moments in f32 (save()'s rule).
        const std::string dtype = std::strcmp(kind, "values") == 0 ? t.dtype : std::string("F32");
        LOOM_CHECK(file.entry(entry).dtype == dtype, "checkpoint file '" << file.path() << "': entry '" << entry << "' is "
                                                                         << file.entry(entry).dtype << ", the index says "
                                                                         << dtype,
                   kCorruptHint);
        float * const out = p.tp_dim < 0 ? full.data() + p.begin : (scratch.resize(static_cast<size_t>(numel)), scratch.data());
        file.read_f32(entry, out);
        // A NaN or infinity is never saved (a step that makes one is skipped): the file is damaged, and
        // loading it would be blamed on the learning rate a step later.
        const float * bad = std::find_if(out, out + numel, [](float x) { return !std::isfinite(x); });
        LOOM_CHECK(bad == out + numel, "checkpoint file '" << file.path() << "': entry '" << entry << "' holds " << *bad
                                                           << " at element " << (bad - out),
                   kCorruptHint);
        if (p.tp_dim < 0) continue;   // the piece is a contiguous range of the full tensor
        for_each_run(p, t.shape, [&](int64_t local, int64_t at, int64_t n) {
            std::copy_n(scratch.data() + (local - p.begin), n, full.data() + at);
        });
    }
}

bool is_vocabulary_tensor(const std::string & name) {   // model/gpt_model.h's names
    return name == "embedding.word_embeddings.weight" || name == "output_layer.weight";
}

// `full` (saved shape) fitted to `target` in place: equal, or a vocabulary tensor whose padding differs.
void fit_shape(std::vector<float> & full, const Index & index, const std::string & name, const TensorRecord & t,
               const Shape & target, int64_t vocab_size) {
    if (t.shape == target) return;
    const bool rows_only = t.shape.size() == 2 && target.size() == 2 && t.shape[1] == target[1] &&
                           is_vocabulary_tensor(name) && vocab_size > 0 && t.shape[0] >= vocab_size &&
                           target[0] >= vocab_size;
    LOOM_CHECK(rows_only, "tensor " << name << " has shape " << shape_string(t.shape) << " in '" << index.path()
                                    << "', the model's is " << shape_string(target),
               "the checkpoint is of another model; give the model flags it was saved with, or --use-checkpoint-args");
    const size_t kept = static_cast<size_t>(std::min(t.shape[0], target[0]) * target[1]);
    full.resize(static_cast<size_t>(shape_numel(target)));
    std::fill(full.begin() + static_cast<std::ptrdiff_t>(kept), full.end(), 0.0f);
}

}  // namespace

std::vector<std::string> absent_tensors(const Index & index, const RankContents & rank) {
    std::vector<std::string> absent;
    std::set<std::string>    seen;
    for (const model::Parameter * p : rank.params) {
        if (!index.tensors.count(p->name) && seen.insert(p->name).second) absent.push_back(p->name);
    }
    for (const Buffer & b : rank.buffers) {
        if (!b.optional && !index.tensors.count(b.name) && seen.insert(b.name).second) absent.push_back(b.name);
    }
    return absent;
}

LoadReport load(const Index & index, const RankContents & rank, const LoadOptions & options) {
    LoadReport report;
    if (rank.params.empty() && rank.buffers.empty()) return report;
    (rank.params.empty() ? rank.buffers.front().data : rank.params.front()->data).device().compute_stream().synchronize();
    FileCache  files(index);
    const bool with_optimizer = options.optimizer && index.has_optimizer && rank.optimizer;
    std::map<const model::Parameter *, std::vector<int>> slots_of;
    if (rank.optimizer) {
        optim::Optimizer & opt = *rank.optimizer;
        for (int i = 0; i < opt.state().num_slots(); ++i) {
            slots_of[opt.params()[static_cast<size_t>(opt.slot_params()[static_cast<size_t>(i)])]].push_back(i);
        }
    }
    std::vector<float> full, scratch, values, m, v;
    // This rank's part of `kind` of p, into `out`.
    auto part = [&](const model::Parameter & p, const TensorRecord & t, const char * kind, std::vector<float> & out) {
        const Shape target = p.tp_slice.dim < 0 ? p.data.shape() : p.tp_slice.full_shape;
        assemble(index, p.name, t, kind, files, full, scratch);
        fit_shape(full, index, p.name, t, target, options.vocab_size);
        if (p.tp_slice.dim < 0) {
            out.swap(full);
        } else {
            out = model::tp_extract(p.tp_slice, full.data());
        }
        LOOM_CHECK(static_cast<int64_t>(out.size()) == p.numel(),
                   "tensor " << p.name << " of '" << index.path() << "' does not fit this rank's part", "");
    };
    std::set<const model::Parameter *> done;
    for (model::Parameter * p : rank.params) {
        if (!done.insert(p).second) continue;
        auto it = index.tensors.find(p->name);
        LOOM_CHECK(it != index.tensors.end() || options.allow_absent,
                   "checkpoint '" << index.path() << "' has no tensor " << p->name,
                   "the checkpoint is of another model; give the model flags it was saved with, or --use-checkpoint-args");
        if (it == index.tensors.end()) {   // kept as initialised, its optimizer slots too
            report.absent.push_back(p->name);
            continue;
        }
        const TensorRecord & t = it->second;
        report.read.insert(p->name);
        // Values from the f32 master when there is one (see the top of checkpoint.h).
        part(*p, t, index.has_optimizer && t.dtype != "F32" ? "master" : "values", values);
        model::parameter_write_f32(*p, values);
        auto slots = slots_of.find(p);
        if (slots == slots_of.end()) continue;
        if (with_optimizer) {
            part(*p, t, "exp_avg", m);
            part(*p, t, "exp_avg_sq", v);
        } else {   // a fresh Adam state over the loaded values
            m.assign(values.size(), 0.0f);
            v.assign(values.size(), 0.0f);
        }
        for (int i : slots->second) {
            const size_t begin = static_cast<size_t>(slot_offset(*rank.optimizer, i, *p));
            const size_t n     = static_cast<size_t>(rank.optimizer->state().slot(i).values.numel());
            rank.optimizer->state().load_slot_state(i, std::span(values).subspan(begin, n), std::span(m).subspan(begin, n),
                                                    std::span(v).subspan(begin, n));
        }
    }
    for (const Buffer & b : rank.buffers) {
        auto it = index.tensors.find(b.name);
        if (it == index.tensors.end() && b.optional) {
            report.fresh.push_back(b.name);
            continue;
        }
        LOOM_CHECK(it != index.tensors.end() || options.allow_absent,
                   "checkpoint '" << index.path() << "' has no tensor " << b.name,
                   "the checkpoint is of another model; give the model flags it was saved with, or --use-checkpoint-args");
        if (it == index.tensors.end()) {   // kept as it is
            report.absent.push_back(b.name);
            continue;
        }
        LOOM_CHECK(it->second.shape == b.data.shape(), "tensor " << b.name << " of '" << index.path() << "' has shape "
                                                                << shape_string(it->second.shape) << ", this model's is "
                                                                << shape_string(b.data.shape()),
                   "the checkpoint is of another model; give the model flags it was saved with, or --use-checkpoint-args");
        report.read.insert(b.name);
        assemble(index, b.name, it->second, "values", files, full, scratch);
        write_values_f32(b.data, full);
    }
    if (rank.optimizer) rank.optimizer->state().set_steps(with_optimizer ? index.optimizer_step : 0);
    return report;
}

std::vector<float> read_tensor(const Index & index, const std::string & name, const std::string & kind) {
    auto it = index.tensors.find(name);
    LOOM_CHECK(it != index.tensors.end(), "checkpoint '" << index.path() << "' has no tensor " << name, "");
    FileCache          files(index);
    std::vector<float> full, scratch;
    assemble(index, name, it->second, kind.c_str(), files, full, scratch);
    return full;
}

void verify(const Index & index) {
    std::set<std::string> pieces_read;   // FileCache checks these as it opens them
    for (const auto & [name, t] : index.tensors) {
        for (const Piece & p : t.pieces) pieces_read.insert(p.file);
    }
    for (const auto & [name, record] : index.files) {
        if (!pieces_read.count(name)) FileCache::check_file((fs::path(index.folder) / name).string(), record);
    }
    FileCache                                    files(index);
    std::vector<float>                           full, scratch;
    std::map<std::string, std::set<std::string>> listed;   // file -> the entries the index names in it
    for (const auto & [name, t] : index.tensors) {
        std::vector<const char *> kinds = {"values"};
        if (index.has_optimizer) {
            if (t.dtype != "F32") kinds.push_back("master");
            kinds.push_back("exp_avg");
            kinds.push_back("exp_avg_sq");
        }
        for (const char * kind : kinds) {
            assemble(index, name, t, kind, files, full, scratch);
            for (const Piece & p : t.pieces) listed[p.file].insert(entry_name(name, p.begin, kind));
        }
    }
    // And nothing else: an entry no tensor of the index names is a tensor the index lost.
    for (const auto & [file, names] : listed) {
        for (const io::SafetensorsEntry & e : files.open(file).entries()) {
            LOOM_CHECK(names.count(e.name), "checkpoint file '" << (fs::path(index.folder) / file).string() << "' holds entry '"
                                                                << e.name << "', which '" << index.path() << "' does not list",
                       kCorruptHint);
        }
    }
}

}  // namespace loom::checkpoint
