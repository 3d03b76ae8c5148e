"""PyTorch reference of tessera's dense decoder (docs/model.md), written from the model's contract,
not from the C++ code: embedding -> N x (RMSNorm -> GQA causal attention with rotate-half RoPE and an
optional sigmoid output gate, MLA / gated DSA (mla_ref.py) or KDA / GDN (kda_block.py) -> o_proj, RMSNorm -> SwiGLU MLP or MoE)
-> RMSNorm -> lm_head, Hugging Face Llama tensor names. With attn_res_block_size > 0 the residual stream is
Kimi K3's Attention Residuals (spec/kimi_k3.md 2.2), transcribed from the spec's dataflow.

Also the training step the C++ trainer runs (AdamW with decay on matrices only, global-norm
clipping, warm-up + cosine schedule), used both for golden files and for the speed comparison.
"""
import math

import torch
import torch.nn as nn
import torch.nn.functional as F

from kda_block import kda_attention, param_shapes as kda_param_shapes
from mla_ref import mla_attention, param_shapes as mla_param_shapes


class RMSNorm(nn.Module):
    def __init__(self, d, eps):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(d))
        self.eps = eps

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps) * self.weight


def rope_tables(seq, head_dim, theta, dtype):
    # angles in float64, then rounded to the model dtype (tessera's convention)
    inv_freq = theta ** (-torch.arange(0, head_dim // 2, dtype=torch.float64) * 2.0 / head_dim)
    ang = torch.arange(seq, dtype=torch.float64)[:, None] * inv_freq[None, :]
    cos = torch.cat([ang.cos(), ang.cos()], -1).to(dtype)
    sin = torch.cat([ang.sin(), ang.sin()], -1).to(dtype)
    return cos, sin


def apply_rope(x, cos, sin):  # x: [B, T, H, D]
    half = x.shape[-1] // 2
    rot = torch.cat([-x[..., half:], x[..., :half]], -1)
    return x * cos[None, :, None, :] + rot * sin[None, :, None, :]


class Attention(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.h, self.hkv = c["n_heads"], c["n_kv_heads"]
        self.d = c.get("head_dim") or c["d_model"] // c["n_heads"]
        C = c["d_model"]
        self.q_proj = nn.Linear(C, self.h * self.d, bias=False)
        self.k_proj = nn.Linear(C, self.hkv * self.d, bias=False)
        self.v_proj = nn.Linear(C, self.hkv * self.d, bias=False)
        self.o_proj = nn.Linear(self.h * self.d, C, bias=False)
        self.gate = c.get("output_gate", "none")
        if self.gate != "none":
            self.g_proj = nn.Linear(C, self.h * self.d if self.gate == "elementwise" else self.h, bias=False)
        if c.get("qk_norm", False):  # Qwen3: RMSNorm over each head of q and k, before RoPE
            self.q_norm = RMSNorm(self.d, c["norm_eps"])
            self.k_norm = RMSNorm(self.d, c["norm_eps"])
        self.rot = c.get("rope_dim", 0) or self.d  # partial rotary: the first rot dims of each head
        self.theta = c["rope_theta"]
        self.sdpa = False

    def forward(self, x):
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.h, self.d)
        k = self.k_proj(x).view(B, T, self.hkv, self.d)
        v = self.v_proj(x).view(B, T, self.hkv, self.d)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        cos, sin = rope_tables(T, self.rot, self.theta, x.dtype)
        r = self.rot
        q = torch.cat([apply_rope(q[..., :r], cos, sin), q[..., r:]], -1)
        k = torch.cat([apply_rope(k[..., :r], cos, sin), k[..., r:]], -1)
        rep = self.h // self.hkv
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)
        if self.sdpa:  # the fast path PyTorch users run (same math)
            o = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=rep > 1)
        else:
            k, v = k.repeat_interleave(rep, 1), v.repeat_interleave(rep, 1)
            s = (q @ k.transpose(-1, -2)) / math.sqrt(self.d)
            s = s.masked_fill(torch.ones(T, T, dtype=torch.bool).triu(1), float("-inf"))
            o = s.softmax(-1) @ v
        o = o.transpose(1, 2).reshape(B, T, self.h * self.d)
        if self.gate != "none":
            g = torch.sigmoid(self.g_proj(x))
            o = o * (g if self.gate == "elementwise" else g.repeat_interleave(self.d, -1))
        return self.o_proj(o)


def layer_types(c):
    a = c.get("attention", "gqa")
    return [a] * c["n_layers"] if isinstance(a, str) else list(a)


