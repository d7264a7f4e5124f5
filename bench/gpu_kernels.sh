#!/usr/bin/env bash
# Where a GPT-2 124M training step's GPU time goes, kernel by kernel: Nsight Compute (ncu) times every kernel
# `loom train --device cuda` launches in a short run (micro-batch 16 x 1024, bf16, dropout off, as
# bench/gpu_gpt2.sh), and the kernels are summed by name: launches, total ms, mean us and share of the
# whole, the largest first. Kernels of the set-up (weight initialisation) are counted too: they are few and
# short beside two steps'. ncu serialises the kernels, so the sum is GPU time without overlap, not the step
# time.
#
#   bench/gpu_kernels.sh [build-dir] [iterations, default 2] [rows, default 30]
#
# Without a GPU or ncu it says so and exits 0.
set -euo pipefail
build=${1:-build}
iters=${2:-2}
rows=${3:-30}
if ! nvidia-smi -L >/dev/null 2>&1 || ! command -v ncu >/dev/null; then
    echo "gpu_kernels: no GPU visible (nvidia-smi) or no ncu; nothing measured"
    exit 0
fi
csv=$(mktemp)
ncu --metrics gpu__time_duration.sum --clock-control none --print-kernel-base function --csv --page raw \
    "$build/apps/loom" train --device cuda --model gpt2-124m --mock-data --bf16 --micro-batch-size 16 \
    --global-batch-size 16 --seq-length 1024 --train-iters "$iters" --log-interval 1 \
    --hidden-dropout 0 --attention-dropout 0 > "$csv" 2>/dev/null || { tail -20 "$csv"; exit 1; }
python3 - "$csv" "$rows" <<'PY'
import csv, sys, collections
path, rows = sys.argv[1], int(sys.argv[2])
lines = open(path).read().splitlines()
start = next(i for i, l in enumerate(lines) if l.startswith('"ID"'))
table = list(csv.reader(lines[start:]))
head = table[0]
name_at, time_at = head.index("Kernel Name"), head.index("gpu__time_duration.sum")
unit = table[1][time_at]   # the units row: "nsecond", "usecond" or "msecond"
scale = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3}[unit]
total, count = collections.Counter(), collections.Counter()
for row in table[2:]:
    if len(row) <= max(name_at, time_at):
        continue
    try:
        us = float(row[time_at].replace(",", "")) * scale
    except ValueError:
        continue
    total[row[name_at]] += us
    count[row[name_at]] += 1
whole = sum(total.values())
print(f"{sum(count.values())} kernel launches, {whole / 1e3:.1f} ms of GPU time in all")
print(f"{'kernel':60} {'launches':>9} {'total ms':>10} {'mean us':>10} {'share':>7}")
for name, us in total.most_common(rows):
    print(f"{name[:60]:60} {count[name]:9d} {us / 1e3:10.2f} {us / count[name]:10.1f} {100 * us / whole:6.1f}%")
PY
rm -f "$csv"
