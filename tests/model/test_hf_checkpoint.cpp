// Hugging Face checkpoints of the Kimi family: the tensor names and shapes of the published Kimi K3
// layout (spec/kimi_k3.md §5), a sharded save + load round trip that is bitwise, MXFP4 routed experts
// dequantised on load, and clear errors for missing or unused tensors.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <functional>
#include <set>
#include <sstream>

#include "core/file.h"
#include "core/safetensors.h"
#include "model/hf_checkpoint.h"
#include "model/hf_config.h"
#include "model/lora.h"
#include "model/model.h"
#include "model/runtime.h"
#include "util/test_util.h"

namespace tessera {
namespace {

model::ModelConfig tiny_kimi(const std::function<void(Json&)>& edit = {}) {
    Json j = Json::parse(R"({
        "vocab_size": 64, "d_model": 32, "n_layers": 3, "n_heads": 2, "ffn_dim": 48,
        "attention": ["kda", "kda", "mla"],
        "kda": {"head_dim": 16, "gate_lower_bound": -5.0, "full_rank_output_gate": true},
        "mla": {"q_lora_rank": 16, "kv_lora_rank": 16, "qk_nope_dim": 8, "qk_rope_dim": 8, "v_head_dim": 8},
        "moe": {"experts": 4, "topk": 2, "ffn_dim": 16, "shared_ffn_dim": 16, "first_dense": 1}})");
    if (edit) edit(j);
    return model::parse_model_config(j, "tiny");
}

const model::HfTensor* find(const std::vector<model::HfTensor>& map, const std::string& name) {
    for (const auto& t : map) {
        if (t.name == name) return &t;
    }
    return nullptr;
}

TEST(HfCheckpoint, KimiK3NamesAndShapesAreThePublishedOnes) {
    Json doc = Json::parse(read_text(std::string(TESSERA_SOURCE_DIR) + "/configs/hf/kimi_k3.json"));
    const model::ModelConfig c = model::import_hf_config(doc, "k3").model;
    const model::Model m(c);  // parameter specs only
    const auto map = model::hf_tensor_map(m.param_specs(), c, "kimi_k3");
    const std::string P = "language_model.model.layers.";
    const std::vector<std::pair<std::string, Shape>> want = {
        {"language_model.model.embed_tokens.weight", Shape{163840, 7168}},
        {"language_model.lm_head.weight", Shape{163840, 7168}},
        {"language_model.model.norm.weight", Shape{7168}},
        {P + "0.self_attn.q_conv1d.weight", Shape{12288, 1, 4}},
        {P + "0.self_attention_res_norm.weight", Shape{7168}},
        {P + "92.mlp_res_proj.weight", Shape{1, 7168}},
        {"language_model.model.output_attn_res_proj.weight", Shape{1, 7168}},
        {P + "0.self_attn.A_log", Shape{128}},
        {P + "0.self_attn.f_a_proj.weight", Shape{128, 7168}},
        {P + "0.self_attn.f_b_proj.weight", Shape{12288, 128}},
        {P + "0.self_attn.b_proj.weight", Shape{96, 7168}},
        {P + "0.self_attn.g_proj.weight", Shape{12288, 7168}},
        {P + "0.self_attn.dt_bias", Shape{12288}},
        {P + "0.self_attn.o_norm.weight", Shape{128}},
        {P + "0.mlp.gate_proj.weight", Shape{33792, 7168}},
        {P + "3.self_attn.q_a_proj.weight", Shape{1536, 7168}},
        {P + "3.self_attn.q_b_proj.weight", Shape{18432, 1536}},
        {P + "3.self_attn.kv_a_proj_with_mqa.weight", Shape{576, 7168}},
        {P + "3.self_attn.kv_a_layernorm.weight", Shape{512}},
        {P + "3.self_attn.kv_b_proj.weight", Shape{24576, 512}},
        {P + "3.self_attn.o_proj.weight", Shape{7168, 12288}},
        {P + "1.post_attention_layernorm.weight", Shape{7168}},
        {P + "1.block_sparse_moe.gate.weight", Shape{896, 7168}},
        {P + "1.block_sparse_moe.gate.e_score_correction_bias", Shape{896}},
        {P + "1.block_sparse_moe.routed_expert_down_proj.weight", Shape{3584, 7168}},
        {P + "1.block_sparse_moe.routed_expert_norm.weight", Shape{3584}},
        {P + "1.block_sparse_moe.routed_expert_up_proj.weight", Shape{7168, 3584}},
        {P + "1.block_sparse_moe.shared_experts.down_proj.weight", Shape{7168, 6144}},
        {P + "92.block_sparse_moe.experts.895.w1.weight", Shape{3072, 3584}},
        {P + "92.block_sparse_moe.experts.895.w2.weight", Shape{3584, 3072}},
        // the image tower and projector (spec §5), under their own names
        {"vision_tower.patch_embed.proj.weight", Shape{1024, 3, 14, 14}},
        {"vision_tower.patch_embed.pos_emb.weight", Shape{64, 64, 1024}},
        {"vision_tower.encoder.blocks.26.wqkv.weight", Shape{4608, 1024}},
        {"vision_tower.encoder.blocks.26.wo.weight", Shape{1024, 1536}},
        {"vision_tower.encoder.blocks.0.mlp.fc0.weight", Shape{4096, 1024}},
        {"vision_tower.encoder.final_layernorm.weight", Shape{1024}},
        {"mm_projector.proj.0.weight", Shape{4096, 4096}},
        {"mm_projector.proj.2.weight", Shape{7168, 4096}},
        {"mm_projector.post_norm.weight", Shape{7168}},
    };
    for (const auto& [name, shape] : want) {
        const model::HfTensor* t = find(map, name);
        ASSERT_NE(t, nullptr) << name;
        EXPECT_EQ(t->shape, shape) << name;
    }
    for (const auto& t : map) EXPECT_EQ(t.name.find("g_a_proj"), std::string::npos) << t.name;
    // §5's text tensors, with each routed expert's w1/w2/w3 counted dense: 2 embeddings + norm + 2 output
    // AttnRes; per layer 2 norms + 4 AttnRes + g + o; KDA q, k, v, 3 convs, f_a, f_b, b, A_log, dt_bias,
    // o_norm (12); MLA 6; the dense MLP 3; MoE router, bias, 3 latent, 3 shared (8) + 3·896 experts; then the
    // tower: patch conv, position table, 6 per block, final norm; the projector 3
    EXPECT_EQ(map.size(), size_t(5 + 93 * 8 + 69 * 12 + 24 * 6 + 3 + 92 * (8 + 3 * 896) + 2 + 27 * 6 + 1 + 3));
}

// Every tensor of a safetensors file but `skip`, as owned copies: tests rewrite a shard around a replaced tensor.
struct ShardCopy {
    std::vector<Tensor> copies;
    std::vector<NamedTensor> named;
};
ShardCopy all_but(const SafetensorsFile& file, const std::string& skip) {
    ShardCopy s;
    for (const auto& e : file.entries()) {
        if (e.name != skip) s.copies.push_back(file.load(e.name));
    }
    size_t i = 0;
    for (const auto& e : file.entries()) {
        if (e.name != skip) s.named.push_back({e.name, s.copies[i++].view()});
    }
    return s;
}

struct Rig {
    explicit Rig(uint64_t seed) : m(tiny_kimi()), rt(m, {1, 1}, false, {}) { m.init_params(rt.params(), seed); }
    model::Model m;
    model::ModelRuntime rt;
};

TEST(HfCheckpoint, ShardedRoundTripIsBitwiseWithTheKimiLinearLayout) {
    test::TempDir d;
    Rig a(1), b(2);
    const auto map = model::hf_tensor_map(a.m.param_specs(), a.m.config(), "kimi_linear");
    model::save_hf_checkpoint(d.path(), map, a.rt.params(), 20000);
    const Json index = Json::parse(read_text(d.file("model.safetensors.index.json")));
    const Json& wm = index["weight_map"];
    for (const char* name : {"model.layers.1.block_sparse_moe.experts.3.w2.weight", "model.layers.0.self_attn.A_log",
                             "model.layers.0.self_attn.q_conv1d.weight", "model.layers.0.mlp.down_proj.weight",
                             "model.layers.2.self_attn.kv_b_proj.weight", "lm_head.weight"}) {
        ASSERT_TRUE(wm.contains(name)) << name;
    }
    SafetensorsFile conv(d.file(wm["model.layers.0.self_attn.q_conv1d.weight"]));
    EXPECT_EQ(conv.entry("model.layers.0.self_attn.q_conv1d.weight").shape, (Shape{32, 1, 4}));
    SafetensorsFile alog(d.file(wm["model.layers.0.self_attn.A_log"]));
    EXPECT_EQ(alog.entry("model.layers.0.self_attn.A_log").shape, (Shape{1, 1, 2, 1}));
    SafetensorsFile w2(d.file(wm["model.layers.1.block_sparse_moe.experts.3.w2.weight"]));
    EXPECT_EQ(w2.entry("model.layers.1.block_sparse_moe.experts.3.w2.weight").shape, (Shape{32, 16}));
    std::set<std::string> shards;
    for (auto it = wm.begin(); it != wm.end(); ++it) shards.insert(it.value().get<std::string>());
    EXPECT_GT(shards.size(), 2u);
    model::load_hf_checkpoint(d.path(), map, b.rt.params());
    for (const auto& s : a.m.param_specs()) {
        EXPECT_TRUE(test::bitwise_equal(a.rt.params().view(s.name), b.rt.params().view(s.name))) << s.name;
    }
}

// Rewrites the saved Kimi-Linear checkpoint in `d` with expert 2's w1 [rows, 32] of layer 1 stored as MXFP4
// (compressed-tensors' weight_packed [rows, 16] + weight_scale [rows, 1]).
void store_w1_as_mxfp4(const test::TempDir& d, const Tensor& packed, const Tensor& scale) {
    Json index = Json::parse(read_text(d.file("model.safetensors.index.json")));
    const std::string w1 = "model.layers.1.block_sparse_moe.experts.2.w1.weight";
    index["weight_map"].erase(w1);
    const std::string shard = index["weight_map"].begin().value();
    ShardCopy rest = all_but(SafetensorsFile(d.file(shard)), w1);
    std::vector<NamedTensor>& keep = rest.named;
    keep.push_back({w1 + "_packed", packed.view()});
    keep.push_back({w1 + "_scale", scale.view()});
    write_safetensors(d.file("mx.safetensors"), keep);
    for (auto& e : keep) index["weight_map"][e.name] = "mx.safetensors";
    write_text_atomic(d.file("model.safetensors.index.json"), index.dump());
    std::filesystem::remove(d.file(shard));
}

TEST(HfCheckpoint, Mxfp4ExpertsAreDequantisedOnLoad) {
    test::TempDir d;
    Rig a(1), b(2);
    const auto map = model::hf_tensor_map(a.m.param_specs(), a.m.config(), "kimi_linear");
    model::save_hf_checkpoint(d.path(), map, a.rt.params());
    // expert 2's w1 [16, 32] of layer 1 in MXFP4: every byte 0x21 (0.5, 1.0), scales 2^(row − 4)
    Tensor packed(DType::u8, Shape{16, 16}), scale(DType::u8, Shape{16, 1});
    for (int64_t r = 0; r < 16; ++r) {
        scale.view().ptr<uint8_t>()[r] = uint8_t(127 + r - 4);
        for (int64_t c = 0; c < 16; ++c) packed.view().ptr<uint8_t>()[r * 16 + c] = 0x21;
    }
    store_w1_as_mxfp4(d, packed, scale);
    model::load_hf_checkpoint(d.path(), map, b.rt.params());
    TensorView ex = b.rt.params().view("model.layers.1.mlp.experts.gate_proj.weight").slice0(2, 3);
    for (int64_t r = 0; r < 16; ++r) {
        const float s = std::ldexp(1.0f, int(r) - 4);
        for (int64_t c = 0; c < 32; ++c)
            EXPECT_EQ(ex.ptr<float>()[r * 32 + c], (c % 2 ? 1.0f : 0.5f) * s) << r << "," << c;
    }
}

// model.lora.expert_dtype = mxfp4: an MXFP4 checkpoint's experts are held byte for byte (never through f32 and
// back), the others quantised on load, and the model computes, bit for bit, what the f32-held model computes on the
// widened values
TEST(HfCheckpoint, Mxfp4ExpertsAreHeldByteForByte) {
    auto wide_experts = [](Json& j) { j["moe"]["ffn_dim"] = 32; };  // w2's rows: whole blocks of 32
    auto with_lora = [&](const std::string& experts) {
        return tiny_kimi([&](Json& j) {
            wide_experts(j);
            j["lora"] = Json{{"rank", 4}, {"target_modules", {"o_proj"}}, {"expert_dtype", experts}};
        });
    };
    test::TempDir d;
    {
        model::Model plain(tiny_kimi(wide_experts));
        model::ModelRuntime rt(plain, {1, 1}, false, {});
        plain.init_params(rt.params(), 1);
        model::save_hf_checkpoint(d.path(), model::hf_tensor_map(plain.param_specs(), plain.config(), "kimi_linear"),
                                  rt.params());
    }
    Tensor packed(DType::u8, Shape{32, 16}), scale(DType::u8, Shape{32, 1});
    for (int64_t r = 0; r < 32; ++r) {
        scale.view().ptr<uint8_t>()[r] = uint8_t(127 + r % 8 - 6);
        for (int64_t c = 0; c < 16; ++c) packed.view().ptr<uint8_t>()[r * 16 + c] = uint8_t((r * 7 + c * 13) & 0xFF);
    }
    store_w1_as_mxfp4(d, packed, scale);
    model::Model f(with_lora("f32")), m(with_lora("mxfp4"));
    model::ModelRuntime frt(f, {1, 8}, false, {}), mrt(m, {1, 8}, false, {});
    f.init_params(frt.params(), 3);  // the adapters (B = 0)
    m.init_params(mrt.params(), 3);
    std::vector<BufferSpec> base;
    for (const BufferSpec& s : f.param_specs())
        if (!model::is_adapter(s.name)) base.push_back(s);
    const auto map = model::hf_tensor_map(base, f.config(), "kimi_linear");
    model::load_hf_checkpoint(d.path(), map, frt.params());
    model::load_hf_checkpoint(d.path(), map, mrt.params());
    const std::string gate = "model.layers.1.mlp.experts.gate_proj.weight";
    const TensorView held = mrt.params().view(gate);
    ASSERT_EQ(held.dtype, DType::mxfp4);
    const uint8_t* blocks = static_cast<const uint8_t*>(held.slice0(2, 3).data);
    for (int64_t r = 0; r < 32; ++r) {  // expert 2: one block a row, its scale byte then its packed bytes
        EXPECT_EQ(blocks[r * 17], scale.view().ptr<uint8_t>()[r]) << r;
        for (int64_t c = 0; c < 16; ++c) EXPECT_EQ(blocks[r * 17 + 1 + c], packed.view().ptr<uint8_t>()[r * 16 + c]);
    }
    // widened, expert 2 is the f32 model's dequantised values bitwise; the f32 model takes the others as quantised
    Tensor wide(DType::f32, held.shape);
    convert(held, wide);
    const TensorView f32_gate = frt.params().view(gate);
    EXPECT_TRUE(test::bitwise_equal(wide.view().slice0(2, 3), f32_gate.slice0(2, 3)));
    EXPECT_FALSE(test::bitwise_equal(wide.view().slice0(0, 1), f32_gate.slice0(0, 1)));  // quantised: lossy
    for (const BufferSpec& s : m.param_specs())
        if (s.dtype == DType::mxfp4) convert(mrt.params().view(s.name), frt.params().view(s.name));
    const std::vector<int32_t> ids = {1, 5, 9, 2, 63, 17, 4, 40};
    Tensor want(DType::f32, Shape{8, 64}), got(DType::f32, Shape{8, 64});
    f.forward_logits({1, 8}, ids, want);
    m.forward_logits({1, 8}, ids, got);
    EXPECT_TRUE(test::bitwise_equal(got, want));
}

TEST(HfCheckpoint, DeepSeekFp8WeightsAreDequantisedOnLoad) {
    // the transformers-written DeepSeek-V3.2 golden with q_b_proj of layer 1 re-stored as block-scaled FP8:
    // codes 0x38 + (c % 8) = 1 + (c % 8)/8, negative on odd rows, scale_inv 0.25 for the one 128 × 128 block
    const std::string src = test::golden_path("hf/deepseek_v32_tiny");
    const model::HfImport hf = model::import_hf_config(Json::parse(read_text(src + "/config.json")), "config.json");
    model::Model m(hf.model);
    model::ModelRuntime rt(m, {1, 1}, false, {});
    const auto map = model::hf_tensor_map(m.param_specs(), hf.model, hf.model_type);
    const std::string w = "model.layers.1.self_attn.q_b_proj.weight";
    const SafetensorsFile orig(src + "/model.safetensors");
    const ShardCopy kept = all_but(orig, w);
    const Shape shape = orig.entry(w).shape;
    Tensor q(DType::f8e4m3, shape), scale(DType::f32, Shape{1, 1});
    for (int64_t r = 0; r < shape[0]; ++r) {
        for (int64_t c = 0; c < shape[1]; ++c) {
            static_cast<uint8_t*>(q.view().data)[r * shape[1] + c] = uint8_t((0x38 + c % 8) | (r % 2 ? 0x80 : 0));
        }
    }
    scale.ptr<float>()[0] = 0.25f;
    test::TempDir d;
    std::vector<NamedTensor> fp8 = kept.named;
    fp8.push_back({w, q.view()});
    write_safetensors(d.file("model.safetensors"), fp8);
    test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, rt.params()); },
                       "needs a 2-D shape and \"" + w + "_scale_inv\"");
    fp8.push_back({w + "_scale_inv", scale.view()});
    write_safetensors(d.file("model.safetensors"), fp8);
    model::load_hf_checkpoint(d.path(), map, rt.params());
    const TensorView got = rt.params().view(w);
    for (int64_t r = 0; r < shape[0]; ++r) {
        for (int64_t c = 0; c < shape[1]; ++c) {
            EXPECT_EQ(got.ptr<float>()[r * shape[1] + c], (r % 2 ? -0.25f : 0.25f) * (1.0f + float(c % 8) / 8.0f));
        }
    }
}

