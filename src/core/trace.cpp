// Step traces (see trace.h). Times: microseconds on the steady clock (CLOCK_MONOTONIC: one time line for every
// process of one machine).
#include "core/trace.h"

#include <atomic>
#include <chrono>
#include <mutex>
#include <vector>

#include "core/json.h"

namespace tessera::trace {

namespace {
std::atomic<bool> g_on{false};

struct Event {
    std::string name;
    const char* cat;
    int64_t arg;
    const char* arg_name;
    double ts, dur;
    int tid;
};

struct Recorder {
    std::mutex mu;
    std::vector<Event> events;
    std::vector<std::string> thread_names;  // by tid
};
Recorder& recorder() {
    static Recorder r;
    return r;
}

thread_local int t_tid = -1;

int tid(Recorder& r) {  // under r.mu
    if (t_tid < 0) {
        t_tid = int(r.thread_names.size());
        r.thread_names.push_back(t_tid == 0 ? "main" : "thread " + std::to_string(t_tid));
    }
    return t_tid;
}

double now_us() {
    return std::chrono::duration<double, std::micro>(std::chrono::steady_clock::now().time_since_epoch()).count();
}
}  // namespace

bool on() { return g_on.load(std::memory_order_relaxed); }

void start() {
    Recorder& r = recorder();
    {
        std::lock_guard lock(r.mu);
        r.events.clear();
        r.thread_names[size_t(tid(r))] = "main";  // the thread that starts tracing
    }
    g_on.store(true);
}

void stop() { g_on.store(false); }

void name_thread(std::string name) {
    Recorder& r = recorder();
    std::lock_guard lock(r.mu);
    r.thread_names[size_t(tid(r))] = std::move(name);
}

Span::Span(std::string_view name, const char* cat, int64_t arg, const char* arg_name)
    : cat_(cat), arg_(arg), arg_name_(arg_name) {
    if (!on()) return;
    name_ = name;
    t0_ = now_us();
}

Span::~Span() {
    if (t0_ < 0) return;
    const double t1 = now_us();
    Recorder& r = recorder();
    std::lock_guard lock(r.mu);
    r.events.push_back({std::move(name_), cat_, arg_, arg_name_, t0_, t1 - t0_, tid(r)});
}

std::string take_events(int pid, const std::string& process_name) {
    Recorder& r = recorder();
    std::lock_guard lock(r.mu);
    std::string out;
    auto add = [&](const Json& j) {
        if (!out.empty()) out += ",\n";
        out += j.dump();
    };
    add({{"ph", "M"}, {"name", "process_name"}, {"pid", pid}, {"args", {{"name", process_name}}}});
    add({{"ph", "M"}, {"name", "process_sort_index"}, {"pid", pid}, {"args", {{"sort_index", pid}}}});
    for (size_t t = 0; t < r.thread_names.size(); ++t)
        add({{"ph", "M"}, {"name", "thread_name"}, {"pid", pid}, {"tid", t}, {"args", {{"name", r.thread_names[t]}}}});
    for (const Event& e : r.events) {
        Json j = {{"ph", "X"},    {"name", e.name}, {"cat", e.cat}, {"pid", pid},
                  {"tid", e.tid}, {"ts", e.ts},     {"dur", e.dur}};
        if (e.arg >= 0) j["args"] = {{e.arg_name, e.arg}};
        add(j);
    }
    r.events.clear();
    return out;
}

}  // namespace tessera::trace
