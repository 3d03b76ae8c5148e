// Checkpoints and run directories that are wrong, or left behind by a run that failed or was killed: refused
// with one line naming the problem, or cleaned up so the same command works again.
#include <gtest/gtest.h>
#include <sys/wait.h>
#include <unistd.h>

#include <cctype>
#include <climits>
#include <cmath>
#include <filesystem>
#include <fstream>

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

std::string replace(std::string s, const std::string& from, const std::string& to) {
    const size_t at = s.find(from);
    EXPECT_NE(at, std::string::npos) << from;
    return at == std::string::npos ? s : s.replace(at, from.size(), to);
}

TEST(RunDirs, TrainerStateMustAgreeWithItsDirectory) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 6 --out " + run).status, 0);
    const std::string state = run + "/checkpoints/step_0000006/trainer_state.json";
    const std::string good = read_text(state);
    write_text_atomic(state, replace(good, "\"step\": 6", "\"step\": 2"));
    expect_one_line_error(run_tessera("train --resume " + run + " --steps 8"),
                          "step 2 contradicts the checkpoint's directory (step 6", "step against directory");
    write_text_atomic(state, replace(good, "\"optimizer_step\": 6", "\"optimizer_step\": 9"));
    expect_one_line_error(run_tessera("train --resume " + run + " --steps 8"), "optimizer_step 9 is past step 6",
                          "optimizer step past the step");
    // a step number past int64 in a directory name was "error: stoll"
    write_text_atomic(state, good);
    fs::copy(run + "/checkpoints/step_0000006", run + "/checkpoints/step_99999999999999999999");
    expect_one_line_error(run_tessera("generate --checkpoint " + run + " --prompt a --max-new-tokens 1"),
                          "step_99999999999999999999: the step in the name is out of range", "step name overflow");
}

TEST(RunDirs, NonFiniteWeightsAreRefused) {
    TempDir d;
    const std::string run = d.file("run");
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 2 --out " + run).status, 0);
    const std::string model = run + "/checkpoints/step_0000002/model.safetensors";
    std::vector<Tensor> owned;
    std::vector<NamedTensor> named;
    {
        SafetensorsFile f(model);
        for (const auto& e : f.entries()) {
            owned.push_back(f.load(e.name));
            named.push_back({e.name, owned.back().view()});
        }
    }
    owned[1].ptr<float>()[3] = NAN;  // a valid file (checksum and all) holding a NaN
    write_safetensors(model, named);
    const std::string name = named[1].name;
    expect_one_line_error(run_tessera("generate --checkpoint " + run + " --prompt a --max-new-tokens 1"),
                          "tensor \"" + name + "\" holds nan at index 3", "generate with a NaN weight");
    expect_one_line_error(run_tessera("train --resume " + run + " --steps 3"), "holds nan", "resume with a NaN weight");
    owned[1].ptr<float>()[3] = -INFINITY;
    write_safetensors(model, named);
    expect_one_line_error(run_tessera("generate --checkpoint " + run + " --prompt a --max-new-tokens 1"), "holds -inf",
                          "generate with an infinite weight");
}

TEST(RunDirs, ARunThatFailsBeforeItsFirstCheckpointLeavesNothing) {
    TempDir d;
    const std::string run = d.file("run");
    // steps 2, 3, 4 are not finite: two skipped (an alert line each on stderr), the third in a row ends the run
    const std::string cmd = "train --config " + kTiny + " --steps 5 --set train.lr=1e30 --out " + run;
    const auto diverges = [&](const std::string& what) {
        SCOPED_TRACE(what);
        const test::CliResult r = run_tessera(cmd);
        EXPECT_EQ(r.status, 1);
        EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 3) << r.err;
        EXPECT_NE(r.err.find("alert [nonfinite, skip]: step 3"), std::string::npos) << r.err;
        EXPECT_NE(r.err.find("\nerror: training diverged at step 4: the loss is"), std::string::npos) << r.err;
    };
    diverges("a diverging run");
    EXPECT_FALSE(fs::exists(run)) << "left config.json / metrics.jsonl / alerts.jsonl behind";
    // the same command says the same thing again, not "already holds a run"
    diverges("the same command again");
    // what a killed run leaves before its first checkpoint does not block a fresh start either
    fs::create_directories(run);
    write_text_atomic(run + "/config.json", "{}");
    write_text_atomic(run + "/metrics.jsonl", "");
    const test::CliResult r = run_tessera("train --config " + kTiny + " --steps 2 --out " + run);
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("holds no checkpoint: starting over"), std::string::npos) << r.out;
}

