// Checkpoint save / load / discovery.
#include "train/checkpoint.h"

#include <unistd.h>

#include <algorithm>
#include <array>
#include <charconv>
#include <cmath>
#include <cstring>
#include <filesystem>
#include <map>
#include <memory>
#include <regex>
#include <set>
#include <sstream>

#include "core/check.h"
#include "core/device.h"
#include "core/file.h"
#include "core/mxfp4.h"
#include "core/safetensors.h"
#include "train/config.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {
// 2: optimizer state in per-rank range files; 3: so are the parameters of a multi-rank run (model-RRRRR-of-WWWWW)
constexpr int kFormat = 3;
constexpr int kOldestFormat = 2;

// Tensors of a group under their spec names (optimizer state is named "m.<param>" in its group).
std::vector<NamedTensor> named(const BufferGroup& g, size_t first = 0) {
    std::vector<NamedTensor> out;
    for (size_t i = first; i < g.size(); ++i) out.push_back({g.specs()[i].name, g.view(i)});
    return out;
}

// Thrown on the ranks that succeeded when another rank failed a collective step (that rank reports why).
struct CollectiveFailure : Error {
    using Error::Error;
};

// Every rank says whether its part succeeded; when one did not, the others throw CollectiveFailure (the
// failing rank goes on with its own error). Collective.
void agree(parallel::Comm& comm, bool ok) {
    if (comm.all_reduce_sum<int64_t>(ok ? 0 : 1) > 0 && ok)
        throw CollectiveFailure("checkpoint: another rank failed to write its part (see its error)");
}

std::string optimizer_file(int rank, int world) {
    return fmt::format("optimizer-{:05d}-of-{:05d}.safetensors", rank, world);
}

constexpr const char* kModelIndex = "model.index.json";

std::string model_file(int rank, int world) { return fmt::format("model-{:05d}-of-{:05d}.safetensors", rank, world); }

// The pieces this rank writes (AdamW::saves: HSDP's replicas leave the dense ranges to the first one), each with
// where it starts in the rank's files' flat tensors: its place in the moments when the rank writes every piece (the
// live buffers are written), else one after another (copies).
struct SavedPieces {
    std::vector<std::pair<const StatePiece*, int64_t>> at;
    int64_t n = 0;  // elements of the flat tensors
    bool all = true;
};
SavedPieces saved_pieces(const AdamW& opt) {
    SavedPieces s;
    for (const StatePiece& p : opt.pieces()) s.all = s.all && opt.saves(p);
    s.n = s.all ? opt.m().specs()[0].shape.numel() : 0;
    for (const StatePiece& p : opt.pieces()) {
        if (s.all)
            s.at.emplace_back(&p, p.state_offset);
        else if (opt.saves(p))
            s.at.emplace_back(&p, std::exchange(s.n, s.n + p.length));
    }
    return s;
}

// The pieces as metadata: "name whole_offset length offset" per line (offset: where the piece starts in the file's
// flat tensors; the elements between pieces are alignment gaps).
std::string pieces_text(const AdamW& opt, const SavedPieces& saved) {
    std::string pieces;
    for (const auto& [p, at] : saved.at)
        pieces += fmt::format("{} {} {} {}\n", opt.param_specs()[p->param].name, p->whole_offset, p->length, at);
    return pieces;
}

Json shape_json(const Shape& s) {
    Json out = Json::array();
    for (int i = 0; i < s.ndim; ++i) out.push_back(s[i]);
    return out;
}

// Several ranks: what the rank files hold together, for readers and tools: the files, and every tensor's whole
// shape (all experts).
void write_model_index(const fs::path& dir, const std::vector<BufferSpec>& specs, ExpertSlice experts, int world) {
    Json files = Json::array(), tensors = Json::object();
    for (int r = 0; r < world; ++r) files.push_back(model_file(r, world));
    for (const BufferSpec& spec : specs)
        tensors[spec.name] = {{"dtype", dtype_name(spec.dtype)}, {"shape", shape_json(whole_shape(spec, experts))}};
    const Json index = {{"format", "tessera ranges"}, {"files", files}, {"tensors", tensors}};
    write_text_atomic((dir / kModelIndex).string(), index.dump(2) + "\n");
}

// Several ranks: this rank's ranges of the parameters, laid out as the pieces it saves.
Tensor model_ranges(const SavedPieces& saved, const ParamRanges& ranges, Device device) {
    Tensor flat(DType::f32, Shape{saved.n});
    float* out = flat.view().ptr<float>();
    std::fill_n(out, flat.view().numel(), 0.0f);
    for (const auto& [p, at] : saved.at) {
        const std::span<const float> r = ranges.region[size_t(p->region)];
        copy_bytes(out + at, Device::cpu, r.data() + p->range_offset, device, size_t(p->length) * sizeof(float));
    }
    return flat;
}

