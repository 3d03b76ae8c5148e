// tessera dashboard RUN_DIR [--port P] [--host H]: serves a run's dashboard from its metrics.jsonl and
// alerts.jsonl (a finished run, or one still being written: the page follows the files), until interrupted.
#include <filesystem>
#include <iostream>

#include "apps/commands.h"
#include "apps/options.h"
#include "core/check.h"
#include "train/monitor_server.h"
#include "train/telemetry.h"

namespace tessera::apps {

void add_dashboard_command(CLI::App& app) {
    auto* cmd = app.add_subcommand("dashboard", "Serve a run's dashboard from its metrics.jsonl (docs/operations.md)");
    auto dir = std::make_shared<std::string>();
    auto port = std::make_shared<int64_t>(8080);
    auto host = std::make_shared<std::string>("127.0.0.1");
    cmd->add_option("run_dir", *dir, "A run directory (what train --out names)")->required();
    add_int_option(cmd, "--port", *port, 0, 65535, "Port to listen on (0 = any free port)");
    cmd->add_option("--host", *host, "Address to listen on (0.0.0.0: every interface)")->capture_default_str();
    cmd->callback([dir, port, host] {
        namespace fs = std::filesystem;
        TESSERA_CHECK(fs::is_regular_file(fs::path(*dir) / "metrics.jsonl"),
                      "{}: not a run directory (no metrics.jsonl)", *dir);
        train::MonitorServer server(*dir, int(*port), {}, *host);
        std::cout << fmt::format("dashboard of {}: http://{}:{}/ (Ctrl-C to stop)", *dir,
                                 *host == "0.0.0.0" ? train::host_name() : *host, server.port())
                  << std::endl;
        server.wait();
    });
}

}  // namespace tessera::apps
