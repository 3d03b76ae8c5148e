// PEFT adapters (model/hf_peft.h) against PEFT itself: tests/golden/hf/deepseek_v32_tiny_peft is a LoRA adapter
// PEFT made and saved on transformers' own tiny DeepSeek-V3.2 (tools/ref/make_peft_golden.py; MLA's five
// projections in every layer, random A and B). Read on its base, tessera gives PEFT's logits, loss and the gradient
// of every adapter tensor, and writes the same adapter files back.
#include <gtest/gtest.h>

#include <filesystem>

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
    model::ModelRuntime rt(m, shape, /*with_grads=*/true, /*recompute=*/false);
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
    test::expect_error([&] { train::open_model_source(with("target_parameters", Json::array({"gate_up_proj"}))); },
                       "target_parameters");
    test::expect_error([&] { train::open_model_source(with("rank_pattern", Json{{"q_a_proj", 4}})); }, "rank_pattern");
    test::expect_error([&] { train::open_model_source(with("base_model_name_or_path", "org/some-hub-model")); },
                       "is not a local directory");
}

}  // namespace
}  // namespace tessera
