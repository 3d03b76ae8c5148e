// Single-block rig (see block_rig.h).
#include "model/layers/block_rig.h"

#include <omp.h>

namespace tessera::model {

BlockRig::BlockRig(Block& b, StepShape max) : block(b) {
    b.declare_params(specs, inits);
    params = BufferGroup("params", specs);
    std::vector<BufferSpec> gspecs = specs;
    for (auto& s : gspecs) s.kind = BufferKind::grad;
    grads = BufferGroup("grads", gspecs);
    std::vector<BufferSpec> a;
    b.declare_saved(a, "saved.", max);
    b.declare_scratch(a, "scratch.", max);
    acts = BufferGroup("acts", a);
    workspace = BufferGroup("ws", {{"ws", DType::u8, Shape{int64_t(b.workspace_bytes(max, omp_get_max_threads())) + 1},
                                    BufferKind::workspace}});
    auto arena = std::make_shared<Arena>(predict_arena_bytes({&params, &grads, &acts, &workspace}, 256), 256);
    allocate_groups(arena, {&params, &grads, &acts, &workspace});
    b.bind_params(params, &grads);
    b.bind_saved(acts, "saved.");
    b.bind_scratch(acts, "scratch.");
    ws = std::span(workspace.base(), workspace.nbytes());
}

}  // namespace tessera::model
