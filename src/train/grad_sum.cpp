// The step's gradient sum (see grad_sum.h).
#include "train/grad_sum.h"

#include <algorithm>
#include <cstring>

#include "core/check.h"
#include "core/device.h"
#include "ops/adamw.h"

namespace tessera::train {

namespace {
constexpr const char* kRegionName[] = {"replicated", "data", "expert"};

float* first(const BufferGroup& g) { return reinterpret_cast<float*>(g.base()); }
}  // namespace

GradientSum::GradientSum(const AdamW& opt, int64_t accumulation, bool fsdp)
    : opt_(opt), regions_(opt.regions()), accumulation_(accumulation), fsdp_(fsdp) {
    TESSERA_CHECK(accumulation >= 1, "GradientSum: {} micro-batches per step", accumulation);
    TESSERA_CHECK(!fsdp || regions_[AdamW::data].comm, "GradientSum: FSDP without ranks to shard over");
    int64_t scratch_elems = 0;
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        // shared: the reduce-scatters write whole ranges; local: the sum of micro-batches, when there are several
        const int64_t n = reg.comm ? reg.shard.longest() : accumulation > 1 ? reg.shard.total() : 0;
        if (n == 0) continue;
        const std::string name = fmt::format("grad.{}.{}", reg.comm ? "range" : "sum", kRegionName[r]);
        sum_[r] = BufferGroup(
            name, {BufferSpec{.name = name, .dtype = DType::f32, .shape = Shape{n}, .kind = BufferKind::grad}});
        if (!reg.comm || by_fsdp(r)) continue;
        std::vector<int64_t> pieces, offsets;  // every rank's range, where it starts in the region
        for (int q = 0; q < reg.comm->size(); ++q) {
            const auto [lo, hi] = reg.shard.stretch_of(q);
            pieces.push_back(hi - lo);
            offsets.push_back(lo);
        }
        rounds_[r] = parallel::ReduceRounds(std::move(pieces), std::move(offsets));
        scratch_elems = std::max(scratch_elems, rounds_[r].scratch_elements());
    }
    for (size_t r = 0; r < AdamW::kRegions; ++r) {  // HSDP: the replicas' ranges, cut into one piece per replica
        const parallel::ShardedRegion& reg = regions_[r];
        if (!reg.replicas) continue;
        const int64_t n = reg.shard.size(), R = reg.replicas->size(), each = (n + R - 1) / R;
        std::vector<int64_t> pieces, offsets;
        for (int64_t q = 0; q < R; ++q) {
            offsets.push_back(std::min(n, q * each));
            pieces.push_back(std::min(n, (q + 1) * each) - offsets.back());
        }
        replica_rounds_[r] = parallel::ReduceRounds(std::move(pieces), std::move(offsets));
        scratch_elems = std::max(scratch_elems, replica_rounds_[r].scratch_elements());
    }
    if (scratch_elems > 0)
        scratch_ = BufferGroup("grad.scratch", {BufferSpec{.name = "grad.scratch",
                                                           .dtype = DType::f32,
                                                           .shape = Shape{scratch_elems},
                                                           .kind = BufferKind::workspace}});
}

std::vector<BufferGroup*> GradientSum::groups() {
    std::vector<BufferGroup*> g;
    for (auto& s : sum_)
        if (s.size() > 0) g.push_back(&s);
    if (scratch_.size() > 0) g.push_back(&scratch_);
    return g;
}

void GradientSum::before(int64_t micro, const BufferGroup& grads) {
    wait();  // the last micro-batch's reductions read the gradients
    micro_ = micro;
    grads.zero();
}

void GradientSum::wait() {
    for (auto& h : pending_) h.wait();
    pending_.clear();
}

void GradientSum::after(int64_t micro, const BufferGroup& grads) {
    TESSERA_CHECK(micro == micro_, "GradientSum: micro-batch {} ends, {} began", micro, micro_);
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        const float* g = opt_.region_base(grads, r);
        if (!g || by_fsdp(r)) continue;
        if (reg.comm) {  // this micro-batch of every rank, in rank order, onto the ranges, a round at a time
            const TensorView scratch = scratch_.view(0);
            rounds_[r].reduce_scatter(*reg.comm, g, first(sum_[r]), micro > 0,
                                      std::span(static_cast<std::byte*>(scratch.data), scratch.nbytes()), pending_);
            continue;
        }
        if (accumulation_ == 1) continue;  // the model's gradients are the sum
        const Device d = grads.device();
        const TensorView s(first(sum_[r]), DType::f32, Shape{reg.shard.total()}, d),
            gv(const_cast<float*>(g), DType::f32, Shape{reg.shard.total()}, d);
        if (micro == 0) {
            copy_bytes(s.data, d, gv.data, d, s.nbytes());
            continue;
        }
        ops::add_vector(gv, s);
    }
}

GradRanges GradientSum::finish(const BufferGroup& grads) {
    wait();
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        // HSDP: each shard group summed its ranks' gradients; the replicas' sums are added in replica order (a
        // reduce-scatter of the range's pieces in place, then each piece broadcast by its replica)
        const parallel::ShardedRegion& reg = regions_[r];
        if (!reg.replicas) continue;
        parallel::ReduceRounds& rr = replica_rounds_[r];
        float* range = first(sum_[r]);
        const TensorView scratch = scratch_.view(0);
        rr.reduce_scatter(*reg.replicas, range, range + rr.offsets[size_t(reg.replicas->rank())], false,
                          std::span(static_cast<std::byte*>(scratch.data), scratch.nbytes()), pending_);
        for (int q = 0; q < reg.replicas->size(); ++q)
            pending_.push_back(reg.replicas->broadcast_async(
                std::as_writable_bytes(std::span(range + rr.offsets[size_t(q)], size_t(rr.pieces[size_t(q)]))), q));
        wait();
    }
    GradRanges out;
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        float* at = reg.comm || accumulation_ > 1 ? first(sum_[r]) : opt_.region_base(grads, r);
        out.region[r] = at ? std::span<float>(at, size_t(reg.shard.size())) : std::span<float>();
    }
    return out;
}

bool GradientSum::by_fsdp(size_t r) const {
    return fsdp_ && regions_[r].comm && (r == AdamW::data || r == AdamW::expert);
}

std::span<float> GradientSum::range(int region) {
    return {first(sum_[size_t(region)]), size_t(regions_[size_t(region)].shard.size())};
}

}  // namespace tessera::train
