"""PyTorch reference of tessera's MLA / gated DSA block (spec/dsa.md §1-§3), written from the spec in MLA's
MHA mode (per-head keys k_h = [W_UK_h c | k^R], values W_UV_h c, no absorption) over a dense [N, N] mask:
same sequence, s <= t, and s in the indexer's top-k set for DSA layers. O(N^2): for golden files only.

The indexer reads detached inputs; its KL loss (teacher = the head mean of this layer's attention
probabilities, detached) is returned next to the block output, so autograd gives the LM gradients of
the trunk and the KL gradients of the indexer separately.
"""
import torch


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def layernorm(x, w, b, eps):
    return torch.nn.functional.layer_norm(x, (x.shape[-1],), w, b, eps)


def rope(x, pos, theta, interleaved):
    """x [N, heads, D] rotated by pos [N]; pairs (2i, 2i+1) or (i, i + D/2), angle pos * theta^(-2i/D)."""
    D = x.shape[-1]
    inv = theta ** (-torch.arange(0, D // 2, dtype=x.dtype) * 2.0 / D)
    ang = pos.to(x.dtype)[:, None, None] * inv
    cos, sin = ang.cos(), ang.sin()
    if interleaved:
        a, b = x[..., 0::2], x[..., 1::2]
        return torch.stack([a * cos - b * sin, b * cos + a * sin], -1).flatten(-2)
    a, b = x[..., : D // 2], x[..., D // 2:]
    return torch.cat([a * cos - b * sin, b * cos + a * sin], -1)


def param_shapes(c):
    C, H, rq, rkv = c["d_model"], c["num_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_dim"], c["qk_rope_dim"], c["v_head_dim"]
    a = "self_attn."
    s = {"input_layernorm.weight": [C]}
    s[a + ("q_a_proj.weight" if rq else "q_proj.weight")] = [rq if rq else H * (dn + dr), C]
    s[a + "kv_a_proj_with_mqa.weight"] = [rkv + dr, C]
    gate = {"elementwise": H * dv, "headwise": H, "none": 0}[c["output_gate"]]
    if gate:
        s[a + "g_proj.weight"] = [gate, C]
    idx = c["dsa"]["topk"] > 0
    HI, DI = c["dsa"]["heads"], c["dsa"]["head_dim"]
    if idx:
        s[a + "indexer.wk.weight"] = [DI, C]
        s[a + "indexer.weights_proj.weight"] = [HI, C]
    if rq:
        s[a + "q_a_layernorm.weight"] = [rq]
        s[a + "q_b_proj.weight"] = [H * (dn + dr), rq]
    s[a + "kv_a_layernorm.weight"] = [rkv]
    s[a + "kv_b_proj.weight"] = [H * (dn + dv), rkv]
    s[a + "o_proj.weight"] = [C, H * dv]
    if idx:
        s[a + "indexer.wq_b.weight"] = [HI * DI, rq if rq else C]
        s[a + "indexer.k_norm.weight"] = [DI]
        s[a + "indexer.k_norm.bias"] = [DI]
    return s


def candidates(N, T, cu):
    """[N, N] bool: s is a candidate of t (s <= t, same batch row, same packed document)."""
    seg = torch.arange(N) // T
    if cu is not None:
        seg = torch.zeros(N, dtype=torch.long)
        for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
            seg[a:b] = i
    n = torch.arange(N)
    return (seg[:, None] == seg[None, :]) & (n[None, :] <= n[:, None])


def select(I, cand, topk, margin, amax=None):
    """top-k per row under (I desc, s desc); asserts a gap of `margin` at the boundary so that fp32
    rounding in the engine cannot change the set. Exact ties (rows of ReLU zeros) are resolved by the
    index order on both sides; they pass when every tied candidate's largest head dot product `amax`
    is below -margin (so fp32 also gives exactly 0)."""
    N = I.shape[0]
    sel = torch.zeros(N, N, dtype=torch.bool)
    for t in range(N):
        cs = [s for s in range(N) if cand[t, s]]
        order = sorted(cs, key=lambda s: (-float(I[t, s]), -s))
        if len(order) > topk:
            gap = float(I[t, order[topk - 1]] - I[t, order[topk]])
            if margin is not None and gap == 0 and amax is not None:
                tied = [s for s in order if float(I[t, s]) == float(I[t, order[topk]])]
                worst = max(float(amax[t, s]) for s in tied)
                assert worst < -margin, f"row {t}: a tied candidate has a head dot product {worst} near 0"
            assert margin is None or gap == 0 or gap > margin, f"row {t}: selection boundary gap {gap} below {margin}; pick another seed"
        for s in order[:topk]:
            sel[t, s] = True
    return sel


def mla_block(P, c, x, T, cu=None, margin=1e-4):
    """x [N, C] (N = B*T) -> (out [N, C], the indexer's mean KL per row (None without an indexer))."""
    o, kl = mla_attention(P, c, rmsnorm(x, P["input_layernorm.weight"], c["norm_eps"]), T, cu, margin)
    return x + o, kl


def mla_attention(P, c, h, T, cu=None, margin=1e-4):
    """h [N, C] (the normed block input) -> (o_proj output [N, C], mean KL per row or None)."""
    a = "self_attn."
    N = h.shape[0]
    H, rq, rkv = c["num_heads"], c["q_lora_rank"], c["kv_lora_rank"]
    dn, dr, dv = c["qk_nope_dim"], c["qk_rope_dim"], c["v_head_dim"]
    lat_eps = c["latent_eps"]
    pos = torch.arange(N) % T
    if rq:
        cq = rmsnorm(h @ P[a + "q_a_proj.weight"].T, P[a + "q_a_layernorm.weight"], lat_eps)
        q = cq @ P[a + "q_b_proj.weight"].T
    else:
        cq = None
        q = h @ P[a + "q_proj.weight"].T
    q = q.view(N, H, dn + dr)
    kva = h @ P[a + "kv_a_proj_with_mqa.weight"].T
    ckv = rmsnorm(kva[:, :rkv], P[a + "kv_a_layernorm.weight"], lat_eps)
    qn, qr, kr = q[..., :dn], q[..., dn:], kva[:, None, rkv:]
    if c["rope"] and dr:
        qr, kr = rope(qr, pos, c["rope_theta"], True), rope(kr, pos, c["rope_theta"], True)
    kvb = (ckv @ P[a + "kv_b_proj.weight"].T).view(N, H, dn + dv)
    k = torch.cat([kvb[..., :dn], kr.expand(N, H, dr)], -1)
    qf = torch.cat([qn, qr], -1)
    tau = c["softmax_scale"] or (dn + dr) ** -0.5
    z = torch.einsum("thd,shd->hts", qf, k) * tau
    cand = candidates(N, T, cu)
    d = c["dsa"]
    kl = None
    if d["topk"] > 0:
        HI, DI, RI = d["heads"], d["head_dim"], d["rope_dim"]
        hd = h.detach()
        qi = ((cq.detach() if rq else hd) @ P[a + "indexer.wq_b.weight"].T).view(N, HI, DI)
        ki = layernorm(hd @ P[a + "indexer.wk.weight"].T, P[a + "indexer.k_norm.weight"],
                       P[a + "indexer.k_norm.bias"], lat_eps)[:, None, :]
        if RI:
            qi = torch.cat([rope(qi[..., :RI], pos, c["rope_theta"], False), qi[..., RI:]], -1)
            ki = torch.cat([rope(ki[..., :RI], pos, c["rope_theta"], False), ki[..., RI:]], -1)
        wi = (hd @ P[a + "indexer.weights_proj.weight"].T) * (HI * DI) ** -0.5
        dots = torch.einsum("tjd,sd->tjs", qi, ki[:, 0])
        I = torch.einsum("tj,tjs->ts", wi, dots.clamp(min=0))
        support = cand if d["stage"] == "dense_warmup" else select(I.detach(), cand, d["topk"], margin,
                                                                     dots.detach().amax(1))
        z = z.masked_fill(~support[None], float("-inf"))
        prob = torch.softmax(z, -1)
        p = prob.detach().mean(0)  # teacher: head mean, constant
        logpi = torch.log_softmax(I.masked_fill(~support, float("-inf")), -1)
        terms = torch.where(p > 0, p * (torch.log(p.clamp(min=1e-300)) - logpi), torch.zeros_like(p))
        kl = terms.sum(-1).mean()
    else:
        prob = torch.softmax(z.masked_fill(~cand[None], float("-inf")), -1)
    o = torch.einsum("hts,shd->thd", prob, kvb[..., dn:]).reshape(N, H * dv)
    if c["output_gate"] != "none":
        g = torch.sigmoid(h @ P[a + "g_proj.weight"].T)
        o = o * (g if c["output_gate"] == "elementwise" else g.repeat_interleave(dv, -1))
    return o @ P[a + "o_proj.weight"].T, kl
