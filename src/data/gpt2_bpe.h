// GPT-2's byte-level BPE tokenizer (Megatron's GPT2BPETokenizer, OpenAI's encoder.py, Hugging Face's
// GPT2Tokenizer), reading the Hugging Face files:
//
//   vocab.json   a JSON object {symbol: id}; a symbol is a string of bytes_to_unicode() characters (below)
//   merges.txt   an optional first line "#version: ...", then one merge "a b" per line; the rank of a
//                merge is its line order (blank lines are skipped). Megatron always drops the first
//                line; Hugging Face, and Loom, drop it only when it starts with "#version".
//
// Encoding a text is four steps, exactly as encoder.py does them:
//
//   1. Pre-tokenise with GPT-2's pattern, applied over UTF-8 code points (gpt2_pretokenize):
//        's|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+
//      The first alternative that matches at the current position wins and the next match starts where
//      it ends, so the pieces tile the text. Contractions are lowercase only ("'S" is "'" then "S"); a
//      single space joins the letters, digits or punctuation after it; of a run of spaces followed by a
//      word, all but the last character form one piece ("   x" -> "  ", " x"). \p{L}, \p{N} and \s are
//      Unicode classes (data/unicode_tables.h); a byte that is not valid UTF-8 counts as punctuation.
//   2. Map each piece's UTF-8 bytes to symbols with bytes_to_unicode(): the printable bytes "!".."~",
//      "¡".."¬", "®".."ÿ" map to themselves, the other 68 bytes to U+0100.. in order (byte 0 -> "Ā",
//      the space 0x20 -> "Ġ", "\n" -> "Ċ").
//   3. Merge: while some adjacent pair of symbols is a merge, take the pair of lowest rank and merge every
//      occurrence of it, left to right, without overlap.
//   4. Look every resulting symbol up in vocab.json.
//
// Worked example (GPT-2's real files): "Hello, world!" -> pieces "Hello", ",", " world", "!" -> symbols
// "Hello", ",", "Ġworld", "!" -> ids 15496, 11, 995, 0.
//
// The end-of-document token is the id of "<|endoftext|>" (50256 in GPT-2). Text is never scanned for
// it: a literal "<|endoftext|>" in a document is tokenized as ordinary characters, as encoder.py does.
// decode() inverts encode() byte for byte: decode(encode(s)) == s for every string, valid UTF-8 or not.
//
// Loading checks the files and throws loom::Error naming the file (and the merges line) when one is
// unreadable, vocab.json is not a JSON object of distinct non-negative integer ids, a merges line is not
// exactly two symbols, or a merge's symbols or its result are not in vocab.json. A byte whose symbol is
// not in the vocabulary (never the case in a byte-level vocabulary) throws when it is met in a text.
//
// encode() keeps a cache of the ids of every piece it has merged (bounded; cleared when full), so a
// tokenizer is not safe to share between threads: give each thread its own.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <string>
#include <string_view>
#include <unordered_map>
#include <vector>

namespace loom::data {

inline constexpr std::string_view kGpt2EndOfText = "<|endoftext|>";

// Step 1 above: the pieces of `text` (views into it), appended to `out`. Concatenated they are `text`.
void                          gpt2_pretokenize(std::string_view text, std::vector<std::string_view> & out);
std::vector<std::string_view> gpt2_pretokenize(std::string_view text);

// The code point bytes_to_unicode() maps a byte to (0x21 -> 0x21, 0x20 -> 0x120 "Ġ", 0x00 -> 0x100 "Ā").
uint32_t gpt2_byte_to_unicode(uint8_t byte);

// Appends code point `cp` (at most U+10FFFF) to `out` as UTF-8.
void append_utf8(std::string & out, uint32_t cp);

class Gpt2BpeTokenizer {
public:
    // Reads and checks both files (see the top of this file).
    Gpt2BpeTokenizer(const std::string & vocab_file, const std::string & merge_file);

    // The ids of `text`, appended to `out` / returned.
    void                 encode(std::string_view text, std::vector<int32_t> & out);
    std::vector<int32_t> encode(std::string_view text);
    // The bytes the ids stand for; throws naming the vocab file for an id it does not hold.
    std::string decode(std::span<const int32_t> ids) const;

    bool    has_eod() const { return eod_ >= 0; }
    // The id of "<|endoftext|>"; throws naming the vocab file when it has none.
    int32_t eod() const;
    // The id of a vocabulary symbol (in bytes_to_unicode form, e.g. "Ġthe"), -1 when absent.
    int32_t token_id(std::string_view symbol) const;

    int64_t             vocab_size() const { return static_cast<int64_t>(id_bytes_.size()); }   // largest id + 1
    int64_t             num_merges() const { return static_cast<int64_t>(merges_.size()); }
    const std::string & vocab_file() const { return vocab_file_; }

private:
    struct StringHash {
        using is_transparent = void;
        size_t operator()(std::string_view s) const { return std::hash<std::string_view>{}(s); }
    };
    struct Merge {
        int32_t rank;
        int32_t result;   // the id of the merged symbol
    };
    using SymbolMap = std::unordered_map<std::string, int32_t, StringHash, std::equal_to<>>;
    using WordCache = std::unordered_map<std::string, std::vector<int32_t>, StringHash, std::equal_to<>>;

    static uint64_t pair_key(int32_t left, int32_t right) {
        return static_cast<uint64_t>(static_cast<uint32_t>(left)) << 32 | static_cast<uint32_t>(right);
    }
    void load_vocab();
    void load_merges(const std::string & merge_file);
    // Steps 2-4 for one piece, appended to `out`.
    void encode_piece(std::string_view piece, std::vector<int32_t> & out);

    std::string                            vocab_file_;
    SymbolMap                              vocab_;          // symbol -> id
    std::vector<std::string>               id_bytes_;       // (V) the bytes each id decodes to
    std::vector<bool>                      id_present_;     // (V) false for ids vocab.json skips
    std::unordered_map<uint64_t, Merge>    merges_;         // (left id, right id) -> rank, result
    int32_t                                byte_ids_[256];  // the id of each byte's symbol, -1 if absent
    int32_t                                eod_ = -1;
    WordCache                              cache_;          // piece bytes -> ids
    std::vector<int32_t>                   word_, merged_;  // scratch of encode_piece
    std::vector<std::string_view>          pieces_;         // scratch of encode
};

}  // namespace loom::data
