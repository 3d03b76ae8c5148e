// Metrics log and progress line.
#include "train/metrics.h"

#include <cmath>
#include <filesystem>
#include <sstream>
#include <vector>

#include "core/check.h"
#include "core/file.h"
#include "ops/isa.h"

namespace tessera::train {

MetricsLog::MetricsLog(const std::string& path, int64_t keep_through_step) {
    if (keep_through_step >= 0 && std::filesystem::exists(path)) {
        std::istringstream in(read_text(path));
        std::string line, kept;
        while (std::getline(in, line)) {
            Json j = Json::parse(line, nullptr, false);
            if (!j.is_discarded() && j.contains("step") && j["step"].is_number() &&
                j["step"].get<int64_t>() > keep_through_step) {
                continue;
            }
            kept += line + "\n";
        }
        write_text_atomic(path, kept);
    }
    out_.open(path, std::ios::app);
    TESSERA_CHECK(out_.good(), "{}: cannot open the metrics log for writing", path);
}

void MetricsLog::write(const Json& record) {
    out_ << record.dump() << '\n';
    out_.flush();
}

std::string format_duration(double s) {
    if (!std::isfinite(s) || s < 0) return "?";
    const int64_t t = int64_t(s + 0.5);
    if (t >= 3600) return fmt::format("{}h{:02d}m", t / 3600, (t % 3600) / 60);
    if (t >= 60) return fmt::format("{}m{:02d}s", t / 60, t % 60);
    return fmt::format("{}s", t);
}

Progress::Progress(std::ostream* out, bool is_tty, int64_t total_steps, int64_t log_interval, std::string engine)
    : out_(out),
      tty_(out != nullptr && is_tty),
      total_(total_steps),
      interval_(log_interval),
      engine_(engine.empty() ? ops::kernel_isa() : std::move(engine)) {}

void Progress::step(
    int64_t step, double loss, double lr, double tokens_per_s, double step_s, double mfu, const std::string& extra) {
    if (!out_) return;
    ema_step_s_ = ema_step_s_ == 0 ? step_s : 0.9 * ema_step_s_ + 0.1 * step_s;
    const bool milestone = step % interval_ == 0 || step == total_;
    if (!tty_ && !milestone) return;
    std::string line =
        fmt::format("step {:>{}}/{} | loss {:.4f} | lr {:.2e} | {:.1f}k tok/s | {:.0f}% of GEMM rate ({}) | ETA {}",
                    step, std::to_string(total_).size(), total_, loss, lr, tokens_per_s / 1e3, 100.0 * mfu, engine_,
                    format_duration(ema_step_s_ * double(total_ - step)));
    if (!extra.empty()) line += " | " + extra;
    if (tty_) {
        *out_ << "\r\033[K" << line << (milestone ? "\n" : "") << std::flush;
        dirty_ = !milestone;
    } else {
        *out_ << line << '\n' << std::flush;
    }
}

void Progress::note(const std::string& line) {
    if (!out_) return;
    if (tty_ && dirty_) *out_ << "\r\033[K";
    *out_ << line << '\n' << std::flush;
    dirty_ = false;
}

void Progress::finish() {
    if (out_ && dirty_) *out_ << '\n' << std::flush;
    dirty_ = false;
}

}  // namespace tessera::train
