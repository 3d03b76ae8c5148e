// The training loop (see trainer.h).
#include "train/trainer.h"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <cmath>
#include <filesystem>
#include <numbers>
#include <optional>
#include <set>

#include "core/check.h"
#include "core/device.h"
#include "core/file.h"
#include "core/rng.h"
#include "core/trace.h"
#include "model/hf_config.h"
#include "model/image_input.h"
#include "ops/backend.h"
#include "ops/gemm.h"
#include "ops/isa.h"
#include "ops/linear.h"
#include "parallel/comm_mpi.h"
#include "parallel/nccl_link.h"
#include "train/alerts.h"
#include "train/checkpoint.h"
#include "train/data/loader.h"
#include "train/fault.h"
#include "train/metrics.h"
#include "train/model_source.h"
#include "train/monitor_server.h"
#include "train/optimizer.h"
#include "train/rank_state.h"
#include "train/schedule.h"
#include "train/weight_budget.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {
using Clock = std::chrono::steady_clock;

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

std::string default_out_dir() {
    auto t = std::time(nullptr);
    char buf[32];
    std::strftime(buf, sizeof buf, "%Y%m%d-%H%M%S", std::localtime(&t));
    return std::string("runs/") + buf;
}

struct Setup {
    Json config_json;
    RunConfig cfg;
    std::string checkpoint;  // resuming from, or empty
    std::string out_dir;
    std::vector<std::string> cleaned;  // what killed runs left, removed or restored (clean_stale_temporaries)
    std::optional<ModelSource> base;   // train.base: the weights a fine-tune starts from (with LoRA: keeps frozen)
};

// The model section that must not change on --resume: everything but the DSA training stage and KL weight,
// which move from the dense warm-up to the sparse stage on the same checkpoint (spec/dsa.md §3.1).
Json fixed_model_json(const model::ModelConfig& m) {
    Json j = model::to_json(m);
    if (j.contains("mla") && j["mla"].contains("dsa")) {
        j["mla"]["dsa"].erase("stage");
        j["mla"]["dsa"].erase("kl_coeff");
    }
    return j;
}

// A fresh run that fails before its first checkpoint removes what it wrote (config.json, metrics.jsonl,
// alerts.jsonl, trace.json, the directory when it made it and nothing else is there): it is not a run --resume could
// continue.
class FreshRunGuard {
  public:
    FreshRunGuard(std::string dir, bool fresh) : dir_(std::move(dir)), active_(fresh), made_(!fs::exists(dir_)) {}
    FreshRunGuard(const FreshRunGuard&) = delete;
    void dismiss() { active_ = false; }
    ~FreshRunGuard() {
        if (!active_ || std::uncaught_exceptions() == 0) return;
        std::error_code ec;
        fs::remove(fs::path(dir_) / "config.json", ec);
        fs::remove(fs::path(dir_) / "metrics.jsonl", ec);
        fs::remove(fs::path(dir_) / "alerts.jsonl", ec);
        fs::remove(fs::path(dir_) / "trace.json", ec);
        if (fs::is_empty(fs::path(dir_) / "checkpoints", ec)) fs::remove(fs::path(dir_) / "checkpoints", ec);
        if (made_ && fs::is_empty(dir_, ec)) fs::remove(dir_, ec);
    }

  private:
    std::string dir_;
    bool active_, made_;
};

// lead: the rank that writes (rank 0): only it cleans up after killed runs.
Setup resolve_setup(const TrainOptions& o, bool lead) {
    Setup s;
    if (!o.resume_dir.empty()) {
        TESSERA_CHECK(
            o.config_path.empty(),
            "--resume takes the config from the checkpoint; drop --config (use --set or --steps for changes)");
        if (lead && fs::is_directory(fs::path(o.resume_dir) / "checkpoints"))
            s.cleaned = clean_stale_temporaries(o.resume_dir);
        s.checkpoint = resolve_checkpoint(o.resume_dir);
        Json base = load_checkpoint_config(s.checkpoint);
        const std::string where = (fs::path(s.checkpoint) / "config.json").string();
        RunConfig before = parse_run_config(base, where);
        for (const auto& ov : o.overrides) apply_override(base, ov);
        s.config_json = base;
        s.cfg = parse_run_config(base, where + " with --set");
        TESSERA_CHECK(fixed_model_json(before.model) == fixed_model_json(s.cfg.model),
                      "--resume: model.* cannot change when resuming from {} (only model.mla.dsa.stage and kl_coeff)",
                      s.checkpoint);
        s.out_dir = o.out_dir.empty() ? fs::path(s.checkpoint).parent_path().parent_path().string() : o.out_dir;
        if (s.cfg.model.has_frozen_params() && !s.cfg.train.base.empty()) s.base = open_model_source(s.cfg.train.base);
    } else {
        s.config_json = load_config_json(o.config_path, o.overrides);
        TESSERA_CHECK(!model::is_hf_config(s.config_json),
                      "{} is a Hugging Face config: train takes a tessera run config (docs/config.md); to fine-tune "
                      "a Hugging Face checkpoint, name its directory: --set train.base=DIR",
                      o.config_path);
        const std::string where = o.config_path.empty() ? "demo config" : o.config_path;
        const Json* train = s.config_json.contains("train") ? &s.config_json["train"] : nullptr;
        if (train && train->is_object() && train->contains("base") && (*train)["base"].is_string() &&
            !(*train)["base"].get<std::string>().empty()) {
            const std::string path = fs::absolute((*train)["base"].get<std::string>()).lexically_normal().string();
            s.base = open_model_source(path);
            // the run names its base (a run directory: the checkpoint that is its latest now) wherever it resumes from
            s.config_json["train"]["base"] = s.base->path;
            s.config_json["model"] = base_model_json(
                *s.base, s.config_json.contains("model") ? s.config_json["model"] : Json::object(), where);
        }
        s.cfg = parse_run_config(s.config_json, where);
        TESSERA_CHECK(!s.cfg.model.vision.enabled() || s.base,
                      "{}: model.vision's image tower is frozen and its weights come from train.base (a Kimi K3 "
                      "checkpoint), but none is named",
                      where);
        s.out_dir = o.out_dir.empty() ? default_out_dir() : o.out_dir;
        TESSERA_CHECK(!fs::exists(s.out_dir) || fs::is_directory(s.out_dir), "--out {}: exists and is not a directory",
                      s.out_dir);
        if (lead) s.cleaned = clean_stale_temporaries(s.out_dir);
        // NOTES: only a checkpoint makes a run (--resume needs one); what a run that stopped before its first
        // checkpoint left behind (config.json, metrics.jsonl) is replaced, or the same command could never run
        // again: "already holds a run", and --resume "not a run".
        TESSERA_CHECK(!holds_checkpoint(s.out_dir),
                      "{} already holds a run; continue it with --resume {} or choose another --out", s.out_dir,
                      s.out_dir);
    }
    if (o.steps) {
        TESSERA_CHECK(*o.steps >= 0, "--steps must be >= 0");
        s.cfg.train.steps = *o.steps;
    }
    s.config_json = to_json(s.cfg);  // the effective config, defaults filled in
    return s;
}
}  // namespace

