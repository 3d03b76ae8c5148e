// PEFT adapters (model/hf_peft.h) against PEFT itself: tests/golden/hf/deepseek_v32_tiny_peft and _peft_experts are
// LoRA adapters PEFT made and saved on transformers' own tiny DeepSeek-V3.2 (tools/ref/make_peft_golden.py; MLA's
// five projections in every layer; o_proj and the stacked routed experts through target_parameters; random A and B).
// Read on its base, tessera gives PEFT's logits, loss and the gradient of every adapter tensor, and writes the
// adapters back: the same files, or (stacked experts) tessera's form, which it reads back to the same logits.
#include <gtest/gtest.h>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>

#include "core/file.h"
#include "core/safetensors.h"
#include "model/hf_peft.h"
#include "model/runtime.h"
#include "train/model_source.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;

TEST(Peft, AdaptersOnTheirBaseGivePeftsLogitsLossAndGradients) {
    const std::string dir = test::golden_path("hf/deepseek_v32_tiny_peft");
    const SafetensorsFile golden(test::golden_path("hf/deepseek_v32_tiny_peft_expected.safetensors"));
    const train::ModelSource src = train::open_model_source(dir);
    ASSERT_TRUE(src.peft);
    EXPECT_EQ(src.config.lora.rank, 2);
    EXPECT_EQ(src.config.lora.alpha, 3.0);
    EXPECT_EQ(src.config.lora.target_modules.size(), 5u * 3u);  // five modules in each of three layers
    const Tensor ids64 = golden.load("ids"), t64 = golden.load("targets");
    const int64_t B = ids64.view().size(0), T = ids64.view().size(1), V = src.config.vocab_size;
    std::vector<int32_t> ids(size_t(B * T)), targets(size_t(B * T));
    for (int64_t i = 0; i < B * T; ++i) {
        ids[size_t(i)] = int32_t(ids64.ptr<int64_t>()[i]);
        targets[size_t(i)] = int32_t(t64.ptr<int64_t>()[i]);
    }
    model::Model m(src.config);
    const model::StepShape shape{B, T};
    model::ModelRuntime rt(m, shape, /*with_grads=*/true, /*recompute=*/{});
    src.load(m, rt.params());
    Tensor logits(DType::f32, Shape{B * T, V});
    m.forward_logits(shape, ids, logits);
    EXPECT_TRUE(
        test::rel_rms_close(logits.view(), golden.load("expected.logits").view().reshape(Shape{B * T, V}), 1e-5));
    rt.grads().zero();
    const model::LossResult r = m.forward_backward(shape, ids, targets, 1.0);
    EXPECT_NEAR(r.loss, double(golden.load("expected.loss").ptr<float>()[0]), 1e-5 * r.loss);
    const std::vector<model::PeftTensor> map = model::peft_tensor_map(m.param_specs(), src.config, "deepseek_v32");
    EXPECT_EQ(map.size(), 30u);
    EXPECT_EQ(rt.grads().size(), map.size()) << "only the adapters train";
    for (const model::PeftTensor& t : map) {
        SCOPED_TRACE(t.name);
        // both sides fp32 (PEFT's too): measured 1.3e-5 - 3.8e-5 (a wrong formula is off by O(1))
        EXPECT_TRUE(test::rel_rms_close(rt.grads().view(t.param), golden.load("grad." + t.name).view(), 1e-4));
    }
    // written back: PEFT's tensors, bit for bit, and a config that names the same modules
    const test::TempDir d;
    model::save_peft_adapter(d.file("out"), map, rt.params(), src.config.lora, src.base);
    const SafetensorsFile theirs(dir + "/adapter_model.safetensors"), mine(d.file("out/adapter_model.safetensors"));
    EXPECT_EQ(theirs.entries().size(), mine.entries().size());
    for (const auto& e : theirs.entries())
        EXPECT_TRUE(test::bitwise_equal(mine.load(e.name).view(), theirs.load(e.name).view())) << e.name;
    const model::PeftAdapter back = model::read_peft_config(d.file("out"), src.config, "deepseek_v32");
    EXPECT_EQ(back.lora.target_modules, src.config.lora.target_modules);
    EXPECT_EQ(back.base, src.base);
}