TEST(HfCheckpoint, MissingAndUnusedTensorsAreNamed) {
    test::TempDir d;
    Rig a(1), b(2);
    const auto map = model::hf_tensor_map(a.m.param_specs(), a.m.config(), "kimi_linear");
    model::save_hf_checkpoint(d.path(), map, a.rt.params());
    Json index = Json::parse(read_text(d.file("model.safetensors.index.json")));
    const std::string file = index["weight_map"]["model.norm.weight"];
    index["weight_map"].erase("model.norm.weight");
    write_text_atomic(d.file("model.safetensors.index.json"), index.dump());
    test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, b.rt.params()); },
                       "has no tensor \"model.norm.weight\"");
    index["weight_map"]["model.norm.weight"] = file;
    Tensor extra(DType::f32, Shape{4});
    write_safetensors(d.file("extra.safetensors"), {{"model.output_attn_res_proj.weight", extra.view()}});
    index["weight_map"]["model.output_attn_res_proj.weight"] = "extra.safetensors";
    write_text_atomic(d.file("model.safetensors.index.json"), index.dump());
    test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, b.rt.params()); },
                       "1 tensor(s) the model does not use, e.g. \"model.output_attn_res_proj.weight\"");
    test::expect_error([&] { model::hf_tensor_map(a.m.param_specs(), a.m.config(), "llama"); },
                       "llama checkpoints are not supported yet");
    write_text_atomic(d.file("model.safetensors.index.json"), "{\"weight_map\": [");
    test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, b.rt.params()); }, "not valid JSON");
}

