#include "train/checkpointing.h"
#include "train/options_parser.h"

#include "comm/agreement.h"
#include "core/error.h"

#include <chrono>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <set>
#include <cstdio>
#include <map>
#include <sstream>

namespace loom::train {

using json = nlohmann::json;

namespace {

// Delayed FP8's histories and scales (GptModel::buffers): a checkpoint saved without that recipe lacks them,
// and a run that loads it starts them afresh, as a new run would.
bool is_fp8_state(const std::string & name) { return name.find(".fp8_") != std::string::npos; }

// The args a checkpoint written before Loom had them lacks, each with the value that model had: a dense
// model's MoE args, RoPE over whole heads in halves.
const std::map<std::string, json> & later_args() {
    static const std::map<std::string, json> defaults = {{"moe_layer_freq", 1},       {"moe_grouped_gemm", false},
                                                         {"rotary_percent", 1.0},     {"rotary_interleaved", false},
                                                         {"apply_layernorm_1p", false}, {"squared_relu", false},
                                                         {"multi_latent_attention", false}, {"q_lora_rank", nullptr},
                                                         {"kv_lora_rank", nullptr},   {"qk_head_dim", nullptr},
                                                         {"qk_pos_emb_head_dim", nullptr}, {"v_head_dim", nullptr},
                                                         {"mtp_num_layers", nullptr}, {"quick_geglu", false},
                                                         {"glu_linear_offset", 0.0},
                                                         {"activation_func_clamp_value", nullptr},
                                                         {"window_size", nullptr}, {"window_attn_skip_freq", nullptr},
                                                         {"softmax_type", "vanilla"}, {"moe_shared_expert_gate", false},
                                                         {"attention_output_gate", false},
                                                         {"experimental_attention_variant", nullptr},
                                                         {"linear_attention_freq", nullptr},
                                                         {"linear_conv_kernel_dim", nullptr},
                                                         {"linear_key_head_dim", nullptr},
                                                         {"linear_value_head_dim", nullptr},
                                                         {"linear_num_key_heads", nullptr},
                                                         {"linear_num_value_heads", nullptr},
                                                         {"dsa_indexer_n_heads", nullptr},
                                                         {"dsa_indexer_head_dim", nullptr},
                                                         {"dsa_indexer_topk_freq", nullptr},
                                                         {"dsa_indexer_skip_topk_offset", nullptr}};
    return defaults;
}

json saved_or_dense(const json & saved, const char * key) {
    if (saved.contains(key)) return saved[key];
    auto it = later_args().find(key);
    return it != later_args().end() ? it->second : json(nullptr);
}

bool is_moe_arg(const char * key) { return std::string(key).rfind("moe_", 0) == 0 || std::string(key) == "num_experts"; }
bool is_later_arg(const char * key) { return is_moe_arg(key) || later_args().count(key) > 0; }

const json & saved_args(const checkpoint::Index & index) {
    LOOM_CHECK(index.metadata.is_object() && index.metadata.contains("args") && index.metadata["args"].is_object(),
               "checkpoint index '" << index.path() << "' has no args", "it was not written by `loom train --save`");
    return index.metadata["args"];
}

checkpoint::RankContents rank_contents(const TrainOptions & options, Setup & setup) {
    checkpoint::RankContents rank;
    rank.params    = setup.parameters();
    rank.optimizer = setup.optimizer.get();
    rank.world     = setup.all_ranks();
    // Without ZeRO-1 every data-parallel rank holds the same state: the first one writes it. With several
    // distributed-optimizer instances each holds the same shards: the first instance writes them.
    const bool first_instance = !setup.groups.inter_dp || setup.groups.inter_dp->rank() == 0;
    const auto & grads = setup.gradient_group();   // the data-parallel ranks (with context parallelism, x CP)
    rank.writes = options.ddp.use_distributed_optimizer ? first_instance : !grads || grads->rank() == 0;
    // Experts: the EP ranks hold different experts, the expert-data-parallel ranks the same ones.
    const auto & edp            = setup.groups.expert_dp ? setup.groups.expert_dp : grads;
    const bool   first_expert   = !setup.groups.inter_expert_dp || setup.groups.inter_expert_dp->rank() == 0;
    rank.writes_experts = options.ddp.use_distributed_optimizer ? first_expert : !edp || edp->rank() == 0;
    // Buffers (the routers' expert biases, delayed FP8's state) are the same on every TP x DP x CP rank of a stage.
    for (model::GptModel * chunk : setup.chunks) {
        for (auto & [name, tensor] : chunk->buffers()) rank.buffers.push_back({name, tensor, is_fp8_state(name)});
    }
    rank.writes_buffers = !setup.groups.tp_dp_cp || setup.groups.tp_dp_cp->rank() == 0;
    return rank;
}

// Megatron's wd_incr_steps: the whole run in samples (Loom's weight decay is constant over it).
double weight_decay_steps(const TrainOptions & o) {
    return o.train_samples > 0 ? static_cast<double>(o.train_samples)
                               : static_cast<double>(o.train_iters) * static_cast<double>(o.global_batch_size);
}

json scheduler_json(const TrainOptions & o, const SchedulerState & state) {
    const optim::LrSchedule & s = state.schedule;
    return {{"max_lr", s.max_lr},
            {"min_lr", s.min_lr},
            {"lr_warmup_steps", s.warmup_steps},
            {"lr_decay_steps", s.decay_steps},
            {"lr_decay_style", optim::lr_decay_style_name(s.style)},
            {"num_steps", state.num_steps},
            {"start_wd", o.adam.weight_decay},
            {"end_wd", o.adam.weight_decay},
            {"wd_incr_steps", weight_decay_steps(o)},
            {"wd_incr_style", "constant"},
            {"lr_warmup_init", s.init_lr},
            {"lr_wsd_decay_steps", s.wsd_steps},
            {"lr_wsd_decay_style", optim::wsd_decay_style_name(s.wsd_style)}};
}

// Whether no rank's model uses each of the index's tensors (`read`: this rank's): one all-reduce over the
// world of a flag per tensor, once the ranks agree on the index they read.
std::vector<std::string> unused_tensors(const checkpoint::Index & index, const std::set<std::string> & read,
                                        comm::Communicator * world, Device & device) {
    std::vector<float> used;
    std::string        names;
    for (const auto & [name, record] : index.tensors) {
        used.push_back(read.count(name) ? 1.0f : 0.0f);
        names += name + '\n';
    }
    if (world && world->size() > 1) {
        const comm::Setting read_from[] = {{"checkpoint", std::to_string(index.tensors.size()) + " tensors, names digest " +
                                                              std::to_string(comm::digest(names))}};
        comm::check_agreement(*world, device, read_from, "the ranks read different checkpoints");
        used = comm::all_reduce_values(*world, device, std::move(used), comm::ReduceOp::max);
    }
    std::vector<std::string> unused;
    size_t                   i = 0;
    for (const auto & [name, record] : index.tensors) {
        if (used[i++] == 0.0f) unused.push_back(name);
    }
    return unused;
}

std::string name_list(const std::vector<std::string> & names) {
    std::string out;
    for (const std::string & n : names) out += (out.empty() ? "" : ", ") + n;
    return out;
}

}  // namespace

Strictness strictness_from_name(const std::string & name) {
    static const std::pair<const char *, Strictness> kNames[] = {
        {"assume_ok_unexpected", Strictness::assume_ok_unexpected}, {"log_unexpected", Strictness::log_unexpected},
        {"log_all", Strictness::log_all}, {"raise_unexpected", Strictness::raise_unexpected},
        {"raise_all", Strictness::raise_all}, {"return_unexpected", Strictness::return_unexpected},
        {"return_all", Strictness::return_all}, {"ignore_all", Strictness::ignore_all}};
    std::string choices;
    for (const auto & [n, value] : kNames) {
        if (name == n) return value;
        choices += (choices.empty() ? "" : ", ") + std::string(n);
    }
    LOOM_THROW("argument --dist-ckpt-strictness: invalid choice: '" << name << "'", "choose from " << choices);
}

namespace {

// A number of the saved schedule that a float holds (a damaged index could give 1e300, which a float
// conversion would turn into undefined behaviour).
float float_field(const json & saved, const char * key, const std::string & index_path) {
    const json & v = saved.at(key);
    LOOM_CHECK(v.is_number() && std::isfinite(v.get<double>()) && std::fabs(v.get<double>()) <= 3.4e38,
               "checkpoint index '" << index_path << "': opt_param_scheduler." << key << " is " << v.dump().substr(0, 40),
               "the index is damaged");
    return static_cast<float>(v.get<double>());
}

// A count of the saved loss scaler: an integer of int64's range (a damaged index could hold 1e95).
int64_t scaler_count(const json & saved, const char * key, const std::string & where) {
    const json v = saved.value(key, json(0));
    LOOM_CHECK(v.is_number_integer() && !(v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX)),
               where << "." << key << " is " << v.dump().substr(0, 40), "the index is damaged");
    return v.get<int64_t>();
}

}  // namespace

