// The alert rules on made-up steps (train/alerts.h): every rule fires on the fault it is for, once per streak, with
// its action, and stays quiet on a healthy sequence; and the Prometheus text format of the registry, checked
// against text written by hand from the exposition format's rules.
#include <gtest/gtest.h>

#include <cmath>

#include "train/alerts.h"
#include "train/telemetry.h"
#include "util/test_util.h"

namespace tessera::train {
namespace {

MonitorConfig all_rules_on() {
    MonitorConfig m;
    m.loss_spike = {.threshold = 6, .steps = 1, .window = 20, .action = "warn"};
    m.expert_overload = {.threshold = 2.5, .steps = 3, .window = 0, .action = "checkpoint"};
    m.straggler = {.threshold = 2, .steps = 2, .window = 0, .action = "warn"};
    m.memory = {.threshold = 0.5, .steps = 1, .window = 0, .action = "stop"};
    m.throughput = {.threshold = 0.5, .steps = 3, .window = 20, .action = "warn"};
    return m;
}

// A healthy step: loss decaying with a little deterministic noise, 1000 tokens in ~0.1 s, four ranks alike,
// one MoE layer at overload 1.5, 10% of memory.
struct Healthy {
    model::StepStats stats;
    std::vector<RankSample> ranks = std::vector<RankSample>(4);
    StepReport at(int64_t step) {
        StepReport r;
        r.step = step;
        r.loss = 4.0 * std::exp(-0.01 * double(step)) + 0.02 * std::sin(double(step) * 1.7);
        r.grad_norm = 1.0;
        r.tokens = 1000;
        r.phases.step = 0.1 + 0.005 * std::sin(double(step));
        stats.moe.resize(1);
        stats.moe[0].first = 1;
        stats.moe[0].second.load.overload = 1.5;
        r.layers = &stats;
        for (size_t i = 0; i < ranks.size(); ++i) {
            ranks[i].v = {};
            ranks[i].v[RankSample::kStep] = r.phases.step;
            ranks[i].v[RankSample::kCommunication] = 0.01 * double(i);  // the ranks wait for each other a little
            ranks[i].v[RankSample::kRss] = 100.0;
        }
        return r;
    }
};

constexpr double kMemory = 1000.0;  // "physical memory" of the made-up machine

TEST(AlertRules, QuietOnAHealthyRun) {
    AlertRules rules(all_rules_on(), kMemory);
    Healthy h;
    for (int64_t s = 1; s <= 300; ++s) {
        const StepReport r = h.at(s);
        EXPECT_TRUE(rules.evaluate(r, h.ranks).empty()) << "step " << s;
    }
}

// The alerts of steps 1..n, with `fault` applied to each step's report and ranks.
template <class F>
std::vector<Alert> run(AlertRules& rules, int64_t n, F fault) {
    Healthy h;
    std::vector<Alert> all;
    for (int64_t s = 1; s <= n; ++s) {
        StepReport r = h.at(s);
        fault(s, r, h);
        for (Alert& a : rules.evaluate(r, h.ranks)) all.push_back(a);
    }
    return all;
}

TEST(AlertRules, NonFiniteSkipsThenStopsAfterTheLimit) {
    MonitorConfig m = all_rules_on();
    m.nonfinite = {.threshold = 0, .steps = 3, .window = 0, .action = "skip"};
    AlertRules rules(m, kMemory);
    // steps 10 and 20-22 are NaN: 10 and 20, 21 are skipped, 22 is the third in a row: stop
    const auto a = run(rules, 30, [](int64_t s, StepReport& r, Healthy&) {
        if (s == 10 || (s >= 20 && s <= 22)) {
            r.loss = std::nan("");
            r.skipped = true;
        }
    });
    ASSERT_EQ(a.size(), 4u);
    for (const Alert& x : a) EXPECT_EQ(x.rule, "nonfinite");
    EXPECT_EQ(a[0].step, 10);
    EXPECT_EQ(a[0].action, AlertAction::skip);
    EXPECT_EQ(a[2].step, 21);
    EXPECT_EQ(a[2].action, AlertAction::skip);
    EXPECT_EQ(a[3].step, 22);
    EXPECT_EQ(a[3].action, AlertAction::stop);
    EXPECT_NE(a[3].message.find("3 such steps in a row"), std::string::npos) << a[3].message;
    // action stop: the first one stops
    m.nonfinite.action = "stop";
    AlertRules strict(m, kMemory);
    const auto b = run(strict, 12, [](int64_t s, StepReport& r, Healthy&) {
        if (s == 10) r.skipped = true, r.grad_norm = INFINITY;
    });
    ASSERT_EQ(b.size(), 1u);
    EXPECT_EQ(b[0].action, AlertAction::stop);
}

TEST(AlertRules, LossSpikeByRobustZScore) {
    AlertRules rules(all_rules_on(), kMemory);
    const auto a = run(rules, 60, [](int64_t s, StepReport& r, Healthy&) {
        if (s == 40) r.loss += 3.0;  // the window's spread is ~0.5 (its trend and noise)
    });
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].rule, "loss_spike");
    EXPECT_EQ(a[0].step, 40);
    EXPECT_GT(a[0].value, 6.0);
    EXPECT_EQ(a[0].action, AlertAction::warn);
    // a spike before the window is full is not judged
    AlertRules early(all_rules_on(), kMemory);
    EXPECT_TRUE(run(early, 15, [](int64_t s, StepReport& r, Healthy&) {
                    if (s == 10) r.loss += 1.0;
                }).empty());
}

