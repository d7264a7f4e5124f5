// Hugging Face GPT-2 import and export (model/hf_gpt2.h) against tests/fixtures/hf_gpt2_tiny, written by
// tools/make_hf_gpt2_fixture.py: a random 2-layer GPT-2 (h 64, a 4, P 32, V 300, padded to 384 here) and
// the logits and loss of an independent float64 GPT-2 forward on a fixed (b 2, s 16) batch.
//
// Tolerances: Loom runs in f32, the reference in f64; logits are O(1) after two layers, so f32 round-off
// stays near 1e-6 and the logits must agree within 1e-4 absolute, the mean loss within 1e-5 relative.
// Export and re-import are bitwise: F32 in, F32 out, transposes only move bits.
#include "backend/cpu/cpu_device.h"
#include "data/llmc_shard.h"
#include "model/hf_gpt2.h"

#include "loom_cli_runner.h"

#include <gtest/gtest.h>
#include <nlohmann/json.hpp>

#include <cmath>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <functional>
#include <limits>
#include <regex>
#include <unistd.h>

using namespace loom;
using json = nlohmann::json;
namespace fs = std::filesystem;

namespace {

const std::string kFixture = LOOM_HF_FIXTURE_DIR;

json read_json(const fs::path & path) {
    std::ifstream in(path);
    return json::parse(in);
}

void write_text(const fs::path & path, const std::string & text) {
    std::ofstream out(path, std::ios::binary);
    out << text;
}

std::string read_bytes(const fs::path & path) {
    std::ifstream in(path, std::ios::binary);
    return std::string(std::istreambuf_iterator<char>(in), {});
}

// A fresh folder per test, removed afterwards.
class HfGpt2 : public ::testing::Test {
protected:
    void SetUp() override {
        dir_ = fs::temp_directory_path() /
               ("loom_test_hf_" + std::to_string(::getpid()) + "_" +
                ::testing::UnitTest::GetInstance()->current_test_info()->name());
        fs::remove_all(dir_);
        fs::create_directories(dir_);
    }
    void TearDown() override { fs::remove_all(dir_); }

    // A copy of the fixture's config.json in `sub`, edited by `edit`, with `safetensors` as its weights.
    fs::path checkpoint(const std::string & sub, const std::function<void(json &)> & edit = nullptr) {
        fs::path d = dir_ / sub;
        fs::create_directories(d);
        json config = read_json(fs::path(kFixture) / "config.json");
        if (edit) edit(config);
        write_text(d / "config.json", config.dump(2));
        return d;
    }

