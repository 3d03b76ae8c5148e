// The training loop: data -> forward/backward (with gradient accumulation) -> clip -> AdamW ->
// schedule; periodic evaluation on the held-out split, checkpoints every K steps and at the end,
// JSONL metrics and a progress line. Resuming from a checkpoint reproduces the uninterrupted run's
// losses bit for bit (same data order, same deterministic kernels, same optimizer state).
#pragma once

#include <atomic>
#include <functional>
#include <memory>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <vector>

#include "model/runtime.h"
#include "parallel/comm.h"
#include "train/config.h"
#include "train/fsdp.h"
#include "train/grad_sum.h"
#include "train/optimizer.h"
#include "train/telemetry.h"

namespace tessera::train {

class PipelineStep;
class WeightCopies;

struct TrainOptions {
    std::string config_path;             // empty: the built-in demo config
    std::vector<std::string> overrides;  // "section.key=value"
    std::optional<int64_t> steps;        // overrides train.steps
    std::string out_dir;                 // checkpoints, metrics.jsonl, config.json
    std::string resume_dir;              // a run directory or checkpoint to continue from
    std::ostream* log = nullptr;         // progress and notes; null = silent
    std::ostream* alert_log = nullptr;   // a line per alert (stderr); null = only alerts.jsonl
    std::optional<int> metrics_port;     // --metrics-port (over monitor.metrics_port; 0 = any free port)
    // --trace-steps A:B: a Chrome trace of steps A..B (1-based, inclusive) into RUN/trace.json (docs/operations.md)
    std::optional<std::pair<int64_t, int64_t>> trace_steps;
    bool log_is_tty = false;
    const std::atomic<bool>* stop = nullptr;  // set (e.g. by SIGINT): checkpoint and return early
    // The data group (null: one process). Rank 0 logs, writes metrics and the shared checkpoint files; every
    // rank must pass the same options.
    parallel::Comm* comm = nullptr;
};

struct StepResult {
    double loss = 0;       // mean over the step's micro-batches (of every rank)
    double grad_norm = 0;  // before clipping
    double lr = 0;
    // The step's layer statistics (Model::take_step_stats), and views of them that live as long as it:
    // a result kept past the next step keeps its own statistics (the model then fills a new object).
    std::shared_ptr<const model::StepStats> stats;
    std::span<const std::pair<int64_t, model::MoeLayerStats>> moe;  // per MoE layer: routing of this step
    std::span<const std::pair<int64_t, model::DsaLayerStats>> dsa;  // per DSA layer: the indexer KL of this step
    double global_aux_loss = 0.0;  // model.moe.global_aux_coeff: the pooled balance loss (mean over micro-batches)
    bool skipped = false;          // the loss or gradient norm was not finite: no update (StepOptions::skip_nonfinite)
    StepPhases phases;             // where this rank's time went (data, optimizer, communication waits; step: unset)
};

struct StepOptions {
    bool skip_nonfinite = false;  // a non-finite loss or gradient skips the update (else: a one-line error)
    bool poison = false;          // test fault: the gradient norm is NaN (TESSERA_FAULT=nan:STEP)
    // parallel.pipeline: this rank's stage runs the micro-batches in the 1F1B schedule (comm is then the stage's
    // data-parallel group)
    PipelineStep* pipeline = nullptr;
    // parallel.tensor: comm's ranks in groups of this many consecutive ones take the same micro-batches (tensor
    // parallelism; each reports the micro-batch's loss, counted once per group)
    int tensor = 1;
    // memory.weight_copies: refreshed after the update (null: none)
    const WeightCopies* copies = nullptr;
};

// Fills a micro-batch's ids and targets and returns its step shape (with document boundaries when
// they are kept apart).
using BatchSource = std::function<model::StepShape(std::span<int32_t> ids, std::span<int32_t> targets)>;

// One optimizer step (0-based `step` for the schedule): forward/backward over grads.accumulation()
// micro-batches from next_batch, their gradient summed over micro-batches and ranks (GradientSum), clip by
// the global norm, AdamW on this rank's range and the ranges shared, then the MoE selection biases move by
// their balancing rule from the routing counts of every rank. fsdp: the model's dense parameters are sharded
// (train/fsdp.h; its hooks set on the model, rt holding its placement). The model must be bound to rt. After the first
// step it makes no heap allocation in tessera's code when the previous result has been dropped (one
// process; tests/model/test_no_alloc.cpp).
// step_targets: the targets that count in the whole step (every micro-batch of every rank; DataLoader::
// step_targets): the loss is then their mean (a micro-batch weighs by its count: supervised data, where prompt
// tokens do not count); 0: the mean over micro-batches of each one's mean (packed data, where all count).
StepResult train_step(model::Model& model,
                      model::ModelRuntime& rt,
                      AdamW& opt,
                      GradientSum& grads,
                      const TrainConfig& tc,
                      int64_t step,
                      const BatchSource& next_batch,
                      std::span<int32_t> ids,
                      std::span<int32_t> targets,
                      parallel::Comm* comm = nullptr,
                      Fsdp* fsdp = nullptr,
                      int64_t step_targets = 0,
                      StepOptions options = {});

// This rank's ranges of the parameters (the optimizer's), from the runtime's group or, with FSDP, its shard.
ParamRanges param_ranges(const AdamW& opt, model::ModelRuntime& rt, Fsdp* fsdp);

struct TrainSummary {
    int64_t first_step = 0;  // steps run by this call: [first_step, last_step)
    int64_t last_step = 0;
    std::vector<double> losses;       // training loss of each step run
    std::optional<double> eval_loss;  // last evaluation (nats per token)
    std::string checkpoint;           // the last checkpoint written
    model::MemoryReport memory;
    bool stopped_early = false;
    bool stopped_by_alert = false;  // an alert rule's action was stop (alerts.jsonl says which)
};

TrainSummary train(const TrainOptions& opts);

}  // namespace tessera::train
