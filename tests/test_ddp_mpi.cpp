// Data parallelism end to end, under mpirun with 1, 2, 4 and 8 ranks (DP = the world size).
//
// Every rank first trains the reference: the same model on the whole global batch, alone, without DDP.
// Then all ranks train it together with DDP in each configuration (plain; --overlap-grad-reduce; the
// distributed optimizer without and with both overlaps), small buckets so that there are many bucket
// groups, and the loss curve and final parameters must match the reference.
//
// Tolerance. Data parallelism changes only f32 summation order: each rank sums its own micro-batches'
// gradients, and the reduction adds the ranks' sums. Those differences (~1e-7 relative) pass through
// AdamW for 20 steps; losses must agree within 5e-5 and parameters within 5e-5 absolute (the learning
// rate is 2e-3 per step, so a real bug, a lost or doubled gradient, moves them by far more). With one
// rank nothing is reordered, and the DDP run must equal the reference bit for bit.
#include "backend/cpu/cpu_device.h"
#include "comm/counting_communicator.h"
#include "comm/mpi_communicator.h"
#include "ddp/ddp.h"
#include "optim/distributed_optimizer.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include "mpi_test_main.h"
#include "small_gpt.h"

#include <gtest/gtest.h>

#include <cmath>
#include <map>

using namespace loom;

namespace {

comm::MpiContext * g_mpi = nullptr;

train::TrainOptions small_options(int64_t dp, bool muon = false, bool mup = false) {
    train::TrainOptions o = testing_models::small_gpt_options(2, 8, 20);
    o.lr_warmup_iters     = 5;
    if (muon) o.muon.emplace().bf16_matmul = false;   // Muon on the weight matrices, Newton-Schulz in f32
    if (mup) {   // µP at width multiplier 2: the hidden matrices' own lr and eps (as --use-mup resolves them)
        o.model.use_mup              = true;
        o.model.mup_base_hidden_size = o.model.hidden_size / 2;
        o.model.mup_output_mult      = 0.5f;
        o.model.softmax_scale        = 1.0f / static_cast<float>(o.model.head_dim());
    }
    parallel::ParallelSizes sizes;
    sizes.world_size = static_cast<int>(dp);
    o.parallel       = parallel::ParallelConfig::create(sizes);
    return o;
}

struct TrainRun {
    std::vector<double>             losses;
    std::vector<std::vector<float>> params;
};

TrainRun train_model(train::TrainOptions o, std::shared_ptr<comm::Communicator> group) {
    Device & device = cpu::device();
    auto     source = train::make_batch_source(o, device, false, group ? group->rank() : 0, o.parallel.dp());
    model::GptModel gpt(o.model, device);
    gpt.init();
    TrainRun run;
    {
        train::Trainer trainer(o, gpt, *source, group);
        run.losses = trainer.run(nullptr).losses;
    }   // the trainer finishes any pending parameter gather
    for (model::Parameter * p : gpt.parameters()) {
        std::vector<float> v(static_cast<size_t>(p->numel()));
        convert(p->data.data_ptr(), p->data.dtype(), v.data(), DType::f32, v.size());
        run.params.push_back(std::move(v));
    }
    return run;
}

const TrainRun & reference(bool muon = false, bool mup = false) {
    static std::map<std::pair<bool, bool>, TrainRun> runs;
    auto it = runs.find({muon, mup});
    if (it == runs.end()) it = runs.emplace(std::pair{muon, mup}, train_model(small_options(1, muon, mup), nullptr)).first;
    return it->second;
}

struct Config {
    const char * name;
    bool         distopt, overlap_grad, overlap_param;
    bool         average_in_collective = false;
    bool         muon                  = false;
    bool         mup                   = false;
};

void expect_matches_reference(const Config & c) {
    SCOPED_TRACE(c.name);
    int64_t             dp = g_mpi->world_size();
    train::TrainOptions o  = small_options(dp, c.muon, c.mup);
    o.ddp.use_distributed_optimizer = c.distopt;
    o.ddp.overlap_grad_reduce       = c.overlap_grad;
    o.ddp.overlap_param_gather      = c.overlap_param;
    o.ddp.average_in_collective     = c.average_in_collective;
    o.ddp.bucket_size               = 20000;   // several buckets (with overlap; one bucket without)
    TrainRun         run = train_model(o, g_mpi->world());
    const TrainRun & ref = reference(c.muon, c.mup);
    ASSERT_EQ(run.losses.size(), ref.losses.size());
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) {
        worst_loss = std::max(worst_loss, std::fabs(run.losses[i] - ref.losses[i]));
        EXPECT_NEAR(run.losses[i], ref.losses[i], 5e-5) << "iteration " << i + 1;
    }
    ASSERT_EQ(run.params.size(), ref.params.size());
    for (size_t k = 0; k < ref.params.size(); ++k) {
        for (size_t i = 0; i < ref.params[k].size(); ++i) {
            worst_param = std::max(worst_param, static_cast<double>(std::fabs(run.params[k][i] - ref.params[k][i])));
        }
    }
    EXPECT_LT(worst_param, 5e-5);
    if (dp == 1) {
        EXPECT_EQ(run.losses, ref.losses) << "one rank: bitwise the reference";
        EXPECT_EQ(run.params, ref.params) << "one rank: bitwise the reference";
    }
    if (g_mpi->world_rank() == 0) {
        std::printf("[dp %lld %s] worst |loss - reference| %.3g, worst |param - reference| %.3g, final loss %.6f\n",
                    static_cast<long long>(dp), c.name, worst_loss, worst_param, run.losses.back());
    }
}

}  // namespace

