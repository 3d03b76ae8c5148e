#!/usr/bin/env bash
# Distributed training's memory and all-to-all volume on this machine (issue 13), the demo hybrid
# (configs/demo.json: KDA + gated DSA + LatentMoE, 32 experts top-4, latent 128; or $1, with ep layouts only
# for a model with experts):
#   per-rank memory at W = 1, 2, 4, with FSDP (parallel.fsdp, the default) and ZeRO-2, and W = 2, 4 with
#     parallel.ep = W: rank 0's buffer groups, predicted arena peak, the arena's high-water mark and the
#     process peak RSS, 2 steps each;
#   all-to-all bytes per token per MoE layer (metrics a2a_bytes of step 2, forward) against
#     2·k·L·4·(EP−1)/EP + k·4·(EP−1)/EP (rows out and back, f32, plus the gates; uniform routing).
# Usage: bench/parallel_memory_a2a.sh [CONFIG [--set KEY=VALUE ...]]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/demo.json}
shift || true
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
run() {  # ranks ep fsdp [--set ...] -> the run directory and its log
    local w=$1 ep=$2 fsdp=$3 out="$tmp/w$1ep$2$3"
    shift 3
    local args=(train --config "$cfg" --steps 2 --out "$out" --set train.eval_interval=0
                --set train.checkpoint_interval=0 "$@")
    if [ "$w" = 1 ]; then
        OMP_NUM_THREADS=2 $bin "${args[@]}" > "$out.log"
    else
        mpirun --allow-run-as-root --oversubscribe -n "$w" -x OMP_NUM_THREADS=1 $bin "${args[@]}" \
            --set parallel.ep="$ep" --set parallel.fsdp="$fsdp" > "$out.log"
    fi
}
moe=$(python3 -c "import json,sys; print(1 if json.load(open(sys.argv[1]))['model'].get('moe',{}).get('experts',0) else 0)" "$cfg")
layouts="1:1:false 2:1:false 2:1:true 4:1:false 4:1:true"
[ "$moe" = 1 ] && layouts="$layouts 2:2:true 4:2:true 4:2:false 4:4:true"
echo "| ranks | ep | FSDP | params (incl. gather slots) MiB | param range MiB | grads MiB | grad ranges MiB | optimizer MiB | predicted peak MiB | arena high-water MiB | process peak RSS MiB | a2a bytes/token/layer (measured) | formula |"
echo "|---|---|---|---|---|---|---|---|---|---|---|---|---|"
for layout in $layouts; do
    IFS=: read -r w ep fsdp <<< "$layout"
    run "$w" "$ep" "$fsdp" "$@"
    python3 - "$tmp/w$w""ep$ep$fsdp" "$w" "$ep" "$fsdp" "$cfg" <<'PY'
import json, re, sys
out, w, ep, fsdp, cfg = sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), sys.argv[4] == "true" and int(sys.argv[2]) > 1, sys.argv[5]
log = open(out + ".log").read()
last = log[log.rindex("memory by buffer group"):]
def mib(name):
    return sum(float(x) for x in re.findall(r"(?:^|, |: )" + name + r" ([0-9.]+) MiB", last.split("\n")[0]))
peak = re.search(r"predicted peak ([0-9.]+) MiB, arena high-water mark ([0-9.]+) MiB", last)
rss = re.search(r"process peak RSS ([0-9.]+) MiB", last)
c = json.load(open(cfg))
moe, train = c["model"].get("moe", {}), c["train"]
meas = formula = 0
if ep > 1:
    k, L = moe["topk"], moe.get("latent_dim") or c["model"]["d_model"]
    rec = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"moe"' in l][-1]
    tokens = train["batch_size"] * train["seq_len"] // w
    meas = sum(l["a2a_bytes"] for l in rec["moe"]) / len(rec["moe"]) / tokens
    formula = (2 * k * L * 4 + k * 4) * (ep - 1) / ep
ranges = mib(r"grad\.range\.[a-z]+") + mib(r"grad\.sum\.[a-z]+")
shard, opt = mib(r"params\.shard\.[a-z]+"), mib(r"adamw\.m") + mib(r"adamw\.v")
print(f"| {w} | {ep} | {'yes' if fsdp else 'no'} | {mib('params'):.1f} | {shard:.1f} | {mib('grads'):.1f} | "
      f"{ranges:.1f} | {opt:.1f} | {float(peak.group(1)):.1f} | "
      f"{float(peak.group(2)):.1f} | {float(rss.group(1)):.1f} | {meas:.0f} | {formula:.0f} |")
PY
done
