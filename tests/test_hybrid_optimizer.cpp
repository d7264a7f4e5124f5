// HybridDeviceOptimizer: the split rule, bitwise equality with AdamW for every offload fraction with and
// without overlap, the memory moved from the device allocator to the pinned host allocator, and one test
// per hazard of docs/design/ddp_and_optimizers.md section 3.7 (each would fail with the upstream behaviour it
// names); then the Trainer with --optimizer-cpu-offload against the same run without it.
// Tolerance everywhere: none (bitwise), unless stated.
#include "backend/cpu/cpu_device.h"
#include "optim/adamw.h"
#include "core/host_adam.h"
#include "optim/hybrid_optimizer.h"
#include "train/data_source.h"
#include "train/trainer.h"

#include "small_gpt.h"

#include <gtest/gtest.h>

#include <chrono>
#include <cstdlib>
#include <cmath>
#include <cstring>
#include <thread>

using namespace loom;

namespace {

// A small "model": bf16 matrices and f32 vectors, as --bf16 GPT has them (sizes not multiples of anything).
std::vector<model::Parameter> make_params(Device & device) {
    const std::vector<std::pair<int64_t, DType>> spec = {
        {3000, DType::bf16}, {77, DType::f32}, {5000, DType::bf16}, {129, DType::f32}, {4096, DType::bf16},
        {1000, DType::f32},  {2500, DType::bf16}, {31, DType::f32}};
    std::vector<model::Parameter> params;
    for (size_t k = 0; k < spec.size(); ++k) {
        model::Parameter p = model::parameter_create("p" + std::to_string(k), {spec[k].first}, spec[k].second, device);
        p.no_weight_decay  = spec[k].second == DType::f32;
        std::vector<float> init(static_cast<size_t>(spec[k].first));
        for (size_t i = 0; i < init.size(); ++i) init[i] = 0.5f * std::sin(0.013f * i + static_cast<float>(k));
        convert(init.data(), DType::f32, p.data.data_ptr(), p.data.dtype(), init.size());
        params.push_back(std::move(p));
    }
    return params;
}

void fill_grads(std::vector<model::Parameter> & params, int step) {
    for (size_t k = 0; k < params.size(); ++k) {
        float * g = params[k].main_grad.data<float>();
        for (int64_t i = 0; i < params[k].numel(); ++i) {
            g[i] = std::cos(0.37f * static_cast<float>(i) * step + static_cast<float>(k)) * 1e-2f;
        }
    }
}

std::vector<optim::HybridSlot> slots_of(std::vector<model::Parameter> & params, float wd) {
    std::vector<optim::HybridSlot> slots;
    for (model::Parameter & p : params) {
        slots.push_back(optim::HybridSlot{p.data.flatten(), p.main_grad.flatten(), p.no_weight_decay ? 0.0f : wd});
    }
    return slots;
}

bool same_bits(const Tensor & a, const Tensor & b) {
    return a.nbytes() == b.nbytes() && std::memcmp(a.data_ptr(), b.data_ptr(), a.nbytes()) == 0;
}

float lr_at(int step) { return 1e-2f * (1.0f + 0.1f * static_cast<float>(step % 3)); }

}  // namespace

TEST(HybridSplit, OffloadsAPrefixUntilTheFractionOvershootingByAtMostOneSlot) {
    const std::vector<int64_t> n = {10, 20, 30, 40};
    EXPECT_EQ(optim::hybrid_offload_split(n, 0.0), (std::vector<bool>{false, false, false, false}));
    EXPECT_EQ(optim::hybrid_offload_split(n, 0.3), (std::vector<bool>{true, true, false, false}));    // 30 >= 30
    EXPECT_EQ(optim::hybrid_offload_split(n, 0.35), (std::vector<bool>{true, true, true, false}));    // 60 > 35
    EXPECT_EQ(optim::hybrid_offload_split(n, 0.05), (std::vector<bool>{true, false, false, false}));  // 10 > 5
    EXPECT_EQ(optim::hybrid_offload_split(n, 1.0), (std::vector<bool>{true, true, true, true}));
    EXPECT_THROW(optim::hybrid_offload_split(n, 1.5), Error);
    EXPECT_THROW(optim::hybrid_offload_split(n, -0.1), Error);
}

