#!/usr/bin/env bash
# Activation memory and time of --bf16 against f32 on this machine's CPU: GPT-2 124M, micro-batch 4 x 256
# (`loom train --mock-data`, one rank, streams synchronised so the peak is the schedule's, not the host's
# lead). Each precision trains `iters` iterations, `runs` times; printed per precision: the activations pool's
# peak from the allocator's own report (deterministic: the same every run), what `loom plan` predicted for it,
# the median over the runs of the median time per iteration after the first, and both as ratios to f32
# measured in the same run of this script.
#
#   bench/bf16_activations.sh [build-dir] [runs] [iters]
set -euo pipefail
build=${1:-build}
runs=${2:-3}
iters=${3:-4}
loom="$build/apps/loom"
args=(train --mock-data --model gpt2-124m --seq-length 256 --micro-batch-size 4 --global-batch-size 4
      --hidden-dropout 0 --attention-dropout 0 --lr-warmup-iters 0 --log-interval 1 --train-iters "$iters")

median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

printf "%-10s %16s %16s %8s %14s %8s\n" precision "activations MiB" "planned MiB" "x f32" "ms/iteration" "x f32"
base_mib=""; base_ms=""
for precision in f32 bf16; do
    extra=(); [[ $precision == bf16 ]] && extra=(--bf16)
    mib="" planned="" times=()
    for ((r = 0; r < runs; ++r)); do
        out=$(LOOM_SYNC_STREAMS=1 "$loom" "${args[@]}" "${extra[@]}" 2>&1)
        line=$(grep -E "^ +activations +peak" <<<"$out")
        mib=$(awk '{print $3}' <<<"$line")
        planned=$(awk '{for (i = 1; i < NF; ++i) if ($i == "planned") print $(i + 2)}' <<<"$line")
        times+=("$(grep -oE "elapsed time per iteration \(ms\): [0-9.]+" <<<"$out" | tail -n +2 | awk '{print $NF}' | median)")
    done
    ms=$(printf "%s\n" "${times[@]}" | median)
    [[ -z $base_mib ]] && base_mib=$mib base_ms=$ms
    printf "%-10s %16s %16s %8.3f %14.1f %8.3f\n" "$precision" "$mib" "$planned" "$(awk "BEGIN {print $mib / $base_mib}")" \
        "$ms" "$(awk "BEGIN {print $ms / $base_ms}")"
done
