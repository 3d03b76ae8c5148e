// Training output: the JSONL metrics log (one object per line, flushed as written) and the
// progress line (redrawn in place on a terminal, printed every log_interval steps otherwise).
#pragma once

#include <cstdint>
#include <fstream>
#include <ostream>
#include <string>

#include "core/config_reader.h"

namespace tessera::train {

class MetricsLog {
  public:
    // Opens path for appending; with keep_through_step >= 0, first drops lines of later steps
    // (a resumed run rewrites the steps after its checkpoint).
    MetricsLog(const std::string& path, int64_t keep_through_step);
    void write(const Json& record);

  private:
    std::ofstream out_;
};

class Progress {
  public:
    // engine: what the GEMM rate is of, named in the line ("": the CPU kernels' ISA, ops::kernel_isa())
    Progress(std::ostream* out, bool is_tty, int64_t total_steps, int64_t log_interval, std::string engine = "");
    // Per-step update: loss, lr, tokens/s, step seconds, MFU (fraction of the GEMM rate), and an
    // optional extra field (the MoE load summary).
    void step(int64_t step,
              double loss,
              double lr,
              double tokens_per_s,
              double step_s,
              double mfu,
              const std::string& extra = {});
    // A line of its own (eval results, checkpoints), not overwritten by the progress line.
    void note(const std::string& line);
    void finish();

  private:
    std::ostream* out_;
    bool tty_;
    int64_t total_, interval_;
    std::string engine_;
    double ema_step_s_ = 0;
    bool dirty_ = false;
};

std::string format_duration(double seconds);  // "3m05s"

}  // namespace tessera::train
