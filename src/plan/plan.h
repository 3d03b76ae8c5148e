// The planner (docs/plan.md, spec/scale.md §2–§8): for a model, a cluster and a workload, every layout the
// runtime can run (expert parallelism, FSDP or ZeRO-2, micro-batch, recompute), each rank's memory from the
// runtime's own buffer groups (plan/memory.h: byte-exact), and a step time from an analytical model: compute per op
// class at the device's measured fraction of peak (the busiest expert-parallel rank's expert GEMMs, from a routing
// histogram), the all-to-all and the FSDP gathers over the link level their group spans with what the overlap does
// not hide, ZeRO-2's gradient exchange, and the optimizer's memory traffic. Ranked by predicted step time among the
// layouts that fit.
#pragma once

#include <string>
#include <vector>

#include "plan/cluster.h"
#include "plan/memory.h"
#include "train/config.h"

namespace tessera::plan {

struct PlanOptions {
    int64_t ranks = 0;  // 0: the cluster's devices
    int threads = 0;    // OpenMP threads per rank for the workspace; 0: the cluster's (CPU), else 1
    // expert load: "uniform", "zipf:S" (the expert of popularity rank i gets ∝ 1/i^S, placed in a fixed scrambled
    // order), or a run's metrics.jsonl (the mean load of its last records, per layer)
    std::string routing = "uniform";
    // optimizer offload: "auto", for the layouts that do not fit with the moments in the arena; "all", every layout
    // both ways (to compare, or to validate it); "off"
    std::string offload = "auto";
    bool pipeline = true;  // search pipeline stages too (plan --no-pipeline: not)
    bool tensor = true;    // search tensor parallelism too (plan --no-tensor: not)
};

struct StepTime {
    double compute = 0;                 // seconds: every GEMM and kernel of the step on the busiest rank
    double expert_compute = 0;          // of which the routed experts'
    double a2a = 0, a2a_exposed = 0;    // the expert all-to-all, and what the chunked overlap leaves
    double fsdp = 0, fsdp_exposed = 0;  // FSDP's gathers and reduce-scatters, and what prefetch leaves
    double grad_sync = 0;  // after backward: ZeRO-2's reduce-scatter and all-gather, or HSDP's replica all-reduce
    double optimizer = 0;  // AdamW over this rank's ranges (memory bound)
    double offload = 0;    // optimizer offload: the moments streamed from and back to their file
    double page_in = 0;    // the weight budget: the released base read back from storage (costs.h: page_in_seconds)
    double gradients = 0;  // clearing the gradients per micro-batch and summing them (memory bound)
    // pipeline stages: the activations' exchanges with the neighbour stages (not overlapped), and what the pipeline
    // fill and drain add to the slowest stage's work
    double p2p = 0, bubble = 0;
    double tensor = 0;  // tensor parallelism's gathers and reduce-scatters around the attention blocks (blocking)
    double total = 0;
    double imbalance = 1;  // busiest rank's routed tokens over the mean
};

struct Candidate {
    Layout layout;
    RankMemory memory;                                     // the rank with the largest arena
    int memory_rank = 0;                                   // which rank that is
    std::vector<std::pair<int, size_t>> rank_arena_bytes;  // every rank predicted (the first and the last)
    bool fits = false;                                     // arena ≤ usable device memory
    StepTime time;
    double tokens_per_s_per_device = 0, mfu = 0;
};

struct Plan {
    std::vector<Candidate> candidates;  // fitting ones by step time, then the rest by memory
    double usable_bytes = 0;            // per device
    double params = 0, active_params = 0, train_flops_per_token = 0;
    int64_t tokens_per_step = 0;
    std::string routing;
};

// The ranks a plan is for (`ranks`, or every device of the cluster when 0); one-line error when the cluster has fewer
// devices or the batch does not split over them.
int64_t plan_ranks(const train::RunConfig& cfg, const Cluster& cluster, int64_t ranks);
Plan make_plan(const train::RunConfig& cfg, const Cluster& cluster, const PlanOptions& o);
// Predicted step time of one layout (the memory is predict_rank_memory's).
StepTime predict_step(const train::RunConfig& cfg, const Cluster& cluster, const Layout& l, const PlanOptions& o);

// The predicted step of one layout as a Chrome trace (tessera simulate; Perfetto reads it): the busiest rank's blocks
// on a compute track (per micro-batch: forward, then per block in reverse its recomputed forward and backward; then the
// optimizer) and its transfers on a communication track (each MoE layer's all-to-all; FSDP's transfers unit by unit
// as train/fsdp.h makes them: the next visit's gather issued as a visit starts unless its unit is still in its slot,
// each unit's reduce-scatter after its last backward visit; HSDP's replica all-reduce or ZeRO-2's exchange after the
// last micro-batch), a unit's compute waiting for its gather. With pipeline stages, one such process per stage, each
// walking its 1F1B schedule (train/pipeline.h: one_f_one_b; with parallel.pipeline_rerun a stage before the last
// re-runs a micro-batch's forward before its backward), with a third track of exchanges with the neighbour stages: each
// starts when both sides reach it (blocking, pairwise), the earlier side waiting (a "bubble" span). The same rates and
// bytes as predict_step, events in time.
struct Simulation {
    std::string trace;   // Chrome trace JSON
    double seconds = 0;  // the step's end
};
Simulation simulate(const train::RunConfig& cfg, const Cluster& cluster, const Layout& l, const PlanOptions& o);

// The ranked table (top `rows` rows) and, when nothing fits, what would: more devices, optimizer offload.
std::string plan_report(const Plan& p, const Cluster& cluster, size_t rows);

}  // namespace tessera::plan
