// The MoE layer's row kernels on CUDA (ops/moe.h; the CPU loops in ops/cpu/moe.cpp are the oracle): dispatch of token
// rows to the expert-contiguous layout and the combine back in slot order, each row's gate, the experts' gated
// activation a = gate·act(h) and its backward (the row's gate gradient ⟨act(h), da⟩ by a fixed-order block sum), the
// gate gradients per (token, slot), Qwen3-Next's shared-expert gate, and each token's routing entropy. No atomics:
// every output element is written by one thread (or one block's fixed tree), so results are bitwise run-to-run.
#include "ops/cuda/glu_math.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void dispatch_kernel(RowsArg<const T> src, const int32_t* row, int64_t K, T* rows) {
    each(src.rows * K, src.cols, [&](int64_t i, int64_t c) {
        const int32_t r = row[i];
        if (r >= 0) rows[r * src.cols + c] = src.data[(i / K) * src.ld + c];
    });
}

template <class T>
__global__ void combine_kernel(const T* rows, const int32_t* row, int64_t K, RowsArg<T> dst, bool accumulate) {
    each(dst.rows, dst.cols, [&](int64_t n, int64_t c) {
        T o = accumulate ? dst.data[n * dst.ld + c] : T(0);
        for (int64_t j = 0; j < K; ++j) {  // slot order
            const int32_t r = row[n * K + j];
            if (r >= 0) o += rows[r * dst.cols + c];
        }
        dst.data[n * dst.ld + c] = o;
    });
}

template <class T>
__global__ void row_gate_kernel(const int32_t* row, const T* gates, int64_t pairs, T* row_gate) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x)
        if (row[i] >= 0) row_gate[row[i]] = gates[i];
}

template <class T, class Act>
__global__ void gated_act_kernel(Act act, const T* h, const T* row_gate, T* a, int64_t R, int64_t F) {
    each(R, F, [&](int64_t r, int64_t f) {
        const T* hr = h + r * 2 * F;
        a[r * F + f] = row_gate[r] * act.value(hr[f], hr[F + f]);
    });
}

// A block per row: dot[r] = ⟨act(h_r), da_r⟩, then dh_r = gate·da ⊙ ∂act/∂h (written)
template <class T, class Act>
__global__ void gated_act_backward_kernel(
    Act act, const T* h, const T* da, const T* row_gate, T* dot, T* dh, int64_t R, int64_t F) {
    __shared__ T shared[kBlock / 32];
    for (int64_t r = blockIdx.x; r < R; r += gridDim.x) {
        const T* hr = h + r * 2 * F;
        const T* dar = da + r * F;
        T acc = 0;
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x) acc += act.value(hr[f], hr[F + f]) * dar[f];
        acc = block_sum(acc, shared);
        if (threadIdx.x == 0) dot[r] = acc;
        const T g = row_gate[r];
        T* dhr = dh + r * 2 * F;
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x) {
            T pg, pu;
            act.partials(hr[f], hr[F + f], pg, pu);
            dhr[f] = g * dar[f] * pg;
            dhr[F + f] = g * dar[f] * pu;
        }
    }
}

template <class T>
__global__ void gate_grads_kernel(const int32_t* row, const T* dot, T* dg, int64_t pairs) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < pairs; i += int64_t(gridDim.x) * blockDim.x)
        dg[i] = row[i] >= 0 ? dot[row[i]] : T(0);
}

template <class T>
__global__ void sigmoid_in_place_kernel(T* g, int64_t n) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x)
        g[i] = T(1.0 / (1.0 + exp(-double(g[i]))));
}

template <class T>
__global__ void scale_rows_by_kernel(const T* g, T* a, int64_t N, int64_t F) {
    each(N, F, [&](int64_t n, int64_t f) { a[n * F + f] *= g[n]; });
}

// A block per token: du[n] = (1 − g[n])·⟨dsa_n, sa_n⟩ (in double), then dsa_n ← g[n]·dsa_n
template <class T>
__global__ void shared_scale_backward_kernel(const T* g, const T* sa, T* dsa, T* du, int64_t N, int64_t F) {
    __shared__ double shared[kBlock / 32];
    for (int64_t n = blockIdx.x; n < N; n += gridDim.x) {
        double dot = 0;
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x) dot += double(dsa[n * F + f]) * double(sa[n * F + f]);
        dot = block_sum(dot, shared);
        if (threadIdx.x == 0) du[n] = T((1.0 - double(g[n])) * dot);
        for (int64_t f = threadIdx.x; f < F; f += blockDim.x) dsa[n * F + f] *= g[n];
    }
}

// A thread per token: −Σ_e p log p over p = s / Σ s, in double
template <class T>
__global__ void routing_entropy_kernel(RowsArg<const T> s, double* out) {
    for (int64_t n = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; n < s.rows; n += int64_t(gridDim.x) * blockDim.x) {
        const T* r = s.data + n * s.ld;
        double z = 0, h = 0;
        for (int64_t e = 0; e < s.cols; ++e) z += double(r[e]);
        for (int64_t e = 0; e < s.cols; ++e) {
            const double p = double(r[e]) / z;
            if (p > 0) h -= p * log(p);
        }
        out[n] = h;
    }
}

template <class T, class F>
cudaError_t with_act(bool situ_act, double beta, double linear_beta, F f) {
    if (situ_act) return f(situ<T>(beta, linear_beta));
    return f(SwiGlu<T>{});
}
}  // namespace

