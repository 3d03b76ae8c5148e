"""KDA forward+backward: tessera's chunked kernel (build/bench/bench_kda) against fla's chunk algorithm
written in PyTorch (fla.ops.kda.naive.naive_chunk_kda, autograd for the backward) on the CPU, same
shapes (B = 1, H = HV = 4, K = V = 128), same thread count, alternating, medians.

Run: python3 tools/ref/compare_kda_speed.py --lengths 4096 16384
"""
import argparse
import importlib.util
import os
import statistics
import subprocess
import time

import torch

import fla

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))
spec = importlib.util.spec_from_file_location("fla_kda_naive", os.path.join(os.path.dirname(fla.__file__), "ops", "kda", "naive.py"))
naive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(naive)


def tessera_ms(binary, T, threads):
    # bench_kda ends with a markdown table: | T | pass | ms | tokens/s | GFLOP/s | share |
    out = subprocess.run([binary, f"--benchmark_filter=BM_kda/{T}/1/", "--benchmark_repetitions=3",
                          "--benchmark_report_aggregates_only=true"],
                         capture_output=True, text=True, check=True, env=dict(os.environ, OMP_NUM_THREADS=str(threads)))
    for line in out.stdout.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if len(cells) == 6 and cells[0] == str(T) and cells[1] == "fwd+bwd":
            return float(cells[2])
    raise RuntimeError("no fwd+bwd row for T = %d in the bench output" % T)


def torch_ms(T, reps):
    H, D = 4, 128
    q = torch.nn.functional.normalize(torch.rand(1, T, H, D), dim=-1).requires_grad_()
    k = torch.nn.functional.normalize(torch.rand(1, T, H, D), dim=-1).requires_grad_()
    v = torch.rand(1, T, H, D).requires_grad_()
    g = (torch.rand(1, T, H, D) * -0.5).requires_grad_()
    beta = torch.rand(1, T, H).requires_grad_()
    times = []
    for _ in range(reps + 1):  # the first run warms up
        t0 = time.perf_counter()
        o, _ = naive.naive_chunk_kda(q, k, v, g, beta)
        o.backward(torch.ones_like(o))
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times[1:])


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--bench", default=os.path.join(ROOT, "build", "bench", "bench_kda"))
    ap.add_argument("--lengths", type=int, nargs="+", default=[4096, 16384])
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    print(f"torch {torch.__version__}, {args.threads} threads; B = 1, H = HV = 4, K = V = 128, chunk 64; forward+backward")
    print("\n| T | tessera ms | fla naive_chunk_kda (PyTorch) ms | ratio |\n|---|---|---|---|")
    for T in args.lengths:
        t = tessera_ms(args.bench, T, args.threads)
        p = torch_ms(T, args.reps)
        print(f"| {T} | {t:.1f} | {p:.0f} | **{p / t:.0f}x** |", flush=True)


if __name__ == "__main__":
    main()
