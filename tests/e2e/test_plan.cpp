// tessera plan (docs/plan.md): the memory it predicts for a rank is the arena the trainer then allocates, byte for
// byte, measured on real runs (one process and mpirun, FSDP and ZeRO-2, expert parallelism, accumulation,
// recompute); the layout it writes trains; the Kimi K3 targets come out as spec/scale.md §2–§4 computes them
// (full AdamW does not fit 128 devices, LoRA does); bad cluster files and impossible requests are one-line errors.
#include <gtest/gtest.h>

#include <cmath>
#include <filesystem>
#include <fstream>
#include <limits>
#include <map>
#include <regex>
#include <set>

#include "core/file.h"
#include "core/json.h"
#include "e2e/cli_util.h"
#include "model/hf_config.h"
#include "parallel/mesh.h"
#include "plan/cluster.h"
#include "plan/memory.h"
#include "train/rank_state.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;
const std::string kClusters = std::string(TESSERA_SOURCE_DIR) + "/configs/cluster/";

// A CPU cluster of `devices` ranks (this machine's MPI ranks) of `memory_gb` each; `device`, `host`: more keys of its
// device and host.
std::string cpu_cluster(
    const TempDir& d, int devices, const std::string& device = "", double memory_gb = 4, const std::string& host = "") {
    const std::string f = d.file("cpu.json");
    write_text_atomic(f, fmt::format(R"({{"name": "test", "devices": {0},
        "device": {{"memory_gb": {2}, "peak_tflops": {{"f32": 0.1}}, "compute_dtype": "f32", "memory_bandwidth_gbs": 10{1}}},
        "host": {{"devices": {0}, "memory_gb": 16{3}}},
        "links": [{{"span": {0}, "bandwidth_gbs": 5, "latency_us": 2}}]}})",
                                     devices, device, memory_gb, host));
    return f;
}

Json plan_json(const std::string& args, const TempDir& d) {
    const std::string out = d.file("plan.json");
    const test::CliResult r = test::run_tessera("plan " + args + " --json " + out);
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status == 0 ? Json::parse(read_text(out)) : Json();
}

struct Case {
    int ranks;
    int ep;
    bool fsdp;
    int micro;
    Json recompute;        // train.recompute: true, false or the block kinds
    int shard = 0;         // parallel.shard (HSDP)
    bool offload = false;  // memory.optimizer_offload
    int pp = 1;            // parallel.pipeline (with the plan's split)
    bool rerun = false;    // parallel.pipeline_rerun
    int tp = 1;            // parallel.tensor
};

// The predicted rank-0 arena of one layout, from a plan over all layouts; split: its pipeline split.
size_t predicted_rank0(const Json& plan, const Case& c, Json* split = nullptr) {
    for (const Json& cand : plan["candidates"]) {
        const Json& l = cand["layout"];
        if (l["ep"] == c.ep && l["fsdp"] == c.fsdp && l["micro_batch"] == c.micro && l["recompute"] == c.recompute &&
            l["shard"] == c.shard && l["offload"] == c.offload && l["pipeline"] == c.pp &&
            l["pipeline_rerun"] == c.rerun && l["tensor"] == c.tp)
            for (const Json& r : cand["memory"]["ranks"])
                if (r["rank"] == 0) {
                    if (split) *split = l["pipeline_split"];
                    return r["arena_bytes"].get<size_t>();
                }
    }
    ADD_FAILURE() << "layout not in the plan";
    return 0;
}

// One training step of `args` (the config and its --set's) on `ranks` ranks into `run`: its metrics record (null, and a
// failure, when the run fails)
Json first_step(int ranks, const std::string& args, const std::string& run) {
    const std::string cmd = "train " + args + " --steps 1 --set train.checkpoint_interval=0 --out " + run;
    const test::CliResult r = ranks == 1 ? test::run_tessera(cmd) : test::run_tessera_mpi(ranks, cmd);
    EXPECT_EQ(r.status, 0) << r.err;
    const std::vector<Json> records = r.status == 0 ? test::jsonl(run + "/metrics.jsonl") : std::vector<Json>{};
    EXPECT_FALSE(records.empty());
    return records.empty() ? Json() : records[0];
}

// Model states, activations and scratch: the plan's rank-0 arena is the arena rank 0 of the real run fills (its
// high-water mark after the first step, metrics.jsonl), for twelve layouts of the tiny MoE model with three layers
// (attention + mlp, then twice attention + moe; recompute: every block kind, or only the MoE blocks or only the
// attention blocks; two of them HSDP: shard groups of 2 of the 4 ranks; four with 2 pipeline stages split as the plan
// splits them, one rank or two (FSDP, EP 2) per stage, the first stage's rank 0 reporting: keeping the activations
// of the micro-batches in flight, and once re-running the forwards instead; three in tensor groups of 2, whose
// micro-batch is the group's).
TEST(Plan, PredictedArenaIsTheMeasuredArena) {
    const std::string model = kTiny + test::kTinyMoe + " --set model.n_layers=3 --set model.n_kv_heads=2";
    const Json moe = Json::array({"moe"}), attention = Json::array({"attention"});
    const Case cases[] = {{1, 1, true, 2, false},
                          {1, 1, true, 4, true},
                          {1, 1, true, 4, moe},
                          {2, 1, true, 2, false},
                          {2, 2, true, 1, true},
                          {2, 2, false, 2, false},
                          {2, 1, false, 1, true},
                          {2, 2, true, 2, attention},
                          {4, 2, true, 1, false},
                          {4, 4, false, 1, true},
                          {4, 2, true, 1, false, 2},
                          {4, 1, true, 1, moe, 2},
                          {2, 1, true, 1, false, 0, false, 2},
                          {2, 1, true, 1, false, 0, false, 2, true},
                          {2, 1, true, 2, moe, 0, false, 2},
                          {4, 2, true, 1, false, 0, false, 2},
                          {2, 1, true, 4, false, 0, false, 1, false, 2},
                          {4, 2, true, 1, moe, 0, false, 1, false, 2},
                          {4, 2, false, 2, true, 0, false, 1, false, 2}};
    TempDir d;
    std::map<int, Json> plans;
    for (const Case& c : cases) {
        if (!plans.count(c.ranks))
            plans[c.ranks] = plan_json(
                fmt::format("{} --cluster {} --threads {}", model, cpu_cluster(d, c.ranks), c.ranks == 1 ? 2 : 1), d);
        Json split;
        const size_t predicted = predicted_rank0(plans[c.ranks], c, &split);
        const Json step = first_step(
            c.ranks,
            fmt::format("--config {} --set parallel.ep={} --set parallel.fsdp={} --set parallel.shard={} --set "
                        "train.micro_batch_size={} --set 'train.recompute={}' --set parallel.pipeline={} --set "
                        "'parallel.pipeline_split={}' --set parallel.pipeline_rerun={} --set parallel.tensor={}",
                        model, c.ep, c.fsdp, c.shard, c.micro, c.recompute.dump(), c.pp,
                        split.is_null() ? "[]" : split.dump(), c.rerun, c.tp),
            d.file(fmt::format("run{}", &c - cases)));
        ASSERT_FALSE(step.is_null());
        EXPECT_EQ(step["memory"]["arena_peak_bytes"].get<size_t>(), predicted)
            << c.ranks << " ranks, ep " << c.ep << (c.fsdp ? " fsdp" : " zero-2") << ", shard " << c.shard << ", micro "
            << c.micro << ", recompute " << c.recompute.dump() << ", pipeline " << c.pp << (c.rerun ? " rerun" : "")
            << ", tensor " << c.tp;
    }
}

// LoRA in a tensor group of 2: the sliced blocks' copies of the frozen bf16 base and of the adapters are the run's
// (Plan.PredictedArenaIsTheMeasuredArena's model with adapters, FSDP, micro-batches of 2 sequences).
TEST(Plan, PredictedArenaOfLoraInATensorGroup) {
    TempDir d;
    const std::string model = kTiny + test::kTinyMoe +
                              " --set model.n_layers=3 --set model.n_kv_heads=2 --set model.lora.rank=4 --set "
                              "model.lora.base_dtype=bf16 --set 'model.lora.target_modules=[\"q_proj\",\"o_proj\"]'";
    const Json plan = plan_json(model + " --mode lora --cluster " + cpu_cluster(d, 2) + " --threads 1", d);
    const Case c{2, 1, true, 2, false, 0, false, 1, false, 2};
    const size_t predicted = predicted_rank0(plan, c);
    const Json step =
        first_step(2, "--config " + model + " --set train.micro_batch_size=2 --set parallel.tensor=2", d.file("run"));
    ASSERT_FALSE(step.is_null());
    EXPECT_EQ(step["memory"]["arena_peak_bytes"].get<size_t>(), predicted);
}

// Pipeline stages: searched for a model that can be cut, with at least as many micro-batches as stages, and split so
// the stages' work balances. A head 64 times a layer's work (vocabulary 16,384 at d_model 32) belongs alone on the last
// stage: of 4 layers over 2 stages the balanced cut gives it layer 3 only (the even cut, 2 + 2, would leave the last
// stage the slowest). A model with tied embeddings, or --no-pipeline, gets none.
TEST(Plan, PipelineStagesAreSearchedWithABalancedSplit) {
    TempDir d;
    const std::string cluster = " --cluster " + cpu_cluster(d, 2) + " --threads 1";
    const Json p = plan_json(kTiny + " --set model.n_layers=4 --set model.vocab_size=16384" + cluster, d);
    int staged = 0;
    for (const Json& c : p["candidates"]) {
        const Json& l = c["layout"];
        if (l["pipeline"] == 1) continue;
        ++staged;
        EXPECT_EQ(l["pipeline"], 2);
        EXPECT_EQ(l["pipeline_split"], Json::array({3})) << l.dump();
        EXPECT_GE(4 / l["micro_batch"].get<int>(), 2) << "fewer micro-batches than stages";  // batch 4 on 1 rank each
        const Json& t = c["step_seconds"];
        EXPECT_GT(t["bubble"].get<double>(), 0.0);
        EXPECT_GT(t["p2p"].get<double>(), 0.0);
        EXPECT_EQ(c["memory"]["ranks"].size(), 2u);  // a rank of each stage
    }
    EXPECT_GT(staged, 0);
    for (const std::string& none : {std::string(" --set model.tie_embeddings=true"), std::string(" --no-pipeline")}) {
        const Json q = plan_json(kTiny + " --set model.n_layers=4" + none + cluster, d);
        for (const Json& c : q["candidates"]) EXPECT_EQ(c["layout"]["pipeline"], 1) << none;
    }
}

