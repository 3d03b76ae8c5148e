// Data-parallel training under mpirun (label mpi): W ranks sharing the global batch give the bits of one
// process accumulating the same micro-batches (losses, evaluation, final parameters), with FSDP (the default)
// and ZeRO-2, one or two micro-batches per rank, for a dense model, tied embeddings with Attention Residuals,
// an MoE model whose selection bias moves by every rank's expert counts, and the KDA : gated DSA hybrid (both
// DSA stages); a
// checkpoint written by one number of ranks resumes on another; layouts that do not fit are one-line errors; on GPUs
// (train.device = cuda), the ranks' buffers over NCCL.
#include <gtest/gtest.h>

#include <filesystem>
#include <limits>
#include <regex>
#include <sstream>

#include "core/config_reader.h"
#include "core/device.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "model/model.h"
#include "train/checkpoint.h"
#include "train/config.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::expect_close_losses;
using test::losses;
using test::run_tessera;
using test::run_tessera_mpi;
using test::TempDir;
namespace fs = std::filesystem;

const std::string kTiny = TESSERA_TINY_CONFIG;  // batch_size 4, 12 steps, checkpoints at 6 and 12

// The final checkpoint's parameters, whole, as read back by the library from whichever layout wrote them
// (one process: model.safetensors; W ranks: each rank's model-RRRRR-of-WWWWW ranges)
std::string final_model(const std::string& run_dir) {
    const std::string ckpt = run_dir + "/checkpoints/step_0000012";
    const train::RunConfig cfg = train::parse_run_config(train::load_checkpoint_config(ckpt), ckpt);
    model::Model m(cfg.model);
    BufferGroup g("params", m.param_specs());
    const std::vector<const BufferGroup*> gs{&g};
    g.allocate(std::make_shared<Arena>(predict_arena_bytes(gs, 4096), 4096));
    train::load_params(ckpt, g);
    return std::string(reinterpret_cast<const char*>(g.base()), g.nbytes());
}

// `tessera logits` on a run's final checkpoint: the logits tensor's bytes
std::string final_logits(const std::string& run_dir, const std::string& ids_file) {
    const std::string out = run_dir + "/logits.safetensors";
    test::CliResult r =
        run_tessera("logits --checkpoint " + run_dir + "/checkpoints/step_0000012 --in " + ids_file + " --out " + out);
    EXPECT_EQ(r.status, 0) << r.err;
    if (r.status != 0) return {};
    const SafetensorsFile f(out);
    const TensorView v = f.view("logits");
    return std::string(static_cast<const char*>(v.data), v.nbytes());
}

struct Layout {
    const char* name;
    int ranks;
    std::string sets;
    int micro = 0;  // sequences per forward on every rank and in the one process (0: the batch of 4 over the ranks)
    std::string ranks_only;  // --set options of the run of several ranks only (its pipeline stages)
};

void PrintTo(const Layout& l, std::ostream* os) { *os << l.name; }

class DataParallel : public ::testing::TestWithParam<Layout> {};

TEST_P(DataParallel, EqualsOneProcessAccumulatingTheSameMicroBatches) {
    const Layout& p = GetParam();
    TempDir d;
    const std::string one = d.file("one"), many = d.file("many");
    const std::string micro = " --set train.micro_batch_size=" + std::to_string(p.micro ? p.micro : 4 / p.ranks);
    test::CliResult a = run_tessera("train --config " + kTiny + " --out " + one + micro + p.sets);
    ASSERT_EQ(a.status, 0) << a.err;
    test::CliResult b =
        run_tessera_mpi(p.ranks, "train --config " + kTiny + " --out " + many + micro + p.sets + p.ranks_only);
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    EXPECT_NE(b.out.find(std::to_string(p.ranks) + " ranks (mpi)"), std::string::npos) << b.out;
    const bool zero2 = p.sets.find("parallel.fsdp=false") != std::string::npos;
    const bool whole = p.ranks_only.find("parallel.pipeline=" + std::to_string(p.ranks)) != std::string::npos;
    EXPECT_NE(b.out.find(whole ? "(one rank per stage)" : zero2 ? "(ZeRO-2)" : "(FSDP)"), std::string::npos) << b.out;
    EXPECT_EQ(b.out.find("pipeline stages") != std::string::npos, !p.ranks_only.empty()) << b.out;
    const auto la = losses(one), lb = losses(many);
    ASSERT_EQ(la.size(), 14u);  // 12 steps, 2 evaluations
    EXPECT_EQ(la, lb);
    EXPECT_TRUE(final_model(one) == final_model(many)) << "the final parameters differ";
    // one model and one optimizer file per rank, each its ranges of the parameters and moments; nothing whole
    for (int r = 0; r < p.ranks; ++r) {
        for (const char* kind : {"model", "optimizer"})
            EXPECT_TRUE(fs::exists(
                fmt::format("{}/checkpoints/step_0000012/{}-{:05d}-of-{:05d}.safetensors", many, kind, r, p.ranks)));
    }
    EXPECT_TRUE(fs::exists(many + "/checkpoints/step_0000012/model.index.json"));
    EXPECT_FALSE(fs::exists(many + "/checkpoints/step_0000012/model.safetensors"));
    // the sharded checkpoint serves inference like the one-process one
    std::vector<int32_t> ids(2 * 16);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 37 + 11) % 256);
    write_safetensors(d.file("ids.safetensors"), {{"ids", TensorView(ids.data(), DType::i32, Shape{2, 16})}});
    const std::string logits_one = final_logits(one, d.file("ids.safetensors"));
    EXPECT_FALSE(logits_one.empty());
    EXPECT_TRUE(logits_one == final_logits(many, d.file("ids.safetensors"))) << "logits of the two checkpoints differ";
}

