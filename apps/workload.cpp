#include "apps/workload.h"

#include "core/check.h"

namespace tessera::apps {

void add_workload_options(CLI::App* cmd, Workload& w, bool cluster_optional) {
    cmd->add_option("model", w.model, "A tessera config, or a Hugging Face config.json (or a directory holding one)")
        ->required();
    auto* cluster = cmd->add_option("--cluster", w.cluster, "The cluster file (configs/cluster/*.json, docs/plan.md)");
    if (!cluster_optional) cluster->required();
    add_int_option(cmd, "--ranks", w.ranks, 0, 1 << 20,
                   "Ranks (devices) to plan for (0 = every device of the cluster)");
    add_int_option(cmd, "--global-batch", w.batch, 0, train::kMaxBatch,
                   "Sequences per optimizer step (0 = the config's train.batch_size)");
    add_int_option(cmd, "--seq", w.seq, 0, model::kMaxSeqLen, "Tokens per sequence (0 = the config's train.seq_len)");
    cmd->add_option("--mode", w.mode,
                    "full: every parameter trains; lora: the base frozen (bf16) with rank-16 adapters on gate/up/down "
                    "projections unless model.lora says otherwise")
        ->check(CLI::IsMember({"full", "lora"}));
    cmd->add_option("--routing", w.routing,
                    "Expert load: uniform, zipf:S, or a run's metrics.jsonl (its recorded per-expert loads)");
    cmd->add_option("--set", w.overrides, "Override a config value: section.key=value (repeatable)");
}

Loaded load_workload(const Workload& w) {
    Loaded l;
    l.doc = load_model_doc(w.model);
    Json run = l.doc.run;
    if (w.mode == "lora" && !(run.contains("model") && run["model"].contains("lora"))) {
        apply_override(run, "model.lora.rank=16");
        apply_override(run, "model.lora.alpha=32");
        apply_override(run, R"(model.lora.target_modules=["gate_proj","up_proj","down_proj"])");
        apply_override(run, "model.lora.base_dtype=bf16");
    }
    for (const std::string& o : w.overrides) apply_override(run, o);
    if (w.batch) run["train"]["batch_size"] = w.batch;
    if (w.seq) run["train"]["seq_len"] = w.seq;
    l.cfg = train::parse_run_config(run, l.doc.file);
    TESSERA_CHECK(w.mode == "lora" || !l.cfg.model.lora.enabled(),
                  "--mode full but model.lora.rank is {}: use --mode lora", l.cfg.model.lora.rank);
    if (!w.cluster.empty()) l.cluster = plan::load_cluster(w.cluster);
    return l;
}

}  // namespace tessera::apps
