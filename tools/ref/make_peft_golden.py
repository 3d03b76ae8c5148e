"""Writes five LoRA adapters made by PEFT (peft.get_peft_model, save_pretrained) on transformers' own tiny
DeepseekV32ForCausalLM (tests/golden/hf/deepseek_v32_tiny, from make_hf_interop_golden.py; two more on its
KimiLinearForCausalLM and Qwen3NextForCausalLM), each with random A and B
(init_lora_weights=False, B scaled so the adapters matter), and beside each <name>_expected.safetensors: token ids
and targets, PEFT's logits (float32 forward), its loss (mean cross-entropy over the targets) and the gradient of that
loss for every adapter tensor ("grad.<PEFT key>"):
  deepseek_v32_tiny_peft          rank 2, alpha 3, on MLA's projections in every layer (q_a/q_b, kv_a_proj_with_mqa,
                                  kv_b_proj, o_proj)
  deepseek_v32_tiny_peft_experts  rank 2, alpha 3, on o_proj and, through target_parameters, the stacked routed
                                  experts of both MoE layers (mlp.experts.gate_up_proj, mlp.experts.down_proj:
                                  PEFT's lora.ParamWrapper, gate and up sharing one A)
  kimi_linear_tiny_peft           rank 2, alpha 3, on transformers' own tiny KimiLinearForCausalLM: o_proj, KDA's
                                  forget gate (f_a_proj, f_b_proj), the shared experts' down_proj and the stacked
                                  routed experts
  qwen3_next_tiny_peft            rank 2, alpha 3, on transformers' own tiny Qwen3NextForCausalLM: the fused
                                  in_proj_qkvz and in_proj_ba of GatedDeltaNet, gated attention's fused q_proj, and
                                  out_proj
  deepseek_v32_tiny_peft_saved    rank 2, alpha 3, on o_proj, with modules_to_save lm_head and model.norm (their
                                  trained copies perturbed so that they differ from the base's; gradients for them
                                  too, under PEFT's saved key: base_model.model.lm_head.weight)
tessera must read each directory on its base and reproduce logits and gradients, and write the adapters back
(tests/model/test_peft.cpp).

  python3 tools/ref/make_peft_golden.py [NAME ...]      writes them (all by default)
  python3 tools/ref/make_peft_golden.py --check DIR     reads a PEFT directory tessera wrote (export-hf) with PEFT
                                                        on its base and prints PEFT's logits' relative RMS distance
                                                        from DIR/../<name>_expected.safetensors' (the adapters
                                                        tessera read from that golden, written back in its form)
"""
import json
import os
import sys

sys.modules["fla"] = None  # transformers' PyTorch reference paths

import peft  # noqa: E402
import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

import golden  # noqa: E402

SEED = 11
HF = os.path.join(golden.GOLDEN, "hf")
# MLA's projections. (Naming gate_proj / up_proj / down_proj, PEFT 0.21 with transformers 5 adapts the stacked
# routed experts through target_parameters even when a regex names only the shared experts' modules: the second
# case names them explicitly.)
CASES = {
    "deepseek_v32_tiny_peft": dict(target_modules=["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj",
                                                   "o_proj"]),
    "deepseek_v32_tiny_peft_experts": dict(target_modules=["o_proj"],
                                           target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
    # transformers' Kimi-Linear renames its checkpoint's modules (block_sparse_moe -> mlp, f_a_proj / f_b_proj ->
    # self_attn.forget_gate.*): PEFT's keys are the model's names
    "deepseek_v32_tiny_peft_saved": dict(target_modules=["o_proj"], modules_to_save=["lm_head", "model.norm"]),
    # Qwen3-Next's fused projections: GatedDeltaNet's in_proj_qkvz (q, k, v, z per key head) and in_proj_ba, gated
    # attention's q_proj (q and its output gate per head), beside the one-to-one out_proj
    "qwen3_next_tiny_peft": dict(target_modules=["in_proj_qkvz", "in_proj_ba", "q_proj", "out_proj"]),
    "kimi_linear_tiny_peft": dict(target_modules=["o_proj", "f_a_proj", "f_b_proj", "shared_experts.down_proj"],
                                  target_parameters=["mlp.experts.gate_up_proj", "mlp.experts.down_proj"]),
}
BASES = {"kimi_linear_tiny_peft": "kimi_linear_tiny", "qwen3_next_tiny_peft": "qwen3_next_tiny"}


def logits_and_grads(pm, ids, targets):
    logits = pm(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    adapters = {n: p for n, p in pm.named_parameters() if "lora_" in n or "modules_to_save" in n}
    grads = torch.autograd.grad(loss, list(adapters.values()))
    return logits, loss, adapters, grads


def check(directory):
    name = os.path.basename(os.path.normpath(directory))
    base = os.path.join(HF, BASES.get(name, "deepseek_v32_tiny"))
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    pm = peft.PeftModel.from_pretrained(model, directory)
    expected = safe_open_all(os.path.join(HF, name + "_expected.safetensors"))
    logits = pm(input_ids=expected["ids"]).logits.detach()
    want = expected["expected.logits"]
    rel = ((logits - want).pow(2).mean().sqrt() / want.pow(2).mean().sqrt()).item()
    print(f"{directory}: PEFT's logits vs the golden's: relative RMS {rel:.3g}")


def safe_open_all(path):
    from safetensors.torch import load_file
    return load_file(path)


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--check":
        check(sys.argv[2])
        return
    for name in sys.argv[1:] or CASES:
        make(name, CASES[name])


def make(name, targets):
    torch.manual_seed(SEED)
    base_name = BASES.get(name, "deepseek_v32_tiny")
    base = os.path.join(HF, base_name)
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    cfg = peft.LoraConfig(r=2, lora_alpha=3, lora_dropout=0.0, init_lora_weights=False, **targets)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # B of the same order as A: the adapters move the logits well above float noise
        for n, p in pm.named_parameters():
            if "lora_B" in n:
                p.mul_(4.0)
            if "modules_to_save" in n:  # trained copies unlike the base's
                p.add_(0.05 * torch.randn_like(p))
    out = os.path.join(HF, name)
    pm.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model card (it names this machine's paths)
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    conf["base_model_name_or_path"] = "../" + base_name  # the base beside it, wherever the tree is
    json.dump(conf, open(os.path.join(out, "adapter_config.json"), "w"), indent=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    targets_ = torch.randint(0, model.config.vocab_size, (2, 20))
    logits, loss, adapters, grads = logits_and_grads(pm, ids, targets_)
    tensors = {"ids": ids.to(torch.int64), "targets": targets_.to(torch.int64), "expected.logits": logits.detach(),
               "expected.loss": loss.detach().reshape(1)}
    for (n, _), g in zip(adapters.items(), grads):
        # PEFT's saved key: the adapter name dropped (a saved module's copy under the module's own name)
        key = n.replace(".modules_to_save.default", "").replace(".default", "")
        tensors["grad." + key] = g.detach().contiguous()
    save_file(tensors, os.path.join(HF, name + "_expected.safetensors"),
              metadata={"script": "tools/ref/make_peft_golden.py", "seed": str(SEED), "torch": torch.__version__,
                        "peft": peft.__version__})
    print(f"wrote {out} ({len(adapters)} adapter tensors) and its expected logits, loss and gradients")


if __name__ == "__main__":
    main()
