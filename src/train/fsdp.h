// FSDP / ZeRO-3 (DESIGN.md principle 5, spec/scale.md): the dense parameters (Sharding::data) are held as
// ranges, not whole. The data region of the flat parameter space is cut over the data group exactly as the
// optimizer cuts it (parallel/shard.h), so a rank's range of the parameters, of the summed gradient and of
// the AdamW moments are the same elements, and the optimizer updates the range in place. Each unit of the
// model (a block, the embedding, the head; model/model.h) is gathered from the ranks' pieces of it
// (all-gather-v) into a gather slot just before use, the next unit's gather issued when a unit is entered so
// it arrives while this one computes, and overwritten when a later unit needs the slot (three slots: the
// embedding and head, and two alternating over the blocks). In backward each unit's gradient is computed
// into the slot's gradient buffer and reduce-scattered onto the ranges (rank order, added to the previous
// micro-batches' sum: train/grad_sum.h) as soon as the unit is done, while the next unit computes.
// Parameters outside the units (Sharding::replicated: the MoE selection bias, Attention Residuals) and the
// experts (Sharding::expert, sharded by expert parallelism) stay whole where they live.
//
// Memory per rank: the replicated and expert parameters and gradients, 1/W of the dense parameters, of their
// summed gradient and moments, three gathered units of parameters and gradients, and the scratch of one unit's
// reduce-scatter (W pieces of this rank's share of the largest unit).
#pragma once

#include <array>
#include <vector>

#include "model/model.h"
#include "model/runtime.h"
#include "parallel/comm.h"
#include "train/grad_sum.h"
#include "train/optimizer.h"

namespace tessera::train {

struct FsdpStats {
    int64_t gathers = 0, gathered_bytes = 0;  // unit gathers issued (prefetched or not), bytes received
    int64_t reductions = 0;                   // unit reduce-scatters
    double wait_seconds = 0.0;                // compute threads waiting for a gather or a slot's reduction
};

class Fsdp final : public model::ParamHooks {
  public:
    static constexpr int kSlots = 3;

    // The model's units over the optimizer's data region (its communicator: the data group); the gradient
    // ranges are grads'.
    Fsdp(const model::Model& model, const AdamW& opt, GradientSum& grads);

    // For the runtime: the parameter and gradient groups with the units in their slots (taken once), and
    // the groups FSDP itself needs (this rank's range of the data parameters, reduce-scatter scratch).
    model::ParamPlacement placement();
    std::vector<BufferGroup*> groups();
    // After allocation: the runtime's parameter and gradient groups (placement()'s).
    void bind(const BufferGroup& params, const BufferGroup& grads);

    std::span<float> shard();  // this rank's range of the data parameters (the optimizer updates it)
    // The parameters changed (optimizer step, load): every slot is stale.
    void invalidate();
    // Initial values (Model::init_params, unit by unit through a slot; a checkpoint loads straight into shard()).
    void init(const model::Model& model, uint64_t seed);
    FsdpStats stats() const { return stats_; }

    // model::ParamHooks
    void begin(std::span<const model::UnitVisit> plan) override;
    void enter(model::UnitVisit v) override;
    void leave(model::UnitVisit v) override;
    void end() override;

  private:
    struct Unit {
        int64_t lo = 0, hi = 0;  // elements [lo, hi) of the data region
        int slot = 0;
        size_t first = 0, last = 0;     // parameter specs
        std::vector<int64_t> piece;     // elements of the unit on each rank (rank order)
        int64_t mine_lo = 0, mine = 0;  // this rank's piece: first element (region) and length
    };
    void gather(int unit);  // issue the unit's gather into its slot
    void ensure(int unit);  // the unit in its slot (waits for its gather)
    float* slot_params(int slot) const;
    float* slot_grads(int slot) const;

    const std::vector<BufferSpec>& specs_;
    GradientSum& grads_;
    parallel::Comm& comm_;
    parallel::FlatShard cut_;   // the data region over the data group
    int64_t region_base_ = 0;   // the data region's first element in the flat space
    std::vector<size_t> flat_;  // each parameter's flat element offset
    std::vector<Unit> units_;
    std::array<size_t, kSlots> slot_at_{}, slot_bytes_{};  // byte offset of each slot in the placed groups
    model::ParamPlacement placement_;
    BufferGroup shard_, scratch_;
    const BufferGroup *params_ = nullptr, *grads_group_ = nullptr;
    // slot state: the unit whose parameters are there (−1: none or stale), the unit being gathered into it
    std::array<int, kSlots> occupant_, incoming_;
    std::array<parallel::Handle, kSlots> gather_h_, reduce_h_;
    std::vector<model::UnitVisit> plan_;
    std::vector<uint8_t> zero_at_, reduce_at_;  // per visit: first / last backward visit of its unit
    size_t cursor_ = 0;
    FsdpStats stats_;
};

}  // namespace tessera::train