class HybridMatchesAdamW : public ::testing::TestWithParam<std::tuple<float, bool>> {};

TEST_P(HybridMatchesAdamW, BitwiseOverTwentyStepsForEveryFractionWithAndWithoutOverlap) {
    const auto [fraction, overlap] = GetParam();
    Device &   device              = cpu::device();
    optim::AdamWConfig config;
    config.weight_decay = 0.1f;

    std::vector<model::Parameter> ref = make_params(device);
    std::vector<model::Parameter> hyb = make_params(device);
    std::vector<model::Parameter *> ref_ptrs;
    for (model::Parameter & p : ref) ref_ptrs.push_back(&p);
    optim::AdamW adamw(ref_ptrs, config);
    optim::HybridOptions options;
    options.offload_fraction = fraction;
    options.overlap_d2h_h2d  = overlap;
    optim::HybridDeviceOptimizer hdo(device, slots_of(hyb, config.weight_decay), config, options);
    if (fraction == 0.0f) {
        EXPECT_EQ(hdo.num_offloaded(), 0);
    }
    if (fraction == 1.0f) {
        EXPECT_EQ(hdo.num_offloaded(), hdo.num_slots());
    }
    EXPECT_EQ(hdo.num_host_groups(), overlap ? hdo.num_offloaded() : (hdo.num_offloaded() > 0 ? 1 : 0));

    for (int step = 1; step <= 20; ++step) {
        fill_grads(ref, step);
        fill_grads(hyb, step);
        adamw.step(lr_at(step));
        device.compute_stream().synchronize();   // the reference update is compute-stream work
        hdo.step(lr_at(step));
        for (size_t k = 0; k < ref.size(); ++k) {
            ASSERT_TRUE(same_bits(ref[k].data, hyb[k].data)) << "param " << k << " after step " << step;
        }
    }
    EXPECT_EQ(hdo.steps(), 20);
    // The state view: m and v equal AdamW's on whichever side they live.
    for (int k = 0; k < hdo.num_slots(); ++k) {
        optim::HybridSlotState s = hdo.slot_state(k);
        EXPECT_EQ(s.offloaded, k < hdo.num_offloaded());
        if (ref[static_cast<size_t>(k)].data.dtype() == DType::f32) {
            EXPECT_EQ(std::memcmp(s.master.data_ptr(), ref[static_cast<size_t>(k)].data.data_ptr(), s.numel * 4), 0);
        }
    }
}

INSTANTIATE_TEST_SUITE_P(Fractions, HybridMatchesAdamW,
                         ::testing::Combine(::testing::Values(0.0f, 0.3f, 0.5f, 1.0f), ::testing::Bool()));

