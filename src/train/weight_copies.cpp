// bf16 copies of the trained GEMM weights (see weight_copies.h).
#include "train/weight_copies.h"

#include "ops/rows.h"

namespace tessera::train {

namespace {
std::vector<BufferSpec> copy_specs(const model::Model& model, const std::function<bool(size_t)>& held_apart) {
    std::vector<BufferSpec> out;
    for (size_t i : model.copyable_weights()) {
        if (held_apart && held_apart(i)) continue;
        out.push_back(model.param_specs()[i]);
        out.back().dtype = DType::bf16;
    }
    return out;
}
}  // namespace

WeightCopies::WeightCopies(const model::Model& model, const std::function<bool(size_t)>& held_apart)
    : copies_("params.bf16", copy_specs(model, held_apart)) {}

void WeightCopies::bind(const BufferGroup& params) {
    pairs_.clear();
    for (size_t i = 0; i < copies_.size(); ++i)
        pairs_.emplace_back(params.view(copies_.specs()[i].name), copies_.view(i));
}

void WeightCopies::refresh() const {
    for (const auto& [param, copy] : pairs_) ops::cast(param, copy);
}

}  // namespace tessera::train
