// The one metrics sink of a training run (docs/operations.md). The trainer reports each step once, as a
// StepReport; the sink turns it into the JSONL record, the progress line's summary, the Prometheus series
// (rank 0 holding every rank's share) and the inputs of the alert rules (train/alerts.h).
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <optional>
#include <span>
#include <string>
#include <vector>

#include "core/json.h"
#include "model/model.h"
#include "parallel/comm.h"
#include "train/fsdp.h"
#include "train/weight_budget.h"

namespace tessera::train {

// Where one rank's step went (seconds): loading batches, the optimizer (clip, AdamW, sharing the updated
// weights), communication compute waited for (FSDP gathers, expert all-to-all), and compute: the rest.
struct StepPhases {
    double step = 0, data = 0, optimizer = 0, communication = 0;
    double compute() const;
};

// One rank's share of a step, gathered to every rank (a fixed array: one all-gather of W·8 doubles a step).
struct RankSample {
    enum Field { kStep, kData, kOptimizer, kCommunication, kArenaInUse, kArenaPeak, kFragmentation, kRss, kFields };
    std::array<double, kFields> v{};
};

// What one optimizer step measured on this rank.
struct StepReport {
    int64_t step = 0;  // 1-based: the step just finished
    double loss = 0, lr = 0, grad_norm = 0;
    bool skipped = false;  // the loss or gradient was not finite: the update was not applied
    int64_t tokens = 0;    // tokens of the whole step (every rank)
    StepPhases phases;
    double flops_per_s = 0, mfu = 0;
    const model::StepStats* layers = nullptr;  // MoE routing and DSA indexer KL per layer
    std::optional<double> global_aux_loss;
    std::optional<FsdpStats> fsdp;  // this step's gathers and reductions
    std::optional<WeightBudgetStats> weights;
    std::optional<size_t> arena_peak_bytes;  // the first step of a run: the arena's high-water mark
    const ArenaStats* arena = nullptr;       // this rank's arena after the step
    double monitor_seconds = 0;              // what the previous step's metrics, logs and alert rules took
};

// Prometheus text exposition (version 0.0.4): metric families with their type and help, series by label set.
class PrometheusRegistry {
  public:
    using Labels = std::vector<std::pair<std::string, std::string>>;
    void gauge(const std::string& name, const std::string& help, double v, const Labels& labels = {});
    void counter_add(const std::string& name, const std::string& help, double delta, const Labels& labels = {});
    // A cumulative histogram: one observation per value, into buckets with these upper bounds (+Inf added).
    void histogram_observe(const std::string& name,
                           const std::string& help,
                           std::span<const double> bounds,
                           std::span<const double> values,
                           const Labels& labels = {});
    std::string text() const;

  private:
    struct Family {
        std::string type, help;
        std::map<std::string, double> series;                   // rendered label set ("" or {a="b"}) -> value
        std::vector<double> bounds;                             // histograms: bucket upper bounds
        std::map<std::string, std::vector<double>> histograms;  // label set -> buckets, sum, count
    };
    Family& family(const std::string& name, const char* type, const std::string& help);
    std::map<std::string, Family> families_;
};

class Telemetry {
  public:
    // comm: the data group (null: one process). step() is then a collective: every rank calls it.
    explicit Telemetry(parallel::Comm* comm);

    // The step's JSONL record (what metrics.jsonl holds), and the Prometheus series updated.
    Json step(const StepReport& r);
    void eval(int64_t step, double loss);
    void checkpoint(int64_t step, double seconds);  // completed, `seconds` after it began
    void checkpoint_blocked(double seconds);        // how long the step loop waited for it (its copy)
    void alert(const std::string& rule);
    void restarts(int64_t n);  // the supervisor's count of restarts before this process (tessera launch)

    // The progress line's share of the last step: experts' worst overload and dead ones, the indexer KL.
    const std::string& summary() const { return summary_; }
    // Every rank's share of the last step, by rank.
    std::span<const RankSample> ranks() const { return ranks_; }
    // The Prometheus text of everything reported so far (any thread).
    std::string prometheus() const;

  private:
    void publish();  // renders the text under the lock
    parallel::Comm* comm_;
    std::vector<RankSample> ranks_;
    PrometheusRegistry reg_;
    std::string summary_;
    mutable std::mutex mu_;
    std::string text_;
};

// This process's resident set (bytes), from /proc/self/statm; 0 where unknown.
size_t resident_bytes();
double physical_memory_bytes();  // the machine's (sysconf)
std::string host_name();         // gethostname, for the URLs the trainer prints

}  // namespace tessera::train
