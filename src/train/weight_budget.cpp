// The frozen base read in place from its files, held to a budget (see weight_budget.h).
#include "train/weight_budget.h"

#include <sys/resource.h>

#include <algorithm>
#include <filesystem>
#include <map>

#include "core/check.h"
#include "core/file.h"
#include "core/mxfp4.h"
#include "model/hf_checkpoint.h"
#include "model/lora.h"

namespace tessera::train {

namespace fs = std::filesystem;

namespace {
int64_t major_faults() {
    rusage u{};
    ::getrusage(RUSAGE_SELF, &u);
    return int64_t(u.ru_majflt);
}

// "model.layers.L." -> L, else -1
int layer_of(const std::string& name) {
    const std::string p = "model.layers.";
    if (!name.starts_with(p)) return -1;
    return std::atoi(name.c_str() + p.size());
}

}  // namespace

WeightBudget::WeightBudget(const ModelSource& source, const model::Model& m, ExpertSlice experts, size_t budget)
    : specs_(m.param_specs()), where_(m.param_specs().size()) {
    stats_.budget_bytes = budget;
    const ModelSource base = source.peft ? open_model_source(source.base) : source;
    const std::vector<BufferSpec>& specs = m.param_specs();
    // stored name -> where it goes, for the frozen parameters that may be read as stored (the same dtype as held and
    // the whole shape): a parameter from the first element of this rank's part, or one expert's slice of it
    struct Place {
        size_t param = 0;
        int64_t offset = 0;  // elements, into the stored tensor
        int64_t slice = -1;  // >= 0: the tensor is this slice of the parameter (an expert here), stored apart
        std::string
            scales;  // an expert held in MXFP4 stored so (K3's): the stored name its packed values, this its scales
    };
    std::map<std::string, std::string> file_of;  // stored name -> file
    std::map<std::string, Place> place_of;
    if (base.hf) {
        std::vector<BufferSpec> whole;
        for (const BufferSpec& s : specs) {
            if (model::is_adapter(s.name)) continue;
            whole.push_back(s);
            whole.back().shape = whole_shape(s, experts);
        }
        const std::map<std::string, std::string> stored = model::stored_tensors(base.path);
        std::map<std::string, size_t> frozen;  // parameter name -> index
        for (size_t k = 0; k < m.frozen_params(); ++k) frozen[specs[k].name] = k;
        for (const model::HfTensor& t : model::hf_tensor_map(whole, base.config, base.model_type)) {
            if (!model::is_plain(t) || t.copy != model::HfTensor::Copy::none) continue;
            const auto f = frozen.find(t.param);
            if (f == frozen.end()) continue;
            std::string name = !t.alias.empty() && !stored.count(t.name) && stored.count(t.alias) ? t.alias : t.name;
            Place at{f->second};
            // MXFP4 in the checkpoint's layout (core/mxfp4.h) read as is by experts held in MXFP4
            const std::string quantised = t.name.substr(0, t.name.size() - std::string("weight").size());
            if (specs[f->second].dtype == DType::mxfp4 && t.expert >= 0 && !stored.count(name) &&
                stored.count(quantised + "weight_packed") && stored.count(quantised + "weight_scale")) {
                name = quantised + "weight_packed";
                at.scales = quantised + "weight_scale";
                file_of[at.scales] = stored.at(at.scales);
            }
            const auto it = stored.find(name);
            if (it == stored.end()) continue;
            const Shape& held = specs[f->second].shape;
            if (t.expert >= 0) {  // one expert of a stacked parameter (per-expert files): this rank's only
                const int64_t first = experts.total > 0 ? experts.first : 0;
                if (t.expert < first || t.expert >= first + held[0]) continue;
                at.slice = t.expert - first;
            } else if (held != t.shape) {
                continue;
            }
            file_of[name] = it->second;
            place_of[name] = at;
        }
    } else {
        const fs::path single = fs::path(base.path) / "model.safetensors";
        TESSERA_CHECK(fs::exists(single),
                      "memory.weights_budget: {} holds its weights as several ranks' ranges; read in place needs one "
                      "model.safetensors (export the base from one process, or drop the budget)",
                      base.path);
        for (size_t i = 0; i < m.frozen_params(); ++i) {
            const BufferSpec& s = specs[i];
            const bool slice = s.sharding == Sharding::expert && experts.total > 0;
            file_of[s.name] = single.string();
            place_of[s.name] = {i, slice ? experts.first * (s.shape.numel() / s.shape[0]) : 0};
        }
    }
    std::map<std::string, SafetensorsFile*> opened;
    auto open = [&](const std::string& name) {
        SafetensorsFile*& f = opened[file_of.at(name)];
        if (!f) {
            files_.push_back(std::make_unique<SafetensorsFile>(file_of.at(name)));
            f = files_.back().get();
        }
        return f->contains(name) ? f : nullptr;
    };
    for (const auto& [name, at] : place_of) {
        SafetensorsFile* f = open(name);
        if (!f) continue;
        const BufferSpec& s = specs[at.param];
        const SafetensorsEntry& e = f->entry(name);
        Shape want = whole_shape(s, experts);
        if (at.slice >= 0) want = Shape::from_span(std::span(s.shape.dims).subspan(1, size_t(s.shape.ndim - 1)));
        std::vector<std::byte*>& w = where_[at.param];
        if (!at.scales.empty()) {  // two pieces an expert: its packed values and its scales
            SafetensorsFile* fs = open(at.scales);
            const int64_t rows = want[0], cols = want[1];
            if (!fs || want.ndim != 2 || e.dtype != DType::u8 || e.shape != (Shape{rows, cols / 2}) ||
                fs->entry(at.scales).dtype != DType::u8 || fs->entry(at.scales).shape != (Shape{rows, cols / 32}))
                continue;  // (then it loads, and the load names what is wrong)
            auto* packed = static_cast<std::byte*>(f->view(name).data);
            auto* scales = static_cast<std::byte*>(fs->view(at.scales).data);
            check_mxfp4(reinterpret_cast<const uint8_t*>(packed), reinterpret_cast<const uint8_t*>(scales), rows, cols,
                        name.substr(0, name.size() - std::string("_packed").size()));  // (the parameter's name)
            w.resize(size_t(2 * s.shape[0]), nullptr);
            w[size_t(2 * at.slice)] = packed;
            w[size_t(2 * at.slice + 1)] = scales;
            continue;
        }
        if (e.dtype != s.dtype || e.shape != want || !f->is_aligned(name)) continue;
        std::byte* data = static_cast<std::byte*>(f->view(name).data) + dtype_bytes(s.dtype, at.offset);
        if (at.slice < 0) {
            w = {data};
        } else {
            w.resize(size_t(s.shape[0]), nullptr);
            w[size_t(at.slice)] = data;
        }
    }
    // a parameter stored apart is mapped when every slice of it is
    for (std::vector<std::byte*>& w : where_)
        if (std::count(w.begin(), w.end(), nullptr) > 0) w.clear();
    // parameters read together as one tensor (BufferSpec::fused_next) are mapped only when the file keeps them back
    // to back in that order (tessera's files do; a Hugging Face file sorted by name may not: then they load)
    for (size_t i = 0; i < specs.size();) {
        size_t j = i;
        auto one = [&](size_t k) { return where_[k].size() == 1; };
        bool whole = one(i);
        for (; specs[j].fused_next && j + 1 < specs.size(); ++j)
            whole = whole && one(j + 1) && where_[j][0] + specs[j].nbytes() == where_[j + 1][0];
        if (!whole && j > i)
            for (size_t k = i; k <= j; ++k) where_[k].clear();
        i = j + 1;
    }
    for (size_t i = 0; i < specs.size(); ++i)
        if (mapped(i)) stats_.mapped_bytes += specs[i].nbytes();
    // pieces per unit: a unit's frozen dense parameters, and each MoE layer's frozen experts one piece an expert
    const std::vector<model::ParamUnit>& units = m.param_units();
    unit_pieces_.resize(units.size());
    std::vector<int> unit_of(specs.size(), -1);
    std::map<int, int> unit_of_layer;
    for (size_t u = 0; u < units.size(); ++u) {
        for (size_t i = units[u].frozen_first; i < units[u].frozen_last; ++i) {
            unit_of[i] = int(u);
            if (layer_of(specs[i].name) >= 0) unit_of_layer[layer_of(specs[i].name)] = int(u);
        }
        for (size_t i = units[u].frozen_expert_first; i < units[u].frozen_expert_last; ++i) unit_of[i] = int(u);
    }
    for (size_t i = 0; i < specs.size(); ++i) {
        if (!mapped(i)) continue;
        const BufferSpec& s = specs[i];
        const int layer = layer_of(s.name);
        int unit = unit_of[i];
        if (unit < 0 && unit_of_layer.count(layer)) unit = unit_of_layer.at(layer);
        auto add = [&](const std::byte* data, size_t bytes, int64_t expert) {
            pieces_.push_back({data, bytes, unit, layer, expert});
            if (unit >= 0) unit_pieces_[size_t(unit)].push_back(pieces_.size() - 1);
        };
        if (s.dtype == DType::mxfp4) {  // (in the checkpoint's layout: its packed values, then its scales)
            const size_t values = size_t(s.shape.numel() / s.shape[0]);
            for (int64_t e = 0; e < s.shape[0]; ++e) {
                add(where_[i][size_t(2 * e)], values / 2, experts.first + e);
                add(where_[i][size_t(2 * e + 1)], values / size_t(kMxfp4Block), experts.first + e);
            }
        } else if (s.sharding == Sharding::expert) {
            const size_t per = s.nbytes() / size_t(s.shape[0]);
            for (int64_t e = 0; e < s.shape[0]; ++e) {
                const std::byte* at = where_[i].size() == 1 ? where_[i][0] + size_t(e) * per : where_[i][size_t(e)];
                add(at, per, experts.first + e);
            }
        } else {
            add(where_[i][0], s.nbytes(), -1);
        }
    }
    std::vector<size_t> unit_bytes;
    for (const auto& list : unit_pieces_) {
        size_t b = 0;
        for (size_t k : list) b += pieces_[k].bytes;
        unit_bytes.push_back(b);
    }
    std::sort(unit_bytes.rbegin(), unit_bytes.rend());
    for (size_t k = 0; k < std::min<size_t>(2, unit_bytes.size()); ++k) stats_.floor_bytes += unit_bytes[k];
    resident_.assign(pieces_.size(), 0);
    for (const Piece& p : pieces_) release_pages(p.data, p.bytes);  // opening the files read them (their checksum)
    faults_at_start_ = major_faults();
    thread_ = std::thread([this] { worker(); });
}

WeightBudget::~WeightBudget() {
    {
        std::lock_guard lock(mu_);
        stop_ = true;
    }
    cv_.notify_all();
    thread_.join();
}

model::ParamPlacement WeightBudget::placement() const {
    // the unmapped parameters packed back to back as the runtime packs them; the mapped ones outside the block
    // (bind() points them into the files)
    std::vector<size_t> offsets(specs_.size(), BufferGroup::kOutside);
    size_t at = 0;
    for (size_t i = 0; i < specs_.size(); ++i) {
        if (mapped(i)) continue;
        offsets[i] = at;
        at = (at + specs_[i].nbytes() + kBufferAlign - 1) / kBufferAlign * kBufferAlign;
    }
    model::ParamPlacement p{BufferGroup("params", specs_, offsets, std::max<size_t>(at, kBufferAlign)),
                            BufferGroup("grads", model::grad_specs(specs_))};
    for (size_t i = 0; i < where_.size(); ++i)
        if (mapped(i)) p.params.place_outside(i, where_[i]);
    return p;
}

std::vector<ParamTarget> WeightBudget::unmapped(const std::vector<ParamTarget>& targets) const {
    std::vector<ParamTarget> out;
    for (const ParamTarget& t : targets)
        if (!mapped(t.param)) out.push_back(t);
    return out;
}

void WeightBudget::observe(const model::StepStats& s) {
    for (const auto& [layer, st] : s.moe) {
        if (layer < 0) continue;
        if (load_.size() <= size_t(layer)) load_.resize(size_t(layer) + 1);
        std::vector<int64_t>& l = load_[size_t(layer)];
        if (l.size() < st.load.load.size()) l.resize(st.load.load.size(), 0);
        for (size_t e = 0; e < st.load.load.size(); ++e) l[e] += st.load.load[e];
    }
}

size_t WeightBudget::resident(const Piece& p) { return resident_bytes(p.data, p.bytes, scratch_); }

int64_t WeightBudget::load_of(const Piece& p) const {
    if (p.expert < 0) return INT64_MAX;  // dense: kept over any expert of its unit
    const bool known =
        p.layer >= 0 && size_t(p.layer) < load_.size() && size_t(p.expert) < load_[size_t(p.layer)].size();
    return known ? load_[size_t(p.layer)][size_t(p.expert)] : 0;
}

void WeightBudget::release_until(size_t budget, int keep_a, int keep_b) {
    size_t total = 0;
    order_.clear();
    // the next use of each unit: its first visit after the cursor (or in the next pass, further)
    std::vector<size_t>& next = next_use_;
    next.assign(unit_pieces_.size(), SIZE_MAX / 4);
    for (size_t k = 0; k < plan_.size(); ++k) {
        const int u = plan_[k].unit;
        if (u < 0 || size_t(u) >= next.size()) continue;
        next[size_t(u)] = std::min(next[size_t(u)], k > cursor_ ? k - cursor_ : plan_.size() + k - cursor_);
    }
    for (size_t k = 0; k < pieces_.size(); ++k) {
        const size_t r = resident(pieces_[k]);
        resident_[k] = r;
        total += r;
    }
    stats_.resident_bytes = total;
    stats_.peak_resident_bytes = std::max(stats_.peak_resident_bytes, total);
    if (total <= budget) return;
    for (size_t k = 0; k < pieces_.size(); ++k) {
        const Piece& p = pieces_[k];
        if (resident_[k] == 0 || p.unit == keep_a || p.unit == keep_b) continue;
        order_.push_back({p.unit >= 0 ? next[size_t(p.unit)] : SIZE_MAX / 2, load_of(p), k});
    }
    // farthest next use first; within a unit its experts least routed first, its dense weights last
    std::sort(order_.begin(), order_.end(), [](const Candidate& a, const Candidate& b) {
        if (a.distance != b.distance) return a.distance > b.distance;
        return std::pair(a.load, a.piece) < std::pair(b.load, b.piece);
    });
    for (const Candidate& c : order_) {
        if (total <= budget) break;
        release_pages(pieces_[c.piece].data, pieces_[c.piece].bytes);
        total -= std::min(total, resident_[c.piece]);
        stats_.released_bytes += int64_t(resident_[c.piece]);
    }
    stats_.resident_bytes = total;
}

void WeightBudget::trim() {
    release_until(stats_.budget_bytes, -1, -1);
    stats_.peak_resident_bytes = stats_.resident_bytes;  // loading and hashing read everything once
}

WeightBudgetStats WeightBudget::stats() {
    stats_.major_faults = major_faults() - faults_at_start_;
    std::lock_guard lock(mu_);
    stats_.prefetched_bytes = prefetched_;
    return stats_;
}

void WeightBudget::begin(std::span<const model::UnitVisit> plan) {
    plan_.assign(plan.begin(), plan.end());
    cursor_ = 0;
}

void WeightBudget::enter(model::UnitVisit v) {
    while (cursor_ < plan_.size() && !(plan_[cursor_].unit == v.unit && plan_[cursor_].backward == v.backward))
        ++cursor_;
    const int next = cursor_ + 1 < plan_.size() ? plan_[cursor_ + 1].unit : -1;
    if (next >= 0 && next != v.unit) prefetch(next);
}

void WeightBudget::leave(model::UnitVisit v) {
    const int next = cursor_ + 1 < plan_.size() ? plan_[cursor_ + 1].unit : -1;
    release_until(stats_.budget_bytes, v.unit, next);
}

void WeightBudget::prefetch(int unit) {
    // its dense pieces, then its experts most routed first, up to half the budget
    std::lock_guard lock(mu_);
    queue_.clear();
    size_t bytes = 0;
    for (size_t k : unit_pieces_[size_t(unit)]) {
        if (pieces_[k].expert < 0) queue_.push_back({pieces_[k].data, pieces_[k].bytes});
    }
    std::vector<std::pair<int64_t, size_t>>& experts = prefetch_order_;
    experts.clear();
    for (size_t k : unit_pieces_[size_t(unit)])
        if (pieces_[k].expert >= 0) experts.push_back({load_of(pieces_[k]), k});
    std::stable_sort(experts.begin(), experts.end(), [](auto& a, auto& b) { return a.first > b.first; });
    for (const auto& q : queue_) bytes += q.second;
    for (const auto& [load, k] : experts) {
        if (bytes + pieces_[k].bytes > stats_.budget_bytes / 2) break;
        queue_.push_back({pieces_[k].data, pieces_[k].bytes});
        bytes += pieces_[k].bytes;
    }
    pending_ = true;
    cv_.notify_all();
}

void WeightBudget::worker() {
    std::vector<std::pair<const std::byte*, size_t>> work;
    std::vector<uint64_t> scratch;
    for (;;) {
        {
            std::unique_lock lock(mu_);
            cv_.wait(lock, [&] { return stop_ || pending_; });
            if (stop_) return;
            work.swap(queue_);
            pending_ = false;
        }
        int64_t fetched = 0;
        for (const auto& [data, bytes] : work) {
            const size_t before = resident_bytes(data, bytes, scratch);
            touch_pages(data, bytes);
            fetched += int64_t(bytes > before ? bytes - before : 0);
        }
        std::lock_guard lock(mu_);
        prefetched_ += fetched;
    }
}

}  // namespace tessera::train