    fs::path dir_;
};

struct Expected {
    int64_t              b = 0, s = 0, vocab = 0;
    std::vector<int32_t> stream;           // (b s + 1): sample i is stream[i s, i s + s + 1)
    std::vector<int32_t> tokens, labels;   // (b, s)
    std::vector<double>  logits;           // (b, s, V), V = 300 (unpadded)
    double               loss = 0;         // mean cross-entropy over the 300 real entries
};

Expected expected() {
    json    j = read_json(fs::path(kFixture) / "expected.json");
    Expected e;
    e.b     = j["batch"];
    e.s     = j["seq"];
    e.vocab = j["vocab_size"];
    e.loss  = j["loss"];
    e.stream = j["stream"].get<std::vector<int32_t>>();
    for (const auto & row : j["tokens"]) for (int32_t t : row) e.tokens.push_back(t);
    for (const auto & row : j["labels"]) for (int32_t t : row) e.labels.push_back(t);
    for (const auto & seq : j["logits"]) for (const auto & row : seq) for (double v : row) e.logits.push_back(v);
    return e;
}

model::MicroBatch micro_batch(const Expected & e) {
    Device &          device = cpu::device();
    model::MicroBatch mb;
    mb.tokens    = Tensor::empty({e.b, e.s}, DType::i32, device);
    mb.labels    = Tensor::empty({e.b, e.s}, DType::i32, device);
    mb.loss_mask = Tensor::empty({e.b, e.s}, DType::f32, device);
    std::memcpy(mb.tokens.data_ptr(), e.tokens.data(), e.tokens.size() * sizeof(int32_t));
    std::memcpy(mb.labels.data_ptr(), e.labels.data(), e.labels.size() * sizeof(int32_t));
    for (int64_t i = 0; i < e.b * e.s; ++i) mb.loss_mask.data<float>()[i] = 1.0f;
    return mb;
}

std::unique_ptr<model::GptModel> load_model(const std::string & dir, int64_t divisible_by = 128,
                                            DType dtype = DType::f32) {
    model::GptConfig config             = model::gpt_config_from_hf(dir);
    config.make_vocab_size_divisible_by = divisible_by;
    config.params_dtype                 = dtype;
    auto gpt = std::make_unique<model::GptModel>(config, cpu::device());
    gpt->init();
    model::load_hf_gpt2(*gpt, dir);
    return gpt;
}

std::vector<float> as_f32(const model::Parameter & p) {
    std::vector<float> v(static_cast<size_t>(p.numel()));
    convert(p.data.data_ptr(), p.data.dtype(), v.data(), DType::f32, v.size());
    return v;
}

bool bitwise_equal(const std::vector<float> & a, const std::vector<float> & b) {
    return a.size() == b.size() && (a.empty() || std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0);
}

std::string error_of(const std::function<void()> & f) {
    try {
        f();
    } catch (const Error & e) {
        return e.what();
    }
    return "(no error)";
}

// A safetensors file from a raw header and data bytes, for the malformed cases.
void write_raw_safetensors(const fs::path & path, const std::string & header, const std::string & data) {
    uint64_t    n = header.size();
    std::string bytes(reinterpret_cast<const char *>(&n), 8);
    write_text(path, bytes + header + data);
}

bool is_buffer(const std::string & name) {
    return name.find(".attn.bias") != std::string::npos || name.find(".attn.masked_bias") != std::string::npos;
}

}  // namespace

TEST_F(HfGpt2, FixtureLogitsMatchFloat64ReferenceWithPaddedVocabulary) {
    Expected e   = expected();
    auto     gpt = load_model(kFixture);
    int64_t  Vp  = gpt->config().padded_vocab_size();
    ASSERT_EQ(Vp, 384);
    model::GptModel::Context ctx;
    gpt->forward(ctx, micro_batch(e));

    const float * logits   = ctx.logits.data<float>();   // (s*b, Vp), rows in (s, b) order
    double        max_err  = 0, loss_sum = 0;
    float         max_pad  = 0;
    for (int64_t bi = 0; bi < e.b; ++bi) {
        for (int64_t si = 0; si < e.s; ++si) {
            const float *  row = logits + (si * e.b + bi) * Vp;
            const double * ref = e.logits.data() + (bi * e.s + si) * e.vocab;
            double         mx  = -INFINITY;
            for (int64_t v = 0; v < e.vocab; ++v) {
                max_err = std::max(max_err, std::fabs(row[v] - ref[v]));
                mx      = std::max(mx, static_cast<double>(row[v]));
            }
            for (int64_t v = e.vocab; v < Vp; ++v) max_pad = std::max(max_pad, std::fabs(row[v]));
            double sum = 0;
            for (int64_t v = 0; v < e.vocab; ++v) sum += std::exp(row[v] - mx);
            loss_sum += mx + std::log(sum) - row[e.labels[bi * e.s + si]];
        }
    }
    // The softmax over the 300 real entries of Loom's logits is Hugging Face's loss.
    double loss = loss_sum / static_cast<double>(e.b * e.s);
    std::printf("max |logit - reference| = %.3g, |loss - reference| / reference = %.3g (loss %.10f, reference %.10f)\n",
                max_err, std::fabs(loss - e.loss) / e.loss, loss, e.loss);
    EXPECT_LT(max_err, 1e-4);
    EXPECT_LT(std::fabs(loss - e.loss) / e.loss, 1e-5);
    EXPECT_EQ(max_pad, 0.0f) << "the padded vocabulary rows must be zero";
}