// The logits of a PEFT directory read on its base by tessera, in the golden's shape [B·T, V]
struct PeftRun {
    explicit PeftRun(const std::string& dir) : src(train::open_model_source(dir)), m(src.config) {}
    Tensor logits(const SafetensorsFile& golden) {
        const Tensor ids64 = golden.load("ids");
        const int64_t B = ids64.view().size(0), T = ids64.view().size(1);
        ids.resize(size_t(B * T));
        for (int64_t i = 0; i < B * T; ++i) ids[size_t(i)] = int32_t(ids64.ptr<int64_t>()[i]);
        shape = {B, T};
        rt = std::make_unique<model::ModelRuntime>(m, shape, /*with_grads=*/true, model::Recompute{});
        src.load(m, rt->params());
        Tensor out(DType::f32, Shape{B * T, src.config.vocab_size});
        m.forward_logits(shape, ids, out);
        return out;
    }
    train::ModelSource src;
    model::Model m;
    model::StepShape shape;
    std::vector<int32_t> ids;
    std::unique_ptr<model::ModelRuntime> rt;
};

// target_parameters on the stacked experts (gate and up sharing PEFT's one A at rank r): tessera holds them as separate
// gate, up and down adapters per expert, gives PEFT's logits, loss and gradients (gate's and up's A gradients summing
// to PEFT's shared A's), and writes them as gate_up_proj at rank 2r (A stacked, B block diagonal; rank_pattern and
// alpha_pattern keep the scale), which it reads back to the same logits bitwise. (The file it writes is PEFT's to
// read: tools/ref/make_peft_golden.py --check.)
// PEFT's logits, loss and adapter gradients from tessera on the golden's ids and targets (a stacked gate_up adapter at
// rank r: gate's and up's A gradients sum to PEFT's shared A's); returns tessera's logits
Tensor expect_peft_results(PeftRun& run,
                           const SafetensorsFile& golden,
                           const std::string& family,
                           size_t stacked,
                           double grad_tol = 1e-4,
                           double logits_tol = 1e-5) {
    Tensor logits = run.logits(golden);
    const int64_t N = logits.view().size(0), V = logits.view().size(1);
    EXPECT_TRUE(
        test::rel_rms_close(logits.view(), golden.load("expected.logits").view().reshape(Shape{N, V}), logits_tol));
    std::vector<int32_t> targets(static_cast<size_t>(N));
    const Tensor t64 = golden.load("targets");
    for (int64_t i = 0; i < N; ++i) targets[size_t(i)] = int32_t(t64.ptr<int64_t>()[i]);
    run.rt->grads().zero();
    const model::LossResult r = run.m.forward_backward(run.shape, run.ids, targets, 1.0);
    EXPECT_NEAR(r.loss, double(golden.load("expected.loss").ptr<float>()[0]), 1e-5 * r.loss);
    size_t parts = 0;
    // a module of several parts read at rank r: every part starts from one shared A, whose gradient is the sum of
    // the parts' A gradients
    std::map<std::string, std::pair<model::PeftTensor, Tensor>> shared;
    for (const model::PeftTensor& t : model::peft_tensor_map(run.m.param_specs(), run.src.config, family)) {
        SCOPED_TRACE(t.param + " <- " + t.name);
        const TensorView g = run.rt->grads().view(t.param);
        const Tensor stored = golden.load("grad." + t.name);
        parts += t.parts > 0;
        const bool a = t.param.ends_with(".lora_A.weight");
        const int64_t E = g.shape.ndim == 3 ? g.shape[0] : 1, r = g.shape[g.shape.ndim - 2];
        if (!a || t.parts < 2 || stored.view().size(0) != r * E) {
            EXPECT_TRUE(test::rel_rms_close(g, model::peft_param(stored, t, g.shape, "golden").view(), grad_tol));
            continue;
        }
        auto [it, fresh] = shared.try_emplace(t.name, t, Tensor(DType::f32, g.shape));
        for (int64_t i = 0; i < g.numel(); ++i) it->second.second.ptr<float>()[i] += g.ptr<float>()[i];
    }
    for (const auto& [name, sum] : shared) {
        SCOPED_TRACE(name + " (shared A)");
        const Tensor want =
            model::peft_param(golden.load("grad." + name), sum.first, sum.second.view().shape, "golden");
        EXPECT_TRUE(test::rel_rms_close(sum.second.view(), want.view(), grad_tol));
    }
    EXPECT_EQ(parts, stacked);
    return logits;
}

