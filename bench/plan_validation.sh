#!/usr/bin/env bash
# The planner against measured runs (issue 16; spec/scale.md §9.1–§9.2). For each model (default: configs/moe_small.json,
# a GQA + MoE model, and configs/demo.json, the KDA/DSA + LatentMoE hybrid): calibrate this machine with 1, 2 and 4
# ranks (tessera calibrate, ranks side by side as they train), write every prediction to a file and print their
# SHA-256 *before* any run, then train each layout REPEATS times for STEPS steps. Constants come from the calibration
# only, never from these runs. Prints a markdown table per model and, over all layouts:
#   - step time: the median over repeats of each run's median step (steps 4..STEPS), its coefficient of variation
#     over repeats, MAPE, the largest error, Kendall's tau of the ranking per rank count, the pick's regret;
#   - memory: the predicted rank-0 arena against the arena's high-water mark (byte-exact expected), and the predicted
#     resident memory of rank 0 (arena + the calibrated reserve outside it) against its largest resident set;
#   - a posteriori (not a prediction): the step time re-planned with the expert load each run recorded, which shows
#     how much of the error is the routing the blind plan assumes uniform;
#   - fit / OOM: a confusion matrix under memory caps set from the predictions before the runs (each layout's
#     predicted resident memory x 0.97 and x 1.03, every layout of the model against every cap): "fits" measured is
#     the largest resident set at or under the cap. A false fit (predicted to fit, measured over) is the failure that
#     matters.
# TESSERA_BASELINE_BIN=another build: its predictions too, from the same calibrations (written and hashed with the
# others), scored against the same runs: a change to the planner's model, side by side on one set of measurements.
# TESSERA_BASELINE_DROP=KEY: the baseline plans from the calibrations without device.KEY (e.g. beside_fsdp, with
# TESSERA_BASELINE_BIN the same build: a calibrated term against its absence on the same runs).
# Usage: bench/plan_validation.sh [STEPS] [REPEATS] [CONFIG ...]
set -euo pipefail
cd "$(dirname "$0")/.."
steps=${1:-12}
repeats=${2:-3}
shift $(($# > 2 ? 2 : $#))
configs=("$@")
[ ${#configs[@]} -gt 0 ] || configs=(configs/moe_small.json configs/demo.json)
bin=${TESSERA_BIN:-build/apps/tessera}
baseline=${TESSERA_BASELINE_BIN:-}
drop=${TESSERA_BASELINE_DROP:-}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT

# the layouts: (ranks ep fsdp micro recompute shard offload pp [tp]), per model; recompute: true, false or block kinds
# joined by '+'; shard: parallel.shard (0: FSDP over every rank; 2 of 4 ranks: HSDP); offload: memory.optimizer_offload
# (the plans price every layout both ways, --offload all); pp: parallel.pipeline (stages; the planner's split is the even
# one for these 4-layer models); tp: parallel.tensor (1 when absent; micro is then the tensor group's)
layouts_for() {
    case "$(basename "$1" .json)" in
        demo) echo "1 1 true 8 false 0 false 1;1 1 true 4 true 0 false 1;1 1 true 8 moe 0 false 1;2 1 true 8 false 0 false 1;2 2 true 4 false 0 false 1;2 2 false 8 true 0 false 1;2 2 true 8 kda 0 false 1;4 2 true 4 false 0 false 1;4 2 true 4 false 2 false 1;4 4 false 4 false 0 false 1;1 1 true 8 false 0 true 1;2 2 true 4 false 0 true 1;2 1 true 1 false 0 false 2;2 1 true 2 false 0 false 2;4 2 true 2 false 0 false 2;2 1 true 16 false 0 false 1 2;2 1 true 8 true 0 false 1 2;4 2 true 4 false 0 false 1 2" ;;
        *) echo "1 1 true 4 false 0 false 1;1 1 true 16 false 0 false 1;1 1 true 8 true 0 false 1;1 1 true 16 moe 0 false 1;2 1 true 8 false 0 false 1;2 2 true 8 false 0 false 1;2 2 false 4 false 0 false 1;2 1 false 8 true 0 false 1;2 2 true 8 attention 0 false 1;4 1 true 4 false 0 false 1;4 1 true 4 false 2 false 1;4 2 true 4 false 0 false 1;4 4 true 4 false 0 false 1;4 4 false 2 true 0 false 1;1 1 true 4 false 0 true 1;2 2 true 8 false 0 true 1;2 1 true 2 false 0 false 2;4 1 true 2 false 0 false 2;4 1 true 1 false 0 false 4;2 1 true 16 false 0 false 1 2;4 2 true 8 false 0 false 1 2" ;;
    esac
}
# train.recompute's value for a layout's recompute field
recompute_json() { case $1 in true | false) echo "$1" ;; *) echo "[\"${1//+/\",\"}\"]" ;; esac }

