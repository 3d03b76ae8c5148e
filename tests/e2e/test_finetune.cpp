// Fine-tuning a base model (train.base) with and without LoRA, through the binary: the base's weights are what
// the run starts from (with a zero learning rate its evaluation is the base's, bit for bit), LoRA checkpoints hold
// only the adapters and the base's hash and resume bitwise, a changed base is refused, and under mpirun (FSDP;
// expert parallelism with adapters on the routed experts) a fine-tune equals one process as training does.
// Hugging Face directories serve as bases too.
#include <gtest/gtest.h>

#include <filesystem>
#include <functional>
#include <set>

#include "core/config_reader.h"
#include "core/file.h"
#include "core/mxfp4.h"
#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/runtime.h"
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
const std::string kLora =
    " --set model.lora.rank=4 --set model.lora.alpha=8"
    " --set 'model.lora.target_modules=[\"q_proj\",\"k_proj\",\"v_proj\",\"o_proj\",\"gate_proj\",\"up_proj\","
    "\"down_proj\"]'";

std::string ckpt(const std::string& run, int step) { return fmt::format("{}/checkpoints/step_{:07d}", run, step); }

// a run directory `to` holding only `run`'s checkpoint at `step`: `train --resume to` continues from there
void continue_from(const std::string& run, int step, const std::string& to) {
    fs::create_directories(to + "/checkpoints");
    fs::copy(ckpt(run, step), ckpt(to, step));
}

// the last evaluation's loss, as written
std::string final_eval(const std::string& run) {
    std::string last;
    for (const auto& [key, value] : losses(run))
        if (key.first == "eval_loss") last = value;
    return last;
}

std::vector<std::string> stored_names(const std::string& file) {
    std::vector<std::string> out;
    const SafetensorsFile f(file);
    for (const auto& e : f.entries()) out.push_back(e.name);
    return out;
}

// trains the tiny base (12 steps) into dir
void train_base(const std::string& dir, const std::string& sets = "") {
    const test::CliResult r = run_tessera("train --config " + kTiny + " --out " + dir + sets);
    ASSERT_EQ(r.status, 0) << r.err;
}

TEST(FineTune, ZeroLearningRateEvaluatesTheBase) {
    // full fine-tuning and LoRA (B = 0) from the base at lr 1e-30 (no step moves a weight by an ulp): the parameters
    // are the base's, so is the evaluation
    TempDir d;
    train_base(d.file("base"));
    for (const std::string& how : {std::string(), kLora}) {
        const std::string run = d.file(how.empty() ? "full" : "lora");
        test::CliResult r =
            run_tessera("train --config " + kTiny + " --out " + run + " --steps 2 --set train.lr=1e-30" +
                        " --set train.base=" + d.file("base") + how);
        ASSERT_EQ(r.status, 0) << r.err;
        EXPECT_NE(r.out.find("fine-tuning " + ckpt(d.file("base"), 12)), std::string::npos) << r.out;
        EXPECT_EQ(final_eval(run), final_eval(d.file("base"))) << (how.empty() ? "full" : "lora");
    }
}

TEST(FineTune, LoraCheckpointsHoldTheAdaptersAndResumeBitwise) {
    TempDir d;
    train_base(d.file("base"));
    const std::string run = d.file("lora"), resumed = d.file("resumed");
    const std::string args = "train --config " + kTiny + " --set train.base=" + d.file("base") + kLora;
    test::CliResult r = run_tessera(args + " --out " + run);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("LoRA rank 4, alpha 8; the base stays frozen"), std::string::npos) << r.out;
    EXPECT_NE(final_eval(run), final_eval(d.file("base"))) << "the adapters learned nothing";
    // the adapters only, and the base they go with
    for (const std::string& name : stored_names(ckpt(run, 12) + "/model.safetensors"))
        EXPECT_TRUE(name.ends_with(".lora_A.weight") || name.ends_with(".lora_B.weight")) << name;
    EXPECT_EQ(stored_names(ckpt(run, 12) + "/model.safetensors").size(), 2u * 7u * 2u);  // 7 modules, 2 layers
    const Json st = Json::parse(read_text(ckpt(run, 12) + "/trainer_state.json"));
    EXPECT_TRUE(st.contains("base_hash") && st["base_hash"].is_number_integer());
    EXPECT_EQ(Json::parse(read_text(ckpt(run, 12) + "/config.json"))["train"]["base"], ckpt(d.file("base"), 12));
    // step 6 continued: the uninterrupted run's bits
    continue_from(run, 6, resumed);
    r = run_tessera("train --resume " + resumed);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(losses(run, 6), losses(resumed));
    EXPECT_EQ(read_text(ckpt(run, 12) + "/model.safetensors"), read_text(ckpt(resumed, 12) + "/model.safetensors"));
    // the fine-tune serves inference on its base
    r = run_tessera("generate --checkpoint " + run + " --prompt 'the ' --max-new-tokens 8");
    EXPECT_EQ(r.status, 0) << r.err;
}

TEST(FineTune, AChangedBaseIsRefused) {
    TempDir d;
    train_base(d.file("base"));
    const std::string run = d.file("lora");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 6 --set train.base=" + d.file("base") + kLora +
                          " --out " + run)
                  .status,
              0);
    // one weight of the base moves by one ulp
    const std::string file = ckpt(d.file("base"), 12) + "/model.safetensors";
    std::map<std::string, Tensor> tensors;
    {
        SafetensorsFile f(file);
        for (const auto& e : f.entries()) tensors.emplace(e.name, f.load(e.name));
    }
    float* w = tensors.at("model.layers.1.self_attn.k_proj.weight").ptr<float>();
    w[3] = std::nextafter(w[3], 1e9f);
    std::vector<NamedTensor> out;
    for (auto& [name, t] : tensors) out.push_back({name, t.view()});
    write_safetensors(file, out, {{"format", "tessera"}});
    test::expect_one_line_error(run_tessera("train --resume " + run + " --steps 8"), "has changed since the fine-tune",
                                "resume on a changed base");
    test::expect_one_line_error(run_tessera("generate --checkpoint " + run + " --prompt a"),
                                "has changed since the fine-tune", "inference on a changed base");
}

TEST(FineTune, MistakesAreOneLineErrors) {
    TempDir d;
    train_base(d.file("base"));
    const std::string base = " --set train.base=" + d.file("base");
    test::expect_one_line_error(
        run_tessera("train --config " + kTiny + base + " --set model.d_model=64 --out " + d.file("a")),
        "model.d_model = 64 but the base", "a model key that contradicts the base");
    test::expect_one_line_error(
        run_tessera("train --config " + kTiny + " --set train.base=" + d.file("nothing") + " --out " + d.file("b")),
        "no such directory", "a base that does not exist");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 2" + base + kLora + " --out " + d.file("lora")).status,
              0);
    test::expect_one_line_error(run_tessera("train --config " + kTiny + " --set train.base=" + d.file("lora") + kLora +
                                            " --out " + d.file("c")),
                                "a LoRA fine-tune itself", "a LoRA fine-tune as a base");
    test::expect_one_line_error(
        run_tessera("train --config " + kTiny + base +
                    " --set model.lora.rank=4 --set 'model.lora.target_modules=[\"qproj\"]' --out " + d.file("e")),
        "names a projection", "a target that matches nothing");
    test::expect_one_line_error(
        run_tessera("export-hf --merge-lora --checkpoint " + d.file("base") + " --out " + d.file("f")),
        "--merge-lora: ", "merging a model without adapters");
    for (const char* dir : {"a", "b", "c", "e", "f"}) EXPECT_FALSE(fs::exists(d.file(dir))) << dir << " left behind";
}

// the logits tensor `tessera logits` writes for a checkpoint or Hugging Face directory
Tensor logits_of(const std::string& source, const std::string& ids, const std::string& out) {
    const test::CliResult r = run_tessera("logits --checkpoint " + source + " --in " + ids + " --out " + out);
    EXPECT_EQ(r.status, 0) << r.err;
    return r.status == 0 ? SafetensorsFile(out).load("logits") : Tensor(DType::f32, Shape{1});
}