// a hybrid with MoE whose activations are held in bf16 (train.activation_dtype): a stage's last KDA, DSA and MoE
// blocks round their own saved sets where the one process keeps bf16 copies of them, the same values
const std::string kBf16Activations = " --set train.grad_clip=0 --set train.activation_dtype=bf16" + test::kTinyHybrid +
                                     test::kTinyMoe +
                                     " --set model.n_layers=4 --set 'model.attention=[\"kda\",\"dsa\",\"kda\",\"dsa\"]'"
                                     " --set model.moe.balance=sign";

INSTANTIATE_TEST_SUITE_P(
    Runs,
    DataParallel,
    ::testing::Values(
        Layout{"dense_2", 2, ""},
        Layout{"dense_4", 4, ""},
        // two micro-batches per rank: rank r's m-th is the one process's (2m + r)-th
        Layout{"dense_2_accumulating", 2, "", 1},
        Layout{"dense_2_zero2", 2, " --set parallel.fsdp=false"},
        Layout{"dense_2_zero2_accumulating", 2, " --set parallel.fsdp=false", 1},
        // AdamW's moments in a file (memory.optimizer_offload), here and in the one process
        Layout{"dense_2_offload", 2, " --set memory.optimizer_offload=true"},
        // feed-forward units of 1.6M elements: a unit's (FSDP) or a range's (ZeRO-2) reduce-scatter runs in several
        // rounds of a piece of every rank's part (parallel::ReduceRounds: 2^19 elements at 2 ranks, 2^18 at 4)
        Layout{"wide_ffn_2", 2, " --set model.ffn_dim=16384"},
        Layout{"wide_ffn_4_zero2", 4, " --set model.ffn_dim=16384 --set parallel.fsdp=false"},
        // one FSDP unit holds the embedding and the final norm; Attention Residuals stay whole
        Layout{"tied_attn_res_4", 4, " --set model.tie_embeddings=true --set model.attn_res_block_size=1"},
        Layout{"moe_sign_2", 2, test::kTinyMoe + " --set model.moe.balance=sign"},
        // the margin histograms of every rank summed before the quantiles move the bias
        Layout{"moe_quantile_2", 2,
               test::kTinyMoe + " --set model.moe.balance=quantile --set model.moe.bias_update_rate=null"},
        Layout{"hybrid_kda_dsa_2", 2, test::kTinyHybrid},
        // only the indexers train: the other units' gradient ranges are zeros
        Layout{"dsa_warmup_2", 2, test::kTinyHybrid + " --set model.mla.dsa.stage=dense_warmup"},
        // pipeline stages (1F1B over 4 micro-batches a step): a micro-batch's gradients are the one process's bits;
        // without clipping (the gradient norm adds each stage's sum in stage order, not one process's order: the last
        // bits may differ), so the parameters too
        Layout{"pipeline_2", 2, " --set train.grad_clip=0", 1, " --set parallel.pipeline=2"},
        // 3 stages of layers {0}, {1, 2}, {3}: the first keeps 3 micro-batches' activations in flight, the middle 2;
        // or (re-running their forwards) the middle one keeps 2 inputs
        Layout{"pipeline_3_uneven", 3, " --set train.grad_clip=0 --set model.n_layers=4", 1,
               " --set parallel.pipeline=3 --set 'parallel.pipeline_split=[1,3]'"},
        Layout{"pipeline_3_uneven_rerun", 3, " --set train.grad_clip=0 --set model.n_layers=4", 1,
               " --set parallel.pipeline=3 --set 'parallel.pipeline_split=[1,3]' --set parallel.pipeline_rerun=true"},
        // 2 stages of 2 ranks: FSDP within each stage, 2 micro-batches per rank
        Layout{"pipeline_2x2_hybrid", 4, " --set train.grad_clip=0" + test::kTinyHybrid, 1,
               " --set parallel.pipeline=2"},
        // the DSA warm-up (only the indexers train), the DSA layer first: stage 0's backward from its kept activations
        // visits its indexer's unit alone
        Layout{"pipeline_2_dsa_warmup", 2,
               " --set train.grad_clip=0" + test::kTinyHybrid +
                   " --set 'model.attention=[\"dsa\",\"kda\"]' --set model.mla.dsa.stage=dense_warmup",
               1, " --set parallel.pipeline=2"},
        Layout{"pipeline_2_bf16_activations", 2, kBf16Activations, 1, " --set parallel.pipeline=2"},
        // the same, re-running each forward before its backward: only the re-run rounds (the first forward's saved
        // sets are replaced unread)
        Layout{"pipeline_2_bf16_activations_rerun", 2, kBf16Activations, 1,
               " --set parallel.pipeline=2 --set parallel.pipeline_rerun=true"},
        Layout{"pipeline_2x2_zero2_moe", 4,
               " --set train.grad_clip=0 --set parallel.fsdp=false" + test::kTinyMoe + " --set model.moe.balance=sign",
               1, " --set parallel.pipeline=2"}),
    [](const auto& info) { return std::string(info.param.name); });

// The optimizer ranges are re-cut on loading: 2 ranks -> 1 and 1 -> 2 continue the uninterrupted run's bits.
TEST(DataParallelCheckpoint, ResumesOnAnotherNumberOfRanks) {
    TempDir d;
    const std::string ref = d.file("ref"), two = d.file("two"), one = d.file("one");
    const std::string micro = " --set train.micro_batch_size=2";  // the same micro-batches on 1 and 2 ranks
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + ref + micro).status, 0);
    for (const auto& [from, to] : {std::pair{2, 1}, std::pair{1, 2}}) {
        // the step-6 checkpoint of a run on `from` ranks, continued on `to`
        const std::string full = d.file(fmt::format("full{}", from)), run = d.file(fmt::format("from{}to{}", from, to));
        const std::string args = "train --config " + kTiny + " --out " + full + micro;
        test::CliResult a = from == 1 ? run_tessera(args) : run_tessera_mpi(from, args);
        ASSERT_EQ(a.status, 0) << a.err;
        fs::create_directories(run + "/checkpoints");
        fs::copy(full + "/checkpoints/step_0000006", run + "/checkpoints/step_0000006");
        const std::string rest = "train --resume " + run;
        test::CliResult b = to == 1 ? run_tessera(rest) : run_tessera_mpi(to, rest);
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_EQ(losses(ref, 6), losses(run)) << from << " -> " << to << " ranks (steps 7-12)";
        EXPECT_TRUE(final_model(ref) == final_model(run)) << from << " -> " << to << " ranks";
    }
}

