"""Training throughput of the demo hybrid (configs/demo.json: KDA x3 + gated DSA, LatentMoE) in tessera vs
the same model in PyTorch eager on the CPU, side by side (alternating rounds, same thread count, medians).

The PyTorch model is written for speed, not as a golden reference: KDA through fla's chunked algorithm in
PyTorch (fla.ops.kda.naive.naive_chunk_kda, autograd backward), the DSA layer in MLA's MHA form over
per-sequence [T, T] scores masked to the indexer's top-k (torch.topk), the indexer KL with detached inputs,
LatentMoE with tokens sorted by expert and one F.linear per expert (compare_moe_speed.py's layout), and
the same AdamW, clipping, batch and sequence length. Same work per step as tessera's (tessera's sparse
kernels skip the masked pairs; at T = 256 and top-64 the dense-masked form costs PyTorch about 4x the
attention FLOPs of the sparse form, which is part of what a user of PyTorch would pay).

Run: python3 tools/ref/compare_hybrid_speed.py [--rounds 3] [--steps 8]
"""
import argparse
import json
import math
import os
import statistics
import subprocess
import sys
import tempfile
import time
import warnings

import torch
import torch.nn as nn
import torch.nn.functional as F

warnings.filterwarnings("ignore")
sys.path.insert(0, os.path.dirname(__file__))
from compare_train_speed import run_tessera  # noqa: E402
from moe_ref import act  # noqa: E402

import fla.ops.kda.naive as fla_naive  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))


def rms(x, w, eps=1e-6):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def lin(o, i):
    return nn.Parameter(torch.randn(o, i) * 0.02)


class Kda(nn.Module):
    def __init__(self, C, H, K, lb):
        super().__init__()
        self.H, self.K, self.lb = H, K, lb
        self.norm = nn.Parameter(torch.ones(C))
        self.qkv, self.conv = lin(3 * H * K, C), nn.Parameter(torch.randn(3 * H * K, 1, 4) * 0.1)
        self.fa, self.fb, self.b = lin(K, C), lin(H * K, K), lin(H, C)
        self.A_log, self.dt = nn.Parameter(torch.zeros(H)), nn.Parameter(torch.zeros(H * K))
        self.g, self.onorm, self.o = lin(H * K, C), nn.Parameter(torch.ones(K)), lin(C, H * K)

    def forward(self, x):
        B, T, C = x.shape
        H, K = self.H, self.K
        h = rms(x, self.norm)
        z = F.conv1d(F.pad((h @ self.qkv.T).transpose(1, 2), (3, 0)), self.conv, groups=3 * H * K).transpose(1, 2)
        q, k, v = F.silu(z).split(H * K, -1)
        q = F.normalize(q.view(B, T, H, K), dim=-1)
        k = F.normalize(k.view(B, T, H, K), dim=-1)
        f = (h @ self.fa.T) @ self.fb.T + self.dt
        g = self.lb * torch.sigmoid(self.A_log.exp().repeat_interleave(K) * f)
        beta = torch.sigmoid(h @ self.b.T)
        o, _ = fla_naive.naive_chunk_kda(q, k, v.view(B, T, H, K), g.view(B, T, H, K), beta)
        y = rms(o, self.onorm, 1e-5).reshape(B, T, H * K) * torch.sigmoid(h @ self.g.T)
        return x + y @ self.o.T


