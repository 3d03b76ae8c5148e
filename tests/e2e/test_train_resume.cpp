// Checkpoints from the outside: a run resumed from its checkpoint reproduces the uninterrupted
// run's losses bit for bit; truncated or corrupted checkpoints are refused with a clear message;
// a run directory is never overwritten by accident.
#include <gtest/gtest.h>

#include <filesystem>
#include <fstream>
#include <set>
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

class Resume : public ::testing::TestWithParam<std::string> {};

// Dense, and MoE with each balancing rule: the selection bias is model state and must resume too.
TEST_P(Resume, ContinuesBitwiseIdentically) {
    TempDir d;
    const std::string full = d.file("full"), part = d.file("part");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + full + GetParam()).status, 0);
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

std::string run_name(const ::testing::TestParamInfo<std::string>& info) {
    const std::vector<std::string> names = {"dense", "moe_sign", "moe_quantile", "hybrid_kda_dsa"};
    return names[info.index];
}
INSTANTIATE_TEST_SUITE_P(Runs,
                         Resume,
                         ::testing::Values("",
                                           test::kTinyMoe + " --set model.moe.balance=sign",
                                           test::kTinyMoe +
                                               " --set model.moe.balance=quantile --set model.moe.latent_dim=16"
                                               " --set model.moe.bias_update_rate=null",
                                           test::kTinyHybrid),
                         run_name);

// memory.optimizer_offload: AdamW's moments in an unlinked file (train/optimizer.h) train the same bits, checkpoint
// the same files (written while training goes on), resume either way, and leave nothing in the run directory.
TEST(OptimizerOffload, SameBitsSameCheckpointsResumesEitherWay) {
    TempDir d;
    const std::string plain = d.file("plain"), off = d.file("off"), back = d.file("back");
    const std::string offload = " --set memory.optimizer_offload=true";
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --out " + plain).status, 0);
    test::CliResult r = run_tessera("train --config " + kTiny + " --out " + off + offload);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("optimizer offload: AdamW's moments"), std::string::npos) << r.out;
    EXPECT_EQ(losses(plain), losses(off));
    for (const char* file : {"model.safetensors", "optimizer-00000-of-00001.safetensors"})
        for (const char* step : {"step_0000006", "step_0000012"}) {
            const std::string f = std::string("/checkpoints/") + step + "/" + file;
            EXPECT_TRUE(read_text(plain + f) == read_text(off + f)) << f;
        }
    std::set<std::string> entries;
    for (const auto& e : fs::directory_iterator(off)) entries.insert(e.path().filename().string());
    EXPECT_EQ(entries, (std::set<std::string>{"alerts.jsonl", "checkpoints", "config.json", "metrics.jsonl"}));
    // the offloaded run's step-6 checkpoint resumed without offload, and the plain one's with it elsewhere
    for (const auto& [from, sets] : {std::pair{off, std::string()}, std::pair{plain, offload +
                                                                                         " --set "
                                                                                         "memory.offload_dir=" +
                                                                                         d.file("")}}) {
        fs::remove_all(back);
        fs::create_directories(back + "/checkpoints");
        fs::copy(from + "/checkpoints/step_0000006", back + "/checkpoints/step_0000006");
        r = run_tessera("train --resume " + back + sets);
        ASSERT_EQ(r.status, 0) << r.err;
        auto a = losses(plain), b = losses(back);
        for (auto it = a.begin(); it != a.end() && it->first <= 6;) it = a.erase(it);
        EXPECT_EQ(a, b) << sets;
        EXPECT_TRUE(read_text(plain + "/checkpoints/step_0000012/model.safetensors") ==
                    read_text(back + "/checkpoints/step_0000012/model.safetensors"))
            << sets;
    }
    // where the file cannot be made: one line, nothing trained
    r = run_tessera("train --config " + kTiny + " --out " + d.file("bad") + offload +
                    " --set memory.offload_dir=" + d.file("missing"));
    test::expect_one_line_error(r, d.file("missing") + ": not a directory", "an offload directory that is not there");
}

TEST(DsaRun, WarmupThenSparseStageOnTheSameRunLogsTheIndexerKl) {
    TempDir d;
    const std::string run = d.file("run");
    test::CliResult r = run_tessera("train --config " + kTiny + " --steps 3 --out " + run + test::kTinyHybrid +
                                    " --set model.mla.dsa.stage=dense_warmup");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("indexer KL"), std::string::npos) << r.out;
    r = run_tessera("train --resume " + run + " --steps 6 --set model.mla.dsa.stage=sparse");
    ASSERT_EQ(r.status, 0) << r.err;
    r = run_tessera("train --resume " + run + " --steps 7 --set model.mla.dsa.topk=4");
    EXPECT_NE(r.status, 0);
    EXPECT_NE(r.err.find("model.* cannot change"), std::string::npos) << r.err;
    std::istringstream in(read_text(run + "/metrics.jsonl"));
    std::string line;
    int steps = 0;
    while (std::getline(in, line)) {
        Json j = Json::parse(line);
        if (!j.contains("loss")) continue;
        ++steps;
        ASSERT_TRUE(j.contains("dsa")) << line;
        ASSERT_EQ(j["dsa"].size(), 1u);
        EXPECT_EQ(j["dsa"][0]["layer"].get<int64_t>(), 1);
        EXPECT_GT(j["dsa"][0]["indexer_kl"].get<double>(), 0.0);
    }
    EXPECT_EQ(steps, 6);
}

TEST(MoeRun, LogsExpertLoadPerLayerAndMovesTheBias) {
    TempDir d;
    const std::string run = d.file("run");
    test::CliResult r = run_tessera("train --config " + kTiny + " --steps 4 --out " + run + test::kTinyMoe +
                                    " --set model.moe.first_dense=0 --set model.moe.capacity_factor=1"
                                    " --set model.ffn_dim=null");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("experts: max overload"), std::string::npos) << r.out;
    std::istringstream in(read_text(run + "/metrics.jsonl"));
    std::string line;
    int steps = 0;
    while (std::getline(in, line)) {
        Json j = Json::parse(line);
        if (!j.contains("loss")) continue;
        ++steps;
        ASSERT_TRUE(j.contains("moe")) << line;
        ASSERT_EQ(j["moe"].size(), 2u);  // both layers
        for (const Json& l : j["moe"]) {
            int64_t total = 0;
            for (const Json& c : l["load"]) total += c.get<int64_t>();
            EXPECT_EQ(total, 4 * 32 * 2);  // every token's two choices
            EXPECT_GE(l["overload"].get<double>(), 1.0);
            EXPECT_GE(l["rerouted"].get<int64_t>() + l["dropped"].get<int64_t>(), 0);
            EXPECT_LT(l["bias_min"].get<double>(), l["bias_max"].get<double>()) << "the sign rule moved nothing";
        }
    }
    EXPECT_EQ(steps, 4);
}

TEST(ResumeChecks, RefusesTruncatedAndCorruptedCheckpoints) {
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

TEST(ResumeChecks, ModelChangesAndOverwritesAreRefused) {
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