TEST(HfCheckpoint, KimiK3LayoutPadsALogAndRefusesANonZeroPad) {
    test::TempDir d;
    Rig a(1), b(2);
    const auto map = model::hf_tensor_map(a.m.param_specs(), a.m.config(), "kimi_k3");
    EXPECT_EQ(map.front().name.rfind("language_model.model.", 0), 0u) << map.front().name;
    model::save_hf_checkpoint(d.path(), map, a.rt.params());
    const Json index = Json::parse(read_text(d.file("model.safetensors.index.json")));
    const std::string name = "language_model.model.layers.0.self_attn.A_log";
    const std::string file = d.file(index["weight_map"][name].get<std::string>());
    Tensor alog = SafetensorsFile(file).load(name);
    ASSERT_EQ(alog.view().shape, (Shape{128}));
    for (int64_t i = 2; i < 128; ++i) ASSERT_EQ(alog.ptr<float>()[i], 0.f) << i;  // 2 heads used, zero pad
    model::load_hf_checkpoint(d.path(), map, b.rt.params());
    EXPECT_TRUE(test::bitwise_equal(a.rt.params().view("model.layers.0.self_attn.A_log"),
                                    b.rt.params().view("model.layers.0.self_attn.A_log")));
    // a non-zero pad means the layout is not what we think: refused
    SafetensorsFile all(file);
    std::vector<Tensor> keep;
    std::vector<NamedTensor> named;
    for (const auto& e : all.entries()) keep.push_back(all.load(e.name));
    for (size_t i = 0; i < all.entries().size(); ++i) {
        if (all.entries()[i].name == name) keep[i].ptr<float>()[7] = 0.5f;
        named.push_back({all.entries()[i].name, keep[i].view()});
    }
    write_safetensors(file, named);
    test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, b.rt.params()); }, "pads with 0.5 at 7");
}

