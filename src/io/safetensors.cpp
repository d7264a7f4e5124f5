#include "io/safetensors.h"

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/json_checks.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::io {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;   // the safetensors crate's limit

constexpr const char * kSafetensorsHint =
    "give a complete safetensors file: one written by `loom export-hf` or `loom train --save`, or a Hugging Face "
    "model.safetensors (e.g. `huggingface-cli download gpt2 model.safetensors --local-dir DIR`); download or write "
    "it again if it was truncated";

}  // namespace

size_t safetensors_dtype_size(const std::string & dtype) {
    if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
    if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
    if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
    if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
    return 0;
}

SafetensorsFile::SafetensorsFile(const std::string & path) : path_(path) {
    file_ = open_input_file(path, "safetensors file");
    struct stat st {};
    LOOM_CHECK(::fstat(::fileno(file_.get()), &st) == 0,
               "cannot stat safetensors file '" << path << "': " << std::strerror(errno), kSafetensorsHint);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    LOOM_CHECK(size >= 8, "safetensors file '" << path << "' is too short: " << size
                                               << " bytes, fewer than the 8-byte header length",
               kSafetensorsHint);
    uint64_t header_bytes = 0;
    LOOM_CHECK(std::fread(&header_bytes, 8, 1, file_.get()) == 1, "cannot read safetensors file '" << path << "'", kSafetensorsHint);
    LOOM_CHECK(header_bytes <= size - 8,
               "safetensors file '" << path << "' is truncated or corrupt: its header length is " << header_bytes
                                    << " bytes, beyond the " << size - 8 << " bytes after the length field",
               kSafetensorsHint);
    LOOM_CHECK(header_bytes <= kMaxHeaderBytes,
               "safetensors file '" << path << "' has a header of " << header_bytes << " bytes, more than the "
                                    << kMaxHeaderBytes << " the format allows",
               kSafetensorsHint);
    std::string text(header_bytes, '\0');
    LOOM_CHECK(header_bytes == 0 || std::fread(text.data(), 1, header_bytes, file_.get()) == header_bytes,
               "cannot read the header of safetensors file '" << path << "'", kSafetensorsHint);
    data_start_ = 8 + header_bytes;
    const uint64_t data_bytes = size - data_start_;

    json header;
    try {
        header = json::parse(text, json_parse_checks<json>("safetensors file '" + path + "' header", JsonKeys::unique));
    } catch (const json::exception & e) {
        LOOM_THROW("safetensors file '" << path << "' has a bad JSON header (" << header_bytes
                                        << " bytes after the length): " << json_error_text(e),
                   kSafetensorsHint);
    }
    LOOM_CHECK(header.is_object(), "safetensors file '" << path << "' has a JSON header that is not an object",
               kSafetensorsHint);

    for (const auto & [name, value] : header.items()) {
        if (name == "__metadata__") {
            LOOM_CHECK(value.is_object(), "safetensors file '" << path << "': __metadata__ is not an object", kSafetensorsHint);
            for (const auto & [key, v] : value.items()) {
                LOOM_CHECK(v.is_string(), "safetensors file '" << path << "': __metadata__." << key << " is not a string",
                           kSafetensorsHint);
                metadata_[key] = v.get<std::string>();
            }
            continue;
        }
        auto bad = [&, &name = name](const std::string & what) {   // (clang 14 cannot capture a binding implicitly)
            LOOM_THROW("safetensors file '" << path << "': tensor '" << name << "' " << what, kSafetensorsHint);
        };
        if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets")) {
            bad("needs an object with dtype, shape and data_offsets, got " + value.dump());
        }
        SafetensorsEntry e;
        e.name = name;
        if (!value["dtype"].is_string()) bad("has a dtype that is not a string");
        e.dtype     = value["dtype"].get<std::string>();
        size_t item = safetensors_dtype_size(e.dtype);
        if (item == 0) bad("has dtype '" + e.dtype + "', which is not a safetensors dtype");
        const json & shape = value["shape"];
        if (!shape.is_array()) bad("has a shape that is not an array");
        uint64_t numel = 1;
        for (const json & dim : shape) {
            if (!dim.is_number_unsigned()) bad("has shape " + shape.dump() + " with a size that is not a non-negative integer");
            uint64_t d = dim.get<uint64_t>();
            if (__builtin_mul_overflow(numel, d, &numel)) bad("has shape " + shape.dump() + " too large to address");
            e.shape.push_back(static_cast<int64_t>(d));
        }
        const json & offsets = value["data_offsets"];
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
            bad("has data_offsets " + offsets.dump() + ", expected [begin, end] of non-negative integers");
        }
        e.begin = offsets[0].get<uint64_t>();
        e.end   = offsets[1].get<uint64_t>();
        uint64_t bytes = 0;
        if (e.end < e.begin) bad("has data_offsets " + offsets.dump() + " that end before they begin");
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(item), &bytes) || e.end - e.begin != bytes) {
            bad("has data_offsets " + offsets.dump() + " spanning " + std::to_string(e.end - e.begin) + " bytes, but shape " +
                shape.dump() + " of " + e.dtype + " needs " + std::to_string(numel) + " x " + std::to_string(item) + " bytes");
        }
        entries_.push_back(std::move(e));
    }

    // The tensors must tile the data exactly, as the safetensors crate requires.
    std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry & a, const SafetensorsEntry & b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t expected = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
        const SafetensorsEntry & e = entries_[i];
        LOOM_CHECK(e.begin >= expected,
                   "safetensors file '" << path << "': tensor '" << e.name << "' at bytes [" << e.begin << ", " << e.end
                                        << ") overlaps tensor '" << entries_[i - 1].name << "' ending at " << expected,
                   kSafetensorsHint);
        LOOM_CHECK(e.begin == expected,
                   "safetensors file '" << path << "': tensor '" << e.name << "' begins at byte " << e.begin
                                        << ", leaving a gap after byte " << expected,
                   kSafetensorsHint);
        LOOM_CHECK(e.end <= data_bytes,
                   "safetensors file '" << path << "' is truncated: tensor '" << e.name << "' at bytes [" << e.begin
                                        << ", " << e.end << ") ends beyond the " << data_bytes << " data bytes of the file",
                   kSafetensorsHint);
        expected = e.end;
        index_[e.name] = i;
    }
    LOOM_CHECK(expected == data_bytes,
               "safetensors file '" << path << "' has " << data_bytes << " data bytes, but its tensors cover "
                                    << expected << (expected < data_bytes ? " (trailing bytes)" : ""),
               kSafetensorsHint);
}

