// FSDP / ZeRO-3: units gathered into slots before use, their gradients reduce-scattered after (see fsdp.h).
#include "train/fsdp.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"

namespace tessera::train {

namespace {
constexpr int64_t kAlignElems = int64_t(kBufferAlign / sizeof(float));

size_t align_up(size_t b) { return (b + kBufferAlign - 1) / kBufferAlign * kBufferAlign; }

parallel::Comm& data_group(const AdamW& opt) {
    parallel::Comm* c = opt.regions()[AdamW::data].comm;
    TESSERA_CHECK(c != nullptr, "FSDP needs several data-parallel ranks");
    return *c;
}
}  // namespace

Fsdp::Fsdp(const model::Model& model, const AdamW& opt, GradientSum& grads)
    : specs_(model.param_specs()),
      grads_(grads),
      comm_(data_group(opt)),
      cut_(opt.regions()[AdamW::data].shard),
      region_base_(opt.regions()[AdamW::data].base) {
    const BufferGroup layout("params", specs_);  // offsets only
    for (size_t i = 0; i < specs_.size(); ++i) flat_.push_back(layout.offset(i) / sizeof(float));
    const int W = comm_.size();
    for (const model::ParamUnit& pu : model.param_units()) {
        Unit u;
        u.first = pu.first;
        u.last = pu.last;
        u.slot = pu.slot;
        TESSERA_CHECK(pu.slot >= 0 && pu.slot < kSlots && pu.first < pu.last, "FSDP: unit with slot {}", pu.slot);
        const int64_t end = int64_t(flat_[pu.last - 1]) + specs_[pu.last - 1].shape.numel();
        u.lo = int64_t(flat_[pu.first]) - region_base_;
        u.hi = (end + kAlignElems - 1) / kAlignElems * kAlignElems - region_base_;
        TESSERA_CHECK(u.lo >= 0 && u.hi <= cut_.total, "FSDP: unit {} .. {} outside the data region",
                      specs_[pu.first].name, specs_[pu.last - 1].name);
        u.piece = cut_.parts(u.lo, u.hi, W);
        u.mine_lo = std::clamp(u.lo, cut_.lo, cut_.hi);
        u.mine = u.piece[size_t(comm_.rank())];
        slot_bytes_[size_t(u.slot)] = std::max(slot_bytes_[size_t(u.slot)], size_t(u.hi - u.lo) * sizeof(float));
        units_.push_back(std::move(u));
    }
    // placed groups: replicated and expert parameters packed as usual, then the three slots
    std::vector<size_t> offsets(specs_.size(), 0);
    size_t at = 0;
    for (size_t i = 0; i < specs_.size(); ++i) {
        if (specs_[i].sharding == Sharding::data) continue;
        offsets[i] = at;
        at = align_up(at + specs_[i].nbytes());
    }
    for (int s = 0; s < kSlots; ++s) {
        slot_at_[size_t(s)] = at;
        at = align_up(at + slot_bytes_[size_t(s)]);
    }
    for (const Unit& u : units_) {
        for (size_t i = u.first; i < u.last; ++i) {
            TESSERA_CHECK(specs_[i].sharding == Sharding::data, "FSDP: unit holds {}, which is not Sharding::data",
                          specs_[i].name);
            offsets[i] = slot_at_[size_t(u.slot)] + (flat_[i] - size_t(region_base_ + u.lo)) * sizeof(float);
        }
    }
    placement_.params = BufferGroup("params", specs_, offsets, std::max<size_t>(at, kBufferAlign));
    placement_.grads = BufferGroup("grads", model::grad_specs(specs_), offsets, std::max<size_t>(at, kBufferAlign));
    shard_ = BufferGroup("params.shard", {BufferSpec{.name = "params.shard",
                                                     .dtype = DType::f32,
                                                     .shape = Shape{std::max<int64_t>(1, cut_.per_rank)},
                                                     .kind = BufferKind::param}});
    // a unit's reduce-scatter receives W pieces of this rank's share of it; one buffer serves them all, since
    // every collective of the process runs on its one communication thread, in turn (parallel/comm.h)
    int64_t scratch = 1;
    for (const Unit& u : units_) scratch = std::max(scratch, u.mine * W);
    scratch_ = BufferGroup(
        "fsdp.scratch",
        {BufferSpec{
            .name = "fsdp.scratch", .dtype = DType::f32, .shape = Shape{scratch}, .kind = BufferKind::workspace}});
    occupant_.fill(-1);
    incoming_.fill(-1);
}

model::ParamPlacement Fsdp::placement() { return std::move(placement_); }

std::vector<BufferGroup*> Fsdp::groups() { return {&shard_, &scratch_}; }

void Fsdp::bind(const BufferGroup& params, const BufferGroup& grads) {
    TESSERA_CHECK(params.size() == specs_.size() && grads.size() == specs_.size(),
                  "FSDP: bound to groups of {} and {} parameters, expected {}", params.size(), grads.size(),
                  specs_.size());
    params_ = &params;
    grads_group_ = &grads;
}

std::span<float> Fsdp::shard() { return {shard_.view(0).ptr<float>(), size_t(cut_.size())}; }

float* Fsdp::slot_params(int slot) const { return reinterpret_cast<float*>(params_->base() + slot_at_[size_t(slot)]); }

float* Fsdp::slot_grads(int slot) const {
    return reinterpret_cast<float*>(grads_group_->base() + slot_at_[size_t(slot)]);
}

void Fsdp::gather(int unit) {
    const Unit& u = units_[size_t(unit)];
    const int s = u.slot;
    gather_h_[size_t(s)].wait();
    occupant_[size_t(s)] = -1;
    incoming_[size_t(s)] = unit;
    std::vector<int64_t> bytes(u.piece.size());
    for (size_t q = 0; q < bytes.size(); ++q) bytes[q] = u.piece[q] * int64_t(sizeof(float));
    const float* mine = shard().data() + (u.mine_lo - cut_.lo);
    gather_h_[size_t(s)] =
        comm_.all_gather_v_async(std::as_bytes(std::span(mine, size_t(u.mine))),
                                 std::as_writable_bytes(std::span(slot_params(s), size_t(u.hi - u.lo))), bytes);
    stats_.gathers += 1;
    stats_.gathered_bytes += (u.hi - u.lo - u.mine) * int64_t(sizeof(float));
}

void Fsdp::ensure(int unit) {
    const int s = units_[size_t(unit)].slot;
    if (occupant_[size_t(s)] == unit) return;
    if (incoming_[size_t(s)] != unit) gather(unit);
    const double t0 = parallel::now_seconds();
    gather_h_[size_t(s)].wait();
    stats_.wait_seconds += parallel::now_seconds() - t0;
    occupant_[size_t(s)] = unit;
    incoming_[size_t(s)] = -1;
}

void Fsdp::invalidate() {
    for (int s = 0; s < kSlots; ++s) {
        gather_h_[size_t(s)].wait();
        occupant_[size_t(s)] = incoming_[size_t(s)] = -1;
    }
}

void Fsdp::begin(std::span<const model::UnitVisit> plan) {
    TESSERA_CHECK(params_, "FSDP: not bound to the runtime's groups");
    TESSERA_CHECK(cursor_ == plan_.size(), "FSDP: a pass began before the last one ended");
    plan_.assign(plan.begin(), plan.end());
    zero_at_.assign(plan_.size(), 0);
    reduce_at_.assign(plan_.size(), 0);
    for (size_t i = 0; i < plan_.size(); ++i) {
        if (!plan_[i].backward) continue;
        bool first = true, last = true;
        for (size_t k = 0; k < plan_.size(); ++k) {
            if (!plan_[k].backward || plan_[k].unit != plan_[i].unit) continue;
            first = first && !(k < i);
            last = last && !(k > i);
        }
        zero_at_[i] = first;
        reduce_at_[i] = last;
    }
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
        reduce_h_[size_t(s)].wait();
        stats_.wait_seconds += parallel::now_seconds() - t0;
        const Unit& u = units_[size_t(v.unit)];
        std::memset(slot_grads(s), 0, size_t(u.hi - u.lo) * sizeof(float));
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
        const Unit& u = units_[size_t(v.unit)];
        const int s = u.slot;
        float* recv = grads_.data_range().data() + (u.mine_lo - cut_.lo);
        const TensorView scratch = scratch_.view(0);
        reduce_h_[size_t(s)] =
            comm_.reduce_scatter_v_async(DType::f32, slot_grads(s), u.piece, recv, u.mine, grads_.adding(),
                                         std::span(static_cast<std::byte*>(scratch.data), scratch.nbytes()));
        stats_.reductions += 1;
    }
    ++cursor_;
}

void Fsdp::end() {
    TESSERA_CHECK(cursor_ == plan_.size(), "FSDP: a pass ended after {} of its {} visits", cursor_, plan_.size());
    const double t0 = parallel::now_seconds();
    for (auto& h : reduce_h_) h.wait();
    stats_.wait_seconds += parallel::now_seconds() - t0;
}

void Fsdp::init(const model::Model& model, uint64_t seed) {
    invalidate();
    for (size_t i = 0; i < specs_.size(); ++i)
        if (specs_[i].sharding != Sharding::data) model.init_params(*params_, seed, i, i + 1);
    for (size_t k = 0; k < units_.size(); ++k) {  // each unit whole in its slot, this rank's piece kept
        const Unit& u = units_[k];
        float* slot = slot_params(u.slot);
        std::fill_n(slot, u.hi - u.lo, 0.0f);
        model.init_params(*params_, seed, u.first, u.last);
        std::copy_n(slot + (u.mine_lo - u.lo), u.mine, shard().data() + (u.mine_lo - cut_.lo));
        occupant_[size_t(u.slot)] = int(k);
    }
}

}  // namespace tessera::train
