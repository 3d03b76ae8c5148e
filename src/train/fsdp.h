// FSDP / ZeRO-3 (DESIGN.md principle 5, spec/scale.md): parameters are held as ranges, not whole. The dense
// parameters (Sharding::data) are cut over the data group, and with expert parallelism over several
// expert-data replicas (W / ep > 1) the experts (Sharding::expert) are cut over the expert-data group,
// exactly as the optimizer cuts those regions (parallel/shard.h): a rank's range of the parameters, of the
// summed gradient and of the AdamW moments are the same elements, and the optimizer updates the range in
// place. The cut is spread: each unit's elements are dealt over every rank of the group, so its gather and
// its reduce-scatter move 1/W of it to or from each rank. Each unit of the model (a block with its experts, the
// embedding, the head; model/model.h) is gathered from the ranks' pieces of it (all-gather-v over each part's group)
// into a gather slot just before use, the next unit's gather issued when a unit is entered so it arrives while this one
// computes, and overwritten when a later unit needs the slot (three slots: the embedding and head, and two alternating
// over the blocks). In backward each unit's gradient is computed into the slot's gradient buffer and
// reduce-scattered onto the ranges (rank order, added to the previous micro-batches' sum: train/grad_sum.h)
// as soon as the unit is done, while the next unit computes. A frozen base (model.lora) is sharded the same way:
// its dense parameters form a flat space of their own (region kFrozen) cut over the data group, its experts (when
// replicas share them) another (kFrozenExperts) cut over the expert-data group, gathered with their unit and never
// reduced; under a weight budget it is not sharded: each rank reads it in place from the base's files. Parameters
// outside the units (Sharding::replicated: the MoE selection bias, Attention Residuals), and the experts when each EP
// rank's experts live on that rank alone, stay whole where they live. A unit no pass ever reduces (the DSA warm-up
// trains the indexers only) keeps a zero gradient range.
//
// Memory per rank: the replicated (and unsharded expert) parameters and gradients, 1/W of the dense
// parameters (1/(W/ep) of this rank's experts), of their summed gradient and moments, three gathered units of
// parameters and gradients, and the scratch of one round of a unit's reduce-scatter (the unit's gradient is
// reduce-scattered in rounds of every rank's piece at once: parallel::ReduceRounds).
#pragma once

#include <array>
#include <functional>
#include <vector>