bool SafetensorsFile::contains(const std::string & name) const { return index_.count(name) > 0; }

const SafetensorsEntry & SafetensorsFile::entry(const std::string & name) const {
    auto it = index_.find(name);
    LOOM_CHECK(it != index_.end(), "safetensors file '" << path_ << "' has no tensor '" << name << "'", kSafetensorsHint);
    return entries_[it->second];
}

std::vector<float> SafetensorsFile::read_f32(const std::string & name) const {
    std::vector<float> out(static_cast<size_t>(shape_numel(entry(name).shape)));
    read_f32(name, out.data());
    return out;
}

void SafetensorsFile::read_f32(const std::string & name, float * out) const {
    const SafetensorsEntry & e = entry(name);
    DType dtype = DType::f32;
    if (e.dtype == "BF16") dtype = DType::bf16;
    else if (e.dtype == "F16") dtype = DType::f16;
    else LOOM_CHECK(e.dtype == "F32", "safetensors file '" << path_ << "': tensor '" << name << "' has dtype " << e.dtype
                                                           << ", not a floating type Loom reads (F32, BF16, F16)",
                    "convert the checkpoint to float32 or bfloat16");
    const size_t         n     = static_cast<size_t>(shape_numel(e.shape));
    const size_t         bytes = e.end - e.begin;
    std::vector<uint8_t> raw(dtype == DType::f32 ? 0 : bytes);
    void *               dst = dtype == DType::f32 ? static_cast<void *>(out) : raw.data();
    bool ok = ::fseeko(file_.get(), static_cast<off_t>(data_start_ + e.begin), SEEK_SET) == 0 &&
              (bytes == 0 || std::fread(dst, 1, bytes, file_.get()) == bytes);
    LOOM_CHECK(ok, "cannot read tensor '" << name << "' from safetensors file '" << path_ << "'", kSafetensorsHint);
    if (n != 0 && dtype != DType::f32) convert(raw.data(), dtype, out, DType::f32, n);
}

void write_safetensors(const std::string & path, const std::vector<SafetensorsTensor> & tensors,
                       const std::map<std::string, std::string> & metadata) {
    json     header = json::object();
    uint64_t offset = 0;
    for (const SafetensorsTensor & t : tensors) {
        LOOM_CHECK(static_cast<int64_t>(t.data.size()) == shape_numel(t.shape),
                   "tensor '" << t.name << "' for '" << path << "' has " << t.data.size() << " elements, its shape "
                              << shape_string(t.shape) << " needs " << shape_numel(t.shape),
                   "");
        LOOM_CHECK(!header.contains(t.name) && t.name != "__metadata__", "tensor '" << t.name << "' written twice to '" << path << "'", "");
        uint64_t bytes = t.data.size() * sizeof(float);
        header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
    }
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');   // the data starts 8-byte aligned, as the crate writes it
    uint64_t length = text.size();

    AtomicFile file(path);
    file.write(&length, 8);
    file.write(text.data(), text.size());
    for (const SafetensorsTensor & t : tensors) file.write(t.data.data(), t.data.size() * sizeof(float));
    file.commit();
}

}  // namespace loom::io
