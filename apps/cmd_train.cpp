// tessera train: the training loop (src/train/trainer.h) behind a CLI, with Ctrl-C handling:
// the first interrupt finishes the step, writes a checkpoint and exits; a second one exits at once.
#include <unistd.h>

#include <atomic>
#include <csignal>
#include <iostream>

#include "apps/commands.h"
#include "train/trainer.h"

namespace tessera::apps {

namespace {
std::atomic<bool> g_stop{false};

void on_sigint(int) {
    if (g_stop.exchange(true)) _exit(130);
}
}  // namespace

void add_train_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("train", "Train a model (the built-in demo config without --config)");
    auto opts = std::make_shared<train::TrainOptions>();
    auto steps = std::make_shared<int64_t>(0);
    cmd->add_option("--config", opts->config_path, "Run config (JSON: model, train, data; see docs/config.md)");
    auto* steps_opt = cmd->add_option("--steps", *steps, "Total optimizer steps (overrides train.steps)")
                          ->check(CLI::NonNegativeNumber);
    cmd->add_option("--out", opts->out_dir, "Run directory for checkpoints and metrics.jsonl (default: runs/<time>)");
    cmd->add_option("--resume", opts->resume_dir, "Continue from the latest checkpoint in this run directory");
    cmd->add_option("--set", opts->overrides, "Override a config value: section.key=value (repeatable)");
    cmd->callback([opts, steps, steps_opt] {
        if (steps_opt->count() > 0) opts->steps = *steps;
        opts->log = &std::cout;
        opts->log_is_tty = isatty(STDOUT_FILENO);
        opts->stop = &g_stop;
        std::signal(SIGINT, on_sigint);
        train::TrainSummary s = train::train(*opts);
        std::cout << s.memory.str() << '\n';
        if (s.eval_loss) {
            std::cout << fmt::format("final eval loss {:.4f} nats/token ({:.3f} bits per byte)\n", *s.eval_loss,
                                     *s.eval_loss / 0.6931471805599453);
        }
        std::cout << "last checkpoint: " << s.checkpoint << '\n';
        if (s.stopped_early) throw CLI::RuntimeError(130);
    });
}

}  // namespace tessera::apps
