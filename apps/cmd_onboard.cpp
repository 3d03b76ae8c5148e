// tessera onboard: a model's first day (issue 16, docs/plan.md "Onboarding"). Its layers mapped to tessera's
// blocks and what tessera does not build; a shape-faithful miniature (model/miniature.h) trained on the demo corpus,
// which must lower its loss, with every op it ran recorded (ops/op_use.h) and each checked against its golden files:
// the reference's values in f64 and f32 and its backward against central differences (ops/verify.h); a plan of the
// full model for a cluster. One report, OUT/onboard.md and OUT/onboard.json; exit status 1 when a check failed.
#include <algorithm>
#include <filesystem>
#include <fstream>
#include <iostream>

#include "apps/commands.h"
#include "apps/options.h"
#include "apps/workload.h"
#include "core/check.h"
#include "core/file.h"
#include "model/inspect.h"
#include "model/miniature.h"
#include "ops/op_use.h"
#include "ops/verify.h"
#include "plan/plan.h"
#include "train/trainer.h"

namespace tessera::apps {

namespace fs = std::filesystem;

namespace {
struct OnboardArgs : Workload {
    std::string out, goldens = TESSERA_GOLDEN_OPS_DIR;
    int64_t steps = 40;
};

// the block that builds a layer range's attention and feed-forward (src/model/layers/)
std::string attention_template(const std::string& type, const model::ModelConfig& c) {
    const std::string gate = c.output_gate == "none" ? "" : ", " + c.output_gate + " output gate";
    if (type == "gqa") return "AttentionBlock (grouped-query attention" + gate + ")";
    if (type == "mla") return "MlaBlock (multi-head latent attention" + gate + ")";
    if (type == "dsa") return "MlaBlock + lightning indexer (DSA, top-" + std::to_string(c.mla.dsa.topk) + gate + ")";
    if (type == "kda") return "KdaBlock (Kimi Delta Attention)";
    if (type == "gdn") return "KdaBlock (Gated DeltaNet)";
    return "";
}

std::string ffn_template(const std::string& kind, const model::ModelConfig& c) {
    if (kind == "mlp") return c.mlp_activation == "situ" ? "MlpBlock (SiTU-GLU)" : "MlpBlock (SwiGLU)";
    const model::MoeConfig& m = c.moe;
    std::string s = fmt::format("MoeBlock ({}{} experts, top-{}, {} router", m.latent_dim ? "LatentMoE, " : "",
                                m.experts, m.topk, m.score);
    if (m.shared_ffn_dim) s += ", shared expert";
    return s + ")";
}

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    std::sort(v.begin(), v.end());
    return v[v.size() / 2];
}

// tokens/s of a run's steps after the first (metrics.jsonl)
double run_tokens_per_s(const fs::path& run) {
    std::ifstream in(run / "metrics.jsonl");
    std::vector<double> v;
    std::string line;
    for (bool first = true; std::getline(in, line);) {
        const Json r = Json::parse(line);
        if (!r.contains("tokens_per_s")) continue;
        if (!first) v.push_back(r["tokens_per_s"].get<double>());
        first = false;
    }
    return median(v);
}
// Everything after the arguments are read: returns whether every check passed (the report is written either way).
bool onboard(const OnboardArgs& a, const Loaded& w, const std::string& name, const fs::path& out) {
    const train::RunConfig& cfg = w.cfg;
    const model::ModelConfig& mc = cfg.model;
    int failed = 0, checks = 0;
    auto check = [&](bool ok) {
        ++checks;
        failed += !ok;
        return ok;
    };
    Json report{{"model", w.doc.file}, {"family", w.doc.family}, {"mode", a.mode}};
    std::string md = fmt::format("# Onboarding {}\n\n`{}`{}, {}\n\n", name, w.doc.file,
                                 w.doc.family.empty() ? "" : " (Hugging Face " + w.doc.family + ")",
                                 mc.lora.enabled() ? fmt::format("LoRA rank {}", mc.lora.rank) : "full training");

    // 1. modules -> blocks, and what is missing
    const model::ModelSummary summary = model::summarize(mc, cfg.train.seq_len);
    md += "## Modules\n\n| layers | attention | block | feed-forward | block |\n|---|---|---|---|---|\n";
    Json modules = Json::array();
    for (const auto& r : summary.layers) {
        const std::string at = attention_template(r.attention, mc), ft = ffn_template(r.ffn, mc);
        md += fmt::format("| {}–{} | {} | {} | {} | {} |\n", r.first, r.last, r.attention, at, r.ffn, ft);
        modules.push_back({{"first", r.first},
                           {"last", r.last},
                           {"attention", r.attention},
                           {"attention_block", at},
                           {"ffn", r.ffn},
                           {"ffn_block", ft}});
    }
    md += fmt::format("\nResiduals: {}. Positions: {}. {:.4g}B parameters, {:.4g}B active per token.\n\n",
                      summary.residuals, summary.positions, summary.params / 1e9, summary.active_params / 1e9);
    if (check(w.doc.unsupported.empty())) {
        md += "Missing: nothing; every module maps to a block.\n\n";
    } else {
        md += "**Missing** (tessera does not build these; the checks below use the rest):\n\n";
        for (const auto& u : w.doc.unsupported) md += "- " + u + "\n";
        md += "\n";
    }
    if (mc.vision.enabled()) {  // frozen, forward only: not part of the miniature's training run
        md += fmt::format(
            "Image tower: MoonViT-V2, {} blocks of width {} and the projector ({:.4g}B parameters, frozen, "
            "`model/vision.h`), checked against its float64 reference by tests/model/test_vision.cpp; the miniature "
            "below trains on text.\n\n",
            mc.vision.layers, mc.vision.width, double(mc.vision.num_params()) / 1e9);
        report["vision"] = {
            {"layers", mc.vision.layers}, {"width", mc.vision.width}, {"params", mc.vision.num_params()}};
    }
    report["modules"] = modules;
    report["missing"] = w.doc.unsupported;

    // 2. the miniature trained on the demo corpus, the ops it runs recorded
    train::RunConfig mini;
    mini.model = model::miniature(mc);
    mini.train.seq_len = 64;
    mini.train.batch_size = 8;
    mini.train.steps = a.steps;
    mini.train.warmup_steps = 5;
    mini.train.eval_interval = 0;
    mini.train.eval_batches = 4;
    mini.train.checkpoint_interval = 0;
    const fs::path mini_cfg = out / "miniature.json", mini_run = out / "miniature-run";
    write_text_atomic(mini_cfg.string(), train::to_json(mini).dump(2) + "\n");
    std::cout << fmt::format("onboard {}: training a miniature ({} layers, width {}) for {} steps ...\n", name,
                             mini.model.n_layers, mini.model.d_model, a.steps)
              << std::flush;
    train::TrainOptions to;
    to.config_path = mini_cfg.string();
    to.out_dir = mini_run.string();
    train::TrainSummary ts;
    std::set<std::string> used;
    {
        ops::OpUseRecorder recorder;
        ts = train::train(to);
        used = recorder.used();
    }
    const double first = ts.losses.front();
    std::vector<double> tail(ts.losses.end() - std::min<ptrdiff_t>(5, ptrdiff_t(ts.losses.size())), ts.losses.end());
    double last = 0;
    for (double l : tail) last += l / double(tail.size());
    const bool lowered = check(std::isfinite(last) && last < 0.9 * first);  // at least 10% below the first step
    const double tps = run_tokens_per_s(mini_run);
    md += fmt::format(
        "## Training a miniature\n\n{} layers ({}), width {}, the byte vocabulary; {} steps of {} × {} tokens on "
        "the demo corpus (`{}`, run in `{}`).\n\nLoss {:.4f} → {:.4f} (mean of the last {} steps): **{}**. "
        "{:.0f} tokens/s on this machine.\n\n",
        mini.model.n_layers, fmt::join(mini.model.attention, ", "), mini.model.d_model, a.steps, mini.train.batch_size,
        mini.train.seq_len, mini_cfg.string(), mini_run.string(), first, last, tail.size(),
        lowered ? "lowered" : "NOT lowered", tps);
    report["training"] = {{"config", mini_cfg.string()}, {"run", mini_run.string()}, {"steps", a.steps},
                          {"first_loss", first},         {"last_loss", last},        {"lowered", lowered},
                          {"tokens_per_s", tps},         {"losses", ts.losses}};

    // 3. every op the miniature ran, against its golden files
    md +=
        "## Ops\n\n| op | case | reference | f64 error | f32 error | gradients checked | worst FD error | |\n"
        "|---|---|---|---|---|---|---|---|\n";
    Json op_report = Json::array();
    for (const std::string& op : used) {
        const std::vector<std::string> files = ops::golden_files(a.goldens, op);
        if (!check(!files.empty())) {
            md += fmt::format("| {} | — | — | — | — | — | — | **no golden file** |\n", op);
            op_report.push_back({{"op", op}, {"cases", Json::array()}, {"passed", false}});
            continue;
        }
        Json cases = Json::array();
        bool op_ok = true;
        for (const std::string& f : files) {
            const ops::GoldenCheck r = ops::check_golden(f);
            op_ok &= check(r.passed());
            md += fmt::format("| {} | {} | {} | {:.2g} | {:.2g} | {} | {:.2g} | {} |\n", op, r.name, r.reference,
                              r.f64_error, r.f32_error, r.fd_checked, r.fd_error,
                              r.passed() ? "ok" : "**" + fmt::format("{}", fmt::join(r.problems, "; ")) + "**");
            cases.push_back({{"case", r.name},
                             {"reference", r.reference},
                             {"f64_error", r.f64_error},
                             {"f32_error", r.f32_error},
                             {"fd_checked", r.fd_checked},
                             {"fd_error", r.fd_error},
                             {"problems", r.problems}});
        }
        std::cout << fmt::format("  op {:<18} {} golden case{}: {}\n", op, files.size(), files.size() == 1 ? "" : "s",
                                 op_ok ? "ok" : "FAILED");
        op_report.push_back({{"op", op}, {"cases", cases}, {"passed", op_ok}});
    }
    md += "\n";
    report["ops"] = op_report;

    // 4. the full model planned on the cluster
    if (!a.cluster.empty()) {
        const plan::Plan p = plan::make_plan(cfg, w.cluster, plan::PlanOptions{a.ranks, 0, a.routing});
        const bool fits = !p.candidates.empty() && p.candidates.front().fits;
        md += fmt::format("## Plan on {}\n\n```\n{}```\n\n", w.cluster.name, plan::plan_report(p, w.cluster, 5));
        Json plan_json{{"cluster", w.cluster.name}, {"layouts", p.candidates.size()}, {"fits", fits}};
        if (!p.candidates.empty()) {
            const plan::Candidate& best = p.candidates.front();
            plan_json["best"] = {{"layout", best.layout.str()},
                                 {"arena_bytes", best.memory.arena_bytes},
                                 {"step_seconds", best.time.total},
                                 {"tokens_per_s_per_device", best.tokens_per_s_per_device},
                                 {"mfu", best.mfu}};
        }
        report["plan"] = plan_json;
    } else {
        md += "## Plan\n\nNot planned: give `--cluster FILE` (configs/cluster/).\n\n";
    }

    const bool ok = failed == 0;
    md += fmt::format("## Verdict\n\n{} of {} checks passed{}.\n", checks - failed, checks,
                      ok ? ": the model onboards" : "");
    report["checks"] = checks;
    report["failed"] = failed;
    report["passed"] = ok;
    write_text_atomic((out / "onboard.md").string(), md);
    write_text_atomic((out / "onboard.json").string(), report.dump(1) + "\n");
    std::cout << fmt::format("onboard {}: {} of {} checks passed; report {}\n", name, checks - failed, checks,
                             (out / "onboard.md").string());
    return ok;
}
}  // namespace

