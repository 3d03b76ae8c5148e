// Step traces (train --trace-steps A:B; docs/operations.md): spans recorded while tracing is on, written as
// Chrome trace events (the JSON that chrome://tracing and Perfetto read). A span off costs one relaxed atomic
// load; on, its end takes a lock and appends to one list (a few hundred spans a step).
#pragma once

#include <cstdint>
#include <string>
#include <string_view>

namespace tessera::trace {

bool on();
void start();  // clears what was recorded and records from now on
void stop();

// The name of this thread's track ("main", "communication", ...); the first span of an unnamed thread calls it
// "thread N".
void name_thread(std::string name);

// A span from its construction to its destruction on this thread's track; cat: Chrome's category ("forward",
// "backward", "comm", "step", ...); arg >= 0 becomes an argument named arg_name ("layer", "step", "bytes").
class Span {
  public:
    Span(std::string_view name, const char* cat, int64_t arg = -1, const char* arg_name = "layer");
    ~Span();
    Span(const Span&) = delete;

  private:
    std::string name_;
    const char* cat_;
    int64_t arg_;
    const char* arg_name_;
    double t0_ = -1;  // microseconds on the steady clock; < 0: not recording
};

// What was recorded, as Chrome trace events (JSON objects joined by commas; pid = `pid`, one tid per thread,
// with thread-name metadata), and cleared.
std::string take_events(int pid, const std::string& process_name);

}  // namespace tessera::trace
