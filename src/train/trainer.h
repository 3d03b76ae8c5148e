// The training loop: data -> forward/backward (with gradient accumulation) -> clip -> AdamW ->
// schedule; periodic evaluation on the held-out split, checkpoints every K steps and at the end,
// JSONL metrics and a progress line. Resuming from a checkpoint reproduces the uninterrupted run's
// losses bit for bit (same data order, same deterministic kernels, same optimizer state).
#pragma once

#include <atomic>
#include <optional>
#include <ostream>
#include <string>
#include <vector>

#include "model/runtime.h"
#include "train/config.h"

namespace tessera::train {

struct TrainOptions {
    std::string config_path;             // empty: the built-in demo config
    std::vector<std::string> overrides;  // "section.key=value"
    std::optional<int64_t> steps;        // overrides train.steps
    std::string out_dir;                 // checkpoints, metrics.jsonl, config.json
    std::string resume_dir;              // a run directory or checkpoint to continue from
    std::ostream* log = nullptr;         // progress and notes; null = silent
    bool log_is_tty = false;
    const std::atomic<bool>* stop = nullptr;  // set (e.g. by SIGINT): checkpoint and return early
};

struct TrainSummary {
    int64_t first_step = 0;          // steps run by this call: [first_step, last_step)
    int64_t last_step = 0;
    std::vector<double> losses;      // training loss of each step run
    std::optional<double> eval_loss; // last evaluation (nats per token)
    std::string checkpoint;          // the last checkpoint written
    model::MemoryReport memory;
    bool stopped_early = false;
};

TrainSummary train(const TrainOptions& opts);

}  // namespace tessera::train
