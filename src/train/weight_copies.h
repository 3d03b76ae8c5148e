// memory.weight_copies (docs/train.md, "bf16 weight copies"): at train.precision = bf16 on a GPU every GEMM takes bf16
// operands, so a GEMM on an f32 weight first rounds it into a copy, per call: the forward's product, the input
// gradient's, and again in a recomputed forward. With copies, the trained GEMM weights the model names
// (Model::copyable_weights: projections, experts, an untied head) are also held in bf16, rounded once after each
// change of the parameters (the optimizer step, a load, the initialisation), and the blocks bind them in place of the
// f32 parameters (Model::set_weight_copies): the GEMMs read them as they read a frozen base held in bf16, the weight
// gradients still go to the f32 gradients, and AdamW still updates the f32 parameters. The values are those each GEMM
// rounded before (round to nearest even, core/dtype.h), so a run has the same bits with or without copies.
//
// What FSDP holds as ranges (train/fsdp.h) is gathered into its slots per visit and rounded by each GEMM as before:
// copies of a gathered unit would be rounded per gather, which saves nothing; gathering bf16 shards would (not built).
// A copy is stale from a change of its parameter until refresh(): whoever changes the parameters calls it.
#pragma once

#include <functional>
#include <vector>

#include "core/buffer_spec.h"
#include "model/model.h"

namespace tessera::train {

class WeightCopies {
  public:
    // The copies of model.copyable_weights() but those `held_apart` names (FSDP's ranges); empty() when none.
    WeightCopies(const model::Model& model, const std::function<bool(size_t)>& held_apart = {});
    bool empty() const { return copies_.size() == 0; }
    // The copies' group, for the runtime to allocate (kind param, bf16, the parameters' names).
    BufferGroup& group() { return copies_; }
    const BufferGroup& group() const { return copies_; }
    // After allocation: the parameters they copy (the runtime's group, placed as the trainer placed it).
    void bind(const BufferGroup& params);
    // Each copy rounded from its parameter (one cast per parameter, on the parameters' device and stream).
    void refresh() const;

  private:
    BufferGroup copies_;
    std::vector<std::pair<TensorView, TensorView>> pairs_;  // (f32 parameter, its bf16 copy)
};

}  // namespace tessera::train
