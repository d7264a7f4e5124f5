// loom data: convert text or JSON lines into a Megatron indexed dataset with byte-level tokens
// (data/preprocess.h has the format and the document rules).
//
//   loom data --input corpus.jsonl --output-prefix out/corpus     -> out/corpus_text_document.{bin,idx}
//   loom data --input book.txt --output-prefix out/book           documents separated by blank lines
//   loom data --input lines.txt --output-prefix out/l --text-documents line
//
// Tokens are each document's UTF-8 bytes (0-255) followed by the end-of-document token 256, so the
// vocabulary is 257 (256 with --no-append-eod); train on the result with `--data-path out/corpus_text_document`.
// GPT-2 BPE (--vocab-file / --merge-file, --tokenizer-type GPT2BPETokenizer) is not implemented yet and
// is refused with exit status 2.
#include "apps/loom/commands.h"
#include "core/error.h"
#include "data/preprocess.h"

#include <CLI/CLI.hpp>

#include <cstdio>
#include <map>

namespace loom::app {

int cmd_data(int argc, char ** argv) {
    CLI::App app{"Convert a text file or JSON lines into a Megatron .bin/.idx dataset with byte-level tokens "
                 "(vocabulary 257: bytes 0-255 and the end-of-document token 256).",
                 "loom data"};
    data::PreprocessOptions options;
    std::string             format = "auto", text_documents = "paragraph", tokenizer = "byte";
    std::string             vocab_file, merge_file;
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
    app.add_flag("--no-append-eod", no_eod, "do not end each document with the end-of-document token 256");
    app.add_option("--tokenizer-type", tokenizer, "byte (GPT2BPETokenizer is not implemented yet)")->capture_default_str();
    app.add_option("--vocab-file", vocab_file, "GPT-2 vocab.json (BPE is not implemented yet)");
    app.add_option("--merge-file", merge_file, "GPT-2 merges.txt (BPE is not implemented yet)");
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    LOOM_CHECK(vocab_file.empty() && merge_file.empty() && (tokenizer == "byte" || tokenizer == "ByteTokenizer"),
               "GPT-2 BPE tokenization (" << (vocab_file.empty() && merge_file.empty() ? "--tokenizer-type " + tokenizer
                                                                                       : std::string("--vocab-file / --merge-file"))
                                          << ") is not implemented yet",
               "drop --vocab-file, --merge-file and --tokenizer-type to convert with byte-level tokens (vocabulary 257), "
               "or tokenize with Megatron's tools/preprocess_data.py, whose output `loom train --data-path` reads");
    options.format         = format == "text" ? data::InputFormat::text
                             : format == "jsonl" ? data::InputFormat::jsonl
                                                 : data::InputFormat::automatic;
    options.text_documents = text_documents == "line" ? data::TextDocuments::line : data::TextDocuments::paragraph;
    options.append_eod     = !no_eod;

    data::PreprocessResult r = data::preprocess_to_indexed_dataset(options);   // throws: exit 2
    std::printf("wrote %s.bin and %s.idx: %lld documents, %lld tokens, %s tokens, vocabulary %lld (bytes%s)%s\n",
                r.prefix.c_str(), r.prefix.c_str(), static_cast<long long>(r.documents),
                static_cast<long long>(r.tokens), data::index_dtype_name(static_cast<uint8_t>(r.dtype)),
                static_cast<long long>(r.vocab_size), options.append_eod ? " + end-of-document 256" : "",
                r.skipped ? (", " + std::to_string(r.skipped) + " empty documents skipped").c_str() : "");
    return 0;
}

}  // namespace loom::app
