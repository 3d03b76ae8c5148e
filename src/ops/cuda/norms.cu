// The row norms on CUDA in the CPU oracle's order of operations (ops/cpu/rmsnorm.cpp, layernorm.cpp, l2norm.cpp,
// gated_rmsnorm.cpp): one block per row, the row statistics in double reduced in a fixed order; the weight (and
// bias) gradients summed over slabs of rows, then the slabs in order (kernel_util.cuh: column_sums_in_slabs).
#include "ops/cuda/kernel_util.cuh"
#include "ops/cuda/launchers.h"

namespace tessera::ops::cuda {

namespace {
template <class T>
__global__ void rmsnorm_forward_kernel(RowsArg<const T> x, const T* w, RowsArg<T> y, T* rstd, double eps) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T* xr = x.data + n * x.ld;
    double ss = 0.0;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) ss += double(xr[d]) * double(xr[d]);
    ss = block_sum(ss, shared);
    const T r = T(1.0 / sqrt(ss / double(x.cols) + eps));
    if (threadIdx.x == 0) rstd[n] = r;
    T* yr = y.data + n * y.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) yr[d] = xr[d] * r * w[d];
}

template <class T>
__global__ void rmsnorm_dx_kernel(RowsArg<const T> dy, RowsArg<const T> x, const T* w, const T* rstd, RowsArg<T> dx) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T *xr = x.data + n * x.ld, *dyr = dy.data + n * dy.ld;
    const T r = rstd[n];
    double dot = 0.0;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) dot += double(dyr[d] * w[d]) * double(xr[d] * r);
    dot = block_sum(dot, shared);
    const T mean = T(dot / double(x.cols));
    T* dxr = dx.data + n * dx.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) dxr[d] += r * (dyr[d] * w[d] - xr[d] * r * mean);
}

// dw's term of row n, column c: dy·x·rstd
template <class T>
struct RmsNormDw {
    RowsArg<const T> dy, x;
    const T* rstd;
    __device__ void operator()(int64_t n, int64_t c, T* acc) const {
        acc[0] += dy.data[n * dy.ld + c] * x.data[n * x.ld + c] * rstd[n];
    }
};
template <class T>
__global__ void layernorm_forward_kernel(
    RowsArg<const T> x, const T* w, const T* b, RowsArg<T> y, T* mean, T* rstd, double eps) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T* xr = x.data + n * x.ld;
    double s = 0.0;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) s += double(xr[d]);
    const double mu = block_sum(s, shared) / double(x.cols);
    double ss = 0.0;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) ss += (double(xr[d]) - mu) * (double(xr[d]) - mu);
    ss = block_sum(ss, shared);
    const T m = T(mu), r = T(1.0 / sqrt(ss / double(x.cols) + eps));
    if (threadIdx.x == 0) {
        mean[n] = m;
        rstd[n] = r;
    }
    T* yr = y.data + n * y.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) yr[d] = (xr[d] - m) * r * w[d] + b[d];
}

template <class T>
__global__ void layernorm_dx_kernel(
    RowsArg<const T> dy, RowsArg<const T> x, const T* w, const T* mean, const T* rstd, RowsArg<T> dx) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T *xr = x.data + n * x.ld, *dyr = dy.data + n * dy.ld;
    const T m = mean[n], r = rstd[n];
    double sg = 0.0, sgx = 0.0;  // Σ g, Σ g∘x̂
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) {
        const double g = double(dyr[d]) * double(w[d]);
        sg += g;
        sgx += g * (double(xr[d]) - double(m)) * double(r);
    }
    sg = block_sum(sg, shared);
    sgx = block_sum(sgx, shared);
    const T mg = T(sg / double(x.cols)), mgx = T(sgx / double(x.cols));
    T* dxr = dx.data + n * dx.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x)
        dxr[d] += r * (dyr[d] * w[d] - mg - (xr[d] - m) * r * mgx);
}

// dw's and db's terms of row n, column c: dy·x̂ and dy
template <class T>
struct LayerNormDwb {
    RowsArg<const T> dy, x;
    const T *mean, *rstd;
    __device__ void operator()(int64_t n, int64_t c, T* acc) const {
        const T g = dy.data[n * dy.ld + c];
        acc[0] += g * (x.data[n * x.ld + c] - mean[n]) * rstd[n];
        acc[1] += g;
    }
};

// ρ = (Σ x² + eps)^-1/2 of the block's row; every thread gets it
template <class T>
__device__ T l2_rho(const T* xr, int64_t cols, double eps, double* shared) {
    double ss = 0.0;
    for (int64_t d = threadIdx.x; d < cols; d += blockDim.x) ss += double(xr[d]) * double(xr[d]);
    return T(1.0 / sqrt(block_sum(ss, shared) + eps));
}

