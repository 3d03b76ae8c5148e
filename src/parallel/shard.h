// How ZeRO shards a buffer group over the data group: its flat element space [0, N) (every buffer at
// its offset, alignment gaps included) cut into W consecutive ranges of `per_rank` elements, a multiple
// of the quantum so that fixed-size reduction chunks (the gradient norm's) never straddle two ranks.
// The last ranges may be short or empty. The cut depends only on (N, W, quantum), so a checkpoint's
// shards can be re-cut for another world size.
#pragma once

#include <algorithm>
#include <cstdint>
#include <utility>
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
    int64_t lo() const { return base + shard.lo; }
    int64_t hi() const { return base + shard.hi; }
};

}  // namespace tessera::parallel
