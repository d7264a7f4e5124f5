// Megatron's indexed dataset (MMIDIDX): a pair of files <prefix>.bin and <prefix>.idx, read and written
// byte for byte as megatron/core/datasets/indexed_dataset.py does.
//
// <prefix>.bin: the token ids of every sequence, concatenated, no header; the element type is given by
// the .idx dtype code (uint16 when the vocabulary is below 65500, else int32, as preprocess_data.py picks).
//
// <prefix>.idx: little-endian, unaligned:
//
//   offset     bytes  field
//   0          9      magic "MMIDIDX\0\0"
//   9          8      uint64 version = 1
//   17         1      uint8  dtype code: 1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
//   18         8      uint64 sequence count N
//   26         8      uint64 document count D (includes the leading 0: there are D - 1 documents)
//   34         4N     int32  sequence_lengths[N]      tokens per sequence
//   34+4N      8N     int64  sequence_pointers[N]     BYTE offset of each sequence in .bin
//   34+12N     8D     int64  document_indices[D]      0, then the sequence index at which each document ends
//   34+12N+8D  N      int8   sequence_modes[N]        only in multimodal datasets (accepted, ignored)
//
// Worked example: two documents, [5 7 9] and [1 2] + [3] (the second holds two sequences), uint16 tokens:
//   .bin = 05 00 07 00 09 00 01 00 02 00 03 00                                   (12 bytes)
//   .idx = "MMIDIDX\0\0" | 01 00 00 00 00 00 00 00 | 08 | N = 3 | D = 3
//          | lengths 3, 2, 1 | pointers 0, 6, 10 | document indices 0, 1, 3        (34 + 12N + 8D = 94 bytes)
//
// The int64 arrays start at 34 + 4N, which is not 8-byte aligned: they are read with memcpy from the
// mapping (MappedFile::load), never through a cast pointer.
//
// IndexedDataset maps both files and validates, before anything is read: the magic, the version, the
// dtype code, that the three arrays fit the .idx size exactly (or with the multimodal modes), that every
// sequence [pointer, pointer + length * itemsize) lies inside .bin, and that the document indices start
// at 0, never decrease and end at N. Each failure is a loom::Error naming the file and the field.
//
// IndexedDatasetWriter streams tokens to <prefix>.bin.tmp.<pid>, writes <prefix>.idx.tmp.<pid> on
// finish(), flushes both to disk and renames .bin then .idx into place, so a crash never leaves an .idx
// that describes a missing or partial .bin; a writer destroyed before finish() removes its temporaries.
#pragma once

#include "data/mapped_file.h"

#include <cstdint>
#include <cstdio>
#include <optional>
#include <span>
#include <utility>
#include <string>
#include <vector>

namespace loom::data {

inline constexpr char     kIndexMagic[9]    = {'M', 'M', 'I', 'D', 'I', 'D', 'X', '\0', '\0'};
inline constexpr uint64_t kIndexVersion     = 1;
inline constexpr size_t   kIndexHeaderBytes = 34;

// Megatron's dtype codes (indexed_dataset.py, DType).
enum class IndexDType : uint8_t { u8 = 1, i8 = 2, i16 = 3, i32 = 4, i64 = 5, f64 = 6, f32 = 7, u16 = 8 };

// Bytes per element of a dtype code; 0 for a code Megatron does not define.
size_t       index_dtype_size(uint8_t code);
const char * index_dtype_name(uint8_t code);   // "uint16", ...; "unknown" for others
// The token type preprocess_data.py picks: uint16 below 65500 tokens of vocabulary, else int32.
IndexDType   index_dtype_for_vocab(int64_t vocab_size);

std::string index_file_path(const std::string & prefix);   // <prefix>.idx
std::string data_file_path(const std::string & prefix);    // <prefix>.bin

class IndexedDataset {
public:
    // Maps <prefix>.idx and <prefix>.bin and validates them (see the top of this file).
    explicit IndexedDataset(const std::string & prefix);

