#!/usr/bin/env bash
# What operations cost a training step (issue 15; goal < 2% each): the metrics sink with its logs and alert rules,
# step traces, and checkpoints (asynchronous against written by the step loop). The demo hybrid (or $1) for
# STEPS steps per run, the runs interleaved (A B C D, A B C D, ...) so that the machine's noise falls on all alike.
#   metrics:     median over steps of monitor_ms (the sink, metrics.jsonl, the progress line and the rules of a
#                step: in every run) over the median step_ms
#   tracing:     median step_ms with --trace-steps over every step, against without
#   checkpoints: a checkpoint every 5 steps, asynchronous or written by the step loop: the median time the step
#                loop waited for one (checkpoint_blocking_ms) over 5 median steps, and the time to write it
# Usage: bench/operations_cost.sh [CONFIG] [STEPS] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/demo.json}
steps=${2:-40}
repeats=${3:-2}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common="--config $cfg --steps $steps --set train.eval_interval=0"
for rep in $(seq "$repeats"); do
    $bin train $common --set train.checkpoint_interval=0 --out "$tmp/base$rep" > /dev/null
    $bin train $common --set train.checkpoint_interval=0 --trace-steps 1:$steps --out "$tmp/trace$rep" > /dev/null
    $bin train $common --set train.checkpoint_interval=5 --out "$tmp/async$rep" > /dev/null
    $bin train $common --set train.checkpoint_interval=5 --set train.async_checkpoints=false \
        --out "$tmp/sync$rep" > /dev/null
done
python3 - "$tmp" "$repeats" <<'PY'
import json, statistics, sys
tmp, repeats = sys.argv[1], int(sys.argv[2])
def recs(name):
    out = []
    for r in range(1, repeats + 1):
        out += [json.loads(l) for l in open(f"{tmp}/{name}{r}/metrics.jsonl") if '"loss"' in l][1:]
    return out
def ckpt(name):  # checkpoints but the last (waited for at the end): blocking ms, total ms
    out = []
    for r in range(1, repeats + 1):
        rs = [json.loads(l) for l in open(f"{tmp}/{name}{r}/metrics.jsonl") if '"checkpoint_ms"' in l][:-1]
        out += [(x["checkpoint_blocking_ms"], x["checkpoint_ms"]) for x in rs]
    return statistics.median(b for b, _ in out), statistics.median(t for _, t in out)
med = statistics.median
base = recs("base")
step = med([r["step_ms"] for r in base])
mon = med([r["monitor_ms"] for r in base[1:]])
trace = med([r["step_ms"] for r in recs("trace")])
(ab, at), (sb, st) = ckpt("async"), ckpt("sync")
print("| what | measured | cost |")
print("|---|---|---|")
print(f"| metrics sink, metrics.jsonl, progress line, alert rules | {mon:.3f} ms of a {step:.0f} ms step | {100 * mon / step:.2f}% |")
print(f"| step traces (every step traced) | {trace:.0f} ms against {step:.0f} ms a step | {100 * (trace / step - 1):+.1f}% |")
print(f"| checkpoint every 5 steps, asynchronous | the step loop waits {ab:.1f} ms of its {at:.0f} ms | {100 * ab / (5 * step):.2f}% |")
print(f"| checkpoint every 5 steps, in the step loop | the step loop waits {sb:.1f} ms | {100 * sb / (5 * step):.2f}% |")
PY