// Tensor parallelism: searched in groups that divide the ranks and the heads (tiny.json: 2 heads, 1 kv head, so none
// until n_kv_heads = 2), each group taking batch / groups sequences; its transfers priced; a model it does not cover
// (here the sequence-wise balance loss), or --no-tensor, gets none.
TEST(Plan, TensorGroupsAreSearchedWhereTheHeadsDivide) {
    TempDir d;
    const std::string cluster = " --cluster " + cpu_cluster(d, 4) + " --threads 1";
    auto tensors = [&](const std::string& args) {
        std::set<int> tps;
        const Json p = plan_json(kTiny + args + cluster, d);
        for (const Json& c : p["candidates"]) {
            const int tp = c["layout"]["tensor"].get<int>();
            tps.insert(tp);
            if (tp == 1) continue;
            EXPECT_EQ(c["layout"]["pipeline"], 1);
            EXPECT_EQ(4 % (4 / tp * c["layout"]["micro_batch"].get<int>()), 0) << c["layout"].dump();
            EXPECT_GT(c["step_seconds"]["tensor"].get<double>(), 0.0);
        }
        return tps;
    };
    EXPECT_EQ(tensors(""), (std::set<int>{1}));
    EXPECT_EQ(tensors(" --set model.n_kv_heads=2"), (std::set<int>{1, 2}));
    EXPECT_EQ(tensors(" --set model.n_kv_heads=2 --no-tensor"), (std::set<int>{1}));
    EXPECT_EQ(tensors(" --set model.n_kv_heads=2" + test::kTinyMoe + " --set model.moe.seq_aux_coeff=0.001"),
              (std::set<int>{1}));
}

// A sliced block's part priced from the calibrated share every tensor rank repeats (device.tensor_shared s): the part
// takes s + (1 − s) / T of the whole block's time, so the tensor layout's compute is linear in s and grows with it,
// and layouts without tensor groups do not move.
TEST(Plan, TensorPartsTakeTheMeasuredSharedShare) {
    TempDir d;
    auto computes = [&](const std::string& shared) {
        const Json p = plan_json(kTiny + " --set model.n_kv_heads=2 --threads 1 --cluster " +
                                     cpu_cluster(d, 2, ", \"tensor_shared\": {\"attention\": " + shared + "}"),
                                 d);
        std::map<std::string, double> by_layout;
        for (const Json& c : p["candidates"])
            by_layout[c["layout"].dump()] = c["step_seconds"]["compute"].get<double>();
        return by_layout;
    };
    const auto none = computes("0"), half = computes("0.5"), all = computes("1");
    int tensor = 0;
    for (const auto& [layout, t0] : none) {
        const double t1 = all.at(layout), th = half.at(layout);
        if (Json::parse(layout)["tensor"] == 1) {
            EXPECT_EQ(t0, t1) << layout;
            continue;
        }
        ++tensor;
        EXPECT_GT(t1, t0) << layout;
        EXPECT_NEAR(th, 0.5 * (t0 + t1), 1e-9 * t1) << layout;
    }
    EXPECT_GT(tensor, 0);
}

// Optimizer offload: searched only for layouts that do not fit with the moments in the arena, and only when the
// cluster file gives its rate. The offloaded layout's arena is the offloaded run's byte for byte, smaller by the
// moments; its step is the same but for the moments' streaming, 8 bytes per element this rank updates at that rate.
TEST(Plan, OptimizerOffloadWhereTheMomentsDoNotFit) {
    TempDir d;
    // (windows of 64 KiB: four of them, and the kernel's fault-around, are less than half the moments)
    const std::string model =
        kTiny + test::kTinyMoe + " --set model.d_model=128 --set memory.offload_window_mib=0.0625";
    const Case plain{1, 1, true, 2, false}, offloaded{1, 1, true, 2, false, 0, true};
    const std::string offload_rate = ", \"offload_bandwidth_gbs\": 2";
    auto plan = [&](double memory_gb, const std::string& host) {
        return plan_json(model + " --cluster " + cpu_cluster(d, 1, "", memory_gb, host) + " --threads 2", d);
    };
    auto find = [](const Json& p, const Case& c) {
        for (const Json& cand : p["candidates"])
            if (cand["layout"]["micro_batch"] == c.micro && cand["layout"]["recompute"] == c.recompute &&
                cand["layout"]["offload"] == c.offload)
                return cand;
        return Json();
    };
    const Json roomy = plan(4, offload_rate);
    const Json all_in = find(roomy, plain);
    ASSERT_FALSE(all_in.is_null());
    EXPECT_TRUE(find(roomy, offloaded).is_null()) << "offload searched where the moments fit";
    const size_t arena = all_in["memory"]["arena_bytes"].get<size_t>();
    const size_t moments = all_in["memory"]["by_category"]["optimizer"].get<size_t>();
    ASSERT_GT(moments, size_t(1) << 20);
    // a device whose usable memory (90%) is the arena less half the moments
    const double memory_gb = double(arena - moments / 2) / 0.9 / 1e9;
    const Json tight = plan(memory_gb, offload_rate);
    const Json off = find(tight, offloaded), on = find(tight, plain);
    ASSERT_FALSE(off.is_null()) << tight.dump();
    EXPECT_FALSE(on["fits"].get<bool>());
    EXPECT_TRUE(off["fits"].get<bool>());
    const size_t predicted = predicted_rank0(tight, offloaded);
    EXPECT_LT(predicted, arena - moments * 9 / 10);
    EXPECT_GT(off["memory"]["offloaded_bytes"].get<size_t>(), moments * 9 / 10);
    const double extra = off["step_seconds"]["offload"].get<double>();
    EXPECT_GT(extra, 0);
    EXPECT_NEAR(off["step_seconds"]["total"].get<double>() - extra, on["step_seconds"]["total"].get<double>(), 1e-12);
    // moments bytes / 2 GB/s: 8 bytes per trained element (the offloaded bytes round each moment up to a page)
    EXPECT_NEAR(extra * 2e9, double(off["memory"]["offloaded_bytes"].get<size_t>()), 2.0 * 4096);
    EXPECT_TRUE(find(plan(memory_gb, ""), offloaded).is_null()) << "offload searched without a rate";
    const Json step = first_step(
        1, "--config " + model + " --set train.micro_batch_size=2 --set memory.optimizer_offload=true", d.file("run"));
    ASSERT_FALSE(step.is_null());
    EXPECT_EQ(step["memory"]["arena_peak_bytes"].get<size_t>(), predicted);
}

// A base of `model` trained 2 steps into d's "base", and the --set's of a LoRA fine-tune of it held in f32 (read in
// place under a weight budget); empty, and a failure, when training fails.
std::string lora_of_new_base(const TempDir& d, const std::string& model) {
    const test::CliResult r = test::run_tessera("train --config " + model + " --steps 2 --out " + d.file("base"));
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status != 0 ? ""
                         : " --set model.lora.rank=4 --set model.lora.alpha=8 --set model.lora.base_dtype=f32 "
                           "--set model.lora.expert_dtype=f32 --set "
                           "'model.lora.target_modules=[\"q_proj\",\"gate_proj\"]' --set train.base=" +
                               d.file("base");
}

// memory.weights_budget: the plan opens the base as the run does, so its arena (without the base read in place) is
// the run's byte for byte and the bytes it says are read in place are the run's; what of them may be resident (the
// budget and the two largest units, at most all of them) joins the memory column; a missing base is a one-line error
TEST(Plan, AWeightBudgetKeepsTheBaseOutOfTheArena) {
    TempDir d;
    const std::string model = kTiny + test::kTinyMoe + " --set model.d_model=128 --set model.ffn_dim=512";
    const std::string base = lora_of_new_base(d, model);
    ASSERT_FALSE(base.empty());
    const std::string lora = base + " --set memory.weights_budget=1";
    const std::string cluster = cpu_cluster(d, 1, "", 4, R"(, "read_bandwidth_gbs": 2)");
    const Json plan = plan_json(model + lora + " --mode lora --cluster " + cluster + " --threads 2", d);
    const Case c{1, 1, true, 2, false};
    const size_t predicted = predicted_rank0(plan, c);
    Json memory;
    for (const Json& cand : plan["candidates"])
        if (cand["layout"]["micro_batch"] == 2 && cand["layout"]["recompute"] == false) memory = cand["memory"];
    ASSERT_TRUE(memory.contains("mapped_bytes")) << plan.dump();
    const Json step = first_step(1, "--config " + model + lora + " --set train.micro_batch_size=2", d.file("run"));
    ASSERT_FALSE(step.is_null());
    EXPECT_EQ(step["memory"]["arena_peak_bytes"].get<size_t>(), predicted);
    const size_t mapped = step["weights"]["mapped_bytes"].get<size_t>();
    EXPECT_GT(mapped, size_t(1) << 20);
    EXPECT_EQ(memory["mapped_bytes"].get<size_t>(), mapped);
    const size_t resident = memory["mapped_resident_bytes"].get<size_t>();
    EXPECT_LE(resident, mapped);
    EXPECT_GE(resident, std::min(mapped, size_t(1) << 20));
    EXPECT_EQ(memory["peak_bytes"].get<size_t>(), predicted + resident);
    // a budget whose base is not there: the plan cannot know what is read in place, and says so in one line
    const std::string missing = d.file("no_base");
    test::expect_one_line_error(test::run_tessera("plan " + model + lora + " --set train.base=" + missing +
                                                  " --mode lora --cluster " + cluster),
                                missing, "a budget without its base");
    // a budget on a cluster that does not say how fast storage reads the base back: its page-ins cannot be priced
    test::expect_one_line_error(
        test::run_tessera("plan " + model + lora + " --mode lora --cluster " + cpu_cluster(d, 1)), "read_bandwidth_gbs",
        "a budget without a read rate");
}

