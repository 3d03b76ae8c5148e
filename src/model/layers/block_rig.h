// A single block bound to its own memory (parameters, gradients, saved activations, scratch,
// workspace) from one arena: layer-level tests against golden files and layer benchmarks.
#pragma once

#include <memory>

#include "core/arena.h"
#include "model/layers/block.h"

namespace tessera::model {

struct BlockRig {
    BlockRig(Block& block, StepShape max);

    Block& block;
    std::vector<BufferSpec> specs;
    std::vector<ParamInit> inits;
    BufferGroup params, grads, acts, workspace;
    std::span<std::byte> ws;
};

}  // namespace tessera::model
