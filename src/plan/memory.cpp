// A rank's memory in a layout (see memory.h).
#include "plan/memory.h"

#include <fmt/format.h>
#include <fmt/ranges.h>

#include <algorithm>
#include <optional>

#include "model/model.h"
#include "model/runtime.h"
#include "parallel/mesh.h"
#include "train/rank_state.h"
#include "train/weight_budget.h"

namespace tessera::plan {

std::string Layout::str() const {
    const std::string sharding = stage_ranks() == 1                   ? "one rank"
                                 : !fsdp                              ? "zero-2"
                                 : shard > 0 && shard < stage_ranks() ? fmt::format("hsdp {}", shard)
                                                                      : "fsdp";
    std::string stages;
    if (pp > 1) {
        stages = fmt::format("pp {}", pp);
        if (split.size() > 6)  // (the first three and the last)
            stages += fmt::format(" [{},...,{}]", fmt::join(split.begin(), split.begin() + 3, ","), split.back());
        else if (!split.empty())
            stages += fmt::format(" [{}]", fmt::join(split, ","));
        stages += rerun ? " rerun, " : ", ";
    }
    if (tp > 1) stages += fmt::format("tp {}, ", tp);
    return fmt::format("{}ep {}, {}, micro {}{}{}{}", stages, ep, sharding, micro_batch,
                       recompute.all     ? ", recompute"
                       : recompute.any() ? ", recompute " + recompute.str()
                                         : "",
                       offload ? ", offload" : "",
                       weights_budget > 0 ? fmt::format(", budget {} MiB", weights_budget) : "");
}

train::RunConfig with_layout(train::RunConfig cfg, const Layout& l) {
    cfg.parallel.ep = l.ep;
    cfg.parallel.fsdp = l.fsdp;
    cfg.parallel.shard = l.shard;
    TESSERA_CHECK(l.pp >= 1 && l.pp <= cfg.model.n_layers && l.ranks % l.pp == 0,
                  "parallel.pipeline = {} does not divide the {} ranks into stages of at least one layer each", l.pp,
                  l.ranks);
    cfg.parallel.pipeline = l.pp;
    TESSERA_CHECK(l.split.empty() || int64_t(l.split.size()) == l.pp - 1,
                  "parallel.pipeline_split names {} stage starts; {} stages need {}", l.split.size(), l.pp, l.pp - 1);
    for (size_t i = 0; i < l.split.size(); ++i)
        TESSERA_CHECK(l.split[i] > (i ? l.split[i - 1] : 0) && l.split[i] < cfg.model.n_layers,
                      "parallel.pipeline_split must be increasing layers in [1, {}) (each stage's first)",
                      cfg.model.n_layers);
    cfg.parallel.pipeline_split = l.split;
    cfg.parallel.pipeline_rerun = l.rerun && l.pp > 1;
    const int64_t D = l.stage_ranks();
    TESSERA_CHECK(l.tp >= 1 && D % l.tp == 0, "parallel.tensor = {} does not divide the {} ranks into tensor groups",
                  l.tp, D);
    TESSERA_CHECK(l.tp == 1 || l.pp == 1, "parallel.tensor = {} with pipeline stages is not supported yet", l.tp);
    if (l.tp > 1) {
        const char* obstacle = model::tensor_obstacle(cfg.model);
        TESSERA_CHECK(!obstacle, "tensor parallelism (parallel.tensor = {}) does not cover {}", l.tp, obstacle);
    }
    cfg.parallel.tensor = l.tp;
    TESSERA_CHECK(l.shard == 0 || l.fsdp, "parallel.shard = {} needs FSDP (ZeRO-2 has no shard groups)", l.shard);
    TESSERA_CHECK(l.shard == 0 || (l.shard >= 2 && D % l.shard == 0),
                  "parallel.shard = {} does not divide the {} ranks into groups of at least 2", l.shard, D);
    cfg.train.micro_batch_size = l.micro_batch;
    cfg.train.recompute = l.recompute;
    cfg.memory.optimizer_offload = l.offload;
    TESSERA_CHECK(l.weights_budget >= 0, "memory.weights_budget = {} MiB must not be negative", l.weights_budget);
    cfg.memory.weights_budget = l.weights_budget;
    cfg.train.micro_batch(int(D / l.tp));  // checks that the batch splits over the tensor groups
    TESSERA_CHECK(l.ep >= 1 && D % l.ep == 0, "parallel.ep = {} does not divide the {} ranks", l.ep, D);
    TESSERA_CHECK(l.ep == 1 || (cfg.model.moe.experts > 0 && cfg.model.moe.experts % l.ep == 0),
                  "parallel.ep = {} does not divide the model's {} experts", l.ep, cfg.model.moe.experts);
    return cfg;
}

std::map<std::string, size_t> RankMemory::by_category() const {
    std::map<std::string, size_t> m;
    for (const Group& g : groups) m[g.category] += g.block_bytes;
    return m;
}

size_t RankMemory::model_state_bytes() const {
    size_t n = 0;
    for (const Group& g : groups)
        if (g.category == "parameters" || g.category == "gradients" || g.category == "optimizer") n += g.block_bytes;
    return n;
}

namespace {
// an unallocated group's layout, again
BufferGroup layout_of(const BufferGroup& g) {
    std::vector<size_t> offsets;
    for (size_t i = 0; i < g.size(); ++i) offsets.push_back(g.offset(i));
    return BufferGroup(g.name(), g.specs(), std::move(offsets), g.nbytes());
}

std::string category_of(const BufferGroup& g) {
    if (g.name().ends_with(".scratch")) return "communication";
    if (g.size() == 0) return "parameters";
    switch (g.specs()[0].kind) {
        case BufferKind::param:
            return "parameters";
        case BufferKind::grad:
            return "gradients";
        case BufferKind::optimizer:
            return "optimizer";
        case BufferKind::activation:
            return "activations";
        case BufferKind::workspace:
            return "workspace";
    }
    return "workspace";
}
// See RankMemory::largest_state_rank: world rank q holds its range of each region over the region's group: rank q of
// the data group (replicated region), q % S of its shard group (data region), q / ep of its expert-data group.
int largest_state_rank(const train::AdamW& opt, int ranks, int ep) {
    int best = 0;
    int64_t most = -1;
    for (int q = 0; q < ranks; ++q) {
        int64_t n = 0;
        for (size_t r = 0; r < train::AdamW::kRegions; ++r) {
            const parallel::ShardedRegion& g = opt.regions()[r];
            if (!g.comm) {
                n += g.shard.size();
                continue;
            }
            n += g.shard.size_of(r == train::AdamW::expert ? parallel::Mesh::expert_data_rank(q, ep)
                                                           : q % g.comm->size());
        }
        if (n > most) {
            most = n;
            best = q;
        }
    }
    return best;
}
}  // namespace

std::vector<RankMemory> predict_rank_memory(const train::RunConfig& run,
                                            const Layout& l,
                                            const std::vector<model::Recompute>& recompute,
                                            int rank,
                                            int threads) {
    const train::RunConfig cfg = with_layout(run, l);
    std::unique_ptr<parallel::Mesh> mesh;
    if (l.ranks > 1) mesh = parallel::Mesh::layout(int(l.ranks), rank, int(l.ep), int(l.shard), int(l.pp), int(l.tp));
    const int ranks = int(l.stage_ranks()), groups = int(l.data_groups());  // the data-parallel group's; taking batches
    train::RankState st(cfg, mesh.get(), cfg.train.accumulation(groups));
    std::optional<train::WeightBudget> budget;  // as train() builds it: what of the base is read in place
    if (cfg.memory.weights_budget > 0) {
        const train::ExpertSlice slice{st.model.local_experts().first, l.ep > 1 ? cfg.model.moe.experts : 0};
        budget.emplace(train::open_model_source(cfg.train.base), st.model, slice,
                       size_t(cfg.memory.weights_budget) << 20);
    }
    st.place(budget ? &*budget : nullptr);
    std::vector<RankMemory> out;
    for (const model::Recompute& r : recompute) {
        std::optional<model::ParamPlacement> placement;  // runtime_groups takes its groups: a copy of each
        if (st.placement)
            placement = model::ParamPlacement{layout_of(st.placement->params), layout_of(st.placement->grads)};
        model::RuntimeGroups rg =
            model::runtime_groups(st.model, {cfg.train.micro_batch(groups), cfg.train.seq_len}, /*with_grads=*/true, r,
                                  placement ? &*placement : nullptr, threads);
        const std::vector<BufferGroup*> all = rg.all(st.extra);
        const std::vector<const BufferGroup*> groups(all.begin(), all.end());
        const std::vector<size_t> blocks = model::arena_block_bytes(groups);
        RankMemory& m = out.emplace_back();
        m.largest_state_rank = rank / ranks * ranks + largest_state_rank(st.opt, ranks, int(l.ep));  // (its stage's)
        for (size_t i = 0; i < groups.size(); ++i) {
            m.groups.push_back({groups[i]->name(), category_of(*groups[i]), groups[i]->nbytes(), blocks[i]});
            m.arena_bytes += blocks[i];
        }
        m.offloaded_bytes = st.opt.offloaded_bytes();
        m.offload_resident_bytes = st.opt.offload_resident_bytes();
        if (budget) {
            const train::WeightBudgetStats b = budget->stats();
            m.mapped_bytes = b.mapped_bytes;
            m.mapped_floor_bytes = b.floor_bytes;
            m.set_weights_budget(b.budget_bytes);
        }
    }
    return out;
}

RankMemory predict_rank_memory(const train::RunConfig& cfg, const Layout& l, int rank, int threads) {
    return std::move(predict_rank_memory(cfg, l, {l.recompute}, rank, threads).front());
}

}  // namespace tessera::plan