TEST(DataParallel, PlainAllReduceMatchesOneRank) { expect_matches_reference({"all-reduce", false, false, false}); }

TEST(DataParallel, OverlappedAllReduceMatchesOneRank) {
    expect_matches_reference({"all-reduce, overlap-grad-reduce", false, true, false});
}

TEST(DataParallel, DistributedOptimizerMatchesOneRank) {
    expect_matches_reference({"distributed optimizer", true, false, false});
}

TEST(DataParallel, DistributedOptimizerWithOverlappedReduceMatchesOneRank) {
    expect_matches_reference({"distributed optimizer, overlap-grad-reduce", true, true, false});
}

TEST(DataParallel, DistributedOptimizerWithBothOverlapsMatchesOneRank) {
    expect_matches_reference({"distributed optimizer, overlap-grad-reduce, overlap-param-gather", true, true, true});
}

// Muon: replicated (each rank orthogonalizes the all-reduced momentum) and with ZeRO-1 (each rank's momentum
// pieces of a matrix summed over DP, the whole matrix orthogonalized, the owned pieces updated).
TEST(DataParallel, MuonMatchesOneRank) {
    expect_matches_reference({"muon", false, false, false, false, true});
    expect_matches_reference({"muon zero-1", true, true, false, false, true});
}

// µP's groups (optim/optimizer.h): each ZeRO-1 piece of a hidden matrix steps with the hidden lr and eps.
TEST(DataParallel, MupDistributedOptimizerMatchesOneRank) {
    expect_matches_reference({"mup zero-1", true, true, false, false, false, true});
}

TEST(DataParallel, AverageInCollectiveMatchesOneRank) {
    expect_matches_reference({"distributed optimizer, average in collective", true, true, false, true});
}

