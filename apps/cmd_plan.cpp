// tessera plan: the parallel layout for a model on a cluster (docs/plan.md): every layout the runtime can run,
// each rank's memory from the runtime's buffer groups (byte-exact), a predicted step time with its breakdown, a
// ranked table, and the chosen layout written as a run config that `tessera train` / `launch` accept.
#include <filesystem>
#include <iostream>

#include "apps/commands.h"
#include "apps/options.h"
#include "apps/workload.h"
#include "core/check.h"
#include "core/file.h"
#include "plan/plan.h"
#include "train/config.h"

namespace tessera::apps {

namespace {
// a file the command writes: its directory made first
void write_output(const std::string& path, const std::string& text) {
    const std::filesystem::path dir = std::filesystem::path(path).parent_path();
    if (!dir.empty()) std::filesystem::create_directories(dir);
    write_text_atomic(path, text);
}

Json candidate_json(const plan::Candidate& c) {
    Json groups = Json::array();
    for (const auto& g : c.memory.groups)
        groups.push_back(
            {{"name", g.name}, {"category", g.category}, {"bytes", g.bytes}, {"block_bytes", g.block_bytes}});
    Json ranks = Json::array();
    for (const auto& [rank, bytes] : c.rank_arena_bytes) ranks.push_back({{"rank", rank}, {"arena_bytes", bytes}});
    const plan::StepTime& t = c.time;
    return {{"layout",
             {{"ranks", c.layout.ranks},
              {"ep", c.layout.ep},
              {"fsdp", c.layout.fsdp},
              {"shard", c.layout.shard},
              {"micro_batch", c.layout.micro_batch},
              {"recompute", c.layout.recompute.to_json()},
              {"offload", c.layout.offload},
              {"pipeline", c.layout.pp},
              {"pipeline_split", c.layout.split},
              {"pipeline_rerun", c.layout.rerun},
              {"tensor", c.layout.tp},
              {"weights_budget", c.layout.weights_budget}}},
            {"memory",
             {{"rank", c.memory_rank},
              {"arena_bytes", c.memory.arena_bytes},
              {"mapped_bytes", c.memory.mapped_bytes},
              {"mapped_resident_bytes", c.memory.mapped_resident_bytes},
              {"mapped_floor_bytes", c.memory.mapped_floor_bytes},
              {"offloaded_bytes", c.memory.offloaded_bytes},
              {"offload_resident_bytes", c.memory.offload_resident_bytes},
              {"peak_bytes", c.memory.peak_bytes()},
              {"ranks", ranks},
              {"groups", groups},
              {"by_category", c.memory.by_category()},
              {"model_state_bytes", c.memory.model_state_bytes()}}},
            {"fits", c.fits},
            {"step_seconds",
             {{"total", t.total},
              {"compute", t.compute},
              {"expert_compute", t.expert_compute},
              {"a2a", t.a2a},
              {"a2a_exposed", t.a2a_exposed},
              {"fsdp", t.fsdp},
              {"fsdp_exposed", t.fsdp_exposed},
              {"grad_sync", t.grad_sync},
              {"optimizer", t.optimizer},
              {"offload", t.offload},
              {"page_in", t.page_in},
              {"gradients", t.gradients},
              {"p2p", t.p2p},
              {"bubble", t.bubble},
              {"tensor", t.tensor}}},
            {"imbalance", t.imbalance},
            {"tokens_per_s_per_device", c.tokens_per_s_per_device},
            {"mfu", c.mfu}};
}

}  // namespace

void add_plan_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "plan", "Search the parallel layout of a model on a cluster: memory per device, step time, a ranked table");
    struct Args : Workload {
        std::string write_config, json, offload = "auto";
        int64_t threads = 0, top = 10;
        bool no_pipeline = false, no_tensor = false;
    };
    auto a = std::make_shared<Args>();
    add_workload_options(cmd, *a);
    add_int_option(cmd, "--threads", a->threads, 0, 4096,
                   "OpenMP threads per rank (sizes the workspace; 0 = the cluster file's, else 1)");
    add_int_option(cmd, "--top", a->top, 1, 100000, "Rows of the table");
    cmd->add_option("--offload", a->offload,
                    "Optimizer offload (AdamW's moments in a file): auto = for the layouts that do not fit without it, "
                    "all = every layout both ways, off")
        ->check(CLI::IsMember({"auto", "all", "off"}))
        ->capture_default_str();
    cmd->add_flag("--no-pipeline", a->no_pipeline,
                  "Do not search pipeline stages (parallel.pipeline; searched by default where the model can be cut)");
    cmd->add_flag("--no-tensor", a->no_tensor,
                  "Do not search tensor parallelism (parallel.tensor; searched by default where the model allows it)");
    cmd->add_option("--write-config", a->write_config, "Write the best layout that fits as a run config here");
    cmd->add_option("--json", a->json, "Write every candidate (layout, memory by group, step breakdown) as JSON here");
    cmd->footer(
        "Example: tessera plan configs/hf/kimi_k3.json --cluster configs/cluster/supernode_128.json --mode lora\n"
        "         tessera plan configs/moe_small.json --cluster configs/cluster/this_machine.json --ranks 2 "
        "--write-config plan.json");
    cmd->callback([a] {
        const Loaded w = load_workload(*a);
        const ModelDoc& doc = w.doc;
        const train::RunConfig& cfg = w.cfg;
        const plan::Cluster& cluster = w.cluster;
        const plan::PlanOptions o{a->ranks, int(a->threads), a->routing, a->offload, !a->no_pipeline, !a->no_tensor};
        const plan::Plan p = plan::make_plan(cfg, cluster, o);
        std::cout << (doc.family.empty() ? "tessera config " + doc.file : doc.family + " (" + doc.file + ")") << ", "
                  << (cfg.model.lora.enabled() ? fmt::format("LoRA rank {}", cfg.model.lora.rank) : "full training")
                  << "\n";
        std::cout << plan::plan_report(p, cluster, size_t(a->top));
        if (!doc.unsupported.empty())
            std::cout << "not modelled (features tessera does not build): " << doc.unsupported.size()
                      << " (tessera inspect lists them)\n";
        if (!a->json.empty()) {
            Json all = Json::array();
            for (const plan::Candidate& c : p.candidates) all.push_back(candidate_json(c));
            write_output(a->json, Json{{"cluster", cluster.name}, {"candidates", all}}.dump(1) + "\n");
        }
        if (!a->write_config.empty()) {
            TESSERA_CHECK(!p.candidates.empty() && p.candidates.front().fits,
                          "--write-config {}: no layout fits; nothing written", a->write_config);
            const plan::Layout& best = p.candidates.front().layout;
            write_output(a->write_config, train::to_json(plan::with_layout(cfg, best)).dump(2) + "\n");
            std::cout << fmt::format("wrote {} ({}); run it with: tessera launch -n {} -- train --config {}\n",
                                     a->write_config, best.str(), best.ranks, a->write_config);
        }
    });
}