// A copy that lives on of the moments a rank saves (a snapshot, or the saved pieces packed when it does not save them
// all): a Tensor, or with the moments offloaded a scratch file beside theirs (train/optimizer.h), filled a window at a
// time with both sides released as it goes, so that neither is ever resident whole.
TensorView moments_copy(RankFiles& f, const AdamW& opt, const SavedPieces& saved, const BufferGroup& moments) {
    const TensorView from = moments.view(0);
    float* to = nullptr;
    if (opt.offloaded()) {
        f.mapped.push_back(std::make_shared<ScratchFile>(opt.offload_dir(), size_t(saved.n) * sizeof(float)));
        to = reinterpret_cast<float*>(f.mapped.back()->data());
    } else {
        f.owned.push_back(Tensor(DType::f32, Shape{saved.n}));
        to = f.owned.back().view().ptr<float>();
    }
    auto copy = [&](int64_t from_at, int64_t to_at, int64_t n) {
        const int64_t window = opt.offloaded() ? opt.offload_window() : std::max<int64_t>(n, 1);
        for (int64_t k = 0; k < n; k += window) {
            const size_t bytes = size_t(std::min(window, n - k)) * sizeof(float);
            copy_bytes(to + to_at + k, Device::cpu, from.ptr<float>() + from_at + k, from.device, bytes);
            if (!opt.offloaded()) continue;
            release_pages(to + to_at + k, bytes);
            release_pages(from.ptr<float>() + from_at + k, bytes);
        }
    };
    if (saved.all)
        copy(0, 0, saved.n);
    else
        for (const auto& [p, at] : saved.at) copy(p->state_offset, at, p->length);
    return TensorView(to, DType::f32, Shape{saved.n});
}

// The step a directory name step_NNNNNNN stands for, or nothing for another name.
std::optional<int64_t> step_in_name(const fs::path& p) {
    static const std::regex re("step_([0-9]+)");
    std::smatch m;
    const std::string name = p.filename().string();
    if (!std::regex_match(name, m, re)) return std::nullopt;
    int64_t step = 0;
    const std::string digits = m[1].str();
    const auto r = std::from_chars(digits.data(), digits.data() + digits.size(), step);
    TESSERA_CHECK(r.ec == std::errc(), "{}: the step in the name is out of range (not a checkpoint this engine wrote)",
                  p.string());
    return step;
}

std::optional<int64_t> step_of(const fs::path& p) {
    if (!fs::exists(p / "trainer_state.json")) return std::nullopt;
    return step_in_name(p);
}

}  // namespace

std::vector<std::string> clean_stale_temporaries(const std::string& run_dir) {
    std::vector<std::string> done;
    std::error_code ec;
    static const std::regex ckpt_re(R"(\.(step_[0-9]+)\.(tmp|old)-(.+))");
    static const std::regex file_re(R"((config\.json|metrics\.jsonl)\.tmp-(.+))");
    const fs::path root = fs::path(run_dir) / "checkpoints";
    if (fs::is_directory(root, ec)) {
        for (const auto& e : fs::directory_iterator(root, ec)) {
            std::smatch m;
            const std::string name = e.path().filename().string();
            if (!std::regex_match(name, m, ckpt_re) || !writer_is_dead(m[3].str())) continue;
            const fs::path final_dir = root / m[1].str();
            if (m[2].str() == "old" && !fs::exists(final_dir)) {
                // killed between moving the old checkpoint aside and moving the new one in: put it back
                fs::rename(e.path(), final_dir, ec);
                if (!ec) done.push_back(fmt::format("restored {} from {}", final_dir.string(), name));
                continue;
            }
            fs::remove_all(e.path(), ec);
            if (!ec) done.push_back("removed " + e.path().string());
        }
    }
    if (fs::is_directory(run_dir, ec)) {
        for (const auto& e : fs::directory_iterator(run_dir, ec)) {
            std::smatch m;
            const std::string name = e.path().filename().string();
            if (!std::regex_match(name, m, file_re) || !writer_is_dead(m[2].str())) continue;
            fs::remove(e.path(), ec);
            if (!ec) done.push_back("removed " + e.path().string());
        }
    }
    return done;
}