TEST(HybridMemory, EachOffloadedBf16ElementMoves12DeviceBytesTo16PinnedHostBytes) {
    // Counted: the `allocated` bytes of the "optimizer" pool of the device and of the pinned host
    // allocator (bytes requested, so exact: no size-class slack). Device side: master + m + v (12 B) per
    // bf16 element, m + v (8 B) per f32 element. Host side: master, m, v and the pinned grad buffer (16 B)
    // per element whatever its dtype.
    Device & device = cpu::device();
    auto     bytes  = [&](MemoryKind kind) {
        device.compute_stream().synchronize();   // memory is freed in stream order
        return device.allocator(kind).pool_stats("optimizer").allocated;
    };
    std::vector<model::Parameter> params = make_params(device);
    int64_t bf16 = 0, f32 = 0;
    for (model::Parameter & p : params) (p.data.dtype() == DType::bf16 ? bf16 : f32) += p.numel();

    for (float fraction : {0.0f, 0.5f, 1.0f}) {
        for (bool pin_grads : {true, false}) {
            const int64_t dev0 = bytes(MemoryKind::device), host0 = bytes(MemoryKind::pinned_host);
            optim::HybridOptions options;
            options.offload_fraction = fraction;
            options.pin_cpu_grads    = pin_grads;
            optim::HybridDeviceOptimizer hdo(device, slots_of(params, 0.1f), {}, options);
            int64_t off_bf16 = 0, off_f32 = 0;
            for (int k = 0; k < hdo.num_slots(); ++k) {
                if (!hdo.slot_state(k).offloaded) continue;
                (params[static_cast<size_t>(k)].data.dtype() == DType::bf16 ? off_bf16 : off_f32) += params[static_cast<size_t>(k)].numel();
            }
            EXPECT_EQ(bytes(MemoryKind::device) - dev0, 12 * (bf16 - off_bf16) + 8 * (f32 - off_f32)) << fraction;
            EXPECT_EQ(bytes(MemoryKind::pinned_host) - host0, (pin_grads ? 16 : 12) * (off_bf16 + off_f32)) << fraction;
            if (fraction == 1.0f) {
                EXPECT_EQ(bytes(MemoryKind::device) - dev0, 0);
            }
        }
    }
    // --no-pin-cpu-params: master, m, v in pageable memory, only the pinned grad buffer counts.
    const int64_t host0 = bytes(MemoryKind::pinned_host);
    optim::HybridOptions options;
    options.offload_fraction = 1.0f;
    options.pin_cpu_params   = false;
    optim::HybridDeviceOptimizer hdo(device, slots_of(params, 0.1f), {}, options);
    EXPECT_EQ(bytes(MemoryKind::pinned_host) - host0, 4 * (bf16 + f32));
}

// Hazard (a): the device part must run after the work on the caller's stream that produces (casts,
// scales) the gradients. Upstream cast on d2h and stepped the device part on current with no wait; a
// device step started before the caller's stream finished reads the old gradients here.
TEST(HybridHazards, A_DeviceStepIsOrderedAfterTheCallersGradientWork) {
    Device & device = cpu::device();
    for (float fraction : {0.0f, 0.5f}) {
        std::vector<model::Parameter> ref = make_params(device), hyb = make_params(device);
        std::vector<model::Parameter *> ptrs;
        for (model::Parameter & p : ref) ptrs.push_back(&p);
        optim::AdamW                 adamw(ptrs, optim::AdamWConfig{});
        optim::HybridOptions         options;
        options.offload_fraction = fraction;
        options.overlap_d2h_h2d  = true;
        // Unbounded queues: the host must get every H2D copy enqueued behind the sleep and return, so that a
        // reader without the wait runs while they are still pending (cpu_stream.h bounds run-ahead to 16).
        setenv("LOOM_STREAM_QUEUE_DEPTH", "1000000", 1);
        optim::HybridDeviceOptimizer hdo(device, slots_of(hyb, 0.01f), {}, options);
        std::unique_ptr<Stream>      current = device.stream_create("compute");
        unsetenv("LOOM_STREAM_QUEUE_DEPTH");
        for (int step = 1; step <= 3; ++step) {
            fill_grads(ref, step);
            adamw.step(1e-2f);
            device.compute_stream().synchronize();   // the reference update is compute-stream work
            for (model::Parameter & p : hyb) p.main_grad.fill_zero();
            // The gradients arrive late, on the caller's stream.
            current->submit([&hyb, step] {
                std::this_thread::sleep_for(std::chrono::milliseconds(30));
                fill_grads(hyb, step);
            });
            hdo.step(1e-2f, current.get());
            current->synchronize();
            for (size_t k = 0; k < ref.size(); ++k) {
                ASSERT_TRUE(same_bits(ref[k].data, hyb[k].data)) << "f " << fraction << " param " << k << " step " << step;
            }
        }
    }
}

