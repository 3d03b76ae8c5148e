// Attention Residuals mixing on CUDA (ops/attn_res.h), the CPU oracle's formulas (ops/cpu/attn_res.cpp): one block
// per token, each source's statistics (Σ v², Σ (w⊙γ)·v, ⟨dout, v⟩) block sums in double in a fixed order, the
// softmax over the S sources in every thread; dγ and dw from one sum per channel over token slabs, the slabs in order
// (kernel_util.cuh: column slabs).
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
// For every source of token n: r_i into r[] and wv_i = Σ_c (w⊙γ)_c v_ic into wv[] (shared memory); the pre-softmax
// score is wv_i·r_i
template <class T>
__device__ void token_scores(MixArg<T> m, const T* g, const T* w, int64_t n, double eps, T* r, T* wv, double* shared) {
    for (int64_t i = 0; i < m.S; ++i) {
        const T* v = m.src[i] + n * m.C;
        double ss = 0.0, sw = 0.0;
        for (int64_t c = threadIdx.x; c < m.C; c += blockDim.x) {
            ss += double(v[c]) * double(v[c]);
            sw += double(w[c] * g[c]) * double(v[c]);
        }
        ss = block_sum(ss, shared);
        sw = block_sum(sw, shared);
        const T ri = T(1) / sqrt(T(ss) / T(m.C) + T(eps));
        if (threadIdx.x == 0) {
            r[i] = ri;
            wv[i] = T(sw);
        }
    }
    __syncthreads();
}

template <class T>
__global__ void attn_res_forward_kernel(MixArg<T> m, const T* g, const T* w, T* out, T* probs, double eps) {
    __shared__ double shared[kBlock / 32];
    __shared__ T r[kAttnResMaxSources], wv[kAttnResMaxSources], score[kAttnResMaxSources];
    const int64_t n = blockIdx.x;
    token_scores(m, g, w, n, eps, r, wv, shared);
    for (int64_t i = threadIdx.x; i < m.S; i += blockDim.x) score[i] = wv[i] * r[i];
    __syncthreads();
    T mx = score[0], z = 0;
    for (int64_t i = 1; i < m.S; ++i) mx = max(mx, score[i]);
    for (int64_t i = 0; i < m.S; ++i) z += exp(score[i] - mx);
    __syncthreads();  // every thread has read the scores: they become the probabilities
    T* pn = probs + n * m.S;
    for (int64_t i = threadIdx.x; i < m.S; i += blockDim.x) pn[i] = score[i] = exp(score[i] - mx) / z;
    __syncthreads();
    for (int64_t c = threadIdx.x; c < m.C; c += blockDim.x) {
        T o = 0;
        for (int64_t i = 0; i < m.S; ++i) o += score[i] * m.src[i][n * m.C + c];
        out[n * m.C + c] = o;
    }
}

