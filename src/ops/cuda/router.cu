// The MoE router on CUDA (ops/router.h), one thread per token: the score function (softmax over the token's E
// logits, or σ) and its backward in the CPU's loop order; selection, gate weights and their backward through the
// row functions the CPU runs too (ops/router_rows.h), so both backends pick the same experts with the same ties.
// Counts per expert are integer atomics (exact in any order).
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"
#include "ops/router_rows.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void router_scores_kernel(RowsArg<const T> u, RowsArg<T> s, bool softmax) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < u.rows; n += int64_t(gridDim.x) * blockDim.x) {
        const T* ur = u.data + n * u.ld;
        T* sr = s.data + n * s.ld;
        if (!softmax) {
            for (int64_t e = 0; e < u.cols; ++e) sr[e] = sigmoid(ur[e]);
            continue;
        }
        T m = ur[0], z = 0;
        for (int64_t e = 1; e < u.cols; ++e) m = max(m, ur[e]);
        for (int64_t e = 0; e < u.cols; ++e) z += (sr[e] = exp(ur[e] - m));
        const T inv = T(1) / z;
        for (int64_t e = 0; e < u.cols; ++e) sr[e] *= inv;
    }
}

template <class T>
__global__ void router_select_kernel(
    RouterRowParams p, const T* s, const T* bias, int64_t N, int64_t E, int32_t* idx, T* w, int32_t* counts) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x) {
        uint8_t allowed[kRouterMaxGroups];
        router_select_row(p, s + n * E, bias, E, idx + n * p.topk, w + n * p.topk, allowed);
        for (int64_t j = 0; j < p.topk; ++j) atomicAdd(counts + idx[n * p.topk + j], 1);
    }
}

template <class T>
__global__ void router_weights_kernel(
    RouterRowParams p, const T* s, const int32_t* idx, T* w, int64_t N, int64_t E, int64_t K) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
        router_weights_row(p, s + n * E, idx + n * K, w + n * K, K);
}

template <class T>
__global__ void router_weights_backward_kernel(
    RouterRowParams p, const T* dg, const T* s, const int32_t* idx, T* ds, int64_t N, int64_t E, int64_t K) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < N; n += int64_t(gridDim.x) * blockDim.x)
        router_weights_backward_row(p, s + n * E, dg + n * K, idx + n * K, ds + n * E, K);
}

template <class T>
__global__ void router_score_backward_kernel(RowsArg<const T> s, RowsArg<const T> ds, RowsArg<T> du, bool softmax) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < s.rows; n += int64_t(gridDim.x) * blockDim.x) {
        const T *sr = s.data + n * s.ld, *dsr = ds.data + n * ds.ld;
        T* dur = du.data + n * du.ld;
        if (!softmax) {
            for (int64_t e = 0; e < s.cols; ++e) dur[e] += dsr[e] * sr[e] * (T(1) - sr[e]);
            continue;
        }
        T dot = 0;
        for (int64_t e = 0; e < s.cols; ++e) dot += dsr[e] * sr[e];
        for (int64_t e = 0; e < s.cols; ++e) dur[e] += sr[e] * (dsr[e] - dot);
    }
}
}  // namespace

template <class T>
cudaError_t launch_router_scores(RowsArg<const T> logits, RowsArg<T> scores, bool softmax, cudaStream_t stream) {
    if (logits.rows == 0) return cudaSuccess;
    launch_kernel(router_scores_kernel<T>, grid_for(logits.rows, 128), 128, 0, stream, logits, scores, softmax);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_select(RouterRowParams p,
                                 const T* scores,
                                 const T* bias,
                                 int64_t N,
                                 int64_t E,
                                 int32_t* indices,
                                 T* weights,
                                 int32_t* counts,
                                 cudaStream_t stream) {
    cudaError_t err = cudaMemsetAsync(counts, 0, size_t(E) * sizeof(int32_t), stream);
    if (err != cudaSuccess || N == 0) return err;
    launch_kernel(router_select_kernel<T>, grid_for(N, 128), 128, 0, stream, p, scores, bias, N, E, indices, weights,
                  counts);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_weights(RouterRowParams p,
                                  const T* scores,
                                  const int32_t* indices,
                                  T* weights,
                                  int64_t N,
                                  int64_t E,
                                  int64_t K,
                                  cudaStream_t stream) {
    if (N == 0) return cudaSuccess;
    launch_kernel(router_weights_kernel<T>, grid_for(N, 128), 128, 0, stream, p, scores, indices, weights, N, E, K);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_weights_backward(RouterRowParams p,
                                           const T* dweights,
                                           const T* scores,
                                           const int32_t* indices,
                                           T* dscores,
                                           int64_t N,
                                           int64_t E,
                                           int64_t K,
                                           cudaStream_t stream) {
    if (N == 0) return cudaSuccess;
    launch_kernel(router_weights_backward_kernel<T>, grid_for(N, 128), 128, 0, stream, p, dweights, scores, indices,
                  dscores, N, E, K);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_score_backward(
    RowsArg<const T> scores, RowsArg<const T> dscores, RowsArg<T> dlogits, bool softmax, cudaStream_t stream) {
    if (scores.rows == 0) return cudaSuccess;
    launch_kernel(router_score_backward_kernel<T>, grid_for(scores.rows, 128), 128, 0, stream, scores, dscores, dlogits,
                  softmax);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                        \
    template cudaError_t launch_router_scores<T>(RowsArg<const T>, RowsArg<T>, bool, cudaStream_t);                   \
    template cudaError_t launch_router_select<T>(RouterRowParams, const T*, const T*, int64_t, int64_t, int32_t*, T*, \
                                                 int32_t*, cudaStream_t);                                             \
    template cudaError_t launch_router_weights<T>(RouterRowParams, const T*, const int32_t*, T*, int64_t, int64_t,    \
                                                  int64_t, cudaStream_t);                                             \
    template cudaError_t launch_router_weights_backward<T>(RouterRowParams, const T*, const T*, const int32_t*, T*,   \
                                                           int64_t, int64_t, int64_t, cudaStream_t);                  \
    template cudaError_t launch_router_score_backward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<T>, bool,        \
                                                         cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