// HSDP inside each stage: 8 ranks in 2 stages of 4, each sharding over groups of 2 with 2 replicas. Two levels of sums
// (as HSDP without stages): within 1e-5 of one process.
TEST(PipelineParallel, HsdpInsideEachStage) {
    TempDir d;
    const std::string args =
        "train --config " + kTiny + " --set train.batch_size=8 --set train.micro_batch_size=1 --set train.grad_clip=0";
    ASSERT_EQ(run_tessera(args + " --out " + d.file("one")).status, 0);
    test::CliResult r =
        run_tessera_mpi(8, args + " --out " + d.file("eight") + " --set parallel.pipeline=2 --set parallel.shard=2");
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("in 2 pipeline stages of 4 ranks"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("groups of 2 ranks, 2 replicas (HSDP)"), std::string::npos) << r.out;
    expect_close_losses(d.file("one"), d.file("eight"));
}

// step -> the routing loads of every MoE layer, as written
std::map<int64_t, std::string> loads(const std::string& run_dir) {
    std::map<int64_t, std::string> out;
    std::istringstream in(read_text(run_dir + "/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
        Json j = Json::parse(line);
        if (!j.contains("moe")) continue;
        std::string l;
        for (const Json& layer : j["moe"]) l += layer["load"].dump();
        out[j["step"].get<int64_t>()] = l;
    }
    return out;
}

// Pipeline stages with expert parallelism in each (the experts of a stage's layers over its 2 ranks): the bits of the
// same expert layout without stages (expert parallelism itself matches one process within 1e-5, below). A checkpoint
// of stages resumes without them and the other way round, continuing the uninterrupted run's bits.
TEST(PipelineParallel, KeepsTheBitsOfItsExpertLayoutAndResumesAcrossLayouts) {
    TempDir d;
    const std::string moe = " --set train.grad_clip=0 --set train.micro_batch_size=1" + test::kTinyMoe +
                            " --set model.moe.balance=sign --set parallel.ep=2";
    const std::string flat = d.file("flat"), staged = d.file("staged");
    ASSERT_EQ(run_tessera_mpi(2, "train --config " + kTiny + " --out " + flat + moe).status, 0);
    test::CliResult r =
        run_tessera_mpi(4, "train --config " + kTiny + " --out " + staged + moe + " --set parallel.pipeline=2");
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("in 2 pipeline stages of 2 ranks"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("their activations kept"), std::string::npos) << r.out;
    EXPECT_EQ(losses(flat), losses(staged));
    EXPECT_EQ(loads(flat), loads(staged));
    EXPECT_TRUE(final_model(flat) == final_model(staged)) << "the final parameters differ";
    const std::string rerun = d.file("rerun");  // the first stage re-running its forwards instead
    r = run_tessera_mpi(4, "train --config " + kTiny + " --out " + rerun + moe +
                               " --set parallel.pipeline=2 --set parallel.pipeline_rerun=true");
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_NE(r.out.find("forward re-run before each backward"), std::string::npos) << r.out;
    EXPECT_EQ(losses(flat), losses(rerun));
    EXPECT_EQ(loads(flat), loads(rerun));

    // dense: 2 stages -> one process and back, from step 6
    const std::string dense = " --set train.grad_clip=0 --set train.micro_batch_size=1";
    const std::string ref = d.file("ref");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + ref + dense).status, 0);
    for (const int from : {2, 1}) {
        const std::string full = d.file(fmt::format("full{}", from)), run = d.file(fmt::format("from{}", from));
        const std::string args = "train --config " + kTiny + " --out " + full + dense;
        test::CliResult a = from == 1 ? run_tessera(args) : run_tessera_mpi(2, args + " --set parallel.pipeline=2");
        ASSERT_EQ(a.status, 0) << a.err;
        fs::create_directories(run + "/checkpoints");
        fs::copy(full + "/checkpoints/step_0000006", run + "/checkpoints/step_0000006");
        test::CliResult b = from == 2 ? run_tessera("train --resume " + run + " --set parallel.pipeline=1")
                                      : run_tessera_mpi(2, "train --resume " + run + " --set parallel.pipeline=2");
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_EQ(losses(ref, 6), losses(run)) << "from " << from << " stages (steps 7-12)";
        EXPECT_TRUE(final_model(ref) == final_model(run)) << "from " << from << " stages";
    }
}

const std::string kMoeSign = test::kTinyMoe + " --set model.moe.balance=sign";