class Dsa(nn.Module):
    def __init__(self, C, H, rq, rkv, dn, dr, dv, HI, DI, topk):
        super().__init__()
        self.H, self.dn, self.dr, self.dv, self.rkv, self.HI, self.DI, self.topk = H, dn, dr, dv, rkv, HI, DI, topk
        self.norm = nn.Parameter(torch.ones(C))
        self.qa, self.qnorm, self.qb = lin(rq, C), nn.Parameter(torch.ones(rq)), lin(H * (dn + dr), rq)
        self.kva, self.kvnorm, self.kvb = lin(rkv + dr, C), nn.Parameter(torch.ones(rkv)), lin(H * (dn + dv), rkv)
        self.g, self.o = lin(H * dv, C), lin(C, H * dv)
        self.iq, self.ik, self.iw = lin(HI * DI, rq), lin(DI, C), lin(HI, C)
        self.iknorm_w, self.iknorm_b = nn.Parameter(torch.ones(DI)), nn.Parameter(torch.zeros(DI))
        self.kl = 0.0

    def forward(self, x):
        B, T, C = x.shape
        H, dn, dr, dv = self.H, self.dn, self.dr, self.dv
        h = rms(x, self.norm)
        cq = rms(h @ self.qa.T, self.qnorm)
        q = (cq @ self.qb.T).view(B, T, H, dn + dr)
        kva = h @ self.kva.T
        kvb = (rms(kva[..., : self.rkv], self.kvnorm) @ self.kvb.T).view(B, T, H, dn + dv)
        k = torch.cat([kvb[..., :dn], kva[..., None, self.rkv:].expand(B, T, H, dr)], -1)
        z = torch.einsum("bthd,bshd->bhts", q, k) / math.sqrt(dn + dr)
        # indexer on detached inputs (NoPE layer; the indexer's rotary is a cheap elementwise op, left out)
        qi = (cq.detach() @ self.iq.T).view(B, T, self.HI, self.DI)
        ki = F.layer_norm(h.detach() @ self.ik.T, (self.DI,), self.iknorm_w, self.iknorm_b, 1e-6)
        wi = (h.detach() @ self.iw.T) / math.sqrt(self.HI * self.DI)
        I = torch.einsum("btj,btjs->bts", wi, torch.einsum("btjd,bsd->btjs", qi, ki).relu())
        causal = torch.ones(T, T, dtype=torch.bool).tril()
        Im = I.masked_fill(~causal, float("-inf"))
        sel = torch.zeros(B, T, T, dtype=torch.bool).scatter_(-1, Im.detach().topk(min(self.topk, T), -1).indices, True)
        sel &= causal
        p = torch.softmax(z.masked_fill(~sel[:, None], float("-inf")), -1)
        teacher = p.detach().mean(1)
        logpi = torch.log_softmax(I.masked_fill(~sel, float("-inf")), -1)
        self.kl = (teacher * (torch.log(teacher.clamp(min=1e-30)) - logpi)).masked_fill(~sel, 0).sum(-1).mean()
        o = torch.einsum("bhts,bshd->bthd", p, kvb[..., dn:]).reshape(B, T, H * dv)
        return x + (o * torch.sigmoid(h @ self.g.T)) @ self.o.T


class Mlp(nn.Module):
    def __init__(self, C, Fd):
        super().__init__()
        self.norm, self.gu, self.d = nn.Parameter(torch.ones(C)), lin(2 * Fd, C), lin(C, Fd)

    def forward(self, x):
        g, u = (rms(x, self.norm) @ self.gu.T).chunk(2, -1)
        return x + (F.silu(g) * u) @ self.d.T


class LatentMoe(nn.Module):
    def __init__(self, C, E, k, Fd, L, FS):
        super().__init__()
        self.k = k
        self.norm, self.router = nn.Parameter(torch.ones(C)), lin(E, C)
        self.bias = torch.zeros(E)
        self.down, self.up, self.lnorm = lin(L, C), lin(C, L), nn.Parameter(torch.ones(L))
        self.w_gate = nn.ParameterList(lin(Fd, L) for _ in range(E))
        self.w_up = nn.ParameterList(lin(Fd, L) for _ in range(E))
        self.w_down = nn.ParameterList(lin(L, Fd) for _ in range(E))
        self.sg, self.su, self.sd = lin(FS, C), lin(FS, C), lin(C, FS)

    def forward(self, x):
        B, T, C = x.shape
        h = rms(x, self.norm).reshape(B * T, C)
        s = torch.sigmoid(h @ self.router.T)
        idx = (s.detach() + self.bias).topk(self.k, -1).indices
        w = s.gather(-1, idx)
        w = w / w.sum(-1, keepdim=True)
        zl = h @ self.down.T
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)
        token = order // self.k
        counts = torch.bincount(flat, minlength=len(self.w_gate)).tolist()
        outs = []
        for e, ze in enumerate(zl[token].split(counts)):
            if len(ze):
                outs.append(F.linear(act(F.linear(ze, self.w_gate[e]), F.linear(ze, self.w_up[e]), "situ"),
                                     self.w_down[e]))
        c = torch.zeros_like(zl).index_add(0, token, torch.cat(outs) * w.reshape(-1)[order][:, None])
        y = rms(c, self.lnorm) @ self.up.T + act(h @ self.sg.T, h @ self.su.T, "situ") @ self.sd.T
        return x + y.view(B, T, C)


