#include "data/gpt2_bpe.h"

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_checks.h"
#include "data/unicode_tables.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <array>
#include <cerrno>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <iterator>

namespace loom::data {

namespace {

using unicode::CharClass;

// ---------------------------------------------------------------------------------------------------
// UTF-8 and character classes

constexpr uint32_t kNotUtf8 = 0xFFFFFFFF;   // a byte that starts no valid UTF-8 sequence

struct Utf8Char {
    uint32_t cp;    // code point, or kNotUtf8
    uint32_t len;   // bytes
};

// The character at s[i]. Overlong forms, surrogates and code points above U+10FFFF are not valid: their
// first byte is returned alone as kNotUtf8.
inline Utf8Char next_char(std::string_view s, size_t i) {
    const auto * p = reinterpret_cast<const unsigned char *>(s.data());
    const size_t n = s.size();
    uint32_t     c = p[i];
    if (c < 0x80) return {c, 1};
    auto cont = [&](size_t k) { return i + k < n && (p[i + k] & 0xC0) == 0x80; };
    if (c >= 0xC2 && c <= 0xDF) {
        if (cont(1)) return {(c & 0x1F) << 6 | (p[i + 1] & 0x3Fu), 2};
    } else if (c >= 0xE0 && c <= 0xEF) {
        if (cont(1) && cont(2)) {
            uint32_t cp = (c & 0x0F) << 12 | (p[i + 1] & 0x3Fu) << 6 | (p[i + 2] & 0x3Fu);
            if (cp >= 0x800 && (cp < 0xD800 || cp > 0xDFFF)) return {cp, 3};
        }
    } else if (c >= 0xF0 && c <= 0xF4) {
        if (cont(1) && cont(2) && cont(3)) {
            uint32_t cp = (c & 0x07) << 18 | (p[i + 1] & 0x3Fu) << 12 | (p[i + 2] & 0x3Fu) << 6 | (p[i + 3] & 0x3Fu);
            if (cp >= 0x10000 && cp <= 0x10FFFF) return {cp, 4};
        }
    }
    return {kNotUtf8, 1};
}

constexpr std::array<CharClass, 128> kAsciiClass = [] {
    std::array<CharClass, 128> table{};
    for (const unicode::CodePointRange & r : unicode::kCharClassRanges) {
        for (uint32_t cp = r.first; cp <= r.last && cp < 128; ++cp) table[cp] = static_cast<CharClass>(r.cls);
    }
    return table;
}();

inline CharClass char_class(uint32_t cp) {
    if (cp < 128) return kAsciiClass[cp];
    const unicode::CodePointRange * begin = std::begin(unicode::kCharClassRanges);
    const unicode::CodePointRange * end   = std::end(unicode::kCharClassRanges);
    const unicode::CodePointRange * after =
        std::upper_bound(begin, end, cp, [](uint32_t v, const unicode::CodePointRange & r) { return v < r.first; });
    if (after == begin || cp > (after - 1)->last) return CharClass::other;   // kNotUtf8 lands here too
    return static_cast<CharClass>((after - 1)->cls);
}

// The length of the contraction 's 't 're 've 'm 'll 'd at s[i] == '\'', or 0.
inline size_t contraction_length(std::string_view s, size_t i) {
    if (i + 1 >= s.size()) return 0;
    char a = s[i + 1];
    if (a == 's' || a == 't' || a == 'm' || a == 'd') return 2;
    if (i + 2 >= s.size()) return 0;
    char b = s[i + 2];
    return (a == 'r' && b == 'e') || (a == 'v' && b == 'e') || (a == 'l' && b == 'l') ? 3 : 0;
}

// ---------------------------------------------------------------------------------------------------
// bytes_to_unicode

constexpr bool is_printable_byte(uint32_t b) {
    return (b >= 0x21 && b <= 0x7E) || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF);
}

constexpr std::array<uint32_t, 256> kByteToUnicode = [] {
    std::array<uint32_t, 256> table{};
    uint32_t                  next = 256;
    for (uint32_t b = 0; b < 256; ++b) table[b] = is_printable_byte(b) ? b : next++;
    return table;
}();

constexpr uint32_t kByteSymbolEnd = 256 + 68;   // every symbol code point is below this

constexpr std::array<int16_t, kByteSymbolEnd> kUnicodeToByte = [] {
    std::array<int16_t, kByteSymbolEnd> table{};
    for (int16_t & t : table) t = -1;
    for (uint32_t b = 0; b < 256; ++b) table[kByteToUnicode[b]] = static_cast<int16_t>(b);
    return table;
}();

// The bytes a vocabulary symbol stands for: each character through the inverse of bytes_to_unicode. A
// symbol with a character outside the table (an added special token) stands for its own UTF-8 text.
std::string symbol_bytes(const std::string & symbol) {
    std::string bytes;
    for (size_t i = 0; i < symbol.size();) {
        Utf8Char c = next_char(symbol, i);
        if (c.cp >= kByteSymbolEnd || kUnicodeToByte[c.cp] < 0) return symbol;
        bytes += static_cast<char>(kUnicodeToByte[c.cp]);
        i += c.len;
    }
    return bytes;
}

constexpr int64_t kMaxTokenId     = (int64_t{1} << 24) - 1;   // far above any real vocabulary
constexpr size_t  kMaxCachedWords = size_t{1} << 18;           // the word cache is cleared when it holds more

}  // namespace

