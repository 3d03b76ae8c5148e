// A shape-faithful miniature of a model (spec/scale.md §9.2) for `tessera onboard`: the same layer types in the
// same order, feed-forward kinds, gates, norms, activations, routing rules, Attention Residuals, position encoding and
// LoRA targets, shrunk (width 64, heads of 16, at most 8 experts, the byte vocabulary) so that it trains on the demo
// corpus in seconds on a CPU. Its layers: the first ones up to the last of the model's (attention, feed-forward)
// pairs to appear, when that is at most 8 layers; otherwise the first layer of each pair, in order.
#pragma once

#include "model/config.h"

namespace tessera::model {

ModelConfig miniature(const ModelConfig& c);

}  // namespace tessera::model
