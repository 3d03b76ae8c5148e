// The metrics sink (see telemetry.h). Prometheus conventions (https://prometheus.io/docs/practices/naming/):
// the tessera_ prefix, base units (seconds, bytes, ratios), _total on counters, one label per dimension that
// stays small (rank, layer, phase); expert load as summaries and a per-layer histogram, never a label per expert.
#include "train/telemetry.h"

#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <limits>

#include "core/check.h"

namespace tessera::train {

double StepPhases::compute() const { return std::max(0.0, step - data - optimizer - communication); }

size_t resident_bytes() {
    std::FILE* f = std::fopen("/proc/self/statm", "r");
    if (!f) return 0;
    unsigned long long pages = 0, resident = 0;
    const int n = std::fscanf(f, "%llu %llu", &pages, &resident);
    std::fclose(f);
    return n == 2 ? size_t(resident) * size_t(::sysconf(_SC_PAGESIZE)) : 0;
}

double physical_memory_bytes() { return double(::sysconf(_SC_PHYS_PAGES)) * double(::sysconf(_SC_PAGESIZE)); }

std::string host_name() {
    char buf[256] = {};
    if (::gethostname(buf, sizeof buf - 1) != 0 || !buf[0]) return "localhost";
    return buf;
}

namespace {
std::string render_labels(const PrometheusRegistry::Labels& labels) {
    if (labels.empty()) return {};
    std::string s = "{";
    for (const auto& [k, v] : labels) {
        if (s.size() > 1) s += ',';
        s += k + "=\"";
        for (char c : v) {  // the exposition format's escapes
            if (c == '\\' || c == '"') s += '\\';
            if (c == '\n') {
                s += "\\n";
                continue;
            }
            s += c;
        }
        s += '"';
    }
    return s + "}";
}

std::string number(double v) {
    if (std::isnan(v)) return "NaN";
    if (std::isinf(v)) return v > 0 ? "+Inf" : "-Inf";
    return fmt::format("{}", v);  // shortest round-trip
}

// The labels with one more (a histogram's le) inside the braces.
std::string with_label(const std::string& rendered, const std::string& extra) {
    if (rendered.empty()) return "{" + extra + "}";
    return rendered.substr(0, rendered.size() - 1) + "," + extra + "}";
}
}  // namespace

PrometheusRegistry::Family& PrometheusRegistry::family(const std::string& name,
                                                       const char* type,
                                                       const std::string& help) {
    Family& f = families_[name];
    if (f.type.empty()) {
        f.type = type;
        f.help = help;
    }
    TESSERA_CHECK(f.type == type, "metric {} reported as {} and as {}", name, f.type, type);
    return f;
}

void PrometheusRegistry::gauge(const std::string& name, const std::string& help, double v, const Labels& labels) {
    family(name, "gauge", help).series[render_labels(labels)] = v;
}

void PrometheusRegistry::counter_add(const std::string& name,
                                     const std::string& help,
                                     double delta,
                                     const Labels& labels) {
    family(name, "counter", help).series[render_labels(labels)] += delta;
}

void PrometheusRegistry::histogram_observe(const std::string& name,
                                           const std::string& help,
                                           std::span<const double> bounds,
                                           std::span<const double> values,
                                           const Labels& labels) {
    Family& f = family(name, "histogram", help);
    if (f.bounds.empty()) f.bounds.assign(bounds.begin(), bounds.end());
    std::vector<double>& h = f.histograms[render_labels(labels)];
    h.resize(f.bounds.size() + 3);  // cumulative buckets (the last: +Inf), sum, count
    for (double v : values) {
        for (size_t b = 0; b <= f.bounds.size(); ++b) h[b] += b == f.bounds.size() || v <= f.bounds[b] ? 1 : 0;
        h[f.bounds.size() + 1] += v;
    }
    h[f.bounds.size() + 2] += double(values.size());
}

std::string PrometheusRegistry::text() const {
    std::string out;
    for (const auto& [name, f] : families_) {
        out += fmt::format("# HELP {} {}\n# TYPE {} {}\n", name, f.help, name, f.type);
        for (const auto& [labels, v] : f.series) out += name + labels + " " + number(v) + "\n";
        const size_t nb = f.bounds.size();
        for (const auto& [labels, h] : f.histograms) {
            for (size_t b = 0; b <= nb; ++b) {
                const std::string le = b == nb ? "+Inf" : number(f.bounds[b]);
                out += name + "_bucket" + with_label(labels, "le=\"" + le + "\"") + " " + number(h[b]) + "\n";
            }
            out += name + "_sum" + labels + " " + number(h[nb + 1]) + "\n";
            out += name + "_count" + labels + " " + number(h[nb + 2]) + "\n";
        }
    }
    return out;
}

Telemetry::Telemetry(parallel::Comm* comm) : comm_(comm), ranks_(size_t(comm ? comm->size() : 1)) { publish(); }

Json Telemetry::step(const StepReport& r) {
    // every rank's share (a collective): step time and its phases, the arena's water level, the process's memory
    RankSample mine;
    mine.v[RankSample::kStep] = r.phases.step;
    mine.v[RankSample::kData] = r.phases.data;
    mine.v[RankSample::kOptimizer] = r.phases.optimizer;
    mine.v[RankSample::kCommunication] = r.phases.communication;
    if (r.arena) {
        mine.v[RankSample::kArenaInUse] = double(r.arena->bytes_in_use);
        mine.v[RankSample::kArenaPeak] = double(r.arena->peak_bytes_in_use);
        mine.v[RankSample::kFragmentation] = r.arena->fragmentation();
    }
    mine.v[RankSample::kRss] = double(resident_bytes());
    if (comm_) {
        comm_->all_gather(std::as_bytes(std::span(mine.v)), std::as_writable_bytes(std::span(ranks_)));
    } else {
        ranks_[0] = mine;
    }

    Json rec = {{"step", r.step},
                {"time", std::chrono::duration<double>(std::chrono::system_clock::now().time_since_epoch()).count()},
                {"loss", r.loss},
                {"lr", r.lr},
                {"grad_norm", r.grad_norm},
                {"tokens_per_s", double(r.tokens) / r.phases.step},
                {"step_ms", r.phases.step * 1e3},
                {"flops_per_s", r.flops_per_s},
                {"mfu", r.mfu},
                {"phase_ms",
                 {{"compute", r.phases.compute() * 1e3},
                  {"communication", r.phases.communication * 1e3},
                  {"data", r.phases.data * 1e3},
                  {"optimizer", r.phases.optimizer * 1e3}}},
                {"monitor_ms", r.monitor_seconds * 1e3},
                {"memory",
                 {{"arena_bytes_in_use", int64_t(mine.v[RankSample::kArenaInUse])},
                  {"arena_peak_bytes", int64_t(mine.v[RankSample::kArenaPeak])},
                  {"arena_fragmentation", mine.v[RankSample::kFragmentation]},
                  {"resident_bytes", int64_t(mine.v[RankSample::kRss])}}}};
    if (r.skipped) rec["skipped"] = true;
    if (r.arena_peak_bytes) rec["arena_peak_bytes"] = *r.arena_peak_bytes;
    if (ranks_.size() > 1) {
        Json steps = Json::array();
        for (const RankSample& s : ranks_) steps.push_back(s.v[RankSample::kStep] * 1e3);
        rec["rank_step_ms"] = steps;
    }

    reg_.gauge("tessera_step", "The last optimizer step finished", double(r.step));
    reg_.counter_add("tessera_steps_total", "Optimizer steps run by this process", 1);
    if (r.skipped) reg_.counter_add("tessera_skipped_steps_total", "Steps whose update was skipped (non-finite)", 1);
    reg_.counter_add("tessera_tokens_total", "Training tokens processed by this process", double(r.tokens));
    reg_.gauge("tessera_loss", "Training loss of the last step (nats per token)", r.loss);
    reg_.gauge("tessera_grad_norm", "Global gradient L2 norm before clipping", r.grad_norm);
    reg_.gauge("tessera_learning_rate", "Learning rate of the last step", r.lr);
    reg_.gauge("tessera_tokens_per_second", "Training throughput of the last step", double(r.tokens) / r.phases.step);
    reg_.gauge("tessera_flops_per_second", "Achieved training FLOP/s of the last step", r.flops_per_s);
    reg_.gauge("tessera_mfu_ratio", "Achieved FLOP/s over the measured GEMM rate", r.mfu);
    static const char* kPhases[] = {"data", "optimizer", "communication"};
    for (size_t i = 0; i < ranks_.size(); ++i) {
        const auto& v = ranks_[i].v;
        const PrometheusRegistry::Labels rank = {{"rank", std::to_string(i)}};
        reg_.gauge("tessera_step_seconds", "Wall time of the last step", v[RankSample::kStep], rank);
        const double compute = std::max(0.0, v[RankSample::kStep] - v[RankSample::kData] - v[RankSample::kOptimizer] -
                                                 v[RankSample::kCommunication]);
        reg_.gauge("tessera_step_phase_seconds", "The last step's time by phase (compute: the rest)", compute,
                   {{"rank", std::to_string(i)}, {"phase", "compute"}});
        for (int p = 0; p < 3; ++p)
            reg_.gauge("tessera_step_phase_seconds", "The last step's time by phase (compute: the rest)",
                       v[size_t(RankSample::kData + p)], {{"rank", std::to_string(i)}, {"phase", kPhases[p]}});
        reg_.gauge("tessera_arena_bytes_in_use", "Bytes allocated in the arena after the step",
                   v[RankSample::kArenaInUse], rank);
        reg_.gauge("tessera_arena_peak_bytes", "The arena's water level (highest bytes in use)",
                   v[RankSample::kArenaPeak], rank);
        reg_.gauge("tessera_arena_fragmentation_ratio", "1 - largest free block / free bytes of the arena",
                   v[RankSample::kFragmentation], rank);
        reg_.gauge("tessera_resident_bytes", "Resident set of the process", v[RankSample::kRss], rank);
    }

    summary_.clear();
    if (r.layers && !r.layers->moe.empty()) {
        Json moe = Json::array();
        double worst = 0;
        int64_t dead = 0, dropped = 0;
        static const double kBounds[] = {0.25, 0.5, 0.75, 1.0, 1.25, 1.5, 2.0, 3.0, 4.0};
        std::vector<double> ratio;
        for (const auto& [layer, s] : r.layers->moe) {
            moe.push_back({{"layer", layer},
                           {"overload", s.load.overload},
                           {"dead", s.load.dead},
                           {"load_entropy", s.load.load_entropy},
                           {"routing_entropy", s.load.routing_entropy},
                           {"rerouted", s.rerouted},
                           {"dropped", s.dropped},
                           {"a2a_bytes", s.a2a_bytes},
                           {"a2a_seconds", s.a2a_seconds},
                           {"a2a_exposed_seconds", s.a2a_exposed_seconds},
                           {"seq_aux_loss", s.seq_aux_loss},
                           {"z_loss", s.z_loss},
                           {"bias_min", s.bias_min},
                           {"bias_max", s.bias_max},
                           {"load", s.load.load}});
            worst = std::max(worst, s.load.overload);
            dead += s.load.dead;
            dropped += s.dropped;
            const PrometheusRegistry::Labels l = {{"layer", std::to_string(layer)}};
            reg_.gauge("tessera_moe_expert_overload_ratio", "Max over mean of the experts' load in the last step",
                       s.load.overload, l);
            reg_.gauge("tessera_moe_dead_experts", "Experts that received no token in the last step",
                       double(s.load.dead), l);
            reg_.gauge("tessera_moe_load_entropy_ratio", "Entropy of the expert load over log(experts) (1 = uniform)",
                       s.load.load_entropy, l);
            reg_.gauge("tessera_moe_routing_entropy", "Mean entropy of the router's scores per token (nats)",
                       s.load.routing_entropy, l);
            reg_.counter_add("tessera_moe_dropped_tokens_total", "Expert slots dropped at capacity", double(s.dropped),
                             l);
            reg_.counter_add("tessera_moe_rerouted_tokens_total", "Expert slots re-routed at capacity",
                             double(s.rerouted), l);
            reg_.counter_add("tessera_moe_a2a_bytes_total", "Bytes this rank's expert all-to-all sent",
                             double(s.a2a_bytes), l);
            reg_.counter_add("tessera_moe_a2a_seconds_total", "Time of the expert all-to-all exchanges", s.a2a_seconds,
                             l);
            reg_.counter_add("tessera_moe_a2a_exposed_seconds_total", "Time compute waited for the expert all-to-all",
                             s.a2a_exposed_seconds, l);
            double mean = 0;
            for (int64_t c : s.load.load) mean += double(c);
            mean /= double(std::max<size_t>(1, s.load.load.size()));
            ratio.clear();
            for (int64_t c : s.load.load) ratio.push_back(mean > 0 ? double(c) / mean : 0.0);
            reg_.histogram_observe("tessera_moe_expert_load_ratio",
                                   "Experts' load over the layer's mean load, one observation per expert and step",
                                   kBounds, ratio, l);
        }
        rec["moe"] = moe;
        if (r.global_aux_loss) rec["global_aux_loss"] = *r.global_aux_loss;
        summary_ = fmt::format("experts: max overload {:.2f}, {} dead", worst, dead);
        if (dropped) summary_ += fmt::format(", {} dropped", dropped);
    }
    if (r.layers && !r.layers->dsa.empty()) {
        Json dsa = Json::array();
        double sum = 0;
        for (const auto& [layer, s] : r.layers->dsa) {
            dsa.push_back({{"layer", layer}, {"indexer_kl", s.kl}});
            sum += s.kl;
            reg_.gauge("tessera_dsa_indexer_kl", "KL of the DSA indexer from the attention it imitates (last step)",
                       s.kl, {{"layer", std::to_string(layer)}});
        }
        rec["dsa"] = dsa;
        summary_ +=
            fmt::format("{}indexer KL {:.4f}", summary_.empty() ? "" : ", ", sum / double(r.layers->dsa.size()));
    }
    if (r.fsdp) {
        rec["fsdp"] = {{"gathers", r.fsdp->gathers},
                       {"gathered_bytes", r.fsdp->gathered_bytes},
                       {"reductions", r.fsdp->reductions},
                       {"wait_seconds", r.fsdp->wait_seconds}};
        reg_.counter_add("tessera_fsdp_gathered_bytes_total", "Bytes FSDP gathers received",
                         double(r.fsdp->gathered_bytes));
        reg_.counter_add("tessera_fsdp_wait_seconds_total", "Time compute waited for FSDP gathers and reductions",
                         r.fsdp->wait_seconds);
    }
    if (r.weights) {
        const WeightBudgetStats& w = *r.weights;
        rec["weights"] = {{"mapped_bytes", w.mapped_bytes},
                          {"resident_bytes", w.resident_bytes},
                          {"peak_resident_bytes", w.peak_resident_bytes},
                          {"released_bytes", w.released_bytes},
                          {"prefetched_bytes", w.prefetched_bytes},
                          {"major_faults", w.major_faults}};
        reg_.gauge("tessera_weights_resident_bytes", "Resident bytes of the frozen base read in place",
                   double(w.resident_bytes));
        reg_.gauge("tessera_weights_budget_bytes", "memory.weights_budget", double(w.budget_bytes));
    }
    publish();
    return rec;
}

void Telemetry::eval(int64_t step, double loss) {
    reg_.gauge("tessera_eval_loss", "Held-out loss of the last evaluation (nats per token)", loss);
    reg_.gauge("tessera_eval_step", "The step of the last evaluation", double(step));
    publish();
}

void Telemetry::checkpoint(int64_t step, double seconds) {
    reg_.gauge("tessera_checkpoint_seconds", "Duration of the last checkpoint", seconds);
    reg_.gauge("tessera_checkpoint_step", "The step of the last checkpoint", double(step));
    reg_.counter_add("tessera_checkpoints_total", "Checkpoints written", 1);
    reg_.counter_add("tessera_checkpoint_seconds_total", "Time spent writing checkpoints", seconds);
    publish();
}

void Telemetry::checkpoint_blocked(double seconds) {
    reg_.gauge("tessera_checkpoint_blocking_seconds",
               "How long the step loop waited for the last checkpoint (its copy; the writing is asynchronous)",
               seconds);
    publish();
}

void Telemetry::alert(const std::string& rule) {
    reg_.counter_add("tessera_alerts_total", "Alerts fired, by rule", 1, {{"rule", rule}});
    publish();
}

void Telemetry::restarts(int64_t n) {
    reg_.counter_add("tessera_restarts_total", "Restarts of the job (tessera launch --max-restarts)", double(n));
    publish();
}

void Telemetry::publish() {
    std::string t = reg_.text();
    std::lock_guard lock(mu_);
    text_ = std::move(t);
}

std::string Telemetry::prometheus() const {
    std::lock_guard lock(mu_);
    return text_;
}

}  // namespace tessera::train
