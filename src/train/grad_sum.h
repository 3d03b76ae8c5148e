// How a step's gradient is summed, in one fixed order whatever the number of ranks and threads: each
// micro-batch's gradient is computed into zeroed buffers (the ops' own accumulation into a gradient never
// mixes two micro-batches), then added to the step's sum: rank r's micro-batch m is the step's
// (m·W + r)-th (train/data/loader.h), and the ranks' gradients of micro-batch m are added to the sum in rank
// order by a reduce-scatter that leaves each rank its ranges of it (the optimizer's ranges: the replicated
// and data regions over the data group, the expert region over the expert-data group; train/optimizer.h).
// So the sum is g_0 + g_1 + g_2 + ... in the step's micro-batch order, the bits of one rank accumulating
// every micro-batch, on any number of ranks. With FSDP the data region is reduce-scattered block by block
// during backward (train/fsdp.h) into the same ranges, the same way.
//
// HSDP (parallel.shard < W) is the exception: the data region is reduce-scattered within each shard group, and
// after the last micro-batch the shard groups' sums are added in replica order (an all-reduce over the replica
// group). Two levels of sums: deterministic run to run and on any thread count, but not the bits of one rank.
#pragma once

#include <vector>

#include "core/buffer_spec.h"
#include "train/optimizer.h"

namespace tessera::train {

class GradientSum {
  public:
    // accumulation: micro-batches per step on this rank; the ranges are the optimizer's. fsdp: the regions FSDP
    // holds (the data region, and the expert region when expert-data replicas share it) are reduced by FSDP
    // into range(), not here.
    GradientSum(const AdamW& opt, int64_t accumulation, bool fsdp = false);

    // The buffers it needs, for the runtime to allocate with the rest: this rank's ranges of the sums of the
    // regions it shares with other ranks, the step's sum of the others when it accumulates micro-batches, and
    // the reductions' receive scratch.
    std::vector<BufferGroup*> groups();
    int64_t accumulation() const { return accumulation_; }

    // Before micro-batch `micro` (0-based): clears the model's gradients; after it: adds them to the sum
    // (collective for the shared regions).
    void before(int64_t micro, const BufferGroup& grads);
    void after(int64_t micro, const BufferGroup& grads);
    // After the last micro-batch: this rank's ranges of the step's gradient.
    GradRanges finish(const BufferGroup& grads);

    // FSDP: this rank's range of a region's sum, and whether this micro-batch adds to it (false for the first,
    // which replaces it).
    std::span<float> range(int region);
    bool adding() const { return micro_ > 0; }

  private:
    const AdamW& opt_;
    std::array<parallel::ShardedRegion, AdamW::kRegions> regions_;
    int64_t accumulation_;
    bool fsdp_;
    int64_t micro_ = 0;
    void wait();  // for the reductions in flight
    bool by_fsdp(size_t region) const;
    // per region: this rank's range of the sum (shared regions), or the step's sum (local, accumulating)
    std::array<BufferGroup, AdamW::kRegions> sum_;
    // NOTES: a shared region is reduced in rounds (parallel::ReduceRounds): round j sums elements [j·c, (j+1)·c) of
    // every rank's range at once. (Stretches of the flat space, as before 2026-12-05, each went to the one or two ranks
    // whose range holds it while the others waited: at W ranks a W-fold incast, and W stretches of scratch.) The
    // rounds queue on the communication thread, which runs them in turn with one scratch.
    BufferGroup scratch_;
    std::array<parallel::ReduceRounds, AdamW::kRegions> rounds_;  // per shared region: the ranges over the ranks
    std::array<parallel::ReduceRounds, AdamW::kRegions> replica_rounds_;  // HSDP: a range's pieces over the replicas
    std::vector<parallel::Handle> pending_;
};

}  // namespace tessera::train