TEST(HfCheckpoint, AKimiK3WithAnImageTowerExportsAndLoadsBackBitwise) {
    const model::ModelConfig c = tiny_kimi([](Json& j) {
        j["attn_res_block_size"] = 2;
        j["kda"]["o_norm_eps"] = 1e-6;
        j["vision"] = Json::parse(R"({"layers": 2, "width": 16, "heads": 2, "head_dim": 8, "ffn_dim": 32,
            "patch_size": 2, "pos_height": 4, "pos_width": 4, "image_token": 5})");
    });
    const Json hf = model::export_hf_config(c);
    ASSERT_TRUE(hf.contains("vision_config")) << hf.dump();
    EXPECT_EQ(hf["media_placeholder_token_id"], 5);
    const model::HfImport back = model::import_hf_config(hf, "exported");
    EXPECT_TRUE(back.unsupported.empty()) << back.unsupported.front();
    EXPECT_EQ(model::to_json(back.model.vision), model::to_json(c.vision));
    model::Model m(c);
    model::ModelRuntime a(m, {1, 1}, false, {}), b(m, {1, 1}, false, {});
    m.init_params(a.params(), 1);
    const auto map = model::hf_tensor_map(m.param_specs(), c, "kimi_k3");
    test::TempDir d;
    model::save_hf_checkpoint(d.path(), map, a.params());
    model::load_hf_checkpoint(d.path(), map, b.params());  // every stored tensor used, the tower's included
    for (const char* name : {"vision_tower.patch_embed.proj.weight", "vision_tower.encoder.blocks.1.wqkv.weight",
                             "mm_projector.proj.2.weight"}) {
        EXPECT_TRUE(test::bitwise_equal(a.params().view(name), b.params().view(name))) << name;
    }
    // the tower lives only in Kimi K3's format
    model::ModelConfig plain = c;
    plain.attn_res_block_size = 0;
    test::expect_error([&] { (void)model::export_hf_config(plain); }, "an image tower comes with Kimi K3");
}

