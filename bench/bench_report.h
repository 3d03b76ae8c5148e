// The Google Benchmark programs' tables: a console reporter that also keeps, per run name, the median (or
// the single run) of every counter and the real time in the run's unit ("ms" for kMillisecond).
#pragma once

#include <benchmark/benchmark.h>

#include <map>
#include <string>
#include <vector>

namespace tessera::bench {

class MedianCollector : public benchmark::ConsoleReporter {
  public:
    std::map<std::string, std::map<std::string, double>> v;  // run name -> counter -> value

    // the value, or nullptr when that run did not happen (filtered out)
    const double* find(const std::string& run, const std::string& counter) const {
        auto it = v.find(run);
        if (it == v.end()) return nullptr;
        auto c = it->second.find(counter);
        return c == it->second.end() ? nullptr : &c->second;
    }

    void ReportRuns(const std::vector<Run>& runs) override {
        for (const auto& r : runs) {
            if (r.run_type == Run::RT_Aggregate && r.aggregate_name != "median") continue;
            for (auto& [k, c] : r.counters) v[r.run_name.str()][k] = c.value;
            v[r.run_name.str()]["ms"] = r.GetAdjustedRealTime();
        }
        ConsoleReporter::ReportRuns(runs);
    }
};

}  // namespace tessera::bench
