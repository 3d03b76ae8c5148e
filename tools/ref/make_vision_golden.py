"""Golden file for Kimi K3's image tower and projector (src/model/vision.h): a small MoonViT-V2 in float64.

Written from spec/kimi_k3.md §5-§6; where the spec marks a detail uncertain, the released MoonViT code's behaviour
(Kimi-VL) is what it follows: the 2-D RoPE turns pair 2j by the patch's column and pair 2j+1 by its row, both at
theta^(-4j/D); the position table is resized with torch's own bilinear F.interpolate (align_corners=False), and used
as is when the grid has its size; the 2x2 merge puts a cell's patches side by side in row-major order.

The first file holds the tower alone. The second puts the tower's rows into a small language model
(tools/ref/dense_model.py) at its image tokens, as Kimi K3 does after expanding each image's placeholder: the logits,
the loss and every language-model parameter's gradient, the tower frozen; and the logits of sequences whose
windows cut images (some of an image's rows only, as tessera's training windows may).

Three images: one at the table's size (no resize), one smaller and one larger than the table, so every path of the
position embedding runs; heads x head_dim differs from the width, as in K3 (12 x 128 over 1024).

    python3 tools/ref/make_vision_golden.py   ->  tests/golden/model/vision_tower.safetensors, vision_lm.safetensors
"""
import json

import torch
import torch.nn.functional as F

import golden
from dense_model import DenseLM

SEED = 20261205
CFG = dict(layers=2, width=32, heads=2, head_dim=24, ffn_dim=64, patch_size=2, channels=3, pos_height=4,
           pos_width=6, merge_h=2, merge_w=2, rope_theta=10000.0, norm_eps=2.0 ** -7, projector_eps=1e-5,
           text_width=48)
