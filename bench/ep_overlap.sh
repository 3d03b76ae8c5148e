#!/usr/bin/env bash
# Expert parallelism's overlap (issue 13): the demo hybrid (configs/demo.json, or $1) on 2 ranks with
# parallel.ep = 2, with the local experts exchanged all at once (ep_chunks 1) or pipelined in groups
# (ep_chunks 2, 4), on the real shared-memory link and on one slowed down by an injected per-byte delay
# (parallel.link_delay_ns_per_byte: the communication thread also sleeps bytes × delay after each transfer).
# Per layout: median over steps 2.. of the step time, the all-to-all time on the communication thread and
# the part of it the compute threads waited for (exposed), summed over the MoE layers.
# Usage: bench/ep_overlap.sh [CONFIG] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/demo.json}
steps=${2:-6}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
echo "| link delay (ns/byte) | ep_chunks | step ms | a2a ms (comm thread) | exposed ms | exposed share |"
echo "|---|---|---|---|---|---|"
for delay in ${DELAYS:-0 4}; do
    for chunks in 1 2 4; do
        out="$tmp/d${delay}c${chunks}"
        mpirun --allow-run-as-root --oversubscribe -n 2 -x OMP_NUM_THREADS=1 $bin train --config "$cfg" --steps "$steps" \
            --out "$out" --set train.eval_interval=0 --set train.checkpoint_interval=0 --set parallel.ep=2 \
            --set parallel.ep_chunks=$chunks --set parallel.link_delay_ns_per_byte=$delay > "$out.log"
        python3 - "$out" "$delay" "$chunks" <<'PY'
import json, statistics, sys
recs = [json.loads(l) for l in open(sys.argv[1] + "/metrics.jsonl") if '"moe"' in l][1:]
med = lambda v: statistics.median(v)
step = med([r["step_ms"] for r in recs])
a2a = med([sum(l["a2a_seconds"] for l in r["moe"]) * 1e3 for r in recs])
exp = med([sum(l["a2a_exposed_seconds"] for l in r["moe"]) * 1e3 for r in recs])
print(f"| {sys.argv[2]} | {sys.argv[3]} | {step:.0f} | {a2a:.1f} | {exp:.1f} | {exp / a2a:.2f} |")
PY
    done
done
