// RMSNorm on CUDA, in the CPU oracle's order of operations (ops/cpu/rmsnorm.cpp): the row statistics in
// double, y = x·rstd·w, dx += rstd·(g − x̂·mean(g∘x̂)), dw summed over rows in row order.
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

template <class T>
__global__ void rmsnorm_dw_kernel(RowsArg<const T> dy, RowsArg<const T> x, const T* rstd, T* dw) {
    for (int64_t c = blockIdx.x * int64_t(blockDim.x) + threadIdx.x; c < x.cols; c += int64_t(gridDim.x) * blockDim.x) {
        T acc = dw[c];
        for (int64_t n = 0; n < x.rows; ++n) acc += dy.data[n * dy.ld + c] * x.data[n * x.ld + c] * rstd[n];
        dw[c] = acc;
    }
}
}  // namespace

template <class T>
cudaError_t launch_rmsnorm_forward(
    RowsArg<const T> x, const T* w, RowsArg<T> y, T* rstd, double eps, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    rmsnorm_forward_kernel<T><<<unsigned(x.rows), kBlock, 0, stream>>>(x, w, y, rstd, eps);
    return cudaGetLastError();
}

template <class T>
cudaError_t launch_rmsnorm_backward(
    RowsArg<const T> dy, RowsArg<const T> x, const T* w, const T* rstd, RowsArg<T> dx, T* dw, cudaStream_t stream) {
    if (x.rows == 0) return cudaSuccess;
    if (dx.data) rmsnorm_dx_kernel<T><<<unsigned(x.rows), kBlock, 0, stream>>>(dy, x, w, rstd, dx);
    if (dw) rmsnorm_dw_kernel<T><<<grid_for(x.cols), kBlock, 0, stream>>>(dy, x, rstd, dw);
    return cudaGetLastError();
}

#define TESSERA_INSTANTIATE(T)                                                                                        \
    template cudaError_t launch_rmsnorm_forward<T>(RowsArg<const T>, const T*, RowsArg<T>, T*, double, cudaStream_t); \
    template cudaError_t launch_rmsnorm_backward<T>(RowsArg<const T>, RowsArg<const T>, const T*, const T*,           \
                                                    RowsArg<T>, T*, cudaStream_t);
TESSERA_INSTANTIATE(float)
TESSERA_INSTANTIATE(double)
#undef TESSERA_INSTANTIATE

}  // namespace tessera::ops::cuda
