// Bad input tried in bulk (issue 11 §7), from outside the binary: every case ends in one short line on stderr
// and a non-zero exit; never a crash, a hang, a silently different run or leftovers that block the next one.
#include <gtest/gtest.h>

#include <cstring>
#include <filesystem>
#include <fstream>

#include "core/config_reader.h"
#include "core/device.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::expect_one_line_error;
using test::run_tessera;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;

void write_file(const std::string& path, const std::string& text) { std::ofstream(path, std::ios::binary) << text; }
std::string nested(int depth) { return std::string(size_t(depth), '[') + std::string(size_t(depth), ']'); }

TEST(BadInput, DeeplyNestedJsonIsRefusedNotACrash) {
    TempDir d;
    write_file(d.file("deep.json"), "{\"model\": {\"d_model\": " + nested(300000) + "}}");
    expect_one_line_error(run_tessera("train --config " + d.file("deep.json") + " --out " + d.file("r")),
                          "nested deeper than 64 levels", "config");
    const std::string header =
        "{\"x\": {\"dtype\": \"F32\", \"shape\": " + nested(300000) + ", \"data_offsets\": [0, 0]}}";
    std::string file(8, '\0');
    const uint64_t n = header.size();
    std::memcpy(file.data(), &n, 8);
    write_file(d.file("deep.safetensors"), file + header);
    expect_one_line_error(
        run_tessera("op linear --in " + d.file("deep.safetensors") + " --out " + d.file("o.safetensors")),
        "nested deeper than 64 levels", "safetensors header");
}

TEST(BadInput, ConfigFilesMustHoldAnObject) {
    TempDir d;
    write_file(d.file("null.json"), "null");
    expect_one_line_error(
        run_tessera("train --config " + d.file("null.json") + " --set train.steps=1 --out " + d.file("r")),
        "must be a JSON object, not null", "null config with --set");
    EXPECT_FALSE(fs::exists(d.file("r")));
    expect_one_line_error(run_tessera("train --config " + d.path() + " --out " + d.file("r")), "is a directory",
                          "a directory as config");
    expect_one_line_error(run_tessera("train --config /dev/zero --out " + d.file("r")), "larger than",
                          "an endless config");
}

TEST(BadInput, LongValuesAreEchoedAsExcerpts) {
    TempDir d;
    write_file(d.file("long.json"), "{\"train\": {\"lr\": \"" + std::string(1 << 20, 'x') + "\"}}");
    expect_one_line_error(run_tessera("train --config " + d.file("long.json") + " --out " + d.file("r")),
                          "train.lr must be a number", "megabyte value", 400);
    expect_one_line_error(run_tessera("train --config " + kTiny + " --set train.lr=" + std::string(100000, 'y') +
                                      " --out " + d.file("r")),
                          "more bytes", "100 kB --set value", 400);
}

TEST(BadInput, SizesFromConfigsAreBounded) {
    TempDir d;
    // 2^62 · d_model wrapped to a small buffer, and the step wrote past it (a segmentation fault)
    expect_one_line_error(
        run_tessera("train --config " + kTiny + " --set model.vocab_size=4611686018427387904 --out " + d.file("r")),
        "model.vocab_size = 4611686018427387904 must be in [1, 16777216]", "vocab 2^62");
    // negative values meant "the default" for keys whose 0 does
    expect_one_line_error(run_tessera("train --config " + kTiny +
                                      " --set model.attention=kda --set model.n_kv_heads=null --set "
                                      "model.kda.gate_rank=-5 --out " +
                                      d.file("r")),
                          "gate_rank must be >= 0", "negative gate rank");
    // issue 11 §6: a key no layer reads
    expect_one_line_error(run_tessera("train --config " + kTiny +
                                      " --set model.attention=kda --set model.qk_norm=true --out " + d.file("r")),
                          "model.qk_norm is set but no layer is \"gqa\"", "qk_norm without gqa layers");
}

TEST(BadInput, ARunLargerThanTheMachineIsRefusedWithItsSize) {
    TempDir d;
    expect_one_line_error(run_tessera("train --config " + kTiny +
                                      " --set model.vocab_size=16777216 --set model.d_model=131072 --set "
                                      "model.n_heads=128 --set model.n_kv_heads=128 --out " +
                                      d.file("r")),
                          "the model needs 67602.5 GiB of memory (params 16896.2 GiB", "16 TiB of parameters");
}