// Hazard (b): every slot, device-resident or offloaded, f32 or bf16, reads the one gradient the caller set
// (DistOpt's decoupled grad). Upstream, device-resident native-f32 params looked at `.grad` only and were
// skipped; here a gradient re-pointed with set_grad must reach every kind of slot.
TEST(HybridHazards, B_EverySlotReadsTheSameGradientSource) {
    Device & device = cpu::device();
    std::vector<model::Parameter> ref = make_params(device), hyb = make_params(device);
    std::vector<model::Parameter *> ptrs;
    for (model::Parameter & p : ref) ptrs.push_back(&p);
    optim::AdamW         adamw(ptrs, optim::AdamWConfig{});
    optim::HybridOptions options;
    options.offload_fraction = 0.5f;
    // Slots start without gradients; the "decoupled" gradients are separate tensors bound afterwards.
    std::vector<optim::HybridSlot> slots = slots_of(hyb, 0.01f);
    for (optim::HybridSlot & s : slots) s.grad = Tensor();
    optim::HybridDeviceOptimizer hdo(device, slots, {}, options);
    std::vector<Tensor> decoupled;
    for (model::Parameter & p : hyb) decoupled.push_back(Tensor::zeros({p.numel()}, DType::f32, device));
    bool device_f32 = false, host_f32 = false;
    for (int k = 0; k < hdo.num_slots(); ++k) {
        hdo.set_grad(k, decoupled[static_cast<size_t>(k)]);
        bool f32 = hyb[static_cast<size_t>(k)].data.dtype() == DType::f32;
        (hdo.slot_state(k).offloaded ? host_f32 : device_f32) |= f32;
    }
    ASSERT_TRUE(device_f32 && host_f32) << "the test needs f32 slots on both sides";
    for (int step = 1; step <= 3; ++step) {
        fill_grads(ref, step);
        adamw.step(1e-2f);
        device.compute_stream().synchronize();   // the reference update is compute-stream work
        fill_grads(hyb, step);
        for (size_t k = 0; k < hyb.size(); ++k) decoupled[k].copy_from(hyb[k].main_grad.flatten());
        for (model::Parameter & p : hyb) p.main_grad.fill_zero();   // `.grad` is stale/zero: must not be used
        hdo.step(1e-2f);
        for (size_t k = 0; k < ref.size(); ++k) ASSERT_TRUE(same_bits(ref[k].data, hyb[k].data)) << k << " " << step;
    }
}

// Hazard (c): a slot with no gradient this step is not updated. Upstream kept the host gradient buffer of
// the previous step bound and stepped with it again.
TEST(HybridHazards, C_ASlotWithoutGradientIsNotUpdatedWithTheStaleOne) {
    Device & device = cpu::device();
    for (bool overlap : {false, true}) {
        std::vector<model::Parameter> hyb = make_params(device);
        optim::HybridOptions          options;
        options.offload_fraction = 0.5f;
        options.overlap_d2h_h2d  = overlap;
        optim::HybridDeviceOptimizer hdo(device, slots_of(hyb, 0.01f), {}, options);
        fill_grads(hyb, 1);
        hdo.step(1e-2f);
        const int host = 0, dev = hdo.num_slots() - 1;   // one slot on each side
        ASSERT_TRUE(hdo.slot_state(host).offloaded);
        ASSERT_FALSE(hdo.slot_state(dev).offloaded);
        std::vector<std::vector<float>> before;
        std::vector<Tensor>             values;
        for (int k : {host, dev}) {
            optim::HybridSlotState s = hdo.slot_state(k);
            before.push_back(values_f32(s.master));
            before.push_back(values_f32(s.exp_avg));
            before.push_back(values_f32(s.exp_avg_sq));
            Tensor copy = Tensor::empty({hyb[static_cast<size_t>(k)].numel()}, hyb[static_cast<size_t>(k)].data.dtype(), device);
            copy.copy_from(hyb[static_cast<size_t>(k)].data.flatten());
            values.push_back(copy);
            hdo.set_grad(k, Tensor());
        }
        fill_grads(hyb, 2);
        hdo.step(1e-2f);
        size_t j = 0;
        for (int k : {host, dev}) {
            optim::HybridSlotState s = hdo.slot_state(k);
            EXPECT_EQ(std::memcmp(s.master.data_ptr(), before[j].data(), s.numel * 4), 0) << "master of slot " << k;
            EXPECT_EQ(std::memcmp(s.exp_avg.data_ptr(), before[j + 1].data(), s.numel * 4), 0) << "m of slot " << k;
            EXPECT_EQ(std::memcmp(s.exp_avg_sq.data_ptr(), before[j + 2].data(), s.numel * 4), 0) << "v of slot " << k;
            EXPECT_TRUE(same_bits(values[j / 3], hyb[static_cast<size_t>(k)].data.flatten())) << "values of slot " << k;
            j += 3;
        }
    }
}