// The weight budget searched (memory.weights_budget not given): on a device too small for the LoRA base in the arena,
// every layout reads the base in place under the largest budget that fits it, and its step pays the page-ins: the
// base beyond the budget read back twice a micro-batch (forward, backward) at the cluster's read rate. The plan's pick
// trains as written: its arena is the run's byte for byte, the base's resident bytes stay within the budget after
// every step, and the bytes the run releases per step (and so reads back) are the ones priced. Without a read rate,
// nothing is searched and nothing fits.
TEST(Plan, TheSearchFitsTheLargestWeightBudget) {
    TempDir d;
    const std::string model =
        kTiny + test::kTinyMoe +
        " --set model.d_model=128 --set model.ffn_dim=512 --set model.n_layers=8 --set model.moe.ffn_dim=256";
    const std::string base = lora_of_new_base(d, model);
    ASSERT_FALSE(base.empty());
    const std::string lora = base + " --mode lora --threads 2";
    // storage at 0.05 GB/s: page-ins cost more than the larger micro-batches save, so the pick is the layout that
    // leaves the largest budget
    const double read_rate = 0.05e9;
    const std::string rate = R"(, "read_bandwidth_gbs": 0.05)";
    // the base's bytes read in place and the arena without it, from a plan with a given budget
    const Json given =
        plan_json(model + lora + " --set memory.weights_budget=1 --cluster " + cpu_cluster(d, 1, "", 4, rate), d);
    Json least;  // the layout with the smallest arena
    for (const Json& c : given["candidates"])
        if (least.is_null() || c["memory"]["arena_bytes"] < least["arena_bytes"]) least = c["memory"];
    const double mapped = least["mapped_bytes"].get<double>(), floor = least["mapped_floor_bytes"].get<double>();
    ASSERT_GT(mapped, 2.0 * floor);
    // a device whose usable bytes leave that layout 3/4 of the base beyond its floor (none fits with the base in the
    // arena; the larger ones fit smaller budgets, or none)
    const double usable = least["arena_bytes"].get<double>() + floor + (mapped - floor) * 3 / 4;
    const std::string device = R"(, "usable_fraction": 1)";
    const std::string best = d.file("best.json");
    const Json plan = plan_json(
        model + lora + " --cluster " + cpu_cluster(d, 1, device, usable / 1e9, rate) + " --write-config " + best, d);
    ASSERT_TRUE(plan.is_object());
    const double MiB = double(1 << 20);
    size_t budgeted = 0;
    for (const Json& c : plan["candidates"]) {
        const Json& m = c["memory"];
        const int64_t budget = c["layout"]["weights_budget"].get<int64_t>();
        if (budget == 0) {  // the base in the arena: nothing fits
            EXPECT_FALSE(c["fits"].get<bool>()) << c.dump();
            continue;
        }
        ++budgeted;
        EXPECT_EQ(m["mapped_bytes"].get<double>(), mapped);
        const double beside = m["arena_bytes"].get<double>() + m["mapped_floor_bytes"].get<double>();
        if (c["fits"].get<bool>()) {  // the largest budget that fits: one more MiB would not
            EXPECT_LE(beside + double(budget) * MiB, usable) << c.dump();
            EXPECT_GT(beside + double(budget + 1) * MiB, usable) << c.dump();
        } else {
            EXPECT_EQ(budget, 1);
        }
        EXPECT_EQ(m["mapped_resident_bytes"].get<double>(), std::min(mapped, double(budget) * MiB + floor));
        const int64_t micro = c["layout"]["micro_batch"].get<int64_t>();
        const double sweeps = 2.0 * double(4 / micro);  // (tiny.json's batch of 4)
        EXPECT_NEAR(c["step_seconds"]["page_in"].get<double>(),
                    sweeps * std::max(0.0, mapped - std::max(double(budget) * MiB, floor / 2)) / read_rate, 1e-12);
    }
    EXPECT_GT(budgeted, 0u);
    const Json& pick = plan["candidates"][0];
    ASSERT_TRUE(pick["fits"].get<bool>()) << pick.dump();
    const int64_t budget = pick["layout"]["weights_budget"].get<int64_t>();
    ASSERT_GT(double(budget) * MiB, floor);   // (above the two largest units: the budget decides what is kept)
    ASSERT_LT(double(budget) * MiB, mapped);  // (some of the base read back every step)
    const Json written = Json::parse(read_text(best));
    EXPECT_EQ(written["memory"]["weights_budget"], budget);
    const test::CliResult r = test::run_tessera("train --config " + best +
                                                " --steps 3 --set train.checkpoint_interval=0 --out " + d.file("run"));
    ASSERT_EQ(r.status, 0) << r.err;
    std::vector<Json> steps;  // the step records
    for (Json& rec : test::jsonl(d.file("run") + "/metrics.jsonl"))
        if (rec.contains("weights")) steps.push_back(std::move(rec));
    ASSERT_EQ(steps.size(), 3u);
    for (const Json& s : steps) EXPECT_LE(s["weights"]["resident_bytes"].get<double>(), double(budget) * MiB);
    EXPECT_EQ(steps[0]["memory"]["arena_peak_bytes"], pick["memory"]["arena_bytes"]);
    // what the run released (and so read back) per step after the first, against the bytes priced
    const double released =
        (steps[2]["weights"]["released_bytes"].get<double>() - steps[0]["weights"]["released_bytes"].get<double>()) /
        2.0;
    const double priced = pick["step_seconds"]["page_in"].get<double>() * read_rate;
    EXPECT_NEAR(released / priced, 1.0, 0.25) << released << " released a step, " << priced << " priced";
    // without a read rate the budget is not searched
    const Json none = plan_json(model + lora + " --cluster " + cpu_cluster(d, 1, device, usable / 1e9), d);
    for (const Json& c : none["candidates"]) {
        EXPECT_EQ(c["layout"]["weights_budget"], 0);
        EXPECT_FALSE(c["fits"].get<bool>());
    }
}

// --write-config: the best layout as a run config that trains under launch.
TEST(Plan, WrittenLayoutTrains) {
    TempDir d;
    const std::string cfg = d.file("best.json");
    const test::CliResult p = test::run_tessera(fmt::format("plan {}{} --cluster {} --threads 1 --write-config {}",
                                                            kTiny, test::kTinyMoe, cpu_cluster(d, 2), cfg));
    ASSERT_EQ(p.status, 0) << p.err;
    EXPECT_NE(p.out.find("tessera launch -n 2 -- train --config " + cfg), std::string::npos) << p.out;
    const test::CliResult t =
        test::run_tessera("launch -n 2 -- train --config " + cfg + " --steps 2 --out " + d.file("run"));
    ASSERT_EQ(t.status, 0) << t.err;
    EXPECT_EQ(test::jsonl(d.file("run") + "/metrics.jsonl").size() >= 2, true);
}

// A best layout that recomputes some block kinds only is written as their list, and train takes it: the device's
// memory set between that layout's and that of every faster one, so the plan must pick it.
TEST(Plan, WrittenKindListTrains) {
    TempDir d;
    const std::string model = kTiny + test::kTinyMoe + " --set model.n_layers=3";
    const Json all = plan_json(model + " --cluster " + cpu_cluster(d, 1) + " --threads 1", d);
    ASSERT_TRUE(all.is_object());
    Json pick;
    double cap = 0, faster = std::numeric_limits<double>::infinity();  // the least memory of the faster candidates
    for (const Json& c : all["candidates"]) {                          // fastest first
        const double m = c["memory"]["peak_bytes"].get<double>();
        if (c["layout"]["recompute"].is_array() && m < faster) {
            pick = c;
            cap = std::isinf(faster) ? 2 * m : (m + faster) / 2;
            break;
        }
        faster = std::min(faster, m);
    }
    ASSERT_TRUE(pick.is_object()) << all.dump();
    const std::string cfg = d.file("best.json");
    const test::CliResult p =
        test::run_tessera(fmt::format("plan {} --cluster {} --threads 1 --write-config {}", model,
                                      cpu_cluster(d, 1, R"(, "usable_fraction": 1)", cap / 1e9), cfg));
    ASSERT_EQ(p.status, 0) << p.err;
    const Json written = Json::parse(read_text(cfg));
    EXPECT_EQ(written["train"]["recompute"], pick["layout"]["recompute"]) << written.dump();
    const test::CliResult t = test::run_tessera("train --config " + cfg + " --steps 2 --out " + d.file("run"));
    ASSERT_EQ(t.status, 0) << t.err;
    EXPECT_GE(test::jsonl(d.file("run") + "/metrics.jsonl").size(), 2u);
}

// Kimi K3 on the 128-device supernode (spec/scale.md §2, §4): full AdamW's optimizer state alone is 8 B per
// parameter / 128 and nothing fits; LoRA (rank 16 on the experts' gate/up/down, bf16 base) with a capacity factor
// fits at EP64, the frozen experts 2 B per routed parameter / 128 (EP64 x EDP2).
TEST(Plan, KimiK3OnASupernode) {
    TempDir d;
    const std::string k3 = std::string(TESSERA_SOURCE_DIR) + "/configs/hf/kimi_k3.json";
    // (without tensor groups: K3's 96 heads give groups of 2, 4 and 8 within a host, which add 9,216 candidates and
    // minutes of planning that this test does not look at)
    const std::string common =
        " --cluster " + kClusters + "supernode_128.json --global-batch 128 --seq 4096 --no-tensor";
    const Json full = plan_json(k3 + common, d);
    ASSERT_TRUE(full.is_object());
    // spec/scale.md §1's 2.78T; the routed experts from configs/hf/kimi_k3.json: 92 MoE layers x 896 experts x gate,
    // up and down of routed_expert_hidden_size 3584 x moe_intermediate_size 3072
    const double params = 2.779e12, routed = 92.0 * 896 * 3 * 3584 * 3072;
    // AdamW's bytes by layout without its shard group; HSDP with shard groups of S keeps 8 B per dense parameter / S,
    // not / 128: the excess over FSDP's is ∝ 1/S − 1/128, 128/S − 1 times the excess at S = 64
    // (the groups' packed bytes: the arena's blocks of so large an arena are coarse)
    std::map<std::string, double> fsdp_optimizer, hsdp64_excess;
    const auto key = [](Json l) {
        l.erase("shard");
        return l.dump();
    };
    const auto optimizer_bytes = [](const Json& c) {  // in the arena, or offloaded (optimizer offload)
        double n = c["memory"]["offloaded_bytes"].get<double>();
        for (const Json& g : c["memory"]["groups"])
            if (g["category"] == "optimizer") n += g["bytes"].get<double>();
        return n;
    };
    for (const Json& c : full["candidates"])
        if (c["layout"]["shard"] == 0) fsdp_optimizer[key(c["layout"])] = optimizer_bytes(c);
    for (const Json& c : full["candidates"])
        if (c["layout"]["shard"] == 64)
            hsdp64_excess[key(c["layout"])] = optimizer_bytes(c) - fsdp_optimizer.at(key(c["layout"]));
    int hsdp = 0, offloaded = 0;
    for (const Json& c : full["candidates"]) {
        EXPECT_FALSE(c["fits"].get<bool>()) << c["layout"].dump();
        offloaded += c["layout"]["offload"].get<bool>();
        const double optimizer = optimizer_bytes(c);
        if (const int64_t S = c["layout"]["shard"].get<int64_t>(); S == 0) {
            EXPECT_NEAR(optimizer / (8.0 * params / 128), 1.0, 0.01) << c["layout"].dump();
        } else {
            ++hsdp;
            EXPECT_GT(hsdp64_excess.at(key(c["layout"])), 0.0);
            EXPECT_NEAR((optimizer - fsdp_optimizer.at(key(c["layout"]))) / hsdp64_excess.at(key(c["layout"])),
                        128.0 / double(S) - 1.0, 0.01 * (128.0 / double(S) - 1.0))
                << c["layout"].dump();
        }
        // the gradient's reduce-scatters run in rounds: each scratch is one round's (16 MiB at 128 ranks), not 128 x a
        // rank's part of a unit (236.8 GB at EP8 when it was; the arena's blocks of so large an arena are coarser)
        for (const Json& g : c["memory"]["groups"]) {
            if (g["category"] == "communication") {
                EXPECT_LE(g["bytes"].get<double>(), 16 << 20) << g.dump();
            }
        }
    }
    const Json lora = plan_json(k3 + common + " --mode lora --set model.moe.capacity_factor=1.25", d);
    ASSERT_TRUE(lora.is_object());
    bool ep64_fits = false;
    for (const Json& c : lora["candidates"]) {
        if (c["layout"]["ep"] != 64 || !c["layout"]["fsdp"].get<bool>()) continue;
        ep64_fits |= c["fits"].get<bool>();
        for (const Json& g : c["memory"]["groups"]) {
            if (g["name"] == "params.shard.frozen_experts") {
                EXPECT_NEAR(g["bytes"].get<double>() / (2.0 * routed / 128), 1.0, 0.01);
            }
        }
    }
    EXPECT_TRUE(ep64_fits);
    EXPECT_GT(hsdp, 0);
    // nothing fits, so every layout is tried with its moments offloaded too, and the smallest is one of them
    EXPECT_EQ(2 * offloaded, int(full["candidates"].size()));
    EXPECT_TRUE(full["candidates"][0]["layout"]["offload"].get<bool>());
}