// bf16 parameters with the distributed optimizer against the single-rank bf16 run. The forward is the
// same bf16 computation on both sides and gradients are f32, but the updated weights are rounded to bf16,
// so an f32-order difference that moves a master weight across a rounding boundary changes a weight by
// a bf16 ulp (2^-7 of its binade; two of the smaller ulps where it crosses a power of two): losses agree
// within 2e-3 (measured ~1e-4), weights within 2^-6 of max(1, |w|).
TEST(DataParallel, Bf16DistributedOptimizerMatchesOneRank) {
    int64_t             dp = g_mpi->world_size();
    train::TrainOptions o  = small_options(dp), one = small_options(1);
    o.model.params_dtype = one.model.params_dtype = DType::bf16;
    o.ddp.use_distributed_optimizer = true;
    o.ddp.overlap_grad_reduce       = true;
    o.ddp.bucket_size               = 20000;
    TrainRun run = train_model(o, g_mpi->world()), ref = train_model(one, nullptr);
    double worst_loss = 0, worst_param = 0;
    for (size_t i = 0; i < ref.losses.size(); ++i) worst_loss = std::max(worst_loss, std::fabs(run.losses[i] - ref.losses[i]));
    for (size_t k = 0; k < ref.params.size(); ++k) {
        for (size_t i = 0; i < ref.params[k].size(); ++i) {
            double d = std::fabs(run.params[k][i] - ref.params[k][i]);
            worst_param = std::max(worst_param, d / std::max(1.0, std::fabs(static_cast<double>(ref.params[k][i]))));
        }
    }
    EXPECT_LT(worst_loss, 2e-3);
    EXPECT_LT(worst_param, 0.015625) << "within two bf16 ulps (relative to max(1, |w|))";
    if (dp == 1) {
        EXPECT_EQ(run.params, ref.params) << "one rank: bitwise";
    }
    if (g_mpi->world_rank() == 0) {
        std::printf("[dp %lld bf16 distributed optimizer] worst |loss - reference| %.3g, worst weight difference %.3g\n",
                    static_cast<long long>(dp), worst_loss, worst_param);
    }
}

// One reduce-scatter per bucket group per iteration, issued only by the last micro-batch's backward
// (and, in the first iteration, whose readiness counts are being recorded, only at finish_grad_sync),
// then one all-gather per bucket group after the step.
namespace {

void expect_one_collective_per_group(bool distopt) {
    SCOPED_TRACE(distopt ? "distributed optimizer" : "all-reduce");
    const comm::OpKind reduce = distopt ? comm::OpKind::reduce_scatter : comm::OpKind::all_reduce;
    int64_t             dp = g_mpi->world_size();
    train::TrainOptions o  = small_options(dp);
    o.global_batch_size    = 4 * dp;   // 4 micro-batches per rank
    Device &        device = cpu::device();
    auto            source = train::make_batch_source(o, device, false, g_mpi->world_rank(), dp);
    model::GptModel gpt(o.model, device);
    gpt.init();
    auto counting = std::make_shared<comm::CountingCommunicator>(g_mpi->world());
    ddp::DdpConfig config;
    config.use_distributed_optimizer = distopt;
    config.overlap_grad_reduce       = true;
    config.bucket_size               = 20000;
    ddp::DistributedDataParallel ddp(gpt.parameters(), config, counting, device);
    optim::OptimizerOptions          clipped{optim::AdamWConfig{}, 1.0f, std::nullopt, std::nullopt, {}, 1.0};
    std::unique_ptr<optim::Optimizer> adam;
    if (distopt) {
        adam = std::make_unique<optim::DistributedOptimizer>(ddp, clipped);
    } else {
        adam = std::make_unique<optim::AdamW>(gpt.parameters(), clipped);
    }
    const int64_t groups = ddp.num_bucket_groups();
    ASSERT_GT(groups, 2) << "small buckets make several groups";
    model::GradReadyFn ready = ddp.grad_ready();
    for (int iteration = 1; iteration <= 3; ++iteration) {
        SCOPED_TRACE(iteration);
        counting->reset();
        ddp.zero_grad_buffer();
        for (int k = 0; k < 4; ++k) {
            ddp.set_last_microbatch(k == 3);
            model::GptModel::Context ctx;
            auto loss = gpt.forward(ctx, source->next());
            gpt.backward(ctx, 1.0 / (loss.count * 4), ready);
            int64_t launched = counting->count(reduce).calls;
            if (k < 3) {
                EXPECT_EQ(launched, 0) << "micro-batch " << k << " launched a reduction";
            } else {
                // Overlap: every group launched during the last backward, except in iteration 1.
                EXPECT_EQ(launched, iteration == 1 ? 0 : groups);
            }
        }
        ddp.finish_grad_sync();
        EXPECT_EQ(counting->count(comm::OpKind::reduce_scatter).calls + counting->count(comm::OpKind::all_reduce).calls,
                  groups) << "one reduction per bucket group";
        EXPECT_TRUE(adam->step(1e-3f).stepped);
        ddp.start_param_sync();   // the trainer's GradSync::start_gather
        if (distopt) {
            EXPECT_EQ(counting->count(comm::OpKind::all_gather).calls, groups + 1) << "the parameters, and the grad norm";
        } else {
            // Replicated gradients: the norm and the step need no communication.
            EXPECT_EQ(counting->count(comm::OpKind::all_gather).calls, 0);
        }
        EXPECT_EQ(counting->count(reduce).calls, groups) << "never twice";
    }
}

}  // namespace

