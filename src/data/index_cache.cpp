#include "data/index_cache.h"

#include "core/atomic_file.h"
#include "core/error.h"
#include "core/input_file.h"

#include <array>
#include <bit>
#include <cerrno>
#include <cstring>
#include <filesystem>
#include <sys/stat.h>

namespace loom::data {

static_assert(std::endian::native == std::endian::little, "the .npy files are written as the host stores them");

// ---------------------------------------------------------------------------------------------------
// MD5 (RFC 1321)

namespace {

constexpr std::array<uint32_t, 64> kMd5Sines = {
    0xd76aa478, 0xe8c7b756, 0x242070db, 0xc1bdceee, 0xf57c0faf, 0x4787c62a, 0xa8304613, 0xfd469501,
    0x698098d8, 0x8b44f7af, 0xffff5bb1, 0x895cd7be, 0x6b901122, 0xfd987193, 0xa679438e, 0x49b40821,
    0xf61e2562, 0xc040b340, 0x265e5a51, 0xe9b6c7aa, 0xd62f105d, 0x02441453, 0xd8a1e681, 0xe7d3fbc8,
    0x21e1cde6, 0xc33707d6, 0xf4d50d87, 0x455a14ed, 0xa9e3e905, 0xfcefa3f8, 0x676f02d9, 0x8d2a4c8a,
    0xfffa3942, 0x8771f681, 0x6d9d6122, 0xfde5380c, 0xa4beea44, 0x4bdecfa9, 0xf6bb4b60, 0xbebfbc70,
    0x289b7ec6, 0xeaa127fa, 0xd4ef3085, 0x04881d05, 0xd9d4d039, 0xe6db99e5, 0x1fa27cf8, 0xc4ac5665,
    0xf4292244, 0x432aff97, 0xab9423a7, 0xfc93a039, 0x655b59c3, 0x8f0ccc92, 0xffeff47d, 0x85845dd1,
    0x6fa87e4f, 0xfe2ce6e0, 0xa3014314, 0x4e0811a1, 0xf7537e82, 0xbd3af235, 0x2ad7d2bb, 0xeb86d391,
};
constexpr std::array<int, 16> kMd5Shifts = {7, 12, 17, 22, 5, 9, 14, 20, 4, 11, 16, 23, 6, 10, 15, 21};

// One 64-byte block into the state (a, b, c, d).
void md5_block(std::array<uint32_t, 4> & state, const uint8_t * block) {
    uint32_t m[16];
    for (int i = 0; i < 16; ++i) {
        m[i] = uint32_t(block[4 * i]) | uint32_t(block[4 * i + 1]) << 8 | uint32_t(block[4 * i + 2]) << 16 |
               uint32_t(block[4 * i + 3]) << 24;
    }
    uint32_t a = state[0], b = state[1], c = state[2], d = state[3];
    for (int i = 0; i < 64; ++i) {
        uint32_t f;
        int      g;
        switch (i / 16) {
            case 0:  f = (b & c) | (~b & d); g = i; break;
            case 1:  f = (d & b) | (~d & c); g = (5 * i + 1) % 16; break;
            case 2:  f = b ^ c ^ d;          g = (3 * i + 5) % 16; break;
            default: f = c ^ (b | ~d);       g = (7 * i) % 16; break;
        }
        f = f + a + kMd5Sines[i] + m[g];
        a = d;
        d = c;
        c = b;
        b = b + std::rotl(f, kMd5Shifts[(i / 16) * 4 + i % 4]);
    }
    state[0] += a;
    state[1] += b;
    state[2] += c;
    state[3] += d;
}

}  // namespace

std::string md5_hex(std::string_view bytes) {
    std::array<uint32_t, 4> state = {0x67452301, 0xefcdab89, 0x98badcfe, 0x10325476};
    const auto *            data  = reinterpret_cast<const uint8_t *>(bytes.data());
    size_t                  whole = bytes.size() / 64 * 64;
    for (size_t at = 0; at < whole; at += 64) md5_block(state, data + at);
    // The tail, 0x80, zeros to 56 mod 64, and the length in bits (little-endian, 64 bits).
    std::vector<uint8_t> tail(data + whole, data + bytes.size());
    tail.push_back(0x80);
    while (tail.size() % 64 != 56) tail.push_back(0);
    const uint64_t bits = static_cast<uint64_t>(bytes.size()) * 8;
    for (int i = 0; i < 8; ++i) tail.push_back(static_cast<uint8_t>(bits >> (8 * i)));
    for (size_t at = 0; at < tail.size(); at += 64) md5_block(state, tail.data() + at);
    static const char hex[] = "0123456789abcdef";
    std::string       out;
    for (uint32_t word : state) {
        for (int i = 0; i < 4; ++i) {
            const uint8_t byte = static_cast<uint8_t>(word >> (8 * i));
            out += hex[byte >> 4];
            out += hex[byte & 15];
        }
    }
    return out;
}

// ---------------------------------------------------------------------------------------------------
// .npy

namespace {

template <typename T> const char * npy_descr() {
    if constexpr (std::is_same_v<T, int16_t>) return "<i2";
    else if constexpr (std::is_same_v<T, int32_t>) return "<i4";
    else return "<i8";
}

constexpr char kNpyMagic[] = "\x93NUMPY";

// The value after 'key': in a .npy header dict, as text up to the next ',' or '}' (a tuple whole).
std::string header_value(const std::string & header, const std::string & key, const std::string & path) {
    const size_t at = header.find("'" + key + "'");
    LOOM_CHECK(at != std::string::npos, "'" << path << "' is not a .npy file Loom can read: its header has no '" << key
                                            << "' (header: " << header << ")",
               "delete the cached index files of this set; Loom rebuilds them");
    size_t begin = header.find(':', at);
    LOOM_CHECK(begin != std::string::npos, "'" << path << "': malformed .npy header " << header, "");
    begin = header.find_first_not_of(' ', begin + 1);
    size_t end;
    if (begin != std::string::npos && header[begin] == '(') {
        end = header.find(')', begin);
        LOOM_CHECK(end != std::string::npos, "'" << path << "': malformed .npy shape in " << header, "");
        ++end;
    } else {
        end = header.find_first_of(",}", begin);
    }
    LOOM_CHECK(begin != std::string::npos && end != std::string::npos, "'" << path << "': malformed .npy header " << header,
               "");
    std::string value = header.substr(begin, end - begin);
    while (!value.empty() && value.back() == ' ') value.pop_back();
    return value;
}

}  // namespace

template <typename T>
void write_npy(const std::string & path, std::span<const T> values, std::span<const int64_t> shape) {
    int64_t count = 1;
    for (int64_t n : shape) count *= n;
    LOOM_CHECK(count == static_cast<int64_t>(values.size()),
               "write_npy('" << path << "'): the shape holds " << count << " values, the data " << values.size(), "");
    std::string dims;
    for (int64_t n : shape) dims += std::to_string(n) + ", ";
    if (shape.size() > 1) dims.resize(dims.size() - 2);   // "(3, 2)"; one dimension keeps its comma: "(3,)"
    else if (!dims.empty()) dims.resize(dims.size() - 1);
    std::string header = std::string("{'descr': '") + npy_descr<T>() + "', 'fortran_order': False, 'shape': (" + dims + "), }";
    const size_t unpadded = 10 + header.size() + 1;
    header.append((64 - unpadded % 64) % 64, ' ');
    header += '\n';
    std::string prologue(kNpyMagic, 6);
    prologue += '\x01';
    prologue += '\x00';
    prologue += static_cast<char>(header.size() & 0xff);
    prologue += static_cast<char>(header.size() >> 8);
    AtomicFile file(path);
    file.write(prologue.data(), prologue.size());
    file.write(header.data(), header.size());
    file.write(values.data(), values.size_bytes());
    file.commit();
}

template <typename T> NpyArray<T> read_npy(const std::string & path) {
    const char * hint = "delete the cached index files of this set (the files sharing its hash prefix) and run again; "
                        "Loom rebuilds and rewrites them";
    InputStream  in   = open_input_file(path, "cached index");
    struct stat  st;
    LOOM_CHECK(::fstat(fileno(in.get()), &st) == 0, "cannot stat '" << path << "': " << std::strerror(errno), "");
    const int64_t file_size = st.st_size;
    char          prologue[12];
    LOOM_CHECK(file_size >= 10 && std::fread(prologue, 1, 10, in.get()) == 10 && std::memcmp(prologue, kNpyMagic, 6) == 0,
               "'" << path << "' is not a .npy file (no \\x93NUMPY magic)", hint);
    const int major       = static_cast<uint8_t>(prologue[6]);
    size_t    header_size = 0, header_at = 10;
    if (major == 1) {
        header_size = static_cast<uint8_t>(prologue[8]) | static_cast<size_t>(static_cast<uint8_t>(prologue[9])) << 8;
    } else {
        LOOM_CHECK((major == 2 || major == 3) && file_size >= 12 && std::fread(prologue + 10, 1, 2, in.get()) == 2,
                   "'" << path << "' is a .npy file of version " << major << ", which Loom does not read", hint);
        header_size = 0;
        for (int i = 0; i < 4; ++i) header_size |= static_cast<size_t>(static_cast<uint8_t>(prologue[8 + i])) << (8 * i);
        header_at = 12;
    }
    LOOM_CHECK(static_cast<int64_t>(header_at + header_size) <= file_size,
               "'" << path << "' is truncated: its .npy header of " << header_size << " bytes runs past the file's "
                   << file_size << " bytes",
               hint);
    std::string header(header_size, '\0');
    LOOM_CHECK(std::fread(header.data(), 1, header_size, in.get()) == header_size, "cannot read '" << path << "'", hint);
    const std::string descr = header_value(header, "descr", path);
    LOOM_CHECK(descr == std::string("'") + npy_descr<T>() + "'",
               "'" << path << "' holds dtype " << descr << ", and Loom's index is " << npy_descr<T>(), hint);
    LOOM_CHECK(header_value(header, "fortran_order", path) == "False",
               "'" << path << "' is in Fortran order, and Loom's indices are in C order", hint);
    const std::string shape_text = header_value(header, "shape", path);
    NpyArray<T>       array;
    int64_t           count = 1;
    for (size_t at = 1; at < shape_text.size();) {
        const size_t stop = shape_text.find_first_of(",)", at);
        if (stop == std::string::npos) break;
        std::string part = shape_text.substr(at, stop - at);
        part.erase(0, part.find_first_not_of(' '));
        if (!part.empty()) {
            size_t  used = 0;
            int64_t n    = -1;
            try {
                n = std::stoll(part, &used);
            } catch (const std::exception &) {
                used = 0;
            }
            LOOM_CHECK(used == part.size() && n >= 0 && n < (int64_t{1} << 40),
                       "'" << path << "': malformed .npy shape " << shape_text, hint);
            array.shape.push_back(n);
            count *= n;
        }
        at = stop + 1;
    }
    const int64_t expected = static_cast<int64_t>(header_at + header_size) + count * static_cast<int64_t>(sizeof(T));
    LOOM_CHECK(file_size == expected, "'" << path << "' is " << file_size << " bytes, and its header (shape "
                                          << shape_text << ", " << npy_descr<T>() << ") makes it " << expected
                                          << (file_size < expected ? " (truncated)" : " (trailing bytes)"),
               hint);
    array.values.resize(static_cast<size_t>(count));
    LOOM_CHECK(std::fread(array.values.data(), sizeof(T), array.values.size(), in.get()) == array.values.size(),
               "cannot read the values of '" << path << "'", hint);
    return array;
}

template void write_npy<int16_t>(const std::string &, std::span<const int16_t>, std::span<const int64_t>);
template void write_npy<int32_t>(const std::string &, std::span<const int32_t>, std::span<const int64_t>);
template void write_npy<int64_t>(const std::string &, std::span<const int64_t>, std::span<const int64_t>);
template NpyArray<int16_t> read_npy<int16_t>(const std::string &);
template NpyArray<int32_t> read_npy<int32_t>(const std::string &);
template NpyArray<int64_t> read_npy<int64_t>(const std::string &);

// ---------------------------------------------------------------------------------------------------
// A cached set

IndexCacheEntry::IndexCacheEntry(const IndexCacheOptions & options, std::string description, const std::string & cls,
                                 const std::string & split)
    : options_(options), description_(std::move(description)) {
    if (enabled()) {   // joined as paths: "cache/" and "cache" name the same files
        base_ = (std::filesystem::path(options_.path) / (md5_hex(description_) + "-" + cls + "-" + split + "-")).string();
    }
}

bool IndexCacheEntry::complete(std::span<const std::string> arrays) const {
    if (!enabled()) return false;
    std::error_code ec;
    if (!std::filesystem::is_regular_file(path("description.txt"), ec)) return false;
    for (const std::string & suffix : arrays) {
        if (!std::filesystem::is_regular_file(path(suffix), ec)) return false;
    }
    return true;
}

void IndexCacheEntry::check_description() const {
    const std::string file = path("description.txt");
    const std::string text = read_input_file(file, "cached index description");
    LOOM_CHECK(text == description_,
               "'" << file << "' does not describe the indices this run needs (its text differs from the expected "
                   << description_.size() << "-byte description, under the same MD5)",
               "delete the files of this set (the files sharing its hash prefix) and run again; Loom rebuilds them");
}

bool IndexCacheEntry::start_writing(std::string & note) const {
    if (!enabled()) return false;
    if (!writes()) {
        note = " [indices built, not in " + options_.path + " yet]";
        return false;
    }
    note = " [indices written to " + options_.path + "]";
    create_folder();
    return true;
}

void IndexCacheEntry::create_folder() const {
    std::error_code ec;
    std::filesystem::create_directories(options_.path, ec);   // another rank may create it at the same time
    LOOM_CHECK(std::filesystem::is_directory(options_.path, ec),
               "--data-cache-path '" << options_.path << "' is not a folder and cannot be created"
                                     << (ec ? ": " + ec.message() : std::string()),
               "give a folder Loom can write to");
}

void IndexCacheEntry::write_description() const { write_file_atomically(path("description.txt"), description_); }

}  // namespace loom::data