// Each trained unit's part of a region of the optimizer's flat space (AdamW::data: its dense parameters,
// AdamW::expert: its experts): elements [lo, hi) of the region.
std::vector<std::pair<int64_t, int64_t>> unit_parts(const train::RankState& st, int region) {
    const BufferGroup layout("params", st.model.trained_specs());  // the optimizer's flat space
    const size_t frozen = st.model.frozen_params();
    const int64_t base = st.opt.regions()[size_t(region)].base;
    std::vector<std::pair<int64_t, int64_t>> parts;
    for (const model::ParamUnit& u : st.model.param_units()) {
        const auto [first, last] =
            region == train::AdamW::data ? std::pair{u.first, u.last} : std::pair{u.expert_first, u.expert_last};
        if (first >= last) continue;
        const int64_t end =
            int64_t(layout.offset(last - 1 - frozen) / 4) + st.model.trained_specs()[last - 1 - frozen].shape.numel();
        parts.push_back({int64_t(layout.offset(first - frozen) / 4) - base, end - base});
    }
    return parts;
}

// FSDP deals each unit over every rank (parallel/shard.h's spread cut), so a unit's gather and reduce-scatter move
// 1/W of it to or from each rank, as the step-time model assumes; ZeRO-2 keeps each rank's range one stretch. Every
// trained unit of a wide MoE model (a dense feed-forward unit of 25 chunks over 4 ranks, a MoE layer whose 2 experts
// per rank, 48 chunks, two expert-data replicas share at EP 2).
TEST(Plan, FsdpSpreadsEveryUnitOverEveryRank) {
    const train::RunConfig base = train::parse_run_config(
        train::load_config_json(kTiny, {"model.ffn_dim=16384", "model.moe.experts=4", "model.moe.topk=2",
                                        "model.moe.ffn_dim=16384", "model.moe.shared_ffn_dim=32", "parallel.ep=2"}),
        "test");
    for (bool fsdp : {true, false}) {
        train::RunConfig cfg = base;
        cfg.parallel.fsdp = fsdp;
        const std::unique_ptr<parallel::Mesh> mesh = parallel::Mesh::layout(4, 1, 2);
        const train::RankState st(cfg, mesh.get(), 1);
        int wide = 0;  // units of more chunks than ranks
        for (int region : {train::AdamW::data, train::AdamW::expert}) {
            const parallel::ShardedRegion& reg = st.opt.regions()[size_t(region)];
            ASSERT_TRUE(reg.comm) << "shared by " << (region == train::AdamW::data ? "4 ranks" : "2 replicas");
            ASSERT_EQ(reg.shard.spread(), fsdp);
            if (!fsdp) {
                EXPECT_NO_THROW(reg.shard.stretch());
                continue;
            }
            for (const auto& [lo, hi] : unit_parts(st, region)) {
                const std::vector<int64_t> parts = reg.shard.parts(lo, hi);
                const int64_t W = int64_t(parts.size()),
                              chunks = (hi - lo + train::AdamW::kChunk - 1) / train::AdamW::kChunk;
                if (chunks < W) continue;
                ++wide;
                for (int64_t n : parts) EXPECT_GE(n, (chunks / W - 1) * train::AdamW::kChunk) << lo << ".." << hi;
            }
        }
        if (fsdp) {
            EXPECT_EQ(wide, 2) << "the first layer's feed-forward unit, the second's experts";
        }
    }
}

// Kimi K3 under FSDP on 128 ranks at EP 8: no rank holds more than 1.02 times its even share of any unit (dense units
// of ~444M elements over 128 ranks, each layer's experts over the 16 expert-data replicas). A contiguous cut gave the
// busiest rank 113 times its share of the median dense unit (bench/RESULTS.md).
TEST(Plan, KimiK3sUnitsAreSpreadEvenly) {
    const std::string f = std::string(TESSERA_SOURCE_DIR) + "/configs/hf/kimi_k3.json";
    train::RunConfig cfg = train::parse_run_config(
        Json{{"model", model::to_json(model::import_hf_config(train::load_config_json(f, {}), f).model)}}, "k3");
    cfg.parallel.ep = 8;
    cfg.parallel.fsdp = true;
    const std::unique_ptr<parallel::Mesh> mesh = parallel::Mesh::layout(128, 0, 8);
    const train::RankState st(cfg, mesh.get(), 1);
    for (int region : {train::AdamW::data, train::AdamW::expert}) {
        const parallel::FlatShard& cut = st.opt.regions()[size_t(region)].shard;
        const std::vector<std::pair<int64_t, int64_t>> units = unit_parts(st, region);
        EXPECT_EQ(units.size(), region == train::AdamW::data ? 188u : 92u) << "2 per layer (93) + embedding + head; "
                                                                              "92 MoE layers";
        for (const auto& [lo, hi] : units) {
            const std::vector<int64_t> parts = cut.parts(lo, hi);
            const double even = double(hi - lo) / double(parts.size());
            EXPECT_LE(double(*std::max_element(parts.begin(), parts.end())), 1.02 * even) << lo << ".." << hi;
        }
    }
}

// The planner prices the busiest rank. Under FSDP's spread cut that can be neither the first nor the last rank (each
// unit's leftover chunks go to the ranks in turn): RankMemory::largest_state_rank names it, and its arena is the
// largest of all ranks', over wide models of 2 to 4 layers, with and without expert parallelism (the last rank's is
// not: it has the fewest leftovers).
TEST(Plan, TheRankWithTheMostMomentsHasTheLargestArena) {
    for (int layers : {2, 3, 4}) {
        for (int ffn : {16384, 20000, 24576}) {
            const train::RunConfig cfg = train::parse_run_config(
                train::load_config_json(kTiny,
                                        {fmt::format("model.ffn_dim={}", ffn), fmt::format("model.n_layers={}", layers),
                                         "model.moe.experts=4", "model.moe.topk=2", "model.moe.ffn_dim=16384"}),
                "test");
            for (int64_t ep : {1, 2})
                for (int64_t shard : {0, 2}) {  // FSDP over the 4 ranks, HSDP over groups of 2
                    const plan::Layout l{4, ep, true, 1, {}, shard};
                    std::vector<size_t> arena;
                    for (int r = 0; r < 4; ++r) arena.push_back(plan::predict_rank_memory(cfg, l, r, 1).arena_bytes);
                    const int q = plan::predict_rank_memory(cfg, l, 0, 1).largest_state_rank;
                    const size_t most = *std::max_element(arena.begin(), arena.end());
                    EXPECT_EQ(arena[size_t(q)], most)
                        << layers << " layers, ffn " << ffn << ", ep " << ep << ", shard " << shard;
                }
        }
    }
}

// calibrate's α-β fit of a collective over its call sizes: exact on exact points; points whose best line would cross
// zero below the smallest call: the line through the smallest and the largest call, α in [0, the fastest call's time];
// the relative weighting lets the small call set α although the large ones
// are a million times longer; fewer than two sizes is an error.
TEST(Plan, AlphaBetaFitsTheMeasuredSizes) {
    const std::vector<double> x = {8, 65536, 1 << 20, 8 << 20};
    std::vector<double> t;
    for (double b : x) t.push_back(3e-6 + b / 4e9);
    plan::AlphaBeta f = plan::fit_alpha_beta(x, t);
    EXPECT_NEAR(f.alpha, 3e-6, 1e-12);
    EXPECT_NEAR(f.beta, 4e9, 1e-6 * 4e9);
    // no latency, noisy: the best line would cross zero below 8 B; the line through the 8 B and the 8 MiB call does
    // too, so α is 0, and β the 8 MiB call's bandwidth (4 GB/s, 5% slow)
    t = {1.5e-9, 65536 / 4e9 * 0.9, (1 << 20) / 4e9, (8 << 20) / 4e9 * 1.05};
    f = plan::fit_alpha_beta(x, t);
    EXPECT_EQ(f.alpha, 0.0);
    EXPECT_NEAR(f.beta, 4e9 / 1.05, 1e-3 * f.beta);
    // two ranks on two cores (as CI measured them): the 8 B calls woke late, 40 us against the 64 KiB calls' 12. The
    // best line crosses zero, and through the origin it called a small collective free. The latency is at most the
    // fastest call's 12 us, the bandwidth the 8 MiB call's after the 8 B call's time: 8 MiB in 2.86 ms
    t = {40e-6, 12e-6, 450e-6, 2900e-6};
    f = plan::fit_alpha_beta(x, t);
    EXPECT_EQ(f.alpha, 12e-6);
    EXPECT_NEAR(f.beta, ((8 << 20) - 8) / (2900e-6 - 40e-6), 1e-9 * f.beta);
    t = {1e-5, 2e-5 + 65536 / 4e9, 2e-5 + (1 << 20) / 4e9, 2e-5 + (8 << 20) / 4e9};  // the small call: 10 us alone
    f = plan::fit_alpha_beta(x, t);
    EXPECT_GT(f.alpha, 8e-6);
    EXPECT_LT(f.alpha, 2.1e-5);
    test::expect_error([&] { plan::fit_alpha_beta({8}, {1e-6}); }, "fit_alpha_beta");
}

