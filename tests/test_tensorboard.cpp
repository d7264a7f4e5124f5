// TensorBoard event files (train/tensorboard.h) read back by an independent reader written here from the
// format's description: TFRecord framing with masked CRC-32C (computed bit by bit, not with Loom's SSE4.2
// routine), and the protobuf fields of tensorflow.Event and Summary. Then `loom train --tensorboard-dir`:
// Megatron's tags, the steps, and the values the log line and the validation report print.
#include "train/tensorboard.h"

#include "loom_cli_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <map>
#include <regex>
#include <set>
#include <string>
#include <vector>

namespace {

namespace fs = std::filesystem;

uint32_t crc32c_bitwise(const uint8_t * p, size_t n) {
    uint32_t crc = 0xffffffffu;
    for (size_t i = 0; i < n; ++i) {
        crc ^= p[i];
        for (int b = 0; b < 8; ++b) crc = (crc >> 1) ^ (0x82f63b78u & (0u - (crc & 1u)));
    }
    return ~crc;
}

uint32_t masked(uint32_t c) { return ((c >> 15) | (c << 17)) + 0xa282ead8u; }

struct Event {
    double      wall_time = 0;
    int64_t     step      = 0;
    std::string file_version;
    std::string tag;
    float       value     = NAN;
};

uint64_t varint(const std::string & s, size_t & at) {
    uint64_t v = 0;
    for (int shift = 0;; shift += 7) {
        const uint8_t byte = static_cast<uint8_t>(s.at(at++));
        v |= static_cast<uint64_t>(byte & 0x7f) << shift;
        if (!(byte & 0x80)) return v;
    }
}

// Calls f(field, wire type, payload start, payload length or the varint value) for each field of a message.
template <typename F> void fields(const std::string & s, F f) {
    size_t at = 0;
    while (at < s.size()) {
        const uint64_t key = varint(s, at);
        const int      field = static_cast<int>(key >> 3), wire = static_cast<int>(key & 7);
        if (wire == 0) {
            f(field, wire, at, varint(s, at));
        } else if (wire == 1) {
            f(field, wire, at, 8);
            at += 8;
        } else if (wire == 5) {
            f(field, wire, at, 4);
            at += 4;
        } else {
            ASSERT_EQ(wire, 2) << "unexpected wire type";
            const uint64_t n = varint(s, at);
            f(field, wire, at, n);
            at += n;
        }
    }
}

Event parse_event(const std::string & data) {
    Event e;
    fields(data, [&](int field, int, size_t at, uint64_t n) {
        if (field == 1) std::memcpy(&e.wall_time, data.data() + at, 8);
        if (field == 2) e.step = static_cast<int64_t>(n);
        if (field == 3) e.file_version = data.substr(at, n);
        if (field == 5) {
            const std::string summary = data.substr(at, n);
            fields(summary, [&](int sf, int, size_t sat, uint64_t sn) {
                if (sf != 1) return;
                const std::string value = summary.substr(sat, sn);
                fields(value, [&](int vf, int, size_t vat, uint64_t vn) {
                    if (vf == 1) e.tag = value.substr(vat, vn);
                    if (vf == 2) std::memcpy(&e.value, value.data() + vat, 4);
                });
            });
        }
    });
    return e;
}

// Every record of an event file, each CRC checked.
std::vector<Event> read_events(const std::string & path) {
    std::ifstream     in(path, std::ios::binary);
    const std::string bytes{std::istreambuf_iterator<char>(in), std::istreambuf_iterator<char>()};
    std::vector<Event> events;
    size_t             at = 0;
    while (at < bytes.size()) {
        EXPECT_LE(at + 12, bytes.size()) << "truncated record header";
        if (at + 12 > bytes.size()) break;
        uint64_t length;
        uint32_t length_crc, data_crc;
        std::memcpy(&length, bytes.data() + at, 8);
        std::memcpy(&length_crc, bytes.data() + at + 8, 4);
        EXPECT_EQ(length_crc, masked(crc32c_bitwise(reinterpret_cast<const uint8_t *>(bytes.data() + at), 8)));
        const std::string data = bytes.substr(at + 12, length);
        std::memcpy(&data_crc, bytes.data() + at + 12 + length, 4);
        EXPECT_EQ(data_crc, masked(crc32c_bitwise(reinterpret_cast<const uint8_t *>(data.data()), data.size())));
        events.push_back(parse_event(data));
        at += 12 + length + 4;
    }
    return events;
}

std::string only_event_file(const std::string & dir) {
    std::vector<std::string> files;
    for (const auto & entry : fs::directory_iterator(dir)) files.push_back(entry.path().string());
    EXPECT_EQ(files.size(), 1u);
    EXPECT_NE(files.empty() ? std::string::npos : files[0].find("events.out.tfevents."), std::string::npos);
    return files.empty() ? "" : files[0];
}

}  // namespace