// ---------------------------------------------------------------------------------------------------
// UTF-8

void append_utf8(std::string & out, uint32_t cp) {
    if (cp < 0x80) {
        out += static_cast<char>(cp);
    } else if (cp < 0x800) {
        out += static_cast<char>(0xC0 | cp >> 6);
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else if (cp < 0x10000) {
        out += static_cast<char>(0xE0 | cp >> 12);
        out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    } else {
        out += static_cast<char>(0xF0 | cp >> 18);
        out += static_cast<char>(0x80 | (cp >> 12 & 0x3F));
        out += static_cast<char>(0x80 | (cp >> 6 & 0x3F));
        out += static_cast<char>(0x80 | (cp & 0x3F));
    }
}

// ---------------------------------------------------------------------------------------------------
// Pre-tokenisation

void gpt2_pretokenize(std::string_view text, std::vector<std::string_view> & out) {
    const size_t n = text.size();
    size_t       i = 0;
    while (i < n) {
        // 's|'t|'re|'ve|'m|'ll|'d
        if (text[i] == '\'') {
            if (size_t m = contraction_length(text, i)) {
                out.push_back(text.substr(i, m));
                i += m;
                continue;
            }
        }
        // ' ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+': a run of one class, with an optional leading space.
        Utf8Char  first = next_char(text, i);
        CharClass cls   = char_class(first.cp);
        size_t    j     = i + first.len;
        if (first.cp == ' ' && j < n) {
            Utf8Char  second = next_char(text, j);
            CharClass next   = char_class(second.cp);
            if (next != CharClass::space) {
                cls = next;
                j += second.len;
            }
        }
        if (cls != CharClass::space) {
            while (j < n) {
                Utf8Char c = next_char(text, j);
                if (char_class(c.cp) != cls) break;
                j += c.len;
            }
            out.push_back(text.substr(i, j - i));
            i = j;
            continue;
        }
        // '\s+(?!\S)|\s+': the whole run at the end of the text; else the run less its last character
        // (which may then join the word after it), unless that would leave nothing.
        size_t last = i;   // where the run's last character starts
        while (j < n) {
            Utf8Char c = next_char(text, j);
            if (char_class(c.cp) != CharClass::space) break;
            last = j;
            j += c.len;
        }
        size_t end = j == n || last == i ? j : last;
        out.push_back(text.substr(i, end - i));
        i = end;
    }
}

std::vector<std::string_view> gpt2_pretokenize(std::string_view text) {
    std::vector<std::string_view> out;
    gpt2_pretokenize(text, out);
    return out;
}

uint32_t gpt2_byte_to_unicode(uint8_t byte) { return kByteToUnicode[byte]; }

// ---------------------------------------------------------------------------------------------------
// Gpt2BpeTokenizer

Gpt2BpeTokenizer::Gpt2BpeTokenizer(const std::string & vocab_file, const std::string & merge_file)
    : vocab_file_(vocab_file) {
    load_vocab();
    load_merges(merge_file);
}

void Gpt2BpeTokenizer::load_vocab() {
    const std::string text = read_input_file(vocab_file_, "vocab file");
    nlohmann::json    j;
    try {
        j = nlohmann::json::parse(text, json_parse_checks<nlohmann::json>("vocab file '" + vocab_file_ + "'"));
    } catch (const nlohmann::json::parse_error & e) {
        size_t at   = std::min<size_t>(e.byte, text.size());
        auto   line = 1 + std::count(text.begin(), text.begin() + static_cast<std::ptrdiff_t>(at), '\n');
        LOOM_THROW("vocab file '" << vocab_file_ << "' line " << line << " is not valid JSON: " << json_error_text(e),
                   "--vocab-file takes a GPT-2 vocab.json: one JSON object mapping each token to its id");
    } catch (const nlohmann::json::exception & e) {   // a number out of range, ...
        LOOM_THROW("vocab file '" << vocab_file_ << "' is not valid JSON: " << json_error_text(e),
                   "--vocab-file takes a GPT-2 vocab.json: one JSON object mapping each token to its id");
    }
    LOOM_CHECK(j.is_object(), "vocab file '" << vocab_file_ << "' holds a JSON " << j.type_name() << ", not an object",
               "--vocab-file takes a GPT-2 vocab.json: one JSON object mapping each token to its id");
    LOOM_CHECK(!j.empty(), "vocab file '" << vocab_file_ << "' is an empty JSON object", "give a GPT-2 vocab.json");

    std::vector<const std::string *> symbol_of;   // id -> its symbol, to name duplicates
    vocab_.reserve(j.size());
    for (auto & [symbol, value] : j.items()) {
        LOOM_CHECK(value.is_number_integer() && value.get<int64_t>() >= 0 && value.get<int64_t>() <= kMaxTokenId,
                   "vocab file '" << vocab_file_ << "': token \"" << symbol << "\" has id " << value.dump()
                                  << ", not an integer in [0, " << kMaxTokenId << "]",
                   "--vocab-file takes a GPT-2 vocab.json: one JSON object mapping each token to its id");
        auto id = static_cast<int32_t>(value.get<int64_t>());
        if (static_cast<size_t>(id) >= symbol_of.size()) symbol_of.resize(static_cast<size_t>(id) + 1, nullptr);
        auto it = vocab_.emplace(symbol, id).first;   // JSON object keys are distinct
        LOOM_CHECK(symbol_of[static_cast<size_t>(id)] == nullptr,
                   "vocab file '" << vocab_file_ << "': tokens \"" << *symbol_of[static_cast<size_t>(id)] << "\" and \""
                                  << symbol << "\" both have id " << id,
                   "every token of a vocab.json needs its own id");
        symbol_of[static_cast<size_t>(id)] = &it->first;
    }

    id_bytes_.assign(symbol_of.size(), std::string());
    id_present_.assign(symbol_of.size(), false);
    for (auto & [symbol, id] : vocab_) {
        id_bytes_[static_cast<size_t>(id)]   = symbol_bytes(symbol);
        id_present_[static_cast<size_t>(id)] = true;
    }
    for (uint32_t b = 0; b < 256; ++b) {
        std::string symbol;
        append_utf8(symbol, kByteToUnicode[b]);
        byte_ids_[b] = token_id(symbol);
    }
    eod_ = token_id(kGpt2EndOfText);
}

void Gpt2BpeTokenizer::load_merges(const std::string & merge_file) {
    InputStream in = open_input_file(merge_file, "merge file");
    std::string              line;
    int64_t                  line_number = 0;
    int32_t                  rank        = 0;
    std::vector<std::string> parts;
    while (read_line(in.get(), line)) {
        ++line_number;
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (line_number == 1 && line.rfind("#version", 0) == 0) continue;
        parts.clear();
        for (size_t i = 0; i < line.size();) {
            size_t start = line.find_first_not_of(" \t", i);
            if (start == std::string::npos) break;
            size_t stop = std::min(line.find_first_of(" \t", start), line.size());
            parts.push_back(line.substr(start, stop - start));
            i = stop;
        }
        if (parts.empty()) continue;
        const std::string where = "merge file '" + merge_file + "' line " + std::to_string(line_number);
        LOOM_CHECK(parts.size() == 2, where << " is not two symbols separated by a space: \"" << line << "\"",
                   "--merge-file takes a GPT-2 merges.txt: an optional \"#version\" line, then one merge \"a b\" "
                   "per line");
        const int32_t ids[2] = {token_id(parts[0]), token_id(parts[1])};
        for (size_t k = 0; k < 2; ++k) {
            LOOM_CHECK(ids[k] >= 0, where << ": symbol \"" << parts[k] << "\" is not in vocab file '" << vocab_file_ << "'",
                       "--vocab-file and --merge-file must come from the same tokenizer");
        }
        const int32_t result = token_id(parts[0] + parts[1]);
        LOOM_CHECK(result >= 0, where << ": the merge \"" << parts[0] << parts[1] << "\" of \"" << parts[0] << "\" and \""
                                      << parts[1] << "\" is not in vocab file '" << vocab_file_ << "'",
                   "--vocab-file and --merge-file must come from the same tokenizer");
        // A repeated merge takes the rank of its last line, as in encoder.py's dict.
        merges_[pair_key(ids[0], ids[1])] = Merge{rank++, result};
    }
    LOOM_CHECK(!std::ferror(in.get()), "error reading merge file '" << merge_file << "' at line " << line_number, "check the file");
}

int32_t Gpt2BpeTokenizer::token_id(std::string_view symbol) const {
    auto it = vocab_.find(symbol);
    return it == vocab_.end() ? -1 : it->second;
}

int32_t Gpt2BpeTokenizer::eod() const {
    LOOM_CHECK(eod_ >= 0, "vocab file '" << vocab_file_ << "' has no \"" << kGpt2EndOfText
                                         << "\" token, GPT-2's end of document",
               "give GPT-2's vocab.json, or convert with --no-append-eod");
    return eod_;
}

void Gpt2BpeTokenizer::encode_piece(std::string_view piece, std::vector<int32_t> & out) {
    auto byte_id = [&](char c) {
        auto b = static_cast<unsigned char>(c);
        if (byte_ids_[b] < 0) {
            std::string symbol;
            append_utf8(symbol, kByteToUnicode[b]);
            char hex[8];
            std::snprintf(hex, sizeof(hex), "0x%02X", b);
            LOOM_THROW("vocab file '" << vocab_file_ << "' has no token \"" << symbol << "\" for byte " << hex
                                      << ", so text holding that byte cannot be tokenized",
                       "a byte-level BPE vocab.json holds all 256 byte tokens; check --vocab-file");
        }
        return byte_ids_[b];
    };
    if (piece.size() == 1) {
        out.push_back(byte_id(piece[0]));
        return;
    }
    if (auto hit = cache_.find(piece); hit != cache_.end()) {
        out.insert(out.end(), hit->second.begin(), hit->second.end());
        return;
    }
    word_.clear();
    for (char c : piece) word_.push_back(byte_id(c));
    while (word_.size() > 1) {
        // The adjacent pair of lowest rank ...
        Merge  best{INT32_MAX, -1};
        size_t best_at = 0;
        for (size_t k = 0; k + 1 < word_.size(); ++k) {
            auto it = merges_.find(pair_key(word_[k], word_[k + 1]));
            if (it != merges_.end() && it->second.rank < best.rank) {
                best    = it->second;
                best_at = k;
            }
        }
        if (best.result < 0) break;
        // ... merged wherever it occurs, left to right.
        const int32_t left = word_[best_at], right = word_[best_at + 1];
        merged_.assign(word_.begin(), word_.begin() + static_cast<std::ptrdiff_t>(best_at));
        for (size_t k = best_at; k < word_.size();) {
            if (k + 1 < word_.size() && word_[k] == left && word_[k + 1] == right) {
                merged_.push_back(best.result);
                k += 2;
            } else {
                merged_.push_back(word_[k]);
                k += 1;
            }
        }
        word_.swap(merged_);
    }
    out.insert(out.end(), word_.begin(), word_.end());
    if (cache_.size() >= kMaxCachedWords) cache_.clear();
    cache_.emplace(std::string(piece), word_);
}

void Gpt2BpeTokenizer::encode(std::string_view text, std::vector<int32_t> & out) {
    pieces_.clear();
    gpt2_pretokenize(text, pieces_);
    for (std::string_view piece : pieces_) encode_piece(piece, out);
}

std::vector<int32_t> Gpt2BpeTokenizer::encode(std::string_view text) {
    std::vector<int32_t> out;
    encode(text, out);
    return out;
}

std::string Gpt2BpeTokenizer::decode(std::span<const int32_t> ids) const {
    std::string out;
    for (int32_t id : ids) {
        LOOM_CHECK(id >= 0 && id < vocab_size() && id_present_[static_cast<size_t>(id)],
                   "token id " << id << " is not in vocab file '" << vocab_file_ << "' (" << vocab_.size()
                               << " tokens, ids up to " << vocab_size() - 1 << ")",
                   "decode ids made with the same vocab.json");
        out += id_bytes_[static_cast<size_t>(id)];
    }
    return out;
}

}  // namespace loom::data
