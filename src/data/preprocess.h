// Text or JSON lines -> a Megatron indexed dataset of byte tokens or GPT-2 BPE tokens (what `loom data`
// runs), the C++ twin of Megatron's tools/preprocess_data.py.
//
// Output: <output-prefix>_<json-key>_document.{bin,idx} (preprocess_data.py's names; the key defaults to
// "text"), one sequence per document, written atomically by IndexedDatasetWriter.
//
// Tokens, by tokenizer:
//   byte (the default): the document's UTF-8 bytes, 0..255, followed by the end-of-document token
//     kByteEod = 256 (Megatron's --append-eod, on by default here so that samples crossing a document
//     boundary see it; turn it off with append_eod = false). The vocabulary is 257 (256 without EOD).
//   GPT-2 BPE (Megatron's GPT2BPETokenizer; vocab_file and merge_file both set): the ids of
//     Gpt2BpeTokenizer::encode (data/gpt2_bpe.h), followed by the id of "<|endoftext|>" (50256 for
//     GPT-2) when append_eod. The vocabulary is vocab.json's (largest id + 1; 50257 for GPT-2).
// Tokens are stored as uint16 when the vocabulary is below 65500, else int32 (index_dtype_for_vocab).
//
// Documents:
//   JSON lines (format jsonl, or auto for *.jsonl / *.json): every non-blank line is a JSON object whose
//     string field `json_key` is one document.
//   plain text (format text, or auto for anything else): with TextDocuments::paragraph (default) a
//     document is a maximal run of non-blank lines, joined by "\n" (blank lines separate documents);
//     with TextDocuments::line every non-blank line is a document. A trailing "\r" is dropped from lines.
//   Empty documents are skipped.
//
// Example: "Hi\nthere\n\nBye\n" as text -> documents "Hi\nthere" and "Bye" ->
//   tokens 72 105 10 116 104 101 114 101 256 | 66 121 101 256, N = 2, D = 3.
#pragma once

#include "data/indexed_dataset.h"

#include <cstdint>
#include <string>
#include <string_view>
#include <vector>

namespace loom::data {

inline constexpr int32_t kByteEod = 256;

enum class InputFormat { automatic, text, jsonl };
enum class TextDocuments { paragraph, line };

struct PreprocessOptions {
    std::string   input;
    std::string   output_prefix;
    std::string   json_key = "text";
    InputFormat   format = InputFormat::automatic;
    TextDocuments text_documents = TextDocuments::paragraph;
    bool          append_eod = true;
    std::string   vocab_file;   // GPT-2 vocab.json and merges.txt: both set for BPE tokens, neither for
    std::string   merge_file;   // byte tokens
};

struct PreprocessResult {
    std::string prefix;          // <output_prefix>_<json_key>_document
    InputFormat format;          // as resolved from automatic
    int64_t     documents = 0;   // written
    int64_t     skipped = 0;     // empty documents not written
    int64_t     tokens = 0;
    int64_t     vocab_size = 0;  // bytes: 257 with EOD, else 256; BPE: the vocab.json's
    int64_t     eod = -1;        // the end-of-document token appended, -1 with append_eod false
    bool        bpe = false;     // GPT-2 BPE tokens, else bytes
    IndexDType  dtype = IndexDType::u16;
};

// "<output_prefix>_<json_key>_document"
std::string document_dataset_prefix(const std::string & output_prefix, const std::string & json_key);
// The bytes of `text` as tokens, then kByteEod when append_eod.
std::vector<int32_t> byte_tokens(std::string_view text, bool append_eod);

// Converts options.input; throws loom::Error naming the input file (and line) on unreadable input, and
// naming the flag or file at fault for a vocab_file without merge_file (or the reverse) or a malformed one.
PreprocessResult preprocess_to_indexed_dataset(const PreprocessOptions & options);

}  // namespace loom::data
