#!/usr/bin/env bash
# Per-iteration time of `loom train` with data parallelism 1, 2 and 4 on this machine: the same model and
# global batch, each DP rank running global / (micro x dp) micro-batches, with and without the
# distributed optimizer and both overlaps. Prints the median of the logged windows (Megatron's
# "elapsed time per iteration"), and the ratio to DP 1 measured in the same run.
#
#   bench/dp_scaling.sh [build-dir]
#
# On a 2-core machine DP 2 gives each rank one core (LOOM_NUM_THREADS=1) and DP 4 oversubscribes, so this
# measures the cost of DDP's buffers and collectives, not a speed-up.
set -euo pipefail
build=${1:-build}
loom="$build/apps/loom"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader
cores=$(nproc)
args=(train --mock-data --model gpt-tiny --log-throughput --train-iters 60 --log-interval 10 --lr-warmup-iters 5
      --global-batch-size 16 --micro-batch-size 2)

median_ms() {   # stdin: loom's log; prints the median of the windows after the first
    grep -o 'elapsed time per iteration (ms): [0-9.]*' | awk '{print $NF}' | tail -n +2 | sort -n |
        awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'
}

printf "%-4s %-28s %10s %9s\n" dp configuration "ms/iter" "vs dp 1"
for extra in "" "--use-distributed-optimizer --overlap-grad-reduce --overlap-param-gather"; do
    label=${extra:+ZeRO-1, both overlaps}
    base=""
    for dp in 1 2 4; do
        threads=$(( cores / dp )); (( threads < 1 )) && threads=1
        ms=$(LOOM_NUM_THREADS=$threads mpirun --oversubscribe -np "$dp" "$loom" "${args[@]}" $extra --ddp-bucket-size 200000 \
             2>/dev/null | median_ms)
        [[ -z "$base" ]] && base=$ms
        printf "%-4s %-28s %10s %9s\n" "$dp" "${label:-all-reduce}" "$ms" "$(awk -v a="$ms" -v b="$base" 'BEGIN {printf "%.2fx", a / b}')"
    done
done