for cfg in "${configs[@]}"; do
    name=$(basename "$cfg" .json)
    for r in 1 2 4; do
        if [ "$r" = 1 ]; then
            $bin calibrate --model "$cfg" --out "$tmp/$name-cal$r.json" > /dev/null
        else
            $bin launch -n "$r" -- calibrate --model "$cfg" --out "$tmp/$name-cal$r.json" > /dev/null
        fi
        threads=$((r == 1 ? 2 : 1))
        $bin plan "$cfg" --cluster "$tmp/$name-cal$r.json" --ranks "$r" --threads "$threads" --offload all \
            --json "$tmp/$name-plan$r.json" > /dev/null
        if [ -n "$baseline" ]; then
            cal=$tmp/$name-cal$r.json
            if [ -n "$drop" ]; then
                python3 -c 'import json, sys; c = json.load(open(sys.argv[1])); c["device"].pop(sys.argv[2], None); json.dump(c, open(sys.argv[3], "w"))' \
                    "$cal" "$drop" "$tmp/$name-basecal$r.json"
                cal=$tmp/$name-basecal$r.json
            fi
            $baseline plan "$cfg" --cluster "$cal" --ranks "$r" --threads "$threads" \
                --json "$tmp/$name-baseline$r.json" > /dev/null
        fi
    done
done
echo "predictions written before the runs: sha256 $(cat "$tmp"/*-plan*.json "$tmp"/*-cal*.json | sha256sum | cut -c1-16)"
[ -z "$baseline" ] || echo "the baseline's: sha256 $(cat "$tmp"/*-baseline*.json | sha256sum | cut -c1-16)"

for cfg in "${configs[@]}"; do
    name=$(basename "$cfg" .json)
    IFS=';' read -r -a layouts <<< "$(layouts_for "$cfg")"
    for rep in $(seq 1 "$repeats"); do  # repeats interleaved: the machine's drift spreads over every layout
        for l in "${layouts[@]}"; do
            read -r ranks ep fsdp micro rec shard off pp tp <<< "$l"
            tp=${tp:-1}
            args="train --config $cfg --steps $steps --set train.eval_interval=0 --set train.checkpoint_interval=0
                  --set parallel.ep=$ep --set parallel.fsdp=$fsdp --set parallel.shard=$shard
                  --set train.micro_batch_size=$micro --set train.recompute=$(recompute_json "$rec")
                  --set memory.optimizer_offload=$off --set parallel.pipeline=$pp --set parallel.tensor=$tp
                  --out $tmp/run-$name-$ranks-$ep-$fsdp-$micro-$rec-$shard-$off-$pp-$tp-$rep"
            if [ "$ranks" = 1 ]; then $bin --threads 2 $args > /dev/null; else $bin launch -n "$ranks" -- $args > /dev/null; fi
        done
    done
done

# a posteriori, not a prediction: each layout re-planned with the expert load its first repeat recorded (--routing
# metrics.jsonl), to show how much of the error is the routing the blind plan assumed uniform
for cfg in "${configs[@]}"; do
    name=$(basename "$cfg" .json)
    for d in "$tmp"/run-"$name"-*-1; do
        IFS=- read -r _ ranks _ <<< "${d#"$tmp"/run-"$name"}"
        run=$(basename "$d")
        $bin plan "$cfg" --cluster "$tmp/$name-cal$ranks.json" --ranks "$ranks" --threads $((ranks == 1 ? 2 : 1)) \
            --offload all --routing "$d/metrics.jsonl" --json "$tmp/routed-${run%-1}.json" > /dev/null
    done