// Hazard (d): one step counter. After a checkpoint load sets it to 5, every part (device and host) steps
// with bias corrections of steps 6 and 7; upstream reset the device part's counter to the checkpoint's on
// every step, so its second step would repeat step 6's correction.
TEST(HybridHazards, D_OneStepCounterForEveryPart) {
    Device & device = cpu::device();
    std::vector<model::Parameter> hyb = make_params(device);
    std::vector<model::Parameter> ref = make_params(device);
    optim::HybridOptions          options;
    options.offload_fraction = 0.5f;
    options.overlap_d2h_h2d  = true;
    optim::AdamWConfig           config;
    optim::HybridDeviceOptimizer hdo(device, slots_of(hyb, 0.01f), config, options);
    hdo.set_steps(5);
    // Reference: f32 masters stepped by host_adam_step at steps 6 and 7.
    std::vector<std::vector<float>> p(ref.size()), m(ref.size()), v(ref.size());
    for (size_t k = 0; k < ref.size(); ++k) {
        p[k].resize(static_cast<size_t>(ref[k].numel()));
        m[k].assign(p[k].size(), 0.0f);
        v[k].assign(p[k].size(), 0.0f);
        convert(ref[k].data.data_ptr(), ref[k].data.dtype(), p[k].data(), DType::f32, p[k].size());
    }
    for (int step = 6; step <= 7; ++step) {
        fill_grads(ref, step);
        fill_grads(hyb, step);
        hdo.step(1e-2f);
        for (size_t k = 0; k < ref.size(); ++k) {
            float wd = ref[k].no_weight_decay ? 0.0f : 0.01f;
            host_adam_step(p[k].data(), ref[k].main_grad.data<float>(), m[k].data(), v[k].data(), ref[k].numel(),
                                  1e-2f, config.beta1, config.beta2, config.eps, wd, step);
        }
    }
    EXPECT_EQ(hdo.steps(), 7);
    for (int k = 0; k < hdo.num_slots(); ++k) {
        optim::HybridSlotState s = hdo.slot_state(k);
        EXPECT_EQ(std::memcmp(s.master.data_ptr(), p[static_cast<size_t>(k)].data(), s.numel * 4), 0) << "slot " << k;
    }
}

// The fix of docs/design/ddp_and_optimizers.md 3.5: the caller's stream waits on the h2d event. With a slow h2d stream,
// work queued on the caller's stream after the step must read the updated values; without the wait it reads old ones.
// One state dict for the whole model: taken after 3 steps of an f = 0.5 overlapped run, loaded into an f = 1 run
// without overlap (over copies of the same values), the next 3 steps are bitwise those of the uninterrupted run, and
// the step counter travels with it.
TEST(HybridStateDict, ResumesBitwiseUnderAnotherSplit) {
    Device &                      device = cpu::device();
    std::vector<model::Parameter> a = make_params(device), b = make_params(device);
    optim::HybridOptions          half{0.5f, true}, all{1.0f, false};
    optim::HybridDeviceOptimizer  first(device, slots_of(a, 0.01f), optim::AdamWConfig{}, half);
    for (int step = 1; step <= 3; ++step) {
        fill_grads(a, step);
        first.step(lr_at(step));
    }
    optim::HybridStateDict state = first.state_dict();
    EXPECT_EQ(state.step, 3);
    ASSERT_EQ(state.slots.size(), a.size());
    for (size_t k = 0; k < a.size(); ++k) b[k].data.copy_from(a[k].data);   // the model weights travel too
    optim::HybridDeviceOptimizer second(device, slots_of(b, 0.01f), optim::AdamWConfig{}, all);
    second.load_state_dict(state);
    EXPECT_EQ(second.steps(), 3);
    for (int step = 4; step <= 6; ++step) {
        fill_grads(a, step);
        fill_grads(b, step);
        first.step(lr_at(step));
        second.step(lr_at(step));
    }
    for (size_t k = 0; k < a.size(); ++k) EXPECT_TRUE(same_bits(a[k].data, b[k].data)) << a[k].name;
    optim::HybridStateDict wrong = state;
    wrong.slots[2].exp_avg.pop_back();
    EXPECT_THROW(second.load_state_dict(wrong), Error);
}