// Expert parallelism: ep ranks per expert group, each holding experts/ep experts of every MoE layer; with
// W = 4 and ep = 2 two expert-data replicas. Against one process accumulating the same micro-batches (dropless):
// the same routing counts every step and losses within 1e-5; the same layout twice: the same bits (with a
// capacity too).
TEST(ExpertParallelTraining, MatchesOneProcessAndRepeatsBitwise) {
    TempDir d;
    // one process on the micro-batches of 2 ranks (2 sequences) and of 4 ranks (1 sequence)
    std::map<int, std::string> one;
    for (int ranks : {2, 4}) {
        one[ranks] = d.file(fmt::format("one{}", ranks));
        ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + one[ranks] +
                              " --set train.micro_batch_size=" + std::to_string(4 / ranks) + kMoeSign)
                      .status,
                  0);
    }
    for (const auto& [ranks, ep] : {std::pair{2, 2}, std::pair{4, 2}, std::pair{4, 4}}) {
        const std::string run = d.file(fmt::format("w{}ep{}", ranks, ep));
        const std::string args = "train --config " + kTiny + kMoeSign + " --set parallel.ep=" + std::to_string(ep);
        test::CliResult r = run_tessera_mpi(ranks, args + " --out " + run);
        ASSERT_EQ(r.status, 0) << r.out << r.err;
        EXPECT_NE(r.out.find(fmt::format("holds {} of 8 experts", 8 / ep)), std::string::npos) << r.out;
        expect_close_losses(one[ranks], run);
        EXPECT_EQ(loads(one[ranks]), loads(run)) << "routing counts, " << ranks << " ranks, ep " << ep;
        if (ranks == 2) {
            // With a capacity the expert group shares each expert's room (tests/parallel/test_ep.cpp has the
            // semantics); here: it trains, drops, and repeats bitwise.
            const std::string cap = " --set model.moe.capacity_factor=1.0 --set model.moe.overflow=drop";
            const std::string ep_cap = d.file("ep_cap"), ep_cap2 = d.file("ep_cap2");
            ASSERT_EQ(run_tessera_mpi(ranks, args + cap + " --out " + ep_cap).status, 0);
            ASSERT_EQ(run_tessera_mpi(ranks, args + cap + " --out " + ep_cap2).status, 0);
            EXPECT_EQ(losses(ep_cap), losses(ep_cap2)) << "capacity: the same layout twice";
            EXPECT_TRUE(std::regex_search(read_text(ep_cap + "/metrics.jsonl"), std::regex("\"dropped\":[1-9]")))
                << "the capacity dropped nothing: the test shows nothing";
        }
        if (ranks == 4 && ep == 2) {
            const std::string again = run + "-again";
            // without overlap (the exchange of all local experts at once): the same bits
            ASSERT_EQ(run_tessera_mpi(ranks, args + " --set parallel.ep_chunks=1 --out " + again).status, 0);
            EXPECT_EQ(losses(run), losses(again)) << "the same layout twice";
            EXPECT_TRUE(final_model(run) == final_model(again));
        }
    }
}

// Tensor parallelism (parallel.tensor): a tensor group's ranks take the same micro-batches, each holds 1/T of their
// tokens between attention blocks and runs 1/T of each attention block's heads. Against one process on the
// micro-batches of the tensor groups: losses and evaluations within 1e-5 (the head sum's order differs), for the dense
// tiny model and the KDA : gated DSA hybrid (the indexer's teacher: every rank's heads) on one group of 2 (FSDP), and a
// KDA + gated GQA + MoE model on 4 ranks, 2 groups of 2 with expert parallelism over pairs that cross the groups (the
// resulting checkpoint resumes on one process), and LoRA on that model's bf16 base on 2 ranks.
TEST(TensorParallelTraining, MatchesOneProcess) {
    TempDir d;
    const std::string heads = " --set model.n_kv_heads=2";
    const std::string hybrid = heads + kMoeSign +
                               " --set 'model.attention=[\"kda\",\"gqa\"]' --set model.kda.head_dim=16"
                               " --set model.output_gate=elementwise";
    const std::string lora =
        " --set model.lora.rank=4 --set model.lora.base_dtype=bf16"
        " --set 'model.lora.target_modules=[\"q_proj\",\"o_proj\",\"gate_proj\"]'";
    struct Case {
        int ranks;
        std::string sets, ranks_only;
        int micro;  // sequences per micro-batch (a tensor group's)
    };
    int i = 0;
    for (const Case& c :
         {Case{2, heads, "", 4}, Case{2, test::kTinyHybrid, "", 4},
          Case{4, hybrid, " --set parallel.ep=2 --set parallel.fsdp=false", 2}, Case{2, hybrid + lora, "", 4}}) {
        const std::string one = d.file(fmt::format("one{}", i)), many = d.file(fmt::format("tp{}", i));
        ++i;
        const std::string args =
            "train --config " + kTiny + c.sets + " --set train.micro_batch_size=" + std::to_string(c.micro);
        test::CliResult a = run_tessera(args + " --out " + one);
        ASSERT_EQ(a.status, 0) << a.err;
        test::CliResult b =
            run_tessera_mpi(c.ranks, args + " --set parallel.tensor=2" + c.ranks_only + " --out " + many);
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_NE(b.out.find("with the 2 ranks of its tensor group"), std::string::npos) << b.out;
        ASSERT_EQ(losses(one).size(), 14u);  // 12 steps, 2 evaluations
        expect_close_losses(one, many);
        if (c.ranks == 4) {  // its checkpoint of step 6 continues on one process like the 4 ranks did
            const std::string resumed = d.file("resumed");
            fs::create_directories(resumed + "/checkpoints");
            fs::copy(many + "/checkpoints/step_0000006", resumed + "/checkpoints/step_0000006");
            test::CliResult r =
                run_tessera("train --resume " + resumed + " --set parallel.tensor=1 --set parallel.ep=1");
            ASSERT_EQ(r.status, 0) << r.err;
            expect_close_losses(many, resumed, 6);
        }
    }
}