// export-hf --merge-lora: the base with W + s·B·A in place of every adapted weight scores like the fine-tune, for a
// Kimi-Linear-shaped hybrid (KDA, MLA with q_lora incl. the merged kv_b_proj, LatentMoE's routed and shared experts)
// and a Qwen3-Next-shaped one (GDN, gated GQA, MoE), and the first with its base held in bf16 (model.lora.base_dtype)
// and with its routed experts held in MXFP4 (model.lora.expert_dtype)
TEST(FineTune, MergedExportScoresLikeTheAdapters) {
    TempDir d;
    std::vector<int32_t> ids(2 * 16);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = int32_t((i * 37 + 11) % 256);
    write_safetensors(d.file("ids.safetensors"), {{"ids", TensorView(ids.data(), DType::i32, Shape{2, 16})}});
    const std::string all =
        " --set model.lora.rank=4 --set 'model.lora.target_modules=[\"q_a_proj\",\"q_b_proj\",\"q_proj\","
        "\"kv_a_proj_with_mqa\",\"kv_b_proj\",\"o_proj\",\"k_proj\",\"v_proj\",\"g_proj\",\"f_a_proj\","
        "\"a_proj\",\"f_b_proj\",\"b_proj\",\"g_a_proj\",\"g_b_proj\",\"gate_proj\",\"up_proj\","
        "\"down_proj\"]'";
    const std::string bf16 = " --set model.lora.base_dtype=bf16";
    const std::string mxfp4 = " --set model.moe.ffn_dim=32 --set model.lora.expert_dtype=mxfp4";
    for (const auto& [arch, held] :
         {std::pair{test::kTinyKimiLinear, std::string()}, std::pair{test::kTinyQwen3Next, std::string()},
          std::pair{test::kTinyKimiLinear, bf16},
          std::pair{test::kTinyKimiLinear + " --set model.moe.ffn_dim=32", mxfp4}}) {
        SCOPED_TRACE(arch + held);
        const std::string base = d.file("base"), lora = d.file("lora"), hf = d.file("hf");
        fs::remove_all(base);
        fs::remove_all(lora);
        fs::remove_all(hf);
        train_base(base, arch + " --steps 6");
        ASSERT_EQ(
            run_tessera("train --config " + kTiny + arch + " --set train.base=" + base + all + held + " --out " + lora)
                .status,
            0);
        // every adapter has PEFT's form (the routed experts' stacked, Qwen3-Next's fused projections one module
        // each): the PEFT export, read on the f32 base, scores like the fine-tune bit for bit (a narrowed base's
        // fine-tune computes with its narrowed values)
        test::CliResult r = run_tessera("export-hf --checkpoint " + lora + " --out " + hf);
        ASSERT_EQ(r.status, 0) << r.err;
        if (held.empty()) {
            EXPECT_TRUE(
                test::bitwise_equal(logits_of(hf, d.file("ids.safetensors"), d.file("p.safetensors")).view(),
                                    logits_of(lora, d.file("ids.safetensors"), d.file("q.safetensors")).view()));
        }
        fs::remove_all(hf);
        r = run_tessera("export-hf --merge-lora --checkpoint " + lora + " --out " + hf);
        ASSERT_EQ(r.status, 0) << r.err;
        const Tensor want = logits_of(lora, d.file("ids.safetensors"), d.file("a.safetensors"));
        const Tensor got = logits_of(hf, d.file("ids.safetensors"), d.file("b.safetensors"));
        const Tensor plain = logits_of(base, d.file("ids.safetensors"), d.file("c.safetensors"));
        EXPECT_TRUE(test::rel_rms_close(got.view(), want.view(), 1e-5));
        EXPECT_FALSE(test::rel_rms_close(plain.view(), want.view(), 1e-4)) << "the adapters changed nothing";
    }
}