// tessera calibrate: a cluster file of what it measured, which plan reads; under launch the link between the ranks.
TEST(Plan, CalibrateWritesAClusterFile) {
    TempDir d;
    const std::string one = d.file("one.json"), two = d.file("two.json");
    const test::CliResult a = test::run_tessera("calibrate --seq 64 --out " + one);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_NE(a.out.find("GEMM (1024^3"), std::string::npos) << a.out;
    const Json c = Json::parse(read_text(one));
    EXPECT_EQ(c["devices"], 1);
    EXPECT_EQ(c["device"]["compute_dtype"], "f32");
    EXPECT_GT(c["device"]["peak_tflops"]["f32"].get<double>(), 0.001) << "a GEMM rate above 1 GFLOP/s";
    // every class at micro-batches of 1, 2, 4, 8 and 16 sequences of 64 (the demo's batch of 16 on one rank)
    const Json& table = c["device"]["efficiency_by_tokens"];
    EXPECT_EQ(table["tokens"], Json::parse("[64, 128, 256, 512, 1024]")) << table.dump();
    for (const char* k : {"gemm", "grouped_gemm", "attention", "kda"}) {
        const double e = c["device"]["efficiency"][k].get<double>();
        EXPECT_TRUE(e > 0 && e <= 1) << k << " " << e;
        ASSERT_EQ(table[k].size(), 5u) << k;
        for (const Json& x : table[k]) EXPECT_TRUE(x.get<double>() > 0 && x.get<double>() <= 1) << k << " " << x;
    }
    for (const auto& [k, v] : c["device"]["forward_share"].items())  // the forward's share of each timed block
        EXPECT_TRUE(v.get<double>() > 0.05 && v.get<double>() < 0.95) << k << " " << v;
    // the demo's attention blocks over half their heads: what a tensor group's ranks each repeat
    for (const char* k : {"attention", "kda"}) {
        const Json& shared = c["device"]["tensor_shared"];
        EXPECT_TRUE(shared.contains(k) && shared[k].get<double>() >= 0 && shared[k].get<double>() <= 2)
            << k << ": " << shared.dump();
    }
    EXPECT_NE(a.out.find("(dsa) over half its heads"), std::string::npos) << a.out;
    // what the process holds outside an arena (code, libraries, oneDNN): tens of MB, not nothing, not GBs
    const double reserved = c["device"]["reserved_gb"].get<double>();
    EXPECT_TRUE(reserved > 0.005 && reserved < 1.0) << reserved;
    // the weight budget's read rate: from storage, so well below a copy in memory (pages faulted back in from the
    // page cache, had the drop failed, come at about memcpy's rate)
    const double read = c["host"]["read_bandwidth_gbs"].get<double>();
    EXPECT_TRUE(read > 0.01 && read < c["device"]["memory_bandwidth_gbs"].get<double>() / 2) << read;
    EXPECT_NE(a.out.find("a released base read back from storage"), std::string::npos) << a.out;
    EXPECT_EQ(test::run_tessera("plan " + kTiny + " --cluster " + one).status, 0);
    // a model without a dense block: the GEMM class from a linear layer of its shared expert's width, by call size
    const std::string moe = d.file("moe.json");
    write_text_atomic(moe, R"({"model": {"vocab_size": 258, "d_model": 32, "n_layers": 2, "n_heads": 2, "n_kv_heads": 1,
        "moe": {"experts": 8, "topk": 2, "ffn_dim": 32, "shared_ffn_dim": 48, "first_dense": 0}},
        "train": {"seq_len": 64, "batch_size": 4}})");
    const test::CliResult m = test::run_tessera("calibrate --model " + moe + " --out " + d.file("moe_cluster.json"));
    ASSERT_EQ(m.status, 0) << m.err;
    for (const char* tokens : {"   64", "  128", "  256"})
        EXPECT_NE(m.out.find(fmt::format("linear 32 -> 48 at {} tokens", tokens)), std::string::npos) << m.out;
    EXPECT_EQ(m.out.find("(mlp)"), std::string::npos) << m.out;
    EXPECT_NE(m.out.find("no block over half the heads"), std::string::npos) << m.out;  // its 1 kv head
    const Json mc = Json::parse(read_text(d.file("moe_cluster.json")));
    EXPECT_FALSE(mc["device"].contains("tensor_shared"));
    ASSERT_EQ(mc["device"]["efficiency_by_tokens"]["gemm"].size(), 3u);
    for (const Json& x : mc["device"]["efficiency_by_tokens"]["gemm"])
        EXPECT_TRUE(x.get<double>() > 0 && x.get<double>() <= 1 && x.get<double>() != 0.9) << x;
    const test::CliResult b = test::run_tessera("launch -n 2 -- calibrate --seq 64 --out " + two);
    ASSERT_EQ(b.status, 0) << b.err;
    const Json l = Json::parse(read_text(two))["links"][0];
    EXPECT_EQ(l["name"], "mpi collectives");
    EXPECT_GT(l["bandwidth_gbs"].get<double>(), 0.01);
    EXPECT_GT(l["latency_us"].get<double>(), 0.0);
    // each collective over the group of both ranks; the link's own numbers are the all-to-all's
    EXPECT_EQ(l["collectives"]["ranks"], Json::parse("[2]")) << l.dump();
    for (const char* k : {"all_gather", "reduce_scatter", "all_to_all"}) {
        ASSERT_EQ(l["collectives"][k]["bandwidth_gbs"].size(), 1u) << k;
        EXPECT_GT(l["collectives"][k]["bandwidth_gbs"][0].get<double>(), 0.01) << k;
        EXPECT_GT(l["collectives"][k]["latency_us"][0].get<double>(), 0.0) << k;
    }
    EXPECT_EQ(l["bandwidth_gbs"], l["collectives"]["all_to_all"]["bandwidth_gbs"][0]);
    // with ranks: each class's slowdown beside FSDP's transfers of its unit (0 alone: no such key)
    EXPECT_FALSE(c["device"].contains("beside_fsdp"));
    const Json beside = Json::parse(read_text(two))["device"]["beside_fsdp"];
    for (const char* k : {"gemm", "grouped_gemm", "attention", "kda"})
        EXPECT_TRUE(beside.contains(k) && beside[k].get<double>() >= 0 && beside[k].get<double>() <= 2)
            << k << ": " << beside.dump();
    EXPECT_NE(b.out.find("beside FSDP's transfers of its unit"), std::string::npos) << b.out;
    // a model whose layers do not fit this machine: one line, no file
    test::expect_one_line_error(test::run_tessera("calibrate --model " + std::string(TESSERA_SOURCE_DIR) +
                                                  "/configs/hf/kimi_k3.json --out " + d.file("k3.json")),
                                "time a smaller model", "K3 calibration");
    EXPECT_FALSE(fs::exists(d.file("k3.json")));
}

// A measured efficiency table: a micro-batch's blocks run at the fraction for their tokens per call, interpolated in
// log tokens. tiny.json (seq 32, batch 4) on one rank: micro-batches of 32, 64 and 128 tokens; the table says 0.2 at 32
// and 0.8 at 128 tokens for every class, so 0.5 at 64: the step's compute at micro 1, 2 and 4 (the same tokens per
// step) goes as 1/0.2 : 1/0.5 : 1/0.8.
TEST(Plan, BlocksRunAtTheRateOfTheirCallSize) {
    TempDir d;
    const std::string cluster = cpu_cluster(d, 1, R"(, "efficiency_by_tokens": {"tokens": [32, 128],
        "gemm": [0.2, 0.8], "grouped_gemm": [0.2, 0.8], "attention": [0.2, 0.8], "kda": [0.2, 0.8]})");
    const Json plan = plan_json(kTiny + " --cluster " + cluster, d);
    std::map<int, double> compute;  // micro-batch -> seconds
    for (const Json& c : plan["candidates"])
        if (c["layout"]["recompute"] == false)
            compute[c["layout"]["micro_batch"].get<int>()] = c["step_seconds"]["compute"].get<double>();
    ASSERT_EQ(compute.size(), 3u);
    EXPECT_NEAR(compute[1] / compute[4], 4.0, 1e-6);
    EXPECT_NEAR(compute[2] / compute[4], 0.8 / 0.5, 1e-6);
}

