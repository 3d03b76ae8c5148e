"""Writes tests/golden/ops/kda_*.safetensors and kda_gate_*.safetensors from fla's own references:
fla.ops.kda.naive.naive_recurrent_kda (loaded from its file, so the Triton-importing package
__init__ is not needed) and the gate formulas of fla.ops.kda.gate (naive_kda_gate,
naive_kda_lowerbound_gate), with torch autograd for every gradient. Inputs follow fla's
tests/ops/test_kda.py (seed 42; q, k = L2(U[0,1)), v = U[0,1), g = logsigmoid(N(0,1)) with exact
zeros, β = σ(N(0,1)), h0 = N(0,1); the varlen case uses −1000 at masked gate positions).
fla computes in fp32, so these files carry their own tolerances.

Run: pip install flash-linear-attention einops && python3 tools/ref/make_kda_golden.py
"""
import importlib.util
import os

import torch
import torch.nn.functional as F

import golden

SEED = 42
torch.manual_seed(SEED)

import fla  # noqa: E402  (only to locate the installed package)

spec = importlib.util.spec_from_file_location("fla_kda_naive", os.path.join(os.path.dirname(fla.__file__), "ops", "kda", "naive.py"))
naive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(naive)


def kda_case(name, B, T, H, HV, D, mask_p=0.0, h0=True, chunk=64, cu=None, neg_inf_mask=False, normalizer=1.0):
    f32 = torch.float32
    q = F.normalize(torch.rand(B, T, H, D, dtype=f32), dim=-1)
    k = F.normalize(torch.rand(B, T, H, D, dtype=f32), dim=-1)
    v = torch.rand(B, T, HV, D, dtype=f32)
    g = F.logsigmoid(torch.randn(B, T, HV, D, dtype=f32)) / normalizer
    mask = torch.rand(B, T, HV, D) < mask_p
    g = g.masked_fill(mask, -1000.0) if neg_inf_mask else g * (~mask)
    beta = torch.randn(B, T, HV, dtype=f32).sigmoid()
    N = B if cu is None else len(cu) - 1
    s0 = torch.randn(N, HV, D, D, dtype=f32)
    do = torch.randn(B, T, HV, D, dtype=f32)
    dht = torch.randn(N, HV, D, D, dtype=f32)
    leaves = {"q": q, "k": k, "v": v, "g": g, "beta": beta}
    if h0:
        leaves["h0"] = s0
    leaves = {n: t.clone().requires_grad_(True) for n, t in leaves.items()}
    if cu is None:
        o, ht = naive.naive_recurrent_kda(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                          initial_state=leaves.get("h0"), output_final_state=True)
    else:  # the reference runs each packed sequence on its own
        os_, hts = [], []
        for s in range(N):
            a, b = cu[s], cu[s + 1]
            oi, hi = naive.naive_recurrent_kda(*(leaves[n][:, a:b] for n in ("q", "k", "v", "g", "beta")),
                                               initial_state=leaves["h0"][s:s + 1] if h0 else None,
                                               output_final_state=True)
            os_.append(oi)
            hts.append(hi)
        o, ht = torch.cat(os_, 1), torch.cat(hts, 0)
    loss = (o * do).sum() + (ht * dht).sum()
    grads = torch.autograd.grad(loss, list(leaves.values()))
    tensors = {n: t.detach() for n, t in leaves.items()}
    tensors.update({"do": do, "dht": dht, "expected.o": o.detach(), "expected.ht": ht.detach()})
    for (n, _), gr in zip(leaves.items(), grads):
        tensors["expected.d" + n] = gr
    if cu is not None:
        tensors["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    # fla's fp32 recurrence is accurate to ~1e-6 relative here (longer sequences accumulate more)
    golden.save(f"ops/{name}.safetensors", tensors, SEED, op="kda", **{"param.chunk_size": chunk},
                **{"rtol.f64": 2e-5, "rtol.f32": 2e-5}, reference="fla.ops.kda.naive.naive_recurrent_kda")


kda_case("kda_t63", 1, 63, 1, 1, 64)
kda_case("kda_zero_gates", 2, 100, 2, 2, 16, mask_p=0.5)
kda_case("kda_gva", 1, 130, 2, 4, 16, normalizer=4.0)
kda_case("kda_chunk32", 2, 80, 2, 4, 16, chunk=32, h0=False)
kda_case("kda_varlen", 1, 160, 2, 2, 16, mask_p=0.3, cu=[0, 15, 100, 160], neg_inf_mask=True)
kda_case("kda_t1000", 1, 1000, 1, 1, 16, mask_p=0.2)


def gate_case(name, B, T, H, D, lower_bound):
    f32 = torch.float32
    f = (torch.randn(B, T, H, D, dtype=f32) * 3).requires_grad_(True)
    if lower_bound:
        A_log = torch.zeros(H, dtype=f32).uniform_(-1, 1).requires_grad_(True)
    else:
        A_log = torch.log(torch.zeros(H, dtype=f32).uniform_(1, 16)).requires_grad_(True)
    dt_bias = (torch.randn(H * D, dtype=f32) * 0.5).requires_grad_(True)
    # the formulas of fla.ops.kda.gate.naive_kda_gate / naive_kda_lowerbound_gate
    z = f + dt_bias.view(H, D)
    if lower_bound:
        g = lower_bound * torch.sigmoid(A_log.view(H, 1).exp() * z)
    else:
        g = -A_log.view(H, 1).exp() * F.softplus(z)
    dg = torch.randn_like(g)
    gf, gA, gb = torch.autograd.grad((g * dg).sum(), [f, A_log, dt_bias])
    golden.save(f"ops/{name}.safetensors",
                {"f": f.detach(), "A_log": A_log.detach(), "dt_bias": dt_bias.detach().view(H, D), "dg": dg,
                 "expected.g": g.detach(), "expected.df": gf, "expected.dA_log": gA,
                 "expected.ddt_bias": gb.view(H, D)},
                SEED, op="kda_gate", **{"param.lower_bound": lower_bound, "rtol.f64": 1e-6, "rtol.f32": 5e-6},
                reference="fla.ops.kda.gate naive_kda_gate / naive_kda_lowerbound_gate formulas")


gate_case("kda_gate_softplus", 2, 32, 4, 16, 0.0)
gate_case("kda_gate_lowerbound", 1, 64, 3, 32, -5.0)
