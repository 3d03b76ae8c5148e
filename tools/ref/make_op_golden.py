"""Writes tests/golden/ops/<case>.safetensors: inputs, output gradients and the expected outputs
and input gradients ("expected.<name>") of every op, computed in float64 by PyTorch (autograd for
gradients). These are independent implementations of the op contracts in docs/ops.md.

Run: python3 tools/ref/make_op_golden.py
"""
import math

import torch
import torch.nn.functional as F

import golden

SEED = 20261129
torch.manual_seed(SEED)
f64 = torch.float64


def randn(*shape, scale=1.0):
    return (torch.randn(*shape, dtype=f64) * scale).requires_grad_(True)


def rope_ref(x, theta, offset):
    B, T, H, D = x.shape
    half = D // 2
    inv_freq = theta ** (-torch.arange(0, half, dtype=f64) * 2.0 / D)
    ang = (torch.arange(T, dtype=f64) + offset)[:, None] * inv_freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1)[None, :, None, :]
    sin = torch.cat([ang.sin(), ang.sin()], -1)[None, :, None, :]
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos + rot * sin


def attention_ref(q, k, v, scale, causal):
    B, T, H, D = q.shape
    rep = H // k.shape[2]
    kk = k.repeat_interleave(rep, dim=2)
    vv = v.repeat_interleave(rep, dim=2)
    scale = scale if scale > 0 else D ** -0.5
    o = F.scaled_dot_product_attention(q.transpose(1, 2), kk.transpose(1, 2), vv.transpose(1, 2),
                                       is_causal=bool(causal), scale=scale).transpose(1, 2)
    s = torch.einsum("bthd,bshd->bhts", q, kk) * scale
    if causal:
        s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
    return o, torch.logsumexp(s, -1)


def write(case, op, inputs, forward, grad_of, params=None, extra_expected=None):
    """forward(**inputs) -> dict of outputs; grad_of: output name -> grad tensor name (d<out>)."""
    params = params or {}
    outs = forward(**inputs)
    tensors = {k: v.detach() for k, v in inputs.items()}
    for name, y in outs.items():
        tensors["expected." + name] = y.detach()
    diff_inputs = {k: v for k, v in inputs.items() if v.dtype == f64 and v.requires_grad}
    loss = 0
    for out_name, grad_name in grad_of.items():
        g = torch.randn_like(outs[out_name])
        tensors[grad_name] = g
        loss = loss + (outs[out_name] * g).sum()
    if grad_of:
        grads = torch.autograd.grad(loss, list(diff_inputs.values()))
        for (name, _), g in zip(diff_inputs.items(), grads):
            tensors["expected.d" + name] = g
    for k, v in (extra_expected or {}).items():
        tensors["expected." + k] = v
    meta = {"op": op}
    meta.update({"param." + k: v for k, v in params.items()})
    golden.save(f"ops/{case}.safetensors", tensors, SEED, **meta)


# linear
write("linear", "linear", dict(x=randn(7, 13), w=randn(5, 13), b=randn(5)),
      lambda x, w, b: {"y": F.linear(x, w, b)}, {"y": "dy"})
write("linear_nobias", "linear", dict(x=randn(33, 70), w=randn(40, 70)),
      lambda x, w: {"y": F.linear(x, w)}, {"y": "dy"})

# embedding: repeated ids accumulate; i32 and i64 ids
for dt, case in ((torch.int64, "embedding"), (torch.int32, "embedding_i32")):
    ids = torch.tensor([3, 1, 3, 0, 9, 3, 1], dtype=dt)
    write(case, "embedding", dict(ids=ids, table=randn(10, 6)),
          lambda ids, table: {"y": F.embedding(ids.long(), table)}, {"y": "dy"})

# rmsnorm
for case, eps in (("rmsnorm", 1e-6), ("rmsnorm_eps", 0.5)):
    write(case, "rmsnorm", dict(x=randn(6, 24), weight=randn(24)),
          lambda x, weight: {"y": x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight},
          {"y": "dy"}, {"eps": eps})

