"""Writes tests/golden/hf/export/<case>/: a tiny tessera model trained for a few steps by the built binary
(`tessera train`), its checkpoint (tessera/: config.json, trainer_state.json, model.safetensors), the directory
`tessera export-hf` makes of that checkpoint (hf/), and <case>_logits.safetensors: token ids and the logits Hugging
Face transformers computes from hf/ with its own KimiLinearForCausalLM / Qwen3NextForCausalLM /
DeepseekV32ForCausalLM (from_pretrained must report no missing, unexpected or mismatched tensor). CI has no Python:
tests/e2e/test_hf_cli.cpp exports tessera/ again, checks the files equal hf/ (so what transformers read is what the
current exporter writes), and checks tessera's logits (from the checkpoint and from its export) against
transformers'.

Cases: kimi_linear_export (KDA + NoPE MLA, grouped sigmoid router with a trained selection bias, tied embeddings:
the head must be written for transformers' Kimi-Linear), qwen3_next_export (GDN + gated GQA with q/k norms, YaRN,
partial rotary, dense layers between MoE layers, gated shared expert, the global balance loss, tied), and
deepseek_v32_export (MLA + DSA indexer with YaRN and mscale != mscale_all_dim, a dense layer between MoE layers,
group-limited routing, tied). Vocabulary 258: the byte tokenizer's, whose special ids the export writes.

Run: python3 tools/ref/make_hf_export_golden.py [--tessera build-test/apps/tessera] [case ...]
"""
import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile

sys.modules["fla"] = None  # transformers' PyTorch reference paths (no Triton on the CPU)

import torch  # noqa: E402
from safetensors.torch import load_file, save_file  # noqa: E402
from transformers import DeepseekV32ForCausalLM, KimiLinearForCausalLM, Qwen3NextForCausalLM  # noqa: E402

import golden  # noqa: E402
from make_hf_interop_golden import indexer_gap  # noqa: E402

TRAIN = {"seq_len": 32, "batch_size": 4, "steps": 30, "lr": 3e-3, "warmup_steps": 5, "eval_interval": 0,
         "eval_batches": 1, "checkpoint_interval": 0, "log_interval": 10, "seed": 11}

CASES = {
    "kimi_linear_export": (KimiLinearForCausalLM, {
        "vocab_size": 258, "d_model": 32, "n_layers": 3, "n_heads": 2, "init_std": 0.15, "ffn_dim": 48, "tie_embeddings": True,
        "attention": ["kda", "kda", "mla"],
        "kda": {"head_dim": 16, "o_norm_eps": 1e-6},
        "mla": {"q_lora_rank": 0, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 8,
                "rope": False},
        "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 16, "first_dense": 1, "groups": 2,
                "topk_groups": 1, "scaling": 2.0, "bias_update_rate": 0.01}}),
    "qwen3_next_export": (Qwen3NextForCausalLM, {
        "vocab_size": 258, "d_model": 32, "n_layers": 4, "n_heads": 2, "init_std": 0.15, "n_kv_heads": 1, "head_dim": 16,
        "ffn_dim": 48, "tie_embeddings": True, "attention": ["gdn", "gqa", "gdn", "gqa"],
        "output_gate": "elementwise", "qk_norm": True, "rope_dim": 4, "rope_theta": 500.0,
        "rope_scaling": {"factor": 8.0, "original_max_position": 8, "beta_fast": 4.0, "truncate": False},
        "kda": {"num_heads": 2, "num_v_heads": 4, "head_dim": 8, "head_v_dim": 8, "o_norm_eps": 1e-6},
        "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 24, "shared_expert_gate": True,
                "score": "softmax", "balance": "frozen", "layers": ["dense", "moe", "dense", "moe"],
                "global_aux_coeff": 0.01}}),
    "deepseek_v32_export": (DeepseekV32ForCausalLM, {
        "vocab_size": 258, "d_model": 32, "n_layers": 3, "n_heads": 2, "init_std": 0.15, "ffn_dim": 48, "tie_embeddings": True,
        "attention": "dsa", "rope_theta": 100.0,
        "rope_scaling": {"factor": 4.0, "original_max_position": 8, "beta_fast": 8.0, "mscale": 0.8,
                         "mscale_all_dim": 0.5},
        "mla": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 8,
                "dsa": {"topk": 8, "heads": 4, "head_dim": 16, "rope_dim": 8}},
        "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 16, "layers": ["moe", "dense", "moe"],
                "groups": 2, "topk_groups": 1, "scaling": 2.5, "bias_update_rate": 0.01}}),
}


