// Sampling and the (full-window) generation loop.
#include "model/sampling.h"

#include <algorithm>
#include <cmath>
#include <functional>
#include <numeric>

#include "core/device.h"

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
              int64_t context,
              std::vector<int32_t>& tokens,
              const SampleParams& p,
              int32_t stop_token,
              const std::function<void(int32_t)>& on_token) {
    TESSERA_CHECK(!tokens.empty(), "generate: the prompt is empty");
    TESSERA_CHECK(context >= 2, "generate: the context must hold at least 2 tokens");
    // (a full context restarts from its later half, which could cut an image: with images all must fit)
    TESSERA_CHECK(!model.has_images() || int64_t(tokens.size()) + p.max_new_tokens <= context,
                  "generate: with images the context ({} tokens) must hold the prompt ({}) and the new tokens ({})",
                  context, tokens.size(), p.max_new_tokens);
    Rng rng(p.seed, 0x5a3b1eull);
    const int64_t V = model.config().vocab_size;
    // the logits on the model's device; sampling reads a host copy
    const bool on_device = model.device() != Device::cpu;
    Tensor logits(DType::f32, Shape{1, V}), device_logits;
    if (on_device) device_logits = Tensor(DType::f32, Shape{1, V}, model.device());
    const TensorView out = on_device ? device_logits.view() : logits.view();
    int64_t pos = 0;
    // decodes tokens[from, end) from position 0
    auto refill = [&](size_t from) {
        for (pos = 0; from + size_t(pos) < tokens.size(); ++pos) {
            model.decode_step(pos, std::span(&tokens[from + size_t(pos)], 1), out);
        }
    };
    refill(tokens.size() - std::min(tokens.size(), size_t(context)));
    for (int64_t n = 0; n < p.max_new_tokens; ++n) {
        if (on_device) copy_bytes(logits.view().data, Device::cpu, out.data, out.device, out.nbytes());
        const int32_t next = sample_token(std::span<const float>(logits.ptr<float>(), size_t(V)), p, rng);
        tokens.push_back(next);
        if (on_token) on_token(next);
        if (next == stop_token || n + 1 == p.max_new_tokens) break;
        if (pos == context) {
            refill(tokens.size() - size_t(context / 2));
        } else {
            model.decode_step(pos++, std::span(&tokens.back(), 1), out);
        }
    }
}

}  // namespace tessera::model