TEST(HfCheckpoint, TiedKimiModelsWriteTheirHeadAndAcceptItBack) {
    // transformers' Kimi-Linear never ties lm_head: a tied model is exported with the head as its own tensor (and
    // the config says tie_word_embeddings = false); a tied checkpoint carrying a head equal to the embedding loads
    for (const char* type : {"kimi_linear", "kimi_k3"}) {
        SCOPED_TRACE(type);
        model::ModelConfig c = tiny_kimi();
        c.tie_embeddings = true;
        model::Model m(c);
        model::ModelRuntime a(m, {1, 1}, false, {}), b(m, {1, 1}, false, {});
        m.init_params(a.params(), 1);
        const auto map = model::hf_tensor_map(m.param_specs(), c, type);
        test::TempDir d;
        model::save_hf_checkpoint(d.path(), map, a.params());
        const std::string head = std::string(type) == "kimi_k3" ? "language_model.lm_head.weight" : "lm_head.weight";
        const SafetensorsFile f(d.file("model-00001-of-00001.safetensors"));
        ASSERT_TRUE(f.contains(head));
        EXPECT_TRUE(test::bitwise_equal(f.load(head).view(), a.params().view("model.embed_tokens.weight")));
        model::load_hf_checkpoint(d.path(), map, b.params());  // the stored head is accepted
        EXPECT_TRUE(test::bitwise_equal(a.params().view("model.embed_tokens.weight"),
                                        b.params().view("model.embed_tokens.weight")));
        model::ModelConfig again = c;
        EXPECT_FALSE(model::untie_stored_head(d.path(), again, type));  // equal: the model stays tied
        EXPECT_TRUE(again.tie_embeddings);
        // a different stored head: transformers' Kimi computes with it, so the model is untied and loads it
        ShardCopy rest = all_but(f, head);
        Tensor other = f.load(head);
        other.ptr<float>()[5] += 1.0f;
        rest.named.push_back({head, other.view()});
        write_safetensors(d.file("model-00001-of-00001.safetensors"), rest.named);
        test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, b.params()); },
                           "\"" + head + "\" differs from model.embed_tokens.weight although the config ties them");
        EXPECT_TRUE(model::untie_stored_head(d.path(), again, type));
        EXPECT_FALSE(again.tie_embeddings);
        model::Model untied(again);
        model::ModelRuntime u(untied, {1, 1}, false, {});
        model::load_hf_checkpoint(d.path(), model::hf_tensor_map(untied.param_specs(), again, type), u.params());
        EXPECT_TRUE(test::bitwise_equal(u.params().view("lm_head.weight"), other.view()));
    }
}

