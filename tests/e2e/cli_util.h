// Running the tessera binary from tests: exit status, stdout and stderr.
#pragma once

#include <string>

namespace tessera::test {

struct CliResult {
    int status = -1;  // exit status (128 + signal if killed)
    std::string out, err;
};

// args: shell words appended to the binary path (quote them yourself).
CliResult run_tessera(const std::string& args);

// The promise for bad input: a non-zero exit (not a signal), one line on stderr starting "error: ", no longer
// than max_chars, containing needle.
void expect_one_line_error(const CliResult& r,
                           const std::string& needle,
                           const std::string& what,
                           size_t max_chars = 2000);

}  // namespace tessera::test
