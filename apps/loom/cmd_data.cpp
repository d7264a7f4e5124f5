// loom data: convert text or JSON lines into a Megatron indexed dataset of byte-level or GPT-2 BPE tokens
// (data/preprocess.h has the format and the document rules, data/gpt2_bpe.h the tokenizer).
//
//   loom data --input corpus.jsonl --output-prefix out/corpus     -> out/corpus_text_document.{bin,idx}
//   loom data --input book.txt --output-prefix out/book           documents separated by blank lines
//   loom data --input lines.txt --output-prefix out/l --text-documents line
//   loom data --input c.jsonl --output-prefix out/c --vocab-file gpt2/vocab.json --merge-file gpt2/merges.txt
//                                                 GPT-2 BPE (--tokenizer-type GPT2BPETokenizer may be added)
//
// Byte tokens (the default, --tokenizer-type byte) are each document's UTF-8 bytes (0-255) followed by
// the end-of-document token 256, so the vocabulary is 257 (256 with --no-append-eod). GPT-2 BPE tokens
// (--vocab-file and --merge-file, with --tokenizer-type GPT2BPETokenizer or without it) are the ids of
// Megatron's GPT2BPETokenizer followed by the id of "<|endoftext|>" (50256 in GPT-2's vocab.json), stored
// as uint16 below 65500 tokens of vocabulary. Train on the result with `--data-path out/corpus_text_document`.
// Only one of --vocab-file / --merge-file, or GPT2BPETokenizer without them, exits with status 2.
#include "apps/loom/commands.h"
#include "core/error.h"
#include "data/preprocess.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>
#include <string>

namespace loom::app {

int cmd_data(int argc, char ** argv) {
    CLI::App app{"Convert a text file or JSON lines into a Megatron .bin/.idx dataset with byte-level tokens "
                 "(vocabulary 257: bytes 0-255 and the end-of-document token 256) or GPT-2 BPE tokens "
                 "(--vocab-file and --merge-file).",
                 "loom data"};
    data::PreprocessOptions options;
    std::string             format = "auto", text_documents = "paragraph", tokenizer;
    bool                    no_eod = false;
    app.add_option("--input", options.input, "a text file, or JSON lines (*.json / *.jsonl, or --format jsonl)")->required();
    app.add_option("--output-prefix,--output_prefix", options.output_prefix,
                   "output prefix; the files are PREFIX_KEY_document.{bin,idx}")
        ->required();
    app.add_option("--json-key,--json-keys", options.json_key, "the JSON field that holds each document's text")
        ->capture_default_str();
    app.add_option("--format", format, "auto (by extension), text or jsonl")
        ->check(CLI::IsMember({"auto", "text", "jsonl"}))
        ->capture_default_str();
    app.add_option("--text-documents", text_documents,
                   "how a text file splits into documents: paragraph (blank lines separate) or line")
        ->check(CLI::IsMember({"paragraph", "line"}))
        ->capture_default_str();
    app.add_flag("--no-append-eod", no_eod,
                 "do not end each document with the end-of-document token (256, or BPE's <|endoftext|>)");
    app.add_option("--tokenizer-type", tokenizer,
                   "byte (ByteTokenizer), or GPT2BPETokenizer (needs --vocab-file and --merge-file); "
                   "default: GPT2BPETokenizer when both files are given, else byte")
        ->check(CLI::IsMember({"byte", "ByteTokenizer", "GPT2BPETokenizer"}));
    app.add_option("--vocab-file", options.vocab_file, "GPT-2 BPE vocab.json (with --merge-file)");
    app.add_option("--merge-file", options.merge_file, "GPT-2 BPE merges.txt (with --vocab-file)");
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    const bool has_files = !options.vocab_file.empty() || !options.merge_file.empty();
    LOOM_CHECK(!options.vocab_file.empty() || options.merge_file.empty(), "--merge-file needs --vocab-file",
               "GPT-2 BPE reads both vocab.json (--vocab-file) and merges.txt (--merge-file)");
    LOOM_CHECK(options.vocab_file.empty() || !options.merge_file.empty(), "--vocab-file needs --merge-file",
               "GPT-2 BPE reads both vocab.json (--vocab-file) and merges.txt (--merge-file)");
    LOOM_CHECK(tokenizer != "GPT2BPETokenizer" || has_files,
               "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file",
               "give GPT-2's vocab.json and merges.txt, or drop --tokenizer-type for byte tokens");
    LOOM_CHECK(tokenizer.empty() || tokenizer == "GPT2BPETokenizer" || !has_files,
               "--vocab-file and --merge-file are GPT-2 BPE files, but --tokenizer-type is " << tokenizer,
               "drop --tokenizer-type (or give GPT2BPETokenizer) to tokenize with BPE, or drop the files for "
               "byte tokens");
    options.format         = format == "text" ? data::InputFormat::text
                             : format == "jsonl" ? data::InputFormat::jsonl
                                                 : data::InputFormat::automatic;
    options.text_documents = text_documents == "line" ? data::TextDocuments::line : data::TextDocuments::paragraph;
    options.append_eod     = !no_eod;

    data::PreprocessResult r = data::preprocess_to_indexed_dataset(options);   // throws: exit 2
    std::string vocabulary = r.bpe ? "GPT-2 BPE, " + options.vocab_file : std::string("bytes");
    if (r.eod >= 0) vocabulary += (r.bpe ? ", " : " + ") + std::string("end-of-document ") + std::to_string(r.eod);
    std::printf("wrote %s.bin and %s.idx: %lld documents, %lld tokens, %s tokens, vocabulary %lld (%s)%s\n",
                r.prefix.c_str(), r.prefix.c_str(), static_cast<long long>(r.documents),
                static_cast<long long>(r.tokens), data::index_dtype_name(static_cast<uint8_t>(r.dtype)),
                static_cast<long long>(r.vocab_size), vocabulary.c_str(),
                r.skipped ? (", " + std::to_string(r.skipped) + " empty documents skipped").c_str() : "");
    return 0;
}

}  // namespace loom::app