TEST(HybridStreams, CallersStreamWaitsForTheH2DCopies) {
    Device & device = cpu::device();
    for (bool skip_wait : {false, true}) {
        std::vector<model::Parameter> hyb = make_params(device);
        std::vector<model::Parameter> ref = make_params(device);
        std::vector<model::Parameter *> ptrs;
        for (model::Parameter & p : ref) ptrs.push_back(&p);
        optim::AdamW         adamw(ptrs, optim::AdamWConfig{});
        optim::HybridOptions options;
        options.offload_fraction     = 1.0f;
        options.overlap_d2h_h2d      = true;
        options.unsafe_skip_h2d_wait = skip_wait;
        // Unbounded queues: the host must get every H2D copy enqueued behind the sleep and return, so that a
        // reader without the wait runs while they are still pending (cpu_stream.h bounds run-ahead to 16).
        setenv("LOOM_STREAM_QUEUE_DEPTH", "1000000", 1);
        optim::HybridDeviceOptimizer hdo(device, slots_of(hyb, 0.01f), {}, options);
        std::unique_ptr<Stream>      current = device.stream_create("compute");
        unsetenv("LOOM_STREAM_QUEUE_DEPTH");
        fill_grads(ref, 1);
        fill_grads(hyb, 1);
        adamw.step(1e-2f);
        device.compute_stream().synchronize();   // the reference update is compute-stream work
        hdo.h2d_stream().submit([] { std::this_thread::sleep_for(std::chrono::milliseconds(300)); });
        hdo.step(1e-2f, current.get());
        bool matched = true;
        current->submit([&] {
            for (size_t k = 0; k < ref.size(); ++k) matched = matched && same_bits(ref[k].data, hyb[k].data);
        });
        current->synchronize();
        EXPECT_EQ(matched, !skip_wait) << (skip_wait ? "without the wait the reader saw the updated values: "
                                                       "the h2d delay did not take effect"
                                                     : "the caller's stream read the values before the H2D copies");
        hdo.h2d_stream().synchronize();
    }
}

namespace {

// gpt-tiny shrunk to 2 layers of hidden 64 and sequence 32, bf16 or f32, 20 iterations with warmup and decay.
train::TrainOptions trainer_options(bool bf16) {
    train::TrainOptions o = testing_models::small_gpt_options(2, 2, 20);
    o.lr_warmup_iters     = 5;
    o.model.params_dtype  = bf16 ? DType::bf16 : DType::f32;
    o.bf16                = bf16;
    return o;
}

struct TrainRun {
    std::vector<double>              losses;
    std::vector<std::vector<uint8_t>> params;   // raw bytes of every parameter
    int64_t                          device_optimizer_bytes = 0, pinned_optimizer_bytes = 0;
    int64_t                          device_peak = 0, pinned_peak = 0;   // whole allocators, during the run
};

TrainRun train_model(train::TrainOptions o) {
    Device & device = cpu::device();
    auto     bytes  = [&](MemoryKind kind) {
        device.compute_stream().synchronize();   // memory is freed in stream order
        return device.allocator(kind).pool_stats("optimizer").allocated;
    };
    auto     source = train::make_batch_source(o, device, false);
    model::GptModel gpt(o.model, device);
    gpt.init();
    TrainRun run;
    const int64_t dev0 = bytes(MemoryKind::device), host0 = bytes(MemoryKind::pinned_host);
    device.allocator(MemoryKind::device).reset_peak();
    device.allocator(MemoryKind::pinned_host).reset_peak();
    {
        train::Trainer trainer(o, gpt, *source);
        run.device_optimizer_bytes = bytes(MemoryKind::device) - dev0;
        run.pinned_optimizer_bytes = bytes(MemoryKind::pinned_host) - host0;
        run.losses                 = trainer.run(nullptr).losses;
    }
    // The pools of the model's state (weights, gradients, optimizer): how many activations and batches
    // are alive at once depends on how far the host has run ahead of the compute stream, which is timing,
    // not the program.
    for (const char * pool : {"weights", "grads", "optimizer"}) {
        run.device_peak += device.allocator(MemoryKind::device).pool_stats(pool).peak_allocated;
    }
    run.pinned_peak = device.allocator(MemoryKind::pinned_host).stats().peak_allocated;
    for (model::Parameter * p : gpt.parameters()) {
        const uint8_t * b = static_cast<const uint8_t *>(p->data.data_ptr());
        run.params.emplace_back(b, b + p->data.nbytes());
    }
    return run;
}

}  // namespace