TEST(AlertRules, ExpertOverloadForNStepsInARow) {
    AlertRules rules(all_rules_on(), kMemory);
    // overloaded in steps 5-6 (too short), then 10-19 (fires once, at the third step), again 30-32
    const auto a = run(rules, 40, [](int64_t s, StepReport& r, Healthy& h) {
        if ((s >= 5 && s <= 6) || (s >= 10 && s <= 19) || (s >= 30 && s <= 32)) h.stats.moe[0].second.load.overload = 3;
    });
    ASSERT_EQ(a.size(), 2u);
    EXPECT_EQ(a[0].rule, "expert_overload");
    EXPECT_EQ(a[0].step, 12);
    EXPECT_EQ(a[0].action, AlertAction::checkpoint);
    EXPECT_EQ(a[1].step, 32);
    EXPECT_NE(a[0].message.find("layer 1"), std::string::npos) << a[0].message;
}

TEST(AlertRules, StragglerRank) {
    AlertRules rules(all_rules_on(), kMemory);
    // rank 2 computes three times as long as the others from step 8 on (they wait for it in communication)
    const auto a = run(rules, 12, [](int64_t s, StepReport&, Healthy& h) {
        if (s < 8) return;
        for (size_t i = 0; i < h.ranks.size(); ++i) {
            h.ranks[i].v[RankSample::kStep] = 0.3;
            h.ranks[i].v[RankSample::kCommunication] = i == 2 ? 0.0 : 0.2;
        }
    });
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].rule, "straggler");
    EXPECT_EQ(a[0].step, 9);
    EXPECT_NE(a[0].message.find("rank 2"), std::string::npos) << a[0].message;
    EXPECT_NEAR(a[0].value, 3.0, 1e-9);
}

// A scheduler hiccup on millisecond steps is several times the median but holds no one up: below the 20 ms
// noise floor no straggler fires, however large the ratio.
TEST(AlertRules, StragglerIgnoresMillisecondNoise) {
    AlertRules rules(all_rules_on(), kMemory);
    const auto a = run(rules, 12, [](int64_t s, StepReport&, Healthy& h) {
        for (size_t i = 0; i < h.ranks.size(); ++i) {
            h.ranks[i].v[RankSample::kStep] = i == 1 && s >= 4 ? 0.015 : 0.003;  // 5x, 12 ms apart
            h.ranks[i].v[RankSample::kCommunication] = 0;
        }
    });
    EXPECT_TRUE(a.empty()) << a[0].message;
}

TEST(AlertRules, MemoryWaterLevel) {
    AlertRules rules(all_rules_on(), kMemory);
    const auto a = run(rules, 10, [](int64_t s, StepReport&, Healthy& h) {
        if (s == 7) h.ranks[3].v[RankSample::kRss] = 600.0;  // 60% of the machine
    });
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].rule, "memory");
    EXPECT_EQ(a[0].action, AlertAction::stop);
    EXPECT_NE(a[0].message.find("rank 3"), std::string::npos) << a[0].message;
}

