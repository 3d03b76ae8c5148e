// Hugging Face config import and model summaries against the published configs (configs/hf/) and the
// exact parameter accounting of spec/kimi_k3.md §4.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
#include <sstream>

#include "core/file.h"
#include "model/hf_config.h"
#include "model/inspect.h"
#include "model/model.h"
#include "train/config.h"
#include "util/test_util.h"

namespace tessera {
namespace {

Json hf(const std::string& name) {
    std::ifstream in(std::string(TESSERA_SOURCE_DIR) + "/configs/hf/" + name + ".json");
    std::stringstream ss;
    ss << in.rdbuf();
    return Json::parse(ss.str());
}

int64_t count(const model::ModelConfig& c, const std::string& type) {
    int64_t n = 0;
    for (int64_t i = 0; i < c.n_layers; ++i) n += c.layer_type(i) == type;
    return n;
}

bool mentions(const std::vector<std::string>& lines, const std::string& needle) {
    for (const auto& l : lines) {
        if (l.find(needle) != std::string::npos) return true;
    }
    return false;
}

TEST(HfConfig, KimiK3MapsEveryLayerAndCountsParametersExactly) {
    const model::HfImport r = model::import_hf_config(hf("kimi_k3"), "kimi_k3.json");
    const model::ModelConfig& m = r.model;
    EXPECT_EQ(m.n_layers, 93);
    EXPECT_EQ(count(m, "kda"), 69);
    EXPECT_EQ(count(m, "mla"), 24);
    for (int64_t i : {3, 7, 91, 92}) EXPECT_EQ(m.layer_type(i), "mla") << i;  // 1-based full_attn_layers
    for (int64_t i : {0, 1, 2, 4, 90}) EXPECT_EQ(m.layer_type(i), "kda") << i;
    EXPECT_FALSE(m.mla.rope);
    EXPECT_EQ(m.output_gate, "elementwise");
    EXPECT_EQ(m.kda.gate_lower_bound, -5.0);
    EXPECT_TRUE(m.kda.full_rank_output_gate);
    EXPECT_EQ(m.moe.experts, 896);
    EXPECT_EQ(m.moe.topk, 16);
    EXPECT_EQ(m.moe.shared_ffn_dim, 2 * 3072);
    EXPECT_EQ(m.moe.latent_dim, 3584);
    EXPECT_TRUE(m.moe.latent_norm);
    EXPECT_EQ(m.moe.activation, "situ");
    EXPECT_EQ(m.moe.scaling, 1.0);
    EXPECT_EQ(m.attn_res_block_size, 12);
    const model::ModelSummary s = model::summarize(m, 4096);
    // spec/kimi_k3.md §4: text model 2,779,484,476,000 (Attention Residuals included: 4·d per layer + 2·d), plus the
    // image tower and projector's 447,358,976 (§5)
    EXPECT_EQ(s.vision_params, 447358976);
    EXPECT_EQ(s.params - s.vision_params, 2779484476000LL);
    EXPECT_EQ(s.routed_expert_params, 2722740830208LL);
    EXPECT_DOUBLE_EQ(s.active_params, double(56743645792LL + 92LL * 16 * 33030144));
    EXPECT_TRUE(r.unsupported.empty()) << r.unsupported.front();
    EXPECT_FALSE(mentions(r.unsupported, "Attention Residuals"));
    EXPECT_FALSE(mentions(r.unsupported, "MXFP4"));  // dequantised on load
    EXPECT_EQ(m.mlp_activation, "situ");             // layer 0's dense MLP
    EXPECT_FALSE(mentions(r.unsupported, "not interpreted")) << "every key of the published file is accounted for";
}

TEST(HfConfig, KimiK3WithIndexFieldsIsTheGatedDsaVariant) {
    Json doc = hf("kimi_k3");
    doc["text_config"]["index_topk"] = 2048;
    doc["text_config"]["index_n_heads"] = 64;
    doc["text_config"]["index_head_dim"] = 128;
    const model::HfImport r = model::import_hf_config(doc, "k3_dsa.json");
    EXPECT_EQ(count(r.model, "dsa"), 24);
    EXPECT_EQ(r.model.mla.dsa.topk, 2048);
    // one indexer per DSA layer: wq_b [64·128, 1536] + wk [128, d] + k_norm (w, b) + weights_proj [64, d]
    const int64_t indexer = 64 * 128 * 1536 + 128 * 7168 + 2 * 128 + 64 * 7168;
    EXPECT_EQ(model::summarize(r.model, 4096).params,
              model::summarize(model::import_hf_config(hf("kimi_k3"), "").model, 4096).params + 24 * indexer);
}

TEST(HfConfig, KimiLinearQwen3NextAndDeepSeekV32MapTheirLayers) {
    const model::HfImport kl = model::import_hf_config(hf("kimi_linear_48b_a3b"), "kl.json");
    EXPECT_EQ(count(kl.model, "kda"), 20);
    EXPECT_EQ(count(kl.model, "mla"), 7);
    EXPECT_EQ(kl.model.layer_type(26), "mla");
    EXPECT_EQ(kl.model.mla.q_lora_rank, 0);
    EXPECT_FALSE(kl.model.kda.full_rank_output_gate);
    EXPECT_FALSE(mentions(kl.unsupported, "not interpreted"));

    const model::HfImport qn = model::import_hf_config(hf("qwen3_next_80b_a3b"), "qn.json");
    EXPECT_EQ(count(qn.model, "gdn"), 36);
    EXPECT_EQ(count(qn.model, "gqa"), 12);
    EXPECT_EQ(qn.model.layer_type(3), "gqa");
    EXPECT_EQ(qn.model.kda.num_v_heads, 32);
    EXPECT_EQ(qn.model.moe.score, "softmax");
    EXPECT_EQ(qn.model.rope_dim, 64);  // partial_rotary_factor 0.25 of head_dim 256
    EXPECT_TRUE(qn.model.qk_norm);
    EXPECT_TRUE(qn.model.moe.shared_expert_gate);
    EXPECT_EQ(qn.model.kda.o_norm_eps, qn.model.norm_eps);
    EXPECT_FALSE(mentions(qn.unsupported, "not interpreted"));

    const model::HfImport ds = model::import_hf_config(hf("deepseek_v3_2_exp"), "ds.json");
    EXPECT_EQ(count(ds.model, "dsa"), 61);
    EXPECT_EQ(ds.model.moe.first_dense, 3);
    EXPECT_EQ(ds.model.moe.groups, 8);
    EXPECT_EQ(ds.model.mla.softmax_scale, 0.0);                   // the default τ, with YaRN's mscale²:
    EXPECT_NEAR(ds.model.mla_layer(true).scale(), 0.1352, 5e-5);  // 192^-1/2 · 1.3689² (spec/dsa.md §1.2)
    EXPECT_FALSE(mentions(ds.unsupported, "YaRN"));
    EXPECT_NE(
        model::summarize(ds.model, 4096)
            .str()
            .find("positions: RoPE, theta 10000, YaRN x40 of 4096 positions (cos/sin x1, MLA softmax scale x1.874)"),
        std::string::npos);
    EXPECT_TRUE(mentions(ds.unsupported, "multi-token-prediction"));
    EXPECT_FALSE(mentions(ds.unsupported, "not interpreted"));
}

TEST(HfConfig, YarnIsReadFromRopeScalingOrRopeParameters) {
    // the published DeepSeek-V3.2 file: rope_scaling {type yarn, factor 40, original 4096, beta 32 / 1, mscale 1 / 1}
    const model::ModelConfig ds = model::import_hf_config(hf("deepseek_v3_2_exp"), "ds.json").model;
    const ops::RopeScaling& y = ds.rope_scaling;
    EXPECT_TRUE(y.enabled());
    EXPECT_EQ(y.factor, 40.0);
    EXPECT_EQ(y.original_max_position, 4096);
    EXPECT_EQ(y.beta_fast, 32.0);
    EXPECT_EQ(y.beta_slow, 1.0);
    EXPECT_EQ(y.mscale, 1.0);
    EXPECT_EQ(y.mscale_all_dim, 1.0);
    EXPECT_EQ(y.cos_sin_factor(), 1.0);  // mscale / mscale_all_dim
    EXPECT_EQ(ds.rope_theta, 10000.0);
    // transformers 5's rope_parameters; a non-null rope_scaling replaces it (transformers' precedence)
    Json doc = hf("qwen3_next_80b_a3b");
    doc.erase("rope_scaling");
    doc["rope_parameters"] =
        Json{{"rope_type", "yarn"}, {"factor", 4.0},           {"original_max_position_embeddings", 64},
             {"rope_theta", 500.0}, {"attention_factor", 0.5}, {"truncate", false}};
    model::HfImport q = model::import_hf_config(doc, "q.json");
    EXPECT_TRUE(q.model.rope_scaling.enabled());
    EXPECT_EQ(q.model.rope_theta, 500.0);  // the dict's own theta wins over the top level's
    EXPECT_EQ(q.model.rope_scaling.cos_sin_factor(), 0.5);
    EXPECT_FALSE(q.model.rope_scaling.truncate);
    EXPECT_EQ(q.model.rope_scaling.beta_fast, 32.0);  // transformers' defaults
    EXPECT_FALSE(mentions(q.unsupported, "rope"));
    doc["rope_scaling"] = Json{{"type", "linear"}, {"factor", 2.0}};
    q = model::import_hf_config(doc, "q.json");
    EXPECT_FALSE(q.model.rope_scaling.enabled());
    EXPECT_TRUE(mentions(q.unsupported, "rope type \"linear\" (rope_scaling)"));
    // without the factor: max_position_embeddings / original_max_position_embeddings
    doc["rope_scaling"] = Json{{"rope_type", "yarn"}, {"original_max_position_embeddings", 4096}};
    doc["max_position_embeddings"] = 32768;
    EXPECT_EQ(model::import_hf_config(doc, "q.json").model.rope_scaling.factor, 8.0);
    doc["rope_scaling"]["beta_fast"] = "fast";
    test::expect_error([&] { model::import_hf_config(doc, "q.json"); },
                       "q.json: rope_scaling: \"beta_fast\" must be a number");
}

TEST(HfConfig, Qwen3NextPartialRotaryIsTruncatedAsTransformersDoes) {
    Json doc = hf("qwen3_next_80b_a3b");
    doc["head_dim"] = 16;
    doc["partial_rotary_factor"] = 0.3;  // int(16 · 0.3) = 4
    EXPECT_EQ(model::import_hf_config(doc, "q.json").model.rope_dim, 4);
    doc.erase("partial_rotary_factor");  // Qwen3NextConfig's default is 0.25
    EXPECT_EQ(model::import_hf_config(doc, "q.json").model.rope_dim, 4);
    doc["partial_rotary_factor"] = 1.0;
    EXPECT_EQ(model::import_hf_config(doc, "q.json").model.rope_dim, 0);  // every dim
    doc["head_dim"] = 20;
    doc["partial_rotary_factor"] = 0.25;  // 5: transformers rotates 6 dims at a 5-dim rotation's frequencies
    EXPECT_TRUE(mentions(model::import_hf_config(doc, "q.json").unsupported, "int(head_dim · factor) = 5"));
    // the export writes a factor whose truncated product is the rotary width again (0.58 · 100 = 57.99…)
    doc["head_dim"] = 100;
    doc["partial_rotary_factor"] = 0.5;
    model::ModelConfig m = model::import_hf_config(doc, "q.json").model;
    m.rope_dim = 58;
    EXPECT_EQ(model::import_hf_config(model::export_hf_config(m), "back").model.rope_dim, 58);
}

TEST(HfConfig, DenseLayersBetweenMoeLayersFollowTransformers) {
    // Qwen3-Next: MoE where the layer is not in mlp_only_layers and (layer + 1) % decoder_sparse_step == 0
    Json doc = hf("qwen3_next_80b_a3b");
    doc["num_hidden_layers"] = 8;
    doc["decoder_sparse_step"] = 2;
    doc["mlp_only_layers"] = Json{3};
    const model::HfImport q = model::import_hf_config(doc, "q.json");
    EXPECT_EQ(q.model.moe.layers,
              (std::vector<std::string>{"dense", "moe", "dense", "dense", "dense", "moe", "dense", "moe"}));
    EXPECT_FALSE(mentions(q.unsupported, "mlp_only_layers"));
    EXPECT_FALSE(mentions(q.unsupported, "decoder_sparse_step"));
    const model::Model qm(q.model);  // dense MLP parameters on the dense layers
    std::set<std::string> names;
    for (const auto& spec : qm.param_specs()) names.insert(spec.name);
    EXPECT_TRUE(names.count("model.layers.3.mlp.gate_proj.weight"));
    EXPECT_TRUE(names.count("model.layers.5.mlp.gate.weight"));
    EXPECT_TRUE(names.count("model.layers.1.mlp.gate.weight"));
    EXPECT_FALSE(names.count("model.layers.4.mlp.gate.weight"));
    Json out = model::export_hf_config(q.model);
    EXPECT_EQ(out["mlp_only_layers"], (Json{0, 2, 3, 4, 6}));
    EXPECT_EQ(model::to_json(model::import_hf_config(out, "back").model), model::to_json(q.model));
    doc["mlp_only_layers"] = Json{8};
    test::expect_error([&] { model::import_hf_config(doc, "q.json"); }, "mlp_only_layers entry 8 is not a layer index");
    // DeepSeek-V3.2 / Kimi-Linear: transformers 5's mlp_layer_types decides; without it, first_k_dense_replace
    // with transformers' defaults (3 and 1)
    doc = hf("deepseek_v3_2_exp");
    doc["num_hidden_layers"] = 4;
    doc.erase("first_k_dense_replace");
    EXPECT_EQ(model::import_hf_config(doc, "d.json").model.moe.first_dense, 3);
    doc["mlp_layer_types"] = Json{"dense", "sparse", "dense", "sparse"};
    const model::ModelConfig d = model::import_hf_config(doc, "d.json").model;
    EXPECT_EQ(d.moe.layers, (std::vector<std::string>{"dense", "moe", "dense", "moe"}));
    out = model::export_hf_config(d);
    EXPECT_EQ(out["mlp_layer_types"], doc["mlp_layer_types"]);
    EXPECT_EQ(out["first_k_dense_replace"], 1);
    EXPECT_EQ(model::to_json(model::import_hf_config(out, "back").model), model::to_json(d));
    doc = hf("kimi_linear_48b_a3b");
    doc.erase("first_k_dense_replace");
    EXPECT_EQ(model::import_hf_config(doc, "k.json").model.moe.first_dense, 1);
    model::ModelConfig k = model::import_hf_config(doc, "k.json").model;
    k.moe.layers.assign(size_t(k.n_layers), "moe");
    k.moe.layers[5] = "dense";
    test::expect_error([&] { model::export_hf_config(k); }, "the dense MLP layers are the first");
}

TEST(HfConfig, Qwen3NextRouterAuxLossIsTheGlobalBalanceLossWhenTransformersAddsIt) {
    Json doc = hf("qwen3_next_80b_a3b");  // router_aux_loss_coef 0.001, output_router_logits false
    model::HfImport q = model::import_hf_config(doc, "q.json");
    EXPECT_EQ(q.model.moe.global_aux_coeff, 0.0);  // transformers adds no balance loss then
    EXPECT_FALSE(mentions(q.unsupported, "router_aux_loss_coef"));
    doc["output_router_logits"] = true;
    q = model::import_hf_config(doc, "q.json");
    EXPECT_EQ(q.model.moe.global_aux_coeff, 0.001);
    const Json out = model::export_hf_config(q.model);
    EXPECT_EQ(out["router_aux_loss_coef"], 0.001);
    EXPECT_EQ(out["output_router_logits"], true);
    doc.erase("router_aux_loss_coef");  // Qwen3NextConfig's default
    EXPECT_EQ(model::import_hf_config(doc, "q.json").model.moe.global_aux_coeff, 0.001);
    q.model.moe.seq_aux_coeff = 1e-4;
    test::expect_error([&] { model::export_hf_config(q.model); }, "at most the global balance loss");
}

TEST(HfConfig, ExportsWriteSpecialTokensInsideTheVocabularyAndKimiNeverTies) {
    // transformers builds nn.Embedding(vocab, d, padding_idx = pad_token_id) and refuses an id outside it
    const model::HfSpecialTokens bytes{.bos = 256, .eos = 256, .pad = 257};
    for (const char* name : {"qwen3_next_tiny", "deepseek_v32_tiny", "kimi_linear_tiny"}) {
        SCOPED_TRACE(name);
        model::ModelConfig m =
            model::import_hf_config(
                Json::parse(read_text(test::golden_path(std::string("hf/") + name + "/config.json"))), name)
                .model;
        Json out = model::export_hf_config(m, bytes);  // vocabulary 64: no such ids
        EXPECT_TRUE(out["pad_token_id"].is_null() && out["bos_token_id"].is_null() && out["eos_token_id"].is_null());
        m.vocab_size = 258;  // the byte tokenizer's
        m.tie_embeddings = true;
        out = model::export_hf_config(m, bytes);
        EXPECT_EQ(out["bos_token_id"], 256);
        EXPECT_EQ(out["eos_token_id"], 256);
        EXPECT_EQ(out["pad_token_id"], 257);
        EXPECT_EQ(out["tie_word_embeddings"], std::string(name) != "kimi_linear_tiny");  // Kimi's head is written
    }
}

TEST(HfConfig, BadConfigsNameTheKey) {
    test::expect_error(
        [] {
            model::import_hf_config(Json{{"model_type", "llama"}}, "x.json");
        },
        "x.json: model_type \"llama\" is not a supported family");
    Json doc = hf("qwen3_next_80b_a3b");
    doc.erase("linear_num_key_heads");
    test::expect_error([&] { model::import_hf_config(doc, "q.json"); }, "q.json: missing key \"linear_num_key_heads\"");
    doc = hf("kimi_linear_48b_a3b");
    doc["linear_attn_config"]["kda_layers"].push_back(4);
    test::expect_error([&] { model::import_hf_config(doc, "k.json"); }, "layer 4 is listed twice");
    doc = hf("deepseek_v3_2_exp");
    doc["new_feature"] = 1;
    EXPECT_TRUE(mentions(model::import_hf_config(doc, "d.json").unsupported, "\"new_feature\" = 1 is not interpreted"));
}

TEST(ShippedConfigs, EveryConfigParsesAndEveryHfConfigImports) {
    int n = 0;
    for (const auto& e : std::filesystem::directory_iterator(std::string(TESSERA_SOURCE_DIR) + "/configs")) {
        if (e.path().extension() != ".json") continue;
        SCOPED_TRACE(e.path().string());
        const train::RunConfig c = train::parse_run_config(train::load_config_json(e.path().string(), {}), "cfg");
        EXPECT_GT(model::summarize(c.model, 256).params, 0);
        ++n;
    }
    EXPECT_GE(n, 5);
    for (const char* name : {"kimi_k3", "kimi_linear_48b_a3b", "qwen3_next_80b_a3b", "deepseek_v3_2_exp"}) {
        EXPECT_NO_THROW(model::import_hf_config(hf(name), name)) << name;
    }
    // the demo is the hybrid the README describes
    const train::RunConfig demo = train::parse_run_config(
        train::load_config_json(std::string(TESSERA_SOURCE_DIR) + "/configs/demo.json", {}), "demo");
    EXPECT_EQ(demo.model.attention, (std::vector<std::string>{"kda", "kda", "kda", "dsa"}));
    EXPECT_LT(demo.model.mla.dsa.topk, demo.train.seq_len);
    EXPECT_GT(demo.model.moe.experts, 16);
    EXPECT_GT(demo.model.moe.topk, 1);
    EXPECT_GT(demo.model.moe.shared_ffn_dim, 0);
}

TEST(HfConfig, KimiLinearExportImportsBackToTheSameModel) {
    for (const char* attention : {R"(["kda", "kda", "kda", "dsa"])", R"(["kda", "mla"])"}) {
        const model::ModelConfig m = model::parse_model_config(
            Json::parse(std::string(R"({"vocab_size": 100, "d_model": 64, "n_layers": )") +
                        (std::string(attention).find("dsa") != std::string::npos ? "4" : "2") +
                        R"(, "n_heads": 4, "ffn_dim": 96, "attention": )" + attention + R"(,
                "output_gate": "elementwise",
                "kda": {"head_dim": 16, "gate_lower_bound": -5.0, "full_rank_output_gate": true, "o_norm_eps": 1e-6},
                "mla": {"q_lora_rank": 32, "kv_lora_rank": 32, "qk_nope_dim": 16, "qk_rope_dim": 8, "v_head_dim": 16,
                        "rope": false)" +
                        (std::string(attention).find("dsa") != std::string::npos
                             ? R"(, "dsa": {"topk": 16, "heads": 2, "head_dim": 16, "rope_dim": 8})"
                             : "") +
                        R"(},
                "moe": {"experts": 8, "topk": 2, "ffn_dim": 32, "shared_ffn_dim": 64, "latent_dim": 32,
                        "latent_norm": true, "groups": 2, "topk_groups": 1}})"),
            "m");
        const model::HfImport back = model::import_hf_config(model::export_hf_config(m), "exported");
        EXPECT_EQ(model::to_json(back.model), model::to_json(m)) << attention;
        EXPECT_TRUE(back.unsupported.empty()) << back.unsupported.front();
    }
    model::ModelConfig gqa;  // a gqa layer points to Qwen3-Next, whose attention is gated with q/k norms
    test::expect_error([&] { model::export_hf_config(gqa); }, "cannot be written as a Qwen3-Next config");
}

TEST(HfConfig, Qwen3NextAndDeepSeekV32ExportsImportBackToTheSameModel) {
    // the configs transformers wrote for the interop goldens, imported, exported and imported again
    for (const char* name : {"qwen3_next_tiny", "deepseek_v32_tiny"}) {
        const Json doc = Json::parse(read_text(test::golden_path(std::string("hf/") + name + "/config.json")));
        const model::HfImport hf = model::import_hf_config(doc, name);
        const Json out = model::export_hf_config(hf.model);
        EXPECT_EQ(out["model_type"], doc["model_type"]) << name;
        const model::HfImport back = model::import_hf_config(out, "exported");
        EXPECT_EQ(model::to_json(back.model), model::to_json(hf.model)) << name;
        EXPECT_TRUE(back.unsupported.empty()) << back.unsupported.front();
        Json quantised = out;  // weights stored in MXFP4 (export-hf --expert-dtype mxfp4): the same model
        quantised["quantization_config"] = model::mxfp4_experts_quantization_config();
        const model::HfImport q = model::import_hf_config(quantised, "quantised");
        EXPECT_EQ(model::to_json(q.model), model::to_json(hf.model)) << name;
        EXPECT_TRUE(q.unsupported.empty()) << q.unsupported.front();
        model::ModelConfig yarn = hf.model;  // with YaRN (every field away from its default)
        yarn.rope_scaling = {.type = ops::RopeScaling::Type::yarn,
                             .factor = 8.0,
                             .original_max_position = 512,
                             .beta_fast = 16.0,
                             .beta_slow = 2.0,
                             .mscale = 0.5,
                             .mscale_all_dim = 0.25,
                             .attention_factor = 1.5,
                             .truncate = false};
        EXPECT_EQ(model::to_json(model::parse_model_config(model::to_json(yarn), "tessera")), model::to_json(yarn));
        const Json y = model::export_hf_config(yarn);
        EXPECT_EQ(y["max_position_embeddings"], 4096) << name;
        const model::HfImport yback = model::import_hf_config(y, "exported");
        EXPECT_EQ(model::to_json(yback.model), model::to_json(yarn)) << name;
        EXPECT_TRUE(yback.unsupported.empty()) << yback.unsupported.front();
    }
    model::ModelConfig qwen =
        model::import_hf_config(Json::parse(read_text(test::golden_path("hf/qwen3_next_tiny/config.json"))), "q").model;
    qwen.moe.balance = "sign";
    test::expect_error([&] { model::export_hf_config(qwen); }, "there is no selection bias");
}

}  // namespace
}  // namespace tessera
