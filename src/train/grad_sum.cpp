// The step's gradient sum (see grad_sum.h).
#include "train/grad_sum.h"

#include <cstring>

#include "core/check.h"

namespace tessera::train {

namespace {
constexpr const char* kRegionName[] = {"replicated", "data", "expert"};

float* first(const BufferGroup& g) { return reinterpret_cast<float*>(g.base()); }
}  // namespace

GradientSum::GradientSum(const AdamW& opt, int64_t accumulation, bool fsdp)
    : opt_(opt), regions_(opt.regions()), accumulation_(accumulation), fsdp_(fsdp) {
    TESSERA_CHECK(accumulation >= 1, "GradientSum: {} micro-batches per step", accumulation);
    TESSERA_CHECK(!fsdp || regions_[AdamW::data].comm, "GradientSum: FSDP without ranks to shard over");
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        // shared: the reduce-scatters write whole ranges; local: the sum of micro-batches, when there are several
        const int64_t n = reg.comm ? reg.shard.per_rank : accumulation > 1 ? reg.shard.total : 0;
        if (n == 0) continue;
        const std::string name = fmt::format("grad.{}.{}", reg.comm ? "range" : "sum", kRegionName[r]);
        sum_[r] = BufferGroup(
            name, {BufferSpec{.name = name, .dtype = DType::f32, .shape = Shape{n}, .kind = BufferKind::grad}});
    }
}

std::vector<BufferGroup*> GradientSum::groups() {
    std::vector<BufferGroup*> g;
    for (auto& s : sum_)
        if (s.size() > 0) g.push_back(&s);
    return g;
}

void GradientSum::before(int64_t micro, const BufferGroup& grads) {
    micro_ = micro;
    grads.zero();
}

void GradientSum::after(int64_t micro, const BufferGroup& grads) {
    TESSERA_CHECK(micro == micro_, "GradientSum: micro-batch {} ends, {} began", micro, micro_);
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        const float* g = opt_.region_base(grads, r);
        if (!g || (fsdp_ && r == AdamW::data)) continue;
        if (reg.comm) {  // this micro-batch of every rank, in rank order, onto the ranges
            std::vector<int64_t> counts(static_cast<size_t>(reg.comm->size()));
            for (int q = 0; q < reg.comm->size(); ++q) counts[size_t(q)] = reg.shard.hi_of(q) - reg.shard.lo_of(q);
            reg.comm->reduce_scatter_v_async(DType::f32, g, counts, first(sum_[r]), reg.shard.size(), micro > 0).wait();
            continue;
        }
        if (accumulation_ == 1) continue;  // the model's gradients are the sum
        float* s = first(sum_[r]);
        const int64_t n = reg.shard.total;
        if (micro == 0) {
            std::memcpy(s, g, size_t(n) * sizeof(float));
            continue;
        }
#pragma omp parallel for simd schedule(static)
        for (int64_t i = 0; i < n; ++i) s[i] += g[i];
    }
}

GradRanges GradientSum::finish(const BufferGroup& grads) {
    GradRanges out;
    for (size_t r = 0; r < AdamW::kRegions; ++r) {
        const parallel::ShardedRegion& reg = regions_[r];
        float* at = reg.comm || accumulation_ > 1 ? first(sum_[r]) : opt_.region_base(grads, r);
        out.region[r] = at ? std::span<float>(at, size_t(reg.shard.size())) : std::span<float>();
    }
    return out;
}

std::span<float> GradientSum::data_range() {
    return {first(sum_[AdamW::data]), size_t(regions_[AdamW::data].shard.size())};
}

}  // namespace tessera::train
