"""Writes tests/golden/layers/mla_*.safetensors and dsa_*.safetensors: an MLA / gated DSA block's
parameters, an input x and output gradient dy, and the float64 reference output, input gradient and
parameter gradients (tools/ref/mla_ref.py): the LM gradient (out · dy) for the trunk plus kl_coeff times
the KL gradient for the indexer, and the KL value.

Run: python3 tools/ref/make_mla_golden.py
"""
import json

import torch

import golden
from mla_ref import mla_block, param_shapes

SEED = 11
torch.manual_seed(SEED)
f64 = torch.float64

NO_DSA = {"topk": 0, "heads": 4, "head_dim": 16, "rope_dim": 8, "stage": "sparse", "kl_coeff": 1.0}
BASE = {"d_model": 32, "num_heads": 4, "q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8,
        "v_head_dim": 8, "rope": True, "rope_theta": 10000.0, "softmax_scale": 0.0, "output_gate": "none",
        "norm_eps": 1e-6, "latent_eps": 1e-6, "dsa": NO_DSA}
DSA = dict(NO_DSA, topk=8)

# name: (config, batch, seq, cu_seqlens)
CASES = {
    "mla_kimi_linear": (dict(BASE, q_lora_rank=0), 2, 20, None),
    "mla_k3_gated_nope": (dict(BASE, rope=False, output_gate="elementwise"), 2, 17, None),
    "mla_packed": (dict(BASE, output_gate="headwise"), 1, 30, [0, 7, 19, 30]),
    "dsa_sparse": (dict(BASE, output_gate="headwise", dsa=DSA), 2, 24, None),
    "dsa_sparse_no_qlora": (dict(BASE, q_lora_rank=0, output_gate="elementwise", dsa=dict(DSA, kl_coeff=0.5)),
                            1, 21, None),
    "dsa_packed": (dict(BASE, dsa=DSA), 1, 33, [0, 5, 20, 33]),
    "dsa_warmup": (dict(BASE, output_gate="elementwise", dsa=dict(DSA, stage="dense_warmup")), 2, 12, None),
}

for name, (c, B, T, cu) in CASES.items():
    for attempt in range(20):  # re-draw until every selection boundary has a clear gap
        params = {}
        for pname, shape in param_shapes(c).items():
            if pname.endswith("norm.weight") or pname.endswith("layernorm.weight"):
                t = 1.0 + 0.1 * torch.randn(shape, dtype=f64)
            elif pname.endswith(".bias"):
                t = 0.1 * torch.randn(shape, dtype=f64)
            else:
                t = torch.randn(shape, dtype=f64) / shape[-1] ** 0.5
            params[pname] = t.float().double().requires_grad_(True)
        N = B * T
        x = torch.randn(N, c["d_model"], dtype=f64).float().double().requires_grad_(True)
        try:
            out, kl = mla_block(params, c, x, T, cu)
            break
        except AssertionError as e:
            print(f"{name}: {e}")
    dy = torch.randn_like(out).float().double()
    total = (out * dy).sum() + (c["dsa"]["kl_coeff"] * kl if kl is not None else 0.0)
    grads = torch.autograd.grad(total, [x] + list(params.values()), allow_unused=True)
    tensors = {"x": x.detach().float(), "dy": dy.float(), "expected.out": out.detach(), "expected.dx": grads[0]}
    for (pname, p), gr in zip(params.items(), grads[1:]):
        tensors["param." + pname] = p.detach().float()
        tensors["expected.grad." + pname] = gr if gr is not None else torch.zeros_like(p)
    if kl is not None:
        tensors["expected.kl"] = kl.detach().reshape(1)
    if cu:
        tensors["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    golden.save(f"layers/{name}.safetensors", tensors, SEED, config=json.dumps(c), batch=B, seq=T)
