"""A plain PyTorch (Latent)MoE layer: the reference for tessera's router and moe ops (docs/moe.md).

Written from spec/moe.md and spec/kimi_k3.md, independently of the C++ code: routing by sorting,
capacity and re-routing as a Python loop over (token, slot) pairs in priority order, experts as a
loop over experts with index_select / index_add (the gate applied after the down projection, which
equals tessera's gate-before-down in exact arithmetic), autograd for every gradient.
"""
import math

import torch
import torch.nn.functional as F


def situ(gate, up, beta=4.0, linear_beta=25.0):
    return beta * torch.tanh(gate / beta) * torch.sigmoid(gate) * (linear_beta * torch.tanh(up / linear_beta))


def act(gate, up, activation, beta=4.0, linear_beta=25.0):
    return situ(gate, up, beta, linear_beta) if activation == "situ" else F.silu(gate) * up


def stable_desc(values):
    """Indices sorting each row by value descending, ties by lower index (torch.topk does not promise that)."""
    return torch.sort(-values, dim=-1, stable=True).indices


def router(x, w, bias=None, topk=2, score="softmax", normalize=True, scaling=1.0, groups=1, topk_groups=1):
    """Returns logits, scores, choice [N, k] (descending by s + bias) and the allowed-expert mask."""
    u = x @ w.T
    s = torch.softmax(u, -1) if score == "softmax" else torch.sigmoid(u)
    sel = (s + bias if bias is not None else s).detach()
    N, E = s.shape
    allowed = torch.ones(N, E, dtype=torch.bool)
    if groups > 1:
        g = sel.view(N, groups, E // groups)
        gscore = g.topk(min(2, E // groups), -1).values.sum(-1) if bias is not None else s.detach().view(N, groups, -1).max(-1).values
        keep = stable_desc(gscore)[:, :topk_groups]
        gmask = torch.zeros(N, groups, dtype=torch.bool).scatter_(1, keep, True)
        allowed = gmask.repeat_interleave(E // groups, dim=1)
    masked = sel.masked_fill(~allowed, float("-inf"))
    choice = stable_desc(masked)[:, :topk]
    return u, s, sel, choice, allowed


def gate_weights(s, experts, normalize, scaling):
    """Gates over each token's final set; experts [N, k] with -1 for dropped slots."""
    valid = experts >= 0
    picked = torch.gather(s, 1, experts.clamp(min=0)) * valid
    if normalize:
        picked = picked / (picked.sum(-1, keepdim=True) + 1e-20)
    return picked * scaling


def apply_capacity(sel, allowed, choice, capacity, overflow):
    """Final expert per (token, slot), -1 = dropped; priority: sel descending, ties (token, slot)."""
    N, K = choice.shape
    E = sel.shape[1]
    pairs = sorted(range(N * K), key=lambda i: (-float(sel[i // K, choice[i // K, i % K]]), i))
    load = [0] * E
    final = choice.clone()
    over = []
    for i in pairs:
        n, j = divmod(i, K)
        e = int(choice[n, j])
        if load[e] < capacity:
            load[e] += 1
        else:
            final[n, j] = -2
            over.append(i)
    rerouted = dropped = 0
    for i in over:
        n, j = divmod(i, K)
        best = -1
        if overflow == "reroute":
            mine = set(int(v) for v in final[n])
            for e in range(E):
                if load[e] >= capacity or not allowed[n, e] or e in mine:
                    continue
                if best < 0 or sel[n, e] > sel[n, best]:
                    best = e
        final[n, j] = best
        if best >= 0:
            load[best] += 1
            rerouted += 1
        else:
            dropped += 1
    return final, rerouted, dropped


def seq_aux_loss(alpha, s, choice, starts):
    N, E = s.shape
    K = choice.shape[1]
    total = 0
    for a, b in zip(starts[:-1], starts[1:]):
        Ts = b - a
        counts = torch.zeros(E, dtype=s.dtype)
        counts.index_add_(0, choice[a:b].reshape(-1), torch.ones(Ts * K, dtype=s.dtype))
        f = E / (K * Ts) * counts
        P = (s[a:b] / s[a:b].sum(-1, keepdim=True)).mean(0)
        total = total + (f * P).sum()
    return alpha * total / (len(starts) - 1)


def z_loss(beta, u):
    return beta * (torch.logsumexp(u, -1) ** 2).mean()


def moe(x, router_w, w_gate, w_up, w_down, router_bias=None, latent_down=None, latent_up=None, latent_norm=None,
        shared_gate=None, shared_up=None, shared_down=None, shared_scale=None, topk=2, score="softmax", normalize=True, scaling=1.0,
        groups=1, topk_groups=1, capacity_factor=0.0, overflow="reroute", activation="swiglu", situ_beta=4.0,
        situ_linear_beta=25.0, norm_eps=1e-6, seq_aux_coeff=0.0, z_loss_coeff=0.0, seq_starts=None):
    N = x.shape[0]
    E = router_w.shape[0]
    u, s, sel, choice, allowed = router(x, router_w, router_bias, topk, score, normalize, scaling, groups, topk_groups)
    rerouted = dropped = 0
    final = choice
    if capacity_factor > 0:
        cap = math.ceil(capacity_factor * N * topk / E)
        final, rerouted, dropped = apply_capacity(sel, allowed, choice, cap, overflow)
    gates = gate_weights(s, final, normalize, scaling)
    z = x @ latent_down.T if latent_down is not None else x
    c = torch.zeros_like(z)
    for e in range(E):
        tok, slot = torch.nonzero(final == e, as_tuple=True)
        if len(tok) == 0:
            continue
        ze = z[tok]
        a = act(ze @ w_gate[e].T, ze @ w_up[e].T, activation, situ_beta, situ_linear_beta)
        c = c.index_add(0, tok, (a @ w_down[e].T) * gates[tok, slot][:, None])
    if latent_down is not None:
        if latent_norm is not None:
            c = c * torch.rsqrt(c.pow(2).mean(-1, keepdim=True) + norm_eps) * latent_norm
        y = c @ latent_up.T
    else:
        y = c
    if shared_gate is not None:
        shared = act(x @ shared_gate.T, x @ shared_up.T, activation, situ_beta, situ_linear_beta) @ shared_down.T
        if shared_scale is not None:  # Qwen3-Next's shared_expert_gate: sigmoid(w . x) per token
            shared = torch.sigmoid(x @ shared_scale.T) * shared
        y = y + shared
    counts = torch.bincount(final[final >= 0].reshape(-1), minlength=E).to(torch.int32)
    demand = torch.bincount(choice.reshape(-1), minlength=E).to(torch.int32)
    aux = torch.zeros((), dtype=x.dtype)
    if seq_aux_coeff > 0:
        aux = aux + seq_aux_loss(seq_aux_coeff, s, choice, seq_starts or [0, N])
    if z_loss_coeff > 0:
        aux = aux + z_loss(z_loss_coeff, u)
    return dict(y=y, counts=counts, demand=demand, indices=final.to(torch.int32), weights=gates,
                rerouted=torch.tensor([rerouted]), dropped=torch.tensor([dropped]), aux_loss=aux.reshape(1))
