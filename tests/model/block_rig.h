// A single block bound to its own memory (parameters, gradients, saved activations, scratch,
// workspace), for layer-level tests against golden files.
#pragma once

#include <memory>

#include "core/arena.h"
#include "model/layers/block.h"

namespace tessera::test {

struct BlockRig {
    BlockRig(model::Block& block, model::StepShape max);

    model::Block& block;
    std::vector<BufferSpec> specs;
    std::vector<model::ParamInit> inits;
    BufferGroup params, grads, acts, workspace;
    std::span<std::byte> ws;
};

}  // namespace tessera::test