bool holds_checkpoint(const std::string& run_dir) {
    const fs::path root = fs::path(run_dir) / "checkpoints";
    std::error_code ec;
    if (!fs::is_directory(root, ec)) return false;
    for (const auto& e : fs::directory_iterator(root, ec)) {
        if (e.is_directory() && step_of(e.path())) return true;
    }
    return false;
}

RankFiles rank_files(const CheckpointContents& c, int rank, int world, bool copy) {
    RankFiles f;
    auto keep = [&](TensorView v) {  // a snapshot (and a device's buffer) is copied; else the live buffer is written
        if (!copy && v.device == Device::cpu) return v;
        f.owned.push_back(Tensor(v.dtype, v.shape));
        copy_bytes(f.owned.back().view().data, Device::cpu, v.data, v.device, v.nbytes());
        return f.owned.back().view();
    };
    const SavedPieces saved = saved_pieces(c.opt);
    const std::string pieces = pieces_text(c.opt, saved);
    auto moments = [&](const BufferGroup& g) {
        return saved.all && !copy && g.device() == Device::cpu ? g.view(0) : moments_copy(f, c.opt, saved, g);
    };
    f.files.push_back({optimizer_file(rank, world),
                       {{"m", moments(c.opt.m())}, {"v", moments(c.opt.v())}},
                       {{"optimizer", "adamw"}, {"step", std::to_string(c.state.optimizer_step)}, {"pieces", pieces}}});
    if (world > 1) {
        f.owned.push_back(model_ranges(saved, c.ranges, c.opt.m().device()));  // (the ranges are where the moments are)
        f.files.push_back({model_file(rank, world),
                           {{"params", f.owned.back().view()}},
                           {{"format", "tessera ranges"}, {"pieces", pieces}}});
    } else {
        std::vector<NamedTensor> params = named(c.params, c.frozen);
        for (NamedTensor& t : params) t.tensor = keep(t.tensor);
        f.files.push_back({"model.safetensors", std::move(params), {{"format", "tessera"}}});
    }
    f.world = world;
    f.rank = rank;
    f.config = c.config;
    f.state = c.state;
    f.specs = c.all_specs ? *c.all_specs : c.opt.param_specs();
    f.experts = c.experts;
    return f;
}

namespace {
// Rank 0, after every rank's files are in tmp: the run config, the trainer state, the index, then the rename.
void complete_checkpoint(const RankFiles& f, const fs::path& tmp, const fs::path& final_dir) {
    write_text_atomic((tmp / "config.json").string(), f.config.dump(2) + "\n");
    if (f.world > 1) write_model_index(tmp, f.specs, f.experts, f.world);
    Json st = {{"format", kFormat},
               {"step", f.state.step},
               {"optimizer_step", f.state.optimizer_step},
               {"tokens_seen", f.state.tokens_seen},
               {"data", {{"epoch", f.state.data.epoch}, {"cursor", f.state.data.cursor}}}};
    if (f.state.base_hash) st["base_hash"] = *f.state.base_hash;
    write_text_atomic((tmp / "trainer_state.json").string(), st.dump(2) + "\n");
    fsync_path(tmp.string());
    const fs::path root = final_dir.parent_path();
    std::error_code ec;
    if (fs::exists(final_dir)) {  // re-saving a step: move the old one aside first
        const fs::path old = root / fmt::format(".{}.old-{}", final_dir.filename().string(), writer_tag());
        fs::rename(final_dir, old);
        fs::rename(tmp, final_dir);
        fs::remove_all(old, ec);
    } else {
        fs::rename(tmp, final_dir);
    }
    fsync_path(root.string());
}

// The checkpoint's directory and rank 0's temporary one (made by rank 0, its name shared: a collective).
std::pair<fs::path, fs::path> checkpoint_dirs(const std::string& run_dir, int64_t step, parallel::Comm* comm) {
    const int W = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
    const fs::path root = fs::path(run_dir) / "checkpoints";
    const std::string name = fmt::format("step_{:07d}", step);
    fs::path tmp = root / fmt::format(".{}.tmp-{}", name, writer_tag());
    std::error_code ec;
    if (rank == 0) {
        fs::create_directories(root);
        fs::remove_all(tmp, ec);
        fs::create_directories(tmp);
    }
    if (W > 1) tmp = comm->broadcast_text(tmp.string(), 0);  // rank 0's, made before anyone writes into it
    return {root / name, tmp};
}
}  // namespace

void write_rank_files(const RankFiles& f, const fs::path& dir, const std::function<void()>& between) {
    for (size_t i = 0; i < f.files.size(); ++i) {
        if (i > 0 && between) between();
        write_safetensors((dir / f.files[i].name).string(), f.files[i].tensors, f.files[i].meta);
    }
}

