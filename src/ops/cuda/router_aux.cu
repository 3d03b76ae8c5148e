// The router's auxiliary losses on CUDA (ops/router.h, spec/moe.md §3.2, §3.4), in double as on the CPU and in the
// CPU's orders: a thread per token for the per-token sums (Σ_e s over the experts, the z-loss's log-sum-exp, the
// gradients), a thread per (sequence or layer, expert) for the sums over tokens, walking the tokens in order. The
// per-row and per-sequence values are summed into the loss on the host, in order, as the CPU sums them.
#include <cmath>

#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
constexpr int kThreads = 128;

// z[t] = Σ_e s[t, e]
template <class T>
__global__ void row_sum_kernel(int64_t N, int64_t E, const T* s, double* z) {
    for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < N; t += int64_t(gridDim.x) * blockDim.x) {
        double acc = 0;
        for (int64_t e = 0; e < E; ++e) acc += double(s[t * E + e]);
        z[t] = acc;
    }
}

// For tokens [starts[q], starts[q + 1]) and expert e (one thread each): `count` adds `unit` per choice of e,
// `prob` adds s/z (scaled by `scale_by_len` ? 1/T_q : 1), tokens in order.
template <class T>
__global__ void column_stats_kernel(int64_t groups,
                                    const int64_t* starts,
                                    int64_t E,
                                    int64_t K,
                                    const T* s,
                                    const int32_t* idx,
                                    const double* z,
                                    bool per_sequence,
                                    double* count,
                                    double* prob) {
    const int64_t total = groups * E;
    for (int64_t x = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; x < total; x += int64_t(gridDim.x) * blockDim.x) {
        const int64_t q = x / E, e = x % E, a = starts[q], b = starts[q + 1], len = b - a;
        const double unit = per_sequence ? double(E) / double(K * len) : 1.0;
        double c = count[x], p = prob[x];
        for (int64_t t = a; t < b; ++t) {
            for (int64_t j = 0; j < K; ++j)
                if (idx[t * K + j] == e) c += unit;
            p += per_sequence ? double(s[t * E + e]) / z[t] / double(len) : double(s[t * E + e]) / z[t];
        }
        count[x] = c;
        prob[x] = p;
    }
}

// ls[q] = Σ_e f[q, e]·P[q, e]
__global__ void seq_dot_kernel(int64_t nseq, int64_t E, const double* f, const double* P, double* ls) {
    for (int64_t q = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; q < nseq; q += int64_t(gridDim.x) * blockDim.x) {
        double acc = 0;
        for (int64_t e = 0; e < E; ++e) acc += f[q * E + e] * P[q * E + e];
        ls[q] = acc;
    }
}

// ds[t] += (c_t·(g_e − Σ_i g_i·s_i/z)) over e: the balance losses' gradient through ŝ = s/z. Per token, g is the
// row of its sequence (per_sequence: g = f[q], c = α/(nseq·T_q·z)) or one vector for all (c = 1/z).
template <class T>
__global__ void balance_grad_kernel(
    int64_t N, int64_t E, const T* s, const double* g, const int64_t* starts, int64_t nseq, double alpha, T* ds) {
    for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < N; t += int64_t(gridDim.x) * blockDim.x) {
        const T* st = s + t * E;
        int64_t q = 0, len = 0;
        const double* gt = g;
        if (starts) {
            while (starts[q + 1] <= t) ++q;
            len = starts[q + 1] - starts[q];
            gt = g + q * E;
        }
        double z = 0, gs = 0;
        for (int64_t e = 0; e < E; ++e) z += double(st[e]);
        for (int64_t e = 0; e < E; ++e) gs += gt[e] * double(st[e]) / z;
        if (starts) {
            const double c = alpha / (double(nseq) * double(len) * z);
            for (int64_t e = 0; e < E; ++e) ds[t * E + e] += T(c * (gt[e] - gs));
        } else {
            for (int64_t e = 0; e < E; ++e) ds[t * E + e] += T((gt[e] - gs) / z);
        }
    }
}

