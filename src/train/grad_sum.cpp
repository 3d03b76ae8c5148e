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
int64_t flat_floats(const BufferGroup& g) { return int64_t(g.nbytes() / sizeof(float)); }
}  // namespace

GradientSum::GradientSum(const std::vector<BufferSpec>& params,
                         const parallel::FlatShard& range,
                         int64_t accumulation,
                         parallel::Comm* comm)
    : range_(range), accumulation_(accumulation), comm_(comm && comm->size() > 1 ? comm : nullptr) {
    TESSERA_CHECK(accumulation >= 1, "GradientSum: {} micro-batches per step", accumulation);
    const int64_t n = flat_floats(BufferGroup("grads", params));
    TESSERA_CHECK(n == range.total, "GradientSum: the range cuts {} elements, the gradients hold {}", range.total, n);
    if (accumulation > 1) sum_ = flat_group("grad.sum", n);
    if (comm_) mine_ = flat_group("grad.range", range.per_rank);  // the reduce-scatter writes whole ranges
}

std::vector<BufferGroup*> GradientSum::groups() {
    std::vector<BufferGroup*> g;
    if (accumulation_ > 1) g.push_back(&sum_);
    if (comm_) g.push_back(&mine_);
    return g;
}

void GradientSum::before(int64_t micro, const BufferGroup& grads) {
    if (micro == 0 || accumulation_ > 1) grads.zero();
}

void GradientSum::after(int64_t micro, const BufferGroup& grads) {
    if (accumulation_ == 1) return;
    float* s = reinterpret_cast<float*>(sum_.base());
    const float* g = reinterpret_cast<const float*>(grads.base());
    const int64_t n = range_.total;
    if (micro == 0) {
        std::memcpy(s, g, size_t(n) * sizeof(float));
        return;
    }
#pragma omp parallel for simd schedule(static)
    for (int64_t i = 0; i < n; ++i) s[i] += g[i];
}

std::span<float> GradientSum::finish(const BufferGroup& grads) {
    float* total = reinterpret_cast<float*>(accumulation_ > 1 ? sum_.base() : grads.base());
    if (!comm_) return {total, size_t(range_.total)};
    float* mine = reinterpret_cast<float*>(mine_.base());
    comm_->reduce_scatter(DType::f32, total, mine, range_.per_rank, range_.total);
    return {mine, size_t(range_.size())};
}

}  // namespace tessera::train
