// The CLI from the outside: every bad input ends in one line on stderr ("error: ...") and a
// non-zero exit, never a crash; the op runner, data and generate commands work end to end.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "ops/linear.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::run_tessera;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;

void expect_one_line_error(const test::CliResult& r, const std::string& needle, const std::string& what) {
    SCOPED_TRACE(what);
    EXPECT_NE(r.status, 0);
    EXPECT_LT(r.status, 128) << "killed by a signal";
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err;
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err;
}

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
                    " --out " + d.file("run"));
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("checkpoint: "), std::string::npos);
    r = run_tessera("generate --checkpoint " + d.file("run") + " --prompt 'the quick' --max-new-tokens 20 --seed 3");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_EQ(r.out.rfind("the quick", 0), 0u) << r.out;
    EXPECT_GE(r.out.size(), std::string("the quick").size() + 1);
    test::CliResult again =
        run_tessera("generate --checkpoint " + d.file("run") + " --prompt 'the quick' --max-new-tokens 20 --seed 3");
    EXPECT_EQ(again.out, r.out) << "same seed, same sample";
    expect_one_line_error(run_tessera("generate --checkpoint " + d.file("nowhere") + " --prompt x"),
                          "no such directory", "missing checkpoint");
}

}  // namespace
}  // namespace tessera
