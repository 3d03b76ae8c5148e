"""Writes tests/golden/hf/kimi_linear_tiny/: a tiny random Kimi-Linear model built with Hugging Face
transformers' own KimiLinearForCausalLM (its PyTorch reference paths: fla is hidden so the CPU fallbacks
run), saved with save_pretrained (config.json + model.safetensors in the published layout), plus
logits.safetensors: token ids and transformers' logits (float32 forward). tessera must load the directory
and reproduce the logits (tests/model/test_hf_checkpoint.cpp).

Run: python3 tools/ref/make_hf_interop_golden.py
"""
import os
import sys

sys.modules["fla"] = None  # use transformers' PyTorch reference implementations (no Triton on the CPU)

import torch  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import KimiLinearConfig, KimiLinearForCausalLM  # noqa: E402

import golden  # noqa: E402

SEED = 5
torch.manual_seed(SEED)
OUT = os.path.join(golden.GOLDEN, "hf", "kimi_linear_tiny")

cfg = KimiLinearConfig(
    vocab_size=64, hidden_size=32, num_hidden_layers=3, num_attention_heads=2, num_key_value_heads=2,
    intermediate_size=48, q_lora_rank=None, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8,
    mla_use_nope=True,
    linear_attn_config={"num_heads": 2, "head_dim": 16, "short_conv_kernel_size": 4, "kda_layers": [1, 2],
                        "full_attn_layers": [3]},
    num_experts=4, num_experts_per_token=2, moe_intermediate_size=16, num_shared_experts=1, first_k_dense_replace=1,
    moe_layer_freq=1, moe_router_activation_func="sigmoid", moe_renormalize=True, routed_scaling_factor=1.0,
    use_grouped_topk=True, num_expert_group=1, topk_group=1, tie_word_embeddings=False, rms_norm_eps=1e-6,
    pad_token_id=0, bos_token_id=1, eos_token_id=2)
model = KimiLinearForCausalLM(cfg).eval()
with torch.no_grad():
    for name, p in model.named_parameters():
        if p.dim() >= 2 and "A_log" not in name:
            p.copy_(torch.randn_like(p) * 0.2)
        elif name.endswith("A_log"):
            p.copy_(torch.rand_like(p) * 1.5)
        else:
            p.copy_(1.0 + 0.1 * torch.randn_like(p))
    for name, b in model.named_buffers():
        if name.endswith("e_score_correction_bias"):
            b.copy_(0.05 * torch.randn_like(b))
os.makedirs(OUT, exist_ok=True)
model.save_pretrained(OUT)
ids = torch.randint(0, 64, (2, 20))
with torch.no_grad():
    logits = model(ids).logits.double()  # float32 forward (the grouped expert matmul has no float64)
save_file({"ids": ids.to(torch.int64), "expected.logits": logits.contiguous()},
          os.path.join(OUT, "..", "kimi_linear_tiny_logits.safetensors"),
          metadata={"script": "tools/ref/make_hf_interop_golden.py", "seed": str(SEED), "format_version": "1",
                    "torch": torch.__version__})
print("wrote", OUT)
