// Runs the tessera binary through the shell, capturing its streams in temporary files.
#include "e2e/cli_util.h"

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdlib>
#include <filesystem>
#include <thread>

#include <gtest/gtest.h>

#include <sstream>

#include "core/config_reader.h"
#include "core/file.h"
#include "util/test_util.h"

namespace tessera::test {

namespace {
// TESSERA_TEST_BIN: another binary to test (e.g. an older build, to see a new test fail before its fix)
std::string binary() {
    const char* other = std::getenv("TESSERA_TEST_BIN");
    return other && *other ? other : TESSERA_BIN;
}

CliResult run_command(const std::string& command_line) {
    TempDir dir;
    const std::string cmd = command_line + " > " + dir.file("out") + " 2> " + dir.file("err");
    const int raw = std::system(cmd.c_str());
    CliResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    r.out = read_text(dir.file("out"));
    r.err = read_text(dir.file("err"));
    return r;
}
}  // namespace

CliResult run_tessera(const std::string& args) { return run_command(binary() + " --threads 2 " + args); }

#ifdef TESSERA_MPIEXEC
CliResult run_tessera_mpi(int ranks, const std::string& args) {
    return run_command(std::string(TESSERA_MPIEXEC) + " --allow-run-as-root --oversubscribe -n " +
                       std::to_string(ranks) + " -x OMP_NUM_THREADS=1 " + binary() + " " + args);
}
#endif

Background start_tessera(const std::string& args, const std::string& dir) {
    Background b{-1, dir + "/bg.out", dir + "/bg.err"};
    const std::string cmd = "exec " + binary() + " --threads 2 " + args + " > " + b.out_file + " 2> " + b.err_file;
    b.pid = ::fork();
    if (b.pid == 0) {
        ::execl("/bin/sh", "sh", "-c", cmd.c_str(), static_cast<char*>(nullptr));
        ::_exit(127);
    }
    return b;
}

CliResult wait_tessera(const Background& b, double timeout_s, bool* exited_normally) {
    const auto t0 = std::chrono::steady_clock::now();
    int raw = 0;
    while (::waitpid(b.pid, &raw, WNOHANG) == 0) {
        if (std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() > timeout_s) {
            ::kill(b.pid, SIGKILL);
            ::waitpid(b.pid, &raw, 0);
            ADD_FAILURE() << "tessera did not end within " << timeout_s << " s";
            break;
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
    CliResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    if (exited_normally) *exited_normally = WIFEXITED(raw);
    r.out = read_text(b.out_file);
    r.err = read_text(b.err_file);
    return r;
}

void expect_one_line_error(const CliResult& r, const std::string& needle, const std::string& what, size_t max_chars) {
    SCOPED_TRACE(what);
    EXPECT_NE(r.status, 0);
    EXPECT_LT(r.status, 128) << "killed by a signal";
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err.substr(0, 2000);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err.substr(0, 2000);
    EXPECT_LE(r.err.size(), max_chars) << "too long: " << r.err.substr(0, 2000);
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err.substr(0, 2000);
}

std::map<std::pair<std::string, int64_t>, std::string> losses(const std::string& run_dir, int64_t after) {
    std::map<std::pair<std::string, int64_t>, std::string> out;
    std::istringstream in(read_text(run_dir + "/metrics.jsonl"));
    std::string line;
    while (std::getline(in, line)) {
        Json j = Json::parse(line);
        const int64_t step = j["step"].get<int64_t>();
        for (const char* key : {"loss", "eval_loss"})
            if (j.contains(key) && step > after) out[{key, step}] = j[key].dump();
    }
    return out;
}

void expect_close_losses(const std::string& a, const std::string& b, int64_t after, int64_t upto) {
    const auto la = losses(a, after), lb = losses(b, after);
    ASSERT_EQ(la.size(), lb.size());
    for (const auto& [key, value] : la) {
        if (key.second > upto) continue;
        const double x = std::stod(value), y = std::stod(lb.at(key));
        EXPECT_NEAR(x, y, 1e-5 * std::abs(x)) << key.first << " at step " << key.second;
    }
}

std::vector<Json> jsonl(const std::string& path) {
    std::vector<Json> out;
    if (!std::filesystem::exists(path)) return out;
    std::string text = read_text(path);
    const size_t end = text.rfind('\n');  // a running job may be halfway through writing its last line
    text.resize(end == std::string::npos ? 0 : end + 1);
    std::istringstream in(text);
    std::string line;
    while (std::getline(in, line))
        if (!line.empty()) out.push_back(Json::parse(line));
    return out;
}

FaultEnv::FaultEnv(const std::string& fault) { ::setenv("TESSERA_FAULT", fault.c_str(), 1); }
FaultEnv::~FaultEnv() { ::unsetenv("TESSERA_FAULT"); }

}  // namespace tessera::test