std::string save_checkpoint(const std::string& run_dir, const CheckpointContents& c, const parallel::Mesh* mesh) {
    parallel::Comm* comm = mesh ? &mesh->world() : nullptr;
    const int W = comm ? comm->size() : 1, rank = comm ? comm->rank() : 0;
    const auto [final_dir, tmp] = checkpoint_dirs(run_dir, c.state.step, comm);
    std::error_code ec;
    try {
        const RankFiles files = rank_files(c, rank, W, /*copy=*/false);
        write_rank_files(files, tmp);
        c.opt.release();                // (offloaded moments: the write read them in)
        if (W > 1) agree(*comm, true);  // every rank's ranges are on disk
        if (rank != 0) {
            agree(*comm, true);  // rank 0 renamed the directory (or failed)
            return final_dir.string();
        }
        complete_checkpoint(files, tmp, final_dir);
        if (W > 1) agree(*comm, true);
    } catch (const fs::filesystem_error& e) {
        if (rank == 0) fs::remove_all(tmp, ec);
        if (W > 1) agree(*comm, false);
        TESSERA_FAIL("checkpoint {}: {}", final_dir.string(), e.what());
    } catch (const CollectiveFailure&) {
        if (rank == 0) fs::remove_all(tmp, ec);
        throw;
    } catch (...) {
        if (rank == 0) fs::remove_all(tmp, ec);
        if (W > 1) agree(*comm, false);
        throw;
    }
    return final_dir.string();
}

CheckpointWriter::CheckpointWriter(std::string run_dir, const parallel::Mesh* mesh, std::function<void()> between)
    : run_dir_(std::move(run_dir)), comm_(mesh ? &mesh->world() : nullptr), between_(std::move(between)) {
    thread_ = std::thread([this] { loop(); });
}

CheckpointWriter::~CheckpointWriter() {
    {
        std::lock_guard lock(mu_);
        quit_ = true;
    }
    cv_.notify_all();
    thread_.join();
    std::error_code ec;
    if (job_ && comm_rank() == 0) fs::remove_all(tmp_, ec);  // an unfinished checkpoint (an error elsewhere)
}

int CheckpointWriter::comm_rank() const { return comm_ ? comm_->rank() : 0; }

void CheckpointWriter::begin(const CheckpointContents& c) {
    if (job_) finish();  // one in flight at a time
    const int W = comm_ ? comm_->size() : 1;
    std::tie(final_, tmp_) = checkpoint_dirs(run_dir_, c.state.step, comm_);
    auto files = std::make_shared<RankFiles>(rank_files(c, comm_rank(), W, /*copy=*/true));
    std::lock_guard lock(mu_);
    job_ = std::move(files);
    written_ = false;
    error_.clear();
    cv_.notify_all();
}

void CheckpointWriter::loop() {
    std::unique_lock lock(mu_);
    for (;;) {
        cv_.wait(lock, [&] { return quit_ || (job_ && !written_); });
        if (quit_) return;
        const std::shared_ptr<RankFiles> job = job_;
        const fs::path tmp = tmp_;
        lock.unlock();
        std::string error;
        try {
            write_rank_files(*job, tmp, between_);
        } catch (const std::exception& e) {
            error = e.what();
        }
        lock.lock();
        written_ = true;
        error_ = error;
        cv_.notify_all();
    }
}

std::optional<std::string> CheckpointWriter::poll(bool wait) {
    if (!job_) return std::nullopt;
    std::array<int64_t, 2> state{};  // this rank: still writing, failed
    {
        std::unique_lock lock(mu_);
        if (wait) cv_.wait(lock, [&] { return written_; });
        state = {written_ ? 0 : 1, error_.empty() ? 0 : 1};
    }
    std::array<int64_t, 2> all = state;
    if (comm_) comm_->all_reduce(std::span<int64_t>(all));  // collective: every rank polls at the same points
    std::error_code ec;
    if (all[1] > 0) {
        const std::string mine = error_;
        if (comm_rank() == 0) fs::remove_all(tmp_, ec);
        job_.reset();
        TESSERA_CHECK(mine.empty(), "checkpoint {}: {}", final_.string(), mine);
        TESSERA_FAIL("checkpoint {}: another rank failed to write its part (see its error)", final_.string());
    }
    if (all[0] > 0) return std::nullopt;  // some rank is still writing
    const std::shared_ptr<RankFiles> job = std::move(job_);
    if (comm_rank() == 0) {
        try {
            complete_checkpoint(*job, tmp_, final_);
        } catch (const fs::filesystem_error& e) {
            fs::remove_all(tmp_, ec);
            TESSERA_FAIL("checkpoint {}: {}", final_.string(), e.what());
        }
    }
    return final_.string();
}

