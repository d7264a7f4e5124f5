// `loom plan`'s memory against the real run, under mpirun with 1, 2 and 4 ranks: for a grid of layouts at
// this world size (DP with and without the distributed optimizer, bf16 and f16 gradient buffers, TP with
// sequence parallelism, PP with virtual stages, CP, EP with the MoE model, Megatron-FSDP), every rank sets up
// on the CPU as `loom train` does and compares the bytes its allocator holds per pool, "weights", "grads" and
// "optimizer", with plan::plan_rank_memory's for the same rank, built on the meta device. Equal, to the
// byte: the plan allocates by the same code. Not in the grid: an offloaded optimizer, whose host state a GPU
// run keeps in pageable memory and the CPU in its device pools (the plan follows the GPU).
#include "backend/cpu/cpu_device.h"
#include "parallel/process_groups.h"
#include "plan/memory_plan.h"
#include "train/megatron_flags.h"
#include "train/options_parser.h"
#include "train/setup.h"

#include "mpi_test_main.h"

#include <gtest/gtest.h>

#include <CLI/CLI.hpp>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

constexpr const char * kPools[] = {"weights", "grads", "optimizer"};

// `loom train ARGS` (or with plan_only, `loom plan ARGS`) parsed and resolved as the commands do.
train::TrainOptions parse_train(const std::vector<std::string> & args, int64_t world_size, bool plan_only = false) {
    CLI::App                  app{"test", "loom train"};
    train::TrainOptionParser  parser(app);
    if (plan_only) parser.plan_only();
    std::vector<const char *> argv{"train"};
    for (const std::string & a : args) argv.push_back(a.c_str());
    train::check_option_values(app, static_cast<int>(argv.size()), argv.data());
    app.parse(static_cast<int>(argv.size()), argv.data());
    return parser.resolve(world_size);
}

std::map<std::string, int64_t> held(Allocator & allocator) {
    std::map<std::string, int64_t> bytes;
    for (const char * pool : kPools) bytes[pool] = allocator.pool_stats(pool).allocated;
    return bytes;
}

void expect_plan_is_the_run(const std::string & flags) {
    SCOPED_TRACE(flags);
    const int world = g_mpi->world_size(), rank = g_mpi->world_rank();
    std::vector<std::string> args{"--mock-data", "--num-layers", "4", "--hidden-size", "64", "--num-attention-heads", "4",
                                  "--seq-length", "32", "--max-position-embeddings", "32", "--micro-batch-size", "1",
                                  "--global-batch-size", "8", "--vocab-size", "1000"};
    std::stringstream in(flags);
    for (std::string word; in >> word;) args.push_back(word);
    const train::TrainOptions options = parse_train(args, world);

    Device &    device    = cpu::device();
    Allocator & allocator = device.allocator(MemoryKind::device);
    device.compute_stream().synchronize();
    const std::map<std::string, int64_t> before = held(allocator);
    std::map<std::string, int64_t>       real;
    {
        const parallel::ProcessGroups groups = parallel::ProcessGroups::create(
            options.parallel, *g_mpi, options.ddp.num_distributed_optimizer_instances, options.hierarchical_cp_sizes);
        const train::Setup setup = train::setup(options, groups, device);
        device.compute_stream().synchronize();
        for (const auto & [pool, bytes] : held(allocator)) real[pool] = bytes - before.at(pool);
    }
    const plan::RankMemory planned = plan::plan_rank_memory(options, world, rank);
    for (const char * pool : kPools) {
        auto it = planned.device.find(pool);
        EXPECT_EQ(it == planned.device.end() ? 0 : it->second, real[pool]) << "rank " << rank << ", pool " << pool;
    }
    EXPECT_GT(real["weights"], 0);
    if (rank == 0) {
        std::printf("[%d ranks: %s] rank 0 holds weights %lld, grads %lld, optimizer %lld bytes, as planned\n", world,
                    flags.c_str(), static_cast<long long>(real["weights"]), static_cast<long long>(real["grads"]),
                    static_cast<long long>(real["optimizer"]));
    }
}

}  // namespace