ParamRanges param_ranges(const AdamW& opt, model::ModelRuntime& rt, Fsdp* fsdp) {
    ParamRanges p = opt.ranges_of(rt.params());
    for (int r = 0; r < int(AdamW::kRegions); ++r)
        if (fsdp && fsdp->holds(r)) p.region[size_t(r)] = fsdp->shard(r);
    return p;
}

StepResult train_step(model::Model& model,
                      model::ModelRuntime& rt,
                      AdamW& opt,
                      GradientSum& grads,
                      const TrainConfig& tc,
                      int64_t step,
                      const BatchSource& next_batch,
                      std::span<int32_t> ids,
                      std::span<int32_t> targets,
                      parallel::Comm* comm,
                      Fsdp* fsdp,
                      int64_t step_targets,
                      StepOptions so) {
    StepResult r;
    r.lr = learning_rate(tc, step);
    const int64_t micros = grads.accumulation(), ranks = comm ? comm->size() : 1;
    const int64_t groups = ranks / so.tensor;  // the ranks taking micro-batches of their own
    auto t = Clock::now();
    auto lap = [&t](double& phase) {  // adds the time since the last lap to a phase
        const auto now = Clock::now();
        phase += std::chrono::duration<double>(now - t).count();
        t = now;
    };
    // micro-batch m's LoRA dropout masks and loss scale (before each pass over it)
    auto prepare = [&](int64_t micro, std::span<const int32_t> tgt) {
        if (model.config().lora.dropout > 0) {  // the masks of the step's (micro · ranks + rank)-th micro-batch
            const uint64_t at =
                uint64_t(step) * uint64_t(micros * ranks) + uint64_t(micro * ranks + (comm ? comm->rank() : 0));
            const auto b = RandomStream{tc.seed, 0x10a0d40ull}.bits(at);  // counter-based, no allocation
            model.set_lora_seed((uint64_t(b[0]) << 32 | b[1]) | 1);
        }
        // the step's loss: the mean over every micro-batch, or over every counted target of the step
        if (step_targets == 0) return 1.0 / double(micros * groups);
        const int64_t n =
            std::count_if(tgt.begin(), tgt.end(), [](int32_t t) { return t != model::Model::kIgnoreIndex; });
        return double(n) / double(step_targets);
    };
    auto before = [&](int64_t micro) {
        trace::Span span("gradient wait", "wait");
        grads.before(micro, rt.grads());
    };
    auto after = [&](int64_t micro) {
        trace::Span span("gradient reduction", "wait");
        grads.after(micro, rt.grads());
    };
    if (so.pipeline) {
        auto timed = [&](auto& f) {
            return [&](int64_t micro) {
                const auto t0 = Clock::now();
                f(micro);
                r.phases.communication += seconds_since(t0);
            };
        };
        const auto load = [&](int64_t, std::span<int32_t> i, std::span<int32_t> t) {
            trace::Span span("data", "step");
            return next_batch(i, t);
        };
        r.loss = so.pipeline->run(load, prepare, timed(before), timed(after), step_targets > 0, r.phases);
        t = Clock::now();
    }
    double ignored = 0;
    for (int64_t micro = 0; micro < (so.pipeline ? 0 : micros); ++micro) {
        before(micro);
        lap(r.phases.communication);  // (waits for the previous micro-batch's reductions)
        model::StepShape shape;
        {
            trace::Span span("data", "step");
            shape = next_batch(ids, targets);
        }
        lap(r.phases.data);
        const double scale = prepare(micro, targets);
        r.loss += model.forward_backward(shape, ids, targets, scale).loss * (step_targets > 0 ? scale : 1.0);
        lap(ignored);  // compute (the step's rest)
        after(micro);
        lap(r.phases.communication);
    }
    const GradRanges g = [&] {
        trace::Span span("gradient reduction", "wait");
        if (comm && comm->rank() % so.tensor != 0) r.loss = 0;  // (a tensor group's ranks: the same micro-batches)
        if (ranks > 1) r.loss = comm->all_reduce_sum(r.loss);   // in rank order, as one rank would add them
        if (so.pipeline) r.loss = so.pipeline->from_last(r.loss);
        if (step_targets == 0) r.loss /= double(micros * groups);
        return grads.finish(rt.grads());  // this rank's ranges of the summed gradient
    }();
    lap(r.phases.communication);
    trace::Span optimizer("optimizer", "step");
    r.grad_norm = opt.grad_norm(g);
    if (so.poison) r.grad_norm = std::numeric_limits<double>::quiet_NaN();
    // before the update: a non-finite gradient would make every weight NaN, and the next checkpoint with them
    r.skipped = !std::isfinite(r.loss) || !std::isfinite(r.grad_norm);
    TESSERA_CHECK(!r.skipped || so.skip_nonfinite,
                  "training diverged at step {}: the loss is {}, the gradient norm {} (lower train.lr?)", step + 1,
                  r.loss, r.grad_norm);
    if (!r.skipped) {  // (every rank agrees: the loss and the norm are the group's)
        opt.clip(g, r.grad_norm, tc.grad_clip);
        opt.update(tc, param_ranges(opt, rt, fsdp), g, r.lr, model.trainable_mask());  // DSA warm-up: indexers only
        opt.share_params(rt.params(), /*fsdp=*/fsdp != nullptr);
        if (fsdp) fsdp->invalidate();
        if (so.copies) so.copies->refresh();
        // after the step, from the whole step's routing (spec/moe.md §3.1), summed over ranks
        if (ranks > 1)
            model.update_moe_bias([comm](std::span<int64_t> counts) { comm->all_reduce(counts); });
        else
            model.update_moe_bias();
    }
    lap(r.phases.optimizer);
    r.stats = model.take_step_stats();
    if (so.pipeline) r.stats = so.pipeline->all_stages(*r.stats);  // (every stage's layers)
    r.moe = r.stats->moe;
    r.dsa = r.stats->dsa;
    r.global_aux_loss = model.take_global_aux_loss();
    return r;
}

