#include "data/preprocess.h"

#include "core/error.h"
#include "core/input_file.h"
#include "core/json_checks.h"
#include "data/gpt2_bpe.h"

#include <nlohmann/json.hpp>

#include <cerrno>
#include <cstring>
#include <fstream>
#include <memory>

namespace loom::data {

std::string document_dataset_prefix(const std::string & output_prefix, const std::string & json_key) {
    return output_prefix + "_" + json_key + "_document";
}

std::vector<int32_t> byte_tokens(std::string_view text, bool append_eod) {
    std::vector<int32_t> tokens;
    tokens.reserve(text.size() + 1);
    for (char c : text) tokens.push_back(static_cast<int32_t>(static_cast<unsigned char>(c)));
    if (append_eod) tokens.push_back(kByteEod);
    return tokens;
}

namespace {

bool is_blank(const std::string & line) { return line.find_first_not_of(" \t\r\n\f\v") == std::string::npos; }

bool ends_with(const std::string & s, const char * suffix) {
    size_t n = std::strlen(suffix);
    return s.size() >= n && s.compare(s.size() - n, n, suffix) == 0;
}

}  // namespace

PreprocessResult preprocess_to_indexed_dataset(const PreprocessOptions & options) {
    LOOM_CHECK(!options.json_key.empty(), "--json-key is empty", "give the JSON field that holds the text, e.g. --json-key text");
    PreprocessResult result;
    result.prefix     = document_dataset_prefix(options.output_prefix, options.json_key);
    result.format     = options.format;
    if (result.format == InputFormat::automatic) {
        result.format = ends_with(options.input, ".jsonl") || ends_with(options.input, ".json") ? InputFormat::jsonl
                                                                                                : InputFormat::text;
    }
    LOOM_CHECK(options.vocab_file.empty() == options.merge_file.empty(),
               "GPT-2 BPE needs both --vocab-file and --merge-file; only "
                   << (options.vocab_file.empty() ? "--merge-file" : "--vocab-file") << " was given",
               "give both (vocab.json and merges.txt of the same tokenizer), or neither for byte tokens");
    std::unique_ptr<Gpt2BpeTokenizer> bpe;
    if (!options.vocab_file.empty()) {
        bpe               = std::make_unique<Gpt2BpeTokenizer>(options.vocab_file, options.merge_file);
        result.bpe        = true;
        result.vocab_size = bpe->vocab_size();
        result.eod        = options.append_eod ? bpe->eod() : -1;
    } else {
        result.vocab_size = options.append_eod ? kByteEod + 1 : 256;
        result.eod        = options.append_eod ? kByteEod : -1;
    }
    result.dtype      = index_dtype_for_vocab(result.vocab_size);

    InputStream in = open_input_file(options.input, "--input");

    IndexedDatasetWriter writer(result.prefix, result.dtype);
    std::vector<int32_t> tokens;
    auto emit = [&](std::string_view text) {
        if (text.empty()) {
            ++result.skipped;
            return;
        }
        if (bpe) {
            tokens.clear();
            bpe->encode(text, tokens);
            if (options.append_eod) tokens.push_back(static_cast<int32_t>(result.eod));
        } else {
            tokens = byte_tokens(text, options.append_eod);
        }
        writer.add_document(tokens);
        ++result.documents;
    };

    std::string line, paragraph;
    bool        in_paragraph = false;
    int64_t     line_number  = 0;
    while (read_line(in.get(), line)) {
        ++line_number;
        if (result.format == InputFormat::jsonl) {
            if (is_blank(line)) continue;
            nlohmann::json j;
            try {
                j = nlohmann::json::parse(line, json_parse_checks<nlohmann::json>(
                    "--input '" + options.input + "' line " + std::to_string(line_number)));
            } catch (const nlohmann::json::exception & e) {
                LOOM_THROW("--input '" << options.input << "' line " << line_number << " is not valid JSON: " << json_error_text(e),
                           "give one JSON object per line (JSON lines), or --format text for a plain text file");
            }
            LOOM_CHECK(j.is_object(), "--input '" << options.input << "' line " << line_number
                                                  << " is JSON but not an object",
                       "give one JSON object per line, e.g. {\"text\": \"...\"}");
            auto it = j.find(options.json_key);
            if (it == j.end()) {
                std::string keys;
                for (auto & [k, v] : j.items()) keys += (keys.empty() ? "" : ", ") + k;
                LOOM_THROW("--input '" << options.input << "' line " << line_number << " has no \"" << options.json_key
                                       << "\" field (its fields: " << (keys.empty() ? "none" : keys) << ")",
                           "name the field that holds the text with --json-key");
            }
            LOOM_CHECK(it->is_string(), "--input '" << options.input << "' line " << line_number << ": field \""
                                                    << options.json_key << "\" is a " << it->type_name()
                                                    << ", not a string",
                       "the --json-key field must hold the document's text");
            emit(it->get_ref<const std::string &>());
            continue;
        }
        if (!line.empty() && line.back() == '\r') line.pop_back();
        if (options.text_documents == TextDocuments::line) {
            if (!is_blank(line)) emit(line);
            continue;
        }
        if (is_blank(line)) {
            if (in_paragraph) emit(paragraph);
            paragraph.clear();
            in_paragraph = false;
        } else {
            if (in_paragraph) paragraph += '\n';
            paragraph += line;
            in_paragraph = true;
        }
    }
    LOOM_CHECK(!std::ferror(in.get()), "error reading --input '" << options.input << "' at line " << line_number, "check the file");
    if (in_paragraph) emit(paragraph);
    LOOM_CHECK(result.documents > 0, "--input '" << options.input << "' holds no non-empty document",
               (result.format == InputFormat::jsonl ? "check --json-key and that the file is JSON lines"
                                                    : "give a text file with at least one non-blank line"));
    writer.finish();
    result.tokens = writer.num_tokens();
    return result;
}

}  // namespace loom::data