// Measured collectives: FSDP's gathers run at the all-gather's rate, its gradients at the reduce-scatter's, expert
// parallelism's exchanges at the all-to-all's, each at the size of its group. The tiny MoE model on 2 ranks, latencies
// 0: every parameter trains in f32, so a gather (twice per unit) moves twice a reduce-scatter's bytes; slowing one
// collective to half its rate adds exactly its time and leaves the others alone.
TEST(Plan, CollectivesRunAtTheirMeasuredRates) {
    TempDir d;
    const auto cluster = [&](int devices, const std::string& ranks, const std::string& ag, const std::string& rs,
                             const std::string& a2a) {
        const std::string f = d.file("coll.json");
        write_text_atomic(f, fmt::format(R"({{"name": "test", "devices": {0},
            "device": {{"memory_gb": 4, "peak_tflops": {{"f32": 0.1}}, "compute_dtype": "f32", "memory_bandwidth_gbs": 10}},
            "host": {{"devices": {0}, "memory_gb": 16}},
            "links": [{{"span": {0}, "bandwidth_gbs": 5, "latency_us": 2, "collectives": {{"ranks": {1},
                "all_gather": {{"bandwidth_gbs": {2}, "latency_us": [0, 0]}},
                "reduce_scatter": {{"bandwidth_gbs": {3}, "latency_us": [0, 0]}},
                "all_to_all": {{"bandwidth_gbs": {4}, "latency_us": [0, 0]}}}}}}]}})",
                                         devices, ranks, ag, rs, a2a));
        return f;
    };
    // (ep, fsdp, micro, recompute) -> step_seconds
    const auto times = [&](const std::string& file, const std::string& extra = "") {
        std::map<std::string, Json> t;
        const Json plan = plan_json(kTiny + test::kTinyMoe + extra + " --cluster " + file, d);
        for (const Json& c : plan["candidates"]) t[c["layout"].dump()] = c["step_seconds"];
        return t;
    };
    const auto base = times(cluster(2, "[2, 4]", "[1, 1]", "[1, 1]", "[1, 1]"));
    const auto ag = times(cluster(2, "[2, 4]", "[0.5, 0.5]", "[1, 1]", "[1, 1]"));
    const auto rs = times(cluster(2, "[2, 4]", "[1, 1]", "[0.5, 0.5]", "[1, 1]"));
    const auto a2a = times(cluster(2, "[2, 4]", "[1, 1]", "[1, 1]", "[0.25, 0.25]"));
    ASSERT_FALSE(base.empty());
    int fsdp = 0, zero2 = 0, ep2 = 0;
    for (const auto& [layout, t] : base) {
        const double f = t["fsdp"].get<double>(), g = t["grad_sync"].get<double>(), x = t["a2a"].get<double>();
        const double gathers = ag.at(layout)["fsdp"].get<double>() - f,
                     scatters = rs.at(layout)["fsdp"].get<double>() - f;
        if (f > 0) {
            ++fsdp;
            EXPECT_NEAR(gathers / scatters, 2.0, 1e-9) << layout;
            EXPECT_NEAR((gathers + scatters) / f, 1.0, 1e-9) << layout;
        }
        if (g > 0) {
            ++zero2;  // one reduce-scatter and one all-gather of as many bytes
            EXPECT_NEAR(ag.at(layout)["grad_sync"].get<double>() / g, 1.5, 1e-9) << layout;
            EXPECT_NEAR(rs.at(layout)["grad_sync"].get<double>() / g, 1.5, 1e-9) << layout;
        }
        EXPECT_DOUBLE_EQ(ag.at(layout)["a2a"].get<double>(), x) << layout;
        EXPECT_DOUBLE_EQ(a2a.at(layout)["fsdp"].get<double>(), f) << layout;
        if (x > 0) {
            ++ep2;
            EXPECT_NEAR(a2a.at(layout)["a2a"].get<double>() / x, 4.0, 1e-9) << layout;
        }
    }
    EXPECT_GT(fsdp, 0);
    EXPECT_GT(zero2, 0);
    EXPECT_GT(ep2, 0);
    // by group size, linear in log ranks: measured at 2 and 8, a group of 4 sees the middle (2.5 GB/s). On 4 ranks
    // with EP1 every collective spans 4 ranks, as with a table of 4 alone; with EP2 the experts' go over groups of 2.
    // HSDP with shard groups of 2 (EP1): the replica all-reduce over the 2 replicas runs at 1 GB/s, not 2.5, and so
    // do the dense collectives over the groups of 2 (the experts' stay over the expert-data group of 4).
    const auto wide = times(cluster(4, "[2, 8]", "[1, 4]", "[1, 4]", "[1, 4]"), " --global-batch 4");
    const auto four = times(cluster(4, "[4, 5]", "[2.5, 2.5]", "[2.5, 2.5]", "[2.5, 2.5]"), " --global-batch 4");
    int same = 0, apart = 0, hsdp = 0;
    for (const auto& [layout, t] : wide) {
        const Json l = Json::parse(layout);
        if (l["pipeline"] != 1) continue;  // (a stage's groups are 2 of the 4 ranks)
        const double a = t["fsdp"].get<double>() + t["grad_sync"].get<double>(),
                     b = four.at(layout)["fsdp"].get<double>() + four.at(layout)["grad_sync"].get<double>();
        if (l["shard"] == 2) {
            EXPECT_GT(t["grad_sync"].get<double>(), 0.0) << layout;  // the replicas' all-reduce
            if (l["ep"] == 1) {
                EXPECT_NEAR(t["grad_sync"].get<double>() / four.at(layout)["grad_sync"].get<double>(), 2.5, 1e-9)
                    << layout;
                EXPECT_GT(t["fsdp"].get<double>() / four.at(layout)["fsdp"].get<double>(), 1.01) << layout;
                ++hsdp;
            }
        } else if (l["ep"] == 1) {
            EXPECT_NEAR(a / b, 1.0, 1e-9) << layout;
            ++same;
        } else if (l["ep"] == 2) {
            EXPECT_GT(a / b, 1.01) << layout;  // the experts' collectives at 1 GB/s, not 2.5
            ++apart;
        }
    }
    EXPECT_GT(same, 0);
    EXPECT_GT(apart, 0);
    EXPECT_GT(hsdp, 0);
}

// A calibrated slowdown beside FSDP's transfers (device.beside_fsdp): FSDP's (and HSDP's) blocks and head compute that
// much slower, exactly; ZeRO-2, which moves nothing while they compute, and one rank do not.
TEST(Plan, BlocksBesideFsdpsTransfersComputeSlower) {
    TempDir d;
    const auto compute = [&](const std::string& device_keys, int ranks) {
        std::map<std::string, double> t;
        const Json plan =
            plan_json(kTiny + test::kTinyMoe + " --global-batch 4 --cluster " + cpu_cluster(d, ranks, device_keys), d);
        for (const Json& c : plan["candidates"]) t[c["layout"].dump()] = c["step_seconds"]["compute"];
        return t;
    };
    for (int ranks : {1, 4}) {
        const auto base = compute("", ranks);
        const auto slow =
            compute(R"(, "beside_fsdp": {"gemm": 0.25, "grouped_gemm": 0.25, "attention": 0.25, "kda": 0.25})", ranks);
        int fsdp = 0, other = 0;
        for (const auto& [layout, t] : base) {
            const Json l = Json::parse(layout);
            const bool beside = ranks > 1 && l["fsdp"].get<bool>();
            EXPECT_NEAR(slow.at(layout) / t, beside ? 1.25 : 1.0, 1e-9) << layout;
            ++(beside ? fsdp : other);
        }
        if (ranks > 1) {
            EXPECT_GT(fsdp, 0);
        }
        EXPECT_GT(other, 0);
    }
}

// Uniform routing is expert parallelism's best case, and the report says so; a skewed load (zipf:1) slows the EP2
// layouts (their busiest rank's experts), not the EP1 ones, and drops the remark.
TEST(Plan, UniformRoutingIsNamedTheBestCase) {
    TempDir d;
    const std::string cluster = cpu_cluster(d, 2);
    const std::string args = "plan " + kTiny + test::kTinyMoe + " --cluster " + cluster;
    const test::CliResult uniform = test::run_tessera(args + " --json " + d.file("u.json"));
    const test::CliResult zipf = test::run_tessera(args + " --routing zipf:1 --json " + d.file("z.json"));
    ASSERT_EQ(uniform.status, 0) << uniform.err;
    ASSERT_EQ(zipf.status, 0) << zipf.err;
    EXPECT_NE(uniform.out.find("routing uniform is expert parallelism's best case"), std::string::npos) << uniform.out;
    EXPECT_EQ(zipf.out.find("best case"), std::string::npos) << zipf.out;
    const Json before_json = Json::parse(read_text(d.file("u.json"))), after = Json::parse(read_text(d.file("z.json")));
    std::map<std::string, double> u;
    for (const Json& c : before_json["candidates"]) u[c["layout"].dump()] = c["step_seconds"]["total"].get<double>();
    int slower = 0;
    for (const Json& c : after["candidates"]) {
        const double t = c["step_seconds"]["total"].get<double>(), before = u.at(c["layout"].dump());
        if (c["layout"]["ep"] == 1) {
            EXPECT_DOUBLE_EQ(t, before) << c["layout"].dump();
        } else {
            EXPECT_GT(t, before) << c["layout"].dump();
            EXPECT_GT(c["imbalance"].get<double>(), 1.0);
            ++slower;
        }
    }
    EXPECT_GT(slower, 0);
}

// tessera simulate: the step of one layout as a Chrome trace. The tiny MoE model on 2 ranks (EP2, FSDP, micro 1 of
// the 2 sequences per rank, recompute): per micro-batch every block forward, recomputed and backward once on the
// compute track, in order and without overlap; the MoE layer's exchanges (forward; backward with the recompute's) and
// FSDP's gathers and reduce-scatters on the communication track; the printed step is where the trace ends.
TEST(Plan, SimulateWritesATraceOfTheStep) {
    TempDir d;
    const std::string out = d.file("trace.json");
    const test::CliResult r = test::run_tessera(
        fmt::format("simulate {}{} --cluster {} --ep 2 --micro-batch 1 --recompute --out {}", kTiny, test::kTinyMoe,
                    cpu_cluster(d, 2, R"(, "forward_share": {"attention": 0.25})"), out));
    ASSERT_EQ(r.status, 0) << r.err;
    const Json t = Json::parse(read_text(out));
    std::map<std::string, int> count;           // "cat/name"
    std::map<std::string, double> layer0_span;  // "cat" of layer 0's attention block: its last span's duration
    double end = 0, compute_end = 0;
    for (const Json& e : t["traceEvents"]) {
        if (e["ph"] != "X") continue;
        const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
        EXPECT_GE(dur, 0.0);
        if (e["tid"] == 0) {
            EXPECT_GE(ts, compute_end - 1e-6) << "compute spans overlap: " << e.dump();
            compute_end = ts + dur;
        }
        end = std::max(end, ts + dur);
        count[e["cat"].get<std::string>() + "/" + e["name"].get<std::string>()]++;
        if (e["name"] == "attention" && e.contains("args") && e["args"]["layer"] == 0)
            layer0_span[e["cat"].get<std::string>()] = dur;
    }
    // tiny.json: 2 layers (attention + mlp, attention + moe); 2 micro-batches per rank. Recompute re-runs every block
    // but the last of its kind (whose saved set is still there; model.cpp): layer 0's attention only.
    EXPECT_EQ(count["forward/attention"], 4);
    EXPECT_EQ(count["forward/mlp"], 2);
    EXPECT_EQ(count["forward/moe"], 2);
    EXPECT_EQ(count["recompute/attention"], 2);
    EXPECT_EQ(count["recompute/moe"] + count["recompute/mlp"], 0);
    EXPECT_EQ(count["backward/attention"], 4);
    EXPECT_EQ(count["step/gradients (clear, accumulate)"], 2);
    EXPECT_EQ(count["optimizer/AdamW"], 1);
    EXPECT_EQ(count["comm/all-to-all"], 4) << "forward and backward, per micro-batch";
    // the cluster's forward share: a quarter of the block's forward + backward, recomputed at the forward's cost
    EXPECT_NEAR(layer0_span["backward"], 3.0 * layer0_span["forward"], 1e-3 * layer0_span["backward"]);
    EXPECT_NEAR(layer0_span["recompute"], layer0_span["forward"], 1e-3 * layer0_span["forward"]);
    // FSDP's transfers unit by unit (a block, the embedding, the head), as the runtime makes them: its gathers
    // (each visit prefetches the next visit's unit unless it is still in its slot) and reduce-scatters per step are
    // the ones a training step of the same layout counts (metrics.jsonl's fsdp record)
    int gathers = 0, reductions = 0;
    for (const auto& [name, n] : count) {
        if (name.starts_with("comm/gather ")) gathers += n;
        if (name.starts_with("comm/reduce-scatter ")) reductions += n;
    }
    const std::string run = d.file("run");
    const test::CliResult tr = test::run_tessera_mpi(
        2, fmt::format("train --config {}{} --steps 2 --set parallel.ep=2 --set train.micro_batch_size=1 --set "
                       "train.recompute=true --set train.eval_interval=0 --set train.checkpoint_interval=0 --out {}",
                       kTiny, test::kTinyMoe, run));
    ASSERT_EQ(tr.status, 0) << tr.err;
    Json step;  // the last step's record (the final checkpoint's has no fsdp counts)
    for (const Json& rec : test::jsonl(run + "/metrics.jsonl"))
        if (rec.contains("fsdp")) step = rec;
    ASSERT_TRUE(step.is_object()) << "no step record with fsdp counts";
    EXPECT_EQ(gathers, step["fsdp"]["gathers"].get<int>());
    EXPECT_EQ(reductions, step["fsdp"]["reductions"].get<int>());
    EXPECT_EQ(gathers, 15) << "6 units, 2 micro-batches: slots kept from one visit and one micro-batch to the next";
    const std::smatch m = [&] {
        std::smatch s;
        std::regex_search(r.out, s, std::regex(R"(simulated step ([0-9.]+) ms)"));
        return s;
    }();
    ASSERT_FALSE(m.empty()) << r.out;
    EXPECT_NEAR(std::stod(m[1]), end / 1e3, 0.1) << r.out;
}

