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

}  // namespace tessera::test
