// Alert rules (docs/operations.md): evaluated on every step from what the metrics sink holds (train/telemetry.h),
// each firing one JSON line in the run's alerts.jsonl, one line on stderr, the dashboard's list and an optional
// webhook POST, and asking the trainer for its action (warn, checkpoint, stop; non-finite steps: skip or stop).
#pragma once

#include <chrono>
#include <condition_variable>
#include <cstdint>
#include <deque>
#include <fstream>
#include <mutex>
#include <optional>
#include <ostream>
#include <span>
#include <string>
#include <thread>
#include <vector>

#include "core/json.h"
#include "train/config.h"
#include "train/telemetry.h"

namespace tessera::train {

// restart: the supervisor's (tessera launch --max-restarts), never a rule's
enum class AlertAction { none = 0, warn = 1, skip = 2, checkpoint = 3, stop = 4, restart = 5 };
AlertAction alert_action(const std::string& name);

struct Alert {
    std::string rule;
    AlertAction action = AlertAction::warn;
    int64_t step = 0;
    double value = 0, threshold = 0;
    std::string message;  // one line
    Json to_json() const;
};

// The rules' state over the steps (histories, streaks). Pure: no I/O, the same inputs give the same alerts.
class AlertRules {
  public:
    explicit AlertRules(const MonitorConfig& cfg, double physical_memory_bytes);
    // The alerts of one step (r: this rank's report; ranks: every rank's share; overloads: per MoE layer).
    std::vector<Alert> evaluate(const StepReport& r, std::span<const RankSample> ranks);
    // The strongest action of a list (none when empty).
    static AlertAction strongest(std::span<const Alert> alerts);

  private:
    // one streak per rule: consecutive steps past the bound; fires when it reaches the rule's steps
    bool streak(int64_t& count, bool past, const AlertRule& rule);
    MonitorConfig cfg_;
    double memory_bytes_;
    std::deque<double> losses_, rates_;
    int64_t nonfinite_ = 0, overload_ = 0, straggler_ = 0, memory_ = 0, throughput_ = 0;
};

// Where alerts go: alerts.jsonl (appended; a line per alert, flushed), stderr, and the webhook (a worker
// thread POSTs them in order, a failed POST a line on stderr; the step loop never waits for it).
class AlertSink {
  public:
    AlertSink(const std::string& jsonl_path, std::ostream* err, std::string webhook);
    ~AlertSink();
    AlertSink(const AlertSink&) = delete;
    void fire(const Alert& a, bool echo = true);  // echo: also the line on stderr

  private:
    void post_loop();
    std::ofstream out_;
    std::ostream* err_;
    std::string webhook_;
    std::mutex mu_;
    std::condition_variable cv_;
    std::deque<std::string> queue_;
    bool done_ = false;
    std::thread poster_;
};

// Splits "http://host:port/path" (one-line error otherwise).
struct HttpUrl {
    std::string host;
    int port = 80;
    std::string path = "/";
};
HttpUrl parse_http_url(const std::string& url);

// The watchdog: a thread that ends the process when no step finishes in `seconds` (a collective that never
// completes, a rank lost without its process ending): one line on stderr, an alert line (when `alerts` is set),
// then _exit(124), which makes mpirun end the job and tessera launch restart it. 0 seconds: no thread.
class Watchdog {
  public:
    Watchdog(double seconds, int rank, AlertSink* alerts);
    ~Watchdog();
    Watchdog(const Watchdog&) = delete;
    void beat(int64_t step);  // a step (or evaluation, checkpoint) finished; the first beat arms it

  private:
    void loop();
    double seconds_;
    int rank_;
    AlertSink* alerts_;
    std::mutex mu_;
    std::condition_variable cv_;
    bool done_ = false, paused_ = true;
    int64_t step_ = 0;
    std::chrono::steady_clock::time_point last_;
    std::thread thread_;
};

}  // namespace tessera::train