TEST(HfCheckpoint, TiedQwenAndDeepSeekModelsStoreNoHeadAndRefuseADifferentOne) {
    // transformers ties these families: save_pretrained writes no lm_head, and a stored one must equal the embedding
    for (const char* name : {"qwen3_next_tiny", "deepseek_v32_tiny"}) {
        SCOPED_TRACE(name);
        const std::string src = test::golden_path(std::string("hf/") + name);
        model::HfImport hf = model::import_hf_config(Json::parse(read_text(src + "/config.json")), "config.json");
        hf.model.tie_embeddings = true;
        model::Model m(hf.model);
        model::ModelRuntime rt(m, {1, 1}, false, {});
        m.init_params(rt.params(), 3);
        const auto map = model::hf_tensor_map(m.param_specs(), hf.model, hf.model_type);
        test::TempDir d;
        model::save_hf_checkpoint(d.path(), map, rt.params());
        const SafetensorsFile f(d.file("model-00001-of-00001.safetensors"));
        EXPECT_FALSE(f.contains("lm_head.weight"));
        EXPECT_FALSE(model::untie_stored_head(d.path(), hf.model, hf.model_type));
        ShardCopy all = all_but(f, "");
        Tensor head = f.load("model.embed_tokens.weight");
        all.named.push_back({"lm_head.weight", head.view()});
        write_safetensors(d.file("model-00001-of-00001.safetensors"), all.named);
        Json index = Json::parse(read_text(d.file("model.safetensors.index.json")));
        index["weight_map"]["lm_head.weight"] = "model-00001-of-00001.safetensors";
        write_text_atomic(d.file("model.safetensors.index.json"), index.dump());
        model::load_hf_checkpoint(d.path(), map, rt.params());  // equal: accepted
        head.ptr<float>()[0] += 1.0f;
        write_safetensors(d.file("model-00001-of-00001.safetensors"), all.named);
        test::expect_error([&] { model::load_hf_checkpoint(d.path(), map, rt.params()); },
                           "\"lm_head.weight\" differs from model.embed_tokens.weight");
    }
}

