// Checkpoints from the outside: a run resumed from its checkpoint reproduces the uninterrupted
// run's losses bit for bit; truncated or corrupted checkpoints are refused with a clear message;
// a run directory is never overwritten by accident.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <sstream>

#include "core/config_reader.h"
#include "core/file.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

using test::run_tessera;
using test::TempDir;
namespace fs = std::filesystem;

const std::string kTiny = TESSERA_TINY_CONFIG;

// step -> the "loss" field exactly as written (shortest round-trip text: equal text = equal bits)
std::map<int64_t, std::string> losses(const std::string& run_dir) {
    std::map<int64_t, std::string> out;
    std::istringstream in(read_text(run_dir + "/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
        Json j = Json::parse(line);
        if (j.contains("loss")) out[j["step"].get<int64_t>()] = j["loss"].dump();
    }
    return out;
}

TEST(Resume, ContinuesBitwiseIdentically) {
    TempDir d;
    const std::string full = d.file("full"), part = d.file("part");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + full).status, 0);
    // The same run, interrupted after its step-6 checkpoint: its directory holds that checkpoint and
    // metrics of steps past it (written before the crash), which the resumed run must replace.
    fs::create_directories(part + "/checkpoints");
    fs::copy(full + "/checkpoints/step_0000006", part + "/checkpoints/step_0000006");
    std::string metrics;
    for (auto& [step, loss] : losses(full)) {
        metrics += Json{{"step", step}, {"loss", step <= 6 ? Json::parse(loss) : Json(99.0)}}.dump() + "\n";
    }
    write_text_atomic(part + "/metrics.jsonl", metrics);
    test::CliResult r = run_tessera("train --resume " + part);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("resumed from"), std::string::npos);
    auto a = losses(full), b = losses(part);
    ASSERT_EQ(a.size(), 12u);
    EXPECT_EQ(a, b);
    // and the final parameters are the same bits
    EXPECT_EQ(read_text(full + "/checkpoints/step_0000012/model.safetensors"),
              read_text(part + "/checkpoints/step_0000012/model.safetensors"));
}

TEST(Resume, RefusesTruncatedAndCorruptedCheckpoints) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 6 --out " + run).status, 0);
    const std::string ckpt = run + "/checkpoints/step_0000006";
    const std::string model = ckpt + "/model.safetensors";
    const std::string good = read_text(model);

    std::string bad = good;
    bad[bad.size() / 2] ^= 0x5a;
    std::ofstream(model, std::ios::binary | std::ios::trunc) << bad;
    test::CliResult r = run_tessera("train --resume " + run + " --steps 8");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("checksum mismatch"), std::string::npos) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;

    std::ofstream(model, std::ios::binary | std::ios::trunc) << good.substr(0, good.size() - 100);
    r = run_tessera("train --resume " + run + " --steps 8");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("truncated"), std::string::npos) << r.err;

    std::ofstream(model, std::ios::binary | std::ios::trunc) << good;
    std::ofstream(ckpt + "/trainer_state.json", std::ios::trunc) << "{\"format\": 1, \"step\": ";
    r = run_tessera("train --resume " + run + " --steps 8");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("trainer_state.json: not valid JSON"), std::string::npos) << r.err;

    fs::remove(ckpt + "/trainer_state.json");  // an incomplete checkpoint directory is not a checkpoint
    r = run_tessera("train --resume " + run + " --steps 8");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("no complete checkpoint"), std::string::npos) << r.err;
}

TEST(Resume, ModelChangesAndOverwritesAreRefused) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 2 --out " + run).status, 0);
    test::CliResult r = run_tessera("train --resume " + run + " --set model.d_model=64");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("model.* cannot change"), std::string::npos) << r.err;
    r = run_tessera("train --config " + kTiny + " --out " + run);
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("already holds a run"), std::string::npos) << r.err;
    // the first run's files are intact
    EXPECT_TRUE(fs::exists(run + "/checkpoints/step_0000002/model.safetensors"));
    for (auto& e : fs::recursive_directory_iterator(run)) {
        EXPECT_EQ(e.path().filename().string().find(".tmp"), std::string::npos) << "left behind: " << e.path();
    }
}

}  // namespace
}  // namespace tessera
