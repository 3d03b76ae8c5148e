#!/usr/bin/env bash
# Data-parallel scaling on this machine (issue 13): tokens/s of configs/bench_dense.json (or $1) for
#   1 rank  x 1 thread,  batch B        (the baseline)
#   2 ranks x 1 thread,  batch 2B       (weak scaling: each rank the baseline's work; goal >= 1.8x tokens/s),
#                                       with FSDP (the default) and with ZeRO-2 (parallel.fsdp=false)
#   1 rank  x 2 threads, batch 2B in micro-batches of B (the same work as the 2 ranks, threads instead)
# Median tokens/s over the steps after the first. Usage: bench/data_parallel_scaling.sh [CONFIG] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/bench_dense.json}
steps=${2:-6}
bin=${TESSERA_BIN:-build/apps/tessera}
B=$(python3 -c "import json,sys; print(json.load(open('$cfg'))['train']['batch_size'])")
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
median() {  # median tokens_per_s of a run's steps after the first
    python3 - "$1" <<'PY'
import json, statistics, sys
v = [json.loads(l)["tokens_per_s"] for l in open(sys.argv[1] + "/metrics.jsonl") if '"tokens_per_s"' in l][1:]
print(f"{statistics.median(v):.0f}")
PY
}
common="train --config $cfg --steps $steps --set train.checkpoint_interval=0"
OMP_NUM_THREADS=1 $bin --threads 1 $common --out "$tmp/a" > /dev/null
mpirun --allow-run-as-root --oversubscribe -n 2 -x OMP_NUM_THREADS=1 $bin $common --out "$tmp/b" \
    --set train.batch_size=$((2 * B)) > /dev/null
mpirun --allow-run-as-root --oversubscribe -n 2 -x OMP_NUM_THREADS=1 $bin $common --out "$tmp/z" \
    --set train.batch_size=$((2 * B)) --set parallel.fsdp=false > /dev/null
OMP_NUM_THREADS=2 $bin --threads 2 $common --out "$tmp/c" --set train.batch_size=$((2 * B)) \
    --set train.micro_batch_size=$B > /dev/null
a=$(median "$tmp/a"); b=$(median "$tmp/b"); z=$(median "$tmp/z"); c=$(median "$tmp/c")
echo "| layout | tokens/s (median) | vs 1 rank x 1 thread |"
echo "|---|---|---|"
echo "| 1 rank x 1 thread, batch $B | $a | 1.00 |"
python3 -c "print(f'| 2 ranks x 1 thread, batch $((2 * B)), FSDP | $b | {$b/$a:.2f} |')"
python3 -c "print(f'| 2 ranks x 1 thread, batch $((2 * B)), ZeRO-2 | $z | {$z/$a:.2f} |')"
python3 -c "print(f'| 1 rank x 2 threads, batch $((2 * B)) (micro $B) | $c | {$c/$a:.2f} |')"
