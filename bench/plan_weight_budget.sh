#!/usr/bin/env bash
# The planner's weight budget search against measured runs (issue 16; docs/plan.md, "Weight budget"). A LoRA fine-tune
# of a base (CONFIG, default configs/bench_dense.json, trained one step: 99 MiB f32, held in f32 so that it is read in
# place) on one rank of this machine:
#   1. `tessera calibrate` measures the machine, storage's read rate included (host.read_bandwidth_gbs);
#   2. the device's memory is capped so that no layout fits with the base in the arena: the smallest layout's arena
#      without the base, its two largest units and 3/4 of the rest of the base (from a plan with a given budget);
#   3. the plan under that cap (no budget given: the search fits the largest budget into each layout) is written and
#      hashed before any run;
#   4. each of the TOP fitting layouts (their offloaded twins left out: a LoRA's few moments change nothing) trains STEPS steps with its budget while a helper evicts the released base from
#      the page cache (bench/evict_page_cache.py: every re-map reads storage, as on a machine whose memory does not
#      hold the base), and again resident (no budget, no cap), for the page-ins' measured cost.
# Per layout: predicted vs measured step (median over REPEATS of each run's median of steps 3..STEPS; the repeats
# interleaved), the page-ins priced vs the measured difference to the resident run, the base bytes priced as read back per step vs the run's released bytes per step, the predicted
# peak (arena + the base's resident bound) vs the measured (arena high-water mark + the most of the base resident
# when leaving a unit, before releasing), the process's (+ the calibrated reserve) vs its largest resident set;
# over the layouts: MAPE, Kendall's tau, the pick's regret.
# Usage: TESSERA_BIN=build/apps/tessera bench/plan_weight_budget.sh [CONFIG] [STEPS] [TOP] [REPEATS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/bench_dense.json}
steps=${2:-8}
top=${3:-6}
repeats=${4:-2}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
evictor=""
trap '[ -z "$evictor" ] || kill "$evictor" 2> /dev/null || true; rm -rf "$tmp"' EXIT
common=(--set train.eval_interval=0 --set train.checkpoint_interval=0 --set train.eval_batches=0)
$bin train --config "$cfg" --steps 1 --out "$tmp/base" "${common[@]}" > /dev/null
lora=(--set model.lora.rank=16 --set model.lora.alpha=32 --set model.lora.base_dtype=f32 --set train.base="$tmp/base"
      --set 'model.lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')

$bin calibrate --model "$cfg" --out "$tmp/cal.json" > /dev/null
$bin plan "$cfg" --mode lora "${lora[@]}" --set memory.weights_budget=1 --cluster "$tmp/cal.json" --threads 2 \
    --json "$tmp/given.json" > /dev/null
python3 - "$tmp" <<'PY'
import json, sys
tmp = sys.argv[1]
given = json.load(open(f"{tmp}/given.json"))["candidates"]
least = min(given, key=lambda c: c["memory"]["arena_bytes"])["memory"]
floor = least["mapped_floor_bytes"]
usable = least["arena_bytes"] + floor + (least["mapped_bytes"] - floor) * 3 / 4
cal = json.load(open(f"{tmp}/cal.json"))
d = cal["device"]
d["memory_gb"] = (usable / 1e9 + d["reserved_gb"]) / d["usable_fraction"]
json.dump(cal, open(f"{tmp}/capped.json", "w"), indent=1)
PY
$bin plan "$cfg" --mode lora "${lora[@]}" --cluster "$tmp/capped.json" --threads 2 --top 8 --json "$tmp/plan.json"
# the same layouts resident (no cap): their predictions for the resident runs
$bin plan "$cfg" --mode lora "${lora[@]}" --cluster "$tmp/cal.json" --threads 2 --json "$tmp/resident.json" > /dev/null
echo "predictions written before the runs: sha256 $(cat "$tmp/plan.json" "$tmp/resident.json" "$tmp/capped.json" |
    sha256sum | cut -c1-16)"

python3 - "$tmp" "$top" > "$tmp/layouts" <<'PY'
import json, sys
tmp, top = sys.argv[1], int(sys.argv[2])
fit = [c for c in json.load(open(f"{tmp}/plan.json"))["candidates"] if c["fits"] and not c["layout"]["offload"]]
for c in fit[:top]:
    l = c["layout"]
    print(l["micro_batch"], json.dumps(l["recompute"]).replace(" ", ""), l["weights_budget"])
PY
for rep in $(seq 1 "$repeats"); do
    while read -r micro rec budget; do
        run="$tmp/run-$micro-${rec//[^a-z]/}"
        args=(train --config "$cfg" --steps "$steps" "${common[@]}" "${lora[@]}" --set train.micro_batch_size="$micro"
              --set train.recompute="$rec")
        $bin --threads 2 "${args[@]}" --out "$run-resident-$rep" > /dev/null
        python3 bench/evict_page_cache.py "$tmp/base" 0.02 &
        evictor=$!
        $bin --threads 2 "${args[@]}" --set memory.weights_budget="$budget" --out "$run-budget-$rep" > /dev/null
        kill "$evictor"
        wait "$evictor" 2> /dev/null || true
        evictor=""
    done < "$tmp/layouts"
