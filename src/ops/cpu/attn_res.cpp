// Attention Residuals mixing on the CPU (see attn_res.h): one token per loop iteration (S sources, C
// channels); statistics in double; dγ and dw reduced per column block over tokens in order.
#include "ops/attn_res.h"

#include <cmath>
#include <vector>

#include "ops/cpu/kernel_util.h"

namespace tessera::ops {

using cpu::dispatch_float;

namespace {
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
    return d;
}

template <class T>
std::vector<T*> pointers(std::span<const TensorView> views) {
    std::vector<T*> p;
    for (const TensorView& v : views) p.push_back(v.ptr<T>());
    return p;
}

// rstd of v_i and score_i of one token
template <class T>
void token_scores(
    const MixDims& d, double eps, const T* const* src, int64_t n, const T* g, const T* w, double* r, double* score) {
    for (int64_t i = 0; i < d.S; ++i) {
        const T* v = src[i] + n * d.C;
        double ss = 0, dot = 0;
        for (int64_t c = 0; c < d.C; ++c) ss += double(v[c]) * double(v[c]);
        r[i] = 1.0 / std::sqrt(ss / double(d.C) + eps);
        for (int64_t c = 0; c < d.C; ++c) dot += double(w[c]) * double(g[c]) * double(v[c]);
        score[i] = dot * r[i];
    }
}
}  // namespace

void attn_res_mix_forward(const AttnResParams& p,
                          std::span<const TensorView> sources,
                          TensorView gamma,
                          TensorView w,
                          TensorView out,
                          TensorView probs) {
    const MixDims d = check_mix(sources, gamma, w, out, probs);
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        const std::vector<T*> src = pointers<T>(sources);
        const T *g = gamma.ptr<T>(), *wp = w.ptr<T>();
#pragma omp parallel
        {
            std::vector<double> r(static_cast<size_t>(d.S)), score(r.size());
#pragma omp for schedule(static)
            for (int64_t n = 0; n < d.N; ++n) {
                token_scores(d, p.eps, src.data(), n, g, wp, r.data(), score.data());
                double m = -INFINITY, z = 0;
                for (double s : score) m = std::max(m, s);
                for (double& s : score) z += (s = std::exp(s - m));
                T* pn = probs.ptr<T>() + n * d.S;
                for (int64_t i = 0; i < d.S; ++i) pn[i] = T(score[size_t(i)] / z);
                T* o = out.ptr<T>() + n * d.C;
                for (int64_t c = 0; c < d.C; ++c) {
                    double acc = 0;
                    for (int64_t i = 0; i < d.S; ++i) acc += double(pn[i]) * double(src[size_t(i)][n * d.C + c]);
                    o[c] = T(acc);
                }
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
                           TensorView dw) {
    const MixDims d = check_mix(sources, gamma, w, dout, probs);
    TESSERA_CHECK(dsources.size() == sources.size(), "attn_res_mix: {} source gradients for {} sources",
                  dsources.size(), sources.size());
    for (const TensorView& v : dsources) {
        check_shape(v, sources[0].shape, "attn_res_mix: dsources");
        check_contiguous(v, "attn_res_mix: dsources");
    }
    check_shape(dgamma, gamma.shape, "attn_res_mix: dgamma");
    check_shape(dw, w.shape, "attn_res_mix: dw");
    dispatch_float(gamma.dtype, "attn_res_mix", [&]<class T>(T) {
        const std::vector<T*> src = pointers<T>(sources), dsrc = pointers<T>(dsources);
        const T *g = gamma.ptr<T>(), *wp = w.ptr<T>(), *pr = probs.ptr<T>();
        const T* dO = dout.ptr<T>();
        // per token: ds_i (kept for the parameter gradients) and the source gradients
        std::vector<double> ds(static_cast<size_t>(d.N * d.S)), rs(ds.size());
#pragma omp parallel
        {
            std::vector<double> r(static_cast<size_t>(d.S)), score(r.size()), dp(r.size()), a(static_cast<size_t>(d.C));
#pragma omp for schedule(static)
            for (int64_t n = 0; n < d.N; ++n) {
                token_scores(d, p.eps, src.data(), n, g, wp, r.data(), score.data());
                const T* pn = pr + n * d.S;
                const T* don = dO + n * d.C;
                double mean_dp = 0;
                for (int64_t i = 0; i < d.S; ++i) {
                    const T* v = src[size_t(i)] + n * d.C;
                    double s = 0;
                    for (int64_t c = 0; c < d.C; ++c) s += double(don[c]) * double(v[c]);
                    dp[size_t(i)] = s;
                    mean_dp += double(pn[i]) * s;
                }
                for (int64_t i = 0; i < d.S; ++i) {
                    const double dsi = double(pn[i]) * (dp[size_t(i)] - mean_dp), ri = r[size_t(i)];
                    ds[size_t(n * d.S + i)] = dsi;
                    rs[size_t(n * d.S + i)] = ri;
                    const T* v = src[size_t(i)] + n * d.C;
                    double dot = 0;  // mean_d(a ⊙ x̂)
                    for (int64_t c = 0; c < d.C; ++c) {
                        a[size_t(c)] = dsi * double(wp[c]) * double(g[c]);
                        dot += a[size_t(c)] * double(v[c]) * ri;
                    }
                    dot /= double(d.C);
                    T* dv = dsrc[size_t(i)] + n * d.C;
                    for (int64_t c = 0; c < d.C; ++c) {
                        dv[c] += T(double(pn[i]) * double(don[c]) + ri * (a[size_t(c)] - double(v[c]) * ri * dot));
                    }
                }
            }
        }
        T *dg = dgamma.ptr<T>(), *dwp = dw.ptr<T>();
        constexpr int64_t kCols = 64;
#pragma omp parallel for schedule(static)
        for (int64_t c0 = 0; c0 < d.C; c0 += kCols) {
            const int64_t c1 = std::min(d.C, c0 + kCols);
            for (int64_t n = 0; n < d.N; ++n) {
                for (int64_t i = 0; i < d.S; ++i) {
                    const double dsi = ds[size_t(n * d.S + i)], ri = rs[size_t(n * d.S + i)];
                    const T* v = src[size_t(i)] + n * d.C;
                    for (int64_t c = c0; c < c1; ++c) {
                        const double xh = double(v[c]) * ri;
                        dg[c] += T(dsi * double(wp[c]) * xh);
                        dwp[c] += T(dsi * double(g[c]) * xh);
                    }
                }
            }
        }
    });
}

}  // namespace tessera::ops