TEST_F(HfGpt2, ForwardLossIsHuggingFacesLossWithAndWithoutPadding) {
    // GptModel's softmax leaves the vocabulary padding out, so padded (300 -> 384) and unpadded models
    // both score Hugging Face's loss.
    Expected e = expected();
    for (int64_t divisible_by : {1, 128}) {
        auto gpt = load_model(kFixture, divisible_by);
        ASSERT_EQ(gpt->config().padded_vocab_size(), divisible_by == 1 ? 300 : 384);
        model::GptModel::Context ctx;
        double loss = gpt->forward(ctx, micro_batch(e)).mean();
        std::printf("padded vocabulary %lld: forward loss %.10f, reference %.10f, relative error %.3g\n",
                    static_cast<long long>(gpt->config().padded_vocab_size()), loss, e.loss,
                    std::fabs(loss - e.loss) / e.loss);
        EXPECT_LT(std::fabs(loss - e.loss) / e.loss, 1e-5);
        // The padding rows of the tied embedding get exactly zero gradient.
        gpt->backward(ctx, 1.0, nullptr);
        cpu::device().compute_stream().synchronize();   // backward is stream work: wait before reading main_grad
        const model::Parameter * wte = gpt->parameters().front();
        const float *            g   = wte->main_grad.data<float>();
        for (int64_t i = 300 * 64; i < wte->numel(); ++i) ASSERT_EQ(g[i], 0.0f) << "padding gradient at " << i;
    }
}

TEST_F(HfGpt2, ConfigJsonGivesTheGpt2Shape) {
    model::GptConfig c = model::gpt_config_from_hf(kFixture);
    EXPECT_EQ(c.num_layers, 2);
    EXPECT_EQ(c.hidden_size, 64);
    EXPECT_EQ(c.num_attention_heads, 4);
    EXPECT_EQ(c.num_query_groups, 4);
    EXPECT_EQ(c.ffn_hidden_size, 256);   // n_inner null -> 4 n_embd
    EXPECT_EQ(c.max_position_embeddings, 32);
    EXPECT_EQ(c.seq_length, 32);
    EXPECT_EQ(c.vocab_size, 300);
    EXPECT_FLOAT_EQ(c.norm_epsilon, 1e-5f);
    EXPECT_EQ(c.normalization, model::Normalization::layernorm);
    EXPECT_FALSE(c.untie_embeddings_and_output_weights);
}

TEST_F(HfGpt2, ExportRoundTripIsBitwise) {
    auto gpt = load_model(kFixture);
    model::export_hf_gpt2(*gpt, (dir_ / "out").string());

    // The safetensors written holds the fixture's tensors (less the mask buffers), bit for bit.
    io::SafetensorsFile original(kFixture + "/model.safetensors");
    io::SafetensorsFile exported((dir_ / "out" / "model.safetensors").string());
    size_t compared = 0;
    for (const io::SafetensorsEntry & t : original.entries()) {
        if (is_buffer(t.name)) continue;
        ASSERT_TRUE(exported.contains(t.name)) << t.name;
        EXPECT_EQ(exported.entry(t.name).dtype, "F32");
        EXPECT_EQ(exported.entry(t.name).shape, t.shape) << t.name;
        EXPECT_TRUE(bitwise_equal(exported.read_f32(t.name), original.read_f32(t.name))) << t.name;
        ++compared;
    }
    EXPECT_EQ(compared, exported.entries().size());
    EXPECT_EQ(compared, 4u + 12u * 2u);

    json config = read_json(dir_ / "out" / "config.json");
    EXPECT_EQ(config["architectures"][0], "GPT2LMHeadModel");
    EXPECT_EQ(config["model_type"], "gpt2");
    EXPECT_EQ(config["activation_function"], "gelu_new");
    EXPECT_EQ(config["vocab_size"], 300);
    EXPECT_EQ(config["n_ctx"], 32);
    EXPECT_EQ(config["layer_norm_epsilon"].get<double>(), 1e-5);

    // Re-imported into a fresh model with other initial values: every parameter bitwise equal.
    model::GptConfig other = model::gpt_config_from_hf((dir_ / "out").string());
    other.seed             = 99;
    model::GptModel again(other, cpu::device());
    again.init();
    model::load_hf_gpt2(again, (dir_ / "out").string());
    auto a = gpt->parameters(), b = again.parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_EQ(a[i]->name, b[i]->name);
        EXPECT_TRUE(bitwise_equal(as_f32(*a[i]), as_f32(*b[i]))) << a[i]->name;
    }
    // No temporary files are left behind.
    size_t files = 0;
    for ([[maybe_unused]] const auto & f : fs::directory_iterator(dir_ / "out")) ++files;
    EXPECT_EQ(files, 2u);
}

