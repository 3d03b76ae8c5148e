"""Writes tests/golden/hf/<name>/: a tiny random model built with Hugging Face transformers' own
KimiLinearForCausalLM (kimi_linear_tiny), Qwen3NextForCausalLM (qwen3_next_tiny) or DeepseekV32ForCausalLM
(deepseek_v32_tiny), on their PyTorch
reference paths (fla is hidden so the CPU fallbacks run), saved with save_pretrained (config.json +
model.safetensors in the published layout), plus <name>_logits.safetensors: token ids and transformers'
logits (float32 forward). tessera must load the directory and reproduce the logits
(tests/model/test_hf_checkpoint.cpp).

Issue 11's cases: deepseek_v32_yarn_tiny (YaRN with mscale != mscale_all_dim, so the cos/sin attention factor and
MLA's softmax mscale² both matter, positions past original_max_position_embeddings; a dense layer between MoE
layers by mlp_layer_types; tied embeddings), qwen3_next_yarn_tiny (YaRN through the older rope_scaling key,
partial_rotary_factor 0.3 of head_dim 16 = int(4.8) = 4 rotary dims, decoder_sparse_step 2 with mlp_only_layers,
tied embeddings, router_aux_loss_coef with output_router_logits; its file also holds transformers' loss and every
parameter gradient of loss + router_aux_loss_coef · aux_loss for labels = ids, "grad.<tensor>"), and
kimi_linear_tied_tiny (tie_word_embeddings true: transformers' Kimi-Linear still computes with its own stored
lm_head).

Run: python3 tools/ref/make_hf_interop_golden.py [name ...]
"""
import os
import sys

sys.modules["fla"] = None  # use transformers' PyTorch reference implementations (no Triton on the CPU)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import (  # noqa: E402
    DeepseekV32Config, DeepseekV32ForCausalLM, KimiLinearConfig, KimiLinearForCausalLM, Qwen3NextConfig,
    Qwen3NextForCausalLM)

import golden  # noqa: E402

SEED = 5


def kimi_linear():
    return KimiLinearForCausalLM(KimiLinearConfig(
        vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
        intermediate_size=48, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
        mla_use_nope=True,
        linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
                            "full_attn_layers": [3]},
        num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1,
        moe_layer_freq=1, moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.0,
        use_grouped_topk=True, num_expert_group=1, topk_group=1, tie_word_embeddings=False, rms_norm_eps=1e-6,
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def qwen3_next():
    """Gated DeltaNet x 3 : gated GQA (q/k norms, partial rotary) with MoE + gated shared expert everywhere;
    grouped value heads (4 value heads over 2 key heads) exercise the per-key-head packing of in_proj_qkvz."""
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=1, partial_rotary_factor=0.5,
        rms_norm_eps=1e-6, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def deepseek_v32():
    """MLA with interleaved RoPE and the DSA indexer (top-6 of 20 tokens: selection happens) in every layer,
    a dense layer 0, then MoE with a sigmoid router + selection bias, group limits and a shared expert."""
    return DeepseekV32ForCausalLM(DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, index_topk=6, index_head_dim=16,
        index_n_heads=8, first_k_dense_replace=1, tie_word_embeddings=False, pad_token_id=0, bos_token_id=1,
        eos_token_id=2))


def deepseek_v32_yarn():
    return DeepseekV32ForCausalLM(DeepseekV32Config(
        vocab_size=64, hidden_size=32, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=2, num_key_value_heads=2, n_shared_experts=1, n_routed_experts=4, routed_scaling_factor=2.5,
        kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8, v_head_dim=8, qk_nope_head_dim=8, n_group=2,
        topk_group=1, num_experts_per_tok=2, norm_topk_prob=True, rms_norm_eps=1e-6, index_topk=6, index_head_dim=16,
        index_n_heads=8, first_k_dense_replace=0, mlp_layer_types=["sparse", "dense", "sparse"],
        tie_word_embeddings=True, max_position_embeddings=32,
        rope_parameters={"rope_type": "yarn", "rope_theta": 100.0, "factor": 4.0, "original_max_position_embeddings": 8,
                         "beta_fast": 8.0, "beta_slow": 1.0, "mscale": 0.8, "mscale_all_dim": 0.5},
        pad_token_id=0, bos_token_id=1, eos_token_id=2))


def qwen3_next_yarn():
    return Qwen3NextForCausalLM(Qwen3NextConfig(
        vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=4, num_attention_heads=2,
        num_key_value_heads=1, head_dim=16, linear_num_key_heads=2, linear_num_value_heads=4, linear_key_head_dim=8,
        linear_value_head_dim=8, linear_conv_kernel_dim=4, num_experts=4, num_experts_per_tok=2,
        moe_intermediate_size=16, shared_expert_intermediate_size=24, decoder_sparse_step=2, mlp_only_layers=[3],
        layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"],
        partial_rotary_factor=0.3, rope_theta=500.0, max_position_embeddings=64,
        rope_scaling={"type": "yarn", "factor": 8.0, "original_max_position_embeddings": 8, "beta_fast": 4.0,
                      "beta_slow": 1.0, "truncate": False},
        output_router_logits=True, router_aux_loss_coef=0.05,
        rms_norm_eps=1e-6, tie_word_embeddings=True, pad_token_id=0, bos_token_id=1, eos_token_id=2))


def kimi_linear_tied():
    model = kimi_linear()
    model.config.tie_word_embeddings = True  # transformers' Kimi-Linear keeps its own lm_head all the same
    return model


