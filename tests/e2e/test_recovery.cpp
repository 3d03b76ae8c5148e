// Supervised recovery (tessera launch --max-restarts; docs/operations.md) under mpirun: a rank killed with SIGKILL
// in a 2- and a 4-rank job, a rank hung in a collective (the watchdog ends it), a restart on fewer ranks. The job
// finishes by itself with the losses of an uninterrupted run, and the times from the fault to its detection and
// back to training are measured and printed (goals: detection <= 5 s, training again <= 10 s plus the checkpoint
// load; docs/operations.md has the numbers): timings are not asserted beyond 30 s, a sign that something hangs.
#include <gtest/gtest.h>

#include <filesystem>
#include <map>
#include <regex>

#include "core/file.h"
#include "core/json.h"
#include "e2e/cli_util.h"
#include "util/test_util.h"

namespace tessera {
namespace {

namespace fs = std::filesystem;
using test::TempDir;

const std::string kTiny = TESSERA_TINY_CONFIG;

// The job: 18 steps of the tiny model, a checkpoint every 6.
std::string job(const std::string& run, const std::string& extra = "") {
    return "train --config " + kTiny + " --steps 18 --out " + run + extra;
}

// From the fault to the job's end (detection), and from there to the first step of the restarted job.
void report_times(const test::CliResult& r, const std::string& run) {
    std::smatch m;
    ASSERT_TRUE(std::regex_search(r.err, m, std::regex(R"(TESSERA_FAULT: [^\n]*step \d+ at unix time ([0-9.]+))")))
        << r.err;
    const double fault = std::stod(m[1]);
    const auto events = test::jsonl(run + "/events.jsonl");
    ASSERT_EQ(events.size(), 1u) << r.err;
    const double ended = events[0]["time"].get<double>();
    double back = 0;
    for (const Json& j : test::jsonl(run + "/metrics.jsonl"))
        if (j.contains("time") && j["time"].get<double>() > ended && back == 0) back = j["time"].get<double>();
    ASSERT_GT(back, 0);
    const double detection = ended - fault, training = back - ended;
    std::printf("recovery: detection %.2f s, back to training %.2f s after (backoff %.0f s included)\n", detection,
                training, events[0]["backoff_seconds"].get<double>());
    EXPECT_LT(detection, 30.0);
    EXPECT_LT(training, 30.0);
}

class KillOneRank : public ::testing::TestWithParam<int> {};

TEST_P(KillOneRank, TheJobRestartsFromItsLastCheckpointWithTheSameLosses) {
    const int ranks = GetParam();
    TempDir d;
    const std::string ref = d.file("ref"), run = d.file("run");
    const test::CliResult a = test::run_tessera(fmt::format("launch -n {} -- {}", ranks, job(ref)));
    ASSERT_EQ(a.status, 0) << a.err;
    test::CliResult b;
    {
        test::FaultEnv fault(fmt::format("kill:10:{}", ranks - 1));
        b = test::run_tessera(fmt::format("launch -n {} --max-restarts 2 -- {}", ranks, job(run)));
    }
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_NE(b.err.find("tessera launch: the job ended with status 137; restart 1/2"), std::string::npos) << b.err;
    const auto events = test::jsonl(run + "/events.jsonl");
    ASSERT_EQ(events.size(), 1u);
    EXPECT_EQ(events[0]["status"], 137);
    EXPECT_EQ(events[0]["from_checkpoint"], true);
    // the lost rank is an alert of the run
    bool alerted = false;
    for (const Json& al : test::jsonl(run + "/alerts.jsonl"))
        alerted |= al["rule"] == "lost_rank" && al["action"] == "restart" && al["value"] == 137.0;
    EXPECT_TRUE(alerted) << read_text(run + "/alerts.jsonl");
    EXPECT_EQ(test::losses(run), test::losses(ref)) << "the restarted job's losses are the uninterrupted job's";
    EXPECT_EQ(test::losses(run).size(), 18u + 3u);  // every step and the evaluations at 6, 12 and 18
    report_times(b, run);
}

INSTANTIATE_TEST_SUITE_P(Ranks, KillOneRank, ::testing::Values(2, 4));

TEST(Recovery, AHungRankIsEndedByTheWatchdogAndTheJobRestarts) {
    TempDir d;
    const std::string ref = d.file("ref"), run = d.file("run");
    const test::CliResult a = test::run_tessera("launch -n 2 -- " + job(ref));
    ASSERT_EQ(a.status, 0) << a.err;
    test::CliResult b;
    {
        test::FaultEnv fault("hang:10:1");
        b = test::run_tessera("launch -n 2 --max-restarts 1 -- " + job(run, " --set monitor.watchdog_seconds=3"));
    }
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_NE(b.err.find("alert [watchdog, stop]"), std::string::npos) << b.err;
    EXPECT_NE(b.err.find("ended with status 124"), std::string::npos) << b.err;
    const auto alerts = test::jsonl(run + "/alerts.jsonl");
    ASSERT_FALSE(alerts.empty());
    EXPECT_EQ(alerts[0]["rule"], "watchdog");
    EXPECT_EQ(test::losses(run), test::losses(ref));
    report_times(b, run);
}

// A rank killed while the asynchronous writer is writing the checkpoint of step 12: the half-written checkpoint
// never becomes one, the restart continues from step 6's, with the same losses.
TEST(Recovery, KilledWhileACheckpointIsWritten) {
    TempDir d;
    const std::string ref = d.file("ref"), run = d.file("run");
    const test::CliResult a = test::run_tessera("launch -n 2 -- " + job(ref));
    ASSERT_EQ(a.status, 0) << a.err;
    test::CliResult b;
    {
        test::FaultEnv fault("kill_write:12:1");
        b = test::run_tessera("launch -n 2 --max-restarts 1 -- " + job(run));
    }
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_NE(b.err.find("TESSERA_FAULT: kill while writing the checkpoint of step 12"), std::string::npos) << b.err;
    EXPECT_NE(b.out.find("resumed from " + run + "/checkpoints/step_0000006 at step 6"), std::string::npos) << b.out;
    // what the killed writers left is gone (removed by the rank that saw its peer die, or by the restarted job)
    for (const auto& e : fs::directory_iterator(run + "/checkpoints"))
        EXPECT_EQ(e.path().filename().string().rfind("step_", 0), 0u) << e.path();
    EXPECT_EQ(test::losses(run), test::losses(ref));
}

// A restart on fewer ranks reshards the checkpoint: one process continues the 2-rank job (ZeRO over one rank is
// the one-process optimizer), with losses close to the uninterrupted job's.
TEST(Recovery, RestartOnFewerRanks) {
    TempDir d;
    const std::string ref = d.file("ref"), run = d.file("run");
    const test::CliResult a = test::run_tessera("launch -n 2 -- " + job(ref));
    ASSERT_EQ(a.status, 0) << a.err;
    test::CliResult b;
    {
        test::FaultEnv fault("kill:8:0");
        b = test::run_tessera("launch -n 2 --max-restarts 1 --restart-ranks 1 -- " + job(run));
    }
    ASSERT_EQ(b.status, 0) << b.err;
    EXPECT_NE(b.err.find("on 1 rank from the last checkpoint"), std::string::npos) << b.err;
    test::expect_close_losses(run, ref);
}

TEST(Recovery, AStragglerRankRaisesAnAlert) {
    TempDir d;
    const std::string run = d.file("run");
    test::FaultEnv fault("slow:4:1");
    const test::CliResult r = test::run_tessera("launch -n 2 -- train --config " + kTiny +
                                                " --steps 8 --set monitor.alerts.straggler.steps=2 --out " + run);
    ASSERT_EQ(r.status, 0) << r.err;
    const auto alerts = test::jsonl(run + "/alerts.jsonl");
    ASSERT_FALSE(alerts.empty()) << r.err;
    EXPECT_EQ(alerts[0]["rule"], "straggler");
    EXPECT_EQ(alerts[0]["step"], 5);
    EXPECT_NE(alerts[0]["message"].get<std::string>().find("rank 1"), std::string::npos) << alerts[0].dump();
}

// The trace of an expert-parallel job: one process per rank, expert chunks on the main track and the exchanges on
// each rank's communication track, where their overlap in time can be seen (printed; the links are slowed so that
// the tiny model's exchanges usually outlast a chunk's compute).
TEST(Recovery, StepTraceOfAnExpertParallelJob) {
    TempDir d;
    const std::string run = d.file("run");
    const test::CliResult r =
        test::run_tessera("launch -n 2 -- train --config " + kTiny + test::kTinyMoe +
                          " --set parallel.ep=2 --set parallel.link_delay_ns_per_byte=2000 --steps 4"
                          " --trace-steps 3:4 --out " +
                          run);
    ASSERT_EQ(r.status, 0) << r.err;
    const Json t = Json::parse(read_text(run + "/trace.json"));
    std::map<std::pair<int, int>, std::string> threads;  // (pid, tid) -> name
    for (const Json& e : t["traceEvents"])
        if (e["ph"] == "M" && e["name"] == "thread_name") threads[{e["pid"], e["tid"]}] = e["args"]["name"];
    for (int pid : {0, 1}) {
        std::vector<std::pair<double, double>> experts, exchanges;
        for (const Json& e : t["traceEvents"]) {
            if (e["ph"] != "X" || e["pid"] != pid) continue;
            const std::pair<double, double> span{e["ts"].get<double>(), e["ts"].get<double>() + e["dur"].get<double>()};
            if (e["name"] == "experts") experts.push_back(span);
            if (e["name"] == "all_to_all") {
                const std::pair<int, int> track(pid, e["tid"].get<int>());
                EXPECT_EQ(threads[track], "communication");
                exchanges.push_back(span);
            }
        }
        EXPECT_FALSE(experts.empty()) << "rank " << pid;
        EXPECT_FALSE(exchanges.empty()) << "rank " << pid;
        // the overlap itself is timing (how long an exchange lasts against a chunk's compute depends on the load
        // of the machine and on where the tokens go): printed, not asserted
        int overlapping = 0;
        for (const auto& a : experts)
            for (const auto& b : exchanges) overlapping += a.first < b.second && b.first < a.second;
        std::printf("rank %d: %d expert spans, %d exchanges, %d pairs overlapping in time\n", pid, int(experts.size()),
                    int(exchanges.size()), overlapping);
    }
}

TEST(Recovery, NoRestartWhenTheJobFailsBeforeItsFirstStep) {
    TempDir d;
    const test::CliResult r =
        test::run_tessera("launch -n 2 --max-restarts 3 -- " + job(d.file("run"), " --set train.lr=-1"));
    EXPECT_EQ(r.status, 1) << r.err;
    EXPECT_NE(r.err.find("train.lr must be positive"), std::string::npos) << r.err;
    EXPECT_NE(r.err.find("before training a step: not restarting"), std::string::npos) << r.err;
    EXPECT_EQ(r.err.find("restart 1/3"), std::string::npos) << r.err;
    test::expect_one_line_error(test::run_tessera("launch -n 2 --max-restarts 1 -- train --config " + kTiny),
                                "needs train --out DIR", "supervising without a run directory");
    test::expect_one_line_error(test::run_tessera("launch -n 2 --max-restarts 1 -- inspect x"),
                                "supervises a train job", "supervising another command");
}

}  // namespace
}  // namespace tessera
