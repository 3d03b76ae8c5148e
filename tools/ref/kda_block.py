"""PyTorch reference of tessera's KDA / GDN block (spec/kda.md §1.2; src/model/layers/kda_block.h),
written from the spec, in float64: RMSNorm -> q/k/v projections -> causal depthwise conv + SiLU
(restarting at every document start) -> per-head L2 norm of q, k -> forget gate (low-rank f_a/f_b
per channel, or GDN's a_proj per head) -> β = σ(b_proj) -> the gated delta rule (the recurrence of
fla's naive_recurrent_kda, in float64) -> head-wise gated RMSNorm with the output gate (low rank
g_a/g_b, or full rank g_proj) -> o_proj, plus the residual.
"""
import math

import torch
import torch.nn.functional as F


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def l2norm(x):
    return x / torch.sqrt((x * x).sum(-1, keepdim=True) + 1e-6)


def causal_conv_silu(x, w, starts):
    """x: [N, C] tokens of one packed row; w: [C, W]; starts: sequence start positions."""
    N, C = x.shape
    W = w.shape[1]
    out = torch.zeros_like(x)
    bounds = list(starts) + [N]
    for s in range(len(starts)):
        a, b = bounds[s], bounds[s + 1]
        seg = x[a:b].t().unsqueeze(0)  # [1, C, L]
        z = F.conv1d(seg, w.unsqueeze(1), padding=W - 1, groups=C)[..., : b - a]
        out[a:b] = F.silu(z[0].t())
    return out


def recurrence(q, k, v, g, beta, scale):
    """One sequence; q, k [T, HV, K] (already expanded to value heads), v [T, HV, V], g [T, HV, K],
    beta [T, HV]: the loop of fla's naive_recurrent_kda, kept in the input dtype."""
    T, HV, K = q.shape
    S = q.new_zeros(HV, K, v.shape[-1])
    outs = []
    for t in range(T):
        S = S * g[t].exp()[..., None]
        S = S + torch.einsum("hk,hv->hkv", beta[t][:, None] * k[t], v[t] - (k[t][..., None] * S).sum(-2))
        outs.append(torch.einsum("hk,hkv->hv", q[t] * scale, S))
    return torch.stack(outs)


def kda_block(p, c, x, starts):
    """p: dict of parameters (tessera names without the layer prefix); c: config dict;
    x: [N, C] one packed row; starts: document starts (row starts included)."""
    return x + kda_attention(p, c, rmsnorm(x, p["input_layernorm.weight"], c["norm_eps"]), starts)


def kda_attention(p, c, h, starts):
    """The block without its input norm and residual: h [N, C] (normed) -> o_proj output [N, C]."""
    H, HV, K, V = c["num_heads"], c["num_v_heads"], c["head_dim"], c["head_v_dim"]
    N = h.shape[0]
    a = "self_attn."
    wqkv = torch.cat([p[a + "q_proj.weight"], p[a + "k_proj.weight"], p[a + "v_proj.weight"]])
    wconv = torch.cat([p[a + "q_conv1d.weight"], p[a + "k_conv1d.weight"], p[a + "v_conv1d.weight"]])
    qkv = causal_conv_silu(h @ wqkv.t(), wconv, starts)
    q = l2norm(qkv[:, : H * K].view(N, H, K))
    k = l2norm(qkv[:, H * K: 2 * H * K].view(N, H, K))
    v = qkv[:, 2 * H * K:].view(N, HV, V)
    if c["scalar_gate"]:
        z = (h @ p[a + "a_proj.weight"].t()).view(N, HV, 1) + p[a + "dt_bias"].view(HV, 1)
    else:
        f = (h @ p[a + "f_a_proj.weight"].t()) @ p[a + "f_b_proj.weight"].t()
        z = f.view(N, HV, K) + p[a + "dt_bias"].view(HV, K)
    A = p[a + "A_log"].exp().view(HV, 1)
    lb = c["gate_lower_bound"]
    g = lb * torch.sigmoid(A * z) if lb < 0 else -A * F.softplus(z)
    g = g.expand(N, HV, K)
    beta = torch.sigmoid(h @ p[a + "b_proj.weight"].t())
    rep = HV // H
    qe, ke = q.repeat_interleave(rep, 1), k.repeat_interleave(rep, 1)
    bounds = list(starts) + [N]
    o = torch.cat([recurrence(qe[s0:s1], ke[s0:s1], v[s0:s1], g[s0:s1], beta[s0:s1], K ** -0.5)
                   for s0, s1 in zip(bounds[:-1], bounds[1:])])
    if c["full_rank_output_gate"]:
        gate = h @ p[a + "g_proj.weight"].t()
    else:
        gate = (h @ p[a + "g_a_proj.weight"].t()) @ p[a + "g_b_proj.weight"].t()
    gate = gate.view(N, HV, V)
    act = torch.sigmoid(gate) if c["output_gate_activation"] == "sigmoid" else F.silu(gate)
    y = rmsnorm(o, p[a + "o_norm.weight"], c["o_norm_eps"]) * act
    return y.reshape(N, HV * V) @ p[a + "o_proj.weight"].t()


def param_shapes(c):
    H, HV, K, V, C, W = c["num_heads"], c["num_v_heads"], c["head_dim"], c["head_v_dim"], c["d_model"], c["conv_size"]
    R = HV if c["scalar_gate"] else c["gate_rank"]
    a = "self_attn."
    s = {"input_layernorm.weight": (C,), a + "q_proj.weight": (H * K, C), a + "k_proj.weight": (H * K, C),
         a + "v_proj.weight": (HV * V, C), a + "q_conv1d.weight": (H * K, W), a + "k_conv1d.weight": (H * K, W),
         a + "v_conv1d.weight": (HV * V, W), a + "b_proj.weight": (HV, C), a + "A_log": (HV,),
         a + "o_norm.weight": (V,), a + "o_proj.weight": (C, HV * V)}
    if c["scalar_gate"]:
        s[a + "a_proj.weight"] = (R, C)
        s[a + "dt_bias"] = (HV,)
    else:
        s[a + "f_a_proj.weight"] = (R, C)
        s[a + "f_b_proj.weight"] = (HV * K, R)
        s[a + "dt_bias"] = (HV * K,)
    if c["full_rank_output_gate"]:
        s[a + "g_proj.weight"] = (HV * V, C)
    else:
        s[a + "g_a_proj.weight"] = (V, C)
        s[a + "g_b_proj.weight"] = (HV * V, V)
    return s