TEST(DataParallel, OneCollectivePerBucketGroupPerIterationAndNoneBeforeTheLastMicrobatch) {
    expect_one_collective_per_group(true);
    expect_one_collective_per_group(false);
}



// Bytes per parameter from the allocator's statistics: weights + grads + optimizer state per rank are
// 6 + 12/d (bf16 parameters, distributed optimizer), 18 (bf16, replicated AdamW), 8 + 8/d and 16 (f32),
// and with 16-bit gradient buffers (--grad-reduce-in-bf16, --fp16) 4 + 16/d and 20: 2 of value and 2 of
// gradient per element of the buffers, and per stepped element the f32 master, m, v and the optimizer's f32
// copy of the gradient. Plus exactly the padding the layout implies.
TEST(DataParallel, BytesPerParameterFollowMegatronsTable) {
    const int64_t d      = g_mpi->world_size();
    Device &      device = cpu::device();
    Allocator &   alloc  = device.allocator(MemoryKind::device);
    auto          bytes  = [&] {
        device.compute_stream().synchronize();   // memory is freed in stream order
        return alloc.pool_stats("weights").allocated + alloc.pool_stats("grads").allocated +
               alloc.pool_stats("optimizer").allocated;
    };
    struct Case {
        DType dtype;
        bool  grads16;   // gradient buffers in the parameters' dtype
    };
    for (const auto [dtype, grads16] : {Case{DType::bf16, false}, Case{DType::f32, false}, Case{DType::bf16, true},
                                        Case{DType::f16, true}}) {
        for (bool distopt : {true, false}) {
            SCOPED_TRACE(std::string(dtype_name(dtype)) + (grads16 ? " gradients" : " f32 gradients") +
                         (distopt ? ", distributed optimizer" : ", replicated"));
            int64_t before = bytes();
            {
                train::TrainOptions o = small_options(d);
                o.model.params_dtype  = dtype;
                o.model.hidden_size     = 48;    // 48-element biases and norms: 64-alignment padding
                o.model.ffn_hidden_size = 200;
                model::GptModel gpt(o.model, device);
                gpt.init();
                const int64_t n = o.model.num_parameters();
                ddp::DdpConfig config;
                config.use_distributed_optimizer = distopt;
                config.grad_reduce_in_fp32       = !grads16;
                ddp::DistributedDataParallel ddp(gpt.parameters(), config, g_mpi->world(), device);
                int64_t padded = 0;
                for (const ddp::BufferLayout & b : ddp.layout().buffers) {
                    padded += b.numel;
                    EXPECT_EQ(b.grad_dtype, grads16 ? dtype : DType::f32);
                }
                const int64_t w = static_cast<int64_t>(dtype_size(dtype));
                const int64_t g = grads16 ? w : 4;                          // a buffer's gradient element
                // per stepped element: master, m, v (16-bit values), and the gradient's f32 copy
                const int64_t state = (dtype == DType::f32 ? 8 : 12) + (grads16 ? 4 : 0);
                int64_t       expected;
                double        per_param;
                if (distopt) {
                    optim::DistributedOptimizer adam(ddp, optim::OptimizerOptions{});
                    expected  = (w + g) * padded + state * adam.owned_numel();
                    per_param = dtype == DType::f32 ? 8.0 + 8.0 / d : grads16 ? 4.0 + 16.0 / d : 6.0 + 12.0 / d;   // the table
                    // Owned elements: this rank's shards minus the padding inside them.
                    EXPECT_LE(adam.owned_numel(), padded / d);
                    EXPECT_EQ(bytes() - before, expected);
                    double measured = static_cast<double>(bytes() - before) / static_cast<double>(n);
                    // The only slack is padding: (w + 4) bytes per padded element plus at most
                    // state x (padded / d - n / d) for an uneven split of the shards.
                    double slack = static_cast<double>((w + g + state) * (padded - n) + state * d) / static_cast<double>(n);
                    EXPECT_NEAR(measured, per_param, slack);
                    if (g_mpi->world_rank() == 0) {
                        std::printf("[d %lld %s, %s gradients, distributed] %.4f bytes/param (table %.4f), padding %lld of %lld\n",
                                    static_cast<long long>(d), dtype_name(dtype), grads16 ? dtype_name(dtype) : "f32",
                                    measured, per_param,
                                    static_cast<long long>(padded - n), static_cast<long long>(n));
                    }
                } else {
                    optim::AdamW adam(gpt.parameters(), optim::AdamWConfig{});
                    EXPECT_EQ(padded, n) << "no padding without the distributed optimizer";
                    expected  = (w + g + state) * n;
                    per_param = dtype == DType::f32 ? 16.0 : grads16 ? 20.0 : 18.0;   // the table
                    EXPECT_EQ(bytes() - before, expected);
                    EXPECT_DOUBLE_EQ(static_cast<double>(bytes() - before) / static_cast<double>(n), per_param);
                }
            }
            EXPECT_EQ(bytes(), before) << "everything is returned";
        }
    }
}

