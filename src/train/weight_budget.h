// memory.weights_budget (docs/train.md, "Weight budget"): a LoRA fine-tune's frozen base read in place from its
// safetensors files instead of copied into the arena, with this process's resident share of it held to a budget,
// so a base larger than memory fine-tunes.
//
// Which parameters: every frozen one the base stores as is, in the dtype it is held in (model.lora.base_dtype): a
// tessera checkpoint's model.safetensors, all of them, experts as this rank's slice of the stacked tensor; a Hugging
// Face directory, its plain tensors of the same whole shape, and stacked experts stored one tensor per expert
// (all four families when not quantised), whose views then have their slices stored apart (core/tensor.h) and reach the
// MoE's grouped GEMMs expert by expert; so do routed experts stored in MXFP4 (Kimi K3's release) when they are held
// in MXFP4 (model.lora.expert_dtype): their packed values and scales are read as the checkpoint lays them out, checked
// once when mapped (core/mxfp4.h). The others (fused, padded, FP8 or converted tensors) load into the arena as
// without a budget.
//
// How: the model's passes visit their units in a known order (model::ParamHooks). Entering a visit, a background
// thread faults in the pages of the next visit's unit (its dense weights, then its experts, most routed first)
// while this one computes; leaving it, while the mapped bytes resident in this process exceed the budget, pieces
// are released (madvise MADV_DONTNEED) in order: the unit whose next use is farthest first, and within it the
// experts routed least (the routing load of the steps so far: an expert cache by observed frequency), the
// current and the next visit's units last. Resident bytes are measured (/proc/self/pagemap), not assumed. The values
// are the file's whatever is resident, so a budgeted run computes bit for bit what a resident one does; a budget below
// two units' worth is kept as well as it can be (the floor is printed). With FSDP the base is not sharded (every
// rank maps the file; train/fsdp.h), what trains is.
#pragma once

#include <condition_variable>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "core/safetensors.h"
#include "model/model.h"
#include "model/runtime.h"
#include "train/checkpoint.h"
#include "train/model_source.h"

namespace tessera::train {

struct WeightBudgetStats {
    size_t mapped_bytes = 0;         // the frozen base read in place
    size_t budget_bytes = 0;         // memory.weights_budget
    size_t floor_bytes = 0;          // the two largest units: what the budget cannot go below
    size_t resident_bytes = 0;       // now (page-table residency of the mapped parameters)
    size_t peak_resident_bytes = 0;  // the most seen when leaving a visit
    int64_t released_bytes = 0;      // handed back (madvise), over the run
    int64_t prefetched_bytes = 0;    // faulted in ahead of use by the background thread
    int64_t major_faults = 0;        // pages read from storage by this process (getrusage), over the run
};

class WeightBudget final : public model::ParamHooks {
  public:
    // Maps what the base stores as is (see above) for model m holding `experts` (its slice; total 0: all).
    WeightBudget(const ModelSource& base, const model::Model& m, ExpertSlice experts, size_t budget_bytes);
    ~WeightBudget() override;
    WeightBudget(const WeightBudget&) = delete;
    WeightBudget& operator=(const WeightBudget&) = delete;

    bool mapped(size_t param) const { return param < where_.size() && !where_[param].empty(); }
    // where a mapped parameter lives in the files: all of it, or (stored one tensor per expert) each expert here;
    // empty: not mapped
    std::vector<std::byte*> where(size_t param) const {
        return mapped(param) ? where_[param] : std::vector<std::byte*>{};
    }
    // The runtime's parameter and gradient groups: the mapped parameters take no arena bytes, their views point
    // into the files.
    model::ParamPlacement placement() const;
    // The targets a load must still fill (those not mapped).
    std::vector<ParamTarget> unmapped(const std::vector<ParamTarget>& targets) const;
    // The routing load of a step (expert frequencies for the cache order).
    void observe(const model::StepStats& s);
    // Releases pieces until the resident bytes are within the budget (after loading and hashing touched them all).
    void trim();
    WeightBudgetStats stats();

    // model::ParamHooks
    void begin(std::span<const model::UnitVisit> plan) override;
    void enter(model::UnitVisit v) override;
    void leave(model::UnitVisit v) override;
    void end() override {}

  private:
    struct Piece {
        const std::byte* data = nullptr;
        size_t bytes = 0;
        int unit = -1;        // the model unit whose visits use it (-1: none known)
        int layer = -1;       // an MoE layer's experts: its index, for the routing load
        int64_t expert = -1;  // >= 0: one expert's slice (its global index)
    };
    size_t resident(const Piece& p);
    int64_t load_of(const Piece& p) const;  // an expert's routing load so far (a dense piece: the most)
    void release_until(size_t budget, int keep_a, int keep_b);
    void prefetch(int unit);  // hands the unit's ranges to the background thread
    void worker();

    std::vector<BufferSpec> specs_;
    std::vector<std::unique_ptr<SafetensorsFile>> files_;
    std::vector<std::vector<std::byte*>> where_;  // per parameter: where(), or empty
    std::vector<Piece> pieces_;
    std::vector<std::vector<size_t>> unit_pieces_;  // per unit: its pieces
    std::vector<std::vector<int64_t>> load_;        // per layer: routing load per expert, summed over steps
    std::vector<model::UnitVisit> plan_;
    size_t cursor_ = 0;
    // scratch of release_until and prefetch, reused
    std::vector<uint64_t> scratch_;
    struct Candidate {
        size_t distance;  // visits to the next use
        int64_t load;
        size_t piece;
    };
    std::vector<size_t> resident_, next_use_;
    std::vector<Candidate> order_;
    std::vector<std::pair<int64_t, size_t>> prefetch_order_;
    WeightBudgetStats stats_;
    int64_t faults_at_start_ = 0;
    // the prefetch thread: the ranges to fault in next, whether there are new ones, whether to stop
    std::mutex mu_;
    std::condition_variable cv_;
    std::vector<std::pair<const std::byte*, size_t>> queue_;
    bool pending_ = false, stop_ = false;
    int64_t prefetched_ = 0;
    std::thread thread_;
};

}  // namespace tessera::train