class Hybrid(nn.Module):
    def __init__(self, c):
        super().__init__()
        m = c["model"]
        C, V = m["d_model"], m["vocab_size"]
        kd, ml, moe = m["kda"], m["mla"], m["moe"]
        self.emb = nn.Parameter(torch.randn(V, C) * 0.02)
        self.layers = nn.ModuleList()
        for i, t in enumerate(m["attention"]):
            if t == "kda":
                self.layers.append(Kda(C, kd["num_heads"], kd["head_dim"], kd["gate_lower_bound"]))
            else:
                d = ml["dsa"]
                self.layers.append(Dsa(C, m["n_heads"], ml["q_lora_rank"], ml["kv_lora_rank"], ml["qk_nope_dim"],
                                       ml["qk_rope_dim"], ml["v_head_dim"], d["heads"], d["head_dim"], d["topk"]))
            self.layers.append(Mlp(C, m["ffn_dim"]) if i < moe["first_dense"] else
                               LatentMoe(C, moe["experts"], moe["topk"], moe["ffn_dim"], moe["latent_dim"],
                                         moe["shared_ffn_dim"]))
        self.norm, self.head = nn.Parameter(torch.ones(C)), lin(V, C)

    def forward(self, ids, targets):
        x = self.emb[ids]
        for layer in self.layers:
            x = layer(x)
        logits = rms(x, self.norm) @ self.head.T
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        kl = sum(l.kl for l in self.layers if isinstance(l, Dsa))
        return loss, kl


def run_torch(c, steps, warmup):
    torch.manual_seed(0)
    model = Hybrid(c)
    t = c["train"]
    opt = torch.optim.AdamW(model.parameters(), lr=t["lr"], betas=(t["beta1"], t["beta2"]),
                            weight_decay=t["weight_decay"], foreach=False)
    B, T, V = t["batch_size"], t["seq_len"], c["model"]["vocab_size"]
    rates = []
    for step in range(steps):
        ids, targets = torch.randint(0, V, (B, T)), torch.randint(0, V, (B, T))
        t0 = time.perf_counter()
        opt.zero_grad(set_to_none=True)
        loss, kl = model(ids, targets)
        (loss + kl).backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), t["grad_clip"])
        opt.step()
        dt = time.perf_counter() - t0
        if step >= warmup:
            rates.append(B * T / dt)
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "demo.json"))
    ap.add_argument("--binary", default=os.path.join(ROOT, "build", "apps", "tessera"))
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=8)
    ap.add_argument("--tessera-steps", type=int, default=40)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    with open(a.config) as f:
        c = json.load(f)
    rows = []
    for r in range(a.rounds):
        ours, _ = run_tessera(a.binary, a.config, a.tessera_steps, a.threads, 10)
        theirs = run_torch(c, a.steps, 2)
        rows.append((ours, theirs))
        print(f"round {r + 1}: tessera {ours:,.0f} tok/s, PyTorch {theirs:,.0f} tok/s, ratio {ours / theirs:.2f}",
              flush=True)
    ours, theirs = statistics.median(x for x, _ in rows), statistics.median(y for _, y in rows)
    print(f"\n| model | tessera tok/s | PyTorch eager tok/s | ratio |\n|---|---|---|---|\n"
          f"| {os.path.basename(a.config)} | {ours:,.0f} | {theirs:,.0f} | **{ours / theirs:.2f}x** |")


if __name__ == "__main__":
    main()
