// AdamW with deterministic, sharded gradient clipping (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "ops/adamw.h"

namespace tessera::train {

namespace {
int world_of(const parallel::Comm* c) { return c ? c->size() : 1; }
int rank_of(const parallel::Comm* c) { return c ? c->rank() : 0; }
}  // namespace

AdamW::AdamW(const std::vector<BufferSpec>& params, parallel::Comm* comm) : comm_(comm), specs_(params) {
    const BufferGroup layout("params", params);  // offsets only: nothing is allocated
    for (size_t t = 0; t < params.size(); ++t) {
        TESSERA_CHECK(params[t].dtype == DType::f32, "AdamW: parameter {} is {}, not f32", params[t].name,
                      dtype_name(params[t].dtype));
        offsets_.push_back(layout.offset(t) / sizeof(float));
    }
    shard_ = parallel::FlatShard(int64_t(layout.nbytes() / sizeof(float)), rank_of(comm), world_of(comm), kChunk);
    auto state = [&](const char* name) {
        return BufferGroup(
            std::string("adamw.") + name,
            {BufferSpec{
                .name = name, .dtype = DType::f32, .shape = Shape{shard_.size()}, .kind = BufferKind::optimizer}});
    };
    m_ = state("m");
    v_ = state("v");
    mine_.resize(size_t(shard_.per_rank / kChunk));
    partial_.resize(mine_.size() * size_t(world_of(comm)));
}

double AdamW::grad_norm(std::span<const float> grad) {
    TESSERA_CHECK(int64_t(grad.size()) == shard_.size(), "grad_norm: {} gradient elements for a range of {}",
                  grad.size(), shard_.size());
    // NOTES: chunk c always covers the same flat elements whatever the thread count and the world size (ranges
    // are whole chunks), and the chunk sums are added in flat order, so the norm has the same bits everywhere.
    const int64_t n = shard_.size();
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < int64_t(mine_.size()); ++k) {
        const int64_t e0 = std::min(n, k * kChunk), e1 = std::min(n, e0 + kChunk);
        double s = 0;
        for (int64_t e = e0; e < e1; ++e) s += double(grad[size_t(e)]) * double(grad[size_t(e)]);
        mine_[size_t(k)] = s;
    }
    if (world_of(comm_) > 1)
        comm_->all_gather(std::as_bytes(std::span(mine_)), std::as_writable_bytes(std::span(partial_)));
    else
        partial_ = mine_;
    double total = 0;
    for (double p : partial_) total += p;
    return std::sqrt(total);
}

void AdamW::clip(std::span<float> grad, double norm, double max_norm) const {
    if (max_norm <= 0) return;
    const double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return;
    const float f = float(coef);
    float* p = grad.data();
    const int64_t n = int64_t(grad.size());
#pragma omp parallel for simd schedule(static)
    for (int64_t e = 0; e < n; ++e) p[e] *= f;
}

void AdamW::update(const TrainConfig& c,
                   const BufferGroup& params,
                   std::span<const float> grad,
                   double lr,
                   const std::vector<bool>& trainable) {
    TESSERA_CHECK(params.size() == specs_.size() && int64_t(grad.size()) == shard_.size(),
                  "AdamW::update: {} parameters and {} gradient elements, expected {} and {}", params.size(),
                  grad.size(), specs_.size(), shard_.size());
    ++step_;
    float* base = reinterpret_cast<float*>(params.base());
    float* m = m_.view(0).ptr<float>();
    float* v = v_.view(0).ptr<float>();
    for (size_t t = 0; t < specs_.size(); ++t) {
        if (!trainable.empty() && !trainable[t]) continue;
        // this rank's part of parameter t: flat [e0, e1)
        const int64_t b = int64_t(offsets_[t]), e0 = std::max(b, shard_.lo),
                      e1 = std::min(b + specs_[t].shape.numel(), shard_.hi);
        if (e0 >= e1) continue;
        const ops::AdamWParams p{.lr = lr,
                                 .beta1 = c.beta1,
                                 .beta2 = c.beta2,
                                 .eps = c.eps,
                                 .weight_decay = specs_[t].weight_decay ? c.weight_decay : 0.0,
                                 .step = step_};
        const Shape s{e1 - e0};
        const int64_t k = e0 - shard_.lo;
        ops::adamw_update(p, TensorView(base + e0, DType::f32, s),
                          TensorView(const_cast<float*>(grad.data()) + k, DType::f32, s),
                          TensorView(m + k, DType::f32, s), TensorView(v + k, DType::f32, s));
    }
}

void AdamW::share_params(const BufferGroup& params) const {
    const int W = world_of(comm_);
    if (W == 1) return;
    float* base = reinterpret_cast<float*>(params.base());
    std::vector<parallel::Handle> pending;
    for (int r = 0; r < W; ++r) {
        const int64_t lo = shard_.lo_of(r), hi = shard_.hi_of(r);
        pending.push_back(comm_->broadcast_async(std::as_writable_bytes(std::span(base + lo, size_t(hi - lo))), r));
    }
    for (auto& h : pending) h.wait();
}

}  // namespace tessera::train
