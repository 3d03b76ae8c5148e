// Numeric command-line options read strictly: base 10, the whole word, inside a stated range, finite. CLI11's own
// conversion saturates (--steps 18446744073709551616 became INT64_MAX), reads 010 as octal and -1 as 2^64 − 1,
// and its range messages print 309-digit bounds; these helpers say "--steps: 18446744073709551616 is not an
// integer in [0, 1000000000000]" instead.
#pragma once

#include <CLI/CLI.hpp>

#include <cstdint>
#include <string>
#include <utility>
#include <vector>

#include "core/json.h"

namespace tessera::apps {

CLI::Option* add_int_option(
    CLI::App* cmd, const std::string& name, int64_t& target, int64_t lo, int64_t hi, const std::string& description);
CLI::Option* add_uint_option(CLI::App* cmd, const std::string& name, uint64_t& target, const std::string& description);
CLI::Option* add_number_option(
    CLI::App* cmd, const std::string& name, double& target, double lo, double hi, const std::string& description);
// Integers separated by commas, each in [lo, hi] ("3,7"; --pipeline-split).
CLI::Option* add_int_list_option(CLI::App* cmd,
                                 const std::string& name,
                                 std::vector<int64_t>& target,
                                 int64_t lo,
                                 int64_t hi,
                                 const std::string& description);

// "A:B" with 1 <= A <= B integers (--trace-steps); a ValidationError otherwise.
std::pair<int64_t, int64_t> parse_step_range(const std::string& s, const std::string& name);

// Stopping on a signal: the command finished cleanly (checkpoint written) and main exits with `status`
// (130 for SIGINT, 143 for SIGTERM) after printing `message` on stderr.
struct Stopped {
    int status = 130;
    std::string message;
};

// A model named on the command line (inspect, plan): a tessera config, a directory holding config.json, or a Hugging
// Face config.json of a supported family (its model section imported, the rest defaults).
struct ModelDoc {
    std::string file;                      // the config.json read
    std::string family;                    // the Hugging Face family, or empty for a tessera config
    Json run;                              // a run config document ({"model": ...} for a Hugging Face config)
    std::vector<std::string> unsupported;  // Hugging Face features tessera does not build
};
ModelDoc load_model_doc(const std::string& path);

}  // namespace tessera::apps
