"""Training throughput of tessera vs the same model in PyTorch on the CPU, side by side.

Alternates rounds (the tessera binary, then each PyTorch reference in this process, same thread
count), takes the median tokens/s over each run's steps after warm-up, and prints a markdown table
with the ratios. References, each the same work per step (AdamW with the same settings, global-norm
clipping, the warm-up + cosine schedule):
  project: tools/ref/dense_model.py with scaled_dot_product_attention, eager
  llama:   Hugging Face transformers' LlamaForCausalLM of the same shapes (SDPA attention), eager
  llama-compiled (with --compile): the same under torch.compile (inductor; compile time left out
           with the warm-up steps)

With --lora R: LoRA fine-tuning instead (rank R, alpha 2R, adapters on q/k/v/o and gate/up/down of every layer,
the base frozen): tessera with adapters, the same over a bf16 base, tessera with the base frozen and no adapters (only the final norm trains:
the forward + input-gradient backward LoRA cannot avoid) and tessera training everything, against the llama
reference with PEFT's LoRA (peft.get_peft_model, the same targets; PyTorch's frozen weights get no gradient).

Run: python3 tools/ref/compare_train_speed.py --config configs/bench_dense.json [--compile] [--lora 16]
"""
import argparse
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(__file__))
from dense_model import DenseLM, make_optimizer, train_step  # noqa: E402

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

MODEL_DEFAULTS = {"vocab_size": 258, "d_model": 256, "n_layers": 4, "n_heads": 4, "head_dim": 0, "ffn_dim": 768,
                  "norm_eps": 1e-6, "rope_theta": 10000.0, "tie_embeddings": False}
TRAIN_DEFAULTS = {"lr": 3e-3, "min_lr_ratio": 0.1, "warmup_steps": 50, "steps": 1000, "weight_decay": 0.1,
                  "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "grad_clip": 1.0}


LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]


def lora_sets(rank):
    return ["--set", f"model.lora.rank={rank}", "--set", f"model.lora.alpha={2 * rank}", "--set",
            "model.lora.target_modules=" + json.dumps(LORA_TARGETS)]


def run_tessera(binary, config, steps, threads, warmup, sets=()):
    with tempfile.TemporaryDirectory() as out:
        run = os.path.join(out, "run")
        proc = subprocess.run([binary, "--threads", str(threads), "train", "--config", config, "--steps", str(steps),
                               "--out", run, *sets], capture_output=True, text=True, check=True)
        rates = []
        peak = None
        with open(os.path.join(run, "metrics.jsonl")) as f:
            for line in f:
                rec = json.loads(line)
                if "tokens_per_s" in rec and rec["step"] > warmup:
                    rates.append(rec["tokens_per_s"])
        for line in proc.stdout.splitlines():
            if "predicted peak" in line:
                peak = line.strip()
        return statistics.median(rates), peak


class LlamaLM(torch.nn.Module):
    """transformers' LlamaForCausalLM with the bench model's shapes, behind dense_model's loss API."""

    def __init__(self, c, seq_len, lora_rank=0):
        super().__init__()
        from transformers import LlamaConfig, LlamaForCausalLM
        cfg = LlamaConfig(vocab_size=c["vocab_size"], hidden_size=c["d_model"], intermediate_size=c["ffn_dim"],
                          num_hidden_layers=c["n_layers"], num_attention_heads=c["n_heads"],
                          num_key_value_heads=c["n_kv_heads"], head_dim=c.get("head_dim") or c["d_model"] // c["n_heads"],
                          rms_norm_eps=c["norm_eps"], rope_theta=c["rope_theta"],
                          tie_word_embeddings=c["tie_embeddings"], max_position_embeddings=seq_len,
                          attention_bias=False, mlp_bias=False, use_cache=False)
        cfg._attn_implementation = "sdpa"
        self.lm = LlamaForCausalLM(cfg)
        if lora_rank:
            import peft
            self.lm = peft.get_peft_model(self.lm, peft.LoraConfig(r=lora_rank, lora_alpha=2 * lora_rank,
                                                                   lora_dropout=0.0, target_modules=LORA_TARGETS))
        self.forward_logits = self.lm

    def loss(self, ids, targets):
        logits = self.forward_logits(input_ids=ids).logits
        return torch.nn.functional.cross_entropy(logits.flatten(0, 1), targets.flatten())

    def aux_loss(self):
        return 0.0

    def moe_layers(self):
        return []


