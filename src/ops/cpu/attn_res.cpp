// Attention Residuals mixing: the entry points (checks, then CUDA tensors to ops/cuda) and the CPU kernel (see
// attn_res.h): one token per loop iteration (S sources, C channels), in the tensors' dtype with vectorised channel
// loops; dγ and dw reduced per column block over tokens in order.
#include "ops/attn_res.h"

#include <array>
#include <cmath>
#include <limits>

#include "ops/backend.h"
#include "ops/cpu/kernel_util.h"
#include "ops/op_use.h"

namespace tessera::ops {

using cpu::dispatch_float;

namespace {
constexpr int64_t kMaxSourcesLimit = 64;

struct MixDims {
    int64_t S, N, C;
};

MixDims check_mix(std::span<const TensorView> sources,
                  const TensorView& gamma,
                  const TensorView& w,
                  const TensorView& out,
                  const TensorView& probs) {
    TESSERA_CHECK(!sources.empty(), "attn_res_mix: no sources");
    TESSERA_CHECK(sources[0].ndim() == 2, "attn_res_mix: sources must be [N, C], not {}", sources[0].shape.str());
    const MixDims d{int64_t(sources.size()), sources[0].size(0), sources[0].size(1)};
    for (const TensorView& v : sources) check_shape(v, sources[0].shape, "attn_res_mix: source");
    check_shape(gamma, Shape{d.C}, "attn_res_mix: gamma");
    check_shape(w, Shape{d.C}, "attn_res_mix: w");
    check_shape(out, Shape{d.N, d.C}, "attn_res_mix: out");
    check_shape(probs, Shape{d.N, d.S}, "attn_res_mix: probs");
    for (const TensorView* t : {&gamma, &w, &out, &probs}) {
        check_contiguous(*t, "attn_res_mix");
        TESSERA_CHECK(t->dtype == sources[0].dtype, "attn_res_mix: every tensor must share one dtype");
    }
    for (const TensorView& v : sources) {
        check_contiguous(v, "attn_res_mix");
        TESSERA_CHECK(v.dtype == sources[0].dtype, "attn_res_mix: every tensor must share one dtype");
    }
    TESSERA_CHECK(d.S <= kMaxSourcesLimit, "attn_res_mix: {} sources, at most {}", d.S, kMaxSourcesLimit);
    return d;
}

// Every source (and source gradient) on the op's device
void check_device(Device device, const TensorView& t) {
    TESSERA_CHECK(t.device == device,
                  "attn_res_mix: tensors on different devices (CPU and CUDA); copy them to one device first");
}

// forward: w ⊙ γ [C]; backward also ds and r per token [2·N·S]
void check_scratch(const MixDims& d, const TensorView& scratch, DType dtype) {
    check_contiguous(scratch, "attn_res_mix: scratch");
    TESSERA_CHECK(scratch.dtype == dtype && scratch.numel() >= attn_res_mix_scratch(d.N, d.S, d.C),
                  "attn_res_mix: scratch holds {} elements, needs {}", scratch.numel(),
                  attn_res_mix_scratch(d.N, d.S, d.C));
}

// NOTES: at most kMaxSources sources per mix (a 61-layer K3 with blocks of 6 mixes 12): the per-token
// statistics live in registers and small stack arrays, so the op touches no heap.
constexpr int64_t kMaxSources = kMaxSourcesLimit;

template <class T>
struct Sources {
    std::array<const T*, kMaxSources> p{};
    explicit Sources(std::span<const TensorView> views) {
        for (size_t i = 0; i < views.size(); ++i) p[i] = views[i].ptr<T>();
    }
    const T* row(int64_t i, int64_t n, int64_t C) const { return p[size_t(i)] + n * C; }
};

// Σ_c a[c]·b[c] over one row, vectorised (lanes summed in a fixed order: the same bits on any thread count)
template <class T>
inline T dot(const T* a, const T* b, int64_t C) {
    T s = 0;
#pragma omp simd reduction(+ : s)
    for (int64_t c = 0; c < C; ++c) s += a[c] * b[c];
    return s;
}

// r_i = rstd of v_i and score_i = r_i Σ_c (w γ)_c v_ic for one token; wg = w ⊙ γ
template <class T>
void token_scores(const MixDims& d, T eps, const Sources<T>& src, int64_t n, const T* wg, T* r, T* score) {
    for (int64_t i = 0; i < d.S; ++i) {
        const T* v = src.row(i, n, d.C);
        r[i] = T(1) / std::sqrt(dot(v, v, d.C) / T(d.C) + eps);
        score[i] = dot(wg, v, d.C) * r[i];
    }
}

// wg = w ⊙ γ, once per call
template <class T>
void weighted_gamma(const MixDims& d, const T* g, const T* w, T* wg) {
    for (int64_t c = 0; c < d.C; ++c) wg[c] = w[c] * g[c];
}
}  // namespace

int64_t attn_res_mix_scratch(int64_t N, int64_t S, int64_t C) { return C + 2 * N * S; }

void attn_res_mix_forward(const AttnResParams& p,
                          std::span<const TensorView> sources,
                          TensorView gamma,
                          TensorView w,
                          TensorView out,
                          TensorView probs,
                          TensorView scratch) {
    note_op_use("attn_res_mix");
    const Device device = op_device("attn_res_mix", {gamma, w, out, probs, scratch});
    for (const TensorView& s : sources) check_device(device, s);
    const MixDims d = check_mix(sources, gamma, w, out, probs);
    check_scratch(d, scratch, gamma.dtype);
    if (device == Device::cuda) return TESSERA_ON_CUDA(attn_res_mix_forward(p, sources, gamma, w, out, probs, scratch));
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        const Sources<T> src(sources);
        T* wg = scratch.ptr<T>();
        weighted_gamma(d, gamma.ptr<T>(), w.ptr<T>(), wg);
        const T eps = T(p.eps);
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < d.N; ++n) {
            std::array<T, kMaxSources> r, score;
            token_scores(d, eps, src, n, wg, r.data(), score.data());
            T m = -std::numeric_limits<T>::infinity(), z = 0;
            for (int64_t i = 0; i < d.S; ++i) m = std::max(m, score[size_t(i)]);
            for (int64_t i = 0; i < d.S; ++i) z += (score[size_t(i)] = std::exp(score[size_t(i)] - m));
            T* pn = probs.ptr<T>() + n * d.S;
            for (int64_t i = 0; i < d.S; ++i) pn[i] = score[size_t(i)] / z;
            T* o = out.ptr<T>() + n * d.C;
            const T* v0 = src.row(0, n, d.C);
#pragma omp simd
            for (int64_t c = 0; c < d.C; ++c) o[c] = pn[0] * v0[c];
            for (int64_t i = 1; i < d.S; ++i) {
                const T* v = src.row(i, n, d.C);
                const T pi = pn[i];
#pragma omp simd
                for (int64_t c = 0; c < d.C; ++c) o[c] += pi * v[c];
            }
        }
    });
}

