#!/usr/bin/env bash
# Per-rank memory and step time of data parallelism's sharding choices, GPT-2 124M in bf16 at DP 2 on this
# machine (`loom train --mock-data` under mpirun, 2 ranks): plain DDP (everything replicated), ZeRO-1
# (--use-distributed-optimizer), and Megatron-FSDP's optim_grads and optim_grads_params. Each configuration
# trains `iters` iterations, `runs` times; printed per configuration: the peak bytes rank 0's allocator
# handed out (its own report: weights, gradients, optimizer state, activations and FSDP's whole units
# together), the median over the runs of the median time per iteration (after the first), and both as
# ratios to plain DDP measured in the same run of this script.
#
#   bench/fsdp_memory.sh [build-dir] [runs] [iters]
set -euo pipefail
build=${1:-build}
runs=${2:-3}
iters=${3:-6}
loom="$build/apps/loom"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader LOOM_NUM_THREADS=1
args=(train --mock-data --model gpt2-124m --bf16 --seq-length 64 --micro-batch-size 1 --global-batch-size 2
      --lr-warmup-iters 0 --log-interval 1 --train-iters "$iters")

median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

configs=("DDP (replicated)|"
         "ZeRO-1|--use-distributed-optimizer"
         "FSDP optim_grads|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads"
         "FSDP optim_grads_params|--use-megatron-fsdp --data-parallel-sharding-strategy optim_grads_params")
printf "%-26s %12s %8s %14s %8s\n" configuration "peak MiB" "x DDP" "ms/iteration" "x DDP"
base_mib=""; base_ms=""
for entry in "${configs[@]}"; do
    label=${entry%%|*}; read -r -a extra <<<"${entry#*|}"
    mibs=(); times=()
    for run in $(seq "$runs"); do
        out=$(mpirun -np 2 "$loom" "${args[@]}" "${extra[@]}" 2>&1)
        mibs+=("$(grep -o 'peak memory ([^)]*): [0-9.]* MiB allocated' <<<"$out" | awk '{print $(NF-2)}')")
        # The iterations after the first (which builds caches), their median.
        times+=("$(grep -o 'elapsed time per iteration (ms): [0-9.]*' <<<"$out" | awk 'NR > 1 {print $NF}' | median)")
    done
    mib=$(printf '%s\n' "${mibs[@]}" | median); ms=$(printf '%s\n' "${times[@]}" | median)
    if [[ -z $base_mib ]]; then base_mib=$mib; base_ms=$ms; fi
    printf "%-26s %12s %8.3f %14s %8.3f\n" "$label" "$mib" "$(awk "BEGIN {print $mib / $base_mib}")" "$ms" \
        "$(awk "BEGIN {print $ms / $base_ms}")"
done