// Expert parallelism's checkpoints hold whole expert tensors and named pieces of the moments: ep 2 resumes on
// ep 2 bitwise, and on one process and on ep 4 within 1e-5.
TEST(ExpertParallelTraining, ResumesOnAnotherExpertLayout) {
    TempDir d;
    const std::string micro = " --set train.micro_batch_size=1";
    auto train = [&](int ranks, int ep, const std::string& args) {
        const std::string cmd = args + micro + kMoeSign + " --set parallel.ep=" + std::to_string(ep);
        return ranks == 1 ? run_tessera(cmd) : run_tessera_mpi(ranks, cmd);
    };
    // the step-6 checkpoints of runs at W 4 / ep 4, W 4 / ep 2 (two expert-data replicas) and one process,
    // continued on other layouts: the same layout gives the same bits, another within 1e-5 of the whole run
    const std::vector<std::pair<int, int>> sources = {{4, 4}, {4, 2}, {1, 1}};
    const std::map<std::pair<int, int>, std::vector<std::pair<int, int>>> targets = {
        {{4, 4}, {{4, 4}, {2, 2}, {1, 1}}}, {{4, 2}, {{4, 2}, {4, 4}}}, {{1, 1}, {{2, 2}, {4, 4}}}};
    for (const auto& [w, ep] : sources) {
        const std::string full = d.file(fmt::format("full_w{}ep{}", w, ep));
        ASSERT_EQ(train(w, ep, "train --config " + kTiny + " --out " + full).status, 0);
        for (const auto& [ranks, to_ep] : targets.at({w, ep})) {
            const std::string run = d.file(fmt::format("w{}ep{}_to_w{}ep{}", w, ep, ranks, to_ep));
            fs::create_directories(run + "/checkpoints");
            fs::copy(full + "/checkpoints/step_0000006", run + "/checkpoints/step_0000006");
            test::CliResult r = train(ranks, to_ep, "train --resume " + run);
            ASSERT_EQ(r.status, 0) << r.out << r.err;
            if (ranks == w && to_ep == ep) {
                EXPECT_EQ(losses(full, 6), losses(run)) << "the same layout: the same bits";
                EXPECT_TRUE(final_model(full) == final_model(run));
            } else {
                expect_close_losses(full, run, 6);
            }
        }
    }
}

// HSDP (parallel.shard = 2 on 4 ranks): the dense parameters sharded within two groups of two ranks, the groups'
// gradients all-reduced after the last micro-batch. Two levels of sums, so not one process's bits: within 1e-5 of it,
// and the same bits twice; a dense model, and the MoE model with EP2 (its experts over the expert-data group, as with
// FSDP). The dense ranges are saved once (by the first replica; a duplicate or a missing piece is a load error): the
// step-6 checkpoint resumes on the same layout with the uninterrupted run's bits, and on one process and on FSDP over
// 2 ranks within 1e-5 of it.
TEST(Hsdp, ShardsWithinGroupsAndMatchesOneProcess) {
    TempDir d;
    const std::string micro = " --set train.micro_batch_size=1";
    const std::string hsdp = micro + " --set parallel.shard=2";
    for (const std::string& model : {std::string(), kMoeSign + " --set parallel.ep=2"}) {
        const bool moe = !model.empty();
        const std::string one = d.file(fmt::format("one{}", moe)), full = d.file(fmt::format("hsdp{}", moe)),
                          again = d.file(fmt::format("again{}", moe));
        const std::string base = "train --config " + kTiny + model;
        // (EP needs ranks: the one process runs the same model without it)
        const std::string one_model = moe ? kMoeSign : std::string();
        ASSERT_EQ(run_tessera("train --config " + kTiny + one_model + micro + " --out " + one).status, 0);
        test::CliResult r = run_tessera_mpi(4, base + hsdp + " --out " + full);
        ASSERT_EQ(r.status, 0) << r.out << r.err;
        EXPECT_NE(r.out.find("sharded over groups of 2 ranks, 2 replicas (HSDP)"), std::string::npos) << r.out;
        // the same layout again, its moments offloaded (the checkpoint packs the saved pieces from the file)
        ASSERT_EQ(run_tessera_mpi(4, base + hsdp + " --set memory.optimizer_offload=true --out " + again).status, 0);
        EXPECT_EQ(losses(full), losses(again)) << "the same layout twice";
        EXPECT_TRUE(final_model(full) == final_model(again));
        for (int r = 0; r < 4; ++r) {
            const std::string file = fmt::format("/checkpoints/step_0000012/optimizer-{:05d}-of-00004.safetensors", r);
            EXPECT_TRUE(read_text(full + file) == read_text(again + file)) << file;
        }
        expect_close_losses(one, full);
        if (moe) continue;
        // resumed from step 6 on HSDP, one process, FSDP over 2 ranks (the same micro-batches on each)
        const std::string fsdp = micro + " --set parallel.shard=0";
        for (const auto& [ranks, sets] : std::vector<std::pair<int, std::string>>{{4, hsdp}, {1, fsdp}, {2, fsdp}}) {
            const std::string run = d.file(fmt::format("resume{}", ranks));
            fs::create_directories(run + "/checkpoints");
            fs::copy(full + "/checkpoints/step_0000006", run + "/checkpoints/step_0000006");
            const std::string args = "train --resume " + run + sets;
            test::CliResult b = ranks == 1 ? run_tessera(args) : run_tessera_mpi(ranks, args);
            ASSERT_EQ(b.status, 0) << ranks << " ranks: " << b.out << b.err;
            if (ranks == 4) {
                EXPECT_EQ(losses(full, 6), losses(run)) << "HSDP resumed on HSDP: the same bits";
                EXPECT_TRUE(final_model(full) == final_model(run));
            } else {
                expect_close_losses(full, run, 6);
            }
        }
    }
}

