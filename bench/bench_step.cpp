// Whole training step of GPT-2 124M on the CPU: micro-batch 4, sequence 256 (1024 tokens per step),
// forward + backward + AdamW, reported as tokens/s and achieved GFLOP/s (Megatron's FLOP count), in f32
// and with --bf16's mixed precision (bf16 GEMM operands, f32 master weights). Compare GFLOP/s with
// bench_gemm's f32 and bf16 peaks measured in the same run. The bf16 step also runs with Megatron's
// default dropout (0.1, 0.1) and with dropout plus full activation recompute (uniform, 1 layer), each
// reporting the "activations" pool's peak bytes over its steps (act_peak_MiB); the ratios against the
// plain bf16 step in the same run are dropout's and recompute's cost. The dropout step also runs with
// per-layer graphs (--cuda-graph-impl transformer_engine: every layer captured once, then replayed; its
// saved activations and workspaces live in the "graphs" pool, graph_pool_MiB: its reserved bytes): on the CPU a replay saves no launch cost,
// so the ratio against the eager dropout step is what the copies into the static inputs cost.
//
//   build/bench/bench_step --benchmark_repetitions=5 --benchmark_report_aggregates_only=true
#include "backend/cpu/cpu_device.h"
#include "graphs/layer_graph_runner.h"
#include "model/gpt_model.h"
#include "optim/optimizer.h"

#include <benchmark/benchmark.h>

#include <random>

using namespace loom;

static void gpt2_124m_step(benchmark::State & state, DType dtype, float dropout = 0.0f, bool recompute = false,
                           bool layer_graphs = false) {
    model::GptConfig config = model::gpt_preset("gpt2-124m");
    config.seq_length       = 256;
    config.params_dtype     = dtype;
    config.hidden_dropout = config.attention_dropout = dropout;
    if (recompute) {
        config.recompute_granularity = model::RecomputeGranularity::full;
        config.recompute_method      = model::RecomputeMethod::uniform;
        config.recompute_num_layers  = 1;
    }
    const int64_t b = 4, s = 256;
    Device &        device = cpu::device();
    model::GptModel gpt(config, device);
    gpt.init();
    auto               params = gpt.parameters();
    optim::AdamW       adam(params, optim::OptimizerOptions{optim::AdamWConfig{}, 1.0f, std::nullopt, std::nullopt, {}, 1.0});
    model::MicroBatch  batch;
    batch.tokens    = Tensor::empty({b, s}, DType::i32, device);
    batch.labels    = Tensor::empty({b, s}, DType::i32, device);
    batch.loss_mask = Tensor::empty({b, s}, DType::f32, device);
    std::mt19937 rng(1);
    for (int64_t i = 0; i < b * s; ++i) {
        batch.tokens.data<int32_t>()[i]  = static_cast<int32_t>(rng() % 50257);
        batch.labels.data<int32_t>()[i]  = static_cast<int32_t>(rng() % 50257);
        batch.loss_mask.data<float>()[i] = 1.0f;
    }
    auto step = [&] {
        gpt.zero_grad();
        model::GptModel::Context ctx;
        auto loss = gpt.forward(ctx, batch);
        gpt.backward(ctx, 1.0 / loss.count, nullptr);
        adam.step(1e-4f);   // norm (the host waits for the compute stream), clip, update
        device.compute_stream().synchronize();
    };
    step();   // untimed warm-up: GEMM primitives and the allocator's first blocks (a step is seconds, and
              // MinTime(5) would otherwise time the first one)
    std::unique_ptr<graphs::LayerGraphRunner> runner;
    if (layer_graphs) {
        runner = std::make_unique<graphs::LayerGraphRunner>(std::vector<model::GptModel *>{&gpt}, pipeline::ScheduleOptions{},
                                                            0, s, b);
        runner->capture();
        step();
    }
    device.allocator().reset_peak();
    const int64_t resident = device.allocator().pool_stats("activations").allocated;
    for (auto _ : state) {
        gpt.zero_grad();
        model::GptModel::Context ctx;
        auto loss = gpt.forward(ctx, batch);
        gpt.backward(ctx, 1.0 / loss.count, nullptr);
        adam.step(1e-4f);
        device.compute_stream().synchronize();
    }
    state.counters["act_peak_MiB"] =
        static_cast<double>(device.allocator().pool_stats("activations").peak_allocated - resident) / 1048576.0;
    if (runner) {
        // What the graphs hold: every block captured into the pool stays reserved for replays.
        state.counters["graph_pool_MiB"] = static_cast<double>(device.allocator().pool_stats(kGraphPool).reserved) / 1048576.0;
    }
    double tokens = static_cast<double>(b * s);
    state.counters["tokens"] = benchmark::Counter(tokens * state.iterations(), benchmark::Counter::kIsRate);
    state.counters["GFLOP"]  = benchmark::Counter(config.training_flops_per_token() * tokens * state.iterations() / 1e9,
                                                    benchmark::Counter::kIsRate);
}
static void BM_gpt2_124m_step_f32(benchmark::State & state) { gpt2_124m_step(state, DType::f32); }
static void BM_gpt2_124m_step_bf16(benchmark::State & state) { gpt2_124m_step(state, DType::bf16); }
static void BM_gpt2_124m_step_bf16_dropout(benchmark::State & state) { gpt2_124m_step(state, DType::bf16, 0.1f); }
static void BM_gpt2_124m_step_bf16_dropout_recompute(benchmark::State & state) {
    gpt2_124m_step(state, DType::bf16, 0.1f, true);
}
static void BM_gpt2_124m_step_bf16_dropout_graphs(benchmark::State & state) {
    gpt2_124m_step(state, DType::bf16, 0.1f, false, true);
}
BENCHMARK(BM_gpt2_124m_step_f32)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);
BENCHMARK(BM_gpt2_124m_step_bf16)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);
BENCHMARK(BM_gpt2_124m_step_bf16_dropout)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);
BENCHMARK(BM_gpt2_124m_step_bf16_dropout_recompute)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);
BENCHMARK(BM_gpt2_124m_step_bf16_dropout_graphs)->Unit(benchmark::kMillisecond)->UseRealTime()->MinTime(5.0);

BENCHMARK_MAIN();
