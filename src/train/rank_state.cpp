// One rank's training state (see rank_state.h).
#include "train/rank_state.h"

#include "train/weight_budget.h"

namespace tessera::train {

RankState::RankState(const RunConfig& cfg, const parallel::Mesh* m, int64_t accumulation)
    : model(cfg.model, m ? &m->expert() : nullptr, cfg.parallel.ep_chunks),
      opt(model.trained_specs(), m, model.local_experts().first),
      sharded(m && cfg.parallel.fsdp),
      grad_sum(opt, accumulation, sharded) {}

void RankState::place(WeightBudget* budget) {
    if (sharded) {
        std::function<std::vector<std::byte*>(size_t)> outside;
        if (budget) outside = [budget](size_t i) { return budget->where(i); };
        fsdp.emplace(model, opt, grad_sum, outside);
    }
    extra = {&opt.m(), &opt.v()};
    for (BufferGroup* g : grad_sum.groups()) extra.push_back(g);
    if (fsdp) {
        for (BufferGroup* g : fsdp->groups()) extra.push_back(g);
        placement = fsdp->placement();
    } else if (budget) {
        placement = budget->placement();
    }
}

}  // namespace tessera::train