SchedulerState resume_scheduler(const TrainOptions & o, const optim::LrSchedule & flags, const json & saved,
                                const std::string & index_path) {
    SchedulerState state;
    state.schedule = flags;
    try {
        state.num_steps = saved.at("num_steps").get<double>();
        LOOM_CHECK(std::isfinite(state.num_steps) && state.num_steps >= 0,
                   "checkpoint index '" << index_path << "' has opt_param_scheduler.num_steps " << state.num_steps,
                   "the index is damaged");
        if (o.override_opt_param_scheduler) return state;
        optim::LrSchedule from = flags;
        from.max_lr       = float_field(saved, "max_lr", index_path);
        from.min_lr       = float_field(saved, "min_lr", index_path);
        from.warmup_steps = saved.at("lr_warmup_steps").get<double>();
        from.decay_steps  = saved.at("lr_decay_steps").get<double>();
        from.style        = optim::lr_decay_style_from_name(saved.at("lr_decay_style").get<std::string>());
        from.init_lr      = saved.contains("lr_warmup_init") ? float_field(saved, "lr_warmup_init", index_path) : flags.init_lr;
        from.wsd_steps    = saved.value("lr_wsd_decay_steps", flags.wsd_steps);
        if (saved.contains("lr_wsd_decay_style")) {
            from.wsd_style = optim::wsd_decay_style_from_name(saved.at("lr_wsd_decay_style").get<std::string>());
        }
        // Each value Megatron's load_state_dict checks, with the flags that set it.
        std::vector<std::string> differ;
        auto                     compare = [&](const char * what, const char * flag, auto now, auto was) {
            if (now == was) return;
            std::ostringstream line;
            line << "    " << what << " (" << flag << "): " << now << " in the flags, " << was << " in the checkpoint";
            differ.push_back(line.str());
        };
        const bool weight_decay_only = o.use_checkpoint_opt_param_scheduler;
        if (!weight_decay_only) {
            compare("learning rate", "--lr", flags.max_lr, from.max_lr);
            compare("minimum learning rate", "--min-lr", flags.min_lr, from.min_lr);
            compare("warmup steps, in samples", "--lr-warmup-*", flags.warmup_steps, from.warmup_steps);
            compare("decay steps, in samples", "--lr-decay-* or --train-*", flags.decay_steps, from.decay_steps);
            compare("learning rate decay style", "--lr-decay-style", std::string(optim::lr_decay_style_name(flags.style)),
                    std::string(optim::lr_decay_style_name(from.style)));
            compare("weight decay steps, in samples", "--train-iters or --train-samples", weight_decay_steps(o),
                    saved.at("wd_incr_steps").get<double>());
        }
        compare("start weight decay", "--weight-decay", o.adam.weight_decay, float_field(saved, "start_wd", index_path));
        compare("end weight decay", "--weight-decay", o.adam.weight_decay, float_field(saved, "end_wd", index_path));
        compare("weight decay increment style", "--weight-decay-incr-style", std::string("constant"),
                saved.at("wd_incr_style").get<std::string>());
        if (!differ.empty()) {
            std::string lines;
            for (const std::string & l : differ) lines += "\n" + l;
            LOOM_THROW("--load: the learning-rate schedule of the flags is not the checkpoint's ('"
                           << index_path << "'):" << lines,
                       (weight_decay_only
                           ? std::string("Loom's weight decay is fixed when the optimizer is built: give the checkpoint's "
                                         "--weight-decay, or --override-opt_param-scheduler to take the flags'")
                           : std::string("give the checkpoint's values, --use-checkpoint-opt_param-scheduler to take the "
                                         "checkpoint's schedule, or --override-opt_param-scheduler to take the flags'")));
        }
        if (o.use_checkpoint_opt_param_scheduler) state.schedule = from;
    } catch (const json::exception & e) {
        LOOM_THROW("checkpoint index '" << index_path << "' has a malformed opt_param_scheduler: " << e.what(),
                   "the index is damaged; --override-opt_param-scheduler does not read it");
    }
    return state;
}

