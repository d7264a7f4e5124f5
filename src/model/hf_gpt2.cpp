#include "model/hf_gpt2.h"

#include "core/atomic_file.h"
#include "core/input_file.h"
#include "core/json_checks.h"

#include "core/error.h"

#include <nlohmann/json.hpp>

#include <algorithm>
#include <cmath>
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

constexpr const char * kConfigHint =
    "pass the folder of a Hugging Face GPT-2 checkpoint (config.json + model.safetensors), or one written by "
    "`loom export-hf`";

// The file a safetensors or config path names inside `dir`.
std::string join(const std::string & dir, const char * name) { return (std::filesystem::path(dir) / name).string(); }

std::string shape_list(const Shape & shape) {
    std::ostringstream os;
    os << "[";
    for (size_t i = 0; i < shape.size(); ++i) os << (i ? ", " : "") << shape[i];
    os << "]";
    return os.str();
}

}  // namespace

// ---------------------------------------------------------------------------------------------------
// config.json

namespace {

json read_config_json(const std::string & dir) {
    std::string   path = join(dir, "config.json");
    const std::string text = read_input_file(path, "--load-hf config");
    try {
        json config = json::parse(text, json_parse_checks<json>("'" + path + "'"));
        LOOM_CHECK(config.is_object(), "'" << path << "' is not a JSON object", kConfigHint);
        return config;
    } catch (const json::exception & e) {
        LOOM_THROW("'" << path << "' is not valid JSON: " << json_error_text(e), kConfigHint);
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
        LOOM_THROW("'" << path << "' has a value of the wrong type: " << json_error_text(e), kConfigHint);
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
    LOOM_CHECK(!c.swiglu, what << "the model has --" << (c.quick_geglu ? "quick-geglu" : "swiglu"), hint);
    LOOM_CHECK(!c.squared_relu, what << "the model has --squared-relu", hint);
    LOOM_CHECK(!c.qk_layernorm, what << "the model has --qk-layernorm", hint);
    LOOM_CHECK(!c.attention_output_gate, what << "the model has --attention-output-gate", hint);
    LOOM_CHECK(!c.gated_delta_net, what << "the model has --experimental-attention-variant gated_delta_net", hint);
    LOOM_CHECK(c.softmax_type == SoftmaxType::vanilla,
               what << "the model has --softmax-type " << (c.softmax_type == SoftmaxType::learnable ? "learnable" : "off-by-one"),
               hint);
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
    LOOM_CHECK(!c.apply_layernorm_1p,
               "a model with --apply-layernorm-1p does not map onto Hugging Face GPT-2: its norms scale by 1 + weight, "
               "GPT-2's by the weight",
               "train without --apply-layernorm-1p to exchange weights with Hugging Face");
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

    io::SafetensorsFile file(join(dir, "model.safetensors"));
    // HF name without the "transformer." prefix -> name in the file.
    std::map<std::string, std::string> names;
    const std::string                  prefix = "transformer.";
    for (const io::SafetensorsEntry & e : file.entries()) {
        std::string key = e.name.rfind(prefix, 0) == 0 ? e.name.substr(prefix.size()) : e.name;
        if (skipped_tensor(key)) continue;
        LOOM_CHECK(names.emplace(key, e.name).second,
                   "safetensors file '" << file.path() << "' holds '" << key << "' twice (with and without the '" << prefix
                                        << "' prefix)",
                   "give a Hugging Face model.safetensors, or one written by `loom export-hf`");
    }

    std::vector<Mapping> mapping = gpt2_mapping(model, checkpoint.vocab_size);
    for (const Mapping & m : mapping) {
        auto it = names.find(m.hf_name);
        LOOM_CHECK(it != names.end(),
                   "safetensors file '" << file.path() << "' has no tensor '" << m.hf_name << "' (for Loom's '"
                                        << m.param->name << "')",
                   "the checkpoint is incomplete or is not a GPT-2 with config.json's n_layer = " << config.num_layers);
        const io::SafetensorsEntry & e = file.entry(it->second);
        LOOM_CHECK(e.shape == m.hf_shape,
                   "safetensors file '" << file.path() << "': tensor '" << e.name << "' has shape " << shape_list(e.shape)
                                        << ", expected " << shape_list(m.hf_shape) << " from '" << join(dir, "config.json") << "'",
                   "config.json and model.safetensors describe different models");
        std::vector<float> values = file.read_f32(e.name);
        // A weight that is not finite would surface a step later as a NaN loss, blamed on the learning rate.
        const auto bad = std::find_if(values.begin(), values.end(), [](float x) { return !std::isfinite(x); });
        LOOM_CHECK(bad == values.end(), "safetensors file '" << file.path() << "': tensor '" << e.name << "' holds " << *bad
                                                             << " at element " << (bad - values.begin()),
                   "the file is damaged; download or export it again");
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

    std::vector<io::SafetensorsTensor> tensors;
    for (const Mapping & m : gpt2_mapping(model, c.vocab_size)) {
        std::vector<float> values = values_f32(m.param->data);
        if (m.transpose) {
            values = transposed(values, m.hf_shape[1], m.hf_shape[0]);
        } else {
            values.resize(static_cast<size_t>(shape_numel(m.hf_shape)));   // the vocabulary cut: padding dropped
        }
        tensors.push_back({m.hf_name, m.hf_shape, std::move(values)});
    }
    io::write_safetensors(join(dir, "model.safetensors"), tensors, {{"format", "pt"}});

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
