#!/usr/bin/env bash
# Save and load of a GPT-2 124M checkpoint (parameters + f32 Adam state, optimizer step) by `loom train`,
# at DP 1 (AdamW) and DP 2 (ZeRO-1: each rank writes its shard), to a folder on this machine's disk.
# Each configuration trains one iteration and saves it, then a fresh process loads it; repeated `runs`
# times. Prints the bytes written and the median save and load times over the runs, as loom reports them
# (save: from the first rank's entry to the tracker file's rename; load: index, checksums, assembly).
#
#   bench/checkpoint_io.sh [build-dir] [runs] [folder]
set -euo pipefail
build=${1:-build}
runs=${2:-3}
root=${3:-$(mktemp -d)}
loom="$build/apps/loom"
export OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 OMPI_MCA_btl_vader_single_copy_mechanism=none
export OMPI_MCA_rmaps_base_oversubscribe=1 OMPI_MCA_btl=self,vader
args=(train --mock-data --model gpt2-124m --seq-length 64 --micro-batch-size 1 --lr-warmup-iters 0 --log-interval 1)

median() { sort -n | awk '{v[NR]=$1} END {print (NR % 2) ? v[(NR+1)/2] : (v[NR/2] + v[NR/2+1]) / 2}'; }

printf "%-22s %10s %10s %10s\n" configuration "MiB" "save s" "load s"
for dp in 1 2; do
    launch=("$loom"); extra=()
    if (( dp > 1 )); then
        launch=(mpirun -np "$dp" "$loom"); extra=(--use-distributed-optimizer); export LOOM_NUM_THREADS=1
    fi
    saves=(); loads=(); mib=""
    for run in $(seq "$runs"); do
        dir="$root/dp$dp"
        rm -rf "$dir"
        out=$("${launch[@]}" "${args[@]}" "${extra[@]}" --train-iters 1 --global-batch-size 2 --save "$dir")
        saves+=("$(grep -o 'MiB in [0-9.]* s' <<<"$out" | awk '{print $3}')")
        mib=$(grep -o '\[ [0-9.]* MiB' <<<"$out" | awk '{print $2}')
        out=$("${launch[@]}" "${args[@]}" "${extra[@]}" --train-iters 2 --global-batch-size 2 --load "$dir")
        loads+=("$(grep -o 'consumed samples [0-9]*) in [0-9.]* s' <<<"$out" | awk '{print $(NF-1)}')")
    done
    label="DP $dp${extra:+ (ZeRO-1)}"
    printf "%-22s %10s %10s %10s\n" "$label" "$mib" "$(printf '%s\n' "${saves[@]}" | median)" \
        "$(printf '%s\n' "${loads[@]}" | median)"
    rm -rf "$root/dp$dp"
done