def mla_layer_config(c, dsa):
    """The flat layer config of mla_ref from a model config (the model's width, heads, theta, gate, eps)."""
    m = c["mla"]
    return dict(m, d_model=c["d_model"], num_heads=c["n_heads"], rope_theta=c["rope_theta"],
                output_gate=c.get("output_gate", "none"), norm_eps=c["norm_eps"],
                dsa=m["dsa"] if dsa else dict(m["dsa"], topk=0))


def kda_layer_config(c, gdn):
    """The flat layer config of kda_block.py from a model config (defaults resolved like the engine's)."""
    k = {**dict(conv_size=4, gate_lower_bound=0.0, full_rank_output_gate=False, o_norm_eps=1e-5), **c["kda"]}
    k.setdefault("num_heads", c["n_heads"])
    k["num_v_heads"] = k.get("num_v_heads") or k["num_heads"]
    k["head_v_dim"] = k.get("head_v_dim") or k["head_dim"]
    k["gate_rank"] = k.get("gate_rank") or k["head_v_dim"]
    k.update(d_model=c["d_model"], norm_eps=c["norm_eps"], scalar_gate=gdn, output_gate_activation="sigmoid")
    if gdn:
        k.update(full_rank_output_gate=True, output_gate_activation="silu")
    return k


class NamedParams(nn.Module):
    """Parameters under checkpoint names (self_attn.*) from a reference's param_shapes."""

    def __init__(self, shapes):
        super().__init__()
        self.names = [n for n in shapes if n.startswith("self_attn.")]
        self.params = nn.ParameterList(nn.Parameter(torch.zeros(shapes[n])) for n in self.names)

    def named_weights(self):
        return {n: p for n, p in zip(self.names, self.params)}


class MlaAttention(NamedParams):
    """MLA / gated DSA through mla_ref.mla_attention. `margin`: when set, every top-k selection must have
    at least this gap at its boundary (golden files: fp32 rounding in the engine cannot flip it)."""

    margin = None

    def __init__(self, c, dsa):
        self.lc = mla_layer_config(c, dsa)
        super().__init__(mla_param_shapes(self.lc))
        self.kl = None

    def forward(self, x):
        B, T, C = x.shape
        o, self.kl = mla_attention(self.named_weights(), self.lc, x.reshape(B * T, C), T, margin=self.margin)
        return o.view(B, T, C)


class KdaAttention(NamedParams):
    """KDA / GDN through kda_block.kda_attention (each batch row is one sequence)."""

    def __init__(self, c, gdn):
        self.lc = kda_layer_config(c, gdn)
        super().__init__(kda_param_shapes(self.lc))

    def forward(self, x):
        B, T, C = x.shape
        o = kda_attention(self.named_weights(), self.lc, x.reshape(B * T, C), [b * T for b in range(B)])
        return o.view(B, T, C)


class MLP(nn.Module):
    def __init__(self, c):
        super().__init__()
        C, Fd = c["d_model"], c["ffn_dim"]
        self.gate_proj = nn.Linear(C, Fd, bias=False)
        self.up_proj = nn.Linear(C, Fd, bias=False)
        self.down_proj = nn.Linear(Fd, C, bias=False)
        self.activation = c.get("mlp_activation", "swiglu")

    def forward(self, x):
        import moe_ref
        return self.down_proj(moe_ref.act(self.gate_proj(x), self.up_proj(x), self.activation))


class Weight(nn.Module):
    def __init__(self, *shape, trainable=True):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(*shape), requires_grad=trainable)


class Router(nn.Module):
    def __init__(self, E, C):
        super().__init__()
        self.weight = nn.Parameter(torch.zeros(E, C))
        self.e_score_correction_bias = nn.Parameter(torch.zeros(E), requires_grad=False)  # selection only


