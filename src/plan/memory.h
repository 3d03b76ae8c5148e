// A rank's memory in a layout, from the buffer groups train() allocates for it: train/rank_state.h built on
// parallel::Mesh::layout (a rank of a job that is not running), then the model runtime's groups
// (model::runtime_groups). Every group is one block of the rank's arena, so the sum of the blocks is the arena's
// high-water mark after the first step: model states, activations and scratch are byte-exact by construction
// (DESIGN.md principle 2). Outside the arena (not predicted here): the GEMM copy buffers, libraries, MPI.
#pragma once

#include <algorithm>
#include <map>
#include <string>
#include <vector>

#include "model/recompute.h"
#include "train/config.h"

namespace tessera::plan {

// What the planner chooses for a run (docs/plan.md): ranks, expert parallelism, FSDP or ZeRO-2, sequences per
// forward per rank, recompute.
struct Layout {
    int64_t ranks = 1, ep = 1;
    bool fsdp = true;
    int64_t micro_batch = 1;     // sequences per forward on each rank (its tensor group's; train.micro_batch_size)
    model::Recompute recompute;  // the block kinds that recompute (model/recompute.h)
    int64_t shard = 0;           // FSDP's shard group (parallel.shard): 0 every rank, else HSDP
    bool offload = false;        // AdamW's moments in a file (memory.optimizer_offload)
    int64_t pp = 1;              // pipeline stages (parallel.pipeline); each a data-parallel group of ranks / pp
    std::vector<int64_t> split;  // their first layers after the first (parallel.pipeline_split); empty: even
    bool rerun = false;          // stages re-run a micro-batch's forward before its backward (parallel.pipeline_rerun)
    int64_t tp = 1;              // ranks per tensor group (parallel.tensor): they share each micro-batch
    int64_t weights_budget = 0;  // MiB of a LoRA base read in place kept resident (memory.weights_budget); 0: none
    // ranks of one pipeline stage (every rank without stages): the data-parallel group
    int64_t stage_ranks() const { return ranks / pp; }
    // the stage's ranks that take micro-batches of their own: its tensor groups
    int64_t data_groups() const { return stage_ranks() / tp; }
    // ranks the dense parameters are sharded over (FSDP: the shard group; ZeRO-2: the stage's ranks)
    int64_t shard_ranks() const { return shard > 0 ? shard : stage_ranks(); }
    // e.g. "ep 8, fsdp, micro 2, recompute", "ep 8, hsdp 8, micro 1, recompute kda+moe, offload",
    // "pp 4 [15,31,46], ep 8, fsdp, micro 1", "pp 2 rerun, ep 1, zero-2, micro 2", "tp 4, ep 8, fsdp, micro 1",
    // "ep 1, one rank, micro 2, budget 48 MiB"
    std::string str() const;
};

// The run config with the layout's choices in it (parallel.ep, parallel.fsdp, parallel.shard, parallel.pipeline and
// its split, parallel.tensor, train.micro_batch_size, train.recompute, memory.optimizer_offload,
// memory.weights_budget); one-line error when
// the batch does not split so.
train::RunConfig with_layout(train::RunConfig cfg, const Layout& l);

struct RankMemory {
    struct Group {
        std::string name, category;         // category: parameters, gradients, optimizer, activations, workspace,
                                            // communication (reduce-scatter scratch)
        size_t bytes = 0, block_bytes = 0;  // packed; in the arena
    };
    std::vector<Group> groups;
    size_t arena_bytes = 0;  // Σ block_bytes
    // memory.weights_budget: the frozen base read in place from its files, outside the arena, and what of it is
    // resident at most: the budget plus the two largest units (the one computing, the next one prefetched), never
    // more than all of it (train/weight_budget.h)
    size_t mapped_bytes = 0, mapped_resident_bytes = 0;
    size_t mapped_floor_bytes = 0;  // the two largest units
    // what of the mapped base may be resident under a budget of `budget_bytes`
    void set_weights_budget(size_t budget_bytes) {
        mapped_resident_bytes = std::min(mapped_bytes, budget_bytes + mapped_floor_bytes);
    }
    // memory.optimizer_offload: AdamW's moments in their file, and the most of them resident during a step
    // (train/optimizer.h)
    size_t offloaded_bytes = 0, offload_resident_bytes = 0;
    // the rank of the layout whose AdamW moments are the most (FSDP's spread cut deals each unit's leftover chunks to
    // the ranks in turn; every other group has the same size on every rank, or is largest on rank 0 or the last)
    int largest_state_rank = 0;
    size_t peak_bytes() const {  // what the device must hold
        return arena_bytes + mapped_resident_bytes + offload_resident_bytes;
    }
    std::map<std::string, size_t> by_category() const;  // block bytes
    size_t model_state_bytes() const;                   // parameters + gradients + optimizer
};

// Rank `rank`'s arena in layout l, with `threads` OpenMP threads per rank (the workspace is per thread). With
// memory.weights_budget the base (train.base) is opened as the run would open it, to know what is read in place.
RankMemory predict_rank_memory(const train::RunConfig& cfg, const Layout& l, int rank, int threads);
// The same for each of `recompute` in place of l.recompute (the rest of the rank's state built once).
std::vector<RankMemory> predict_rank_memory(const train::RunConfig& cfg,
                                            const Layout& l,
                                            const std::vector<model::Recompute>& recompute,
                                            int rank,
                                            int threads);

}  // namespace tessera::plan
