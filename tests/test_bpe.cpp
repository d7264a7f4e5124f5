// GPT-2 byte-level BPE (data/gpt2_bpe.h): the pieces and ids equal those of an independent Python
// reference encoder (tools/make_bpe_fixture.py, using the `regex` module and GPT-2's pattern) on the
// fixture vocabulary in tests/fixtures/bpe for every test string, the training sample and random strings
// over every character class; decode(encode(s)) == s byte for byte, invalid UTF-8 included; malformed
// vocab/merges files throw naming the file and line; `loom data` with BPE writes encode(text) + EOD per
// document, and refuses half a tokenizer with exit status 2. Ids are compared exactly. FIM samples
// (data/fim.h) are checked at the end of the file.
#include "core/error.h"
#include "data/blended_dataset.h"
#include "data/fim.h"
#include "data/gpt2_bpe.h"
#include "data/indexed_dataset.h"
#include "data/preprocess.h"

#include "error_text.h"
#include "loom_cli_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
#include <fstream>
#include <functional>
#include <iterator>
#include <string>
#include <unistd.h>
#include <vector>

using namespace loom;
using namespace loom::data;

namespace {

const std::string kFixtures = LOOM_BPE_FIXTURE_DIR;
const std::string kVocab    = kFixtures + "/vocab.json";
const std::string kMerges   = kFixtures + "/merges.txt";

std::string temp_path(const std::string & name) {
    return testing::TempDir() + "loom_test_bpe_" + std::to_string(::getpid()) + "_" + name;
}

std::string read_text(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_text(const std::string & path, const std::string & text) {
    std::ofstream(path, std::ios::binary | std::ios::trunc) << text;
}

nlohmann::json expected() { return nlohmann::json::parse(read_text(kFixtures + "/expected.json")); }


std::vector<std::string> pieces_of(std::string_view text) {
    std::vector<std::string> out;
    for (std::string_view piece : gpt2_pretokenize(text)) out.emplace_back(piece);
    return out;
}

// The UTF-8 symbol of a byte, as vocab.json spells it.
std::string byte_symbol(uint8_t byte) {
    std::string s;
    append_utf8(s, gpt2_byte_to_unicode(byte));
    return s;
}

// A byte-level vocabulary of the 256 byte symbols (ids 0..255 in byte order) plus `extra`.
std::string write_vocab(const std::string & name, const nlohmann::json & extra, int skip_byte = -1) {
    nlohmann::json vocab = nlohmann::json::object();
    for (int b = 0; b < 256; ++b) {
        if (b != skip_byte) vocab[byte_symbol(static_cast<uint8_t>(b))] = b;
    }
    for (auto & [symbol, id] : extra.items()) vocab[symbol] = id;
    std::string path = temp_path(name);
    write_text(path, vocab.dump());
    return path;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// Against the Python reference encoder

TEST(Gpt2Bpe, PiecesAndIdsEqualThePythonReferenceForEveryFixtureString) {
    Gpt2BpeTokenizer tok(kVocab, kMerges);
    nlohmann::json   e = expected();
    ASSERT_GE(e["cases"].size(), 40u);
    for (const nlohmann::json & c : e["cases"]) {
        const std::string text = c["text"].get<std::string>();
        EXPECT_EQ(pieces_of(text), c["pretokens"].get<std::vector<std::string>>()) << "text: " << c["text"].dump();
        EXPECT_EQ(tok.encode(text), c["ids"].get<std::vector<int32_t>>()) << "text: " << c["text"].dump();
    }
    // Twice: the second pass is served from the word cache.
    for (const nlohmann::json & c : e["cases"]) {
        EXPECT_EQ(tok.encode(c["text"].get<std::string>()), c["ids"].get<std::vector<int32_t>>());
    }
}

TEST(Gpt2Bpe, FixtureVocabularyHasGpt2sLayoutAndEndOfText) {
    Gpt2BpeTokenizer tok(kVocab, kMerges);
    nlohmann::json   e = expected();
    EXPECT_EQ(tok.vocab_size(), e["vocab_size"].get<int64_t>());
    EXPECT_EQ(tok.num_merges(), e["num_merges"].get<int64_t>());
    ASSERT_TRUE(tok.has_eod());
    EXPECT_EQ(tok.eod(), e["eod"].get<int32_t>());
    EXPECT_EQ(tok.eod(), tok.vocab_size() - 1);   // "<|endoftext|>" is last, as in GPT-2 (50256)
    // bytes_to_unicode and GPT-2's id order of the byte symbols.
    EXPECT_EQ(gpt2_byte_to_unicode('!'), 0x21u);
    EXPECT_EQ(gpt2_byte_to_unicode(' '), 0x120u);    // "Ġ"
    EXPECT_EQ(gpt2_byte_to_unicode('\n'), 0x10Au);   // "Ċ"
    EXPECT_EQ(gpt2_byte_to_unicode(0), 0x100u);      // "Ā"
    EXPECT_EQ(gpt2_byte_to_unicode(0xAD), 0x143u);   // the soft hyphen, the last byte remapped
    EXPECT_EQ(tok.token_id("!"), 0);
    EXPECT_EQ(tok.token_id("\xC4\xA0"), 220);   // "Ġ"
    EXPECT_EQ(tok.token_id("\xC4\x8A"), 198);   // "Ċ"
    EXPECT_EQ(tok.token_id("\xC4\x80"), 188);   // "Ā"
    EXPECT_EQ(tok.token_id("no such token"), -1);
    // "<|endoftext|>" in a text is ordinary characters; decoding the EOD id gives its spelling.
    std::vector<int32_t> ids = tok.encode("<|endoftext|>");
    EXPECT_EQ(std::count(ids.begin(), ids.end(), tok.eod()), 0);
    EXPECT_EQ(tok.decode(std::vector<int32_t>{tok.eod()}), "<|endoftext|>");
}

// ---------------------------------------------------------------------------------------------------
// Pre-tokenisation, by hand (each checked against Python's regex.findall with GPT-2's pattern)

TEST(Gpt2Bpe, PretokenizationFollowsGpt2sPattern) {
    using V = std::vector<std::string>;
    EXPECT_EQ(pieces_of("Hello world's  2024!!"), (V{"Hello", " world", "'s", " ", " 2024", "!!"}));
    EXPECT_EQ(pieces_of("Hello, world!"), (V{"Hello", ",", " world", "!"}));
    EXPECT_EQ(pieces_of(""), V{});
    EXPECT_EQ(pieces_of("   x"), (V{"  ", " x"}));                    // the last space joins the word
    EXPECT_EQ(pieces_of("a  \n"), (V{"a", "  \n"}));                  // trailing whitespace stays whole
    EXPECT_EQ(pieces_of("x\t\ty"), (V{"x", "\t", "\t", "y"}));        // only a space joins a word
    EXPECT_EQ(pieces_of("don't"), (V{"don", "'t"}));
    EXPECT_EQ(pieces_of("'S"), (V{"'", "S"}));                        // contractions are lowercase only
    EXPECT_EQ(pieces_of(" 's"), (V{" '", "s"}));                      // " ?[^\s\p{L}\p{N}]+" came first
    EXPECT_EQ(pieces_of("we'll 've'd"), (V{"we", "'ll", " '", "ve", "'d"}));
    EXPECT_EQ(pieces_of("3.14"), (V{"3", ".", "14"}));
    EXPECT_EQ(pieces_of("caf\u00e9\u65e5\u672c"), (V{"caf\u00e9\u65e5\u672c"}));   // Latin and CJK letters
    EXPECT_EQ(pieces_of("e\u0301"), (V{"e", "\u0301"}));                          // a combining mark is not \p{L}
    EXPECT_EQ(pieces_of("\u00a0x"), (V{"\u00a0", "x"}));                           // NBSP is \s, not " "
    EXPECT_EQ(pieces_of("x \u3000y"), (V{"x", " ", "\u3000", "y"}));
    EXPECT_EQ(pieces_of("\U0001F600\U0001F44D"), (V{"\U0001F600\U0001F44D"}));
    // Invalid UTF-8 counts as punctuation (Python: bytes decoded with errors="surrogateescape").
    EXPECT_EQ(pieces_of("a\xff\xfe" "b \xc3( ok\xed\xa0\x80"), (V{"a", "\xff\xfe", "b", " \xc3(", " ok", "\xed\xa0\x80"}));
}

TEST(Gpt2Bpe, DecodeInvertsEncodeByteForByte) {
    Gpt2BpeTokenizer         tok(kVocab, kMerges);
    std::vector<std::string> texts;
    const nlohmann::json     cases = expected();   // (iterating expected()["cases"] itself read a freed temporary)
    for (const nlohmann::json & c : cases["cases"]) texts.push_back(c["text"].get<std::string>());
    std::string every_byte;
    for (int b = 0; b < 256; ++b) every_byte += static_cast<char>(b);
    texts.push_back(every_byte);
    texts.push_back("truncated \xe6\x97 and overlong \xc0\xaf and surrogate \xed\xa0\x80 and \xf4\x90\x80\x80 too big");
    texts.push_back(read_text(kFixtures + "/sample.txt"));
    for (const std::string & text : texts) {
        std::vector<int32_t> ids = tok.encode(text);
        EXPECT_EQ(tok.decode(ids), text);
        for (int32_t id : ids) ASSERT_TRUE(id >= 0 && id < tok.eod()) << id;
    }
    // The sample the merges were trained on compresses; bytes it never saw do not.
    std::string sample = read_text(kFixtures + "/sample.txt");
    EXPECT_LT(tok.encode(sample).size(), sample.size() * 6 / 10);

    std::string message = error_of([&] { tok.decode(std::vector<int32_t>{1, 557}); });
    EXPECT_NE(message.find("token id 557"), std::string::npos) << message;
    EXPECT_NE(message.find(kVocab), std::string::npos) << message;
}

// ---------------------------------------------------------------------------------------------------
// Malformed files

TEST(Gpt2Bpe, MalformedFilesThrowNamingTheFileAndLine) {
    const std::string good_merges = temp_path("good_merges.txt");
    write_text(good_merges, "#version: 0.2\nh e\n");
    const std::string good_vocab = write_vocab("good_vocab.json", {{"he", 256}, {"<|endoftext|>", 257}});
    {
        Gpt2BpeTokenizer tok(good_vocab, good_merges);
        EXPECT_EQ(tok.encode("hehe"), (std::vector<int32_t>{256, 256}));
        EXPECT_EQ(tok.eod(), 257);
    }
    struct Case {
        std::string vocab_text, merges_text;   // empty vocab_text: the good vocabulary
        std::vector<std::string> names;        // each must appear in the message
    };
    const std::string bad_vocab  = temp_path("bad_vocab.json");
    const std::string bad_merges = temp_path("bad_merges.txt");
    const Case cases[] = {
        {"{\n\"a\": 0,\n oops}", "", {bad_vocab, "line 3", "not valid JSON"}},
        {"[1, 2]", "", {bad_vocab, "not an object"}},
        {"{\"a\": \"zero\"}", "", {bad_vocab, "\"a\"", "not an integer"}},
        {"{\"a\": -1}", "", {bad_vocab, "\"a\"", "not an integer"}},
        {"{\"a\": 0, \"b\": 0}", "", {bad_vocab, "both have id 0"}},
        {"", "#version: 0.2\nh e\nh e l\n", {bad_merges, "line 3", "not two symbols"}},
        {"", "h e\nhe\n", {bad_merges, "line 2", "not two symbols"}},
        {"", "#version: 0.2\nh e\nhe l\n", {bad_merges, "line 3", "\"hel\"", "is not in vocab file '" + good_vocab}},
        {"", "h e\nhe xyz\n", {bad_merges, "line 2", "\"xyz\"", "is not in vocab file '" + good_vocab}},
    };
    for (const Case & c : cases) {
        std::string vocab = good_vocab, merges = good_merges;
        if (!c.vocab_text.empty()) write_text(vocab = bad_vocab, c.vocab_text);
        if (!c.merges_text.empty()) write_text(merges = bad_merges, c.merges_text);
        std::string message = error_of([&] { Gpt2BpeTokenizer(vocab, merges); });
        for (const std::string & name : c.names) {
            EXPECT_NE(message.find(name), std::string::npos) << "expected '" << name << "' in: " << message;
        }
    }
    std::string message = error_of([&] { Gpt2BpeTokenizer("/nonexistent/vocab.json", good_merges); });
    EXPECT_NE(message.find("cannot read vocab file '/nonexistent/vocab.json'"), std::string::npos) << message;
    message = error_of([&] { Gpt2BpeTokenizer(good_vocab, "/nonexistent/merges.txt"); });
    EXPECT_NE(message.find("cannot read merge file '/nonexistent/merges.txt'"), std::string::npos) << message;

    // A vocabulary without "<|endoftext|>" tokenizes, but has no EOD.
    const std::string no_eod = write_vocab("no_eod.json", {{"he", 256}});
    Gpt2BpeTokenizer  tok(no_eod, good_merges);
    EXPECT_FALSE(tok.has_eod());
    message = error_of([&] { tok.eod(); });
    EXPECT_NE(message.find(no_eod), std::string::npos) << message;
    EXPECT_NE(message.find("<|endoftext|>"), std::string::npos) << message;
    // A vocabulary without a byte's symbol fails on a text holding that byte, naming the file.
    const std::string no_z = write_vocab("no_z.json", {{"he", 256}}, 'z');
    Gpt2BpeTokenizer  tok_z(no_z, good_merges);
    EXPECT_EQ(tok_z.encode("he"), (std::vector<int32_t>{256}));
    message = error_of([&] { tok_z.encode("hez"); });
    EXPECT_NE(message.find(no_z), std::string::npos) << message;
    EXPECT_NE(message.find("byte 0x7A"), std::string::npos) << message;
}

// ---------------------------------------------------------------------------------------------------
// Conversion: preprocess_to_indexed_dataset and `loom data`

namespace {

const std::vector<std::string> kDocuments = {
    "The quick brown fox didn't jump in 2024.",
    "Ελληνικά και 日本語 mixed with emoji \U0001F600 and   spaces\tand tabs",
    "I'm sure we'll check it.\nSecond line of the same document.",
};

std::string write_jsonl(const std::string & name) {
    std::string path = temp_path(name);
    std::string text;
    for (const std::string & d : kDocuments) text += nlohmann::json{{"text", d}}.dump() + "\n";
    write_text(path, text);
    return path;
}

}  // namespace

TEST(Gpt2Bpe, PreprocessWritesEachDocumentsIdsThenEod) {
    Gpt2BpeTokenizer  tok(kVocab, kMerges);
    PreprocessOptions o;
    o.input         = write_jsonl("docs.jsonl");
    o.output_prefix = temp_path("bpe");
    o.vocab_file    = kVocab;
    o.merge_file    = kMerges;
    PreprocessResult r = preprocess_to_indexed_dataset(o);
    EXPECT_TRUE(r.bpe);
    EXPECT_EQ(r.vocab_size, 557);
    EXPECT_EQ(r.eod, tok.eod());
    EXPECT_EQ(r.dtype, IndexDType::u16);
    IndexedDataset ds(r.prefix);
    ASSERT_EQ(ds.num_documents(), static_cast<int64_t>(kDocuments.size()));
    int64_t total = 0;
    for (size_t d = 0; d < kDocuments.size(); ++d) {
        std::vector<int32_t> want = tok.encode(kDocuments[d]);
        want.push_back(tok.eod());
        EXPECT_EQ(ds.sequence(static_cast<int64_t>(d)), want) << kDocuments[d];
        total += static_cast<int64_t>(want.size());
    }
    EXPECT_EQ(r.tokens, total);

    // Without EOD; and a vocabulary of 65500 or more stores int32.
    o.append_eod    = false;
    o.vocab_file    = write_vocab("big_vocab.json", {{"he", 256}, {"<|endoftext|>", 70000}});
    o.merge_file    = temp_path("big_merges.txt");
    o.output_prefix = temp_path("bpe_big");
    write_text(o.merge_file, "h e\n");
    r = preprocess_to_indexed_dataset(o);
    EXPECT_EQ(r.vocab_size, 70001);
    EXPECT_EQ(r.eod, -1);
    EXPECT_EQ(r.dtype, IndexDType::i32);
    Gpt2BpeTokenizer big(o.vocab_file, o.merge_file);
    EXPECT_EQ(IndexedDataset(r.prefix).sequence(0), big.encode(kDocuments[0]));

    o.merge_file.clear();
    std::string message = error_of([&] { preprocess_to_indexed_dataset(o); });
    EXPECT_NE(message.find("--merge-file"), std::string::npos) << message;
}

TEST(Gpt2Bpe, LoomDataTokenizesWithBpeAndRefusesHalfATokenizer) {
    const std::string jsonl  = write_jsonl("cli.jsonl");
    const std::string prefix = temp_path("cli");
    CliRun r = run_loom("data --input " + jsonl + " --output-prefix " + prefix + " --tokenizer-type GPT2BPETokenizer"
                        " --vocab-file " + kVocab + " --merge-file " + kMerges);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("vocabulary 557 (GPT-2 BPE"), std::string::npos) << r.out;
    Gpt2BpeTokenizer tok(kVocab, kMerges);
    IndexedDataset   ds(prefix + "_text_document");
    std::vector<int32_t> want = tok.encode(kDocuments[1]);
    want.push_back(tok.eod());
    EXPECT_EQ(ds.sequence(1), want);
    // --tokenizer-type may be left out when both files are given.
    r = run_loom("data --input " + jsonl + " --output-prefix " + prefix + "2 --vocab-file " + kVocab + " --merge-file " + kMerges);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_EQ(IndexedDataset(prefix + "2_text_document").sequence(1), want);

    const std::string base = "data --input " + jsonl + " --output-prefix " + temp_path("bad");
    struct Case {
        std::string args, names;
    } cases[] = {
        {base + " --vocab-file " + kVocab, "--merge-file"},
        {base + " --merge-file " + kMerges, "--vocab-file"},
        {base + " --tokenizer-type GPT2BPETokenizer", "--vocab-file and --merge-file"},
        {base + " --tokenizer-type SentencePieceTokenizer", "--tokenizer-type"},
        {base + " --tokenizer-type byte --vocab-file " + kVocab + " --merge-file " + kMerges, "--tokenizer-type is byte"},
        {base + " --vocab-file /nonexistent/vocab.json --merge-file " + kMerges, "/nonexistent/vocab.json"},
    };
    for (const Case & c : cases) {
        CliRun bad = run_loom(c.args);
        EXPECT_EQ(bad.status, 2) << c.args << " -> " << bad.out;
        EXPECT_NE(bad.out.find(c.names), std::string::npos) << c.args << " -> " << bad.out;
    }
}

// `loom train --tokenizer-type GPT2BPETokenizer --vocab-file --merge-file`: the vocabulary size is the
// tokenizer's (557 here), padded as Megatron pads it (to a multiple of 128 x TP), whatever the data reaches.
TEST(Gpt2Bpe, LoomTrainTakesTheVocabularyFromTheTokenizer) {
    const std::string jsonl  = write_jsonl("train.jsonl");
    const std::string prefix = temp_path("train");
    const std::string files  = " --vocab-file " + kVocab + " --merge-file " + kMerges;
    ASSERT_EQ(run_loom("data --input " + jsonl + " --output-prefix " + prefix + files).status, 0);
    const std::string base = "train --data-path " + prefix + "_text_document --split 100,0,0 --seq-length 16 "
                             "--num-layers 1 --train-iters 2 --log-interval 1";
    CliRun r = run_loom(base + " --tokenizer-type GPT2BPETokenizer" + files);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("vocab 557 (padded 640)"), std::string::npos) << r.out;
    struct Case {
        std::string args, names;
    } cases[] = {
        {base + " --tokenizer-type GPT2BPETokenizer --vocab-file " + kVocab, "needs --vocab-file and --merge-file"},
        {base + " --merge-file " + kMerges, "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"},
        {base + " --tokenizer-type GPT2BPETokenizer --vocab-size 600" + files,
         "--vocab-size 600 contradicts --vocab-file '" + kVocab + "', which holds 557 tokens"},
        {base + " --tokenizer-type NullTokenizer", "--tokenizer-type NullTokenizer needs --vocab-size"},
        {base + " --tokenizer-type SentencePieceTokenizer", "--tokenizer-type SentencePieceTokenizer is not supported"},
    };
    for (const Case & c : cases) {
        CliRun bad = run_loom(c.args);
        EXPECT_EQ(bad.status, 2) << c.args << " -> " << bad.out;
        EXPECT_NE(bad.out.find(c.names), std::string::npos) << c.args << " -> " << bad.out;
    }
    // The files alone mean GPT2BPETokenizer, pretrain_gpt.py's default --tokenizer-type.
    r = run_loom(base + files);
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("vocab 557 (padded 640)"), std::string::npos) << r.out;
    // NullTokenizer: the ids as they are, within --vocab-size.
    r = run_loom(base + " --tokenizer-type NullTokenizer --vocab-size 557");
    EXPECT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("vocab 557 (padded 640)"), std::string::npos) << r.out;
}

