#include "train/tensorboard.h"

#include "core/atomic_file.h"
#include "core/crc32c.h"
#include "core/error.h"

#include <cerrno>
#include <chrono>
#include <cstring>
#include <filesystem>
#include <unistd.h>

namespace loom::train {

namespace {

uint32_t masked_crc(const void * data, size_t bytes) {
    const uint32_t c = crc32c(data, bytes);
    return ((c >> 15) | (c << 17)) + 0xa282ead8u;
}

// Protobuf wire format: the few encodings an Event needs.
void put_varint(std::string & out, uint64_t v) {
    while (v >= 0x80) {
        out.push_back(static_cast<char>((v & 0x7f) | 0x80));
        v >>= 7;
    }
    out.push_back(static_cast<char>(v));
}

void put_fixed(std::string & out, const void * bytes, size_t n) { out.append(static_cast<const char *>(bytes), n); }

void put_bytes_field(std::string & out, int field, const std::string & bytes) {
    put_varint(out, static_cast<uint64_t>(field) << 3 | 2);
    put_varint(out, bytes.size());
    out += bytes;
}

std::string event_header(double wall_time, int64_t step) {
    std::string e;
    put_varint(e, 1 << 3 | 1);   // wall_time: fixed64
    put_fixed(e, &wall_time, 8);
    put_varint(e, 2 << 3 | 0);   // step: varint
    put_varint(e, static_cast<uint64_t>(step));
    return e;
}

double now_seconds() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

}  // namespace

TensorBoardWriter::TensorBoardWriter(const std::string & dir) {
    namespace fs = std::filesystem;
    std::error_code ec;
    fs::create_directories(dir, ec);
    LOOM_CHECK(fs::is_directory(dir), "--tensorboard-dir '" << dir << "' cannot be created: " << ec.message(),
               "give a folder that can be written");
    char host[256] = "localhost";
    ::gethostname(host, sizeof(host) - 1);
    path_ = (fs::path(dir) / ("events.out.tfevents." + std::to_string(static_cast<long long>(now_seconds())) + "." +
                              host + "." + std::to_string(::getpid()) + ".0"))
                .string();
    file_ = open_for_writing(path_);
    LOOM_CHECK(file_ != nullptr, "cannot create TensorBoard event file '" << path_ << "': " << std::strerror(errno),
               "check --tensorboard-dir's permissions");
    std::string first = event_header(now_seconds(), 0);
    put_bytes_field(first, 3, "brain.Event:2");   // file_version
    write_record(first);
    flush();
}

TensorBoardWriter::~TensorBoardWriter() {
    if (file_ != nullptr) std::fclose(file_);
}

void TensorBoardWriter::add_scalar(const std::string & tag, double value, int64_t step) {
    std::string v;
    put_bytes_field(v, 1, tag);
    const float f = static_cast<float>(value);
    put_varint(v, 2 << 3 | 5);   // simple_value: fixed32
    put_fixed(v, &f, 4);
    std::string summary;
    put_bytes_field(summary, 1, v);
    std::string event = event_header(now_seconds(), step);
    put_bytes_field(event, 5, summary);
    write_record(event);
}

void TensorBoardWriter::write_record(const std::string & data) {
    const uint64_t length      = data.size();
    const uint32_t length_crc  = masked_crc(&length, 8);
    const uint32_t data_crc    = masked_crc(data.data(), data.size());
    bool           ok          = std::fwrite(&length, 8, 1, file_) == 1 && std::fwrite(&length_crc, 4, 1, file_) == 1 &&
                std::fwrite(data.data(), 1, data.size(), file_) == data.size() &&
                std::fwrite(&data_crc, 4, 1, file_) == 1;
    if (!ok) {
        throw OutputError(detail::concat("cannot write TensorBoard event file '", path_, "': ", std::strerror(errno)),
                          "check the free space of --tensorboard-dir's file system", __FILE__, __LINE__);
    }
}

void TensorBoardWriter::flush() {
    check_written(file_, "TensorBoard event file '" + path_ + "'", "check the free space of --tensorboard-dir's file system");
}

}  // namespace loom::train
