// tessera onboard (docs/plan.md "Onboarding"): the demo model onboards (every module a block, the miniature's loss
// lowered, every op it ran within tolerance of its reference and of central differences, a plan); a Hugging Face
// config with a feature tessera does not build, an op without golden files and a golden file that disagrees with the
// op each fail the run (exit 1) with the report saying why; bad arguments are one-line errors that leave nothing.
#include <gtest/gtest.h>

#include <filesystem>
#include <set>
#include <tuple>

#include "core/file.h"
#include "core/json.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const std::string kSource = TESSERA_SOURCE_DIR;
const std::string kGoldens = kSource + "/tests/golden/ops";

std::set<std::string> ops_of(const Json& report) {
    std::set<std::string> s;
    for (const Json& o : report["ops"]) s.insert(o["op"].get<std::string>());
    return s;
}

TEST(Onboard, TheDemoModelOnboards) {
    TempDir d;
    const std::string out = d.file("demo");
    const test::CliResult r = test::run_tessera("--threads 2 onboard " + kSource + "/configs/demo.json --cluster " +
                                                kSource + "/configs/cluster/this_machine.json --out " + out);
    ASSERT_EQ(r.status, 0) << r.out << r.err;
    const Json rep = Json::parse(read_text(out + "/onboard.json"));
    EXPECT_TRUE(rep["passed"].get<bool>());
    EXPECT_EQ(rep["failed"], 0);
    EXPECT_TRUE(rep["missing"].empty());
    // the modules: KDA + dense, KDA + LatentMoE, DSA + LatentMoE
    ASSERT_EQ(rep["modules"].size(), 3u);
    EXPECT_EQ(rep["modules"][2]["attention"], "dsa");
    EXPECT_NE(rep["modules"][1]["ffn_block"].get<std::string>().find("LatentMoE, 32 experts, top-4"),
              std::string::npos);
    // the miniature keeps the demo's layer pattern and trains
    const Json mini = Json::parse(read_text(out + "/miniature.json"));
    EXPECT_EQ(mini["model"]["attention"], Json::parse(R"(["kda","kda","kda","dsa"])"));
    EXPECT_EQ(mini["model"]["d_model"], 64);
    EXPECT_EQ(mini["model"]["moe"]["activation"], "situ");
    const Json& t = rep["training"];
    EXPECT_TRUE(t["lowered"].get<bool>());
    EXPECT_LT(t["last_loss"].get<double>(), 0.9 * t["first_loss"].get<double>());
    EXPECT_EQ(t["losses"].size(), 40u);
    EXPECT_GT(t["tokens_per_s"].get<double>(), 0);
    // every op of its blocks ran and was checked: KDA's, DSA's, the MoE chain, the loss and the optimizer
    const std::set<std::string> ops = ops_of(rep);
    for (const char* op :
         {"kda", "kda_gate", "causal_conv1d", "gated_rmsnorm", "dsa_indexer", "sparse_attention", "indexer_kl", "moe",
          "router", "situ_glu", "linear", "rmsnorm", "embedding", "cross_entropy", "adamw"})
        EXPECT_TRUE(ops.count(op)) << op << " not recorded";
    EXPECT_FALSE(ops.count("attention")) << "no gqa layer in the demo";
    EXPECT_FALSE(ops.count("lora")) << "full training";
    for (const Json& o : rep["ops"]) {
        EXPECT_TRUE(o["passed"].get<bool>()) << o.dump();
        for (const Json& c : o["cases"])
            if (o["op"] != "adamw" && o["op"] != "dsa_indexer") {
                EXPECT_GT(c["fd_checked"].get<int>(), 0) << c.dump();
            }
    }
    ASSERT_TRUE(rep.contains("plan"));
    EXPECT_TRUE(rep["plan"]["fits"].get<bool>());
    EXPECT_GT(rep["plan"]["best"]["tokens_per_s_per_device"].get<double>(), 0);
    const std::string md = read_text(out + "/onboard.md");
    EXPECT_NE(md.find("the model onboards"), std::string::npos);
    EXPECT_NE(md.find("| sparse_attention | sparse_attention | PyTorch |"), std::string::npos);
}

