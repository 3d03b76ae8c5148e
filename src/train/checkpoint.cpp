// Checkpoint save / load / discovery.
#include "train/checkpoint.h"

#include <unistd.h>

#include <charconv>
#include <filesystem>
#include <regex>

#include "core/check.h"
#include "core/file.h"
#include "core/safetensors.h"
#include "train/config.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {
constexpr int kFormat = 1;

// Tensors of a group under their spec names (optimizer state is named "m.<param>" in its group).
std::vector<NamedTensor> named(const BufferGroup& g) {
    std::vector<NamedTensor> out;
    for (size_t i = 0; i < g.size(); ++i) out.push_back({g.specs()[i].name, g.view(i)});
    return out;
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

std::string save_checkpoint(const std::string& run_dir, const CheckpointContents& c) {
    const fs::path root = fs::path(run_dir) / "checkpoints";
    fs::create_directories(root);
    const std::string name = fmt::format("step_{:07d}", c.state.step);
    const fs::path final_dir = root / name;
    const fs::path tmp = root / fmt::format(".{}.tmp-{}", name, writer_tag());
    std::error_code ec;
    fs::remove_all(tmp, ec);
    fs::create_directories(tmp);
    try {
        write_text_atomic((tmp / "config.json").string(), c.config.dump(2) + "\n");
        write_safetensors((tmp / "model.safetensors").string(), named(c.params), {{"format", "tessera"}});
        if (c.m && c.v) {
            std::vector<NamedTensor> opt = named(*c.m);
            for (auto& t : named(*c.v)) opt.push_back(t);
            write_safetensors((tmp / "optimizer.safetensors").string(), opt,
                              {{"optimizer", "adamw"}, {"step", std::to_string(c.state.optimizer_step)}});
        }
        Json st = {{"format", kFormat},
                   {"step", c.state.step},
                   {"optimizer_step", c.state.optimizer_step},
                   {"tokens_seen", c.state.tokens_seen},
                   {"data", {{"epoch", c.state.data.epoch}, {"cursor", c.state.data.cursor}}}};
        write_text_atomic((tmp / "trainer_state.json").string(), st.dump(2) + "\n");
        fsync_path(tmp.string());
        if (fs::exists(final_dir)) {  // re-saving a step: move the old one aside first
            const fs::path old = root / fmt::format(".{}.old-{}", name, writer_tag());
            fs::rename(final_dir, old);
            fs::rename(tmp, final_dir);
            fs::remove_all(old, ec);
        } else {
            fs::rename(tmp, final_dir);
        }
        fsync_path(root.string());
    } catch (const fs::filesystem_error& e) {
        fs::remove_all(tmp, ec);
        TESSERA_FAIL("checkpoint {}: {}", final_dir.string(), e.what());
    } catch (...) {
        fs::remove_all(tmp, ec);
        throw;
    }
    return final_dir.string();
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
    TESSERA_CHECK(get(j, "format") == kFormat, "{}: checkpoint format {} is not supported (expected {})", path,
                  get(j, "format"), kFormat);
    TrainerState s;
    s.step = get(j, "step");
    s.optimizer_step = get(j, "optimizer_step");
    s.tokens_seen = get(j, "tokens_seen");
    TESSERA_CHECK(j.contains("data") && j["data"].is_object(), "{}: missing \"data\"", path);
    s.data.epoch = get(j["data"], "epoch");
    s.data.cursor = get(j["data"], "cursor");
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

void load_groups(const std::string& file, const std::vector<const BufferGroup*>& groups) {
    SafetensorsFile f(file);
    size_t expected = 0;
    for (const BufferGroup* g : groups) {
        for (size_t i = 0; i < g->size(); ++i) {
            const std::string& name = g->specs()[i].name;
            TESSERA_CHECK(f.contains(name), "{}: missing tensor \"{}\"", file, name);
            f.load_into(name, g->view(i));
        }
        expected += g->size();
        check_finite(*g, file);
    }
    if (f.entries().size() != expected) {
        for (const auto& e : f.entries()) {
            bool known = false;
            for (const BufferGroup* g : groups) known = known || g->index_of(e.name) >= 0;
            TESSERA_CHECK(known, "{}: unexpected tensor \"{}\" (a checkpoint of another model?)", file, e.name);
        }
    }
}

}  // namespace tessera::train
