// Autoregressive sampling: temperature, top-k, and greedy decoding (temperature 0), with incremental
// decoding: each new token is one Model::decode_step over the KV / indexer-key / recurrent-state caches.
#pragma once

#include <cstdint>
#include <functional>
#include <span>
#include <vector>

#include "core/rng.h"
#include "model/model.h"

namespace tessera::model {

struct SampleParams {
    int64_t max_new_tokens = 200;
    double temperature = 0.8;  // 0 = greedy
    int64_t top_k = 40;        // 0 = the whole vocabulary
    uint64_t seed = 0;
};

// Picks a token from one row of logits; deterministic given the rng position.
int32_t sample_token(std::span<const float> logits, const SampleParams& p, Rng& rng);

// Extends `tokens` by up to p.max_new_tokens tokens, stopping early at `stop_token` (>= 0). The model
// must have decoding caches bound for batch 1 and `context` tokens; the context is the last `context`
// tokens: when the caches are full, the last context/2 tokens are decoded again from position 0
// (a sliding window re-filled in halves). on_token is called with each new token (streaming output).
void generate(Model& model,
              int64_t context,
              std::vector<int32_t>& tokens,
              const SampleParams& p,
              int32_t stop_token,
              const std::function<void(int32_t)>& on_token);

}  // namespace tessera::model