// lse[t] of the logits' row t; du += β·2·lse/N·softmax(u) when du is given.
template <class T>
__global__ void z_loss_kernel(RowsArg<const T> u, double beta, double* lse, T* du) {
    for (int64_t t = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; t < u.rows; t += int64_t(gridDim.x) * blockDim.x) {
        const T* r = u.data + t * u.ld;
        double m = double(r[0]), z = 0;
        for (int64_t e = 1; e < u.cols; ++e) m = fmax(m, double(r[e]));
        for (int64_t e = 0; e < u.cols; ++e) z += exp(double(r[e]) - m);
        const double l = m + log(z);
        lse[t] = l;
        if (!du) continue;
        const double c = beta * 2.0 * l / double(u.rows);
        for (int64_t e = 0; e < u.cols; ++e) du[t * u.cols + e] += T(c * exp(double(r[e]) - l));
    }
}
}  // namespace

template <class T>
cudaError_t launch_router_balance_stats(RouterAuxArgs<T> a, double* choices, double* prob_sums, cudaStream_t stream) {
    if (a.N == 0) return cudaSuccess;
    launch_kernel(row_sum_kernel<T>, grid_for(a.N, kThreads), kThreads, 0, stream, a.N, a.E, a.scores, a.z);
    launch_kernel(column_stats_kernel<T>, grid_for(a.E, kThreads), kThreads, 0, stream, 1, a.starts, a.E, a.K, a.scores,
                  a.indices, a.z, false, choices, prob_sums);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_balance_backward(RouterAuxArgs<T> a, const double* grad, T* dscores, cudaStream_t stream) {
    if (a.N == 0) return cudaSuccess;
    launch_kernel(balance_grad_kernel<T>, grid_for(a.N, kThreads), kThreads, 0, stream, a.N, a.E, a.scores, grad,
                  nullptr, 0, 0.0, dscores);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_seq_aux(
    RouterAuxArgs<T> a, int64_t nseq, double alpha, double* f, double* P, double* ls, T* dscores, cudaStream_t stream) {
    if (a.N == 0) return cudaSuccess;
    cudaError_t err = cudaMemsetAsync(f, 0, sizeof(double) * size_t(2 * nseq * a.E), stream);  // f and P
    if (err != cudaSuccess) return err;
    launch_kernel(row_sum_kernel<T>, grid_for(a.N, kThreads), kThreads, 0, stream, a.N, a.E, a.scores, a.z);
    launch_kernel(column_stats_kernel<T>, grid_for(nseq * a.E, kThreads), kThreads, 0, stream, nseq, a.starts, a.E, a.K,
                  a.scores, a.indices, a.z, true, f, P);
    launch_kernel(seq_dot_kernel, grid_for(nseq, kThreads), kThreads, 0, stream, nseq, a.E, f, P, ls);
    if (dscores)
        launch_kernel(balance_grad_kernel<T>, grid_for(a.N, kThreads), kThreads, 0, stream, a.N, a.E, a.scores, f,
                      a.starts, nseq, alpha, dscores);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_router_z_loss(RowsArg<const T> logits, double beta, double* lse, T* dlogits, cudaStream_t stream) {
    if (logits.rows == 0) return cudaSuccess;
    launch_kernel(z_loss_kernel<T>, grid_for(logits.rows, kThreads), kThreads, 0, stream, logits, beta, lse, dlogits);
    return cudaGetLastError();
}

#define TESSERA_AUX(T)                                                                                              \
    template cudaError_t launch_router_balance_stats<T>(RouterAuxArgs<T>, double*, double*, cudaStream_t);          \
    template cudaError_t launch_router_balance_backward<T>(RouterAuxArgs<T>, const double*, T*, cudaStream_t);      \
    template cudaError_t launch_router_seq_aux<T>(RouterAuxArgs<T>, int64_t, double, double*, double*, double*, T*, \
                                                  cudaStream_t);                                                    \
    template cudaError_t launch_router_z_loss<T>(RowsArg<const T>, double, double*, T*, cudaStream_t);
TESSERA_AUX(float)
TESSERA_AUX(double)
#undef TESSERA_AUX

}  // namespace tessera::ops::cuda
