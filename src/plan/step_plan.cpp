#include "plan/step_plan.h"

#include "core/error.h"

#include <algorithm>
#include <map>
#include <tuple>

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

StepPlan plan_step(const train::TrainOptions & options, int world_size, const CostModel & costs, bool sampled) {
    const int64_t microbatches = options.global_batch_size / (options.micro_batch_size * options.parallel.dp());
    train::TrainOptions planned = options;
    int64_t             run     = microbatches;   // M', the micro-batches the stages run
    if (sampled && options.batch_schedule.empty()) {
        run                       = std::min<int64_t>(microbatches, 2 * options.parallel.pp());
        planned.global_batch_size = run * options.micro_batch_size * options.parallel.dp();
    }
    StepPlan plan;
    plan.stages.push_back(plan_rank_memory(planned, world_size, 0, &costs));
    const std::vector<int> ranks = plan.stages.front().pipeline_ranks;
    for (size_t stage = 1; stage < ranks.size(); ++stage) {
        plan.stages.push_back(plan_rank_memory(planned, world_size, ranks[stage], &costs));
    }
    double transfer_s = 0;
    // Each stage's op durations by (forward, chunk, micro-batch run), in ms.
    std::vector<std::map<std::tuple<bool, int, int>, double>> durations(plan.stages.size());
    for (size_t stage = 0; stage < plan.stages.size(); ++stage) {
        const RankMemory & s = plan.stages[stage];
        LOOM_CHECK(s.time.has_value(), "rank " << s.rank << "'s iteration was not timed", "");
        transfer_s = std::max(transfer_s, s.time->transfer_s);
        for (const pipeline::TimelineOp & op : s.time->ops) {
            durations[stage][{op.op.forward, op.op.chunk, op.op.microbatch}] = op.end - op.start;
        }
    }
    // Micro-batch m of the whole schedule is timed by micro-batch `ran(m)` of the run.
    const int64_t head = run / 2, tail = run - head;
    auto          ran  = [&](int m) -> int {
        if (m < head) return m;
        if (m >= microbatches - tail) return static_cast<int>(m - (microbatches - run));
        return static_cast<int>(head - 1);
    };
    pipeline::ScheduleOptions schedule = plan.stages.front().time->schedule;
    schedule.num_microbatches          = static_cast<int>(microbatches);
    plan.timeline = pipeline::simulate_timeline(
        schedule,
        [&](int rank, size_t, const pipeline::ScheduleOp & op) {
            const auto & d  = durations[static_cast<size_t>(rank)];
            auto         it = d.find({op.forward, op.chunk, ran(op.microbatch)});
            LOOM_CHECK(it != d.end(), "stage " << rank << " did not run " << pipeline::op_label(op), "");
            return it->second;
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
