"""Writes tests/golden/model/<case>.safetensors for the dense model test: a tiny config, its
initial parameters, one batch with the float64 reference logits, loss and every parameter
gradient, and a 10-step training trajectory (losses) from the float64 reference trainer.

Run: python3 tools/ref/make_model_golden.py
"""
import json
import sys

import torch

import golden
from dense_model import DenseLM, make_optimizer, train_step

SEED = 7

TRAIN = {"lr": 1e-2, "min_lr_ratio": 0.1, "warmup_steps": 3, "steps": 10, "schedule": "cosine",
         "weight_decay": 0.1, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 0.5,
         "seq_len": 16, "batch_size": 2}

CASES = {
    "dense_gqa": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0,
                  "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False, "init_std": 0.1},
    "dense_tied_mha": {"vocab_size": 40, "d_model": 48, "n_layers": 3, "n_heads": 3, "n_kv_heads": 3, "head_dim": 0,
                       "ffn_dim": 64, "norm_eps": 1e-5, "rope_theta": 500.0, "tie_embeddings": True, "init_std": 0.1},
    # MoE from layer 1 on: Kimi-K3-like (sigmoid router + bias, latent projections with norm, shared
    # expert, SiTU) with both router losses; and a softmax router with group limits and capacity re-routing.
    # The sign-rule bias update (γ large enough to change routing within 10 steps) is part of the trajectory.
    "moe_latent_situ": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0,
                        "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False,
                        "init_std": 0.1,
                        "moe": {"experts": 8, "topk": 3, "ffn_dim": 16, "latent_dim": 16, "latent_norm": True,
                                "shared_ffn_dim": 24, "score": "sigmoid", "activation": "situ", "first_dense": 1,
                                "balance": "sign", "bias_update_rate": 0.05, "seq_aux_coeff": 0.01,
                                "z_loss_coeff": 0.001}},
    "moe_capacity": {"vocab_size": 48, "d_model": 32, "n_layers": 3, "n_heads": 2, "n_kv_heads": 2, "head_dim": 0,
                     "ffn_dim": 40, "norm_eps": 1e-5, "rope_theta": 10000.0, "tie_embeddings": True,
                     "init_std": 0.1,
                     "moe": {"experts": 8, "topk": 2, "ffn_dim": 24, "score": "softmax", "groups": 4,
                             "topk_groups": 2, "capacity_factor": 1.0, "overflow": "reroute", "first_dense": 1,
                             "balance": "sign", "bias_update_rate": 0.02}},
    # gated attention: GQA with an elementwise sigmoid output gate (Qwen3-Next style)
    "gated_gqa": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0,
                  "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False, "init_std": 0.1,
                  "output_gate": "elementwise"},
    # gated DSA (sparse stage, top-6 of 16 tokens) with a headwise gate; the indexer learns from its KL
    "dsa_sparse": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4, "n_kv_heads": 4, "head_dim": 0,
                   "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False, "init_std": 0.1,
                   "attention": "dsa", "output_gate": "headwise",
                   "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8,
                           "v_head_dim": 8, "rope": True, "softmax_scale": 0.0, "latent_eps": 1e-6,
                           "dsa": {"topk": 6, "heads": 4, "head_dim": 16, "rope_dim": 8, "stage": "sparse",
                                   "kl_coeff": 0.5, "dk_slabs": 4}}},
    # Kimi K3's full-attention layer: dense gated MLA with NoPE, elementwise gate, no q_lora; MoE from layer 1
    "mla_nope_moe": {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 2, "head_dim": 0,
                     "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": True,
                     "init_std": 0.1, "attention": "mla", "output_gate": "elementwise",
                     "mla": {"q_lora_rank": 0, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
                             "v_head_dim": 8, "rope": False, "softmax_scale": 0.0, "latent_eps": 1e-6,
                             "dsa": {"topk": 0, "heads": 4, "head_dim": 32, "rope_dim": 16, "stage": "sparse",
                                     "kl_coeff": 1.0, "dk_slabs": 4}},
                     "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 16, "score": "sigmoid",
                             "first_dense": 1, "balance": "sign", "bias_update_rate": 0.01}},
    # a tiny Kimi-K3-with-DSA hybrid: KDA (lower-bound gate, full-rank output gate) : gated DSA = 3 : 1,
    # Stable LatentMoE with SiTU-GLU and a shared expert from layer 1. Top-12 of 16: later rows select. (With
    # fewer, the fp32 drift of the KDA layers over the trajectory moves indexer scores across close selection
    # boundaries after a few steps; dsa_sparse covers small top-k over the whole trajectory.)
    "hybrid_kda_dsa": {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "head_dim": 0,
                       "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False,
                       "init_std": 0.1, "attention": ["kda", "kda", "kda", "dsa"], "output_gate": "elementwise",
                       "mlp_activation": "situ",
                       "kda": {"num_heads": 2, "num_v_heads": 2, "head_dim": 16, "head_v_dim": 16, "conv_size": 4,
                               "gate_rank": 8, "gate_lower_bound": -5.0, "full_rank_output_gate": True,
                               "o_norm_eps": 1e-5, "chunk_size": 32},
                       "mla": {"q_lora_rank": 24, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8,
                               "v_head_dim": 8, "rope": False, "softmax_scale": 0.0, "latent_eps": 1e-6,
                               "dsa": {"topk": 12, "heads": 4, "head_dim": 16, "rope_dim": 8, "stage": "sparse",
                                       "kl_coeff": 1.0, "dk_slabs": 4}},
                       "moe": {"experts": 8, "topk": 2, "ffn_dim": 16, "latent_dim": 16, "latent_norm": True,
                               "shared_ffn_dim": 16, "score": "sigmoid", "activation": "situ", "first_dense": 1,
                               "balance": "sign", "bias_update_rate": 0.05}},
    # Kimi K3's residual dataflow: Attention Residuals with depth blocks of 2 over 5 layers (blocks start at
    # layers 0, 2, 4; the output mix reads 4 sources) around gated NoPE MLA, a SiTU dense layer 0 and Stable
    # LatentMoE with a shared expert
    "attn_res_mla_moe": {"vocab_size": 64, "d_model": 32, "n_layers": 5, "n_heads": 2, "n_kv_heads": 2,
                         "head_dim": 0, "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0,
                         "tie_embeddings": False, "init_std": 0.1, "attention": "mla", "output_gate": "elementwise",
                         "mlp_activation": "situ", "attn_res_block_size": 2,
                         "mla": {"q_lora_rank": 0, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 4,
                                 "v_head_dim": 8, "rope": False, "softmax_scale": 0.0, "latent_eps": 1e-6,
                                 "dsa": {"topk": 0, "heads": 4, "head_dim": 32, "rope_dim": 16, "stage": "sparse",
                                         "kl_coeff": 1.0, "dk_slabs": 4}},
                         "moe": {"experts": 8, "topk": 2, "ffn_dim": 16, "latent_dim": 16, "latent_norm": True,
                                 "shared_ffn_dim": 16, "score": "sigmoid", "activation": "situ", "first_dense": 1,
                                 "balance": "sign", "bias_update_rate": 0.05}},
    # Qwen3-Next-like: Gated DeltaNet : gated GQA = 3 : 1 with grouped value heads; the GQA layer with
    # per-head q/k RMSNorm and partial rotary (4 of 8 dims); MoE in layers 2-3 with a softmax router and a
    # shared expert scaled by its sigmoid gate
    "hybrid_gdn_gqa": {"vocab_size": 64, "d_model": 32, "n_layers": 4, "n_heads": 4, "n_kv_heads": 2, "head_dim": 0,
                       "ffn_dim": 48, "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": True,
                       "init_std": 0.1, "attention": ["gdn", "gdn", "gdn", "gqa"], "output_gate": "elementwise",
                       "qk_norm": True, "rope_dim": 4,
                       "kda": {"num_heads": 2, "num_v_heads": 4, "head_dim": 16, "head_v_dim": 8, "conv_size": 4,
                               "o_norm_eps": 1e-6, "chunk_size": 64},
                       "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 24, "score": "softmax",
                               "shared_expert_gate": True, "first_dense": 2, "balance": "frozen"}},
}

