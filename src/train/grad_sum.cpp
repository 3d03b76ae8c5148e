// The step's gradient sum (see grad_sum.h).
#include "train/grad_sum.h"

#include <cstring>

#include "core/check.h"

namespace tessera::train {

namespace {
BufferGroup flat_group(const std::string& name, int64_t elements) {
    return BufferGroup(
        name, {BufferSpec{.name = name, .dtype = DType::f32, .shape = Shape{elements}, .kind = BufferKind::grad}});
}
}  // namespace

GradientSum::GradientSum(const std::vector<BufferSpec>& params, const AdamW& opt, int64_t accumulation)
    : regions_(opt.regions()),
      total_(int64_t(BufferGroup("grads", params).nbytes() / sizeof(float))),
      accumulation_(accumulation) {
    TESSERA_CHECK(accumulation >= 1, "GradientSum: {} micro-batches per step", accumulation);
    TESSERA_CHECK(regions_[1].base + regions_[1].shard.total == total_,
                  "GradientSum: the ranges cut {} elements, the gradients hold {}",
                  regions_[1].base + regions_[1].shard.total, total_);
    if (accumulation > 1) sum_ = flat_group("grad.sum", total_);
    int64_t mine = 0;  // the reduce-scatters write whole ranges
    for (const auto& r : regions_)
        if (r.comm) mine += r.shard.per_rank;
    if (mine > 0) mine_ = flat_group("grad.range", mine);
}

std::vector<BufferGroup*> GradientSum::groups() {
    std::vector<BufferGroup*> g;
    if (accumulation_ > 1) g.push_back(&sum_);
    if (mine_.size() > 0) g.push_back(&mine_);
    return g;
}

void GradientSum::before(int64_t micro, const BufferGroup& grads) {
    if (micro == 0 || accumulation_ > 1) grads.zero();
}

void GradientSum::after(int64_t micro, const BufferGroup& grads) {
    if (accumulation_ == 1) return;
    float* s = reinterpret_cast<float*>(sum_.base());
    const float* g = reinterpret_cast<const float*>(grads.base());
    const int64_t n = total_;
    if (micro == 0) {
        std::memcpy(s, g, size_t(n) * sizeof(float));
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) s[i] += g[i];
}

GradRanges GradientSum::finish(const BufferGroup& grads) {
    float* sum = reinterpret_cast<float*>(accumulation_ > 1 ? sum_.base() : grads.base());
    float* mine = mine_.size() > 0 ? reinterpret_cast<float*>(mine_.base()) : nullptr;
    GradRanges out;
    for (size_t i = 0; i < regions_.size(); ++i) {
        const parallel::ShardedRegion& r = regions_[i];
        if (!r.comm) {  // this rank alone holds the region: its range is all of it
            out.region[i] = {sum + r.base, size_t(r.shard.size())};
            continue;
        }
        r.comm->reduce_scatter(DType::f32, sum + r.base, mine, r.shard.per_rank, r.shard.total);
        out.region[i] = {mine, size_t(r.shard.size())};
        mine += r.shard.per_rank;
    }
    return out;
}

}  // namespace tessera::train
