#!/usr/bin/env bash
# A/B of two `umbp` binaries on the pool bench: the runs alternate (A, B, A, B, …) so the machine's
# drift touches both alike. Usage: bench/ab.sh BIN_A BIN_B [PAIRS] [ROUNDS]
# Prints each run's JSON on its own line, tagged A or B; summarise with bench/ab_table.py.
set -euo pipefail
a=${1:?binary A}; b=${2:?binary B}; pairs=${3:-3}; rounds=${4:-5}
for i in $(seq 1 "$pairs"); do
    for tag in A B; do
        bin=$a; [ "$tag" = B ] && bin=$b
        echo "# run $i $tag $(date -u +%H:%M:%S) load $(cut -d' ' -f1 /proc/loadavg)" >&2
        printf '%s ' "$tag"
        "$bin" bench --rounds "$rounds" --json | tr -d '\n'
        echo
    done
done