std::string resolve_checkpoint(const std::string& dir) {
    const fs::path p(dir);
    TESSERA_CHECK(fs::exists(p), "{}: no such directory", dir);
    if (fs::exists(p / "trainer_state.json")) return p.string();
    const fs::path root = p / "checkpoints";
    TESSERA_CHECK(fs::is_directory(root), "{}: neither a checkpoint nor a run directory with checkpoints/", dir);
    std::optional<int64_t> best;
    fs::path best_path;
    for (auto& e : fs::directory_iterator(root)) {
        if (!e.is_directory()) continue;
        auto s = step_of(e.path());
        if (s && (!best || *s > *best)) {
            best = s;
            best_path = e.path();
        }
    }
    TESSERA_CHECK(best.has_value(), "{}: no complete checkpoint under {}", dir, root.string());
    return best_path.string();
}

Json load_checkpoint_config(const std::string& ckpt_dir) {
    const std::string path = (fs::path(ckpt_dir) / "config.json").string();
    Json j = parse_json(read_text(path, kMaxConfigBytes), path);
    TESSERA_CHECK(j.is_object(), "{}: not a JSON object (corrupted checkpoint?)", path);
    return j;
}

TrainerState load_trainer_state(const std::string& ckpt_dir) {
    const std::string path = (fs::path(ckpt_dir) / "trainer_state.json").string();
    Json j = parse_json(read_text(path, kMaxConfigBytes), path);
    TESSERA_CHECK(j.is_object(), "{}: not a JSON object (corrupted checkpoint?)", path);
    auto get = [&](const Json& o, const char* key) -> int64_t {
        TESSERA_CHECK(o.contains(key) && o[key].is_number_integer() && o[key].get<int64_t>() >= 0,
                      "{}: missing or invalid \"{}\"", path, key);
        return o[key].get<int64_t>();
    };
    TESSERA_CHECK(get(j, "format") >= kOldestFormat && get(j, "format") <= kFormat,
                  "{}: checkpoint format {} is not supported (this tessera reads {} to {})", path, get(j, "format"),
                  kOldestFormat, kFormat);
    TrainerState s;
    s.step = get(j, "step");
    s.optimizer_step = get(j, "optimizer_step");
    s.tokens_seen = get(j, "tokens_seen");
    TESSERA_CHECK(j.contains("data") && j["data"].is_object(), "{}: missing \"data\"", path);
    s.data.epoch = get(j["data"], "epoch");
    s.data.cursor = get(j["data"], "cursor");
    if (j.contains("base_hash")) {
        TESSERA_CHECK(j["base_hash"].is_number_integer(), "{}: invalid \"base_hash\"", path);
        s.base_hash = j["base_hash"].get<int64_t>();
    }
    // the state must agree with the directory it sits in, and with itself
    fs::path dir = fs::path(ckpt_dir).lexically_normal();
    if (dir.filename().empty()) dir = dir.parent_path();  // "…/step_0000006/"
    if (const auto named = step_in_name(dir)) {
        TESSERA_CHECK(s.step == *named, "{}: step {} contradicts the checkpoint's directory (step {}; corrupted?)",
                      path, s.step, *named);
    }
    TESSERA_CHECK(s.optimizer_step <= s.step, "{}: optimizer_step {} is past step {} (corrupted?)", path,
                  s.optimizer_step, s.step);
    return s;
}

