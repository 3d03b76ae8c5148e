// SIGINT (Ctrl-C) and SIGTERM (Slurm, Kubernetes and container platforms before they stop a job) end a training
// run the same way: the step finishes, a checkpoint is written, one line on stderr says so, and the exit status
// is 130 or 143; --resume then continues from that checkpoint.
#include <gtest/gtest.h>
#include <signal.h>

#include <chrono>
#include <filesystem>
#include <thread>

#include "core/file.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;

// Waits until the run has logged a training step (its handlers are installed by then).
bool wait_for_a_step(const std::string& metrics, double timeout_s) {
    const auto t0 = std::chrono::steady_clock::now();
    while (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() < timeout_s) {
        if (fs::exists(metrics) && read_text(metrics).find("\"loss\"") != std::string::npos) return true;
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    return false;
}

class StopSignal : public ::testing::TestWithParam<int> {};

TEST_P(StopSignal, WritesACheckpointSaysSoAndExitsWith128PlusTheSignal) {
    const int sig = GetParam();
    TempDir d;
    const std::string run = d.file("run");
    const test::Background bg = test::start_tessera(
        "train --config " + kTiny + " --steps 1000000 --set train.checkpoint_interval=0 --out " + run, d.path());
    ASSERT_TRUE(wait_for_a_step(run + "/metrics.jsonl", 60)) << read_text(bg.err_file);
    ::kill(bg.pid, sig);
    bool normal = false;
    const test::CliResult r = test::wait_tessera(bg, 60, &normal);
    EXPECT_TRUE(normal) << "killed by the signal, nothing saved";
    EXPECT_EQ(r.status, 128 + sig) << r.err;
    const std::string name = sig == SIGTERM ? "SIGTERM" : "SIGINT";
    EXPECT_EQ(r.err.rfind("tessera: stopped by " + name + " after step ", 0), 0u) << r.err;
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << r.err;
    EXPECT_NE(r.err.find("--resume " + run), std::string::npos) << r.err;
    ASSERT_TRUE(fs::exists(run + "/checkpoints")) << r.err;
    // and the run continues from there
    const size_t at = r.err.find("after step ");
    ASSERT_NE(at, std::string::npos);
    const int64_t step = std::stoll(r.err.substr(at + 11));
    EXPECT_TRUE(fs::exists(fmt::format("{}/checkpoints/step_{:07d}", run, step))) << r.err;
    const test::CliResult resumed = test::run_tessera(fmt::format("train --resume {} --steps {}", run, step + 1));
    EXPECT_EQ(resumed.status, 0) << resumed.err;
    EXPECT_NE(resumed.out.find(fmt::format("resumed from {}/checkpoints/step_{:07d}", run, step)), std::string::npos)
        << resumed.out;
}

INSTANTIATE_TEST_SUITE_P(Signals, StopSignal, ::testing::Values(SIGINT, SIGTERM), [](const auto& info) {
    return info.param == SIGTERM ? "SIGTERM" : "SIGINT";
});

}  // namespace
}  // namespace tessera