#include "model/model.h"
#include "model/runtime.h"
#include "parallel/comm.h"
#include "train/checkpoint.h"
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
    // The frozen dense parameters (model.lora's base): a region of their own, cut over the data group like the
    // trained ones but outside the optimizer's flat space; gathered with their unit, never reduced.
    static constexpr int kFrozen = int(AdamW::kRegions);
    // The frozen experts when expert-data replicas share them (W / ep > 1): a region of each rank's experts cut over
    // the expert-data group, in the same way.
    static constexpr int kFrozenExperts = kFrozen + 1;

    // The model's units over the optimizer's regions; the gradient ranges are grads'. outside (a weight budget,
    // train/weight_budget.h): the frozen base is not sharded (every rank reads it in place), and the frozen
    // parameters outside(i) names live there instead of in the arena.
    Fsdp(const model::Model& model,
         const AdamW& opt,
         GradientSum& grads,
         const std::function<std::vector<std::byte*>(size_t)>& outside = {});

    // For the runtime: the parameter and gradient groups with the units in their slots (taken once), and
    // the groups FSDP itself needs (this rank's ranges of the sharded parameters, reduce-scatter scratch).
    model::ParamPlacement placement();
    std::vector<BufferGroup*> groups();
    // After allocation: the runtime's parameter and gradient groups (placement()'s).
    void bind(const BufferGroup& params, const BufferGroup& grads);

    // Whether FSDP holds a region (AdamW::Region) as ranges; this rank's range of its parameters.
    bool holds(int region) const { return regions_[size_t(region)].comm != nullptr; }
    // Whether FSDP holds parameter spec i as ranges (each element on one rank of its group), not whole.
    bool holds_param(size_t i) const;
    std::span<float> shard(int region);
    // The parameters changed (optimizer step, load): every slot is stale.
    void invalidate();
    // Initial values (Model::init_params, unit by unit through a slot).
    void init(const model::Model& model, uint64_t seed);
    // What a checkpoint load must fill: this rank's ranges of the regions FSDP holds, the rest whole (experts:
    // this rank's slice); invalidate() afterwards.
    std::vector<ParamTarget> load_targets(const AdamW& opt, const BufferGroup& params, ExpertSlice experts);
    FsdpStats stats() const { return stats_; }

    // model::ParamHooks
    void begin(std::span<const model::UnitVisit> plan) override;
    void enter(model::UnitVisit v) override;
    void leave(model::UnitVisit v) override;
    void end() override;

  private:
    struct Region {
        parallel::Comm* comm = nullptr;  // null: not held by FSDP
        parallel::FlatShard cut;         // the region over comm
        int64_t base = 0;                // its first element in the flat space
        BufferGroup shard;               // this rank's range
    };
    // A unit's stretch of one region, at `at` bytes into its slot.
    struct Part {
        int region = 0;
        int64_t lo = 0, hi = 0;         // elements of the region
        std::vector<int64_t> piece;     // elements on each rank of the region's group
        std::vector<int64_t> bytes;     // the same in bytes (the gather's counts)
        int64_t mine_at = 0, mine = 0;  // this rank's piece: where it is in the rank's range, its length
        int64_t mine_off = 0;           // where it is in the part (the ranks' pieces tile it in rank order)
        size_t at = 0;
        parallel::ReduceRounds reduce;  // the gradient's reduce-scatter of the pieces
    };
    struct Unit {
        int slot = 0;
        std::vector<std::pair<size_t, size_t>> specs;  // spec ranges in the slot
        std::vector<Part> parts;                       // the trained parts first, then the frozen one
        size_t bytes = 0;                              // in the slot
        size_t grad_bytes = 0;                         // the trained parts' (all the gradient slot holds)
    };
    void gather(int unit);  // issue the unit's gather into its slot
    void ensure(int unit);  // the unit in its slot (waits for its gather)
    std::byte* slot_params(int slot) const { return params_->base() + slot_at_[size_t(slot)]; }
    std::byte* slot_grads(int slot) const { return grads_group_->base() + grad_slot_at_[size_t(slot)]; }
    float* mine(const Part& p);  // this rank's piece in its range of the region

    const std::vector<BufferSpec>& specs_;  // every parameter, the frozen ones first
    size_t frozen_ = 0;                     // how many (whole on every rank, no gradient)
    GradientSum& grads_;
    std::function<std::vector<std::byte*>(size_t)> outside_;  // a weight budget's mapped frozen parameters
    std::array<Region, AdamW::kRegions + 2> regions_;         // the optimizer's, then kFrozen, kFrozenExperts
    std::vector<size_t> flat_;                                // each parameter's flat element offset
    std::vector<Unit> units_;
    std::array<size_t, kSlots> slot_at_{}, grad_slot_at_{}, slot_bytes_{},
        grad_slot_bytes_{};  // each slot's byte offset in the placed
                             // groups (parameters, gradients), size
    model::ParamPlacement placement_;
    BufferGroup scratch_;
    const BufferGroup *params_ = nullptr, *grads_group_ = nullptr;
    // slot state: the unit whose parameters are there (−1: none or stale), the unit being gathered into it
    std::array<int, kSlots> occupant_, incoming_;
    std::array<std::vector<parallel::Handle>, kSlots> gather_h_, reduce_h_;
    std::vector<model::UnitVisit> plan_;
    std::vector<uint8_t> zero_at_, reduce_at_;  // per visit: first / last backward visit of its unit
    std::vector<uint8_t> seen_;                 // per unit: scratch of begin()
    size_t cursor_ = 0;
    FsdpStats stats_;
};

}  // namespace tessera::train
