#!/usr/bin/env python3
"""`loom plan --gpu`'s predicted throughput beside published runs of the same configurations.

    python3 bench/plan_vs_published.py [path/to/loom]

For each row it plans the run at full size (`loom plan ... --ranks 0 --json`), turns the predicted step time
into TFLOP/s per GPU with the FLOP formula the publication used, and prints predicted / published. The
constants of the cost model (src/plan/cost_model.h) were not fitted to these rows. docs/plan.md shows the
output and explains the differences.

Sources (what each publication states; micro-batch sizes, recompute and schedules they do not state are
taken as noted in docs/plan.md):
  narayanan  Narayanan et al., "Efficient Large-Scale Language Model Training on GPU Clusters Using
             Megatron-LM", SC 2021 (arXiv 2104.04473), Table 1: A100 80GB, s 2048, V 51200, full recompute,
             F = 96 B s l h^2 (1 + s/(6h) + V/(16 l h)).
  megatron   NVIDIA/Megatron-LM README, "Performance benchmarking" (images/model_table.png, July 2024): H100,
             s 4096, V 131072, F = 72 B s l h^2 (1 + s/(6h) + V/(12 l h)) (Megatron's count of the time, no
             causal halving, no recompute).
  llm.c      karpathy/llm.c scripts/run_gpt2_124M.sh (8 x A100 80GB, "~300ms/iter") and run_gpt2_1558M.sh
             (8 x H100 80GB, "2.80s/iter"): step times.
"""
import json
import subprocess
import sys

LOOM = sys.argv[1] if len(sys.argv) > 1 else "build/apps/loom"


def plan(flags, gpu, gpus):
    cmd = [LOOM, "plan", "--mock-data", "--bf16", "--nodes", str(max(gpus // 8, 1)),
           "--gpus-per-node", str(min(gpus, 8)), "--ranks", "0", "--gpu", gpu, "--json"] + flags
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    return json.loads(out)


def gpt(heads, hidden, layers, seq, vocab, tp, pp, batch, sequence_parallel):
    flags = ["--num-layers", layers, "--hidden-size", hidden, "--num-attention-heads", heads,
             "--seq-length", seq, "--max-position-embeddings", seq, "--vocab-size", vocab,
             "--micro-batch-size", 1, "--global-batch-size", batch,
             "--tensor-model-parallel-size", tp, "--pipeline-model-parallel-size", pp]
    if tp > 1 and sequence_parallel:
        flags.append("--sequence-parallel")
    return [str(f) for f in flags]


rows = []
# Narayanan et al. 2021, Table 1: heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU.
for a, h, l, tp, pp, n, B, published in [
        (24, 2304, 24, 1, 1, 32, 512, 137), (32, 3072, 30, 2, 1, 64, 512, 138),
        (32, 4096, 36, 4, 1, 128, 512, 142), (48, 6144, 40, 8, 1, 256, 1024, 135),
        (64, 8192, 48, 8, 2, 512, 1536, 138), (80, 10240, 60, 8, 4, 1024, 1792, 140),
        (96, 12288, 80, 8, 8, 1536, 2304, 148), (128, 16384, 96, 8, 16, 1920, 2160, 155),
        (128, 20480, 105, 8, 35, 2520, 2520, 163), (160, 25600, 128, 8, 64, 3072, 3072, 163)]:
    # 2021: before sequence parallelism (Korthikanti et al., 2022).
    flags = gpt(a, h, l, 2048, 51200, tp, pp, B, False) + ["--recompute-granularity", "full", "--recompute-method",
                                                    "uniform", "--recompute-num-layers", "1"]
    j = plan(flags, "a100-80gb", n)
    s, V = 2048, 51200
    flops = 96 * B * s * l * h * h * (1 + s / (6 * h) + V / (16 * l * h))
    rows.append(("narayanan", f"{l}L h{h} TP{tp} PP{pp} {n} GPUs", flops / j["step_seconds"] / n / 1e12, published, j))

# Megatron-LM README, H100 weak scaling: heads, hidden, layers, TP, PP, GPUs, batch, TFLOP/s per GPU.
for a, h, l, tp, pp, n, B, published in [
        (16, 2048, 24, 1, 1, 48, 192, 408.8), (32, 4096, 30, 2, 1, 96, 192, 465.9),
        (48, 6144, 32, 4, 1, 192, 192, 489.1), (56, 7168, 48, 8, 1, 384, 192, 459.6),
        (64, 8192, 84, 8, 2, 768, 384, 419.7), (80, 10240, 92, 8, 4, 1536, 768, 420.5),
        (96, 12288, 96, 8, 6, 2304, 1152, 432.8), (128, 16384, 96, 8, 8, 3072, 1536, 474.4),
        (144, 18432, 112, 8, 16, 6144, 3072, 459.9)]:
    # The README: "--overlap-grad-reduce --overlap-param-gather", "--tp-comm-overlap" (Megatron's rule: with TP and
    # sequence parallelism).
    flags = gpt(a, h, l, 4096, 131072, tp, pp, B, True) + ["--use-distributed-optimizer", "--overlap-grad-reduce",
                                                     "--overlap-param-gather"] + (["--tp-comm-overlap"] if tp > 1 else [])
    j = plan(flags, "h100-80gb", n)
    s, V = 4096, 131072
    flops = 72 * B * s * l * h * h * (1 + s / (6 * h) + V / (12 * l * h))
    rows.append(("megatron", f"{l}L h{h} TP{tp} PP{pp} {n} GPUs", flops / j["step_seconds"] / n / 1e12, published, j))

# llm.c: step seconds (inverted, so that the ratio reads as throughput like the others).
for model, gpu, mbs, batch, published_s in [("gpt2-124m", "a100-80gb", 64, 512, 0.300),
                                            ("gpt2-1.5b", "h100-80gb", 16, 1024, 2.80)]:
    flags = ["--model", model, "--seq-length", "1024", "--micro-batch-size", str(mbs), "--global-batch-size",
             str(batch), "--hidden-dropout", "0", "--attention-dropout", "0", "--use-distributed-optimizer",
             "--overlap-grad-reduce"]
    j = plan(flags, gpu, 8)
    rows.append(("llm.c", f"{model} 8 x {gpu} (steps/s)", 1 / j["step_seconds"], 1 / published_s, j))

print(f"{'source':10s} {'configuration':34s} {'predicted':>10s} {'published':>10s} {'ratio':>6s} {'bubble':>7s} {'peak GiB':>9s}")
within = 0
for source, name, predicted, published, j in rows:
    ratio = predicted / published
    within += abs(ratio - 1) <= 0.15
    print(f"{source:10s} {name:34s} {predicted:10.2f} {published:10.2f} {ratio:6.2f} {j['bubble_fraction']:7.1%} "
          f"{j['peak_bytes'] / 2**30:9.1f}")
print(f"within 15% of the published figure: {within} of {len(rows)}")