template <class T>
cudaError_t launch_moe_dispatch(RowsArg<const T> src, const int32_t* row, int64_t K, T* rows, cudaStream_t stream) {
    if (src.rows == 0 || src.cols == 0) return cudaSuccess;
    launch_kernel(dispatch_kernel<T>, rows_grid(src.rows * K, src.cols), kBlock, 0, stream, src, row, K, rows);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_moe_combine(
    const T* rows, const int32_t* row, int64_t K, RowsArg<T> dst, bool accumulate, cudaStream_t stream) {
    if (dst.rows == 0 || dst.cols == 0) return cudaSuccess;
    launch_kernel(combine_kernel<T>, rows_grid(dst.rows, dst.cols), kBlock, 0, stream, rows, row, K, dst, accumulate);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_moe_row_gate(
    const int32_t* row, const T* gates, int64_t pairs, T* row_gate, int64_t R, cudaStream_t stream) {
    cudaError_t err = cudaMemsetAsync(row_gate, 0, size_t(R) * sizeof(T), stream);
    if (err != cudaSuccess || pairs == 0) return err;
    launch_kernel(row_gate_kernel<T>, grid_for(pairs), kBlock, 0, stream, row, gates, pairs, row_gate);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_moe_gated_act(bool situ_act,
                                 double beta,
                                 double linear_beta,
                                 const T* h,
                                 const T* row_gate,
                                 T* a,
                                 int64_t R,
                                 int64_t F,
                                 cudaStream_t stream) {
    if (R == 0 || F == 0) return cudaSuccess;
    return with_act<T>(situ_act, beta, linear_beta, [&](auto act) {
        launch_kernel(gated_act_kernel<T, decltype(act)>, rows_grid(R, F), kBlock, 0, stream, act, h, row_gate, a, R,
                      F);
        return cudaGetLastError();
    });
}

template <class T>
cudaError_t launch_moe_gated_act_backward(bool situ_act,
                                          double beta,
                                          double linear_beta,
                                          const T* h,
                                          const T* da,
                                          const T* row_gate,
                                          T* dot,
                                          T* dh,
                                          int64_t R,
                                          int64_t F,
                                          cudaStream_t stream) {
    if (R == 0) return cudaSuccess;
    return with_act<T>(situ_act, beta, linear_beta, [&](auto act) {
        launch_kernel(gated_act_backward_kernel<T, decltype(act)>, grid_for(R, 1, 65535), kBlock, 0, stream, act, h, da,
                      row_gate, dot, dh, R, F);
        return cudaGetLastError();
    });
}

template <class T>
cudaError_t launch_moe_gate_grads(const int32_t* row, const T* dot, T* dg, int64_t pairs, cudaStream_t stream) {
    if (pairs == 0) return cudaSuccess;
    launch_kernel(gate_grads_kernel<T>, grid_for(pairs), kBlock, 0, stream, row, dot, dg, pairs);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_moe_shared_scale_forward(T* g, T* a, int64_t N, int64_t F, cudaStream_t stream) {
    if (N == 0) return cudaSuccess;
    launch_kernel(sigmoid_in_place_kernel<T>, grid_for(N), kBlock, 0, stream, g, N);
    if (F > 0) launch_kernel(scale_rows_by_kernel<T>, rows_grid(N, F), kBlock, 0, stream, g, a, N, F);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_moe_shared_scale_backward(
    const T* g, const T* a, T* da, T* du, int64_t N, int64_t F, cudaStream_t stream) {
    if (N == 0) return cudaSuccess;
    launch_kernel(shared_scale_backward_kernel<T>, grid_for(N, 1, 65535), kBlock, 0, stream, g, a, da, du, N, F);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_routing_entropy(RowsArg<const T> scores, double* out, cudaStream_t stream) {
    if (scores.rows == 0) return cudaSuccess;
    launch_kernel(routing_entropy_kernel<T>, grid_for(scores.rows), kBlock, 0, stream, scores, out);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                        \
    template cudaError_t launch_moe_dispatch<T>(RowsArg<const T>, const int32_t*, int64_t, T*, cudaStream_t);         \
    template cudaError_t launch_moe_combine<T>(const T*, const int32_t*, int64_t, RowsArg<T>, bool, cudaStream_t);    \
    template cudaError_t launch_moe_row_gate<T>(const int32_t*, const T*, int64_t, T*, int64_t, cudaStream_t);        \
    template cudaError_t launch_moe_gated_act<T>(bool, double, double, const T*, const T*, T*, int64_t, int64_t,      \
                                                 cudaStream_t);                                                       \
    template cudaError_t launch_moe_gated_act_backward<T>(bool, double, double, const T*, const T*, const T*, T*, T*, \
                                                          int64_t, int64_t, cudaStream_t);                            \
    template cudaError_t launch_moe_gate_grads<T>(const int32_t*, const T*, T*, int64_t, cudaStream_t);               \
    template cudaError_t launch_moe_shared_scale_forward<T>(T*, T*, int64_t, int64_t, cudaStream_t);                  \
    template cudaError_t launch_moe_shared_scale_backward<T>(const T*, const T*, T*, T*, int64_t, int64_t,            \
                                                             cudaStream_t);                                           \
    template cudaError_t launch_routing_entropy<T>(RowsArg<const T>, double*, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