TEST(TensorBoardWriter, RecordsReadBackWithTheirTagsStepsAndValues) {
    const std::string dir = fs::temp_directory_path() / ("loom_tb_unit_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    {
        loom::train::TensorBoardWriter w(dir + "/nested");
        w.add_scalar("lm loss", 6.25, 1);
        w.add_scalar("learning-rate vs samples", 1.5e-4, 4096);
        w.add_scalar("grad-norm", -0.5, 1LL << 40);
        w.flush();
    }
    const std::vector<Event> events = read_events(only_event_file(dir + "/nested"));
    ASSERT_EQ(events.size(), 4u);
    EXPECT_EQ(events[0].file_version, "brain.Event:2");
    EXPECT_GT(events[0].wall_time, 1.7e9) << "seconds since 1970";
    const std::tuple<const char *, int64_t, float> want[] = {
        {"lm loss", 1, 6.25f}, {"learning-rate vs samples", 4096, 1.5e-4f}, {"grad-norm", 1LL << 40, -0.5f}};
    for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(events[i + 1].tag, std::get<0>(want[i]));
        EXPECT_EQ(events[i + 1].step, std::get<1>(want[i]));
        EXPECT_EQ(events[i + 1].value, std::get<2>(want[i]));
        EXPECT_GE(events[i + 1].wall_time, events[i].wall_time);
    }
    fs::remove_all(dir);
}

