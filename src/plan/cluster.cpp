// Cluster files (see cluster.h).
#include "plan/cluster.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "core/config_reader.h"
#include "core/file.h"
#include "core/json.h"

namespace tessera::plan {

const Link& Cluster::link_for(int64_t size) const {
    for (const Link& l : links)
        if (l.span == 0 || size <= l.span) return l;
    return links.back();
}

const char* op_class_name(OpClass cls) {
    static const char* const names[] = {"gemm", "grouped_gemm", "attention", "kda"};  // OpClass order
    return names[int(cls)];
}

OpClass block_class(const std::string& kind) {
    if (kind == "kda" || kind == "gdn") return OpClass::kda;
    if (kind == "attention" || kind == "mla" || kind == "dsa") return OpClass::attention;
    return OpClass::gemm;
}

const char* collective_name(Collective k) {
    static const char* const names[] = {"all_gather", "reduce_scatter", "all_to_all"};  // Collective order
    return names[int(k)];
}

namespace {
// y at x from the points (xs ascending, ys): linear in log x, held at the ends
double log_interpolate(const std::vector<double>& xs, const std::vector<double>& ys, double x) {
    if (x <= xs.front()) return ys.front();
    if (x >= xs.back()) return ys.back();
    const size_t i = size_t(std::upper_bound(xs.begin(), xs.end(), x) - xs.begin());  // xs[i-1] < x
    const double f = std::log(x / xs[i - 1]) / std::log(xs[i] / xs[i - 1]);
    return ys[i - 1] + f * (ys[i] - ys[i - 1]);
}
}  // namespace

double Cluster::Device::efficiency_at(OpClass cls, double n) const {
    const auto it = efficiency_by_tokens.find(cls);
    if (it == efficiency_by_tokens.end() || tokens.empty()) return efficiency.at(cls);
    return log_interpolate(tokens, it->second, n);
}

double Link::seconds(Collective k, int64_t group, double bytes, double messages) const {
    double bw = bandwidth, lat = latency;
    if (const auto it = bandwidth_by_ranks.find(k); it != bandwidth_by_ranks.end() && !ranks.empty()) {
        bw = log_interpolate(ranks, it->second, double(group));
        lat = log_interpolate(ranks, latency_by_ranks.at(k), double(group));
    }
    return bytes / bw + messages * lat;
}

AlphaBeta fit_alpha_beta(const std::vector<double>& bytes, const std::vector<double>& seconds) {
    TESSERA_CHECK(bytes.size() == seconds.size() && bytes.size() >= 2, "fit_alpha_beta: {} sizes, {} times",
                  bytes.size(), seconds.size());
    // weighted least squares in (α, γ = 1/β), weights 1/t²
    double s = 0, sx = 0, sxx = 0, st = 0, sxt = 0;
    for (size_t i = 0; i < bytes.size(); ++i) {
        TESSERA_CHECK(seconds[i] > 0 && bytes[i] >= 0, "fit_alpha_beta: {} bytes in {} s", bytes[i], seconds[i]);
        const double w = 1.0 / (seconds[i] * seconds[i]), x = bytes[i], t = seconds[i];
        s += w, sx += w * x, sxx += w * x * x, st += w * t, sxt += w * x * t;
    }
    const double det = s * sxx - sx * sx;
    TESSERA_CHECK(det > 0, "fit_alpha_beta: needs two distinct sizes");
    double alpha = (st * sxx - sx * sxt) / det, gamma = (s * sxt - sx * st) / det;
    if (alpha < 0) {  // the line through the smallest and the largest call, α within [0, the fastest call's time]
        const auto [lo, hi] = std::minmax_element(bytes.begin(), bytes.end());
        const double t_lo = seconds[size_t(lo - bytes.begin())], t_hi = seconds[size_t(hi - bytes.begin())];
        gamma = (t_hi - t_lo) / (*hi - *lo);
        alpha = std::clamp(t_lo - *lo * gamma, 0.0, *std::min_element(seconds.begin(), seconds.end()));
    }
    return {alpha, 1.0 / std::max(gamma, 1e-30)};
}

double Cluster::Device::forward_fraction(OpClass cls) const {
    const auto it = forward_share.find(cls);
    return it == forward_share.end() ? 1.0 / 3.0 : it->second;
}

namespace {
// A list of numbers: one-line error naming the key when it is not one.
std::vector<double> numbers(const Json& v, const std::string& where) {
    TESSERA_CHECK(v.is_array() && !v.empty(), "{}: must be a non-empty list of numbers", where);
    std::vector<double> out;
    for (const Json& x : v) {
        TESSERA_CHECK(x.is_number(), "{}: must be a list of numbers", where);
        out.push_back(x.get<double>());
    }
    return out;
}

// A table's axis: ascending numbers of at least `least` (token counts, group sizes).
std::vector<double> ascending(const Json& v, double least, const std::string& where, const char* what) {
    std::vector<double> axis = numbers(v, where);
    for (size_t i = 0; i < axis.size(); ++i)
        TESSERA_CHECK(axis[i] >= least && (i == 0 || axis[i] > axis[i - 1]), "{}: must be ascending {} of at least {}",
                      where, what, least);
    return axis;
}

// The entry of `all` whose name(e) is `key`, or a one-line error listing the names.
template <class E, size_t N>
E named(const E (&all)[N], const char* (*name)(E), const std::string& key, const std::string& where, const char* kind) {
    const E* e = std::find_if(std::begin(all), std::end(all), [&](E x) { return key == name(x); });
    if (e == std::end(all)) {
        std::string names;
        for (E x : all) names += std::string(names.empty() ? "" : ", ") + name(x);
        TESSERA_FAIL("{}: unknown {} {} ({})", where, kind, key, names);
    }
    return *e;
}

// device.efficiency_by_tokens: {"tokens": [ascending], "<class>": [one fraction per token count], ...}
void read_efficiency_table(const Json& t, Cluster::Device& dev, const std::string& where) {
    TESSERA_CHECK(t.is_object() && t.contains("tokens"), "{}: needs \"tokens\" and one list per op class", where);
    dev.tokens = ascending(t["tokens"], 1, where + ".tokens", "counts");
    for (const auto& [key, v] : t.items()) {
        if (key == "tokens") continue;
        const OpClass cls = named(kOpClasses, op_class_name, key, where, "op class");
        std::vector<double> e = numbers(v, where + "." + key);
        TESSERA_CHECK(e.size() == dev.tokens.size(), "{}.{}: {} values for {} token counts", where, key, e.size(),
                      dev.tokens.size());
        for (double x : e) TESSERA_CHECK(x > 0 && x <= 1, "{}.{}: fractions must be in (0, 1] (got {})", where, key, x);
        dev.efficiency_by_tokens[cls] = std::move(e);
    }
}

// links[i].collectives: {"ranks": [ascending group sizes], "<collective>": {"bandwidth_gbs": [...], "latency_us":
// [...]} with one value per group size, ...}
void read_collectives(const Json& t, Link& link, const std::string& where) {
    TESSERA_CHECK(t.is_object() && t.contains("ranks"), "{}: needs \"ranks\" and one entry per collective", where);
    link.ranks = ascending(t["ranks"], 2, where + ".ranks", "group sizes");
    for (const auto& [key, v] : t.items()) {
        if (key == "ranks") continue;
        const Collective k = named(kCollectives, collective_name, key, where, "collective");
        const std::string at = where + "." + key;
        TESSERA_CHECK(v.is_object() && v.contains("bandwidth_gbs") && v.contains("latency_us") && v.size() == 2,
                      "{}: needs bandwidth_gbs and latency_us (one value per group size), nothing else", at);
        std::vector<double> bw = numbers(v["bandwidth_gbs"], at + ".bandwidth_gbs"),
                            lat = numbers(v["latency_us"], at + ".latency_us");
        TESSERA_CHECK(bw.size() == link.ranks.size() && lat.size() == link.ranks.size(),
                      "{}: {} and {} values for {} group sizes", at, bw.size(), lat.size(), link.ranks.size());
        for (size_t i = 0; i < bw.size(); ++i) {
            TESSERA_CHECK(bw[i] > 0 && lat[i] >= 0, "{}: bandwidths must be positive, latencies not negative", at);
            bw[i] *= 1e9;
            lat[i] *= 1e-6;
        }
        link.bandwidth_by_ranks[k] = std::move(bw);
        link.latency_by_ranks[k] = std::move(lat);
    }
}

// device.<key>: {"<class>": value, ...}, each in [lo, hi] (closed) or (lo, hi)
std::map<OpClass, double> per_class(
    ConfigReader& d, const char* key, const std::string& where, double lo, double hi, bool closed) {
    std::map<OpClass, double> out;
    ConfigReader f(d.section(key), where + "." + key);
    for (OpClass cls : kOpClasses) {
        const std::string name = op_class_name(cls);
        if (!f.has(name)) continue;
        const double v = f.number(name, 0);
        TESSERA_CHECK(closed ? v >= lo && v <= hi : v > lo && v < hi, "{}.{}: {} must be in {}{}, {}{} (got {})", where,
                      key, name, closed ? "[" : "(", lo, hi, closed ? "]" : ")", v);
        out[cls] = v;
    }
    f.finish();
    return out;
}

double positive(ConfigReader& r, const std::string& key, const std::string& where) {
    TESSERA_CHECK(r.has(key), "{}: {} is missing", where, key);
    const double v = r.number(key, 0);
    TESSERA_CHECK(v > 0, "{}: {} must be positive (got {})", where, key, v);
    return v;
}
}  // namespace

Cluster load_cluster(const std::string& path) {
    const Json doc = Json::parse(read_text(path), nullptr, false);
    TESSERA_CHECK(doc.is_object(), "{}: not a JSON object (a cluster file, docs/plan.md)", path);
    Cluster c;
    Json rest = doc;  // the links (a list) are read below
    rest.erase("links");
    ConfigReader top(rest, path);
    c.name = top.text("name", path);
    c.source = top.text("source", "");
    c.devices = top.integer("devices", 0);
    TESSERA_CHECK(c.devices >= 1, "{}: devices must be at least 1", path);
    {
        const std::string where = path + ": device";
        ConfigReader d(top.section("device"), where);
        c.device.name = d.text("name", "");
        c.device.memory = positive(d, "memory_gb", where) * 1e9;
        c.device.usable_fraction = d.number("usable_fraction", 0.9);
        TESSERA_CHECK(c.device.usable_fraction > 0 && c.device.usable_fraction <= 1,
                      "{}: usable_fraction must be in (0, 1]", where);
        c.device.reserved = d.number("reserved_gb", 0) * 1e9;
        TESSERA_CHECK(c.device.reserved >= 0 && c.device.reserved < c.device.memory * c.device.usable_fraction,
                      "{}: reserved_gb must be >= 0 and below the usable memory", where);
        {
            const Json& peaks = d.section("peak_tflops");
            TESSERA_CHECK(peaks.is_object() && !peaks.empty(), "{}: peak_tflops needs one dtype at least", where);
            ConfigReader p(peaks, where + ".peak_tflops");
            for (const char* dt : {"f32", "bf16", "fp8"})
                if (p.has(dt)) c.device.peak_flops[dt] = positive(p, dt, where + ".peak_tflops") * 1e12;
            p.finish();
        }
        c.device.compute_dtype = d.choice("compute_dtype", "bf16", {"f32", "bf16", "fp8"});
        TESSERA_CHECK(c.device.peak_flops.count(c.device.compute_dtype), "{}: compute_dtype {} has no peak_tflops",
                      where, c.device.compute_dtype);
        {
            ConfigReader e(d.section("efficiency"), where + ".efficiency");
            for (OpClass cls : kOpClasses) {
                const std::string key = op_class_name(cls);
                const double v = e.number(key, 0.5);
                TESSERA_CHECK(v > 0 && v <= 1, "{}.efficiency: {} must be in (0, 1] (got {})", where, key, v);
                c.device.efficiency[cls] = v;
            }
            e.finish();
        }
        if (d.has("efficiency_by_tokens"))
            read_efficiency_table(d.section("efficiency_by_tokens"), c.device, where + ".efficiency_by_tokens");
        c.device.forward_share = per_class(d, "forward_share", where, 0, 1, false);
        c.device.beside_fsdp = per_class(d, "beside_fsdp", where, 0, 2, true);
        c.device.tensor_shared = per_class(d, "tensor_shared", where, 0, 2, true);
        c.device.memory_bandwidth = positive(d, "memory_bandwidth_gbs", where) * 1e9;
        c.device.threads = d.integer("threads", 0);
        TESSERA_CHECK(c.device.threads >= 0, "{}: threads must not be negative", where);
        d.finish();
    }
    {
        const std::string where = path + ": host";
        ConfigReader h(top.section("host"), where);
        c.host.devices = h.integer("devices", 1);
        TESSERA_CHECK(c.host.devices >= 1 && c.devices % c.host.devices == 0,
                      "{}: devices ({}) must divide the cluster's {}", where, c.host.devices, c.devices);
        c.host.memory = h.number("memory_gb", 0) * 1e9;
        c.host.disk = h.number("disk_gb", 0) * 1e9;
        c.host.link_bandwidth = h.number("link_bandwidth_gbs", 0) * 1e9;
        c.host.offload_bandwidth = h.number("offload_bandwidth_gbs", 0) * 1e9;
        c.host.read_bandwidth = h.number("read_bandwidth_gbs", 0) * 1e9;
        TESSERA_CHECK(c.host.memory >= 0 && c.host.disk >= 0 && c.host.link_bandwidth >= 0 &&
                          c.host.offload_bandwidth >= 0 && c.host.read_bandwidth >= 0,
                      "{}: sizes must not be negative", where);
        h.finish();
    }
    {
        TESSERA_CHECK(doc.contains("links") && doc["links"].is_array() && !doc["links"].empty(),
                      "{}: links must be a list of levels (innermost first), one at least", path);
        int64_t prev = 0;
        for (size_t i = 0; i < doc["links"].size(); ++i) {
            const std::string where = fmt::format("{}: links[{}]", path, i);
            Json l = doc["links"][i];
            TESSERA_CHECK(l.is_object(), "{}: not an object", where);
            Link link;
            if (l.contains("collectives")) {
                read_collectives(l["collectives"], link, where + ".collectives");
                l.erase("collectives");
            }
            ConfigReader r(l, where);
            link.name = r.text("name", fmt::format("level {}", i));
            link.span = r.integer("span", 0);
            link.bandwidth = positive(r, "bandwidth_gbs", where) * 1e9;
            link.latency = r.number("latency_us", 0) * 1e-6;
            TESSERA_CHECK(link.span >= 0 && link.latency >= 0, "{}: span and latency_us must not be negative", where);
            TESSERA_CHECK(link.span == 0 || link.span > prev, "{}: span {} must grow level by level", where, link.span);
            TESSERA_CHECK(link.span == 0 || c.devices % link.span == 0 || link.span >= c.devices,
                          "{}: span {} must divide the cluster's {} devices", where, link.span, c.devices);
            r.finish();
            prev = link.span == 0 ? c.devices : link.span;
            c.links.push_back(link);
        }
    }
    top.finish();
    return c;
}

}  // namespace tessera::plan