class MoE(nn.Module):
    """tessera's MoE block (docs/moe.md) around the reference layer of moe_ref.py, with tessera's tensor
    names; the router losses are kept for the training loss, the router's choices for the bias update."""

    def __init__(self, c):
        super().__init__()
        m, C = c["moe"], c["d_model"]
        E, Fd, L = m["experts"], m["ffn_dim"], m.get("latent_dim", 0) or C
        self.m, self.eps = m, c["norm_eps"]
        self.gate = Router(E, C)
        self.experts = nn.ModuleDict({"gate_proj": Weight(E, Fd, L), "up_proj": Weight(E, Fd, L),
                                      "down_proj": Weight(E, L, Fd)})
        if m.get("latent_dim", 0):
            self.routed_expert_down_proj = Weight(L, C)
            self.routed_expert_up_proj = Weight(C, L)
            if m.get("latent_norm", False):
                self.routed_expert_norm = Weight(L)
        if m.get("shared_ffn_dim", 0):
            FS = m["shared_ffn_dim"]
            self.shared_experts = nn.ModuleDict({"gate_proj": Weight(FS, C), "up_proj": Weight(FS, C),
                                                 "down_proj": Weight(C, FS)})
            if m.get("shared_expert_gate", False):
                self.shared_expert_gate = Weight(1, C)
        self.aux = 0.0
        self.demand = None

    margin = None  # when set: every token's k-th and (k+1)-th selection scores differ by more (golden files)

    def forward(self, x):
        import moe_ref
        B, T, C = x.shape
        m = self.m
        if self.margin is not None and m.get("groups", 1) == 1:
            z = x.reshape(B * T, C).detach() @ self.gate.weight.detach().t()
            p = torch.sigmoid(z) if m.get("score", "sigmoid") == "sigmoid" else torch.softmax(z, -1)
            top = (p + self.gate.e_score_correction_bias.detach()).sort(-1, descending=True).values
            gap = float((top[:, m["topk"] - 1] - top[:, m["topk"]]).min())
            assert gap > self.margin, f"router selection gap {gap} below {self.margin}; pick another seed"
        opt = lambda name: getattr(self, name).weight if hasattr(self, name) else None
        shared = getattr(self, "shared_experts", None)
        out = moe_ref.moe(
            x.reshape(B * T, C), self.gate.weight, self.experts["gate_proj"].weight, self.experts["up_proj"].weight,
            self.experts["down_proj"].weight, router_bias=self.gate.e_score_correction_bias,
            latent_down=opt("routed_expert_down_proj"), latent_up=opt("routed_expert_up_proj"),
            latent_norm=opt("routed_expert_norm"),
            shared_gate=shared["gate_proj"].weight if shared else None,
            shared_up=shared["up_proj"].weight if shared else None,
            shared_down=shared["down_proj"].weight if shared else None,
            shared_scale=opt("shared_expert_gate"),
            topk=m["topk"], score=m.get("score", "sigmoid"), normalize=m.get("normalize", True),
            scaling=m.get("scaling", 1.0), groups=m.get("groups", 1), topk_groups=m.get("topk_groups", 1),
            capacity_factor=m.get("capacity_factor", 0.0), overflow=m.get("overflow", "reroute"),
            activation=m.get("activation", "swiglu"), norm_eps=self.eps, seq_aux_coeff=m.get("seq_aux_coeff", 0.0),
            z_loss_coeff=m.get("z_loss_coeff", 0.0), seq_starts=[b * T for b in range(B + 1)])
        self.aux = out["aux_loss"].sum()
        self.demand = out["demand"]
        return out["y"].reshape(B, T, C)

    @torch.no_grad()
    def update_bias(self):
        """The sign rule: b += γ·sign(mean − load) from this step's router choices."""
        if self.m.get("balance", "sign") != "sign":
            return
        d = self.demand.double()
        self.gate.e_score_correction_bias += self.m.get("bias_update_rate", 1e-3) * torch.sign(d.mean() - d)


def attn_res_mix(sources, norm, proj, eps):
    """softmax over sources of proj . RMSNorm_norm(v_i), applied to the raw sources (along depth only)"""
    v = torch.stack(sources)  # [S, B, T, C]
    xh = v * torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + eps)
    p = ((xh * norm.weight) @ proj.weight[0]).softmax(0)  # [S, B, T]
    return (p[..., None] * v).sum(0)


class Layer(nn.Module):
    def __init__(self, c, index=0):
        super().__init__()
        if c.get("attn_res_block_size", 0):
            C = c["d_model"]
            self.self_attention_res_norm, self.self_attention_res_proj = Weight(C), Weight(1, C)
            self.mlp_res_norm, self.mlp_res_proj = Weight(C), Weight(1, C)
        self.eps = c["norm_eps"]
        self.input_layernorm = RMSNorm(c["d_model"], c["norm_eps"])
        t = layer_types(c)[index]
        if t in ("mla", "dsa"):
            self.self_attn = MlaAttention(c, t == "dsa")
        elif t in ("kda", "gdn"):
            self.self_attn = KdaAttention(c, t == "gdn")
        else:
            self.self_attn = Attention(c)
        self.post_attention_layernorm = RMSNorm(c["d_model"], c["norm_eps"])
        moe = c.get("moe", {})
        self.mlp = MoE(c) if moe.get("experts", 0) and index >= moe.get("first_dense", 1) else MLP(c)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))

    def forward_attn_res(self, R, P, restart):
        """One layer of the Attention Residuals dataflow: R (finished block sums, R[0] = embedding) and P (the
        partial block sum) in and out; restart: this layer starts a new depth block (l mod B = 0)."""
        x_a = attn_res_mix(R + [P], self.self_attention_res_norm, self.self_attention_res_proj, self.eps) if R else P
        if restart:
            R, P = R + [P], None
        a = self.self_attn(self.input_layernorm(x_a))
        P = a if P is None else P + a
        x_m = attn_res_mix(R + [P], self.mlp_res_norm, self.mlp_res_proj, self.eps)
        return R, P + self.mlp(self.post_attention_layernorm(x_m))


