// The CLI from the outside: every bad input ends in one line on stderr ("error: ...") and a
// non-zero exit, never a crash; the op runner, data and generate commands work end to end.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/config_reader.h"
#include "core/device.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "ops/isa.h"
#include "ops/linear.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::expect_one_line_error;
using test::run_tessera;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;

void write_file(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

TEST(Cli, BadConfigsGiveOneClearLine) {
    TempDir d;
    expect_one_line_error(run_tessera("train --config " + d.file("missing.json")), "cannot open", "missing config");
    write_file(d.file("bad.json"), "{\"model\": {\"d_model\": 32,, }");
    expect_one_line_error(run_tessera("train --config " + d.file("bad.json")), "not valid JSON", "malformed JSON");
    write_file(d.file("typo.json"), R"({"model": {"d_modle": 32}})");
    expect_one_line_error(run_tessera("train --config " + d.file("typo.json")),
                          "unknown key \"model.d_modle\" (did you mean \"model.d_model\"?)", "unknown key");
    write_file(d.file("section.json"), R"({"optimizer": {}})");
    expect_one_line_error(run_tessera("train --config " + d.file("section.json")), "unknown key \"optimizer\"",
                          "unknown section");
    write_file(d.file("heads.json"), R"({"model": {"n_heads": 4, "n_kv_heads": 3}})");
    expect_one_line_error(run_tessera("train --config " + d.file("heads.json")), "multiple of model.n_kv_heads",
                          "contradictory heads");
    expect_one_line_error(run_tessera("train --config " + kTiny + " --set train.lr=abc --out " + d.file("r")),
                          "train.lr must be a number", "non-numeric --set");
    expect_one_line_error(run_tessera("train --config " + kTiny + " --set train.lr --out " + d.file("r")),
                          "expected key=value", "--set without =");
    expect_one_line_error(
        run_tessera("train --config " + kTiny + " --set data.path=" + d.file("nodata") + " --out " + d.file("r")),
        "no such file or directory", "missing data");
    expect_one_line_error(run_tessera("train --config " + kTiny + " --steps -3 --out " + d.file("r")), "--steps",
                          "negative steps");
    const std::string moe = " --set model.moe.experts=8 --set model.moe.ffn_dim=16 --out " + d.file("r");
    expect_one_line_error(run_tessera("train --config " + kTiny + moe + " --set model.moe.topk=9"),
                          "model.moe.topk 9 must be in [1, experts = 8]", "topk above the experts");
    expect_one_line_error(run_tessera("train --config " + kTiny + moe + " --set model.moe.expert=3"),
                          "did you mean \"model.moe.experts\"", "typo in the moe section");
    expect_one_line_error(run_tessera("train --config " + kTiny + moe + " --set model.moe.balance=magic"),
                          "model.moe.balance", "unknown balancing rule");
    const std::string r = " --out " + d.file("r");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set 'model.attention=[\"kda\",\"mamba\"]'"),
                          "model.attention[1] = \"mamba\" must be one of: dsa, gdn, gqa, kda, mla",
                          "unknown layer type");
    expect_one_line_error(
        run_tessera("train --config " + kTiny + r + " --set 'model.attention=[\"kda\",\"gqa\",\"gqa\"]'"),
        "lists 3 layer types for model.n_layers", "layer list of the wrong length");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set model.attention=dsa"),
                          "\"dsa\" layers need model.mla.dsa.topk > 0", "dsa without top-k");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set model.mla.kv_lora_rank=8"),
                          "model.mla is set but no layer is", "mla section without mla layers");
    expect_one_line_error(run_tessera("train --config " + kTiny + r +
                                      " --set model.attention=dsa --set model.mla.dsa.topk=4 "
                                      "--set model.mla.dsa.stage=warm"),
                          "model.mla.dsa.stage", "unknown DSA stage");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set train.recompute=1"),
                          "train.recompute must be true, false, a block kind or a list of them",
                          "recompute as a number");
    expect_one_line_error(
        run_tessera("train --config " + kTiny + r + " --set train.recompute=mlpp"),
        "train.recompute must be a block kind (attention, dsa, gdn, kda, mla, mlp, moe), not \"mlpp\"",
        "unknown block kind");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set 'train.recompute=[\"kda\",\"mpl\"]'"),
                          "train.recompute[1] must be a block kind (attention, dsa, gdn, kda, mla, mlp, moe), not "
                          "\"mpl\"",
                          "unknown block kind in a list");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set 'train.recompute=[\"kda\"]'"),
                          "train.recompute names 'kda' blocks, which the model does not have (its blocks: attention, "
                          "mlp)",
                          "recompute of a kind the model lacks");
    expect_one_line_error(run_tessera("train --config " + kTiny + r + " --set model.attn_res_block_size=-1"),
                          "model.attn_res_block_size must be >= 0", "negative AttnRes block size");
    expect_one_line_error(run_tessera("train --config " + kTiny + moe + " --set model.moe.shared_expert_gate=true"),
                          "model.moe.shared_expert_gate needs a shared expert", "shared gate without a shared expert");
}

