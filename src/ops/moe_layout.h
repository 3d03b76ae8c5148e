// The MoE layer's routing bookkeeping on raw host rows (formulas: ops/moe.h), written once for the CPU
// (ops/cpu/moe.cpp) and for the CUDA backend, which reads the router's choices back, runs these on the host and copies
// the layout to the device (ops/cuda/moe_ops.cpp): capacity with re-routing or dropping, and the expert-contiguous
// layout. Sequential over (token, slot) pairs in a fixed order, so both backends lay the same rows out the same way.
#pragma once

#include <algorithm>
#include <cstdint>
#include <limits>
#include <numeric>
#include <utility>

#include "ops/moe.h"
#include "ops/router_rows.h"

namespace tessera::ops {

// Capacity: the pairs (token n, slot j) of choice [N, K] claim room in priority order (s + bias descending, ties by
// pair index); cap(e) = share[e] (expert parallelism's room for this rank) or `uniform`. An overflowing pair takes its
// token's best other expert with room among the allowed groups (reroute) or is dropped. Writes expert [N, K] (−1:
// dropped); order [N·K] and load [E] are scratch. Returns (rerouted, dropped).
template <class T>
std::pair<int64_t, int64_t> moe_capacity_rows(const MoeParams& p,
                                              int64_t N,
                                              int64_t E,
                                              int64_t K,
                                              int64_t uniform,
                                              const T* S,
                                              const int32_t* choice,
                                              const T* bias,
                                              const int64_t* share,
                                              int32_t* expert,
                                              int32_t* order,
                                              int32_t* load) {
    auto cap = [&](int64_t e) { return share ? share[e] : uniform; };
    auto key = [&](int64_t n, int64_t e) {  // NaN ranks last: the sort's order stays a strict weak one
        const T k = bias ? S[n * E + e] + bias[e] : S[n * E + e];
        return k == k ? k : -std::numeric_limits<T>::infinity();
    };
    std::iota(order, order + N * K, 0);
    std::sort(order, order + N * K, [&](int32_t a, int32_t b) {
        const T ka = key(a / K, choice[a]), kb = key(b / K, choice[b]);
        return ka > kb || (ka == kb && a < b);
    });
    std::fill(load, load + E, 0);
    constexpr int32_t kOver = -2;
    for (int64_t q = 0; q < N * K; ++q) {
        const int32_t i = order[q], e = choice[i];
        expert[i] = load[e] < cap(e) ? (++load[e], e) : kOver;
    }
    int64_t rerouted = 0, dropped = 0;
    uint8_t allowed[kRouterMaxGroups];
    const RouterRowParams rp = p.router.row();
    for (int64_t q = 0; q < N * K; ++q) {
        const int32_t i = order[q];
        if (expert[i] != kOver) continue;
        int32_t best = -1;
        const int64_t n = i / K;
        if (p.overflow == MoeOverflow::reroute) {
            router_allowed_groups_row(rp, S + n * E, bias, E, allowed);
            const int32_t* mine = expert + n * K;
            for (int64_t e = 0; e < E; ++e) {
                if (load[e] >= cap(e) || !router_group_allows(rp, allowed, E, e)) continue;
                if (std::find(mine, mine + K, int32_t(e)) != mine + K) continue;
                if (best < 0 || key(n, e) > key(n, best)) best = int32_t(e);
            }
        }
        if (best >= 0) {
            ++load[best];
            ++rerouted;
        } else {
            ++dropped;
        }
        expert[i] = best;
    }
    return {rerouted, dropped};
}

// The layout of the final experts [N, K]: counts [E] (rows per expert), padded segment starts offsets [E + 1], and
// each pair's row in (expert, token, slot) order (−1: dropped).
inline void moe_layout_rows(
    int64_t N, int64_t K, int64_t E, const int32_t* expert, int32_t* row, int32_t* counts, int32_t* offsets) {
    std::fill(counts, counts + E, 0);
    for (int64_t i = 0; i < N * K; ++i) {
        if (expert[i] >= 0) ++counts[expert[i]];
    }
    offsets[0] = 0;
    for (int64_t e = 0; e < E; ++e)
        offsets[e + 1] = offsets[e] + int32_t((counts[e] + kMoeRowAlign - 1) / kMoeRowAlign * kMoeRowAlign);
    std::fill(counts, counts + E, 0);      // recounted as the cursor of each segment
    for (int64_t i = 0; i < N * K; ++i) {  // (token, slot) order within each expert
        const int32_t e = expert[i];
        row[i] = e >= 0 ? offsets[e] + counts[e]++ : -1;
    }
}

}  // namespace tessera::ops
