#!/usr/bin/env bash
# The weight budget (memory.weights_budget, train/weight_budget.h; issue 14): a LoRA fine-tune whose frozen base is
# read in place from its file, resident vs budgets of 1/2 and 1/4 of the base's bytes, and the same base copied
# into the arena (no budget). Per run: median tokens/s over steps 2.., the bytes read in place, the base's resident
# bytes after the last unit of a step (max over steps) and the most seen before a release, bytes faulted in ahead of
# use by the prefetch thread and released per step, major faults over the run, bytes read from storage per step
# (the process's file system inputs, whole run over steps), the process's peak RSS.
# The base: CONFIG (default configs/bench_dense.json, ~30M parameters, 120 MiB f32) trained for one step.
# With HF=1 the base is first written by export-hf (a model with gdn layers: Qwen3-Next, routed experts one tensor per
# expert) and read from that directory. SETS: more `--set` words for the model (one string, split on spaces).
# With MXFP4=1 (implies HF=1) export-hf writes the routed experts in MXFP4 (--expert-dtype mxfp4, Kimi K3's release
# layout) and the fine-tunes hold them in MXFP4 (model.lora.expert_dtype=mxfp4): the budget reads them in place.
# With HF=1 the budgets are fractions of the directory's safetensors bytes.
# With EVICT=1 a helper (bench/evict_page_cache.py) drops the base's files from the page cache every 20 ms during the
# budgeted runs (posix_fadvise DONTNEED: only pages no process maps, i.e. what the budget released), so that every
# re-map reads storage (major faults): a base larger than the page cache, on a machine whose memory holds it.
# Usage: [HF=1] [MXFP4=1] [EVICT=1] bench/weight_budget.sh [CONFIG] [STEPS] [SETS]
set -euo pipefail
cd "$(dirname "$0")/.."
cfg=${1:-configs/bench_dense.json}
steps=${2:-6}
read -r -a sets <<< "${3:-}"
bin=${TESSERA_BIN:-build/apps/tessera}
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
common=(--set train.eval_interval=0 --set train.checkpoint_interval=0 --set train.eval_batches=0 "${sets[@]}")
$bin train --config "$cfg" --steps 1 --out "$tmp/base" "${common[@]}" > "$tmp/base.log"
base="$tmp/base"
base_mib=$(python3 -c "import os,sys; print(os.path.getsize(sys.argv[1]) >> 20)" "$tmp/base/checkpoints/step_0000001/model.safetensors")
lora=(--set model.lora.rank=16 --set model.lora.alpha=32
      --set 'model.lora.target_modules=["q_proj","k_proj","v_proj","o_proj","gate_proj","up_proj","down_proj"]')
kind="f32"
export_args=()
if [ "${MXFP4:-0}" = 1 ]; then
    HF=1
    export_args=(--expert-dtype mxfp4)
    lora+=(--set model.lora.expert_dtype=mxfp4)
    kind="f32, routed experts in MXFP4"
fi
if [ "${HF:-0}" = 1 ]; then
    $bin export-hf --checkpoint "$tmp/base" --out "$tmp/hf" "${export_args[@]}" > /dev/null
    base="$tmp/hf"
    base_mib=$(python3 -c "import glob,os,sys; print(sum(os.path.getsize(f) for f in glob.glob(sys.argv[1] + '/*.safetensors')) >> 20)" "$base")
fi
lora+=(--set train.base="$base")
echo "base: $base_mib MiB ($cfg ${3:-}, $kind$([ "${HF:-0}" = 1 ] && echo ", Hugging Face directory")$([ "${EVICT:-0}" = 1 ] && echo ", evicted from the page cache"))"
echo
echo "| budget MiB | tokens/s | vs resident | read in place MiB | base resident after a step MiB (max) | peak before release MiB | prefetched MiB / step | released MiB / step | major faults | read from storage MiB / step | process peak RSS MiB |"
echo "|---|---|---|---|---|---|---|---|---|---|---|"
ref=""
for budget in 0 $((base_mib / 2)) $((base_mib / 4)); do
    out="$tmp/b$budget"
    evictor=""
    if [ "${EVICT:-0}" = 1 ] && [ "$budget" -gt 0 ]; then
        python3 bench/evict_page_cache.py "$base" 0.02 &
        evictor=$!
    fi
    /usr/bin/time -f "%M %I" -o "$out.rss" $bin train --config "$cfg" --steps "$steps" --out "$out" "${common[@]}" "${lora[@]}" \
        --set memory.weights_budget=$budget > "$out.log"
    if [ -n "$evictor" ]; then kill "$evictor"; wait "$evictor" 2> /dev/null || true; fi
    ref=$(python3 - "$out" "$budget" "$ref" <<'PY'
import json, statistics, sys
out, budget, ref = sys.argv[1], int(sys.argv[2]), sys.argv[3]
recs = [json.loads(l) for l in open(out + "/metrics.jsonl") if '"tokens_per_s"' in l]
tps = statistics.median(r["tokens_per_s"] for r in recs[1:])
rss_kib, inblocks = (int(v) for v in open(out + ".rss").read().split()[-2:])
rss = rss_kib / 1024
read = inblocks * 512 / len(recs)  # bytes read from storage per step (file system inputs, 512-byte blocks)
mib = lambda b: f"{b / 2**20:.1f}"
ratio = f"{tps / float(ref):.2f}" if ref else "1.00"
if budget == 0:
    row = ["resident (no budget)", f"{tps:,.0f}", ratio, "-", "all", "-", "-", "-", "-", mib(read), f"{rss:,.0f}"]
else:
    w = [r["weights"] for r in recs]
    n = len(recs)
    row = [str(budget), f"{tps:,.0f}", ratio, mib(w[-1]["mapped_bytes"]), mib(max(x["resident_bytes"] for x in w)),
           mib(w[-1]["peak_resident_bytes"]), mib(w[-1]["prefetched_bytes"] / n), mib(w[-1]["released_bytes"] / n),
           str(w[-1]["major_faults"]), mib(read), f"{rss:,.0f}"]
print("| " + " | ".join(row) + " |", file=sys.stderr)
print(ref or tps)
PY
)
done
