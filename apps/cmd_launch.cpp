// tessera launch -n W [--threads-per-rank T] [--max-restarts K] -- COMMAND...: runs `tessera COMMAND...` as W MPI
// ranks on this machine through OpenMPI's mpirun, with the defaults one machine needs: no core binding (each rank
// runs T OpenMP threads), T = cores / W unless given, --oversubscribe when W·T exceeds the cores, and
// --allow-run-as-root when run as root (containers). On a cluster use mpirun or srun directly.
//
// With --max-restarts K it supervises a `train --out DIR` job (docs/operations.md): when the job ends with a
// failure after training at least one step (a rank killed, a watchdog that fired: mpirun then ends every rank),
// it waits (backoff 1, 2, 4, ... s, at most 30), then runs the job again from DIR's last complete checkpoint
// (`--resume DIR`, on --restart-ranks ranks if given), at most K times, each restart a line on stderr and in
// DIR/events.jsonl, and an alert in DIR/alerts.jsonl (rule lost_rank: a rank killed or ended by the watchdog;
// job_failed otherwise; action restart). Exit statuses that are decisions are not retried: 0, 2 (usage), 3 (an alert
// stopped the run), 130 and 143 (SIGINT, SIGTERM: forwarded to the job).
#include <sys/prctl.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <fstream>
#include <iostream>
#include <thread>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/check.h"
#include "core/json.h"
#include "train/alerts.h"
#include "train/checkpoint.h"