TEST(Plan, OneRankHoldsWhatItsPlanSays) {
    if (g_mpi->world_size() != 1) GTEST_SKIP() << "runs with 1 rank";
    for (const char * flags : {"", "--bf16", "--bf16 --grad-reduce-in-bf16", "--fp16 --loss-scale 1024",
                               "--bf16 --use-distributed-optimizer --overlap-grad-reduce",
                               "--untie-embeddings-and-output-weights --swiglu --normalization RMSNorm --disable-bias-linear"}) {
        expect_plan_is_the_run(flags);
    }
}

TEST(Plan, TwoRanksHoldWhatTheirPlansSay) {
    if (g_mpi->world_size() != 2) GTEST_SKIP() << "runs with 2 ranks";
    for (const char * flags : {"--use-distributed-optimizer", "--bf16 --use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather",
                               "--bf16 --grad-reduce-in-bf16 --use-distributed-optimizer",
                               "--tensor-model-parallel-size 2 --sequence-parallel",
                               "--pipeline-model-parallel-size 2", "--context-parallel-size 2",
                               "--num-experts 4 --expert-model-parallel-size 2 --disable-bias-linear --use-distributed-optimizer",
                               "--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params --no-gradient-accumulation-fusion"}) {
        expect_plan_is_the_run(flags);
    }
}

TEST(Plan, FourRanksHoldWhatTheirPlansSay) {
    if (g_mpi->world_size() != 4) GTEST_SKIP() << "runs with 4 ranks";
    for (const char * flags : {"--tensor-model-parallel-size 2 --sequence-parallel --use-distributed-optimizer --bf16",
                               "--pipeline-model-parallel-size 2 --num-layers-per-virtual-pipeline-stage 1 --use-distributed-optimizer",
                               "--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2",
                               "--num-experts 4 --expert-model-parallel-size 2 --disable-bias-linear --bf16 --use-distributed-optimizer"}) {
        expect_plan_is_the_run(flags);
    }
}

// The plan holds a model no machine here could: GPT-3 175B's shapes at TP 8 x PP 8, its first-stage rank's
// values, gradients and Adam state planned without the memory (address space reserved, never touched).
TEST(Plan, PlansAModelFarLargerThanThisMachine) {
    if (g_mpi->world_size() != 1) GTEST_SKIP() << "runs with 1 rank";
    const train::TrainOptions options = parse_train(
        {"--mock-data", "--num-layers", "96", "--hidden-size", "12288", "--num-attention-heads", "96", "--seq-length", "2048",
         "--max-position-embeddings", "2048", "--micro-batch-size", "1", "--global-batch-size", "1536", "--vocab-size",
         "50257", "--bf16", "--tensor-model-parallel-size", "8", "--pipeline-model-parallel-size", "8",
         "--use-distributed-optimizer"},
        64 * 8, /*plan_only=*/true);
    const plan::RankMemory plan = plan::plan_rank_memory(options, 64 * 8, 0);
    // 175B / 64 model-parallel ranks: about 2.7B values in bf16 (5.5 GB) and gradients in f32 (11 GB) per rank.
    const double params = static_cast<double>(plan.device.at("weights")) / 2.0;
    EXPECT_GT(params, 2.6e9);
    EXPECT_LT(params, 3.0e9);
    EXPECT_EQ(plan.device.at("grads"), plan.device.at("weights") * 2) << "f32 gradients of bf16 values";
    std::printf("[GPT-3 175B, TP 8 x PP 8 x DP 8, rank 0] %.2f GB of weights, %.2f GB of gradients, %.2f GB of optimizer state\n",
                plan.device.at("weights") / 1e9, plan.device.at("grads") / 1e9, plan.device.at("optimizer") / 1e9);
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