# swiglu
write("swiglu", "swiglu", dict(gate=randn(5, 17, scale=3), up=randn(5, 17)),
      lambda gate, up: {"y": F.silu(gate) * up}, {"y": "dy"})

# cross-entropy with an ignored row, and a wide vocabulary streamed in blocks
targets = torch.tensor([2, -100, 0, 10, 5, 5], dtype=torch.int64)
write("cross_entropy", "cross_entropy", dict(logits=randn(6, 11, scale=2), targets=targets),
      lambda logits, targets: {"loss": F.cross_entropy(logits, targets, ignore_index=-100)}, {"loss": "dloss"})
targets = torch.randint(0, 3000, (9,), dtype=torch.int32)
write("cross_entropy_wide", "cross_entropy", dict(logits=randn(9, 3000, scale=4), targets=targets),
      lambda logits, targets: {"loss": F.cross_entropy(logits, targets.long())}, {"loss": "dloss"})

# rope
write("rope", "rope", dict(x=randn(2, 5, 3, 8)), lambda x: {"y": rope_ref(x, 10000.0, 0)}, {"y": "dy"})
write("rope_offset", "rope", dict(x=randn(1, 6, 2, 16)), lambda x: {"y": rope_ref(x, 500.0, 1000)}, {"y": "dy"},
      {"theta": 500.0, "offset": 1000})

# causal depthwise conv1d
for case, act in (("causal_conv1d", "silu"), ("causal_conv1d_none", "none")):
    def conv(x, w, act=act):
        B, T, C = x.shape
        W = w.shape[1]
        z = F.conv1d(x.transpose(1, 2), w.unsqueeze(1), padding=W - 1, groups=C)[..., :T].transpose(1, 2)
        return {"y": F.silu(z) if act == "silu" else z}
    write(case, "causal_conv1d", dict(x=randn(2, 9, 5), w=randn(5, 4)), conv, {"y": "dy"}, {"activation": act})

# attention: small GQA, non-causal, and multi-tile (T > 128, ragged last tile) with a custom scale
for case, shape, causal, scale in (("attention", (2, 9, 4, 2, 8), 1, 0.0),
                                   ("attention_noncausal", (1, 7, 2, 2, 4), 0, 0.0),
                                   ("attention_tiles", (1, 300, 2, 1, 16), 1, 0.3)):
    B, T, H, HKV, D = shape
    def attn(q, k, v, causal=causal, scale=scale):
        o, lse = attention_ref(q, k, v, scale, causal)
        return {"o": o, "lse": lse}
    write(case, "attention", dict(q=randn(B, T, H, D), k=randn(B, T, HKV, D), v=randn(B, T, HKV, D)), attn,
          {"o": "do"}, {"scale": scale, "causal": causal})

# l2norm (eps inside the sqrt) and the gated RMSNorm of KDA (sigmoid) and GDN (silu) outputs
write("l2norm", "l2norm", dict(x=randn(7, 24)), lambda x: {"y": x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)},
      {"y": "dy"})
for case, act in (("gated_rmsnorm", "sigmoid"), ("gated_rmsnorm_silu", "silu")):
    def grms(x, gate, weight, act=act):
        n = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5) * weight
        return {"y": n * (torch.sigmoid(gate) if act == "sigmoid" else F.silu(gate))}
    write(case, "gated_rmsnorm", dict(x=randn(9, 16), gate=randn(9, 16, scale=2), weight=randn(16)), grms,
          {"y": "dy"}, {"activation": act})