// Losses and final parameters of 20 iterations are bitwise those of the run without offload, for
// fractions 0, 0.3, 0.5, 1 with and without overlap (bf16 and f32 parameters); the optimizer pool of the
// device allocator shrinks by 12 bytes per offloaded bf16 parameter (8 per f32 one) and the pinned host
// allocator's grows by 16 (master, m, v and the pinned f32 gradient), and so do the peaks of the
// allocators (the device's state pools: weights, grads, optimizer) during the 20 iterations (`allocated` bytes, exact: no size-class slack).
TEST(HybridTrainer, LossCurveAndParametersBitwiseTheNonOffloadedRunForEveryFraction) {
    for (bool bf16 : {true, false}) {
        SCOPED_TRACE(bf16 ? "bf16" : "f32");
        train::TrainOptions base = trainer_options(bf16);
        const TrainRun      ref  = train_model(base);
        int64_t             total = 0;
        for (const std::vector<uint8_t> & p : ref.params) total += static_cast<int64_t>(p.size()) / (bf16 ? 2 : 4);
        EXPECT_EQ(ref.device_optimizer_bytes, (bf16 ? 12 : 8) * total);
        EXPECT_LT(ref.losses.back(), ref.losses.front()) << "the loss falls";
        for (float fraction : {0.0f, 0.3f, 0.5f, 1.0f}) {
            for (bool overlap : {false, true}) {
                SCOPED_TRACE("fraction " + std::to_string(fraction) + (overlap ? " overlap" : ""));
                train::TrainOptions o     = base;
                o.optimizer_cpu_offload    = true;
                o.offload.offload_fraction = fraction;
                o.offload.overlap_d2h_h2d  = overlap;
                TrainRun run = train_model(o);
                EXPECT_EQ(run.losses, ref.losses);
                EXPECT_TRUE(run.params == ref.params) << "final parameters differ";
                // Offloaded elements: what left the device's optimizer pool, per element.
                const int64_t per_element = bf16 ? 12 : 8;
                const int64_t offloaded   = (ref.device_optimizer_bytes - run.device_optimizer_bytes) / per_element;
                EXPECT_EQ((ref.device_optimizer_bytes - run.device_optimizer_bytes) % per_element, 0);
                EXPECT_EQ(run.pinned_optimizer_bytes, 16 * offloaded);
                // The peaks of the whole allocators during training move by the same bytes (the
                // optimizer state lives through the run; every other allocation is the same).
                // The reference (and fraction 0) decides its step on the device (Optimizer::step_gated),
                // whose gate and norm keep 8 + 8 bytes of pinned copies; an offloaded step decides on the host.
                const int64_t gate_copies = offloaded > 0 ? 16 : 0;
                EXPECT_EQ(ref.device_peak - run.device_peak, per_element * offloaded);
                EXPECT_EQ(run.pinned_peak - ref.pinned_peak, 16 * offloaded - gate_copies);
                if (fraction == 0.0f) {
                    EXPECT_EQ(offloaded, 0);
                }
                if (fraction == 1.0f) {
                    EXPECT_EQ(offloaded, total);
                }
                if (fraction == 0.3f || fraction == 0.5f) {
                    EXPECT_GE(offloaded, static_cast<int64_t>(fraction * total));
                    EXPECT_LT(offloaded, total);
                }
            }
        }
    }
}