// The offload order under the distributed optimizer (docs/design/ddp_and_optimizers.md 2.3, 3.2): the
// default-weight-decay group's pieces before the no-decay group's (biases, norms), so a fraction offloads weight-matrix
// pieces first.
TEST(DataParallel, CpuOffloadTakesTheDecayGroupsPiecesFirst) {
    Device &            device = cpu::device();
    train::TrainOptions o      = small_options(g_mpi->world_size());
    o.model.params_dtype       = DType::bf16;
    model::GptModel gpt(o.model, device);
    gpt.init();
    ddp::DdpConfig config;
    config.use_distributed_optimizer = true;
    ddp::DistributedDataParallel ddp(gpt.parameters(), config, g_mpi->world(), device);
    optim::OptimizerOptions options;
    options.offload = optim::HybridOptions{};
    options.offload->offload_fraction = 0.3f;
    optim::DistributedOptimizer adam(ddp, options);
    const std::vector<int> &    slots = adam.slot_params();
    ASSERT_EQ(static_cast<int>(slots.size()), adam.state().num_slots());
    bool seen_no_decay = false;
    for (size_t i = 0; i < slots.size(); ++i) {
        bool no_decay = ddp.params()[slots[i]]->no_weight_decay;
        EXPECT_FALSE(seen_no_decay && !no_decay) << "a decay piece after a no-decay one at slot " << i;
        seen_no_decay = seen_no_decay || no_decay;
        if (adam.state().slot_state(static_cast<int>(i)).offloaded) {
            EXPECT_FALSE(no_decay) << "f = 0.3 offloads only weight-matrix pieces here";
            EXPECT_TRUE(i == 0 || adam.state().slot_state(static_cast<int>(i) - 1).offloaded) << "a prefix";
        }
    }
    EXPECT_GT(adam.state().num_offloaded(), 0);
}

// A non-finite local gradient stops every rank before the collective, naming the rank and parameter.
TEST(DataParallel, NanGradientIsCaughtBeforeTheReductionNamingTheParameter) {
    Device &            device = cpu::device();
    train::TrainOptions o      = small_options(g_mpi->world_size());
    model::GptModel     gpt(o.model, device);
    gpt.init();
    ddp::DdpConfig config;
    config.check_for_nan_in_grad = true;
    ddp::DistributedDataParallel ddp(gpt.parameters(), config, g_mpi->world(), device);
    ddp.zero_grad_buffer();
    device.compute_stream().synchronize();   // the zeroing is stream work: let it run before the host writes
    model::Parameter * victim = gpt.parameters()[3];
    victim->main_grad.data<float>()[5] = NAN;
    try {
        ddp.finish_grad_sync();
        FAIL() << "no error for a NaN gradient";
    } catch (const Error & e) {
        std::string what = e.what();
        EXPECT_NE(what.find(victim->name), std::string::npos) << what;
        EXPECT_NE(what.find("rank " + std::to_string(g_mpi->world_rank())), std::string::npos) << what;
    }
}