TEST(Peft, StackedExpertAdaptersGivePeftsLogitsLossAndGradientsAndWriteBack) {
    const std::string dir = test::golden_path("hf/deepseek_v32_tiny_peft_experts");
    const SafetensorsFile golden(test::golden_path("hf/deepseek_v32_tiny_peft_experts_expected.safetensors"));
    PeftRun run(dir);
    EXPECT_EQ(run.src.config.lora.rank, 2);
    EXPECT_EQ(run.src.config.lora.target_modules.size(), 3u + 2u * 3u);  // o_proj in 3 layers, 2 MoE layers' experts
    const Tensor logits = expect_peft_results(run, golden, "deepseek_v32", 2 * 3 * 2);
    const std::vector<model::PeftTensor> map =
        model::peft_tensor_map(run.m.param_specs(), run.src.config, "deepseek_v32");
    // written back in tessera's form: gate_up_proj at rank 4 with alpha 6, read back to the same logits
    const test::TempDir d;
    model::save_peft_adapter(d.file("out"), map, run.rt->params(), run.src.config.lora, run.src.base);
    const Json c = Json::parse(read_text(d.file("out/adapter_config.json")));
    EXPECT_EQ(c["rank_pattern"],
              (Json{{"model.layers.1.mlp.experts.gate_up_proj", 4}, {"model.layers.2.mlp.experts.gate_up_proj", 4}}));
    EXPECT_EQ(c["alpha_pattern"], (Json{{"model.layers.1.mlp.experts.gate_up_proj", 6.0},
                                        {"model.layers.2.mlp.experts.gate_up_proj", 6.0}}));
    EXPECT_EQ(c["target_parameters"],
              (Json{"model.layers.1.mlp.experts.down_proj", "model.layers.1.mlp.experts.gate_up_proj",
                    "model.layers.2.mlp.experts.down_proj", "model.layers.2.mlp.experts.gate_up_proj"}));
    const SafetensorsFile mine(d.file("out/adapter_model.safetensors"));
    EXPECT_EQ(mine.entry("base_model.model.model.layers.1.mlp.experts.base_layer.lora_A.weight").shape,
              (Shape{4 * 4, 32}));  // rank 4 × 4 experts, hidden 32
    EXPECT_EQ(mine.entry("base_model.model.model.layers.1.mlp.experts.base_layer.lora_B.weight").shape,
              (Shape{2 * 16, 4 * 4}));
    auto config = Json::parse(read_text(d.file("out/adapter_config.json")));
    config["base_model_name_or_path"] = std::filesystem::absolute(test::golden_path("hf/deepseek_v32_tiny")).string();
    write_text_atomic(d.file("out/adapter_config.json"), config.dump());
    PeftRun back(d.file("out"));
    EXPECT_EQ(back.src.config.lora.target_modules, run.src.config.lora.target_modules);
    EXPECT_TRUE(test::bitwise_equal(back.logits(golden).view(), logits.view()));
    // B coupling gate and up at rank 2r is no pair of rank-r adapters: refused
    std::vector<NamedTensor> tensors;
    std::vector<Tensor> keep;
    for (const auto& e : mine.entries()) {
        keep.push_back(mine.load(e.name));
        if (e.name == "base_model.model.model.layers.2.mlp.experts.base_layer.lora_B.weight")
            keep.back().ptr<float>()[0 * 16 + 2 * 4 + 1] = 0.5f;  // row 0 (gate), rank 2 (up's), expert 1
        tensors.push_back({e.name, keep.back().view()});
    }
    write_safetensors(d.file("out/adapter_model.safetensors"), tensors);
    test::expect_error([&] { PeftRun(d.file("out")).logits(golden); },
                       "couples the projections it fuses (a nonzero element off B's diagonal blocks, expert 1)");
}

