#include "train/setup.h"

#include <algorithm>

#include "core/error.h"
#include "model/hf_gpt2.h"
#include "optim/distributed_optimizer.h"
#include "pipeline/layer_assignment.h"

namespace loom::train {

namespace {

int size_of(const std::shared_ptr<comm::Communicator> & group) { return group ? group->size() : 1; }

void check_pipeline_group(const TrainOptions & options, const parallel::ProcessGroups & groups) {
    LOOM_CHECK(size_of(groups.pp) == options.parallel.pp(),
               "pipeline group of " << size_of(groups.pp) << " ranks for --pipeline-model-parallel-size "
                                    << options.parallel.pp(), "");
}

}  // namespace

std::vector<model::PipelineStage> pipeline_stages(const TrainOptions & options, int stage) {
    const int pp = options.parallel.pp();
    LOOM_CHECK(stage >= 0 && stage < pp, "pipeline stage " << stage << " of --pipeline-model-parallel-size " << pp, "");
    if (pp == 1) return {model::PipelineStage{}};
    const pipeline::LayerAssignment   layout = pipeline::assign_layers(options.layer_split());
    std::vector<model::PipelineStage> stages;
    for (int c = 0; c < layout.num_chunks; ++c) {
        const pipeline::LayerRange layers = layout.at(stage, c);
        const int                  v      = c * pp + stage;   // virtual stage
        stages.push_back(model::PipelineStage{layers.begin, layers.size(), v == 0, v == pp * layout.num_chunks - 1});
    }
    return stages;
}

Setup::~Setup() {
    for (model::GptModel * chunk : chunks) chunk->set_param_hooks({});
    if (ddp) {
        try {
            ddp->finish_param_sync();   // leave the model's weights whole for whoever uses it next
        } catch (...) {
        }
    }
}

std::vector<model::Parameter *> Setup::parameters() const {
    std::vector<model::Parameter *> params;
    for (model::GptModel * chunk : chunks) {
        for (model::Parameter * p : chunk->parameters()) params.push_back(p);
    }
    return params;
}

Setup setup(const TrainOptions & options, const parallel::ProcessGroups & groups, Device & device, bool init_values) {
    check_pipeline_group(options, groups);
    LOOM_CHECK(size_of(groups.tp) == options.parallel.tp(),
               "tensor-parallel group of " << size_of(groups.tp) << " ranks for --tensor-model-parallel-size "
                                           << options.parallel.tp(), "");
    options.model.validate();
    model::TensorParallel tensor;
    if (size_of(groups.tp) > 1) {
        tensor = model::TensorParallel{groups.tp, groups.tp->rank(), groups.tp->size(), options.sequence_parallel};
        if (options.tp_comm_overlap) tensor.overlap = std::make_shared<model::TensorParallel::Streams>(device);
    }
    LOOM_CHECK(size_of(groups.expert_ep) == options.parallel.ep(),
               "expert-parallel group of " << size_of(groups.expert_ep) << " ranks for --expert-model-parallel-size "
                                           << options.parallel.ep(), "");
    model::ExpertParallel expert;
    if (size_of(groups.expert_ep) > 1) {
        expert.group = groups.expert_ep;
        expert.rank  = groups.expert_ep->rank();
        expert.size  = groups.expert_ep->size();
    }
    if (size_of(groups.expert_tp) > 1) {
        expert.tp_rank = groups.expert_tp->rank();
        expert.tp_size = groups.expert_tp->size();
    }
    if (size_of(groups.expert_tp_ep) > 1) expert.tp_ep = groups.expert_tp_ep;
    if (size_of(groups.tp_dp_cp) > 1) expert.tp_dp_cp = groups.tp_dp_cp;   // global_aux_loss's counts
    LOOM_CHECK(size_of(groups.cp) == options.parallel.cp(),
               "context-parallel group of " << size_of(groups.cp) << " ranks for --context-parallel-size "
                                            << options.parallel.cp(), "");
    model::ContextParallel context;
    context.comm_types = options.cp_comm_types;
    if (size_of(groups.cp) > 1) {
        context.group = groups.cp;
        context.rank  = groups.cp->rank();
        context.size  = groups.cp->size();
        context.tp_cp = groups.tp_cp;
        context.inner = groups.cp_inner;
        context.outer = groups.cp_outer;
        const bool hierarchical = std::find(context.comm_types.begin(), context.comm_types.end(),
                                            model::CpCommType::a2a_p2p) != context.comm_types.end();
        LOOM_CHECK(!hierarchical || (context.inner && context.outer),
                   "--cp-comm-type a2a+p2p without the hierarchical context-parallel groups",
                   "give --hierarchical-context-parallel-sizes (the process groups are built from it)");
        context.streams = std::make_shared<model::ContextParallel::Streams>(device);
    }
    std::vector<std::unique_ptr<model::GptModel>> owned;
    std::vector<model::GptModel *>                chunks;
    for (const model::PipelineStage & part : pipeline_stages(options, groups.pp ? groups.pp->rank() : 0)) {
        owned.push_back(std::make_unique<model::GptModel>(options.model, device, part, tensor, expert, context));
        if (init_values) owned.back()->init();
        chunks.push_back(owned.back().get());
    }
    if (!options.load_hf.empty() && init_values) {
        // options.resolve() refused --load-hf with TP or PP, and checked the shape against config.json.
        model::load_hf_gpt2(*chunks.front(), options.load_hf);
    }
    Setup s = setup(options, std::move(chunks), groups);
    s.owned_chunks = std::move(owned);
    return s;
}

Setup setup(const TrainOptions & options, std::vector<model::GptModel *> chunks, const parallel::ProcessGroups & groups) {
    LOOM_CHECK(!chunks.empty(), "a rank with no model chunks", "");
    check_pipeline_group(options, groups);
    Setup s;
    s.chunks = std::move(chunks);
    s.groups = groups;
    Device &                        device = s.chunks.front()->device();
    std::vector<model::Parameter *> params = s.parameters();
    if (groups.dp) {
        LOOM_CHECK(groups.dp->size() == options.parallel.dp(),
                   "data-parallel group of " << groups.dp->size() << " ranks for options resolved for "
                                             << options.parallel.dp(), "");
        // With context parallelism the CP ranks hold the same weights and different positions of the same
        // samples: gradients reduce (and ZeRO-1 shards) over data- and context-parallel ranks together.
        const std::shared_ptr<comm::Communicator> & grads = s.gradient_group();
        // Expert parameters reduce and shard over the expert-data-parallel group (the dense dp group's
        // ranks while --expert-model-parallel-size is 1).
        // With several distributed-optimizer instances each instance's own ranks shard (intra groups) and
        // the instances all-reduce their shards (inter groups).
        const bool instances = groups.intra_dp != nullptr;
        // Megatron's one DDP per model chunk: only chunk 0 of the first stage is cut into buckets.
        ddp::DdpPlacement placement;
        placement.pipeline_rank                            = groups.pp ? groups.pp->rank() : 0;
        placement.overlap_param_gather_with_optimizer_step = options.overlap_param_gather_with_optimizer_step;
        for (size_t c = 0; c < s.chunks.size(); ++c) {
            placement.chunk_of_param.insert(placement.chunk_of_param.end(), s.chunks[c]->parameters().size(),
                                            static_cast<int>(c));
            const std::vector<int> units = s.chunks[c]->parameter_units();
            placement.unit_of_param.insert(placement.unit_of_param.end(), units.begin(), units.end());
        }
        s.ddp = std::make_unique<ddp::DistributedDataParallel>(
            params, options.ddp, instances ? groups.intra_dp : grads, device,
            instances ? groups.intra_expert_dp : (groups.expert_dp ? groups.expert_dp : grads),
            instances ? groups.inter_dp : nullptr, instances ? groups.inter_expert_dp : nullptr, placement);
        for (model::GptModel * chunk : s.chunks) chunk->set_param_hooks(s.ddp->param_hooks());
    } else {
        LOOM_CHECK(!options.ddp.use_distributed_optimizer && !options.ddp.overlap_grad_reduce &&
                       options.ddp.grad_reduce_in_fp32,
                   "the data-parallel options need a data-parallel group",
                   "16-bit gradient buffers, ZeRO-1 and the overlaps live in DDP's buffers");
    }
    optim::OptimizerOptions optimizer{options.adam, options.clip_grad, std::nullopt, std::nullopt, {}, 1.0};
    if (options.optimizer_cpu_offload) optimizer.offload = options.offload;
    optimizer.mup_width_mult = options.model.mup_width_mult();
    optimizer.muon = options.muon;   // the weight matrices' shards gather over TP (ETP for experts)
    optimizer.muon_groups = {size_of(groups.tp) > 1 ? groups.tp.get() : nullptr,
                             size_of(groups.expert_tp) > 1 ? groups.expert_tp.get() : nullptr};
    // The norm sums over the model-parallel ranks: TP x PP (tp_pp), or the stages alone.
    comm::Communicator * model_parallel = size_of(groups.tp_pp) > 1 ? groups.tp_pp.get()
                                          : size_of(groups.pp) > 1  ? groups.pp.get()
                                                                    : nullptr;
    // Expert parameters are summed over their own model-parallel ranks, ETP x EP x PP (each expert once),
    // when the model has them and the expert groups exist (Megatron's expert sub-optimizer's norm).
    comm::Communicator * expert_model_parallel =
        options.model.moe.enabled() && groups.expert_tp_ep_pp ? groups.expert_tp_ep_pp.get() : nullptr;
    if (options.ddp.use_distributed_optimizer) {
        s.optimizer = std::make_unique<optim::DistributedOptimizer>(*s.ddp, optimizer, model_parallel, expert_model_parallel);
    } else {
        s.optimizer = std::make_unique<optim::AdamW>(params, optimizer, model_parallel, expert_model_parallel);
    }
    return s;
}

}  // namespace loom::train