// ---------------------------------------------------------------------------------------------------
// Fill-in-the-middle samples (data/fim.h): the layouts, Megatron's treatment of empty documents, the
// rates, and the draws' dependence on (seed, sample) alone. Ids are compared exactly; the rates' counts
// within 4.5 standard deviations.

namespace {

// The fixture vocabulary plus the FIM sentinels and a file separator (557..561).
std::string write_fim_vocab() {
    nlohmann::json vocab = nlohmann::json::parse(read_text(kVocab));
    vocab["<fim_prefix>"] = 557;
    vocab["<fim_middle>"] = 558;
    vocab["<fim_suffix>"] = 559;
    vocab["<fim_pad>"]    = 560;
    vocab["<file_sep>"]   = 561;
    const std::string path = temp_path("fim_vocab.json");
    write_text(path, vocab.dump());
    return path;
}

struct FimFixture {
    std::shared_ptr<Gpt2BpeTokenizer> tok = std::make_shared<Gpt2BpeTokenizer>(write_fim_vocab(), kMerges);
    FimTransform make(double rate, double spm_rate, FimOptions o = {}) const {
        o.rate     = rate;
        o.spm_rate = spm_rate;
        return FimTransform(tok, o, 1234);
    }
};

constexpr int32_t kP = 557, kM = 558, kS = 559, kPad = 560, kSep = 561;

// The text of one transformed document's ids (nothing after it) read in the order `spm` says: its
// prefix + middle + suffix, decoded. Fails the test on another layout. (A PSM document with an empty prefix
// reads <P> <S> too, and gives the same text either way.)
std::string read_layout(Gpt2BpeTokenizer & tok, std::span<const int32_t> ids, bool spm) {
    auto at = [&](int32_t id) { return std::find(ids.begin(), ids.end(), id) - ids.begin(); };
    auto text = [&](std::ptrdiff_t from, std::ptrdiff_t to) {
        return tok.decode(std::vector<int32_t>(ids.begin() + from, ids.begin() + to));
    };
    const std::ptrdiff_t n = static_cast<std::ptrdiff_t>(ids.size()), p = at(kP), s = at(kS), m = at(kM);
    EXPECT_EQ(p, 0);
    EXPECT_TRUE(s < m && m < n) << "a sentinel is missing or out of order";
    if (spm) {   // <P> <S> suffix <M> prefix middle: prefix and middle are one run of text
        EXPECT_EQ(s, 1);
        return text(m + 1, n) + text(2, m);
    }
    return text(1, s) + text(m + 1, n) + text(s + 1, m);   // <P> prefix <S> suffix <M> middle
}

}  // namespace