// transformers' Kimi-Linear names its modules as it renames the checkpoint's (mlp for block_sparse_moe,
// self_attn.forget_gate.f_a_proj / f_b_proj): PEFT's adapters on them, the shared experts and the stacked experts
// read on their base give PEFT's logits, loss and gradients
TEST(Peft, KimiLinearAdaptersUseTransformersModuleNames) {
    const std::string dir = test::golden_path("hf/kimi_linear_tiny_peft");
    const SafetensorsFile golden(test::golden_path("hf/kimi_linear_tiny_peft_expected.safetensors"));
    PeftRun run(dir);
    const std::vector<std::string>& m = run.src.config.lora.target_modules;
    EXPECT_NE(std::find(m.begin(), m.end(), "model.layers.0.self_attn.f_a_proj"), m.end()) << Json(m).dump();
    // two MoE layers; the KDA forget gate's adapter gradients through transformers' reference chunk_kda measured
    // 1.1e-4 from tessera's (fp32 both; a wrong formula is off by O(1))
    expect_peft_results(run, golden, "kimi_linear", 2 * 3 * 2, 3e-4);
}

// modules_to_save (PEFT trains a copy of each such module whole and saves it under the module's own name): read on
// the base, the trained copies of lm_head and model.norm replace the base's, train with PEFT's gradients, and are
// written back bit for bit with the same config list
TEST(Peft, ModulesToSaveTrainWholeUnderTheirTransformersNames) {
    const std::string dir = test::golden_path("hf/deepseek_v32_tiny_peft_saved");
    const SafetensorsFile golden(test::golden_path("hf/deepseek_v32_tiny_peft_saved_expected.safetensors"));
    PeftRun run(dir);
    EXPECT_EQ(run.src.config.lora.modules_to_save, (std::vector<std::string>{"lm_head", "model.norm"}));
    expect_peft_results(run, golden, "deepseek_v32", 0);
    const std::vector<model::PeftTensor> map =
        model::peft_tensor_map(run.m.param_specs(), run.src.config, "deepseek_v32");
    EXPECT_EQ(map.size(), 3u * 2u + 2u);  // o_proj's A and B in three layers, lm_head.weight, model.norm.weight
    EXPECT_EQ(run.rt->grads().size(), map.size()) << "the adapters and the saved modules train";
    const test::TempDir d;
    model::save_peft_adapter(d.file("out"), map, run.rt->params(), run.src.config.lora, run.src.base);
    const SafetensorsFile theirs(dir + "/adapter_model.safetensors"), mine(d.file("out/adapter_model.safetensors"));
    EXPECT_EQ(theirs.entries().size(), mine.entries().size());
    for (const auto& e : theirs.entries())
        EXPECT_TRUE(test::bitwise_equal(mine.load(e.name).view(), theirs.load(e.name).view())) << e.name;
    EXPECT_EQ(Json::parse(read_text(d.file("out/adapter_config.json")))["modules_to_save"],
              (Json{"lm_head", "model.norm"}));
}