TEST_F(HfGpt2, Bf16ParametersLoadRoundedAndExportTheirValues) {
    auto f32  = load_model(kFixture);
    auto bf16 = load_model(kFixture, 128, DType::bf16);
    auto a = f32->parameters(), b = bf16->parameters();
    ASSERT_EQ(a.size(), b.size());
    for (size_t i = 0; i < a.size(); ++i) {
        ASSERT_EQ(b[i]->data.dtype(), DType::bf16);
        std::vector<float> rounded = as_f32(*a[i]);
        for (float & v : rounded) v = bf16_bits_to_f32(f32_to_bf16_bits(v));
        EXPECT_TRUE(bitwise_equal(as_f32(*b[i]), rounded)) << b[i]->name;
    }
    model::export_hf_gpt2(*bf16, (dir_ / "out").string());
    io::SafetensorsFile exported((dir_ / "out" / "model.safetensors").string());
    std::vector<float>     wte = exported.read_f32("wte.weight");
    std::vector<float>     param = as_f32(*b[0]);
    param.resize(wte.size());
    EXPECT_TRUE(bitwise_equal(wte, param));
}

TEST_F(HfGpt2, TransformerPrefixAndTiedLmHeadAreAccepted) {
    io::SafetensorsFile                original(kFixture + "/model.safetensors");
    std::vector<io::SafetensorsTensor> tensors;
    for (const io::SafetensorsEntry & t : original.entries()) {
        if (is_buffer(t.name)) continue;
        tensors.push_back({"transformer." + t.name, t.shape, original.read_f32(t.name)});
    }
    tensors.push_back({"lm_head.weight", original.entry("wte.weight").shape, original.read_f32("wte.weight")});
    fs::path d = checkpoint("prefixed");
    io::write_safetensors((d / "model.safetensors").string(), tensors);

    auto reference = load_model(kFixture);
    auto prefixed  = load_model(d.string());
    auto a = reference->parameters(), b = prefixed->parameters();
    for (size_t i = 0; i < a.size(); ++i) {
        EXPECT_TRUE(bitwise_equal(as_f32(*a[i]), as_f32(*b[i]))) << a[i]->name;
    }
}