// --optimizer-cpu-offload inside the distributed optimizer: each rank offloads a prefix of its own shard
// pieces; losses and final weights are bitwise those of the same data-parallel run without offload, for
// fractions 0, 0.3, 0.5 and 1, with and without overlap, bf16 and f32. Each rank's optimizer pool moves
// 12 (bf16) or 8 (f32) bytes per offloaded element from the device allocator, and its pinned host pool
// gains 16 (master, m, v, pinned gradient).
TEST(DataParallel, DistributedOptimizerWithCpuOffloadIsBitwiseTheRunWithout) {
    int64_t  dp     = g_mpi->world_size();
    Device & device = cpu::device();
    auto     bytes  = [&](MemoryKind kind) {
        device.compute_stream().synchronize();   // memory is freed in stream order
        return device.allocator(kind).pool_stats("optimizer").allocated;
    };
    for (DType dtype : {DType::bf16, DType::f32}) {
        SCOPED_TRACE(dtype_name(dtype));
        train::TrainOptions base = small_options(dp);
        base.model.params_dtype         = dtype;
        base.ddp.use_distributed_optimizer = true;
        base.ddp.overlap_grad_reduce    = true;
        base.ddp.bucket_size            = 20000;
        const int64_t dev0 = bytes(MemoryKind::device);
        TrainRun      ref  = train_model(base, g_mpi->world());
        ASSERT_EQ(bytes(MemoryKind::device), dev0) << "the optimizer state is freed with the trainer";
        // Each fraction once, the overlap on for two of them and off for the other two.
        const std::pair<float, bool> cases[] = {{0.0f, true}, {0.3f, false}, {0.5f, true}, {1.0f, false}};
        for (auto [fraction, overlap] : cases) {
            SCOPED_TRACE("fraction " + std::to_string(fraction) + (overlap ? " overlap" : ""));
            train::TrainOptions o      = base;
            o.optimizer_cpu_offload    = true;
            o.offload.offload_fraction = fraction;
            o.offload.overlap_d2h_h2d  = overlap;
            TrainRun run = train_model(o, g_mpi->world());
            EXPECT_EQ(run.losses, ref.losses);
            EXPECT_EQ(run.params, ref.params);
        }
        // Memory, with a trainer alive: fraction 1 moves this rank's whole shard (`owned` elements, measured
        // from the plain distributed optimizer's state) to the pinned host allocator.
        int64_t owned = 0;
        for (float fraction : {0.0f, 1.0f}) {
            train::TrainOptions o      = base;
            o.optimizer_cpu_offload    = fraction > 0;
            o.offload.offload_fraction = fraction;
            auto            source = train::make_batch_source(o, device, false, g_mpi->world_rank(), dp);
            model::GptModel gpt(o.model, device);
            gpt.init();
            const int64_t  d0 = bytes(MemoryKind::device), h0 = bytes(MemoryKind::pinned_host);
            train::Trainer trainer(o, gpt, *source, g_mpi->world());
            const int64_t  dev = bytes(MemoryKind::device) - d0, host = bytes(MemoryKind::pinned_host) - h0;
            if (fraction == 0.0f) {
                owned = dev / (dtype == DType::bf16 ? 12 : 8);
                EXPECT_EQ(dev % (dtype == DType::bf16 ? 12 : 8), 0);
                EXPECT_GT(owned, 0);
                EXPECT_EQ(host, 0);
            } else {
                EXPECT_EQ(dev, 0) << "fraction 1 leaves no optimizer state on the device";
                EXPECT_EQ(host, 16 * owned);
            }
        }
    }
}

int main(int argc, char ** argv) { return testing_mpi::run_all_tests_under_mpi(argc, argv, &g_mpi); }