std::string host() {
    char buf[HOST_NAME_MAX + 1] = {};
    ::gethostname(buf, sizeof buf - 1);
    std::string h(buf);
    for (char& c : h) {
        if (!std::isalnum(static_cast<unsigned char>(c))) c = '_';
    }
    return h;
}

int dead_pid() {  // a child that has exited and been reaped
    const int pid = ::fork();
    if (pid == 0) ::_exit(0);
    ::waitpid(pid, nullptr, 0);
    return pid;
}

TEST(RunDirs, TemporariesOfKilledWritersAreCleanedSafely) {
    TempDir d;
    const std::string run = d.file("run"), ck = run + "/checkpoints/";
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 2 --out " + run).status, 0);
    const std::string dead = std::to_string(dead_pid()), live = std::to_string(::getpid());
    fs::create_directories(ck + ".step_0000004.tmp-" + host() + "-" + dead);  // killed mid-write
    fs::create_directories(ck + ".step_0000005.tmp-" + dead);                 // the older name: pid only
    fs::create_directories(ck + ".step_0000006.tmp-" + host() + "-" + live);  // a live writer: kept
    fs::create_directories(ck + ".step_0000007.tmp-otherhost-" + dead);       // another host's: kept
    // killed between moving step 2 aside and moving its replacement in: step 2 comes back
    fs::rename(ck + "step_0000002", ck + ".step_0000002.old-" + host() + "-" + dead);
    write_text_atomic(run + "/metrics.jsonl.tmp-" + dead, "");
    const test::CliResult r = run_tessera("train --resume " + run + " --steps 3");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_NE(r.out.find("cleaned up after a killed run: restored"), std::string::npos) << r.out;
    EXPECT_NE(r.out.find("resumed from " + ck + "step_0000002"), std::string::npos) << r.out;
    EXPECT_FALSE(fs::exists(ck + ".step_0000004.tmp-" + host() + "-" + dead));
    EXPECT_FALSE(fs::exists(ck + ".step_0000005.tmp-" + dead));
    EXPECT_FALSE(fs::exists(run + "/metrics.jsonl.tmp-" + dead));
    EXPECT_TRUE(fs::exists(ck + ".step_0000006.tmp-" + host() + "-" + live));
    EXPECT_TRUE(fs::exists(ck + ".step_0000007.tmp-otherhost-" + dead));
    EXPECT_TRUE(fs::exists(ck + "step_0000003/model.safetensors"));
}

TEST(RunDirs, AnExportKilledMidwayBlocksNothing) {
    TempDir d;
    const std::string kimi =  // as in Cli.ExportHfWritesAKimiLinearDirectoryThatScoresIdentically
        " --set 'model.attention=[\"kda\",\"kda\",\"mla\"]' --set model.n_layers=3 --set model.kda.head_dim=16"
        " --set model.n_kv_heads=null --set model.mla.q_lora_rank=16 --set model.moe.experts=4"
        " --set model.moe.ffn_dim=16 --set model.moe.shared_ffn_dim=32 --set model.output_gate=elementwise"
        " --set model.kda.o_norm_eps=1e-6";
    ASSERT_EQ(run_tessera("train --config " + kTiny + " --steps 1 --out " + d.file("run") + kimi).status, 0);
    // what a killed export leaves: its temporary directory (it used to write into --out itself, which the next
    // export then refused as "not an empty directory")
    const std::string stale = d.file("hf.tmp-" + host() + "-" + std::to_string(dead_pid()));
    fs::create_directories(stale);
    write_text_atomic(stale + "/model-00001-of-00009.safetensors", "partial");
    const test::CliResult r = run_tessera("export-hf --checkpoint " + d.file("run") + " --out " + d.file("hf") + "/");
    ASSERT_EQ(r.status, 0) << r.err;
    EXPECT_FALSE(fs::exists(stale));
    EXPECT_TRUE(fs::exists(d.file("hf/config.json")));
    for (const auto& e : fs::directory_iterator(d.path())) {
        EXPECT_EQ(e.path().filename().string().find(".tmp-"), std::string::npos) << "left behind: " << e.path();
    }
}

}  // namespace
}  // namespace tessera
