// One rank's training state (see rank_state.h).
#include "train/rank_state.h"

#include "train/weight_budget.h"

namespace tessera::train {

namespace {
// The trained parameters that start one of the model's units (its dense parameters, its experts): AdamW's segments.
std::vector<size_t> unit_starts(const model::Model& m) {
    std::vector<size_t> starts;
    const size_t frozen = m.frozen_params();
    for (const model::ParamUnit& u : m.param_units()) {
        if (u.first < u.last) starts.push_back(u.first - frozen);
        if (u.expert_first < u.expert_last) starts.push_back(u.expert_first - frozen);
    }
    return starts;
}
// FSDP when parallel.fsdp and the data-parallel group (a pipeline stage's) has ranks to shard over
bool sharded_over(const RunConfig& cfg, const parallel::Mesh* m) {
    return m && cfg.parallel.fsdp && m->data().size() > 1;
}
}  // namespace

RankState::RankState(const RunConfig& cfg, const parallel::Mesh* m, int64_t accumulation)
    : model(cfg.model,
            m ? &m->expert() : nullptr,
            cfg.parallel.ep_chunks,
            m ? cfg.parallel.stage_layers(m->stage(), cfg.model.n_layers) : model::LayerRange{},
            m ? m->tensor() : nullptr),
      opt(model.trained_specs(),
          m,
          model.local_experts().first,
          unit_starts(model),
          sharded_over(cfg, m),
          cfg.memory.optimizer_offload ? AdamW::offload_window_elements(cfg.memory.offload_window_mib) : 0),
      sharded(sharded_over(cfg, m)),
      copy_weights(cfg.memory.weight_copies && cfg.train.device == "cuda" && cfg.train.precision == "bf16"),
      grad_sum(opt, accumulation, sharded) {
    model.set_activation_dtype(cfg.train.activation_dtype);
    if (m && m->pp() > 1)
        pipeline.emplace(model, *m, accumulation,
                         model::StepShape{cfg.train.micro_batch(m->data().size() / m->tp()), cfg.train.seq_len},
                         cfg.train.recompute, cfg.parallel.pipeline_rerun);
}

void RankState::place(WeightBudget* budget) {
    if (sharded) {
        std::function<std::vector<std::byte*>(size_t)> outside;
        if (budget) outside = [budget](size_t i) { return budget->where(i); };
        fsdp.emplace(model, opt, grad_sum, outside);
    }
    if (copy_weights) {
        copies.emplace(model, [this](size_t i) { return fsdp && fsdp->holds_param(i); });
        if (copies->empty()) copies.reset();
    }
    model.set_weight_copies(copies ? &copies->group() : nullptr);
    extra = {&opt.m(), &opt.v()};
    for (BufferGroup* g : grad_sum.groups()) extra.push_back(g);
    if (pipeline) extra.push_back(&pipeline->group());
    if (copies) extra.push_back(&copies->group());
    if (fsdp) {
        for (BufferGroup* g : fsdp->groups()) extra.push_back(g);
        placement = fsdp->placement();
    } else if (budget) {
        placement = budget->placement();
    }
}

}  // namespace tessera::train