TEST(AlertRules, ThroughputDrop) {
    AlertRules rules(all_rules_on(), kMemory);
    // steps 40-44 take four times as long; the median of the window stays that of the healthy steps
    const auto a = run(rules, 60, [](int64_t s, StepReport& r, Healthy&) {
        if (s >= 40 && s <= 44) r.phases.step = 0.4;
    });
    ASSERT_EQ(a.size(), 1u);
    EXPECT_EQ(a[0].rule, "throughput");
    EXPECT_EQ(a[0].step, 42);
    EXPECT_NEAR(a[0].value, 0.25, 0.02);
}

TEST(AlertRules, StrongestAction) {
    std::vector<Alert> a(3);
    a[0].action = AlertAction::warn;
    a[1].action = AlertAction::checkpoint;
    a[2].action = AlertAction::warn;
    EXPECT_EQ(AlertRules::strongest(a), AlertAction::checkpoint);
    EXPECT_EQ(AlertRules::strongest({}), AlertAction::none);
}

TEST(Prometheus, TextExpositionFormat) {
    PrometheusRegistry reg;
    reg.gauge("tessera_loss", "Training loss", 2.5);
    reg.counter_add("tessera_tokens_total", "Tokens", 100);
    reg.counter_add("tessera_tokens_total", "Tokens", 28);
    reg.gauge("tessera_step_seconds", "Step time", 0.25, {{"rank", "1"}});
    reg.gauge("tessera_step_seconds", "Step time", 0.125, {{"rank", "0"}});
    reg.gauge("tessera_odd", "Escapes", std::nan(""), {{"path", "a\"b\\c\nd"}});
    const double bounds[] = {0.5, 1, 2};
    const double first[] = {0.25, 1.0, 3.0}, second[] = {2.0};
    reg.histogram_observe("tessera_load_ratio", "Load", bounds, first, {{"layer", "3"}});
    reg.histogram_observe("tessera_load_ratio", "Load", bounds, second, {{"layer", "3"}});
    const std::string want =
        "# HELP tessera_load_ratio Load\n"
        "# TYPE tessera_load_ratio histogram\n"
        "tessera_load_ratio_bucket{layer=\"3\",le=\"0.5\"} 1\n"
        "tessera_load_ratio_bucket{layer=\"3\",le=\"1\"} 2\n"
        "tessera_load_ratio_bucket{layer=\"3\",le=\"2\"} 3\n"
        "tessera_load_ratio_bucket{layer=\"3\",le=\"+Inf\"} 4\n"
        "tessera_load_ratio_sum{layer=\"3\"} 6.25\n"
        "tessera_load_ratio_count{layer=\"3\"} 4\n"
        "# HELP tessera_loss Training loss\n"
        "# TYPE tessera_loss gauge\n"
        "tessera_loss 2.5\n"
        "# HELP tessera_odd Escapes\n"
        "# TYPE tessera_odd gauge\n"
        "tessera_odd{path=\"a\\\"b\\\\c\\nd\"} NaN\n"
        "# HELP tessera_step_seconds Step time\n"
        "# TYPE tessera_step_seconds gauge\n"
        "tessera_step_seconds{rank=\"0\"} 0.125\n"
        "tessera_step_seconds{rank=\"1\"} 0.25\n"
        "# HELP tessera_tokens_total Tokens\n"
        "# TYPE tessera_tokens_total counter\n"
        "tessera_tokens_total 128\n";
    EXPECT_EQ(reg.text(), want);
    // one name, one type
    test::expect_error([&] { reg.counter_add("tessera_loss", "x", 1); }, "reported as gauge and as counter");
}

TEST(Webhook, Urls) {
    const HttpUrl u = parse_http_url("http://alerts.local:9093/api/v1/tessera");
    EXPECT_EQ(u.host, "alerts.local");
    EXPECT_EQ(u.port, 9093);
    EXPECT_EQ(u.path, "/api/v1/tessera");
    const HttpUrl d = parse_http_url("http://example");
    EXPECT_EQ(d.port, 80);
    EXPECT_EQ(d.path, "/");
    test::expect_error([] { parse_http_url("http://host:99999/x"); }, "bad port");
    test::expect_error([] { parse_http_url("https://host/x"); }, "not an http:// URL");
    test::expect_error([] { parse_http_url("http://:80/x"); }, "no host");
}

}  // namespace
}  // namespace tessera::train
