// loom train: train a GPT (the main job), on one rank or data-parallel over the ranks mpirun starts.
//
//   loom train                                   gpt-tiny on the built-in synthetic dataset
//   mpirun -np 4 loom train --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather
//                                                data parallel over 4 ranks (ZeRO-1, both overlaps)
//   loom train --model gpt2-124m --data-path corpus_text_document --micro-batch-size 4 --seq-length 256
//   loom train --load-hf gpt2 --data-path corpus_text_document   fine-tune Hugging Face GPT-2 weights
//
// Prints Megatron's per-iteration line every --log-interval iterations, optionally writes the same keys
// as JSON lines (--log-file), and ends with a summary: tokens/s, achieved TFLOP/s, peak memory by pool.
// Under mpirun every rank is a data-parallel rank (DDP, ddp/ddp.h); only rank 0 prints, and an error on
// any rank stops the whole job. The options are validated for the launched world size before MPI starts,
// and the ranks check that they were launched alike (flags, build, model, data) before any other collective.
// A single process uses DDP's buffers too when a data-parallel flag asks for them.
#include "apps/loom/commands.h"
#include "apps/loom/devices.h"
#include "train/options_parser.h"
#include "backend/cpu/cpu_device.h"
#include "checkpoint/checkpoint.h"
#include "comm/agreement.h"
#include "comm/mpi_communicator.h"
#include "core/error.h"
#include "data/gpt_dataset.h"
#include "ddp/layout.h"
#include "parallel/process_groups.h"
#include "plan/cpu_calibration.h"
#include "plan/memory_plan.h"
#include "plan/step_plan.h"
#include "train/data_source.h"
#include "train/setup.h"
#include "train/trainer.h"

#include <CLI/CLI.hpp>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <optional>