// The args the flag tables save (train/flag_table.h), plus the sizes derived from several flags.
json checkpoint_metadata(const TrainOptions & o, int64_t consumed_samples, const SchedulerState & scheduler,
                         const json & rerun, const std::optional<optim::LossScalerState> & grad_scaler) {
    json args = json::object();
    for (const FlagInfo & f : train_flags()) {
        if (f.arg.key == nullptr) continue;
        json value = f.arg.value(o);
        if (!value.is_discarded()) args[f.arg.key] = std::move(value);
    }
    args["padded_vocab_size"]  = o.model.padded_vocab_size(o.parallel.tp());
    args["data_parallel_size"] = o.parallel.dp();
    json metadata = {{"args", args}, {"consumed_train_samples", consumed_samples}, {"rng", {{"seed", o.model.seed}}}};
    // With the optimizer only, as Megatron (--no-save-optim saves neither).
    if (!o.no_save_optim) metadata["opt_param_scheduler"] = scheduler_json(o, scheduler);
    if (!o.no_save_optim && grad_scaler) {
        metadata["grad_scaler"] = {{"scale", grad_scaler->scale},
                                   {"growth_tracker", grad_scaler->growth_tracker},
                                   {"hysteresis_tracker", grad_scaler->hysteresis_tracker}};
    }
    if (!rerun.is_null()) metadata["rerun_state_machine"] = rerun;
    return metadata;
}

