// The data layer: Megatron's MMIDIDX files (round trip, the byte layout of docs/design/conventions.md B2, every
// malformed file named in its error), the split of documents, the GPT document/sample/shuffle indices, llm.c shards,
// the synthetic dataset, the loader's per-rank tiling of each global batch and resume, the text/JSONL converter and
// `loom data` run as a program.
#include "backend/cpu/cpu_device.h"
#include "core/error.h"
#include "core/input_file.h"
#include "data/blended_dataset.h"
#include "data/gpt_dataset.h"
#include "data/index_cache.h"
#include "data/indexed_dataset.h"
#include "data/llmc_shard.h"
#include "data/preprocess.h"
#include "data/token_dataset.h"

#include "error_text.h"
#include "loom_cli_runner.h"

#include <gtest/gtest.h>

#include <filesystem>

#include <array>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <functional>
#include <iterator>
#include <map>
#include <numeric>
#include <set>
#include <string>
#include <fcntl.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

using namespace loom;
using namespace loom::data;

namespace {

std::string temp_path(const std::string & name) {
    return testing::TempDir() + "loom_test_data_" + std::to_string(::getpid()) + "_" + name;
}

std::vector<uint8_t> read_bytes(const std::string & path) {
    std::ifstream in(path, std::ios::binary);
    return {std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
}

void write_bytes(const std::string & path, const std::vector<uint8_t> & bytes) {
    std::ofstream out(path, std::ios::binary | std::ios::trunc);
    out.write(reinterpret_cast<const char *>(bytes.data()), static_cast<std::streamsize>(bytes.size()));
}

template <typename T> void put(std::vector<uint8_t> & bytes, T value) {
    uint8_t raw[sizeof(T)];
    std::memcpy(raw, &value, sizeof(T));
    bytes.insert(bytes.end(), raw, raw + sizeof(T));
}

template <typename T> void poke(std::vector<uint8_t> & bytes, size_t offset, T value) {
    std::memcpy(bytes.data() + offset, &value, sizeof(T));
}


// The worked example of indexed_dataset.h: documents [5 7 9] and [1 2] + [3], uint16.
std::string write_worked_example(const std::string & name) {
    std::string          prefix = temp_path(name);
    IndexedDatasetWriter w(prefix, IndexDType::u16);
    w.add_document(std::vector<int32_t>{5, 7, 9});
    w.add_sequence(std::vector<int32_t>{1, 2});
    w.add_sequence(std::vector<int32_t>{3});
    w.end_document();
    w.finish();
    return prefix;
}

// Documents whose tokens name them and their position: token i of document d is 1000 (d + 1) + i (int32).
std::string write_numbered_documents(const std::string & name, const std::vector<int32_t> & lengths) {
    std::string          prefix = temp_path(name);
    IndexedDatasetWriter w(prefix, IndexDType::i32);
    for (size_t d = 0; d < lengths.size(); ++d) {
        std::vector<int32_t> tokens(static_cast<size_t>(lengths[d]));
        for (int32_t i = 0; i < lengths[d]; ++i) tokens[i] = 1000 * static_cast<int32_t>(d + 1) + i;
        w.add_document(tokens);
    }
    w.finish();
    return prefix;
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// MMIDIDX

// Every reader opens its input through core/input_file: the open does not block on a FIFO with no writer
// (the ctest timeout would catch a hang), and what is refused is decided on the descriptor that was opened.
TEST(InputFile, RefusesFifosFoldersAndDevicesWithoutBlockingAndReadsFiles) {
    const std::string dir  = temp_path("input_file");
    std::filesystem::remove_all(dir);
    std::filesystem::create_directories(dir);
    const std::string fifo = dir + "/pipe";
    ASSERT_EQ(mkfifo(fifo.c_str(), 0600), 0);
    auto expect_error = [](const std::function<void()> & f, const std::vector<std::string> & parts) {
        const std::string text = error_of(f);
        for (const std::string & part : parts) EXPECT_NE(text.find(part), std::string::npos) << part << " in: " << text;
    };
    expect_error([&] { open_input_fd(fifo, "--text-file"); }, {"--text-file '" + fifo + "'", "is a FIFO (named pipe)"});
    expect_error([&] { read_input_file(dir, "--params"); }, {"--params '" + dir + "'", "is a folder"});
    expect_error([&] { open_input_file("/dev/zero", "merge file"); }, {"merge file '/dev/zero'", "is a device"});
    expect_error([&] { read_input_file(dir + "/absent", "checkpoint index"); },
                 {"cannot read checkpoint index '" + dir + "/absent'", "No such file"});

    const std::string file = dir + "/lines.txt";
    { std::ofstream(file, std::ios::binary) << "one\r\n\ntwo\nlast"; }
    EXPECT_EQ(read_input_file(file, "--input"), "one\r\n\ntwo\nlast");
    InputStream              in = open_input_file(file, "--input");
    std::vector<std::string> lines;
    std::string              line;
    while (read_line(in.get(), line)) lines.push_back(line);
    EXPECT_EQ(lines, (std::vector<std::string>{"one\r", "", "two", "last"}));
    // Reads block again once the file is open: the descriptor's O_NONBLOCK was cleared.
    int fd = open_input_fd(file, "--input");
    EXPECT_EQ(fcntl(fd, F_GETFL) & O_NONBLOCK, 0);
    close(fd);
    std::filesystem::remove_all(dir);
}

TEST(IndexedDataset, WriterReaderRoundTripInBothTokenTypes) {
    for (IndexDType dtype : {IndexDType::u16, IndexDType::i32}) {
        std::string prefix = temp_path(std::string("roundtrip_") + index_dtype_name(static_cast<uint8_t>(dtype)));
        std::vector<std::vector<int32_t>> docs = {{1, 2, 3}, {}, {65535 % 60000, 0}, {42}};
        if (dtype == IndexDType::i32) docs[2] = {1 << 20, 7};
        {
            IndexedDatasetWriter w(prefix, dtype);
            for (const auto & d : docs) w.add_document(d);
            w.add_sequence(std::vector<int32_t>{9, 9});   // a trailing document of two sequences, closed by finish()
            w.add_sequence(std::vector<int32_t>{8});
            w.finish();
        }
        IndexedDataset ds(prefix);
        EXPECT_EQ(ds.dtype(), dtype);
        ASSERT_EQ(ds.num_sequences(), 6);
        EXPECT_EQ(ds.num_documents(), 5);
        EXPECT_EQ(ds.num_tokens(), 3 + 0 + 2 + 1 + 2 + 1);
        for (size_t i = 0; i < docs.size(); ++i) EXPECT_EQ(ds.sequence(static_cast<int64_t>(i)), docs[i]) << i;
        EXPECT_EQ(ds.sequence(4), (std::vector<int32_t>{9, 9}));
        EXPECT_EQ(ds.sequence(5), (std::vector<int32_t>{8}));
        std::vector<int64_t> document_indices;
        for (int64_t d = 0; d <= ds.num_documents(); ++d) document_indices.push_back(ds.document_index(d));
        EXPECT_EQ(document_indices, (std::vector<int64_t>{0, 1, 2, 3, 4, 6}));
        int64_t item = static_cast<int64_t>(ds.token_bytes());
        EXPECT_EQ(ds.sequence_pointer(0), 0);
        EXPECT_EQ(ds.sequence_pointer(2), 3 * item) << "pointers are byte offsets, the empty sequence adds none";
        EXPECT_EQ(ds.sequence_pointer(5), 8 * item);
        std::vector<int32_t> middle(1);
        ds.read(0, 1, middle);
        EXPECT_EQ(middle[0], 2);
        std::vector<int32_t> past(2);
        EXPECT_THROW(ds.read(0, 2, past), Error);
        // No temporary files are left behind.
        EXPECT_NE(::access((data_file_path(prefix) + ".tmp." + std::to_string(::getpid())).c_str(), F_OK), 0);
    }
}

TEST(IndexedDataset, WriterOutputMatchesTheSpecLayoutByteByByte) {
    std::string prefix = write_worked_example("layout");
    // .idx built by hand from the table in conventions.md B2.
    std::vector<uint8_t> idx = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
    put<uint64_t>(idx, 1);   // version
    put<uint8_t>(idx, 8);    // uint16
    put<uint64_t>(idx, 3);   // N
    put<uint64_t>(idx, 3);   // D, with the leading 0
    for (int32_t len : {3, 2, 1}) put<int32_t>(idx, len);
    for (int64_t ptr : {0, 6, 10}) put<int64_t>(idx, ptr);
    for (int64_t doc : {0, 1, 3}) put<int64_t>(idx, doc);
    ASSERT_EQ(idx.size(), 94u);
    EXPECT_EQ(read_bytes(index_file_path(prefix)), idx);
    EXPECT_EQ(read_bytes(data_file_path(prefix)), (std::vector<uint8_t>{5, 0, 7, 0, 9, 0, 1, 0, 2, 0, 3, 0}));

    // And the reader reads a hand-built pair (int32 tokens this time) at the unaligned offsets.
    std::string hand = temp_path("hand");
    std::vector<uint8_t> idx32 = {'M', 'M', 'I', 'D', 'I', 'D', 'X', 0, 0};
    put<uint64_t>(idx32, 1);
    put<uint8_t>(idx32, 4);
    put<uint64_t>(idx32, 2);
    put<uint64_t>(idx32, 2);
    put<int32_t>(idx32, 1);
    put<int32_t>(idx32, 2);
    put<int64_t>(idx32, 0);
    put<int64_t>(idx32, 4);
    put<int64_t>(idx32, 0);
    put<int64_t>(idx32, 2);
    std::vector<uint8_t> bin32;
    for (int32_t t : {70000, -1 + 2, 123456}) put<int32_t>(bin32, t);
    write_bytes(index_file_path(hand), idx32);
    write_bytes(data_file_path(hand), bin32);
    IndexedDataset ds(hand);
    EXPECT_EQ(ds.num_documents(), 1);
    EXPECT_EQ(ds.sequence(0), (std::vector<int32_t>{70000}));
    EXPECT_EQ(ds.sequence(1), (std::vector<int32_t>{1, 123456}));
    EXPECT_EQ(ds.max_token(), 123456);
}

TEST(IndexedDataset, EveryMalformedFileThrowsNamingTheFileAndField) {
    std::string                prefix = write_worked_example("good");
    const std::vector<uint8_t> idx = read_bytes(index_file_path(prefix));
    const std::vector<uint8_t> bin = read_bytes(data_file_path(prefix));
    ASSERT_NO_THROW(IndexedDataset{prefix});

    struct Case {
        const char *                                name;
        std::function<void(std::vector<uint8_t> &, std::vector<uint8_t> &)> corrupt;
        const char *                                file_suffix;   // the file the message must name
        const char *                                field;         // and what it must say
    };
    const Case cases[] = {
        {"bad_magic", [](auto & i, auto &) { i[0] = 'X'; }, ".idx", "magic"},
        {"bad_version", [](auto & i, auto &) { poke<uint64_t>(i, 9, 2); }, ".idx", "version 2"},
        {"bad_dtype", [](auto & i, auto &) { poke<uint8_t>(i, 17, 9); }, ".idx", "dtype code 9"},
        {"float_dtype", [](auto & i, auto &) { poke<uint8_t>(i, 17, 7); }, ".idx", "float32"},
        {"short_header", [](auto & i, auto &) { i.resize(20); }, ".idx", "34-byte header"},
        {"truncated_arrays", [](auto & i, auto &) { i.resize(i.size() - 8); }, ".idx", "N = 3"},
        {"huge_count", [](auto & i, auto &) { poke<uint64_t>(i, 18, uint64_t{1} << 62); }, ".idx", "truncated"},
        {"trailing_bytes", [](auto & i, auto &) { i.resize(i.size() + 1); }, ".idx", "trailing bytes"},
        {"bin_too_short", [](auto &, auto & b) { b.resize(b.size() - 2); }, ".bin", "too short"},
        {"bin_empty", [](auto &, auto & b) { b.clear(); }, ".bin", "sequence_pointers[0]"},
        {"pointer_past_bin", [](auto & i, auto &) { poke<int64_t>(i, 34 + 12 + 8, 100); }, ".bin", "sequence_pointers[1] = 100"},
        {"negative_length", [](auto & i, auto &) { poke<int32_t>(i, 34, -1); }, ".idx", "sequence_lengths[0]"},
        {"documents_decrease", [](auto & i, auto &) { poke<int64_t>(i, 34 + 36 + 8, 4); }, ".idx", "document_indices[1]"},
        {"documents_end_early", [](auto & i, auto &) { poke<int64_t>(i, 34 + 36 + 16, 2); }, ".idx", "last document index is 2"},
        {"documents_start_late", [](auto & i, auto &) { poke<int64_t>(i, 34 + 36, 1); }, ".idx", "document_indices[0]"},
        // Once accepted, and trained on garbage with exit 0: overlapping pointers, a changed dtype byte, a
        // .bin with more bytes than its index describes.
        {"pointers_overlap", [](auto & i, auto &) { poke<int64_t>(i, 34 + 12 + 8, 0); }, ".idx",
         "sequence_pointers[1] = 0, but the sequences before it end at byte"},
        {"dtype_byte_changed", [](auto & i, auto &) { poke<uint8_t>(i, 17, 1); }, ".idx", "sequence_pointers[1]"},
        {"bin_trailing_bytes", [](auto &, auto & b) { b.resize(b.size() + 2); }, ".bin", "trailing bytes"},
    };
    for (const Case & c : cases) {
        std::string          bad = temp_path(std::string("bad_") + c.name);
        std::vector<uint8_t> i = idx, b = bin;
        c.corrupt(i, b);
        write_bytes(index_file_path(bad), i);
        write_bytes(data_file_path(bad), b);
        std::string message = error_of([&] { IndexedDataset ds(bad); });
        EXPECT_NE(message.find(bad + c.file_suffix), std::string::npos) << c.name << ": " << message;
        EXPECT_NE(message.find(c.field), std::string::npos) << c.name << ": " << message;
        EXPECT_NE(message.find("HINT"), std::string::npos) << c.name << ": " << message;
    }
    std::string missing = temp_path("missing");
    std::string message = error_of([&] { IndexedDataset ds(missing); });
    EXPECT_NE(message.find(missing + ".idx"), std::string::npos) << message;
}

// A .bin truncated by another process while mapped: reading a lost page raises SIGBUS, which the mapped
// file's handler turns into a message naming the file and exit status 2.
TEST(IndexedDatasetDeathTest, BinTruncatedWhileMappedExitsTwoNamingIt) {
    GTEST_FLAG_SET(death_test_style, "threadsafe");
    std::vector<int32_t> lengths(4, 5000);
    std::string          prefix = write_numbered_documents("shrinking", lengths);
    EXPECT_EXIT(
        {
            IndexedDataset ds(prefix);
            std::filesystem::resize_file(data_file_path(prefix), 0);
            std::vector<int32_t> tokens = ds.sequence(3);
            std::printf("read %d\n", tokens[0]);
        },
        ::testing::ExitedWithCode(2), "shrinking.bin' became shorter while Loom read it");
}

TEST(IndexedDataset, WriterRefusesTokensOutsideItsType) {
    std::string          prefix = temp_path("refuse");
    IndexedDatasetWriter w(prefix, IndexDType::u16);
    std::string          message = error_of([&] { w.add_document(std::vector<int32_t>{1, 70000}); });
    EXPECT_NE(message.find("70000"), std::string::npos) << message;
    EXPECT_EQ(index_dtype_for_vocab(65499), IndexDType::u16);
    EXPECT_EQ(index_dtype_for_vocab(65500), IndexDType::i32);
}

// ---------------------------------------------------------------------------------------------------
// Split

TEST(Split, DividesDocumentsAsMegatronDoes) {
    auto r = split_documents("969,30,1", 1000);
    EXPECT_EQ(r[0], (DocumentRange{0, 969}));
    EXPECT_EQ(r[1], (DocumentRange{969, 999}));
    EXPECT_EQ(r[2], (DocumentRange{999, 1000}));
    // round(10/3) = 3 three times: 9 documents, so every boundary moves up by one (Megatron's correction).
    r = split_documents("1,1,1", 10);
    EXPECT_EQ(r[0], (DocumentRange{0, 4}));
    EXPECT_EQ(r[1], (DocumentRange{4, 7}));
    EXPECT_EQ(r[2], (DocumentRange{7, 10}));
    // Missing weights are 0; slashes work as in Megatron's regex.
    r = split_documents("100", 7);
    EXPECT_EQ(r[0], (DocumentRange{0, 7}));
    EXPECT_EQ(r[1].size(), 0);
    EXPECT_EQ(r[2].size(), 0);
    r = split_documents("98/2", 100);
    EXPECT_EQ(r[0], (DocumentRange{0, 98}));
    EXPECT_EQ(r[1], (DocumentRange{98, 100}));
    // Python rounds half to even: 0.5 * 5 = 2.5 -> 2.
    r = split_documents("1,1", 5);
    EXPECT_EQ(r[0], (DocumentRange{0, 3}));   // [0, 2, 4] corrected by -1 -> [0, 3, 5]
    auto w = parse_split("949,50,1");
    EXPECT_NEAR(w[0] + w[1] + w[2], 1.0, 1e-12);
    EXPECT_NEAR(w[1], 0.05, 1e-12);
    for (const char * bad : {"a,b", "1,2,3,4", "0,0,0", "-1,2", "", "1,,2"}) {
        std::string message = error_of([&] { parse_split(bad); });
        EXPECT_NE(message.find("--split"), std::string::npos) << bad << ": " << message;
    }
}

// ---------------------------------------------------------------------------------------------------
// GPT sample index

TEST(GptSampleIndex, WorkedExampleOfTheHeader) {
    std::vector<int32_t> sizes = {4, 3, 5};
    std::vector<int32_t> order = {0, 1, 2};
    EXPECT_EQ(build_sample_index(sizes, order, 3, 12, 1), (std::vector<int64_t>{0, 0, 0, 3, 1, 2, 2, 2}));
}

TEST(GptSampleIndex, SamplesUseEveryTokenOfTheSplitInOrderOverlappingByOne) {
    std::vector<int32_t> lengths = {7, 1, 0, 12, 3, 25, 2, 9, 4, 16, 5, 11};
    std::string          prefix  = write_numbered_documents("samples", lengths);
    auto                 data    = std::make_shared<const IndexedDataset>(prefix);
    const int64_t        seq     = 5;
    DocumentRange        range{2, 10};   // documents 2..9 only
    GptDataset           ds(data, range, seq, 0, 1234, 20000, "train");

    const GptSampleIndex & index = ds.index();
    EXPECT_EQ(index.num_epochs, 1);
    int64_t tokens = 0;
    for (int64_t d = range.begin; d < range.end; ++d) tokens += lengths[d];
    EXPECT_EQ(index.tokens_per_epoch, tokens);
    EXPECT_EQ(ds.num_samples(), (tokens - 1) / seq);
    // The document index is a permutation of the split's documents.
    std::multiset<int32_t> docs(index.document_index.begin(), index.document_index.end());
    EXPECT_EQ(docs, (std::multiset<int32_t>{2, 3, 4, 5, 6, 7, 8, 9}));
    // The token stream in document-index order.
    std::vector<int32_t> stream;
    for (int32_t d : index.document_index) {
        std::vector<int32_t> t = data->sequence(d);
        stream.insert(stream.end(), t.begin(), t.end());
    }
    std::vector<int32_t> sample(seq + 1), previous;
    for (int64_t k = 0; k < ds.num_samples(); ++k) {
        ds.sample_unshuffled(k, sample);
        std::vector<int32_t> expected(stream.begin() + k * seq, stream.begin() + k * seq + seq + 1);
        ASSERT_EQ(sample, expected) << "sample " << k << " is tokens [k s, k s + s + 1) of the stream";
        if (k > 0) {
            EXPECT_EQ(sample.front(), previous.back()) << "consecutive samples overlap by one token";
        }
        for (int32_t t : sample) {
            int32_t d = t / 1000 - 1;
            EXPECT_TRUE(d >= range.begin && d < range.end) << "token " << t << " from outside the split";
        }
        previous = sample;
    }
    // The shuffle index is a permutation of the samples, and sample(i) reads shuffle_index[i].
    std::vector<int64_t> sorted = index.shuffle_index;
    std::sort(sorted.begin(), sorted.end());
    std::vector<int64_t> iota(sorted.size());
    std::iota(iota.begin(), iota.end(), int64_t{0});
    EXPECT_EQ(sorted, iota);
    std::vector<int32_t> a(seq + 1), b(seq + 1);
    ds.sample(3, a);
    ds.sample_unshuffled(index.shuffle_index[3], b);
    EXPECT_EQ(a, b);
}

TEST(GptSampleIndex, IsDeterministicForASeedAndDifferentForAnother) {
    std::vector<int32_t> sizes(50);
    for (size_t i = 0; i < sizes.size(); ++i) sizes[i] = static_cast<int32_t>(3 + (i * 7) % 11);
    DocumentRange  range{0, 50};
    GptSampleIndex a = build_gpt_sample_index(sizes, range, 8, 0, 1234);
    GptSampleIndex b = build_gpt_sample_index(sizes, range, 8, 0, 1234);
    GptSampleIndex c = build_gpt_sample_index(sizes, range, 8, 0, 1235);
    EXPECT_EQ(a.document_index, b.document_index);
    EXPECT_EQ(a.sample_index, b.sample_index);
    EXPECT_EQ(a.shuffle_index, b.shuffle_index);
    EXPECT_NE(a.document_index, c.document_index);
    EXPECT_NE(a.shuffle_index, c.shuffle_index);
    // The documented shuffle: Fisher-Yates from the back with draw_below on one mt19937_64(seed).
    std::mt19937_64      rng(1234);
    std::vector<int32_t> docs(50);
    std::iota(docs.begin(), docs.end(), 0);
    for (size_t i = docs.size(); i > 1; --i) std::swap(docs[i - 1], docs[draw_below(rng, i)]);
    EXPECT_EQ(a.document_index, docs);
}

TEST(GptSampleIndex, BuildsEnoughEpochsForTheRequestedSamples) {
    std::vector<int32_t> sizes = {10, 20, 30, 40};   // 100 tokens per epoch, 12 samples of seq 8 per epoch
    DocumentRange        range{0, 4};
    // 30 samples need 30 * 8 + 1 = 241 tokens: 3 epochs. The last epoch gives 30 - (200 - 1) / 8 = 6 samples,
    // below 80% of 12, so it is shuffled apart.
    GptSampleIndex x = build_gpt_sample_index(sizes, range, 8, 30, 7);
    EXPECT_EQ(x.num_epochs, 3);
    EXPECT_TRUE(x.separate_final_epoch);
    EXPECT_EQ(x.num_samples(), (300 - 1) / 8);
    std::map<int32_t, int> count;
    for (int32_t d : x.document_index) ++count[d];
    for (int32_t d = 0; d < 4; ++d) EXPECT_EQ(count[d], 3);
    std::multiset<int32_t> last(x.document_index.end() - 4, x.document_index.end());
    EXPECT_EQ(last, (std::multiset<int32_t>{0, 1, 2, 3})) << "the separate final epoch holds each document once";
    // The first (E - 1) epochs' samples are permuted among themselves first.
    int64_t before = (200 - 1) / 8;
    for (int64_t i = 0; i < before; ++i) EXPECT_LT(x.shuffle_index[i], before);
    // 34 samples: the last epoch gives 34 - 24 = 10 >= 9.6 samples, so no separate epoch.
    GptSampleIndex y = build_gpt_sample_index(sizes, range, 8, 34, 7);
    EXPECT_EQ(y.num_epochs, 3);
    EXPECT_FALSE(y.separate_final_epoch);
}

TEST(GptDataset, OpensASplitOfAPrefixAndNamesAnEmptyOne) {
    std::vector<int32_t> lengths(20, 9);
    std::string          prefix = write_numbered_documents("open", lengths);
    auto                 train  = open_gpt_dataset(prefix, "80,20,0", Split::train, 4, 0, 1);
    auto                 valid  = open_gpt_dataset(prefix, "80,20,0", Split::valid, 4, 0, 1);
    EXPECT_EQ(train->range(), (DocumentRange{0, 16}));
    EXPECT_EQ(valid->range(), (DocumentRange{16, 20}));
    EXPECT_EQ(train->vocab_size(), 20 * 1000 + 8 + 1) << "vocab 0 means the largest token + 1";
    EXPECT_EQ(train->num_samples(), (16 * 9 - 1) / 4);
    std::string message = error_of([&] { open_gpt_dataset(prefix, "80,20,0", Split::test, 4, 0, 1); });
    EXPECT_NE(message.find("test split"), std::string::npos) << message;
    EXPECT_NE(message.find(prefix), std::string::npos) << message;
    message = error_of([&] { open_gpt_dataset(prefix, "80,20,0", Split::valid, 100, 0, 1); });
    EXPECT_NE(message.find("seq_length + 1 = 101"), std::string::npos) << message;
    // A token outside --vocab-size is found when the dataset opens (one scan of the .bin), not when its sample
    // is drawn: the largest one is named.
    message = error_of([&] { open_gpt_dataset(prefix, "80,20,0", Split::train, 4, 0, 1, 512); });
    EXPECT_NE(message.find(prefix + ".bin' holds token id 20008, outside the vocabulary of 512"), std::string::npos)
        << message;
    EXPECT_NE(message.find("--vocab-size"), std::string::npos) << message;
}

// Without --vocab-size the vocabulary is the largest id + 1. An end-of-document id far above the text's ids
// (GPT-2's 50256 over a small corpus, the byte tokenizer's 256) is taken; one corrupt id far above the rest
// inside a document is refused, naming where it is, instead of silently widening the model 76 times.
TEST(GptDataset, InferredVocabularyRefusesALoneCorruptIdButNotAnEndOfDocumentId) {
    auto write = [](const std::string & name, int32_t corrupt) {
        std::string          prefix = temp_path(name);
        IndexedDatasetWriter w(prefix, IndexDType::i32);
        for (int32_t d = 0; d < 12; ++d) {
            std::vector<int32_t> tokens;
            for (int32_t i = 0; i < 20; ++i) tokens.push_back((d * 7 + i * 3) % 900);
            if (d == 5 && corrupt > 0) tokens[7] = corrupt;
            tokens.push_back(50256);   // the end of the document
            w.add_document(tokens);
        }
        w.finish();
        return prefix;
    };
    const std::string clean = write("eod_only", 0);
    EXPECT_EQ(open_gpt_dataset(clean, "100,0,0", Split::train, 8, 0, 1)->vocab_size(), 50257);

    const std::string bad     = write("corrupt_id", 3'819'532);
    const std::string message = error_of([&] { open_gpt_dataset(bad, "100,0,0", Split::train, 8, 0, 1); });
    EXPECT_NE(message.find(bad + ".bin' holds token id 3819532 (sequence 5, token 7), more than twice any other id "
                                 "(the next largest is 50256)"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("--vocab-size"), std::string::npos) << message;
    // Given explicitly, the vocabulary is the user's word.
    EXPECT_EQ(open_gpt_dataset(bad, "100,0,0", Split::train, 8, 0, 1, 4'000'000)->vocab_size(), 4'000'000);
    // A large id that is not isolated (within twice the next) is an ordinary vocabulary.
    const std::string dense = write("dense_top", 90'000);
    EXPECT_EQ(open_gpt_dataset(dense, "100,0,0", Split::train, 8, 0, 1)->vocab_size(), 90'001);
}

// ---------------------------------------------------------------------------------------------------
// Blends (data/blended_dataset.h)

namespace {

// `count` documents of `length` tokens (uint16) in a small vocabulary: token i of document d is
// (7 d + 3 i + salt) % 128, plus 128 when salt is odd, so the samples of a dataset written with an even salt
// and one written with an odd salt are told apart by their tokens (below or from 128).
std::string write_small_vocab_documents(const std::string & name, int count, int length, int salt) {
    std::string          prefix = temp_path(name);
    IndexedDatasetWriter w(prefix, IndexDType::u16);
    for (int d = 0; d < count; ++d) {
        std::vector<int32_t> tokens;
        for (int i = 0; i < length; ++i) tokens.push_back((7 * d + 3 * i + salt) % 128 + 128 * (salt % 2));
        w.add_document(tokens);
    }
    w.finish();
    return prefix;
}

std::vector<std::string> words_of(std::initializer_list<const char *> words) {
    return std::vector<std::string>(words.begin(), words.end());
}

std::vector<int32_t> sample_of(const TokenDataset & ds, int64_t i) {
    std::vector<int32_t> out(static_cast<size_t>(ds.seq_length() + 1));
    ds.sample(i, out);
    return out;
}

}  // namespace

// get_blend_from_list: prefixes alone, or weight/prefix pairs when every weight position reads as a
// number; Loom refuses the malformed lists Megatron would turn into a later failure, naming flag and word.
TEST(BlendedDataset, DataPathParsesAsGetBlendFromListAndMalformedListsNameTheWord) {
    Blend one = parse_blend(words_of({"A"}));
    EXPECT_EQ(one.prefixes, words_of({"A"}));
    EXPECT_TRUE(one.weights.empty());
    Blend two = parse_blend(words_of({"A", "B"}));
    EXPECT_EQ(two.prefixes, words_of({"A", "B"}));
    EXPECT_TRUE(two.weights.empty()) << "prefixes alone are weighted by their sizes later";
    Blend pairs = parse_blend(words_of({"30", "A", " 1e1 ", " B ", "0.5", "C"}));
    EXPECT_EQ(pairs.prefixes, words_of({"A", "B", "C"})) << "prefixes are stripped";
    EXPECT_EQ(pairs.weights, (std::vector<double>{30.0, 10.0, 0.5})) << "the weights as given, not normalised";

    struct Case {
        std::vector<std::string> words;
        std::string              flag, names;
    } cases[] = {
        {{}, "--data-path", "--data-path needs at least one dataset prefix"},
        {words_of({"0.3", "A", "0.7"}), "--data-path",
         "--data-path: '0.3' (word 1) reads as a weight, but the 3 words are not WEIGHT PREFIX pairs (an odd count)"},
        {words_of({"A", "0.3", "B", "0.7"}), "--data-path",
         "--data-path: '0.3' (word 2) reads as a weight, but the 4 words are not WEIGHT PREFIX pairs (a weight must "
         "come before its prefix)"},
        {words_of({"0.3", "A", "x", "B"}), "--data-path",
         "--data-path: 'x' (word 3) is not a number, and '0.3' (word 1) is a weight"},
        {words_of({"-0.3", "A", "0.7", "B"}), "--data-path", "--data-path: the weight '-0.3' (word 1) of 'A' is negative"},
        {words_of({"0.3", "A", "0", "B"}), "--train-data-path", "--train-data-path: the weight '0' (word 3) of 'B' is zero"},
        {words_of({"nan", "A", "1", "B"}), "--data-path", "the weight 'nan' (word 1) of 'A' is not a finite number"},
        {words_of({"0.3", "0.5", "0.7", "B"}), "--valid-data-path",
         "--valid-data-path: '0.5' (word 2) stands where the prefix of weight '0.3' belongs, and is a number"},
    };
    for (const Case & c : cases) {
        const std::string message = error_of([&] { parse_blend(c.words, c.flag); });
        EXPECT_NE(message.find(c.names), std::string::npos) << message;
    }
}

// normalize() and _get_size_per_split_per_dataset, numbers computed with Megatron's Python.
TEST(BlendedDataset, WeightsAndDatasetSizesAreTheBuildersNumbers) {
    EXPECT_EQ(normalize_weights(std::vector<double>{30, 70}), (std::vector<double>{0.3, 0.7}));
    const std::vector<double> w = normalize_weights(normalize_weights(std::vector<double>{0.3, 0.7}));
    EXPECT_EQ(samples_per_dataset(w, 10), (std::vector<int64_t>{3, 7}));
    EXPECT_EQ(samples_per_dataset(w, 10, 0.005), (std::vector<int64_t>{4, 8})) << "ceil(3 x 1.005), ceil(7 x 1.005)";
    const std::vector<double> three = normalize_weights(normalize_weights(std::vector<double>{0.2, 0.5, 0.3}));
    EXPECT_EQ(samples_per_dataset(three, 7), (std::vector<int64_t>{2, 4, 3}));
    EXPECT_EQ(samples_per_dataset(three, 7, 0.005), (std::vector<int64_t>{3, 5, 4}));
    // Many weights: the sum is numpy's pairwise sum, so the normalised weights add to 1 within a few ulps.
    std::vector<double> many(300);
    for (size_t i = 0; i < many.size(); ++i) many[i] = 1.0 / static_cast<double>(i + 1);
    const std::vector<double> normalized = normalize_weights(many);
    EXPECT_NEAR(std::accumulate(normalized.begin(), normalized.end(), 0.0), 1.0, 1e-14);
}

// The header's worked example, a three-dataset case (from the reference implementation in Python) and
// the tie rule.
TEST(BlendedDataset, BlendingIndexMatchesTheHandComputedExamples) {
    BlendingIndex x = build_blending_index(std::vector<double>{0.3, 0.7}, 10);
    EXPECT_EQ(x.dataset_index, (std::vector<int16_t>{1, 0, 1, 1, 0, 1, 1, 0, 1, 1}));
    EXPECT_EQ(x.dataset_sample_index, (std::vector<int64_t>{0, 0, 1, 2, 1, 3, 4, 2, 5, 6}));
    BlendingIndex y = build_blending_index(normalize_weights(std::vector<double>{0.2, 0.5, 0.3}), 9);
    EXPECT_EQ(y.dataset_index, (std::vector<int16_t>{1, 2, 0, 1, 2, 1, 0, 1, 2}));
    EXPECT_EQ(y.dataset_sample_index, (std::vector<int64_t>{0, 0, 0, 1, 1, 2, 1, 3, 2}));
    // Equal errors go to the lower index: i = 0 (0.5, 0.5) -> 0, i = 2 (0, 0) -> 0.
    EXPECT_EQ(build_blending_index(std::vector<double>{0.5, 0.5}, 4).dataset_index, (std::vector<int16_t>{0, 1, 0, 1}));
}

// After S samples each dataset has given w_d S samples within one (tolerance: 1 sample, i.e. a fraction
// within 1/S of its weight), for every S up to 2000 (the index of S samples is the first S of a longer one).
TEST(BlendedDataset, AchievedFractionsAreWithinOneOverSOfTheWeights) {
    for (const std::vector<double> & weights : {std::vector<double>{0.3, 0.7}, std::vector<double>{0.2, 0.5, 0.3}}) {
        const std::vector<double> w     = normalize_weights(weights);
        const BlendingIndex       index = build_blending_index(w, 2000);
        std::vector<int64_t>      count(w.size(), 0);
        for (int64_t s = 1; s <= 2000; ++s) {
            ++count[static_cast<size_t>(index.dataset_index[static_cast<size_t>(s - 1)])];
            for (size_t d = 0; d < w.size(); ++d) {
                ASSERT_LE(std::abs(static_cast<double>(count[d]) / static_cast<double>(s) - w[d]), 1.0 / static_cast<double>(s))
                    << "dataset " << d << " after " << s << " samples";
            }
        }
    }
}

// --data-path 0.3 A 0.7 B: each dataset built with ceil(ceil(N w) x 1.005) samples, the blend of
// sum ceil(N w) samples reads sample dataset_sample_index[i] of dataset dataset_index[i], and its
// vocabulary is the larger of the two.
TEST(BlendedDataset, WeightedBlendReadsEachSampleFromTheDatasetItsIndexNames) {
    const std::string a = write_small_vocab_documents("blend_a", 30, 21, 0);   // even salt: tokens < 128
    const std::string b = write_small_vocab_documents("blend_b", 40, 17, 1);   // odd salt: tokens >= 128
    GptDatasetOptions o;
    o.seq_length = 8;
    o.seed       = 1234;
    auto ds      = open_blended_split(parse_blend(words_of({"0.3", a.c_str(), "0.7", b.c_str()})), "100,0,0",
                                      Split::train, 40, o);
    auto * blend = dynamic_cast<BlendedDataset *>(ds.get());
    ASSERT_NE(blend, nullptr);
    EXPECT_EQ(blend->num_samples(), 12 + 28) << "ceil(40 x 0.3) + ceil(40 x 0.7)";
    EXPECT_EQ(blend->datasets()[0]->vocab_size(), 127 + 1);
    EXPECT_EQ(blend->vocab_size(), 255 + 1) << "the largest of the datasets' vocabularies";
    EXPECT_EQ(blend->datasets()[1]->index().num_epochs, 1);
    std::vector<int64_t> drawn(2, 0);
    for (int64_t i = 0; i < blend->num_samples(); ++i) {
        const int16_t d      = blend->index().dataset_index[static_cast<size_t>(i)];
        const auto    sample = sample_of(*ds, i);
        EXPECT_EQ(sample, sample_of(*blend->datasets()[static_cast<size_t>(d)], blend->index().dataset_sample_index[static_cast<size_t>(i)]));
        for (int32_t t : sample) ASSERT_EQ(t >= 128, d == 1) << "sample " << i << " holds token " << t;
        ++drawn[static_cast<size_t>(d)];
    }
    EXPECT_EQ(drawn, (std::vector<int64_t>{12, 28}));
    // The datasets were asked for ceil(12 x 1.005) = 13 and ceil(28 x 1.005) = 29 samples (one epoch holds more).
    const std::string desc_a = blend->datasets()[0]->cache_description();
    EXPECT_NE(desc_a.find("\"num_samples\": 13"), std::string::npos) << desc_a;
    EXPECT_NE(blend->datasets()[1]->cache_description().find("\"num_samples\": 29"), std::string::npos);
}

// One prefix without a weight is today's GPT dataset: no blending layer, the same indices and samples.
TEST(BlendedDataset, OnePrefixIsTheGptDatasetUnchanged) {
    const std::string a = write_small_vocab_documents("single", 25, 13, 0);
    GptDatasetOptions o;
    o.seq_length = 6;
    o.seed       = 77;
    for (Split which : {Split::train, Split::valid}) {
        auto ds    = open_blended_split(parse_blend(words_of({a.c_str()})), "80,20,0", which, 90, o);
        auto today = open_gpt_dataset(a, "80,20,0", which, 6, 90, 77);
        auto * gpt = dynamic_cast<GptDataset *>(ds.get());
        ASSERT_NE(gpt, nullptr) << "no BlendedDataset around a single prefix";
        EXPECT_EQ(gpt->range(), today->range());
        EXPECT_EQ(gpt->index().document_index, today->index().document_index);
        EXPECT_EQ(gpt->index().shuffle_index, today->index().shuffle_index);
        ASSERT_EQ(gpt->num_samples(), today->num_samples());
        for (int64_t i = 0; i < gpt->num_samples(); ++i) ASSERT_EQ(sample_of(*gpt, i), sample_of(*today, i)) << i;
    }
    // With a weight, --data-path builds the blending layer as Megatron does (a blend of one, N samples of a
    // dataset built with ceil(N x 1.005)); a per-split path (no --split) takes the dataset whole, unblended.
    auto weighted = open_blended_split(parse_blend(words_of({"1", a.c_str()})), "80,20,0", Split::train, 90, o);
    auto * one    = dynamic_cast<BlendedDataset *>(weighted.get());
    ASSERT_NE(one, nullptr);
    EXPECT_EQ(one->num_samples(), 90);
    EXPECT_NE(one->datasets()[0]->cache_description().find("\"num_samples\": 91"), std::string::npos);
    auto   whole = open_blended_split(parse_blend(words_of({"1", a.c_str()})), std::nullopt, Split::valid, 30, o);
    auto * gpt   = dynamic_cast<GptDataset *>(whole.get());
    ASSERT_NE(gpt, nullptr);
    EXPECT_EQ(gpt->range(), (DocumentRange{0, 25}));
    EXPECT_NE(gpt->describe().find("(valid split: documents [0, 25) of 25"), std::string::npos) << gpt->describe();
}

// Prefixes without weights: one epoch of each, weighted by their sample counts, min(N, total) samples.
TEST(BlendedDataset, PrefixesWithoutWeightsBlendOneEpochOfEachBySize) {
    const std::string a = write_small_vocab_documents("sized_a", 10, 21, 0);   // 210 tokens: (210 - 1) / 8 = 26 samples
    const std::string b = write_small_vocab_documents("sized_b", 30, 21, 1);   // 630 tokens: 78 samples
    GptDatasetOptions o;
    o.seq_length = 8;
    auto   ds    = open_blended_split(parse_blend(words_of({a.c_str(), b.c_str()})), "100,0,0", Split::train, 50, o);
    auto * blend = dynamic_cast<BlendedDataset *>(ds.get());
    ASSERT_NE(blend, nullptr);
    EXPECT_EQ(blend->datasets()[0]->num_samples(), 26);
    EXPECT_EQ(blend->datasets()[1]->num_samples(), 78);
    EXPECT_EQ(blend->num_samples(), 50) << "min(N, 26 + 78)";
    EXPECT_DOUBLE_EQ(blend->weights()[0], 0.25);
    auto all = open_blended_split(parse_blend(words_of({a.c_str(), b.c_str()})), "100,0,0", Split::train, 1000, o);
    EXPECT_EQ(all->num_samples(), 26 + 78) << "capped at one epoch of each";
}

// Megatron's IndexError: a blend drawing more samples from a dataset than it holds names the dataset and
// --mid-level-dataset-surplus.
TEST(BlendedDataset, OversampledDatasetIsAnErrorNamingTheSurplusFlag) {
    const std::string a    = write_small_vocab_documents("over_a", 5, 9, 0);   // 45 tokens: 5 samples of 8
    auto              data = std::make_shared<const IndexedDataset>(a);
    std::vector<std::unique_ptr<GptDataset>> datasets;
    datasets.push_back(std::make_unique<GptDataset>(data, DocumentRange{0, 5}, 8, 0, 1));
    datasets.push_back(std::make_unique<GptDataset>(data, DocumentRange{0, 5}, 8, 0, 2));
    const std::string message = error_of([&] { BlendedDataset(std::move(datasets), {0.5, 0.5}, 20, "train"); });
    EXPECT_NE(message.find("the train blend draws 10 samples from dataset 0 ('" + a + "'), more than the 5 it was built with"),
              std::string::npos)
        << message;
    EXPECT_NE(message.find("--mid-level-dataset-surplus"), std::string::npos) << message;
}

// ---------------------------------------------------------------------------------------------------
// The index cache (data/index_cache.h)

TEST(IndexCache, Md5MatchesPythonsHashlib) {
    EXPECT_EQ(md5_hex(""), "d41d8cd98f00b204e9800998ecf8427e");
    EXPECT_EQ(md5_hex("a"), "0cc175b9c0f1b6a831c399e269772661");
    EXPECT_EQ(md5_hex("abc"), "900150983cd24fb0d6963f7d28e17f72");
    EXPECT_EQ(md5_hex("message digest"), "f96b697d7cb7938d525a2f31aaf161d0");
    // The padding's edge cases: 55, 56 and 64 bytes, and two blocks.
    EXPECT_EQ(md5_hex(std::string(55, 'x')), "04364420e25c512fd958a70738aa8f72");
    EXPECT_EQ(md5_hex(std::string(56, 'x')), "668a72d5ba17f08e62dabcafad6db14b");
    EXPECT_EQ(md5_hex(std::string(64, 'x')), "c1bb4f81d892b2d57947682aeb252456");
    std::string digits;
    for (int i = 0; i < 8; ++i) digits += "1234567890";
    EXPECT_EQ(md5_hex(digits), "57edf4a22be3c955ac49da2e2107b67a");
    EXPECT_EQ(md5_hex("The quick brown fox jumps over the lazy dog"), "9e107d9d372bb6826bd81d3542a419d6");
}

// numpy.save's version 1.0 layout byte by byte, read back, and damaged files refused naming them.
TEST(IndexCache, NpyFilesHaveNumpysLayoutAndDamagedOnesAreRefusedByName) {
    const std::string    path = temp_path("pairs.npy");
    std::vector<int64_t> values{0, 0, 1, 5, 2, 7};
    write_npy<int64_t>(path, values, std::vector<int64_t>{3, 2});
    std::vector<uint8_t> bytes = read_bytes(path);
    ASSERT_EQ(bytes.size(), 128u + 48u) << "the header padded to 128 bytes, then 6 x 8";
    const std::string head(bytes.begin(), bytes.begin() + 128);
    EXPECT_EQ(head.substr(0, 8), std::string("\x93NUMPY\x01\x00", 8));
    EXPECT_EQ(bytes[8] + 256 * bytes[9], 118);
    EXPECT_EQ(head.substr(10, 59), "{'descr': '<i8', 'fortran_order': False, 'shape': (3, 2), }");
    EXPECT_EQ(head.back(), '\n');
    NpyArray<int64_t> back = read_npy<int64_t>(path);
    EXPECT_EQ(back.shape, (std::vector<int64_t>{3, 2}));
    EXPECT_EQ(back.values, values);
    const std::string    small = temp_path("small.npy");
    std::vector<int16_t> which{1, 0, 1};
    write_npy<int16_t>(small, which, std::vector<int64_t>{3});
    const std::vector<uint8_t> small_bytes = read_bytes(small);
    EXPECT_NE(std::string(small_bytes.begin(), small_bytes.end()).find("'shape': (3,), }"), std::string::npos);
    EXPECT_EQ(read_npy<int16_t>(small).values, which);

    std::string message = error_of([&] { read_npy<int32_t>(path); });
    EXPECT_NE(message.find("'" + path + "' holds dtype '<i8', and Loom's index is <i4"), std::string::npos) << message;
    bytes.pop_back();
    write_bytes(path, bytes);
    message = error_of([&] { read_npy<int64_t>(path); });
    EXPECT_NE(message.find("'" + path + "' is 175 bytes"), std::string::npos) << message;
    EXPECT_NE(message.find("(truncated)"), std::string::npos) << message;
    EXPECT_NE(message.find("delete the cached index files"), std::string::npos) << message;
    write_bytes(path, {'n', 'o', 't', ' ', 'n', 'p', 'y', '!', '!', '!', '!'});
    message = error_of([&] { read_npy<int64_t>(path); });
    EXPECT_NE(message.find("'" + path + "' is not a .npy file"), std::string::npos) << message;
}

namespace {

// The files of a folder, name -> (modification time in ns, size).
std::map<std::string, std::pair<int64_t, int64_t>> folder_files(const std::string & dir) {
    std::map<std::string, std::pair<int64_t, int64_t>> files;
    for (const auto & entry : std::filesystem::directory_iterator(dir)) {
        struct stat st;
        EXPECT_EQ(::stat(entry.path().c_str(), &st), 0);
        files[entry.path().filename().string()] = {int64_t(st.st_mtim.tv_sec) * 1'000'000'000 + st.st_mtim.tv_nsec, st.st_size};
    }
    return files;
}

}  // namespace

// --data-cache-path: the first build writes every index (named by the MD5 of its description), a second
// build with the same description loads them (no file is rewritten: the modification times stay) and
// serves the same samples; a rank that does not write leaves the folder as it is.
TEST(IndexCache, FirstBuildWritesTheIndicesAndTheSecondLoadsThemUnchanged) {
    const std::string a   = write_small_vocab_documents("cache_a", 30, 21, 0);
    const std::string b   = write_small_vocab_documents("cache_b", 40, 17, 1);
    const std::string dir = temp_path("index_cache");
    std::filesystem::remove_all(dir);
    GptDatasetOptions o;
    o.seq_length = 8;
    o.seed       = 5;
    const Blend blend = parse_blend(words_of({"0.3", a.c_str(), "0.7", b.c_str()}));
    auto        plain = open_blended_split(blend, "90,10,0", Split::train, 60, o);   // no cache: nothing written

    o.cache.path = dir;
    o.cache.write = false;
    auto reader  = open_blended_split(blend, "90,10,0", Split::train, 60, o);
    EXPECT_FALSE(std::filesystem::exists(dir)) << "a rank that does not write builds in memory on a miss";

    o.cache.write = true;
    auto first    = open_blended_split(blend, "90,10,0", Split::train, 60, o);
    auto files    = folder_files(dir);
    ASSERT_EQ(files.size(), 4u + 4u + 3u) << "two GPT sets of 4 files and the blend's 3";
    const auto & blended = dynamic_cast<const BlendedDataset &>(*first);
    EXPECT_FALSE(blended.loaded_from_cache());
    const std::string hash = md5_hex(blended.datasets()[0]->cache_description());
    for (const char * suffix : {"description.txt", "document_index.npy", "sample_index.npy", "shuffle_index.npy"}) {
        EXPECT_EQ(files.count(hash + "-GPTDataset-train-" + suffix), 1u) << suffix;
    }
    EXPECT_EQ(read_npy<int32_t>(dir + "/" + hash + "-GPTDataset-train-document_index.npy").values,
              blended.datasets()[0]->index().document_index);

    auto second = open_blended_split(blend, "90,10,0", Split::train, 60, o);
    const auto & again = dynamic_cast<const BlendedDataset &>(*second);
    EXPECT_TRUE(again.loaded_from_cache());
    EXPECT_TRUE(again.datasets()[0]->loaded_from_cache());
    EXPECT_TRUE(again.datasets()[1]->loaded_from_cache());
    EXPECT_EQ(folder_files(dir), files) << "nothing rewritten";
    EXPECT_EQ(again.index().dataset_index, blended.index().dataset_index);
    EXPECT_EQ(again.datasets()[1]->index().sample_index, blended.datasets()[1]->index().sample_index);
    EXPECT_EQ(again.datasets()[1]->index().shuffle_index, blended.datasets()[1]->index().shuffle_index);
    ASSERT_EQ(second->num_samples(), plain->num_samples());
    for (int64_t i = 0; i < second->num_samples(); ++i) {
        ASSERT_EQ(sample_of(*second, i), sample_of(*plain, i)) << i;
        ASSERT_EQ(sample_of(*reader, i), sample_of(*plain, i)) << i;
    }
    EXPECT_NE(second->describe().find("[indices loaded from " + dir + "]"), std::string::npos) << second->describe();

    // Another description (another seed) is another set beside it.
    o.seed = 6;
    open_blended_split(blend, "90,10,0", Split::train, 60, o);
    EXPECT_EQ(folder_files(dir).size(), 2 * files.size());
}

// A damaged cache file is an error naming it, with the hint to delete the set; a set missing a file is a
// miss, rebuilt and rewritten.
TEST(IndexCache, DamagedFileIsAnErrorNamingItAndAnIncompleteSetIsRebuilt) {
    const std::string a   = write_small_vocab_documents("damaged", 30, 21, 0);
    const std::string dir = temp_path("damaged_cache");
    std::filesystem::remove_all(dir);
    IndexCacheOptions cache{dir, true};
    auto              built = open_gpt_dataset(a, "100,0,0", Split::train, 8, 40, 3, 0, cache);
    const std::string base  = dir + "/" + md5_hex(built->cache_description()) + "-GPTDataset-train-";
    auto open = [&] { return open_gpt_dataset(a, "100,0,0", Split::train, 8, 40, 3, 0, cache); };
    EXPECT_TRUE(open()->loaded_from_cache());

    // A truncated shuffle index.
    const std::vector<uint8_t> shuffle = read_bytes(base + "shuffle_index.npy");
    write_bytes(base + "shuffle_index.npy", std::vector<uint8_t>(shuffle.begin(), shuffle.end() - 8));
    std::string message = error_of([&] { open(); });
    EXPECT_NE(message.find("'" + base + "shuffle_index.npy' is"), std::string::npos) << message;
    EXPECT_NE(message.find("(truncated)"), std::string::npos) << message;
    EXPECT_NE(message.find("delete the"), std::string::npos) << message;
    write_bytes(base + "shuffle_index.npy", shuffle);

    // A document id outside the split, in a file of the right size.
    std::vector<uint8_t> documents = read_bytes(base + "document_index.npy");
    const std::vector<uint8_t> good = documents;
    poke<int32_t>(documents, documents.size() - 4, 999);
    write_bytes(base + "document_index.npy", documents);
    message = error_of([&] { open(); });
    EXPECT_NE(message.find("'" + base + "document_index.npy' holds document id 999, outside the split's [0, 30)"),
              std::string::npos)
        << message;
    write_bytes(base + "document_index.npy", good);

    // A shuffle index that is not a permutation.
    std::vector<uint8_t> repeated = shuffle;
    std::memcpy(repeated.data() + repeated.size() - 8, repeated.data() + repeated.size() - 16, 8);
    write_bytes(base + "shuffle_index.npy", repeated);
    message = error_of([&] { open(); });
    EXPECT_NE(message.find("'" + base + "shuffle_index.npy' is not a permutation"), std::string::npos) << message;
    write_bytes(base + "shuffle_index.npy", shuffle);

    // A description edited under the same name.
    std::ofstream(base + "description.txt", std::ios::app) << " ";
    message = error_of([&] { open(); });
    EXPECT_NE(message.find("'" + base + "description.txt' does not describe the indices this run needs"), std::string::npos)
        << message;
    std::ofstream(base + "description.txt", std::ios::trunc) << built->cache_description();
    auto intact = open();
    EXPECT_TRUE(intact->loaded_from_cache());
    EXPECT_EQ(intact->index().shuffle_index, built->index().shuffle_index);

    // A missing file: the set is incomplete, rebuilt and written again.
    std::filesystem::remove(base + "sample_index.npy");
    auto rebuilt = open();
    EXPECT_FALSE(rebuilt->loaded_from_cache());
    EXPECT_TRUE(std::filesystem::exists(base + "sample_index.npy"));
    EXPECT_EQ(read_npy<int64_t>(base + "sample_index.npy").values, built->index().sample_index);
    EXPECT_TRUE(open()->loaded_from_cache());

    // Another dataset written at the same prefix, with as many documents and tokens but other lengths: its
    // indices differ, so the cached set is not used; a new one is built beside it.
    IndexedDatasetWriter w(a, IndexDType::u16);
    for (int d = 0; d < 30; ++d) {
        std::vector<int32_t> tokens;
        for (int i = 0; i < (d % 2 == 0 ? 11 : 31); ++i) tokens.push_back((7 * d + 3 * i) % 128);
        w.add_document(tokens);
    }
    w.finish();
    auto other = open();
    EXPECT_FALSE(other->loaded_from_cache()) << "a set built for the old documents";
    EXPECT_NE(other->index().sample_index, built->index().sample_index);
    EXPECT_EQ(other->index().sample_index, open_gpt_dataset(a, "100,0,0", Split::train, 8, 40, 3, 0, {})->index().sample_index);
}

// ---------------------------------------------------------------------------------------------------
// llm.c shards

TEST(LlmcShard, ReadsBothVersionsAsWindowsWithStrideSeqLength) {
    std::vector<int32_t> tokens(23);
    std::iota(tokens.begin(), tokens.end(), 100);
    for (bool llama3 : {false, true}) {
        std::string path = temp_path(llama3 ? "llama3.bin" : "gpt2.bin");
        std::vector<int32_t> t = tokens;
        if (llama3) t[5] = 128000;
        write_llmc_shard(path, t, llama3);
        EXPECT_EQ(read_bytes(path).size(), 1024u + t.size() * (llama3 ? 4 : 2));
        LlmcShardDataset ds(path, 5);
        EXPECT_EQ(ds.num_tokens(), 23);
        EXPECT_EQ(ds.num_samples(), (23 - 1) / 5);
        EXPECT_EQ(ds.vocab_size(), llama3 ? 128256 : 50257);
        std::vector<int32_t> w(6);
        ds.sample(0, w);
        EXPECT_EQ(w, (std::vector<int32_t>{100, 101, 102, 103, 104, t[5]}));
        ds.sample(3, w);
        EXPECT_EQ(w, (std::vector<int32_t>{115, 116, 117, 118, 119, 120}));
    }
}

TEST(LlmcShard, MalformedShardsThrowNamingTheFileAndField) {
    std::vector<int32_t> tokens(40, 7);
    std::string          good = temp_path("good_shard.bin");
    write_llmc_shard(good, tokens);
    const std::vector<uint8_t> bytes = read_bytes(good);
    struct Case {
        const char * name;
        std::function<void(std::vector<uint8_t> &)> corrupt;
        const char * field;
    };
    const Case cases[] = {
        {"magic", [](auto & b) { poke<int32_t>(b, 0, 20240522); }, "h[0] = 20240522"},
        {"version", [](auto & b) { poke<int32_t>(b, 4, 7); }, "h[1] = 7"},
        {"count", [](auto & b) { poke<int32_t>(b, 8, 41); }, "h[2] = 41"},
        {"truncated", [](auto & b) { b.resize(b.size() - 2); }, "truncated"},
        {"no_header", [](auto & b) { b.resize(100); }, "1024-byte header"},
        {"token", [](auto & b) { poke<uint16_t>(b, 1024, 60000); }, "token id 60000"},
    };
    for (const Case & c : cases) {
        std::string          path = temp_path(std::string("bad_shard_") + c.name + ".bin");
        std::vector<uint8_t> b = bytes;
        c.corrupt(b);
        write_bytes(path, b);
        std::string message = error_of([&] {
            LlmcShardDataset     ds(path, 4);
            std::vector<int32_t> window(5);
            ds.sample(0, window);
        });
        EXPECT_NE(message.find(path), std::string::npos) << c.name << ": " << message;
        EXPECT_NE(message.find(c.field), std::string::npos) << c.name << ": " << message;
    }
}

// ---------------------------------------------------------------------------------------------------
// Synthetic data

TEST(SyntheticDataset, IsDeterministicInRangeAndNearItsEntropyFloor) {
    const int64_t    vocab = 64, seq = 32;
    SyntheticDataset a(vocab, seq, 3), b(vocab, seq, 3), c(vocab, seq, 4);
    std::vector<int32_t> x(seq + 1), y(seq + 1), z(seq + 1);
    std::map<std::pair<int32_t, int32_t>, double> pair_count;
    std::map<int32_t, double>                     from_count;
    for (int64_t i = 0; i < 4000; ++i) {
        a.sample(i, x);
        b.sample(i, y);
        ASSERT_EQ(x, y);
        for (int k = 0; k <= seq; ++k) ASSERT_TRUE(x[k] >= 0 && x[k] < vocab);
        for (int k = 0; k < seq; ++k) {
            pair_count[{x[k], x[k + 1]}] += 1;
            from_count[x[k]] += 1;
        }
    }
    c.sample(0, z);
    a.sample(0, x);
    EXPECT_NE(x, z);
    // The empirical conditional entropy H(next | current) is the loss floor: about 1.11 nats (a little less
    // where successors coincide), far below ln 64 = 4.16.
    double h = 0.0, total = 0.0;
    for (auto & [key, n] : pair_count) {
        h -= n * std::log(n / from_count[key.first]);
        total += n;
    }
    h /= total;
    EXPECT_LT(h, SyntheticDataset::kEntropyNats + 0.05);
    EXPECT_GT(h, 0.8);
}

// ---------------------------------------------------------------------------------------------------
// Loader

TEST(Loader, DataParallelRanksTileEachGlobalBatchExactlyAndResume) {
    std::vector<int32_t> lengths(60);
    for (size_t i = 0; i < lengths.size(); ++i) lengths[i] = static_cast<int32_t>(5 + i % 13);
    std::string prefix = write_numbered_documents("loader", lengths);
    auto        ds     = open_gpt_dataset(prefix, "1", Split::train, 6, 0, 99);
    Device &    device = cpu::device();
    const int64_t mbs = 2, dp = 3, num_microbatches = 4, gbs = mbs * dp * num_microbatches, s = 6;
    ASSERT_GT(ds->num_samples(), 2 * gbs);

    std::vector<int32_t> window(s + 1);
    auto expect_row_is_sample = [&](const Batch & batch, int64_t row, int64_t sample) {
        ds->sample(sample, window);
        for (int64_t i = 0; i < s; ++i) {
            ASSERT_EQ(batch.tokens.data<int32_t>()[row * s + i], window[i]);
            ASSERT_EQ(batch.labels.data<int32_t>()[row * s + i], window[i + 1]) << "labels are tokens shifted by one";
            ASSERT_EQ(batch.loss_mask.data<float>()[row * s + i], 1.0f);
        }
    };

    std::vector<Loader> loaders;
    loaders.reserve(dp);
    for (int64_t r = 0; r < dp; ++r) loaders.emplace_back(*ds, mbs, r, dp, device);
    for (int64_t iteration = 0; iteration < 2; ++iteration) {
        std::vector<int> seen(static_cast<size_t>(gbs), 0);
        for (int64_t m = 0; m < num_microbatches; ++m) {
            for (int64_t r = 0; r < dp; ++r) {
                Batch batch = loaders[r].next_microbatch();
                ASSERT_EQ(batch.tokens.shape(), (Shape{mbs, s}));
                ASSERT_EQ(batch.labels.dtype(), DType::i32);
                ASSERT_EQ(batch.loss_mask.dtype(), DType::f32);
                for (int64_t j = 0; j < mbs; ++j) {
                    int64_t sample = iteration * gbs + m * mbs * dp + r * mbs + j;   // Megatron's sampler
                    expect_row_is_sample(batch, j, sample);
                    ++seen[static_cast<size_t>(sample - iteration * gbs)];
                }
            }
        }
        for (int n : seen) EXPECT_EQ(n, 1) << "each sample of the global batch is read by exactly one rank, once";
        for (const Loader & l : loaders) EXPECT_EQ(l.consumed_samples(), (iteration + 1) * gbs);
    }
    // Resume at consumed_samples = 2 gbs: the same micro-batches as the loader that kept going.
    Loader resumed(*ds, mbs, 1, dp, device, 2 * gbs);
    Batch  x = resumed.next_microbatch(), y = loaders[1].next_microbatch();
    EXPECT_EQ(std::vector<int32_t>(x.tokens.data<int32_t>(), x.tokens.data<int32_t>() + mbs * s),
              std::vector<int32_t>(y.tokens.data<int32_t>(), y.tokens.data<int32_t>() + mbs * s));
    Loader later(*ds, mbs, 0, dp, device);
    later.set_consumed_samples(ds->num_samples() - 1);
    EXPECT_EQ(later.sample_index(0), ds->num_samples() - 1);
    EXPECT_EQ(later.sample_index(1), 0) << "indices wrap around the dataset";
}

// ---------------------------------------------------------------------------------------------------
// Conversion

TEST(Preprocess, TextParagraphsLinesAndJsonLinesBecomeByteDocuments) {
    std::string text = temp_path("doc.txt");
    std::ofstream(text) << "Hi\r\nthere\n\n\n  \nBye\n";
    PreprocessOptions o;
    o.input         = text;
    o.output_prefix = temp_path("para");
    PreprocessResult r = preprocess_to_indexed_dataset(o);
    EXPECT_EQ(r.prefix, o.output_prefix + "_text_document");
    EXPECT_EQ(r.documents, 2);
    EXPECT_EQ(r.vocab_size, 257);
    IndexedDataset ds(r.prefix);
    EXPECT_EQ(ds.sequence(0), (std::vector<int32_t>{72, 105, 10, 116, 104, 101, 114, 101, 256}));
    EXPECT_EQ(ds.sequence(1), (std::vector<int32_t>{66, 121, 101, 256}));
    EXPECT_EQ(ds.num_documents(), 2);

    o.text_documents = TextDocuments::line;
    o.append_eod     = false;
    o.output_prefix  = temp_path("lines");
    r                = preprocess_to_indexed_dataset(o);
    EXPECT_EQ(r.documents, 3);
    EXPECT_EQ(r.vocab_size, 256);
    EXPECT_EQ(IndexedDataset(r.prefix).sequence(1), (std::vector<int32_t>{'t', 'h', 'e', 'r', 'e'}));

    std::string jsonl = temp_path("docs.jsonl");
    std::ofstream(jsonl) << "{\"id\": 1, \"body\": \"caf\\u00e9\"}\n\n{\"body\": \"\"}\n{\"body\": \"x\"}\n";
    PreprocessOptions j;
    j.input         = jsonl;
    j.json_key      = "body";
    j.output_prefix = temp_path("json");
    r               = preprocess_to_indexed_dataset(j);
    EXPECT_EQ(r.prefix, j.output_prefix + "_body_document");
    EXPECT_EQ(r.documents, 2);
    EXPECT_EQ(r.skipped, 1);
    EXPECT_EQ(IndexedDataset(r.prefix).sequence(0), (std::vector<int32_t>{'c', 'a', 'f', 0xc3, 0xa9, 256}));

    j.json_key          = "text";
    std::string message = error_of([&] { preprocess_to_indexed_dataset(j); });
    EXPECT_NE(message.find(jsonl + "' line 1"), std::string::npos) << message;
    EXPECT_NE(message.find("\"text\""), std::string::npos) << message;
    EXPECT_NE(message.find("its fields: body, id"), std::string::npos) << message;
    // Nothing is left behind by a failed conversion.
    EXPECT_NE(::access(index_file_path(document_dataset_prefix(j.output_prefix, "text")).c_str(), F_OK), 0);
}

// ---------------------------------------------------------------------------------------------------
// `loom data`, run as a program

namespace {


}  // namespace

TEST(LoomData, ConvertsTextAndJsonLinesThatTheReaderReadsBack) {
    std::string text = temp_path("cli.txt");
    std::ofstream(text) << "first document\nstill first\n\nsecond\n";
    std::string prefix = temp_path("cli_text");
    CliRun      r      = run_loom("data --input " + text + " --output-prefix " + prefix);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find("2 documents"), std::string::npos) << r.out;
    IndexedDataset ds(prefix + "_text_document");
    EXPECT_EQ(ds.num_documents(), 2);
    std::vector<int32_t> second = ds.sequence(1);
    EXPECT_EQ(std::string(second.begin(), second.end() - 1), "second");
    EXPECT_EQ(second.back(), kByteEod);

    std::string jsonl = temp_path("cli.jsonl");
    std::ofstream out(jsonl);
    for (int i = 0; i < 40; ++i) out << "{\"text\": \"document number " << i << " says hello\"}\n";
    out.close();
    std::string jprefix = temp_path("cli_json");
    r                   = run_loom("data --input " + jsonl + " --output-prefix " + jprefix + " --json-keys text");
    ASSERT_EQ(r.status, 0) << r.out;
    auto gpt = open_gpt_dataset(jprefix + "_text_document", "969,30,1", Split::train, 16, 0, 1234);
    EXPECT_EQ(gpt->range(), (DocumentRange{0, 39}));
    EXPECT_EQ(gpt->vocab_size(), 257);
    EXPECT_GT(gpt->num_samples(), 40);
}

TEST(LoomData, BadInputExitsTwoNamingTheProblem) {
    std::string text = temp_path("cli_bad.txt");
    std::ofstream(text) << "hello\n";
    std::string jsonl = temp_path("cli_bad.jsonl");
    std::ofstream(jsonl) << "{\"text\": \"ok\"}\nnot json\n";
    struct Case {
        std::string args, names;
    } cases[] = {
        {"data --input " + text + " --output-prefix " + temp_path("o1") + " --vocab-file vocab.json --merge-file merges.txt",
         "cannot read vocab file 'vocab.json'"},
        {"data --input " + text + " --output-prefix " + temp_path("o2") + " --tokenizer-type GPT2BPETokenizer",
         "--tokenizer-type GPT2BPETokenizer needs --vocab-file and --merge-file"},
        {"data --input " + jsonl + " --output-prefix " + temp_path("o3"), jsonl + "' line 2 is not valid JSON"},
        {"data --input /nonexistent/loom.txt --output-prefix " + temp_path("o4"), "/nonexistent/loom.txt"},
        {"data --input " + text + " --output-prefix /nonexistent/dir/x", "/nonexistent/dir/x_text_document.bin"},
        {"data --output-prefix " + temp_path("o5"), "--input"},
    };
    for (const Case & c : cases) {
        CliRun r = run_loom(c.args);
        EXPECT_EQ(r.status, 2) << c.args << " -> " << r.out;
        EXPECT_NE(r.out.find(c.names), std::string::npos) << c.args << " -> " << r.out;
    }
}

// `loom train` on a weighted blend, end to end: --data-path 0.3 A 0.7 B trains, writes its indices to
// --data-cache-path and loads them on the second run (the same losses); a malformed list exits 2 naming
// the word.
TEST(LoomTrain, WeightedDataPathTrainsWritesTheCacheAndLoadsItOnTheNextRun) {
    const std::string a   = write_small_vocab_documents("cli_blend_a", 30, 21, 0);
    const std::string b   = write_small_vocab_documents("cli_blend_b", 40, 17, 1);
    const std::string dir = temp_path("cli_cache");
    std::filesystem::remove_all(dir);
    const std::string args = "train --data-path 0.3 " + a + " 0.7 " + b +
                             " --split 100,0,0 --train-iters 3 --num-layers 1 --seq-length 16 --micro-batch-size 2 "
                             "--log-interval 1 --data-cache-path " + dir;
    CliRun first = run_loom(args);
    ASSERT_EQ(first.status, 0) << first.out;
    // 3 iterations x 2 samples: ceil(6 x 0.3) + ceil(6 x 0.7) = 2 + 5 samples, the vocabulary the larger one's.
    EXPECT_NE(first.out.find("data: Megatron blend of 2 datasets (train split, 7 samples, vocab 256, weights 0.3 0.7) "
                             "[indices written to " + dir + "]"),
              std::string::npos)
        << first.out;
    EXPECT_NE(first.out.find("iteration        3/       3"), std::string::npos) << first.out;
    EXPECT_EQ(folder_files(dir).size(), 11u);
    CliRun second = run_loom(args);
    ASSERT_EQ(second.status, 0) << second.out;
    EXPECT_NE(second.out.find("[indices loaded from " + dir + "]"), std::string::npos) << second.out;
    auto losses = [](const std::string & out) {
        std::string found;
        for (size_t at = out.find("lm loss: "); at != std::string::npos; at = out.find("lm loss: ", at + 1)) {
            found += out.substr(at, 21) + "\n";
        }
        return found;
    };
    EXPECT_FALSE(losses(first.out).empty()) << first.out;
    EXPECT_EQ(losses(second.out), losses(first.out)) << "the cached indices serve the same samples";

    CliRun bad = run_loom("train --data-path 0.3 " + a + " 0.7 --split 100,0,0 --train-iters 1");
    EXPECT_EQ(bad.status, 2) << bad.out;
    EXPECT_NE(bad.out.find("--data-path: '0.3' (word 1) reads as a weight, but the 3 words are not WEIGHT PREFIX pairs"),
              std::string::npos)
        << bad.out;
}
