// Elementwise kernels on CUDA: the gated activations SwiGLU and SiTU-GLU (ops/swiglu.h, ops/situ_glu.h, the math
// of ops/cpu/glu_math.h), the KDA forget gate (ops/kda_gate.h), the linear layer's bias add and bias gradient,
// and the integer-id check the embedding and cross-entropy ops share.
#include "ops/cuda/glu_math.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T, class Act>
__global__ void glu_forward_kernel(Act act, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= g.cols) return;
    for (int64_t r = blockIdx.y; r < g.rows; r += gridDim.y)
        y.data[r * y.ld + c] = act.value(g.data[r * g.ld + c], u.data[r * u.ld + c]);
}

template <class T, class Act>
__global__ void glu_backward_kernel(
    Act act, RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= g.cols) return;
    for (int64_t r = blockIdx.y; r < g.rows; r += gridDim.y) {
        const T d = dy.data[r * dy.ld + c];
        T pg, pu;
        act.partials(g.data[r * g.ld + c], u.data[r * u.ld + c], pg, pu);
        dg.data[r * dg.ld + c] += d * pg;
        du.data[r * du.ld + c] += d * pu;
    }
}

template <class T, class Act>
cudaError_t glu_forward(Act act, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream) {
    if (g.rows == 0 || g.cols == 0) return cudaSuccess;
    launch_kernel(glu_forward_kernel<T, Act>, rows_grid(g.rows, g.cols), kBlock, 0, stream, act, g, u, y);
    return cudaGetLastError();
}

template <class T, class Act>
cudaError_t glu_backward(Act act,
                         RowsArg<const T> dy,
                         RowsArg<const T> g,
                         RowsArg<const T> u,
                         RowsArg<T> dg,
                         RowsArg<T> du,
                         cudaStream_t stream) {
    if (g.rows == 0 || g.cols == 0) return cudaSuccess;
    launch_kernel(glu_backward_kernel<T, Act>, rows_grid(g.rows, g.cols), kBlock, 0, stream, act, dy, g, u, dg, du);
    return cudaGetLastError();
}

// softplus(z) = z above PyTorch's threshold 20, in double below it (as the CPU computes it)
template <class T>
__device__ inline T softplus(T z) {
    return z > T(20) ? z : T(log1p(exp(double(z))));
}

// g[e] over e = (n·HV + i)·K + c
template <class T>
__global__ void kda_gate_forward_kernel(
    const T* f, const T* A_log, const T* bias, T* g, int64_t total, int64_t HV, int64_t K, T lb) {
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        const int64_t c = e % K, i = (e / K) % HV;
        const T a = T(exp(double(A_log[i])));
        const T z = f[e] + bias[i * K + c];
        g[e] = lb == T(0) ? -a * softplus(z) : lb * sigmoid(a * z);
    }
}

// ∂g/∂z·dg at element e, and its term of dA_log (the CPU's formulas, ops/cpu/kda_gate.cpp)
template <class T>
__device__ inline T kda_gate_dz(
    const T* f, const T* A_log, const T* bias, const T* dg, int64_t e, int64_t i, int64_t c, int64_t K, T lb, T* da) {
    const T a = T(exp(double(A_log[i])));
    const T z = f[e] + bias[i * K + c];
    if (lb == T(0)) {
        *da = dg[e] * (-a * softplus(z));
        return -a * sigmoid(z) * dg[e];
    }
    const T u = a * z, s = sigmoid(u);
    const T du = dg[e] * lb * s * (T(1) - s);
    *da = du * u;
    return a * du;
}

template <class T>
__global__ void kda_gate_df_kernel(
    const T* f, const T* A_log, const T* bias, const T* dg, T* df, int64_t total, int64_t HV, int64_t K, T lb) {
    for (int64_t e = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; e < total; e += int64_t(gridDim.x) * blockDim.x) {
        T da;
        df[e] += kda_gate_dz(f, A_log, bias, dg, e, (e / K) % HV, e % K, K, lb, &da);
    }
}