class Inner(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.embed_tokens = nn.Embedding(c["vocab_size"], c["d_model"])
        self.layers = nn.ModuleList(Layer(c, i) for i in range(c["n_layers"]))
        self.norm = RMSNorm(c["d_model"], c["norm_eps"])
        if c.get("attn_res_block_size", 0):
            self.output_attn_res_norm, self.output_attn_res_proj = Weight(c["d_model"]), Weight(1, c["d_model"])


class DenseLM(nn.Module):
    def __init__(self, c):
        super().__init__()
        self.c = c
        self.model = Inner(c)
        self.tied = c["tie_embeddings"]
        if not self.tied:
            self.lm_head = nn.Linear(c["d_model"], c["vocab_size"], bias=False)

    def set_sdpa(self, on):
        for layer in self.model.layers:
            layer.self_attn.sdpa = on

    def forward(self, ids, image_rows=None, image_token=None):
        x = self.model.embed_tokens(ids)
        if image_rows is not None:  # Kimi K3's image tokens: their embedding rows replaced by the tower's, in order
            x = x.clone()
            x[ids == image_token] = image_rows.to(x.dtype)
        B = self.c.get("attn_res_block_size", 0)
        if B:
            R, P = [], x
            for l, layer in enumerate(self.model.layers):
                R, P = layer.forward_attn_res(R, P, l % B == 0)
            x = attn_res_mix(R + [P], self.model.output_attn_res_norm, self.model.output_attn_res_proj,
                             self.c["norm_eps"])
        else:
            for layer in self.model.layers:
                x = layer(x)
        x = self.model.norm(x)
        w = self.model.embed_tokens.weight if self.tied else self.lm_head.weight
        return x @ w.t()

    def loss(self, ids, targets, image_rows=None, image_token=None):
        logits = self.forward(ids, image_rows, image_token)
        return F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1).long(), ignore_index=-100)

    def moe_layers(self):
        return [layer.mlp for layer in self.model.layers if isinstance(layer.mlp, MoE)]

    def aux_loss(self):
        """The router losses and the DSA indexers' kl_coeff·KL of the last forward (0 for dense models)."""
        aux = sum((m.aux for m in self.moe_layers()), torch.zeros((), dtype=torch.float64))
        for layer in self.model.layers:
            if isinstance(layer.self_attn, MlaAttention) and layer.self_attn.kl is not None:
                aux = aux + layer.self_attn.lc["dsa"]["kl_coeff"] * layer.self_attn.kl
        return aux

    def checkpoint_params(self):
        """(checkpoint name, parameter) pairs: MLA parameters under their self_attn.* names."""
        out = []
        for n, p in self.named_parameters():
            if ".self_attn.params." in n:  # MlaAttention / KdaAttention
                layer = n.split(".self_attn.params.")[0]
                attn = self.get_submodule(layer + ".self_attn")
                n = layer + "." + attn.names[int(n.rsplit(".", 1)[1])]
            out.append((n, p))
        return out


def learning_rate(t, step):
    if step < t["warmup_steps"]:
        return t["lr"] * (step + 1) / t["warmup_steps"]
    min_lr = t["min_lr_ratio"] * t["lr"]
    p = min(1.0, (step - t["warmup_steps"]) / max(1, t["steps"] - t["warmup_steps"]))
    return min_lr + (t["lr"] - min_lr) * 0.5 * (1 + math.cos(math.pi * p))


def make_optimizer(model, t):
    decay = [p for n, p in model.named_parameters() if p.dim() >= 2 and p.requires_grad]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2 and p.requires_grad]
    return torch.optim.AdamW([{"params": decay, "weight_decay": t["weight_decay"]},
                              {"params": no_decay, "weight_decay": 0.0}],
                             lr=t["lr"], betas=(t["beta1"], t["beta2"]), eps=t["eps"], foreach=False)


def train_step(model, opt, t, step, ids, targets):
    for g in opt.param_groups:
        g["lr"] = learning_rate(t, step)
    opt.zero_grad(set_to_none=True)
    loss = model.loss(ids, targets)
    (loss + model.aux_loss()).backward()
    if t["grad_clip"] > 0:
        torch.nn.utils.clip_grad_norm_([p for p in model.parameters() if p.requires_grad], t["grad_clip"])
    opt.step()
    for m in model.moe_layers():
        m.update_bias()
    return loss.item()
