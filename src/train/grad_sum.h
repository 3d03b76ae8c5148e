// How a step's gradient is summed, in one fixed order whatever the number of ranks and threads: each
// micro-batch's gradient is computed into zeroed buffers and added to the step's sum in micro-batch order
// (the ops' own accumulation into a gradient never mixes two micro-batches), then the ranks' sums are
// added in rank order by a reduce-scatter that leaves each rank its range of the result (ZeRO: the
// optimizer's range, parallel/shard.h). So W ranks with one micro-batch each give the bits of one rank
// accumulating the same W micro-batches.
#pragma once

#include <span>
#include <vector>

#include "core/buffer_spec.h"
#include "parallel/comm.h"
#include "parallel/shard.h"

namespace tessera::train {

class GradientSum {
  public:
    // accumulation: micro-batches per step on this rank; comm null or one rank: no reduction.
    GradientSum(const std::vector<BufferSpec>& param_specs,
                const parallel::FlatShard& range,
                int64_t accumulation,
                parallel::Comm* comm = nullptr);

    // The buffers it needs, for the runtime to allocate with the rest: the step's sum when it accumulates
    // more than one micro-batch, this rank's range of the reduced sum when there is more than one rank.
    std::vector<BufferGroup*> groups();
    int64_t accumulation() const { return accumulation_; }

    // Before micro-batch `micro` (0-based): clears the model's gradients; after it: adds them to the sum.
    void before(int64_t micro, const BufferGroup& grads);
    void after(int64_t micro, const BufferGroup& grads);
    // After the last micro-batch: this rank's range of the step's gradient summed over ranks (collective).
    std::span<float> finish(const BufferGroup& grads);

  private:
    parallel::FlatShard range_;
    int64_t accumulation_;
    parallel::Comm* comm_;
    BufferGroup sum_, mine_;
};

}  // namespace tessera::train