// tessera launch starts mpirun itself (threads per rank, root, oversubscription) and trains like mpirun does
TEST(Launch, RunsTheCommandAsRanks) {
    TempDir d;
    test::CliResult r = run_tessera("launch -n 2 -- train --config " + kTiny + " --out " + d.file("a"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("2 ranks (mpi)"), std::string::npos) << r.out;
    const std::string mpi = d.file("b");
    ASSERT_EQ(run_tessera_mpi(2, "train --config " + kTiny + " --out " + mpi).status, 0);
    EXPECT_EQ(losses(d.file("a")), losses(mpi));
    r = run_tessera("launch -n 2");
    EXPECT_EQ(r.status, 2) << "no command: a usage error";
}

// A checkpoint whose optimizer files do not add up is refused in one line: a rank's file missing, files of two
// layouts mixed, files that do not hold the moments
TEST(DataParallelCheckpoint, RefusesOptimizerFilesThatDoNotAddUp) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera_mpi(2, "train --config " + kTiny + " --steps 6 --out " + run).status, 0);
    const std::string ckpt = run + "/checkpoints/step_0000006/";
    const std::string r0 = ckpt + "optimizer-00000-of-00002.safetensors",
                      r1 = ckpt + "optimizer-00001-of-00002.safetensors";
    auto resume = [&](const std::string& needle) {
        test::CliResult r = run_tessera("train --resume " + run + " --steps 8");
        EXPECT_EQ(r.status, 1);
        EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
        EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    };
    fs::rename(r1, d.file("kept"));
    resume("optimizer-00001-of-00002.safetensors: missing (the checkpoint holds the optimizer files of 2 ranks)");
    fs::copy_file(r0, ckpt + "optimizer-00000-of-00001.safetensors");
    resume("optimizer files of 2 and 1 ranks");
    // one file, rank 1's of the two: a part of the moments
    fs::remove(r0);
    fs::remove(ckpt + "optimizer-00000-of-00001.safetensors");
    fs::rename(d.file("kept"), ckpt + "optimizer-00000-of-00001.safetensors");
    resume("moments this rank needs (corrupted?)");
}

// The parameters of a multi-rank checkpoint are the ranks' model files and their index: a file missing, pieces
// that do not cover the model exactly once, an index that disagrees with the model or is gone are one-line
// errors for training and inference alike.
TEST(DataParallelCheckpoint, RefusesModelFilesThatDoNotAddUp) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera_mpi(2, "train --config " + kTiny + " --steps 6 --out " + run).status, 0);
    const std::string ckpt = run + "/checkpoints/step_0000006/";
    const std::string r0 = ckpt + "model-00000-of-00002.safetensors", r1 = ckpt + "model-00001-of-00002.safetensors";
    auto refused = [&](const std::string& needle) {
        std::vector<int32_t> ids(8, 5);
        write_safetensors(d.file("ids.safetensors"), {{"ids", TensorView(ids.data(), DType::i32, Shape{1, 8})}});
        for (const std::string& cmd : {"train --resume " + run + " --steps 8",
                                       "logits --checkpoint " + ckpt + " --in " + d.file("ids.safetensors") +
                                           " --out " + d.file("l.safetensors")}) {
            test::CliResult r = run_tessera(cmd);
            EXPECT_EQ(r.status, 1) << cmd;
            EXPECT_NE(r.err.find(needle), std::string::npos) << cmd << ": " << r.err;
            EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
        }
    };
    fs::rename(r1, d.file("kept"));
    refused("model-00001-of-00002.safetensors: missing (the checkpoint holds the model files of 2 ranks)");
    fs::copy_file(r0, r1);  // rank 0's ranges twice: every element it holds found twice
    refused("the model files hold");
    fs::remove(r1);
    fs::rename(d.file("kept"), r1);
    const std::string index = ckpt + "model.index.json", text = read_text(index);
    Json j = Json::parse(text);
    j["tensors"]["model.norm.weight"]["shape"] = {7};
    write_text_atomic(index, j.dump());
    refused("tensor \"model.norm.weight\" is [7], expected [32]");
    fs::remove(index);
    refused("neither model.safetensors nor model.index.json");
    write_text_atomic(index, text);
    EXPECT_EQ(run_tessera("train --resume " + run + " --steps 8").status, 0) << "restored: the checkpoint loads";
}

// The batch and layout keys, read strictly in one process too
// Training on GPUs under mpirun (train.device = cuda): each rank's GPU buffers travel over NCCL
// (parallel/nccl_link.h), the reductions summed on the GPU in rank order. The KDA : gated DSA hybrid on 2 ranks with
// FSDP trains with the 2 CPU ranks' losses (within 1e-3, the GPU's bound), ZeRO-2 gives FSDP's bits, pipeline stages
// (of the hybrid; of an MoE model within 1e-5), expert parallelism (the MoE model at EP 2, a capacity and two expert
// groups in flight) and tensor parallelism (a LoRA fine-tune of a bf16 base) the CPU's losses, and the step-6
// checkpoint resumes on the GPUs with the uninterrupted run's bits. Skipped without a GPU for each rank; the CUDA
// emulator shows 8 (scripts/run.sh test runs it there).
bool gpu_per_rank(int ranks) { return cuda_available() && cuda_device_count() >= ranks; }

void expect_gpu_losses_near(const std::string& gpu_run, const std::string& cpu_run, double tolerance = 1e-3) {
    const auto gpu = losses(gpu_run), cpu = losses(cpu_run);
    ASSERT_EQ(gpu.size(), cpu.size());
    ASSERT_FALSE(cpu.empty());
    for (const auto& [key, text] : cpu) {
        const double c = std::stod(text), g = std::stod(gpu.at(key));
        EXPECT_NEAR(g, c, tolerance * std::abs(c)) << key.first << " at step " << key.second;
    }
}