void attn_res_mix_backward(const AttnResParams& p,
                           TensorView dout,
                           std::span<const TensorView> sources,
                           TensorView gamma,
                           TensorView w,
                           TensorView probs,
                           std::span<const TensorView> dsources,
                           TensorView dgamma,
                           TensorView dw,
                           TensorView scratch) {
    const Device device = op_device("attn_res_mix", {dout, gamma, w, probs, dgamma, dw, scratch});
    for (const TensorView& s : sources) check_device(device, s);
    for (const TensorView& s : dsources) check_device(device, s);
    const MixDims d = check_mix(sources, gamma, w, dout, probs);
    check_scratch(d, scratch, gamma.dtype);
    TESSERA_CHECK(dsources.size() == sources.size(), "attn_res_mix: {} source gradients for {} sources",
                  dsources.size(), sources.size());
    for (const TensorView& v : dsources) {
        check_shape(v, sources[0].shape, "attn_res_mix: dsources");
        check_contiguous(v, "attn_res_mix: dsources");
        TESSERA_CHECK(v.dtype == gamma.dtype, "attn_res_mix: every tensor must share one dtype");
    }
    TESSERA_CHECK(dgamma.defined() == dw.defined(), "attn_res_mix: dgamma and dw go together");
    const bool params = dgamma.defined();  // absent: frozen mixing parameters
    if (params) {
        check_shape(dgamma, gamma.shape, "attn_res_mix: dgamma");
        check_shape(dw, w.shape, "attn_res_mix: dw");
    }
    if (device == Device::cuda)
        return TESSERA_ON_CUDA(attn_res_mix_backward(p, dout, sources, gamma, w, probs, dsources, dgamma, dw, scratch));
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        const Sources<T> src(sources);
        std::array<T*, kMaxSources> dsrc{};
        for (size_t i = 0; i < dsources.size(); ++i) dsrc[i] = dsources[i].ptr<T>();
        const T *g = gamma.ptr<T>(), *wp = w.ptr<T>(), *pr = probs.ptr<T>(), *dO = dout.ptr<T>();
        T* wg = scratch.ptr<T>();
        T* ds = wg + d.C;        // [N, S]: ds_i per token, kept for the parameter gradients
        T* rs = ds + d.N * d.S;  // [N, S]: r_i per token
        weighted_gamma(d, g, wp, wg);
        const T eps = T(p.eps);
        // per token: ds_i = p_i (dp_i − Σ_j p_j dp_j) and the source gradients
        //   dv_i += p_i dout + r_i (ds_i wg − r_i v_i mean_c(ds_i wg ⊙ r_i v_i))
#pragma omp parallel for schedule(static)
        for (int64_t n = 0; n < d.N; ++n) {
            std::array<T, kMaxSources> r, score, dp;
            token_scores(d, eps, src, n, wg, r.data(), score.data());
            const T* pn = pr + n * d.S;
            const T* don = dO + n * d.C;
            T mean_dp = 0;
            for (int64_t i = 0; i < d.S; ++i) {
                dp[size_t(i)] = dot(don, src.row(i, n, d.C), d.C);
                mean_dp += pn[i] * dp[size_t(i)];
            }
            for (int64_t i = 0; i < d.S; ++i) {
                const T dsi = pn[i] * (dp[size_t(i)] - mean_dp), ri = r[size_t(i)], pi = pn[i];
                ds[n * d.S + i] = dsi;
                rs[n * d.S + i] = ri;
                const T* v = src.row(i, n, d.C);
                const T mean_a_xh = dsi * ri * dot(wg, v, d.C) / T(d.C);  // mean_c(a ⊙ x̂), a = ds_i wg
                const T k = ri * ri * mean_a_xh;
                T* dv = dsrc[size_t(i)] + n * d.C;
#pragma omp simd
                for (int64_t c = 0; c < d.C; ++c) dv[c] += pi * don[c] + ri * dsi * wg[c] - k * v[c];
            }
        }
        if (!params) return;
        // dγ += Σ_n,i ds_i r_i (w ⊙ v_i), dw += Σ_n,i ds_i r_i (γ ⊙ v_i): per column block, tokens in order
        T *dg = dgamma.ptr<T>(), *dwp = dw.ptr<T>();
        constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < d.C; c0 += kCols) {
            const int64_t c1 = std::min(d.C, c0 + kCols);
            std::array<T, kCols> acc{};
            for (int64_t n = 0; n < d.N; ++n) {
                for (int64_t i = 0; i < d.S; ++i) {
                    const T f = ds[n * d.S + i] * rs[n * d.S + i];
                    const T* v = src.row(i, n, d.C);
#pragma omp simd
                    for (int64_t c = c0; c < c1; ++c) acc[size_t(c - c0)] += f * v[c];
                }
            }
            for (int64_t c = c0; c < c1; ++c) {
                dg[c] += acc[size_t(c - c0)] * wp[c];
                dwp[c] += acc[size_t(c - c0)] * g[c];
            }
        }
    });
}

}  // namespace tessera::ops