TEST_F(HfGpt2, SafetensorsReadsBf16AndF16AsFloat32) {
    // 1.5, -2, 0.099609375 (exact in both) as BF16 and as F16, then an I64 that is listed but not readable.
    const uint16_t bf16[3] = {0x3fc0, 0xc000, 0x3dcc};
    const uint16_t f16[3]  = {0x3e00, 0xc000, 0x2e60};
    const int64_t  i64     = 7;
    std::string    data(reinterpret_cast<const char *>(bf16), 6);
    data += std::string(reinterpret_cast<const char *>(f16), 6);
    data += std::string(reinterpret_cast<const char *>(&i64), 8);
    write_raw_safetensors(dir_ / "m.safetensors",
                          R"({"b":{"dtype":"BF16","shape":[3],"data_offsets":[0,6]},)"
                          R"("h":{"dtype":"F16","shape":[3],"data_offsets":[6,12]},)"
                          R"("i":{"dtype":"I64","shape":[],"data_offsets":[12,20]},"__metadata__":{"format":"pt"}})",
                          data);
    io::SafetensorsFile f((dir_ / "m.safetensors").string());
    EXPECT_EQ(f.metadata().at("format"), "pt");
    EXPECT_EQ(f.read_f32("b"), (std::vector<float>{1.5f, -2.0f, 0.099609375f}));
    EXPECT_EQ(f.read_f32("h"), (std::vector<float>{1.5f, -2.0f, 0.099609375f}));
    std::string msg = error_of([&] { f.read_f32("i"); });
    EXPECT_NE(msg.find("'i'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("I64"), std::string::npos) << msg;
}

TEST_F(HfGpt2, ConfigMismatchNamesTheFlagAndConfigJson) {
    model::GptConfig config = model::gpt_config_from_hf(kFixture);
    config.hidden_size      = 128;
    config.ffn_hidden_size  = 512;
    model::GptModel gpt(config, cpu::device());
    std::string     msg = error_of([&] { model::load_hf_gpt2(gpt, kFixture); });
    EXPECT_NE(msg.find("--hidden-size 128"), std::string::npos) << msg;
    EXPECT_NE(msg.find("n_embd = 64"), std::string::npos) << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;

    config              = model::gpt_config_from_hf(kFixture);
    config.vocab_size   = 256;
    model::GptModel small(config, cpu::device());
    msg = error_of([&] { model::load_hf_gpt2(small, kFixture); });
    EXPECT_NE(msg.find("--vocab-size 256"), std::string::npos) << msg;
}

TEST_F(HfGpt2, NonGpt2ModelsAreRefusedNamingTheFlag) {
    model::GptConfig llama = model::gpt_preset("llama-tiny");
    model::GptModel  gpt(llama, cpu::device());
    std::string      msg = error_of([&] { model::export_hf_gpt2(gpt, (dir_ / "x").string()); });
    EXPECT_NE(msg.find("--normalization RMSNorm"), std::string::npos) << msg;

    model::GptConfig untied                    = model::gpt_config_from_hf(kFixture);
    untied.untie_embeddings_and_output_weights = true;
    model::GptModel u(untied, cpu::device());
    msg = error_of([&] { model::load_hf_gpt2(u, kFixture); });
    EXPECT_NE(msg.find("--untie-embeddings-and-output-weights"), std::string::npos) << msg;

    model::GptConfig swiglu = model::gpt_config_from_hf(kFixture);
    swiglu.swiglu           = true;
    model::GptModel s(swiglu, cpu::device());
    msg = error_of([&] { model::export_hf_gpt2(s, (dir_ / "x").string()); });
    EXPECT_NE(msg.find("--swiglu"), std::string::npos) << msg;
}

TEST_F(HfGpt2, MissingUnexpectedAndMisshapenTensorsAreNamed) {
    io::SafetensorsFile original(kFixture + "/model.safetensors");
    auto with = [&](const std::string & sub, const std::function<void(std::vector<io::SafetensorsTensor> &)> & edit) {
        std::vector<io::SafetensorsTensor> tensors;
        for (const io::SafetensorsEntry & t : original.entries()) {
            tensors.push_back({t.name, t.shape, original.read_f32(t.name)});
        }
        edit(tensors);
        fs::path d = checkpoint(sub);
        io::write_safetensors((d / "model.safetensors").string(), tensors);
        auto gpt = std::make_unique<model::GptModel>(model::gpt_config_from_hf(d.string()), cpu::device());
        return error_of([&] { model::load_hf_gpt2(*gpt, d.string()); });
    };
    std::string msg = with("missing", [](auto & t) {
        std::erase_if(t, [](const io::SafetensorsTensor & x) { return x.name == "h.1.mlp.c_fc.bias"; });
    });
    EXPECT_NE(msg.find("no tensor 'h.1.mlp.c_fc.bias'"), std::string::npos) << msg;
    EXPECT_NE(msg.find("layers.1.mlp.fc1.bias"), std::string::npos) << msg;

    msg = with("unexpected", [](auto & t) { t.push_back({"h.2.ln_1.weight", {64}, std::vector<float>(64, 1.0f)}); });
    EXPECT_NE(msg.find("'h.2.ln_1.weight'"), std::string::npos) << msg;

    msg = with("misshapen", [](auto & t) {
        for (auto & x : t) {
            if (x.name == "h.0.attn.c_proj.weight") x.shape = {32, 128};
        }
    });
    EXPECT_NE(msg.find("'h.0.attn.c_proj.weight' has shape [32, 128], expected [64, 64]"), std::string::npos) << msg;

    // A weight that is not finite is the file's fault, named there, not a NaN loss a step later.
    msg = with("nan", [](auto & t) {
        for (auto & x : t) {
            if (x.name == "h.1.ln_2.bias") x.data[5] = std::numeric_limits<float>::quiet_NaN();
        }
    });
    EXPECT_NE(msg.find("tensor 'h.1.ln_2.bias' holds nan at element 5"), std::string::npos) << msg;
}

TEST_F(HfGpt2, MalformedSafetensorsFilesAreNamed) {
    const std::string bytes = read_bytes(fs::path(kFixture) / "model.safetensors");
    auto error_for = [&](const std::string & name, const std::string & contents) {
        fs::path d = checkpoint(name);
        write_text(d / "model.safetensors", contents);
        return std::make_pair((d / "model.safetensors").string(),
                              error_of([&] { io::SafetensorsFile f((d / "model.safetensors").string()); }));
    };
    auto expect_error = [&](const std::string & name, const std::string & contents, const std::string & needle) {
        auto [path, msg] = error_for(name, contents);
        EXPECT_NE(msg.find(path), std::string::npos) << name << ": " << msg;
        EXPECT_NE(msg.find(needle), std::string::npos) << name << ": " << msg;
        EXPECT_NE(msg.find("HINT"), std::string::npos) << name << ": " << msg;
    };
    expect_error("short", bytes.substr(0, 5), "too short");
    expect_error("truncated", bytes.substr(0, bytes.size() - 100), "'ln_f.bias'");
    expect_error("truncated_header", bytes.substr(0, 200), "header length");
    std::string bad_json = bytes;
    bad_json[8]          = '[';
    bad_json[9]          = '!';
    expect_error("bad_json", bad_json, "bad JSON header");
    expect_error("trailing", bytes + "junk", "trailing bytes");

    auto raw = [&](const std::string & name, const std::string & header, size_t data_bytes, const std::string & needle) {
        std::string contents(8, '\0');
        uint64_t    n = header.size();
        std::memcpy(contents.data(), &n, 8);
        expect_error(name, contents + header + std::string(data_bytes, '\0'), needle);
    };
    raw("overlap",
        R"({"a":{"dtype":"F32","shape":[2],"data_offsets":[0,8]},"b":{"dtype":"F32","shape":[2],"data_offsets":[4,12]}})",
        12, "overlaps tensor 'a'");
    raw("inconsistent", R"({"a":{"dtype":"F32","shape":[3],"data_offsets":[0,8]}})", 8, "tensor 'a'");
    raw("out_of_range", R"({"a":{"dtype":"F32","shape":[4],"data_offsets":[0,16]}})", 8, "beyond the 8 data bytes");
    raw("dtype", R"({"a":{"dtype":"F31","shape":[2],"data_offsets":[0,8]}})", 8, "dtype 'F31'");
    raw("gap",
        R"({"a":{"dtype":"F32","shape":[1],"data_offsets":[0,4]},"b":{"dtype":"F32","shape":[1],"data_offsets":[8,12]}})",
        12, "gap");
    // 100 000 nested arrays once crashed (SIGSEGV) while the error message was built from the parsed header.
    raw("deep", R"({"a":)" + std::string(100000, '[') + std::string(100000, ']') + "}", 0, "nests deeper than 64 levels");
}

TEST_F(HfGpt2, ConfigJsonErrorsNameTheKey) {
    auto error_with = [&](const std::string & name, const std::function<void(json &)> & edit) {
        fs::path d = checkpoint(name, edit);
        return error_of([&] { model::gpt_config_from_hf(d.string()); });
    };
    std::string msg = error_with("relu", [](json & c) { c["activation_function"] = "relu"; });
    EXPECT_NE(msg.find("activation_function \"relu\""), std::string::npos) << msg;
    EXPECT_NE(msg.find("config.json"), std::string::npos) << msg;
    EXPECT_EQ(error_with("tanh", [](json & c) { c["activation_function"] = "gelu_pytorch_tanh"; }), "(no error)");

    msg = error_with("no_layers", [](json & c) { c.erase("n_layer"); });
    EXPECT_NE(msg.find("no n_layer"), std::string::npos) << msg;
    msg = error_with("n_ctx_only", [](json & c) { c.erase("n_positions"); });
    EXPECT_EQ(msg, "(no error)");
    msg = error_with("llama", [](json & c) { c["model_type"] = "llama"; });
    EXPECT_NE(msg.find("model_type"), std::string::npos) << msg;
    msg = error_of([&] { model::gpt_config_from_hf((dir_ / "nowhere").string()); });
    EXPECT_NE(msg.find("nowhere/config.json"), std::string::npos) << msg;
}

// ---------------------------------------------------------------------------------------------------
// The command line

namespace {

double lm_loss(const std::string & out) {
    std::smatch m;
    std::regex  re("lm loss value: ([0-9.E+-]+)");
    return std::regex_search(out, m, re) ? std::stod(m[1]) : NAN;
}

}  // namespace

TEST_F(HfGpt2, CliEvalLoadHfPrintsTheReferenceLoss) {
    // The fixture's 33-token stream as an llm.c shard: its two windows of 17 are the fixture's batch.
    Expected e = expected();
    std::string shard = (dir_ / "stream.bin").string();
    data::write_llmc_shard(shard, e.stream);
    std::string eval = " --llmc-shard " + shard + " --seq-length 16 --micro-batch-size 2 --eval-iters 1";
    CliRun r = run_loom("eval --load-hf " + kFixture + eval);
    ASSERT_EQ(r.status, 0) << r.out;
    double loss = lm_loss(r.out);
    EXPECT_LT(std::fabs(loss - e.loss) / e.loss, 1e-5) << r.out;

    // export-hf of the loaded weights, then eval of the export: the same loss line.
    CliRun x = run_loom("export-hf --load-hf " + kFixture + " --output " + (dir_ / "exported").string());
    ASSERT_EQ(x.status, 0) << x.out;
    CliRun again = run_loom("eval --load-hf " + (dir_ / "exported").string() + eval);
    ASSERT_EQ(again.status, 0) << again.out;
    EXPECT_EQ(lm_loss(again.out), loss) << again.out;

    // Without vocabulary padding: the same loss to the printed precision.
    CliRun unpadded = run_loom("eval --load-hf " + kFixture + eval + " --make-vocab-size-divisible-by 1");
    ASSERT_EQ(unpadded.status, 0) << unpadded.out;
    EXPECT_NEAR(lm_loss(unpadded.out), loss, 1e-5 * loss) << unpadded.out;
}

TEST_F(HfGpt2, CliExportFromSeedThenTrainAndEvalLoadIt) {
    std::string out = (dir_ / "seeded").string();
    CliRun      x   = run_loom("export-hf --num-layers 2 --hidden-size 32 --num-attention-heads 2 --seq-length 16 "
                               "--max-position-embeddings 16 --vocab-size 200 --output " + out);
    ASSERT_EQ(x.status, 0) << x.out;
    json config = read_json(fs::path(out) / "config.json");
    EXPECT_EQ(config["n_embd"], 32);
    EXPECT_EQ(config["n_positions"], 16);
    EXPECT_EQ(config["vocab_size"], 200);
    CliRun eval = run_loom("eval --mock-data --load-hf " + out + " --eval-iters 1 --micro-batch-size 2");
    ASSERT_EQ(eval.status, 0) << eval.out;
    EXPECT_TRUE(std::isfinite(lm_loss(eval.out))) << eval.out;
    CliRun train = run_loom("train --mock-data --load-hf " + out + " --train-iters 2 --lr-warmup-iters 0 --micro-batch-size 2 --log-interval 1");
    ASSERT_EQ(train.status, 0) << train.out;
    EXPECT_NE(train.out.find("training summary"), std::string::npos) << train.out;
}

TEST_F(HfGpt2, CliMismatchExitsTwoNamingTheFlag) {
    CliRun r = run_loom("eval --mock-data --load-hf " + kFixture + " --hidden-size 128 --eval-iters 1", "2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("--hidden-size 128 does not match n_embd = 64"), std::string::npos) << r.out;

    r = run_loom("eval --mock-data --load-hf " + kFixture + " --seq-length 64 --eval-iters 1", "2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("--seq-length 64 exceeds n_positions = 32"), std::string::npos) << r.out;

    r = run_loom("train --mock-data --load-hf " + kFixture + " --swiglu", "2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("--swiglu"), std::string::npos) << r.out;

    r = run_loom("export-hf --model llama-tiny --output " + (dir_ / "llama").string(), "2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("--normalization RMSNorm"), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(dir_ / "llama" / "config.json"));

    r = run_loom("eval --mock-data --load-hf " + (dir_ / "missing").string(), "2>&1 >/dev/null");
    EXPECT_EQ(r.status, 2);
    EXPECT_NE(r.out.find("config.json"), std::string::npos) << r.out;
}