TEST(Fim, Utf8DecodingReplacesEachMaximalSubpartAsPythonDoes) {
    struct Case {
        std::string    bytes;
        std::u32string text;   // b.decode('utf-8', 'replace')
    } cases[] = {
        {"a\xC3\xA9" "b", U"a\u00E9b"},
        {"\xF0\x9F\x98\x80", U"\U0001F600"},
        {"\xF0\x9F\x98", U"\uFFFD"},                  // a truncated sequence is one subpart
        {"\xF0\x9F\x98" "x", U"\uFFFDx"},
        {"\xE0\x80\xAF", U"\uFFFD\uFFFD\uFFFD"},      // overlong: E0 takes A0..BF next
        {"\xED\xA0\x80", U"\uFFFD\uFFFD\uFFFD"},      // a surrogate
        {"\xF4\x90\x80\x80", U"\uFFFD\uFFFD\uFFFD\uFFFD"},   // above U+10FFFF
        {"\xC0\xAF", U"\uFFFD\uFFFD"},
        {"\xE2\x82" "\xE2\x82\xAC", U"\uFFFD\u20AC"},
        {"\xFF\x80", U"\uFFFD\uFFFD"},
    };
    for (const Case & c : cases) {
        EXPECT_EQ(decode_utf8_lossy(c.bytes), c.text) << testing::PrintToString(c.bytes);
    }
    for (const std::string & d : kDocuments) EXPECT_EQ(encode_utf8(decode_utf8_lossy(d)), d);
}