// ddt_bias and dA_log over tokens: row slabs of the [N, HV·K] terms (kernel_util.cuh), in double; then ddt_bias[i, c]
// += its slabs' sum, and dA_log[i] += the fixed-order block sum over head i's channels of theirs.
template <class T>
struct KdaGateParamTerm {
    const T *f, *A_log, *bias, *dg;
    int64_t HV, K;
    T lb;
    __device__ void operator()(int64_t n, int64_t col, double* acc) const {
        const int64_t i = col / K, c = col % K;
        T da;
        acc[0] += double(kda_gate_dz(f, A_log, bias, dg, (n * HV + i) * K + c, i, c, K, lb, &da));
        acc[1] += double(da);
    }
};
template <class T>
__global__ void kda_gate_dA_kernel(int64_t K, int64_t HV, int64_t slabs, const double* da, T* dA_log) {
    __shared__ double shared[kBlock / 32];
    const int64_t i = blockIdx.x;
    double v = 0.0;
    for (int64_t c = threadIdx.x; c < K; c += blockDim.x)
        for (int64_t sl = 0; sl < slabs; ++sl) v += da[sl * HV * K + i * K + c];
    v = block_sum(v, shared);
    if (threadIdx.x == 0) dA_log[i] += T(v);
}
}  // namespace

template <class T>
cudaError_t launch_swiglu_forward(RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream) {
    return glu_forward(SwiGlu<T>{}, g, u, y, stream);
}

template <class T>
cudaError_t launch_swiglu_backward(
    RowsArg<const T> dy, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> dg, RowsArg<T> du, cudaStream_t stream) {
    return glu_backward(SwiGlu<T>{}, dy, g, u, dg, du, stream);
}

template <class T>
cudaError_t launch_situ_glu_forward(
    double beta, double linear_beta, RowsArg<const T> g, RowsArg<const T> u, RowsArg<T> y, cudaStream_t stream) {
    return glu_forward(situ<T>(beta, linear_beta), g, u, y, stream);
}

template <class T>
cudaError_t launch_situ_glu_backward(double beta,
                                     double linear_beta,
                                     RowsArg<const T> dy,
                                     RowsArg<const T> g,
                                     RowsArg<const T> u,
                                     RowsArg<T> dg,
                                     RowsArg<T> du,
                                     cudaStream_t stream) {
    return glu_backward(situ<T>(beta, linear_beta), dy, g, u, dg, du, stream);
}

