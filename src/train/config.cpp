// Run config parsing, validation and serialisation.
#include "train/config.h"

#include <cmath>

#include "core/check.h"
#include "core/file.h"
#include "train/demo_config.h"

namespace tessera::train {

std::array<std::pair<const char*, AlertRule*>, 6> alert_rules(MonitorConfig& m) {
    return {{{"nonfinite", &m.nonfinite},
             {"loss_spike", &m.loss_spike},
             {"expert_overload", &m.expert_overload},
             {"straggler", &m.straggler},
             {"memory", &m.memory},
             {"throughput", &m.throughput}}};
}

std::array<std::pair<const char*, const AlertRule*>, 6> alert_rules(const MonitorConfig& m) {
    std::array<std::pair<const char*, const AlertRule*>, 6> out;
    const auto rules = alert_rules(const_cast<MonitorConfig&>(m));
    std::copy(rules.begin(), rules.end(), out.begin());
    return out;
}

namespace {
void check_rule(const AlertRule& r, const std::string& where) {
    TESSERA_CHECK(std::isfinite(r.threshold) && r.threshold >= 0 && r.threshold <= 1e12,
                  "{}.threshold must be a finite number >= 0", where);
    TESSERA_CHECK(r.steps >= 1 && r.steps <= 1000000, "{}.steps must be in [1, 1000000]", where);
    TESSERA_CHECK(r.window >= 0 && r.window <= 1000000, "{}.window must be in [0, 1000000]", where);
}
}  // namespace

RunConfig parse_run_config(const Json& doc, const std::string& where) {
    TESSERA_CHECK(doc.is_object(), "{}: the config must be a JSON object, not {}", where, doc.type_name());
    ConfigReader top(doc, where);
    RunConfig c;
    c.model = model::parse_model_config(top.section("model"), where + ": model");
    ConfigReader t(top.section("train"), where + ": train");
    TrainConfig d;
    TrainConfig& tc = c.train;
    tc.seq_len = t.integer("seq_len", d.seq_len);
    tc.batch_size = t.integer("batch_size", d.batch_size);
    tc.steps = t.integer("steps", d.steps);
    TESSERA_CHECK(!t.has("grad_accum"),
                  "{}: train.grad_accum is gone: train.batch_size is the global batch (sequences per optimizer step) "
                  "and train.micro_batch_size the sequences per forward on each rank; accumulation follows",
                  where);
    tc.micro_batch_size = t.integer("micro_batch_size", d.micro_batch_size);
    tc.lr = t.number("lr", d.lr);
    tc.min_lr_ratio = t.number("min_lr_ratio", d.min_lr_ratio);
    tc.warmup_steps = t.integer("warmup_steps", d.warmup_steps);
    tc.schedule = t.choice("schedule", d.schedule, {"cosine", "wsd", "constant"});
    tc.decay_fraction = t.number("decay_fraction", d.decay_fraction);
    tc.weight_decay = t.number("weight_decay", d.weight_decay);
    tc.beta1 = t.number("beta1", d.beta1);
    tc.beta2 = t.number("beta2", d.beta2);
    tc.eps = t.number("eps", d.eps);
    tc.grad_clip = t.number("grad_clip", d.grad_clip);
    tc.eval_interval = t.integer("eval_interval", d.eval_interval);
    tc.eval_batches = t.integer("eval_batches", d.eval_batches);
    tc.checkpoint_interval = t.integer("checkpoint_interval", d.checkpoint_interval);
    tc.log_interval = t.integer("log_interval", d.log_interval);
    tc.seed = uint64_t(t.integer("seed", int64_t(d.seed)));
    tc.recompute = t.parsed("recompute", d.recompute, model::Recompute::from_json);
    tc.device = t.choice("device", d.device, {"cpu", "cuda"});
    tc.precision = t.choice("precision", d.precision, {"f32", "bf16"});
    tc.activation_dtype =
        t.choice("activation_dtype", std::string(dtype_name(d.activation_dtype)), {"f32", "bf16"}) == "bf16"
            ? DType::bf16
            : DType::f32;
    tc.async_checkpoints = t.boolean("async_checkpoints", d.async_checkpoints);
    tc.base = t.text("base", d.base);
    t.finish();
    ConfigReader dr(top.section("data"), where + ": data");
    c.data.path = dr.text("path", "");
    c.data.val_fraction = dr.number("val_fraction", c.data.val_fraction);
    c.data.mask_documents = dr.boolean("mask_documents", c.data.mask_documents);
    dr.finish();
    ConfigReader pr(top.section("parallel"), where + ": parallel");
    c.parallel.fsdp = pr.boolean("fsdp", c.parallel.fsdp);
    c.parallel.shard = pr.integer("shard", c.parallel.shard);
    c.parallel.ep = pr.integer("ep", c.parallel.ep);
    c.parallel.ep_chunks = pr.integer("ep_chunks", c.parallel.ep_chunks);
    c.parallel.link_delay_ns_per_byte = pr.number("link_delay_ns_per_byte", c.parallel.link_delay_ns_per_byte);
    c.parallel.pipeline = pr.integer("pipeline", c.parallel.pipeline);
    c.parallel.tensor = pr.integer("tensor", c.parallel.tensor);
    c.parallel.pipeline_rerun = pr.boolean("pipeline_rerun", c.parallel.pipeline_rerun);
    c.parallel.pipeline_split =
        pr.parsed("pipeline_split", c.parallel.pipeline_split, [](const Json& v, const std::string& at) {
            TESSERA_CHECK(v.is_array(), "{} must be a list of layer indices", at);
            std::vector<int64_t> out;
            for (const Json& x : v) {
                TESSERA_CHECK(x.is_number_integer(), "{} must be a list of layer indices", at);
                out.push_back(x.get<int64_t>());
            }
            return out;
        });
    pr.finish();
    ConfigReader mr(top.section("memory"), where + ": memory");
    c.memory.weights_budget = mr.integer("weights_budget", c.memory.weights_budget);
    c.memory.optimizer_offload = mr.boolean("optimizer_offload", c.memory.optimizer_offload);
    c.memory.offload_dir = mr.text("offload_dir", c.memory.offload_dir);
    c.memory.offload_window_mib = mr.number("offload_window_mib", c.memory.offload_window_mib);
    c.memory.weight_copies = mr.boolean("weight_copies", c.memory.weight_copies);
    mr.finish();
    ConfigReader on(top.section("monitor"), where + ": monitor");
    MonitorConfig& mon = c.monitor;
    mon.metrics_port = on.integer("metrics_port", mon.metrics_port);
    mon.webhook = on.text("webhook", mon.webhook);
    mon.watchdog_seconds = on.number("watchdog_seconds", mon.watchdog_seconds);
    ConfigReader al(on.section("alerts"), where + ": monitor.alerts");
    for (auto [name, rule] : alert_rules(mon)) {
        ConfigReader rr(al.section(name), where + ": monitor.alerts." + name);
        rule->threshold = rr.number("threshold", rule->threshold);
        rule->steps = rr.integer("steps", rule->steps);
        rule->window = rr.integer("window", rule->window);
        rule->action =
            rr.choice("action", rule->action,
                      std::string(name) == "nonfinite" ? std::set<std::string>{"skip", "stop"}
                                                       : std::set<std::string>{"warn", "checkpoint", "stop"});
        rr.finish();
        check_rule(*rule, where + ": monitor.alerts." + name);
    }
    al.finish();
    on.finish();
    top.finish();

    auto check = [&](bool ok, const std::string& what) { TESSERA_CHECK(ok, "{}: {}", where, what); };
    check(tc.seq_len > 0, "train.seq_len must be positive");
    check(tc.batch_size > 0, "train.batch_size must be positive");
    check(tc.steps >= 0, "train.steps must be >= 0");
    check(tc.micro_batch_size >= 0, "train.micro_batch_size must be >= 0 (0 = batch_size / ranks)");
    check(tc.micro_batch_size == 0 || tc.batch_size % tc.micro_batch_size == 0,
          fmt::format("train.batch_size {} is not a multiple of train.micro_batch_size {}", tc.batch_size,
                      tc.micro_batch_size));
    check(tc.lr > 0, "train.lr must be positive");
    check(tc.min_lr_ratio >= 0 && tc.min_lr_ratio <= 1, "train.min_lr_ratio must be in [0, 1]");
    check(tc.warmup_steps >= 0, "train.warmup_steps must be >= 0");
    check(tc.decay_fraction > 0 && tc.decay_fraction <= 1, "train.decay_fraction must be in (0, 1]");
    check(tc.weight_decay >= 0, "train.weight_decay must be >= 0");
    check(tc.beta1 >= 0 && tc.beta1 < 1 && tc.beta2 >= 0 && tc.beta2 < 1,
          "train.beta1 and train.beta2 must be in [0, 1)");
    check(tc.eps > 0, "train.eps must be positive");
    check(tc.grad_clip >= 0, "train.grad_clip must be >= 0 (0 = off)");
    check(tc.eval_interval >= 0 && tc.eval_batches >= 0, "train.eval_interval and train.eval_batches must be >= 0");
    check(tc.checkpoint_interval >= 0, "train.checkpoint_interval must be >= 0");
    check(tc.log_interval >= 1, "train.log_interval must be >= 1");
    check(c.data.val_fraction >= 0 && c.data.val_fraction < 1, "data.val_fraction must be in [0, 1)");
    check(c.memory.weights_budget >= 0 && c.memory.weights_budget <= (int64_t(1) << 40),
          "memory.weights_budget must be a number of MiB >= 0 (0 = the whole base in memory)");
    check(c.memory.weights_budget == 0 || (c.model.lora.enabled() && !tc.base.empty()),
          "memory.weights_budget needs a LoRA fine-tune of a base (train.base and model.lora): only a frozen base is "
          "read in place");
    check(c.memory.offload_window_mib >= 1.0 / 256 && c.memory.offload_window_mib <= 65536,
          "memory.offload_window_mib must be in [1/256, 65536] (MiB of each moment streamed at a time)");
    check(mon.metrics_port >= 0 && mon.metrics_port <= 65535, "monitor.metrics_port must be in [0, 65535] (0 = off)");
    check(mon.webhook.empty() || mon.webhook.starts_with("http://"),
          "monitor.webhook must be an http:// URL (or empty)");
    check(std::isfinite(mon.watchdog_seconds) && mon.watchdog_seconds >= 0 && mon.watchdog_seconds <= 1e7,
          "monitor.watchdog_seconds must be in [0, 1e7] (0 = off)");
    check(c.parallel.ep >= 1 && c.parallel.ep <= (int64_t(1) << 16), "parallel.ep must be in [1, 65536]");
    check(c.parallel.shard == 0 || (c.parallel.shard >= 2 && c.parallel.shard <= (int64_t(1) << 20)),
          "parallel.shard must be 0 (every rank) or a number of ranks in [2, 1048576]");
    check(c.parallel.ep_chunks >= 1 && c.parallel.ep_chunks <= 1024, "parallel.ep_chunks must be in [1, 1024]");
    check(std::isfinite(c.parallel.link_delay_ns_per_byte) && c.parallel.link_delay_ns_per_byte >= 0 &&
              c.parallel.link_delay_ns_per_byte <= 1e6,
          "parallel.link_delay_ns_per_byte must be in [0, 1e6]");
    check(c.parallel.tensor >= 1 && c.parallel.tensor <= 1024, "parallel.tensor must be in [1, 1024]");
    check(c.parallel.tensor == 1 || tc.seq_len % c.parallel.tensor == 0,
          fmt::format("parallel.tensor = {} does not divide train.seq_len = {} (each rank keeps 1/{} of the tokens)",
                      c.parallel.tensor, tc.seq_len, c.parallel.tensor));
    check(c.parallel.pipeline >= 1 && c.parallel.pipeline <= c.model.n_layers,
          fmt::format("parallel.pipeline must be in [1, {}] (stages of at least one layer)", c.model.n_layers));
    const std::vector<int64_t>& split = c.parallel.pipeline_split;
    check(split.empty() || int64_t(split.size()) == c.parallel.pipeline - 1,
          fmt::format("parallel.pipeline_split names {} stage starts; {} stages need {}", split.size(),
                      c.parallel.pipeline, c.parallel.pipeline - 1));
    for (size_t i = 0; i < split.size(); ++i)
        check(split[i] > (i ? split[i - 1] : 0) && split[i] < c.model.n_layers,
              fmt::format("parallel.pipeline_split must be increasing layers in [1, {}) (each stage's first)",
                          c.model.n_layers));
    auto bounded = [&](int64_t v, int64_t hi, const char* key) {
        TESSERA_CHECK(v <= hi, "{}: train.{} = {} must be at most {}", where, key, v, hi);
    };
    bounded(tc.seq_len, model::kMaxSeqLen, "seq_len");
    bounded(tc.batch_size, kMaxBatch, "batch_size");
    bounded(tc.steps, kMaxSteps, "steps");
    bounded(tc.warmup_steps, kMaxSteps, "warmup_steps");
    bounded(tc.eval_interval, kMaxSteps, "eval_interval");
    bounded(tc.eval_batches, kMaxBatch, "eval_batches");
    bounded(tc.checkpoint_interval, kMaxSteps, "checkpoint_interval");
    bounded(tc.log_interval, kMaxSteps, "log_interval");
    check(tc.seed <= uint64_t(INT64_MAX), "train.seed must be >= 0");  // read as int64: -1 became 2^64 - 1
    // keys nothing reads in this configuration (see model/config.cpp): an error unless at their default
    auto unread = [&](bool set, const std::string& key, const std::string& why) {
        TESSERA_CHECK(!set, "{}: {} is set but {}; remove it", where, key, why);
    };
    unread(tc.decay_fraction != d.decay_fraction && tc.schedule != "wsd", "train.decay_fraction",
           "train.schedule is not \"wsd\"");
    unread(tc.min_lr_ratio != d.min_lr_ratio && tc.schedule == "constant", "train.min_lr_ratio",
           "train.schedule is \"constant\"");
    unread(tc.eval_batches != d.eval_batches && c.data.val_fraction == 0, "train.eval_batches",
           "data.val_fraction = 0 (nothing to evaluate)");
    unread(tc.eval_interval != d.eval_interval && c.data.val_fraction == 0, "train.eval_interval",
           "data.val_fraction = 0 (nothing to evaluate)");
    unread(c.parallel.shard != 0 && !c.parallel.fsdp, "parallel.shard",
           "parallel.fsdp is false (ZeRO-2 has no shard groups)");
    unread(c.parallel.ep != 1 && c.model.moe.experts == 0, "parallel.ep", "the model has no MoE layers");
    return c;
}

model::LayerRange ParallelConfig::stage_layers(int64_t stage, int64_t n_layers) const {
    const auto first = [&](int64_t s) {
        if (s == 0) return int64_t(0);
        if (s == pipeline) return n_layers;
        return pipeline_split.empty() ? s * n_layers / pipeline : pipeline_split[size_t(s - 1)];
    };
    return {first(stage), first(stage + 1)};
}

Json to_json(const RunConfig& c) {
    const TrainConfig& t = c.train;
    Json train = {{"seq_len", t.seq_len},
                  {"batch_size", t.batch_size},
                  {"steps", t.steps},
                  {"micro_batch_size", t.micro_batch_size},
                  {"lr", t.lr},
                  {"min_lr_ratio", t.min_lr_ratio},
                  {"warmup_steps", t.warmup_steps},
                  {"schedule", t.schedule},
                  {"decay_fraction", t.decay_fraction},
                  {"weight_decay", t.weight_decay},
                  {"beta1", t.beta1},
                  {"beta2", t.beta2},
                  {"eps", t.eps},
                  {"grad_clip", t.grad_clip},
                  {"eval_interval", t.eval_interval},
                  {"eval_batches", t.eval_batches},
                  {"checkpoint_interval", t.checkpoint_interval},
                  {"log_interval", t.log_interval},
                  {"seed", t.seed},
                  {"recompute", t.recompute.to_json()},
                  {"device", t.device},
                  {"precision", t.precision},
                  {"activation_dtype", dtype_name(t.activation_dtype)},
                  {"async_checkpoints", t.async_checkpoints},
                  {"base", t.base}};
    Json alerts = Json::object();
    for (auto [name, rule] : alert_rules(c.monitor))
        alerts[name] = {
            {"threshold", rule->threshold}, {"steps", rule->steps}, {"window", rule->window}, {"action", rule->action}};
    Json monitor = {{"metrics_port", c.monitor.metrics_port},
                    {"webhook", c.monitor.webhook},
                    {"watchdog_seconds", c.monitor.watchdog_seconds},
                    {"alerts", alerts}};
    Json data = {
        {"path", c.data.path}, {"val_fraction", c.data.val_fraction}, {"mask_documents", c.data.mask_documents}};
    return Json{{"model", model::to_json(c.model)},
                {"train", train},
                {"data", data},
                {"parallel",
                 {{"fsdp", c.parallel.fsdp},
                  {"shard", c.parallel.shard},
                  {"ep", c.parallel.ep},
                  {"ep_chunks", c.parallel.ep_chunks},
                  {"link_delay_ns_per_byte", c.parallel.link_delay_ns_per_byte},
                  {"pipeline", c.parallel.pipeline},
                  {"tensor", c.parallel.tensor},
                  {"pipeline_split", c.parallel.pipeline_split},
                  {"pipeline_rerun", c.parallel.pipeline_rerun}}},
                {"memory",
                 {{"weights_budget", c.memory.weights_budget},
                  {"optimizer_offload", c.memory.optimizer_offload},
                  {"offload_dir", c.memory.offload_dir},
                  {"offload_window_mib", c.memory.offload_window_mib},
                  {"weight_copies", c.memory.weight_copies}}},
                {"monitor", monitor}};
}

int64_t TrainConfig::micro_batch(int ranks) const {
    const int64_t micro = micro_batch_size ? micro_batch_size : batch_size / ranks;
    TESSERA_CHECK(micro >= 1 && batch_size % (micro * ranks) == 0,
                  "train.batch_size {} does not split over {} ranks{}: it must be a multiple of ranks x "
                  "micro_batch_size",
                  batch_size, ranks, micro_batch_size ? fmt::format(" in micro-batches of {}", micro_batch_size) : "");
    return micro;
}

int64_t TrainConfig::accumulation(int ranks) const { return batch_size / (micro_batch(ranks) * ranks); }

Json demo_config_json() {
    Json j = Json::parse(kDemoConfigJson, nullptr, false);
    TESSERA_CHECK(!j.is_discarded(), "the built-in demo config is not valid JSON");
    return j;
}

Json load_config_json(const std::string& path, const std::vector<std::string>& overrides) {
    Json doc;
    if (path.empty()) {
        doc = demo_config_json();
    } else {
        doc = parse_json(read_text(path, kMaxConfigBytes), path);
        TESSERA_CHECK(doc.is_object(), "{}: the config must be a JSON object, not {}", path, doc.type_name());
    }
    for (const auto& o : overrides) apply_override(doc, o);
    return doc;
}

std::string bundled_corpus_path() { return TESSERA_SOURCE_DIR "/data/corpus"; }

}  // namespace tessera::train