// tessera simulate of tensor groups: 2 ranks in one group of 2 (tiny.json with 2 kv heads, micro-batch 2 of the
// group's 4 sequences, recompute): per micro-batch each attention block's forward waits for its all-gather and
// reduce-scatter, its recomputed forward (layer 0's) again, its backward for three more; the spans are the planner's
// `tensor` time and the simulated step its estimate (nothing else overlaps on one rank of one group without FSDP's
// prefetch contention here: ZeRO-2).
TEST(Plan, SimulateLaysOutTensorTransfers) {
    TempDir d;
    const std::string out = d.file("trace.json"), plan = d.file("plan.json");
    const std::string model = kTiny + " --set model.n_kv_heads=2", cluster = " --cluster " + cpu_cluster(d, 2);
    const test::CliResult r = test::run_tessera("simulate " + model + cluster +
                                                " --tensor 2 --micro-batch 2 --zero2 --recompute --out " + out);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("tp 2, ep 1, zero-2, micro 2, recompute"), std::string::npos) << r.out;
    const Json t = Json::parse(read_text(out));
    int spans = 0;
    double seconds = 0;
    for (const Json& e : t["traceEvents"])
        if (e["ph"] == "X" && e["name"] == "tensor all-gather / reduce-scatter") {
            ++spans;
            seconds += e["dur"].get<double>() / 1e6;
        }
    // 2 micro-batches x 2 attention blocks x (forward, backward) + layer 0's recomputed forward
    EXPECT_EQ(spans, 2 * (2 * 2 + 1));
    const Json p = plan_json(model + cluster + " --threads 1", d);
    for (const Json& c : p["candidates"]) {
        const Json& l = c["layout"];
        if (l["tensor"] == 2 && l["micro_batch"] == 2 && l["fsdp"] == false && l["recompute"] == true &&
            l["offload"] == false) {
            EXPECT_NEAR(c["step_seconds"]["tensor"].get<double>(), seconds, 1e-9 + 1e-6 * seconds);
        }
    }
}

// tessera simulate of pipeline stages: the tiny model's 4 layers as 2 stages of 1 rank each, split [1] (stage 0:
// layer 0, stage 1: layers 1–3 and the head), 4 micro-batches of 1 sequence. Each stage is a process of the trace with
// its own tracks; stage 0 runs the 1F1B order (train/pipeline.h: one forward ahead, then a forward and a backward in
// turn), its backward alone (the activations kept) or after its forward again (--pipeline-rerun); the exchanges are
// the schedule's, both neighbours blocked in each at once; stage 1 waits for its first input; the printed step is where
// the trace ends, and re-running costs stage 0 time (hidden here: stage 1, three layers and the head, sets the pace).
TEST(Plan, SimulateLaysOutThePipelineStages) {
    TempDir d;
    const std::string cluster = cpu_cluster(d, 2, R"(, "forward_share": {"attention": 0.25})");
    double busy[2] = {0, 0};  // stage 0's compute
    for (const bool rerun : {false, true}) {
        SCOPED_TRACE(rerun ? "re-running" : "keeping");
        const std::string out = d.file("trace.json");
        const test::CliResult r = test::run_tessera(
            fmt::format("simulate {} --set model.n_layers=4 --cluster {} --pipeline 2 --pipeline-split 1 "
                        "--micro-batch 1{} --out {}",
                        kTiny, cluster, rerun ? " --pipeline-rerun" : "", out));
        ASSERT_EQ(r.status, 0) << r.err;
        const Json t = Json::parse(read_text(out));
        std::map<int, double> compute_end;           // per stage
        std::map<int, std::vector<Json>> exchanges;  // per stage, in time
        std::map<int, std::map<std::string, int>> count;
        std::vector<std::string> layer0;  // stage 0's first block's spans: forward, reforward, backward in time
        double end = 0, first_input = -1, stage1_first = -1;
        std::set<std::string> names;
        for (const Json& e : t["traceEvents"]) {
            if (e["ph"] == "M" && e["name"] == "process_name") names.insert(e["args"]["name"].get<std::string>());
            if (e["ph"] != "X") continue;
            const int pid = e["pid"].get<int>();
            const double ts = e["ts"].get<double>(), dur = e["dur"].get<double>();
            end = std::max(end, ts + dur);
            if (e["tid"] == 0) {
                EXPECT_GE(ts, compute_end[pid] - 1e-6) << "compute spans overlap: " << e.dump();
                compute_end[pid] = ts + dur;
                if (pid == 1 && e["cat"] != "bubble" && stage1_first < 0) stage1_first = ts;
                if (pid == 0 && e["cat"] != "bubble") busy[rerun] += dur;
            }
            if (e["tid"] == 2) {
                exchanges[pid].push_back(e);
                if (pid == 1 && first_input < 0) first_input = ts + dur;
            }
            count[pid][e["cat"].get<std::string>() + "/" + e["name"].get<std::string>()]++;
            if (pid == 0 && e["name"] == "attention") layer0.push_back(e["cat"].get<std::string>());
        }
        const std::string layout =
            rerun ? "pp 2 [1] rerun, ep 1, one rank, micro 1" : "pp 2 [1], ep 1, one rank, micro 1";
        EXPECT_TRUE(names.count("stage 0 (layers 0–0): busiest rank, " + layout)) << t.dump().substr(0, 600);
        EXPECT_TRUE(names.count("stage 1 (layers 1–3): busiest rank, " + layout));
        // stage 0: every micro-batch forward, then (forward again and) backward; F0 F1 B0 F2 B1 F3 B2 B3
        const std::vector<std::string> B =
            rerun ? std::vector<std::string>{"reforward", "backward"} : std::vector<std::string>{"backward"};
        std::vector<std::string> want;
        for (const char pass : std::string("FFBFBFBB"))
            if (pass == 'F')
                want.push_back("forward");
            else
                want.insert(want.end(), B.begin(), B.end());
        EXPECT_EQ(layer0, want);
        EXPECT_EQ(count[0]["forward/mlp"], 4);
        EXPECT_EQ(count[0]["reforward/mlp"], rerun ? 4 : 0);
        EXPECT_EQ(count[0]["backward/mlp"], 4);
        EXPECT_EQ(count[0]["forward/embedding+head"], 0);
        // stage 1: three layers and the head, forward and backward together
        EXPECT_EQ(count[1]["forward/attention"], 12);
        EXPECT_EQ(count[1]["reforward/attention"], 0);
        EXPECT_EQ(count[1]["backward/attention"], 12);
        EXPECT_EQ(count[1]["forward/embedding+head"], 4);
        EXPECT_EQ(count[0]["step/gradients (clear, accumulate)"], 4);
        EXPECT_EQ(count[1]["step/gradients (clear, accumulate)"], 4);
        EXPECT_EQ(count[0]["optimizer/AdamW"], 1);
        EXPECT_EQ(count[1]["optimizer/AdamW"], 1);
        // the schedule's exchanges: activations of 0, then (activations of m + 1 out, the gradient of m in) ×3, the
        // gradient of 3 in; the same spans on both sides
        ASSERT_EQ(exchanges[0].size(), 5u);
        ASSERT_EQ(exchanges[1].size(), 5u);
        EXPECT_EQ(exchanges[0][0]["name"], "stage 1: 0 out");
        EXPECT_EQ(exchanges[0][1]["name"], "stage 1: 1 out, ∂0 in");
        EXPECT_EQ(exchanges[0][4]["name"], "stage 1: ∂3 in");
        EXPECT_EQ(exchanges[1][0]["name"], "stage 0: 0 in");
        EXPECT_EQ(exchanges[1][1]["name"], "stage 0: ∂0 out, 1 in");
        for (size_t k = 0; k < 5; ++k) {
            EXPECT_DOUBLE_EQ(exchanges[0][k]["ts"].get<double>(), exchanges[1][k]["ts"].get<double>()) << k;
            EXPECT_DOUBLE_EQ(exchanges[0][k]["dur"].get<double>(), exchanges[1][k]["dur"].get<double>()) << k;
            EXPECT_GT(exchanges[0][k]["dur"].get<double>(), 0.0);
        }
        // stage 1 waits for its first input (a bubble on its compute track), stage 0 for the gradients
        EXPECT_GE(stage1_first, first_input - 1e-6);
        EXPECT_GT(count[1]["bubble/wait for stage 0"], 0);
        EXPECT_GT(count[0]["bubble/wait for stage 1"], 0);
        const std::smatch m = [&] {
            std::smatch s;
            std::regex_search(r.out, s,
                              std::regex(R"(simulated step ([0-9.]+) ms \(the planner's estimate ([0-9.]+) ms)"));
            return s;
        }();
        ASSERT_FALSE(m.empty()) << r.out;
        EXPECT_NEAR(std::stod(m[1]), end / 1e3, 0.1) << r.out;
    }
    EXPECT_GT(busy[1], busy[0]) << "re-running the forwards costs stage 0 time";
}