TEST(Onboard, WhatIsMissingOrWrongFailsTheRun) {
    TempDir d;
    // DeepSeek-V3.2: its multi-token-prediction layer is not built; the rest (DSA, MoE with groups) trains
    {
        const std::string out = d.file("dsv32");
        const test::CliResult r =
            test::run_tessera("--threads 2 onboard " + kSource + "/configs/hf/deepseek_v3_2_exp.json --out " + out);
        EXPECT_EQ(r.status, 1) << r.out << r.err;
        EXPECT_NE(r.err.find("a check failed"), std::string::npos) << r.err;
        const Json rep = Json::parse(read_text(out + "/onboard.json"));
        EXPECT_FALSE(rep["passed"].get<bool>());
        EXPECT_EQ(rep["failed"], 1);
        ASSERT_EQ(rep["missing"].size(), 1u);
        EXPECT_NE(rep["missing"][0].get<std::string>().find("multi-token-prediction"), std::string::npos);
        EXPECT_TRUE(rep["training"]["lowered"].get<bool>());
        EXPECT_TRUE(ops_of(rep).count("sparse_attention"));
        EXPECT_FALSE(rep.contains("plan"));  // no --cluster
    }
    // an op without golden files, and a golden file whose reference disagrees with the op
    const std::string goldens = d.file("goldens");
    fs::create_directories(goldens);
    for (const auto& e : fs::directory_iterator(kGoldens)) {
        const std::string n = e.path().filename().string();
        if (n.rfind("situ_glu", 0) == 0 || n.rfind("linear", 0) == 0) continue;
        fs::copy_file(e.path(), goldens + "/" + n);
    }
    // linear's golden with one expected output moved by 1e-3
    test::write_golden_with_moved_value(kGoldens + "/linear.safetensors", goldens + "/linear.safetensors", "expected.y",
                                        2, 1e-3);
    const std::string out = d.file("demo");
    const test::CliResult r = test::run_tessera("--threads 2 onboard " + kSource + "/configs/demo.json --goldens " +
                                                goldens + " --out " + out);
    EXPECT_EQ(r.status, 1) << r.out << r.err;
    const Json rep = Json::parse(read_text(out + "/onboard.json"));
    EXPECT_TRUE(rep["missing"].empty());
    std::map<std::string, Json> by_op;
    for (const Json& o : rep["ops"]) by_op[o["op"].get<std::string>()] = o;
    ASSERT_TRUE(by_op.count("situ_glu"));
    EXPECT_FALSE(by_op["situ_glu"]["passed"].get<bool>());
    EXPECT_TRUE(by_op["situ_glu"]["cases"].empty());
    ASSERT_TRUE(by_op.count("linear"));
    EXPECT_FALSE(by_op["linear"]["passed"].get<bool>());
    ASSERT_EQ(by_op["linear"]["cases"].size(), 1u);
    const Json& c = by_op["linear"]["cases"][0];
    EXPECT_GT(c["f64_error"].get<double>(), 1e-6);
    EXPECT_NE(c["problems"][0].get<std::string>().find("y"), std::string::npos) << c.dump();
    EXPECT_LE(c["fd_error"].get<double>(), 1e-6);  // the op itself agrees with central differences
    EXPECT_TRUE(by_op["moe"]["passed"].get<bool>());
    EXPECT_EQ(rep["failed"], 2);
    EXPECT_NE(read_text(out + "/onboard.md").find("**no golden file**"), std::string::npos);
}

// The shipped Hugging Face configs: each family's miniature trains and its ops pass; Kimi K3 (its image tower reported
// beside the modules), Qwen3-Next and Kimi-Linear onboard whole; each runs an op of its own blocks
// (K3's SiTU-GLU, Qwen3-Next's gated attention, Kimi-Linear's KDA).
TEST(Onboard, EachFamilysMiniatureTrains) {
    TempDir d;
    for (const auto& [name, status, op] :
         {std::tuple{"kimi_k3", 0, "situ_glu"}, std::tuple{"qwen3_next_80b_a3b", 0, "attention"},
          std::tuple{"kimi_linear_48b_a3b", 0, "kda"}}) {
        SCOPED_TRACE(name);
        const std::string out = d.file(name);
        const test::CliResult r =
            test::run_tessera("--threads 2 onboard " + kSource + "/configs/hf/" + name + ".json --out " + out);
        EXPECT_EQ(r.status, status) << r.out << r.err;
        const Json rep = Json::parse(read_text(out + "/onboard.json"));
        EXPECT_EQ(rep["failed"], status);
        EXPECT_EQ(rep["missing"].size(), size_t(status));
        EXPECT_TRUE(rep["training"]["lowered"].get<bool>());
        for (const Json& o : rep["ops"]) EXPECT_TRUE(o["passed"].get<bool>()) << o.dump();
        EXPECT_TRUE(ops_of(rep).count(op)) << op;                           // one of the family's own blocks ran
        EXPECT_EQ(rep.contains("vision"), std::string(name) == "kimi_k3");  // K3's image tower, reported
    }
}

TEST(Onboard, BadArgumentsAreOneLineErrorsAndLeaveNothing) {
    TempDir d;
    const std::string demo = kSource + "/configs/demo.json";
    fs::create_directories(d.file("full"));
    write_text_atomic(d.file("full/keep.txt"), "x");
    test::expect_one_line_error(test::run_tessera("onboard " + demo + " --out " + d.file("full")),
                                "exists and is not an empty directory", "a non-empty --out");
    EXPECT_EQ(read_text(d.file("full/keep.txt")), "x");
    test::expect_one_line_error(
        test::run_tessera("onboard " + demo + " --goldens " + d.path() + " --out " + d.file("o1")),
        "no golden files there", "a --goldens without golden files");
    test::expect_one_line_error(test::run_tessera("onboard " + d.file("none.json") + " --out " + d.file("o2")),
                                "no such file", "a missing model");
    test::expect_one_line_error(test::run_tessera("onboard " + demo + " --steps 3 --out " + d.file("o3")), "--steps",
                                "too few steps");
    for (const char* o : {"o1", "o2", "o3"}) EXPECT_FALSE(fs::exists(d.file(o))) << o;
}

}  // namespace
}  // namespace tessera