template <class T>
__global__ void l2norm_forward_kernel(RowsArg<const T> x, RowsArg<T> y, double eps) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T* xr = x.data + n * x.ld;
    const T rho = l2_rho(xr, x.cols, eps, shared);
    T* yr = y.data + n * y.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) yr[d] = xr[d] * rho;
}

template <class T>
__global__ void l2norm_backward_kernel(RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx, double eps) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T *xr = x.data + n * x.ld, *g = dy.data + n * dy.ld;
    const T rho = l2_rho(xr, x.cols, eps, shared);
    double ydy = 0.0;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) ydy += double(xr[d] * rho * g[d]);
    const T yg = T(block_sum(ydy, shared));
    T* dxr = dx.data + n * dx.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) dxr[d] += rho * (g[d] - xr[d] * rho * yg);
}

// act(z) and act'(z) of the gated norm: σ (KDA) or silu (GDN)
template <class T>
__device__ inline T gate_act(bool silu, T z) {
    const T s = sigmoid(z);
    return silu ? z * s : s;
}
template <class T>
__device__ inline T gate_act_grad(bool silu, T z) {
    const T s = sigmoid(z);
    return silu ? s * (T(1) + z * (T(1) - s)) : s * (T(1) - s);
}

// 1 / sqrt(mean(x²) + eps) of the block's row; every thread gets it
template <class T>
__device__ T rms_rstd(const T* xr, int64_t cols, double eps, double* shared) {
    double ss = 0.0;
    for (int64_t d = threadIdx.x; d < cols; d += blockDim.x) ss += double(xr[d]) * double(xr[d]);
    return T(1.0 / sqrt(block_sum(ss, shared) / double(cols) + eps));
}

template <class T>
__global__ void gated_rmsnorm_forward_kernel(
    RowsArg<const T> x, RowsArg<const T> z, const T* w, RowsArg<T> y, double eps, bool silu) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T *xr = x.data + n * x.ld, *zr = z.data + n * z.ld;
    const T r = rms_rstd(xr, x.cols, eps, shared);
    T* yr = y.data + n * y.ld;
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) yr[d] = xr[d] * r * w[d] * gate_act(silu, zr[d]);
}

// dx and dz (either may be absent), and each row's rstd into rstd_out for the weight-gradient kernel
template <class T>
__global__ void gated_rmsnorm_rows_kernel(RowsArg<const T> dy,
                                          RowsArg<const T> x,
                                          RowsArg<const T> z,
                                          const T* w,
                                          RowsArg<T> dx,
                                          RowsArg<T> dz,
                                          T* rstd_out,
                                          double eps,
                                          bool silu) {
    __shared__ double shared[kBlock / 32];
    const int64_t n = blockIdx.x;
    const T *xr = x.data + n * x.ld, *zr = z.data + n * z.ld, *g = dy.data + n * dy.ld;
    const T r = rms_rstd(xr, x.cols, eps, shared);
    if (threadIdx.x == 0) rstd_out[n] = r;
    if (!dx.data && !dz.data) return;
    double dot = 0.0;  // Σ dn·n with dn = dy·w·act(z), n = x·r
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x)
        dot += double(g[d] * w[d] * gate_act(silu, zr[d]) * xr[d] * r);
    const T mean = T(block_sum(dot, shared) / double(x.cols));
    for (int64_t d = threadIdx.x; d < x.cols; d += blockDim.x) {
        const T nc = xr[d] * r;
        if (dx.data) dx.data[n * dx.ld + d] += r * (g[d] * w[d] * gate_act(silu, zr[d]) - nc * mean);
        if (dz.data) dz.data[n * dz.ld + d] += g[d] * nc * w[d] * gate_act_grad(silu, zr[d]);
    }
}

// dw's term of row n, column c: dy·x·rstd·act(z)
template <class T>
struct GatedRmsNormDw {
    RowsArg<const T> dy, x, z;
    const T* rstd;
    bool silu;
    __device__ void operator()(int64_t n, int64_t c, T* acc) const {
        acc[0] += dy.data[n * dy.ld + c] * x.data[n * x.ld + c] * rstd[n] * gate_act(silu, z.data[n * z.ld + c]);
    }
};
}  // namespace