// Each arg a table marks must_match, named by its flag.
void check_checkpoint_args(const TrainOptions & options, const checkpoint::Index & index) {
    const json & saved = saved_args(index);
    for (const FlagInfo & f : train_flags()) {
        if (!f.arg.must_match) continue;
        const char * key = f.arg.key;
        LOOM_CHECK(saved.contains(key) || is_later_arg(key), "checkpoint index '" << index.path() << "' has no arg " << key, "");
        const json was = saved_or_dense(saved, key);
        const json now = f.arg.value(options);
        if (was == now) continue;
        LOOM_THROW(f.name << ": the model has " << key << " = " << now.dump() << ", the checkpoint in '"
                          << index.folder << "' has " << was.dump(),
                   "give the model flags the checkpoint was saved with, or --use-checkpoint-args to take them from it");
    }
}

void apply_checkpoint_args(model::GptConfig & m, const checkpoint::Index & index) {
    const json & a = saved_args(index);
    // Each value checked before it is converted: a damaged index could hold 1e95 where an integer belongs,
    // whose conversion would be undefined behaviour, not an error.
    auto bad = [&](const std::string & key, const json & v) {
        LOOM_THROW("checkpoint index '" << index.path() << "' has malformed args: " << key << " is "
                                        << v.dump().substr(0, 40),
                   "give the model flags instead of --use-checkpoint-args");
    };
    auto integer = [&](const std::string & key, const json & v) -> int64_t {
        if (!v.is_number_integer() || (v.is_number_unsigned() && v.get<uint64_t>() > uint64_t(INT64_MAX))) bad(key, v);
        return v.get<int64_t>();
    };
    auto real = [&](const std::string & key, const json & v) -> float {
        if (!v.is_number() || !std::isfinite(v.get<double>()) || std::fabs(v.get<double>()) > 3.4e38) bad(key, v);
        return static_cast<float>(v.get<double>());
    };
    auto flag = [&](const std::string & key, const json & v) -> bool {
        if (!v.is_boolean()) bad(key, v);
        return v.get<bool>();
    };
    auto at = [&](const char * key) -> const json & {
        if (!a.contains(key)) bad(key, json("missing"));
        return a.at(key);
    };
    m.num_layers                   = integer("num_layers", at("num_layers"));
    m.hidden_size                  = integer("hidden_size", at("hidden_size"));
    m.ffn_hidden_size              = integer("ffn_hidden_size", at("ffn_hidden_size"));
    m.num_attention_heads          = integer("num_attention_heads", at("num_attention_heads"));
    m.num_query_groups             = integer("num_query_groups", at("num_query_groups"));
    m.max_position_embeddings      = integer("max_position_embeddings", at("max_position_embeddings"));
    m.seq_length                   = integer("seq_length", at("seq_length"));
    m.vocab_size                   = integer("vocab_size", at("vocab_size"));
    m.make_vocab_size_divisible_by = integer("make_vocab_size_divisible_by", at("make_vocab_size_divisible_by"));
    m.normalization = at("normalization") == "RMSNorm" ? model::Normalization::rmsnorm : model::Normalization::layernorm;
    m.swiglu        = flag("swiglu", at("swiglu"));
    m.squared_relu  = flag("squared_relu", saved_or_dense(a, "squared_relu"));
    m.quick_geglu   = flag("quick_geglu", saved_or_dense(a, "quick_geglu"));
    m.glu_linear_offset = real("glu_linear_offset", saved_or_dense(a, "glu_linear_offset"));
    if (const json clamp = saved_or_dense(a, "activation_func_clamp_value"); !clamp.is_null()) {
        m.activation_clamp = real("activation_func_clamp_value", clamp);
    }
    if (const json window = saved_or_dense(a, "window_size"); !window.is_null()) {   // [L, 0]
        if (!window.is_array() || window.size() != 2) bad("window_size", window);
        m.window_size = integer("window_size", window[0]);
        const json freq = saved_or_dense(a, "window_attn_skip_freq");
        if (freq.is_array()) {
            m.window_layers.clear();
            for (const json & v : freq) m.window_layers.push_back(static_cast<int>(integer("window_attn_skip_freq", v)));
        } else if (!freq.is_null()) {
            m.window_skip_freq = integer("window_attn_skip_freq", freq);
        }
    }
    if (const json softmax = saved_or_dense(a, "softmax_type"); softmax == "off-by-one") {
        m.softmax_type = model::SoftmaxType::off_by_one;
    } else if (softmax == "learnable") {
        m.softmax_type = model::SoftmaxType::learnable;
    } else if (softmax != "vanilla") {
        bad("softmax_type", softmax);
    }
    m.qk_layernorm  = flag("qk_layernorm", a.value("qk_layernorm", json(false)));   // absent before the flag
    m.attention_output_gate = flag("attention_output_gate", saved_or_dense(a, "attention_output_gate"));
    const json & position = at("position_embedding_type");
    if (!position.is_string()) bad("position_embedding_type", position);
    m.position_embedding = position == "rope"   ? model::PositionEmbedding::rope
                           : position == "none" ? model::PositionEmbedding::none
                                                : model::PositionEmbedding::learned_absolute;
    m.add_bias_linear                     = flag("add_bias_linear", at("add_bias_linear"));
    m.untie_embeddings_and_output_weights = flag("untie_embeddings_and_output_weights", at("untie_embeddings_and_output_weights"));
    m.norm_epsilon                        = real("norm_epsilon", at("norm_epsilon"));
    m.rotary_base                         = real("rotary_base", at("rotary_base"));
    m.rotary_percent                      = real("rotary_percent", saved_or_dense(a, "rotary_percent"));
    m.rotary_interleaved                  = flag("rotary_interleaved", saved_or_dense(a, "rotary_interleaved"));
    m.apply_layernorm_1p                  = flag("apply_layernorm_1p", saved_or_dense(a, "apply_layernorm_1p"));
    m.init_method_std                     = real("init_method_std", at("init_method_std"));
    // Multi-latent attention's shape (the sizes are null in a model without it).
    m.multi_latent_attention = flag("multi_latent_attention", saved_or_dense(a, "multi_latent_attention"));
    if (m.multi_latent_attention) {
        const json q             = saved_or_dense(a, "q_lora_rank");
        m.q_lora_rank            = q.is_null() ? 0 : integer("q_lora_rank", q);
        m.kv_lora_rank           = integer("kv_lora_rank", at("kv_lora_rank"));
        m.qk_head_dim            = integer("qk_head_dim", at("qk_head_dim"));
        m.qk_pos_emb_head_dim    = integer("qk_pos_emb_head_dim", at("qk_pos_emb_head_dim"));
        m.v_head_dim             = integer("v_head_dim", at("v_head_dim"));
        // Its RoPE (saved with the sizes; Megatron's defaults when absent).
        m.mla_yarn              = a.value("rope_type", json("yarn")) != json("rope");
        m.rotary_scaling_factor = real("rotary_scaling_factor", a.value("rotary_scaling_factor", json(1.0)));
        m.mscale                = real("mscale", a.value("mscale", json(1.0)));
        m.mscale_all_dim        = real("mscale_all_dim", a.value("mscale_all_dim", json(0.0)));
    }
    // The gated delta-net's pattern and sizes (null in a model without it).
    if (const json variant = saved_or_dense(a, "experimental_attention_variant"); variant == "dsa") {
        // DSA's indexer (its sizes; the top-k and the loss's weight are training choices, given as flags).
        m.dsa                  = true;
        m.dsa_indexer_n_heads  = integer("dsa_indexer_n_heads", at("dsa_indexer_n_heads"));
        m.dsa_indexer_head_dim = integer("dsa_indexer_head_dim", at("dsa_indexer_head_dim"));
        m.dsa_indexer_topk     = integer("dsa_indexer_topk", a.value("dsa_indexer_topk", json(m.seq_length)));
        // Which layers have an indexer: null when every layer computes its own top-k.
        if (const json freq = saved_or_dense(a, "dsa_indexer_topk_freq"); !freq.is_null()) {
            m.dsa_indexer_topk_freq        = integer("dsa_indexer_topk_freq", freq);
            m.dsa_indexer_skip_topk_offset = integer("dsa_indexer_skip_topk_offset",
                                                     saved_or_dense(a, "dsa_indexer_skip_topk_offset"));
        }
    } else if (!variant.is_null()) {
        if (variant != "gdn" && variant != "gated_delta_net") bad("experimental_attention_variant", variant);
        m.gated_delta_net = true;
        const json freq   = saved_or_dense(a, "linear_attention_freq");
        m.linear_attention_layers.clear();
        if (freq.is_array()) {
            for (const json & v : freq) m.linear_attention_layers.push_back(static_cast<int>(integer("linear_attention_freq", v)));
            m.linear_attention_freq = 0;
        } else {
            m.linear_attention_freq = integer("linear_attention_freq", freq);
        }
        m.linear_conv_kernel_dim = integer("linear_conv_kernel_dim", at("linear_conv_kernel_dim"));
        m.linear_key_head_dim    = integer("linear_key_head_dim", at("linear_key_head_dim"));
        m.linear_value_head_dim  = integer("linear_value_head_dim", at("linear_value_head_dim"));
        m.linear_num_key_heads   = integer("linear_num_key_heads", at("linear_num_key_heads"));
        m.linear_num_value_heads = integer("linear_num_value_heads", at("linear_num_value_heads"));
    }
    // Multi-token prediction's depths (null: none) and the weight of their losses.
    if (const json depths = saved_or_dense(a, "mtp_num_layers"); !depths.is_null()) {
        m.mtp_num_layers          = integer("mtp_num_layers", depths);
        m.mtp_loss_scaling_factor = real("mtp_loss_scaling_factor", a.value("mtp_loss_scaling_factor", json(0.1)));
    }
    // The MoE shape (the router's other settings are training choices, given as flags).
    if (const json experts = saved_or_dense(a, "num_experts"); !experts.is_null()) {
        m.moe.num_experts = integer("num_experts", experts);
        const json freq   = saved_or_dense(a, "moe_layer_freq");
        if (freq.is_array()) {
            m.moe.layer_pattern.clear();
            for (const json & v : freq) {
                const int64_t x = integer("moe_layer_freq", v);
                if (x < 0 || x > 1) bad("moe_layer_freq", v);
                m.moe.layer_pattern.push_back(static_cast<int>(x));
            }
        } else {
            m.moe.layer_freq = integer("moe_layer_freq", freq);
        }
        m.moe.ffn_hidden_size = integer("moe_ffn_hidden_size", saved_or_dense(a, "moe_ffn_hidden_size"));
        const json shared     = saved_or_dense(a, "moe_shared_expert_intermediate_size");
        m.moe.shared_expert_intermediate_size = shared.is_null() ? 0 : integer("moe_shared_expert_intermediate_size", shared);
        m.moe.shared_expert_gate = flag("moe_shared_expert_gate", saved_or_dense(a, "moe_shared_expert_gate"));
        m.moe.grouped_gemm = flag("moe_grouped_gemm", saved_or_dense(a, "moe_grouped_gemm"));
    }
}

