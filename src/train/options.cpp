#include "train/options_parser.h"

#include "core/error.h"
#include "train/megatron_flags.h"

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <type_traits>

namespace loom::train {

namespace {

// The tables, each with the value its flags land in, in the order they are registered (so the order
// --help lists a group's flags in). The one list of tables: registration, the checkpoint's args and the
// docs all walk it.
template <class Values, class Visit> void for_each_table(Values & v, Visit && visit) {
    auto & o = v.options;
    visit(model_option_flags(), o);
    visit(model_flags(), v.model);
    visit(adam_flags(), o.adam);
    visit(optim_flags(), v.optim);
    visit(schedule_flags(), o);
    visit(offload_flags(), o.offload);
    visit(ddp_flags(), o.ddp);
    visit(parallel_flags(), v.parallel);
    visit(parallel_option_flags(), o);
    visit(logging_flags(), o);
    visit(data_flags(), o);
    visit(checkpoint_flags(), o);
    visit(recompute_flags(), v.recompute);
    visit(moe_flags(), v.moe);
    visit(graph_flags(), v.graphs);
    visit(graph_option_flags(), o);
}

// The shortest %g spelling of `value` that reads back as the same T (1e-4f is "0.0001", not "9.99999975e-05").
template <class T> std::string shortest_text(T value) {
    char buffer[40];
    for (int digits = 6;; ++digits) {
        std::snprintf(buffer, sizeof buffer, "%.*g", digits, static_cast<double>(value));
        const T back = std::is_same_v<T, float> ? std::strtof(buffer, nullptr) : std::strtod(buffer, nullptr);
        if (back == value || digits == 17 || value != value) return buffer;
    }
}

// A member's value as text that is equal exactly when the values are.
template <class T> std::string value_text(const T & value) {
    if constexpr (std::is_same_v<T, bool>) {
        return value ? "true" : "false";
    } else if constexpr (std::is_floating_point_v<T>) {
        return shortest_text(value);
    } else if constexpr (std::is_integral_v<T>) {
        return std::to_string(value);
    } else if constexpr (std::is_same_v<T, std::string>) {
        return value;
    } else {   // a list
        std::string text;
        for (const auto & item : value) {
            if (!text.empty()) text += ' ';
            text += value_text(item);
        }
        return text;
    }
}

}  // namespace

std::vector<comm::Setting> TrainOptionParser::settings(const TrainOptions & resolved) const {
    std::vector<comm::Setting> out;
    for_each_table(values_, [&](auto table, const auto & owner) {
        for (const auto & flag : table) {
            std::visit([&](auto member) { out.push_back({flag.name, value_text(owner.*member)}); }, flag.member);
        }
    });
    const model::GptConfig & m = resolved.model;
    out.push_back({"the resolved model",
                   detail::concat(m.num_layers, " layers, hidden ", m.hidden_size, ", ffn ", m.ffn_hidden_size, ", heads ",
                                  m.num_attention_heads, " (", m.num_query_groups, " query groups), seq ", m.seq_length,
                                  ", vocab ", m.vocab_size, ", ", m.num_parameters(), " parameters")});
    return out;
}

std::vector<FlagInfo> train_flags() {
    FlagValues            scratch;
    std::vector<FlagInfo> out;
    for_each_table(scratch, [&](auto table, auto &) { append_info(out, table); });
    return out;
}

TrainOptionParser::TrainOptionParser(CLI::App & app) : app_(app) {
    // argparse's rule: a flag given twice takes its last value (launch scripts append "$@" to their flags).
    app.option_defaults()->multi_option_policy(CLI::MultiOptionPolicy::TakeLast);
    // Flags CLI11 does not know are collected and refused together in resolve(), one per line.
    app.allow_extras();
    for_each_table(values_, [&](auto table, auto & owner) { add_flags(app, table, owner); });
    add_noop_flags(app, noop_values_);
    read_numbers_as_argparse(app);
    group_like_megatron(app);
}

namespace {

// --fp8-param-gather: the FP8 codes are encoded from the distributed optimizer's f32 shards (ddp/ddp.h).
void check_fp8_param_gather(const TrainOptions & o) {
    if (!o.model.fp8_param_gather) return;
    LOOM_CHECK(o.ddp.use_distributed_optimizer,
               "--fp8-param-gather only supported with distributed optimizer, torch fsdp2, megatron fsdp, or inference mode",
               "add --use-distributed-optimizer, or --use-megatron-fsdp with a sharding strategy other than no_shard");
    LOOM_CHECK(!o.optimizer_cpu_offload || o.model.fp8_delayed,
               "When `--fp8-param-gather` is enabled, the optimizer cpu offload must be used in conjunction with "
               "`--fp8-recipe delayed`.", "");
    LOOM_CHECK(!o.optimizer_cpu_offload, "--fp8-param-gather with --optimizer-cpu-offload is not supported by Loom",
               "Loom's hybrid optimizer steps 16-bit or f32 weights: drop one of them");
    LOOM_CHECK(!o.muon, "--optimizer muon with --fp8-param-gather is not supported by Loom",
               "Muon orthogonalizes 16-bit or f32 weights in Loom: drop --fp8-param-gather");
}

// --fp8-recipe delayed: a layer's amax histories move after its training forward and backward, once each per
// micro-batch; what would cast a layer's operands a second time in a pass is refused (Loom's limits).
void check_fp8_delayed(const TrainOptions & o) {
    if (!o.model.fp8_delayed) return;
    const char * hint = "give --fp8-recipe tensorwise, or drop the other flag";
    LOOM_CHECK(!o.layer_graphs, "--fp8-recipe delayed with layer graphs (--cuda-graph-impl) is not supported by Loom", hint);
    LOOM_CHECK(o.model.recompute_granularity != model::RecomputeGranularity::full,
               "--fp8-recipe delayed with --recompute-granularity full is not supported by Loom", hint);
    LOOM_CHECK(!o.model.recompute_mlp && !o.model.recompute_shared_experts,
               "--fp8-recipe delayed with --recompute-modules " << (o.model.recompute_mlp ? "mlp" : "shared_experts")
                                                                << " is not supported by Loom", hint);
}

}  // namespace

// The order of the steps is the flags' order of precedence: the preset (or --load-hf's shape), the model
// flags given, the tokenizer's vocabulary, MoE and graphs over the model, --use-checkpoint-args over all of
// them; then the checks that need the resolved model.
TrainOptions TrainOptionParser::resolve(int64_t world_size) {
    const std::string unsupported = unsupported_flags_message(app_.remaining());
    LOOM_CHECK(unsupported.empty(), unsupported,
               "docs/megatron_flags.md lists the Megatron flags Loom accepts; `loom train --help` groups them");
    const Given  given(app_);
    TrainOptions o = values_.options;
    // The experts: the flag's, or a preset's (deepseek-v3) without it.
    const int64_t experts = given("--num-experts") ? values_.moe.num_experts : model::gpt_preset(o.model_preset).moe.num_experts;
    resolve_parallel_sizes(values_.parallel, experts, given, world_size, o);
    check_dropout(values_.model);

    o.model = model::gpt_preset(o.model_preset);
    const std::optional<model::GptConfig> hf = read_hf_shape(given, o);
    resolve_model_shape(values_.model, given, o);
    resolve_decoupled_lr(values_.optim, given, o);
    resolve_recompute(values_.recompute, given, o.model);
    check_model_flags(values_.model, given, o);
    apply_tokenizer(o, given("--vocab-size"));
    resolve_moe(values_.moe, given, o);
    resolve_cuda_graphs(values_.graphs, values_.moe, o);
    LOOM_CHECK(o.model.offload_modules == 0 || !o.layer_graphs,
               "--fine-grained-activation-offloading with --cuda-graph-impl is not supported by Loom",
               "Loom offloads the inputs of layers run eagerly: drop one of them");
    LOOM_CHECK(!o.model.dsa || o.parallel.tp() == 1 || o.sequence_parallel,
               "--experimental-attention-variant dsa with --tensor-model-parallel-size " << o.parallel.tp()
                   << " needs --sequence-parallel (Megatron's AbsorbedMLASelfAttention requires it)",
               "add --sequence-parallel");
    validate_checkpoint_flags(o, given);
    apply_checkpoint_shape(o);
    if (hf) check_hf_shape(*hf, values_.model, given, o);

    resolve_batch(given, o);
    resolve_ddp(values_.parallel, given, o);
    LOOM_CHECK(!o.model.dsa || o.parallel.cp() == 1 ||
                   std::all_of(o.cp_comm_types.begin(), o.cp_comm_types.end(),
                               [](model::CpCommType c) { return c == model::CpCommType::allgather; }),
               "--experimental-attention-variant dsa with --context-parallel-size " << o.parallel.cp()
                   << " needs --cp-comm-type allgather (Megatron: \"DSAttention context parallelism currently supports "
                      "cp_comm_type=allgather only.\")",
               "add --cp-comm-type allgather");
    LOOM_CHECK(!o.full_iteration_graph || !o.ddp.use_megatron_fsdp,
               "--cuda-graph-impl full_iteration with --use-megatron-fsdp is not supported by Loom",
               "Megatron-FSDP's gathers are issued from hooks on the host during the passes: drop one of them");
    resolve_optimizer(values_.optim, o);
    check_fp8_param_gather(o);
    check_fp8_delayed(o);
    resolve_schedule(given, o);
    validate_hyperparameters(o);
    validate_logging(given, o);
    validate_data(given, o, data_optional_);
    resolve_precision(o);
    check_offload(o);
    validate_layout(o);
    o.model.validate();
    if (!plan_only_) check_memory(o, world_size);
    return o;
}

std::string flag_reference_markdown() {
    CLI::App          app{"", "loom train"};
    TrainOptionParser parser(app);
    return render_flags_markdown(app);
}

}  // namespace loom::train