class TransformersInterop : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersInterop, ASavedTransformersModelGivesTransformersLogits) {
    // tests/golden/hf/<case>: written by transformers' KimiLinearForCausalLM / Qwen3NextForCausalLM /
    // DeepseekV32ForCausalLM .save_pretrained (tools/ref/make_hf_interop_golden.py), with its own float32 logits for
    // two rows of ids
    const std::string dir = test::golden_path("hf/" + GetParam());
    model::HfImport hf = model::import_hf_config(Json::parse(read_text(dir + "/config.json")), "config.json");
    EXPECT_TRUE(hf.unsupported.empty()) << hf.unsupported.front();
    // kimi_linear_tied_tiny: tied in its config, yet transformers' Kimi-Linear computes with its stored head
    EXPECT_EQ(model::untie_stored_head(dir, hf.model, hf.model_type), GetParam() == "kimi_linear_tied_tiny");
    model::Model m(hf.model);
    SafetensorsFile golden(test::golden_path("hf/" + GetParam() + "_logits.safetensors"));
    const Tensor ids64 = golden.load("ids");
    const int64_t B = ids64.view().size(0), T = ids64.view().size(1), V = hf.model.vocab_size;
    model::ModelRuntime rt(m, {B, T}, false, {});
    const auto map = model::hf_tensor_map(m.param_specs(), hf.model, hf.model_type);
    model::load_hf_checkpoint(dir, map, rt.params());
    std::vector<int32_t> ids(ids64.view().ptr<int64_t>(), ids64.view().ptr<int64_t>() + B * T);
    Tensor logits(DType::f32, Shape{B * T, V});
    m.forward_logits({B, T}, ids, logits);
    EXPECT_TRUE(test::rel_rms_close(logits, golden.load("expected.logits").view().reshape(Shape{B * T, V}), 1e-4));
    // saving in the same layout and loading again is bitwise (fused tensors reassembled, norm offsets undone)
    test::TempDir d;
    model::save_hf_checkpoint(d.path(), map, rt.params(), 4096);
    model::ModelRuntime back(m, {1, 1}, false, {});
    model::load_hf_checkpoint(d.path(), map, back.params());
    for (const auto& spec : m.param_specs()) {
        EXPECT_TRUE(test::bitwise_equal(rt.params().view(spec.name), back.params().view(spec.name))) << spec.name;
    }
}

INSTANTIATE_TEST_SUITE_P(Families,
                         TransformersInterop,
                         ::testing::Values("kimi_linear_tiny",
                                           "qwen3_next_tiny",
                                           "deepseek_v32_tiny",
                                           "deepseek_v32_yarn_tiny",
                                           "qwen3_next_yarn_tiny",
                                           "kimi_linear_tied_tiny"));