TEST(BadInput, NumericOptionsAreStrict) {
    TempDir d;
    const std::string out = " --out " + d.file("r");
    // saturated to INT64_MAX, this trained forever
    expect_one_line_error(run_tessera("train --config " + kTiny + " --steps 18446744073709551616" + out),
                          "--steps: '18446744073709551616' is not an integer in [0, 1000000000000]", "huge --steps");
    expect_one_line_error(run_tessera("generate --checkpoint x --prompt a --temperature nan"),
                          "--temperature: 'nan' is not a number in [0, 1000000]", "NaN temperature");
    // CLI11's own range message printed DBL_MAX with 309 digits
    expect_one_line_error(run_tessera("generate --checkpoint x --prompt a --temperature 1e400"),
                          "'1e400' is not a number", "overflowing temperature", 200);
    expect_one_line_error(run_tessera("generate --checkpoint x --prompt a --seed -1"), "--seed: '-1'",
                          "negative seed (was 2^64 - 1)");
    expect_one_line_error(run_tessera("generate --checkpoint x --prompt a --top-k 5x"), "--top-k: '5x'",
                          "trailing junk");
    expect_one_line_error(run_tessera("generate --checkpoint x --prompt a --max-new-tokens 0x10"),
                          "--max-new-tokens: '0x10'", "hexadecimal");
    expect_one_line_error(run_tessera("inspect " + kTiny + " --seq 0"), "--seq: '0'", "zero sequence");
    expect_one_line_error(run_tessera("train --threads 100000 --config " + kTiny + out), "--threads: '100000'",
                          "absurd thread count");
    // 010 is ten, not octal eight
    const test::CliResult r = run_tessera("train --config " + kTiny + " --steps 010" + out);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("step 10/10"), std::string::npos) << r.out;
}

TEST(BadInput, GlobalOptionsAfterTheSubcommand) {
    // issue 11 §5: `tessera logits --threads 1 ...` was a usage error
    expect_one_line_error(run_tessera("logits --threads 1 --checkpoint nowhere --in a --out b"), "nowhere: no such",
                          "--threads after the subcommand");
    const test::CliResult r = run_tessera("inspect --threads 1 " + kTiny);
    EXPECT_EQ(r.status, 0) << r.err;
}

TEST(BadInput, EndlessDataFilesAndMisplacedOutputs) {
    TempDir d;
    // read forever before: a device is no text file
    expect_one_line_error(run_tessera("data /dev/zero --out " + d.file("s.safetensors")),
                          "/dev/zero: not a regular file or a directory", "data from /dev/zero");
    expect_one_line_error(run_tessera("train --config " + kTiny + " --set data.path=/dev/zero --out " + d.file("r")),
                          "not a regular file", "training on /dev/zero");
    write_file(d.file("file"), "x");
    expect_one_line_error(run_tessera("train --config " + kTiny + " --out " + d.file("file")),
                          "exists and is not a directory", "--out names a file");
}

TEST(BadInput, WrongTypesInHuggingFaceConfigsHaveNoLibraryPrefix) {
    TempDir d;
    Json cfg = Json::parse(read_text(test::golden_path("hf/qwen3_next_tiny/config.json")));
    cfg["rope_parameters"]["rope_theta"] = "big";
    write_file(d.file("config.json"), cfg.dump());
    const test::CliResult r = run_tessera("inspect " + d.path());
    expect_one_line_error(r, "rope_parameters: \"rope_theta\" must be a number, not \"big\"", "a string rope_theta");
    EXPECT_EQ(r.err.find("json.exception"), std::string::npos) << r.err;
}

TEST(BadInput, OpListTakesNothingElse) {
    // --set, --in and an op name next to --list were ignored without a word
    expect_one_line_error(run_tessera("op --list --set eps=1"), "--list takes no op name, --in, --out or --set",
                          "--list with --set");
    expect_one_line_error(run_tessera("op rmsnorm --list"), "--list takes no op name", "--list with a name");
}

TEST(BadInput, OpOnADeviceThisMachineLacksIsOneLine) {
    TempDir d;
    const std::string io = " --in " + test::golden_path("ops/linear.safetensors") + " --out " + d.file("o.safetensors");
    expect_one_line_error(run_tessera("op linear --device tpu" + io), "--device", "an unknown device");
    if (!cuda_available()) {
        expect_one_line_error(run_tessera("op linear --device cuda" + io),
                              cuda_built() ? "no CUDA device is visible" : "this build has no CUDA backend",
                              "--device cuda without a GPU");
    }
    EXPECT_FALSE(std::filesystem::exists(d.file("o.safetensors")));
}

TEST(BadInput, UsageErrorsEchoLongArgumentsAsExcerpts) {
    expect_one_line_error(run_tessera("train --bogus " + std::string(100000, 'z')), "not expected", "long argument",
                          1200);
}

}  // namespace
}  // namespace tessera
