// Hugging Face checkpoints through the CLI: every kind of feature the import reports as unsupported stops
// `logits` and `generate` with one line naming it (never a silently different model), while `inspect` lists it.
#include <gtest/gtest.h>

#include <filesystem>

#include "core/config_reader.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::run_tessera;
using test::TempDir;

Json golden_config(const std::string& name) {
    return Json::parse(read_text(test::golden_path("hf/" + name + "/config.json")));
}

struct Unsupported {
    std::string what;    // the push_back site in model/hf_config.cpp
    Json config;         // a Hugging Face config using it
    std::string needle;  // what the one-line error must name
};

// One config per entry kind of HfImport::unsupported (each push_back site and report_rest caller).
std::vector<Unsupported> unsupported_cases() {
    std::vector<Unsupported> cs;
    auto with = [&](const std::string& what, const std::string& base, const std::function<void(Json&)>& edit,
                    const std::string& needle) {
        Json c = golden_config(base);
        edit(c);
        cs.push_back({what, c, needle});
    };
    with(
        "SiTU betas", "kimi_linear_tiny", [](Json& c) { c["hidden_act"] = "situ", c["activation_situ_beta"] = 3.0; },
        "SiTU betas 3 / 25");
    with(
        "MTP layers", "deepseek_v32_tiny", [](Json& c) { c["num_nextn_predict_layers"] = 1; },
        "multi-token-prediction");
    with(
        "attention bias", "qwen3_next_tiny", [](Json& c) { c["attention_bias"] = true; }, "attention_bias");
    with(
        "rope type", "qwen3_next_tiny",
        [](Json& c) {
            c["rope_parameters"] = {{"rope_type", "llama3"}, {"factor", 8}};
        },
        "rope type \"llama3\"");
    with(
        "unknown key", "deepseek_v32_tiny", [](Json& c) { c["new_feature"] = 1; },
        "\"new_feature\" = 1 is not interpreted");
    with(
        "unknown rope key", "qwen3_next_tiny", [](Json& c) { c["rope_parameters"]["low_freq_factor"] = 1; },
        "\"low_freq_factor\" = 1 is not interpreted");
    with(
        "unknown rope key under yarn", "deepseek_v32_tiny",
        [](Json& c) {
            c["rope_parameters"] = {
                {"rope_type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 8}, {"long_factor", 2}};
        },
        "\"long_factor\" = 2 is not interpreted");
    with(
        "unknown linear_attn_config key", "kimi_linear_tiny", [](Json& c) { c["linear_attn_config"]["mode"] = "x"; },
        "\"mode\" = \"x\" is not interpreted");
    with(
        "YaRN on Kimi", "kimi_linear_tiny",
        [](Json& c) {
            c["rope_scaling"] = {{"type", "yarn"}, {"factor", 4}, {"original_max_position_embeddings", 8}};
        },
        "YaRN rope scaling on a Kimi config");
    with(
        "moe_layer_freq", "kimi_linear_tiny", [](Json& c) { c["moe_layer_freq"] = 2; }, "moe_layer_freq");
    with(
        "topk_method (Kimi)", "kimi_linear_tiny", [](Json& c) { c["topk_method"] = "greedy"; },
        "topk_method \"greedy\"");
    with(
        "topk_method (DeepSeek)", "deepseek_v32_tiny", [](Json& c) { c["topk_method"] = "group_limited_greedy"; },
        "topk_method \"group_limited_greedy\"");
    with(
        "odd partial rotary", "qwen3_next_tiny", [](Json& c) { c["rope_parameters"]["partial_rotary_factor"] = 0.625; },
        "int(head_dim · factor) = 5");
    with(
        "sliding window", "qwen3_next_tiny", [](Json& c) { c["use_sliding_window"] = true; },
        "sliding-window attention");
    with(
        "partial rotary on MLA", "deepseek_v32_tiny",
        [](Json& c) { c["rope_parameters"]["partial_rotary_factor"] = 0.5; },
        "partial_rotary_factor 0.5 of the MLA rope dims");
    with(
        "MLP bias", "deepseek_v32_tiny", [](Json& c) { c["mlp_bias"] = true; }, "MLP biases");
    // an image tower other than MoonViT-V2's (K3's own imports: tests/model/test_vision.cpp)
    Json vision = Json::parse(read_text(TESSERA_SOURCE_DIR "/configs/hf/kimi_k3.json"))["vision_config"];
    vision["norm_type"] = "layernorm";
    vision["text_hidden_size"] = golden_config("kimi_linear_tiny")["hidden_size"];
    Json k3 = {{"model_type", "kimi_k3"},
               {"text_config", golden_config("kimi_linear_tiny")},
               {"vision_config", vision},
               {"media_placeholder_token_id", 3}};
    cs.push_back({"another image tower", k3, "vision_config.norm_type \"layernorm\" (the tower builds \"rmsnorm\")"});
    k3.erase("vision_config");
    k3["text_config"]["image_size"] = 32;
    cs.push_back({"unknown text_config key (K3)", k3, "\"image_size\" = 32 is not interpreted"});
    return cs;
}

TEST(HfCli, EveryUnsupportedFeatureStopsLogitsAndGenerate) {
    TempDir d;
    Tensor ids(DType::i64, Shape{1, 4});
    for (int64_t i = 0; i < 4; ++i) ids.ptr<int64_t>()[i] = i + 3;
    write_safetensors(d.file("ids.safetensors"), {{"ids", ids.view()}});
    const std::string in = " --in " + d.file("ids.safetensors") + " --out " + d.file("logits.safetensors");
    // the unchanged checkpoints run (the errors below come from the features, not from the families)
    for (const char* name : {"kimi_linear_tiny", "qwen3_next_tiny", "deepseek_v32_tiny"}) {
        const test::CliResult ok =
            run_tessera("logits --checkpoint " + test::golden_path(std::string("hf/") + name) + in);
        EXPECT_EQ(ok.status, 0) << name << ": " << ok.err;
    }
    const std::vector<Unsupported> cases = unsupported_cases();
    for (size_t i = 0; i < cases.size(); ++i) {
        const Unsupported& u = cases[i];
        SCOPED_TRACE(u.what);
        const std::string dir = d.file("case" + std::to_string(i));
        std::filesystem::create_directories(dir);
        write_text_atomic(dir + "/config.json", u.config.dump(2));
        for (const std::string& cmd :
             {"logits --checkpoint " + dir + in, "generate --max-new-tokens 2 --prompt ab --checkpoint " + dir}) {
            const test::CliResult r = run_tessera(cmd);
            EXPECT_EQ(r.status, 1) << cmd;
            EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
            EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
            EXPECT_NE(r.err.find("uses what tessera does not build"), std::string::npos) << r.err;
            EXPECT_NE(r.err.find(u.needle), std::string::npos) << r.err;
        }
        const test::CliResult listed = run_tessera("inspect " + dir);  // inspect keeps listing them
        EXPECT_EQ(listed.status, 0) << listed.err;
        EXPECT_NE(listed.out.find(u.needle), std::string::npos) << listed.out;
    }
    // train has no Hugging Face source: such a config is named as one, not run as something else
    const test::CliResult t =
        run_tessera("train --config " + test::golden_path("hf/qwen3_next_tiny/config.json") + " --out " + d.file("r"));
    EXPECT_EQ(t.status, 1);
    EXPECT_NE(t.err.find("is a Hugging Face config: train takes a tessera run config"), std::string::npos) << t.err;
}

// tests/golden/hf/export/<case> (tools/ref/make_hf_export_golden.py): a tessera checkpoint trained by the binary,
// the directory export-hf made of it, and the logits transformers computed from that directory after loading every
// tensor. Exporting the checkpoint again must give the same files (what transformers read is what the exporter
// writes now), and tessera's logits, from the checkpoint and from the export, must be transformers'.
class TransformersReadsTheExport : public ::testing::TestWithParam<std::string> {};

TEST_P(TransformersReadsTheExport, ReExportedFilesAreTheOnesTransformersReadAndScoreTheSame) {
    const std::string g = test::golden_path("hf/export/" + GetParam());
    TempDir d;
    test::CliResult r = run_tessera("export-hf --checkpoint " + g + "/tessera --out " + d.file("hf"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(Json::parse(read_text(d.file("hf/config.json"))), Json::parse(read_text(g + "/hf/config.json")));
    const Json mine = Json::parse(read_text(d.file("hf/model.safetensors.index.json")))["weight_map"],
               theirs = Json::parse(read_text(g + "/hf/model.safetensors.index.json"))["weight_map"];
    EXPECT_EQ(mine.size(), theirs.size());
    for (auto it = theirs.begin(); it != theirs.end(); ++it) {
        ASSERT_TRUE(mine.contains(it.key())) << it.key();
        const Tensor a = SafetensorsFile(d.file("hf/" + mine[it.key()].get<std::string>())).load(it.key()),
                     b = SafetensorsFile(g + "/hf/" + it.value().get<std::string>()).load(it.key());
        EXPECT_TRUE(test::bitwise_equal(a.view(), b.view())) << it.key();
    }
    SafetensorsFile golden(g + "_logits.safetensors");
    write_safetensors(d.file("ids.safetensors"), {{"ids", golden.load("ids").view()}});
    for (const std::string& source : {g + "/tessera", d.file("hf")}) {
        r = run_tessera("logits --checkpoint " + source + " --in " + d.file("ids.safetensors") + " --out " +
                        d.file("logits.safetensors"));
        ASSERT_EQ(r.status, 0) << r.err;
        EXPECT_TRUE(test::rel_rms_close(SafetensorsFile(d.file("logits.safetensors")).load("logits").view(),
                                        golden.load("expected.logits").view(), 1e-4))
            << source;
    }
}

INSTANTIATE_TEST_SUITE_P(Families,
                         TransformersReadsTheExport,
                         ::testing::Values("kimi_linear_export", "qwen3_next_export", "deepseek_v32_export"));

}  // namespace
}  // namespace tessera
