// tessera train: the training loop (src/train/trainer.h) behind a CLI, with SIGINT (Ctrl-C) and SIGTERM (what
// Slurm, Kubernetes and container platforms send before stopping a job) handled alike: the first one finishes
// the step, writes a checkpoint, says so on stderr and exits 130 (SIGINT) or 143 (SIGTERM); a second one exits
// at once with the same status.
#include <pthread.h>
#include <unistd.h>

#include <omp.h>

#include <atomic>
#include <csignal>
#include <cstdlib>
#include <filesystem>
#include <iostream>
#include <thread>

#include "apps/commands.h"
#include "apps/options.h"
#include "parallel/comm_mpi.h"
#include "train/trainer.h"

namespace tessera::apps {

namespace {
std::atomic<bool> g_stop{false};
std::atomic<int> g_signal{0};

void on_stop_signal(int sig) {
    int first = 0;
    if (!g_signal.compare_exchange_strong(first, sig)) _exit(128 + sig);  // the second signal: at once
    g_stop.store(true);
}

// NOTES: SIGINT and SIGTERM are blocked in this thread before any other starts (OpenMP's, MPI's: they inherit
// the mask) and taken by a thread of their own with sigwait, so a signal never interrupts a compute thread.
// Delivered to a thread inside a oneDNN GEMM, the signal frame corrupted the heap in a few percent of runs
// (tests/e2e/test_signals.cpp under ctest: "corrupted size vs. prev_size", a 64-byte vector store of
// gradient values over a malloc header; 3 of 40 runs before, none of 100 after).
void install_stop_handlers() {
    sigset_t set;
    sigemptyset(&set);
    sigaddset(&set, SIGINT);
    sigaddset(&set, SIGTERM);
    pthread_sigmask(SIG_BLOCK, &set, nullptr);
    std::thread([set] {
        for (;;) {
            int sig = 0;
            if (sigwait(&set, &sig) == 0) on_stop_signal(sig);
        }
    }).detach();
}
}  // namespace

void add_train_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("train", "Train a model (the built-in demo config without --config)");
    auto opts = std::make_shared<train::TrainOptions>();
    auto steps = std::make_shared<int64_t>(0);
    cmd->add_option("--config", opts->config_path, "Run config (JSON: model, train, data; see docs/config.md)");
    auto* steps_opt =
        add_int_option(cmd, "--steps", *steps, 0, train::kMaxSteps, "Total optimizer steps (overrides train.steps)");
    cmd->add_option("--out", opts->out_dir, "Run directory for checkpoints and metrics.jsonl (default: runs/<time>)");
    cmd->add_option("--resume", opts->resume_dir, "Continue from the latest checkpoint in this run directory");
    cmd->add_option("--set", opts->overrides, "Override a config value: section.key=value (repeatable)");
    auto port = std::make_shared<int64_t>(0);
    auto* port_opt = add_int_option(cmd, "--metrics-port", *port, 0, 65535,
                                    "Serve Prometheus /metrics and the live dashboard (/) on this port of rank 0 "
                                    "(0 = any free port; overrides monitor.metrics_port)");
    cmd->footer(
        "SIGINT (Ctrl-C) or SIGTERM: the step finishes, a checkpoint is written, and train exits 130 or 143; "
        "continue with --resume.\nSeveral processes: mpirun -n W tessera train ... (or srun): the W ranks share "
        "train.batch_size and shard the optimizer state (docs/parallel.md).\nAlerts (monitor.alerts, "
        "docs/operations.md) "
        "go to alerts.jsonl and stderr; an alert whose action is stop ends the run with status 3.");
    auto trace = std::make_shared<std::string>();
    cmd->add_option("--trace-steps", *trace,
                    "Write a Chrome trace (Perfetto) of steps A to B into RUN/trace.json, e.g. 5:7");
    cmd->callback([opts, steps, steps_opt, port, port_opt, trace] {
        if (steps_opt->count() > 0) opts->steps = *steps;
        if (!trace->empty()) opts->trace_steps = parse_step_range(*trace, "--trace-steps");
        if (port_opt->count() > 0) opts->metrics_port = int(*port);
        install_stop_handlers();  // first: every thread started later inherits the blocked signals
        // under mpirun / srun: one rank per process; the ranks on this host share its cores
        std::unique_ptr<parallel::MpiRuntime> mpi;
        std::unique_ptr<parallel::Comm> world;
        if (parallel::launched_by_mpi()) {
            mpi = std::make_unique<parallel::MpiRuntime>();
            world = mpi->world();
            opts->comm = world.get();
            const int share = std::max(1, int(std::thread::hardware_concurrency()) / parallel::local_ranks());
            if (!std::getenv("OMP_NUM_THREADS") && omp_get_max_threads() > share) omp_set_num_threads(share);
        }
        const bool lead = !world || world->rank() == 0;
        opts->log = lead ? &std::cout : nullptr;
        opts->log_is_tty = isatty(STDOUT_FILENO);
        opts->alert_log = lead ? &std::cerr : nullptr;
        opts->stop = &g_stop;
        train::TrainSummary s;
        try {
            s = train::train(*opts);
        } catch (const std::exception& e) {
            if (!world || world->size() == 1) throw;
            // the other ranks may wait in a collective this one will never join: end the job
            std::fprintf(stderr, "error: (rank %d) %s\n", world->rank(), e.what());
            std::fflush(stderr);
            mpi->abort(1);
        }
        if (lead) {
            std::cout << s.memory.str() << '\n';
            if (s.eval_loss) {
                std::cout << fmt::format("final eval loss {:.4f} nats/token ({:.3f} bits per byte)\n", *s.eval_loss,
                                         *s.eval_loss / 0.6931471805599453);
            }
            std::cout << "last checkpoint: " << s.checkpoint << '\n' << std::flush;
        }
        if (s.stopped_by_alert) {
            throw Stopped{3, lead
                                 ? fmt::format("tessera: stopped by an alert rule after step {} (see {}/alerts.jsonl), "
                                               "checkpoint {}",
                                               s.last_step,
                                               std::filesystem::path(s.checkpoint).parent_path().parent_path().string(),
                                               s.checkpoint)
                                 : ""};
        }
        if (s.stopped_early) {
            const int sig = g_signal.load();
            const std::string run = std::filesystem::path(s.checkpoint).parent_path().parent_path().string();
            throw Stopped{128 + sig,
                          lead ? fmt::format("tessera: stopped by {} after step {}, checkpoint {}; continue with "
                                             "--resume {}",
                                             sig == SIGTERM ? "SIGTERM" : "SIGINT", s.last_step, s.checkpoint, run)
                               : ""};
        }
    });
}

}  // namespace tessera::apps
