#!/usr/bin/env bash
# Distributed training's memory and all-to-all volume on this machine (issue 13), the demo hybrid
# (configs/demo.json: KDA + gated DSA + LatentMoE, 32 experts top-4, latent 128; or $1):
#   per-rank memory at W = 1, 2, 4 (data parallel) and W = 2, 4 with parallel.ep = W: rank 0's predicted
#     arena peak, the arena's high-water mark and the process peak RSS, 2 steps each;
#   all-to-all bytes per token per MoE layer (metrics a2a_bytes of step 2, forward) against
#     2·k·L·4·(EP−1)/EP + k·4·(EP−1)/EP (rows out and back, f32, plus the gates; uniform routing).
# Usage: bench/parallel_memory_a2a.sh [CONFIG]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/demo.json}
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # ranks ep -> the memory line and the run directory
    local w=$1 ep=$2 out="$tmp/w$1ep$2"
    if [ "$w" = 1 ]; then
        OMP_NUM_THREADS=2 $bin train --config "$cfg" --steps 2 --out "$out" --set train.eval_interval=0 \
            --set train.checkpoint_interval=0 > "$out.log"
    else
        mpirun --allow-run-as-root --oversubscribe -n "$w" -x OMP_NUM_THREADS=1 $bin train --config "$cfg" --steps 2 \
            --out "$out" --set train.eval_interval=0 --set train.checkpoint_interval=0 --set parallel.ep="$ep" > "$out.log"
    fi
}
echo "| ranks | ep | params MiB | optimizer MiB | predicted peak MiB | arena high-water MiB | process peak RSS MiB | a2a bytes/token/layer (measured) | formula |"
echo "|---|---|---|---|---|---|---|---|---|"
for layout in "1 1" "2 1" "4 1" "2 2" "4 4"; do
    set -- $layout
    run "$1" "$2"
    python3 - "$tmp/w$1ep$2" "$1" "$2" "$cfg" <<'PY'
import json, re, sys
out, w, ep, cfg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
log = open(out + ".log").read()
last = log[log.rindex("memory by buffer group"):]
def mib(name):
    m = re.search(name + r" ([0-9.]+) MiB", last)
    return float(m.group(1)) if m else 0.0
peak = re.search(r"predicted peak ([0-9.]+) MiB, arena high-water mark ([0-9.]+) MiB", last)
rss = re.search(r"process peak RSS ([0-9.]+) MiB", last)
c = json.load(open(cfg))
moe, train = c["model"]["moe"], c["train"]
k, L = moe["topk"], moe.get("latent_dim") or c["model"]["d_model"]
rec = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"moe"' in l][-1]
tokens = train["batch_size"] * train["seq_len"] // w
meas = sum(l["a2a_bytes"] for l in rec["moe"]) / len(rec["moe"]) / tokens if ep > 1 else 0
formula = (2 * k * L * 4 + k * 4) * (ep - 1) / ep
print(f"| {w} | {ep} | {mib('params'):.1f} | {mib('adamw.m') + mib('adamw.v'):.1f} | {float(peak.group(1)):.1f} | "
      f"{float(peak.group(2)):.1f} | {float(rss.group(1)):.1f} | {meas:.0f} | {formula:.0f} |")
PY
done