TEST(Plan, MistakesAreOneLineErrors) {
    TempDir d;
    const std::string bad = d.file("bad.json");
    const auto cluster_error = [&](const std::string& text, const std::string& needle) {
        write_text_atomic(bad, text);
        test::expect_one_line_error(test::run_tessera("plan " + kTiny + " --cluster " + bad), needle, text);
    };
    cluster_error("[]", "not a JSON object");
    cluster_error(R"({"devices": 2, "device": {"peak_tflops": {"f32": 1}, "memory_bandwidth_gbs": 1},
                     "links": [{"bandwidth_gbs": 1}]})",
                  "memory_gb is missing");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1}, "links": [{"bandwidth_gbs": 1}], "nodes": 3})",
                  "nodes");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "memory_bandwidth_gbs": 1},
                     "links": [{"bandwidth_gbs": 1}]})",
                  "compute_dtype bf16 has no peak_tflops");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "beside_fsdp": {"kda": -0.1}}, "links": [{"bandwidth_gbs": 1}]})",
                  "beside_fsdp: kda must be in [0, 2] (got -0.1)");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "tensor_shared": {"attention": 2.5}}, "links": [{"bandwidth_gbs": 1}]})",
                  "tensor_shared: attention must be in [0, 2] (got 2.5)");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1}, "host": {"read_bandwidth_gbs": -1}, "links": [{"bandwidth_gbs": 1}]})",
                  "host: sizes must not be negative");
    const std::string ok = cpu_cluster(d, 2);
    // HSDP's shard group: a divisor of the ranks, under FSDP
    for (const auto& [shard, needle] : {std::pair{"3", "parallel.shard = 3 does not divide the 2 ranks"},
                                        std::pair{"2 --zero2", "parallel.shard = 2 needs FSDP"}})
        test::expect_one_line_error(
            test::run_tessera(fmt::format("simulate {} --cluster {} --ranks 2 --shard {} --out {}", kTiny, ok, shard,
                                          d.file("sim.json"))),
            needle, shard);
    EXPECT_FALSE(fs::exists(d.file("sim.json")));
    test::expect_one_line_error(test::run_tessera("plan " + kTiny + " --cluster " + ok + " --ranks 3"),
                                "3 ranks but the cluster", "more ranks than devices");
    test::expect_one_line_error(test::run_tessera("plan " + kTiny + " --cluster " + ok + " --global-batch 3"),
                                "does not split over 2 ranks", "batch");
    test::expect_one_line_error(
        test::run_tessera("plan " + kTiny + test::kTinyMoe + " --cluster " + ok + " --routing zipf:x"),
        "zipf:S needs an exponent", "routing");
    test::expect_one_line_error(
        test::run_tessera("simulate " + kTiny + test::kTinyMoe + " --cluster " + ok + " --ep 3 --out " + d.file("t")),
        "does not divide the 2 ranks", "ep");
    test::expect_one_line_error(
        test::run_tessera("simulate " + kTiny + " --cluster " + ok + " --recompute=attention,mop --out " + d.file("t")),
        "simulate: --recompute[1] must be a block kind", "unknown recompute kind");
    test::expect_one_line_error(
        test::run_tessera("simulate " + kTiny + " --cluster " + ok + " --recompute=kda --out " + d.file("t")),
        "train.recompute names 'kda' blocks, which the model does not have", "recompute of a kind the model lacks");
    test::expect_one_line_error(
        test::run_tessera("simulate " + kTiny + " --cluster " + ok + " --offload --out " + d.file("t")),
        "no host.offload_bandwidth_gbs, so optimizer offload is not priced", "offload without a rate");
    test::expect_one_line_error(test::run_tessera("plan " + kTiny + " --cluster " + ok + " --offload some"),
                                "--offload", "an unknown offload mode");
    const auto staged_tp = [&](const std::string& args) {
        return test::run_tessera("simulate " + kTiny + " --set model.n_kv_heads=2 --cluster " + ok + " " + args +
                                 " --out " + d.file("t"));
    };
    // tensor groups: a group size the ranks (or a stage's) do not divide; a model tensor parallelism does not cover;
    // heads the group does not divide (tiny.json: 1 kv head)
    test::expect_one_line_error(staged_tp("--tensor 4"), "simulate: --tensor 4 does not divide the 2 ranks",
                                "a group larger than the ranks");
    test::expect_one_line_error(staged_tp("--tensor 2 --pipeline 2 --micro-batch 1"),
                                "simulate: --tensor 2 does not divide the 1 ranks of a stage", "groups in stages");
    test::expect_one_line_error(staged_tp("--tensor 2" + test::kTinyMoe + " --set model.moe.seq_aux_coeff=0.01"),
                                "does not cover model.moe.seq_aux_coeff", "a model it does not cover");
    test::expect_one_line_error(
        test::run_tessera("simulate " + kTiny + " --cluster " + ok + " --tensor 2 --out " + d.file("t")),
        "parallel.tensor = 2 does not divide model.n_kv_heads = 1", "heads the group does not divide");
    const auto staged = [&](const std::string& args) {
        return test::run_tessera("simulate " + kTiny + " --set model.n_layers=4 --cluster " + ok + " " + args +
                                 " --out " + d.file("t"));
    };
    test::expect_one_line_error(staged("--pipeline 3"), "--pipeline 3 does not divide the 2 ranks", "3 stages");
    test::expect_one_line_error(staged("--pipeline-split 2"),
                                "--pipeline-split or --pipeline-rerun without --pipeline stages",
                                "a split without stages");
    test::expect_one_line_error(staged("--pipeline 2 --pipeline-split 4"),
                                "parallel.pipeline_split must be increasing layers in [1, 4)", "a split past the end");
    test::expect_one_line_error(staged("--pipeline 2 --pipeline-split 1,2"),
                                "parallel.pipeline_split names 2 stage starts; 2 stages need 1", "a split too long");
    test::expect_one_line_error(staged("--pipeline 2 --pipeline-split 2,x"),
                                "'2,x' is not a list of integers in [1, 1048576] separated by commas",
                                "a split that is no number");
    test::expect_one_line_error(staged("--pipeline 2 --pipeline-split 0"), "is not a list of integers in [1, ",
                                "a split at layer 0");
    test::expect_one_line_error(staged("--pipeline 2 --set model.tie_embeddings=true"), "with model.tie_embeddings",
                                "stages of a model that cannot be cut");
    EXPECT_FALSE(fs::exists(d.file("t")));
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "efficiency_by_tokens": {"tokens": [256, 512], "kda": [0.5]}},
                     "links": [{"bandwidth_gbs": 1}]})",
                  "efficiency_by_tokens.kda: 1 values for 2 token counts");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "efficiency_by_tokens": {"tokens": [512, 256], "kda": [0.5, 0.6]}},
                     "links": [{"bandwidth_gbs": 1}]})",
                  "tokens: must be ascending");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "efficiency_by_tokens": {"tokens": [256], "conv": [0.5]}},
                     "links": [{"bandwidth_gbs": 1}]})",
                  "unknown op class conv");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                     "memory_bandwidth_gbs": 1, "forward_share": {"kda": 1.5}}, "links": [{"bandwidth_gbs": 1}]})",
                  "forward_share: kda must be in (0, 1)");
    const auto collectives_error = [&](const std::string& collectives, const std::string& needle) {
        cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "peak_tflops": {"f32": 1}, "compute_dtype": "f32",
                         "memory_bandwidth_gbs": 1}, "links": [{"bandwidth_gbs": 1, "collectives": )" +
                          collectives + "}]}",
                      needle);
    };
    collectives_error(R"({"ranks": [2, 4], "all_gather": {"bandwidth_gbs": [1], "latency_us": [1, 2]}})",
                      "all_gather: 1 and 2 values for 2 group sizes");
    collectives_error(R"({"ranks": [4, 2], "all_gather": {"bandwidth_gbs": [1, 1], "latency_us": [1, 2]}})",
                      "ranks: must be ascending group sizes of at least 2");
    collectives_error(R"({"ranks": [2], "broadcast": {"bandwidth_gbs": [1], "latency_us": [1]}})",
                      "unknown collective broadcast");
    collectives_error(R"({"ranks": [2], "all_to_all": {"bandwidth_gbs": [0], "latency_us": [1]}})",
                      "bandwidths must be positive");
    collectives_error(R"({"ranks": [2], "all_to_all": {"bandwidth_gbs": [1]}})", "needs bandwidth_gbs and latency_us");
    cluster_error(R"({"devices": 2, "device": {"memory_gb": 1, "reserved_gb": -1, "peak_tflops": {"f32": 1},
                     "compute_dtype": "f32", "memory_bandwidth_gbs": 1}, "links": [{"bandwidth_gbs": 1}]})",
                  "reserved_gb must be >= 0");
    // the reserve comes off the usable memory: 4 GB x 0.9 less 3.5999 GB leaves 100 KB, which nothing fits
    {
        const std::string reserved = d.file("reserved.json");
        write_text_atomic(reserved, R"({"devices": 2, "device": {"memory_gb": 4, "reserved_gb": 3.5999,
            "peak_tflops": {"f32": 1}, "compute_dtype": "f32", "memory_bandwidth_gbs": 1}, "host": {"devices": 2},
            "links": [{"bandwidth_gbs": 1}]})");
        const test::CliResult r = test::run_tessera("plan " + kTiny + " --cluster " + reserved);
        EXPECT_EQ(r.status, 0) << r.err;
        EXPECT_NE(r.out.find("less 3.6 GB reserved"), std::string::npos) << r.out;
        EXPECT_NE(r.out.find("no layout fits"), std::string::npos) << r.out;
    }
    // nothing fits: no config is written
    const std::string small = d.file("small.json");
    write_text_atomic(small, R"({"devices": 2, "device": {"memory_gb": 0.000001, "peak_tflops": {"f32": 1},
        "compute_dtype": "f32", "memory_bandwidth_gbs": 1}, "host": {"devices": 2}, "links": [{"bandwidth_gbs": 1}]})");
    test::expect_one_line_error(
        test::run_tessera("plan " + kTiny + " --cluster " + small + " --write-config " + d.file("out.json")),
        "no layout fits", "nothing fits");
    EXPECT_FALSE(fs::exists(d.file("out.json")));
}

}  // namespace
}  // namespace tessera