namespace loom::app {

namespace {

// What `loom plan` predicts for this run's rank 0: its memory, and its step on this machine's CPU (`loom plan
// --gpu cpu`: the rates measured before the run) or on a GPU of the plan's table (by the device's name).
struct Planned {
    plan::RankMemory      memory;
    std::optional<double> step_s;
};

// The median of the steps after the warm-up iterations (the first two), or of all where there are no more.
double median_step(std::vector<double> steps) {
    if (steps.size() > 2) steps.erase(steps.begin(), steps.begin() + 2);
    std::sort(steps.begin(), steps.end());
    return steps.empty() ? 0.0 : steps[steps.size() / 2];
}

void print_summary(const train::TrainSummary & s, Device & where, const std::optional<Planned> & plan_of_run) {
    const std::optional<plan::RankMemory> planned = plan_of_run ? std::optional<plan::RankMemory>(plan_of_run->memory)
                                                                : std::nullopt;
    if (s.losses.empty()) {
        std::printf("\ntraining summary: no iterations to run (the checkpoint is at --train-iters already)\n");
        return;
    }
    std::printf("\ntraining summary: %zu iterations (%lld to %lld) in %.1f s | %.0f tokens/s | %.3f TFLOP/s achieved | "
                "lm loss %.4f -> %.4f\n",
                s.losses.size(), static_cast<long long>(s.first_iteration),
                static_cast<long long>(s.first_iteration + static_cast<int64_t>(s.losses.size()) - 1), s.seconds,
                s.tokens_per_second, s.tflops, s.losses.front(), s.losses.back());
    Allocator & device = where.allocator(MemoryKind::device);
    std::printf("peak memory (%s): %.1f MiB allocated, %.1f MiB reserved\n", device.name().c_str(),
                device.stats().peak_allocated / 1048576.0, device.stats().peak_reserved / 1048576.0);
    for (const std::string & pool : device.pool_names()) {
        AllocatorStats p = device.pool_stats(pool);
        std::printf("  %-12s peak %9.1f MiB   in use %9.1f MiB", pool.c_str(), p.peak_allocated / 1048576.0,
                    p.allocated / 1048576.0);
        if (planned && planned->device.count(pool)) std::printf("   planned %9.1f MiB", planned->device.at(pool) / 1048576.0);
        if (planned && planned->iteration_planned && pool == kActivationsPool) {
            std::printf("   planned peak %9.1f MiB", planned->activations_peak / 1048576.0);
        }
        std::printf("\n");
    }
    if (planned && planned->iteration_planned) {   // loom plan's figures for this rank (docs/plan.md)
        std::printf("loom plan predicted for this rank: %.1f MiB held between iterations, %.1f MiB at an iteration's "
                    "peak (the data and evaluation not counted)\n",
                    planned->device_total() / 1048576.0, planned->device_peak_total() / 1048576.0);
    }
    if (plan_of_run && plan_of_run->step_s) {
        std::printf("step time: measured %.4f s (the median of %zu iterations' steps after the first two), loom plan "
                    "predicted %.4f s (x%.2f)\n",
                    median_step(s.step_seconds), s.step_seconds.size() > 2 ? s.step_seconds.size() - 2 : s.step_seconds.size(),
                    *plan_of_run->step_s, median_step(s.step_seconds) / *plan_of_run->step_s);
    }
    if (s.work_end) {   // the backend counts its host work (CUDA)
        const DeviceWork & w = *s.work_end;
        std::printf("%s work: %lld GEMMs through %lld cached cuBLASLt plans (%lld heuristic queries)", where.name().c_str(),
                    static_cast<long long>(w.gemms), static_cast<long long>(w.gemm_plans),
                    static_cast<long long>(w.heuristic_queries));
        if (s.iterations_after_warmup > 0) {
            const DeviceWork & a = *s.work_warm;
            const double       n = static_cast<double>(s.iterations_after_warmup);
            std::printf("; per iteration after warm-up: %.2f host synchronisations, %.2f late reads, %.2f device "
                        "allocations, %.2f heuristic queries",
                        (w.host_syncs - a.host_syncs) / n, (w.late_reads - a.late_reads) / n,
                        (w.device_allocations - a.device_allocations) / n, (w.heuristic_queries - a.heuristic_queries) / n);
        }
        std::printf("; attention: %lld calls through cuDNN's fused attention (%lld plans, %lld shapes refused)\n",
                    static_cast<long long>(w.fused_attention), static_cast<long long>(w.fused_attention_plans),
                    static_cast<long long>(w.fused_attention_refused));
    }
}

// The world size mpirun launched this process into (Open MPI, or a PMI launcher), else 1.
int64_t launched_world_size() {
    for (const char * name : {"OMPI_COMM_WORLD_SIZE", "PMI_SIZE"}) {
        if (const char * value = std::getenv(name)) {
            return std::max(1L, std::strtol(value, nullptr, 10));
        }
    }
    return 1;
}

}  // namespace

static int train_on_this_rank(train::TrainOptions & options, bool vocab_given, comm::MpiContext * mpi);

// Under mpirun, before the first collective: every rank was launched with the same flags (as parsed) and
// build, and resolved the same model (comm/agreement.h). A disagreement ends every rank naming the flags.
static void check_launch_agreement(const train::TrainOptionParser & parser, const train::TrainOptions & options,
                                   comm::MpiContext & mpi) {
    std::vector<comm::Setting> settings = parser.settings(options);
    settings.insert(settings.begin(), comm::Setting{"loom version", LOOM_VERSION});
    comm::check_agreement(*mpi.world(), cpu::device(), settings, "the ranks were launched with different options");
}

int cmd_train(int argc, char ** argv) {
    CLI::App app{"Train a GPT on this rank.", "loom train"};
    train::TrainOptionParser parser(app);
    if (std::optional<int> status = parse_arguments(app, argc, argv)) {
        return *status;
    }
    const int64_t       world   = launched_world_size();
    train::TrainOptions options = parser.resolve(world);
    // 16-bit gradients live in DDP's buffers, as do ZeRO-1's shards: one rank builds them too.
    const bool use_ddp = world > 1 || options.ddp.use_distributed_optimizer || options.ddp.overlap_grad_reduce ||
                         !options.ddp.grad_reduce_in_fp32 || options.print_layout || options.optimizer_cpu_offload;
    std::unique_ptr<comm::MpiContext> mpi;
    if (use_ddp) {
        mpi = std::make_unique<comm::MpiContext>();
        LOOM_CHECK(mpi->world_size() == world, "MPI started " << mpi->world_size() << " ranks, the launcher said " << world, "");
        mpi->set_timeout(static_cast<double>(options.distributed_timeout_minutes) * 60.0);
    }
    if (world == 1) return train_on_this_rank(options, parser.vocab_given(), mpi.get());
    // Under mpirun, anything thrown on one rank stops the job: the other ranks may be waiting for it in a
    // collective, and would wait forever.
    auto stop = [&](const char * what, int status, bool has_rank) {
        if (has_rank) {   // a loom::Error's text starts with its rank
            std::fprintf(stderr, "loom train: %s\n", what);
        } else {
            std::fprintf(stderr, "[rank %d] loom train: %s\n", mpi->world_rank(), what);
        }
        std::fflush(stderr);
        mpi->abort(status);
    };
    try {
        check_launch_agreement(parser, options, *mpi);
        return train_on_this_rank(options, parser.vocab_given(), mpi.get());
    } catch (const train::RerunExit & e) {
        // Every rank reached the same decision (reduced over the world): each ends with its status, no abort.
        if (mpi->world_rank() == 0) std::fprintf(stderr, "loom train: %s\n", e.what());
        return e.code();
    } catch (const RunError & e) {
        stop(e.what(), 1, true);
    } catch (const Error & e) {
        stop(e.what(), kExitBadInput, true);
    } catch (const std::exception & e) {
        stop(e.what(), 1, false);
    } catch (...) {
        stop("an exception that is not a std::exception", 1, false);
    }
    return 1;
}

static int train_on_this_rank(train::TrainOptions & options, bool vocab_given, comm::MpiContext * mpi) {
    // --save is this job's until it ends (checkpoint/checkpoint.h): a second job saving there is refused
    // before it reads any data or trains a step.
    std::optional<checkpoint::SaveFolderLock> save_lock;
    if (!options.save.empty() && (!mpi || mpi->world_rank() == 0)) save_lock.emplace(options.save);
    Device & device = device_for(options.device);
    // Process groups: Megatron's rank order (tp-cp-ep-dp-pp); none in a single process without DDP. On a GPU
    // the groups are NCCL communicators, MPI carrying their ids.
    std::unique_ptr<comm::CommunicatorFactory> nccl;
    if (mpi) nccl = gpu_process_groups(*mpi, device);
    if (nccl) nccl->set_timeout(static_cast<double>(options.distributed_timeout_minutes) * 60.0);
    parallel::ProcessGroups groups;
    if (mpi) {
        // The layout resolve() validated for this world size (train/options.h: TrainOptions::parallel).
        comm::CommunicatorFactory & factory = nccl ? *nccl : static_cast<comm::CommunicatorFactory &>(*mpi);
        groups = parallel::ProcessGroups::create(options.parallel, factory, options.ddp.num_distributed_optimizer_instances,
                                                 options.hierarchical_cp_sizes);
    }
    const int rank = mpi ? mpi->world_rank() : 0;
    FILE *    out  = rank == 0 ? stdout : nullptr;
    std::unique_ptr<train::BatchSource> data = train::make_batch_source(
        options, device, vocab_given, groups.dp ? groups.dp->rank() : 0, options.parallel.dp());
    // Validation batches: --eval-iters batches of --eval-global-batch-size at each of the train_iters / eval_interval + 1
    // evaluations (Megatron's count), from the validation split, with the vocabulary now fixed.
    std::unique_ptr<train::BatchSource> valid;
    // With per-split paths and no --valid-data-path there is nothing to validate on (Megatron's do_valid).
    if (options.eval_interval > 0 && options.eval_iters > 0 &&
        (!options.per_split_data() || !options.valid_data_path.empty())) {
        const int64_t evaluations = options.train_iters / options.eval_interval + 1;
        valid = train::make_batch_source(options, device, true, groups.dp ? groups.dp->rank() : 0,
                                         options.parallel.dp(), data::Split::valid,
                                         evaluations * options.eval_iters * options.eval_global_batch_size);
    }
    // The test split: --eval-iters global batches once after training (Megatron's do_test), where the data
    // has one: a --split with a test weight, --test-data-path, or --mock-data. A test split too small for a
    // sample is reported and skipped (Megatron would have no test data loader for it).
    std::unique_ptr<train::BatchSource> test;
    const bool has_test = options.per_split_data() ? !options.test_data_path.empty()
                          : !options.data_path.empty() ? data::parse_split(options.split)[2] > 0.0
                                                       : options.mock_data;
    if (valid && has_test) {
        try {
            test = train::make_batch_source(options, device, true, groups.dp ? groups.dp->rank() : 0,
                                            options.parallel.dp(), data::Split::test,
                                            options.eval_iters * options.eval_global_batch_size);
        } catch (const Error & e) {
            if (out) std::printf("loom train: the test split is not evaluated: %s\n", e.message().c_str());
        }
    }
    // Context parallelism: each CP rank trains on its two chunks of the same samples.
    const int cp_rank = groups.cp ? groups.cp->rank() : 0, cp_size = options.parallel.cp();
    data = train::context_parallel_part(std::move(data), cp_rank, cp_size, options.model.mtp_num_layers);
    if (valid) valid = train::context_parallel_part(std::move(valid), cp_rank, cp_size);
    if (test) test = train::context_parallel_part(std::move(test), cp_rank, cp_size);
    if (mpi && mpi->world_size() > 1) {
        // The data the flags named is the same on every rank (a path can name different files on two hosts).
        const std::vector<comm::Setting> read = {
            {"training data", data->identity()},
            {"validation data", valid ? valid->identity() : "none"},
            {"test data", test ? test->identity() : "none"},
            {"the vocabulary", std::to_string(options.model.vocab_size)},
        };
        comm::check_agreement(*mpi->world(), cpu::device(), read, "the ranks read different data");
    }
    // What `loom plan` predicts for this run's rank 0 (the same set-up and one iteration on the meta device),
    // set beside the allocator's figures in the summary, with its step where the plan knows the device.
    std::optional<Planned> planned;
    const char *           run_plan = std::getenv("LOOM_RUN_PLAN");   // "0": skip it (README, environment variables)
    if (out && !(run_plan && std::string(run_plan) == "0")) {
        try {
            const int world_size = mpi ? mpi->world_size() : 1;
            // The step is planned on this machine's CPU, or on a GPU of the plan's table; the ranks of this
            // launch share a node (mpirun's local size).
            const std::string gpu = device.type() == DeviceType::cpu ? "cpu" : plan::gpu_for_product(device.product_name());
            if (!gpu.empty()) {
                const plan::PlannedDevice here = plan::planned_device(gpu);
                int64_t per_node = world_size;
                if (const char * local = std::getenv("OMPI_COMM_WORLD_LOCAL_SIZE")) per_node = std::max(1L, std::atol(local));
                const plan::CostModel costs(here.spec, static_cast<int>(per_node), options.model.params_dtype,
                                            here.efficiency);
                const plan::StepPlan  step = plan::plan_step(options, world_size, costs);
                planned = Planned{step.stages.front(), step.step_s};
                if (gpu == "cpu") {
                    std::printf("loom plan predicts for rank 0: a step of %.4f s on this machine (loom plan --gpu cpu: "
                                "%.3g GFLOP/s GEMMs, %.3g GB/s memory, measured now), %.1f MiB held, %.1f MiB at the "
                                "iteration's peak\n",
                                step.step_s, costs.tensor_core_flops() / 1e9, here.spec.hbm_bytes_per_s / 1e9,
                                planned->memory.device_total() / 1048576.0, planned->memory.device_peak_total() / 1048576.0);
                } else {
                    std::printf("loom plan predicts for rank 0: a step of %.4f s on this %s (loom plan --gpu %s), %.1f MiB "
                                "held, %.1f MiB at the iteration's peak\n",
                                step.step_s, device.product_name().c_str(), gpu.c_str(),
                                planned->memory.device_total() / 1048576.0, planned->memory.device_peak_total() / 1048576.0);
                }
            } else {
                planned = Planned{plan::plan_rank_memory(options, world_size, 0), std::nullopt};
            }
        } catch (const Error & e) {
            std::printf("loom train: no plan of this run's memory: %s\n", e.message().c_str());
        } catch (const std::exception & e) {   // the plan is advice: it never stops the run
            std::printf("loom train: no plan of this run's memory: %s\n", e.what());
        }
    }
    train::Setup setup = train::setup(options, groups, device);
    if (out) std::printf("loom train: %s on %s, %lld parameters, %lld layers, hidden %lld, heads %lld, seq %lld, vocab %lld (padded %lld)\n",
                options.model_preset.c_str(), device.name().c_str(), static_cast<long long>(options.model.num_parameters()),
                static_cast<long long>(options.model.num_layers), static_cast<long long>(options.model.hidden_size),
                static_cast<long long>(options.model.num_attention_heads), static_cast<long long>(options.model.seq_length),
                static_cast<long long>(options.model.vocab_size),
                static_cast<long long>(options.model.padded_vocab_size()));
    // The experts' decomposition when it differs from the dense one: world = etp x ep x edp x pp.
    std::string experts;
    const parallel::ParallelConfig & layout = options.parallel;
    if (layout.ep() > 1 || layout.etp() != layout.tp()) {
        experts = ", experts: " + (layout.etp() > 1 ? "etp " + std::to_string(layout.etp()) + " x " : std::string()) +
                  "ep " + std::to_string(layout.ep()) + " x edp " + std::to_string(layout.edp());
    }
    std::string batch = "global batch " + std::to_string(options.global_batch_size);
    if (!options.batch_schedule.empty()) {   // (first sample, batch) pairs
        batch = "global batch by samples consumed:";
        for (const auto & [first, size] : options.batch_schedule) {
            batch += " " + std::to_string(first) + ":" + std::to_string(size);
        }
    }
    const std::string context = layout.cp() > 1 ? ", cp " + std::to_string(layout.cp()) : std::string();
    if (out) std::printf("data: %s | micro-batch %lld, %s, %lld iterations | parallel: tp %lld%s, pp %lld, "
                         "dp %lld%s\n",
                data->describe().c_str(), static_cast<long long>(options.micro_batch_size), batch.c_str(),
                static_cast<long long>(options.train_iters), static_cast<long long>(layout.tp()), context.c_str(),
                static_cast<long long>(layout.pp()), static_cast<long long>(options.parallel.dp()),
                experts.c_str());
    if (out && options.print_layout) {
        std::printf("%s\n", ddp::layout_table(setup.ddp->layout(), setup.ddp->specs(),
                                              options.ddp.use_distributed_optimizer).c_str());
    }
    train::TrainSummary summary;
    {
        train::Trainer trainer(options, setup, *data);
        trainer.set_validation(valid.get());
        trainer.set_test(test.get());
        summary = trainer.run(out);
    }
    if (out) print_summary(summary, device, planned);
    return 0;
}

}  // namespace loom::app