TEST(Fim, EachDocumentBecomesPrefixSuffixMiddleAroundItsSentinels) {
    FimFixture   f;
    Gpt2BpeTokenizer & tok = *f.tok;
    const std::vector<int32_t> doc   = tok.encode(kDocuments[1]);   // multi-byte characters, emoji, runs of spaces
    const std::vector<int32_t> tail  = tok.encode(kDocuments[0] + " " + kDocuments[2] + " " + kDocuments[0]);
    std::vector<int32_t>       input = doc;
    input.push_back(tok.eod());
    input.insert(input.end(), tail.begin(), tail.end());
    for (double spm : {1.0, 0.0}) {
        const FimTransform fim = f.make(1.0, spm);
        for (int64_t i = 0; i < 40; ++i) {
            std::vector<int32_t> out = input;
            fim.apply(i, out);
            ASSERT_EQ(out.size(), input.size());
            const auto eod = std::find(out.begin(), out.end(), tok.eod());
            ASSERT_NE(eod, out.end()) << "sample " << i;
            const std::span<const int32_t> first(out.data(), static_cast<size_t>(eod - out.begin()));
            EXPECT_EQ(read_layout(tok, first, spm == 1.0), kDocuments[1]) << "sample " << i;
            // The document after the end-of-document id is transformed on its own: it starts with <P>.
            ASSERT_LT(eod + 1, out.end());
            EXPECT_EQ(*(eod + 1), kP);
        }
    }
}

