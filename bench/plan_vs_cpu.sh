#!/usr/bin/env bash
# `loom plan --gpu cpu` held against runs on this machine: each configuration trains `iters` iterations `runs`
# times with `loom train` (one rank, CPU), which prints the plan's step for this machine (its rates measured at
# the start of the run) and the measured median step after the first two iterations. Printed per
# configuration: the median over the runs of both, and measured / predicted.
#
#   bench/plan_vs_cpu.sh [build-dir] [runs] [iters]
set -euo pipefail
build=${1:-build}
runs=${2:-3}
iters=${3:-6}
loom="$build/apps/loom"

median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

configs=(
    "gpt-tiny f32|--model gpt-tiny"
    "gpt-tiny bf16|--model gpt-tiny --bf16"
    "h512 L4 s256 bf16|--num-layers 4 --hidden-size 512 --num-attention-heads 8 --seq-length 256 --max-position-embeddings 256 --vocab-size 8192 --micro-batch-size 4 --bf16"
    "gpt2-124m 2x256 bf16|--model gpt2-124m --seq-length 256 --micro-batch-size 2 --bf16"
)
printf "%-22s %14s %14s %10s\n" configuration "measured ms" "predicted ms" "measured/predicted"
for entry in "${configs[@]}"; do
    name=${entry%%|*}
    read -r -a flags <<<"${entry#*|}"
    measured=() predicted=()
    for ((r = 0; r < runs; ++r)); do
        out=$("$loom" train --mock-data --hidden-dropout 0 --attention-dropout 0 --log-interval "$iters" \
              --train-iters "$iters" "${flags[@]}" 2>&1 || true)
        line=$(grep -E "^step time: measured" <<<"$out") || { echo "$name: no step time in the output:"; echo "$out" | tail -5; exit 1; }
        measured+=("$(awk '{print $4}' <<<"$line")")
        predicted+=("$(grep -oE "loom plan predicted [0-9.]+" <<<"$line" | awk '{print $4}')")
    done
    m=$(printf "%s\n" "${measured[@]}" | median)
    p=$(printf "%s\n" "${predicted[@]}" | median)
    printf "%-22s %14.1f %14.1f %10.2f\n" "$name" "$(awk "BEGIN {print $m * 1000}")" "$(awk "BEGIN {print $p * 1000}")" \
        "$(awk "BEGIN {print $m / $p}")"
done