template <class T>
cudaError_t launch_kda_gate_forward(const T* f,
                                    const T* A_log,
                                    const T* dt_bias,
                                    T* g,
                                    int64_t N,
                                    int64_t HV,
                                    int64_t K,
                                    double lower_bound,
                                    cudaStream_t stream) {
    const int64_t total = N * HV * K;
    if (total == 0) return cudaSuccess;
    launch_kernel(kda_gate_forward_kernel<T>, grid_for(total), kBlock, 0, stream, f, A_log, dt_bias, g, total, HV, K,
                  T(lower_bound));
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_kda_gate_backward(const T* dg,
                                     const T* f,
                                     const T* A_log,
                                     const T* dt_bias,
                                     T* df,
                                     T* dA_log,
                                     T* ddt_bias,
                                     int64_t N,
                                     int64_t HV,
                                     int64_t K,
                                     double lower_bound,
                                     double* slabs_work,
                                     cudaStream_t stream) {
    const int64_t total = N * HV * K;
    if (total == 0) return cudaSuccess;
    const T lb = T(lower_bound);
    if (df)
        launch_kernel(kda_gate_df_kernel<T>, grid_for(total), kBlock, 0, stream, f, A_log, dt_bias, dg, df, total, HV,
                      K, lb);
    if (dA_log || ddt_bias) {
        const int64_t cols = HV * K, slabs = column_slabs(N);
        launch_column_slabs<double, 2>(N, cols, KdaGateParamTerm<T>{f, A_log, dt_bias, dg, HV, K, lb}, slabs_work,
                                       stream);
        if (ddt_bias)
            launch_kernel(slab_totals_kernel<double, AddTo<T>>, grid_for(cols), kBlock, 0, stream, cols, slabs,
                          static_cast<const double*>(slabs_work), AddTo<T>{ddt_bias});
        if (dA_log)
            launch_kernel(kda_gate_dA_kernel<T>, unsigned(HV), kBlock, 0, stream, K, HV, slabs,
                          static_cast<const double*>(slabs_work + slabs * cols), dA_log);
    }
    return cudaGetLastError();
}

namespace {
template <class T>
__global__ void add_bias_kernel(RowsArg<T> y, const T* b) {
    const int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x;
    if (c >= y.cols) return;
    for (int64_t r = blockIdx.y; r < y.rows; r += gridDim.y) y.data[r * y.ld + c] += b[c];
}

template <class T>
struct ColumnOf {
    RowsArg<const T> dy;
    __device__ void operator()(int64_t n, int64_t c, T* acc) const { acc[0] += dy.data[n * dy.ld + c]; }
};

__global__ void check_ids_kernel(const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad) {
    for (int64_t i = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; i < n; i += int64_t(gridDim.x) * blockDim.x) {
        const int64_t id = load_id(ids, ids32, i);
        if (id != except && (id < 0 || id >= limit))
            atomicMin(reinterpret_cast<unsigned long long*>(bad), static_cast<unsigned long long>(i));
    }
}
}  // namespace

template <class T>
cudaError_t launch_add_bias(RowsArg<T> y, const T* b, cudaStream_t stream) {
    if (y.rows == 0 || y.cols == 0) return cudaSuccess;
    launch_kernel(add_bias_kernel<T>, rows_grid(y.rows, y.cols), kBlock, 0, stream, y, b);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_column_sums(RowsArg<const T> dy, T* db, T* slabs, cudaStream_t stream) {
    column_sums_in_slabs<T, 1>(dy.rows, dy.cols, ColumnOf<T>{dy}, slabs, {db}, stream);
    return cudaGetLastError();
}

cudaError_t launch_check_ids(
    const void* ids, bool ids32, int64_t n, int64_t limit, int64_t except, int64_t* bad, cudaStream_t stream) {
    if (n == 0) return cudaSuccess;
    launch_kernel(check_ids_kernel, grid_for(n), kBlock, 0, stream, ids, ids32, n, limit, except, bad);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                       \
    template cudaError_t launch_swiglu_forward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<T>, cudaStream_t);     \
    template cudaError_t launch_swiglu_backward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<const T>, RowsArg<T>, \
                                                   RowsArg<T>, cudaStream_t);                                        \
    template cudaError_t launch_add_bias<T>(RowsArg<T>, const T*, cudaStream_t);                                     \
    template cudaError_t launch_column_sums<T>(RowsArg<const T>, T*, T*, cudaStream_t);                              \
    template cudaError_t launch_situ_glu_forward<T>(double, double, RowsArg<const T>, RowsArg<const T>, RowsArg<T>,  \
                                                    cudaStream_t);                                                   \
    template cudaError_t launch_situ_glu_backward<T>(double, double, RowsArg<const T>, RowsArg<const T>,             \
                                                     RowsArg<const T>, RowsArg<T>, RowsArg<T>, cudaStream_t);        \
    template cudaError_t launch_kda_gate_forward<T>(const T*, const T*, const T*, T*, int64_t, int64_t, int64_t,     \
                                                    double, cudaStream_t);                                           \
    template cudaError_t launch_kda_gate_backward<T>(const T*, const T*, const T*, const T*, T*, T*, T*, int64_t,    \
                                                     int64_t, int64_t, double, double*, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