TEST(Fim, EmptyDocumentsAreDroppedWithTheirEndAndTheSampleIsPaddedAsMegatrons) {
    FimFixture           f;
    const int32_t        e = f.tok->eod(), a = f.tok->encode("a")[0], b = f.tok->encode("b")[0], c = f.tok->encode("c")[0];
    const FimTransform   keep = f.make(0.0, 0.5);
    std::vector<int32_t> s    = {e, a, b, e, e, c, e};
    keep.apply(0, s);
    // The leading end and the second of two adjacent ends go; the empty document after the last end is kept
    // (as nothing); the sample is padded back to its length.
    EXPECT_EQ(s, (std::vector<int32_t>{a, b, e, c, e, kPad, kPad}));

    // At rate 1 an empty last document still becomes its three sentinels (both orders read P S M); "a"
    // becomes four ids, the sentinels and "a" in one of the three parts.
    const FimTransform all = f.make(1.0, 0.5);
    for (int64_t i = 0; i < 8; ++i) {
        s = {a, e, e, e, e, e, e, e};
        all.apply(i, s);
        EXPECT_EQ(std::vector<int32_t>(s.begin() + 4, s.end()), (std::vector<int32_t>{e, kP, kS, kM})) << "sample " << i;
        EXPECT_EQ(s[0], kP);
        EXPECT_EQ(std::count(s.begin(), s.begin() + 4, a), 1);
    }
}