    const std::string & prefix() const { return prefix_; }
    IndexDType          dtype() const { return static_cast<IndexDType>(dtype_code_); }
    size_t              token_bytes() const { return token_bytes_; }
    int64_t             num_sequences() const { return num_sequences_; }              // N
    int64_t             num_documents() const { return num_document_indices_ - 1; }   // D - 1
    int64_t             num_tokens() const { return num_tokens_; }                    // sum of the lengths

    int32_t sequence_length(int64_t i) const;    // 0 <= i < N
    int64_t sequence_pointer(int64_t i) const;   // bytes into .bin
    int64_t document_index(int64_t d) const;     // 0 <= d < D; document_index(0) == 0
    // All N lengths, copied out (the sample-index builder walks them many times).
    std::vector<int32_t> sequence_lengths() const;

    // Tokens [offset, offset + out.size()) of sequence i, widened to int32.
    void                 read(int64_t i, int64_t offset, std::span<int32_t> out) const;
    std::vector<int32_t> sequence(int64_t i) const;
    // The smallest and largest token id in .bin (one vectorised pass over the file, done on the first call);
    // {0, -1} if it is empty.
    std::pair<int64_t, int64_t> token_range() const;
    int64_t                     max_token() const { return token_range().second; }

    // How the id `top` (normally the largest) is used: the largest id below it, and the first place it
    // appears other than as the last token of a sequence. An end-of-document token sits at the top of the
    // vocabulary and ends every sequence; a single corrupt id far above the rest does neither. One pass.
    struct TopTokenUse {
        int64_t next_below     = -1;   // -1: no smaller id
        int64_t inner_sequence = -1;   // -1: `top` only ever ends a sequence
        int64_t inner_offset   = -1;
    };
    TopTokenUse top_token_use(int64_t top) const;

private:
    std::string     prefix_;
    MappedFile      idx_, bin_;
    uint8_t         dtype_code_  = 0;
    size_t          token_bytes_ = 0;
    int64_t         num_sequences_ = 0, num_document_indices_ = 0, num_tokens_ = 0;
    size_t          lengths_at_ = 0, pointers_at_ = 0, documents_at_ = 0;   // byte offsets into .idx
    mutable std::optional<std::pair<int64_t, int64_t>> token_range_;        // computed on first use
};

class IndexedDatasetWriter {
public:
    // Starts <prefix>.bin.tmp.<pid>; tokens are stored as `dtype` (any integer code Megatron defines).
    IndexedDatasetWriter(const std::string & prefix, IndexDType dtype);
    // Removes the temporary files unless finish() ran.
    ~IndexedDatasetWriter();
    IndexedDatasetWriter(const IndexedDatasetWriter &) = delete;
    IndexedDatasetWriter & operator=(const IndexedDatasetWriter &) = delete;

    // Appends one sequence; throws if a token does not fit the dtype.
    void add_sequence(std::span<const int32_t> tokens);
    // Closes the current document after the sequences added since the last end_document().
    void end_document();
    // add_sequence + end_document: the usual one-sequence document.
    void add_document(std::span<const int32_t> tokens);

    // Writes the .idx, flushes both files and renames them into place. Sequences added after the last
    // end_document() are closed into a final document first.
    void finish();

    int64_t num_sequences() const { return static_cast<int64_t>(lengths_.size()); }
    int64_t num_tokens() const { return num_tokens_; }

private:
    std::string          prefix_, bin_tmp_, idx_tmp_;
    IndexDType           dtype_;
    std::FILE *          bin_ = nullptr;
    std::vector<int32_t> lengths_;            // (N)
    std::vector<int64_t> pointers_;           // (N) bytes
    std::vector<int64_t> document_indices_{0};  // (D)
    std::vector<uint8_t> buffer_;
    int64_t              num_tokens_ = 0, bin_bytes_ = 0;
    bool                 finished_ = false;
};

}  // namespace loom::data
