// One token's row of the MoE router's selection and gate weights (formulas: ops/router.h), written once for the
// CPU loops (ops/cpu/router.cpp, ops/cpu/moe.cpp) and the CUDA kernels (ops/cuda/router.cu, one thread per
// token), so both backends choose the same experts with the same ties. Plain C++ on raw rows; no tessera types.
#pragma once

#include <cmath>
#include <cstdint>

#include "core/host_device.h"

namespace tessera::ops {

constexpr int64_t kRouterMaxGroups = 1024;  // router_allowed_groups writes up to this many flags

struct RouterRowParams {
    int64_t topk = 2;
    bool normalize = true;
    double scaling = 1.0;
    int64_t groups = 1;
    int64_t topk_groups = 1;
};

// The score of group g: the sum of its two largest s̃ with a bias (and more than one expert per group), else its
// largest s
template <class T>
TESSERA_HOST_DEVICE T router_group_score(const T* s, const T* bias, int64_t g, int64_t gs) {
    T best = -INFINITY, second = -INFINITY;
    for (int64_t e = g * gs; e < (g + 1) * gs; ++e) {
        const T v = bias ? s[e] + bias[e] : s[e];
        if (v > best) {
            second = best;
            best = v;
        } else if (v > second) {
            second = v;
        }
    }
    return bias && gs > 1 ? best + second : best;
}

// allowed[g] = 1 for the topk_groups best groups (ties: the lower group id); allowed[0] = 1 alone when groups <= 1.
// Group scores are recomputed per pick (topk_groups·E work) rather than stored: no per-token table, which on a GPU
// would be a large per-thread local array.
template <class T>
TESSERA_HOST_DEVICE void router_allowed_groups_row(
    const RouterRowParams& p, const T* s, const T* bias, int64_t E, uint8_t* allowed) {
    const int64_t G = p.groups;
    if (G <= 1) {
        allowed[0] = 1;
        return;
    }
    const int64_t gs = E / G;
    for (int64_t g = 0; g < G; ++g) allowed[g] = 0;
    for (int64_t m = 0; m < p.topk_groups; ++m) {
        int64_t pick = -1;
        T pick_score = -INFINITY;
        for (int64_t g = 0; g < G; ++g) {
            if (allowed[g]) continue;
            const T v = router_group_score(s, bias, g, gs);
            if (pick < 0 || v > pick_score) {
                pick = g;
                pick_score = v;
            }
        }
        allowed[pick] = 1;
    }
}

TESSERA_HOST_DEVICE inline bool router_group_allows(const RouterRowParams& p,
                                                    const uint8_t* allowed,
                                                    int64_t E,
                                                    int64_t e) {
    return p.groups <= 1 || allowed[e / (E / p.groups)];
}

// w_j = s[idx_j] (/ (Σ chosen s + 1e-20) when normalize) · scaling; −1 slots get 0 and stay out of the sum
template <class T>
TESSERA_HOST_DEVICE void router_weights_row(const RouterRowParams& p, const T* s, const int32_t* idx, T* w, int64_t K) {
    T z = 0;
    for (int64_t j = 0; j < K; ++j) z += idx[j] >= 0 ? s[idx[j]] : T(0);
    const T scale = T(p.scaling) / (p.normalize ? z + T(1e-20) : T(1));
    for (int64_t j = 0; j < K; ++j) w[j] = idx[j] >= 0 ? s[idx[j]] * scale : T(0);
}

// Top-K of s̃ = s + bias over the allowed experts into idx (slots in descending s̃; ties: the lower id), then the
// gate weights into val (which holds the kept s̃ until then). allowed: kRouterMaxGroups flags of scratch.
template <class T>
TESSERA_HOST_DEVICE void router_select_row(
    const RouterRowParams& p, const T* s, const T* bias, int64_t E, int32_t* idx, T* val, uint8_t* allowed) {
    const int64_t K = p.topk;
    router_allowed_groups_row(p, s, bias, E, allowed);
    int64_t count = 0;
    for (int64_t e = 0; e < E; ++e) {
        if (!router_group_allows(p, allowed, E, e)) continue;
        const T v = bias ? s[e] + bias[e] : s[e];
        int64_t pos;
        if (count < K) {
            pos = count++;
        } else if (v > val[K - 1]) {
            pos = K - 1;
        } else {
            continue;
        }
        for (; pos > 0 && val[pos - 1] < v; --pos) {  // equal values keep the lower id first
            val[pos] = val[pos - 1];
            idx[pos] = idx[pos - 1];
        }
        val[pos] = v;
        idx[pos] = int32_t(e);
    }
    router_weights_row(p, s, idx, val, K);
}

// ds[idx_j] += ∂L/∂s through the gate weights: ρ·dg_j, or with normalisation ρ (dg_j − Σ_i dg_i s_i / z) / z
template <class T>
TESSERA_HOST_DEVICE void router_weights_backward_row(
    const RouterRowParams& p, const T* s, const T* dg, const int32_t* idx, T* ds, int64_t K) {
    const T rho = T(p.scaling);
    if (!p.normalize) {
        for (int64_t j = 0; j < K; ++j) {
            if (idx[j] >= 0) ds[idx[j]] += rho * dg[j];
        }
        return;
    }
    T z = 0, t = 0;
    for (int64_t j = 0; j < K; ++j) {
        if (idx[j] < 0) continue;
        z += s[idx[j]];
        t += dg[j] * s[idx[j]];
    }
    z += T(1e-20);
    for (int64_t j = 0; j < K; ++j) {
        if (idx[j] >= 0) ds[idx[j]] += rho * (dg[j] - t / z) / z;
    }
}

}  // namespace tessera::ops