TEST(Fim, RatesAreTheShareOfDocumentsTransformedAndInSpmOrder) {
    FimFixture                 f;
    const std::vector<int32_t> doc = f.tok->encode(kDocuments[0]);
    const FimTransform         fim = f.make(0.5, 0.25);
    const int                  n   = 2000;
    int                        transformed = 0, spm = 0;   // spm: documents that start <P> <S>
    for (int64_t i = 0; i < n; ++i) {
        std::vector<int32_t> out = doc;
        fim.apply(i, out);
        if (out == doc) continue;
        ASSERT_EQ(out[0], kP) << "sample " << i;
        ++transformed;
        spm += out[1] == kS;
    }
    // Binomial counts: 1000 +- 4.5 x 22.4 transformed. <P> <S> starts every SPM document and the PSM ones
    // whose prefix is empty, the smaller of two draws from [0, L] being 0: 1 - (L / (L + 1))^2.
    EXPECT_NEAR(transformed, 1000, 101);
    const double length = static_cast<double>(decode_utf8_lossy(kDocuments[0]).size());
    const double q      = 0.25 + 0.75 * (1 - std::pow(length / (length + 1), 2));
    EXPECT_NEAR(spm, transformed * q, 4.5 * std::sqrt(transformed * q * (1 - q)));
}

