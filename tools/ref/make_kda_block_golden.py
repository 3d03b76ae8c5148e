"""Writes tests/golden/layers/kda_*.safetensors: a KDA or GDN block's parameters, an input x and
output gradient dy, and the float64 reference output and every gradient (tools/ref/kda_block.py).
First checks that the reference's recurrence equals fla's naive_recurrent_kda (fp32) on these inputs.

Run: python3 tools/ref/make_kda_block_golden.py
"""
import importlib.util
import json
import os

import torch

import golden
from kda_block import kda_block, param_shapes, recurrence

SEED = 3
torch.manual_seed(SEED)
f64 = torch.float64

import fla  # noqa: E402

spec = importlib.util.spec_from_file_location("fla_kda_naive", os.path.join(os.path.dirname(fla.__file__), "ops", "kda", "naive.py"))
naive = importlib.util.module_from_spec(spec)
spec.loader.exec_module(naive)

BASE = {"d_model": 32, "num_heads": 2, "num_v_heads": 4, "head_dim": 16, "head_v_dim": 16, "conv_size": 4,
        "scalar_gate": False, "gate_rank": 8, "gate_lower_bound": 0.0, "full_rank_output_gate": False,
        "output_gate_activation": "sigmoid", "norm_eps": 1e-6, "o_norm_eps": 1e-5, "chunk_size": 32}

CASES = {
    "kda_low_rank": (dict(BASE), 2, 40, None),
    "kda_k3_style": (dict(BASE, gate_lower_bound=-5.0, full_rank_output_gate=True, num_v_heads=2), 1, 70, None),
    "gdn": (dict(BASE, scalar_gate=True, full_rank_output_gate=True, output_gate_activation="silu"), 2, 33, None),
    "kda_packed": (dict(BASE), 1, 80, [0, 9, 50, 80]),
}


def check_against_fla():
    T, HV, K = 50, 2, 8
    q = torch.nn.functional.normalize(torch.rand(1, T, HV, K), dim=-1)
    k = torch.nn.functional.normalize(torch.rand(1, T, HV, K), dim=-1)
    v, g, b = torch.rand(1, T, HV, K), torch.nn.functional.logsigmoid(torch.randn(1, T, HV, K)), torch.rand(1, T, HV)
    ref, _ = naive.naive_recurrent_kda(q, k, v, g, b)
    ours = recurrence(q[0].double(), k[0].double(), v[0].double(), g[0].double(), b[0].double(), K ** -0.5)
    err = ((ours - ref[0].double()).norm() / ref.norm()).item()
    assert err < 1e-6, f"reference recurrence differs from fla's naive_recurrent_kda: {err}"


check_against_fla()
for name, (c, B, T, cu) in CASES.items():
    params = {}
    for pname, shape in param_shapes(c).items():
        if pname.endswith("norm.weight"):
            t = 1.0 + 0.1 * torch.randn(shape, dtype=f64)
        elif pname.endswith("A_log"):
            t = torch.empty(shape, dtype=f64).uniform_(-0.5, 1.0)
        elif pname.endswith("dt_bias"):
            t = 0.5 * torch.randn(shape, dtype=f64)
        elif "conv1d" in pname:
            t = 0.5 * torch.randn(shape, dtype=f64)
        else:
            t = torch.randn(shape, dtype=f64) / shape[-1] ** 0.5
        params[pname] = t.float().double().requires_grad_(True)
    N = B * T
    x = torch.randn(N, c["d_model"], dtype=f64).float().double().requires_grad_(True)
    starts = cu[:-1] if cu else [b * T for b in range(B)]
    out = kda_block(params, c, x, starts)
    dy = torch.randn_like(out).float().double()
    grads = torch.autograd.grad((out * dy).sum(), [x] + list(params.values()))
    tensors = {"x": x.detach().float(), "dy": dy.float(), "expected.out": out.detach(), "expected.dx": grads[0]}
    for (pname, p), gr in zip(params.items(), grads[1:]):
        tensors["param." + pname] = p.detach().float()
        tensors["expected.grad." + pname] = gr
    if cu:
        tensors["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    golden.save(f"layers/{name}.safetensors", tensors, SEED, config=json.dumps(c), batch=B, seq=T)
