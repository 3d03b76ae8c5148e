"""Times Kimi K3's image tower forward in PyTorch eager (float32, no grad) at the released shape, on the same grids
as bench/bench_vision, with the reference of make_vision_golden.py (its attention is two einsums per image, as an
eager implementation without a fused kernel computes it). The median of --reps.

    python3 tools/ref/compare_vision_speed.py [--layers 27] [--grids 32x32,16x64] [--reps 3] [--threads 2]
"""
import argparse
import statistics
import time

import torch

from make_vision_golden import tower


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--layers", type=int, default=27)
    ap.add_argument("--grids", default="32x32,16x64")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    c = dict(layers=a.layers, width=1024, heads=12, head_dim=128, ffn_dim=4096, patch_size=14, channels=3,
             pos_height=64, pos_width=64, merge_h=2, merge_w=2, rope_theta=10000.0, norm_eps=2.0 ** -7,
             projector_eps=1e-5, text_width=7168)
    w, qkv, f, pd, mw = 1024, 1536, 4096, 588, 4096
    t = "vision_tower."
    g = torch.Generator().manual_seed(7)

    def mat(rows, cols):
        return (torch.rand(rows, cols, generator=g) - 0.5) * 0.07

    p = {t + "patch_embed.proj.weight": mat(w, pd).reshape(w, 3, 14, 14),
         t + "patch_embed.pos_emb.weight": mat(64 * 64, w).reshape(64, 64, w)}
    for l in range(a.layers):
        b = f"{t}encoder.blocks.{l}."
        p.update({b + "norm0.weight": torch.ones(w), b + "wqkv.weight": mat(3 * qkv, w), b + "wo.weight": mat(w, qkv),
                  b + "norm1.weight": torch.ones(w), b + "mlp.fc0.weight": mat(f, w), b + "mlp.fc1.weight": mat(w, f)})
    p.update({t + "encoder.final_layernorm.weight": torch.ones(w), "mm_projector.proj.0.weight": mat(mw, mw),
              "mm_projector.proj.2.weight": mat(7168, mw), "mm_projector.post_norm.weight": torch.ones(7168)})
    print(f"PyTorch {torch.__version__}, {a.threads} threads, {a.layers} blocks")
    print("| grid | forward s (median) |")
    print("|---|---|")
    with torch.no_grad():
        for item in a.grids.split(","):
            h, wd = (int(x) for x in item.split("x"))
            patches = torch.rand(h * wd, pd, generator=g) * 2 - 1
            times = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                tower(p, patches, [(h, wd)], c)
                times.append(time.perf_counter() - t0)
            print(f"| {h}x{wd} | {statistics.median(times):.3f} |")


if __name__ == "__main__":
    main()