TEST(Fim, ASamplesDrawsDependOnTheSeedAndItsIndexAlone) {
    FimFixture                 f;
    const std::vector<int32_t> doc = f.tok->encode(kDocuments[2]);
    const FimTransform         fim = f.make(1.0, 0.5);
    std::vector<std::vector<int32_t>> first;
    for (int64_t i = 0; i < 20; ++i) {
        first.push_back(doc);
        fim.apply(i, first.back());
    }
    // In any order, on another transform of the same seed: the same samples; another seed: other cuts.
    const FimTransform again = f.make(1.0, 0.5);
    int                distinct = 0;
    for (int64_t i = 19; i >= 0; --i) {
        std::vector<int32_t> out = doc;
        again.apply(i, out);
        EXPECT_EQ(out, first[static_cast<size_t>(i)]) << "sample " << i;
        distinct += i > 0 && first[static_cast<size_t>(i)] != first[static_cast<size_t>(i - 1)];
    }
    EXPECT_GE(distinct, 15);
    FimOptions o;
    o.rate = 1.0;
    const FimTransform other(f.tok, o, 4321);
    int                differ = 0;
    for (int64_t i = 0; i < 20; ++i) {
        std::vector<int32_t> out = doc;
        other.apply(i, out);
        differ += out != first[static_cast<size_t>(i)];
    }
    EXPECT_GE(differ, 15);
}

TEST(Fim, SplitTokenCutsFragmentsAndNoPrefixKeepsDocuments) {
    FimFixture f;
    Gpt2BpeTokenizer & tok = *f.tok;
    FimOptions o;
    o.split_sample  = "<file_sep>";
    o.fragment_rate = 1.0;
    const FimTransform split = f.make(1.0, 0.0, o);
    EXPECT_EQ(split.ids().split, kSep);
    const std::vector<int32_t> first = tok.encode(kDocuments[0]), second = tok.encode(kDocuments[2]);
    std::vector<int32_t>       input = first;
    input.push_back(kSep);
    input.insert(input.end(), second.begin(), second.end());
    std::vector<int32_t> out = input;
    split.apply(7, out);
    const auto sep = std::find(out.begin(), out.end(), kSep);
    ASSERT_NE(sep, out.end());
    EXPECT_EQ(read_layout(tok, std::span<const int32_t>(out.data(), static_cast<size_t>(sep - out.begin())), false),
              kDocuments[0]);
    EXPECT_EQ(*(sep + 1), kP);

    // --fim-no-prefix: a document whose text starts with it stays as it is; others are transformed.
    FimOptions np;
    np.no_prefix = "The quick";
    const FimTransform keep = f.make(1.0, 0.5, np);
    for (int64_t i = 0; i < 5; ++i) {
        out = first;
        keep.apply(i, out);
        EXPECT_EQ(out, first);
        out = second;
        keep.apply(i, out);
        EXPECT_EQ(out[0], kP);
    }
}

