// One rank's training state as train() builds it: the model over the mesh's expert group, AdamW's ranges, the
// gradient sum, FSDP, and the buffer groups these add to the model runtime's. The planner (plan/memory.h) builds the
// same for a rank of a job that is not running (on parallel::Mesh::layout), so its memory prediction is the
// trainer's allocation by construction (DESIGN.md principle 2).
#pragma once

#include <optional>
#include <vector>

#include "model/model.h"
#include "model/runtime.h"
#include "parallel/mesh.h"
#include "train/config.h"
#include "train/fsdp.h"
#include "train/grad_sum.h"
#include "train/optimizer.h"
#include "train/pipeline.h"
#include "train/weight_copies.h"

namespace tessera::train {

class WeightBudget;

struct RankState {
    // mesh null: one process. accumulation: micro-batches per step on this rank (TrainConfig::accumulation).
    RankState(const RunConfig& cfg, const parallel::Mesh* mesh, int64_t accumulation);
    // Once a weight budget (memory.weights_budget, made on `model`) exists or not: FSDP when parallel.fsdp shards
    // over several ranks, the weight copies, then `extra` and `placement`.
    void place(WeightBudget* budget);

    model::Model model;
    AdamW opt;
    bool sharded = false;       // FSDP
    bool copy_weights = false;  // memory.weight_copies applies (train.device = cuda, train.precision = bf16)
    GradientSum grad_sum;
    std::optional<Fsdp> fsdp;
    std::optional<PipelineStep> pipeline;  // parallel.pipeline > 1
    // memory.weight_copies at train.precision = bf16 on a GPU, when some parameter is copied
    std::optional<WeightCopies> copies;
    // the optimizer's, the gradient sum's, FSDP's, the pipeline's and the weight copies' groups
    std::vector<BufferGroup*> extra;
    std::optional<model::ParamPlacement> placement;
};

}  // namespace tessera::train
