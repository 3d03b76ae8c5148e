// Alert rules, where alerts go, and the watchdog (see alerts.h).
#include "train/alerts.h"

#include <httplib.h>
#include <unistd.h>

#include <algorithm>
#include <cmath>
#include <ctime>
#include <iostream>

#include "core/check.h"

namespace tessera::train {

AlertAction alert_action(const std::string& name) {
    if (name == "warn") return AlertAction::warn;
    if (name == "skip") return AlertAction::skip;
    if (name == "checkpoint") return AlertAction::checkpoint;
    if (name == "stop") return AlertAction::stop;
    TESSERA_FAIL("unknown alert action {}", name);
}

namespace {
const char* action_name(AlertAction a) {
    switch (a) {
        case AlertAction::none:
            return "none";
        case AlertAction::warn:
            return "warn";
        case AlertAction::skip:
            return "skip";
        case AlertAction::checkpoint:
            return "checkpoint";
        case AlertAction::stop:
            return "stop";
        case AlertAction::restart:
            return "restart";
    }
    return "?";
}

std::string utc_now() {
    const std::time_t t = std::time(nullptr);
    std::tm tm{};
    gmtime_r(&t, &tm);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y-%m-%dT%H:%M:%SZ", &tm);
    return buf;
}

double median(std::vector<double> v) {
    if (v.empty()) return 0;
    const size_t mid = v.size() / 2;
    std::nth_element(v.begin(), v.begin() + std::ptrdiff_t(mid), v.end());
    const double hi = v[mid];
    if (v.size() % 2) return hi;
    return 0.5 * (hi + *std::max_element(v.begin(), v.begin() + std::ptrdiff_t(mid)));
}

void push_window(std::deque<double>& h, double v, int64_t window) {
    h.push_back(v);
    while (int64_t(h.size()) > std::max<int64_t>(1, window)) h.pop_front();
}
}  // namespace

Json Alert::to_json() const {
    return {{"time", utc_now()}, {"step", step},           {"rule", rule},      {"action", action_name(action)},
            {"value", value},    {"threshold", threshold}, {"message", message}};
}

AlertRules::AlertRules(const MonitorConfig& cfg, double physical_memory_bytes)
    : cfg_(cfg), memory_bytes_(physical_memory_bytes) {}

bool AlertRules::streak(int64_t& count, bool past, const AlertRule& rule) {
    count = past ? count + 1 : 0;
    return count == rule.steps;  // once per streak
}

AlertAction AlertRules::strongest(std::span<const Alert> alerts) {
    AlertAction a = AlertAction::none;
    for (const Alert& x : alerts) a = std::max(a, x.action);
    return a;
}

std::vector<Alert> AlertRules::evaluate(const StepReport& r, std::span<const RankSample> ranks) {
    std::vector<Alert> out;
    auto fire = [&](const char* rule, const AlertRule& cfg, double value, double threshold, std::string msg) {
        out.push_back({rule, alert_action(cfg.action), r.step, value, threshold, std::move(msg)});
    };
    // non-finite loss or gradient: the step was skipped; `steps` in a row (or action stop) end the run
    if (r.skipped) {
        ++nonfinite_;
        const bool stop = cfg_.nonfinite.action == "stop" || nonfinite_ >= cfg_.nonfinite.steps;
        out.push_back({"nonfinite", stop ? AlertAction::stop : AlertAction::skip, r.step,
                       std::isfinite(r.loss) ? r.grad_norm : r.loss, 0,
                       fmt::format("step {}: the loss is {}, the gradient norm {}: {}", r.step, r.loss, r.grad_norm,
                                   stop ? fmt::format("stopping ({} such steps in a row; lower train.lr?)", nonfinite_)
                                        : "the update was skipped")});
        return out;  // the other rules judge finite steps only
    }
    nonfinite_ = 0;

    // loss spike: robust z-score (median and MAD of the window before this step; 1.4826 MAD ~ sigma)
    const AlertRule& ls = cfg_.loss_spike;
    if (ls.threshold > 0 && ls.window > 0 && int64_t(losses_.size()) >= ls.window) {
        std::vector<double> h(losses_.begin(), losses_.end());
        const double med = median(h);
        for (double& x : h) x = std::abs(x - med);
        const double sigma = std::max(1.4826 * median(h), 1e-3 * std::abs(med) + 1e-12);
        const double z = (r.loss - med) / sigma;
        if (z > ls.threshold)
            fire(
                "loss_spike", ls, z, ls.threshold,
                fmt::format("step {}: loss {:.4f} is {:.1f} robust sigmas above the median {:.4f} of the last {} steps",
                            r.step, r.loss, z, med, ls.window));
    }
    if (ls.window > 0) push_window(losses_, r.loss, ls.window);

    // expert overload: the worst MoE layer's max/mean load past the bound for `steps` steps in a row
    const AlertRule& eo = cfg_.expert_overload;
    if (eo.threshold > 0 && r.layers && !r.layers->moe.empty()) {
        double worst = 0;
        int64_t at = -1;
        for (const auto& [layer, s] : r.layers->moe)
            if (s.load.overload > worst) std::tie(worst, at) = std::pair(s.load.overload, layer);
        if (streak(overload_, worst > eo.threshold, eo))
            fire("expert_overload", eo, worst, eo.threshold,
                 fmt::format("step {}: layer {}'s busiest expert has {:.2f}x the mean load, above {} for {} steps",
                             r.step, at, worst, eo.threshold, eo.steps));
    }

    // straggler: a rank whose compute time (its step less data, optimizer and communication waits) is far above
    // the ranks' median: the others wait for it in the collectives. The gap must also exceed a noise floor: on
    // steps of a few milliseconds a scheduler hiccup is several times the median and holds no one up.
    const AlertRule& st = cfg_.straggler;
    if (st.threshold > 0 && ranks.size() > 1) {
        std::vector<double> busy;
        for (const RankSample& s : ranks)
            busy.push_back(std::max(0.0, s.v[RankSample::kStep] - s.v[RankSample::kData] - s.v[RankSample::kOptimizer] -
                                             s.v[RankSample::kCommunication]));
        const auto worst = std::max_element(busy.begin(), busy.end());
        const double slowest = *worst;
        const int64_t who = worst - busy.begin();
        busy.erase(worst);
        const double med = median(busy);  // of the other ranks (with two ranks: the other one)
        const double ratio = med > 0 ? slowest / med : 0;
        constexpr double kNoiseFloor = 0.02;  // seconds
        if (streak(straggler_, ratio > st.threshold && slowest - med > kNoiseFloor, st))
            fire("straggler", st, ratio, st.threshold,
                 fmt::format("step {}: rank {} computes {:.0f} ms against the other ranks' median {:.0f} ms ({:.1f}x) "
                             "for {} steps",
                             r.step, who, slowest * 1e3, med * 1e3, ratio, st.steps));
    }

    // memory water level: a rank's resident set over physical memory
    const AlertRule& mem = cfg_.memory;
    if (mem.threshold > 0 && memory_bytes_ > 0) {
        double worst = 0;
        size_t who = 0;
        for (size_t i = 0; i < ranks.size(); ++i)
            if (ranks[i].v[RankSample::kRss] > worst) std::tie(worst, who) = std::pair(ranks[i].v[RankSample::kRss], i);
        const double share = worst / memory_bytes_;
        if (streak(memory_, share > mem.threshold, mem))
            fire("memory", mem, share, mem.threshold,
                 fmt::format("step {}: rank {} holds {:.0f} MiB resident, {:.0f}% of physical memory", r.step, who,
                             worst / 0x1p20, 100 * share));
    }

    // throughput drop: tokens/s under a share of the median of the window before
    const AlertRule& tp = cfg_.throughput;
    const double rate = double(r.tokens) / std::max(r.phases.step, 1e-12);
    if (tp.threshold > 0 && tp.window > 0 && int64_t(rates_.size()) >= std::min<int64_t>(tp.window, 10)) {
        const double med = median(std::vector<double>(rates_.begin(), rates_.end()));
        if (streak(throughput_, rate < tp.threshold * med, tp))
            fire(
                "throughput", tp, rate / med, tp.threshold,
                fmt::format("step {}: {:.0f} tokens/s, {:.0f}% of the median {:.0f} of the last {} steps, for {} steps",
                            r.step, rate, 100 * rate / med, med, rates_.size(), tp.steps));
    }
    // a slow streak does not drag the median it is judged by
    if (tp.window > 0 && throughput_ == 0) push_window(rates_, rate, tp.window);
    return out;
}

HttpUrl parse_http_url(const std::string& url) {
    TESSERA_CHECK(url.starts_with("http://"), "webhook {}: not an http:// URL", url);
    HttpUrl u;
    std::string rest = url.substr(7);
    const size_t slash = rest.find('/');
    if (slash != std::string::npos) {
        u.path = rest.substr(slash);
        rest = rest.substr(0, slash);
    }
    const size_t colon = rest.rfind(':');
    if (colon != std::string::npos) {
        const std::string port = rest.substr(colon + 1);
        TESSERA_CHECK(!port.empty() && port.size() <= 5 && std::all_of(port.begin(), port.end(), ::isdigit) &&
                          std::stoi(port) > 0 && std::stoi(port) < 65536,
                      "webhook {}: bad port '{}'", url, port);
        u.port = std::stoi(port);
        rest = rest.substr(0, colon);
    }
    TESSERA_CHECK(!rest.empty(), "webhook {}: no host", url);
    u.host = rest;
    return u;
}

AlertSink::AlertSink(const std::string& jsonl_path, std::ostream* err, std::string webhook)
    : err_(err), webhook_(std::move(webhook)) {
    out_.open(jsonl_path, std::ios::app);
    TESSERA_CHECK(out_.good(), "{}: cannot open the alerts log for writing", jsonl_path);
    if (!webhook_.empty()) {
        parse_http_url(webhook_);  // a bad URL fails now, not at the first alert
        poster_ = std::thread([this] { post_loop(); });
    }
}

AlertSink::~AlertSink() {
    {
        std::lock_guard lock(mu_);
        done_ = true;
    }
    cv_.notify_all();
    if (poster_.joinable()) poster_.join();  // what was queued is still sent (each POST times out in seconds)
}

void AlertSink::fire(const Alert& a, bool echo) {
    const std::string line = a.to_json().dump();
    {
        std::lock_guard lock(mu_);
        out_ << line << '\n';
        out_.flush();
        if (err_ && echo)
            *err_ << fmt::format("alert [{}, {}]: {}\n", a.rule, action_name(a.action), a.message) << std::flush;
        if (!webhook_.empty()) queue_.push_back(line);
    }
    cv_.notify_all();
}

void AlertSink::post_loop() {
    const HttpUrl u = parse_http_url(webhook_);
    httplib::Client client(u.host, u.port);
    client.set_connection_timeout(2);
    client.set_read_timeout(5);
    client.set_write_timeout(5);
    for (;;) {
        std::string body;
        {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return done_ || !queue_.empty(); });
            if (queue_.empty()) return;
            body = std::move(queue_.front());
            queue_.pop_front();
        }
        const auto res = client.Post(u.path, body, "application/json");
        if (!res || res->status / 100 != 2) {
            std::lock_guard lock(mu_);
            if (err_)
                *err_ << fmt::format("warning: webhook {}: {}\n", webhook_,
                                     res ? fmt::format("HTTP {}", res->status) : httplib::to_string(res.error()))
                      << std::flush;
        }
    }
}

