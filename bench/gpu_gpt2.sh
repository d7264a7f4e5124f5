#!/usr/bin/env bash
# GPT-2 124M training on one GPU (micro-batch 16 x 1024 tokens, bf16): `loom train --device cuda` eager,
# with per-layer graphs and with one full-iteration graph, beside PyTorch's own step (bench/pytorch_step.py --device cuda: torch.compile,
# bf16 autocast, flash attention, fused AdamW; then eager) measured in the same session on the same GPU.
# Prints tokens/s and MFU for each (the median of Loom's logged windows after the first; PyTorch's median
# step), and each one's ratio to torch.compile's tokens/s.
#
#   bench/gpu_gpt2.sh [build-dir] [peak TFLOP/s, default 989: H100 SXM dense bf16]
#
# GPT2_ITERS (default 60) and GPT2_LOG_INTERVAL (10) size Loom's runs, TORCH_STEPS (30) PyTorch's;
# GPT2_FUSED_CLASSIFIER=1 adds --cross-entropy-loss-fusion to Loom's. Loom's
# lines print as each run ends, PyTorch's after them, each with its ratio to torch.compile's tokens/s.
#
# Without a GPU it says so and exits 0.
set -euo pipefail
build=${1:-build}
peak=${2:-989}
loom="$build/apps/loom"
here=$(cd "$(dirname "$0")" && pwd)
if ! nvidia-smi -L >/dev/null 2>&1; then
    echo "gpu_gpt2: no GPU visible (nvidia-smi); nothing measured"
    exit 0
fi
nvidia-smi -L | head -1
b=16; s=1024; iters=${GPT2_ITERS:-60}; interval=${GPT2_LOG_INTERVAL:-10}; torch_steps=${TORCH_STEPS:-30}
# Dropout off, as in bench/pytorch_step.py's model: both sides run the same arithmetic.
args=(train --device cuda --model gpt2-124m --mock-data --bf16 --micro-batch-size $b --global-batch-size $b
      --seq-length $s --train-iters $iters --log-interval $interval --log-throughput --lr-warmup-iters 5
      --hidden-dropout 0 --attention-dropout 0)

median() {   # stdin: numbers, one per line (the first window dropped by the caller); prints the median
    sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'
}

printf "\n%-34s %12s %8s %12s\n" run tokens/s MFU "ms/step"
loom_tps=()
# Eager, per-layer graphs, and the whole forward-backward as one graph (Loom's --cuda-graph-impl); with
# GPT2_FUSED_CLASSIFIER=1 every run fuses the classifier (--cross-entropy-loss-fusion).
fused=(); [[ "${GPT2_FUSED_CLASSIFIER:-0}" == 1 ]] && fused=(--cross-entropy-loss-fusion)
for graphs in none transformer_engine full_iteration; do
    if ! log=$("$loom" "${args[@]}" "${fused[@]}" --cuda-graph-impl $graphs 2>&1); then
        printf "%-34s failed:\n%s\n" "loom, graphs $graphs" "$(tail -5 <<<"$log")"
        continue
    fi
    ms=$(grep -o 'elapsed time per iteration (ms): [0-9.]*' <<<"$log" | awk '{print $NF}' | tail -n +2 | median)
    tflops=$(grep -o 'TFLOP/s/GPU): [0-9.]*' <<<"$log" | awk '{print $NF}' | tail -n +2 | median)
    tps=$(awk -v ms="$ms" -v t=$((b * s)) 'BEGIN {printf "%.0f", t / (ms / 1000)}')
    mfu=$(awk -v t="$tflops" -v p="$peak" 'BEGIN {printf "%.1f%%", 100 * t / p}')
    printf "%-34s %12s %8s %12s\n" "loom, graphs $graphs" "$tps" "$mfu" "$ms"
    loom_tps+=("loom, graphs $graphs=$tps")
    grep -E 'peak|memory' <<<"$log" | tail -2
    grep ' work: ' <<<"$log" || true   # host synchronisations and late reads per iteration
done

torch_line=$(python3 "$here/pytorch_step.py" --device cuda --steps "$torch_steps" --peak-tflops "$peak")
echo "$torch_line"
torch_tps=$(grep -o '[0-9]* tokens/s' <<<"$torch_line" | awk '{print $1}')
eager_line=$(python3 "$here/pytorch_step.py" --device cuda --steps "$torch_steps" --no-compile --peak-tflops "$peak")
echo "$eager_line"
eager_tps=$(grep -o '[0-9]* tokens/s' <<<"$eager_line" | awk '{print $1}')
if [[ -n "$torch_tps" ]]; then
    printf "\n%-34s %12s %12s\n" run tokens/s "vs compile"
    printf "%-34s %12s %12s\n" "pytorch torch.compile" "$torch_tps" "1.00x"
    for entry in "pytorch eager=$eager_tps" "${loom_tps[@]}"; do
        printf "%-34s %12s %12s\n" "${entry%=*}" "${entry##*=}" \
            "$(awk -v a="${entry##*=}" -v b="$torch_tps" 'BEGIN {printf "%.2fx", a / b}')"
    done
fi