namespace tessera::apps {

namespace {
namespace fs = std::filesystem;

std::string mpirun_path() {
    if (const char* p = std::getenv("TESSERA_MPIRUN"); p && *p) return p;
    for (const char* dir : {"/usr/bin", "/usr/local/bin"}) {
        const std::string p = std::string(dir) + "/mpirun";
        if (::access(p.c_str(), X_OK) == 0) return p;
    }
    return "mpirun";  // from PATH
}

std::string self_path() {
    char buf[4096];
    const ssize_t n = ::readlink("/proc/self/exe", buf, sizeof buf - 1);
    TESSERA_CHECK(n > 0, "launch: cannot find the tessera binary (/proc/self/exe)");
    return std::string(buf, size_t(n));
}

std::vector<std::string> mpirun_args(int64_t ranks, int64_t threads, const std::vector<std::string>& command) {
    const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
    const int64_t t = threads > 0 ? threads : std::max<int64_t>(1, cores / ranks);
    std::vector<std::string> args = {
        mpirun_path(), "-n", std::to_string(ranks), "--bind-to", "none", "-x", "OMP_NUM_THREADS=" + std::to_string(t)};
    if (ranks * t > cores) args.push_back("--oversubscribe");
    if (::geteuid() == 0) args.push_back("--allow-run-as-root");
    args.push_back(self_path());
    args.insert(args.end(), command.begin(), command.end());
    return args;
}

[[noreturn]] void exec(std::vector<std::string> args) {
    std::vector<char*> argv;
    for (auto& a : args) argv.push_back(a.data());
    argv.push_back(nullptr);
    ::execvp(argv[0], argv.data());
    std::fprintf(stderr, "error: launch: cannot run %s (install openmpi-bin, or set TESSERA_MPIRUN)\n",
                 args[0].c_str());
    _exit(127);
}

// The value of a train option (--out DIR or --out=DIR), or "".
std::string option_value(const std::vector<std::string>& cmd, const std::string& name) {
    for (size_t i = 0; i < cmd.size(); ++i) {
        if (cmd[i] == name && i + 1 < cmd.size()) return cmd[i + 1];
        if (cmd[i].starts_with(name + "=")) return cmd[i].substr(name.size() + 1);
    }
    return "";
}

// The command that continues the run in dir: --config dropped (a resumed run takes its checkpoint's), --resume dir.
std::vector<std::string> resume_command(const std::vector<std::string>& cmd, const std::string& dir) {
    std::vector<std::string> out;
    for (size_t i = 0; i < cmd.size(); ++i) {
        if (cmd[i] == "--config" || cmd[i] == "--resume") {
            ++i;
            continue;
        }
        if (cmd[i].starts_with("--config=") || cmd[i].starts_with("--resume=")) continue;
        out.push_back(cmd[i]);
    }
    out.insert(out.end(), {"--resume", dir});
    return out;
}

std::atomic<int> g_child{-1};
std::atomic<int> g_forwarded{0};
void forward_signal(int sig) {
    g_forwarded.store(sig);
    if (const int pid = g_child.load(); pid > 0) ::kill(pid, sig);
}

double unix_time() {
    return std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count();
}

// Runs the job once; its exit status (128 + signal when killed).
int run_once(const std::vector<std::string>& args, int64_t restarts) {
    std::fflush(stdout);
    std::fflush(stderr);
    const pid_t pid = ::fork();
    TESSERA_CHECK(pid >= 0, "launch: fork failed");
    if (pid == 0) {
        ::setenv("TESSERA_RESTARTS", std::to_string(restarts).c_str(), 1);
        exec(args);
    }
    g_child.store(pid);
    int status = 0;
    while (::waitpid(pid, &status, 0) < 0 && errno == EINTR) {
    }
    g_child.store(-1);
    return WIFEXITED(status) ? WEXITSTATUS(status) : 128 + WTERMSIG(status);
}

// After the job: every rank it left behind (mpirun may exit before a rank it killed is gone; this process is their
// subreaper) is reaped, those still alive after 10 s killed, so that no rank of the old job writes while the new
// one starts (a dead writer's temporary files are removed by the restarted job only when their writer is gone).
void reap_leftovers() {
    const auto deadline = std::chrono::steady_clock::now() + std::chrono::seconds(10);
    for (;;) {
        const pid_t r = ::waitpid(-1, nullptr, WNOHANG);
        if (r > 0) continue;
        if (r < 0 && errno == ECHILD) return;
        if (std::chrono::steady_clock::now() > deadline) {
            for (const auto& e : fs::directory_iterator("/proc")) {  // children left: processes whose parent is this
                std::ifstream stat(e.path() / "stat");
                std::string pid, comm, state;
                pid_t ppid = 0;
                if (stat >> pid >> comm >> state >> ppid && ppid == ::getpid()) ::kill(std::stoi(pid), SIGKILL);
            }
        }
        std::this_thread::sleep_for(std::chrono::milliseconds(20));
    }
}

void supervise(int64_t ranks,
               int64_t threads,
               int64_t max_restarts,
               int64_t restart_ranks,
               const std::vector<std::string>& command) {
    TESSERA_CHECK(!command.empty() && command[0] == "train",
                  "launch --max-restarts supervises a train job: the command must be train ... --out DIR");
    std::string dir = option_value(command, "--out");
    if (dir.empty()) dir = option_value(command, "--resume");
    TESSERA_CHECK(!dir.empty(), "launch --max-restarts needs train --out DIR: the run directory it restarts from");
    struct sigaction sa {};
    sa.sa_handler = forward_signal;
    sigemptyset(&sa.sa_mask);
    ::sigaction(SIGINT, &sa, nullptr);
    ::sigaction(SIGTERM, &sa, nullptr);
    ::prctl(PR_SET_CHILD_SUBREAPER, 1);  // the job's orphaned ranks become this process's children
    int64_t restarts = 0;
    std::vector<std::string> cmd = command;
    for (;;) {
        const auto started = fs::file_time_type::clock::now();
        const int status =
            run_once(mpirun_args(restarts > 0 && restart_ranks > 0 ? restart_ranks : ranks, threads, cmd), restarts);
        reap_leftovers();
        const double ended = unix_time();
        if (status == 0 || status == 2 || status == 3 || status == 130 || status == 143 || g_forwarded.load()) {
            std::exit(status);
        }
        std::error_code ec;
        const fs::path metrics = fs::path(dir) / "metrics.jsonl";
        const bool trained = fs::exists(metrics, ec) && fs::last_write_time(metrics, ec) > started;
        if (!trained) {
            std::cerr << fmt::format(
                "tessera launch: the job ended with status {} before training a step: not "
                "restarting (the same error would come back)\n",
                status);
            std::exit(status);
        }
        if (restarts >= max_restarts) {
            std::cerr << fmt::format("tessera launch: the job ended with status {}; {} restart{} used, giving up\n",
                                     status, restarts, restarts == 1 ? "" : "s");
            std::exit(status);
        }
        ++restarts;
        const double backoff = std::min(30.0, double(int64_t(1) << std::min<int64_t>(restarts - 1, 5)));
        const bool resume = train::holds_checkpoint(dir);
        const int64_t next_ranks = restart_ranks > 0 ? restart_ranks : ranks;
        const std::string line =
            fmt::format("tessera launch: the job ended with status {}; restart {}/{} in {:.0f} s on {} rank{} from {}",
                        status, restarts, max_restarts, backoff, next_ranks, next_ranks == 1 ? "" : "s",
                        resume ? "the last checkpoint of " + dir : "the start (no checkpoint yet)");
        // the lost rank as an alert of the run (alerts.jsonl, the dashboard, stderr)
        train::AlertSink((fs::path(dir) / "alerts.jsonl").string(), &std::cerr, "")
            .fire({.rule = status >= 128 || status == 124 ? "lost_rank" : "job_failed",
                   .action = train::AlertAction::restart,
                   .value = double(status),
                   .message = fmt::format("the job ended with status {}{}; restart {}/{} from {}", status,
                                          status > 128    ? fmt::format(" (a rank killed by signal {})", status - 128)
                                          : status == 124 ? std::string(" (the watchdog ended a rank)")
                                                          : std::string(),
                                          restarts, max_restarts, resume ? "the last checkpoint" : "the start")},
                  /*echo=*/false);
        std::cerr << line << std::endl;
        {
            std::ofstream ev(fs::path(dir) / "events.jsonl", std::ios::app);
            ev << Json{{"event", "restart"},
                       {"time", ended},
                       {"status", status},
                       {"restart", restarts},
                       {"max_restarts", max_restarts},
                       {"ranks", next_ranks},
                       {"backoff_seconds", backoff},
                       {"from_checkpoint", resume}}
                      .dump()
               << '\n';
        }
        std::this_thread::sleep_for(std::chrono::duration<double>(backoff));
        if (g_forwarded.load()) std::exit(128 + g_forwarded.load());
        cmd = resume ? resume_command(command, dir) : command;
    }
}
}  // namespace

void add_launch_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("launch", "Run a tessera command as several MPI ranks on this machine (mpirun)");
    auto ranks = std::make_shared<int64_t>(2), threads = std::make_shared<int64_t>(0);
    auto restarts = std::make_shared<int64_t>(0), restart_ranks = std::make_shared<int64_t>(0);
    auto rest = std::make_shared<std::vector<std::string>>();
    add_int_option(cmd, "-n,--ranks", *ranks, 1, 4096, "Number of ranks (processes)");
    add_int_option(cmd, "--threads-per-rank", *threads, 0, 4096, "OpenMP threads per rank (0 = cores / ranks)");
    add_int_option(cmd, "--max-restarts", *restarts, 0, 1000,
                   "Supervise a train job: restart it from its last checkpoint when it fails, at most this often");
    add_int_option(cmd, "--restart-ranks", *restart_ranks, 0, 4096,
                   "Ranks of the restarted jobs (0 = as many as the first; checkpoints reshard)");
    cmd->add_option("command", *rest, "The tessera command and its arguments, after --")->required();
    cmd->footer(
        "Example: tessera launch -n 2 -- train --set parallel.ep=2\n"
        "         tessera launch -n 4 --max-restarts 3 -- train --out runs/a --set monitor.watchdog_seconds=60");
    cmd->callback([ranks, threads, restarts, restart_ranks, rest] {
        if (*restarts == 0) exec(mpirun_args(*ranks, *threads, *rest));
        supervise(*ranks, *threads, *restarts, *restart_ranks, *rest);
    });
}

}  // namespace tessera::apps