void add_onboard_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "onboard",
        "Onboard a model: its layers mapped to tessera's blocks, a miniature trained on the demo corpus, every op it "
        "ran checked against its reference and finite differences, a plan; one report (markdown + JSON)");
    auto a = std::make_shared<OnboardArgs>();
    add_workload_options(cmd, *a, true);
    cmd->add_option("--out", a->out, "The report's directory, new or empty (default: onboard-<model name>)");
    add_int_option(cmd, "--steps", a->steps, 10, 100000, "Training steps of the miniature");
    cmd->add_option("--goldens", a->goldens, "The op golden files (tools/ref/make_op_golden.py)")
        ->default_str(a->goldens);
    cmd->footer(
        "Example: tessera onboard configs/hf/kimi_k3.json --cluster configs/cluster/supernode_128.json --mode lora\n"
        "Exit status 0: everything works; 1: a check failed (the report says which); the report is written either "
        "way.");
    cmd->callback([a] {
        const Loaded w = load_workload(*a);
        const fs::path model_path = fs::path(w.doc.file);
        const std::string name = model_path.filename() == "config.json" ? model_path.parent_path().filename().string()
                                                                        : model_path.stem().string();
        const fs::path out = a->out.empty() ? fs::path("onboard-" + name) : fs::path(a->out);
        TESSERA_CHECK(!fs::exists(out) || (fs::is_directory(out) && fs::is_empty(out)),
                      "--out {}: exists and is not an empty directory; remove it or choose another", out.string());
        // the ops' golden files are checked before anything runs, so a wrong --goldens fails at once
        TESSERA_CHECK(!ops::golden_files(a->goldens).empty(), "--goldens {}: no golden files there", a->goldens);
        fs::create_directories(out);
        bool ok = false;
        try {
            ok = onboard(*a, w, name, out);
        } catch (...) {
            std::error_code ec;  // nothing half-written is left: the directory was new or empty
            fs::remove_all(out, ec);
            throw;
        }
        if (!ok)
            throw Stopped{1, fmt::format("onboard {}: a check failed (see {})", name, (out / "onboard.md").string())};
    });
}

}  // namespace tessera::apps