done

python3 - "$tmp" "$repeats" "${configs[@]}" <<'PY'
import itertools, json, os, statistics, sys
tmp, repeats, configs = sys.argv[1], int(sys.argv[2]), sys.argv[3:]
rows = []  # (model, ranks, label, predicted s, measured s, cv, pred arena, arena, pred resident, resident)
for cfg in configs:
    name = os.path.basename(cfg)[:-5]
    plans = {r: json.load(open(f"{tmp}/{name}-plan{r}.json"))["candidates"] for r in (1, 2, 4)}
    base = {r: json.load(open(f"{tmp}/{name}-baseline{r}.json"))["candidates"] for r in (1, 2, 4)
            if os.path.exists(f"{tmp}/{name}-baseline{r}.json")}
    reserved = {r: json.load(open(f"{tmp}/{name}-cal{r}.json"))["device"]["reserved_gb"] * 1e9 for r in (1, 2, 4)}
    runs = sorted({d.rsplit("-", 1)[0] for d in os.listdir(tmp) if d.startswith(f"run-{name}-")})
    for run in runs:
        ranks, ep, fsdp, micro, rec, shard, off, pp, tp = run[len(f"run-{name}-"):].split("-")
        ranks = int(ranks)
        recompute = rec == "true" if rec in ("true", "false") else rec.split("+")
        key = dict(ep=int(ep), fsdp=fsdp == "true", micro_batch=int(micro), recompute=recompute, shard=int(shard),
                   offload=off == "true", pipeline=int(pp), pipeline_rerun=False,  # (the runs keep activations)
                   tensor=int(tp))
        # (a baseline build from before HSDP, offload, stages, their re-run or tensor groups names no shard, offload,
        # pipeline, pipeline_rerun or tensor: 0, false, 1, false, 1)
        pick = lambda cands: next((c for c in cands if all(c["layout"].get(k, 1 if k in ("pipeline", "tensor") else 0)
                                                           == v for k, v in key.items())), None)
        cand = pick(plans[ranks])
        routed = pick(json.load(open(f"{tmp}/routed-{run}.json"))["candidates"])
        baseline = pick(base[ranks]) if base else None  # (None: a baseline without this layout)
        medians, arenas, resident = [], [], []
        for rep in range(1, repeats + 1):
            recs = [json.loads(l) for l in open(f"{tmp}/{run}-{rep}/metrics.jsonl")]
            recs = [r for r in recs if "step_ms" in r]
            medians.append(statistics.median(r["step_ms"] for r in recs[3:]) / 1e3)
            arenas.append(recs[0]["memory"]["arena_peak_bytes"])
            resident.append(max(r["memory"]["resident_bytes"] for r in recs))
        arena = next(r["arena_bytes"] for r in cand["memory"]["ranks"] if r["rank"] == 0)
        cv = statistics.stdev(medians) / statistics.mean(medians) if len(medians) > 1 else 0.0
        sharding = ("one rank per stage" if ranks == int(pp) else "zero-2" if fsdp != "true"
                    else f"hsdp {shard}" if shard != "0" else "fsdp")
        label = (f"{ranks} rank{'s' if ranks > 1 else ''}" + (f", pp {pp}" if pp != "1" else "") +
                 (f", tp {tp}" if tp != "1" else "") +
                 (f", ep {ep}, {sharding}"
                 if ranks > 1 else "") + f", micro {micro}" +
                 (", recompute" if rec == "true" else "" if rec == "false" else f", recompute {rec}") +
                 (", offload" if off == "true" else ""))
        rows.append((name, ranks, label, cand["step_seconds"]["total"], statistics.median(medians), cv, arena,
                     max(arenas), arena + reserved[ranks] + cand["memory"].get("offload_resident_bytes", 0), max(resident), routed["step_seconds"]["total"],
                     routed["imbalance"], baseline["step_seconds"]["total"] if baseline else None))