std::optional<std::string> checkpoint_to_load(const TrainOptions & o) {
    std::optional<int64_t> step;
    if (o.ckpt_step >= 0) step = o.ckpt_step;
    return checkpoint::find_checkpoint(o.load, step);
}

Resumed load_checkpoint(const TrainOptions & options, Setup & setup) {
    Resumed resumed;
    if (options.load.empty()) return resumed;
    const auto start = std::chrono::steady_clock::now();
    std::optional<std::string> folder = checkpoint_to_load(options);
    LOOM_CHECK(folder || !options.exit_on_missing_checkpoint,
               "--exit-on-missing-checkpoint: '" << options.load << "' holds no checkpoint (no "
                                                 << checkpoint::kTrackerFile << ")",
               "give the --save folder of a run, or leave the flag out to train from scratch");
    if (!folder) return resumed;
    checkpoint::Index index = checkpoint::read_index(*folder);
    check_checkpoint_args(options, index);
    // The schedule (checked before any tensor is read), as Megatron: not with --finetune or --no-load-optim.
    if (const json * saved = index.metadata.contains("grad_scaler") ? &index.metadata["grad_scaler"] : nullptr) {
        const std::string where = "checkpoint index '" + index.path() + "': grad_scaler";
        LOOM_CHECK(saved->is_object() && saved->contains("scale") && (*saved)["scale"].is_number() &&
                       std::isfinite((*saved)["scale"].get<double>()) && (*saved)["scale"].get<double>() > 0 &&
                       (*saved)["scale"].get<double>() <= 3.4e38,
                   where << " has no positive finite scale", "the index is damaged");
        optim::LossScalerState state;
        state.scale              = static_cast<float>((*saved)["scale"].get<double>());
        state.growth_tracker     = scaler_count(*saved, "growth_tracker", where);
        state.hysteresis_tracker = scaler_count(*saved, "hysteresis_tracker", where);
        resumed.grad_scaler      = state;
    }
    if (!options.finetune && !options.no_load_optim && index.metadata.contains("opt_param_scheduler")) {
        resumed.scheduler = resume_scheduler(options, options.lr_schedule(), index.metadata["opt_param_scheduler"],
                                             index.path());
    } else if (!options.finetune && !options.no_load_optim) {
        LOOM_CHECK(!options.use_checkpoint_opt_param_scheduler,
                   "--use-checkpoint-opt_param-scheduler: checkpoint index '" << index.path()
                                                                              << "' holds no opt_param_scheduler",
                   "it was saved with --no-save-optim, or before Loom saved the schedule; give the schedule's flags "
                   "instead");
    }
    checkpoint::LoadOptions load;
    load.optimizer  = !options.no_load_optim && !options.finetune;
    load.vocab_size = options.model.vocab_size;
    if (load.optimizer && index.has_optimizer) {   // Adam's moments are not Muon's momentum (a checkpoint before the arg: adam)
        const json &      args  = saved_args(index);
        const std::string saved = args.contains("optimizer") ? args["optimizer"].get<std::string>() : "adam";
        LOOM_CHECK(saved == options.optimizer(), "--optimizer " << options.optimizer() << ": checkpoint '" << index.path()
                                                              << "' holds the state of --optimizer " << saved,
                   "give --optimizer " << saved << ", or --no-load-optim to start " << options.optimizer()
                                       << "'s state afresh from the checkpoint's weights");
    }
    const checkpoint::RankContents contents = rank_contents(options, setup);
    const Strictness               strict   = strictness_from_name(options.dist_ckpt_strictness);
    load.allow_absent = strict != Strictness::assume_ok_unexpected;
    const bool find_missing =
        strict == Strictness::log_all || strict == Strictness::raise_all || strict == Strictness::return_all;
    const std::vector<std::string> unexpected = checkpoint::absent_tensors(index, contents);
    std::vector<std::string>       missing;
    if (find_missing) {
        std::set<std::string> read;
        for (const model::Parameter * p : contents.params) {
            if (index.tensors.count(p->name)) read.insert(p->name);
        }
        for (const checkpoint::Buffer & b : contents.buffers) {
            if (index.tensors.count(b.name)) read.insert(b.name);
        }
        missing = unused_tensors(index, read, contents.world, setup.chunks.at(0)->device());
    }
    const int rank = contents.world ? contents.world->rank() : 0;
    if (strict == Strictness::raise_unexpected || strict == Strictness::raise_all) {
        LOOM_CHECK(unexpected.empty() && missing.empty(),
                   "--dist-ckpt-strictness " << options.dist_ckpt_strictness << ": checkpoint '" << index.path()
                       << "' does not match the model"
                       << (unexpected.empty() ? "" : "; rank " + std::to_string(rank) +
                                                         "'s model has tensors it lacks (unexpected): " + name_list(unexpected))
                       << (missing.empty() ? "" : "; it has tensors no rank's model uses (missing): " + name_list(missing)),
                   "load a checkpoint of this model, or give log_all to load the tensors it has and keep the others' "
                   "initial values");
    }
    // Loading writes whole values (and, through the optimizer's slots, the shards): FSDP's sharded units
    // are gathered first.
    if (setup.ddp) setup.ddp->finish_param_sync();
    const checkpoint::LoadReport report = checkpoint::load(index, contents, load);
    if (!report.fresh.empty()) {
        resumed.notes.push_back("note: '" + index.path() + "' holds no delayed FP8 state (" + std::to_string(report.fresh.size()) +
                                " histories and scales): they start afresh, each scale at 1");
    }
    // FP8 codes (--fp8-param-gather): the shards' codes again from the loaded main values.
    if (setup.ddp) setup.ddp->encode_fp8_params();
    const bool listed = strict != Strictness::ignore_all && strict != Strictness::assume_ok_unexpected;
    if (listed && !unexpected.empty()) {
        std::fprintf(stderr, "WARNING: rank %d: --dist-ckpt-strictness %s: %zu tensor(s) of the model are not in '%s' "
                             "(unexpected), kept at their initial values: %s\n",
                     rank, options.dist_ckpt_strictness.c_str(), unexpected.size(), index.path().c_str(),
                     name_list(unexpected).c_str());
    }
    if (listed && !missing.empty()) {
        resumed.notes.push_back("WARNING: --dist-ckpt-strictness " + options.dist_ckpt_strictness + ": " +
                                std::to_string(missing.size()) + " tensor(s) of '" + index.path() +
                                "' are used by no rank's model (missing), not loaded: " + name_list(missing));
    }
    if (index.metadata.contains("rerun_state_machine")) resumed.rerun = index.metadata["rerun_state_machine"];
    resumed.folder = *folder;
    if (!options.finetune) {
        resumed.iteration = index.iteration;
        LOOM_CHECK(index.metadata.contains("consumed_train_samples"),
                   "checkpoint index '" << index.path() << "' has no consumed_train_samples", "");
        resumed.consumed_samples = index.metadata["consumed_train_samples"].get<int64_t>();
    }
    resumed.seconds = std::chrono::duration<double>(std::chrono::steady_clock::now() - start).count();
    return resumed;
}