def run(*args):
    r = subprocess.run(args, capture_output=True, text=True)
    if r.returncode != 0:
        sys.exit(f"{' '.join(args)} failed:\n{r.stderr}")
    return r.stdout


def write(case, tessera):
    cls, model_cfg = CASES[case]
    out = os.path.join(golden.GOLDEN, "hf", "export", case)
    shutil.rmtree(out, ignore_errors=True)
    with tempfile.TemporaryDirectory() as tmp:
        cfg_path = os.path.join(tmp, "config.json")
        with open(cfg_path, "w") as f:
            json.dump({"model": model_cfg, "train": TRAIN}, f)
        run(tessera, "--threads", "1", "train", "--config", cfg_path, "--out", os.path.join(tmp, "run"))
        steps = os.path.join(tmp, "run", "checkpoints")
        ckpt = os.path.join(steps, sorted(os.listdir(steps))[-1])
        os.makedirs(os.path.join(out, "tessera"))
        for name in ("config.json", "trainer_state.json", "model.safetensors"):  # what export-hf and logits read
            shutil.copy(os.path.join(ckpt, name), os.path.join(out, "tessera", name))
    run(tessera, "export-hf", "--checkpoint", os.path.join(out, "tessera"), "--out", os.path.join(out, "hf"))
    model, info = cls.from_pretrained(os.path.join(out, "hf"), output_loading_info=True, dtype=torch.float32)
    problems = {k: v for k, v in info.items() if v}
    assert not problems, f"{case}: transformers did not load every tensor: {problems}"
    model.eval()
    for attempt in range(20):  # ids whose DSA top-k boundaries are clear (exact ties could pick other keys)
        gen = torch.Generator().manual_seed(100 + attempt)
        ids = torch.randint(0, 258, (2, 20), generator=gen)
        if indexer_gap(model, ids) > 1e-4:
            break
    with torch.no_grad():
        logits = model(ids).logits  # float32, as transformers computes them
    path = os.path.join(golden.GOLDEN, "hf", "export", f"{case}_logits.safetensors")
    save_file({"ids": ids.to(torch.int64), "expected.logits": logits.contiguous()}, path,
              metadata={"script": "tools/ref/make_hf_export_golden.py", "format_version": "1",
                        "torch": torch.__version__, "case": case})
    # what tessera computes from its own checkpoint, for the record
    with tempfile.TemporaryDirectory() as tmp:
        save_file({"ids": ids.to(torch.int64)}, os.path.join(tmp, "ids.safetensors"))
        run(tessera, "logits", "--checkpoint", os.path.join(out, "tessera"), "--in", os.path.join(tmp, "ids.safetensors"),
            "--out", os.path.join(tmp, "logits.safetensors"))
        ours = load_file(os.path.join(tmp, "logits.safetensors"))["logits"].double()
    logits = logits.double()
    err = (ours - logits).abs().max().item()
    print(f"{case}: transformers loaded {out}/hf; tessera vs transformers logits: max abs {err:.2e}, "
          f"rel rms {((ours - logits).norm() / logits.norm()).item():.2e}")


parser = argparse.ArgumentParser()
parser.add_argument("--tessera", default=os.path.join(golden.ROOT, "build-test", "apps", "tessera"))
parser.add_argument("cases", nargs="*")
opts = parser.parse_args()
for c in opts.cases or CASES:
    write(c, opts.tessera)
