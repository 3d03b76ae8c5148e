"""The MoE layer forward+backward: tessera (build/bench/bench_moe, the "layer" column) against the same
layer in PyTorch eager on the CPU, same sizes, same thread count, alternating, medians.

The PyTorch layer is the usual efficient eager formulation (Hugging Face's DeepSeek/Qwen MoE blocks:
a ModuleList of experts, each with its own weights, and a loop over the experts that have tokens):
softmax router, top-k, renormalised gates, tokens sorted by expert, one F.linear per expert for
gate/up/down, index_add combine; autograd for the backward. (Slicing one stacked [E, F, L] weight
per expert, or slicing the sorted tokens, makes autograd add a full-size zero gradient per slice:
10-100x slower at E = 256; torch.split avoids that.) Sizes: N tokens of width L (no latent projection), experts of
width F.

Run: python3 tools/ref/compare_moe_speed.py
"""
import argparse
import os
import statistics
import subprocess
import time

import torch
import torch.nn.functional as F

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
CONFIGS = [(64, 4), (256, 8), (896, 16)]


def tessera_tokens_per_s(binary, N, L, Fd, threads, reps):
    out = subprocess.run([binary, "--tokens", str(N), "--latent", str(L), "--ffn", str(Fd), "--reps", str(reps)],
                         capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    rates = {}
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 11 and cells[2] == "uniform" and cells[10]:
            rates[(int(cells[0]), int(cells[1]))] = float(cells[10])
    return rates


def moe_layer(x, router_w, w_gate, w_up, w_down, k):
    probs = torch.softmax(x @ router_w.T, -1)  # w_gate, w_up, w_down: one weight per expert
    weights, idx = probs.topk(k, -1)
    weights = weights / weights.sum(-1, keepdim=True)
    flat = idx.reshape(-1)
    order = flat.argsort(stable=True)
    token = order // k
    counts = torch.bincount(flat, minlength=router_w.shape[0]).tolist()
    xs = x[token]
    gs = weights.reshape(-1)[order]
    outs = []
    for e, xe in enumerate(xs.split(counts)):  # split, not slices: one backward for all experts
        if len(xe):
            outs.append(F.linear(F.silu(F.linear(xe, w_gate[e])) * F.linear(xe, w_up[e]), w_down[e]))
    y = torch.cat(outs) * gs[:, None]
    return torch.zeros_like(x).index_add(0, token, y)


def torch_tokens_per_s(N, L, Fd, E, k, reps):
    x = torch.randn(N, L, requires_grad=True)
    router_w = (torch.randn(E, L) * 0.05).requires_grad_()
    w_gate = [(torch.randn(Fd, L) * L ** -0.5).requires_grad_() for _ in range(E)]
    w_up = [(torch.randn(Fd, L) * L ** -0.5).requires_grad_() for _ in range(E)]
    w_down = [(torch.randn(L, Fd) * Fd ** -0.5).requires_grad_() for _ in range(E)]
    dy = torch.randn(N, L)
    times = []
    for _ in range(reps + 1):  # the first run warms up
        t0 = time.perf_counter()
        y = moe_layer(x, router_w, w_gate, w_up, w_down, k)
        y.backward(dy)
        times.append(time.perf_counter() - t0)
    return N / statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "bench_moe"))
    ap.add_argument("--tokens", type=int, default=4096)
    ap.add_argument("--latent", type=int, default=256)
    ap.add_argument("--ffn", type=int, default=128)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--rounds", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; N = {args.tokens}, L = {args.latent}, F = {args.ffn}; "
          "MoE layer forward+backward, tokens/s (median of rounds)")
    t_rates = {c: [] for c in CONFIGS}
    p_rates = {c: [] for c in CONFIGS}
    for _ in range(args.rounds):
        got = tessera_tokens_per_s(args.bench, args.tokens, args.latent, args.ffn, args.threads, args.reps)
        for c in CONFIGS:
            t_rates[c].append(got[c])
            p_rates[c].append(torch_tokens_per_s(args.tokens, args.latent, args.ffn, c[0], c[1], args.reps))
    print("\n| E | k | tessera tok/s | PyTorch eager tok/s | ratio |\n|---|---|---|---|---|")
    for c in CONFIGS:
        t, p = statistics.median(t_rates[c]), statistics.median(p_rates[c])
        print(f"| {c[0]} | {c[1]} | {t:,.0f} | {p:,.0f} | **{t / p:.1f}x** |", flush=True)


if __name__ == "__main__":
    main()
