// tessera launch -n W [--threads-per-rank T] -- COMMAND...: runs `tessera COMMAND...` as W MPI ranks on this
// machine through OpenMPI's mpirun, with the defaults one machine needs: no core binding (each rank runs
// T OpenMP threads), T = cores / W unless given, --oversubscribe when W·T exceeds the cores, and
// --allow-run-as-root when run as root (containers). On a cluster use mpirun or srun directly.
#include <unistd.h>

#include <cstdlib>
#include <thread>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/check.h"

namespace tessera::apps {

namespace {
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
}  // namespace

void add_launch_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("launch", "Run a tessera command as several MPI ranks on this machine (mpirun)");
    auto ranks = std::make_shared<int64_t>(2), threads = std::make_shared<int64_t>(0);
    auto rest = std::make_shared<std::vector<std::string>>();
    add_int_option(cmd, "-n,--ranks", *ranks, 1, 4096, "Number of ranks (processes)");
    add_int_option(cmd, "--threads-per-rank", *threads, 0, 4096, "OpenMP threads per rank (0 = cores / ranks)");
    cmd->add_option("command", *rest, "The tessera command and its arguments, after --")->required();
    cmd->footer("Example: tessera launch -n 2 -- train --set parallel.ep=2");
    cmd->callback([ranks, threads, rest] {
        const int64_t cores = std::max<int64_t>(1, std::thread::hardware_concurrency());
        const int64_t t = *threads > 0 ? *threads : std::max<int64_t>(1, cores / *ranks);
        std::vector<std::string> args = {mpirun_path(),
                                         "-n",
                                         std::to_string(*ranks),
                                         "--bind-to",
                                         "none",
                                         "-x",
                                         "OMP_NUM_THREADS=" + std::to_string(t)};
        if (*ranks * t > cores) args.push_back("--oversubscribe");
        if (::geteuid() == 0) args.push_back("--allow-run-as-root");
        args.push_back(self_path());
        args.insert(args.end(), rest->begin(), rest->end());
        std::vector<char*> argv;
        for (auto& a : args) argv.push_back(a.data());
        argv.push_back(nullptr);
        std::fflush(stdout);
        ::execvp(argv[0], argv.data());
        TESSERA_FAIL("launch: cannot run {} (install openmpi-bin, or set TESSERA_MPIRUN)", args[0]);
    });
}

}  // namespace tessera::apps