TrainSummary train(const TrainOptions& opts) {
    parallel::Comm* comm = opts.comm && opts.comm->size() > 1 ? opts.comm : nullptr;
    const int ranks = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
    const bool lead = rank == 0;  // logs, writes metrics and the run directory
    std::ostream* log = lead ? opts.log : nullptr;
    Setup setup = resolve_setup(opts, lead);
    if (comm) setup.out_dir = comm->broadcast_text(setup.out_dir, 0);  // a default name has rank 0's clock
    const RunConfig& cfg = setup.cfg;
    const TrainConfig& tc = cfg.train;
    auto note = [&](const std::string& s) {
        if (log) *log << s << '\n' << std::flush;
    };
    // parallel.pipeline: the ranks in stages; each stage's data-parallel ranks (dranks) share the batch
    const int64_t stages = cfg.parallel.pipeline;
    TESSERA_CHECK(stages == 1 || ranks > 1,
                  "parallel.pipeline = {} needs several ranks (mpirun -n W, W a multiple of "
                  "it)",
                  stages);
    TESSERA_CHECK(ranks % stages == 0, "parallel.pipeline = {} does not divide the {} ranks into stages", stages,
                  ranks);
    const int dranks = ranks / int(stages), drank = rank % dranks;
    // parallel.tensor: the stage's ranks in tensor groups of tp; each group (gdata of them) takes its own micro-batches
    const int tp = int(cfg.parallel.tensor);
    TESSERA_CHECK(tp == 1 || ranks > 1, "parallel.tensor = {} needs several ranks (mpirun -n W, W a multiple of it)",
                  tp);
    TESSERA_CHECK(dranks % tp == 0, "parallel.tensor = {} does not divide the {} ranks{} into tensor groups", tp,
                  dranks, stages > 1 ? " of a pipeline stage" : "");
    const int gdata = dranks / tp, gdrank = drank / tp;
    const int64_t micro = tc.micro_batch(gdata), accumulation = tc.accumulation(gdata);
    TESSERA_CHECK(cfg.parallel.ep == 1 || ranks > 1,
                  "parallel.ep = {} needs several ranks (mpirun -n W, W a multiple of "
                  "it)",
                  cfg.parallel.ep);
    TESSERA_CHECK(cfg.parallel.shard == 0 || ranks > 1,
                  "parallel.shard = {} needs several ranks (mpirun -n W, W a multiple of it)", cfg.parallel.shard);
    const Device device = tc.device == "cuda" ? Device::cuda : Device::cpu;
    if (device == Device::cuda) {
        TESSERA_CHECK(
            cuda_available(), "train.device = cuda: {}; train on the CPU (train.device = cpu)",
            cuda_built() ? "no CUDA device on this machine" : "this build has no CUDA backend (-DTESSERA_CUDA=ON)");
        if (comm) {  // one GPU per rank (its local rank's), and the ranks' GPU buffers over NCCL
            const int gpus = cuda_device_count(), local = parallel::local_ranks();
            TESSERA_CHECK(gpus >= local,
                          "train.device = cuda: {} ranks on this host and {} GPU{}; start at most one rank per GPU",
                          local, gpus, gpus == 1 ? "" : "s");
            use_cuda_device(parallel::local_rank() % gpus);
            comm->use_device_link(parallel::make_nccl_link(*comm));
        }
        TESSERA_CHECK(cfg.memory.weights_budget == 0,
                      "train.device = cuda: memory.weights_budget (a frozen base read in place from its files) is a "
                      "CPU feature; set it to 0");
        TESSERA_CHECK(!cfg.memory.optimizer_offload,
                      "train.device = cuda: memory.optimizer_offload (AdamW's moments in a file) is a CPU feature for "
                      "now; set it to false");
    }
    std::optional<parallel::Mesh> mesh;  // one-line error when W is not a multiple of parallel.ep
    if (comm) mesh.emplace(*comm, int(cfg.parallel.ep), int(cfg.parallel.shard), int(stages), tp);
    if (mesh) mesh->expert().set_link_delay(cfg.parallel.link_delay_ns_per_byte * 1e-9);
    const parallel::Mesh* m = mesh ? &*mesh : nullptr;
    parallel::Comm* dcomm = m && dranks > 1 ? &m->data() : nullptr;  // the stage's data-parallel ranks

    const std::string data_path = cfg.data.path.empty() ? bundled_corpus_path() : cfg.data.path;
    TokenSource tokens(data_path);
    // the largest id present, not the tokenizer's size: a checkpoint's tokenizer may name ids past the model's
    // vocabulary that the text never uses (Kimi's reserved special tokens)
    TESSERA_CHECK(tokens.max_token() < cfg.model.vocab_size,
                  "data {} holds token id {} (its tokenizer has {} ids) but model.vocab_size is {}", data_path,
                  tokens.max_token(), tokens.vocab_size(), cfg.model.vocab_size);
    DataLoader loader(tokens, tc.seq_len, micro, cfg.data.val_fraction, tc.seed, {gdrank, gdata, accumulation});
    // images in the data (token_source.h): made for this model's tower (its image token, patch size, merge)
    const model::VisionConfig& vision = cfg.model.vision;
    const bool with_images = !tokens.images().empty();
    if (with_images) {
        TESSERA_CHECK(vision.enabled(), "data {} holds {} images but the model has no image tower (model.vision)",
                      data_path, tokens.images().size());
        TESSERA_CHECK(tokens.image_token() == vision.image_token && tokens.patch_dim() == vision.patch_dim(),
                      "data {}: its images are image token {} with patches of {} values; the model's tower takes "
                      "image token {} with patches of {}",
                      data_path, tokens.image_token(), tokens.patch_dim(), vision.image_token, vision.patch_dim());
        for (const ShardImage& im : tokens.images())
            TESSERA_CHECK(im.count == model::image_tokens(vision, im.grid),
                          "data {}: an image of {}x{} patches has {} image tokens; the model's tower gives it {}",
                          data_path, im.grid.h, im.grid.w, im.count, model::image_tokens(vision, im.grid));
    }
    ImageBatch images;                       // the current micro-batch's (capacity for the most a pass takes)
    std::vector<ops::PatchGrid> step_grids;  // the images of a step's windows on every rank
    if (with_images) {
        step_grids.reserve(size_t(tc.batch_size * tc.seq_len));  // (an image takes at least one token of a window)
        images.patches.reserve(size_t(vision.max_patches * vision.patch_dim()));
        images.grids.reserve(size_t(vision.max_patches));
        images.rows.reserve(size_t(vision.max_patches));
    }

    RankState st(cfg, m, accumulation);
    model::Model& model = st.model;
    AdamW& opt = st.opt;
    // memory.optimizer_offload: the moments in a file (train/optimizer.h), in the run's directory unless told
    const std::string offload_dir = cfg.memory.offload_dir.empty() ? setup.out_dir : cfg.memory.offload_dir;
    if (opt.offloaded()) {
        if (cfg.memory.offload_dir.empty()) fs::create_directories(setup.out_dir);
        opt.offload_to(offload_dir);
    }
    GradientSum& grad_sum = st.grad_sum;
    const ExpertSlice slice{model.local_experts().first, m && m->ep() > 1 ? cfg.model.moe.experts : 0};
    // memory.weights_budget: the frozen base read in place from its files on every rank, held to the budget
    // (train/weight_budget.h); FSDP then shards only what trains
    std::optional<WeightBudget> budget;
    if (cfg.memory.weights_budget > 0)
        budget.emplace(*setup.base, model, slice, size_t(cfg.memory.weights_budget) << 20);
    st.place(budget ? &*budget : nullptr);
    std::optional<Fsdp>& fsdp = st.fsdp;
    const model::StepShape shape{micro, tc.seq_len};
    model::ModelRuntime rt(model, shape, /*with_grads=*/true, tc.recompute, st.extra,
                           st.placement ? &*st.placement : nullptr, device);
    if (fsdp) fsdp->bind(rt.params(), rt.grads());
    if (st.copies) st.copies->bind(rt.params());
    PipelineStep* pipeline = st.pipeline ? &*st.pipeline : nullptr;
    if (pipeline) pipeline->bind(model, rt.activations());
    model::HooksPair both(fsdp ? &*fsdp : nullptr, budget ? &*budget : nullptr);
    if (fsdp || budget) model.set_param_hooks(&both);

    TrainerState state;
    // pipeline stages: the whole model's trained parameters (a checkpoint's index names them all) and those of the
    // other stages (a checkpoint holds them: loading skips them)
    std::vector<BufferSpec> whole_specs;
    if (pipeline) {
        const model::Model whole(cfg.model);      // (specs only)
        tc.recompute.check(whole.block_kinds());  // (each stage's holds some of them)
        whole_specs = whole.trained_specs();
    }
    std::set<std::string> other_stages;
    for (const BufferSpec& spec : whole_specs) other_stages.insert(spec.name);
    for (const BufferSpec& spec : model.param_specs()) other_stages.erase(spec.name);
    // what trains: this rank's ranges of what FSDP holds, the rest whole (experts: this rank's); the frozen base
    // (parameters [0, frozen)) is not in checkpoints: it comes from train.base
    const size_t frozen = model.frozen_params();
    std::vector<ParamTarget> trained, base;  // [frozen, end) and [0, frozen): whole or this rank's FSDP ranges
    if (fsdp) {
        for (const ParamTarget& t : fsdp->load_targets(opt, rt.params(), slice))
            (t.param >= frozen ? trained : base).push_back(t);
    } else {
        base = held_targets(rt.params(), 0, frozen, slice);
        trained = held_targets(rt.params(), frozen, SIZE_MAX, slice);
    }
    // what a load must fill: a mapped base parameter already holds its values
    const std::vector<ParamTarget> base_loaded = budget ? budget->unmapped(base) : base;
    // hashing reads the base once: a mapped piece's pages go back as soon as it is hashed
    const auto hashed = [&](const ParamTarget& t) {
        if (budget && budget->mapped(t.param))
            release_pages(t.dst, dtype_bytes(model.param_specs()[t.param].dtype, t.length));
    };
    const auto ranged = [&](size_t i) { return fsdp && fsdp->holds_param(i); };
    if (!setup.checkpoint.empty()) {
        state = load_trainer_state(setup.checkpoint);
        if (frozen > 0) {
            TESSERA_CHECK(setup.base, "{}: the model has frozen parameters but train.base names no base",
                          setup.checkpoint);
            load_base(*setup.base, model, rt.params(), base_loaded, slice);
            const int64_t h = frozen_hash(model, base, ranged, m, hashed);
            TESSERA_CHECK(!state.base_hash || *state.base_hash == h,
                          "--resume {}: its base {} has changed since the fine-tune began (frozen weights hash {}, the "
                          "checkpoint says {})",
                          setup.checkpoint, setup.base->path, h, *state.base_hash);
        }
        load_params(setup.checkpoint, model.param_specs(), trained, slice, other_stages);
        if (fsdp) fsdp->invalidate();
        load_optimizer(setup.checkpoint, opt, other_stages);
        loader.set_position(state.data);
        opt.set_step(state.optimizer_step);
    } else {
        if (fsdp) {
            fsdp->init(model, tc.seed);
        } else {
            for (size_t i = 0; i < model.param_specs().size(); ++i)  // (a mapped base is read-only: its file's)
                if (!budget || !budget->mapped(i)) model.init_params(rt.params(), tc.seed, i, i + 1);
        }
        if (setup.base) {  // the base's weights over the initialisation (adapters keep theirs)
            std::vector<ParamTarget> all = base_loaded;
            all.insert(all.end(), trained.begin(), trained.end());
            load_base(*setup.base, model, rt.params(), all, slice);
            if (fsdp) fsdp->invalidate();
        }
        if (frozen > 0) state.base_hash = frozen_hash(model, base, ranged, m, hashed);
    }
    if (st.copies) st.copies->refresh();  // from the loaded or initial values
    if (budget) budget->trim();           // loading and hashing read the mapped base once
    const bool fresh = setup.checkpoint.empty();
    // a fresh run that fails before its first checkpoint leaves nothing
    FreshRunGuard guard(setup.out_dir, fresh && lead);
    std::optional<MetricsLog> metrics;
    if (lead) {
        fs::create_directories(setup.out_dir);
        for (const auto& line : setup.cleaned) note("cleaned up after a killed run: " + line);
        const fs::path metrics_path = fs::path(setup.out_dir) / "metrics.jsonl";
        if (fresh && fs::exists(metrics_path)) {
            note(fmt::format("{} holds no checkpoint: starting over (replacing config.json and metrics.jsonl)",
                             setup.out_dir));
            fs::remove(metrics_path);
        }
        write_text_atomic((fs::path(setup.out_dir) / "config.json").string(), setup.config_json.dump(2) + "\n");
        metrics.emplace(metrics_path.string(), fresh ? -1 : state.step);
    }

    // every rank measures its own threads (side by side, as they train); the job's rate is W times that; on a GPU
    // each GPU's cuBLAS rate at the run's precision, W times
    const ops::GemmPrecisionScope gemm_precision(tc.precision == "bf16" ? ops::GemmPrecision::bf16
                                                                        : ops::GemmPrecision::f32);
    const double gemm_gflops =
        (device == Device::cpu ? ops::measure_gemm_gflops() : ops::measure_linear_gflops(device)) * ranks;
    double train_flops_per_token = model.train_flops_per_token(tc.seq_len);  // (a stage's: summed over the stages)
    if (m && m->pipeline()) train_flops_per_token = m->pipeline()->all_reduce_sum(train_flops_per_token);
    const int64_t tokens_per_step = tc.batch_size * tc.seq_len;
    note(fmt::format("tessera: {} parameters ({} layers, d_model {}), {} tokens per step, {} steps", model.num_params(),
                     cfg.model.n_layers, cfg.model.d_model, tokens_per_step, tc.steps));
    if (comm)
        note(fmt::format(
            "{} ranks ({}){}: each runs {} micro-batch{} of {} sequences per step{}{}; {}; memory below is "
            "per rank",
            ranks, comm->has_device_link() ? comm->backend() + "; GPU memory over NCCL" : comm->backend(),
            pipeline
                ? fmt::format(" in {} pipeline stages of {} rank{} (1F1B; this rank: layers {}-{}, {} "
                              "micro-batch{} in flight{})",
                              stages, dranks, dranks == 1 ? "" : "s", model.layers().first, model.layers().last - 1,
                              pipeline->in_flight(), pipeline->in_flight() == 1 ? "" : "es",
                              model.last_stage()   ? ""
                              : pipeline->reruns() ? ", forward re-run before each backward"
                                                   : ", their activations kept")
                : std::string(),
            accumulation, accumulation == 1 ? "" : "es", micro,
            m->ep() > 1 ? fmt::format(", holds {} of {} experts per MoE layer (parallel.ep {})",
                                      model.local_experts().second, cfg.model.moe.experts, m->ep())
                        : std::string(),
            tp > 1 ? fmt::format(", with the {} ranks of its tensor group (parallel.tensor: 1/{} of the tokens between "
                                 "attention blocks, 1/{} of each attention block's heads)",
                                 tp, tp, tp)
                   : std::string(),
            dranks == 1     ? "each stage's parameters, gradients and optimizer state whole (one rank per stage)"
            : !fsdp         ? "optimizer state and summed gradients sharded (ZeRO-2)"
            : m->replicas() ? fmt::format("dense parameters, gradients and optimizer state sharded over groups of {} "
                                          "ranks, {} replicas (HSDP)",
                                          m->shard().size(), m->replicas()->size())
                            : "parameters, gradients and optimizer state sharded (FSDP)"));
    note(fmt::format("data: {}; {} training windows, {} eval batches", tokens.description(), loader.num_train_windows(),
                     loader.num_eval_batches()));
    note(rt.memory_report().str());
    if (tc.activation_dtype == DType::bf16) {
        const std::vector<bool> copies = model.narrowed_blocks(tc.recompute);
        note(
            fmt::format("saved activations rounded to bf16 (train.activation_dtype): {} of {} blocks hold them as "
                        "bf16 copies{}",
                        std::count(copies.begin(), copies.end(), true), copies.size(),
                        tc.recompute.any() ? ", recomputed kinds keep f32" : ""));
    }
    if (st.copies)
        note(
            fmt::format("bf16 weight copies (memory.weight_copies): {} trained GEMM weights, {:.1f} MiB, rounded once "
                        "a step{}",
                        st.copies->group().size(), double(st.copies->group().nbytes()) / 0x1p20,
                        fsdp ? "; what FSDP shards is rounded per GEMM" : ""));
    if (budget) {
        const WeightBudgetStats b = budget->stats();
        note(fmt::format(
            "weight budget: {:.1f} MiB of the frozen base read in place from its files, {:.1f} MiB "
            "resident at most (two units need {:.1f} MiB)",
            double(b.mapped_bytes) / 0x1p20, double(b.budget_bytes) / 0x1p20, double(b.floor_bytes) / 0x1p20));
    }
    if (opt.offloaded())
        note(fmt::format(
            "optimizer offload: AdamW's moments, {:.1f} MiB, in a file in {} (unlinked; the kernel pages "
            "it), at most {:.1f} MiB of them resident during a step",
            double(opt.offloaded_bytes()) / 0x1p20, offload_dir, double(opt.offload_resident_bytes()) / 0x1p20));
    note(fmt::format("GEMM rate of {} ({}): {:.0f} GFLOP/s (measured now; {}); run directory: {}",
                     device == Device::cuda ? (ranks > 1 ? fmt::format("the {} GPUs", ranks) : "the GPU")
                     : ranks > 1            ? fmt::format("the {} ranks", ranks)
                                            : std::string("this machine"),
                     tc.precision, gemm_gflops,
                     device == Device::cuda ? cuda_device_name()
                     : tc.precision == "bf16"
                         ? fmt::format("{}; bf16 GEMMs: {}", ops::isa_summary(), ops::cpu_bf16_gemm())
                         : ops::isa_summary(),
                     setup.out_dir));
    if (!setup.checkpoint.empty()) note(fmt::format("resumed from {} at step {}", setup.checkpoint, state.step));
    if (setup.base) {
        int64_t train_params = 0, all_params = 0;
        for (size_t i = 0; i < model.param_specs().size(); ++i) {
            const int64_t n = whole_shape(model.param_specs()[i], slice).numel();
            all_params += n;
            if (i >= frozen) train_params += n;
        }
        const model::LoraConfig& l = cfg.model.lora;
        note(fmt::format("fine-tuning {}: {} of {} parameters train ({:.2f}%){}", setup.base->path, train_params,
                         all_params, 100.0 * double(train_params) / double(std::max<int64_t>(1, all_params)),
                         l.enabled() ? fmt::format(", LoRA rank {}, alpha {}{}; the base stays frozen", l.rank, l.alpha,
                                                   l.rslora ? " (rsLoRA)" : "")
                                     : std::string(", every weight (full fine-tune)")));
    }

    std::vector<int32_t> ids(size_t(shape.tokens())), targets(size_t(shape.tokens()));
    std::vector<int64_t> cu(size_t(shape.tokens()) + 1);  // document boundaries of the current batch
    auto set_images = [&] {                               // the batch's images to the model (with data that has them)
        if (!with_images) return;
        const int64_t n = int64_t(images.patches.size()) / std::max<int64_t>(1, vision.patch_dim());
        model.set_images(images.grids, TensorView(images.patches.data(), DType::f32, Shape{n, vision.patch_dim()}),
                         images.rows);
    };
    auto shape_of = [&](std::span<const int32_t> i) {
        if (!cfg.data.mask_documents) return shape;
        const int64_t n = document_starts(i, shape.batch, shape.seq, tokens.end_of_document(), cu);
        return model::StepShape{shape.batch, shape.seq, std::span<const int64_t>(cu.data(), size_t(n))};
    };
    // The ranks share the evaluation batches (batch i on rank i mod W; with pipeline stages, on the stages' ranks i mod
    // W / stages, the loss on the last); the per-batch sums are added in batch order, so the result does not depend on
    // the number of ranks.
    // train.eval_batches counts batches of train.batch_size sequences: eval_batches · batch_size / micro of the
    // loader's micro-batches, the same sequences on any number of ranks
    std::vector<double> eval_parts(
        size_t(2 * std::min(tc.eval_batches * (tc.batch_size / micro), loader.num_eval_batches())));
    auto evaluate = [&]() -> std::optional<double> {
        const int64_t n = int64_t(eval_parts.size() / 2);
        if (n == 0) return std::nullopt;
        std::fill(eval_parts.begin(), eval_parts.end(), 0.0);
        // with expert parallelism every rank of an expert group must run each forward (its experts serve the
        // others), with FSDP every rank (each forward gathers from all): ranks without a batch of their own in
        // the last round run one whose result they drop
        // (tensor parallelism: a tensor group's ranks run each of their batches together)
        const bool lockstep = m && (m->ep() > 1 || fsdp || tp > 1);  // FSDP: every rank gathers each block's parameters
        for (int64_t i = gdrank; i < (lockstep ? (n + gdata - 1) / gdata * gdata : n); i += gdata) {
            loader.eval_batch(i % n, ids, targets, with_images ? &images : nullptr);
            set_images();
            model::LossResult r = pipeline ? pipeline->forward_loss(shape_of(ids), ids, targets)
                                           : model.forward_loss(shape_of(ids), ids, targets);
            if (i >= n || drank % tp != 0) continue;  // (a tensor group's loss: counted on its first rank)
            eval_parts[size_t(2 * i)] = r.loss * double(r.count);
            eval_parts[size_t(2 * i + 1)] = double(r.count);
        }
        if (comm) comm->all_reduce(std::span(eval_parts));  // one non-zero term per element: exact
        double sum = 0, count = 0;
        for (int64_t i = 0; i < n; ++i) {
            sum += eval_parts[size_t(2 * i)];
            count += eval_parts[size_t(2 * i + 1)];
        }
        return count > 0 ? std::optional(sum / count) : std::nullopt;
    };
    TrainSummary summary;
    summary.first_step = state.step;
    Progress progress(log, opts.log_is_tty, tc.steps, tc.log_interval,
                      device == Device::cuda   ? "GPU " + tc.precision
                      : tc.precision == "bf16" ? std::string(ops::kernel_isa()) + " bf16"
                                               : "");
    // operations (docs/operations.md): one metrics sink on every rank (its step() gathers each rank's share), the
    // alert rules and the HTTP endpoint on rank 0, a watchdog on every rank
    Telemetry telemetry(comm);
    const MonitorConfig& mon = cfg.monitor;
    std::optional<AlertSink> alerts;
    std::optional<AlertRules> rules;
    std::optional<MonitorServer> server;
    if (lead) {
        alerts.emplace((fs::path(setup.out_dir) / "alerts.jsonl").string(), opts.alert_log, mon.webhook);
        rules.emplace(mon, physical_memory_bytes());
        const int port = opts.metrics_port ? *opts.metrics_port : int(mon.metrics_port);
        if (port > 0 || opts.metrics_port) {
            server.emplace(setup.out_dir, port, [&telemetry] { return telemetry.prometheus(); });
            note(fmt::format("metrics: http://{}:{}/metrics (Prometheus), dashboard at http://{}:{}/", host_name(),
                             server->port(), host_name(), server->port()));
        }
    }
    telemetry.restarts(restarts_before());
    const Fault fault = fault_from_env(rank);
    Watchdog watchdog(mon.watchdog_seconds, rank, alerts ? &*alerts : nullptr);
    auto run_eval = [&](int64_t step) {
        trace::Span span("evaluation", "step", step, "step");
        summary.eval_loss = evaluate();
        if (!summary.eval_loss) return;
        const double bpb = *summary.eval_loss / std::numbers::ln2;
        if (metrics) metrics->write({{"step", step}, {"eval_loss", *summary.eval_loss}, {"eval_bpb", bpb}});
        telemetry.eval(step, *summary.eval_loss);
        progress.note(
            fmt::format("eval at step {}: loss {:.4f} ({:.3f} bits per byte)", step, *summary.eval_loss, bpb));
    };
    // checkpoints: written by a thread of their own while training goes on (train.async_checkpoints; the step
    // loop copies this rank's part and polls between steps), or in the step loop
    std::atomic<int64_t> writing{0};  // the step being written (for TESSERA_FAULT=kill_write)
    std::optional<CheckpointWriter> writer;
    if (tc.async_checkpoints) writer.emplace(setup.out_dir, m, [&] { fault.while_writing(writing.load()); });
    Clock::time_point began;
    double blocked = 0;  // how long the step loop waited for the checkpoint in flight
    auto completed = [&](const std::string& path, int64_t step) {
        summary.checkpoint = path;
        guard.dismiss();
        const double total = seconds_since(began);
        telemetry.checkpoint(step, total);
        if (metrics)
            metrics->write({{"step", step},
                            {"checkpoint", path},
                            {"checkpoint_ms", total * 1e3},
                            {"checkpoint_blocking_ms", blocked * 1e3}});
        progress.note(fmt::format("checkpoint: {}", path));
    };
    // wait: return with the checkpoint on disk (the last step, a stop); otherwise it completes at a later poll
    auto checkpoint = [&](bool wait) {
        trace::Span span("checkpoint", "step", state.step, "step");
        if (writer && writer->pending()) completed(writer->finish(), writing.load());  // one in flight at a time
        began = Clock::now();
        state.optimizer_step = opt.step();
        state.data = loader.position();
        const CheckpointContents contents{.config = setup.config_json,
                                          .params = rt.params(),
                                          .opt = opt,
                                          .ranges = param_ranges(opt, rt, fsdp ? &*fsdp : nullptr),
                                          .experts = slice,
                                          .state = state,
                                          .frozen = frozen,
                                          .all_specs = pipeline ? &whole_specs : nullptr};
        if (!writer) {
            const std::string path = save_checkpoint(setup.out_dir, contents, m);
            blocked = seconds_since(began);
            completed(path, state.step);
            return;
        }
        writing = state.step;
        writer->begin(contents);
        blocked = seconds_since(began);
        telemetry.checkpoint_blocked(blocked);
        if (wait) {
            const std::string path = writer->finish();
            blocked = seconds_since(began);
            completed(path, state.step);
        }
    };

    // the trace of --trace-steps: every rank's spans gathered to rank 0 (a collective), written as RUN/trace.json
    auto finish_trace = [&] {
        trace::stop();
        const std::string mine = trace::take_events(rank, fmt::format("rank {}", rank));
        std::string all = mine;
        if (comm) {
            std::vector<int64_t> sizes(static_cast<size_t>(ranks));
            const int64_t n = int64_t(mine.size());
            comm->all_gather(std::as_bytes(std::span(&n, 1)), std::as_writable_bytes(std::span(sizes)));
            int64_t total = 0;
            for (int64_t x : sizes) total += x;
            all.assign(size_t(total), '\0');
            comm->all_gather_v(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)), sizes);
            std::string joined;  // the ranks' texts, comma separated
            int64_t at = 0;
            for (int64_t x : sizes) {
                if (x == 0) continue;
                if (!joined.empty()) joined += ",\n";
                joined.append(all, size_t(at), size_t(x));
                at += x;
            }
            all = std::move(joined);
        }
        if (!lead) return;
        const std::string path = (fs::path(setup.out_dir) / "trace.json").string();
        write_text_atomic(path, "{\"displayTimeUnit\": \"ms\", \"traceEvents\": [\n" + all + "\n]}\n");
        progress.note(fmt::format("trace of steps {}-{}: {} (chrome://tracing or https://ui.perfetto.dev)",
                                  opts.trace_steps->first, std::min(opts.trace_steps->second, state.step), path));
    };

    int64_t last_saved = setup.checkpoint.empty() ? -1 : state.step;
    const BatchSource next_batch = [&](std::span<int32_t> i, std::span<int32_t> t) {
        loader.next_batch(i, t, with_images ? &images : nullptr);
        set_images();
        return shape_of(i);
    };
    FsdpStats fsdp_last;
    ArenaStats arena_stats;
    double monitor_seconds = 0;  // the metrics sink, logs and alert rules of the last step
    watchdog.beat(state.step);
    while (state.step < tc.steps) {
        if (fsdp) fsdp_last = fsdp->stats();  // (evaluation and checkpoints between steps gather too)
        const auto t0 = Clock::now();
        if (opts.trace_steps && state.step + 1 == opts.trace_steps->first) trace::start();
        std::optional<trace::Span> step_span;
        step_span.emplace("step", "step", state.step + 1, "step");
        fault.before_step(state.step + 1);
        // the image tower's FLOPs of the step on every rank (from the data alone, as its counted targets)
        double step_image_flops = 0;
        if (with_images) {
            loader.step_images(step_grids);
            step_image_flops = model.image_forward_flops(step_grids);
        }
        StepResult r = train_step(model, rt, opt, grad_sum, tc, state.step, next_batch, ids, targets, dcomm,
                                  fsdp ? &*fsdp : nullptr, loader.step_targets(),
                                  {.skip_nonfinite = true,  // (the nonfinite rule decides: skip, or stop)
                                   .poison = fault.poisons(state.step + 1),
                                   .pipeline = pipeline,
                                   .tensor = tp,
                                   .copies = st.copies ? &*st.copies : nullptr});
        step_span.reset();
        state.step++;
        state.tokens_seen += tokens_per_step;
        StepReport rep{.step = state.step,
                       .loss = r.loss,
                       .lr = r.lr,
                       .grad_norm = r.grad_norm,
                       .skipped = r.skipped,
                       .tokens = tokens_per_step,
                       .phases = r.phases,
                       .layers = r.stats.get(),
                       .arena = &arena_stats};
        rep.phases.step = seconds_since(t0);
        for (const auto& [layer, s] : r.moe)  // (this rank's layers: a pipeline's statistics hold every stage's)
            if (layer >= model.layers().first && layer < model.layers().last)
                rep.phases.communication += s.a2a_exposed_seconds;
        const double tps = double(tokens_per_step) / rep.phases.step;
        rep.flops_per_s = tps * train_flops_per_token + step_image_flops / rep.phases.step;
        rep.mfu = rep.flops_per_s / (gemm_gflops * 1e9);
        summary.losses.push_back(r.loss);
        if (state.step == summary.first_step + 1) {
            rep.arena_peak_bytes = rt.arena().stats().peak_bytes_in_use;
            if (device == Device::cuda && lead)  // (the backend's scratch is sized by the first step's calls)
                progress.note(fmt::format(
                    "the GPU after step {}: arena high-water mark {:.1f} MiB, kernel scratch and "
                    "GEMM operand copies outside it {:.1f} MiB",
                    state.step, double(*rep.arena_peak_bytes) / 0x1p20, double(ops::cuda_scratch_bytes()) / 0x1p20));
        }
        if (!r.moe.empty() && cfg.model.moe.global_aux_coeff > 0) rep.global_aux_loss = r.global_aux_loss;
        if (fsdp) {  // this step's gathers and reductions, and how long compute waited for them
            const FsdpStats now = fsdp->stats();
            rep.fsdp = FsdpStats{.gathers = now.gathers - fsdp_last.gathers,
                                 .gathered_bytes = now.gathered_bytes - fsdp_last.gathered_bytes,
                                 .reductions = now.reductions - fsdp_last.reductions,
                                 .wait_seconds = now.wait_seconds - fsdp_last.wait_seconds};
            rep.phases.communication += rep.fsdp->wait_seconds;
            fsdp_last = now;
        }
        if (budget) {  // the base's resident share, and what reached it from storage
            budget->observe(*r.stats);
            rep.weights = budget->stats();
        }
        arena_stats = rt.arena().stats();
        const auto monitor_t0 = Clock::now();
        rep.monitor_seconds = monitor_seconds;
        const Json rec = telemetry.step(rep);  // (every rank: it gathers the ranks' shares)
        if (metrics) metrics->write(rec);
        progress.step(state.step, r.loss, r.lr, tps, rep.phases.step, rep.mfu, telemetry.summary());
        // the alert rules on rank 0, their action shared with every rank (with the stop signal: one reduction)
        AlertAction action = AlertAction::none;
        if (rules) {
            const std::vector<Alert> fired = rules->evaluate(rep, telemetry.ranks());
            for (const Alert& al : fired) {
                // the non-finite step that ends the run: its error line says it on stderr
                alerts->fire(al, /*echo=*/!(al.rule == "nonfinite" && al.action == AlertAction::stop));
                telemetry.alert(al.rule);
            }
            action = AlertRules::strongest(fired);
        }
        monitor_seconds = seconds_since(monitor_t0);  // (the next step's record says it)
        std::array<int64_t, 2> votes = {opts.stop && opts.stop->load() ? 1 : 0, int64_t(action)};
        if (comm) comm->all_reduce(std::span<int64_t>(votes));  // (rank 0 alone votes an action: the sum is its)
        action = AlertAction(votes[1]);
        if (action == AlertAction::stop && r.skipped)  // non-finite steps past the rule's count: as before
            TESSERA_FAIL("training diverged at step {}: the loss is {}, the gradient norm {} (lower train.lr?)",
                         state.step, r.loss, r.grad_norm);
        const bool last = state.step == tc.steps;
        if ((tc.eval_interval > 0 && state.step % tc.eval_interval == 0) || last) run_eval(state.step);
        if ((tc.checkpoint_interval > 0 && state.step % tc.checkpoint_interval == 0) || last ||
            action >= AlertAction::checkpoint) {
            checkpoint(last || action == AlertAction::stop);
            last_saved = state.step;
        }
        // a checkpoint begun after step k is complete at the end of step k + 1 at the latest: what is on disk
        // at each step does not depend on the writer's speed (a collective: every rank polls after every step)
        if (writer && writer->pending())
            if (const auto t0 = Clock::now(); const auto path = writer->poll(/*wait=*/state.step > writing.load())) {
                blocked += seconds_since(t0);
                completed(*path, writing.load());
            }
        watchdog.beat(state.step);
        if (opts.trace_steps && state.step == opts.trace_steps->second) finish_trace();
        // every rank stops at the same step (a signal may reach them at different times)
        const bool stop = votes[0] > 0 || action == AlertAction::stop;
        if (stop && state.step < tc.steps) {  // (at the last step: just finish)
            if (last_saved != state.step) checkpoint(true);
            summary.stopped_early = true;
            if (action == AlertAction::stop) summary.stopped_by_alert = true;
            progress.note(fmt::format("stopped at step {}{}; continue with --resume {}", state.step,
                                      action == AlertAction::stop ? " by an alert (alerts.jsonl)" : "", setup.out_dir));
            break;
        }
    }
    if (last_saved != state.step) checkpoint(true);
    if (writer && writer->pending()) completed(writer->finish(), writing.load());
    if (trace::on()) finish_trace();  // the run ended inside the window
    progress.finish();
    summary.last_step = state.step;
    summary.memory = rt.memory_report();
    return summary;
}

}  // namespace tessera::train