void load_params(const std::string& ckpt_dir,
                 const std::vector<BufferSpec>& specs,
                 const std::vector<ParamTarget>& targets,
                 ExpertSlice experts,
                 const std::set<std::string>& elsewhere) {
    // what the checkpoint holds: pieces (name, whole offset, length, data) of whole tensors, read in place from
    // model.safetensors (one process wrote it) or from the ranks' model-RRRRR-of-WWWWW files (several did)
    struct Source {
        int64_t whole_offset, length;
        const float* data;
    };
    std::map<std::string, std::vector<Source>> sources;
    std::map<std::string, size_t> spec_of;
    for (size_t i = 0; i < specs.size(); ++i) spec_of[specs[i].name] = i;
    auto whole_numel = [&](size_t i) { return whole_shape(specs[i], experts).numel(); };
    // a parameter's spec index, or SIZE_MAX for another pipeline stage's
    auto known = [&](const std::string& file, const std::string& name) {
        const auto it = spec_of.find(name);
        if (it == spec_of.end() && elsewhere.count(name)) return SIZE_MAX;
        TESSERA_CHECK(it != spec_of.end(), "{}: unexpected tensor \"{}\" (a checkpoint of another model?)", file, name);
        return it->second;
    };
    std::vector<std::unique_ptr<SafetensorsFile>> files;
    const fs::path whole = fs::path(ckpt_dir) / "model.safetensors";
    if (fs::exists(whole)) {
        files.push_back(std::make_unique<SafetensorsFile>(whole.string()));
        const SafetensorsFile& f = *files.back();
        for (const auto& e : f.entries()) {
            const size_t i = known(whole.string(), e.name);
            if (i == SIZE_MAX) continue;
            const Shape want = whole_shape(specs[i], experts);
            // (f32 as written; a target held in bf16 takes the values rounded)
            TESSERA_CHECK(e.shape == want && e.dtype == DType::f32, "{}: tensor \"{}\" is {} {}, expected f32 {}",
                          whole.string(), e.name, dtype_name(e.dtype), e.shape.str(), want.str());
            sources[e.name].push_back({0, whole_numel(i), f.view(e.name).ptr<float>()});
        }
    } else {
        // the index names the files and every tensor's whole shape, which must be the model's
        const std::string index_path = (fs::path(ckpt_dir) / kModelIndex).string();
        TESSERA_CHECK(fs::exists(index_path), "{}: neither model.safetensors nor {} (corrupted?)", ckpt_dir,
                      kModelIndex);
        const Json index = parse_json(read_text(index_path, kMaxConfigBytes), index_path);
        TESSERA_CHECK(index.is_object() && index.value("format", "") == "tessera ranges" && index.contains("files") &&
                          index["files"].is_array() && !index["files"].empty() && index.contains("tensors") &&
                          index["tensors"].is_object(),
                      "{}: not a tessera model index (corrupted?)", index_path);
        const int world = int(index["files"].size());
        for (int r = 0; r < world; ++r)
            TESSERA_CHECK(index["files"][size_t(r)] == model_file(r, world), "{}: file {} should be {} (corrupted?)",
                          index_path, r, model_file(r, world));
        for (const auto& [name, t] : index["tensors"].items()) {
            const size_t i = known(index_path, name);
            if (i == SIZE_MAX) continue;
            const Json shape = shape_json(whole_shape(specs[i], experts));
            TESSERA_CHECK(t.is_object() && t.value("shape", Json()) == shape, "{}: tensor \"{}\" is {}, expected {}",
                          index_path, name, t.is_object() ? t.value("shape", Json()).dump() : t.dump(), shape.dump());
        }
        for (int r = 0; r < world; ++r) {
            const std::string path = (fs::path(ckpt_dir) / model_file(r, world)).string();
            TESSERA_CHECK(fs::exists(path), "{}: missing (the checkpoint holds the model files of {} ranks)", path,
                          world);
            files.push_back(std::make_unique<SafetensorsFile>(path));
            const SafetensorsFile& f = *files.back();
            TESSERA_CHECK(f.entries().size() == 1 && f.contains("params") && f.entry("params").dtype == DType::f32 &&
                              f.entry("params").shape.ndim == 1,
                          "{}: must hold one f32 tensor \"params\" (corrupted?)", path);
            const int64_t n = f.entry("params").shape[0];
            const float* data = f.view("params").ptr<float>();
            const auto it = f.metadata().find("pieces");
            TESSERA_CHECK(it != f.metadata().end(), "{}: no \"pieces\" metadata (corrupted?)", path);
            std::istringstream lines(it->second);
            std::string name;
            int64_t w0 = 0, length = 0, at = 0;
            while (lines >> name >> w0 >> length >> at) {
                const size_t i = known(path, name);
                if (i == SIZE_MAX) continue;
                TESSERA_CHECK(w0 >= 0 && length > 0 && at >= 0 && at + length <= n && w0 + length <= whole_numel(i),
                              "{}: piece {} {} {} {} is out of range (corrupted?)", path, name, w0, length, at);
                sources[name].push_back({w0, length, data + at});
            }
            TESSERA_CHECK(lines.eof(), "{}: unreadable \"pieces\" metadata (corrupted?)", path);
        }
    }
    for (const ParamTarget& t : targets) {  // each wanted stretch from the pieces that overlap it
        const std::string& name = specs[t.param].name;
        int64_t found = 0;
        for (const Source& src : sources[name]) {
            const int64_t lo = std::max(src.whole_offset, t.whole_offset),
                          hi = std::min(src.whole_offset + src.length, t.whole_offset + t.length);
            if (lo >= hi) continue;
            t.store(lo - t.whole_offset, src.data + (lo - src.whole_offset), hi - lo, ckpt_dir, name);
            found += hi - lo;
        }
        TESSERA_CHECK(found == t.length,
                      "{}: the model files hold {} of the {} elements of \"{}\" wanted here (missing "
                      "or corrupted?)",
                      ckpt_dir, found, t.length, name);
    }
}

