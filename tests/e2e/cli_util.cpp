// Runs the tessera binary through the shell, capturing its streams in temporary files.
#include "e2e/cli_util.h"

#include <sys/wait.h>

#include <cstdlib>

#include "core/file.h"
#include "util/test_util.h"

namespace tessera::test {

CliResult run_tessera(const std::string& args) {
    TempDir dir;
    const std::string cmd =
        std::string(TESSERA_BIN) + " --threads 2 " + args + " > " + dir.file("out") + " 2> " + dir.file("err");
    const int raw = std::system(cmd.c_str());
    CliResult r;
    r.status = WIFEXITED(raw) ? WEXITSTATUS(raw) : 128 + WTERMSIG(raw);
    r.out = read_text(dir.file("out"));
    r.err = read_text(dir.file("err"));
    return r;
}

}  // namespace tessera::test