# adamw: one step from a given state, through torch.optim.AdamW itself
param, grad = torch.randn(4, 5, dtype=f64), torch.randn(4, 5, dtype=f64)
m, v = torch.randn(4, 5, dtype=f64) * 0.1, torch.rand(4, 5, dtype=f64) * 0.01
p = torch.nn.Parameter(param.clone())
opt = torch.optim.AdamW([p], lr=0.01, betas=(0.8, 0.95), eps=1e-6, weight_decay=0.1, foreach=False)
opt.state[p] = {"step": torch.tensor(6.0, dtype=f64), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
p.grad = grad.clone()
opt.step()
st = opt.state[p]
golden.save("ops/adamw.safetensors",
            {"param": param, "grad": grad, "m": m, "v": v, "expected.param": p.detach(),
             "expected.m": st["exp_avg"], "expected.v": st["exp_avg_sq"]},
            SEED, op="adamw", **{"param.lr": 0.01, "param.beta1": 0.8, "param.beta2": 0.95, "param.eps": 1e-6,
                                 "param.weight_decay": 0.1, "param.step": 7})

# layernorm (the DSA indexer's key norm) and interleaved rope (MLA); appended last so that the cases above
# keep their random streams
write("layernorm", "layernorm", dict(x=randn(6, 20, scale=2), weight=randn(20), bias=randn(20)),
      lambda x, weight, bias: {"y": F.layer_norm(x, (20,), weight, bias, 1e-6)}, {"y": "dy"})


def rope_interleaved_ref(x, theta, offset):
    B, T, H, D = x.shape
    inv_freq = theta ** (-torch.arange(0, D // 2, dtype=f64) * 2.0 / D)
    ang = (torch.arange(T, dtype=f64) + offset)[:, None] * inv_freq[None, :]
    cos, sin = ang.cos()[None, :, None, :], ang.sin()[None, :, None, :]
    a, b = x[..., 0::2], x[..., 1::2]
    return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)


write("rope_interleaved", "rope", dict(x=randn(2, 7, 3, 8)), lambda x: {"y": rope_interleaved_ref(x, 300.0, 2)},
      {"y": "dy"}, {"theta": 300.0, "offset": 2, "layout": "interleaved"})


# Attention Residuals mixing (spec/kimi_k3.md §2.2), written from the formula: softmax over depth of
# w · RMSNorm_γ(v_i), applied to the raw sources
def attn_res_mix_ref(sources, gamma, w, eps=1e-6):
    xh = sources * torch.rsqrt(sources.pow(2).mean(-1, keepdim=True) + eps)
    p = torch.softmax((xh * gamma * w).sum(-1), 0)  # [S, N]
    return {"out": (p[..., None] * sources).sum(0), "probs": p.T.contiguous()}


write("attn_res_mix", "attn_res_mix", dict(sources=randn(4, 6, 24, scale=2), gamma=randn(24), w=randn(24)),
      attn_res_mix_ref, {"out": "dout"})


# YaRN rope (issue 11): frequencies written from the paper's formula as transformers 5 applies it, checked here
# against transformers' own _compute_yarn_parameters (float32) before they are used in float64
def yarn_inv_freq(D, theta, factor, L0, beta_fast, beta_slow, truncate):
    def corr(n):
        return D * math.log(L0 / (n * 2 * math.pi)) / (2 * math.log(theta))
    lo, hi = corr(beta_fast), corr(beta_slow)
    if truncate:
        lo, hi = math.floor(lo), math.ceil(hi)
    lo, hi = max(lo, 0), min(hi, D - 1)
    if lo == hi:
        hi += 0.001
    base = theta ** (-torch.arange(0, D // 2, dtype=f64) * 2.0 / D)
    ramp = ((torch.arange(D // 2, dtype=f64) - lo) / (hi - lo)).clamp(0, 1)
    return base * (1 - ramp) + base / factor * ramp


def yarn_factor(factor, mscale, mscale_all_dim, attention_factor):
    def g(s, m):
        return 1.0 if s <= 1 else 0.1 * m * math.log(s) + 1.0
    if attention_factor:
        return attention_factor
    return g(factor, mscale) / g(factor, mscale_all_dim) if mscale and mscale_all_dim else g(factor, 1)


def check_yarn_against_transformers(D, theta, yarn):
    from transformers import LlamaConfig
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS
    rp = {"rope_type": "yarn", "rope_theta": theta, "factor": yarn["factor"],
          "original_max_position_embeddings": yarn["original_max_position"], "beta_fast": yarn["beta_fast"],
          "beta_slow": yarn["beta_slow"], "truncate": bool(yarn["truncate"])}
    for k in ("mscale", "mscale_all_dim", "attention_factor"):
        if yarn[k]:
            rp[k] = yarn[k]
    cfg = LlamaConfig(hidden_size=4 * D, num_attention_heads=4, head_dim=D, max_position_embeddings=100000,
                      rope_parameters=rp)
    inv, att = ROPE_INIT_FUNCTIONS["yarn"](cfg)
    ours = yarn_inv_freq(D, theta, yarn["factor"], yarn["original_max_position"], yarn["beta_fast"], yarn["beta_slow"],
                         yarn["truncate"])
    assert torch.allclose(inv.double(), ours, rtol=1e-6, atol=0), (inv, ours)
    assert abs(att - yarn_factor(yarn["factor"], yarn["mscale"], yarn["mscale_all_dim"], yarn["attention_factor"])) < 1e-7


def rope_yarn_ref(x, theta, offset, yarn, interleaved):
    B, T, H, D = x.shape
    check_yarn_against_transformers(D, theta, yarn)
    inv_freq = yarn_inv_freq(D, theta, yarn["factor"], yarn["original_max_position"], yarn["beta_fast"],
                             yarn["beta_slow"], yarn["truncate"])
    m = yarn_factor(yarn["factor"], yarn["mscale"], yarn["mscale_all_dim"], yarn["attention_factor"])
    ang = (torch.arange(T, dtype=f64) + offset)[:, None] * inv_freq[None, :]
    cos, sin = m * ang.cos()[None, :, None, :], m * ang.sin()[None, :, None, :]
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    a, b = x[..., :D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


for case, yarn, interleaved in (
        ("rope_yarn", dict(factor=8.0, original_max_position=256, beta_fast=8.0, beta_slow=1.0, mscale=1.0,
                           mscale_all_dim=0.5, attention_factor=0.0, truncate=1), False),
        ("rope_yarn_interleaved", dict(factor=4.0, original_max_position=128, beta_fast=32.0, beta_slow=2.0,
                                       mscale=0.0, mscale_all_dim=0.0, attention_factor=1.25, truncate=0), True)):
    write(case, "rope", dict(x=randn(2, 5, 3, 32)), lambda x: {"y": rope_yarn_ref(x, 10000.0, 1500, yarn, interleaved)},
          {"y": "dy"}, dict(theta=10000.0, offset=1500, layout="interleaved" if interleaved else "half", scaling="yarn",
                            **yarn))


# LoRA (PEFT's Linear: lora_B(lora_A(x)) * scaling), its own seed so the cases above stay as they were
torch.manual_seed(SEED + 1)


def lora_ref(x, a, b, scale):
    return F.linear(F.linear(x, a), b) * scale


write("lora", "lora", dict(x=randn(9, 13), a=randn(3, 13), b=randn(7, 3)),
      lambda x, a, b: {"y": lora_ref(x, a, b, 2.5)}, {"y": "dy"}, dict(scale=2.5))
# routed experts: rows grouped by expert, an empty expert and one holding a single row
offsets = torch.tensor([0, 4, 4, 5, 11], dtype=torch.int64)


def lora_experts_ref(x, a, b, offsets, scale):
    parts = [lora_ref(x[offsets[e]:offsets[e + 1]], a[e], b[e], scale) for e in range(a.shape[0])]
    return torch.cat(parts, 0)


write("lora_experts", "lora_experts", dict(x=randn(11, 6), offsets=offsets, a=randn(4, 2, 6), b=randn(4, 5, 2)),
      lambda x, offsets, a, b: {"y": lora_experts_ref(x, a, b, offsets, 0.75)}, {"y": "dy"}, dict(scale=0.75))
