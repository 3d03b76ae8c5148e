#!/usr/bin/env bash
# Sharded training, two builds side by side (e.g. before and after a change to train/grad_sum.cpp, train/fsdp.cpp or
# parallel/shard.h): the demo hybrid (or CONFIG) under ZeRO-2 (MODE zero2, the default: parallel.fsdp = false) or FSDP
# (MODE fsdp) on 2 and 4 ranks, REPEATS runs per build interleaved, 14 steps each. Per build and rank count: each
# run's median step time and median communication phase (steps 4..14; the phase is the compute thread waiting for
# gathers and reductions), and the median over runs. A side may be BIN:KEY=VALUE,... to run with those config keys
# too, e.g. one build as FSDP against HSDP: bench/shard_ab.sh BIN BIN:parallel.shard=2 fsdp (at 2 ranks a shard
# group of 2 is every rank: plain FSDP on both sides).
# Usage: bench/shard_ab.sh OLD_BIN[:SETS] NEW_BIN[:SETS] [MODE] [CONFIG] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
[ $# -ge 2 ] || {
    echo "usage: bench/shard_ab.sh OLD_BIN[:KEY=VALUE,...] NEW_BIN[:KEY=VALUE,...] [zero2|fsdp] [CONFIG] [REPEATS]" >&2
    exit 2
}
old=$1 new=$2 mode=${3:-zero2} cfg=${4:-configs/demo.json} repeats=${5:-3}
case $mode in
    zero2) fsdp=false ;;
    fsdp) fsdp=true ;;
    *) echo "bench/shard_ab.sh: MODE is zero2 or fsdp, not '$mode'" >&2; exit 2 ;;
esac
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
for W in 2 4; do
    for rep in $(seq 1 "$repeats"); do
        for v in old new; do
            side=$old
            [ $v = new ] && side=$new
            bin=${side%%:*} sets=()
            if [[ $side == *:* ]]; then
                IFS=, read -ra kv <<< "${side#*:}"
                for s in "${kv[@]}"; do sets+=(--set "$s"); done
            fi
            "$bin" launch -n $W -- train --config "$cfg" --steps 14 --set parallel.fsdp=$fsdp "${sets[@]}" \
                --set train.eval_interval=0 --set train.checkpoint_interval=0 --out "$tmp/$v-$W-$rep" > /dev/null
        done
    done
done
python3 - "$tmp" "$repeats" <<'PY'
import json, statistics as st, sys
tmp, repeats = sys.argv[1], int(sys.argv[2])
print("| ranks | build | step ms (each run) | median | communication ms (each run) | median |")
print("|---|---|---|---|---|---|")
for W in (2, 4):
    for v in ("old", "new"):
        steps, comm = [], []
        for rep in range(1, repeats + 1):
            rows = [json.loads(l) for l in open(f"{tmp}/{v}-{W}-{rep}/metrics.jsonl")]
            rows = [r for r in rows if r.get("step", 0) >= 4 and "step_ms" in r]
            steps.append(st.median(r["step_ms"] for r in rows))
            comm.append(st.median(r["phase_ms"]["communication"] for r in rows))
        fmt = lambda xs: ", ".join(f"{x:.1f}" for x in xs)
        print(f"| {W} | {v} | {fmt(steps)} | {st.median(steps):.1f} | {fmt(comm)} | {st.median(comm):.1f} |")
PY
