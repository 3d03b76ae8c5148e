// Runs the tessera binary through the shell, capturing its streams in temporary files.
#include "e2e/cli_util.h"

#include <sys/wait.h>

#include <algorithm>
#include <cstdlib>

#include "core/file.h"
#include "util/test_util.h"

namespace tessera::test {

CliResult run_tessera(const std::string& args) {
    TempDir dir;
    // TESSERA_TEST_BIN: another binary to test (e.g. an older build, to see a new test fail before its fix)
    const char* other = std::getenv("TESSERA_TEST_BIN");
    const std::string bin = other && *other ? other : TESSERA_BIN;
    const std::string cmd = bin + " --threads 2 " + args + " > " + dir.file("out") + " 2> " + dir.file("err");
    const int raw = std::system(cmd.c_str());
    CliResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    r.out = read_text(dir.file("out"));
    r.err = read_text(dir.file("err"));
    return r;
}

void expect_one_line_error(const CliResult& r, const std::string& needle, const std::string& what, size_t max_chars) {
    SCOPED_TRACE(what);
    EXPECT_NE(r.status, 0);
    EXPECT_LT(r.status, 128) << "killed by a signal";
    EXPECT_EQ(r.err.rfind("error: ", 0), 0u) << r.err.substr(0, 2000);
    EXPECT_EQ(std::count(r.err.begin(), r.err.end(), '\n'), 1) << "not one line: " << r.err.substr(0, 2000);
    EXPECT_LE(r.err.size(), max_chars) << "too long: " << r.err.substr(0, 2000);
    EXPECT_NE(r.err.find(needle), std::string::npos) << r.err.substr(0, 2000);
}

}  // namespace tessera::test