TEST(CudaDataParallel, RanksOverNcclTrainWithTheCpusLossesAndResumeBitwise) {
    if (!gpu_per_rank(2)) GTEST_SKIP() << "no GPU for each of 2 ranks (nor the CUDA emulator)";
    TempDir d;
    auto train = [&](const std::string& name, const std::string& sets) {
        test::CliResult r = run_tessera_mpi(
            2, "train --config " + kTiny + " --set train.micro_batch_size=2 --out " + d.file(name) + sets);
        EXPECT_EQ(r.status, 0) << r.out << r.err;
        return r;
    };
    const std::string gpu = " --set train.device=cuda", hybrid = test::kTinyHybrid,
                      stages = hybrid + " --set train.grad_clip=0 --set parallel.pipeline=2",
                      experts = kMoeSign +
                                " --set parallel.ep=2 --set parallel.ep_chunks=2 --set model.moe.capacity_factor=1.0",
                      tensor =
                          " --set model.n_kv_heads=2 --set parallel.tensor=2 --set model.lora.rank=4"
                          " --set model.lora.base_dtype=bf16 --set 'model.lora.target_modules=[\"q_proj\",\"o_proj\"]'";
    train("cpu", hybrid);
    const test::CliResult fsdp = train("fsdp", hybrid + gpu);
    EXPECT_NE(fsdp.out.find("2 ranks (mpi; GPU memory over NCCL)"), std::string::npos) << fsdp.out;
    expect_gpu_losses_near(d.file("fsdp"), d.file("cpu"));
    train("zero2", hybrid + gpu + " --set parallel.fsdp=false");
    EXPECT_EQ(losses(d.file("fsdp")), losses(d.file("zero2"))) << "ZeRO-2 and FSDP sum the same bits in the same order";
    // bf16 GEMMs (memory.weight_copies, train/weight_copies.h): ZeRO-2 reads every trained GEMM weight from its bf16
    // copy, refreshed after the ranks share the updated ranges; FSDP rounds what it gathers per GEMM (the hybrid's
    // weights are all its): the same bits. Under expert parallelism with FSDP the experts, each on its rank alone, are
    // read from copies and the dense weights rounded per GEMM: the bits of rounding all per GEMM.
    const std::string bf16 = " --set train.precision=bf16", per_gemm = " --set memory.weight_copies=false";
    const std::string copies = "bf16 weight copies (memory.weight_copies): ";
    const test::CliResult zero2_bf16 = train("zero2_bf16", hybrid + gpu + bf16 + " --set parallel.fsdp=false"),
                          fsdp_bf16 = train("fsdp_bf16", hybrid + gpu + bf16);
    EXPECT_NE(zero2_bf16.out.find(copies), std::string::npos) << zero2_bf16.out;
    EXPECT_EQ(fsdp_bf16.out.find(copies), std::string::npos) << fsdp_bf16.out;
    EXPECT_EQ(losses(d.file("fsdp_bf16")), losses(d.file("zero2_bf16")));
    EXPECT_NE(losses(d.file("fsdp_bf16")), losses(d.file("fsdp"))) << "the GEMMs must round to bf16";
    const test::CliResult experts_bf16 = train("experts_bf16", experts + gpu + bf16);
    train("experts_bf16_per_gemm", experts + gpu + bf16 + per_gemm);
    EXPECT_NE(experts_bf16.out.find("what FSDP shards is rounded per GEMM"), std::string::npos) << experts_bf16.out;
    EXPECT_EQ(losses(d.file("experts_bf16")), losses(d.file("experts_bf16_per_gemm")));
    // pipeline stages (each its own weights' copies), and tensor parallelism (its sliced attention blocks rounding per
    // GEMM, the rest from copies)
    const std::string sliced = hybrid + " --set model.n_kv_heads=2 --set parallel.tensor=2";
    for (const auto& [name, sets] : {std::pair{"stages_bf16", stages}, std::pair{"tensor_bf16", sliced}}) {
        const test::CliResult r = train(name, sets + gpu + bf16 + " --set parallel.fsdp=false");
        EXPECT_NE(r.out.find(copies), std::string::npos) << r.out;
        train(name + std::string("_per_gemm"), sets + gpu + bf16 + " --set parallel.fsdp=false" + per_gemm);
        EXPECT_EQ(losses(d.file(name)), losses(d.file(name + std::string("_per_gemm")))) << name;
    }
    train("stages_cpu", stages);
    train("stages_gpu", stages + gpu);
    expect_gpu_losses_near(d.file("stages_gpu"), d.file("stages_cpu"));
    // MoE layers on the first stage, which keeps 2 of 4 micro-batches' activations: a micro-batch's backward reads
    // its own expert offsets, not the later forward's host copy (that drifted 1.6e-4 from the CPU by step 3)
    const std::string moe_stages = kMoeSign +
                                   " --set model.moe.first_dense=0 --set model.ffn_dim=null --set train.grad_clip=0"
                                   " --set parallel.pipeline=2 --set train.micro_batch_size=1";
    train("moe_stages_cpu", moe_stages);
    train("moe_stages_gpu", moe_stages + gpu);
    expect_gpu_losses_near(d.file("moe_stages_gpu"), d.file("moe_stages_cpu"), 1e-5);
    train("experts_cpu", experts);
    train("experts_gpu", experts + gpu);
    expect_gpu_losses_near(d.file("experts_gpu"), d.file("experts_cpu"));
    train("tensor_cpu", tensor);
    train("tensor_gpu", tensor + gpu);
    expect_gpu_losses_near(d.file("tensor_gpu"), d.file("tensor_cpu"));
    const std::string resumed = d.file("resumed");
    fs::create_directories(resumed + "/checkpoints");
    fs::copy(d.file("fsdp") + "/checkpoints/step_0000006", resumed + "/checkpoints/step_0000006");
    test::CliResult r = run_tessera_mpi(2, "train --resume " + resumed);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    EXPECT_EQ(losses(d.file("fsdp"), 6), losses(resumed));
    EXPECT_TRUE(final_model(d.file("fsdp")) == final_model(resumed));
}

// More ranks on a host than it has GPUs: one line before any rank starts training, nothing written. On the CUDA
// emulator it shows one device (TESSERA_CUDA_EMULATOR_DEVICES=1); on a machine with one GPU as it is.
TEST(CudaDataParallel, MoreRanksThanGpusIsAOneLineError) {
    if (!cuda_available()) GTEST_SKIP() << "no GPU (nor the CUDA emulator)";
    if (!cuda_emulated() && cuda_device_count() >= 2) GTEST_SKIP() << "a GPU for each of 2 ranks";
    TempDir d;
    if (cuda_emulated()) setenv("TESSERA_CUDA_EMULATOR_DEVICES", "1", 1);
    const test::CliResult r =
        run_tessera_mpi(2, "train --config " + kTiny + " --set train.device=cuda --out " + d.file("x"));
    unsetenv("TESSERA_CUDA_EMULATOR_DEVICES");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("train.device = cuda: 2 ranks on this host and 1 GPU; start at most one rank per GPU"),
              std::string::npos)
        << r.err;
    EXPECT_FALSE(fs::exists(d.file("x") + "/config.json")) << "a failed start leaves nothing";
}

