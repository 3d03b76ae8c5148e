// The run's HTTP endpoint (see monitor_server.h).
#include "train/monitor_server.h"

#include <httplib.h>

#include <filesystem>
#include <fstream>

#include "core/check.h"
#include "core/json.h"

namespace tessera::train {

std::pair<std::string, size_t> jsonl_since(const std::string& path, size_t offset) {
    std::ifstream in(path, std::ios::binary);
    if (!in) return {"[]", 0};
    in.seekg(0, std::ios::end);
    const size_t size = size_t(in.tellg());
    if (offset > size) offset = 0;  // the file was rewritten (a resumed run drops its later steps): from the start
    in.seekg(std::streamoff(offset));
    std::string text(size - offset, '\0');
    in.read(text.data(), std::streamsize(text.size()));
    const size_t end = text.rfind('\n');
    if (end == std::string::npos) return {"[]", offset};
    std::string out = "[";
    size_t at = 0;
    while (at <= end) {
        const size_t nl = text.find('\n', at);
        if (nl > at) {
            if (out.size() > 1) out += ',';
            out.append(text, at, nl - at);
        }
        at = nl + 1;
    }
    return {out + "]", offset + end + 1};
}

MonitorServer::MonitorServer(std::string run_dir,
                             int port,
                             std::function<std::string()> prometheus,
                             const std::string& host)
    : server_(std::make_unique<httplib::Server>()), run_dir_(std::move(run_dir)), prometheus_(std::move(prometheus)) {
    httplib::Server& s = *server_;
    // two threads answer (a dashboard or two, a Prometheus scraper): each thread of a pool costs the trainer a
    // malloc arena. No keep-alive: a browser's idle connection would hold a thread for 5 s after each of its polls
    // and keep a scraper (or its own next request) waiting.
    s.new_task_queue = [] { return new httplib::ThreadPool(2); };
    s.set_keep_alive_max_count(1);
    s.Get("/", [](const httplib::Request&, httplib::Response& res) {
        res.set_content(kDashboardHtml, "text/html; charset=utf-8");
    });
    s.Get("/chart.js", [](const httplib::Request&, httplib::Response& res) {
        res.set_header("Cache-Control", "max-age=86400");
        res.set_content(chart_js(), "application/javascript");
    });
    s.Get("/metrics", [this](const httplib::Request&, httplib::Response& res) {
        if (!prometheus_) {
            res.status = 404;
            res.set_content("a finished run has no live metrics: its records are at /api/records\n", "text/plain");
            return;
        }
        res.set_content(prometheus_(), "text/plain; version=0.0.4; charset=utf-8");
    });
    for (const char* name : {"records", "alerts"}) {
        const std::string file =
            (std::filesystem::path(run_dir_) / (std::string(name) == "records" ? "metrics.jsonl" : "alerts.jsonl"))
                .string();
        s.Get(std::string("/api/") + name, [file](const httplib::Request& req, httplib::Response& res) {
            size_t offset = 0;
            if (req.has_param("offset")) {
                try {
                    offset = std::stoull(req.get_param_value("offset"));
                } catch (const std::exception&) {
                    res.status = 400;
                    res.set_content("offset: not a number\n", "text/plain");
                    return;
                }
            }
            const auto [records, next] = jsonl_since(file, offset);
            res.set_header("Cache-Control", "no-store");
            res.set_content(fmt::format("{{\"offset\":{},\"records\":{}}}", next, records), "application/json");
        });
    }
    s.Get("/api/run", [this](const httplib::Request&, httplib::Response& res) {
        res.set_content(Json{{"run_dir", run_dir_}, {"live", bool(prometheus_)}}.dump(), "application/json");
    });
    port_ = port == 0 ? s.bind_to_any_port(host) : (s.bind_to_port(host, port) ? port : -1);
    TESSERA_CHECK(port_ > 0, "monitor: cannot listen on {}:{} (in use? choose another --metrics-port)", host, port);
    thread_ = std::thread([this] { server_->listen_after_bind(); });
}

MonitorServer::~MonitorServer() {
    server_->stop();
    if (thread_.joinable()) thread_.join();
}

void MonitorServer::wait() {
    if (thread_.joinable()) thread_.join();
}

}  // namespace tessera::train
