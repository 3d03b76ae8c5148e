// A run's HTTP endpoint (cpp-httplib; docs/operations.md): Prometheus text at /metrics, the live dashboard at /
// (chart.js from Debian's libjs-chart.js, compiled into the binary: nothing is fetched from the network), and the
// dashboard's data: /api/records and /api/alerts (the run directory's metrics.jsonl and alerts.jsonl from a
// byte offset). The same server shows a finished run (`tessera dashboard RUN_DIR`), without /metrics.
#pragma once

#include <functional>
#include <memory>
#include <string>
#include <thread>

namespace httplib {
class Server;
}

namespace tessera::train {

class MonitorServer {
  public:
    // port 0: any free port (port() tells which). prometheus: the live exposition text (empty: no /metrics).
    // host: the address to listen on ("0.0.0.0": every interface, what a Prometheus server elsewhere needs).
    MonitorServer(std::string run_dir,
                  int port,
                  std::function<std::string()> prometheus,
                  const std::string& host = "0.0.0.0");
    ~MonitorServer();
    MonitorServer(const MonitorServer&) = delete;
    int port() const { return port_; }
    void wait();  // until the server stops (the offline dashboard: until the process ends)

  private:
    std::unique_ptr<httplib::Server> server_;
    std::string run_dir_;
    std::function<std::string()> prometheus_;
    int port_ = 0;
    std::thread thread_;
};

// The complete lines of a JSONL file from byte `offset` on, as a JSON array text, and the offset after them
// (a line still being written waits for the next call).
std::pair<std::string, size_t> jsonl_since(const std::string& path, size_t offset);

// The dashboard page and chart.js (generated from the Debian package at build time).
extern const char* const kDashboardHtml;
std::string chart_js();

}  // namespace tessera::train
