"""Training throughput of tessera vs the same model in PyTorch eager on the CPU, side by side.

Alternates rounds (tessera binary, then PyTorch in this process, same thread count), takes the
median tokens/s over each run's steps after warm-up, and prints a markdown table with the ratio.
The PyTorch model is tools/ref/dense_model.py with scaled_dot_product_attention, AdamW with the
same settings, and global-norm clipping: the same work per step.

Run: python3 tools/ref/compare_train_speed.py --config configs/bench_dense.json
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from dense_model import DenseLM, make_optimizer, train_step  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

MODEL_DEFAULTS = {"vocab_size": 258, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 0, "ffn_dim": 768,
                  "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False}
TRAIN_DEFAULTS = {"lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 50, "steps": 1000, "weight_decay": 0.1,
                  "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0}


def run_tessera(binary, config, steps, threads, warmup):
    with tempfile.TemporaryDirectory() as out:
        run = os.path.join(out, "run")
        proc = subprocess.run([binary, "--threads", str(threads), "train", "--config", config, "--steps", str(steps),
                               "--out", run], capture_output=True, text=True, check=True)
        rates = []
        peak = None
        with open(os.path.join(run, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if "tokens_per_s" in rec and rec["step"] > warmup:
                    rates.append(rec["tokens_per_s"])
        for line in proc.stdout.splitlines():
            if "predicted peak" in line:
                peak = line.strip()
        return statistics.median(rates), peak


def run_torch(model_cfg, train_cfg, steps, warmup):
    torch.manual_seed(0)
    model = DenseLM(model_cfg)
    model.set_sdpa(True)
    opt = make_optimizer(model, train_cfg)
    B, T, V = train_cfg["batch_size"], train_cfg["seq_len"], model_cfg["vocab_size"]
    rates = []
    for step in range(steps):
        ids = torch.randint(0, V, (B, T))
        targets = torch.randint(0, V, (B, T))
        t0 = time.perf_counter()
        train_step(model, opt, train_cfg, step, ids, targets)
        dt = time.perf_counter() - t0
        if step >= warmup:
            rates.append(B * T / dt)
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_dense.json"))
    ap.add_argument("--tessera", default=os.path.join(ROOT, "build", "apps", "tessera"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.load(open(args.config))
    model_cfg = dict(MODEL_DEFAULTS, **cfg["model"])
    model_cfg.setdefault("n_kv_heads", model_cfg["n_heads"])
    train_cfg = dict(TRAIN_DEFAULTS, **cfg.get("train", {}))
    rows = []
    peak = None
    for r in range(args.rounds):
        t, peak = run_tessera(args.tessera, args.config, args.steps, args.threads, args.warmup)
        p = run_torch(model_cfg, train_cfg, args.steps, args.warmup)
        rows.append((t, p))
        print(f"round {r + 1}: tessera {t:,.0f} tok/s, PyTorch {p:,.0f} tok/s, ratio {t / p:.2f}", file=sys.stderr)
    torch_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c = model_cfg
    print(f"\nmodel: d={c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads ({c['n_kv_heads']} kv), "
          f"ffn {c['ffn_dim']}, vocab {c['vocab_size']}; batch {train_cfg['batch_size']} x seq {train_cfg['seq_len']}; "
          f"{args.threads} threads; PyTorch {torch.__version__} eager (SDPA attention)\n")
    print("| round | tessera tok/s | PyTorch tok/s | ratio |\n|---|---|---|---|")
    for i, (t, p) in enumerate(rows):
        print(f"| {i + 1} | {t:,.0f} | {p:,.0f} | {t / p:.2f} |")
    ratios = [t / p for t, p in rows]
    print(f"| median | {statistics.median(r[0] for r in rows):,.0f} | {statistics.median(r[1] for r in rows):,.0f} "
          f"| **{statistics.median(ratios):.2f}** |")
    print(f"\ntessera memory: {peak}\nPyTorch process max RSS: {torch_rss:,.0f} MiB")


if __name__ == "__main__":
    main()