# Cases whose 10-step trajectory at lr 1e-2 is ill-conditioned in fp32: PyTorch's own fp32 run of
# hybrid_kda_dsa departs from its float64 run by 1e-2 relative by step 7 (attn_res_mla_moe: 3e-3 by step 8;
# expert choices flip). At lr 3e-3 the same comparison stays within 2e-6, so the engine can be held to 1e-5.
TRAIN_OVERRIDES = {"hybrid_kda_dsa": {"lr": 3e-3}, "hybrid_gdn_gqa": {"lr": 3e-3}, "attn_res_mla_moe": {"lr": 3e-3}}

ONLY = set(sys.argv[1:])  # case names to write (default: all)


def batch(gen, c, t):
    ids = torch.randint(0, c["vocab_size"], (t["batch_size"], t["seq_len"]), generator=gen, dtype=torch.int32)
    targets = torch.randint(0, c["vocab_size"], (t["batch_size"], t["seq_len"]), generator=gen, dtype=torch.int32)
    targets[0, :3] = -100  # ignored positions
    return ids, targets


import dense_model  # noqa: E402

dense_model.MlaAttention.margin = 1e-4  # DSA selections and expert choices with a clear gap, so fp32
dense_model.MoE.margin = 1e-4           # rounding cannot flip them anywhere in the trajectory