def indexer_gap(model, ids):
    """The smallest gap, over DSA layers and rows with more candidates than index_topk, between the k-th and
    (k+1)-th index score, recomputed in float64 from the indexer's own inputs (inf without DSA layers). The
    golden needs a clear gap: with exact ties (relu zeros) torch.topk and tessera may pick different keys."""
    inputs, gaps = {}, [float("inf")]
    hooks = [layer.self_attn.indexer.register_forward_pre_hook(
        lambda mod, args, i=i: inputs.__setitem__(i, args)) for i, layer in enumerate(model.model.layers)
        if hasattr(getattr(layer, "self_attn", None), "indexer")]
    with torch.no_grad():
        model(ids)
    for h in hooks:
        h.remove()
    for i, (hs, q_resid, (cos, sin), *_) in inputs.items():
        ix = model.model.layers[i].self_attn.indexer
        B, S, _ = hs.shape
        r, K = ix.qk_rope_head_dim, ix.index_topk
        q = ix.wq_b(q_resid).view(B, S, ix.n_heads, ix.head_dim).double()
        k = ix.k_norm(ix.wk(hs)).double()
        c, s = cos.double(), sin.double()

        def rope(x, c, s):  # rotate-half on the first r dims
            half = r // 2
            xr = x[..., :r]
            rot = torch.cat([-xr[..., half:], xr[..., :half]], -1)
            return torch.cat([xr * c + rot * s, x[..., r:]], -1)

        q, k = rope(q, c[:, :, None, :], s[:, :, None, :]), rope(k, c, s)
        scores = torch.relu(torch.einsum("bshd,btd->bsht", q, k)) * ix.softmax_scale
        index = torch.einsum("bsh,bsht->bst", ix.weights_proj(hs).double() * ix.n_heads ** -0.5, scores)
        index = index.masked_fill(~torch.ones(S, S, dtype=torch.bool).tril(), float("-inf"))
        top = index.sort(-1, descending=True).values[:, K:]  # rows with more than K candidates
        gaps.append(float((top[:, :, K - 1] - top[:, :, K]).min()) if top.shape[1] else float("inf"))
    return min(gaps)


def write(name, build):
    for attempt in range(20):  # a new seed while a DSA selection boundary is too close to call
        seed = SEED + 1000 * attempt
        torch.manual_seed(seed)
        model = build().eval()
        with torch.no_grad():
            for pname, p in model.named_parameters():
                if p.dim() >= 2 and "A_log" not in pname:
                    p.copy_(torch.randn_like(p) * 0.2)
                elif pname.endswith("A_log"):
                    p.copy_(torch.rand_like(p) * 1.5)
                else:
                    p.copy_(1.0 + 0.1 * torch.randn_like(p))
            for bname, b in model.named_buffers():
                if bname.endswith("e_score_correction_bias"):
                    b.copy_(0.05 * torch.randn_like(b))
        ids = torch.randint(0, 64, (2, 20))
        gap = indexer_gap(model, ids)
        if gap > 1e-4:
            break
        print(f"{name}: seed {seed}: index score gap {gap} at a top-k boundary; next seed")
    out = os.path.join(golden.GOLDEN, "hf", name)
    os.makedirs(out, exist_ok=True)
    model.save_pretrained(out)
    with torch.no_grad():
        logits = model(ids).logits.double()  # float32 forward (the grouped expert matmul has no float64)
    tensors = {"ids": ids.to(torch.int64), "expected.logits": logits.contiguous()}
    if model.config.output_router_logits:  # transformers' training loss, with the router aux loss, and its gradients
        result = model(ids, labels=ids)
        result.loss.backward()
        tensors["expected.loss"] = result.loss.detach().double().reshape(1)
        tensors["expected.aux_loss"] = result.aux_loss.detach().double().reshape(1)
        for pname, p in model.named_parameters():  # under the names save_pretrained writes
            g = p.grad.detach().clone()
            if pname.endswith("mlp.experts.gate_up_proj"):  # [E, 2F, D]: gate rows, then up rows
                base, F = pname[:-len("gate_up_proj")], g.shape[1] // 2
                for e in range(g.shape[0]):
                    tensors[f"grad.{base}{e}.gate_proj.weight"] = g[e, :F].contiguous()
                    tensors[f"grad.{base}{e}.up_proj.weight"] = g[e, F:].contiguous()
            elif pname.endswith("mlp.experts.down_proj"):
                for e in range(g.shape[0]):
                    tensors[f"grad.{pname[:-len('down_proj')]}{e}.down_proj.weight"] = g[e].contiguous()
            else:
                tensors["grad." + pname] = g
        print(f"{name}: loss {float(result.loss):.6f} (aux {float(result.aux_loss):.6f})")
    save_file(tensors,
              os.path.join(out, "..", f"{name}_logits.safetensors"),
              metadata={"script": "tools/ref/make_hf_interop_golden.py", "seed": str(seed), "format_version": "1",
                        "torch": torch.__version__})
    print("wrote", out)


CASES = {"kimi_linear_tiny": kimi_linear, "qwen3_next_tiny": qwen3_next, "deepseek_v32_tiny": deepseek_v32,
         "deepseek_v32_yarn_tiny": deepseek_v32_yarn, "qwen3_next_yarn_tiny": qwen3_next_yarn,
         "kimi_linear_tied_tiny": kimi_linear_tied}
if __name__ == "__main__":
    for case, fn in CASES.items():
        if len(sys.argv) == 1 or case in sys.argv[1:]:
            write(case, fn)
