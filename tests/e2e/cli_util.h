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

// A tessera process in the background (stdout and stderr to out_file and err_file), for signal tests.
struct Background {
    int pid = -1;
    std::string out_file, err_file;
};
Background start_tessera(const std::string& args, const std::string& dir);
// Waits for it (killing it after timeout_s); status as in CliResult, plus a flag: exited normally (not by a signal).
CliResult wait_tessera(const Background& b, double timeout_s, bool* exited_normally = nullptr);

// The promise for bad input: a non-zero exit (not a signal), one line on stderr starting "error: ", no longer
// than max_chars, containing needle.
void expect_one_line_error(const CliResult& r,
                           const std::string& needle,
                           const std::string& what,
                           size_t max_chars = 2000);

}  // namespace tessera::test