GRIDS = [(4, 6), (2, 4), (6, 8)]
# the language model the tower feeds (d_model = CFG's text_width); token 7 is the image token
LM = {"vocab_size": 40, "d_model": 48, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0, "ffn_dim": 64,
      "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False, "init_std": 0.1}
IMAGE_TOKEN = 7


def rmsnorm(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def rope_2d(x, grids, theta):
    n, h, d = x.shape
    cols, rows = [], []
    for gh, gw in grids:
        idx = torch.arange(gh * gw, dtype=torch.float64)
        cols.append(idx % gw)
        rows.append(torch.div(idx, gw, rounding_mode="floor"))
    col, row = torch.cat(cols), torch.cat(rows)
    freq = theta ** (-torch.arange(0, d, 4, dtype=torch.float64) / d)  # d/4 frequencies
    angle = torch.empty(n, d // 2, dtype=torch.float64)
    angle[:, 0::2] = torch.outer(col, freq)
    angle[:, 1::2] = torch.outer(row, freq)
    xc = torch.view_as_complex(x.reshape(n, h, d // 2, 2).contiguous())
    turn = torch.polar(torch.ones_like(angle), angle)[:, None, :].to(xc.dtype)  # computed in f64, used in x's dtype
    return torch.view_as_real(xc * turn).reshape(n, h, d)


def pos_embed(table, grids):
    out = []
    for gh, gw in grids:
        if (gh, gw) == tuple(table.shape[:2]):
            out.append(table.reshape(gh * gw, -1))
        else:
            t = F.interpolate(table.permute(2, 0, 1)[None], size=(gh, gw), mode="bilinear", align_corners=False)
            out.append(t[0].permute(1, 2, 0).reshape(gh * gw, -1))
    return torch.cat(out)


def tower(p, patches, grids, c):
    t = "vision_tower."
    x = patches @ p[t + "patch_embed.proj.weight"].reshape(c["width"], -1).T + pos_embed(p[t + "patch_embed.pos_emb.weight"], grids)
    n, hd, d = x.shape[0], c["heads"], c["head_dim"]
    bounds = [0]
    for gh, gw in grids:
        bounds.append(bounds[-1] + gh * gw)
    for l in range(c["layers"]):
        b = f"{t}encoder.blocks.{l}."
        qkv = rmsnorm(x, p[b + "norm0.weight"], c["norm_eps"]) @ p[b + "wqkv.weight"].T
        q, k, v = qkv.reshape(n, 3, hd, d).unbind(1)
        q, k = rope_2d(q, grids, c["rope_theta"]), rope_2d(k, grids, c["rope_theta"])
        o = torch.empty_like(q)
        for s, e in zip(bounds[:-1], bounds[1:]):  # bidirectional within each image
            scores = torch.einsum("qhd,khd->hqk", q[s:e], k[s:e]) / d ** 0.5
            o[s:e] = torch.einsum("hqk,khd->qhd", scores.softmax(-1), v[s:e])
        x = x + o.reshape(n, hd * d) @ p[b + "wo.weight"].T
        hmid = F.gelu(rmsnorm(x, p[b + "norm1.weight"], c["norm_eps"]) @ p[b + "mlp.fc0.weight"].T, approximate="tanh")
        x = x + hmid @ p[b + "mlp.fc1.weight"].T
    z = rmsnorm(x, p[t + "encoder.final_layernorm.weight"], c["norm_eps"])
    merged = []
    for (gh, gw), s in zip(grids, bounds):
        cell = z[s:s + gh * gw].reshape(gh // 2, 2, gw // 2, 2, -1).permute(0, 2, 1, 3, 4)
        merged.append(cell.reshape((gh // 2) * (gw // 2), -1))
    m = torch.cat(merged)
    y = F.gelu(m @ p["mm_projector.proj.0.weight"].T) @ p["mm_projector.proj.2.weight"].T
    return rmsnorm(y, p["mm_projector.post_norm.weight"], c["projector_eps"])


def main():
    torch.manual_seed(SEED)
    c = CFG
    w, qkv, f, pd, mw = c["width"], c["heads"] * c["head_dim"], c["ffn_dim"], c["channels"] * c["patch_size"] ** 2, 4 * c["width"]
    d64 = torch.float64

    def mat(rows, cols):
        return torch.randn(rows, cols, dtype=d64) / cols ** 0.5

    def norm(n):
        return 1.0 + 0.1 * torch.randn(n, dtype=d64)

    t = "vision_tower."
    p = {t + "patch_embed.proj.weight": mat(w, pd).reshape(w, c["channels"], c["patch_size"], c["patch_size"]),
         t + "patch_embed.pos_emb.weight": 0.5 * torch.randn(c["pos_height"], c["pos_width"], w, dtype=d64)}
    for l in range(c["layers"]):
        b = f"{t}encoder.blocks.{l}."
        p[b + "norm0.weight"] = norm(w)
        p[b + "wqkv.weight"] = mat(3 * qkv, w)
        p[b + "wo.weight"] = mat(w, qkv)
        p[b + "norm1.weight"] = norm(w)
        p[b + "mlp.fc0.weight"] = mat(f, w)
        p[b + "mlp.fc1.weight"] = mat(w, f)
    p[t + "encoder.final_layernorm.weight"] = norm(w)
    p["mm_projector.proj.0.weight"] = mat(mw, mw)
    p["mm_projector.proj.2.weight"] = mat(c["text_width"], mw)
    p["mm_projector.post_norm.weight"] = norm(c["text_width"])
    p = {k: v.float().double() for k, v in p.items()}  # the values the f32 engine reads
    n = sum(gh * gw for gh, gw in GRIDS)
    patches = torch.randn(n, pd, dtype=d64).float().double()
    out = tower(p, patches, GRIDS, c)
    tensors = {k: v.float() for k, v in p.items()}
    tensors.update({"patches": patches.float(), "grids": torch.tensor(GRIDS, dtype=torch.int64), "out": out})
    golden.save("model/vision_tower.safetensors", tensors, SEED, config=json.dumps(c))
    language_model(p, patches, out)


def language_model(tower_params, patches, rows):
    """Two sequences of 24 tokens: images 0 and 1 (6 + 2 rows) in the first, image 2 (12 rows) in the second."""
    gen = torch.Generator().manual_seed(SEED + 1)
    lm = DenseLM(LM).double()
    with torch.no_grad():
        for _, q in lm.checkpoint_params():
            q.copy_(torch.randn(q.shape, generator=gen, dtype=torch.float64) * (LM["init_std"] if q.dim() >= 2 else 0.1)
                    + (0 if q.dim() >= 2 else 1.0))
            q.copy_(q.float().double())
    ids = torch.randint(0, LM["vocab_size"], (2, 24), generator=gen)
    ids[ids == IMAGE_TOKEN] = IMAGE_TOKEN + 1
    ids[0, 2:8] = IMAGE_TOKEN   # image 0: 4x6 patches -> 6 tokens
    ids[0, 15:17] = IMAGE_TOKEN  # image 1: 2x4 -> 2
    ids[1, 5:17] = IMAGE_TOKEN  # image 2: 6x8 -> 12
    targets = torch.randint(0, LM["vocab_size"], (2, 24), generator=gen)
    targets[ids == IMAGE_TOKEN] = -100  # image positions carry no label (spec §6)
    image_rows = rows.float().double()  # the rows the f32 tower hands over, to within its own tolerance
    logits = lm(ids, image_rows, IMAGE_TOKEN)
    loss = lm.loss(ids, targets, image_rows, IMAGE_TOKEN)
    loss.backward()
    tensors = {"param." + n: q.detach().float() for n, q in lm.checkpoint_params()}
    tensors.update({"param." + n: v.float() for n, v in tower_params.items()})
    tensors.update({"patches": patches.float(), "grids": torch.tensor(GRIDS, dtype=torch.int64),
                    "ids": ids.int(), "targets": targets.int(), "expected.logits": logits.detach().reshape(-1, LM["vocab_size"]),
                    "expected.loss": loss.detach()})
    for n, q in lm.checkpoint_params():
        tensors["expected.grad." + n] = q.grad.detach()
    # training windows cut images (tessera's data loader): a window's image tokens take the rows of the whole image's
    # output that fall inside it. Here the last 3 rows of image 0 open the first sequence, image 1 whole, and the
    # first 4 rows of image 2 close the second.
    cut = torch.randint(0, LM["vocab_size"], (2, 24), generator=gen)
    cut[cut == IMAGE_TOKEN] = IMAGE_TOKEN + 1
    cut[0, 0:3] = IMAGE_TOKEN
    cut[0, 15:17] = IMAGE_TOKEN
    cut[1, 20:24] = IMAGE_TOKEN
    with torch.no_grad():
        cut_logits = lm(cut, torch.cat([image_rows[3:6], image_rows[6:8], image_rows[8:12]]), IMAGE_TOKEN)
    tensors.update({"cut.ids": cut.int(), "cut.rows": torch.tensor([[3, 6], [0, 2], [0, 4]], dtype=torch.int64),
                    "cut.expected.logits": cut_logits.reshape(-1, LM["vocab_size"])})
    model = dict(LM, vision=dict({k: v for k, v in CFG.items() if k != "text_width"}, image_token=IMAGE_TOKEN))
    golden.save("model/vision_lm.safetensors", tensors, SEED, config=json.dumps({"model": model}))


if __name__ == "__main__":
    main()