checkpoint::Index index_to_read(const TrainOptions & o, const char * command) {
    LOOM_CHECK(o.save.empty() && o.save_interval == 0 && o.exit_interval == 0 && o.exit_duration_in_mins == 0 &&
                   !o.exit_signal_handler,
               "--save, --save-interval and the --exit-* flags are flags of `loom train`, not of `" << command << "`",
               "leave them out");
    std::optional<std::string> folder = checkpoint_to_load(o);
    LOOM_CHECK(folder, "--load '" << o.load << "' holds no " << checkpoint::kTrackerFile,
               "give the --save folder of a `loom train` run");
    return checkpoint::read_index(*folder);
}

void load_weights(const checkpoint::Index & index, model::GptModel & model) {
    checkpoint::RankContents contents;
    contents.params = model.parameters();
    for (auto & [name, tensor] : model.buffers()) contents.buffers.push_back({name, tensor, is_fp8_state(name)});
    checkpoint::LoadOptions load;
    load.optimizer  = false;
    load.vocab_size = model.config().vocab_size;
    checkpoint::load(index, contents, load);
}

std::optional<int64_t> tracked_iteration(const std::string & dir) {
    std::ifstream in(std::filesystem::path(dir) / checkpoint::kTrackerFile);
    int64_t       iteration = 0;
    if (!(in >> iteration)) return std::nullopt;
    return iteration;
}

