// How ZeRO shards a region of a buffer group over the ranks that share it. The region's flat element space [0, N)
// (every buffer at its offset, alignment gaps included) is split into segments (the model's units, which FSDP gathers
// one at a time; one segment when none are given), and each segment into chunks of `quantum` elements from its start,
// the last one short: the fixed chunks the gradient norm sums (optimizer.h), so that no chunk is split between ranks.
// Two cuts deal the chunks out:
//  - contiguous (ZeRO-2, and the regions FSDP does not hold): rank r holds the region's chunks [r·p, (r+1)·p) in
//    order, p = ⌈chunks / W⌉: one stretch of the flat space, which the optimizer updates in place;
//  - spread (FSDP): each segment's c chunks are dealt over the ranks in rank order, ⌊c / W⌋ to each and the c mod W
//    left over to the ranks next in turn (the turn carries over from one segment to the next), so every unit is
//    gathered from and reduced onto every rank evenly. (A contiguous cut leaves a unit in one or two ranks' stretches,
//    and those ranks send and receive all of it: W times the traffic of the busiest link.)
// A rank's range is its intervals one after another; an interval never crosses a segment's end. The cut depends only on
// (N, W, quantum, segments, spread), so a checkpoint's shards can be re-cut for another layout (their pieces name
// elements of the whole tensors).
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
#include <vector>

#include "core/check.h"
#include "parallel/comm.h"

namespace tessera::parallel {

class FlatShard {
  public:
    struct Interval {
        int64_t lo = 0, hi = 0;  // elements [lo, hi) of the region
        int64_t at = 0;          // where they start in the rank's range
    };

    FlatShard() = default;
    // segments: where each starts (0 is one whether named or not); spread: FSDP's cut, else the contiguous one
    FlatShard(int64_t n, int rank, int world, int64_t quantum, std::vector<int64_t> segments = {}, bool spread = false);

    int64_t total() const { return total_; }
    int64_t longest() const { return longest_; }  // the longest rank's range: a buffer for any rank's
    const std::vector<Interval>& mine() const { return of_[size_t(rank_)]; }
    const std::vector<Interval>& of(int r) const { return of_[size_t(r)]; }
    int64_t size() const { return size_of(rank_); }
    int64_t size_of(int r) const {
        return of_[size_t(r)].empty() ? 0 : of_[size_t(r)].back().at + len(of_[size_t(r)].back());
    }
    // Rank r's stretch [lo, hi) of a contiguous cut (empty ranges: [N, N)).
    std::pair<int64_t, int64_t> stretch_of(int r) const;
    std::pair<int64_t, int64_t> stretch() const { return stretch_of(rank_); }
    bool spread() const { return spread_; }
    // How many of the elements [a, b) each rank holds; checked to tile [a, b) in rank order, one stretch per rank (what
    // an all-gather-v of the ranks' pieces puts together).
    std::vector<int64_t> parts(int64_t a, int64_t b) const;
    // Where this rank's first element at or after a (in [a, b), which parts() tiled) is in its range (0: none).
    int64_t at(int64_t a, int64_t b) const;
    // Chunks of an interval (whole chunks of its segment, the last one perhaps short).
    int64_t chunks(const Interval& i) const { return (len(i) + quantum_ - 1) / quantum_; }

  private:
    static int64_t len(const Interval& i) { return i.hi - i.lo; }
    int64_t total_ = 0, quantum_ = 1, longest_ = 0;
    int rank_ = 0;
    bool spread_ = false;
    std::vector<std::vector<Interval>> of_ = {{}};  // every rank's intervals, in flat order
};

// A reduce-scatter of large pieces (rank q's: pieces[q] elements at offsets[q] of the send buffer) in rounds: round j
// sums elements [j·c, (j+1)·c) of every rank's piece at once, so every rank receives in every round, and the scratch
// (a round's W pieces received, and its W pieces packed to send) stays 2·W·c elements; c = 2²⁰ / W elements, at least
// 2¹⁴ (64 KiB to each peer: not latency-bound), at most the longest piece.
struct ReduceRounds {
    std::vector<int64_t> pieces, offsets;
    int64_t round = 1, rounds = 1;  // c; how many

    ReduceRounds() = default;
    ReduceRounds(std::vector<int64_t> p, std::vector<int64_t> o) : pieces(std::move(p)), offsets(std::move(o)) {
        TESSERA_CHECK(!pieces.empty() && pieces.size() == offsets.size(), "ReduceRounds: {} pieces, {} offsets",
                      pieces.size(), offsets.size());
        const int64_t W = int64_t(pieces.size()), longest = *std::max_element(pieces.begin(), pieces.end());
        round = std::max<int64_t>(1, std::min(std::max<int64_t>((int64_t(1) << 20) / W, int64_t(1) << 14), longest));
        rounds = std::max<int64_t>(1, (longest + round - 1) / round);
    }
    int64_t scratch_elements() const { return 2 * int64_t(pieces.size()) * round; }
    // every rank's piece of round j, into n (W elements)
    void counts(int64_t j, std::vector<int64_t>& n) const {
        n.resize(pieces.size());
        for (size_t q = 0; q < pieces.size(); ++q) n[q] = std::clamp<int64_t>(pieces[q] - j * round, 0, round);
    }
    // Issues every round on c (f32 sums in rank order; accumulate: added to recv's values): send holds each rank's
    // piece at its offset, recv this rank's piece; scratch: scratch_elements() floats. The handles go to `out`.
    void reduce_scatter(Comm& c,
                        const float* send,
                        float* recv,
                        bool accumulate,
                        std::span<std::byte> scratch,
                        std::vector<Handle>& out) {
        const int64_t mine = pieces[size_t(c.rank())];
        for (int64_t j = 0; j < rounds; ++j) {
            const int64_t a = j * round;
            counts(j, counts_);
            out.push_back(c.reduce_scatter_v_async(DType::f32, send + a, counts_, recv + std::min(a, mine),
                                                   counts_[size_t(c.rank())], accumulate, scratch, offsets));
        }
    }

  private:
    std::vector<int64_t> counts_;  // a round's (reduce_scatter copies them when it issues the round)
};

// One region of a buffer group's flat element space, cut over the ranks that share it.
struct ShardedRegion {
    int64_t base = 0;      // the region's first element in the flat space
    FlatShard shard;       // this rank's range, relative to base
    Comm* comm = nullptr;  // the ranks that share the region (null: this rank alone)
    // the ranks that hold the same range of it (HSDP's replicas of the dense region; null: none)
    Comm* replicas = nullptr;
};

}  // namespace tessera::parallel