template <class T>
cudaError_t launch_rmsnorm_forward(
    RowsArg<const T> x, const T* w, RowsArg<T> y, T* rstd, double eps, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(rmsnorm_forward_kernel<T>, unsigned(x.rows), kBlock, 0, stream, x, w, y, rstd, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_rmsnorm_backward(RowsArg<const T> dy,
                                    RowsArg<const T> x,
                                    const T* w,
                                    const T* rstd,
                                    RowsArg<T> dx,
                                    T* dw,
                                    T* slabs,
                                    cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    if (dx.data) launch_kernel(rmsnorm_dx_kernel<T>, unsigned(x.rows), kBlock, 0, stream, dy, x, w, rstd, dx);
    if (dw) column_sums_in_slabs<T, 1>(x.rows, x.cols, RmsNormDw<T>{dy, x, rstd}, slabs, {dw}, stream);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_layernorm_forward(
    RowsArg<const T> x, const T* w, const T* b, RowsArg<T> y, T* mean, T* rstd, double eps, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(layernorm_forward_kernel<T>, unsigned(x.rows), kBlock, 0, stream, x, w, b, y, mean, rstd, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_layernorm_backward(RowsArg<const T> dy,
                                      RowsArg<const T> x,
                                      const T* w,
                                      const T* mean,
                                      const T* rstd,
                                      RowsArg<T> dx,
                                      T* dw,
                                      T* db,
                                      T* slabs,
                                      cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    if (dx.data) launch_kernel(layernorm_dx_kernel<T>, unsigned(x.rows), kBlock, 0, stream, dy, x, w, mean, rstd, dx);
    if (dw) column_sums_in_slabs<T, 2>(x.rows, x.cols, LayerNormDwb<T>{dy, x, mean, rstd}, slabs, {dw, db}, stream);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_l2norm_forward(RowsArg<const T> x, RowsArg<T> y, double eps, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(l2norm_forward_kernel<T>, unsigned(x.rows), kBlock, 0, stream, x, y, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_l2norm_backward(
    RowsArg<const T> dy, RowsArg<const T> x, RowsArg<T> dx, double eps, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(l2norm_backward_kernel<T>, unsigned(x.rows), kBlock, 0, stream, dy, x, dx, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_gated_rmsnorm_forward(
    RowsArg<const T> x, RowsArg<const T> z, const T* w, RowsArg<T> y, double eps, bool silu, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(gated_rmsnorm_forward_kernel<T>, unsigned(x.rows), kBlock, 0, stream, x, z, w, y, eps, silu);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_gated_rmsnorm_backward(RowsArg<const T> dy,
                                          RowsArg<const T> x,
                                          RowsArg<const T> z,
                                          const T* w,
                                          RowsArg<T> dx,
                                          RowsArg<T> dz,
                                          T* dw,
                                          T* rstd_work,
                                          T* slabs,
                                          double eps,
                                          bool silu,
                                          cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    launch_kernel(gated_rmsnorm_rows_kernel<T>, unsigned(x.rows), kBlock, 0, stream, dy, x, z, w, dx, dz, rstd_work,
                  eps, silu);
    if (dw)
        column_sums_in_slabs<T, 1>(x.rows, x.cols, GatedRmsNormDw<T>{dy, x, z, rstd_work, silu}, slabs, {dw}, stream);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                         \
    template cudaError_t launch_rmsnorm_forward<T>(RowsArg<const T>, const T*, RowsArg<T>, T*, double, cudaStream_t);  \
    template cudaError_t launch_rmsnorm_backward<T>(RowsArg<const T>, RowsArg<const T>, const T*, const T*,            \
                                                    RowsArg<T>, T*, T*, cudaStream_t);                                 \
    template cudaError_t launch_layernorm_forward<T>(RowsArg<const T>, const T*, const T*, RowsArg<T>, T*, T*, double, \
                                                     cudaStream_t);                                                    \
    template cudaError_t launch_layernorm_backward<T>(RowsArg<const T>, RowsArg<const T>, const T*, const T*,          \
                                                      const T*, RowsArg<T>, T*, T*, T*, cudaStream_t);                 \
    template cudaError_t launch_l2norm_forward<T>(RowsArg<const T>, RowsArg<T>, double, cudaStream_t);                 \
    template cudaError_t launch_l2norm_backward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<T>, double,             \
                                                   cudaStream_t);                                                      \
    template cudaError_t launch_gated_rmsnorm_forward<T>(RowsArg<const T>, RowsArg<const T>, const T*, RowsArg<T>,     \
                                                         double, bool, cudaStream_t);                                  \
    template cudaError_t launch_gated_rmsnorm_backward<T>(RowsArg<const T>, RowsArg<const T>, RowsArg<const T>,        \
                                                          const T*, RowsArg<T>, RowsArg<T>, T*, T*, T*, double, bool,  \
                                                          cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