void ParamTarget::store(
    int64_t at, const float* src, int64_t n, const std::string& where, const std::string& name) const {
    const float* bad = std::find_if(src, src + n, [](float x) { return !std::isfinite(x); });
    TESSERA_CHECK(bad == src + n,
                  "{}: tensor \"{}\" holds {} at index {} (a diverged run's weights?); refusing to use it", where, name,
                  *bad, whole_offset + at + (bad - src));
    TESSERA_CHECK(at >= 0 && at + n <= length, "{}: {} elements at {} of \"{}\" outside the {} wanted", where, n, at,
                  name, length);
    auto* to = static_cast<std::byte*>(dst);
    if (dtype == DType::f32) {
        copy_bytes(to + at * 4, device, src, Device::cpu, size_t(n) * 4);
        return;
    }
    // narrow: converted where it lives, or in host memory first on a device
    thread_local std::vector<std::byte> staging;
    size_t offset = 0, bytes = 0;
    if (dtype == DType::bf16) {
        offset = size_t(at) * 2;
        bytes = size_t(n) * 2;
    } else {
        TESSERA_CHECK(dtype == DType::mxfp4, "{}: \"{}\" is held as {}", where, name, dtype_name(dtype));
        TESSERA_CHECK(at % kMxfp4Block == 0 && n % kMxfp4Block == 0,  // frozen experts: quantised in blocks of 32
                      "{}: \"{}\" is held in MXFP4, whose blocks of 32 values a piece of {} at {} cuts", where, name, n,
                      whole_offset + at);
        offset = size_t(at / kMxfp4Block * kMxfp4BlockBytes);
        bytes = size_t(n / kMxfp4Block * kMxfp4BlockBytes);
    }
    std::byte* out = to + offset;
    if (device != Device::cpu) {
        staging.resize(bytes);
        out = staging.data();
    }
    if (dtype == DType::bf16) {
        auto* o = reinterpret_cast<bf16*>(out);
        for (int64_t i = 0; i < n; ++i) o[i] = float_to_bf16(src[i]);
    } else {
        f32_to_mxfp4(src, n, reinterpret_cast<uint8_t*>(out));
    }
    if (device != Device::cpu) copy_bytes(to + offset, device, out, Device::cpu, bytes);
}

const void* ParamTarget::host_values(std::vector<std::byte>& staging) const {
    if (device == Device::cpu) return dst;
    staging.resize(dtype_bytes(dtype, length));
    copy_bytes(staging.data(), Device::cpu, dst, device, staging.size());
    return staging.data();
}

Shape whole_shape(const BufferSpec& spec, ExpertSlice experts) {
    Shape s = spec.shape;
    if (spec.sharding == Sharding::expert && experts.total > 0) s[0] = experts.total;
    return s;
}

ParamTarget held_target(size_t param, const BufferSpec& spec, ExpertSlice experts, void* dst, Device device) {
    const int64_t n = spec.shape.numel();
    const bool slice = spec.sharding == Sharding::expert && experts.total > 0;
    return {param, slice ? experts.first * (n / spec.shape[0]) : 0, n, dst, spec.dtype, device};
}

std::vector<ParamTarget> held_targets(const BufferGroup& params, size_t first, size_t last, ExpertSlice experts) {
    std::vector<ParamTarget> targets;
    for (size_t i = first; i < std::min(last, params.size()); ++i) {
        const TensorView v = params.view(i);
        targets.push_back(held_target(i, params.specs()[i], experts, v.data, v.device));
        if (!v.slices) continue;
        // slices stored apart (a base read in place from per-expert tensors): a target each
        const ParamTarget whole = targets.back();
        targets.pop_back();
        const int64_t per = whole.length / v.size(0);
        const bool pairs = v.dtype == DType::mxfp4;  // packed values and scales (core/tensor.h)
        for (int64_t e = 0; e < v.size(0); ++e)
            targets.push_back({i, whole.whole_offset + e * per, per, v.slices[pairs ? 2 * e : e], whole.dtype,
                               whole.device, pairs ? v.slices[2 * e + 1] : nullptr});
    }
    return targets;
}

void load_params(const std::string& ckpt_dir, const BufferGroup& params, ExpertSlice experts, size_t first) {
    load_params(ckpt_dir, params.specs(), held_targets(params, first, params.size(), experts), experts);
}

}  // namespace tessera::train

