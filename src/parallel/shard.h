// How ZeRO shards a buffer group over the data group: its flat element space [0, N) (every buffer at
// its offset, alignment gaps included) cut into W consecutive ranges of `per_rank` elements, a multiple
// of the quantum so that fixed-size reduction chunks (the gradient norm's) never straddle two ranks.
// The last ranges may be short or empty. The cut depends only on (N, W, quantum), so a checkpoint's
// shards can be re-cut for another world size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <vector>

#include "core/check.h"
#include "parallel/comm.h"

namespace tessera::parallel {

struct FlatShard {
    int64_t total = 0;       // N: elements of the flat space
    int64_t per_rank = 0;    // elements per range (a multiple of the quantum)
    int64_t lo = 0, hi = 0;  // this rank's range

    FlatShard() = default;
    FlatShard(int64_t n, int rank, int world, int64_t quantum) : total(n) {
        TESSERA_CHECK(n >= 0 && world >= 1 && rank >= 0 && rank < world && quantum >= 1,
                      "FlatShard: {} elements, rank {} of {}, quantum {}", n, rank, world, quantum);
        const int64_t quanta = (n + quantum - 1) / quantum;
        per_rank = (quanta + world - 1) / world * quantum;
        lo = std::min(n, int64_t(rank) * per_rank);
        hi = std::min(n, lo + per_rank);
    }
    int64_t size() const { return hi - lo; }
    int64_t lo_of(int r) const { return std::min(total, int64_t(r) * per_rank); }
    int64_t hi_of(int r) const { return std::min(total, lo_of(r) + per_rank); }
    // How many of the elements [a, b) each rank holds (rank order: the parts tile [a, b)).
    std::vector<int64_t> parts(int64_t a, int64_t b, int world) const {
        std::vector<int64_t> n(static_cast<size_t>(world));
        for (int r = 0; r < world; ++r)
            n[size_t(r)] = std::max<int64_t>(0, std::min(b, hi_of(r)) - std::max(a, lo_of(r)));
        return n;
    }
};

// A reduce-scatter of large pieces runs in rounds of this many elements of every rank's piece at once, so every rank
// receives in every round and the scratch (a round's W pieces received, and its W pieces packed to send) stays
// 2·W·round elements: 2²⁰ elements over all ranks, at least 2¹⁴ per rank (64 KiB to each peer: not latency-bound).
inline int64_t reduce_round(int ranks) { return std::max<int64_t>((int64_t(1) << 20) / ranks, int64_t(1) << 14); }

// One region of a buffer group's flat element space, cut over the ranks that share it.
struct ShardedRegion {
    int64_t base = 0;      // the region's first element in the flat space
    FlatShard shard;       // this rank's range, relative to base
    Comm* comm = nullptr;  // the ranks that share the region (null: this rank alone)
    int64_t lo() const { return base + shard.lo; }
    int64_t hi() const { return base + shard.hi; }
};

}  // namespace tessera::parallel
