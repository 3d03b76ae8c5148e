#!/usr/bin/env bash
# Frozen routed experts held in f32, bf16 and MXFP4 (model.lora.expert_dtype; issue 14): a LoRA fine-tune (rank 16
# on attention, the dense MLP, the shared and every routed expert) of an MoE base, the three in alternating rounds.
# Per run: median tokens/s over steps 2.., the memory line's predicted peak and parameter bytes, the process's peak
# RSS. The base: CONFIG (default configs/moe_small.json) trained for one step.
# Usage: bench/expert_dtype.sh [CONFIG] [STEPS] [ROUNDS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/moe_small.json}
steps=${2:-6}
rounds=${3:-3}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--set train.eval_interval=0 --set train.checkpoint_interval=0 --set train.eval_batches=0)
$bin train --config "$cfg" --steps 1 --out "$tmp/base" "${common[@]}" > "$tmp/base.log"
lora=(--set train.base="$tmp/base" --set model.lora.rank=16 --set model.lora.alpha=32
      --set 'model.lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')
echo "base: $cfg trained 1 step; $(nproc) threads; $(grep -m1 'model name' /proc/cpuinfo | cut -d: -f2 | xargs)"
echo
echo "| round | expert dtype | tokens/s | vs f32 | params MiB (memory line) | predicted peak MiB | process peak RSS MiB |"
echo "|---|---|---|---|---|---|---|"
for round in $(seq "$rounds"); do
    ref=""
    for dtype in f32 bf16 mxfp4; do
        out="$tmp/r$round-$dtype"
        /usr/bin/time -f "%M" -o "$out.rss" $bin train --config "$cfg" --steps "$steps" --out "$out" "${common[@]}" \
            "${lora[@]}" --set model.lora.expert_dtype=$dtype > "$out.log"
        ref=$(python3 - "$out" "$round" "$dtype" "$ref" <<'PY'
import json, re, statistics, sys
out, rnd, dtype, ref = sys.argv[1:5]
recs = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"tokens_per_s"' in l]
tps = statistics.median(r["tokens_per_s"] for r in recs[1:])
rss = int(open(out + ".rss").read().split()[-1]) / 1024
log = open(out + ".log").read()
params = re.search(r"params ([0-9.]+) MiB", log)
peak = re.search(r"predicted peak ([0-9.]+) MiB", log)
ratio = f"{tps / float(ref):.2f}" if ref else "1.00"
row = [rnd, dtype, f"{tps:,.0f}", ratio, params.group(1) if params else "?", peak.group(1) if peak else "?",
       f"{rss:,.0f}"]
print("| " + " | ".join(row) + " |", file=sys.stderr)
print(ref or tps)
PY
)
    done
done
