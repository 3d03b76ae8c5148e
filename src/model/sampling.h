// Autoregressive sampling: temperature, top-k, and greedy decoding (temperature 0). This issue's
// generation re-runs the model over the context window for each new token; incremental decoding
// with KV / recurrent-state caches comes with the hybrid model.
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

// Extends `tokens` by up to p.max_new_tokens tokens, stopping early at `stop_token` (>= 0).
// The model must be bound for batch 1 and sequence length >= 1; the context is its last
// max-seq tokens. on_token is called with each new token (for streaming output).
void generate(Model& model,
              StepShape max,
              std::vector<int32_t>& tokens,
              const SampleParams& p,
              int32_t stop_token,
              TensorView logits_buffer,
              const std::function<void(int32_t)>& on_token);

}  // namespace tessera::model
