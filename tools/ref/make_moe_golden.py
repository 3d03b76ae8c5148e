"""Writes tests/golden/ops/{router,moe,situ_glu}_*.safetensors from the PyTorch reference in moe_ref.py:
router variants (softmax / sigmoid, bias, group-limited top-k, scaling, no renormalisation), the MoE
layer (plain, latent projections with the Stable-LatentMoE norm, shared expert, SiTU-GLU, capacity
with re-routing and with dropping, the sequence-wise balance loss and the z-loss), float64 with
autograd gradients.

Run: python3 tools/ref/make_moe_golden.py
"""
import torch

import golden
import moe_ref

SEED = 5
torch.manual_seed(SEED)
f64 = torch.float64


def randn(*shape, scale=1.0, grad=True):
    return (torch.randn(*shape, dtype=f64) * scale).requires_grad_(grad)


def write(case, op, inputs, params, forward, grad_of, extra=None):
    outs = forward(**inputs)
    tensors = {k: v.detach() for k, v in inputs.items()}
    tensors.update(extra or {})
    for name, y in outs.items():
        tensors["expected." + name] = y.detach()
    diff = {k: v for k, v in inputs.items() if v.dtype == f64 and v.requires_grad}
    loss = 0
    for out_name, grad_name in grad_of.items():
        g = torch.randn_like(outs[out_name])
        tensors[grad_name] = g
        loss = loss + (outs[out_name] * g).sum()
    for (name, _), g in zip(diff.items(), torch.autograd.grad(loss, list(diff.values()), allow_unused=True)):
        tensors["expected.d" + name] = g if g is not None else torch.zeros_like(inputs[name])
    meta = {"op": op, "rtol.f32": "2e-5"}
    meta.update({"param." + k: str(v) for k, v in params.items()})
    golden.save(f"ops/{case}.safetensors", tensors, SEED, **meta)


def router_case(case, N, D, E, bias=False, **p):
    inputs = dict(x=randn(N, D), w=randn(E, D, scale=0.5))
    if bias:
        inputs["bias"] = randn(E, scale=0.1, grad=False)

    def fwd(x, w, bias=None):
        rp = {k: v for k, v in p.items() if k not in ("normalize",)}
        u, s, _, choice, _ = moe_ref.router(x, w, bias, **rp)
        weights = moe_ref.gate_weights(s, choice, bool(p.get("normalize", 1)), p.get("scaling", 1.0))
        counts = torch.bincount(choice.reshape(-1), minlength=E).to(torch.int32)
        return dict(indices=choice.to(torch.int32), weights=weights, counts=counts, logits=u, scores=s)

    write(case, "router", inputs, p, fwd, {"weights": "dweights"})


router_case("router_softmax", 10, 12, 8, topk=2, score="softmax", normalize=1)
router_case("router_softmax_plain", 10, 12, 8, topk=3, score="softmax", normalize=0, scaling=1.5)
router_case("router_sigmoid_groups", 12, 12, 16, bias=True, topk=4, score="sigmoid", normalize=1, scaling=2.5,
            groups=4, topk_groups=2)
router_case("router_sigmoid_groups_nobias", 12, 12, 16, topk=3, score="sigmoid", normalize=1, groups=8,
            topk_groups=3)

# SiTU-GLU over a range that reaches both saturations
write("situ_glu", "situ_glu", dict(gate=randn(6, 40, scale=6.0), up=randn(6, 40, scale=30.0)), {},
      lambda gate, up: {"y": moe_ref.situ(gate, up)}, {"y": "dy"})


def moe_case(case, N=24, D=16, E=8, F=12, L=None, FS=None, bias=False, norm=False, seq=None, **p):
    inputs = dict(x=randn(N, D), router_w=randn(E, D, scale=0.5))
    if bias:
        inputs["router_bias"] = randn(E, scale=0.05, grad=False)
    Le = L or D
    inputs.update(w_gate=randn(E, F, Le, scale=Le ** -0.5), w_up=randn(E, F, Le, scale=Le ** -0.5),
                  w_down=randn(E, Le, F, scale=F ** -0.5))
    if L:
        inputs.update(latent_down=randn(L, D, scale=D ** -0.5), latent_up=randn(D, L, scale=L ** -0.5))
        if norm:
            inputs["latent_norm"] = (1.0 + 0.1 * torch.randn(L, dtype=f64)).requires_grad_(True)
    if FS:
        inputs.update(shared_gate=randn(FS, D, scale=D ** -0.5), shared_up=randn(FS, D, scale=D ** -0.5),
                      shared_down=randn(D, FS, scale=FS ** -0.5))
    extra = {}
    if seq:
        extra["cu_seqlens"] = torch.tensor(seq, dtype=torch.int64)

    def fwd(**t):
        q = dict(p)
        q["normalize"] = bool(q.get("normalize", 1))
        return moe_ref.moe(**t, **q, seq_starts=seq)

    grads = {"y": "dy"}
    if p.get("seq_aux_coeff", 0) or p.get("z_loss_coeff", 0):
        grads["aux_loss"] = "daux_loss"
    write(case, "moe", inputs, p, fwd, grads, extra)


moe_case("moe_softmax", topk=2, score="softmax")
moe_case("moe_sigmoid_groups_shared", E=16, topk=3, score="sigmoid", bias=True, scaling=2.5, groups=4, topk_groups=2,
         FS=10)
moe_case("moe_latent_norm_situ", E=16, topk=4, L=8, norm=True, FS=20, bias=True, score="sigmoid",
         activation="situ")
moe_case("moe_latent_plain", E=8, topk=2, L=6, score="softmax", normalize=0)
moe_case("moe_capacity_reroute", N=32, E=8, topk=2, score="sigmoid", bias=True, capacity_factor=1.0,
         overflow="reroute", seq_aux_coeff=0.01, z_loss_coeff=0.001, seq=[0, 10, 32])
moe_case("moe_capacity_drop", N=32, E=8, topk=3, score="softmax", capacity_factor=0.5, overflow="drop")
moe_case("moe_capacity_groups", N=32, E=16, topk=2, score="sigmoid", bias=True, groups=4, topk_groups=2,
         capacity_factor=0.75, overflow="reroute")
