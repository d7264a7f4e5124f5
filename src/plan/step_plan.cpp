#include "plan/step_plan.h"

#include "core/error.h"

#include <algorithm>

namespace loom::plan {

double megatron_flops(const train::TrainOptions & options) {
    const model::GptConfig & model  = options.model;
    const double             tokens = static_cast<double>(options.global_batch_size * model.seq_length);
    double                   flops  = model.training_flops_per_token(options.parallel.tp()) * tokens;
    if (model.recompute_granularity == model::RecomputeGranularity::full) {
        // uniform: every layer's forward runs again; block: the first N layers of each model chunk.
        double share = 1.0;
        if (model.recompute_method == model::RecomputeMethod::block) {
            const double chunks = static_cast<double>(options.parallel.pp() * options.parallel.vpp().value_or(1));
            share = std::min(1.0, static_cast<double>(model.recompute_num_layers) * chunks /
                                      static_cast<double>(model.num_layers));
        }
        flops += share * model.layers_forward_flops_per_token() * tokens;
    }
    return flops;
}

StepPlan plan_step(const train::TrainOptions & options, int world_size, const CostModel & costs) {
    LOOM_CHECK(!options.model.moe.enabled(), "loom plan cannot time a model with MoE layers yet",
               "their tokens go to the experts the router picks from the data, which the plan does not compute; "
               "plan the memory without --gpu");
    StepPlan plan;
    plan.stages.push_back(plan_rank_memory(options, world_size, 0, &costs));
    const std::vector<int> ranks = plan.stages.front().pipeline_ranks;
    for (size_t stage = 1; stage < ranks.size(); ++stage) {
        plan.stages.push_back(plan_rank_memory(options, world_size, ranks[stage], &costs));
    }
    double transfer_s = 0;
    for (const RankMemory & stage : plan.stages) {
        LOOM_CHECK(stage.time.has_value(), "rank " << stage.rank << "'s iteration was not timed", "");
        transfer_s = std::max(transfer_s, stage.time->transfer_s);
    }
    const pipeline::ScheduleOptions & schedule = plan.stages.front().time->schedule;
    plan.timeline = pipeline::simulate_timeline(
        schedule,
        [&](int rank, size_t k, const pipeline::ScheduleOp &) {
            const std::vector<pipeline::TimelineOp> & ops = plan.stages[static_cast<size_t>(rank)].time->ops;
            LOOM_CHECK(k < ops.size(), "stage " << rank << " ran " << ops.size() << " ops, the schedule has more", "");
            return ops[k].end - ops[k].start;
        },
        transfer_s * 1e3);
    for (size_t stage = 0; stage < plan.stages.size(); ++stage) {
        const RankTime & time = *plan.stages[stage].time;
        const auto &     ops  = plan.timeline.ranks[stage];
        const double     step = time.head_s + (ops.empty() ? 0.0 : ops.back().end / 1e3) + time.tail_s;
        if (step > plan.step_s) {
            plan.step_s        = step;
            plan.slowest_stage = static_cast<int>(stage);
        }
    }
    plan.model_flops    = megatron_flops(options);
    plan.tflops_per_gpu = plan.step_s > 0 ? plan.model_flops / plan.step_s / world_size / 1e12 : 0.0;
    plan.mfu            = plan.tflops_per_gpu * 1e12 / costs.tensor_core_flops();
    return plan;
}

}  // namespace loom::plan
