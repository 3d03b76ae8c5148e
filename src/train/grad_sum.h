// How a step's gradient is summed, in one fixed order whatever the number of ranks and threads: each
// micro-batch's gradient is computed into zeroed buffers and added to the step's sum in micro-batch order
// (the ops' own accumulation into a gradient never mixes two micro-batches), then the ranks' sums are
// added in rank order by reduce-scatters that leave each rank its ranges of the result (the optimizer's
// ranges: the replicated region over the data group, the expert region over the expert-data group;
// train/optimizer.h). So W ranks with one micro-batch each give the bits of one rank accumulating the
// same W micro-batches.
#pragma once

#include <vector>

#include "core/buffer_spec.h"
#include "train/optimizer.h"

namespace tessera::train {

class GradientSum {
  public:
    // accumulation: micro-batches per step on this rank; the ranges are the optimizer's.
    GradientSum(const std::vector<BufferSpec>& param_specs, const AdamW& opt, int64_t accumulation);

    // The buffers it needs, for the runtime to allocate with the rest: the step's sum when it accumulates
    // more than one micro-batch, this rank's ranges of the reduced sum when ranks share a region.
    std::vector<BufferGroup*> groups();
    int64_t accumulation() const { return accumulation_; }

    // Before micro-batch `micro` (0-based): clears the model's gradients; after it: adds them to the sum.
    void before(int64_t micro, const BufferGroup& grads);
    void after(int64_t micro, const BufferGroup& grads);
    // After the last micro-batch: this rank's ranges of the step's gradient summed over ranks (collective).
    GradRanges finish(const BufferGroup& grads);

  private:
    std::array<parallel::ShardedRegion, 2> regions_;
    int64_t total_;  // flat elements
    int64_t accumulation_;
    BufferGroup sum_, mine_;
};

}  // namespace tessera::train