namespace tessera::train {

void load_optimizer(const std::string& ckpt_dir, AdamW& opt, const std::set<std::string>& elsewhere) {
    // the files of the W ranks that wrote the checkpoint
    const std::regex re(R"(optimizer-(\d{5})-of-(\d{5})\.safetensors)");
    int world = 0;
    for (const auto& e : fs::directory_iterator(ckpt_dir)) {
        std::smatch m;
        const std::string name = e.path().filename().string();
        if (!std::regex_match(name, m, re)) continue;
        const int w = std::stoi(m[2].str());
        TESSERA_CHECK(world == 0 || w == world, "{}: optimizer files of {} and {} ranks (corrupted?)", ckpt_dir, world,
                      w);
        world = w;
    }
    TESSERA_CHECK(world > 0, "{}: no optimizer-RRRRR-of-WWWWW.safetensors (corrupted, or written by an older tessera?)",
                  ckpt_dir);
    // my pieces by parameter name: (whole offset, length, offset in m and v)
    std::map<std::string, std::vector<const StatePiece*>> mine;
    int64_t wanted = 0, found = 0;
    for (const StatePiece& p : opt.pieces()) {
        mine[opt.param_specs()[p.param].name].push_back(&p);
        wanted += p.length;
    }
    std::set<std::string> known;
    for (const BufferSpec& spec : opt.param_specs()) known.insert(spec.name);
    float* m = opt.m().view(0).ptr<float>();
    float* v = opt.v().view(0).ptr<float>();
    const Device device = opt.device();  // (the moments of a device's optimizer: copied piece by piece)
    for (int r = 0; r < world; ++r) {
        const std::string path = (fs::path(ckpt_dir) / optimizer_file(r, world)).string();
        TESSERA_CHECK(fs::exists(path), "{}: missing (the checkpoint holds the optimizer files of {} ranks)", path,
                      world);
        SafetensorsFile f(path);
        int64_t n = -1;
        for (const char* t : {"m", "v"}) {
            TESSERA_CHECK(f.contains(t) && f.entry(t).dtype == DType::f32 && f.entry(t).shape.ndim == 1 &&
                              (n < 0 || f.entry(t).shape[0] == n),
                          "{}: tensor \"{}\" must be f32 [n] like its twin", path, t);
            n = f.entry(t).shape[0];
        }
        TESSERA_CHECK(f.entries().size() == 2, "{}: unexpected tensors besides \"m\" and \"v\"", path);
        const auto it = f.metadata().find("pieces");
        TESSERA_CHECK(it != f.metadata().end(), "{}: no \"pieces\" metadata (corrupted?)", path);
        const Tensor fm = f.load("m"), fv = f.load("v");
        std::istringstream lines(it->second);
        std::string name;
        int64_t whole = 0, length = 0, at = 0;  // at: the piece's offset in the file's m and v
        while (lines >> name >> whole >> length >> at) {
            TESSERA_CHECK(whole >= 0 && length > 0 && at >= 0 && at + length <= n,
                          "{}: piece {} {} {} {} is out of range (corrupted?)", path, name, whole, length, at);
            const auto mp = mine.find(name);
            TESSERA_CHECK(mp != mine.end() || known.count(name) || elsewhere.count(name),
                          "{}: moments of \"{}\", which this model does not have", path, name);
            if (mp != mine.end()) {
                for (const StatePiece* p : mp->second) {  // copy the overlap of the two pieces
                    const int64_t lo = std::max(whole, p->whole_offset),
                                  hi = std::min(whole + length, p->whole_offset + p->length);
                    if (lo >= hi) continue;
                    const size_t bytes = size_t(hi - lo) * sizeof(float);
                    copy_bytes(m + p->state_offset + (lo - p->whole_offset), device,
                               fm.ptr<float>() + at + (lo - whole), Device::cpu, bytes);
                    copy_bytes(v + p->state_offset + (lo - p->whole_offset), device,
                               fv.ptr<float>() + at + (lo - whole), Device::cpu, bytes);
                    found += hi - lo;
                }
            }
        }
        TESSERA_CHECK(lines.eof(), "{}: unreadable \"pieces\" metadata (corrupted?)", path);
    }
    TESSERA_CHECK(found == wanted, "{}: the optimizer files hold {} of the {} moments this rank needs (corrupted?)",
                  ckpt_dir, found, wanted);
    check_finite(opt.m(), ckpt_dir);
    check_finite(opt.v(), ckpt_dir);
    opt.release();
}

}  // namespace tessera::train
