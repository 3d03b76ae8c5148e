// Sampling and the (full-window) generation loop.
#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

namespace tessera::model {

int32_t sample_token(std::span<const float> logits, const SampleParams& p, Rng& rng) {
    const int64_t V = int64_t(logits.size());
    if (p.temperature <= 0) return int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin());
    std::vector<int32_t> idx(static_cast<size_t>(V));
    std::iota(idx.begin(), idx.end(), 0);
    const int64_t k = p.top_k > 0 ? std::min(p.top_k, V) : V;
    // ties broken by the lower id so the candidate set is deterministic
    std::partial_sort(idx.begin(), idx.begin() + k, idx.end(), [&](int32_t a, int32_t b) {
        return logits[size_t(a)] != logits[size_t(b)] ? logits[size_t(a)] > logits[size_t(b)] : a < b;
    });
    const double top = logits[size_t(idx[0])];
    std::vector<double> w(static_cast<size_t>(k));
    double sum = 0;
    for (int64_t i = 0; i < k; ++i) {
        w[size_t(i)] = std::exp((logits[size_t(idx[size_t(i)])] - top) / p.temperature);
        sum += w[size_t(i)];
    }
    double u = rng.uniform() * sum;
    for (int64_t i = 0; i < k; ++i) {
        u -= w[size_t(i)];
        if (u <= 0) return idx[size_t(i)];
    }
    return idx[size_t(k - 1)];
}

void generate(Model& model,
              StepShape max,
              std::vector<int32_t>& tokens,
              const SampleParams& p,
              int32_t stop_token,
              TensorView logits_buffer,
              const std::function<void(int32_t)>& on_token) {
    TESSERA_CHECK(!tokens.empty(), "generate: the prompt is empty");
    Rng rng(p.seed, 0x5a3b1eull);
    const int64_t V = model.config().vocab_size;
    for (int64_t n = 0; n < p.max_new_tokens; ++n) {
        const int64_t T = std::min<int64_t>(int64_t(tokens.size()), max.seq);
        std::span<const int32_t> ctx(tokens.data() + tokens.size() - size_t(T), size_t(T));
        TensorView logits = logits_buffer.prefix(Shape{T, V});
        model.forward_logits({1, T}, ctx, logits);
        std::span<const float> last(logits.ptr<float>() + (T - 1) * V, size_t(V));
        const int32_t next = sample_token(last, p, rng);
        tokens.push_back(next);
        if (on_token) on_token(next);
        if (next == stop_token) break;
    }
}

}  // namespace tessera::model
