"""Writes tests/golden/ops/{dsa_indexer,sparse_attention,indexer_kl}_*.safetensors from the PyTorch reference
in dsa_ref.py (float64, autograd): indexer selection with forced ties, packed sequences and topk > T;
sparse attention over indexer-selected rows and over dense rows; the indexer KL, sparse and dense.

Run: python3 tools/ref/make_dsa_golden.py
"""
import torch

import dsa_ref
import golden

SEED = 11
torch.manual_seed(SEED)
f64 = torch.float64


def save(case, op, tensors, params, expected, rtol32="1e-5"):
    t = {k: v.detach() for k, v in tensors.items()}
    t.update({"expected." + k: v.detach() for k, v in expected.items()})
    meta = {"op": op, "rtol.f32": rtol32}
    meta.update({"param." + k: str(v) for k, v in params.items()})
    golden.save(f"ops/{case}.safetensors", t, SEED, **meta)


def indexer_inputs(B, T, HI, DI, tie_row=None):
    q = torch.randn(B, T, HI, DI, dtype=f64)
    k = torch.randn(B, T, DI, dtype=f64)
    w = torch.randn(B, T, HI, dtype=f64)
    if tie_row is not None:
        q[:, tie_row] = 0.0  # every score of this query is 0: the k most recent tokens win
    return q, k, w


def indexer_case(case, B, T, HI, DI, topk, cu=None, tie_row=None):
    q, k, w = indexer_inputs(B, T, HI, DI, tie_row)
    idx, sc = dsa_ref.indexer_select(q, k, w, topk, cu)
    tensors = {"q": q, "k": k, "w": w}
    if cu is not None:
        tensors["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    save(case, "dsa_indexer", tensors, {"topk": topk}, {"indices": idx, "scores": sc})


indexer_case("dsa_indexer", 2, 37, 4, 16, 8, tie_row=20)
indexer_case("dsa_indexer_varlen", 1, 50, 3, 8, 6, cu=[0, 7, 30, 50])
indexer_case("dsa_indexer_topk_over_t", 1, 5, 2, 8, 8)
indexer_case("dsa_indexer_long_rows", 1, 300, 2, 8, 40, tie_row=250)  # several key blocks, pruning


def sparse_case(case, B, T, H, DK, DV, topk, scale):
    qi, ki, wi = indexer_inputs(B, T, 2, 8)
    idx, _ = dsa_ref.indexer_select(qi, ki, wi, topk)
    q = torch.randn(B, T, H, DK, dtype=f64, requires_grad=True)
    kv = torch.randn(B, T, DK, dtype=f64, requires_grad=True)
    o, lse = dsa_ref.sparse_attention(q, kv, idx, scale, DV)
    do = torch.randn_like(o)
    dq, dkv = torch.autograd.grad((o * do).sum(), [q, kv])
    save(case, "sparse_attention", {"q": q, "kv": kv, "indices": idx, "do": do}, {"scale": scale, "dv": DV},
         {"o": o, "lse": lse, "dq": dq, "dkv": dkv})


sparse_case("sparse_attention", 2, 40, 4, 24, 16, 8, 0.2)
sparse_case("sparse_attention_dense_rows", 1, 30, 3, 20, 20, 32, 0.0 + 20 ** -0.5)  # topk >= T: causal dense


def kl_case(case, B, T, HI, DI, topk=None, cu=None):
    q, k, w = indexer_inputs(B, T, HI, DI)
    q.requires_grad_(True)
    k.requires_grad_(True)
    w.requires_grad_(True)
    tensors = {"q": q, "k": k, "w": w}
    if topk is not None:
        idx, _ = dsa_ref.indexer_select(q, k, w, topk, cu)
        valid = idx >= 0
        p = torch.softmax(torch.randn(B, T, topk, dtype=f64).masked_fill(~valid, float("-inf")), -1)
        p = p.masked_fill(~valid, 0.0)
        p[0, 3, 0] = 0.0  # a zero target entry (skipped in the sum)
        p[0, 3] = p[0, 3] / p[0, 3].sum()
        tensors.update(p=p, indices=idx)
        loss = dsa_ref.indexer_kl(q, k, w, p, idx)
    else:
        mask = dsa_ref.candidates_mask(T, cu)
        p = torch.softmax(torch.randn(B, T, T, dtype=f64).masked_fill(~mask, float("-inf")), -1)
        tensors["p"] = p
        loss = dsa_ref.indexer_kl(q, k, w, p, None, cu)
    if cu is not None:
        tensors["cu_seqlens"] = torch.tensor(cu, dtype=torch.int64)
    dloss = torch.tensor(1.7, dtype=f64)
    dq, dk, dw = torch.autograd.grad(loss * dloss, [q, k, w])
    tensors["dloss"] = dloss
    save(case, "indexer_kl", tensors, {}, {"loss": loss, "dq": dq, "dk": dk, "dw": dw})


kl_case("indexer_kl_sparse", 2, 24, 3, 8, topk=6)
kl_case("indexer_kl_dense", 1, 30, 2, 8, cu=[0, 12, 30])