void add_simulate_command(CLI::App& app) {
    auto* cmd = app.add_subcommand(
        "simulate", "Write one layout's predicted step as a Chrome trace (compute and communication tracks; Perfetto)");
    struct Args : Workload {
        std::string out;
        int64_t ep = 1, micro = 0, shard = 0, pipeline = 1, tensor = 1;
        bool zero2 = false, offload = false, rerun = false;
        std::string recompute;       // "", "all" or kinds separated by commas
        std::vector<int64_t> split;  // the stages' first layers after the first
    };
    auto a = std::make_shared<Args>();
    add_workload_options(cmd, *a);
    add_int_option(cmd, "--ep", a->ep, 1, 1 << 20, "Expert parallelism");
    add_int_option(cmd, "--micro-batch", a->micro, 0, train::kMaxBatch,
                   "Sequences per forward on each rank, or tensor group (0 = the whole per-rank batch)");
    add_int_option(cmd, "--tensor", a->tensor, 1, 1 << 20,
                   "Tensor parallelism: ranks per tensor group sharing each micro-batch (parallel.tensor)");
    cmd->add_flag("--zero2", a->zero2, "ZeRO-2 instead of FSDP");
    add_int_option(cmd, "--shard", a->shard, 0, 1 << 20,
                   "HSDP: FSDP shards the dense parameters over groups of this many ranks (0 = every rank)");
    cmd->add_flag("--offload", a->offload, "AdamW's moments in a file on the host (memory.optimizer_offload)");
    add_int_option(cmd, "--pipeline", a->pipeline, 1, 1 << 20,
                   "Pipeline stages (parallel.pipeline; each a data-parallel group of ranks / stages)");
    add_int_list_option(cmd, "--pipeline-split", a->split, 1, 1 << 20,
                        "The stages' first layers after the first, e.g. 3,7 (parallel.pipeline_split; default: even)");
    cmd->add_flag("--pipeline-rerun", a->rerun,
                  "Stages re-run a micro-batch's forward before its backward instead of keeping its activations "
                  "(parallel.pipeline_rerun)");
    cmd->add_flag("--recompute{all}", a->recompute,
                  "Recompute the blocks' activations in backward: every kind, or --recompute=KIND,... (kda, moe, ...)");
    cmd->add_option("--out", a->out, "The trace file to write (open it in https://ui.perfetto.dev)")->required();
    cmd->footer(
        "Example: tessera simulate configs/hf/kimi_k3.json --cluster configs/cluster/supernode_128.json --mode lora "
        "--global-batch 128 --seq 4096 --ep 64 --micro-batch 1 --recompute --set model.moe.capacity_factor=1.25 "
        "--out k3.json");
    cmd->callback([a] {
        const Loaded w = load_workload(*a);
        const train::RunConfig& cfg = w.cfg;
        const plan::Cluster& cluster = w.cluster;
        const int64_t W = plan::plan_ranks(cfg, cluster, a->ranks);
        Json kinds = Json::array();
        for (size_t at = 0; at < a->recompute.size();) {
            const size_t comma = std::min(a->recompute.find(',', at), a->recompute.size());
            kinds.push_back(a->recompute.substr(at, comma - at));
            at = comma + 1;
        }
        const model::Recompute recompute = a->recompute == "all"
                                               ? model::Recompute::every()
                                               : model::Recompute::from_json(kinds, "simulate: --recompute");
        plan::Layout l{W, a->ep, !a->zero2, a->micro, recompute, a->shard, a->offload, a->pipeline, a->split};
        TESSERA_CHECK((l.split.empty() && !a->rerun) || l.pp > 1,
                      "simulate: --pipeline-split or --pipeline-rerun without --pipeline stages");
        l.rerun = a->rerun;
        l.tp = a->tensor;
        l.weights_budget = cfg.memory.weights_budget;  // (--set memory.weights_budget=MIB)
        TESSERA_CHECK(W % l.pp == 0, "simulate: --pipeline {} does not divide the {} ranks", l.pp, W);
        TESSERA_CHECK(l.stage_ranks() % l.tp == 0, "simulate: --tensor {} does not divide the {} ranks{}", l.tp,
                      l.stage_ranks(), l.pp > 1 ? " of a stage" : "");
        if (!a->micro) l.micro_batch = cfg.train.batch_size / l.data_groups();
        const plan::PlanOptions o{W, 0, a->routing};
        const plan::Simulation s = plan::simulate(cfg, cluster, l, o);
        write_output(a->out, s.trace);
        std::cout << fmt::format(
            "{} on {} ranks of {}: simulated step {:.1f} ms (the planner's estimate {:.1f} ms); "
            "trace: {}\n",
            l.str(), W, cluster.name, s.seconds * 1e3, plan::predict_step(cfg, cluster, l, o).total * 1e3, a->out);
    });
}

}  // namespace tessera::apps