TEST(Fim, TokensAVocabularyLacksStandForEndOfTextAndBadOptionsAreRefused) {
    auto               tok = std::make_shared<Gpt2BpeTokenizer>(kVocab, kMerges);
    const FimTransform fim(tok, FimOptions{}, 1);
    const FimTransform::Ids & ids = fim.ids();
    for (int32_t id : {ids.prefix, ids.middle, ids.suffix, ids.pad, ids.eod}) EXPECT_EQ(id, tok->eod());
    FimOptions split;
    split.split_sample = "x";
    std::string message = error_of([&] { FimTransform(tok, split, 1); });
    EXPECT_NE(message.find("--fim-split-sample needs --fim-fragment-rate"), std::string::npos) << message;
    FimOptions rate;
    rate.rate = 1.5;
    message   = error_of([&] { FimTransform(tok, rate, 1); });
    EXPECT_NE(message.find("--fim-rate must be a probability in [0, 1], got 1.5"), std::string::npos) << message;
}

// The GPT dataset hands every sample through the transform; `loom train --fim-data` trains on it, and
// refuses what Megatron refuses and what Loom's FIM cannot read, naming the flag.
TEST(Fim, GptDatasetSamplesAreTransformedAndLoomTrainRefusesWhatItCannotRead) {
    const std::string jsonl  = write_jsonl("fim.jsonl");
    const std::string prefix = temp_path("fim");
    const std::string vocab  = write_fim_vocab();
    const std::string files  = " --vocab-file " + vocab + " --merge-file " + kMerges;
    ASSERT_EQ(run_loom("data --input " + jsonl + " --output-prefix " + prefix + files).status, 0);

    FimFixture              f;
    GptDatasetOptions       plain;
    plain.seq_length = 24;
    plain.seed       = 1234;
    GptDatasetOptions with = plain;
    FimOptions        all;
    all.rate = 1.0;
    with.fim = std::make_shared<const FimTransform>(f.tok, all, 1234);
    const Blend blend{{prefix + "_text_document"}, {}};
    auto        raw = open_blended_split(blend, "100,0,0", Split::train, 6, plain);
    auto        fim = open_blended_split(blend, "100,0,0", Split::train, 6, with);
    EXPECT_NE(fim->identity().find("with FIM (rate 1, SPM rate 0.5"), std::string::npos) << fim->identity();
    for (int64_t i = 0; i < raw->num_samples(); ++i) {
        std::vector<int32_t> want(25), got(25);
        raw->sample(i, want);
        with.fim->apply(i, want);
        fim->sample(i, got);
        EXPECT_EQ(got, want) << "sample " << i;
    }

    const std::string base = "train --data-path " + prefix + "_text_document --split 100,0,0 --seq-length 16 "
                             "--num-layers 1 --train-iters 3 --log-interval 1 --fim-data";
    CliRun r = run_loom(base + files);
    ASSERT_EQ(r.status, 0) << r.out;
    // The files alone fix the vocabulary at the tokenizer's, sentinels included (the data reaches 556 only).
    EXPECT_NE(r.out.find("vocab 562 (padded 640)"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("FIM (rate 0.5, SPM rate 0.5, ids prefix 557 middle 558 suffix 559 pad 560"),
              std::string::npos) << r.out;
    struct Case {
        std::string args, names;
    } cases[] = {
        {"train --mock-data --fim-data --num-layers 1 --train-iters 1", "Mock dataset is not supported with FIM dataset."},
        {base + " --fim-rate 0" + files, "--fim-rate should be specified."},
        {base + " --fim-spm-rate 1.5" + files, "--fim-spm-rate must be a probability in [0, 1], got 1.5"},
        {base + " --fim-split-sample '<file_sep>'" + files, "--fim-split-sample needs --fim-fragment-rate"},
        {base + " --tokenizer-type NullTokenizer --vocab-size 600", "--fim-data needs the GPT-2 BPE tokenizer"},
    };
    for (const Case & c : cases) {
        CliRun bad = run_loom(c.args);
        EXPECT_EQ(bad.status, 2) << c.args << " -> " << bad.out;
        EXPECT_NE(bad.out.find(c.names), std::string::npos) << c.args << " -> " << bad.out;
    }
}