def write_case(name, c, seed):
    train = dict(TRAIN, **TRAIN_OVERRIDES.get(name, {}))
    gen = torch.Generator().manual_seed(seed)
    model = DenseLM(c).double()
    with torch.no_grad():
        for pname, p in model.checkpoint_params():
            if pname.endswith("e_score_correction_bias"):
                p.copy_(0.05 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            elif p.dim() >= 2:
                p.copy_(torch.randn(p.shape, generator=gen, dtype=torch.float64) * c["init_std"])
            else:
                p.copy_(1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64))
            p.copy_(p.float().double())  # exactly representable in f32: both sides start equal
    tensors = {"param." + n: p.detach().float() for n, p in model.checkpoint_params()}
    ids, targets = batch(gen, c, train)
    tensors["ids"], tensors["targets"] = ids, targets
    logits = model(ids.long())
    loss = model.loss(ids, targets)
    (loss + model.aux_loss()).backward()
    tensors["expected.logits"] = logits.detach().reshape(-1, c["vocab_size"])
    tensors["expected.loss"] = loss.detach()
    for n, p in model.checkpoint_params():
        tensors["expected.grad." + n] = p.grad.detach() if p.grad is not None else torch.zeros_like(p).detach()
    # trajectory
    opt = make_optimizer(model, train)
    traj_ids, traj_targets, losses = [], [], []
    for step in range(train["steps"]):
        i, tg = batch(gen, c, train)
        traj_ids.append(i)
        traj_targets.append(tg)
        losses.append(train_step(model, opt, train, step, i, tg))
    tensors["traj.ids"] = torch.stack(traj_ids)
    tensors["traj.targets"] = torch.stack(traj_targets)
    tensors["expected.traj.losses"] = torch.tensor(losses, dtype=torch.float64)
    config = {"model": c, "train": train}
    golden.save(f"model/{name}.safetensors", tensors, seed, config=json.dumps(config))


for name, c in CASES.items():
    if ONLY and name not in ONLY:
        continue
    for attempt in range(20):  # a new seed when a DSA selection boundary is too close to call
        try:
            write_case(name, c, SEED + 1000 * attempt)
            break
        except AssertionError as e:
            print(f"{name}: seed {SEED + 1000 * attempt}: {e}")
