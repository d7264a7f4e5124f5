#include "model/hf_gpt2.h"

#include "core/atomic_file.h"
#include "core/input_file.h"
#include "core/json_depth.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cerrno>
#include <charconv>
#include <cstring>
#include <filesystem>
#include <fstream>
#include <sstream>
#include <sys/stat.h>
#include <unistd.h>

namespace loom::model {

namespace {

using json = nlohmann::json;

constexpr uint64_t kMaxHeaderBytes = uint64_t{100} << 20;   // the safetensors crate's limit

constexpr const char * kSafetensorsHint =
    "pass a folder with a Hugging Face model.safetensors (e.g. `huggingface-cli download gpt2 config.json "
    "model.safetensors --local-dir DIR`) or one written by `loom export-hf`; download it again if it was truncated";

constexpr const char * kConfigHint =
    "pass the folder of a Hugging Face GPT-2 checkpoint (config.json + model.safetensors), or one written by "
    "`loom export-hf`";

// The file a safetensors or config path names inside `dir`.
std::string join(const std::string & dir, const char * name) { return (std::filesystem::path(dir) / name).string(); }

// ---------------------------------------------------------------------------------------------------
// Writing files atomically: <path>.tmp.<pid>, flushed to disk, then renamed over <path>.



std::string shape_list(const Shape & shape) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    os << "]";
    return os.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// safetensors

size_t safetensors_dtype_size(const std::string & dtype) {
    if (dtype == "F64" || dtype == "I64" || dtype == "U64") return 8;
    if (dtype == "F32" || dtype == "I32" || dtype == "U32") return 4;
    if (dtype == "BF16" || dtype == "F16" || dtype == "I16" || dtype == "U16") return 2;
    if (dtype == "I8" || dtype == "U8" || dtype == "BOOL" || dtype == "F8_E4M3" || dtype == "F8_E5M2") return 1;
    return 0;
}

SafetensorsFile::SafetensorsFile(const std::string & path) : path_(path) {
    file_ = open_input_file(path, "safetensors file");
    struct stat st {};
    LOOM_CHECK(::fstat(::fileno(file_.get()), &st) == 0,
               "cannot stat safetensors file '" << path << "': " << std::strerror(errno), kSafetensorsHint);
    const uint64_t size = static_cast<uint64_t>(st.st_size);
    LOOM_CHECK(size >= 8, "safetensors file '" << path << "' is too short: " << size
                                               << " bytes, fewer than the 8-byte header length",
               kSafetensorsHint);
    uint64_t header_bytes = 0;
    LOOM_CHECK(std::fread(&header_bytes, 8, 1, file_.get()) == 1, "cannot read safetensors file '" << path << "'", kSafetensorsHint);
    LOOM_CHECK(header_bytes <= size - 8,
               "safetensors file '" << path << "' is truncated or corrupt: its header length is " << header_bytes
                                    << " bytes, beyond the " << size - 8 << " bytes after the length field",
               kSafetensorsHint);
    LOOM_CHECK(header_bytes <= kMaxHeaderBytes,
               "safetensors file '" << path << "' has a header of " << header_bytes << " bytes, more than the "
                                    << kMaxHeaderBytes << " the format allows",
               kSafetensorsHint);
    std::string text(header_bytes, '\0');
    LOOM_CHECK(header_bytes == 0 || std::fread(text.data(), 1, header_bytes, file_.get()) == header_bytes,
               "cannot read the header of safetensors file '" << path << "'", kSafetensorsHint);
    data_start_ = 8 + header_bytes;
    const uint64_t data_bytes = size - data_start_;

    json header;
    try {
        header = json::parse(text, json_depth_limit<json>("safetensors file '" + path + "' header"));
    } catch (const json::exception & e) {
        LOOM_THROW("safetensors file '" << path << "' has a bad JSON header (" << header_bytes
                                        << " bytes after the length): " << e.what(),
                   kSafetensorsHint);
    }
    LOOM_CHECK(header.is_object(), "safetensors file '" << path << "' has a JSON header that is not an object",
               kSafetensorsHint);

    for (const auto & [name, value] : header.items()) {
        if (name == "__metadata__") {
            LOOM_CHECK(value.is_object(), "safetensors file '" << path << "': __metadata__ is not an object", kSafetensorsHint);
            for (const auto & [key, v] : value.items()) {
                LOOM_CHECK(v.is_string(), "safetensors file '" << path << "': __metadata__." << key << " is not a string",
                           kSafetensorsHint);
                metadata_[key] = v.get<std::string>();
            }
            continue;
        }
        auto bad = [&, &name = name](const std::string & what) {   // (clang 14 cannot capture a binding implicitly)
            LOOM_THROW("safetensors file '" << path << "': tensor '" << name << "' " << what, kSafetensorsHint);
        };
        if (!value.is_object() || !value.contains("dtype") || !value.contains("shape") || !value.contains("data_offsets")) {
            bad("needs an object with dtype, shape and data_offsets, got " + value.dump());
        }
        SafetensorsEntry e;
        e.name = name;
        if (!value["dtype"].is_string()) bad("has a dtype that is not a string");
        e.dtype     = value["dtype"].get<std::string>();
        size_t item = safetensors_dtype_size(e.dtype);
        if (item == 0) bad("has dtype '" + e.dtype + "', which is not a safetensors dtype");
        const json & shape = value["shape"];
        if (!shape.is_array()) bad("has a shape that is not an array");
        uint64_t numel = 1;
        for (const json & dim : shape) {
            if (!dim.is_number_unsigned()) bad("has shape " + shape.dump() + " with a size that is not a non-negative integer");
            uint64_t d = dim.get<uint64_t>();
            if (__builtin_mul_overflow(numel, d, &numel)) bad("has shape " + shape.dump() + " too large to address");
            e.shape.push_back(static_cast<int64_t>(d));
        }
        const json & offsets = value["data_offsets"];
        if (!offsets.is_array() || offsets.size() != 2 || !offsets[0].is_number_unsigned() || !offsets[1].is_number_unsigned()) {
            bad("has data_offsets " + offsets.dump() + ", expected [begin, end] of non-negative integers");
        }
        e.begin = offsets[0].get<uint64_t>();
        e.end   = offsets[1].get<uint64_t>();
        uint64_t bytes = 0;
        if (e.end < e.begin) bad("has data_offsets " + offsets.dump() + " that end before they begin");
        if (__builtin_mul_overflow(numel, static_cast<uint64_t>(item), &bytes) || e.end - e.begin != bytes) {
            bad("has data_offsets " + offsets.dump() + " spanning " + std::to_string(e.end - e.begin) + " bytes, but shape " +
                shape.dump() + " of " + e.dtype + " needs " + std::to_string(numel) + " x " + std::to_string(item) + " bytes");
        }
        entries_.push_back(std::move(e));
    }

    // The tensors must tile the data exactly, as the safetensors crate requires.
    std::sort(entries_.begin(), entries_.end(), [](const SafetensorsEntry & a, const SafetensorsEntry & b) {
        return a.begin != b.begin ? a.begin < b.begin : a.end < b.end;
    });
    uint64_t expected = 0;
    for (size_t i = 0; i < entries_.size(); ++i) {
        const SafetensorsEntry & e = entries_[i];
        LOOM_CHECK(e.begin >= expected,
                   "safetensors file '" << path << "': tensor '" << e.name << "' at bytes [" << e.begin << ", " << e.end
                                        << ") overlaps tensor '" << entries_[i - 1].name << "' ending at " << expected,
                   kSafetensorsHint);
        LOOM_CHECK(e.begin == expected,
                   "safetensors file '" << path << "': tensor '" << e.name << "' begins at byte " << e.begin
                                        << ", leaving a gap after byte " << expected,
                   kSafetensorsHint);
        LOOM_CHECK(e.end <= data_bytes,
                   "safetensors file '" << path << "' is truncated: tensor '" << e.name << "' at bytes [" << e.begin
                                        << ", " << e.end << ") ends beyond the " << data_bytes << " data bytes of the file",
                   kSafetensorsHint);
        expected = e.end;
        index_[e.name] = i;
    }
    LOOM_CHECK(expected == data_bytes,
               "safetensors file '" << path << "' has " << data_bytes << " data bytes, but its tensors cover "
                                    << expected << (expected < data_bytes ? " (trailing bytes)" : ""),
               kSafetensorsHint);
}

bool SafetensorsFile::contains(const std::string & name) const { return index_.count(name) > 0; }

const SafetensorsEntry & SafetensorsFile::entry(const std::string & name) const {
    auto it = index_.find(name);
    LOOM_CHECK(it != index_.end(), "safetensors file '" << path_ << "' has no tensor '" << name << "'", kSafetensorsHint);
    return entries_[it->second];
}

std::vector<float> SafetensorsFile::read_f32(const std::string & name) const {
    std::vector<float> out(static_cast<size_t>(shape_numel(entry(name).shape)));
    read_f32(name, out.data());
    return out;
}

void SafetensorsFile::read_f32(const std::string & name, float * out) const {
    const SafetensorsEntry & e = entry(name);
    DType dtype = DType::f32;
    if (e.dtype == "BF16") dtype = DType::bf16;
    else if (e.dtype == "F16") dtype = DType::f16;
    else LOOM_CHECK(e.dtype == "F32", "safetensors file '" << path_ << "': tensor '" << name << "' has dtype " << e.dtype
                                                           << ", not a floating type Loom reads (F32, BF16, F16)",
                    "convert the checkpoint to float32 or bfloat16");
    const size_t         n     = static_cast<size_t>(shape_numel(e.shape));
    const size_t         bytes = e.end - e.begin;
    std::vector<uint8_t> raw(dtype == DType::f32 ? 0 : bytes);
    void *               dst = dtype == DType::f32 ? static_cast<void *>(out) : raw.data();
    bool ok = ::fseeko(file_.get(), static_cast<off_t>(data_start_ + e.begin), SEEK_SET) == 0 &&
              (bytes == 0 || std::fread(dst, 1, bytes, file_.get()) == bytes);
    LOOM_CHECK(ok, "cannot read tensor '" << name << "' from safetensors file '" << path_ << "'", kSafetensorsHint);
    if (n != 0 && dtype != DType::f32) convert(raw.data(), dtype, out, DType::f32, n);
}

void write_safetensors(const std::string & path, const std::vector<SafetensorsTensor> & tensors,
                       const std::map<std::string, std::string> & metadata) {
    json     header = json::object();
    uint64_t offset = 0;
    for (const SafetensorsTensor & t : tensors) {
        LOOM_CHECK(static_cast<int64_t>(t.data.size()) == shape_numel(t.shape),
                   "tensor '" << t.name << "' for '" << path << "' has " << t.data.size() << " elements, its shape "
                              << shape_string(t.shape) << " needs " << shape_numel(t.shape),
                   "");
        LOOM_CHECK(!header.contains(t.name) && t.name != "__metadata__", "tensor '" << t.name << "' written twice to '" << path << "'", "");
        uint64_t bytes = t.data.size() * sizeof(float);
        header[t.name] = {{"dtype", "F32"}, {"shape", t.shape}, {"data_offsets", {offset, offset + bytes}}};
        offset += bytes;
    }
    if (!metadata.empty()) header["__metadata__"] = metadata;
    std::string text = header.dump();
    text.append((8 - text.size() % 8) % 8, ' ');   // the data starts 8-byte aligned, as the crate writes it
    uint64_t length = text.size();

    AtomicFile file(path);
    file.write(&length, 8);
    file.write(text.data(), text.size());
    for (const SafetensorsTensor & t : tensors) file.write(t.data.data(), t.data.size() * sizeof(float));
    file.commit();
}

// ---------------------------------------------------------------------------------------------------
// config.json

namespace {

json read_config_json(const std::string & dir) {
    std::string   path = join(dir, "config.json");
    const std::string text = read_input_file(path, "--load-hf config");
    try {
        json config = json::parse(text, json_depth_limit<json>("'" + path + "'"));
        LOOM_CHECK(config.is_object(), "'" << path << "' is not a JSON object", kConfigHint);
        return config;
    } catch (const json::exception & e) {
        LOOM_THROW("'" << path << "' is not valid JSON: " << e.what(), kConfigHint);
    }
}

// Shortest decimal of a float, as a double: 1e-5f is written as 1e-05, not 9.99999974737875e-06.
double float_as_decimal(float value) {
    char buffer[32];
    auto result = std::to_chars(buffer, buffer + sizeof(buffer), value);
    return std::strtod(std::string(buffer, result.ptr).c_str(), nullptr);
}

}  // namespace

namespace {

GptConfig config_from_json(const std::string & path, const json & config);

}  // namespace

GptConfig gpt_config_from_hf(const std::string & dir) {
    const std::string path   = join(dir, "config.json");
    const json        config = read_config_json(dir);
    try {
        return config_from_json(path, config);
    } catch (const json::exception & e) {   // a key of the wrong type (n_layer "twelve", scale_attn_weights "yes")
        LOOM_THROW("'" << path << "' has a value of the wrong type: " << e.what(), kConfigHint);
    }
}

namespace {

GptConfig config_from_json(const std::string & path, const json & config) {
    // A positive integer under `key`, else under `fallback` (n_positions, else n_ctx).
    auto integer = [&](const char * key, const char * fallback = nullptr) -> int64_t {
        const char * used = fallback != nullptr && !config.contains(key) ? fallback : key;
        LOOM_CHECK(config.contains(used), "'" << path << "' has no " << key
                                              << (fallback != nullptr ? std::string(" (nor ") + fallback + ")" : ""),
                   kConfigHint);
        const json & v = config[used];
        LOOM_CHECK(v.is_number_integer() && v.get<int64_t>() >= 1,
                   "'" << path << "': " << used << " = " << v.dump() << " is not a positive integer", kConfigHint);
        return v.get<int64_t>();
    };
    if (config.contains("model_type")) {
        LOOM_CHECK(config["model_type"] == "gpt2",
                   "'" << path << "': model_type " << config["model_type"].dump() << " is not \"gpt2\"",
                   "only GPT-2 checkpoints (GPT2LMHeadModel) can be imported");
    }
    std::string activation = config.value("activation_function", std::string("gelu_new"));
    LOOM_CHECK(activation == "gelu_new" || activation == "gelu_pytorch_tanh",
               "'" << path << "': activation_function \"" << activation << "\" is not supported",
               "Loom's GELU is the tanh approximation: activation_function must be gelu_new or gelu_pytorch_tanh");
    LOOM_CHECK(config.value("scale_attn_weights", true),
               "'" << path << "': scale_attn_weights false is not supported", "Loom scales attention by 1 / sqrt(d)");
    LOOM_CHECK(!config.value("scale_attn_by_inverse_layer_idx", false),
               "'" << path << "': scale_attn_by_inverse_layer_idx true is not supported", "Loom scales attention by 1 / sqrt(d)");
    LOOM_CHECK(!config.value("add_cross_attention", false),
               "'" << path << "': add_cross_attention true is not supported", "only decoder-only GPT-2 can be imported");

    GptConfig c;
    c.num_layers              = integer("n_layer");
    c.hidden_size             = integer("n_embd");
    c.num_attention_heads     = integer("n_head");
    c.num_query_groups        = c.num_attention_heads;
    c.max_position_embeddings = integer("n_positions", "n_ctx");
    c.seq_length              = c.max_position_embeddings;
    c.vocab_size              = integer("vocab_size");
    c.ffn_hidden_size         = config.contains("n_inner") && !config["n_inner"].is_null() ? integer("n_inner")
                                                                                            : 4 * c.hidden_size;
    if (config.contains("layer_norm_epsilon")) {
        LOOM_CHECK(config["layer_norm_epsilon"].is_number() && config["layer_norm_epsilon"].get<double>() > 0,
                   "'" << path << "': layer_norm_epsilon " << config["layer_norm_epsilon"].dump() << " is not a positive number",
                   kConfigHint);
        c.norm_epsilon = static_cast<float>(config["layer_norm_epsilon"].get<double>());
    }
    if (config.contains("initializer_range") && config["initializer_range"].is_number()) {
        c.init_method_std = static_cast<float>(config["initializer_range"].get<double>());
    }
    c.normalization                       = Normalization::layernorm;
    c.swiglu                              = false;
    c.position_embedding                  = PositionEmbedding::learned_absolute;
    c.add_bias_linear                     = true;
    c.untie_embeddings_and_output_weights = false;
    LOOM_CHECK(c.hidden_size % c.num_attention_heads == 0,
               "'" << path << "': n_embd " << c.hidden_size << " is not divisible by n_head " << c.num_attention_heads,
               kConfigHint);
    return c;
}

}  // namespace

void check_gpt2_architecture(const GptConfig & c, const std::string & action) {
    const std::string what = "cannot " + action + " Hugging Face GPT-2 weights: ";
    const char *      hint = "GPT-2 is LayerNorm, GELU, learned positions, biases and a tied output layer; drop the flag";
    LOOM_CHECK(c.normalization == Normalization::layernorm, what << "the model has --normalization RMSNorm", hint);
    LOOM_CHECK(!c.swiglu, what << "the model has --swiglu", hint);
    LOOM_CHECK(!c.qk_layernorm, what << "the model has --qk-layernorm", hint);
    LOOM_CHECK(!c.moe.enabled(), what << "the model has --num-experts " << c.moe.num_experts << " (GPT-2 has no experts)", hint);
    LOOM_CHECK(c.position_embedding == PositionEmbedding::learned_absolute,
               what << "the model has --position-embedding-type "
                    << (c.position_embedding == PositionEmbedding::rope ? "rope" : "none"),
               hint);
    LOOM_CHECK(c.add_bias_linear, what << "the model has --disable-bias-linear", hint);
    LOOM_CHECK(!c.untie_embeddings_and_output_weights, what << "the model has --untie-embeddings-and-output-weights", hint);
    LOOM_CHECK(c.num_query_groups == c.num_attention_heads,
               what << "the model has --group-query-attention (--num-query-groups " << c.num_query_groups << ")", hint);
}

void check_hf_gpt2_compatible(const GptConfig & checkpoint, const GptConfig & model, const std::string & dir) {
    const std::string path = join(dir, "config.json");
    const char *      hint = "drop the flag (or --model) to take the shape from config.json, or point --load-hf at a matching checkpoint";
    auto same = [&](int64_t model_value, int64_t hf_value, const char * flag, const char * key) {
        LOOM_CHECK(model_value == hf_value, flag << " " << model_value << " does not match " << key << " = " << hf_value
                                                 << " in '" << path << "'",
                   hint);
    };
    same(model.num_layers, checkpoint.num_layers, "--num-layers", "n_layer");
    same(model.hidden_size, checkpoint.hidden_size, "--hidden-size", "n_embd");
    same(model.num_attention_heads, checkpoint.num_attention_heads, "--num-attention-heads", "n_head");
    same(model.ffn_hidden_size, checkpoint.ffn_hidden_size, "--ffn-hidden-size", "n_inner (null: 4 x n_embd)");
    same(model.max_position_embeddings, checkpoint.max_position_embeddings, "--max-position-embeddings", "n_positions");
    LOOM_CHECK(model.vocab_size >= checkpoint.vocab_size,
               "--vocab-size " << model.vocab_size << " is smaller than vocab_size = " << checkpoint.vocab_size << " in '"
                               << path << "'",
               "the model must hold every token of the checkpoint; drop --vocab-size");
    LOOM_CHECK(model.norm_epsilon == checkpoint.norm_epsilon,
               "the model's norm epsilon " << model.norm_epsilon << " does not match layer_norm_epsilon = "
                                           << checkpoint.norm_epsilon << " in '" << path << "'",
               "build the model from config.json (gpt_config_from_hf, or --load-hf on the command line)");
}

// ---------------------------------------------------------------------------------------------------
// The mapping

namespace {

// One Loom parameter and the HF tensor it corresponds to.
struct Mapping {
    std::string hf_name;     // without prefix
    Parameter * param;
    Shape       hf_shape;
    bool        transpose;   // Conv1D (in, out) <-> Linear (out, in)
};

std::vector<Mapping> gpt2_mapping(GptModel & model, int64_t hf_vocab) {
    std::map<std::string, Parameter *> params;
    for (Parameter * p : model.parameters()) params[p->name] = p;
    const GptConfig & c = model.config();
    const int64_t     h = c.hidden_size, f = c.ffn_hidden_size;
    std::vector<Mapping> out;
    auto add = [&](const std::string & hf, const std::string & loom, Shape shape, bool transpose) {
        auto it = params.find(loom);
        LOOM_CHECK(it != params.end(), "the model has no parameter '" << loom << "' for Hugging Face tensor '" << hf << "'",
                   "only GPT-2-shaped models map onto Hugging Face GPT-2");
        out.push_back({hf, it->second, shape, transpose});
        params.erase(it);
    };
    add("wte.weight", "embedding.word_embeddings.weight", {hf_vocab, h}, false);
    add("wpe.weight", "embedding.position_embeddings.weight", {c.max_position_embeddings, h}, false);
    for (int64_t i = 0; i < c.num_layers; ++i) {
        std::string hf = "h." + std::to_string(i) + ".", lm = "layers." + std::to_string(i) + ".";
        add(hf + "ln_1.weight", lm + "norm1.weight", {h}, false);
        add(hf + "ln_1.bias", lm + "norm1.bias", {h}, false);
        add(hf + "attn.c_attn.weight", lm + "attention.qkv.weight", {h, 3 * h}, true);
        add(hf + "attn.c_attn.bias", lm + "attention.qkv.bias", {3 * h}, false);
        add(hf + "attn.c_proj.weight", lm + "attention.proj.weight", {h, h}, true);
        add(hf + "attn.c_proj.bias", lm + "attention.proj.bias", {h}, false);
        add(hf + "ln_2.weight", lm + "norm2.weight", {h}, false);
        add(hf + "ln_2.bias", lm + "norm2.bias", {h}, false);
        add(hf + "mlp.c_fc.weight", lm + "mlp.fc1.weight", {h, f}, true);
        add(hf + "mlp.c_fc.bias", lm + "mlp.fc1.bias", {f}, false);
        add(hf + "mlp.c_proj.weight", lm + "mlp.fc2.weight", {f, h}, true);
        add(hf + "mlp.c_proj.bias", lm + "mlp.fc2.bias", {h}, false);
    }
    add("ln_f.weight", "final_norm.weight", {h}, false);
    add("ln_f.bias", "final_norm.bias", {h}, false);
    LOOM_CHECK(params.empty(), "the model's parameter '" << params.begin()->first << "' has no Hugging Face GPT-2 tensor",
               "only GPT-2-shaped models map onto Hugging Face GPT-2");
    return out;
}

// The causal-mask buffers and the tied LM head: present in HF files, not parameters.
bool skipped_tensor(const std::string & name) {
    auto ends_with = [&](const std::string & suffix) {
        return name.size() >= suffix.size() && name.compare(name.size() - suffix.size(), suffix.size(), suffix) == 0;
    };
    return name == "lm_head.weight" || ends_with(".attn.bias") || ends_with(".attn.masked_bias");
}

// (rows, cols) row-major -> (cols, rows).
std::vector<float> transposed(const std::vector<float> & a, int64_t rows, int64_t cols) {
    std::vector<float> t(a.size());
    for (int64_t r = 0; r < rows; ++r) {
        for (int64_t c = 0; c < cols; ++c) t[c * rows + r] = a[r * cols + c];
    }
    return t;
}

}  // namespace

void load_hf_gpt2(GptModel & model, const std::string & dir) {
    const GptConfig & config = model.config();
    check_gpt2_architecture(config, "import");
    GptConfig checkpoint = gpt_config_from_hf(dir);
    check_hf_gpt2_compatible(checkpoint, config, dir);

    SafetensorsFile file(join(dir, "model.safetensors"));
    // HF name without the "transformer." prefix -> name in the file.
    std::map<std::string, std::string> names;
    const std::string                  prefix = "transformer.";
    for (const SafetensorsEntry & e : file.entries()) {
        std::string key = e.name.rfind(prefix, 0) == 0 ? e.name.substr(prefix.size()) : e.name;
        if (skipped_tensor(key)) continue;
        LOOM_CHECK(names.emplace(key, e.name).second,
                   "safetensors file '" << file.path() << "' holds '" << key << "' twice (with and without the '" << prefix
                                        << "' prefix)",
                   kSafetensorsHint);
    }

    std::vector<Mapping> mapping = gpt2_mapping(model, checkpoint.vocab_size);
    for (const Mapping & m : mapping) {
        auto it = names.find(m.hf_name);
        LOOM_CHECK(it != names.end(),
                   "safetensors file '" << file.path() << "' has no tensor '" << m.hf_name << "' (for Loom's '"
                                        << m.param->name << "')",
                   "the checkpoint is incomplete or is not a GPT-2 with config.json's n_layer = " << config.num_layers);
        const SafetensorsEntry & e = file.entry(it->second);
        LOOM_CHECK(e.shape == m.hf_shape,
                   "safetensors file '" << file.path() << "': tensor '" << e.name << "' has shape " << shape_list(e.shape)
                                        << ", expected " << shape_list(m.hf_shape) << " from '" << join(dir, "config.json") << "'",
                   "config.json and model.safetensors describe different models");
        std::vector<float> values = file.read_f32(e.name);
        if (m.transpose) values = transposed(values, m.hf_shape[0], m.hf_shape[1]);
        // The word embedding: rows beyond the checkpoint's vocabulary (padding, or a larger --vocab-size) are zero.
        values.resize(static_cast<size_t>(m.param->numel()), 0.0f);
        write_values_f32(m.param->data, values);
        names.erase(it);
    }
    LOOM_CHECK(names.empty(), "safetensors file '" << file.path() << "' has tensor '" << names.begin()->second
                                                   << "', which no parameter of a GPT-2 with n_layer = "
                                                   << config.num_layers << " uses",
               "config.json and model.safetensors describe different models, or the checkpoint is not GPT-2");
}

void export_hf_gpt2(GptModel & model, const std::string & dir) {
    const GptConfig & c = model.config();
    check_gpt2_architecture(c, "export");
    std::error_code ec;
    std::filesystem::create_directories(dir, ec);
    LOOM_CHECK(!ec, "cannot create folder '" << dir << "': " << ec.message(), "check the path given to --output");

    std::vector<SafetensorsTensor> tensors;
    for (const Mapping & m : gpt2_mapping(model, c.vocab_size)) {
        std::vector<float> values = values_f32(m.param->data);
        if (m.transpose) {
            values = transposed(values, m.hf_shape[1], m.hf_shape[0]);
        } else {
            values.resize(static_cast<size_t>(shape_numel(m.hf_shape)));   // the vocabulary cut: padding dropped
        }
        tensors.push_back({m.hf_name, m.hf_shape, std::move(values)});
    }
    write_safetensors(join(dir, "model.safetensors"), tensors, {{"format", "pt"}});

    json config = {
        {"architectures", {"GPT2LMHeadModel"}},
        {"model_type", "gpt2"},
        {"activation_function", "gelu_new"},
        {"n_layer", c.num_layers},
        {"n_embd", c.hidden_size},
        {"n_head", c.num_attention_heads},
        {"n_inner", c.ffn_hidden_size},
        {"n_positions", c.max_position_embeddings},
        {"n_ctx", c.max_position_embeddings},
        {"vocab_size", c.vocab_size},
        {"layer_norm_epsilon", float_as_decimal(c.norm_epsilon)},
        {"initializer_range", float_as_decimal(c.init_method_std)},
        {"tie_word_embeddings", true},
        {"torch_dtype", "float32"},
    };
    std::string text = config.dump(2) + "\n";
    AtomicFile  file(join(dir, "config.json"));
    file.write(text.data(), text.size());
    file.commit();
}

}  // namespace loom::model