TEST(TensorBoardWriter, LoomTrainWritesMegatronsScalars) {
    const std::string dir = fs::temp_directory_path() / ("loom_tb_train_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const std::string log = dir + "_metrics.jsonl";
    CliRun r = run_loom("train --mock-data --train-iters 4 --num-layers 1 --log-interval 1 --eval-interval 2 "
                        "--eval-iters 1 --tensorboard-dir " + dir + " --log-validation-ppl-to-tensorboard "
                        "--log-timers-to-tensorboard --log-memory-to-tensorboard --log-throughput --log-file " + log);
    ASSERT_EQ(r.status, 0) << r.out;
    const std::vector<Event> events = read_events(only_event_file(dir));
    std::map<std::string, std::vector<std::pair<int64_t, float>>> by_tag;
    for (size_t i = 1; i < events.size(); ++i) by_tag[events[i].tag].emplace_back(events[i].step, events[i].value);
    for (const char * tag : {"learning-rate", "learning-rate vs samples", "batch-size", "batch-size vs samples",
                             "lm loss", "lm loss vs samples", "loss-scale", "grad-norm", "grad-norm vs samples",
                             "mem-reserved-bytes", "mem-allocated-bytes", "mem-max-allocated-bytes", "iteration-time",
                             "throughput", "lm loss validation", "lm loss validation vs samples",
                             "lm loss validation ppl"}) {
        EXPECT_TRUE(by_tag.count(tag)) << "no '" << tag << "' scalar";
    }
    // The per-iteration scalars at steps 1..4 (samples 8..32), equal to the JSON log's values.
    std::ifstream in(log);
    std::string   line;
    for (int64_t k = 1; std::getline(in, line); ++k) {
        const nlohmann::json j = nlohmann::json::parse(line);
        ASSERT_EQ(by_tag["lm loss"].at(k - 1).first, k);
        EXPECT_FLOAT_EQ(by_tag["lm loss"].at(k - 1).second, j["lm loss"].get<float>()) << "iteration " << k;
        EXPECT_FLOAT_EQ(by_tag["learning-rate"].at(k - 1).second, j["learning rate"].get<float>());
        EXPECT_FLOAT_EQ(by_tag["grad-norm"].at(k - 1).second, j["grad norm"].get<float>());
        EXPECT_EQ(by_tag["lm loss vs samples"].at(k - 1).first, 8 * k);
        EXPECT_EQ(by_tag["batch-size"].at(k - 1).second, 8.0f);
    }
    // Validation at iterations 2 and 4, and after training (4 again), the values of the printed report; the
    // test split's report after them is not written to TensorBoard.
    const std::regex report(" validation loss at ([^|]+)\\| lm loss value: ([0-9.E+-]+) \\| lm loss PPL: ([0-9.E+-]+)");
    std::vector<double> printed, ppl;
    EXPECT_NE(r.out.find("validation loss at iteration 4 on test set"), std::string::npos) << r.out;
    for (std::sregex_iterator it(r.out.begin(), r.out.end(), report), end; it != end; ++it) {
        if ((*it)[1].str().find("on test set") != std::string::npos) continue;
        printed.push_back(std::stod((*it)[2].str()));
        ppl.push_back(std::stod((*it)[3].str()));
    }
    const auto & validation = by_tag["lm loss validation"];
    ASSERT_EQ(validation.size(), 3u);
    ASSERT_EQ(printed.size(), 3u);
    const int64_t steps[] = {2, 4, 4};
    for (size_t i = 0; i < 3; ++i) {
        EXPECT_EQ(validation[i].first, steps[i]);
        EXPECT_NEAR(validation[i].second, printed[i], 1e-6 * printed[i]);   // the report prints 7 digits
        EXPECT_NEAR(by_tag["lm loss validation ppl"].at(i).second, ppl[i], 1e-6 * ppl[i]);
    }
    fs::remove_all(dir);
    fs::remove(log);
    // A file where the folder should be is refused before training.
    CliRun bad = run_loom("train --mock-data --tensorboard-dir /etc/hostname");
    EXPECT_EQ(bad.status, 2);
    EXPECT_NE(bad.out.find("--tensorboard-dir '/etc/hostname' exists and is not a folder"), std::string::npos) << bad.out;
}

// A MoE run adds the router's tracked losses, as Megatron's tracker writes them (their own tags, by
// iteration), equal to the log's; with --moe-per-layer-logging also each layer's (moe/<name>_layer_<i>),
// whose mean over the two MoE layers is the logged value (to f32 rounding).
TEST(TensorBoardWriter, MoeRunWritesTheRoutersLosses) {
    const std::string dir = fs::temp_directory_path() / ("loom_tb_moe_" + std::to_string(::getpid()));
    fs::remove_all(dir);
    const std::string log = dir + "_metrics.jsonl";
    CliRun r = run_loom("train --mock-data --train-iters 3 --num-layers 2 --log-interval 1 --num-experts 4 "
                        "--moe-aux-loss-coeff 1e-2 --moe-z-loss-coeff 1e-3 --moe-per-layer-logging --tensorboard-dir " +
                        dir + " --log-file " + log);
    ASSERT_EQ(r.status, 0) << r.out;
    EXPECT_NE(r.out.find(" | load_balancing_loss: "), std::string::npos) << r.out;
    const std::vector<Event> events = read_events(only_event_file(dir));
    std::map<std::string, std::vector<std::pair<int64_t, float>>> by_tag;
    for (size_t i = 1; i < events.size(); ++i) by_tag[events[i].tag].emplace_back(events[i].step, events[i].value);
    std::ifstream in(log);
    std::string   line;
    int64_t       k = 1;
    for (; std::getline(in, line); ++k) {
        const nlohmann::json j = nlohmann::json::parse(line);
        for (const char * tag : {"load_balancing_loss", "z_loss"}) {
            ASSERT_EQ(by_tag[tag].size(), 3u) << tag;
            EXPECT_EQ(by_tag[tag].at(k - 1).first, k);
            EXPECT_FLOAT_EQ(by_tag[tag].at(k - 1).second, j[tag].get<float>()) << tag << ", iteration " << k;
            EXPECT_GT(j[tag].get<double>(), 0.0) << tag;
            const std::string layer = std::string("moe/") + tag + "_layer_";
            ASSERT_EQ(by_tag[layer + "0"].size(), 3u) << layer;
            ASSERT_EQ(by_tag[layer + "1"].size(), 3u) << layer;
            EXPECT_EQ(by_tag.count(layer + "2"), 0u) << "two layers";
            const double mean = (by_tag[layer + "0"].at(k - 1).second + by_tag[layer + "1"].at(k - 1).second) / 2.0;
            EXPECT_NEAR(mean, j[tag].get<double>(), 1e-6 * j[tag].get<double>()) << tag << ", iteration " << k;
            EXPECT_NE(by_tag[layer + "0"].at(k - 1).second, by_tag[layer + "1"].at(k - 1).second) << "each layer its own";
        }
    }
    EXPECT_EQ(k, 4);
    fs::remove_all(dir);
    fs::remove(log);
}