TEST(DataParallelErrors, BatchAndLayoutKeysAreOneLineErrors) {
    TempDir d;
    const std::vector<std::pair<std::string, std::string>> cases = {
        {" --set train.grad_accum=2", "train.grad_accum is gone: train.batch_size is the global batch"},
        {" --set train.micro_batch_size=3", "train.batch_size 4 is not a multiple of train.micro_batch_size 3"},
        {" --set parallel.ep=2", "parallel.ep is set but the model has no MoE layers"},
        {" --set parallel.ep_chunks=0", "parallel.ep_chunks must be in [1, 1024]"},
        {" --set parallel.fsdp=3", "parallel.fsdp must be true or false, not 3"},
        {" --set parallel.link_delay_ns_per_byte=-1", "parallel.link_delay_ns_per_byte must be in [0, 1e6]"},
        {" --set parallel.shard=1", "parallel.shard must be 0 (every rank) or a number of ranks in [2, 1048576]"},
        {" --set parallel.fsdp=false --set parallel.shard=2",
         "parallel.shard is set but parallel.fsdp is false (ZeRO-2 has no shard groups)"},
    };
    for (const auto& [set, message] : cases) {
        test::CliResult r = run_tessera("train --config " + kTiny + " --out " + d.file("x") + set);
        EXPECT_EQ(r.status, 1) << set;
        EXPECT_NE(r.err.find(message), std::string::npos) << set << ": " << r.err;
        EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
        EXPECT_FALSE(fs::exists(d.file("x"))) << set;
    }
}

TEST(DataParallelErrors, LayoutsThatDoNotFitAreOneLineErrors) {
    TempDir d;
    test::CliResult r = run_tessera_mpi(3, "train --config " + kTiny + " --out " + d.file("a"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("train.batch_size 4 does not split over 3 ranks"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(d.file("a") + "/config.json")) << "a failed start leaves nothing";
    r = run_tessera_mpi(2, "train --config " + kTiny + " --out " + d.file("c") + kMoeSign + " --set parallel.ep=3");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("parallel.ep = 3 does not divide the 2 ranks"), std::string::npos) << r.err;
    r = run_tessera_mpi(4, "train --config " + kTiny + " --out " + d.file("d") + kMoeSign +
                               " --set model.moe.experts=6 --set parallel.ep=4");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("6 experts do not divide over 4 ranks"), std::string::npos) << r.err;
    r = run_tessera("train --config " + kTiny + " --out " + d.file("e") + kMoeSign + " --set parallel.ep=2");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("parallel.ep = 2 needs several ranks"), std::string::npos) << r.err;
    r = run_tessera("train --config " + kTiny + " --out " + d.file("f") + " --set parallel.shard=2");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("parallel.shard = 2 needs several ranks"), std::string::npos) << r.err;
    r = run_tessera_mpi(4, "train --config " + kTiny + " --out " + d.file("g") + " --set parallel.shard=3");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("parallel.shard = 3 does not divide the 4 ranks into groups of at least 2"), std::string::npos)
        << r.err;
    EXPECT_FALSE(fs::exists(d.file("g") + "/config.json")) << "a failed start leaves nothing";
    // pipeline stages
    r = run_tessera("train --config " + kTiny + " --out " + d.file("h") + " --set parallel.pipeline=2");
    test::expect_one_line_error(r, "parallel.pipeline = 2 needs several ranks", "pipeline in one process");
    r = run_tessera_mpi(3, "train --config " + kTiny + " --out " + d.file("i") + " --set parallel.pipeline=2");
    EXPECT_NE(r.err.find("parallel.pipeline = 2 does not divide the 3 ranks into stages"), std::string::npos) << r.err;
    r = run_tessera_mpi(2, "train --config " + kTiny + " --out " + d.file("j") +
                               " --set parallel.pipeline=2 --set model.tie_embeddings=true");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("pipeline stages (parallel.pipeline) cannot split a model with model.tie_embeddings"),
              std::string::npos)
        << r.err;
    EXPECT_FALSE(fs::exists(d.file("j") + "/config.json")) << "a failed start leaves nothing";
    // tensor groups
    r = run_tessera("train --config " + kTiny + " --out " + d.file("k") + " --set parallel.tensor=2");
    test::expect_one_line_error(r, "parallel.tensor = 2 needs several ranks", "tensor groups in one process");
    r = run_tessera_mpi(2, "train --config " + kTiny + " --out " + d.file("l") + " --set parallel.tensor=4");
    EXPECT_NE(r.err.find("parallel.tensor = 4 does not divide the 2 ranks into tensor groups"), std::string::npos)
        << r.err;
    r = run_tessera_mpi(2, "train --config " + kTiny + " --out " + d.file("m") + " --set parallel.tensor=2");
    EXPECT_NE(r.err.find("parallel.tensor = 2 does not divide model.n_kv_heads = 1"), std::string::npos) << r.err;
    r = run_tessera("train --config " + kTiny + " --out " + d.file("n") + " --set parallel.tensor=3");
    test::expect_one_line_error(r, "parallel.tensor = 3 does not divide train.seq_len = 32", "tokens per rank");
    r = run_tessera_mpi(4, "train --config " + kTiny + " --out " + d.file("o") +
                               " --set model.n_kv_heads=2 --set parallel.tensor=2 --set parallel.pipeline=2");
    EXPECT_NE(r.err.find("tensor parallelism (parallel.tensor = 2) with pipeline stages is not supported yet"),
              std::string::npos)
        << r.err;
    for (const char* run : {"k", "l", "m", "n", "o"})
        EXPECT_FALSE(fs::exists(d.file(run) + "/config.json")) << "a failed start leaves nothing";
}

}  // namespace
}  // namespace tessera