bool retire_checkpoint(const TrainOptions & o, std::optional<int64_t> previous, int64_t iteration) {
    namespace fs = std::filesystem;
    if (o.save_retain_interval <= 0 || !previous || *previous <= 0 || *previous == iteration ||
        *previous % o.save_retain_interval == 0) {
        return false;
    }
    const fs::path folder = fs::path(o.save) / checkpoint::iteration_folder(*previous);
    std::error_code ec;
    if (fs::is_symlink(fs::symlink_status(folder, ec)) || !fs::is_directory(folder, ec)) return false;
    const fs::path doomed = folder.string() + ".tmp";
    fs::remove_all(doomed, ec);
    fs::rename(folder, doomed, ec);
    LOOM_CHECK(!ec, "--save-retain-interval: cannot remove '" << folder.string() << "': " << ec.message(), "");
    fs::remove_all(doomed, ec);
    return true;
}

std::unique_ptr<checkpoint::SaveInProgress> begin_save_checkpoint(
    const TrainOptions & options, Setup & setup, int64_t iteration, int64_t consumed_samples,
    const SchedulerState & scheduler, const std::optional<optim::LossScalerState> & grad_scaler, bool background) {
    return checkpoint::begin_save(options.save, iteration,
                                  checkpoint_metadata(options, consumed_samples, scheduler, nullptr, grad_scaler),
                                  rank_contents(options, setup), !options.no_save_optim, background);
}

checkpoint::SaveStats save_checkpoint(const TrainOptions & options, Setup & setup, int64_t iteration,
                                      int64_t consumed_samples, const SchedulerState & scheduler, const json & rerun,
                                      const std::optional<optim::LossScalerState> & grad_scaler) {
    return checkpoint::save(options.save, iteration,
                            checkpoint_metadata(options, consumed_samples, scheduler, rerun, grad_scaler),
                            rank_contents(options, setup), !options.no_save_optim);
}

}  // namespace loom::train