for name in dict.fromkeys(r[0] for r in rows):
    print(f"\n{name}:\n")
    print("| layout | predicted step ms | measured step ms (median of repeats) | CV | error | predicted arena MiB | "
          "measured arena MiB | predicted resident MiB | measured resident MiB | resident error | recorded "
          "imbalance | error with the recorded routing |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        if r[0] != name: continue
        _, _, label, p, m, cv, pa, ma, pr, mr, pp, imb, _ = r
        print(f"| {label} | {p*1e3:.0f} | {m*1e3:.0f} | {100*cv:.1f}% | {100*(p-m)/m:+.0f}% | {pa/2**20:.1f} | "
              f"{ma/2**20:.1f} | {pr/2**20:.1f} | {mr/2**20:.1f} | {100*(pr-mr)/mr:+.1f}% | {imb:.2f} | "
              f"{100*(pp-m)/m:+.0f}% |")

errs = [abs(r[3] - r[4]) / r[4] for r in rows]
based = [r for r in rows if r[12] is not None]  # (a baseline without HSDP does not price those layouts)
if based:
    print("\nthe baseline build's predictions against the same runs:\n\n| layout | measured step ms | predicted | error | "
          "baseline predicted | baseline error |\n|---|---|---|---|---|---|")
    for r in based:
        print(f"| {r[0]}, {r[2]} | {r[4]*1e3:.0f} | {r[3]*1e3:.0f} | {100*(r[3]-r[4])/r[4]:+.1f}% | {r[12]*1e3:.0f} | "
              f"{100*(r[12]-r[4])/r[4]:+.1f}% |")
    base_errs = [abs(r[12] - r[4]) / r[4] for r in based]
    errs_based = [abs(r[3] - r[4]) / r[4] for r in based]
    print(f"\nover these {len(based)} layouts: MAPE {100*statistics.mean(errs_based):.2f}% against the baseline's "
          f"{100*statistics.mean(base_errs):.2f}%; largest error {100*max(errs_based):.1f}% against {100*max(base_errs):.1f}%")
print(f"\n{len(rows)} layouts x {repeats} repeats: step time MAPE {100*statistics.mean(errs):.1f}%, largest error "
      f"{100*max(errs):.1f}%, median CV over repeats {100*statistics.median(r[5] for r in rows):.1f}%; "
      f"arenas equal to the byte: {sum(r[6] == r[7] for r in rows)}/{len(rows)}; resident memory within "
      f"{100*max(abs(r[8]-r[9])/r[9] for r in rows):.1f}% (largest error)")
routed = [abs(r[10] - r[4]) / r[4] for r in rows]
print(f"a posteriori, each layout re-planned with the expert load its run recorded (not a prediction): MAPE "
      f"{100*statistics.mean(routed):.1f}%, largest error {100*max(routed):.1f}%")
for name, ranks in dict.fromkeys((r[0], r[1]) for r in rows):
    sub = [r for r in rows if r[0] == name and r[1] == ranks]
    if len(sub) < 2: continue
    pairs = list(itertools.combinations(sub, 2))
    tau = (sum((a[3] - b[3]) * (a[4] - b[4]) > 0 for a, b in pairs) -
           sum((a[3] - b[3]) * (a[4] - b[4]) < 0 for a, b in pairs)) / len(pairs)
    pick = min(sub, key=lambda r: r[3]); best = min(sub, key=lambda r: r[4])
    print(f"- {name}, {ranks} rank(s): Kendall tau {tau:+.2f} over {len(sub)} layouts; the pick ({pick[2]}) measures "
          f"{pick[4]/best[4]:.2f}x the best measured ({best[2]})")

# fit / OOM under caps set from the predictions
m = {(True, True): 0, (True, False): 0, (False, True): 0, (False, False): 0}
for name in dict.fromkeys(r[0] for r in rows):
    sub = [r for r in rows if r[0] == name]
    caps = [r[8] * f for r in sub for f in (0.97, 1.03)]
    for cap in caps:
        for r in sub:
            m[(r[8] <= cap, r[9] <= cap)] += 1
print("\n| caps x layouts | actually fits | actually OOMs |\n|---|---|---|")
print(f"| predicted fits | {m[(True, True)]} | **{m[(True, False)]}** (false fit) |")
print(f"| predicted OOM | {m[(False, True)]} (false OOM) | {m[(False, False)]} |")
PY
