// FSDP / ZeRO-3: units gathered into slots before use, their gradients reduce-scattered after (see fsdp.h).
#include "train/fsdp.h"

#include <algorithm>
#include <cstring>
#include <utility>

#include "core/check.h"
#include "core/device.h"
#include "core/mxfp4.h"

namespace tessera::train {

namespace {
constexpr int64_t kAlignElems = int64_t(kBufferAlign / sizeof(float));

size_t align_up(size_t b) { return (b + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

// A parameter's length in the flat spaces, which count 4-byte words: its elements when f32 (every trained one), half
// of them when bf16 (a frozen base kept in bf16: the frozen region is only ever gathered, never summed, so a cut
// between two words is a cut between elements)
int64_t words(const BufferSpec& s) { return int64_t((s.nbytes() + sizeof(float) - 1) / sizeof(float)); }

void wait_all(std::vector<parallel::Handle>& hs) {
    for (auto& h : hs) h.wait();
    hs.clear();
}
}  // namespace

Fsdp::Fsdp(const model::Model& model,
           const AdamW& opt,
           GradientSum& grads,
           const std::function<std::vector<std::byte*>(size_t)>& outside)
    : specs_(model.param_specs()), frozen_(model.frozen_params()), grads_(grads), outside_(outside) {
    TESSERA_CHECK(opt.regions()[AdamW::data].comm != nullptr, "FSDP needs several data-parallel ranks");
    for (int r : {AdamW::data, AdamW::expert}) {  // the experts too when replicas share them (W / ep > 1)
        const parallel::ShardedRegion& reg = opt.regions()[size_t(r)];
        Region& g = regions_[size_t(r)];
        g.comm = reg.comm;
        g.cut = reg.shard;
        g.base = reg.base;
        if (!g.comm) continue;
        const std::string name = r == AdamW::data ? "params.shard.data" : "params.shard.expert";
        g.shard = BufferGroup(name, {BufferSpec{.name = name,
                                                .dtype = DType::f32,
                                                .shape = Shape{std::max<int64_t>(1, g.cut.longest())},
                                                .kind = BufferKind::param}});
    }
    // the optimizer's flat space: the trained parameters (after the frozen ones). The frozen dense ones form a flat
    // space of their own, cut over the data group the same way; the frozen experts (when replicas share them, W / ep
    // > 1) another, cut over the expert-data group, where each parameter starts and each cut falls on a multiple of
    // `align` words: with MXFP4 experts a multiple of a block's 17 bytes from every parameter's start, so a rank's
    // range of one is whole blocks
    const BufferGroup layout("params", model.trained_specs());  // offsets only
    std::vector<BufferSpec> frozen_dense;
    int64_t expert_words = 0, align = kAlignElems;
    for (size_t i = 0; i < frozen_; ++i) {
        if (specs_[i].sharding == Sharding::data) frozen_dense.push_back(specs_[i]);
        if (specs_[i].dtype == DType::mxfp4) align = kAlignElems * int64_t(kMxfp4BlockBytes);
    }
    const BufferGroup frozen_layout("frozen", frozen_dense);
    flat_.assign(frozen_, 0);
    for (size_t i = 0, k = 0; i < frozen_; ++i) {
        if (specs_[i].sharding == Sharding::data) flat_[i] = frozen_layout.offset(k++) / sizeof(float);
        if (specs_[i].sharding != Sharding::expert) continue;
        flat_[i] = size_t(expert_words);
        expert_words = (expert_words + words(specs_[i]) + align - 1) / align * align;
    }
    for (size_t i = 0; i < layout.size(); ++i) flat_.push_back(layout.offset(i) / sizeof(float));
    std::vector<int64_t> dense_units, expert_units;  // where the units' frozen parts start
    for (const model::ParamUnit& pu : model.param_units()) {
        if (pu.frozen_first < pu.frozen_last) dense_units.push_back(int64_t(flat_[pu.frozen_first]));
        if (pu.frozen_expert_first < pu.frozen_expert_last)
            expert_units.push_back(int64_t(flat_[pu.frozen_expert_first]));
    }
    auto frozen_region = [&](int r, parallel::Comm* comm, int64_t total, int64_t cut_align,
                             std::vector<int64_t> segments, const char* name) {
        Region& g = regions_[size_t(r)];
        g.comm = comm;
        g.cut = parallel::FlatShard(total, comm->rank(), comm->size(), cut_align, std::move(segments), true);
        g.base = 0;
        g.shard = BufferGroup(name, {BufferSpec{.name = name,
                                                .dtype = DType::f32,
                                                .shape = Shape{std::max<int64_t>(1, g.cut.longest())},
                                                .kind = BufferKind::param}});
    };
    if (!frozen_dense.empty() && !outside_)
        frozen_region(kFrozen, opt.regions()[AdamW::data].comm, int64_t(frozen_layout.nbytes() / sizeof(float)),
                      kAlignElems, dense_units, "params.shard.frozen");
    if (expert_words > 0 && !outside_ && opt.regions()[AdamW::expert].comm)
        frozen_region(kFrozenExperts, opt.regions()[AdamW::expert].comm, expert_words, align, expert_units,
                      "params.shard.frozen_experts");
    auto held = [&](size_t i) { return holds_param(i); };
    int64_t scratch = 1;  // elements
    for (const model::ParamUnit& pu : model.param_units()) {
        TESSERA_CHECK(pu.slot >= 0 && pu.slot < kSlots, "FSDP: unit with slot {}", pu.slot);
        Unit u;
        u.slot = pu.slot;
        std::vector<std::pair<size_t, size_t>> ranges;  // trained dense, experts, frozen dense: the non-empty ones
        if (pu.first < pu.last) ranges.push_back({pu.first, pu.last});
        if (pu.expert_first < pu.expert_last && holds(AdamW::expert))
            ranges.push_back({pu.expert_first, pu.expert_last});
        if (pu.frozen_first < pu.frozen_last && holds(kFrozen)) ranges.push_back({pu.frozen_first, pu.frozen_last});
        if (pu.frozen_expert_first < pu.frozen_expert_last && holds(kFrozenExperts))
            ranges.push_back({pu.frozen_expert_first, pu.frozen_expert_last});
        TESSERA_CHECK(!ranges.empty() || outside_, "FSDP: a unit with nothing it shards");
        for (const auto& [first, last] : ranges) {
            Part p;
            const bool expert = specs_[first].sharding == Sharding::expert;
            p.region = first < frozen_ ? (expert ? kFrozenExperts : kFrozen) : expert ? AdamW::expert : AdamW::data;
            const Region& g = regions_[size_t(p.region)];
            const int64_t end = int64_t(flat_[last - 1]) + words(specs_[last - 1]);
            p.lo = int64_t(flat_[first]) - g.base;
            p.hi = (end + kAlignElems - 1) / kAlignElems * kAlignElems - g.base;
            TESSERA_CHECK(p.lo >= 0 && p.hi <= g.cut.total(), "FSDP: unit {} .. {} outside its region",
                          specs_[first].name, specs_[last - 1].name);
            p.piece = g.cut.parts(p.lo, p.hi);  // (the ranks' pieces tile the part in rank order)
            for (int64_t n : p.piece) p.bytes.push_back(n * int64_t(sizeof(float)));
            p.mine_at = g.cut.at(p.lo, p.hi);
            p.mine = p.piece[size_t(g.comm->rank())];
            for (int q = 0; q < g.comm->rank(); ++q) p.mine_off += p.piece[size_t(q)];
            p.at = u.bytes;
            u.bytes = align_up(u.bytes + size_t(p.hi - p.lo) * sizeof(float));
            if (p.region < kFrozen) {  // a round receives a piece from every rank of the group, and packs its own
                std::vector<int64_t> offsets;  // the pieces one after another in the unit's part
                for (int64_t n = 0; int64_t k : p.piece) offsets.push_back(std::exchange(n, n + k));
                p.reduce = parallel::ReduceRounds(p.piece, std::move(offsets));
                scratch = std::max(scratch, p.reduce.scratch_elements());
                u.grad_bytes = u.bytes;
            }
            u.parts.push_back(std::move(p));
            u.specs.push_back({first, last});
        }
        slot_bytes_[size_t(u.slot)] = std::max(slot_bytes_[size_t(u.slot)], u.bytes);
        grad_slot_bytes_[size_t(u.slot)] = std::max(grad_slot_bytes_[size_t(u.slot)], u.grad_bytes);
        units_.push_back(std::move(u));
    }
    // placed groups: what FSDP does not hold packed as usual, then the three slots; the gradient group the same
    // without the frozen parameters (first = frozen_)
    auto place = [&](size_t first, std::array<size_t, kSlots>& slot_at, const std::array<size_t, kSlots>& slot_bytes,
                     const std::string& name, std::vector<BufferSpec> specs) {
        std::vector<size_t> offsets(specs_.size() - first, 0);
        size_t at = 0;
        for (size_t i = first; i < specs_.size(); ++i) {
            if (held(i)) continue;
            if (first == 0 && i < frozen_ && outside_ && !outside_(i).empty()) {  // read in place: place_outside below
                offsets[i] = BufferGroup::kOutside;
                continue;
            }
            offsets[i - first] = at;
            at = align_up(at + specs_[i].nbytes());
        }
        for (int s = 0; s < kSlots; ++s) {
            slot_at[size_t(s)] = at;
            at = align_up(at + slot_bytes[size_t(s)]);
        }
        for (const Unit& u : units_) {
            for (size_t k = 0; k < u.parts.size(); ++k) {
                const Part& p = u.parts[k];
                if (u.specs[k].first < first) continue;  // the gradient group: no frozen parameters
                const int64_t base = regions_[size_t(p.region)].base + p.lo;
                for (size_t i = u.specs[k].first; i < u.specs[k].second; ++i) {
                    TESSERA_CHECK(held(i), "FSDP: unit holds {}, which it does not shard", specs_[i].name);
                    offsets[i - first] = slot_at[size_t(u.slot)] + p.at + (flat_[i] - size_t(base)) * sizeof(float);
                }
            }
        }
        return BufferGroup(name, std::move(specs), offsets, std::max<size_t>(at, kBufferAlign));
    };
    placement_.params = place(0, slot_at_, slot_bytes_, "params", specs_);
    for (size_t i = 0; i < frozen_ && outside_; ++i)
        if (std::vector<std::byte*> at = outside_(i); !at.empty()) placement_.params.place_outside(i, std::move(at));
    placement_.grads = place(frozen_, grad_slot_at_, grad_slot_bytes_, "grads", model::grad_specs(specs_));
    // one scratch serves every reduce-scatter, since every collective of the process runs on its one
    // communication thread, in turn (parallel/comm.h)
    scratch_ = BufferGroup(
        "fsdp.scratch",
        {BufferSpec{
            .name = "fsdp.scratch", .dtype = DType::f32, .shape = Shape{scratch}, .kind = BufferKind::workspace}});
    occupant_.fill(-1);
    incoming_.fill(-1);
}

model::ParamPlacement Fsdp::placement() { return std::move(placement_); }

std::vector<BufferGroup*> Fsdp::groups() {
    std::vector<BufferGroup*> g = {&scratch_};
    for (Region& r : regions_)
        if (r.comm) g.push_back(&r.shard);
    return g;
}

void Fsdp::bind(const BufferGroup& params, const BufferGroup& grads) {
    TESSERA_CHECK(params.size() == specs_.size() && grads.size() == specs_.size() - frozen_,
                  "FSDP: bound to groups of {} and {} parameters, expected {} and {}", params.size(), grads.size(),
                  specs_.size(), specs_.size() - frozen_);
    params_ = &params;
    grads_group_ = &grads;
}

std::span<float> Fsdp::shard(int region) {
    Region& g = regions_[size_t(region)];
    TESSERA_CHECK(g.comm, "FSDP: region {} is not sharded", region);
    return {g.shard.view(0).ptr<float>(), size_t(g.cut.size())};
}

bool Fsdp::holds_param(size_t i) const {
    const Sharding s = specs_[i].sharding;
    if (i < frozen_) return (s == Sharding::data && holds(kFrozen)) || (s == Sharding::expert && holds(kFrozenExperts));
    return s == Sharding::data || (s == Sharding::expert && holds(AdamW::expert));
}

float* Fsdp::mine(const Part& p) { return shard(p.region).data() + p.mine_at; }

void Fsdp::gather(int unit) {
    Unit& u = units_[size_t(unit)];
    const int s = u.slot;
    wait_all(gather_h_[size_t(s)]);
    occupant_[size_t(s)] = -1;
    incoming_[size_t(s)] = unit;
    for (const Part& p : u.parts) {
        gather_h_[size_t(s)].push_back(regions_[size_t(p.region)].comm->all_gather_v_async(
            std::as_bytes(std::span(mine(p), size_t(p.mine))),
            std::span(slot_params(s) + p.at, size_t(p.hi - p.lo) * sizeof(float)), p.bytes));
        stats_.gathered_bytes += (p.hi - p.lo - p.mine) * int64_t(sizeof(float));
    }
    stats_.gathers += 1;
}

void Fsdp::ensure(int unit) {
    const int s = units_[size_t(unit)].slot;
    if (occupant_[size_t(s)] == unit) return;
    if (incoming_[size_t(s)] != unit) gather(unit);
    const double t0 = parallel::now_seconds();
    wait_all(gather_h_[size_t(s)]);
    stats_.wait_seconds += parallel::now_seconds() - t0;
    occupant_[size_t(s)] = unit;
    incoming_[size_t(s)] = -1;
}

void Fsdp::invalidate() {
    for (int s = 0; s < kSlots; ++s) {
        wait_all(gather_h_[size_t(s)]);
        occupant_[size_t(s)] = incoming_[size_t(s)] = -1;
    }
}

void Fsdp::begin(std::span<const model::UnitVisit> plan) {
    TESSERA_CHECK(params_, "FSDP: not bound to the runtime's groups");
    TESSERA_CHECK(cursor_ == plan_.size(), "FSDP: a pass began before the last one ended");
    plan_.assign(plan.begin(), plan.end());
    zero_at_.assign(plan_.size(), 0);
    reduce_at_.assign(plan_.size(), 0);
    // a unit's first backward visit zeroes its slot's gradients, its last reduces them
    seen_.assign(units_.size(), 0);
    for (size_t i = 0; i < plan_.size(); ++i)
        if (plan_[i].backward && !std::exchange(seen_[size_t(plan_[i].unit)], 1)) zero_at_[i] = 1;
    seen_.assign(units_.size(), 0);
    for (size_t i = plan_.size(); i-- > 0;)
        if (plan_[i].backward && !std::exchange(seen_[size_t(plan_[i].unit)], 1)) reduce_at_[i] = 1;
    cursor_ = 0;
    if (!plan_.empty()) {
        const int u = plan_[0].unit, s = units_[size_t(u)].slot;
        if (occupant_[size_t(s)] != u && incoming_[size_t(s)] != u) gather(u);
    }
}

void Fsdp::enter(model::UnitVisit v) {
    TESSERA_CHECK(cursor_ < plan_.size() && plan_[cursor_] == v, "FSDP: the model left its announced plan (visit {})",
                  cursor_);
    const int s = units_[size_t(v.unit)].slot;
    ensure(v.unit);
    if (zero_at_[cursor_]) {  // the slot's gradients start at zero (after the last unit's reduction read them)
        const double t0 = parallel::now_seconds();
        wait_all(reduce_h_[size_t(s)]);
        stats_.wait_seconds += parallel::now_seconds() - t0;
        device_zero(grads_group_->device(), slot_grads(s), units_[size_t(v.unit)].grad_bytes);
    }
    if (cursor_ + 1 < plan_.size()) {  // prefetch the next visit's unit into its slot (another than this one's)
        const int n = plan_[cursor_ + 1].unit, ns = units_[size_t(n)].slot;
        if (ns != s && occupant_[size_t(ns)] != n && incoming_[size_t(ns)] != n) gather(n);
    }
}

void Fsdp::leave(model::UnitVisit v) {
    TESSERA_CHECK(cursor_ < plan_.size() && plan_[cursor_] == v, "FSDP: the model left its announced plan (visit {})",
                  cursor_);
    if (reduce_at_[cursor_]) {  // the unit's gradient of this micro-batch, onto the ranges, in rank order
        Unit& u = units_[size_t(v.unit)];
        const int s = u.slot;
        const TensorView scratch = scratch_.view(0);
        for (Part& p : u.parts) {
            if (p.region >= kFrozen) continue;  // no gradient
            const Region& g = regions_[size_t(p.region)];
            float* recv = grads_.range(p.region).data() + p.mine_at;
            p.reduce.reduce_scatter(*g.comm, reinterpret_cast<const float*>(slot_grads(s) + p.at), recv,
                                    grads_.adding(), std::span(static_cast<std::byte*>(scratch.data), scratch.nbytes()),
                                    reduce_h_[size_t(s)]);
        }
        stats_.reductions += 1;
    }
    ++cursor_;
}

void Fsdp::end() {
    TESSERA_CHECK(cursor_ == plan_.size(), "FSDP: a pass ended after {} of its {} visits", cursor_, plan_.size());
    const double t0 = parallel::now_seconds();
    for (auto& hs : reduce_h_) wait_all(hs);
    stats_.wait_seconds += parallel::now_seconds() - t0;
}

void Fsdp::init(const model::Model& model, uint64_t seed) {
    invalidate();
    std::vector<bool> in_unit(specs_.size(), false);
    for (const Unit& u : units_)
        for (const auto& [first, last] : u.specs)
            std::fill(in_unit.begin() + long(first), in_unit.begin() + long(last), true);
    for (size_t i = 0; i < specs_.size(); ++i)  // (a weight budget's mapped base is read-only: its file's)
        if (!in_unit[i] && !(i < frozen_ && outside_ && !outside_(i).empty()))
            model.init_params(*params_, seed, i, i + 1);
    for (size_t k = 0; k < units_.size(); ++k) {  // each unit whole in its slot, this rank's pieces kept
        const Unit& u = units_[k];
        const Device d = params_->device();
        device_zero(d, slot_params(u.slot), u.bytes);
        for (size_t j = 0; j < u.parts.size(); ++j) {
            const Part& p = u.parts[j];
            model.init_params(*params_, seed, u.specs[j].first, u.specs[j].second);
            copy_bytes(mine(p), d, slot_params(u.slot) + p.at + size_t(p.mine_off) * sizeof(float), d,
                       size_t(p.mine) * sizeof(float));
        }
        occupant_[size_t(u.slot)] = int(k);
    }
}

std::vector<ParamTarget> Fsdp::load_targets(const AdamW& opt, const BufferGroup& params, ExpertSlice experts) {
    std::vector<ParamTarget> targets;
    for (const StatePiece& p : opt.pieces()) {  // this rank's ranges of what FSDP holds
        if (!holds(p.region)) continue;
        targets.push_back({p.param + frozen_, p.whole_offset, p.length, shard(p.region).data() + p.range_offset,
                           DType::f32, params.device()});
    }
    for (size_t i = 0; i < frozen_; ++i) {  // this rank's ranges of the frozen parameters (words: see words())
        if (!holds_param(i)) continue;
        const int r = specs_[i].sharding == Sharding::expert ? kFrozenExperts : kFrozen;
        const Region& g = regions_[size_t(r)];
        const int64_t start = int64_t(flat_[i]), n = words(specs_[i]);
        // elements of words [lo, hi) of the parameter (an MXFP4 one's cut at whole blocks: see the constructor)
        const DType d = specs_[i].dtype;
        auto elements = [&](int64_t w) {
            const int64_t bytes = w * int64_t(sizeof(float));
            return d == DType::mxfp4 ? bytes / int64_t(kMxfp4BlockBytes) * kMxfp4Block : bytes / int64_t(dtype_size(d));
        };
        for (const parallel::FlatShard::Interval& iv : g.cut.mine()) {
            const int64_t lo = std::max(start, iv.lo), hi = std::min(start + n, iv.hi);
            if (hi <= lo) continue;
            const int64_t first = elements(lo - start), count = std::min(elements(hi - start), specs_[i].shape.numel());
            targets.push_back({i, held_target(i, specs_[i], experts, nullptr).whole_offset + first, count - first,
                               shard(r).data() + iv.at + (lo - iv.lo), d, params.device()});
        }
    }
    for (size_t i = 0; i < specs_.size(); ++i) {  // the rest whole (experts: this rank's slice)
        if (holds_param(i)) continue;
        for (const ParamTarget& t : held_targets(params, i, i + 1, experts)) targets.push_back(t);
    }
    return targets;
}

}  // namespace tessera::train