def make_reference(kind, model_cfg, train_cfg, lora_rank=0):
    torch.manual_seed(0)
    if kind == "llama-peft":
        return LlamaLM(model_cfg, train_cfg["seq_len"], lora_rank)
    if kind == "project":
        model = DenseLM(model_cfg)
        model.set_sdpa(True)
    else:
        model = LlamaLM(model_cfg, train_cfg["seq_len"])
        if kind == "llama-compiled":
            model.forward_logits = torch.compile(model.lm)
    return model


def run_torch(kind, model_cfg, train_cfg, steps, warmup, lora_rank=0):
    model = make_reference(kind, model_cfg, train_cfg, lora_rank)
    opt = make_optimizer(model, train_cfg)
    B, T, V = train_cfg["batch_size"], train_cfg["seq_len"], model_cfg["vocab_size"]
    rates = []
    for step in range(steps):
        ids = torch.randint(0, V, (B, T))
        targets = torch.randint(0, V, (B, T))
        t0 = time.perf_counter()
        train_step(model, opt, train_cfg, step, ids, targets)
        dt = time.perf_counter() - t0
        if step >= warmup:
            rates.append(B * T / dt)
    return statistics.median(rates)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--config", default=os.path.join(ROOT, "configs", "bench_dense.json"))
    ap.add_argument("--tessera", default=os.path.join(ROOT, "build", "apps", "tessera"))
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--warmup", type=int, default=2, help="steps left out of the median")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--references", default="project,llama", help="comma-separated: project, llama")
    ap.add_argument("--compile", action="store_true", help="also llama under torch.compile")
    ap.add_argument("--lora", type=int, default=0, help="LoRA fine-tuning of rank R instead (see above)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    cfg = json.load(open(args.config))
    model_cfg = dict(MODEL_DEFAULTS, **cfg["model"])
    model_cfg.setdefault("n_kv_heads", model_cfg["n_heads"])
    train_cfg = dict(TRAIN_DEFAULTS, **cfg.get("train", {}))
    refs = [r for r in args.references.split(",") if r] + (["llama-compiled"] if args.compile else [])
    # LoRA: tessera's other two ways of training the same model are references too
    variants = {"tessera": lora_sets(args.lora) if args.lora else []}
    if args.lora:
        refs = ["tessera-frozen", "tessera-full", "llama-peft"]
        variants["tessera-frozen"] = ["--set", "model.lora.rank=1", "--set", 'model.lora.modules_to_save=["norm"]']
        variants["tessera-full"] = []
        refs.insert(1, "tessera-bf16-base")  # the same adapters over a base held in bf16 (model.lora.base_dtype)
        variants["tessera-bf16-base"] = lora_sets(args.lora) + ["--set", "model.lora.base_dtype=bf16"]
    rows = []
    peak = None
    for r in range(args.rounds):
        row = {}
        for name, sets in variants.items():
            row[name], p = run_tessera(args.tessera, args.config, args.steps, args.threads, args.warmup, sets)
            if name == "tessera":
                peak = p
        for ref in refs:
            if ref in variants:
                continue
            row[ref] = run_torch(ref, model_cfg, train_cfg, args.steps + (3 if ref == "llama-compiled" else 0),
                                 args.warmup + (3 if ref == "llama-compiled" else 0), args.lora)
        rows.append(row)
        print(f"round {r + 1}: " + ", ".join(f"{k} {v:,.0f} tok/s" for k, v in row.items()), file=sys.stderr)
    torch_rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    c = model_cfg
    import platform
    print(f"\nmodel: d={c['d_model']}, {c['n_layers']} layers, {c['n_heads']} heads ({c['n_kv_heads']} kv), "
          f"ffn {c['ffn_dim']}, vocab {c['vocab_size']}; batch {train_cfg['batch_size']} x seq {train_cfg['seq_len']}; "
          f"{args.threads} threads; PyTorch {torch.__version__} (CPU capability {torch.backends.cpu.get_cpu_capability()}), "
          f"{platform.processor() or platform.machine()}\n")
    print("| round | tessera tok/s | " + " | ".join(f"{r} tok/s | ratio" for r in refs) + " |")
    print("|---|---|" + "---|---|" * len(refs))
    for i, row in enumerate(rows):
        print(f"| {i + 1} | {row['tessera']:,.0f} | " +
              " | ".join(f"{row[r]:,.0f} | {row['tessera'] / row[r]:.2f}" for r in refs) + " |")
    med = lambda k: statistics.median(row[k] for row in rows)  # noqa: E731
    print(f"| median | {med('tessera'):,.0f} | " +
          " | ".join(f"{med(r):,.0f} | **{statistics.median(row['tessera'] / row[r] for row in rows):.2f}**"
                     for r in refs) + " |")
    print(f"\ntessera memory: {peak}\nPyTorch process max RSS: {torch_rss:,.0f} MiB")


if __name__ == "__main__":
    main()
