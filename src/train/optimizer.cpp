// AdamW with deterministic, sharded gradient clipping (see optimizer.h).
#include "train/optimizer.h"

#include <algorithm>
#include <cmath>

#include "core/check.h"
#include "ops/adamw.h"

namespace tessera::train {

namespace {
parallel::Comm* shared(parallel::Comm& c) { return c.size() > 1 ? &c : nullptr; }
}  // namespace

AdamW::AdamW(const std::vector<BufferSpec>& params, const parallel::Mesh* mesh, int64_t first_expert) : specs_(params) {
    const BufferGroup layout("params", params);  // offsets only: nothing is allocated
    const int64_t total = int64_t(layout.nbytes() / sizeof(float));
    int64_t expert_base = total;  // the expert-sharded parameters come last
    for (size_t t = 0; t < params.size(); ++t) {
        TESSERA_CHECK(params[t].dtype == DType::f32, "AdamW: parameter {} is {}, not f32", params[t].name,
                      dtype_name(params[t].dtype));
        offsets_.push_back(int64_t(layout.offset(t) / sizeof(float)));
        if (params[t].sharding == Sharding::expert) {
            if (expert_base == total) expert_base = offsets_.back();
        } else {
            TESSERA_CHECK(expert_base == total, "AdamW: parameter {} follows an expert-sharded one", params[t].name);
        }
    }
    parallel::Comm* data = mesh ? shared(mesh->data()) : nullptr;
    parallel::Comm* expert_data = mesh ? shared(mesh->expert_data()) : nullptr;
    expert_ = mesh ? shared(mesh->expert()) : nullptr;
    auto cut = [](int64_t base, int64_t n, parallel::Comm* c) {
        return parallel::ShardedRegion{base, parallel::FlatShard(n, c ? c->rank() : 0, c ? c->size() : 1, kChunk), c};
    };
    regions_[replicated] = cut(0, expert_base, data);
    regions_[expert] = cut(expert_base, total - expert_base, expert_data);
    const int64_t n = regions_[replicated].shard.size() + regions_[expert].shard.size();
    auto state = [&](const char* name) {
        return BufferGroup(
            std::string("adamw.") + name,
            {BufferSpec{.name = name, .dtype = DType::f32, .shape = Shape{n}, .kind = BufferKind::optimizer}});
    };
    m_ = state("m");
    v_ = state("v");
    for (size_t t = 0; t < params.size(); ++t) {  // the pieces of each parameter held here
        const bool ex = params[t].sharding == Sharding::expert;
        const parallel::ShardedRegion& reg = regions_[ex ? expert : replicated];
        const int64_t b = offsets_[t], n = params[t].shape.numel(), e0 = std::max(b, reg.lo()),
                      e1 = std::min(b + n, reg.hi());
        if (e0 >= e1) continue;
        const int64_t slice_at = ex ? first_expert * (n / params[t].shape[0]) : 0;  // the slice in the whole tensor
        pieces_.push_back(
            {t, slice_at + (e0 - b), (e0 - reg.lo()) + (ex ? regions_[replicated].shard.size() : 0), e1 - e0, e0});
    }
    for (int r : {replicated, expert}) {
        const parallel::ShardedRegion& g = regions_[size_t(r)];
        mine_[size_t(r)].resize(size_t(g.shard.per_rank / kChunk));
        partial_[size_t(r)].resize(mine_[size_t(r)].size() * size_t(g.comm ? g.comm->size() : 1));
    }
}

double AdamW::region_sum_of_squares(int r, std::span<const float> grad) {
    const parallel::ShardedRegion& g = regions_[size_t(r)];
    TESSERA_CHECK(int64_t(grad.size()) == g.shard.size(), "grad_norm: {} gradient elements for a range of {}",
                  grad.size(), g.shard.size());
    // NOTES: chunk c always covers the same flat elements whatever the thread count and the number of ranks
    // (ranges are whole chunks), and the chunk sums are added in flat order, so the sum has the same bits.
    std::vector<double>& mine = mine_[size_t(r)];
    std::vector<double>& all = partial_[size_t(r)];
    const int64_t n = g.shard.size();
#pragma omp parallel for schedule(static)
    for (int64_t k = 0; k < int64_t(mine.size()); ++k) {
        const int64_t e0 = std::min(n, k * kChunk), e1 = std::min(n, e0 + kChunk);
        double s = 0;
        for (int64_t e = e0; e < e1; ++e) s += double(grad[size_t(e)]) * double(grad[size_t(e)]);
        mine[size_t(k)] = s;
    }
    if (g.comm)
        g.comm->all_gather(std::as_bytes(std::span(mine)), std::as_writable_bytes(std::span(all)));
    else
        all = mine;
    double total = 0;
    for (double p : all) total += p;
    return total;
}

double AdamW::grad_norm(const GradRanges& g) {
    const double dense = region_sum_of_squares(replicated, g.region[replicated]);
    double experts = region_sum_of_squares(expert, g.region[expert]);
    if (expert_) {  // each EP rank's experts: their sums added in EP rank order
        std::vector<double> each(size_t(expert_->size()));
        expert_->all_gather(std::as_bytes(std::span(&experts, 1)), std::as_writable_bytes(std::span(each)));
        experts = 0;
        for (double e : each) experts += e;
    }
    return std::sqrt(dense + experts);
}

void AdamW::clip(const GradRanges& g, double norm, double max_norm) const {
    if (max_norm <= 0) return;
    const double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return;
    const float f = float(coef);
    for (std::span<float> r : g.region) {
        float* p = r.data();
        const int64_t n = int64_t(r.size());
#pragma omp parallel for simd schedule(static)
        for (int64_t e = 0; e < n; ++e) p[e] *= f;
    }
}

void AdamW::update(const TrainConfig& c,
                   const BufferGroup& params,
                   const GradRanges& g,
                   double lr,
                   const std::vector<bool>& trainable) {
    TESSERA_CHECK(params.size() == specs_.size(), "AdamW::update: {} parameters, expected {}", params.size(),
                  specs_.size());
    ++step_;
    float* base = reinterpret_cast<float*>(params.base());
    float* m = m_.view(0).ptr<float>();
    float* v = v_.view(0).ptr<float>();
    const int64_t replicated_here = regions_[replicated].shard.size();
    for (const StatePiece& piece : pieces_) {
        const BufferSpec& spec = specs_[piece.param];
        if (!trainable.empty() && !trainable[piece.param]) continue;
        const bool ex = spec.sharding == Sharding::expert;
        const ops::AdamWParams p{.lr = lr,
                                 .beta1 = c.beta1,
                                 .beta2 = c.beta2,
                                 .eps = c.eps,
                                 .weight_decay = spec.weight_decay ? c.weight_decay : 0.0,
                                 .step = step_};
        const Shape s{piece.length};
        const int64_t k = piece.state_offset - (ex ? replicated_here : 0);  // within the region's gradient range
        ops::adamw_update(p, TensorView(base + piece.flat_offset, DType::f32, s),
                          TensorView(g.region[ex ? expert : replicated].data() + k, DType::f32, s),
                          TensorView(m + piece.state_offset, DType::f32, s),
                          TensorView(v + piece.state_offset, DType::f32, s));
    }
}

void AdamW::share_params(const BufferGroup& params) const {
    float* base = reinterpret_cast<float*>(params.base());
    std::vector<parallel::Handle> pending;
    for (const parallel::ShardedRegion& reg : regions_) {
        if (!reg.comm) continue;
        for (int q = 0; q < reg.comm->size(); ++q) {
            const int64_t lo = reg.base + reg.shard.lo_of(q), hi = reg.base + reg.shard.hi_of(q);
            pending.push_back(
                reg.comm->broadcast_async(std::as_writable_bytes(std::span(base + lo, size_t(hi - lo))), q));
        }
    }
    for (auto& h : pending) h.wait();
}

}  // namespace tessera::train
