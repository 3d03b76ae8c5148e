"""Writes tests/golden/hf/deepseek_v32_tiny_peft/: a LoRA adapter made by PEFT (peft.get_peft_model,
save_pretrained) on transformers' own tiny DeepseekV32ForCausalLM (tests/golden/hf/deepseek_v32_tiny, from
make_hf_interop_golden.py), rank 2, alpha 3, on MLA's projections in every layer (q_a/q_b, kv_a_proj_with_mqa, kv_b_proj, o_proj), with random A and B
(init_lora_weights=False, B scaled so the adapters matter), plus deepseek_v32_tiny_peft_expected.safetensors: token
ids and targets, PEFT's logits (float32 forward), its loss (mean cross-entropy over the targets) and the gradient of
that loss for every adapter tensor ("grad.<PEFT key>"). tessera must read the directory on its base and reproduce
logits and gradients, and write the same adapter files back (tests/model/test_peft.cpp).

Run: python3 tools/ref/make_peft_golden.py
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
# routed experts instead, through target_parameters with gate and up fused at twice the rank, even when a regex
# names only the shared experts' modules; tessera does not read that form yet.)
TARGETS = ["q_a_proj", "q_b_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj"]


def main():
    torch.manual_seed(SEED)
    base = os.path.join(HF, "deepseek_v32_tiny")
    model = AutoModelForCausalLM.from_pretrained(base, dtype=torch.float32)
    model.eval()
    cfg = peft.LoraConfig(r=2, lora_alpha=3, lora_dropout=0.0, target_modules=TARGETS, init_lora_weights=False)
    pm = peft.get_peft_model(model, cfg)
    with torch.no_grad():  # B of the same order as A: the adapters move the logits well above float noise
        for name, p in pm.named_parameters():
            if "lora_B" in name:
                p.mul_(4.0)
    out = os.path.join(HF, "deepseek_v32_tiny_peft")
    pm.save_pretrained(out)
    os.remove(os.path.join(out, "README.md"))  # PEFT's model card (it names this machine's paths)
    conf = json.load(open(os.path.join(out, "adapter_config.json")))
    conf["base_model_name_or_path"] = "../deepseek_v32_tiny"  # the base beside it, wherever the tree is
    json.dump(conf, open(os.path.join(out, "adapter_config.json"), "w"), indent=2)
    ids = torch.randint(0, model.config.vocab_size, (2, 20))
    targets = torch.randint(0, model.config.vocab_size, (2, 20))
    logits = pm(input_ids=ids).logits
    loss = F.cross_entropy(logits.flatten(0, 1), targets.flatten())
    adapters = {n: p for n, p in pm.named_parameters() if "lora_" in n}
    grads = torch.autograd.grad(loss, list(adapters.values()))
    tensors = {"ids": ids.to(torch.int64), "targets": targets.to(torch.int64), "expected.logits": logits.detach(),
               "expected.loss": loss.detach().reshape(1)}
    for (name, _), g in zip(adapters.items(), grads):
        key = name.replace(".default", "")  # PEFT's saved key: the adapter name dropped
        tensors["grad." + key] = g.detach().contiguous()
    save_file(tensors, os.path.join(HF, "deepseek_v32_tiny_peft_expected.safetensors"),
              metadata={"script": "tools/ref/make_peft_golden.py", "seed": str(SEED), "torch": torch.__version__,
                        "peft": peft.__version__})
    print(f"wrote {out} ({len(adapters)} adapter tensors) and its expected logits, loss and gradients")


if __name__ == "__main__":
    main()
