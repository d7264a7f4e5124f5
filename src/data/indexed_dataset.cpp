#include "data/indexed_dataset.h"

#include "core/atomic_file.h"

#include "core/error.h"

#include <algorithm>
#include <cerrno>
#include <cstring>
#include <iomanip>
#include <limits>
#include <sstream>
#include <unistd.h>

namespace loom::data {

namespace {

constexpr const char * kIdxHint =
    "pass the prefix of a .bin/.idx pair written by Megatron's tools/preprocess_data.py or `loom data` "
    "(e.g. --data-path corpus_text_document); regenerate the pair if it was truncated or overwritten";

std::string hex_bytes(const uint8_t * p, size_t n) {
    std::ostringstream os;
    for (size_t i = 0; i < n; ++i) {
        os << (i ? " " : "") << std::hex << std::setw(2) << std::setfill('0') << static_cast<int>(p[i]);
    }
    return os.str();
}

// Smallest and largest of n tokens of type T at p (unaligned), in blocks copied to an aligned buffer so the
// reductions vectorise.
template <typename T> std::pair<int64_t, int64_t> token_min_max(const uint8_t * p, int64_t n) {
    constexpr int64_t kBlock = 4096;
    alignas(64) T     block[kBlock];
    T                 lo = std::numeric_limits<T>::max(), hi = std::numeric_limits<T>::lowest();
    for (int64_t start = 0; start < n; start += kBlock) {
        const int64_t m = std::min(kBlock, n - start);
        std::memcpy(block, p + start * static_cast<int64_t>(sizeof(T)), static_cast<size_t>(m) * sizeof(T));
        for (int64_t i = 0; i < m; ++i) {
            lo = std::min(lo, block[i]);
            hi = std::max(hi, block[i]);
        }
    }
    if (n == 0) return {0, -1};
    return {static_cast<int64_t>(lo), static_cast<int64_t>(hi)};
}

template <typename T> IndexedDataset::TopTokenUse top_use(const uint8_t * bin, const IndexedDataset & data, int64_t top) {
    IndexedDataset::TopTokenUse use;
    T                           below = std::numeric_limits<T>::lowest();
    bool                        any   = false;
    for (int64_t s = 0; s < data.num_sequences(); ++s) {
        const uint8_t * p   = bin + data.sequence_pointer(s);
        const int64_t   len = data.sequence_length(s);
        for (int64_t i = 0; i < len; ++i) {
            T v;
            std::memcpy(&v, p + i * static_cast<int64_t>(sizeof(T)), sizeof(T));
            if (static_cast<int64_t>(v) < top) {
                below = std::max(below, v);
                any   = true;
            } else if (static_cast<int64_t>(v) == top && i + 1 < len && use.inner_sequence < 0) {
                use.inner_sequence = s;
                use.inner_offset   = i;
            }
        }
    }
    if (any) use.next_below = static_cast<int64_t>(below);
    return use;
}

template <typename T> void widen(const uint8_t * p, std::span<int32_t> out) {
    for (size_t i = 0; i < out.size(); ++i) {
        T v;
        std::memcpy(&v, p + i * sizeof(T), sizeof(T));
        out[i] = static_cast<int32_t>(v);
    }
}

}  // namespace

size_t index_dtype_size(uint8_t code) {
    switch (code) {
        case 1: case 2: return 1;
        case 3: case 8: return 2;
        case 4: case 7: return 4;
        case 5: case 6: return 8;
        default: return 0;
    }
}

const char * index_dtype_name(uint8_t code) {
    switch (code) {
        case 1: return "uint8";
        case 2: return "int8";
        case 3: return "int16";
        case 4: return "int32";
        case 5: return "int64";
        case 6: return "float64";
        case 7: return "float32";
        case 8: return "uint16";
        default: return "unknown";
    }
}

IndexDType index_dtype_for_vocab(int64_t vocab_size) {
    return vocab_size < 65500 ? IndexDType::u16 : IndexDType::i32;
}

std::string index_file_path(const std::string & prefix) { return prefix + ".idx"; }
std::string data_file_path(const std::string & prefix) { return prefix + ".bin"; }

// ---------------------------------------------------------------------------------------------------
// Reader

IndexedDataset::IndexedDataset(const std::string & prefix)
    : prefix_(prefix), idx_(index_file_path(prefix), "Megatron index"), bin_(data_file_path(prefix), "Megatron data") {
    const std::string & ip = idx_.path();
    const size_t        isize = idx_.size();
    LOOM_CHECK(isize >= kIndexHeaderBytes, "Megatron index '" << ip << "' is truncated: " << isize
                                                               << " bytes, fewer than the 34-byte header",
               kIdxHint);
    LOOM_CHECK(std::memcmp(idx_.data(), kIndexMagic, sizeof(kIndexMagic)) == 0,
               "Megatron index '" << ip << "' has a bad magic: its first 9 bytes are " << hex_bytes(idx_.data(), 9)
                                  << ", expected 4d 4d 49 44 49 44 58 00 00 (\"MMIDIDX\\0\\0\")",
               "this is not a Megatron .idx file; " << kIdxHint);
    uint64_t version = idx_.load<uint64_t>(9);
    LOOM_CHECK(version == kIndexVersion, "Megatron index '" << ip << "' has version " << version
                                                            << " at offset 9; only version " << kIndexVersion
                                                            << " is readable",
               "rewrite the dataset with a Megatron release that writes version 1, or with `loom data`");
    dtype_code_  = idx_.load<uint8_t>(17);
    token_bytes_ = index_dtype_size(dtype_code_);
    LOOM_CHECK(token_bytes_ != 0, "Megatron index '" << ip << "' has dtype code " << static_cast<int>(dtype_code_)
                                                     << " at offset 17, which Megatron does not define",
               "valid codes are 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16; "
                   << kIdxHint);
    LOOM_CHECK(dtype_code_ != 6 && dtype_code_ != 7,
               "Megatron index '" << ip << "' stores " << index_dtype_name(dtype_code_)
                                  << " elements (dtype code " << static_cast<int>(dtype_code_)
                                  << "), which are not token ids",
               "a GPT dataset needs an integer token dtype (uint16 or int32)");

    uint64_t n = idx_.load<uint64_t>(18);
    uint64_t d = idx_.load<uint64_t>(26);
    // 34 + 12N + 8D must not overflow before it is compared with the size: bound N and D by the size.
    const uint64_t body = isize - kIndexHeaderBytes;
    LOOM_CHECK(n <= body / 12 && d <= body / 8 && 12 * n + 8 * d <= body,
               "Megatron index '" << ip << "' is truncated or corrupt: the header's sequence count N = " << n
                                  << " and document count D = " << d << " need 34 + 12N + 8D = "
                                  << (n <= body && d <= body ? std::to_string(34 + 12 * n + 8 * d) : std::string("more"))
                                  << " bytes, the file has " << isize,
               kIdxHint);
    const uint64_t expected = kIndexHeaderBytes + 12 * n + 8 * d;
    LOOM_CHECK(isize == expected || isize == expected + n,
               "Megatron index '" << ip << "' has " << isize << " bytes; N = " << n << " sequences and D = " << d
                                  << " document indices make " << expected << " (or " << expected + n
                                  << " with multimodal sequence modes)",
               "the file has trailing bytes or a wrong count in its header; " << kIdxHint);
    LOOM_CHECK(d >= 1, "Megatron index '" << ip << "' has document count D = 0; D includes the leading 0, so it is "
                                                   "at least 1",
               kIdxHint);
    num_sequences_        = static_cast<int64_t>(n);
    num_document_indices_ = static_cast<int64_t>(d);
    lengths_at_           = kIndexHeaderBytes;
    pointers_at_          = lengths_at_ + 4 * n;
    documents_at_         = pointers_at_ + 8 * n;

    const std::string & bp    = bin_.path();
    const uint64_t      bsize = bin_.size();
    for (int64_t i = 0; i < num_sequences_; ++i) {
        int32_t len = sequence_length(i);
        int64_t ptr = sequence_pointer(i);
        LOOM_CHECK(len >= 0, "Megatron index '" << ip << "': sequence_lengths[" << i << "] = " << len << " is negative",
                   kIdxHint);
        LOOM_CHECK(ptr >= 0 && static_cast<uint64_t>(ptr) <= bsize &&
                       static_cast<uint64_t>(len) * token_bytes_ <= bsize - static_cast<uint64_t>(ptr),
                   "Megatron data '" << bp << "' is too short for its index '" << ip << "': sequence " << i
                                     << " has sequence_pointers[" << i << "] = " << ptr << " bytes and "
                                     << "sequence_lengths[" << i << "] = " << len << " tokens of "
                                     << token_bytes_ << " bytes, ending at byte "
                                     << static_cast<uint64_t>(ptr) + static_cast<uint64_t>(len) * token_bytes_
                                     << ", but the .bin has " << bsize << " bytes",
                   "the .bin was truncated or belongs to another .idx; " << kIdxHint);
        // The writer lays the sequences end to end from byte 0 (Megatron's _sequence_pointers): anything
        // else means the index was edited, or belongs to another .bin.
        const int64_t expected = num_tokens_ * static_cast<int64_t>(token_bytes_);
        LOOM_CHECK(ptr == expected, "Megatron index '" << ip << "': sequence_pointers[" << i << "] = " << ptr
                                                       << ", but the sequences before it end at byte " << expected,
                   "pointers are the running sum of lengths x " << token_bytes_ << " bytes; " << kIdxHint);
        num_tokens_ += len;
    }
    LOOM_CHECK(static_cast<uint64_t>(num_tokens_) * token_bytes_ == bsize,
               "Megatron data '" << bp << "' has " << bsize << " bytes, but its index '" << ip << "' describes "
                                 << num_tokens_ << " tokens of " << token_bytes_ << " bytes ("
                                 << static_cast<uint64_t>(num_tokens_) * token_bytes_ << " bytes)",
               "the .bin has trailing bytes, or the .idx's dtype code is wrong; " << kIdxHint);
    int64_t previous = -1;
    for (int64_t k = 0; k < num_document_indices_; ++k) {
        int64_t v = document_index(k);
        LOOM_CHECK(k > 0 || v == 0, "Megatron index '" << ip << "': document_indices[0] = " << v << ", expected 0",
                   kIdxHint);
        LOOM_CHECK(v >= previous && v <= num_sequences_,
                   "Megatron index '" << ip << "': document_indices[" << k << "] = " << v
                                      << (v < previous ? " decreases (the previous one is " + std::to_string(previous) + ")"
                                                       : " exceeds the sequence count N = " + std::to_string(num_sequences_)),
                   kIdxHint);
        previous = v;
    }
    LOOM_CHECK(previous == num_sequences_,
               "Megatron index '" << ip << "': the last document index is " << previous
                                  << ", but documents must end at the sequence count N = " << num_sequences_,
               kIdxHint);
}

int32_t IndexedDataset::sequence_length(int64_t i) const { return idx_.load<int32_t>(lengths_at_ + 4 * static_cast<size_t>(i)); }
int64_t IndexedDataset::sequence_pointer(int64_t i) const { return idx_.load<int64_t>(pointers_at_ + 8 * static_cast<size_t>(i)); }
int64_t IndexedDataset::document_index(int64_t d) const { return idx_.load<int64_t>(documents_at_ + 8 * static_cast<size_t>(d)); }

std::vector<int32_t> IndexedDataset::sequence_lengths() const {
    std::vector<int32_t> lengths(static_cast<size_t>(num_sequences_));
    if (!lengths.empty()) std::memcpy(lengths.data(), idx_.data() + lengths_at_, lengths.size() * sizeof(int32_t));
    return lengths;
}

void IndexedDataset::read(int64_t i, int64_t offset, std::span<int32_t> out) const {
    LOOM_CHECK(i >= 0 && i < num_sequences_, "sequence " << i << " of '" << prefix_ << "' is out of range [0, "
                                                         << num_sequences_ << ")",
               "");
    int64_t len = sequence_length(i);
    LOOM_CHECK(offset >= 0 && offset + static_cast<int64_t>(out.size()) <= len,
               "tokens [" << offset << ", " << offset + static_cast<int64_t>(out.size()) << ") of sequence " << i
                          << " of '" << prefix_ << "' are outside its " << len << " tokens",
               "");
    const uint8_t * p = bin_.data() + sequence_pointer(i) + offset * static_cast<int64_t>(token_bytes_);
    switch (dtype_code_) {
        case 1: widen<uint8_t>(p, out); break;
        case 2: widen<int8_t>(p, out); break;
        case 3: widen<int16_t>(p, out); break;
        case 4: widen<int32_t>(p, out); break;
        case 5: widen<int64_t>(p, out); break;
        case 8: widen<uint16_t>(p, out); break;
        default: LOOM_THROW("unreadable dtype code " << static_cast<int>(dtype_code_), "");
    }
}

std::vector<int32_t> IndexedDataset::sequence(int64_t i) const {
    std::vector<int32_t> tokens(static_cast<size_t>(sequence_length(i)));
    read(i, 0, tokens);
    return tokens;
}

std::pair<int64_t, int64_t> IndexedDataset::token_range() const {
    if (token_range_) return *token_range_;
    // The sequences tile the .bin exactly (checked at open), so one pass over the whole file sees every token.
    const int64_t   n = static_cast<int64_t>(bin_.size() / token_bytes_);
    const uint8_t * p = bin_.data();
    std::pair<int64_t, int64_t> range{0, -1};
    switch (dtype_code_) {
        case 1: range = token_min_max<uint8_t>(p, n); break;
        case 2: range = token_min_max<int8_t>(p, n); break;
        case 3: range = token_min_max<int16_t>(p, n); break;
        case 4: range = token_min_max<int32_t>(p, n); break;
        case 5: range = token_min_max<int64_t>(p, n); break;
        case 8: range = token_min_max<uint16_t>(p, n); break;
        default: break;
    }
    token_range_ = range;
    return range;
}

IndexedDataset::TopTokenUse IndexedDataset::top_token_use(int64_t top) const {
    const uint8_t * p = bin_.data();
    switch (dtype_code_) {
        case 1: return top_use<uint8_t>(p, *this, top);
        case 2: return top_use<int8_t>(p, *this, top);
        case 3: return top_use<int16_t>(p, *this, top);
        case 4: return top_use<int32_t>(p, *this, top);
        case 5: return top_use<int64_t>(p, *this, top);
        case 8: return top_use<uint16_t>(p, *this, top);
        default: return {};
    }
}

// ---------------------------------------------------------------------------------------------------
// Writer

namespace {

void write_or_throw(std::FILE * f, const void * data, size_t bytes, const std::string & path) {
    if (bytes != 0 && std::fwrite(data, 1, bytes, f) != bytes) {
        LOOM_THROW("cannot write " << bytes << " bytes to '" << path << "': " << std::strerror(errno),
                   "check the free space and permissions of the output folder");
    }
}

void close_or_throw(std::FILE * f, const std::string & path) {
    bool ok = std::fflush(f) == 0 && ::fsync(fileno(f)) == 0;
    int  err = errno;
    ok = (std::fclose(f) == 0) && ok;
    LOOM_CHECK(ok, "cannot flush '" << path << "': " << std::strerror(err), "check the free space of the output folder");
}

}  // namespace

IndexedDatasetWriter::IndexedDatasetWriter(const std::string & prefix, IndexDType dtype)
    : prefix_(prefix), dtype_(dtype) {
    uint8_t code = static_cast<uint8_t>(dtype);
    LOOM_CHECK(index_dtype_size(code) != 0 && dtype != IndexDType::f32 && dtype != IndexDType::f64,
               "cannot write token dtype code " << static_cast<int>(code) << " to '" << prefix << "'",
               "use uint16 (vocabulary below 65500) or int32");
    std::string suffix = ".tmp." + std::to_string(::getpid());
    bin_tmp_ = data_file_path(prefix) + suffix;
    idx_tmp_ = index_file_path(prefix) + suffix;
    bin_     = std::fopen(bin_tmp_.c_str(), "wb");
    LOOM_CHECK(bin_ != nullptr, "cannot create '" << bin_tmp_ << "': " << std::strerror(errno),
               "check that the folder of --output-prefix exists and is writable");
}

IndexedDatasetWriter::~IndexedDatasetWriter() {
    if (bin_ != nullptr) std::fclose(bin_);
    if (!finished_) {
        std::remove(bin_tmp_.c_str());
        std::remove(idx_tmp_.c_str());
    }
}

void IndexedDatasetWriter::add_sequence(std::span<const int32_t> tokens) {
    LOOM_CHECK(!finished_, "sequence added to '" << prefix_ << "' after finish()", "");
    const size_t item = index_dtype_size(static_cast<uint8_t>(dtype_));
    int64_t      lo = 0, hi = 0;
    switch (dtype_) {
        case IndexDType::u8:  lo = 0;      hi = 255;   break;
        case IndexDType::i8:  lo = -128;   hi = 127;   break;
        case IndexDType::i16: lo = -32768; hi = 32767; break;
        case IndexDType::u16: lo = 0;      hi = 65535; break;
        default: lo = std::numeric_limits<int32_t>::min(); hi = std::numeric_limits<int32_t>::max(); break;
    }
    buffer_.resize(tokens.size() * item);
    for (size_t i = 0; i < tokens.size(); ++i) {
        int64_t t = tokens[i];
        LOOM_CHECK(t >= lo && t <= hi, "token " << t << " does not fit the " << index_dtype_name(static_cast<uint8_t>(dtype_))
                                                << " elements of '" << data_file_path(prefix_) << "'",
                   "write the dataset with int32 tokens (a vocabulary of 65500 or more)");
        uint8_t * p = buffer_.data() + i * item;
        switch (dtype_) {
            case IndexDType::u8:  { uint8_t  v = static_cast<uint8_t>(t);  std::memcpy(p, &v, 1); break; }
            case IndexDType::i8:  { int8_t   v = static_cast<int8_t>(t);   std::memcpy(p, &v, 1); break; }
            case IndexDType::i16: { int16_t  v = static_cast<int16_t>(t);  std::memcpy(p, &v, 2); break; }
            case IndexDType::u16: { uint16_t v = static_cast<uint16_t>(t); std::memcpy(p, &v, 2); break; }
            case IndexDType::i64: { int64_t  v = t;                        std::memcpy(p, &v, 8); break; }
            default:              { int32_t  v = static_cast<int32_t>(t);  std::memcpy(p, &v, 4); break; }
        }
    }
    LOOM_CHECK(tokens.size() <= static_cast<size_t>(std::numeric_limits<int32_t>::max()),
               "a sequence of " << tokens.size() << " tokens does not fit the int32 lengths of '"
                                << index_file_path(prefix_) << "'",
               "split the document into shorter sequences");
    write_or_throw(bin_, buffer_.data(), buffer_.size(), bin_tmp_);
    lengths_.push_back(static_cast<int32_t>(tokens.size()));
    pointers_.push_back(bin_bytes_);
    bin_bytes_  += static_cast<int64_t>(buffer_.size());
    num_tokens_ += static_cast<int64_t>(tokens.size());
}

void IndexedDatasetWriter::end_document() {
    document_indices_.push_back(static_cast<int64_t>(lengths_.size()));
}

void IndexedDatasetWriter::add_document(std::span<const int32_t> tokens) {
    add_sequence(tokens);
    end_document();
}

void IndexedDatasetWriter::finish() {
    LOOM_CHECK(!finished_, "finish() called twice on the writer of '" << prefix_ << "'", "");
    if (document_indices_.back() != static_cast<int64_t>(lengths_.size())) end_document();

    std::FILE * bin = bin_;
    bin_ = nullptr;
    close_or_throw(bin, bin_tmp_);

    std::FILE * idx = std::fopen(idx_tmp_.c_str(), "wb");
    LOOM_CHECK(idx != nullptr, "cannot create '" << idx_tmp_ << "': " << std::strerror(errno),
               "check that the folder of --output-prefix is writable");
    try {
        uint64_t version = kIndexVersion;
        uint8_t  code    = static_cast<uint8_t>(dtype_);
        uint64_t n       = lengths_.size();
        uint64_t d       = document_indices_.size();
        write_or_throw(idx, kIndexMagic, sizeof(kIndexMagic), idx_tmp_);
        write_or_throw(idx, &version, 8, idx_tmp_);
        write_or_throw(idx, &code, 1, idx_tmp_);
        write_or_throw(idx, &n, 8, idx_tmp_);
        write_or_throw(idx, &d, 8, idx_tmp_);
        write_or_throw(idx, lengths_.data(), lengths_.size() * sizeof(int32_t), idx_tmp_);
        write_or_throw(idx, pointers_.data(), pointers_.size() * sizeof(int64_t), idx_tmp_);
        write_or_throw(idx, document_indices_.data(), document_indices_.size() * sizeof(int64_t), idx_tmp_);
    } catch (...) {
        std::fclose(idx);
        throw;
    }
    close_or_throw(idx, idx_tmp_);

    // .bin first: an .idx in place always describes a complete .bin.
    for (const auto & [from, to] : {std::pair{bin_tmp_, data_file_path(prefix_)}, std::pair{idx_tmp_, index_file_path(prefix_)}}) {
        rename_into_place(from, to);
    }
    finished_ = true;
}

}  // namespace loom::data