TEST(TransformersInterop, DecodingWithYarnGivesTransformersLogitsAtEveryPosition) {
    // the caches (KV, indexer keys, GDN state) see the same YaRN frequencies as the full forward
    for (const char* name : {"deepseek_v32_yarn_tiny", "qwen3_next_yarn_tiny"}) {
        SCOPED_TRACE(name);
        const std::string dir = test::golden_path(std::string("hf/") + name);
        const model::HfImport hf = model::import_hf_config(Json::parse(read_text(dir + "/config.json")), "config.json");
        ASSERT_TRUE(hf.model.rope_scaling.enabled());
        SafetensorsFile golden(test::golden_path(std::string("hf/") + name + "_logits.safetensors"));
        const Tensor ids64 = golden.load("ids"), want = golden.load("expected.logits");
        const int64_t B = ids64.view().size(0), T = ids64.view().size(1), V = hf.model.vocab_size;
        model::Model m(hf.model);
        BufferGroup cache("cache", m.cache_specs(B, T));
        model::ModelRuntime rt(m, {B, 1}, false, {}, {&cache});
        m.bind_cache(cache);
        model::load_hf_checkpoint(dir, model::hf_tensor_map(m.param_specs(), hf.model, hf.model_type), rt.params());
        Tensor step(DType::f32, Shape{B, V}), expected(DType::f64, Shape{B, V});
        for (int64_t pos = 0; pos < T; ++pos) {
            std::vector<int32_t> tok;
            for (int64_t b = 0; b < B; ++b) {
                tok.push_back(int32_t(ids64.view().ptr<int64_t>()[b * T + pos]));
                const double* row = want.view().ptr<double>() + (b * T + pos) * V;
                std::copy(row, row + V, expected.ptr<double>() + b * V);
            }
            m.decode_step(pos, tok, step);
            EXPECT_TRUE(test::rel_rms_close(step, expected, 1e-4)) << "position " << pos;
        }
    }
}

TEST(TransformersInterop, Qwen3NextTrainingLossAndGradientsWithTheRouterAuxLossAreTransformers) {
    // qwen3_next_yarn_tiny (output_router_logits, router_aux_loss_coef 0.05 -> model.moe.global_aux_coeff): the
    // gradient of transformers' loss + 0.05 · load_balancing_loss_func for labels = ids, every parameter, against
    // tessera's forward_backward with the same shifted targets
    const std::string dir = test::golden_path("hf/qwen3_next_yarn_tiny");
    const model::HfImport hf = model::import_hf_config(Json::parse(read_text(dir + "/config.json")), "config.json");
    ASSERT_EQ(hf.model.moe.global_aux_coeff, 0.05);
    model::Model m(hf.model);
    SafetensorsFile golden(test::golden_path("hf/qwen3_next_yarn_tiny_logits.safetensors"));
    const Tensor ids64 = golden.load("ids");
    const int64_t B = ids64.view().size(0), T = ids64.view().size(1);
    model::ModelRuntime rt(m, {B, T}, /*with_grads=*/true, {});
    const auto map = model::hf_tensor_map(m.param_specs(), hf.model, hf.model_type);
    model::load_hf_checkpoint(dir, map, rt.params());
    std::vector<int32_t> ids(size_t(B * T)), targets(size_t(B * T));
    for (int64_t i = 0; i < B * T; ++i) {
        ids[size_t(i)] = int32_t(ids64.view().ptr<int64_t>()[i]);
        targets[size_t(i)] = i % T == T - 1 ? model::Model::kIgnoreIndex : int32_t(ids64.view().ptr<int64_t>()[i + 1]);
    }
    rt.grads().zero();
    const model::LossResult lm = m.forward_backward({B, T}, ids, targets, 1.0);
    const double aux = m.take_global_aux_loss();
    EXPECT_NEAR(lm.loss + aux, golden.load("expected.loss").ptr<double>()[0], 1e-5);
    EXPECT_NEAR(aux, 0.05 * golden.load("expected.aux_loss").ptr<double>()[0], 1e-6);
    // the gradients in the checkpoint layout (fused tensors assembled; norm offsets do not apply to gradients)
    std::vector<model::HfTensor> grad_map = map;
    for (auto& t : grad_map) t.offset = 0.f;
    test::TempDir d;
    model::save_hf_checkpoint(d.path(), grad_map, rt.grads());
    const SafetensorsFile grads(d.file("model-00001-of-00001.safetensors"));
    int checked = 0;
    for (const auto& e : grads.entries()) {
        ASSERT_TRUE(golden.contains("grad." + e.name)) << e.name;
        EXPECT_TRUE(test::rel_rms_close(grads.load(e.name).view(), golden.load("grad." + e.name).view(), 1e-4))
            << e.name;
        ++checked;
    }
    EXPECT_GT(checked, 40);
    // without the aux loss the router gradients differ: the comparison above sees it
    model::ModelConfig plain = hf.model;
    plain.moe.global_aux_coeff = 0;
    model::Model p(plain);
    model::ModelRuntime prt(p, {B, T}, true, {});
    model::load_hf_checkpoint(dir, map, prt.params());
    prt.grads().zero();
    p.forward_backward({B, T}, ids, targets, 1.0);
    EXPECT_FALSE(test::rel_rms_close(prt.grads().view("model.layers.1.mlp.gate.weight"),
                                     rt.grads().view("model.layers.1.mlp.gate.weight"), 1e-3));
}

}  // namespace
}  // namespace tessera
