// AdamW with deterministic gradient clipping.
#include "train/optimizer.h"

#include <cmath>

#include "ops/adamw.h"

namespace tessera::train {

namespace {
constexpr int64_t kChunk = 1 << 16;

std::vector<BufferSpec> state_specs(const std::vector<BufferSpec>& params, const std::string& prefix) {
    std::vector<BufferSpec> specs = params;
    for (auto& s : specs) {
        s.name = prefix + s.name;
        s.kind = BufferKind::optimizer;
    }
    return specs;
}

int64_t num_chunks(const std::vector<BufferSpec>& specs) {
    int64_t n = 0;
    for (auto& s : specs) n += (s.shape.numel() + kChunk - 1) / kChunk;
    return n;
}
}  // namespace

AdamW::AdamW(const std::vector<BufferSpec>& params)
    : m_("adamw.m", state_specs(params, "m.")),
      v_("adamw.v", state_specs(params, "v.")),
      partial_(size_t(num_chunks(params))) {}

double AdamW::grad_norm(const BufferGroup& grads) {
    // NOTES: chunk c of tensor t always covers the same elements and the chunk sums are added in
    // order, so the norm has the same bits on any thread count.
    int64_t c = 0;
    for (size_t t = 0; t < grads.size(); ++t) {
        TensorView g = grads.view(t);
        const float* p = g.ptr<float>();
        const int64_t n = g.numel();
        const int64_t chunks = (n + kChunk - 1) / kChunk;
#pragma omp parallel for schedule(static)
        for (int64_t k = 0; k < chunks; ++k) {
            const int64_t e0 = k * kChunk, e1 = std::min(n, e0 + kChunk);
            double s = 0;
            for (int64_t e = e0; e < e1; ++e) s += double(p[e]) * double(p[e]);
            partial_[size_t(c + k)] = s;
        }
        c += chunks;
    }
    double total = 0;
    for (int64_t k = 0; k < c; ++k) total += partial_[size_t(k)];
    return std::sqrt(total);
}

void AdamW::clip(const BufferGroup& grads, double norm, double max_norm) {
    if (max_norm <= 0) return;
    const double coef = max_norm / (norm + 1e-6);
    if (coef >= 1.0) return;
    const float f = float(coef);
    for (size_t t = 0; t < grads.size(); ++t) {
        TensorView g = grads.view(t);
        float* p = g.ptr<float>();
        const int64_t n = g.numel();
#pragma omp parallel for simd schedule(static)
        for (int64_t e = 0; e < n; ++e) p[e] *= f;
    }
}

void AdamW::update(const TrainConfig& c,
                   const BufferGroup& params,
                   const BufferGroup& grads,
                   double lr,
                   const std::vector<bool>& trainable) {
    ++step_;
    for (size_t t = 0; t < params.size(); ++t) {
        if (!trainable.empty() && !trainable[t]) continue;
        const ops::AdamWParams p{.lr = lr,
                                 .beta1 = c.beta1,
                                 .beta2 = c.beta2,
                                 .eps = c.eps,
                                 .weight_decay = params.specs()[t].weight_decay ? c.weight_decay : 0.0,
                                 .step = step_};
        ops::adamw_update(p, params.view(t), grads.view(t), m_.view(t), v_.view(t));
    }
}

}  // namespace tessera::train
