// Depthwise causal conv1d on CUDA (ops/causal_conv1d.h), in the CPU oracle's order of operations
// (ops/cpu/causal_conv1d.cpp): forward one thread per (token, channel); dx in gather form, one thread per
// (token, channel) adding the later tokens' terms in token order; dw summed over token slabs, the slabs in order
// (kernel_util.cuh: column slabs). A sequence is a batch row, or a packed segment of cu_seqlens (device copy).
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
// [t0, t1): the sequence holding flattened token t
__device__ inline void seq_bounds(const ConvShape& s, int64_t t, int64_t& t0, int64_t& t1) {
    if (!s.cu) {
        t0 = t / s.T * s.T;
        t1 = t0 + s.T;
        return;
    }
    int64_t lo = 0, hi = s.segments - 1;  // the last segment j with cu[j] <= t
    while (lo < hi) {
        const int64_t mid = (lo + hi + 1) / 2;
        if (s.cu[mid] <= t)
            lo = mid;
        else
            hi = mid - 1;
    }
    t0 = s.cu[lo];
    t1 = s.cu[lo + 1];
}

template <class T>
__device__ inline T conv_z(const ConvShape& s, const T* x, const T* w, int64_t t0, int64_t t, int64_t c) {
    T z = 0;
    for (int64_t k = 0; k < s.W; ++k) {
        const int64_t src = t - (s.W - 1) + k;
        if (src >= t0) z += w[c * s.W + k] * x[src * s.C + c];
    }
    return z;
}

// ∂L/∂z at (t, c): dy through the SiLU when there is one
template <class T>
__device__ inline T conv_dz(const ConvShape& s, const T* x, const T* w, const T* dy, int64_t t0, int64_t t, int64_t c) {
    const T g = dy[t * s.C + c];
    if (!s.silu) return g;
    const T v = conv_z(s, x, w, t0, t, c), sg = sigmoid(v);
    return g * sg * (T(1) + v * (T(1) - sg));
}

template <class T>
__global__ void conv_forward_kernel(ConvShape s, const T* x, const T* w, T* y) {
    const int64_t total = s.tokens * s.C;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t t = e / s.C, c = e % s.C;
        int64_t t0, t1;
        seq_bounds(s, t, t0, t1);
        const T v = conv_z(s, x, w, t0, t, c);
        y[e] = s.silu ? v * sigmoid(v) : v;
    }
}

template <class T>
__global__ void conv_dx_kernel(ConvShape s, const T* dy, const T* x, const T* w, T* dx) {
    const int64_t total = s.tokens * s.C;
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t src = e / s.C, c = e % s.C;
        int64_t t0, t1;
        seq_bounds(s, src, t0, t1);
        T acc = dx[e];
        const int64_t last = src + s.W < t1 ? src + s.W : t1;
        for (int64_t t = src; t < last; ++t) acc += w[c * s.W + (src + s.W - 1 - t)] * conv_dz(s, x, w, dy, t0, t, c);
        dx[e] = acc;
    }
}

// dw's terms of token t, channel c: ∂L/∂z(t, c) times each tap's input
template <class T>
struct ConvDwTerm {
    ConvShape s;
    const T *dy, *x, *w;
    __device__ void operator()(int64_t t, int64_t c, T* acc) const {
        int64_t t0, t1;
        seq_bounds(s, t, t0, t1);
        const T d = conv_dz(s, x, w, dy, t0, t, c);
        for (int64_t k = 0; k < s.W; ++k) {
            const int64_t src = t - (s.W - 1) + k;
            if (src >= t0) acc[k] += d * x[src * s.C + c];
        }
    }
};

// window [B, W−1, C]: each thread owns one (row, channel) column of it, so the shift is race-free
__global__ void conv_step_kernel(
    int64_t B, int64_t C, int64_t W, bool silu, const float* x, const float* w, float* window, float* y) {
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < B * C; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t b = e / C, c = e % C;
        float* win = window + b * (W - 1) * C;
        float z = 0.f;
        for (int64_t k = 0; k + 1 < W; ++k) z += w[c * W + k] * win[k * C + c];
        z += w[c * W + W - 1] * x[e];
        y[e] = silu ? z * sigmoid(z) : z;
        for (int64_t k = 0; k + 2 < W; ++k) win[k * C + c] = win[(k + 1) * C + c];
        if (W > 1) win[(W - 2) * C + c] = x[e];
    }
}
}  // namespace

template <class T>
cudaError_t launch_conv1d_forward(ConvShape s, const T* x, const T* w, T* y, cudaStream_t stream) {
    if (s.tokens * s.C == 0) return cudaSuccess;
    launch_kernel(conv_forward_kernel<T>, grid_for(s.tokens * s.C), kBlock, 0, stream, s, x, w, y);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_conv1d_backward(
    ConvShape s, const T* dy, const T* x, const T* w, T* dx, T* dw, T* slabs, cudaStream_t stream) {
    if (s.tokens * s.C == 0) return cudaSuccess;
    if (s.W > kConvMaxWidth) return cudaErrorInvalidValue;
    if (dx) launch_kernel(conv_dx_kernel<T>, grid_for(s.tokens * s.C), kBlock, 0, stream, s, dy, x, w, dx);
    if (dw) {
        launch_column_slabs<T, kConvMaxWidth>(s.tokens, s.C, ConvDwTerm<T>{s, dy, x, w}, slabs, stream, int(s.W));
        const int64_t n = column_slabs(s.tokens);
        for (int64_t k = 0; k < s.W; ++k)  // dw[c, k] += tap k's slabs in order
            launch_kernel(slab_totals_kernel<T, AddTo<T>>, grid_for(s.C), kBlock, 0, stream, s.C, n,
                          static_cast<const T*>(slabs + k * n * s.C), AddTo<T>{dw + k, s.W});
    }
    return cudaGetLastError();
}

cudaError_t launch_conv1d_step(int64_t B,
                               int64_t C,
                               int64_t W,
                               bool silu,
                               const float* x,
                               const float* w,
                               float* window,
                               float* y,
                               cudaStream_t stream) {
    if (B * C == 0) return cudaSuccess;
    launch_kernel(conv_step_kernel, grid_for(B * C), kBlock, 0, stream, B, C, W, silu, x, w, window, y);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                      \
    template cudaError_t launch_conv1d_forward<T>(ConvShape, const T*, const T*, T*, cudaStream_t); \
    template cudaError_t launch_conv1d_backward<T>(ConvShape, const T*, const T*, const T*, T*, T*, T*, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