// A run config at `path` fine-tuning the Hugging Face base `hf` (vocabulary 64) for 3 steps of `batch` sequences of
// 16 tokens, on a token file it writes beside it
void write_hf_run(TempDir& d, const std::string& hf, int64_t batch, const std::string& path) {
    std::vector<uint16_t> ids(4000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t((i * 11 + i / 7) % 64);
    write_safetensors(d.file("ids.safetensors"),
                      {{"tokens", TensorView(ids.data(), DType::u16, Shape{int64_t(ids.size())})}},
                      {{"vocab_size", "64"}});
    write_text_atomic(path, Json{{"train",
                                  {{"seq_len", 16},
                                   {"batch_size", batch},
                                   {"steps", 3},
                                   {"eval_interval", 0},
                                   {"eval_batches", 1},
                                   {"checkpoint_interval", 0},
                                   {"base", hf}}},
                                 {"data", {{"path", d.file("ids.safetensors")}}}}
                                .dump());
}

// A LoRA fine-tune of a Hugging Face base exported as PEFT writes (export-hf without --merge-lora): the directory
// scores like the fine-tune when read back on its base (routed experts' adapters in PEFT's stacked form too), PEFT
// directories serve as bases (stacked experts under expert parallelism too), modules_to_save included
TEST(FineTune, PeftExportScoresLikeTheFineTune) {
    TempDir d;
    const std::string hf = test::golden_path("hf/deepseek_v32_tiny");
    write_hf_run(d, hf, 2, d.file("run.json"));
    const std::string lora =
        " --set model.lora.rank=2 --set 'model.lora.target_modules=[\"q_a_proj\",\"kv_b_proj\",\"o_proj\"]'";
    ASSERT_EQ(run_tessera("train --config " + d.file("run.json") + lora + " --out " + d.file("run")).status, 0);
    test::CliResult r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("peft"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("PEFT LoRA adapters of rank 2"), std::string::npos) << r.out;
    const Json conf = Json::parse(read_text(d.file("peft/adapter_config.json")));
    EXPECT_EQ(conf["peft_type"], "LORA");
    EXPECT_EQ(conf["base_model_name_or_path"], fs::absolute(hf).lexically_normal().string());
    EXPECT_EQ(conf["target_modules"].size(), 9u);  // three modules in each of three layers
    std::vector<int32_t> in(2 * 16);
    for (size_t i = 0; i < in.size(); ++i) in[i] = int32_t((i * 5 + 3) % 64);
    write_safetensors(d.file("in.safetensors"), {{"ids", TensorView(in.data(), DType::i32, Shape{2, 16})}});
    EXPECT_TRUE(
        test::bitwise_equal(logits_of(d.file("peft"), d.file("in.safetensors"), d.file("a.safetensors")).view(),
                            logits_of(d.file("run"), d.file("in.safetensors"), d.file("b.safetensors")).view()));
    // a PEFT directory as the base: its adapters train on (lr 1e-30: the directory's own logits, bit for bit)
    const std::string peft = test::golden_path("hf/deepseek_v32_tiny_peft");
    Json cont = Json::parse(read_text(d.file("run.json")));
    cont["train"]["base"] = peft;
    write_text_atomic(d.file("cont.json"), cont.dump());
    r = run_tessera("train --config " + d.file("cont.json") + " --set train.lr=1e-30 --out " + d.file("cont"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("LoRA rank 2, alpha 3"), std::string::npos) << r.out;
    EXPECT_TRUE(test::bitwise_equal(logits_of(d.file("cont"), d.file("in.safetensors"), d.file("c.safetensors")).view(),
                                    logits_of(peft, d.file("in.safetensors"), d.file("d.safetensors")).view()));
    test::expect_one_line_error(
        run_tessera("train --config " + d.file("cont.json") + " --set model.lora.rank=4 --out " + d.file("cont2")),
        "model.lora.rank = 4 but the base", "other adapters over a PEFT base");
    // PEFT's stacked expert adapters as the base under two EP ranks (each rank's slice of every expert's A and B):
    // one process's losses
    cont["train"]["base"] = test::golden_path("hf/deepseek_v32_tiny_peft_experts");
    cont["train"]["micro_batch_size"] = 1;
    write_text_atomic(d.file("experts.json"), cont.dump());
    r = run_tessera("train --config " + d.file("experts.json") + " --out " + d.file("ex_one"));
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera_mpi(2,
                        "train --config " + d.file("experts.json") + " --set parallel.ep=2 --out " + d.file("ex_ep2"));
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    expect_close_losses(d.file("ex_one"), d.file("ex_ep2"));
    // adapters on only the routed experts' gate_proj: PEFT's stacked gate_up_proj at rank r (up's rows of B zero),
    // scoring like the fine-tune
    ASSERT_EQ(run_tessera("train --config " + d.file("run.json") +
                          " --set model.lora.rank=2 --set 'model.lora.target_modules=[\"experts.gate_proj\"]' --out " +
                          d.file("experts"))
                  .status,
              0);
    r = run_tessera("export-hf --checkpoint " + d.file("experts") + " --out " + d.file("p2"));
    ASSERT_EQ(r.status, 0) << r.err;
    const Json stacked = Json::parse(read_text(d.file("p2/adapter_config.json")));
    EXPECT_EQ(stacked["target_parameters"],
              (Json{"model.layers.1.mlp.experts.gate_up_proj", "model.layers.2.mlp.experts.gate_up_proj"}));
    EXPECT_TRUE(stacked["rank_pattern"].empty());
    EXPECT_TRUE(
        test::bitwise_equal(logits_of(d.file("p2"), d.file("in.safetensors"), d.file("e.safetensors")).view(),
                            logits_of(d.file("experts"), d.file("in.safetensors"), d.file("f.safetensors")).view()));
    // modules trained whole (modules_to_save) are written under their transformers names and listed in the config;
    // the directory scores like the fine-tune, and the norm's trained copy changed (its whole weight trained)
    ASSERT_EQ(run_tessera("train --config " + d.file("run.json") + lora +
                          " --set 'model.lora.modules_to_save=[\"lm_head\",\"model.norm\"]' --out " + d.file("saved"))
                  .status,
              0);
    r = run_tessera("export-hf --checkpoint " + d.file("saved") + " --out " + d.file("p3"));
    ASSERT_EQ(r.status, 0) << r.err;
    const Json saved = Json::parse(read_text(d.file("p3/adapter_config.json")));
    EXPECT_EQ(saved["modules_to_save"], (Json{"lm_head", "model.norm"}));
    const SafetensorsFile p3(d.file("p3/adapter_model.safetensors"));
    ASSERT_TRUE(p3.contains("base_model.model.model.norm.weight"));
    const SafetensorsFile base_weights(hf + "/model.safetensors");
    EXPECT_FALSE(test::bitwise_equal(p3.load("base_model.model.model.norm.weight").view(),
                                     base_weights.load("model.norm.weight").view()));
    EXPECT_TRUE(
        test::bitwise_equal(logits_of(d.file("p3"), d.file("in.safetensors"), d.file("g.safetensors")).view(),
                            logits_of(d.file("saved"), d.file("in.safetensors"), d.file("h.safetensors")).view()));
}

// inspect --set model.lora...: what LoRA trains and its training state, before any run
TEST(FineTune, InspectCountsWhatLoraTrains) {
    const test::CliResult r = run_tessera("inspect " + kTiny + kLora);
    ASSERT_EQ(r.status, 0) << r.err;
    // per layer r·(in + out): q 4·64, k 4·48, v 4·48, o 4·64, gate and up 4·96, down 4·96; two layers
    EXPECT_NE(r.out.find("LoRA rank 4 (alpha 8) on 14 modules: 4.1 K parameters train"), std::string::npos) << r.out;
    test::expect_one_line_error(run_tessera("inspect " + kTiny + " --set train.lr=1"), "model.* values only",
                                "a train key to inspect");
}

// Under mpirun a fine-tune is training like any other: W = 2 with FSDP gives one process's bits (dense), and
// expert parallelism (adapters on the routed experts living with them) one process's losses within 1e-5.
TEST(FineTune, UnderMpiEqualsOneProcess) {
    TempDir d;
    const std::string micro = " --set train.micro_batch_size=2";
    train_base(d.file("dense"));
    // with dropout: the masks are the micro-batch's place in the step, not the rank's
    const std::string dense = "train --config " + kTiny + micro + " --set train.base=" + d.file("dense") + kLora +
                              " --set model.lora.dropout=0.1";
    test::CliResult a = run_tessera(dense + " --out " + d.file("one")),
                    b = run_tessera_mpi(2, dense + " --out " + d.file("two"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    EXPECT_NE(b.out.find("(FSDP)"), std::string::npos) << b.out;
    EXPECT_NE(b.out.find("params.shard.frozen"), std::string::npos) << "the frozen base is sharded too: " << b.out;
    EXPECT_EQ(losses(d.file("one")), losses(d.file("two")));
    EXPECT_EQ(stored_names(ckpt(d.file("one"), 12) + "/model.safetensors").size(), 28u);
    // an MoE base; adapters on attention, the shared expert and every routed expert
    const std::string moe = test::kTinyMoe + " --set model.moe.balance=sign";
    train_base(d.file("moe"), moe);
    const std::string ft =
        "train --config " + kTiny + " --set train.micro_batch_size=1 --set train.base=" + d.file("moe") + kLora;
    a = run_tessera(ft + " --out " + d.file("moe_one"));
    b = run_tessera_mpi(2, ft + " --set parallel.ep=2 --out " + d.file("moe_ep2"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    EXPECT_NE(b.out.find("holds 4 of 8 experts"), std::string::npos) << b.out;
    expect_close_losses(d.file("moe_one"), d.file("moe_ep2"));
    // the W-rank checkpoint resumes in one process
    const std::string resumed = d.file("moe_resumed");
    continue_from(d.file("moe_ep2"), 6, resumed);
    a = run_tessera("train --resume " + resumed + " --set parallel.ep=1");
    ASSERT_EQ(a.status, 0) << a.err;
    expect_close_losses(d.file("moe_one"), resumed, 6);
}

// Frozen experts shared by expert-data replicas (W / ep > 1) are cut over them like the dense base
// (params.shard.frozen_experts): two ranks without EP (f32 and MXFP4-held experts, the MXFP4 ranges whole blocks) give
// one process's bits and their checkpoint resumes in one process (the base hash counts each element once); four ranks
// at EP 2 train like one process
TEST(FineTune, FrozenExpertsAreCutOverTheirReplicas) {
    TempDir d;
    train_base(d.file("moe"), test::kTinyMoe + " --set model.moe.balance=sign");
    const std::string ft =
        "train --config " + kTiny + " --set train.micro_batch_size=1 --set train.base=" + d.file("moe") + kLora;
    for (const std::string held : {"", " --set model.lora.expert_dtype=mxfp4"}) {
        SCOPED_TRACE(held);
        fs::remove_all(d.file("one"));
        fs::remove_all(d.file("two"));
        fs::remove_all(d.file("resumed"));
        const test::CliResult a = run_tessera(ft + held + " --out " + d.file("one"));
        const test::CliResult b = run_tessera_mpi(2, ft + held + " --out " + d.file("two"));
        ASSERT_EQ(a.status, 0) << a.err;
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_NE(b.out.find("params.shard.frozen_experts"), std::string::npos) << b.out;
        EXPECT_EQ(losses(d.file("one")), losses(d.file("two")));
        const std::string resumed = d.file("resumed");
        continue_from(d.file("two"), 6, resumed);
        const test::CliResult c = run_tessera("train --resume " + resumed);
        ASSERT_EQ(c.status, 0) << c.err;
        EXPECT_EQ(losses(d.file("one"), 6), losses(resumed));
    }
    // one process against four ranks at EP 2 (each EP slice shared by two replicas)
    auto four_ranks_like_one = [&](const std::string& run, const std::string& name) {
        const test::CliResult a = run_tessera(run + " --out " + d.file(name + "_one"));
        const test::CliResult b = run_tessera_mpi(4, run + " --set parallel.ep=2 --out " + d.file(name + "_four"));
        ASSERT_EQ(a.status, 0) << a.err;
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_NE(b.out.find("params.shard.frozen_experts"), std::string::npos) << b.out;
        expect_close_losses(d.file(name + "_one"), d.file(name + "_four"));
    };
    four_ranks_like_one(ft, "ep");
    // a Hugging Face base (per-expert tensors): each rank reads its EP slice of the experts and keeps its range
    write_hf_run(d, test::golden_path("hf/deepseek_v32_tiny"), 4, d.file("hf.json"));
    four_ranks_like_one("train --config " + d.file("hf.json") +
                            " --set train.micro_batch_size=1 --set model.lora.rank=2 --set "
                            "'model.lora.target_modules=[\"o_proj\",\"experts.down_proj\"]'",
                        "hf");
}

// model.lora.base_dtype = bf16 (the frozen GEMM weights held in bf16): a dense base under FSDP on two ranks gives one
// process's bits, its W = 2 checkpoint resumes in one process bitwise, the result stays near the f32 base's (the
// base rounded to bf16), and it generates; an MoE base's bf16 experts under expert parallelism train like one
// process (merging a bf16 base: MergedExportScoresLikeTheAdapters)
TEST(FineTune, ABf16BaseShardsAndResumes) {
    TempDir d;
    train_base(d.file("base"));
    const std::string args =
        "train --config " + kTiny + " --set train.micro_batch_size=2 --set train.base=" + d.file("base") + kLora;
    const std::string bf16 = " --set model.lora.base_dtype=bf16";
    test::CliResult a = run_tessera(args + bf16 + " --out " + d.file("one")),
                    b = run_tessera_mpi(2, args + bf16 + " --out " + d.file("two")),
                    f = run_tessera(args + " --out " + d.file("f32"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    ASSERT_EQ(f.status, 0) << f.err;
    EXPECT_NE(b.out.find("params.shard.frozen"), std::string::npos) << b.out;
    EXPECT_EQ(losses(d.file("one")), losses(d.file("two")));
    EXPECT_NE(losses(d.file("one")), losses(d.file("f32")));
    for (const auto& [key, value] : losses(d.file("f32")))
        EXPECT_NEAR(std::stod(losses(d.file("one")).at(key)), std::stod(value), 2e-2) << key.first << " " << key.second;
    const std::string resumed = d.file("resumed");
    continue_from(d.file("two"), 6, resumed);
    a = run_tessera("train --resume " + resumed);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_EQ(losses(d.file("one"), 6), losses(resumed));
    a = run_tessera("generate --checkpoint " + d.file("one") + " --prompt 'the ' --max-new-tokens 8");
    EXPECT_EQ(a.status, 0) << a.err;
    // an MoE base: bf16 routed and shared experts, adapters on every routed expert, two EP ranks
    train_base(d.file("moe"), test::kTinyMoe + " --set model.moe.balance=sign");
    const std::string ft =
        "train --config " + kTiny + " --set train.micro_batch_size=1 --set train.base=" + d.file("moe") + kLora + bf16;
    a = run_tessera(ft + " --out " + d.file("moe_one"));
    b = run_tessera_mpi(2, ft + " --set parallel.ep=2 --out " + d.file("moe_ep2"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    expect_close_losses(d.file("moe_one"), d.file("moe_ep2"));
}

// model.lora.expert_dtype = mxfp4 (the frozen routed experts held in MXFP4, quantised from the f32 base on load): two
// EP ranks train like one process, a checkpoint resumes bitwise (the base hash is the held values'), and the losses
// stay near the f32-held base's
TEST(FineTune, Mxfp4ExpertsTrainUnderExpertParallelismAndResume) {
    TempDir d;
    train_base(d.file("moe"), test::kTinyMoe + " --set model.moe.balance=sign");
    const std::string ft =
        "train --config " + kTiny + " --set train.micro_batch_size=1 --set train.base=" + d.file("moe") + kLora;
    const std::string mxfp4 = " --set model.lora.expert_dtype=mxfp4";
    test::CliResult a = run_tessera(ft + mxfp4 + " --out " + d.file("one")),
                    b = run_tessera_mpi(2, ft + mxfp4 + " --set parallel.ep=2 --out " + d.file("ep2")),
                    f = run_tessera(ft + " --out " + d.file("f32"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    ASSERT_EQ(f.status, 0) << f.err;
    expect_close_losses(d.file("one"), d.file("ep2"));
    EXPECT_NE(losses(d.file("one")), losses(d.file("f32")));
    for (const auto& [key, value] : losses(d.file("f32")))
        EXPECT_NEAR(std::stod(losses(d.file("one")).at(key)), std::stod(value), 0.1) << key.first << " " << key.second;
    const std::string resumed = d.file("resumed");
    continue_from(d.file("one"), 6, resumed);
    a = run_tessera("train --resume " + resumed);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_EQ(losses(d.file("one"), 6), losses(resumed));
    a = run_tessera("inspect " + kTiny + test::kTinyMoe + kLora + mxfp4);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_NE(a.out.find("routed experts in mxfp4"), std::string::npos) << a.out;
}

// memory.weights_budget: the frozen base read in place from its files (tessera dense and MoE bases, a Hugging Face
// directory) trains bitwise as the resident base does, while the resident share of it is held to the budget after
// every unit, in one process and on two ranks with FSDP (sharding what trains) or without alike, and under expert
// parallelism like one process; mistakes are one-line errors
TEST(FineTune, AWeightBudgetReadsTheBaseInPlaceAndTrainsAsTheResidentBase) {
    TempDir d;
    const std::string wide = " --set model.d_model=128 --set model.ffn_dim=512";  // units of several pages
    train_base(d.file("dense"), wide);
    train_base(d.file("moe"), wide + test::kTinyMoe);
    const std::string budget = " --set memory.weights_budget=1";
    for (const std::string& base : {d.file("dense"), d.file("moe")}) {
        const std::string args = "train --config " + kTiny + wide + " --set train.base=" + base + kLora;
        const test::CliResult a = run_tessera(args + " --out " + base + "_resident"),
                              b = run_tessera(args + budget + " --out " + base + "_budget");
        ASSERT_EQ(a.status, 0) << a.err;
        ASSERT_EQ(b.status, 0) << b.err;
        EXPECT_NE(b.out.find("of the frozen base read in place from its files, 1.0 MiB resident at most"),
                  std::string::npos)
            << b.out;
        EXPECT_EQ(losses(base + "_resident"), losses(base + "_budget"));
        int64_t steps = 0;
        for_each_line(read_text(base + "_budget/metrics.jsonl"), [&](std::string_view line, size_t) {
            const Json rec = Json::parse(line);
            if (!rec.contains("weights")) return;
            ++steps;
            EXPECT_LE(rec["weights"]["resident_bytes"].get<int64_t>(), int64_t(1) << 20) << line;
            EXPECT_GT(rec["weights"]["released_bytes"].get<int64_t>(), 0) << line;
        });
        EXPECT_EQ(steps, 12);
        // step 6 continued under the budget: the uninterrupted run's bits
        const std::string resumed = base + "_resumed";
        continue_from(base + "_budget", 6, resumed);
        const test::CliResult c = run_tessera("train --resume " + resumed);
        ASSERT_EQ(c.status, 0) << c.err;
        EXPECT_EQ(losses(base + "_budget", 6), losses(resumed));
    }
    // a Hugging Face directory's plain tensors, read in place
    const std::string hf = test::golden_path("hf/qwen3_next_tiny");
    std::vector<uint16_t> ids(4000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t((i * 7 + i / 13) % 64);
    write_safetensors(d.file("ids.safetensors"),
                      {{"tokens", TensorView(ids.data(), DType::u16, Shape{int64_t(ids.size())})}},
                      {{"vocab_size", "64"}});
    write_text_atomic(
        d.file("run.json"),
        Json{{"train", {{"seq_len", 16}, {"batch_size", 2}, {"steps", 3}, {"eval_batches", 1}, {"base", hf}}},
             {"data", {{"path", d.file("ids.safetensors")}}}}
            .dump());
    const std::string args = "train --config " + d.file("run.json") +
                             " --set model.lora.rank=2 --set 'model.lora.target_modules=[\"q_proj\",\"o_proj\"]'";
    test::CliResult a = run_tessera(args + " --out " + d.file("hf_resident")),
                    b = run_tessera(args + budget + " --out " + d.file("hf_budget"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_EQ(losses(d.file("hf_resident")), losses(d.file("hf_budget")));
    test::expect_one_line_error(run_tessera("train --config " + kTiny + budget + " --out " + d.file("e1")),
                                "memory.weights_budget needs a LoRA fine-tune of a base", "a budget without a base");
    test::expect_one_line_error(run_tessera("train --config " + kTiny + wide + " --set train.base=" + d.file("dense") +
                                            kLora + " --set memory.weights_budget=-1 --out " + d.file("e3")),
                                "memory.weights_budget must be a number of MiB >= 0", "a negative budget");
    // two ranks, each reading the base in place, with FSDP sharding what trains and without (ZeRO-2): one process's
    // bits; an MoE base under two EP ranks (each its experts' slice of the file) like one process
    const std::string two = "train --config " + kTiny + wide +
                            " --set train.micro_batch_size=2 --set train.base=" + d.file("dense") + kLora + budget;
    a = run_tessera(two + " --out " + d.file("z_one"));
    ASSERT_EQ(a.status, 0) << a.err;
    for (const char* fsdp : {"true", "false"}) {
        b = run_tessera_mpi(2, two + " --set parallel.fsdp=" + fsdp + " --out " + d.file(std::string("z_") + fsdp));
        ASSERT_EQ(b.status, 0) << b.out << b.err;
        EXPECT_EQ(b.out.find("params.shard.frozen"), std::string::npos) << "the base is read, not sharded: " << b.out;
        EXPECT_EQ(b.out.find("(FSDP)") != std::string::npos, std::string(fsdp) == "true") << b.out;
        EXPECT_EQ(losses(d.file("z_one")), losses(d.file(std::string("z_") + fsdp))) << "fsdp " << fsdp;
    }
    const std::string ep = "train --config " + kTiny + wide + test::kTinyMoe +
                           " --set train.micro_batch_size=1 --set train.base=" + d.file("moe") + kLora + budget;
    a = run_tessera(ep + " --out " + d.file("ep_one"));
    b = run_tessera_mpi(2, ep + " --set parallel.ep=2 --out " + d.file("ep_two"));
    ASSERT_EQ(a.status, 0) << a.err;
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    expect_close_losses(d.file("ep_one"), d.file("ep_two"));
}

// memory.weights_budget on a Hugging Face base that stores its routed experts one tensor per expert (as export-hf
// writes Qwen3-Next in f32 and in bf16, held as bf16, and Kimi-Linear): every expert is read in place from its own
// tensor (the mapped bytes cover them all), the budget holds with pieces released, and the losses are the resident
// run's bit for bit; two EP ranks, each mapping its experts, train like one process, two FSDP ranks bit for bit
TEST(FineTune, AWeightBudgetReadsExpertsStoredOneTensorEachInPlace) {
    TempDir d;
    const int64_t F = 128, L = 128;
    const std::string wide = fmt::format(
        " --set model.d_model={} --set model.moe.experts=8 --set model.moe.ffn_dim={} --set model.moe.topk=2", L, F);
    const std::string qwen = test::kTinyQwen3Next + wide,
                      kimi = test::kTinyKimiLinear + wide + " --set model.moe.shared_ffn_dim=256";
    for (const auto& [arch, dtype] : {std::pair{qwen, std::string("f32")}, std::pair{qwen, std::string("bf16")},
                                      std::pair{kimi, std::string("f32")}}) {
        SCOPED_TRACE(arch + " " + dtype);
        const std::string base = d.file("base"), hf = d.file("hf"), resident = d.file("resident"),
                          budget = d.file("budget");
        for (const std::string& dir : {base, hf, resident, budget}) fs::remove_all(dir);
        train_base(base, arch + " --steps 2");
        test::CliResult r = run_tessera("export-hf --checkpoint " + base + " --out " + hf + " --dtype " + dtype);
        ASSERT_EQ(r.status, 0) << r.err;
        int64_t expert_tensors = 0;  // one per expert and projection
        const Json index = Json::parse(read_text(hf + "/model.safetensors.index.json"));
        for (const auto& [name, file] : index["weight_map"].items())
            if (name.find(".experts.") != std::string::npos) ++expert_tensors;
        ASSERT_GT(expert_tensors, 0);
        const std::string args = "train --config " + kTiny + arch +
                                 " --set train.micro_batch_size=1 --set train.base=" + hf +
                                 " --set model.lora.base_dtype=" + dtype + kLora;
        r = run_tessera(args + " --out " + resident);
        ASSERT_EQ(r.status, 0) << r.err;
        r = run_tessera(args + " --set memory.weights_budget=1 --out " + budget);
        ASSERT_EQ(r.status, 0) << r.err;
        EXPECT_EQ(losses(resident), losses(budget));
        const int64_t expert_bytes = expert_tensors * F * L * (dtype == "f32" ? 4 : 2);
        int64_t steps = 0;
        for_each_line(read_text(budget + "/metrics.jsonl"), [&](std::string_view line, size_t) {
            const Json rec = Json::parse(line);
            if (!rec.contains("weights")) return;
            ++steps;
            EXPECT_GE(rec["weights"]["mapped_bytes"].get<int64_t>(), expert_bytes) << line;
            EXPECT_LE(rec["weights"]["resident_bytes"].get<int64_t>(), int64_t(1) << 20) << line;
            EXPECT_GT(rec["weights"]["released_bytes"].get<int64_t>(), 0) << line;
        });
        EXPECT_EQ(steps, 12);
        if (arch != qwen || dtype != "f32") continue;
        r = run_tessera_mpi(2, args + " --set memory.weights_budget=1 --set parallel.ep=2 --out " + d.file("ep2"));
        ASSERT_EQ(r.status, 0) << r.out << r.err;
        expect_close_losses(budget, d.file("ep2"));
        r = run_tessera_mpi(2,
                            args + " --set memory.weights_budget=1 --set parallel.fsdp=true --out " + d.file("fsdp2"));
        ASSERT_EQ(r.status, 0) << r.out << r.err;
        EXPECT_EQ(losses(budget), losses(d.file("fsdp2")));
    }
}

// Rewrites safetensors file `from` into `to` (may be the same), each tensor loaded and passed to edit first; the
// metadata is kept but for the checksum, which the write recomputes.
void rewrite_tensors(const std::string& from,
                     const std::string& to,
                     const std::function<void(const std::string&, Tensor&)>& edit) {
    std::vector<Tensor> owned;
    std::vector<NamedTensor> out;
    std::map<std::string, std::string> meta;
    {
        const SafetensorsFile f(from);
        for (const auto& e : f.entries()) owned.push_back(f.load(e.name));
        size_t k = 0;
        for (const auto& e : f.entries()) {
            edit(e.name, owned[k]);
            out.push_back({e.name, owned[k++].view()});
        }
        meta = f.metadata();
        meta.erase("crc32c");
    }
    write_safetensors(to, out, meta);
}

// A tiny Kimi K3 with its image tower (patches of 3x2x2 pixels, 2x2 merge) whose image token is `image_token`
model::ModelConfig tiny_k3(int64_t vocab, int64_t image_token) {
    return model::parse_model_config(Json::parse(fmt::format(R"({{
        "vocab_size": {}, "d_model": 32, "n_layers": 3, "n_heads": 2, "ffn_dim": 48, "attn_res_block_size": 2,
        "attention": ["kda", "kda", "mla"],
        "kda": {{"head_dim": 16, "gate_lower_bound": -5.0, "full_rank_output_gate": true, "o_norm_eps": 1e-6}},
        "mla": {{"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 8}},
        "moe": {{"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 16, "first_dense": 1}},
        "vision": {{"layers": 2, "width": 16, "heads": 2, "head_dim": 8, "ffn_dim": 32, "patch_size": 2,
                   "pos_height": 4, "pos_width": 4, "image_token": {}}}}})",
                                                             vocab, image_token)),
                                     "tiny k3");
}

// A 4-step fine-tune of `base` (sequences of 16, batches of 2, evaluation and checkpoints every 2 steps)
Json k3_run(const std::string& base, const Json& data) {
    return {{"train",
             {{"seq_len", 16},
              {"batch_size", 2},
              {"steps", 4},
              {"eval_interval", 2},
              {"eval_batches", 2},
              {"checkpoint_interval", 2},
              {"base", base}}},
            {"data", data}};
}

// Kimi K3's routed experts come in MXFP4 (export-hf --expert-dtype mxfp4 writes that layout; the reading side is
// checked on hand-packed bytes in test_hf_checkpoint): a LoRA fine-tune of such a base with the experts held in MXFP4
// trains bit for bit as one whose f32 experts are quantised on load. Under memory.weights_budget they are read in
// place in the checkpoint's layout (packed values and scales, two pieces an expert) instead of copied into the arena:
// the mapped bytes grow by exactly theirs (17 bytes a block of 32), the budget holds with pieces released, and the
// losses are the resident run's bit for bit, in one process and on two EP ranks; a NaN scale is refused in one line
// as the resident load refuses it. A merged export writes dense experts without the base's quantization_config.
TEST(FineTune, AWeightBudgetReadsMxfp4ExpertsInTheCheckpointsLayout) {
    TempDir d;
    const std::string arch = test::kTinyKimiLinear +
                             " --set model.d_model=128 --set model.moe.experts=8 --set model.moe.ffn_dim=128"
                             " --set model.moe.topk=2 --set model.moe.shared_ffn_dim=256";
    const std::string hf = d.file("hf"), hf32 = d.file("hf32");
    train_base(d.file("base"), arch + " --steps 2");
    test::CliResult r = run_tessera("export-hf --checkpoint " + d.file("base") + " --out " + hf32);
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera("export-hf --checkpoint " + d.file("base") + " --out " + hf + " --expert-dtype mxfp4");
    ASSERT_EQ(r.status, 0) << r.err;
    int64_t values = 0;  // the MXFP4 experts' values (weight_packed: two a byte)
    const Json index = Json::parse(read_text(hf + "/model.safetensors.index.json"));
    for (const auto& [name, file] : index["weight_map"].items()) {
        if (name.find(".experts.") == std::string::npos) continue;
        EXPECT_FALSE(name.ends_with(".weight")) << name;
        if (name.ends_with(".weight_packed"))
            values += 2 * SafetensorsFile(hf + "/" + file.get<std::string>()).entry(name).shape.numel();
    }
    ASSERT_EQ(values, 2 * 8 * 3 * 128 * 128);  // the MoE layers (first_dense = 1) × experts × w1, w2, w3
    EXPECT_EQ(Json::parse(read_text(hf + "/config.json"))["quantization_config"]["format"], "mxfp4-pack-quantized");
    // experts whose rows are not whole blocks of 32 values (ffn_dim 16) cannot be written in MXFP4
    train_base(d.file("narrow"), test::kTinyKimiLinear + " --steps 1");
    test::expect_one_line_error(run_tessera("export-hf --checkpoint " + d.file("narrow") + " --out " +
                                            d.file("narrow_hf") + " --expert-dtype mxfp4"),
                                "does not have rows of whole blocks of 32 values", "experts of 16 columns");
    EXPECT_FALSE(fs::exists(d.file("narrow_hf")));
    const std::string base_args = "train --config " + kTiny + arch +
                                  " --set train.micro_batch_size=1 --set train.base=" + hf + kLora,
                      args = base_args + " --set model.lora.expert_dtype=mxfp4";
    r = run_tessera(args + " --out " + d.file("resident"));
    ASSERT_EQ(r.status, 0) << r.err;
    const std::string from_f32 = "train --config " + kTiny + arch +
                                 " --set train.micro_batch_size=1 --set train.base=" + hf32 + kLora +
                                 " --set model.lora.expert_dtype=mxfp4";
    r = run_tessera(from_f32 + " --out " + d.file("quantised_on_load"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(losses(d.file("resident")), losses(d.file("quantised_on_load")));
    r = run_tessera(args + " --set memory.weights_budget=1 --out " + d.file("budget"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(losses(d.file("resident")), losses(d.file("budget")));
    // experts widened to f32 are converted, so they load into the arena: only the dense weights are mapped
    r = run_tessera(base_args + " --set memory.weights_budget=1 --out " + d.file("widened"));
    ASSERT_EQ(r.status, 0) << r.err;
    auto weights = [&](const std::string& run) {
        std::vector<Json> out;
        for_each_line(read_text(run + "/metrics.jsonl"), [&](std::string_view line, size_t) {
            const Json rec = Json::parse(line);
            if (rec.contains("weights")) out.push_back(rec["weights"]);
        });
        return out;
    };
    const std::vector<Json> held = weights(d.file("budget")), widened = weights(d.file("widened"));
    ASSERT_EQ(held.size(), 12u);
    ASSERT_EQ(widened.size(), 12u);
    for (size_t k = 0; k < held.size(); ++k) {
        EXPECT_EQ(held[k]["mapped_bytes"].get<int64_t>() - widened[k]["mapped_bytes"].get<int64_t>(),
                  values / kMxfp4Block * kMxfp4BlockBytes)
            << held[k].dump();
        EXPECT_LE(held[k]["resident_bytes"].get<int64_t>(), int64_t(1) << 20) << held[k].dump();
        EXPECT_GT(held[k]["released_bytes"].get<int64_t>(), 0) << held[k].dump();
    }
    r = run_tessera_mpi(2, args + " --set memory.weights_budget=1 --set parallel.ep=2 --out " + d.file("ep2"));
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    expect_close_losses(d.file("budget"), d.file("ep2"));
    // merged: dense experts, so the base's quantization_config goes; with --expert-dtype mxfp4 both stay
    r = run_tessera("export-hf --checkpoint " + d.file("budget") + " --merge-lora --out " + d.file("merged"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_FALSE(Json::parse(read_text(d.file("merged") + "/config.json")).contains("quantization_config"));
    EXPECT_TRUE(Json::parse(read_text(d.file("merged") + "/model.safetensors.index.json"))["weight_map"].contains(
        "model.layers.1.block_sparse_moe.experts.5.w2.weight"));
    r = run_tessera("export-hf --checkpoint " + d.file("budget") + " --merge-lora --expert-dtype mxfp4 --out " +
                    d.file("merged4"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(read_text(d.file("merged4") + "/config.json"), read_text(hf + "/config.json"));
    test::expect_one_line_error(
        run_tessera("export-hf --checkpoint " + d.file("budget") + " --expert-dtype mxfp4 --out " + d.file("peft")),
        "--expert-dtype: " + d.file("budget"), "MXFP4 experts for a PEFT export");
    EXPECT_FALSE(fs::exists(d.file("peft")));
    // expert 5's w2 of layer 1 with a NaN scale: refused when mapped, as when loaded
    const std::string bad = "model.layers.1.block_sparse_moe.experts.5.w2.weight_scale";
    const std::string shard = hf + "/" + index["weight_map"][bad].get<std::string>();
    rewrite_tensors(shard, shard, [&](const std::string& name, Tensor& t) {
        if (name == bad) t.ptr<uint8_t>()[3] = 255;
    });
    for (const std::string& budget : {std::string(), std::string(" --set memory.weights_budget=1")}) {
        const std::string out = d.file("nan" + std::to_string(budget.size()));
        test::expect_one_line_error(run_tessera(args + budget + " --out " + out),
                                    "experts.5.w2.weight: MXFP4 scale of row 0 group 3 is NaN", budget);
        EXPECT_FALSE(fs::exists(out + "/checkpoints")) << budget;
    }
}

// Supervised data (prompt tokens masked): a step's loss is the mean over every counted target of the step, so one
// forward of the batch, four accumulated micro-batches and two ranks train alike (micro-batches of uneven counted
// targets weigh by their count, not equally).
TEST(FineTune, SupervisedLossIsTheMeanOverTheStepsCountedTargets) {
    TempDir d;
    std::string lines;
    for (int i = 0; i < 400; ++i) {  // prompts of very different lengths, short completions
        lines += fmt::format("{{\"prompt\": \"{}\", \"completion\": \" {}.\"}}\n",
                             std::string(size_t(1 + (i * 37) % 90), 'q'), i);
    }
    write_text_atomic(d.file("sft.jsonl"), lines);
    ASSERT_EQ(run_tessera("data " + d.file("sft.jsonl") + " --out " + d.file("sft.safetensors")).status, 0);
    const std::string args = "train --config " + kTiny + " --steps 4 --set data.path=" + d.file("sft.safetensors") +
                             " --set train.eval_interval=2";
    test::CliResult r = run_tessera(args + " --out " + d.file("whole"));
    ASSERT_EQ(r.status, 0) << r.err;
    ASSERT_EQ(run_tessera(args + " --set train.micro_batch_size=1 --out " + d.file("micro1")).status, 0);
    ASSERT_EQ(run_tessera(args + " --set train.micro_batch_size=2 --out " + d.file("micro2")).status, 0);
    r = run_tessera_mpi(2, args + " --set train.micro_batch_size=2 --out " + d.file("ranks2"));
    ASSERT_EQ(r.status, 0) << r.err;
    // (the evaluation reads eval_batches micro-batches: another micro-batch size evaluates other windows)
    const auto whole = losses(d.file("whole")), micro1 = losses(d.file("micro1"));
    int64_t compared = 0;
    for (const auto& [key, value] : whole) {
        if (key.first != "loss") continue;
        EXPECT_NEAR(std::stod(value), std::stod(micro1.at(key)), 1e-5 * std::stod(value)) << "step " << key.second;
        ++compared;
    }
    EXPECT_EQ(compared, 4);
    EXPECT_EQ(losses(d.file("micro2")), losses(d.file("ranks2")));
}

// generate reads the prompt and writes the text with a checkpoint's tokenizer (--tokenizer; by default the model's
// own or its base's Hugging Face directory's), and refuses one with more ids than the model has
TEST(FineTune, GenerateSpeaksTheTokenizersLanguage) {
    TempDir d;
    std::string lines;
    for (int i = 0; i < 200; ++i) lines += fmt::format("{{\"text\": \"hacker, n. one who enjoys {} puzzles.\"}}\n", i);
    write_text_atomic(d.file("text.jsonl"), lines);
    const std::string tokenizer = test::golden_path("tokenizers/qwen2");
    ASSERT_EQ(
        run_tessera("data " + d.file("text.jsonl") + " --tokenizer " + tokenizer + " --out " + d.file("t.safetensors"))
            .status,
        0);
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 2 --set model.vocab_size=1505 --set data.path=" +
                          d.file("t.safetensors") + " --out " + d.file("run"))
                  .status,
              0);
    const std::string gen =
        "generate --checkpoint " + d.file("run") + " --prompt 'hacker, n.' --max-new-tokens 5 --temperature 0";
    test::CliResult a = run_tessera(gen + " --tokenizer " + tokenizer),
                    b = run_tessera(gen + " --tokenizer " + tokenizer);
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_EQ(a.out.rfind("hacker, n.", 0), 0u) << a.out;
    EXPECT_GT(a.out.size(), std::string("hacker, n.\n").size()) << "nothing generated";
    EXPECT_EQ(a.out, b.out) << "greedy decoding is deterministic";
    test::expect_one_line_error(run_tessera("generate --checkpoint " + test::golden_path("hf/qwen3_next_tiny") +
                                            " --prompt hi --tokenizer " + tokenizer),
                                "1505 ids, more than the model's vocabulary of 64", "a tokenizer too large");
}

// A Hugging Face checkpoint (transformers' own tiny Qwen3-Next: gated DeltaNet, gated attention, MoE in every
// layer) as the base, on token ids inside its vocabulary.
TEST(FineTune, AHuggingFaceDirectoryIsABase) {
    TempDir d;
    std::vector<uint16_t> ids(6000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t((i * 7 + i / 13) % 64);
    write_safetensors(d.file("ids.safetensors"),
                      {{"tokens", TensorView(ids.data(), DType::u16, Shape{int64_t(ids.size())})}},
                      {{"vocab_size", "64"}});
    const std::string hf = test::golden_path("hf/qwen3_next_tiny");
    // no model section: the architecture is the base's; one sequence per forward on 1 and 2 ranks alike (the
    // Qwen3-Next global balance loss pools over a micro-batch)
    write_text_atomic(d.file("run.json"), Json{{"train",
                                                {{"seq_len", 16},
                                                 {"batch_size", 2},
                                                 {"micro_batch_size", 1},
                                                 {"steps", 4},
                                                 {"eval_interval", 2},
                                                 {"eval_batches", 2},
                                                 {"checkpoint_interval", 2},
                                                 {"base", hf}}},
                                               {"data", {{"path", d.file("ids.safetensors")}}}}
                                              .dump());
    const std::string args = "train --config " + d.file("run.json") +
                             " --set model.lora.rank=2 --set 'model.lora.target_modules=[\"q_proj\",\"o_proj\","
                             "\"gate_proj\",\"down_proj\"]'";
    test::CliResult a = run_tessera(args + " --out " + d.file("one"));
    ASSERT_EQ(a.status, 0) << a.err;
    // the same base under expert parallelism: each rank loads its experts from the published per-expert tensors
    test::CliResult b = run_tessera_mpi(2, args + " --set parallel.ep=2 --out " + d.file("ep2"));
    ASSERT_EQ(b.status, 0) << b.out << b.err;
    expect_close_losses(d.file("one"), d.file("ep2"));
    // the fine-tune's logits are transformers' (lr 1e-30: the base's own)
    const std::string zero = d.file("zero");
    ASSERT_EQ(run_tessera(args + " --set train.lr=1e-30 --out " + zero).status, 0);
    SafetensorsFile golden(test::golden_path("hf/qwen3_next_tiny_logits.safetensors"));
    write_safetensors(d.file("in.safetensors"), {{"ids", golden.load("ids").view()}});
    a = run_tessera("logits --checkpoint " + zero + " --in " + d.file("in.safetensors") + " --out " +
                    d.file("logits.safetensors"));
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_TRUE(test::rel_rms_close(SafetensorsFile(d.file("logits.safetensors")).load("logits").view(),
                                    golden.load("expected.logits").view(), 1e-4));
    // merged back into the Hugging Face layout it came from: the base's own config, and the fine-tune's scores
    a = run_tessera("export-hf --merge-lora --checkpoint " + d.file("one") + " --out " + d.file("merged"));
    ASSERT_EQ(a.status, 0) << a.err;
    EXPECT_EQ(Json::parse(read_text(d.file("merged/config.json"))), Json::parse(read_text(hf + "/config.json")));
    EXPECT_TRUE(
        test::rel_rms_close(logits_of(d.file("merged"), d.file("in.safetensors"), d.file("m.safetensors")).view(),
                            logits_of(d.file("one"), d.file("in.safetensors"), d.file("o.safetensors")).view(), 1e-5));
}

TEST(FineTune, AKimiK3BaseWithItsImageTowerScoresImagesAndFineTunesOnText) {
    // a tiny Kimi K3 with its image tower, as a Hugging Face directory: `logits` takes images as Kimi's processor
    // writes them; LoRA and full fine-tunes on text keep the tower frozen, their checkpoints leave it to the base, and
    // both resume bitwise
    TempDir d;
    const model::ModelConfig c = tiny_k3(64, 5);
    // one sequence of 16 tokens, 4 of them the image token (5) for one image of 4x4 patches of 3x2x2 pixels
    std::vector<int32_t> seq(16);
    for (int i = 0; i < 16; ++i) seq[size_t(i)] = i >= 3 && i < 7 ? 5 : 6 + (i * 5) % 50;
    const Tensor pixels = test::randn(DType::f32, Shape{16, 3, 2, 2}, 4);
    std::vector<int64_t> hw{4, 4};
    Tensor want(DType::f32, Shape{16, 64});
    {
        model::Model m(c);
        model::ModelRuntime rt(m, {1, 16}, false, {});
        m.init_params(rt.params(), 3);
        model::save_hf_checkpoint(d.file("k3"), model::hf_tensor_map(m.param_specs(), c, "kimi_k3"), rt.params());
        write_text_atomic(d.file("k3/config.json"), model::export_hf_config(c).dump());
        const std::vector<ops::PatchGrid> grids{{4, 4}};
        m.set_images(grids, pixels.view().reshape(Shape{16, 12}));
        m.forward_logits({1, 16}, seq, want);
    }
    write_safetensors(d.file("in.safetensors"), {{"ids", TensorView(seq.data(), DType::i32, Shape{1, 16})},
                                                 {"pixel_values", pixels.view()},
                                                 {"image_grid_hws", TensorView(hw.data(), DType::i64, Shape{1, 2})}});
    test::CliResult s = run_tessera("logits --checkpoint " + d.file("k3") + " --in " + d.file("in.safetensors") +
                                    " --out " + d.file("logits.safetensors"));
    ASSERT_EQ(s.status, 0) << s.err;
    EXPECT_TRUE(test::bitwise_equal(SafetensorsFile(d.file("logits.safetensors")).load("logits").view(),
                                    want.view().reshape(Shape{1, 16, 64})));
    hw = {2, 4};  // 2 image tokens' worth of patches for 4 image tokens
    write_safetensors(d.file("bad.safetensors"), {{"ids", TensorView(seq.data(), DType::i32, Shape{1, 16})},
                                                  {"pixel_values", pixels.view().prefix(Shape{8, 3, 2, 2})},
                                                  {"image_grid_hws", TensorView(hw.data(), DType::i64, Shape{1, 2})}});
    s = run_tessera("logits --checkpoint " + d.file("k3") + " --in " + d.file("bad.safetensors") + " --out " +
                    d.file("bad_logits.safetensors"));
    EXPECT_NE(s.status, 0);
    EXPECT_NE(s.err.find("the ids hold 4 image tokens (model.vision.image_token 5), the images give 2"),
              std::string::npos)
        << s.err;
    EXPECT_FALSE(fs::exists(d.file("bad_logits.safetensors")));
    // the images' tensors themselves: each mistake one line, nothing written
    const std::vector<std::pair<std::vector<NamedTensor>, std::string>> bad = {
        {{{"ids", TensorView(seq.data(), DType::i32, Shape{1, 16})}, {"pixel_values", pixels.view()}},
         "images need both pixel_values and image_grid_hws"},
        {{{"ids", TensorView(seq.data(), DType::i32, Shape{1, 16})},
          {"pixel_values", pixels.view().reshape(Shape{16, 2, 6})},
          {"image_grid_hws", TensorView(hw.data(), DType::i64, Shape{1, 2})}},
         "pixel_values must be [patches, 3, 2, 2] or [patches, 12], not [16, 2, 6]"},
        {{{"ids", TensorView(seq.data(), DType::i32, Shape{1, 16})},
          {"pixel_values", pixels.view()},
          {"image_grid_hws", TensorView(hw.data(), DType::i64, Shape{2})}},
         "image_grid_hws must be [images, 2] i32 or i64"},
    };
    for (const auto& [tensors, needle] : bad) {
        write_safetensors(d.file("bad.safetensors"), tensors);
        test::expect_one_line_error(
            run_tessera("logits --checkpoint " + d.file("k3") + " --in " + d.file("bad.safetensors") + " --out " +
                        d.file("bad_logits.safetensors")),
            needle, needle);
        EXPECT_FALSE(fs::exists(d.file("bad_logits.safetensors")));
    }
    // images for a model without a tower
    test::expect_one_line_error(
        run_tessera("logits --checkpoint " + test::golden_path("hf/kimi_linear_tiny") + " --in " +
                    d.file("in.safetensors") + " --out " + d.file("bad_logits.safetensors")),
        "images given, but", "a model without a tower");
    std::vector<uint16_t> ids(6000);
    for (size_t i = 0; i < ids.size(); ++i) ids[i] = uint16_t(6 + (i * 7 + i / 13) % 58);  // no image token
    write_safetensors(d.file("ids.safetensors"),
                      {{"tokens", TensorView(ids.data(), DType::u16, Shape{int64_t(ids.size())})}},
                      {{"vocab_size", "64"}});
    write_text_atomic(d.file("run.json"), k3_run(d.file("k3"), {{"path", d.file("ids.safetensors")}}).dump());
    const std::string args = "train --config " + d.file("run.json");
    for (const std::string& how :
         {std::string(" --set model.lora.rank=2 --set 'model.lora.target_modules=[\"o_proj\"]'"), std::string()}) {
        SCOPED_TRACE(how.empty() ? "full" : "lora");
        const std::string run = d.file(how.empty() ? "full" : "lora"), resumed = run + "_resumed";
        test::CliResult r = run_tessera(args + how + " --out " + run);
        ASSERT_EQ(r.status, 0) << r.err;
        for (const std::string& name : stored_names(ckpt(run, 4) + "/model.safetensors")) {
            EXPECT_FALSE(name.starts_with("vision_tower.") || name.starts_with("mm_projector.")) << name;
            if (!how.empty()) {
                EXPECT_TRUE(name.find(".lora_") != std::string::npos) << name;
            }
        }
        continue_from(run, 2, resumed);
        r = run_tessera("train --resume " + resumed);
        ASSERT_EQ(r.status, 0) << r.err;
        EXPECT_EQ(losses(run, 2), losses(resumed));
        EXPECT_EQ(read_text(ckpt(run, 4) + "/model.safetensors"), read_text(ckpt(resumed, 4) + "/model.safetensors"));
    }
    // without its base the tower would start random and be missing from every checkpoint: refused
    write_text_atomic(d.file("scratch.json"), Json{{"model", model::to_json(c)},
                                                   {"train", {{"seq_len", 16}, {"batch_size", 2}, {"steps", 1}}},
                                                   {"data", {{"path", d.file("ids.safetensors")}}}}
                                                  .dump());
    const test::CliResult r = run_tessera("train --config " + d.file("scratch.json") + " --out " + d.file("scratch"));
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("image tower is frozen and its weights come from train.base"), std::string::npos) << r.err;
    EXPECT_FALSE(fs::exists(d.file("scratch")));
}

// Image and text data for a Kimi K3 fine-tune (token_source.h, loader.h): `tessera data` with the checkpoint's
// tokenizer turns each image token of a JSONL line into its image's image tokens (never targets) and keeps the
// processor's patches in the shard; training windows cut images where they fall and the tower sees each whole image.
// The images change the losses (the tower's rows reach the model), the run resumes bitwise, two ranks (each its own
// micro-batches' images) train like one process, and bad lines are one-line errors naming file and line.
TEST(FineTune, AKimiK3FineTunesOnImagesAndText) {
    TempDir d;
    const int32_t kMediaPad = 1513;  // Kimi's <|media_pad|>, added to the golden Kimi tokenizer
    const model::ModelConfig c = tiny_k3(1792, kMediaPad);
    const std::string k3 = d.file("k3");
    {
        model::Model m(c);
        model::ModelRuntime rt(m, {1, 16}, false, {});
        m.init_params(rt.params(), 3);
        model::save_hf_checkpoint(k3, model::hf_tensor_map(m.param_specs(), c, "kimi_k3"), rt.params());
        write_text_atomic(k3 + "/config.json", model::export_hf_config(c).dump());
    }
    const std::string kimi = test::golden_path("tokenizers/kimi");
    fs::copy_file(kimi + "/tiktoken.model", k3 + "/tiktoken.model");
    Json tok = Json::parse(read_text(kimi + "/tokenizer_config.json"));
    tok["added_tokens_decoder"][std::to_string(kMediaPad)] = {{"content", "<|media_pad|>"}, {"special", true}};
    write_text_atomic(k3 + "/tokenizer_config.json", tok.dump());
    // images of 4x4, 2x4 and 4x6 patches (4, 2 and 6 image tokens), each file as Kimi's processor writes one
    const std::vector<std::pair<int64_t, int64_t>> grids = {{4, 4}, {2, 4}, {4, 6}};
    for (size_t k = 0; k < grids.size(); ++k) {
        const auto [h, w] = grids[k];
        const Tensor pixels = test::randn(DType::f32, Shape{h * w, 3, 2, 2}, 10 + k);
        std::vector<int64_t> hw{h, w};
        write_safetensors(
            d.file(fmt::format("img{}.safetensors", k)),
            {{"pixel_values", pixels.view()}, {"image_grid_hws", TensorView(hw.data(), DType::i64, Shape{1, 2})}});
    }
    std::string lines;
    int64_t images = 0, image_tokens = 0;
    for (int i = 0; i < 60; ++i) {
        const int k = i % 3, n = int(grids[size_t(k)].first * grids[size_t(k)].second / 4);
        if (i % 4 == 3) {
            lines += fmt::format("{{\"text\": \"plain line {} without a picture\"}}\n", i);
        } else if (i % 2 == 0) {
            lines +=
                fmt::format("{{\"text\": \"look <|media_pad|> at {}\", \"images\": [\"img{}.safetensors\"]}}\n", i, k);
            ++images;
            image_tokens += n;
        } else {
            lines += fmt::format(
                "{{\"prompt\": \"<|media_pad|> and <|media_pad|> show\", \"completion\": \" two things {}\", "
                "\"images\": [\"img{}.safetensors\", \"img{}.safetensors\"]}}\n",
                i, k, (k + 1) % 3);
            images += 2;
            image_tokens += n + int(grids[size_t((k + 1) % 3)].first * grids[size_t((k + 1) % 3)].second / 4);
        }
    }
    write_text_atomic(d.file("data.jsonl"), lines);
    test::CliResult r =
        run_tessera("data " + d.file("data.jsonl") + " --tokenizer " + k3 + " --out " + d.file("shard.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    {
        const SafetensorsFile shard(d.file("shard.safetensors"));
        ASSERT_TRUE(shard.contains("image_patches"));
        EXPECT_EQ(shard.entry("image_grids").shape, (Shape{images, 2}));
        EXPECT_EQ(shard.entry("image_patches").shape[1], 12);
        const Tensor tokens = shard.load("tokens"), mask = shard.load("loss_mask");
        int64_t found = 0, targets = 0;
        for (int64_t i = 0; i < tokens.numel(); ++i) {
            const bool image = tokens.ptr<uint16_t>()[i] == kMediaPad;
            found += image;
            if (image) targets += mask.ptr<uint8_t>()[i];
        }
        EXPECT_EQ(found, image_tokens);
        EXPECT_EQ(targets, 0) << "image tokens are never targets";
    }
    write_text_atomic(d.file("run.json"),
                      k3_run(k3, {{"path", d.file("shard.safetensors")}, {"val_fraction", 0.2}}).dump());
    const std::string args = "train --config " + d.file("run.json") +
                             " --set model.lora.rank=2 --set 'model.lora.target_modules=[\"o_proj\"]'";
    r = run_tessera(args + " --out " + d.file("lora"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find(fmt::format("{} images", images)), std::string::npos) << r.out;
    continue_from(d.file("lora"), 2, d.file("resumed"));
    r = run_tessera("train --resume " + d.file("resumed"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(losses(d.file("lora"), 2), losses(d.file("resumed")));
    r = run_tessera_mpi(2, args + " --set train.micro_batch_size=1 --out " + d.file("two"));
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    expect_close_losses(d.file("lora"), d.file("two"));
    // generate with an image: the prompt's image token becomes the image's tokens
    r = run_tessera("generate --checkpoint " + d.file("lora") + " --prompt '<|media_pad|> look' --images " +
                    d.file("img0.safetensors") + " --max-new-tokens 4 --temperature 0");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_TRUE(r.out.starts_with("<|media_pad|> look")) << r.out;
    test::expect_one_line_error(run_tessera("generate --checkpoint " + d.file("lora") + " --prompt 'look' --images " +
                                            d.file("img0.safetensors")),
                                "--prompt holds 0 image token(s) (id 1513) for the 1 image(s)", "no image token");
    test::expect_one_line_error(
        run_tessera("generate --checkpoint " + d.file("lora") + " --prompt '<|media_pad|> look' --context 8 --images " +
                    d.file("img0.safetensors")),
        "with images the context (8 tokens) must hold the prompt", "a short context");
    test::expect_one_line_error(run_tessera("generate --checkpoint " + d.file("lora") +
                                            " --prompt '<|media_pad|>' --images " + d.file("missing.safetensors")),
                                "--images " + d.file("missing.safetensors") + ": no such file", "a missing image file");
    test::expect_one_line_error(run_tessera("generate --checkpoint " + test::golden_path("hf/kimi_linear_tiny") +
                                            " --prompt 'look' --images " + d.file("img0.safetensors")),
                                "has no image tower", "images for a model without a tower");
    // a shard made for another tower: patches of 4x4 pixels (48 values), so grids of half the sides
    rewrite_tensors(d.file("shard.safetensors"), d.file("other.safetensors"), [](const std::string& name, Tensor& t) {
        if (name == "image_patches") t = Tensor::copy_of(t.view().reshape(Shape{t.numel() / 48, 48}));
        if (name == "image_grids")
            for (int64_t i = 0; i < t.numel(); ++i) t.ptr<int32_t>()[i] /= 2;
    });
    test::expect_one_line_error(
        run_tessera(args + " --set data.path=" + d.file("other.safetensors") + " --out " + d.file("other")),
        "its images are image token 1513 with patches of 48 values; the model's tower takes image token 1513 with "
        "patches of 12",
        "a shard for another tower");
    EXPECT_FALSE(fs::exists(d.file("other") + "/checkpoints"));
    // an image whose token count is not the tower's (its first image's tokens one short)
    rewrite_tensors(d.file("shard.safetensors"), d.file("short.safetensors"), [](const std::string& name, Tensor& t) {
        if (name == "image_tokens") t.ptr<int64_t>()[1] -= 1;
    });
    test::expect_one_line_error(
        run_tessera(args + " --set data.path=" + d.file("short.safetensors") + " --out " + d.file("short")),
        "an image of 4x4 patches has 3 image tokens; the model's tower gives it 4", "a short image");
    // the same shard with other pixels: other losses
    rewrite_tensors(d.file("shard.safetensors"), d.file("flipped.safetensors"), [](const std::string& name, Tensor& t) {
        if (name == "image_patches")
            for (int64_t i = 0; i < t.numel(); ++i) t.ptr<float>()[i] *= -1.f;
    });
    r = run_tessera(args + " --set data.path=" + d.file("flipped.safetensors") + " --out " + d.file("flipped"));
    ASSERT_EQ(r.status, 0) << r.err;
    const auto a = losses(d.file("lora")), b = losses(d.file("flipped"));
    ASSERT_EQ(a.size(), b.size());
    for (const auto& [key, value] : a) EXPECT_NE(value, b.at(key)) << key.first << " " << key.second;
    // bad lines: one line naming the file and line, no shard
    const std::vector<std::pair<std::string, std::string>> bad = {
        {R"({"text": "one <|media_pad|> two <|media_pad|>", "images": ["img0.safetensors"]})",
         "more image tokens (id 1513) in the text than the 1 image(s)"},
        {R"({"text": "no token", "images": ["img0.safetensors"]})", "1 image(s) but 0 image token(s)"},
        {R"({"text": "<|media_pad|>", "images": ["missing.safetensors"]})", "image file"},
        {R"({"text": "<|media_pad|>", "images": "img0.safetensors"})", "\"images\" must be a non-empty array"},
    };
    for (const auto& [line, needle] : bad) {
        write_text_atomic(d.file("bad.jsonl"), lines + line + "\n");
        test::expect_one_line_error(
            run_tessera("data " + d.file("bad.jsonl") + " --tokenizer " + k3 + " --out " + d.file("bad.safetensors")),
            "bad.jsonl:61: ", line);
        test::expect_one_line_error(
            run_tessera("data " + d.file("bad.jsonl") + " --tokenizer " + k3 + " --out " + d.file("bad.safetensors")),
            needle, line);
        EXPECT_FALSE(fs::exists(d.file("bad.safetensors")));
    }
    // images without a tower to read them
    test::expect_one_line_error(run_tessera("data " + d.file("data.jsonl") + " --out " + d.file("bad.safetensors")),
                                "data.jsonl:1: images, but the byte tokenizer has no image tower",
                                "the byte tokenizer");
    // a model without a tower refuses image data
    test::expect_one_line_error(
        run_tessera("train --config " + kTiny + " --set data.path=" + d.file("shard.safetensors") +
                    " --set model.vocab_size=1792 --out " + d.file("text_model")),
        fmt::format("holds {} images but the model has no image tower", images), "a model without a tower");
}

}  // namespace
}  // namespace tessera