Watchdog::Watchdog(double seconds, int rank, AlertSink* alerts) : seconds_(seconds), rank_(rank), alerts_(alerts) {
    if (seconds_ > 0) thread_ = std::thread([this] { loop(); });
}

Watchdog::~Watchdog() {
    {
        std::lock_guard lock(mu_);
        done_ = true;
    }
    cv_.notify_all();
    if (thread_.joinable()) thread_.join();
}

void Watchdog::beat(int64_t step) {
    std::lock_guard lock(mu_);
    step_ = step;
    last_ = std::chrono::steady_clock::now();
    paused_ = false;
}

void Watchdog::loop() {
    std::unique_lock lock(mu_);
    const auto limit = std::chrono::duration<double>(seconds_);
    while (!done_) {
        cv_.wait_for(lock, std::chrono::milliseconds(200));
        if (done_ || paused_ || std::chrono::steady_clock::now() - last_ < limit) continue;
        const Alert a{"watchdog",
                      AlertAction::stop,
                      step_ + 1,
                      seconds_,
                      seconds_,
                      fmt::format("rank {}: step {} has not finished in {} s (a collective stuck or a rank lost): "
                                  "ending the process",
                                  rank_, step_ + 1, seconds_)};
        lock.unlock();
        if (alerts_) {
            alerts_->fire(a);
        } else {
            std::cerr << fmt::format("alert [watchdog, stop]: {}\n", a.message) << std::flush;
        }
        _exit(124);
    }
}

}  // namespace tessera::train