// Qwen3-Next's fused projections are one PEFT module each (GatedDeltaNet's in_proj_qkvz: q, k, v and z in row
// groups per key head; in_proj_ba; gated attention's q_proj: q and its gate per head): PEFT's adapters at rank r read
// as one tessera adapter per projection from a shared A give PEFT's logits, loss and gradients (each shared A's the
// sum of its parts'); written back at rank parts·r (B block diagonal over the parts' rows, rank and alpha patterns
// under the module's full name) they read back to the same logits bitwise
TEST(Peft, Qwen3NextFusedProjectionsAreOnePeftModuleEach) {
    const std::string dir = test::golden_path("hf/qwen3_next_tiny_peft");
    const SafetensorsFile golden(test::golden_path("hf/qwen3_next_tiny_peft_expected.safetensors"));
    PeftRun run(dir);
    const std::vector<std::string>& m = run.src.config.lora.target_modules;
    for (const char* p : {"model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.g_proj",
                          "model.layers.2.self_attn.a_proj", "model.layers.3.self_attn.g_proj"})
        EXPECT_NE(std::find(m.begin(), m.end(), p), m.end()) << p << " in " << Json(m).dump();
    // three GatedDeltaNet layers (4 + 2 parts) and one attention layer (2 parts), A and B each. Through
    // transformers' reference chunk_gated_delta_rule (fp32 both) the logits measured 1.7e-5 from tessera's (the base
    // model's own interop test allows 1e-4), the gradients within 2.1e-4; B's rows mapped without the head groups
    // are off by 1.0-1.3
    const Tensor logits = expect_peft_results(run, golden, "qwen3_next", 3 * 6 * 2 + 2 * 2, 4e-4, 1e-4);
    const test::TempDir d;
    model::save_peft_adapter(d.file("out"), model::peft_tensor_map(run.m.param_specs(), run.src.config, "qwen3_next"),
                             run.rt->params(), run.src.config.lora, run.src.base);
    Json c = Json::parse(read_text(d.file("out/adapter_config.json")));
    EXPECT_EQ(c["rank_pattern"]["model.layers.0.linear_attn.in_proj_qkvz"], 8);
    EXPECT_EQ(c["alpha_pattern"]["model.layers.0.linear_attn.in_proj_qkvz"], 12.0);
    EXPECT_EQ(c["rank_pattern"]["model.layers.3.self_attn.q_proj"], 4);
    EXPECT_EQ(c["target_modules"].size(), 3u * 3u + 1u);
    const SafetensorsFile mine(d.file("out/adapter_model.safetensors"));
    EXPECT_EQ(mine.entry("base_model.model.model.layers.1.linear_attn.in_proj_qkvz.lora_B.weight").shape,
              (Shape{96, 8}));
    c["base_model_name_or_path"] = fs::absolute(test::golden_path("hf/qwen3_next_tiny")).string();
    write_text_atomic(d.file("out/adapter_config.json"), c.dump());
    PeftRun back(d.file("out"));
    EXPECT_EQ(back.src.config.lora.target_modules, run.src.config.lora.target_modules);
    EXPECT_TRUE(test::bitwise_equal(back.logits(golden).view(), logits.view()));
}

// A safetensors file rewritten with `extra` tensors added or replacing those of the same name
void rewrite_safetensors(const std::string& from,
                         const std::string& to,
                         const std::map<std::string, TensorView>& extra) {
    const SafetensorsFile f(from);
    std::map<std::string, Tensor> kept;
    for (const auto& e : f.entries())
        if (!extra.count(e.name)) kept.emplace(e.name, f.load(e.name));
    std::vector<NamedTensor> named;
    for (const auto& [name, t] : kept) named.push_back({name, t.view()});
    for (const auto& [name, v] : extra) named.push_back({name, v});
    write_safetensors(to, named);
}

// Qwen3-Next's decoder norms are zero-centred (Qwen3NextRMSNorm scales by 1 + w and stores w): as modules_to_save PEFT
// keeps the module's own stored form. A PEFT directory whose saved model.norm holds w trains from the same model as
// the base with w stored in its place (logits bitwise), and tessera writes w back (bitwise here: w is a multiple of
// 1/32, so 1 + w is exact), and reads its own file back to the same logits.
TEST(Peft, Qwen3NextZeroCentredNormsTrainWholeInTheirStoredForm) {
    const test::TempDir d;
    const std::string golden_dir = test::golden_path("hf/qwen3_next_tiny_peft");
    const SafetensorsFile golden(test::golden_path("hf/qwen3_next_tiny_peft_expected.safetensors"));
    const std::string base = test::golden_path("hf/qwen3_next_tiny");
    Tensor w(DType::f32, Shape{32});  // a trained norm, as transformers stores it
    for (int64_t i = 0; i < 32; ++i) w.ptr<float>()[i] = 0.03125f * float(i - 13);
    // the base with w in place of model.norm.weight, and the golden adapters on it
    fs::create_directories(d.file("base"));
    for (const char* f : {"config.json", "generation_config.json"}) fs::copy_file(base + "/" + f, d.file("base/") + f);
    rewrite_safetensors(base + "/model.safetensors", d.file("base/model.safetensors"),
                        {{"model.norm.weight", w.view()}});
    Json c = Json::parse(read_text(golden_dir + "/adapter_config.json"));
    const auto adapter_dir = [&](const std::string& name, const std::string& on, bool saved) {
        fs::create_directories(d.file(name));
        Json cc = c;
        cc["base_model_name_or_path"] = fs::absolute(on).string();
        if (saved) cc["modules_to_save"] = Json::array({"model.norm"});
        write_text_atomic(d.file(name + "/adapter_config.json"), cc.dump());
        std::map<std::string, TensorView> extra;
        if (saved) extra.emplace("base_model.model.model.norm.weight", w.view());
        rewrite_safetensors(golden_dir + "/adapter_model.safetensors", d.file(name + "/adapter_model.safetensors"),
                            extra);
        return d.file(name);
    };
    PeftRun on_base(adapter_dir("on_base", d.file("base"), false));
    PeftRun saved(adapter_dir("saved", base, true));
    EXPECT_EQ(saved.src.config.lora.modules_to_save, (std::vector<std::string>{"model.norm"}));
    const Tensor logits = saved.logits(golden);
    EXPECT_TRUE(test::bitwise_equal(logits.view(), on_base.logits(golden).view()));
    const std::vector<model::PeftTensor> map =
        model::peft_tensor_map(saved.m.param_specs(), saved.src.config, "qwen3_next");
    model::save_peft_adapter(d.file("out"), map, saved.rt->params(), saved.src.config.lora, saved.src.base);
    const SafetensorsFile mine(d.file("out/adapter_model.safetensors"));
    EXPECT_TRUE(test::bitwise_equal(mine.load("base_model.model.model.norm.weight").view(), w.view()));
    EXPECT_EQ(Json::parse(read_text(d.file("out/adapter_config.json")))["modules_to_save"],
              Json::array({"model.norm"}));
    PeftRun back(d.file("out"));
    EXPECT_TRUE(test::bitwise_equal(back.logits(golden).view(), logits.view()));
}

