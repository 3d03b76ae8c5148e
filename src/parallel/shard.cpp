// The cuts of a region over its ranks (see shard.h).
#include "parallel/shard.h"

namespace tessera::parallel {

FlatShard::FlatShard(int64_t n, int rank, int world, int64_t quantum, std::vector<int64_t> segments, bool spread)
    : total_(n), quantum_(quantum), rank_(rank), spread_(spread), of_(size_t(std::max(world, 1))) {
    TESSERA_CHECK(n >= 0 && world >= 1 && rank >= 0 && rank < world && quantum >= 1,
                  "FlatShard: {} elements, rank {} of {}, quantum {}", n, rank, world, quantum);
    segments.push_back(0);
    std::sort(segments.begin(), segments.end());
    segments.erase(std::unique(segments.begin(), segments.end()), segments.end());
    TESSERA_CHECK(segments.back() <= n, "FlatShard: a segment at {} of {} elements", segments.back(), n);
    if (segments.size() > 1 && segments.back() == n) segments.pop_back();
    segments.push_back(n);  // segment k: [segments[k], segments[k + 1])
    const size_t K = segments.size() - 1;
    std::vector<int64_t> first(K + 1, 0);  // each segment's first chunk among the region's
    for (size_t k = 0; k < K; ++k) first[k + 1] = first[k] + (segments[k + 1] - segments[k] + quantum - 1) / quantum;
    // chunks [c0, c1) of segment k to rank r
    auto add = [&](int r, size_t k, int64_t c0, int64_t c1) {
        if (c1 <= c0) return;
        std::vector<Interval>& v = of_[size_t(r)];
        const int64_t at = v.empty() ? 0 : v.back().at + len(v.back());
        v.push_back({segments[k] + c0 * quantum, std::min(segments[k + 1], segments[k] + c1 * quantum), at});
    };
    if (spread) {
        int turn = 0;  // the rank that gets the next segment's first leftover chunk
        for (size_t k = 0; k < K; ++k) {
            const int64_t c = first[k + 1] - first[k], each = c / world, left = c % world;
            int64_t c0 = 0;
            for (int r = 0; r < world; ++r) {
                const int64_t mine = each + ((r - turn + world) % world < left ? 1 : 0);
                add(r, k, c0, c0 + mine);
                c0 += mine;
            }
            turn = int((turn + left) % world);
        }
    } else {
        const int64_t per = (first[K] + world - 1) / world;
        for (int r = 0; r < world; ++r) {
            const int64_t c0 = std::min(first[K], int64_t(r) * per), c1 = std::min(first[K], c0 + per);
            for (size_t k = size_t(std::upper_bound(first.begin(), first.end(), c0) - first.begin()) - 1;
                 k < K && first[k] < c1; ++k)
                add(r, k, std::max(c0, first[k]) - first[k], std::min(c1, first[k + 1]) - first[k]);
        }
    }
    for (int r = 0; r < world; ++r) longest_ = std::max(longest_, size_of(r));
}

std::pair<int64_t, int64_t> FlatShard::stretch_of(int r) const {
    const std::vector<Interval>& v = of_[size_t(r)];
    if (v.empty()) return {total_, total_};
    TESSERA_CHECK(v.back().hi - v.front().lo == size_of(r), "FlatShard: rank {}'s range is not one stretch", r);
    return {v.front().lo, v.back().hi};
}

namespace {
// the part of [a, b) in interval i: [lo, hi), empty when hi <= lo
std::pair<int64_t, int64_t> overlap(const FlatShard::Interval& i, int64_t a, int64_t b) {
    return {std::max(a, i.lo), std::min(b, i.hi)};
}
}  // namespace

std::vector<int64_t> FlatShard::parts(int64_t a, int64_t b) const {
    std::vector<int64_t> n(of_.size(), 0);
    int64_t next = a;
    for (size_t r = 0; r < of_.size(); ++r) {
        for (const Interval& i : of_[r]) {
            const auto [lo, hi] = overlap(i, a, b);
            if (hi <= lo) continue;
            TESSERA_CHECK(lo == next, "FlatShard: elements [{}, {}) are not in rank order (rank {} holds {} next)", a,
                          b, r, lo);
            n[r] += hi - lo;
            next = hi;
        }
    }
    TESSERA_CHECK(a >= b || next == b, "FlatShard: elements [{}, {}) are not all held", a, b);
    return n;
}

int64_t FlatShard::at(int64_t a, int64_t b) const {
    for (const Interval& i : mine())
        if (const auto [lo, hi] = overlap(i, a, b); lo < hi) return i.at + (lo - i.lo);
    return 0;
}

}  // namespace tessera::parallel