done

python3 - "$tmp" "$repeats" <<'PY'
import itertools, json, statistics, sys
tmp, repeats = sys.argv[1], int(sys.argv[2])
plan = [c for c in json.load(open(f"{tmp}/plan.json"))["candidates"] if c["fits"] and not c["layout"]["offload"]]
resident = [c for c in json.load(open(f"{tmp}/resident.json"))["candidates"] if not c["layout"]["offload"]]
cal = json.load(open(f"{tmp}/capped.json"))
usable = cal["device"]["memory_gb"] * 1e9 * cal["device"]["usable_fraction"] - cal["device"]["reserved_gb"] * 1e9
mib = lambda b: f"{b / 2**20:.1f}"
rows = []
for line in open(f"{tmp}/layouts"):
    micro, rec, budget = line.split()
    same = lambda c: (c["layout"]["micro_batch"] == int(micro) and
                      json.dumps(c["layout"]["recompute"]).replace(" ", "") == rec)
    c = next(c for c in plan if same(c))
    pred_resident = next(c for c in resident if same(c))["step_seconds"]["total"]
    name = "".join(ch for ch in rec if ch.isalpha())
    runs = {k: [[json.loads(l) for l in open(f"{tmp}/run-{micro}-{name}-{k}-{rep}/metrics.jsonl") if '"step_ms"' in l]
                for rep in range(1, repeats + 1)] for k in ("resident", "budget")}
    ms = {k: statistics.median(statistics.median(r["step_ms"] for r in v[2:]) for v in vs) / 1e3
          for k, vs in runs.items()}
    recs = {k: vs[0] for k, vs in runs.items()}  # (bytes and memory: the first repeat's; they repeat)
    w = [r["weights"] for r in recs["budget"]]
    released = (w[-1]["released_bytes"] - w[0]["released_bytes"]) / (len(w) - 1)
    t = c["step_seconds"]
    priced = t["page_in"] * cal["host"]["read_bandwidth_gbs"] * 1e9
    peak = recs["budget"][0]["memory"]["arena_peak_bytes"] + w[-1]["peak_resident_bytes"]
    rss = max(r["memory"]["resident_bytes"] for r in recs["budget"])
    label = f"micro {micro}" + ("" if rec == "false" else ", recompute" if rec == "true" else f", recompute {rec}")
    rows.append(dict(label=label, budget=int(budget), pred=t["total"], meas=ms["budget"], resident=ms["resident"],
                     pred_resident=pred_resident,
                     page_in=t["page_in"], priced=priced, released=released, pred_peak=c["memory"]["peak_bytes"],
                     peak=peak, pred_rss=c["memory"]["peak_bytes"] + cal["device"]["reserved_gb"] * 1e9, rss=rss))
print(f"\nusable per device (the cap): {mib(usable)} MiB; read rate {cal['host']['read_bandwidth_gbs']:.2f} GB/s\n")
print("| layout | budget MiB | predicted step ms | measured step ms | error | resident: predicted, measured ms | "
      "page-in priced ms | measured over resident ms | base read back priced MiB / step | released MiB / step | predicted peak MiB | measured peak MiB | "
      "predicted process MiB | measured process MiB |")
print("|---|---|---|---|---|---|---|---|---|---|---|---|---|---|")
for r in rows:
    print(f"| {r['label']} | {r['budget']} | {r['pred']*1e3:.0f} | {r['meas']*1e3:.0f} | "
          f"{100*(r['pred']-r['meas'])/r['meas']:+.1f}% | {r['pred_resident']*1e3:.0f}, {r['resident']*1e3:.0f} | "
          f"{r['page_in']*1e3:.0f} | {(r['meas']-r['resident'])*1e3:+.0f} | "
          f"{mib(r['priced'])} | {mib(r['released'])} | {mib(r['pred_peak'])} | {mib(r['peak'])} | "
          f"{mib(r['pred_rss'])} | {mib(r['rss'])} |")
errors = [abs(r["pred"] - r["meas"]) / r["meas"] for r in rows]
pairs = list(itertools.combinations(rows, 2))
tau = sum((a["pred"] - b["pred"]) * (a["meas"] - b["meas"]) > 0 for a, b in pairs) / len(pairs) * 2 - 1 if pairs else 1
best = min(r["meas"] for r in rows)
print(f"\nstep time MAPE {100*statistics.mean(errors):.1f}%, largest {100*max(errors):.1f}%; Kendall tau {tau:.2f}; "
      f"the pick ({rows[0]['label']}, budget {rows[0]['budget']} MiB) measured {rows[0]['meas']/best:.2f}x the best; "
      f"every measured peak within the cap: {all(r['peak'] <= usable for r in rows)}")
res = [abs(r["pred_resident"] - r["resident"]) / r["resident"] for r in rows]
print(f"the same layouts resident: MAPE {100*statistics.mean(res):.1f}%; page-ins priced / measured over resident: " +
      ", ".join(f"{r['page_in'] / (r['meas'] - r['resident']):.2f}" if r["meas"] > r["resident"] else "-" for r in rows) +
      "; bytes priced / released: " + ", ".join(f"{r['priced'] / r['released']:.2f}" for r in rows))
PY