TEST(Peft, WhatTesseraDoesNotReadIsAOneLineError) {
    const test::TempDir d;
    const std::string base = test::golden_path("hf/deepseek_v32_tiny_peft");
    const Json config = Json::parse(read_text(base + "/adapter_config.json"));
    auto with = [&](const std::string& key, const Json& value) {  // the golden adapter with one key changed
        fs::remove_all(d.file("a"));
        fs::create_directories(d.file("a"));
        Json c = config;
        c["base_model_name_or_path"] = fs::absolute(test::golden_path("hf/deepseek_v32_tiny")).string();
        c[key] = value;
        write_text_atomic(d.file("a/adapter_config.json"), c.dump());
        fs::copy_file(base + "/adapter_model.safetensors", d.file("a/adapter_model.safetensors"));
        return d.file("a");
    };
    test::expect_error([&] { train::open_model_source(with("use_dora", true)); }, "use_dora is not supported");
    test::expect_error([&] { train::open_model_source(with("target_parameters", Json::array({"w13_proj"}))); },
                       "target_parameters entry \"w13_proj\" names no stacked expert parameter");
    test::expect_error(
        [&] {
            train::open_model_source(with("rank_pattern", Json{{"q_a_proj", 4}}));
        },
        "rank_pattern \"q_a_proj\" (per-module ranks) is not supported");
    test::expect_error([&] { train::open_model_source(with("base_model_name_or_path", "org/some-hub-model")); },
                       "is not a local directory");
    test::expect_error([&] { train::open_model_source(with("modules_to_save", Json::array({"lm_head"}))); },
                       "modules_to_save entry \"lm_head\":");
    // a saved module's weights the config does not list in modules_to_save
    const std::string saved = test::golden_path("hf/deepseek_v32_tiny_peft_saved");
    fs::remove_all(d.file("a"));
    fs::create_directories(d.file("a"));
    Json c = Json::parse(read_text(saved + "/adapter_config.json"));
    c["base_model_name_or_path"] = fs::absolute(test::golden_path("hf/deepseek_v32_tiny")).string();
    c["modules_to_save"] = Json::array({"lm_head"});
    write_text_atomic(d.file("a/adapter_config.json"), c.dump());
    fs::copy_file(saved + "/adapter_model.safetensors", d.file("a/adapter_model.safetensors"));
    test::expect_error([&] { train::open_model_source(d.file("a")); },
                       "\"base_model.model.model.norm.weight\" is neither a LoRA adapter tensor");
}

}  // namespace
}  // namespace tessera
