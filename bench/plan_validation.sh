#!/usr/bin/env bash
# The planner against measured runs (issue 16; spec/scale.md §9.2): calibrate this machine first (tessera
# calibrate, one rank and two), write every prediction to a file and print its SHA-256 *before* any run, then train
# each layout for STEPS steps and compare the predicted step time with the median measured one (steps 4..STEPS) and
# the predicted rank-0 arena with the measured one. Constants come from the calibration only, never from these runs.
# Prints a markdown table, the MAPE, the largest error, Kendall's tau of the ranking and the pick's regret.
# Usage: bench/plan_validation.sh [CONFIG] [STEPS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/moe_small.json}
steps=${2:-15}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
$bin calibrate --model "$cfg" --out "$tmp/cal1.json" > /dev/null
$bin launch -n 2 -- calibrate --model "$cfg" --out "$tmp/cal2.json" > /dev/null
$bin plan "$cfg" --cluster "$tmp/cal1.json" --ranks 1 --threads 2 --json "$tmp/plan1.json" > /dev/null
$bin plan "$cfg" --cluster "$tmp/cal2.json" --ranks 2 --threads 1 --json "$tmp/plan2.json" > /dev/null
echo "predictions written before the runs: sha256 $(cat "$tmp/plan1.json" "$tmp/plan2.json" | sha256sum | cut -c1-16)"
# the layouts run: (ranks ep fsdp micro recompute)
layouts=("1 1 true 2 false" "1 1 true 8 false" "1 1 true 4 true"
         "2 1 true 8 false" "2 1 true 2 false" "2 2 true 8 false" "2 2 true 4 false"
         "2 1 false 8 false" "2 2 false 4 false" "2 1 true 8 true" "2 2 true 8 true" "2 2 false 2 true")
for l in "${layouts[@]}"; do
    read -r ranks ep fsdp micro rec <<< "$l"
    args="train --config $cfg --steps $steps --set train.eval_interval=0 --set train.checkpoint_interval=0
          --set parallel.ep=$ep --set parallel.fsdp=$fsdp --set train.micro_batch_size=$micro
          --set train.recompute=$rec --out $tmp/run-$ranks-$ep-$fsdp-$micro-$rec"
    if [ "$ranks" = 1 ]; then $bin --threads 2 $args > /dev/null; else $bin launch -n 2 -- $args > /dev/null; fi
done
python3 - "$tmp" "${layouts[@]}" <<'PY'
import json, statistics, sys, itertools
tmp, layouts = sys.argv[1], [l.split() for l in sys.argv[2:]]
plans = {r: json.load(open(f"{tmp}/plan{r}.json"))["candidates"] for r in ("1", "2")}
rows = []
for ranks, ep, fsdp, micro, rec in layouts:
    key = dict(ep=int(ep), fsdp=fsdp == "true", micro_batch=int(micro), recompute=rec == "true")
    cand = next(c for c in plans[ranks] if all(c["layout"][k] == v for k, v in key.items()))
    recs = [json.loads(l) for l in open(f"{tmp}/run-{ranks}-{ep}-{fsdp}-{micro}-{rec}/metrics.jsonl")]
    recs = [r for r in recs if "step_ms" in r]
    measured = statistics.median(r["step_ms"] for r in recs[3:]) / 1e3
    arena = next(r["arena_bytes"] for r in cand["memory"]["ranks"] if r["rank"] == 0)
    rows.append((f"{ranks} rank{'s' if ranks != '1' else ''}, " + (f"ep {ep}, " if ranks != "1" else "") +
                 ("fsdp" if fsdp == "true" else "zero-2") * (ranks != "1") + f"{', ' if ranks != '1' else ''}micro {micro}" +
                 (", recompute" if rec == "true" else ""),
                 cand["step_seconds"]["total"], measured, arena, recs[0]["memory"]["arena_peak_bytes"]))
print("| layout | predicted step ms | measured step ms | error | predicted arena MiB | measured arena MiB |")
print("|---|---|---|---|---|---|")
errs = []
for name, p, m, pa, ma in rows:
    errs.append(abs(p - m) / m)
    print(f"| {name} | {p*1e3:.0f} | {m*1e3:.0f} | {100*(p-m)/m:+.0f}% | {pa/2**20:.1f} | {ma/2**20:.1f} |")
print(f"\nMAPE {100*statistics.mean(errs):.1f}%, largest error {100*max(errs):.1f}%, "
      f"arenas equal: {sum(r[3] == r[4] for r in rows)}/{len(rows)}")
for ranks in ("1", "2"):
    sub = [r for r in rows if r[0].startswith(ranks + " rank")]
    pairs = list(itertools.combinations(sub, 2))
    tau = sum((a[1] - b[1]) * (a[2] - b[2]) > 0 for a, b in pairs) - sum((a[1] - b[1]) * (a[2] - b[2]) < 0 for a, b in pairs)
    pick = min(sub, key=lambda r: r[1]); best = min(sub, key=lambda r: r[2])
    print(f"{ranks} rank(s): Kendall tau {tau/len(pairs):+.2f} over {len(sub)} layouts; the pick ({pick[0]}) "
          f"measures {pick[2]/best[2]:.2f}x the best measured ({best[0]})")
PY
