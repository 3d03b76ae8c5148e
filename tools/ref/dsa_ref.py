"""PyTorch reference of tessera's DSA ops (spec/dsa.md §2-§3), written from the spec: the indexer as a dense
masked [T, T] score matrix and a brute-force sort under the total order, sparse attention as dense attention
with an additive mask off the selected set, and the indexer KL with autograd. O(T^2): for tests only.
"""
import torch


def candidates_mask(T, cu=None):
    """[T, T] bool: s is a candidate of t (s <= t, same packed sequence)."""
    causal = torch.ones(T, T, dtype=torch.bool).tril()
    if cu is None:
        return causal
    seg = torch.zeros(T, dtype=torch.long)
    for i, (a, b) in enumerate(zip(cu[:-1], cu[1:])):
        seg[a:b] = i
    return causal & (seg[:, None] == seg[None, :])


def indexer_scores(q, k, w):
    """I [B, T, T] = sum_j w[t,j] relu(q[t,j] . k[s])."""
    a = torch.einsum("btjd,bsd->btjs", q, k)
    return torch.einsum("btj,btjs->bts", w, a.clamp(min=0))


def indexer_select(q, k, w, topk, cu=None):
    B, T = q.shape[:2]
    I = indexer_scores(q, k, w).detach()
    mask = candidates_mask(T, cu)
    idx = torch.full((B, T, topk), -1, dtype=torch.int32)
    sc = torch.zeros(B, T, topk, dtype=q.dtype)
    for b in range(B):
        for t in range(T):
            cands = [s for s in range(T) if mask[t, s]]
            best = sorted(cands, key=lambda s: (-float(I[b, t, s]), -s))[:topk]
            best.sort()
            for i, s in enumerate(best):
                idx[b, t, i] = s
                sc[b, t, i] = I[b, t, s]
    return idx, sc


def sparse_attention(q, kv, indices, scale, dv):
    """o [B,T,H,DV], lse [B,T,H] via dense masked attention (+inf lse for a query with no entry)."""
    B, T, H, DK = q.shape
    z = torch.einsum("bthd,bsd->bths", q, kv) * scale
    allowed = torch.zeros(B, T, T, dtype=torch.bool)
    for b in range(B):
        for t in range(T):
            for s in indices[b, t].tolist():
                if 0 <= s < T:
                    allowed[b, t, s] = True
    z = z.masked_fill(~allowed[:, :, None, :], float("-inf"))
    lse = torch.logsumexp(z, -1)
    p = torch.exp(z - lse[..., None]).nan_to_num(0.0)
    o = torch.einsum("bths,bsd->bthd", p, kv[..., :dv])
    return o, lse.masked_fill(torch.isinf(lse), float("inf"))


def indexer_kl(q, k, w, p, indices=None, cu=None):
    """mean over rows with support of KL(p || softmax(I)) over the support."""
    B, T = q.shape[:2]
    I = indexer_scores(q, k, w)
    total = 0
    rows = 0
    for b in range(B):
        for t in range(T):
            if indices is not None:
                sel = [s for s in indices[b, t].tolist() if 0 <= s < T]
                slots = [i for i, s in enumerate(indices[b, t].tolist()) if 0 <= s < T]
                if not sel:
                    continue
                It = I[b, t, sel]
                pt = p[b, t, slots]
            else:
                mask = candidates_mask(T, cu)[t]
                It = I[b, t][mask]
                pt = p[b, t][mask]
            logpi = It - torch.logsumexp(It, 0)
            pos = pt > 0
            total = total + (pt[pos] * (pt[pos].log() - logpi[pos])).sum()
            rows += 1
    return total / rows