// dv_i += p_i dout + r_i ds_i (w⊙γ) − r_i² mean_c(ds_i (w⊙γ) ⊙ r_i v_i) v_i; ds_i and r_i into ds_rs (for dγ, dw)
template <class T>
__global__ void attn_res_backward_kernel(
    MixArg<T> m, const T* dout, const T* g, const T* w, const T* probs, MixGradArg<T> dm, T* ds_rs, double eps) {
    __shared__ double shared[kBlock / 32];
    __shared__ T r[kAttnResMaxSources], wv[kAttnResMaxSources], dp[kAttnResMaxSources];
    const int64_t n = blockIdx.x;
    token_scores(m, g, w, n, eps, r, wv, shared);
    const T* don = dout + n * m.C;
    const T* pn = probs + n * m.S;
    for (int64_t i = 0; i < m.S; ++i) {
        const T* v = m.src[i] + n * m.C;
        double s = 0.0;
        for (int64_t c = threadIdx.x; c < m.C; c += blockDim.x) s += double(don[c]) * double(v[c]);
        s = block_sum(s, shared);
        if (threadIdx.x == 0) dp[i] = T(s);
    }
    __syncthreads();
    T mean_dp = 0;
    for (int64_t i = 0; i < m.S; ++i) mean_dp += pn[i] * dp[i];
    T* ds = ds_rs + n * m.S;
    T* rs = ds_rs + m.N * m.S + n * m.S;
    for (int64_t i = 0; i < m.S; ++i) {
        const T dsi = pn[i] * (dp[i] - mean_dp), ri = r[i], pi = pn[i];
        if (threadIdx.x == 0) {
            ds[i] = dsi;
            rs[i] = ri;
        }
        const T* v = m.src[i] + n * m.C;
        const T mean_a_xh = dsi * ri * wv[i] / T(m.C);  // mean_c(a ⊙ x̂), a = ds_i (w⊙γ)
        const T k = ri * ri * mean_a_xh;
        T* dv = dm.dsrc[i] + n * m.C;
        for (int64_t c = threadIdx.x; c < m.C; c += blockDim.x)
            dv[c] += pi * don[c] + ri * dsi * (w[c] * g[c]) - k * v[c];
    }
}

// dγ and dw share one column sum over tokens: Σ_n Σ_i ds_i r_i v_ic (row slabs, kernel_util.cuh), then
// dγ += Σ·w and dw += Σ·γ
template <class T>
struct AttnResParamTerm {
    MixArg<T> m;
    const T* ds_rs;
    __device__ void operator()(int64_t n, int64_t c, T* acc) const {
        for (int64_t i = 0; i < m.S; ++i)
            acc[0] += ds_rs[n * m.S + i] * ds_rs[m.N * m.S + n * m.S + i] * m.src[i][n * m.C + c];
    }
};
template <class T>
struct AttnResParamFinish {
    const T *g, *w;
    T *dg, *dw;
    __device__ void operator()(int64_t c, T total) const {
        dg[c] += total * w[c];
        dw[c] += total * g[c];
    }
};
}  // namespace

template <class T>
cudaError_t launch_attn_res_forward(
    MixArg<T> m, const T* g, const T* w, T* out, T* probs, double eps, cudaStream_t stream) {
    if (m.N == 0) return cudaSuccess;
    if (m.S < 1 || m.S > kAttnResMaxSources) return cudaErrorInvalidValue;
    launch_kernel(attn_res_forward_kernel<T>, unsigned(m.N), kBlock, 0, stream, m, g, w, out, probs, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_attn_res_backward(MixArg<T> m,
                                     const T* dout,
                                     const T* g,
                                     const T* w,
                                     const T* probs,
                                     MixGradArg<T> dm,
                                     T* dg,
                                     T* dw,
                                     T* ds_rs,
                                     T* slabs,
                                     double eps,
                                     cudaStream_t stream) {
    if (m.N == 0) return cudaSuccess;
    if (m.S < 1 || m.S > kAttnResMaxSources) return cudaErrorInvalidValue;
    launch_kernel(attn_res_backward_kernel<T>, unsigned(m.N), kBlock, 0, stream, m, dout, g, w, probs, dm, ds_rs, eps);
    if (dg) {
        launch_column_slabs<T, 1>(m.N, m.C, AttnResParamTerm<T>{m, ds_rs}, slabs, stream);
        launch_kernel(slab_totals_kernel<T, AttnResParamFinish<T>>, grid_for(m.C), kBlock, 0, stream, m.C,
                      column_slabs(m.N), static_cast<const T*>(slabs), AttnResParamFinish<T>{g, w, dg, dw});
    }
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                         \
    template cudaError_t launch_attn_res_forward<T>(MixArg<T>, const T*, const T*, T*, T*, double, cudaStream_t);      \
    template cudaError_t launch_attn_res_backward<T>(MixArg<T>, const T*, const T*, const T*, const T*, MixGradArg<T>, \
                                                     T*, T*, T*, T*, double, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