TEST(Cli, UsageErrorsExitWithTwo) {
    test::CliResult r = run_tessera("frobnicate");
    EXPECT_EQ(r.status, 2);
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
    r = run_tessera("train --bogus-flag");
    EXPECT_EQ(r.status, 2);
    r = run_tessera("--help");
    EXPECT_EQ(r.status, 0);
    for (const char* cmd : {"train", "generate", "op", "data"}) EXPECT_NE(r.out.find(cmd), std::string::npos);
}

TEST(Cli, OpRunnerRunsForwardAndBackwardFromFiles) {
    TempDir d;
    Tensor x = test::randn(DType::f32, Shape{5, 7}, 1), w = test::randn(DType::f32, Shape{3, 7}, 2),
           dy = test::randn(DType::f32, Shape{5, 3}, 3);
    write_safetensors(d.file("in.safetensors"), {{"x", x}, {"w", w}, {"dy", dy}});
    test::CliResult r =
        run_tessera("op linear --in " + d.file("in.safetensors") + " --out " + d.file("out.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    SafetensorsFile out(d.file("out.safetensors"));
    Tensor y(DType::f32, Shape{5, 3}), dx(DType::f32, Shape{5, 7}), dw(DType::f32, Shape{3, 7});
    ops::linear_forward({}, x, w, {}, y);
    ops::linear_backward(dy, x, w, dx, dw, {});
    EXPECT_TRUE(test::bitwise_equal(out.view("y"), y));
    EXPECT_TRUE(test::bitwise_equal(out.view("dx"), dx));
    EXPECT_TRUE(test::bitwise_equal(out.view("dw"), dw));
    EXPECT_FALSE(out.contains("db"));  // no bias given

    r = run_tessera("op --list");
    ASSERT_EQ(r.status, 0);
    for (const char* op :
         {"linear", "embedding", "rmsnorm", "swiglu", "cross_entropy", "rope", "causal_conv1d", "attention", "adamw"}) {
        EXPECT_NE(r.out.find(std::string(op) + ":"), std::string::npos) << op;
    }
}

TEST(Cli, OpRunnerBadInputs) {
    TempDir d;
    Tensor x = test::randn(DType::f32, Shape{5, 7}, 1), w = test::randn(DType::f32, Shape{3, 6}, 2);
    write_safetensors(d.file("bad_shape.safetensors"), {{"x", x}, {"w", w}});
    const std::string out = " --out " + d.file("o.safetensors");
    expect_one_line_error(run_tessera("op linear --in " + d.file("bad_shape.safetensors") + out), "do not give y",
                          "wrong-shaped input");
    expect_one_line_error(run_tessera("op frob --in " + d.file("bad_shape.safetensors") + out), "unknown op \"frob\"",
                          "unknown op");
    expect_one_line_error(run_tessera("op rmsnorm --in " + d.file("bad_shape.safetensors") + out + " --set eps=abc"),
                          "eps='abc' is not a number", "non-numeric op parameter");
    std::string bytes = read_text(d.file("bad_shape.safetensors"));
    write_file(d.file("trunc.safetensors"), bytes.substr(0, bytes.size() - 9));
    expect_one_line_error(run_tessera("op linear --in " + d.file("trunc.safetensors") + out), "truncated",
                          "truncated safetensors");
    expect_one_line_error(run_tessera("op linear --in " + d.file("nope.safetensors") + out), "cannot open",
                          "missing input file");
    EXPECT_FALSE(std::filesystem::exists(d.file("o.safetensors"))) << "a failed op must not leave an output file";
}

TEST(Cli, DataShardTrainsAndGenerateSamples) {
    TempDir d;
    std::string text;
    for (int i = 0; i < 400; ++i) text += "the quick brown fox jumps over the lazy dog. ";
    write_file(d.file("a.txt"), text);
    test::CliResult r = run_tessera("data " + d.file("a.txt") + " --out " + d.file("shard.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find(std::to_string(text.size() + 1) + " tokens"), std::string::npos) << r.out;
    r = run_tessera("train --config " + kTiny + " --steps 4 --set data.path=" + d.file("shard.safetensors") +
                    " --set train.activation_dtype=bf16 --set train.precision=bf16 --out " + d.file("run"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("checkpoint: "), std::string::npos);
    // the start line says how this CPU computes the bf16 GEMMs (oneDNN's AMX kernels only where it runs them)
    const bool amx = ops::onednn_isa().find("amx") != std::string::npos;
    EXPECT_NE(r.out.find(amx ? "; bf16 GEMMs: oneDNN's AMX kernels)"
                             : "; bf16 GEMMs: sgemm on operands rounded to bf16, slower than f32 here)"),
              std::string::npos)
        << r.out;
    // two layers of attention + MLP: the first of each kind holds a bf16 copy
    EXPECT_NE(r.out.find("saved activations rounded to bf16 (train.activation_dtype): 2 of 4 blocks hold them as bf16 "
                         "copies\n"),
              std::string::npos)
        << r.out;
    r = run_tessera("generate --checkpoint " + d.file("run") + " --prompt 'the quick' --max-new-tokens 20 --seed 3");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out.rfind("the quick", 0), 0u) << r.out;
    EXPECT_GE(r.out.size(), std::string("the quick").size() + 1);
    test::CliResult again =
        run_tessera("generate --checkpoint " + d.file("run") + " --prompt 'the quick' --max-new-tokens 20 --seed 3");
    EXPECT_EQ(again.out, r.out) << "same seed, same sample";
    expect_one_line_error(run_tessera("generate --checkpoint " + d.file("nowhere") + " --prompt x"),
                          "no such directory", "missing checkpoint");
    expect_one_line_error(run_tessera("generate --checkpoint " + d.file("run") + " --prompt x --device gpu"),
                          "--device: gpu not in {cpu,cuda}", "unknown device");
    if (!cuda_available()) {
        expect_one_line_error(run_tessera("generate --checkpoint " + d.file("run") + " --prompt x --device cuda"),
                              cuda_built() ? "--device cuda: no CUDA device on this machine"
                                           : "--device cuda: this build has no CUDA backend",
                              "no GPU");
    }
}

// Fine-tuning data: prompt/completion lines tokenized with a checkpoint's tokenizer (the Qwen2-style golden one),
// then training on the shard (prompt targets ignored, documents ended by its <|endoftext|>).
// train.precision = bf16 on oneDNN's AMX kernels computes what sgemm on operands rounded to bf16 computes, up to the
// sums' order: the first step's loss within 1e-7 relative of the same run with oneDNN held below AMX
// (DNNL_MAX_CPU_ISA=AVX512_CORE_BF16), and not the f32 run's. Only where oneDNN runs AMX.
TEST(Cli, Bf16GemmsOnAmxGiveTheRoundedOperandsLoss) {
    if (ops::onednn_isa().find("amx") == std::string::npos) GTEST_SKIP() << "oneDNN runs no AMX kernels here";
    test::TempDir d;
    auto first_loss = [&](const std::string& name, const std::string& precision, bool below_amx) {
        const char* held = std::getenv("DNNL_MAX_CPU_ISA");
        const std::string saved = held ? held : "";
        if (below_amx) setenv("DNNL_MAX_CPU_ISA", "AVX512_CORE_BF16", 1);
        const test::CliResult r = run_tessera(
            "train --config " + kTiny + " --steps 1 --set train.precision=" + precision + " --out " + d.file(name));
        if (below_amx) held ? setenv("DNNL_MAX_CPU_ISA", saved.c_str(), 1) : unsetenv("DNNL_MAX_CPU_ISA");
        EXPECT_EQ(r.status, 0) << r.err;
        if (precision == "bf16") {
            EXPECT_NE(r.out.find(below_amx ? "bf16 GEMMs: sgemm" : "bf16 GEMMs: oneDNN's AMX kernels"),
                      std::string::npos)
                << r.out;
        }
        return std::stod(test::losses(d.file(name)).at({"loss", 1}));
    };
    const double amx = first_loss("amx", "bf16", false), rounded = first_loss("rounded", "bf16", true),
                 f32 = first_loss("f32", "f32", false);
    EXPECT_NEAR(amx, rounded, 1e-7 * rounded);  // (3e-11 measured; bf16 against f32: 3e-6)
    EXPECT_GT(std::abs(rounded - f32), 1e-6 * f32) << "the GEMMs must round to bf16";
}

TEST(Cli, SupervisedJsonlWithACheckpointTokenizerTrains) {
    TempDir d;
    std::string lines;
    for (int i = 0; i < 60; ++i) {
        lines += fmt::format("{{\"prompt\": \"Question {}: what is {} + {}?\", \"completion\": \" It is {}.\"}}\n", i,
                             i, 2 * i, 3 * i);
    }
    write_file(d.file("sft.jsonl"), lines);
    const std::string tokenizer = test::golden_path("tokenizers/qwen2");
    test::CliResult r = run_tessera("data " + d.file("sft.jsonl") + " --tokenizer " + tokenizer + " --out " +
                                    d.file("sft.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("from 60 documents (" + tokenizer + "/tokenizer.json tokenizer, vocab 1505); "),
              std::string::npos)
        << r.out;
    EXPECT_NE(r.out.find("training targets (prompts masked)"), std::string::npos) << r.out;
    r = run_tessera("train --config " + kTiny + " --steps 2 --set model.vocab_size=1505 --set data.path=" +
                    d.file("sft.safetensors") + " --out " + d.file("run"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("prompts masked from the loss"), std::string::npos) << r.out;
    expect_one_line_error(run_tessera("train --config " + kTiny + " --steps 2 --set data.path=" +
                                      d.file("sft.safetensors") + " --out " + d.file("run2")),
                          "(its tokenizer has 1505 ids) but model.vocab_size is 258", "a model too small for the ids");
    write_file(d.file("bad.jsonl"), lines + "{\"prompt\": \"no completion\"}\n");
    expect_one_line_error(run_tessera("data " + d.file("bad.jsonl") + " --tokenizer " + tokenizer + " --out " +
                                      d.file("bad.safetensors")),
                          d.file("bad.jsonl") + ":61: \"prompt\" without \"completion\"", "a bad JSONL line");
    EXPECT_FALSE(std::filesystem::exists(d.file("bad.safetensors")));
    expect_one_line_error(run_tessera("data " + d.file("sft.jsonl") + " --tokenizer " + d.file("none") + " --out " +
                                      d.file("x.safetensors")),
                          "none: not a directory", "a missing tokenizer directory");
}

TEST(Cli, LogitsScoreIdsCausallyAndPerRow) {
    TempDir d;
    // a hybrid checkpoint (KDA + gated DSA) of two steps
    test::CliResult r =
        run_tessera("train --config " + kTiny + " --steps 2 --out " + d.file("run") +
                    " --set 'model.attention=[\"kda\",\"dsa\"]' --set model.mla.dsa.topk=4 --set model.n_kv_heads=null"
                    " --set model.kda.head_dim=16");
    ASSERT_EQ(r.status, 0) << r.err;
    Tensor ids(DType::i64, Shape{2, 12});
    for (int64_t i = 0; i < 24; ++i) ids.ptr<int64_t>()[i] = (i * 37 + 5) % 258;
    write_safetensors(d.file("ids.safetensors"), {{"ids", ids}});
    r = run_tessera("logits --checkpoint " + d.file("run") + " --in " + d.file("ids.safetensors") + " --out " +
                    d.file("logits.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    Tensor both = SafetensorsFile(d.file("logits.safetensors")).load("logits");
    ASSERT_EQ(both.view().shape, (Shape{2, 12, 258}));
    // the second row alone (i32 ids, its last token changed): equal logits before the change, causal
    Tensor row(DType::i32, Shape{1, 12});
    for (int64_t i = 0; i < 12; ++i) row.ptr<int32_t>()[i] = int32_t(ids.ptr<int64_t>()[12 + i]);
    row.ptr<int32_t>()[11] = 7;
    write_safetensors(d.file("row.safetensors"), {{"ids", row}});
    r = run_tessera("logits --checkpoint " + d.file("run") + " --in " + d.file("row.safetensors") + " --out " +
                    d.file("row_logits.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    Tensor one = SafetensorsFile(d.file("row_logits.safetensors")).load("logits");
    for (int64_t t = 0; t < 11; ++t) {
        for (int64_t v = 0; v < 258; ++v) {
            ASSERT_NEAR(one.ptr<float>()[t * 258 + v], both.ptr<float>()[(12 + t) * 258 + v], 1e-5) << "position " << t;
        }
    }
    double diff = 0;
    for (int64_t v = 0; v < 258; ++v)
        diff += std::abs(one.ptr<float>()[11 * 258 + v] - both.ptr<float>()[23 * 258 + v]);
    EXPECT_GT(diff, 0.0) << "the changed token changes its own logits";
    row.ptr<int32_t>()[3] = 258;
    write_safetensors(d.file("bad.safetensors"), {{"ids", row}});
    expect_one_line_error(run_tessera("logits --checkpoint " + d.file("run") + " --in " + d.file("bad.safetensors") +
                                      " --out " + d.file("x.safetensors")),
                          "ids[0, 3] = 258 is outside the vocabulary", "id out of range");
    EXPECT_FALSE(std::filesystem::exists(d.file("x.safetensors"))) << "no partial output";
    Tensor flat(DType::i32, Shape{12});
    write_safetensors(d.file("flat.safetensors"), {{"ids", flat}});
    expect_one_line_error(run_tessera("logits --checkpoint " + d.file("run") + " --in " + d.file("flat.safetensors") +
                                      " --out " + d.file("x.safetensors")),
                          "ids must be [B, T] i32 or i64", "1-D ids");
    write_safetensors(d.file("noids.safetensors"), {{"tokens", row}});
    expect_one_line_error(run_tessera("logits --checkpoint " + d.file("run") + " --in " + d.file("noids.safetensors") +
                                      " --out " + d.file("x.safetensors")),
                          "no tensor \"ids\"", "missing ids");
    expect_one_line_error(run_tessera("generate --checkpoint " + d.file("run") + " --prompt ab --context 1"),
                          "the context must hold at least 2 tokens", "a one-token context");
}

TEST(Cli, InspectSummarisesHuggingFaceAndTesseraConfigs) {
    TempDir d;
    test::CliResult r = run_tessera("inspect " TESSERA_SOURCE_DIR "/configs/hf/kimi_k3.json --seq 4096");
    ASSERT_EQ(r.status, 0) << r.err;
    for (const char* needle :
         {"family: Kimi K3", "layers: kda 69, mla 24, mlp 1, moe 92", "2.78 T total",
          "active parameters per token: 105 G",
          "residuals: Attention Residuals, depth blocks of 12 layers (9 sources at the output mix)",
          "447 M in the frozen image tower and projector"}) {
        EXPECT_NE(r.out.find(needle), std::string::npos) << needle << "\n" << r.out;
    }
    r = run_tessera("inspect " + kTiny);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("0-1  gqa + mlp"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("not supported yet: nothing"), std::string::npos) << r.out;
    expect_one_line_error(run_tessera("inspect " + d.file("nowhere.json")), "no such file", "missing path");
    write_file(d.file("llama.json"), R"({"model_type": "llama", "hidden_size": 64})");
    expect_one_line_error(run_tessera("inspect " + d.file("llama.json")), "is not a supported family",
                          "unknown family");
}

TEST(Cli, ExportHfWritesAKimiLinearDirectoryThatScoresIdentically) {
    TempDir d;
    test::CliResult r =
        run_tessera("train --config " + kTiny + " --steps 2 --out " + d.file("run") + test::kTinyKimiLinear);
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf") + " --shard-mib 1");
    ASSERT_EQ(r.status, 0) << r.err;
    const Json cfg = Json::parse(read_text(d.file("hf/config.json")));
    EXPECT_EQ(cfg["model_type"], "kimi_linear");
    EXPECT_EQ(cfg["linear_attn_config"]["full_attn_layers"], Json::array({3}));
    EXPECT_EQ(cfg["num_shared_experts"], 2);
    EXPECT_TRUE(std::filesystem::exists(d.file("hf/model.safetensors.index.json")));
    Tensor ids(DType::i32, Shape{2, 10});
    for (int64_t i = 0; i < 20; ++i) ids.ptr<int32_t>()[i] = int32_t((i * 29 + 3) % 258);
    write_safetensors(d.file("ids.safetensors"), {{"ids", ids}});
    for (const char* src : {"run", "hf"}) {
        r = run_tessera("logits --checkpoint " + d.file(src) + " --in " + d.file("ids.safetensors") + " --out " +
                        d.file(std::string(src) + ".safetensors"));
        ASSERT_EQ(r.status, 0) << src << ": " << r.err;
    }
    Tensor a = SafetensorsFile(d.file("run.safetensors")).load("logits"),
           b = SafetensorsFile(d.file("hf.safetensors")).load("logits");
    EXPECT_TRUE(test::bitwise_equal(a, b)) << "the Hugging Face directory holds the same model";
    r = run_tessera("inspect " + d.file("hf"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("family: Kimi-Linear"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("not supported yet: nothing"), std::string::npos) << r.out;
    r = run_tessera("generate --checkpoint " + d.file("hf") + " --prompt 'ab' --max-new-tokens 8 --context 32");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out.rfind("ab", 0), 0u) << r.out;
    // bf16 shards: the same model up to bf16 rounding of the weights
    r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf16") + " --dtype bf16");
    ASSERT_EQ(r.status, 0) << r.err;
    const Json idx = Json::parse(read_text(d.file("hf16/model.safetensors.index.json")));
    const std::string f = idx["weight_map"]["model.norm.weight"];
    EXPECT_EQ(SafetensorsFile(d.file("hf16/" + f)).entry("model.norm.weight").dtype, DType::bf16);
    r = run_tessera("logits --checkpoint " + d.file("hf16") + " --in " + d.file("ids.safetensors") + " --out " +
                    d.file("hf16.safetensors"));
    ASSERT_EQ(r.status, 0) << r.err;
    Tensor c = SafetensorsFile(d.file("hf16.safetensors")).load("logits");
    EXPECT_TRUE(test::rel_rms_close(c, a, 2e-2));
    EXPECT_FALSE(test::bitwise_equal(c, a)) << "bf16 rounding changes something";
    expect_one_line_error(run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf")),
                          "already exists", "existing output");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 1 --out " + d.file("gqa")).status, 0);
    expect_one_line_error(run_tessera("export-hf --checkpoint " + d.file("gqa") + " --out " + d.file("hf2")),
                          "cannot be written as a Qwen3-Next config", "a plain GQA model");
    EXPECT_FALSE(std::filesystem::exists(d.file("hf2"))) << "nothing written";
}

TEST(Cli, ExportHfWritesQwen3NextForAGdnModel) {
    TempDir d;
    test::CliResult r =
        run_tessera("train --config " + kTiny + " --steps 2 --out " + d.file("run") + test::kTinyQwen3Next);
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(Json::parse(read_text(d.file("hf/config.json")))["model_type"], "qwen3_next");
    const Json idx = Json::parse(read_text(d.file("hf/model.safetensors.index.json")));
    EXPECT_TRUE(idx["weight_map"].contains("model.layers.0.linear_attn.in_proj_qkvz.weight"));
    Tensor ids(DType::i32, Shape{1, 12});
    for (int64_t i = 0; i < 12; ++i) ids.ptr<int32_t>()[i] = int32_t((i * 37 + 11) % 258);
    write_safetensors(d.file("ids.safetensors"), {{"ids", ids}});
    for (const char* src : {"run", "hf"}) {
        r = run_tessera("logits --checkpoint " + d.file(src) + " --in " + d.file("ids.safetensors") + " --out " +
                        d.file(std::string(src) + ".safetensors"));
        ASSERT_EQ(r.status, 0) << src << ": " << r.err;
    }
    // zero-centred norms are stored as w − 1 and read back as (w − 1) + 1: equal up to that rounding
    EXPECT_TRUE(test::rel_rms_close(SafetensorsFile(d.file("run.safetensors")).load("logits"),
                                    SafetensorsFile(d.file("hf.safetensors")).load("logits"), 1e-6));
}

TEST(Cli, ExportHfWritesKimiK3WhenTheModelHasAttentionResiduals) {
    TempDir d;
    const std::string k3 =
        " --set 'model.attention=[\"kda\",\"kda\",\"mla\"]' --set model.n_layers=3 --set model.kda.head_dim=16"
        " --set model.n_kv_heads=null --set model.mla.rope=false --set model.moe.experts=4 --set model.moe.ffn_dim=16"
        " --set model.moe.shared_ffn_dim=32 --set model.output_gate=elementwise --set model.kda.o_norm_eps=1e-6"
        " --set model.kda.gate_lower_bound=-5 --set model.kda.full_rank_output_gate=true"
        " --set model.attn_res_block_size=2";
    test::CliResult r = run_tessera("train --config " + kTiny + " --steps 2 --out " + d.file("run") + k3);
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf"));
    ASSERT_EQ(r.status, 0) << r.err;
    const Json cfg = Json::parse(read_text(d.file("hf/config.json")));
    EXPECT_EQ(cfg["model_type"], "kimi_k3");
    EXPECT_EQ(cfg["text_config"]["attn_res_block_size"], 2);
    const Json idx = Json::parse(read_text(d.file("hf/model.safetensors.index.json")));
    for (const char* name : {"language_model.model.layers.2.mlp_res_proj.weight",
                             "language_model.model.output_attn_res_norm.weight", "language_model.lm_head.weight"}) {
        EXPECT_TRUE(idx["weight_map"].contains(name)) << name;
    }
    Tensor ids(DType::i32, Shape{1, 12});
    for (int64_t i = 0; i < 12; ++i) ids.ptr<int32_t>()[i] = int32_t((i * 31 + 5) % 258);
    write_safetensors(d.file("ids.safetensors"), {{"ids", ids}});
    for (const char* src : {"run", "hf"}) {
        r = run_tessera("logits --checkpoint " + d.file(src) + " --in " + d.file("ids.safetensors") + " --out " +
                        d.file(std::string(src) + ".safetensors"));
        ASSERT_EQ(r.status, 0) << src << ": " << r.err;
    }
    EXPECT_TRUE(test::bitwise_equal(SafetensorsFile(d.file("run.safetensors")).load("logits"),
                                    SafetensorsFile(d.file("hf.safetensors")).load("logits")));
    r = run_tessera("inspect " + d.file("hf"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("residuals: Attention Residuals, depth blocks of 2 layers"), std::string::npos) << r.out;
}

}  // namespace
}  // namespace tessera
